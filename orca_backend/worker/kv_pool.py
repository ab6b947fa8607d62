"""The preallocated K/V pool of a worker's layers; core/kv_cache_manager.py decides who holds which slots."""

from __future__ import annotations

import torch


def allocate_kv_pool(
    num_layers: int, capacity_tokens: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The preallocated per-layer K/V pools, [slots, heads, head_dim] each."""
    shape = (capacity_tokens, num_heads, head_dim)
    return [
        (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
        for _ in range(num_layers)
    ]
