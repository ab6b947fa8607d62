"""Triton's vLLM-backend contract (docs/vllm-backend-contract.md), without a server: which outputs a
request gets, prompt echo, finish reasons, per-response counts, logprobs JSON, dtypes, and the
config.pbtxt files that declare it. test_serving.py checks the same over gRPC on a real server."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from orca_backend.engine.output_processor import Logprob, RequestOutput
from orca_backend.messages import FinishReason
from orca_backend.server.protocol import (
    ALWAYS_SENT,
    OUTPUT_NAMES,
    RETURN_INPUTS,
    STREAMING_ECHO_REFUSED,
    error_code,
    parse_inputs,
    request_failure,
    response_builder,
)

REPO = Path(__file__).resolve().parents[2] / "model_repository"
PROMPT = [5, 6, 7]


class CharTokenizer:
    """One token per character: enough to see what the echo prepends."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)


def flag(value: bool) -> np.ndarray:
    return np.array([value], dtype=np.bool_)


def parse(stream: bool | None = None, exclude: bool | None = None, sampling: dict | None = None, **returns: bool):
    tensors = {"input_ids": np.array(PROMPT, dtype=np.int32)}
    if stream is not None:
        tensors["stream"] = flag(stream)
    if exclude is not None:
        tensors["exclude_input_in_output"] = flag(exclude)
    if sampling is not None:
        tensors["sampling_parameters"] = np.array([json.dumps(sampling).encode()], dtype=np.object_)
    tensors.update({name: flag(value) for name, value in returns.items()})
    return parse_inputs(tensors)


def event(new_ids: list[int], n_out: int, finished: bool = False, reason: str | None = None,
          logprobs: list[dict[int, Logprob]] | None = None, cumulative: float | None = None) -> RequestOutput:
    finish_reason = None if reason is None else FinishReason(reason)  # as the engine reports it
    return RequestOutput("r", new_ids, "".join(chr(i) for i in new_ids), finished, finish_reason, len(PROMPT), n_out, 0.0,
                         logprobs=logprobs, cumulative_logprob=cumulative)  # fmt: skip


ALL_RETURNS = {name: True for name in RETURN_INPUTS}


# ---- which outputs ----------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(RETURN_INPUTS))
@pytest.mark.parametrize("value", [None, False, True])
def test_each_optional_output_is_sent_only_when_its_return_input_is_true(name, value):
    parsed = parse(**({} if value is None else {name: value}))
    expected = ALWAYS_SENT + ((RETURN_INPUTS[name],) if value else ())
    assert parsed.outputs == expected
    builder = response_builder(parsed, list(PROMPT), CharTokenizer(), stream=True)
    builder.add(event([65], 1, finished=True, reason="length"))
    assert set(builder.flush()) == set(expected)


def test_return_inputs_must_be_bools():
    with pytest.raises(ValueError, match="return_logprobs must be a BOOL"):
        parse_inputs({"input_ids": np.array(PROMPT, dtype=np.int32), "return_logprobs": np.array([1], np.int32)})


# ---- prompt echo ------------------------------------------------------------------------------
@pytest.mark.parametrize(("stream", "exclude", "echoed"), [
    (False, None, True), (False, False, True), (False, True, False),
    (True, None, False), (True, True, False),
])
def test_prompt_echo_follows_the_vllm_backend(stream, exclude, echoed):
    parsed = parse(stream=stream, exclude=exclude, **ALL_RETURNS)
    builder = response_builder(parsed, list(PROMPT), CharTokenizer(), stream=stream)
    builder.add(event([65], 1))
    builder.add(event([66], 2, finished=True, reason="length"))
    arrays = builder.flush()
    prefix = "".join(chr(i) for i in PROMPT) if echoed else ""
    assert arrays["text_output"][0].decode().endswith("AB") and arrays["text_output"][0].decode()[:-2] == prefix
    assert arrays["output_ids"].tolist()[:-2] == (PROMPT if echoed else [])
    assert int(arrays["num_output_tokens"][0]) == 2  # the echo is not counted as output


