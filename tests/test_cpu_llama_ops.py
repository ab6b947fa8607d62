"""The Llama family's C element-wise kernels on CPU (RMSNorm with residual add, rotary, SiLU-and-mul)
against their torch references, and how dispatch wires them into CPU_OPS."""

from __future__ import annotations

import platform

import pytest
import torch

from orca_backend.model.rope import cos_sin_table, inverse_frequencies
from orca_kernels import cpu_llama_ops, dispatch, get_ops
from orca_kernels.cpu_llama_ops import add_rmsnorm_cpu, rotary_cpu, silu_and_mul_cpu
from orca_kernels.rmsnorm import add_rmsnorm_torch
from orca_kernels.rotary import rotary_torch
from orca_kernels.silu import silu_and_mul_torch

TOL = {"rtol": 1e-5, "atol": 1e-6}
# torch's CPU kernels vectorise with fixed-width vectors on x86 (AVX2 / AVX512), whose summation
# order the RMSNorm kernel reproduces; elsewhere only the tolerance is promised.
X86 = platform.machine().lower() in ("x86_64", "amd64")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def _with_threads(threads: int, fn):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(before)


# --- add + RMSNorm -----------------------------------------------------------------------------


@pytest.mark.parametrize("hidden", [1, 5, 31, 96, 257, 768])
@pytest.mark.parametrize("tokens", [1, 3, 67])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_matches_reference(hidden: int, tokens: int, with_residual: bool) -> None:
    x, residual = _randn(tokens, hidden, seed=hidden), _randn(tokens, hidden, seed=tokens, scale=3.0)
    weight = 1.0 + 0.1 * _randn(hidden, seed=7)
    if not with_residual:
        residual = None
    out, summed = add_rmsnorm_cpu(x, residual, weight, 1e-6)
    ref_out, ref_summed = add_rmsnorm_torch(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert out.is_contiguous() and out.shape == x.shape
    if residual is None:
        assert summed is x  # the reference's contract: the sum is x itself
    else:
        assert torch.equal(summed, ref_summed)  # one fp32 add, rounded like torch's


def test_add_rmsnorm_strided_and_per_head() -> None:
    """Strided rows (a slice of a wider activation), and Qwen3's per-head norm over [T, heads, d]
    views of the fused qkv projection."""
    wide = _randn(9, 2 * 768, seed=1)
    x, residual = wide[:, 100:868], _randn(9, 3, 768, seed=2)[:, 1]
    weight = 1.0 + 0.1 * _randn(768, seed=3)
    for got, ref in zip(add_rmsnorm_cpu(x, residual, weight, 1e-5), add_rmsnorm_torch(x, residual, weight, 1e-5),
                        strict=True):  # fmt: skip
        torch.testing.assert_close(got, ref, **TOL)
    for tokens in (1, 5):
        q = _randn(tokens, 20 * 64, seed=tokens)[:, : 12 * 64].view(tokens, 12, 64)  # not contiguous
        head_w = 1.0 + 0.1 * _randn(64, seed=4)
        out, summed = add_rmsnorm_cpu(q, None, head_w, 1e-6)
        torch.testing.assert_close(out, add_rmsnorm_torch(q, None, head_w, 1e-6)[0], **TOL)
        assert out.shape == q.shape and summed is q


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_add_rmsnorm_many_tokens_any_thread_count(threads: int) -> None:
    """Enough rows that they are spread over the OpenMP threads."""
    x, residual, weight = _randn(200, 768, seed=threads), _randn(200, 768, seed=9), _randn(768, seed=10)
    out, summed = _with_threads(threads, lambda: add_rmsnorm_cpu(x, residual, weight, 1e-6))
    ref_out, ref_summed = add_rmsnorm_torch(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(summed, ref_summed)


@pytest.mark.skipif(not X86, reason="torch's summation order is reproduced for its x86 vector widths")
@pytest.mark.parametrize("hidden", [5, 64, 100, 768, 4096, 40000])
def test_add_rmsnorm_is_bit_identical_to_reference(hidden: int) -> None:
    """The sum of squares is added in torch's own order, so outputs equal the reference's (and
    transformers') exactly: a last-bit difference could flip a greedy token."""
    x, residual, weight = _randn(16, hidden, seed=hidden), _randn(16, hidden, seed=1), _randn(hidden, seed=2)
    assert torch.equal(
        add_rmsnorm_cpu(x, residual, weight, 1e-6)[0], add_rmsnorm_torch(x, residual, weight, 1e-6)[0]
    )


# --- rotary ------------------------------------------------------------------------------------


def _table(head_dim: int, positions: int = 300) -> torch.Tensor:
    return cos_sin_table(inverse_frequencies(head_dim, 10000.0, None), positions, torch.device("cpu"))


def _qkv_views(tokens: int, q_heads: int, kv_heads: int, head_dim: int, seed: int):
    """q and k as the model passes them: strided views of the fused qkv projection's output."""
    qkv = _randn(tokens, (q_heads + 2 * kv_heads) * head_dim, seed=seed)
    q, k, _ = qkv.split([q_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    return qkv, q.view(tokens, q_heads, head_dim), k.view(tokens, kv_heads, head_dim)


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (12, 4), (8, 1), (3, 1)])
@pytest.mark.parametrize("head_dim", [6, 64, 128])
@pytest.mark.parametrize("tokens", [1, 2, 37])
def test_rotary_matches_reference(q_heads: int, kv_heads: int, head_dim: int, tokens: int) -> None:
    qkv, q, k = _qkv_views(tokens, q_heads, kv_heads, head_dim, seed=q_heads + head_dim + tokens)
    before = qkv.clone()
    table = _table(head_dim)
    positions = torch.randint(0, 300, (tokens,), generator=torch.Generator().manual_seed(tokens))
    positions[0] = 299  # the table's last row
    q_out, k_out = rotary_cpu(q, k, positions, table)
    ref_q, ref_k = rotary_torch(q, k, positions, table)
    torch.testing.assert_close(q_out, ref_q, **TOL)
    torch.testing.assert_close(k_out, ref_k, **TOL)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(qkv, before)  # the fused projection (v included) is never modified
    if X86:  # products and sums rounded one by one, as torch does them: no fused multiply-add
        assert torch.equal(q_out, ref_q) and torch.equal(k_out, ref_k)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_rotary_prefill_any_thread_count(threads: int) -> None:
    _, q, k = _qkv_views(120, 12, 4, 64, seed=threads)
    positions = torch.arange(120, dtype=torch.int32)  # int32 positions are taken too
    table = _table(64)
    got = _with_threads(threads, lambda: rotary_cpu(q, k, positions, table))
    for g, r in zip(got, rotary_torch(q, k, positions.long(), table), strict=True):
        torch.testing.assert_close(g, r, **TOL)


def test_rotary_rejects_positions_outside_the_table() -> None:
    _, q, k = _qkv_views(3, 4, 2, 64, seed=0)
    for bad in (300, -1):
        with pytest.raises(IndexError, match=f"position {bad} of token 1 is outside"):
            rotary_cpu(q, k, torch.tensor([0, bad, 2]), _table(64))
    with pytest.raises(ValueError, match="positions"):
        rotary_cpu(q, k, torch.tensor([0, 1]), _table(64))


# --- SiLU-and-mul ------------------------------------------------------------------------------


@pytest.mark.parametrize("inner", [1, 3, 1001, 2048])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_silu_and_mul_matches_reference(inner: int, tokens: int) -> None:
    x = _randn(tokens, 2 * inner, seed=inner + tokens, scale=4.0)
    out = silu_and_mul_cpu(x)
    ref = silu_and_mul_torch(x)
    torch.testing.assert_close(out, ref, **TOL)
    if X86:  # exp as torch's vectorised kernels compute it (SLEEF's expf_u10)
        assert torch.equal(out, ref)


def test_silu_and_mul_strided_leading_dims_and_extremes() -> None:
    x = _randn(2, 3, 2 * 300 + 8, seed=5, scale=4.0)[..., 8:]  # rows not contiguous with each other
    torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_torch(x), **TOL)
    # exp's range limits: underflow to 0, overflow to inf, and everything in between
    gate = torch.tensor([-150.0, -105.0, -104.0, -88.0, -50.0, -1e-30, 0.0, 1e-30, 50.0, 88.0, 104.0, 150.0])
    x = torch.cat([gate, torch.linspace(-3, 3, gate.numel())]).unsqueeze(0)
    torch.testing.assert_close(silu_and_mul_cpu(x), silu_and_mul_torch(x), **TOL)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_silu_and_mul_many_tokens_any_thread_count(threads: int) -> None:
    x = _randn(100, 2 * 2048, seed=threads, scale=4.0)
    torch.testing.assert_close(
        _with_threads(threads, lambda: silu_and_mul_cpu(x)), silu_and_mul_torch(x), **TOL
    )


# --- float32 only, and dispatch ----------------------------------------------------------------


def test_wrappers_take_float32_cpu_tensors_only() -> None:
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="float32 CPU tensors only"):
        add_rmsnorm_cpu(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-6)
    with pytest.raises(ValueError, match="float32 CPU tensors only"):
        silu_and_mul_cpu(x)
    with pytest.raises(ValueError, match="float32 CPU tensors only"):
        rotary_cpu(x.view(2, 1, 64), x.view(2, 1, 64), torch.tensor([0, 1]), _table(64))


