"""CUDA graphs for every step of one GPU: decode-only steps per batch size, steps that run prompt
tokens (prefill, or prefill and decodes mixed: ORCA's iteration-level batches) per token count.

A step of a small batch does about a millisecond of GPU work and, launched from Python, ten times
that of host work: a kernel launch, a GEMM dispatch and an allocation per op and layer (~300 Triton
launches for a mixed step of a 32-layer model, ~43 us each). A CUDA graph records the step's
launches once and replays them with one call, so that host cost disappears, on one condition:
every replay must make exactly the launches the capture made, with the same grids, shapes and
pointers; only the values in the buffers may differ.

So a graphed step runs on static buffers, padded up to a bucket, and each bucket has its own graph,
captured at load, largest first, all in one memory pool:

- Decode-only steps (`DecodeGraphs`): one query per request, padded to a batch size of 1, 2, 4, 8,
  ... below max_num_seqs, and max_num_seqs (`capture_sizes`). Their attention is the split-K decode
  kernel, whose grid comes from the batch size.
- Speculative decoding's verify steps (`VerifyGraphs`): room for 1 + k queries and as many logits
  rows per request, padded to a batch size as decode steps are (up to MAX_VERIFY_BATCH); requests
  that verify fewer than k proposals, or none, run their own tokens there. A verify step beside a
  prompt chunk of more than 1 + k tokens goes to the mixed graphs, whose buckets hold the verify
  rows of up to MAX_VERIFY_BATCH requests beside one logits row per request.
- A proposer's passes (worker/draft_proposer.py, eagle_proposer.py): its own `MixedGraphs` (a
  draft's first pass of a round, an EAGLE head's pass over what a step kept) and `DecodeGraphs`
  (the one-token passes), over its own forward, in the same pool.
- Every other step (`MixedGraphs`, which also return every token's final hidden states: embedding
  requests pool some of them): padded to a token count of 16, 32, 64, ... below the largest,
  and the largest: max_num_batched_tokens, or `DEFAULT_MAX_GRAPH_TOKENS` when that is unset
  (`mixed_capture_sizes`; 8 sizes at most from 16 to 2048, so capture time and the pool, sized by
  the largest, are bounded). A bucket of T tokens holds min(T, max_num_seqs) + 1 requests (every
  live request has a token, and one more is the padding's) and a query length of T; its attention
  is the ragged kernel, whose grid is sized from those three integers (an upper bound on the query
  blocks: the programs past the step's real blocks exit at once) and whose query-block table is
  built on the device from the static query starts. A step with more tokens than the largest
  bucket runs eagerly, and says so ("tokens_above_buckets").

Whole graphs per token count, not vLLM's piecewise capture (graphs between the attention calls,
attention launched eagerly): our attention launches read nothing back to the host and are sized by
plain integers, so the bucket's integers make them capturable as they are, and a piecewise step
would still launch two or three attention kernels per layer from Python (the K/V write, rotary and
attention: ~100 launches, ~4 ms of host time for 32 layers), four times the ~1 ms a mixed step may
cost the host. The price is padding: up to twice a step's tokens through the GEMMs (their cost
barely moves below a few hundred tokens), and programs for the padding request that exit at once.

Padding. Before a replay the live step is copied into the first tokens and requests of the buffers
and the rest are padding: token 0 at position 0 with K/V slot -1 (every K/V write skips it), owned
by padding requests of context length 0 (attention reads no K/V for them and gives zeros). The
padding requests take the padding tokens max_query_len at a time: in a decode bucket one each, in a
mixed bucket the first takes them all and the others none. Everything a kernel needs that varies
inside a bucket comes from those device buffers, never from a Python scalar: the metadata's host
integers are the bucket's (its token and request counts, its query length, the model's whole
context as the longest), never the step's. The logits of the live requests are read out of one
output buffer every graph of the object writes (so the graphs' memory is one pool plus one
[max requests, vocab] buffer); the grammar masks and sampling run outside the graph, as they do
eagerly.

LoRA (enable_lora): each token's adapter slot, and the tokens sorted by slot with each slot's start
and count, are one more static buffer (padding tokens have no slot). A graph's `LoRAMetadata` has
no host copies, so the model launches the adapter kernels of every projection an adapter may target
whatever the step's adapters (model/lora.py), and the kernels' grids come from the bucket's token
count and the slot count (kernels/orca_kernels/triton_lora.py): a step with two adapters, one or
none replays the same graph.

Tensor parallelism (tensor_parallel_size > 1, one GPU per rank): every rank captures the same
buckets in the same order at load, each graph holding that rank's NCCL collectives (the
row-parallel all-reduces, the vocabulary's all-gather). NCCL (2.9 on) lets a collective be
captured provided every rank of the communicator launches a graph of the same capture; every rank
takes the same `SchedulerOutput` and picks its bucket, or the eager path, from it alone, so they
do. torch's NCCL process group enqueues no watchdog work for a collective under capture, and its
watchdog queries events in thread-local capture mode, so the default capture mode serves. Pipeline
parallelism stays eager: a later stage's input arrives by a point-to-point receive outside any graph.

On a CPU there is nothing to capture, but the same objects run the same static-buffer forward
eagerly (`capture=False`): that is how CI checks, without a GPU, that steps of one bucket (and the
all-padding step a capture records) make identical launches, read nothing back to the host and give
the eager path's tokens (tests/worker/test_cuda_graphs.py, test_mixed_graphs.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from orca_backend.model.stage_input import StageInput
from orca_backend.worker.input_batch import StepInputs
from orca_kernels import AttentionMetadata
from orca_kernels.lora import LoRAMetadata, sort_by_slot

logger = logging.getLogger("orca.worker")

PAD_SLOT = -1  # the K/V slot of a padding token: the write skips it
DEFAULT_MAX_GRAPH_TOKENS = 2048  # the largest mixed bucket when max_num_batched_tokens is unset
MIN_GRAPH_TOKENS = 16  # the smallest mixed bucket: below it a GEMM costs the same

# (stage input, attention metadata, logits indices) -> logits [B, vocab], or (logits, hidden states)
# where a step returns its tokens' hidden states too (hidden_layers)
Forward = Callable[[StageInput, Sequence[AttentionMetadata], torch.Tensor], "torch.Tensor | tuple[torch.Tensor, torch.Tensor]"]

# How a step's forward ran (`SamplerOutput.step_path`, counted in `orca_model_steps_total{path}` and
# written in the iteration log): its graph replayed, or why it ran eagerly. The first group is the
# runner's (no step replays a graph), the last three the step's own.
GRAPH_REPLAYED = "cuda_graph"
EAGER_REASONS = {
    "enforce_eager": "enforce_eager is set",
    "no_cuda_device": "CUDA graphs need a CUDA device",
    "pipeline_parallel": "CUDA graphs are captured for pipeline_parallel_size = 1 only (a later stage's input "
                         "arrives by a point-to-point receive each step)",
    "torch_kernels": "kernels='torch': the torch reference kernels read values back to the host, which a "
                     "graph cannot capture",
    "tokens_above_buckets": "more tokens than the largest captured token count (max_num_batched_tokens, or "
                            f"{DEFAULT_MAX_GRAPH_TOKENS} when it is unset)",
    "batch_above_buckets": "more requests than the largest captured batch (max_num_seqs)",
    "static_buffers": "on the graphs' static buffers, not captured (the CPU tests' path)",
    "prompt_logprobs": "a request computes prompt logprobs (a logits row per prompt token; the graphs hold one "
                       "per request)",
    "speculative": "a step with more proposed tokens to verify (speculative decoding) than its graphs hold: the "
                   "verify graphs hold steps whose every request runs at most 1 + num_speculative_tokens tokens, "
                   "the mixed graphs min(max_num_seqs, 64) * num_speculative_tokens verify rows",
}


def runner_eager_reason(enforce_eager: bool, device: torch.device, pipeline_parallel: bool, kernels: str) -> str:
    """Why no step of a runner can replay a graph (an EAGER_REASONS key), or "" when steps can.
    Tensor parallelism is no reason: each rank captures its graphs, collectives included."""
    if enforce_eager:
        return "enforce_eager"
    if device.type != "cuda":
        return "no_cuda_device"
    if pipeline_parallel:
        return "pipeline_parallel"
    if kernels == "torch":
        return "torch_kernels"
    return ""


class GraphCaptureError(RuntimeError):
    """Capturing one bucket's graph failed (the exception it raised is the cause)."""

    def __init__(self, bucket: str, cause: BaseException) -> None:
        super().__init__(f"capturing the CUDA graph of {bucket} failed: {type(cause).__name__}: {cause}")


def capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a decode graph is captured for: powers of two below max_num_seqs, and max_num_seqs."""
    return _doubling(1, max_num_seqs)


def mixed_capture_sizes(max_num_batched_tokens: int) -> list[int]:
    """The token counts a mixed graph is captured for: powers of two from MIN_GRAPH_TOKENS below the
    largest, and the largest (max_num_batched_tokens; DEFAULT_MAX_GRAPH_TOKENS when it is 0, unset)."""
    return _doubling(MIN_GRAPH_TOKENS, max_num_batched_tokens or DEFAULT_MAX_GRAPH_TOKENS)


def _doubling(smallest: int, largest: int) -> list[int]:
    sizes, size = [], smallest
    while size < largest:
        sizes.append(size)
        size *= 2
    return [*sizes, largest]


def verify_capture_sizes(max_num_seqs: int) -> list[int]:
    """The batch sizes a verify graph is captured for: as decode's, up to MAX_VERIFY_BATCH (a verify
    graph's logits hold (1 + k) rows per request, and speculation pays at small batches)."""
    return _doubling(1, min(max_num_seqs, MAX_VERIFY_BATCH))


MAX_VERIFY_BATCH = 64


def is_decode_only(inputs: StepInputs) -> bool:
    """One new token per request: the steps of `DecodeGraphs` (and of the split-K decode kernel)."""
    return inputs.max_query_len == 1 and inputs.num_tokens == inputs.num_requests


