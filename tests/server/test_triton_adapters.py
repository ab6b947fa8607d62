"""The two TritonPythonModel adapters against a stand-in `triton_python_backend_utils` (no server).

What a real server cannot show cheaply lives here: the engine loop dying under pending requests,
and the response thread's bookkeeping (one final response per request, never two).
"""

from __future__ import annotations

import importlib
import json
import os
import signal
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from core_hooks import CrashSwitch, StepGate, pid_alive

from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.entrypoints.llm import LLM
from orca_backend.sampling_params import SamplingParams
from orca_backend.server.protocol import OUTPUT_NAMES

FINAL = 1


@dataclass
class FakeTensor:
    name: str
    array: np.ndarray

    def as_numpy(self) -> np.ndarray:
        return self.array


@dataclass
class FakeResponse:
    output_tensors: list[FakeTensor] = field(default_factory=list)
    error: Any = None

    def output(self, name: str) -> np.ndarray:
        return next(t.array for t in self.output_tensors if t.name == name)


class FakeError:
    UNKNOWN, INTERNAL, NOT_FOUND, INVALID_ARG, UNAVAILABLE, UNSUPPORTED, ALREADY_EXISTS, CANCELLED = range(8)

    def __init__(self, message: str, code: int = 1) -> None:
        self.message, self.code = message, code


class FakeSender:
    def __init__(self) -> None:
        self.sent: list[tuple[FakeResponse | None, int]] = []
        self.after_final: list[tuple[FakeResponse | None, int]] = []
        self.cancelled = False
        self.finished = threading.Event()
        self.release: threading.Event | None = None  # when set up, send() waits for it: a lagging client
        self.sending = threading.Event()
        self.refuse_finals = 0  # this many final sends raise, as a real sender's failing send does

    def send(self, response: FakeResponse | None = None, flags: int = 0) -> None:
        self.sending.set()
        if flags & FINAL and self.refuse_finals:
            self.refuse_finals -= 1
            raise RuntimeError("the final response could not be delivered")
        if self.release is not None:
            assert self.release.wait(60), "the test never released the sender"
        # Recorded, not asserted: the adapter swallows a sender's exceptions (a real one raises when
        # the client is gone), so an assertion here could never fail a test.
        (self.after_final if self.finished.is_set() else self.sent).append((response, flags))
        if flags & FINAL:
            self.finished.set()

    def is_cancelled(self) -> bool:
        return self.cancelled

    def ids(self) -> list[int]:
        return [int(t) for r, _ in self.sent if r is not None and r.error is None
                for t in r.output("output_ids").reshape(-1)]


class FakeRequest:
    def __init__(self, parameters: str = "", outputs: tuple[str, ...] = OUTPUT_NAMES, timeout_us: int = 0,
                 **tensors: np.ndarray) -> None:  # fmt: skip
        self.tensors = tensors
        self._parameters = parameters
        self._timeout_us = timeout_us
        self._outputs = outputs  # Triton lists every output when the client names none
        self.sender = FakeSender()

    def requested_output_names(self) -> list[str]:
        return list(self._outputs)

    def get_response_sender(self) -> FakeSender:
        return self.sender

    def request_id(self) -> str:
        return ""

    def parameters(self) -> str:
        return self._parameters

    def timeout(self) -> int:  # Triton's request timeout in microseconds, 0 when the client set none
        return self._timeout_us

    def is_cancelled(self) -> bool:
        return self.sender.cancelled


class FakeMetric:
    def __init__(self, buckets: list[float] | None = None) -> None:
        self.value = 0.0
        self.buckets = buckets
        self.observed: list[float] = []

    def set(self, value: float) -> None:
        self.value = value

    def increment(self, value: float) -> None:
        self.value += value

    def observe(self, value: float) -> None:
        assert self.buckets is not None, "observe() on a metric made without buckets (not a histogram)"
        self.observed.append(value)


