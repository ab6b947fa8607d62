"""The client side of the request/response contract (docs/architecture.md), in one place.

Both served models (`orca`, `baseline`) take the input tensors of Triton's vLLM backend and answer
with its output tensors (README, "The request/response contract"), so every client here
(orca-client, the load generator, orca-bench, the tests) encodes requests, decodes responses and
reads model configs through these functions. Only numpy is imported at module level: tritonclient is imported where
a tensor object or a client is needed, and nothing here may pull in torch or the engine.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# ------------------------------------------------------------------------------ tensor names
TEXT_INPUT = "text_input"
INPUT_IDS = "input_ids"
MAX_TOKENS = "max_tokens"
SAMPLING_PARAMETERS = "sampling_parameters"
STREAM = "stream"
EXCLUDE_INPUT_IN_OUTPUT = "exclude_input_in_output"

TEXT_OUTPUT = "text_output"
OUTPUT_IDS = "output_ids"
FINISH_REASON = "finish_reason"
CUMULATIVE_LOGPROB = "cumulative_logprob"
LOGPROBS = "logprobs"
NUM_INPUT_TOKENS = "num_input_tokens"
NUM_OUTPUT_TOKENS = "num_output_tokens"
# With the `prompt_logprobs` sampling parameter: JSON, in the response of the first token, one entry per
# prompt token (null for the first, then {token id: {logprob, rank, decoded_token}}); "null" otherwise.
PROMPT_LOGPROBS = "prompt_logprobs"
# The request's timeline (ns on the server host's CLOCK_MONOTONIC, -1 where a moment never came) and
# counts, in its last response, when `return_perf_metrics` is true (TensorRT-LLM's name).
PERF_METRICS = "perf_metrics"
PERF_OUTPUTS = ("arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns",
                "num_preemptions", "prefix_cache_hit_tokens", "num_draft_tokens", "num_accepted_draft_tokens")
# Outputs the server sends only when the request's `return_<output>` input is true.
OPTIONAL_OUTPUTS = (FINISH_REASON, CUMULATIVE_LOGPROB, LOGPROBS, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS, PROMPT_LOGPROBS,
                    PERF_METRICS)
# What this project's clients ask for: when a request ended, and how many tokens it counted.
STATUS_OUTPUTS = (FINISH_REASON, NUM_INPUT_TOKENS, NUM_OUTPUT_TOKENS)
NOT_FINISHED = "None"  # finish_reason of every response but the last


# ---------------------------------------------------------------------------------- requests
@dataclass(frozen=True)
class RequestTensor:
    """One input tensor of a request: its name, the array to send and Triton's wire datatype."""

    name: str
    array: np.ndarray
    datatype: str  # "BYTES" | "INT32" | "BOOL"


def _bytes_tensor(name: str, value: str) -> RequestTensor:
    return RequestTensor(name, np.array([value.encode("utf-8")], dtype=np.object_), "BYTES")


def _bool_tensor(name: str, value: bool) -> RequestTensor:
    return RequestTensor(name, np.array([value], dtype=np.bool_), "BOOL")


