"""The frontend's handle on an engine core running in its own process (core/core_process.py).

It starts the process (spawned: never fork a process that may hold CUDA or threads), waits until
the model is loaded, and then only sends: adds and aborts go out as they come, on any thread.
Its output thread ("orca-output") receives one frame per iteration and hands the outputs to the
frontend's callback, which detokenizes and reports them; it also keeps the stats the last frame
carried. The process's death, however it happens (its loop failed, it was killed), reaches the
frontend as `on_dead(reason)` once, after the last outputs the process managed to send.

The watchdog ("orca-watchdog") covers what no exception reports: a hang. The core sends a frame for
every iteration, so while requests are outstanding, silence for `iteration_timeout_s` means an
iteration is stuck (a stopped or deadlocked worker, a forward that never returns). The watchdog then
kills the process, whose workers follow their master, and the death path above ends every request.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from typing import TYPE_CHECKING

from orca_backend.config import EngineConfig
from orca_backend.messages import (
    STOP_MESSAGE,
    CoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    EngineStats,
    FinishReason,
    abort_message,
    add_message,
    loads,
    read_frame,
)
from orca_backend.processes import exit_description

if TYPE_CHECKING:
    from orca_backend.core.core_process import CoreHook

logger = logging.getLogger("orca.engine")


def _core_process_main(config: EngineConfig, conn: Connection, hook: CoreHook | None) -> None:
    """The spawned process's target. The core is imported there only: the frontend's process (the
    Triton stub) never loads the scheduler, the executor or torch."""
    from orca_backend.core.core_process import run_core_process

    run_core_process(config, conn, hook)

SHUTDOWN_TIMEOUT_S = 30.0  # an iteration in progress finishes before the core sees the stop


class EngineCoreProcess:
    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[CoreOutputs], None],
        on_dead: Callable[[str], None],
        hook: CoreHook | None = None,
        start_timeout_s: float | None = None,
    ) -> None:
        """Returns once the model is loaded; raises what loading raised (or why the process died)."""
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self.dead_reason: str | None = None
        self._closing = False
        self._send_lock = threading.Lock()  # adds, aborts and stop come from several threads
        # The watchdog's view: requests sent and not finished, and when the core last showed progress.
        self._iteration_timeout_s = float(config.iteration_timeout_s)
        self._outstanding = 0
        self._progress_at = time.monotonic()
        self._hang_reason: str | None = None
        self._stats = EngineStats(0, 0, 0, config.kv_capacity_tokens, 0, 0, 0.0, 0)
        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe(duplex=True)
        # Not a daemon: a daemonic process may not start the tp x pp worker processes.
        self.process = ctx.Process(target=_core_process_main, args=(config, child_end, hook),
                                   name="orca-engine-core", daemon=False)  # fmt: skip
        self.process.start()
        child_end.close()  # the process holds the only other end: its exit reads as EOF here
        atexit.register(self.shutdown)  # a process left running would hang interpreter exit
        try:
            info = self._startup_answer(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self.pid: int = info["pid"]
        self.worker_pids: list[int] = info["worker_pids"]
        self._thread = threading.Thread(target=self._output_loop, name="orca-output", daemon=True)
        self._thread.start()
        if self._iteration_timeout_s > 0:
            threading.Thread(target=self._watchdog, name="orca-watchdog", daemon=True).start()

    def _startup_answer(self, timeout_s: float | None) -> dict:
        if not wait([self._conn, self.process.sentinel], timeout=timeout_s):
            raise RuntimeError(f"the engine core process did not load the model within {timeout_s:.0f} s")
        try:
            message = loads(self._conn.recv_bytes())
        except (EOFError, OSError):
            self.process.join(timeout=5)
            raise RuntimeError(f"the engine core process {exit_description(self.process.exitcode)} while loading "
                               "the model; its log says why") from None
        if message[0] == "failed":
            raise message[1]
        return message[1]

    # ----------------------------------------------------------------- any thread
    def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        with self._send_lock:
            if self._outstanding == 0:  # the clock starts with the first outstanding request
                self._progress_at = time.monotonic()
            self._outstanding += len(requests)
        self._send(add_message(requests))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        with contextlib.suppress(EngineDeadError):  # a dead core has ended every request already
            self._send(abort_message(request_id, reason))

    def stats(self) -> EngineStats:
        return self._stats

    def _send(self, data: bytes) -> None:
        with self._send_lock:
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine is not serving: {self.dead_reason}")
            try:
                self._conn.send_bytes(data)
            except OSError:
                # The output thread reports the death with the process's exit code.
                raise EngineDeadError("the engine core process is gone") from None

    def shutdown(self) -> None:
        """Stops the process (the iteration in progress ends first), then by force. Idempotent."""
        if self._closing:
            return
        self._closing = True
        atexit.unregister(self.shutdown)
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send_bytes(STOP_MESSAGE)
        self.process.join(timeout=SHUTDOWN_TIMEOUT_S)
        if self.process.is_alive():
            logger.warning("engine core process %s did not stop within %.0f s; killing it", self.process.pid,
                           SHUTDOWN_TIMEOUT_S)
            self.process.kill()
            self.process.join(timeout=5)
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout=10)
        self._conn.close()

    # ---------------------------------------------------------------- output thread
    def _output_loop(self) -> None:
        try:
            self._read_frames()
        except BaseException as exc:  # noqa: BLE001 - nobody would deliver another output: end them all
            logger.exception("the engine's output thread failed")
            reason = f"the engine's output thread failed: {exc!r}"
            if self._mark_dead(reason):
                self.process.kill()  # its workers follow their master
                self._on_dead(reason)

    def _read_frames(self) -> None:
        while True:
            try:
                message = loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            outputs, self._stats, dead_reason = read_frame(message)
            finished = outputs.num_finished
            with self._send_lock:
                self._progress_at = time.monotonic()
                self._outstanding -= finished
            if dead_reason is not None:
                # Marked dead before its failed requests are reported, so their errors say the engine is gone.
                self._mark_dead(dead_reason)
            if outputs:
                try:
                    self._on_outputs(outputs)
                except Exception:  # a bug there must not silence every later request: log it and go on
                    logger.exception("output processing failed for %d outputs", len(outputs))
            if dead_reason is not None:
                self._on_dead(dead_reason)
                return
        self.process.join(timeout=5)
        if self._closing:
            reason = "the engine was shut down"
        elif self._hang_reason is not None:
            reason = self._hang_reason
        else:
            reason = f"the engine core process (pid {self.process.pid}) {exit_description(self.process.exitcode)}"
        if self._mark_dead(reason):
            self._on_dead(reason)

    # ---------------------------------------------------------------- watchdog thread
    def _watchdog(self) -> None:
        period = min(1.0, self._iteration_timeout_s / 4)
        while not self._closing and self.dead_reason is None:
            time.sleep(period)
            with self._send_lock:
                stalled = time.monotonic() - self._progress_at if self._outstanding > 0 else 0.0
            if stalled > self._iteration_timeout_s and not self._closing and self.dead_reason is None:
                self._hang_reason = (
                    f"no engine iteration finished in {stalled:.0f} s with {self._outstanding} requests outstanding "
                    f"(iteration_timeout_s={self._iteration_timeout_s:g}): a worker or the forward is hung; the "
                    f"engine core process (pid {self.process.pid}) was killed"
                )
                logger.error("watchdog: %s", self._hang_reason)
                # Workers too: a stopped (SIGSTOP) worker would not notice its master's death.
                for pid in self.worker_pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self.process.kill()  # the output thread reads EOF and ends every request with this reason
                if not self._thread.is_alive() and self._mark_dead(self._hang_reason):
                    self._on_dead(self._hang_reason)  # no output thread is left to do it
                return

    def _mark_dead(self, reason: str) -> bool:
        """Sets the dead reason once; False if it was already set."""
        with self._send_lock:
            if self.dead_reason is not None:
                return False
            self.dead_reason = reason
        if not self._closing:
            logger.error("engine stops serving: %s", reason)
        return True
