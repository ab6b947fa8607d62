"""The scheduler's decisions (core/scheduler.py, core/waiting_queue.py): the waiting queue's order
(priorities with aging, first come first served within one, a request whose grammar compiled taking
its place by arrival), iteration-level admission against request-level mode, chunked prefill under a
token budget, preemption (lowest priority first, by recompute with every token kept), deadlines and
aborts (`expire`, a cancel taken in before the next iteration), and a failed batch narrowed down to
the request that fails (`fail_batch`). Time is the scheduler's injected clock wherever the outcome
depends on it, so no test races the machine. What bounds a batch's size (max_num_seqs, the K/V pool)
is tests/engine/test_batching.py's; the K/V manager's own accounting is tests/core/test_kv_cache.py's.
"""

from __future__ import annotations

import random

import pytest
from core_hooks import StepGate
from engine_helpers import GREEDY, drain, long_prompts, mixed_params, random_prompts

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.core.kv_cache_manager import make_kv_manager
from orca_backend.core.request import Request
from orca_backend.core.scheduler import Scheduler
from orca_backend.core.waiting_queue import WaitingQueue
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.kv_groups import one_table
from orca_backend.messages import FinishReason


class Clock:
    """The scheduler's clock, moved by the test; starts at the real monotonic time."""

    def __init__(self) -> None:
        import time

        self.now = time.monotonic()

    def __call__(self) -> float:
        return self.now


def engine_with_clock(checkpoint, **config) -> tuple[LLMEngine, Clock]:
    engine = LLMEngine(EngineConfig(model=str(checkpoint), **config))
    clock = Clock()
    engine.core.scheduler.clock = clock
    return engine, clock


class FirstEvents:
    """An output sink recording the order in which requests had their first event."""

    def __init__(self) -> None:
        self.order: list[str] = []

    def __call__(self, event) -> None:
        if event.request_id not in self.order:
            self.order.append(event.request_id)


# ------------------------------------------------------------------------- the queue and priorities
def test_waiting_queue_serves_lower_priority_values_first_fcfs_within_one():
    q = WaitingQueue()
    reqs = {name: Request(name, [1], GREEDY, arrival_time=t, priority=p)
            for name, t, p in [("a", 0, 1), ("b", 1, 0), ("c", 2, 1), ("d", 3, 0), ("e", 4, -1)]}  # fmt: skip
    for r in reqs.values():
        q.append(r)
    order = []
    while q:
        head = q.head(now=10.0)
        q.remove(head)
        order.append(head.request_id)
    assert order == ["e", "b", "d", "a", "c"]


def test_aging_lifts_a_waiting_request_one_level_per_aging_period():
    q = WaitingQueue(aging_s=10.0)
    low = Request("low", [1], GREEDY, arrival_time=0.0, priority=2)
    high = Request("high", [1], GREEDY, arrival_time=15.0, priority=0)
    q.append(low)
    q.append(high)
    assert q.head(now=15.0) is high  # low has waited 15 s: one level up, still behind priority 0
    assert q.head(now=19.9) is high
    assert q.head(now=20.0) is low  # two levels up after 20 s: equal to high, and it arrived first


def test_aging_closes_the_widest_allowed_gap_in_bounded_time(tiny_checkpoint):
    """Priorities lie in [-max_priority, max_priority]: a request at the worst priority goes ahead of
    every best-priority request that arrives 2 * max_priority aging periods (400 s) after it, however
    many keep arriving. (Before the bound, a client could send -2**31 + 1 and no aging caught up.)"""
    top = EngineConfig().max_priority
    q = WaitingQueue(aging_s=10.0)
    worst = Request("worst", [1], GREEDY, arrival_time=0.0, priority=top)
    q.append(worst)
    early = Request("early", [1], GREEDY, arrival_time=390.0, priority=-top)  # 39 levels after it: still ahead
    q.append(early)
    assert q.head(now=399.0) is early
    q.remove(early)
    for t in range(400, 600, 5):  # best-priority arrivals from 400 s on
        q.append(Request(f"best{t}", [1], GREEDY, arrival_time=float(t), priority=-top))
    assert q.head(now=600.0) is worst  # 40+ levels up: at least equal to -20, and it arrived first
    with pytest.raises(ValueError, match=r"priority must be an integer in \[-20, 20\]"):
        LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]))).add_request([1], GREEDY, priority=-(2**31) + 1)