def test_cpu_ops_use_the_c_kernels_for_float32(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_KERNELS", raising=False)
    ops = get_ops("cpu")
    assert ops is dispatch.CPU_OPS
    calls: list[str] = []
    for name in ("add_rmsnorm_cpu", "rotary_cpu", "silu_and_mul_cpu"):
        original = getattr(cpu_llama_ops, name)
        monkeypatch.setattr(cpu_llama_ops, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    _, q, k = _qkv_views(2, 4, 2, 64, seed=0)
    ops.add_rmsnorm(torch.randn(2, 64), torch.randn(2, 64), torch.ones(64), 1e-6)
    ops.rotary(q, k, torch.tensor([3, 4]), _table(64))
    ops.silu_and_mul(torch.randn(2, 64))
    assert calls == ["add_rmsnorm_cpu", "rotary_cpu", "silu_and_mul_cpu"]


def test_cpu_ops_keep_the_references_for_half_precision() -> None:
    ops = dispatch.CPU_OPS
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        x, residual, weight = (torch.randn(3, 64, generator=g).to(dtype) for _ in range(3))
        got, ref = ops.add_rmsnorm(x, residual, weight, 1e-6), add_rmsnorm_torch(x, residual, weight, 1e-6)
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
        assert torch.equal(ops.silu_and_mul(x), silu_and_mul_torch(x))
        q, k = x.view(3, 1, 64), residual.view(3, 1, 64)
        got, ref = (
            ops.rotary(q, k, torch.tensor([0, 1, 2]), _table(64)),
            rotary_torch(q, k, torch.tensor([0, 1, 2]), _table(64)),
        )
        assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
