"""The linear-layer matmul the model runs (orca_backend.model.gemm over
kernels/orca_kernels/cpu_gemm.py: the C kernel for few tokens on CPU float32 and bfloat16, then the
libraries) and kernels/orca_kernels/csrc/decode_gemm.c, on every instruction set this CPU runs,
against the exact result."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from cpu_isas import SUPPORTED_ISAS, force_isa, forget_choices
from torch_threads import torch_threads

from orca_backend.model import gemm
from orca_kernels import cpu_gemm, native
from orca_kernels.dispatch import CPU_OPS


@pytest.fixture
def choice(monkeypatch):
    """Sets ORCA_CPU_GEMM for one test; the process-wide choice is re-made before and after."""

    def set_choice(value: str) -> None:
        monkeypatch.setenv(cpu_gemm.GEMM_ENV, value)
        cpu_gemm.cpu_gemm_choice.cache_clear()

    yield set_choice
    monkeypatch.undo()
    cpu_gemm.cpu_gemm_choice.cache_clear()


ISAS = SUPPORTED_ISAS
# bfloat16 results are rounded once from float32 sums: within half a bfloat16 step (2^-9 relative)
# of the exact result, plus the float32 sums' own error.
BF16_RTOL = 2**-8


def reference(x, w, bias):
    """The exact result (in float64) of x W^T + bias for the values x, w and bias hold."""
    return F.linear(x.double(), w.double(), bias.double() if bias is not None else None)


# Odd sizes on purpose: N not a multiple of any tile's rows, K not a multiple of 8, 16 or 32 (the
# tails), token counts past every tile's tokens (the single-token tiles after them).
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("rows", [1, 2, 3, 7, 16, 32])
@pytest.mark.parametrize(("n", "k"), [(96, 80), (13, 37), (3, 8), (257, 1031)])
@pytest.mark.parametrize("with_bias", [True, False])
def test_native_kernel_equals_f_linear(isa, rows, n, k, with_bias):
    torch.manual_seed(rows * 1000 + n + k)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    bias = b if with_bias else None
    expected = reference(x, w, bias).float()
    torch.testing.assert_close(cpu_gemm.native_linear(x, w, bias, isa), expected, rtol=1e-5, atol=1e-5 * k**0.5)
    w, x, bias = w.bfloat16(), x.bfloat16(), bias.bfloat16() if bias is not None else None
    y = cpu_gemm.native_linear(x, w, bias, isa)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), reference(x, w, bias), rtol=BF16_RTOL, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_reads_strided_rows(isa, dtype):
    """x rows at a stride wider than K (a view into a larger buffer) are read in place."""
    torch.manual_seed(0)
    w, buf = torch.randn(40, 24, dtype=dtype), torch.randn(5, 64, dtype=dtype)
    x = buf[:, 8:32]
    assert x.stride(0) == 64
    assert torch.equal(cpu_gemm.native_linear(x, w, None, isa), cpu_gemm.native_linear(x.contiguous(), w, None, isa))
    torch.testing.assert_close(cpu_gemm.native_linear(x, w, None, isa).double(), reference(x, w, None),
                               rtol=BF16_RTOL if dtype == torch.bfloat16 else 1e-5, atol=1e-5)  # fmt: skip


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_kernel_is_batch_invariant(isa, dtype):
    """A token's output is bit-identical whatever else is in the batch and wherever it sits in it."""
    torch.manual_seed(1)
    w, b, x = torch.randn(203, 777, dtype=dtype), torch.randn(203, dtype=dtype), torch.randn(32, 777, dtype=dtype)
    with torch_threads(2):
        alone = torch.cat([cpu_gemm.native_linear(x[i : i + 1], w, b, isa) for i in range(32)])
    for rows in (2, 3, 5, 6, 7, 16, 31, 32):  # every tiling: the memory-bound tiles under 4 tokens, then the others
        assert torch.equal(cpu_gemm.native_linear(x[:rows], w, b, isa), alone[:rows])
    perm = torch.randperm(32)
    assert torch.equal(cpu_gemm.native_linear(x[perm].contiguous(), w, b, isa), alone[perm])
    # The OpenMP split of the rows does not matter either.
    with torch_threads(1):
        assert torch.equal(cpu_gemm.native_linear(x, w, b, isa), alone)


