"""orca_client.protocol: the exact tensors a request becomes, and the fields read back from responses
and model configs (no server: fake results and clients, real tritonclient tensor types)."""

from __future__ import annotations

import asyncio
import json
from types import SimpleNamespace

import numpy as np
import pytest

from orca_client import protocol
from orca_client.bench_server import served_model
from orca_client.loadgen import LoadOptions, request_inputs
from orca_client.workload import TraceRequest

# ---------------------------------------------------------------------------------- requests


def _by_name(tensors: list[protocol.RequestTensor]) -> dict[str, protocol.RequestTensor]:
    return {t.name: t for t in tensors}


def test_encode_every_input_unbatched():
    tensors = protocol.encode_request(text="héllo", max_tokens=7, sampling={"temperature": 0, "top_k": 3},
                                      stream=True, exclude_input_in_output=False)
    assert [t.name for t in tensors] == ["text_input", "max_tokens", "sampling_parameters", "stream",
                                         "exclude_input_in_output"]
    t = _by_name(tensors)
    assert t["text_input"].datatype == "BYTES" and t["text_input"].array.dtype == np.object_
    assert t["text_input"].array.shape == (1,) and t["text_input"].array[0] == "héllo".encode()
    assert t["max_tokens"].datatype == "INT32" and t["max_tokens"].array.dtype == np.int32
    assert t["max_tokens"].array.tolist() == [7]
    assert t["sampling_parameters"].datatype == "BYTES"
    assert json.loads(t["sampling_parameters"].array[0]) == {"temperature": 0, "top_k": 3}
    assert t["stream"].datatype == "BOOL" and t["stream"].array.dtype == np.bool_
    assert t["stream"].array.tolist() == [True]
    assert t["exclude_input_in_output"].array.tolist() == [False]


def test_encode_return_outputs_switches_on_their_return_inputs():
    tensors = _by_name(protocol.encode_request(input_ids=[1], return_outputs=protocol.STATUS_OUTPUTS, batched=True))
    assert set(tensors) == {"input_ids", "return_finish_reason", "return_num_input_tokens",
                            "return_num_output_tokens"}  # fmt: skip
    assert all(t.datatype == "BOOL" and t.array.tolist() == [[True]]
               for name, t in tensors.items() if name != "input_ids")  # fmt: skip
    with pytest.raises(ValueError, match="output_ids is not an optional output"):
        protocol.encode_request(input_ids=[1], return_outputs=["output_ids"])


def test_encode_batched_adds_a_batch_dimension_of_one():
    tensors = _by_name(protocol.encode_request(input_ids=[5, 6, 7], max_tokens=2, stream=False, batched=True))
    assert set(tensors) == {"input_ids", "max_tokens", "stream"}
    ids = tensors["input_ids"]
    assert ids.datatype == "INT32" and ids.array.dtype == np.int32 and ids.array.shape == (1, 3)
    assert ids.array.tolist() == [[5, 6, 7]]
    assert tensors["max_tokens"].array.shape == (1, 1)
    assert tensors["stream"].array.shape == (1, 1) and tensors["stream"].array.tolist() == [[False]]
    unbatched = _by_name(protocol.encode_request(input_ids=[5, 6, 7]))
    assert unbatched["input_ids"].array.shape == (3,)


def test_encode_leaves_out_what_is_not_given():
    assert protocol.encode_request() == []
    # An empty sampling dict is not sent; a string is sent verbatim (malformed JSON included).
    assert protocol.encode_request(input_ids=[1], sampling={})[0].name == "input_ids"
    (_, sampling) = protocol.encode_request(input_ids=[1], sampling='{"temperature": 0,')
    assert sampling.array[0] == b'{"temperature": 0,'
    # Both prompts are sent as given: refusing them is the server's job.
    assert [t.name for t in protocol.encode_request(text="a", input_ids=[1])] == ["text_input", "input_ids"]


