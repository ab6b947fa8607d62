"""Speculative decoding through the engine: greedy tokens equal the engine's without speculation
whatever the proposals (all right, right up to a point, all wrong, and the n-gram proposer's own),
under both K/V policies, chunked prefill, prefix caching and preemption; cuts at max_tokens and stop
tokens inside a proposal; logprobs of the emitted tokens; the K/V of rejected proposals given back;
the spec_decode counts; and seeded sampling reproducible. The sampler's rejection rule is checked
statistically in tests/worker/test_rejection_sampler.py."""

from __future__ import annotations

import json

import numpy as np
import pytest
from engine_helpers import OracleProposer, random_prompts
from kv_modes import KV_MODES

from orca_backend import LLM, SamplingParams
from orca_backend.config import SpeculativeConfig
from orca_backend.core.ngram_proposer import NgramProposer

K = OracleProposer.K
NGRAM = json.dumps({"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
# Every decode proposes, however often its proposals were rejected (no pause): for the tests of what
# rejection does, which would otherwise see only a request's first few rounds rejected.
NO_PAUSE = {"max_pause_steps": 0}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


def speculating_llm(path, proposer=None, spec: dict | None = None, **options) -> LLM:
    llm = LLM(str(path), speculative_config=json.dumps({**json.loads(NGRAM), **(spec or {})}), **options)
    if proposer is not None:
        llm.engine.core.scheduler.proposer = proposer
    return llm


def references(path, prompts, params=GREEDY, **options) -> list[list[int]]:
    return [o.output_ids for o in LLM(str(path), **options).generate(prompts, params)]


@pytest.mark.parametrize("mode", KV_MODES)
@pytest.mark.parametrize("wrong", ["never", "cycle", "always"])
def test_greedy_tokens_equal_the_engine_without_speculation(tiny_checkpoint, mode, wrong):
    path, config = tiny_checkpoint
    prompts = random_prompts(6, config.vocab_size, seed=3)
    expected = references(path, prompts, max_num_seqs=8, **KV_MODES[mode])
    proposer = OracleProposer(prompts, expected, config.vocab_size, wrong)
    llm = speculating_llm(path, proposer, NO_PAUSE, max_num_seqs=8, **KV_MODES[mode])
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert 0 < stats.spec_num_draft_tokens <= proposer.proposed  # a token budget cuts proposals
    if wrong == "never":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
        assert stats.num_iterations < len(prompts) * GREEDY.max_tokens / 2  # several tokens a step
    elif wrong == "always":
        assert stats.spec_num_accepted_tokens == 0
    else:
        assert 0 < stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens
        assert all(stats.spec_accepted_per_pos)  # every place of a proposal was reached
    assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens
    assert llm.engine.core.kv.used_tokens == 0


@pytest.mark.parametrize("mode", ["reserve", "paged"])
def test_ngram_proposals_keep_tokens_exact(tiny_checkpoint, mode):
    """The n-gram proposer on prompts that repeat themselves (and on random ones)."""
    path, config = tiny_checkpoint
    rng = np.random.default_rng(7)
    prompts = [(rng.integers(0, config.vocab_size, 5).tolist() * 4)[:18] for _ in range(4)]
    prompts += random_prompts(3, config.vocab_size, seed=11)
    expected = references(path, prompts, max_num_seqs=8, **KV_MODES[mode])
    llm = speculating_llm(path, max_num_seqs=8, **KV_MODES[mode])
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.core.stats().spec_num_draft_tokens > 0


def test_preemption_with_proposals_in_a_small_pool(tiny_checkpoint):
    """A pool too small for every request: decodes preempt as usual, proposals never do (they go
    without when no block is free), and no token changes."""
    path, config = tiny_checkpoint
    prompts = random_prompts(8, config.vocab_size, seed=21)
    options = {"kv_policy": "paged", "block_size": 4, "kv_capacity_tokens": 160, "max_num_seqs": 8}
    expected = references(path, prompts, **options)
    proposer = OracleProposer(prompts, expected, config.vocab_size, "cycle")
    llm = speculating_llm(path, proposer, **options)
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_accepted_tokens > 0


def test_rejected_proposals_give_their_blocks_back(tiny_checkpoint):
    """Paged, blocks of 2: every proposal is wrong, so after each step the request holds blocks for
    its tokens only, and each step's runner holds the tables the scheduler gave that step."""
    path, config = tiny_checkpoint
    prompts = random_prompts(2, config.vocab_size, seed=4)
    expected = references(path, prompts)
    proposer = OracleProposer(prompts, expected, config.vocab_size, "always")
    llm = speculating_llm(path, proposer, NO_PAUSE, kv_policy="paged", block_size=2)
    engine, core = llm.engine, llm.engine.core
    scheduled: dict[str, list[int]] = {}
    schedule = core.scheduler.schedule

    def schedule_and_note_tables():
        batch = schedule()
        scheduled.clear()
        scheduled.update({r.request_id: list(r.block_tables[0]) for r in core.scheduler.running})
        return batch

    core.scheduler.schedule = schedule_and_note_tables
    tokens: dict[str, list[int]] = {}
    ids = [engine.add_request(p, GREEDY, on_output=lambda out: tokens.setdefault(out.request_id, []).extend(
        out.new_token_ids)).request_id for p in prompts]  # fmt: skip
    held = []
    while engine.has_work():
        engine.step()
        batch = core.executor.runner.input_batch
        for request_id, table in scheduled.items():
            row = batch.row_of.get(request_id)
            if row is not None:
                assert batch.block_table[row, 0, : batch.num_blocks[row]].tolist() == table
        held += [(len(r.block_tables[0]), -(-r.num_tokens // 2)) for r in core.scheduler.running]
    assert held and all(blocks == needed for blocks, needed in held)
    assert [tokens[i] for i in ids] == expected
    assert core.stats().spec_num_draft_tokens > 0 and core.kv.used_tokens == 0


@pytest.mark.parametrize("wrong", ["never", "cycle"])
def test_max_tokens_and_stop_tokens_inside_a_proposal(tiny_checkpoint, wrong):
    """Proposals stop where max_tokens would end the request, and a stop token among the accepted
    ones ends it there: the same tokens and finish reasons as without speculation."""
    path, config = tiny_checkpoint
    prompts = random_prompts(4, config.vocab_size, seed=8)
    plain = references(path, prompts)
    # Stop at each one's 10th token (its first occurrence), and cut at odd lengths.
    cases = [SamplingParams(max_tokens=m, temperature=0.0, stop_token_ids=[plain[i][9]])
             for i, m in enumerate([24, 7, 13, 24])]  # fmt: skip
    expected_outputs = LLM(str(path)).generate(prompts, cases)
    expected = {tuple(p): o.output_ids for p, o in zip(prompts, expected_outputs, strict=True)}
    proposer = OracleProposer(prompts, plain, config.vocab_size, wrong)
    outputs = speculating_llm(path, proposer).generate(prompts, cases)
    for prompt, output, reference in zip(prompts, outputs, expected_outputs, strict=True):
        assert output.output_ids == expected[tuple(prompt)]
        assert output.finish_reason == reference.finish_reason


def test_logprobs_of_emitted_tokens(tiny_checkpoint):
    """Each emitted token's logprobs, accepted proposal or not, are the ones the engine gives without
    speculation (values within float rounding: the rows are computed in a different batch shape)."""
    path, config = tiny_checkpoint
    prompts = random_prompts(3, config.vocab_size, seed=9)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = LLM(str(path)).generate(prompts, params)
    proposer = OracleProposer(prompts, [o.output_ids for o in plain], config.vocab_size, "cycle")
    outputs = speculating_llm(path, proposer).generate(prompts, params)
    for got, want in zip(outputs, plain, strict=True):
        assert got.output_ids == want.output_ids
        assert len(got.logprobs) == len(want.logprobs) == 16
        for a, b in zip(got.logprobs, want.logprobs, strict=True):
            assert list(a) == list(b)  # the same ids: the token and its top 3, in order
            assert [x.rank for x in a.values()] == [x.rank for x in b.values()]
            np.testing.assert_allclose([x.logprob for x in a.values()], [x.logprob for x in b.values()], atol=1e-4)


def test_seeded_sampling_is_reproducible(tiny_checkpoint):
    """A seeded request samples the same tokens in every run with speculation (its acceptance and
    resampling draws come from its seed and its length), alone or in a batch."""
    path, config = tiny_checkpoint
    prompts = random_prompts(3, config.vocab_size, seed=12)
    params = [SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=100 + i, ignore_eos=True) for i in range(3)]
    params[2] = SamplingParams(max_tokens=20, temperature=1.0, seed=102, n=3, ignore_eos=True)  # each sample proposes
    plain = references(path, prompts, GREEDY)  # proposals from the greedy run: some right, some not
    proposer = OracleProposer(prompts, plain, config.vocab_size, "never", strict=False)
    llm = speculating_llm(path, proposer)
    def run(prompts, params):
        return [[s.output_ids for s in o.samples or [o]] for o in llm.generate(prompts, params)]

    first, again = run(prompts, params), run(prompts, params)
    alone = [run([p], [q])[0] for p, q in zip(prompts, params, strict=True)]
    assert first == again == alone
    assert len({tuple(s) for s in first[2]}) == 3
    assert llm.engine.core.stats().spec_num_accepted_tokens > 0


def test_ngram_proposer_takes_the_longest_latest_match():
    def propose(tokens, limit=10, proposer=None):
        return (proposer or NgramProposer(3, 1, 3)).propose_tokens("r", tokens, limit)

    tokens = [1, 2, 3, 9, 1, 2, 3, 8, 7, 5, 2, 3]  # "2 3" occurs thrice; the latest earlier one is followed by 8 7 5
    assert propose(tokens) == [8, 7, 5]
    assert propose(tokens, 2) == [8, 7]
    longest = [5, 6, 7, 1, 4, 6, 7, 2, 5, 6, 7]  # "5 6 7" beats the later "6 7"
    assert propose(longest) == [1, 4, 6]
    assert propose([1, 2, 3, 4]) == []
    assert propose([4, 4]) == [4]  # a match at the end proposes what follows it
    assert propose([1, 2, 3, 1], proposer=NgramProposer(3, 2, 2)) == []  # below prompt_lookup_min


def test_ngram_proposer_index_grows_with_the_request_as_a_fresh_lookup_would():
    """The incremental index answers as a lookup over the whole context would, step after step."""
    rng = np.random.default_rng(3)
    tokens = rng.integers(0, 6, 300).tolist()  # a small alphabet: many matches, of every length
    grown = NgramProposer(4, 2, 4)
    for size in range(1, len(tokens) + 1, 3):
        assert grown.propose_tokens("r", tokens[:size], 4) == NgramProposer(4, 2, 4).propose_tokens("r", tokens[:size], 4)
    brute = tokens[:50]
    for n in range(4, 1, -1):  # the definition, written out: latest earlier occurrence of the longest suffix
        hits = [e for e in range(n, len(brute)) if brute[e - n : e] == brute[-n:]]
        if hits:
            assert grown.propose_tokens("s", brute, 4) == brute[hits[-1] : hits[-1] + 4]
            break


@pytest.mark.parametrize(("text", "message"), [
    ('{"method": "ngram"}', "num_speculative_tokens must be an integer >= 1"),
    ('{"method": "medusa", "num_speculative_tokens": 3}', "method 'medusa' is not served"),
    ('{"method": "eagle", "num_speculative_tokens": 3}', "method 'eagle' needs model, the EAGLE head's"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 1}', "unknown field\\(s\\) draft_tensor_parallel_size"),
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2}',
     "prompt_lookup_min \\(4\\) must be at most"),
    ('[1]', "must be a JSON object"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0}', "disable_by_batch_size must be"),
    ('{"method": "ngram", "num_speculative_tokens": 2, "max_pause_steps": -1}', "max_pause_steps must be an integer >= 0"),
])  # fmt: skip
def test_a_bad_speculative_config_is_refused_naming_the_field(text, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_json(text)


def test_speculative_config_defaults_follow_vllm():
    config = SpeculativeConfig.from_json('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}')
    assert (config.prompt_lookup_min, config.prompt_lookup_max) == (4, 4)
    config = SpeculativeConfig.from_json('{"model": "[ngram]", "num_speculative_tokens": 2}')
    assert (config.method, config.prompt_lookup_min, config.prompt_lookup_max) == ("ngram", 5, 5)


@pytest.mark.parametrize("family", ["Llama", "Mixtral", "Qwen2"])
@pytest.mark.parametrize("wrong", ["never", "cycle"])
def test_llama_family_and_moe_equal_transformers(tmp_path, family, wrong):
    """The Llama family (and a MoE) with proposals: greedy tokens equal transformers' own."""
    from hf_tiny import hf_greedy, write_tiny

    model = write_tiny(family, tmp_path, seed=5)
    prompts = random_prompts(3, model.config.vocab_size, seed=6)
    expected = [hf_greedy(model, p, 16) for p in prompts]
    proposer = OracleProposer(prompts, expected, model.config.vocab_size, wrong)
    llm = speculating_llm(tmp_path, proposer, kv_policy="paged", block_size=4)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.core.stats().spec_num_accepted_tokens > 0


def test_async_scheduling_with_speculation_runs_nothing_ahead(tiny_checkpoint):
    """async_scheduling with speculative decoding: a request's next step waits for its tokens (it
    proposes from them), and the tokens are the engine's without either."""
    path, config = tiny_checkpoint
    prompts = random_prompts(5, config.vocab_size, seed=13)
    expected = references(path, prompts)
    proposer = OracleProposer(prompts, expected, config.vocab_size, "cycle")
    llm = speculating_llm(path, proposer, async_scheduling=True)
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert llm.engine.core.stats().spec_num_accepted_tokens > 0


@pytest.mark.parametrize("wrong", ["never", "cycle"])
def test_penalties_count_the_proposals_before_each_row(tiny_checkpoint, wrong):
    """Presence, frequency and repetition penalties (beside a logit_bias): each verifying row counts
    the proposals before it as output, the request's own row all of them, so greedy tokens are the
    engine's without speculation (beside a request with a min_tokens ban)."""
    path, config = tiny_checkpoint
    prompts = random_prompts(4, config.vocab_size, seed=31)
    params = [
        SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, frequency_penalty=0.9, presence_penalty=0.5, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, repetition_penalty=1.6, logit_bias={7: 2.0}, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.0, min_tokens=12, frequency_penalty=-0.7),
    ]
    plain = LLM(str(path)).generate(prompts, params)
    # Control: the penalties change tokens, so a proposal counted wrong is seen.
    free = LLM(str(path)).generate(prompts, SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True))
    assert plain[1].output_ids != free[1].output_ids and plain[2].output_ids != free[2].output_ids
    proposer = OracleProposer(prompts, [o.output_ids for o in plain], config.vocab_size, wrong)
    llm = speculating_llm(path, proposer)
    outputs = llm.generate(prompts, params)
    assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain]
    assert llm.engine.core.stats().spec_num_accepted_tokens > 0


