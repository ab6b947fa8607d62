"""Llama-family kernels (RMSNorm, SiLU-and-mul, rotary, grouped-query attention): each Triton kernel
against its torch reference, and each torch reference against an independent formula (Hugging
Face's for RMSNorm and rotary, ``F.silu(gate) * up``, and GQA as multi-head attention over
repeated K/V).

Triton runs as in tests/kernels/test_kernels.py, on the GPU when there is one, else through the
interpreter, with the same tolerances (tests/triton_testing.py).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from attention_cases import BATCHES, BLOCK_SIZES, GQA_HEADS, dense_attention, expand_kv, make_meta, pool_slots
from triton_testing import (
    DEVICE,
    assert_close,
    randn,
    test_in_fresh_process,  # noqa: F401 (collected here: reruns this file where this process can't)
)

from orca_kernels import KernelOps
from orca_kernels.dispatch import CPU_OPS, TORCH_OPS

DTYPES = [torch.float32, torch.bfloat16]


# --- add + RMSNorm -----------------------------------------------------------------------------


def _hf_rmsnorm(hidden_states: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm.forward, written out from its definition."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    hidden_states = hidden_states * torch.rsqrt(variance + eps)
    return weight * hidden_states.to(input_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm_torch_is_hf_rmsnorm(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(1)
    x, residual = randn(5, 96, g=g, dtype=dtype), randn(5, 96, g=g, dtype=dtype)
    weight = randn(96, g=g, dtype=dtype)
    if not with_residual:
        residual = None

    out, summed = TORCH_OPS.add_rmsnorm(x, residual, weight, 1e-6)

    expected_sum = x if residual is None else x + residual
    assert torch.equal(summed, expected_sum)
    assert torch.equal(out, _hf_rmsnorm(expected_sum, weight, 1e-6))  # bit for bit, roundings included
    # And the math itself, in float64: x / sqrt(mean(x^2) + eps) * w.
    s = expected_sum.double()
    exact = s / (s.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt() * weight.double()
    assert_close(out, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [50, 256])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_rmsnorm(ops: KernelOps, dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (randn(3, hidden, g=g) * 2 + 1).to(dtype)
    residual = randn(3, hidden, g=g, dtype=dtype) if with_residual else None
    weight = randn(hidden, g=g, dtype=dtype)

    out, summed = ops.add_rmsnorm(x, residual, weight, 1e-5)

    ref_out, ref_sum = TORCH_OPS.add_rmsnorm(x, residual, weight, 1e-5)
    assert_close(summed, ref_sum, dtype)
    assert_close(out, ref_out, dtype)
    if residual is None:
        assert summed is x  # same contract as the reference: no copy


@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rmsnorm_wide_rows(ops: KernelOps, dtype: torch.dtype) -> None:
    """Rows wider than the block take the looped two-pass path; max_block=32 forces it."""
    g = torch.Generator().manual_seed(7)
    x, residual = randn(2, 200, g=g, dtype=dtype), randn(2, 200, g=g, dtype=dtype)
    weight = randn(200, g=g, dtype=dtype)

    out, summed = ops.add_rmsnorm(x, residual, weight, 1e-5, max_block=32)
    out_nores, _ = ops.add_rmsnorm(x, None, weight, 1e-5, max_block=32)

    ref_out, ref_sum = TORCH_OPS.add_rmsnorm(x, residual, weight, 1e-5)
    assert_close(summed, ref_sum, dtype)
    assert_close(out, ref_out, dtype)
    assert_close(out_nores, TORCH_OPS.add_rmsnorm(x, None, weight, 1e-5)[0], dtype)


def test_add_rmsnorm_per_head_of_fused_qkv(ops: KernelOps) -> None:
    """Qwen3 normalises each head of q and k: [T, H, D] views of the fused projection, weight [D]."""
    g = torch.Generator().manual_seed(5)
    qkv = randn(3, (4 + 2 + 2) * 64, g=g, dtype=torch.bfloat16)
    q = qkv[:, : 4 * 64].view(3, 4, 64)
    weight = randn(64, g=g, dtype=torch.bfloat16)

    out, _ = ops.add_rmsnorm(q, None, weight, 1e-6)

    assert out.shape == q.shape
    assert_close(out, TORCH_OPS.add_rmsnorm(q, None, weight, 1e-6)[0], torch.bfloat16)


def test_add_rmsnorm_fp32_weight_keeps_hf_dtype_promotion(ops: KernelOps) -> None:
    """HF multiplies an fp32 weight by the bf16-rounded row, so the output is fp32."""
    g = torch.Generator().manual_seed(6)
    x, weight = randn(2, 64, g=g, dtype=torch.bfloat16), randn(64, g=g)
    out, _ = ops.add_rmsnorm(x, None, weight, 1e-6)
    ref, _ = TORCH_OPS.add_rmsnorm(x, None, weight, 1e-6)
    assert out.dtype == ref.dtype == torch.float32
    # The kernel's only difference: the interpreter's bf16 rounding of the normalised row.
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)


# --- SiLU and multiply -------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_and_mul_torch_is_gated_silu(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    gate, up = randn(3, 40, g=g, dtype=dtype) * 4, randn(3, 40, g=g, dtype=dtype)

    out = TORCH_OPS.silu_and_mul(torch.cat([gate, up], dim=-1))

    assert out.dtype == dtype and out.shape == (3, 40)
    # Close, not equal: torch's vectorised silu (contiguous gate here) and its scalar loop (the
    # reference's strided view) round differently in the last bit.
    assert_close(out, F.silu(gate) * up, dtype)
    exact = gate.double() * torch.sigmoid(gate.double()) * up.double()
    assert_close(out, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [50, 1100])  # 1100: two column blocks, the second partial
def test_silu_and_mul(ops: KernelOps, dtype: torch.dtype, inner: int) -> None:
    g = torch.Generator().manual_seed(inner)
    x = randn(3, 2 * inner, g=g) * 4
    x[0, :4] = torch.tensor([-100.0, -20.0, 20.0, 100.0])  # saturated gates, exp overflow included
    x = x.to(dtype)

    out = ops.silu_and_mul(x)

    # fp32 math over the same rounded inputs.
    assert_close(out, TORCH_OPS.silu_and_mul(x.float()), dtype)
    assert torch.isfinite(out.float()).all()


@pytest.mark.parametrize("dtype", DTYPES)
def test_gelu_and_mul_torch_is_gated_tanh_gelu(dtype: torch.dtype) -> None:
    """Gemma's GeGLU: transformers' gelu_pytorch_tanh of the gate times up, against its formula."""
    g = torch.Generator().manual_seed(5)
    gate, up = randn(3, 40, g=g, dtype=dtype) * 4, randn(3, 40, g=g, dtype=dtype)
    out = TORCH_OPS.gelu_and_mul(torch.cat([gate, up], dim=-1))
    assert out.dtype == dtype and out.shape == (3, 40)
    x = gate.double()
    exact = 0.5 * x * (1 + torch.tanh((2 / torch.pi) ** 0.5 * (x + 0.044715 * x**3))) * up.double()
    assert_close(out, exact, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [50, 1100])
def test_gelu_and_mul(ops: KernelOps, dtype: torch.dtype, inner: int) -> None:
    g = torch.Generator().manual_seed(inner + 1)
    x = randn(3, 2 * inner, g=g) * 4
    x[0, :4] = torch.tensor([-100.0, -20.0, 20.0, 100.0])  # saturated gates, exp overflow included
    x = x.to(dtype)
    out = ops.gelu_and_mul(x)
    assert_close(out, TORCH_OPS.gelu_and_mul(x.float()), dtype)
    assert torch.isfinite(out.float()).all()
    assert not torch.allclose(out.float(), ops.silu_and_mul(x).float(), atol=1e-2)  # not the SiLU it shares a kernel with


def test_silu_and_mul_strided_rows(ops: KernelOps) -> None:
    """Rows of a wider tensor (row stride != 2 * inner) are read in place."""
    g = torch.Generator().manual_seed(3)
    x = randn(4, 200, g=g)[:, 8:168]
    assert_close(ops.silu_and_mul(x), TORCH_OPS.silu_and_mul(x), torch.float32)


# --- rotary ------------------------------------------------------------------------------------


def _cos_sin_table(
    head_dim: int, max_positions: int, base: float = 10000.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(inv_freq, cos_sin [max_positions, head_dim]) as the model builds them."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
    return inv_freq, torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(DEVICE)


def _hf_apply_rotary(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' LlamaRotaryEmbedding + apply_rotary_pos_emb, written out from their definitions
    for q/k [T, H, D] (HF's layout is [B, H, T, D]; unsqueeze_dim=1 broadcasts over the heads)."""

    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return torch.cat((-x2, x1), dim=-1)

    freqs = positions.float()[:, None].cpu() @ inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().to(q.device).unsqueeze(1), emb.sin().to(q.device).unsqueeze(1)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


