"""A checkpoint's `quantization_config`, read into the fields a family's config carries for it.

Served, for the families whose `Family.quant_methods` name them:
- `fp8`: e4m3 weights with per-tensor or block scales (model/fp8.py);
- `gptq`: 4- or 8-bit integers packed along the input (GPTQ's own `gptq` format, whose zero points
  are stored minus one, and gptqmodel's `gptq_v2`), group or channel scales, symmetric or not, with
  `desc_act`'s activation-ordered groups (`g_idx`);
- `awq`: AutoAWQ's GEMM packing (4 bits, interleaved along the output), with zero points;
- `compressed-tensors` (llm-compressor): `pack-quantized` integer weights of 4 or 8 bits (group,
  channel or tensor scales, symmetric or not) and `float-quantized` FP8 weights (per tensor or per
  channel); W8A8, `int-quantized` int8 or `float-quantized` FP8 weights with one scale per row (or
  tensor) and activations quantized per token as the model runs (dynamic, symmetric: llm-compressor's
  W8A8 and FP8_DYNAMIC schemes; kernels/orca_kernels/w8a8.py); and its `kv_cache_scheme` of FP8 K/V with static per-tensor or per-head
  scales (`k_scale` / `v_scale`, used with kv_cache_dtype fp8: model/kv_scales.py), beside weights
  or alone.
Everything else is refused at load naming the field and value, since it would load and answer
wrongly. The integer formats' tensors are read by model/int_quant.py.
"""

from __future__ import annotations

from typing import Any

INT_FORMATS = ("gptq", "gptq_v2", "awq", "compressed-tensors")
METHODS = ("fp8", "gptq", "awq", "compressed-tensors")


def quantization_fields(quantization: dict[str, Any], source: str) -> dict[str, Any]:
    """The config fields (`fp8`, `fp8_block`; `int_format`, `int_bits`, `int_group`, `int_symmetric`,
    `int_act_order`; `act_quant`; `kv_scales`) for a served `quantization_config`; refuses any other."""
    method = quantization.get("quant_method")
    if method == "fp8":
        return {"fp8": True, "fp8_block": fp8_block(quantization, source)}
    if method == "gptq":
        return _gptq(quantization, source)
    if method == "awq":
        return _awq(quantization, source)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization, source)
    raise ValueError(f"{source}: quantization_config quant_method {method!r} is not supported (served: "
                     f"{', '.join(METHODS)})")  # fmt: skip


def fp8_block(quantization: dict[str, Any], source: str) -> tuple[int, int] | None:
    """The scale blocks (out, in) of an FP8 quantization_config (None: one scale per tensor), refusing
    a format or block shape model/fp8.py does not read."""
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{source}: FP8 format {quantization['fmt']!r} is not supported (e4m3 is)")
    block = quantization.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"{source}: weight_block_size {block!r} is not two positive sizes")
    return (int(block[0]), int(block[1])) if block is not None else None


def _refuse(source: str, method: str, field: str, value: Any, served: str) -> ValueError:
    return ValueError(f"{source}: {method} quantization_config {field}={value!r} is not served ({served})")


def _bits(value: Any, source: str, method: str, field: str) -> int:
    if value not in (4, 8):
        raise _refuse(source, method, field, value, "4 or 8 bits")
    return int(value)


def _group(value: Any, source: str, method: str, field: str) -> int:
    """Columns per scale group; 0 for one group per row (GPTQ's and AWQ's -1)."""
    if value in (-1, None, 0):
        return 0
    if not isinstance(value, int) or value < 1:
        raise _refuse(source, method, field, value, "a positive group size, or -1 for one per row")
    return value


def _gptq(q: dict[str, Any], source: str) -> dict[str, Any]:
    checkpoint_format = q.get("checkpoint_format", q.get("format", "gptq"))
    if checkpoint_format not in ("gptq", "gptq_v2") or q.get("is_marlin_format"):
        raise _refuse(source, "gptq", "checkpoint_format", checkpoint_format, "gptq and gptq_v2 packing")
    return {"int_format": checkpoint_format, "int_bits": _bits(q.get("bits"), source, "gptq", "bits"),
            "int_group": _group(q.get("group_size", 128), source, "gptq", "group_size"),
            "int_symmetric": bool(q.get("sym", True)), "int_act_order": bool(q.get("desc_act", False))}  # fmt: skip


def _awq(q: dict[str, Any], source: str) -> dict[str, Any]:
    version = str(q.get("version", "gemm")).lower()
    if version != "gemm":
        raise _refuse(source, "awq", "version", q.get("version"), "AutoAWQ's GEMM packing, version 'gemm'")
    if not q.get("zero_point", True):
        raise _refuse(source, "awq", "zero_point", q["zero_point"], "AWQ with zero points")
    bits = q.get("bits", q.get("w_bit"))
    if bits != 4:
        raise _refuse(source, "awq", "bits", bits, "4 bits")
    group = _group(q.get("group_size", q.get("q_group_size", 128)), source, "awq", "group_size")
    return {"int_format": "awq", "int_bits": 4, "int_group": group, "int_symmetric": False, "int_act_order": False}


