"""The Llama-style decoder against Hugging Face `transformers` on random checkpoints it writes.

Llama, Mistral, Qwen2 and Qwen3, tiny float32 geometries with initializer_range 0.3 (clear top-1
margins, so exact token equality is sound): GQA groups of 1, 2 and 4 and multi-query, head_dim
different from hidden / heads, tied and untied embeddings, llama3 rope scaling, Qwen2's q/k/v bias,
Qwen3's q/k norm. Requests are mixed prefills and decodes that join and leave the running batch.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from kv_modes import KV_MODES

from orca_backend import LLM, SamplingParams
from orca_backend.config import model_config_from_hf
from orca_backend.distributed.layout import ParallelLayout
from orca_backend.families.llama import LlamaConfig
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.llama import LlamaWeights, llama_key

transformers = pytest.importorskip("transformers")

COMMON = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "max_position_embeddings": 128,
          "initializer_range": 0.3, "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": None}  # fmt: skip

# (id, transformers config class, kwargs)
CASES = [
    ("llama-gqa2-untied", "LlamaConfig",
     {"num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 96, "tie_word_embeddings": False}),
    ("llama-mqa-headdim32-tied-llama3", "LlamaConfig",
     {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32, "intermediate_size": 80,
      "tie_word_embeddings": True, "rope_theta": 500.0,
      "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 16}}),
    ("llama-attention-bias", "LlamaConfig",
     {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "attention_bias": True}),
    ("mistral-gqa4-headdim16", "MistralConfig",
     {"num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96,
      "sliding_window": None}),
    ("qwen2-mha-bias-tied", "Qwen2Config",
     {"num_attention_heads": 4, "num_key_value_heads": 4, "intermediate_size": 96, "tie_word_embeddings": True}),
    ("qwen3-gqa2-qknorm-headdim24", "Qwen3Config",
     {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24, "intermediate_size": 96}),
]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, tuple[str, object]]:
    """One random checkpoint per case, written by transformers itself; (path, HF model)."""
    out = {}
    for case_id, config_name, kwargs in CASES:
        config = getattr(transformers, config_name)(**COMMON, **kwargs)
        arch = config_name.replace("Config", "ForCausalLM")
        torch.manual_seed(len(out))
        model = getattr(transformers, arch)(config).eval()
        if config_name == "Qwen2Config":  # random biases, not the zeros transformers initialises them to
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if name.endswith("_proj.bias"):
                        param.normal_(0, 0.3)
        path = tmp_path_factory.mktemp(case_id)
        model.save_pretrained(path)
        out[case_id] = (str(path), model)
    return out


def prompts(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(2, vocab, (n,), generator=gen).tolist() for n in (1, 4, 9, 17, 30)]


def hf_greedy(model, prompt: list[int], max_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                             max_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
    return out[0, len(prompt):].tolist()


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_greedy_tokens_equal_transformers_in_a_mixed_batch(checkpoints, case_id):
    path, hf = checkpoints[case_id]
    # max_num_seqs 3 < 5 requests: later requests join as earlier ones leave (different lengths).
    ps = prompts(320, seed=1)
    lengths = [12, 5, 9, 3, 7]
    refs = [hf_greedy(hf, prompt, n) for prompt, n in zip(ps, lengths, strict=True)]
    for mode, options in KV_MODES.items():
        llm = LLM(path, max_num_seqs=3, kv_capacity_tokens=1024, **options)
        for _ in range(2):  # the second run hits the prefix cache, when it is on
            outs = llm.generate(ps, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
            for prompt, out, ref in zip(ps, outs, refs, strict=True):
                assert out.output_ids == ref, f"{mode}: prompt {prompt}"
        assert llm.engine.core.kv.used_tokens == 0


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_last_token_logits_match_transformers(checkpoints, case_id):
    """Prefill and decode logits of a flattened batch, against transformers' full forward."""
    path, hf = checkpoints[case_id]
    llm = LLM(path, max_num_seqs=8, kv_capacity_tokens=1024)
    sampler = llm.engine.core.executor.runner.sampler
    captured: list[torch.Tensor] = []
    launch = sampler.launch

    def capture(logits: torch.Tensor, batch_meta, *prompt):
        captured.append(logits.clone())
        return launch(logits, batch_meta, *prompt)

    sampler.launch = capture
    ps = prompts(320, seed=2)
    outs = llm.generate(ps, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    # The first iteration prefilled all five; the third decoded each one's second new token.
    for step in (0, 2):
        for row, (prompt, out) in enumerate(zip(ps, outs, strict=True)):
            ids = prompt + out.output_ids[:step]
            with torch.no_grad():
                ref = hf(torch.tensor([ids])).logits[0, -1]
            torch.testing.assert_close(captured[step][row], ref, rtol=1e-4, atol=1e-4)


def test_config_switches_map_from_each_family(checkpoints):
    cfg = {case_id: model_config_from_hf(f"{path}/config.json") for case_id, (path, _) in checkpoints.items()}
    assert isinstance(cfg["qwen3-gqa2-qknorm-headdim24"], LlamaConfig)
    assert cfg["qwen3-gqa2-qknorm-headdim24"].qk_norm and cfg["qwen3-gqa2-qknorm-headdim24"].head_dim == 24
    assert cfg["qwen2-mha-bias-tied"].qkv_bias and not cfg["qwen2-mha-bias-tied"].o_bias
    assert cfg["llama-attention-bias"].qkv_bias and cfg["llama-attention-bias"].o_bias
    llama3 = cfg["llama-mqa-headdim32-tied-llama3"]
    assert llama3.rope_llama3 == (8.0, 1.0, 4.0, 16) and llama3.num_key_value_heads == 1 and llama3.tie_word_embeddings


@pytest.mark.parametrize(
    ("change", "field"),
    [
        # sliding windows are served (test_window_models.py); attention kinds other than those are not
        ({"use_sliding_window": True, "sliding_window": 32, "architectures": ["Qwen2ForCausalLM"],
          "layer_types": ["chunked_attention", "full_attention"]}, "layer_types"),
        ({"num_local_experts": 8}, "num_local_experts"),
        ({"rope_scaling": {"rope_type": "mrope", "mrope_section": [16, 24, 24]}}, "rope type 'mrope'"),
        ({"hidden_act": "gelu"}, "hidden_act"),
        ({"architectures": ["FalconForCausalLM"]}, "FalconForCausalLM"),
    ],
)
def test_configs_served_wrong_are_refused_naming_the_field(tmp_path, change, field):
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128} | change  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=field):
        model_config_from_hf(tmp_path / "config.json")


