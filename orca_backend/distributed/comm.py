"""Tensor-parallel collectives inside one pipeline stage (NCCL on GPUs, gloo on CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist


class TensorParallelGroup:
    """The ranks of one stage. With a single rank every collective is the identity."""

    def __init__(self, size: int = 1, group: dist.ProcessGroup | None = None) -> None:
        self.size = size
        self.group = group

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(tensor, group=self.group)
        return tensor

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """Concatenates each rank's [rows, chunk] logits into [rows, vocab] on every rank."""
        if self.size == 1:
            return local
        chunk = -(-vocab // self.size)
        padded = local.new_full((local.shape[0], chunk), float("-inf"))
        padded[:, : local.shape[1]] = local
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        dist.all_gather(parts, padded, group=self.group)
        return torch.cat(parts, dim=1)[:, :vocab]


def smallest_over_ranks(value: int, device: torch.device) -> int:
    """`value`'s minimum over every rank of the world (every rank calls it at the same point: a
    collective of the default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def any_rank(flags: list[bool], device: torch.device) -> list[bool]:
    """Each flag OR-ed over every rank of the world (every rank calls it at the same point of the
    same step: a collective of the default group)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return flags
    tensor = torch.tensor([int(f) for f in flags], dtype=torch.int32, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return [bool(v) for v in tensor.tolist()]
