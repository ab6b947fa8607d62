"""Residual-add + RMSNorm (the Llama family's pre-norm) over [num_tokens, hidden]: torch reference."""

from __future__ import annotations

import torch


def add_rmsnorm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (RMSNorm(x + residual), x + residual); with residual None the sum is x itself.

    The norm follows Hugging Face's LlamaRMSNorm step for step (statistics and scaling in fp32,
    rounded to the activation dtype *before* the weight multiply) so that checkpoints reproduce
    transformers' numbers, not merely a mathematically equal variant.
    """
    summed = x if residual is None else x + residual
    h = summed.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(summed.dtype), summed
