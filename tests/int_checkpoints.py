"""Integer-quantized checkpoints of a float one, packed as each quantizer's reference code packs them,
written apart from the engine's reader (orca_backend/model/int_quant.py) so that a wrong bit order
there cannot hide here:

- GPTQ (AutoGPTQ / gptqmodel `QuantLinear.pack`): GPTQ's min/max quantizer (0 always in range), the
  integers of 32 // bits input rows shifted into each int32 word of `qweight` [in / per, out], the
  zero points the same way along the output in `qzeros` (format `gptq`: one subtracted from each
  field across the word, as gptqmodel converts them), fp16 `scales`
  [groups, out], `g_idx` [in]; `desc_act` draws an activation order per layer input (GPTQ orders by
  the input's Hessian, so q, k and v share one, as gate and up do), whose runs of `group` columns
  form the groups.
- AWQ (AutoAWQ `WQLinear_GEMM.from_linear`): AWQ's min/max quantizer, `qweight` [in, out / 8] with
  word element i holding output column `order_map[i]` of its eight, `qzeros` alike, fp16 `scales`.
- compressed-tensors pack-quantized: the compressed-tensors package itself (its qparams and its
  PackedQuantizationCompressor), with its own config classes writing quantization_config.

These packers were checked bit for bit against AutoAWQ 0.2.9's `WQLinear_GEMM.from_linear` and
GPTQModel 7.7.0's `pack` and v2 -> v1 conversion, run from their own sources (4 and 8 bits, symmetric
and not, desc_act; docs/quantization.md).

Each writer also returns the float weights its integers stand for, computed from its own integers
and scales (`dequantized_copy` saves them as a float checkpoint: the oracle where transformers does
not read the format).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

AWQ_ORDER_MAP = [0, 2, 4, 6, 1, 3, 5, 7]


def projections(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The decoder projections a quantizer converts (not the embedding, LM head or MoE router): the
    `*_proj` layers, and Mixtral's experts (`w1`, `w2`, `w3`)."""
    return [k[: -len(".weight")] for k in tensors if k.startswith("model.layers.")
            and (k.endswith("proj.weight") or re.search(r"\.experts\.\d+\.w[123]\.weight$", k))]  # fmt: skip


def minmax_quantize(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool, awq: bool):
    """GPTQ's (or AWQ's) round-to-nearest quantizer per group: (integers [out, in], fp16 scales
    [out, groups], zero points [out, groups]), the scales rounded to fp16 before the integers are
    formed, as the stored scales are what the checkpoint's readers use."""
    maxq = 2**bits - 1
    groups = int(g_idx.max()) + 1
    q = torch.empty(w.shape, dtype=torch.int64)
    scales = torch.empty(w.shape[0], groups)
    zeros = torch.empty(w.shape[0], groups, dtype=torch.int64)
    for g in range(groups):
        cols = (g_idx == g).nonzero().flatten()
        x = w[:, cols].double()
        lo, hi = x.min(1).values, x.max(1).values
        if awq:
            scale = ((hi - lo).clamp(min=1e-5) / maxq).half().double()
            zero = (-torch.round(lo / scale)).clamp(0, maxq)
        else:
            lo, hi = lo.clamp(max=0), hi.clamp(min=0)
            if sym:
                hi = torch.maximum(lo.abs(), hi)
                lo = -hi
            scale = ((hi - lo) / maxq).half().double()
            zero = torch.full_like(scale, (maxq + 1) / 2) if sym else torch.round(-lo / scale)
        q[:, cols] = torch.clamp(torch.round(x / scale[:, None]) + zero[:, None], 0, maxq).long()
        scales[:, g], zeros[:, g] = scale.float(), zero.long()
    return q, scales, zeros


def dequantize(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, g_idx: torch.Tensor) -> torch.Tensor:
    """The float32 weight: each entry's integer minus its group's zero point, times its group's scale."""
    return (q.float() - zeros.float()[:, g_idx]) * scales[:, g_idx]