def test_removing_from_the_middle_and_requeueing_at_the_head():
    q = WaitingQueue()
    reqs = [Request(f"r{i}", [1], GREEDY, arrival_time=i) for i in range(5)]
    for r in reqs:
        q.append(r)
    q.remove(reqs[2])
    assert reqs[2] not in q and len(q) == 4
    preempted = Request("p", [1], GREEDY, arrival_time=9.0)
    q.appendleft(preempted)
    assert q.head(now=10.0) is preempted
    assert [r.request_id for r in q] == ["p", "r0", "r1", "r3", "r4"]


def test_a_compiled_request_takes_its_place_in_the_queue_by_arrival():
    """While its grammar compiles a request waits out of the queue (it holds nobody up); compiled, it goes
    before the requests of its priority that arrived after it (ties of arrival time: the order the
    scheduler took them in)."""
    def request(name: str, arrival: float, order: int, priority: int = 0) -> Request:
        r = Request(name, [1], SamplingParams(), arrival_time=arrival, priority=priority)
        r.arrival_order = order
        return r

    queue = WaitingQueue()
    for r in (request("a", 1.0, 0), request("c", 2.0, 2), request("d", 3.0, 3), request("x", 0.5, 4, priority=1)):
        queue.append(r)
    queue.insert(request("b", 2.0, 1))  # arrived with c, taken in before it
    queue.insert(request("e", 4.0, 5))  # the last to arrive: the tail
    queue.insert(request("w", 0.1, 6, priority=1))
    assert [r.request_id for r in queue] == ["a", "b", "c", "d", "e", "w", "x"] and len(queue) == 7

    class Compiles:  # the scheduler's StructuredOutputManager, with compiles that end when the test says
        def __init__(self) -> None:
            self.pending, self.done = set(), []

        def submit(self, request_id, spec) -> None:
            self.pending.add(request_id)

        def poll(self):
            done, self.done = self.done, []
            return done

        def remove(self, request_id) -> None:
            self.pending.discard(request_id)

    compiles = Compiles()
    scheduler = Scheduler(make_kv_manager(EngineConfig(), one_table([0], [range(1)])), 1, False, None,
                          structured=compiles)  # fmt: skip
    for name in ("constrained", "first", "second"):
        scheduler.add(Request(name, [1, 2], SamplingParams(structured_outputs={"regex": "a"} if name == "constrained"
                                                           else None), arrival_time=0.0))  # fmt: skip
    assert scheduler.schedule().requests[0].request_id == "first"  # the compiling request holds nobody up
    assert scheduler.num_compiling == 1 and [r.request_id for r in scheduler.waiting] == ["second"]
    compiles.done.append(("constrained", None, None))
    assert not scheduler.take_compiled()
    assert [r.request_id for r in scheduler.waiting] == ["constrained", "second"]  # by arrival


def test_the_engine_admits_by_priority_and_equal_priorities_first_come_first_served(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=1, priority_aging_s=0))
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = FirstEvents()
    engine.add_request([1, 2], params, request_id="first", on_output=first)
    engine.step()  # first runs; everyone below waits for the one seat
    for rid, priority in [("b1", 1), ("c0", 0), ("d1", 1), ("e-1", -1), ("f0", 0)]:
        engine.add_request([1, 2], params, request_id=rid, priority=priority, on_output=first)
    drain(engine)
    assert first.order == ["first", "e-1", "c0", "f0", "b1", "d1"]


# --------------------------------------------------------------- iteration-level vs request-level
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


