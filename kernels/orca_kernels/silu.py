"""Gated MLP activations: SiLU (SwiGLU, the Llama family's MLP) and tanh GELU (GeGLU, Gemma's):
torch references."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def silu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """x: [..., 2 * inner] holding the gate then the up projection (one fused GEMM's output).

    Returns ``silu(gate) * up`` [..., inner] in x's dtype, i.e. transformers'
    ``act_fn(gate_proj(x)) * up_proj(x)``.
    """
    inner = gate_up_split(x.shape[-1])
    return F.silu(x[..., :inner]) * x[..., inner:]


def gelu_and_mul_torch(x: torch.Tensor) -> torch.Tensor:
    """As `silu_and_mul_torch` with the tanh-approximated GELU (transformers' gelu_pytorch_tanh):
    ``gelu_tanh(gate) * up``."""
    inner = gate_up_split(x.shape[-1])
    return F.gelu(x[..., :inner], approximate="tanh") * x[..., inner:]


def gate_up_split(width: int) -> int:
    """The inner width of a fused [..., 2 * inner] gate/up tensor; odd widths are a caller bug."""
    if width % 2:
        raise ValueError(f"a gated activation needs [..., 2 * inner] (gate then up), got last dim {width}")
    return width // 2
