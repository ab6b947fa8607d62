"""The torch side of the family registry: each family's model code.

orca_backend/families/ maps a config.json's `architectures` to its family (torch-free) and names, in
`Family.model`, the module of the family's model code; that module's MODEL_CODE says how to load and
run it. Modules are imported when a model of their family is first built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from orca_backend.families import AnyModelConfig, family_of


@dataclass(frozen=True)
class ModelCode:
    weights: Any  # a class with .load(source, config, layout, dtype, device): model/decoder.py's DecoderWeights, or GPT-2's
    model: Any  # a StageModel (model/stage_input.py) built from (config, weights, ops, layout, tp), with .forward(...)
    checkpoint_key: Callable[[str], str | None]  # stored tensor name -> the name the weights ask for
    random_state_dict: Callable[..., dict]  # (config, seed) -> HF-named random tensors, for presets


def model_code(config: AnyModelConfig) -> ModelCode:
    """The model code of a config's family."""
    return importlib.import_module(family_of(config).model).MODEL_CODE
