"""Batching, observed through the engine: a request's tokens are the same alone, in a batch of 16,
joining a batch mid-decode and under request-level scheduling (batch invariance); and what bounds a
batch: max_num_seqs, and the K/V pool under ORCA's reservation (no overcommit) and the paged policy
(more requests at once, preempted without changing a token). The scheduler's other decisions are
tests/core/test_scheduler.py's."""

from __future__ import annotations

import pytest
from engine_helpers import random_prompts
from kv_modes import KV_MODES

from orca_backend import LLM, SamplingParams
from orca_backend.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


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
