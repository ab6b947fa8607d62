"""The fused pre-norm + GEMM kernel (triton_norm_linear.py) against its torch reference
(norm_linear.py): fp32 tightly, bf16 within a couple of ulps of the fp32 reference computed on the
same rounded inputs (tests/triton_testing.py)."""

from __future__ import annotations

import pytest
import torch
from triton_testing import (
    DEVICE,
    assert_close,
    no_host_reads,
    randn,
    test_in_fresh_process,  # noqa: F401 (collected here: reruns this file where this process can't)
)

from orca_kernels import KernelOps
from orca_kernels.norm_linear import norm_linear_torch


def _inputs(rows: int, hidden: int, out: int, dtype: torch.dtype, seed: int, *, layernorm: bool, bias: bool,
            x_bias: bool, residual: bool) -> dict:  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    return {
        "x": (randn(rows, hidden, g=g) * 2 + 0.5).to(dtype),  # a non-zero mean exercises LayerNorm's centring
        "x_bias": randn(hidden, g=g, dtype=dtype) if x_bias else None,
        "residual": randn(rows, hidden, g=g, dtype=dtype) if residual else None,
        "norm_w": (1 + 0.1 * randn(hidden, g=g)).to(dtype),
        "norm_b": randn(hidden, g=g, dtype=dtype) * 0.1 if layernorm else None,
        "eps": 1e-5,
        "weight": randn(out, hidden, g=g, dtype=dtype) * hidden**-0.5,
        "bias": randn(out, g=g, dtype=dtype) if bias else None,
    }


def _reference(args: dict, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference in the inputs' dtype: it rounds the norm's output and the gate/up GEMM output
    where the kernel does, so in bf16 the two differ by the GEMM's accumulation order and the final
    rounding alone."""
    return norm_linear_torch(**args, activation=activation)


# (activation, layernorm, bias): GPT-2's qkv (LayerNorm, bias) and MLP input (bias + GELU), the
# Llama family's q/k/v (RMSNorm, Qwen2's bias or none) and gated MLPs.
CASES = [("none", True, True), ("gelu", True, True), ("none", False, True), ("none", False, False),
         ("silu_and_mul", False, False), ("gelu_and_mul", False, False)]  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("activation", "layernorm", "bias"), CASES)
@pytest.mark.parametrize("rows", [1, 2, 19])  # one row (the M = 1 case), and several row blocks
def test_norm_linear_matches_the_reference(ops: KernelOps, dtype, activation, layernorm, bias, rows) -> None:
    # hidden 80 and 72 output columns: neither a multiple of the K or N tiles (masked tails).
    args = _inputs(rows, 80, 144 if activation.endswith("_and_mul") else 72, dtype, rows, layernorm=layernorm,
                   bias=bias, x_bias=True, residual=True)  # fmt: skip
    y, summed = ops.norm_linear(**args, activation=activation)
    ref_y, ref_summed = _reference(args, activation)
    assert y.shape == ref_y.shape
    if dtype == torch.float32:
        assert torch.equal(summed, ref_summed)  # the residual stream is rounded as the reference's
        torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    else:
        # bf16: the interpreter rounds toward zero where torch rounds to nearest (tests/triton_testing.py),
        # and the output is three roundings deep (the norm's output, the GEMM's, the activation's): a
        # one-ulp difference in the normalised row can become a few ulps of a gated product.
        assert_close(summed, ref_summed, dtype)
        torch.testing.assert_close(y.float(), ref_y.float(), atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize(("x_bias", "residual"), [(False, False), (True, False), (False, True)])
def test_norm_linear_without_bias_or_residual(ops: KernelOps, x_bias: bool, residual: bool) -> None:
    """The first layer's norm (no residual yet, no previous bias): the residual is x itself, as the
    references return it; with only one of the two the sum is a new tensor."""
    args = _inputs(3, 48, 40, torch.float32, 5, layernorm=True, bias=True, x_bias=x_bias, residual=residual)
    y, summed = ops.norm_linear(**args, activation="none")
    ref_y, ref_summed = _reference(args, "none")
    torch.testing.assert_close(y, ref_y, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(summed, ref_summed, atol=0, rtol=0)
    assert (summed is args["x"]) == (not x_bias and not residual)


def test_norm_linear_reads_nothing_back_and_writes_only_its_outputs(ops: KernelOps, monkeypatch) -> None:
    """A CUDA graph captures it: no host read; and x, the residual and the weights are left as they were."""
    args = _inputs(4, 64, 64, torch.float32, 3, layernorm=False, bias=False, x_bias=True, residual=True)
    before = {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}
    with no_host_reads(monkeypatch, "norm_linear"):
        ops.norm_linear(**args, activation="silu_and_mul")
    assert all(torch.equal(args[k], v) for k, v in before.items())


def test_norm_linear_refuses_what_it_cannot_compute(ops: KernelOps) -> None:
    args = _inputs(2, 32, 32, torch.float32, 1, layernorm=True, bias=False, x_bias=False, residual=False)
    with pytest.raises(ValueError, match="needs the bias"):
        ops.norm_linear(**args, activation="gelu")
    with pytest.raises(ValueError, match="activation must be"):
        ops.norm_linear(**args, activation="relu")
    args["weight"] = args["weight"].t()  # column-major
    with pytest.raises(ValueError, match="row-major weight"):
        ops.norm_linear(**args)
    assert DEVICE in ("cpu", "cuda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_every_cuda_tiling_fits_a_hoppers_shared_memory(dtype: torch.dtype) -> None:
    """The tilings chosen on CUDA, checked without a GPU: each pipeline stage holds an x tile and one
    weight tile (two for a gated MLP), and `num_stages` of them must stay well inside the 227 KB an H100
    or H200 gives a block (the sweep's gated (16, 64, 256) tiling at 4 stages needed 250 KB and failed)."""
    from orca_kernels.triton_norm_linear import _blocks

    for rows in (1, 16, 17, 32, 33, 64, 256):
        for out_cols, gated in ((1152, False), (4864, True), (14336, True), (50257, False), (151936, False)):
            block_m, block_n, block_k, _, stages = _blocks(rows, out_cols, gated, torch.device("cuda"), dtype)
            assert min(block_m, block_n, block_k) >= 16
            per_stage = (block_m * block_k + block_k * block_n * (2 if gated else 1)) * dtype.itemsize
            assert per_stage * stages <= 200 * 1024, (rows, out_cols, gated, per_stage * stages)
