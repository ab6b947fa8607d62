"""FP8 checkpoints (quant_method "fp8", e4m3) of the Llama family: block-scaled (`weight_scale_inv`,
as Qwen3-FP8 and DeepSeek ship) and per-tensor (`weight_scale`). On CPU the engine dequantizes them
at load; its greedy tokens equal transformers' own dequantizing load of the same files (float32,
tiny checkpoints whose margins make exact equality sound), with tensor parallelism too. The Triton
dequantizing GEMM that CUDA runs is tested against its torch reference under the interpreter."""

from __future__ import annotations

import json
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
    if block is not None:
        pytest.importorskip("accelerate")
        config = transformers.FineGrainedFP8Config(dequantize=True, weight_block_size=block)
        model = model_class.from_pretrained(fp8_dir, quantization_config=config, dtype=torch.float32).eval()
    else:
        dense_dir = fp8_dir.parent / (fp8_dir.name + "-dequantized")
        shutil.copytree(fp8_dir, dense_dir)
        tensors = load_file(str(fp8_dir / "model.safetensors"))
        dense = {}
        for key, value in tensors.items():
            if key.endswith(("weight_scale", "input_scale")):
                continue
            if value.dtype == torch.float8_e4m3fn:
                scale = tensors[key + "_scale"].reshape(1, 1)
                value = dequantize_fp8(value, scale.expand(value.shape[0], 1), (1, value.shape[1]), torch.float32)
            dense[key] = value
        save_file(dense, str(dense_dir / "model.safetensors"), metadata={"format": "pt"})
        config = json.loads((dense_dir / "config.json").read_text())
        del config["quantization_config"]
        (dense_dir / "config.json").write_text(json.dumps(config))
        model = model_class.from_pretrained(dense_dir, dtype=torch.float32).eval()
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


# --- the Triton dequantizing GEMM ------------------------------------------------------------------


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_kernel_in_fresh_process() -> None:
    run_in_fresh_process(__file__ + "::test_fp8_linear_triton_equals_the_reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "block"), [(3, 48, 64, (16, 16)), (17, 40, 72, (32, 16)), (5, 33, 50, (1, 50))])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_triton_equals_the_reference(monkeypatch, dtype, m, n, k, block, bias):
    """Edges the tiles do not divide (n 33/40, k 50/72), blocks the tiles straddle, per-row scales."""
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
