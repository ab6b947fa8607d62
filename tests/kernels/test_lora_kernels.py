"""The multi-LoRA kernels: the torch reference against its definition (each token's adapter run
alone), and the Triton shrink/expand against the reference under TRITON_INTERPRET=1 (on the GPU
when there is one), for ranks 8, 16 and 64 (and 192, a fused projection's three slices of 64, tiled), a slot with no token, tokens with no adapter, and
without reading anything back to the host."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from triton_testing import DEVICE, NEEDS_FRESH_PROCESS, no_host_reads, run_in_fresh_process, use_import_mode

from orca_kernels.lora import lora_metadata, lora_torch


def stack(slots: int, rank: int, k: int, n: int, g: torch.Generator, dtype: torch.dtype = torch.float32):
    """Stacked weights whose slot s has rank rank - 2 s (the rest zero padding, as loaded adapters are)."""
    a, b = torch.zeros(slots, rank, k), torch.zeros(slots, n, rank)
    for s in range(slots):
        r = max(rank - 2 * s, 1)
        a[s, :r] = torch.randn(r, k, generator=g) * 0.3
        b[s, :, :r] = torch.randn(n, r, generator=g) * 0.3
    return a.to(dtype), b.to(dtype)


def per_token(y, x, a, b, token_slots):  # noqa: ANN001, ANN201
    out = y.clone().double()
    for t, s in enumerate(token_slots):
        if s >= 0:
            out[t] += b[s].double() @ (a[s].double() @ x[t].double())
    return out


@pytest.mark.parametrize("token_slots", [[0, 2, -1, 2, 0, 0, -1], [1] * 5, [-1, -1], [3, 0, 3, 3, 1, 2] * 7])
def test_reference_equals_each_token_alone(token_slots):
    g = torch.Generator().manual_seed(len(token_slots))
    x, y = torch.randn(len(token_slots), 24, generator=g), torch.randn(len(token_slots), 40, generator=g)
    a, b = stack(4, 8, 24, 40, g)
    meta = lora_metadata(np.array(token_slots), 4, "cpu")
    expected = per_token(y, x, a, b, token_slots)
    lora_torch(y, x, a, b, meta)
    torch.testing.assert_close(y.double(), expected, atol=1e-5, rtol=1e-5)


def test_metadata_groups_tokens_by_slot():
    meta = lora_metadata(np.array([2, -1, 0, 2, -1, 0]), 4, "cpu")
    assert meta.sorted_tokens.tolist() == [1, 4, 2, 5, 0, 3]
    assert (meta.host_starts, meta.host_counts) == ([2, 4, 4, 6], [2, 0, 2, 0])
    with pytest.raises(ValueError, match="token slots must lie in"):
        lora_metadata(np.array([4]), 4, "cpu")


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_kernels_in_fresh_process() -> None:
    run_in_fresh_process(__file__ + "::test_triton_equals_the_reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rank", [8, 16, 64, 192])
@pytest.mark.parametrize(("tokens", "k", "n"), [(1, 40, 24), (37, 64, 72)])
def test_triton_equals_the_reference(monkeypatch, dtype, rank, tokens, k, n):
    """Slot 3 gets no token; some tokens run no adapter; ragged widths."""
    use_import_mode(monkeypatch)
    from orca_kernels import triton_lora

    g = torch.Generator().manual_seed(rank * tokens)
    token_slots = (torch.randint(-1, 3, (tokens,), generator=g)).numpy()
    if tokens > 1:
        token_slots[0] = -1
    x = torch.randn(tokens, k, generator=g).to(dtype)
    y = torch.randn(tokens, n, generator=g).to(dtype)
    a, b = stack(4, rank, k, n, g, dtype)
    expected = y.float().clone()
    lora_torch(expected, x.float(), a.float(), b.float(), lora_metadata(token_slots, 4, "cpu"))
    meta = lora_metadata(token_slots, 4, DEVICE)
    x_d, a_d, b_d = x.to(DEVICE), a.to(DEVICE), b.to(DEVICE)
    warm = y.to(DEVICE, copy=True)
    triton_lora.lora_triton(warm, x_d, a_d, b_d, meta)  # compiled outside the guard
    out = y.to(DEVICE, copy=True)
    with no_host_reads(monkeypatch, "the Triton LoRA launch"):
        triton_lora.lora_triton(out, x_d, a_d, b_d, meta)
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)
    untouched = token_slots < 0
    assert torch.equal(out.cpu()[untouched], y[untouched])  # no adapter: y exactly as it was
