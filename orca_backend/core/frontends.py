"""The frontends one engine core serves: the one that started it and those attached since.

A served model may run several Triton instances (`instance_group { count: N }`): N stub processes,
each parsing, tokenizing, detokenizing and answering its own requests, over one engine core. The
first instance starts the core process and talks to it over the pipe it was started with (frontend
0, the owner); the others connect to the socket the core listens on (core_process.py). Each frontend
gets only its own requests' outputs, and every frontend gets a frame for every iteration the core
reports, with the stats and the death reason: a frontend's watchdog takes silence while its
requests are outstanding as a hang, and its requests may be queued behind the others'.

Requests are the owner's unless an attached frontend added them; their ids are unique across
frontends (each instance makes its own distinct, server/orca_model.py). An attached frontend that
goes away (its stub was killed, or its model instance finalized) has its requests aborted, so their
K/V is freed; the owner going away stops the core (core_process.py).
"""

from __future__ import annotations

import logging
import threading
from multiprocessing.connection import Connection

from orca_backend.messages import CoreOutputs, EngineStats, outputs_frame

logger = logging.getLogger("orca.engine")

OWNER = 0  # the frontend that started the core


class Frontends:
    """Connections by index (OWNER: the starting frontend's pipe), and which attached frontend owns
    which request. The loop thread sends; each connection's reader thread registers and drops."""

    def __init__(self, owner: Connection) -> None:
        self._lock = threading.Lock()
        self._links: dict[int, Connection] = {OWNER: owner}
        self._next = OWNER + 1
        self._owner_of: dict[str, int] = {}  # request id -> attached frontend (the OWNER's are not listed)

    def attach(self, conn: Connection) -> int:
        with self._lock:
            index = self._next
            self._next += 1
            self._links[index] = conn
        return index

    def register(self, index: int, request_ids: list[str]) -> None:
        """Before the core sees an attached frontend's requests: their first outputs may come at once."""
        if index == OWNER:
            return
        with self._lock:
            for request_id in request_ids:
                self._owner_of[request_id] = index

    def detach(self, index: int) -> list[str]:
        """Forgets an attached frontend; returns the ids of its requests the core still holds. They
        stay listed as its until their final outputs (the aborts') pass, which then go nowhere."""
        with self._lock:
            self._links.pop(index, None)
            return [rid for rid, owner in self._owner_of.items() if owner == index]

    def send(self, outputs: CoreOutputs, stats: EngineStats, dead_reason: str | None) -> None:
        """One frame to each frontend: its requests' outputs (perhaps none), the stats, the death.

        Raises OSError if the owner's pipe is gone (the core then stops); an attached frontend whose
        connection fails is dropped, its requests left for its reader thread to abort.
        """
        with self._lock:
            links = dict(self._links)
            if len(links) == 1 and not self._owner_of:  # the common case, one instance: no split
                parts = {OWNER: outputs}
            else:
                parts = self._split(outputs, links)
        for index, conn in links.items():
            frame = outputs_frame(parts.get(index) or CoreOutputs(), stats, dead_reason)
            if index == OWNER:
                conn.send_bytes(frame)
                continue
            try:
                conn.send_bytes(frame)
            except OSError:  # its reader thread reads EOF too, and aborts what it owned
                logger.warning("attached frontend %d is gone; its requests are aborted", index)
                with self._lock:
                    self._links.pop(index, None)

    def _split(self, outputs: CoreOutputs, links: dict[int, Connection]) -> dict[int, CoreOutputs]:
        """Each frontend's share of one step's outputs (called with the lock held)."""
        parts = {index: CoreOutputs() for index in links}
        owner_of = self._owner_of
        for request_id, token in zip(outputs.request_ids, outputs.token_ids, strict=True):
            part = parts.get(owner_of.get(request_id, OWNER))
            if part is not None:  # None: its frontend is gone, and the request is being aborted
                part.request_ids.append(request_id)
                part.token_ids.append(token)
        for output in outputs.others:
            index = owner_of.get(output.request_id, OWNER)
            if output.finished:
                owner_of.pop(output.request_id, None)
            part = parts.get(index)
            if part is not None:
                part.others.append(output)
        return parts

    def attached(self) -> list[tuple[int, Connection]]:
        with self._lock:
            return [(index, conn) for index, conn in self._links.items() if index != OWNER]
