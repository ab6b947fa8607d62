"""`make gpu-check`'s script (benchmarks/gpu_check.py) end to end on CPU, as CI runs it:
`--device cpu --quick` runs every section (ceilings, kernels in Triton's interpreter, decode and
prefill rooflines, the iteration- vs request-level A/B) with small settings. The figures are whatever
this machine measures: the tests check their structure and sanity, never their values or the clock.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ("ceilings", "kernels", "decode", "prefill", "ab")


def load_gpu_check():
    spec = importlib.util.spec_from_file_location("orca_bench_gpu_check", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def clean_env() -> dict[str, str]:
    """The caller's environment minus what would change the run's kernel choices: the script sets
    TRITON_INTERPRET itself before it imports triton, and the engine picks its CPU kernels."""
    return {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "ORCA_KERNELS")}


def finite_positive(value) -> bool:
    return (
        isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value > 0
    )


@pytest.fixture(scope="module")
def quick_run(tmp_path_factory) -> tuple[dict, str, str]:
    """(gpu_check.json, summary.md, stdout + stderr) of one CI-style run."""
    out = tmp_path_factory.mktemp("gpu_check")
    cmd = [sys.executable, str(SCRIPT), "--device", "cpu", "--quick", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, log[-6000:]
    return json.loads((out / "gpu_check.json").read_text()), (out / "summary.md").read_text(), log


def test_quick_run_has_every_section_and_no_errors(quick_run):
    result, _, _ = quick_run
    assert result["errors"] == {}
    for name in SECTIONS:
        assert isinstance(result.get(name), dict), name
        assert "skipped" not in result[name], result[name]
        assert finite_positive(result["seconds"][name]), name
    args = result["args"]
    assert args["quick"] and args["device"] == "cpu"
    assert (args["model"], args["dtype"]) == ("gpt2-tiny", "float32")
    assert args["cpu_threads"] == 1 and result["environment"]["torch_threads"] == 1


def test_ceilings(quick_run):
    c = quick_run[0]["ceilings"]
    for key in ("copy_bytes", "copy_ms", "copy_gb_s", "matmul_n", "matmul_ms", "matmul_tflops"):
        assert finite_positive(c[key]), key
    assert c["matmul_dtype"] == "float32"


def test_kernels_run_interpreted_and_match_torch(quick_run):
    k = quick_run[0]["kernels"]
    assert k["mode"] == "interpreted" and "interpreter" in k["note"]
    assert k["args"]["interpret"] and k["args"]["dtype"] == "fp32"
    assert k["all_triton_ok"] is True
    triton_ops = {r["op"] for r in k["results"] if r["impl"] == "triton"}
    kernels = {"add_layernorm", "bias_gelu", "add_rmsnorm", "silu_and_mul", "rotary", "write_kv", "attention"}
    assert kernels <= triton_ops
    for r in k["results"]:
        assert r["ok"], r
        assert r["ms"] is None  # the interpreter's timings mean nothing: none are reported
        assert math.isfinite(r["max_err"])
    assert len(k["table"]) == len(k["results"]) + 1


def test_decode_roofline(quick_run):
    d = quick_run[0]["decode"]
    for key in ("step_ms_median", "step_ms_p10", "step_ms_p90", "weight_bytes", "kv_bytes", "bandwidth_gb_s",
                "roofline_ms", "fraction_of_roofline", "mean_context"):  # fmt: skip
        assert finite_positive(d[key]), key
    assert d["step_ms_p10"] <= d["step_ms_median"] <= d["step_ms_p90"]
    assert "needs CUDA" in d["gpu_profile"]["skipped"]  # said, not silently absent
    assert d["host_profile"] and all(finite_positive(r["calls_per_call"]) for r in d["host_profile"])


def test_prefill_against_peak(quick_run):
    p = quick_run[0]["prefill"]
    assert (p["prompts"], p["prompt_len"], p["tokens"]) == (4, 64, 256)
    for key in ("flops", "step_ms_median", "achieved_tflops", "peak_tflops", "fraction_of_peak"):
        assert finite_positive(p[key]), key
    assert "needs CUDA" in p["gpu_profile"]["skipped"]


def test_ab_both_modes(quick_run):
    ab = quick_run[0]["ab"]
    assert finite_positive(ab["unloaded"]["norm_median_ms"])
    assert finite_positive(ab["unloaded"]["one_at_a_time_rate"])
    assert ab["slos_ms"] and all(finite_positive(v) for v in ab["slos_ms"].values())
    for mode in ("iteration", "request"):
        points = ab["points"][mode]
        assert points, mode
        for point in points:
            assert point["mode"] == mode and point["num_requests"] > 0
            for key in ("offered_rate", "duration_s", "norm_median_ms", "norm_p90_ms", "e2e_median_ms"):
                assert finite_positive(point[key]), (mode, key, point)
        assert [p["offered_rate"] for p in points] == sorted(p["offered_rate"] for p in points)
        assert set(ab["sustained"][mode]) == set(ab["slos_ms"])
        for s in ab["sustained"][mode].values():
            assert s["max_rate"] is None or finite_positive(s["max_rate"])
            assert isinstance(s["never_missed"], bool)
    assert set(ab["ratios"]) == set(ab["slos_ms"])
    for ratio in ab["ratios"].values():
        if ratio["max_rate_ratio"] is None:
            assert ratio["reason"], ratio  # no ratio without saying why
        else:
            assert finite_positive(ratio["max_rate_ratio"])
        assert ratio["crossing_ratio"] is None or finite_positive(ratio["crossing_ratio"])


def test_summary_has_every_headline(quick_run):
    result, summary, _ = quick_run
    assert "**Not a GPU run** (`--device cpu`, torch threads: 1)" in summary
    assert "## Device ceilings" in summary
    assert "## Kernels (`benchmarks/kernels.py`, fp32, Triton interpreter: correctness only)" in summary
    assert "## Engine vs rooflines" in summary
    assert (
        "batch-1 decode step" in summary and f"**{result['decode']['fraction_of_roofline']:.1%}**" in summary
    )
    assert "prefill step, 4 x 64 tokens" in summary
    assert "No GPU busy time for decode: the device profile needs CUDA" in summary
    assert "## Engine-level A/B" in summary and "| iteration |" in summary and "| request |" in summary
    assert "## Errors" not in summary and "## Not run on this device" not in summary


def test_explicit_flags_win_over_quick_defaults():
    gpu_check = load_gpu_check()
    args = gpu_check.parse_args(["--device", "cpu", "--quick", "--model", "gpt2-mini", "--prefill", "2", "32",
                                 "--ab-budget-s", "5"])  # fmt: skip
    assert (args.model, args.prefill, args.ab_budget_s) == ("gpt2-mini", [2, 32], 5.0)
    assert (args.dtype, args.max_seqs, args.decode_steps) == ("float32", 8, 20)  # the rest: --quick's
    full = gpu_check.parse_args([])
    assert {name: getattr(full, name) for name in gpu_check.DEFAULTS} == gpu_check.DEFAULTS
    assert gpu_check.parse_args(["--quick"]).dtype == "bfloat16"  # quick on CUDA keeps the GPU dtype
    assert set(gpu_check.QUICK) == set(gpu_check.DEFAULTS)


# triton imported (compiled) before the script could set TRITON_INTERPRET: the kernels cannot run
# on CPU in that process, and the report must say so rather than leave the section out.
SKIP_SCRIPT = """
import runpy, sys
import triton.language  # compiled mode: TRITON_INTERPRET is unset
sys.argv = [{script!r}, *sys.argv[1:]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def test_kernels_report_why_they_cannot_run(tmp_path):
    script = SKIP_SCRIPT.format(script=str(SCRIPT))
    cmd = [
        sys.executable,
        "-c",
        script,
        "--device",
        "cpu",
        "--quick",
        "--sections",
        "kernels",
        "--out",
        str(tmp_path),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "triton was imported before TRITON_INTERPRET=1" in result["kernels"]["skipped"]
    assert "kernels skipped: cpu: triton was imported" in proc.stdout
    summary = (tmp_path / "summary.md").read_text()
    assert "## Not run on this device" in summary and "- kernels: cpu: triton was imported" in summary
