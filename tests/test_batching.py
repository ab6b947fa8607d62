"""Batch invariance and iteration-level (vs request-level) scheduling, observed through the engine."""

from __future__ import annotations

import pytest
import torch
from core_hooks import StepGate
from kv_modes import KV_MODES

from orca_backend import LLM, SamplingParams
from orca_backend.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def random_prompts(n: int, vocab: int, seed: int, max_len: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def step_until_done(engine: LLMEngine, streams, max_steps: int = 10_000) -> None:
    for _ in range(max_steps):
        if not engine.has_work():
            return
        engine.step()
    raise AssertionError("engine did not finish")


@pytest.mark.parametrize("mode", KV_MODES)
def test_batch_invariance_alone_vs_batch_of_16_vs_joining(tiny_checkpoint, mode):
    path, config = tiny_checkpoint
    prompts = random_prompts(16, config.vocab_size, seed=5)
    llm = LLM(str(path), max_num_seqs=16, **KV_MODES[mode])
    alone = [llm.generate([p], GREEDY)[0].output_ids for p in prompts]
    together = [o.output_ids for o in llm.generate(prompts, GREEDY)]
    assert together == alone

    # Staggered: requests join while others are mid-decode and others leave (varied max_tokens).
    engine = llm.engine
    events: dict[str, list[int]] = {}

    def collect(out):
        events.setdefault(out.request_id, []).extend(out.new_token_ids)

    lengths = [12, 3, 7, 12, 5, 9, 2, 12]
    ids = []
    for i, p in enumerate(prompts[:8]):
        params = SamplingParams(max_tokens=lengths[i], temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(p, params, on_output=collect).request_id)
        engine.step()  # each new request joins a batch that is already decoding
        engine.step()
    while engine.has_work():
        engine.step()
    for i, rid in enumerate(ids):
        assert events[rid] == alone[i][: lengths[i]], f"request {i}"
    assert engine.core.kv.used_tokens == 0


def _run_long_and_short(tiny_checkpoint, scheduling: str):
    path, config = tiny_checkpoint
    engine = LLMEngine_for(path, scheduling)
    prompts = random_prompts(5, config.vocab_size, seed=9)
    finish: dict[str, float] = {}
    first: dict[str, float] = {}

    def collect(out):
        if out.new_token_ids:
            first.setdefault(out.request_id, out.time)
        if out.finished:
            finish[out.request_id] = out.time

    long_id = engine.add_request(prompts[0], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), on_output=collect).request_id
    short_ids = [
        engine.add_request(p, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), on_output=collect).request_id
        for p in prompts[1:4]
    ]
    for _ in range(6):
        engine.step()
    late_id = engine.add_request(prompts[4], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True), on_output=collect).request_id
    while engine.has_work():
        engine.step()
    assert engine.core.kv.used_tokens == 0
    return long_id, short_ids, late_id, first, finish


def LLMEngine_for(path, scheduling: str) -> LLMEngine:
    from orca_backend.config import EngineConfig

    return LLMEngine(EngineConfig(model=str(path), max_num_seqs=8, scheduling=scheduling))


def test_iteration_level_short_requests_leave_early_and_new_ones_join(tiny_checkpoint):
    long_id, short_ids, late_id, first, finish = _run_long_and_short(tiny_checkpoint, "iteration")
    for sid in short_ids:
        assert finish[sid] < finish[long_id]
    assert first[late_id] < finish[long_id]  # joined the running batch
    assert finish[late_id] < finish[long_id]


def test_request_level_holds_the_batch_and_admits_nobody_midway(tiny_checkpoint):
    long_id, short_ids, late_id, first, finish = _run_long_and_short(tiny_checkpoint, "request")
    for sid in short_ids:  # every response of the batch is released together, at the end
        assert finish[sid] == finish[long_id]
        assert first[sid] == finish[long_id]
    assert first[late_id] > finish[long_id]  # waited for the whole batch


def test_request_level_returns_same_tokens(tiny_checkpoint):
    path, config = tiny_checkpoint
    prompts = random_prompts(6, config.vocab_size, seed=3)
    a = LLM(str(path)).generate(prompts, GREEDY)
    b = LLM(str(path), scheduling="request").generate(prompts, GREEDY)
    assert [o.output_ids for o in a] == [o.output_ids for o in b]


