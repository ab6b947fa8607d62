"""Both models on a real tritonserver (started once for this module on free ports, always stopped).

The checkpoint is tiny (exact greedy tokens are sound there) but has a long context, so a long
request runs for a while: long enough to see short requests overtake it and to cancel it mid-way.
"""

from __future__ import annotations

import functools
import itertools
import json
import os
import random
import re
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from orca_backend.entrypoints.llm import LLM
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.sampling_params import SamplingParams
from orca_client.protocol import PERF_METRICS, PERF_OUTPUTS, STATUS_OUTPUTS

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")

from serving_utils import (  # noqa: E402 - after the skip above
    StreamSession,
    all_cancelled,
    dashboard_series,
    engine_processes,
    finished_counts,
    http_generate,
    iteration_lines,
    log_size,
    metric,
    model_statistics,
    one_request,
    ran_to_length,
    read_metrics,
    run_in_slices,
    start_server,
    wait_until,
)

pytestmark = pytest.mark.integration

SERVER_MODEL = GPT2Config(vocab_size=384, n_positions=1024, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
BASELINE_BATCH = 8
GREEDY = {"temperature": 0}
ROOT = Path(__file__).resolve().parents[2]
ORCA_ITERATION_LOG = "orca-iterations.jsonl"


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(SERVER_MODEL)


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    path, _ = checkpoint
    run_dir = tmp_path_factory.mktemp("triton")
    server = start_server(
        run_dir, path,
        parameters={"kv_capacity_tokens": "32768"}, max_batch_size=BASELINE_BATCH,
        # What each of orca's iterations ran: the overtaking test reads it to know the engine's side.
        model_parameters={"orca": {"iteration_log": str(run_dir / ORCA_ITERATION_LOG)}},
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
        assert result.num_output_tokens == len(expected.output_ids)  # the responses' counts summed
        assert all(d.num_input_tokens == expected.num_input_tokens for d in result.deltas)
        if model == "baseline":
            assert len(result.deltas) == 1  # one answer per request, whatever `stream` says


@pytest.mark.parametrize(("model", "stream", "exclude", "echoed"), [
    ("orca", False, None, True), ("orca", False, False, True), ("orca", False, True, False),
    ("orca", True, None, False), ("orca", True, True, False),
    # The baseline answers once whatever `stream` says; the default echo follows the client's flag on
    # both models (an A/B client gets the same text from each), an explicit false is honoured.
    ("baseline", True, None, False), ("baseline", False, None, True), ("baseline", True, False, True),
    ("baseline", False, True, False),
])  # fmt: skip
def test_prompt_echo_follows_the_vllm_backend(server, reference, model, stream, exclude, echoed):
    expected = reference("the cat", 6)
    result = one_request(server.grpc_url, model, text="the cat", max_tokens=6, sampling=GREEDY, stream=stream,
                         exclude_input_in_output=exclude)  # fmt: skip
    assert result.error is None
    assert result.text == ("the cat" if echoed else "") + expected.text
    assert result.ids[-len(expected.output_ids):] == expected.output_ids
    assert len(result.ids) > len(expected.output_ids) if echoed else len(result.ids) == len(expected.output_ids)
    assert result.num_output_tokens == len(expected.output_ids)  # the echo is not output


def test_a_stream_asking_for_the_prompt_echo_is_refused_with_the_vllm_message(server):
    result = one_request(server.grpc_url, "orca", text="the cat", max_tokens=6, stream=True,
                         exclude_input_in_output=False)
    assert result.error is not None and "When streaming, `exclude_input_in_output` = False is not allowed." \
        in result.error, result.error


def raw_responses(server, model: str, inputs: list, timeout_s: float = 60.0) -> list:
    """Every InferResult of one request, as tritonclient hands them over (outputs not decoded)."""
    import queue

    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id="raw", enable_empty_final_response=True)
        responses = []
        while True:
            result, error = results.get(timeout=timeout_s)
            assert error is None, error
            if result.get_response().parameters["triton_final_response"].bool_param:
                if result.get_response().outputs:
                    responses.append(result)
                return responses
            responses.append(result)
    finally:
        client.stop_stream()
        client.close()


@pytest.mark.parametrize("model", ["orca", "baseline"])
@pytest.mark.parametrize("returns", [(), ("finish_reason", "num_input_tokens", "num_output_tokens"),
                                     ("finish_reason", "cumulative_logprob", "logprobs", "num_input_tokens",
                                      "num_output_tokens")])  # fmt: skip
def test_optional_outputs_only_when_asked_with_the_vllm_backends_types(server, reference, model, returns):
    from orca_client.protocol import build_inputs

    expected = reference([3, 4, 5], 7)
    inputs = build_inputs(input_ids=[3, 4, 5], max_tokens=7, sampling=GREEDY, stream=True, return_outputs=returns,
                          batched=model == "baseline")  # fmt: skip
    responses = raw_responses(server, model, inputs)
    # orca streams (responses merge tokens when sending falls behind); the baseline answers once.
    assert 1 <= len(responses) <= 7 if model == "orca" else len(responses) == 1
    dtypes = {"finish_reason": np.object_, "cumulative_logprob": np.float32, "logprobs": np.object_,
              "num_input_tokens": np.uint32, "num_output_tokens": np.uint32}  # fmt: skip
    for response in responses:
        names = {o.name for o in response.get_response().outputs}
        assert names == {"text_output", "output_ids", *returns}
        for name in returns:
            assert response.as_numpy(name).dtype == dtypes[name], name
    if "finish_reason" in returns:
        reasons = [r.as_numpy("finish_reason").reshape(-1)[0].decode() for r in responses]
        assert reasons == ["None"] * (len(responses) - 1) + [expected.finish_reason]
        counts = [int(r.as_numpy("num_output_tokens").reshape(-1)[0]) for r in responses]
        assert sum(counts) == len(expected.output_ids)
        assert {int(r.as_numpy("num_input_tokens").reshape(-1)[0]) for r in responses} == {3}
    if "logprobs" in returns:  # the `logprobs` sampling parameter was not set
        assert {r.as_numpy("logprobs").reshape(-1)[0] for r in responses} == {b"null"}


@pytest.mark.parametrize("stream", [True, False])
def test_logprobs_and_cumulative_logprob_as_the_vllm_backend_sends_them(server, reference, stream):
    """The checks of the vLLM backend's own additional-outputs test, plus equality with the engine."""
    from orca_client.protocol import build_inputs

    sampling = {**GREEDY, "logprobs": 2}
    expected = reference([3, 4, 5], 9, logprobs=2)
    inputs = build_inputs(input_ids=[3, 4, 5], max_tokens=9, sampling=sampling, stream=stream,
                          return_outputs=("logprobs", "cumulative_logprob", "num_output_tokens"))  # fmt: skip
    responses = raw_responses(server, "orca", inputs)
    per_token, texts, totals = [], [], []
    for response in responses:
        logprobs = json.loads(response.as_numpy("logprobs")[0])
        assert len(logprobs) == int(response.as_numpy("num_output_tokens")[0])  # one dict per new token
        per_token += logprobs
        texts.append(response.as_numpy("text_output")[0].decode())
        totals.append(float(response.as_numpy("cumulative_logprob")[0]))
    assert len(per_token) == len(expected.output_ids)
    decoded = ""
    for entry, token, want in zip(per_token, expected.output_ids, expected.logprobs, strict=True):
        assert 1 <= len(entry) <= 3 and all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        (best,) = [v for v in entry.values() if v["rank"] == 1]  # greedy: the sampled token is the most likely
        assert entry[str(token)] is best
        decoded += best["decoded_token"]
        assert {int(k): v["rank"] for k, v in entry.items()} == {k: v.rank for k, v in want.items()}
        assert {int(k): v["logprob"] for k, v in entry.items()} == pytest.approx({k: v.logprob for k, v in want.items()})
    prompt_text = "" if stream else texts[0][: len(texts[0]) - len(expected.text)]  # not streamed: echoed
    assert prompt_text + decoded == "".join(texts)
    assert totals[-1] == pytest.approx(expected.cumulative_logprob, abs=1e-4)
    assert all(b < a for a, b in zip(totals, totals[1:], strict=False))  # a running total of negative logprobs


@pytest.mark.parametrize(("model", "stream"), [("orca", True), ("orca", False), ("baseline", False)])
def test_prompt_logprobs_come_with_the_first_token_on_both_models(server, reference, model, stream):
    """`return_prompt_logprobs` with the `prompt_logprobs` sampling parameter: the first response holds
    one entry per prompt token (null for the first), equal to the engine's offline; later ones null."""
    from orca_client.protocol import build_inputs

    prompt = [3, 4, 5, 90, 17]
    expected = reference(prompt, 4, prompt_logprobs=1)
    inputs = build_inputs(input_ids=prompt, max_tokens=4, sampling={**GREEDY, "prompt_logprobs": 1}, stream=stream,
                          return_outputs=("prompt_logprobs",), batched=model == "baseline")  # fmt: skip
    responses = raw_responses(server, model, inputs)
    sent = [json.loads(r.as_numpy("prompt_logprobs").reshape(-1)[0]) for r in responses]
    assert all(later is None for later in sent[1:])
    assert len(sent[0]) == len(prompt) and sent[0][0] is None
    for entry, want, token in zip(sent[0][1:], expected.prompt_logprobs[1:], prompt[1:], strict=True):
        assert str(token) in entry and {int(k): v["rank"] for k, v in entry.items()} == {k: v.rank for k, v in want.items()}
        assert {int(k): v["logprob"] for k, v in entry.items()} == pytest.approx({k: v.logprob for k, v in want.items()})


@pytest.mark.parametrize(("model", "stream"), [("orca", True), ("orca", False), ("baseline", False)])
def test_n_samples_come_as_one_element_each_on_both_models(server, reference, model, stream):
    """n = 3: every response holds one element per sample in each output (the vLLM backend's shape),
    `output_ids` the samples' ids one after the other, split by `num_output_tokens`; sample i equals
    the engine's offline request seeded seed + i."""
    from orca_client.protocol import build_inputs

    prompt, n = [3, 4, 5, 90, 17, 8], 3
    expected = [reference(prompt, 6, temperature=0.9, seed=11 + i, ignore_eos=True).output_ids for i in range(n)]
    sampling = {"temperature": 0.9, "seed": 11, "n": n, "ignore_eos": True}
    inputs = build_inputs(input_ids=prompt, max_tokens=6, sampling=sampling, stream=stream, exclude_input_in_output=True,
                          return_outputs=("finish_reason", "num_output_tokens", "num_input_tokens"),
                          batched=model == "baseline")  # fmt: skip
    responses = raw_responses(server, model, inputs)
    samples: list[list[int]] = [[] for _ in range(n)]
    for response in responses:
        counts = response.as_numpy("num_output_tokens").reshape(-1).tolist()
        ids = response.as_numpy("output_ids").reshape(-1).tolist()
        assert len(counts) == n and len(response.as_numpy("text_output").reshape(-1)) == n and sum(counts) == len(ids)
        for i, start in enumerate(itertools.accumulate(counts[:-1], initial=0)):
            samples[i] += ids[start : start + counts[i]]
        assert response.as_numpy("num_input_tokens").reshape(-1).tolist() == [len(prompt)]
    assert samples == expected and len({tuple(s) for s in samples}) == n
    assert [r.decode() for r in responses[-1].as_numpy("finish_reason").reshape(-1)] == ["length"] * n


@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_embeddings_as_the_openai_frontend_sends_them(server, checkpoint, model):
    """/v1/embeddings through `--backend vllm`, replayed: the vector (text_output, JSON) equals
    LLM.embed's, usage counts the prompt and no output token; a `dimensions` the model was not
    trained for fails that request alone with INVALID_ARG."""
    from serving_utils import frontend_embedding_inputs

    with LLM(str(checkpoint[0])) as llm:
        expected = llm.embed(["the kalo mine", [5, 6, 7, 8]])
    for prompt, want in zip(["the kalo mine", [5, 6, 7, 8]], expected, strict=True):
        (response,) = raw_responses(server, model, frontend_embedding_inputs(prompt, batched=model == "baseline"))
        vector = json.loads(response.as_numpy("text_output").reshape(-1)[0])
        assert max(abs(a - b) for a, b in zip(vector, want.embedding, strict=True)) < 1e-5
        assert response.as_numpy("num_input_tokens").reshape(-1).tolist() == [want.num_input_tokens]
        assert response.as_numpy("num_output_tokens").reshape(-1).tolist() == [0]
    refused = raw_error(server, model, frontend_embedding_inputs("the kalo mine", dimensions=8,
                                                                 batched=model == "baseline"))  # fmt: skip
    assert "does not support Matryoshka" in refused


def raw_error(server, model: str, inputs: list, timeout_s: float = 60.0) -> str:
    """The error message a request is answered with (it must be answered with one)."""
    import queue

    results: queue.SimpleQueue = queue.SimpleQueue()
    client = grpcclient.InferenceServerClient(server.grpc_url)
    client.start_stream(callback=lambda result, error: results.put((result, error)))
    try:
        client.async_stream_infer(model, inputs, request_id="raw-error")
        _, error = results.get(timeout=timeout_s)
        assert error is not None, "the request was answered without an error"
        return str(error)
    finally:
        client.stop_stream()
        client.close()


# ---- scheduling: iteration-level vs request-level -------------------------------------------
def test_orca_short_requests_overtake_a_long_one_token_by_token(server, reference):
    """Four short requests sent while a long one runs join it at the next iterations and finish
    first, streaming token by token.

    The engine runs the long request in slices (SIGCONT, SIGSTOP, see run_in_slices) for a few
    iterations, is held still until Triton has handed the shorts to the frontend, and runs in slices
    again until they run: so the shorts join while the long one runs however fast this CPU generates
    (all 1000 tokens in under a second) and however late a loaded machine passes things along. The
    iteration log (the engine's own account) then says whether the shorts joined after the long
    one's prefill with more than their own length of it to go: only such a try is judged, up to
    three tries, and a scheduler that never lets them join fails all three."""
    long_prompt, long_tokens, short_tokens = [1, 2, 3, 4, 5], 1000, 8
    short_prompts = [[7 + i, 8] for i in range(4)]
    _, core, _ = engine_processes(server.process.pid)
    log = server.run_dir / ORCA_ITERATION_LOG
    iterations = functools.partial(metric, server, "orca_iterations_total", "orca")
    running = functools.partial(metric, server, "orca_requests_running", "orca")
    tries: list[dict] = []
    for attempt in range(3):
        started = _settled(iterations)  # what earlier tests left has ended, and the export caught up
        log_offset = log_size(log)
        received, _ = model_statistics(server, "orca")
        with StreamSession(server.grpc_url) as session:
            os.kill(core, signal.SIGSTOP)
            try:
                long = session.send("orca", f"long{attempt}", input_ids=long_prompt, max_tokens=long_tokens,
                                    sampling=GREEDY, stream=True, exclude_input_in_output=True)
                assert run_in_slices(core, progress=iterations, until=lambda: iterations() >= started + 5)  # noqa: B023
                shorts = [session.send("orca", f"short{attempt}.{i}", input_ids=prompt, max_tokens=short_tokens,
                                       sampling=GREEDY, stream=True) for i, prompt in enumerate(short_prompts)]
                assert wait_until(lambda: model_statistics(server, "orca")[0] >= received + 5, timeout_s=60)  # noqa: B023
                # Handed over is not yet read: the engine's inbox reader needs the CPU too, which a
                # loaded machine gives it late. In slices until the five run (or the long one is done).
                assert run_in_slices(core, progress=iterations,  # noqa: B023
                                     until=lambda: running() >= 5 or iterations() >= started + long_tokens)  # noqa: B023
            finally:
                os.kill(core, signal.SIGCONT)
            session.wait()
        assert len(long.ids) == long_tokens, long.error
        for short, prompt in zip(shorts, short_prompts, strict=True):
            assert short.ids == reference(prompt, short_tokens).output_ids
        # The long request's prefill is the first iteration of this try that ran prompt tokens; it
        # then makes one token an iteration, so it ends long_tokens - 1 iterations later.
        lines: list[dict] = []
        ended = wait_until(lambda: _long_has_ended(lines, log, log_offset, long_tokens), timeout_s=30)  # noqa: B023
        assert ended, iteration_lines(log, log_offset)[:3]
        first, *later = lines
        long_ends = first["iteration"] + long_tokens - 1
        joins = [line["iteration"] for line in later if line["prompt_tokens"] > 0]
        joined_tokens = sum(line["prompt_tokens"] for line in later)
        tries.append({"long_prefill_tokens": first["prompt_tokens"], "long_ends": long_ends, "shorts_joined": joins,
                      "prompt_tokens_joined": joined_tokens})  # fmt: skip
        if (first["prompt_tokens"] != len(long_prompt) or joined_tokens < sum(map(len, short_prompts))
                or joins[-1] + short_tokens - 1 >= long_ends):  # fmt: skip
            continue  # the shorts came with the long request's prefill, or when it was (nearly) done
        timeline = [(r.request_id, round(r.first_at - long.sent_at, 3), round(r.finished_at - long.sent_at, 3))
                    for r in (long, *shorts)]
        assert all(s.finished_at < long.finished_at for s in shorts), timeline
        # Streaming really streams: the shorts finished before the long request did, so its tokens
        # came in several responses while it ran. (How many tokens each response holds depends on
        # how far sending falls behind the engine, so only that there are several is asserted.)
        assert len(long.deltas) > 1 and len(long.deltas[0].ids) < long_tokens, [len(d.ids) for d in long.deltas]
        return
    pytest.fail(f"in three tries the short requests never joined the long one while it had tokens to go: {tries}")


def _long_has_ended(lines: list[dict], log: Path, offset: int, long_tokens: int) -> bool:
    """Fills `lines` with the iteration log's lines from the long request's prefill (the first to run
    prompt tokens after `offset`) to its last iteration; False until the log holds them all."""
    read = iteration_lines(log, offset)
    start = next((i for i, line in enumerate(read) if line["prompt_tokens"] > 0), None)
    if start is None:
        return False
    last = read[start]["iteration"] + long_tokens - 1
    lines[:] = [line for line in read[start:] if line["iteration"] <= last]
    return lines[-1]["iteration"] == last


def _settled(read: Callable[[], float], timeout_s: float = 60.0) -> float:
    """`read()` once two reads 0.5 s apart (more than the metrics' export period) agree."""
    deadline, last = time.monotonic() + timeout_s, read()
    while time.monotonic() < deadline:
        time.sleep(0.5)
        last, previous = read(), last
        if last == previous:
            return last
    raise AssertionError(f"still changing after {timeout_s} s: {last}")


def test_baseline_answers_a_batch_together_and_triton_batched_it(server, reference):
    inferences_before, executions_before = model_statistics(server, "baseline")
    lengths = [4, 8, 16, 32, 64, 128, 200, 300]
    prompts = [[11 + i, 4, 9][: 1 + i % 3] for i in range(len(lengths))]  # ragged: 1 to 3 tokens
    assert len(lengths) == BASELINE_BATCH
    with StreamSession(server.grpc_url) as session:
        results = [session.send("baseline", f"b{i}", input_ids=prompt, max_tokens=n, sampling=GREEDY, stream=True,
                                return_outputs=(*STATUS_OUTPUTS, PERF_METRICS))
                   for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True))]  # fmt: skip
        session.wait()
    # Triton counts a request once the model releases it, which may come after the client has its last
    # response: wait for the count rather than read it once.
    assert wait_until(lambda: model_statistics(server, "baseline")[0] - inferences_before >= len(lengths), timeout_s=60)
    inferences, executions = model_statistics(server, "baseline")
    assert inferences - inferences_before == len(lengths)
    assert executions - executions_before < len(lengths)  # the dynamic batcher really batched
    for result, prompt, n in zip(results, prompts, lengths, strict=True):
        assert result.error is None and len(result.deltas) == 1
        assert result.ids == reference(prompt, n).output_ids
    # Request-level: the 4-token request is answered only when the 300-token one is done. Causally,
    # not by durations: every answer reached the client after the batch's last token was computed
    # (the server's times and the client's are the host's one monotonic clock).
    batch_end_ns = max(r.deltas[-1].perf["last_token_time_ns"] for r in results)
    assert all(r.finished_at * 1e9 >= batch_end_ns for r in results), [r.finished_at * 1e9 - batch_end_ns for r in results]


