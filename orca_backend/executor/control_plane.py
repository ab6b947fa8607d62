"""The Ray pool's control plane, the engine core's side and a rank's: TCP connections that are
authenticated both ways with a shared random key (multiprocessing's HMAC challenge) and then carry
the rank's hello, each under a deadline.

`ControlServer` listens on one address (the core's node address as Ray knows it, never every
interface) and accepts until every rank is in: a peer that fails any part of the handshake (a port
scan's connect-and-close, a wrong key, garbage, an over-long frame, silence, a rank out of range or
already in) is dropped and logged with its address while accepting goes on, and the listener closes
once the ranks are in. `connect_control` is a rank's end, under the same deadline. Both ends set TCP
keepalive, so a peer that vanishes without a reset becomes an error (orca_backend/net.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import socket
import threading
import time
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from orca_backend.executor.base import WorkerFailure
from orca_backend.net import listen, set_keepalive

logger = logging.getLogger("orca.workers")

# A control connection's TCP connect, mutual authentication and hello, from either end: a peer that
# takes longer is dropped (a real rank needs milliseconds; the bound only ends silent peers).
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING_HANDSHAKES = 64  # connections authenticating at once; more are refused at once
MAX_HELLO_BYTES = 256
ACCEPT_POLL_S = 0.25  # how often accepting looks at finished handshakes and at ranks that died


class _Deadline:
    """Shuts `sock` down unless the block it guards ends within `timeout_s`, and then fails the block
    with TimeoutError: multiprocessing's handshake reads without a timeout, and a silent (or
    trickling) peer would hold it forever."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock, self._timeout_s = sock, timeout_s
        self._lock = threading.Lock()
        self._ended = self._expired = False
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._timer.cancel()
        with self._lock:
            self._ended = True
            if self._expired:
                raise TimeoutError(f"no handshake within {self._timeout_s:g} s") from exc

    def _expire(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._expired = True
            with contextlib.suppress(OSError):  # already closed by its peer
                self._sock.shutdown(socket.SHUT_RDWR)


def connect_control(address: tuple[str, int], authkey: bytes, rank: int,
                    timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:  # fmt: skip
    """A rank's control connection to the engine core's ControlServer: connected, authenticated both
    ways and its rank said, each within `timeout_s` (TimeoutError, AuthenticationError or OSError
    otherwise)."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        sock.settimeout(None)  # a Connection reads a blocking descriptor
        set_keepalive(sock)
        conn = Connection(os.dup(sock.fileno()))
        try:
            with _Deadline(sock, timeout_s):
                answer_challenge(conn, authkey)
                deliver_challenge(conn, authkey)
                conn.send_bytes(json.dumps({"kind": "hello", "rank": rank}).encode())
        except BaseException:
            conn.close()
            raise
    finally:
        sock.close()
    return conn


class ControlServer:
    """The engine core's end of the control plane: a TCP listener on `host` (port ephemeral) that
    `accept_ranks` takes every rank's connection from, then closes."""

    def __init__(self, host: str, authkey: bytes, world_size: int,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:  # fmt: skip
        self._listener = listen(host)
        self._listener.settimeout(ACCEPT_POLL_S)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._authkey, self._world_size, self._handshake_timeout_s = authkey, world_size, handshake_timeout_s
        self._lock = threading.Lock()  # guards the three below
        self._closed = False
        self._handshaking: set[socket.socket] = set()
        self._accepted: queue.SimpleQueue[tuple[tuple, int, Connection]] = queue.SimpleQueue()

    def accept_ranks(self, timeout_s: float, ended: Callable[[], str | None] = lambda: None) -> list[Connection]:
        """Every rank's connection, in rank order. Each connection authenticates and says its rank on a
        thread of its own, so a bad peer delays no other; one that fails is dropped and logged with its
        address (the first connection of a rank wins). WorkerFailure if `timeout_s` passes first, or if
        `ended()` (asked about once a second) describes a rank that ended before connecting. The
        listener is closed when this returns or raises."""
        ranks: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        next_check = 0.0
        try:
            while len(ranks) < self._world_size:
                now = time.monotonic()
                if now >= next_check:
                    why = ended()
                    if why:
                        raise WorkerFailure(f"a Ray worker ended before connecting: {why}")
                    next_check = now + 1.0
                if now > deadline:
                    missing = sorted(set(range(self._world_size)) - set(ranks))
                    raise WorkerFailure(f"the Ray workers did not all connect within {timeout_s:.0f} s "
                                        f"(ranks {missing} did not)")  # fmt: skip
                self._accept_one()
                self._take_accepted(ranks)
        except BaseException:
            for conn in ranks.values():
                conn.close()
            raise
        finally:
            self.close()
        return [ranks[rank] for rank in range(self._world_size)]

    def close(self) -> None:
        """Stops listening and ends the handshakes under way. Idempotent."""
        with self._lock:
            self._closed = True
            handshaking = list(self._handshaking)
        self._listener.close()
        for sock in handshaking:
            with contextlib.suppress(OSError):  # its handshake just ended
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(queue.Empty):
            while True:
                self._accepted.get_nowait()[2].close()  # authenticated after the last rank: not needed

    def _accept_one(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except TimeoutError:
            return
        with self._lock:
            busy = len(self._handshaking) >= MAX_PENDING_HANDSHAKES
            if not busy:
                self._handshaking.add(sock)
        if busy:
            sock.close()
            _drop(peer, f"{MAX_PENDING_HANDSHAKES} connections are authenticating already")
            return
        threading.Thread(target=self._handshake, args=(sock, peer), name="orca-ray-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: tuple) -> None:
        """On its own thread: authenticates `sock`'s peer and reads its hello; queues (peer, rank,
        connection), or drops it."""
        try:
            sock.setblocking(True)
            set_keepalive(sock)
            conn = Connection(os.dup(sock.fileno()))
            try:
                with _Deadline(sock, self._handshake_timeout_s):
                    deliver_challenge(conn, self._authkey)
                    answer_challenge(conn, self._authkey)
                    rank = _read_hello(conn.recv_bytes(MAX_HELLO_BYTES), self._world_size)
            except BaseException:
                conn.close()
                raise
        except (EOFError, OSError, AuthenticationError, AssertionError, ValueError) as exc:
            with self._lock:
                closed = self._closed  # then close() cut it short
            _drop(peer, "accepting ended before it authenticated" if closed else _handshake_failure(exc))
            return
        finally:
            with self._lock:
                self._handshaking.discard(sock)
            sock.close()
        with self._lock:
            if not self._closed:
                self._accepted.put((peer, rank, conn))
                return
        conn.close()

    def _take_accepted(self, ranks: dict[int, Connection]) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                peer, rank, conn = self._accepted.get_nowait()
                if rank in ranks:
                    conn.close()
                    _drop(peer, f"rank {rank} is connected already")
                else:
                    ranks[rank] = conn


def _read_hello(data: bytes, world_size: int) -> int:
    """The rank a hello message says, or ValueError."""
    hello = json.loads(data)  # a ValueError if it is not JSON (or not UTF-8)
    if not isinstance(hello, dict) or hello.get("kind") != "hello":
        raise ValueError(f"expected {{\"kind\": \"hello\", \"rank\": <rank>}}, got {data[:80]!r}")
    rank = hello.get("rank")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is not one of this pool's ranks 0..{world_size - 1}")
    return rank


def _handshake_failure(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return str(exc)
    if isinstance(exc, EOFError | ConnectionResetError):
        # A peer that closes with our challenge still unread is reset by its kernel, not closed.
        return "it closed the connection during the handshake"
    if isinstance(exc, AuthenticationError | AssertionError):  # AssertionError: not a challenge at all
        return f"it failed authentication ({exc or 'not a challenge'})"
    if isinstance(exc, ValueError):
        return f"bad hello: {exc}"
    return f"{exc or type(exc).__name__} (a malformed frame, or a reset)"


def _drop(peer: tuple, why: str) -> None:
    logger.warning("dropped a control connection from %s port %s: %s", peer[0], peer[1], why)