class StopProposer:
    """Proposes each request's stop token (its stop_token_ids' first) wherever it may propose."""

    def propose(self, request, limit: int) -> list[int]:  # noqa: ANN001 - a core Request
        return [request.params.stop_token_ids[0]] * min(K, limit)

    def forget(self, request_id: str) -> None:
        pass


@pytest.mark.parametrize("proposals", ["reference", "stop"])
def test_min_tokens_holds_with_proposals_on_both_sides_of_the_ban(tiny_checkpoint, proposals):
    """Requests short of min_tokens propose too: a verifying row bans the stop tokens while the
    output before it (the proposals before it counted) is short of min_tokens, and the request's own
    row counts every proposal. Two kinds of request: one whose stop token is its first unbanned
    token at 5 or 10 (with every proposal right, a step's own row lands exactly there: banned by a
    count without the proposals), and one whose stop token it would make at 2 but for a ban to 6 (a
    proposed stop token there is accepted where the verifying row does not ban it). Tokens and
    finish reasons are the engine's without speculation."""
    path, config = tiny_checkpoint
    candidates = random_prompts(24, config.vocab_size, seed=33)
    free = LLM(str(path)).generate(candidates, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    prompts, params = [], []
    for (stop_at, min_tokens, wanted) in ((5, 5, 2), (10, 10, 1), (2, 6, 2)):
        chosen = [(p, o.output_ids[stop_at]) for p, o in zip(candidates, free, strict=True)
                  if o.output_ids[stop_at] not in o.output_ids[:stop_at] and p not in prompts][:wanted]  # fmt: skip
        assert len(chosen) == wanted
        for prompt, stop in chosen:
            prompts.append(prompt)
            params.append(SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, min_tokens=min_tokens,
                                         stop_token_ids=[stop]))  # fmt: skip
    plain = LLM(str(path)).generate(prompts, params)
    assert [o.finish_reason for o in plain[:3]] == ["stop"] * 3 and [len(o.output_ids) for o in plain[:3]] == [6, 6, 11]
    proposer = (OracleProposer(prompts, [o.output_ids for o in plain], config.vocab_size, "never")
                if proposals == "reference" else StopProposer())  # fmt: skip
    llm = speculating_llm(path, proposer)
    outputs = llm.generate(prompts, params)
    assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain]
    assert llm.engine.core.stats().spec_num_draft_tokens > 0


