"""Which slice of the model a rank holds: its pipeline stage's layers and its tensor-parallel shard."""

from __future__ import annotations

from dataclasses import dataclass

from orca_backend.config import stage_layers


@dataclass(frozen=True)
class ParallelLayout:
    tp_size: int = 1
    pp_size: int = 1
    tp_rank: int = 0
    pp_rank: int = 0

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        """Global rank: stages are consecutive blocks of tp_size ranks."""
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def layers(self, n_layer: int) -> range:
        """This stage's layers (config.stage_layers)."""
        return stage_layers(n_layer, self.pp_size, self.pp_rank)

    def shard(self, size: int) -> tuple[int, int]:
        """[lo, hi) of a dimension split evenly over tp ranks (heads, MLP width)."""
        if size % self.tp_size:
            raise ValueError(f"dimension {size} does not split over tensor_parallel_size {self.tp_size}")
        step = size // self.tp_size
        return self.tp_rank * step, (self.tp_rank + 1) * step

    def vocab_shard(self, vocab: int) -> tuple[int, int]:
        """[lo, hi) of the vocabulary; chunks of ceil(vocab / tp), the last one shorter."""
        chunk = -(-vocab // self.tp_size)
        return min(self.tp_rank * chunk, vocab), min((self.tp_rank + 1) * chunk, vocab)


SINGLE_PROCESS = ParallelLayout()  # the whole model on one rank
