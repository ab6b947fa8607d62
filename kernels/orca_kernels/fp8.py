"""FP8 weights (e4m3) with their scales, and the linear layer over them: the torch reference.

A checkpoint's FP8 linear weight is ``[out, in]`` float8_e4m3fn with float32 scales, one per block of
``block = (block_out, block_in)`` entries: ``scale`` is ``[ceil(out / block_out), ceil(in / block_in)]``
and weight entry ``(r, c)`` stands for ``weight[r, c] * scale[r // block_out, c // block_in]``. The
block-scaled format (Qwen3-FP8, DeepSeek: ``weight_block_size`` [128, 128], ``weight_scale_inv``) is
that as stored; a per-tensor scale (``weight_scale``) is the block ``(1, in)`` with every row's scale
equal, so that several projections stacked along ``out`` (q, k and v; gate and up) keep one layout.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype) -> torch.Tensor:
    """The float weight an FP8 weight stands for, in `dtype` (the product is formed in float32)."""
    rows, cols = weight.shape
    block_out, block_in = block
    expanded = scale.repeat_interleave(block_out, dim=0)[:rows].repeat_interleave(block_in, dim=1)[:, :cols]
    return (weight.to(torch.float32) * expanded).to(dtype)


def fp8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x [M, in] @ dequantized weight.T (+ bias), in x's dtype."""
    return F.linear(x, dequantize_fp8(weight, scale, block, x.dtype), bias)
