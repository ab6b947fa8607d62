"""SiLU-gated MLP activation (SwiGLU, the Llama family's MLP): torch reference."""

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


def gate_up_split(width: int) -> int:
    """The inner width of a fused [..., 2 * inner] gate/up tensor; odd widths are a caller bug."""
    if width % 2:
        raise ValueError(f"silu_and_mul needs [..., 2 * inner] (gate then up), got last dim {width}")
    return width // 2
