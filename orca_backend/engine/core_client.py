"""The frontend's handle on an engine core running in its own process (core/core_process.py).

`EngineCoreProcess` starts the process (spawned: never fork a process that may hold CUDA or
threads) and returns once the model is loaded; `AttachedCore` connects to a core that another
frontend started (another Triton instance of the same model: core/frontends.py). Then both only
send: adds and aborts go out as they come, on any thread.
The output thread ("orca-output") receives one frame per iteration and hands the outputs (this
frontend's requests' only) to the frontend's callback, which detokenizes and reports them; it also
keeps the stats the last frame carried. The core's death, however it happens (its loop failed, it
was killed), reaches the frontend as `on_dead(reason)` once, after the last outputs it managed to send.

The watchdog ("orca-watchdog") covers what no exception reports: a hang. The core sends a frame for
every iteration to every frontend, so while requests are outstanding, silence for
`iteration_timeout_s` means an iteration is stuck (a stopped or deadlocked worker, a forward that
never returns). With `health_check_interval_s`, an idle core is pinged that often and its loop must
answer within the same timeout, so a wedged engine is found before a request finds it. The watchdog
then kills the core process, whose workers follow their master, and the death path above ends every
request, on every frontend.
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, wait
from typing import TYPE_CHECKING

from orca_backend.config import EngineConfig
from orca_backend.messages import (
    DETACH_MESSAGE,
    PING_MESSAGE,
    STOP_MESSAGE,
    CoreAddress,
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
from orca_backend.processes import child_environment, exit_description

if TYPE_CHECKING:
    from orca_backend.core.core_process import CoreHook

logger = logging.getLogger("orca.engine")


def _core_process_main(config: EngineConfig, conn: Connection, hook: CoreHook | None,
                       listen: CoreAddress | None) -> None:  # fmt: skip
    """The spawned process's target. The core is imported there only: the frontend's process (the
    Triton stub) never loads the scheduler, the executor or torch."""
    from orca_backend.core.core_process import run_core_process

    run_core_process(config, conn, hook, listen)


SHUTDOWN_TIMEOUT_S = 30.0  # an iteration in progress finishes before the core sees the stop


class _CoreLink:
    """One frontend's connection to an engine core process: what both kinds share (sending, the
    output thread, the watchdog). A subclass connects, then calls `_serve` with the ready answer."""

    def __init__(self, config: EngineConfig, on_outputs: Callable[[CoreOutputs], None],
                 on_dead: Callable[[str], None]) -> None:  # fmt: skip
        self._on_outputs = on_outputs
        self._on_dead = on_dead
        self.dead_reason: str | None = None
        # The frontend that started the core stopped it: the model is being unloaded (attached links only).
        self.stopped_by_owner = False
        self._closing = False
        self._send_lock = threading.Lock()  # adds, aborts and stop come from several threads
        # The watchdog's view: requests sent and not finished, and when the core last showed progress.
        self._iteration_timeout_s = float(config.iteration_timeout_s)
        self._health_check_s = float(config.health_check_interval_s)
        self._outstanding = 0
        self._progress_at = time.monotonic()
        self._ping_at: float | None = None  # an idle core's health check was sent then, unanswered so far
        self._hang_reason: str | None = None
        self._stats = EngineStats(0, 0, 0, config.kv_capacity_tokens, 0, 0, 0.0, 0)
        self._conn: Connection
        self._thread: threading.Thread | None = None
        self.pid = 0
        self.worker_pids: list[int] = []
        self.kv_capacity_tokens = config.kv_capacity_tokens

    def _serve(self, info: dict) -> None:
        self.pid = info["pid"]
        self.worker_pids = info["worker_pids"]
        self.kv_capacity_tokens = info["kv_capacity_tokens"]  # the pool the core allocated
        self._stats = dataclasses.replace(self._stats, kv_capacity_tokens=self.kv_capacity_tokens)
        self._thread = threading.Thread(target=self._output_loop, name="orca-output", daemon=True)
        self._thread.start()
        if self._iteration_timeout_s > 0:
            threading.Thread(target=self._watchdog, name="orca-watchdog", daemon=True).start()

    def _kill(self) -> None:
        """Kills the core process at once (its workers follow their master)."""
        raise NotImplementedError

    def _gone_reason(self) -> str:
        """Why the core's end closed, when this frontend did not close it."""
        raise NotImplementedError

    def _reap(self) -> None:
        """Waits (briefly) for the core process to be gone, where this frontend is its parent."""

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

    def _join_output_thread(self) -> None:
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    # ---------------------------------------------------------------- output thread
    def _output_loop(self) -> None:
        try:
            self._read_frames()
        except BaseException as exc:  # noqa: BLE001 - nobody would deliver another output: end them all
            logger.exception("the engine's output thread failed")
            reason = f"the engine's output thread failed: {exc!r}"
            if self._mark_dead(reason):
                self._kill()
                self._on_dead(reason)

    def _read_frames(self) -> None:
        while True:
            try:
                message = loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if message[0] == "stopped":
                self.stopped_by_owner = True
                break
            outputs, self._stats, dead_reason = read_frame(message)
            finished = outputs.num_finished
            with self._send_lock:
                self._progress_at = time.monotonic()
                self._ping_at = None
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
        self._reap()  # a killed core is gone, not a zombie, by the time its requests hear of it
        if self._closing:
            reason = "the engine was shut down"
        elif self._hang_reason is not None:
            reason = self._hang_reason
        else:
            reason = self._gone_reason()
        if self._mark_dead(reason):
            self._on_dead(reason)

    # ---------------------------------------------------------------- watchdog thread
    def _watchdog(self) -> None:
        period = min(1.0, self._iteration_timeout_s / 4, self._health_check_s / 2 or 1.0)
        while not self._closing and self.dead_reason is None:
            time.sleep(period)
            now = time.monotonic()
            with self._send_lock:
                if self._outstanding > 0:
                    stalled, waiting = now - self._progress_at, f"with {self._outstanding} requests outstanding"
                elif self._ping_at is not None:
                    stalled, waiting = now - self._ping_at, "to an idle engine's health check"
                else:
                    stalled, waiting = 0.0, ""
                ping = (self._health_check_s > 0 and self._outstanding == 0 and self._ping_at is None
                        and now - self._progress_at >= self._health_check_s)  # fmt: skip
                if ping:
                    self._ping_at = now
            if ping:
                with contextlib.suppress(EngineDeadError):  # the output thread reports a death
                    self._send(PING_MESSAGE)
            if stalled > self._iteration_timeout_s and not self._closing and self.dead_reason is None:
                self._hang_reason = (
                    f"no engine iteration finished in {stalled:.0f} s {waiting} "
                    f"(iteration_timeout_s={self._iteration_timeout_s:g}): a worker or the forward is hung; the "
                    f"engine core process (pid {self.pid}) was killed"
                )
                logger.error("watchdog: %s", self._hang_reason)
                # Workers too: a stopped (SIGSTOP) worker would not notice its master's death.
                for pid in self.worker_pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                self._kill()  # the output thread reads EOF and ends every request with this reason
                if self._thread is not None and not self._thread.is_alive() and self._mark_dead(self._hang_reason):
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