class StepGraphs:
    """The static buffers of steps up to the largest bucket, and on CUDA one captured graph per
    bucket. `run` takes a step's inputs (one `eager_reason` finds nothing against) and returns its
    logits. The subclasses say what a bucket is sized by and how big it is."""

    def __init__(
        self, forward: Forward, sizes: list[int], max_blocks: int, block_size: int, device: torch.device,
        lora_slots: int = 0, hidden_layers: tuple[int, ...] | None = None, num_groups: int = 1,
        hidden_input: tuple[int, torch.dtype] | None = None,
    ) -> None:  # fmt: skip
        """`hidden_layers` (an EAGLE head's): not None, each step returns every token's final hidden
        state too, and the hidden states entering those layers (StageInput.aux_layers). `num_groups`:
        the K/V groups, each with its slots and block tables (orca_backend/kv_groups.py).
        `hidden_input` (an EAGLE head's passes): (width, dtype) of a hidden state per token that each
        step reads beside its tokens (StageInput.hidden), copied in on the device by `run`."""
        self.forward = forward
        self.num_groups = num_groups
        self.sizes = sorted(set(sizes))
        self.max_size = self.sizes[-1]
        self.block_size = block_size
        self.max_context = max_blocks * block_size  # the longest context a row's table can hold
        self.device = device
        num_tokens = max(self.shape(size)[0] for size in self.sizes)
        num_requests = max(self.shape(size)[1] for size in self.sizes)
        num_logits = max(self.num_logits(size) for size in self.sizes)
        # Device buffers a graph reads: (token ids, positions, each group's K/V slots); (query starts,
        # context lengths, logits indices), the second [:R] of its row, the last [:L]; each group's
        # block tables.
        self.tokens = torch.zeros((2 + num_groups, num_tokens), dtype=torch.int64, device=device)
        self.hidden_layers = hidden_layers
        self.every_token = torch.arange(num_tokens, device=device) if hidden_layers is not None else None
        self.requests = torch.zeros((3, max(num_requests + 1, num_logits)), dtype=torch.int32, device=device)
        self.block_tables = torch.zeros((num_groups, num_requests, max_blocks), dtype=torch.int32, device=device)
        self.hidden_in = None if hidden_input is None else \
            torch.zeros((num_tokens, hidden_input[0]), dtype=hidden_input[1], device=device)  # fmt: skip
        # LoRA (`lora_slots` adapter slots): each token's slot, the tokens sorted by slot, each slot's
        # start and count among them (orca_kernels.lora.LoRAMetadata), in one int32 buffer.
        self.lora_slots = lora_slots
        self.lora_map = torch.zeros(2 * num_tokens + 2 * lora_slots, dtype=torch.int32, device=device) \
            if lora_slots else None  # fmt: skip
        # The host side the live step is written into: the device buffers themselves on a CPU, pinned
        # copies on CUDA, each moved by one asynchronous copy from contiguous pinned memory (a strided
        # source would go through a pageable, synchronous copy), guarded by an event. The tokens and
        # requests go whole (the rows past a bucket too, unread: one copy, not a strided one); the
        # block tables go as the step's [count, width] packed (a row holds every block of the longest
        # context).
        cuda = device.type == "cuda"
        self._host_tokens, self._host_requests, self._host_lora = (
            None if t is None else (torch.zeros_like(t, device="cpu", pin_memory=True) if cuda else t).numpy()
            for t in (self.tokens, self.requests, self.lora_map)
        )
        self._host_tables = self.block_tables.numpy() if not cuda else \
            torch.zeros(self.block_tables.numel(), dtype=torch.int32, pin_memory=True).numpy()  # fmt: skip
        self._ramp = np.arange(1, num_requests + 1, dtype=np.int64)  # padding requests 1, 2, 3, ... after the live ones
        self._copied: torch.cuda.Event | None = None
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: torch.Tensor | None = None  # [max logits rows, vocab]: every graph's output (CUDA)
        self.hidden: torch.Tensor | None = None  # [max tokens, width]: with hidden_layers, the hidden states (CUDA)
        self.pool: tuple | None = None  # the memory pool of the graphs, shared with the runner's other object
        self.graph_bytes = 0

    # ------------------------------------------------------------------ what each kind says
    def size_of(self, inputs: StepInputs) -> int:
        """The count a step's bucket is chosen by."""
        raise NotImplementedError

    def shape(self, size: int) -> tuple[int, int, int]:
        """A bucket's (tokens, requests, max query length): its metadata's host integers."""
        raise NotImplementedError

    def num_logits(self, size: int) -> int:
        """A bucket's logits rows: one per request, unless the kind says otherwise."""
        return self.shape(size)[1]

    def describe(self, size: int) -> str:
        """A bucket, in words (the log and capture errors)."""
        raise NotImplementedError

    def describe_all(self) -> str:
        """The buckets, in words (the log)."""
        raise NotImplementedError

    def eager_reason(self, inputs: StepInputs) -> str:
        """Why this step cannot run on the static buffers (an EAGER_REASONS key), "" when it can."""
        raise NotImplementedError

    # ------------------------------------------------------------------ a step
    def bucket(self, count: int) -> int:
        """The bucket a step of `count` (`size_of`) is padded to."""
        return next(size for size in self.sizes if size >= count)

    def path(self, inputs: StepInputs) -> str:
        """How `run` runs a step that fits: its bucket's graph replayed, or the static buffers eagerly."""
        return GRAPH_REPLAYED if self.bucket(self.size_of(inputs)) in self.graphs else "static_buffers"

    def run(self, inputs: StepInputs, ahead: tuple[torch.Tensor, torch.Tensor] | None = None,
            hidden: torch.Tensor | None = None) -> torch.Tensor:  # fmt: skip
        """The logits of a step that fits (no `eager_reason`), a row per logits index of the step: its
        graph replayed on CUDA, the same static-buffer forward run eagerly elsewhere. On CUDA the view
        is valid until the next run. `ahead` (async scheduling, a proposer's passes): (token
        positions, ids) written over the input tokens on the device. `hidden` (with `hidden_input`):
        the live tokens' hidden states [T, width], copied in on the device."""
        rows = len(inputs.logits_indices)
        size = self.load(inputs)
        if ahead is not None:
            self.tokens[0].index_copy_(0, *ahead)
        if hidden is not None:
            assert self.hidden_in is not None, "these graphs read no hidden states"
            self.hidden_in[: len(hidden)].copy_(hidden)
        graph = self.graphs.get(size)
        if graph is None:
            out = self.forward(*self.views(size))
            return (out[0][:rows], out[1]) if isinstance(out, tuple) else out[:rows]
        graph.replay()
        assert self.logits is not None
        # With hidden_layers, every token's hidden states too (the live tokens' rows first).
        return self.logits[:rows] if self.hidden is None else (self.logits[:rows], self.hidden)

    def load(self, inputs: StepInputs) -> int:
        """Writes the live step into the first tokens and requests of the static buffers and padding
        after them, up to its bucket; returns the bucket."""
        size = self.bucket(self.size_of(inputs))
        tokens, requests = inputs.num_tokens, inputs.num_requests
        self._wait_for_copies()
        self._host_tokens[:, :tokens] = inputs.flat64.reshape(2 + self.num_groups, tokens)
        starts, context_lens, logits_indices = self._host_requests
        starts[: requests + 1] = inputs.query_start
        context_lens[:requests] = inputs.context_lens
        logits_indices[: len(inputs.logits_indices)] = inputs.logits_indices
        width = inputs.block_tables.shape[2]
        self._tables(requests, width)[:] = inputs.block_tables  # entries past a row's context are never read
        self._pad(tokens, requests, size, len(inputs.logits_indices))
        if self._host_lora is not None:
            self._load_lora(inputs.lora_slots, size)
        self._upload(requests, width)
        return size

    def load_padding(self, size: int) -> None:
        """Makes a bucket all padding (what a capture records: nothing is written, nothing is read)."""
        self._wait_for_copies()
        self._host_requests[0, 0] = 0
        self._pad(0, 0, size, 0)
        if self._host_lora is not None:
            self._load_lora(None, size)
        self._upload(0, 0)

    def _pad(self, tokens: int, requests: int, size: int, logits: int) -> None:
        """Tokens [tokens, T) and requests [requests, R) of bucket `size` become padding: token 0 at
        position 0 with no K/V slot, owned by requests of context 0 that take max_query_len tokens each
        until none is left; logits rows [logits, L) read token 0 (any valid one)."""
        num_tokens, num_requests, max_query_len = self.shape(size)
        self._host_tokens[:2, tokens:num_tokens] = 0
        self._host_tokens[2:, tokens:num_tokens] = PAD_SLOT
        starts, context_lens, logits_indices = self._host_requests
        padding = num_requests - requests
        ends = np.minimum(tokens + self._ramp[:padding] * max_query_len, num_tokens)
        starts[requests + 1 : num_requests + 1] = ends
        context_lens[requests:num_requests] = 0
        logits_indices[logits : self.num_logits(size)] = 0

    def _load_lora(self, token_slots: np.ndarray | None, size: int) -> None:
        """The step's token->slot mapping over the bucket's tokens (padding and tokens without an
        adapter: slot -1), as `lora_metadata` sorts it."""
        num_tokens, max_tokens, slots = self.shape(size)[0], self.tokens.shape[1], self.lora_slots
        token_slot, order = self._host_lora[:num_tokens], self._host_lora[max_tokens : max_tokens + num_tokens]
        live = 0 if token_slots is None else len(token_slots)
        if live:
            token_slot[:live] = token_slots
        token_slot[live:] = -1
        sorted_tokens, starts, counts = sort_by_slot(token_slot, slots)
        order[:] = sorted_tokens
        self._host_lora[2 * max_tokens : 2 * max_tokens + slots] = starts
        self._host_lora[2 * max_tokens + slots :] = counts

    def _tables(self, count: int, width: int) -> np.ndarray:
        """Where the step's block tables are written on the host: the device buffer's rows on a CPU,
        the pinned staging packed as [groups, count, width] on CUDA."""
        if self.device.type != "cuda":
            return self._host_tables[:, :count, :width]
        return self._host_tables[: self.num_groups * count * width].reshape(self.num_groups, count, width)

    def _wait_for_copies(self) -> None:
        if self._copied is not None:
            self._copied.synchronize()  # the pinned buffers are not rewritten while a copy reads them

    def _upload(self, count: int, width: int) -> None:
        """CUDA: the host buffers into the device buffers, one asynchronous copy each."""
        if self.device.type != "cuda":
            return  # the host buffers are the device's
        self.tokens.copy_(torch.from_numpy(self._host_tokens), non_blocking=True)
        self.requests.copy_(torch.from_numpy(self._host_requests), non_blocking=True)
        if self.lora_map is not None:
            self.lora_map.copy_(torch.from_numpy(self._host_lora), non_blocking=True)
        if count and width:
            self.block_tables[:, :count, :width].copy_(torch.from_numpy(self._tables(count, width)), non_blocking=True)
        self._copied = torch.cuda.Event()
        self._copied.record()

    def staging_buffers(self) -> list[np.ndarray]:
        """The host memory a step copies to the device from (the only such copies a graph step makes)."""
        return [a for a in (self._host_tokens, self._host_requests, self._host_tables, self._host_lora) if a is not None]

    def views(self, size: int) -> tuple[StageInput, list[AttentionMetadata], torch.Tensor]:
        """The forward's arguments for a bucket: views of the static buffers, and metadata (one per K/V
        group) whose host integers are the bucket's alone. New metadata objects each call: each caches
        what it derives."""
        num_tokens, num_requests, max_query_len = self.shape(size)
        input_ids, positions, *slot_mappings = self.tokens[:, :num_tokens].unbind(0)
        metas = [
            AttentionMetadata(
                query_start=self.requests[0, : num_requests + 1],
                context_lens=self.requests[1, :num_requests],
                block_tables=tables[:num_requests],
                slot_mapping=slot_mapping,
                block_size=self.block_size,
                max_query_len=max_query_len,
                max_context_len=self.max_context,
                num_requests=num_requests,
            )
            for tables, slot_mapping in zip(self.block_tables, slot_mappings, strict=True)
        ]
        lora = None
        if self.lora_map is not None:  # no host copies: the kernels of every projection run (model/lora.py)
            max_tokens, slots = self.tokens.shape[1], self.lora_slots
            mapping = self.lora_map
            lora = LoRAMetadata(mapping[:num_tokens], mapping[max_tokens : max_tokens + num_tokens],
                                mapping[2 * max_tokens : 2 * max_tokens + slots], mapping[2 * max_tokens + slots :],
                                None, None)  # fmt: skip
        every_token = self.every_token[:num_tokens] if self.every_token is not None else None
        hidden = self.hidden_in[:num_tokens] if self.hidden_in is not None else None
        stage_input = StageInput(input_ids, positions, hidden, lora, every_token, self.hidden_layers or ())
        return stage_input, metas, self.requests[2, : self.num_logits(size)]

    # ------------------------------------------------------------------ capture
    @torch.inference_mode()
    def capture(self, pool: tuple | None = None) -> None:
        """Captures one graph per bucket, largest first, in one memory pool (`pool`, shared with the
        runner's other graphs, or a new one: a smaller graph's temporaries fit in what the larger ones
        left), each after an eager warm-up run of its bucket (Triton compiles its kernels, cuBLAS picks
        its algorithms). Every graph copies its logits into `self.logits`, so no graph's own output
        outlives its capture. CUDA only."""
        if self.device.type != "cuda":
            raise RuntimeError(f"CUDA graphs are captured on a CUDA device, not {self.device}")
        started = time.perf_counter()
        free_before = torch.cuda.mem_get_info(self.device)[0]
        stream = torch.cuda.Stream(self.device)  # capture needs a stream other than the default one
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for size in sorted(self.sizes, reverse=True):
                try:
                    self.load_padding(size)
                    warm = self.forward(*self.views(size))
                    warm_logits, warm_hidden = warm if isinstance(warm, tuple) else (warm, None)
                    if self.logits is None:  # the largest bucket's rows are every bucket's most
                        rows = max(self.num_logits(s) for s in self.sizes)
                        self.logits = torch.empty((rows, warm_logits.shape[1]), dtype=warm_logits.dtype,
                                                  device=self.device)  # fmt: skip
                    if warm_hidden is not None and self.hidden is None:
                        self.hidden = torch.empty((self.tokens.shape[1], warm_hidden.shape[1]), dtype=warm_hidden.dtype,
                                                  device=self.device)  # fmt: skip
                    del warm, warm_logits, warm_hidden
                    torch.cuda.synchronize(self.device)
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=pool, stream=stream):
                        out = self.forward(*self.views(size))
                        logits, hidden = out if isinstance(out, tuple) else (out, None)
                        self.logits[: logits.shape[0]].copy_(logits)
                        if hidden is not None:
                            self.hidden[: hidden.shape[0]].copy_(hidden)
                    del out, logits, hidden
                except Exception as e:
                    raise GraphCaptureError(self.describe(size), e) from e
                pool = graph.pool() if pool is None else pool
                self.graphs[size] = graph
        torch.cuda.current_stream(self.device).wait_stream(stream)
        torch.cuda.synchronize(self.device)
        self.pool = pool
        self.graph_bytes = max(free_before - torch.cuda.mem_get_info(self.device)[0], 0)
        logger.info("captured %d CUDA graphs for %s in %.1f s, using %.0f MiB", len(self.graphs),
                    self.describe_all(), time.perf_counter() - started, self.graph_bytes / 2**20)  # fmt: skip


