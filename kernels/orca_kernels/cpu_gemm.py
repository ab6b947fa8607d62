"""The CPU float32 matrix multiply of linear layers (weights `[out, in]`, torch.nn.Linear's layout).

No one GEMM is best over the 1 to thousands of tokens an iteration has, so the multiply is picked
by the number of tokens:
- up to `NATIVE_MAX_TOKENS` (a decode iteration of a small batch): the C kernel
  `csrc/decode_gemm.c`, which reads each weight once at streaming bandwidth;
- up to `ONEDNN_MAX_TOKENS`: oneDNN (the op torch.compile's CPU backend uses for linear layers);
- beyond (prefill): MKL's sgemm through F.linear, the fastest of the three at hundreds of tokens.
docs/cpu-gemm.md has the measurements behind the thresholds.

The C kernel is built on first use (native.py). Without a C compiler the engine logs a warning once
and uses oneDNN at every size. `ORCA_CPU_GEMM` overrides the choice for A/B runs: `auto` (the
above), `native` (the C kernel required, an error if it cannot be built), `onednn` (oneDNN at every
size) or `torch` (F.linear at every size). The choice is logged once per process. The dense layers
(orca_backend/model/gemm.py) and the CPU mixture-of-experts path (moe.py) both multiply through here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os

import torch
import torch.nn.functional as F

from . import native

logger = logging.getLogger("orca.kernels")

GEMM_ENV = "ORCA_CPU_GEMM"
CHOICES = ("auto", "native", "onednn", "torch")
NATIVE_MAX_TOKENS = 32
ONEDNN_MAX_TOKENS = 512


@functools.cache
def cpu_gemm_choice() -> str:
    """"native" (C kernel for few tokens, oneDNN, then MKL), "onednn" or "torch": decided once per process."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{GEMM_ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice == "onednn" and not torch.backends.mkldnn.is_available():
        raise RuntimeError(f"{GEMM_ENV}=onednn, but this torch build has no oneDNN (mkldnn)")
    if choice in ("auto", "native"):
        try:
            _native_kernel()
        except (native.NativeBuildError, OSError) as exc:
            if choice == "native":
                raise RuntimeError(f"{GEMM_ENV}=native: {exc}") from exc
            logger.warning("CPU linear layers: the C decode GEMM is unavailable (%s); using oneDNN at every size", exc)
            choice = "onednn" if torch.backends.mkldnn.is_available() else "torch"
        else:
            choice = "native"
    logger.info("CPU float32 linear layers: %s", {
        "native": f"C kernel up to {NATIVE_MAX_TOKENS} tokens, oneDNN up to {ONEDNN_MAX_TOKENS}, MKL beyond",
        "onednn": "oneDNN", "torch": "torch F.linear (MKL)"}[choice])  # fmt: skip
    return choice


@functools.cache
def _native_kernel() -> ctypes._CFuncPtr:
    p, i64 = native.PTR, native.I64
    # x, x_stride, M, W, N, K, bias, y, num_threads
    return native.declare("decode_gemm", "orca_decode_linear_f32", [p, i64, i64, p, i64, i64, p, p, ctypes.c_int], None)


def native_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear through the C kernel: CPU float32, x [M, K] with unit column stride, weight contiguous."""
    assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and x.dtype == weight.dtype == torch.float32
    assert bias is None or (bias.is_contiguous() and bias.dtype == torch.float32)
    (m, k), n = x.shape, weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"linear: x has {k} features, the weight expects {weight.shape[1]}")
    y = torch.empty(m, n, dtype=torch.float32)
    _native_kernel()(x.data_ptr(), x.stride(0), m, weight.data_ptr(), n, k, bias.data_ptr() if bias is not None else None,
                     y.data_ptr(), torch.get_num_threads())  # fmt: skip
    return y


def linear_cpu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x and a contiguous weight, by the choice above on CPU float32;
    F.linear itself for any other device or dtype."""
    if x.device.type != "cpu" or x.dtype != torch.float32:
        return F.linear(x, weight, bias)
    choice, tokens = cpu_gemm_choice(), x.shape[0]
    if choice == "native" and tokens <= NATIVE_MAX_TOKENS:
        return native_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)
    if choice == "onednn" or (choice == "native" and tokens <= ONEDNN_MAX_TOKENS):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