# ---- HTTP -------------------------------------------------------------------------------------
def test_http_generate_stream_sse_on_orca(server, reference):
    expected = reference("the cat", 12)
    status, events = http_generate(server, "orca", {"text_input": "the cat", "max_tokens": 12, "stream": True,
                                                    "sampling_parameters": '{"temperature": "0"}',
                                                    "return_finish_reason": True, "return_num_output_tokens": True},
                                   stream=True)  # fmt: skip
    # How many events carry the 12 tokens depends on how far the sender falls behind the engine (a
    # fast CPU folds them into one), so what is asserted is what any split keeps: every event a
    # delta of at least one token, their concatenation the exact ids and text, the finish reason
    # on the last event only, the per-event counts summing to 12.
    assert status == 200 and events
    deltas = [e["output_ids"] if isinstance(e["output_ids"], list) else [e["output_ids"]] for e in events]
    assert all(deltas) and [t for d in deltas for t in d] == expected.output_ids
    assert "".join(e["text_output"] for e in events) == expected.text
    assert [e["finish_reason"] for e in events] == ["None"] * (len(events) - 1) + [expected.finish_reason]
    assert [e["num_output_tokens"] for e in events] == [len(d) for d in deltas]


def test_http_generate_on_both_models_with_top_level_parameters(server, reference):
    expected = reference([4, 5, 6], 5)
    for model in ("orca", "baseline"):
        # `temperature` is no input: HTTP generate hands it over as a request parameter.
        status, (body,) = http_generate(server, model, {"input_ids": [4, 5, 6], "max_tokens": 5, "temperature": 0})
        assert status == 200, body
        # Not streamed and exclude_input_in_output not sent: the prompt is echoed, as vLLM's backend does.
        assert body["output_ids"] == [4, 5, 6] + expected.output_ids and body["text_output"].endswith(expected.text)
        assert set(body) >= {"text_output", "output_ids"} and "finish_reason" not in body
    status, (body,) = http_generate(server, "orca", {"text_input": "", "max_tokens": 5})
    assert status == 400 and "text_input is empty" in body["error"]