def encode_request(
    *,
    text: str | None = None,
    input_ids: list[int] | None = None,
    max_tokens: int | None = None,
    sampling: Mapping[str, Any] | str | None = None,
    stream: bool | None = None,
    exclude_input_in_output: bool | None = None,
    return_outputs: Iterable[str] = (),
    batched: bool = False,
) -> list[RequestTensor]:
    """The input tensors of one request; an argument left at None is not sent.

    `return_outputs` names optional outputs (OPTIONAL_OUTPUTS) to switch on with their
    `return_<output>` inputs; without them a response holds text_output and output_ids alone.

    `sampling` is a mapping (sent as JSON) or a string sent verbatim as `sampling_parameters`
    (tests send malformed JSON that way); an empty one is not sent. `batched` adds Triton's
    implicit batch dimension of 1, which a model with `max_batch_size > 0` (the baseline) expects.
    Giving both prompts, or neither, is left to the server to refuse: tests check that it does.
    """
    tensors: list[RequestTensor] = []
    if text is not None:
        tensors.append(_bytes_tensor(TEXT_INPUT, text))
    if input_ids is not None:
        tensors.append(RequestTensor(INPUT_IDS, np.array(input_ids, dtype=np.int32), "INT32"))
    if max_tokens is not None:
        tensors.append(RequestTensor(MAX_TOKENS, np.array([max_tokens], dtype=np.int32), "INT32"))
    if sampling:
        payload = sampling if isinstance(sampling, str) else json.dumps(dict(sampling))
        tensors.append(_bytes_tensor(SAMPLING_PARAMETERS, payload))
    if stream is not None:
        tensors.append(_bool_tensor(STREAM, stream))
    if exclude_input_in_output is not None:
        tensors.append(_bool_tensor(EXCLUDE_INPUT_IN_OUTPUT, exclude_input_in_output))
    for output in return_outputs:
        if output not in OPTIONAL_OUTPUTS:
            raise ValueError(f"{output} is not an optional output; those are {', '.join(OPTIONAL_OUTPUTS)}")
        tensors.append(_bool_tensor(f"return_{output}", True))
    if batched:
        tensors = [RequestTensor(t.name, t.array[np.newaxis, ...], t.datatype) for t in tensors]
    return tensors


def to_infer_inputs(tensors: list[RequestTensor], module: Any = None) -> list[Any]:
    """tritonclient InferInputs holding `tensors`; `module` is tritonclient.grpc (default) or .http."""
    if module is None:
        import tritonclient.grpc as module
    inputs = []
    for tensor in tensors:
        infer_input = module.InferInput(tensor.name, list(tensor.array.shape), tensor.datatype)
        infer_input.set_data_from_numpy(tensor.array)
        inputs.append(infer_input)
    return inputs


def build_inputs(*, module: Any = None, **request: Any) -> list[Any]:
    """`encode_request(**request)` as tritonclient InferInputs ready to send."""
    return to_infer_inputs(encode_request(**request), module)


# --------------------------------------------------------------------------------- responses
@dataclass
class Delta:
    """The fields of one response, batch dimension removed (in a stream: what is new since the last).

    Outputs the response did not carry read as "", 0 or None.
    """

    text: str
    ids: list[int]
    finish_reason: str  # "" until the last response (the server's "None")
    num_input_tokens: int
    num_output_tokens: int  # generated tokens this response counts: sum them over a stream
    final: bool
    cumulative_logprob: float | None = None
    logprobs: list[dict[str, Any]] | None = None  # one {token id: {logprob, rank, decoded_token}} per token
    time: float = field(default_factory=time.perf_counter)  # when it was decoded
    perf: dict[str, int] | None = None  # PERF_OUTPUTS, when the response carries them


def _first_int(value: np.ndarray | None) -> int:
    return int(value[0]) if value is not None and value.size else 0


def decode_response(result: Any) -> Delta:
    """Reads an InferResult (gRPC or HTTP) of any of the models into a Delta."""

    def output(name: str) -> np.ndarray | None:
        value = result.as_numpy(name)
        return None if value is None else value.reshape(-1)

    text = output(TEXT_OUTPUT)
    ids = output(OUTPUT_IDS)
    reason = output(FINISH_REASON)
    finish = reason[0].decode() if reason is not None and reason.size else ""
    finish = "" if finish == NOT_FINISHED else finish
    final = bool(finish)
    cumulative = output(CUMULATIVE_LOGPROB)
    logprobs = output(LOGPROBS)
    perf = None
    if output(PERF_OUTPUTS[0]) is not None:  # all of them or none (as_numpy costs ~30 µs a call)
        perf = {name: _first_int(output(name)) for name in PERF_OUTPUTS}
    with contextlib.suppress(AttributeError, KeyError, TypeError):
        # Set on the empty last response of a decoupled gRPC stream (enable_empty_final_response).
        final = final or result.get_response().parameters["triton_final_response"].bool_param
    return Delta(
        text=b"".join(text).decode("utf-8") if text is not None else "",
        ids=[int(t) for t in ids] if ids is not None else [],
        finish_reason=finish,
        num_input_tokens=_first_int(output(NUM_INPUT_TOKENS)),
        num_output_tokens=_first_int(output(NUM_OUTPUT_TOKENS)),
        final=final,
        cumulative_logprob=float(cumulative[0]) if cumulative is not None and cumulative.size else None,
        logprobs=json.loads(logprobs[0]) if logprobs is not None and logprobs.size else None,
        perf=perf,
    )


