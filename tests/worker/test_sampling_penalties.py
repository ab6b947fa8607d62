"""Penalties, logit_bias and logprobs (vLLM v1's semantics) against a float64 reference on tiny models.

The reference runs `transformers` in float64 and applies the processing itself: logit_bias, then the
repetition penalty over prompt and output tokens, the frequency and presence penalties over output
tokens, then argmax. Exact token equality is sound on these tiny geometries as long as the top-2 gap
of the processed logits stays clear of float32 rounding: the reference reports its smallest gap and
the tests check it.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from kv_modes import KV_MODES

from orca_backend import LLM, SamplingParams
from orca_backend.entrypoints.llm import CompletionOutput
from orca_backend.worker.logits_processors import LogitsProcessors
from orca_backend.worker.staging import StagingArena

transformers = pytest.importorskip("transformers")

GREEDY = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
# The last one holds tokens its own greedy continuation comes back to.
PROMPTS = [[5, 6, 7], [100, 3, 250, 7, 7], [42], [17, 17, 300, 9], [5, 6, 7, 164, 202, 19, 109, 285]]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint[0]


@pytest.fixture(scope="module")
def llm(checkpoint) -> LLM:
    return LLM(str(checkpoint), max_num_seqs=16)


def process(logits: torch.Tensor, params: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """vLLM v1's logits processing of one row, written out plainly in float64."""
    x = logits.clone()
    for token, bias in (params.logit_bias or {}).items():
        x[token] += bias
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=x.shape[0]).double()
    if params.repetition_penalty != 1.0:
        seen = counts > 0
        seen[prompt] = True
        p = params.repetition_penalty
        x = torch.where(seen, torch.where(x > 0, x / p, x * p), x)
    return x - params.frequency_penalty * counts - params.presence_penalty * (counts > 0).double()


@torch.no_grad()
def reference_greedy(hf, prompt: list[int], params: SamplingParams) -> tuple[list[int], float]:
    """Greedy tokens under the params' processing, and the smallest top-2 gap met on the way."""
    output: list[int] = []
    gap = float("inf")
    for _ in range(params.max_tokens):
        logits = hf(torch.tensor([prompt + output])).logits[0, -1]
        x = process(logits, params, prompt, output)
        top = x.topk(2).values
        gap = min(gap, float(top[0] - top[1]))
        output.append(int(x.argmax()))
    return output, gap


@torch.no_grad()
def reference_logprobs(hf, prompt: list[int], output: list[int]) -> torch.Tensor:
    """[len(output), vocab]: float64 log_softmax of the raw logits at each generated position."""
    logits = hf(torch.tensor([prompt + output[:-1]])).logits[0, len(prompt) - 1 :]
    return logits.log_softmax(dim=-1)


def check_logprobs(out: CompletionOutput, ref: torch.Tensor, k: int, tokenizer) -> None:
    assert out.logprobs is not None and len(out.logprobs) == len(out.output_ids)
    total = 0.0
    for token, entry, row in zip(out.output_ids, out.logprobs, ref, strict=True):
        top = row.topk(k).indices.tolist() if k else []
        assert set(entry) == {token, *top}  # k or k + 1 entries: the sampled token always
        for t, lp in entry.items():
            assert abs(lp.logprob - float(row[t])) < 1e-4
            assert lp.rank == 1 + int((row > row[t]).sum())
            assert lp.decoded_token == (tokenizer.decode([t]) if tokenizer else "")
        total += entry[token].logprob
    assert out.cumulative_logprob == pytest.approx(total, abs=1e-9)


# --------------------------------------------------------------------------------- greedy, exact
CASES = {
    "repetition": dict(repetition_penalty=1.8),
    "repetition<1": dict(repetition_penalty=0.7),
    "frequency": dict(frequency_penalty=1.5),
    "negative frequency": dict(frequency_penalty=-1.0),
    "presence": dict(presence_penalty=1.5),
    "logit_bias": dict(logit_bias={254: 4.0, 91: 3.0, 164: -100.0, 151: 2.5}),
    # A repetition "bonus" makes the prompt's tokens likely: a frequency penalty must not touch them.
    "repetition<1 and frequency": dict(repetition_penalty=0.8, frequency_penalty=1.0),
    "all": dict(presence_penalty=0.5, frequency_penalty=0.7, repetition_penalty=1.3, logit_bias={114: 2.0, 19: -3.0}),
}


@pytest.mark.parametrize("case", CASES)
def test_penalties_and_bias_equal_a_float64_reference(llm, tiny_hf_float64, case):
    params = replace(GREEDY, **CASES[case])
    outs = llm.generate(PROMPTS, params)
    plain = llm.generate(PROMPTS, GREEDY)
    changed = 0
    for prompt, out, base in zip(PROMPTS, outs, plain, strict=True):
        ref, gap = reference_greedy(tiny_hf_float64, prompt, params)
        assert gap > 1e-3, "the reference's top-2 gap is too small for an exact comparison: pick other params"
        assert out.output_ids == ref, prompt
        changed += out.output_ids != base.output_ids
    assert changed >= 2  # the params matter here, so the test can fail


