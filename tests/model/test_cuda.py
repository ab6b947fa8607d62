"""The engine on a CUDA GPU against Hugging Face transformers (run in float32 on the CPU as the oracle).

- float32: greedy tokens must equal transformers' exactly, with the Triton kernels and with the torch
  references. The checkpoints are tiny (hidden <= 256, <= 4 layers) with initializer_range 0.3, where
  the top-2 logit margins dwarf float32 rounding (docs/architecture.md, Testing), so any difference is a bug.
- bfloat16: exact equality is not a sound test there, so the engine's own greedy tokens are scored
  teacher-forced by the float32 reference (tests/bf16_oracle.py has the tolerance).
- batch invariance: a request's greedy tokens alone equal its tokens inside a mixed, staggered batch.

Every test is skipped on machines without CUDA (the CPU CI); `make gpu-check` runs them on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from bf16_oracle import MAX_TOKENS, assert_near_top, prompts_for
from hf_tiny import write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.families.gpt2 import GPT2Config

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make gpu-check` on a GPU machine)"
)
transformers = pytest.importorskip("transformers")


GEOMETRIES = [
    # head_dim 16; 24 (not a power of two: masked head-dim lanes); 128 (the widest tile); 4 layers, 10 heads
    GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3),
    GPT2Config(vocab_size=300, n_positions=128, n_embd=120, n_layer=2, n_head=5, initializer_range=0.3),
    GPT2Config(vocab_size=512, n_positions=128, n_embd=256, n_layer=2, n_head=2, initializer_range=0.3),
    GPT2Config(vocab_size=400, n_positions=128, n_embd=160, n_layer=4, n_head=10, initializer_range=0.3),
]
BF16_GEOMETRIES = GEOMETRIES[:2]  # the geometries bf16_oracle's tolerance was measured on


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def hf_model(path) -> torch.nn.Module:
    return transformers.GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def hf_greedy(model: torch.nn.Module, prompt: list[int], max_tokens: int) -> list[int]:
    """Greedy decoding with full forwards (no generate(): these checkpoints' EOS id lies outside
    their small vocabularies, which generate's length processors would index)."""
    ids = list(prompt)
    for _ in range(max_tokens):
        ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"h{g.n_embd}-l{g.n_layer}-nh{g.n_head}")
def test_fp32_greedy_tokens_equal_transformers(make_checkpoint, geometry: GPT2Config, kernels: str) -> None:
    path, config = make_checkpoint(geometry, seed=7, tokenizer=False)
    llm = LLM(str(path), device="cuda", dtype="float32", kernels=kernels, max_num_seqs=16)
    prompts = prompts_for(config.vocab_size, seed=1)
    outs = llm.generate(prompts, greedy())
    hf = hf_model(path)
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.finish_reason == "length"
        assert out.output_ids == hf_greedy(hf, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("geometry", BF16_GEOMETRIES, ids=lambda g: f"h{g.n_embd}-l{g.n_layer}-nh{g.n_head}")
def test_bf16_tokens_are_near_top_under_fp32_reference(make_checkpoint, geometry: GPT2Config) -> None:
    path, config = make_checkpoint(geometry, seed=7, tokenizer=False)
    llm = LLM(str(path), device="cuda", dtype="bfloat16", kernels="triton", max_num_seqs=16)
    prompts = prompts_for(config.vocab_size, seed=2)
    outs = llm.generate(prompts, greedy())
    assert_near_top(hf_model(path), prompts, [o.output_ids for o in outs])


def test_fp32_batch_invariance(make_checkpoint) -> None:
    """Alone, all together, and joining a batch that is already decoding while others leave."""
    path, config = make_checkpoint(GEOMETRIES[1], seed=5, tokenizer=False)
    llm = LLM(str(path), device="cuda", dtype="float32", kernels="triton", max_num_seqs=16)
    gen = torch.Generator().manual_seed(5)
    lengths = torch.randint(1, 60, (12,), generator=gen).tolist()
    prompts = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in lengths]
    alone = [llm.generate([p], greedy())[0].output_ids for p in prompts]
    together = [o.output_ids for o in llm.generate(prompts, greedy())]
    assert together == alone

    engine = llm.engine
    tokens: dict[str, list[int]] = {}

    def collect(out) -> None:
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    max_tokens = [24, 3, 11, 24, 6, 17, 2, 24, 9, 13, 24, 5]
    ids = []
    for prompt, n in zip(prompts, max_tokens, strict=True):
        ids.append(engine.add_request(prompt, greedy(n), on_output=collect).request_id)
        engine.step()  # each newcomer's prefill joins decodes already under way
        engine.step()
    while engine.has_work():
        engine.step()
    for i, (rid, n) in enumerate(zip(ids, max_tokens, strict=True)):
        assert tokens[rid] == alone[i][:n], f"request {i}"


