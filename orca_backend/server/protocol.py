"""The request/response contract of the `orca` and `baseline` models, in one place (docs/architecture.md).

Parsing works on plain numpy arrays and dicts so it is unit-testable without Triton; the adapters
only collect a request's tensors (`read_request`) and wrap the arrays built here into responses.
Every parse problem is a ValueError whose message tells the client what to send instead.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import check_priority, check_timeout
from orca_backend.engine.output_processor import RequestOutput
from orca_backend.messages import EngineDeadError, EngineOverloadedError, FinishReason, RequestMetrics
from orca_backend.sampling_params import PoolingParams, SamplingParams, loads_client_json, parse_sampling_json
from orca_backend.server.metrics import FinishedRequest

# Triton's vLLM backend sends these outputs only when the request's input of the same name is true
# (docs/vllm-backend-contract.md); text_output, and this project's output_ids, are always sent.
# return_prompt_logprobs is this project's, in the same style (the vLLM backend has no prompt logprobs).
RETURN_INPUTS = {
    "return_finish_reason": "finish_reason",
    "return_cumulative_logprob": "cumulative_logprob",
    "return_logprobs": "logprobs",
    "return_num_input_tokens": "num_input_tokens",
    "return_num_output_tokens": "num_output_tokens",
    "return_prompt_logprobs": "prompt_logprobs",
}
# `return_perf_metrics` (TensorRT-LLM's name) switches on the request's timeline and counts, in its
# final response only: times in ns on the server host's CLOCK_MONOTONIC (time.monotonic_ns(), as
# TensorRT-LLM's steady clock), -1 where a moment never came (a request that ended before it was
# scheduled, or without a token).
PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "num_preemptions", "prefix_cache_hit_tokens", "num_draft_tokens", "num_accepted_draft_tokens")
INPUT_NAMES = ("text_input", "input_ids", "max_tokens", "sampling_parameters", "stream", "exclude_input_in_output",
               *RETURN_INPUTS, "return_perf_metrics", "embedding_request")
# The inputs an embedding request may come with (the vLLM backend reads no other).
EMBEDDING_INPUTS = frozenset({"embedding_request", "return_num_input_tokens", "return_num_output_tokens"})
ALWAYS_SENT = ("text_output", "output_ids")
OUTPUT_NAMES = (*ALWAYS_SENT, *RETURN_INPUTS.values(), *PERF_OUTPUTS)
# The engine's finish reasons as the contract names them (the others end in an error response).
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.CANCELLED: "abort"}
NOT_FINISHED = "None"  # finish_reason of every response but the last (vLLM's str(None))
# The vLLM backend's words, with the prefix its errors carry.
STREAMING_ECHO_REFUSED = "Error generating stream: When streaming, `exclude_input_in_output` = False is not allowed."
CANCELLED_MESSAGE = "Request was cancelled"
_SAMPLING_KEYS = frozenset(f.name for f in fields(SamplingParams))


@dataclass
class ParsedRequest:
    prompt: str | list[int]
    params: SamplingParams
    stream: bool = False
    # The `exclude_input_in_output` input, None when not sent: then the prompt is echoed in a
    # non-streaming answer and not in a stream (Triton's vLLM backend).
    exclude_input: bool | None = None
    # The outputs to build: those always sent plus those a `return_*` input switched on, less any the
    # client did not request (Triton lists every output when a client names none). A response's cost
    # in the stub grows with its tensors.
    outputs: tuple[str, ...] = ALWAYS_SENT
    # Request parameter `scheduling_priority`, lower served first (Triton reserves `priority` for its
    # own request field, which the Python backend cannot read).
    priority: int = 0
    timeout_s: float | None = None  # request parameter `timeout_s`, or Triton's request timeout
    # An embedding request (the `embedding_request` input, as Triton's OpenAI frontend sends it for
    # /v1/embeddings): its prompt is pooled into one vector, sent as JSON in text_output.
    pooling: PoolingParams | None = None


def parse_inputs(
    tensors: Mapping[str, np.ndarray | None],
    parameters: Mapping[str, Any] | str | None = None,
    batched: bool = False,
    max_request_bytes: int = 0,
    triton_timeout_us: int = 0,
    max_priority: int = EngineConfig.max_priority,
) -> ParsedRequest:
    """Validates one request's input tensors and its request-level parameters.

    `batched`: the model has max_batch_size > 0 (baseline), so every tensor carries a leading
    batch dimension, which must be 1 (one prompt per request).
    Sampling values are merged with this precedence: the `max_tokens` input, then the
    `sampling_parameters` JSON, then request parameters (HTTP generate's top-level keys).
    `max_request_bytes` (0: none) bounds the size of the tensors and the request parameters (where a
    client may send `structured_outputs` or `stop` too) before anything is decoded or tokenized.
    The request's timeout is the shorter of its `timeout_s` parameter and Triton's request
    timeout (`triton_timeout_us`, 0 when the client set none).
    """
    present = {name: np.asarray(value) for name, value in tensors.items() if value is not None}
    size = sum(_num_bytes(value) for value in present.values()) + _parameters_bytes(parameters)
    if max_request_bytes and size > max_request_bytes:
        raise ValueError(f"the request's inputs and parameters hold {size} bytes, more than this deployment's "
                         f"max_request_bytes of {max_request_bytes}")  # fmt: skip
    arrays = {name: _unbatch(name, value, batched) for name, value in present.items()}
    unknown = sorted(set(arrays) - set(INPUT_NAMES))
    if unknown:
        raise ValueError(f"unknown input(s) {', '.join(unknown)}; inputs are {', '.join(INPUT_NAMES)}")

    if "embedding_request" in arrays:
        return _parse_embedding_request(arrays)
    prompt = _parse_prompt(arrays.get("text_input"), arrays.get("input_ids"))

    request_parameters = _parameters_dict(parameters)
    values: dict[str, Any] = {k: v for k, v in request_parameters.items() if k in _SAMPLING_KEYS}
    if "sampling_parameters" in arrays:
        values.update(parse_sampling_json(_scalar_string("sampling_parameters", arrays["sampling_parameters"])))
    if "max_tokens" in arrays:
        values["max_tokens"] = _scalar_int("max_tokens", arrays["max_tokens"])
    params = SamplingParams.from_dict(values)  # ValueError with the offending key and value

    stream = _scalar_bool("stream", arrays["stream"]) if "stream" in arrays else False
    exclude = _scalar_bool("exclude_input_in_output", arrays["exclude_input_in_output"]) \
        if "exclude_input_in_output" in arrays else None
    returned = _returned_outputs(arrays)
    if "return_perf_metrics" in arrays and _scalar_bool("return_perf_metrics", arrays["return_perf_metrics"]):
        returned += PERF_OUTPUTS
    priority = _parameter_int("scheduling_priority", request_parameters.get("scheduling_priority", 0))
    check_priority(priority, max_priority)
    timeouts = [t / 1e6 for t in (triton_timeout_us,) if t]
    if "timeout_s" in request_parameters:
        timeout_s = _parameter_float("timeout_s", request_parameters["timeout_s"])
        check_timeout(timeout_s)
        timeouts.append(timeout_s)
    return ParsedRequest(prompt=prompt, params=params, stream=stream, exclude_input=exclude,
                         outputs=ALWAYS_SENT + returned, priority=priority,
                         timeout_s=min(timeouts) if timeouts else None)  # fmt: skip


def _parse_embedding_request(arrays: Mapping[str, np.ndarray]) -> ParsedRequest:
    """The vLLM backend's `embedding_request`: JSON {"input": a string or token ids, "pooling_params":
    {"dimensions": [d]}} (the OpenAI frontend's shape; a bare d is taken too)."""
    others = sorted(set(arrays) - EMBEDDING_INPUTS)
    if others:
        raise ValueError(f"an embedding_request takes no {', '.join(others)}: the prompt and its pooling are in its JSON")
    text = _scalar_string("embedding_request", arrays["embedding_request"])
    request = loads_client_json(text, "embedding_request", '{"input": "some text", "pooling_params": {}}')
    if not isinstance(request, dict) or "input" not in request:
        raise ValueError('embedding_request must be a JSON object with "input" (a string or a list of token ids)')
    prompt = request["input"]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        prompt = _parse_prompt(None, np.array(prompt, dtype=np.int64))
    elif not isinstance(prompt, str) or not prompt:
        raise ValueError("embedding_request input must be a non-empty string or a list of token ids (one prompt)")
    pooling_params = request.get("pooling_params") or {}
    if not isinstance(pooling_params, dict) or set(pooling_params) - {"dimensions"}:
        raise ValueError(f"embedding_request pooling_params takes dimensions only, got {pooling_params!r}")
    dims = pooling_params.get("dimensions")
    if isinstance(dims, list):
        if len(dims) != 1:
            raise ValueError(f"pooling_params.dimensions must hold one size, got {dims!r}")
        dims = dims[0]
    return ParsedRequest(prompt=prompt, params=SamplingParams(max_tokens=1), exclude_input=True,
                         outputs=ALWAYS_SENT + _returned_outputs(arrays), pooling=PoolingParams(dimensions=dims))  # fmt: skip


def _returned_outputs(arrays: Mapping[str, np.ndarray]) -> tuple[str, ...]:
    """The optional outputs whose `return_*` input the request set true."""
    return tuple(output for flag, output in RETURN_INPUTS.items() if flag in arrays and _scalar_bool(flag, arrays[flag]))


def _parameters_bytes(parameters: Mapping[str, Any] | str | None) -> int:
    """The request parameters' size: Triton hands them over as one JSON string."""
    if not parameters:
        return 0
    text = parameters if isinstance(parameters, str) else json.dumps(dict(parameters), default=str)
    return len(text.encode("utf-8", "surrogatepass"))


def _num_bytes(value: np.ndarray) -> int:
    if value.dtype == np.object_:  # BYTES tensors: the strings' lengths
        return sum(len(item) if isinstance(item, bytes | str) else 8 for item in value.reshape(-1))
    return value.nbytes


def _parameter_int(name: str, raw: Any) -> int:
    """A request parameter that must be an integer (gRPC sends int64, HTTP JSON numbers or strings)."""
    if isinstance(raw, str):
        raw = raw.strip()
        if raw.lstrip("+-").isdigit():
            return int(raw)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        return raw
    raise ValueError(f"request parameter {name} must be an integer, got {raw!r}")


def _parameter_float(name: str, raw: Any) -> float:
    if not isinstance(raw, bool):
        try:
            return float(raw)
        except (TypeError, ValueError):
            pass
    raise ValueError(f"request parameter {name} must be a number, got {raw!r}")


def _unbatch(name: str, value: np.ndarray, batched: bool) -> np.ndarray:
    value = np.asarray(value)
    if not batched:
        return value
    if value.ndim == 0 or value.shape[0] != 1:
        raise ValueError(f"{name}: send one prompt per request (batch dimension 1), got shape {list(value.shape)}")
    return value[0]


def _parse_prompt(text: np.ndarray | None, ids: np.ndarray | None) -> str | list[int]:
    if text is not None and ids is not None:
        raise ValueError("send either text_input or input_ids, not both")
    if text is None and ids is None:
        raise ValueError("no prompt: send text_input (a string) or input_ids (INT32 token ids)")
    if text is not None:
        prompt = _scalar_string("text_input", text)
        if not prompt:
            raise ValueError("text_input is empty; send a non-empty prompt")
        return prompt
    assert ids is not None
    if not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"input_ids must be INT32 token ids, got {ids.dtype}")
    flat = ids.reshape(-1)
    if flat.size == 0:
        raise ValueError("input_ids is empty; send at least one token id")
    if (flat < 0).any():
        raise ValueError(f"input_ids must be non-negative token ids, got {int(flat.min())}")
    return [int(t) for t in flat]


