"""The request/response contract (orca_backend.server.protocol) without a server, and the repository
and orca-serve rendering that carry it."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from orca_backend.config import EngineConfig
from orca_backend.engine.output_processor import RequestOutput
from orca_backend.entrypoints.serve import ServerOptions, TritonServer, render_config
from orca_backend.server.protocol import (
    INPUT_NAMES,
    OUTPUT_NAMES,
    ResponseBuilder,
    error_code,
    output_arrays,
    parse_inputs,
)
from orca_backend.server.triton_config import INPUTS, OUTPUTS, engine_config

REPO = Path(__file__).resolve().parents[2] / "model_repository"


def text(value: str) -> np.ndarray:
    return np.array([value.encode()], dtype=np.object_)


def ids(*values: int) -> np.ndarray:
    return np.array(values, dtype=np.int32)


def sampling(values: object) -> np.ndarray:
    return text(values if isinstance(values, str) else json.dumps(values))


# ---- prompts ---------------------------------------------------------------------------------
def test_text_prompt_and_defaults():
    parsed = parse_inputs({"text_input": text("héllo wörld")})
    assert parsed.prompt == "héllo wörld"
    assert parsed.stream is False and parsed.exclude_input is None  # unset: the builder decides the echo
    assert parsed.outputs == ("text_output", "output_ids")  # the others need their return_* input
    assert parsed.params.max_tokens == 16


def test_token_prompt():
    assert parse_inputs({"input_ids": ids(5, 6, 7)}).prompt == [5, 6, 7]


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({}, "no prompt"),
        ({"max_tokens": ids(4)}, "no prompt"),
        ({"text_input": text("a"), "input_ids": ids(1)}, "either text_input or input_ids, not both"),
        ({"text_input": text("")}, "text_input is empty"),
        ({"input_ids": ids()}, "input_ids is empty"),
        ({"input_ids": ids(3, -1)}, "non-negative"),
        ({"input_ids": np.array([1.5], dtype=np.float32)}, "INT32"),
        ({"text_input": np.array([b"\xff\xfe"], dtype=np.object_)}, "UTF-8"),
        ({"text_input": np.array([b"a", b"b"], dtype=np.object_)}, "exactly one element"),
        ({"text_input": np.array([3], dtype=np.int32)}, "must be a string"),
        ({"text_input": text("a"), "prompt": text("b")}, "unknown input"),
    ],
)
def test_bad_prompts(tensors, message):
    with pytest.raises(ValueError, match=message):
        parse_inputs(tensors)


# ---- sampling parameters -------------------------------------------------------------------
def test_numeric_strings_as_genai_perf_sends_them():
    parsed = parse_inputs({"text_input": text("a"),
                           "sampling_parameters": sampling({"max_tokens": "32", "min_tokens": "32", "temperature": "0"})})
    assert (parsed.params.max_tokens, parsed.params.min_tokens, parsed.params.temperature) == (32, 32, 0.0)


def test_max_tokens_input_beats_json_beats_request_parameters():
    tensors = {"input_ids": ids(1), "sampling_parameters": sampling({"max_tokens": 8, "top_k": 3})}
    params = {"max_tokens": 2, "top_k": 9, "temperature": 0.5}
    parsed = parse_inputs(tensors, json.dumps(params))
    assert (parsed.params.max_tokens, parsed.params.top_k, parsed.params.temperature) == (8, 3, 0.5)
    parsed = parse_inputs({**tensors, "max_tokens": ids(4)}, params)
    assert parsed.params.max_tokens == 4


def test_request_parameters_ignore_foreign_keys():
    # HTTP generate's top-level keys and client-added ones (gRPC's triton_* flags) share this dict.
    parsed = parse_inputs({"input_ids": ids(1)}, '{"triton_enable_empty_final_response": true, "seed": 7}')
    assert parsed.params.seed == 7
    assert parse_inputs({"input_ids": ids(1)}, "").params.seed is None


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
        ({"temperature": -1}, "temperature must be a finite number >= 0"),
        ({"top_p": 1.5}, r"top_p must be in \[0, 1\] \(0 is greedy\)"),
        ({"top_k": -5}, "top_k"),
        ({"max_tokens": 0}, "max_tokens must be a positive integer"),
        ({"max_tokens": "many"}, "max_tokens must be an integer"),
        ({"min_tokens": 9, "max_tokens": 4}, "min_tokens"),
        ({"temprature": 0}, "unknown sampling parameter"),
        ({"ignore_eos": "maybe"}, "ignore_eos must be a boolean"),
    ],
)
def test_bad_sampling_parameters(payload, message):
    with pytest.raises(ValueError, match=message):
        parse_inputs({"input_ids": ids(1), "sampling_parameters": sampling(payload)})


def test_wrong_dtypes_of_scalars():
    with pytest.raises(ValueError, match="max_tokens must be an INT32"):
        parse_inputs({"input_ids": ids(1), "max_tokens": np.array([2.0], dtype=np.float32)})
    with pytest.raises(ValueError, match="stream must be a BOOL"):
        parse_inputs({"input_ids": ids(1), "stream": ids(1)})


def test_flags():
    parsed = parse_inputs({"input_ids": ids(1), "stream": np.array([True]),
                           "exclude_input_in_output": np.array([False])})
    assert parsed.stream is True and parsed.exclude_input is False


# ---- the baseline's batch dimension ----------------------------------------------------------
def test_batched_inputs_lose_their_batch_dimension():
    parsed = parse_inputs({"input_ids": ids(1, 2)[None], "max_tokens": ids(3)[None], "text_input": None},
                          batched=True)
    assert parsed.prompt == [1, 2] and parsed.params.max_tokens == 3


def test_batched_input_with_two_prompts_is_refused():
    with pytest.raises(ValueError, match="one prompt per request"):
        parse_inputs({"text_input": np.array([[b"a"], [b"b"]], dtype=np.object_)}, batched=True)


# ---- responses -------------------------------------------------------------------------------
def event(new_ids, new_text="", finished=False, reason=None, n_out=0, error=None) -> RequestOutput:
    return RequestOutput("r", list(new_ids), new_text, finished, reason, 3, n_out, 0.0, error)


def decode(arrays):
    return (arrays["text_output"][0].decode(), arrays["output_ids"].tolist(), arrays["finish_reason"][0].decode(),
            int(arrays["num_input_tokens"][0]), int(arrays["num_output_tokens"][0]))


def test_stream_deltas_with_prompt_prefix_concatenate_to_the_full_answer():
    builder = ResponseBuilder(stream=True, prefix_ids=[7, 8], prefix_text="ab", outputs=OUTPUT_NAMES)
    assert not builder.ready
    builder.add(event([1], "x", n_out=1))
    assert builder.ready
    assert decode(builder.flush()) == ("abx", [7, 8, 1], "None", 3, 1)
    assert not builder.ready
    builder.add(event([2], "y", n_out=2))
    builder.add(event([3], "z", finished=True, reason="length", n_out=3))  # merged when sending lags
    assert builder.finished and builder.ready
    assert decode(builder.flush()) == ("yz", [2, 3], "length", 3, 2)  # the count is this response's


def test_stream_interval_holds_tokens_after_the_first_until_n_or_the_end():
    builder = ResponseBuilder(stream=True, stream_interval=3, outputs=OUTPUT_NAMES)
    builder.add(event([1], "a", n_out=1))
    assert builder.ready  # the first token at once
    assert decode(builder.flush())[1] == [1]
    for i, token in enumerate([2, 3], start=2):
        builder.add(event([token], "b", n_out=i))
        assert not builder.ready
    builder.add(event([4], "c", n_out=4))
    assert builder.ready and decode(builder.flush())[:2] == ("bbc", [2, 3, 4])
    builder.add(event([5], "d", finished=True, reason="length", n_out=5))
    assert builder.ready and decode(builder.flush())[1:3] == ([5], "length")


def test_non_stream_answers_once_with_everything():
    builder = ResponseBuilder(stream=False, outputs=OUTPUT_NAMES)
    builder.add(event([1], "x", n_out=1))
    assert not builder.ready
    builder.add(event([2], "y", finished=True, reason="stop", n_out=2))
    assert decode(builder.flush()) == ("xy", [1, 2], "stop", 3, 2)


def test_error_event_is_kept_for_an_error_response():
    builder = ResponseBuilder(stream=True)
    builder.add(event([], finished=True, reason="error", error="model execution failed: boom"))
    assert builder.finished and builder.error == "model execution failed: boom"


def test_output_arrays_types_and_batch_dimension():
    arrays = output_arrays([1, 2], "hi", "length", 4, 2, batched=False)
    assert list(arrays) == list(OUTPUT_NAMES)
    assert arrays["output_ids"].dtype == np.int32 and arrays["num_output_tokens"].dtype == np.uint32
    assert arrays["num_input_tokens"].dtype == np.uint32 and arrays["cumulative_logprob"].dtype == np.float32
    assert arrays["text_output"].dtype == np.object_
    batched = output_arrays([1, 2], "hi", "length", 4, 2, batched=True)
    assert batched["output_ids"].shape == (1, 2) and batched["text_output"].shape == (1, 1)


def test_error_codes():
    from orca_backend.engine.llm_engine import EngineDeadError

    assert error_code(ValueError("bad"))[0] == "INVALID_ARG"
    assert error_code(EngineDeadError("gone"))[0] == "UNAVAILABLE"
    assert error_code(KeyError("x"))[0] == "INTERNAL"


# ---- priority, timeout, request size ----------------------------------------------------------
def test_priority_and_timeout_come_from_request_parameters():
    parsed = parse_inputs({"input_ids": ids(1, 2)}, {"scheduling_priority": 3, "timeout_s": 2.5})
    assert (parsed.priority, parsed.timeout_s) == (3, 2.5)
    parsed = parse_inputs({"input_ids": ids(1, 2)}, '{"scheduling_priority": "-1", "timeout_s": "0.5"}')  # HTTP may send strings
    assert (parsed.priority, parsed.timeout_s) == (-1, 0.5)
    assert (parse_inputs({"input_ids": ids(1)}).priority, parse_inputs({"input_ids": ids(1)}).timeout_s) == (0, None)


def test_the_shorter_of_the_parameter_and_tritons_request_timeout_wins():
    assert parse_inputs({"input_ids": ids(1)}, triton_timeout_us=3_000_000).timeout_s == 3.0
    assert parse_inputs({"input_ids": ids(1)}, {"timeout_s": 2}, triton_timeout_us=3_000_000).timeout_s == 2.0
    assert parse_inputs({"input_ids": ids(1)}, {"timeout_s": 9}, triton_timeout_us=3_000_000).timeout_s == 3.0


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"scheduling_priority": 1.5}, "request parameter scheduling_priority must be an integer"),
        ({"scheduling_priority": "high"}, "request parameter scheduling_priority must be an integer"),
        ({"scheduling_priority": 2**40}, "priority must be an integer in"),
        ({"scheduling_priority": 21}, r"priority must be an integer in \[-20, 20\] .*max_priority is 20\), got 21"),
        ({"scheduling_priority": -(2**31) + 1}, r"priority must be an integer in \[-20, 20\]"),
        ({"timeout_s": "soon"}, "request parameter timeout_s must be a number"),
        ({"timeout_s": -1}, "timeout_s must be a number of seconds > 0"),
        ({"timeout_s": True}, "request parameter timeout_s must be a number"),
    ],
)
def test_bad_priority_or_timeout_parameters(parameters, message):
    with pytest.raises(ValueError, match=message):
        parse_inputs({"input_ids": ids(1, 2)}, parameters)


def test_max_request_bytes_bounds_the_inputs_before_anything_is_decoded():
    prompt = "x" * 1000
    assert parse_inputs({"text_input": text(prompt)}, max_request_bytes=1000).prompt == prompt
    with pytest.raises(ValueError, match="1001 bytes, more than this deployment's max_request_bytes of 1000"):
        parse_inputs({"text_input": text(prompt + "y")}, max_request_bytes=1000)
    with pytest.raises(ValueError, match="max_request_bytes of 100"):
        parse_inputs({"input_ids": np.ones(26, dtype=np.int32)}, max_request_bytes=100)  # 104 bytes
    with pytest.raises(ValueError, match="max_request_bytes"):  # checked before the invalid UTF-8 is seen
        parse_inputs({"text_input": np.array([b"\xff" * 200], dtype=np.object_)}, max_request_bytes=100)
    # Request parameters count too: a client may send structured_outputs or stop there (HTTP generate's
    # top-level keys), and Triton hands them over as one JSON string.
    schema = json.dumps({"structured_outputs": {"json": {"type": "object", "description": "z" * 2000}}})
    with pytest.raises(ValueError, match="inputs and parameters hold .* bytes, more than this deployment's "
                                         "max_request_bytes of 1000"):  # fmt: skip
        parse_inputs({"input_ids": ids(1, 2)}, schema, max_request_bytes=1000)


def test_a_timeout_is_answered_unavailable_and_other_failures_internal_or_unavailable():
    from orca_backend.messages import FinishReason
    from orca_backend.server.protocol import request_failure

    assert error_code(request_failure("the request timed out", True, FinishReason.TIMEOUT))[0] == "UNAVAILABLE"
    assert error_code(request_failure("batch failed", True))[0] == "INTERNAL"
    assert error_code(request_failure("engine gone", False))[0] == "UNAVAILABLE"


# ---- the model repository and orca-serve's rendering of it -------------------------------------
def _declared(config_text: str, section: str) -> dict[str, str]:
    block = re.search(rf"{section}\s*\[(.*?)\n\]", config_text, re.S).group(1)
    return dict(re.findall(r'name:\s*"(\w+)",\s*data_type:\s*(TYPE_\w+)', block))


@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_repository_declares_the_contract(model):
    config = (REPO / model / "config.pbtxt").read_text()
    assert set(_declared(config, "input")) == set(INPUT_NAMES)
    assert set(_declared(config, "output")) == set(OUTPUT_NAMES)
    assert _declared(config, "input")["input_ids"] == "TYPE_INT32"
    params = {k: v for k, v in re.findall(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config)}
    engine = EngineConfig.from_parameters(params)
    assert (engine.model, engine.device, engine.dtype) == ("gpt2-small", "cpu", "float32")
    # The Python-based backend's model.py serves it: the repository keeps none of its own.
    backend = {"orca": "orca", "baseline": "orca_baseline"}[model]
    assert re.search(rf'(?m)^backend: "{backend}"$', config) and not (REPO / model / "1" / "model.py").exists()
    # What auto-complete fills in for a one-line config.pbtxt is what the checked-in one declares.
    declared = {name: (dtype, [int(dim)]) for name, dtype, dim in
                re.findall(r'\{ name: "(\w+)", data_type: (TYPE_\w+), dims: \[ (-?\d+) \]', config)}  # fmt: skip
    assert {t["name"]: (t["data_type"], t["dims"]) for t in INPUTS + OUTPUTS} == declared


def test_orca_is_decoupled_and_baseline_batches_ragged_prompts():
    orca = (REPO / "orca" / "config.pbtxt").read_text()
    baseline = (REPO / "baseline" / "config.pbtxt").read_text()
    assert re.search(r"decoupled:\s*true", orca) and re.search(r"(?m)^max_batch_size:\s*0", orca)
    assert "decoupled" not in re.sub(r"#.*", "", baseline)
    assert re.search(r"(?m)^max_batch_size:\s*[1-9]", baseline)
    assert re.search(r"max_queue_delay_microseconds:\s*\d+", baseline)
    assert re.search(r'name:\s*"input_ids"[^}]*allow_ragged_batch:\s*true', baseline)


def test_engine_config_forced_fields():
    triton_config = {"parameters": {"model": {"string_value": "gpt2-tiny"}, "scheduling": {"string_value": "iteration"},
                                    "max_num_seqs": {"string_value": "4"}}}
    config = engine_config(triton_config, {}, scheduling="request", max_num_seqs=8)
    assert (config.model, config.scheduling, config.max_num_seqs) == ("gpt2-tiny", "request", 8)


def test_old_max_batch_size_parameter_is_refused_with_its_new_name():
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig.from_parameters({"max_batch_size": {"string_value": "4"}})


def test_render_config_overrides_adds_and_escapes():
    source = (REPO / "baseline" / "config.pbtxt").read_text()
    out = render_config(source, {"model": '/ckpt/"x"', "kv_capacity_tokens": "64", "extra": "1"},
                        {"max_batch_size": 4, "max_queue_delay_microseconds": 0})
    params = dict(re.findall(r'key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"((?:[^"\\]|\\.)*)"', out))
    assert params["model"] == '/ckpt/\\"x\\"' and params["kv_capacity_tokens"] == "64" and params["extra"] == "1"
    assert re.search(r"(?m)^max_batch_size:\s*4$", out) and "max_queue_delay_microseconds: 0" in out
    assert out.count('key: "model"') == 1


def test_rendered_repository_holds_only_the_chosen_models(tmp_path):
    server = TritonServer(ServerOptions(models=("orca",), parameters={"model": "gpt2-tiny"}, max_num_seqs=3,
                                        run_dir=tmp_path))
    repository = server.render_repository()
    assert sorted(p.name for p in repository.iterdir()) == ["orca"]
    config = (repository / "orca" / "config.pbtxt").read_text()
    assert 'string_value: "gpt2-tiny"' in config and 'string_value: "3"' in config
    command = server.command(server_binary_stub(), repository)
    assert "--load-model=orca" in command and "--model-control-mode=explicit" in command
    assert f"--grpc-port={server.grpc_port}" in command and "--http-address=127.0.0.1" in command


def server_binary_stub():
    from orca_backend.entrypoints.serve import TritonBinary

    return TritonBinary(Path("/bin/true"))


def test_the_fast_byte_serialization_gives_tritons_own_bytes():
    """The stub serializes every string output through triton_python_backend_utils.serialize_byte_tensor;
    ours, installed in its place, must give the same bytes for whatever a response may carry."""
    import importlib.util

    from orca_backend.server.protocol import serialize_byte_tensor

    pytriton = pytest.importorskip("pytriton")
    path = Path(pytriton.__file__).parent / "tritonserver" / "backends" / "python" / "triton_python_backend_utils.py"
    spec = importlib.util.spec_from_file_location("triton_utils_original", path)
    original = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(original)
    cases = [
        np.array([b"None"], dtype=np.object_), np.array(["naïve ✓"], dtype=np.object_), np.array([b""], dtype=np.object_),
        np.array([[b"a", "b"], [3, 4.5]], dtype=np.object_), np.array([b"x\x00", b"yz"], dtype=np.bytes_),
        np.array([b"ab", b"c"], dtype=np.object_)[::-1], np.array([np.str_("s"), b"\xff\x00"], dtype=np.object_),
        np.zeros((0,), dtype=np.object_), np.array([1, 2], dtype=np.int32),
    ]  # fmt: skip
    for case in cases:
        assert serialize_byte_tensor(case) == original.serialize_byte_tensor(case), case


# ---- embedding requests ---------------------------------------------------------------------
def embedding(payload: object, **others: np.ndarray):
    text = payload if isinstance(payload, str) else json.dumps(payload)
    return parse_inputs({"embedding_request": np.array([text.encode()], dtype=np.object_), **others})


def test_an_embedding_request_as_the_openai_frontend_sends_it():
    parsed = embedding({"input": "hello", "pooling_params": {"dimensions": [16]}},
                       return_num_input_tokens=np.array([True]))  # fmt: skip
    assert parsed.prompt == "hello" and parsed.pooling is not None and parsed.pooling.dimensions == 16
    assert parsed.exclude_input is True and parsed.outputs[-1] == "num_input_tokens"
    assert embedding({"input": [5, 6, 7], "pooling_params": {}}).prompt == [5, 6, 7]
    assert embedding({"input": "x"}).pooling.dimensions is None


@pytest.mark.parametrize(("payload", "others", "message"), [
    ({"input": "x"}, {"sampling_parameters": np.array([b"{}"], dtype=np.object_)}, "takes no sampling_parameters"),
    ('{"input": ', {}, "embedding_request is not valid JSON"),
    ({"text": "x"}, {}, 'must be a JSON object with "input"'),
    ({"input": ["a", "b"]}, {}, "input must be a non-empty string or a list of token ids"),
    ({"input": "x", "pooling_params": {"dimensions": [8, 16]}}, {}, "must hold one size"),
    ({"input": "x", "pooling_params": {"normalize": False}}, {}, "takes dimensions only"),
    ({"input": "x", "pooling_params": {"dimensions": [0]}}, {}, "dimensions must be a positive integer"),
])  # fmt: skip
def test_bad_embedding_requests_say_what_to_send(payload, others, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        embedding(payload, **others)
