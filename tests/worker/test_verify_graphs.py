"""The CUDA-graph path of speculative decoding's verify steps (worker/cuda_graphs.py's `VerifyGraphs`),
checked on the CPU (CI has no GPU): verify steps run on the static buffers padded to batch-size
buckets, those in which some request verifies fewer than k proposals (cut by max_tokens, or paused
after fruitless rounds) among them; they return a logits row per token in the sampler's order (each
request's own row, then the rows verifying its proposals) and give the engine's tokens without
speculation, right and wrong proposals alike, writing no K/V for padding; a step with a prompt
chunk longer than 1 + k beside them runs on the mixed buffers, which hold its verify rows; and, on
the Triton kernels a GPU captures, steps of one bucket and the all-padding step a capture records
make identical launches and pass the capture guard (tests/graph_checks.py)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from engine_helpers import OracleProposer, drain, random_prompts
from graph_checks import run_checking_pool
from triton_testing import INTERPRETED, NEEDS_FRESH_PROCESS, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.worker.cuda_graphs import (
    VerifyGraphs,
    capture_sizes,
    mixed_capture_sizes,
    verify_capture_sizes,
)
from orca_backend.worker.model_runner import ModelRunner

K = OracleProposer.K
MAX_NUM_SEQS = 8
SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": K, "max_pause_steps": 0})  # every step verifies
MAX_TOKENS = [40, 29, 52, 33, 45, 26]


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the Triton cases run in this process")
def test_triton_cases_in_fresh_process() -> None:
    run_in_fresh_process(__file__)


def test_verify_capture_sizes_stop_at_small_batches():
    assert verify_capture_sizes(8) == [1, 2, 4, 8]
    assert verify_capture_sizes(256) == [1, 2, 4, 8, 16, 32, 64]


def _static_llm(model: str, kernels: str, wrong: str) -> tuple[LLM, ModelRunner, OracleProposer, list, list, list]:
    """An engine whose every step runs on the graphs' static buffers (eagerly: a CPU captures
    nothing), proposing each request's true continuation (wrong from a place: `wrong`); its prompts,
    their parameters and the tokens an engine without speculation makes of them."""
    plain = LLM(model, max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=2048, kernels=kernels)
    prompts = random_prompts(len(MAX_TOKENS), plain.engine.model_config.vocab_size, seed=19)
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in MAX_TOKENS]
    expected = [o.output_ids for o in plain.generate(prompts, params)]
    llm = LLM(model, max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=2048, kernels=kernels, speculative_config=SPECULATIVE)
    proposer = llm.engine.core.scheduler.proposer = OracleProposer(prompts, expected, plain.engine.model_config.vocab_size,
                                                                   wrong)  # fmt: skip
    runner = llm.engine.core.executor.runner
    runner.decode_graphs = runner.static_decode(capture_sizes(MAX_NUM_SEQS))
    runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(0))
    runner.verify_graphs = runner.static_verify(verify_capture_sizes(MAX_NUM_SEQS))
    return llm, runner, proposer, prompts, params, expected


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize("wrong", ["never", "cycle"])
def test_verify_steps_on_static_buffers_give_the_tokens_and_padding_writes_no_kv(model, wrong):
    llm, runner, _, prompts, params, expected = _static_llm(model, "cpu", wrong)
    graphs: VerifyGraphs = runner.verify_graphs
    run = graphs.run
    seen: list[tuple[int, int, bool]] = []  # (live requests, bucket, whether all verify k) of every verify step

    def checked_run(inputs, ahead=None):
        """The pool after the step differs from before only in the live tokens' slots; a row per token."""
        logits, _ = run_checking_pool(run, runner.kv_caches, inputs, ahead)
        assert logits.shape[0] == len(inputs.logits_indices) == inputs.num_tokens
        uniform = inputs.num_tokens == inputs.num_requests * (1 + K)
        seen.append((inputs.num_requests, graphs.bucket(inputs.num_requests), uniform))
        return logits

    graphs.run = checked_run
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    stats, spec = llm.engine.stats(), llm.engine.core.stats()
    # Every step ran on the static buffers: prompts (all prefilled in the first step, with no
    # proposals) on the mixed ones, verify steps on the verify buckets, uniform or not.
    assert set(stats.steps_by_path) == {"static_buffers"}, stats.steps_by_path
    assert len(seen) > 3 and any(live < bucket for live, bucket, _ in seen)  # padded steps among them
    # Near its max_tokens a request proposes fewer than k tokens, down to none (a plain decode).
    assert any(not uniform for _, _, uniform in seen)
    if wrong == "never":
        assert spec.spec_num_accepted_tokens == spec.spec_num_draft_tokens
    else:
        assert 0 < spec.spec_num_accepted_tokens < spec.spec_num_draft_tokens