# The Llama family: GQA (group 2), multi-query with head_dim != hidden / heads, Qwen3's q/k norm.
LLAMA_CASES = {
    "llama-gqa2": ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 2}),
    "llama-mqa-headdim32": ("LlamaConfig", {"num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 32}),
    "qwen3-gqa2-qknorm": ("Qwen3Config", {"num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 24}),
}


@pytest.fixture(scope="module")
def llama_checkpoints(tmp_path_factory) -> dict[str, tuple[str, torch.nn.Module]]:
    out = {}
    for case_id, (config_name, kwargs) in LLAMA_CASES.items():
        config = getattr(transformers, config_name)(
            vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, max_position_embeddings=256,
            initializer_range=0.3, eos_token_id=None, bos_token_id=None, **kwargs,
        )  # fmt: skip
        torch.manual_seed(len(out))
        model = getattr(transformers, config_name.replace("Config", "ForCausalLM"))(config).eval()
        path = tmp_path_factory.mktemp(case_id)
        model.save_pretrained(path)
        out[case_id] = (str(path), model)
    return out


@pytest.mark.parametrize("kernels", ["triton", "torch"])
@pytest.mark.parametrize("case_id", list(LLAMA_CASES))
def test_llama_family_fp32_greedy_tokens_equal_transformers(llama_checkpoints, case_id: str, kernels: str) -> None:
    path, hf = llama_checkpoints[case_id]
    llm = LLM(path, device="cuda", dtype="float32", kernels=kernels, max_num_seqs=16)
    prompts = prompts_for(320, seed=1)
    outs = llm.generate(prompts, greedy())
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.output_ids == hf_greedy(hf, prompt, MAX_TOKENS), f"prompt of {len(prompt)} tokens"


@pytest.mark.parametrize("case_id", ["llama-gqa2", "qwen3-gqa2-qknorm"])
def test_llama_family_bf16_tokens_are_near_top_under_fp32_reference(llama_checkpoints, case_id: str) -> None:
    path, hf = llama_checkpoints[case_id]
    llm = LLM(path, device="cuda", dtype="bfloat16", kernels="triton", max_num_seqs=16)
    prompts = prompts_for(320, seed=2)
    outs = llm.generate(prompts, greedy())
    assert_near_top(hf, prompts, [o.output_ids for o in outs])



def test_cuda_graph_tokens_equal_eager(make_checkpoint) -> None:
    """Decode steps replayed from the captured graphs (every bucket up to 16, most of them padded)
    give the tokens of the same engine run eagerly, in float32 (where these checkpoints' margins make
    exact equality sound; a padded GEMM may round differently from an unpadded one in bfloat16)."""
    dtype = "float32"
    path, config = make_checkpoint(GEOMETRIES[3], seed=3, tokenizer=False)
    prompts = prompts_for(config.vocab_size, seed=4) * 3  # 15 requests: buckets 16, 8, 4, 2, 1 as they finish
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    graphed = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=16)
    runner = graphed.engine.core.executor.runner
    assert runner.decode_graphs is not None and sorted(runner.decode_graphs.graphs) == [1, 2, 4, 8, 16]
    replays = []
    run = runner.decode_graphs.run
    runner.decode_graphs.run = lambda inputs, ahead=None: replays.append(inputs.num_requests) or run(inputs, ahead)
    mixed_replays = []
    run_mixed = runner.mixed_graphs.run
    runner.mixed_graphs.run = lambda inputs, ahead=None: mixed_replays.append(inputs.num_tokens) or run_mixed(inputs, ahead)
    with_graphs = [o.output_ids for o in graphed.generate(prompts, params)]
    eager = LLM(str(path), device="cuda", dtype=dtype, max_num_seqs=16, enforce_eager=True)
    assert eager.engine.core.executor.runner.decode_graphs is None
    assert with_graphs == [o.output_ids for o in eager.generate(prompts, params)]
    assert {runner.decode_graphs.bucket(n) for n in replays} == {1, 2, 4, 8, 16}
    # Every step replayed a graph: decode steps theirs, steps with prompt tokens the mixed ones; the
    # eager engine says why it has none.
    steps = graphed.engine.stats().steps_by_path
    assert set(steps) == {"cuda_graph"} and steps["cuda_graph"] == len(replays) + len(mixed_replays)
    assert mixed_replays
    assert set(eager.engine.stats().steps_by_path) == {"enforce_eager"}


def test_a_capture_failure_fails_the_load_naming_the_batch_size(make_checkpoint, monkeypatch) -> None:
    """No silent eager: a graph that cannot be captured fails the load with its batch size and error;
    enforce_eager loads the same engine without graphs, and kernels='torch' is an eager reason."""
    from orca_backend.worker.cuda_graphs import DecodeGraphs

    path, _ = make_checkpoint(GEOMETRIES[0], seed=1, tokenizer=False)
    views = DecodeGraphs.views

    def failing_views(self, size):
        if size == 4:
            raise ValueError("planted at batch size 4")
        return views(self, size)

    monkeypatch.setattr(DecodeGraphs, "views", failing_views)
    with pytest.raises(RuntimeError, match=r"batch size 4 failed: ValueError: planted at batch size 4; set enforce_eager"):
        LLM(str(path), device="cuda", dtype="float32", max_num_seqs=8)
    assert LLM(str(path), device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=True).generate([[5]])
    monkeypatch.setattr(DecodeGraphs, "views", views)
    torch_kernels = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=8, kernels="torch")
    assert torch_kernels.engine.core.executor.runner.eager_reason == "torch_kernels"


def test_gpt2_mlp_epilogue_is_gelu_tanh() -> None:
    """GPT-2's fc layer on CUDA is one GEMM with a bias + GELU epilogue; it must be GPT-2's gelu_new
    (the tanh form), not erf's GELU (they differ by up to ~5e-4 here)."""
    from orca_backend.model.gemm import linear_bias_gelu
    from orca_kernels.gelu import bias_gelu_torch

    g = torch.Generator().manual_seed(0)
    x, w, b = torch.randn(7, 64, generator=g), torch.randn(256, 64, generator=g) * 0.3, torch.randn(256, generator=g)
    out = linear_bias_gelu(x.cuda(), w.cuda(), b.cuda(), bias_gelu_torch).cpu()
    y = x.double() @ w.double().t() + b.double()
    assert torch.allclose(out.double(), torch.nn.functional.gelu(y, approximate="tanh"), atol=2e-5, rtol=0)
    assert not torch.allclose(out.double(), torch.nn.functional.gelu(y), atol=1e-4, rtol=0)


def test_async_scheduling_tokens_equal_sync(make_checkpoint) -> None:
    """Async scheduling on a GPU (each step launched while the last runs, its tokens filled in on the
    device, CUDA graphs on) gives the synchronous engine's tokens, float32."""
    path, config = make_checkpoint(GEOMETRIES[1], seed=6, tokenizer=False)
    prompts = prompts_for(config.vocab_size, seed=8) * 2
    params = [SamplingParams(max_tokens=3 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    sync = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=16, async_scheduling=False)
    expected = [o.output_ids for o in sync.generate(prompts, params)]
    assert sync.engine.core.max_batches_in_flight == 1
    del sync
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=16)  # unset: on, on CUDA
    assert llm.engine.core.config.async_scheduling is True
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.core.max_batches_in_flight == 2


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="tensor parallelism over NCCL needs two GPUs")
def test_tensor_parallel_ranks_replay_graphs_with_their_collectives(make_checkpoint) -> None:
    """tp = 2, a GPU per rank: each rank captures its buckets with the NCCL all-reduces and the
    vocabulary's all-gather inside, every step (prompt steps included) replays a graph on both, and
    the tokens are those of the same engine run eagerly, float32."""
    path, config = make_checkpoint(GEOMETRIES[3], seed=3, tokenizer=False)
    prompts = prompts_for(config.vocab_size, seed=4) * 3
    params = [SamplingParams(max_tokens=4 + 2 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    outputs, paths = [], []
    for enforce_eager in (False, True):
        llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=16, tensor_parallel_size=2,
                  max_num_batched_tokens=128, enforce_eager=enforce_eager)  # fmt: skip
        try:
            outputs.append([o.output_ids for o in llm.generate(prompts, params)])
            paths.append(set(llm.engine.stats().steps_by_path))
        finally:
            llm.engine.shutdown()
    assert outputs[0] == outputs[1]
    assert paths == [{"cuda_graph"}, {"enforce_eager"}]


def assert_replayed(llm: LLM, drafter) -> None:  # noqa: ANN001 - a RunnerProposer
    """The proposer's passes replayed their graphs (a whole prompt's first pass may run eagerly), and so
    did every target step, verify steps with fewer than k proposals (max_tokens cuts) too."""
    assert drafter.pass_paths["cuda_graph"] > 0 and set(drafter.pass_paths) <= {"cuda_graph", "tokens_above_buckets"}
    assert set(llm.engine.stats().steps_by_path) == {"cuda_graph"}


def test_draft_model_passes_replay_graphs_and_keep_the_tokens(make_checkpoint) -> None:
    """Speculative decoding with a draft model (a smaller GPT-2 of random weights, every decode
    proposing): the draft's passes and every target step replay their captured graphs, and the
    tokens equal the engine's without speculation, float32."""
    import json

    path, config = make_checkpoint(GEOMETRIES[3], seed=3, tokenizer=False)
    draft, _ = make_checkpoint(GPT2Config(vocab_size=config.vocab_size, n_positions=128, n_embd=64, n_layer=1, n_head=4,
                                          initializer_range=0.3), seed=5, tokenizer=False)  # fmt: skip
    prompts = prompts_for(config.vocab_size, seed=4)
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    expected = [o.output_ids for o in LLM(str(path), device="cuda", dtype="float32").generate(prompts, params)]
    spec = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3, "max_pause_steps": 0})
    llm = LLM(str(path), device="cuda", dtype="float32", max_num_seqs=8, speculative_config=spec)
    drafter = llm.engine.core.executor.runner.drafter
    assert sorted(drafter.next_graphs.graphs) == [1, 2, 4, 8] and drafter.first_graphs.graphs
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert_replayed(llm, drafter)


