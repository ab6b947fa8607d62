"""Triton kernels against their torch references: on the GPU when there is one, else on CPU
through Triton's interpreter (how this process gets into the right mode, and the tolerances, are
in tests/triton_testing.py).
"""

from __future__ import annotations

import logging

import pytest
import torch
from attention_cases import BATCHES, make_meta, pool_slots, with_padding_request
from triton_testing import (
    DEVICE,
    INTERPRET_ENV,
    INTERPRETED,
    assert_close,
    no_host_reads,
    randn,
    test_in_fresh_process,  # noqa: F401 (collected here: reruns this file where this process can't)
)

from orca_kernels import KernelOps, dispatch, get_ops
from orca_kernels.dispatch import TORCH_OPS

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# --- add + LayerNorm ---------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [50, 96, 200, 768])
@pytest.mark.parametrize("with_residual", [True, False])
def test_add_layernorm(ops: KernelOps, dtype: torch.dtype, hidden: int, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = (randn(3, hidden, g=g) * 2 + 1).to(dtype)  # a non-zero mean exercises the centring
    residual = randn(3, hidden, g=g, dtype=dtype) if with_residual else None
    weight, bias = randn(hidden, g=g, dtype=dtype), randn(hidden, g=g, dtype=dtype)

    out, new_res = ops.add_layernorm(x, residual, weight, bias, 1e-5)

    # fp32 reference over the same rounded sum that the kernel normalises.
    ref_res = x if residual is None else x + residual
    ref_out, _ = TORCH_OPS.add_layernorm(ref_res.float(), None, weight.float(), bias.float(), 1e-5)
    assert_close(new_res, ref_res, dtype)
    assert_close(out, ref_out, dtype)
    if residual is None:
        assert new_res is x  # same contract as the reference: no copy


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [50, 200])
def test_add_layernorm_wide_rows(ops: KernelOps, dtype: torch.dtype, hidden: int) -> None:
    """Rows wider than the block take the looped three-pass path; max_block=32 forces it."""
    g = torch.Generator().manual_seed(7)
    x = (randn(2, hidden, g=g) + 3).to(dtype)
    residual = randn(2, hidden, g=g, dtype=dtype)
    weight, bias = randn(hidden, g=g, dtype=dtype), randn(hidden, g=g, dtype=dtype)

    out, new_res = ops.add_layernorm(x, residual, weight, bias, 1e-5, max_block=32)

    ref_out, ref_res = TORCH_OPS.add_layernorm(
        x.float(), residual.float(), weight.float(), bias.float(), 1e-5
    )
    assert_close(new_res, ref_res, dtype)
    assert_close(out, ref_out, dtype)


def test_add_layernorm_strided_rows(ops: KernelOps) -> None:
    """Rows of a wider tensor (row stride != hidden) are read in place."""
    g = torch.Generator().manual_seed(3)
    base = randn(4, 160, g=g)
    x, residual = base[:, :96], base[:, 64:]
    weight, bias = randn(96, g=g), randn(96, g=g)
    out, new_res = ops.add_layernorm(x, residual, weight, bias, 1e-6)
    ref_out, ref_res = TORCH_OPS.add_layernorm(x, residual, weight, bias, 1e-6)
    assert_close(new_res, ref_res, torch.float32)
    assert_close(out, ref_out, torch.float32)


# --- bias + GeLU -------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("inner", [50, 200, 3072])
def test_bias_gelu(ops: KernelOps, dtype: torch.dtype, inner: int) -> None:
    g = torch.Generator().manual_seed(inner)
    x = randn(3, inner, g=g) * 4
    x[0, :4] = torch.tensor([-30.0, -9.0, 9.0, 30.0])  # the saturated tails of the tanh
    x = x.to(dtype)
    bias = randn(inner, g=g, dtype=dtype)

    out = ops.bias_gelu(x, bias)

    # fp32 math over the same rounded sum.
    expected = TORCH_OPS.bias_gelu((x + bias).float(), torch.zeros(inner, device=DEVICE))
    assert_close(out, expected, dtype)
    assert torch.isfinite(out.float()).all()


