"""Sliding-window attention and attention-logit soft-capping on the CPU path: the torch reference
against attention written out densely from its definition, the CPU path (C decode kernel + torch
prefills) against the reference, freed blocks before the window never read, and the plain kernel
unchanged when neither is used."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from attention_cases import BATCHES, BLOCK_SIZES, dense_attention, make_meta, pool_slots
from torch_threads import torch_threads

from orca_kernels.attention import AttentionMetadata, attention_torch, first_visible_key
from orca_kernels.cpu_attention import attention_cpu

# Windows shorter than a block, equal to one (16), and longer than most contexts; softcap 5 with q
# scaled up (scores of a few times the cap) so that capping changes the softmax a lot.
WINDOWS = [1, 4, 13, 16, 64]
SOFTCAPS = [0.0, 5.0]
# (query heads, K/V heads): multi-head, grouped (4 query heads per K/V head) and multi-query.
LAYOUTS = {"mha": (4, 4), "group4": (8, 2), "mqa": (4, 1)}
HEAD_DIM = 64
SCALE = HEAD_DIM**-0.5


def _inputs(meta, q_heads: int, kv_heads: int, seed: int, q_gain: float = 1.0, extra_slots: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens, slots = meta.host_lens()[0][-1], pool_slots(meta) + extra_slots
    q = torch.randn(tokens, 3, q_heads, HEAD_DIM, generator=g)[:, 0] * q_gain  # strided, as from a fused qkv
    pool = torch.randn(3, slots, kv_heads, HEAD_DIM, generator=g)
    return q, pool[1], pool[2]  # caches: layers of a multi-layer pool, at a non-zero offset


def _q_gain(softcap: float) -> float:
    return 4.0 if softcap else 1.0  # scores ~ N(0, 16): many beyond the cap of 5


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_reference_matches_dense_attention(batch: str, block_size: int, softcap: float, layout: str) -> None:
    """attention_torch with a window (gather from the window start, the decode matmuls, the masked
    prefill) and softcap against the definition, for every window."""
    meta = make_meta("cpu", BATCHES[batch], block_size=block_size, seed=block_size)
    q_heads, kv_heads = LAYOUTS[layout]
    q, k_cache, v_cache = _inputs(meta, q_heads, kv_heads, seed=block_size + q_heads, q_gain=_q_gain(softcap))
    for window in WINDOWS:
        out = attention_torch(q, k_cache, v_cache, meta, SCALE, window, softcap)
        expected = dense_attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
        torch.testing.assert_close(
            out.double(), expected, atol=1e-5, rtol=1e-5, msg=lambda m, w=window: f"window {w}: {m}"
        )


def test_the_oracle_sees_the_window_and_the_cap() -> None:
    """The oracle itself: with window 1 each query sees only its own key, so its output is that
    key's V row exactly; capping changes the outputs (the q scaling makes it matter)."""
    meta = make_meta("cpu", BATCHES["chunked"], block_size=5)
    q, k_cache, v_cache = _inputs(meta, 8, 2, seed=1, q_gain=4.0)
    own = v_cache[meta.slot_mapping].repeat_interleave(4, dim=1).double()  # each query's own V row
    assert torch.equal(dense_attention(q, k_cache, v_cache, meta, SCALE, 1, 5.0), own)
    assert torch.equal(attention_torch(q, k_cache, v_cache, meta, SCALE, 1, 5.0), own.float())
    capped = dense_attention(q, k_cache, v_cache, meta, SCALE, 0, 5.0)
    assert (capped - dense_attention(q, k_cache, v_cache, meta, SCALE, 0, 0.0)).abs().max() > 0.1


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_cpu_matches_reference(batch: str, block_size: int, softcap: float, layout: str) -> None:
    meta = make_meta("cpu", BATCHES[batch], block_size=block_size, seed=block_size + 1)
    q_heads, kv_heads = LAYOUTS[layout]
    q, k_cache, v_cache = _inputs(
        meta, q_heads, kv_heads, seed=block_size + 2 * q_heads, q_gain=_q_gain(softcap)
    )
    for window in WINDOWS:
        out = attention_cpu(q, k_cache, v_cache, meta, SCALE, window, softcap)
        expected = attention_torch(q, k_cache, v_cache, meta, SCALE, window, softcap)
        torch.testing.assert_close(
            out, expected, atol=1e-5, rtol=1e-5, msg=lambda m, w=window: f"window {w}: {m}"
        )