def _kv_cache_scheme(scheme: dict[str, Any], source: str) -> dict[str, Any]:
    """compressed-tensors' K/V scheme: FP8 e4m3 with static scales per tensor or per K/V head, stored
    as each attention's k_scale and v_scale."""
    if scheme.get("type") != "float" or scheme.get("num_bits") != 8 or scheme.get("dynamic") \
            or not scheme.get("symmetric", True) or scheme.get("strategy", "tensor") not in ("tensor", "attn_head"):  # fmt: skip
        raise _refuse(source, "compressed-tensors", "kv_cache_scheme", scheme,
                      "FP8 K/V with static per-tensor or per-head scales")  # fmt: skip
    return {"kv_scales": True}


def _compressed_tensors(q: dict[str, Any], source: str) -> dict[str, Any]:
    name = "compressed-tensors"
    for field in ("sparsity_config", "transform_config"):
        if q.get(field):
            raise _refuse(source, name, field, q[field], "dense weights with no sparsity or transform scheme")
    kv = _kv_cache_scheme(q["kv_cache_scheme"], source) if q.get("kv_cache_scheme") else {}
    groups = list((q.get("config_groups") or {}).values())
    if not groups:
        if kv:  # K/V scales alone: the weights are float
            return kv
        raise _refuse(source, name, "config_groups", q.get("config_groups"), "one weight scheme")
    return kv | _weight_scheme(q, groups, source)


def _input_activations(inputs: dict[str, Any], source: str) -> str:
    """The activations' format ("int8" or "fp8") of a W8A8 scheme: 8 bits, symmetric, scaled per
    token at run time (static per-tensor activation scales are not served)."""
    kind = {"int": "int8", "float": "fp8"}.get(inputs.get("type", ""))
    if kind is None or inputs.get("num_bits") != 8 or inputs.get("strategy") != "token" or not inputs.get("dynamic") \
            or not inputs.get("symmetric", True):  # fmt: skip
        raise _refuse(source, "compressed-tensors", "input_activations", inputs,
                      "8-bit int or FP8 activations quantized per token at run time (dynamic, symmetric)")  # fmt: skip
    return kind


def _weight_scheme(q: dict[str, Any], groups: list[dict[str, Any]], source: str) -> dict[str, Any]:
    name = "compressed-tensors"
    schemes = [(g.get("weights"), g.get("input_activations"), g.get("output_activations"),
                g.get("format", q.get("format"))) for g in groups]  # fmt: skip
    if any(s != schemes[0] for s in schemes[1:]):
        raise _refuse(source, name, "config_groups", q["config_groups"], "one scheme for every quantized layer")
    weights, inputs, outputs, fmt = schemes[0]
    if outputs:
        raise _refuse(source, name, "output_activations", outputs, "weights and input activations only")
    if not weights:
        raise _refuse(source, name, "weights", weights, "quantized weights")
    act = _input_activations(inputs, source) if inputs else ""
    strategy = weights.get("strategy", "tensor")
    if fmt == "float-quantized":
        if weights.get("type") != "float" or weights.get("num_bits") != 8 or strategy not in ("tensor", "channel"):
            raise _refuse(source, name, "weights", weights, "FP8 e4m3 weights with tensor or channel scales")
        if act not in ("", "fp8"):
            raise _refuse(source, name, "input_activations", inputs, "FP8 activations over FP8 weights")
        return {"fp8": True, "fp8_block": None, "act_quant": act}
    if fmt == "int-quantized":
        if weights.get("type") != "int" or weights.get("num_bits") != 8 or strategy not in ("tensor", "channel") \
                or not weights.get("symmetric", True):  # fmt: skip
            raise _refuse(source, name, "weights", weights, "symmetric int8 weights with tensor or channel scales")
        if act != "int8":
            raise _refuse(source, name, "input_activations", inputs, "int8 activations over int-quantized weights "
                          "(weight-only int8 is served as pack-quantized)")  # fmt: skip
        return {"act_quant": "int8"}
    if act:
        raise _refuse(source, name, "input_activations", inputs, "quantized activations over int-quantized int8 or "
                      "float-quantized FP8 weights (W8A8); pack-quantized weights are weight-only (W4A16, W8A16)")  # fmt: skip
    if fmt != "pack-quantized":
        raise _refuse(source, name, "format", fmt, "pack-quantized and float-quantized")
    if weights.get("type") != "int":
        raise _refuse(source, name, "weights.type", weights.get("type"), "int")
    if weights.get("actorder") not in (None, "weight", False):
        raise _refuse(source, name, "weights.actorder", weights["actorder"], "none or 'weight' (g_idx is not read)")
    if strategy not in ("group", "channel", "tensor"):
        raise _refuse(source, name, "weights.strategy", strategy, "group, channel or tensor")
    if strategy == "tensor" and not weights.get("symmetric", True):
        raise _refuse(source, name, "weights.symmetric", False, "asymmetric weights with group or channel scales")
    group = _group(weights.get("group_size"), source, name, "weights.group_size") if strategy == "group" else 0
    if strategy == "group" and not group:
        raise _refuse(source, name, "weights.group_size", weights.get("group_size"), "a positive group size")
    return {"int_format": name, "int_bits": _bits(weights.get("num_bits"), source, name, "weights.num_bits"),
            "int_group": group, "int_symmetric": bool(weights.get("symmetric", True)), "int_act_order": False}  # fmt: skip
