"""The CPU matrix multiply of linear layers (weights `[out, in]`, torch.nn.Linear's layout), float32
and bfloat16.

No one GEMM is best over the 1 to thousands of tokens an iteration has, nor on every kind of x86
CPU, so the multiply is picked by the CPU and the number of tokens (`ORCA_CPU_GEMM=auto`):
- AVX2 machines ("native"): plain weights; up to 32 tokens (a decode iteration of a small batch)
  the C kernel `csrc/decode_gemm.c`, which reads each weight once at streaming bandwidth; then
  oneDNN, and in float32 past 512 tokens MKL's sgemm (the faster there).
- AVX-512 machines ("packed"): the layers' weights (and the LM head, tied or not) are reordered once, at
  load (`pack_weight`), into oneDNN's blocked layout. Up to 64 tokens the C kernel's panel tiles read
  that layout in place (`packed_native_linear`: 1.02-1.97x oneDNN on the same buffer, which at a few
  tokens reads it at 0.6-0.75x the bandwidth); beyond, oneDNN multiplies it, on prefills up to 2.2x faster than MKL
  (which runs its AVX2 code on AMD CPUs). `pack_weight` checks the layout on every weight it packs:
  one oneDNN lays out otherwise (another version, another kind of CPU) goes to oneDNN at every
  size, with a warning. A weight left plain (a mixture-of-experts layer's experts) takes the C
  kernel up to 12 tokens, oneDNN beyond.
docs/cpu-gemm.md has the measurements behind these choices.

The C kernel is built on first use (native.py) and runs the widest instruction set this CPU has
(`cpu_isa()`: AVX2, AVX-512, or AVX-512 with its bfloat16 dot product); `ORCA_CPU_ISA` forces a
narrower one (what a machine of that kind would run: the tests and benchmarks use it to cover every
kind on one machine). Without a C compiler (or on a CPU without AVX2) the engine logs a warning
once and uses oneDNN at every size. `ORCA_CPU_GEMM` overrides the choice for A/B runs: `auto` (the
above), `native` (plain weights, the C kernel required: an error if it cannot be built), `packed`,
`onednn` (plain weights, oneDNN at every size) or `torch` (F.linear at every size). The choice is
logged once per process. The dense layers (orca_backend/model/gemm.py) and the CPU
mixture-of-experts path (moe.py, plain expert weights) both multiply through here.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from . import native

logger = logging.getLogger("orca.kernels")

GEMM_ENV = "ORCA_CPU_GEMM"
CHOICES = ("auto", "native", "packed", "onednn", "torch")
ISA_ENV = "ORCA_CPU_ISA"
# decode_gemm.c's ISA_* ids, narrowest first.
ISAS = {"avx2": 0, "avx512": 1, "avx512_bf16": 2}
# The C kernel up to this many tokens on plain weights, per instruction set: past it oneDNN is faster
# (docs/cpu-gemm.md; measured on AVX2 and AVX-512 EPYCs, float32 and bfloat16 alike).
NATIVE_MAX_TOKENS = {"avx2": 32, "avx512": 12, "avx512_bf16": 12}
# float32 beyond the C kernel: oneDNN up to this many tokens, MKL's sgemm past it. On AVX2 MKL is up
# to 7% faster on prefills of a thousand tokens or more; on AVX-512 oneDNN is faster at every size
# (on AMD CPUs MKL runs its AVX2 code: 2.2x slower than oneDNN on a Zen 5 EPYC), so MKL never runs.
ONEDNN_MAX_TOKENS = {"avx2": 512, "avx512": None, "avx512_bf16": None}
# A packed weight takes the C kernel's panel tiles up to this many tokens, oneDNN beyond. On a Zen 5
# EPYC (at half its usual multiply-add peak on both days measured) the panel tiles took 0.83-0.98x
# oneDNN's time at 16-64 tokens over GPT-2-small's and llama-150m's matrices in float32 and bfloat16,
# and were even with it from 128 (float32) or 256 (bfloat16) on (docs/cpu-gemm.md). Up to 64 covers
# the decode steps of a batch of 64.
PACKED_NATIVE_MAX_TOKENS = 64
# The panel width (output rows) of oneDNN's blocked layout that the panel tiles read (decode_gemm.c).
PANEL = 64


@functools.cache
def supported_isas() -> tuple[str, ...]:
    """The instruction sets of the C kernel this CPU (and its OS) runs, narrowest first."""
    supported = _native_isa_supported()
    return tuple(isa for isa, code in ISAS.items() if supported(code))


@functools.cache
def cpu_isa() -> str:
    """The instruction set the C kernel runs: $ORCA_CPU_ISA, else the widest this CPU (and OS) has."""
    have = supported_isas()
    wanted = os.environ.get(ISA_ENV, "auto")
    if wanted not in ("auto", *ISAS):
        raise ValueError(f"{ISA_ENV} must be auto or one of {', '.join(ISAS)}, got {wanted!r}")
    if not have:
        raise native.NativeBuildError("the C decode GEMM needs AVX2 and FMA, which this CPU does not have")
    if wanted != "auto" and wanted not in have:
        raise RuntimeError(f"{ISA_ENV}={wanted}, but this CPU runs only {', '.join(have)}")
    isa = have[-1] if wanted == "auto" else wanted
    logger.info("CPU decode GEMM: %s instructions (this CPU has %s)", isa, ", ".join(have))
    return isa


def native_max_tokens() -> int:
    return NATIVE_MAX_TOKENS[cpu_isa()]


@functools.cache
def cpu_gemm_choice() -> str:
    """"native", "packed", "onednn" or "torch" (the module docstring says what each runs): decided
    once per process."""
    choice = os.environ.get(GEMM_ENV, "auto")
    if choice not in CHOICES:
        raise ValueError(f"{GEMM_ENV} must be one of {', '.join(CHOICES)}, got {choice!r}")
    if choice in ("packed", "onednn") and not torch.backends.mkldnn.is_available():
        raise RuntimeError(f"{GEMM_ENV}={choice}, but this torch build has no oneDNN (mkldnn)")
    if choice in ("auto", "native", "packed"):
        try:
            _kernels("plain")
            cpu_isa()
        except (native.NativeBuildError, OSError) as exc:
            if choice != "auto":
                raise RuntimeError(f"{GEMM_ENV}={choice}: {exc}") from exc
            logger.warning("CPU linear layers: the C decode GEMM is unavailable (%s); using oneDNN at every size", exc)
            choice = "onednn" if torch.backends.mkldnn.is_available() else "torch"
    if choice == "auto":
        packs = cpu_isa() != "avx2" and torch.backends.mkldnn.is_available()
        choice = "packed" if packs else "native"
    isa = cpu_isa() if choice in ("native", "packed") else ""
    if choice == "native":
        onednn_max = ONEDNN_MAX_TOKENS[isa]
        logger.info("CPU linear layers: the C kernel (%s) up to %d tokens, then float32 %s, bfloat16 oneDNN", isa,
                    NATIVE_MAX_TOKENS[isa], f"oneDNN up to {onednn_max} and MKL beyond" if onednn_max else "oneDNN")  # fmt: skip
    elif choice == "packed":
        logger.info("CPU linear layers: weights in oneDNN's blocked layout, oneDNN at every size; plain weights "
                    "(MoE experts) the C kernel (%s) up to %d tokens, then oneDNN", isa, NATIVE_MAX_TOKENS[isa])  # fmt: skip
    else:
        logger.info("CPU linear layers: %s", "oneDNN" if choice == "onednn" else "torch F.linear (MKL)")
    return choice


@dataclass(frozen=True)
class PackedWeight:
    """A linear layer's weight [out, in] reordered into oneDNN's blocked layout (an opaque tensor,
    which oneDNN's linear reads, and where `padded_in` is set, the C kernel's panel tiles through
    its buffer's address); `pack_weight` makes it, `linear_cpu` multiplies by it."""

    packed: torch.Tensor
    shape: torch.Size
    dtype: torch.dtype
    # `in` padded as the panel layout pads it, when the buffer holds the weight in that layout
    # (decode_gemm.c: [out / 64][padded_in][64], bfloat16 in pairs of k), else 0: oneDNN only
    padded_in: int = 0
    address: int = 0  # of the buffer, for the C kernel (read once: torch.ops.mkldnn.data_ptr is a dispatch)

    @property
    def nbytes(self) -> int:
        return self.shape.numel() * self.dtype.itemsize


def pack_weight(weight: torch.Tensor) -> torch.Tensor | PackedWeight:
    """The weight as `linear_cpu` multiplies it fastest: reordered for oneDNN under the "packed"
    choice (CPU float32 or bfloat16), else contiguous."""
    weight = weight.contiguous()
    if weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16):
        return weight
    if cpu_gemm_choice() != "packed":
        return weight
    packed = torch.ops.mkldnn._reorder_linear_weight(weight, None)
    padded_in, address = _panel_layout(packed, weight) if cpu_isa() != "avx2" else (0, 0)
    return PackedWeight(packed, weight.shape, weight.dtype, padded_in, address)


