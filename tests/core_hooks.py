"""Hooks tests install in an engine core process (`LLMEngine.launch(config, core_hook=...)`).

The core runs in a process of its own, so a test cannot patch it from outside: it hands the
process one of these objects, whose multiprocessing primitives travel with it when the process is
spawned, and drives it from the test's side.
"""

from __future__ import annotations

import multiprocessing as mp
from typing import Any

_ctx = mp.get_context("spawn")


class StepGate:
    """Holds the core before each forward until the test lets one through: the test decides how far
    generation gets, whatever the machine's speed."""

    def __init__(self) -> None:
        self._permits = _ctx.Semaphore(0)
        self._open = _ctx.Event()
        self._aborts = _ctx.Semaphore(0)  # one per abort the core has taken into its inbox

    def __call__(self, core: Any) -> None:  # in the core process
        executor = core.executor
        run = executor.collect_oldest
        abort = core.abort

        def collect() -> list[int]:
            if not self._open.is_set():
                assert self._permits.acquire(timeout=60), "the test never let this iteration run"
            return run()

        def noted_abort(*args: Any, **kwargs: Any) -> None:
            abort(*args, **kwargs)
            self._aborts.release()

        executor.collect_oldest = collect
        core.abort = noted_abort

    def wait_for_abort(self, timeout_s: float = 60.0) -> bool:
        """Until the core's inbox holds the abort the test sent (its reader thread took it from the
        pipe): the next iteration's drain then sees it, however the core's threads are scheduled."""
        return self._aborts.acquire(timeout=timeout_s)

    def allow(self, iterations: int = 1) -> None:
        for _ in range(iterations):
            self._permits.release()

    def open(self) -> None:
        self._open.set()
        self._permits.release()


class PoisonSampling:
    """Makes the sampling of one request's rows fail inside the workers, after every collective (a
    structured-output bitmask that does not split into its rows makes the sampling rank raise), as a
    fault that strikes only that batch would."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id

    def __call__(self, core: Any) -> None:  # in the core process
        executor = core.executor
        submit = executor.submit

        def poisoned(step: Any) -> None:
            if self.request_id in step.scheduled_ids:
                step.bitmask_rows, step.bitmask = [step.scheduled_ids.index(self.request_id)], b"\0"
            submit(step)

        executor.submit = poisoned


class Crash(BaseException):
    """Kills the engine loop (its per-batch guard only catches Exception)."""


class CrashSwitch:
    """Once thrown, the core's next iteration kills its loop, as a bug in the loop would."""

    def __init__(self) -> None:
        self._thrown = _ctx.Event()

    def __call__(self, core: Any) -> None:  # in the core process
        step = core.step

        def checked_step() -> Any:
            if self._thrown.is_set():
                raise Crash("simulated loss of the engine")
            return step()

        core.step = checked_step

    def throw(self) -> None:
        self._thrown.set()


class RequireEnv:
    """Fails the core's start (LLMEngine.launch raises it) unless the process runs with name=value."""

    def __init__(self, name: str, value: str) -> None:
        self.name, self.value = name, value

    def __call__(self, core: Any) -> None:  # in the core process
        import os

        found = os.environ.get(self.name)
        if found != self.value:
            raise AssertionError(f"the core process runs with {self.name}={found!r}, not {self.value!r}")


def pid_alive(pid: int) -> bool:
    """Whether a process runs (a zombie awaiting its parent's wait() does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):  # gone, before the open or between it and the read
        return False