def test_logprobs_are_the_raw_log_softmax_with_ranks_and_top_k(llm, tiny_hf_float64):
    tok = llm.tokenizer
    # Random sampling picks tokens that are not the most likely: ranks above 1 are exercised.
    params = SamplingParams(max_tokens=16, temperature=1.3, seed=5, logprobs=5, ignore_eos=True,
                            presence_penalty=0.8, logit_bias={7: 3.0})  # fmt: skip
    for prompt in PROMPTS[:2]:
        out = llm.generate([prompt], params)[0]
        check_logprobs(out, reference_logprobs(tiny_hf_float64, prompt, out.output_ids), 5, tok)
        assert max(entry[t].rank for t, entry in zip(out.output_ids, out.logprobs, strict=True)) > 1
    # Greedy with a penalty: the argmax of the processed logits, logprobs of the raw ones.
    out = llm.generate([PROMPTS[2]], replace(GREEDY, logprobs=3, frequency_penalty=2.0))[0]
    check_logprobs(out, reference_logprobs(tiny_hf_float64, PROMPTS[2], out.output_ids), 3, tok)
    # logprobs=0: the sampled token alone; without logprobs, none at all.
    out = llm.generate([PROMPTS[3]], replace(GREEDY, logprobs=0))[0]
    assert all(len(entry) == 1 for entry in out.logprobs)
    check_logprobs(out, reference_logprobs(tiny_hf_float64, PROMPTS[3], out.output_ids), 0, tok)
    plain = llm.generate([PROMPTS[3]], GREEDY)[0]
    assert plain.logprobs is None and plain.cumulative_logprob is None


def test_logprobs_stream_one_dict_per_token_and_a_running_total(llm):
    events = []
    llm.engine.add_request(PROMPTS[0], replace(GREEDY, max_tokens=6, logprobs=2), on_output=events.append)
    while llm.engine.has_work():
        llm.engine.step()
    total = 0.0
    for event in events:
        assert len(event.logprobs) == len(event.new_token_ids)
        total += sum(entry[t].logprob for t, entry in zip(event.new_token_ids, event.logprobs, strict=True))
        assert event.cumulative_logprob == pytest.approx(total, abs=1e-9)


def test_a_stop_string_cuts_logprobs_with_the_tokens(llm):
    prompt = llm.tokenizer.encode("the kalo mine")
    full = llm.generate([prompt], replace(GREEDY, max_tokens=30, logprobs=1))[0]
    out = llm.generate([prompt], replace(GREEDY, max_tokens=30, logprobs=1, stop=[full.text[3:6]]))[0]
    assert out.finish_reason == "stop" and len(out.output_ids) < len(full.output_ids)
    assert out.logprobs == full.logprobs[: len(out.output_ids)]
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.output_ids, out.logprobs, strict=True)))


# ------------------------------------------------------------------------------ batch invariance
MIXED = [
    SamplingParams(max_tokens=14, temperature=0.9, top_p=0.95, seed=11, presence_penalty=0.6, frequency_penalty=0.4,
                   repetition_penalty=1.3, logit_bias={50: 2.0}, logprobs=3, ignore_eos=True),
    SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True),
    SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
    SamplingParams(max_tokens=9, temperature=0.0, frequency_penalty=1.2, ignore_eos=True),
    SamplingParams(max_tokens=11, temperature=0.7, seed=8, repetition_penalty=1.5, logprobs=0, ignore_eos=True),
    SamplingParams(max_tokens=8, temperature=0.0, logprobs=4, ignore_eos=True),
    SamplingParams(max_tokens=13, temperature=0.0, logit_bias={9: 5.0, 10: -5.0}, ignore_eos=True),
    SamplingParams(max_tokens=7, temperature=0.0, top_p=0.0, presence_penalty=-1.0, ignore_eos=True),
]


def mixed_batch(n: int) -> tuple[list[list[int]], list[SamplingParams]]:
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 300, (int(k),), generator=gen).tolist() for k in torch.randint(1, 12, (n,), generator=gen)]
    params = [MIXED[i % len(MIXED)] for i in range(n)]
    return prompts, [replace(p, seed=i) if p.seed is not None else p for i, p in enumerate(params)]


def assert_same(a: CompletionOutput, b: CompletionOutput) -> None:
    assert a.output_ids == b.output_ids
    assert (a.logprobs is None) == (b.logprobs is None)
    for x, y in zip(a.logprobs or [], b.logprobs or [], strict=True):
        assert x.keys() == y.keys()
        assert all(x[t].rank == y[t].rank and abs(x[t].logprob - y[t].logprob) < 1e-5 for t in x)


