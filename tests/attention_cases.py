"""Ragged selective-batching attention cases shared by the kernel tests (Triton and CPU)."""

from __future__ import annotations

import random

import torch

from orca_kernels import AttentionMetadata

# Each request is (queries, context); the queries are the last positions of the context.
BATCHES = {
    # prefill, decode, a 1-token prompt, a partial prefill (1 < n < ctx), a longer decode
    "mixed": [(20, 20), (1, 37), (1, 1), (5, 30), (1, 50)],
    "prefill_only": [(17, 17), (33, 33), (2, 2)],
    "decode_only": [(1, 5), (1, 40), (1, 16), (1, 1)],
    # chunked prefill: chunks over earlier K/V, starting and ending mid-block and spanning several
    # blocks, beside a first chunk (n == ctx) and a decode
    "chunked": [(7, 40), (16, 48), (3, 19), (12, 12), (1, 33)],
    # speculative decoding's verify steps: a last token and k proposals over earlier K/V, beside a
    # decode, and one of 17 (k = 16, the most a step proposes)
    "speculative": [(5, 41), (1, 30), (3, 12), (17, 60)],
}

# Pool block sizes: one token per block, the engine's default, and one that is neither a power of
# two nor a divisor of the Triton kernel's key tiles (16 and up).
BLOCK_SIZES = [1, 5, 16]


