"""Prompt logprobs (SamplingParams.prompt_logprobs, vLLM's) against transformers in float64.

Entry i of a request's prompt logprobs scores prompt token i given tokens 0..i-1 (entry 0 is None):
the logits of position i - 1. The classic bug is an off-by-one between positions and tokens, so the
reference is written out position by position, and a loglikelihood of a continuation (what lm-eval
asks with max_tokens 1) is checked as a sum. Values must equal the reference's log-softmax to fp32
tolerance; the top-k ids must equal the reference's where the k-th and (k+1)-th values are apart.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from orca_backend import LLM, SamplingParams
from orca_backend.core.request import Request
from orca_backend.core.scheduler import _hold_prompt_logprobs
from orca_backend.scheduler_output import PromptLogprobsChunk

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 6, 7, 164, 202, 19, 109, 285, 33, 12, 90, 91, 7, 7, 300, 2, 64, 65, 66, 1, 250, 3, 9],
           [100, 3, 250, 7], [42], [17, 17, 300, 9, 11, 13, 200, 201, 202, 203, 5]]  # fmt: skip


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint[0]


@torch.no_grad()
def reference(hf, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab]: row i - 1 is log p(. | prompt[:i]), which scores prompt[i]."""
    return hf(torch.tensor([prompt])).logits[0, :-1].log_softmax(dim=-1)


def check(prompt_logprobs, prompt: list[int], ref: torch.Tensor, k: int) -> None:
    assert prompt_logprobs is not None and len(prompt_logprobs) == len(prompt)
    assert prompt_logprobs[0] is None
    for i in range(1, len(prompt)):
        entry, row, token = prompt_logprobs[i], ref[i - 1], prompt[i]
        assert token in entry  # the prompt token itself, whatever its rank
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4, (i, t)
            assert lp.rank == 1 + int((row > row[t]).sum()), (i, t)
        values, ids = row.topk(k + 1)
        if k and float(values[k - 1] - values[k]) > 1e-4:  # the top k are unambiguous
            assert set(entry) == {token, *ids[:k].tolist()}, i
        assert len(entry) in (k, k + 1)


@pytest.mark.parametrize("chunk", [0, 5], ids=["whole", "chunked"])
def test_prompt_logprobs_equal_transformers_at_every_position(checkpoint, tiny_hf_float64, chunk):
    """Chunked: 5 tokens an iteration, so the first prompt's logprobs come from 5 steps, and chunks
    end on every offset of a prompt; whole: one step."""
    llm = LLM(str(checkpoint), dtype="float32", max_num_seqs=4, max_num_batched_tokens=chunk)
    try:
        params = [replace(GREEDY, prompt_logprobs=k) for k in (3, 0, 5, 20)]
        outs = llm.generate(PROMPTS, params)
        plain = llm.generate(PROMPTS, GREEDY)
    finally:
        llm.shutdown()
    for prompt, out, p, base in zip(PROMPTS, outs, params, plain, strict=True):
        check(out.prompt_logprobs, prompt, reference(tiny_hf_float64, prompt), p.prompt_logprobs)
        assert out.output_ids == base.output_ids  # the extra logits rows change no token
    assert all(out.prompt_logprobs is None for out in plain)
    assert outs[2].prompt_logprobs == [None]  # one prompt token: nothing to score


def test_a_loglikelihood_equals_the_sum_from_transformers(checkpoint, tiny_hf_float64):
    """lm-eval's loglikelihood(context, continuation): one request of context + continuation with
    max_tokens 1 and prompt_logprobs 0, summed over the continuation's positions."""
    context, continuation = PROMPTS[0][:15], PROMPTS[0][15:]
    with LLM(str(checkpoint), dtype="float32") as llm:
        out = llm.generate([context + continuation], SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))[0]
    ours = sum(out.prompt_logprobs[i][t].logprob for i, t in enumerate(continuation, start=len(context)))
    with torch.no_grad():
        logits = tiny_hf_float64(torch.tensor([context + continuation])).logits[0].log_softmax(dim=-1)
    theirs = sum(float(logits[len(context) + j - 1, t]) for j, t in enumerate(continuation))
    assert ours == pytest.approx(theirs, abs=1e-4)
    is_greedy = all(out.prompt_logprobs[i][t].rank == 1 for i, t in enumerate(continuation, start=len(context)))
    assert not is_greedy  # a random continuation: the test would see a logprob taken one position off


