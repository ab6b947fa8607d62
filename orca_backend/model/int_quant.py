"""Integer weight checkpoints (GPTQ, AWQ, compressed-tensors pack-quantized): reading a linear layer's
packed integers, scales and zero points into the one layout every kernel reads
(kernels/orca_kernels/int_quant.py says what it stands for).

Each format is a bit-level contract, read here as its reference code writes it:
- GPTQ (`qweight` [in / per, out], `qzeros` [groups, out / per], `scales` [groups, out], `g_idx`):
  both packed sequentially, the lowest bits first, the weight along the input and the zero points
  along the output; format `gptq` stores the packed zero points minus one in every field, subtracted
  from the whole word (a zero point of 0 borrows from the field above), `gptq_v2` as they are.
- AWQ GEMM (`qweight` [in, out / 8], `qzeros` [groups, out / 8], `scales` [groups, out]): packed
  along the output, word element k holding column `AWQ_ORDER[k]` of its eight.
- compressed-tensors pack-quantized (`weight_packed` [out, in / per], `weight_scale` [out, groups],
  `weight_zero_point` [out / per, groups] when asymmetric, `weight_shape`): packed sequentially along
  the input (the zero points along the output), signed values stored plus 2^(bits - 1).

A projection stored in float (a quantizer's `ignore` / `modules_to_not_convert`) is read as float.
On CUDA the packed layout stays (the Triton dequantizing GEMM reads it, gemm.linear); on CPU the
weights are rewritten into the C kernel's byte layout (kernels/orca_kernels/cpu_int_gemm.py). A layer
that kernel cannot read (its docstring says which), or every layer where the kernel cannot be built,
is dequantized at load into the engine's dtype instead, with a warning.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass

import torch

from orca_backend.model.checkpoint import INT_TENSORS, WeightSource
from orca_kernels import cpu_int_gemm, native
from orca_kernels.int_quant import IntWeight, as_int32, dequantize_values, pack_int32, unpack_int32

logger = logging.getLogger("orca.model")

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's GEMM packing: word element k holds column AWQ_ORDER[k] of its 8

@dataclass
class _Unpacked:
    """A whole layer read from its format: unsigned integers [out, in], scales and zeros [out, groups]."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group: int
    g_idx: torch.Tensor | None


def is_int_quantized(src: WeightSource, layer: str, int_format: str) -> bool:
    """Whether the linear layer `layer` (its name without `.weight`) is stored as integers."""
    return bool(int_format) and f"{layer}.{INT_TENSORS[int_format][0]}" in src


def load_int_linear(
    src: WeightSource, layer: str, config: object, dim: int | None, lo: int, hi: int | None, dtype: torch.dtype,
    device: torch.device, dense: bool = False,
) -> torch.Tensor | IntWeight | cpu_int_gemm.CpuIntWeight:  # fmt: skip
    """The integer linear layer `layer` (rows or columns [lo, hi) along `dim`, a tensor-parallel shard):
    packed for CUDA's Triton GEMM or the CPU's C kernel, or dequantized to `dtype` when `dense` or
    where the CPU kernel cannot read it. A shard along the input must hold whole groups."""
    fmt, bits = config.int_format, config.int_bits  # type: ignore[attr-defined]
    whole = _read(src, layer, fmt, bits, config.int_group)  # type: ignore[attr-defined]
    part = _shard(whole, layer, dim, lo, hi)
    if device.type == "cuda" and not dense:
        return IntWeight(pack_int32(part.q, bits).to(device), part.scales.to(device), part.zeros.to(device), bits,
                         part.group, None if part.g_idx is None else part.g_idx.to(device))  # fmt: skip
    if device.type == "cpu" and not dense:
        problem = cpu_int_gemm.cpu_layout_problem(part.q.shape[1], bits, part.group, part.g_idx) or _cpu_kernel_problem()
        if problem is None:
            return cpu_int_gemm.repack(part.q, part.scales, part.zeros, bits, part.group, part.g_idx)
        logger.warning("%s: dequantized at load to %s (the CPU integer kernel cannot read it: %s)", layer, dtype,
                       problem)  # fmt: skip
    return dequantize_values(part.q, part.scales, part.zeros, part.group, part.g_idx, dtype).to(device)


@functools.cache
def _cpu_kernel_problem() -> str | None:
    """Why the CPU integer kernel cannot run here (no C compiler, no AVX2), or None: asked once per
    process, not once per layer."""
    try:
        cpu_int_gemm.int_linear_cpu(torch.zeros(1, 32), cpu_int_gemm.repack(
            torch.zeros(1, 32, dtype=torch.int32), torch.ones(1, 1), torch.zeros(1, 1), 4, 32, None))  # fmt: skip
    except (native.NativeBuildError, OSError, RuntimeError) as exc:
        return str(exc)
    return None


