"""FP8 checkpoints (quant_method "fp8", e4m3): reading their linear weights with their scales.

Two layouts are read (kernels/orca_kernels/fp8.py says what a weight and its scales stand for):
- block-scaled, as Qwen3-FP8 and DeepSeek ship (`weight_block_size` in the config): each `*.weight`
  is FP8 beside a float32 `*.weight_scale_inv` of one scale per block;
- per-tensor (no `weight_block_size`): one `*.weight_scale` per weight, read as the block (1, in);
  so is compressed-tensors' float-quantized `channel` strategy, one scale per row.

On CUDA the weights stay FP8 and every linear layer over them is the Triton dequantizing GEMM
(gemm.linear). Elsewhere they are dequantized once, at load, into the engine's dtype: a CPU has no
FP8 arithmetic, and a float weight read once per step costs what the dequantization would every
step (a documented choice: the memory saving is the GPU's). Activations are never quantized (the
checkpoints' `input_scale`s are not used), as transformers' dequantizing load does too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca_backend.model.checkpoint import WeightSource
from orca_kernels.fp8 import dequantize_fp8


@dataclass
class Fp8Weight:
    """A linear layer's FP8 weight [out, in] and its float32 scales [ceil(out / block[0]), ceil(in / block[1])]."""

    weight: torch.Tensor
    scale: torch.Tensor
    block: tuple[int, int]

    @property
    def shape(self) -> torch.Size:
        return self.weight.shape

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes


def read_fp8_linear(
    src: WeightSource, name: str, block: tuple[int, int] | None, dim: int | None, lo: int, hi: int | None,
    device: torch.device,
) -> Fp8Weight:  # fmt: skip
    """The FP8 weight `name` (rows or columns [lo, hi) along `dim`, a tensor-parallel shard) with its
    scales. A shard must start and end on block boundaries (its scales are whole blocks)."""
    weight = src.get(name, dim, lo, hi)
    if block is None:  # per tensor or per row (compressed-tensors' channel strategy): the block (1, in)
        scale = src.get(name + "_scale").reshape(-1, 1).to(torch.float32)
        if scale.shape[0] == 1:
            scale = scale.expand(weight.shape[0], 1)
        elif dim == 0:
            scale = scale[lo:hi]
        return Fp8Weight(weight.to(device), scale.contiguous().to(device), (1, weight.shape[1]))
    scale = src.get(name + "_scale_inv").to(torch.float32)
    if dim is not None:
        size, extent = block[dim], src.shape(name)[dim]
        end = extent if hi is None else hi
        if lo % size or (end % size and end != extent):
            raise ValueError(f"{name}: a tensor-parallel shard [{lo}, {end}) along dimension {dim} does not fall on "
                             f"the checkpoint's FP8 blocks of {size}; choose a tensor_parallel_size that splits whole "
                             "blocks")  # fmt: skip
        index = [slice(None), slice(None)]
        index[dim] = slice(lo // size, -(-end // size))
        scale = scale[tuple(index)]
    return Fp8Weight(weight.to(device).contiguous(), scale.contiguous().to(device), block)


def load_fp8_linear(
    src: WeightSource, name: str, fp8_block: tuple[int, int] | None, dim: int | None, lo: int, hi: int | None,
    dtype: torch.dtype, device: torch.device,
) -> torch.Tensor | Fp8Weight:  # fmt: skip
    """An FP8 linear weight (a shard of it along `dim`): FP8 on CUDA, dequantized to `dtype`
    elsewhere (the whole tensor, then the shard: any split works)."""
    if device.type == "cuda":
        return read_fp8_linear(src, name, fp8_block, dim, lo, hi, device)
    whole = read_fp8_linear(src, name, fp8_block, None, 0, None, torch.device("cpu"))
    dense = dequantize_fp8(whole.weight, whole.scale, whole.block, dtype)
    if dim is not None:
        dense = dense.narrow(dim, lo, (dense.shape[dim] if hi is None else hi) - lo)
    return dense.to(device).contiguous()


def concat_fp8_rows(parts: list[Fp8Weight]) -> Fp8Weight:
    """FP8 projections stacked along `out` with their scales: each part but the last must hold whole
    blocks of rows."""
    block = parts[0].block
    for part in parts[:-1]:
        if part.block != block or part.shape[0] % block[0]:
            raise ValueError(f"FP8 projections of {part.shape[0]} rows do not stack on blocks of {block[0]} rows")
    return Fp8Weight(torch.cat([p.weight for p in parts]), torch.cat([p.scale for p in parts]), block)
