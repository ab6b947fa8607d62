"""The paged K/V policy, chunked prefill and prefix caching on a real (tiny) model: same tokens as
ORCA's reservation with whole prompts, greedy and seeded sampling alike."""

from __future__ import annotations

import random

import pytest
import torch

from orca_backend import LLM, SamplingParams


def long_prompts(n: int, vocab: int, seed: int, shared: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, vocab, (shared,), generator=gen).tolist()
    lengths = torch.randint(1, 40, (n,), generator=gen).tolist()  # the tiny model's context is 128
    return [prefix + torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


def mixed_params(n: int, seed: int) -> list[SamplingParams]:
    """Greedy and seeded random sampling, varied lengths: seeded tokens change if a prefill chunk
    or a recomputation draws from a request's generator."""
    rng = random.Random(seed)
    return [
        SamplingParams(max_tokens=rng.randint(1, 16), ignore_eos=True, temperature=rng.choice([0.0, 0.8]),
                       top_k=rng.choice([0, 20]), seed=rng.randrange(1000))  # fmt: skip
        for _ in range(n)
    ]


def spy_iterations(llm: LLM) -> list[tuple[int, int]]:
    """(requests, tokens) of every iteration the model runs."""
    runner = llm.engine.core.executor.runner
    seen: list[tuple[int, int]] = []
    original = runner.execute

    def spy(meta):
        seen.append((len(meta.scheduled_ids), meta.num_tokens))
        return original(meta)

    runner.execute = spy
    return seen


@pytest.fixture(scope="module")
def reference(tiny_checkpoint):
    path, config = tiny_checkpoint
    prompts = long_prompts(10, config.vocab_size, seed=2)
    params = mixed_params(10, seed=2)
    outs = LLM(str(path), max_num_seqs=4).generate(prompts, params)
    return str(path), prompts, params, [o.output_ids for o in outs]


@pytest.mark.parametrize("policy", ["reserve", "paged"])
@pytest.mark.parametrize("budget", [1, 7, 64])
def test_chunked_prefill_gives_the_unchunked_tokens(reference, policy, budget):
    path, prompts, params, expected = reference
    llm = LLM(path, max_num_seqs=4, kv_policy=policy, max_num_batched_tokens=budget)
    iterations = spy_iterations(llm)
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert max(tokens for _, tokens in iterations) <= budget
    if budget > 1:  # decodes ride along with prompt chunks
        assert any(requests > 1 and tokens > requests for requests, tokens in iterations)


@pytest.mark.parametrize("seed", range(4))
def test_a_pool_too_small_for_the_batch_preempts_and_keeps_every_token(tiny_checkpoint, seed):
    path, config = tiny_checkpoint
    prompts = long_prompts(8, config.vocab_size, seed=seed)
    params = mixed_params(8, seed=seed)
    expected = [LLM(str(path)).generate([p], [sp])[0].output_ids for p, sp in zip(prompts, params, strict=True)]
    llm = LLM(str(path), kv_policy="paged", block_size=4, kv_capacity_tokens=64, max_num_seqs=8, kv_watermark=0.0,
              max_num_batched_tokens=random.Random(seed).choice([0, 16]))  # fmt: skip
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_used_blocks == 0


def test_prefix_caching_skips_shared_prompt_tokens_and_keeps_outputs(tiny_checkpoint):
    path, config = tiny_checkpoint
    prompts = long_prompts(6, config.vocab_size, seed=4, shared=64)  # a 64-token "system prompt"
    params = mixed_params(6, seed=4)
    runs = {}
    for caching in (False, True):
        llm = LLM(str(path), kv_policy="paged", enable_prefix_caching=caching, max_num_seqs=2)
        outs = llm.generate(prompts, params)
        runs[caching] = ([o.output_ids for o in outs], llm.engine.stats())
    assert runs[True][0] == runs[False][0]
    plain, cached = runs[False][1], runs[True][1]
    assert plain.num_prompt_tokens_computed == sum(len(p) for p in prompts)
    # Two run at a time: the first two compute the prefix, the other four find its 16 blocks cached.
    assert cached.num_prompt_tokens_computed == plain.num_prompt_tokens_computed - 4 * 64
    assert cached.prefix_cache_hit_tokens == 4 * 64 and 0 < cached.prefix_cache_hit_rate < 1


def test_cached_prefixes_are_evicted_when_the_pool_needs_their_blocks(tiny_checkpoint):
    path, config = tiny_checkpoint
    llm = LLM(str(path), kv_policy="paged", enable_prefix_caching=True, block_size=4, kv_capacity_tokens=128)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    first, big = (torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (64, 108))

    def hits_of(prompt: list[int]) -> tuple[list[int], int]:
        before = llm.engine.stats().prefix_cache_hit_tokens
        out = llm.generate([prompt], greedy)[0].output_ids
        return out, llm.engine.stats().prefix_cache_hit_tokens - before

    expected, _ = hits_of(first)
    assert hits_of(first) == (expected, 60)  # 15 of its 16 blocks: the last token is always computed
    # 108 + 4 tokens need 28 of the 32 blocks; at most 19 were ever handed out, so cached ones go.
    hits_of(big)
    out, hits = hits_of(first)
    assert out == expected and hits < 60
    assert llm.engine.stats().kv_used_blocks == 0
