"""The linear-layer matmul the model runs (orca_backend.model.gemm over
kernels/orca_kernels/cpu_gemm.py: the C kernel for few tokens on CPU float32, oneDNN, then MKL) and
kernels/orca_kernels/csrc/decode_gemm.c against F.linear."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch_threads import torch_threads

from orca_backend.model import gemm
from orca_kernels import cpu_gemm, native


@pytest.fixture
def choice(monkeypatch):
    """Sets ORCA_CPU_GEMM for one test; the process-wide choice is re-made before and after."""

    def set_choice(value: str) -> None:
        monkeypatch.setenv(cpu_gemm.GEMM_ENV, value)
        cpu_gemm.cpu_gemm_choice.cache_clear()

    yield set_choice
    monkeypatch.undo()
    cpu_gemm.cpu_gemm_choice.cache_clear()


# Odd sizes on purpose: N not a multiple of the kernel's 4-row blocks, K not a multiple of 8 (the
# scalar tail), an odd token count (the single-token block after the pairs).
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 32])
@pytest.mark.parametrize(("n", "k"), [(96, 80), (13, 37), (3, 8), (257, 1031)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_native_kernel_equals_f_linear(rows, n, k, with_bias):
    torch.manual_seed(rows * 1000 + n + k)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    bias = b if with_bias else None
    expected = F.linear(x.double(), w.double(), bias.double() if bias is not None else None).float()
    torch.testing.assert_close(cpu_gemm.native_linear(x, w, bias), expected, rtol=1e-5, atol=1e-5 * k**0.5)


def test_native_kernel_reads_strided_rows():
    """x rows at a stride wider than K (a view into a larger buffer) are read in place."""
    torch.manual_seed(0)
    w, buf = torch.randn(40, 24), torch.randn(5, 64)
    x = buf[:, 8:32]
    assert x.stride(0) == 64
    torch.testing.assert_close(cpu_gemm.native_linear(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_native_kernel_is_batch_invariant():
    """A token's output is bit-identical whatever else is in the batch and wherever it sits in it."""
    torch.manual_seed(1)
    w, b, x = torch.randn(203, 777), torch.randn(203), torch.randn(32, 777)
    with torch_threads(2):
        alone = torch.cat([cpu_gemm.native_linear(x[i : i + 1], w, b) for i in range(32)])
    for rows in (2, 3, 5, 16, 31, 32):  # both tilings: 4 rows x 2 tokens under 4 tokens, 3 x 4 from 4 on
        assert torch.equal(cpu_gemm.native_linear(x[:rows], w, b), alone[:rows])
    perm = torch.randperm(32)
    assert torch.equal(cpu_gemm.native_linear(x[perm].contiguous(), w, b), alone[perm])
    # The OpenMP split of the rows does not matter either.
    with torch_threads(1):
        assert torch.equal(cpu_gemm.native_linear(x, w, b), alone)


@pytest.mark.parametrize("setting", ["auto", "native", "onednn", "torch"])
@pytest.mark.parametrize("rows", [1, 32, 33, 512, 600])
def test_every_choice_and_size_equals_f_linear(choice, setting, rows):
    if setting == "onednn" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    choice(setting)
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 80), torch.randn(96), torch.randn(rows, 80)
    packed = gemm.pack(w)
    torch.testing.assert_close(gemm.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


def test_auto_takes_the_c_kernel_up_to_its_threshold(choice, monkeypatch):
    """The path really taken: the C kernel at <= NATIVE_MAX_TOKENS tokens, not beyond."""
    choice("auto")
    assert cpu_gemm.cpu_gemm_choice() == "native"  # this machine has a C compiler
    calls = []
    real = cpu_gemm.native_linear
    monkeypatch.setattr(cpu_gemm, "native_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = gemm.pack(torch.randn(8, 8))
    for rows in (1, cpu_gemm.NATIVE_MAX_TOKENS, cpu_gemm.NATIVE_MAX_TOKENS + 1):
        gemm.linear(torch.randn(rows, 8), w)
    assert calls == [1, cpu_gemm.NATIVE_MAX_TOKENS]


def test_pack_makes_a_strided_shard_contiguous():
    w = torch.randn(8, 16)[:, 4:12]  # a row-parallel shard: a column slice
    packed = gemm.pack(w)
    assert packed.is_contiguous() and torch.equal(packed, w)
    x = torch.randn(2, 8)
    torch.testing.assert_close(gemm.linear(x, packed), F.linear(x, w))


def test_half_precision_uses_f_linear():
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(gemm.linear(x, gemm.pack(w)), F.linear(x, w))


def test_bad_choice_is_an_error(choice):
    choice("fastest")
    with pytest.raises(ValueError, match="ORCA_CPU_GEMM must be one of"):
        cpu_gemm.cpu_gemm_choice()


def test_without_a_compiler_auto_warns_and_native_is_an_error(choice, monkeypatch, caplog):
    def no_compiler(name):
        raise native.NativeBuildError("no C compiler found")

    monkeypatch.setattr(native, "load", no_compiler)
    cpu_gemm._native_kernel.cache_clear()
    try:
        choice("auto")
        with caplog.at_level(logging.WARNING, logger="orca.kernels"):
            fallback = cpu_gemm.cpu_gemm_choice()
        assert fallback in ("onednn", "torch")
        assert "C decode GEMM is unavailable (no C compiler found)" in caplog.text
        x, w = torch.randn(2, 8), torch.randn(4, 8)
        torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))
        choice("native")
        with pytest.raises(RuntimeError, match="ORCA_CPU_GEMM=native: no C compiler found"):
            cpu_gemm.cpu_gemm_choice()
    finally:
        cpu_gemm._native_kernel.cache_clear()
