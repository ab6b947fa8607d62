"""Both models on a real tritonserver (started once for this module on free ports, always stopped).

The checkpoint is tiny (exact greedy tokens are sound there) but has a long context, so a long
request runs for a while: long enough to see short requests overtake it and to cancel it mid-way.
"""

from __future__ import annotations

import os
import random
import re
import signal

import numpy as np
import pytest

from orca_backend.config import ModelConfig
from orca_backend.llm import LLM
from orca_backend.sampling_params import SamplingParams
from orca_client.served_path import process_tree, stub_model

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")

from serving_utils import (  # noqa: E402 - after the skip above
    StreamSession,
    http_generate,
    metric,
    model_statistics,
    one_request,
    read_metrics,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.integration

SERVER_MODEL = ModelConfig(vocab_size=384, n_positions=1024, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
BASELINE_BATCH = 8
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(SERVER_MODEL)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    server = start_server(
        tmp_path_factory.mktemp("triton"), path,
        parameters={"kv_capacity_tokens": "32768"}, max_batch_size=BASELINE_BATCH,
        # A long queue delay makes the batcher's batches deterministic: a burst of
        # BASELINE_BATCH requests always forms one batch.
        max_queue_delay_us=500_000,
    )
    try:
        yield server
    finally:
        server.stop()
        # The log is the first thing to read when a test here fails.
        print("\n".join(line for line in server.log_tail(20000).splitlines() if not line.startswith(("|", "+"))))


@pytest.fixture(scope="module")
def reference(checkpoint):
    """Offline greedy outputs of the same checkpoint: the oracle for every served token."""
    path, _ = checkpoint
    llm = LLM(str(path))

    def generate(prompt, max_tokens: int, **params):
        params = SamplingParams(max_tokens=max_tokens, **{**GREEDY, **params})
        return llm.generate([prompt], params)[0]

    return generate


def engine_core_pid(server) -> int:
    """The orca stub's engine process (its one child that is not multiprocessing's resource tracker)."""
    tree = process_tree(server.process.pid)
    (stub,) = [p.pid for p in tree if stub_model(p.cmdline) == "orca"]
    (core,) = [p.pid for p in tree if p.ppid == stub and "resource_tracker" not in " ".join(p.cmdline)]
    return core


def kv_used(server, model: str) -> float:
    return metric(server, "orca_kv_used_tokens", model)


def assert_healthy(server) -> None:
    assert server.is_live() and server.is_ready()
    for model in server.options.models:
        assert wait_until(lambda m=model: kv_used(server, m) == 0, timeout_s=30), f"{model} K/V not freed"


# ---- exactness ----------------------------------------------------------------------------------
@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_greedy_grpc_stream_matches_offline_generate(server, reference, model):
    prompts = [[5, 17, 99, 3], "the cat sat on the mat", [200] * 30]
    with StreamSession(server.grpc_url) as session:
        for i, prompt in enumerate(prompts):
            key = "text" if isinstance(prompt, str) else "input_ids"
            session.send(model, f"p{i}", max_tokens=24, sampling=GREEDY, stream=True, **{key: prompt})
        results = session.wait()
    for prompt, result in zip(prompts, results, strict=True):
        expected = reference(prompt, 24)
        assert result.error is None
        assert result.ids == expected.output_ids
        assert result.text == expected.text
        assert result.finish_reason == expected.finish_reason
        assert result.deltas[-1].num_output_tokens == len(expected.output_ids)
        assert result.deltas[-1].num_input_tokens == expected.num_input_tokens
        if model == "baseline":
            assert len(result.deltas) == 1  # one answer per request, whatever `stream` says


def test_exclude_input_in_output_false_prepends_the_prompt(server, reference):
    expected = reference("the cat", 6)
    for model in ("orca", "baseline"):
        for stream in (True, False):
            result = one_request(server.grpc_url, model, text="the cat", max_tokens=6, sampling=GREEDY,
                                 stream=stream, exclude_input_in_output=False)
            assert result.text == "the cat" + expected.text
            assert result.ids[-len(expected.output_ids):] == expected.output_ids


# ---- scheduling: iteration-level vs request-level -------------------------------------------
def test_orca_short_requests_overtake_a_long_one_token_by_token(server, reference):
    long_tokens, short_tokens = 600, 8
    with StreamSession(server.grpc_url) as session:
        long = session.send("orca", "long", input_ids=[1, 2, 3], max_tokens=long_tokens, sampling=GREEDY,
                            stream=True, exclude_input_in_output=True)
        assert wait_until(lambda: len(long.ids) >= 5, timeout_s=60, interval_s=0.005)
        short_prompts = [[7 + i, 8] for i in range(4)]
        shorts = [session.send("orca", f"short{i}", input_ids=prompt, max_tokens=short_tokens, sampling=GREEDY,
                               stream=True) for i, prompt in enumerate(short_prompts)]
        session.wait()
    assert len(long.ids) == long_tokens, long.error
    timeline = [(r.request_id, round(r.first_at - long.sent_at, 3), round(r.finished_at - long.sent_at, 3))
                for r in (long, *shorts)]
    assert all(s.finished_at < long.finished_at for s in shorts), timeline
    for short, prompt in zip(shorts, short_prompts, strict=True):
        assert short.ids == reference(prompt, short_tokens).output_ids
    # Streaming really streams: the long request's first tokens reached the client (the wait above)
    # before the shorts were sent, and the shorts finished before it did, so its tokens came in
    # several responses while it ran. (How many tokens each response holds depends on how far
    # sending falls behind the engine on a busy machine, so only that there are several is asserted.)
    assert len(long.deltas) > 1 and len(long.deltas[0].ids) < long_tokens, [len(d.ids) for d in long.deltas]


def test_baseline_answers_a_batch_together_and_triton_batched_it(server, reference):
    inferences_before, executions_before = model_statistics(server, "baseline")
    lengths = [4, 8, 16, 32, 64, 128, 200, 300]
    prompts = [[11 + i, 4, 9][: 1 + i % 3] for i in range(len(lengths))]  # ragged: 1 to 3 tokens
    assert len(lengths) == BASELINE_BATCH
    with StreamSession(server.grpc_url) as session:
        results = [session.send("baseline", f"b{i}", input_ids=prompt, max_tokens=n, sampling=GREEDY, stream=True)
                   for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True))]
        session.wait()
    inferences, executions = model_statistics(server, "baseline")
    assert inferences - inferences_before == len(lengths)
    assert executions - executions_before < len(lengths)  # the dynamic batcher really batched
    for result, prompt, n in zip(results, prompts, lengths, strict=True):
        assert result.error is None and len(result.deltas) == 1
        assert result.ids == reference(prompt, n).output_ids
    # Request-level: the 4-token request is answered only when the 300-token one is done.
    first, last = min(r.finished_at for r in results), max(r.finished_at for r in results)
    run_time = last - min(r.sent_at for r in results)
    assert last - first < 0.25 * run_time