# --------------------------------------------------------------------------------- chunked prefill
def spy_iterations(llm: LLM) -> list[tuple[int, int]]:
    """(requests, tokens) of every iteration the model runs."""
    runner = llm.engine.core.executor.runner
    seen: list[tuple[int, int]] = []
    original = runner.execute

    def spy(meta):
        seen.append((len(meta.scheduled_ids), meta.num_tokens))
        return original(meta)

    runner.execute = spy
    return seen


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    path, config = tiny_checkpoint
    prompts = long_prompts(10, config.vocab_size, seed=2)
    params = mixed_params(10, seed=2)
    outs = LLM(str(path), max_num_seqs=4).generate(prompts, params)
    return str(path), prompts, params, [o.output_ids for o in outs]


@pytest.mark.parametrize("policy", ["reserve", "paged"])
@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_gives_the_unchunked_tokens(reference, policy, budget):
    path, prompts, params, expected = reference
    llm = LLM(path, max_num_seqs=4, kv_policy=policy, max_num_batched_tokens=budget)
    iterations = spy_iterations(llm)
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert max(tokens for _, tokens in iterations) <= budget
    if budget > 1:  # decodes ride along with prompt chunks
        assert any(requests > 1 and tokens > requests for requests, tokens in iterations)


# ------------------------------------------------------------------------------------- preemption
def test_preemption_takes_the_lowest_priority_first(tiny_checkpoint):
    """Two running requests outgrow a small paged pool: the older, low-priority one is preempted
    rather than the newest (which a priority-blind scheduler would take)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), kv_capacity_tokens=32, block_size=4,
                                    kv_policy="paged", kv_watermark=0.0, priority_aging_s=0))  # fmt: skip
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    scheduler = engine.core.scheduler
    preempt, victims = scheduler._preempt, []
    scheduler._preempt = lambda request: victims.append(request.request_id) or preempt(request)
    low = engine.add_request([1] * 8, params, request_id="low", priority=5)
    engine.step()
    high = engine.add_request([2] * 8, params, request_id="high", priority=0)
    drain(engine)
    assert victims and set(victims) == {"low"}
    low_events, high_events = list(low), list(high)
    assert high_events[-1].num_output_tokens == low_events[-1].num_output_tokens == 12
    reference = LLM(str(tiny_checkpoint[0])).generate([[1] * 8, [2] * 8], params)
    assert [t for e in low_events for t in e.new_token_ids] == reference[0].output_ids
    assert [t for e in high_events for t in e.new_token_ids] == reference[1].output_ids


@pytest.mark.parametrize("seed", range(4))
def test_a_pool_too_small_for_the_batch_preempts_and_keeps_every_token(tiny_checkpoint, seed):
    path, config = tiny_checkpoint
    prompts = long_prompts(8, config.vocab_size, seed=seed)
    params = mixed_params(8, seed=seed)
    expected = [LLM(str(path)).generate([p], [sp])[0].output_ids for p, sp in zip(prompts, params, strict=True)]
    llm = LLM(str(path), kv_policy="paged", block_size=4, kv_capacity_tokens=64, max_num_seqs=8, kv_watermark=0.0,
              max_num_batched_tokens=random.Random(seed).choice([0, 16]))  # fmt: skip
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_used_blocks == 0


# ---------------------------------------------------------------------------- deadlines and aborts
def test_a_queued_request_times_out_with_a_clear_error_and_holds_nothing(tiny_checkpoint):
    engine, clock = engine_with_clock(tiny_checkpoint[0], max_num_seqs=1)
    long = engine.add_request([1, 2], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    queued = engine.add_request([3, 4], GREEDY, timeout_s=2.0)
    engine.step()  # long runs; queued waits behind it (max_num_seqs 1)
    clock.now += 100.0  # far past the deadline, however slowly the lines above ran
    engine.step()
    events = list(queued)
    assert [e.finish_reason for e in events] == ["timeout"] and events[0].new_token_ids == []
    assert "timeout of 2 s passed while it was waiting in the queue (0 tokens generated)" in events[0].error
    drain(engine)
    assert list(long)[-1].num_output_tokens == 6  # the other request is untouched
    assert engine.core.kv.used_tokens == 0 and not engine.has_work()


def test_a_running_request_times_out_keeping_what_it_streamed(tiny_checkpoint):
    engine, clock = engine_with_clock(tiny_checkpoint[0], kv_policy="reserve")
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    timed = engine.add_request([1, 2, 3], params, timeout_s=1.0)
    other = engine.add_request([4, 5], SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True))
    for _ in range(3):
        engine.step()
    clock.now += 100.0
    engine.step()
    events = list(timed)
    assert events[-1].finish_reason == "timeout" and events[-1].num_output_tokens == 3
    assert "while it was running (3 tokens generated)" in events[-1].error
    assert [t for e in events for t in e.new_token_ids] == \
        LLM(str(tiny_checkpoint[0])).generate([[1, 2, 3]], params)[0].output_ids[:3]  # fmt: skip
    drain(engine)
    assert list(other)[-1].finish_reason == "length"
    assert engine.core.kv.used_tokens == 0


def test_a_request_finished_before_its_deadline_is_not_touched_by_it(tiny_checkpoint):
    engine, clock = engine_with_clock(tiny_checkpoint[0])
    stream = engine.add_request([1, 2], GREEDY, timeout_s=1.0)
    drain(engine)
    clock.now += 100.0
    later = engine.add_request([1, 2], GREEDY)
    drain(engine)
    assert [e.finish_reason for e in stream][-1] == "length" and list(later)[-1].finish_reason == "length"


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


# ----------------------------------------------------------------------------- failing batch member
def poison_runner(engine: LLMEngine, poison: set[str]) -> list[list[str]]:
    """Makes any forward holding a request in `poison` raise, as a request that breaks the model
    would; returns the request ids of every forward tried."""
    runner = engine.core.executor.runner
    original, tried = runner.execute, []

    def execute(meta):
        tried.append(list(meta.scheduled_ids))
        if poison & set(meta.scheduled_ids):
            raise RuntimeError("injected: this batch holds a poison request")
        return original(meta)

    runner.execute = execute
    return tried


@pytest.mark.parametrize("kv_policy", ["paged", "reserve"])
def test_a_request_that_breaks_its_batch_fails_alone_and_the_others_are_exact(tiny_checkpoint, kv_policy):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), kv_policy=kv_policy, max_consecutive_failed_iterations=3))
    tried = poison_runner(engine, {"r5"})
    prompts = [[i + 1, i + 2, i + 3] for i in range(8)]
    params = [SamplingParams(max_tokens=5, temperature=0.0 if i % 2 else 0.8, seed=i, ignore_eos=True) for i in range(8)]
    streams = engine.add_requests(prompts, params, request_ids=[f"r{i}" for i in range(8)])
    drain(engine)
    events = {s.request_id: list(s) for s in streams}
    assert events["r5"][-1].finish_reason == "error" and "poison" in events["r5"][-1].error
    reference = LLM(str(tiny_checkpoint[0])).generate(prompts, params)
    for i in range(8):
        if i != 5:
            assert [t for e in events[f"r{i}"] for t in e.new_token_ids] == reference[i].output_ids
    # Narrowed down in halves, each half alone: 8 -> 4 + 4 -> 2 -> 1 + 1 (never two failures in a row
    # past the budget of 3); then the seven go on together.
    r = [f"r{i}" for i in range(8)]
    assert tried[:6] == [r, r[:4], r[4:], ["r4", "r5"], ["r4"], ["r5"]]
    assert all("r5" not in ids for ids in tried[6:]) and max(len(ids) for ids in tried[6:]) == 7
    assert engine.healthy
    assert engine.core.kv.used_tokens == 0 and not engine.has_work()


@pytest.mark.parametrize(("batch", "poisoned"), [(32, [3, 4, 20, 31]), (32, [0, 1, 2, 3, 4, 5, 6, 7]),
                                                (256, [0, 1]), (256, [0, 37, 38, 90, 128, 129, 200, 255])])
def test_any_number_of_poison_requests_fail_alone_and_the_engine_goes_on(tiny_checkpoint, batch, poisoned):
    """Re-runs that narrow a failed batch down to its poison requests do not spend the failure
    budget (10): up to 8 poison requests, adjacent or spread, in batches of 32 and 256 each fail
    alone, every bystander's tokens are exact, and the engine stays healthy."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=batch,
                                    kv_capacity_tokens=batch * 32))  # fmt: skip
    ids = [f"r{i}" for i in range(batch)]
    poison = {ids[i] for i in poisoned}
    tried = poison_runner(engine, poison)
    prompts = [[1 + i % 50, 2 + i % 7, 3] for i in range(batch)]
    streams = engine.add_requests(prompts, GREEDY, request_ids=ids)
    drain(engine)
    reference = LLM(str(tiny_checkpoint[0]), max_num_seqs=batch).generate(prompts, GREEDY)
    for stream, want in zip(streams, reference, strict=True):
        events = list(stream)
        if stream.request_id in poison:
            assert events[-1].finish_reason == "error" and "poison" in events[-1].error
        else:
            assert [t for e in events for t in e.new_token_ids] == want.output_ids, stream.request_id
    assert engine.healthy, engine.dead_reason
    assert len(tried[0]) == batch and engine.core.kv.used_tokens == 0


