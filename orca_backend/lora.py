"""LoRA adapters as the engine's layers share them, torch-free: what a request's adapter is
(`LoRARequest`), which adapters a deployment serves (`LoRARegistry`), and how PEFT's files map onto
this engine's projections (`read_adapter`).

An adapter is a directory in PEFT's format: ``adapter_config.json`` (``r``, ``lora_alpha``,
``target_modules``, ``use_rslora``) and ``adapter_model.safetensors`` (``...lora_A.weight`` [r, in]
and ``...lora_B.weight`` [out, r] per targeted module). The frontend reads both at registration
(the weights' header only) and refuses, naming the field, what the engine would not compute
faithfully; the model runners read the weights themselves when an adapter is first loaded
(orca_backend/model/lora.py).

Each family's PEFT module names map onto its projections; a fused projection stacks its slices
(GPT-2's ``c_attn`` is one slice of PEFT's own fused module; the Llama family's ``q_proj``,
``k_proj``, ``v_proj`` are three slices of ``qkv``, ``gate_proj`` and ``up_proj`` two of
``gate_up``). The MLP of a mixture-of-experts layer takes no adapter (its experts have no dense
projection to add to): such adapters are refused.
"""

from __future__ import annotations

import itertools
import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
MULTI_LORA_FILE = "multi_lora.json"  # Triton's vLLM backend's name: {adapter name: directory}


@dataclass(frozen=True, slots=True)
class LoRARequest:
    """The adapter a request runs with. `lora_id` is unique per registration in one engine, so an
    adapter re-registered under the same name from another directory is a different adapter (its own
    prefix-cache entries, its own load)."""

    name: str
    lora_id: int
    path: str


@dataclass(frozen=True)
class Projection:
    """One LoRA-able projection of a layer: its slices' (input, output) widths, unsharded."""

    name: str
    slices: tuple[tuple[int, int], ...]
    row_parallel: bool  # its input is split over tensor-parallel ranks (o, down); else its output is


@dataclass(frozen=True)
class AdapterSpec:
    """An adapter as read and checked at registration."""

    rank: int
    scaling: float  # lora_alpha / r, or / sqrt(r) with use_rslora
    # (layer, projection, slice) -> the checkpoint keys of its A and B
    modules: dict[tuple[int, str, int], tuple[str, str]]


# PEFT module names (relative to a layer) -> (projection, slice), and where layers live, per family.
_GPT2_MODULES = {"attn.c_attn": ("qkv", 0), "attn.c_proj": ("o", 0), "mlp.c_fc": ("fc", 0), "mlp.c_proj": ("down", 0)}
_LLAMA_MODULES = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
                  "self_attn.o_proj": ("o", 0), "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
                  "mlp.down_proj": ("down", 0)}  # fmt: skip
_KEY = re.compile(r"^base_model\.model\.(?:transformer\.h|model\.layers)\.(\d+)\.(.+)\.lora_([AB])\.weight$")
# adapter_config.json fields that change what an adapter computes and are not implemented here.
_REFUSED_FIELDS = ("use_dora", "modules_to_save", "lora_bias", "rank_pattern", "alpha_pattern", "layer_replication",
                   "use_qalora", "alora_invocation_tokens", "target_parameters", "trainable_token_indices")  # fmt: skip


def projections(model_config: Any) -> dict[str, Projection]:
    """The LoRA-able projections of the family's layers (every layer has the same ones, except a
    mixture-of-experts layer's MLP: `lora_layer_projections`)."""
    if model_config.architecture == "GPT2LMHeadModel":
        e, inner = model_config.n_embd, model_config.n_inner
        return {"qkv": Projection("qkv", ((e, 3 * e),), False), "o": Projection("o", ((e, e),), True),
                "fc": Projection("fc", ((e, inner),), False), "down": Projection("down", ((inner, e),), True)}  # fmt: skip
    h, d, i = model_config.hidden_size, model_config.head_dim, model_config.intermediate_size
    q, kv = model_config.num_attention_heads * d, model_config.num_key_value_heads * d
    return {"qkv": Projection("qkv", ((h, q), (h, kv), (h, kv)), False), "o": Projection("o", ((q, h),), True),
            "gate_up": Projection("gate_up", ((h, i), (h, i)), False), "down": Projection("down", ((i, h),), True)}  # fmt: skip


