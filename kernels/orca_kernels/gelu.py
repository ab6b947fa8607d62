"""Bias + GeLU (tanh approximation, GPT-2's "gelu_new") for the MLP: torch reference."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def bias_gelu_torch(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    return F.gelu(x + bias, approximate="tanh")
