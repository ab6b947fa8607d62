"""The model families, one module each, what every family declares (`Family`), and the one registry
`architectures -> family`.

Everything the engine knows about a family outside its model code lives in its module here: its
config dataclass and config.json parsing, its presets, the dimensions tensor parallelism splits, its
LoRA targets, and the architecture names it serves. Config parsing (`config_from_hf_dict`), LoRA
(orca_backend/lora.py, model/lora.py), the model registry (model/registry.py) and the load-time
checks (config.check_parallel_layout) all find a config's family through `family_of`; no module
outside this package names an architecture (tests/test_layering.py checks). Adding a family: one
module here, its model code in model/, and its line in REGISTRY (docs/architecture.md, "Adding a
family").

The families load on demand; a served model loads its own. REGISTRY names, for each family, what
must be known before its module is imported (the architectures and config.json `model_type`s it
serves, its presets' names), and a family's module (orca_backend.families.<name>) is imported the
first time one of them is looked up, as vLLM's model registry imports a model's module; the names
are checked against the module as it loads.

Torch-free, like config.py: the client, orca-serve and the Triton stub read it.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, TypeAlias

if TYPE_CHECKING:
    from orca_backend.families.constant_time import ConstantTimeConfig
    from orca_backend.families.gpt2 import GPT2Config
    from orca_backend.families.llama import LlamaConfig

AnyModelConfig: TypeAlias = "GPT2Config | LlamaConfig | ConstantTimeConfig"  # GemmaConfig is a LlamaConfig

# A dimension's [lo, hi) on this tensor-parallel rank (distributed.layout.ParallelLayout.shard), passed
# in so that the families need not import the layout.
Shard = Callable[[int], tuple[int, int]]


@dataclass(frozen=True)
class Projection:
    """One LoRA-able projection of a layer: its slices' (input, output) widths, unsharded."""

    name: str
    slices: tuple[tuple[int, int], ...]
    row_parallel: bool  # its input is split over tensor-parallel ranks (o, down); else its output is


@dataclass(frozen=True)
class LoRATargets:
    """How PEFT adapters map onto a family's layers: orca_backend/lora.py reads and checks them with
    these, model/lora.py shards them as the base weights are sharded."""

    projections: Callable[[Any], dict[str, Projection]]  # (config) -> a layer's LoRA-able projections
    peft_modules: dict[str, tuple[str, int]]  # PEFT module name, relative to a layer -> (projection, slice)
    peft_prefix: str  # where PEFT's keys find the layers: f"{peft_prefix}.{layer}.{module}.lora_A.weight"
    fan_in_fan_out: bool  # the base layers store [in, out] (GPT-2's Conv1D), as PEFT's config records
    # (config, shard, projection, slice) -> the rows of a column-parallel slice's output this rank holds
    output_rows: Callable[[Any, Shard, str, int], list[tuple[int, int]]]
    # (config, shard, projection) -> the columns of a row-parallel projection's input this rank holds
    input_columns: Callable[[Any, Shard, str], tuple[int, int]]


@dataclass(frozen=True)
class Family:
    """One model family, its module's `FAMILY`: the config.json `architectures` it serves and
    everything the engine knows about them outside the model code. Its config class carries the K/V
    geometry every family exposes under the same names (`num_layers`, `num_kv_heads`, `head_dim`,
    `window(layer)`, `kv_window`, `max_context`, `hidden_size`)."""

    name: str  # the family's key and its module's name (model_config_to_json, the model registry's messages)
    config_class: type
    architectures: tuple[str, ...]  # config.json's names for it, each served by this family's model code
    from_hf_dict: Callable[[dict[str, Any], str], Any]  # (config.json, its path for messages) -> config
    presets: dict[str, Any]  # name -> config: geometry only, with seeded random weights
    tp_divisible: Callable[[Any], list[tuple[str, int]]]  # (config) -> the (name, size) each tp rank splits
    lora: LoRATargets
    model: str  # the module of its model code (torch), whose MODEL_CODE model/registry.py reads
    # The quantization_config methods its checkpoints may declare (orca_backend/quantization.py).
    quant_methods: tuple[str, ...] = ()


@dataclass(frozen=True)
class Registration:
    """A family as the registry knows it before its module is imported."""

    architectures: tuple[str, ...]  # as its Family lists them
    presets: tuple[str, ...]  # its presets' names, as its Family lists them
    model_types: tuple[str, ...] = ()  # config.json `model_type`s that name it when `architectures` is missing


