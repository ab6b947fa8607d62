"""What every model family declares (`Family`), read through the registry in families/__init__.py.

Plain data only, like the rest of families/: no torch, and nothing of the engine above it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# A dimension's [lo, hi) on this tensor-parallel rank (distributed.layout.ParallelLayout.shard), passed
# in so that the families need not import the layout.
Shard = Callable[[int], tuple[int, int]]


@dataclass(frozen=True)
class Projection:
    """One LoRA-able projection of a layer: its slices' (input, output) widths, unsharded."""

    name: str
    slices: tuple[tuple[int, int], ...]
    row_parallel: bool  # its input is split over tensor-parallel ranks (o, down); else its output is


@dataclass(frozen=True)
class LoRATargets:
    """How PEFT adapters map onto a family's layers: orca_backend/lora.py reads and checks them with
    these, model/lora.py shards them as the base weights are sharded."""

    projections: Callable[[Any], dict[str, Projection]]  # (config) -> a layer's LoRA-able projections
    peft_modules: dict[str, tuple[str, int]]  # PEFT module name, relative to a layer -> (projection, slice)
    peft_prefix: str  # where PEFT's keys find the layers: f"{peft_prefix}.{layer}.{module}.lora_A.weight"
    fan_in_fan_out: bool  # the base layers store [in, out] (GPT-2's Conv1D), as PEFT's config records
    # (config, shard, projection, slice) -> the rows of a column-parallel slice's output this rank holds
    output_rows: Callable[[Any, Shard, str, int], list[tuple[int, int]]]
    # (config, shard, projection) -> the columns of a row-parallel projection's input this rank holds
    input_columns: Callable[[Any, Shard, str], tuple[int, int]]


@dataclass(frozen=True)
class Family:
    """One model family: the config.json `architectures` it serves and everything the engine knows
    about them outside the model code. Its config class carries the K/V geometry every family
    exposes under the same names (`num_layers`, `num_kv_heads`, `head_dim`, `kv_window`,
    `max_context`, `hidden_size`)."""

    name: str  # the family's key (model_config_to_json, the model registry's messages)
    config_class: type
    architectures: tuple[str, ...]  # config.json's names for it, each served by this family's model code
    from_hf_dict: Callable[[dict[str, Any], str], Any]  # (config.json, its path for messages) -> config
    presets: dict[str, Any]  # name -> config: geometry only, with seeded random weights
    tp_divisible: Callable[[Any], list[tuple[str, int]]]  # (config) -> the (name, size) each tp rank splits
    lora: LoRATargets
    model: str  # the module of its model code (torch), whose MODEL_CODE model/registry.py reads
    fp8: bool = False  # FP8 (e4m3) checkpoints are served (model/fp8.py)
    model_types: tuple[str, ...] = ()  # config.json `model_type`s that name it when `architectures` is missing


def fp8_block(quantization: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The scale blocks (out, in) of an FP8 quantization_config (None: one scale per tensor), refusing
    a format or block shape model/fp8.py does not read."""
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{source}: FP8 format {quantization['fmt']!r} is not supported (e4m3 is)")
    block = quantization.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"{source}: weight_block_size {block!r} is not two positive sizes")
    return (int(block[0]), int(block[1])) if block is not None else None
