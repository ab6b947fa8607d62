"""W8A8 checkpoints (compressed-tensors' int-quantized int8 or float-quantized FP8 weights with
activations quantized per token at run time): reading their linear weights with their scales.

The weights stay 8-bit on every device, with one float32 scale per output row (a per-tensor scale
is repeated); every projection over them quantizes its input per token and multiplies the codes
(kernels/orca_kernels/w8a8.py). Served in one process: a row-parallel shard (o_proj, down_proj
under tensor parallelism) would see part of each token's activations, so its per-token scale would
not be the one the whole row gives (vLLM's ranks each take their own; here that split is refused
rather than answering otherwise than one process).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca_backend.model.checkpoint import WeightSource


@dataclass
class W8A8Weight:
    """A linear layer's 8-bit weight [out, in] (int8 or FP8 e4m3 codes), its float32 scales [out], and
    the format its activations are quantized to per token ("int8" or "fp8")."""

    weight: torch.Tensor
    scale: torch.Tensor
    act: str

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes


def load_w8a8_linear(src: WeightSource, layer: str, act: str, dim: int | None, lo: int, hi: int | None,
                     device: torch.device) -> W8A8Weight:  # fmt: skip
    """The W8A8 weight of linear layer `layer` (a shard along `dim`; tensor parallelism, the only
    source of shards along dim 1, is refused for W8A8 by config.check_parallel_layout)."""
    name = layer + ".weight"
    weight = src.get(name, dim, lo, hi)
    expected = torch.int8 if act == "int8" else torch.float8_e4m3fn
    if weight.dtype != expected:
        raise ValueError(f"{name}: a W8A8 checkpoint with {act} activations stores {expected} weights, got {weight.dtype}")
    scale = src.get(name + "_scale").float().reshape(-1)
    if scale.numel() == 1:
        scale = scale.expand(weight.shape[0])
    elif scale.numel() == src.shape(name)[0]:
        scale = scale[lo:hi] if dim == 0 else scale
    else:
        raise ValueError(f"{name}_scale holds {scale.numel()} values: one per output row or one per tensor are served")
    return W8A8Weight(weight.to(device).contiguous(), scale.contiguous().to(device), act)


def concat_w8a8_rows(parts: list[W8A8Weight]) -> W8A8Weight:
    """Projections over one input (q, k and v; gate and up) stacked along `out` with their scales."""
    return W8A8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), parts[0].act)