# family name (its module: orca_backend.families.<name>) -> what it serves, in the order errors list them.
REGISTRY: dict[str, Registration] = {
    "gpt2": Registration(("GPT2LMHeadModel",), ("gpt2-small", "gpt2-medium", "gpt2-tiny", "gpt2-mini"),
                         model_types=("gpt2",)),
    "llama": Registration(("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                           "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"),
                          ("llama-150m", "llama-tiny", "mixtral-tiny", "qwen2-moe-tiny", "mixtral-small",
                           "qwen3-moe-tiny", "mistral-sw-tiny", "qwen2.5-0.5b")),
    "gemma": Registration(("Gemma2ForCausalLM", "Gemma3ForCausalLM"), ("gemma2-tiny", "gemma3-tiny")),
    # A measurement device, not a model (families/constant_time.py): the serving path's cost alone.
    "constant_time": Registration(("OrcaConstantTimeMeasure",), ("constant-time-measure",)),
}  # fmt: skip
# The model_type GPT-2's first uploads are taken to have: their config.json carries neither it nor
# `architectures`.
UNNAMED_MODEL_TYPE = "gpt2"

ARCHITECTURES: dict[str, str] = {arch: name for name, entry in REGISTRY.items() for arch in entry.architectures}
_PRESET_FAMILIES: dict[str, str] = {preset: name for name, entry in REGISTRY.items() for preset in entry.presets}


@functools.cache
def family_named(name: str) -> Family:
    """The family of that name (a REGISTRY key), its module imported on first use; KeyError for none."""
    entry = REGISTRY[name]
    loaded: Family = importlib.import_module(f"{__name__}.{name}").FAMILY
    declared = (loaded.name, loaded.architectures, tuple(loaded.presets))
    if declared != (name, entry.architectures, entry.presets):
        raise RuntimeError(f"families/{name}.py declares {declared}, but its REGISTRY line says "
                           f"{(name, entry.architectures, entry.presets)}: make them agree")  # fmt: skip
    return loaded


def all_families() -> tuple[Family, ...]:
    """Every family, each module imported (error messages that list what is served, tests)."""
    return tuple(family_named(name) for name in REGISTRY)


class _Presets(Mapping[str, Any]):
    """Every family's presets by name; reading one imports its family alone (`in` and the names
    import none)."""

    def __getitem__(self, preset: str) -> AnyModelConfig:
        return family_named(_PRESET_FAMILIES[preset]).presets[preset]

    def __contains__(self, preset: object) -> bool:
        return preset in _PRESET_FAMILIES

    def __iter__(self) -> Iterator[str]:
        return iter(_PRESET_FAMILIES)

    def __len__(self) -> int:
        return len(_PRESET_FAMILIES)


# Named presets: geometry only; weights are seeded random (no model hub is reachable at run time).
PRESETS: Mapping[str, AnyModelConfig] = _Presets()


def family_of(config: Any) -> Family:
    """The family of a model config (any family's), by its architecture."""
    name = ARCHITECTURES.get(config.architecture)
    if name is None:
        raise ValueError(f"no family serves architecture {config.architecture!r}; served: {', '.join(ARCHITECTURES)}")
    return family_named(name)


def config_from_hf_dict(raw: dict[str, Any], source: str) -> AnyModelConfig:
    """The engine's config for a Hugging Face config.json (`source` names it in errors), chosen by its
    `architectures`; refuses, naming the field, what no family computes faithfully."""
    archs = raw.get("architectures")
    if not archs:  # older configs name only a model_type, and GPT-2's first uploads not even that
        model_type = raw.get("model_type", UNNAMED_MODEL_TYPE)
        archs = [entry.architectures[0] for entry in REGISTRY.values() if model_type in entry.model_types]
    if not archs:
        raise ValueError(f"{source}: no `architectures` entry: cannot tell which model this is")
    arch = archs[0]
    _check_quantization(raw.get("quantization_config"), arch, source)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: architectures {arch!r} is not supported; served: {', '.join(ARCHITECTURES)}")
    return family_named(ARCHITECTURES[arch]).from_hf_dict(raw, source)


def _check_quantization(quantization: Any, arch: str, source: str) -> None:
    """A checkpoint's quantization_config: none, or a method its family serves (whose parsing reads the
    method's fields, orca_backend/quantization.py). Anything else is refused: it would load and answer wrongly."""
    if not quantization:
        return
    method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
    if arch in ARCHITECTURES and method in family_named(ARCHITECTURES[arch]).quant_methods:
        return
    served = [f"{m} on {', '.join(f.architectures)}" for f in all_families() for m in f.quant_methods]
    raise ValueError(f"{source}: quantization_config (quant_method {method!r}) is not supported on {arch}; "
                     f"served: {'; '.join(sorted(set(served)))}. Any other quantized checkpoint would load and "
                     "answer wrongly; serve the unquantized checkpoint")  # fmt: skip


def model_config_to_json(config: AnyModelConfig) -> str:
    """For the worker processes' command line: the fields plus which family."""
    return json.dumps({"family": family_of(config).name, "fields": asdict(config)})


def model_config_from_json(text: str) -> AnyModelConfig:
    data = json.loads(text)
    config_class = family_named(data["family"]).config_class
    # JSON has no tuples: the fields declared as tuples (rope_llama3, fp8_block, layer_types, ...) become
    # tuples again; anything else is kept as config.json gave it.
    tuples = {f.name for f in fields(config_class) if str(f.type).startswith("tuple")}
    values = {name: tuple(value) if name in tuples and value is not None else value
              for name, value in data["fields"].items()}  # fmt: skip
    return config_class(**values)
