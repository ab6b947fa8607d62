"""Flattens a scheduled batch into the `BatchMeta` the workers run (selective batching's one tensor).

This runs every iteration for every request, so it stays lean. A request's sampling fields never
change, so the columns they make (ids, temperature, top_k, top_p, seeds, which rows have extras, a
grammar or a min_tokens ban) are kept from one iteration to the next while the batch holds the same
requests (vLLM v1's persistent input batch, in spirit): the steady state only rebuilds what moves,
the positions, the new tokens and their K/V slots. Block tables live as rows of one array from a
request's first batch to its release, so a batch of decodes (the steady state) is gathered from them
by array indexing, whatever requests joined or left since the last one.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from orca_backend.core.request import Request
from orca_backend.core.scheduler import ScheduledBatch
from orca_backend.core.stop import banned_token_ids
from orca_backend.core.structured_output import StructuredOutputManager
from orca_backend.worker.batch_meta import BatchMeta, LogitsSetup, RowExtras, pad_block_tables

_NO_BAN: list[int] = []  # shared by every row without a ban: nothing reads a row to change it


@dataclass
class _Columns:
    """The per-request fields of one set of requests, in batch order, that do not change between
    iterations. Never changed once built: every BatchMeta of the set shares its lists (a batch may
    still be in flight when the next is built, so nothing reading a BatchMeta changes it)."""

    requests: list[Request]  # the key, compared element by element (requests compare by identity)
    request_ids: list[str]
    temperature: list[float]
    top_k: list[int]
    top_p: list[float]
    seeds: list[int]
    extras_rows: list[int]  # penalties, logit_bias or logprobs
    structured_rows: list[int]
    min_tokens_rows: list[int]  # may ban EOS and stop ids while short of min_tokens
    # Each request's row of the kept block tables (_TableRows), set by the set's first batch with decodes.
    table_rows: np.ndarray | None = None


def _batch_columns(request: Request) -> tuple[str, float, int, float, int, bool, bool, bool]:
    p = request.params
    columns = request.batch_columns = (
        request.request_id, 0.0 if p.greedy else p.temperature, p.top_k if p.top_k > 0 else 0, p.top_p,
        request.sampling_seed, request.sampler_extras, request.structured, p.min_tokens > 0,
    )  # fmt: skip
    return columns


def _columns(requests: list[Request]) -> _Columns:
    """Under load the set of requests changes nearly every iteration (some end, others join), so this
    runs often: each request's columns are one kept tuple, and one zip turns them into columns."""
    rows = list(map(_kept_batch_columns, requests))
    if None in rows:  # a request's first batch
        rows = [_batch_columns(r) if row is None else row for r, row in zip(requests, rows, strict=True)]
    if not rows:
        return _Columns([], [], [], [], [], [], [], [], [])
    request_ids, temperature, top_k, top_p, seeds, extras, structured, min_tokens = map(list, zip(*rows, strict=True))
    every_row = range(len(requests))
    return _Columns(
        list(requests), request_ids, temperature, top_k, top_p, seeds, list(itertools.compress(every_row, extras)),
        list(itertools.compress(every_row, structured)), list(itertools.compress(every_row, min_tokens)),
    )  # fmt: skip


