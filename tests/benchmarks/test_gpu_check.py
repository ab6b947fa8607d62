"""`make gpu-check`'s script (benchmarks/gpu_check.py) end to end on CPU, as CI runs it:
`--device cpu --quick` runs every section (ceilings, kernels in Triton's interpreter, decode and
prefill rooflines, graphs on vs off on the static-buffer path, the iteration- vs request-level A/B)
with small settings. The figures are whatever this machine measures: the tests check their structure
and sanity, never their values or the clock.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bench_script import load_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.py"
SECTIONS = ("ceilings", "kernels", "decode", "prefill", "graphs", "ab")
# The graphs section's targets that name no model (the others name GPT-2-medium or Qwen2.5-0.5B).
MODEL_FREE_TARGETS = {"kernels_per_layer", "host_ms@1", "host_ms@64", "gpu_idle@64"}


def load_gpu_check():
    return load_script("gpu_check")


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


def test_graphs_on_vs_off_with_equal_tokens(quick_run):
    g = quick_run[0]["graphs"]
    assert g["errors"] == {}
    assert g["tokens_equal"] is True  # the flag main() fails the run on
    assert g["captured"] is False and "no CUDA graph is captured on cpu" in g["note"]  # said, not implied
    assert list(g["models"]) == ["gpt2-tiny", "llama-tiny"]
    for name, m in g["models"].items():
        # CPU: the static buffers, run eagerly; async: the same, with async scheduling
        assert m["modes"] == {"on": "static", "off": "eager", "async": "static+async"}, name
        assert m["captured"] is False and m["max_num_seqs"] == 8 and m["capture_sizes"] == [1, 2, 4, 8]
        assert m["dtype"] == "float32" and m["layers"] == 2
        assert m["tokens_equal"] is True and m["token_check"]["mismatched"] == []
        assert m["token_check"]["requests"] == 8
        assert m["token_check"]["tokens"] == sum(4 + 4 * i for i in range(8))  # outputs of 4, 8, ... 32
        for mode in ("on", "off", "async"):
            assert finite_positive(m["build_seconds"][mode])
            assert list(m["decode"][mode]) == ["1", "2", "8"]
            for running, f in m["decode"][mode].items():
                assert f["running"] == int(running) and f["steps"] == (20 if running == "1" else 4)
                for key in ("step_ms_median", "step_ms_p10", "step_ms_p90", "tokens_per_s"):
                    assert finite_positive(f[key]), (name, mode, running, key)
                assert f["step_ms_p10"] <= f["step_ms_median"] <= f["step_ms_p90"]
                assert "gpu_profile" not in f and "host_ms" not in f  # no device profile off CUDA
        assert m["batch1_step_ms"]["on"] == m["decode"]["on"]["1"]["step_ms_median"]
        assert finite_positive(m["batch1_speedup"])
        assert "needs CUDA" in m["kernels"]["skipped"]
        # The targets name GPT-2-medium and Qwen2.5-0.5B: only the model-independent ones
        # appear for the tiny models, none judged off a GPU.
        assert {t["key"] for t in m["targets"]} == MODEL_FREE_TARGETS
        assert all(t["met"] is None and "not a GPU run" in t["why"] for t in m["targets"])


def test_graph_targets_judge_only_gpu_figures():
    gpu_check = load_gpu_check()

    def figures(step_ms: float, rate: float, host_ms: float, idle: float) -> dict:
        return {
            "model": "gpt2-medium", "modes": {"on": "captured", "off": "eager"},
            "kernels": {"kernels_per_layer": 7.0},
            "decode": {"on": {"1": {"step_ms_median": step_ms, "host_ms": host_ms}, "64": {"host_ms": host_ms,
                       "gpu_idle_fraction": idle}, "256": {"tokens_per_s": rate}}},
        }  # fmt: skip

    def judged(m: dict) -> dict:
        return {t["key"]: t for t in gpu_check.graph_targets(m, gpu_check.torch.device("cuda"))}

    rows = judged(figures(0.4, 20000.0, 0.1, 0.05))
    assert set(rows) == MODEL_FREE_TARGETS | {"batch1_step_ms", "tokens_per_s@256"}
    assert rows["batch1_step_ms"]["met"] is True and rows["batch1_step_ms"]["stretch_met"] is True
    assert rows["tokens_per_s@256"]["met"] is True and rows["kernels_per_layer"]["met"] is False
    assert rows["host_ms@1"]["met"] is True and rows["gpu_idle@64"]["met"] is True
    rows = judged(figures(1.1, 9000.0, 0.5, 0.3))
    assert not any(
        rows[k]["met"] for k in ("batch1_step_ms", "tokens_per_s@256", "host_ms@64", "gpu_idle@64")
    )
    uncaptured = figures(0.4, 20000.0, 0.1, 0.05) | {"modes": {"on": "eager", "off": "eager"}}
    rows = judged(uncaptured)
    assert rows["host_ms@1"]["met"] is None and "not captured" in rows["host_ms@1"]["why"]


# The graphs-on engine built with other weights (seed 1): its tokens differ from the eager engine's.
# In a fresh process: main() imports triton, which must not happen in compiled mode in this one.
MISMATCH_SCRIPT = """
import importlib.util, sys
spec = importlib.util.spec_from_file_location("orca_bench_gpu_check", {script!r})
gpu_check = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = gpu_check
spec.loader.exec_module(gpu_check)
real_llm = gpu_check.LLM
gpu_check.LLM = lambda *args, **kwargs: real_llm(*args, **kwargs, seed=0 if kwargs["enforce_eager"] else 1)
sys.exit(gpu_check.main(sys.argv[1:]))
"""


def test_graph_tokens_that_differ_fail_the_run(tmp_path):
    argv = ["--device", "cpu", "--quick", "--sections", "graphs", "--graph-models", "gpt2-tiny", "--graph-batches", "1",
            "--decode-steps", "2", "--out", str(tmp_path)]  # fmt: skip
    cmd = [sys.executable, "-c", MISMATCH_SCRIPT.format(script=str(SCRIPT)), *argv]
    proc = subprocess.run(cmd, cwd=ROOT, env=clean_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 1, (proc.stdout + proc.stderr)[-4000:]
    assert "graph tokens differ from eager tokens: gpt2-tiny: " in proc.stderr
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["errors"] == {}  # nothing broke: the tokens differ, and that alone fails the run
    g = result["graphs"]
    assert g["tokens_equal"] is False and g["models"]["gpt2-tiny"]["token_check"]["mismatched"]
    assert "- gpt2-tiny: **False**" in (tmp_path / "summary.md").read_text()


def test_ab_both_modes(quick_run):
    ab = quick_run[0]["ab"]
    assert finite_positive(ab["unloaded"]["norm_median_ms"])
    assert finite_positive(ab["unloaded"]["one_at_a_time_rate"])
    assert ab["slos_ms"] and all(finite_positive(v) for v in ab["slos_ms"].values())
    assert ab["reps"] == 3 and ab["rates"] == "achieved"
    assert ab["iteration_max_batch"] == 8 and ab["request_batches"] == [2, 8]
    for mode in ("iteration", "request"):
        points = ab["points"][mode]
        assert points, mode
        for point in points:
            assert point["mode"] == mode and point["num_requests"] > 0
            for key in ("offered_rate", "duration_s", "norm_median_ms", "norm_p90_ms", "e2e_median_ms"):
                assert finite_positive(point[key]), (mode, key, point)
            # Three runs of the point (one if the first left requests unfinished: it fails every SLO);
            # the medians lie within the runs' ranges.
            assert point["reps"] == len(point["runs"])
            assert point["reps"] == 3 or (point["reps"] == 1 and point["censored"] > 0)
            for key in ("achieved_rate", "output_tokens_per_s", "norm_median_ms"):
                lo, hi = point[f"{key}_range"]
                values = [r[key] for r in point["runs"]]
                assert lo <= point[key] <= hi and [lo, hi] == [min(values), max(values)]
            for run in point["runs"]:
                assert run["completed"] + run["censored"] == run["num_requests"]
                # Achieved: completed requests over the run's wall time, never the offered rate.
                assert math.isclose(run["achieved_rate"], run["completed"] / run["duration_s"])
        by_batch = {}
        for p in points:
            by_batch.setdefault(p["max_batch"], []).append(p["offered_rate"])
        assert all(rates == sorted(rates) for rates in by_batch.values())
        assert set(by_batch) == ({8} if mode == "iteration" else {2, 8})
        assert set(ab["sustained"][mode]) == set(ab["slos_ms"])
        for s in ab["sustained"][mode].values():
            assert s["max_rate"] is None or finite_positive(s["max_rate"])
            assert isinstance(s["never_missed"], bool)
    assert set(ab["sustained_request_by_batch"]) == {"2", "8"}
    for k, baseline in ab["sustained"]["request"].items():  # the best max batch at each SLO
        rates = [s[k]["max_rate"] for s in ab["sustained_request_by_batch"].values()]
        rates = [r for r in rates if r is not None]
        assert baseline["max_rate"] == (max(rates) if rates else None)
        assert baseline["max_batch"] in ((2, 8) if rates else (None,))
    # Sustained rates are achieved ones: each is some passing point's median achieved rate.
    achieved = {p["achieved_rate"] for m in ("iteration", "request") for p in ab["points"][m]}
    for mode in ("iteration", "request"):
        assert {s["max_rate"] for s in ab["sustained"][mode].values()} - {None} <= achieved
    assert set(ab["ratios"]) == set(ab["slos_ms"])
    for ratio in ab["ratios"].values():
        if ratio["max_rate_ratio"] is None:
            assert ratio["reason"], ratio  # no ratio without saying why
        else:
            assert finite_positive(ratio["max_rate_ratio"])
        assert ratio["crossing_ratio"] is None or finite_positive(ratio["crossing_ratio"])


def test_finished_tokens_only_count(monkeypatch):
    """A run cut off at its time limit counts its finished requests' tokens, not the trace's."""
    gpu_check = load_gpu_check()
    from orca_backend import LLM
    from orca_client.workload import TraceRequest

    llm = LLM("gpt2-tiny", kv_capacity_tokens=1024, max_num_seqs=1, scheduling="request")
    llm.generate([[1, 2, 3]], gpu_check.SamplingParams(max_tokens=2))  # first-call costs, unclocked
    trace = [TraceRequest(0.0, [1, 2, 3], 2), TraceRequest(0.0, [4, 5, 6], 200)]
    steps = [0]
    real_step = llm.engine.step

    def step() -> None:  # a slow engine: the second request cannot finish within the limit
        steps[0] += 1
        real_step()
        if steps[0] > 3:
            gpu_check.time.sleep(0.05)

    monkeypatch.setattr(llm.engine, "step", step)
    run, _, _ = gpu_check.replay(llm, trace, time_limit_s=1.0)
    assert (run.completed, run.censored) == (1, 1)
    assert math.isclose(run.output_tokens_per_s, 2 / run.duration_s)


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
    assert "## CUDA graphs: decode steps graphed vs eager" in summary
    assert "**Graphs not captured**: no CUDA graph is captured on cpu" in summary
    assert "| gpt2-tiny | on (static) |" in summary and "| llama-tiny | off (eager) |" in summary
    assert "- gpt2-tiny: **True**" in summary and "- llama-tiny: **True**" in summary
    assert (
        "| kernels per decoder layer in a decode step | gpt2-tiny | - | ≤ 6 | n/a (not a GPU run" in summary
    )
    assert "## Engine-level A/B" in summary
    assert "| iteration | 8 |" in summary and "| request | 2 |" in summary and "| request | 8 |" in summary
    assert "**each point run 3 times**" in summary and "Rates are **achieved**" in summary
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
