"""The CUDA-graph path of steps with prompt tokens (worker/cuda_graphs.py's `MixedGraphs`), checked on
the CPU (CI has no GPU): chunked prompts joining running decodes, run on the static buffers padded to
token-count buckets, give the eager path's tokens and write no K/V for padding; within a bucket,
steps of different splits of prompt and decode tokens, and the all-padding step a capture records,
make identical launches; and no step reads a value back to the host or copies host memory in other
than its staging buffers (the capture guard, tests/graph_checks.py)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import random_prompts
from graph_checks import (
    CaptureGuard,
    HostReadError,
    StepRecorder,
    capture_guard,
    guard_steps,
    named_buffers,
    run_checking_pool,
)
from triton_testing import INTERPRETED, NEEDS_FRESH_PROCESS, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.worker.cuda_graphs import MixedGraphs, capture_sizes, mixed_capture_sizes
from orca_backend.worker.model_runner import ModelRunner

MODELS = ["gpt2-tiny", "llama-tiny"]
# The CPU's kernels (tokens only: their prefill loop reads lengths to the host, which no GPU runs),
# and the Triton kernels a GPU captures, here in Triton's interpreter (`slow`).
CASES = [pytest.param(m, k, marks=pytest.mark.slow if k == "triton" else ()) for m in MODELS for k in ("cpu", "triton")]
MAX_NUM_SEQS = 8
MAX_NUM_BATCHED_TOKENS = 32  # chunked prompts: steps of 32 tokens and fewer, mixed buckets 16 and 32
MAX_TOKENS = [3, 9, 4, 8, 5, 7, 2, 6]


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the Triton cases run in this process")
def test_triton_cases_in_fresh_process() -> None:
    run_in_fresh_process(__file__)


def _kernels(kernels: str, monkeypatch: pytest.MonkeyPatch) -> str:
    if kernels == "triton":
        use_import_mode(monkeypatch)  # skips when this process cannot run Triton (the fresh-process test does)
        if not INTERPRETED:  # a CUDA machine: its captured graphs are tests/model/test_cuda.py's
            pytest.skip("the engines here run on the CPU, where Triton needs its interpreter")
    return kernels


def test_mixed_capture_sizes_are_bounded_by_the_token_budget():
    assert mixed_capture_sizes(32) == [16, 32]
    assert mixed_capture_sizes(100) == [16, 32, 64, 100]
    assert mixed_capture_sizes(8) == [8]
    assert mixed_capture_sizes(0) == [16, 32, 64, 128, 256, 512, 1024, 2048]  # unset: DEFAULT_MAX_GRAPH_TOKENS


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight prompts of 1-23 tokens, chunked into steps of at most 32 tokens beside the decodes of the
    requests already prefilled; greedy and seeded random."""
    prompts = random_prompts(MAX_NUM_SEQS, vocab, seed=12)
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
        for i, n in enumerate(MAX_TOKENS)
    ]
    return prompts, params


def _llm(model: str, kernels: str) -> LLM:
    return LLM(model, max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=1024, kernels=kernels,
               max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)  # fmt: skip


def _static_llm(model: str, kernels: str) -> tuple[LLM, ModelRunner]:
    """An engine whose every step runs on the graphs' static buffers (eagerly: a CPU captures nothing)."""
    llm = _llm(model, kernels)
    runner = llm.engine.core.executor.runner
    runner.decode_graphs = runner.static_decode(capture_sizes(MAX_NUM_SEQS))
    runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(MAX_NUM_BATCHED_TOKENS))
    return llm, runner


def _is_mixed(label: object) -> bool:
    return isinstance(label, tuple) and label[0] != label[1]


@pytest.mark.parametrize(("model", "kernels"), CASES)
def test_mixed_steps_on_static_buffers_give_the_eager_tokens_and_padding_writes_no_kv(model, kernels, monkeypatch):
    kernels = _kernels(kernels, monkeypatch)
    eager = _llm(model, kernels)
    prompts, params = _workload(eager.engine.model_config.vocab_size)
    expected = [o.output_ids for o in eager.generate(prompts, params)]

    llm, runner = _static_llm(model, kernels)
    graphs: MixedGraphs = runner.mixed_graphs
    run = graphs.run
    seen: list[tuple[int, int, int]] = []  # (live tokens, live requests, bucket) of every mixed step

    def checked_run(inputs, ahead=None):
        """The pool after the step differs from before only in the live tokens' slots; the step returns
        a logits row per request and every token's hidden states (what embedding requests pool)."""
        (logits, hidden), _ = run_checking_pool(run, runner.kv_caches, inputs, ahead)
        assert logits.shape[0] == inputs.num_requests and hidden.shape[0] >= inputs.num_tokens
        seen.append((inputs.num_tokens, inputs.num_requests, graphs.bucket(inputs.num_tokens)))
        return logits, hidden

    graphs.run = checked_run
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.steps_by_path == {"static_buffers": stats.num_iterations}  # no step ran eagerly
    assert {bucket for _, _, bucket in seen} == {16, 32}
    # Prompts joined running decodes (more requests than prompt chunks), in steps that padded.
    assert any(requests > 1 and tokens > requests for tokens, requests, _ in seen)
    assert any(tokens < bucket for tokens, _, bucket in seen)