class BatchBuilder:
    """Builds each iteration's BatchMeta, keeping the static columns of the last few request sets
    (one per batch in flight, with pipeline parallelism) and every request's block table as a row of
    one array until the request is released. `table_changes` is the K/V manager's log of the requests
    whose table it replaced (KVCacheManager.table_changes): each build takes it, and the kept rows
    follow it."""

    CACHED_SETS = 4

    def __init__(
        self, block_size: int, eos_token_id: int | None, table_changes: list[Request],
        structured: StructuredOutputManager | None = None,
    ) -> None:  # fmt: skip
        self.block_size = block_size
        self.eos_token_id = eos_token_id
        self.structured = structured
        self._cache: list[_Columns] = []  # most recently used first
        self._table_rows = _TableRows()
        self._table_changes = table_changes

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
        self._table_rows.release(released_ids)
        if self._table_changes:
            self._table_rows.follow(self._table_changes)
            self._table_changes.clear()
        meta = self._flatten(batch, columns, batch_id)
        meta.request_ids = columns.request_ids
        meta.temperature = columns.temperature
        meta.top_k = columns.top_k
        meta.top_p = columns.top_p
        meta.seeds = columns.seeds
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

    def _flatten(self, batch: ScheduledBatch, columns: _Columns, batch_id: int) -> BatchMeta:
        """The batch's leading decodes from the kept table rows, the rest (prompts, chunks) request by
        request, joined when a batch has both (under load: the decodes, then this iteration's newcomers)."""
        requests, num_decodes = batch.requests, batch.num_decodes
        if not num_decodes:
            return _meta(batch_id, *self._flatten_each(requests, batch.num_new_tokens))
        if columns.table_rows is None:
            columns.table_rows = np.array(self._table_rows.assign(requests), dtype=np.intp)
        row_index = columns.table_rows
        if num_decodes == len(requests):  # the steady state
            return _meta(batch_id, *self._flatten_decodes(requests, row_index))
        # Both parts' tables hold each request's first W blocks, W the wider part's width.
        decodes = self._flatten_decodes(requests[:num_decodes], row_index[:num_decodes])
        width = decodes.block_tables.shape[1]
        rest = self._flatten_each(requests[num_decodes:], batch.num_new_tokens[num_decodes:], min_width=width)
        if rest.block_tables.shape[1] > width:
            decodes = decodes._replace(block_tables=self._table_rows.array[row_index[:num_decodes], : rest.block_tables.shape[1]])
        return _meta(batch_id, *_join(decodes, rest))

    def _flatten_decodes(self, requests: list[Request], rows: np.ndarray) -> _Flat:
        """Every request computes its last token, at position `num_computed`, and samples: one new
        token each. The tables come from the kept rows (`rows`), the rest by whole-array
        operations."""
        size, count = self.block_size, len(requests)
        positions = np.fromiter(map(_num_computed, requests), dtype=np.int64, count=count)
        block_index, offset = np.divmod(positions, size)  # the new token's block (its context's last) and slot in it
        tables = self._table_rows.array
        slots = tables[rows, block_index].astype(np.int64)
        slots *= size
        slots += offset
        return _Flat(
            input_ids=np.fromiter([(r.output_ids or r.prompt_ids)[-1] for r in requests], dtype=np.int64, count=count),
            positions=positions,
            slot_mapping=slots,
            query_start=np.arange(count + 1, dtype=np.int32),
            context_lens=np.add(positions, 1, dtype=np.int32, casting="unsafe"),
            block_tables=tables[rows, : block_index.max() + 1],  # a copy: the kept rows change later
            sample=[True] * count,
        )

    def _flatten_each(self, requests: list[Request], num_new_tokens: list[int], min_width: int = 0) -> _Flat:
        """Any requests, one by one: prompts or chunks of them, decodes. Their tables are at least
        `min_width` wide."""
        size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start = [0]
        context_lens: list[int] = []
        sample: list[bool] = []
        end = 0
        for request, num_new in zip(requests, num_new_tokens, strict=True):
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
        return _Flat(
            np.array(input_ids, dtype=np.int64), np.array(positions, dtype=np.int64), np.array(slots, dtype=np.int64),
            np.array(query_start, dtype=np.int32), np.array(context_lens, dtype=np.int32),
            pad_block_tables([r.block_table for r in requests], max(-(-max(context_lens) // size), min_width)), sample,
        )  # fmt: skip


class _Flat(NamedTuple):
    """The flat token fields of some requests of a batch, in BatchMeta's order and types."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    query_start: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    sample: list[bool]


def _join(first: _Flat, second: _Flat) -> _Flat:
    """Two parts of a batch as one: the second's queries after the first's, tables padded to one width."""
    tables = np.zeros((len(first.context_lens) + len(second.context_lens),
                       max(first.block_tables.shape[1], second.block_tables.shape[1])), dtype=np.int32)  # fmt: skip
    tables[: len(first.block_tables), : first.block_tables.shape[1]] = first.block_tables
    tables[len(first.block_tables) :, : second.block_tables.shape[1]] = second.block_tables
    return _Flat(
        np.concatenate((first.input_ids, second.input_ids)),
        np.concatenate((first.positions, second.positions)),
        np.concatenate((first.slot_mapping, second.slot_mapping)),
        np.concatenate((first.query_start, second.query_start[1:] + first.query_start[-1])),
        np.concatenate((first.context_lens, second.context_lens)),
        tables,
        first.sample + second.sample,
    )  # fmt: skip


class _TableRows:
    """Every request's block table as a row of one int32 array, kept across iterations (vLLM v1's
    persistent block table): a decode-only batch gathers its tables and slots with two indexings
    instead of reading hundreds of lists.

    A request gets its row, written whole, with its first batch of decodes, and keeps it until it is
    released (the row is then zeroed and reused). Row r holds exactly the list `_copied_from[r]`, zero
    past it. KVCacheManager replaces a table whenever it changes (never editing one in place) and logs
    the request, and `follow` brings the logged requests' rows up to date: a table that extends the
    old one (decodes crossing a block boundary) has its new entries written, all rows' in one
    assignment; any other (re-admitted after a preemption) is rewritten whole."""

    def __init__(self) -> None:
        self.array = np.zeros((0, 0), dtype=np.int32)
        self._row_of: dict[str, int] = {}
        # Per row: the request holding it (a logged request whose id was reused is not that request),
        # and the table the row was copied from, kept alive so that `is` cannot match a new list.
        self._owner: list[Request | None] = []
        self._copied_from: list[list[int]] = []
        self._free: list[int] = []

    def release(self, request_ids: list[str]) -> None:
        freed = [row for row in map(self._row_of.pop, request_ids, itertools.repeat(None)) if row is not None]
        if freed:
            self.array[freed] = 0
            for row in freed:
                self._owner[row] = None
                self._copied_from[row] = _NO_TABLE
            self._free += freed

    def assign(self, requests: list[Request]) -> list[int]:
        """Each request's row; a request without one takes a free row, written whole."""
        rows = list(map(self._row_of.get, map(_request_id, requests)))
        if None in rows:
            new = [r for r, row in zip(requests, rows, strict=True) if row is None]
            rows = [self._take_row(r) if row is None else row for r, row in zip(requests, rows, strict=True)]
            self.follow(new)
        return rows

    def follow(self, requests: list[Request]) -> None:
        """Brings the rows of these requests (those holding one) up to their current tables."""
        changed: list[tuple[int, list[int]]] = []
        for request in requests:
            row = self._row_of.get(request.request_id)
            if row is not None and self._owner[row] is request and request.block_table is not self._copied_from[row]:
                changed.append((row, request.block_table))
        if not changed:
            return
        width = max(len(table) for _, table in changed)
        if width > self.array.shape[1]:
            self._grow(self.array.shape[0], max(2 * self.array.shape[1], width, 8))
        at_rows: list[int] = []
        at_columns: list[int] = []
        values: list[int] = []
        for row, table in changed:
            old = self._copied_from[row]
            start = len(old)
            if table[:start] != old:  # not an extension of the old table: rewrite the row
                self.array[row] = 0
                start = 0
            at_rows += [row] * (len(table) - start)
            at_columns += range(start, len(table))
            values += table[start:]
            self._copied_from[row] = table
        self.array[at_rows, at_columns] = values

    def _take_row(self, request: Request) -> int:
        if not self._free:
            old = len(self._copied_from)
            self._grow(max(2 * old, 16), self.array.shape[1])
            self._free = list(range(len(self._copied_from) - 1, old - 1, -1))  # the lowest row first
        row = self._row_of[request.request_id] = self._free.pop()
        self._owner[row] = request
        return row

    def _grow(self, rows: int, width: int) -> None:
        grown = np.zeros((rows, width), dtype=np.int32)
        grown[: self.array.shape[0], : self.array.shape[1]] = self.array
        self.array = grown
        self._owner += [None] * (rows - len(self._owner))
        self._copied_from += [_NO_TABLE] * (rows - len(self._copied_from))


_NO_TABLE: list[int] = []  # what a free row holds: no request's table is this list
# Per-request reads done with map() at C speed.
_num_computed = operator.attrgetter("num_computed")
_request_id = operator.attrgetter("request_id")
_kept_batch_columns = operator.attrgetter("batch_columns")


def _meta(
    batch_id: int, input_ids: np.ndarray, positions: np.ndarray, slot_mapping: np.ndarray, query_start: np.ndarray,
    context_lens: np.ndarray, block_tables: np.ndarray, sample: list[bool],
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
    return BatchBuilder(block_size, eos_token_id, [], structured).build(batch, batch_id, released_ids)


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
