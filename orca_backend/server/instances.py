"""How the Triton instances of one served model find their one engine core.

`instance_group { count: N }` gives a model N stub processes, started at once by one tritonserver,
each running `initialize()`. The first to take the model's lock starts the engine core process,
which listens on a socket for the others (core/frontends.py); they wait until it answers and
attach. The lock is an flock held by the starting instance for its whole life, so:
- while an instance waits, a held lock means the core is still loading (a large model takes
  minutes): it waits on; a free lock and no answer means the starting instance failed (its own load
  error says why) or went away, and the waiting instance's load fails saying so;
- nothing is left behind to clean: the kernel frees the lock with its holder, the core removes its
  socket when it stops, and a stale socket file (a killed core) is replaced by the next owner.

Everything lives in a directory of this user's only (mode 0700), named by the tritonserver's pid
(the stubs' parent), the model and its version: two servers, or two models of one, never meet. The
socket's key (multiprocessing's HMAC handshake) is a file there, written by the owner before its
core listens.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import secrets
import stat
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from orca_backend.messages import CoreAddress

ATTACH_POLL_S = 0.1
MAX_SOCKET_PATH = 100  # AF_UNIX allows 107 bytes


def instance_count(triton_config: dict[str, Any]) -> int:
    """The instances config.pbtxt asks for: each group's count, times its `gpus` where it lists them.
    A KIND_GPU group without `gpus` gets a set per visible GPU, which the config does not say: it
    counts once here, so list the GPUs, or use KIND_MODEL (the engine places its tensors itself)."""
    total = 0
    for group in triton_config.get("instance_group") or [{"count": 1}]:
        total += int(group.get("count", 1) or 1) * max(1, len(group.get("gpus") or []))
    return total


class CoreRendezvous:
    """The meeting point of one model's instances in one tritonserver (module docstring)."""

    def __init__(self, model_name: str, model_version: str, server_pid: int | None = None,
                 root: Path | None = None) -> None:  # fmt: skip
        server_pid = os.getppid() if server_pid is None else server_pid  # a stub's parent is tritonserver
        root = root or Path(tempfile.gettempdir()) / f"orca-{os.getuid()}"
        name = f"{server_pid}-{model_name}-v{model_version}"
        if len(str(root / name / "core.sock")) > MAX_SOCKET_PATH:
            name = f"{server_pid}-{hashlib.sha256(name.encode()).hexdigest()[:16]}"
        if len(str(root / name / "core.sock")) > MAX_SOCKET_PATH:
            raise RuntimeError(f"{root} is too long a directory for the engine core's socket (AF_UNIX paths are "
                               "limited to 107 bytes): set TMPDIR to a shorter one")  # fmt: skip
        self.directory = root / name
        self._socket = self.directory / "core.sock"
        self._key_file = self.directory / "core.key"
        self._lock_fd: int | None = None
        _private_directory(root)
        _private_directory(self.directory)

    def claim(self) -> bool:
        """True if this instance is the model's first: it starts the core, and holds the lock until
        `release` (or its process ends)."""
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self._lock_fd = fd
        return True

    def owner_address(self) -> CoreAddress:
        """For the owner: a new key, written before the core listens, and no stale socket in the way."""
        assert self._lock_fd is not None, "only the instance holding the lock starts the core"
        key = secrets.token_bytes(32)
        fd = os.open(self._key_file, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(key)
        self._socket.unlink(missing_ok=True)
        return CoreAddress(str(self._socket), key)

    def wait_for_core(self, attach: Callable[[CoreAddress], Any]) -> Any:
        """For the others: `attach(address)` once the owner's core listens; RuntimeError if the owner
        lets go of the lock (it failed or went away) before that."""
        while True:
            if self._socket.exists():
                try:
                    return attach(CoreAddress(str(self._socket), self._key_file.read_bytes()))
                except (ConnectionError, OSError):
                    pass  # a stale socket, or the core is stopping: decided below
            if self._lock_is_free():
                raise RuntimeError("the model instance that starts the engine core failed to load, or went away, "
                                   "before its core answered; its own load error in the server log says why")
            time.sleep(ATTACH_POLL_S)

    def _lock_is_free(self) -> bool:
        fd = os.open(self.directory / "lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        finally:
            os.close(fd)  # frees it again, if this took it
        return True

    def release(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None


def _private_directory(path: Path) -> None:
    """Makes (or checks) a directory only this user can enter: a socket and key inside are safe."""
    path.mkdir(mode=0o700, exist_ok=True)
    info = path.lstat()
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise RuntimeError(f"{path} must be a directory of this user's only (mode 0700); remove it and load again")
