"""FP8 checkpoints (quant_method "fp8", e4m3) of the Llama family: block-scaled (`weight_scale_inv`,
as Qwen3-FP8 and DeepSeek ship) and per-tensor (`weight_scale`). On CPU the engine dequantizes them
at load; its greedy tokens equal transformers' own dequantizing load of the same files (float32,
tiny checkpoints whose margins make exact equality sound), with tensor parallelism too; the oracle's
own dequantization is written apart from the engine's. A config that declares FP8 over float
weights is refused at load, projections left in float are served and logged. The Triton
dequantizing GEMM that CUDA runs is tested against its torch reference under the interpreter."""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import pytest
import torch
from hf_tiny import write_tiny
from safetensors.torch import load_file, save_file
from triton_testing import DEVICE, NEEDS_FRESH_PROCESS, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.config import model_config_from_hf
from orca_kernels.fp8 import dequantize_fp8, fp8_linear_torch

transformers = pytest.importorskip("transformers")
FP8_MAX = 448.0  # the largest e4m3 value
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 254, 9, 11], [3]]


def quantize(weight: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(FP8 weight, its scales as a checkpoint stores them): per block of `block`, or one per tensor."""
    if block is None:
        scale = weight.abs().max().clamp(min=1e-12) / FP8_MAX
        return (weight / scale).to(torch.float8_e4m3fn), scale.reshape(1)
    rows, cols = weight.shape
    bo, bi = block
    padded = torch.zeros(-(-rows // bo) * bo, -(-cols // bi) * bi)
    padded[:rows, :cols] = weight
    blocks = padded.reshape(padded.shape[0] // bo, bo, padded.shape[1] // bi, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_apart(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """The float32 weight an FP8 weight stands for, written apart from the engine's dequantize_fp8 so
    that a bug there cannot hide in the oracle: each entry times the scale of its block (indexed per
    entry), or times the tensor's one scale when `block` is None."""
    values = weight.to(torch.float32)
    if block is None:
        return values * scale.to(torch.float32).reshape(())
    rows = torch.arange(weight.shape[0]) // block[0]
    cols = torch.arange(weight.shape[1]) // block[1]
    return values * scale.to(torch.float32)[rows[:, None], cols[None, :]]


def write_fp8(float_dir: Path, out: Path, block: tuple[int, int] | None) -> Path:
    """The checkpoint in `float_dir` with every projection FP8, as transformers' FP8 format has it."""
    shutil.copytree(float_dir, out)
    tensors = load_file(str(float_dir / "model.safetensors"))
    stored = {}
    for key, value in tensors.items():
        if key.endswith("proj.weight"):
            stored[key], scale = quantize(value.float(), block)
            stored[key[: -len("weight")] + ("weight_scale_inv" if block else "weight_scale")] = scale
            if block is None:
                stored[key[: -len("weight")] + "input_scale"] = torch.ones(1)  # static checkpoints carry them: unused
        else:
            stored[key] = value
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block) if block else None}  # fmt: skip
    (out / "config.json").write_text(json.dumps(config))
    return out