class EngineCoreProcess(_CoreLink):
    """A core process this frontend starts and owns: it stops when this frontend stops it or goes."""

    def __init__(
        self,
        config: EngineConfig,
        on_outputs: Callable[[CoreOutputs], None],
        on_dead: Callable[[str], None],
        hook: CoreHook | None = None,
        start_timeout_s: float | None = None,
        listen: CoreAddress | None = None,
    ) -> None:
        """Returns once the model is loaded; raises what loading raised (or why the process died).
        With `listen`, other frontends may attach to the core there (`AttachedCore`)."""
        super().__init__(config, on_outputs, on_dead)
        ctx = mp.get_context("spawn")
        self._conn, child_end = ctx.Pipe(duplex=True)
        # Not a daemon: a daemonic process may not start the tp x pp worker processes.
        self.process = ctx.Process(target=_core_process_main, args=(config, child_end, hook, listen),
                                   name="orca-engine-core", daemon=False)  # fmt: skip
        with child_environment():  # its workers inherit it from the core
            self.process.start()
        child_end.close()  # the process holds the only other end: its exit reads as EOF here
        atexit.register(self.shutdown)  # a process left running would hang interpreter exit
        try:
            info = self._startup_answer(start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._serve(info)

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

    def _kill(self) -> None:
        self.process.kill()

    def _reap(self) -> None:
        self.process.join(timeout=5)

    def _gone_reason(self) -> str:
        return f"the engine core process (pid {self.process.pid}) {exit_description(self.process.exitcode)}"

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
        self._join_output_thread()
        self._conn.close()


class AttachedCore(_CoreLink):
    """A core another frontend started and owns: this frontend's going detaches it (the core aborts
    its requests and serves the others); the core's end, orderly or not, ends its requests."""

    def __init__(
        self,
        config: EngineConfig,
        address: CoreAddress,
        on_outputs: Callable[[CoreOutputs], None],
        on_dead: Callable[[str], None],
        answer_timeout_s: float = 60.0,
    ) -> None:
        """Connects to the core listening at `address` (its model is loaded); ConnectionError naming
        the address if none answers there."""
        super().__init__(config, on_outputs, on_dead)
        try:
            self._conn = Client(address.path, family="AF_UNIX", authkey=address.authkey)
        except (OSError, EOFError, AuthenticationError) as exc:
            raise ConnectionError(f"no engine core answers at {address.path}: {exc!r}") from exc
        if not self._conn.poll(answer_timeout_s):
            self._conn.close()
            raise ConnectionError(f"the engine core at {address.path} did not answer within {answer_timeout_s:g} s")
        self._serve(loads(self._conn.recv_bytes())[1])

    def _kill(self) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(self.pid, signal.SIGKILL)

    def _gone_reason(self) -> str:
        if self.stopped_by_owner:
            return "the engine was shut down by the model instance that started it (the model is being unloaded)"
        return f"the engine core process (pid {self.pid}) is gone"

    def shutdown(self) -> None:
        """Detaches from the core. Idempotent."""
        if self._closing:
            return
        self._closing = True
        # The core closes its end in answer, which ends the output thread; then this end closes.
        with self._send_lock, contextlib.suppress(OSError):
            self._conn.send_bytes(DETACH_MESSAGE)
        self._join_output_thread()
        self._conn.close()
