"""Embedding requests (vLLM's task "embed") against transformers' last hidden state, pooled the same way.

The oracle is transformers' `hidden_states[-1]` (after the final norm) of the prompt alone, pooled as
the checkpoint's sentence-transformers files say (last token by default, mean, CLS), cut to
`dimensions` and L2-normalised where a Normalize module is listed. Tolerance: 1e-5 absolute per value
(float32 kernels against float32 transformers on a 64-wide model; the differences seen are ~2e-7).
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from engine_helpers import drain
from hf_tiny import write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.sampling_params import PoolingParams

transformers = pytest.importorskip("transformers")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [3, 4], [100, 200, 300, 1, 2, 3, 4, 5, 6, 7, 8, 9, 17], [42]]
TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen3-embed")
    return path, write_tiny("Qwen3", path, seed=1)


def with_pooling(src: Path, dst: Path, mode: str, normalize: bool, **config: object) -> Path:
    """A copy of the checkpoint with sentence-transformers' modules.json and 1_Pooling/config.json
    (and `config` merged into config.json)."""
    shutil.copytree(src, dst)
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]  # fmt: skip
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    (dst / "modules.json").write_text(json.dumps(modules))
    (dst / "1_Pooling").mkdir()
    modes = {f"pooling_mode_{m}": m == mode for m in ("cls_token", "mean_tokens", "max_tokens", "lasttoken")}
    (dst / "1_Pooling" / "config.json").write_text(json.dumps({"word_embedding_dimension": 64, **modes}))
    hf = json.loads((dst / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(hf | config))
    return dst


@torch.no_grad()
def reference(model, prompt: list[int], mode: str = "lasttoken", normalize: bool = True, dims: int | None = None):
    hidden = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states[-1][0].double()
    vector = {"lasttoken": hidden[-1], "mean_tokens": hidden.mean(0), "cls_token": hidden[0]}[mode][:dims]
    return torch.nn.functional.normalize(vector, dim=0) if normalize else vector


def check(outputs, model, prompts, **pooled) -> None:
    for prompt, out in zip(prompts, outputs, strict=True):
        want = reference(model, prompt, **pooled)
        assert out.num_input_tokens == len(prompt) and len(out.embedding) == len(want)
        assert (torch.tensor(out.embedding, dtype=torch.float64) - want).abs().max() < TOLERANCE, prompt


@pytest.mark.parametrize("chunk", [0, 5], ids=["whole", "chunked"])
def test_default_pooling_is_the_last_token_normalised(qwen3, chunk):
    path, model = qwen3
    with LLM(str(path), max_num_seqs=4, max_num_batched_tokens=chunk) as llm:
        check(llm.embed(PROMPTS), model, PROMPTS)


@pytest.mark.parametrize(("mode", "normalize"), [("mean_tokens", True), ("cls_token", False), ("lasttoken", False)])
def test_sentence_transformers_pooling_over_chunks(qwen3, tmp_path, mode, normalize):
    """Mean pooling sums the hidden states of every chunk of the prompt (5 tokens an iteration)."""
    path, model = qwen3
    pooled = with_pooling(path, tmp_path / "st", mode, normalize)
    with LLM(str(pooled), max_num_seqs=4, max_num_batched_tokens=5) as llm:
        check(llm.embed(PROMPTS), model, PROMPTS, mode=mode, normalize=normalize)


def test_matryoshka_dimensions_cut_before_the_normalisation(qwen3, tmp_path):
    path, model = qwen3
    with LLM(str(with_pooling(path, tmp_path / "m", "lasttoken", True, matryoshka_dimensions=[16, 32, 64]))) as llm:
        check(llm.embed(PROMPTS, PoolingParams(dimensions=16)), model, PROMPTS, dims=16)
        with pytest.raises(ValueError, match=r"dimensions must be one of \[16, 32, 64\], got 20"):
            llm.embed(PROMPTS[:1], PoolingParams(dimensions=20))
    with LLM(str(path)) as llm, pytest.raises(ValueError, match="does not support Matryoshka"):
        llm.embed(PROMPTS[:1], PoolingParams(dimensions=16))


def test_a_pooling_this_engine_does_not_compute_refuses_embeddings_not_generation(qwen3, tmp_path):
    path, _ = qwen3
    with LLM(str(with_pooling(path, tmp_path / "max", "max_tokens", True))) as llm:
        with pytest.raises(ValueError, match=r"pooling \(pooling_mode_max_tokens\) is not computed here"):
            llm.embed(PROMPTS[:1])
        assert len(llm.generate(PROMPTS[:1], SamplingParams(max_tokens=3, ignore_eos=True))[0].output_ids) == 3


def test_embeddings_batched_with_generation_whose_tokens_stay_exact(qwen3, tmp_path):
    """Embedding requests are prefills that emit no token: in the same iterations as generation
    requests, mean-pooled over chunks, the generated tokens are those of a run without them."""
    path, model = qwen3
    pooled = with_pooling(path, tmp_path / "mean", "mean_tokens", True)
    params = [SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)]  # fmt: skip
    engine = LLMEngine(EngineConfig(model=str(pooled), max_num_seqs=8, max_num_batched_tokens=9))
    try:
        alone = engine.add_requests(PROMPTS[:2], params)
        drain(engine)
        expected = [[t for e in s for t in e.new_token_ids] for s in alone]
        generated = engine.add_requests(PROMPTS[:2], params)
        embedded = engine.add_requests(PROMPTS, SamplingParams(), pooling=PoolingParams())
        iterations = engine.core.num_iterations
        drain(engine)
        assert engine.core.num_iterations - iterations < 15  # they ran side by side, not one after the other
        assert [[t for e in s for t in e.new_token_ids] for s in generated] == expected
        finals = [list(s)[-1] for s in embedded]
        assert all(f.new_token_ids == [] and f.num_output_tokens == 0 for f in finals)
        check(finals, model, PROMPTS, mode="mean_tokens")
        assert engine.core.kv.used_blocks == 0
    finally:
        engine.shutdown()


def test_embedding_steps_on_the_graphs_static_buffers_pool_the_same(qwen3, tmp_path):
    """On CUDA a step with embedding requests replays a mixed graph, which returns every token's final
    hidden states (worker/cuda_graphs.py). Here those static buffers run eagerly: mean-pooled over
    chunks beside generation (a one-token prompt among them), the embeddings are transformers' and
    the tokens the eager engine's, and every step ran on the buffers."""
    from orca_backend.worker.cuda_graphs import capture_sizes, mixed_capture_sizes

    path, model = qwen3
    pooled = with_pooling(path, tmp_path / "mean", "mean_tokens", True)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    with LLM(str(pooled), max_num_seqs=8, max_num_batched_tokens=9) as eager:
        expected = [o.output_ids for o in eager.generate(PROMPTS[:2], params)]
    engine = LLMEngine(EngineConfig(model=str(pooled), max_num_seqs=8, max_num_batched_tokens=9))
    try:
        runner = engine.core.executor.runner
        runner.decode_graphs = runner.static_decode(capture_sizes(8))
        runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(9))
        generated = engine.add_requests(PROMPTS[:2], params)
        embedded = engine.add_requests(PROMPTS, SamplingParams(), pooling=PoolingParams())
        drain(engine)
        assert [[t for e in s for t in e.new_token_ids] for s in generated] == expected
        check([list(s)[-1] for s in embedded], model, PROMPTS, mode="mean_tokens")
        assert set(engine.stats().steps_by_path) == {"static_buffers"}
    finally:
        engine.shutdown()


