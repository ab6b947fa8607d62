"""The offline LLM's lifecycle (orca_backend/entrypoints/llm.py): its engine and worker processes end
with shutdown(), a `with` block, the LLM being dropped, or the interpreter exiting. The Ray
backend's counterpart (actors and placement groups) is in tests/executor/test_ray.py."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import subprocess
import sys
import weakref

import pytest
from core_hooks import pid_alive
from serving_utils import wait_until

from orca_backend import LLM, SamplingParams
from orca_backend.engine.llm_engine import EngineDeadError

PROMPTS = [[5, 6, 7], [8]]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_dropped_llms_leave_no_worker_processes():
    """Three tp=2 engines in a row, each dropped with `del`: nothing keeps an LLM alive, and its
    workers are gone (joined) by the time the next one starts."""
    for _ in range(3):
        llm = LLM("gpt2-tiny", tensor_parallel_size=2)
        llm.generate(PROMPTS, GREEDY)
        workers = llm.engine.core.executor.pids
        assert len(workers) == 2 and all(map(pid_alive, workers))
        collected = weakref.ref(llm)
        del llm
        assert collected() is None  # freed by its reference count: no cycle holds it
        gc.collect()
        assert not any(map(pid_alive, workers))
        assert not {p.pid for p in mp.active_children()} & set(workers)


def test_a_with_block_stops_the_engine_and_shutdown_is_idempotent():
    with LLM("gpt2-tiny", tensor_parallel_size=2) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        workers = llm.engine.core.executor.pids
    assert [len(o.output_ids) for o in outputs] == [4, 4]
    assert not any(map(pid_alive, workers))
    llm.shutdown()
    with pytest.raises(EngineDeadError, match="shut down"):
        llm.generate(PROMPTS, GREEDY)


# An LLM left to the interpreter's exit: it prints its workers' pids and returns.
LEFT_AT_EXIT = """
import json
from orca_backend import LLM, SamplingParams
llm = LLM("gpt2-tiny", tensor_parallel_size=2)
llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, temperature=0.0))
print(json.dumps(llm.engine.core.executor.pids), flush=True)
"""


def test_an_llm_left_at_interpreter_exit_stops_cleanly():
    done = subprocess.run([sys.executable, "-c", LEFT_AT_EXIT], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    workers = json.loads(done.stdout)
    assert wait_until(lambda: not any(map(pid_alive, workers)), timeout_s=60)
