"""`BatchMeta`: everything a model runner needs for one iteration, as plain numbers and strings.

The engine builds it from a `ScheduledBatch`; a runner in the same process or in a worker process
consumes it. Plain fields keep the control channel free of pickled objects: it crosses as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from orca_backend.engine.request import Request
from orca_backend.engine.scheduler import ScheduledBatch


@dataclass
class BatchMeta:
    batch_id: int
    request_ids: list[str]
    # Flattened new tokens of every request (selective batching's one tensor).
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # K/V pool slot each new token is written to
    # Per request: where its queries sit in the flat batch, and its K/V region.
    query_start: list[int]  # [B + 1]
    context_lens: list[int]
    kv_starts: list[int]
    # Per request sampling: temperature 0 is greedy; top_k 0 is off.
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    banned_ids: list[list[int]]  # EOS and stop ids before min_tokens
    released_ids: list[str] = field(default_factory=list)  # finished requests: drop their sampler state

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def to_bytes(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> BatchMeta:
        return cls(**json.loads(data))


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
        banned_ids=[_banned_ids(request, eos_token_id) for request in requests],
        released_ids=released_ids,
    )


def _banned_ids(request: Request, eos_token_id: int | None) -> list[int]:
    """Before min_tokens, EOS (unless ignored) and the stop ids cannot be sampled."""
    params = request.params
    if not params.min_tokens or len(request.output_ids) >= params.min_tokens:
        return []
    banned = list(params.stop_token_ids)
    if eos_token_id is not None and not params.ignore_eos:
        banned.append(eos_token_id)
    return banned