def test_a_verify_step_beside_a_long_prompt_chunk_runs_on_the_mixed_buffers():
    """Three requests verify (every proposal right); a prompt of 2 + 2k tokens joins them, then one of
    1 + k tokens. The second fits a verify bucket as a request of 1 + k tokens, as do the steps
    verifying fewer than k proposals; the first does not ("speculative" there) and runs on the mixed
    buffers, which hold its verify rows. A mixed bucket without room for them says so."""
    llm, runner, proposer, prompts, params, expected = _static_llm("gpt2-tiny", "cpu", "never")
    verify, mixed = runner.verify_graphs, runner.mixed_graphs
    reasons: list[tuple[str, int]] = []  # (the verify graphs' eager reason, longest query) of every verify step
    prompt_steps: list[str] = []  # that reason for each step with a prompt of 1 + k tokens beside verify rows
    eager_reason = verify.eager_reason

    def noted(inputs):
        reasons.append((eager_reason(inputs), inputs.max_query_len))
        lengths = np.diff(inputs.query_start)
        lengths[inputs.spec.positions] = 0  # the requests verifying proposals
        if (lengths == 1 + K).any():
            prompt_steps.append(reasons[-1][0])
        return reasons[-1][0]

    verify.eager_reason = noted
    mixed_with_rows = []  # the verify steps the mixed buffers ran
    run_mixed = mixed.run

    def noted_mixed(inputs, ahead=None):
        if inputs.spec is not None:
            mixed_with_rows.append(inputs)
        (logits, hidden), _ = run_checking_pool(run_mixed, runner.kv_caches, inputs, ahead)
        assert logits.shape[0] == len(inputs.logits_indices)
        return logits, hidden

    mixed.run = noted_mixed
    fresh = torch.randint(0, llm.engine.model_config.vocab_size, (3 + 3 * K,), generator=torch.Generator().manual_seed(5))
    late = [fresh[: 2 + 2 * K].tolist(), fresh[2 + 2 * K :].tolist()]  # 2 + 2k and 1 + k tokens
    late_expected = [o.output_ids for o in LLM("gpt2-tiny", max_num_seqs=MAX_NUM_SEQS).generate(late, params[3:5])]
    proposer.references.update({tuple(p): e for p, e in zip(late, late_expected, strict=True)})
    engine, tokens = llm.engine, {}

    def add(prompt, sampling):
        collect = lambda o: tokens.setdefault(o.request_id, []).extend(o.new_token_ids)  # noqa: E731
        return engine.add_request(prompt, sampling, on_output=collect).request_id

    first = [add(p, q) for p, q in zip(prompts[:3], params[:3], strict=True)]
    for _ in range(3):  # the prompts, then verify steps
        engine.step()
    long_id = add(late[0], params[3])
    engine.step()
    short_id = add(late[1], params[4])
    drain(engine)
    assert [tokens[i] for i in first] == expected[:3] and [tokens[long_id], tokens[short_id]] == late_expected
    assert set(engine.stats().steps_by_path) == {"static_buffers"}
    assert [reason for reason, longest in reasons if longest > 1 + K] == ["speculative"]
    assert {reason for reason, longest in reasons if longest <= 1 + K} == {""}
    assert prompt_steps == [""]
    [step] = mixed_with_rows  # the long prompt's step, with 3 requests' verify rows
    assert len(step.logits_indices) == step.num_requests + 3 * K
    without_room = runner.static_mixed(mixed.sizes)
    without_room.spec_rows = 0
    assert without_room.eager_reason(step) == "speculative" and mixed.eager_reason(step) == ""


