"""The integer-weight linear layer (4 or 8 bits, group scales and zero points; int_quant.py's layout)
as a Triton kernel: the packed words are read once, unpacked and dequantized in registers, and
multiplied on the tensor cores in the activations' dtype (bfloat16 or float16 MMA; float32
activations multiply in float32). A decode step reads a quarter of bfloat16's weight bytes at 4 bits,
which is what the format buys on a GPU.

What a tile loads: each int32 word of its ``[BLOCK_N, BLOCK_K]`` weight tile once, as a
``[BLOCK_N, BLOCK_K / per]`` tile (``per = 32 // bits`` values a word), which is shifted against the
``per`` bit offsets into ``[BLOCK_N, BLOCK_K / per, per]`` and reshaped to ``[BLOCK_N, BLOCK_K]``
(column ``word * per + j``: the layout's order). Loading a word once per value it holds, and a float32
scale and zero point per value, read about 12 bytes for each half byte of weight, and the float32
tiles, multiplied by the software pipeline's stages, did not fit in shared memory. Without ``g_idx``
the tile's ``BLOCK_K`` divides the group size where a power of two from 16 up can, so the whole tile
lies in one group and its scales and zero points are one ``[BLOCK_N]`` vector each; with ``g_idx``
(activation order), or a group size no such block divides, they are gathered per value from the few
group columns of each row (cached), and the tiles are smaller to keep the gathers' stages inside
shared memory.

One program computes a ``BLOCK_M x BLOCK_N`` tile of the output over one of ``SPLIT_K`` slices of
the input. Decode steps (a few rows) have too few output tiles to fill the GPU, so their input is
split and the float32 partial sums added afterwards in a fixed order (deterministic, and the same
number of launches whatever the batch: capture-safe); prefill steps take one slice and wider tiles.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction


@triton.jit
def dequantized_tile(
    w_ptr, s_ptr, z_ptr, g_ptr, rows_n, n_mask, k0, K, stride_wn, stride_sn,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, GROUP_TILE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """Rows `rows_n` (int64 [BLOCK_N], masked by `n_mask`), columns [k0, k0 + BLOCK_K) of a packed
    integer weight, dequantized to float32 [BLOCK_N, BLOCK_K] (the integer linear layer's and the
    MoE grouped GEMM's tile; the pointers are one weight's, an expert's in the grouped GEMM)."""
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = BLOCK_K // PER
    offs_k = k0 + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    shifts = tl.arange(0, PER) * BITS  # value j of a word sits in its bits [j * BITS, (j + 1) * BITS)
    # k0 is a multiple of BLOCK_K, hence of PER, and K of PER: a word is all inside K or all past it.
    offs_w = k0 // PER + tl.arange(0, WORDS)
    words = tl.load(w_ptr + rows_n[:, None] * stride_wn + offs_w[None, :],
                    mask=n_mask[:, None] & (offs_w < K // PER)[None, :], other=0)  # fmt: skip
    q = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    q = tl.reshape(q, [BLOCK_N, BLOCK_K])  # row-major: column word * PER + j, as packed
    if GROUP_TILE:  # the tile lies in group k0 // GROUP: one scale and zero point per row
        g = k0 // GROUP
        s = tl.load(s_ptr + rows_n * stride_sn + g, mask=n_mask, other=0.0)[:, None]
        z = tl.load(z_ptr + rows_n * stride_sn + g, mask=n_mask, other=0.0)[:, None]
    else:
        if HAS_G_IDX:  # noqa: SIM108 - a constexpr branch, resolved when the kernel compiles
            g = tl.load(g_ptr + offs_k, mask=k_mask, other=0)
        else:
            g = offs_k // GROUP
        wk_mask = n_mask[:, None] & k_mask[None, :]
        s = tl.load(s_ptr + rows_n[:, None] * stride_sn + g[None, :], mask=wk_mask, other=0.0)
        z = tl.load(z_ptr + rows_n[:, None] * stride_sn + g[None, :], mask=wk_mask, other=0.0)
    # Dequantized in registers. Columns past K are finite and meet x's zeros.
    return (q.to(tl.float32) - z) * s


@triton.jit
def _int_linear_kernel(
    x_ptr, w_ptr, s_ptr, z_ptr, g_ptr, y_ptr,
    M, N, K, K_PER_SPLIT,
    stride_xm, stride_wn, stride_sn, stride_ys, stride_ym,
    BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr, GROUP_TILE: tl.constexpr,
    IEEE: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    k_lo = tl.program_id(2) * K_PER_SPLIT
    m_mask, n_mask = offs_m < M, offs_n < N
    rows_n = offs_n.to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(k_lo, tl.minimum(k_lo + K_PER_SPLIT, K), BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & (offs_k < K)[None, :], other=0.0)  # fmt: skip
        w = dequantized_tile(w_ptr, s_ptr, z_ptr, g_ptr, rows_n, n_mask, k0, K, stride_wn, stride_sn, BITS, GROUP,
                             HAS_G_IDX, GROUP_TILE, BLOCK_N, BLOCK_K)  # fmt: skip
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


class Config(NamedTuple):
    """One launch's tiles: BLOCK_M x BLOCK_N outputs over BLOCK_K inputs a step; `group_tile`: each
    step's BLOCK_K columns lie in one group (one scale and zero point per row)."""

    block_m: int
    block_n: int
    block_k: int
    group_tile: bool
    num_warps: int
    num_stages: int


def group_block_k(group: int, widest: int) -> int:
    """The widest power of two from 16 (tl.dot's least K) up to `widest` that divides `group`, or 0."""
    block_k = widest
    while block_k >= 16 and group % block_k:
        block_k //= 2
    return block_k if block_k >= 16 else 0


def config(m: int, bits: int, group: int, has_g_idx: bool, dtype: torch.dtype, cuda: bool) -> Config:
    """The tiles for a step of `m` rows. On CUDA each pipeline stage holds an x tile and a packed-word
    tile in shared memory (plus, on the per-value path, two float32 [BLOCK_N, BLOCK_K] gathers),
    sized to stay far inside Hopper's 227 KB; the dequantized tile lives in registers. The sizes are
    the fastest of those timed on an H200 (decode [4096 x 4096], group 128: 20 us). The interpreter
    takes small tiles, so a group of several tiles and one of a tile both occur."""
    if not cuda:
        return _config(16, 16, 32, 32, group, has_g_idx, warps=4, stages=1, per_value_stages=1)
    if dtype == torch.float32:  # float32 x tiles, and a float32 weight tile in the FMA dot's registers
        return _config(16 if m <= 16 else 64, 64 if m <= 16 else 128, 32, 32, group, has_g_idx, warps=4, stages=2,
                       per_value_stages=2)  # fmt: skip
    if m <= 16:  # decode: memory-bound; wide tiles keep more of the weight in flight
        # per-value: the gathers' stages at [64, 64] x 2 x float32 are 32 KB each
        return _config(16, 128, 128, 64, group, has_g_idx, warps=4, stages=4, per_value_stages=3, per_value_n=64)
    return _config(64, 128, 128, 32, group, has_g_idx, warps=4, stages=3, per_value_stages=2)


def tile_k(group: int, has_g_idx: bool, widest: int, per_value_k: int) -> tuple[int, bool]:
    """(BLOCK_K, whether each tile lies in one group): the widest block up to `widest` that divides
    the group, where the groups run in order and one does; else `per_value_k`, the scales and zero
    points gathered per value (`dequantized_tile`'s two paths; the integer linear layer's and the MoE
    grouped GEMM's choice)."""
    block_k = 0 if has_g_idx else group_block_k(group, widest)
    return (block_k, True) if block_k else (per_value_k, False)


def _config(
    block_m: int, block_n: int, widest: int, per_value_k: int, group: int, has_g_idx: bool, warps: int,
    stages: int, per_value_stages: int, per_value_n: int | None = None,
) -> Config:  # fmt: skip
    block_k, group_tile = tile_k(group, has_g_idx, widest, per_value_k)
    if group_tile:
        return Config(block_m, block_n, block_k, True, warps, stages)
    # Per-value scales and zero points: their float32 gathers go through the stages too.
    return Config(block_m, per_value_n or block_n, block_k, False, warps, per_value_stages)


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
    cfg = config(m, bits, group, g_idx is not None, x.dtype, x.is_cuda)
    # Four programs a multiprocessor (timed: long inputs gain); the interpreter's 4 split decode steps too.
    programs = 4 * torch.cuda.get_device_properties(x.device).multi_processor_count if x.is_cuda else 4
    splits = split_k(m, n, k, cfg.block_m, cfg.block_n, cfg.block_k, programs)
    k_per_split = triton.cdiv(triton.cdiv(k, splits), cfg.block_k) * cfg.block_k  # slices start on tiles
    splits = triton.cdiv(k, k_per_split)
    partial = torch.empty((splits, m, n), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, cfg.block_m), triton.cdiv(n, cfg.block_n), splits)
    _int_linear_kernel[grid](
        x, packed, scales, zeros, g_idx if g_idx is not None else packed, partial,
        m, n, k, k_per_split,
        x.stride(0), packed.stride(0), scales.stride(0), partial.stride(0), partial.stride(1),
        BITS=bits, GROUP=group, HAS_G_IDX=g_idx is not None, GROUP_TILE=cfg.group_tile,
        IEEE=x.dtype == torch.float32,
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; GPUs never take this path.
        DOT_FP32=INTERPRETED and x.dtype != torch.float32,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )  # fmt: skip
    y = partial[0] if splits == 1 else partial.sum(0)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
