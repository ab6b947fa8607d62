"""The Llama family's C element-wise kernels on CPU (RMSNorm with residual add, rotary, SiLU-and-mul)
against their torch references, and how dispatch wires them into CPU_OPS."""

from __future__ import annotations

import ctypes
import platform

import numpy as np
import pytest
import torch
from torch_threads import torch_threads

from orca_backend.model.rope import cos_sin_table, inverse_frequencies
from orca_kernels import cpu_llama_ops, dispatch, get_ops
from orca_kernels.cpu_llama_ops import (
    add_rmsnorm_cpu,
    add_rmsnorm_order,
    load_add_rmsnorm_kernel,
    rotary_cpu,
    silu_and_mul_cpu,
    silu_and_mul_order,
)
from orca_kernels.native import TorchOrder
from orca_kernels.rmsnorm import add_rmsnorm_torch
from orca_kernels.rotary import rotary_torch
from orca_kernels.silu import silu_and_mul_torch

TOL = {"rtol": 1e-5, "atol": 1e-6}
# torch's CPU kernels vectorise with fixed-width vectors on x86, whose summation order the RMSNorm
# kernel reproduces; elsewhere only the tolerance is promised. Its AVX2 and AVX512 builds (not the
# DEFAULT one that ATEN_CPU_CAPABILITY=default forces) are those every kernel's order is known for.
X86 = platform.machine().lower() in ("x86_64", "amd64")
VECTORISED = X86 and torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def _randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


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
    with torch_threads(threads):
        out, summed = add_rmsnorm_cpu(x, residual, weight, 1e-6)
    ref_out, ref_summed = add_rmsnorm_torch(x, residual, weight, 1e-6)
    torch.testing.assert_close(out, ref_out, **TOL)
    assert torch.equal(summed, ref_summed)


@pytest.mark.skipif(not X86, reason="torch's summation order is reproduced for its x86 vector widths")
@pytest.mark.parametrize("hidden", [5, 64, 100, 768, 4096, 40000])
def test_add_rmsnorm_is_bit_identical_to_reference(hidden: int) -> None:
    """The sum of squares is added in torch's own order, at the width torch's sum runs at here
    (probed: under AVX512, torch 2.13's sum runs its AVX2 build), so outputs equal the
    reference's (and transformers') exactly: a last-bit difference could flip a greedy token."""
    assert add_rmsnorm_order().matches
    x, residual, weight = _randn(16, hidden, seed=hidden), _randn(16, hidden, seed=1), _randn(hidden, seed=2)
    assert torch.equal(
        add_rmsnorm_cpu(x, residual, weight, 1e-6)[0], add_rmsnorm_torch(x, residual, weight, 1e-6)[0]
    )


