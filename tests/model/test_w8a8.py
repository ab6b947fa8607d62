"""W8A8 checkpoints (compressed-tensors): int8 weights with int8 activations (llm-compressor's W8A8
preset, `int-quantized`) and FP8 weights with FP8 activations (its FP8_DYNAMIC preset,
`float-quantized`), activations quantized per token as the model runs.

Each checkpoint is written by the compressed-tensors package itself (its presets, calculate_qparams
and compressors), never by the engine's reader. The oracle is transformers' Llama holding the
package's own decompression of the weights, with every quantized projection's input rounded per
token as the scheme says (a forward pre-hook written here from the rule: s = max|x| / 127 or / 448,
codes round(x / s), read back times s). The engine's greedy tokens equal the oracle's exactly,
sound for these tiny float32 checkpoints (initializer_range 0.3); its log-probs differ from the same
weights with float activations (the activations' rounding is really applied).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from hf_tiny import hf_greedy, write_tiny
from safetensors.torch import load_file, save_file

from orca_backend import LLM, SamplingParams
from orca_backend.config import model_config_from_hf

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
PROMPTS = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 254, 9, 11], [3]]
MAX_TOKENS = 10
PRESETS = {"int8": ("W8A8", "int-quantized"), "fp8": ("FP8_DYNAMIC", "float-quantized")}


def write_ct(float_dir: Path, out: Path, preset: str, fmt: str) -> dict[str, torch.Tensor]:
    """`float_dir` quantized as llm-compressor saves `preset` (lm_head left in float), through the
    package's own qparams and compressor; returns the float weight each projection stands for (the
    package's decompression)."""
    from compressed_tensors.compressors.naive_quantized.base import (
        FloatQuantizationCompressor,
        IntQuantizationCompressor,
    )
    from compressed_tensors.quantization import QuantizationConfig, preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = preset_name_to_scheme(preset, ["Linear"])
    compressor = FloatQuantizationCompressor if fmt == "float-quantized" else IntQuantizationCompressor
    tensors = load_file(str(float_dir / "model.safetensors"))
    stored, dense = dict(tensors), {}
    for name in [k for k in tensors if k.startswith("model.layers.") and k.endswith("proj.weight")]:
        w = stored.pop(name).float()
        lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)  # channel: one scale per row
        scale, zero = calculate_qparams(lo, hi, scheme.weights)
        state = compressor.compress({"weight": w, "weight_scale": scale, "weight_zero_point": zero}, scheme)
        dense[name] = compressor.decompress(dict(state), scheme)["weight"].float()
        stored |= {f"{name[: -len('.weight')]}.{k}": v.contiguous() for k, v in state.items()}
    config = QuantizationConfig(config_groups={"group_0": scheme}, format=fmt, ignore=["lm_head"],
                                quantization_status="compressed")  # fmt: skip
    shutil.copytree(float_dir, out)
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = config.model_dump(exclude_none=True) | {"quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(raw))
    return dense


def round_per_token(x: torch.Tensor, act: str) -> torch.Tensor:
    """The scheme's dynamic per-token rounding of a projection's input, read back in float."""
    largest = 127.0 if act == "int8" else 448.0
    scale = x.abs().amax(dim=-1, keepdim=True) / largest
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    y = x / safe
    codes = torch.round(y).clamp(-128, 127) if act == "int8" else y.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return codes * scale


def oracle(model: torch.nn.Module, dense: dict[str, torch.Tensor], act: str | None) -> torch.nn.Module:
    """`model` holding `dense` weights, its projections' inputs rounded per token (`act`; None: not)."""
    import copy

    model = copy.deepcopy(model)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, weight in dense.items():
            params[name].copy_(weight)
    if act is not None:
        for name, module in model.named_modules():
            if name.startswith("model.layers.") and name.endswith("proj"):
                module.register_forward_pre_hook(lambda _m, args: (round_per_token(args[0], act),))
    return model


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    path = tmp_path_factory.mktemp("llama")
    return write_tiny("Llama", path, seed=13), path


@pytest.fixture(scope="module")
def w8a8(llama, tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    _, path = llama
    return {act: (out := tmp_path_factory.mktemp(f"w8a8-{act}") / "ckpt", write_ct(path, out, *PRESETS[act]))
            for act in PRESETS}  # fmt: skip


def engine_outputs(path: Path, **options) -> list:
    return LLM(str(path), dtype="float32", **options).generate(PROMPTS, SamplingParams(
        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0))  # fmt: skip


def chosen_logprobs(outputs: list) -> list[float]:
    return [lp[t].logprob for o in outputs for t, lp in zip(o.output_ids, o.logprobs, strict=True)]


@pytest.mark.parametrize("act", list(PRESETS))
def test_checkpoint_is_what_llm_compressor_ships(w8a8, act):
    path, _ = w8a8[act]
    tensors = load_file(str(path / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[q + ".weight"].dtype == (torch.int8 if act == "int8" else torch.float8_e4m3fn)
    assert tuple(tensors[q + ".weight_scale"].shape) == (64, 1)
    inputs = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"][
        "input_activations"]
    assert inputs["strategy"] == "token" and inputs["dynamic"] is True
    assert model_config_from_hf(path / "config.json").act_quant == act


@pytest.mark.parametrize("act", list(PRESETS))
def test_greedy_equals_transformers_with_activations_rounded_per_token(w8a8, llama, act):
    model, _ = llama
    path, dense = w8a8[act]
    expected = [hf_greedy(oracle(model, dense, act), prompt, MAX_TOKENS) for prompt in PROMPTS]
    outs = engine_outputs(path)
    assert [o.output_ids for o in outs] == expected


@pytest.mark.parametrize("act", list(PRESETS))
def test_the_activations_rounding_is_really_applied(w8a8, llama, tmp_path, act):
    """The same weights in float with float activations (a float checkpoint of the package's
    decompression) give other log-probs."""
    _, float_dir = llama
    path, dense = w8a8[act]
    weight_only = tmp_path / "weight-only"
    shutil.copytree(float_dir, weight_only)
    save_file(load_file(str(float_dir / "model.safetensors")) | {k: v.contiguous() for k, v in dense.items()},
              str(weight_only / "model.safetensors"), metadata={"format": "pt"})  # fmt: skip
    assert chosen_logprobs(engine_outputs(path)) != pytest.approx(chosen_logprobs(engine_outputs(weight_only)), abs=1e-4)


def test_tensor_parallelism_is_refused_naming_the_reason(w8a8):
    path, _ = w8a8["int8"]
    with pytest.raises(ValueError, match="W8A8 checkpoints are served with tensor_parallel_size 1"):
        LLM(str(path), dtype="float32", tensor_parallel_size=2)


@pytest.mark.parametrize(("change", "message"), [
    (lambda g: g["input_activations"].update(dynamic=False, strategy="tensor"), "input_activations"),
    (lambda g: g.pop("input_activations"), "input_activations"),
    (lambda g: g["input_activations"].update(num_bits=4), "input_activations"),
])  # fmt: skip
def test_schemes_not_served_are_refused(w8a8, tmp_path, change, message):
    """Static per-tensor activation scales, int-quantized weights without activations (weight-only
    int8 is pack-quantized), other activation widths: refused naming the field."""
    path, _ = w8a8["int8"]
    raw = json.loads((path / "config.json").read_text())
    change(raw["quantization_config"]["config_groups"]["group_0"])
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(tmp_path / "config.json")