def make_meta(
    device: str | torch.device, requests: list[tuple[int, int]], block_size: int = 16, seed: int = 0
) -> AttentionMetadata:
    """Paged K/V laid out to catch a kernel that assumes anything its block table does not say: the
    used blocks are the odd ones (so an unused block sits between any two, block 0 included),
    shuffled across and within requests; a request's last block is partly unused; and every table
    row ends in padding naming a nonzero, unused block of the pool (random K/V in the tests), so a
    kernel reading a table entry past the context gets wrong results, not a crash."""
    counts = [-(-ctx // block_size) for _, ctx in requests]
    blocks = list(range(1, 2 * sum(counts), 2))
    random.Random(seed).shuffle(blocks)
    pad = 2 * sum(counts)  # the pool's last block, never used
    tables, used = [], 0
    for count in counts:
        tables.append(blocks[used : used + count])
        used += count
    width = max(counts) + 1  # at least one padding entry in every row
    query_start, slot_mapping = [0], []
    for (n, ctx), table in zip(requests, tables, strict=True):
        query_start.append(query_start[-1] + n)
        slot_mapping.extend(table[j // block_size] * block_size + j % block_size for j in range(ctx - n, ctx))
    context_lens = [ctx for _, ctx in requests]
    return AttentionMetadata(
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor(
            [table + [pad] * (width - len(table)) for table in tables], dtype=torch.int32, device=device
        ),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        block_size=block_size,
        max_query_len=max(n for n, _ in requests),
        max_context_len=max(context_lens),
        num_requests=len(requests),
    )


def decode_meta(device: str | torch.device, contexts: list[int], block_size: int, seed: int = 0) -> AttentionMetadata:
    """A decode-only batch (one query each) over `contexts`, laid out as `make_meta` lays them out."""
    return make_meta(device, [(1, ctx) for ctx in contexts], block_size=block_size, seed=seed)


def with_padded_rows(live: AttentionMetadata, pad_after: list[int]) -> tuple[AttentionMetadata, list[int]]:
    """The live decode batch with a padded row (context 0, slot -1, a table row naming the pool's
    unused, NaN-filled last block) inserted after each live row listed in pad_after, as a CUDA
    graph's batch-size bucket pads a smaller batch. Returns the metadata and the live rows' places."""
    device = live.context_lens.device
    pad_block = int(live.block_tables.max())
    width = live.block_tables.shape[1]
    ctx, tables, slots, places = [], [], [], []
    for i in range(live.num_requests):
        places.append(len(ctx))
        ctx.append(int(live.context_lens[i]))
        tables.append(live.block_tables[i].tolist())
        slots.append(int(live.slot_mapping[i]))
        for _ in range(pad_after.count(i)):
            ctx.append(0)
            tables.append([pad_block] * width)
            slots.append(-1)
    rows = len(ctx)
    meta = AttentionMetadata(
        query_start=torch.arange(rows + 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=device),
        block_tables=torch.tensor(tables, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_size=live.block_size,
        max_query_len=1,
        max_context_len=max(ctx),
        num_requests=rows,
    )
    return meta, places


def with_padding_request(live: AttentionMetadata, pad_tokens: int, empty: int) -> AttentionMetadata:
    """The live batch padded as a mixed CUDA graph's token bucket pads it: `pad_tokens` more tokens
    (slot -1) owned by one padding request of context 0 whose table row names the pool's unused last
    block, then `empty` requests of no token; the host integers are the bucket's (its token count as
    the longest query)."""
    device = live.context_lens.device
    width = live.block_tables.shape[1]
    tokens = int(live.query_start[-1]) + pad_tokens
    pad_rows = torch.full((1 + empty, width), int(live.block_tables.max()), dtype=torch.int32, device=device)
    return AttentionMetadata(
        query_start=torch.cat([live.query_start, torch.full((1 + empty,), tokens, dtype=torch.int32, device=device)]),
        context_lens=torch.cat([live.context_lens, torch.zeros(1 + empty, dtype=torch.int32, device=device)]),
        block_tables=torch.cat([live.block_tables, pad_rows]),
        slot_mapping=torch.cat([live.slot_mapping, torch.full((pad_tokens,), -1, dtype=torch.int64, device=device)]),
        block_size=live.block_size,
        max_query_len=tokens,
        max_context_len=live.max_context_len,
        num_requests=live.num_requests + 1 + empty,
    )


def rope_table(device: str | torch.device, head_dim: int, max_positions: int) -> torch.Tensor:
    """The models' fp32 table (orca_backend.model.rope): cos(p * f) in the first half, sin in the second."""
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float32), inv_freq)
    return torch.cat((angles.cos(), angles.sin()), dim=-1).to(device)


def pools_equal(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Two K/V pools bit for bit, NaN where NaN (the slots no write may touch)."""
    torch.testing.assert_close(actual, expected, atol=0, rtol=0, equal_nan=True)


def pool_slots(meta: AttentionMetadata) -> int:
    """Slots of a pool holding every block the metadata names, padding included."""
    return (int(meta.block_tables.max()) + 1) * meta.block_size


def dense_attention(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
    window: int = 0, softcap: float = 0.0,
) -> torch.Tensor:  # fmt: skip
    """Attention written out from its definition in float64, independently of `attention_torch`: each
    context token's slot computed from the host block tables, GQA as K/V head h // group, every
    query's visible keys as an explicit mask over positions (j <= p, and j > p - window with a
    window), softcap as softcap * tanh(s / softcap), an explicit softmax. Slow, test-only; returns
    float64 on CPU."""
    q, k_cache, v_cache = q.double().cpu(), k_cache.double().cpu(), v_cache.double().cpu()
    q_heads, kv_heads = q.shape[1], k_cache.shape[1]
    kv_head = torch.arange(q_heads) // (q_heads // kv_heads)
    out = torch.empty(q.shape, dtype=torch.float64)
    size, (qs, context_lens) = meta.block_size, meta.host_lens()
    for i, (ctx, table) in enumerate(zip(context_lens, meta.block_tables.tolist(), strict=True)):
        slots = [table[j // size] * size + j % size for j in range(ctx)]
        k, v = k_cache[slots][:, kv_head], v_cache[slots][:, kv_head]  # [ctx, q_heads, head_dim]
        n = qs[i + 1] - qs[i]
        p = torch.arange(ctx - n, ctx)[:, None]  # each query's position
        j = torch.arange(ctx)[None, :]
        visible = j <= p
        if window:
            visible &= j > p - window
        scores = torch.einsum("nhd,khd->hnk", q[qs[i] : qs[i + 1]], k) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        scores = scores.masked_fill(~visible, float("-inf"))
        e = (scores - scores.max(dim=2, keepdim=True).values).exp()
        out[qs[i] : qs[i + 1]] = torch.einsum("hnk,khd->nhd", e / e.sum(dim=2, keepdim=True), v)
    return out


# (query heads, K/V heads) for grouped-query attention: query head h reads K/V head
# h // (Hq // Hkv). Group sizes 1 (plain multi-head), 2 and 4, and multi-query (one K/V head).
GQA_HEADS = {"mha": (4, 4), "group2": (4, 2), "group4": (8, 2), "mqa": (4, 1)}


def expand_kv(cache: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[slots, Hkv, D] -> [slots, Hq, D]: each K/V head repeated for its query heads, which turns GQA
    into the multi-head attention it is defined as (a test-only copy; kernels never materialise it)."""
    return cache.repeat_interleave(num_q_heads // cache.shape[1], dim=1)
