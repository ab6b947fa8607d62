"""The CUDA-graph path of speculative decoding's proposers in the model runner, checked on the CPU
(CI has no GPU). The draft model (worker/draft_proposer.py's `static_graphs`): a round's first pass
runs on static buffers bucketed by token count and the one-token passes after it on buffers
bucketed by batch size, each pass's tokens fed to the next on the device; the engine's tokens are
unchanged with a draft that is always right (the target itself) and one that is almost never right,
and no pass writes K/V for its padding; a first pass longer than the largest bucket runs eagerly and
says so. The EAGLE heads (worker/eagle_proposer.py): the pass over what a step kept and the
one-token proposing passes run on static buffers that read a hidden state per token beside the
tokens, each proposing pass's tokens fed on the device too, with the target's tokens unchanged.
On the Triton kernels a GPU captures, passes of one bucket and the all-padding pass a capture
records make identical launches and pass the capture guard (tests/graph_checks.py)."""

from __future__ import annotations

import json

import pytest
from engine_helpers import random_prompts
from graph_checks import run_checking_pool
from triton_testing import INTERPRETED, NEEDS_FRESH_PROCESS, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.worker.cuda_graphs import (
    StepGraphs,
    capture_sizes,
    mixed_capture_sizes,
    verify_capture_sizes,
)
from orca_backend.worker.draft_proposer import DraftProposer

K = 3
MAX_NUM_SEQS = 4
PARAMS = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in (20, 13, 17, 9, 15)]


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the Triton cases run in this process")
def test_triton_cases_in_fresh_process() -> None:
    run_in_fresh_process(__file__)


def static_engine(target, draft, max_num_batched_tokens: int = 0, **options) -> tuple[LLM, DraftProposer]:
    """An engine whose target steps and draft passes all run on the graphs' static buffers (eagerly:
    a CPU captures nothing), every decode proposing K tokens (no pause)."""
    spec = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": K, "max_pause_steps": 0}
    llm = LLM(str(target), max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=2048, speculative_config=json.dumps(spec),
              **options)  # fmt: skip
    runner = llm.engine.core.executor.runner
    runner.decode_graphs = runner.static_decode(capture_sizes(MAX_NUM_SEQS))
    runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(0))
    runner.verify_graphs = runner.static_verify(verify_capture_sizes(MAX_NUM_SEQS))
    drafter = runner.drafter
    assert isinstance(drafter, DraftProposer)
    graphs = drafter.static_graphs(MAX_NUM_SEQS, max_num_batched_tokens, runner.input_batch.block_table.shape[2])
    assert graphs == [drafter.first_graphs, drafter.next_graphs]
    return llm, drafter


def checked(drafter: DraftProposer, graphs: StepGraphs, seen: list[tuple[int, int]], fed_on_device: bool) -> None:
    """Every pass on `graphs` changes the draft's pool in its live tokens' slots only, takes its tokens
    from the device (the pass before's, `ahead`) where `fed_on_device`, else from the host, and notes
    its (live requests, bucket)."""
    run = graphs.run

    def checked_run(inputs, ahead=None, hidden=None):
        assert (ahead is not None) == fed_on_device
        out, _ = run_checking_pool(run, drafter.kv_caches, inputs, ahead, hidden)
        logits = out[0] if isinstance(out, tuple) else out  # (an EAGLE head's passes return its output too)
        assert logits.shape[0] == inputs.num_requests
        seen.append((inputs.num_requests, graphs.bucket(graphs.size_of(inputs))))
        return out

    graphs.run = checked_run


@pytest.mark.parametrize("draft", ["itself", "random"])
def test_draft_passes_on_static_buffers_keep_the_tokens_and_write_no_padding_kv(tiny_checkpoint, make_checkpoint,
                                                                                draft):  # fmt: skip
    path, config = tiny_checkpoint
    draft_path = path if draft == "itself" else make_checkpoint(config, seed=9)[0]
    prompts = random_prompts(len(PARAMS), config.vocab_size, seed=27)
    expected = [o.output_ids for o in LLM(str(path)).generate(prompts, PARAMS)]
    llm, drafter = static_engine(path, draft_path)
    first, following = [], []
    checked(drafter, drafter.first_graphs, first, fed_on_device=False)
    checked(drafter, drafter.next_graphs, following, fed_on_device=True)
    assert [o.output_ids for o in llm.generate(prompts, PARAMS)] == expected
    assert set(drafter.pass_paths) == {"static_buffers"}
    assert drafter.pass_paths["static_buffers"] == len(first) + len(following)
    assert any(live < bucket for live, bucket in following)  # padded passes among them
    assert max(live for live, _ in first) == MAX_NUM_SEQS  # a first pass of several requests
    stats = llm.engine.core.stats()
    if draft == "itself":
        assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens > 0
    else:
        assert stats.spec_num_accepted_tokens < stats.spec_num_draft_tokens / 4


def test_a_first_pass_above_the_largest_bucket_runs_eagerly_and_says_so(tiny_checkpoint):
    """Largest first-pass bucket 16 tokens: a request's first round reads its whole prompt (20
    tokens) into the draft, eagerly; its later rounds' first passes, of a token or two, do not."""
    path, config = tiny_checkpoint
    prompts = [p * 4 for p in random_prompts(3, config.vocab_size, seed=28)]  # 20 tokens each
    params = PARAMS[:3]
    expected = [o.output_ids for o in LLM(str(path)).generate(prompts, params)]
    llm, drafter = static_engine(path, path, max_num_batched_tokens=16)
    assert drafter.first_graphs.sizes == [16]
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert drafter.pass_paths["tokens_above_buckets"] >= 1 and drafter.pass_paths["static_buffers"] > 0
    assert set(drafter.pass_paths) == {"tokens_above_buckets", "static_buffers"}