@pytest.mark.parametrize("mode", ["reserve", "paged-chunked-cached", "preempting", "request-level"])
def test_a_request_samples_the_same_alone_and_in_any_batch(checkpoint, mode):
    options = {"preempting": {"kv_policy": "paged", "block_size": 1, "kv_capacity_tokens": 60},
               "request-level": {"scheduling": "request"}}.get(mode) or KV_MODES[mode]  # fmt: skip
    llm = LLM(str(checkpoint), max_num_seqs=16, **options)
    prompts, params = mixed_batch(20)
    assert sum(p.penalized for p in params) > 8  # more than the sampler's first table rows: they grow
    alone = [llm.generate([p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    for _ in range(2):  # the second batch reuses the released requests' table rows
        together = llm.generate(prompts, params)
        for a, b in zip(alone, together, strict=True):
            assert_same(a, b)
    if mode == "preempting":
        assert llm.engine.stats().num_preemptions > 0
    assert llm.engine.core.kv.used_tokens == 0


def test_the_sampler_tables_grow_while_requests_run(checkpoint):
    """Requests arriving one per iteration: the ninth penalized one finds eight running with counts
    and prompt marks, which must survive the tables' growth."""
    llm = LLM(str(checkpoint), max_num_seqs=16)  # fresh: its sampler has no table rows yet
    prompts = [PROMPTS[i % len(PROMPTS)] + [i] for i in range(10)]
    params = [replace(GREEDY, frequency_penalty=-0.5, repetition_penalty=0.8 if i % 2 else 1.0) for i in range(10)]
    alone = [llm.generate([p], sp)[0].output_ids for p, sp in zip(prompts, params, strict=True)]
    engine, tokens = llm.engine, {}
    for i, (prompt, sp) in enumerate(zip(prompts, params, strict=True)):
        engine.add_request(prompt, sp, request_id=f"g{i}",
                           on_output=lambda out: tokens.setdefault(out.request_id, []).extend(out.new_token_ids))
        engine.step()
    while engine.has_work():
        engine.step()
    assert [tokens[f"g{i}"] for i in range(10)] == alone


def test_a_failed_batch_records_nothing_in_the_sampler(checkpoint):
    """A batch that fails before or after the sampler took its updates is re-run (in halves) with the
    same updates; counting them twice would change these penalized tokens (small negative frequency
    penalties: a token counted twice becomes the favourite)."""
    prompts = PROMPTS[:4]
    params = [replace(GREEDY, frequency_penalty=-0.5), replace(GREEDY, **CASES["repetition"]),
              replace(GREEDY, frequency_penalty=-0.3, presence_penalty=0.2), replace(GREEDY, **CASES["all"])]  # fmt: skip
    llm = LLM(str(checkpoint), max_num_seqs=16)
    expected = llm.generate(prompts, params)
    runner = llm.engine.core.executor.runner
    original, count = runner.execute, [0]

    def execute(meta):
        count[0] += 1
        whole = len(meta.scheduled_ids) == len(prompts)  # its halves then run alone, and succeed
        if count[0] == 1 or (whole and count[0] % 7 == 0):  # the sampler never sees the setup or the update
            raise RuntimeError("injected failure before sampling")
        out = original(meta)
        if whole and count[0] % 3 == 0:  # it took the updates, and the core records nothing
            raise RuntimeError("injected failure after sampling")
        return out

    runner.execute = execute
    got = llm.generate(prompts, params)
    for a, b in zip(expected, got, strict=True):
        assert a.output_ids == b.output_ids
    assert count[0] > 2 * GREEDY.max_tokens  # the failures happened and were re-run

def test_penalty_counts_follow_the_deltas_and_are_rebuilt_when_a_row_is_taken_again():
    """Counts come from the output tokens a row is given (at add, from each delta); a request that takes
    a row again (resumed after a preemption) gets them back from its tokens, whatever row it lands in."""
    params = SamplingParams(frequency_penalty=1.0)
    staging = StagingArena(torch.device("cpu"))
    processors = LogitsProcessors(4, 10, torch.device("cpu"), staging)
    none = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))

    def penalized(position: int, row: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.tensor([position]), torch.tensor([row])

    processors.add(2, params, [1], [3, 3])
    processors.count([2], [[4]])
    logits = torch.zeros(2, 10)
    processors.apply(logits, none, penalized(1, 2), repetition=False)
    assert logits[1].tolist() == [0, 0, 0, -2, -1, 0, 0, 0, 0, 0] and torch.all(logits[0] == 0)
    processors.remove(2)
    assert not processors.processed[2] and not processors.penalized[2]
    staging.begin()
    processors.add(0, params, [1], [3, 3, 4])
    again = torch.zeros(2, 10)
    processors.apply(again, none, penalized(1, 0), repetition=False)
    assert torch.equal(again, logits)