@pytest.mark.slow
def test_verify_steps_of_one_bucket_make_identical_launches_and_pass_the_capture_guard(monkeypatch):
    """The Triton path a GPU captures: verify steps run under the capture guard, and within each
    bucket every step (of whatever acceptance) and the all-padding step make identical launches."""
    from graph_checks import StepRecorder, guard_steps, record_triton_kernels

    use_import_mode(monkeypatch)  # skips when this process cannot run Triton (the fresh-process test does)
    if not INTERPRETED:  # a CUDA machine: captured graphs are tests/model/test_cuda.py's
        pytest.skip("the engines here run on the CPU, where Triton needs its interpreter")
    record_triton_kernels(monkeypatch)
    llm, runner, _, prompts, params, expected = _static_llm("llama-tiny", "triton", "cycle")
    guarded = guard_steps(monkeypatch, runner, runner.verify_graphs)
    recorder = StepRecorder(runner, runner.verify_graphs)
    assert [o.output_ids for o in llm.generate(prompts[:3], params[:3])] == expected[:3]
    assert guarded.passed and not guarded.failures
    recorder.record_padding()
    recorder.assert_identical_launches()
    assert any(len(steps) >= 3 for steps in recorder.recordings.values())  # steps and the padding in a bucket


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_steps_on_static_buffers_return_every_tokens_hidden_states(tmp_path, method):
    """With an EAGLE head every step's graph returns, beside the logits, every token's hidden states
    (the final one, and for EAGLE-3 those entering the head's layers) from a buffer of the bucket's
    size: a head mirroring a one-layer target keeps most proposals accepted, an EAGLE-3 head of
    random weights keeps the tokens, and every step ran on the static buffers."""
    from eagle_heads import target_and_head
    from hf_tiny import hf_greedy

    model, target, head = target_and_head(tmp_path, method)
    prompts = random_prompts(4, 320, seed=6)
    spec = json.dumps({"method": method, "model": str(head), "num_speculative_tokens": K})
    llm = LLM(str(target), kv_policy="paged", block_size=4, max_num_seqs=MAX_NUM_SEQS, speculative_config=spec)
    runner = llm.engine.core.executor.runner
    runner.decode_graphs = runner.static_decode(capture_sizes(MAX_NUM_SEQS))
    runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(0))
    runner.verify_graphs = runner.static_verify(verify_capture_sizes(MAX_NUM_SEQS))
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert [o.output_ids for o in llm.generate(prompts, params)] == [hf_greedy(model, p, 24) for p in prompts]
    assert set(llm.engine.stats().steps_by_path) == {"static_buffers"}
    stats = llm.engine.core.stats()
    assert stats.spec_num_draft_tokens > 0
    if method == "eagle":
        assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens


@pytest.mark.slow
def test_eagle3_steps_pass_the_capture_guard_with_their_hidden_states(tmp_path, monkeypatch):
    """The Triton path a GPU captures, with an EAGLE-3 head: every graphed step (prompt, decode,
    verify) returns its hidden states without reading a value back to the host, and a verify bucket's
    steps make identical launches."""
    from eagle_heads import target_and_head
    from graph_checks import StepRecorder, guard_steps, record_triton_kernels
    from hf_tiny import hf_greedy

    use_import_mode(monkeypatch)
    if not INTERPRETED:
        pytest.skip("the engines here run on the CPU, where Triton needs its interpreter")
    record_triton_kernels(monkeypatch)
    model, target, head = target_and_head(tmp_path, "eagle3")
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})
    llm = LLM(str(target), kernels="triton", max_num_seqs=4, speculative_config=spec)
    runner = llm.engine.core.executor.runner
    runner.decode_graphs = runner.static_decode(capture_sizes(4))
    runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(32))
    runner.verify_graphs = runner.static_verify(verify_capture_sizes(4))
    guarded = [guard_steps(monkeypatch, runner, g) for g in (runner.mixed_graphs, runner.verify_graphs)]
    recorder = StepRecorder(runner, runner.verify_graphs)
    prompts = random_prompts(2, 320, seed=6)
    params = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
    assert [o.output_ids for o in llm.generate(prompts, params)] == [hf_greedy(model, p, 10) for p in prompts]
    assert all(g.passed and not g.failures for g in guarded)
    recorder.record_padding()
    recorder.assert_identical_launches()
