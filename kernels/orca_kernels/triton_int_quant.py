"""The integer-weight linear layer (4 or 8 bits, group scales and zero points; int_quant.py's layout)
as a Triton kernel: the packed words are read once, unpacked and dequantized in registers, and
multiplied on the tensor cores in the activations' dtype (bfloat16 or float16 MMA; float32
activations multiply in float32). A decode step reads a quarter of bfloat16's weight bytes at 4 bits,
which is what the format buys on a GPU.

One program computes a ``BLOCK_M x BLOCK_N`` tile of the output over one of ``SPLIT_K`` slices of
the input. Decode steps (a few rows) have too few output tiles to fill the GPU, so their input is
split and the float32 partial sums added afterwards in a fixed order (deterministic, and the same
number of launches whatever the batch: capture-safe); prefill steps take one slice and wider tiles.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def _int_linear_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    PER: tl.constexpr = 32 // BITS
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(2) * K_PER_SPLIT
    m_mask, n_mask = offs_m < M, offs_n < N
    rows_n = offs_n.to(tl.int64)[:, None]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
        wk_mask = n_mask[:, None] & k_mask[None, :]
        words = tl.load(w_ptr + rows_n * stride_wn + (offs_k // PER)[None, :], mask=wk_mask, other=0)
        q = (words >> ((offs_k % PER) * BITS)[None, :]) & ((1 << BITS) - 1)
        if HAS_G_IDX:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        else:
            g = offs_k // GROUP
        s = tl.load(s_ptr + rows_n * stride_sn + g[None, :], mask=wk_mask, other=0.0)
        z = tl.load(z_ptr + rows_n * stride_sn + g[None, :], mask=wk_mask, other=0.0)
        w = (q.to(tl.float32) - z) * s  # [BLOCK_N, BLOCK_K], dequantized in registers
        if IEEE:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        elif DOT_FP32:  # the weight rounded to x's dtype as the MMA reads it, multiplied in float32
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(x.dtype).to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    y = y_ptr + tl.program_id(2).to(tl.int64) * stride_ys
    tl.store(y + offs_m.to(tl.int64)[:, None] * stride_ym + offs_n[None, :], acc,
             mask=m_mask[:, None] & n_mask[None, :])  # fmt: skip


INTERPRETED: bool = not isinstance(_int_linear_kernel, JITFunction)


def split_k(m: int, n: int, k: int, block_m: int, block_n: int, block_k: int, programs: int) -> int:
    """How many slices of the input a step takes: for a step of one row tile (decode), enough for
    `programs` programs, each slice at least four BLOCK_K wide; one for longer steps."""
    tiles = triton.cdiv(n, block_n)
    if m > block_m or tiles >= programs:
        return 1
    return max(1, min(triton.cdiv(programs, tiles), k // (4 * block_k)))


def int_linear_triton(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
    g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """Same contract as ``int_linear_torch``: x [M, in] (unit last stride) times the integer weight
    [out, in], plus bias; the result in x's dtype."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if packed.stride(-1) != 1 or scales.stride() != zeros.stride() or scales.stride(-1) != 1:
        raise ValueError("int_linear_triton needs the packed weight, scales and zero points with unit last strides")
    (m, k), n = x.shape, packed.shape[0]
    if packed.shape[1] * (32 // bits) != k:
        raise ValueError(f"int linear: x has {k} features, the {bits}-bit weight holds {packed.shape[1] * 32 // bits}")
    if m == 0:
        return torch.empty((0, n), dtype=x.dtype, device=x.device)
    if x.is_cuda:
        block_m, block_n, block_k = (16 if m <= 16 else 64), (64 if m <= 16 else 128), 64
        programs = 2 * torch.cuda.get_device_properties(x.device).multi_processor_count
    else:
        block_m, block_n, block_k, programs = 16, 16, 16, 4  # the interpreter: small tiles, every mask path
    splits = split_k(m, n, k, block_m, block_n, block_k, programs)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), block_k) * block_k
    splits = triton.cdiv(k, k_per_split)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n), splits)
    _int_linear_kernel[grid](
        x, packed, scales, zeros, g_idx if g_idx is not None else packed, partial,
        m, n, k, k_per_split,
        x.stride(0), packed.stride(0), scales.stride(0), partial.stride(0), partial.stride(1),
        BITS=bits, GROUP=group, HAS_G_IDX=g_idx is not None, IEEE=x.dtype == torch.float32,
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; GPUs never take this path.
        DOT_FP32=INTERPRETED and x.dtype != torch.float32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    y = partial[0] if splits == 1 else partial.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
