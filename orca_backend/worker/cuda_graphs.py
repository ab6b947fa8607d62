"""CUDA graphs for decode-only steps: the steady state of a serving engine, replayed instead of
launched op by op.

A decode step of a small batch does about a millisecond of GPU work and, launched from Python, ten
times that of host work: a kernel launch, a GEMM dispatch and an allocation per op and layer. A
CUDA graph records the step's launches once and replays them with one call, so that host cost
disappears, on one condition: every replay must make exactly the launches the capture made, with
the same grids, shapes and pointers; only the values in the buffers may differ.

So a decode step here runs on static buffers. Batch sizes are padded up to a capture size (1, 2, 4,
8, ... up to max_num_seqs, and max_num_seqs itself), and each size has its own graph, captured at
load, largest first, all in one memory pool. Before a replay the live batch is copied into the
first rows of the buffers and the rest are padding: token 0 at position 0, K/V slot -1 (the K/V
write skips it) and context length 0 (attention reads no K/V for it and gives zeros). Everything a
kernel needs that varies inside a bucket comes from those device buffers, never from a Python
scalar: the metadata's host integers are the bucket's (its size, a query length of 1, the model's
whole context as the longest). The logits of the live rows are read out of the graph's output;
the grammar masks and sampling run outside the graph, as they do eagerly.

On a CPU there is nothing to capture, but the same object runs the same static-buffer forward
eagerly (`capture=False`): that is how CI checks, without a GPU, that two batches of one bucket make
identical launches and give the eager path's tokens (tests/worker/test_cuda_graphs.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np
import torch

from orca_backend.model.stage_input import StageInput
from orca_backend.worker.input_batch import StepInputs
from orca_kernels import AttentionMetadata

logger = logging.getLogger("orca.worker")

PAD_SLOT = -1  # the K/V slot of a padded row: the write skips it

# (stage input, attention metadata, logits indices) -> logits [B, vocab]
Forward = Callable[[StageInput, AttentionMetadata, torch.Tensor], torch.Tensor]

# How a step's forward ran (`SamplerOutput.step_path`, counted in `orca_model_steps_total{path}` and
# written in the iteration log): its graph replayed, or why it ran eagerly. The first group is the
# runner's (no step replays a graph), the last three the step's own.
GRAPH_REPLAYED = "cuda_graph"
EAGER_REASONS = {
    "enforce_eager": "enforce_eager is set",
    "no_cuda_device": "CUDA graphs need a CUDA device",
    "parallel": "CUDA graphs are captured for tensor_parallel_size = pipeline_parallel_size = 1 only",
    "lora": "enable_lora: the adapters' token mapping is not part of the graphs' static buffers",
    "torch_kernels": "kernels='torch': the torch reference kernels read values back to the host, which a "
                     "graph cannot capture",
    "mixed_step": "the step runs prompt tokens (only decode-only steps are graphed)",
    "batch_above_buckets": "more decodes than the largest captured batch size (max_num_seqs)",
    "static_buffers": "decode-only, on the graphs' static buffers, not captured (the CPU tests' path)",
}


def runner_eager_reason(enforce_eager: bool, device: torch.device, parallel: bool, lora: bool, kernels: str) -> str:
    """Why no step of a runner can replay a graph (an EAGER_REASONS key), or "" when decode steps can."""
    if enforce_eager:
        return "enforce_eager"
    if device.type != "cuda":
        return "no_cuda_device"
    if parallel:
        return "parallel"
    if lora:
        return "lora"
    if kernels == "torch":
        return "torch_kernels"
    return ""


class GraphCaptureError(RuntimeError):
    """Capturing one batch size's graph failed (the exception it raised is the cause)."""

    def __init__(self, size: int, cause: BaseException) -> None:
        super().__init__(f"capturing the CUDA graph of decode steps of batch size {size} failed: "
                         f"{type(cause).__name__}: {cause}")  # fmt: skip


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a graph is captured for: powers of two below max_num_seqs, and max_num_seqs."""
    sizes, size = [], 1
    while size < max_num_seqs:
        sizes.append(size)
        size *= 2
    return [*sizes, max_num_seqs]


class DecodeGraphs:
    """The static buffers of decode-only steps up to `max(sizes)` requests, and on CUDA one captured
    graph per size. `run` takes a decode-only step's inputs and returns its logits."""

    def __init__(
        self, forward: Forward, sizes: list[int], max_blocks: int, block_size: int, device: torch.device,
    ) -> None:  # fmt: skip
        self.forward = forward
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.block_size = block_size
        self.max_context = max_blocks * block_size  # the longest context a row's table can hold
        self.device = device
        n = self.max_size
        # Device buffers a graph reads: (token ids, positions, K/V slots), context lengths, block tables.
        # The query starts and logits indices of a decode step are 0, 1, 2, ...: written once.
        self.tokens = torch.zeros((3, n), dtype=torch.int64, device=device)
        self.context_lens = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((n, max_blocks), dtype=torch.int32, device=device)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = self.query_start[:n]  # each row's one token is its last
        # The host side the live batch is written into: the device buffers themselves on a CPU, pinned
        # copies on CUDA, each moved by one asynchronous copy from contiguous pinned memory (a strided
        # source would go through a pageable, synchronous copy), guarded by an event. The tokens and
        # context lengths are small and go whole; the block tables go as the batch's [count, width]
        # packed (a row holds every block of the longest context).
        cuda = device.type == "cuda"
        self._host_tokens, self._host_context_lens = (
            (torch.zeros_like(t, device="cpu", pin_memory=True) if cuda else t).numpy()
            for t in (self.tokens, self.context_lens)
        )
        self._host_tables = self.block_tables.numpy() if not cuda else \
            torch.zeros(self.block_tables.numel(), dtype=torch.int32, pin_memory=True).numpy()  # fmt: skip
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each graph's logits [size, vocab]
        self.graph_bytes = 0

    def bucket(self, num_requests: int) -> int:
        """The capture size a batch of `num_requests` is padded to."""
        return next(size for size in self.sizes if size >= num_requests)

    def eager_reason(self, inputs: StepInputs) -> str:
        """Why this step cannot run on the static buffers (an EAGER_REASONS key), "" when it can: it
        must be decode-only (one new token per request) and small enough for a bucket."""
        if inputs.max_query_len != 1 or inputs.num_tokens != inputs.num_requests:
            return "mixed_step"
        if inputs.num_requests > self.max_size:
            return "batch_above_buckets"
        return ""

    def path(self, inputs: StepInputs) -> str:
        """How `run` runs a step that fits: its bucket's graph replayed, or the static buffers eagerly."""
        return GRAPH_REPLAYED if self.bucket(inputs.num_requests) in self.graphs else "static_buffers"

    def run(self, inputs: StepInputs, ahead: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """The logits [B, vocab] of a decode-only step (no `eager_reason`): its graph replayed on CUDA, the same
        static-buffer forward run eagerly elsewhere. On CUDA the view is valid until the next run.
        `ahead` (async scheduling): (token positions, ids) written over the input tokens on the device."""
        num_requests = inputs.num_requests
        size = self.load(inputs)
        if ahead is not None:
            self.tokens[0].index_copy_(0, *ahead)
        graph = self.graphs.get(size)
        if graph is None:
            return self.forward(*self.views(size))[:num_requests]
        graph.replay()
        return self.outputs[size][:num_requests]

    def load(self, inputs: StepInputs) -> int:
        """Writes the live batch into the first rows of the static buffers and padding after it, up to
        its bucket; returns the bucket."""
        count, size = inputs.num_requests, self.bucket(inputs.num_requests)
        self._wait_for_copies()
        self._host_tokens[:, :count] = inputs.flat64.reshape(3, count)
        self._host_context_lens[:count] = inputs.context_lens
        width = inputs.block_tables.shape[1]
        self._tables(count, width)[:] = inputs.block_tables  # entries past a row's context are never read
        self._pad(count, size)
        self._upload(count, width)
        return size

    def _tables(self, count: int, width: int) -> np.ndarray:
        """Where the batch's block tables are written on the host: the device buffer's rows on a CPU,
        the pinned staging packed as [count, width] on CUDA."""
        if self.device.type != "cuda":
            return self._host_tables[:count, :width]
        return self._host_tables[: count * width].reshape(count, width)

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are not rewritten while a copy reads them

    def _pad(self, start: int, stop: int) -> None:
        """Rows [start, stop) become padding: token 0 at position 0, no K/V slot, no context."""
        self._host_tokens[:2, start:stop] = 0
        self._host_tokens[2, start:stop] = PAD_SLOT
        self._host_context_lens[start:stop] = 0

    def _upload(self, count: int, width: int) -> None:
        """CUDA: the host buffers into the device buffers, one asynchronous copy each (the rows past a
        bucket go too, unread: a whole small buffer is one copy, a slice of it a strided one)."""
        if self.device.type != "cuda":
            return  # the host buffers are the device's
        self.tokens.copy_(torch.from_numpy(self._host_tokens), non_blocking=True)
        self.context_lens.copy_(torch.from_numpy(self._host_context_lens), non_blocking=True)
        if count and width:
            self.block_tables[:count, :width].copy_(torch.from_numpy(self._tables(count, width)), non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def views(self, size: int) -> tuple[StageInput, AttentionMetadata, torch.Tensor]:
        """The forward's arguments for a bucket: views of the static buffers, and metadata whose host
        integers are the bucket's alone. A new metadata object each call: it caches what it derives."""
        input_ids, positions, slot_mapping = self.tokens[:, :size].unbind(0)
        meta = AttentionMetadata(
            query_start=self.query_start[: size + 1],
            context_lens=self.context_lens[:size],
            block_tables=self.block_tables[:size],
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            max_query_len=1,
            max_context_len=self.max_context,
            num_requests=size,
        )
        return StageInput(input_ids, positions, None), meta, self.logits_indices[:size]

    @torch.inference_mode()
    def capture(self) -> None:
        """Captures one graph per size, largest first, in one memory pool (a smaller graph's
        temporaries fit in what the larger ones left), each after an eager warm-up run of its size
        (Triton compiles its kernels, cuBLAS picks its algorithms). CUDA only."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs are captured on a CUDA device, not {self.device}")
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        pool = None
        stream = torch.cuda.Stream(self.device)  # capture needs a stream other than the default one
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                try:
                    self._wait_for_copies()
                    self._pad(0, size)  # capture runs on padding: nothing is written, nothing is read
                    self._upload(0, 0)
                    self.forward(*self.views(size))  # warm-up
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        self.outputs[size] = self.forward(*self.views(size))
                except Exception as e:
                    raise GraphCaptureError(size, e) from e
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.graph_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        logger.info("captured %d CUDA graphs for decode steps of %s requests in %.1f s, using %.0f MiB",
                    len(self.graphs), self.sizes, time.perf_counter() - started, self.graph_bytes / 2**20)  # fmt: skip
