"""kv_cache_dtype fp8 (vLLM's name): the engine's K/V pool in FP8 with per-layer, per-head scales.

FP8 K/V is lossy, so the oracle is transformers run on the same quantized K/V: an attention function
registered with transformers that rounds each layer's keys and values as the pool stores them
(x / scale, clamped, to the FP8 format, read back times the scale; written here from that
definition, not with the engine's helpers) and then runs transformers' own attention. The engine's
greedy tokens must equal that model's exactly, which is sound for these tiny float32 checkpoints
(initializer_range 0.3: the top logits are far apart); and differ in log-probs from the engine with
K/V in float32 (the rounding is really applied).

Scales come from the checkpoint where it holds them (`self_attn.k_scale` / `v_scale`: per head in
one layer, per tensor in the other here), else they are 1.0 (GPT-2).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from hf_tiny import hf_greedy, write_tiny
from safetensors.torch import load_file, save_file

from orca_backend import LLM, SamplingParams
from orca_backend.config import EngineConfig

transformers = pytest.importorskip("transformers")
PROMPTS = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 254, 9, 11, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49], [3]]
MAX_TOKENS = 12
POOL_DTYPES = {"fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
# Layer 0: per K/V head; layer 1: per tensor. Sized so that the tiny model's K/V spans tens to
# hundreds of codes' magnitudes (its K/V reach ~10).
SCALES = {0: ([0.04, 0.07], [0.03, 0.05]), 1: ([0.06], [0.045])}


def _fake_quantize(x: torch.Tensor, scale: torch.Tensor, pool_dtype: torch.dtype) -> torch.Tensor:
    """x [batch, heads, tokens, head_dim] as an FP8 pool gives it back: fp8(x / s) * s per head."""
    s = scale.float().expand(x.shape[1])[None, :, None, None]
    limit = torch.finfo(pool_dtype).max
    return ((x.float() / s).clamp(-limit, limit).to(pool_dtype).float() * s).to(x.dtype)


def quantized_kv_model(model: torch.nn.Module, scales: dict[int, tuple[list[float], list[float]]],
                       pool_dtype: torch.dtype) -> torch.nn.Module:  # fmt: skip
    """`model` attending over K/V rounded as an FP8 pool stores it, layer by layer (`scales`: each
    layer's K and V scales; 1.0 where a layer has none)."""
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    base = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def attend(module, query, key, value, *args, **kwargs):
        k_scale, v_scale = scales.get(module.layer_idx, ([1.0], [1.0]))
        key = _fake_quantize(key, torch.tensor(k_scale), pool_dtype)
        value = _fake_quantize(value, torch.tensor(v_scale), pool_dtype)
        return base(module, query, key, value, *args, **kwargs)

    AttentionInterface.register("fp8_kv_test", attend)
    model.set_attn_implementation("fp8_kv_test")
    return model


def with_kv_scales(src: Path, dst: Path, scales: dict[int, tuple[list[float], list[float]]]) -> Path:
    """`src` with each layer's k_scale / v_scale stored beside its weights, as llm-compressor writes them."""
    import shutil

    shutil.copytree(src, dst)
    tensors = load_file(str(src / "model.safetensors"))
    for layer, (k, v) in scales.items():
        attn = f"model.layers.{layer}.self_attn."
        tensors[attn + "k_scale"], tensors[attn + "v_scale"] = torch.tensor(k), torch.tensor(v)
    save_file(tensors, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> tuple[torch.nn.Module, Path]:
    """A tiny Llama (4 query heads over 2 K/V heads) and its checkpoint with K/V scales."""
    path = tmp_path_factory.mktemp("llama")
    model = write_tiny("Llama", path / "float", seed=21)
    return model, with_kv_scales(path / "float", path / "scaled", SCALES)


def engine_outputs(path: Path | str, **options) -> list:
    llm = LLM(str(path), dtype="float32", **options)
    return llm.generate(PROMPTS, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0))


def chosen_logprobs(outputs: list) -> list[float]:
    return [lp[t].logprob for o in outputs for t, lp in zip(o.output_ids, o.logprobs, strict=True)]


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
@pytest.mark.parametrize("kv_cache_dtype", list(POOL_DTYPES))
def test_llama_greedy_equals_transformers_on_the_same_quantized_kv(llama, kv_cache_dtype, kernels):
    """GQA, per-head and per-tensor checkpoint scales, prompts that span several blocks: the C
    kernels and the torch references both give transformers' tokens over the same FP8 K/V."""
    model, path = llama
    oracle = quantized_kv_model(model, SCALES, POOL_DTYPES[kv_cache_dtype])
    expected = [hf_greedy(oracle, prompt, MAX_TOKENS) for prompt in PROMPTS]
    outs = engine_outputs(path, kv_cache_dtype=kv_cache_dtype, kernels=kernels, block_size=4)
    assert [o.output_ids for o in outs] == expected


def test_fp8_kv_is_really_applied(llama):
    """Other log-probs than K/V in float32, and other again with the checkpoint's scales ignored
    (kv_cache_dtype auto keeps float32 K/V and logs that the scales are unused)."""
    _, path = llama
    fp8 = chosen_logprobs(engine_outputs(path, kv_cache_dtype="fp8"))
    auto = chosen_logprobs(engine_outputs(path))
    assert fp8 != pytest.approx(auto, abs=1e-4)
    unscaled = chosen_logprobs(engine_outputs(path.parent / "float", kv_cache_dtype="fp8"))  # scales 1.0
    assert unscaled != pytest.approx(fp8, abs=1e-4)


def test_gpt2_without_checkpoint_scales_uses_one(tmp_path):
    """A checkpoint with no K/V scales (GPT-2: multi-head, no rotary, the K/V write without it)
    is served with every scale 1.0, vLLM's default."""
    config = transformers.GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=2, n_head=4,
                                     initializer_range=0.3, bos_token_id=None, eos_token_id=None)  # fmt: skip
    torch.manual_seed(5)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(tmp_path)
    oracle = quantized_kv_model(model, {}, torch.float8_e4m3fn)
    expected = [hf_greedy(oracle, prompt, MAX_TOKENS) for prompt in PROMPTS]
    assert [o.output_ids for o in engine_outputs(tmp_path, kv_cache_dtype="fp8")] == expected


