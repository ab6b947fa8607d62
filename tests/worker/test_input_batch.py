"""The persistent input batch (worker/input_batch.py): the rows it keeps from the scheduler's deltas
are what a from-scratch build of the same batch gives, through joins, ends, block growth,
preemption and the reuse of freed rows; and a request's tokens do not depend on which row it had."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from orca_backend import EngineConfig, SamplingParams
from orca_backend.core.request import Request
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.scheduler_output import NewRequest, SchedulerOutput
from orca_backend.worker.input_batch import STOP_IDS, TOP_K, InputBatch, StepInputs
from orca_backend.worker.logits_processors import BIAS_IDS, BIAS_VALUES


def _from_scratch(step: SchedulerOutput, requests: list[Request], like: InputBatch) -> StepInputs:
    """The step's inputs from an empty input batch, every scheduled request sent whole as it is now."""
    scratch = InputBatch(like.max_rows, like.max_tokens, like.block_size, like.processors.vocab_size,
                         torch.device("cpu"), like.num_groups)  # fmt: skip
    whole = SchedulerOutput(step.step_id, step.scheduled_ids, step.num_scheduled_tokens, step.num_computed, [
        NewRequest(r.request_id, r.all_token_ids(), r.num_prompt_tokens, [b for table in r.block_tables for b in table],
                   r.params, r.sampling_seed, sorted(r.stop_ids)) for r in requests])  # fmt: skip
    scratch.apply(whole)
    return scratch.prepare(whole)


def _plain(inputs: StepInputs) -> dict:
    s = inputs.sampling

    def at(positions: tuple[torch.Tensor, torch.Tensor], table: torch.Tensor, columns: slice | int) -> list:
        """The positions, and what the device's per-row table holds for each (rows differ between builds)."""
        return [positions[0].tolist(), table[positions[1]][:, columns].tolist()]

    stop_ids = [[sorted(set(ids)) for ids in at(s.banned, s.ids, slice(STOP_IDS, None))[1]]]
    return {
        "input_ids": inputs.input_ids.tolist(), "positions": inputs.positions.tolist(),
        "slot_mapping": inputs.slot_mapping.tolist(), "query_start": inputs.query_start.tolist(),
        "context_lens": inputs.context_lens.tolist(), "logits_indices": inputs.logits_indices.tolist(),
        "block_tables": inputs.block_tables.tolist(), "max_query_len": inputs.max_query_len,
        "max_context_len": inputs.max_context_len, "sample": s.sample.tolist(),
        "random": at(s.random, s.values, slice(None)), "top_k": at(s.random, s.ids, TOP_K),
        "banned": [s.banned[0].tolist(), stop_ids], "logprobs": [s.logprobs.tolist(), s.logprobs_at, s.num_logprobs],
        "biased": [s.biased[0].tolist(), [sorted((i, v) for i, v in zip(ids, values, strict=True) if (i, v) != (0, 0.0))
                                          for ids, values in zip(at(s.biased, s.processors.ids, slice(BIAS_IDS, None))[1],
                                                                 at(s.biased, s.processors.values, slice(BIAS_VALUES, None))[1],
                                                                 strict=True)]],
        "penalized": at(s.penalized, s.processors.values, slice(0, BIAS_VALUES)), "repetition": s.repetition,
    }  # fmt: skip


@pytest.mark.parametrize("policy,prefix_caching", [("paged", False), ("paged", True), ("reserve", False)])
def test_the_kept_rows_equal_a_from_scratch_build_of_every_step(policy, prefix_caching):
    """A churning run (requests joining and ending every few steps, tables growing a block at a time, a
    pool small enough to preempt, shared prefix blocks, chunked prompts, every sampling column in use):
    at every step the runner's inputs from its kept rows equal those of an input batch that is sent
    every scheduled request whole."""
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", max_num_seqs=6, kv_capacity_tokens=96, block_size=4,
                                    kv_policy=policy, enable_prefix_caching=prefix_caching,
                                    max_num_batched_tokens=12))  # fmt: skip
    core = engine.core
    kept = core.executor.runner.input_batch
    schedule, prepare = core.scheduler.schedule, kept.prepare
    scheduled: dict[int, list[Request]] = {}
    compared, rows_taken = [], []

    def record_schedule():
        batch = schedule()
        if batch is not None:
            scheduled[batch.output.step_id] = list(batch.requests)
        return batch

    def compare_prepare(step: SchedulerOutput) -> StepInputs:
        inputs = prepare(step)
        expected = _from_scratch(step, scheduled.pop(step.step_id), kept)
        assert _plain(inputs) == _plain(expected), f"step {step.step_id}"
        compared.append(step.step_id)
        rows_taken.append(inputs.sampling.rows.tolist())
        return inputs

    core.scheduler.schedule, kept.prepare = record_schedule, compare_prepare
    shared = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks every prompt starts with
    added = 0
    for step in range(600):
        if step % 3 == 0 and added < 24:
            params = SamplingParams(max_tokens=4 + (7 * added) % 29, ignore_eos=True, temperature=0.8 * (added % 2),
                                    top_k=added % 4, top_p=0.9, seed=added, min_tokens=2 * (added % 3),
                                    stop_token_ids=[7], frequency_penalty=0.5 * (added % 4 == 1),
                                    logit_bias={3: 1.0} if added % 5 == 2 else None,
                                    logprobs=1 if added % 6 == 3 else None)  # fmt: skip
            engine.add_request(shared + [added + 20] * (1 + 3 * (added % 5)), params, on_output=lambda o: None)
            added += 1
        if not engine.has_work() and added == 24:
            break
        engine.step()
    assert added == 24 and not engine.has_work()
    assert len(compared) > 50
    if policy == "paged":
        assert core.scheduler.num_preemptions > 0
    # Rows of ended and preempted requests were taken again: 24 requests ran in at most 6 rows.
    assert max(max(rows) for rows in rows_taken) < 6


