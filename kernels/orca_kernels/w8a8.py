"""W8A8 linear layers: 8-bit weights with one scale per output row, and activations quantized per
token as the layer runs (llm-compressor's W8A8-INT8 and FP8-dynamic schemes, as vLLM serves them).

A token's activations x (one row) are quantized symmetrically with the scale s = max|x| / M, where
M is the format's largest value (127 for int8, 448 for FP8 e4m3; vLLM's convention): int8 codes are
round(x / s) (half to even) clamped to [-128, 127], FP8 codes x / s rounded to e4m3. A row of zeros
gets s = 0 and codes 0. The layer's output is

    y[t, o] = s[t] * w_scale[o] * sum_i code_x[t, i] * code_w[o, i]

(+ bias), in float32, rounded once to x's dtype. int8 sums are exact in int32 (torch._int_mm, on
CPU and CUDA); FP8 products are exact in float32, so the reference multiplies the codes in float32
(cuBLAS's FP8 GEMM, torch._scaled_mm, on GPUs that have it).
"""

from __future__ import annotations

import torch

ACT_FORMATS = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}


def quantize_per_token(x: torch.Tensor, act: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes [T, K] int8 or FP8, scales [T, 1] float32) of x [T, K], per the module's rule."""
    dtype, largest = ACT_FORMATS[act]
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / largest
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))  # zeros stay zeros
    y = x / safe
    if act == "int8":
        return torch.round(y).clamp(-128, 127).to(dtype), scale
    return y.clamp(-largest, largest).to(dtype), scale


def w8a8_linear_torch(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, act: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """The module's formula in float32 over the codes: x [T, K], weight [N, K] codes of the act's
    format, weight_scale [N] float32."""
    codes, scale = quantize_per_token(x, act)
    y = (codes.float() @ weight.float().t()) * scale * weight_scale[None, :]
    y = y.to(x.dtype)
    return y if bias is None else y + bias


def w8a8_linear(
    x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, act: str, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`w8a8_linear_torch`, with int8 sums in int32 by torch._int_mm (CPU and CUDA; CUDA's needs more
    than 16 rows, so fewer are padded with zero rows) and FP8 on CUDA by torch._scaled_mm with the
    row scales (elsewhere the reference: a CPU has no FP8 arithmetic)."""
    if act == "fp8" and not x.is_cuda:
        return w8a8_linear_torch(x, weight, weight_scale, act, bias)
    codes, scale = quantize_per_token(x, act)
    if act == "int8":
        rows = codes.shape[0]
        if codes.is_cuda and rows <= 16:
            codes = torch.cat([codes, codes.new_zeros(17 - rows, codes.shape[1])])
        acc = torch._int_mm(codes, weight.t())[:rows]
        y = (acc.float() * scale * weight_scale[None, :]).to(x.dtype)
    else:
        y = torch._scaled_mm(codes, weight.t(), scale_a=scale, scale_b=weight_scale[None, :].contiguous(),
                             out_dtype=x.dtype)  # fmt: skip
    return y if bias is None else y + bias
