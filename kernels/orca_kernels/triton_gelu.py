"""Fused bias + GeLU (tanh approximation) as one Triton kernel, one program per (row, column block).

``0.5 * x * (1 + tanh(y))`` is rewritten as ``x * sigmoid(2 * y)`` (the same function): it needs one
``exp`` and no ``tanh``, which Triton's core language lacks. The sum is taken in fp32: Triton's CPU
interpreter holds bf16 as raw uint16 and would add the bit patterns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

MAX_BLOCK = 1024


@triton.jit
def _bias_gelu_kernel(x_ptr, bias_ptr, out_ptr, inner, stride_x, stride_out, BLOCK: tl.constexpr):
    # A (row, column block) grid: the bias index is the column, no per-element modulo needed.
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 for long prefills
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inner
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # Round the sum to the output dtype first, as the reference's separate `x + bias` does.
    s = (x + b).to(out_ptr.dtype.element_ty).to(tl.float32)
    y = 0.7978845608028654 * (s + 0.044715 * s * s * s)  # sqrt(2 / pi) * (s + 0.044715 s^3)
    e = tl.exp(-2.0 * tl.abs(y))  # in (0, 1]: never overflows, unlike exp(-2y) for very negative s
    out = s * tl.where(y >= 0, 1.0 / (1.0 + e), e / (1.0 + e))
    tl.store(out_ptr + row * stride_out + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


INTERPRETED: bool = not isinstance(_bias_gelu_kernel, JITFunction)


def bias_gelu_triton(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Same contract as ``bias_gelu_torch``: gelu_tanh(x + bias) over [num_tokens, inner]."""
    inner = x.shape[-1]
    x2 = x.reshape(-1, inner)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.result_type(x, bias), device=x.device)
    if x2.numel() > 0:
        block = min(triton.next_power_of_2(inner), MAX_BLOCK)
        grid = (x2.shape[0], triton.cdiv(inner, block))
        _bias_gelu_kernel[grid](
            x2, bias.contiguous(), out, inner, x2.stride(0), out.stride(0), BLOCK=block, num_warps=4
        )
    return out.view(x.shape)