def test_eagle_head_passes_replay_graphs_and_keep_the_tokens(tmp_path) -> None:
    """Speculative decoding with an EAGLE head mirroring a one-layer Llama target: the head's passes
    (over what each step kept, and the proposing ones) replay their captured graphs, most proposals
    are accepted, and the tokens equal the engine's run eagerly, float32."""
    import json

    from eagle_heads import target_and_head

    _, target, head = target_and_head(tmp_path, "eagle")
    prompts = prompts_for(320, seed=6)
    params = [SamplingParams(max_tokens=6 + 3 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    spec = json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 3, "max_pause_steps": 0})
    eager = LLM(str(target), device="cuda", dtype="float32", speculative_config=spec, enforce_eager=True)
    expected = [o.output_ids for o in eager.generate(prompts, params)]
    del eager
    llm = LLM(str(target), device="cuda", dtype="float32", max_num_seqs=8, speculative_config=spec)
    drafter = llm.engine.core.executor.runner.drafter
    assert sorted(drafter.propose_graphs.graphs) == [1, 2, 4, 8] and drafter.observe_graphs.graphs
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert_replayed(llm, drafter)
    stats = llm.engine.core.stats()
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens


def test_embedding_steps_replay_mixed_graphs_and_pool_the_eager_vectors(tmp_path) -> None:
    """Embedding requests (a one-token prompt among them): their steps replay the mixed graphs, whose
    every-token hidden states give the vectors of the same engine run eagerly (float32, 1e-5)."""
    write_tiny("Qwen3", tmp_path, seed=1)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [100, 200, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17], [42]]
    vectors, paths = [], []
    for enforce_eager in (False, True):
        llm = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8, enforce_eager=enforce_eager)
        vectors.append(torch.tensor([o.embedding for o in llm.embed(prompts)]))
        paths.append(set(llm.engine.stats().steps_by_path))
        del llm
    assert paths == [{"cuda_graph"}, {"enforce_eager"}]
    assert (vectors[0] - vectors[1]).abs().max() < 1e-5


