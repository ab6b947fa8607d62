"""Distributed execution on CPU (gloo): worker processes with tensor and pipeline parallelism."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from core_hooks import pid_alive
from engine_helpers import OracleProposer
from kv_modes import KV_MODES

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.engine.llm_engine import EngineDeadError, LLMEngine
from orca_backend.families.gpt2 import GPT2Config

# Heads and MLP width split over tp=2, layers over pp=2; the vocabulary (not a multiple of 2 x 64)
# exercises the padded vocab-parallel gather.
GEOMETRY = GPT2Config(vocab_size=301, n_positions=128, n_embd=96, n_layer=4, n_head=6, initializer_range=0.3)


@pytest.fixture(scope="module")
def checkpoint(make_checkpoint):
    return make_checkpoint(GEOMETRY, seed=11, tokenizer=False)[0]


def staggered_run(engine: LLMEngine, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Adds requests one by one while others decode; short ones leave while long ones go on."""
    tokens: dict[str, list[int]] = {}

    def collect(out):
        tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    ids = []
    for prompt, n in zip(prompts, lengths, strict=True):
        params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(prompt, params, on_output=collect).request_id)
        engine.step()
    while engine.has_work():
        engine.step()
    assert engine.core.kv.used_tokens == 0
    return [tokens[i] for i in ids]


def make_prompts(n: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(4)
    return [torch.randint(0, GEOMETRY.vocab_size, (int(k),), generator=gen).tolist() for k in torch.randint(1, 20, (n,), generator=gen)]


@pytest.fixture(scope="module")
def reference(checkpoint):
    engine = LLMEngine(EngineConfig(model=str(checkpoint), max_num_seqs=3))
    prompts = make_prompts(8)
    lengths = [9, 3, 12, 5, 2, 10, 7, 4]
    return prompts, lengths, staggered_run(engine, prompts, lengths)


@pytest.mark.parametrize(("tp", "pp", "mode"), [(2, 1, "reserve"), (1, 2, "reserve"), (2, 2, "reserve"),
                                                (2, 1, "paged-chunked-cached"), (1, 2, "paged-chunked-cached")])
def test_parallel_tokens_equal_single_process(checkpoint, reference, tp, pp, mode):
    prompts, lengths, expected = reference
    engine = LLMEngine(EngineConfig(model=str(checkpoint), max_num_seqs=3, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, **KV_MODES[mode]))  # fmt: skip
    try:
        assert staggered_run(engine, prompts, lengths) == expected
        # Pipeline parallelism keeps one batch per stage in flight when enough requests wait.
        assert engine.stats().max_batches_in_flight == pp
        # Each rank holds about 1/(tp*pp) of the weights (embeddings are shared by first and last stage).
        per_rank = engine.core.executor.weight_bytes
        full = sum(p.numel() * 4 for p in _full_weights(checkpoint))
        assert max(per_rank) <= 1.3 * full / (tp * pp), (per_rank, full)
    finally:
        engine.shutdown()
    assert not any(p.is_alive() for p in engine.core.executor.processes)


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2)])
def test_speculative_decoding_equals_single_process(checkpoint, reference, tp, pp):
    """Proposals right up to a place that cycles: every rank writes them after the request's tokens,
    the sampling rank verifies them (the accepted counts cross the pipe), every rank appends the
    several tokens a step records and cuts the tables of rejected proposals (paged, blocks of 4)."""
    prompts, lengths, expected = reference
    spec = f'{{"method": "ngram", "num_speculative_tokens": {OracleProposer.K}}}'
    engine = LLMEngine(EngineConfig(model=str(checkpoint), max_num_seqs=3, tensor_parallel_size=tp,
                                    pipeline_parallel_size=pp, kv_policy="paged", block_size=4,
                                    speculative_config=spec))  # fmt: skip
    engine.core.scheduler.proposer = OracleProposer(prompts, expected, GEOMETRY.vocab_size, "cycle")
    try:
        assert staggered_run(engine, prompts, lengths) == expected
        stats = engine.stats()
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kernels", ["cpu", pytest.param("triton", marks=pytest.mark.slow)])
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "ngram"])
def test_tensor_parallel_steps_on_static_buffers_equal_single_process(checkpoint, reference, monkeypatch, kernels,
                                                                      speculative):  # fmt: skip
    """On a GPU each tensor-parallel rank replays CUDA graphs with its collectives inside
    (worker/cuda_graphs.py). Here every rank runs every step on the graphs' static buffers: prompt
    chunks joining decodes in mixed buckets of 16 and 24 tokens, decodes in batches of 1-3, and with
    speculation verify steps. The tokens are the single process's, and no rank's padding wrote K/V;
    with the Triton kernels (in the interpreter) every step on every rank passes the capture guard."""
    from worker_hooks import StaticBufferWorker

    from orca_backend.executor import multiproc

    prompts, lengths, expected = reference
    if kernels == "triton":  # the interpreter is slow: four requests
        prompts, lengths, expected = prompts[:4], lengths[:4], expected[:4]
    if speculative:  # three requests long enough for verify steps of k proposals each, once all are prefilled
        prompts, lengths = prompts[:3], [20] * 3
        expected = staggered_run(LLMEngine(EngineConfig(model=str(checkpoint), max_num_seqs=3)), prompts, lengths)
    hook = StaticBufferWorker(world_size=2, guard=kernels == "triton")
    monkeypatch.setattr(multiproc, "worker_main", hook)
    spec = f'{{"method": "ngram", "num_speculative_tokens": {OracleProposer.K}}}' if speculative else ""
    engine = LLMEngine(EngineConfig(model=str(checkpoint), max_num_seqs=3, tensor_parallel_size=2, kernels=kernels,
                                    kv_policy="paged", block_size=4, max_num_batched_tokens=24,
                                    speculative_config=spec))  # fmt: skip
    if speculative:
        engine.core.scheduler.proposer = OracleProposer(prompts, expected, GEOMETRY.vocab_size, "cycle")
    try:
        assert staggered_run(engine, prompts, lengths) == expected
        stats = engine.stats()
    finally:
        engine.shutdown()
    # Every step ran on the static buffers; with speculation, those that verify fewer than k
    # proposals for some request run eagerly (as on a GPU).
    eager = {"speculative"} if speculative else set()
    assert set(stats.steps_by_path) <= {"static_buffers", *eager}, stats.steps_by_path
    runs = [hook.runs(rank) for rank in range(2)]
    assert runs[0] == runs[1] and sum(runs[0].values()) == stats.steps_by_path["static_buffers"], (runs, stats)
    assert runs[0]["decode"] > 0 and runs[0]["mixed"] > 0
    assert (runs[0]["verify"] > 0) == speculative, (runs, stats.steps_by_path)


