"""Fused SiLU-and-multiply (SwiGLU) and tanh-GELU-and-multiply (GeGLU) as one Triton kernel, one
program per (row, column block).

The gate/up GEMM is fused into one [T, 2 * inner] output; reading both halves in one kernel and
writing only the [T, inner] product saves the round trip through memory of ``silu(gate)``. The math
is fp32 with a single rounding at the store (Triton's CPU interpreter would otherwise multiply bf16
bit patterns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .silu import gate_up_split

MAX_BLOCK = 1024


@triton.jit
def _act_and_mul_kernel(x_ptr, out_ptr, inner, stride_x, stride_out, BLOCK: tl.constexpr, GELU: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 for long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    x_row = x_ptr + row * stride_x
    gate = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_row + inner + cols, mask=mask, other=0.0).to(tl.float32)
    # silu(g) = g sigmoid(g); tanh GELU(g) = g sigmoid(2 y), y = sqrt(2 / pi) (g + 0.044715 g^3)
    # (triton_gelu.py). sigmoid(z) from e = exp(-|z|) in (0, 1]: never overflows for very negative z.
    z = 2.0 * 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate) if GELU else gate
    e = tl.exp(-tl.abs(z))
    out = gate * tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e)) * up
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


INTERPRETED: bool = not isinstance(_act_and_mul_kernel, JITFunction)


def silu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``silu_and_mul_torch``: [..., 2 * inner] (gate, up) -> [..., inner]."""
    return _act_and_mul(x, gelu=False)


def gelu_and_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """Same contract as ``gelu_and_mul_torch``."""
    return _act_and_mul(x, gelu=True)


def _act_and_mul(x: torch.Tensor, gelu: bool) -> torch.Tensor:
    inner = gate_up_split(x.shape[-1])
    x2 = x.reshape(-1, 2 * inner)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty((x2.shape[0], inner), dtype=x.dtype, device=x.device)
    if out.numel() > 0:
        block = min(triton.next_power_of_2(inner), MAX_BLOCK)
        grid = (x2.shape[0], triton.cdiv(inner, block))
        _act_and_mul_kernel[grid](x2, out, inner, x2.stride(0), out.stride(0), BLOCK=block, GELU=gelu, num_warps=4)
    return out.view(*x.shape[:-1], inner)
