"""Runs one iteration of (a slice of) the model on a `BatchMeta`: flat inputs, forward, sampling.

The runner owns what lives on the model's device: the weights, the K/V pool of its layers and
the sampler. It knows nothing of requests or scheduling, so the same class runs in the engine's
process (tp = pp = 1) and inside each worker process.
"""

from __future__ import annotations

import numpy as np
import torch

from orca_backend.config import EngineConfig, ModelConfig
from orca_backend.engine.batch import BatchMeta
from orca_backend.engine.cpu_allocator import tune_cpu_allocator
from orca_backend.engine.kv_cache import allocate_kv_pool
from orca_backend.engine.sampler import Sampler
from orca_backend.model.gpt2 import StageInput
from orca_backend.model.loader import load_model
from orca_backend.parallel.comm import TensorParallelGroup
from orca_backend.parallel.layout import SINGLE_PROCESS, ParallelLayout
from orca_kernels import AttentionMetadata


class ModelRunner:
    def __init__(
        self, config: EngineConfig, model_config: ModelConfig, device: torch.device | str | None = None,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        self.device = torch.device(device or config.device)
        if self.device.type == "cpu":
            tune_cpu_allocator()
        self.layout = layout
        self.model = load_model(config, model_config, self.device, layout, tp)
        self.kv_caches = allocate_kv_pool(
            len(self.model.weights.layers), config.kv_capacity_tokens, self.model.num_heads, model_config.head_dim,
            config.torch_dtype, self.device,
        )  # fmt: skip
        self.sampler = Sampler()

    @torch.inference_mode()
    def execute(self, meta: BatchMeta) -> list[int]:
        """The whole model in this process: forward and sample."""
        return self.sample(self.run_stage(meta), meta)

    @torch.inference_mode()
    def run_stage(self, meta: BatchMeta, hidden: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's layers; logits on the last stage, activations for the next stage otherwise."""
        input_ids, positions, attn_meta, logits_indices = self._prepare_inputs(meta)
        return self.model.forward(StageInput(input_ids, positions, hidden), attn_meta, self.kv_caches, logits_indices)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, meta: BatchMeta) -> list[int]:
        self.sampler.release(meta.released_ids)
        return self.sampler.sample(logits, meta)

    def _prepare_inputs(self, meta: BatchMeta) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, torch.Tensor]:
        """Every per-iteration index tensor from one host list and one device copy: this runs every
        iteration, and one conversion of B + T numbers is far cheaper than seven small ones."""
        num_tokens, num_requests = meta.num_tokens, len(meta.context_lens)
        logits_indices = [end - 1 for end in meta.query_start[1:]]
        host = np.array(
            meta.input_ids + meta.positions + meta.slot_mapping + meta.query_start + meta.context_lens
            + meta.kv_starts + logits_indices,
            dtype=np.int64,
        )  # numpy converts a list of ints several times faster than torch.tensor()
        flat = torch.from_numpy(host).to(self.device, non_blocking=True)  # fmt: skip
        input_ids, positions, slot_mapping, query_start, context_lens, kv_starts, logits_index_tensor = flat.split(
            [num_tokens, num_tokens, num_tokens, num_requests + 1, num_requests, num_requests, num_requests]
        )
        attn_meta = AttentionMetadata(
            query_start=query_start.to(torch.int32),
            context_lens=context_lens.to(torch.int32),
            kv_starts=kv_starts.to(torch.int32),
            slot_mapping=slot_mapping,
            max_query_len=max(b - a for a, b in zip(meta.query_start, meta.query_start[1:], strict=False)),
            max_context_len=max(meta.context_lens),
            query_start_host=meta.query_start,
            context_lens_host=meta.context_lens,
            kv_starts_host=meta.kv_starts,
        )
        return input_ids, positions, attn_meta, logits_index_tensor
