"""Attention for selective batching: torch reference and the metadata every implementation reads.

The batch is one flattened run of tokens. Request i owns queries
``q[query_start[i]:query_start[i+1]]`` and a contiguous K/V region of the per-layer pool starting at
slot ``kv_starts[i]``; after this step's K/V is written the region holds ``context_lens[i]`` tokens.
A prefill request has as many queries as context (causal over its prompt); a decode request has one
query that sees its whole context. Queries are always the *last* ``n`` positions of the context, so
query ``t`` of ``n`` may see keys ``0 .. context_len - n + t``.

Grouped-query attention (Llama 2 70B onwards, Mistral, Qwen2/3): the pool holds ``Hkv`` K/V heads
and q has ``Hq`` heads, a multiple of ``Hkv``; query head ``h`` attends with K/V head
``h // (Hq // Hkv)``, so consecutive query heads share one K/V head (transformers' ``repeat_kv``
order). ``Hkv == Hq`` is ordinary multi-head attention and ``Hkv == 1`` multi-query attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    query_start: torch.Tensor  # int32 [B + 1]: offsets of each request's queries in the flat batch
    context_lens: torch.Tensor  # int32 [B]: K/V tokens of each request after this step's write
    kv_starts: torch.Tensor  # int32 [B]: first pool slot of each request's K/V region
    slot_mapping: torch.Tensor  # int64 [T]: pool slot that each new token's K/V is written to
    max_query_len: int
    max_context_len: int
    # Host copies, so the per-request torch loop does not sync a device tensor in every layer.
    query_start_host: list[int]
    context_lens_host: list[int]
    kv_starts_host: list[int]

    @property
    def num_requests(self) -> int:
        return len(self.context_lens_host)


def write_kv_torch(
    k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Scatters new K/V ([T, heads, head_dim]) into the pool ([slots, heads, head_dim]) in place."""
    k_cache.index_copy_(0, slot_mapping, k)
    v_cache.index_copy_(0, slot_mapping, v)


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
) -> torch.Tensor:
    """q: [T, Hq, head_dim]; caches: [slots, Hkv, head_dim] with Hq % Hkv == 0. Returns [T, Hq, head_dim]."""
    num_kv_heads = k_cache.shape[1]
    group = gqa_group_size(q.shape[1], num_kv_heads)
    out = torch.empty_like(q)
    qs, ctxs, starts = meta.query_start_host, meta.context_lens_host, meta.kv_starts_host
    q_scaled = q * scale  # for the decode path, once for the whole batch
    for i in range(meta.num_requests):
        q_lo, q_hi, ctx, kv_lo = qs[i], qs[i + 1], ctxs[i], starts[i]
        n = q_hi - q_lo
        ki = k_cache[kv_lo : kv_lo + ctx].transpose(0, 1)  # [Hkv, ctx, head_dim]
        vi = v_cache[kv_lo : kv_lo + ctx].transpose(0, 1)
        if n == 1:
            # Decode: one query over its whole context. Two matmuls and a softmax cost a third of
            # SDPA's CPU dispatch here (which picks its unfused math path for these strided views).
            # A K/V head's `group` query heads are the rows of one matmul against it, so K/V is
            # never repeated; with group 1 this is [heads, 1, head_dim] as for plain multi-head.
            qi = q_scaled[q_lo].view(num_kv_heads, group, -1)
            scores = torch.matmul(qi, ki.transpose(1, 2))  # [Hkv, group, ctx]
            out[q_lo] = torch.matmul(scores.softmax(dim=-1), vi).view(q.shape[1], -1)
            continue
        out[q_lo:q_hi] = prefill_attention(q[q_lo:q_hi], ki, vi, scale)
    return out


def prefill_attention(qi: torch.Tensor, ki: torch.Tensor, vi: torch.Tensor, scale: float) -> torch.Tensor:
    """One request's n queries ([n, Hq, head_dim]) over its context ([Hkv, ctx, head_dim])."""
    n, ctx = qi.shape[0], ki.shape[1]
    # SDPA broadcasts each K/V head over its query heads itself (no repeat_interleave copy); the
    # flag is passed only for GQA so that multi-head attention takes exactly the path it always did.
    gqa = {"enable_gqa": True} if gqa_group_size(qi.shape[1], ki.shape[0]) > 1 else {}
    mask = None
    if n < ctx:  # queries are the last n positions: bottom-right aligned causal mask
        rows = torch.arange(n, device=qi.device)[:, None] + (ctx - n)
        mask = torch.arange(ctx, device=qi.device)[None, :] <= rows
    oi = F.scaled_dot_product_attention(
        qi.transpose(0, 1), ki, vi, attn_mask=mask, is_causal=(n == ctx), scale=scale, **gqa
    )
    return oi.transpose(0, 1)
