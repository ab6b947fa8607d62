"""Async scheduling (`async_scheduling=True`): step N+1 is scheduled and launched while step N runs,
its requests' input tokens taken on the device from N's sampled ids. Whatever the workload, the
tokens, finish reasons and logprobs are those of the synchronous engine; the steps run ahead of a
request's stop, of a failure or of an abort are dropped."""

from __future__ import annotations

import dataclasses
import random

import pytest
from engine_helpers import drain, long_prompts, random_prompts

from orca_backend import LLM, SamplingParams
from orca_backend.config import EngineConfig
from orca_backend.scheduler_output import SchedulerOutput
from orca_backend.worker.cuda_graphs import capture_sizes

MODELS = ["gpt2-tiny", "llama-tiny"]


def _params(n: int, seed: int, vocab: int) -> list[SamplingParams]:
    """Greedy and seeded random sampling, lengths from 1 to 24, some stopping early on a stop token
    (found when its step lands, after the next step was run ahead), some asking for logprobs or
    logit_bias, and one with penalties."""
    rng = random.Random(seed)
    params = []
    for i in range(n):
        kwargs = {}
        if i % 4 == 1:
            kwargs["stop_token_ids"] = rng.sample(range(vocab), 40)
        if i % 5 == 2:
            kwargs["logprobs"] = 2
        if i % 7 == 3:
            kwargs["logit_bias"] = {rng.randrange(vocab): 5.0}
        if i == 5:
            kwargs["frequency_penalty"] = 0.5
        params.append(SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True, temperature=rng.choice([0.0, 0.9]),
                                     top_k=rng.choice([0, 20]), seed=rng.randrange(1000), **kwargs))  # fmt: skip
    return params


def _outputs(llm: LLM, prompts, params) -> list[tuple]:
    return [(o.output_ids, o.finish_reason, o.logprobs) for o in llm.generate(prompts, params)]


def _spy_launches(llm: LLM) -> list[SchedulerOutput]:
    """Records every step the runner launches."""
    runner = llm.engine.core.executor.runner
    launched: list[SchedulerOutput] = []
    launch = runner.launch

    def spy(step: SchedulerOutput):
        launched.append(step)
        return launch(step)

    runner.launch = spy
    return launched


@pytest.mark.parametrize("model", MODELS)
def test_async_tokens_equal_sync(model):
    sync = LLM(model, max_num_seqs=6)
    vocab = sync.engine.model_config.vocab_size
    prompts, params = random_prompts(14, vocab, seed=11), _params(14, seed=11, vocab=vocab)
    expected = _outputs(sync, prompts, params)
    llm = LLM(model, max_num_seqs=6, async_scheduling=True)
    launched = _spy_launches(llm)
    assert _outputs(llm, prompts, params) == expected
    assert llm.engine.core.max_batches_in_flight == 2
    assert sum(len(step.ahead_rows) for step in launched) > 20  # most decodes ran ahead of their last step
    assert any(o[1] == "stop" for o in expected)  # stop tokens were found a step late, and nothing leaked


@pytest.mark.parametrize("model", MODELS)
def test_async_on_the_cuda_graph_path(model):
    """Decode steps on the CUDA-graph path's static buffers (run eagerly on a CPU), run ahead: the
    ids are written over the static input tokens before the forward."""
    sync = LLM(model, max_num_seqs=6)
    vocab = sync.engine.model_config.vocab_size
    prompts, params = random_prompts(10, vocab, seed=4), _params(10, seed=4, vocab=vocab)
    expected = _outputs(sync, prompts, params)
    llm = LLM(model, max_num_seqs=6, async_scheduling=True)
    runner = llm.engine.core.executor.runner
    runner.decode_graphs = runner.static_decode(capture_sizes(6))
    launched = _spy_launches(llm)
    assert _outputs(llm, prompts, params) == expected
    assert any(step.ahead_rows and len(step.scheduled_ids) == step.num_tokens for step in launched)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "static_buffers"])
