"""Helpers the engine's test files share: GREEDY (four greedy tokens), `drain` (step an in-process
engine until it has no work), and seeded workloads: short random prompts, long prompts with an
optional shared prefix, and sampling parameters mixing greedy and seeded random sampling."""

from __future__ import annotations

import random

import torch

from orca_backend import SamplingParams
from orca_backend.engine.llm_engine import LLMEngine

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def drain(engine: LLMEngine) -> None:
    while engine.has_work():
        engine.step()


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
