"""Configuration dataclasses: the model geometry and the engine's tuning knobs.

Every knob a deployment tunes is also a config.pbtxt `parameters` entry (see
`EngineConfig.from_parameters`), so the offline API and the Triton model share one definition.
Plain data only: importing this module must not import torch (the client and orca-serve read it).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name: see orca_backend.model.device


@dataclass(frozen=True)
class ModelConfig:
    """GPT-2 family geometry, named as in Hugging Face's GPT2Config."""

    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int | None = 50256
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_inner(self) -> int:
        return 4 * self.n_embd

    def num_parameters(self) -> int:
        per_layer = 12 * self.n_embd * self.n_embd + 13 * self.n_embd
        return self.vocab_size * self.n_embd + self.n_positions * self.n_embd + self.n_layer * per_layer + 2 * self.n_embd

    @classmethod
    def from_hf_json(cls, path: str | Path) -> ModelConfig:
        raw = json.loads(Path(path).read_text())
        model_type = raw.get("model_type", "gpt2")
        if model_type != "gpt2":
            raise ValueError(f"{path}: model_type {model_type!r} is not supported; ORCA serves the GPT-2 family")
        unsupported = {
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "scale_attn_weights": True,
            "add_cross_attention": False,
        }
        for key, expected in unsupported.items():
            if raw.get(key, expected) != expected:
                raise ValueError(f"{path}: {key}={raw[key]!r} is not supported (expected {expected!r})")
        activation = raw.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{path}: activation_function {activation!r} is not supported; only tanh GeLU is")
        if raw.get("n_inner") not in (None, 4 * raw.get("n_embd", 768)):
            raise ValueError(f"{path}: n_inner must be 4 * n_embd")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


# Named presets: geometry only; weights are seeded random (no model hub is reachable at run time).
PRESETS: dict[str, ModelConfig] = {
    "gpt2-small": ModelConfig(),  # GPT-2 124M geometry, the default for CPU benchmarks
    "gpt2-medium": ModelConfig(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-tiny": ModelConfig(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4, eos_token_id=None, initializer_range=0.3),
    "gpt2-mini": ModelConfig(vocab_size=1024, n_positions=512, n_embd=192, n_layer=4, n_head=6, eos_token_id=None, initializer_range=0.3),
}


@dataclass
class EngineConfig:
    model: str = "gpt2-tiny"  # local HF checkpoint directory, or a preset name from PRESETS
    tokenizer: str | None = None  # tokenizer.json or a directory holding one; default: the model dir's
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 32  # requests in one iteration (Triton's max_batch_size is the baseline batcher's)
    kv_capacity_tokens: int = 16384  # K/V pool size in token slots, per layer
    kv_policy: str = "reserve"  # ORCA: reserve prompt + max_tokens slots at admission
    scheduling: str = "iteration"  # "iteration" (ORCA) or "request" (the baseline's batch-to-completion)
    seed: int = 0  # weights of presets, and the RNG of unseeded sampling
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kernels: str = "auto"  # "auto" | "triton" | "cpu" | "torch" (see orca_kernels.dispatch)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduling not in ("iteration", "request"):
            raise ValueError(f"scheduling must be 'iteration' or 'request', got {self.scheduling!r}")
        if self.kv_policy != "reserve":
            raise ValueError(f"kv_policy must be 'reserve' (the only policy implemented), got {self.kv_policy!r}")
        if self.kernels not in ("auto", "triton", "cpu", "torch"):
            raise ValueError(f"kernels must be auto, triton, cpu or torch, got {self.kernels!r}")
        for name in ("max_num_seqs", "kv_capacity_tokens", "tensor_parallel_size", "pipeline_parallel_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    def model_config(self) -> ModelConfig:
        if self.model in PRESETS:
            return PRESETS[self.model]
        config_path = Path(self.model) / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"model {self.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with config.json"
            )
        return ModelConfig.from_hf_json(config_path)

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
            default = known[key].default
            if isinstance(default, bool):
                kwargs[key] = value.lower() in ("1", "true", "yes")
            elif isinstance(default, int):
                try:
                    kwargs[key] = int(value)
                except ValueError:
                    raise ValueError(f"parameter {key} must be an integer, got {value!r}") from None
            else:
                kwargs[key] = value
        return cls(**kwargs)


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