def _single(name: str, value: np.ndarray) -> Any:
    if value.size != 1:
        raise ValueError(f"{name} must hold exactly one element, got shape {list(value.shape)}")
    return value.reshape(-1)[0]


def _scalar_string(name: str, value: np.ndarray) -> str:
    item = _single(name, value)
    if isinstance(item, bytes | np.bytes_):
        try:
            return bytes(item).decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{name} is not valid UTF-8") from None
    if isinstance(item, str):
        return item
    raise ValueError(f"{name} must be a string (TYPE_STRING/BYTES), got {value.dtype}")


def _scalar_int(name: str, value: np.ndarray) -> int:
    if not np.issubdtype(value.dtype, np.integer) or value.dtype == np.bool_:
        raise ValueError(f"{name} must be an INT32, got {value.dtype}")
    return int(_single(name, value))


def _scalar_bool(name: str, value: np.ndarray) -> bool:
    if value.dtype != np.bool_:
        raise ValueError(f"{name} must be a BOOL, got {value.dtype}")
    return bool(_single(name, value))


def _parameters_dict(parameters: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """Request parameters: Triton's Python backend hands them over as a JSON string.

    Keys that are not sampling parameters are ignored: Triton and its clients add their own
    (e.g. gRPC's triton_enable_empty_final_response), so strictness here would break them.
    """
    if parameters is None:
        return {}
    if isinstance(parameters, str):
        if not parameters.strip():
            return {}
        try:
            parameters = json.loads(parameters)
        except json.JSONDecodeError:
            return {}
        except RecursionError:
            raise ValueError("the request parameters are nested too deeply to parse") from None
    return dict(parameters) if isinstance(parameters, Mapping) else {}


@dataclass
class ResponseBuilder:
    """Turns a request's engine events into response payloads (numpy arrays by output name).

    Streaming: each flush holds what is new since the previous one (several events may be merged
    when responses fall behind the engine): text, ids, logprobs and `num_output_tokens` are deltas,
    `num_input_tokens` and `cumulative_logprob` are repeated whole, `finish_reason` is "None"
    until the last, and the prompt logprobs go out once, with the first token ("null" after). The first flush also carries the prompt when it is echoed. After the first
    token, a flush waits for `stream_interval` new tokens (or the end): fewer, larger responses,
    each costing the stub and tritonserver the same. Non-streaming: one payload holding
    everything, ready once the request finished.
    """

    stream: bool
    prefix_ids: list[int] = field(default_factory=list)  # the prompt, when it is echoed
    prefix_text: str = ""
    batched: bool = False
    outputs: tuple[str, ...] = ALWAYS_SENT
    stream_interval: int = 1
    wants_logprobs: bool = False  # the `logprobs` sampling parameter was set ("null" is sent otherwise)
    lora_name: str | None = None  # the request's LoRA adapter (for the metrics)
    num_input_tokens: int = 0
    num_output_tokens: int = 0  # generated so far
    cumulative_logprob: float | None = None
    finished: bool = False
    finish_reason: FinishReason | None = None  # the engine's
    error: str | None = None  # the request ends in an error response with this message
    request_metrics: RequestMetrics | None = None  # from the final event
    _ids: list[int] = field(default_factory=list)
    _text: list[str] = field(default_factory=list)
    _logprobs: list[dict[int, Any]] = field(default_factory=list)
    _prompt_logprobs: list[dict[int, Any] | None] | None = None  # until a flush sends them
    _num_output_sent: int = 0
    _first_sent: bool = False

    def add(self, event: RequestOutput) -> None:
        self._ids.extend(event.new_token_ids)
        if event.new_text:
            self._text.append(event.new_text)
        if event.logprobs is not None:
            self._logprobs.extend(event.logprobs)
        if event.prompt_logprobs is not None:
            self._prompt_logprobs = event.prompt_logprobs
        if event.embedding is not None:  # an embedding request's one answer: the vector as JSON, as vLLM's
            self._text.append(json.dumps(event.embedding))
        if event.cumulative_logprob is not None:
            self.cumulative_logprob = event.cumulative_logprob
        self.num_input_tokens = event.num_input_tokens
        self.num_output_tokens = event.num_output_tokens
        if event.finished:
            self.finished = True
            self.finish_reason = event.finish_reason
            self.request_metrics = event.metrics
            if event.finish_reason in (FinishReason.ERROR, FinishReason.TIMEOUT, FinishReason.INVALID):
                self.error = event.error or "the engine failed this request"
            elif event.finish_reason is FinishReason.CANCELLED and self.stream:
                self.error = CANCELLED_MESSAGE  # a cancelled stream ends in a CANCELLED error, as in vLLM's

    @property
    def ready(self) -> bool:
        """Whether a flush has something to send now."""
        if self.finished:
            return True
        if not self.stream:
            return False
        if not self._first_sent:  # the first token goes out at once: time to first token is not traded
            return bool(self._ids or self._text)
        return len(self._ids) >= self.stream_interval

    def flush(self) -> dict[str, np.ndarray]:
        ids, text = self._ids, "".join(self._text)
        if not self._first_sent:
            ids, text = self.prefix_ids + ids, self.prefix_text + text
            self._first_sent = True
        logprobs = self._logprobs if self.wants_logprobs else None
        prompt_logprobs = self._prompt_logprobs
        self._ids, self._text, self._logprobs, self._prompt_logprobs = [], [], [], None
        new_tokens, self._num_output_sent = self.num_output_tokens - self._num_output_sent, self.num_output_tokens
        reason = FINISH_REASONS.get(self.finish_reason, str(self.finish_reason)) if self.finished else NOT_FINISHED
        # The perf metrics are known at the end only: a stream's earlier responses go without them.
        names = self.outputs if self.finished else tuple(n for n in self.outputs if n not in PERF_OUTPUTS)
        return output_arrays(ids, text, reason, self.num_input_tokens, new_tokens, self.batched, names,
                             cumulative_logprob=self.cumulative_logprob, logprobs=logprobs,
                             prompt_logprobs=prompt_logprobs, metrics=self.request_metrics)


@dataclass
class SamplesResponseBuilder:
    """A request with n > 1: one ResponseBuilder per sample (events go to the one of their `index`),
    and every payload holds one element per sample in each output, in sample order, as the vLLM
    backend's do: `num_input_tokens` alone is the request's one value, and `output_ids` (ours) holds
    the samples' ids one after the other (`num_output_tokens` splits them). A stream sends a payload
    when any sample has something new (the others' elements are empty, a finished one's
    `finish_reason` repeated); the request ends when every sample has, in an error if any failed."""

    samples: list[ResponseBuilder]

    def add(self, event: RequestOutput) -> None:
        self.samples[event.index].add(event)

    @property
    def finished(self) -> bool:
        return all(sample.finished for sample in self.samples)

    @property
    def ready(self) -> bool:
        return self.finished or any(sample.ready for sample in self.samples)

    @property
    def error(self) -> str | None:
        failed = self._failed()
        return None if failed is None else failed.error

    @property
    def finish_reason(self) -> FinishReason | None:
        return (self._failed() or self.samples[0]).finish_reason

    def _failed(self) -> ResponseBuilder | None:
        """The sample whose error the request ends with: one that failed, before the samples the
        engine cancelled because of it (a stream's cancelled samples carry an error too)."""
        errors = [sample for sample in self.samples if sample.error is not None]
        return next((s for s in errors if s.finish_reason is not FinishReason.CANCELLED), errors[0] if errors else None)

    def flush(self) -> dict[str, np.ndarray]:
        payloads = [sample.flush() for sample in self.samples]
        merged = {name: np.concatenate([payload[name] for payload in payloads], axis=-1) for name in payloads[0]}
        if "num_input_tokens" in merged:  # the prompt's length, known once any sample had an event
            merged["num_input_tokens"] = np.maximum.reduce([payload["num_input_tokens"] for payload in payloads])
        return merged

    def finished_request(self) -> FinishedRequest:
        """The request's account for the metrics: its samples' tokens together, from its arrival to
        its last sample's last token."""
        first, metrics = self.samples[0], [s.request_metrics for s in self.samples if s.request_metrics is not None]
        merged = None
        if metrics:
            scheduled = [m.first_scheduled_time for m in metrics if m.first_scheduled_time is not None]
            first_tokens = [m.first_token_time for m in metrics if m.first_token_time is not None]
            last_tokens = [m.last_token_time for m in metrics if m.last_token_time is not None]
            merged = RequestMetrics(metrics[0].arrival_time, min(scheduled, default=None),
                                    sum(m.num_preemptions for m in metrics), metrics[0].num_cached_tokens,
                                    min(first_tokens, default=None), max(last_tokens, default=None),
                                    sum(m.num_draft_tokens for m in metrics),
                                    sum(m.num_accepted_tokens for m in metrics))  # fmt: skip
        return FinishedRequest(self.finish_reason, merged, first.num_input_tokens,
                               sum(s.num_output_tokens for s in self.samples), first.lora_name, len(self.samples))  # fmt: skip


def finished_request(builder: ResponseBuilder | SamplesResponseBuilder) -> FinishedRequest:
    """What a finished request's builder holds for the metrics."""
    if isinstance(builder, SamplesResponseBuilder):
        return builder.finished_request()
    return FinishedRequest(builder.finish_reason, builder.request_metrics, builder.num_input_tokens,
                           builder.num_output_tokens, builder.lora_name)  # fmt: skip


def response_builder(request: ParsedRequest, prompt_ids: list[int], tokenizer: Any, *, stream: bool,
                     batched: bool = False, stream_interval: int = 1) -> ResponseBuilder | SamplesResponseBuilder:
    """The builder for one parsed request, `stream` saying whether it is answered as a stream;
    `prompt_ids` are its prompt's ids (LLMEngine.prompt_ids: a text prompt is tokenized once, there).

    The prompt is echoed when `exclude_input_in_output` is false, or unset and the client did not
    ask for a stream (its `stream` flag, whether or not the model streams: the baseline answers once
    either way, and an A/B client must get the same default from both models); a stream refuses
    false (Triton's vLLM backend does, with this message).
    """
    if stream and request.exclude_input is False:
        raise ValueError(STREAMING_ECHO_REFUSED)
    prefix_ids: list[int] = []
    prefix_text = ""
    if request.exclude_input is False or (request.exclude_input is None and not request.stream):
        prefix_ids = prompt_ids
        if isinstance(request.prompt, str):
            prefix_text = request.prompt
        elif tokenizer is not None:
            prefix_text = tokenizer.decode(prefix_ids)
    samples = [ResponseBuilder(stream=stream, prefix_ids=prefix_ids, prefix_text=prefix_text, batched=batched,
                               outputs=request.outputs, stream_interval=stream_interval,
                               wants_logprobs=request.params.logprobs is not None, lora_name=request.params.lora_name)
               for _ in range(request.params.n)]  # fmt: skip
    return samples[0] if len(samples) == 1 else SamplesResponseBuilder(samples)


def output_arrays(
    ids: list[int], text: str, finish_reason: str, num_input_tokens: int, num_output_tokens: int, batched: bool,
    names: tuple[str, ...] = OUTPUT_NAMES, *, cumulative_logprob: float | None = None,
    logprobs: list[dict[int, Any]] | None = None, prompt_logprobs: list[dict[int, Any] | None] | None = None,
    metrics: RequestMetrics | None = None,
) -> dict[str, np.ndarray]:
    """The response payload: the outputs in `names`, with the vLLM backend's dtypes.

    `logprobs` holds one {token id: Logprob} dict per token, sent as JSON keyed by the id as a
    string (None sends the literal "null"); `prompt_logprobs` the same per prompt token, the first
    null; a cumulative logprob that was not computed is NaN.
    """
    arrays = {}
    if "text_output" in names:
        arrays["text_output"] = np.array([text.encode("utf-8")], dtype=np.object_)
    if "output_ids" in names:
        arrays["output_ids"] = np.array(ids, dtype=np.int32)
    if "finish_reason" in names:
        arrays["finish_reason"] = np.array([finish_reason.encode("utf-8")], dtype=np.object_)
    if "cumulative_logprob" in names:
        value = float("nan") if cumulative_logprob is None else cumulative_logprob
        arrays["cumulative_logprob"] = np.array([value], dtype=np.float32)
    if "logprobs" in names:
        arrays["logprobs"] = np.array([_logprobs_json(logprobs).encode("utf-8")], dtype=np.object_)
    if "num_input_tokens" in names:
        arrays["num_input_tokens"] = np.array([num_input_tokens], dtype=np.uint32)
    if "num_output_tokens" in names:
        arrays["num_output_tokens"] = np.array([num_output_tokens], dtype=np.uint32)
    if "prompt_logprobs" in names:
        arrays["prompt_logprobs"] = np.array([_logprobs_json(prompt_logprobs).encode("utf-8")], dtype=np.object_)
    if PERF_OUTPUTS[0] in names:
        arrays.update(_perf_arrays(metrics))
    if batched:  # the baseline's outputs carry the batch dimension too
        arrays = {name: value[np.newaxis, ...] for name, value in arrays.items()}
    return arrays


def _perf_arrays(metrics: RequestMetrics | None) -> dict[str, np.ndarray]:
    def ns(seconds: float | None) -> int:
        return -1 if seconds is None else round(seconds * 1e9)

    m = metrics or RequestMetrics(0.0, None, 0, 0)
    times = (m.arrival_time if metrics else None, m.first_scheduled_time, m.first_token_time, m.last_token_time)
    arrays = {name: np.array([ns(t)], dtype=np.int64) for name, t in zip(PERF_OUTPUTS[:4], times, strict=True)}
    arrays["num_preemptions"] = np.array([m.num_preemptions], dtype=np.uint32)
    arrays["prefix_cache_hit_tokens"] = np.array([m.num_cached_tokens], dtype=np.uint32)
    arrays["num_draft_tokens"] = np.array([m.num_draft_tokens], dtype=np.uint32)
    arrays["num_accepted_draft_tokens"] = np.array([m.num_accepted_tokens], dtype=np.uint32)
    return arrays


def _logprobs_json(logprobs: list[dict[int, Any] | None] | None) -> str:
    if logprobs is None:
        return "null"
    return json.dumps([None if per_token is None else
                       {str(token_id): {"logprob": entry.logprob, "rank": entry.rank,
                                        "decoded_token": entry.decoded_token}
                        for token_id, entry in per_token.items()} for per_token in logprobs])  # fmt: skip


def read_request(request: Any, config: EngineConfig, batched: bool = False) -> ParsedRequest:
    """Collects a pb_utils.InferenceRequest's tensors, parameters and timeout and parses them, within
    the deployment's limits (`config`)."""
    import triton_python_backend_utils as pb_utils  # only importable inside the Python backend stub

    tensors = {}
    for name in INPUT_NAMES:
        tensor = pb_utils.get_input_tensor_by_name(request, name)
        if tensor is not None:
            tensors[name] = tensor.as_numpy()
    parsed = parse_inputs(tensors, request.parameters(), batched=batched, max_request_bytes=config.max_request_bytes,
                          triton_timeout_us=int(request.timeout()), max_priority=config.max_priority)  # fmt: skip
    requested = set(request.requested_output_names())
    if requested:
        parsed.outputs = tuple(name for name in parsed.outputs if name in requested)
    return parsed


def make_response(arrays: Mapping[str, np.ndarray]) -> Any:
    import triton_python_backend_utils as pb_utils

    return pb_utils.InferenceResponse(output_tensors=[pb_utils.Tensor(name, value) for name, value in arrays.items()])


def serialize_byte_tensor(tensor: np.ndarray) -> bytes | tuple | None:
    """Triton's BYTES wire format of a string tensor (each element's 4-byte little-endian length, then
    its bytes, in C order): what triton_python_backend_utils.serialize_byte_tensor returns, for the same
    inputs, in about half the time. The Python backend's stub calls that function by name for every
    string output it builds (text_output, finish_reason, logprobs: a call per response), walking the
    array with np.nditer; `install_fast_byte_serialization` puts this one in its place."""
    if tensor.size == 0:
        return ()
    if tensor.dtype != np.object_ and tensor.dtype.type != np.bytes_:
        return None
    parts = []
    for item in tensor.reshape(-1).tolist():  # C order, as nditer walks it; bytes_ items lose trailing NULs alike
        data = item if type(item) is bytes else str(item).encode("utf-8")
        parts.append(len(data).to_bytes(4, "little"))
        parts.append(data)
    return b"".join(parts)


def install_fast_byte_serialization(pb_utils: Any) -> None:
    """Makes the stub serialize string outputs with `serialize_byte_tensor` (same bytes, cheaper)."""
    pb_utils.serialize_byte_tensor = serialize_byte_tensor


def error_response(exc: BaseException) -> Any:
    """An InferenceResponse carrying `exc` as a TritonError with a fitting status code."""
    import triton_python_backend_utils as pb_utils

    code, message = error_code(exc)
    return pb_utils.InferenceResponse(error=pb_utils.TritonError(message, getattr(pb_utils.TritonError, code)))


class EngineUnavailable(RuntimeError):
    """The engine cannot take or finish requests (it died or the model is shutting down)."""


class RequestTimedOut(RuntimeError):
    """The request's timeout passed before it finished (Triton's own queue timeouts say UNAVAILABLE too)."""


class RequestCancelled(RuntimeError):
    """The client cancelled a stream: its final response is a CANCELLED error, as in vLLM's backend."""


def request_failure(
    message: str, engine_healthy: bool, finish_reason: FinishReason | None = FinishReason.ERROR
) -> Exception:
    """The exception for a request the engine ended with ERROR, TIMEOUT or INVALID, or a cancelled
    stream.

    A timeout, or a request whose engine loop died, may be retried (UNAVAILABLE); "invalid" is the
    request's own fault found by the engine, e.g. a structured-output grammar that does not compile
    (INVALID_ARG); otherwise the request failed inside a running engine (INTERNAL).
    """
    if finish_reason is FinishReason.INVALID:
        return ValueError(message)
    if finish_reason is FinishReason.TIMEOUT:
        return RequestTimedOut(message)
    if finish_reason is FinishReason.CANCELLED:
        return RequestCancelled(message)
    return RuntimeError(message) if engine_healthy else EngineUnavailable(message)


def error_code(exc: BaseException) -> tuple[str, str]:
    """(TritonError code name, message) for an exception raised while handling a request."""
    if isinstance(exc, EngineDeadError | EngineUnavailable):
        return "UNAVAILABLE", f"the ORCA engine is unavailable: {exc}"
    if isinstance(exc, EngineOverloadedError | RequestTimedOut):
        return "UNAVAILABLE", str(exc)
    if isinstance(exc, RequestCancelled):
        return "CANCELLED", str(exc)
    if isinstance(exc, ValueError):
        return "INVALID_ARG", str(exc)
    return "INTERNAL", f"internal error: {type(exc).__name__}: {exc}"
