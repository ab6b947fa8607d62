"""`make gpu-smoke`'s script (benchmarks/gpu_smoke.py) on CPU, as CI runs it.

The stage runner with stand-in stages (fast): a hung stage is killed at its timeout with every process it
started, and the run goes on; a stage's partial result survives its failure or its kill; results
reach --out as each stage ends, so a run killed mid-stage leaves the stages before it; the exit
status is nonzero when a stage did not pass, and the summary lists every stage. Then every real
stage end to end with `--device cpu --quick`: its figures are whatever this machine measures, so the
tests check their structure, never their values or the clock (marked slow: six processes that import torch).
"""

from __future__ import annotations

import gzip
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_smoke.py"
STAGES = ("env", "kernel_tests", "graphs", "decode_throughput", "host_time", "decode_attention", "int4_gemm",
          "triton_compile", "served")

# Stand-in stages. `hang` reports its own pid and a child's, then never ends; `fail` reports a partial
# result, then raises; `kill_runner` kills the runner (a device command cut off at its limit).
FAKE_SCRIPT = """
import os, signal, subprocess, sys, time
from pathlib import Path
sys.path.insert(0, {bench!r})
import gpu_smoke
from gpu_smoke import Stage

def ok(args, report):
    print("ok stage ran")
    return {{"value": 1}}

def hang(args, report):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    report({{"pid": os.getpid(), "child": child.pid}})
    print("hang stage waits", flush=True)
    time.sleep(600)

def fail(args, report):
    report({{"step": 1}})
    raise RuntimeError("planted failure")

def kill_runner(args, report):
    os.kill(os.getppid(), signal.SIGKILL)
    return {{}}

STAGES = {{"ok": Stage("ok", "returns", 60, ok), "hang": Stage("hang", "never ends", {hang_timeout}, hang),
           "fail": Stage("fail", "raises", 60, fail), "after": Stage("after", "returns", 60, ok),
           "kill_runner": Stage("kill_runner", "kills the runner", 60, kill_runner)}}
names = os.environ["FAKE_STAGES"].split(",")
sys.exit(gpu_smoke.main(sys.argv[1:], stages=[STAGES[n] for n in names], script=Path(__file__)))
"""


def clean_env(**extra: str) -> dict[str, str]:
    """The caller's environment minus what would change the run's kernel choices (the runner sets
    TRITON_INTERPRET for its stages itself)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ORCA_KERNELS")}
    return env | extra


def run_fakes(
    tmp_path: Path, names: list[str], *args: str, hang_timeout: float = 3
) -> tuple[subprocess.CompletedProcess, Path]:
    script = tmp_path / "fake_smoke.py"
    script.write_text(FAKE_SCRIPT.format(bench=str(ROOT / "benchmarks"), hang_timeout=hang_timeout))
    out = tmp_path / "out"
    cmd = [sys.executable, str(script), "--device", "cpu", "--out", str(out), *args]
    env = clean_env(
        FAKE_STAGES=",".join(names), TMPDIR=str(tmp_path)
    )  # the runner's work folder, killed or not
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    return proc, out


def alive(pid: int) -> bool:
    """A process that exists and is not a zombie (a killed child of a killed parent may linger as one)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def test_a_hung_stage_is_killed_and_the_run_goes_on(tmp_path):
    proc, out = run_fakes(tmp_path, ["ok", "hang", "fail", "after"])
    assert proc.returncode == 1, proc.stdout + proc.stderr
    run = json.loads((out / "smoke.json").read_text())
    stages = run["stages"]
    assert list(stages) == ["ok", "hang", "fail", "after"]
    assert [s["status"] for s in stages.values()] == ["passed", "timeout", "failed", "passed"]
    assert stages["ok"]["result"] == {"value": 1} and stages["after"]["result"] == {"value": 1}
    hung = stages["hang"]
    assert hung["timeout_s"] == 3 and "killed after 3 s" in hung["why"]
    # What it reported before it hung is kept; it and the process it started are gone.
    pids = hung["result"]["pid"], hung["result"]["child"]
    assert not any(alive(pid) for pid in pids), pids
    failed = stages["fail"]
    assert failed["result"]["step"] == 1 and failed["result"]["errors"] == ["RuntimeError: planted failure"]
    assert failed["why"] == "RuntimeError: planted failure" and failed["returncode"] == 1
    log = (out / "smoke.log").read_text()
    assert "hang stage waits" in log and "hang: killed at its timeout of 3 s" in log
    assert "RuntimeError: planted failure" in log and log.count("ok stage ran") == 2
    summary = (out / "summary.md").read_text()
    assert "**Not passed: hang, fail.**" in summary
    for row in ("| ok | passed |", "| hang | timeout: killed after 3 s", "| fail | failed: RuntimeError: planted failure",
                "| after | passed |"):  # fmt: skip
        assert row in summary, row
    assert "not passed: hang, fail" in proc.stdout


