"""Ragged-batch attention and K/V scatter as Triton kernels (see ``attention.py`` for the semantics).

One launch covers the whole selectively-batched step, prefill and decode requests alike, with no
padding: the grid is (query block, head), and a small host-built table maps every query block to
its request and to the block's first query inside that request. Each program streams its request's
keys from the pool (``kv_starts[i] + j``) in blocks with an online softmax in fp32, flash-attention
style, and applies the bottom-right causal rule: query ``t`` of ``n`` sees keys ``0 .. ctx - n + t``.

Grouped-query attention needs no copy of the pool: the program for query head ``h`` simply reads
K/V head ``h // GROUP``. The ``GROUP`` programs that share a K/V head each stream its keys (hits in
L2 when they run close together); packing a group's heads into one program's query rows would read
every key once, which matters for decode-heavy batches, and is left for later.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .attention import AttentionMetadata, gqa_group_size


@triton.jit
def _attention_inner(
    acc,
    l_i,
    m_i,
    q,
    k_base,
    v_base,
    stride_kt,
    stride_vt,
    q_pos,
    lo,
    hi,
    qk_scale,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Folds keys [lo, hi) into the running (acc, l_i, m_i); MASKED blocks straddle the causal edge."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM  # constant-folds away when HEAD_DIM is a power of two
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        rows = offs_n.to(tl.int64)  # int64: slot * stride can pass 2**31 in a large pool
        load_mask = d_mask[None, :]
        if MASKED:
            load_mask = load_mask & (offs_n < hi)[:, None]
        k = tl.load(k_base + rows[:, None] * stride_kt + offs_d[None, :], mask=load_mask, other=0.0)
        v = tl.load(v_base + rows[:, None] * stride_vt + offs_d[None, :], mask=load_mask, other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [M, N], log2 units
        if MASKED:
            s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
        # Every row sees key 0, which lies in the first block processed, so m_new is finite here.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=INPUT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _attention_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_req_ptr,
    block_m_ptr,
    query_start_ptr,
    context_lens_ptr,
    kv_starts_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    GROUP: tl.constexpr,
):
    pid = tl.program_id(0)
    head = tl.program_id(1).to(tl.int64)
    kv_head = head // GROUP  # GQA: query heads [g * GROUP, (g + 1) * GROUP) share K/V head g
    req = tl.load(block_req_ptr + pid)
    m_start = tl.load(block_m_ptr + pid)  # first query of this block, counted within its request
    q_lo = tl.load(query_start_ptr + req)
    n = tl.load(query_start_ptr + req + 1) - q_lo
    ctx = tl.load(context_lens_ptr + req)
    kv_start = tl.load(kv_starts_ptr + req).to(tl.int64)

    offs_m = m_start + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    qo_mask = (offs_m < n)[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = (q_lo + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + offs_d[None, :], mask=qo_mask, other=0.0
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    q_pos = ctx - n + offs_m  # each query's position in its context; rows past n are never stored

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + kv_start * stride_kt + kv_head * stride_kh
    v_base = v_ptr + kv_start * stride_vt + kv_head * stride_vh

    # Keys up to the block's first query position are visible to every row: those whole key
    # blocks skip all masking. The rest, up to the last row's position, get the causal mask.
    first_pos = ctx - n + m_start
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(first_pos + BLOCK_M, ctx)
    # fmt: off
    acc, l_i, m_i = _attention_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, 0, full_end, qk_scale,
        False, HEAD_DIM, BLOCK_N, BLOCK_D, INPUT_PRECISION, DOT_FP32,
    )
    acc, l_i, m_i = _attention_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, q_pos, full_end, kv_end, qk_scale,
        True, HEAD_DIM, BLOCK_N, BLOCK_D, INPUT_PRECISION, DOT_FP32,
    )
    # fmt: on

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=qo_mask,
    )


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    num_heads,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kct,
    stride_kch,
    stride_vct,
    stride_vch,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    tl.store(k_cache_ptr + slot * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


INTERPRETED: bool = not isinstance(_attention_kernel, JITFunction)

# One-entry cache of the block table: every layer of a step passes the same batch layout, so only
# the first layer pays for building it and copying it to the device.
_table_cache: tuple[tuple, torch.Tensor] | None = None


def _block_table(meta: AttentionMetadata, block_m: int, device: torch.device) -> torch.Tensor:
    """int32 [2, num_blocks]: (request, first query within the request) of every query block."""
    global _table_cache
    key = (tuple(meta.query_start_host), tuple(meta.context_lens_host), block_m, device)
    cached = _table_cache
    if cached is not None and cached[0] == key:
        return cached[1]
    qs, ctxs = meta.query_start_host, meta.context_lens_host
    blocks = []  # (keys the block reads, request, first query)
    for i in range(meta.num_requests):
        n, ctx = qs[i + 1] - qs[i], ctxs[i]
        for m in range(0, n, block_m):
            blocks.append((min(ctx, ctx - n + m + block_m), i, m))
    # Longest blocks first, so the short decode blocks fill in behind them instead of leaving a tail.
    blocks.sort(key=lambda b: -b[0])
    table = torch.tensor([[b[1] for b in blocks], [b[2] for b in blocks]], dtype=torch.int32, device=device)
    _table_cache = (key, table)
    return table


def _unit_last_stride(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit head_dim stride, got strides {tuple(t.stride())}")


def _attention_blocks(q: torch.Tensor, max_query_len: int) -> tuple[int, int]:
    if q.device.type != "cuda":
        return 16, 16  # interpreter: small blocks keep it fast and still exercise every mask path
    # Decode-heavy batches waste most of a 64-row block; 16 is the smallest tl.dot tile. fp32 tiles
    # take twice the shared memory, so they stream half as many keys per step.
    return (16 if max_query_len <= 16 else 64), (32 if q.dtype == torch.float32 else 64)


def attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
) -> torch.Tensor:
    """Same contract as ``attention_torch`` (GQA included); block sizes are overridable for tests and
    benchmarks."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    _unit_last_stride(k_cache, "k_cache")
    _unit_last_stride(v_cache, "v_cache")
    num_tokens, num_heads, head_dim = q.shape
    group = gqa_group_size(num_heads, k_cache.shape[1])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    default_m, default_n = _attention_blocks(q, meta.max_query_len)
    block_m, block_n = block_m or default_m, block_n or default_n
    table = _block_table(meta, block_m, q.device)
    block_d = max(triton.next_power_of_2(head_dim), 16)
    # fp32 inputs would otherwise run the dot products in TF32 on NVIDIA GPUs (~1e-3 error).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (table.shape[1], num_heads)
    _attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        table[0],
        table[1],
        meta.query_start,
        meta.context_lens,
        meta.kv_starts,
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        scale * math.log2(math.e),  # the kernel uses exp2
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        INPUT_PRECISION=precision,
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; GPUs never take this path.
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        GROUP=group,
        num_warps=4 if block_d <= 64 else 8,
        num_stages=2,
    )
    return out


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Same contract as ``write_kv_torch``: scatters k/v [T, heads, head_dim] into the pool in place."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    _unit_last_stride(k_cache, "k_cache")
    _unit_last_stride(v_cache, "v_cache")
    num_tokens, num_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    # About 4K elements per program: big enough to saturate bandwidth, small enough for registers.
    block_h = min(triton.next_power_of_2(num_heads), max(4096 // block_d, 1))
    grid = (num_tokens, triton.cdiv(num_heads, block_h))
    _write_kv_kernel[grid](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        num_heads,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        num_warps=4,
    )
