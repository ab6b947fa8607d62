"""A decoder layer's pre-norm and the linear layer it feeds, as one op: torch reference.

``norm_linear_torch(x, x_bias, residual, norm_w, norm_b, eps, weight, bias, activation)`` is

    summed = x + x_bias + residual      (each add rounded to the dtype, as separate ops round)
    h = LayerNorm(summed) if norm_b is given, else RMSNorm(summed)   (add_layernorm / add_rmsnorm)
    y = activation(h @ weight.T + bias)

and returns ``(y, summed)``: the next residual stream, as ``add_layernorm`` / ``add_rmsnorm`` return
it. ``x_bias`` is the bias of the linear layer that produced ``x``, which the models leave to this op
when the kernel set fuses it (triton_norm_linear.py): that linear then needs no bias of its own.

Activations: ``"none"``; ``"gelu"`` (GPT-2's MLP input: ``bias_gelu`` of the GEMM's output);
``"silu_and_mul"`` and ``"gelu_and_mul"`` (the gated MLPs: ``weight`` is [2 * inner, hidden], gate
rows then up rows, and y is [T, inner]).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .gelu import bias_gelu_torch
from .layernorm import add_layernorm_torch
from .rmsnorm import add_rmsnorm_torch
from .silu import gelu_and_mul_torch, silu_and_mul_torch

ACTIVATIONS = ("none", "gelu", "silu_and_mul", "gelu_and_mul")


def check_activation(activation: str, bias: torch.Tensor | None) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if activation == "gelu" and bias is None:
        raise ValueError("the 'gelu' activation is GPT-2's bias + GELU: it needs the bias")
    if activation.endswith("_and_mul") and bias is not None:
        raise ValueError(f"{activation} takes no bias (no gated MLP of the families has one)")


def norm_linear_torch(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str = "none",
) -> tuple[torch.Tensor, torch.Tensor]:
    check_activation(activation, bias)
    if x_bias is not None:
        x = x + x_bias
    if norm_b is not None:
        h, summed = add_layernorm_torch(x, residual, norm_w, norm_b, eps)
    else:
        h, summed = add_rmsnorm_torch(x, residual, norm_w, eps)
    if activation == "gelu":
        return bias_gelu_torch(F.linear(h, weight), bias), summed
    y = F.linear(h, weight, bias)
    if activation == "silu_and_mul":
        y = silu_and_mul_torch(y)
    elif activation == "gelu_and_mul":
        y = gelu_and_mul_torch(y)
    return y, summed