@pytest.mark.parametrize("wrong", ["never", "cycle", "always"])
def test_constrained_requests_speculate_within_their_grammar(tiny_checkpoint, wrong):
    """A grammar's request proposes only what its grammar allows (a proposal it refuses is cut
    there), each verifying row carries the grammar's mask at its place, and its matcher advances by
    every emitted token: the text, tokens and finish reasons are the engine's without speculation."""
    pytest.importorskip("xgrammar")
    path, config = tiny_checkpoint
    prompts = ["the cat sat on", "hello there", "kalo mine to", "one two"]
    constraints = [{"regex": r"(ab|cd){3,8}x"}, {"choice": ["yes", "no", "maybe so"]},
                   {"json": {"type": "object", "properties": {"k": {"type": "string", "pattern": "^[a-e]{1,12}$"}},
                             "required": ["k"]}, "disable_any_whitespace": True},
                   {"regex": r"\d{4}-\d{2}-\d{2}"}]  # fmt: skip
    params = [SamplingParams(max_tokens=40, temperature=0.0, structured_outputs=c) for c in constraints]
    plain = LLM(str(path)).generate(prompts, params)
    llm = speculating_llm(path)
    proposer = llm.engine.core.scheduler.proposer = OracleProposer(
        [llm.engine.prompt_ids(p) for p in prompts], [o.output_ids for o in plain], config.vocab_size, wrong)
    outputs = llm.generate(prompts, params)
    assert [o.text for o in outputs] == [o.text for o in plain]
    assert [o.output_ids for o in outputs] == [o.output_ids for o in plain]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in plain] == ["stop"] * 4
    stats = llm.engine.core.stats()
    if wrong == "never":
        assert 0 < stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    else:  # a wrong token (its successor in the vocabulary) is mostly one the grammar refuses: cut before verifying
        assert stats.spec_num_draft_tokens < proposer.proposed


