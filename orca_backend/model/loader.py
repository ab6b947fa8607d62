"""Builds the model slice an EngineConfig and a ParallelLayout name: from a local HF checkpoint
directory, or a seeded preset."""

from __future__ import annotations

import logging

import torch

from orca_backend.config import PRESETS, EngineConfig, ModelConfig
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.model.checkpoint import WeightSource, random_hf_state_dict
from orca_backend.model.device import torch_dtype
from orca_backend.model.gpt2 import GPT2, GPT2Weights
from orca_kernels import get_ops

logger = logging.getLogger("orca.model")


def load_model(
    config: EngineConfig, model_config: ModelConfig, device: torch.device,
    layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
) -> GPT2:  # fmt: skip
    if config.model in PRESETS:
        logger.info("model: preset %s with random weights (seed %d)", config.model, config.seed)
        source = WeightSource.from_state_dict(random_hf_state_dict(model_config, config.seed))
    else:
        logger.info("model: checkpoint %s", config.model)
        source = WeightSource.from_dir(config.model)
    weights = GPT2Weights.load(source, model_config, layout, torch_dtype(config.dtype), device)
    return GPT2(model_config, weights, get_ops(device, config.kernels), layout, tp)
