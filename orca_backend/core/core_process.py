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

Given a `CoreAddress`, the core also listens there for more frontends (the other instances of a
served model, core/frontends.py): each connects and authenticates (multiprocessing's HMAC
handshake with the address's key), gets the same ready answer, then sends adds and aborts like the
first; it can neither stop the core nor outlive it (the listener closes with the core).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, Listener

from orca_backend.config import EngineConfig
from orca_backend.core.engine_core import EngineCore
from orca_backend.core.frontends import OWNER, Frontends
from orca_backend.messages import STOPPED_MESSAGE, CoreAddress, CoreOutputs, EngineDeadError, dumps, loads
from orca_backend.processes import huge_pages_description

# Called with the built core before it serves, inside the core process (must be picklable): the seam
# tests use to hold or break iterations, and where instrumentation can attach.
CoreHook = Callable[[EngineCore], None]

logger = logging.getLogger("orca.engine")


# ------------------------------------------------------------------------------ the process
def run_core_process(config: EngineConfig, conn: Connection, hook: CoreHook | None = None,
                     listen: CoreAddress | None = None) -> None:  # fmt: skip
    """Entry point of the engine core process: build, report ready (or why not), serve until told to stop.

    The model loads on this thread and runs on it: torch's CPU thread pool belongs to the thread
    that first ran parallel ops, and a forward on another thread measured 1.3-1.7x slower.
    `listen`: where more frontends may attach once the model is loaded.
    """
    logging.basicConfig(level=logging.INFO, format="orca-engine-core %(levelname)s %(name)s: %(message)s")
    logger.info("%s", huge_pages_description())
    try:
        core = EngineCore(config, config.model_config())
        if hook is not None:
            hook(core)
        listener = Listener(listen.path, family="AF_UNIX", authkey=listen.authkey) if listen is not None else None
    except BaseException as exc:  # noqa: BLE001 - the frontend raises it to whoever launched the engine
        conn.send_bytes(dumps(("failed", _picklable(exc))))
        return
    ready = dumps(("ready", {"pid": os.getpid(), "worker_pids": getattr(core.executor, "pids", []),
                             "kv_capacity_tokens": core.config.kv_capacity_tokens}))  # fmt: skip
    frontends = Frontends(conn)
    conn.send_bytes(ready)
    threading.Thread(target=_read_inputs, args=(conn, core, frontends, OWNER), name="orca-core-inputs",
                     daemon=True).start()  # fmt: skip
    if listener is not None:
        threading.Thread(target=_accept_frontends, args=(listener, core, frontends, ready), name="orca-core-attach",
                         daemon=True).start()  # fmt: skip
    try:
        core.run_forever(lambda outputs: frontends.send(outputs, core.stats(), core.dead_reason))
        if core.dead_reason is not None:  # the frontends must hear of the death even if no request was failed
            frontends.send(CoreOutputs(), core.stats(), core.dead_reason)
    except OSError:
        logger.warning("the frontend is gone; stopping")
    finally:
        if listener is not None:
            listener.close()  # removes the socket file: nobody attaches to a core that is going
        for _, attached in frontends.attached():
            with contextlib.suppress(OSError):
                attached.send_bytes(STOPPED_MESSAGE)  # an orderly end, unless a death was reported above
        core.shutdown()


def _accept_frontends(listener: Listener, core: EngineCore, frontends: Frontends, ready: bytes) -> None:
    """Takes in the frontends that attach, one reader thread each, until the listener closes."""
    while True:
        try:
            conn = listener.accept()
        except OSError:  # closed: the core is going
            return
        except Exception as exc:  # noqa: BLE001 - a peer that fails the handshake is refused alone
            logger.warning("refused a frontend that could not attach: %r", exc)
            continue
        try:
            conn.send_bytes(ready)
        except OSError:
            conn.close()
            continue
        index = frontends.attach(conn)
        logger.info("frontend %d attached", index)
        threading.Thread(target=_read_inputs, args=(conn, core, frontends, index), name=f"orca-core-inputs-{index}",
                         daemon=True).start()  # fmt: skip


def _read_inputs(conn: Connection, core: EngineCore, frontends: Frontends, index: int) -> None:
    while True:
        try:
            message = loads(conn.recv_bytes())
        except (EOFError, OSError):
            message = ("gone",)
        kind = message[0]
        if kind == "add":
            frontends.register(index, [request.request_id for request in message[1]])
            # A dead core refuses it; the frontend fails every request it holds when it hears of the death.
            with contextlib.suppress(EngineDeadError):
                core.add_requests(message[1])
        elif kind == "abort":
            core.abort(message[1], message[2])
        elif kind == "ping":
            core.ping()
        elif index == OWNER and kind in ("stop", "gone"):  # the starting frontend's end: nobody is left to serve
            core.stop()
            return
        elif index != OWNER and kind in ("detach", "gone"):  # what it asked for is no longer wanted
            for request_id in frontends.detach(index):
                core.abort(request_id)
            logger.info("frontend %d detached", index)
            conn.close()
            return


def _picklable(exc: BaseException) -> BaseException:
    try:
        pickle.loads(dumps((exc,)))
        return exc
    except Exception:
        return RuntimeError(f"{type(exc).__name__}: {exc}")

