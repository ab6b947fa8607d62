"""LoRA weights as the model runs them: every resident adapter of every projection of this rank's
layers, stacked in slots (`LoRAStack`), and an adapter's checkpoint read into one slot's shape
(`read_adapter_weights`). The kernels (orca_kernels.lora, .triton_lora) add each token's delta.

A slot holds, per layer and projection, ``a`` [R, in] and ``b`` [out, R] with R = slices x
max_lora_rank: each slice of a fused projection (q, k, v of ``qkv``) owns R / slices rows of ``a``
and the matching columns of ``b``, over its own output rows only (b is block-diagonal), and an
adapter of rank r < max_lora_rank fills r of them; the rest are zeros, which add exact zeros. The
adapter's scaling is folded into ``b`` at load.

Tensor parallelism shards an adapter as its base weight is sharded. A column-parallel projection
(q/k/v, gate/up, GPT-2's c_attn and c_fc) splits its output: each rank holds the rows of ``b`` of its
heads or MLP slice and all of ``a``. A row-parallel one (o_proj, down_proj, GPT-2's c_proj) splits its
input: each rank holds its columns of ``a`` and all of ``b``, and adds ``(x_r a_r^T) b^T`` to its partial
product before the all-reduce, whose sum over ranks is ``(x a^T) b^T``: the base projection's one
all-reduce carries the adapter too, and no rank gathers the shrunk activations.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from safetensors.torch import load as load_safetensors

from orca_backend.distributed.layout import ParallelLayout
from orca_backend.families import Projection, family_of
from orca_backend.lora import LoRARequest, layer_projections, projections
from orca_kernels import KernelOps
from orca_kernels.lora import LoRAMetadata


def _output_ranges(model_config: object, layout: ParallelLayout, name: str, index: int) -> list[tuple[int, int]]:
    """The rows of a column-parallel slice's output this rank holds, as its base weight's shard (the
    family knows how its fused projections are laid out)."""
    return family_of(model_config).lora.output_rows(model_config, layout.shard, name, index)


def _input_range(model_config: object, layout: ParallelLayout, name: str) -> tuple[int, int]:
    """The columns of a row-parallel projection's input this rank holds."""
    return family_of(model_config).lora.input_columns(model_config, layout.shard, name)


def _local_widths(model_config: object, layout: ParallelLayout, projection: Projection) -> tuple[int, list[int]]:
    """(input width, each slice's output width) of a projection on this rank."""
    if projection.row_parallel:
        lo, hi = _input_range(model_config, layout, projection.name)
        return hi - lo, [out for _, out in projection.slices]
    outs = [sum(hi - lo for lo, hi in _output_ranges(model_config, layout, projection.name, i))
            for i in range(len(projection.slices))]  # fmt: skip
    return projection.slices[0][0], outs


# (local layer index, projection) -> (a [R, in], b [out, R]) of one adapter, in a slot's shape
AdapterWeights = dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_adapter_weights(
    lora: LoRARequest, data: bytes, modules: dict[tuple[int, str, int], tuple[str, str]], model_config: object,
    layout: ParallelLayout, max_rank: int, dtype: torch.dtype,
) -> AdapterWeights:  # fmt: skip
    """An adapter's tensors for this rank's layers and shards, on the host, padded to a slot's shape,
    from its weights file's bytes and module table (orca_backend.lora.read_registered_weights, which
    checked every key, shape and value)."""
    projs = projections(model_config)
    layers = layout.layers(model_config.num_layers)
    out: AdapterWeights = {}
    tensors = load_safetensors(data)
    for (layer, name, index), (key_a, key_b) in modules.items():
        if layer not in layers:
            continue
        projection = projs[name]
        fan_in, outs = _local_widths(model_config, layout, projection)
        local = (layer - layers.start, name)
        if local not in out:
            out[local] = (torch.zeros(len(projection.slices) * max_rank, fan_in),
                          torch.zeros(sum(outs), len(projection.slices) * max_rank))  # fmt: skip
        a_slot, b_slot = out[local]
        a, b = tensors[key_a].float(), tensors[key_b].float() * lora.scaling
        if projection.row_parallel:
            lo, hi = _input_range(model_config, layout, name)
            a = a[:, lo:hi]
        else:
            b = torch.cat([b[lo:hi] for lo, hi in _output_ranges(model_config, layout, name, index)])
        rows = slice(index * max_rank, index * max_rank + lora.rank)
        first = sum(outs[:index])
        a_slot[rows] = a
        b_slot[first : first + outs[index], rows] = b
    return {key: (a.to(dtype), b.to(dtype)) for key, (a, b) in out.items()}


