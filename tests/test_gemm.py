"""orca_backend.model.gemm: the linear-layer matmul the model runs (oneDNN on CPU float32)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from orca_backend.model import gemm


@pytest.mark.parametrize("rows", [1, 4, 64, 1500])
@pytest.mark.parametrize("with_bias", [True, False])
def test_packed_linear_equals_f_linear(rows, with_bias):
    torch.manual_seed(rows)
    w, b, x = torch.randn(96, 80), torch.randn(96), torch.randn(rows, 80)
    bias = b if with_bias else None
    packed = gemm.pack(w)
    if torch.backends.mkldnn.is_available() and gemm.onednn_enabled():
        assert packed.is_mkldnn  # the fast path really is taken on CPU float32
    torch.testing.assert_close(gemm.linear(x, packed, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    # An unpacked weight (the tied LM head) takes the same path.
    torch.testing.assert_close(gemm.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)


def test_half_precision_weights_stay_plain():
    w = torch.randn(8, 8, dtype=torch.bfloat16)
    assert gemm.pack(w) is w
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    torch.testing.assert_close(gemm.linear(x, w), F.linear(x, w))


def test_torch_choice_keeps_f_linear_and_bad_choice_is_an_error(monkeypatch):
    monkeypatch.setattr(gemm, "_onednn", None)
    monkeypatch.setenv("ORCA_CPU_GEMM", "torch")
    w = torch.randn(8, 8)
    assert gemm.pack(w) is w
    monkeypatch.setattr(gemm, "_onednn", None)
    monkeypatch.setenv("ORCA_CPU_GEMM", "fastest")
    with pytest.raises(ValueError, match="ORCA_CPU_GEMM must be"):
        gemm.pack(w)
    monkeypatch.setattr(gemm, "_onednn", None)