# ---- HTTP -------------------------------------------------------------------------------------
def test_http_generate_stream_sse_on_orca(server, reference):
    expected = reference("the cat", 12)
    status, events = http_generate(server, "orca", {"text_input": "the cat", "max_tokens": 12, "stream": True,
                                                    "sampling_parameters": '{"temperature": "0"}'}, stream=True)
    assert status == 200 and len(events) > 1
    ids = [t for e in events for t in (e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]])]
    assert ids == expected.output_ids
    assert "".join(e["text_output"] for e in events) == expected.text
    assert events[-1]["finish_reason"] == expected.finish_reason
    assert events[-1]["num_output_tokens"] == len(expected.output_ids)


def test_http_generate_on_both_models_with_top_level_parameters(server, reference):
    expected = reference([4, 5, 6], 5)
    for model in ("orca", "baseline"):
        # `temperature` is no input: HTTP generate hands it over as a request parameter.
        status, (body,) = http_generate(server, model, {"input_ids": [4, 5, 6], "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        assert body["output_ids"] == expected.output_ids and body["text_output"] == expected.text
    status, (body,) = http_generate(server, "orca", {"text_input": "", "max_tokens": 5})
    assert status == 400 and "text_input is empty" in body["error"]


# ---- cancellation -----------------------------------------------------------------------------
def test_cancelling_a_stream_frees_its_kv_and_the_server_keeps_serving(server, reference):
    generated_before = metric(server, "orca_generated_tokens_total", "orca")
    cancelled_before = metric(server, "orca_requests_finished_total", "orca", reason="cancelled")
    max_tokens = 1000
    core = engine_core_pid(server)
    session = StreamSession(server.grpc_url)
    closed = False
    try:
        result = session.send("orca", "doomed", input_ids=[9, 8, 7], max_tokens=max_tokens, sampling=GREEDY,
                              stream=True)
        assert wait_until(lambda: len(result.ids) >= 10, timeout_s=60, interval_s=0.005)
        # The engine is held still until the frontend has seen the cancel and sent the abort, so the
        # request cannot run to max_tokens first however slowly the machine passes the cancel along.
        os.kill(core, signal.SIGSTOP)
        try:
            # Its K/V is visible while it runs: the gauges (exported every 50 ms) keep the last
            # iteration's figures while the engine is stopped.
            assert wait_until(lambda: kv_used(server, "orca") > 0, timeout_s=10, interval_s=0.01)
            session.close(cancel=True)
            closed = True
            assert wait_until(lambda: re.search(r"orca: doomed#\d+: cancelled by the client", server.log_tail(20000)),
                              timeout_s=60)
        finally:
            os.kill(core, signal.SIGCONT)
    finally:
        if not closed:
            session.close(cancel=True)
    assert wait_until(lambda: kv_used(server, "orca") == 0, timeout_s=30)
    assert wait_until(lambda: metric(server, "orca_requests_finished_total", "orca", reason="cancelled")
                      == cancelled_before + 1, timeout_s=10)
    assert metric(server, "orca_generated_tokens_total", "orca") - generated_before < max_tokens
    after = one_request(server.grpc_url, "orca", input_ids=[1, 2], max_tokens=6, sampling=GREEDY, stream=True)
    assert after.ids == reference([1, 2], 6).output_ids
    assert_healthy(server)


# ---- bad input ----------------------------------------------------------------------------------
BAD_REQUESTS = [
    ({"max_tokens": 4}, "no prompt"),
    ({"text": "a", "input_ids": [1]}, "not both"),
    ({"text": ""}, "text_input is empty"),
    ({"input_ids": []}, "input_ids is empty"),
    ({"input_ids": [1] * 100, "max_tokens": 1000}, "context length of 1024"),
    ({"input_ids": [1], "sampling": '{"temperature": 0,'}, "not valid JSON"),
    ({"input_ids": [1], "sampling": {"temperature": -1}}, "temperature must be a finite number >= 0"),
    ({"input_ids": [1], "sampling": {"top_p": 2}}, "top_p must be in"),
    ({"input_ids": [1], "sampling": {"temprature": 0}}, "unknown sampling parameter"),
    ({"input_ids": [1], "max_tokens": 0}, "max_tokens must be a positive integer"),
    ({"input_ids": [100000]}, "outside the model's vocabulary"),
    ({"input_ids_dtype": "FP32"}, "input_ids"),  # wrong dtype: Triton itself refuses it
]


def _send_bad(session: StreamSession, model: str, request: dict) -> None:
    if "input_ids_dtype" not in request:
        session.send(model, "bad", stream=True, **request)
        return
    shape = [1, 2] if session.is_batched(model) else [2]
    tensor = grpcclient.InferInput("input_ids", shape, request["input_ids_dtype"])
    tensor.set_data_from_numpy(np.array([1.0, 2.0], dtype=np.float32).reshape(shape))
    session.send_inputs(model, [tensor], "bad")


@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_every_bad_input_fails_alone_while_a_good_stream_completes(server, reference, model):
    good_tokens = 150 if model == "orca" else 40
    expected = reference([3, 1, 4, 1, 5], good_tokens)
    with StreamSession(server.grpc_url) as good_session:
        good = good_session.send(model, "good", input_ids=[3, 1, 4, 1, 5], max_tokens=good_tokens,
                                 sampling=GREEDY, stream=True)
        sessions = []
        for request, _ in BAD_REQUESTS:
            session = StreamSession(server.grpc_url)
            sessions.append(session)
            _send_bad(session, model, request)
        try:
            for session, (request, message) in zip(sessions, BAD_REQUESTS, strict=True):
                (result,) = session.wait(timeout_s=60)
                assert result.error is not None, f"{request} was accepted"
                assert message in result.error, f"{request}: {result.error}"
        finally:
            for session in sessions:
                session.close()
        good_session.wait()
    assert good.error is None and good.ids == expected.output_ids
    assert_healthy(server)


# ---- load ---------------------------------------------------------------------------------------
def test_200_concurrent_streams_complete_with_exact_token_counts(server):
    rng = random.Random(0)
    specs = [(f"c{i}", [rng.randrange(1, 300) for _ in range(rng.randint(1, 40))], rng.randint(1, 48))
             for i in range(200)]
    finished_before = metric(server, "orca_requests_finished_total", "orca", reason="length")
    with StreamSession(server.grpc_url) as session:
        for request_id, prompt, n in specs:
            session.send("orca", request_id, input_ids=prompt, max_tokens=n,
                         sampling={"temperature": 0.8, "seed": 1, "ignore_eos": True}, stream=True)
        results = session.wait(timeout_s=300)
    assert not session.stray_errors
    for (request_id, prompt, n), result in zip(specs, results, strict=True):
        assert result.request_id == request_id and result.error is None
        assert len(result.ids) == n and result.finish_reason == "length"
        assert result.deltas[-1].num_output_tokens == n and result.deltas[-1].num_input_tokens == len(prompt)
    assert wait_until(lambda: metric(server, "orca_requests_finished_total", "orca", reason="length")
                      == finished_before + len(specs), timeout_s=10)
    assert wait_until(lambda: metric(server, "orca_requests_running", "orca") == 0, timeout_s=10)
    assert_healthy(server)


def test_metrics_are_exported(server):
    samples = read_metrics(server)
    for name in ("orca_requests_waiting", "orca_requests_running", "orca_kv_used_tokens", "orca_kv_capacity_tokens",
                 "orca_iterations_total", "orca_generated_tokens_total", "orca_iteration_seconds"):
        for model in ("orca", "baseline"):
            assert any(n == name and ("model", model) in labels for (n, labels) in samples), f"{name} missing: {model}"
    assert metric(server, "orca_kv_capacity_tokens", "orca") == 32768
    assert metric(server, "orca_iterations_total", "orca") > 0
