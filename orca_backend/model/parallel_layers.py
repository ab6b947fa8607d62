"""The two tensor-parallel building blocks every family shares: a vocabulary-parallel embedding
lookup and a row-parallel linear layer (each rank holds a slice of the input dimension)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.model import gemm


def vocab_parallel_embed(input_ids: torch.Tensor, table: torch.Tensor, vocab_lo: int, tp: TensorParallelGroup) -> torch.Tensor:
    """Rows of the embedding for `input_ids`; `table` is this rank's [vocab shard, hidden] slice
    starting at id `vocab_lo`. Each rank fills the ids it holds and zeros elsewhere; the sum over
    ranks is the full lookup."""
    if tp.size == 1:
        return table[input_ids]
    local = input_ids - vocab_lo
    mine = (local >= 0) & (local < table.shape[0])
    return tp.all_reduce(table[local.clamp(0, table.shape[0] - 1)] * mine[:, None])


def row_parallel_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, tp: TensorParallelGroup,
    lora: Callable[[torch.Tensor, torch.Tensor], None] | None = None,
) -> torch.Tensor:  # fmt: skip
    """x @ weight.T + bias where x and weight hold this rank's slice of the input dimension. `lora`
    (x, y) adds the tokens' adapter deltas to this rank's partial product in place, before the
    partial sums meet (model/lora.py: the sum of the ranks' deltas is the whole delta)."""
    if tp.size == 1:
        out = gemm.linear(x, weight, bias)
        if lora is not None:
            lora(x, out)
        return out
    partial = gemm.linear(x, weight)
    if lora is not None:
        lora(x, partial)
    out = tp.all_reduce(partial)
    return out if bias is None else out + bias  # the bias once, after the partial sums meet