@dataclass
class LoRAProjectionStack:
    a: torch.Tensor  # [slots, R, in]
    b: torch.Tensor  # [slots, out, R]


class LoRAStack:
    """The slots of every LoRA-able projection of this rank's layers, zero until an adapter is loaded."""

    def __init__(
        self, model_config: object, layout: ParallelLayout, max_loras: int, max_rank: int, dtype: torch.dtype,
        device: torch.device,
    ) -> None:  # fmt: skip
        self.max_loras, self.max_rank = max_loras, max_rank
        projs = projections(model_config)
        self.layers: list[dict[str, LoRAProjectionStack]] = []
        for layer in layout.layers(model_config.num_layers):
            stacks = {}
            for name in layer_projections(model_config, layer):
                fan_in, outs = _local_widths(model_config, layout, projs[name])
                rank = len(projs[name].slices) * max_rank
                stacks[name] = LoRAProjectionStack(torch.zeros(max_loras, rank, fan_in, dtype=dtype, device=device),
                                                   torch.zeros(max_loras, sum(outs), rank, dtype=dtype, device=device))  # fmt: skip
            self.layers.append(stacks)
        # projection -> the slots whose adapter targets it in some layer: a step runs a projection's
        # kernels only when one of its tokens' adapters does
        self.targets: dict[str, set[int]] = {name: set() for name in projs}

    def load(self, slot: int, weights: AdapterWeights) -> None:
        """Puts an adapter in a slot; what it does not target becomes zeros."""
        for targeted in self.targets.values():
            targeted.discard(slot)
        for index, stacks in enumerate(self.layers):
            for name, stack in stacks.items():
                pair = weights.get((index, name))
                if pair is None:
                    stack.a[slot].zero_()
                    stack.b[slot].zero_()
                else:
                    stack.a[slot].copy_(pair[0])
                    stack.b[slot].copy_(pair[1])
                    self.targets[name].add(slot)

    def num_bytes(self) -> int:
        return sum(s.a.nbytes + s.b.nbytes for stacks in self.layers for s in stacks.values())

    def step(self, ops: KernelOps, meta: LoRAMetadata | None) -> LoRAStep | None:
        """What a forward adds its adapters with this step: None when no token runs an adapter."""
        if meta is None:
            return None
        if meta.host_counts is None:  # a CUDA graph's mapping: the same launches whatever the step's adapters
            return LoRAStep(self, ops, meta, set(self.targets))
        active = {slot for slot, count in enumerate(meta.host_counts) if count}
        targeted = {name for name, slots in self.targets.items() if slots & active}
        return LoRAStep(self, ops, meta, targeted) if targeted else None


@dataclass
class LoRAStep:
    stack: LoRAStack
    ops: KernelOps
    meta: LoRAMetadata
    targeted: set[str]  # the projections some token's adapter targets this step

    def add(self, layer: int, name: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] += each token's adapter delta for projection `name` of local layer `layer`, x its input."""
        if name in self.targeted:
            stack = self.stack.layers[layer][name]
            self.ops.lora(y, x, stack.a, stack.b, self.meta)

    def adder(self, layer: int, name: str) -> Callable[[torch.Tensor, torch.Tensor], None] | None:
        """`add` bound to one projection, for row_parallel_linear; None if no token's adapter targets it."""
        if name not in self.targeted:
            return None
        return lambda x, y: self.add(layer, name, x, y)
