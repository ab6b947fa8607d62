"""Fused residual-add + RMSNorm as one Triton kernel: one program per row, fp32 statistics.

Rounding follows the torch reference (Hugging Face's LlamaRMSNorm) step by step: the sum
``x + residual`` is rounded to its dtype before the statistics (so the norm describes the residual
that is stored), the normalised row is rounded to that dtype before the weight multiply, and the
product is rounded once more to the output dtype. Arithmetic itself is always fp32: besides
precision, Triton's CPU interpreter holds bf16 as raw uint16 and would add the bit patterns.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .rows import as_rows

# A row up to this wide stays in registers (one read); wider rows loop over it twice.
MAX_BLOCK = 8192


@triton.jit
def _add_rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    new_res_ptr,
    hidden,
    stride_x,
    stride_res,
    stride_out,
    stride_new_res,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 for long batches
    x_row = x_ptr + row * stride_x
    res_row = res_ptr + row * stride_res
    out_row = out_ptr + row * stride_out
    new_res_row = new_res_ptr + row * stride_new_res
    cols = tl.arange(0, BLOCK)
    sum_ty = new_res_ptr.dtype.element_ty  # the summed residual's dtype (x's when there is none)

    if ONE_BLOCK:
        mask = cols < hidden
        s = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            s = s.to(sum_ty)  # round like the reference's `x + residual`
            tl.store(new_res_row + cols, s, mask=mask)
            s = s.to(tl.float32)
        rstd = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)  # masked columns loaded as 0
        h = (s * rstd).to(sum_ty).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (w * h).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Wide rows: pass 1 writes the sum and accumulates the squares, pass 2 normalises, re-reading
        # the row this program just wrote (hot in L1/L2). No centring, so two passes are exact.
        sum_ptr = new_res_row if HAS_RESIDUAL else x_row
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            s = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
                s = s.to(sum_ty)
                tl.store(new_res_row + offs, s, mask=mask)
                s = s.to(tl.float32)
            acc += s * s
        rstd = tl.rsqrt(tl.sum(acc, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            s = tl.load(sum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            h = (s * rstd).to(sum_ty).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + offs, (w * h).to(out_ptr.dtype.element_ty), mask=mask)


# @triton.jit picks compiled vs interpreted when this module is imported; dispatch re-imports the
# module if TRITON_INTERPRET changed since.
INTERPRETED: bool = not isinstance(_add_rmsnorm_kernel, JITFunction)



def add_rmsnorm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    max_block: int = MAX_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``add_rmsnorm_torch``; ``max_block`` only exists so tests reach the wide-row path.

    Any leading shape works ([T, hidden], or [T, heads, head_dim] for Qwen3's per-head q/k norm).
    """
    hidden = x.shape[-1]
    x2 = as_rows(x, hidden)
    if residual is None:
        res2, new_res = x2, x  # the reference returns x itself as the summed residual
        new_res2 = x2  # never written (HAS_RESIDUAL=False); its dtype is the rounding target
    else:
        res2 = as_rows(residual, hidden)
        new_res = torch.empty(x.shape, dtype=torch.result_type(x, residual), device=x.device)
        new_res2 = new_res.view(-1, hidden)
    out = torch.empty(x2.shape, dtype=torch.result_type(weight, new_res), device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        block = min(triton.next_power_of_2(hidden), triton.next_power_of_2(max_block))
        # Enough warps that each thread holds a handful of elements; at most 16 (512 threads).
        num_warps = min(max(block // 256, 1), 16)
        _add_rmsnorm_kernel[(rows,)](
            x2,
            res2,
            weight.contiguous(),
            out,
            new_res2,
            hidden,
            x2.stride(0),
            res2.stride(0),
            out.stride(0),
            new_res2.stride(0),
            eps,
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            ONE_BLOCK=block >= hidden,
            num_warps=num_warps,
        )
    return out.view(x.shape), new_res