# --- write_kv ----------------------------------------------------------------------------------


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "head_dim"), [(3, 80), (2, 64), (40, 128)])  # 40x128: 2 head blocks
def test_write_kv(ops: KernelOps, dtype: torch.dtype, heads: int, head_dim: int, padded: bool) -> None:
    """Each token's K/V lands in its slot and nowhere else; a slot of -1 (a padded row of a CUDA-graph
    bucket) writes nothing."""
    g = torch.Generator().manual_seed(heads)
    tokens, slots = 5, 32
    # k and v as strided views of a fused qkv projection, as the model produces them.
    qkv = randn(tokens, 3, heads, head_dim, g=g, dtype=dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.randperm(slots, generator=g)[:tokens].to(DEVICE)
    if padded:
        slot_mapping[[1, 4]] = -1
    k_cache = randn(slots, heads, head_dim, g=g, dtype=dtype)
    v_cache = randn(slots, heads, head_dim, g=g, dtype=dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()

    ops.write_kv(k, v, k_cache, v_cache, slot_mapping)

    live = (slot_mapping >= 0).nonzero().flatten()
    written = slot_mapping[live]
    untouched = torch.ones(slots, dtype=torch.bool, device=DEVICE)
    untouched[written] = False
    assert torch.equal(k_cache[written], k[live]) and torch.equal(v_cache[written], v[live])
    assert torch.equal(k_cache[untouched], k_before[untouched]) and torch.equal(v_cache[untouched], v_before[untouched])


# --- attention ---------------------------------------------------------------------------------

def _attention_check(ops: KernelOps, meta, heads: int, head_dim: int, dtype: torch.dtype, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    tokens, slots = meta.host_lens()[0][-1], pool_slots(meta)
    # q as a strided view of a fused qkv tensor; the caches as one layer of a multi-layer pool.
    q = randn(tokens, 3, heads, head_dim, g=g, dtype=dtype)[:, 0]
    pool = randn(2, 2, slots, heads, head_dim, g=g, dtype=dtype)
    k_cache, v_cache = pool[0, 1], pool[1, 1]
    scale = head_dim**-0.5

    out = ops.attention(q, k_cache, v_cache, meta, scale)

    expected = TORCH_OPS.attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_attention(ops: KernelOps, batch: str, head_dim: int, dtype: torch.dtype) -> None:
    _attention_check(ops, make_meta(DEVICE, BATCHES[batch]), 2, head_dim, dtype, seed=head_dim)


@pytest.mark.parametrize("window", [0, 8])
@pytest.mark.parametrize("batch", ["mixed", "chunked"])
def test_a_mixed_buckets_padding_gives_zeros_and_leaves_the_live_tokens_alone(ops: KernelOps, batch: str, window: int) -> None:
    """A mixed CUDA graph's bucket (worker/cuda_graphs.py): the live batch, then a padding request of
    context 0 with 19 tokens (more than a query tile: its programs start before any key) and NaN
    queries, then requests of no token, all under the bucket's integers. The padding tokens come out
    exactly zero and read no K/V (their table row names a NaN block); the live tokens equal the
    reference on the live batch alone."""
    live = make_meta(DEVICE, BATCHES[batch], block_size=5, seed=3)
    meta = with_padding_request(live, pad_tokens=19, empty=2)
    g = torch.Generator().manual_seed(4)
    tokens, live_tokens, slots = int(meta.query_start[-1]), int(live.query_start[-1]), pool_slots(live)
    q = torch.full((tokens, 2, 64), float("nan"), device=DEVICE)
    q[:live_tokens] = randn(live_tokens, 2, 64, g=g)
    k_cache, v_cache = randn(slots, 2, 64, g=g), randn(slots, 2, 64, g=g)
    pad_block = int(meta.block_tables.max())
    k_cache[pad_block * 5 : (pad_block + 1) * 5] = float("nan")
    v_cache[pad_block * 5 : (pad_block + 1) * 5] = float("nan")

    out = ops.attention(q, k_cache, v_cache, meta, 0.125, window)

    assert torch.equal(out[live_tokens:], torch.zeros_like(out[live_tokens:]))
    expected = TORCH_OPS.attention(q[:live_tokens], k_cache, v_cache, live, 0.125, window)
    assert_close(out[:live_tokens], expected, torch.float32)


# Pool block sizes against the interpreter's 16-key tiles: one token per block, blocks that do not
# divide the tile (5, 12), one that is a tile, and blocks spanning several tiles (64). The dtype
# and head_dim matrix above runs at the default 16 only: the interpreter is slow.
@pytest.mark.parametrize("block_size", [1, 5, 12, 16, 64])
@pytest.mark.parametrize("batch", ["mixed", "chunked"])
def test_attention_paged(ops: KernelOps, batch: str, block_size: int) -> None:
    meta = make_meta(DEVICE, BATCHES[batch], block_size=block_size, seed=block_size)
    _attention_check(ops, meta, 2, 80, torch.float32, seed=block_size)


@pytest.mark.parametrize("block_size", [1, 5])
def test_attention_paged_bf16(ops: KernelOps, block_size: int) -> None:
    meta = make_meta(DEVICE, BATCHES["mixed"], block_size=block_size, seed=block_size)
    _attention_check(ops, meta, 2, 64, torch.bfloat16, seed=block_size)


@pytest.mark.parametrize(("block_m", "block_n", "block_size"), [(32, 16, 12), (16, 32, 5), (64, 64, 16)])
def test_attention_block_sizes(ops: KernelOps, block_m: int, block_n: int, block_size: int) -> None:
    """Other tilings move the causal edge and the unmasked/masked split of the key loop, and the
    pool blocks' edges within the key tiles."""
    meta = make_meta(DEVICE, BATCHES["mixed"], block_size=block_size)
    g = torch.Generator().manual_seed(block_m + block_n)
    heads, head_dim, tokens, slots = 2, 64, meta.host_lens()[0][-1], pool_slots(meta)
    q = randn(tokens, heads, head_dim, g=g)
    k_cache, v_cache = randn(slots, heads, head_dim, g=g), randn(slots, heads, head_dim, g=g)

    out = ops.attention(q, k_cache, v_cache, meta, 0.125, block_m=block_m, block_n=block_n)

    assert_close(out, TORCH_OPS.attention(q, k_cache, v_cache, meta, 0.125), torch.float32)


@pytest.mark.parametrize("block_size", [5, 16])
def test_write_then_attend(ops: KernelOps, block_size: int) -> None:
    """One model step: scatter this step's K/V by slot_mapping, then attend over the pool."""
    meta = make_meta(DEVICE, BATCHES["mixed"], block_size=block_size)
    g = torch.Generator().manual_seed(11)
    heads, head_dim, tokens, slots = 3, 80, meta.host_lens()[0][-1], pool_slots(meta)
    q, k, v = randn(3, tokens, heads, head_dim, g=g).unbind(0)
    caches = randn(2, slots, heads, head_dim, g=g)
    k_cache, v_cache = caches.clone().unbind(0)
    k_ref, v_ref = caches.clone().unbind(0)

    ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = ops.attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    TORCH_OPS.write_kv(k, v, k_ref, v_ref, meta.slot_mapping)
    expected = TORCH_OPS.attention(q, k_ref, v_ref, meta, head_dim**-0.5)

    assert_close(out, expected, torch.float32)


@pytest.mark.parametrize("block_m", [4, 16])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_query_block_table_covers_every_query_once(ops: KernelOps, batch: str, block_m: int) -> None:
    from orca_kernels.triton_attention import _query_block_table, _query_grid

    meta = make_meta(DEVICE, BATCHES[batch])
    sizes = [n for n, _ in BATCHES[batch]]
    num_programs = _query_grid(len(sizes), sum(sizes), max(sizes), block_m)
    table = _query_block_table(meta, block_m, num_programs).cpu()
    assert table.dtype == torch.int32 and table.shape == (2, num_programs)
    covered = sorted(
        (req, m0 + j) for req, m0 in table.t().tolist() for j in range(block_m) if m0 + j < sizes[req]
    )
    assert covered == [(i, t) for i, n in enumerate(sizes) for t in range(n)]
    # The grid is an upper bound on the blocks; the spare programs, which start past their
    # request's queries, come after every real block.
    real = [m0 < sizes[req] for req, m0 in table.t().tolist()]
    assert sum(real) == sum(-(-n // block_m) for n in sizes)
    assert real == sorted(real, reverse=True)


@pytest.mark.parametrize(("batch", "block_m"), [("mixed", None), ("chunked", 4), ("decode_only", None)])
def test_attention_launch_reads_nothing_back_to_the_host(
    ops: KernelOps, monkeypatch: pytest.MonkeyPatch, batch: str, block_m: int | None
) -> None:
    """The Triton launch builds its query-block table on the device and sizes its grid from plain
    integers, so that a step can be captured as a CUDA graph: a host read of a tensor (.tolist(),
    .item(), .cpu(), int(t), ...: each a sync on a GPU) fails here. The chunked batch at
    block_m=4 also launches spare programs (the grid is an upper bound on the query blocks)."""
    g = torch.Generator().manual_seed(17)
    meta = make_meta(DEVICE, BATCHES[batch], block_size=5)
    heads, head_dim, tokens, slots = 2, 64, meta.host_lens()[0][-1], pool_slots(meta)
    q = randn(tokens, heads, head_dim, g=g)
    k_cache, v_cache = randn(slots, heads, head_dim, g=g), randn(slots, heads, head_dim, g=g)
    # Before the guard: the reference reads host values by design. The warm-up (its own metadata,
    # so the guarded call still builds the table) keeps compilation out of the guarded call.
    expected = TORCH_OPS.attention(q, k_cache, v_cache, meta, 0.125)
    warm_meta = make_meta(DEVICE, BATCHES[batch], block_size=5)
    ops.attention(q, k_cache, v_cache, warm_meta, 0.125, block_m=block_m)

    with no_host_reads(monkeypatch, "the Triton attention launch"):
        out = ops.attention(q, k_cache, v_cache, meta, 0.125, block_m=block_m)

    assert_close(out, expected, torch.float32)


# --- dispatch ----------------------------------------------------------------------------------


def test_dispatch_env_selects_triton(triton_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ORCA_KERNELS", "triton")
    assert get_ops(DEVICE).name == "triton"


def test_dispatch_auto_uses_triton_on_cuda(triton_env: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Building the ops needs no GPU; only launching them does.
    monkeypatch.delenv("ORCA_KERNELS", raising=False)
    assert get_ops("cuda").name == "triton"


def test_dispatch_rejects_interpreter_switched_after_import(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(INTERPRET_ENV, "0" if INTERPRETED else "1")
    with pytest.raises(RuntimeError, match="first imported"):
        get_ops("cuda", "triton")


def test_dispatch_forced_triton_on_cpu_without_interpreter_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(INTERPRET_ENV, raising=False)
    with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
        get_ops("cpu", "triton")


def test_dispatch_rejects_unknown_choice() -> None:
    with pytest.raises(ValueError, match="ORCA_KERNELS"):
        get_ops("cpu", "cutlass")


def test_dispatch_logs_once(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setattr(dispatch, "_logged", set())
    with caplog.at_level(logging.INFO, logger="orca.kernels"):
        get_ops("cpu", "torch")
        get_ops("cpu", "torch")
    assert [r.getMessage() for r in caplog.records] == ["orca kernels: using torch implementations on cpu"]
