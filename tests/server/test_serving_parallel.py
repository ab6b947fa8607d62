"""`orca` with tensor_parallel_size=2 on a real tritonserver: the engine inside Triton's Python
backend spawns its worker processes (gloo on CPU), and the served tokens equal one process's."""

from __future__ import annotations

import os
import signal

import pytest
from core_hooks import pid_alive

from orca_backend.entrypoints.llm import LLM
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.sampling_params import SamplingParams
from orca_client.served_path import process_tree

pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")

from serving_utils import StreamSession, engine_processes, metric, start_server, wait_until  # noqa: E402 - after the skip

pytestmark = pytest.mark.integration

# Four heads and an even vocabulary so that tp=2 splits both.
MODEL = GPT2Config(vocab_size=384, n_positions=256, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(MODEL)[0]


@pytest.fixture(scope="module")
def tp2_server(checkpoint, tmp_path_factory):
    server = start_server(
        tmp_path_factory.mktemp("triton-tp2"), checkpoint, models=("orca",),
        parameters={"tensor_parallel_size": "2", "kv_capacity_tokens": "4096"},
    )  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


def test_tp2_served_greedy_streams_equal_single_process_generate(tp2_server, checkpoint):
    prompts = [[5, 17, 99, 3], [200] * 30, list(range(1, 60)), [7]]
    max_tokens = [24, 8, 40, 16]  # different lengths: requests leave while others decode
    with StreamSession(tp2_server.grpc_url) as session:
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            session.send("orca", f"tp{i}", input_ids=prompt, max_tokens=n, sampling={"temperature": 0}, stream=True)
        results = session.wait()
    expected = LLM(str(checkpoint)).generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0) for n in max_tokens])
    for result, want in zip(results, expected, strict=True):
        assert result.error is None
        assert result.ids == want.output_ids
        assert result.deltas[-1].final and not any(d.final for d in result.deltas[:-1])
    assert wait_until(lambda: metric(tp2_server, "orca_kv_used_tokens", "orca") == 0, timeout_s=30)
    assert tp2_server.is_ready()


@pytest.fixture
def doomed_tp2_server(checkpoint, tmp_path):
    server = start_server(tmp_path / "triton", checkpoint, models=("orca",),
                          parameters={"tensor_parallel_size": "2", "kv_capacity_tokens": "4096"})
    try:
        yield server
    finally:
        server.stop()


def test_killed_engine_core_process_ends_every_stream_and_leaves_nothing_running(doomed_tp2_server):
    """SIGKILL the engine core process (the tp=2 workers' master) while streams are under way."""
    server = doomed_tp2_server
    _, core, workers = engine_processes(server.process.pid)
    assert len(workers) == 2, [p.cmdline for p in process_tree(core)]
    # One gRPC stream per request: a stream's error names no request, so each session has one.
    sessions = [StreamSession(server.grpc_url) for _ in range(6)]
    try:
        results = [s.send("orca", f"s{i}", input_ids=[3 + i, 40, 41], max_tokens=200, sampling={"temperature": 0},
                          stream=True) for i, s in enumerate(sessions)]  # fmt: skip
        assert wait_until(lambda: all(r.deltas for r in results), timeout_s=120)  # every stream is generating
        os.kill(core, signal.SIGKILL)
        for session in sessions:
            session.wait()
    finally:
        for session in sessions:
            session.close()
    for result in results:
        assert result.error is not None and "UNAVAILABLE" in result.error.upper(), result.error
        assert "SIGKILL" in result.error
    assert wait_until(lambda: not server.is_ready(), timeout_s=30)  # the model unloaded itself
    assert wait_until(lambda: not any(map(pid_alive, [core, *workers])), timeout_s=30)
    assert server.is_live()
