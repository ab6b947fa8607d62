"""The CUDA-graph path's conditions, checked on the CPU (CI has no GPU): decode steps run on the
static buffers of worker/cuda_graphs.py give the eager path's tokens for every bucket, padded rows
write no K/V, and two different batches of one bucket make identical launches — every torch op and
every C kernel call, with its shapes, strides, buffers and non-tensor arguments — which is what a
captured graph replayed for another batch relies on."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from engine_helpers import random_prompts
from graph_checks import StepRecorder, guard_steps, record_c_kernels, record_triton_kernels, run_checking_pool
from hf_tiny import write_tiny
from triton_testing import INTERPRETED, NEEDS_FRESH_PROCESS, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.model.decoder import Decoder
from orca_backend.model.gpt2 import GPT2
from orca_backend.worker.cuda_graphs import (
    EAGER_REASONS,
    PAD_SLOT,
    DecodeGraphs,
    GraphCaptureError,
    capture_sizes,
    runner_eager_reason,
)
from orca_backend.worker.model_runner import ModelRunner

# The families' presets; and two Llama-family variants written by transformers: Qwen2's biased q/k/v
# and Qwen3's q/k norm (CPU kernels only: the interpreter's time goes to the two presets).
MODELS = ["gpt2-tiny", "llama-tiny"]
VARIANTS = {"qwen2": "Qwen2", "qwen3": "Qwen3"}
# The CPU's C kernels, and the Triton kernels a GPU runs (here in Triton's interpreter).
KERNELS = ["cpu", "triton"]
# Mixtral's experts on the Triton path, whose grouped GEMMs are what a GPU captures (the CPU's reference
# loops over the experts a step chose: never captured).
# The Triton cases run the engine through the interpreter (about 100 s of the suite): `make test` runs
# them, `make test-fast` leaves them out (marked slow; tests/kernels/ checks each kernel there).
CASES = [
    pytest.param(m, k, marks=pytest.mark.slow if k == "triton" else ())
    for m, k in [(m, k) for m in MODELS for k in KERNELS] + [(v, "cpu") for v in VARIANTS] + [("mixtral-tiny", "triton")]
]


@pytest.fixture(scope="module")
def model_paths(tmp_path_factory) -> dict[str, str]:
    """Preset names as they are; the variants as checkpoints transformers writes (tiny, seeded)."""
    pytest.importorskip("transformers")
    paths = {m: m for m in (*MODELS, "mixtral-tiny")}
    for name, family in VARIANTS.items():
        path = tmp_path_factory.mktemp(name)
        write_tiny(family, path, seed=7)
        paths[name] = str(path)
    return paths
MAX_NUM_SEQS = 8


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the Triton cases run in this process")
def test_triton_cases_in_fresh_process() -> None:
    run_in_fresh_process(__file__)


def _kernels(kernels: str, monkeypatch: pytest.MonkeyPatch) -> str:
    if kernels == "triton":
        use_import_mode(monkeypatch)  # skips when this process cannot run Triton (the fresh-process test does)
        if not INTERPRETED:  # a CUDA machine: its captured graphs are tests/model/test_cuda.py's
            pytest.skip("the engines here run on the CPU, where Triton needs its interpreter")
    return kernels


def test_capture_sizes_are_powers_of_two_up_to_max_num_seqs():
    assert capture_sizes(1) == [1]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]


# Tokens each of the eight requests generates: after the prefill step the decode steps run 8, 5, 4, 3,
# 2 and 1 live rows, so every bucket (8, 4, 2, 1) runs, two of them (8 and 4) with two different
# batch sizes, and most steps pad.
MAX_TOKENS = [2, 2, 2, 3, 4, 5, 6, 7]


def _workload(vocab: int) -> tuple[list[list[int]], list[SamplingParams]]:
    """Eight requests of different lengths, greedy and seeded random, finishing as MAX_TOKENS says."""
    prompts = random_prompts(MAX_NUM_SEQS, vocab, seed=5)
    params = [
        SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.8 if i % 3 == 0 else 0.0, seed=i)
        for i, n in enumerate(MAX_TOKENS)
    ]
    return prompts, params


def _static_llm(model: str, kernels: str) -> tuple[LLM, ModelRunner]:
    llm = LLM(model, max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=1024, kernels=kernels)
    runner = llm.engine.core.executor.runner
    assert runner.decode_graphs is None  # a CPU runner runs eagerly unless a test says otherwise
    runner.decode_graphs = runner.static_decode(capture_sizes(MAX_NUM_SEQS))
    return llm, runner


@pytest.mark.parametrize(("model", "kernels"), CASES)
def test_static_decode_gives_the_eager_tokens_for_every_bucket_and_padded_rows_write_no_kv(
    model, kernels, model_paths, monkeypatch
):  # fmt: skip
    kernels, model = _kernels(kernels, monkeypatch), model_paths[model]
    eager = LLM(model, max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=1024, kernels=kernels)
    prompts, params = _workload(eager.engine.model_config.vocab_size)
    expected = [o.output_ids for o in eager.generate(prompts, params)]

    llm, runner = _static_llm(model, kernels)
    graphs: DecodeGraphs = runner.decode_graphs
    run = graphs.run
    seen: list[tuple[int, int]] = []  # (live requests, bucket) of every static step

    def checked_run(inputs, ahead=None):
        """The pool after the step differs from before only in the live rows' slots."""
        logits, before = run_checking_pool(run, runner.kv_caches, inputs, ahead)
        live_slots = torch.from_numpy(inputs.slot_mapping.reshape(-1).copy())
        for (k0, _), (k1, _) in zip(before, runner.kv_caches, strict=True):
            assert not torch.equal(k0[live_slots], k1[live_slots])  # and the live rows did write
        assert logits.shape[0] == inputs.num_requests
        seen.append((inputs.num_requests, graphs.bucket(inputs.num_requests)))
        return logits

    graphs.run = checked_run
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
    assert [live for live, _ in seen] == [8, 5, 4, 3, 2, 1]  # MAX_TOKENS' plan: every bucket, most padded
    assert [bucket for _, bucket in seen] == [8, 8, 4, 4, 2, 1]


