"""From a Triton model configuration to the engine's (server/triton_config.py), without a server:
vLLM's model.json arguments with vLLM's meaning, their precedence under config.pbtxt parameters,
refusals that name what they refuse, and the engine settings they reach."""

from __future__ import annotations

import dataclasses
import json

import pytest

from orca_backend.config import EngineConfig, hub_snapshot
from orca_backend.core.engine_core import resolved_config
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.families import PRESETS
from orca_backend.sampling_params import SamplingParams
from orca_backend.server.triton_config import (
    IGNORED_VLLM_ARGS,
    INPUTS,
    OUTPUTS,
    auto_complete,
    check_parameters,
    engine_config,
    report_custom_metrics,
    vllm_parameters,
)


def pbtxt(**parameters: str) -> dict:
    return {"parameters": {key: {"string_value": value} for key, value in parameters.items()}}


def test_model_json_reaches_the_engine_with_vllms_meaning():
    config = engine_config(pbtxt(), {
        "model": "gpt2-tiny", "dtype": "half", "max_num_seqs": 7, "max_model_len": 128, "block_size": 32,
        "enable_prefix_caching": True, "enforce_eager": True, "enable_chunked_prefill": True, "seed": 3,
        "tensor_parallel_size": 1, "distributed_executor_backend": "mp", "enable_lora": True, "max_loras": 2,
        "max_lora_rank": 8, "async_scheduling": False, "kv_cache_memory_bytes": 2**20, "kv_cache_dtype": "fp8",
        "swap_space": 2, "calculate_kv_scales": False, "disable_hybrid_kv_cache_manager": True,
    })  # fmt: skip
    assert (config.model, config.dtype, config.max_num_seqs, config.max_model_len, config.block_size) == (
        "gpt2-tiny", "float16", 7, 128, 32)
    assert config.enable_prefix_caching and config.enforce_eager and config.enable_lora
    assert (config.max_num_batched_tokens, config.seed, config.max_loras, config.max_lora_rank) == (2048, 3, 2, 8)
    assert config.device == "auto"  # vLLM's default where model.json names none
    assert config.kv_cache_memory_bytes == 2**20
    assert config.kv_cache_dtype == "fp8" and float(config.swap_space) == 2.0
    assert config.disable_hybrid_kv_cache_manager is True


def test_config_pbtxt_parameters_override_model_json_and_the_adapter_forces_its_own():
    config = engine_config(pbtxt(max_num_seqs="5", device="cpu"), {"model": "gpt2-tiny", "max_num_seqs": 9},
                           scheduling="request")  # fmt: skip
    assert (config.max_num_seqs, config.device, config.scheduling) == (5, "cpu", "request")
    assert engine_config(pbtxt(model="gpt2-tiny"), {}).device == "cpu"  # no model.json: this engine's default


@pytest.mark.parametrize(("args", "message"), [
    ({"swap_spaec": 4}, "unsupported engine argument(s) swap_spaec"),
    ({"cpu_offload_gb": 4, "kv_transfer_config": {}}, "unsupported engine argument(s) cpu_offload_gb, kv_transfer_config"),
    ({"dtype": "float64"}, "dtype 'float64' is not one of auto"),
    ({"enable_chunked_prefill": "maybe"}, "enable_chunked_prefill must be true or false"),
    ({"distributed_executor_backend": "uni"}, "distributed_executor_backend 'uni' is not supported"),
    ({"calculate_kv_scales": True}, "calculate_kv_scales is not served"),
])  # fmt: skip
def test_model_json_arguments_nothing_honours_are_refused_by_name(args, message):
    with pytest.raises(ValueError, match="model.json: ") as failure:
        vllm_parameters(args)
    assert message in str(failure.value)


def test_harmless_vllm_arguments_are_accepted_and_change_nothing():
    assert vllm_parameters(dict.fromkeys(IGNORED_VLLM_ARGS, True)) == {"device": "auto"}
    assert vllm_parameters({"dtype": "auto", "enable_chunked_prefill": False}) == {"device": "auto"}


