"""Selective-batching attention on CPU: one C call per layer for requests of few queries
(decodes, speculative verifies, short prompt chunks), one for longer prompts and chunks where the C
kernels are built with AVX-512 (elsewhere those go to SDPA); and the K/V write, one C call per
layer (after `quantize_kv` where the pool is FP8).

The torch reference (`attention_torch`) loops over requests in Python; at 64 decoding requests
that loop costs ~10 ms per layer of GPT-2-small against a ~3 ms memory floor, because each request
is ~6 small ops. The C kernels (csrc/decode_attention.c) do every request in one call each: a
request of at most `SHORT_QUERIES` queries query by query, each as a decode of its own context; a
longer one in tiles of queries whose scores are outer products, up to twice SDPA's speed on AMD CPUs
(docs/cpu-attention.md; `prefill_in_c` says where). float32 and bfloat16 (widened to float32 as it
is read, its output rounded once), each over a pool of its own dtype or an FP8 one (read back
through per-head tables of the 256 codes: `KVScales.tables`); other dtypes use the reference (a
documented choice).

Paged K/V: the C kernels walk each request's block table themselves, reading K/V in place block by
block; for SDPA a prefill's context is gathered through its table (`gather_context`).

Grouped-query attention: the K/V pool may have fewer heads than q (Llama-style GQA, or multi-query
with one KV head); query head h reads KV head h // (q_heads // kv_heads). The C kernels read each
KV head's rows once for its whole group of query heads, so K/V is never repeated; SDPA's
`prefill_attention` takes [kv_heads, ctx, head_dim] K/V as it is.

Sliding window and soft-capping (per layer, as in attention.py): the C kernels walk a request's
table from its first query's window start, so the table entries of blocks wholly before the window
(freed, -1) are never read; for SDPA a prefill's context is gathered from there on.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from orca_kernels import native
from orca_kernels.attention import (
    AttentionMetadata,
    KVScales,
    attention_torch,
    check_kv_scales,
    check_window,
    first_visible_key,
    gather_context,
    gqa_group_size,
    is_fp8_pool,
    prefill_attention,
    quantize_kv,
)

# Requests of at most this many queries in a step (decodes, speculative verifies of 1 + k tokens,
# short prompt chunks) are attended by the C kernel, query by query; longer ones by SDPA, whose
# blocked matmuls win once a request's queries share enough keys.
SHORT_QUERIES = 32


@functools.cache
def load_decode_kernel() -> dict[tuple[torch.dtype, str], ctypes._CFuncPtr]:
    """The kernel's entry points by (query dtype, "fp8" for an FP8 pool, else "") with their
    signatures declared: built once per machine, loaded and declared once per process (every layer
    calls one). Raises NativeBuildError with the reason."""
    p, i64 = native.PTR, native.I64
    # q, q_row_stride, q_head_stride, k_cache, v_cache, out, query_start, context_lens, block_tables,
    # block_table_stride, block_size, num_requests, q_heads, kv_heads, head_dim, max_context, scale,
    # window, softcap, k_lut, v_lut, scratch, num_threads, max_short
    argtypes = [p, i64, i64, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                ctypes.c_float, p, p, p, ctypes.c_int, i64]  # fmt: skip
    names = {(torch.float32, ""): "f32", (torch.float32, "fp8"): "fp8_f32", (torch.bfloat16, ""): "bf16",
             (torch.bfloat16, "fp8"): "fp8_bf16"}  # fmt: skip
    return {key: native.declare("decode_attention", f"orca_decode_attention_{name}", argtypes, None)
            for key, name in names.items()}  # fmt: skip


@functools.cache
def load_prefill_kernel() -> dict[tuple[torch.dtype, str], ctypes._CFuncPtr]:
    """The prefill entry points, keyed as `load_decode_kernel`'s: the decode kernel's arguments
    without scratch; they return 0, or -1 when a thread's work area could not be allocated."""
    p, i64 = native.PTR, native.I64
    argtypes = [p, i64, i64, p, p, p, p, p, p, i64, i64, i64, i64, i64, i64, i64, ctypes.c_float, i64,
                ctypes.c_float, p, p, ctypes.c_int, i64]  # fmt: skip
    names = {(torch.float32, ""): "f32", (torch.float32, "fp8"): "fp8_f32", (torch.bfloat16, ""): "bf16",
             (torch.bfloat16, "fp8"): "fp8_bf16"}  # fmt: skip
    return {key: native.declare("decode_attention", f"orca_prefill_attention_{name}", argtypes, ctypes.c_int)
            for key, name in names.items()}  # fmt: skip