def test_graphs_are_off_on_cpu_with_the_reason_logged(caplog):
    with caplog.at_level(logging.INFO, logger="orca.worker"):
        llm = LLM("gpt2-tiny", kv_capacity_tokens=256)
    runner = llm.engine.core.executor.runner
    assert runner.decode_graphs is None and runner.mixed_graphs is None
    assert "steps run eagerly: CUDA graphs need a CUDA device" in caplog.text
    with caplog.at_level(logging.INFO, logger="orca.worker"):
        LLM("gpt2-tiny", kv_capacity_tokens=256, enforce_eager=True)
    assert "steps run eagerly: enforce_eager is set" in caplog.text
    with pytest.raises(RuntimeError, match="captured on a CUDA device"):
        llm.engine.core.executor.runner.static_decode([1, 2]).capture()


# --- launch recording ---------------------------------------------------------------------------


@pytest.mark.parametrize(("model", "kernels"), CASES)
def test_two_batches_of_one_bucket_make_identical_launches(model, kernels, model_paths, monkeypatch):
    """Every decode step of the workload is recorded; within each bucket, batches with different
    live rows, tokens and contexts, and the all-padding batch its capture records, must make the same
    launches, and none reads a value back to the host or copies host memory in (a CUDA graph cannot
    capture that: the capture guard fails the step)."""
    kernels, model = _kernels(kernels, monkeypatch), model_paths[model]
    # The CPU set stands in for a GPU's launches op by op: its one-call C decode step
    # (cpu_decoder_step.py) runs on CPU only, where no step is captured.
    monkeypatch.setattr(Decoder, "cpu_step", None)
    monkeypatch.setattr(GPT2, "cpu_step", None)
    c_kernels = record_c_kernels(monkeypatch)
    triton_kernels = record_triton_kernels(monkeypatch) if kernels == "triton" else False
    llm, runner = _static_llm(model, kernels)
    graphs: DecodeGraphs = runner.decode_graphs
    guarded = guard_steps(monkeypatch, runner, graphs)
    recorder = StepRecorder(runner, graphs)
    prompts, params = _workload(llm.engine.model_config.vocab_size)
    llm.generate(prompts, params)
    recorder.record_padding()

    recordings = recorder.recordings
    assert set(recordings) == {1, 2, 4, 8}
    assert not guarded.failures and len(guarded.passed) == 6  # every decode step passed the capture guard
    recorder.assert_identical_launches()
    assert all(steps[-1][0] == "padding" for steps in recordings.values())
    # At least two buckets compared live batches of different sizes.
    assert sum(len({label for label, _ in steps}) > 2 for steps in recordings.values()) >= 2
    # The kernels themselves were recorded: on the CPU path the C decode attention and K/V write
    # (whenever a compiler built them), on the Triton path every Triton launch with its grid.
    kinds = {(launch[0], launch[1]) for launch in recordings[8][0][1]}
    if kernels == "cpu" and c_kernels:
        assert {("c", "orca_kernels.cpu_attention.load_decode_kernel"),
                ("c", "orca_kernels.cpu_attention.load_write_kv_kernel")} <= kinds  # fmt: skip
    if triton_kernels:
        # The decode kernels, the K/V write (and the Llama family's rotary) fused into them.
        launched = {name for kind, name in kinds if kind == "triton"}
        assert {"_decode_split_kernel", "_decode_reduce_kernel"} <= launched, launched
        assert not {"_write_kv_kernel", "_rotary_kernel"} & launched, launched
    assert PAD_SLOT == -1


