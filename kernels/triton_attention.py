"""Ragged-batch attention and K/V scatter as Triton kernels (see ``attention.py`` for the semantics).

One launch covers the whole selectively-batched step, prefill and decode requests alike, with no
padding: the grid is (query block, K/V head), and a small table maps every query block to its
request and to the block's first query inside that request. The table is built on the device from
the metadata's tensors and the grid is sized from plain integers alone, so a launch reads nothing
back to the host and a step can be captured as a CUDA graph. Each program streams its request's
keys from the paged pool in tiles of ``BLOCK_N`` with an online softmax in fp32, flash-attention
style, and applies the bottom-right causal rule: query ``t`` of ``n`` sees keys ``0 .. ctx - n + t``.

Paged K/V: key ``j`` of request ``i`` is pool slot ``block_tables[i, j // BLOCK_SIZE] * BLOCK_SIZE +
j % BLOCK_SIZE``. Each key tile looks up the pool block of each of its ``BLOCK_N`` keys (one int32
load per key, shared by the K and V loads), so a tile may straddle any number of pool blocks and
``BLOCK_SIZE`` (the pool's block size, a compile-time constant: one engine uses one) need neither
divide ``BLOCK_N`` nor be a power of two. Table entries past a request's context are never loaded.

Grouped-query attention needs no copy of the pool, and each K/V tile is read once per query block:
a program takes all the query heads that share its K/V head (``GROUP`` of them; query head ``h``
reads K/V head ``h // GROUP``) and stacks them into the rows of one tile, ``BLOCK_M`` queries by
``HEADS`` heads, query-major (row ``r`` is query ``r // HEADS``, head ``r % HEADS`` of the group).
Every K and V tile it loads then feeds one dot product for the whole group, and decode, whose
single query would leave most of a 16-row tile masked, fills those rows with the group's heads
instead. ``HEADS`` is the group rounded up to a power of two (padded heads are masked); groups past
``_MAX_HEADS`` are split over several programs per K/V head. GROUP == 1 is plain multi-head.
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
    table_row,
    q_pos,
    lo,
    hi,
    qk_scale,
    MASKED: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    """Folds keys [lo, hi) into the running (acc, l_i, m_i); MASKED tiles straddle the causal edge.
    k_base/v_base point at the K/V head in pool slot 0; table_row at the request's block table row."""
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM  # constant-folds away when HEAD_DIM is a power of two
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        load_mask = d_mask[None, :]
        if MASKED:
            # Keys past hi (past the context, for the last tile) read no table entry and no K/V.
            in_range = offs_n < hi
            load_mask = load_mask & in_range[:, None]
            blocks = tl.load(table_row + offs_n // BLOCK_SIZE, mask=in_range, other=0)
        else:
            blocks = tl.load(table_row + offs_n // BLOCK_SIZE)  # unmasked tiles end inside the context
        # int64: slot * stride can pass 2**31 in a large pool
        rows = blocks.to(tl.int64) * BLOCK_SIZE + offs_n % BLOCK_SIZE
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
    block_tables_ptr,
    stride_bt,
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
    BLOCK_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    SPLITS: tl.constexpr,
):
    pid = tl.program_id(0)
    # GQA: query heads [g * GROUP, (g + 1) * GROUP) share K/V head g. This program takes HEADS of
    # them (all, unless the group is split over SPLITS programs), starting at head0 of the group.
    kv_head = (tl.program_id(1) // SPLITS).to(tl.int64)
    head0 = tl.program_id(1) % SPLITS * HEADS
    req = tl.load(block_req_ptr + pid)
    m_start = tl.load(block_m_ptr + pid)  # first query of this block, counted within its request
    q_lo = tl.load(query_start_ptr + req)
    n = tl.load(query_start_ptr + req + 1) - q_lo
    if m_start >= n:
        return  # one of the grid's spare programs (see _query_grid): no queries of its own
    ctx = tl.load(context_lens_ptr + req)
    table_row = block_tables_ptr + req.to(tl.int64) * stride_bt

    # BLOCK_M queries x HEADS heads stacked query-major into the rows of one tile: a token's heads
    # sit next to each other in q and out, so each row group is one contiguous HEADS * D run.
    offs_r = tl.arange(0, BLOCK_M * HEADS)
    offs_m = m_start + offs_r // HEADS  # the row's query, counted within its request
    offs_g = head0 + offs_r % HEADS  # the row's query head, counted within the group
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    qo_mask = ((offs_m < n) & (offs_g < GROUP))[:, None] & (offs_d < HEAD_DIM)[None, :]
    q_rows = (q_lo + offs_m).to(tl.int64)
    q = tl.load(
        q_ptr + q_rows[:, None] * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=qo_mask,
        other=0.0,
    )
    if DOT_FP32:
        q = q.to(tl.float32)
    # Each row's position in its context; rows past n or past the group are never stored.
    q_pos = ctx - n + offs_m

    m_i = tl.full([BLOCK_M * HEADS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M * HEADS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M * HEADS, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh

    # Keys up to the query block's first query position are visible to every row (every head of
    # the group alike): those whole BLOCK_N key tiles skip all masking. The rest, up to the last
    # query's position, get the causal mask.
    first_pos = ctx - n + m_start
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_end = tl.minimum(first_pos + BLOCK_M, ctx)
    # fmt: off
    acc, l_i, m_i = _attention_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, 0, full_end,
        qk_scale, False, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE, INPUT_PRECISION, DOT_FP32,
    )
    acc, l_i, m_i = _attention_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, full_end, kv_end,
        qk_scale, True, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE, INPUT_PRECISION, DOT_FP32,
    )
    # fmt: on

    out = acc / l_i[:, None]
    tl.store(
        out_ptr + q_rows[:, None] * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
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


def _query_grid(num_requests: int, num_tokens: int, max_query_len: int, block_m: int) -> int:
    """Programs along the query-block axis: an upper bound on the real count of query blocks,
    sum_i cdiv(n_i, block_m), from plain integers alone, since the n_i stay on the device.

    cdiv(n, m) == 1 + (n - 1) // m, and a sum of floors is at most the floor of the sum, so the
    count is at most B + (T - B) // block_m: at most (T - B) // block_m spare programs, none for a
    decode-only batch. B * cdiv(max_query_len, block_m) is a bound too, and the tighter one when
    every request fits one block (it is then exactly B). The spare programs exit at once (the
    kernel's m_start >= n check)."""
    return min(
        num_requests + (num_tokens - num_requests) // block_m,
        num_requests * triton.cdiv(max_query_len, block_m),
    )


def _query_block_table(meta: AttentionMetadata, block_m: int, num_programs: int) -> torch.Tensor:
    """int32 [2, num_programs]: (request, first query within the request) of every query block (not
    to be confused with the K/V block tables in ``meta``), built by device ops on ``query_start``
    and ``context_lens`` with no host read. Programs past the real count of blocks get a first query
    past their request's last query, and the kernel returns at once for them."""
    query_start = meta.query_start.long()
    n = query_start[1:] - query_start[:-1]
    blocks = (n + block_m - 1) // block_m
    ends = torch.cumsum(blocks, 0)  # request i owns programs [ends[i] - blocks[i], ends[i])
    pid = torch.arange(num_programs, dtype=torch.int64, device=ends.device)
    # A spare program (pid >= ends[-1]) lands on the last request, past its last block.
    req = torch.searchsorted(ends, pid, right=True).clamp_(max=meta.num_requests - 1)
    first = (pid - (ends - blocks)[req]) * block_m
    # Longest blocks first, so the short decode blocks fill in behind them instead of leaving a
    # tail: a sort on the device (no host read), by the keys each block reads; spares go last.
    n_req, ctx = n[req], meta.context_lens[req].long()
    reads = torch.where(first < n_req, torch.minimum(ctx, ctx - n_req + first + block_m), -1)
    order = torch.argsort(reads, descending=True, stable=True)
    return torch.stack((req, first))[:, order].to(torch.int32)


def _unit_last_stride(t: torch.Tensor, name: str) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name} must have a unit head_dim stride, got strides {tuple(t.stride())}")


# Query heads one program stacks into its tile at most; larger groups (multi-query attention over
# many heads) are split over several programs per K/V head, each reading the K/V head's keys.
_MAX_HEADS = 64


def _attention_heads(group: int) -> tuple[int, int]:
    """(query heads per program, a power of two; programs per K/V head) for a GQA group."""
    heads = min(triton.next_power_of_2(group), _MAX_HEADS)
    return heads, triton.cdiv(group, heads)


def _attention_blocks(q: torch.Tensor, max_query_len: int, heads: int) -> tuple[int, int]:
    """(BLOCK_M queries per program, BLOCK_N keys per step); a program's tile is BLOCK_M * heads rows."""
    if q.device.type != "cuda":
        # Interpreter: small tiles keep it fast and still exercise every mask path.
        return max(16 // heads, 1), 16
    # A tile of 16 rows (the smallest tl.dot tile) for decode-heavy batches, whose single query
    # leaves the rest masked, and 64 for prefill; the group's heads take their share of the rows,
    # down to one query per program. fp32 tiles take twice the shared memory, so they stream half
    # as many keys per step.
    rows = 16 if max_query_len <= 16 else 64
    return max(rows // heads, 1), (32 if q.dtype == torch.float32 else 64)


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
    benchmarks (``block_m`` counts queries: a program's tile holds them for each head of its group)."""
    if q.stride(-1) != 1:
        q = q.contiguous()
    _unit_last_stride(k_cache, "k_cache")
    _unit_last_stride(v_cache, "v_cache")
    num_tokens, num_heads, head_dim = q.shape
    group = gqa_group_size(num_heads, k_cache.shape[1])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    heads, splits = _attention_heads(group)
    default_m, default_n = _attention_blocks(q, meta.max_query_len, heads)
    block_m, block_n = block_m or default_m, block_n or default_n
    # Every layer of a step launches with the same tiling: the first builds the table, the others
    # reuse it (kept on the metadata object, which lives for one step).
    num_programs = _query_grid(meta.num_requests, num_tokens, meta.max_query_len, block_m)
    key = ("triton_query_blocks", block_m, num_programs)
    table = meta.kernel_tables.get(key)
    if table is None:
        table = meta.kernel_tables[key] = _query_block_table(meta, block_m, num_programs)
    block_tables = meta.block_tables if meta.block_tables.stride(-1) == 1 else meta.block_tables.contiguous()
    block_d = max(triton.next_power_of_2(head_dim), 16)
    # fp32 inputs would otherwise run the dot products in TF32 on NVIDIA GPUs (~1e-3 error).
    precision = "ieee" if q.dtype == torch.float32 else "tf32"
    grid = (num_programs, k_cache.shape[1] * splits)
    _attention_kernel[grid](
        q,
        k_cache,
        v_cache,
        out,
        table[0],
        table[1],
        meta.query_start,
        meta.context_lens,
        block_tables,
        block_tables.stride(0),
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
        BLOCK_SIZE=meta.block_size,
        INPUT_PRECISION=precision,
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; GPUs never take this path.
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        GROUP=group,
        HEADS=heads,
        SPLITS=splits,
        num_warps=4 if block_d <= 64 and block_m * heads <= 64 else 8,
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