def test_max_batch_size_bounds_every_iteration(tiny_checkpoint):
    path, config = tiny_checkpoint
    llm = LLM(str(path), max_num_seqs=3)
    sizes = []
    runner = llm.engine.core.executor.runner
    original = runner.execute

    def spy(meta):
        sizes.append(len(meta.scheduled_ids))
        return original(meta)

    runner.execute = spy
    outs = llm.generate(random_prompts(10, config.vocab_size, seed=1), GREEDY)
    assert all(len(o.output_ids) == 12 for o in outs)
    assert max(sizes) == 3


def test_kv_capacity_limits_admission_without_overcommit(tiny_checkpoint):
    path, config = tiny_checkpoint
    # Each request reserves 10 + 12 = 22 slots (blocks of one slot); 50 slots hold two at a time.
    llm = LLM(str(path), kv_capacity_tokens=50, block_size=1, max_num_seqs=16, kv_policy="reserve")
    engine = llm.engine
    peak = 0
    original = engine.core.executor.runner.execute

    def spy(meta):
        nonlocal peak
        assert engine.core.kv.used_tokens <= engine.core.kv.capacity_tokens
        peak = max(peak, len(meta.scheduled_ids))
        return original(meta)

    engine.core.executor.runner.execute = spy
    prompts = [[i + 1] * 10 for i in range(6)]
    outs = llm.generate(prompts, GREEDY)
    assert peak == 2
    assert all(len(o.output_ids) == 12 for o in outs)
    assert engine.core.kv.used_tokens == 0


def test_background_loop_streams_and_abort_frees_kv(tiny_checkpoint):
    path, _ = tiny_checkpoint
    from orca_backend.config import EngineConfig

    # Each forward waits for the test's permit, so how far generation gets does not depend on
    # the machine's speed.
    gate = StepGate()
    engine = LLMEngine.launch(EngineConfig(model=str(path)), core_hook=gate)
    try:
        # Added together, so both join the first iteration: five iterations finish the short one.
        long, short = engine.add_requests(
            [[1, 2, 3], [4, 5]],
            [SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
             SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)],
        )  # fmt: skip
        gate.allow(5)
        got = [o for o in short]
        assert sum(len(o.new_token_ids) for o in got) == 5 and got[-1].finish_reason == "length"
        first = next(iter(long))
        assert not first.finished
        engine.abort_request(long.request_id)
        assert gate.wait_for_abort()  # in the core's inbox: not racing the reader thread
        gate.open()  # the iteration already waiting runs; the abort is taken in before the next
        rest = list(long)
        assert rest[-1].finished and rest[-1].finish_reason == "cancelled"
        tokens = len(first.new_token_ids) + sum(len(o.new_token_ids) for o in rest)
        assert tokens <= 6
        # Abort is processed before the next iteration; afterwards the pool is empty again.
        again = engine.add_request([7], SamplingParams(max_tokens=3, temperature=0.0))
        list(again)
        assert engine.stats().kv_used_tokens == 0 and engine.stats().num_running == 0
    finally:
        engine.shutdown()


def test_paged_pool_runs_more_requests_at_once_and_preempts_without_changing_tokens(tiny_checkpoint):
    path, _ = tiny_checkpoint
    prompts = [[i + 1] * 10 for i in range(6)]
    reserve = LLM(str(path), kv_capacity_tokens=50, block_size=1, kv_policy="reserve")
    reserved = [o.output_ids for o in reserve.generate(prompts, GREEDY)]
    # The same 50 slots, paged: admission asks for the prompt only, so five requests start at once
    # and then run out of room as they decode: the newest are preempted and recomputed.
    llm = LLM(str(path), kv_capacity_tokens=50, block_size=1, kv_policy="paged", max_num_seqs=16)
    runner = llm.engine.core.executor.runner
    sizes = []
    original = runner.execute

    def spy(meta):
        sizes.append(len(meta.scheduled_ids))
        return original(meta)

    runner.execute = spy
    outs = llm.generate(prompts, GREEDY)
    assert [o.output_ids for o in outs] == reserved
    stats = llm.engine.stats()
    assert max(sizes) == 5 and stats.num_preemptions > 0 and stats.kv_used_blocks == 0
