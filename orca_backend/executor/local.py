"""The whole model in the engine core's process (tp = pp = 1)."""

from __future__ import annotations

from collections import deque

from orca_backend.scheduler_output import SamplerOutput, SchedulerOutput
from orca_backend.worker.model_runner import LaunchedStep, ModelRunner


class LocalExecutor:
    """A step's deltas are taken in when it is submitted. It runs when it is collected, on the thread
    that collects it; under async scheduling it is launched at once instead (on a GPU its kernels are
    queued and the host goes on), and up to two steps are in flight: the next one is scheduled and
    launched while the last runs, and a step's tokens are read back when it is collected."""

    def __init__(self, runner: ModelRunner, async_scheduling: bool = False) -> None:
        self.runner = runner
        self.kv_capacity_tokens = runner.kv_capacity_tokens
        self.max_in_flight = 2 if async_scheduling else 1
        self._pending: deque[SchedulerOutput | LaunchedStep] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def submit(self, step: SchedulerOutput) -> None:
        self.runner.update_states(step)
        self._pending.append(self.runner.launch(step) if self.max_in_flight > 1 else step)

    def collect_oldest(self) -> SamplerOutput:
        pending = self._pending.popleft()
        if isinstance(pending, SchedulerOutput):
            return self.runner.execute(pending)
        return pending.result()

    def shutdown(self) -> None:
        self._pending.clear()
