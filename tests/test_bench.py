"""`orca-bench`: metrics math, workloads and reports without a server; then the whole A/B on a tiny
checkpoint against a real tritonserver (and the echo-only mode), checked from its own raw records."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import random
import shutil
import statistics

import numpy as np
import pytest

from orca_client import bench, bench_metrics, report, workload
from orca_client.bench_metrics import Stats, summarize, sustained_throughput
from orca_client.loadgen import RequestRecord, RunResult, _read_response

# --------------------------------------------------------------------------- metrics (no server)


def _record(i, send, times, tokens, max_tokens=None, error=None, scheduled=None):
    r = RequestRecord(i, scheduled if scheduled is not None else send, prompt_len=4,
                      max_tokens=max_tokens if max_tokens is not None else sum(tokens))
    r.send_time = send
    r.response_times = list(times)
    r.response_tokens = list(tokens)
    r.error = error
    if error is None and times:
        r.done_time = times[-1]
        r.finish_reason = "length"
    return r


def test_stats_percentiles_match_numpy():
    values = [0.001 * x for x in (5, 1, 9, 3, 7, 2, 8, 4, 6, 10)]
    s = Stats.of(values)
    ms = np.array(values) * 1000
    assert s.count == 10
    assert s.mean == pytest.approx(ms.mean())
    assert s.median == pytest.approx(5.5)
    assert s.p90 == pytest.approx(np.percentile(ms, 90))
    assert s.p99 == pytest.approx(np.percentile(ms, 99))
    assert s.max == pytest.approx(10.0)
    empty = Stats.of([])
    assert empty.count == 0 and math.isnan(empty.median)


def test_summarize_per_request_definitions():
    # A streamed request: sent at 1.0, tokens at 1.2, 1.3, 1.5 (the last response carries 2 tokens).
    streamed = _record(0, 1.0, [1.2, 1.3, 1.5], [1, 1, 2])
    # A baseline-style request: one response with all 4 tokens.
    single = _record(1, 2.0, [3.0], [4])
    failed = _record(2, 2.5, [], [], max_tokens=3, error="boom")
    run = RunResult("m", 1.0, [streamed, single, failed], duration_s=4.0, client_cpu_s=0.0)
    m = summarize(run, slo_ms_per_token=200.0)
    assert (m.completed, m.errors, m.num_requests) == (2, 1, 3)
    assert m.request_throughput == pytest.approx(2 / 4.0)  # completed / duration
    assert m.output_token_throughput == pytest.approx(8 / 4.0)
    # e2e: 0.5 s and 1.0 s; normalized: 125 and 250 ms/token.
    assert m.e2e_ms.median == pytest.approx(750.0)
    assert m.normalized_ms.median == pytest.approx((125.0 + 250.0) / 2)
    assert m.ttft_ms.median == pytest.approx((200.0 + 1000.0) / 2)
    # TPOT: (0.5 - 0.2) / 3 for the streamed one; none for the single response (no token pace to see).
    assert m.tpot_ms.count == 1 and m.tpot_ms.mean == pytest.approx(100.0)
    # ITL: one sample per response after the first: 100 and 200 ms.
    assert m.itl_ms.count == 2 and m.itl_ms.mean == pytest.approx(150.0)
    # Goodput: only the streamed request meets 200 ms/token, out of 3 requests.
    assert m.goodput_fraction == pytest.approx(1 / 3)
    assert m.goodput_rps == pytest.approx(1 / 4.0)
    assert m.slo_met is False  # an error fails the point even though the median is within the SLO
    assert m.token_mismatches == 0
    assert m.first_error == "boom"


def test_slo_met_and_token_mismatch():
    records = [_record(i, 0.1 * i, [0.1 * i + 0.05 * (k + 1) for k in range(4)], [1] * 4) for i in range(5)]
    records[0].max_tokens = 7  # the trace asked for 7: a mismatch
    m = summarize(RunResult("m", 2.0, records, duration_s=1.0, client_cpu_s=0.01), slo_ms_per_token=50.0)
    assert m.normalized_ms.median == pytest.approx(50.0)
    assert m.slo_met is True
    assert m.token_mismatches == 1
    assert m.client_cpu_us_per_response == pytest.approx(1e6 * 0.01 / 20)
    assert summarize(RunResult("m", 2.0, records, 1.0, 0.0), slo_ms_per_token=49.0).slo_met is False


def _point(rate, throughput, median, met, errors=0, truncated=False):
    stats = Stats(1, median, median, median, median, median)
    return bench_metrics.RunMetrics(
        model="m", offered_rate=rate, num_requests=10, completed=10 - errors, errors=errors, truncated=truncated,
        duration_s=10.0, request_throughput=throughput, output_token_throughput=0.0, e2e_ms=stats,
        normalized_ms=stats, ttft_ms=stats, tpot_ms=stats, itl_ms=stats, send_lag_ms=stats, slo_met=met,
    )  # fmt: skip


def test_sustained_throughput_and_interpolation():
    points = [_point(1.0, 0.9, 50, True), _point(2.0, 1.8, 80, True), _point(3.0, 2.4, 180, False),
              _point(4.0, 2.5, 900, False)]
    s = sustained_throughput(points, slo_ms_per_token=100.0)
    assert s.max_throughput == pytest.approx(1.8) and s.at_rate == 2.0
    # The SLO (100) lies 20/100 of the way from 80 to 180: throughput 1.8 + 0.2 * 0.6.
    assert s.interpolated == pytest.approx(1.92)
    assert (s.points_met, s.points, s.below_grid, s.above_grid) == (2, 4, False, False)
    none = sustained_throughput([_point(1.0, 0.5, 500, False)], 100.0)
    assert none.max_throughput == 0 and none.below_grid
    top = sustained_throughput([_point(1.0, 0.9, 50, True), _point(2.0, 1.9, 60, True)], 100.0)
    assert top.above_grid and top.interpolated is None
    assert bench_metrics.ratio(3.0, 0.0) == math.inf and math.isnan(bench_metrics.ratio(0.0, 0.0))


def test_headline_ratio_and_qualifiers():
    from orca_client.bench_server import ServedModel

    models = [ServedModel("orca", "orca", max_num_seqs=32), ServedModel("b8", "baseline", 8), ServedModel("b32", "baseline", 32)]
    sustained = {
        "orca": bench_metrics.Sustained("orca", 2.0, 2.0, None, 3, 4),
        "b8": bench_metrics.Sustained("b8", 0.2, 0.2, None, 1, 2),
        "b32": bench_metrics.Sustained("b32", 0.5, 0.5, 0.6, 2, 3),
    }
    h = bench.headline(sustained, models, [0.2, 0.5])
    assert h["best_baseline"] == "b32" and h["ratio"] == pytest.approx(4.0)
    assert h["ratio_interpolated"] == pytest.approx(2.0 / 0.6)
    sustained["b8"] = bench_metrics.Sustained("b8", 0.0, None, None, 0, 1, below_grid=True)
    sustained["b32"] = bench_metrics.Sustained("b32", 0.0, None, None, 0, 1, below_grid=True)
    h = bench.headline(sustained, models, [0.25, 0.5])
    assert h["ratio"] == math.inf and h["ratio_lower_bound"] == pytest.approx(8.0)
    assert "at least" in h["qualifier"]


def test_read_response_from_raw_protobuf():
    from tritonclient.grpc import InferResult, service_pb2

    response = service_pb2.ModelInferResponse()
    for name, dtype in [("text_output", "BYTES"), ("output_ids", "INT32"), ("finish_reason", "BYTES"),
                        ("num_input_tokens", "INT32"), ("num_output_tokens", "INT32")]:
        out = response.outputs.add()
        out.name, out.datatype = name, dtype
    ids = np.array([7, 8, 9], dtype=np.int32).tobytes()
    response.raw_output_contents.extend([b"\x02\x00\x00\x00ab", ids, b"\x06\x00\x00\x00length",
                                         np.int32(5).tobytes(), np.int32(12).tobytes()])
    record = RequestRecord(0, 0.0, 5, 12)
    assert _read_response(InferResult(response), record, 1.5) is True
    assert record.response_tokens == [3] and record.reported_output_tokens == 12
    assert record.finish_reason == "length" and record.done_time == 1.5
    # A streamed delta: empty finish_reason is not final.
    response.raw_output_contents[2] = b"\x00\x00\x00\x00"
    assert _read_response(InferResult(response), record, 1.6) is False


# -------------------------------------------------------------------------- workloads (no server)


def test_synthetic_trace_seeded_and_rescaled():
    a = workload.synthetic_trace(50, "uniform:4:16", "lognormal:8:64", 100, request_rate=1.0, seed=3)
    b = workload.synthetic_trace(50, "uniform:4:16", "lognormal:8:64", 100, request_rate=1.0, seed=3)
    assert a == b
    assert all(4 <= r.prompt_len <= 16 and 1 <= r.max_tokens <= 64 for r in a)
    fast = workload.at_rate(a, 4.0)
    assert [r.max_tokens for r in fast] == [r.max_tokens for r in a]
    assert workload.mean_rate(fast) == pytest.approx(4.0)
    assert all(r.arrival == 0 for r in workload.at_rate(a, math.inf))
    burst = workload.burst_trace(5, 10, 3, 100)
    assert all(r.arrival == 0 and r.prompt_len == 10 and r.max_tokens == 3 for r in burst)


def test_bursty_arrivals_have_the_asked_cv():
    rng = random.Random(0)
    gaps = [workload.inter_arrival(2.0, 3.0, rng) for _ in range(20000)]
    assert statistics.fmean(gaps) == pytest.approx(0.5, rel=0.1)
    assert statistics.pstdev(gaps) / statistics.fmean(gaps) == pytest.approx(3.0, rel=0.15)
    with pytest.raises(ValueError):
        workload.parse_arrival("gamma:-1")


def test_dist_parsing_and_fit_checks(tmp_path):
    assert workload.parse_dist("fixed:7") == ("fixed", 7.0, 7.0)
    assert workload.dist_median("uniform:10:20") == 15 and workload.dist_median("lognormal:32:256") == 32
    for bad in ("uniform:0:3", "normal:1:2", "uniform:5"):
        with pytest.raises(ValueError):
            workload.parse_dist(bad)
    trace = [workload.TraceRequest(0.0, [1, 2, 3], 10)]
    workload.check_fits(trace, context_len=13, vocab_size=4)
    with pytest.raises(ValueError, match="context"):
        workload.check_fits(trace, context_len=12, vocab_size=4)
    with pytest.raises(ValueError, match="vocabulary"):
        workload.check_fits(trace, context_len=64, vocab_size=3)
    mixed = [workload.TraceRequest(0.5, [1, 2], 3), workload.TraceRequest(0.1, [], 4, prompt_text="héllo")]
    path = tmp_path / "t.jsonl"
    workload.save_trace(mixed, path)
    loaded = workload.load_trace(path)
    assert [r.prompt_text for r in loaded] == ["héllo", None]  # sorted by arrival
    assert loaded[1].prompt_ids == [1, 2]


def test_report_from_a_synthetic_result(tmp_path):
    records = [_record(i, 0.1 * i, [0.1 * i + 0.02 * (k + 1) for k in range(3)], [1] * 3) for i in range(4)]
    runs = []
    for name, scale in (("orca", 1.0), ("baseline_bs8", 3.0)):
        for rate in (1.0, 2.0):
            raw = RunResult(name, rate, records, duration_s=2.0 * scale, client_cpu_s=0.0)
            runs.append({"metrics": summarize(raw, 30.0), "raw": raw})
    result = {
        "command": "orca-bench --test", "labels": {"orca": "orca", "baseline_bs8": "baseline (batch 8)"},
        "setup": {"model": "tiny", "device": "cpu", "dtype": "float32", "workload": "test"},
        "slo": {"factor": 6.0, "ms_per_token": 30.0},
        "runs": runs, "notes": ["a note"],
        "sustained": {"orca": sustained_throughput([r["metrics"] for r in runs[:2]], 30.0)},
        "headline": {"orca_rps": 2.0, "best_baseline": "baseline_bs8", "best_baseline_rps": 0.5, "ratio": 4.0,
                     "ratio_interpolated": None, "qualifier": ""},
    }  # fmt: skip
    paths = report.write_all(result, tmp_path)
    data = json.loads(paths["json"].read_text())
    assert data["runs"][0]["raw"]["requests"][0]["response_tokens"] == [1, 1, 1]
    text = paths["markdown"].read_text()
    assert "**4.00×**" in text and "orca-bench --test" in text and "baseline (batch 8)" in text
    assert paths["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


# ------------------------------------------------------------------------ real server (integration)

needs_server = pytest.mark.skipif(
    not (os.environ.get("TRITONSERVER") or shutil.which("tritonserver") or importlib.util.find_spec("pytriton")),
    reason="no tritonserver available (pip install nvidia-pytriton)",
)


def _recomputed_median_normalized_ms(raw: dict) -> float:
    done = [r for r in raw["requests"] if r["error"] is None and r["done_time"] is not None]
    return statistics.median(1000 * (r["done_time"] - r["send_time"]) / sum(r["response_tokens"]) for r in done)


@needs_server
@pytest.mark.integration
@pytest.mark.slow
def test_ab_sweep_on_a_tiny_model(tiny_checkpoint, tmp_path):
    path, config = tiny_checkpoint
    out = tmp_path / "bench"
    argv = [
        "--model", str(path), "--prompt-dist", "uniform:4:24", "--output-dist", "uniform:1:24",
        "--rates", "3,12", "--num-requests", "10", "--baseline-batch-sizes", "4,8",
        "--unloaded-repeats", "1", "--fairness-tokens", "8", "--no-early-stop", "--out", str(out), "--quiet",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    assert (out / "summary.md").is_file() and (out / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert data["command"] == "orca-bench " + " ".join(argv)

    # The same trace the bench replayed, rebuilt independently from the seed.
    trace = workload.synthetic_trace(64, "uniform:4:24", "uniform:1:24", config.vocab_size, request_rate=1.0, seed=0)
    runs = data["runs"]
    assert {(r["metrics"]["model"], r["metrics"]["offered_rate"]) for r in runs} == {
        (m, rate) for m in ("orca", "baseline_bs4", "baseline_bs8") for rate in (3.0, 12.0)}
    for run in runs:
        m, raw = run["metrics"], run["raw"]
        assert m["errors"] == 0 and m["completed"] == 10 and not m["truncated"]
        for rec, req in zip(raw["requests"], trace[:10], strict=True):
            # Token counts match the trace: what arrived, what the server reported, what was asked.
            assert rec["max_tokens"] == req.max_tokens and rec["prompt_len"] == req.prompt_len
            assert sum(rec["response_tokens"]) == req.max_tokens == rec["reported_output_tokens"]
            assert rec["finish_reason"] == "length"
            # orca streams (a response may merge tokens when responses fall behind the engine);
            # the request-level baseline answers once at the end.
            assert 1 <= len(rec["response_times"]) <= (req.max_tokens if m["model"] == "orca" else 1)
        if m["model"] == "orca":
            assert sum(len(r["response_times"]) for r in raw["requests"]) > len(raw["requests"])
        assert m["request_throughput"] == pytest.approx(m["completed"] / m["duration_s"])
        end = max(r["done_time"] for r in raw["requests"])
        assert m["duration_s"] == pytest.approx(end)
        assert m["normalized_ms"]["median"] == pytest.approx(_recomputed_median_normalized_ms(raw), rel=1e-9)
        if m["model"] != "orca":
            assert 1 <= m["batches"] <= 10  # Triton's batcher ran the baseline's requests in batches

    assert data["slo"]["ms_per_token"] == pytest.approx(6.0 * data["unloaded"]["median_ms_per_token"])
    for run in runs:
        assert run["metrics"]["slo_met"] == (run["metrics"]["normalized_ms"]["median"] <= data["slo"]["ms_per_token"])
    assert set(data["sustained"]) == {"orca", "baseline_bs4", "baseline_bs8"}
    assert data["headline"]["best_baseline"] in ("baseline_bs4", "baseline_bs8")
    fair = data["fairness"]
    assert len(fair["runs"]) == 2 and fair["runs"][1]["batches"] >= 1
    assert data["loadgen_overhead"]["burst_run"]["errors"] == 0
    assert data["loadgen_overhead"]["fraction_of_unloaded"] > 0


@needs_server
@pytest.mark.integration
def test_echo_mode_measures_the_load_generator(tmp_path):
    out = tmp_path / "echo"
    assert bench.main(["--echo", "--rates", "40", "--num-requests", "24", "--out", str(out), "--quiet"]) == 0
    data = json.loads((out / "bench.json").read_text())
    overhead = data["loadgen_overhead"]
    for key in ("rate_run", "burst_run"):
        m = overhead[key]
        assert m["errors"] == 0 and m["token_mismatches"] == 0 and m["completed"] == m["num_requests"]
        assert m["client_cpu_us_per_response"] > 0
    assert overhead["burst_run"]["num_requests"] >= 64
    assert "echo" in overhead["summary"]