def test_isas_differ_in_order_only():
    """Each instruction set sums in its own order: on a machine with several, their float32 results
    agree to rounding but (on these sizes) not bit for bit, so a test that ran one path for another
    would show it."""
    if len(ISAS) < 2:
        pytest.skip(f"this CPU runs only {ISAS}")
    torch.manual_seed(2)
    w, x = torch.randn(64, 1000), torch.randn(3, 1000)
    results = {isa: cpu_gemm.native_linear(x, w, None, isa) for isa in ISAS}
    assert not torch.equal(results["avx2"], results[ISAS[-1]])
    for y in results.values():
        torch.testing.assert_close(y, results["avx2"], rtol=1e-5, atol=1e-4)


@pytest.fixture
def isa_env(monkeypatch):
    """Sets ORCA_CPU_ISA for one test; the process-wide choice is re-made before and after."""

    yield lambda isa: force_isa(monkeypatch, isa)
    monkeypatch.undo()
    forget_choices()


def test_the_isa_is_the_widest_unless_forced(isa_env):
    isa_env("auto")
    assert cpu_gemm.cpu_isa() == ISAS[-1]
    for isa in ISAS:
        isa_env(isa)
        assert cpu_gemm.cpu_isa() == isa
        assert cpu_gemm.native_max_tokens() == cpu_gemm.NATIVE_MAX_TOKENS[isa]
    isa_env("avx1024")
    with pytest.raises(ValueError, match="ORCA_CPU_ISA must be auto or one of avx2, avx512, avx512_bf16"):
        cpu_gemm.cpu_isa()


def test_an_isa_the_cpu_lacks_is_an_error(isa_env):
    missing = [isa for isa in cpu_gemm.ISAS if isa not in ISAS]
    if not missing:
        pytest.skip("this CPU runs every instruction set of the kernel")
    isa_env(missing[0])
    with pytest.raises(RuntimeError, match=f"ORCA_CPU_ISA={missing[0]}, but this CPU runs only"):
        cpu_gemm.cpu_isa()
    with pytest.raises(RuntimeError, match=f"this CPU does not run {missing[0]} instructions"):
        cpu_gemm.native_linear(torch.randn(1, 8), torch.randn(4, 8), None, missing[0])


