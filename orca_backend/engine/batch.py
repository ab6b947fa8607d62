"""`BatchMeta`: everything a model runner needs for one iteration, as plain numbers and strings.

The engine builds it from a `ScheduledBatch`; a runner in the same process or in a worker process
consumes it. Plain fields keep the control channel free of pickled objects: it crosses as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

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
    a decode request (the common case) costs a handful of list appends."""
    meta = BatchMeta(batch_id, [], [], [], [], [0], [], [], [], [], [], [], [], released_ids)
    input_ids, positions, slots, query_start = meta.input_ids, meta.positions, meta.slot_mapping, meta.query_start
    end = 0
    for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
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
        meta.context_lens.append(first + num_new)
        meta.kv_starts.append(kv_start)

        params = request.params
        meta.request_ids.append(request.request_id)
        meta.temperature.append(params.temperature)
        meta.top_k.append(params.top_k if params.top_k > 0 else 0)
        meta.top_p.append(params.top_p)
        meta.seeds.append(request.sampling_seed)
        banned: list[int] = []
        if params.min_tokens and len(request.output_ids) < params.min_tokens:
            banned = list(params.stop_token_ids)
            if eos_token_id is not None and not params.ignore_eos:
                banned.append(eos_token_id)
        meta.banned_ids.append(banned)
    return meta