class FakeFamily:
    GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"
    registry: dict[str, dict[frozenset, FakeMetric]] = {}

    def __init__(self, name: str, description: str, kind: str) -> None:
        self.name = name
        FakeFamily.registry.setdefault(name, {})

    def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> FakeMetric:  # noqa: N802
        return FakeFamily.registry[self.name].setdefault(frozenset(labels.items()), FakeMetric(buckets))


def make_pb_utils() -> types.ModuleType:
    pb = types.ModuleType("triton_python_backend_utils")
    pb.Tensor = FakeTensor
    pb.InferenceResponse = FakeResponse
    pb.TritonError = FakeError
    pb.TritonModelException = RuntimeError
    pb.MetricFamily = FakeFamily
    pb.TRITONSERVER_RESPONSE_COMPLETE_FINAL = FINAL
    pb.Logger = types.SimpleNamespace(log_info=lambda m: None, log_warn=lambda m: None, log_error=lambda m: None)
    pb.get_input_tensor_by_name = lambda request, name: (
        FakeTensor(name, request.tensors[name]) if name in request.tensors else None)
    pb.using_decoupled_model_transaction_policy = lambda config: config.get(
        "model_transaction_policy", {}).get("decoupled", False)
    pb.unloaded = []
    pb.unload_model = pb.unloaded.append
    return pb


@pytest.fixture
def pb_utils(monkeypatch):
    pb = make_pb_utils()
    FakeFamily.registry = {}
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", pb)
    for name in ("orca_backend.server.orca_model", "orca_backend.server.baseline_model"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    return pb


PARAMETERS = {"model": {"string_value": "gpt2-tiny"}, "kv_capacity_tokens": {"string_value": "2048"}}


def load(kind: str, core_hook: Any = None, **config: Any) -> Any:
    """Initializes the adapter as Triton would; `core_hook` is installed in its engine core process."""
    module = importlib.import_module(f"orca_backend.server.{kind}_model")
    model = (module.OrcaModel if kind == "orca" else module.BaselineModel)()
    model_config = {"parameters": PARAMETERS, **config}
    launch = LLMEngine.launch
    try:
        LLMEngine.launch = lambda engine_config: launch(engine_config, core_hook=core_hook)  # type: ignore[method-assign]
        model.initialize({"model_config": json.dumps(model_config), "model_name": kind, "model_version": "1"})
    finally:
        LLMEngine.launch = launch  # type: ignore[method-assign]
    return model


def ids_request(ids: list[int], max_tokens: int, batched: bool = False, **extra: np.ndarray) -> FakeRequest:
    """A streamed greedy request, prompt not echoed, with finish_reason and the counts switched on."""
    tensors = {"input_ids": np.array(ids, dtype=np.int32), "max_tokens": np.array([max_tokens], dtype=np.int32),
               "stream": np.array([True]), "exclude_input_in_output": np.array([True]),
               **{f"return_{name}": np.array([True]) for name in ("finish_reason", "num_input_tokens",
                                                                  "num_output_tokens")}, **extra}
    if batched:
        tensors = {k: v[np.newaxis] for k, v in tensors.items()}
    return FakeRequest('{"temperature": 0}', **tensors)


def expected(prompt: list[int], max_tokens: int) -> list[int]:
    return LLM("gpt2-tiny").generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0))[0].output_ids


def finish(request: FakeRequest, timeout_s: float = 30.0) -> FakeSender:
    assert request.sender.finished.wait(timeout_s), "no final response"
    return request.sender


def assert_one_final(sender: FakeSender) -> None:
    """Exactly one final response, the last one, and nothing sent after it."""
    assert [flags for _, flags in sender.sent].count(FINAL) == 1 and sender.sent[-1][1] == FINAL
    assert sender.after_final == [], f"{len(sender.after_final)} response(s) after the final one"


