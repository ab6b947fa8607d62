"""Flattens a scheduled batch into the `BatchMeta` the workers run (selective batching's one tensor)."""

from __future__ import annotations

from orca_backend.core.request import Request
from orca_backend.core.scheduler import ScheduledBatch
from orca_backend.core.stop import banned_token_ids
from orca_backend.core.structured_output import StructuredOutputManager
from orca_backend.worker.batch_meta import BatchMeta, LogitsSetup, RowExtras


def build_batch_meta(
    batch: ScheduledBatch, batch_id: int, block_size: int, eos_token_id: int | None, released_ids: list[str],
    structured: StructuredOutputManager | None = None,
) -> BatchMeta:  # fmt: skip
    """Flattens a scheduled batch. This runs every iteration for every request, so it stays lean:
    per-request fields are list comprehensions, and a decode request (the common case) adds three
    appends to the flat token lists. Constrained requests that sample get their grammar's bitmask
    row from `structured` (the scheduler's); a batch without any carries none."""
    requests = batch.requests
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    context_lens: list[int] = []
    sample: list[bool] = []
    extras: list[RowExtras] = []
    bitmask_rows: list[int] = []
    end = 0
    for request, num_new in zip(requests, batch.num_new_tokens, strict=True):
        if request.sampler_extras:
            extras.append(_row_extras(len(sample), request))
        first = request.num_computed  # position of the first new token
        table = request.block_table
        if num_new == 1:
            prompt_len = request.num_prompt_tokens
            input_ids.append(request.prompt_ids[first] if first < prompt_len else request.output_ids[first - prompt_len])
            positions.append(first)
            slots.append(table[first // block_size] * block_size + first % block_size)
        else:
            input_ids += request.all_token_ids()[first : first + num_new]
            positions += range(first, first + num_new)
            slots += [table[p // block_size] * block_size + p % block_size for p in range(first, first + num_new)]
        end += num_new
        query_start.append(end)
        context_lens.append(first + num_new)
        sample.append(first + num_new == request.num_tokens)
        if request.structured and sample[-1]:
            bitmask_rows.append(len(sample) - 1)
    bitmask = b""
    if bitmask_rows:
        assert structured is not None, "a constrained request in a batch built without its matchers"
        bitmask = structured.fill_bitmask([requests[row].request_id for row in bitmask_rows])
    params = [request.params for request in requests]
    return BatchMeta(
        batch_id=batch_id,
        request_ids=[request.request_id for request in requests],
        input_ids=input_ids,
        positions=positions,
        slot_mapping=slots,
        query_start=query_start,
        context_lens=context_lens,
        block_tables=[request.block_table[: -(-n // block_size)] for request, n in zip(requests, context_lens, strict=True)],
        sample=sample,
        temperature=[p.temperature if p.top_p else 0.0 for p in params],  # top_p 0 is greedy
        top_k=[p.top_k if p.top_k > 0 else 0 for p in params],
        top_p=[p.top_p for p in params],
        seeds=[request.sampling_seed for request in requests],
        banned_ids=[banned_token_ids(request, eos_token_id) for request in requests],
        released_ids=released_ids,
        extras=extras,
        bitmask_rows=bitmask_rows,
        bitmask=bitmask,
    )


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
