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

Sliding windows and soft-capping (``window`` and ``softcap``, per layer; 0: none) are plain
arguments of the launch and compile-time flags (SLIDING, SOFTCAP), so a layer without them runs the
very kernel it ran before they existed, and neither the grid nor the decode splits depend on them.
A windowed program starts its key loop at the window start of its earliest query (the ragged
kernel: its query block's first query's; a decode: ``max(ctx - window, 0)``), so no key before it
is loaded, nor its table entry: the blocks wholly before every window may be freed while a request
grows, their entries left as -1. Decode splits cut the window's span instead of the whole context.
Soft-capping bends each score through ``softcap * tanh(score / softcap)`` before the mask and the
softmax, the fused new key's included.

Grouped-query attention needs no copy of the pool, and each K/V tile is read once per query block:
a program takes all the query heads that share its K/V head (``GROUP`` of them; query head ``h``
reads K/V head ``h // GROUP``) and stacks them into the rows of one tile, ``BLOCK_M`` queries by
``HEADS`` heads, query-major (row ``r`` is query ``r // HEADS``, head ``r % HEADS`` of the group).
Every K and V tile it loads then feeds one dot product for the whole group, and decode, whose
single query would leave most of a 16-row tile masked, fills those rows with the group's heads
instead. ``HEADS`` is the group rounded up to a power of two (padded heads are masked); groups past
``_MAX_HEADS`` are split over several programs per K/V head. GROUP == 1 is plain multi-head.

Decode-only steps (one query per request) take a split-K path instead, flash-decoding style. The
ragged grid would give them one program per (request, K/V head), 16 for GPT-2 medium at batch 1
against an H100's 132 SMs, each walking the whole context alone. ``_decode_split_kernel`` adds a
third grid axis that cuts each request's keys into ``NUM_SPLITS`` ranges of whole ``BLOCK_N``
tiles, computed on the device from ``context_lens`` (splits past the context have nothing to do),
and writes each split's unnormalised partial (acc, running max m, sum l) to fp32 scratch;
``_decode_reduce_kernel`` then merges the splits of each (request, head) with the log-sum-exp
rescaling. ``NUM_SPLITS`` comes from the batch size, the K/V-head programs and the SM count alone
(`decode_splits`), never from the context lengths, so the grid is fixed per batch size and one
CUDA graph captured per batch size replays for any contexts. A request of context 0 (a padded row
of such a graph's batch) reads no K/V and gets zeros, as it does from the ragged kernel; its slot
-1 makes `write_kv_triton` write nothing for it.

The split kernel also takes over the launches before it in a decode: `write_kv_attention_triton`
has it write this step's K/V to the pool (FUSED_WRITE), and `rotary_write_kv_attention_triton`
(the Llama family) has it apply the rotary embedding to the query and the new key first (ROTARY),
with the same fp32 math and rounding as `rotary_triton`: one launch (+ the reduce) where there
were three. Other batches run the separate kernels.

FP8 pools (KV_FP8, attention.py's contract): every kernel loads the codes and reads them back as
code * scale of its K/V head, rounded to the model's dtype, before the dot products; the write
kernel and the fused write store fp8(x / scale), clamped to the format's largest value, and the
fused write attends with the new key and value as read back from what it stores.
"""

from __future__ import annotations

import functools
import math

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from . import triton_rotary
from .attention import AttentionMetadata, KVScales, check_kv_scales, check_window, gqa_group_size, is_fp8_pool
from .rotary import check_rotary_args


@triton.jit
def _soft_cap(x, cap):
    """``cap * tanh(x)``, fp32. tanh as ``1 - 2 / (e^2x + 1)``: Triton's interpreter has no libdevice
    tanh, and this form saturates to exactly +-cap where e^2x overflows to inf or underflows to 0
    (the naive ratio of exponentials would give inf / inf = NaN there)."""
    return cap * (1.0 - 2.0 / (tl.exp2(x * 2.885390081777927) + 1.0))  # e^2x = 2^(2 log2(e) x)


@triton.jit
def _kv_head_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_FP8: tl.constexpr):
    """(k_scale, v_scale) of a K/V head of an FP8 pool (KV_FP8), else 1 (unread)."""
    if KV_FP8:
        return tl.load(k_scale_ptr + kv_head), tl.load(v_scale_ptr + kv_head)
    return 1.0, 1.0


@triton.jit
def _quantize(x, scale, FP8_MAX: tl.constexpr, CACHE_DTYPE: tl.constexpr):
    """x as an FP8 pool stores it: x / scale in fp32, clamped to the format's largest finite value,
    rounded to nearest (attention.py's quantize_kv)."""
    y = x.to(tl.float32) / scale
    return tl.minimum(tl.maximum(y, -FP8_MAX), FP8_MAX).to(CACHE_DTYPE)


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
    cap,
    window,
    MASKED: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    k_scale,
    v_scale,
    KV_FP8: tl.constexpr,
    KV_DTYPE: tl.constexpr,
):
    """Folds keys [lo, hi) into the running (acc, l_i, m_i); MASKED tiles straddle the causal edge.
    k_base/v_base point at the K/V head in pool slot 0; table_row at the request's block table row.
    Only keys in [lo, hi) are loaded, and their table entries: lo need not be a tile multiple.

    Scores are ``dot * qk_scale`` in log2 units, or with SOFTCAP ``cap * tanh(dot * qk_scale)``, the
    caller passing qk_scale = scale / softcap and cap = softcap * log2(e): Gemma 2's
    ``softcap * tanh(scale * q.k / softcap)`` in log2 units, with the constants folded on the host.
    SLIDING (with MASKED): the tiles straddle a window's lower edge too, key j visible to the row at
    q_pos only if q_pos - window < j <= q_pos. KV_FP8: the pool holds FP8
    codes, read back as code * scale (the K/V head's k_scale, v_scale) rounded to KV_DTYPE, the
    model's dtype (attention.py)."""
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
        if KV_FP8:
            k = (k.to(tl.float32) * k_scale).to(KV_DTYPE)
            v = (v.to(tl.float32) * v_scale).to(KV_DTYPE)
        if DOT_FP32:
            k = k.to(tl.float32)
            v = v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=INPUT_PRECISION) * qk_scale  # [M, N], log2 units
        if SOFTCAP:  # before the mask, as the reference: masked keys stay -inf
            s = _soft_cap(s, cap)
        if MASKED:
            visible = offs_n[None, :] <= q_pos[:, None]
            if SLIDING:
                visible = visible & (offs_n[None, :] > q_pos[:, None] - window)
            s = tl.where(visible, s, float("-inf"))
        # Without a window every row sees the range's first key (key 0 for the ragged kernel, the
        # split's first for the decode kernel), which lies in the first tile processed, so m_new is
        # finite here. With one, a row whose window starts past this tile has seen no key yet and
        # m_new is -inf: it subtracts 0 instead of -inf (NaN), and keeps m_i = -inf, acc = l = 0.
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        m_ref = m_new
        if SLIDING:
            m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_ref)
        p = tl.exp2(s - m_ref[:, None])
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
    cap,
    window,
    k_scale_ptr,
    v_scale_ptr,
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
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
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
    k_scale, v_scale = _kv_head_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_FP8)
    KV_DTYPE: tl.constexpr = q_ptr.dtype.element_ty

    # Negative only for a request with fewer keys than queries: the padding request of a mixed CUDA
    # graph's bucket (context 0), whose key ranges the clamps below make empty (zeros out).
    first_pos = ctx - n + m_start
    if SLIDING:
        # The loop starts at the block's first query's window start, unaligned: no key before it
        # is loaded, nor its table entry (the blocks wholly before it may be freed, their entries
        # -1). Keys from the last query's window start to the first query's position are visible
        # to every row: whole tiles there skip the masks; the tiles below them get the window's
        # lower edge, the tiles above the causal edge (both masks in each, for the rows between).
        kv_end = tl.maximum(tl.minimum(first_pos + BLOCK_M, ctx), 0)  # past the block's last query position
        kv_lo = tl.maximum(first_pos - window + 1, 0)
        shared_lo = tl.maximum(kv_end - window, kv_lo)  # the last query's window start
        mid_lo = tl.minimum(kv_lo + tl.cdiv(shared_lo - kv_lo, BLOCK_N) * BLOCK_N, kv_end)
        mid_hi = mid_lo + tl.maximum(first_pos + 1 - mid_lo, 0) // BLOCK_N * BLOCK_N
        # fmt: off
        acc, l_i, m_i = _attention_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, kv_lo, mid_lo,
            qk_scale, cap, window, True, True, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            INPUT_PRECISION, DOT_FP32, k_scale, v_scale, KV_FP8, KV_DTYPE,
        )
        acc, l_i, m_i = _attention_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, mid_lo, mid_hi,
            qk_scale, cap, window, False, False, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            INPUT_PRECISION, DOT_FP32, k_scale, v_scale, KV_FP8, KV_DTYPE,
        )
        acc, l_i, m_i = _attention_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, mid_hi, kv_end,
            qk_scale, cap, window, True, True, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            INPUT_PRECISION, DOT_FP32, k_scale, v_scale, KV_FP8, KV_DTYPE,
        )
        # fmt: on
    else:
        # Keys up to the query block's first query position are visible to every row (every head
        # of the group alike): those whole BLOCK_N key tiles skip all masking. The rest, up to the
        # last query's position, get the causal mask.
        full_end = tl.maximum(first_pos + 1, 0) // BLOCK_N * BLOCK_N
        kv_end = tl.maximum(tl.minimum(first_pos + BLOCK_M, ctx), 0)
        # fmt: off
        acc, l_i, m_i = _attention_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, 0, full_end,
            qk_scale, cap, window, False, False, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            INPUT_PRECISION, DOT_FP32, k_scale, v_scale, KV_FP8, KV_DTYPE,
        )
        acc, l_i, m_i = _attention_inner(
            acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, full_end, kv_end,
            qk_scale, cap, window, True, False, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE,
            INPUT_PRECISION, DOT_FP32, k_scale, v_scale, KV_FP8, KV_DTYPE,
        )
        # fmt: on

    # A request of context 0 (a padding request of a CUDA graph's bucket) saw no key: acc is 0, and
    # so is its output, not 0 / 0.
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
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
    k_scale_ptr,
    v_scale_ptr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + tok).to(tl.int64)
    if slot < 0:
        return  # slot -1 marks a padded row of a CUDA graph's batch: it reads and writes nothing
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h < num_heads)[:, None] & (offs_d < HEAD_DIM)[None, :]
    k = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask)
    v = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask)
    if KV_FP8:  # each head by its own scale
        cache_dtype: tl.constexpr = k_cache_ptr.dtype.element_ty
        k_scale = tl.load(k_scale_ptr + offs_h, mask=offs_h < num_heads, other=1.0)
        v_scale = tl.load(v_scale_ptr + offs_h, mask=offs_h < num_heads, other=1.0)
        k = _quantize(k, k_scale[:, None], FP8_MAX, cache_dtype)
        v = _quantize(v, v_scale[:, None], FP8_MAX, cache_dtype)
    tl.store(k_cache_ptr + slot * stride_kct + offs_h[:, None] * stride_kch + offs_d[None, :], k, mask=mask)
    tl.store(v_cache_ptr + slot * stride_vct + offs_h[:, None] * stride_vch + offs_d[None, :], v, mask=mask)


