"""GPT-2's C element-wise kernels on CPU (LayerNorm with residual add, bias + GeLU) against their
torch references, and how dispatch wires them into CPU_OPS."""

from __future__ import annotations

import pytest
import torch
from torch_threads import torch_threads

from orca_kernels import cpu_gpt2_ops, dispatch, get_ops
from orca_kernels.cpu_gpt2_ops import add_layernorm_cpu, add_layernorm_order, bias_gelu_cpu
from orca_kernels.gelu import bias_gelu_torch
from orca_kernels.layernorm import add_layernorm_torch

TOL = {"rtol": 1e-5, "atol": 1e-6}
GELU_TOL = {"rtol": 1e-6, "atol": 1e-6}


def _randn(*shape: int, seed: int, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale + shift


# --- add + LayerNorm ---------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [1, 5, 31, 96, 257, 768, 40000])
@pytest.mark.parametrize("tokens", [1, 3, 67])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_layernorm_matches_reference(hidden: int, tokens: int, with_residual: bool) -> None:
    x = _randn(tokens, hidden, seed=hidden, scale=2.0, shift=1.0)  # a non-zero mean exercises the centring
    residual = _randn(tokens, hidden, seed=tokens, scale=3.0) if with_residual else None
    weight, bias = 1.0 + 0.1 * _randn(hidden, seed=7), _randn(hidden, seed=8)
    out, summed = add_layernorm_cpu(x, residual, weight, bias, 1e-5)
    ref_out, ref_summed = add_layernorm_torch(x, residual, weight, bias, 1e-5)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert out.is_contiguous() and out.shape == x.shape
    if residual is None:
        assert summed is x  # the reference's contract: the sum is x itself
    else:
        assert torch.equal(summed, ref_summed)  # one fp32 add, rounded like torch's


def test_add_layernorm_large_offset_and_constant_rows() -> None:
    """A large common offset (the variance is a small difference of large numbers for a naive
    sum of squares) and a constant row (variance 0: the output is the bias). Offset rows need
    torch's own vector width: at the other one the moments round differently by ~1e-4 (the probe
    tells the widths apart by these rows; where no width agrees the reference runs instead)."""
    if not add_layernorm_order().matches:
        pytest.skip("torch's LayerNorm order is reproduced at no width here; dispatch runs the reference")
    x = _randn(4, 768, seed=1, shift=1000.0)
    weight, bias = _randn(768, seed=2), _randn(768, seed=3)
    torch.testing.assert_close(
        add_layernorm_cpu(x, None, weight, bias, 1e-5)[0], add_layernorm_torch(x, None, weight, bias, 1e-5)[0],
        rtol=1e-4, atol=1e-5,
    )  # fmt: skip
    const = torch.full((2, 100), 3.5)
    out = add_layernorm_cpu(const, None, weight[:100], bias[:100], 1e-5)[0]
    torch.testing.assert_close(
        out, add_layernorm_torch(const, None, weight[:100], bias[:100], 1e-5)[0], **TOL
    )


def test_add_layernorm_strided_and_leading_dims() -> None:
    """Strided rows (slices of wider activations, as the model's unbind of stage activations gives)
    and a 3-D input."""
    wide = _randn(9, 2 * 768, seed=1)
    x, residual = wide[:, 100:868], _randn(9, 3, 768, seed=2)[:, 1]
    weight, bias = 1.0 + 0.1 * _randn(768, seed=3), _randn(768, seed=4)
    got, ref = (
        add_layernorm_cpu(x, residual, weight, bias, 1e-5),
        add_layernorm_torch(x, residual, weight, bias, 1e-5),
    )
    for g, r in zip(got, ref, strict=True):
        torch.testing.assert_close(g, r, **TOL)
    x3 = _randn(2, 5, 2 * 96, seed=5)[..., ::2]  # column stride 2: copied
    w3, b3 = _randn(96, seed=6), _randn(96, seed=7)
    out, summed = add_layernorm_cpu(x3, None, w3, b3, 1e-5)
    torch.testing.assert_close(out, add_layernorm_torch(x3, None, w3, b3, 1e-5)[0], **TOL)
    assert out.shape == x3.shape and summed is x3


@pytest.mark.parametrize("threads", [1, 2])
def test_add_layernorm_many_tokens_any_thread_count(threads: int) -> None:
    """Enough rows that they are spread over the OpenMP threads."""
    x, residual = _randn(200, 768, seed=threads, shift=0.5), _randn(200, 768, seed=9)
    weight, bias = _randn(768, seed=10), _randn(768, seed=11)
    with torch_threads(threads):
        out, summed = add_layernorm_cpu(x, residual, weight, bias, 1e-5)
    ref_out, ref_summed = add_layernorm_torch(x, residual, weight, bias, 1e-5)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(summed, ref_summed)


def test_add_layernorm_rejects_bad_shapes() -> None:
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="add_layernorm_cpu needs"):
        add_layernorm_cpu(x, None, torch.ones(63), torch.zeros(64), 1e-5)
    with pytest.raises(ValueError, match="add_layernorm_cpu needs"):
        add_layernorm_cpu(x, torch.randn(3, 64), torch.ones(64), torch.zeros(64), 1e-5)