def test_build_inputs_are_tritonclient_tensors_of_the_encoded_arrays():
    grpcclient = pytest.importorskip("tritonclient.grpc")
    httpclient = pytest.importorskip("tritonclient.http")
    inputs = protocol.build_inputs(input_ids=[1, 2], stream=True, batched=True)
    assert [type(i) for i in inputs] == [grpcclient.InferInput] * 2
    assert [(i.name(), i.datatype(), i.shape()) for i in inputs] == [("input_ids", "INT32", [1, 2]),
                                                                     ("stream", "BOOL", [1, 1])]
    (http_input,) = protocol.build_inputs(text="x", module=httpclient)
    assert isinstance(http_input, httpclient.InferInput) and http_input.shape() == [1]


def test_load_generator_requests_carry_max_tokens_in_the_sampling_json():
    pytest.importorskip("tritonclient.grpc")
    options = LoadOptions(stream=True)
    ids_request = TraceRequest(0.0, [3, 4], 9)
    inputs = request_inputs(ids_request, False, options)
    flags = [("exclude_input_in_output", "BOOL", [1]), ("return_finish_reason", "BOOL", [1]),
             ("return_num_output_tokens", "BOOL", [1])]  # fmt: skip
    assert [(i.name(), i.datatype(), i.shape()) for i in inputs] == [
        ("input_ids", "INT32", [2]), ("sampling_parameters", "BYTES", [1]), ("stream", "BOOL", [1]), *flags]
    encoded = protocol.encode_request(input_ids=[3, 4], stream=True, exclude_input_in_output=True,
                                      sampling={"temperature": 0, "ignore_eos": True, "max_tokens": 9},
                                      return_outputs=(protocol.FINISH_REASON, protocol.NUM_OUTPUT_TOKENS))
    assert [i._get_content() for i in inputs] == [i._get_content() for i in protocol.to_infer_inputs(encoded)]
    text_request = TraceRequest(0.0, [], 5, prompt_text="hi")
    assert [i.name() for i in request_inputs(text_request, True, options)] == [
        "text_input", "sampling_parameters", "stream", *(name for name, _, _ in flags)]


# --------------------------------------------------------------------------------- responses


class FakeResult:
    """Just what decode_response reads of an InferResult: as_numpy, and the gRPC response's parameters."""

    def __init__(self, outputs: dict[str, np.ndarray], final_flag: bool | None = None) -> None:
        self.outputs = outputs
        self.final_flag = final_flag

    def as_numpy(self, name: str) -> np.ndarray | None:
        return self.outputs.get(name)

    def get_response(self) -> SimpleNamespace:
        parameters = {}
        if self.final_flag is not None:
            parameters["triton_final_response"] = SimpleNamespace(bool_param=self.final_flag)
        return SimpleNamespace(parameters=parameters)


def test_decode_a_batched_final_response():
    result = FakeResult({
        "text_output": np.array([[b"caf", "é".encode()]], dtype=np.object_),
        "output_ids": np.array([[11, 12]], dtype=np.int32),
        "finish_reason": np.array([[b"length"]], dtype=np.object_),
        "num_input_tokens": np.array([[4]], dtype=np.uint32),
        "num_output_tokens": np.array([[2]], dtype=np.uint32),
    })  # fmt: skip
    delta = protocol.decode_response(result)
    assert (delta.text, delta.ids, delta.finish_reason) == ("café", [11, 12], "length")
    assert (delta.num_input_tokens, delta.num_output_tokens, delta.final) == (4, 2, True)
    assert all(type(i) is int for i in delta.ids)


def test_decode_stream_deltas_and_the_empty_final_response():
    delta = protocol.decode_response(FakeResult({"text_output": np.array([b"a"], dtype=np.object_),
                                                 "output_ids": np.array([3], dtype=np.int32),
                                                 "finish_reason": np.array([b"None"], dtype=np.object_)}))
    assert (delta.text, delta.ids, delta.finish_reason, delta.final) == ("a", [3], "", False)
    empty_final = protocol.decode_response(FakeResult({}, final_flag=True))
    assert (empty_final.text, empty_final.ids, empty_final.finish_reason) == ("", [], "")
    assert empty_final.final and empty_final.num_output_tokens == 0


