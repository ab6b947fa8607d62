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

from serving_utils import (  # noqa: E402
    StreamSession,
    all_cancelled,
    finished_counts,
    log_size,
    metric,
    model_processes,
    model_statistics,
    ran_to_length,
    run_until_decoding,
    start_server,
    wait_until,
)

from orca_client.served_path import process_tree  # noqa: E402

pytestmark = pytest.mark.integration

INSTANCES = 3
# The requests a test holds running: long enough that none makes all its tokens before the last joins,
# however unevenly a loaded machine passes them on (this tiny model makes 1,000 tokens in well under a
# second). They are not streamed: a stream's thousands of responses would keep the instances, which
# pass the requests on, busy on a loaded machine.
LONG = 8000
SERVER_MODEL = GPT2Config(vocab_size=384, n_positions=LONG + 8, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
ADMIN_KEY = "instances-test"
ITERATION_LOG = "orca-iterations.jsonl"
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(SERVER_MODEL)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("instances")
    server = start_server(run_dir, checkpoint[0], models=("orca",), instances=INSTANCES, admin_key=ADMIN_KEY,
                          parameters={"kv_capacity_tokens": str(12 * LONG)},
                          model_parameters={"orca": {"iteration_log": str(run_dir / ITERATION_LOG)}})  # fmt: skip
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
    """Requests spread over every instance, cancelled while they run: each instance aborts its own.

    As in test_serving's cancel test: once Triton has handed every request to an instance, the engine
    runs in slices until an iteration decodes them all (run_until_decoding), and is held still until
    every instance has sent its aborts; a try in which one still ran to max_tokens first (it ends
    "length") is tried again."""
    (core,) = stubs_and_cores(server)[1]
    count = 3 * INSTANCES
    log = server.run_dir / ITERATION_LOG
    for attempt in range(3):
        finished_before = finished_counts(server)
        received, offset = model_statistics(server, "orca")[0], log_size(log)
        session = StreamSession(server.grpc_url)
        os.kill(core, signal.SIGSTOP)
        try:
            for i in range(count):
                session.send("orca", f"doomed{attempt}.{i}", input_ids=[9, 8, i + 1], max_tokens=LONG, sampling=GREEDY,
                             stream=False)
            assert wait_until(lambda: model_statistics(server, "orca")[0] >= received + count, timeout_s=60)  # noqa: B023
            all_run = run_until_decoding(core, log, offset, count,
                                         stop=lambda: ran_to_length(server, finished_before) > 0)  # noqa: B023
            # When one ran to max_tokens before the last reached the engine, the try ends below.
            held_kv = all_run and wait_until(lambda: metric(server, "orca_kv_used_tokens", "orca") > 0, timeout_s=10)
            session.close(cancel=True)
            pattern = rf"orca: doomed{attempt}\.\d+#\S+: cancelled by the client"
            wait_until(lambda: len(re.findall(pattern, server.log_tail(400_000)))  # noqa: B023
                       == count - ran_to_length(server, finished_before), timeout_s=30)  # noqa: B023
        finally:
            os.kill(core, signal.SIGCONT)
            session.close(cancel=True)
        if not all_cancelled(server, finished_before, count):
            continue  # some had made all their tokens before their cancel reached the engine
        assert held_kv
        break
    else:
        pytest.fail("in three tries some request always ran to max_tokens before its cancel reached the engine")
    cancelled_on = re.findall(rf"orca: doomed{attempt}\.\d+#(orca_\d+_\d+)/\d+: cancelled by the client",
                              server.log_tail(400_000))  # fmt: skip
    assert len(cancelled_on) == count and set(cancelled_on) == {f"orca_0_{i}" for i in range(INSTANCES)}
    assert wait_until(lambda: metric(server, "orca_kv_used_tokens", "orca") == 0, timeout_s=30)


def test_unloading_leaves_no_process_and_a_reload_serves_again(server, reference):
    client = httpclient.InferenceServerClient(server.http_url)
    headers = {"admin-key": ADMIN_KEY}
    try:
        before = {p.pid: p.cmdline for p in process_tree(server.process.pid)}
        client.unload_model("orca", headers=headers)
        # An exiting process is still in the tree a moment after its command line is gone.
        left = lambda: [before[p.pid] for p in process_tree(server.process.pid)  # noqa: E731
                        if p.pid in before and p.pid != server.process.pid]  # fmt: skip
        assert wait_until(lambda: not left(), timeout_s=60), f"processes left after unloading: {left()}"
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
    log = server.run_dir / ITERATION_LOG
    finished_before, offset = finished_counts(server), log_size(log)
    received = model_statistics(server, "orca")[0]
    session = StreamSession(server.grpc_url)
    try:
        # Run in slices until every request runs (as the cancel test); if a loaded machine passed one
        # on so late that another had made all its tokens, the ones still running are the orphans.
        os.kill(core, signal.SIGSTOP)
        results = [session.send("orca", f"orphan{i}", input_ids=[3, i + 1], max_tokens=LONG, sampling=GREEDY,
                                stream=False) for i in range(2 * INSTANCES)]  # fmt: skip
        assert wait_until(lambda: model_statistics(server, "orca")[0] >= received + len(results), timeout_s=60)
        run_until_decoding(core, log, offset, len(results), stop=lambda: ran_to_length(server, finished_before) > 0)
        orphans = len(results) - ran_to_length(server, finished_before)
        os.kill(core, signal.SIGKILL)
        # Triton's stream errors name no request: each of them ends with one.
        assert orphans > 0
        assert wait_until(lambda: len(session.stray_errors) == orphans, timeout_s=60), session.stray_errors
        # (A request an instance had not passed on yet finds the core gone as it sends, "is gone" with
        # no pid, or finds the death already reported, "the engine is not serving: <why>", or its
        # instance's loop already stopped by it, "the engine loop stopped (<why>)".)
        assert all(re.search(r"unavailable: (the engine is not serving: |the engine loop stopped \()?the engine core "
                             r"process (\(pid \d+\) )?(is gone|was killed)", error)
                   for error in session.stray_errors), session.stray_errors
    finally:
        session.close()
    assert wait_until(lambda: server.model_ready_status("orca") != 200, timeout_s=60)
    assert wait_until(lambda: stubs_and_cores(server) == ([], []), timeout_s=60)
