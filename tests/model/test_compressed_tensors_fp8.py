"""compressed-tensors `float-quantized` checkpoints (llm-compressor's FP8 weights, e4m3, with one
scale per tensor or one per output row), weights only, served through the FP8 path (model/fp8.py).

Each checkpoint is written by the compressed-tensors package itself (its `calculate_qparams` and its
FloatQuantizationCompressor, its QuantizationConfig writing quantization_config), never by the
engine's reader. The oracle is transformers' own dequantizing load of the same directory
(CompressedTensorsConfig(dequantize=True)), whose weights are checked to be the package's own
decompression: the engine's greedy tokens equal its tokens exactly, which is sound for these tiny
float32 checkpoints (initializer_range 0.3: the top logits are far apart, so no rounding of the
summation order can turn a token). Their log-probs differ from the unquantized checkpoint's (the
FP8 rounding is really served), tensor parallelism equals one process, the shards the CUDA path
reads carry their rows' scales, and an FP8 scheme whose activations have a static scale is refused
when the config is read, naming input_activations (activations quantized per token at run time are
served: tests/model/test_w8a8.py)."""

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
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.fp8 import read_fp8_linear
from orca_kernels.fp8 import dequantize_fp8

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 254, 9, 11], [3]]
STRATEGIES = ["tensor", "channel"]


def weight_only_fp8(strategy: str):
    """compressed-tensors' scheme of FP8 e4m3 weights (symmetric, static scales) and float activations."""
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    args = QuantizationArgs(num_bits=8, type="float", symmetric=True, strategy=strategy, dynamic=False)
    return QuantizationScheme(targets=["Linear"], weights=args)


def write_ct_fp8(float_dir: Path, out: Path, scheme) -> dict[str, torch.Tensor]:
    """`float_dir` as llm-compressor saves a float-quantized checkpoint of `scheme` (lm_head left in
    float), through the compressed-tensors package's own qparams and compressor; returns the float
    weights each projection stands for, by name: the package's own decompression of what it stored."""
    from compressed_tensors.compressors.naive_quantized.base import FloatQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.utils import calculate_qparams

    args = scheme.weights
    tensors = load_file(str(float_dir / "model.safetensors"))
    stored, dense = dict(tensors), {}
    for name in [k for k in tensors if k.startswith("model.layers.") and k.endswith("proj.weight")]:
        layer = name[: -len(".weight")]
        w = stored.pop(name).float()
        if args.strategy == "channel":  # one scale per output row: [out, 1], as its observers shape it
            lo, hi = w.amin(dim=1, keepdim=True), w.amax(dim=1, keepdim=True)
        else:  # one scale per tensor: [1]
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        scale, zero = calculate_qparams(lo, hi, args)
        state = {"weight": w, "weight_scale": scale, "weight_zero_point": zero}
        state = FloatQuantizationCompressor.compress(state, scheme)  # drops the symmetric zero point
        dense[name] = FloatQuantizationCompressor.decompress(dict(state), scheme)["weight"].float()
        stored |= {f"{layer}.{k}": v for k, v in state.items()}
    config = QuantizationConfig(config_groups={"group_0": scheme}, format="float-quantized",
                                ignore=["lm_head"], quantization_status="compressed")  # fmt: skip
    shutil.copytree(float_dir, out)
    stored = {k: v.contiguous() for k, v in stored.items()}
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    raw = json.loads((out / "config.json").read_text())
    raw["quantization_config"] = config.model_dump(exclude_none=True) | {"quant_method": "compressed-tensors"}
    (out / "config.json").write_text(json.dumps(raw))
    return dense


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_tiny("Llama", path, seed=11)
    return path


@pytest.fixture(scope="module")
def fp8(llama, tmp_path_factory) -> dict[str, tuple[Path, dict[str, torch.Tensor]]]:
    """strategy -> (its checkpoint, the float weights it stands for)."""
    out = {}
    for strategy in STRATEGIES:
        path = tmp_path_factory.mktemp(f"ct-fp8-{strategy}") / "ckpt"
        out[strategy] = (path, write_ct_fp8(llama, path, weight_only_fp8(strategy)))
    return out


def engine_outputs(path: Path, **options) -> list:
    return LLM(str(path), dtype="float32", **options).generate(PROMPTS, SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0))  # fmt: skip


