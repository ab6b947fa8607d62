"""The whole model in the engine core's process (tp = pp = 1)."""

from __future__ import annotations

from collections import deque

from orca_backend.scheduler_output import SamplerOutput, SchedulerOutput
from orca_backend.worker.model_runner import ModelRunner


class LocalExecutor:
    """A step's deltas are taken in when it is submitted; it runs when it is collected, on the thread
    that collects it."""

    max_in_flight = 1

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self._pending: deque[SchedulerOutput] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def submit(self, step: SchedulerOutput) -> None:
        self.runner.update_states(step)
        self._pending.append(step)

    def collect_oldest(self) -> SamplerOutput:
        return self.runner.execute(self._pending.popleft())

    def shutdown(self) -> None:
        self._pending.clear()