def pack_rows(intweight: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's packing: row r of the result holds rows r * per .. r * per + per - 1 of `intweight`,
    row r * per + j shifted left by bits * j (as uint32, returned as int32)."""
    per = 32 // bits
    out = torch.zeros(intweight.shape[0] // per, intweight.shape[1], dtype=torch.int64)
    for r in range(out.shape[0]):
        for j in range(per):
            out[r] |= intweight[r * per + j] << (bits * j)
    return _as_int32(out)


def v1_zeros(qzeros: torch.Tensor, bits: int) -> torch.Tensor:
    """Format `gptq`'s packed zero points: one subtracted from every field of each uint32 word, across
    the word (gptqmodel's v2 -> v1 conversion; a zero point of 0 borrows from the field above)."""
    ones = sum(1 << shift for shift in range(0, 32, bits))
    return _as_int32(((qzeros.to(torch.int64) & 0xFFFFFFFF) - ones) & 0xFFFFFFFF)


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_awq(intweight: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM packing of [in, out] 4-bit integers: column c of the result holds columns
    8c .. 8c + 7, column 8c + order_map[i] shifted left by 4 i."""
    out = torch.zeros(intweight.shape[0], intweight.shape[1] // 8, dtype=torch.int64)
    for c in range(out.shape[1]):
        for i in range(8):
            out[:, c] |= intweight[:, c * 8 + AWQ_ORDER_MAP[i]] << (4 * i)
    return _as_int32(out)


def write_gptq(float_dir: Path, out: Path, bits: int, group: int, sym: bool = True, desc_act: bool = False,
               checkpoint_format: str = "gptq", seed: int = 0) -> dict[str, torch.Tensor]:  # fmt: skip
    """`float_dir` as GPTQ stores it; returns the float weights it stands for, by name."""
    tensors = load_file(str(float_dir / "model.safetensors"))
    stored, dense, orders = dict(tensors), {}, {}
    for layer in projections(tensors):
        w = stored.pop(layer + ".weight").float()
        cols = w.shape[1]
        size = group if group > 0 else cols
        source = layer.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        if source not in orders:  # one activation order per input (q, k and v share theirs, gate and up theirs)
            gen = torch.Generator().manual_seed(seed + len(orders))
            orders[source] = torch.randperm(cols, generator=gen) if desc_act else torch.arange(cols)
        order = orders[source]
        g_idx = torch.empty(cols, dtype=torch.long)
        g_idx[order] = torch.arange(cols) // size  # the j-th column in activation order is in group j // size
        q, scales, zeros = minmax_quantize(w, bits, g_idx, sym, awq=False)
        dense[layer + ".weight"] = dequantize(q, scales, zeros, g_idx)
        stored[layer + ".qweight"] = pack_rows(q.t().contiguous(), bits)
        qzeros = pack_rows(zeros, bits).t().contiguous()  # packed along the output
        stored[layer + ".qzeros"] = v1_zeros(qzeros, bits) if checkpoint_format == "gptq" else qzeros
        stored[layer + ".scales"] = scales.t().contiguous().half()
        stored[layer + ".g_idx"] = g_idx.to(torch.int32)
    _save(float_dir, out, stored, {"quant_method": "gptq", "bits": bits, "group_size": group, "desc_act": desc_act,
                                   "sym": sym, "checkpoint_format": checkpoint_format, "static_groups": False,
                                   "true_sequential": True, "damp_percent": 0.01})  # fmt: skip
    return dense


def write_awq(float_dir: Path, out: Path, group: int) -> dict[str, torch.Tensor]:
    """`float_dir` as AutoAWQ's GEMM version stores it (4 bits); returns the float weights by name."""
    tensors = load_file(str(float_dir / "model.safetensors"))
    stored, dense = dict(tensors), {}
    for layer in projections(tensors):
        w = stored.pop(layer + ".weight").float()
        g_idx = torch.arange(w.shape[1]) // group
        q, scales, zeros = minmax_quantize(w, 4, g_idx, sym=False, awq=True)
        dense[layer + ".weight"] = dequantize(q, scales, zeros, g_idx)
        stored[layer + ".qweight"] = pack_awq(q.t().contiguous())
        stored[layer + ".qzeros"] = pack_awq(zeros.t().contiguous())
        stored[layer + ".scales"] = scales.t().contiguous().half()
    _save(float_dir, out, stored, {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                   "version": "gemm", "modules_to_not_convert": None})  # fmt: skip
    return dense


def write_compressed_tensors(float_dir: Path, out: Path, bits: int, strategy: str, group: int | None,
                             sym: bool) -> dict[str, torch.Tensor]:  # fmt: skip
    """`float_dir` as llm-compressor saves a pack-quantized checkpoint, through the compressed-tensors
    package's own quantizer and compressor; returns the float weights it stands for (its own
    dequantization of its own integers)."""
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig, QuantizationScheme
    from compressed_tensors.quantization.lifecycle.forward import dequantize as ct_dequantize
    from compressed_tensors.quantization.lifecycle.forward import quantize as ct_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=bits, type="int", symmetric=sym, strategy=strategy, group_size=group)
    scheme = QuantizationScheme(targets=["Linear"], weights=args)
    tensors = load_file(str(float_dir / "model.safetensors"))
    stored, dense = dict(tensors), {}
    for layer in projections(tensors):
        w = stored.pop(layer + ".weight").float()
        grouped = w.reshape(w.shape[0], -1, group) if strategy == "group" else w.reshape(w.shape[0], 1, -1)
        scale, zero = calculate_qparams(grouped.amin(-1), grouped.amax(-1), args)
        zero = zero.round().to(torch.int8)
        q = ct_quantize(x=w, scale=scale, zero_point=zero, args=args, dtype=torch.int8)
        dense[layer + ".weight"] = ct_dequantize(x_q=q, scale=scale, zero_point=zero, args=args).float()
        state = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero},
                                                      scheme)  # fmt: skip
        stored |= {f"{layer}.{k}": v for k, v in state.items()}
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="pack-quantized", ignore=["lm_head"],
                                quantization_status="compressed")  # fmt: skip
    _save(float_dir, out, stored, config.model_dump(exclude_none=True) | {"quant_method": "compressed-tensors"})
    return dense


def _save(float_dir: Path, out: Path, stored: dict[str, torch.Tensor], quantization: dict) -> None:
    shutil.copytree(float_dir, out)
    save_file({k: v.contiguous() for k, v in stored.items()}, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))


def dequantized_copy(quant_dir: Path, dense: dict[str, torch.Tensor]) -> Path:
    """A float checkpoint beside `quant_dir`: its unquantized tensors, and `dense` for the projections."""
    out = quant_dir.parent / (quant_dir.name + "-dequantized")
    shutil.copytree(quant_dir, out)
    kept = {k: v for k, v in load_file(str(quant_dir / "model.safetensors")).items() if k.rsplit(".", 1)[0] + ".weight"
            not in dense}  # fmt: skip
    save_file(kept | dense, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return out
