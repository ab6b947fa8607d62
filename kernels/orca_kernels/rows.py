"""Activations as the norm and element-wise kernels (Triton and C) take them: [rows, width] with
unit column stride, and outputs shaped back like their input."""

from __future__ import annotations

import torch


def as_rows(t: torch.Tensor, width: int) -> torch.Tensor:
    """[..., width] -> [rows, width] with unit column stride: a view whenever possible. A 2-D input
    is used as it is, without a reshape (these run at one token, where each call counts)."""
    if t.dim() != 2:
        t = t.reshape(-1, width)
    return t if t.stride(1) == 1 else t.contiguous()


def empty_rows(like: torch.Tensor, rows: int, width: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A new [rows, width] tensor of `dtype`, viewed as `like`'s leading shape with `width` last.
    torch.empty takes ints: a torch.Size costs 2 us more to parse."""
    out = torch.empty(rows, width, dtype=dtype)
    return out if like.dim() == 2 else out.view(*like.shape[:-1], width)
