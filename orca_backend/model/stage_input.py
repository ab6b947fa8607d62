"""What enters a pipeline stage, for every model family."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca_kernels.lora import LoRAMetadata


@dataclass
class StageInput:
    """What enters a pipeline stage: token ids on the first, the previous stage's activations after."""

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    hidden: torch.Tensor | None = None  # [2, T, hidden]: the block output and the residual stream
    lora: LoRAMetadata | None = None  # each token's adapter, when some token runs one (model/lora.py)
