"""The model families, one module each, and the one registry `architectures -> family`.

Everything the engine knows about a family outside its model code lives in its module here: its
config dataclass and config.json parsing, its presets, the dimensions tensor parallelism splits, its
LoRA targets, and the architecture names it serves. Config parsing (`config_from_hf_dict`), LoRA
(orca_backend/lora.py, model/lora.py), the model registry (model/registry.py) and the load-time
checks (config.check_parallel_layout) all find a config's family through `family_of`; no module
outside this package names an architecture (tests/test_layering.py checks). Adding a family: one
module here, its model code in model/, and its line in FAMILIES (docs/architecture.md, "Adding a
family").

Torch-free, like config.py: the client, orca-serve and the Triton stub read it.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from typing import Any

from orca_backend.families import gemma, gpt2, llama
from orca_backend.families.base import Family
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.families.llama import LlamaConfig

FAMILIES: tuple[Family, ...] = (gpt2.FAMILY, llama.FAMILY, gemma.FAMILY)

ARCHITECTURES: dict[str, Family] = {arch: family for family in FAMILIES for arch in family.architectures}
_BY_NAME: dict[str, Family] = {family.name: family for family in FAMILIES}

AnyModelConfig = GPT2Config | LlamaConfig  # GemmaConfig is a LlamaConfig

# Named presets: geometry only; weights are seeded random (no model hub is reachable at run time).
PRESETS: dict[str, AnyModelConfig] = {name: config for family in FAMILIES for name, config in family.presets.items()}


def family_of(config: Any) -> Family:
    """The family of a model config (any family's), by its architecture."""
    family = ARCHITECTURES.get(config.architecture)
    if family is None:
        raise ValueError(f"no family serves architecture {config.architecture!r}; served: {', '.join(ARCHITECTURES)}")
    return family


def config_from_hf_dict(raw: dict[str, Any], source: str) -> AnyModelConfig:
    """The engine's config for a Hugging Face config.json (`source` names it in errors), chosen by its
    `architectures`; refuses, naming the field, what no family computes faithfully."""
    archs = raw.get("architectures")
    if not archs:  # older configs name only a model_type, and GPT-2's first uploads not even that
        model_type = raw.get("model_type", gpt2.MODEL_TYPE)
        archs = [family.architectures[0] for family in FAMILIES if model_type in family.model_types]
    if not archs:
        raise ValueError(f"{source}: no `architectures` entry: cannot tell which model this is")
    arch = archs[0]
    _check_quantization(raw.get("quantization_config"), arch, source)
    if arch not in ARCHITECTURES:
        raise ValueError(f"{source}: architectures {arch!r} is not supported; served: {', '.join(ARCHITECTURES)}")
    return ARCHITECTURES[arch].from_hf_dict(raw, source)


def _check_quantization(quantization: Any, arch: str, source: str) -> None:
    """A checkpoint's quantization_config: none, or FP8 on a family that serves it (its parsing reads the
    FP8 fields). Anything else is refused: it would load and answer wrongly."""
    if not quantization:
        return
    method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
    family = ARCHITECTURES.get(arch)
    if method != "fp8" or family is None or not family.fp8:
        fp8_archs = [name for name, served in ARCHITECTURES.items() if served.fp8]
        served = "" if method != "fp8" else f" on {arch} (served for {', '.join(fp8_archs)})"
        raise ValueError(f"{source}: quantization_config (quant_method {method!r}) is not supported{served}: this "
                         "engine computes with unquantized weights, or FP8 ones on the Llama family, and any other "
                         "quantized checkpoint would load and answer wrongly; serve the unquantized checkpoint")  # fmt: skip


def model_config_to_json(config: AnyModelConfig) -> str:
    """For the worker processes' command line: the fields plus which family."""
    return json.dumps({"family": family_of(config).name, "fields": asdict(config)})


def model_config_from_json(text: str) -> AnyModelConfig:
    data = json.loads(text)
    config_class = _BY_NAME[data["family"]].config_class
    # JSON has no tuples: the fields declared as tuples (rope_llama3, fp8_block, layer_types, ...) become
    # tuples again; anything else is kept as config.json gave it.
    tuples = {f.name for f in fields(config_class) if str(f.type).startswith("tuple")}
    values = {name: tuple(value) if name in tuples and value is not None else value
              for name, value in data["fields"].items()}  # fmt: skip
    return config_class(**values)
