"""The chaos suite (issue #17): `orca` on a real tritonserver over gRPC (CPU) under a storm of
well-formed, cancelled and poison requests, under overload, with a tensor-parallel worker killed or
stopped under load, and with a LoRA adapter whose weights changed after it was registered.

Every well-formed request that runs to its end must carry exactly the tokens the offline engine
(`orca_backend.LLM`, same checkpoint) produces for it: greedy and fixed-seed sampling do not
depend on what else is in the batch. Every wait is bounded, so a hang fails a test instead of
blocking the run.

To add a poison kind, append a `Poison` to POISONS (verify its message by sending it once); a
deployment limit it needs goes into STORM_PARAMETERS.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from core_hooks import pid_alive

from orca_backend.entrypoints.llm import LLM
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.lora import ADAPTER_WEIGHTS, write_random_adapter
from orca_backend.sampling_params import MAX_SEED, MAX_TOP_K, SamplingParams
from orca_client.protocol import STATUS_OUTPUTS, build_inputs
from orca_client.served_path import parse_stat, process_tree

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")

from serving_utils import (  # noqa: E402 - after the skip
    StreamResult,
    StreamSession,
    engine_processes,
    metric,
    start_server,
    wait_until,
)
from tritonclient.utils import triton_to_np_dtype  # noqa: E402 - after the skip

pytestmark = pytest.mark.integration

# Equal to tests/server/test_serving_parallel.py's model (make_checkpoint writes it once per session); four
# heads and an even vocabulary so that tensor_parallel_size=2 splits both.
MODEL = GPT2Config(vocab_size=384, n_positions=256, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
VOCAB, CONTEXT = MODEL.vocab_size, MODEL.n_positions
GREEDY = {"temperature": 0}

# config.pbtxt parameters of the storm's server (a deployment limit a new poison kind needs goes here).
STORM_PARAMETERS = {"kv_capacity_tokens": "8192", "max_input_tokens": "220", "max_stop_sequences": "4",
                    "max_stop_length": "32", "max_request_bytes": "65536"}
OVERLOAD_QUEUE = 32  # max_queued_requests of the overload server
OVERLOAD_REQUESTS = 1100
OVERLOAD_STREAMS = 16

# The tensor-parallel fault tests run with a short watchdog, and every in-flight stream must end
# within FAULT_BOUND_S of the fault. A hang (SIGSTOP) is noticed by the frontend's watchdog once no
# iteration finished for ITERATION_TIMEOUT_S; it checks every min(1, ITERATION_TIMEOUT_S / 4) s
# (engine/core_client.py), then kills the core, whose EOF fails every request at once. A killed
# worker is noticed sooner (the core waits on the workers' sentinels), and the watchdog bounds that
# path too. The adapter polls engine health every HEALTH_POLL_S (0.1 s, server/orca_model.py).
# FAULT_SLACK_S is for a loaded 2-core CI machine, not for the mechanism.
ITERATION_TIMEOUT_S = 3
WATCHDOG_PERIOD_S = min(1.0, ITERATION_TIMEOUT_S / 4)
HEALTH_POLL_S = 0.1
FAULT_SLACK_S = 30.0
FAULT_BOUND_S = ITERATION_TIMEOUT_S + WATCHDOG_PERIOD_S + HEALTH_POLL_S + FAULT_SLACK_S

SETTLE_S = 60.0  # bound for gauges to read 0 and for counters to catch up after a burst
LOAD_WAIT_S = 240.0  # bound for a burst of requests to end on a busy 2-core machine

GAUGES = ("orca_kv_used_tokens", "orca_kv_blocks_used", "orca_requests_running", "orca_requests_waiting")


# ---- the poison table ---------------------------------------------------------------------------------
def _tensor(name: str, datatype: str, values: list[Any]) -> Any:
    array = np.array(values, dtype=triton_to_np_dtype(datatype))
    tensor = grpcclient.InferInput(name, list(array.shape), datatype)
    tensor.set_data_from_numpy(array)
    return tensor


@dataclass(frozen=True)
class Poison:
    """A request the server must refuse, alone, with an error containing `error`.

    `request`: orca_client.protocol.build_inputs keywords merged over POISON_BASE (a value of None
    drops a base field). `tensors`: raw (name, Triton datatype, values) inputs, replacing any of the
    same name (for what build_inputs cannot encode: a wrong dtype, bytes that are not UTF-8).
    `infer`: extra keywords of tritonclient's async_stream_infer, e.g. parameters={...} (request
    parameters, as HTTP generate's top-level keys arrive), priority=, timeout=.
    """

    name: str
    request: dict[str, Any]
    error: str
    tensors: tuple[tuple[str, str, list[Any]], ...] = ()
    infer: dict[str, Any] = field(default_factory=dict)
    accepted: bool = False  # passes admission and is ended by the engine (a timeout): it counts as finished

    def inputs(self) -> list[Any]:
        request = {k: v for k, v in {**POISON_BASE, **self.request}.items() if v is not None}
        raw = {name: _tensor(name, datatype, values) for name, datatype, values in self.tensors}
        built = [t for t in build_inputs(batched=False, **request) if t.name() not in raw]
        return built + list(raw.values())

    def send(self, session: StreamSession, request_id: str, model: str = "orca") -> StreamResult:
        """Sends it on `session`, which must carry nothing else (a stream's error names no request)."""
        if self.infer:  # StreamSession.send_inputs passes none of these: bind them to this session's client
            session.client.async_stream_infer = functools.partial(session.client.async_stream_infer, **self.infer)
        return session.send_inputs(model, self.inputs(), request_id)


POISON_BASE: dict[str, Any] = {"input_ids": [5, 6, 7], "max_tokens": 8, "sampling": GREEDY, "stream": True}
NESTED_800: dict[str, Any] = {"type": "integer"}
for _ in range(799):
    NESTED_800 = {"type": "array", "items": NESTED_800}
_SEED_RANGE = f"seed must be an integer in [0, {MAX_SEED}]"
_TEMPERATURE = "temperature must be a finite number >= 0"
_TOP_P = "top_p must be in [0, 1] (0 is greedy)"
_MAX_TOKENS = "max_tokens must be a positive integer"
_DTYPE = "data-type is '{}', but model 'orca' expects 'INT32'"  # Triton's own check, before the model

POISONS: list[Poison] = [
    Poison("seed 2**64", {"sampling": {"seed": MAX_SEED + 1}}, _SEED_RANGE),
    Poison("seed 2**70", {"sampling": {"temperature": 1, "seed": 2**70}}, _SEED_RANGE),
    Poison("negative seed", {"sampling": {"seed": -1}}, _SEED_RANGE),
    Poison("bool seed", {"sampling": {"seed": True}}, "seed must be an integer, got True"),
    Poison("top_k 2**31", {"sampling": {"temperature": 1, "top_k": MAX_TOP_K + 1}},
           f"top_k must be -1, 0 or a positive integer up to {MAX_TOP_K}"),
    Poison("top_k -2", {"sampling": {"top_k": -2}}, "top_k must be -1, 0 or a positive integer"),
    Poison("fractional top_k", {"sampling": {"top_k": 1.5}}, "top_k must be an integer, got 1.5"),
    Poison("temperature inf", {"sampling": '{"temperature": Infinity}'}, _TEMPERATURE),
    Poison("temperature 'inf' string", {"sampling": {"temperature": "inf"}}, _TEMPERATURE),
    Poison("temperature nan", {"sampling": '{"temperature": NaN}'}, _TEMPERATURE),
    Poison("negative temperature", {"sampling": {"temperature": -0.5}}, _TEMPERATURE),
    Poison("temperature not a number", {"sampling": {"temperature": "hot"}}, "temperature must be a number"),
    Poison("negative top_p", {"sampling": {"temperature": 1, "top_p": -0.1}}, _TOP_P),
    Poison("top_p > 1", {"sampling": {"temperature": 1, "top_p": 1.5}}, _TOP_P),
    Poison("stop_token_ids = vocab size", {"sampling": {"stop_token_ids": [VOCAB]}},
           f"stop_token_ids: {VOCAB} is outside the model's vocabulary [0, {VOCAB})"),
    Poison("negative stop_token_ids", {"sampling": {"stop_token_ids": [3, -3]}},
           "stop_token_ids must be non-negative integers"),
    Poison("empty stop string", {"sampling": {"stop": ["ab", ""]}}, "stop must be a list of non-empty strings"),
    Poison("input_ids = vocab size", {"input_ids": [1, VOCAB, 2]},
           f"token id {VOCAB} is outside the model's vocabulary [0, {VOCAB})"),
    Poison("input_ids 2**31-1", {"input_ids": [2**31 - 1]}, "is outside the model's vocabulary"),
    Poison("negative input_ids", {"input_ids": [1, -2]}, "input_ids must be non-negative token ids, got -2"),
    Poison("empty input_ids", {"input_ids": []}, "input_ids is empty"),
    Poison("empty text", {"input_ids": None, "text": ""}, "text_input is empty"),
    Poison("no prompt", {"input_ids": None}, "no prompt"),
    Poison("both prompts", {"text": "the cat"}, "not both"),
    Poison("text not UTF-8", {"input_ids": None}, "text_input is not valid UTF-8",
           tensors=(("text_input", "BYTES", [b"\xff\xfe"]),)),
    Poison("prompt + max_tokens beyond context", {"input_ids": [1] * 200, "max_tokens": 100},
           f"exceeds the model's context length of {CONTEXT} tokens"),
    Poison("max_tokens 2**31-1", {"max_tokens": 2**31 - 1}, f"exceeds the model's context length of {CONTEXT}"),
    Poison("max_tokens 0", {"max_tokens": 0}, _MAX_TOKENS),
    Poison("negative max_tokens", {"max_tokens": -5}, _MAX_TOKENS),
    Poison("max_tokens 0 in the JSON", {"max_tokens": None, "sampling": {"max_tokens": 0}}, _MAX_TOKENS),
    Poison("min_tokens > max_tokens", {"max_tokens": 4, "sampling": {"min_tokens": 5}},
           "min_tokens must be an integer in [0, max_tokens=4]"),
    Poison("unknown sampling key", {"sampling": {"temprature": 0}}, "unknown sampling parameter(s): temprature"),
    Poison("malformed JSON", {"sampling": '{"temperature": 0,'}, "sampling_parameters is not valid JSON"),
    Poison("JSON not an object", {"sampling": "[1, 2]"}, "sampling_parameters must be a JSON object"),
    Poison("ignore_eos not a boolean", {"sampling": {"ignore_eos": "yes"}}, "ignore_eos must be a boolean"),
    Poison("n 129", {"sampling": {"n": 129}}, "n must be an integer in [1, 128]"),
    Poison("best_of 2", {"sampling": {"n": 2, "best_of": 2}}, "best_of is not supported"),
    Poison("presence_penalty 3", {"sampling": {"presence_penalty": 3}}, "presence_penalty must be a number in [-2, 2]"),
    Poison("repetition_penalty 0", {"sampling": {"repetition_penalty": 0}},
           "repetition_penalty must be a finite number > 0"),
    Poison("logit_bias id = vocab size", {"sampling": {"logit_bias": {str(VOCAB): 5}}},
           f"logit_bias: {VOCAB} is outside the model's vocabulary [0, {VOCAB})"),
    Poison("logit_bias 200", {"sampling": {"logit_bias": {"5": 200}}}, "logit_bias values must be numbers in [-100, 100]"),
    Poison("logprobs 21", {"sampling": {"logprobs": 21}}, "logprobs must be an integer in [0, 20]"),
    Poison("prompt echo in a stream", {"exclude_input_in_output": False},
           "When streaming, `exclude_input_in_output` = False is not allowed."),
    Poison("INT64 max_tokens", {"max_tokens": None}, _DTYPE.format("INT64"),
           tensors=(("max_tokens", "INT64", [8]),)),
    Poison("FP32 max_tokens", {"max_tokens": None}, _DTYPE.format("FP32"),
           tensors=(("max_tokens", "FP32", [8.0]),)),
    Poison("FP32 input_ids", {"input_ids": None}, _DTYPE.format("FP32"),
           tensors=(("input_ids", "FP32", [1.0, 2.0]),)),
    Poison("two max_tokens", {}, "unexpected shape for input 'max_tokens'", tensors=(("max_tokens", "INT32", [4, 5]),)),
    Poison("unknown input", {}, "unexpected inference input 'bogus'", tensors=(("bogus", "INT32", [1]),)),
    Poison("bad seed as a request parameter", {"sampling": None}, _SEED_RANGE, infer={"parameters": {"seed": -1}}),
    # Deployment limits (STORM_PARAMETERS) and per-request scheduling options.
    Poison("prompt past max_input_tokens", {"input_ids": [1] * 221, "max_tokens": 4},
           "221 tokens, more than this deployment's max_input_tokens of 220"),
    Poison("too many stop strings", {"sampling": {"stop": ["a", "b", "c", "d", "e"]}},
           "5 stop strings, more than this deployment's max_stop_sequences of 4"),
    Poison("stop string too long", {"sampling": {"stop": ["x" * 33]}},
           "a stop string of 33 characters, longer than this deployment's max_stop_length of 32"),
    Poison("request past max_request_bytes", {"input_ids": None, "text": "y" * 70_000},
           "more than this deployment's max_request_bytes of 65536"),
    Poison("every token banned before min_tokens", {"sampling": {"min_tokens": 2, "stop_token_ids": list(range(VOCAB))}},
           "ban every token of the vocabulary"),
    Poison("bad scheduling_priority", {}, "request parameter scheduling_priority must be an integer",
           infer={"parameters": {"scheduling_priority": "urgent"}}),
    Poison("scheduling_priority out of range", {}, "priority must be an integer in",
           infer={"parameters": {"scheduling_priority": 2**40}}),
    Poison("negative timeout_s", {}, "timeout_s must be a number of seconds > 0", infer={"parameters": {"timeout_s": -1.0}}),
    Poison("Triton request timeout already passed", {"max_tokens": 200}, "the request timed out: its timeout of 1e-06 s",
           infer={"timeout": 1}, accepted=True),
    # Hostile payloads (issue #29): per-request lists bounded before they reach an iteration, JSON nested
    # past what the parser recurses into, a schema nested past max_structured_output_depth.
    Poison("2000 stop_token_ids", {"sampling": {"stop_token_ids": [7] * 2000, "min_tokens": 4}},
           "stop_token_ids has 2000 entries, more than the limit of 1024"),
    Poison("1500 logit_bias entries", {"sampling": {"logit_bias": {str(i): 1 for i in range(1500)}}},
           "logit_bias has 1500 entries, more than the limit of 1024"),
    Poison("JSON nested 20000 deep", {"sampling": "[" * 20_000 + "]" * 20_000}, "sampling_parameters is nested too deeply"),
    Poison("schema nested 800 deep", {"sampling": {"structured_outputs": {"json": NESTED_800}}},
           "nests 800 levels deep, more than this deployment's max_structured_output_depth of 64"),
    Poison("scheduling_priority -2**31+1", {}, "priority must be an integer in [-20, 20]",
           infer={"parameters": {"scheduling_priority": -(2**31) + 1}}),
]
POISON_COPIES = 2  # each kind is sent this many times during the storm


# ---- servers and the oracle ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(MODEL)[0]


def _print_log(server) -> None:
    # The log is the first thing to read when a test here fails.
    print("\n".join(line for line in server.log_tail(20000).splitlines() if not line.startswith(("|", "+"))))


@pytest.fixture(scope="module")
def storm_server(checkpoint, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("triton-storm"), checkpoint, models=("orca",),
                          parameters=STORM_PARAMETERS)
    try:
        yield server
    finally:
        server.stop()
        _print_log(server)


@pytest.fixture(scope="module")
def overload_server(checkpoint, tmp_path_factory):
    # A small engine batch keeps the engine well behind a burst, so the queue limit is reached.
    server = start_server(tmp_path_factory.mktemp("triton-overload"), checkpoint, models=("orca",), max_num_seqs=8,
                          parameters={"kv_capacity_tokens": "4096", "max_queued_requests": str(OVERLOAD_QUEUE)})
    try:
        yield server
    finally:
        server.stop()
        _print_log(server)


@pytest.fixture
def tp2_server(checkpoint, tmp_path):
    """A fresh tensor_parallel_size=2 server per test: a fault ends its model for good."""
    server = start_server(tmp_path / "triton", checkpoint, models=("orca",), parameters={
        "tensor_parallel_size": "2", "kv_capacity_tokens": "8192", "iteration_timeout_s": str(ITERATION_TIMEOUT_S)})
    try:
        yield server
    finally:
        server.stop()
        _print_log(server)


@dataclass(frozen=True)
class Spec:
    """A well-formed request: what the server is sent and what the oracle runs."""

    prompt: str | tuple[int, ...]
    max_tokens: int
    sampling_json: str  # the sampling_parameters input

    @property
    def sampling(self) -> dict[str, Any]:
        return json.loads(self.sampling_json)

    def send(self, session: StreamSession, request_id: str, model: str = "orca") -> StreamResult:
        prompt = {"text": self.prompt} if isinstance(self.prompt, str) else {"input_ids": list(self.prompt)}
        inputs = build_inputs(batched=False, max_tokens=self.max_tokens, sampling=self.sampling_json, stream=True,
                              return_outputs=STATUS_OUTPUTS, **prompt)
        return session.send_inputs(model, inputs, request_id)


@pytest.fixture(scope="module")
def reference(checkpoint):
    """spec list -> offline outputs (memoized): the oracle for every served token."""
    llm = LLM(str(checkpoint))
    cache: dict[Spec, Any] = {}

    def generate(specs: list[Spec]) -> list[Any]:
        todo = list(dict.fromkeys(s for s in specs if s not in cache))
        if todo:
            params = [SamplingParams.from_dict({"max_tokens": s.max_tokens, **s.sampling}) for s in todo]
            prompts = [s.prompt if isinstance(s.prompt, str) else list(s.prompt) for s in todo]
            cache.update(zip(todo, llm.generate(prompts, params), strict=True))
        return [cache[s] for s in specs]

    return generate


WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "then", "ran", "far", "away", "from", "old", "red", "dogs"]


