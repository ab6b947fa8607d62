"""A linear layer's weight as its checkpoint stores it: float, FP8 (model/fp8.py), integers
(model/int_quant.py) or W8A8 (model/w8a8.py), projections over one input stacked into one weight, and
a MoE layer's experts stacked for the grouped GEMMs."""

from __future__ import annotations

import torch

from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.fp8 import Fp8Weight, concat_fp8_rows, load_fp8_linear
from orca_backend.model.int_quant import IntWeight, concat_int_rows, is_int_quantized, load_int_linear
from orca_backend.model.w8a8 import W8A8Weight, concat_w8a8_rows, load_w8a8_linear
from orca_kernels.cpu_int_gemm import CpuIntWeight
from orca_kernels.int_quant import IntExperts
from orca_kernels.int_quant import stack_experts as stack_int_experts

LinearWeight = torch.Tensor | Fp8Weight | IntWeight | CpuIntWeight | W8A8Weight
# One projection of every expert of a MoE layer (stack_experts).
Experts = torch.Tensor | IntExperts | list[CpuIntWeight]


def load_linear(
    src: WeightSource, layer: str, config: object, dim: int | None, lo: int, hi: int | None, dtype: torch.dtype,
    device: torch.device, dense: bool = False,
) -> LinearWeight:  # fmt: skip
    """The weight of linear layer `layer` (its name without `.weight`; a shard along `dim`): plain,
    FP8 or integer as `config`'s quantization fields and the stored tensors say; `dense`: always a
    float tensor (the experts' grouped GEMMs read no other)."""
    if is_int_quantized(src, layer, config.int_format):  # type: ignore[attr-defined]
        return load_int_linear(src, layer, config, dim, lo, hi, dtype, device, dense)
    name = layer + ".weight"
    act = getattr(config, "act_quant", "")
    if act and src.dtype(name) in (torch.int8, torch.float8_e4m3fn) and not dense:
        return load_w8a8_linear(src, layer, act, dim, lo, hi, device)
    if getattr(config, "fp8", False) and src.dtype(name) == torch.float8_e4m3fn:
        return load_fp8_linear(src, name, config.fp8_block, dim, lo, hi, dtype, device)  # type: ignore[attr-defined]
    return src.get(name, dim, lo, hi).to(device=device, dtype=dtype).contiguous()


def concat_rows(parts: list[LinearWeight]) -> LinearWeight:
    """Projections stacked along `out` (q, k and v; gate and up) into one weight, each kind with its
    scales. Parts of different kinds (one left in float by the quantizer) are refused."""
    kinds = {type(p) for p in parts}
    if len(kinds) > 1:
        raise ValueError("projections over one input (q, k and v; gate and up) are stored partly quantized and "
                         "partly in float, and do not stack into one weight")  # fmt: skip
    if isinstance(parts[0], Fp8Weight):
        return concat_fp8_rows(parts)  # type: ignore[arg-type]
    if isinstance(parts[0], W8A8Weight):
        return concat_w8a8_rows(parts)  # type: ignore[arg-type]
    if isinstance(parts[0], (IntWeight, CpuIntWeight)):
        return concat_int_rows(parts)  # type: ignore[arg-type]
    return torch.cat(parts)  # type: ignore[arg-type]


def stack_experts(weights: list[LinearWeight]) -> Experts:
    """One projection of every expert of a MoE layer, as the grouped GEMMs read it: float weights
    stacked, integer ones stacked packed on CUDA (IntExperts) and kept one per expert in the C
    kernel's layout on the CPU."""
    first = weights[0]
    if len({type(w) for w in weights}) > 1:
        raise ValueError("a MoE layer's experts are stored partly quantized and partly in float")
    if isinstance(first, IntWeight):
        return stack_int_experts(weights)  # type: ignore[arg-type]
    if isinstance(first, CpuIntWeight):
        return list(weights)  # type: ignore[arg-type]
    if isinstance(first, torch.Tensor):
        return torch.stack(weights)  # type: ignore[arg-type]
    raise ValueError(f"experts stored as {type(first).__name__} are read dequantized, not as stored")