@pytest.mark.slow
def test_draft_passes_of_one_bucket_make_identical_launches_and_pass_the_capture_guard(monkeypatch):
    """The Triton path a GPU captures: the draft's passes run under the capture guard (no value read
    back to the host, no host copy but the staging buffers'), and within each bucket every pass and
    the all-padding pass make identical launches."""
    from graph_checks import StepRecorder, guard_steps, record_triton_kernels

    use_import_mode(monkeypatch)  # skips when this process cannot run Triton (the fresh-process test does)
    if not INTERPRETED:  # a CUDA machine: captured graphs are tests/model/test_cuda.py's
        pytest.skip("the engines here run on the CPU, where Triton needs its interpreter")
    record_triton_kernels(monkeypatch)
    prompts = random_prompts(3, 320, seed=29)
    params = PARAMS[:3]
    expected = [o.output_ids for o in LLM("llama-tiny").generate(prompts, params)]
    llm, drafter = static_engine("llama-tiny", "llama-tiny", kernels="triton")
    guarded = [guard_steps(monkeypatch, drafter, g) for g in (drafter.first_graphs, drafter.next_graphs)]
    recorders = [StepRecorder(drafter, g) for g in (drafter.first_graphs, drafter.next_graphs)]
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert all(g.passed and not g.failures for g in guarded)
    for recorder in recorders:
        recorder.record_padding()
        recorder.assert_identical_launches()
        assert any(len(passes) >= 3 for passes in recorder.recordings.values())  # passes and the padding in a bucket


def static_eagle_engine(target, head, method: str, **options) -> tuple[LLM, object]:
    """An engine with an EAGLE head whose target steps and head passes all run on the graphs'
    static buffers, every decode proposing K tokens (no pause)."""
    spec = {"method": method, "model": str(head), "num_speculative_tokens": K, "max_pause_steps": 0}
    llm = LLM(str(target), kv_policy="paged", block_size=4, max_num_seqs=MAX_NUM_SEQS,
              speculative_config=json.dumps(spec), **options)  # fmt: skip
    runner = llm.engine.core.executor.runner
    runner.decode_graphs = runner.static_decode(capture_sizes(MAX_NUM_SEQS))
    runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(0))
    runner.verify_graphs = runner.static_verify(verify_capture_sizes(MAX_NUM_SEQS))
    drafter = runner.drafter
    assert drafter.static_graphs(MAX_NUM_SEQS, 0, runner.input_batch.block_table.shape[2]) == \
        [drafter.observe_graphs, drafter.propose_graphs]  # fmt: skip
    return llm, drafter


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_eagle_passes_on_static_buffers_keep_the_tokens_and_write_no_padding_kv(tmp_path, method):
    """A head mirroring a one-layer target (most proposals accepted) and an EAGLE-3 head of random
    weights: the target's tokens are transformers', and every head pass ran on the static buffers."""
    from eagle_heads import target_and_head
    from hf_tiny import hf_greedy

    model, target, head = target_and_head(tmp_path, method)
    prompts = random_prompts(len(PARAMS), 320, seed=6)
    llm, drafter = static_eagle_engine(target, head, method)
    observed, proposed = [], []
    checked(drafter, drafter.observe_graphs, observed, fed_on_device=False)
    checked(drafter, drafter.propose_graphs, proposed, fed_on_device=True)
    assert [o.output_ids for o in llm.generate(prompts, PARAMS)] == [hf_greedy(model, p, q.max_tokens)
                                                                     for p, q in zip(prompts, PARAMS, strict=True)]  # fmt: skip
    assert set(drafter.pass_paths) == {"static_buffers"}
    assert drafter.pass_paths["static_buffers"] == len(observed) + len(proposed) and observed and proposed
    assert any(live < bucket for live, bucket in proposed)
    stats = llm.engine.core.stats()
    if method == "eagle":
        assert stats.spec_num_accepted_tokens > 0.5 * stats.spec_num_draft_tokens


@pytest.mark.slow
def test_eagle3_passes_of_one_bucket_make_identical_launches_and_pass_the_capture_guard(tmp_path, monkeypatch):
    """The Triton path a GPU captures, with an EAGLE-3 head: its passes run under the capture guard
    (the hidden states they read are device memory), and within each bucket every pass and the
    all-padding pass make identical launches."""
    from eagle_heads import target_and_head
    from graph_checks import StepRecorder, guard_steps, record_triton_kernels
    from hf_tiny import hf_greedy

    use_import_mode(monkeypatch)
    if not INTERPRETED:
        pytest.skip("the engines here run on the CPU, where Triton needs its interpreter")
    record_triton_kernels(monkeypatch)
    model, target, head = target_and_head(tmp_path, "eagle3")
    llm, drafter = static_eagle_engine(target, head, "eagle3", kernels="triton")
    guarded = [guard_steps(monkeypatch, drafter, g) for g in (drafter.observe_graphs, drafter.propose_graphs)]
    recorders = [StepRecorder(drafter, g) for g in (drafter.observe_graphs, drafter.propose_graphs)]
    prompts = random_prompts(2, 320, seed=6)
    params = PARAMS[:2]
    assert [o.output_ids for o in llm.generate(prompts, params)] == [hf_greedy(model, p, q.max_tokens)
                                                                     for p, q in zip(prompts, params, strict=True)]  # fmt: skip
    assert all(g.passed and not g.failures for g in guarded)
    for recorder in recorders:
        recorder.record_padding()
        recorder.assert_identical_launches()
        assert any(len(passes) >= 3 for passes in recorder.recordings.values())