def test_a_preempted_embedding_request_pools_its_recompute_once(qwen3, tmp_path):
    """A pool too small for everything at once preempts: a mean-pooled request recomputed from its
    start must not count its first chunks twice."""
    path, model = qwen3
    pooled = with_pooling(path, tmp_path / "mean", "mean_tokens", True)
    prompts = [p * 3 for p in PROMPTS]
    with LLM(str(pooled), max_num_seqs=8, kv_policy="paged", block_size=4, kv_capacity_tokens=64,
             max_num_batched_tokens=8) as llm:  # fmt: skip
        gen = llm.engine.add_requests(prompts[:2], SamplingParams(max_tokens=40, ignore_eos=True))
        embedded = llm.engine.add_requests(prompts, SamplingParams(), pooling=PoolingParams())
        drain(llm.engine)
        assert llm.engine.core.scheduler.num_preemptions > 0
        check([list(s)[-1] for s in embedded], model, prompts, mode="mean_tokens")
        assert all(list(s)[-1].num_output_tokens == 40 for s in gen)


def test_gpt2_family_pools_its_final_layernorm(tiny_checkpoint):
    path, _ = tiny_checkpoint
    model = transformers.GPT2Model.from_pretrained(path).eval()

    class LastHidden(torch.nn.Module):  # GPT2Model's hidden_states[-1] is after ln_f, as LMHead's is
        def forward(self, ids, output_hidden_states):
            return model(ids, output_hidden_states=output_hidden_states)

    with LLM(str(path), max_num_batched_tokens=4) as llm:
        check(llm.embed(PROMPTS), LastHidden(), PROMPTS)


def test_bad_dimensions_are_refused():
    for bad in (0, -3, 1.5, True):
        with pytest.raises(ValueError, match="dimensions must be a positive integer"):
            PoolingParams(dimensions=bad)
    assert replace(PoolingParams(), dimensions=8).dimensions == 8
