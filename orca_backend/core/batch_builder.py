"""Flattens a scheduled batch into the `BatchMeta` the workers run (selective batching's one tensor).

This runs every iteration for every request, so it stays lean. A request's sampling fields never
change, so the columns they make (ids, temperature, top_k, top_p, seeds, which rows have extras, a
grammar or a min_tokens ban) are kept from one iteration to the next while the batch holds the same
requests (vLLM v1's persistent input batch, in spirit): the steady state only rebuilds what moves,
the positions, the new tokens and their K/V slots.
"""

from __future__ import annotations

from dataclasses import dataclass

from orca_backend.core.request import Request
from orca_backend.core.scheduler import ScheduledBatch
from orca_backend.core.stop import banned_token_ids
from orca_backend.core.structured_output import StructuredOutputManager
from orca_backend.worker.batch_meta import BatchMeta, LogitsSetup, RowExtras

_NO_BAN: list[int] = []  # shared by every row without a ban: nothing reads a row to change it


@dataclass
class _Columns:
    """The per-request fields of one set of requests, in batch order, that do not change between
    iterations. BatchMeta gets copies: a batch may still be in flight when the next is built."""

    requests: list[Request]  # the key, compared element by element (requests compare by identity)
    request_ids: list[str]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    extras_rows: list[int]  # penalties, logit_bias or logprobs
    structured_rows: list[int]
    min_tokens_rows: list[int]  # may ban EOS and stop ids while short of min_tokens


def _sampling_row(request: Request) -> tuple[float, int, float, int]:
    row = request.sampling_row
    if row is None:
        p = request.params
        row = request.sampling_row = (p.temperature if p.top_p else 0.0, p.top_k if p.top_k > 0 else 0, p.top_p,
                                      request.sampling_seed)  # top_p 0 is greedy  # fmt: skip
    return row


def _columns(requests: list[Request]) -> _Columns:
    temperature, top_k, top_p, seeds = (list(c) for c in zip(*map(_sampling_row, requests), strict=True)) \
        if requests else ([], [], [], [])  # fmt: skip
    return _Columns(
        list(requests), [r.request_id for r in requests], temperature, top_k, top_p, seeds,  # type: ignore[arg-type]
        [i for i, r in enumerate(requests) if r.sampler_extras],
        [i for i, r in enumerate(requests) if r.structured],
        [i for i, r in enumerate(requests) if r.params.min_tokens],
    )  # fmt: skip


