"""The Llama family's C element-wise kernels in bfloat16 (csrc/llama_ops.c) against their torch
references: bit for bit, since they round where torch's bfloat16 ops round (the residual sum, the
normalised row, the weight product; the rotated q and k; the SiLU, the product), on the x86 builds
whose vector widths they reproduce; and dispatch's use of them for bfloat16 models."""

from __future__ import annotations

import pytest
import torch
from test_cpu_llama_ops import VECTORISED, _qkv_views, _table
from torch_threads import torch_threads

from orca_kernels import cpu_llama_ops, dispatch, get_ops
from orca_kernels.cpu_llama_ops import add_rmsnorm_cpu, rotary_cpu, silu_and_mul_cpu
from orca_kernels.rmsnorm import add_rmsnorm_torch
from orca_kernels.rotary import rotary_torch
from orca_kernels.silu import silu_and_mul_torch

pytestmark = pytest.mark.skipif(not VECTORISED, reason="torch's bfloat16 rounding order is known for its AVX2 and "
                                "AVX512 builds")  # fmt: skip
BF16 = torch.bfloat16


def _rows(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale).to(BF16)


@pytest.mark.parametrize("hidden", [5, 64, 100, 773, 2048, 4099])
@pytest.mark.parametrize("tokens", [1, 3, 67])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_equals_the_reference(hidden: int, tokens: int, with_residual: bool) -> None:
    x, residual, weight = _rows(tokens, hidden, seed=hidden), _rows(tokens, hidden, seed=hidden + 1), _rows(hidden, seed=2)
    got = add_rmsnorm_cpu(x, residual if with_residual else None, weight, 1e-6)
    ref = add_rmsnorm_torch(x, residual if with_residual else None, weight, 1e-6)
    assert got[0].dtype == BF16 and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_add_rmsnorm_many_tokens_any_thread_count(threads: int) -> None:
    """Rows spread over threads, each its own float32 scratch row."""
    x, residual, weight = _rows(100, 2048, seed=threads), _rows(100, 2048, seed=9), _rows(2048, seed=3)
    with torch_threads(threads):
        got = add_rmsnorm_cpu(x, residual, weight, 1e-5)
    ref = add_rmsnorm_torch(x, residual, weight, 1e-5)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


def test_add_rmsnorm_strided_rows_and_per_head() -> None:
    """A strided x (a view of a wider tensor) and Qwen3's per-head norm over [T * heads, head_dim]."""
    wide = _rows(4, 3 * 128, seed=5)
    x, weight = wide[:, 128:256], _rows(128, seed=6)
    assert all(torch.equal(a, b) for a, b in zip(add_rmsnorm_cpu(x, None, weight, 1e-6),
                                                  add_rmsnorm_torch(x, None, weight, 1e-6), strict=True))  # fmt: skip
    heads = _rows(3, 8, 64, seed=7)
    got, ref = add_rmsnorm_cpu(heads, None, _rows(64, seed=8), 1e-6), add_rmsnorm_torch(heads, None, _rows(64, seed=8), 1e-6)
    assert torch.equal(got[0], ref[0])


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (12, 4), (8, 1)])
@pytest.mark.parametrize("head_dim", [6, 64, 128])
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_equals_the_reference(q_heads: int, kv_heads: int, head_dim: int, tokens: int) -> None:
    """q and k as views of one fused qkv row (strided), left untouched."""
    qkv, q, k = _qkv_views(tokens, q_heads, kv_heads, head_dim, seed=head_dim)
    qkv, q, k = (t.to(BF16) for t in (qkv, q, k))
    positions = torch.randint(0, 200, (tokens,), generator=torch.Generator().manual_seed(tokens))
    before = q.clone(), k.clone()
    got, ref = rotary_cpu(q, k, positions, _table(head_dim)), rotary_torch(q, k, positions, _table(head_dim))
    assert got[0].dtype == BF16 and torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    assert torch.equal(q, before[0]) and torch.equal(k, before[1])


@pytest.mark.parametrize("inner", [1, 24, 56, 100, 1016, 2048])
@pytest.mark.parametrize("tokens", [1, 5, 70])
def test_silu_and_mul_equals_the_reference(inner: int, tokens: int) -> None:
    """Widths before, at and past torch's splits of a row into pairs of bfloat16 vectors (SLEEF's
    exp) and the rest (std::exp), whose exps differ in the last bit for a few percent of inputs."""
    x = _rows(tokens, 2 * inner, seed=inner + tokens, scale=4.0)
    got = silu_and_mul_cpu(x)
    assert got.dtype == BF16 and torch.equal(got, silu_and_mul_torch(x))


def test_silu_and_mul_extremes_and_strided_rows() -> None:
    x = _rows(3, 2 * 64, seed=1, scale=40.0)
    x[0, :4] = torch.tensor([0.0, -0.0, 1e30, -1e30]).to(BF16)
    assert torch.equal(silu_and_mul_cpu(x), silu_and_mul_torch(x))
    wide = _rows(4, 3 * 128, seed=2, scale=3.0)[:, 64:320]  # [4, 256] strided rows
    assert torch.equal(silu_and_mul_cpu(wide), silu_and_mul_torch(wide))


def test_cpu_ops_use_the_c_kernels_for_bfloat16(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bfloat16 model's RMSNorm, rotary and SiLU-and-mul are the C kernels', equal to the references."""
    monkeypatch.delenv("ORCA_KERNELS", raising=False)
    ops = get_ops("cpu")
    assert ops is dispatch.CPU_OPS
    calls: list[str] = []
    for name in ("add_rmsnorm_cpu", "rotary_cpu", "silu_and_mul_cpu"):
        original = getattr(cpu_llama_ops, name)
        monkeypatch.setattr(cpu_llama_ops, name, lambda *a, _f=original, _n=name: calls.append(_n) or _f(*a))
    x, residual, weight = _rows(2, 64, seed=0), _rows(2, 64, seed=1), _rows(64, seed=2)
    got = ops.add_rmsnorm(x, residual, weight, 1e-6)
    assert torch.equal(got[0], add_rmsnorm_torch(x, residual, weight, 1e-6)[0])
    _, q, k = _qkv_views(2, 4, 2, 64, seed=0)
    ops.rotary(q.to(BF16), k.to(BF16), torch.tensor([3, 4]), _table(64))
    ops.silu_and_mul(_rows(2, 64, seed=3))
    assert calls == ["add_rmsnorm_cpu", "rotary_cpu", "silu_and_mul_cpu"]


def test_a_bfloat16_kernel_that_matches_nowhere_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    from orca_kernels.native import TorchOrder

    monkeypatch.setattr(cpu_llama_ops, "silu_and_mul_bf16_order", lambda: TorchOrder(16, False))
    called: list[str] = []
    monkeypatch.setattr(cpu_llama_ops, "silu_and_mul_cpu", lambda *a: called.append("c"))
    x = _rows(2, 64, seed=4)
    assert torch.equal(dispatch.silu_and_mul_cpu_or_torch(x), silu_and_mul_torch(x)) and called == []
