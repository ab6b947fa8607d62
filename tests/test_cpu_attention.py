"""The CPU attention path (C decode kernel + SDPA prefills) against the torch reference, and how
dispatch chooses it."""

from __future__ import annotations

import logging
import random

import pytest
import torch
from attention_cases import BATCHES, make_meta, pool_slots

from orca_kernels import dispatch, get_ops, native
from orca_kernels.attention import attention_torch
from orca_kernels.cpu_attention import attention_cpu, load_decode_kernel


def _inputs(meta, heads: int, head_dim: int, seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    tokens, slots = meta.query_start_host[-1], pool_slots(meta)
    q = torch.randn(tokens, 3, heads, head_dim, generator=g).to(dtype)[:, 0]  # strided, as from a fused qkv
    pool = torch.randn(2, 2, slots, heads, head_dim, generator=g).to(dtype)
    return q, pool[0, 1], pool[1, 1]  # caches: one layer of a multi-layer pool


@pytest.mark.parametrize("heads", [1, 3, 12])
@pytest.mark.parametrize("head_dim", [64, 80, 128])
@pytest.mark.parametrize("batch", list(BATCHES))
def test_matches_reference(batch: str, head_dim: int, heads: int) -> None:
    meta = make_meta("cpu", BATCHES[batch])
    q, k_cache, v_cache = _inputs(meta, heads, head_dim, seed=head_dim + heads)
    scale = head_dim**-0.5
    out = attention_cpu(q, k_cache, v_cache, meta, scale)
    torch.testing.assert_close(out, attention_torch(q, k_cache, v_cache, meta, scale), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_many_decodes_any_thread_count(threads: int) -> None:
    """Long, uneven contexts spread over the OpenMP threads; each thread has its own scratch row."""
    rng = random.Random(threads)
    requests = [(1, rng.randint(1, 700)) for _ in range(40)] + [(9, 30)]
    meta = make_meta("cpu", requests, gap=3)
    q, k_cache, v_cache = _inputs(meta, 4, 64, seed=threads)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = attention_cpu(q, k_cache, v_cache, meta, 0.125)
    finally:
        torch.set_num_threads(before)
    torch.testing.assert_close(out, attention_torch(q, k_cache, v_cache, meta, 0.125), atol=1e-5, rtol=1e-5)


def test_other_dtypes_use_the_reference() -> None:
    meta = make_meta("cpu", BATCHES["mixed"])
    q, k_cache, v_cache = _inputs(meta, 2, 64, seed=0, dtype=torch.bfloat16)
    out = attention_cpu(q, k_cache, v_cache, meta, 0.125)
    assert torch.equal(out, attention_torch(q, k_cache, v_cache, meta, 0.125))


def test_rejects_index_tensors_of_the_wrong_type() -> None:
    meta = make_meta("cpu", BATCHES["decode_only"])
    meta.kv_starts = meta.kv_starts.long()
    q, k_cache, v_cache = _inputs(meta, 2, 64, seed=0)
    with pytest.raises(ValueError, match="int32"):
        attention_cpu(q, k_cache, v_cache, meta, 0.125)


def test_auto_uses_the_c_kernel_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("ORCA_KERNELS", raising=False)
    assert get_ops("cpu") is dispatch.CPU_OPS
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
