"""Executors run batches on the model: in this process, or on worker processes (parallel/workers.py).

The engine submits `BatchMeta`s and collects sampled tokens oldest first. Up to `max_in_flight`
batches may be submitted before collecting: one for a single stage, `pp` with pipeline parallelism
so every stage has work (ORCA §4.2, Figure 8).
"""

from __future__ import annotations

from collections import deque
from typing import Protocol

from orca_backend.engine.batch import BatchMeta
from orca_backend.engine.model_runner import ModelRunner


class WorkerFailure(RuntimeError):
    """A worker process died or raised: the model is gone, every request in it must end."""


class Executor(Protocol):
    max_in_flight: int

    @property
    def num_in_flight(self) -> int: ...

    def submit(self, meta: BatchMeta) -> None: ...

    def collect_oldest(self) -> list[int]:
        """Sampled tokens of the oldest submitted batch, blocking; raises WorkerFailure if the model is gone."""
        ...

    def shutdown(self) -> None: ...


class LocalExecutor:
    """The whole model in the engine's process; a batch runs when it is collected."""

    max_in_flight = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._pending: deque[BatchMeta] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def submit(self, meta: BatchMeta) -> None:
        self._pending.append(meta)

    def collect_oldest(self) -> list[int]:
        return self.runner.execute(self._pending.popleft())

    def shutdown(self) -> None:
        self._pending.clear()