def test_config_pbtxt_parameters_nothing_reads_fail_the_load_by_name():
    check_parameters(pbtxt(max_num_seqs="4", REPORT_CUSTOM_METRICS="true", EXECUTION_ENV_PATH="x")["parameters"])
    check_parameters({"stream_interval": "2"}, frozenset({"stream_interval"}))
    with pytest.raises(ValueError, match="max_num_seq, stream_interval are not read"):
        check_parameters({"max_num_seq": "4", "stream_interval": "2"})  # the baseline reads no stream_interval
    with pytest.raises(ValueError, match="kv_capacity_token "):
        engine_config(pbtxt(kv_capacity_token="64"), {})


@pytest.mark.parametrize(("parameters", "model_json", "on"), [
    ({}, {}, True),  # this engine's default (the vLLM backend's is off)
    ({"REPORT_CUSTOM_METRICS": {"string_value": "true"}}, {}, True),
    ({"REPORT_CUSTOM_METRICS": {"string_value": "false"}}, {}, False),
    ({"REPORT_CUSTOM_METRICS": {"string_value": "true"}}, {"disable_log_stats": True}, False),
])  # fmt: skip
def test_metrics_are_off_as_the_vllm_backend_switches_them_off(parameters, model_json, on):
    assert report_custom_metrics(parameters, model_json) is on


class FakeModelConfig:
    """pb_utils.ModelConfig as auto-complete sees it."""

    def __init__(self, declared: dict) -> None:
        self.declared = {"input": [], "output": [], **declared}
        self.policy: dict | None = None
        self.dynamic_batching = False

    def as_dict(self) -> dict:
        return self.declared

    def add_input(self, tensor: dict) -> None:
        self.declared["input"].append(tensor)

    def add_output(self, tensor: dict) -> None:
        self.declared["output"].append(tensor)

    def set_model_transaction_policy(self, policy: dict) -> None:
        self.policy = policy

    def set_max_batch_size(self, size: int) -> None:
        self.declared["max_batch_size"] = size

    def set_dynamic_batching(self) -> None:
        self.dynamic_batching = True


def test_auto_complete_adds_the_contract_and_keeps_what_config_pbtxt_declares():
    declared_text = {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1]}  # required here: kept so
    orca = auto_complete(FakeModelConfig({"input": [declared_text]}), batching=False)
    assert orca.as_dict()["input"][0] is declared_text
    assert [t["name"] for t in orca.as_dict()["input"]] == [t["name"] for t in INPUTS]
    assert [t["name"] for t in orca.as_dict()["output"]] == [t["name"] for t in OUTPUTS]
    assert orca.policy == {"decoupled": True} and orca.as_dict()["max_batch_size"] == 0
    baseline = auto_complete(FakeModelConfig({}), batching=True)
    assert baseline.policy is None and baseline.dynamic_batching and baseline.as_dict()["max_batch_size"] == 32
    sized = auto_complete(FakeModelConfig({"max_batch_size": 4, "dynamic_batching": {}}), batching=True)
    assert sized.as_dict()["max_batch_size"] == 4 and not sized.dynamic_batching


def test_kv_cache_memory_bytes_becomes_whole_blocks_of_this_ranks_kv():
    model = PRESETS["llama-tiny"]
    per_token = 2 * 4 * model.num_layers * model.num_kv_heads * model.head_dim  # K and V, float32
    config = EngineConfig(model="llama-tiny", kv_cache_memory_bytes=per_token * 100, block_size=16)
    assert config.with_kv_capacity(model).kv_capacity_tokens == 96  # 100 tokens' bytes: 6 whole blocks
    half = dataclasses.replace(config, dtype="bfloat16")
    assert half.with_kv_capacity(model).kv_capacity_tokens == 192
    assert EngineConfig(model="llama-tiny").with_kv_capacity(model).kv_capacity_tokens == 16384  # unset: as given
    with pytest.raises(ValueError, match="less than one block"):
        EngineConfig(model="llama-tiny", kv_cache_memory_bytes=per_token).with_kv_capacity(model)


