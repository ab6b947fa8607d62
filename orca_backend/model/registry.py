"""Which model code serves which checkpoint architecture (config.json's `architectures`).

`orca_backend.config.model_config_from_hf` turns a config.json into the family's config (and
refuses what no family here computes faithfully); this registry gives that config's model code.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orca_backend.config import GEMMA_ARCHITECTURES, LLAMA_ARCHITECTURES, ModelConfig
from orca_backend.model import gemma, gpt2, llama
from orca_backend.model.checkpoint import gpt2_key, random_hf_state_dict


@dataclass(frozen=True)
class ModelFamily:
    weights: Any  # a class with .load(source, config, layout, dtype, device)
    model: Any  # a class built from (config, weights, ops, layout, tp) with .forward(...)
    checkpoint_key: Callable[[str], str | None]  # stored tensor name -> the name the weights ask for
    random_state_dict: Callable[..., dict]  # (config, seed) -> HF-named random tensors, for presets


GPT2_FAMILY = ModelFamily(gpt2.GPT2Weights, gpt2.GPT2, gpt2_key, random_hf_state_dict)
LLAMA_FAMILY = ModelFamily(llama.LlamaWeights, llama.Llama, llama.llama_key, llama.random_llama_state_dict)
GEMMA_FAMILY = ModelFamily(gemma.GemmaWeights, gemma.Gemma, gemma.gemma_key, gemma.random_gemma_state_dict)

MODEL_FAMILIES: dict[str, ModelFamily] = {
    ModelConfig.architecture: GPT2_FAMILY,
    **{arch: LLAMA_FAMILY for arch in LLAMA_ARCHITECTURES},
    **{arch: GEMMA_FAMILY for arch in GEMMA_ARCHITECTURES},
}


def family_of(architecture: str) -> ModelFamily:
    if architecture not in MODEL_FAMILIES:
        raise ValueError(f"no model code for architecture {architecture!r}; served: {', '.join(MODEL_FAMILIES)}")
    return MODEL_FAMILIES[architecture]