# Long, uneven decodes (one 1-token context, several block boundaries) beside one chunked prefill.
UNEVEN = [(1, c) for c in (1, 400, 3, 257, 64, 65, 129, 2, 33)] + [(9, 30)]


@pytest.mark.parametrize(("threads", "block_size"), [(1, 16), (2, 5), (3, 1)])
def test_long_decodes_any_thread_count(threads: int, block_size: int) -> None:
    """Windows far shorter than the contexts, spread over the OpenMP threads."""
    meta = make_meta("cpu", UNEVEN, block_size=block_size, seed=threads)
    q, k_cache, v_cache = _inputs(meta, 8, 2, seed=threads, q_gain=4.0)
    cases = [(window, softcap) for window in (1, 13, 100, 1000) for softcap in SOFTCAPS]
    with torch_threads(threads):
        outs = [attention_cpu(q, k_cache, v_cache, meta, SCALE, w, c) for w, c in cases]
    for (window, softcap), out in zip(cases, outs, strict=True):
        expected = attention_torch(q, k_cache, v_cache, meta, SCALE, window, softcap)
        torch.testing.assert_close(
            out,
            expected,
            atol=1e-5,
            rtol=1e-5,
            msg=lambda m, w=window, c=softcap: f"window {w}, softcap {c}: {m}",
        )


def _freed(meta, window: int, freed: int) -> tuple[AttentionMetadata, int]:
    """New metadata (nothing cached from `meta`'s table) whose block tables have every entry wholly
    before its request's first window start (the first query's) set to `freed`, as the scheduler
    leaves them; and how many entries that was."""
    tables = meta.block_tables.clone()
    qs, ctxs = meta.host_lens()
    count = 0
    for i in range(meta.num_requests):
        first = first_visible_key(ctxs[i] - (qs[i + 1] - qs[i]), window) // meta.block_size
        tables[i, :first] = freed
        count += first
    return dataclasses.replace(meta, block_tables=tables), count


@pytest.mark.parametrize("softcap", SOFTCAPS)
@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_freed_blocks_before_the_window_are_never_read(batch: str, block_size: int, softcap: float) -> None:
    """Entries of blocks wholly before the window hold -1, or name a block of NaN K/V: the outputs
    are those of the intact table. Without a window the NaN table does poison the outputs, so a
    kernel that read those entries would fail here."""
    meta = make_meta("cpu", BATCHES[batch], block_size=block_size, seed=block_size)
    q, k_cache, v_cache = _inputs(
        meta, 8, 2, seed=block_size, q_gain=_q_gain(softcap), extra_slots=block_size
    )
    nan_block = pool_slots(meta) // block_size  # the extra block past every one the metadata names
    k_cache[nan_block * block_size :] = float("nan")
    v_cache[nan_block * block_size :] = float("nan")
    for window in (1, 4, 13, 16):
        expected = attention_torch(q, k_cache, v_cache, meta, SCALE, window, softcap)
        ours = attention_cpu(q, k_cache, v_cache, meta, SCALE, window, softcap)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
        for freed in (-1, nan_block):
            freed_meta, count = _freed(meta, window, freed)
            assert count > 0 or batch == "prefill_only"  # (a prefill's first query sees key 0)
            assert torch.equal(
                attention_torch(q, k_cache, v_cache, freed_meta, SCALE, window, softcap), expected
            )
            assert torch.equal(attention_cpu(q, k_cache, v_cache, freed_meta, SCALE, window, softcap), ours)
    # the control: the NaN table without a window
    nan_meta, count = _freed(meta, 4, nan_block)
    assert count > 0 or batch == "prefill_only"
    if count:
        for attention in (attention_cpu, attention_torch):
            assert attention(q, k_cache, v_cache, nan_meta, SCALE, 0, softcap).isnan().any(), (
                attention.__name__
            )


def test_freed_blocks_of_long_decodes() -> None:
    """Most of each long decode's table is -1: the walk starts mid-table, mid-block."""
    meta = make_meta("cpu", UNEVEN, block_size=5, seed=2)
    q, k_cache, v_cache = _inputs(meta, 4, 1, seed=2)
    expected = attention_torch(q, k_cache, v_cache, meta, SCALE, 13, 5.0)
    ours = attention_cpu(q, k_cache, v_cache, meta, SCALE, 13, 5.0)
    freed_meta, count = _freed(meta, 13, -1)
    assert count > 150
    assert torch.equal(attention_cpu(q, k_cache, v_cache, freed_meta, SCALE, 13, 5.0), ours)
    assert torch.equal(attention_torch(q, k_cache, v_cache, freed_meta, SCALE, 13, 5.0), expected)