def test_the_pool_holds_a_byte_an_element(llama):
    """FP8 K/V takes a quarter of float32's bytes: kv_cache_memory_bytes buys four times the tokens,
    and the runner's pool is FP8."""
    _, path = llama
    budget = 2**16
    config = EngineConfig(model=str(path), kv_cache_memory_bytes=budget)
    fp8 = EngineConfig(model=str(path), kv_cache_memory_bytes=budget, kv_cache_dtype="fp8")
    model_config = config.model_config()
    assert config.kv_bytes_per_token(model_config) == 4 * fp8.kv_bytes_per_token(model_config)
    tokens = [c.with_kv_capacity(model_config).kv_capacity_tokens for c in (config, fp8)]
    assert tokens[1] == 4 * tokens[0]
    runner = LLM(str(path), kv_cache_memory_bytes=budget, kv_cache_dtype="fp8_e5m2").engine.core.executor.runner
    assert runner.kv_capacity_tokens == tokens[1]
    assert {cache.dtype for layer in runner.kv_caches for cache in layer} == {torch.float8_e5m2}


@pytest.mark.parametrize("value", ["int8", "fp8_inc", "FP8"])
def test_unserved_kv_cache_dtypes_are_refused(value):
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, fp8, fp8_e4m3, fp8_e5m2"):
        EngineConfig(kv_cache_dtype=value)


def test_scales_of_a_wrong_shape_are_refused(llama, tmp_path):
    _, path = llama
    bad = with_kv_scales(path.parent / "float", tmp_path / "bad", {0: ([0.1, 0.2, 0.3], [0.1]), 1: ([0.1], [0.1])})
    with pytest.raises(ValueError, match=r"k_scale holds 3 values: one \(per tensor\) or one per K/V head \(2\)"):
        LLM(str(bad), kv_cache_dtype="fp8")
    partial = with_kv_scales(path.parent / "float", tmp_path / "partial", {0: ([0.1], [0.1])})
    with pytest.raises(ValueError, match="K/V scales for some layers only"):
        LLM(str(partial), kv_cache_dtype="fp8")


def with_kv_cache_scheme(src: Path, dst: Path) -> Path:
    """`src` under a quantization_config of FP8 K/V only, as llm-compressor writes it (by the
    compressed-tensors package: per-head static scales, float weights)."""
    import json
    import shutil

    from compressed_tensors.quantization import QuantizationArgs, QuantizationConfig

    shutil.copytree(src, dst)
    scheme = QuantizationArgs(num_bits=8, type="float", strategy="attn_head", dynamic=False, symmetric=True)
    config = QuantizationConfig(config_groups={}, kv_cache_scheme=scheme, quantization_status="compressed")
    raw = json.loads((dst / "config.json").read_text())
    raw["quantization_config"] = config.model_dump(exclude_none=True) | {"quant_method": "compressed-tensors"}
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_compressed_tensors_kv_cache_scheme_is_served(llama, tmp_path):
    """llm-compressor's FP8 K/V checkpoints (kv_cache_scheme) load, their scales used with
    kv_cache_dtype fp8; declaring the scheme over a checkpoint without scales is refused."""
    pytest.importorskip("compressed_tensors")
    model, path = llama
    declared = with_kv_cache_scheme(path, tmp_path / "ct")
    oracle = quantized_kv_model(model, SCALES, torch.float8_e4m3fn)
    expected = [hf_greedy(oracle, prompt, MAX_TOKENS) for prompt in PROMPTS]
    assert [o.output_ids for o in engine_outputs(declared, kv_cache_dtype="fp8")] == expected
    unscaled = with_kv_cache_scheme(path.parent / "float", tmp_path / "ct-unscaled")
    with pytest.raises(ValueError, match="declares FP8 K/V scales \\(kv_cache_scheme\\), but it holds none"):
        LLM(str(unscaled), kv_cache_dtype="fp8")


@pytest.mark.slow
def test_tensor_parallel_equals_one_process(llama):
    """Two ranks, each with its K/V head and that head's scale."""
    _, path = llama
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    one = [o.output_ids for o in LLM(str(path), dtype="float32", kv_cache_dtype="fp8").generate(PROMPTS, greedy)]
    two = LLM(str(path), dtype="float32", kv_cache_dtype="fp8", tensor_parallel_size=2)
    try:
        assert [o.output_ids for o in two.generate(PROMPTS, greedy)] == one
    finally:
        two.engine.shutdown()