@pytest.mark.parametrize("setting", ["auto", "native", "packed", "onednn", "torch"])
@pytest.mark.parametrize("rows", [1, 32, 33, 512, 600])
def test_every_choice_and_size_equals_f_linear(choice, setting, rows):
    if setting in ("packed", "onednn") and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    choice(setting)
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 80), torch.randn(96), torch.randn(rows, 80)
    with gemm.packing_for(CPU_OPS):
        packed = gemm.pack(w)
    torch.testing.assert_close(gemm.linear(x, packed, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_auto_packs_on_avx512_and_takes_the_c_kernel_for_plain_weights(choice, isa_env, isa, monkeypatch):
    """The path really taken, in float32 and bfloat16: on AVX2 the layers' weights stay plain and the
    C kernel multiplies up to native_max_tokens() tokens, not beyond; on AVX-512 they are packed,
    the C kernel's panel tiles multiply them up to PACKED_NATIVE_MAX_TOKENS and oneDNN beyond, and
    a weight left plain (a MoE layer's experts) takes the C kernel up to its own threshold."""
    choice("auto")
    isa_env(isa)
    assert cpu_gemm.cpu_gemm_choice() == ("native" if isa == "avx2" else "packed")
    calls, panel_calls = [], []
    real, real_panels = cpu_gemm.native_linear, cpu_gemm.packed_native_linear
    monkeypatch.setattr(cpu_gemm, "native_linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    monkeypatch.setattr(cpu_gemm, "packed_native_linear", lambda *a: panel_calls.append(a[0].shape[0]) or real_panels(*a))
    most, most_packed = cpu_gemm.native_max_tokens(), cpu_gemm.PACKED_NATIVE_MAX_TOKENS
    for dtype in (torch.float32, torch.bfloat16):
        plain = torch.randn(8, 8, dtype=dtype)
        with gemm.packing_for(CPU_OPS):
            layer = gemm.pack(plain)
        assert not isinstance(gemm.pack(plain), cpu_gemm.PackedWeight)  # outside a CPU model's load: plain
        assert isinstance(layer, cpu_gemm.PackedWeight) == (isa != "avx2")
        for weight in (layer, plain):
            calls.clear()
            panel_calls.clear()
            sizes = (1, most, most + 1, most_packed, most_packed + 1)
            for rows in sizes:
                x = torch.randn(rows, 8, dtype=dtype)
                y = gemm.linear(x, weight)
                assert y.dtype == dtype and y.shape == (rows, 8)
                torch.testing.assert_close(y.double(), reference(x, plain, None), rtol=BF16_RTOL, atol=1e-5)
            packed = weight is layer and isa != "avx2"
            assert calls == ([] if packed else [rows for rows in sizes if rows <= most])
            assert panel_calls == ([rows for rows in sizes if rows <= most_packed] if packed else [])


AVX512_ISAS = [isa for isa in ISAS if isa != "avx2"]


def panel_packed(choice, w: torch.Tensor) -> cpu_gemm.PackedWeight:
    """w packed as a CPU model's load packs it (with the instruction set the test forced), in the
    panel layout the C kernel reads (the tests below need it: a oneDNN that lays out otherwise
    skips them, which the warning test covers)."""
    choice("packed")
    with gemm.packing_for(CPU_OPS):
        packed = gemm.pack(w)
    if not packed.padded_in:
        pytest.skip(f"oneDNN lays out a {w.dtype} {tuple(w.shape)} weight otherwise on this machine")
    return packed


# Sizes past every panel and pair boundary: N not a multiple of 64 (the last panel's masked rows), K
# odd (bfloat16's last pair half padding), tokens past a pass of 6 (the narrower last pass).
@pytest.mark.parametrize("isa", AVX512_ISAS)
@pytest.mark.parametrize(("n", "k"), [(96, 80), (13, 37), (257, 1031), (64, 2)])
@pytest.mark.parametrize("rows", [1, 2, 6, 7, 16, 37, 64])
def test_the_packed_weight_kernel_equals_f_linear(choice, isa_env, isa, n, k, rows):
    isa_env(isa)
    torch.manual_seed(rows * 1000 + n + k)
    w, b, x = torch.randn(n, k), torch.randn(n), torch.randn(rows, k)
    packed = panel_packed(choice, w)
    assert packed.padded_in >= k
    torch.testing.assert_close(cpu_gemm.packed_native_linear(x, packed, b, isa), reference(x, w, b).float(),
                               rtol=1e-5, atol=1e-5 * k**0.5)  # fmt: skip
    w, x, b = w.bfloat16(), x.bfloat16(), b.bfloat16()
    y = cpu_gemm.packed_native_linear(x, panel_packed(choice, w), b, isa)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y.double(), reference(x, w, b), rtol=BF16_RTOL, atol=1e-5 * k**0.5)


@pytest.mark.parametrize("isa", AVX512_ISAS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_packed_weight_kernel_is_batch_invariant(choice, isa_env, isa, dtype):
    """As the plain kernel: a token's output is bit-identical whatever else is in the batch (up to
    PACKED_NATIVE_MAX_TOKENS), wherever it sits in it, however the panels go to the threads; and
    x rows at a stride are read in place."""
    isa_env(isa)
    torch.manual_seed(3)
    w, b = torch.randn(203, 777, dtype=dtype), torch.randn(203, dtype=dtype)
    most = cpu_gemm.PACKED_NATIVE_MAX_TOKENS
    buf = torch.randn(most, 800, dtype=dtype)
    x = buf[:, :777]
    packed = panel_packed(choice, w)
    with torch_threads(2):
        alone = torch.cat([cpu_gemm.packed_native_linear(x[i : i + 1], packed, b, isa) for i in range(most)])
        for rows in sorted({2, 5, 6, 7, 12, 16, 37, most}):
            assert torch.equal(cpu_gemm.packed_native_linear(x[:rows], packed, b, isa), alone[:rows])
        perm = torch.randperm(most)
        assert torch.equal(cpu_gemm.packed_native_linear(x[perm].contiguous(), packed, b, isa), alone[perm])
    with torch_threads(1):
        assert torch.equal(cpu_gemm.packed_native_linear(x, packed, b, isa), alone)


def test_a_layout_the_kernel_does_not_read_goes_to_onednn_with_a_warning(choice, isa_env, monkeypatch, caplog):
    """The layout check compares oneDNN's buffer with the weight in full: read as panels of another
    width (what another oneDNN might lay out) it does not match, and the weight takes oneDNN at
    every size, with a warning."""
    if not AVX512_ISAS or not torch.backends.mkldnn.is_available():
        pytest.skip("the packed choice's C path needs AVX-512 and oneDNN")
    isa_env(AVX512_ISAS[-1])
    monkeypatch.setattr(cpu_gemm, "PANEL", 32)
    cpu_gemm._warn_other_layout.cache_clear()
    choice("packed")
    w, x = torch.randn(96, 80), torch.randn(3, 80)
    with caplog.at_level(logging.WARNING, logger="orca.kernels"), gemm.packing_for(CPU_OPS):
        packed = gemm.pack(w)
    assert isinstance(packed, cpu_gemm.PackedWeight) and packed.padded_in == 0
    assert "otherwise than in panels of 32 rows" in caplog.text and "takes oneDNN at every size" in caplog.text
    monkeypatch.setattr(cpu_gemm, "packed_native_linear", lambda *a: pytest.fail("the C kernel read another layout"))
    torch.testing.assert_close(gemm.linear(x, packed), F.linear(x, w), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_float32_prefills_go_to_mkl_only_on_avx2(choice, isa_env, isa, monkeypatch):
    """Past oneDNN's range MKL takes float32 prefills on AVX2 machines; on AVX-512 ones (where MKL
    runs its AVX2 code on AMD CPUs) oneDNN keeps them."""
    choice("auto")
    isa_env(isa)
    calls, real = [], F.linear
    monkeypatch.setattr(cpu_gemm.F, "linear", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    w = gemm.pack(torch.randn(8, 8))
    for rows in (cpu_gemm.native_max_tokens() + 1, 600):
        gemm.linear(torch.randn(rows, 8), w)
    assert calls == ([600] if isa == "avx2" else [])


@pytest.mark.parametrize("setting", ["native", "packed"])
def test_pack_takes_a_strided_shard(choice, setting):
    if setting == "packed" and not torch.backends.mkldnn.is_available():
        pytest.skip("this torch build has no oneDNN")
    choice(setting)
    w = torch.randn(8, 16)[:, 4:12]  # a row-parallel shard: a column slice
    with gemm.packing_for(CPU_OPS):
        packed = gemm.pack(w)
    if setting == "native":
        assert packed.is_contiguous() and torch.equal(packed, w)
    else:
        assert isinstance(packed, cpu_gemm.PackedWeight) and packed.shape == w.shape and packed.nbytes == w.nbytes
    for rows in (2, 40):
        x = torch.randn(rows, 8)
        torch.testing.assert_close(gemm.linear(x, packed), F.linear(x, w))


def test_float16_uses_f_linear():
    w = torch.randn(8, 8, dtype=torch.float16)
    x = torch.randn(3, 8, dtype=torch.float16)
    assert torch.equal(gemm.linear(x, gemm.pack(w)), F.linear(x, w))


def test_bad_choice_is_an_error(choice):
    choice("fastest")
    with pytest.raises(ValueError, match="ORCA_CPU_GEMM must be one of"):
        cpu_gemm.cpu_gemm_choice()


def test_without_a_compiler_auto_warns_and_native_is_an_error(choice, monkeypatch, caplog):
    def no_compiler(name):
        raise native.NativeBuildError("no C compiler found")

    monkeypatch.setattr(native, "load", no_compiler)
    cpu_gemm._kernels.cache_clear()
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
        cpu_gemm._kernels.cache_clear()