def test_penalized_requests_run_ahead_and_keep_the_sync_tokens(graphs):
    """Presence, frequency and repetition penalties, greedy and sampled, beside requests without: each
    penalized request runs ahead of its last step, whose token its penalties count from the device
    (the penalties change the tokens, so a token counted twice or missed is seen). Some stop early on
    a stop token, so the steps run ahead of them are dropped, their counts with them."""
    sync = LLM("llama-tiny", max_num_seqs=6)
    vocab = sync.engine.model_config.vocab_size
    prompts = random_prompts(8, vocab, seed=21)
    penalties = [{"frequency_penalty": 1.5}, {"presence_penalty": 1.8}, {"repetition_penalty": 1.7},
                 {"frequency_penalty": -1.0, "presence_penalty": 0.5}, {}]  # fmt: skip
    params = [SamplingParams(max_tokens=12 + i, ignore_eos=True, temperature=0.8 if i % 3 == 0 else 0.0, seed=i,
                             stop_token_ids=list(range(0, vocab, 3)) if i in (2, 6) else [], **penalties[i % 5])
              for i in range(8)]  # fmt: skip
    expected = _outputs(sync, prompts, params)
    plain = _outputs(sync, prompts, [dataclasses.replace(p, frequency_penalty=0.0, presence_penalty=0.0,
                                                         repetition_penalty=1.0) for p in params])  # fmt: skip
    assert sum(a[0] != b[0] for a, b in zip(expected, plain, strict=True)) >= 4  # the penalties matter
    llm = LLM("llama-tiny", max_num_seqs=6, async_scheduling=True)
    if graphs:
        runner = llm.engine.core.executor.runner
        runner.decode_graphs = runner.static_decode(capture_sizes(6))
    launched = _spy_launches(llm)
    assert _outputs(llm, prompts, params) == expected
    assert any(o[1] == "stop" for o in expected)
    penalized = {f"req-{i}" for i, p in enumerate(params) if p.penalized}
    ran_ahead = {step.scheduled_ids[r] for step in launched for r in step.ahead_rows}
    assert len(ran_ahead & penalized) >= 5, ran_ahead


def test_async_with_preemption_chunked_prefill_and_prefix_caching():
    """A pool too small for the batch (requests preempted and recomputed), prompts longer than the
    token budget (prefilled in chunks beside the decodes), a shared prefix cached."""
    kwargs = dict(max_num_seqs=8, kv_capacity_tokens=160, block_size=4, max_num_batched_tokens=24,
                  enable_prefix_caching=True)  # fmt: skip
    sync = LLM("llama-tiny", **kwargs)
    vocab = sync.engine.model_config.vocab_size
    prompts = long_prompts(10, vocab, seed=3, shared=12)
    params = [SamplingParams(max_tokens=8 + i, ignore_eos=True, temperature=0.0 if i % 2 else 0.7, seed=i)
              for i in range(10)]  # fmt: skip
    expected = _outputs(sync, prompts, params)
    llm = LLM("llama-tiny", async_scheduling=True, **kwargs)
    assert _outputs(llm, prompts, params) == expected
    assert llm.engine.core.scheduler.num_preemptions > 0
    assert llm.engine.core.kv.used_tokens == 0  # every block came back, those of steps dropped too


def test_two_steps_landing_before_the_next_record_both_tokens(tiny_checkpoint):
    """When a request ends, the pipeline drains: the step in flight and the one after it both land
    before the next is scheduled, so that step records two tokens of a request at once. Each goes
    into the runner's row, in order (the second once overwrote the first, and the next step read a
    stale input token: a regression test). A pool small enough that blocks are reused at once."""
    path, config = tiny_checkpoint
    prompts = long_prompts(8, config.vocab_size, seed=3)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (8, 16, 16, 16, 5, 13, 2, 9)]
    kwargs = dict(kv_policy="paged", block_size=4, kv_capacity_tokens=64, max_num_seqs=8, kv_watermark=0.0)
    expected = _outputs(LLM(str(path), **kwargs), prompts, params)
    assert _outputs(LLM(str(path), async_scheduling=True, **kwargs), prompts, params) == expected


def test_a_failed_step_drops_the_step_run_ahead_and_fails_only_its_request(monkeypatch):
    """The forward of any step holding the poisoned request fails: the step launched after it ran on
    its tokens and is dropped; bisection ends the poisoned request alone, the others finish with the
    synchronous engine's tokens."""
    poison = 7

    def poisoned(llm: LLM) -> LLM:
        model = llm.engine.core.executor.runner.model
        forward = model.forward

        def failing(stage_input, *args):
            if poison in stage_input.input_ids.tolist():
                raise RuntimeError("injected device error")
            return forward(stage_input, *args)

        model.forward = failing
        return llm

    def run(llm: LLM) -> list[tuple[list[int], str]]:
        params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)
        streams = [llm.engine.add_request(p, params) for p in ([1, 2, 3], [4, 5, poison], [8, 9], [10, 11, 12, 13])]
        drain(llm.engine)
        events = [list(s) for s in streams]
        return [([t for e in es for t in e.new_token_ids], es[-1].finish_reason) for es in events]

    expected = run(poisoned(LLM("gpt2-tiny", max_num_seqs=4)))
    llm = poisoned(LLM("gpt2-tiny", max_num_seqs=4, async_scheduling=True))
    got = run(llm)
    assert [reason for _, reason in got] == ["length", "error", "length", "length"]
    assert got == expected
    assert llm.engine.healthy and llm.engine.core.kv.used_tokens == 0


