"""The FP8 linear layer as a Triton kernel: the weight is read as FP8 (a quarter of float32's bytes,
half of bfloat16's), scaled per block in registers and multiplied in float32 (see fp8.py for the
layout). Decode is bandwidth-bound on the weights, so reading them as FP8 is what the format buys
on a GPU; the activations stay in the model's dtype (weight-only: checkpoints' input scales are
not used).

One program computes a ``BLOCK_M x BLOCK_N`` tile of the output, streaming ``BLOCK_K`` columns of
x and of the weight at a time; each weight entry's scale is looked up by its block, so the tile
sizes need not divide the scale blocks (nor the matrix dimensions: edges are masked).
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
    BLOCK_OUT: tl.constexpr, BLOCK_IN: tl.constexpr, HAS_BIAS: tl.constexpr,
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
    _fp8_linear_kernel[grid](
        x, weight, scale, bias if bias is not None else y, y,
        m, n, k,
        x.stride(0), weight.stride(0), scale.stride(0), y.stride(0),
        BLOCK_OUT=block[0], BLOCK_IN=block[1], HAS_BIAS=bias is not None,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y
