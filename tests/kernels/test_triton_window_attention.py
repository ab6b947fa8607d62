"""Sliding-window attention and attention-logit soft-capping in the Triton attention kernels (the
ragged ``_attention_kernel`` and the split-K ``_decode_split_kernel`` with its fused K/V write and
fused rotary) against the torch reference: on the GPU when there is one, else on CPU through
Triton's interpreter (see tests/triton_testing.py).

Every pool slot outside the live contexts holds NaN, and so do the slots just before the pool, so a
kernel that reads a K/V slot it should not (before a window, past a context, a padded row's, a
freed block's, through a -1 table entry) returns NaN instead of passing. The queries and keys are
scaled up so that the soft cap (5.0) changes the scores a lot (test_cases_are_sensitive).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest
import torch
from attention_cases import (
    BATCHES,
    BLOCK_SIZES,
    GQA_HEADS,
    decode_meta,
    make_meta,
    pool_slots,
    pools_equal,
    rope_table,
    with_padded_rows,
)
from triton_testing import (
    DEVICE,
    assert_close,
    no_host_reads,
    randn,
    test_in_fresh_process,  # noqa: F401 (collected here: reruns this file where this process can't)
)

from orca_kernels import AttentionMetadata, KernelOps
from orca_kernels.attention import attention_torch, first_visible_key, write_kv_torch
from orca_kernels.rotary import rotary_torch

HEAD_DIM = 16
SCALE = HEAD_DIM**-0.5
AMPLITUDE = 3.0  # of q and k: scores of several units, well into the cap's bend
CAP = 5.0
# Windows of one key, shorter than a tile, not a divisor of anything, exactly the interpreter's
# key tile (16), and longer than every context (the whole context: no window in effect).
WINDOWS = [1, 4, 13, 16, 64]
# (window, softcap): soft-capping alone, and every window with and without it; a few of them for
# the block sizes other than 5 (the interpreter is slow).
SETTINGS = [(0, CAP)] + [(w, c) for w in WINDOWS for c in (0.0, CAP)]
FEWER_SETTINGS = [(0, CAP), (1, 0.0), (4, CAP), (13, 0.0), (16, CAP), (64, CAP)]
# The slots just before the pool (NaN): what a -1 table entry names, for block sizes up to 16.
GUARD = 16
# Decode contexts: one key, two, one tile exactly, and two over several tiles and pool blocks.
CONTEXTS = [1, 2, 16, 37, 40]


def _module():
    """The Triton attention module as `triton_ops` left it (reloaded in this process's mode)."""
    from orca_kernels import triton_attention

    return triton_attention


# --- inputs ------------------------------------------------------------------------------------


def _pool(meta: AttentionMetadata, kv_heads: int, g: torch.Generator, dtype: torch.dtype, head_dim: int):
    """(k_cache, v_cache): random K/V in every context slot, NaN everywhere else, each a view GUARD
    slots into a buffer whose first GUARD slots hold NaN too (where table entry -1 points)."""
    slots = pool_slots(meta)
    k = randn(GUARD + slots, kv_heads, head_dim, g=g, dtype=dtype) * AMPLITUDE
    v = randn(GUARD + slots, kv_heads, head_dim, g=g, dtype=dtype)
    k_cache, v_cache = k[GUARD:], v[GUARD:]
    unused = torch.ones(slots, dtype=torch.bool, device=k.device)
    for i in range(meta.num_requests):
        unused[meta.context_slots(i)] = False
    for buffer, cache in ((k, k_cache), (v, v_cache)):
        buffer[:GUARD] = float("nan")
        cache[unused] = float("nan")
    return k_cache, v_cache


def _guarded_copy(cache: torch.Tensor) -> torch.Tensor:
    """A copy of a pool from `_pool`, itself GUARD slots into a buffer that starts with NaN ones."""
    buffer = torch.full(
        (GUARD + cache.shape[0], *cache.shape[1:]), float("nan"), dtype=cache.dtype, device=DEVICE
    )
    buffer[GUARD:] = cache
    return buffer[GUARD:]


def _inputs(
    meta: AttentionMetadata,
    q_heads: int = 4,
    kv_heads: int = 2,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (a strided view of a fused qkv tensor, as the models make it) and the pool."""
    g = torch.Generator().manual_seed(seed)
    q = (randn(meta.slot_mapping.numel(), 3, q_heads, head_dim, g=g, dtype=dtype) * AMPLITUDE)[:, 0]
    return (q, *_pool(meta, kv_heads, g, dtype, head_dim))


def _reference(q, k_cache, v_cache, meta, window: int, softcap: float) -> torch.Tensor:
    return attention_torch(q.float(), k_cache.float(), v_cache.float(), meta, SCALE, window, softcap)






def _padded_q(q_live: torch.Tensor, meta: AttentionMetadata, places: list[int]) -> torch.Tensor:
    """The live queries at their places; NaN in the padded rows, which must still give zeros."""
    q = torch.full((meta.num_requests, *q_live.shape[1:]), float("nan"), dtype=q_live.dtype, device=DEVICE)
    q[places] = q_live
    return q


def _assert_padded_rows_zero(out: torch.Tensor, places: list[int]) -> None:
    padded = [i for i in range(out.shape[0]) if i not in places]
    assert padded and torch.equal(out[padded], torch.zeros_like(out[padded]))






def test_cases_are_sensitive() -> None:
    """The inputs make each setting matter: the cap, and each window shorter than a context, change
    the reference's output well past the tolerance, so a kernel that ignored one would fail."""
    meta = make_meta(DEVICE, BATCHES["mixed"], block_size=5)
    q, k_cache, v_cache = _inputs(meta)
    plain = _reference(q, k_cache, v_cache, meta, 0, 0.0)
    for window, softcap in SETTINGS:
        if window < meta.max_context_len:
            assert (_reference(q, k_cache, v_cache, meta, window, softcap) - plain).abs().max() > 0.1


# --- the ragged kernel -------------------------------------------------------------------------


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("batch", list(BATCHES))
def test_windows_and_softcap(ops: KernelOps, batch: str, block_size: int) -> None:
    """Each batch of attention_cases (decode_only takes the split-K path, the others the ragged
    kernel) at each pool block size, under every window, with and without the cap (block size 5:
    every setting; 1 and 16: some)."""
    meta = make_meta(DEVICE, BATCHES[batch], block_size=block_size, seed=block_size)
    q, k_cache, v_cache = _inputs(meta, seed=block_size)
    for window, softcap in SETTINGS if block_size == 5 else FEWER_SETTINGS:
        out = ops.attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
        expected = _reference(q, k_cache, v_cache, meta, window, softcap)
        assert_close(out, expected, torch.float32)


@pytest.mark.parametrize(("block_m", "block_n"), [(1, 16), (4, 16), (32, 16), (8, 32)])
def test_ragged_tilings(ops: KernelOps, block_m: int, block_n: int) -> None:
    """Other query and key tiles: query blocks wider than a key tile (rows whose window starts past
    the first tiles), of one query, and key tiles wider than the window, so that the lower-edge,
    all-visible and upper-edge ranges of a program take every shape. The chunk of 37 queries fills
    a 32-query block: its last rows see no key of the block's first key tiles (window 4 or 13)."""
    meta = make_meta(DEVICE, [(7, 40), (37, 48), (12, 12), (1, 33)], block_size=5, seed=1)
    q, k_cache, v_cache = _inputs(meta, seed=block_m)
    for window, softcap in [(4, 0.0), (13, CAP), (20, 0.0), (40, CAP)]:
        out = ops.attention(
            q, k_cache, v_cache, meta, SCALE, window, softcap, block_m=block_m, block_n=block_n
        )
        assert_close(out, _reference(q, k_cache, v_cache, meta, window, softcap), torch.float32)


@pytest.mark.parametrize("layout", list(GQA_HEADS))
@pytest.mark.parametrize("batch", ["mixed", "decode_only"])
def test_gqa_layouts(ops: KernelOps, batch: str, layout: str) -> None:
    """Multi-head, GQA groups of 2 and 4 and multi-query, through the ragged and the split kernels."""
    meta = make_meta(DEVICE, BATCHES[batch], block_size=5, seed=2)
    q, k_cache, v_cache = _inputs(meta, *GQA_HEADS[layout], seed=3)
    for window, softcap in [(13, CAP), (4, 0.0)]:
        out = ops.attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
        assert_close(out, _reference(q, k_cache, v_cache, meta, window, softcap), torch.float32)


@pytest.mark.parametrize("batch", ["chunked", "decode_only"])
def test_bf16(ops: KernelOps, batch: str) -> None:
    """bf16 inputs against the fp32 reference on the same rounded values."""
    meta = make_meta(DEVICE, BATCHES[batch], block_size=16, seed=4)
    q, k_cache, v_cache = _inputs(meta, 4, 1, torch.bfloat16, seed=4, head_dim=32)
    for window, softcap in [(13, CAP), (16, 0.0)]:
        out = ops.attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
        assert_close(out, _reference(q, k_cache, v_cache, meta, window, softcap), torch.bfloat16)


def test_ragged_context_zero_row_is_zero(ops: KernelOps) -> None:
    """A context-0 row in a ragged batch still reads nothing and gives zeros under a window."""
    prefill = make_meta(DEVICE, [(6, 6), (1, 9)], block_size=5)
    meta = AttentionMetadata(
        query_start=torch.tensor([0, 6, 7, 8], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([6, 9, 0], dtype=torch.int32, device=DEVICE),
        block_tables=torch.cat((prefill.block_tables, torch.full_like(prefill.block_tables[-1:], -1))),
        slot_mapping=torch.cat((prefill.slot_mapping, torch.tensor([-1], device=DEVICE))),
        block_size=5,
        max_query_len=6,
        max_context_len=9,
        num_requests=3,
    )
    q, k_cache, v_cache = _inputs(prefill, seed=5)
    q = torch.cat((q, torch.full_like(q[:1], float("nan"))))

    out = ops.attention(q, k_cache, v_cache, meta, SCALE, 4, CAP)

    assert torch.equal(out[7], torch.zeros_like(out[7]))
    assert_close(out[:7], _reference(q[:7], k_cache, v_cache, prefill, 4, CAP), torch.float32)


# --- the split-K decode kernel -----------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 2, 3, 4])
def test_decode_splits(ops: KernelOps, num_splits: int) -> None:
    """The split kernel cuts the window's span, not the context, into its splits: 1 (normalised in
    the kernel), 3 (not a power of two), and windows shorter and longer than a split or the
    context. Padded rows (context 0, NaN query) give zeros."""
    live = decode_meta(DEVICE, CONTEXTS, block_size=5, seed=num_splits)
    meta, places = with_padded_rows(live, pad_after=[0, 4])
    q_live, k_cache, v_cache = _inputs(live, 8, 2, seed=num_splits)
    q = _padded_q(q_live, meta, places)
    for window, softcap in [(1, 0.0), (5, CAP), (16, 0.0), (20, CAP), (64, 0.0)]:
        out = ops.attention(q, k_cache, v_cache, meta, SCALE, window, softcap, num_splits=num_splits)
        _assert_padded_rows_zero(out, places)
        assert_close(out[places], _reference(q_live, k_cache, v_cache, live, window, softcap), torch.float32)


@pytest.mark.parametrize(
    ("layout", "dtype", "num_splits"),
    [("group4", torch.float32, 3), ("mqa", torch.float32, 1), ("mha", torch.bfloat16, 2)],
)
def test_fused_write(ops: KernelOps, layout: str, dtype: torch.dtype, num_splits: int) -> None:
    """write_kv_attention on a decode batch (the split kernel writes this step's K/V and takes the
    new key, whose score is capped too, from k/v) against write_kv_torch + attention_torch: the same
    output and pool. The new tokens' slots hold NaN before the call; padded rows give zeros."""
    q_heads, kv_heads = GQA_HEADS[layout]
    live = decode_meta(DEVICE, CONTEXTS, block_size=5, seed=6)
    meta, places = with_padded_rows(live, pad_after=[1, 4])
    q_live, k_cache, v_cache = _inputs(live, q_heads, kv_heads, dtype, seed=6)
    q = _padded_q(q_live, meta, places)
    g = torch.Generator().manual_seed(7)
    qkv = randn(meta.num_requests, 3, kv_heads, HEAD_DIM, g=g, dtype=dtype)
    qkv[:, 1] *= AMPLITUDE
    k, v = qkv[:, 1], qkv[:, 2]  # strided views, as the models make them
    k_cache[live.slot_mapping], v_cache[live.slot_mapping] = float("nan"), float("nan")
    for window, softcap in [(1, CAP), (13, 0.0), (20, CAP)]:
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv_torch(k[places], v[places], k_ref, v_ref, live.slot_mapping)
        expected = _reference(q_live, k_ref, v_ref, live, window, softcap)
        k_out, v_out = _guarded_copy(k_cache), _guarded_copy(v_cache)

        out = ops.write_kv_attention(
            q, k, v, k_out, v_out, meta, SCALE, window, softcap, num_splits=num_splits
        )

        assert_close(out[places], expected, dtype)
        _assert_padded_rows_zero(out, places)
        pools_equal(k_out, k_ref)
        pools_equal(v_out, v_ref)


@pytest.mark.parametrize(
    ("layout", "dtype", "num_splits"),
    [("group4", torch.float32, 3), ("mha", torch.float32, 1), ("mqa", torch.bfloat16, 4)],
)
def test_fused_rotary(ops: KernelOps, layout: str, dtype: torch.dtype, num_splits: int) -> None:
    """rotary_write_kv_attention on a decode batch (rotary, K/V write and windowed, capped attention
    in one split launch) against rotary_torch + write_kv_torch + attention_torch, and bit for bit
    the unfused Triton path's output and pool (rotary_triton, then write_kv_attention_triton)."""
    q_heads, kv_heads = GQA_HEADS[layout]
    live = decode_meta(DEVICE, CONTEXTS, block_size=5, seed=8)
    meta, places = with_padded_rows(live, pad_after=[0, 2])
    _, k_cache, v_cache = _inputs(live, q_heads, kv_heads, dtype, seed=8)
    k_cache[live.slot_mapping], v_cache[live.slot_mapping] = float("nan"), float("nan")
    g = torch.Generator().manual_seed(9)
    qkv = torch.full(
        (meta.num_requests, q_heads + 2 * kv_heads, HEAD_DIM), float("nan"), dtype=dtype, device=DEVICE
    )
    qkv[places] = randn(live.num_requests, q_heads + 2 * kv_heads, HEAD_DIM, g=g, dtype=dtype)
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)
    if dtype == torch.float32:
        # Not in bf16: the interpreter rounds the rotated q and k toward zero where rotary_torch
        # rounds to nearest (see triton_testing.py), and scaled-up scores would magnify that ulp
        # past bf16's tolerance. The fp32 cases and test_fused_write cover the cap in earnest.
        qkv[:, : q_heads + kv_heads] *= AMPLITUDE
    positions = (meta.context_lens.long() - 1).clamp(min=0)
    cos_sin = rope_table(DEVICE, HEAD_DIM, max(CONTEXTS) + 8)
    for window, softcap in [(4, CAP), (20, 0.0), (64, CAP)]:
        q_rot, k_rot = rotary_torch(q[places], k[places], positions[places], cos_sin)
        k_ref, v_ref = k_cache.clone(), v_cache.clone()
        write_kv_torch(k_rot, v[places], k_ref, v_ref, live.slot_mapping)
        expected = _reference(q_rot, k_ref, v_ref, live, window, softcap)
        k_unfused, v_unfused = _guarded_copy(k_cache), _guarded_copy(v_cache)
        # fmt: off
        unfused = ops.write_kv_attention(*ops.rotary(q, k, positions, cos_sin), v, k_unfused, v_unfused, meta,
                                         SCALE, window, softcap, num_splits=num_splits)
        k_out, v_out = _guarded_copy(k_cache), _guarded_copy(v_cache)

        out = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, k_out, v_out, meta, SCALE, window,
                                            softcap, num_splits=num_splits)
        # fmt: on

        assert_close(out[places], expected, dtype)
        _assert_padded_rows_zero(out, places)
        assert torch.equal(out, unfused)
        pools_equal(k_out, k_unfused)
        pools_equal(v_out, v_unfused)
        pools_equal(v_out, v_ref)


# --- freed blocks: table entries before every window are never read ----------------------------


def _free_before_windows(meta: AttentionMetadata, window: int, entry: int) -> AttentionMetadata:
    """The metadata with every table entry wholly before its request's first window start (the
    first query's) replaced by `entry`, as the scheduler frees those blocks: -1, or a block of NaN."""
    query_start, context_lens = meta.host_lens()
    tables = meta.block_tables.clone()
    freed = 0
    for i, ctx in enumerate(context_lens):
        n = query_start[i + 1] - query_start[i]
        blocks = first_visible_key(ctx - n, window) // meta.block_size
        tables[i, :blocks] = entry
        freed += blocks
    assert freed, "nothing to free: the case tests nothing"
    return dataclasses.replace(meta, block_tables=tables)


_FREED_CASES = {
    # (path, requests, block size, window)
    "ragged_chunked": ("attention", BATCHES["chunked"], 5, 13),
    "ragged_mixed": ("attention", BATCHES["mixed"], 1, 4),
    "decode": ("attention", [(1, c) for c in CONTEXTS], 5, 5),
    "fused_write": ("write_kv_attention", [(1, c) for c in CONTEXTS], 5, 16),
    "fused_rotary": ("rotary_write_kv_attention", [(1, c) for c in CONTEXTS], 16, 4),
}


def _run_path(ops: KernelOps, path: str, q, k_cache, v_cache, meta, window: int, softcap: float):
    """ops.<path> on a copy of the pool (NaN guard slots included): (output, k pool, v pool). The
    fused paths take this step's new key and value (a decode's last context token) from the pool's
    own values, rotated ones at zero angle (position 0 of an all-0-angle table), so that one
    reference serves every path."""
    k_cache, v_cache = _guarded_copy(k_cache), _guarded_copy(v_cache)
    if path == "attention":
        return (
            ops.attention(q, k_cache, v_cache, meta, SCALE, window, softcap, num_splits=3),
            k_cache,
            v_cache,
        )
    k, v = k_cache[meta.slot_mapping], v_cache[meta.slot_mapping]
    if path == "write_kv_attention":
        out = ops.write_kv_attention(q, k, v, k_cache, v_cache, meta, SCALE, window, softcap, num_splits=3)
        return out, k_cache, v_cache
    positions = torch.zeros(meta.num_requests, dtype=torch.int64, device=DEVICE)
    cos_sin = torch.cat((torch.ones(1, HEAD_DIM // 2), torch.zeros(1, HEAD_DIM // 2)), dim=-1).to(DEVICE)
    # fmt: off
    out = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, SCALE, window,
                                        softcap, num_splits=3)
    # fmt: on
    return out, k_cache, v_cache


@pytest.mark.parametrize("entry", ["minus_one", "nan_block"])
@pytest.mark.parametrize("case", list(_FREED_CASES))
def test_freed_blocks_are_never_read(ops: KernelOps, case: str, entry: str) -> None:
    """Table entries wholly before a request's first window start hold -1 (pointing into the NaN
    slots before the pool) or name a NaN-filled block: a windowed launch gives the reference's
    output on the intact table, with and without the cap, through each path. The same tables
    without the window give NaN: the test sees a read of a freed entry."""
    path, requests, block_size, window = _FREED_CASES[case]
    intact = make_meta(DEVICE, requests, block_size=block_size, seed=10)
    q, k_cache, v_cache = _inputs(intact, seed=10)
    # Block 0 is never used (make_meta uses the odd blocks): NaN throughout.
    freed = _free_before_windows(intact, window, -1 if entry == "minus_one" else 0)
    for softcap in (0.0, CAP):
        expected = _reference(q, k_cache, v_cache, intact, window, softcap)

        out, k_out, v_out = _run_path(ops, path, q, k_cache, v_cache, freed, window, softcap)

        assert_close(out, expected, torch.float32)
        pools_equal(k_out, k_cache)  # the fused paths rewrite the new tokens' own values
        pools_equal(v_out, v_cache)
    with warnings.catch_warnings():  # the interpreter's numpy warns of the NaN it computes with
        warnings.simplefilter("ignore", RuntimeWarning)
        unwindowed, _, _ = _run_path(ops, path, q, k_cache, v_cache, freed, 0, 0.0)
    assert unwindowed.isnan().any()


# --- launches: arguments, grid and host reads --------------------------------------------------


def test_invalid_window_or_softcap_raises(ops: KernelOps) -> None:
    meta = decode_meta(DEVICE, [3, 9], block_size=5)
    q, k_cache, v_cache = _inputs(meta)
    before = k_cache.clone()
    for window, softcap in [(-1, 0.0), (0, -1.0)]:
        with pytest.raises(ValueError, match="window and softcap"):
            ops.attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
        with pytest.raises(ValueError, match="window and softcap"):
            ops.write_kv_attention(q, q[:, :2], q[:, :2], k_cache, v_cache, meta, SCALE, window, softcap)
    pools_equal(k_cache, before)


class _GridRecorder:
    """Stands in for a kernel: records each launch's grid and runs the kernel."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple[int, ...]):
        self.grids.append(grid)
        return self.kernel[grid]


def test_decode_grid_ignores_window(ops: KernelOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode batches of one size launch the same grids (splits included) and allocate the same
    scratch whatever their contexts, window and cap: one CUDA graph per batch size replays them all."""
    module = _module()
    split = _GridRecorder(module._decode_split_kernel)
    reduce = _GridRecorder(module._decode_reduce_kernel)
    monkeypatch.setattr(module, "_decode_split_kernel", split)
    monkeypatch.setattr(module, "_decode_reduce_kernel", reduce)
    shapes = []
    empty = torch.empty

    def recording_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        shapes.append(tuple(t.shape))
        return t

    runs = [([1, 2, 3], 0, 0.0), ([40, 17, 64], 4, CAP), ([40, 17, 64], 64, 0.0), ([5, 33, 2], 16, CAP)]
    for contexts, window, softcap in runs:
        meta = decode_meta(DEVICE, contexts, block_size=16)
        q, k_cache, v_cache = _inputs(meta, seed=len(split.grids))
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", recording_empty)
            ops.attention(q, k_cache, v_cache, meta, SCALE, window, softcap)
    assert len(set(split.grids)) == 1 and len(set(reduce.grids)) == 1 and len(split.grids) == len(runs)
    per_run = len(shapes) // len(runs)
    assert all(shapes[i * per_run : (i + 1) * per_run] == shapes[:per_run] for i in range(len(runs)))
    assert split.grids[0][2] == module.decode_splits(3, 2, torch.device(DEVICE))


def test_windowed_launches_read_nothing_back_to_the_host(
    ops: KernelOps, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window and the cap are plain numbers, the window's key ranges computed on the device: a
    host read of a tensor fails here, in the ragged launch and in the fused rotary decode launch
    (with padded rows, as a CUDA graph's bucket has)."""
    ragged = make_meta(DEVICE, BATCHES["chunked"], block_size=5)
    q_ragged, k_ragged, v_ragged = _inputs(ragged, seed=11)
    decode, places = with_padded_rows(decode_meta(DEVICE, [37, 2, 16], block_size=5), pad_after=[1])
    q, k_cache, v_cache = _inputs(decode, seed=12)
    k, v = randn(2, decode.num_requests, 2, HEAD_DIM, g=torch.Generator().manual_seed(13)).unbind(0)
    positions, cos_sin = (decode.context_lens.long() - 1).clamp(min=0), rope_table(DEVICE, HEAD_DIM, 40)
    # Before the guard: the reference reads host values by design, and a warm-up keeps
    # compilation out of the guarded call.
    expected = _reference(q_ragged, k_ragged, v_ragged, ragged, 13, CAP)
    ops.attention(q_ragged, k_ragged, v_ragged, ragged, SCALE, 13, CAP)
    caches = _guarded_copy(k_cache), _guarded_copy(v_cache)
    fused_expected = ops.rotary_write_kv_attention(
        q, k, v, positions, cos_sin, *caches, decode, SCALE, 4, CAP
    )

    with no_host_reads(monkeypatch, "a windowed, soft-capped Triton attention launch"):
        out = ops.attention(q_ragged, k_ragged, v_ragged, ragged, SCALE, 13, CAP)
        fused = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, *caches, decode, SCALE, 4, CAP)

    assert_close(out, expected, torch.float32)
    assert torch.equal(fused, fused_expected)


def test_defaults_are_no_window_no_cap(ops: KernelOps) -> None:
    """window=0 and softcap=0 passed explicitly are the defaults: bit for bit the same output."""
    for batch in ("mixed", "decode_only"):
        meta = make_meta(DEVICE, BATCHES[batch], block_size=5)
        q, k_cache, v_cache = _inputs(meta, seed=14)
        out = ops.attention(q, k_cache, v_cache, meta, SCALE)
        assert torch.equal(ops.attention(q, k_cache, v_cache, meta, SCALE, 0, 0.0), out)
        assert_close(out, _reference(q, k_cache, v_cache, meta, 0, 0.0), torch.float32)