def test_fp8_checkpoint_on_cuda_keeps_fp8_weights_and_the_cpus_tokens(tmp_path) -> None:
    """An FP8 (block-scaled) Llama-family checkpoint: on CUDA its projections stay FP8 (the Triton
    dequantizing GEMM), and its float32 greedy tokens equal the CPU's, which dequantizes at load."""
    from test_fp8 import PROMPTS, write_fp8

    from orca_backend.model.fp8 import Fp8Weight

    write_tiny("Qwen3", tmp_path / "float", seed=11)
    fp8_dir = write_fp8(tmp_path / "float", tmp_path / "fp8", (16, 16))
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu = [o.output_ids for o in LLM(str(fp8_dir), dtype="float32").generate(PROMPTS, params)]
    gpu = LLM(str(fp8_dir), device="cuda", dtype="float32")
    layer = gpu.engine.core.executor.runner.model.weights.layers[0]
    assert isinstance(layer.qkv_w, Fp8Weight) and layer.qkv_w.weight.dtype == torch.float8_e4m3fn
    assert [o.output_ids for o in gpu.generate(PROMPTS, params)] == cpu


def test_gptq_checkpoint_on_cuda_keeps_int4_weights_and_the_cpus_tokens(tmp_path) -> None:
    """A GPTQ checkpoint (4 bits, asymmetric, desc_act): on CUDA its projections stay packed (the
    Triton dequantizing GEMM, decode steps graphed), and its float32 greedy tokens equal the CPU's
    (its C kernel)."""
    from int_checkpoints import write_gptq
    from test_int_quant import PROMPTS

    from orca_backend.model.int_quant import IntWeight

    write_tiny("Llama", tmp_path / "float", seed=11)
    write_gptq(tmp_path / "float", tmp_path / "gptq", 4, 32, sym=False, desc_act=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu = [o.output_ids for o in LLM(str(tmp_path / "gptq"), dtype="float32").generate(PROMPTS, params)]
    gpu = LLM(str(tmp_path / "gptq"), device="cuda", dtype="float32")
    layer = gpu.engine.core.executor.runner.model.weights.layers[0]
    assert isinstance(layer.qkv_w, IntWeight) and layer.qkv_w.g_idx is not None
    assert [o.output_ids for o in gpu.generate(PROMPTS, params)] == cpu


def test_mixtral_on_cuda_equals_the_cpu(tmp_path) -> None:
    """Mixtral's experts on the GPU (Triton grouped GEMMs, decode steps graphed) give the CPU's
    float32 greedy tokens (the CPU's reference runs each chosen expert in torch)."""
    from test_moe import MIXTRAL

    model = write_tiny("Mixtral", tmp_path, seed=5, **MIXTRAL)
    prompts = prompts_for(model.config.vocab_size, seed=9)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu = [o.output_ids for o in LLM(str(tmp_path), dtype="float32").generate(prompts, params)]
    gpu = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8)
    assert [o.output_ids for o in gpu.generate(prompts, params)] == cpu