class DecodeGraphs(StepGraphs):
    """Decode-only steps (`is_decode_only`), bucketed by batch size: a bucket of B requests holds B
    tokens, a query length of 1 (the split-K decode kernels)."""

    def size_of(self, inputs: StepInputs) -> int:
        return inputs.num_requests

    def shape(self, size: int) -> tuple[int, int, int]:
        return size, size, 1

    def describe(self, size: int) -> str:
        return f"decode steps of batch size {size}"

    def describe_all(self) -> str:
        return f"decode steps of {self.sizes} requests"

    def eager_reason(self, inputs: StepInputs) -> str:
        if inputs.num_requests > self.max_size:
            return "batch_above_buckets"
        return ""


class MixedGraphs(StepGraphs):
    """Steps with prompt tokens, bucketed by token count: a bucket of T tokens holds min(T,
    max_num_seqs) + 1 requests (the live ones, then the padding's) and a query length of T (the
    ragged attention kernel). With `spec_rows` (speculative decoding) it holds that many more logits
    rows, up to one per token, for the rows verifying proposals of a verify step that the verify
    graphs cannot hold (a prompt chunk longer than 1 + k beside them, more requests than their
    largest bucket)."""

    def __init__(
        self, forward: Forward, sizes: list[int], max_num_seqs: int, max_blocks: int, block_size: int,
        device: torch.device, lora_slots: int = 0, hidden_layers: tuple[int, ...] | None = None, num_groups: int = 1,
        hidden_input: tuple[int, torch.dtype] | None = None, spec_rows: int = 0,
    ) -> None:  # fmt: skip
        self.max_num_seqs = max_num_seqs
        self.spec_rows = spec_rows
        super().__init__(forward, sizes, max_blocks, block_size, device, lora_slots, hidden_layers, num_groups,
                         hidden_input)  # fmt: skip

    def size_of(self, inputs: StepInputs) -> int:
        return inputs.num_tokens

    def shape(self, size: int) -> tuple[int, int, int]:
        return size, min(size, self.max_num_seqs) + 1, size

    def num_logits(self, size: int) -> int:
        requests = self.shape(size)[1]
        return min(requests + self.spec_rows, max(size, requests))

    def describe(self, size: int) -> str:
        return f"mixed steps of {size} tokens"

    def describe_all(self) -> str:
        return f"mixed steps of {self.sizes} tokens"

    def eager_reason(self, inputs: StepInputs) -> str:
        if inputs.num_tokens > self.max_size:
            return "tokens_above_buckets"
        if inputs.num_requests > self.max_num_seqs:
            return "batch_above_buckets"
        if len(inputs.logits_indices) > self.num_logits(self.bucket(inputs.num_tokens)):
            return "speculative"
        return ""