def test_orca_streams_exact_tokens_and_returns_from_execute_at_once(pb_utils):
    gate = StepGate()
    model = load("orca", gate, model_transaction_policy={"decoupled": True})
    try:
        # No iteration can run: execute() must return without waiting for one.
        requests = [ids_request([1, 2, 3], 12), ids_request([9], 5), FakeRequest(input_ids=np.array([], np.int32))]
        assert model.execute(requests) is None
        assert requests[0].sender.sent == [] and requests[1].sender.sent == []
        gate.open()
        for request, prompt, n in ((requests[0], [1, 2, 3], 12), (requests[1], [9], 5)):
            sender = finish(request)
            assert sender.ids() == expected(prompt, n)
            assert_one_final(sender)
            final = sender.sent[-1][0]
            assert final.output("finish_reason")[0] == b"length"
            assert sum(int(r.output("num_output_tokens")[0]) for r, _ in sender.sent) == n  # per-response counts
        (error, flags), = finish(requests[2]).sent
        assert flags == FINAL and error.error.code == FakeError.INVALID_ARG and "empty" in error.error.message
    finally:
        model.finalize()
    for request in requests:
        assert_one_final(request.sender)


def test_orca_builds_only_the_requested_outputs(pb_utils):
    model = load("orca", model_transaction_policy={"decoupled": True})
    try:
        request = ids_request([1, 2, 3], 6)
        request._outputs = ("output_ids", "finish_reason")
        model.execute([request])
        sender = finish(request)
        assert sender.ids() == expected([1, 2, 3], 6)
        assert {tuple(t.name for t in response.output_tensors) for response, _ in sender.sent} == \
            {("output_ids", "finish_reason")}
        assert sender.sent[-1][0].output("finish_reason")[0] == b"length"
    finally:
        model.finalize()


def test_orca_refuses_past_its_queue_limit_at_once_with_unavailable(pb_utils):
    gate = StepGate()
    params = {**PARAMETERS, "max_queued_requests": {"string_value": "2"}}
    model = load("orca", gate, model_transaction_policy={"decoupled": True}, parameters=params)
    try:
        # No iteration runs, so nothing leaves the queue: the third request is one too many.
        requests = [ids_request([1, 2, 3], 4), ids_request([4, 5], 4), ids_request([6], 4)]
        assert model.execute(requests) is None
        (refused, flags), = requests[2].sender.sent
        assert flags == FINAL and refused.error.code == FakeError.UNAVAILABLE
        assert "max_queued_requests=2" in refused.error.message and "retry later" in refused.error.message
        gate.open()
        for request, prompt in ((requests[0], [1, 2, 3]), (requests[1], [4, 5])):
            assert finish(request).ids() == expected(prompt, 4)
        retry = ids_request([6], 4)  # the queue drained: the same request is taken now
        model.execute([retry])
        assert finish(retry).ids() == expected([6], 4)
    finally:
        model.finalize()
    for request in requests:
        assert_one_final(request.sender)


def test_orca_request_timeout_ends_the_request_unavailable_and_the_others_go_on(pb_utils):
    gate = StepGate()
    model = load("orca", gate, model_transaction_policy={"decoupled": True})
    try:
        timed = ids_request([1, 2, 3], 8)
        timed._timeout_us = 1  # Triton's request timeout: long gone when the engine first looks
        other = ids_request([4, 5], 6)
        model.execute([timed, other])
        gate.open()
        (error, flags), = finish(timed).sent
        assert flags == FINAL and error.error.code == FakeError.UNAVAILABLE
        assert "timed out: its timeout of 1e-06 s passed while it was waiting in the queue" in error.error.message
        assert finish(other).ids() == expected([4, 5], 6)
        assert wait_for(lambda: model.engine.stats().kv_used_blocks == 0)
    finally:
        model.finalize()
    assert_one_final(timed.sender)


def test_orca_a_final_response_that_cannot_be_built_or_sent_becomes_an_error(pb_utils):
    import orca_backend.server.orca_model as orca_model

    model = load("orca", model_transaction_policy={"decoupled": True})
    make_response = orca_model.make_response

    def failing_final(arrays):
        if arrays["finish_reason"][0]:
            raise ValueError("an output that cannot be built")
        return make_response(arrays)

    try:
        unbuildable = ids_request([1, 2, 3], 4)
        orca_model.make_response = failing_final
        model.execute([unbuildable])
        error, flags = finish(unbuildable).sent[-1]
        assert flags == FINAL and "an output that cannot be built" in error.error.message
        orca_model.make_response = make_response
        unsendable = ids_request([1, 2, 3], 4)
        unsendable.sender.refuse_finals = 1
        model.execute([unsendable])
        error, flags = finish(unsendable).sent[-1]
        assert flags == FINAL and "the final response could not be sent" in error.error.message
    finally:
        orca_model.make_response = make_response
        model.finalize()
    for request in (unbuildable, unsendable):
        assert_one_final(request.sender)