@functools.cache
def prefill_in_c() -> bool:
    """Whether requests of more than SHORT_QUERIES queries go to the C prefill kernel rather than to
    SDPA: where the kernel is built with AVX-512 (16-float vectors). There it measured 1.2-2.0x
    SDPA, whose CPU path runs MKL's AVX2 GEMMs on AMD; built for AVX2 it measured 0.5-1.3x
    (docs/cpu-attention.md)."""
    return native.declare("decode_attention", "orca_attention_lanes", [], ctypes.c_int)() == 16


@functools.cache
def load_write_kv_kernel() -> ctypes._CFuncPtr:
    p, i64 = native.PTR, native.I64
    # k, k_row_stride, v, v_row_stride, k_cache, v_cache, slots, tokens, row_bytes (strides in bytes)
    return native.declare("decode_attention", "orca_write_kv", [p, i64, p, i64, p, p, p, i64, i64], None)


def check_slots(caller: str, slot_mapping: torch.Tensor, tokens: int) -> None:
    """What the C K/V write trusts of a step's slots: a contiguous int64 slot per token."""
    if slot_mapping.dtype != torch.int64 or not slot_mapping.is_contiguous() or slot_mapping.numel() != tokens:
        raise ValueError(f"{caller} needs a contiguous int64 slot per token, got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)} for {tokens} tokens")  # fmt: skip


def check_layout(caller: str, meta: AttentionMetadata) -> None:
    """What the C attention kernels trust of a step's layout: contiguous int32 index tensors, and
    block tables whose every row holds the blocks of the longest context."""
    tables = meta.block_tables
    for index in (meta.query_start, meta.context_lens, tables):
        if index.dtype != torch.int32 or not index.is_contiguous():
            raise ValueError(f"{caller} needs contiguous int32 query_start, context_lens and block_tables")
    if (
        meta.block_size < 1
        or tables.dim() != 2
        or tables.shape[0] < meta.num_requests
        or tables.shape[1] * meta.block_size < meta.max_context_len
    ):
        raise ValueError(
            f"{caller} needs block_size >= 1 and block_tables [requests, >= ceil(max_context_len / "
            f"block_size)], got block_size {meta.block_size}, block_tables {tuple(tables.shape)} for "
            f"{meta.num_requests} requests of up to {meta.max_context_len} tokens"
        )


def write_kv_cpu(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:  # fmt: skip
    """Same contract as `write_kv_torch` (a negative slot writes nothing), one C call for any dtype:
    it copies each token's row of bytes (an FP8 pool's quantized first), and its launch does not
    depend on how many slots are negative (the CUDA-graph path's padded rows; worker/cuda_graphs.py)."""
    check_kv_scales(k_cache, kv_scales)
    if kv_scales is not None:
        k, v = quantize_kv(k, kv_scales.k, k_cache.dtype), quantize_kv(v, kv_scales.v, v_cache.dtype)
    tokens, heads, head_dim = k.shape
    row = heads * head_dim
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()) or k_cache.shape[1:] != (heads, head_dim) \
            or v_cache.shape != k_cache.shape or not (k.dtype == v.dtype == k_cache.dtype == v_cache.dtype):
        raise ValueError(f"write_kv_cpu needs contiguous pools [slots, {heads}, {head_dim}] of k's dtype, got "
                         f"{tuple(k_cache.shape)} {k_cache.dtype} and {tuple(v_cache.shape)} {v_cache.dtype}")  # fmt: skip
    if k.stride(2) != 1 or k.stride(1) != head_dim:
        k = k.contiguous()
    if v.stride(2) != 1 or v.stride(1) != head_dim:
        v = v.contiguous()
    check_slots("write_kv_cpu", slot_mapping, tokens)
    size = k.element_size()
    load_write_kv_kernel()(
        k.data_ptr(), k.stride(0) * size, v.data_ptr(), v.stride(0) * size, k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), tokens, row * size,
    )  # fmt: skip