@pytest.mark.slow
@pytest.mark.parametrize("model", [*MODELS, "mixtral-tiny"])  # Mixtral: the experts' grouped GEMMs
def test_mixed_steps_of_one_bucket_make_identical_launches_and_pass_the_capture_guard(model, monkeypatch):
    """The Triton path a GPU captures: every step of the workload, decode-only and mixed, runs under the
    capture guard, and within each bucket steps of different splits of prompt and decode tokens, and
    the all-padding step, make identical launches (grids, shapes, memory)."""
    from graph_checks import record_triton_kernels

    _kernels("triton", monkeypatch)
    record_triton_kernels(monkeypatch)
    llm, runner = _static_llm(model, "triton")
    guarded = [guard_steps(monkeypatch, runner, g) for g in (runner.mixed_graphs, runner.decode_graphs)]
    recorder = StepRecorder(runner, runner.mixed_graphs)
    prompts, params = _workload(llm.engine.model_config.vocab_size)
    llm.generate(prompts, params)
    assert not guarded[0].failures and not guarded[1].failures
    assert len(guarded[0].passed) + len(guarded[1].passed) == llm.engine.stats().num_iterations
    assert guarded[0].passed and guarded[1].passed
    recorder.record_padding()

    recordings = recorder.recordings
    assert set(recordings) == {16, 32}
    recorder.assert_identical_launches()
    splits = {label for steps in recordings.values() for label, _ in steps if _is_mixed(label)}
    assert any(len({label for label, _ in steps if _is_mixed(label)}) >= 2 for steps in recordings.values()), splits
    launched = {launch[1] for launch in recordings[32][0][1] if launch[0] == "triton"}
    assert {"_attention_kernel", "_write_kv_kernel"} <= launched, launched  # the ragged path, from the bucket


def test_the_capture_guard_fails_host_reads_and_unregistered_host_copies(monkeypatch):
    """The guard is no tautology: the CPU kernels' SDPA prefill loop (an AVX2 machine's, for requests
    of more than SHORT_QUERIES queries, here every one of more than one) reads the query lengths back
    to the host (`AttentionMetadata.host_lens`), which a GPU's graph could not capture; a planted
    .item() and a tensor built from host memory during a step fail it too; the same mixed steps
    through the C prefill kernel (AVX-512's), and the decode steps, pass it."""
    from orca_kernels import cpu_attention

    monkeypatch.setattr(cpu_attention, "SHORT_QUERIES", 1)
    monkeypatch.setattr(cpu_attention, "prefill_in_c", lambda: False)
    llm, runner = _static_llm("gpt2-tiny", "cpu")
    mixed = guard_steps(monkeypatch, runner, runner.mixed_graphs)
    prompts, params = _workload(llm.engine.model_config.vocab_size)
    with pytest.raises(RuntimeError, match="Tensor.tolist"):  # the request failed with the guard's error
        llm.generate(prompts[:2], params[:2])
    assert not mixed.passed
    assert mixed.failures and all("Tensor.tolist()" in str(e) for e in mixed.failures)
    monkeypatch.setattr(cpu_attention, "prefill_in_c", lambda: True)
    llm, runner = _static_llm("gpt2-tiny", "cpu")
    mixed = guard_steps(monkeypatch, runner, runner.mixed_graphs)
    llm.generate(prompts, params)
    assert mixed.passed and not mixed.failures
    llm, runner = _static_llm("gpt2-tiny", "cpu")
    decode = guard_steps(monkeypatch, runner, runner.decode_graphs)
    llm.generate(prompts, params)
    assert decode.passed and not decode.failures

    llm, runner = _static_llm("gpt2-tiny", "cpu")
    graphs = runner.decode_graphs
    guard = CaptureGuard(named_buffers(runner, graphs).values(), graphs.staging_buffers())
    with capture_guard(monkeypatch, guard), pytest.raises(HostReadError, match=r"Tensor.item\(\)"):
        graphs.tokens[0, 0].item()
    guard = CaptureGuard(named_buffers(runner, graphs).values(), graphs.staging_buffers())
    host = torch.arange(4)  # memory from outside the step, registered nowhere
    with capture_guard(monkeypatch, guard), pytest.raises(HostReadError, match="no registered staging buffer"):
        graphs.tokens[0, :4].copy_(host)
    with capture_guard(monkeypatch, guard):  # a step's own temporaries and the static buffers are device memory
        made = graphs.tokens[0, :4] + 1
        graphs.tokens[1, :4].copy_(made)
    guard = CaptureGuard(named_buffers(runner, graphs).values(), [host])
    with capture_guard(monkeypatch, guard):  # a registered staging buffer may be copied in
        graphs.tokens[0, :4].copy_(host)