def test_integer_experts_on_cuda_stay_packed_and_give_the_cpus_tokens(tmp_path) -> None:
    """Qwen2-MoE with GPTQ experts (4 bits, activation order): on CUDA each projection's experts stay
    packed, stacked (the Triton grouped GEMMs dequantize their tiles), and the float32 greedy tokens
    equal the CPU's (each expert through the C kernel)."""
    from int_checkpoints import write_gptq
    from test_int_quant import PROMPTS

    from orca_kernels.int_quant import IntExperts

    write_tiny("Qwen2Moe", tmp_path / "float", seed=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)  # fmt: skip
    write_gptq(tmp_path / "float", tmp_path / "gptq", 4, 32, sym=False, desc_act=True)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    cpu = [o.output_ids for o in LLM(str(tmp_path / "gptq"), dtype="float32").generate(PROMPTS, params)]
    gpu = LLM(str(tmp_path / "gptq"), device="cuda", dtype="float32", max_num_seqs=8)
    layer = gpu.engine.core.executor.runner.model.weights.layers[0]
    assert isinstance(layer.experts_w13, IntExperts) and isinstance(layer.experts_w2, IntExperts)
    assert layer.experts_w13.g_idx is not None and len(layer.experts_w13) == 4
    assert [o.output_ids for o in gpu.generate(PROMPTS, params)] == cpu