def test_a_stream_refuses_exclude_input_in_output_false_with_the_vllm_message():
    assert STREAMING_ECHO_REFUSED == ("Error generating stream: When streaming, `exclude_input_in_output` = False "
                                      "is not allowed.")
    with pytest.raises(ValueError, match=re.escape(STREAMING_ECHO_REFUSED)):
        response_builder(parse(stream=True, exclude=False), list(PROMPT), CharTokenizer(), stream=True)


def test_the_baseline_answers_once_so_a_stream_flag_does_not_refuse_the_echo():
    # The baseline builds every answer with stream=False, whatever the request's `stream` says.
    builder = response_builder(parse(stream=True, exclude=False), list(PROMPT), CharTokenizer(), stream=False)
    assert builder.prefix_ids == PROMPT


@pytest.mark.parametrize("stream", [True, False])
def test_the_default_echo_follows_the_clients_stream_flag_on_both_models(stream):
    """exclude_input_in_output unset: orca (streaming as asked) and the baseline (answering once)
    echo the prompt alike, only when the client did not ask for a stream."""
    orca = response_builder(parse(stream=stream), list(PROMPT), CharTokenizer(), stream=stream)
    baseline = response_builder(parse(stream=stream), list(PROMPT), CharTokenizer(), stream=False, batched=True)
    assert orca.prefix_ids == baseline.prefix_ids == ([] if stream else PROMPT)


# ---- finish reasons, counts, logprobs --------------------------------------------------------
def test_a_stream_says_none_until_the_last_response_and_its_counts_sum_to_the_total():
    builder = response_builder(parse(stream=True, **ALL_RETURNS), list(PROMPT), CharTokenizer(), stream=True)
    reasons, counts, inputs = [], [], []
    for tokens, total, finished in [([65], 1, False), ([66, 67], 3, False), ([68], 4, True)]:
        builder.add(event(tokens, total, finished=finished, reason="stop" if finished else None))
        arrays = builder.flush()
        reasons.append(arrays["finish_reason"][0].decode())
        counts.append(int(arrays["num_output_tokens"][0]))
        inputs.append(int(arrays["num_input_tokens"][0]))
    assert reasons == ["None", "None", "stop"]
    assert counts == [1, 2, 1] and sum(counts) == 4
    assert inputs == [3, 3, 3]  # repeated on every response


def test_a_cancelled_answer_says_abort_and_a_cancelled_stream_ends_in_a_cancelled_error():
    once = response_builder(parse(return_finish_reason=True), list(PROMPT), CharTokenizer(), stream=False)
    once.add(event([65], 1, finished=True, reason="cancelled"))
    assert once.error is None and once.flush()["finish_reason"][0] == b"abort"
    streamed = response_builder(parse(stream=True), list(PROMPT), CharTokenizer(), stream=True)
    streamed.add(event([65], 1, finished=True, reason="cancelled"))
    assert streamed.error == "Request was cancelled"
    code, message = error_code(request_failure(streamed.error, True, streamed.finish_reason))
    assert (code, message) == ("CANCELLED", "Request was cancelled")


def test_logprobs_json_is_one_dict_per_token_keyed_by_id_strings():
    parsed = parse(stream=True, sampling={"logprobs": 1}, **ALL_RETURNS)
    builder = response_builder(parsed, list(PROMPT), CharTokenizer(), stream=True)
    first = {65: Logprob(-0.5, 1, "A"), 70: Logprob(-1.5, 2, "F")}
    second = {66: Logprob(-2.0, 3, "B"), 71: Logprob(-0.25, 1, "G")}
    builder.add(event([65], 1, logprobs=[first], cumulative=-0.5))
    builder.add(event([66], 2, logprobs=[second], cumulative=-2.5))  # merged into one response
    arrays = builder.flush()
    assert json.loads(arrays["logprobs"][0]) == [
        {"65": {"logprob": -0.5, "rank": 1, "decoded_token": "A"}, "70": {"logprob": -1.5, "rank": 2, "decoded_token": "F"}},
        {"66": {"logprob": -2.0, "rank": 3, "decoded_token": "B"}, "71": {"logprob": -0.25, "rank": 1, "decoded_token": "G"}},
    ]  # fmt: skip
    assert arrays["cumulative_logprob"].dtype == np.float32 and float(arrays["cumulative_logprob"][0]) == -2.5
    builder.add(event([67], 3, finished=True, reason="length", logprobs=[{67: Logprob(-1.0, 1, "C")}], cumulative=-3.5))
    arrays = builder.flush()
    assert len(json.loads(arrays["logprobs"][0])) == 1  # a delta, like the text
    assert float(arrays["cumulative_logprob"][0]) == -3.5  # a running total


