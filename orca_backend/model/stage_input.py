"""What enters and leaves a pipeline stage, and what every family's model holds."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import ParallelLayout
from orca_kernels import KernelOps
from orca_kernels.attention import KVScales
from orca_kernels.cpu_gemm import c_linear
from orca_kernels.lora import LoRAMetadata

if TYPE_CHECKING:
    from orca_backend.model.lora import LoRAStack


@dataclass
class StageInput:
    """What enters a pipeline stage: token ids on the first, the previous stage's activations after."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    # [2, T, hidden]: the block output and the residual stream (an EAGLE head's pass: [T, hidden], the
    # hidden state each token reads, worker/eagle_proposer.py)
    hidden: torch.Tensor | None = None
    lora: LoRAMetadata | None = None  # each token's adapter, when some token runs one (model/lora.py)
    # Embedding requests: the tokens whose final hidden state (after the final norm) the last stage
    # returns too, as (logits, hidden [len, hidden] float32).
    pool_indices: torch.Tensor | None = None
    # EAGLE-3: with pool_indices, the hidden states entering these layers too (the residual stream
    # before each), after the final one in the same rows: [len, hidden * (1 + len(aux_layers))].
    aux_layers: tuple[int, ...] = ()


def stage_output(x: torch.Tensor, residual: torch.Tensor | None) -> torch.Tensor:
    """What a stage before the last passes on: [2, T, hidden], the block output and the residual
    stream (zeros when the stage had no layer to start it)."""
    return torch.stack([x, residual if residual is not None else torch.zeros_like(x)])


class StageModel:
    """What every family's model holds, as model/registry.py builds it from (config, weights, ops,
    layout, tp): this rank's share of the heads and of the vocabulary, and the LoRA slots. The
    family's `forward(stage_input, metas, kv_caches, logits_indices)` runs its stage: `metas` is the
    step's attention metadata for each K/V group (orca_backend/kv_groups.py), a layer reading its
    group's (`kv_groups`)."""

    def __init__(
        self, config: Any, weights: Any, ops: KernelOps, layout: ParallelLayout, tp: TensorParallelGroup | None,
        num_heads: int, num_kv_heads: int,
    ) -> None:  # fmt: skip
        self.config = config
        self.weights = weights
        self.ops = ops
        self.layout = layout
        self.tp = tp or TensorParallelGroup()
        self.num_heads = num_heads // layout.tp_size  # this rank's
        self.num_kv_heads = num_kv_heads // layout.tp_size  # the K/V pool's heads (model_runner.py)
        self.vocab_lo, self.vocab_hi = layout.vocab_shard(config.vocab_size)
        # This stage's layers, by their index in the model (none for a model with no layer).
        self.stage_layers = layout.layers(config.num_layers) if weights.layers else range(0)
        self.lora: LoRAStack | None = None  # the adapters' slots, with enable_lora (worker/lora_manager.py)
        # Each of this stage's layers' FP8 K/V scales (kv_cache_dtype fp8; model/kv_scales.py), else None.
        self.kv_scales: list[KVScales | None] = [None] * len(weights.layers)
        # Each of this stage's layers' K/V group, as the model runner lays out the pool (all 0: one).
        self.kv_groups: list[int] = [0] * len(weights.layers)

    def c_step_obstacle(self, linears: list[object]) -> str | None:
        """Why no family's C decode step (kernels/orca_kernels/cpu_decoder_step.py) can run this
        stage, as far as what every family shares decides it (None: nothing here stands in the way):
        the CPU kernel set in one process, K/V pools of the model's dtype, and `linears` (the
        stage's linear weights) each one the C GEMM multiplies."""
        if self.ops.name != "cpu":
            return "not the CPU kernel set"
        if self.tp.size > 1 or not (self.layout.is_first_stage and self.layout.is_last_stage):
            return "tensor or pipeline parallel"
        if any(s is not None for s in self.kv_scales):
            return "FP8 K/V pools"
        if any(c_linear(w) is None for w in linears):
            return "linear layers the C GEMM does not multiply"
        return None

    def kv_scale_names(self, layer: int) -> list[tuple[str, str]]:
        """The checkpoint names a layer's FP8 K/V scales may have, as (k, v) pairs in the order tried
        (model/kv_scales.py); none for a family no quantizer writes them for."""
        return []

    def eagle3_layers(self, layers: tuple[int, ...] | None) -> tuple[int, ...]:
        """The layers whose input hidden states an EAGLE-3 head joins: `layers` as its config names
        them (checked), or vLLM's default for the model."""
        raise ValueError(f"speculative_config: method 'eagle3' is not served for {type(self).__name__} models")

    def vocab_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(token embedding, LM head), [vocab, hidden] each, of a single-process model: what an EAGLE
        head (model/eagle.py) shares with it."""
        raise ValueError(f"speculative_config: method 'eagle' is not served for {type(self).__name__} models")