@pytest.fixture(scope="module")
def float_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Qwen3 (q/k norm) and Llama (plain GQA) tiny float checkpoints."""
    out = {}
    for family in ("Qwen3", "Llama"):
        out[family] = tmp_path_factory.mktemp(family.lower())
        write_tiny(family, out[family], seed=11)
    return out


def reference_tokens(fp8_dir: Path, family: str, block: tuple[int, int] | None) -> list[list[int]]:
    """transformers' greedy tokens: its own dequantizing FP8 load (block-scaled); per-tensor, which
    its FP8 loader does not read, from the same weights dequantized into a float checkpoint."""
    model_class = getattr(transformers, f"{family}ForCausalLM")
    if block is None:
        return hf_greedy(model_class.from_pretrained(dequantized_copy(fp8_dir, None), dtype=torch.float32).eval())
    pytest.importorskip("accelerate")
    config = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=block)
    return hf_greedy(model_class.from_pretrained(fp8_dir, quantization_config=config, dtype=torch.float32).eval())


def dequantized_copy(fp8_dir: Path, block: tuple[int, int] | None) -> Path:
    """A float checkpoint of the weights `fp8_dir` stands for (dequantize_apart), beside it."""
    dense_dir = fp8_dir.parent / (fp8_dir.name + "-dequantized")
    shutil.copytree(fp8_dir, dense_dir)
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    scale_suffix = "_scale" if block is None else "_scale_inv"
    dense = {}
    for key, value in tensors.items():
        if key.endswith(("weight_scale", "weight_scale_inv", "input_scale")):
            continue
        if value.dtype == torch.float8_e4m3fn:
            value = dequantize_apart(value, tensors[key + scale_suffix], block)
        dense[key] = value
    save_file(dense, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((dense_dir / "config.json").read_text())
    del config["quantization_config"]
    (dense_dir / "config.json").write_text(json.dumps(config))
    return dense_dir


def hf_greedy(model: torch.nn.Module) -> list[list[int]]:
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = model.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False, min_new_tokens=GREEDY.max_tokens)
            tokens.append(out[0, len(prompt):].tolist())
    return tokens


@pytest.mark.parametrize("family", ["Qwen3", "Llama"])
@pytest.mark.parametrize("block", [(16, 16), (32, 16), None], ids=["block16", "block32x16", "per-tensor"])
def test_fp8_checkpoint_greedy_equals_transformers(float_checkpoints, tmp_path, family, block):
    fp8_dir = write_fp8(float_checkpoints[family], tmp_path / "fp8", block)
    config = model_config_from_hf(fp8_dir / "config.json")
    assert config.fp8 and config.fp8_block == block
    expected = reference_tokens(fp8_dir, family, block)
    outs = LLM(str(fp8_dir), dtype="float32").generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in outs] == expected
    # Not the float checkpoint's tokens: the FP8 rounding is really in the weights served.
    floats = LLM(str(float_checkpoints[family]), dtype="float32").generate(PROMPTS, GREEDY)
    assert [o.output_ids for o in floats] != expected


@pytest.mark.parametrize(("shape", "block"), [((48, 64), (16, 16)), ((40, 72), (32, 16)), ((33, 50), None)])
def test_dequantize_fp8_equals_an_independent_dequantization(shape, block):
    """The engine's dequantization (CPU loads, and the Triton GEMM's reference) against dequantize_apart:
    blocks the shape does not divide, and one scale per tensor as the (1, in) block the engine reads."""
    weight = torch.randn(*shape, generator=torch.Generator().manual_seed(shape[0]))
    q, scale = quantize(weight, block)
    expected = dequantize_apart(q, scale, block)
    if block is None:
        scale, block = scale.reshape(1, 1).expand(shape[0], 1), (1, shape[1])
    torch.testing.assert_close(dequantize_fp8(q, scale, block, torch.float32), expected, rtol=0, atol=0)
    # and it is the weight quantized: e4m3 rounds within 2^-4 relatively, or 2^-9 scales below its normals
    torch.testing.assert_close(expected, weight, rtol=2**-4, atol=float(scale.max()) * 2**-9)


@pytest.mark.slow
def test_fp8_tensor_parallel_equals_one_process(float_checkpoints, tmp_path):
    fp8_dir = write_fp8(float_checkpoints["Qwen3"], tmp_path / "fp8", (16, 16))
    one = [o.output_ids for o in LLM(str(fp8_dir), dtype="float32").generate(PROMPTS, GREEDY)]
    two = LLM(str(fp8_dir), dtype="float32", tensor_parallel_size=2)
    try:
        assert [o.output_ids for o in two.generate(PROMPTS, GREEDY)] == one
    finally:
        two.engine.shutdown()


def test_other_quantizations_and_fp8_gpt2_are_refused(tmp_path):
    raw = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 320, "n_embd": 64,
           "n_layer": 2, "n_head": 4, "n_positions": 128, "quantization_config": {"quant_method": "fp8"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="quant_method 'fp8'\\) is not supported on GPT2LMHeadModel"):
        model_config_from_hf(tmp_path / "config.json")
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
           "quantization_config": {"quant_method": "fp8", "fmt": "e5m2"}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="FP8 format 'e5m2' is not supported"):
        model_config_from_hf(tmp_path / "config.json")


def declare_fp8(float_dir: Path, out: Path, keep: dict[str, torch.Tensor] | None = None) -> Path:
    """`float_dir` with an FP8 quantization_config but float weights: those of `float_dir`, or `keep`."""
    shutil.copytree(float_dir, out)
    if keep is not None:
        save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [16, 16]}
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_an_fp8_config_over_float_weights_is_refused_at_load(float_checkpoints, tmp_path):
    """No FP8 weight at all: it would be served in float to a user who believes it FP8."""
    plain = declare_fp8(float_checkpoints["Llama"], tmp_path / "plain")
    with pytest.raises(ValueError, match=re.escape(f"{plain}: config.json's quantization_config declares an FP8 "
                                                   "checkpoint (quant_method 'fp8'), but it holds no FP8 (F8_E4M3) "
                                                   "weight (no weight_scale or weight_scale_inv)")):  # fmt: skip
        LLM(str(plain), dtype="float32")
    # Scales beside float weights (FP8 values cast up without them applied, or applied already): refused too.
    tensors = load_file(str(float_checkpoints["Llama"] / "model.safetensors"))
    scaled = {**tensors, "model.layers.0.mlp.down_proj.weight_scale_inv": torch.ones(4, 6)}
    with pytest.raises(ValueError, match="holds no FP8 \\(F8_E4M3\\) weight \\(only 1 scale tensors beside float"):
        LLM(str(declare_fp8(float_checkpoints["Llama"], tmp_path / "scaled", scaled)), dtype="float32")


def test_fp8_weights_other_than_projections_are_refused(float_checkpoints, tmp_path):
    """An FP8 embedding or LM head would be read without its scale."""
    fp8_dir = write_fp8(float_checkpoints["Llama"], tmp_path / "fp8", (16, 16))
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    tensors["lm_head.weight"], tensors["lm_head.weight_scale_inv"] = quantize(tensors["lm_head.weight"], (16, 16))
    save_file(tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="FP8 tensors lm_head.weight are not decoder projections"):
        LLM(str(fp8_dir), dtype="float32")


def test_projections_left_in_float_are_served_and_logged(float_checkpoints, tmp_path, caplog):
    """A quantizer may leave some projections in float: they are served in float, and named."""
    fp8_dir = write_fp8(float_checkpoints["Llama"], tmp_path / "fp8", (16, 16))
    tensors = load_file(str(fp8_dir / "model.safetensors"))
    floats = load_file(str(float_checkpoints["Llama"] / "model.safetensors"))
    for name in ("model.layers.1.self_attn.o_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        tensors[name] = floats[name]
        del tensors[name + "_scale_inv"]
    save_file(tensors, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="orca.model"):
        outs = LLM(str(fp8_dir), dtype="float32").generate(PROMPTS, GREEDY)
    assert f"{fp8_dir}: 2 decoder projections are not FP8 and are served in float (12 are FP8): " \
           "model.layers.0.mlp.down_proj.weight, model.layers.1.self_attn.o_proj.weight" in caplog.text
    expected = hf_greedy(transformers.LlamaForCausalLM.from_pretrained(dequantized_copy(fp8_dir, (16, 16)),
                                                                       dtype=torch.float32).eval())  # fmt: skip
    assert [o.output_ids for o in outs] == expected


# --- the Triton dequantizing GEMM ------------------------------------------------------------------


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_kernel_in_fresh_process() -> None:
    run_in_fresh_process(__file__ + "::test_fp8_linear_triton_equals_the_reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "block"), [(3, 48, 64, (16, 16)), (17, 40, 72, (32, 16)), (5, 33, 50, (1, 50)),
                                                    (4, 24, 40, (8, 8))])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_triton_equals_the_reference(monkeypatch, dtype, m, n, k, block, bias):
    """Edges the tiles do not divide (n 33/40, k 50/72), blocks the tiles straddle, per-row scales.
    bfloat16 activations take the tensor-core path (chunks inside a scale block) except with 8-column
    blocks, narrower than the interpreter's 16-column chunk: the per-entry path."""
    use_import_mode(monkeypatch)
    from orca_kernels import triton_fp8

    g = torch.Generator().manual_seed(m + n)
    weight = torch.randn(n, k, generator=g)
    if block == (1, k):
        q, scale = quantize(weight, None)
        scale = scale.reshape(1, 1).expand(n, 1).contiguous()
    else:
        q, scale = quantize(weight, block)
    x = torch.randn(m, k, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    out = triton_fp8.fp8_linear_triton(x.to(DEVICE), q.to(DEVICE), scale.to(DEVICE), block, None if b is None else b.to(DEVICE))
    expected = fp8_linear_torch(x.float(), q, scale, block, None if b is None else b.float())
    assert out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)