def test_a_killed_run_leaves_the_stages_that_ended(tmp_path):
    proc, out = run_fakes(tmp_path, ["ok", "kill_runner", "after"])
    assert proc.returncode == -9  # SIGKILL, as a device command's time limit ends it
    stages = json.loads((out / "smoke.json").read_text())["stages"]
    assert stages["ok"]["status"] == "passed" and stages["ok"]["result"] == {"value": 1}
    assert stages["kill_runner"]["status"] == "running"  # where the run died
    assert stages["after"]["status"] == "pending"
    summary = (out / "summary.md").read_text()
    assert "| ok | passed |" in summary and "| kill_runner | running |" in summary
    assert "ok stage ran" in (out / "smoke.log").read_text()


def test_the_runs_budget_cuts_a_stage_and_skips_the_rest(tmp_path):
    proc, out = run_fakes(tmp_path, ["hang", "after"], "--budget-s", "2", hang_timeout=600)
    assert proc.returncode == 1
    stages = json.loads((out / "smoke.json").read_text())["stages"]
    assert stages["hang"]["status"] == "timeout" and stages["hang"]["timeout_s"] <= 2
    assert stages["after"]["status"] == "not run" and "budget of 2 s was spent" in stages["after"]["why"]
    assert "| after | not run: the run's budget of 2 s was spent |" in (out / "summary.md").read_text()


def test_no_cuda_device_is_an_error(tmp_path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path)], cwd=ROOT, env=clean_env(CUDA_VISIBLE_DEVICES=""),
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 2 and "needs a CUDA GPU (torch sees no CUDA device)" in proc.stderr
    assert not (tmp_path / "smoke.json").exists()


def finite_positive(value) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


# Six stage processes, each importing torch and the engine, one starting a tritonserver: ~30-50 s on a
# busy 2-core machine.
QUICK_RUN = pytest.mark.slow


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str, Path]:
    """(smoke.json, summary.md, the output folder) of one CI-style run."""
    out = tmp_path_factory.mktemp("gpu_smoke")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr + (out / "smoke.log").read_text())[-6000:]
    return json.loads((out / "smoke.json").read_text()), (out / "summary.md").read_text(), out


def result(quick_run, stage: str) -> dict:
    record = quick_run[0]["stages"][stage]
    assert record["status"] == "passed", record
    assert not record["result"].get("errors"), record
    return record["result"]


@QUICK_RUN
def test_quick_run_passes_every_stage_into_six_files(quick_run):
    run, summary, out = quick_run
    assert list(run["stages"]) == list(STAGES)
    # A lent GPU machine sends back eight files at most.
    assert sorted(p.name for p in out.iterdir()) == ["serving-cost.json", "smoke.json", "smoke.log", "summary.md",
                                                     "trace-gpt2-tiny.json.gz", "trace-llama-tiny.json.gz"]  # fmt: skip
    assert "**Not a GPU run**" in summary and "Not passed" not in summary
    for stage in STAGES:
        assert f"| {stage} | passed |" in summary


@QUICK_RUN
def test_env(quick_run):
    env = result(quick_run, "env")
    assert env["torch"] and env["triton"] and env["commit"]
    assert "device" not in env  # no CUDA device to describe


@QUICK_RUN
def test_kernel_tests_are_collected_off_cuda(quick_run):
    tests = result(quick_run, "kernel_tests")
    assert tests["mode"] == "collected only (no CUDA)" and tests["exit_code"] == 0
    # Every node id names a test (pytest fails the collection otherwise): the MoE kernel's among them.
    assert tests["collected"] >= len(tests["tests"])
    assert "tests/model/test_moe.py::test_moe_triton_equals_the_reference" in tests["tests"]


@QUICK_RUN
def test_graphs_every_bucket_replayed_and_traced(quick_run):
    graphs = result(quick_run, "graphs")
    out = quick_run[2]
    assert list(graphs["models"]) == ["gpt2-tiny", "llama-tiny"]
    for name, m in graphs["models"].items():
        assert m["mode"] == "static" and "no CUDA graph on cpu" in m["note"]
        assert m["capture_sizes"] == [1, 2, 4, 8] and list(m["replay_ms"]) == ["1", "2", "4", "8"]
        assert all(finite_positive(v) for v in m["replay_ms"].values()), m["replay_ms"]
        # Every decode step of the staggered requests ran on the static buffers, the prefill mixed.
        assert set(m["steps_by_path"]) == {"static_buffers"}  # prompt steps on their own (mixed) buffers too
        trace = m["trace"]
        assert trace["file"] == f"trace-{name}.json.gz" and trace["buckets"] == [1, 8]
        events = json.loads(gzip.decompress((out / trace["file"]).read_bytes()))["traceEvents"]
        names = {e.get("name") for e in events}
        assert {"gpu_smoke.replay_bucket_1", "gpu_smoke.replay_bucket_8"} <= names
        assert m["kernels_per_layer"] == {}  # counted on CUDA only: a CPU's steps launch no kernels


