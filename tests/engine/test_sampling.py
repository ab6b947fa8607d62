"""Sampling, stopping and incremental detokenization."""

from __future__ import annotations

import pytest
import torch

from orca_backend import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint[0]), max_num_seqs=16)


def test_seeded_sampling_is_reproducible_and_batch_invariant(llm):
    params = SamplingParams(max_tokens=16, temperature=1.0, top_k=50, top_p=0.9, seed=1234)
    alone = llm.generate([[5, 6, 7]], params)[0].output_ids
    crowd = [[5, 6, 7]] + [[i, i + 1] for i in range(1, 9)]
    mixed_params = [params] + [SamplingParams(max_tokens=16, temperature=0.8, seed=i) for i in range(8)]
    together = llm.generate(crowd, mixed_params)
    assert together[0].output_ids == alone
    other_seed = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=1.0, seed=99))[0].output_ids
    assert other_seed != alone
    greedy = llm.generate([[5, 6, 7]], SamplingParams(max_tokens=16, temperature=0.0))[0].output_ids
    assert greedy != alone  # temperature 1 on diverse random weights does not reduce to argmax


def test_top_k_one_and_tiny_top_p_are_greedy(llm):
    greedy = llm.generate([[9, 8]], SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))[0].output_ids
    k1 = llm.generate([[9, 8]], SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=3, ignore_eos=True))[0]
    p0 = llm.generate([[9, 8]], SamplingParams(max_tokens=10, temperature=1.5, top_p=1e-6, seed=3, ignore_eos=True))[0]
    assert k1.output_ids == greedy and p0.output_ids == greedy


@pytest.mark.parametrize("temperature", [1e-300, 1e-45, 9e-6])
def test_a_temperature_below_the_epsilon_is_greedy(llm, temperature):
    """1e-300 is 0 in float32: dividing the logits by it drew from NaNs (tokens of rank ~300 of 384).
    Below vLLM's epsilon (1e-5) a temperature samples greedily, in a batch with others too."""
    prompts = [[9, 8], [3, 4, 5]]
    greedy = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
    params = [SamplingParams(max_tokens=10, temperature=temperature, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=10, temperature=1.0, seed=4, ignore_eos=True)]  # fmt: skip
    tiny = llm.generate(prompts, params)
    assert SamplingParams(temperature=temperature).greedy and not SamplingParams(temperature=1e-5).greedy
    assert tiny[0].output_ids == greedy[0].output_ids


def test_top_k_restricts_to_the_k_most_likely(llm):
    # Sample one token many times from the same prompt; every pick must be among the top-3 logits.
    engine = llm.engine
    prompt = [3, 1, 4, 1, 5]
    hf_logits = _last_logits(llm, prompt)
    top3 = set(hf_logits.topk(3).indices.tolist())
    picks = {o.output_ids[0] for o in llm.generate([prompt] * 40, [SamplingParams(max_tokens=1, temperature=2.0, top_k=3, seed=s) for s in range(40)])}
    assert picks <= top3 and len(picks) > 1
    assert engine.core.kv.used_tokens == 0


def _last_logits(llm: LLM, prompt: list[int]) -> torch.Tensor:
    from orca_backend.core.request import Request
    from orca_backend.core.scheduler import ScheduledBatch, make_scheduler_output
    from orca_backend.scheduler_output import SchedulerOutput

    engine = llm.engine
    r = Request("probe", prompt, SamplingParams(max_tokens=1), arrival_time=0.0)
    assert engine.core.kv.admit(r, others_running=False)
    runner = engine.core.executor.runner
    step = make_scheduler_output(ScheduledBatch([r], [len(prompt)]), -1)
    runner.update_states(step)
    logits = runner.run_stage(step)[0]
    engine.core.kv.free(r)
    runner.update_states(SchedulerOutput(-1, [], [], [], finished_ids=["probe"]))  # the runner forgets the probe
    return logits


def test_eos_stops_unless_ignored_and_never_before_min_tokens(llm):
    eos = llm.engine.model_config.eos_token_id
    prompt = [11, 12, 13]
    greedy = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0].output_ids
    # Make the greedy continuation's 4th token a stop token: generation must end right there.
    stop_tok = greedy[3]
    first = greedy.index(stop_tok)
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert out.finish_reason == "stop" and out.output_ids == greedy[: first + 1]
    # min_tokens bans the stop token until then, so the output is at least that long.
    out = llm.generate([prompt], SamplingParams(max_tokens=30, min_tokens=first + 3, temperature=0.0, stop_token_ids=[stop_tok]))[0]
    assert len(out.output_ids) >= first + 3
    assert stop_tok not in out.output_ids[: first + 3]
    if eos is not None:
        out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, min_tokens=30))[0]
        assert len(out.output_ids) == 30 and eos not in out.output_ids