# --- bias + GeLU -------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", [1, 3, 50, 1001, 3072])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_bias_gelu_matches_reference(inner: int, tokens: int) -> None:
    x, bias = _randn(tokens, inner, seed=inner + tokens, scale=4.0), _randn(inner, seed=inner)
    out = bias_gelu_cpu(x, bias)
    torch.testing.assert_close(out, bias_gelu_torch(x, bias), **GELU_TOL)
    assert out.is_contiguous() and out.shape == x.shape


def test_bias_gelu_whole_range_strided_and_extremes() -> None:
    x = torch.linspace(-30, 30, 200_001).unsqueeze(0)  # both branches of the tanh and its tails
    zero = torch.zeros(x.shape[-1])
    torch.testing.assert_close(bias_gelu_cpu(x, zero), bias_gelu_torch(x, zero), **GELU_TOL)
    extremes = torch.tensor([[-1e30, -200.0, -60.0, -1e-30, 0.0, 1e-30, 60.0, 200.0, 1e30]])
    zero = torch.zeros(extremes.shape[-1])
    torch.testing.assert_close(bias_gelu_cpu(extremes, zero), bias_gelu_torch(extremes, zero), **GELU_TOL)
    assert torch.isfinite(bias_gelu_cpu(extremes, zero)).all()
    strided = _randn(2, 3, 300 + 8, seed=5, scale=4.0)[..., 8:]  # rows not contiguous with each other
    bias = _randn(300, seed=6)
    torch.testing.assert_close(bias_gelu_cpu(strided, bias), bias_gelu_torch(strided, bias), **GELU_TOL)


@pytest.mark.parametrize("threads", [1, 2])
def test_bias_gelu_many_tokens_any_thread_count(threads: int) -> None:
    x, bias = _randn(100, 3072, seed=threads, scale=4.0), _randn(3072, seed=3)
    with torch_threads(threads):
        out = bias_gelu_cpu(x, bias)
    torch.testing.assert_close(out, bias_gelu_torch(x, bias), **GELU_TOL)


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """How many bfloat16 steps apart two bfloat16 tensors are, element by element (same-sign values:
    the bit patterns' distance; across zero, the sum of both sides' distances from it)."""
    def ordered(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).to(torch.int32) & 0xFFFF
        return torch.where(bits >= 0x8000, 0x8000 - bits, bits)  # monotone in the value

    return (ordered(a) - ordered(b)).abs()


def assert_bf16_gelu_close(out: torch.Tensor, ref: torch.Tensor) -> None:
    """Within one bfloat16 step of torch's, or (the GeLU's negative tail, where torch's tanh may
    round to -1 and give 0 while float32's own rounding leaves ~1e-7) within 1e-6; and rarely apart."""
    ulps, gap = bf16_ulps(out, ref), (out.float() - ref.float()).abs()
    assert bool(((ulps <= 1) | (gap <= 1e-6)).all()), (int(ulps.max()), float(gap.max()))
    assert float(((ulps > 0) & (gap > 1e-6)).float().mean()) < 0.01


@pytest.mark.parametrize("inner", [1, 50, 3072])
@pytest.mark.parametrize("tokens", [1, 70])
def test_bias_gelu_bf16_is_torchs_within_one_ulp(inner: int, tokens: int) -> None:
    """bfloat16: the sum rounded as torch's add rounds it, the GeLU in float32 rounded once. Only this
    file's tanh differs from torch's (a few float32 ulps), so an output moves at most one bfloat16
    step, and only where the float32 result lies at a rounding boundary (or in the far negative
    tail, by ~1e-7): rarely."""
    x = _randn(tokens, inner, seed=inner + tokens, scale=4.0).to(torch.bfloat16)
    bias = _randn(inner, seed=inner).to(torch.bfloat16)
    out = bias_gelu_cpu(x, bias)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert_bf16_gelu_close(out, bias_gelu_torch(x, bias))


def test_bias_gelu_bf16_whole_range_and_strided() -> None:
    every = torch.arange(0, 0x10000, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)  # every bfloat16
    every = every[torch.isfinite(every)].unsqueeze(0)
    zero = torch.zeros(every.shape[-1], dtype=torch.bfloat16)
    assert_bf16_gelu_close(bias_gelu_cpu(every, zero), bias_gelu_torch(every, zero))
    strided = _randn(2, 3, 300 + 8, seed=5, scale=4.0).to(torch.bfloat16)[..., 8:]
    bias = _randn(300, seed=6).to(torch.bfloat16)
    assert_bf16_gelu_close(bias_gelu_cpu(strided, bias), bias_gelu_torch(strided, bias))


# --- dtypes, and dispatch -----------------------------------------------------------------------


