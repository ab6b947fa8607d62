"""The engine's configuration: its tuning knobs (`EngineConfig`) and the checks a model config must pass
against them. Each model family's own config (geometry, config.json parsing, presets) is its module in
orca_backend/families/.

Every knob a deployment tunes is also a config.pbtxt `parameters` entry (see
`EngineConfig.from_parameters`), so the offline API and the Triton model share one definition.
Plain data only: importing this module must not import torch (the client and orca-serve read it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from orca_backend.families import PRESETS, AnyModelConfig, config_from_hf_dict, family_of
from orca_backend.sampling_params import PoolingConfig, read_pooling_config

DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name: see orca_backend.model.device
# kv_cache_dtype (vLLM's values): "auto" stores K/V in the model's dtype; fp8 (= fp8_e4m3) and fp8_e5m2
# in one byte per element, with per-layer scales (model/kv_scales.py, kernels' attention.py).
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")


def _json_object(text: str, name: str, cls: type) -> dict[str, Any]:
    """`text`, the JSON object config `name` holds (`cls`'s fields); ValueError naming it otherwise."""
    try:
        values = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{name} is not valid JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{name} must be a JSON object of vLLM's {cls.__name__} fields")
    return values


def _json_fields(text: str, name: str, cls: type, values: dict[str, Any] | None = None) -> dict[str, Any]:
    """`_json_object`'s values (or `values`, already read from it), refusing a field `cls` lacks."""
    values = _json_object(text, name, cls) if values is None else values
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
        raise ValueError(f"{name}: unknown field(s) {', '.join(unknown)} (known: {', '.join(sorted(known))})")
    return values


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's `kv_events_config` (its names and defaults): where the prefix cache's K/V events go
    (core/kv_events.py)."""

    enable_kv_cache_events: bool = False
    publisher: str = "null"  # "zmq", or "null": none
    endpoint: str = "tcp://*:5557"  # bound when it has a wildcard (or is ipc/inproc), else connected to
    replay_endpoint: str | None = None  # a ROUTER socket that resends buffered batches on request
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # the PUB socket's high-water mark
    max_queue_size: int = 100_000  # batches waiting for the publisher thread
    topic: str = ""

    @classmethod
    def from_json(cls, text: str) -> KVEventsConfig:
        config = cls(**_json_fields(text, "kv_events_config", cls))
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"kv_events_config: publisher must be 'zmq' or 'null', got {config.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            if not isinstance(getattr(config, name), int) or getattr(config, name) < 1:
                raise ValueError(f"kv_events_config: {name} must be an integer >= 1, got {getattr(config, name)!r}")
        return config


# The proposers built: n-gram lookup in the engine core (core/ngram_proposer.py), a draft model in the
# model runner (worker/draft_proposer.py).
SPECULATIVE_METHODS = ("ngram", "draft_model", "eagle", "eagle3")
# The methods whose proposals a model in the model runner makes (the scheduler leaves it placeholders).
RUNNER_SPECULATIVE_METHODS = ("draft_model", "eagle", "eagle3")
# vLLM's other methods: refused at load, by name, until their proposer is built here.
UNBUILT_SPECULATIVE_METHODS = ("medusa", "mlp_speculator", "mtp", "suffix")


@dataclass(frozen=True)
class SpeculativeConfig:
    """vLLM's `speculative_config` (its names): how a running request's next tokens are proposed and
    verified in one step (docs/architecture.md, "Speculative decoding"). `method` "ngram" proposes
    the tokens that followed the latest earlier occurrence of the request's last n tokens (prompt
    lookup), n from `prompt_lookup_max` down to `prompt_lookup_min`; vLLM takes one of them for the
    other when only one is given. "draft_model" runs `model`, a smaller checkpoint with the target's
    vocabulary, greedily for `num_speculative_tokens` tokens (vLLM takes that method when a model is
    named without one). "eagle" runs `model`, an EAGLE head (vLLM's EagleLlamaForCausalLM
    checkpoints), greedily over the target's own hidden states, embedding and LM head; "eagle3" an
    EAGLE-3 head (Eagle3LlamaForCausalLM) over three of the target's layers' hidden states."""

    method: str = "ngram"
    num_speculative_tokens: int = 0
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft_model: a preset name or a checkpoint directory
    # No request proposes in a step while more than this many run (vLLM's name; where a batch fills
    # the device, verifying proposals costs more than it saves). None: always.
    disable_by_batch_size: int | None = None
    # This engine's own (not vLLM's): a request whose proposals keep being rejected pauses them,
    # longer after each further fruitless round, never for more than this many of its steps (the
    # scheduler's SPEC_PAUSE_*). 0: every decode proposes, as vLLM's do.
    max_pause_steps: int = 256

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        values = _json_object(text, "speculative_config", cls)
        if values.get("model") in ("ngram", "[ngram]") and "method" not in values:  # vLLM's older spelling
            values = {**{k: v for k, v in values.items() if k != "model"}, "method": "ngram"}
        method = values.setdefault("method", "draft_model" if values.get("model") else "ngram")
        if method in UNBUILT_SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: method {method!r} is not served by this engine yet (served: "
                             f"{', '.join(SPECULATIVE_METHODS)}); README, \"Speculative decoding\"")  # fmt: skip
        if method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative_config: unknown method {method!r} (served: {', '.join(SPECULATIVE_METHODS)})")
        values = _json_fields(text, "speculative_config", cls, values)
        if method in RUNNER_SPECULATIVE_METHODS:
            if not values.get("model") or not isinstance(values["model"], str):
                what = "the draft checkpoint" if method == "draft_model" else "the EAGLE head's checkpoint"
                raise ValueError(f"speculative_config: method {method!r} needs model, {what}")
            if {"prompt_lookup_min", "prompt_lookup_max"} & set(values):
                raise ValueError(f"speculative_config: prompt_lookup_min/max are the ngram method's, not {method}'s")
        elif values.get("model") is not None:
            raise ValueError(f"speculative_config: method {method!r} takes no model")
        else:
            low, high = values.get("prompt_lookup_min"), values.get("prompt_lookup_max")
            values["prompt_lookup_min"] = low if low is not None else high if high is not None else 5
            values["prompt_lookup_max"] = high if high is not None else values["prompt_lookup_min"]
        config = cls(**values)
        lookups = ("prompt_lookup_min", "prompt_lookup_max") if method == "ngram" else ()
        optional = ("disable_by_batch_size",) if config.disable_by_batch_size is not None else ()
        for name in ("num_speculative_tokens", *lookups, *optional, "max_pause_steps"):
            value, least = getattr(config, name), 0 if name == "max_pause_steps" else 1
            if not isinstance(value, int) or isinstance(value, bool) or value < least:
                raise ValueError(f"speculative_config: {name} must be an integer >= {least}, got {value!r}")
        if config.num_speculative_tokens > MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"speculative_config: num_speculative_tokens must be at most {MAX_SPECULATIVE_TOKENS}, "
                             f"got {config.num_speculative_tokens}")  # fmt: skip
        if method == "ngram" and config.prompt_lookup_min > config.prompt_lookup_max:  # type: ignore[operator]
            raise ValueError(f"speculative_config: prompt_lookup_min ({config.prompt_lookup_min}) must be at most "
                             f"prompt_lookup_max ({config.prompt_lookup_max})")  # fmt: skip
        return config


MAX_SPECULATIVE_TOKENS = 16  # proposals per request per step: a verify step's query stays short


@dataclass
class EngineConfig:
    model: str = "gpt2-tiny"  # local HF checkpoint directory, or a preset name from PRESETS
    tokenizer: str | None = None  # tokenizer.json or a directory holding one; default: the model dir's
    device: str = "cpu"  # cpu, cuda, cuda:N, or auto: cuda when the engine core sees a CUDA device, else cpu
    dtype: str = "float32"
    max_num_seqs: int = 32  # requests in one iteration (Triton's max_batch_size is the baseline batcher's)
    kv_capacity_tokens: int = 16384  # K/V pool size in token slots, per layer (whole blocks of it are used)
    # vLLM's names. kv_cache_memory_bytes: the pool in bytes per rank instead (kv_capacity_tokens is
    # derived from it and the model's K/V geometry, `with_kv_capacity`). gpu_memory_utilization: the
    # share of a GPU's memory the engine may use, the pool taking what the weights, the largest step's
    # activations and memory outside torch leave (worker/kv_pool.py; kv_capacity_tokens is then what
    # the engine core finds). kv_cache_memory_bytes wins over it; a CPU engine ignores it, as vLLM's
    # CPU build does.
    kv_cache_memory_bytes: int = 0
    gpu_memory_utilization: float = 0.0
    # vLLM's name: "auto" (the model's dtype) or FP8 (fp8 / fp8_e4m3, fp8_e5m2), one byte an element:
    # K/V quantized on write with per-K/V-head scales (the checkpoint's k_scale / v_scale, else 1.0, as
    # vLLM), read back in every attention kernel. The draft model of speculative decoding keeps its
    # own K/V in the model's dtype.
    kv_cache_dtype: str = "auto"
    # vLLM's (v0) name: GiB of host memory per rank for the K/V pool's host tier. A request preempted
    # for lack of blocks is swapped there (its K/V copied out, and back when it resumes) instead of
    # being recomputed, while there is room; with prefix caching, cached blocks the device evicts are
    # kept there too (least recently stored dropped first) and copied back on a hit. 0: no host tier.
    swap_space: float = 0.0
    max_model_len: int = 0  # prompt + max_tokens of a request at most this (0: the model's context)
    # "paged" (vLLM): blocks as the context grows, preempting the newest request when they run out;
    # "reserve" (ORCA): blocks for prompt + max_tokens at admission, never preempted.
    kv_policy: str = "paged"
    # vLLM's name. A model whose layers attend within different windows (Gemma 2/3: local and global
    # layers) gets a block table per group of layers alike, local groups giving back blocks behind
    # their window (orca_backend/kv_groups.py), under the paged policy; true: one table for every layer.
    disable_hybrid_kv_cache_manager: bool = False
    block_size: int = 16  # K/V slots per block
    enable_prefix_caching: bool = False  # share the K/V of full blocks of equal prefixes
    # vLLM's kv_events_config (JSON, `KVEventsConfig`): publish what the prefix cache stores and evicts
    # for KV-aware routers (core/kv_events.py). "": none.
    kv_events_config: str = ""
    max_num_batched_tokens: int = 0  # tokens per iteration, long prompts chunked to fit; 0: no limit
    # vLLM's speculative_config (JSON, `SpeculativeConfig`): each running request's next tokens are
    # proposed and verified with its last one in the same step. "": none.
    speculative_config: str = ""
    # vLLM's `quantization` engine argument: the method the checkpoint's quantization_config must
    # declare ("awq", "gptq", "compressed-tensors", "fp8"; vLLM's kernel names awq_marlin and
    # gptq_marlin are the same formats). "": whatever the checkpoint declares. Nothing is quantized
    # at load: a method over an unquantized checkpoint (vLLM's online FP8) is refused.
    quantization: str = ""
    kv_watermark: float = 0.01  # paged: share of blocks admission leaves free for running requests
    # Admission control: requests accepted but not started (no token yet) beyond these are refused
    # at once with a retry-later error; 0 means no limit.
    max_queued_requests: int = 0
    max_queued_prompt_tokens: int = 0
    # Watchdog (served engines): with requests outstanding and no iteration finished for this long,
    # the engine core process is killed and every request ends with an error; 0 turns it off. A Ray
    # worker pool (offline too) fails when a step's tokens take this long (executor/ray_executor.py).
    iteration_timeout_s: float = 60.0
    # Health check of an idle engine (served engines; ENABLE_VLLM_HEALTH_CHECK sets it, as the vLLM
    # backend's name): with nothing outstanding, the frontend pings the core's loop this often, and an
    # unanswered ping counts as a hung iteration (iteration_timeout_s), so a wedged engine turns the model
    # unready before any request finds it. 0: off (a request finds it, after iteration_timeout_s).
    health_check_interval_s: float = 0.0
    # Failure budget: this many failed iterations in a row end the engine (a sticky device error
    # fails every batch); 0 never does.
    max_consecutive_failed_iterations: int = 10
    # One JSON line per iteration appended to this file (core/iteration_log.py); "" turns it off.
    iteration_log: str = ""
    # Limits a deployment sets on each request, checked before it reaches the engine (0: none).
    max_input_tokens: int = 0  # prompt tokens; the model's context length bounds it anyway
    max_stop_sequences: int = 16  # stop strings per request
    max_stop_length: int = 256  # characters per stop string
    max_request_bytes: int = 4 * 2**20  # a served request's inputs and parameters, before any decoding
    # Structured output: a constraint's size (schema JSON, regex, grammar or choices, in bytes) and a
    # JSON schema's nesting depth (of its objects and arrays), checked before anything compiles (an
    # array schema nested 800 deep took 48 s to compile; 64 deep, 13 ms); a grammar that has not
    # compiled after the timeout fails its request alone with INVALID_ARG, and the compiles queued
    # behind it go on on a fresh thread.
    max_structured_output_bytes: int = 64 * 2**10
    max_structured_output_depth: int = 64
    structured_output_compile_timeout_s: float = 30.0
    # Priorities: a waiting request gains one priority level (lower is served first) per this many
    # seconds it waits, so no class starves; 0 turns aging off (strict priority). Accepted priorities
    # lie in [-max_priority, max_priority] (Unix nice levels' span by default), so at most
    # 2 * max_priority * priority_aging_s (400 s) of waiting closes any gap between two classes.
    priority_aging_s: float = 10.0
    max_priority: int = 20
    scheduling: str = "iteration"  # "iteration" (ORCA) or "request" (the baseline's batch-to-completion)
    seed: int = 0  # weights of presets, and the RNG of unseeded sampling
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kernels: str = "auto"  # "auto" | "triton" | "cpu" | "torch" (see orca_kernels.dispatch)
    # CUDA: steps replay CUDA graphs captured at load, per batch size (decode-only steps) or token count
    # (steps with prompt tokens; worker/cuda_graphs.py); True runs every step eagerly (vLLM's name).
    # Graphs are CUDA and tp = pp = 1 only.
    enforce_eager: bool = False
    # Schedule step N+1 while step N runs (vLLM's name): a request's token from N reaches N+1 on the
    # device, and the host's work of a step overlaps the model's. tp = pp = 1, iteration-level only.
    # None (unset): on where that applies on a CUDA device (its tokens equal the synchronous engine's
    # there, tests/model/test_cuda.py), off on a CPU, whose cores run the model and the host's work
    # alike (`resolved_config` decides when the engine starts).
    async_scheduling: bool | None = None
    # Multi-LoRA (vLLM's names): requests name an adapter (`lora_name`) of `lora_modules` ({name: PEFT
    # adapter directory}; served: the model's multi_lora.json); `max_loras` adapters are resident at
    # once (the others wait, evicted least recently used), each of rank at most `max_lora_rank`;
    # `max_cpu_loras` keep their weights in host memory (0: as many as max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    lora_modules: dict[str, str] = field(default_factory=dict)
    # Served: re-read multi_lora.json when it changes, adding and removing adapters at run time (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); every adapter must then lie in lora_allowed_dir.
    allow_runtime_lora_updating: bool = False
    lora_allowed_dir: str = ""
    # Where tp x pp > 1 ranks run (vLLM's name): "mp", worker processes on this host, or "ray", actors
    # on the Ray cluster at ray_address (executor/ray_executor.py), placed by a placement group.
    distributed_executor_backend: str = "mp"
    ray_address: str = "auto"
    ray_placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        if self.model not in PRESETS and not Path(self.model).exists() and HUB_ID.fullmatch(self.model):
            snapshot = hub_snapshot(self.model)
            if snapshot is not None:  # a hub id, as vLLM's model.json names models: the cached download
                self.model = str(snapshot)
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduling not in ("iteration", "request"):
            raise ValueError(f"scheduling must be 'iteration' or 'request', got {self.scheduling!r}")
        if not float(self.swap_space) >= 0:
            raise ValueError(f"swap_space must be >= 0 GiB (0: no host tier), got {self.swap_space!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r} "
                             "(int8 and fp8_inc K/V caches are not served)")  # fmt: skip
        if self.kv_policy not in ("reserve", "paged"):
            raise ValueError(f"kv_policy must be 'reserve' or 'paged', got {self.kv_policy!r}")
        if int(self.block_size) < 1 or int(self.kv_capacity_tokens) < int(self.block_size):
            raise ValueError(f"block_size must be >= 1 and at most kv_capacity_tokens ({self.kv_capacity_tokens}), "
                             f"got {self.block_size!r}")  # fmt: skip
        if int(self.max_num_batched_tokens) < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 1, or 0 for no limit, got {self.max_num_batched_tokens!r}")
        events = self.kv_events()
        if events is not None and events.enable_kv_cache_events and not self.enable_prefix_caching:
            raise ValueError("kv_events_config enables K/V cache events, which describe the prefix cache: set "
                             "enable_prefix_caching too")  # fmt: skip
        speculative = self.speculative()  # a bad speculative_config fails here, naming the field
        if speculative is not None and speculative.method in RUNNER_SPECULATIVE_METHODS and (
                int(self.tensor_parallel_size) != 1 or int(self.pipeline_parallel_size) != 1):  # fmt: skip
            raise ValueError(f"speculative_config: method {speculative.method!r} runs in one process "
                             "(tensor_parallel_size = pipeline_parallel_size = 1); the ngram method serves any "
                             "layout")  # fmt: skip
        if float(self.health_check_interval_s) < 0:
            raise ValueError(f"health_check_interval_s must be > 0, or 0 for none, got {self.health_check_interval_s!r}")
        if float(self.health_check_interval_s) > 0 and float(self.iteration_timeout_s) == 0:
            raise ValueError("health_check_interval_s needs iteration_timeout_s > 0: an unanswered health check is "
                             "a hung iteration, and with iteration_timeout_s 0 nothing watches for one")  # fmt: skip
        if float(self.iteration_timeout_s) < 0:
            raise ValueError(f"iteration_timeout_s must be > 0, or 0 to turn the watchdog off, got {self.iteration_timeout_s!r}")
        if float(self.structured_output_compile_timeout_s) < 0:
            raise ValueError("structured_output_compile_timeout_s must be > 0, or 0 for no limit, got "
                             f"{self.structured_output_compile_timeout_s!r}")
        if float(self.priority_aging_s) < 0:
            raise ValueError(f"priority_aging_s must be > 0, or 0 for strict priority, got {self.priority_aging_s!r}")
        for name in ("max_queued_requests", "max_queued_prompt_tokens", "max_consecutive_failed_iterations",
                     "max_input_tokens", "max_stop_sequences", "max_stop_length", "max_request_bytes",
                     "max_structured_output_bytes", "max_structured_output_depth", "max_priority"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 1, or 0 for no limit, got {getattr(self, name)!r}")
        if not 0.0 <= float(self.kv_watermark) < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark!r}")
        if self.kernels not in ("auto", "triton", "cpu", "torch"):
            raise ValueError(f"kernels must be auto, triton, cpu or torch, got {self.kernels!r}")
        for name in ("max_num_seqs", "kv_capacity_tokens", "tensor_parallel_size", "pipeline_parallel_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.async_scheduling and not self.async_applies():
            raise ValueError("async_scheduling runs one process with iteration-level scheduling: it needs "
                             "tensor_parallel_size = pipeline_parallel_size = 1 and scheduling 'iteration'")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}")
        if self.ray_placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError("ray_placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got "
                             f"{self.ray_placement_strategy!r}")
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                             "pip install -e .[ray] (the same version on every host)")
        for name in ("max_loras", "max_lora_rank"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if int(self.max_lora_rank) > 512:
            raise ValueError(f"max_lora_rank must be at most 512, got {self.max_lora_rank!r}")
        if int(self.max_cpu_loras) < 0:
            raise ValueError(f"max_cpu_loras must be >= max_loras, or 0 for max_loras, got {self.max_cpu_loras!r}")
        if self.max_cpu_loras and int(self.max_cpu_loras) < int(self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if (self.lora_modules or self.allow_runtime_lora_updating) and not self.enable_lora:
            raise ValueError("lora_modules and allow_runtime_lora_updating need enable_lora")
        if self.allow_runtime_lora_updating and not self.lora_allowed_dir:
            raise ValueError("allow_runtime_lora_updating needs lora_allowed_dir: adapters added at run time must "
                             "lie in a directory the deployment chose")  # fmt: skip
        if not (self.device in ("cpu", "auto") or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be cpu, cuda, cuda:N or auto, got {self.device!r}")
        if not 0.0 <= float(self.gpu_memory_utilization) <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], or 0 for none, got {self.gpu_memory_utilization!r}")
        for name in ("kv_cache_memory_bytes", "max_model_len"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 1, or 0 for none, got {getattr(self, name)!r}")

    def model_config(self) -> AnyModelConfig:
        if self.model in PRESETS:
            return PRESETS[self.model]
        config_path = Path(self.model) / "config.json"
        if not config_path.is_file():
            if not Path(self.model).exists() and HUB_ID.fullmatch(self.model):
                raise ValueError(
                    f"model {self.model!r} is neither a local directory nor in the Hugging Face cache ({hub_cache()}), "
                    f"and this engine reaches no model hub: download it first (huggingface-cli download {self.model}) "
                    "or set model to a checkpoint directory"
                )
            raise ValueError(
                f"model {self.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with config.json"
            )
        config = model_config_from_hf(config_path)
        check_quantization_argument(self.quantization, json.loads(config_path.read_text()), str(config_path))
        return config

    def kv_events(self) -> KVEventsConfig | None:
        """kv_events_config, parsed (None when unset)."""
        return KVEventsConfig.from_json(self.kv_events_config) if self.kv_events_config else None

    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, parsed (None when unset)."""
        return SpeculativeConfig.from_json(self.speculative_config) if self.speculative_config else None

    def draft_config(self) -> EngineConfig | None:
        """The engine config of speculative decoding's draft model (method draft_model), else None: the
        target's settings with the draft checkpoint, no speculation and no adapters."""
        speculative = self.speculative()
        if speculative is None or speculative.method != "draft_model":
            return None
        return replace(self, model=speculative.model, tokenizer=None, speculative_config="", enable_lora=False,
                       lora_modules={}, allow_runtime_lora_updating=False, kv_cache_dtype="auto")  # fmt: skip

    def kv_bytes_per_token(self, model_config: AnyModelConfig) -> int:
        """The bytes a token's K and V take on one rank: over its stage's layers and its KV heads."""
        element = 1 if self.kv_cache_dtype != "auto" else {"float32": 4, "bfloat16": 2, "float16": 2}[self.dtype]
        return (2 * element * -(-model_config.num_layers // int(self.pipeline_parallel_size))
                * -(-model_config.num_kv_heads // int(self.tensor_parallel_size)) * model_config.head_dim)  # fmt: skip

    def host_kv_blocks(self, model_config: AnyModelConfig) -> int:
        """The host tier's blocks (swap_space GiB over a block's bytes on one rank; the draft model's
        K/V, where there is one, adds its own share to the host memory)."""
        per_block = self.kv_bytes_per_token(model_config) * int(self.block_size)
        return int(float(self.swap_space) * 2**30) // per_block if per_block else 0

    def async_applies(self) -> bool:
        """Whether async scheduling can run: one process, iteration-level scheduling."""
        return (self.scheduling == "iteration" and int(self.tensor_parallel_size) == 1
                and int(self.pipeline_parallel_size) == 1)  # fmt: skip

    def sizes_kv_pool_from_memory(self) -> bool:
        """Whether the engine core sizes the K/V pool from the GPU's memory (gpu_memory_utilization on
        a CUDA device, kv_cache_memory_bytes unset): kv_capacity_tokens is then what it finds."""
        return self.device.startswith("cuda") and bool(self.gpu_memory_utilization) and not self.kv_cache_memory_bytes

    def with_kv_capacity(self, model_config: AnyModelConfig) -> EngineConfig:
        """This config with kv_capacity_tokens derived from kv_cache_memory_bytes, where that is set: the
        token slots whose K and V, over this rank's layers and KV heads, fit in that many bytes."""
        if not self.kv_cache_memory_bytes:
            return self
        per_token = self.kv_bytes_per_token(model_config)
        if per_token == 0:
            raise ValueError("kv_cache_memory_bytes: this model keeps no K/V; set kv_capacity_tokens")
        tokens = int(self.kv_cache_memory_bytes) // per_token // int(self.block_size) * int(self.block_size)
        if tokens < int(self.block_size):
            raise ValueError(f"kv_cache_memory_bytes={self.kv_cache_memory_bytes} holds less than one block of "
                             f"{self.block_size} tokens ({per_token} bytes a token)")  # fmt: skip
        return replace(self, kv_capacity_tokens=tokens)

    def pooling_config(self) -> PoolingConfig:
        """How embedding requests are pooled (sampling_params.read_pooling_config); a preset's: the default."""
        if self.model in PRESETS:
            return PoolingConfig()
        return read_pooling_config(self.model, json.loads((Path(self.model) / "config.json").read_text()))

    def tokenizer_path(self) -> Path | None:
        if self.tokenizer:
            path = Path(self.tokenizer)
            path = path / "tokenizer.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"tokenizer {self.tokenizer!r}: no tokenizer.json found")
            return path
        if self.model not in PRESETS and (Path(self.model) / "tokenizer.json").is_file():
            return Path(self.model) / "tokenizer.json"
        return None

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> EngineConfig:
        """Builds a config from config.pbtxt parameters (see `parameter_values`).

        Keys that are not engine fields are left for the caller; empty values keep the default.
        """
        known = {f.name: f for f in fields(cls)}
        values = parameter_values(parameters)
        if "max_batch_size" in values:
            raise ValueError("parameter max_batch_size is now max_num_seqs (the engine's batch); Triton's own "
                             "top-level max_batch_size stays the baseline batcher's setting")
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known or value == "":
                continue
            if key == "lora_modules":
                raise ValueError("parameter lora_modules is not read: list the adapters in the model version's "
                                 "multi_lora.json (Triton's vLLM backend's file)")  # fmt: skip
            default = known[key].default
            if isinstance(default, bool) or known[key].type == "bool | None":
                kwargs[key] = parameter_bool(key, value)
            elif isinstance(default, (int, float)):
                try:
                    kwargs[key] = type(default)(value)
                except ValueError:
                    kind = "an integer" if isinstance(default, int) else "a number"
                    raise ValueError(f"parameter {key} must be {kind}, got {value!r}") from None
            else:
                kwargs[key] = value
        return cls(**kwargs)


HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")  # a model hub's "organization/name"


def hub_cache() -> Path:
    """Where Hugging Face's libraries keep downloaded checkpoints (their own precedence of variables)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(home).expanduser() / "hub"


def hub_snapshot(repo_id: str, revision: str = "main") -> Path | None:
    """The cached download of a hub checkpoint (`huggingface-cli download` or any earlier load wrote
    it): models--<org>--<name>/snapshots/<the commit refs/<revision> names>, if it holds config.json."""
    repo = hub_cache() / f"models--{repo_id.replace('/', '--')}"
    try:
        commit = (repo / "refs" / revision).read_text().strip()
    except OSError:
        return None
    snapshot = repo / "snapshots" / commit
    return snapshot if (snapshot / "config.json").is_file() else None


# vLLM's names for a method's kernels -> the checkpoint format they read.
QUANTIZATION_ALIASES = {"awq_marlin": "awq", "gptq_marlin": "gptq", "compressed_tensors": "compressed-tensors"}


def check_quantization_argument(wanted: str, raw: dict[str, Any], source: str) -> None:
    """The `quantization` argument against what the checkpoint's config.json declares, as vLLM checks it."""
    if not wanted:
        return
    declared = (raw.get("quantization_config") or {}).get("quant_method")
    if declared is None:
        raise ValueError(f"quantization={wanted!r}, but {source} declares no quantization_config: this engine "
                         "quantizes nothing at load (vLLM's online quantization is not served); serve a checkpoint "
                         "quantized offline, or leave quantization unset")  # fmt: skip
    if QUANTIZATION_ALIASES.get(wanted, wanted) != declared:
        raise ValueError(f"quantization={wanted!r} does not match the method {source} declares ({declared!r})")


def model_config_from_hf(path: str | Path) -> AnyModelConfig:
    """The engine's config for a Hugging Face config.json, chosen by its `architectures`
    (orca_backend/families/)."""
    return config_from_hf_dict(json.loads(Path(path).read_text()), str(path))


def check_parallel_layout(config: AnyModelConfig, tp: int, pp: int) -> None:
    """Refuses, at load and naming the field, a tp x pp layout the model's geometry cannot split:
    each tensor-parallel rank holds an equal share of the attention heads, the KV heads (never
    replicated) and the MLP width, and each pipeline stage at least one layer; the family names
    those dimensions."""
    for name, size in family_of(config).tp_divisible(config):
        if size % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {name} {size}: each rank must hold an equal "
                             "share (heads are split, never replicated)")  # fmt: skip
    if config.num_layers < pp:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {config.num_layers} layers")
    if tp > 1 and getattr(config, "act_quant", ""):
        raise ValueError(f"tensor_parallel_size {tp}: W8A8 checkpoints are served with tensor_parallel_size 1 (a "
                         "row-parallel shard would quantize part of each token's activations with its own scale)")


# The K/V pool's geometry, which the frontend's validation and the core's K/V manager both need.
def stage_layers(num_layers: int, pp_size: int, pp_rank: int) -> range:
    """A pipeline stage's layers; earlier stages take one extra when num_layers does not divide evenly."""
    if num_layers < pp_size:
        raise ValueError(f"pipeline_parallel_size {pp_size} exceeds the model's {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    start = pp_rank * base + min(pp_rank, extra)
    return range(start, start + base + (pp_rank < extra))


def pool_capacity_tokens(capacity_tokens: int, block_size: int) -> int:
    """The slots of a pool of `capacity_tokens` cut into whole blocks."""
    return capacity_tokens // block_size * block_size


def parameter_bool(key: str, value: str) -> bool:
    """A config.pbtxt parameter's true or false (1/0 and yes/no too); ValueError naming it otherwise."""
    if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
        raise ValueError(f"parameter {key} must be true or false, got {value!r}")
    return value.lower() in ("1", "true", "yes")


def parameter_values(parameters: Mapping[str, Any], expand_env: bool = True) -> dict[str, str]:
    """config.pbtxt `parameters` as plain strings: the one reader of them (server and client).

    Triton hands a model its parameters as {key: {"string_value": ...}}; `orca-serve` and tests may
    pass plain strings. Inside the server `${ENV}` references expand (the compose file sets the
    model that way); surrounding whitespace goes.
    """
    out = {}
    for key, raw in parameters.items():
        value = raw.get("string_value", "") if isinstance(raw, Mapping) else str(raw)
        out[key] = (os.path.expandvars(value) if expand_env else value).strip()
    return out
