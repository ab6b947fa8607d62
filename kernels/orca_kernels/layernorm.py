"""Residual-add + LayerNorm over the flattened [num_tokens, hidden] tensor: torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def add_layernorm_torch(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (LayerNorm(x + residual), x + residual); with residual None the sum is x itself."""
    summed = x if residual is None else x + residual
    return F.layer_norm(summed, (summed.shape[-1],), weight, bias, eps), summed
