"""Attention for selective batching: torch reference and the metadata every implementation reads.

The batch is one flattened run of tokens. Request i owns queries
``q[query_start[i]:query_start[i+1]]`` and, after this step's K/V is written, ``context_lens[i]``
tokens of K/V in the per-layer pool. The pool is paged: its flat ``[num_slots, kv_heads, head_dim]``
layout is cut into blocks of ``block_size`` consecutive slots, and row i of ``block_tables`` lists
request i's blocks in context order, so its context token j lives at slot
``block_tables[i][j // block_size] * block_size + j % block_size``. A request's blocks may sit
anywhere in the pool, in any order; within a block its tokens are consecutive slots. Entries of a
row past ``ceil(context_lens[i] / block_size)`` are padding and never read, nor are the slots of
the last block past the context.

A prefill request has as many queries as context (causal over its prompt); a decode request has one
query that sees its whole context; a chunked prefill has n queries over a context of earlier K/V
plus the chunk itself. Queries are always the *last* ``n`` positions of the context, so query ``t``
of ``n`` may see keys ``0 .. context_len - n + t`` (a bottom-right aligned causal mask). The one
exception is a request of context 0, whatever its query count (the padding of a CUDA graph's bucket,
worker/cuda_graphs.py): it reads no K/V and its queries get zeros.

Sliding windows and soft-capping are per layer, so they are arguments of every attention call, not
metadata. ``window > 0`` (Mistral, Qwen2's upper layers, Gemma's local layers): query position ``p``
sees keys ``p - window < j <= p`` only, transformers' rule, so a decode reads its context's last
``window`` keys. Blocks wholly before every window may be freed while a request grows
(core/kv_cache_manager.py): a windowed kernel never reads their table entries, which may then hold
anything (the scheduler leaves -1 there). ``softcap > 0`` (Gemma 2): each score ``s = scale * q.k``
becomes ``softcap * tanh(s / softcap)`` before the mask and the softmax.

FP8 K/V (``kv_cache_dtype`` fp8, vLLM's name): the pool may be ``float8_e4m3fn`` or ``float8_e5m2``,
each layer with its `KVScales` (a float32 scale per K/V head for K and for V). A token's K is
stored as ``fp8(k / k_scale)``, clamped to the format's largest finite value, and every kernel reads
it back as ``float32(stored) * k_scale`` rounded to the model's dtype (q's): attention over an FP8
pool computes exactly what it would over a model-dtype pool holding those dequantized values, the
new token's K/V included (what the tests compare transformers against). V likewise.

Grouped-query attention (Llama 2 70B onwards, Mistral, Qwen2/3): the pool holds ``Hkv`` K/V heads
and q has ``Hq`` heads, a multiple of ``Hkv``; query head ``h`` attends with K/V head
``h // (Hq // Hkv)``, so consecutive query heads share one K/V head (transformers' ``repeat_kv``
order). ``Hkv == Hq`` is ordinary multi-head attention and ``Hkv == 1`` multi-query attention.

The metadata holds the per-request values only as tensors on the batch's device, no host copies, so
that a kernel launch needs no device->host read and a step can be captured as a CUDA graph. This
module's reference and the CPU path's prefill loop read them to the host once per step
(``AttentionMetadata.host_lens``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    """One step's batch layout, as device tensors plus the plain integers a launch is sized by.

    Nothing here is a per-request host list: a kernel launch reads only the tensors and the ints,
    so the step can be captured as a CUDA graph. The torch reference and the CPU path's prefill
    loop, which do need per-request integers on the host, call `host_lens()`.

    Everything derived from the tensors (`host_lens`, `context_slots`, `kernel_tables`) is built at
    its first use and kept on this object for every layer of the step, so the tensors must not be
    changed in place afterwards: a new step builds a new object. (A CUDA graph that captured a
    step re-runs the device-side builds on every replay; `host_lens` cannot be captured at all.)"""

    query_start: torch.Tensor  # int32 [B + 1]: offsets of each request's queries in the flat batch
    context_lens: torch.Tensor  # int32 [B]: K/V tokens of each request after this step's write
    block_tables: torch.Tensor  # int32 [B, max_blocks]: pool blocks in context order, right-padded
    slot_mapping: torch.Tensor  # int64 [T]: pool slot that each new token's K/V is written to
    block_size: int  # slots per block; any value >= 1
    max_query_len: int
    max_context_len: int
    num_requests: int  # B

    def host_lens(self) -> tuple[list[int], list[int]]:
        """(query_start, context_lens) as host lists: a device->host read (a sync on a GPU), made
        once per object and reused by every layer. For the torch reference and the CPU path only,
        never for the Triton launch, which must stay free of host reads."""
        return self._host_lens

    @functools.cached_property
    def _host_lens(self) -> tuple[list[int], list[int]]:
        # One read for both tensors: one sync per step on a GPU instead of two.
        values = torch.cat((self.query_start, self.context_lens)).tolist()
        split = self.query_start.numel()
        return values[:split], values[split:]

    def context_slots(self, i: int, start: int = 0) -> torch.Tensor:
        """int64 [context_lens[i] - start]: the pool slot of each of request i's context tokens from
        position `start` on, in context order, on the block table's device. Table entries before
        `start`'s block are not read (a sliding window's freed blocks). Built from the device table
        on the first call (the context length comes from `host_lens`, read once per object) and
        kept on this object, so every layer of a step reuses it."""
        slots = self._context_slots.get((i, start))
        if slots is None:
            ctx, size = self.host_lens()[1][i], self.block_size
            first = start // size
            blocks = self.block_tables[i, first : -(-ctx // size)].long()
            offsets = torch.arange(size, dtype=torch.int64, device=blocks.device)
            slots = (blocks[:, None] * size + offsets).flatten()[start - first * size : ctx - first * size]
            self._context_slots[(i, start)] = slots
        return slots

    @functools.cached_property
    def _context_slots(self) -> dict[tuple[int, int], torch.Tensor]:
        return {}  # not a dataclass field (no annotation): a per-object cache for context_slots

    @functools.cached_property
    def kernel_tables(self) -> dict[object, torch.Tensor]:
        """Device tensors a kernel derives from this metadata on the device (the Triton launch's
        query-block table), keyed as that kernel chooses: built at the first layer's launch and
        reused by the others. Not a dataclass field."""
        return {}


FP8_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


@dataclass
class KVScales:
    """One layer's FP8 K/V scales: a stored K is fp8(k / k[head]) and reads back as
    float32(stored) * k[head], rounded to the model's dtype; V likewise (see this module's docstring)."""

    k: torch.Tensor  # float32 [kv_heads], on the pool's device
    v: torch.Tensor
    # (pool dtype, model dtype) -> the dequantized value of every FP8 code per head, [kv_heads, 256]
    # float32 for K and for V: the C kernel's tables (`tables`)
    _tables: dict = field(default_factory=dict, repr=False, compare=False)

    def tables(self, pool_dtype: torch.dtype, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The value each of the 256 codes of `pool_dtype` reads back as under each head's scale,
        rounded to `dtype` and held as float32 ([kv_heads, 256] for K and for V): built once per
        layer, then one table lookup an element replaces the conversion and the multiply."""
        tables = self._tables.get((pool_dtype, dtype))
        if tables is None:
            codes = torch.arange(256, dtype=torch.uint8, device=self.k.device).view(pool_dtype)
            every_head = codes.expand(len(self.k), 256)  # [heads, 256]: the layout dequantize_kv reads
            tables = self._tables[(pool_dtype, dtype)] = tuple(
                dequantize_kv(every_head, scale, dtype).float().contiguous() for scale in (self.k, self.v)
            )
        return tables


