"""What the engine's child processes (the core process, the tp x pp workers) share: the environment
they start with, and how one ended."""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator
from pathlib import Path

# torch's CPU allocator (c10's alloc_cpu) asks the kernel for transparent huge pages, madvise
# MADV_HUGEPAGE, for every buffer of 2 MB and more when this is 1: the weights and the K/V pool then
# sit on 2 MB pages, and a decode step's streaming reads cross a page (a TLB miss, and where the
# hardware prefetcher stops) 512 times less often: 1.04x the offline throughput of llama-150m in
# bfloat16 (docs/cpu-gemm.md, "Huge pages"). torch reads it once, at its first allocation, so it is
# set for the processes the engine spawns, before they import torch; a value the user set is kept
# (0 turns it off), and a kernel whose THP mode is "never" ignores the advice.
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
THP_MODE_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def child_env_vars() -> dict[str, str]:
    """The variables the engine's children start with: HUGE_PAGES_ENV=1 unless the user set it."""
    return {HUGE_PAGES_ENV: os.environ.get(HUGE_PAGES_ENV, "1")}


@contextlib.contextmanager
def child_environment() -> Iterator[None]:
    """os.environ with `child_env_vars` added, for the processes spawned inside (a spawned process
    copies its parent's environment when it starts); what it added is removed on exit."""
    added = {key: value for key, value in child_env_vars().items() if key not in os.environ}
    os.environ.update(added)
    try:
        yield
    finally:
        for key in added:
            os.environ.pop(key, None)


def huge_pages_description() -> str:
    """This process's huge-page setting for torch's CPU buffers, for the log."""
    try:
        mode = next((w.strip("[]") for w in THP_MODE_FILE.read_text().split() if w.startswith("[")), "unknown")
    except OSError:
        mode = "unknown (no " + str(THP_MODE_FILE) + ")"
    wanted = os.environ.get(HUGE_PAGES_ENV, "")
    state = "on" if wanted == "1" and mode in ("always", "madvise") else "off"
    return f"transparent huge pages for torch's CPU buffers of 2 MB and more: {state} ({HUGE_PAGES_ENV}={wanted or 'unset'}, the kernel's mode {mode})"


def exit_description(code: int | None) -> str:
    """How a child process ended, from its exit code (None: no exit status yet)."""
    if code is None:
        return "stopped answering"
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"
