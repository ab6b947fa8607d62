"""The split-K decode attention kernels (``_decode_split_kernel`` + ``_decode_reduce_kernel``) and
the CUDA-graph padding rules (context 0, slot -1) against the torch reference: on the GPU when there
is one, else on CPU through Triton's interpreter (see tests/triton_testing.py).

Every pool slot outside the live contexts holds NaN, so a kernel that reads one K/V slot it should
not (past a context, a padded row's, a split's neighbour's tail) returns NaN instead of passing.
"""

from __future__ import annotations

import pytest
import torch
from attention_cases import decode_meta, make_meta, pool_slots, pools_equal, rope_table, with_padded_rows
from triton_testing import (
    DEVICE,
    TOL,
    assert_close,
    no_host_reads,
    randn,
    test_in_fresh_process,  # noqa: F401 (collected here: reruns this file where this process can't)
    triton_ops,
)

from orca_kernels import AttentionMetadata, KernelOps
from orca_kernels.attention import attention_torch, write_kv_torch
from orca_kernels.dispatch import TORCH_OPS
from orca_kernels.rotary import rotary_torch

# Decode contexts: a single key, one shorter than the interpreter's 4 splits, one BLOCK_N tile
# exactly (the interpreter's 16), and two over several pool blocks and tiles, 37 a multiple of
# neither. With 4 splits of whole 16-key tiles, 40 fills three splits (the last one partly) and
# leaves one empty; every shorter context leaves three empty.
CONTEXTS = [1, 2, 16, 37, 40]
# (query heads, K/V heads): multi-head, a GQA group of 4, multi-query.
LAYOUTS = {"mha": (2, 2), "group4": (8, 2), "mqa": (4, 1)}
HEAD_DIM = 16


def _module():
    """The Triton attention module as `triton_ops` left it (reloaded in this process's mode)."""
    from orca_kernels import triton_attention

    return triton_attention




def _nan_outside_contexts(meta: AttentionMetadata, *caches: torch.Tensor) -> None:
    """Fills every pool slot that no request's context names with NaN, in place."""
    unused = torch.ones(caches[0].shape[0], dtype=torch.bool, device=caches[0].device)
    for i in range(meta.num_requests):
        unused[meta.context_slots(i)] = False
    for cache in caches:
        cache[unused] = float("nan")


