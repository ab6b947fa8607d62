"""FP8 K/V pools in the Triton kernels (the K/V write, the ragged kernel, the split-K decode kernel
with its fused write and rotary) against the torch reference over the same pool: on the GPU when
there is one, else through Triton's interpreter (tests/triton_testing.py).

K/V inputs are values the FP8 format holds exactly at their head's scale (random codes read back),
so a write stores the same codes under any rounding: the interpreter's float32 -> FP8 conversion
sometimes rounds toward zero where GPUs (and torch) round to nearest, loses the carry of a value
that rounds up to a power of two (0.49 -> 0.25, not 0.5), and flushes subnormals to zero; values
built this way meet none of these. The fused rotary rotates the new key before quantizing it, so there
the interpreter's pool may differ from torch's in those ways, and a GPU's by a code where its
rotation's FMAs round differently.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import BATCHES, decode_meta, make_meta, pool_slots, rope_table, with_padded_rows
from triton_testing import (
    DEVICE,
    assert_close,
    test_in_fresh_process,  # noqa: F401 (collected here: reruns this file where this process can't)
)

from orca_kernels import AttentionMetadata, KernelOps
from orca_kernels.attention import KVScales, attention_torch, dequantize_kv, write_kv_torch
from orca_kernels.rotary import rotary_torch

HEAD_DIM = 16
Q_HEADS, KV_HEADS = 8, 2  # a GQA group of 4
SCALES = KVScales(torch.tensor([0.5, 2.0], device=DEVICE), torch.tensor([0.25, 1.5], device=DEVICE))


def _codes(*shape: int, g: torch.Generator, pool_dtype: torch.dtype) -> torch.Tensor:
    """Random normal FP8 codes of magnitude 1/8 .. 4 (no subnormal, NaN or inf)."""
    values = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).view(pool_dtype).float()
    usable = values.isfinite() & (values.abs() >= 0.125) & (values.abs() <= 4)
    return torch.where(usable, values, torch.ones_like(values)).to(pool_dtype).to(DEVICE)


def _inputs(meta: AttentionMetadata, dtype: torch.dtype, pool_dtype: torch.dtype, seed: int):
    """q; the pools; this step's k and v (exact at their heads' scales)."""
    g = torch.Generator().manual_seed(seed)
    tokens = meta.slot_mapping.numel()
    q = (torch.randn(tokens, Q_HEADS, HEAD_DIM, generator=g) * 0.5).to(device=DEVICE, dtype=dtype)
    k_cache = _codes(pool_slots(meta), KV_HEADS, HEAD_DIM, g=g, pool_dtype=pool_dtype)
    v_cache = _codes(pool_slots(meta), KV_HEADS, HEAD_DIM, g=g, pool_dtype=pool_dtype)
    k = dequantize_kv(_codes(tokens, KV_HEADS, HEAD_DIM, g=g, pool_dtype=pool_dtype), SCALES.k, dtype)
    v = dequantize_kv(_codes(tokens, KV_HEADS, HEAD_DIM, g=g, pool_dtype=pool_dtype), SCALES.v, dtype)
    return q, k_cache, v_cache, k, v


def _bytes(pool: torch.Tensor) -> torch.Tensor:
    return pool.view(torch.uint8)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", ["mixed", "chunked", "decode_only"])
def test_write_then_attention_equals_the_reference(
    ops: KernelOps, batch: str, dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:  # fmt: skip
    """write_kv_attention over an FP8 pool (the write kernel + the ragged kernel, or for a decode
    batch the split kernel writing the new K/V itself): the pool's bytes equal the torch write's,
    and the output the reference's over that pool."""
    meta = make_meta(DEVICE, BATCHES[batch], block_size=5, seed=2)
    q, k_cache, v_cache, k, v = _inputs(meta, dtype, pool_dtype, seed=3)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_torch(k, v, k_ref, v_ref, meta.slot_mapping, SCALES)
    expected = attention_torch(q.float(), k_ref, v_ref, meta, 0.3, kv_scales=SCALES)

    out = ops.write_kv_attention(q, k, v, k_cache, v_cache, meta, 0.3, kv_scales=SCALES)

    assert torch.equal(_bytes(k_cache), _bytes(k_ref)) and torch.equal(_bytes(v_cache), _bytes(v_ref))
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_reads_each_heads_scale(ops: KernelOps, dtype: torch.dtype) -> None:
    """The ragged and the split kernels over a pool written by the reference, with a window and a
    soft-cap: the reference's output (swapping the heads' scales changes it)."""
    for batch in ("speculative", "decode_only"):
        meta = make_meta(DEVICE, BATCHES[batch], block_size=16, seed=5)
        q, k_cache, v_cache, _, _ = _inputs(meta, dtype, torch.float8_e4m3fn, seed=6)
        expected = attention_torch(q.float(), k_cache, v_cache, meta, 0.3, 9, 20.0, SCALES)
        out = ops.attention(q, k_cache, v_cache, meta, 0.3, 9, 20.0, SCALES)
        assert_close(out, expected, dtype)
        swapped = KVScales(SCALES.k.flip(0), SCALES.v.flip(0))
        assert not torch.allclose(attention_torch(q.float(), k_cache, v_cache, meta, 0.3, 9, 20.0, swapped),
                                  expected, atol=0.1)  # fmt: skip