# --- how each step ran: counted, logged, and never a silent eager --------------------------------


def test_the_runners_eager_reasons():
    """Why a runner replays no graph, in order of precedence; "" where steps are captured (LoRA engines'
    included: their token->slot mapping is in the static buffers)."""
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert runner_eager_reason(False, cuda, False, "triton") == ""
    assert runner_eager_reason(True, cuda, False, "triton") == "enforce_eager"
    assert runner_eager_reason(False, cpu, False, "cpu") == "no_cuda_device"
    assert runner_eager_reason(False, cuda, True, "triton") == "pipeline_parallel"
    assert runner_eager_reason(False, cuda, False, "torch") == "torch_kernels"
    assert set(EAGER_REASONS) >= {"tokens_above_buckets", "batch_above_buckets", "static_buffers"}
    assert not {"mixed_step", "lora"} & set(EAGER_REASONS)  # steps with prompt tokens or adapters replay graphs too


def test_every_step_is_counted_and_logged_by_how_its_forward_ran(tmp_path):
    """engine.stats().steps_by_path counts every iteration once, under the reason its forward ran as it
    did; the iteration log writes the same path on each line, and worker processes report theirs."""
    log = tmp_path / "iterations.jsonl"
    llm = LLM("gpt2-tiny", max_num_seqs=MAX_NUM_SEQS, kv_capacity_tokens=1024, iteration_log=str(log))
    prompts, params = _workload(llm.engine.model_config.vocab_size)
    llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats.steps_by_path == {"no_cuda_device": stats.num_iterations} and stats.num_iterations > 1
    llm.shutdown()
    lines = [json.loads(line) for line in log.read_text().splitlines() if '"iteration"' in line]
    assert len(lines) == stats.num_iterations and {line["step_path"] for line in lines} == {"no_cuda_device"}

    # The static buffers (a GPU's path, eager here): every step that fits a bucket runs on them; the
    # prefill of all eight prompts is more tokens than the one mixed bucket (16) and says so.
    llm, runner = _static_llm("gpt2-tiny", "cpu")
    runner.mixed_graphs = runner.static_mixed([16])
    llm.generate(prompts, params)
    stats = llm.engine.stats()
    assert stats.steps_by_path == {"static_buffers": 6, "tokens_above_buckets": 1}  # MAX_TOKENS' plan
    eager = LLM("gpt2-tiny", kv_capacity_tokens=256, enforce_eager=True)
    eager.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert eager.engine.stats().steps_by_path == {"enforce_eager": 3}
    with LLM("gpt2-tiny", kv_capacity_tokens=256, tensor_parallel_size=2) as tp2:
        tp2.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))
        # The sampling worker's path crossed its control pipe (an empty path would read as "").
        assert tp2.engine.stats().steps_by_path == {"no_cuda_device": 3}


def test_a_capture_failure_is_a_load_error_naming_the_batch_size(monkeypatch):
    """What a failed capture becomes (the capture itself needs a GPU: tests/model/test_cuda.py plants
    one there): an error naming the batch size, the error and enforce_eager; an allocation failure,
    torch's or cuBLAS's, also says to lower the K/V pool or max_num_seqs."""
    llm = LLM("gpt2-tiny", kv_capacity_tokens=256)
    runner = llm.engine.core.executor.runner

    def plant(cause):
        def capture(self, pool=None):
            raise GraphCaptureError("decode steps of batch size 4", cause) from cause
        monkeypatch.setattr(DecodeGraphs, "capture", capture)

    plant(ValueError("boom"))
    with pytest.raises(RuntimeError, match=r"batch size 4 failed: ValueError: boom; set enforce_eager") as info:
        runner._capture(runner.static_decode([1, 2, 4]))
    assert isinstance(info.value.__cause__, ValueError)
    plant(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    with pytest.raises(RuntimeError, match=r"batch size 4 failed: .*ALLOC_FAILED.*out of GPU memory.*lower kv_capacity_tokens"):
        runner._capture(runner.static_decode([1, 2, 4]))