def _step(step_id: int, ids: list[str], counts: list[int], computed: list[int], new: list[NewRequest] | None = None,
          recorded: dict[str, int] | None = None, grown: dict[str, list[int]] | None = None,
          preempted: list[str] | None = None, finished: list[str] | None = None) -> SchedulerOutput:  # fmt: skip
    recorded, grown = recorded or {}, grown or {}
    return SchedulerOutput(step_id, ids, counts, computed, new or [], list(recorded), list(recorded.values()),
                           list(grown), list(grown.values()), preempted or [], finished or [])  # fmt: skip


def test_rows_are_freed_by_ends_and_preemptions_and_taken_again():
    batch = InputBatch(3, 32, 4, 50, torch.device("cpu"))
    params = SamplingParams(max_tokens=8)
    batch.apply(_step(0, ["a", "b"], [3, 2], [0, 0], new=[NewRequest("a", [1, 2, 3], 3, [5], params, 0),
                                                          NewRequest("b", [4, 5], 2, [6], params, 0)]))  # fmt: skip
    assert batch.row_of == {"a": 0, "b": 1}
    # "a" decodes its sampled 9 into a new block; "b" is preempted after its 6 was recorded; "c" joins in
    # the row "b" left.
    step = _step(1, ["a", "c"], [1, 1], [3, 0], new=[NewRequest("c", [7], 1, [8], params, 0)],
                 recorded={"a": 9, "b": 6}, grown={"a": [2]}, preempted=["b"])  # fmt: skip
    batch.apply(step)
    assert batch.row_of == {"a": 0, "c": 1} and batch.states["b"].token_ids == [4, 5, 6]
    inputs = batch.prepare(step)
    assert inputs.input_ids.tolist() == [9, 7] and inputs.positions.tolist() == [3, 0]
    assert inputs.slot_mapping.tolist() == [[5 * 4 + 3, 8 * 4]] and inputs.block_tables.tolist() == [[[5], [8]]]
    # "a" ends; "b" resumes with a whole new table, in the row "a" left, holding every token it had.
    step = _step(2, ["b"], [3], [0], grown={"b": [1]}, finished=["a"])
    batch.apply(step)
    assert batch.row_of == {"c": 1, "b": 0} and "a" not in batch.states
    assert batch.block_table[0, 0, :3].tolist() == [1, 0, 0]  # nothing left of "a"'s two blocks
    inputs = batch.prepare(step)
    assert inputs.input_ids.tolist() == [4, 5, 6] and inputs.slot_mapping.tolist() == [[4, 5, 6]]
    assert inputs.sampling.sample.tolist() == [True]
    with pytest.raises(RuntimeError, match="sent as new twice"):
        batch.apply(_step(3, ["c"], [1], [1], new=[NewRequest("c", [7], 1, [8], params, 0)]))
    with pytest.raises(RuntimeError, match="recorded for requests that hold no row"):
        batch.apply(_step(4, [], [], [], recorded={"zz": 1}))


def test_a_full_input_batch_refuses_another_row():
    batch = InputBatch(1, 8, 4, 50, torch.device("cpu"))
    batch.apply(_step(0, ["a"], [1], [0], new=[NewRequest("a", [1], 1, [0], SamplingParams(), 0)]))
    with pytest.raises(RuntimeError, match="no free row for request b"):
        batch.apply(_step(1, ["b"], [1], [0], new=[NewRequest("b", [1], 1, [1], SamplingParams(), 0)]))


def test_a_requests_tokens_do_not_depend_on_its_row():
    """One request, random sampling with a seed, penalties and logit_bias: alone (row 0), and last of
    seven in a pool small enough that it is preempted and resumed in other rows: the same tokens."""
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5, frequency_penalty=0.4, repetition_penalty=1.3,
                            logit_bias={11: 2.0}, ignore_eos=True)  # fmt: skip
    prompt = [3, 1, 4, 1, 5, 9, 2]

    def run(others: int) -> tuple[list[int], list[int]]:
        engine = LLMEngine(EngineConfig(model="gpt2-tiny", max_num_seqs=8, kv_capacity_tokens=160, block_size=4))
        kept = engine.core.executor.runner.input_batch
        take_row, rows = kept._take_row, []

        def spy(state, block_ids):
            row = take_row(state, block_ids)
            if state.request_id == "x":
                rows.append(row)
            return row

        kept._take_row = spy
        out: list[int] = []
        for i in range(others):
            engine.add_request([20 + i] * 9, SamplingParams(max_tokens=30, ignore_eos=True), on_output=lambda o: None)
        engine.add_request(prompt, params, on_output=lambda o: out.extend(o.new_token_ids), request_id="x", priority=1)
        while engine.has_work():
            engine.step()
        return out, rows

    alone, alone_rows = run(0)
    crowded, crowded_rows = run(6)
    assert alone_rows == [0]
    assert len(crowded_rows) > 1 and set(crowded_rows) != {0}, crowded_rows  # preempted, resumed elsewhere
    assert len(alone) == 24 and crowded == alone


def test_ragged_appends_and_positions():
    from orca_backend.worker.input_batch import ragged_arange

    assert ragged_arange(np.array([2, 0, 3]), 5).tolist() == [0, 1, 0, 1, 2]
