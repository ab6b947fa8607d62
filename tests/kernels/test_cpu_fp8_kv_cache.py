"""FP8 K/V pools (kv_cache_dtype fp8) on the CPU paths: the torch reference and the C kernels.

The contract (kernels/orca_kernels/attention.py): a K/V value is stored as fp8(x / scale) per K/V
head, clamped, and read back as float32(code) * scale rounded to the model's dtype. So attention
over an FP8 pool must equal, exactly, attention over a model-dtype pool holding those read-back
values: that is what these tests compare, for every path, and what the model tests compare
transformers against (tests/model/test_fp8_kv_cache.py).
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import BATCHES, make_meta, pool_slots

from orca_kernels import cpu_attention
from orca_kernels.attention import KVScales, attention_torch, dequantize_kv, quantize_kv, write_kv_torch
from orca_kernels.cpu_attention import attention_cpu, write_kv_cpu

POOL_DTYPES = [torch.float8_e4m3fn, torch.float8_e5m2]
# Per-head scales that are not powers of two, so a kernel applying the wrong head's (or none) fails.
K_SCALES, V_SCALES = [0.37, 1.9], [0.052, 0.81]


def _scales(kv_heads: int = 2) -> KVScales:
    return KVScales(torch.tensor(K_SCALES[:kv_heads]), torch.tensor(V_SCALES[:kv_heads]))


def _pools(meta, kv_heads: int, head_dim: int, pool_dtype: torch.dtype, scales: KVScales, seed: int):
    """An FP8 pool of random K/V (several times the scales, so codes span the format's range) and
    the same values read back in float32 and bfloat16."""
    g = torch.Generator().manual_seed(seed)
    slots = pool_slots(meta)
    k = quantize_kv(torch.randn(slots, kv_heads, head_dim, generator=g) * 4, scales.k, pool_dtype)
    v = quantize_kv(torch.randn(slots, kv_heads, head_dim, generator=g) * 4, scales.v, pool_dtype)
    return k, v


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
def test_quantize_rounds_to_nearest_and_saturates(pool_dtype: torch.dtype) -> None:
    """x / scale rounded to the nearest code; past the largest finite value, that value (vLLM's
    saturating conversion), never inf or NaN."""
    limit = torch.finfo(pool_dtype).max
    scale = torch.tensor([2.0])
    x = torch.tensor([0.0, 1.0, -3.0, 2 * limit, -4 * limit, 1e30]).reshape(1, 1, 6)  # [1 token, 1 head, 6]
    codes = quantize_kv(x, scale, pool_dtype).float().flatten()
    assert codes.tolist() == [0.0, 0.5, -1.5, limit, -limit, limit]
    # round to nearest: 1 + a quarter of the step between codes at 1 reads back as 1, three quarters
    # as the next code (e4m3 keeps 3 mantissa bits, e5m2 2)
    step = 0.125 if pool_dtype == torch.float8_e4m3fn else 0.25
    near = quantize_kv(torch.tensor([[[1 + step / 4, 1 + 3 * step / 4]]]), torch.tensor([1.0]), pool_dtype)
    assert near.float().flatten().tolist() == [1.0, 1.0 + step]


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("write_kv", [write_kv_torch, write_kv_cpu], ids=["torch", "cpu"])
def test_write_stores_each_heads_codes(write_kv, pool_dtype: torch.dtype) -> None:
    """The write quantizes each head by its own scale into the token's slot; a negative slot (a
    padded row of a CUDA graph's batch) writes nothing; every other slot keeps its bytes."""
    meta = make_meta("cpu", BATCHES["mixed"], block_size=5, seed=3)
    scales = _scales()
    k_cache, v_cache = _pools(meta, 2, 16, pool_dtype, scales, seed=1)
    before_k, before_v = k_cache.clone(), v_cache.clone()
    g = torch.Generator().manual_seed(2)
    tokens = meta.slot_mapping.numel()
    k, v = torch.randn(tokens, 2, 16, generator=g), torch.randn(tokens, 2, 16, generator=g)
    slots = meta.slot_mapping.clone()
    slots[1] = -1
    write_kv(k, v, k_cache, v_cache, slots, scales)
    live = slots >= 0
    written = slots[live]
    assert torch.equal(k_cache[written].view(torch.uint8),
                       quantize_kv(k[live], scales.k, pool_dtype).view(torch.uint8))  # fmt: skip
    assert torch.equal(v_cache[written].view(torch.uint8),
                       quantize_kv(v[live], scales.v, pool_dtype).view(torch.uint8))  # fmt: skip
    untouched = torch.ones(k_cache.shape[0], dtype=torch.bool)
    untouched[written] = False
    assert torch.equal(k_cache[untouched].view(torch.uint8), before_k[untouched].view(torch.uint8))
    assert torch.equal(v_cache[untouched].view(torch.uint8), before_v[untouched].view(torch.uint8))


def test_an_fp8_pool_needs_its_scales() -> None:
    meta = make_meta("cpu", BATCHES["decode_only"], block_size=5)
    k_cache, v_cache = _pools(meta, 2, 16, torch.float8_e4m3fn, _scales(), seed=0)
    q = torch.randn(meta.num_requests, 4, 16)
    with pytest.raises(ValueError, match="needs float32 KVScales"):
        attention_cpu(q, k_cache, v_cache, meta, 0.25)
    with pytest.raises(ValueError, match=r"needs float32 KVScales of \[2\]"):
        attention_torch(q, k_cache, v_cache, meta, 0.25, kv_scales=_scales(1))
    with pytest.raises(ValueError, match="kv_scales are for an FP8"):
        attention_torch(q, k_cache.float(), v_cache.float(), meta, 0.25, kv_scales=_scales())


@pytest.mark.parametrize("pool_dtype", POOL_DTYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("attention", [attention_torch, attention_cpu], ids=["torch", "cpu"])
@pytest.mark.parametrize(("batch", "window", "softcap"),
                         [("mixed", 0, 0.0), ("chunked", 0, 0.0), ("speculative", 7, 0.0), ("mixed", 9, 30.0),
                          ("prefill_only", 0, 0.0), ("prefill_only", 9, 30.0)])  # fmt: skip
def test_attention_over_fp8_equals_attention_over_its_values(
    monkeypatch: pytest.MonkeyPatch, attention, dtype: torch.dtype, pool_dtype: torch.dtype, batch: str, window: int,
    softcap: float,
) -> None:  # fmt: skip
    """Prefills, decodes, chunks and verify steps, GQA, sliding windows and soft-capping: attention
    over the FP8 pool is bit for bit attention over a model-dtype pool of its read-back values (the
    C kernels read them through their per-head tables, the reference dequantizes). Long prompts go
    to the C prefill kernel here on any CPU kind."""
    monkeypatch.setattr(cpu_attention, "prefill_in_c", lambda: True)
    meta = make_meta("cpu", BATCHES[batch], block_size=5, seed=len(batch))
    scales = _scales()
    k_cache, v_cache = _pools(meta, 2, 32, pool_dtype, scales, seed=4)
    g = torch.Generator().manual_seed(5)
    q = torch.randn(meta.slot_mapping.numel(), 8, 32, generator=g).to(dtype)
    out = attention(q, k_cache, v_cache, meta, 0.17, window, softcap, scales)
    k_read, v_read = dequantize_kv(k_cache, scales.k, dtype), dequantize_kv(v_cache, scales.v, dtype)
    expected = attention(q, k_read, v_read, meta, 0.17, window, softcap)
    assert torch.equal(out, expected)
    if dtype == torch.float32:  # and the C kernel and the reference agree as over float32 pools
        reference = attention_torch(q, k_read, v_read, meta, 0.17, window, softcap)
        torch.testing.assert_close(out, reference, atol=2e-5, rtol=2e-5)


def test_read_back_tables_are_each_heads_scaled_codes() -> None:
    """The C kernel's tables: entry (head, code) is float32(code) * scale[head] rounded to the model
    dtype, for all 256 codes (NaN codes stay NaN)."""
    scales = _scales()
    for pool_dtype in POOL_DTYPES:
        k_table, v_table = scales.tables(pool_dtype, torch.bfloat16)
        codes = torch.arange(256, dtype=torch.uint8).view(pool_dtype)
        for head in range(2):
            expected = dequantize_kv(codes[:, None], scales.k[head : head + 1], torch.bfloat16).float().flatten()
            torch.testing.assert_close(k_table[head], expected, atol=0, rtol=0, equal_nan=True)
        assert v_table.shape == (2, 256) and v_table.dtype == torch.float32