@triton.jit
def _rotate(x1_ptrs, mask, cos, sin, first_half, HALF: tl.constexpr):
    """Neox rotary of the elements whose first-half partner is at ``x1_ptrs`` (element d of a head
    reads x1 = x[d % HALF] and x2 = x[d % HALF + HALF]): ``x1 cos - x2 sin`` where ``first_half``,
    else ``x2 cos + x1 sin``, in fp32. The same loads, casts and expressions as ``_rotate_heads`` in
    triton_rotary.py (the unfused kernel), so that the compiler sees the same arithmetic (on sm_90
    both compile to the same mul + fma pairs under fp fusion); the caller rounds the result to the
    storage dtype, as that kernel's store does."""
    x1 = tl.load(x1_ptrs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x1_ptrs + HALF, mask=mask, other=0.0).to(tl.float32)
    return tl.where(first_half, x1 * cos - x2 * sin, x2 * cos + x1 * sin)


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    acc_ptr,
    ml_ptr,
    context_lens_ptr,
    block_tables_ptr,
    k_new_ptr,
    v_new_ptr,
    slot_ptr,
    pos_ptr,
    cos_sin_ptr,
    stride_bt,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_ot,
    stride_oh,
    stride_knt,
    stride_knh,
    stride_vnt,
    stride_vnh,
    stride_cs,
    num_heads,
    num_splits,
    ml_stride,
    qk_scale,
    cap,
    window,
    k_scale_ptr,
    v_scale_ptr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
    GROUP: tl.constexpr,
    HEADS: tl.constexpr,
    ROWS: tl.constexpr,
    HEAD_SPLITS: tl.constexpr,
    DIRECT: tl.constexpr,
    FUSED_WRITE: tl.constexpr,
    ROTARY: tl.constexpr,
    SLIDING: tl.constexpr,
    SOFTCAP: tl.constexpr,
    KV_FP8: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    """Program (request r, K/V-head program g, split s) of a decode-only batch, whose token r is
    request r's single query. Folds the split's keys [s * chunk, min((s + 1) * chunk, ctx)) (counted
    from the window's start with SLIDING, below) into an online softmax for the HEADS query heads of
    its group, stacked as the rows of one tile (ROWS, at least 16 for tl.dot; rows past HEADS or past
    the group are masked), and stores the unnormalised acc, m (log2 units) and l. DIRECT (one
    split): stores the normalised output.

    SLIDING: the query sees only the window's keys [max(ctx - window, 0), ctx), and the splits cut
    that span instead, from its start: the range is still all visible, so no tile needs the
    window's mask, and no key before the window is read, nor its table entry. SOFTCAP: see
    `_attention_inner`; the fused new key's score is capped as well.

    FUSED_WRITE: this step's K/V (k_new, v_new: token r's row) is not in the pool yet. The split
    holding the context's last position takes that key and value from k_new / v_new instead of
    the pool, and the first program of each K/V head stores them at the token's slot (none for
    slot -1). No program reads that slot, so the store races with no load: the write costs no
    launch of its own.

    ROTARY (with FUSED_WRITE): q and k_new are this step's un-rotated query and key (read, never
    written); the kernel applies the neox rotary at positions[r] from the cos/sin table to both
    (see `_rotate`), attends with the rotated query and stores the rotated key: rotary_triton's
    launch fused away too.

    KV_FP8: the pool holds FP8 codes (see `_attention_inner`); with FUSED_WRITE the new key and
    value are quantized for the store and read back from those codes for their own score and sum,
    exactly as a later step reads them from the pool."""
    req = tl.program_id(0).to(tl.int64)
    kv_head = (tl.program_id(1) // HEAD_SPLITS).to(tl.int64)
    head0 = tl.program_id(1) % HEAD_SPLITS * HEADS
    split = tl.program_id(2)
    ctx = tl.load(context_lens_ptr + req)
    # The split's key range, on the device: whole BLOCK_N tiles, so that only the context's last
    # tile needs masking. A split past the context (every split of a context-0 row) gets lo == hi
    # and reads nothing, not even its block table entries.
    if SLIDING:
        # The window only moves the range's start; the number of splits (the grid) stays fixed.
        win_lo = tl.maximum(ctx - window, 0)
        chunk = tl.cdiv(tl.cdiv(ctx - win_lo, num_splits), BLOCK_N) * BLOCK_N
        lo = win_lo + split * chunk
    else:
        chunk = tl.cdiv(tl.cdiv(ctx, num_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
    hi = tl.maximum(tl.minimum(lo + chunk, ctx), lo)
    # The keys read from the pool: all of the range, or with FUSED_WRITE all but the new one.
    pool_hi = tl.maximum(tl.minimum(hi, ctx - 1), lo) if FUSED_WRITE else hi
    full_end = lo + (pool_hi - lo) // BLOCK_N * BLOCK_N
    table_row = block_tables_ptr + req * stride_bt

    offs_r = tl.arange(0, ROWS)
    offs_g = head0 + offs_r  # the row's query head, counted within the group
    heads = kv_head * GROUP + offs_g
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    row_mask = (offs_r < HEADS) & (offs_g < GROUP)
    qo_mask = row_mask[:, None] & d_mask[None, :]
    q_rows = q_ptr + req * stride_qt + heads[:, None] * stride_qh
    if ROTARY:
        # The query and the new key are rotated here, at position positions[r] (a decode's position
        # is its context length - 1), from row positions[r] of the fp32 cos/sin table: element d
        # pairs with d +- HEAD_DIM / 2 and takes angle d % (HEAD_DIM / 2). fp32 math, then ONE
        # rounding to the model dtype (q's: rotary_triton returns q_out and k_out in it), where
        # rotary_triton rounds at its stores; the dot products and the pool see those rounded
        # values, so pool, scores and output are the unfused path's.
        pos = tl.load(pos_ptr + req).to(tl.int64)
        pair = offs_d % (HEAD_DIM // 2)
        first_half = offs_d < HEAD_DIM // 2
        cos = tl.load(cos_sin_ptr + pos * stride_cs + pair, mask=d_mask, other=0.0).to(tl.float32)
        sin = tl.load(cos_sin_ptr + pos * stride_cs + HEAD_DIM // 2 + pair, mask=d_mask, other=0.0).to(tl.float32)
        # fmt: off
        q = _rotate(q_rows + pair[None, :], qo_mask, cos[None, :], sin[None, :], first_half[None, :],
                    HEAD_DIM // 2).to(q_ptr.dtype.element_ty)
        # fmt: on
    else:
        q = tl.load(q_rows + offs_d[None, :], mask=qo_mask, other=0.0)
    if DOT_FP32:
        q = q.to(tl.float32)
    # Every row is the same query and sees every key of the range; the masked tile's causal rule
    # (key <= q_pos) cuts it at the range's end. Splits are whole tiles, so only the context's last
    # tile is ever partial, but the rule holds for any range.
    q_pos = tl.zeros([ROWS], dtype=tl.int32) + (pool_hi - 1)

    m_i = tl.full([ROWS], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    k_base = k_ptr + kv_head * stride_kh
    v_base = v_ptr + kv_head * stride_vh
    k_scale, v_scale = _kv_head_scales(k_scale_ptr, v_scale_ptr, kv_head, KV_FP8)
    KV_DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    # fmt: off
    acc, l_i, m_i = _attention_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, lo, full_end,
        qk_scale, cap, window, False, False, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE,
        INPUT_PRECISION, DOT_FP32, k_scale, v_scale, KV_FP8, KV_DTYPE,
    )
    acc, l_i, m_i = _attention_inner(
        acc, l_i, m_i, q, k_base, v_base, stride_kt, stride_vt, table_row, q_pos, full_end, pool_hi,
        qk_scale, cap, window, True, False, SOFTCAP, HEAD_DIM, BLOCK_N, BLOCK_D, BLOCK_SIZE,
        INPUT_PRECISION, DOT_FP32, k_scale, v_scale, KV_FP8, KV_DTYPE,
    )
    # fmt: on
    if FUSED_WRITE:
        k_row = k_new_ptr + req * stride_knt + kv_head * stride_knh
        if ROTARY:  # rounded to the model dtype as the query (see above), then stored as it is
            k_new = _rotate(k_row + pair, d_mask, cos, sin, first_half, HEAD_DIM // 2).to(q_ptr.dtype.element_ty)
        else:
            k_new = tl.load(k_row + offs_d, mask=d_mask, other=0.0)
        v_new = tl.load(v_new_ptr + req * stride_vnt + kv_head * stride_vnh + offs_d, mask=d_mask, other=0.0)
        if KV_FP8:  # stored as codes; attended as what the pool gives back
            k_store = _quantize(k_new, k_scale, FP8_MAX, k_ptr.dtype.element_ty)
            v_store = _quantize(v_new, v_scale, FP8_MAX, v_ptr.dtype.element_ty)
            k_new = (k_store.to(tl.float32) * k_scale).to(KV_DTYPE)
            v_new = (v_store.to(tl.float32) * v_scale).to(KV_DTYPE)
        else:
            k_store, v_store = k_new, v_new
        if (hi == ctx) & (lo < hi):  # this split holds the new key: one more step of the online softmax
            s_new = tl.sum(q.to(tl.float32) * k_new.to(tl.float32)[None, :], axis=1) * qk_scale
            if SOFTCAP:
                s_new = _soft_cap(s_new, cap)
            m_new = tl.maximum(m_i, s_new)
            alpha = tl.exp2(m_i - m_new)
            p_new = tl.exp2(s_new - m_new)
            l_i = l_i * alpha + p_new
            acc = acc * alpha[:, None] + p_new[:, None] * v_new.to(tl.float32)[None, :]
            m_i = m_new
        slot = tl.load(slot_ptr + req).to(tl.int64)
        if (split == 0) & (head0 == 0) & (slot >= 0):
            tl.store(k_ptr + slot * stride_kt + kv_head * stride_kh + offs_d, k_store, mask=d_mask)
            tl.store(v_ptr + slot * stride_vt + kv_head * stride_vh + offs_d, v_store, mask=d_mask)

    if DIRECT:
        # One split holds the whole context: normalise here, no scratch and no reduce. Context 0
        # leaves acc and l at 0: zeros, not 0 / 0.
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(
            out_ptr + req * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=qo_mask,
        )
    else:
        # Scratch rows are (request, head, split): acc [B, Hq, S, HEAD_DIM], m and l [2, B, Hq, S].
        # An empty split stores m = -inf, l = 0 and acc = 0, which the reduce weighs by 0.
        rows = (req * num_heads + heads) * num_splits + split
        tl.store(acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :], acc, mask=qo_mask)
        tl.store(ml_ptr + rows, m_i, mask=row_mask)
        tl.store(ml_ptr + ml_stride + rows, l_i, mask=row_mask)


@triton.jit
def _decode_reduce_kernel(
    acc_ptr,
    ml_ptr,
    out_ptr,
    stride_ot,
    stride_oh,
    num_splits,
    ml_stride,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    """Program (request r, query head h): merges the num_splits partials of (r, h) into out[r, h].
    With M the largest split max, split s is weighed by 2^(m_s - M): out = sum_s w_s acc_s /
    sum_s w_s l_s. Empty splits (m = -inf) weigh 0; when all are empty (context 0) so is out."""
    req = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    s_mask = offs_s < num_splits
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    rows = (req * tl.num_programs(1) + head) * num_splits + offs_s
    m_s = tl.load(ml_ptr + rows, mask=s_mask, other=float("-inf"))
    l_s = tl.load(ml_ptr + ml_stride + rows, mask=s_mask, other=0.0)
    m_max = tl.max(m_s, axis=0)
    # All splits empty: -inf - -inf would be NaN; any finite stand-in gives every split weight 0.
    m_max = tl.where(m_max == float("-inf"), 0.0, m_max)
    w = tl.exp2(m_s - m_max)
    denom = tl.sum(w * l_s, axis=0)
    acc = tl.load(
        acc_ptr + rows[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(acc * w[:, None], axis=0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(
        out_ptr + req * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=d_mask
    )


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


# Decode splits: the grid should hold about twice as many programs as the GPU has SMs, so that
# every SM has work and a second wave hides the tail; more splits than this only cut the contexts
# finer than a tile or two and grow the reduce. The interpreter takes a few, to exercise the merge.
_DECODE_WAVES = 2
_MAX_DECODE_SPLITS = 16
_INTERPRETER_DECODE_SPLITS = 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_splits(num_requests: int, kv_programs: int, device: torch.device) -> int:
    """Key splits per (request, K/V-head program) for a decode-only batch: the smallest power of two
    that gives the grid (num_requests x kv_programs x splits) at least ``_DECODE_WAVES`` programs per
    SM, at most ``_MAX_DECODE_SPLITS``; 1 for a batch that fills the GPU on its own. Plain integers
    in, so the choice is the same for every batch of a size whatever its context lengths (one CUDA
    graph per batch size replays for all of them); never the metadata's max_context_len either."""
    if device.type != "cuda":
        return _INTERPRETER_DECODE_SPLITS
    index = device.index if device.index is not None else torch.cuda.current_device()
    programs = max(num_requests * kv_programs, 1)
    wanted = triton.cdiv(_DECODE_WAVES * _sm_count(index), programs)
    return min(triton.next_power_of_2(wanted), _MAX_DECODE_SPLITS)


def _score_args(scale: float, softcap: float) -> tuple[float, float]:
    """(qk_scale, cap) for the kernels, which score in log2 units (exp2): scale * log2(e) and no cap,
    or with soft-capping scale / softcap inside the tanh and softcap * log2(e) outside it."""
    if softcap:
        return scale / softcap, softcap * math.log2(math.e)
    return scale * math.log2(math.e), 0.0


def _scale_args(q: torch.Tensor, kv_scales: KVScales | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers of a launch: an FP8 pool's per-head scales, else any tensor (unread)."""
    return (kv_scales.k, kv_scales.v) if kv_scales is not None else (q, q)


def _fp8_max(cache: torch.Tensor) -> float:
    """The FP8 pool's largest finite value, where stores clamp (0.0, unused, for other pools)."""
    return float(torch.finfo(cache.dtype).max) if is_fp8_pool(cache) else 0.0


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int,
    softcap: float,
    block_n: int | None,
    num_splits: int | None,
    new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    rotary: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_scales: KVScales | None = None,
) -> None:
    """A decode-only batch (token i is request i's one query) through the split-K kernels: plain
    integers size the grid and the scratch, and nothing is read back to the host. `new_kv` (k, v,
    slot_mapping): this step's K/V, written to the pool by the same launch (see FUSED_WRITE).
    `rotary` (positions, cos_sin), with `new_kv` only: q and k are rotated by that launch too (see
    ROTARY). `kv_scales`: an FP8 pool's (checked by the caller)."""
    num_requests, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    heads, head_splits = _attention_heads(group)
    kv_programs = num_kv_heads * head_splits
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits must be at least 1, got {num_splits}")
    splits = num_splits or decode_splits(num_requests, kv_programs, q.device)
    block_n = block_n or _attention_blocks(q, 1, heads)[1]
    rows = max(heads, 16)  # the smallest tl.dot tile; rows past the group's heads are masked
    block_d = max(triton.next_power_of_2(head_dim), 16)
    block_tables = meta.block_tables if meta.block_tables.stride(-1) == 1 else meta.block_tables.contiguous()
    direct = splits == 1
    if direct:  # the split kernel writes out itself: no scratch
        acc = ml = out
    else:
        acc = torch.empty((num_requests, num_heads, splits, head_dim), dtype=torch.float32, device=q.device)
        ml = torch.empty((2, num_requests, num_heads, splits), dtype=torch.float32, device=q.device)
    k_new, v_new, slots = new_kv if new_kv is not None else (q, q, meta.slot_mapping)  # unread without FUSED_WRITE
    if k_new.stride(-1) != 1:
        k_new = k_new.contiguous()
    if v_new.stride(-1) != 1:
        v_new = v_new.contiguous()
    if rotary is not None and new_kv is None:
        raise ValueError("the fused rotary needs the fused K/V write (new_kv)")
    positions, cos_sin = rotary if rotary is not None else (slots, q)  # unread without ROTARY
    if positions.stride(0) != 1:
        positions = positions.contiguous()
    if cos_sin.stride(-1) != 1:
        cos_sin = cos_sin.contiguous()
    qk_scale, cap = _score_args(scale, softcap)
    _decode_split_kernel[(num_requests, kv_programs, splits)](
        q,
        k_cache,
        v_cache,
        out,
        acc,
        ml,
        meta.context_lens,
        block_tables,
        k_new,
        v_new,
        slots,
        positions,
        cos_sin,
        block_tables.stride(0),
        q.stride(0),
        q.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        v_cache.stride(0),
        v_cache.stride(1),
        out.stride(0),
        out.stride(1),
        k_new.stride(0),
        k_new.stride(1),
        v_new.stride(0),
        v_new.stride(1),
        cos_sin.stride(0),
        num_heads,
        splits,
        num_requests * num_heads * splits,  # ml's stride between m and l
        qk_scale,
        cap,
        window,
        *_scale_args(q, kv_scales),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        BLOCK_SIZE=meta.block_size,
        INPUT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and q.dtype == torch.bfloat16,
        GROUP=group,
        HEADS=heads,
        ROWS=rows,
        HEAD_SPLITS=head_splits,
        DIRECT=direct,
        FUSED_WRITE=new_kv is not None,
        ROTARY=rotary is not None,
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        KV_FP8=kv_scales is not None,
        FP8_MAX=_fp8_max(k_cache),
        num_warps=4 if block_d <= 64 and rows <= 64 else 8,
        num_stages=2,
    )
    if direct:
        return
    _decode_reduce_kernel[(num_requests, num_heads)](
        acc,
        ml,
        out,
        out.stride(0),
        out.stride(1),
        splits,
        num_requests * num_heads * splits,
        HEAD_DIM=head_dim,
        BLOCK_D=block_d,
        BLOCK_S=triton.next_power_of_2(splits),
        num_warps=1 if block_d <= 64 else 2,
    )


def attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: KVScales | None = None,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_splits: int | None = None,
) -> torch.Tensor:
    """Same contract as ``attention_torch`` (GQA, sliding window and soft-capping included); block
    sizes are overridable for tests and benchmarks (``block_m`` counts queries: a program's tile
    holds them for each head of its group). ``window`` and ``softcap`` are plain numbers (per layer),
    never read from the device, and size nothing: the grid is the same for any of them.

    A decode-only batch (``max_query_len == 1`` and one token per request) takes the split-K
    kernels, with ``num_splits`` key splits per request (default: `decode_splits`; ``block_m`` does
    not apply there); any other batch takes the ragged kernel. An FP8 pool is read with its
    ``kv_scales`` (attention.py)."""
    check_window(window, softcap)
    check_kv_scales(k_cache, kv_scales)
    if q.stride(-1) != 1:
        q = q.contiguous()
    _unit_last_stride(k_cache, "k_cache")
    _unit_last_stride(v_cache, "v_cache")
    num_tokens, num_heads, head_dim = q.shape
    group = gqa_group_size(num_heads, k_cache.shape[1])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    if meta.max_query_len == 1 and num_tokens == meta.num_requests:
        _decode_attention(q, k_cache, v_cache, out, meta, scale, window, softcap, block_n, num_splits,
                          kv_scales=kv_scales)  # fmt: skip
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
    qk_scale, cap = _score_args(scale, softcap)
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
        qk_scale,
        cap,
        window,
        *_scale_args(q, kv_scales),
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
        SLIDING=window > 0,
        SOFTCAP=softcap > 0,
        KV_FP8=kv_scales is not None,
        num_warps=4 if block_d <= 64 and block_m * heads <= 64 else 8,
        num_stages=2,
    )
    return out


def write_kv_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: KVScales | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``write_kv_triton`` of this step's k/v, then ``attention_triton``; for a decode-only batch in
    one launch fewer: the split kernel writes the new K/V itself and takes the new key and value
    from k/v rather than from the pool."""
    check_window(window, softcap)  # before the write: a bad argument leaves the pool as it was
    check_kv_scales(k_cache, kv_scales)
    num_tokens = q.shape[0]
    if not (num_tokens and meta.max_query_len == 1 and num_tokens == meta.num_requests):
        write_kv_triton(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
        return attention_triton(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales, num_splits=num_splits)
    if q.stride(-1) != 1:
        q = q.contiguous()
    _unit_last_stride(k_cache, "k_cache")
    _unit_last_stride(v_cache, "v_cache")
    gqa_group_size(q.shape[1], k_cache.shape[1])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # fmt: off
    _decode_attention(q, k_cache, v_cache, out, meta, scale, window, softcap, None, num_splits,
                      (k, v, meta.slot_mapping), kv_scales=kv_scales)
    # fmt: on
    return out


def rotary_write_kv_attention_triton(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: KVScales | None = None,
    *,
    num_splits: int | None = None,
) -> torch.Tensor:
    """``rotary_triton`` of q and k at ``positions``, then ``write_kv_attention_triton`` of the rotated
    q/k and v: the pool gets the rotated key, and the output is attention with the rotated query.

    A decode-only batch takes ONE split-K launch (+ the reduce when it splits): the split kernel
    rotates the query and the new key itself (ROTARY: positions and the cos/sin row read on the
    device, no host read), rounding them to q's dtype where rotary_triton rounds, so the pool and
    the output are bit for bit the unfused path's. Any other batch calls the two functions.

    q, k and v are only read, on either path (rotary_triton returns new tensors; the fused kernel
    rotates in registers): q and k, views of the fused qkv projection as a rule, are left
    un-rotated, and only the attention output and the pool carry the rotation."""
    num_tokens = q.shape[0]
    check_rotary_args(q, k, positions, cos_sin)
    check_window(window, softcap)
    check_kv_scales(k_cache, kv_scales)
    if not (num_tokens and meta.max_query_len == 1 and num_tokens == meta.num_requests):
        # The module, not a name imported from it: get_ops may reload triton_rotary (interpreter
        # toggling), and this call must take the reloaded kernel.
        q, k = triton_rotary.rotary_triton(q, k, positions, cos_sin)
        return write_kv_attention_triton(q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv_scales,
                                         num_splits=num_splits)  # fmt: skip
    if q.stride(-1) != 1:
        q = q.contiguous()
    _unit_last_stride(k_cache, "k_cache")
    _unit_last_stride(v_cache, "v_cache")
    gqa_group_size(q.shape[1], k_cache.shape[1])
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    # fmt: off
    _decode_attention(q, k_cache, v_cache, out, meta, scale, window, softcap, None, num_splits,
                      (k, v, meta.slot_mapping), (positions, cos_sin), kv_scales)
    # fmt: on
    return out


def write_kv_triton(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:  # fmt: skip
    """Same contract as ``write_kv_torch``: scatters k/v [T, heads, head_dim] into the pool in place
    (quantized where it is FP8), except that a token whose slot is negative (slot -1: a padded row of
    a CUDA graph's batch) is skipped: it writes nothing, so no pool slot changes for it."""
    check_kv_scales(k_cache, kv_scales)
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
        *_scale_args(k, kv_scales),
        HEAD_DIM=head_dim,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        KV_FP8=kv_scales is not None,
        FP8_MAX=_fp8_max(k_cache),
        num_warps=4,
    )