def _qk_views(tokens: int, hq: int, hkv: int, head_dim: int, g: torch.Generator, dtype: torch.dtype):
    """q and k as non-contiguous views of a fused qkv projection, as the model produces them."""
    qkv = randn(tokens, (hq + 2 * hkv) * head_dim, g=g, dtype=dtype)
    q = qkv[:, : hq * head_dim].view(tokens, hq, head_dim)
    k = qkv[:, hq * head_dim : (hq + hkv) * head_dim].view(tokens, hkv, head_dim)
    return qkv, q, k


@pytest.mark.parametrize("head_dim", [64, 128])
def test_rotary_torch_is_hf_rotate_half(head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    inv_freq, cos_sin = _cos_sin_table(head_dim, 4096)
    positions = torch.tensor([0, 1, 7, 300, 4095], device=DEVICE)
    qkv, q, k = _qk_views(5, 4, 2, head_dim, g, torch.float32)
    before = qkv.clone()

    q_out, k_out = TORCH_OPS.rotary(q, k, positions, cos_sin)

    hf_q, hf_k = _hf_apply_rotary(q, k, positions, inv_freq)
    torch.testing.assert_close(q_out, hf_q, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_out, hf_k, atol=1e-6, rtol=1e-6)
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(qkv, before)  # the inputs (and the fused v) are untouched
    assert torch.equal(q_out[0], q[0])  # position 0 is the identity rotation


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("heads", "head_dim"), [((4, 2), 64), ((8, 1), 128), ((3, 3), 80)])
def test_rotary(ops: KernelOps, dtype: torch.dtype, heads: tuple[int, int], head_dim: int) -> None:
    g = torch.Generator().manual_seed(head_dim)
    _, cos_sin = _cos_sin_table(head_dim, 512)
    positions = torch.tensor([0, 5, 511, 17, 200, 3], device=DEVICE)  # ragged: prefill and decodes mixed
    qkv, q, k = _qk_views(6, *heads, head_dim, g, dtype)
    before = qkv.clone()

    q_out, k_out = ops.rotary(q, k, positions, cos_sin)

    ref_q, ref_k = TORCH_OPS.rotary(q.float(), k.float(), positions, cos_sin)
    assert_close(q_out, ref_q, dtype)
    assert_close(k_out, ref_k, dtype)
    assert q_out.shape == q.shape and k_out.shape == k.shape
    assert q_out.is_contiguous() and k_out.is_contiguous()
    assert torch.equal(qkv, before)