def attention_cpu(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """Same contract as `attention_torch`: q [tokens, q_heads, head_dim], caches [slots, kv_heads,
    head_dim] with q_heads a multiple of kv_heads (kv_heads == q_heads: multi-head attention);
    `window`, `softcap` and an FP8 pool's `kv_scales` as in attention.py (0, None: none)."""
    tokens, heads, head_dim = q.shape
    kv_heads = k_cache.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.shape[2] != head_dim:
        raise ValueError(
            f"attention_cpu needs k_cache and v_cache of one shape [slots, kv_heads, {head_dim}], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    gqa_group_size(heads, kv_heads)  # ValueError unless heads is a multiple of kv_heads (>= 1)
    check_window(window, softcap)
    check_kv_scales(k_cache, kv_scales)
    fp8 = is_fp8_pool(k_cache)
    if q.dtype not in (torch.float32, torch.bfloat16) or (k_cache.dtype != q.dtype and not fp8) \
            or v_cache.dtype != k_cache.dtype or q.device.type != "cpu":  # fmt: skip
        return attention_torch(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)
    if q.stride(2) != 1 or q.stride(1) != head_dim or not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("attention_cpu needs [tokens, heads, head_dim] rows with contiguous heads and contiguous caches")
    check_layout("attention_cpu", meta)
    tables = meta.block_tables
    out = torch.empty((tokens, heads, head_dim), dtype=q.dtype)
    threads = torch.get_num_threads()
    # per thread: the scores; in bfloat16 also the query widened to float32, and the output
    per_thread = heads * meta.max_context_len
    if q.dtype == torch.bfloat16:
        per_thread += heads * 2 * head_dim
    scratch = torch.empty((threads, per_thread), dtype=torch.float32)
    k_lut, v_lut = kv_scales.tables(k_cache.dtype, q.dtype) if kv_scales is not None else (None, None)
    load_decode_kernel()[(q.dtype, "fp8" if fp8 else "")](
        q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        meta.query_start.data_ptr(), meta.context_lens.data_ptr(), tables.data_ptr(), tables.stride(0),
        meta.block_size, meta.num_requests, heads, kv_heads, head_dim, meta.max_context_len, scale, window,
        softcap, k_lut.data_ptr() if k_lut is not None else None, v_lut.data_ptr() if v_lut is not None else None,
        scratch.data_ptr(), threads, SHORT_QUERIES,
    )  # fmt: skip
    if meta.max_query_len > SHORT_QUERIES and prefill_in_c():
        failed = load_prefill_kernel()[(q.dtype, "fp8" if fp8 else "")](
            q.data_ptr(), q.stride(0), q.stride(1), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
            meta.query_start.data_ptr(), meta.context_lens.data_ptr(), tables.data_ptr(), tables.stride(0),
            meta.block_size, meta.num_requests, heads, kv_heads, head_dim, meta.max_context_len, scale, window,
            softcap, k_lut.data_ptr() if k_lut is not None else None, v_lut.data_ptr() if v_lut is not None else None,
            threads, SHORT_QUERIES,
        )  # fmt: skip
        if failed:
            raise MemoryError("attention_cpu: the prefill kernel could not allocate its per-thread work areas")
    elif meta.max_query_len > SHORT_QUERIES:
        qs, ctxs = meta.host_lens()  # read once per metadata object, shared by every layer
        for i in range(meta.num_requests):
            q_lo, q_hi = qs[i], qs[i + 1]
            if q_hi - q_lo > 1 and not ctxs[i]:  # no key to see (a CUDA graph bucket's padding request)
                out[q_lo:q_hi] = 0
            elif q_hi - q_lo > SHORT_QUERIES:
                # [kv_heads, ctx - start, head_dim] from the first query's window start on:
                # prefill_attention shares each K/V head over its group
                start = first_visible_key(ctxs[i] - (q_hi - q_lo), window)
                ki, vi = gather_context(k_cache, v_cache, meta, i, start, kv_scales, q.dtype)
                out[q_lo:q_hi] = prefill_attention(q[q_lo:q_hi], ki, vi, scale, window, softcap)
    return out