def test_orca_merges_a_streams_tokens_while_its_sender_lags(pb_utils):
    gate = StepGate()
    model = load("orca", gate, model_transaction_policy={"decoupled": True})
    try:
        request = ids_request([1, 2, 3], 8)
        request.sender.release = threading.Event()
        model.execute([request])
        gate.allow(1)
        assert request.sender.sending.wait(30)  # the first token's send is stuck
        gate.allow(5)
        assert wait_for(lambda: model.engine.stats().num_generated_tokens >= 6)
        request.sender.release.set()
        gate.open()
        sender = finish(request)
        assert sender.ids() == expected([1, 2, 3], 8)  # never fewer tokens
        per_response = [len(r.output("output_ids")) for r, _ in sender.sent]
        assert len(per_response) < 8 and max(per_response) > 1, per_response
        assert_one_final(sender)
    finally:
        model.finalize()


def test_orca_stream_interval_sends_the_first_token_alone_then_every_n(pb_utils):
    params = {**PARAMETERS, "stream_interval": {"string_value": "3"}}
    gate = StepGate()
    model = load("orca", gate, model_transaction_policy={"decoupled": True}, parameters=params)
    try:
        request = ids_request([4, 5], 8)
        model.execute([request])
        # One iteration, then the rest: a free-running engine can finish a second token before the
        # first response is built, and then the first response rightly carries both.
        gate.allow(1)
        assert wait_for(lambda: len(request.sender.sent) >= 1)
        gate.open()
        sender = finish(request)
        assert sender.ids() == expected([4, 5], 8)
        # The first token alone, then at least 3 per response (more when sending lags), the rest with the final.
        sizes = [len(r.output("output_ids")) for r, _ in sender.sent]
        assert sizes[0] == 1 and all(n >= 3 for n in sizes[1:-1]) and len(sizes) <= 4, sizes
    finally:
        model.finalize()
    with pytest.raises(RuntimeError, match="stream_interval"):
        load("orca", model_transaction_policy={"decoupled": True},
             parameters={**PARAMETERS, "stream_interval": {"string_value": "0"}})


def test_orca_cancellation_aborts_and_frees_kv(pb_utils):
    gate = StepGate()
    model = load("orca", gate, model_transaction_policy={"decoupled": True})
    try:
        request = ids_request([4, 5], 200)
        model.execute([request])
        gate.allow(2)
        assert wait_for(lambda: len(request.sender.ids()) >= 2)
        request.sender.cancelled = True
        # The response thread has asked the engine to abort: at most the iteration the engine is
        # already waiting to run completes before the abort is taken in.
        assert wait_for(lambda: all(p.abort_requested for p in model._pending.values()))
        assert gate.wait_for_abort()  # and the core has it in its inbox: not racing its reader thread
        gate.open()
        sender = finish(request)
        final = sender.sent[-1][0].error  # a cancelled stream ends in vLLM's CANCELLED error
        assert (final.code, final.message) == (FakeError.CANCELLED, "Request was cancelled")
        assert len(sender.ids()) <= 3
        assert_one_final(sender)
        assert wait_for(lambda: model.engine.stats().kv_used_tokens == 0)
    finally:
        model.finalize()


