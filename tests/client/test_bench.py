"""`orca-bench`: metrics math, workloads and reports without a server; then the whole A/B on a tiny
checkpoint against a real tritonserver (and the echo-only mode), checked from its own raw records."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import shutil
import statistics
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from orca_client import bench, bench_metrics, report, served_path, workload
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
                        ("num_input_tokens", "UINT32"), ("num_output_tokens", "UINT32")]:
        out = response.outputs.add()
        out.name, out.datatype = name, dtype
    ids = np.array([7, 8, 9], dtype=np.int32).tobytes()
    response.raw_output_contents.extend([b"\x02\x00\x00\x00ab", ids, b"\x06\x00\x00\x00length",
                                         np.uint32(5).tobytes(), np.uint32(12).tobytes()])
    record = RequestRecord(0, 0.0, 5, 12)
    assert _read_response(InferResult(response), record, 1.5) is True
    assert record.response_tokens == [3] and record.reported_output_tokens == 12
    assert record.finish_reason == "length" and record.done_time == 1.5
    # A streamed delta: finish_reason "None" is not final, and its count adds to the total.
    response.raw_output_contents[2] = b"\x04\x00\x00\x00None"
    response.raw_output_contents[4] = np.uint32(3).tobytes()
    assert _read_response(InferResult(response), record, 1.6) is False
    assert record.reported_output_tokens == 15 and record.finish_reason == "length"


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


# ------------------------------------------------------------------- served-path stage (no server)

TICK = 1 / served_path.CLOCK_TICKS


def _stat_line(pid, comm, ppid, utime, stime, start=1000):
    # /proc/<pid>/stat: pid (comm) state ppid pgrp session tty tpgid flags minflt cminflt majflt cmajflt
    # utime stime cutime cstime priority nice threads itrealvalue starttime ...
    fields = ["S", ppid, pid, pid, 0, -1, 0, 0, 0, 0, 0, utime, stime, 7, 7, 20, 0, 1, 0, start, 0, 0]
    return f"{pid} ({comm}) " + " ".join(map(str, fields)) + "\n"


def _stub_cmdline(repo, model):
    # As observed on tritonserver 2.51 (nvidia-pytriton): <stub> <repo>/<model>/<version>/model.py <shm region>
    # <default size> <growth> <parent pid> <backend dir> <ipc handle> <instance> <runtime model dir>
    return [f"{repo}/../backends/python/triton_python_backend_stub", f"{repo}/{model}/1/model.py",
            "triton_python_backend_shm_region_1", "1048576", "1048576", "100", f"{repo}/../backends/python", "336",
            f"{model}_0_0", "DEFAULT"]


def _fake_proc(root, procs):
    for pid, (comm, ppid, ticks, argv) in procs.items():
        (root / str(pid)).mkdir()
        (root / str(pid) / "stat").write_text(_stat_line(pid, comm, ppid, ticks, 0))
        (root / str(pid) / "cmdline").write_bytes(b"\0".join(a.encode() for a in argv) + b"\0")
    (root / "self").mkdir()  # non-numeric entries are ignored


def test_parse_stat_counts_fields_after_the_last_parenthesis():
    stat = served_path.parse_stat(_stat_line(4242, "py (stub) x", 17, utime=30, stime=12, start=987654))
    assert (stat.pid, stat.ppid, stat.start_ticks) == (4242, 17, 987654)
    assert stat.cpu_s == pytest.approx(42 * TICK)


def test_process_tree_classifies_stubs_and_everything_below_them(tmp_path):
    repo = "/tmp/orca-bench-x/repository"
    _fake_proc(tmp_path, {
        100: ("tritonserver", 1, 50, ["/opt/tritonserver/bin/tritonserver", "--model-repository=" + repo]),
        101: ("triton_python_", 100, 400, _stub_cmdline(repo, "orca")),
        102: ("triton_python_", 100, 10, _stub_cmdline(repo, "baseline_bs8")),
        103: ("python", 101, 300, ["python", "-c", "engine core"]),  # an engine process of orca's stub
        104: ("python", 103, 200, ["python", "-c", "worker"]),  # and a worker below it
        105: ("sh", 100, 5, ["sh"]),
        200: ("unrelated", 1, 999, ["/usr/bin/unrelated"]),
    })  # fmt: skip
    tree = served_path.process_tree(100, proc=tmp_path)
    assert sorted(p.pid for p in tree) == [100, 101, 102, 103, 104, 105]
    roles = served_path.classify(tree, 100)
    assert roles == {100: ("tritonserver", None), 101: ("stub", "orca"), 102: ("stub", "baseline_bs8"),
                     103: ("engine", "orca"), 104: ("engine", "orca"), 105: ("other", None)}
    # Without the script path, the instance name (<model>_<instance>_<device>) names the model.
    assert served_path.stub_model(("/x/triton_python_backend_stub", "a", "b", "c", "d", "e", "f", "g", "my_model_0_0")) \
        == "my_model"
    assert served_path.stub_model(("python", "x.py")) is None


def test_cpu_split_per_role_and_model_with_processes_coming_and_going():
    def p(pid, ppid, ticks, argv=(), start=1000):
        return served_path.ProcStat(pid, ppid, start, ticks * TICK, tuple(argv))

    stub = tuple(_stub_cmdline("/r", "orca"))
    before = [p(100, 1, 50), p(101, 100, 400, stub), p(103, 101, 300), p(104, 103, 200), p(106, 101, 5)]
    after = [p(100, 1, 70), p(101, 100, 700, stub), p(103, 101, 350),
             p(104, 103, 20, start=2000),  # pid reused by a new process: all of its CPU is new
             p(107, 101, 8)]  # started during the run; 106 exited (its CPU since `before` is lost)
    split = served_path.cpu_split(before, after, 100)
    assert split.tritonserver == pytest.approx(20 * TICK)
    assert split.stub == {"orca": pytest.approx(300 * TICK)}
    assert split.engine == {"orca": pytest.approx((50 + 20 + 8) * TICK)}
    assert (split.other, split.appeared, split.vanished) == (0.0, 2, 2)
    assert split.processes == {"tritonserver": 1, "stub": 1, "engine": 3}


def test_served_path_limits_rows_and_fairness_ratio():
    config = 'parameters { key: "max_num_seqs" value: { string_value: "32" } }\n' \
             'parameters { key: "kv_capacity_tokens" value: { string_value: "16384" } }\n'
    assert served_path.raised_limits(config, [64, 256], 96, None, None) == {
        "max_num_seqs": "256", "kv_capacity_tokens": str(256 * 96)}
    assert served_path.raised_limits(config, [4, 8], 96, None, None) == {}  # never lowered
    assert served_path.raised_limits(config, [64, 256], 96, 48, 100000) == {}  # flags win
    assert served_path.does_not_fit(64, 96, 1024, 48, None).startswith("orca's max_num_seqs is 48")
    assert "kv_capacity_tokens" in served_path.does_not_fit(64, 96, 1024, 64, 6000)
    assert "context" in served_path.does_not_fit(4, 96, 64, 64, None)
    assert served_path.does_not_fit(64, 96, 1024, 64, 64 * 96) is None

    cpu = {"tritonserver": 0.2, "stub": {"orca": 1.5, "baseline_bs8": 0.01}, "engine": {"orca": 0.3}}
    served = [{"tokens_per_s": 900.0, "errors": 0, "output_tokens": 1000, "responses": 950, "client_cpu_s": 0.25,
               "server_cpu_s": cpu},
              {"tokens_per_s": 800.0, "errors": 0, "output_tokens": 1000, "responses": 1000, "client_cpu_s": 0.3,
               "server_cpu_s": None}]  # fmt: skip
    row = served_path._row(64, "orca", served, {"tokens_per_s": 1800.0, "cpu_us_per_token": 1000.0})
    assert row["served_tokens_per_s"] == 900.0 and row["served_over_offline"] == pytest.approx(0.5)
    assert (row["stub_cpu_us_per_token"], row["engine_cpu_us_per_token"]) == (pytest.approx(1500), pytest.approx(300))
    assert row["tritonserver_cpu_us_per_token"] == pytest.approx(200)
    assert row["client_cpu_us_per_token"] == pytest.approx(250)
    assert row["server_cpu_efficiency"] == pytest.approx(1000 / 2000)
    assert row["responses_per_token"] == pytest.approx(0.95)
    no_cpu = served_path._row(64, "orca", served[1:], {"tokens_per_s": 1800.0, "cpu_us_per_token": 1000.0})
    assert no_cpu["stub_cpu_us_per_token"] is None and no_cpu["server_cpu_efficiency"] is None  # --url: no pid

    runs = [{"label": "orca", "requests": 32, "token_throughput": 300.0},
            {"label": "baseline (batch 32)", "requests": 32, "token_throughput": 200.0}]
    ratio = served_path.fairness_ratio({"runs": runs})
    assert ratio["orca_over_baseline"] == pytest.approx(1.5) and ratio["baseline"] == "baseline (batch 32)"
    assert served_path.fairness_ratio({"runs": runs[:1]}) is None and served_path.fairness_ratio(None) is None


def test_served_path_section_in_the_report():
    row = {"streams": 64, "skipped": None, "offline_tokens_per_s": 1800.0, "offline_cpu_us_per_token": 1000.0,
           "served_tokens_per_s": 900.0, "served_over_offline": 0.5, "stub_cpu_us_per_token": 1500.0,
           "engine_cpu_us_per_token": 0.0, "tritonserver_cpu_us_per_token": 200.0, "client_cpu_us_per_token": 250.0,
           "server_cpu_efficiency": 0.59, "responses_per_token": 0.95, "served_errors": 0}
    section = {"prompt_len": 32, "max_tokens": 64, "repeats": 2, "notes": ["raised max_num_seqs"],
               "rows": [row, {"streams": 256, "skipped": "orca's max_num_seqs is 32 < 256: the burst would queue"}],
               "fairness": {"baseline": "baseline (batch 32)", "requests": 32, "orca_tokens_per_s": 300.0,
                            "baseline_tokens_per_s": 200.0, "orca_over_baseline": 1.5}}  # fmt: skip
    text = report.render_markdown({"served_path": section, "command": "orca-bench --served-path-only"})
    assert "## Served path" in text and "server-CPU efficiency" in text
    assert "| 64 | 1800.0 | 1000 | 900.0 | 0.50 | 1500 | 0 | 200 | 250 | 0.59 | 0.95 |" in text
    assert "| 256 | skipped: orca's max_num_seqs is 32 < 256" in text
    assert "orca/baseline = **1.50×**" in text and "- raised max_num_seqs" in text
    table = [line for line in text.splitlines() if line.startswith("| 256")][0]
    assert table.count("|") == text.splitlines()[text.splitlines().index(table) - 2].count("|")  # 11 columns
    no_baseline = report.render_markdown({"served_path": {**section, "fairness": None}})
    assert "no baseline ran it" in no_baseline


def test_served_path_flags():
    parser = bench.build_parser()
    args = parser.parse_args([])
    assert (args.served_path_streams, args.served_path_prompt, args.served_path_tokens) == ([64, 256], 32, 64)
    assert args.served_path_repeats == 2 and not args.served_path_only
    args = parser.parse_args(["--served-path-streams", "256,4,64", "--served-path-only", "--served-path-repeats", "1",
                              "--served-path-prompt", "8", "--served-path-tokens", "4"])
    assert (args.served_path_streams, args.served_path_only, args.served_path_repeats) == ([4, 64, 256], True, 1)
    assert (args.served_path_prompt, args.served_path_tokens) == (8, 4)
    assert parser.parse_args(["--served-path-streams", ""]).served_path_streams == []
    with pytest.raises(SystemExit):
        parser.parse_args(["--served-path-streams", "0,4"])
    with pytest.raises(SystemExit, match="served-path-only"):
        bench.main(["--served-path-only", "--served-path-streams", ""])


# ----------------------------------------------------------- orca variants and shared prefixes (no server)


def test_orca_variants_parsing():
    parser = bench.build_parser()
    assert parser.parse_args([]).orca_variants == {}
    spec = "cached:kv_policy=paged,enable_prefix_caching=TRUE;chunked:max_num_batched_tokens=256;"
    assert parser.parse_args(["--orca-variants", spec]).orca_variants == {
        "cached": {"kv_policy": "paged", "enable_prefix_caching": "true"},
        "chunked": {"max_num_batched_tokens": "256"}}
    assert bench.parse_orca_variants("same") == {"same": {}}  # an unchanged copy: an A/A check
    assert bench.parse_orca_variants(" paged : kv_policy = paged ") == {"paged": {"kv_policy": "paged"}}


@pytest.mark.parametrize(("spec", "named"), [
    ("paged:kv_policy", "'kv_policy' is not key=value"),
    ("paged:kv_polcy=paged", "'kv_polcy' is not a parameter"),
    ("paged:kv_policy=lazy", "kv_policy='lazy'"),
    ("a:block_size=0", "block_size='0'"),
    ("a:max_num_batched_tokens=lots", "max_num_batched_tokens='lots'"),
    ("a:kv_policy=paged;a:kv_policy=reserve", "variant 'a' is given twice"),
    ("a:kv_policy=paged,kv_policy=reserve", "'kv_policy' is given twice"),
    ("my variant:kv_policy=paged", "got 'my variant'"),
    (":kv_policy=paged", "got ''"),
])  # fmt: skip
def test_bad_orca_variants_name_the_bad_part(spec, named, capsys):
    with pytest.raises(SystemExit):
        bench.build_parser().parse_args(["--orca-variants", spec])
    err = capsys.readouterr().err
    assert "--orca-variants" in err and named in err


def test_variants_are_orca_kind_with_their_own_label():
    from orca_client.bench_server import ServedModel, served_model

    config = {"max_batch_size": 0, "parameters": {"max_num_seqs": {"string_value": "32"}}}
    paged = served_model("orca_paged", config)
    assert (paged.kind, paged.variant, paged.max_num_seqs, paged.label) == ("orca_variant", "paged", 32, "orca (paged)")
    assert paged.is_orca and served_model("orca", config).kind == "orca"
    assert not served_model("baseline_bs8", {"max_batch_size": 8}).is_orca
    assert ServedModel("orca", "orca").label == "orca"
    assert bench.bench_server.parameter_differences({"kv_policy": "paged", "seed": "0"},
                                                    {"kv_policy": "reserve", "seed": "0"}) == {"kv_policy": "paged"}


def _served_config(path):
    """What Triton would report for a rendered config.pbtxt: its batch size and string parameters."""
    from orca_backend.entrypoints.serve import _PARAM_RE

    text = path.read_text()
    batch = int(re.search(r"(?m)^max_batch_size:\s*(\d+)", text).group(1))
    return {"max_batch_size": batch,
            "parameters": {m["key"]: {"string_value": m["value"]} for m in _PARAM_RE.finditer(text)}}


def _params(path):
    return {k: v["string_value"] for k, v in _served_config(path)["parameters"].items()}


def test_build_repository_writes_variant_copies(tmp_path):
    repo = tmp_path / "repo"
    names = bench.bench_server.build_repository(repo, [8], echo=False, orca_variants={
        "reserve": {"kv_policy": "reserve", "block_size": "32"}, "same": {}})
    assert names == ["orca", "orca_reserve", "orca_same", "baseline_bs8"]
    text = (repo / "orca_reserve" / "config.pbtxt").read_text()
    assert re.search(r'(?m)^name: "orca_reserve"$', text) and text.count("\nname:") + text.startswith("name:") == 1
    assert re.search(r'(?m)^backend: "orca"$', text) and (repo / "orca_reserve" / "1").is_dir()  # the backend's model.py
    orca, reserve, same = (_params(repo / n / "config.pbtxt") for n in ("orca", "orca_reserve", "orca_same"))
    assert bench.bench_server.parameter_differences(reserve, orca) == {"kv_policy": "reserve", "block_size": "32"}
    assert same == orca


def test_serving_gives_variants_every_orca_wide_override(tmp_path, monkeypatch):
    """serving() with a stand-in server: the rendered repository is what tritonserver would load."""
    import orca_backend.entrypoints.serve as serve

    rendered, real_server = {}, serve.TritonServer

    class FakeServer:
        def __init__(self, options):
            self.options, self.process = options, None
            self.grpc_url, self.metrics_url = "127.0.0.1:1", "http://127.0.0.1:2/metrics"

        def start(self):
            real = real_server.__new__(real_server)
            real.options, real.run_dir = self.options, self.options.run_dir
            rendered["repo"] = real.render_repository()  # the per-model overrides applied, as at start

        def wait_ready(self, timeout_s):
            pass

        def stop(self):
            pass

    monkeypatch.setattr(serve, "TritonServer", FakeServer)
    monkeypatch.setattr(bench.bench_server, "fetch_model_config",
                        lambda url, name: _served_config(rendered["repo"] / name / "config.pbtxt"))
    args = bench.build_parser().parse_args([
        "--model", "gpt2-tiny", "--max-num-seqs", "48", "--stream-interval", "2", "--kv-capacity-tokens", "4096",
        "--baseline-batch-sizes", "8", "--served-path-streams", "", "--no-echo",
        "--orca-variants", "reserve:kv_policy=reserve,kv_capacity_tokens=2048;chunked:max_num_batched_tokens=64"])
    with bench.serving(args, tmp_path, bench.Progress(1, enabled=False)) as endpoint:
        models = {m.name: m for m in endpoint.models}
        params = {n: _params(rendered["repo"] / n / "config.pbtxt") for n in ("orca", "orca_reserve", "orca_chunked")}
        chunked_text = (rendered["repo"] / "orca_chunked" / "config.pbtxt").read_text()
    assert [m.name for m in endpoint.models] == ["orca", "orca_reserve", "orca_chunked", "baseline_bs8"]
    for name in ("orca", "orca_reserve", "orca_chunked"):
        assert params[name]["max_num_seqs"] == "48" and params[name]["stream_interval"] == "2"
        assert params[name]["model"] == "gpt2-tiny"
    assert params["orca"]["kv_capacity_tokens"] == params["orca_chunked"]["kv_capacity_tokens"] == "4096"
    assert params["orca_reserve"]["kv_capacity_tokens"] == "2048"  # its own key beats --kv-capacity-tokens
    assert models["orca_reserve"].overrides == {"kv_policy": "reserve", "kv_capacity_tokens": "2048"}
    assert models["orca_chunked"].overrides == {"max_num_batched_tokens": "64"}
    assert models["orca_reserve"].label == "orca (reserve)" and models["orca_reserve"].max_num_seqs == 48
    assert re.search(r'(?m)^name: "orca_chunked"$', chunked_text)
    assert not rendered["repo"].exists()  # serving() removed its run directory


def test_served_path_raised_limits_apply_to_variants():
    raised = {"max_num_seqs": "256", "kv_capacity_tokens": "24576"}
    per_model = bench.variant_parameters(raised, {"a": {"kv_policy": "paged"}, "b": {"max_num_seqs": "8"}})
    assert per_model == {"orca_a": {**raised, "kv_policy": "paged"},
                         "orca_b": {"max_num_seqs": "8", "kv_capacity_tokens": "24576"}}


def test_shared_prefix_prompts_share_exactly_n_tokens():
    n = 40
    trace = workload.synthetic_trace(30, "uniform:4:16", "fixed:8", 1000, request_rate=1.0, seed=5, shared_prefix=n)
    plain = workload.synthetic_trace(30, "uniform:4:16", "fixed:8", 1000, request_rate=1.0, seed=5)
    prefix = trace[0].prompt_ids[:n]
    assert all(r.prompt_ids[:n] == prefix for r in trace)
    assert len({r.prompt_ids[n] for r in trace}) > 1  # the shared part ends at n
    # The rest of the trace is the one without a prefix: same own prompts, arrivals and outputs.
    assert [r.prompt_ids[n:] for r in trace] == [r.prompt_ids for r in plain]
    assert [(r.arrival, r.max_tokens) for r in trace] == [(r.arrival, r.max_tokens) for r in plain]
    assert workload.synthetic_trace(3, "fixed:4", "fixed:1", 1000, seed=5, shared_prefix=n)[0].prompt_ids[:n] == prefix
    assert workload.synthetic_trace(3, "fixed:4", "fixed:1", 1000, seed=6, shared_prefix=n)[0].prompt_ids[:n] != prefix
    longest = max(r.prompt_len for r in trace)  # the prefix counts in the context check
    workload.check_fits(trace, context_len=longest + 8, vocab_size=1000)
    with pytest.raises(ValueError, match="of which 40 shared prefix.*--shared-prefix"):
        workload.check_fits(trace, context_len=longest + 7, vocab_size=1000, shared_prefix=n)


def _workload_args(*extra):
    return bench.build_parser().parse_args(["--prompt-dist", "uniform:4:16", "--output-dist", "fixed:8", *extra])


def test_workload_with_a_shared_prefix_fits_the_context():
    geometry = bench.Geometry(vocab_size=1000, context_len=64)
    w = bench.make_workload(_workload_args("--shared-prefix", "40"), geometry, 50)
    assert all(r.prompt_ids[:40] == w.base[0].prompt_ids[:40] for r in w.base)
    assert all(r.prompt_len + r.max_tokens <= 64 for r in w.base)
    assert w.typical.prompt_ids[:40] == w.base[0].prompt_ids[:40] and w.typical.prompt_len == 40 + 10
    assert "40-token shared prefix" in w.description
    with pytest.raises(SystemExit, match="--shared-prefix"):  # 41 + up to 16 + 8 > 64
        bench.make_workload(_workload_args("--shared-prefix", "41"), geometry, 50)
    with pytest.raises(SystemExit, match="--shared-prefix"):
        bench.main(["--shared-prefix", "8", "--trace", "t.jsonl"])


def test_prefix_caching_makes_each_rate_s_prompts_distinct():
    w = bench.make_workload(_workload_args("--shared-prefix", "8"), bench.Geometry(1000, 64), 50)
    assert w.at(2.0, 10) == w.at(2.0, 10) and w.at(2.0, 10)[0].prompt_ids == w.base[0].prompt_ids
    w.distinct_per_rate = True
    a, b = w.at(2.0, 10), w.at(4.0, 10)
    assert a == w.at(2.0, 10)  # every model gets the same requests at a rate
    for x, y, base in zip(a, b, w.base, strict=False):
        assert x.prompt_len == y.prompt_len == base.prompt_len and x.max_tokens == base.max_tokens
        assert x.prompt_ids[:8] == y.prompt_ids[:8] == base.prompt_ids[:8]  # the shared prefix stays
        assert x.prompt_ids[8] != base.prompt_ids[8] and x.prompt_ids[9:] == base.prompt_ids[9:]
    assert [r.prompt_ids[8] for r in a] != [r.prompt_ids[8] for r in b]


_METRICS = """# HELP orca_requests_running Requests admitted to the engine's running batch
# TYPE orca_requests_running gauge
orca_requests_running{{model="orca",version="1"}} {running}
orca_requests_running{{model="orca_paged",version="1"}} {paged}
orca_preemptions_total{{model="orca",version="1"}} {preempted}
orca_prompt_tokens_computed_total{{model="orca",version="1"}} {computed}
orca_prefix_cache_hits_total{{model="orca",version="1"}} 0
orca_prefix_cache_queries_total{{model="orca",version="1"}} {computed}
orca_requests_finished_total{{model="orca",reason="length",version="1"}} 3
nv_inference_count{{model="orca",version="1"}} 12
"""


def test_engine_samples_read_prometheus_text():
    text = _METRICS.format(running=3, paged=9, preempted=2, computed=500)
    samples = bench.bench_server.engine_samples(text, ["orca_requests_running", "orca_preemptions_total"],
                                                ["orca", "orca_paged"])
    assert samples == {"orca": {"orca_requests_running": 3.0, "orca_preemptions_total": 2.0},
                       "orca_paged": {"orca_requests_running": 9.0}}


class _FakeEndpoint:
    """A metrics endpoint: while `busy`, each scrape of the running gauge shows the next value of
    `running` (the last one sticks; orca_paged shows 9); idle engines show 0."""

    def __init__(self, running=(4, 7, 5), fail=False, busy=False):
        self.running, self.fail, self.busy, self.calls = list(running), fail, busy, 0
        self.preempted, self.computed = 10, 1000

    def __call__(self, url, metrics, models):
        self.calls += 1
        if self.fail:
            raise ConnectionRefusedError("connection refused")
        running = paged = 0
        if self.busy and "orca_requests_running" in metrics:
            running, paged = self.running.pop(0) if len(self.running) > 1 else self.running[0], 9
        text = _METRICS.format(running=running, paged=paged, preempted=self.preempted, computed=self.computed)
        return bench.bench_server.engine_samples(text, metrics, models)


def test_engine_watch_peak_and_counter_deltas():
    import time

    fake = _FakeEndpoint(busy=True)
    watch = bench.bench_server.EngineWatch("http://fake/metrics", "orca", period_s=0.01, settle_s=0, read=fake).start()
    time.sleep(0.2)
    fake.preempted, fake.computed, fake.busy = 13, 1800, False
    stats = watch.stop()
    assert stats.peak_running == 7 and stats.note is None
    assert stats.counters == {"preemptions": 3, "prompt_tokens_computed": 800, "prefix_cache_hits": 0,
                              "prefix_cache_queries": 800}
    assert bench_metrics.hit_rate(0, 800) == 0.0 and bench_metrics.hit_rate(None, 800) is None
    # A model that does not export a counter: that one is None, and the note says which.
    other = _FakeEndpoint(busy=True)
    watch = bench.bench_server.EngineWatch("http://fake/metrics", "orca_paged", period_s=0.01, settle_s=0,
                                           read=other).start()
    time.sleep(0.05)
    other.busy = False
    stats = watch.stop()
    assert stats.peak_running == 9 and set(stats.counters.values()) == {None}
    assert "not exported: orca_preemptions_total" in stats.note


def test_engine_watch_never_fails_the_run():
    stats = bench.bench_server.EngineWatch("http://fake/metrics", "orca", period_s=0.01, settle_s=0,
                                           read=_FakeEndpoint(fail=True)).start().stop()
    assert stats.peak_running is None and set(stats.counters.values()) == {None}
    assert "peak running not recorded: ConnectionRefusedError" in stats.note and "counters not recorded" in stats.note
    none = bench.bench_server.EngineWatch(None, "orca").start().stop()
    assert none.peak_running is None and "--metrics-url" in none.note


def test_bench_run_records_engine_metrics_for_orca_kinds_only(monkeypatch):
    from orca_client.bench_server import ServedModel

    fake = _FakeEndpoint(running=(2, 6, 3))
    monkeypatch.setattr(bench.bench_server, "read_engine_metrics", fake)
    monkeypatch.setattr(bench.bench_server, "inference_counts", lambda url, name: None)

    def fake_run_trace(url, model, trace, options, batched, rate):
        import time

        fake.busy, fake.running = True, [2, 6, 3]
        time.sleep(0.5)  # the watcher samples a few times meanwhile
        fake.computed += 64
        fake.busy = False
        records = [_record(i, 0.1 * i, [0.1 * i + 0.02 * (k + 1) for k in range(3)], [1] * 3) for i in range(len(trace))]
        return RunResult(model, rate, records, duration_s=1.0, client_cpu_s=0.0)

    monkeypatch.setattr(bench, "run_trace", fake_run_trace)
    models = [ServedModel("orca", "orca"), ServedModel("orca_paged", "orca_variant", variant="paged"),
              ServedModel("baseline_bs8", "baseline", 8)]
    endpoint = bench.Endpoint("127.0.0.1:1", "http://fake/metrics", models)
    b = bench.Bench(bench.build_parser().parse_args([]), endpoint, bench.Geometry(1000, 64), bench.Progress(1, False))
    trace = [workload.TraceRequest(0.0, [1, 2], 3)] * 2
    _, orca = b.run(models[0], trace, "orca", rate=1.0)
    assert orca.peak_running == 6 and orca.prompt_tokens_computed == 64 and orca.preemptions == 0
    assert orca.engine_metrics_note is None
    _, variant = b.run(models[1], trace, "variant", rate=1.0)
    assert variant.peak_running == 9 and variant.preemptions is None and "not exported" in variant.engine_metrics_note
    calls = fake.calls
    _, baseline = b.run(models[2], trace, "baseline", rate=1.0)
    assert baseline.peak_running is None and baseline.engine_metrics_note is None
    assert fake.calls - calls <= 1  # only wait_idle's scrape: no watcher for the request-level baseline
    notes = bench.sweep_notes([orca, variant, baseline], models)
    assert any("Engine metrics of orca_paged incomplete in 1 run(s)" in n for n in notes)


def _variant_result():
    from orca_client.bench_server import ServedModel

    records = [_record(i, 0.1 * i, [0.1 * i + 0.02 * (k + 1) for k in range(3)], [1] * 3) for i in range(4)]
    models = [ServedModel("orca", "orca", max_num_seqs=32),
              ServedModel("orca_paged", "orca_variant", max_num_seqs=32, variant="paged",
                          overrides={"kv_policy": "paged"}),
              ServedModel("orca_cached", "orca_variant", variant="cached",
                          overrides={"kv_policy": "paged", "enable_prefix_caching": "true"}),
              ServedModel("baseline_bs8", "baseline", 8)]
    # peak running, preemptions, prompt tokens computed, prefix-cache hits, queries (the runs send 4 × 4 tokens)
    engine = {"orca": (8, 0, 16, 0, 0), "orca_paged": (14, 3, 20, 0, 0), "orca_cached": (16, 1, 6, 10, 16)}
    runs, sustained = [], {}
    for name, rates in (("orca", (1.0, 2.0, 4.0)), ("orca_paged", (1.0, 2.0)), ("orca_cached", (1.0, 2.0, 4.0)),
                        ("baseline_bs8", (1.0,))):
        points = []
        for rate in rates:
            raw = RunResult(name, rate, records, duration_s=2.0 / rate, client_cpu_s=0.0)
            m = summarize(raw, 30.0)
            if name in engine:
                peak, pre, computed, hits, queries = engine[name]
                m.peak_running, m.preemptions = peak - (rate < 2), pre
                m.prompt_tokens_computed, m.prefix_cache_hits, m.prefix_cache_queries = computed, hits, queries
            points.append(m)
            runs.append({"metrics": m, "raw": raw})
        sustained[name] = sustained_throughput(points, 30.0)
    sustained["orca"] = dataclasses.replace(sustained["orca"], max_throughput=2.0, interpolated=2.5, above_grid=False)
    sustained["orca_paged"] = dataclasses.replace(sustained["orca_paged"], max_throughput=3.0, above_grid=False)
    return {
        "command": "orca-bench --orca-variants x", "labels": {m.name: m.label for m in models},
        "models": [dataclasses.asdict(m) for m in models],
        "slo": {"factor": 6.0, "ms_per_token": 30.0}, "runs": runs, "notes": [], "sustained": sustained,
        "headline": {"orca_rps": 2.0, "best_baseline": "baseline_bs8", "best_baseline_rps": 0.5, "ratio": 4.0,
                     "ratio_interpolated": None, "qualifier": ""},
    }  # fmt: skip


def test_report_renders_the_variants_section(tmp_path):
    result = _variant_result()
    paths = report.write_all(result, tmp_path)
    text = paths["markdown"].read_text()
    data = json.loads(paths["json"].read_text())
    assert data["runs"][0]["metrics"]["peak_running"] == 7 and data["runs"][0]["metrics"]["preemptions"] == 0
    assert data["models"][1]["overrides"] == {"kv_policy": "paged"}
    section = text.split("## K/V policies and variants", 1)[1].split("\n## ", 1)[0]
    assert "at 2.000 req/s, the highest rate every orca-kind model ran" in section
    rows = {line.split(" | ")[0][2:]: line for line in section.splitlines() if line.startswith("| orca")}
    assert set(rows) == {"orca", "orca (paged)", "orca (cached)"}
    assert "| reference | 2.000 (2.500) | 1.00× | 8 | 0 (0) |" in rows["orca"]
    # 3.0 / 2.0 on the grid; interpolated as the headline does: 3.0 (none of its own) / 2.5.
    assert "| kv_policy=paged | 3.000 | 1.50× (1.20×) | 14 | 3 (6) |" in rows["orca (paged)"]
    assert "| 6 of 16 | 62% |" in rows["orca (cached)"] and "(≥: top rate met)" in rows["orca (cached)"]
    assert "| 20 of 16 |" in rows["orca (paged)"] and rows["orca (paged)"].endswith("| – |")
    header = [line for line in section.splitlines() if line.startswith("| model")][0]
    assert all(row.count("|") == header.count("|") for row in rows.values())
    # The headline is orca vs the baselines, as without variants: no variant in its table.
    headline = text.split("## Headline", 1)[1].split("\n## ", 1)[0]
    assert "**4.00×**" in headline and "orca (paged)" not in headline
    assert report.render_markdown(data) == text  # a view of the JSON
    without = {**data, "models": [m for m in data["models"] if m["kind"] != "orca_variant"]}
    assert "K/V policies" not in report.render_markdown(without)  # no variants, no section


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
        "--served-path-streams", "8", "--served-path-tokens", "16", "--served-path-repeats", "1",
        "--orca-variants", "reserve:kv_policy=reserve", "--iteration-log",
    ]  # fmt: skip
    assert bench.main(argv) == 0
    data = json.loads((out / "bench.json").read_text())
    assert (out / "summary.md").is_file() and (out / "curve.png").read_bytes()[:4] == b"\x89PNG"
    assert data["command"] == "orca-bench " + " ".join(argv)
    # --iteration-log: every engine's log (its lines flushed as written; the closing line needs a clean
    # engine shutdown, which Triton's 10 s exit timeout does not always leave a model) and its plot.
    logs = {path.stem: [json.loads(line) for line in path.read_text().splitlines()]
            for path in (out / "iteration_logs").glob("*.jsonl")}  # fmt: skip
    assert set(logs) == {"orca", "orca_reserve", "baseline_bs4", "baseline_bs8"}
    for lines in logs.values():
        steps = [line for line in lines if "iteration" in line]
        assert [s["iteration"] for s in steps] == list(range(1, len(steps) + 1)) and all(s["dropped"] == 0 for s in steps)
        assert sum(s["generated_tokens"] for s in steps) > 0 and lines[len(steps):] in ([], [{"event": "closed", "dropped": 0}])
    assert (out / "iterations.png").read_bytes()[:4] == b"\x89PNG"
    # The report names the machine: figures move with the CPU and the width torch's kernels run at.
    host = data["setup"]["machine"]
    assert host["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability() and host["cpu"]
    assert f"torch CPU capability {host['torch_cpu_capability']}" in (out / "summary.md").read_text()

    # The same trace the bench replayed, rebuilt independently from the seed.
    trace = workload.synthetic_trace(64, "uniform:4:24", "uniform:1:24", config.vocab_size, request_rate=1.0, seed=0)
    runs = data["runs"]
    assert {(r["metrics"]["model"], r["metrics"]["offered_rate"]) for r in runs} == {
        (m, rate) for m in ("orca", "orca_reserve", "baseline_bs4", "baseline_bs8") for rate in (3.0, 12.0)}
    for run in runs:
        m, raw = run["metrics"], run["raw"]
        assert m["errors"] == 0 and m["completed"] == 10 and not m["truncated"]
        for rec, req in zip(raw["requests"], trace[:10], strict=True):
            # Token counts match the trace: what arrived, what the server reported, what was asked.
            assert rec["max_tokens"] == req.max_tokens and rec["prompt_len"] == req.prompt_len
            assert sum(rec["response_tokens"]) == req.max_tokens == rec["reported_output_tokens"]
            assert rec["finish_reason"] == "length"
            # orca streams (a response may merge tokens when responses fall behind the engine, on a
            # fast CPU all of them); the request-level baseline answers once at the end.
            assert 1 <= len(rec["response_times"]) <= (req.max_tokens if m["model"].startswith("orca") else 1)
        if m["model"].startswith("orca"):
            # The engine's metrics over the run: every prompt computed once, nothing preempted. The
            # peak is sampled every 0.2 s: a tiny model's requests can all fall between samples.
            assert m["engine_metrics_note"] is None and 0 <= m["peak_running"] <= 10
            assert m["prompt_tokens_computed"] == sum(r["prompt_len"] for r in raw["requests"])
            assert m["preemptions"] == 0 and m["prefix_cache_hits"] == 0
        else:
            assert m["peak_running"] is None and m["prompt_tokens_computed"] is None
        # Both models send their timeline of each request: the split's parts are durations, and the server's
        # span (queue + prefill + decode) plus what lay outside it is the client's end-to-end.
        assert all(rec["perf"] is not None and rec["perf"]["num_preemptions"] == 0 for rec in raw["requests"])
        split = m["latency_split_ms"]
        assert split["queue"]["count"] == 10 and all(split[p]["median"] >= 0 for p in ("queue", "prefill", "decode"))
        for rec in raw["requests"]:
            perf = rec["perf"]
            span_s = (perf["last_token_time_ns"] - perf["arrival_time_ns"]) / 1e9
            assert 0 < span_s <= rec["done_time"] - rec["send_time"]
        assert m["request_throughput"] == pytest.approx(m["completed"] / m["duration_s"])
        end = max(r["done_time"] for r in raw["requests"])
        assert m["duration_s"] == pytest.approx(end)
        assert m["normalized_ms"]["median"] == pytest.approx(_recomputed_median_normalized_ms(raw), rel=1e-9)
        if m["model"].startswith("baseline"):
            assert 1 <= m["batches"] <= 10  # Triton's batcher ran the baseline's requests in batches

    assert data["slo"]["ms_per_token"] == pytest.approx(6.0 * data["unloaded"]["median_ms_per_token"])
    for run in runs:
        assert run["metrics"]["slo_met"] == (run["metrics"]["normalized_ms"]["median"] <= data["slo"]["ms_per_token"])
    assert set(data["sustained"]) == {"orca", "orca_reserve", "baseline_bs4", "baseline_bs8"}
    reserve = next(m for m in data["models"] if m["name"] == "orca_reserve")
    assert (reserve["kind"], reserve["overrides"]) == ("orca_variant", {"kv_policy": "reserve"})
    assert "## K/V policies and variants" in (out / "summary.md").read_text()
    assert data["headline"]["best_baseline"] in ("baseline_bs4", "baseline_bs8")
    fair = data["fairness"]
    assert len(fair["runs"]) == 2 and fair["runs"][1]["batches"] >= 1
    assert data["loadgen_overhead"]["burst_run"]["errors"] == 0
    assert data["loadgen_overhead"]["fraction_of_unloaded"] > 0

    # The served-path stage: a burst of 8 on orca and the same requests offline, with the server's CPU.
    (row,) = data["served_path"]["rows"]
    assert row["streams"] == 8 and row["skipped"] is None and row["served_errors"] == 0
    assert row["served_tokens_per_s"] > 0 and row["offline_tokens_per_s"] > 0
    assert row["offline"]["output_tokens"] == row["served_runs"][0]["output_tokens"] == 8 * 16
    # CPU comes from /proc in clock ticks (10 ms), and 128 tokens can cost the stub or tritonserver
    # less than one on a fast CPU: asserted is that every process was found and measured.
    cpu = row["served_runs"][0]["server_cpu_s"]
    assert "orca" in cpu["stub"] and "orca" in cpu["engine"]
    assert min(row[f"{p}_cpu_us_per_token"] for p in ("stub", "engine", "tritonserver")) >= 0
    assert 0 < row["responses_per_token"] <= 1
    assert data["served_path"]["fairness"]["orca_over_baseline"] > 0
    assert "## Served path" in (out / "summary.md").read_text()
    assert "## Where the time went" in (out / "summary.md").read_text()


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


def test_early_stops_end_each_request_at_its_computed_length_inside_a_loose_max_tokens(monkeypatch):
    from orca_backend import LLM, SamplingParams
    from orca_client.early_stop import with_early_stops
    from orca_client.loadgen import LoadOptions, request_inputs
    from orca_client.workload import synthetic_trace

    trace = synthetic_trace(12, "uniform:4:24", "uniform:2:40", 512, seed=3)
    stopped = with_early_stops(trace, 100, "gpt2-tiny", "cpu", "float32")
    assert [r.prompt_ids for r in stopped] == [r.prompt_ids for r in trace]
    assert all(r.sent_max_tokens == 100 and len(r.stop_token_ids) == 1 for r in stopped)
    assert all(1 <= s.max_tokens <= t.max_tokens for s, t in zip(stopped, trace, strict=True))
    # Served as the load generator sends them, each request stops at its stop token, at that length.
    llm = LLM("gpt2-tiny")
    params = [SamplingParams(max_tokens=r.sent_max_tokens, temperature=0.0, ignore_eos=True,
                             stop_token_ids=list(r.stop_token_ids)) for r in stopped]  # fmt: skip
    outs = llm.generate([r.prompt_ids for r in stopped], params)
    assert [len(o.output_ids) for o in outs] == [r.max_tokens for r in stopped]
    assert {o.finish_reason for o in outs} == {"stop"}
    # The load generator sends the loose bound and the stop token.
    from orca_client import loadgen

    monkeypatch.setattr(loadgen.protocol, "build_inputs", lambda **request: request)
    sent = request_inputs(stopped[0], False, LoadOptions())["sampling"]
    assert (sent["max_tokens"], sent["stop_token_ids"], sent["ignore_eos"]) == (100, list(stopped[0].stop_token_ids), True)
    with pytest.raises(ValueError, match="below request"):
        with_early_stops(trace, 10, "gpt2-tiny", "cpu", "float32")


def test_latency_split_from_the_servers_timeline():
    """queue / prefill / decode from the server's timeline, outside = the client's end-to-end less it;
    requests without a timeline, or with a moment that never came, are left out."""
    ms = 1_000_000

    def record(perf):
        r = RequestRecord(0, 0.0, 4, 3, send_time=1.0, done_time=1.1, finish_reason="length", perf=perf)
        r.response_times, r.response_tokens = [1.05, 1.1], [1, 2]
        return r

    timeline = {"arrival_time_ns": 5 * ms, "first_scheduled_time_ns": 15 * ms, "first_token_time_ns": 45 * ms,
                "last_token_time_ns": 85 * ms, "num_preemptions": 0, "prefix_cache_hit_tokens": 0}
    split = bench_metrics.latency_split([record(timeline), record(None), record({**timeline, "first_token_time_ns": -1})])
    assert {part: round(stats.median, 6) for part, stats in split.items()} == {
        "queue": 10.0, "prefill": 30.0, "decode": 40.0, "outside": 20.0}
    assert split["queue"].count == 1
    assert bench_metrics.latency_split([record(None)]) is None


def test_reports_name_the_commit_they_ran(tmp_path):
    """Every raw result names its code: the checkout's commit (+dirty), or "unknown" outside one."""
    from orca_client import machine

    root = Path(__file__).resolve().parents[2]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                          check=False).stdout.strip()  # fmt: skip
    if head:
        assert machine.code_revision(root).split("+")[0] == head
    assert machine.code_revision(tmp_path) == "unknown"


def test_lora_mode_serves_random_adapters_and_compares_mixed_bursts_with_none(tmp_path):
    """`orca-bench --lora 2`: the adapters orca-bench wrote are served, both bursts of every round
    complete with every token (errors would mean an adapter was refused), and the report says so."""
    out = tmp_path / "lora"
    assert bench.main(["--lora", "2", "--model", "llama-tiny", "--lora-streams", "6", "--lora-tokens", "8",
                       "--lora-repeats", "2", "--out", str(out), "--quiet"]) == 0  # fmt: skip
    section = json.loads((out / "bench.json").read_text())["lora"]
    assert (section["adapters"], section["rank"], len(section["rows"])) == (2, 16, 2)
    for row in section["rows"]:
        assert row["none_errors"] == row["mixed_errors"] == 0
        assert row["none_tokens_per_s"] > 0 and row["mixed_tokens_per_s"] > 0
    assert sorted(p.name for p in (out / "adapters").iterdir()) == ["adapter0", "adapter1"]
    assert "## LoRA: adapters mixed against none" in (out / "summary.md").read_text()
