"""From a Triton model configuration to the engine's: what the `orca` and `orca_baseline` backends
fill in when Triton auto-completes a config.pbtxt, which parameters they read, and the model
version's model.json of vLLM engine arguments.

A model repository written for Triton's vLLM backend — a config.pbtxt of one line, `backend: "vllm"`,
and `1/model.json` of vLLM's engine arguments (`multi_lora.json` beside it where adapters are served)
— switches to this engine by changing that line to `backend: "orca"` (iteration-level) or
`backend: "orca_baseline"` (request-level, Triton's dynamic batcher), once the backends are installed
(`orca-serve install-backend`). Auto-complete adds the contract's inputs and outputs and the
transaction policy (or, for the baseline, the dynamic batcher) as the vLLM backend's does.

Where an engine setting comes from, each overriding the one before: the engine's defaults,
model.json (vLLM's names and meanings), config.pbtxt `parameters` (this engine's names, README).
Every model.json argument is either read (`VLLM_ARGS`), accepted and ignored with a reason
(`IGNORED_VLLM_ARGS`), or refused: the load fails naming it, as the vLLM backend fails on an invalid
argument. A config.pbtxt parameter that is neither an engine setting nor one these adapters or
Triton's Python backend read fails the load too.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from orca_backend.config import EngineConfig, parameter_bool, parameter_values

MODEL_JSON = "model.json"
# ENABLE_VLLM_HEALTH_CHECK (the vLLM backend checks its engine at each request): an idle engine is
# pinged this often unless health_check_interval_s says otherwise (config.py).
HEALTH_CHECK_INTERVAL_S = 5.0  # the vLLM backend's file of engine arguments, in the model version's directory

# The contract's tensors (README, "The request/response contract"): Triton's vLLM backend's, with
# input_ids, max_tokens, output_ids and return_perf_metrics's outputs added.
INPUTS: tuple[dict[str, Any], ...] = (
    {"name": "text_input", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "input_ids", "data_type": "TYPE_INT32", "dims": [-1], "optional": True},
    {"name": "max_tokens", "data_type": "TYPE_INT32", "dims": [1], "optional": True},
    {"name": "sampling_parameters", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
    {"name": "stream", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    {"name": "exclude_input_in_output", "data_type": "TYPE_BOOL", "dims": [1], "optional": True},
    *({"name": name, "data_type": "TYPE_BOOL", "dims": [1], "optional": True} for name in (
        "return_finish_reason", "return_cumulative_logprob", "return_logprobs", "return_num_input_tokens",
        "return_num_output_tokens", "return_prompt_logprobs", "return_perf_metrics")),
    # The vLLM backend's input for embedding requests (Triton's OpenAI frontend, /v1/embeddings).
    {"name": "embedding_request", "data_type": "TYPE_STRING", "dims": [1], "optional": True},
)  # fmt: skip
OUTPUTS: tuple[dict[str, Any], ...] = (
    {"name": "text_output", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "output_ids", "data_type": "TYPE_INT32", "dims": [-1]},
    {"name": "finish_reason", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "cumulative_logprob", "data_type": "TYPE_FP32", "dims": [-1]},
    {"name": "logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "prompt_logprobs", "data_type": "TYPE_STRING", "dims": [-1]},
    {"name": "num_input_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_output_tokens", "data_type": "TYPE_UINT32", "dims": [-1]},
    *({"name": name, "data_type": "TYPE_INT64", "dims": [1]} for name in (
        "arrival_time_ns", "first_scheduled_time_ns", "first_token_time_ns", "last_token_time_ns")),
    {"name": "num_preemptions", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "prefix_cache_hit_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_draft_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
    {"name": "num_accepted_draft_tokens", "data_type": "TYPE_UINT32", "dims": [1]},
)  # fmt: skip
BASELINE_MAX_BATCH_SIZE = 32  # the baseline's batch when config.pbtxt gives none (its checked-in one)
BASELINE_QUEUE_DELAY_US = 10_000


def auto_complete(config: Any, batching: bool) -> Any:
    """Fills a pb_utils.ModelConfig (Triton's auto-complete): the contract's inputs and outputs it does
    not declare, and how requests arrive — decoupled with no Triton batching (`orca`), or Triton's
    dynamic batcher (`batching`: the baseline). What config.pbtxt declares stays."""
    declared = config.as_dict()
    inputs = {tensor["name"] for tensor in declared.get("input", [])}
    outputs = {tensor["name"] for tensor in declared.get("output", [])}
    # Auto-complete may set no more than name, data_type, dims and optional (Triton 2.51): a baseline
    # whose config.pbtxt does not declare input_ids with allow_ragged_batch (the checked-in one does)
    # batches only id prompts of equal length together; text prompts batch whatever their length.
    for tensor in INPUTS:
        if tensor["name"] not in inputs:
            config.add_input(tensor)
    for tensor in OUTPUTS:
        if tensor["name"] not in outputs:
            config.add_output(tensor)
    if not batching:
        config.set_model_transaction_policy({"decoupled": True})
        config.set_max_batch_size(0)
    else:
        if int(declared.get("max_batch_size", 0) or 0) == 0:
            config.set_max_batch_size(BASELINE_MAX_BATCH_SIZE)
        if "dynamic_batching" not in declared:
            config.set_dynamic_batching()
    return config


# ------------------------------------------------------------------------------ config.pbtxt
# Read by Triton's Python backend itself, or by the vLLM backend (and here): never refused.
TRITON_PARAMETERS = frozenset({"EXECUTION_ENV_PATH", "FORCE_CPU_ONLY_INPUT_TENSORS", "REPORT_CUSTOM_METRICS",
                               "ENABLE_VLLM_HEALTH_CHECK"})  # fmt: skip
_ENGINE_PARAMETERS = frozenset(f.name for f in fields(EngineConfig)) - {"lora_modules"}


def check_parameters(parameters: Mapping[str, Any], adapter_parameters: frozenset[str] = frozenset()) -> None:
    """Refuses config.pbtxt parameters nothing reads (a typo would otherwise leave a setting at its
    default), naming them; `adapter_parameters` are the model adapter's own (`stream_interval`)."""
    known = _ENGINE_PARAMETERS | TRITON_PARAMETERS | adapter_parameters
    unknown = sorted(set(parameters) - known)
    if unknown:
        raise ValueError(f"config.pbtxt parameters {', '.join(unknown)} are not read by this backend: check the "
                         "spelling (README, Configuration lists them)")  # fmt: skip


def report_custom_metrics(parameters: Mapping[str, Any], model_json: Mapping[str, Any]) -> bool:
    """Whether the model exports its metrics: unless REPORT_CUSTOM_METRICS says false, or model.json's
    disable_log_stats true (the vLLM backend exports none unless the parameter is true: this engine's
    default is on, README says so)."""
    value = parameter_values(parameters).get("REPORT_CUSTOM_METRICS", "")
    if value and not parameter_bool("REPORT_CUSTOM_METRICS", value):
        return False
    return not _bool(model_json.get("disable_log_stats", False), "disable_log_stats")


# ------------------------------------------------------------------------------ model.json
def _same(name: str) -> Callable[[Any], dict[str, str]]:
    return lambda value: {name: _text(value)}


def _dtype(value: Any) -> dict[str, str]:
    names = {"float32": "float32", "float": "float32", "bfloat16": "bfloat16", "float16": "float16", "half": "float16"}
    if value == "auto":  # vLLM's default: the checkpoint's own; here, the engine's (README, Configuration)
        return {}
    if value not in names:
        raise ValueError(f"dtype {value!r} is not one of auto, {', '.join(names)}")
    return {"dtype": names[value]}


def _chunked_prefill(value: Any) -> dict[str, str]:
    # vLLM V1 chunks long prompts by default with a 2,048-token budget (its online-serving default);
    # max_num_batched_tokens, where model.json gives it, is the budget (vLLM's meaning too).
    return {"max_num_batched_tokens": "2048"} if _bool(value, "enable_chunked_prefill") else {}


def _calculate_kv_scales(value: Any) -> dict[str, str]:
    if _bool(value, "calculate_kv_scales"):
        raise ValueError("calculate_kv_scales is not served: scales from the first batch would make every later "
                         "answer depend on which request came first; FP8 K/V uses the checkpoint's k_scale/v_scale, "
                         "else 1.0 (README, kv_cache_dtype)")  # fmt: skip
    return {}


def _executor(value: Any) -> dict[str, str]:
    if value not in ("mp", "ray"):
        raise ValueError(f"distributed_executor_backend {value!r} is not supported (mp and ray are)")
    return {"distributed_executor_backend": value}


# vLLM engine argument -> this engine's parameters, with vLLM's meaning.
VLLM_ARGS: dict[str, Callable[[Any], dict[str, str]]] = {
    **{name: _same(name) for name in (
        "model", "tokenizer", "max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size",
        "enable_prefix_caching", "tensor_parallel_size", "pipeline_parallel_size", "enforce_eager",
        "kv_cache_memory_bytes", "gpu_memory_utilization", "enable_lora", "max_loras", "max_lora_rank",
        "max_cpu_loras", "seed", "async_scheduling", "device", "quantization", "kv_cache_dtype", "swap_space",
        "disable_hybrid_kv_cache_manager")},
    "dtype": _dtype,
    "enable_chunked_prefill": _chunked_prefill,
    "distributed_executor_backend": _executor,
    "calculate_kv_scales": _calculate_kv_scales,
    "disable_log_stats": lambda value: {},  # read by report_custom_metrics
    "kv_events_config": lambda value: {"kv_events_config": value if isinstance(value, str) else json.dumps(value)},
    "speculative_config": lambda value: {"speculative_config": value if isinstance(value, str) else json.dumps(value)},
}  # fmt: skip
# Accepted and ignored: each changes nothing this engine does (the reason says why).
IGNORED_VLLM_ARGS = {
    "disable_log_requests": "request logging is Triton's (--log-verbose)",
    "enable_log_requests": "request logging is Triton's (--log-verbose)",
    "trust_remote_code": "no checkpoint code is ever run: every supported architecture is built in",
    "tokenizer_mode": "the tokenizer is the checkpoint's tokenizer.json, read by the tokenizers library",
    "load_format": "weights load from safetensors, the only format read",
    "served_model_name": "Triton serves the model under its repository name",
    "disable_custom_all_reduce": "tensor-parallel reductions are torch.distributed's",
    "max_seq_len_to_capture": "CUDA graphs are captured per batch size, for any context",
    "max_logprobs": "logprobs are bounded per request by the sampling parameters' own limit",
}


def read_model_json(path: Path) -> dict[str, Any]:
    """The model version's model.json ({} when there is none); ValueError if it is not a JSON object."""
    if not path.is_file():
        return {}
    try:
        args = json.loads(path.read_text())
    except ValueError as exc:
        raise ValueError(f"{path} is not valid JSON: {exc}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{path} must hold a JSON object of vLLM engine arguments, got {type(args).__name__}")
    return args


def vllm_parameters(args: Mapping[str, Any], source: str = MODEL_JSON) -> dict[str, str]:
    """model.json's engine arguments as this engine's parameters (strings, as config.pbtxt gives
    them); ValueError naming an argument that is unknown or cannot be honoured."""
    unknown = sorted(set(args) - set(VLLM_ARGS) - set(IGNORED_VLLM_ARGS))
    if unknown:
        raise ValueError(f"{source}: unsupported engine argument(s) {', '.join(unknown)}; README, \"Switching from "
                         "Triton's vLLM backend\", lists those read and those ignored")  # fmt: skip
    # vLLM's default device is auto (the GPU where there is one): a model.json that names none gets it.
    parameters: dict[str, str] = {"device": "auto"} if args else {}
    for name, value in args.items():
        if name in VLLM_ARGS and value is not None:
            try:
                parameters.update(VLLM_ARGS[name](value))
            except ValueError as exc:
                raise ValueError(f"{source}: {exc}") from None
    return parameters


def engine_config(triton_config: Mapping[str, Any], model_json: Mapping[str, Any],
                  adapter_parameters: frozenset[str] = frozenset(), **forced: Any) -> EngineConfig:  # fmt: skip
    """The engine's config: model.json's arguments, then config.pbtxt's parameters over them, then
    the fields the adapter owns (`forced`). A pool size in config.pbtxt (kv_capacity_tokens or
    kv_cache_memory_bytes) overrides model.json's gpu_memory_utilization, as any parameter does."""
    parameters = triton_config.get("parameters", {}) or {}
    check_parameters(parameters, adapter_parameters)
    values = parameter_values(parameters)
    from_json = vllm_parameters(model_json)
    if {"kv_capacity_tokens", "kv_cache_memory_bytes"} & values.keys():
        from_json.pop("gpu_memory_utilization", None)
    config = EngineConfig.from_parameters({**from_json, **values})
    if values.get("ENABLE_VLLM_HEALTH_CHECK", "").lower() == "true" and not config.health_check_interval_s:
        forced = {"health_check_interval_s": HEALTH_CHECK_INTERVAL_S, **forced}
    return dataclasses.replace(config, **forced)


def _text(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _bool(value: Any, name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise ValueError(f"{name} must be true or false, got {value!r}")
