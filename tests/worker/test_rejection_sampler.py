"""Speculative sampling keeps the target's distribution (worker/sampler.py, `rejection_sample`):
tokens emitted after verifying a proposal (the proposal where accepted, else the residual's draw)
are distributed as the target's own, for a proposer that names one token (n-gram) and for one that
samples from a distribution q (a draft model). Checked by a chi-square test at a stated false-alarm
rate; the same test rejects two classic mistakes (resampling from p instead of the residual, and
accepting with min(1, q/p)). Then through the engine: the emitted tokens of many seeded requests
have the same distribution with speculation as without."""

from __future__ import annotations

import json
from statistics import NormalDist

import numpy as np
import pytest
import torch
from engine_helpers import random_prompts

from orca_backend import LLM, SamplingParams
from orca_backend.worker.sampler import _draw, rejection_sample

FALSE_ALARM = 1e-4  # the chance a correct sampler fails one check (every draw here is seeded: it either fails or not)
N = 40_000


def chi2_threshold(df: int, alpha: float = FALSE_ALARM) -> float:
    """The chi-square quantile 1 - alpha (Wilson-Hilferty's approximation: within 1% for df >= 3)."""
    z = NormalDist().inv_cdf(1 - alpha)
    return df * (1 - 2 / (9 * df) + z * (2 / (9 * df)) ** 0.5) ** 3


def goodness_of_fit(counts: np.ndarray, probs: np.ndarray) -> tuple[float, float]:
    """The chi-square statistic of observed `counts` against `probs` (cells with p > 0) and its threshold."""
    cells = probs > 0
    if counts[~cells].any():
        return float("inf"), 0.0
    expected = probs[cells] * counts.sum()
    return float(((counts[cells] - expected) ** 2 / expected).sum()), chi2_threshold(int(cells.sum()) - 1)


P = torch.tensor([0.35, 0.25, 0.2, 0.1, 0.07, 0.03, 0.0], dtype=torch.float64)  # the target's distribution
Q = torch.tensor([0.05, 0.1, 0.4, 0.3, 0.05, 0.05, 0.05], dtype=torch.float64)  # a draft model's


def emitted(sample, q: torch.Tensor | None, draft_token: int | None = None, seed: int = 0) -> np.ndarray:
    """Counts of the tokens emitted over N verifications of one proposal each: `draft_token`, or a
    draw from q."""
    g = torch.Generator().manual_seed(seed)
    probs = P.expand(N, -1).contiguous()
    if q is None:
        drafts = torch.full((N,), draft_token, dtype=torch.int64)
        draft_probs = None
    else:
        draft_probs = q.expand(N, -1).contiguous()
        drafts = _draw(draft_probs, torch.rand(N, generator=g, dtype=torch.float64)).squeeze(1)
    accept, replacement = sample(probs, drafts, torch.rand(N, generator=g, dtype=torch.float64),
                                 torch.rand(N, generator=g, dtype=torch.float64), draft_probs)  # fmt: skip
    tokens = torch.where(accept, drafts, replacement)
    return np.bincount(tokens.numpy(), minlength=len(P))


def resample_from_p(probs, drafts, u_accept, u_resample, draft_probs=None):
    """A classic mistake: a rejected proposal is replaced by a draw from p, not the residual."""
    accept, _ = rejection_sample(probs, drafts, u_accept, u_resample, draft_probs)
    return accept, _draw(probs, u_resample).squeeze(1)


def accept_by_q_over_p(probs, drafts, u_accept, u_resample, draft_probs=None):
    """Another: the ratio upside down."""
    p = probs.gather(1, drafts[:, None]).squeeze(1)
    q = draft_probs.gather(1, drafts[:, None]).squeeze(1) if draft_probs is not None else torch.ones_like(p)
    _, replacement = rejection_sample(probs, drafts, u_accept, u_resample, draft_probs)
    return u_accept * p < q, replacement


@pytest.mark.parametrize("draft_token", [0, 2, 5, 6])  # likely, middling, unlikely, impossible under p
def test_one_token_proposals_keep_the_distribution(draft_token):
    statistic, threshold = goodness_of_fit(emitted(rejection_sample, None, draft_token), P.numpy())
    assert statistic < threshold


def test_draft_model_proposals_keep_the_distribution():
    statistic, threshold = goodness_of_fit(emitted(rejection_sample, Q), P.numpy())
    assert statistic < threshold


@pytest.mark.parametrize("wrong", [resample_from_p, accept_by_q_over_p])
def test_a_wrong_rule_fails_the_same_check(wrong):
    statistic, threshold = goodness_of_fit(emitted(wrong, Q), P.numpy())
    assert statistic > threshold
    if wrong is resample_from_p:  # with a one-token proposer too
        statistic, threshold = goodness_of_fit(emitted(wrong, None, 2), P.numpy())
        assert statistic > threshold


def test_engine_samples_the_same_distribution_with_speculation(tiny_checkpoint):
    """2,000 requests with seeds 0..1999, temperature 1 and top-k 8: the distribution of their
    second and third tokens (sampled after proposals: the greedy continuation, often accepted,
    sometimes not) equals the one without speculation (a two-sample chi-square at FALSE_ALARM, over
    the tokens seen at least 20 times in all)."""
    path, config = tiny_checkpoint
    prompt = random_prompts(1, config.vocab_size, seed=2)[0]
    greedy = LLM(str(path)).generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))[0].output_ids
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=8, seed=s, ignore_eos=True) for s in range(2000)]
    plain = LLM(str(path), max_num_seqs=256).generate([prompt] * 2000, params)
    config_json = json.dumps({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 1})
    llm = LLM(str(path), max_num_seqs=256, speculative_config=config_json)

    class GreedyContinuation:
        def propose(self, request, limit):
            done = len(request.output_ids)
            return greedy[done : done + min(2, limit)]

        def forget(self, request_id):
            pass

    llm.engine.core.scheduler.proposer = GreedyContinuation()
    speculative = llm.generate([prompt] * 2000, params)
    stats = llm.engine.core.stats()
    assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
    for place in (1, 2):
        a = np.bincount([o.output_ids[place] for o in plain], minlength=config.vocab_size)
        b = np.bincount([o.output_ids[place] for o in speculative], minlength=config.vocab_size)
        cells = (a + b) >= 20
        a = np.r_[a[cells], a[~cells].sum()]
        b = np.r_[b[cells], b[~cells].sum()]
        keep = (a + b) > 0
        a, b = a[keep], b[keep]
        expected_a = (a + b) * a.sum() / (a.sum() + b.sum())
        expected_b = (a + b) * b.sum() / (a.sum() + b.sum())
        statistic = (((a - expected_a) ** 2 / expected_a) + ((b - expected_b) ** 2 / expected_b)).sum()
        assert len(a) > 3 and statistic < chi2_threshold(len(a) - 1)
