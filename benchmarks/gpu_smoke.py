"""GPU smoke: the first command to run on a lent GPU. Each stage runs in its own process under its own
timeout (a hung CUDA kernel cannot be interrupted from inside its process), and what it measured
lands in --out as it goes, so a run cut short still leaves every stage that ended.

    python benchmarks/gpu_smoke.py --out gpu_results             # every stage (needs CUDA)
    python benchmarks/gpu_smoke.py --stages env,graphs           # some of them
    python benchmarks/gpu_smoke.py --device cpu --quick --out DIR   # the plumbing on a CPU (CI)

Stages, in the order they run, with their seconds on one H200 (2026-11-30, docs/bench/gpu/smoke-2026-11-30
run 1, every stage passed: 3.6 minutes in all; the norm + GEMM tests joined since). `make gpu-smoke` adds the package's
install (~10-20 s) before them; the run's own budget (--budget-s, 380 s) cuts every timeout to what is
left of it, so the whole stays under 7 minutes.

| stage            | what                                                                | H200     | timeout |
|------------------|---------------------------------------------------------------------|----------|---------|
| env              | versions, the device, nvidia-smi's clocks and memory                | 8 s      | 60 s    |
| kernel_tests     | the kernel tests never run compiled (norm + GEMM, split-K decode    | 89 s     | 170 s   |
|                  | with the fused K/V write and rotary, windows, FP8, LoRA, MoE,       |          |         |
|                  | int4/int8) and the                                                  |          |         |
|                  | engine's CUDA-graph, async, FP8, MoE, window and LoRA token tests   |          |         |
| graphs           | both models graphed at max_num_seqs 256, the K/V pool sized from    | 62 s     | 120 s   |
|                  | gpu_memory_utilization 0.9: every bucket captured (a                |          |         |
|                  | failure fails the stage), decode steps replay graphs, per-bucket    |          |         |
|                  | replay time (CUDA events), graph pool memory, capture seconds, one  |          |         |
|                  | profiler trace per model of a bucket-1 and a bucket-64 replay       |          |         |
| decode_throughput| the first graph model decoding 256 requests of 900-token prompts   | 10 s     | 90 s    |
|                  | (graphs, async scheduling: the defaults), 64 steps timed: tok/s     |          |         |
| host_time        | issue #41's host targets, 64 requests decoding: a mixed step's host | not run  | 60 s    |
|                  | time (a 512-token prompt joining every step; synchronous steps, the |          |         |
|                  | step's wall time minus its GPU busy time), and GPU idle under       |          |         |
|                  | sampled traffic (temperature, top-p/k, penalties; async scheduling) |          |         |
| decode_attention | the fused decode-attention launch at real shapes (MHA 16x64, GQA    | 22 s     | 60 s    |
|                  | 14/2x64; batch 1, 64, 256; context 1k, 8k) against a copy of the    |          |         |
|                  | same bytes, device time from CUDA-graph replays, and one eager call |          |         |
| int4_gemm        | the int4 dequantizing GEMM and the W8A8 GEMMs against cuBLAS over   | 9 s      | 45 s    |
|                  | the same weight dequantized, decode and prefill token counts        |          |         |
| triton_compile   | each Triton kernel's first call minus its warm call, on an empty    | 15 s     | 60 s    |
|                  | Triton cache                                                        |          |         |
| served           | serving_cost.py on the host CPUs: 256 and 1,024 streams, 1, 4 and 8 | not run  | 90 s    |
|                  | instances over one core (only where tritonserver's wheels are here) |          |         |
| total            |                                                                     | 3.6 min  | 380 s   |

Files in --out (six: a lent machine sends back eight at most): smoke.json (every stage's status,
seconds and result, rewritten as each stage reports), smoke.log (every stage's output as it prints),
summary.md, trace-<model>.json.gz (the graphs stage's chrome traces; open in Perfetto) and
serving-cost.json (the served stage's raw figures).
Exit status: 0 when every stage passed, 1 when one failed, timed out or was not run (summary.md
says which), 2 without a CUDA device.

--device cpu --quick runs every stage on tiny settings as CI does (tests/benchmarks/test_gpu_smoke.py):
the kernel tests are only collected (their node ids must exist), the graphs run the static-buffer
decode path eagerly (nothing is captured), decode attention runs the C kernels and the compile
stage Triton's interpreter; the figures prove the code paths, not a GPU's.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gzip
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
ROOT = BENCH_DIR.parent

# What a stage's process is given: the parsed arguments, and `report`, which writes a partial result
# the runner picks up while the stage runs (kept if the stage is then killed).
Report = Callable[[dict[str, Any]], None]


@dataclass(frozen=True)
class Stage:
    name: str
    what: str
    timeout_s: float
    run: Callable[[argparse.Namespace, Report], dict[str, Any]]
    # Its part of summary.md, from its result; none: the stage table's line alone.
    render: Callable[[dict[str, Any]], list[str]] | None = None


def load_gpu_check() -> ModuleType:
    """benchmarks/gpu_check.py, whose timing helpers and workloads the stages share. Loaded inside a
    stage's process only: the runner stays free of torch, so a stage's process starts quickly."""
    import importlib.util

    name = "orca_bench_gpu_check"
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# -------------------------------------------------------------------------------------- the runner
def stage_env(args: argparse.Namespace) -> dict[str, str]:
    """A stage's environment: unbuffered output (a killed stage's last lines reach the log). Off CUDA,
    Triton only in its interpreter (set before the stage's process imports triton), and one torch
    thread: OpenMP threads spin against whatever else shares a small CI machine."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.device == "cpu":
        env |= {"TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    return env


def run_stages(
    stages: list[Stage], args: argparse.Namespace, argv: list[str], script: Path
) -> dict[str, Any]:  # fmt: skip
    """Runs each stage as `script --stage NAME` in a process group of its own, killed at its timeout
    (or at the end of the run's budget, whichever comes first); rewrites smoke.json and summary.md
    whenever a stage reports and when it ends. Returns the run's record."""
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "smoke.log"
    log_path.write_text("")
    run: dict[str, Any] = {
        "command": " ".join(["benchmarks/gpu_smoke.py", *argv]),
        "device": args.device,
        "budget_s": args.budget_s,
        "stages": {s.name: {"status": "pending", "what": s.what, "timeout_s": s.timeout_s} for s in stages},
    }
    write_record(run, stages, out)
    deadline = time.monotonic() + args.budget_s
    work = Path(tempfile.mkdtemp(prefix="gpu_smoke_"))  # the stages' result files, outside --out
    try:
        for stage in stages:
            record = run["stages"][stage.name]
            timeout = min(stage.timeout_s, deadline - time.monotonic())
            if timeout <= 0:
                record |= {"status": "not run", "why": f"the run's budget of {args.budget_s:g} s was spent"}
                write_record(run, stages, out)
                continue

            def on_report(partial: dict[str, Any], record: dict[str, Any] = record) -> None:
                record.update(partial)
                write_record(run, stages, out)

            on_report({"status": "running"})  # a run killed now says which stage it was in
            record |= run_stage(
                stage, args, argv, script, work / f"{stage.name}.json", timeout, log_path, on_report
            )
            write_record(run, stages, out)
            print(f"== {stage.name}: {describe(record)}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return run


def run_stage(
    stage: Stage, args: argparse.Namespace, argv: list[str], script: Path, result_path: Path, timeout: float,
    log_path: Path, on_report: Callable[[dict[str, Any]], None],
) -> dict[str, Any]:  # fmt: skip
    """One stage's process, its output appended to the log as it prints. While it runs, each new
    partial result it reports goes to `on_report`; at its timeout its whole process group (pytest's
    workers too) is killed. Returns the stage's record: status, seconds, exit code, result."""
    command = [sys.executable, str(script), *argv, "--stage", stage.name, "--result", str(result_path)]
    with log_path.open("a") as log:
        log.write(f"\n===== {stage.name} (timeout {timeout:.0f} s): {stage.what}\n")
        log.flush()
        started = time.monotonic()
        proc = subprocess.Popen(command, cwd=ROOT, env=stage_env(args), stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)  # fmt: skip
        seen = None
        timed_out = False
        while True:
            try:
                proc.wait(timeout=0.5)
                break
            except subprocess.TimeoutExpired:
                pass
            seen = pick_up(result_path, seen, on_report)
            if time.monotonic() - started >= timeout:
                kill_group(proc.pid)
                proc.wait()
                timed_out = True
                break
        seconds = time.monotonic() - started
        kill_group(proc.pid)  # whatever the stage left running (pytest's workers, say)
        if timed_out:
            log.write(f"\n===== {stage.name}: killed at its timeout of {timeout:.0f} s\n")
    record: dict[str, Any] = {"seconds": seconds, "returncode": proc.returncode, "timeout_s": timeout}
    result = read_result(result_path)
    if result is not None:
        record["result"] = result
    if timed_out:
        record["status"] = "timeout"
        record["why"] = f"killed after {timeout:.0f} s (its result is what it had reported by then)"
    elif proc.returncode == 0:
        record["status"] = "passed"
    else:
        record["status"] = "failed"
        record["why"] = stage_errors(result) or f"exit status {proc.returncode} (see smoke.log)"
    return record


def kill_group(pgid: int) -> None:
    """SIGKILL to the process group this runner started for a stage (start_new_session), if any
    process of it is left."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)


def pick_up(path: Path, seen: float | None, on_report: Callable[[dict[str, Any]], None]) -> float | None:
    """Hands a partial result the stage wrote since `seen` (its file's mtime) to on_report."""
    try:
        mtime = path.stat().st_mtime
    except FileNotFoundError:
        return seen
    if mtime != seen and (result := read_result(path)) is not None:
        on_report({"status": "running", "result": result})
    return mtime


def read_result(path: Path) -> dict[str, Any] | None:
    try:
        return json.loads(path.read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def write_json(path: Path, value: Any) -> None:
    """Written whole or not at all: a reader (or a kill) never sees half a file."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(value, indent=2, default=str))
    os.replace(tmp, path)


def stage_errors(result: dict[str, Any] | None) -> str:
    if not result:
        return ""
    return "; ".join(result.get("errors", []))


def describe(record: dict[str, Any]) -> str:
    text = record["status"]
    if "seconds" in record:
        text += f" in {record['seconds']:.1f} s"
    if "why" in record:
        text += f": {record['why']}"
    return text


def write_record(run: dict[str, Any], stages: list[Stage], out: Path) -> None:
    write_json(out / "smoke.json", run)
    tmp = out / "summary.md.tmp"
    tmp.write_text(render_summary(run, stages))
    os.replace(tmp, out / "summary.md")


def render_summary(run: dict[str, Any], stages: list[Stage]) -> str:
    records = run["stages"]
    bad = [name for name, r in records.items() if r["status"] not in ("passed", "pending", "running")]
    lines = [f"# GPU smoke ({run['device']})", "", f"`{run['command']}`", ""]
    if run["device"] != "cuda":
        lines += ["**Not a GPU run**: the stages' figures prove the code paths, not a GPU's.", ""]
    if bad:
        lines += [f"**Not passed: {', '.join(bad)}.**", ""]
    lines += ["| stage | status | seconds | timeout s | what |", "|---|---|---|---|---|"]
    for name, r in records.items():
        seconds = f"{r['seconds']:.1f}" if "seconds" in r else "-"
        status = r["status"] + (f": {r['why']}" if "why" in r else "")
        lines.append(f"| {name} | {status} | {seconds} | {r['timeout_s']:.0f} | {r['what']} |")
    lines.append("")
    for stage in stages:
        result = records[stage.name].get("result")
        if stage.render is not None and result:
            try:
                lines += stage.render(result)
            except Exception as exc:  # a partial result may lack what the renderer reads
                lines += [f"## {stage.name}", "", f"(not rendered: {exc!r}; see smoke.json)", ""]
    return "\n".join(lines)


def run_one_stage(stage: Stage, args: argparse.Namespace) -> int:
    """In a stage's own process: runs it, writes its result; exit status 1 when it failed."""
    path = Path(args.result)
    try:
        result = stage.run(args, lambda partial: write_json(path, partial))
    except Exception as exc:  # what it had reported stays, with the error beside it
        traceback.print_exc()
        last = read_result(path) or {}
        write_json(path, {**last, "errors": [*last.get("errors", []), f"{type(exc).__name__}: {exc}"]})
        return 1
    write_json(path, result)
    if result.get("errors"):
        print(f"{stage.name} failed: " + "; ".join(result["errors"]), file=sys.stderr)
        return 1
    return 0


# ------------------------------------------------------------------------------------------ stages
NVIDIA_SMI_FIELDS = ("name", "driver_version", "pstate", "clocks.sm", "clocks.mem", "clocks.max.sm", "clocks.max.mem",
                     "memory.total", "memory.used", "memory.free", "temperature.gpu", "power.draw", "power.limit")  # fmt: skip


def run_env(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    import platform

    import torch
    import triton

    from orca_client import machine

    result: dict[str, Any] = {
        "python": platform.python_version(), "torch": torch.__version__, "torch_cuda": torch.version.cuda,
        "triton": triton.__version__, "commit": machine.code_revision(ROOT), "host_cpu": machine.summary(),
        "errors": [],
    }  # fmt: skip
    try:
        import transformers

        result["transformers"] = transformers.__version__
    except ImportError as exc:  # the engine tests' oracle: kernel_tests will skip them, and fail for it
        result["transformers"] = f"missing ({exc})"
    if args.device == "cuda":
        props = torch.cuda.get_device_properties(0)
        free, total = torch.cuda.mem_get_info(0)
        result["device"] = {
            "name": props.name, "capability": f"{props.major}.{props.minor}", "sms": props.multi_processor_count,
            "memory_gib": total / 2**30, "free_gib": free / 2**30,
        }  # fmt: skip
    smi = shutil.which("nvidia-smi")
    if smi is None:
        result["nvidia_smi"] = {"skipped": "nvidia-smi is not on the PATH"}
        if args.device == "cuda":
            result["errors"].append("nvidia-smi is not on the PATH: no clocks or memory to report")
        return result
    query = [smi, f"--query-gpu={','.join(NVIDIA_SMI_FIELDS)}", "--format=csv,noheader"]
    proc = subprocess.run(query, capture_output=True, text=True, timeout=30)
    if proc.returncode != 0:
        result["nvidia_smi"] = {"error": (proc.stdout + proc.stderr).strip()}
        result["errors"].append(f"nvidia-smi failed: {result['nvidia_smi']['error'][:200]}")
        return result
    result["nvidia_smi"] = [dict(zip(NVIDIA_SMI_FIELDS, (v.strip() for v in line.split(",")), strict=True))
                            for line in proc.stdout.strip().splitlines()]  # fmt: skip
    return result


def render_env(r: dict[str, Any]) -> list[str]:
    lines = ["## Environment", "", f"torch {r['torch']} (CUDA {r['torch_cuda']}), triton {r['triton']}, "
             f"transformers {r.get('transformers')}, Python {r['python']}; commit {r['commit']}; host {r['host_cpu']}."]  # fmt: skip
    if "device" in r:
        d = r["device"]
        lines.append(f"Device: {d['name']} (sm_{d['capability'].replace('.', '')}, {d['sms']} SMs, "
                     f"{d['memory_gib']:.1f} GiB, {d['free_gib']:.1f} free).")  # fmt: skip
    smi = r.get("nvidia_smi")
    if isinstance(smi, list):
        lines += ["", "| " + " | ".join(NVIDIA_SMI_FIELDS) + " |", "|" + "---|" * len(NVIDIA_SMI_FIELDS)]
        lines += ["| " + " | ".join(gpu[f] for f in NVIDIA_SMI_FIELDS) + " |" for gpu in smi]
    elif smi:
        lines.append(f"nvidia-smi: {smi}.")
    return [*lines, ""]


# The tests that have never run compiled on a GPU (issue #41): the fused norm + GEMM, the split-K decode
# kernels with the fused K/V write and rotary, the windowed kernels, FP8, multi-LoRA and the MoE grouped
# GEMM, and the engine on CUDA for CUDA graphs (a draft model's and an EAGLE head's passes and
# embedding steps too), async scheduling and the families that use those kernels. The `*_in_fresh_process` tests (-k) only rerun a
# file under the interpreter on a CPU.
SMOKE_TESTS = [
    "tests/kernels/test_norm_linear.py",
    "tests/kernels/test_triton_decode_attention.py",
    "tests/kernels/test_triton_window_attention.py",
    "tests/kernels/test_lora_kernels.py",
    "tests/model/test_fp8.py::test_fp8_linear_triton_equals_the_reference",
    "tests/model/test_int_quant.py::test_int_linear_triton_equals_the_reference",
    "tests/model/test_moe.py::test_moe_triton_equals_the_reference",
    "tests/model/test_moe.py::test_moe_align_places_every_pair_once_in_its_experts_run",
    "tests/model/test_cuda.py::test_cuda_graph_tokens_equal_eager",
    "tests/model/test_cuda.py::test_a_capture_failure_fails_the_load_naming_the_batch_size",
    "tests/model/test_cuda.py::test_async_scheduling_tokens_equal_sync",
    "tests/model/test_cuda.py::test_gpt2_mlp_epilogue_is_gelu_tanh",
    "tests/model/test_cuda.py::test_fp8_checkpoint_on_cuda_keeps_fp8_weights_and_the_cpus_tokens",
    "tests/model/test_cuda.py::test_gptq_checkpoint_on_cuda_keeps_int4_weights_and_the_cpus_tokens",
    "tests/model/test_cuda.py::test_mixtral_on_cuda_equals_the_cpu",
    "tests/model/test_cuda.py::test_windowed_families_on_cuda_equal_transformers",
    "tests/model/test_cuda.py::test_mixed_lora_adapters_on_cuda_equal_peft_merged",
    "tests/model/test_cuda.py::test_draft_model_passes_replay_graphs_and_keep_the_tokens",
    "tests/model/test_cuda.py::test_eagle_head_passes_replay_graphs_and_keep_the_tokens",
    "tests/model/test_cuda.py::test_embedding_steps_replay_mixed_graphs_and_pool_the_eager_vectors",
]


class TestOutcomes:
    """A pytest plugin that keeps each test's outcome (on xdist's controller too)."""

    __test__ = False  # not a test class

    def __init__(self) -> None:
        self.collected: list[str] = []
        self.passed: list[str] = []
        self.failed: list[str] = []
        self.skipped: list[str] = []

    def pytest_collection_finish(self, session: Any) -> None:
        self.collected = [item.nodeid for item in session.items]

    def pytest_runtest_logreport(self, report: Any) -> None:
        if report.failed:
            self.failed.append(f"{report.nodeid} ({report.when})")
        elif report.skipped:
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else str(report.longrepr)
            self.skipped.append(f"{report.nodeid}: {reason}")
        elif report.when == "call":
            self.passed.append(report.nodeid)


def run_kernel_tests(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """On CUDA the tests, on 8 pytest-xdist workers where installed (each with 2 CPU threads, as
    `make gpu-check-tests`); a test skipped there ran nothing, and fails the stage. Off CUDA they are
    only collected: every node id must still name a test."""
    import pytest

    collect_only = args.device != "cuda"
    options = ["-q", "-p", "no:cacheprovider", "-rfEs", "--durations=10", "-k", "not fresh_process"]
    if collect_only:
        options.append("--collect-only")
    else:
        os.environ.setdefault("OMP_NUM_THREADS", "2")  # the workers inherit it
        try:
            import xdist  # noqa: F401

            options += ["-n", "8"]
        except ImportError:
            print("pytest-xdist is not installed: the tests run in one process", flush=True)
    outcomes = TestOutcomes()
    code = pytest.main([*options, *SMOKE_TESTS], plugins=[outcomes])
    result: dict[str, Any] = {
        "mode": "collected only (no CUDA)" if collect_only else "run", "tests": SMOKE_TESTS,
        "exit_code": int(code), "errors": [],
    }  # fmt: skip
    if collect_only:
        result["collected"] = len(outcomes.collected)
        if code != 0 or not outcomes.collected:
            result["errors"].append(f"pytest could not collect every test (exit status {int(code)})")
        return result
    result |= {"passed": len(outcomes.passed), "failed": outcomes.failed, "skipped": outcomes.skipped}
    if code != 0:
        result["errors"].append(f"pytest exit status {int(code)}: {len(outcomes.failed)} failed")
    if outcomes.skipped:
        result["errors"].append(
            f"{len(outcomes.skipped)} skipped on the GPU, so never run: {outcomes.skipped[:3]}"
        )
    return result


def render_kernel_tests(r: dict[str, Any]) -> list[str]:
    lines = ["## Kernel tests", ""]
    if "collected" in r:
        return [*lines, f"{r['mode']}: {r['collected']} tests collected from {len(r['tests'])} node ids.", ""]
    lines.append(
        f"{r.get('passed', 0)} passed, {len(r.get('failed', []))} failed, {len(r.get('skipped', []))} skipped."
    )
    lines += [f"- failed: `{t}`" for t in r.get("failed", [])] + [
        f"- skipped: `{t}`" for t in r.get("skipped", [])
    ]
    return [*lines, ""]


def safe_name(model: str) -> str:
    """A model name (or checkpoint path) as a file name the device tool brings back."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", Path(model).name)


def run_graphs(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """Each of --graph-models graphed, one engine at a time (iteration- and request-level scheduling
    run the same runner, so one engine covers both)."""
    result: dict[str, Any] = {"models": {}, "errors": []}
    for model in args.graph_models:
        try:
            result["models"][model] = graph_model(args, model)
        except Exception as exc:  # this model's failure is reported; the other model still runs
            traceback.print_exc()
            result["errors"].append(f"{model}: {type(exc).__name__}: {exc}")
        # The engine's cycles freed and torch's cache emptied: the next engine sizes its K/V pool from
        # the device's free memory (worker/kv_pool.py), which must not still hold this one's.
        load_gpu_check().release(None)
        report(result)
    return result


def graph_model(args: argparse.Namespace, model: str) -> dict[str, Any]:
    """One model's engine at --graph-max-seqs: built (on CUDA a capture failure fails the load, so
    this raises), every bucket's graph present, staggered requests whose decode steps must all replay
    a graph, then a full batch whose buffers every bucket's graph replays (CUDA events), and one
    profiler trace of the bucket-1 and bucket-64 replays."""
    import torch

    from orca_backend import LLM, SamplingParams
    from orca_backend.worker.cuda_graphs import (
        EAGER_REASONS,
        GRAPH_REPLAYED,
        StepGraphs,
        capture_sizes,
        mixed_capture_sizes,
    )

    gpu_check = load_gpu_check()
    device = torch.device(args.device)
    sizes = capture_sizes(args.graph_max_seqs)
    mixed_sizes = mixed_capture_sizes(0)
    prompt_len, max_tokens = 32, 32
    # Blocks for a full batch's requests at their longest, with one to spare each (16-token blocks).
    kv_tokens = args.graph_max_seqs * (-(-(prompt_len + max_tokens) // 16) + 1) * 16
    captures: dict[str, float] = {}  # graphs' kind -> its capture's own seconds, beside the build's
    capture = StepGraphs.capture

    def timed_capture(graphs: StepGraphs, pool: Any = None) -> None:
        started = time.perf_counter()
        capture(graphs, pool)
        captures[type(graphs).__name__] = time.perf_counter() - started

    StepGraphs.capture = timed_capture  # type: ignore[method-assign]
    try:
        started = time.perf_counter()
        # On a GPU the pool takes what 0.9 of its memory leaves (worker/kv_pool.py), as vLLM's default
        # does; a CPU ignores it and takes kv_tokens. Steps synchronous: the stage counts each step's
        # tokens as it returns (async scheduling, on by default on CUDA, hands them over a step later).
        llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=args.graph_max_seqs,
                  kv_capacity_tokens=kv_tokens, gpu_memory_utilization=KV_POOL_UTILIZATION,
                  async_scheduling=False)  # fmt: skip
        build_s = time.perf_counter() - started
    finally:
        StepGraphs.capture = capture  # type: ignore[method-assign]
    try:
        runner = llm.engine.core.executor.runner
        config = llm.engine.config
        pool = {"gpu_memory_utilization": KV_POOL_UTILIZATION if config.sizes_kv_pool_from_memory() else None,
                "tokens": config.kv_capacity_tokens,
                "gib": config.kv_capacity_tokens * config.kv_bytes_per_token(llm.engine.model_config) / 2**30}  # fmt: skip
        result: dict[str, Any] = {"model": model, "dtype": args.dtype, "max_num_seqs": args.graph_max_seqs,
                                  "capture_sizes": sizes, "build_s": build_s, "prompt_tokens": prompt_len,
                                  "kv_pool": pool}  # fmt: skip
        if device.type == "cuda":
            graphs, mixed = runner.decode_graphs, runner.mixed_graphs
            if graphs is None or mixed is None:
                raise RuntimeError(f"no CUDA graphs: {EAGER_REASONS[runner.eager_reason]}")
            for kind, wanted, got in (("decode", sizes, graphs.graphs), ("mixed", mixed_sizes, mixed.graphs)):
                missing = [s for s in wanted if s not in got]
                if missing:
                    raise RuntimeError(f"{kind} buckets {missing} of {wanted} have no graph (captured: {sorted(got)})")
            path = GRAPH_REPLAYED
            result |= {"mode": "captured", "capture_s": captures, "mixed_sizes": mixed_sizes,
                       "graph_pool_mib": (graphs.graph_bytes + mixed.graph_bytes) / 2**20,
                       "reserved_gib": torch.cuda.memory_reserved(device) / 2**30}  # fmt: skip
        else:  # the forward a graph would replay, run eagerly on the same static buffers
            graphs = runner.decode_graphs = runner.static_decode(sizes)
            runner.mixed_graphs = runner.static_mixed(mixed_sizes)
            path = "static_buffers"
            result |= {
                "mode": "static",
                "note": f"no CUDA graph on {device.type}: the static-buffer forward, eagerly",
            }
        engine = llm.engine
        # Requests ending one after another (4, 8, ... tokens): the decode batch shrinks through the buckets.
        n = min(16, args.graph_max_seqs)
        prompts, params = gpu_check.token_workload(engine.model_config.vocab_size, n, 16, seed=0)
        llm.generate(prompts, params)
        paths = engine.stats().steps_by_path
        result["steps_by_path"] = dict(paths)
        if set(paths) != {path}:  # prompt steps too: mixed steps replay graphs of their own
            raise RuntimeError(f"steps did not all run on {path}: {dict(paths)}")
        # A full batch decoding: its step leaves every row of the static buffers live, so each bucket's
        # graph replays real requests (replaying recomputes that step: the same K/V to the same slots).
        full = args.graph_max_seqs
        prompts = [
            [1 + (i * 7 + j) % (engine.model_config.vocab_size - 1) for j in range(prompt_len)]
            for i in range(full)
        ]
        tokens = [0]

        def on_output(out: Any) -> None:
            tokens[0] += len(out.new_token_ids)

        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        streams = engine.add_requests(prompts, params, on_output=on_output)
        try:
            for _ in range(max_tokens // 2):  # the prefill (in chunks if it must), then one decode-only step
                before, tokens_before = engine.stats().steps_by_path.get(path, 0), tokens[0]
                engine.step()
                if engine.stats().steps_by_path.get(path, 0) > before:
                    break
            else:
                raise RuntimeError(f"no decode-only step of {full} requests ran on {path}")
            if tokens[0] - tokens_before != full:
                raise RuntimeError(
                    f"the decode-only step gave {tokens[0] - tokens_before} tokens, not {full}"
                )
            gpu_check.sync(device)

            def replay(size: int) -> Callable[[], object]:
                if device.type == "cuda":
                    return graphs.graphs[size].replay
                return lambda: graphs.forward(*graphs.views(size))

            result["replay_ms"] = {str(s): gpu_check.median_seconds(replay(s), device, reps=args.replay_reps) * 1e3
                                   for s in sizes}  # fmt: skip
            result["trace"] = trace_replays(
                args, device, model, {s: replay(s) for s in traced_buckets(sizes)}
            )
            # #41's count: kernels a decoder layer launches (the step's over its layers, the LM head and
            # the embedding included, so a little over the layer's own).
            layers = engine.model_config.num_layers
            result["kernels_per_layer"] = {b: n / layers for b, n in result["trace"].get("device_events_per_replay", {}).items()}
        finally:
            for s in streams:
                engine.abort_request(s.request_id)
            gpu_check.drain(llm)
        return result
    finally:
        llm.shutdown()
        del llm
        gpu_check.release(None)


KV_POOL_UTILIZATION = 0.9  # the graphs stage's engines: vLLM's default share of the GPU


def traced_buckets(sizes: list[int]) -> list[int]:
    """Bucket 1 and bucket 64 (the largest bucket up to 64 where max_num_seqs is smaller)."""
    return sorted({1, max(s for s in sizes if s <= 64)})


def trace_replays(
    args: argparse.Namespace, device: Any, model: str, replays: dict[int, Callable[[], object]]
) -> dict[str, Any]:  # fmt: skip
    """One torch.profiler session over one replay of each bucket (after a warm-up replay), each in a
    range named after it; the chrome trace goes to --out gzipped."""
    import torch
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile, record_function

    for fn in replays.values():
        fn()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for size, fn in replays.items():
            with record_function(f"gpu_smoke.replay_bucket_{size}"):
                fn()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
    path = Path(args.out) / f"trace-{safe_name(model)}.json.gz"
    with tempfile.TemporaryDirectory() as tmp:
        raw = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(path, "wb") as dst:
            shutil.copyfileobj(src, dst)
    kernels = [e for e in prof.events() if e.device_type == DeviceType.CUDA]
    result: dict[str, Any] = {"file": path.name, "buckets": list(replays), "device_events": len(kernels)}
    if device.type == "cuda":  # each bucket's replay on its own: how many kernels one step launches
        per_replay = {}
        for size, fn in replays.items():
            with profile(activities=[ProfilerActivity.CUDA]) as one:
                fn()
                torch.cuda.synchronize(device)
            per_replay[str(size)] = sum(e.device_type == DeviceType.CUDA for e in one.events())
        result["device_events_per_replay"] = per_replay
    return result


def render_graphs(r: dict[str, Any]) -> list[str]:
    lines = ["## CUDA graphs", ""]
    for model, m in r["models"].items():
        lines.append(f"**{model}** ({m['dtype']}, max_num_seqs {m['max_num_seqs']}): {m['mode']}; engine built in "
                     f"{m['build_s']:.1f} s" + (f", capture {sum(m['capture_s'].values()):.1f} s, graph pool {m['graph_pool_mib']:.0f} MiB"
                                                  if "capture_s" in m else "") + f"; steps by path {m['steps_by_path']}; "
                     f"trace {m['trace']['file']} (buckets {m['trace']['buckets']}, {m['trace']['device_events']} device events).")  # fmt: skip
        pool = m["kv_pool"]
        sized = f"from gpu_memory_utilization {pool['gpu_memory_utilization']}" if pool["gpu_memory_utilization"] \
            else "kv_capacity_tokens (a CPU ignores gpu_memory_utilization)"  # fmt: skip
        lines.append(f"K/V pool: {pool['tokens']:,} tokens, {pool['gib']:.2f} GiB, {sized}.")
        lines += ["", "| bucket | " + " | ".join(m["replay_ms"]) + " |", "|---|" + "---|" * len(m["replay_ms"]),
                  "| replay ms | " + " | ".join(f"{v:.3f}" for v in m["replay_ms"].values()) + " |", ""]  # fmt: skip
        if m.get("kernels_per_layer"):
            lines += ["Kernels a replay launches per decoder layer (the whole step's over its layers): " + ", ".join(
                f"bucket {b}: {v:.1f}" for b, v in m["kernels_per_layer"].items()) + ".", ""]  # fmt: skip
    lines += [f"- error: {e}" for e in r["errors"]]
    return [*lines, ""]


# (name, query heads, K/V heads, head dim): GPT-2-medium's MHA and Qwen2.5-0.5B's GQA
ATTENTION_SHAPES = [("mha 16x64", 16, 16, 64), ("gqa 14/2x64", 14, 2, 64)]


def run_decode_throughput(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """The first graph model decoding --throughput-running requests of --throughput-context-token
    prompts as a user's engine runs it (CUDA graphs, and on CUDA async scheduling, both defaults;
    prompts prefilled in chunks of --throughput-chunk tokens): output tok/s and ms a step over
    --throughput-steps steps in which every request decodes, timed from the host."""
    import torch

    from orca_backend import LLM, SamplingParams

    gpu_check = load_gpu_check()
    device = torch.device(args.device)
    model, running, context = args.graph_models[0], args.throughput_running, args.throughput_context
    steps = args.throughput_steps
    started = time.perf_counter()
    llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=running,
              kv_capacity_tokens=_pool_tokens(running, context + steps), gpu_memory_utilization=KV_POOL_UTILIZATION,
              max_num_batched_tokens=args.throughput_chunk)  # fmt: skip
    result: dict[str, Any] = {"model": model, "dtype": args.dtype, "running": running, "context": context,
                              "steps": steps, "chunk": args.throughput_chunk, "build_s": time.perf_counter() - started,
                              "async_scheduling": bool(llm.engine.core.config.async_scheduling)}  # fmt: skip
    decodes = _Decodes(llm.engine, running)
    try:
        started = time.perf_counter()
        decodes.start(SamplingParams(max_tokens=steps + 32, temperature=0.0, ignore_eos=True), context)
        gpu_check.sync(device)
        result["prefill_s"] = time.perf_counter() - started
        before, started = decodes.tokens, time.perf_counter()
        for _ in range(steps):
            decodes.engine.step()
        gpu_check.sync(device)
        elapsed = time.perf_counter() - started
        result |= {"tokens": decodes.tokens - before, "tok_s": (decodes.tokens - before) / elapsed,
                   "ms_per_step": elapsed / steps * 1e3, "steps_by_path": dict(decodes.engine.stats().steps_by_path)}  # fmt: skip
        print(f"{model}: {running} running at ~{context}-token contexts: {result['tok_s']:,.0f} tok/s, "
              f"{result['ms_per_step']:.2f} ms a step (async scheduling {result['async_scheduling']})", flush=True)  # fmt: skip
        report(result)
        return result
    finally:
        decodes.close(llm, gpu_check)
        del llm, decodes
        gpu_check.release(None)


def render_decode_throughput(r: dict[str, Any]) -> list[str]:
    lines = ["## Decode throughput", "",
             f"{r['model']} ({r['dtype']}): {r['running']} requests of {r['context']}-token prompts (prefilled in "
             f"{r['chunk']}-token steps, {r.get('prefill_s', float('nan')):.1f} s), then {r['steps']} steps in which every "
             f"request decodes; async scheduling {'on' if r['async_scheduling'] else 'off'}."]  # fmt: skip
    if "tok_s" in r:
        lines.append(f"**{r['tok_s']:,.0f} output tok/s**, {r['ms_per_step']:.2f} ms a step; steps by path "
                     f"{r['steps_by_path']}.")  # fmt: skip
    return [*lines, ""]


def run_host_time(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """Issue #41's two host-side targets on the first graph model, --host-running requests decoding:
    - the host time of a mixed step, one --host-prompt-token prompt joining the running decodes every
      step (each new request ends at its first token, so every timed step is the same mix):
      synchronous steps (async scheduling off), host = the step's wall time - its GPU busy time;
    - the GPU idle between steps under sampled traffic (temperature 0.8, top-p 0.95, top-k 50,
      presence, frequency and repetition penalties), as users run it (async scheduling at its
      default): 1 - GPU busy / step. GPU busy is the profiler's device time of the same steps (CUDA
      only; off CUDA the steps' wall times alone)."""
    import torch

    from orca_backend import LLM

    gpu_check = load_gpu_check()
    device = torch.device(args.device)
    model, running, prompt, steps = args.graph_models[0], args.host_running, args.host_prompt, args.host_steps
    result: dict[str, Any] = {"model": model, "dtype": args.dtype, "running": running, "prompt": prompt,
                              "steps": steps}  # fmt: skip
    for name, async_scheduling, measure in (("mixed", False, _mixed_steps), ("sampled", None, _sampled_steps)):
        llm = LLM(model, device=args.device, dtype=args.dtype, max_num_seqs=running + 1,
                  kv_capacity_tokens=_pool_tokens(running + steps + 1, prompt + 2 * steps),
                  gpu_memory_utilization=KV_POOL_UTILIZATION, max_num_batched_tokens=running + prompt,
                  async_scheduling=async_scheduling)  # fmt: skip
        decodes = _Decodes(llm.engine, running)
        try:
            result[name] = measure(decodes, gpu_check, device, prompt, steps)
            result[name]["steps_by_path"] = dict(llm.engine.stats().steps_by_path)
            print(f"{model} {name}: {json.dumps(result[name])}", flush=True)
            report(result)
        finally:
            decodes.close(llm, gpu_check)
            del llm, decodes
            gpu_check.release(None)
    return result


def _pool_tokens(requests: int, tokens_each: int) -> int:
    """A CPU's K/V pool for `requests` of up to `tokens_each` tokens, in whole 16-token blocks and one
    more each (a GPU's pool takes KV_POOL_UTILIZATION of its memory instead)."""
    return requests * (-(-(tokens_each + 16) // 16) + 1) * 16


class _Decodes:
    """A stage's running requests on one engine, and a count of every token it streams."""

    def __init__(self, engine: Any, running: int) -> None:
        import random

        self.engine, self.running, self.tokens, self.streams = engine, running, 0, []
        self.rng = random.Random(0)
        self.vocab = engine.model_config.vocab_size

    def count(self, out: Any) -> None:
        self.tokens += len(out.new_token_ids)

    def prompt(self, length: int) -> list[int]:
        return [self.rng.randrange(1, self.vocab) for _ in range(length)]

    def start(self, params: Any, prompt_tokens: int = 16) -> None:
        """`running` requests of `prompt_tokens`-token prompts, stepped until every one has a token,
        then three more steps: every request decoding, async scheduling's pipeline full."""
        decoding: set[str] = set()

        def on_output(out: Any) -> None:
            if out.new_token_ids:
                decoding.add(out.request_id)
                self.count(out)

        self.streams = self.engine.add_requests([self.prompt(prompt_tokens) for _ in range(self.running)], params,
                                                on_output=on_output)  # fmt: skip
        while len(decoding) < self.running:
            self.engine.step()
        for _ in range(3):
            self.engine.step()

    def close(self, llm: Any, gpu_check: ModuleType) -> None:
        """The requests aborted, the engine drained and shut down (the caller then drops its last
        references and calls gpu_check.release, so that the next engine finds the memory free)."""
        for stream in self.streams:
            llm.engine.abort_request(stream.request_id)
        gpu_check.drain(llm)
        llm.shutdown()


def _busy_ms(gpu_check: ModuleType, fn: Callable[[], object], calls: int, device: Any) -> float | None:
    return (gpu_check.gpu_kernel_time(fn, calls, device) or {}).get("gpu_ms_per_call")


def _mixed_steps(decodes: _Decodes, gpu_check: ModuleType, device: Any, prompt: int, steps: int) -> dict:
    from orca_backend import SamplingParams

    decodes.start(SamplingParams(max_tokens=4 * steps + 64, temperature=0.0, ignore_eos=True))
    joining = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    def mixed_step() -> None:
        decodes.engine.add_requests([decodes.prompt(prompt)], joining, on_output=decodes.count)
        decodes.engine.step()

    before = decodes.tokens
    times = [gpu_check.wall_seconds(mixed_step, device) for _ in range(steps)]
    if decodes.tokens - before != steps * (decodes.running + 1):  # every step: each decode and the new prompt
        raise RuntimeError(f"{decodes.tokens - before} tokens in {steps} mixed steps of {decodes.running} decodes "
                           "and one prompt each: not every step was that mix")  # fmt: skip
    step_ms = statistics.median(times) * 1e3
    busy = _busy_ms(gpu_check, mixed_step, steps, device)
    return {"step_ms_median": step_ms, "gpu_busy_ms": busy, "host_ms": None if busy is None else step_ms - busy}


def _sampled_steps(decodes: _Decodes, gpu_check: ModuleType, device: Any, prompt: int, steps: int) -> dict:
    from orca_backend import SamplingParams

    decodes.start(SamplingParams(max_tokens=4 * steps + 64, temperature=0.8, top_p=0.95, top_k=50,
                                 presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.1,
                                 ignore_eos=True, seed=7))  # fmt: skip
    engine = decodes.engine
    step_ms = gpu_check.wall_seconds(lambda: [engine.step() for _ in range(steps)], device) / steps * 1e3
    busy = _busy_ms(gpu_check, engine.step, steps, device)
    return {"step_ms": step_ms, "gpu_busy_ms": busy, "gpu_idle": None if busy is None else max(0.0, 1.0 - busy / step_ms),
            "async_scheduling": bool(engine.core.config.async_scheduling)}  # fmt: skip


def render_host_time(r: dict[str, Any]) -> list[str]:
    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f}"

    lines = ["## Host time (issue #41's mixed-step and idle targets)", "",
             f"{r['model']} ({r['dtype']}), {r['running']} requests decoding. GPU busy: the profiler's device time "
             "per step (CUDA only).", ""]  # fmt: skip
    if m := r.get("mixed"):
        lines.append(f"- **Mixed step** (a {r['prompt']}-token prompt joining every step, synchronous): "
                     f"{ms(m['step_ms_median'])} ms a step, GPU busy {ms(m['gpu_busy_ms'])} ms, **host "
                     f"{ms(m['host_ms'])} ms** (target <= 1 ms); steps by path {m['steps_by_path']}.")  # fmt: skip
    if smp := r.get("sampled"):
        idle = "-" if smp["gpu_idle"] is None else f"{smp['gpu_idle']:.0%}"
        lines.append(f"- **Sampled traffic** (temperature 0.8, top-p, top-k, penalties; async scheduling "
                     f"{'on' if smp['async_scheduling'] else 'off'}): {ms(smp['step_ms'])} ms a step, GPU busy "
                     f"{ms(smp['gpu_busy_ms'])} ms, **GPU idle {idle}** (target <= 10%); steps by path "
                     f"{smp['steps_by_path']}.")  # fmt: skip
    return [*lines, ""]


def run_decode_attention(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """The decode step's attention launch as the models make it (GPT-2's write_kv_attention, the
    Llama family's rotary_write_kv_attention) over a paged pool of shuffled 16-token blocks, every
    request at the same context, against a device copy of the same bytes: achieved GB/s and its
    fraction of the copy's (bytes read + written, as gpu_check's ceilings count them)."""
    import torch

    from orca_kernels import get_ops

    ops = get_ops(torch.device(args.device))
    result: dict[str, Any] = {"kernels": ops.name, "dtype": args.dtype, "points": [], "errors": []}
    # The pool in the model's dtype at every point, and in FP8 (kv_cache_dtype fp8) at the longest contexts.
    points = [("auto", context) for context in args.attention_contexts]
    points += [("fp8", context) for context in args.attention_fp8_contexts]
    for name, q_heads, kv_heads, head_dim in ATTENTION_SHAPES:
        for kv, context in points:
            for batch in args.attention_batches:
                point = attention_point(args, ops, q_heads, kv_heads, head_dim, batch, context, kv)
                result["points"].append({"shape": name, "kv": kv, **point})
                print(f"{name} {kv:4} batch {batch:3d} context {context:5d}: {point['us']:8.1f} us, {point['gb_s']:7.1f} "
                      f"GB/s = {point['fraction_of_copy']:.0%} of a copy's {point['copy_gb_s']:.0f} GB/s", flush=True)  # fmt: skip
                report(result)
    return result


def attention_point(
    args: argparse.Namespace, ops: Any, q_heads: int, kv_heads: int, head_dim: int, batch: int, context: int,
    kv: str = "auto",
) -> dict[str, Any]:  # fmt: skip
    """One decode-attention launch's median time at `batch` requests of `context` tokens (over an FP8
    pool with `kv` fp8), and a copy's of the same bytes."""
    import torch

    from orca_kernels.attention import KVScales

    gpu_check = load_gpu_check()
    kernels = gpu_check.load_sibling("kernels")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    _, meta, slots = kernels.make_batch(
        argparse.Namespace(prefill=[0, 0], decode=[batch, context], block_size=16), device
    )
    g = torch.Generator(device=device).manual_seed(batch + context)

    def randn(*dims: int) -> torch.Tensor:
        return torch.randn(*dims, generator=g, device=device).to(dtype)

    k_cache, v_cache = randn(slots, kv_heads, head_dim), randn(slots, kv_heads, head_dim)
    kv_scales = None
    if kv == "fp8":
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
        ones = torch.ones(kv_heads, device=device)
        kv_scales = KVScales(ones, ones)
    q, k, v = (
        randn(batch, q_heads, head_dim),
        randn(batch, kv_heads, head_dim),
        randn(batch, kv_heads, head_dim),
    )
    scale = head_dim**-0.5
    if q_heads == kv_heads:
        call = functools.partial(ops.write_kv_attention, q, k, v, k_cache, v_cache, meta, scale, 0, 0.0, kv_scales)
    else:
        inverse = 10000.0 ** (-torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
        angles = torch.arange(context, device=device, dtype=torch.float32)[:, None] * inverse
        cos_sin = torch.cat([angles.cos(), angles.sin()], dim=-1)
        positions = meta.context_lens.long() - 1
        call = functools.partial(ops.rotary_write_kv_attention, q, k, v, positions, cos_sin, k_cache, v_cache, meta,
                                 scale, 0, 0.0, kv_scales)  # fmt: skip
    # K and V of every context token read; q read, the output and the new K/V written.
    nbytes = (2 * batch * context * kv_heads * k_cache.element_size()
              + (2 * batch * q_heads + 2 * batch * kv_heads) * dtype.itemsize) * head_dim  # fmt: skip
    # Device time as a captured step pays it (the launch's host cost left out), beside one eager call's
    # (what an eager step pays, host launch included).
    seconds = gpu_check.graph_seconds(call, device, reps=args.attention_reps)
    eager_s = gpu_check.median_seconds(call, device, reps=args.attention_reps)
    copy_s = gpu_check.copy_seconds(device, nbytes, reps=args.attention_reps, timer=gpu_check.graph_seconds)
    gb_s, copy_gb_s = nbytes / seconds / 1e9, 2 * nbytes / copy_s / 1e9
    return {"batch": batch, "context": context, "bytes": nbytes, "us": seconds * 1e6, "eager_us": eager_s * 1e6,
            "gb_s": gb_s, "copy_us": copy_s * 1e6, "copy_gb_s": copy_gb_s, "fraction_of_copy": gb_s / copy_gb_s}  # fmt: skip


def render_decode_attention(r: dict[str, Any]) -> list[str]:
    lines = ["## Decode attention vs copy bandwidth", "",
             f"{r['kernels']} kernels, {r['dtype']}; bytes = K/V of every context token (one byte an element in an "
             "fp8 pool) + q, output and the new K/V; copy GB/s counts bytes read + written. us: device time from "
             "CUDA-graph replays, L2 flushed before each call (gpu_check.graph_seconds); eager us: one eager call "
             "between CUDA events, the host's launch included.", "",
             "| shape | K/V | batch | context | MB | us | eager us | GB/s | copy GB/s | of copy |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for p in r["points"]:
        lines.append(f"| {p['shape']} | {p.get('kv', 'auto')} | {p['batch']} | {p['context']} | {p['bytes'] / 1e6:.1f} | "
                     f"{p['us']:.1f} | {p.get('eager_us', float('nan')):.1f} | {p['gb_s']:.0f} | {p['copy_gb_s']:.0f} | "
                     f"{p['fraction_of_copy']:.0%} |")  # fmt: skip
    return [*lines, ""]


def run_int4_gemm(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """The 4-bit Triton dequantizing GEMM (groups of 128, the layout integer checkpoints load into) and
    the W8A8 GEMMs (activations quantized per token: int8 by torch._int_mm, FP8 by torch._scaled_mm
    where the GPU has FP8) against the dtype's own GEMM (cuBLAS on a GPU) over the same [out, in]
    shapes, at decode and prefill token counts: each one's median time, the int4 weight's GB/s, and
    the ratios."""
    import torch
    import torch.nn.functional as F

    from orca_kernels.int_quant import pack_int32
    from orca_kernels.triton_int_quant import int_linear_triton
    from orca_kernels.w8a8 import w8a8_linear

    gpu_check = load_gpu_check()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    result: dict[str, Any] = {"dtype": args.dtype, "group": 128, "points": [], "errors": []}
    g = torch.Generator(device=device).manual_seed(0)
    for n, k in args.int_gemm_shapes:
        q = torch.randint(0, 16, (n, k), generator=g, device=device)
        packed = pack_int32(q, 4)
        scales = torch.rand(n, k // 128, generator=g, device=device) * 0.01
        zeros = torch.full((n, k // 128), 8.0, device=device)
        dense = ((q.float() - 8.0) * scales.repeat_interleave(128, dim=1)).to(dtype)
        weight_bytes = packed.nbytes + scales.nbytes + zeros.nbytes
        row_scale = torch.rand(n, generator=g, device=device) * 0.01
        w8 = {"int8": torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)}
        if device.type == "cpu" or torch.cuda.get_device_capability(device) >= (8, 9):
            w8["fp8"] = torch.randn(n, k, generator=g, device=device).to(torch.float8_e4m3fn)
        for tokens in args.int_gemm_tokens:
            x = torch.randn(tokens, k, generator=g, device=device).to(dtype)
            int4 = functools.partial(int_linear_triton, x, packed, scales, zeros, 4, 128)
            # Device times from CUDA-graph replays (the layers run captured), L2 flushed before each call.
            int4_s = gpu_check.graph_seconds(int4, device, reps=args.int_gemm_reps)
            dense_s = gpu_check.graph_seconds(functools.partial(F.linear, x, dense), device, reps=args.int_gemm_reps)
            point = {"out": n, "in": k, "tokens": tokens, "int4_us": int4_s * 1e6, "dense_us": dense_s * 1e6,
                     "int4_weight_gb_s": weight_bytes / int4_s / 1e9, "dense_over_int4": dense_s / int4_s}  # fmt: skip
            for act, weight in w8.items():
                call = functools.partial(w8a8_linear, x, weight, row_scale, act)
                point[f"w8a8_{act}_us"] = gpu_check.graph_seconds(call, device, reps=args.int_gemm_reps) * 1e6
            result["points"].append(point)
            w8a8 = ", ".join(f"w8a8 {act} {point[f'w8a8_{act}_us']:.1f} us" for act in w8)
            print(f"[{n}, {k}] x {tokens:5d} tokens: int4 {point['int4_us']:8.1f} us, {args.dtype} {point['dense_us']:8.1f} us"
                  f" -> {point['dense_over_int4']:.2f}x; {w8a8}", flush=True)  # fmt: skip
            report(result)
    return result


def render_int4_gemm(r: dict[str, Any]) -> list[str]:
    lines = ["## The int4 dequantizing GEMM and the W8A8 GEMMs vs the dense one", "",
             f"groups of {r['group']}, activations {r['dtype']}; the dense GEMM is torch's F.linear (cuBLAS on a GPU) "
             "over the same weight dequantized; W8A8 quantizes the activations per token first. Device times from "
             "CUDA-graph replays, L2 flushed before each call.", "",
             "| out x in | tokens | int4 us | dense us | int4 weight GB/s | dense / int4 | W8A8 int8 us | W8A8 fp8 us |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [f"| {p['out']} x {p['in']} | {p['tokens']} | {p['int4_us']:.1f} | {p['dense_us']:.1f} | "
              f"{p['int4_weight_gb_s']:.0f} | {p['dense_over_int4']:.2f}x | {p.get('w8a8_int8_us', float('nan')):.1f} | "
              f"{p.get('w8a8_fp8_us', float('nan')):.1f} |" for p in r["points"]]  # fmt: skip
    return [*lines, ""]


def compile_cases(device: Any, dtype: Any, quick: bool) -> dict[str, Callable[[], object]]:
    """One call of each Triton kernel the engine launches, at a small shape of its own."""
    import numpy as np
    import torch

    from orca_kernels import get_ops, triton_fp8, triton_int_quant
    from orca_kernels.int_quant import pack_int32
    from orca_kernels.lora import lora_metadata

    kernels = load_gpu_check().load_sibling("kernels")
    ops = get_ops(device, "triton")
    t, h, heads, kv_heads, d = (4, 64, 4, 2, 16) if quick else (64, 1024, 16, 2, 64)
    g = torch.Generator(device=device).manual_seed(0)

    def randn(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*dims, generator=g, device=device) * scale).to(dtype)

    x, res, w, b = randn(t, h), randn(t, h), randn(h), randn(h)
    gate_up, bias = randn(t, 8 * h), randn(8 * h)
    q, k = randn(t, heads, d), randn(t, kv_heads, d)
    positions = torch.arange(t, device=device)
    cos_sin = torch.cat([torch.ones(256, d // 2), torch.zeros(256, d // 2)], dim=-1).to(device)
    _, prefill_meta, prefill_slots = kernels.make_batch(
        argparse.Namespace(prefill=[2, t // 2], decode=[0, 0], block_size=16), device
    )
    _, decode_meta, decode_slots = kernels.make_batch(argparse.Namespace(prefill=[0, 0], decode=[4, 100], block_size=16), device)  # fmt: skip
    pool = (
        randn(max(prefill_slots, decode_slots), kv_heads, d),
        randn(max(prefill_slots, decode_slots), kv_heads, d),
    )
    dq, dk, dv = randn(4, heads, d), randn(4, kv_heads, d), randn(4, kv_heads, d)
    experts, top_k, inner = 4, 2, h
    w13, w2 = randn(experts, 2 * inner, h, scale=0.05), randn(experts, h, inner, scale=0.05)
    topk_ids = torch.stack(
        [torch.randperm(experts, generator=torch.Generator().manual_seed(i))[:top_k] for i in range(t)]
    ).to(device)
    topk_weights = torch.rand(t, top_k, device=device).to(dtype)
    rank, slots = 8, 2
    lora_a, lora_b = randn(slots, rank, h), randn(slots, h, rank)
    lora_meta = lora_metadata(np.arange(t, dtype=np.int32) % (slots + 1) - 1, slots, device)
    fp8_weight = torch.randn(h, h, device=device).to(torch.float8_e4m3fn)
    fp8_scale = torch.ones(-(-h // 128), -(-h // 128), device=device)
    int4_weight = pack_int32(torch.randint(0, 16, (h, h), generator=g, device=device), 4)
    int4_scales, int4_zeros = torch.ones(h, h // 32, device=device), torch.full((h, h // 32), 8.0, device=device)
    scale = d**-0.5
    return {
        "add_layernorm": lambda: ops.add_layernorm(x, res, w, b, 1e-5),
        "bias_gelu": lambda: ops.bias_gelu(gate_up, bias),
        "add_rmsnorm": lambda: ops.add_rmsnorm(x, res, w, 1e-5),
        "silu_and_mul": lambda: ops.silu_and_mul(gate_up),
        "gelu_and_mul": lambda: ops.gelu_and_mul(gate_up),
        "rotary": lambda: ops.rotary(q, k, positions, cos_sin),
        "write_kv": lambda: ops.write_kv(k[: len(prefill_meta.slot_mapping)], k[: len(prefill_meta.slot_mapping)], *pool, prefill_meta.slot_mapping),
        "attention (ragged prefill)": lambda: ops.attention(q[:t], pool[0], pool[1], prefill_meta, scale),
        "write_kv_attention (split-K decode)": lambda: ops.write_kv_attention(dq, dk, dv, *pool, decode_meta, scale),
        "rotary_write_kv_attention (split-K decode)": lambda: ops.rotary_write_kv_attention(
            dq, dk, dv, decode_meta.context_lens.long() - 1, cos_sin, *pool, decode_meta, scale),
        "moe (grouped GEMMs)": lambda: ops.moe(x, w13, w2, topk_weights, topk_ids),
        "lora (shrink, expand)": lambda: ops.lora(x.clone(), x, lora_a, lora_b, lora_meta),
        "fp8_linear": lambda: triton_fp8.fp8_linear_triton(x, fp8_weight, fp8_scale, (128, 128)),
        "int4_linear": lambda: triton_int_quant.int_linear_triton(x, int4_weight, int4_scales, int4_zeros, 4, 32),
    }  # fmt: skip


def run_triton_compile(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """Each kernel's first call (Triton compiles it, on an empty cache) minus the median of three warm
    calls, the device drained around each. The first call of all also builds Triton's launcher
    utilities; on a CPU the interpreter compiles nothing, the differences are noise, and one warm
    call is enough."""
    import torch

    gpu_check = load_gpu_check()
    cache = tempfile.mkdtemp(prefix="gpu_smoke_triton_cache_")
    os.environ["TRITON_CACHE_DIR"] = cache  # read when a kernel first compiles: nothing is cached there
    device = torch.device(args.device)
    result: dict[str, Any] = {"cache": "empty (a fresh TRITON_CACHE_DIR)", "kernels": {}, "errors": []}
    if device.type != "cuda":
        result["note"] = "Triton's interpreter: nothing is compiled, the figures are noise"
    try:
        cases = compile_cases(device, getattr(torch, args.dtype), args.quick and device.type != "cuda")
        warm_calls = 3 if device.type == "cuda" else 1
        for name, call in cases.items():
            try:
                first = gpu_check.wall_seconds(call, device)
                warm = statistics.median(gpu_check.wall_seconds(call, device) for _ in range(warm_calls))
            except Exception as exc:  # this kernel's failure is reported; the others still compile
                traceback.print_exc()
                result["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
                continue
            result["kernels"][name] = {"first_s": first, "warm_s": warm, "compile_s": first - warm}
            print(f"{name}: first call {first:.2f} s, warm {warm * 1e3:.3f} ms", flush=True)
            report(result)
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    result["total_compile_s"] = sum(k["compile_s"] for k in result["kernels"].values())
    return result


def render_triton_compile(r: dict[str, Any]) -> list[str]:
    lines = ["## Triton compile seconds (first call - warm call, empty cache)", ""]
    if "note" in r:
        lines += [f"{r['note']}.", ""]
    lines += ["| kernel | compile s | warm ms |", "|---|---|---|"]
    lines += [f"| {n} | {k['compile_s']:.2f} | {k['warm_s'] * 1e3:.3f} |" for n, k in r["kernels"].items()]
    if "total_compile_s" in r:
        lines.append(f"| total | {r['total_compile_s']:.1f} | |")
    return [*lines, ""] + [f"- error: {e}" for e in r["errors"]]


# ------------------------------------------------------------------------------------------ served
def run_served(args: argparse.Namespace, report: Report) -> dict[str, Any]:
    """The serving path's CPU per streamed token (benchmarks/serving_cost.py: the constant-time
    measurement device on a real tritonserver, 1 to 8 `orca` instances over one engine core) on this
    machine's host CPUs, when tritonserver is here: the nvidia-pytriton and tritonclient wheels carried
    and installed (`make gpu-smoke WHEELS=wheels`; see the Makefile's gpu-served)."""
    import importlib.util

    missing = [m for m in ("pytriton", "tritonclient") if importlib.util.find_spec(m) is None]
    if missing and not shutil.which("tritonserver"):
        return {"skipped": f"no tritonserver ({', '.join(missing)} not installed): carry the nvidia-pytriton and "
                           "tritonclient wheels (make gpu-served says how)"}  # fmt: skip
    # Its server logs stay out of --out (a lent machine sends back eight files at most): the JSON alone goes there.
    scratch = Path(tempfile.mkdtemp(prefix="gpu_smoke_served_"))
    command = [sys.executable, str(BENCH_DIR / "serving_cost.py"), "--streams", ",".join(map(str, args.served_streams)),
               "--instances", ",".join(map(str, args.served_instances)), "--tokens", "64", "--repeats", "1",
               "--out", str(scratch / "serving-cost.json")]  # fmt: skip
    try:
        subprocess.run(command, check=True)
    finally:
        if (scratch / "serving-cost.json").is_file():
            shutil.copy2(scratch / "serving-cost.json", Path(args.out) / "serving-cost.json")
        shutil.rmtree(scratch, ignore_errors=True)
    runs = json.loads((Path(args.out) / "serving-cost.json").read_text()).get("runs", [])
    return {"command": " ".join(command[1:]), "runs": [
        {"instances": r["instances"], "streams": r["streams"], "tokens_per_s": r["result"]["tokens_per_s"],
         "stub_us_per_response": r["result"]["us_per_response"]["stubs"]} for r in runs]}  # fmt: skip


def render_served(r: dict[str, Any]) -> list[str]:
    if "skipped" in r:
        return ["## Served (serving_cost.py)", "", f"Not run: {r['skipped']}.", ""]
    lines = ["## Served (serving_cost.py, constant-time device, host CPUs)", "", f"`{r['command']}`", "",
             "| instances | streams | tok/s | stub µs/response |", "|---|---|---|---|"]  # fmt: skip
    lines += [f"| {x['instances']} | {x['streams']} | {x['tokens_per_s']:,.0f} | {x['stub_us_per_response']:.0f} |"
              for x in r["runs"]]  # fmt: skip
    return [*lines, ""]


STAGES = [
    Stage("env", "versions, the device, nvidia-smi clocks and memory", 60, run_env, render_env),
    Stage("kernel_tests", "the kernel and engine tests never run compiled", 170, run_kernel_tests, render_kernel_tests),
    Stage("graphs", "both models graphed: every bucket, replay times, pool memory, capture s, traces", 120, run_graphs,
          render_graphs),
    # 900-token prompts and 96 tokens at most: inside GPT-2's 1,024-token context.
    Stage("decode_throughput", "the first model decoding 256 requests at ~1k-token contexts: tok/s", 90,
          run_decode_throughput, render_decode_throughput),
    Stage("host_time", "a mixed step's host time; GPU idle under sampled traffic (64 running)", 60, run_host_time,
          render_host_time),
    Stage("decode_attention", "decode attention at real shapes vs copy bandwidth", 60, run_decode_attention,
          render_decode_attention),
    Stage("int4_gemm", "the int4 dequantizing GEMM vs the dense GEMM at decode and prefill shapes", 45, run_int4_gemm,
          render_int4_gemm),
    Stage("triton_compile", "Triton compile seconds per kernel, empty cache", 60, run_triton_compile,
          render_triton_compile),
    Stage("served", "the serving path's CPU per token, 1-8 instances (when tritonserver is here)", 90, run_served,
          render_served),
]  # fmt: skip


# --------------------------------------------------------------------------------------- arguments
# Each setting's value for the GPU run, and (QUICK) for --quick: every stage end to end on a small CPU.
DEFAULTS: dict[str, Any] = {
    "dtype": "bfloat16", "graph_models": ["gpt2-medium", "qwen2.5-0.5b"], "graph_max_seqs": 256, "replay_reps": 20,
    "attention_batches": [1, 64, 256], "attention_contexts": [1024, 8192], "attention_fp8_contexts": [8192],
    "attention_reps": 20,
    "served_streams": [256, 1024], "served_instances": [1, 4, 8],
    "int_gemm_shapes": [(4096, 4096), (14336, 4096)], "int_gemm_tokens": [1, 16, 256, 2048], "int_gemm_reps": 20,
    "throughput_running": 256, "throughput_context": 900, "throughput_steps": 64, "throughput_chunk": 8192,
    "host_running": 64, "host_prompt": 512, "host_steps": 16,
}  # fmt: skip
QUICK: dict[str, Any] = {
    "dtype": "float32", "graph_models": ["gpt2-tiny", "llama-tiny"], "graph_max_seqs": 8, "replay_reps": 3,
    "attention_batches": [1, 4], "attention_contexts": [64, 256], "attention_fp8_contexts": [256], "attention_reps": 3,
    "served_streams": [16], "served_instances": [2],
    "int_gemm_shapes": [(48, 256)], "int_gemm_tokens": [1, 20], "int_gemm_reps": 2,
    "throughput_running": 4, "throughput_context": 40, "throughput_steps": 3, "throughput_chunk": 64,
    "host_running": 3, "host_prompt": 20, "host_steps": 2,
}  # fmt: skip


def parse_args(argv: list[str], stages: list[Stage]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--out", default="gpu_results", help="folder for smoke.json, smoke.log, summary.md, traces"
    )
    p.add_argument("--stages", default=",".join(s.name for s in stages),
                   help=f"comma-separated subset of {', '.join(s.name for s in stages)}")  # fmt: skip
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument(
        "--quick", action="store_true", help="small settings for every one not given (the CI check on CPU)"
    )
    p.add_argument(
        "--budget-s", type=float, default=380.0, help="the whole run's limit: no stage runs past it"
    )
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--graph-models", nargs="+", help="graphs stage: presets or checkpoint directories")
    p.add_argument(
        "--graph-max-seqs", type=int, help="graphs stage: max_num_seqs (a graph per bucket up to it)"
    )
    p.add_argument("--replay-reps", type=int)
    p.add_argument("--attention-batches", type=int, nargs="+")
    p.add_argument("--attention-contexts", type=int, nargs="+")
    p.add_argument("--attention-fp8-contexts", type=int, nargs="+", help="decode_attention stage: an FP8 pool's contexts")
    p.add_argument("--attention-reps", type=int)
    p.add_argument("--served-streams", type=int, nargs="+", help="served stage: concurrent streams per burst")
    p.add_argument("--served-instances", type=int, nargs="+", help="served stage: orca instance counts")
    p.add_argument("--throughput-running", type=int, help="decode_throughput stage: requests decoding together")
    p.add_argument("--throughput-context", type=int, help="decode_throughput stage: each prompt's tokens")
    p.add_argument("--throughput-steps", type=int, help="decode_throughput stage: decode steps timed")
    p.add_argument("--throughput-chunk", type=int, help="decode_throughput stage: max_num_batched_tokens")
    p.add_argument("--host-running", type=int, help="host_time stage: requests decoding together")
    p.add_argument("--host-prompt", type=int, help="host_time stage: the joining prompt's tokens (mixed steps)")
    p.add_argument("--host-steps", type=int, help="host_time stage: steps timed")
    p.add_argument("--int-gemm-tokens", type=int, nargs="+", help="int4_gemm stage: token counts")
    p.add_argument("--int-gemm-reps", type=int)
    p.set_defaults(int_gemm_shapes=None)  # [out, in] pairs: DEFAULTS' or QUICK's, no flag
    p.add_argument("--stage", help=argparse.SUPPRESS)  # internal: run this one stage in this process
    p.add_argument("--result", help=argparse.SUPPRESS)  # internal: where that stage writes its result
    args = p.parse_args(argv)
    for name, full in DEFAULTS.items():
        if getattr(args, name) is None:
            quick = args.quick and (name != "dtype" or args.device == "cpu")
            setattr(args, name, QUICK[name] if quick else full)
    return args


def cuda_missing() -> str | None:
    """Why this machine has no usable CUDA device (asked in a child, so the runner never imports torch)."""
    probe = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 3)"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    if proc.returncode == 0:
        return None
    return "torch sees no CUDA device" if proc.returncode == 3 else proc.stderr.strip()[-500:]


def main(argv: list[str] | None = None, stages: list[Stage] | None = None, script: Path | None = None) -> int:
    """`stages` and `script` (the file that defines them, rerun for each stage) are this module's
    own unless a test passes stand-ins."""
    argv = sys.argv[1:] if argv is None else argv
    stages = STAGES if stages is None else stages
    args = parse_args(argv, stages)
    by_name = {s.name: s for s in stages}
    if args.stage is not None:
        return run_one_stage(by_name[args.stage], args)
    chosen = [s for s in args.stages.split(",") if s]
    if unknown := sorted(set(chosen) - set(by_name)):
        raise SystemExit(f"unknown stage(s) {unknown}; choose from {', '.join(by_name)}")
    if args.device == "cuda" and (why := cuda_missing()):
        print(f"benchmarks/gpu_smoke.py needs a CUDA GPU ({why}); --device cpu --quick checks the plumbing",
              file=sys.stderr)  # fmt: skip
        return 2
    run = run_stages([by_name[n] for n in chosen], args, argv, script or Path(__file__).resolve())
    failed = [name for name, r in run["stages"].items() if r["status"] != "passed"]
    print(
        f"wrote {Path(args.out) / 'summary.md'}; "
        + (f"not passed: {', '.join(failed)}" if failed else "every stage passed")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
