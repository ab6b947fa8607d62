"""Builds and loads the project's small C kernels for CPU (kernels/csrc) with the system C compiler,
and the conventions every kernel is called with.

A kernel is compiled once per machine into a cache directory (``$ORCA_CACHE_DIR``, else
``$XDG_CACHE_HOME/orca``, else ``~/.cache/orca``), keyed by its source, the compiler and the CPU's
feature flags (it is built with ``-march=native``; the key covers the shared headers csrc/*.h too), and loaded with ctypes: no Python headers, no
torch headers, about a second to build. Several processes may build at once; the last rename wins
and every one loads a complete file.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]


class NativeBuildError(RuntimeError):
    pass


def _cache_dir() -> Path:
    if os.environ.get("ORCA_CACHE_DIR"):
        return Path(os.environ["ORCA_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "orca"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        return ""


def _compiler() -> str:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not compiler:
        raise NativeBuildError(
            "no C compiler found (set $CC or install gcc, e.g. `apt-get install gcc`); it builds the CPU "
            "kernels (decode attention, the decode GEMM, the element-wise ops of GPT-2 and the Llama family)"
        )
    return compiler


@functools.cache
def load(name: str) -> ctypes.CDLL:
    """The shared library built from csrc/<name>.c, compiling it on first use on this machine."""
    source = CSRC / f"{name}.c"
    compiler = _compiler()
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]  # what a kernel #includes from csrc
    key = hashlib.sha256(
        b"\0".join([source.read_bytes(), *headers, compiler.encode(), " ".join(CFLAGS).encode(), _cpu_flags().encode()])
    ).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            result = subprocess.run(
                [compiler, *CFLAGS, str(source), "-o", tmp, "-lm"], capture_output=True, text=True, check=False
            )
            if result.returncode != 0:
                raise NativeBuildError(f"building {source.name} with {compiler} failed:\n{result.stderr.strip()}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    return ctypes.CDLL(str(target))


# Pointers travel as plain integers (tensor.data_ptr()) declared void*: a ctypes.cast per argument
# costs ~2 us, as much as some of the kernels at one token.
PTR = ctypes.c_void_p
I64 = ctypes.c_int64

# Vectorized<float>::size() in torch's CPU kernels: the norm kernels add in torch's order and SiLU
# splits its rows as torch does, both of which depend on it.
TORCH_FLOAT_LANES = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8


def declare(library: str, name: str, argtypes: list, restype: type | None) -> ctypes._CFuncPtr:
    """Entry point `name` of csrc/<library>.c (built on first use) with its C signature declared."""
    fn = getattr(load(library), name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def check_float32(name: str, *tensors: torch.Tensor | None) -> None:
    """The C kernels take float32 CPU tensors only: anything else is a ValueError naming the kernel."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            raise ValueError(f"{name} takes float32 CPU tensors only, got {t.dtype} on {t.device}")
