"""Ragged selective-batching attention cases shared by the kernel tests (Triton and CPU)."""

from __future__ import annotations

import torch

from orca_kernels import AttentionMetadata

# Each request is (queries, context); the queries are the last positions of the context.
BATCHES = {
    # prefill, decode, a 1-token prompt, a partial prefill (1 < n < ctx), a longer decode
    "mixed": [(20, 20), (1, 37), (1, 1), (5, 30), (1, 50)],
    "prefill_only": [(17, 17), (33, 33), (2, 2)],
    "decode_only": [(1, 5), (1, 40), (1, 16), (1, 1)],
}


def make_meta(device: str | torch.device, requests: list[tuple[int, int]], gap: int = 7) -> AttentionMetadata:
    """K/V regions laid out back to front with gaps: non-zero, non-adjacent, out of request order."""
    kv_starts, slot = [0] * len(requests), gap
    for i in reversed(range(len(requests))):
        kv_starts[i] = slot
        slot += requests[i][1] + gap
    query_start, slot_mapping = [0], []
    for (n, ctx), start in zip(requests, kv_starts, strict=True):
        query_start.append(query_start[-1] + n)
        slot_mapping.extend(range(start + ctx - n, start + ctx))
    context_lens = [ctx for _, ctx in requests]
    return AttentionMetadata(
        query_start=torch.tensor(query_start, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        kv_starts=torch.tensor(kv_starts, dtype=torch.int32, device=device),
        slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64, device=device),
        max_query_len=max(n for n, _ in requests),
        max_context_len=max(context_lens),
        query_start_host=query_start,
        context_lens_host=context_lens,
        kv_starts_host=kv_starts,
    )


def pool_slots(meta: AttentionMetadata) -> int:
    return max(s + c for s, c in zip(meta.kv_starts_host, meta.context_lens_host, strict=True)) + 3


# (query heads, K/V heads) for grouped-query attention: query head h reads K/V head
# h // (Hq // Hkv). Group sizes 1 (plain multi-head), 2 and 4, and multi-query (one K/V head).
GQA_HEADS = {"mha": (4, 4), "group2": (4, 2), "group4": (8, 2), "mqa": (4, 1)}


def expand_kv(cache: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """[slots, Hkv, D] -> [slots, Hq, D]: each K/V head repeated for its query heads, which turns GQA
    into the multi-head attention it is defined as (a test-only copy; kernels never materialise it)."""
    return cache.repeat_interleave(num_q_heads // cache.shape[1], dim=1)