def test_streamed_text_deltas_concatenate_to_the_full_decode(llm):
    tok = llm.tokenizer
    engine = llm.engine
    deltas: list[str] = []
    ids: list[int] = []

    def collect(out):
        deltas.append(out.new_text)
        ids.extend(out.new_token_ids)

    for prompt in (tok.encode("héllo naïve 日本 😀 the"), [5, 200, 17]):
        deltas.clear()
        ids.clear()
        engine.add_request(prompt, SamplingParams(max_tokens=40, temperature=1.0, seed=7, ignore_eos=True), on_output=collect)
        while engine.has_work():
            engine.step()
        assert "".join(deltas) == tok.decode(ids)
        # A delta never ends inside a multi-byte character unless it is the final flush.
        assert all(not d.endswith("\ufffd") for d in deltas[:-1])


def test_stop_string_truncates_text(llm):
    tok = llm.tokenizer
    prompt = tok.encode("the kalo mine")
    full = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[stop]))[0]
    assert out.finish_reason == "stop"
    assert out.text == full.text[: full.text.find(stop)]
    assert len(out.output_ids) < len(full.output_ids)
    # The output processor reports the stop to the core as an abort: its K/V is free once generate returns.
    assert llm.engine.core.kv.used_tokens == 0


def test_stop_string_cuts_the_same_place_in_request_level_mode(tiny_checkpoint, llm):
    """Request-level mode releases a batch's tokens together, when the batch ends; the stop string
    must still cut text and ids exactly where iteration-level mode cuts them."""
    tok = llm.tokenizer
    prompts = [tok.encode("the kalo mine"), tok.encode("a b"), tok.encode("mine the")]
    full = llm.generate(prompts, SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True))
    assert all(len(f.text) > 7 for f in full)
    params = [SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True, stop=[f.text[4:7]]) for f in full]
    iteration = llm.generate(prompts, params)
    request = LLM(str(tiny_checkpoint[0]), max_num_seqs=16, scheduling="request").generate(prompts, params)
    for a, b in zip(iteration, request, strict=True):
        assert a.finish_reason == b.finish_reason == "stop"
        assert (a.text, a.output_ids) == (b.text, b.output_ids)


def test_text_prompts_round_trip(llm):
    out = llm.generate("the naïve one", SamplingParams(max_tokens=5, temperature=0.0))[0]
    ids_out = llm.generate([llm.tokenizer.encode("the naïve one")], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert out.output_ids == ids_out.output_ids and isinstance(out.text, str)


def test_a_stream_that_never_completes_a_character_costs_linear_work(tiny_checkpoint):
    """Continuation bytes forever: the text waiting for its character to complete is released (as
    U+FFFD, what a final decode shows) once a few tokens wait, so the tokens re-decoded per step stay
    bounded instead of growing with the stream (quadratic work on the shared output thread)."""
    from orca_backend.engine.output_processor import DetokenizerState, update_text
    from orca_backend.tokenizer import Tokenizer

    tokenizer = Tokenizer(tiny_checkpoint[0] / "tokenizer.json")
    lone = next(t for t in range(tokenizer.vocab_size) if tokenizer.decode([t]) == "\ufffd")
    decoded: list[int] = []

    class Counting:
        def decode(self, ids: list[int]) -> str:
            decoded.append(len(ids))
            return tokenizer.decode(ids)

    state, n = DetokenizerState([5, 6], []), 3000
    for _ in range(n):
        state.token_ids.append(lone)
        update_text(Counting(), state)
    update_text(Counting(), state, final=True)
    assert max(decoded) <= 16  # the last release (its context) and up to 8 waiting tokens, whatever n is
    assert state.text == tokenizer.decode([lone] * n)


def test_the_cpu_argmax_is_torchs_first_maximum():
    from orca_backend.worker.sampler import _argmax

    logits = torch.randn(64, 300)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first wins, as in torch
    logits[5] = float("-inf")
    assert torch.equal(_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(_argmax(logits[:, ::2]), logits[:, ::2].argmax(dim=-1))  # not contiguous: torch's own
