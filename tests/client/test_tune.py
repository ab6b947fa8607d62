"""`orca-bench --tune` (client/orca_client/tune.py): ORCA's tuning step. The choice on given curves, the
arguments, and the whole command on a tiny model served by a real tritonserver."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
from types import SimpleNamespace

import pytest

from orca_client import bench, report, tune
from orca_client.bench_metrics import Stats


def _point(model: str, rate: float, rps: float, median: float, p90: float, errors: int = 0, truncated: bool = False):
    """What `tune.choose` reads of a run's metrics."""
    return SimpleNamespace(model=model, offered_rate=rate, request_throughput=rps, output_token_throughput=10 * rps,
                           normalized_ms=Stats(10, median, median, p90, p90, p90), errors=errors, truncated=truncated)  # fmt: skip


def test_parse_tune_names_one_variant_per_value():
    spec = tune.parse_tune("max_num_seqs=8, 16,32,16")
    assert spec == tune.TuneSpec("max_num_seqs", ("8", "16", "32"))
    assert spec.variants() == {"max_num_seqs-8": {"max_num_seqs": "8"}, "max_num_seqs-16": {"max_num_seqs": "16"},
                               "max_num_seqs-32": {"max_num_seqs": "32"}}  # fmt: skip
    assert tune.parse_tune("kv_policy=reserve,paged").variant_name("paged") == "kv_policy-paged"
    for bad in ("max_num_seqs", "max_num_seqs=8", "=8,16", "x=a.b,a_b"):
        with pytest.raises(argparse.ArgumentTypeError):
            tune.parse_tune(bad)


def test_the_choice_is_the_highest_throughput_within_the_budget():
    spec = tune.parse_tune("max_num_seqs=8,16,32")
    curves = {
        # 8 meets the budget at both rates; 16 at the first only, with more throughput than 8's best;
        # 32's faster point failed a request, and its other point is over the budget.
        "orca_max_num_seqs-8": [_point("8", 1, 0.9, 20, 30), _point("8", 2, 1.5, 35, 60)],
        "orca_max_num_seqs-16": [_point("16", 1, 1.8, 30, 55), _point("16", 2, 2.5, 80, 90)],
        "orca_max_num_seqs-32": [_point("32", 1, 3.0, 20, 25, errors=1), _point("32", 2, 3.1, 45, 50)],
    }
    chosen = tune.choose(spec, curves, budget_ms=40)
    assert chosen["best"] == "16"
    assert chosen["config_pbtxt"] == 'parameters: { key: "max_num_seqs" value: { string_value: "16" } }'
    by_value = {c["value"]: c for c in chosen["choices"]}
    assert by_value["8"]["max_request_throughput"] == 1.5 and by_value["8"]["points_met"] == 2
    assert by_value["32"]["points_met"] == 0 and by_value["32"]["at_rate"] is None
    # With the p90 held to the budget too, 16's point (p90 55) and 8's faster one (p90 60) drop out.
    strict = tune.choose(spec, curves, budget_ms=40, p90=True)
    assert strict["best"] == "8" and strict["choices"][0]["max_request_throughput"] == 0.9
    # A budget nobody meets: no choice, and the report says what to do.
    none = tune.choose(spec, curves, budget_ms=5)
    assert none["best"] is None and "config_pbtxt" not in none
    assert "No value met the budget" in "\n".join(report.tune_lines(none))
    assert "**(best)**" in "\n".join(report.tune_lines(chosen))


def test_tune_arguments_are_checked():
    with pytest.raises(SystemExit, match="not a parameter of orca's config.pbtxt"):
        bench.main(["--tune", "max_num_seqz=8,16", "--quiet"])
    with pytest.raises(SystemExit, match="--tune-p90 goes with --tune"):
        bench.main(["--tune-p90", "--quiet"])
    with pytest.raises(SystemExit, match="also in --orca-variants"):
        bench.main(["--tune", "max_num_seqs=8,16", "--orca-variants", "max_num_seqs-8:max_num_seqs=4", "--quiet"])


needs_server = pytest.mark.skipif(
    not (os.environ.get("TRITONSERVER") or shutil.which("tritonserver") or importlib.util.find_spec("pytriton")),
    reason="no tritonserver available (pip install nvidia-pytriton)",
)


@needs_server
@pytest.mark.integration
@pytest.mark.slow
def test_tune_picks_the_batch_size_that_meets_the_budget(tiny_checkpoint, tmp_path):
    """A burst of 16 requests on orca with max_num_seqs 1 (they run one after another) and 16 (they
    run together). The budget is one both meet however slow the machine is at that moment (a budget
    relative to the unloaded latency races the clock on two cores), so the choice is the higher
    throughput: 16, by far more than noise (sixteen requests per step against one). Which points
    met the budget and the chosen figures are also recomputed from the recorded runs."""
    path, _ = tiny_checkpoint
    out = tmp_path / "tune"
    argv = [
        "--model", str(path), "--prompt-dist", "uniform:4:8", "--output-dist", "uniform:96:96", "--rates", "burst",
        "--num-requests", "16", "--baseline-batch-sizes", "4", "--unloaded-repeats", "1", "--skip-fairness",
        "--no-echo", "--served-path-streams", "", "--slo-ms", "60000", "--tune", "max_num_seqs=1,16", "--out", str(out),
        "--quiet",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    chosen = data["tune"]
    assert chosen["key"] == "max_num_seqs" and chosen["budget_ms_per_token"] == data["slo"]["ms_per_token"]
    assert chosen["best"] == "16", chosen
    assert chosen["config_pbtxt"] == 'parameters: { key: "max_num_seqs" value: { string_value: "16" } }'
    variants = {m["name"]: m["overrides"] for m in data["models"] if m["kind"] == "orca_variant"}
    assert variants == {"orca_max_num_seqs-1": {"max_num_seqs": "1"}, "orca_max_num_seqs-16": {"max_num_seqs": "16"}}
    for choice in chosen["choices"]:
        runs = [r["metrics"] for r in data["runs"] if r["metrics"]["model"] == f"orca_{choice['variant']}"]
        assert len(runs) == 1 and runs[0]["errors"] == 0 and runs[0]["completed"] == 16
        met = runs[0]["normalized_ms"]["median"] <= chosen["budget_ms_per_token"]
        assert choice["points_met"] == int(met)
        assert choice["max_request_throughput"] == (runs[0]["request_throughput"] if met else 0.0)
    assert "## Tuning" in (out / "summary.md").read_text()
