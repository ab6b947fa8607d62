"""The instruction sets of the C decode GEMM (kernels/orca_kernels/csrc/decode_gemm.c) this CPU
runs, and forcing one for a test, as `ORCA_CPU_ISA` does for a process: the tests cover every kind
of x86 machine this one can stand in for (an AVX-512 machine runs the AVX2 path too)."""

from __future__ import annotations

import pytest

from orca_kernels import cpu_gemm

SUPPORTED_ISAS = list(cpu_gemm.supported_isas())


def force_isa(monkeypatch: pytest.MonkeyPatch, isa: str) -> None:
    """ORCA_CPU_ISA=isa for the rest of the test (monkeypatch undoes it); the process-wide choices
    (the instruction set, and the GEMM choice that follows from it) are made again now and must be
    once more after the test (`forget_choices`, which the fixtures call)."""
    monkeypatch.setenv(cpu_gemm.ISA_ENV, isa)
    forget_choices()


def forget_choices() -> None:
    cpu_gemm.cpu_isa.cache_clear()
    cpu_gemm.cpu_gemm_choice.cache_clear()
