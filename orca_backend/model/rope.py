"""Rotary position embeddings: the inverse frequencies (with Llama 3.1's frequency scaling) and the
cos/sin table every layer's `ops.rotary` reads."""

from __future__ import annotations

import math

import torch


def inverse_frequencies(
    head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None, linear: float = 1.0
) -> torch.Tensor:
    """float32 [head_dim / 2]: theta^(-2i / head_dim), rescaled as `rope_type: llama3` or `linear`
    asks (linear: every frequency divided by the factor, i.e. positions interpolated).

    Llama 3.1 keeps high frequencies (wavelength under original_context / high_freq_factor),
    divides low ones (wavelength over original_context / low_freq_factor) by `factor`, and
    interpolates smoothly in between.
    """
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim)
    if linear != 1.0:
        inv_freq = inv_freq / linear
    if llama3 is None:
        return inv_freq
    factor, low_freq_factor, high_freq_factor, original_context = llama3
    low_freq_wavelen = original_context / low_freq_factor
    high_freq_wavelen = original_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (original_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def cos_sin_table(inv_freq: torch.Tensor, max_positions: int, device: torch.device) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos(p * f) in the first half, sin(p * f) in the second."""
    positions = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(positions, inv_freq)
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
