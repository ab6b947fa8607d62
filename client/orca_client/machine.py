"""Which machine a benchmark ran on: the CPU's model and widest vector extension, and the capability
torch's CPU kernels dispatch to. CPU figures move with both (this project's machines are AMD EPYCs
with AVX2 or AVX-512 and Intel Xeons with AVX-512 and AMX, handed out at random), so every report
names them; and which code it ran (`code_revision`), so every figure can be traced to a commit."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path


def _cpuinfo_field(name: str) -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def cpu_model() -> str:
    return _cpuinfo_field("model name") or platform.processor() or platform.machine() or "unknown"


def cpu_vectors() -> str:
    """The widest x86 vector extension the CPU reports (and AMX where present), else the machine."""
    flags = set(_cpuinfo_field("flags").split())
    if not flags:
        return platform.machine() or "unknown"
    widest = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "SSE/AVX"
    return widest + (" + AMX" if "amx_tile" in flags else "")


def torch_cpu_capability() -> str:
    """torch.backends.cpu.get_cpu_capability() (ATEN_CPU_CAPABILITY overrides it), or why not.

    The client never imports torch itself (tests/client/test_client_imports.py): where this process has
    not, a child of the same Python answers, as a server started from it would see it."""
    torch = sys.modules.get("torch")
    if torch is not None:
        return torch.backends.cpu.get_cpu_capability()
    code = "import torch; print(torch.backends.cpu.get_cpu_capability())"
    try:
        result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({e})"
    return result.stdout.strip() if result.returncode == 0 else "unknown (torch is not importable here)"


def describe() -> dict[str, str]:
    return {
        "cpu": cpu_model(),
        "cpu_vectors": cpu_vectors(),
        "torch_cpu_capability": torch_cpu_capability(),
        "cpus": str(os.cpu_count()),
    }


def summary(machine: dict[str, str] | None = None) -> str:
    """One line for a report: 'AMD EPYC (AVX-512), 2 CPUs, torch CPU capability AVX512'."""
    m = machine or describe()
    return f"{m['cpu']} ({m['cpu_vectors']}), {m['cpus']} CPUs, torch CPU capability {m['torch_cpu_capability']}"


def code_revision(tree: Path | None = None) -> str:
    """The commit of the checkout at `tree` (default: the one this package sits in), "+dirty" with
    uncommitted changes to tracked files; "unknown" outside a git checkout (an installed copy)."""
    tree = tree or Path(__file__).resolve().parents[2]

    def git(*args: str) -> str:
        try:
            return subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True, check=True,
                                  timeout=10).stdout.strip()  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return ""

    head = git("rev-parse", "--short", "HEAD")
    if not head:
        return "unknown"
    return head + ("+dirty" if git("status", "--porcelain", "--untracked-files=no") else "")
