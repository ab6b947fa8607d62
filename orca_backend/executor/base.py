"""The executor interface: the engine core submits `SchedulerOutput`s and collects sampled tokens (a
`SamplerOutput`: the tokens, and logprobs for the rows that asked), oldest first.

Up to `max_in_flight` batches may be submitted before collecting: one for a single stage, `pp`
with pipeline parallelism so every stage has work (ORCA §4.2, Figure 8).
"""

from __future__ import annotations

from typing import Protocol

from orca_backend.scheduler_output import SamplerOutput, SchedulerOutput


class WorkerFailure(RuntimeError):
    """A worker process died or raised: the model is gone, every request in it must end."""


class BatchFailed(RuntimeError):
    """One batch failed where the workers could go on (its sampling, after every collective): the
    engine core treats it as any failed forward."""


class Executor(Protocol):
    max_in_flight: int
    kv_capacity_tokens: int  # the K/V pool every rank allocated (sized from memory where the config asks)

    @property
    def num_in_flight(self) -> int: ...

    def submit(self, step: SchedulerOutput) -> None: ...

    def collect_oldest(self) -> SamplerOutput:
        """Sampled tokens of the oldest submitted batch, blocking; raises WorkerFailure if the model is
        gone, and any other exception (BatchFailed from workers) if only this batch failed."""
        ...

    def shutdown(self) -> None: ...
