"""The iteration log: one JSON line per engine iteration, written off the loop.

Off by default (`EngineConfig.iteration_log`, a file path; `orca-serve --iteration-log DIR` gives
each model its own file). Each line says when the iteration ended and what it did: its duration,
the requests and tokens it scheduled (prompt and decode), the tokens it generated, the K/V blocks
used and free after it, the preemptions and prefix-cache hits it caused, and how its forward ran
(`step_path`: "cuda_graph", or why it ran eagerly). The loop only builds a
small dict and puts it on a bounded queue: a writer thread serialises and writes them, flushing
whenever it has caught up (so an engine killed later loses no line). A full queue (a disk slower
than the engine) drops the line and counts it, and never stalls the loop; the count is in every
line (`dropped`) and in the last one, written when the engine shuts down cleanly.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
from typing import IO, Any

logger = logging.getLogger("orca.engine")

QUEUE_LINES = 10_000  # ~ seconds of iterations: a disk stall longer than that drops lines


class IterationLog:
    def __init__(self, path: str, max_queued: int = QUEUE_LINES, stream: IO[str] | None = None) -> None:
        """Appends to `path` (or writes to `stream`, for tests)."""
        self.path = path
        self.dropped = 0
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(maxsize=max_queued)
        self._owns_stream = stream is None
        self._stream = stream if stream is not None else open(path, "a", buffering=1 << 16)  # noqa: SIM115
        self._thread = threading.Thread(target=self._write, name="orca-iteration-log", daemon=True)
        self._thread.start()

    def record(self, line: dict[str, Any]) -> None:
        """From the engine loop: never blocks."""
        line["dropped"] = self.dropped
        try:
            self._queue.put_nowait(line)
        except queue.Full:
            self.dropped += 1

    def close(self) -> None:
        """Writes what is queued and a last line with the drop count, then closes the file."""
        if not self._thread.is_alive():  # writing failed earlier (said then): nothing drains the queue
            return
        try:
            self._queue.put({"event": "closed", "dropped": self.dropped}, timeout=5)
            self._queue.put(None, timeout=5)
        except queue.Full:
            logger.warning("iteration log %s: the writer is stuck; closing without its last lines", self.path)
            return
        self._thread.join(timeout=10)

    def _write(self) -> None:
        while True:
            line = self._queue.get()
            if line is None:
                break
            try:
                self._stream.write(json.dumps(line, separators=(",", ":")) + "\n")
                if self._queue.empty():  # caught up: to disk, so a process killed later loses nothing
                    self._stream.flush()
            except OSError as exc:  # a full disk must not take the engine down: stop logging, say so once
                logger.error("iteration log %s: writing failed (%s); no more lines are written", self.path, exc)
                return
        self._stream.flush()
        if self._owns_stream:
            self._stream.close()
