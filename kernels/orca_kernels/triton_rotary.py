"""Neox-style rotary embedding of q and k as one Triton kernel (see ``rotary.py`` for the math).

The grid is (token, head block): each program gathers its token's cos/sin row from the table once
and rotates a block of q heads and the same block of k heads with it, so a single launch serves
both tensors. q and k are read through their strides (they are usually views of the fused qkv
projection) and written to fresh contiguous outputs. The math is fp32 with one rounding at the
store (Triton's CPU interpreter would otherwise multiply bf16 bit patterns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .rotary import check_rotary_args

# Elements of one tensor rotated per program: enough to keep the memory system busy, few enough
# to stay in registers.
BLOCK_ELEMENTS = 2048


@triton.jit
def _rotate_heads(src, dst, stride_src_h, stride_dst_h, num_heads, offs_h, cos, sin,
                  HALF: tl.constexpr, BLOCK_HALF: tl.constexpr):  # fmt: skip
    """Rotates heads ``offs_h`` of one token: [x1, x2] -> [x1 cos - x2 sin, x2 cos + x1 sin]."""
    offs_d = tl.arange(0, BLOCK_HALF)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HALF)[None, :]
    src_lo = src + offs_h[:, None] * stride_src_h + offs_d[None, :]
    x1 = tl.load(src_lo, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src_lo + HALF, mask=mask, other=0.0).to(tl.float32)
    dst_lo = dst + offs_h[:, None] * stride_dst_h + offs_d[None, :]
    ty = dst.dtype.element_ty
    tl.store(dst_lo, (x1 * cos[None, :] - x2 * sin[None, :]).to(ty), mask=mask)
    tl.store(dst_lo + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    pos_ptr,
    cos_sin_ptr,
    num_q_heads,
    num_k_heads,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)  # int64: tok * stride can pass 2**31 for long prefills
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    pos = tl.load(pos_ptr + tok).to(tl.int64)
    cos = tl.load(cos_sin_ptr + pos * stride_cs + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    sin = tl.load(cos_sin_ptr + pos * stride_cs + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    # fmt: off
    _rotate_heads(q_ptr + tok * stride_qt, q_out_ptr + tok * stride_qot, stride_qh, stride_qoh, num_q_heads,
                  offs_h, cos, sin, HALF, BLOCK_HALF)
    _rotate_heads(k_ptr + tok * stride_kt, k_out_ptr + tok * stride_kot, stride_kh, stride_koh, num_k_heads,
                  offs_h, cos, sin, HALF, BLOCK_HALF)
    # fmt: on


INTERPRETED: bool = not isinstance(_rotary_kernel, JITFunction)


def rotary_triton(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``rotary_torch``: new contiguous (q_out, k_out) in q's dtype.

    Positions are not range-checked here (that would sync the device): each must be a row of
    ``cos_sin``, which the model guarantees by sizing the table to its maximum context.
    """
    head_dim = check_rotary_args(q, k, positions, cos_sin)
    if q.stride(-1) != 1:
        q = q.contiguous()
    if k.stride(-1) != 1:
        k = k.contiguous()
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    num_tokens, num_q_heads, _ = q.shape
    num_k_heads = k.shape[1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return q_out, k_out
    half = head_dim // 2
    block_half = triton.next_power_of_2(half)
    max_heads = max(num_q_heads, num_k_heads)
    block_h = min(triton.next_power_of_2(max_heads), max(BLOCK_ELEMENTS // block_half, 1))
    grid = (num_tokens, triton.cdiv(max_heads, block_h))
    _rotary_kernel[grid](
        q,
        k,
        q_out,
        k_out,
        positions,
        cos_sin,
        num_q_heads,
        num_k_heads,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin.stride(0),
        HALF=half,
        BLOCK_H=block_h,
        BLOCK_HALF=block_half,
        num_warps=4,
    )
    return q_out, k_out