def test_wrappers_take_the_dtypes_they_have_kernels_for() -> None:
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    w = torch.ones(64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        add_layernorm_cpu(x.float(), None, w.float(), w, 1e-5)  # the bias too
    with pytest.raises(ValueError, match="all float32 or all bfloat16"):
        add_layernorm_cpu(x.half(), None, w.half(), w.half(), 1e-5)
    with pytest.raises(ValueError, match="float32 CPU tensors only"):
        bias_gelu_cpu(x, w.float())  # mixed dtypes
    with pytest.raises(ValueError, match="float32 CPU tensors only"):
        bias_gelu_cpu(x.half(), w.half())


@pytest.mark.parametrize("hidden", [1, 31, 96, 257, 768, 1600])
@pytest.mark.parametrize("with_residual", [True, False])
def test_bf16_add_layernorm_is_torchs_within_one_ulp(hidden: int, with_residual: bool) -> None:
    """bfloat16 rows: the sum is torch's bit for bit; each output torch's or one bfloat16 ulp from
    it (where the last float32 bit of rstd crosses a rounding boundary: gpt2_ops.c), rarely."""
    if not cpu_gpt2_ops.add_layernorm_bf16_order().matches:
        pytest.skip("the bfloat16 LayerNorm is not within an ulp of torch's here; dispatch runs the reference")
    x = _randn(64, hidden, seed=hidden, scale=2.0, shift=1.0).to(torch.bfloat16)
    residual = _randn(64, hidden, seed=3, scale=3.0).to(torch.bfloat16) if with_residual else None
    weight, bias = (1.0 + 0.1 * _randn(hidden, seed=7)).to(torch.bfloat16), _randn(hidden, seed=8).to(torch.bfloat16)
    out, summed = add_layernorm_cpu(x, residual, weight, bias, 1e-5)
    ref_out, ref_summed = add_layernorm_torch(x, residual, weight, bias, 1e-5)
    assert out.dtype == torch.bfloat16 and out.shape == x.shape
    assert summed is x if residual is None else torch.equal(summed, ref_summed)
    ulps = (out.view(torch.int16).int() - ref_out.view(torch.int16).int()).abs()
    assert int(ulps.max()) <= 1
    assert int(ulps.count_nonzero()) * 100 <= ulps.numel()


@pytest.mark.skipif(
    torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"),
    reason="under other builds an op whose order is not reproduced keeps its reference (test_cpu_llama_ops)",
)
def test_cpu_ops_use_the_c_kernels_for_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_KERNELS", raising=False)
    ops = get_ops("cpu")
    assert ops is dispatch.CPU_OPS
    calls: list[str] = []
    for name in ("add_layernorm_cpu", "bias_gelu_cpu"):
        original = getattr(cpu_gpt2_ops, name)
        monkeypatch.setattr(cpu_gpt2_ops, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    ops.add_layernorm(torch.randn(2, 64), torch.randn(2, 64), torch.ones(64), torch.zeros(64), 1e-5)
    ops.bias_gelu(torch.randn(2, 64), torch.zeros(64))
    assert calls == ["add_layernorm_cpu", "bias_gelu_cpu"]


def test_cpu_ops_take_the_c_kernels_in_bf16_and_the_references_in_float16(monkeypatch: pytest.MonkeyPatch) -> None:
    """LayerNorm and bias + GeLU take the C kernels in bfloat16 (LayerNorm where its probe holds),
    the references in float16."""
    ops = dispatch.CPU_OPS
    g = torch.Generator().manual_seed(0)
    calls: list[tuple[str, torch.dtype]] = []
    for name in ("add_layernorm_cpu", "bias_gelu_cpu"):
        original = getattr(cpu_gpt2_ops, name)
        monkeypatch.setattr(cpu_gpt2_ops, name, lambda x, *a, _f=original, _n=name: calls.append((_n, x.dtype)) or _f(x, *a))
    for dtype in (torch.bfloat16, torch.float16):
        x, residual = (torch.randn(3, 64, generator=g).to(dtype) for _ in range(2))
        weight, bias = (torch.randn(64, generator=g).to(dtype) for _ in range(2))
        got, ref = (
            ops.add_layernorm(x, residual, weight, bias, 1e-5),
            add_layernorm_torch(x, residual, weight, bias, 1e-5),
        )
        assert torch.equal(got[1], ref[1])
        if dtype == torch.bfloat16:
            assert (got[0].view(torch.int16).int() - ref[0].view(torch.int16).int()).abs().max() <= 1
            assert_bf16_gelu_close(ops.bias_gelu(x, bias), bias_gelu_torch(x, bias))
        else:
            assert torch.equal(got[0], ref[0])
            assert torch.equal(ops.bias_gelu(x, bias), bias_gelu_torch(x, bias))
    layernorm = [("add_layernorm_cpu", torch.bfloat16)] if cpu_gpt2_ops.add_layernorm_bf16_order().matches else []
    assert calls == [*layernorm, ("bias_gelu_cpu", torch.bfloat16)]
