"""The FP8 linear layer as a Triton kernel: the weight is read as FP8 (a quarter of float32's bytes,
half of bfloat16's) and dequantized in registers (see fp8.py for the layout). Decode is
bandwidth-bound on the weights, so reading them as FP8 is what the format buys on a GPU; the
activations stay in the model's dtype (weight-only: checkpoints' input scales are not used).

One program computes a ``BLOCK_M x BLOCK_N`` tile of the output, streaming ``BLOCK_K`` columns of
x and of the weight at a time. Two ways to multiply a chunk:

- on the tensor cores (`MMA`: 16-bit activations, and every chunk of ``BLOCK_K`` columns inside one
  scale block, as 128-column blocks and per-channel or per-tensor scales are): the FP8 codes become
  the activations' dtype exactly (an e4m3 value has 3 mantissa bits), the chunk is one bf16/fp16
  MMA with float32 accumulation, and its partial sums are scaled per output row by the chunk's
  block scale: the same products as the dequantized weight's, each exact in float32;
- otherwise (float32 activations, or blocks narrower than a chunk): each weight entry is scaled by
  its block's scale and the chunk multiplied in float32 ("ieee": no TF32 rounding).

Edges the tiles do not divide are masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_ym,
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, HAS_BIAS: tl.constexpr, MMA: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    scale_rows = s_ptr + (offs_n // BLOCK_OUT).to(tl.int64)[:, None] * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        wk_mask = n_mask[:, None] & k_mask[None, :]
        w = tl.load(w_ptr + offs_n.to(tl.int64)[:, None] * stride_wn + offs_k[None, :], mask=wk_mask, other=0.0)
        if MMA:  # the chunk's codes times x on the tensor cores, then its block's scale per output row
            s = tl.load(scale_rows + k0 // BLOCK_IN, mask=n_mask[:, None], other=0.0)  # [BLOCK_N, 1]
            if DOT_FP32:  # the same products in float32 (the interpreter: below)
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(x, tl.trans(w.to(tl.float32).to(x.dtype)))  # the codes exactly, via float32
            acc += part * tl.trans(s)
        else:
            s = tl.load(scale_rows + (offs_k // BLOCK_IN)[None, :], mask=wk_mask, other=0.0)
            w = w.to(tl.float32) * s  # [BLOCK_N, BLOCK_K], dequantized in registers
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


INTERPRETED: bool = not isinstance(_fp8_linear_kernel, JITFunction)


def fp8_linear_triton(
    x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], bias: torch.Tensor | None = None
) -> torch.Tensor:
    """Same contract as ``fp8_linear_torch``: x [M, in] (any float dtype, unit last stride) times the
    FP8 weight [out, in] scaled per block, plus bias; the result in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1 or scale.stride(-1) != 1:
        raise ValueError("fp8_linear_triton needs the weight and its scales with unit last strides")
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"fp8 linear: x has {k} features, the weight expects {weight.shape[1]}")
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if x.device.type == "cuda":
        # Decode (a few rows): a 16-row tile, the weight streamed in wide column tiles; prefill: 64.
        block_m, block_n, block_k = (16 if m <= 16 else 64), 64, 64
    else:
        block_m, block_n, block_k = 16, 16, 16  # the interpreter: small tiles, every mask path
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    # Tensor cores where each chunk of block_k columns lies inside one scale block (module docstring).
    mma = x.dtype in (torch.bfloat16, torch.float16) and (block[1] % block_k == 0 or block[1] >= k)
    _fp8_linear_kernel[grid](
        x, weight, scale, bias if bias is not None else y, y,
        m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        BLOCK_OUT=block[0], BLOCK_IN=block[1], HAS_BIAS=bias is not None, MMA=mma,
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; GPUs never take this path.
        DOT_FP32=INTERPRETED,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y
