"""Integer weights (4 or 8 bits) with per-group scales and zero points, and the linear layer over them:
the layout every kernel reads, and the torch reference.

GPTQ, AWQ and compressed-tensors checkpoints each pack their integers their own way; the loader
(orca_backend/model/int_quant.py) rewrites all of them into this one layout:

- ``packed``: int32 ``[out, in * bits / 32]``. Entry ``(r, c)`` of the weight is the unsigned integer
  ``q`` in bits ``[(c % per) * bits, (c % per + 1) * bits)`` of ``packed[r, c // per]``, where
  ``per = 32 // bits`` (the lowest bits hold the first column: compressed-tensors' order).
- ``scales``, ``zeros``: float32 ``[out, groups]``. Entry ``(r, c)`` stands for
  ``(q - zeros[r, g]) * scales[r, g]`` with ``g = c // group`` (``group``: columns per group; one
  group per row is ``group == in``), or ``g = g_idx[c]`` when the checkpoint ordered its groups by
  activation (GPTQ's ``desc_act``, compressed-tensors' ``actorder="group"``). A symmetric scheme's zero
  is ``2 ** (bits - 1)`` everywhere; zeros are whole numbers kept in float32 so that every kernel
  subtracts them as it multiplies.

The products ``(q - z) * s`` are formed in float32 and the weight is used in the activations' dtype,
as transformers' dequantizing loads compute it. A MoE layer's experts stack their weights in the same
layout with one more leading dimension (`IntExperts`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

BITS = (4, 8)


@dataclass
class IntWeight:
    """A linear layer's integer weight in this module's layout."""

    packed: torch.Tensor  # int32 [out, in * bits / 32]
    scales: torch.Tensor  # float32 [out, groups]
    zeros: torch.Tensor  # float32 [out, groups]
    bits: int
    group: int  # input columns per group
    g_idx: torch.Tensor | None  # int32 [in]: each column's group, when not runs of `group`

    @property
    def shape(self) -> torch.Size:
        return torch.Size((self.packed.shape[0], self.packed.shape[1] * 32 // self.bits))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.packed, self.scales, self.zeros, self.g_idx) if t is not None)


@dataclass
class IntExperts:
    """One projection of every expert of a MoE layer, stacked: `IntWeight`'s tensors with a leading
    expert dimension (``g_idx`` [experts, in] when the experts order their groups by activation)."""

    packed: torch.Tensor  # int32 [experts, out, in * bits / 32]
    scales: torch.Tensor  # float32 [experts, out, groups]
    zeros: torch.Tensor  # float32 [experts, out, groups]
    bits: int
    group: int
    g_idx: torch.Tensor | None  # int32 [experts, in]

    @property
    def shape(self) -> torch.Size:
        return torch.Size((*self.packed.shape[:2], self.packed.shape[2] * 32 // self.bits))

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (self.packed, self.scales, self.zeros, self.g_idx) if t is not None)

    def __len__(self) -> int:
        return self.packed.shape[0]

    def __getitem__(self, expert: int) -> IntWeight:
        g_idx = None if self.g_idx is None else self.g_idx[expert]
        return IntWeight(self.packed[expert], self.scales[expert], self.zeros[expert], self.bits, self.group, g_idx)


def stack_experts(weights: list[IntWeight]) -> IntExperts:
    """The experts' weights of one projection stacked; they must share bits and group size. Where
    some experts order their groups by activation, the others' runs are written out as a g_idx too."""
    first = weights[0]
    if any(w.bits != first.bits or w.group != first.group or w.shape != first.shape for w in weights):
        raise ValueError("a MoE layer's experts are quantized with different bits, group sizes or shapes")
    g_idx = None
    if any(w.g_idx is not None for w in weights):
        cols = first.shape[1]
        g_idx = torch.stack([group_index(cols, w.group, w.g_idx, w.packed.device).to(torch.int32) for w in weights])
    return IntExperts(torch.stack([w.packed for w in weights]), torch.stack([w.scales for w in weights]),
                      torch.stack([w.zeros for w in weights]), first.bits, first.group, g_idx)  # fmt: skip


def values_per_word(bits: int) -> int:
    if bits not in BITS:
        raise ValueError(f"{bits}-bit integer weights are not served ({' and '.join(map(str, BITS))} bits are)")
    return 32 // bits


def unpack_int32(packed: torch.Tensor, bits: int, dim: int, order: tuple[int, ...] | None = None) -> torch.Tensor:
    """The unsigned integers packed `32 // bits` to an int32 along `dim` (int32 in, int32 out: the
    packed dimension grows by `32 // bits`). Word element k holds bits [k * bits, (k + 1) * bits),
    and is the `order[k]`-th of its run of values (None: the k-th)."""
    per = values_per_word(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    moved = packed.movedim(dim, -1).to(torch.int32)
    values = (moved.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # [..., words, k]
    if order is not None:
        values = values[..., torch.argsort(torch.tensor(order, device=packed.device))]
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * per).movedim(-1, dim).contiguous()


def as_int32(words: torch.Tensor) -> torch.Tensor:
    """32-bit words held in int64 (0 .. 2^32 - 1) as the int32 tensors checkpoints store: the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_int32(values: torch.Tensor, bits: int) -> torch.Tensor:
    """The layout's `packed` for unsigned integers [out, in] (in a multiple of 32 // bits)."""
    per = values_per_word(bits)
    rows, cols = values.shape
    if cols % per:
        raise ValueError(f"{cols} input features do not pack into whole int32 words of {per} values of {bits} bits")
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    return as_int32((values.to(torch.int64).reshape(rows, cols // per, per) << shifts).sum(-1))


def group_index(cols: int, group: int, g_idx: torch.Tensor | None, device: torch.device) -> torch.Tensor:
    """The group of each of `cols` input columns: `g_idx`, else runs of `group` columns."""
    if g_idx is not None:
        return g_idx.to(device=device, dtype=torch.long)
    return torch.arange(cols, device=device) // group


def dequantize_int(
    packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
    g_idx: torch.Tensor | None, dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The float weight [out, in] the layout stands for, in `dtype` (formed in float32)."""
    return dequantize_values(unpack_int32(packed, bits, dim=1), scales, zeros, group, g_idx, dtype)


def dequantize_values(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int, g_idx: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:  # fmt: skip
    """The same for unsigned integers [out, in] not yet packed."""
    g = group_index(q.shape[1], group, g_idx, q.device)
    return ((q.to(torch.float32) - zeros.float()[:, g]) * scales.float()[:, g]).to(dtype)


def int_linear_torch(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, bits: int, group: int,
    g_idx: torch.Tensor | None = None, bias: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """x [M, in] @ dequantized weight.T (+ bias), in x's dtype."""
    return F.linear(x, dequantize_int(packed, scales, zeros, bits, group, g_idx, x.dtype), bias)

