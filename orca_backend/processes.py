"""What the engine's child processes (the core process, the tp x pp workers) share: how one ended."""

from __future__ import annotations

import signal


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