def test_batched_with_generation_requests_whose_tokens_stay_exact(checkpoint, tiny_hf_float64):
    """Prompt-logprob rows beside sampling requests of every kind: their tokens and logprobs are the
    ones they have alone."""
    others = [SamplingParams(max_tokens=8, temperature=0.9, seed=3, logprobs=2, ignore_eos=True),
              SamplingParams(max_tokens=8, temperature=0.0, presence_penalty=0.5, ignore_eos=True)]  # fmt: skip
    with LLM(str(checkpoint), dtype="float32", max_num_seqs=4, max_num_batched_tokens=16) as llm:
        alone = llm.generate(PROMPTS[1:2] + PROMPTS[3:], others)
        mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[3]],
                             [replace(GREEDY, prompt_logprobs=2), *others])  # fmt: skip
    check(mixed[0].prompt_logprobs, PROMPTS[0], reference(tiny_hf_float64, PROMPTS[0]), 2)
    for one, other in zip(alone, mixed[1:], strict=True):
        assert one.output_ids == other.output_ids and one.prompt_logprobs is None is other.prompt_logprobs
    assert [e.keys() for e in alone[0].logprobs] == [e.keys() for e in mixed[1].logprobs]


def test_a_cached_prefix_is_computed_again_for_prompt_logprobs(checkpoint, tiny_hf_float64):
    """vLLM's rule: a request asking for prompt logprobs reads nothing from the prefix cache (a cached
    block has no logits), so its values are whole; others still hit what it cached."""
    with LLM(str(checkpoint), dtype="float32", block_size=4, enable_prefix_caching=True) as llm:
        llm.generate([PROMPTS[0]], GREEDY)
        hits = llm.engine.stats().prefix_cache_hit_tokens
        out = llm.generate([PROMPTS[0]], replace(GREEDY, prompt_logprobs=1))[0]
        assert llm.engine.stats().prefix_cache_hit_tokens == hits
        again = llm.generate([PROMPTS[0]], GREEDY)[0]
        assert llm.engine.stats().prefix_cache_hit_tokens > hits
    check(out.prompt_logprobs, PROMPTS[0], reference(tiny_hf_float64, PROMPTS[0]), 1)
    assert again.output_ids == out.output_ids


def test_a_recomputed_chunk_is_not_held_twice():
    """After a preemption a request's prefill runs again from its start: the chunks it holds already
    are dropped, the new tail is appended, and a gap is a loud error."""
    request = Request("r", list(range(10)), replace(GREEDY, prompt_logprobs=0), 0.0)
    row = ([1], [-1.0], [1])
    _hold_prompt_logprobs([request], [PromptLogprobsChunk(0, 1, [row] * 4)])  # tokens 1..4
    _hold_prompt_logprobs([request], [PromptLogprobsChunk(0, 1, [([2], [-2.0], [2])] * 6)])  # 1..6 again
    assert request.prompt_logprobs == [row] * 4 + [([2], [-2.0], [2])] * 2
    with pytest.raises(ValueError, match="from token 9"):
        _hold_prompt_logprobs([request], [PromptLogprobsChunk(0, 9, [row])])


@pytest.mark.parametrize("value", [-1, 21, 1.5, True, "x"])
def test_prompt_logprobs_out_of_range_are_refused(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams.from_dict({"prompt_logprobs": value})
    assert SamplingParams.from_dict({"prompt_logprobs": "3"}).prompt_logprobs == 3
