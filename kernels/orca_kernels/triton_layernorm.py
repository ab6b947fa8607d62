"""Fused residual-add + LayerNorm as one Triton kernel: one program per row, fp32 statistics.

The sum ``x + residual`` is taken in fp32 and rounded to the input dtype before the statistics, as
the torch reference does, so the normalised output always describes the residual that is stored.
(Arithmetic is never done directly in bf16/fp16: besides precision, Triton's CPU interpreter holds
bf16 as raw uint16 and would add the bit patterns.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .rows import as_rows

# A row up to this wide stays in registers (one read, exact two-pass variance); wider rows loop.
MAX_BLOCK = 8192


@triton.jit
def _add_layernorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    b_ptr,
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

    if ONE_BLOCK:
        mask = cols < hidden
        s = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            s += tl.load(res_row + cols, mask=mask, other=0.0).to(tl.float32)
            s = s.to(new_res_ptr.dtype.element_ty)  # round like the reference's `x + residual`
            tl.store(new_res_row + cols, s, mask=mask)
            s = s.to(tl.float32)
        mean = tl.sum(s, axis=0) / hidden
        diff = tl.where(mask, s - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(diff * diff, axis=0) / hidden + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_row + cols, (diff * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)
    else:
        # Wide rows: pass 1 writes the sum and accumulates the mean, pass 2 the centred variance
        # (two-pass rather than E[x^2] - mean^2, which cancels badly), pass 3 normalises.
        # Passes 2 and 3 re-read the row this program just wrote; it is hot in L1/L2.
        sum_ptr = new_res_row if HAS_RESIDUAL else x_row
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            s = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
            if HAS_RESIDUAL:
                s += tl.load(res_row + offs, mask=mask, other=0.0).to(tl.float32)
                s = s.to(new_res_ptr.dtype.element_ty)
                tl.store(new_res_row + offs, s, mask=mask)
            acc += s.to(tl.float32)
        mean = tl.sum(acc, axis=0) / hidden
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            s = tl.load(sum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            diff = tl.where(mask, s - mean, 0.0)
            acc += diff * diff
        rstd = 1.0 / tl.sqrt(tl.sum(acc, axis=0) / hidden + eps)
        for start in range(0, hidden, BLOCK):
            offs = start + cols
            mask = offs < hidden
            s = tl.load(sum_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            tl.store(out_row + offs, ((s - mean) * rstd * w + b).to(out_ptr.dtype.element_ty), mask=mask)


# @triton.jit picks compiled vs interpreted when this module is imported; dispatch re-imports the
# module if TRITON_INTERPRET changed since.
INTERPRETED: bool = not isinstance(_add_layernorm_kernel, JITFunction)



def add_layernorm_triton(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    *,
    max_block: int = MAX_BLOCK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``add_layernorm_torch``; ``max_block`` only exists so tests reach the wide-row path."""
    hidden = x.shape[-1]
    x2 = as_rows(x, hidden)
    if residual is None:
        res2, new_res = x2, x  # the reference returns x itself as the new residual
        new_res2 = x2  # never written: HAS_RESIDUAL=False skips the store
    else:
        res2 = as_rows(residual, hidden)
        new_res = torch.empty(x.shape, dtype=torch.result_type(x, residual), device=x.device)
        new_res2 = new_res.view(-1, hidden)
    out = torch.empty(x2.shape, dtype=new_res.dtype, device=x.device)
    rows = x2.shape[0]
    if rows > 0:
        block = min(triton.next_power_of_2(hidden), triton.next_power_of_2(max_block))
        # Enough warps that each thread holds a handful of elements; at most 16 (512 threads).
        num_warps = min(max(block // 256, 1), 16)
        _add_layernorm_kernel[(rows,)](
            x2,
            res2,
            weight.contiguous(),
            bias.contiguous(),
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
