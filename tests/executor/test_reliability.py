"""Failures no exception reports in time: the failure budget (a run of failed iterations ends the
engine), the watchdog (a hung iteration ends the engine core process and every request), a stream
whose event never comes (iterating it fails with the request named instead of hanging), and a
tensor-parallel worker that stops, or whose sampling fails for one request of its batch."""

from __future__ import annotations

import os
import signal

import pytest
from core_hooks import PoisonSampling, StepGate, pid_alive
from engine_helpers import GREEDY
from serving_utils import wait_until

from orca_backend import LLM, SamplingParams
from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine

PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def failing_iterations(llm: LLM, failing: set[int]) -> None:
    """Makes the model's forwards number `failing` (counted from 1) raise, as a device error would."""
    runner = llm.engine.core.executor.runner
    original, count = runner.execute, [0]

    def execute(meta):
        count[0] += 1
        if count[0] in failing:
            raise RuntimeError(f"injected failure {count[0]}")
        return original(meta)

    runner.execute = execute


def run(llm: LLM, n: int) -> list[list]:
    streams = [llm.engine.add_request([1, 2, 3], PARAMS) for _ in range(n)]
    while llm.engine.has_work():
        llm.engine.step()
    return [list(s) for s in streams]


def test_a_run_of_failed_iterations_ends_the_engine(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint[0]), max_num_seqs=1, max_consecutive_failed_iterations=2)
    failing_iterations(llm, {1, 2, 3})
    events = run(llm, 3)
    assert [e[-1].finish_reason for e in events] == ["error"] * 3
    assert "injected failure 1" in events[0][-1].error and "injected failure 2" in events[1][-1].error
    assert "2 iterations in a row failed; the last: injected failure 2" in events[2][-1].error
    assert not llm.engine.healthy


def test_a_success_between_failures_resets_the_budget(tiny_checkpoint):
    llm = LLM(str(tiny_checkpoint[0]), max_num_seqs=1, max_consecutive_failed_iterations=2)
    failing_iterations(llm, {1, 3})
    events = run(llm, 3)
    assert [e[-1].finish_reason for e in events] == ["error", "error", "length"]
    assert llm.engine.healthy


def test_the_watchdog_ends_a_hung_iteration_and_every_request(tiny_checkpoint):
    gate = StepGate()  # never opened: the first iteration hangs
    engine = LLMEngine.launch(EngineConfig(model=str(tiny_checkpoint[0]), iteration_timeout_s=2), core_hook=gate)
    try:
        streams = [engine.add_request([1, 2, 3], PARAMS) for _ in range(3)]
        for stream in streams:
            last = list(stream)[-1]  # ends: the watchdog fires after ~2 s
            assert last.finish_reason == "error"
            assert "no engine iteration finished" in last.error and "iteration_timeout_s=2" in last.error
        assert not engine.healthy and not pid_alive(engine.core.pid)
    finally:
        engine.shutdown()


@pytest.mark.slow
def test_a_stopped_tensor_parallel_worker_is_noticed_and_no_process_outlives_it(tiny_checkpoint):
    engine = LLMEngine.launch(EngineConfig(model=str(tiny_checkpoint[0]), tensor_parallel_size=2, iteration_timeout_s=3))
    workers = list(engine.core.worker_pids)
    try:
        assert list(engine.add_request([1, 2], PARAMS))[-1].finish_reason == "length"  # serving
        os.kill(workers[1], signal.SIGSTOP)
        streams = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True)) for _ in range(4)]
        for stream in streams:
            last = list(stream)[-1]
            assert last.finish_reason == "error" and "no engine iteration finished" in last.error
        assert not engine.healthy
    finally:
        engine.shutdown()
    # SIGKILLed, but reaped by whichever process adopts them: give that a moment.
    assert wait_until(lambda: not pid_alive(engine.core.pid) and not any(pid_alive(pid) for pid in workers)), [
        (pid, pid_alive(pid)) for pid in workers]


def test_a_batch_whose_sampling_fails_in_a_tensor_parallel_worker_fails_only_its_culprit(tiny_checkpoint):
    """Sampling runs after every collective, so a worker that fails there reports the batch and goes
    on: the engine narrows the failure down to the request that causes it, as in one process."""
    path = str(tiny_checkpoint[0])
    engine = LLMEngine.launch(EngineConfig(model=path, tensor_parallel_size=2, max_consecutive_failed_iterations=3),
                              core_hook=PoisonSampling("poison"))  # fmt: skip
    try:
        prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [10]]
        ids = ["a", "b", "poison", "c"]
        streams = engine.add_requests(prompts, PARAMS, request_ids=ids)
        events = {s.request_id: list(s) for s in streams}
        assert events["poison"][-1].finish_reason == "error" and "sampling failed" in events["poison"][-1].error
        reference = LLM(path).generate(prompts, PARAMS)
        for rid, ref in zip(ids, reference, strict=True):
            if rid != "poison":
                assert [t for e in events[rid] for t in e.new_token_ids] == ref.output_ids
        assert engine.healthy and all(pid_alive(pid) for pid in engine.core.worker_pids)
        again = engine.add_request([1, 2, 3], PARAMS)
        assert [t for e in again for t in e.new_token_ids] == reference[0].output_ids
    finally:
        engine.shutdown()


def test_iterating_a_stream_whose_event_never_comes_fails_with_the_request_named(tiny_checkpoint, monkeypatch):
    """Not stepped, the in-process engine never produces an event: iteration fails, it does not hang."""
    from orca_backend.engine.llm_engine import RequestStream

    monkeypatch.setattr(RequestStream, "wait_timeout_s", 0.2)
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0])))
    stream = engine.add_request([1, 2], GREEDY, request_id="never-stepped")
    with pytest.raises(TimeoutError, match=r"request never-stepped: no event for 0.2 s"):
        list(stream)
