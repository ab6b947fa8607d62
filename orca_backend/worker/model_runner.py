"""Runs one iteration of (a slice of) the model on a `BatchMeta`: flat inputs, forward, sampling.

The runner owns what lives on the model's device: the weights, the K/V pool of its layers and
the sampler. It knows nothing of requests or scheduling, so the same class runs in the engine's
process (tp = pp = 1) and inside each worker process.
"""

from __future__ import annotations

import numpy as np
import torch

from orca_backend.config import AnyModelConfig, EngineConfig
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.model.device import torch_dtype
from orca_backend.model.loader import load_model
from orca_backend.model.stage_input import StageInput
from orca_backend.worker.batch_meta import BatchMeta, SamplerOutput
from orca_backend.worker.bitmask import apply_bitmask, decode_bitmask
from orca_backend.worker.cpu_allocator import tune_cpu_allocator
from orca_backend.worker.kv_pool import allocate_kv_pool
from orca_backend.worker.sampler import Sampler
from orca_kernels import AttentionMetadata


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: AnyModelConfig, device: torch.device,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        self.device = device  # checked by the caller (make_executor, or the worker process for its rank)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.layout = layout
        self.model = load_model(config, model_config, self.device, layout, tp)
        self.block_size = config.block_size
        num_slots = config.kv_capacity_tokens // config.block_size * config.block_size  # whole blocks
        self.kv_caches = allocate_kv_pool(
            len(self.model.weights.layers), num_slots, self.model.num_kv_heads, model_config.head_dim,
            torch_dtype(config.dtype), self.device,
        )  # fmt: skip
        self.sampler = Sampler()

    # One inference-mode scope per entry point: entering one costs microseconds, every iteration.
    @torch.inference_mode()
    def execute(self, batch_meta: BatchMeta) -> SamplerOutput:
        """The whole model in this process: forward and sample."""
        return self._sample(self._run_stage(batch_meta), batch_meta)

    @torch.inference_mode()
    def run_stage(self, batch_meta: BatchMeta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's layers; logits on the last stage, activations for the next stage otherwise."""
        return self._run_stage(batch_meta, hidden)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, batch_meta: BatchMeta) -> SamplerOutput:
        """The sampling rank's last step: the grammar masks, then the sampler."""
        return self._sample(logits, batch_meta)

    def _run_stage(self, batch_meta: BatchMeta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        input_ids, positions, attn_meta, logits_indices = self._prepare_inputs(batch_meta)
        return self.model.forward(StageInput(input_ids, positions, hidden), attn_meta, self.kv_caches, logits_indices)

    def _sample(self, logits: torch.Tensor, batch_meta: BatchMeta) -> SamplerOutput:
        self.sampler.release(batch_meta.released_ids)
        if batch_meta.bitmask_rows:  # structured output: the grammar's mask comes before any sampling step
            rows = batch_meta.bitmask_rows
            apply_bitmask(logits, decode_bitmask(batch_meta.bitmask, len(rows)), rows)
        return self.sampler.sample(logits, batch_meta)

    def _prepare_inputs(self, batch_meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """The step's index tensors, from the BatchMeta's arrays as they are: one int64 and one int32
        host buffer (and the block tables) make three tensors, moved to the device in three copies
        (none on CPU), and every index tensor is a view of one of them. This runs every iteration, and
        each call into numpy or torch costs microseconds whatever its size."""
        m = batch_meta
        num_tokens, num_requests = m.num_tokens, len(m.context_lens)
        query_start, context_lens = m.query_start, m.context_lens
        logits_indices = query_start[1:] - 1  # each request's last token
        host64 = np.concatenate((m.input_ids, m.positions, m.slot_mapping))
        host32 = np.concatenate((query_start, context_lens, logits_indices))
        tensors = [torch.from_numpy(a) for a in (host64, host32, m.block_tables)]
        if self.device.type != "cpu":
            tensors = [t.to(self.device, non_blocking=True) for t in tensors]
        flat64, flat32, block_tables = tensors
        # split_with_sizes, not split: the same views without split's Python wrapper (microseconds a step)
        input_ids, positions, slot_mapping = flat64.split_with_sizes([num_tokens, num_tokens, num_tokens])
        query_start_t, context_lens_t, logits_index_tensor = flat32.split_with_sizes([num_requests + 1, num_requests, num_requests])
        attn_meta = AttentionMetadata(
            query_start=query_start_t,
            context_lens=context_lens_t,
            block_tables=block_tables,
            slot_mapping=slot_mapping,
            block_size=self.block_size,
            # a decode-only batch (one token per request, the steady state) needs no difference taken
            max_query_len=1 if num_tokens == num_requests else int(np.diff(query_start).max()),
            max_context_len=int(context_lens.max()),
            query_start_host=query_start.tolist(),
            context_lens_host=context_lens.tolist(),
        )
        return input_ids, positions, attn_meta, logits_index_tensor