def _inputs(
    meta: AttentionMetadata,
    q_heads: int,
    kv_heads: int,
    dtype: torch.dtype,
    seed: int,
    head_dim: int = HEAD_DIM,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q as a strided view of a fused qkv tensor; K/V as one layer of a two-layer pool."""
    g = torch.Generator().manual_seed(seed)
    q = randn(meta.num_requests, 3, q_heads, head_dim, g=g, dtype=dtype)[:, 0]
    pool = randn(2, 2, pool_slots(meta), kv_heads, head_dim, g=g, dtype=dtype)
    k_cache, v_cache = pool[0, 1], pool[1, 1]
    _nan_outside_contexts(meta, k_cache, v_cache)
    return q, k_cache, v_cache


def _check(
    ops: KernelOps,
    meta: AttentionMetadata,
    layout: str,
    dtype: torch.dtype,
    seed: int,
    head_dim: int = HEAD_DIM,
    **kwargs: object,
) -> None:
    q, k_cache, v_cache = _inputs(meta, *LAYOUTS[layout], dtype, seed, head_dim)
    scale = head_dim**-0.5
    out = ops.attention(q, k_cache, v_cache, meta, scale, **kwargs)
    expected = TORCH_OPS.attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert_close(out, expected, dtype)


# --- against the reference ---------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [None, 1, 2, 3, 4])
def test_decode_attention_num_splits(ops: KernelOps, num_splits: int | None) -> None:
    """1: the split kernel normalises and writes out itself (no scratch, no reduce); 3: a split
    count that is not a power of two (the reduce masks its padded splits); None: the default."""
    _check(ops, decode_meta(DEVICE, CONTEXTS, block_size=5), "group4", torch.float32, seed=7, num_splits=num_splits)


# group4 at block size 5 is the num_splits test's.
@pytest.mark.parametrize(("layout", "block_size"), [("mha", 16), ("mha", 5), ("group4", 16), ("mqa", 5)])
def test_decode_attention_layouts(ops: KernelOps, layout: str, block_size: int) -> None:
    _check(ops, decode_meta(DEVICE, CONTEXTS, block_size, seed=block_size), layout, torch.float32, seed=block_size)


@pytest.mark.parametrize(("layout", "block_size"), [("mha", 16), ("mqa", 5)])
def test_decode_attention_bf16(ops: KernelOps, layout: str, block_size: int) -> None:
    _check(ops, decode_meta(DEVICE, CONTEXTS, block_size, seed=3), layout, torch.bfloat16, seed=3, head_dim=32)


@pytest.mark.parametrize(("q_heads", "kv_heads", "max_heads"), [(6, 2, 64), (6, 1, 2)])
def test_decode_attention_padded_and_split_groups(
    ops: KernelOps, monkeypatch: pytest.MonkeyPatch, q_heads: int, kv_heads: int, max_heads: int
) -> None:
    """A group of 3 heads padded to a tile of 4 (the padded rows store nothing), and a group of 6
    split over 3 programs per K/V head (each its own partials); head_dim 24 masks the tile's columns."""
    monkeypatch.setattr(_module(), "_MAX_HEADS", max_heads)
    monkeypatch.setitem(LAYOUTS, "custom", (q_heads, kv_heads))
    _check(ops, decode_meta(DEVICE, CONTEXTS, block_size=5), "custom", torch.float32, seed=q_heads, head_dim=24)


# --- CUDA-graph padding: context 0 and slot -1 --------------------------------------------------




@pytest.mark.parametrize(
    ("dtype", "num_splits"), [(torch.float32, None), (torch.float32, 1), (torch.bfloat16, 3)]
)
def test_decode_padded_rows_are_zero(ops: KernelOps, dtype: torch.dtype, num_splits: int | None) -> None:
    """Padded rows (context 0) come out exactly zero even with a NaN query and read no K/V (their
    table row names NaN slots); the live rows equal the reference on the live rows alone."""
    live = decode_meta(DEVICE, [37, 2, 16], block_size=5)
    meta, places = with_padded_rows(live, pad_after=[0, 2, 2])
    q_live, k_cache, v_cache = _inputs(live, 8, 2, dtype, seed=5)
    q = torch.full((meta.num_requests, 8, HEAD_DIM), float("nan"), dtype=dtype, device=DEVICE)
    q[places] = q_live

    out = ops.attention(q, k_cache, v_cache, meta, 0.25, num_splits=num_splits)

    padded = [i for i in range(meta.num_requests) if i not in places]
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    expected = TORCH_OPS.attention(q_live.float(), k_cache.float(), v_cache.float(), live, 0.25)
    assert_close(out[places], expected, dtype)


@pytest.mark.parametrize("num_splits", [None, 1, 3])
@pytest.mark.parametrize(("layout", "dtype"), [("group4", torch.float32), ("mha", torch.float32), ("mqa", torch.bfloat16)])
def test_fused_write_equals_write_then_attention(ops: KernelOps, layout: str, dtype: torch.dtype, num_splits) -> None:
    """write_kv_attention on a decode batch (one launch fewer: the split kernel writes the new K/V
    and takes the new key from k/v, not the pool) equals write_kv then attention: the same output,
    the same pool. The new tokens' slots hold NaN before the call, so reading one fails the test;
    padded rows (context 0, slot -1) give zeros and write nothing."""
    q_heads, kv_heads = LAYOUTS[layout]
    live = decode_meta(DEVICE, CONTEXTS, block_size=5, seed=4)
    meta, places = with_padded_rows(live, pad_after=[1, 4])
    q_live, k_cache, v_cache = _inputs(live, q_heads, kv_heads, dtype, seed=9)
    g = torch.Generator().manual_seed(10)
    q = torch.zeros((meta.num_requests, q_heads, HEAD_DIM), dtype=dtype, device=DEVICE)
    q[places] = q_live
    qkv = randn(meta.num_requests, 3, kv_heads, HEAD_DIM, g=g, dtype=dtype)  # k and v strided, as the models make them
    k, v = qkv[:, 1], qkv[:, 2]
    new_slots = live.slot_mapping
    k_cache[new_slots], v_cache[new_slots] = float("nan"), float("nan")
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    TORCH_OPS.write_kv(k, v, k_ref, v_ref, meta.slot_mapping)
    expected = TORCH_OPS.attention(q_live.float(), k_ref.float(), v_ref.float(), live, HEAD_DIM**-0.5)

    out = ops.write_kv_attention(q, k, v, k_cache, v_cache, meta, HEAD_DIM**-0.5, num_splits=num_splits)

    assert_close(out[places], expected, dtype)
    padded = [i for i in range(meta.num_requests) if i not in places]
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    torch.testing.assert_close(k_cache, k_ref, atol=0, rtol=0, equal_nan=True)
    torch.testing.assert_close(v_cache, v_ref, atol=0, rtol=0, equal_nan=True)


def test_fused_write_is_one_launch_fewer(ops: KernelOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode batch: the split kernel (and the reduce) and no K/V write kernel; a prefill batch:
    the write kernel, then the ragged kernel."""
    module = _module()
    launched: list[str] = []
    for name in ("_decode_split_kernel", "_decode_reduce_kernel", "_write_kv_kernel", "_attention_kernel"):
        kernel = getattr(module, name)
        monkeypatch.setattr(module, name, _Launches(kernel, name, launched))
    for meta, expected in ((decode_meta(DEVICE, [3, 9], block_size=5), ["_decode_split_kernel", "_decode_reduce_kernel"]),
                           (make_meta(DEVICE, [(3, 3), (1, 6)], block_size=5), ["_write_kv_kernel", "_attention_kernel"])):  # fmt: skip
        launched.clear()
        tokens, g = meta.slot_mapping.numel(), torch.Generator().manual_seed(0)
        q, k, v = (randn(tokens, 2, HEAD_DIM, g=g) for _ in range(3))
        k_cache, v_cache = (randn(pool_slots(meta), 2, HEAD_DIM, g=g) for _ in range(2))
        ops.write_kv_attention(q, k, v, k_cache, v_cache, meta, 0.25, num_splits=2 if tokens == meta.num_requests else None)
        assert launched == expected


class _Launches:
    """A kernel whose launches (kernel[grid](...)) are listed by name."""

    def __init__(self, kernel, name: str, launched: list[str]) -> None:
        self.kernel, self.name, self.launched = kernel, name, launched

    def __getitem__(self, grid):
        self.launched.append(self.name)
        return self.kernel[grid]


# --- rotary fused in too (the Llama family's rotary_write_kv_attention) --------------------------






@pytest.mark.parametrize(
    ("layout", "dtype", "num_splits"),
    [("mha", torch.float32, 3), ("group4", torch.float32, 1), ("mqa", torch.float32, 3),
     ("mha", torch.bfloat16, 1), ("group4", torch.bfloat16, 3), ("mqa", torch.bfloat16, 1)],
)  # fmt: skip
def test_fused_rotary_equals_rotary_then_write_then_attention(
    ops: KernelOps, layout: str, dtype: torch.dtype, num_splits: int
) -> None:
    """rotary_write_kv_attention on a decode batch (one split launch + the reduce: the kernel rotates
    q and the new key, writes the rotated key and v, attends with the rotated q) against
    rotary_torch + write_kv_torch + attention_torch: the output within the dtype's tolerance, and
    the pool and the output bit for bit the unfused Triton path's (rotary_triton, then
    write_kv_attention_triton). The pool equals the torch reference's bit for bit too in fp32 under
    the interpreter; in bf16 the interpreter rounds fp32->bf16 toward zero (torch: to nearest even),
    and a GPU may contract the rotation into FMAs, so there it is within the dtype's tolerance.
    The new tokens' slots hold NaN before the call (reading one fails); padded rows (context 0,
    slot -1, NaN q/k/v) give zeros and write nothing; q, k and v are left untouched."""
    q_heads, kv_heads = LAYOUTS[layout]
    live = decode_meta(DEVICE, CONTEXTS, block_size=5, seed=4)
    meta, places = with_padded_rows(live, pad_after=[1, 4])
    _, k_cache, v_cache = _inputs(live, q_heads, kv_heads, dtype, seed=11)
    k_cache[live.slot_mapping], v_cache[live.slot_mapping] = float("nan"), float("nan")
    # q, k and v: views of one fused qkv projection, as the models make them.
    g = torch.Generator().manual_seed(12)
    qkv = torch.full((meta.num_requests, q_heads + 2 * kv_heads, HEAD_DIM), float("nan"), dtype=dtype, device=DEVICE)
    qkv[places] = randn(live.num_requests, q_heads + 2 * kv_heads, HEAD_DIM, g=g, dtype=dtype)
    q, k, v = qkv.split([q_heads, kv_heads, kv_heads], dim=1)
    # A decode's position is its context length - 1; a padded row's is 0 (as the CUDA-graph runner pads).
    positions = (meta.context_lens.long() - 1).clamp(min=0)
    cos_sin = rope_table(DEVICE, HEAD_DIM, max(CONTEXTS) + 8)
    scale = HEAD_DIM**-0.5
    qkv_before = qkv.clone()

    q_rot, k_rot = rotary_torch(q[places], k[places], positions[places], cos_sin)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_torch(k_rot, v[places], k_ref, v_ref, live.slot_mapping)
    expected = attention_torch(q_rot.float(), k_ref.float(), v_ref.float(), live, scale)
    k_unfused, v_unfused = k_cache.clone(), v_cache.clone()
    unfused = ops.write_kv_attention(
        *ops.rotary(q, k, positions, cos_sin), v, k_unfused, v_unfused, meta, scale, num_splits=num_splits
    )

    out = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale, num_splits=num_splits)

    assert_close(out[places], expected, dtype)
    padded = [i for i in range(meta.num_requests) if i not in places]
    assert torch.equal(out[padded], torch.zeros_like(out[padded]))
    assert torch.equal(out, unfused)
    pools_equal(k_cache, k_unfused)
    pools_equal(v_cache, v_unfused)
    if dtype == torch.float32 and DEVICE == "cpu":
        pools_equal(k_cache, k_ref)
    else:
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(k_cache, k_ref, atol=atol, rtol=rtol, equal_nan=True)
    pools_equal(v_cache, v_ref)
    pools_equal(qkv, qkv_before)


def test_torch_composition_is_rotary_then_write_then_attention() -> None:
    """The torch set's rotary_write_kv_attention is rotary_torch, write_kv_torch, attention_torch."""
    meta = make_meta("cpu", [(3, 3), (1, 6)], block_size=5)
    g = torch.Generator().manual_seed(1)
    q, k, v = torch.randn(3, meta.slot_mapping.numel(), 2, HEAD_DIM, generator=g).unbind(0)
    caches = torch.randn(2, pool_slots(meta), 2, HEAD_DIM, generator=g)
    positions, cos_sin = torch.tensor([0, 1, 2, 5]), rope_table(DEVICE, HEAD_DIM, 8).cpu()
    expected_caches = caches.clone()
    q_rot, k_rot = rotary_torch(q, k, positions, cos_sin)
    write_kv_torch(k_rot, v, *expected_caches, meta.slot_mapping)
    expected = attention_torch(q_rot, *expected_caches, meta, 0.25)

    out = TORCH_OPS.rotary_write_kv_attention(q, k, v, positions, cos_sin, *caches, meta, 0.25)

    assert torch.equal(out, expected) and torch.equal(caches, expected_caches)