def chosen_logprobs(outputs: list) -> list[float]:
    return [lp[t].logprob for o in outputs for t, lp in zip(o.output_ids, o.logprobs, strict=True)]


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_checkpoint_is_what_llm_compressor_ships(fp8, strategy):
    """FP8 weights, float32 scales of [1] or [out, 1], no zero points, lm_head and embeddings float."""
    path, _ = fp8[strategy]
    tensors = load_file(str(path / "model.safetensors"))
    q = "model.layers.0.self_attn.q_proj"
    assert tensors[q + ".weight"].dtype == torch.float8_e4m3fn
    assert tensors[q + ".weight_scale"].dtype == torch.float32
    assert tuple(tensors[q + ".weight_scale"].shape) == ((64, 1) if strategy == "channel" else (1,))
    assert not any(k.endswith(("zero_point", "input_scale")) for k in tensors)
    assert tensors["lm_head.weight"].dtype == tensors["model.embed_tokens.weight"].dtype == torch.float32
    if strategy == "channel":  # the rows' scales differ: a scale read for the wrong row would show
        assert tensors[q + ".weight_scale"].unique().numel() == 64
    quantization = json.loads((path / "config.json").read_text())["quantization_config"]
    assert quantization["format"] == "float-quantized" and quantization["ignore"] == ["lm_head"]
    assert quantization["config_groups"]["group_0"]["weights"]["strategy"] == strategy
    assert "input_activations" not in quantization["config_groups"]["group_0"]
    config = model_config_from_hf(path / "config.json")
    assert config.fp8 and config.fp8_block is None


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_greedy_equals_transformers_dequantizing_load(fp8, llama, strategy):
    path, dense = fp8[strategy]
    config = transformers.CompressedTensorsConfig(dequantize=True)  # transformers' own decompression
    model = transformers.LlamaForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=config
    ).eval()
    # The oracle holds the package's own decompression (scales applied), not the float weights.
    params = dict(model.named_parameters())
    floats = load_file(str(llama / "model.safetensors"))
    for name, weight in dense.items():
        torch.testing.assert_close(params[name].detach(), weight, rtol=0, atol=0)
        assert not torch.equal(weight, floats[name])
    expected = [hf_greedy(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    outs = engine_outputs(path)
    assert [o.output_ids for o in outs] == expected
    # The FP8 rounding is really served: other log-probs than the float checkpoint's.
    assert chosen_logprobs(outs) != pytest.approx(chosen_logprobs(engine_outputs(llama)), abs=1e-4)


@pytest.mark.parametrize("strategy", STRATEGIES)
@pytest.mark.parametrize(("name", "dim"), [("model.layers.0.mlp.gate_proj.weight", 0),
                                           ("model.layers.1.self_attn.k_proj.weight", 0),
                                           ("model.layers.0.mlp.down_proj.weight", 1),
                                           ("model.layers.1.self_attn.o_proj.weight", 1)])  # fmt: skip
def test_tensor_parallel_shards_carry_their_rows_scales(fp8, strategy, name, dim):
    """What the CUDA path reads for each half of a projection (FP8 weight and scales; CPU loads
    dequantize the whole tensor before splitting it) dequantizes to that half of the package's
    decompression: a column-parallel half keeps its rows' scales, a row-parallel half all of them."""
    path, dense = fp8[strategy]
    src = WeightSource.from_dir(path, quantized="fp8")
    extent = dense[name].shape[dim]
    for lo, hi in [(0, extent // 2), (extent // 2, None)]:
        shard = read_fp8_linear(src, name, None, dim, lo, hi, torch.device("cpu"))
        assert shard.weight.dtype == torch.float8_e4m3fn
        expected = dense[name].narrow(dim, lo, (extent if hi is None else hi) - lo)
        got = dequantize_fp8(shard.weight, shard.scale, shard.block, torch.float32)
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.slow
def test_tensor_parallel_equals_one_process(fp8):
    path, _ = fp8["channel"]
    one = [o.output_ids for o in LLM(str(path), dtype="float32").generate(PROMPTS, GREEDY)]
    two = LLM(str(path), dtype="float32", tensor_parallel_size=2)
    try:
        assert [o.output_ids for o in two.generate(PROMPTS, GREEDY)] == one
    finally:
        two.engine.shutdown()


def test_fp8_with_static_input_activations_is_refused(llama, tmp_path):
    """compressed-tensors' FP8 preset (per-tensor weights, activations scaled by a static per-tensor
    input_scale) would be served here with float activations, answering otherwise than the checkpoint
    was calibrated for: refused when the config is read. (FP8_DYNAMIC, activations quantized per
    token at run time, is served: tests/model/test_w8a8.py.)"""
    from compressed_tensors.quantization import preset_name_to_scheme

    scheme = preset_name_to_scheme("FP8", ["Linear"])
    assert scheme.input_activations.type == "float" and scheme.input_activations.strategy == "tensor"
    assert scheme.input_activations.dynamic is False
    write_ct_fp8(llama, tmp_path / "w8a8", scheme)
    with pytest.raises(ValueError, match="input_activations"):
        model_config_from_hf(tmp_path / "w8a8" / "config.json")