def test_logprobs_say_null_unless_the_logprobs_parameter_was_set():
    builder = response_builder(parse(return_logprobs=True, return_cumulative_logprob=True), list(PROMPT), CharTokenizer(),
                               stream=False)  # fmt: skip
    builder.add(event([65], 1, finished=True, reason="length"))
    arrays = builder.flush()
    assert arrays["logprobs"][0] == b"null"
    assert math.isnan(float(arrays["cumulative_logprob"][0]))  # not computed: NaN, as vLLM v1 sends


def test_prompt_logprobs_go_out_once_with_the_first_token_null_first():
    """One entry per prompt token, null for the first; a stream sends them with its first response
    and "null" after; a request that did not ask gets "null"."""
    parsed = parse(stream=True, sampling={"prompt_logprobs": 1}, return_prompt_logprobs=True)
    builder = response_builder(parsed, list(PROMPT), CharTokenizer(), stream=True)
    first = event([65], 1)
    first.prompt_logprobs = [None] + [{t: Logprob(-0.5 * t, 2, chr(t)), 1: Logprob(-0.1, 1, "x")} for t in PROMPT[1:]]
    builder.add(first)
    sent = json.loads(builder.flush()["prompt_logprobs"][0])
    assert len(sent) == len(PROMPT) and sent[0] is None
    assert sent[1] == {str(PROMPT[1]): {"logprob": -0.5 * PROMPT[1], "rank": 2, "decoded_token": chr(PROMPT[1])},
                       "1": {"logprob": -0.1, "rank": 1, "decoded_token": "x"}}  # fmt: skip
    builder.add(event([66], 2, finished=True, reason="length"))
    assert builder.flush()["prompt_logprobs"][0] == b"null"
    plain = response_builder(parse(return_prompt_logprobs=True), list(PROMPT), CharTokenizer(), stream=False)
    plain.add(event([65], 1, finished=True, reason="length"))
    assert plain.flush()["prompt_logprobs"][0] == b"null"


def test_n_samples_send_one_element_each_and_count_every_samples_tokens():
    from orca_backend.server.metrics import observations
    from orca_backend.server.protocol import finished_request

    returns = {"return_finish_reason": True, "return_num_output_tokens": True, "return_num_input_tokens": True}
    builder = response_builder(parse(stream=True, sampling={"n": 2}, **returns), list(PROMPT), CharTokenizer(),
                               stream=True)  # fmt: skip

    def sample_event(index: int, ids: list[int], n_out: int, **kw) -> RequestOutput:
        out = event(ids, n_out, **kw)
        out.index = index
        return out

    builder.add(sample_event(1, [65], 1))
    assert builder.ready
    first = builder.flush()
    assert first["text_output"].tolist() == [b"", b"A"] and first["output_ids"].tolist() == [65]
    assert first["num_output_tokens"].tolist() == [0, 1] and first["num_input_tokens"].tolist() == [len(PROMPT)]
    assert first["finish_reason"].tolist() == [b"None", b"None"]
    builder.add(sample_event(1, [66], 2, finished=True, reason="length"))
    assert not builder.finished
    builder.add(sample_event(0, [67, 68], 2))
    middle = builder.flush()
    assert middle["output_ids"].tolist() == [67, 68, 66] and middle["finish_reason"].tolist() == [b"None", b"length"]
    builder.add(sample_event(0, [69], 3, finished=True, reason="stop"))
    assert builder.finished and builder.error is None
    last = builder.flush()
    assert last["finish_reason"].tolist() == [b"stop", b"length"] and last["num_output_tokens"].tolist() == [1, 0]
    finished = finished_request(builder)
    assert (finished.n, finished.num_output_tokens) == (2, 5)
    assert observations(finished)["vllm:request_params_n"] == 2