def test_fused_rotary_is_one_launch(ops: KernelOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode batch: the split kernel (and the reduce), no rotary kernel and no K/V write kernel;
    a prefill batch: rotary, the K/V write, then the ragged kernel."""
    from orca_kernels import triton_rotary

    module = _module()
    launched: list[str] = []
    for owner, name in ((module, "_decode_split_kernel"), (module, "_decode_reduce_kernel"),
                        (module, "_write_kv_kernel"), (module, "_attention_kernel"), (triton_rotary, "_rotary_kernel")):  # fmt: skip
        monkeypatch.setattr(owner, name, _Launches(getattr(owner, name), name, launched))
    cos_sin = rope_table(DEVICE, HEAD_DIM, 16)
    for meta, expected in ((decode_meta(DEVICE, [3, 9], block_size=5), ["_decode_split_kernel", "_decode_reduce_kernel"]),
                           (make_meta(DEVICE, [(3, 3), (1, 6)], block_size=5),
                            ["_rotary_kernel", "_write_kv_kernel", "_attention_kernel"])):  # fmt: skip
        launched.clear()
        tokens, g = meta.slot_mapping.numel(), torch.Generator().manual_seed(0)
        q, k, v = (randn(tokens, 2, HEAD_DIM, g=g) for _ in range(3))
        k_cache, v_cache = (randn(pool_slots(meta), 2, HEAD_DIM, g=g) for _ in range(2))
        positions = torch.tensor([0, 1, 2, 5] if tokens == 4 else [2, 8], device=DEVICE)
        decode = tokens == meta.num_requests
        ops.rotary_write_kv_attention(
            q, k, v, positions, cos_sin, k_cache, v_cache, meta, 0.25, num_splits=2 if decode else None
        )
        assert launched == expected


def test_ragged_kernel_context_zero_row_is_zero(ops: KernelOps) -> None:
    """The ragged (non-decode) kernel gives a context-0 row zeros too, not 0 / 0."""
    g = torch.Generator().manual_seed(2)
    prefill = make_meta(DEVICE, [(3, 3), (1, 6)], block_size=5)
    meta = AttentionMetadata(
        query_start=torch.tensor([0, 3, 4, 5], dtype=torch.int32, device=DEVICE),
        context_lens=torch.tensor([3, 6, 0], dtype=torch.int32, device=DEVICE),
        block_tables=torch.cat((prefill.block_tables, prefill.block_tables[-1:])),
        slot_mapping=torch.cat((prefill.slot_mapping, torch.tensor([-1], device=DEVICE))),
        block_size=5,
        max_query_len=3,
        max_context_len=6,
        num_requests=3,
    )
    q = randn(5, 2, HEAD_DIM, g=g)
    k_cache, v_cache = (
        randn(pool_slots(prefill), 2, HEAD_DIM, g=g),
        randn(pool_slots(prefill), 2, HEAD_DIM, g=g),
    )

    out = ops.attention(q, k_cache, v_cache, meta, 0.25)

    assert torch.equal(out[4], torch.zeros_like(out[4]))
    assert_close(out[:4], TORCH_OPS.attention(q[:4], k_cache, v_cache, prefill, 0.25), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_negative_slots(ops: KernelOps, dtype: torch.dtype) -> None:
    """Slot -1 writes nothing: not the pool's last slot (as Python indexing would), not the memory
    just before the pool (as the raw pointer arithmetic would), no slot at all; live tokens land."""
    g = torch.Generator().manual_seed(9)
    tokens, slots, heads = 6, 20, 3
    k, v = randn(2, tokens, heads, HEAD_DIM, g=g, dtype=dtype).unbind(0)
    slot_mapping = torch.tensor([4, -1, 19, -1, 0, -1], dtype=torch.int64, device=DEVICE)
    # Each cache is a view one slot into a larger buffer: buffer slot 0 is a guard before the pool.
    buffers = randn(2, slots + 1, heads, HEAD_DIM, g=g, dtype=dtype)
    k_cache, v_cache = buffers[0, 1:], buffers[1, 1:]
    before = buffers.clone()

    ops.write_kv(k, v, k_cache, v_cache, slot_mapping)

    live = slot_mapping >= 0
    expected = before.clone()
    TORCH_OPS.write_kv(k[live], v[live], expected[0, 1:], expected[1, 1:], slot_mapping[live])
    assert torch.equal(buffers, expected)


# --- launch: routing, grid and host reads ------------------------------------------------------


class _GridRecorder:
    """Stands in for a kernel: records each launch's grid and runs the kernel."""

    def __init__(self, kernel: object) -> None:
        self.kernel, self.grids = kernel, []

    def __getitem__(self, grid: tuple[int, ...]):
        self.grids.append(grid)
        return self.kernel[grid]


def test_decode_batches_take_the_split_kernels(ops: KernelOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """A decode-only batch launches split + reduce; a batch with a longer query keeps the ragged kernel."""
    module = _module()
    recorders = {}
    for name in ("_decode_split_kernel", "_decode_reduce_kernel", "_attention_kernel"):
        recorders[name] = _GridRecorder(getattr(module, name))
        monkeypatch.setattr(module, name, recorders[name])
    g = torch.Generator().manual_seed(4)

    decode = decode_meta(DEVICE, [3, 20], block_size=16)
    q, k_cache, v_cache = _inputs(decode, 4, 2, torch.float32, seed=4)
    ops.attention(q, k_cache, v_cache, decode, 0.25, num_splits=2)
    assert recorders["_decode_split_kernel"].grids == [(2, 2, 2)]  # (requests, K/V heads, splits)
    assert recorders["_decode_reduce_kernel"].grids == [(2, 4)]  # (requests, query heads)
    assert recorders["_attention_kernel"].grids == []

    mixed = make_meta(DEVICE, [(2, 2), (1, 5)], block_size=16)
    q = randn(3, 4, HEAD_DIM, g=g)
    k_cache, v_cache = randn(pool_slots(mixed), 2, HEAD_DIM, g=g), randn(pool_slots(mixed), 2, HEAD_DIM, g=g)
    out = ops.attention(q, k_cache, v_cache, mixed, 0.25)
    assert len(recorders["_attention_kernel"].grids) == 1
    assert len(recorders["_decode_split_kernel"].grids) == 1
    assert_close(out, TORCH_OPS.attention(q, k_cache, v_cache, mixed, 0.25), torch.float32)


def test_decode_grid_is_fixed_per_batch_size(ops: KernelOps, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two batches of one size, with different context lengths and max_context_len, launch the same
    grids and allocate the same scratch: what a CUDA graph captured once per batch size needs."""
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

    for contexts in ([1, 2, 3], [40, 17, 64]):
        meta = decode_meta(DEVICE, contexts, block_size=16)
        q, k_cache, v_cache = _inputs(meta, 4, 2, torch.float32, seed=len(shapes))
        with monkeypatch.context() as m:
            m.setattr(torch, "empty", recording_empty)
            ops.attention(q, k_cache, v_cache, meta, 0.25)
    assert split.grids[0] == split.grids[1] and reduce.grids[0] == reduce.grids[1]
    assert shapes[: len(shapes) // 2] == shapes[len(shapes) // 2 :]
    splits = split.grids[0][2]
    assert splits == module.decode_splits(3, 2, torch.device(DEVICE))
    if DEVICE == "cpu":
        assert splits > 1  # the interpreter exercises the reduce


def test_decode_splits_fill_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a (pretend) 132-SM GPU: at least two programs per SM while the batch is small, a power
    of two, at most 16, and 1 once the batch fills the GPU on its own."""
    triton_ops(monkeypatch)
    module = _module()
    monkeypatch.setattr(module, "_sm_count", lambda index: 132)
    gpu = torch.device("cuda", 0)
    assert module.decode_splits(1, 16, gpu) == 16  # GPT-2 medium at batch 1: 256 programs
    assert module.decode_splits(4, 16, gpu) == 8  # 264 / 64 -> 5 -> 8: 512 programs
    assert module.decode_splits(1, 8, gpu) == 16  # capped
    assert module.decode_splits(64, 16, gpu) == 1
    for batch in (1, 2, 3, 5, 8, 13, 16, 17):
        splits = module.decode_splits(batch, 16, gpu)
        assert splits & (splits - 1) == 0 and 1 <= splits <= 16
        assert splits == 16 or batch * 16 * splits >= 2 * 132
    assert module.decode_splits(1, 16, torch.device("cpu")) > 1


@pytest.mark.parametrize("num_splits", [None, 1])
def test_decode_launch_reads_nothing_back_to_the_host(
    ops: KernelOps, monkeypatch: pytest.MonkeyPatch, num_splits: int | None
) -> None:
    """The split-K launch takes each request's context length and key ranges on the device: a host
    read of a tensor (.tolist(), .item(), .cpu(), int(t), bool(t), ...: each a sync on a GPU) fails
    here. The batch has padded rows, as a CUDA graph's bucket has. The same launch with the rotary
    and the K/V write fused in reads each position and cos/sin row on the device too."""
    meta, places = with_padded_rows(decode_meta(DEVICE, [37, 2, 16], block_size=5), pad_after=[1])
    q, k_cache, v_cache = _inputs(meta, 8, 2, torch.float32, seed=13)
    k, v = randn(2, meta.num_requests, 2, HEAD_DIM, g=torch.Generator().manual_seed(14)).unbind(0)
    positions, cos_sin = (meta.context_lens.long() - 1).clamp(min=0), rope_table(DEVICE, HEAD_DIM, 40)
    # Before the guard: the reference reads host values by design, and a warm-up keeps
    # compilation out of the guarded call.
    expected = TORCH_OPS.attention(q, k_cache, v_cache, meta, 0.25)
    ops.attention(q, k_cache, v_cache, meta, 0.25, num_splits=num_splits)
    fused_caches = k_cache.clone(), v_cache.clone()
    fused_expected = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, *fused_caches, meta, 0.25,
                                                   num_splits=num_splits)  # fmt: skip

    with no_host_reads(monkeypatch, "the Triton decode attention launch"):
        out = ops.attention(q, k_cache, v_cache, meta, 0.25, num_splits=num_splits)
        fused = ops.rotary_write_kv_attention(
            q, k, v, positions, cos_sin, *fused_caches, meta, 0.25, num_splits=num_splits
        )

    assert_close(out, expected, torch.float32)
    assert torch.equal(fused, fused_expected)