def test_a_sticky_failure_of_every_fresh_batch_spends_the_failure_budget(tiny_checkpoint):
    """A sticky device error fails every batch, each member alone too: bisection attributes nothing,
    and the failures of the fresh batches (not their re-runs) count until the budget is spent."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=2, max_consecutive_failed_iterations=4))
    tried = poison_runner(engine, {f"r{i}" for i in range(12)})
    streams = engine.add_requests([[1, 2]] * 12, GREEDY, request_ids=[f"r{i}" for i in range(12)])
    drain(engine)
    assert all(list(s)[-1].finish_reason == "error" for s in streams)
    assert not engine.healthy and "4 iterations in a row failed" in engine.dead_reason
    # Four fresh pairs, the first three narrowed down to each member alone before the next was tried.
    assert tried == [["r0", "r1"], ["r0"], ["r1"], ["r2", "r3"], ["r2"], ["r3"], ["r4", "r5"], ["r4"], ["r5"],
                     ["r6", "r7"]]  # fmt: skip


def test_a_request_whose_batch_mate_was_aborted_mid_flight_is_re_run_before_it_is_blamed(tiny_checkpoint):
    """The culprit of a failed forward is cancelled while its batch runs: the one request left may be
    innocent, so it is re-run alone (and its tokens are exact), not failed in the culprit's place."""
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0])))
    runner = engine.core.executor.runner
    original, tried = runner.execute, []

    def execute(meta):
        tried.append(list(meta.scheduled_ids))
        if "culprit" in meta.scheduled_ids:
            # Its abort lands while the batch runs (as with pipeline parallelism), its event reported.
            engine._process(engine.core.scheduler.finish("culprit", FinishReason.CANCELLED))
            raise RuntimeError("injected: the culprit's input breaks the forward")
        return original(meta)

    runner.execute = execute
    culprit, bystander = engine.add_requests([[3, 4], [5, 6, 7]], GREEDY, request_ids=["culprit", "bystander"])
    drain(engine)
    assert list(culprit)[-1].finish_reason == "cancelled"
    events = list(bystander)
    assert events[-1].finish_reason == "length", events[-1].error
    assert [t for e in events for t in e.new_token_ids] == LLM(str(tiny_checkpoint[0])).generate([[5, 6, 7]], GREEDY)[0].output_ids
    assert tried[:2] == [["culprit", "bystander"], ["bystander"]] and engine.healthy