def test_an_abort_while_two_steps_are_in_flight():
    """Aborted between steps (both its steps in flight or landed): it ends cancelled, its blocks come
    back once no step holds them, the others' tokens are the synchronous engine's."""
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8]]
    expected = [o.output_ids for o in LLM("gpt2-tiny").generate(prompts, params)]
    llm = LLM("gpt2-tiny", async_scheduling=True)
    engine = llm.engine
    streams = [engine.add_request(p, params) for p in prompts]
    for _ in range(4):
        engine.step()
    assert engine.core.executor.num_in_flight == 1  # one step ahead, launched, not landed
    engine.abort_request(streams[1].request_id)
    drain(engine)
    events = [list(s) for s in streams]
    assert events[1][-1].finish_reason == "cancelled"
    for i in (0, 2):
        assert [t for e in events[i] for t in e.new_token_ids] == expected[i]
    assert engine.core.kv.used_tokens == 0


def test_async_scheduling_is_refused_where_it_cannot_run():
    with pytest.raises(ValueError, match="async_scheduling runs one process"):
        EngineConfig(async_scheduling=True, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="scheduling 'iteration'"):
        EngineConfig(async_scheduling=True, scheduling="request")


def test_async_beside_constrained_requests(tiny_checkpoint):
    """Structured-output requests (never run ahead: their next mask needs their token) in the same
    batches as requests that are: every one gets the synchronous engine's tokens and text, and no
    matcher is left behind."""
    pytest.importorskip("xgrammar")
    schema = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
              "required": ["name", "age"], "additionalProperties": False}  # fmt: skip
    params = [
        SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True),  # runs beside the constrained ones
        SamplingParams(max_tokens=48, structured_outputs={"json": schema}, temperature=0.0),
        SamplingParams(max_tokens=16, temperature=0.9, seed=3, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=24, structured_outputs={"regex": r"\d{4}-\d{2}-\d{2}"}, temperature=0.8, seed=4),
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
    ]
    prompts = ["the cat sat on", "hello there", "kalo mine to", "the cat", "hello"]
    path = str(tiny_checkpoint[0])
    expected = [(o.output_ids, o.text, o.finish_reason) for o in LLM(path, max_num_seqs=8).generate(prompts, params)]
    llm = LLM(path, max_num_seqs=8, async_scheduling=True)
    # The grammars compiled once first (cached by spec): the constrained requests then start within
    # an iteration or two of the others, however slowly a loaded machine compiles, and run beside them.
    constrained = [i for i, p in enumerate(params) if p.structured_outputs is not None]
    llm.generate([prompts[i] for i in constrained], [params[i] for i in constrained])
    launched = _spy_launches(llm)
    assert [(o.output_ids, o.text, o.finish_reason) for o in llm.generate(prompts, params)] == expected
    assert any(step.ahead_rows and step.bitmask_rows for step in launched)  # both kinds in one step
    core = llm.engine.core
    assert core.structured.num_matchers == 0 and core.kv.used_blocks == 0


def test_async_under_orcas_reservation_policy():
    """kv_policy "reserve" (blocks for prompt + max_tokens at admission): a request run ahead never
    needs a block past its reservation (the token it waits for cannot end it by length)."""
    kwargs = dict(max_num_seqs=4, kv_policy="reserve", kv_capacity_tokens=256, block_size=4)
    sync = LLM("gpt2-tiny", **kwargs)
    vocab = sync.engine.model_config.vocab_size
    prompts, params = random_prompts(10, vocab, seed=9), _params(10, seed=9, vocab=vocab)
    expected = _outputs(sync, prompts, params)
    llm = LLM("gpt2-tiny", async_scheduling=True, **kwargs)
    assert _outputs(llm, prompts, params) == expected
    assert llm.engine.core.kv.used_tokens == 0


def test_async_in_the_engine_core_process():
    """The served layout: the engine core in its own process, its loop running steps while requests
    stream in; tokens as the synchronous engine's, and an abort mid-run leaves the engine serving."""
    from orca_backend.engine.llm_engine import LLMEngine

    vocab = 512  # gpt2-tiny
    prompts, params = random_prompts(8, vocab, seed=21), _params(8, seed=21, vocab=vocab)
    expected = _outputs(LLM("gpt2-tiny", max_num_seqs=4), prompts, params)
    engine = LLMEngine.launch(EngineConfig(model="gpt2-tiny", max_num_seqs=4, async_scheduling=True))
    try:
        streams = [engine.add_request(p, sp) for p, sp in zip(prompts, params, strict=True)]
        doomed = engine.add_request([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        engine.abort_request(doomed.request_id)
        events = [list(s) for s in streams]
        got = [([t for e in es for t in e.new_token_ids], es[-1].finish_reason) for es in events]
        assert got == [(ids, reason) for ids, reason, _ in expected]
        assert list(doomed)[-1].finish_reason == "cancelled"
        assert engine.healthy
    finally:
        engine.shutdown()
