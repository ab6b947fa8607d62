"""How the kernel tests run Triton: on the GPU when there is one, else on CPU through Triton's
interpreter, and the helpers every kernel test file shares.

How Triton picks the interpreter: ``@triton.jit`` reads TRITON_INTERPRET when it decorates a
function, not at launch. Our kernels are decorated when a ``kernels/orca_kernels/triton_*.py`` module is
imported, and ``get_ops`` re-imports one built in the other mode, so per-test monkeypatching covers
them. But ``triton.language`` decorates its own helpers (``tl.sum``, ``tl.max``, ``tl.zeros``) when
``triton`` is first imported, so the variable must also be set *before the first import of triton*
in the process. Importing this module does that (and restores the variable right after) when it
is the first to import triton on a machine without CUDA. If something imported triton earlier in
compiled mode, the kernel test files re-run themselves in a fresh interpreter process instead.

Tolerances: fp32 is checked tightly (1e-5). bf16/fp16 are checked against the fp32 reference on the
same rounded inputs with a couple of units in the last place; the interpreter also rounds fp32->bf16
toward zero where GPUs round to nearest even, which costs up to one more bf16 ulp.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import torch

INTERPRET_ENV = "TRITON_INTERPRET"
if "triton" not in sys.modules and not torch.cuda.is_available():
    _saved = os.environ.get(INTERPRET_ENV)
    os.environ[INTERPRET_ENV] = "1"
    try:
        import triton.language  # noqa: F401  (decorates tl.sum & co. as interpreted functions)
    except ImportError:
        pass  # importorskip below reports it
    finally:
        if _saved is None:
            del os.environ[INTERPRET_ENV]
        else:
            os.environ[INTERPRET_ENV] = _saved

tl = pytest.importorskip("triton.language")

from triton.runtime.jit import JITFunction  # noqa: E402

from orca_kernels import KernelOps, get_ops  # noqa: E402

INTERPRETED = not isinstance(tl.sum, JITFunction)
DEVICE = "cpu" if INTERPRETED or not torch.cuda.is_available() else "cuda"
# Triton was imported in compiled mode on a machine without CUDA: nothing can run in this process.
NEEDS_FRESH_PROCESS = DEVICE == "cpu" and not INTERPRETED

# (atol, rtol) per dtype, see the module docstring.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3)}


def use_import_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET as it was when triton was imported: the only mode this process can run."""
    if NEEDS_FRESH_PROCESS:
        pytest.skip("triton was imported before TRITON_INTERPRET=1; test_in_fresh_process covers this")
    if INTERPRETED:
        monkeypatch.setenv(INTERPRET_ENV, "1")
    else:
        monkeypatch.delenv(INTERPRET_ENV, raising=False)


def triton_ops(monkeypatch: pytest.MonkeyPatch) -> KernelOps:
    """The Triton bundle, in that mode."""
    use_import_mode(monkeypatch)
    ops = get_ops(DEVICE, "triton")
    assert ops.name == "triton"
    return ops


def run_in_fresh_process(test_file: str) -> None:
    """Runs a kernel test file in a new interpreter with TRITON_INTERPRET=1 set from the start."""
    env = {**os.environ, INTERPRET_ENV: "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file]
    result = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_in_fresh_process(request: pytest.FixtureRequest) -> None:
    """Imported by each kernel test file (pytest collects it there): where this process cannot run
    Triton, that file runs again in a new one."""
    run_in_fresh_process(str(request.path))


def randn(*shape: int, g: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=g).to(device=DEVICE, dtype=dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    """`actual` has `dtype` and matches `expected` within that dtype's tolerance."""
    atol, rtol = TOL[dtype]
    assert actual.dtype == dtype
    torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol)


@contextlib.contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch, what: str) -> Iterator[None]:
    """Inside: every way a tensor's value reaches the host raises, naming `what`, and so do the
    metadata's per-object host caches (a reference may have filled them before); on CUDA any
    synchronizing call is an error too. What a launch a CUDA graph can capture must pass."""
    from orca_kernels import AttentionMetadata

    def host_read(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"{what} read a tensor back to the host")

    with monkeypatch.context() as guard:
        for name in ("tolist", "item", "cpu", "numpy", "__int__", "__index__", "__bool__", "__float__"):
            guard.setattr(torch.Tensor, name, host_read)
        for name in ("host_lens", "context_slots"):
            guard.setattr(AttentionMetadata, name, host_read)
        if DEVICE == "cuda":
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if DEVICE == "cuda":
                torch.cuda.set_sync_debug_mode("default")