# --- LoRA: the token->slot mapping in the static buffers -----------------------------------------

ADAPTER_OF = ["A", None, "B", None, "A", "B", None, None]  # the last decodes run no adapter (MAX_TOKENS)
ADAPTERS = {"GPT2": (["c_attn", "c_fc"], {"fan_in_fan_out": True}), "Llama": (["q_proj", "v_proj", "down_proj"], {})}


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory) -> dict[str, tuple[str, dict[str, str]]]:
    """family -> (base checkpoint, {adapter name: path}): two PEFT adapters of different ranks each."""
    pytest.importorskip("peft")
    from hf_tiny import write_lora, write_tiny

    from orca_backend.families.gpt2 import GPT2Config
    from orca_backend.model.checkpoint import write_random_checkpoint

    out = {}
    for family, (targets, extra) in ADAPTERS.items():
        root = tmp_path_factory.mktemp(family.lower())
        if family == "GPT2":
            import transformers

            config = GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
            write_random_checkpoint(root / "base", config, seed=4, tokenizer=False)
            base = transformers.GPT2LMHeadModel.from_pretrained(root / "base").eval()
        else:
            base = write_tiny(family, root / "base", seed=3)
        write_lora(base, root / "A", 1, 8, targets, **extra)
        write_lora(base, root / "B", 2, 4, targets[:1], **extra)
        out[family] = (str(root / "base"), {"A": str(root / "A"), "B": str(root / "B")})
    return out


def _lora_llm(path: str, adapters: dict[str, str], kernels: str, static: bool) -> LLM:
    llm = LLM(path, max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=1024, kernels=kernels, dtype="float32",
              max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, enable_lora=True, max_loras=2, max_lora_rank=8,
              lora_modules=adapters)  # fmt: skip
    if static:
        runner = llm.engine.core.executor.runner
        runner.decode_graphs = runner.static_decode(capture_sizes(MAX_NUM_SEQS))
        runner.mixed_graphs = runner.static_mixed(mixed_capture_sizes(MAX_NUM_BATCHED_TOKENS))
    return llm


def _lora_workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    prompts, params = _workload(vocab)
    return prompts, [dataclasses.replace(p, lora_name=name) for p, name in zip(params, ADAPTER_OF, strict=True)]


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_lora_steps_on_static_buffers_give_the_eager_tokens(family, lora_models):
    """Requests of two adapters and of none, chunked into mixed steps: every step runs on the static
    buffers (enable_lora no longer forces eager steps) and gives the eager engine's tokens."""
    path, adapters = lora_models[family]
    eager = _lora_llm(path, adapters, "cpu", static=False)
    prompts, params = _lora_workload(eager.engine.model_config.vocab_size)
    expected = [o.output_ids for o in eager.generate(prompts, params)]
    without = [o.output_ids for o in eager.generate(prompts, [dataclasses.replace(p, lora_name=None) for p in params])]
    assert [e != w for e, w in zip(expected, without, strict=True)] == [name is not None for name in ADAPTER_OF]

    llm = _lora_llm(path, adapters, "cpu", static=True)
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    stats = llm.engine.stats()
    assert stats.steps_by_path == {"static_buffers": stats.num_iterations}


@pytest.mark.slow
def test_lora_steps_of_one_bucket_make_identical_launches_and_pass_the_capture_guard(lora_models, monkeypatch):
    """The Triton path: steps with both adapters, one, or none (the last decodes), and the all-padding
    step, make identical launches within each bucket, the adapters' kernels included, under the guard."""
    from graph_checks import record_triton_kernels

    _kernels("triton", monkeypatch)
    record_triton_kernels(monkeypatch)
    path, adapters = lora_models["GPT2"]
    llm = _lora_llm(path, adapters, "triton", static=True)
    runner = llm.engine.core.executor.runner
    all_graphs = (runner.mixed_graphs, runner.decode_graphs)
    guarded = [guard_steps(monkeypatch, runner, g) for g in all_graphs]
    recorders = [StepRecorder(runner, g) for g in all_graphs]
    prompts, params = _lora_workload(llm.engine.model_config.vocab_size)
    eager = _lora_llm(path, adapters, "triton", static=False)
    assert [o.output_ids for o in llm.generate(prompts, params)] == [o.output_ids for o in eager.generate(prompts, params)]
    assert not guarded[0].failures and not guarded[1].failures
    assert len(guarded[0].passed) + len(guarded[1].passed) == llm.engine.stats().num_iterations
    for recorder in recorders:
        recorder.record_padding()
        recorder.assert_identical_launches()
        for steps in recorder.recordings.values():
            launched = {launch[1] for launch in steps[0][1] if launch[0] == "triton"}
            assert {"_shrink_kernel", "_expand_kernel"} <= launched, launched
