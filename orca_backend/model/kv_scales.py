"""An FP8 K/V pool's dtype and scales (kv_cache_dtype fp8, vLLM's name).

A token's K is stored as fp8(k / k_scale) and read back as code * k_scale (kernels' attention.py),
one scale per layer and K/V head for K and one for V. Where the checkpoint has them they come from
it, as quantizers write them: `self_attn.k_scale` / `v_scale` (llm-compressor's compressed-tensors
`kv_cache_scheme`, ModelOpt), or `self_attn.k_proj.output_scale` / `v_proj.output_scale` (AMMO,
Quark), each a scalar (per tensor) or one per K/V head. Elsewhere they are 1.0, vLLM's default:
e4m3 holds magnitudes up to 448 with 3 mantissa bits, and K/V rarely passes a few tens, so most
values keep about two significant digits; a checkpoint calibrated by a quantizer does better.
vLLM's `calculate_kv_scales` (scales from the first batch a server sees) is not served: it would
make every later answer depend on which request came first.
"""

from __future__ import annotations

import logging

import torch

from orca_backend.distributed.layout import ParallelLayout
from orca_backend.model.checkpoint import WeightSource
from orca_kernels.attention import KVScales

logger = logging.getLogger("orca.model")

# kv_cache_dtype -> the pool's torch dtype ("auto": the model's)
FP8_POOL_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_pool_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    return FP8_POOL_DTYPES.get(kv_cache_dtype, model_dtype)


def load_kv_scales(
    source: WeightSource, scale_names: list[list[tuple[str, str]]], num_kv_heads: int, layout: ParallelLayout,
    kv_cache_dtype: str, device: torch.device, declared: bool = False,
) -> list[KVScales | None]:  # fmt: skip
    """Each of this stage's layers' scales for an FP8 pool (None for each with kv_cache_dtype auto):
    `scale_names[i]` lists layer i's candidate (k, v) tensor names in the checkpoint, in the order
    tried; this rank takes its K/V heads' share of per-head scales. `declared`: the checkpoint's
    quantization_config says it holds them (a checkpoint that then holds none is refused)."""
    stored = [next(((k, v) for k, v in names if k in source and v in source), None) for names in scale_names]
    found = sum(pair is not None for pair in stored)
    if declared and scale_names and not found:
        raise ValueError(f"the checkpoint's quantization_config declares FP8 K/V scales (kv_cache_scheme), but it "
                         f"holds none ({scale_names[0][0][0]} is missing)")  # fmt: skip
    if kv_cache_dtype == "auto":
        if found:
            first = next(pair for pair in stored if pair is not None)
            logger.warning("the checkpoint holds FP8 K/V scales (%s, ...), unused: K/V is kept in the model's dtype "
                           "(set kv_cache_dtype=fp8 to use them)", first[0])  # fmt: skip
        return [None] * len(scale_names)
    if found and found != len(stored):
        missing = [i for i, pair in enumerate(stored) if pair is None]
        raise ValueError(f"kv_cache_dtype={kv_cache_dtype}: the checkpoint holds K/V scales for some layers only "
                         f"(none for this stage's layers {missing[:8]}): {scale_names[missing[0]][0]} is missing")  # fmt: skip
    if not found:
        logger.warning("kv_cache_dtype=%s: the checkpoint holds no K/V scales (k_scale, v_scale): every scale is 1.0, "
                       "as vLLM's default", kv_cache_dtype)  # fmt: skip
    lo, hi = layout.shard(num_kv_heads)
    ones = torch.ones(hi - lo, dtype=torch.float32, device=device)
    return [KVScales(ones, ones) if pair is None else
            KVScales(*(_heads(source, name, num_kv_heads, lo, hi, device) for name in pair)) for pair in stored]  # fmt: skip


def _heads(source: WeightSource, name: str, num_kv_heads: int, lo: int, hi: int, device: torch.device) -> torch.Tensor:
    """A stored scale as this rank's K/V heads' float32 scales: a scalar repeated, or its heads' slice."""
    scale = source.get(name).float().flatten()
    if scale.numel() == 1:
        scale = scale.expand(num_kv_heads)
    elif scale.numel() != num_kv_heads:
        raise ValueError(f"K/V scale {name} holds {scale.numel()} values: one (per tensor) or one per K/V head "
                         f"({num_kv_heads}) are served")  # fmt: skip
    if not bool((scale > 0).all()) or not bool(scale.isfinite().all()):
        raise ValueError(f"K/V scale {name} must be positive and finite, got {scale.tolist()}")
    return scale[lo:hi].contiguous().to(device)
