"""Helpers the engine's test files share: GREEDY (four greedy tokens), `drain` (step an in-process
engine until it has no work), `chunked_then_cached` (the same prompts twice through chunked prefill
and the prefix cache), and seeded workloads: short random prompts, long prompts with an optional
shared prefix, and sampling parameters mixing greedy and seeded random sampling; `OracleProposer`,
speculative decoding's proposals made right or wrong to order."""

from __future__ import annotations

import random

import torch

from orca_backend import LLM, SamplingParams
from orca_backend.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def drain(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


def chunked_then_cached(model: str, prompts: list[list[int]], params: SamplingParams, chunk: int,
                        **engine: object) -> tuple[list[list[int]], list[list[int]]]:
    """The prompts' tokens prefilled in `chunk`-token pieces (float32, blocks of 4, prefix caching on),
    then again over the warm prefix cache, which must have served some of them."""
    llm = LLM(model, dtype="float32", max_num_seqs=8, block_size=4, max_num_batched_tokens=chunk,
              enable_prefix_caching=True, **engine)  # fmt: skip
    try:
        first = [o.output_ids for o in llm.generate(prompts, params)]
        again = [o.output_ids for o in llm.generate(prompts, params)]
        assert llm.engine.stats().prefix_cache_hit_tokens > 0
    finally:
        llm.engine.shutdown()
    return first, again


def random_prompts(n: int, vocab: int, seed: int, max_len: int = 24) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, max_len, (n,), generator=gen).tolist()
    return [torch.randint(0, vocab, (k,), generator=gen).tolist() for k in lengths]


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


class OracleProposer:
    """Speculative decoding's proposals made to order (in the scheduler's place of its proposer).
    Proposes each request's true continuation (its tokens from a run without speculation), wrong
    from a place that cycles from call to call: every proposal is accepted (`wrong` "never"), some
    are ("cycle": 0, 1, ... k accepted in turn), or none ("always")."""

    K = 4  # tokens a proposal holds at most: the engine's num_speculative_tokens must be as many

    def __init__(self, prompts: list[list[int]], references: list[list[int]], vocab_size: int, wrong: str,
                 strict: bool = True) -> None:  # fmt: skip
        """`references[i]`: the tokens that follow `prompts[i]` (token ids). `strict`: the engine's
        tokens must be the reference's (greedy); else it proposes the reference's tokens at the same
        place, wherever the request went."""
        self.references = {tuple(p): r for p, r in zip(prompts, references, strict=True)}
        self.vocab_size, self.wrong, self.strict = vocab_size, wrong, strict
        self.proposed = 0
        self.calls = 0

    def propose(self, request, limit: int) -> list[int]:  # noqa: ANN001 - a core Request
        """NgramProposer.propose's contract: up to min(K, limit) tokens to follow the request's."""
        tokens = request.prompt_ids + request.output_ids
        for prompt, reference in self.references.items():
            if tuple(tokens[: len(prompt)]) == prompt:
                done = len(tokens) - len(prompt)
                assert not self.strict or tokens[len(prompt) :] == reference[:done], "the tokens left the reference"
                proposal = reference[done : done + min(self.K, limit)]
                wrong_from = {"never": self.K, "always": 0, "cycle": self.calls % (self.K + 1)}[self.wrong]
                self.calls += 1
                proposal = [t if j < wrong_from else (t + 1) % self.vocab_size for j, t in enumerate(proposal)]
                self.proposed += len(proposal)
                return proposal
        raise AssertionError("a context no reference starts with")

    def forget(self, request_id: str) -> None:
        pass