def test_penalties_and_logprobs_equal_single_process(checkpoint):
    """The sampling rank of a worker pool holds the penalty state and returns logprobs and prompt
    logprobs as the in-process sampler does: the steps' deltas cross the pipes as msgpack, the
    logprobs as JSON. Prompts are prefilled in chunks of 4 tokens, so prompt logprobs come from
    several steps (with tp = 2 the vocabulary's shards are gathered; with pp = 2 the last stage scores).
    The last request has n = 3 samples, forked from sample 0's blocks on every rank."""
    prompts = make_prompts(4)
    params = [
        SamplingParams(max_tokens=8, temperature=0.0, frequency_penalty=-0.5, repetition_penalty=1.3, logprobs=3,
                       prompt_logprobs=2, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.9, seed=4, presence_penalty=0.7, logit_bias={3: 4.0}, logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, prompt_logprobs=0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=1.0, seed=5, frequency_penalty=1.0, n=3, ignore_eos=True),
    ]
    outputs = []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(str(checkpoint), max_num_seqs=6, tensor_parallel_size=tp, pipeline_parallel_size=pp,
                  max_num_batched_tokens=4, kv_policy="paged", block_size=4)  # fmt: skip
        try:
            outputs.append(llm.generate(prompts, params))
        finally:
            llm.engine.shutdown()
    for one, *others in zip(*outputs, strict=True):
        for two in others:
            assert one.output_ids == two.output_ids
            # n = 3: every rank copies the samples' partly filled block before they run
            assert [s.output_ids for s in one.samples or []] == [s.output_ids for s in two.samples or []]
            for name in ("logprobs", "prompt_logprobs"):
                ours, theirs = getattr(one, name), getattr(two, name)
                assert (ours is None) == (theirs is None)
                for a, b in zip(ours or [], theirs or [], strict=True):
                    assert (a is None) == (b is None)
                    if a is not None:
                        assert a.keys() == b.keys() and all(a[t].rank == b[t].rank for t in a)
                        assert all(abs(a[t].logprob - b[t].logprob) < 1e-5 for t in a)
    assert outputs[0][0].logprobs is not None and outputs[0][1].logprobs is not None
    assert [len(o.prompt_logprobs or []) for o in outputs[0]] == [len(prompts[0]), 0, len(prompts[2]), 0]
    assert max(len(p) for p in prompts[::2]) > 4  # some prompt logprobs came from several chunks
    assert len({tuple(s.output_ids) for s in outputs[0][3].samples}) == 3 and len(prompts[3]) > 5