def test_n_samples_end_with_the_failed_samples_error_not_a_cancelled_ones():
    builder = response_builder(parse(stream=True, sampling={"n": 2}), list(PROMPT), CharTokenizer(), stream=True)
    cancelled, failed = event([], 0, finished=True, reason="cancelled"), event([], 0, finished=True, reason="error")
    failed.index, failed.error = 1, "model execution failed: boom"
    builder.add(cancelled)  # sample 0, cancelled by the engine because sample 1 failed
    builder.add(failed)
    assert builder.finished and builder.error == "model execution failed: boom"
    assert builder.finish_reason is FinishReason.ERROR


def test_output_dtypes_are_the_vllm_backends():
    builder = response_builder(parse(**ALL_RETURNS), list(PROMPT), CharTokenizer(), stream=False)
    builder.add(event([65], 1, finished=True, reason="length"))
    dtypes = {name: array.dtype for name, array in builder.flush().items()}
    assert dtypes == {"text_output": np.object_, "output_ids": np.int32, "finish_reason": np.object_,
                      "cumulative_logprob": np.float32, "logprobs": np.object_, "num_input_tokens": np.uint32,
                      "num_output_tokens": np.uint32, "prompt_logprobs": np.object_}  # fmt: skip


# ---- the repository declares it ---------------------------------------------------------------
VLLM_TYPES = {"text_output": "TYPE_STRING", "finish_reason": "TYPE_STRING", "cumulative_logprob": "TYPE_FP32",
              "logprobs": "TYPE_STRING", "num_input_tokens": "TYPE_UINT32", "num_output_tokens": "TYPE_UINT32",
              "output_ids": "TYPE_INT32", "prompt_logprobs": "TYPE_STRING"}  # fmt: skip
# return_perf_metrics' outputs (TensorRT-LLM's names for the times).
PERF_TYPES = {"arrival_time_ns": "TYPE_INT64", "first_scheduled_time_ns": "TYPE_INT64",
              "first_token_time_ns": "TYPE_INT64", "last_token_time_ns": "TYPE_INT64",
              "num_preemptions": "TYPE_UINT32", "prefix_cache_hit_tokens": "TYPE_UINT32",
              "num_draft_tokens": "TYPE_UINT32", "num_accepted_draft_tokens": "TYPE_UINT32"}  # fmt: skip


@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_both_configs_declare_the_contract_with_its_types(model):
    config = (REPO / model / "config.pbtxt").read_text()
    declared = dict(re.findall(r'\{ name: "(\w+)", data_type: (TYPE_\w+)', config))
    for name in (*RETURN_INPUTS, "return_perf_metrics"):
        assert declared[name] == "TYPE_BOOL"
    assert {name: declared[name] for name in OUTPUT_NAMES} == VLLM_TYPES | PERF_TYPES


def test_histogram_observations_of_a_request_leave_out_the_moments_that_never_came():
    from orca_backend.messages import RequestMetrics
    from orca_backend.server.metrics import FinishedRequest, observations, one_two_five_buckets

    served = observations(FinishedRequest(FinishReason.LENGTH, RequestMetrics(10.0, 10.5, 1, 16, 11.0, 13.0), 20, 5))
    assert served == pytest.approx({
        "vllm:request_prompt_tokens": 20, "vllm:request_generation_tokens": 5, "vllm:request_params_n": 1,
        "orca_request_preemptions": 1, "vllm:e2e_request_latency_seconds": 3.0,
        "vllm:time_to_first_token_seconds": 1.0, "vllm:time_per_output_token_seconds": 0.5,
        "vllm:request_decode_time_seconds": 2.0, "vllm:request_queue_time_seconds": 0.5,
        "vllm:request_prefill_time_seconds": 0.5, "vllm:request_inference_time_seconds": 2.5,
    })  # fmt: skip
    # Cancelled while queued: no token, never scheduled: counts only.
    queued = observations(FinishedRequest(FinishReason.CANCELLED, RequestMetrics(10.0, None, 0, 0), 20, 0))
    assert set(queued) == {"vllm:request_prompt_tokens", "vllm:request_generation_tokens", "vllm:request_params_n",
                           "orca_request_preemptions"}  # fmt: skip
    assert one_two_five_buckets(1024) == [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