def is_fp8_pool(cache: torch.Tensor) -> bool:
    return cache.dtype in FP8_KV_DTYPES


def check_kv_scales(k_cache: torch.Tensor, kv_scales: KVScales | None) -> None:
    """An FP8 pool is read and written with its layer's scales, one per K/V head; a model-dtype pool
    with none."""
    if not is_fp8_pool(k_cache):
        if kv_scales is not None:
            raise ValueError(f"kv_scales are for an FP8 K/V pool, got a {k_cache.dtype} one")
        return
    heads = k_cache.shape[1]
    if kv_scales is None or kv_scales.k.shape != (heads,) or kv_scales.v.shape != (heads,) \
            or kv_scales.k.dtype != torch.float32 or kv_scales.v.dtype != torch.float32:  # fmt: skip
        shapes = None if kv_scales is None else (tuple(kv_scales.k.shape), tuple(kv_scales.v.shape))
        raise ValueError(f"an FP8 ({k_cache.dtype}) K/V pool needs float32 KVScales of [{heads}] per K/V head, "
                         f"got {shapes}")  # fmt: skip


def quantize_kv(x: torch.Tensor, scale: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """[T, heads, head_dim] K or V as stored in an FP8 pool: x / scale per head, in float32, clamped to
    the format's largest finite value (as vLLM's saturating conversion), rounded to nearest even."""
    limit = torch.finfo(pool_dtype).max
    return (x.float() / scale[:, None]).clamp(-limit, limit).to(pool_dtype)


def dequantize_kv(stored: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype,
                  heads_first: bool = False) -> torch.Tensor:  # fmt: skip
    """FP8 K or V ([..., heads, head_dim], or with heads_first [heads, ..., head_dim]) read back:
    float32(stored) * scale per head, rounded to `dtype`."""
    per_head = scale[:, None, None] if heads_first else scale[:, None]
    return (stored.float() * per_head).to(dtype)


def write_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
    kv_scales: KVScales | None = None,
) -> None:  # fmt: skip
    """Scatters new K/V ([T, heads, head_dim]) into the pool ([slots, heads, head_dim]) in place,
    quantized where the pool is FP8 (`quantize_kv`). A negative slot (a padded row of a CUDA-graph
    bucket) writes nothing; the reference drops those rows first, a data-dependent shape the kernels
    avoid."""
    check_kv_scales(k_cache, kv_scales)
    if slot_mapping.numel() and bool((slot_mapping < 0).any()):
        keep = slot_mapping >= 0
        k, v, slot_mapping = k[keep], v[keep], slot_mapping[keep]
    if kv_scales is not None:  # torch has no FP8 index_copy_ on CPU: the bytes are copied
        k = quantize_kv(k, kv_scales.k, k_cache.dtype).view(torch.uint8)
        v = quantize_kv(v, kv_scales.v, v_cache.dtype).view(torch.uint8)
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