def _sum_squares_in_torch_order(rows: np.ndarray, lanes: int) -> np.ndarray:
    """Each row's float32 sum of squares added as torch's cascade_sum adds a contiguous row
    (aten/src/ATen/native/cpu/SumKernel.cpp: vectorized_inner_sum, row_sum, multi_row_sum) with
    Vectorized<float>::size() == lanes, written from that code independently of the C kernel."""
    n = rows.shape[1]
    if n < lanes:  # scalar_inner_sum: one-float vectors
        lanes = 1
    sq = rows.astype(np.float32) ** 2
    vecs = n // lanes
    size_ilp = vecs // 4  # row_sum: the row as (-1, 4) vectors
    level_power = max(4, ((size_ilp - 1).bit_length() if size_ilp > 2 else 1) // 4)  # CeilLog2(size) / 4 levels
    step, mask = 1 << level_power, (1 << level_power) - 1
    acc = np.zeros((4, rows.shape[0], 4 * lanes), np.float32)  # 4 levels of ILP rows of vectors
    ilp_row = lambda i: sq[:, i * 4 * lanes : (i + 1) * 4 * lanes]  # noqa: E731
    i = 0
    while i + step <= size_ilp:
        for _ in range(step):
            acc[0] += ilp_row(i)
            i += 1
        for j in range(1, 4):
            acc[j] += acc[j - 1]
            acc[j - 1] = 0
            if i & (mask << (j * level_power)):
                break
    while i < size_ilp:
        acc[0] += ilp_row(i)
        i += 1
    for j in range(1, 4):
        acc[0] += acc[j]
    vec = [acc[0][:, k * lanes : (k + 1) * lanes] for k in range(4)]
    for v in range(size_ilp * 4, vecs):  # whole vectors left over go into the first partial sum
        vec[0] = vec[0] + sq[:, v * lanes : (v + 1) * lanes]
    for k in range(1, 4):
        vec[0] = vec[0] + vec[k]
    total = np.zeros(rows.shape[0], np.float32)
    for k in range(vecs * lanes, n):  # the scalar tail, then each lane in turn
        total += sq[:, k]
    for lane in range(lanes):
        total += vec[0][:, lane]
    return total


@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("hidden", [5, 12, 64, 100, 773, 4099, 40000])
def test_add_rmsnorm_adds_in_torch_order_at_either_width(lanes: int, hidden: int) -> None:
    """Both x86 widths' orders, whatever this machine's is: the kernel driven at 8 and 16 lanes
    equals an RMSNorm whose sum of squares is added in torch's order at that width (mean = sum /
    hidden, rstd = 1 / sqrt, then x * rstd and weight * that, each rounded in float32)."""
    x, weight = _randn(6, hidden, seed=hidden + lanes), _randn(hidden, seed=3)
    out = torch.empty_like(x)
    load_add_rmsnorm_kernel()(x.data_ptr(), hidden, None, 0, weight.data_ptr(), out.data_ptr(), x.data_ptr(), 6,
                              hidden, 1e-6, lanes, 1)  # fmt: skip
    var = _sum_squares_in_torch_order(x.numpy(), lanes) / np.float32(hidden)
    rstd = np.float32(1.0) / np.sqrt(var + np.float32(1e-6))
    expected = weight.numpy() * (x.numpy() * rstd[:, None])
    assert np.array_equal(out.numpy(), expected)


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
    with torch_threads(threads):
        got = rotary_cpu(q, k, positions, table)
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
    if silu_and_mul_order().matches:  # exp as torch's vectorised kernels compute it (SLEEF's expf_u10)
        assert torch.equal(out, ref)


@pytest.mark.skipif(not VECTORISED, reason="needs torch's vectorised exp (its AVX2 or AVX512 build)")
@pytest.mark.parametrize("lanes", [8, 16])
@pytest.mark.parametrize("inner", [24, 40, 1016])
def test_silu_and_mul_splits_rows_as_torch_at_either_width(lanes: int, inner: int) -> None:
    """torch's loop gives SLEEF's exp to whole pairs of vectors and libm's expf to the rest of a
    row: the kernel at 8 and 16 lanes equals that split at its width (the vectorised part from
    F.silu over a multiple of 32 floats, which either x86 build runs vectorised, the tail from
    libm's expf in float32), so both widths are checked whatever this machine's is."""
    x = _randn(16, 2 * inner, seed=inner, scale=4.0)
    gate, up = x[:, :inner], x[:, inner:]
    split = inner - inner % (2 * lanes)
    padded = torch.nn.functional.pad(gate, (0, -inner % 32))
    vectorised = torch.nn.functional.silu(padded)[:, :inner] * up
    expf = ctypes.CDLL("libm.so.6").expf
    expf.argtypes, expf.restype = [ctypes.c_float], ctypes.c_float
    g = gate.numpy()
    scalar = g / (np.float32(1) + np.vectorize(lambda v: expf(-v), otypes=[np.float32])(g)) * up.numpy()
    expected = torch.cat([vectorised[:, :split], torch.from_numpy(scalar[:, split:])], dim=1)
    assert torch.equal(silu_and_mul_cpu(x, lanes), expected)


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
    with torch_threads(threads):
        out = silu_and_mul_cpu(x)
    torch.testing.assert_close(out, silu_and_mul_torch(x), **TOL)


# --- float32 only, and dispatch ----------------------------------------------------------------


def test_wrappers_take_float32_or_bfloat16_cpu_tensors_only() -> None:
    x = torch.randn(2, 64, dtype=torch.float16)
    with pytest.raises(ValueError, match="CPU tensors all float32 or all bfloat16"):
        add_rmsnorm_cpu(x, None, torch.ones(64, dtype=torch.float16), 1e-6)
    with pytest.raises(ValueError, match="CPU tensors all float32 or all bfloat16"):
        silu_and_mul_cpu(x)
    with pytest.raises(ValueError, match="CPU tensors all float32 or all bfloat16"):
        rotary_cpu(x.view(2, 1, 64), x.view(2, 1, 64), torch.tensor([0, 1]), _table(64))
    mixed = torch.randn(2, 64)
    with pytest.raises(ValueError, match="CPU tensors all float32 or all bfloat16"):
        add_rmsnorm_cpu(mixed, None, torch.ones(64, dtype=torch.bfloat16), 1e-6)


@pytest.mark.skipif(not VECTORISED, reason="torch's order is known for its AVX2 and AVX512 builds")
def test_probes_find_torch_order_on_x86_builds() -> None:
    """On the builds the kernels are written for, every probe finds a width that agrees with torch
    (a kernel whose order broke would show here, not as a slower machine)."""
    from orca_kernels.cpu_gpt2_ops import add_layernorm_order

    for order in (add_rmsnorm_order(), silu_and_mul_order(), add_layernorm_order(),
                  cpu_llama_ops.add_rmsnorm_bf16_order(), cpu_llama_ops.silu_and_mul_bf16_order()):  # fmt: skip
        assert order.matches and order.lanes in (8, 16)


def test_an_op_whose_order_matches_nowhere_runs_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    """A C kernel that agrees with torch at no width is not used (auto keeps its reference; a
    forced ORCA_KERNELS=cpu is an error naming it), so the tokens stay transformers'."""
    monkeypatch.delenv("ORCA_KERNELS", raising=False)
    monkeypatch.setattr(cpu_llama_ops, "add_rmsnorm_order", lambda: TorchOrder(8, False))
    ops = get_ops("cpu")
    assert ops.add_rmsnorm is add_rmsnorm_torch and ops.name == "cpu"
    assert ops.rotary is dispatch.rotary_cpu_or_torch  # the others keep their C kernels
    with pytest.raises(RuntimeError, match=r"ORCA_KERNELS=cpu: the C kernels for \[.*'add_rmsnorm'"):
        get_ops("cpu", "cpu")


@pytest.mark.skipif(not VECTORISED, reason="under other builds ops whose order is not reproduced keep the reference")
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


def test_cpu_ops_keep_the_references_for_float16() -> None:
    ops = dispatch.CPU_OPS
    g = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(3, 64, generator=g).to(torch.float16) for _ in range(3))
    got, ref = ops.add_rmsnorm(x, residual, weight, 1e-6), add_rmsnorm_torch(x, residual, weight, 1e-6)
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    assert torch.equal(ops.silu_and_mul(x), silu_and_mul_torch(x))
    q, k = x.view(3, 1, 64), residual.view(3, 1, 64)
    got, ref = (
        ops.rotary(q, k, torch.tensor([0, 1, 2]), _table(64)),
        rotary_torch(q, k, torch.tensor([0, 1, 2]), _table(64)),
    )
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