def random_spec(rng: random.Random, max_tokens: int, stop: str | None = None) -> Spec:
    if rng.random() < 0.3:
        prompt: str | tuple[int, ...] = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 12)))
    else:
        prompt = tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 48)))
    if rng.random() < 0.5:
        # A temperature below vLLM's epsilon is greedy (1e-300 is 0 in float32: it drew from NaNs).
        sampling: dict[str, Any] = dict(GREEDY) if rng.random() < 0.8 else {"temperature": 1e-300, "seed": 3}
    else:
        sampling = {"temperature": rng.choice([0.6, 1.0, 1.4]), "seed": rng.choice([rng.randrange(MAX_SEED), MAX_SEED, 0])}
        if rng.random() < 0.5:
            sampling["top_p"] = rng.choice([0.5, 0.9])
        if rng.random() < 0.5:
            sampling["top_k"] = rng.choice([1, 20, VOCAB, MAX_TOP_K])
    if rng.random() < 0.2:
        sampling["min_tokens"] = rng.randint(0, max_tokens)
    if rng.random() < 0.2:
        sampling["stop_token_ids"] = [rng.randrange(VOCAB)]
    if rng.random() < 0.2:
        sampling["ignore_eos"] = True
    if rng.random() < 0.2:  # penalties keep per-request counts in the sampler: they must survive cancels too
        sampling.update(rng.choice([{"presence_penalty": 1.5}, {"frequency_penalty": -0.5},
                                    {"repetition_penalty": 1.3, "frequency_penalty": 0.4}]))  # fmt: skip
    if rng.random() < 0.1:
        sampling["logit_bias"] = {str(rng.randrange(VOCAB)): rng.choice([-100.0, 8.0])}
    if stop is not None:
        sampling["stop"] = [stop]
    return Spec(prompt, max_tokens, json.dumps(sampling, sort_keys=True))