def _panel_layout(packed: torch.Tensor, weight: torch.Tensor) -> tuple[int, int]:
    """(`in` padded, the buffer's address) when oneDNN's buffer `packed` holds `weight` in the panel
    layout the C kernel reads (zero padding included), else (0, 0) (logged once): read back and
    compared in full."""
    (n, k), pair = weight.shape, 2 if weight.dtype == torch.bfloat16 else 1
    try:  # ops torch keeps for AOT Inductor: a torch without them keeps oneDNN alone (with the warning)
        nbytes, address = torch.ops.mkldnn._nbytes(packed), torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):
        nbytes = address = 0
    n_padded = -(-n // PANEL) * PANEL
    k_padded, rest = divmod(nbytes, n_padded * weight.element_size())
    if address and not rest and k_padded >= k and k_padded % pair == 0:
        buffer = (ctypes.c_char * nbytes).from_address(address)
        panels = torch.frombuffer(buffer, dtype=weight.dtype).view(n_padded // PANEL, k_padded // pair, PANEL, pair)
        plain = panels.permute(0, 2, 1, 3).reshape(n_padded, k_padded)
        if torch.equal(plain[:n, :k], weight) and not plain[n:].any() and not plain[:, k:].any():
            return k_padded, address
    _warn_other_layout(tuple(weight.shape), weight.dtype)
    return 0, 0


@functools.cache
def _warn_other_layout(shape: tuple[int, int], dtype: torch.dtype) -> None:
    logger.warning("CPU linear layers: oneDNN laid out a %s weight %s otherwise than in panels of %d rows "
                   "(torch %s); it takes oneDNN at every size", dtype, shape, PANEL, torch.__version__)  # fmt: skip


@functools.cache
def _kernels(layout: str) -> dict[torch.dtype, ctypes._CFuncPtr]:
    """The C kernel's entry points by dtype, for plain weights ("plain": orca_decode_linear_*) or
    oneDNN's packed ones ("packed": orca_packed_linear_*, which take K padded after K)."""
    p, i64, c_int = native.PTR, native.I64, ctypes.c_int
    # x, x_stride, M, W, N, K, (padded K), bias, y, num_threads, isa
    argtypes = [p, i64, i64, p, i64, i64, *([i64] if layout == "packed" else []), p, p, c_int, c_int]
    prefix = {"plain": "orca_decode_linear", "packed": "orca_packed_linear"}[layout]
    return {
        torch.float32: native.declare("decode_gemm", f"{prefix}_f32", argtypes, None),
        torch.bfloat16: native.declare("decode_gemm", f"{prefix}_bf16", argtypes, None),
    }


@functools.cache
def _native_isa_supported() -> ctypes._CFuncPtr:
    return native.declare("decode_gemm", "orca_decode_gemm_isa_supported", [ctypes.c_int], ctypes.c_int)


def native_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """F.linear through the C kernel: CPU float32 or bfloat16 (x, weight and bias alike), x [M, K]
    with unit column stride, weight contiguous; `isa` (default `cpu_isa()`) one this CPU runs."""
    dtype = x.dtype
    assert x.dim() == 2 and x.stride(1) == 1 and weight.is_contiguous() and weight.dtype == dtype
    assert bias is None or (bias.is_contiguous() and bias.dtype == dtype)
    (m, k), n = x.shape, _out_features(x, weight.shape)
    kernel = _kernels("plain").get(dtype)
    if kernel is None:
        raise ValueError(f"the C decode GEMM takes float32 or bfloat16, got {dtype}")
    if isa is not None and isa not in supported_isas():
        raise RuntimeError(f"this CPU does not run {isa} instructions")
    y = torch.empty(m, n, dtype=dtype)
    kernel(x.data_ptr(), x.stride(0), m, weight.data_ptr(), n, k, bias.data_ptr() if bias is not None else None,
           y.data_ptr(), torch.get_num_threads(), ISAS[isa or cpu_isa()])  # fmt: skip
    return y


def packed_native_linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None = None,
                         isa: str | None = None) -> torch.Tensor:  # fmt: skip
    """F.linear through the C kernel's panel tiles, reading a packed weight whose `padded_in` is set;
    x [M, K] with unit column stride, of the weight's dtype, as the bias; `isa` (default `cpu_isa()`)
    an AVX-512 one this CPU runs."""
    dtype = x.dtype
    assert x.dim() == 2 and x.stride(1) == 1 and weight.padded_in and dtype == weight.dtype
    assert bias is None or (bias.is_contiguous() and bias.dtype == dtype)
    (m, k), n = x.shape, _out_features(x, weight.shape)
    if isa is not None and isa not in supported_isas():
        raise RuntimeError(f"this CPU does not run {isa} instructions")
    isa = isa or cpu_isa()
    if isa == "avx2":
        raise RuntimeError("the packed-weight tiles run AVX-512 instructions, not avx2")
    y = torch.empty(m, n, dtype=dtype)
    _kernels("packed")[dtype](x.data_ptr(), x.stride(0), m, weight.address, n, k, weight.padded_in,
                              bias.data_ptr() if bias is not None else None, y.data_ptr(), torch.get_num_threads(),
                              ISAS[isa])  # fmt: skip
    return y


@dataclass(frozen=True)
class CLinear:
    """How `linear_cpu` multiplies by a weight with the C kernel, for the steps of up to `max_tokens`
    tokens: through oneDNN's packed buffer (`padded_in` set) or the plain weight at `address`. What a
    caller that runs the kernel from C itself needs (cpu_decoder_step.py)."""

    address: int
    out_features: int
    in_features: int
    padded_in: int  # 0: the plain weight's rows
    max_tokens: int


def c_linear(weight: object) -> CLinear | None:
    """The C kernel `linear_cpu` runs for this weight at few tokens, or None where it runs none
    (oneDNN alone, another device or dtype, `ORCA_CPU_GEMM` chose otherwise, or a quantized weight,
    which `linear_cpu` does not take)."""
    if isinstance(weight, PackedWeight):
        return CLinear(weight.address, *weight.shape, weight.padded_in, PACKED_NATIVE_MAX_TOKENS) if weight.padded_in else None
    if not isinstance(weight, torch.Tensor) or weight.device.type != "cpu" or weight.dtype not in (torch.float32, torch.bfloat16) or not weight.is_contiguous():
        return None
    if cpu_gemm_choice() not in ("native", "packed"):
        return None
    return CLinear(weight.data_ptr(), *weight.shape, 0, native_max_tokens())


def _out_features(x: torch.Tensor, weight_shape: torch.Size) -> int:
    """N of a weight [N, K] that x [M, K] is multiplied by; a ValueError unless the Ks agree."""
    if weight_shape[1] != x.shape[1]:
        raise ValueError(f"linear: x has {x.shape[1]} features, the weight expects {weight_shape[1]}")
    return weight_shape[0]


def linear_cpu(
    x: torch.Tensor, weight: torch.Tensor | PackedWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x and a `pack_weight`ed weight, by the choice above on CPU
    float32 and bfloat16; F.linear itself for any other device or dtype."""
    if isinstance(weight, PackedWeight):
        if weight.padded_in and x.shape[0] <= PACKED_NATIVE_MAX_TOKENS and x.dtype == weight.dtype:
            return packed_native_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, weight.packed, bias, "none", [], "")
    if x.device.type != "cpu" or x.dtype not in (torch.float32, torch.bfloat16):
        return F.linear(x, weight, bias)
    choice, tokens = cpu_gemm_choice(), x.shape[0]
    if choice in ("native", "packed") and tokens <= native_max_tokens():
        return native_linear(x if x.stride(1) == 1 else x.contiguous(), weight, bias)
    if x.dtype == torch.float32 and (choice in ("onednn", "packed") or (choice == "native" and _onednn_takes(tokens))):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


def _onednn_takes(tokens: int) -> bool:
    """Whether a float32 multiply of this many tokens past the C kernel's goes to oneDNN (else MKL)."""
    most = ONEDNN_MAX_TOKENS[cpu_isa()]
    return most is None or tokens <= most
