"""The control channel's wire format: `BatchMeta`, everything a model runner needs for one
iteration, and `SamplerOutput`, what the sampling rank answers, as plain numbers and strings.

The engine core builds a BatchMeta from a scheduled batch (core/batch_builder.py); a runner in the
same process or in a worker process consumes it. Plain fields keep the control channel free of
pickled objects: it crosses as JSON.

The per-token and per-request index fields are numpy arrays, in the dtypes the model runner hands
to torch as they are (`INDEX_DTYPES`): the core builds them with a few vectorized operations (a
decode-only batch without a per-request loop over its tables), and the runner's inputs are views of
them, not conversions of thousands of Python ints every iteration.
"""

from __future__ import annotations

import base64
import itertools
import json
from dataclasses import asdict, dataclass, field, fields

import numpy as np

from orca_backend.messages import TokenLogprobs


@dataclass
class LogitsSetup:
    """A request's static logits processing. The core sends it with the request's batches until one
    of them has returned; the sampler keeps it from the first it sees until the request is released."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    bias_ids: list[int] = field(default_factory=list)  # logit_bias, as two lists (JSON keys are strings)
    bias_values: list[float] = field(default_factory=list)
    prompt_ids: list[int] = field(default_factory=list)  # with a repetition penalty only (it covers the prompt)

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


@dataclass
class RowExtras:
    """What the sampler needs of one row beyond its logits and the plain per-row fields; only rows
    of requests with penalties, logit_bias or logprobs have one."""

    row: int
    num_logprobs: int = -1  # -1: none; k >= 0: the sampled token's logprob and the top k
    processed: bool = False  # logit_bias or penalties: the sampler holds (or is sent) its setup
    setup: LogitsSetup | None = None  # None once a batch carrying it has returned
    # The request's output tokens from index `output_offset` on, those the core has not yet seen
    # arrive at the sampler (penalized requests only). Applying them is idempotent: a batch that
    # failed is re-run with the same offset, whether or not the sampler had taken them.
    output_offset: int = 0
    output_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, d: dict) -> RowExtras:
        setup = d.pop("setup")
        return cls(**d, setup=LogitsSetup(**setup) if setup is not None else None)


# The index fields and their dtypes: int64 where torch indexes with them (embedding rows, positions, K/V
# slots), int32 where the attention kernels read them.
INDEX_DTYPES = {"input_ids": np.int64, "positions": np.int64, "slot_mapping": np.int64,
                "query_start": np.int32, "context_lens": np.int32, "block_tables": np.int32}  # fmt: skip


def pad_block_tables(tables: list[list[int]], width: int) -> np.ndarray:
    """int32 [len(tables), width]: each table's first `width` blocks, zero-padded on the right."""
    lengths = np.fromiter((min(len(t), width) for t in tables), dtype=np.int64, count=len(tables))
    padded = np.zeros((len(tables), width), dtype=np.int32)
    # Filled by a mask, not row by row (a Python loop of row copies is slow at hundreds of requests).
    padded[np.arange(width)[None, :] < lengths[:, None]] = np.fromiter(
        itertools.chain.from_iterable(t[:width] for t in tables), dtype=np.int32, count=int(lengths.sum())
    )
    return padded


@dataclass(eq=False)  # __eq__ below: numpy fields compare by value
class BatchMeta:
    batch_id: int
    request_ids: list[str]
    # Flattened new tokens of every request (selective batching's one tensor), int64 [T].
    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray  # K/V pool slot each new token is written to
    # Per request: where its queries sit in the flat batch, and its K/V blocks (int32).
    query_start: np.ndarray  # [B + 1]
    context_lens: np.ndarray  # [B]
    # [B, W], W the most blocks any request's context fills: row i holds request i's first W blocks in
    # context order (token j is in block j // block_size), zero past the blocks it has.
    block_tables: np.ndarray
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
    # Sparse: a batch of requests without penalties, logit_bias or logprobs carries none.
    extras: list[RowExtras] = field(default_factory=list)
    # Structured output: the rows of constrained requests that sample this step, and their token bitmask
    # rows in that order, int32 words (ceil(vocab / 32) per row; worker/bitmask.py), as raw bytes: base64
    # text on the wire only (a few MB a step for many rows of a large vocabulary, which the in-process
    # runner never encodes). Empty when no row is constrained; only the sampling rank of a worker pool is
    # sent them.
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: bytes = b""

    def __post_init__(self) -> None:
        """Index fields given as lists (tests, tools) become arrays; ragged block tables are padded."""
        for name, dtype in INDEX_DTYPES.items():
            value = getattr(self, name)
            if not isinstance(value, np.ndarray):
                if name == "block_tables":
                    value = pad_block_tables(value, max(map(len, value), default=0))
                setattr(self, name, np.asarray(value, dtype=dtype))

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, BatchMeta):
            return NotImplemented
        return all(
            np.array_equal(a, b) if f.name in INDEX_DTYPES else a == b
            for f in fields(self) for a, b in [(getattr(self, f.name), getattr(other, f.name))]
        )  # fmt: skip

    def to_bytes(self) -> bytes:
        plain = {f.name: getattr(self, f.name) for f in fields(self)}
        for name in INDEX_DTYPES:
            plain[name] = plain[name].tolist()
        plain["extras"] = [asdict(e) for e in self.extras]
        plain["bitmask"] = base64.b64encode(self.bitmask).decode("ascii")
        return json.dumps(plain, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> BatchMeta:
        meta = cls(**json.loads(data))  # the index fields arrive as lists: __post_init__ makes them arrays
        meta.bitmask = base64.b64decode(meta.bitmask)  # type: ignore[arg-type]
        if meta.extras:
            meta.extras = [RowExtras.from_dict(d) for d in meta.extras]  # type: ignore[arg-type]
        return meta


@dataclass
class SamplerOutput:
    token_ids: list[int]  # one per row (a row that samples nothing has a placeholder the core ignores)
    # One per row when any row asked for logprobs (None for the rows that did not), else None.
    logprobs: list[TokenLogprobs | None] | None = None