def layer_projections(model_config: Any, layer: int) -> list[str]:
    """The projections of one layer an adapter may target (a MoE layer's MLP has none)."""
    names = list(projections(model_config))
    if getattr(model_config, "num_experts", 0) and model_config.is_moe_layer(layer):
        names = [n for n in names if n in ("qkv", "o")]
    return names


def read_adapter(path: str | Path, model_config: Any, max_lora_rank: int) -> AdapterSpec:
    """Reads and checks an adapter directory against the model; ValueError naming what is wrong."""
    path = Path(path)
    config_file, weights_file = path / ADAPTER_CONFIG, path / ADAPTER_WEIGHTS
    if not config_file.is_file():
        raise ValueError(f"LoRA adapter {path}: no {ADAPTER_CONFIG} (PEFT's format is expected)")
    if not weights_file.is_file():
        other = " (adapter_model.bin is not read: save it with safetensors)" if (path / "adapter_model.bin").exists() else ""
        raise ValueError(f"LoRA adapter {path}: no {ADAPTER_WEIGHTS}{other}")
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_CONFIG} is not readable JSON ({e})") from None
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {peft_type!r} is not supported (LORA is)")
    for name in _REFUSED_FIELDS:
        if config.get(name):
            raise ValueError(f"LoRA adapter {path}: {name}={config[name]!r} is not supported "
                             "(the adapter would not be computed as trained)")  # fmt: skip
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path}: bias={config['bias']!r} is not supported (bias 'none' is)")
    rank = config.get("r")
    if not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA adapter {path}: r must be a positive integer, got {rank!r}")
    if rank > max_lora_rank:
        raise ValueError(f"LoRA adapter {path}: rank {rank} exceeds max_lora_rank {max_lora_rank}")
    alpha = config.get("lora_alpha", 8)
    scaling = float(alpha) / (rank**0.5 if config.get("use_rslora") else rank)
    modules = _module_keys(path, weights_file, model_config, rank)
    return AdapterSpec(rank, scaling, modules)


def _module_keys(path: Path, weights_file: Path, model_config: Any, rank: int) -> dict[tuple[int, str, int], tuple[str, str]]:
    shapes = safetensors_shapes(weights_file)
    table = _GPT2_MODULES if model_config.architecture == "GPT2LMHeadModel" else _LLAMA_MODULES
    projs = projections(model_config)
    found: dict[tuple[int, str, int], dict[str, str]] = {}
    for key, shape in shapes.items():
        match = _KEY.match(key)
        target = table.get(match.group(2)) if match else None
        layer = int(match.group(1)) if match else -1
        if match is None or target is None or not 0 <= layer < model_config.num_layers:
            raise ValueError(f"LoRA adapter {path}: weight {key!r} targets no projection this engine adapts "
                             f"(supported modules: {', '.join(table)}; embeddings and the LM head are not)")  # fmt: skip
        projection, index = target
        if projection not in layer_projections(model_config, layer):
            raise ValueError(f"LoRA adapter {path}: weight {key!r} targets the mixture-of-experts MLP of layer "
                             f"{layer}, which takes no adapter (attention projections do)")  # fmt: skip
        fan_in, fan_out = projs[projection].slices[index]
        which = match.group(3)
        expected = (rank, fan_in) if which == "A" else (fan_out, rank)
        if tuple(shape) != expected:
            raise ValueError(f"LoRA adapter {path}: {key} has shape {tuple(shape)}, expected {expected} for this model "
                             f"and r={rank} (an adapter of another base model?)")  # fmt: skip
        found.setdefault((layer, projection, index), {})[which] = key
    if not found:
        raise ValueError(f"LoRA adapter {path}: {ADAPTER_WEIGHTS} holds no lora_A / lora_B weights")
    for target, pair in found.items():
        if set(pair) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path}: layer {target[0]} {target[1]} has lora_{''.join(pair)} without its pair")
    return {target: (pair["A"], pair["B"]) for target, pair in sorted(found.items())}


