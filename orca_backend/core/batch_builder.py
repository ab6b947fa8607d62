"""Flattens a scheduled batch into the `BatchMeta` the workers run (selective batching's one tensor)."""

from __future__ import annotations

from orca_backend.core.scheduler import ScheduledBatch
from orca_backend.core.stop import banned_token_ids
from orca_backend.worker.batch_meta import BatchMeta


def build_batch_meta(batch: ScheduledBatch, batch_id: int, eos_token_id: int | None, released_ids: list[str]) -> BatchMeta:
    """Flattens a scheduled batch. This runs every iteration for every request, so it stays lean:
    per-request fields are list comprehensions, and a decode request (the common case) adds three
    appends to the flat token lists."""
    requests = batch.requests
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    end = 0
    for request, num_new in zip(requests, batch.num_new_tokens, strict=True):
        first = request.num_computed  # position of the first new token
        kv_start = request.kv_start
        if num_new == 1:
            input_ids.append(request.output_ids[-1] if request.output_ids else request.prompt_ids[first])
            positions.append(first)
            slots.append(kv_start + first)
        else:
            input_ids += request.all_token_ids()[first : first + num_new]
            positions += range(first, first + num_new)
            slots += range(kv_start + first, kv_start + first + num_new)
        end += num_new
        query_start.append(end)
        context_lens.append(first + num_new)
    params = [request.params for request in requests]
    return BatchMeta(
        batch_id=batch_id,
        request_ids=[request.request_id for request in requests],
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_start=query_start,
        context_lens=context_lens,
        kv_starts=[request.kv_start for request in requests],
        temperature=[p.temperature for p in params],
        top_k=[p.top_k if p.top_k > 0 else 0 for p in params],
        top_p=[p.top_p for p in params],
        seeds=[request.sampling_seed for request in requests],
        banned_ids=[banned_token_ids(request, eos_token_id) for request in requests],
        released_ids=released_ids,
    )
