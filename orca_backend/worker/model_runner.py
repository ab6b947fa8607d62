"""Runs one step of (a slice of) the model on a `SchedulerOutput`: deltas into the persistent input
batch, flat inputs, forward, sampling.

The runner owns what lives on the model's device and the requests' state the scheduler sends it:
the weights, the K/V pool of its layers, the input batch (worker/input_batch.py) and the sampler.
It knows nothing of scheduling, so the same class runs in the engine's process (tp = pp = 1) and
inside each worker process, each applying the same deltas.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from orca_backend.config import EngineConfig, pool_capacity_tokens
from orca_backend.distributed.comm import TensorParallelGroup, any_rank, smallest_over_ranks
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.families import AnyModelConfig
from orca_backend.kv_groups import model_kv_groups
from orca_backend.lora import LoRARequest
from orca_backend.model.device import torch_dtype
from orca_backend.model.kv_scales import kv_pool_dtype
from orca_backend.model.loader import load_model
from orca_backend.model.stage_input import StageInput
from orca_backend.scheduler_output import SamplerOutput, SchedulerOutput
from orca_backend.worker.bitmask import apply_bitmask, decode_bitmask
from orca_backend.worker.cpu_allocator import tune_cpu_allocator
from orca_backend.worker.cuda_graphs import (
    EAGER_REASONS,
    MAX_VERIFY_BATCH,
    DecodeGraphs,
    GraphCaptureError,
    MixedGraphs,
    StepGraphs,
    VerifyGraphs,
    capture_sizes,
    is_decode_only,
    mixed_capture_sizes,
    runner_eager_reason,
    verify_capture_sizes,
)
from orca_backend.worker.draft_proposer import DraftProposer
from orca_backend.worker.eagle_proposer import EagleProposer
from orca_backend.worker.host_kv import HostKV
from orca_backend.worker.input_batch import InputBatch, StepInputs
from orca_backend.worker.kv_pool import (
    MemoryReading,
    check_free_memory,
    kv_pool_tokens,
    profile_memory,
    read_cuda_memory,
)
from orca_backend.worker.kv_pool import describe as describe_memory
from orca_backend.worker.lora_manager import LoRAManager
from orca_backend.worker.runner_proposer import RunnerProposer
from orca_backend.worker.sampler import SampledTokens, Sampler
from orca_kernels import AttentionMetadata
from orca_kernels.lora import lora_metadata

logger = logging.getLogger("orca.worker")
Graphs = TypeVar("Graphs", bound=StepGraphs)


@dataclass
class LaunchedStep:
    """A step launched (`ModelRunner.launch`): its sampled ids on their way, or the error it raised."""

    sampled: SampledTokens | None = None
    error: BaseException | None = None

    def result(self) -> SamplerOutput:
        if self.error is not None:
            raise self.error
        assert self.sampled is not None
        return self.sampled.result()


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: AnyModelConfig, device: torch.device,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        self.device = device  # checked by the caller (make_executor, or the worker process for its rank)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.layout = layout
        # What the device holds before this engine loads anything is not its own (worker/kv_pool.py).
        self._memory_baseline: MemoryReading | None = None
        if config.sizes_kv_pool_from_memory():
            self._memory_baseline = read_cuda_memory(self.device)
            check_free_memory(self._memory_baseline, config.gpu_memory_utilization)
        self.model = load_model(config, model_config, self.device, layout, tp)
        # The K/V groups (orca_backend/kv_groups.py), as the engine core's manager lays out the pool.
        self.kv_groups = model_kv_groups(model_config, config)
        self.model.kv_groups = [self.kv_groups.layer_group[i] for i in self.model.stage_layers]
        self.block_size = config.block_size
        self.max_num_seqs = config.max_num_seqs
        # The adapters' slots before the pool: a pool sized from memory leaves them their room.
        self.lora: LoRAManager | None = None
        if config.enable_lora:
            self.lora = LoRAManager(self.model, model_config, layout, config.max_loras, config.max_lora_rank,
                                    config.max_cpu_loras, torch_dtype(config.dtype), self.device)  # fmt: skip
        # Speculative decoding with a draft model or an EAGLE head: it proposes in this runner, its K/V
        # slot for slot beside the target's (loaded before the pool is sized, so its weights are counted).
        self.drafter: RunnerProposer | None = None
        speculative = config.speculative()
        method = speculative.method if speculative is not None else ""
        self.num_speculative_tokens = speculative.num_speculative_tokens if speculative is not None else 0
        if method == "draft_model":
            self.drafter = DraftProposer(config, model_config, self.device)
        elif method in ("eagle", "eagle3"):
            self.drafter = EagleProposer(config, model_config, self.model, self.device)
        # The final hidden state of every token of every step, for the EAGLE head (None: not asked).
        self._every_token: torch.Tensor | None = None
        self.hidden_size = model_config.hidden_size
        if self.drafter is not None and len({model_config.window(i) for i in range(model_config.num_layers)}) > 1:
            logger.info("K/V: one block table for every layer (no per-group K/V): speculative_config method %r "
                        "proposes over the target's table", method)  # fmt: skip
        if config.sizes_kv_pool_from_memory():
            num_slots = self._kv_slots_from_memory(config, model_config)
        else:
            num_slots = pool_capacity_tokens(config.kv_capacity_tokens, config.block_size)
        self.kv_capacity_tokens = num_slots  # every rank's: the engine core's K/V manager takes it
        self.kv_caches = self._allocate_pool(num_slots, model_config, config)
        self.num_pages = self.kv_groups.num_pages(num_slots // config.block_size)
        if self.drafter is not None:
            self.drafter.allocate(num_slots)
        # The host tier (swap_space), in the same blocks as the engine core counts them.
        self.host_kv: HostKV | None = None
        if float(config.swap_space) > 0:
            host_blocks = self.kv_groups.num_pages(config.host_kv_blocks(model_config))
            self.host_kv = HostKV(self._pool_tensors(), host_blocks, config.block_size)
            logger.info("K/V host tier: %d blocks (%.2f GiB)", host_blocks, self.host_kv.nbytes / 2**30)
        # A row for every request that can run at once: max_num_seqs per batch, one batch per stage in flight.
        self.input_batch = InputBatch(
            config.max_num_seqs * config.pipeline_parallel_size,
            min(model_config.max_context, self.num_pages * config.block_size),  # a global group's most
            config.block_size, model_config.vocab_size, self.device, self.kv_groups.num_groups,
        )  # fmt: skip
        self.input_batch.several_tokens_per_step = (bool(config.speculative_config) or config.async_scheduling
                                                    or config.pipeline_parallel_size > 1)  # fmt: skip
        self.sampler = Sampler()
        self._lora_failures: dict[int, str] = {}  # adapters that failed to load, until the next sampled tokens
        if self.lora is not None:
            self.input_batch.lora_slot_of = self.lora.slot_of
        self._step: tuple[int, StepInputs] | None = None  # the inputs of the step being run (run_stage, then sample)
        # The last step's request ids and sampled ids on the device: under async scheduling the next
        # step's requests run ahead on them (`SchedulerOutput.ahead_rows`).
        self._last_sampled: tuple[list[str], torch.Tensor] | None = None
        # CUDA: the persistent device buffers the host buffers are copied into, and the event that marks the
        # last copies done (the host buffers are not written again before it).
        self._device_buffers: dict[str, torch.Tensor] = {}
        self._copied: torch.cuda.Event | None = None
        # The CUDA graphs of decode-only steps, of speculative decoding's verify steps and of the others
        # (worker/cuda_graphs.py), None where a step of that kind runs eagerly.
        self.decode_graphs: DecodeGraphs | None = None
        self.verify_graphs: VerifyGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        # Why no step replays a graph here (an EAGER_REASONS key; "" when steps can).
        self.eager_reason = runner_eager_reason(
            config.enforce_eager, self.device, self.layout.pp_size > 1, self.model.ops.name,
        )  # fmt: skip
        self._step_path = ""  # how the last step's forward ran: cuda_graphs.GRAPH_REPLAYED or an EAGER_REASONS key
        if self.eager_reason:
            logger.info("steps run eagerly: %s", EAGER_REASONS[self.eager_reason])
        else:
            # The mixed graphs first: their largest bucket sizes the pool every graph shares.
            self.mixed_graphs = self._capture(self.static_mixed(mixed_capture_sizes(config.max_num_batched_tokens)))
            self.decode_graphs = self._capture(self.static_decode(capture_sizes(config.max_num_seqs)),
                                               self.mixed_graphs.pool)  # fmt: skip
            if self.num_speculative_tokens:
                self.verify_graphs = self._capture(self.static_verify(verify_capture_sizes(config.max_num_seqs)),
                                                   self.mixed_graphs.pool)  # fmt: skip
            if self.drafter is not None:  # the draft model's or the EAGLE head's passes
                for graphs in self.drafter.static_graphs(config.max_num_seqs, config.max_num_batched_tokens,
                                                         self.input_batch.block_table.shape[2]):  # fmt: skip
                    self._capture(graphs, self.mixed_graphs.pool)

    def _allocate_pool(self, num_slots: int, model_config: AnyModelConfig,
                       config: EngineConfig) -> list[tuple[torch.Tensor, torch.Tensor]]:  # fmt: skip
        """Each of this stage's layers' (K, V) pools: the pool of `num_slots` slots of one table, cut
        into the K/V groups' pages (orca_backend/kv_groups.py), a layer's the tensors of its page slot
        (shared with the layers of other groups that have that slot)."""
        groups, size = self.kv_groups, config.block_size
        slots = [groups.layer_slot[i] for i in self.model.stage_layers]
        tensors = allocate_kv_pool(max(slots, default=-1) + 1, groups.num_pages(num_slots // size) * size,
                                   self.model.num_kv_heads, model_config.head_dim,
                                   kv_pool_dtype(config.kv_cache_dtype, torch_dtype(config.dtype)), self.device)  # fmt: skip
        return [tensors[slot] for slot in slots]

    def _pool_tensors(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The distinct (K, V) pools of this rank, the draft model's included: what a block copy copies."""
        layers = self.kv_caches + (self.drafter.kv_caches if self.drafter is not None else [])
        return list({id(k_cache): (k_cache, v_cache) for k_cache, v_cache in layers}.values())

    def _kv_slots_from_memory(self, config: EngineConfig, model_config: AnyModelConfig) -> int:
        """The pool's slots from gpu_memory_utilization (worker/kv_pool.py): the largest step runs once
        on a pool of one block, and every rank takes the smallest rank's answer (their pools are one
        block table's)."""
        assert self._memory_baseline is not None
        loaded = read_cuda_memory(self.device)  # the weights, with the adapters' slots where LoRA is on
        torch.cuda.reset_peak_memory_stats(self.device)  # the peak from here: the weights and the step (not the load's)
        self.kv_caches = self._allocate_pool(config.block_size, model_config, config)
        profile = profile_memory(self._memory_baseline, loaded, lambda: self.run_profile_step(model_config, config),
                                 lambda: read_cuda_memory(self.device))  # fmt: skip
        del self.kv_caches
        torch.cuda.empty_cache()
        per_token = config.kv_bytes_per_token(model_config) + (self.drafter.kv_bytes_per_token if self.drafter else 0)
        tokens = smallest_over_ranks(kv_pool_tokens(profile, config.gpu_memory_utilization, per_token,
                                                    config.block_size), self.device)  # fmt: skip
        logger.info("K/V pool: %d tokens (%.2f GiB) from gpu_memory_utilization: %s", tokens,
                    tokens * per_token / 2**30, describe_memory(profile, config.gpu_memory_utilization))  # fmt: skip
        return tokens

    @torch.inference_mode()
    def run_profile_step(self, model_config: AnyModelConfig, config: EngineConfig) -> None:
        """The forward of the largest step the scheduler sends: max_num_batched_tokens tokens (the
        largest mixed bucket when that is unset) over max_num_seqs logits rows, all padding (nothing
        is read from or written to the K/V pool). A stage after the first takes zero activations."""
        size = mixed_capture_sizes(config.max_num_batched_tokens)[-1]
        max_blocks = -(-model_config.max_context // config.block_size)
        static = MixedGraphs(self._forward, [size], self.max_num_seqs, max_blocks, config.block_size, self.device,
                             self._lora_slots(), self._mixed_hidden_layers(), self.kv_groups.num_groups,
                             spec_rows=self._mixed_spec_rows())  # fmt: skip
        static.load_padding(size)
        stage_input, metas, logits_indices = static.views(size)
        if not self.layout.is_first_stage:
            stage_input.hidden = torch.zeros((2, size, model_config.hidden_size), dtype=torch_dtype(config.dtype),
                                             device=self.device)  # fmt: skip
        static.forward(stage_input, metas, logits_indices)

    def _capture(self, graphs: Graphs, pool: tuple | None = None) -> Graphs:
        """The graphs, captured. A failure fails the load, naming the bucket and the error, never a
        silent fall back to eager steps: enforce_eager is how a deployment runs without graphs. Out of
        memory (torch's, or cuBLAS's or Triton's own allocation) names what to lower."""
        try:
            graphs.capture(pool)
        except GraphCaptureError as e:
            cause = e.__cause__
            if isinstance(cause, torch.cuda.OutOfMemoryError) or any(
                    mark in str(cause).lower() for mark in ("out of memory", "alloc_failed")):  # fmt: skip
                pool_gib = sum(k.nbytes + v.nbytes for k, v in self._pool_tensors()) / 2**30
                raise RuntimeError(
                    f"{e}: out of GPU memory beside the weights and the K/V pool ({pool_gib:.1f} GiB); lower "
                    "kv_capacity_tokens, max_num_seqs or max_num_batched_tokens, or set enforce_eager to run "
                    "without graphs"
                ) from cause
            raise RuntimeError(f"{e}; set enforce_eager to run steps without CUDA graphs") from cause
        return graphs

    def _forward(self, stage_input: StageInput, metas: Sequence[AttentionMetadata],
                 logits_indices: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return self.model.forward(stage_input, metas, self.kv_caches, logits_indices)

    def static_decode(self, sizes: list[int]) -> DecodeGraphs:
        """The static buffers of decode steps padded to `sizes` (not captured yet: `capture()` does
        that on CUDA; on a CPU the same forward runs on them eagerly, as the tests do)."""
        return DecodeGraphs(self._forward, sizes, self.input_batch.block_table.shape[2], self.block_size, self.device,
                            self._lora_slots(), self._hidden_layers(), self.kv_groups.num_groups)  # fmt: skip

    def static_verify(self, sizes: list[int]) -> VerifyGraphs:
        """The static buffers of verify steps padded to `sizes` requests (as `static_decode`)."""
        return VerifyGraphs(self._forward, sizes, self.num_speculative_tokens, self.input_batch.block_table.shape[2],
                            self.block_size, self.device, self._lora_slots(), self._hidden_layers(),
                            self.kv_groups.num_groups)  # fmt: skip

    def static_mixed(self, sizes: list[int]) -> MixedGraphs:
        """The static buffers of steps with prompt tokens padded to `sizes` tokens (as `static_decode`),
        with room for the rows verifying proposals of up to MAX_VERIFY_BATCH requests, returning every
        token's final hidden states too (what embedding requests pool)."""
        return MixedGraphs(self._forward, sizes, self.max_num_seqs, self.input_batch.block_table.shape[2],
                           self.block_size, self.device, self._lora_slots(), self._mixed_hidden_layers(),
                           self.kv_groups.num_groups, spec_rows=self._mixed_spec_rows())  # fmt: skip

    def _mixed_hidden_layers(self) -> tuple[int, ...]:
        """What the mixed graphs return beside the logits: every token's final hidden states, and an
        EAGLE head's auxiliary ones."""
        return self._hidden_layers() or ()

    def _mixed_spec_rows(self) -> int:
        """The verify rows a mixed bucket holds beyond its requests' own (speculative decoding)."""
        return min(self.max_num_seqs, MAX_VERIFY_BATCH) * self.num_speculative_tokens

    def _hidden_layers(self) -> tuple[int, ...] | None:
        """What the graphs return beside the logits: for an EAGLE head, every token's hidden states
        (StepGraphs' hidden_layers); else nothing (None)."""
        return self.drafter.aux_layers if self.drafter is not None and self.drafter.needs_hidden_states else None

    def _lora_slots(self) -> int:
        """The adapter slots the graphs' static token->slot mapping covers (0: LoRA is off)."""
        return 0 if self.lora is None else self.lora.stack.max_loras

    def update_states(self, step: SchedulerOutput) -> None:
        """Takes in the step's deltas (scheduler_output.py). Every runner does, as the step arrives, before
        and whatever its forward then does: the core counts them as held once sent."""
        if step.lora_loads:
            if self.lora is None:
                raise RuntimeError("a step loads LoRA adapters into a runner built without enable_lora")
            self._load_adapters(step.lora_loads)
        self.input_batch.apply(step)
        if step.kv_to_host or step.kv_to_device:
            if self.host_kv is None:
                raise RuntimeError("a step copies K/V blocks to or from a host tier this runner was built without")
            self.host_kv.copy(step.kv_to_host, step.kv_to_device)
        if step.block_copies:
            self._copy_blocks(step.block_copies)

    @torch.inference_mode()
    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Each (source, destination) block's K/V into the destination, in every layer of this
        rank's pool: a forked request's copy of the block its sample 0 goes on writing."""
        size = self.block_size
        slots = np.asarray(copies, dtype=np.int64)[:, :, None] * size + np.arange(size)  # [copies, 2, size]
        index = self.input_batch.staging.put(slots)  # staged: no pageable copy in the step's stream
        sources, destinations = index[:, 0].reshape(-1), index[:, 1].reshape(-1)
        for k_cache, v_cache in self._pool_tensors():
            for cache in (k_cache, v_cache):  # as bytes: torch copies no FP8 rows by index on CPU
                cache = cache.view(torch.uint8) if cache.element_size() == 1 else cache
                cache.index_copy_(0, destinations, cache.index_select(0, sources))

    def _load_adapters(self, loads: list[tuple[int, LoRARequest]]) -> None:
        """Loads the step's adapters. The ranks agree on which failed (a file may differ between hosts),
        so all of them zero the same slots; the failures go out with the next sampled tokens."""
        assert self.lora is not None
        failed = self.lora.load(loads)
        if self.layout.world_size > 1:
            anywhere = any_rank([lora.lora_id in failed for _, lora in loads], self.device)
            elsewhere = {lora.lora_id for (_, lora), bad in zip(loads, anywhere, strict=True) if bad} - set(failed)
            self.lora.unload(elsewhere)
            failed |= {lora.lora_id: f"LoRA adapter {lora.name!r} could not be loaded on another model worker "
                                     "(its log has the details)" for _, lora in loads if lora.lora_id in elsewhere}  # fmt: skip
        self._lora_failures |= failed

    def execute(self, step: SchedulerOutput) -> SamplerOutput:
        """The whole model in this process, on a step whose deltas it has taken in: forward and sample."""
        return self.launch(step).result()

    # One inference-mode scope per entry point: entering one costs microseconds, every iteration.
    @torch.inference_mode()
    def launch(self, step: SchedulerOutput) -> LaunchedStep:
        """`execute` without waiting for the sampled ids (on a GPU the step's kernels are queued and the
        host goes on); an error is kept for `result()`, as `execute` would have raised it."""
        try:
            return LaunchedStep(self._launch_sample(self._run_stage(step), step))
        except Exception as e:  # noqa: BLE001 - raised by result(), where execute would have raised it
            self._last_sampled = None  # a step run ahead of this one cannot take its tokens
            return LaunchedStep(error=e)

    @torch.inference_mode()
    def run_stage(self, step: SchedulerOutput, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's layers; logits on the last stage, activations for the next stage otherwise."""
        return self._run_stage(step, hidden)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, step: SchedulerOutput) -> SamplerOutput:
        """The sampling rank's last step: the grammar masks, then the sampler."""
        return self._sample(logits, step)

    def _run_stage(self, step: SchedulerOutput, hidden: torch.Tensor | None = None) -> torch.Tensor:
        if self._copied is not None:
            self._copied.synchronize()
        if self.drafter is not None and step.spec_rows:  # the draft model's proposals, before the inputs are read
            self.drafter.propose(step, self.input_batch, self.input_batch.step_rows(step))
        inputs = self.input_batch.prepare(step)
        self._step = (step.step_id, inputs)
        ahead = self._ahead_tokens(step) if step.ahead_rows else None
        if ahead is not None and inputs.sampling is not None and inputs.sampling.penalized_ahead.shape[1]:
            index = self.input_batch.staging.put(inputs.sampling.penalized_ahead)
            inputs.sampling.unrecorded = torch.stack((index[0], ahead[1].index_select(0, index[1])))
        graphs, self._step_path = self._graphs_for(inputs)
        if not self._step_path and inputs.prompt_logprobs is not None:
            self._step_path = "prompt_logprobs"
        if graphs is not None and not self._step_path:
            self._step_path = graphs.path(inputs)
            return graphs.run(inputs, ahead)
        input_ids, positions, metas, logits_indices = self._device_inputs(inputs)
        if ahead is not None:
            input_ids.index_copy_(0, *ahead)
        lora = None
        if inputs.lora_slots is not None:
            assert self.lora is not None
            lora = lora_metadata(inputs.lora_slots, self.lora.stack.max_loras, self.device)
        # A forward that returns hidden states returns every token's, as the mixed graphs do: the
        # pooled tokens are some of them, and an EAGLE head reads them all.
        hidden_layers = self._hidden_layers()
        pool_indices = None
        if hidden_layers is not None or inputs.pooling is not None:
            pool_indices = self._every_token_index(inputs.num_tokens)
        stage_input = StageInput(input_ids, positions, hidden, lora, pool_indices, hidden_layers or ())
        return self.model.forward(stage_input, metas, self.kv_caches, logits_indices)

    def _graphs_for(self, inputs: StepInputs) -> tuple[StepGraphs | None, str]:
        """The graphs whose buckets a step goes to, and why it cannot run on them ("" when it can): a
        verify step to the verify graphs where they hold it, else (a prompt chunk longer than 1 + k
        beside its verify rows) to the mixed ones, which hold verify rows too; a decode-only step to
        the decode graphs; a step with embedding requests to the mixed ones, which return every token's
        hidden states."""
        if inputs.pooling is None and inputs.spec is not None and self.verify_graphs is not None \
                and not self.verify_graphs.eager_reason(inputs):  # fmt: skip
            return self.verify_graphs, ""
        graphs = self.decode_graphs if inputs.pooling is None and is_decode_only(inputs) else self.mixed_graphs
        return graphs, self.eager_reason if graphs is None else graphs.eager_reason(inputs)

    def _every_token_index(self, count: int) -> torch.Tensor:
        """0..count-1 on the device (a view of one grown by doubling)."""
        if self._every_token is None or len(self._every_token) < count:
            size = max(count, 2 * (0 if self._every_token is None else len(self._every_token)))
            self._every_token = torch.arange(size, device=self.device)
        return self._every_token[:count]

    def _ahead_tokens(self, step: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor]:
        """(token positions, ids) of the requests run ahead: each one's input token is the id the
        last step sampled for it, still on the device (its copy to the host may not have landed).
        The index reaches the device through the staging arena: a copy from pageable memory would
        wait for the step in flight, the very wait running ahead avoids."""
        if self._last_sampled is None:
            raise RuntimeError("a step runs ahead of a step that sampled nothing (it failed)")
        last_ids, last_tokens = self._last_sampled
        where = {request_id: i for i, request_id in enumerate(last_ids)}
        starts = list(itertools.accumulate(step.num_scheduled_tokens, initial=0))
        rows = step.ahead_rows
        index = np.array([[starts[r] for r in rows], [where[step.scheduled_ids[r]] for r in rows]], dtype=np.int64)
        positions, sources = self.input_batch.staging.put(index)
        return positions, last_tokens.index_select(0, sources)

    def _sample(self, logits: torch.Tensor, step: SchedulerOutput) -> SamplerOutput:
        return self._launch_sample(logits, step).result()

    def _launch_sample(self, logits: torch.Tensor, step: SchedulerOutput) -> SampledTokens:
        assert self._step is not None and self._step[0] == step.step_id, "sample() follows run_stage() of the same step"
        inputs = self._step[1]
        if step.bitmask_rows:  # structured output: the grammar's mask comes before any sampling step
            rows = step.bitmask_rows
            apply_bitmask(logits, decode_bitmask(step.bitmask, len(rows)), rows)
        pooled, every_token = None, None
        if isinstance(logits, tuple):  # the last stage also returned every token's final hidden states
            logits, hidden = logits
            if self._hidden_layers() is not None:  # the EAGLE head's
                every_token = hidden  # with EAGLE-3's auxiliary hidden states after the final ones
            if inputs.pooling is not None:  # the pooled tokens' final hidden states
                pooled = (hidden.index_select(0, inputs.pooling.indices)[:, : self.hidden_size], inputs.pooling)
        # The rows after the requests' own: those verifying proposals, then those scoring prompt tokens.
        count, spec_logits, prompt_logits = inputs.num_requests, None, None
        if inputs.spec is not None:
            spec_logits = logits[count : count + len(inputs.spec.draft_ids)]
            count += len(inputs.spec.draft_ids)
        if inputs.prompt_logprobs is not None:
            prompt_logits = logits[count:]
        if count > inputs.num_requests or prompt_logits is not None:
            logits = logits[: inputs.num_requests]
        if step.spec_bitmask_rows:  # the grammars' masks of the rows verifying constrained requests' proposals
            assert spec_logits is not None
            rows = step.spec_bitmask_rows
            apply_bitmask(spec_logits, decode_bitmask(step.spec_bitmask, len(rows)), rows)
        assert inputs.sampling is not None  # (a target's step always has its sampling)
        sampled = self.sampler.launch(logits, inputs.sampling, prompt_logits, inputs.prompt_logprobs, pooled,
                                      spec_logits, inputs.spec)  # fmt: skip
        self.input_batch.draws_used()
        sampled.step_path = self._step_path
        if self._lora_failures:
            sampled.lora_failures, self._lora_failures = self._lora_failures, {}
        self._last_sampled = (step.scheduled_ids, sampled.tokens)
        if every_token is not None:  # the EAGLE head runs on what the step kept (a wait for it on a GPU)
            assert self.drafter is not None
            self.drafter.observe(step, self.input_batch, self.input_batch.step_rows(step), every_token, sampled.result())
        return sampled

    def _device_inputs(
        self, inputs: StepInputs
    ) -> tuple[torch.Tensor, torch.Tensor, list[AttentionMetadata], torch.Tensor]:  # fmt: skip
        """The step's index tensors: the input batch wrote them into three persistent host buffers
        (int64 tokens, int32 requests, the block tables), moved to the device in three copies (none
        on CPU); every index tensor is a view of one of them. This runs every iteration, and each call
        into numpy or torch costs microseconds whatever its size."""
        num_tokens, num_requests, groups = inputs.num_tokens, inputs.num_requests, self.kv_groups.num_groups
        tables = inputs.block_tables[0] if groups == 1 else inputs.block_tables  # (a numpy view costs less)
        flat64, flat32, block_tables = (self._to_device(name, array) for name, array in
                                        (("flat64", inputs.flat64), ("flat32", inputs.flat32), ("tables", tables)))  # fmt: skip
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()
        # split_with_sizes, not split: the same views without split's Python wrapper (microseconds a step)
        input_ids, positions, *slot_mappings = flat64.split_with_sizes([num_tokens] * (2 + groups))
        query_start, context_lens, logits_indices = flat32.split_with_sizes(
            [num_requests + 1, num_requests, len(inputs.logits_indices)])
        group_tables = (block_tables,) if groups == 1 else block_tables.unbind(0)
        metas = [
            AttentionMetadata(
                query_start=query_start,
                context_lens=context_lens,
                block_tables=table,
                slot_mapping=slot_mapping,
                block_size=self.block_size,
                max_query_len=inputs.max_query_len,
                max_context_len=inputs.max_context_len,
                num_requests=num_requests,
            )
            for table, slot_mapping in zip(group_tables, slot_mappings, strict=True)
        ]
        return input_ids, positions, metas, logits_indices

    def _to_device(self, name: str, array: np.ndarray) -> torch.Tensor:
        """The host buffer itself on CPU; elsewhere its copy in the persistent device buffer `name`
        (grown by doubling), as one asynchronous copy from pinned memory."""
        host = torch.from_numpy(array)
        if self.device.type == "cpu":
            return host
        buffer = self._device_buffers.get(name)
        if buffer is None or buffer.numel() < host.numel():
            size = max(host.numel(), 1024, 0 if buffer is None else 2 * buffer.numel())
            buffer = self._device_buffers[name] = torch.empty(size, dtype=host.dtype, device=self.device)
        device_view = buffer[: host.numel()].view(host.shape)
        device_view.copy_(host, non_blocking=True)
        return device_view


def allocate_kv_pool(
    num_layers: int, capacity_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The preallocated per-layer K/V pools of the runner's layers, [slots, heads, head_dim] each;
    core/kv_cache_manager.py decides who holds which slots."""
    shape = (capacity_tokens, num_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
