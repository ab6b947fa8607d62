"""n > 1 (parallel sampling): one prompt, n samples, the prompt prefilled once.

Sample i of a request seeded s draws with seed s + i (vLLM's derivation), so its tokens must equal
those of a separate request seeded s + i: that is the oracle here, under every K/V policy, chunked
prefill, async scheduling, request-level batching and preemption. The prompt's blocks are held
once: read from the K/V manager's pool while the samples run.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from engine_helpers import drain
from kv_modes import KV_MODES

from orca_backend import LLM, SamplingParams
from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.messages import FinishReason

# 10 tokens: with blocks of 4 the samples share blocks 0-1 and copy block 2, which holds the prompt's
# token 8 (computed by sample 0) and where each writes its last prompt token 9 and beyond.
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
SAMPLED = SamplingParams(max_tokens=8, temperature=0.9, top_k=50, seed=7, ignore_eos=True)


def separately(llm: LLM, prompt: list[int], params: SamplingParams) -> list[list[int]]:
    """The oracle: n separate requests, request i seeded seed + i."""
    singles = [replace(params, n=1, seed=params.seed + i) for i in range(params.n)]
    return [o.output_ids for o in llm.generate([prompt] * params.n, singles)]


@pytest.mark.parametrize("mode", [*KV_MODES, "async", "request-level"])
def test_samples_equal_separate_requests_seeded_as_vllm_seeds_them(mode):
    options = {"async": {"async_scheduling": True}, "request-level": {"scheduling": "request"}}.get(mode) \
        or KV_MODES[mode]  # fmt: skip
    params = [replace(SAMPLED, n=3),
              replace(SAMPLED, n=4, seed=40, presence_penalty=0.8, stop_token_ids=[97, 300], max_tokens=12),
              replace(SAMPLED, n=2, temperature=0.0)]  # fmt: skip
    prompts = [PROMPT, PROMPT[:5], [17, 17, 300, 9, 250, 4, 4, 91, 3]]
    with LLM("gpt2-tiny", max_num_seqs=8, **options) as llm:
        outs = llm.generate(prompts, params)
        for prompt, p, out in zip(prompts, params, outs, strict=True):
            assert [s.index for s in out.samples] == list(range(p.n))
            assert [s.output_ids for s in out.samples] == separately(llm, prompt, p), p
            assert out.output_ids == out.samples[0].output_ids
    assert len({tuple(s.output_ids) for s in outs[0].samples}) == 3  # seeded samples differ
    assert len({tuple(s.output_ids) for s in outs[2].samples}) == 1  # greedy ones do not


def test_the_prompt_is_prefilled_once_and_its_blocks_are_held_once():
    """While the samples decode, the blocks wholly before the prompt's last token are one set held
    by all n (their reference count is n), and the prompt ran through the model once, plus its last
    token once per other sample."""
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", kv_policy="paged", block_size=4, max_num_seqs=8))
    try:
        n = 4
        stream = engine.add_request(PROMPT, replace(SAMPLED, n=n, max_tokens=20))
        core = engine.core
        while len(core.scheduler.running) < n or any(not r.output_ids for r in core.scheduler.running):
            engine.step()
        tables = [r.block_tables[0] for r in core.scheduler.running]
        shared = (len(PROMPT) - 1) // 4
        assert all(t[:shared] == tables[0][:shared] for t in tables)
        assert len({t[shared] for t in tables}) == n  # the partly filled block: each sample's own copy
        assert [core.kv.pool.blocks[b].ref_count for b in tables[0][:shared]] == [n] * shared
        assert core.scheduler.num_prompt_tokens_computed == len(PROMPT) + n - 1
        drain(engine)
        finished = [e for e in stream if e.finished]
        assert sorted(e.index for e in finished) == list(range(n))
        assert core.kv.used_blocks == 0
    finally:
        engine.shutdown()


def test_preempted_samples_recompute_and_keep_their_tokens():
    """A pool too small for every sample at once: samples (forks included) are preempted and
    recomputed, and their tokens are still those of separate requests."""
    params = replace(SAMPLED, n=4, max_tokens=24)
    with LLM("gpt2-tiny", max_num_seqs=8, kv_policy="paged", block_size=4, kv_capacity_tokens=96) as llm:
        out = llm.generate([PROMPT], params)[0]
        assert llm.engine.core.scheduler.num_preemptions > 0
        assert [s.output_ids for s in out.samples] == separately(llm, PROMPT, params)


def test_abort_ends_every_sample_and_frees_their_blocks():
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", kv_policy="paged", block_size=4))
    try:
        stream = engine.add_request(PROMPT, replace(SAMPLED, n=3, max_tokens=50), request_id="fan")
        for _ in range(4):
            engine.step()
        engine.abort_request("fan")
        drain(engine)
        ends = [e for e in stream if e.finished]
        assert sorted(e.index for e in ends) == [0, 1, 2] and {e.finish_reason for e in ends} == {FinishReason.CANCELLED}
        assert {e.request_id for e in ends} == {"fan"}
        assert engine.core.kv.used_blocks == 0
        engine.add_request(PROMPT, SAMPLED, request_id="fan")  # the id is free again
        drain(engine)
    finally:
        engine.shutdown()


def test_a_failed_sample_cancels_the_others():
    """One sample's batch fails (its sampling raises in the runner): bisection ends that sample with
    the error, and its siblings are cancelled rather than run to max_tokens for a failed request."""
    from core_hooks import PoisonSampling

    engine = LLMEngine(EngineConfig(model="gpt2-tiny", max_num_seqs=8), core_hook=PoisonSampling("1_fan"))
    try:
        stream = engine.add_request(PROMPT, replace(SAMPLED, n=3, max_tokens=200), request_id="fan")
        drain(engine)
        ends = {e.index: e for e in stream if e.finished}
        assert ends[1].finish_reason is FinishReason.ERROR
        assert {ends[0].finish_reason, ends[2].finish_reason} == {FinishReason.CANCELLED}
        assert max(ends[0].num_output_tokens, ends[2].num_output_tokens) < 200
    finally:
        engine.shutdown()


def test_only_sample_0_returns_prompt_logprobs():
    with LLM("gpt2-tiny") as llm:
        out = llm.generate([PROMPT], replace(SAMPLED, n=2, prompt_logprobs=1))[0]
        alone = llm.generate([PROMPT], replace(SAMPLED, prompt_logprobs=1))[0]
    assert out.samples[0].prompt_logprobs == alone.prompt_logprobs and out.samples[1].prompt_logprobs is None


@pytest.mark.parametrize(("values", "match"), [({"n": 0}, "n must be"), ({"n": 129}, "n must be"),
                                               ({"n": 2, "best_of": 3}, "best_of is not supported")])  # fmt: skip
def test_bad_n_and_best_of_are_refused(values, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams.from_dict(values)
    assert SamplingParams.from_dict({"n": "2", "best_of": 1}).n == 2