def with_stop_string(rng: random.Random, spec: Spec, unstopped: Any) -> Spec:
    """`spec` with a stop string taken from the middle of its own unstopped output (so it stops)."""
    text = unstopped.text or ""
    starts = [i for i in range(len(text) // 3, len(text) - 1) if text[i:i + 2].isascii() and text[i:i + 2].isalpha()]
    if not starts:
        return spec
    i = rng.choice(starts)
    return Spec(spec.prompt, spec.max_tokens, json.dumps({**spec.sampling, "stop": [text[i:i + 2]]}, sort_keys=True))


def gauges(server) -> dict[str, float]:
    return {name: metric(server, name, "orca") for name in GAUGES}


def finished_total(server) -> float:
    return metric(server, "orca_requests_finished_total", "orca")


def model_ready(server, model: str = "orca") -> bool:
    try:
        with urllib.request.urlopen(f"http://{server.http_url}/v2/models/{model}/ready", timeout=5) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError):  # HTTPError (non-200) is a URLError
        return False


def assert_settled_and_serving(server, reference) -> None:
    """Gauges at 0 within a bounded wait, the model ready, and one more request served exactly."""
    assert wait_until(lambda: not any(gauges(server).values()), timeout_s=SETTLE_S), gauges(server)
    assert model_ready(server) and server.is_live()
    spec = Spec((9, 8, 7, 6), 12, json.dumps(GREEDY))
    with StreamSession(server.grpc_url) as session:
        result = spec.send(session, "after")
        session.wait(timeout_s=60)
    assert result.error is None and result.ids == reference([spec])[0].output_ids


def close_all(sessions: list[StreamSession]) -> None:
    for session in sessions:
        session.close(cancel=True)


# ---- 1. the mixed storm ---------------------------------------------------------------------------------
def test_mixed_storm_of_good_cancelled_and_poison_streams(storm_server, reference):
    server = storm_server
    rng = random.Random(17)
    # ~20% are cancelled by their client after a random number of tokens (0: right after sending);
    # those are long, so that most are cut short.
    doomed = [rng.random() < 0.2 for _ in range(200)]
    good = [random_spec(rng, rng.randint(48, 160) if d else rng.randint(1, 48)) for d in doomed]
    good = [with_stop_string(rng, s, out) if rng.random() < 0.15 else s for s, out in zip(good, reference(good), strict=True)]
    cancel_after = {i: rng.randint(0, s.max_tokens // 2) for i, s in enumerate(good) if doomed[i]}
    cancelled_before = metric(server, "orca_requests_finished_total", "orca", reason="cancelled")
    expected = reference(good)
    plan = [("good", i) for i in range(len(good))] + [("poison", i) for i in range(len(POISONS))] * POISON_COPIES
    rng.shuffle(plan)
    finished_before = finished_total(server)

    sessions: list[StreamSession] = []
    results: dict[tuple[str, int, int], StreamResult] = {}
    cancel_of: dict[int, StreamSession] = {}
    try:
        # One stream per request: a stream's error names no request, and cancelling a stream
        # cancels everything on it. All streams are opened first, then the requests go out at once.
        sessions += [StreamSession(server.grpc_url) for _ in plan]
        for n, ((kind, i), session) in enumerate(zip(plan, sessions, strict=True)):
            if kind == "good":
                results[(kind, i, n)] = good[i].send(session, f"good{i}")
                if i in cancel_after:
                    cancel_of[i] = session
            else:
                results[(kind, i, n)] = POISONS[i].send(session, f"poison{i}.{n}")
        # The canceller: each doomed stream is cancelled once it has its number of tokens.
        by_index = {i: r for (kind, i, _), r in results.items() if kind == "good"}
        cancelled: set[int] = set()
        deadline = time.monotonic() + LOAD_WAIT_S
        while len(cancelled) < len(cancel_after) and time.monotonic() < deadline:
            for i, after in cancel_after.items():
                if i not in cancelled and (len(by_index[i].ids) >= after or by_index[i].done.is_set()):
                    cancel_of[i].close(cancel=True)
                    cancelled.add(i)
            time.sleep(0.002)
        assert len(cancelled) == len(cancel_after), "streams to cancel never reached their point"
        remaining = [r for (kind, i, _), r in results.items() if not (kind == "good" and i in cancel_after)]
        for result in remaining:
            assert result.done.wait(max(0.0, deadline - time.monotonic())), \
                f"{result.request_id} unfinished after {LOAD_WAIT_S} s ({len(result.ids)} tokens)"
    finally:
        close_all(sessions)

    stray = [e for s in sessions for e in s.stray_errors]
    assert not stray, stray
    problems = []
    for (kind, i, _), result in results.items():
        if kind == "poison":
            poison = POISONS[i]
            if result.error is None or poison.error not in result.error:
                problems.append(f"poison {poison.name!r}: expected {poison.error!r}, got {result.error!r} "
                                f"({len(result.ids)} tokens)")
        elif i in cancel_after:  # whatever it received before the cancel is a prefix of its reference
            if result.error is not None or result.ids != expected[i].output_ids[:len(result.ids)]:
                problems.append(f"cancelled good{i} {good[i]}: {result.error!r}, ids {result.ids} "
                                f"not a prefix of {expected[i].output_ids}")
        elif (result.error, result.ids, result.text, result.finish_reason) != \
                (None, expected[i].output_ids, expected[i].text, expected[i].finish_reason):
            problems.append(f"good{i} {good[i]}: error {result.error!r}, finish {result.finish_reason!r} "
                            f"ids {result.ids} != {expected[i].output_ids} ({expected[i].finish_reason!r})")
    assert not problems, "\n".join(problems)
    # Every accepted request (good, cancelled, timed out) ended inside the server: none is left holding
    # K/V or a batch slot; a refused one never counted.
    accepted = len(good) + POISON_COPIES * sum(p.accepted for p in POISONS)
    assert wait_until(lambda: finished_total(server) - finished_before == accepted, timeout_s=SETTLE_S), \
        (finished_total(server) - finished_before, accepted)
    cut = metric(server, "orca_requests_finished_total", "orca", reason="cancelled") - cancelled_before
    print(f"storm: {len(good)} good ({len(cancel_after)} cancelled by the client, {cut:.0f} of them cut short), "
          f"{len(POISONS) * POISON_COPIES} poison")
    assert_settled_and_serving(server, reference)


# ---- 2. overload ---------------------------------------------------------------------------------------
def test_overload_every_request_gets_its_tokens_or_retry_later(overload_server, reference):
    """Over 1,000 requests at once against a queue limit of OVERLOAD_QUEUE.

    They share OVERLOAD_STREAMS streams (a thousand gRPC streams of their own would take minutes
    to open on a 2-core machine). A stream's error names no request, so refusals are attributed by
    elimination: a refused request gets its error and nothing else, so the requests that got no
    response at all must be exactly as many as the errors of their stream.
    """
    server = overload_server
    rng = random.Random(5)
    pool = [random_spec(rng, rng.randint(4, 12)) for _ in range(40)]
    specs = [rng.choice(pool) for _ in range(OVERLOAD_REQUESTS)]
    expected = reference(specs)
    finished_before = finished_total(server)
    sessions = [StreamSession(server.grpc_url) for _ in range(OVERLOAD_STREAMS)]
    try:
        results = [spec.send(sessions[n % len(sessions)], f"o{n}") for n, spec in enumerate(specs)]

        def ended() -> int:  # requests that got their final response, plus errors on their streams
            return sum(r.done.is_set() for r in results) + sum(len(s.stray_errors) for s in sessions)

        assert wait_until(lambda: ended() == len(specs), timeout_s=LOAD_WAIT_S, interval_s=0.2), \
            f"{len(specs) - ended()} of {len(specs)} requests unanswered after {LOAD_WAIT_S} s"
    finally:
        close_all(sessions)
    served = refused = 0
    problems = []
    for session in sessions:
        mine = [(n, r) for n, r in enumerate(results) if r.request_id in session.results]
        silent = [n for n, r in mine if not r.done.is_set()]
        problems += [f"o{n}: {len(results[n].ids)} tokens and no end" for n in silent if results[n].deltas]
        problems += [f"stray error {e!r}" for e in session.stray_errors if "retry later" not in e]
        if len(silent) != len(session.stray_errors):
            problems.append(f"{len(silent)} requests without an answer but {len(session.stray_errors)} errors")
        refused += len(session.stray_errors)
        for n, result in mine:
            if not result.done.is_set():
                continue
            if result.error is not None:  # the stream's only open request: StreamSession attributed it
                refused += 1
                if "retry later" not in result.error or result.ids:
                    problems.append(f"o{n}: error {result.error!r} after {len(result.ids)} tokens")
            elif (result.ids, result.finish_reason) == (expected[n].output_ids, expected[n].finish_reason):
                served += 1
            else:
                problems.append(f"o{n} {specs[n]}: {result.finish_reason!r} {result.ids} != "
                                f"{expected[n].finish_reason!r} {expected[n].output_ids}")
    assert not problems, "\n".join(problems[:20])
    assert served + refused == len(specs)
    assert served >= 1 and refused >= 1, (served, refused)
    print(f"overload: {served} served, {refused} refused (retry later)")
    assert wait_until(lambda: finished_total(server) - finished_before == served, timeout_s=SETTLE_S), \
        (finished_total(server) - finished_before, served)
    assert_settled_and_serving(server, reference)


# ---- 3. tensor-parallel worker faults under load --------------------------------------------------------
def _start_ticks(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return parse_stat(f.read()).start_ticks
    except (OSError, ValueError, IndexError):
        return None


def survivors(snapshot: list[Any], session_id: int) -> list[str]:
    """Processes of a stopped server still running: from its tree as it was, or in its session."""
    left = [f"{p.pid} {' '.join(p.cmdline)[:120]}" for p in snapshot
            if pid_alive(p.pid) and _start_ticks(p.pid) == p.start_ticks]
    for entry in os.listdir("/proc"):
        if entry.isdigit() and pid_alive(int(entry)):
            try:
                if os.getsid(int(entry)) == session_id:
                    left.append(f"{entry} (in the server's session)")
            except (ProcessLookupError, PermissionError):
                continue
    return left


@pytest.mark.parametrize("fault", ["SIGKILL", "SIGSTOP"])
def test_a_faulted_tp2_worker_ends_every_stream_unloads_the_model_and_leaves_no_process(tp2_server, fault):
    """A worker SIGKILLed (it dies) or SIGSTOPped (it hangs the collective) while 16 streams run."""
    server = tp2_server
    stub, core, workers = engine_processes(server.process.pid)
    assert len(workers) == 2, [p.cmdline for p in process_tree(core)]
    sessions = [StreamSession(server.grpc_url) for _ in range(16)]
    try:
        results = [s.send_inputs("orca", build_inputs(input_ids=[3 + i, 40, 41], max_tokens=CONTEXT - 3, stream=True,
                                                      sampling={**GREEDY, "ignore_eos": True}), f"s{i}")
                   for i, s in enumerate(sessions)]  # fmt: skip
        assert wait_until(lambda: all(r.deltas for r in results), timeout_s=120, interval_s=0.01)
        snapshot = process_tree(server.process.pid)  # everything the server runs, workers generating
        assert not any(r.done.is_set() for r in results), "a stream ended before the fault"
        os.kill(workers[-1], getattr(signal, fault))
        deadline = time.monotonic() + FAULT_BOUND_S
        for session in sessions:  # every stream ends within the bound (else TimeoutError)
            session.wait(timeout_s=max(0.0, deadline - time.monotonic()))
    finally:
        close_all(sessions)
    cause = "was killed by SIGKILL" if fault == "SIGKILL" else f"(iteration_timeout_s={ITERATION_TIMEOUT_S})"
    for result in results:
        assert result.error is not None and "the ORCA engine is unavailable" in result.error, result.error
        assert cause in result.error, result.error
        assert len(result.ids) < CONTEXT - 3
    assert wait_until(lambda: not model_ready(server), timeout_s=FAULT_BOUND_S)  # the model unloaded itself
    assert server.is_live()
    session_id = server.process.pid  # the server runs in a session of its own (start_new_session)
    server.stop()
    assert wait_until(lambda: not survivors(snapshot, session_id), timeout_s=30), survivors(snapshot, session_id)
    assert {stub, core, *workers} <= {p.pid for p in snapshot}


# ---- 4. a LoRA adapter whose weights changed after registration, under load ------------------------------
# Its requests end with the load's error (the first ones when its load fails, the later ones as they
# arrive); it never spends the failure budget (set low here: three such iterations used to end the engine).
BAD_LORA_REQUESTS = 100  # and as many healthy ones (the base model and adapters A and B), interleaved
HEALTHY_STREAMS = 8  # the healthy requests share these; each bad one has a stream of its own (its error names no request)
FAILURE_BUDGET = 3  # max_consecutive_failed_iterations of its server
BAD_LORA_ERROR = "LoRA adapter 'bad' could not be loaded: its weights changed since it was registered"


@pytest.fixture(scope="module")
def lora_adapters(tmp_path_factory):
    """Random PEFT adapters A and B for MODEL (std 0.2: they change the greedy tokens); never modified."""
    root = tmp_path_factory.mktemp("chaos-lora")
    for name, rank, seed in (("A", 8, 1), ("B", 4, 2)):
        write_random_adapter(root / name, MODEL, rank=rank, seed=seed, std=0.2)
    return root


@pytest.fixture
def bad_adapter(tmp_path):
    """A third adapter, the test's own to break."""
    write_random_adapter(tmp_path / "bad", MODEL, rank=8, seed=3, std=0.2)
    return tmp_path / "bad"


@pytest.fixture(scope="module")
def lora_reference(checkpoint, lora_adapters):
    """As `reference`, with adapters A and B registered (a spec names one in its sampling JSON)."""
    llm = LLM(str(checkpoint), enable_lora=True, max_loras=2,
              lora_modules={name: str(lora_adapters / name) for name in ("A", "B")})  # fmt: skip
    cache: dict[Spec, Any] = {}

    def generate(specs: list[Spec]) -> list[Any]:
        todo = list(dict.fromkeys(s for s in specs if s not in cache))
        if todo:
            params = [SamplingParams.from_dict({"max_tokens": s.max_tokens, **s.sampling}) for s in todo]
            cache.update(zip(todo, llm.generate([list(s.prompt) for s in todo], params), strict=True))
        return [cache[s] for s in specs]

    try:
        yield generate
    finally:
        llm.shutdown()


@pytest.fixture
def lora_server(checkpoint, lora_adapters, bad_adapter, tmp_path):
    """A fresh server per test serving A, B and "bad" (the test breaks "bad")."""
    server = start_server(tmp_path / "triton", checkpoint, models=("orca",),
                          lora_modules={"A": str(lora_adapters / "A"), "B": str(lora_adapters / "B"),
                                        "bad": str(bad_adapter)},
                          parameters={"kv_capacity_tokens": "4096", "max_loras": "2",
                                      "max_consecutive_failed_iterations": str(FAILURE_BUDGET)})  # fmt: skip
    try:
        yield server
    finally:
        server.stop()
        _print_log(server)


def lora_spec(prompt: tuple[int, ...], lora_name: str | None) -> Spec:
    return Spec(prompt, 8, json.dumps({**GREEDY, **({"lora_name": lora_name} if lora_name else {})}, sort_keys=True))


def test_a_bad_adapter_under_load_fails_its_requests_alone(lora_server, bad_adapter, lora_reference):
    server = lora_server
    rng = random.Random(39)
    prompts = [tuple(rng.randrange(VOCAB) for _ in range(rng.randint(1, 8))) for _ in range(2 * BAD_LORA_REQUESTS)]
    healthy = [lora_spec(p, rng.choice([None, "A", "B"])) for p in prompts[:BAD_LORA_REQUESTS]]
    bad = [lora_spec(p, "bad") for p in prompts[BAD_LORA_REQUESTS:]]
    expected = lora_reference(healthy)  # before the bad adapter breaks (the oracle does not register it)
    base = lora_reference([lora_spec(s.prompt, None) for s in healthy])
    for name in ("A", "B"):  # each adapter changes some request's tokens: serving the base model for it fails
        assert any(e.output_ids != b.output_ids for s, e, b in zip(healthy, expected, base, strict=True)
                   if s.sampling.get("lora_name") == name), name  # fmt: skip
    core_before = engine_processes(server.process.pid)
    start_ticks = _start_ticks(core_before[1])
    # Registered, never loaded yet (nothing named it): its weights file is now half of what was checked.
    weights = bad_adapter / ADAPTER_WEIGHTS
    os.truncate(weights, weights.stat().st_size // 2)
    plan = [("healthy", i) for i in range(len(healthy))] + [("bad", i) for i in range(len(bad))]
    rng.shuffle(plan)
    finished_before = finished_total(server)

    shared: list[StreamSession] = []
    own: list[StreamSession] = []
    results: dict[tuple[str, int], StreamResult] = {}
    started = time.monotonic()
    try:
        shared += [StreamSession(server.grpc_url) for _ in range(HEALTHY_STREAMS)]
        own += [StreamSession(server.grpc_url) for _ in bad]
        sessions = iter(own)
        for n, (kind, i) in enumerate(plan):  # all streams open first, then the requests go out at once
            if kind == "healthy":
                results[(kind, i)] = healthy[i].send(shared[n % HEALTHY_STREAMS], f"healthy{i}")
            else:
                results[(kind, i)] = bad[i].send(next(sessions), f"bad{i}")
        deadline = time.monotonic() + LOAD_WAIT_S
        for (kind, i), result in results.items():
            assert result.done.wait(max(0.0, deadline - time.monotonic())), \
                f"{kind}{i} unfinished after {LOAD_WAIT_S} s ({len(result.ids)} tokens)"
    finally:
        close_all(shared + own)
    elapsed = time.monotonic() - started

    stray = [e for s in shared + own for e in s.stray_errors]
    assert not stray, stray
    problems = []
    for (kind, i), result in results.items():
        if kind == "bad":
            if result.error is None or BAD_LORA_ERROR not in result.error or result.deltas:
                problems.append(f"bad{i}: error {result.error!r} after {len(result.ids)} tokens")
            elif str(bad_adapter.parent) in result.error or str(server.run_dir) in result.error:
                problems.append(f"bad{i}: the error names a server path: {result.error!r}")
        elif (result.error, result.ids, result.text, result.finish_reason) != \
                (None, expected[i].output_ids, expected[i].text, expected[i].finish_reason):
            problems.append(f"healthy{i} {healthy[i]}: error {result.error!r}, finish {result.finish_reason!r} "
                            f"ids {result.ids} != {expected[i].output_ids} ({expected[i].finish_reason!r})")
    assert not problems, "\n".join(problems[:20])
    print(f"bad adapter: {len(healthy)} healthy and {len(bad)} bad requests ended in {elapsed:.1f} s")
    # Every request was accepted and ended inside the engine; the engine never died or restarted.
    assert wait_until(lambda: finished_total(server) - finished_before == len(healthy) + len(bad), timeout_s=SETTLE_S), \
        (finished_total(server) - finished_before, len(healthy) + len(bad))
    assert engine_processes(server.process.pid) == core_before and _start_ticks(core_before[1]) == start_ticks
    assert "iterations in a row failed" not in server.log_tail(200_000)
    assert_settled_and_serving(server, lora_reference)
    # More bad requests in a row than the failure budget, each alone in its batch (had they been failed
    # iterations, the third would end the engine), then adapter A still serves exactly.
    for n in range(2 * FAILURE_BUDGET):
        with StreamSession(server.grpc_url) as session:
            refused = lora_spec((9, 8, 7, 6), "bad").send(session, f"after-bad{n}")
            session.wait(timeout_s=60)
        assert refused.error is not None and BAD_LORA_ERROR in refused.error and not refused.deltas, refused.error
    spec = lora_spec((9, 8, 7, 6), "A")
    with StreamSession(server.grpc_url) as session:
        served = spec.send(session, "after-A")
        session.wait(timeout_s=60)
    assert served.error is None and served.ids == lora_reference([spec])[0].output_ids
    assert model_ready(server) and engine_processes(server.process.pid) == core_before
