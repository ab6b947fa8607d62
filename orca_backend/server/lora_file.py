"""The served adapters' list: the model version's multi_lora.json (Triton's vLLM backend's file,
{adapter name: directory}), read at load and, with allow_runtime_lora_updating, again whenever it
changes, so adapters are added and removed while the model serves.

The file is looked at (one stat) at most once a second, from execute(): an edited file takes effect
for the requests that arrive after it. Adapters it no longer lists are refused to new requests; those
running finish with them. An adapter the engine refuses (a bad directory, a rank above
max_lora_rank, a path outside lora_allowed_dir) is logged, and the others still apply.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from orca_backend.lora import MULTI_LORA_FILE, read_multi_lora_json

CHECK_INTERVAL_S = 1.0


def multi_lora_path(model_dir: str | Path, version: str) -> Path:
    """Where the vLLM backend (and Triton's OpenAI frontend, to list a model's adapters) look for it."""
    return Path(model_dir) / str(version) / MULTI_LORA_FILE


class MultiLoraFile:
    def __init__(self, path: Path, apply: Callable[[dict[str, str]], list[str]], log: Callable[[str], None]) -> None:
        """`apply` makes the engine serve exactly the given adapters and returns the refusals; `log`
        reports them (the model's Triton log)."""
        self.path, self._apply, self._log = path, apply, log
        self._stamp = self._stat()
        self._next_check = time.monotonic() + CHECK_INTERVAL_S

    def _stat(self) -> tuple[int, int] | None:
        try:
            info = self.path.stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def refresh(self) -> None:
        """Re-reads the file if it changed since it was last read (checked at most once a second)."""
        now = time.monotonic()
        if now < self._next_check:
            return
        self._next_check = now + CHECK_INTERVAL_S
        stamp = self._stat()
        if stamp == self._stamp:
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
        self._log(f"{self.path}: re-read; serving LoRA adapters {sorted(set(adapters))} less {len(errors)} refused")