@pytest.mark.parametrize("num_splits", [None, 1])
def test_fused_rotary_write_over_fp8(ops: KernelOps, num_splits: int | None) -> None:
    """rotary_write_kv_attention on a decode batch with padded rows (one split launch: the kernel
    rotates q and the new key, quantizes and stores the key and v, and attends with what the pool
    gives back): the output is the reference's over the pool the kernel left, and that pool is
    rotary_torch + write_kv_torch's (v's codes exactly; the rotated key's within one code, see
    below); padded rows write nothing and give zeros."""
    live = decode_meta(DEVICE, [1, 2, 16, 37, 40], block_size=5, seed=4)
    meta, places = with_padded_rows(live, pad_after=[1, 4])
    q_live, k_cache, v_cache, k_live, v_live = _inputs(live, torch.float32, torch.float8_e4m3fn, seed=8)
    q = torch.zeros((meta.num_requests, Q_HEADS, HEAD_DIM), device=DEVICE)
    k = torch.zeros((meta.num_requests, KV_HEADS, HEAD_DIM), device=DEVICE)
    v = torch.zeros_like(k)
    q[places], k[places], v[places] = q_live, k_live, v_live
    positions = (meta.context_lens.long() - 1).clamp(min=0)
    cos_sin = rope_table(DEVICE, HEAD_DIM, 48)
    q_rot, k_rot = rotary_torch(q_live, k_live, positions[places], cos_sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_torch(k_rot, v_live, k_ref, v_ref, live.slot_mapping, SCALES)

    out = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, 0.3,
                                        kv_scales=SCALES, num_splits=num_splits)  # fmt: skip

    # The new key and value were attended as the pool now gives them back.
    expected = attention_torch(q_rot, k_cache, v_cache, live, 0.3, kv_scales=SCALES)
    torch.testing.assert_close(out[places], expected, atol=1e-5, rtol=1e-5)
    padded = [i for i in range(meta.num_requests) if i not in places]
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    assert torch.equal(_bytes(v_cache), _bytes(v_ref))
    # Equal, or one code apart: a GPU may contract the rotation into FMAs (its rotated key differs from
    # torch's in the last bits, which can cross a rounding boundary), and the interpreter's conversions
    # flush subnormals and lose carries (module docstring).
    got, want = (pool.float() for pool in (k_cache, k_ref))
    one_code = (got - want).abs() <= 0.125 * want.abs()
    flushed = (got == 0) & (want.abs() < 2**-6)
    lost_carry = (got * 2 == want) & (want.abs().log2() == want.abs().log2().round())  # rounded up to 2^e, kept e-1
    assert bool((one_code | (DEVICE == "cpu") & (flushed | lost_carry)).all())