def test_the_model_repository_api_refuses_a_caller_without_the_admin_key(server):
    """orca-serve's default: Triton's load/unload API (a load may carry model code) is closed."""
    for path in ("/v2/repository/index", "/v2/repository/models/orca/unload"):
        request = urllib.request.Request(f"http://{server.http_url}{path}", data=b"{}", method="POST")
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=30)
        assert refused.value.code == 403
    assert server.is_ready()


# ---- latency histograms with vLLM's names ---------------------------------------------------------
HISTOGRAMS = ("vllm:time_to_first_token_seconds", "vllm:e2e_request_latency_seconds", "vllm:request_queue_time_seconds",
              "vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:time_per_output_token_seconds")


@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_latency_histograms_count_and_sum_what_was_served(server, reference, model):
    """Triton's vLLM backend's histograms and counters, exported by both models: token histograms and
    counters exactly, latency counts exactly and sums within what the client measured around them;
    a request that timed out counts under its finish reason."""

    def snapshot() -> dict[str, float]:
        values = {f"{name}_{part}": metric(server, f"{name}_{part}", model) for name in HISTOGRAMS
                  for part in ("count", "sum")}  # fmt: skip
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            values[name] = metric(server, name, model)
        for reason in ("length", "timeout"):
            values[reason] = metric(server, "vllm:request_success_total", model, finished_reason=reason)
        return values

    before = snapshot()
    prompts, lengths = [[3, 4, 5], [6, 7], [8, 9, 10, 11]], [5, 9, 3]
    with StreamSession(server.grpc_url) as session:
        results = [session.send(model, f"h{i}", input_ids=p, max_tokens=n, sampling=GREEDY, stream=True)
                   for i, (p, n) in enumerate(zip(prompts, lengths, strict=True))]  # fmt: skip
        session.wait()
    with StreamSession(server.grpc_url) as session:  # one that times out: counted, under its reason
        session.client.async_stream_infer = functools.partial(session.client.async_stream_infer,
                                                              parameters={"timeout_s": 0.001})  # fmt: skip
        late = session.send(model, "late", input_ids=[5, 6], max_tokens=400, sampling=GREEDY, stream=True)
        session.wait()
        late_e2e = time.perf_counter() - late.sent_at  # its error carries no time of its own
    assert late.error is not None and "timed out" in late.error
    late_tokens = int(re.search(r"\((\d+) tokens generated\)", late.error).group(1))  # none reach the client
    for result, prompt, n in zip(results, prompts, lengths, strict=True):
        assert result.error is None and result.ids == reference(prompt, n).output_ids
    # Exported before each final response (vLLM's order): read at once, nothing is missing.
    delta = {name: value - before[name] for name, value in snapshot().items()}
    assert delta["timeout"] == 1
    assert delta["length"] == 3
    assert delta["vllm:request_prompt_tokens_count"] == delta["vllm:request_generation_tokens_count"] == 4
    assert delta["vllm:request_prompt_tokens_sum"] == delta["vllm:prompt_tokens_total"] == sum(map(len, prompts)) + 2
    assert delta["vllm:request_generation_tokens_sum"] == delta["vllm:generation_tokens_total"] == \
        sum(lengths) + late_tokens  # fmt: skip
    assert delta["vllm:time_to_first_token_seconds_count"] == 3 + (late_tokens > 0)
    assert delta["vllm:time_per_output_token_seconds_count"] == 3 + (late_tokens > 1)
    # Server-side times lie inside what the client measured around them (they start later and end earlier).
    client_e2e = sum(r.finished_at - r.sent_at for r in results) + late_e2e
    assert 0 < delta["vllm:e2e_request_latency_seconds_sum"] <= client_e2e
    assert 0 < delta["vllm:time_to_first_token_seconds_sum"] <= delta["vllm:e2e_request_latency_seconds_sum"]
    assert delta["vllm:request_queue_time_seconds_count"] >= 3 and delta["vllm:request_queue_time_seconds_sum"] >= 0


