"""Builds and loads the project's small C kernels for CPU (kernels/orca_kernels/csrc) with the system C
compiler, and the conventions every kernel is called with.

A kernel is compiled once per machine into a cache directory (``$ORCA_CACHE_DIR``, else
``$XDG_CACHE_HOME/orca``, else ``~/.cache/orca``), keyed by its source, the compiler and the CPU's
feature flags (it is built with ``-march=native``; the key covers the shared headers csrc/*.h too), and loaded with ctypes: no Python headers, no
torch headers, about a second to build. Several processes may build at once; the last rename wins
and every one loads a complete file. The key is also compiled into the library
(``orca_build_key``): a cached file that does not carry it (left by another build, damaged, or
replaced) is never loaded, but rebuilt, with a warning.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger("orca.kernels")

CSRC = Path(__file__).parent / "csrc"
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-fPIC", "-shared"]
# Libraries built from more than their own csrc/<name>.c: the kernels they call, compiled in beside it.
LINKED = {"decoder_step": ("llama_ops", "gpt2_ops", "decode_gemm", "decode_attention")}


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
    """The shared library built from csrc/<name>.c (and the files LINKED names), compiling it on
    first use on this machine."""
    sources = [CSRC / f"{part}.c" for part in (name, *LINKED.get(name, ()))]
    compiler = _compiler()
    headers = [h.read_bytes() for h in sorted(CSRC.glob("*.h"))]  # what a kernel #includes from csrc
    key = hashlib.sha256(
        b"\0".join([*(s.read_bytes() for s in sources), *headers, compiler.encode(), " ".join(CFLAGS).encode(),
                    _cpu_flags().encode()])  # fmt: skip
    ).hexdigest()[:16]
    target = _cache_dir() / f"{name}-{key}.so"
    stamp = _build_stamp(key)
    if target.exists() and stamp not in target.read_bytes():
        logger.warning("orca kernels: the cached %s does not carry the build key of its source; rebuilding it", target)
    elif target.exists():
        return ctypes.CDLL(str(target))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp_dir:
        stamp_c, tmp = Path(tmp_dir) / "build_key.c", Path(tmp_dir) / target.name
        stamp_c.write_text(f'__attribute__((used)) const char orca_build_key[] = "{stamp.decode()}";\n')
        result = subprocess.run([compiler, *CFLAGS, *map(str, sources), str(stamp_c), "-o", str(tmp), "-lm"],
                                capture_output=True, text=True, check=False)  # fmt: skip
        if result.returncode != 0:
            raise NativeBuildError(f"building {sources[0].name} with {compiler} failed:\n{result.stderr.strip()}")
        os.replace(tmp, target)
    return ctypes.CDLL(str(target))


def _build_stamp(key: str) -> bytes:
    """What a library built for `key` carries in its data: checked before a cached file is loaded."""
    return f"orca-build-key:{key}".encode()


# Pointers travel as plain integers (tensor.data_ptr()) declared void*: a ctypes.cast per argument
# costs ~2 us, as much as some of the kernels at one token.
PTR = ctypes.c_void_p
I64 = ctypes.c_int64

# The vector width (floats) of torch's CPU kernels compiled for the capability it dispatches to
# (ATEN_CPU_CAPABILITY overrides it): Vectorized<float>::size() is 16 under AVX512, 8 otherwise.
CAPABILITY_LANES = 16 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 8
LANE_CANDIDATES = (16, 8, 4)


@dataclass(frozen=True)
class TorchOrder:
    """How a C kernel that reproduces one of torch's CPU kernels' rounding runs on this machine."""

    lanes: int  # the vector width it adds (or splits rows) in
    matches: bool  # whether at that width its outputs agree with torch's on the probe rows


def probe_torch_order(kernel: str, agrees: Callable[[int], bool]) -> TorchOrder:
    """The vector width at which `agrees(lanes)` (the C kernel at that width against its torch
    reference on probe rows) holds, the capability's own width tried first.

    Not every torch kernel has a build for every capability: under AVX512, torch 2.13's sum and
    LayerNorm run their AVX2 build (registered without ALSO_REGISTER_AVX512_DISPATCH) while its
    element-wise kernels run 16-wide, so the width is measured per kernel, not read off the CPU.
    Where no width agrees, `matches` is False and dispatch keeps the torch reference for that op
    (logged here, once per kernel and process)."""
    order = [CAPABILITY_LANES, *(lanes for lanes in LANE_CANDIDATES if lanes != CAPABILITY_LANES)]
    capability = torch.backends.cpu.get_cpu_capability()
    for lanes in order:
        if agrees(lanes):
            logger.info("orca kernels: the C %s kernel follows torch's order in %d-float vectors (torch's CPU "
                        "capability %s)", kernel, lanes, capability)  # fmt: skip
            return TorchOrder(lanes, True)
    logger.warning("orca kernels: the C %s kernel does not reproduce torch's rounding at any vector width in %s "
                   "(torch %s, CPU capability %s); that op runs the torch reference", kernel, order,
                   torch.__version__, capability)  # fmt: skip
    return TorchOrder(CAPABILITY_LANES, False)


def declare(library: str, name: str, argtypes: list, restype: type | None) -> ctypes._CFuncPtr:
    """Entry point `name` of csrc/<library>.c (built on first use) with its C signature declared."""
    fn = getattr(load(library), name)
    fn.argtypes = argtypes
    fn.restype = restype
    return fn


def check_float32_or_bf16(name: str, *tensors: torch.Tensor | None) -> torch.dtype:
    """The one dtype of `tensors` (None skipped) for a C kernel with float32 and bfloat16 entry points
    (CPU tensors only): anything else is a ValueError naming the kernel."""
    dtypes = {t.dtype for t in tensors if t is not None}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16} or not all(t.is_cpu for t in tensors if t is not None):
        found = [(t.dtype, t.device.type) for t in tensors if t is not None]
        raise ValueError(f"{name} takes CPU tensors all float32 or all bfloat16, got {found}")
    return dtypes.pop()


def check_float32(name: str, *tensors: torch.Tensor | None) -> None:
    """The C kernels take float32 CPU tensors only: anything else is a ValueError naming the kernel."""
    for t in tensors:
        if t is not None and (t.dtype != torch.float32 or not t.is_cpu):
            raise ValueError(f"{name} takes float32 CPU tensors only, got {t.dtype} on {t.device}")
