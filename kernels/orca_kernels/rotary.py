"""Rotary position embedding, neox style (Hugging Face's ``rotate_half``): torch reference.

Llama, Mistral, Qwen2 and Qwen3 rotate each head vector ``[x1, x2]`` (its two halves) by the
angles ``pos * inv_freq``: ``[x1 cos - x2 sin, x2 cos + x1 sin]``. The caller precomputes one fp32
table ``cos_sin`` [max_positions, head_dim] whose first half of columns is cos(pos * inv_freq) and
second half sin(pos * inv_freq); a row gather by position then serves a ragged batch of prefill
and decode tokens alike.
"""

from __future__ import annotations

import torch


def check_rotary_args(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> int:
    """Validates the shapes shared by every implementation; returns head_dim."""
    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        raise ValueError(
            f"rotary needs q [T, Hq, D] and k [T, Hkv, D], got {tuple(q.shape)} and {tuple(k.shape)}"
        )
    head_dim = q.shape[2]
    if head_dim % 2 or cos_sin.dim() != 2 or cos_sin.shape[1] != head_dim:
        raise ValueError(f"rotary needs an even head_dim and cos_sin [max_positions, {head_dim}], "
                         f"got head_dim {head_dim} and cos_sin {tuple(cos_sin.shape)}")  # fmt: skip
    if positions.shape != (q.shape[0],):
        raise ValueError(f"rotary needs positions [T={q.shape[0]}], got {tuple(positions.shape)}")
    return head_dim


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] in fp32; cos/sin [T, 1, D/2] broadcast over the heads."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def rotary_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] (any strides), positions int64 [T], cos_sin fp32 [P, D].

    Returns new contiguous (q_out, k_out) in q's dtype, computed in fp32. The inputs are never
    modified: q and k are often views of the fused qkv projection, whose v part must stay intact.
    """
    head_dim = check_rotary_args(q, k, positions, cos_sin)
    cos, sin = cos_sin[positions].float().unsqueeze(1).split(head_dim // 2, dim=-1)
    q_out = _rotate(q.float(), cos, sin).to(q.dtype)
    k_out = _rotate(k.float(), cos, sin).to(q.dtype)
    return q_out, k_out