def safetensors_shapes(path: Path) -> dict[str, list[int]]:
    """Tensor name -> shape, from a safetensors file's JSON header alone (no tensor is read)."""
    try:
        with open(path, "rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            if size > 100 * 2**20:
                raise ValueError(f"a header of {size} bytes")
            header = json.loads(f.read(size))
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(f"{path}: not a readable safetensors file ({e})") from None
    return {name: info["shape"] for name, info in header.items() if name != "__metadata__"}


def read_multi_lora_json(path: str | Path) -> dict[str, str]:
    """{adapter name: directory} from a multi_lora.json (Triton's vLLM backend's file); relative
    directories are relative to the file's own directory."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise ValueError(f"enable_lora is set but {path} does not exist: it lists the adapters "
                         '({"name": "/path/to/adapter", ...})') from None  # fmt: skip
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path} is not readable JSON ({e})") from None
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in raw.items()):
        raise ValueError(f'{path} must be a JSON object of adapter names to directories, {{"name": "/path", ...}}')
    return {name: str(path.parent / directory) for name, directory in raw.items()}


_PEFT_PREFIX = {"GPT2LMHeadModel": "base_model.model.transformer.h"}  # else: base_model.model.model.layers


def write_random_adapter(path: str | Path, model_config: Any, rank: int, seed: int, std: float = 0.02) -> None:
    """A PEFT adapter directory for `model_config` targeting every projection this engine adapts,
    with seeded normal(0, std) A and B (benchmarks: adapters for presets, which have no checkpoint)."""
    import numpy as np
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    gpt2 = model_config.architecture == "GPT2LMHeadModel"
    table = _GPT2_MODULES if gpt2 else _LLAMA_MODULES
    prefix = _PEFT_PREFIX.get(model_config.architecture, "base_model.model.model.layers")
    projs = projections(model_config)
    rng = np.random.default_rng(seed)
    tensors = {}
    for layer in range(model_config.num_layers):
        allowed = layer_projections(model_config, layer)
        for module, (name, index) in table.items():
            if name not in allowed:
                continue
            fan_in, fan_out = projs[name].slices[index]
            key = f"{prefix}.{layer}.{module}.lora_"
            tensors[key + "A.weight"] = (rng.standard_normal((rank, fan_in)) * std).astype(np.float32)
            tensors[key + "B.weight"] = (rng.standard_normal((fan_out, rank)) * std).astype(np.float32)
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    modules = sorted({module.rsplit(".", 1)[1] for module in table})
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": modules, "bias": "none",
              "fan_in_fan_out": gpt2}  # fmt: skip
    (path / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2))


class LoRARegistry:
    """The adapters requests may name (the frontend's): name -> LoRARequest, each checked when added.
    `allowed_dir`, when set, is the directory every adapter must lie in (symbolic links resolved)."""

    def __init__(self, model_config: Any, max_lora_rank: int, allowed_dir: str = "") -> None:
        self.model_config = model_config
        self.max_lora_rank = max_lora_rank
        self.allowed_dir = Path(allowed_dir).resolve() if allowed_dir else None
        self._adapters: dict[str, LoRARequest] = {}
        self._ids = itertools.count(1)

    @property
    def names(self) -> list[str]:
        return sorted(self._adapters)

    def add(self, name: str, path: str) -> LoRARequest:
        """Registers (or re-registers from another directory) an adapter; ValueError if it is refused."""
        if not isinstance(name, str) or not name or len(name) > 256:
            raise ValueError(f"a LoRA adapter's name must be a non-empty string of at most 256 characters, got {name!r}")
        resolved = Path(path).resolve()
        if self.allowed_dir is not None and not resolved.is_relative_to(self.allowed_dir):
            raise ValueError(f"LoRA adapter {name!r}: {path} lies outside lora_allowed_dir {self.allowed_dir}")
        known = self._adapters.get(name)
        if known is not None and known.path == str(resolved):
            return known
        read_adapter(resolved, self.model_config, self.max_lora_rank)
        lora = self._adapters[name] = LoRARequest(name, next(self._ids), str(resolved))
        return lora

    def remove(self, name: str) -> None:
        """Requests may no longer name it (those running finish with it)."""
        if self._adapters.pop(name, None) is None:
            raise ValueError(f"no LoRA adapter named {name!r} is registered")

    def sync(self, adapters: dict[str, str]) -> list[str]:
        """Makes the registry hold exactly `adapters` (a re-read multi_lora.json): new and moved ones
        added, missing ones removed. Returns the errors of those refused (the rest still apply)."""
        errors = []
        for name in set(self._adapters) - set(adapters):
            self.remove(name)
        for name, path in adapters.items():
            try:
                self.add(name, path)
            except ValueError as e:
                self._adapters.pop(name, None)
                errors.append(str(e))
        return errors

    def get(self, name: str) -> LoRARequest:
        lora = self._adapters.get(name)
        if lora is None:
            served = ", ".join(self.names) or "none"
            raise ValueError(f"LoRA adapter {name!r} is not served here (served: {served})")
        return lora
