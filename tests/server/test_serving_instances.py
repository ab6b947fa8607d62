"""`orca` with three Triton instances over one engine core, on a real tritonserver (server/instances.py,
core/frontends.py): requests spread over every instance get the offline tokens, a cancel on any
instance frees its K/V, metrics count each request and token once, unloading leaves no process, and
the core's death fails every instance's requests and unloads the model.
"""

from __future__ import annotations

import os
import re
import signal

import pytest

from orca_backend.entrypoints.llm import LLM
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.sampling_params import SamplingParams

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")
httpclient = pytest.importorskip("tritonclient.http", reason="needs the serve extras (tritonclient)")

from serving_utils import StreamSession, metric, model_processes, start_server, wait_until  # noqa: E402

from orca_client.served_path import process_tree  # noqa: E402

pytestmark = pytest.mark.integration

INSTANCES = 3
SERVER_MODEL = GPT2Config(vocab_size=384, n_positions=1024, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
ADMIN_KEY = "instances-test"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(SERVER_MODEL)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("instances"), checkpoint[0], models=("orca",), instances=INSTANCES,
                          admin_key=ADMIN_KEY, parameters={"kv_capacity_tokens": "32768"})  # fmt: skip
    try:
        yield server
    finally:
        server.stop()
        print("\n".join(line for line in server.log_tail(20000).splitlines() if not line.startswith(("|", "+"))))


@pytest.fixture(scope="module")
def reference(checkpoint):
    llm = LLM(str(checkpoint[0]))
    return lambda prompt, max_tokens: llm.generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0))[0]


def stubs_and_cores(server) -> tuple[list[int], list[int]]:
    return model_processes(server.process.pid, "orca")


def instances_that(server, what: str) -> set[str]:
    """The instances whose log lines say `what` about a request (its id names its instance)."""
    return set(re.findall(r"orca: \S+#(orca_\d+_\d+)/\d+: " + what, server.log_tail(400_000)))


def test_one_core_serves_every_instances_requests_with_the_offline_tokens(server, reference):
    stubs, cores = stubs_and_cores(server)
    assert len(stubs) == INSTANCES and len(cores) == 1, (stubs, cores)
    success_before = metric(server, "vllm:request_success_total", "orca")
    generated_before = metric(server, "orca_generated_tokens_total", "orca")
    counted_before = metric(server, "vllm:generation_tokens_total", "orca")
    prompts = [[(5 * i + j) % 300 + 1 for j in range(2 + i % 5)] for i in range(4 * INSTANCES)]
    max_tokens = [4 + i % 6 for i in range(len(prompts))]
    sessions = [StreamSession(server.grpc_url) for _ in range(INSTANCES)]
    try:
        results = []
        for i, (prompt, n) in enumerate(zip(prompts, max_tokens, strict=True)):
            results.append(sessions[i % INSTANCES].send("orca", f"spread{i}", input_ids=prompt, max_tokens=n,
                                                        sampling=GREEDY, stream=True))  # fmt: skip
        for session in sessions:
            session.wait()
    finally:
        for session in sessions:
            session.close()
    for result, prompt, n in zip(results, prompts, max_tokens, strict=True):
        assert result.error is None, result.error
        assert result.ids == reference(prompt, n).output_ids, result.request_id
    # Counted once: each request's end by the instance that served it, the engine's totals by the core's owner.
    total = sum(max_tokens)
    assert wait_until(lambda: metric(server, "vllm:request_success_total", "orca") == success_before + len(prompts))
    assert wait_until(lambda: metric(server, "orca_generated_tokens_total", "orca") == generated_before + total)
    assert metric(server, "vllm:generation_tokens_total", "orca") == counted_before + total


def test_a_cancel_on_any_instance_frees_its_kv(server, reference):
    cancelled_before = metric(server, "orca_requests_finished_total", "orca", reason="cancelled")
    (core,) = stubs_and_cores(server)[1]
    session = StreamSession(server.grpc_url)
    count = 3 * INSTANCES
    results = [session.send("orca", f"doomed{i}", input_ids=[9, 8, i + 1], max_tokens=1000, sampling=GREEDY,
                            stream=True) for i in range(count)]  # fmt: skip
    closed = False
    try:
        assert wait_until(lambda: all(len(r.ids) >= 2 for r in results), timeout_s=120, interval_s=0.01)
        # Held still until every instance has sent its aborts: none can run to max_tokens first.
        os.kill(core, signal.SIGSTOP)
        try:
            assert wait_until(lambda: metric(server, "orca_kv_used_tokens", "orca") > 0, timeout_s=10)
            session.close(cancel=True)
            closed = True
            assert wait_until(lambda: len(re.findall(r"orca: doomed\d+#\S+: cancelled by the client",
                                                     server.log_tail(400_000))) == count, timeout_s=60)  # fmt: skip
        finally:
            os.kill(core, signal.SIGCONT)
    finally:
        if not closed:
            session.close(cancel=True)
    assert instances_that(server, "cancelled by the client") == {f"orca_0_{i}" for i in range(INSTANCES)}
    assert wait_until(lambda: metric(server, "orca_kv_used_tokens", "orca") == 0, timeout_s=30)
    assert wait_until(lambda: metric(server, "orca_requests_finished_total", "orca", reason="cancelled")
                      == cancelled_before + count)  # fmt: skip


def test_unloading_leaves_no_process_and_a_reload_serves_again(server, reference):
    client = httpclient.InferenceServerClient(server.http_url)
    headers = {"admin-key": ADMIN_KEY}
    try:
        before = {p.pid: p.cmdline for p in process_tree(server.process.pid)}
        client.unload_model("orca", headers=headers)
        assert wait_until(lambda: not stubs_and_cores(server)[0] and not stubs_and_cores(server)[1], timeout_s=60)
        left = [before[p.pid] for p in process_tree(server.process.pid) if p.pid in before and p.pid != server.process.pid]
        assert not left, f"processes left after unloading: {left}"
        client.load_model("orca", headers=headers)
        assert wait_until(lambda: server.model_ready_status("orca") == 200, timeout_s=120)
    finally:
        client.close()
    stubs, cores = stubs_and_cores(server)
    assert len(stubs) == INSTANCES and len(cores) == 1
    with StreamSession(server.grpc_url) as session:
        results = [session.send("orca", f"again{i}", input_ids=[4, i + 1], max_tokens=5, sampling=GREEDY, stream=True)
                   for i in range(INSTANCES)]  # fmt: skip
        session.wait()
    for i, result in enumerate(results):
        assert result.ids == reference([4, i + 1], 5).output_ids


def test_the_cores_death_fails_every_instances_requests_and_unloads_the_model(server):
    (core,) = stubs_and_cores(server)[1]
    session = StreamSession(server.grpc_url)
    try:
        results = [session.send("orca", f"orphan{i}", input_ids=[3, i + 1], max_tokens=1000, sampling=GREEDY,
                                stream=True) for i in range(2 * INSTANCES)]  # fmt: skip
        assert wait_until(lambda: all(r.ids for r in results), timeout_s=120, interval_s=0.01)
        os.kill(core, signal.SIGKILL)
        # Triton's stream errors name no request: each of them ends with one.
        assert wait_until(lambda: len(session.stray_errors) == len(results), timeout_s=60), session.stray_errors
        assert all(re.search(r"unavailable: the engine core process \(pid \d+\) (is gone|was killed)", error)
                   for error in session.stray_errors), session.stray_errors
    finally:
        session.close()
    assert wait_until(lambda: server.model_ready_status("orca") != 200, timeout_s=60)
    assert wait_until(lambda: stubs_and_cores(server) == ([], []), timeout_s=60)