def _read(src: WeightSource, layer: str, fmt: str, bits: int, group: int) -> _Unpacked:
    if fmt in ("gptq", "gptq_v2"):
        q = unpack_int32(src.get(f"{layer}.qweight"), bits, dim=0).t()
        qzeros = src.get(f"{layer}.qzeros")
        zeros = unpack_int32(gptq_v1_zeros_to_v2(qzeros, bits) if fmt == "gptq" else qzeros, bits, dim=1).t()
        scales = src.get(f"{layer}.scales").t()
        g_idx = src.get(f"{layer}.g_idx") if f"{layer}.g_idx" in src else None
    elif fmt == "awq":
        q = unpack_int32(src.get(f"{layer}.qweight"), bits, dim=1, order=AWQ_ORDER).t()
        zeros = unpack_int32(src.get(f"{layer}.qzeros"), bits, dim=1, order=AWQ_ORDER).t()
        scales, g_idx = src.get(f"{layer}.scales").t(), None
    else:  # compressed-tensors pack-quantized
        out, cols = (int(v) for v in src.get(f"{layer}.weight_shape").tolist())
        q = unpack_int32(src.get(f"{layer}.weight_packed"), bits, dim=1)[:, :cols]
        scales = src.get(f"{layer}.weight_scale")
        if scales.numel() == 1:  # the tensor strategy: one scale, every row's
            scales = scales.reshape(1, 1).expand(out, 1)
        if f"{layer}.weight_zero_point" in src:
            zeros = unpack_int32(src.get(f"{layer}.weight_zero_point"), bits, dim=0)[:out]
        else:
            zeros = torch.full_like(scales, 2 ** (bits - 1), dtype=torch.int32)
        g_idx = None
    out, cols = q.shape
    groups = scales.shape[1]
    size = cols if groups == 1 else (group or cols)
    if g_idx is not None and torch.equal(g_idx.long(), torch.arange(cols) // size):
        g_idx = None  # runs of `group` columns: the plain layout (desc_act false still stores g_idx)
    if g_idx is None and -(-cols // size) != groups:
        raise ValueError(f"{layer}: {groups} scale groups for {cols} input columns do not match the config's "
                         f"group_size {group or -1}")  # fmt: skip
    if zeros.shape != scales.shape or q.shape[0] != scales.shape[0]:
        raise ValueError(f"{layer}: weight {tuple(q.shape)}, scales {tuple(scales.shape)} and zero points "
                         f"{tuple(zeros.shape)} do not fit together")  # fmt: skip
    return _Unpacked(q.contiguous(), scales.float().contiguous(), zeros.float().contiguous(), size, g_idx)


def gptq_v1_zeros_to_v2(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ format `gptq`'s packed zero points as format `gptq_v2` stores them: one added back to every
    field of each word, across the word (mod 2^32), as gptqmodel converts them; this undoes the writer's
    subtraction exactly, a zero point of 0 (whose borrow lowered the field above) included, where
    adding one per unpacked value would read 16 and the next field one short."""
    ones = sum(1 << shift for shift in range(0, 32, bits))
    return as_int32((qzeros.to(torch.int64) + ones) & 0xFFFFFFFF)


def _shard(whole: _Unpacked, layer: str, dim: int | None, lo: int, hi: int | None) -> _Unpacked:
    """Rows (dim 0) or input columns (dim 1) [lo, hi) of a layer. Along the input a shard starts and
    ends on group boundaries (it takes whole groups' scales) unless the groups follow g_idx (every
    group's scales are kept) or there is one group per row."""
    if dim is None:
        return whole
    end = whole.q.shape[dim] if hi is None else hi
    if dim == 0:
        return _Unpacked(whole.q[lo:end], whole.scales[lo:end], whole.zeros[lo:end], whole.group, whole.g_idx)
    q = whole.q[:, lo:end]
    if whole.g_idx is not None:
        return _Unpacked(q, whole.scales, whole.zeros, whole.group, whole.g_idx[lo:end])
    if whole.scales.shape[1] == 1:
        return _Unpacked(q, whole.scales, whole.zeros, end - lo, None)
    size, cols = whole.group, whole.q.shape[1]
    if lo % size or (end % size and end != cols):
        raise ValueError(f"{layer}: a tensor-parallel shard of input columns [{lo}, {end}) cuts the checkpoint's "
                         f"quantization groups of group_size {size}; choose a tensor_parallel_size that splits "
                         "whole groups")  # fmt: skip
    g = slice(lo // size, -(-end // size))
    return _Unpacked(q, whole.scales[:, g], whole.zeros[:, g], size, None)


def concat_int_rows(parts: list[IntWeight] | list[cpu_int_gemm.CpuIntWeight]) -> IntWeight | cpu_int_gemm.CpuIntWeight:
    """Integer projections stacked along `out` (q, k and v; gate and up), in either layout: they share
    the input, so their groups must be the same."""
    first = parts[0]

    def order(part: IntWeight | cpu_int_gemm.CpuIntWeight) -> torch.Tensor | None:
        return part.g_idx if isinstance(part, IntWeight) else part.perm

    for part in parts[1:]:
        a, b = order(part), order(first)
        same_order = (a is None) == (b is None) and (a is None or torch.equal(a, b))
        if part.bits != first.bits or part.group != first.group or not same_order:
            raise ValueError("integer projections over one input (q, k and v; gate and up) are quantized with "
                             "different bits, group sizes or activation orders, and do not stack")  # fmt: skip
    scales, zeros = torch.cat([p.scales for p in parts]), torch.cat([p.zeros for p in parts])
    if isinstance(first, IntWeight):
        return IntWeight(torch.cat([p.packed for p in parts]), scales, zeros, first.bits, first.group, first.g_idx)
    return cpu_int_gemm.CpuIntWeight(torch.cat([p.data for p in parts]), scales, zeros, first.bits, first.group,
                                     first.perm)  # fmt: skip
