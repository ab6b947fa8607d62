"""The CPU attention path (C decode kernel + SDPA prefills) against the torch reference, the torch
reference against attention written out densely from its definition, both over paged K/V, and how
dispatch chooses the CPU path."""

from __future__ import annotations

import logging
import random
import subprocess

import pytest
import torch
from attention_cases import BATCHES, BLOCK_SIZES, dense_attention, make_meta, pool_slots, with_padding_request
from torch_threads import torch_threads

from orca_kernels import cpu_attention, cpu_gpt2_ops, cpu_llama_ops, dispatch, get_ops, native
from orca_kernels.attention import attention_torch, write_kv_torch
from orca_kernels.cpu_attention import SHORT_QUERIES, attention_cpu, load_decode_kernel, write_kv_cpu


def _inputs(meta, heads: int, head_dim: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tokens, slots = meta.host_lens()[0][-1], pool_slots(meta)
    q = torch.randn(tokens, 3, heads, head_dim, generator=g).to(dtype)[:, 0]  # strided, as from a fused qkv
    pool = torch.randn(2, 2, slots, heads, head_dim, generator=g).to(dtype)
    return q, pool[0, 1], pool[1, 1]  # caches: one layer of a multi-layer pool


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(3, 3), (8, 2), (4, 1)])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_reference_matches_dense_attention(batch: str, q_heads: int, kv_heads: int, block_size: int) -> None:
    """attention_torch (block-table gather, SDPA, batched decode matmuls) against the definition."""
    meta = make_meta("cpu", BATCHES[batch], block_size=block_size, seed=block_size)
    q, k_cache, v_cache = _gqa_inputs(meta, q_heads, kv_heads, 64, seed=block_size + q_heads)
    out = attention_torch(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(
        out.double(), dense_attention(q, k_cache, v_cache, meta, 0.125), atol=1e-5, rtol=1e-5
    )


def test_context_slots_follow_the_table_and_are_cached() -> None:
    meta = make_meta("cpu", BATCHES["mixed"], block_size=5)
    for i, (ctx, table) in enumerate(zip(meta.host_lens()[1], meta.block_tables.tolist(), strict=True)):
        slots = meta.context_slots(i)
        assert slots.dtype == torch.int64
        assert slots.tolist() == [table[j // 5] * 5 + j % 5 for j in range(ctx)]
        assert meta.context_slots(i) is slots  # built once per metadata object, for every layer
    assert meta.host_lens() is meta.host_lens()  # one device->host read per metadata object


@pytest.mark.parametrize("block_size", BLOCK_SIZES)
@pytest.mark.parametrize("heads", [1, 3, 12])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_reference(batch: str, head_dim: int, heads: int, block_size: int) -> None:
    meta = make_meta("cpu", BATCHES[batch], block_size=block_size)
    q, k_cache, v_cache = _inputs(meta, heads, head_dim, seed=head_dim + heads)
    scale = head_dim**-0.5
    out = attention_cpu(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, attention_torch(q, k_cache, v_cache, meta, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("threads", "block_size"), [(1, 16), (2, 5), (3, 1)])
def test_many_decodes_any_thread_count(threads: int, block_size: int) -> None:
    """Long, uneven contexts spread over the OpenMP threads; each thread has its own scratch row."""
    rng = random.Random(threads)
    requests = [(1, rng.randint(1, 700)) for _ in range(40)] + [(9, 30)]
    meta = make_meta("cpu", requests, block_size=block_size, seed=threads)
    q, k_cache, v_cache = _inputs(meta, 4, 64, seed=threads)
    with torch_threads(threads):
        out = attention_cpu(q, k_cache, v_cache, meta, 0.125)
    torch.testing.assert_close(out, attention_torch(q, k_cache, v_cache, meta, 0.125), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_score_does_not_depend_on_the_block_size(dtype: torch.dtype) -> None:
    """The same contexts paged in blocks of 3, 8, 16 and 32 slots: each key sits at another place in
    the kernel's tiles, and every output is the same bits."""
    contexts, q_heads, kv_heads, head_dim = [37, 64, 100, 150, 9], 6, 2, 64
    g = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(sum(contexts), kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(len(contexts), q_heads, head_dim, generator=g).to(dtype)
    outs = []
    for block_size in (3, 8, 16, 32):
        meta = make_meta("cpu", [(1, ctx) for ctx in contexts], block_size=block_size)
        slots = [int(meta.block_tables[r, j // block_size]) * block_size + j % block_size
                 for r, ctx in enumerate(contexts) for j in range(ctx)]  # fmt: skip
        k_cache, v_cache = (torch.randn(pool_slots(meta), kv_heads, head_dim, generator=g).to(dtype) for _ in range(2))
        k_cache[slots], v_cache[slots] = keys, values
        outs.append(attention_cpu(q, k_cache, v_cache, meta, 0.125))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("requests", [[(1, 300)], [(1, 40), (1, 1), (3, 90)]])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(12, 12), (8, 2), (3, 1)])
def test_few_decodes_split_their_heads_over_the_threads(threads, requests, q_heads, kv_heads) -> None:
    """Fewer query tokens than 4 a thread (a batch-1 decode): each token's K/V heads are tasks of
    their own, on several threads at once, and every head's output is still its own (in bfloat16
    too: equal to float32 rounded once)."""
    meta = make_meta("cpu", requests, block_size=16, seed=threads)
    q, k_cache, v_cache = _gqa_inputs(meta, q_heads, kv_heads, 64, seed=q_heads)
    with torch_threads(threads):
        out = attention_cpu(q, k_cache, v_cache, meta, 0.125)
        low = attention_cpu(q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16(), meta, 0.125)
        wide = attention_cpu(q.bfloat16().float(), k_cache.bfloat16().float(), v_cache.bfloat16().float(), meta, 0.125)
    torch.testing.assert_close(out, _gqa_reference(q, k_cache, v_cache, meta, 0.125), atol=1e-5, rtol=1e-5)
    assert torch.equal(low, wide.bfloat16())


# (query heads, K/V heads): group sizes 1, 2, 4 and 8, and multi-query (one K/V head) at 8 and 3.
GQA_LAYOUTS = [(4, 4), (8, 4), (8, 2), (16, 2), (8, 1), (3, 1)]
# Uneven contexts: the shared mixed and decode-only batches, and long decodes with one prefill.
GQA_BATCHES = {
    "mixed": BATCHES["mixed"],
    "decode_only": BATCHES["decode_only"],
    "chunked": BATCHES["chunked"],
    "uneven_decodes": [(1, c) for c in (1, 400, 3, 257, 64, 65, 129, 2, 33)] + [(9, 30)],
}


def _gqa_inputs(meta, q_heads: int, kv_heads: int, head_dim: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    tokens, slots = meta.host_lens()[0][-1], pool_slots(meta)
    q = torch.randn(tokens, 3, q_heads, head_dim, generator=g)[:, 0]  # strided, as from a fused qkv
    pool = torch.randn(3, slots, kv_heads, head_dim, generator=g)
    return q, pool[1], pool[2]  # caches: layers of a multi-layer pool, at a non-zero offset


def _gqa_reference(q, k_cache, v_cache, meta, scale: float) -> torch.Tensor:
    """GQA by definition: query head h attends with K/V head h // group, i.e. multi-head attention
    over K/V repeated `group` times per head (materialised here, never in the kernel)."""
    group = q.shape[1] // k_cache.shape[1]
    k_rep, v_rep = k_cache.repeat_interleave(group, dim=1), v_cache.repeat_interleave(group, dim=1)
    return attention_torch(q, k_rep, v_rep, meta, scale)


@pytest.mark.parametrize("block_size", [1, 12, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), GQA_LAYOUTS)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("batch", list(GQA_BATCHES))
def test_gqa_matches_reference(
    batch: str, head_dim: int, q_heads: int, kv_heads: int, block_size: int
) -> None:
    meta = make_meta("cpu", GQA_BATCHES[batch], block_size=block_size, seed=3)
    seed = head_dim + 31 * q_heads + kv_heads
    q, k_cache, v_cache = _gqa_inputs(meta, q_heads, kv_heads, head_dim, seed)
    scale = head_dim**-0.5
    out = attention_cpu(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, _gqa_reference(q, k_cache, v_cache, meta, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_gqa_any_thread_count(threads: int) -> None:
    """Every group size over long, uneven contexts spread over the OpenMP threads."""
    meta = make_meta("cpu", GQA_BATCHES["uneven_decodes"], block_size=12, seed=threads)
    cases = []
    for q_heads, kv_heads in GQA_LAYOUTS:
        for head_dim in (64, 128):
            q, k_cache, v_cache = _gqa_inputs(meta, q_heads, kv_heads, head_dim, seed=threads + q_heads)
            expected = _gqa_reference(q, k_cache, v_cache, meta, head_dim**-0.5)
            cases.append(((q_heads, kv_heads, head_dim), q, k_cache, v_cache, expected))
    with torch_threads(threads):
        outs = [attention_cpu(q, k, v, meta, case[2] ** -0.5) for case, q, k, v, _ in cases]
    for (case, *_, expected), out in zip(cases, outs, strict=True):
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5, msg=lambda m, c=case: f"{c}: {m}")


@pytest.mark.parametrize(("q_heads", "kv_heads"), [(8, 2), (8, 1)])
def test_gqa_decodes_equal_multi_head_over_repeated_kv(q_heads: int, kv_heads: int) -> None:
    """Sharing a K/V row across a group changes no arithmetic: bit-identical to the multi-head
    kernel fed K/V repeated per query head."""
    meta = make_meta("cpu", GQA_BATCHES["uneven_decodes"], block_size=5)
    q, k_cache, v_cache = _gqa_inputs(meta, q_heads, kv_heads, 64, seed=q_heads + kv_heads)
    group = q_heads // kv_heads
    k_rep, v_rep = k_cache.repeat_interleave(group, dim=1), v_cache.repeat_interleave(group, dim=1)
    qs = meta.host_lens()[0]
    decodes = [qs[i] for i in range(meta.num_requests) if qs[i + 1] - qs[i] == 1]
    out = attention_cpu(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out[decodes], attention_cpu(q, k_rep, v_rep, meta, 0.125)[decodes])


def test_rejects_query_heads_not_a_multiple_of_kv_heads() -> None:
    meta = make_meta("cpu", BATCHES["decode_only"])
    q, k_cache, v_cache = _gqa_inputs(meta, 6, 4, 64, seed=0)
    with pytest.raises(ValueError, match=r"query heads \(6\) to be a multiple of the K/V heads \(4\)"):
        attention_cpu(q, k_cache, v_cache, meta, 0.125)
    with pytest.raises(ValueError, match="k_cache and v_cache of one shape"):
        attention_cpu(q, k_cache, v_cache[:, :2], meta, 0.125)


def test_other_dtypes_use_the_reference() -> None:
    meta = make_meta("cpu", BATCHES["mixed"])
    q, k_cache, v_cache = _inputs(meta, 2, 64, seed=0, dtype=torch.float16)
    out = attention_cpu(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out, attention_torch(q, k_cache, v_cache, meta, 0.125))


@pytest.mark.parametrize("batch", list(BATCHES))
@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (5, 0.0), (0, 20.0)])
def test_bfloat16_equals_float32_on_the_same_values(batch, heads, kv_heads, window, softcap) -> None:
    """In bfloat16 the kernel widens q and K/V to float32 as it reads them, attends in float32 and
    rounds its output once: it equals the float32 kernel on the same (bfloat16-valued) inputs,
    rounded to bfloat16, bit for bit."""
    meta = make_meta("cpu", BATCHES[batch])
    q, k_cache, v_cache = _gqa_inputs(meta, heads, kv_heads, 24, seed=3)
    q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
    out = attention_cpu(q, k_cache, v_cache, meta, 0.2, window, softcap)
    assert out.dtype == torch.bfloat16
    wide = attention_cpu(q.float(), k_cache.float(), v_cache.float(), meta, 0.2, window, softcap)
    short = meta.host_lens()[0]
    decode_rows = torch.cat([torch.arange(short[i], short[i + 1]) for i in range(meta.num_requests)
                             if short[i + 1] - short[i] <= SHORT_QUERIES])  # fmt: skip
    # the decode kernel's rows (the C prefill kernel's are checked below; SDPA computes bfloat16 its own way)
    assert torch.equal(out[decode_rows], wide[decode_rows].bfloat16())


# Prompts and chunks of more than SHORT_QUERIES queries, for the prefill kernel's tiles (48 queries
# with AVX-512, 16 with AVX2): a chunk of 40 over 35 earlier keys, starting mid-block; a 100-token
# prompt (tiles ending mid-way); a 33-query chunk beside a decode.
LONG_PROMPTS = [(40, 75), (1, 20), (100, 100), (33, 120)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [5, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads", "head_dim"), [(3, 3, 64), (8, 2, 80), (4, 1, 20)])
@pytest.mark.parametrize(("window", "softcap"), [(0, 0.0), (24, 0.0), (0, 30.0)])
def test_the_prefill_kernel_matches_reference(
    monkeypatch: pytest.MonkeyPatch, dtype, block_size, q_heads, kv_heads, head_dim, window, softcap
) -> None:  # fmt: skip
    """The C prefill kernel (every request of more than SHORT_QUERIES queries; forced, as on an
    AVX-512 machine) against the torch reference over K/V repeated per query head: each query sees
    its own causal prefix (or window), GQA reads its K/V head, head_dim need not fill the vector
    lanes; in bfloat16 it equals the float32 kernel on the same values, rounded once."""
    monkeypatch.setattr(cpu_attention, "prefill_in_c", lambda: True)
    meta = make_meta("cpu", LONG_PROMPTS, block_size=block_size, seed=block_size)
    q, k_cache, v_cache = _gqa_inputs(meta, q_heads, kv_heads, head_dim, seed=head_dim)
    scale = head_dim**-0.5
    group = q_heads // kv_heads
    k_rep, v_rep = k_cache.repeat_interleave(group, dim=1), v_cache.repeat_interleave(group, dim=1)
    if dtype == torch.float32:
        out = attention_cpu(q, k_cache, v_cache, meta, scale, window, softcap)
        expected = attention_torch(q, k_rep, v_rep, meta, scale, window, softcap)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    else:
        q, k_cache, v_cache = q.bfloat16(), k_cache.bfloat16(), v_cache.bfloat16()
        out = attention_cpu(q, k_cache, v_cache, meta, scale, window, softcap)
        wide = attention_cpu(q.float(), k_cache.float(), v_cache.float(), meta, scale, window, softcap)
        assert torch.equal(out, wide.bfloat16())


def test_rejects_index_tensors_of_the_wrong_type() -> None:
    meta = make_meta("cpu", BATCHES["decode_only"])
    q, k_cache, v_cache = _inputs(meta, 2, 64, seed=0)
    tables = meta.block_tables
    for wrong in (tables.long(), torch.cat([tables, tables], dim=1)[:, ::2]):  # int64; not contiguous
        meta.block_tables = wrong
        with pytest.raises(ValueError, match="contiguous int32 query_start, context_lens and block_tables"):
            attention_cpu(q, k_cache, v_cache, meta, 0.125)


def test_rejects_block_tables_too_narrow_for_the_context() -> None:
    """The C kernel reads ceil(context / block_size) entries of a row: a narrower table is an error."""
    meta = make_meta("cpu", BATCHES["decode_only"], block_size=16)  # longest context 40: 3 blocks
    q, k_cache, v_cache = _inputs(meta, 2, 64, seed=0)
    meta.block_tables = meta.block_tables[:, :2].contiguous()
    with pytest.raises(
        ValueError, match=r"block_tables \[requests, >= ceil\(max_context_len / block_size\)\]"
    ):
        attention_cpu(q, k_cache, v_cache, meta, 0.125)


def test_auto_uses_the_c_kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_KERNELS", raising=False)
    ops = get_ops("cpu")
    assert ops.name == "cpu" and ops.attention is attention_cpu  # the decode-attention kernel has no torch order
    monkeypatch.setenv("ORCA_KERNELS", "torch")
    assert get_ops("cpu") is dispatch.TORCH_OPS


@pytest.fixture
def no_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A machine without a usable C compiler and nothing built yet."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    native.load.cache_clear()
    load_decode_kernel.cache_clear()
    yield
    native.load.cache_clear()
    load_decode_kernel.cache_clear()


def test_forced_cpu_without_compiler_is_an_error(no_compiler: None) -> None:
    with pytest.raises(RuntimeError, match="ORCA_KERNELS=cpu.*no-such-cc"):
        get_ops("cpu", "cpu")


def test_auto_without_compiler_logs_and_uses_the_reference(
    no_compiler: None, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="orca.kernels"):
        assert get_ops("cpu", "auto") is dispatch.TORCH_OPS
    assert "decode-attention kernel is unavailable" in caplog.text


def test_compile_errors_are_reported(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    (tmp_path / "broken.c").write_text("this is not C\n")
    monkeypatch.setattr(native, "CSRC", tmp_path)
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(native.NativeBuildError, match="building broken.c"):
        native.load("broken")
    assert not list((tmp_path / "cache").glob("*.so"))  # no half-built library left behind


def test_a_cached_library_without_its_build_key_is_rebuilt_never_loaded(
    monkeypatch: pytest.MonkeyPatch, tmp_path, caplog: pytest.LogCaptureFixture
) -> None:
    """A file at the cache path that was not built from this source (stale, damaged, or planted by
    another user of a shared cache) is not loaded: its code never runs, and it is rebuilt."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ORCA_CACHE_DIR", str(cache))
    native.load.cache_clear()
    try:
        native.load("decode_gemm")
        (cached,) = cache.glob("decode_gemm-*.so")
        marker = tmp_path / "planted-code-ran"
        planted = tmp_path / "planted.c"
        planted.write_text('#include <stdio.h>\n__attribute__((constructor)) static void run(void) '
                           f'{{ FILE *f = fopen("{marker}", "w"); if (f) fclose(f); }}\n')  # fmt: skip
        subprocess.run(["cc", "-shared", "-fPIC", str(planted), "-o", str(cached)], check=True)
        native.load.cache_clear()
        with caplog.at_level(logging.WARNING, logger="orca.kernels"):
            library = native.load("decode_gemm")
        assert "does not carry the build key of its source; rebuilding it" in caplog.text
        assert not marker.exists()  # the planted library was never loaded
        assert hasattr(library, "orca_build_key") and b"orca-build-key:" in cached.read_bytes()
    finally:
        native.load.cache_clear()


# The element-wise libraries, in the order dispatch loads them after the decode-attention kernel:
# what the warning calls each, its source, the loader dispatch calls and the kernels it declares.
ELEMENTWISE_LIBRARIES = {
    "llama": (cpu_llama_ops, "Llama element-wise", "llama_ops.c", "load_llama_kernels",
              ("load_add_rmsnorm_kernel", "load_rotary_kernel", "load_silu_and_mul_kernel")),
    "gpt2": (cpu_gpt2_ops, "GPT-2 element-wise", "gpt2_ops.c", "load_gpt2_kernels",
             ("load_add_layernorm_kernel", "load_bias_gelu_kernel")),
}  # fmt: skip


@pytest.fixture(params=list(ELEMENTWISE_LIBRARIES))
def library_that_fails(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> tuple[str, str]:
    """Every kernel dispatch loads before this library builds; this one does not (a compile error, say)."""
    load_decode_kernel()
    for name, (module, label, source, load_all, _) in ELEMENTWISE_LIBRARIES.items():
        if name != request.param:
            getattr(module, load_all)()
            continue

        def fail(source: str = source) -> None:
            raise native.NativeBuildError(f"building {source} with cc failed: boom")

        monkeypatch.setattr(module, load_all, fail)
        return label, source
    raise AssertionError(request.param)


def test_forced_cpu_without_an_elementwise_library_is_an_error(library_that_fails: tuple[str, str]) -> None:
    _, source = library_that_fails
    with pytest.raises(RuntimeError, match=f"ORCA_KERNELS=cpu: building {source}"):
        get_ops("cpu", "cpu")


def test_auto_without_an_elementwise_library_logs_once_and_uses_the_references(
    library_that_fails: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    label, source = library_that_fails
    with caplog.at_level(logging.WARNING, logger="orca.kernels"):
        assert get_ops("cpu", "auto") is dispatch.TORCH_OPS
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert f"{label} kernel is unavailable (building {source} with cc failed: boom)" in caplog.text


@pytest.mark.parametrize("name", list(ELEMENTWISE_LIBRARIES))
def test_without_a_compiler_the_elementwise_kernels_fail_to_load(
    name: str, monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    module, _, _, load_all, kernel_loaders = ELEMENTWISE_LIBRARIES[name]
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    monkeypatch.setenv("ORCA_CACHE_DIR", str(tmp_path / "cache"))
    loaders = (native.load, *(getattr(module, n) for n in kernel_loaders))
    for loader in loaders:
        loader.cache_clear()
    try:
        with pytest.raises(OSError, match="no-such-cc"):
            getattr(module, load_all)()
    finally:
        for loader in loaders:
            loader.cache_clear()


@pytest.mark.parametrize("write_kv", [write_kv_cpu, write_kv_torch], ids=["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_skips_padded_slots(write_kv, dtype: torch.dtype) -> None:
    """Each token's K/V lands in its slot and nowhere else; a slot of -1 (a padded row of a CUDA-graph
    bucket) writes nothing. k and v are strided views of a fused projection, as the models make them."""
    g = torch.Generator().manual_seed(1)
    tokens, slots, heads, head_dim = 6, 40, 3, 8
    qkv = torch.randn(tokens, 3, heads, head_dim, generator=g).to(dtype)
    k, v = qkv[:, 1], qkv[:, 2]
    slot_mapping = torch.randperm(slots, generator=g)[:tokens]
    slot_mapping[[0, 3]] = -1
    k_cache, v_cache = (torch.randn(slots, heads, head_dim, generator=g).to(dtype) for _ in range(2))
    k_before, v_before = k_cache.clone(), v_cache.clone()
    write_kv(k, v, k_cache, v_cache, slot_mapping)
    live = torch.tensor([1, 2, 4, 5])
    untouched = torch.ones(slots, dtype=torch.bool)
    untouched[slot_mapping[live]] = False
    assert torch.equal(k_cache[slot_mapping[live]], k[live]) and torch.equal(v_cache[slot_mapping[live]], v[live])
    assert torch.equal(k_cache[untouched], k_before[untouched]) and torch.equal(v_cache[untouched], v_before[untouched])


@pytest.mark.parametrize("attention", [attention_cpu, attention_torch])
def test_a_mixed_buckets_padding_request_gives_zeros(attention) -> None:
    """A mixed CUDA graph's bucket (worker/cuda_graphs.py): a padding request of context 0 with several
    NaN queries, then requests of no token, beside the live batch: zeros for the padding tokens, the
    live batch's own output for the live ones."""
    live = make_meta("cpu", BATCHES["mixed"])
    meta = with_padding_request(live, pad_tokens=6, empty=2)
    q_live, k_cache, v_cache = _inputs(live, 2, 64, seed=1)
    q = torch.cat([q_live, torch.full((6, *q_live.shape[1:]), float("nan"))])
    out = attention(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out[len(q_live):], torch.zeros_like(out[len(q_live):]))
    assert torch.equal(out[: len(q_live)], attention(q_live, k_cache, v_cache, live, 0.125))


def test_a_row_without_context_gives_zeros() -> None:
    """A padded row of a CUDA-graph bucket (context 0) reads no K/V and gives zeros, beside live rows
    that give the reference's output."""
    meta = make_meta("cpu", BATCHES["decode_only"])
    q, k_cache, v_cache = _inputs(meta, 2, 64, seed=0)
    live = attention_cpu(q, k_cache, v_cache, meta, 0.125)
    meta.context_lens = meta.context_lens.clone()
    meta.context_lens[1] = 0
    out = attention_cpu(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    others = [i for i in range(meta.num_requests) if i != 1]
    assert torch.equal(out[others], live[others])