@pytest.mark.parametrize("method", ["bitsandbytes", "hqq", "torchao", "mxfp4"])
def test_a_quantized_checkpoint_is_refused_naming_its_method(tmp_path, method):
    """Nothing here computes these quantized weights: such a checkpoint would load and answer wrongly
    (FP8, GPTQ, AWQ and compressed-tensors are served: tests/model/test_fp8.py, test_int_quant.py)."""
    raw = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "max_position_embeddings": 128,
           "quantization_config": {"quant_method": method, "bits": 4}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=f"quantization_config \\(quant_method '{method}'\\) is not supported"):
        model_config_from_hf(tmp_path / "config.json")


@pytest.mark.parametrize(("extra", "dtype"), [("model.layers.0.self_attn.q_proj.weight_scale", torch.float32),
                                              ("model.layers.0.mlp.up_proj.qweight", torch.int32),
                                              ("model.layers.0.mlp.gate_proj.weight", torch.float8_e4m3fn)])
def test_quantized_tensors_are_refused_even_without_a_quantization_config(checkpoints, tmp_path, extra, dtype):
    """Scales, packed integers or FP8 weights in the safetensors file, whatever config.json says."""
    from safetensors.torch import load_file, save_file

    path = Path(checkpoints["llama-gqa2-untied"][0])
    for f in path.iterdir():
        if f.name != "model.safetensors":
            (tmp_path / f.name).write_bytes(f.read_bytes())
    tensors = load_file(str(path / "model.safetensors"))
    tensors[extra] = torch.ones(4, 4).to(dtype)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{extra}' .* belongs to a quantized checkpoint"):
        LLM(str(tmp_path))


def test_sharded_bfloat16_checkpoint_loads_in_float32(checkpoints, tmp_path):
    """A checkpoint saved in bfloat16 across several files with model.safetensors.index.json."""
    _, hf = checkpoints["llama-gqa2-untied"]
    copy.deepcopy(hf).to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    reference = transformers.LlamaForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).eval()
    prompt = prompts(320, seed=3)[3]
    out = LLM(str(tmp_path), dtype="float32").generate([prompt], SamplingParams(max_tokens=8, temperature=0.0,
                                                                                ignore_eos=True))[0]
    assert out.output_ids == hf_greedy(reference, prompt, 8)


def test_tensor_parallel_must_divide_the_kv_heads(checkpoints):
    path, _ = checkpoints["llama-mqa-headdim32-tied-llama3"]  # one KV head: two ranks cannot split it
    config = model_config_from_hf(f"{path}/config.json")
    source = WeightSource.from_dir(path, llama_key)
    layout = ParallelLayout(tp_size=2, tp_rank=0)
    with pytest.raises(ValueError, match="does not divide num_key_value_heads 1"):
        LlamaWeights.load(source, config, layout, torch.float32, torch.device("cpu"))


def test_llama_presets_generate():
    llm = LLM("llama-tiny", max_num_seqs=4)
    outs = llm.generate([[5, 6, 7], [9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))
    assert [len(o.output_ids) for o in outs] == [6, 6]
    alone = llm.generate([[9]], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert alone.output_ids == outs[1].output_ids


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_parallel_tokens_equal_single_process_on_gqa(checkpoints, tp, pp):
    """Query and KV heads split over tensor-parallel ranks (2 query heads, 1 KV head each), layers over
    stages; requests join and leave the running batch."""
    path, _ = checkpoints["llama-gqa2-untied"]
    ps = prompts(320, seed=5)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (7, 3, 9, 4, 6)]
    expected = [o.output_ids for o in LLM(path, max_num_seqs=3).generate(ps, params)]
    llm = LLM(path, max_num_seqs=3, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert [o.output_ids for o in llm.generate(ps, params)] == expected
    finally:
        llm.engine.shutdown()
