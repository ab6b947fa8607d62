"""Builds the model slice an EngineConfig and a ParallelLayout name: from a local HF checkpoint
directory, or a seeded preset, with the family's code from the registry."""

from __future__ import annotations

import logging
from typing import Any

import torch

from orca_backend.config import PRESETS, EngineConfig
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.families import AnyModelConfig
from orca_backend.model import gemm
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.device import torch_dtype
from orca_backend.model.kv_scales import load_kv_scales
from orca_backend.model.registry import model_code
from orca_kernels import get_ops

logger = logging.getLogger("orca.model")


def quantized_as(model_config: AnyModelConfig) -> str:
    """What a model config declares its checkpoint's weights to be: "fp8", an integer format, "int8"
    (W8A8's int-quantized weights), or ""."""
    if getattr(model_config, "fp8", False):
        return "fp8"
    if getattr(model_config, "act_quant", "") == "int8":
        return "int8"
    return getattr(model_config, "int_format", "")


def load_model(
    config: EngineConfig, model_config: AnyModelConfig, device: torch.device,
    layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
) -> Any:  # fmt: skip
    code = model_code(model_config)
    if config.model in PRESETS:
        logger.info("model: preset %s with random weights (seed %d)", config.model, config.seed)
        source = WeightSource.from_state_dict(code.random_state_dict(model_config, config.seed))
    else:
        logger.info("model: checkpoint %s (%s)", config.model, model_config.architecture)
        source = WeightSource.from_dir(config.model, code.checkpoint_key, quantized_as(model_config))
    ops = get_ops(device, config.kernels)
    with gemm.packing_for(ops):
        weights = code.weights.load(source, model_config, layout, torch_dtype(config.dtype), device)
    model = code.model(model_config, weights, ops, layout, tp)
    names = [model.kv_scale_names(i) for i in model.stage_layers]
    model.kv_scales = load_kv_scales(source, names, model_config.num_kv_heads, layout, config.kv_cache_dtype, device,
                                     declared=getattr(model_config, "kv_scales", False))  # fmt: skip
    return model