def _raw_response(outputs: list[tuple[str, str, bytes]]):
    service_pb2 = pytest.importorskip("tritonclient.grpc.service_pb2")
    response = service_pb2.ModelInferResponse()
    for name, datatype, raw in outputs:
        out = response.outputs.add()
        out.name, out.datatype = name, datatype
        response.raw_output_contents.append(raw)
    return response


def test_read_response_counts_from_raw_bytes():
    final = _raw_response([("output_ids", "INT32", np.array([7, 8, 9], dtype=np.int32).tobytes()),
                           ("finish_reason", "BYTES", b"\x04\x00\x00\x00stop"),
                           ("num_output_tokens", "UINT32", np.uint32(12).tobytes())])
    assert protocol.read_response_counts(final) == protocol.ResponseCounts(3, 12, "stop")
    delta = _raw_response([("output_ids", "INT32", np.int32(5).tobytes()),
                           ("finish_reason", "BYTES", b"\x04\0\0\0None")])
    assert protocol.read_response_counts(delta) == protocol.ResponseCounts(1, None, "")


# ----------------------------------------------------------------------------- model configs

ORCA_CONFIG = {
    "name": "orca", "max_batch_size": 0,
    "parameters": {"model": {"string_value": "gpt2-tiny"}, "max_num_seqs": {"string_value": "16"},
                   "tokenizer": {}},
}  # fmt: skip
BASELINE_CONFIG = {"name": "baseline", "max_batch_size": 8,
                   "dynamic_batching": {"max_queue_delay_microseconds": "100"}}


def test_config_reads():
    # tritonclient.grpc nests the config under "config"; tritonclient.http returns it bare.
    assert protocol.unwrap_model_config({"config": ORCA_CONFIG}) == ORCA_CONFIG
    assert protocol.unwrap_model_config(BASELINE_CONFIG) == BASELINE_CONFIG
    assert not protocol.is_batched(ORCA_CONFIG) and protocol.is_batched(BASELINE_CONFIG)
    assert not protocol.is_batched({"name": "echo"})
    assert protocol.triton_max_batch_size(BASELINE_CONFIG) == 8
    assert protocol.string_parameters(ORCA_CONFIG) == {"model": "gpt2-tiny", "max_num_seqs": "16",
                                                       "tokenizer": ""}
    assert protocol.string_parameters(BASELINE_CONFIG) == {}


def test_sync_and_async_clients_read_configs_alike():
    calls = []

    class SyncClient:
        def get_model_config(self, model, as_json=False):
            calls.append((model, as_json))
            return {"config": BASELINE_CONFIG}

    class AsyncClient:
        async def get_model_config(self, model, as_json=False):
            calls.append((model, as_json))
            return {"config": BASELINE_CONFIG}

    assert protocol.get_model_config(SyncClient(), "baseline") == BASELINE_CONFIG
    assert asyncio.run(protocol.get_model_config_async(AsyncClient(), "baseline")) == BASELINE_CONFIG
    assert calls == [("baseline", True), ("baseline", True)]


def test_served_model_from_config():
    orca = served_model("orca", ORCA_CONFIG)
    assert (orca.kind, orca.max_num_seqs, orca.max_batch_size, orca.label) == ("orca", 16, None, "orca")
    baseline = served_model("baseline_bs8", BASELINE_CONFIG)
    assert (baseline.kind, baseline.max_batch_size, baseline.max_queue_delay_us) == ("baseline", 8, 100)
    assert baseline.max_num_seqs is None and baseline.label == "baseline (batch 8)"
    assert served_model("echo", {"max_batch_size": 0}).kind == "echo"
    assert served_model("orca", {"max_batch_size": 0}).max_num_seqs is None