@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_perf_metrics_come_only_when_asked_in_order_and_inside_the_clients_timings(server, reference, model):
    """return_perf_metrics: the request's timeline in its last response only, monotone (arrival <=
    first scheduled <= first token <= last token), on the host's monotonic clock, so between the
    client's send and its receipt of the last response; absent when not asked."""
    sent_ns = time.monotonic_ns()
    asked = one_request(server.grpc_url, model, input_ids=[4, 5, 6], max_tokens=7, sampling=GREEDY, stream=True,
                        return_outputs=(*STATUS_OUTPUTS, PERF_METRICS))  # fmt: skip
    received_ns = time.monotonic_ns()
    plain = one_request(server.grpc_url, model, input_ids=[4, 5, 6], max_tokens=7, sampling=GREEDY, stream=True)
    assert asked.error is None and asked.ids == plain.ids == reference([4, 5, 6], 7).output_ids
    assert all(d.perf is None for d in plain.deltas) and all(d.perf is None for d in asked.deltas[:-1])
    perf = asked.deltas[-1].perf
    assert perf is not None and set(perf) == set(PERF_OUTPUTS)
    times = [perf[name] for name in PERF_OUTPUTS[:4]]
    assert sent_ns <= times[0] <= times[1] <= times[2] <= times[3] <= received_ns, (sent_ns, times, received_ns)
    assert perf["num_preemptions"] == 0 and perf["prefix_cache_hit_tokens"] == 0


