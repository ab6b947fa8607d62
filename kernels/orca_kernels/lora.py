"""Multi-LoRA for selective batching: the torch reference, which the CPU runs.

Requests with different adapters, and with none, share one flat batch. The base projection runs once
on every token; then each token adds its own adapter's low-rank delta,
``y[t] += (x[t] A[s]^T) B[s]^T`` with ``s`` its adapter's slot, computed for all tokens at once as
Punica's SGMV does: the tokens are grouped by slot (`LoRAMetadata`, built once per step and shared
by every layer), and each active slot's tokens are gathered, shrunk by A (to the rank) and expanded
by B, so a step reads each active adapter's weights once per projection. Tokens without an adapter
(slot -1) are left alone.

The weights of every slot are stacked: ``a`` [slots, R, in] and ``b`` [slots, out, R], R the stack's
rank. An adapter of a smaller rank is zero-padded, and a fused projection (q/k/v, gate/up) stacks the
slices' ranks with B block-diagonal; the zeros add exact zeros, so padding changes no result. The
adapter's scaling (alpha / r) is folded into B when the slot is loaded (orca_backend/model/lora.py).
kernels/orca_kernels/triton_lora.py is the GPU's grouped shrink and expand over the same metadata.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class LoRAMetadata:
    """A step's token-to-adapter mapping (every tensor on the model's device).

    `sorted_tokens` lists the token indices grouped by slot, tokens without an adapter first; slot s
    owns entries ``slot_starts[s] : slot_starts[s] + slot_counts[s]``. The host copies of the counts
    and starts let the CPU path slice without reading the device; the Triton kernels read only the
    device tensors, so their launches do not depend on the mapping. A CUDA graph's mapping (static
    buffers, worker/cuda_graphs.py) has no host copies (None): what a step's adapters are is then on
    the device alone, and the model runs the kernels of every projection an adapter may target."""

    token_slots: torch.Tensor  # int32 [T]: each token's slot, -1 for none
    sorted_tokens: torch.Tensor  # int32 [T]
    slot_starts: torch.Tensor  # int32 [S]
    slot_counts: torch.Tensor  # int32 [S]
    host_starts: list[int] | None
    host_counts: list[int] | None

    @property
    def num_slots(self) -> int:
        return self.slot_counts.numel()

    def host_mapping(self) -> tuple[list[int], list[int]]:
        """(starts, counts) on the host: the copies, or else a read of the device tensors (the CPU
        path, which never runs in a graph)."""
        if self.host_starts is None or self.host_counts is None:
            return self.slot_starts.tolist(), self.slot_counts.tolist()
        return self.host_starts, self.host_counts


def sort_by_slot(slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(sorted_tokens, slot_starts, slot_counts), int32, of tokens whose adapter slots are `slots` (-1:
    none): the token indices by slot, stably, tokens without an adapter first."""
    order = np.argsort(slots, kind="stable").astype(np.int32)  # slot -1 first, then 0, 1, ...
    counts = np.bincount(slots + 1, minlength=num_slots + 1).astype(np.int32)
    starts = (np.cumsum(counts) - counts).astype(np.int32)
    return order, starts[1:], counts[1:]


def lora_metadata(token_slots: np.ndarray, num_slots: int, device: torch.device | str) -> LoRAMetadata:
    """The metadata of a step whose token t runs the adapter in slot ``token_slots[t]`` (-1: none)."""
    slots = np.asarray(token_slots, dtype=np.int32)
    if slots.size and (slots.min() < -1 or slots.max() >= num_slots):
        raise ValueError(f"token slots must lie in [-1, {num_slots}), got {slots.min()}..{slots.max()}")
    order, starts, counts = sort_by_slot(slots, num_slots)

    def on_device(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array).to(device, non_blocking=True)

    return LoRAMetadata(on_device(slots), on_device(order), on_device(starts.copy()), on_device(counts.copy()),
                        starts.tolist(), counts.tolist())  # fmt: skip


def lora_torch(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata) -> None:
    """Adds each token's adapter delta to ``y`` [T, out] in place; x [T, in], a [S, R, in], b [S, out, R].
    The shrink is computed in float32 (the Triton kernels accumulate in it too)."""
    tokens = x.shape[0]
    host_starts, host_counts = meta.host_mapping()
    for slot, count in enumerate(host_counts):
        if not count:
            continue
        a_s, b_s = a[slot].to(torch.float32), b[slot].to(torch.float32)
        if count == tokens:  # every token runs this adapter: no gather
            y += F.linear(F.linear(x.to(torch.float32), a_s), b_s).to(y.dtype)
            continue
        start = host_starts[slot]
        index = meta.sorted_tokens[start : start + count].long()
        delta = F.linear(F.linear(x.index_select(0, index).to(torch.float32), a_s), b_s)
        y.index_add_(0, index, delta.to(y.dtype))
