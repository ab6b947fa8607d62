"""W8A8 linear layers (kernels/orca_kernels/w8a8.py): the per-token activation rounding, and the
int8 GEMM (torch._int_mm, CPU and CUDA) and FP8 GEMM (torch._scaled_mm, CUDA) against the formula
in float32 over the same codes."""

from __future__ import annotations

import pytest
import torch

from orca_kernels.w8a8 import quantize_per_token, w8a8_linear, w8a8_linear_torch

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def test_int8_codes_round_half_to_even_per_row_and_zero_rows_stay_zero():
    x = torch.tensor([[127.0, 63.5, -64.5, 0.0], [0.0, 0.0, 0.0, 0.0], [-2.0, 1.0, 0.5, 0.25]])
    codes, scale = quantize_per_token(x, "int8")
    assert codes.dtype == torch.int8
    assert scale.flatten().tolist() == torch.tensor([1.0, 0.0, 2.0 / 127]).tolist()  # float32
    assert codes[0].tolist() == [127, 64, -64, 0]  # 63.5 -> 64 and -64.5 -> -64: to even
    assert codes[1].tolist() == [0, 0, 0, 0]
    assert codes[2].tolist() == [-127, 64, 32, 16]  # 63.5 -> 64, 31.75 -> 32, 15.875 -> 16


def test_fp8_codes_span_448_per_row():
    x = torch.tensor([[4.0, -1.0, 0.001], [0.5, 0.25, -0.125]])
    codes, scale = quantize_per_token(x, "fp8")
    assert codes.dtype == torch.float8_e4m3fn
    assert codes.float()[:, 0].tolist() == [448.0, 448.0]
    assert scale.flatten().tolist() == torch.tensor([4 / 448, 0.5 / 448]).tolist()  # float32


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows", [1, 5, 40])
@pytest.mark.parametrize("act", ["int8", "fp8"])
def test_the_gemm_is_the_formula_over_the_codes(device, rows, act):
    """int8: sums exact in int32, so equal to float32 sums of the codes wherever those are exact
    (small codes here: every partial sum below 2^24); FP8: within float32 summation order."""
    if act == "fp8" and device == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 GEMMs need sm_89 or newer")
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 64, generator=g).to(device)
    if act == "int8":
        weight = torch.randint(-127, 128, (48, 64), generator=g, dtype=torch.int8).to(device)
    else:
        weight = (torch.randn(48, 64, generator=g) * 100).to(torch.float8_e4m3fn).to(device)
    scale = (torch.rand(48, generator=g) * 0.01 + 0.001).to(device)
    bias = torch.randn(48, generator=g).to(device)
    out = w8a8_linear(x, weight, scale, act, bias)
    expected = w8a8_linear_torch(x, weight, scale, act, bias)
    if act == "int8":
        torch.testing.assert_close(out, expected, rtol=1e-6, atol=1e-6)
    else:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-4)
