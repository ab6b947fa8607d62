"""The matrix multiply of every linear layer (weights `[out, in]`, torch.nn.Linear's layout).

On CPU in float32 it goes through oneDNN (the op torch.compile's CPU backend uses for linear
layers) with the layer weights reordered once, at load, into oneDNN's blocked layout (the packed
tensor replaces the plain one: no second copy). Measured on the 2-core CI machine (AMD EPYC) over
GPT-2-small's 24 MLP matrices, against MKL's sgemm (torch's default) on the best weight layout:
1 token 11.1 vs 13.3 ms, 4 tokens 14.2 vs 40.9 ms (MKL is at its worst on the few-token batches
of decode), 64 tokens 72 vs 110 ms, 2,048 tokens 1.69 vs 1.96 s. The tied embedding stays a plain
tensor (the embedding lookup indexes it) and oneDNN reads it unpacked for the LM head.

CUDA and half precision use F.linear unchanged. ORCA_CPU_GEMM=torch keeps F.linear on CPU too (for
A/B); the choice is logged once per process.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F

logger = logging.getLogger("orca.model")

_onednn: bool | None = None  # decided once per process


def onednn_enabled() -> bool:
    global _onednn
    if _onednn is None:
        choice = os.environ.get("ORCA_CPU_GEMM", "auto")
        if choice not in ("auto", "torch", "onednn"):
            raise ValueError(f"ORCA_CPU_GEMM must be auto, torch or onednn, got {choice!r}")
        available = torch.backends.mkldnn.is_available()
        if choice == "onednn" and not available:
            raise RuntimeError("ORCA_CPU_GEMM=onednn, but this torch build has no oneDNN (mkldnn)")
        _onednn = available and choice != "torch"
        logger.info("CPU float32 linear layers: %s", "oneDNN, packed weights" if _onednn else "torch F.linear (MKL)")
    return _onednn


def _uses_onednn(device: torch.device, dtype: torch.dtype) -> bool:
    return device.type == "cpu" and dtype == torch.float32 and onednn_enabled()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight in the form `linear` multiplies fastest on its device (oneDNN's layout on CPU float32)."""
    if not _uses_onednn(weight.device, weight.dtype):
        return weight
    return torch.ops.mkldnn._reorder_linear_weight(weight, None)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x and a plain or `pack`ed weight."""
    if weight.is_mkldnn or _uses_onednn(x.device, x.dtype):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)