def test_rotary_many_heads(ops: KernelOps) -> None:
    """40 query heads of 128 need two head blocks per token; k's 8 heads fit in the first."""
    g = torch.Generator().manual_seed(40)
    _, cos_sin = _cos_sin_table(128, 64)
    positions = torch.tensor([3, 63], device=DEVICE)
    _, q, k = _qk_views(2, 40, 8, 128, g, torch.float32)
    q_out, k_out = ops.rotary(q, k, positions, cos_sin)
    ref_q, ref_k = TORCH_OPS.rotary(q, k, positions, cos_sin)
    assert_close(q_out, ref_q, torch.float32)
    assert_close(k_out, ref_k, torch.float32)


# --- grouped-query attention -------------------------------------------------------------------


def _gqa_inputs(meta, hq: int, hkv: int, head_dim: int, dtype: torch.dtype, seed: int):
    """q as a strided view of a fused qkv tensor; the caches as one layer of a multi-layer pool."""
    g = torch.Generator().manual_seed(seed)
    tokens, slots = meta.host_lens()[0][-1], pool_slots(meta)
    q = randn(tokens, hq + 2 * hkv, head_dim, g=g, dtype=dtype)[:, :hq]
    pool = randn(2, 2, slots, hkv, head_dim, g=g, dtype=dtype)
    return q, pool[0, 1], pool[1, 1]


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", list(GQA_HEADS))
@pytest.mark.parametrize("batch", list(BATCHES))
def test_gqa_attention_torch_is_mha_over_repeated_kv(
    batch: str, layout: str, head_dim: int, dtype: torch.dtype, block_size: int
) -> None:
    meta = make_meta(DEVICE, BATCHES[batch], block_size=block_size, seed=block_size)
    hq, hkv = GQA_HEADS[layout]
    q, k_cache, v_cache = _gqa_inputs(meta, hq, hkv, head_dim, dtype, seed=head_dim + hq + hkv)
    scale = head_dim**-0.5

    out = TORCH_OPS.attention(q, k_cache, v_cache, meta, scale)

    expected = TORCH_OPS.attention(q, expand_kv(k_cache, hq), expand_kv(v_cache, hq), meta, scale)
    if hq == hkv:
        assert torch.equal(out, expected)
    else:
        assert_close(out, expected, dtype)
    # And both against attention written out from its definition (float64, its own slot arithmetic).
    assert_close(out, dense_attention(q, k_cache, v_cache, meta, scale), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("layout", ["group2", "group4", "mqa"])
def test_gqa_attention(ops: KernelOps, layout: str, head_dim: int, dtype: torch.dtype) -> None:
    meta = make_meta(DEVICE, BATCHES["mixed"])
    hq, hkv = GQA_HEADS[layout]
    q, k_cache, v_cache = _gqa_inputs(meta, hq, hkv, head_dim, dtype, seed=head_dim + hq + hkv)
    scale = head_dim**-0.5

    out = ops.attention(q, k_cache, v_cache, meta, scale)

    expected = TORCH_OPS.attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("batch", ["prefill_only", "decode_only", "chunked"])
def test_gqa_attention_batches(ops: KernelOps, batch: str) -> None:
    meta = make_meta(DEVICE, BATCHES[batch])
    q, k_cache, v_cache = _gqa_inputs(meta, 8, 2, 64, torch.float32, seed=3)
    out = ops.attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, TORCH_OPS.attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


@pytest.mark.parametrize("block_size", [1, 12])
@pytest.mark.parametrize("layout", ["group4", "mqa"])
def test_gqa_attention_paged(ops: KernelOps, layout: str, block_size: int) -> None:
    """A K/V tile's block lookups serve every query head the program stacks over its K/V head."""
    meta = make_meta(DEVICE, BATCHES["mixed"], block_size=block_size, seed=block_size)
    hq, hkv = GQA_HEADS[layout]
    q, k_cache, v_cache = _gqa_inputs(meta, hq, hkv, 64, torch.float32, seed=block_size)
    out = ops.attention(q, k_cache, v_cache, meta, 0.125)
    assert_close(out, TORCH_OPS.attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch", ["mixed", "decode_only"])
def test_gqa_attention_group8(ops: KernelOps, batch: str, dtype: torch.dtype) -> None:
    """16 query heads over 2 K/V heads: one program stacks a K/V head's 8 query heads into its
    tile's rows (decode fills the tile with heads instead of masked queries)."""
    meta = make_meta(DEVICE, BATCHES[batch])
    q, k_cache, v_cache = _gqa_inputs(meta, 16, 2, 64, dtype, seed=8)

    out = ops.attention(q, k_cache, v_cache, meta, 0.125)

    expected = TORCH_OPS.attention(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize(("hq", "hkv", "max_heads"), [(6, 2, 64), (8, 1, 2), (6, 2, 2)])
def test_gqa_attention_padded_and_split_groups(
    ops: KernelOps, monkeypatch: pytest.MonkeyPatch, hq: int, hkv: int, max_heads: int
) -> None:
    """A group of 3 pads the program's heads to 4; a cap below the group splits it over several
    programs per K/V head (evenly for 8 by 2, with a padded last program for 3 by 2)."""
    from orca_kernels import triton_attention

    monkeypatch.setattr(triton_attention, "_MAX_HEADS", max_heads)
    meta = make_meta(DEVICE, BATCHES["mixed"])
    q, k_cache, v_cache = _gqa_inputs(meta, hq, hkv, 64, torch.float32, seed=hq + hkv)

    out = ops.attention(q, k_cache, v_cache, meta, 0.125)

    assert_close(out, TORCH_OPS.attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


def test_gqa_attention_block_m_override(ops: KernelOps) -> None:
    """block_m counts queries per program, whatever the group: 32 queries x 4 heads per tile."""
    meta = make_meta(DEVICE, BATCHES["mixed"])
    q, k_cache, v_cache = _gqa_inputs(meta, 8, 2, 64, torch.float32, seed=5)
    out = ops.attention(q, k_cache, v_cache, meta, 0.125, block_m=32, block_n=16)
    assert_close(out, TORCH_OPS.attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


def test_gqa_write_then_attend(ops: KernelOps) -> None:
    """One Llama step: rotary on q/k views of the fused projection, scatter K/V into a pool of Hkv
    heads, attend with Hq query heads; all Triton against all torch."""
    meta = make_meta(DEVICE, BATCHES["mixed"], block_size=5)
    g = torch.Generator().manual_seed(11)
    hq, hkv, head_dim, tokens, slots = 4, 2, 64, meta.host_lens()[0][-1], pool_slots(meta)
    qkv, q, k = _qk_views(tokens, hq, hkv, head_dim, g, torch.float32)
    v = qkv[:, (hq + hkv) * head_dim :].view(tokens, hkv, head_dim)
    positions = torch.cat([torch.arange(c - n, c) for n, c in BATCHES["mixed"]]).to(DEVICE)
    _, cos_sin = _cos_sin_table(head_dim, 64)
    caches = randn(2, slots, hkv, head_dim, g=g)
    results = []
    for kernel_ops in (ops, TORCH_OPS):
        k_cache, v_cache = caches.clone().unbind(0)
        q_rot, k_rot = kernel_ops.rotary(q, k, positions, cos_sin)
        kernel_ops.write_kv(k_rot, v, k_cache, v_cache, meta.slot_mapping)
        results.append(kernel_ops.attention(q_rot, k_cache, v_cache, meta, head_dim**-0.5))
    assert_close(results[0], results[1], torch.float32)


def test_gqa_rejects_uneven_heads(ops: KernelOps) -> None:
    meta = make_meta(DEVICE, BATCHES["decode_only"])
    q, k_cache, v_cache = _gqa_inputs(meta, 6, 4, 64, torch.float32, seed=0)
    for kernel_ops in (ops, TORCH_OPS):
        with pytest.raises(ValueError, match="multiple of the K/V heads"):
            kernel_ops.attention(q, k_cache, v_cache, meta, 0.125)


# --- dispatch ----------------------------------------------------------------------------------


def test_bundles_carry_the_llama_ops(ops: KernelOps) -> None:
    from orca_kernels.rmsnorm import add_rmsnorm_torch
    from orca_kernels.rotary import rotary_torch
    from orca_kernels.silu import silu_and_mul_torch

    assert TORCH_OPS.add_rmsnorm is add_rmsnorm_torch
    assert TORCH_OPS.silu_and_mul is silu_and_mul_torch
    assert TORCH_OPS.rotary is rotary_torch
    # CPU_OPS: the C kernels for float32, these references otherwise (tests/kernels/test_cpu_llama_ops.py)
    names = [f.__name__ for f in (CPU_OPS.add_rmsnorm, CPU_OPS.silu_and_mul, CPU_OPS.rotary)]
    assert names == ["add_rmsnorm_cpu_or_torch", "silu_and_mul_cpu_or_torch", "rotary_cpu_or_torch"]
    names = [f.__name__ for f in (CPU_OPS.add_layernorm, CPU_OPS.bias_gelu)]  # tests/kernels/test_cpu_gpt2_ops.py
    assert names == ["add_layernorm_cpu_or_torch", "bias_gelu_cpu_or_torch"]
    names = [f.__name__ for f in (ops.add_rmsnorm, ops.silu_and_mul, ops.rotary)]
    assert names == ["add_rmsnorm_triton", "silu_and_mul_triton", "rotary_triton"]