def write_kv_and_attend(
    write_kv: Callable, attention: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int = 0, softcap: float = 0.0, kv_scales: KVScales | None = None,
) -> torch.Tensor:  # fmt: skip
    """A layer's attention step: this step's K/V into the pool, then attention over it. Kernel sets
    bind their own write_kv and attention (dispatch.py); the Triton set fuses the two for decodes."""
    write_kv(k, v, k_cache, v_cache, meta.slot_mapping, kv_scales)
    return attention(q, k_cache, v_cache, meta, scale, window, softcap, kv_scales)


def rotate_and_attend(
    rotary: Callable, write_kv_attention: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    positions: torch.Tensor, cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
    meta: AttentionMetadata, scale: float, window: int = 0, softcap: float = 0.0, kv_scales: KVScales | None = None,
) -> torch.Tensor:  # fmt: skip
    """A rotary layer's attention step (the Llama family): rotary of this step's q and k at
    `positions`, then `write_kv_attention` of the rotated q/k and v, so the pool holds rotated keys.
    Kernel sets bind their own rotary and write_kv_attention (dispatch.py); the Triton set fuses all
    three into one launch for decodes. q and k are not modified (the rotaries return new tensors)."""
    q, k = rotary(q, k, positions, cos_sin)
    return write_kv_attention(q, k, v, k_cache, v_cache, meta, scale, window, softcap, kv_scales)


def gqa_group_size(num_q_heads: int, num_kv_heads: int) -> int:
    """Query heads per K/V head; a clear error for a head layout no model can have."""
    if num_kv_heads <= 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"grouped-query attention needs the query heads ({num_q_heads}) to be a multiple of the "
            f"K/V heads ({num_kv_heads})"
        )
    return num_q_heads // num_kv_heads


def attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    kv_scales: KVScales | None = None,
) -> torch.Tensor:
    """q: [T, Hq, head_dim]; caches: [slots, Hkv, head_dim] with Hq % Hkv == 0. Returns [T, Hq, head_dim].
    `window`, `softcap` and `kv_scales` (an FP8 pool's) as in this module's docstring (0, None: none)."""
    num_kv_heads = k_cache.shape[1]
    group = gqa_group_size(q.shape[1], num_kv_heads)
    check_window(window, softcap)
    check_kv_scales(k_cache, kv_scales)
    out = torch.empty_like(q)
    qs, ctxs = meta.host_lens()
    q_scaled = q * scale  # for the decode path, once for the whole batch
    for i in range(meta.num_requests):
        q_lo, q_hi = qs[i], qs[i + 1]
        n = q_hi - q_lo
        if ctxs[i] == 0:  # no key to see (a CUDA graph bucket's padding request): zeros, as the kernels give
            out[q_lo:q_hi] = 0
            continue
        start = first_visible_key(ctxs[i] - n, window)  # the first query's window starts here
        ki, vi = gather_context(k_cache, v_cache, meta, i, start, kv_scales, q.dtype)
        if n == 1 and not softcap:
            # Decode: one query over its whole context. Two matmuls and a softmax cost a third of
            # SDPA's CPU dispatch here (which picks its unfused math path for these strided views).
            # A K/V head's `group` query heads are the rows of one matmul against it, so K/V is
            # never repeated; with group 1 this is [heads, 1, head_dim] as for plain multi-head.
            qi = q_scaled[q_lo].view(num_kv_heads, group, -1)
            scores = torch.matmul(qi, ki.transpose(1, 2))  # [Hkv, group, ctx]
            out[q_lo] = torch.matmul(scores.softmax(dim=-1), vi).view(q.shape[1], -1)
            continue
        out[q_lo:q_hi] = prefill_attention(q[q_lo:q_hi], ki, vi, scale, window, softcap)
    return out


