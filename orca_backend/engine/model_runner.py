"""Runs one iteration of (a slice of) the model on a `BatchMeta`: flat inputs, forward, sampling.

The runner owns what lives on the model's device: the weights, the K/V pool of its layers and
the sampler. It knows nothing of requests or scheduling, so the same class runs in the engine's
process (tp = pp = 1) and inside each worker process.
"""

from __future__ import annotations

import torch

from orca_backend.config import EngineConfig, ModelConfig
from orca_backend.engine.batch import BatchMeta
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
        attn_meta = self._attention_metadata(meta)
        stage_input = StageInput(self._tensor(meta.input_ids), self._tensor(meta.positions), hidden)
        logits_indices = self._tensor([end - 1 for end in meta.query_start[1:]])
        return self.model.forward(stage_input, attn_meta, self.kv_caches, logits_indices)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, meta: BatchMeta) -> list[int]:
        self.sampler.release(meta.released_ids)
        return self.sampler.sample(logits, meta)

    def _tensor(self, values: list[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=self.device)

    def _attention_metadata(self, meta: BatchMeta) -> AttentionMetadata:
        return AttentionMetadata(
            query_start=self._tensor(meta.query_start, torch.int32),
            context_lens=self._tensor(meta.context_lens, torch.int32),
            kv_starts=self._tensor(meta.kv_starts, torch.int32),
            slot_mapping=self._tensor(meta.slot_mapping),
            max_query_len=max(b - a for a, b in zip(meta.query_start, meta.query_start[1:], strict=False)),
            max_context_len=max(meta.context_lens),
            query_start_host=meta.query_start,
            context_lens_host=meta.context_lens,
            kv_starts_host=meta.kv_starts,
        )