def test_max_model_len_bounds_requests_below_the_models_context():
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", max_model_len=16))
    try:
        engine.validate([1, 2, 3], SamplingParams(max_tokens=13))
        with pytest.raises(ValueError, match="exceeds max_model_len of 16 tokens"):
            engine.validate([1, 2, 3], SamplingParams(max_tokens=14))
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="exceeds the model's context"):
        LLMEngine(EngineConfig(model="gpt2-tiny", max_model_len=10**6))


def test_device_auto_is_the_machines():
    assert resolved_config(EngineConfig(device="auto")).device == "cpu"  # no CUDA device in CI
    assert resolved_config(EngineConfig(device="cpu", gpu_memory_utilization=0.9)).device == "cpu"


def test_unset_async_scheduling_is_on_where_it_applies_on_cuda_and_off_elsewhere():
    """Resolved from the settings alone (no device is opened): on for one CUDA process scheduling by
    iterations; off on a CPU, for the request-level baseline and for several ranks; a value given stays."""
    assert resolved_config(EngineConfig(device="cuda")).async_scheduling is True
    assert resolved_config(EngineConfig(device="cuda:1")).async_scheduling is True
    assert resolved_config(EngineConfig(device="cuda", async_scheduling=False)).async_scheduling is False
    assert resolved_config(EngineConfig(device="auto")).async_scheduling is False  # auto is a CPU in CI
    assert resolved_config(EngineConfig(device="cpu", async_scheduling=True)).async_scheduling is True
    for off in ({"scheduling": "request"}, {"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}):
        assert resolved_config(EngineConfig(device="cuda", **off)).async_scheduling is False, off
    # config.pbtxt and model.json values parse as booleans; absent stays unset.
    assert EngineConfig.from_parameters({"async_scheduling": "false"}).async_scheduling is False
    assert EngineConfig.from_parameters({"async_scheduling": "true"}).async_scheduling is True
    assert EngineConfig.from_parameters({}).async_scheduling is None
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig.from_parameters({"async_scheduling": "sometimes"})


def test_a_pool_size_in_config_pbtxt_overrides_model_jsons_gpu_memory_utilization():
    model_json = {"model": "gpt2-tiny", "gpu_memory_utilization": 0.5}
    assert engine_config(pbtxt(), model_json).gpu_memory_utilization == 0.5
    for parameter, value in (("kv_capacity_tokens", "4096"), ("kv_cache_memory_bytes", "1048576")):
        config = engine_config(pbtxt(**{parameter: value}), model_json)
        assert config.gpu_memory_utilization == 0.0 and str(getattr(config, parameter)) == value


def test_a_hub_id_reads_the_hugging_face_cache_or_fails_naming_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    repo = tmp_path / "models--org--tiny"
    snapshot = repo / "snapshots" / "abc123"
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    assert hub_snapshot("org/tiny") is None  # no config.json: not a download
    (snapshot / "config.json").write_text("{}")
    assert hub_snapshot("org/tiny") == snapshot
    assert EngineConfig(model="org/tiny").model == str(snapshot)
    with pytest.raises(ValueError, match="reaches no model hub: download it first"):
        EngineConfig(model="org/missing").model_config()


def test_model_json_speculative_config_reaches_the_engine_as_vllm_names_it():
    """vLLM's speculative_config, a JSON object in model.json, is the engine's parameter; a method
    not served is refused at load with its name."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2}
    parameters = vllm_parameters({"speculative_config": spec})
    assert json.loads(parameters["speculative_config"]) == spec
    config = EngineConfig.from_parameters(parameters)
    assert config.speculative().prompt_lookup_max == 2
    with pytest.raises(ValueError, match="method 'medusa' is not served"):
        EngineConfig.from_parameters(vllm_parameters({"speculative_config": {"method": "medusa", "model": "x"}}))