@QUICK_RUN
def test_decode_throughput_times_steps_where_every_request_decodes(quick_run):
    run = result(quick_run, "decode_throughput")
    assert (run["model"], run["running"], run["context"], run["steps"]) == ("gpt2-tiny", 4, 40, 3)
    assert run["async_scheduling"] is False  # unset: off on a CPU
    # Every timed step decoded every request: a token each (none had reached its max_tokens).
    assert run["tokens"] == run["running"] * run["steps"]
    assert finite_positive(run["tok_s"]) and finite_positive(run["ms_per_step"])
    assert "Decode throughput" in quick_run[1] and "output tok/s" in quick_run[1]


@QUICK_RUN
def test_host_time_times_mixed_steps_and_sampled_steps(quick_run):
    run = result(quick_run, "host_time")
    assert (run["model"], run["running"], run["prompt"], run["steps"]) == ("gpt2-tiny", 3, 20, 2)
    mixed, sampled = run["mixed"], run["sampled"]
    assert finite_positive(mixed["step_ms_median"]) and finite_positive(sampled["step_ms"])
    # Off CUDA there is no device profile: no busy time, no host or idle figure made up from it.
    assert mixed["gpu_busy_ms"] is None and mixed["host_ms"] is None and sampled["gpu_idle"] is None
    assert sampled["async_scheduling"] is False  # unset: off on a CPU
    assert "Mixed step" in quick_run[1] and "Sampled traffic" in quick_run[1]


@QUICK_RUN
def test_decode_attention_against_copy(quick_run):
    attention = result(quick_run, "decode_attention")
    assert attention["kernels"] == "cpu" and attention["dtype"] == "float32"
    points = attention["points"]
    assert {(p["shape"], p["kv"], p["batch"], p["context"]) for p in points} == {
        (shape, kv, batch, context) for shape in ("mha 16x64", "gqa 14/2x64") for batch in (1, 4)
        for kv, context in (("auto", 64), ("auto", 256), ("fp8", 256))
    }  # fmt: skip
    for p in points:
        for key in ("bytes", "us", "gb_s", "copy_us", "copy_gb_s", "fraction_of_copy"):
            assert finite_positive(p[key]), (p, key)
        assert math.isclose(p["fraction_of_copy"], p["gb_s"] / p["copy_gb_s"])
    mha = next(p for p in points if p["shape"] == "mha 16x64" and p["batch"] == 1 and p["context"] == 64)
    assert mha["bytes"] == (2 * 64 * 16 + 2 * 16 + 2 * 16) * 64 * 4  # K/V read, q and output, the new K/V
    fp8 = next(p for p in points if p["shape"] == "mha 16x64" and p["batch"] == 1 and p["kv"] == "fp8")
    assert fp8["bytes"] == (2 * 256 * 16 * 1 + (2 * 16 + 2 * 16) * 4) * 64  # an FP8 pool: a byte an element


@QUICK_RUN
def test_int4_gemm_against_the_dense_gemm(quick_run):
    int4 = result(quick_run, "int4_gemm")
    assert int4["dtype"] == "float32" and int4["group"] == 128
    assert {(p["out"], p["in"], p["tokens"]) for p in int4["points"]} == {(48, 256, 1), (48, 256, 20)}
    for p in int4["points"]:
        for key in ("int4_us", "dense_us", "int4_weight_gb_s", "dense_over_int4", "w8a8_int8_us", "w8a8_fp8_us"):
            assert finite_positive(p[key]), (p, key)
        assert math.isclose(p["dense_over_int4"], p["dense_us"] / p["int4_us"])
    assert "## The int4 dequantizing GEMM and the W8A8 GEMMs vs the dense one" in quick_run[1]


@QUICK_RUN
def test_triton_compile_covers_every_kernel(quick_run):
    compiled = result(quick_run, "triton_compile")
    assert "interpreter" in compiled["note"]
    assert set(compiled["kernels"]) == {
        "add_layernorm", "bias_gelu", "add_rmsnorm", "silu_and_mul", "gelu_and_mul", "rotary", "write_kv",
        "attention (ragged prefill)", "write_kv_attention (split-K decode)", "rotary_write_kv_attention (split-K decode)",
        "moe (grouped GEMMs)", "lora (shrink, expand)", "fp8_linear", "int4_linear",
    }  # fmt: skip
    for k in compiled["kernels"].values():
        assert finite_positive(k["first_s"]) and finite_positive(k["warm_s"])
        assert math.isclose(k["compile_s"], k["first_s"] - k["warm_s"])


@QUICK_RUN
def test_served_stage_measures_two_instances_over_one_core(quick_run):
    served = result(quick_run, "served")
    (run,) = served["runs"]
    assert (run["instances"], run["streams"]) == (2, 16)
    assert run["tokens_per_s"] > 0 and run["stub_us_per_response"] > 0
    assert "--instances 2" in served["command"]
