"""The engine core in a process of its own.

A served model runs its `EngineCore` here, never in Triton's stub process: scheduling, the forward
and the update run on this process's main thread (the thread that loaded the model, see
`run_core_process`), so they never compete for one GIL with the stub's response sending. With
tp x pp > 1 this process is also the master of the worker processes.

The frontend (engine/core_client.py) and this process talk over one duplex pipe, in the messages
and encoding of orca_backend/messages.py: requests, aborts and stop in; a ready (or failed) answer,
then one frame per iteration that produced anything, carrying every request's new tokens at once.
A reader thread takes the frontend's messages into the core's inbox, so adds and aborts never wait
for an iteration; the loop sends each frame itself. When the frontend's end of the pipe closes
(the stub was killed), the core stops and the process exits; its workers follow their master.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection

from orca_backend.config import EngineConfig
from orca_backend.core.engine_core import EngineCore
from orca_backend.messages import CoreOutputs, EngineDeadError, dumps, loads, outputs_frame

# Called with the built core before it serves, inside the core process (must be picklable): the seam
# tests use to hold or break iterations, and where instrumentation can attach.
CoreHook = Callable[[EngineCore], None]

logger = logging.getLogger("orca.engine")


# ------------------------------------------------------------------------------ the process
def run_core_process(config: EngineConfig, conn: Connection, hook: CoreHook | None = None) -> None:
    """Entry point of the engine core process: build, report ready (or why not), serve until told to stop.

    The model loads on this thread and runs on it: torch's CPU thread pool belongs to the thread
    that first ran parallel ops, and a forward on another thread measured 1.3-1.7x slower.
    """
    logging.basicConfig(level=logging.INFO, format="orca-engine-core %(levelname)s %(name)s: %(message)s")
    try:
        core = EngineCore(config, config.model_config())
        if hook is not None:
            hook(core)
    except BaseException as exc:  # noqa: BLE001 - the frontend raises it to whoever launched the engine
        conn.send_bytes(dumps(("failed", _picklable(exc))))
        return
    conn.send_bytes(dumps(("ready", {"pid": os.getpid(), "worker_pids": getattr(core.executor, "pids", [])})))
    threading.Thread(target=_read_inputs, args=(conn, core), name="orca-core-inputs", daemon=True).start()
    try:
        core.run_forever(lambda outputs: conn.send_bytes(outputs_frame(outputs, core.stats(), core.dead_reason)))
        if core.dead_reason is not None:  # the frontend must hear of the death even if no request was failed
            conn.send_bytes(outputs_frame(CoreOutputs(), core.stats(), core.dead_reason))
    except OSError:
        logger.warning("the frontend is gone; stopping")
    finally:
        core.shutdown()


def _read_inputs(conn: Connection, core: EngineCore) -> None:
    while True:
        try:
            message = loads(conn.recv_bytes())
        except (EOFError, OSError):  # the frontend's end closed: nobody is left to serve
            core.stop()
            return
        kind = message[0]
        if kind == "add":
            # A dead core refuses it; the frontend fails every request it holds when it hears of the death.
            with contextlib.suppress(EngineDeadError):
                core.add_requests(message[1])
        elif kind == "abort":
            core.abort(message[1], message[2])
        elif kind == "stop":
            core.stop()
            return


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(dumps((exc,)))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")