def check_window(window: int, softcap: float) -> None:
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0 (0: none), got {window} and {softcap}")


def first_visible_key(position: int, window: int) -> int:
    """The first key a query at `position` sees: 0, or with a sliding window the window's start."""
    return max(position - window + 1, 0) if window else 0


def gather_context(
    k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, i: int, start: int = 0,
    kv_scales: KVScales | None = None, dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Request i's context K and V from position `start` on, copied out of the paged pool, each
    [Hkv, ctx - start, head_dim]; an FP8 pool's dequantized to `dtype` (the model's) with its scales."""
    slots = meta.context_slots(i, start)
    if kv_scales is None:
        return k_cache.index_select(0, slots).transpose(0, 1), v_cache.index_select(0, slots).transpose(0, 1)
    assert dtype is not None, "an FP8 pool is read back in the model's dtype"
    k, v = (cache.view(torch.uint8).index_select(0, slots).view(cache.dtype).transpose(0, 1)
            for cache in (k_cache, v_cache))  # fmt: skip
    return dequantize_kv(k, kv_scales.k, dtype, heads_first=True), dequantize_kv(v, kv_scales.v, dtype, heads_first=True)


def prefill_attention(
    qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, scale: float, window: int = 0, softcap: float = 0.0
) -> torch.Tensor:
    """One request's n queries ([n, Hq, head_dim]) over keys ([Hkv, keys, head_dim]) that end at
    the last query's position: query t of n sits at key index `keys - n + t`. With a sliding window
    the keys may start past the context's first (at the first query's window: `gather_context`);
    the window's rule reads key indices relative to that start as well."""
    n, keys = qi.shape[0], ki.shape[1]
    gqa = gqa_group_size(qi.shape[1], ki.shape[0]) > 1
    if not (window or softcap):
        # SDPA broadcasts each K/V head over its query heads itself (no repeat_interleave copy); the
        # flag is passed only for GQA so that multi-head attention takes exactly the path it always did.
        mask = None
        if n < keys:  # queries are the last n positions: bottom-right aligned causal mask
            rows = torch.arange(n, device=qi.device)[:, None] + (keys - n)
            mask = torch.arange(keys, device=qi.device)[None, :] <= rows
        # A batch of one: on CPU only 4-D inputs take torch's fused flash-attention kernel (3-D ones
        # fall back to the unfused math path: 2.7-3.4x slower on a 512-token prompt).
        oi = F.scaled_dot_product_attention(
            qi.transpose(0, 1)[None], ki[None], vi[None], attn_mask=mask, is_causal=(n == keys), scale=scale,
            **({"enable_gqa": True} if gqa else {}),
        )  # fmt: skip
        return oi[0].transpose(0, 1)
    # Soft-capping sits between the scores and the softmax, where SDPA takes nothing: the scores
    # are computed here, in fp32 as transformers' eager attention does for Gemma.
    group = qi.shape[1] // ki.shape[0]
    k_rep = ki.repeat_interleave(group, dim=0) if group > 1 else ki  # [Hq, keys, d]
    v_rep = vi.repeat_interleave(group, dim=0) if group > 1 else vi
    scores = torch.matmul(qi.transpose(0, 1), k_rep.transpose(1, 2)) * scale  # [Hq, n, keys]
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    pos = torch.arange(n, device=qi.device)[:, None] + (keys - n)  # each query's key index
    key = torch.arange(keys, device=qi.device)[None, :]
    visible = key <= pos
    if window:
        visible &= key > pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores.float(), dim=-1).to(vi.dtype)
    return torch.matmul(probs, v_rep).transpose(0, 1)
