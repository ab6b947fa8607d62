"""The served adapters' list: the model version's multi_lora.json (Triton's vLLM backend's file,
{adapter name: directory}), read at load and, with allow_runtime_lora_updating, again whenever it
or an adapter's files change, so adapters are added, replaced and removed while the model serves.

A thread of its own looks (one stat of the file, a few of each adapter's) once a second: reading and
checking an adapter reads all its weights, which must never hold up Triton's thread. An edited file
takes effect within about a second. Adapters it no longer lists are refused to new requests; those
running finish with them. An adapter whose files changed is read and checked again (a new adapter
if its weights changed). An adapter the engine refuses (a bad directory or file, a rank above
max_lora_rank, a path outside lora_allowed_dir) is logged alone, and the others still apply; it is
tried again when its files or the list change.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path

from orca_backend.lora import MULTI_LORA_FILE, read_multi_lora_json

CHECK_INTERVAL_S = 1.0


def multi_lora_path(model_dir: str | Path, version: str) -> Path:
    """Where the vLLM backend (and Triton's OpenAI frontend, to list a model's adapters) look for it."""
    return Path(model_dir) / str(version) / MULTI_LORA_FILE


class MultiLoraFile:
    def __init__(
        self, path: Path, apply: Callable[[dict[str, str]], list[str]], changed: Callable[[], list[str]],
        log: Callable[[str], None],
    ) -> None:  # fmt: skip
        """`apply` makes the engine serve exactly the given adapters and returns the refusals;
        `changed` names the adapters whose files changed since they were read; `log` reports (the
        model's Triton log)."""
        self.path, self._apply, self._changed, self._log = path, apply, changed, log
        self._stamp = self._stat()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orca-multi-lora", daemon=True)

    def start(self) -> MultiLoraFile:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - the watcher outlives any one bad re-read
                self._log(f"{self.path}: re-read failed ({e!r}); the adapters served stay as they were")

    def _stat(self) -> tuple[int, int] | None:
        try:
            info = self.path.stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def refresh(self) -> None:
        """Re-reads the file and re-applies it if it, or some adapter's files, changed."""
        stamp = self._stat()
        changed = self._changed()
        if stamp == self._stamp and not changed:
            return
        self._stamp = stamp
        try:
            adapters = read_multi_lora_json(self.path)
        except ValueError as e:  # a half-written or removed file: the adapters served stay as they were
            self._log(f"{self.path}: not applied ({e})")
            return
        errors = self._apply(adapters)
        for error in errors:
            self._log(f"{self.path}: {error}")
        why = f"the files of {', '.join(changed)} changed" if changed else "it changed"
        self._log(f"{self.path}: re-read ({why}); serving LoRA adapters {sorted(set(adapters))} less {len(errors)} refused")
