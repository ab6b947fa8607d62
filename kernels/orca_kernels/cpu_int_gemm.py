"""The CPU linear layer over integer weights (4 or 8 bits, group scales and zero points; int_quant.py
says what they stand for): the C kernel `csrc/int_gemm.c` for decode steps, which reads the packed
bytes straight from memory (an eighth of float32's bytes at 4 bits) and dequantizes in registers;
longer steps dequantize the weight once (in C, the same products) and multiply it with the float
GEMM of cpu_gemm.py, where the step is bound by arithmetic, not by the weights' bytes.

The weights are rewritten at load into the kernel's byte layout (`CpuIntWeight`, `repack`): at 4
bits each 32 columns are four 32-bit words, column 16 h + i being nibble 4 h + i / 4 of word i % 4
(csrc/int_gemm.c says why). Activation-ordered groups (GPTQ's desc_act) are made contiguous by
permuting the input columns once at load (`perm`, applied to x each call), which needs every group to
hold `group` columns. What the kernel cannot read (an input or groups not a multiple of 32 columns,
uneven activation-ordered groups) is reported by `cpu_layout_problem`, and the loader dequantizes
that layer at load instead.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from . import native
from .cpu_gemm import ISAS, cpu_isa, linear_cpu

# Up to this many tokens the C kernel (it unpacks a row once per 4 tokens: two passes over the
# weights at 8); longer steps dequantize and multiply with the float GEMM. A choice, not yet measured
# against the crossing point.
NATIVE_MAX_TOKENS = 8


@dataclass
class CpuIntWeight:
    """A linear layer's integer weight in int_gemm.c's layout."""

    data: torch.Tensor  # uint8 [out, in / 2] (4 bits) or [out, in] (8 bits)
    scales: torch.Tensor  # float32 [out, in / group]
    zeros: torch.Tensor  # float32 [out, in / group]
    bits: int
    group: int
    perm: torch.Tensor | None  # int64 [in]: x's columns in the order the weight's columns are stored

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.data.shape[0], self.data.shape[1] * (2 if self.bits == 4 else 1)))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.data, self.scales, self.zeros, self.perm) if t is not None)


def cpu_layout_problem(cols: int, bits: int, group: int, g_idx: torch.Tensor | None) -> str | None:
    """Why int_gemm.c cannot read a layer of this shape, or None when it can."""
    if cols % 32:
        return f"{cols} input columns are not a multiple of 32"
    if group % 32:
        return f"groups of {group} columns are not a multiple of 32"
    if g_idx is not None and not torch.equal(torch.bincount(g_idx.long()), torch.full((cols // group,), group)):
        return "its activation-ordered groups do not each hold group_size columns"
    return None


def repack(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
           g_idx: torch.Tensor | None) -> CpuIntWeight:  # fmt: skip
    """Unsigned integers [out, in] with their scales and zeros [out, groups] in int_gemm.c's layout
    (`cpu_layout_problem` must have found none)."""
    perm = None
    if g_idx is not None:  # columns sorted by group: each group's columns become one run
        perm = torch.argsort(g_idx.long(), stable=True)
        q = q[:, perm]
    if bits == 4:
        # [out, blocks, h, i // 4, word i % 4] -> [out, blocks, word, nibble 4 h + i // 4]
        nibbles = q.reshape(q.shape[0], -1, 2, 4, 4).permute(0, 1, 4, 2, 3).reshape(q.shape[0], -1, 4, 8)
        words = (nibbles.to(torch.int64) << torch.arange(0, 32, 4)).sum(-1)  # [out, blocks, 4]
        q = _words_to_bytes(words)
    return CpuIntWeight(q.to(torch.uint8).reshape(q.shape[0], -1).contiguous(), scales.float().contiguous(),
                        zeros.float().contiguous(), bits, group, perm)  # fmt: skip


def _words_to_bytes(words: torch.Tensor) -> torch.Tensor:
    """32-bit words (held in int64) as their 4 little-endian bytes each, along the last dimension."""
    return ((words.unsqueeze(-1) >> torch.arange(0, 32, 8)) & 0xFF).reshape(*words.shape[:-1], -1)


@functools.cache
def _kernels() -> tuple[ctypes._CFuncPtr, ctypes._CFuncPtr]:
    p, i64, c_int = native.PTR, native.I64, ctypes.c_int
    # x, x_stride, M, W, scales, zeros, N, K, group, bits, bias, y, num_threads, isa
    linear = native.declare("int_gemm", "orca_int_linear_f32",
                            [p, i64, i64, p, p, p, i64, i64, i64, c_int, p, p, c_int, c_int], None)  # fmt: skip
    # W, scales, zeros, N, K, group, bits, out, num_threads
    dequantize = native.declare("int_gemm", "orca_int_dequantize_f32", [p, p, p, i64, i64, i64, c_int, p, c_int], None)
    return linear, dequantize


def _isa_id(isa: str) -> int:
    """decode_gemm.c's id of an instruction set, as int_gemm.c runs it (AVX512-BF16: the AVX-512 path)."""
    return min(ISAS[isa], ISAS["avx512"])


def dequantize_cpu(weight: CpuIntWeight) -> torch.Tensor:
    """The float32 weight [out, in] (columns in stored order: x permuted by `perm` multiplies it)."""
    (n, k), out = weight.shape, torch.empty(weight.shape, dtype=torch.float32)
    _kernels()[1](weight.data.data_ptr(), weight.scales.data_ptr(), weight.zeros.data_ptr(), n, k, weight.group,
                  weight.bits, out.data_ptr(), torch.get_num_threads())  # fmt: skip
    return out


def int_linear_cpu(x: torch.Tensor, weight: CpuIntWeight, bias: torch.Tensor | None = None,
                   isa: str | None = None) -> torch.Tensor:  # fmt: skip
    """F.linear(x, the weight, bias) for 2-D CPU x in float32 or bfloat16 (multiplied in float32,
    the result in x's dtype); `isa` (default cpu_isa()) one this CPU runs."""
    dtype = x.dtype
    x = x.float() if weight.perm is None else x.float()[:, weight.perm]
    x = x if x.stride(1) == 1 else x.contiguous()
    b = None if bias is None else bias.float().contiguous()
    (m, k), n = x.shape, weight.shape[0]
    if k != weight.shape[1]:
        raise ValueError(f"int linear: x has {k} features, the weight expects {weight.shape[1]}")
    if m > NATIVE_MAX_TOKENS:
        return linear_cpu(x, dequantize_cpu(weight), b).to(dtype)
    y = torch.empty(m, n, dtype=torch.float32)
    _kernels()[0](x.data_ptr(), x.stride(0), m, weight.data.data_ptr(), weight.scales.data_ptr(),
                  weight.zeros.data_ptr(), n, k, weight.group, weight.bits, None if b is None else b.data_ptr(),
                  y.data_ptr(), torch.get_num_threads(), _isa_id(isa or cpu_isa()))  # fmt: skip
    return y.to(dtype)


def expert_linear_cpu(x: torch.Tensor, weight: CpuIntWeight | torch.Tensor) -> torch.Tensor:
    """An expert's GEMM in the CPU kernel set's MoE (moe.py): its integer weight through the C
    kernel, a float one through linear_cpu."""
    return int_linear_cpu(x, weight) if isinstance(weight, CpuIntWeight) else linear_cpu(x, weight)