def test_orca_engine_death_fails_pending_and_new_requests_unavailable(pb_utils):
    crash = CrashSwitch()
    model = load("orca", crash, model_transaction_policy={"decoupled": True})
    try:
        warm = ids_request([1], 3)
        model.execute([warm])
        finish(warm)
        crash.throw()
        pending = [ids_request([1, 2], 50), ids_request([3], 50)]
        model.execute(pending)
        for request in pending:
            response, flags = finish(request).sent[-1]
            assert flags == FINAL and response.error.code == FakeError.UNAVAILABLE
        assert wait_for(lambda: pb_utils.unloaded == ["orca"])  # readiness turns false
        late = ids_request([1], 3)
        model.execute([late])
        (response, flags), = finish(late).sent
        assert flags == FINAL and response.error.code == FakeError.UNAVAILABLE
    finally:
        model.finalize()
    for request in (warm, *pending, late):  # finalize() must not answer anything a second time
        assert_one_final(request.sender)


def test_orca_killed_engine_process_fails_every_stream(pb_utils):
    """SIGKILL, not a clean death: the frontend alone notices (the pipe closes) and answers for the core."""
    gate = StepGate()
    model = load("orca", gate, model_transaction_policy={"decoupled": True})
    try:
        streams = [ids_request([1, 2], 100), ids_request([3], 100), ids_request([5, 6, 7], 100)]
        model.execute(streams)
        # Generation under way: iterations let through one at a time until two streams have tokens (the
        # adds reach the core's inbox on its reader thread, so the requests may join over a few steps).
        assert wait_for(lambda: all(r.sender.ids() for r in streams[:2]) or gate.allow(1))
        core = model.engine.core
        os.kill(core.pid, signal.SIGKILL)
        for request in streams:
            response, flags = finish(request).sent[-1]
            assert flags == FINAL and response.error.code == FakeError.UNAVAILABLE
            assert "SIGKILL" in response.error.message
        assert wait_for(lambda: pb_utils.unloaded == ["orca"])
        assert not pid_alive(core.pid)
    finally:
        model.finalize()
    for request in streams:
        assert_one_final(request.sender)


def test_orca_refuses_a_non_decoupled_config(pb_utils):
    with pytest.raises(RuntimeError, match="decoupled"):
        load("orca")


def test_baseline_runs_the_batch_and_fails_only_the_bad_request(pb_utils):
    model = load("baseline", max_batch_size=4)
    try:
        good = [ids_request([1, 2, 3], 12, batched=True), ids_request([9], 5, batched=True)]
        too_long = ids_request([1] * 10, 500, batched=True)  # beyond gpt2-tiny's 256-token context
        responses = model.execute([good[0], too_long, good[1]])
        assert [r.error is None for r in responses] == [True, False, True]
        assert responses[1].error.code == FakeError.INVALID_ARG and "context length" in responses[1].error.message
        for response, prompt, n in ((responses[0], [1, 2, 3], 12), (responses[2], [9], 5)):
            assert response.output("output_ids").shape == (1, n)
            assert response.output("output_ids")[0].tolist() == expected(prompt, n)
        assert not any(r.sender.sent for r in (*good, too_long))  # non-decoupled: answers are returned
        assert model.engine.config.max_num_seqs == 4 and model.engine.config.scheduling == "request"
    finally:
        model.finalize()


def test_baseline_engine_death_answers_unavailable(pb_utils):
    crash = CrashSwitch()
    model = load("baseline", crash, max_batch_size=4)
    try:
        crash.throw()
        responses = model.execute([ids_request([1, 2], 8, batched=True)])
        assert responses[0].error.code == FakeError.UNAVAILABLE
        responses = model.execute([ids_request([1, 2], 8, batched=True)])
        assert responses[0].error.code == FakeError.UNAVAILABLE
    finally:
        model.finalize()


