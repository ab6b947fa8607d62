"""The matrix multiply of every linear layer (weights `[out, in]`, torch.nn.Linear's layout).

On CPU in float32 the weights stay plain and contiguous, and kernels/orca_kernels/cpu_gemm.py picks
the multiply by the number of tokens (a C kernel for decodes, oneDNN, then MKL; `ORCA_CPU_GEMM` overrides it).
CUDA and half precision use F.linear; FP8 weights (CUDA only) a Triton dequantizing GEMM.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from orca_backend.model.fp8 import Fp8Weight
from orca_kernels.cpu_gemm import linear_cpu


def pack(weight: torch.Tensor | Fp8Weight) -> torch.Tensor | Fp8Weight:
    """The weight as `linear` wants it: contiguous (a tensor-parallel shard may be a strided view)."""
    return weight if isinstance(weight, Fp8Weight) else weight.contiguous()


def linear(x: torch.Tensor, weight: torch.Tensor | Fp8Weight, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x and a `pack`ed weight; an FP8 weight (only on CUDA:
    elsewhere they are dequantized at load, model/fp8.py) through the Triton dequantizing GEMM."""
    if isinstance(weight, Fp8Weight):
        from orca_kernels.triton_fp8 import fp8_linear_triton  # triton is imported where FP8 runs only

        return fp8_linear_triton(x, weight.weight, weight.scale, weight.block, bias)
    return linear_cpu(x, weight, bias)


def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, bias_gelu: Callable) -> torch.Tensor:
    """bias_gelu(linear(x, weight), bias): GPT-2's MLP input. On CUDA it is one cuBLASLt GEMM whose
    epilogue adds the bias and applies GELU in its tanh form, GPT-2's `gelu_new` (torch's
    _addmm_activation; one launch per layer instead of two); elsewhere the GEMM, then `bias_gelu`
    (the kernel set's, which on CPU reproduces torch's rounding)."""
    if x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return bias_gelu(linear(x, weight), bias)