@pytest.mark.parametrize("batch", list(BATCHES))
def test_no_window_no_cap_is_the_plain_path(batch: str) -> None:
    """window 0 and softcap 0, passed or defaulted, give bitwise what the plain path gives; a window
    covering every context gives the decodes bitwise the same (the kernel's walk and arithmetic
    are those of the plain kernel), its prefills (a masked path, not SDPA) the same to rounding."""
    meta = make_meta("cpu", BATCHES[batch], block_size=5, seed=4)
    q, k_cache, v_cache = _inputs(meta, 8, 2, seed=4)
    plain = attention_cpu(q, k_cache, v_cache, meta, SCALE)
    assert torch.equal(attention_cpu(q, k_cache, v_cache, meta, SCALE, 0, 0.0), plain)
    assert torch.equal(attention_cpu(q, k_cache, v_cache, meta, SCALE, window=0, softcap=0.0), plain)
    assert torch.equal(
        attention_torch(q, k_cache, v_cache, meta, SCALE, 0, 0.0),
        attention_torch(q, k_cache, v_cache, meta, SCALE),
    )
    qs = meta.host_lens()[0]
    decodes = [qs[i] for i in range(meta.num_requests) if qs[i + 1] - qs[i] == 1]
    wide = attention_cpu(q, k_cache, v_cache, meta, SCALE, meta.max_context_len)
    assert torch.equal(wide[decodes], plain[decodes])
    torch.testing.assert_close(wide, plain, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window", [1, 4, 13, 64])
def test_a_windowed_decode_is_the_plain_kernel_over_its_last_keys(window: int) -> None:
    """With one token per block, a decode's window is exactly a plain decode over a table of its
    last `window` entries: bitwise equal, so the window changes which keys are read, nothing else."""
    meta = make_meta("cpu", [(1, c) for c in (1, 400, 3, 64, 65, 13, 2, 33)], block_size=1, seed=5)
    q, k_cache, v_cache = _inputs(meta, 8, 2, seed=window)
    out = attention_cpu(q, k_cache, v_cache, meta, SCALE, window)
    ctxs = meta.host_lens()[1]
    tables = [
        row[max(ctx - window, 0) : ctx] for row, ctx in zip(meta.block_tables.tolist(), ctxs, strict=True)
    ]
    lens = [len(t) for t in tables]
    last_keys = dataclasses.replace(
        meta,
        block_tables=torch.tensor([t + [0] * (max(lens) - len(t)) for t in tables], dtype=torch.int32),
        context_lens=torch.tensor(lens, dtype=torch.int32),
        max_context_len=max(lens),
    )
    assert torch.equal(out, attention_cpu(q, k_cache, v_cache, last_keys, SCALE))


def test_rejects_negative_window_or_softcap() -> None:
    meta = make_meta("cpu", BATCHES["mixed"])
    q, k_cache, v_cache = _inputs(meta, 4, 2, seed=0)
    for attention in (attention_cpu, attention_torch):
        for dtype in (torch.float32, torch.bfloat16):  # bfloat16: attention_cpu delegates to the reference
            args = (q.to(dtype), k_cache.to(dtype), v_cache.to(dtype), meta, SCALE)
            with pytest.raises(ValueError, match="window and softcap must be >= 0"):
                attention(*args, -1)
            with pytest.raises(ValueError, match="window and softcap must be >= 0"):
                attention(*args, 0, -1.0)
            with pytest.raises(ValueError, match="window and softcap must be >= 0"):
                attention(*args, window=4, softcap=-0.5)


def test_other_dtypes_use_the_reference_with_window_and_softcap() -> None:
    meta = make_meta("cpu", BATCHES["mixed"])
    q, k_cache, v_cache = (t.to(torch.float16) for t in _inputs(meta, 4, 2, seed=0, q_gain=4.0))
    out = attention_cpu(q, k_cache, v_cache, meta, SCALE, 13, 5.0)
    assert torch.equal(out, attention_torch(q, k_cache, v_cache, meta, SCALE, 13, 5.0))