def test_stop_strings_cut_inside_a_step_of_several_tokens(tiny_checkpoint):
    """A stop string completed by a token in the middle of a step's tokens: the text, tokens and
    finish reason are the engine's without speculation (the rest of the step is dropped)."""
    path, config = tiny_checkpoint
    prompts = ["the cat sat on", "hello there", "kalo mine to"]
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    plain = LLM(str(path)).generate(prompts, params)
    stops = [o.text[len(o.text) // 3 : len(o.text) // 3 + 3] for o in plain]
    with_stops = [SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop=[stop]) for stop in stops]
    expected = LLM(str(path)).generate(prompts, with_stops)
    llm = speculating_llm(path)
    llm.engine.core.scheduler.proposer = OracleProposer(
        [llm.engine.prompt_ids(p) for p in prompts], [o.output_ids for o in plain], config.vocab_size, "never")
    outputs = llm.generate(prompts, with_stops)
    assert [o.text for o in outputs] == [o.text for o in expected]
    assert [o.finish_reason for o in outputs] == [o.finish_reason for o in expected] == ["stop"] * 3
    assert [o.output_ids for o in outputs] == [o.output_ids for o in expected]


def draft_config(path, k: int = K, **options) -> str:
    return json.dumps({"method": "draft_model", "model": str(path), "num_speculative_tokens": k, **options})


@pytest.mark.parametrize("mode", KV_MODES)
def test_draft_model_the_target_itself_has_every_proposal_accepted(tiny_checkpoint, mode):
    """The target as its own draft (the upper bound): greedy proposals are the target's own tokens,
    so all are accepted, and the tokens are the engine's without speculation."""
    path, config = tiny_checkpoint
    prompts = random_prompts(5, config.vocab_size, seed=14)
    expected = references(path, prompts, max_num_seqs=8, **KV_MODES[mode])
    llm = LLM(str(path), max_num_seqs=8, speculative_config=draft_config(path), **KV_MODES[mode])
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert llm.engine.core.kv.used_tokens == 0


def test_draft_model_with_async_scheduling_runs_nothing_ahead(tiny_checkpoint):
    """A request whose next step ran ahead would propose from tokens the host does not have yet: with
    the target as its own draft, every proposal is still accepted."""
    path, config = tiny_checkpoint
    prompts = random_prompts(5, config.vocab_size, seed=16)
    expected = references(path, prompts)
    llm = LLM(str(path), speculative_config=draft_config(path), async_scheduling=True)
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


@pytest.mark.parametrize("mode", ["reserve", "paged"])
def test_draft_model_with_random_weights_still_exact(tiny_checkpoint, make_checkpoint, mode):
    """A draft of the same geometry with other random weights: almost nothing is accepted, and the
    tokens are still the engine's without speculation; so are seeded samples reproducible."""
    path, config = tiny_checkpoint
    draft, _ = make_checkpoint(config, seed=9)
    prompts = random_prompts(5, config.vocab_size, seed=15)
    expected = references(path, prompts, **KV_MODES[mode])
    llm = LLM(str(path), speculative_config=draft_config(draft, 3, **NO_PAUSE), **KV_MODES[mode])
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 4


def test_draft_model_after_preemption_and_with_a_smaller_draft(tiny_checkpoint, make_checkpoint):
    """A pool small enough to preempt (a resumed request's draft recomputes its context) and a
    draft of another geometry (one layer, other heads): tokens unchanged."""
    from orca_backend.families.gpt2 import GPT2Config

    path, config = tiny_checkpoint
    small = GPT2Config(vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=32, n_layer=1, n_head=2,
                       initializer_range=0.3)  # fmt: skip
    draft, _ = make_checkpoint(small, seed=1)
    prompts = random_prompts(8, config.vocab_size, seed=21)
    options = {"kv_policy": "paged", "block_size": 4, "kv_capacity_tokens": 160, "max_num_seqs": 8}
    expected = references(path, prompts, **options)
    llm = LLM(str(path), speculative_config=draft_config(draft, **NO_PAUSE), **options)
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0 and stats.spec_num_draft_tokens > 0


def test_a_draft_model_that_cannot_serve_the_target_is_refused(tiny_checkpoint, make_checkpoint):
    from orca_backend.families.gpt2 import GPT2Config

    path, config = tiny_checkpoint
    other_vocab, _ = make_checkpoint(GPT2Config(vocab_size=200, n_positions=128, n_embd=32, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match="draft model's vocab_size .* is not the target's \\(384\\)"):
        LLM(str(path), speculative_config=draft_config(other_vocab))
    with pytest.raises(ValueError, match="'draft_model' runs in one process"):
        LLM(str(path), speculative_config=draft_config(path), tensor_parallel_size=2)


@pytest.mark.parametrize("family", ["Llama", "Mixtral"])
def test_llama_family_and_moe_as_their_own_draft_equal_transformers(tmp_path, family):
    from hf_tiny import hf_greedy, write_tiny

    model = write_tiny(family, tmp_path, seed=5)
    prompts = random_prompts(3, model.config.vocab_size, seed=6)
    expected = [hf_greedy(model, p, 16) for p in prompts]
    llm = LLM(str(tmp_path), kv_policy="paged", block_size=4, speculative_config=draft_config(tmp_path, 3))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens


def test_disable_by_batch_size_stops_proposals_while_more_requests_run(tiny_checkpoint):
    """vLLM's disable_by_batch_size: no request proposes while more than that many run; as the batch
    drains below it, proposals resume. Tokens unchanged either way."""
    path, config = tiny_checkpoint
    prompts = random_prompts(6, config.vocab_size, seed=23)
    lengths = [4, 4, 4, 4, 20, 20]  # four end early: the last two then run alone
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths]
    expected = [o.output_ids for o in LLM(str(path)).generate(prompts, params)]
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": K, "disable_by_batch_size": 2})
    llm = LLM(str(path), speculative_config=spec)
    proposer = OracleProposer(prompts, expected, config.vocab_size, "never")
    llm.engine.core.scheduler.proposer = proposer
    steps = []
    schedule = llm.engine.core.scheduler.schedule

    def schedule_and_note():
        batch = schedule()
        if batch is not None:
            steps.append((len(llm.engine.core.scheduler.running), len(batch.spec)))
        return batch

    llm.engine.core.scheduler.schedule = schedule_and_note
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert all(spec == 0 for running, spec in steps if running > 2)
    assert any(spec for running, spec in steps if running <= 2)


def proposal_rounds(llm: LLM) -> dict[str, list[tuple[int, int]]]:
    """Notes, per request, each step's (its output tokens before the step, its proposals) as the
    scheduler schedules it."""
    rounds: dict[str, list[tuple[int, int]]] = {}
    scheduler = llm.engine.core.scheduler
    schedule = scheduler.schedule

    def schedule_and_note():
        batch = schedule()
        if batch is not None:
            for i, request in enumerate(batch.requests):
                if request.output_ids:
                    rounds.setdefault(request.request_id, []).append((len(request.output_ids), len(batch.spec.get(i, ()))))
        return batch

    scheduler.schedule = schedule_and_note
    return rounds


@pytest.mark.parametrize("wrong", ["always", "never", "late"])
def test_proposals_pause_while_they_keep_being_rejected(tiny_checkpoint, wrong):
    """Two fruitless rounds in a row pause a request's proposals for 64 of its steps, a fruitless
    round after that 256 more; proposals that are right never pause; a round after a pause that is
    accepted resumes proposals at once. Tokens unchanged."""
    from orca_backend.core.scheduler import SPEC_PAUSE_AFTER, SPEC_PAUSE_FIRST, SPEC_PAUSE_GROWTH

    assert (SPEC_PAUSE_AFTER, SPEC_PAUSE_FIRST, SPEC_PAUSE_GROWTH) == (2, 64, 4)  # the rounds below
    path, config = tiny_checkpoint
    prompts = random_prompts(3, config.vocab_size, seed=25)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    expected = references(path, prompts, params)
    proposer = OracleProposer(prompts, expected, config.vocab_size, "always" if wrong == "late" else wrong)
    llm = speculating_llm(path, proposer)
    rounds = proposal_rounds(llm)
    if wrong == "late":  # right from the round after the first pause on
        propose = proposer.propose
        proposer.propose = lambda request, limit: (
            setattr(proposer, "wrong", "never") if len(request.output_ids) >= 60 else None, propose(request, limit))[1]
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert len(rounds) == len(prompts)
    for steps in rounds.values():
        proposed = [(before, count) for before, count in steps if count]
        if wrong == "never":  # every step proposes K (fewer where max_tokens comes)
            assert all(count == min(K, 99 - before) for before, count in steps)
        elif wrong == "always":  # rounds after its first and second tokens, then one 64 steps on
            assert proposed == [(1, K), (2, K), (67, K)]
            assert [before for before, _ in steps] == list(range(1, 100))  # a token a step
        else:  # the round after the pause accepted: it proposes every step from there
            assert proposed[:3] == [(1, K), (2, K), (67, K)]
            assert all(count == min(K, 99 - before) for before, count in proposed[2:]) and len(proposed) > 4
            assert proposed[3][0] == 67 + 1 + K  # the round's proposals and the token after them


def test_max_pause_steps_zero_proposes_every_step(tiny_checkpoint):
    path, config = tiny_checkpoint
    prompts = random_prompts(2, config.vocab_size, seed=26)
    expected = references(path, prompts)
    llm = speculating_llm(path, OracleProposer(prompts, expected, config.vocab_size, "always"), NO_PAUSE)
    rounds = proposal_rounds(llm)
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    assert all(count == min(K, GREEDY.max_tokens - 1 - before) for steps in rounds.values() for before, count in steps), rounds


# ---- EAGLE heads --------------------------------------------------------------------------------
def eagle_config(head, k: int = K, **options) -> str:
    return json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": k, **options})


@pytest.fixture(scope="module")
def random_head(tmp_path_factory):
    """A two-layer EAGLE head of random weights over the tiny GPT-2 (hidden size 64)."""
    import torch
    from eagle_heads import head_config, random_layers, write_eagle_head

    layers = random_layers(head_config(64, 384, num_layers=2), seed=3)
    fc = 0.3 * torch.randn(64, 128, generator=torch.Generator().manual_seed(4))
    return write_eagle_head(tmp_path_factory.mktemp("eagle"), layers, fc)


@pytest.mark.parametrize("mode", KV_MODES)
def test_eagle_with_a_random_head_still_exact(tiny_checkpoint, random_head, mode):
    """A head of random weights proposes almost nothing the target accepts: the tokens are the
    engine's without speculation, and every block is given back."""
    path, config = tiny_checkpoint
    prompts = random_prompts(6, config.vocab_size, seed=31)
    expected = references(path, prompts, max_num_seqs=8, **KV_MODES[mode])
    llm = LLM(str(path), max_num_seqs=8, speculative_config=eagle_config(random_head, **NO_PAUSE), **KV_MODES[mode])
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0 and stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 4
    assert llm.engine.core.kv.used_tokens == 0


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_eagle_with_a_head_mirroring_the_target_has_most_proposals_accepted(tmp_path, family):
    """The head reads the token after each position at that position (EAGLE's shift by one), the
    target's hidden states and its own: a head that mirrors the target then has most of its
    proposals accepted (a shift by one position or a token makes them chance: 1/320), and the
    tokens are transformers' own."""
    from eagle_heads import mirror_head
    from hf_tiny import hf_greedy, write_tiny

    target = write_tiny(family, tmp_path / "target", seed=5, num_hidden_layers=1)
    head = mirror_head(target, tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    prompts = random_prompts(4, target.config.vocab_size, seed=6)
    expected = [hf_greedy(target, p, 24) for p in prompts]
    llm = LLM(str(tmp_path / "target"), kv_policy="paged", block_size=4, speculative_config=eagle_config(head, 3))
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == expected
    stats = llm.engine.core.stats()
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens > 0
    assert all(stats.spec_accepted_per_pos)  # the head's own hidden states carry later proposals too


@pytest.mark.parametrize("family", ["Llama", "Mixtral"])
def test_eagle_on_the_llama_family_and_moe_equals_transformers(tmp_path, family):
    import torch
    from eagle_heads import head_config, random_layers, write_eagle_head
    from hf_tiny import hf_greedy, write_tiny

    model = write_tiny(family, tmp_path / "target", seed=5)
    layers = random_layers(head_config(64, model.config.vocab_size), seed=8)
    head = write_eagle_head(tmp_path / "head", layers, 0.3 * torch.randn(64, 128), torch.randn(64))
    prompts = random_prompts(3, model.config.vocab_size, seed=6)
    expected = [hf_greedy(model, p, 16) for p in prompts]
    llm = LLM(str(tmp_path / "target"), kv_policy="paged", block_size=4, speculative_config=eagle_config(head, 3))
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert llm.engine.core.stats().spec_num_draft_tokens > 0


def test_eagle_through_preemption_prefix_hits_forks_and_async_scheduling(tmp_path):
    """The head's K/V where the target's comes from elsewhere: a resumed request's prefill writes it
    again, a prefix-cache hit finds it in the shared blocks, a forked sample's copied block carries
    it (n = 2), and async scheduling runs nothing ahead; the mirroring head keeps most proposals
    accepted through all of it, and the tokens are the engine's without speculation."""
    from eagle_heads import mirror_head
    from hf_tiny import write_tiny

    target = write_tiny("Llama", tmp_path / "target", seed=5, num_hidden_layers=1)
    head = mirror_head(target, tmp_path / "head")
    target.save_pretrained(tmp_path / "target")
    shared = random_prompts(1, 320, seed=40)[0] * 3  # a prefix of whole blocks, then each its own tail
    prompts = [shared + tail for tail in random_prompts(8, 320, seed=41)]
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, n=2)
    options = {"kv_policy": "paged", "block_size": 4, "kv_capacity_tokens": 240, "max_num_seqs": 8,
               "enable_prefix_caching": True, "async_scheduling": True}  # fmt: skip
    expected = LLM(str(tmp_path / "target"), **options).generate(prompts, params)
    llm = LLM(str(tmp_path / "target"), speculative_config=eagle_config(head, 3), **options)
    outputs = llm.generate(prompts, params)
    assert [[s.output_ids for s in o.samples] for o in outputs] == [[s.output_ids for s in o.samples] for o in expected]
    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0
    assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens > 0
    assert llm.engine.core.kv.used_tokens == 0


def test_eagle_configs_that_cannot_run_are_refused(tiny_checkpoint, random_head):
    path, _ = tiny_checkpoint
    with pytest.raises(ValueError, match="method 'eagle' runs in one process"):
        LLM(str(path), speculative_config=eagle_config(random_head), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="architecture 'EagleLlamaForCausalLM' is not a head of method 'eagle3'"):
        LLM(str(path), speculative_config=json.dumps({"method": "eagle3", "model": str(random_head),
                                                      "num_speculative_tokens": 2}))  # fmt: skip


def test_eagle_beside_embedding_requests_in_the_same_steps(tmp_path):
    """With the head on, a step's forward returns every token's final hidden state: the embedding
    requests of the step pool theirs from among them, as a run without speculation does, and the
    generated tokens stay the same."""
    import torch
    from eagle_heads import head_config, random_layers, write_eagle_head
    from engine_helpers import drain
    from hf_tiny import write_tiny

    from orca_backend.config import EngineConfig
    from orca_backend.engine.llm_engine import LLMEngine
    from orca_backend.sampling_params import PoolingParams

    write_tiny("Qwen3", tmp_path / "target", seed=1)
    head = write_eagle_head(tmp_path / "head", random_layers(head_config(64, 320), seed=2), 0.3 * torch.randn(64, 128))
    prompts = random_prompts(4, 320, seed=44)
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

    def run(**options):
        engine = LLMEngine(EngineConfig(model=str(tmp_path / "target"), max_num_seqs=8, max_num_batched_tokens=12,
                                        **options))  # fmt: skip
        try:
            generated = engine.add_requests(prompts[:2], params)
            embedded = engine.add_requests(prompts, SamplingParams(), pooling=PoolingParams())
            drain(engine)
            return [[t for e in s for t in e.new_token_ids] for s in generated], [list(s)[-1].embedding for s in embedded]
        finally:
            engine.shutdown()

    tokens, vectors = run()
    spec_tokens, spec_vectors = run(speculative_config=eagle_config(head, 3))
    assert spec_tokens == tokens
    torch.testing.assert_close(torch.tensor(spec_vectors), torch.tensor(vectors), rtol=0, atol=1e-6)


# ---- EAGLE-3 heads, and every head's proposals against its reference ----------------------------
def recorded_first_proposals(llm: LLM) -> list[tuple[str, int, int]]:
    """Wraps the runner's head so that each step's first proposal of each request is recorded:
    (request id, the request's token count then, the proposal)."""
    proposer = llm.engine.core.executor.runner.drafter
    propose, seen = proposer.propose, []

    def recording(step, batch, rows):
        propose(step, batch, rows)
        for position, drafts in zip(step.spec_rows, step.spec_tokens, strict=True):
            seen.append((step.scheduled_ids[position], int(batch.num_tokens[rows[position]]), drafts[0]))

    proposer.propose = recording
    return seen


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_each_first_proposal_is_the_reference_heads_on_transformers_hidden_states(tmp_path, method):
    """A request's first proposal of a step is what the head, fed the target's hidden states at every
    earlier position (transformers' own: the final one for EAGLE-1, those entering three layers for
    EAGLE-3) and the token after each, names at the position before its last token: the engine's
    shift by one, its K/V and its hidden states are the reference's (a shift or a wrong layer makes
    them chance). The tokens are transformers' own."""
    import torch
    from eagle_heads import (
        head_config,
        random_eagle3,
        random_layers,
        reference_eagle3,
        reference_head,
        write_eagle3_head,
        write_eagle_head,
    )
    from hf_tiny import hf_greedy, write_tiny

    model = write_tiny("Llama", tmp_path / "target", seed=5, num_hidden_layers=4)
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    if method == "eagle":
        layers = random_layers(head_config(64, 320), seed=6)
        fc = 0.3 * torch.randn(64, 128, generator=torch.Generator().manual_seed(7))
        head = write_eagle_head(tmp_path / "head", layers, fc)
    else:
        tensors = random_eagle3(64, 320, draft_vocab=120, seed=6, fc_scale=0.01)  # the earlier positions matter
        head = write_eagle3_head(tmp_path / "head", tensors, 320, [1, 2, 3])
    prompts = random_prompts(4, 320, seed=8)
    llm = LLM(str(tmp_path / "target"), kv_policy="paged", block_size=4,
              speculative_config=json.dumps({"method": method, "model": str(head), "num_speculative_tokens": 3,
                                             **NO_PAUSE}))  # fmt: skip
    seen = recorded_first_proposals(llm)
    outputs = llm.generate(prompts, GREEDY)
    assert [o.output_ids for o in outputs] == [hf_greedy(model, p, GREEDY.max_tokens) for p in prompts]
    expected = {}
    for prompt, output in zip(prompts, outputs, strict=True):
        tokens = prompt + output.output_ids
        with torch.no_grad():
            states = model(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        if method == "eagle":
            _, names = reference_head(layers, fc, None, embed, lm_head, tokens[1:], states[-1][0, :-1])
        else:
            joined = torch.cat([states[i][0, :-1] for i in (1, 2, 3)], dim=-1)
            _, names = reference_eagle3(tensors, embed, tokens[1:], joined)
        expected[output.request_id] = names
    assert len(seen) > 20
    agree = [proposal == expected[request_id][count - 2] for request_id, count, proposal in seen]
    assert sum(agree) >= 0.9 * len(agree), agree  # near-ties of float sums aside


@pytest.mark.parametrize("family", ["Llama", "Qwen2"])
def test_eagle3_with_a_random_head_still_exact_through_preemption_and_prefix_hits(tmp_path, family):
    from eagle_heads import random_eagle3, write_eagle3_head
    from hf_tiny import hf_greedy, write_tiny

    model = write_tiny(family, tmp_path / "target", seed=5, num_hidden_layers=4)
    head = write_eagle3_head(tmp_path / "head", random_eagle3(64, 320, draft_vocab=160, seed=9), 320, [3, 1, 2])
    shared = random_prompts(1, 320, seed=40)[0] * 3
    prompts = [shared + tail for tail in random_prompts(6, 320, seed=42)]
    options = {"kv_policy": "paged", "block_size": 4, "kv_capacity_tokens": 200, "max_num_seqs": 6,
               "enable_prefix_caching": True}  # fmt: skip
    llm = LLM(str(tmp_path / "target"), speculative_config=eagle_config(head, 3, **NO_PAUSE).replace('"eagle"', '"eagle3"'),
              **options)  # fmt: skip
    assert [o.output_ids for o in llm.generate(prompts, GREEDY)] == [hf_greedy(model, p, GREEDY.max_tokens)
                                                                      for p in prompts]  # fmt: skip
    stats = llm.engine.core.stats()
    assert stats.num_preemptions > 0 and stats.prefix_cache_hit_tokens > 0 and stats.spec_num_draft_tokens > 0
    assert llm.engine.core.kv.used_tokens == 0