class VerifyGraphs(StepGraphs):
    """Speculative decoding's verify steps, bucketed by batch size: a bucket of B requests holds B (1 +
    k) tokens, a query length of 1 + k, and a logits row per token, in the order the sampler reads them
    (`SpecRows`): each request's own row (its last token), then every request's rows verifying its
    proposals. Any step with proposals whose requests each run at most 1 + k tokens fits: one
    verifying fewer than k (cut by max_tokens, or paused while its proposals were rejected: a plain
    decode) runs its own tokens, from the query starts on the device, and B more padding requests of
    up to 1 + k tokens each own what the live ones leave of the B (1 + k) tokens."""

    def __init__(
        self, forward: Forward, sizes: list[int], num_speculative_tokens: int, max_blocks: int, block_size: int,
        device: torch.device, lora_slots: int = 0, hidden_layers: tuple[int, ...] | None = None, num_groups: int = 1,
    ) -> None:  # fmt: skip
        self.query_len = 1 + num_speculative_tokens
        super().__init__(forward, sizes, max_blocks, block_size, device, lora_slots, hidden_layers, num_groups)

    def size_of(self, inputs: StepInputs) -> int:
        return inputs.num_requests

    def shape(self, size: int) -> tuple[int, int, int]:
        return size * self.query_len, 2 * size, self.query_len

    def num_logits(self, size: int) -> int:
        return size * self.query_len

    def describe(self, size: int) -> str:
        return f"verify steps of batch size {size} ({self.query_len} tokens each)"

    def describe_all(self) -> str:
        return f"verify steps of {self.sizes} requests ({self.query_len} tokens each)"

    def eager_reason(self, inputs: StepInputs) -> str:
        if inputs.spec is None or inputs.max_query_len > self.query_len:
            return "speculative"
        if inputs.num_requests > self.max_size:
            return "batch_above_buckets"
        return ""

