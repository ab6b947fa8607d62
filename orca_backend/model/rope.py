"""Rotary position embeddings: the inverse frequencies of every rope type served (transformers'
default, `linear`, `llama3`, `yarn`, `dynamic` and `longrope`, with its semantics) and the cos/sin
table every layer's `ops.rotary` reads.

The table is the one place a rope type shows: every rotary (torch, C, Triton, fused into attention
or not) gathers row `position` of it. transformers' attention factor (yarn's mscale, longrope's) is
folded into cos and sin, as transformers folds it, and a row may have frequencies of its own: that is
how `dynamic` and `longrope` are served.

Those two are the types whose frequencies transformers recomputes at every forward from the longest
position in it (`seq_len = max(position_ids) + 1`): dynamic NTK raises the base once seq_len passes
max_position_embeddings, longrope switches from its short to its long factors once seq_len passes
original_max_position_embeddings. Each forward rotates its new q and k with them; keys already in the
cache keep the rotation they were given. So in greedy generation the prompt is rotated with the
frequencies of its length, and each later token at position p with those of `seq_len = p + 1`.
Here row p holds the frequencies of `seq_len = p + 1` (at least the window's: within it they are
the short factors, or the unscaled base): a token's rotation depends on its position alone, so a
request's tokens do not depend on its batch, on chunked prefill or on a prefix cache hit, and they
equal transformers' generation whenever the prompt fits in the original window (the whole prompt
then has the window's frequencies in both). A prompt longer than the window is rotated by
transformers with the frequencies of its full length (NTK for that length; the long factors), here
position by position, so such requests can answer otherwise. (transformers' batched generation takes
seq_len from the longest row, so its own tokens there depend on the batch.)
"""

from __future__ import annotations

import math

import torch

from orca_backend.families.llama import LlamaConfig


def inverse_frequencies(
    head_dim: int, theta: float, llama3: tuple[float, float, float, int] | None = None, linear: float = 1.0
) -> torch.Tensor:
    """float32 [head_dim / 2]: theta^(-2i / head_dim), rescaled as `rope_type: llama3` or `linear`
    asks (linear: every frequency divided by the factor, i.e. positions interpolated).

    Llama 3.1 keeps high frequencies (wavelength under original_context / high_freq_factor),
    divides low ones (wavelength over original_context / low_freq_factor) by `factor`, and
    interpolates smoothly in between.
    """
    inv_freq = 1.0 / theta ** _exponents(head_dim)
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


def yarn_frequencies(head_dim: int, theta: float, yarn: tuple[float, int, float, float, bool]) -> torch.Tensor:
    """float32 [head_dim / 2] of `rope_type: yarn`, (factor, original_max_position_embeddings,
    beta_fast, beta_slow, truncate): the dimensions that turn more than beta_fast times within the
    original window keep their frequency (extrapolated), those that turn fewer than beta_slow times
    are divided by `factor` (interpolated), with a linear ramp over the dimensions in between."""
    factor, original_context, beta_fast, beta_slow, truncate = yarn

    def dimension_of(turns: float) -> float:  # the (fractional) dimension that turns `turns` times in the window
        return head_dim * math.log(original_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dimension_of(beta_fast), dimension_of(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # a one-dimension ramp, not a division by zero
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolated = 1 - ramp  # each dimension's share of its unscaled frequency
    powers = theta ** _exponents(head_dim)
    return (1.0 / (factor * powers)) * (1 - extrapolated) + (1.0 / powers) * extrapolated


def dynamic_ntk_frequencies(head_dim: int, theta: float, factor: float, window: int, max_positions: int) -> torch.Tensor:
    """float32 [max_positions, head_dim / 2] of `rope_type: dynamic`: row p has the NTK-aware base
    for a sequence of p + 1 tokens, theta ((factor (p + 1) / window) - (factor - 1))^(d / (d - 2)),
    and the unscaled frequencies within the window (module docstring)."""
    seq_len = torch.arange(1, max_positions + 1).clamp(min=window)  # int64, as transformers' seq_len tensor
    base = theta * ((factor * seq_len / window) - (factor - 1)) ** (head_dim / (head_dim - 2))
    scaled = 1.0 / base[:, None] ** _exponents(head_dim)
    return torch.where(seq_len[:, None] > window, scaled, inverse_frequencies(head_dim, theta))


def longrope_frequencies(
    head_dim: int, theta: float, short_factor: tuple[float, ...], long_factor: tuple[float, ...], window: int,
    max_positions: int,
) -> torch.Tensor:  # fmt: skip
    """float32 [max_positions, head_dim / 2] of `rope_type: longrope`: each frequency divided by its
    short factor at positions within the original window, by its long factor from there on (module
    docstring)."""
    powers = theta ** _exponents(head_dim)
    short = 1.0 / (torch.tensor(short_factor, dtype=torch.float32) * powers)
    long = 1.0 / (torch.tensor(long_factor, dtype=torch.float32) * powers)
    beyond = torch.arange(max_positions)[:, None] >= window  # seq_len = p + 1 > window
    return torch.where(beyond, long, short)


def cos_sin_table(
    inv_freq: torch.Tensor, max_positions: int, device: torch.device, attention_factor: float = 1.0
) -> torch.Tensor:
    """float32 [max_positions, head_dim]: cos(p * f) in the first half, sin(p * f) in the second, both
    times `attention_factor`. inv_freq: [head_dim / 2] for every row, or [max_positions, head_dim / 2]."""
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq
    return (torch.cat([freqs.cos(), freqs.sin()], dim=-1) * attention_factor).to(device)


def rope_table(config: LlamaConfig, device: torch.device) -> torch.Tensor:
    """The table of the config's rope (rope_theta with its scaling), config.max_context rows."""
    d, theta, positions = config.head_dim, config.rope_theta, config.max_context
    if config.rope_yarn is not None:
        inv_freq = yarn_frequencies(d, theta, config.rope_yarn)
    elif config.rope_dynamic != 1.0:
        inv_freq = dynamic_ntk_frequencies(d, theta, config.rope_dynamic, config.max_position_embeddings, positions)
    elif config.rope_longrope_window:
        inv_freq = longrope_frequencies(d, theta, config.rope_short_factor, config.rope_long_factor,
                                        config.rope_longrope_window, positions)  # fmt: skip
    else:
        inv_freq = inverse_frequencies(d, theta, config.rope_llama3, config.rope_linear)
    return cos_sin_table(inv_freq, positions, device, config.rope_attention_factor)


def _exponents(head_dim: int) -> torch.Tensor:
    """float32 [head_dim / 2]: 2i / head_dim, the exponent of theta in frequency i."""
    return torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