def test_embeddings_equal_single_process(checkpoint):
    """Embedding requests under tp = 2 (each rank holds the whole hidden state after its all-reduce)
    and pp = 2 (the last stage pools, and its chunk sums cross the pipe as JSON)."""
    from orca_backend.sampling_params import PoolingParams

    prompts = make_prompts(4)
    vectors = []
    for tp, pp in ((1, 1), (2, 1), (1, 2)):
        llm = LLM(str(checkpoint), tensor_parallel_size=tp, pipeline_parallel_size=pp, max_num_batched_tokens=5)
        try:
            vectors.append([o.embedding for o in llm.embed(prompts, PoolingParams())])
        finally:
            llm.engine.shutdown()
    for other in vectors[1:]:
        for a, b in zip(vectors[0], other, strict=True):
            assert max(abs(x - y) for x, y in zip(a, b, strict=True)) < 1e-5


def _full_weights(checkpoint) -> list[torch.Tensor]:
    from safetensors.torch import load_file

    return list(load_file(str(checkpoint / "model.safetensors")).values())


def test_killed_worker_ends_requests_with_errors_and_leaves_no_orphans(checkpoint):
    engine = LLMEngine.launch(EngineConfig(model=str(checkpoint), tensor_parallel_size=2))
    try:
        stream = engine.add_request([1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        waiting = engine.add_request([4, 5], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        events = iter(stream)
        assert not next(events).finished  # generation is under way
        workers = engine.core.worker_pids
        assert len(workers) == 2
        os.kill(workers[1], signal.SIGKILL)
        started = time.monotonic()
        last = list(events)[-1]
        assert last.finish_reason == "error" and "worker" in last.error
        assert list(waiting)[-1].finish_reason == "error"
        assert time.monotonic() - started < 15
        assert not engine.healthy
        with pytest.raises(EngineDeadError, match="worker"):
            engine.add_request([1], SamplingParams(max_tokens=1))
        deadline = time.monotonic() + 15
        while any(map(pid_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(pid_alive, workers))
    finally:
        engine.shutdown()


def test_worker_exception_is_reported_not_hung(checkpoint):
    """A rank that raises (here: an unloadable checkpoint path) fails start-up with its traceback."""
    from orca_backend.executor.base import WorkerFailure

    bad = EngineConfig(model=str(checkpoint), tensor_parallel_size=2, tokenizer=None)
    os.rename(checkpoint / "model.safetensors", checkpoint / "moved.safetensors")
    try:
        with pytest.raises(WorkerFailure, match="no model.safetensors"):
            LLMEngine(bad)
    finally:
        os.rename(checkpoint / "moved.safetensors", checkpoint / "model.safetensors")


@pytest.mark.parametrize(
    ("geometry", "tp", "pp", "message"),
    [
        (GPT2Config(vocab_size=384, n_positions=64, n_embd=112, n_layer=2, n_head=7), 2, 1,
         "tensor_parallel_size 2 does not divide n_head 7"),
        (GPT2Config(vocab_size=384, n_positions=64, n_embd=64, n_layer=2, n_head=4), 3, 1,
         "tensor_parallel_size 3 does not divide n_head 4"),
        (GPT2Config(vocab_size=384, n_positions=64, n_embd=64, n_layer=2, n_head=4), 1, 3,
         "pipeline_parallel_size 3 exceeds the model's 2 layers"),
    ],
)
def test_a_layout_the_geometry_cannot_split_is_refused_at_load_naming_the_field(make_checkpoint, geometry, tp, pp,
                                                                                message):  # fmt: skip
    """Before any worker starts (a GPT-2 of 7 heads at tp=2 used to load and fail at the first
    forward with a shape error that ended the engine); the Llama family's fields: test_llama.py."""
    path, _ = make_checkpoint(geometry, tokenizer=False)
    with pytest.raises(ValueError, match=message):
        LLMEngine(EngineConfig(model=str(path), tensor_parallel_size=tp, pipeline_parallel_size=pp))