# ---- cancellation -----------------------------------------------------------------------------
def test_cancelling_a_stream_frees_its_kv_and_the_server_keeps_serving(server, reference):
    """A stream cancelled while its request runs: the engine aborts it, frees its K/V and counts it.

    The engine runs the request in slices (see run_in_slices) for a few iterations, then is held still
    until the frontend has seen the cancel and sent the abort, so the request has tokens to go when
    the abort reaches the engine. A try in which it still ran to max_tokens first (it ends "length",
    not "cancelled") says nothing and is tried again, up to three times."""
    max_tokens = 1000
    _, core, _ = engine_processes(server.process.pid)
    iterations = functools.partial(metric, server, "orca_iterations_total", "orca")
    running = functools.partial(metric, server, "orca_requests_running", "orca")
    generated_before = metric(server, "orca_generated_tokens_total", "orca")
    aborted_before = metric(server, "vllm:request_success_total", "orca", finished_reason="abort")
    for attempt in range(3):
        finished_before = finished_counts(server)
        started = iterations()
        session = StreamSession(server.grpc_url)
        os.kill(core, signal.SIGSTOP)
        try:
            session.send("orca", f"doomed{attempt}", input_ids=[9, 8, 7], max_tokens=max_tokens, sampling=GREEDY,
                         stream=True)
            assert run_in_slices(core, progress=iterations,  # noqa: B023
                                 until=lambda: iterations() >= started + 10 and running() == 1  # noqa: B023
                                 or ran_to_length(server, finished_before))  # noqa: B023
            # Its K/V is visible while it runs: the gauges keep the last iteration's figures while the
            # engine is stopped. (When it made all its tokens first, the try ends below.)
            held_kv = wait_until(lambda: kv_used(server, "orca") > 0, timeout_s=10, interval_s=0.01)
            session.close(cancel=True)
            if not ran_to_length(server, finished_before):
                wait_until(lambda: re.search(rf"orca: doomed{attempt}#\d+: cancelled by the client",  # noqa: B023
                                             server.log_tail(20000)), timeout_s=10)  # fmt: skip
        finally:
            os.kill(core, signal.SIGCONT)
            session.close(cancel=True)
        if not all_cancelled(server, finished_before, 1):
            continue  # the engine had made all its tokens before the cancel reached it
        assert held_kv
        break
    else:
        pytest.fail("in three tries the request always ran to max_tokens before its cancel reached the engine")
    assert wait_until(lambda: kv_used(server, "orca") == 0, timeout_s=30)
    assert metric(server, "vllm:request_success_total", "orca", finished_reason="abort") == aborted_before + 1
    assert metric(server, "orca_generated_tokens_total", "orca") - generated_before < (attempt + 1) * max_tokens
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
        assert result.num_output_tokens == n and result.num_input_tokens == len(prompt)
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
    # vLLM's cache_config_info, from which autoscalers read the pool: 32768 slots in blocks of 16.
    for model in ("orca", "baseline"):
        (labels,) = [dict(labels) for (n, labels) in samples if n == "vllm:cache_config_info" and ("model", model) in labels]
        assert (labels["block_size"], labels["num_gpu_blocks"], samples[("vllm:cache_config_info", frozenset(labels.items()))]) \
            == ("16", "2048", 1.0)  # fmt: skip


def test_every_series_the_dashboard_queries_is_exported_by_both_models(server, reference):
    """After traffic on both models (a request each here, whatever ran before), each series the dashboard
    reads has samples labelled with each model, so both curves of the A/B are drawn."""
    for model in ("orca", "baseline"):
        one_request(server.grpc_url, model, input_ids=[4, 5, 6], max_tokens=3, sampling=GREEDY, stream=True)
    # The speculative-decoding panel's series come with speculative_config (test_serving_speculative.py).
    series = {name for name in dashboard_series() if not name.startswith("vllm:spec_decode")}
    assert {"vllm:time_to_first_token_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
            "vllm:gpu_cache_usage_perc", "orca_request_preemptions_bucket"} <= series
    for model in ("orca", "baseline"):
        # A request's end is exported before its final response.
        assert metric(server, "vllm:e2e_request_latency_seconds_count", model) > 0
        samples = read_metrics(server)
        missing = sorted(name for name in series
                         if not any(n == name and ("model", model) in labels for (n, labels) in samples))
        assert not missing, f"{model} exports none of {missing}"