def wait_for(predicate, timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return False


def test_orca_a_schema_that_does_not_compile_is_invalid_arg_while_another_request_completes(pb_utils, tiny_checkpoint):
    """The engine core finds the bad schema (finish_reason "invalid"): the client gets INVALID_ARG with the
    compiler's message, and the request beside it runs on to its exact tokens."""
    gate = StepGate()
    parameters = {**PARAMETERS, "model": {"string_value": str(tiny_checkpoint[0])}}
    model = load("orca", gate, model_transaction_policy={"decoupled": True}, parameters=parameters)

    def step_until(done, progress) -> None:
        """Lets iterations through one at a time (each gives `progress` a token) until `done()`."""
        while not done():
            count = progress()
            gate.allow(1)
            assert wait_for(lambda count=count: done() or progress() > count)

    def structured(constraint: dict) -> np.ndarray:  # as Triton's OpenAI frontend sends it: a JSON string
        fields = {"json": None, "regex": None, "choice": None, "grammar": None, "json_object": None,
                  "disable_any_whitespace": False, "disable_additional_properties": False,
                  "whitespace_pattern": None, "structural_tag": None, "_backend": None, "_backend_was_auto": False}
        text = json.dumps({"temperature": 0, "structured_outputs": json.dumps({**fields, **constraint})})
        return np.array([text.encode()], dtype=np.object_)

    try:
        # The first constrained request imports xgrammar and builds the compiler in the core process.
        warm = ids_request([1, 2], 30, sampling_parameters=structured({"choice": ["yes", "no"]}))
        model.execute([warm])
        step_until(warm.sender.finished.is_set, lambda: len(warm.sender.ids()))
        assert warm.sender.sent[-1][0].output("finish_reason")[0] == b"stop"
        good = ids_request([1, 2, 3], 40)
        bad = ids_request([4, 5], 8, sampling_parameters=structured({"json": {"type": "nope"}}))
        model.execute([good, bad])
        step_until(bad.sender.finished.is_set, lambda: len(good.sender.ids()))
        assert not good.sender.finished.is_set()  # still generating
        (error, flags), = bad.sender.sent
        assert flags == FINAL and error.error.code == FakeError.INVALID_ARG
        assert error.error.message.startswith('invalid json for structured output: Unsupported type "nope"')
        gate.open()
        ours = LLM(str(tiny_checkpoint[0])).generate([[1, 2, 3]], SamplingParams(max_tokens=40, temperature=0))
        assert finish(good).ids() == ours[0].output_ids
        finished = FakeFamily.registry["orca_requests_finished_total"]  # exported by the metrics thread (0.2 s)
        assert wait_for(lambda: sum(m.value for labels, m in finished.items() if ("reason", "invalid") in labels) == 1)
    finally:
        model.finalize()
    for request in (warm, good, bad):
        assert_one_final(request.sender)


@pytest.mark.parametrize("kind", ["orca", "baseline"])
def test_a_text_prompt_is_tokenized_once_and_echoed_as_sent(pb_utils, tiny_checkpoint, monkeypatch, kind):
    """The server tokenizes a text prompt once (LLMEngine.prompt_ids): the echo and the engine use
    those ids, on both models (it was twice with the echo, three times on the baseline)."""
    from orca_backend.tokenizer import Tokenizer

    calls: list[str] = []
    encode = Tokenizer.encode
    monkeypatch.setattr(Tokenizer, "encode", lambda self, text: calls.append(text) or encode(self, text))
    parameters = {"model": {"string_value": str(tiny_checkpoint[0])}, "kv_capacity_tokens": {"string_value": "2048"}}
    config = {"model_transaction_policy": {"decoupled": True}} if kind == "orca" else {"max_batch_size": 2}
    model = load(kind, parameters=parameters, **config)
    text = "hello world"
    tensors = {"text_input": np.array([text.encode()], dtype=np.object_), "max_tokens": np.array([4], dtype=np.int32),
               "exclude_input_in_output": np.array([False])}  # fmt: skip
    if kind == "baseline":
        tensors = {k: v[np.newaxis] for k, v in tensors.items()}
    request = FakeRequest('{"temperature": 0}', **tensors)
    try:
        calls.clear()  # the model's own start-up may tokenize (the chat template, the vocabulary check)
        responses = model.execute([request])
        final = finish(request).sent[-1][0] if kind == "orca" else responses[0]
        assert final.error is None
        assert calls == [text]
        assert final.output("text_output").reshape(-1)[0].decode().startswith(text)  # the prompt echoed as sent
    finally:
        model.finalize()