class BatchBuilder:
    """Builds each iteration's BatchMeta, keeping the static columns of the last few request sets
    (one per batch in flight, with pipeline parallelism)."""

    CACHED_SETS = 4

    def __init__(self, block_size: int, eos_token_id: int | None, structured: StructuredOutputManager | None = None) -> None:
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.structured = structured
        self._cache: list[_Columns] = []  # most recently used first

    def _columns_of(self, requests: list[Request]) -> _Columns:
        for i, columns in enumerate(self._cache):
            if columns.requests == requests:  # C-speed: same length, then identity of each element
                if i:
                    self._cache.insert(0, self._cache.pop(i))
                return columns
        columns = _columns(requests)
        self._cache.insert(0, columns)
        del self._cache[self.CACHED_SETS :]
        return columns

    def build(self, batch: ScheduledBatch, batch_id: int, released_ids: list[str]) -> BatchMeta:
        requests = batch.requests
        columns = self._columns_of(requests)
        if batch.decode_only:
            meta = self._flatten_decodes(requests, batch_id)
        else:
            meta = self._flatten(batch, batch_id)
        meta.request_ids = list(columns.request_ids)
        meta.temperature = list(columns.temperature)
        meta.top_k = list(columns.top_k)
        meta.top_p = list(columns.top_p)
        meta.seeds = list(columns.seeds)
        meta.released_ids = released_ids
        banned = [_NO_BAN] * len(requests)
        for row in columns.min_tokens_rows:
            banned[row] = banned_token_ids(requests[row], self.eos_token_id)
        meta.banned_ids = banned
        sample = meta.sample
        meta.extras = [_row_extras(row, requests[row]) for row in columns.extras_rows]
        bitmask_rows = [row for row in columns.structured_rows if sample[row]]
        if bitmask_rows:
            assert self.structured is not None, "a constrained request in a batch built without its matchers"
            meta.bitmask_rows = bitmask_rows
            meta.bitmask = self.structured.fill_bitmask([requests[row].request_id for row in bitmask_rows])
        return meta

    def _flatten_decodes(self, requests: list[Request], batch_id: int) -> BatchMeta:
        """Every request computes its last token, position `num_computed`, and samples: one new token
        each, read off per-request lists by comprehensions (no per-request branches)."""
        size = self.block_size
        positions = [r.num_computed for r in requests]
        tables = [r.block_table for r in requests]
        num_blocks = [p // size + 1 for p in positions]  # blocks the context fills, the new token's last
        return _meta(
            batch_id,
            input_ids=[(r.output_ids or r.prompt_ids)[-1] for r in requests],
            positions=positions,
            slot_mapping=[t[n - 1] * size + p % size for t, n, p in zip(tables, num_blocks, positions, strict=True)],
            query_start=list(range(len(requests) + 1)),
            context_lens=[p + 1 for p in positions],
            # A table that is exactly the context (paged) goes as it is: tables are replaced, never
            # changed in place (KVCacheManager.grow). A reserved one is cut to the context.
            block_tables=[t if len(t) == n else t[:n] for t, n in zip(tables, num_blocks, strict=True)],
            sample=[True] * len(requests),
        )

    def _flatten(self, batch: ScheduledBatch, batch_id: int) -> BatchMeta:
        """Any batch: prompts or chunks of them beside decodes."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample: list[bool] = []
        end = 0
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            first = request.num_computed  # position of the first new token
            table = request.block_table
            if num_new == 1:
                prompt_len = request.num_prompt_tokens
                input_ids.append(request.prompt_ids[first] if first < prompt_len else request.output_ids[first - prompt_len])
                positions.append(first)
                slots.append(table[first // size] * size + first % size)
            else:
                input_ids += request.all_token_ids()[first : first + num_new]
                positions += range(first, first + num_new)
                slots += [table[p // size] * size + p % size for p in range(first, first + num_new)]
            end += num_new
            query_start.append(end)
            context_lens.append(first + num_new)
            sample.append(first + num_new == request.num_tokens)
        block_tables = [r.block_table[: -(-n // size)] for r, n in zip(batch.requests, context_lens, strict=True)]
        return _meta(batch_id, input_ids, positions, slots, query_start, context_lens, block_tables, sample)


def _meta(
    batch_id: int, input_ids: list[int], positions: list[int], slot_mapping: list[int], query_start: list[int],
    context_lens: list[int], block_tables: list[list[int]], sample: list[bool],
) -> BatchMeta:  # fmt: skip
    """A BatchMeta with its flat token fields; `BatchBuilder.build` fills the per-request columns."""
    return BatchMeta(batch_id, [], input_ids, positions, slot_mapping, query_start, context_lens, block_tables,
                     sample, [], [], [], [], [])  # fmt: skip


def build_batch_meta(
    batch: ScheduledBatch, batch_id: int, block_size: int, eos_token_id: int | None, released_ids: list[str],
    structured: StructuredOutputManager | None = None,
) -> BatchMeta:  # fmt: skip
    """One batch, with nothing kept (tests, tools); the engine core keeps a `BatchBuilder`. Constrained
    requests that sample get their grammar's bitmask row from `structured` (the scheduler's); a batch
    without any carries none."""
    return BatchBuilder(block_size, eos_token_id, structured).build(batch, batch_id, released_ids)


def _row_extras(row: int, request: Request) -> RowExtras:
    """What the sampler needs of a request with penalties, logit_bias or logprobs: the setup until a
    batch carrying it has returned, then each output token it has not been sent yet, with its offset
    (see worker/logits_processors.py)."""
    p = request.params
    extras = RowExtras(row, num_logprobs=-1 if p.logprobs is None else p.logprobs)
    penalized = p.penalized
    if not (penalized or p.logit_bias):
        return extras
    extras.processed = True
    synced = request.sampler_synced
    if synced is None:
        bias = p.logit_bias or {}
        extras.setup = LogitsSetup(
            p.presence_penalty, p.frequency_penalty, p.repetition_penalty, list(bias), list(bias.values()),
            request.prompt_ids if p.repetition_penalty != 1.0 else [],
        )  # fmt: skip
        synced = 0
    if penalized:
        extras.output_offset = synced
        extras.output_ids = request.output_ids[synced:]
    return extras