@pytest.mark.parametrize("family", ["Mistral", "Gemma2", "Gemma3"])
def test_windowed_families_on_cuda_equal_transformers(tmp_path, family: str) -> None:
    """Sliding windows (blocks freed behind Mistral's), Gemma 2's soft-capping and Gemma 3's two rope
    tables on the GPU: the Triton kernels, decode steps graphed, give transformers' float32 tokens."""
    from test_window_models import GREEDY, write_family
    from test_window_models import PROMPTS as WINDOW_PROMPTS

    model = write_family(family, tmp_path)
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    gpu = LLM(str(tmp_path), device="cuda", dtype="float32", max_num_seqs=8, block_size=4)
    assert [o.output_ids for o in gpu.generate(WINDOW_PROMPTS, params)] == [hf_greedy(model, p, GREEDY.max_tokens) for p in WINDOW_PROMPTS]


def test_mixed_lora_adapters_on_cuda_equal_peft_merged(tmp_path) -> None:
    """Two PEFT adapters and none in one batch on the GPU (the Triton shrink/expand kernels, decode
    steps eager: LoRA engines capture no graphs): float32 tokens equal transformers + peft merged."""
    pytest.importorskip("peft")
    from hf_tiny import write_lora

    base = write_tiny("Llama", tmp_path / "base", seed=3)
    merged = {None: base, "A": write_lora(base, tmp_path / "A", 1, 8, ["q_proj", "v_proj", "o_proj", "down_proj"]),
              "B": write_lora(base, tmp_path / "B", 2, 16, ["k_proj", "gate_proj", "up_proj"])}  # fmt: skip
    prompts, names = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 9], [3]], ["A", None, "B", "A"]
    params = [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, lora_name=n) for n in names]
    gpu = LLM(str(tmp_path / "base"), device="cuda", dtype="float32", max_num_seqs=8, enable_lora=True, max_loras=2,
              lora_modules={"A": str(tmp_path / "A"), "B": str(tmp_path / "B")})  # fmt: skip
    assert gpu.engine.core.executor.runner.model.ops.name == "triton"
    want = []
    for prompt, name in zip(prompts, names, strict=True):
        with torch.no_grad():
            out = merged[name].generate(torch.tensor([prompt]), max_new_tokens=16, min_new_tokens=16, do_sample=False)
        want.append(out[0, len(prompt):].tolist())
    assert [o.output_ids for o in gpu.generate(prompts, params)] == want