@dataclass(frozen=True)
class ResponseCounts:
    """What the load generator needs from one response, without decoding ids or text."""

    output_ids: int  # ids this response carries
    num_output_tokens: int | None  # the tokens this response counts, when it carries the count
    finish_reason: str  # "" until the last response
    perf: dict[str, int] | None = None  # PERF_OUTPUTS, when the response carries them (the last one)


def read_response_counts(response: Any) -> ResponseCounts:
    """Reads a gRPC ModelInferResponse's raw output bytes directly.

    InferResult.as_numpy costs ~30 µs a call, and three calls per token were a third of the load
    generator's CPU per response. Triton's raw layouts: INT32 and UINT32 little-endian; each BYTES
    element a 4-byte little-endian length and then its bytes.
    """
    ids = 0
    reported: int | None = None
    finish = ""
    perf: dict[str, int] = {}
    for output, raw in zip(response.outputs, response.raw_output_contents, strict=False):
        if output.name in _PERF_NAMES:
            perf[output.name] = int.from_bytes(raw, "little", signed=output.datatype.startswith("INT"))
            continue
        if output.name == OUTPUT_IDS:
            ids = len(raw) // 4
        elif output.name == NUM_OUTPUT_TOKENS and len(raw) >= 4:
            reported = int.from_bytes(raw[:4], "little", signed=output.datatype == "INT32")
        elif output.name == FINISH_REASON and len(raw) > 4:
            size = int.from_bytes(raw[:4], "little")
            finish = raw[4:4 + size].decode()
    return ResponseCounts(ids, reported, "" if finish == NOT_FINISHED else finish, perf or None)


_PERF_NAMES = frozenset(PERF_OUTPUTS)


# ----------------------------------------------------------------------------- model configs
def unwrap_model_config(reply: Mapping[str, Any]) -> dict[str, Any]:
    """The model config in a get_model_config(..., as_json=True) reply: gRPC nests it under
    "config", HTTP returns it bare."""
    config = reply.get("config", reply)
    return dict(config)


def get_model_config(client: Any, model: str) -> dict[str, Any]:
    """`model`'s config as the server loaded it, from a tritonclient.grpc or .http client."""
    return unwrap_model_config(client.get_model_config(model, as_json=True))


async def get_model_config_async(client: Any, model: str) -> dict[str, Any]:
    """get_model_config for a tritonclient.grpc.aio (or .http.aio) client."""
    return unwrap_model_config(await client.get_model_config(model, as_json=True))


def triton_max_batch_size(config: Mapping[str, Any]) -> int:
    """Triton's top-level max_batch_size: the dynamic batcher's limit (0: the model does not batch)."""
    return int(config.get("max_batch_size", 0))


def takes_input(config: Mapping[str, Any], name: str) -> bool:
    """Whether the model declares the input `name` (echo takes no `return_perf_metrics`, say)."""
    return any(entry.get("name") == name for entry in config.get("input", []))


def is_batched(config: Mapping[str, Any]) -> bool:
    """Whether requests carry Triton's implicit batch dimension (baseline: yes; orca, echo: no)."""
    return triton_max_batch_size(config) > 0


def string_parameters(config: Mapping[str, Any]) -> dict[str, str]:
    """The config's `parameters { key: ... value: { string_value: ... } }` entries, as key -> value.

    Every engine setting is such an entry (docs/architecture.md, Configuration), so this is how a
    client learns what the server really runs. `${ENV}` references stay as the server reported them:
    they name the server's environment, not this one.
    """
    from orca_backend.config import parameter_values  # torch-free; imported here to keep this module light

    return parameter_values(config.get("parameters") or {}, expand_env=False)
