"""`BatchMeta`: everything a model runner needs for one iteration, as plain numbers and strings.

The engine core builds it from a scheduled batch (core/batch_builder.py); a runner in the same
process or in a worker process consumes it. Plain fields keep the control channel free of pickled
objects: it crosses as JSON.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass
class BatchMeta:
    batch_id: int
    request_ids: list[str]
    # Flattened new tokens of every request (selective batching's one tensor).
    input_ids: list[int]
    positions: list[int]
    slot_mapping: list[int]  # K/V pool slot each new token is written to
    # Per request: where its queries sit in the flat batch, and its K/V blocks.
    query_start: list[int]  # [B + 1]
    context_lens: list[int]
    block_tables: list[list[int]]  # pool blocks in context order: token j is in block j // block_size
    # False for a prefill chunk that stops short of the request's last token: no token is sampled,
    # so its random stream is not advanced either.
    sample: list[bool]
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
