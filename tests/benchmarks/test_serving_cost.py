"""benchmarks/serving_cost.py: its CPU sets, the config it renders, how a burst's /proc and engine
figures become per-token and per-response costs, the profile summary (no server); and one short run
on a real tritonserver with one and two instances. The figures are whatever this machine measures:
the tests check what they are made of, never their values or the clock."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
from pathlib import Path

import pytest
from bench_script import load_script

from orca_client import served_path
from orca_client.loadgen import RequestRecord, RunResult

ROOT = Path(__file__).resolve().parents[2]


sc = load_script("serving_cost")


def test_cpu_lists_and_sets():
    assert sc.parse_cpus("0-2,5") == {0, 1, 2, 5} and sc.parse_cpus("3") == {3}
    for bad in ("", "a", "3-1", "1-x"):
        with pytest.raises(ValueError, match="CPU list"):
            sc.parse_cpus(bad)
    # Two CPUs: nothing to spare, nothing pinned, and the JSON says so.
    server, client, note = sc.cpu_sets("auto", {0, 1})
    assert (server, client) == (None, None) and "not pinned" in note and "2 usable" in note
    assert sc.cpu_sets("shared", set(range(8)))[:2] == (None, None)
    # Eight: the client gets the last quarter, the server the rest.
    server, client, note = sc.cpu_sets("auto", set(range(8)))
    assert (server, client) == ({0, 1, 2, 3, 4, 5}, {6, 7}) and note.startswith("pinned")
    assert sc.cpu_sets("3", {0, 1, 2, 3})[:2] == ({0, 1, 2}, {3})
    for bad in ("4", "0-3"):  # outside the usable CPUs; all of them (none left for the server)
        with pytest.raises(ValueError, match="proper subset"):
            sc.cpu_sets(bad, {0, 1, 2, 3})


def test_the_server_parameters(tmp_path):
    params = sc.server_parameters([64, 1024, 256], 32 + 64, tmp_path / "device", 1)
    # The largest burst is one batch, its K/V in whole blocks of 16 per request.
    assert params["model"] == str(tmp_path / "device") and params["max_num_seqs"] == "1024"
    assert params["kv_capacity_tokens"] == str(1024 * 96) and params["stream_interval"] == "1"
    assert sc.server_parameters([8], 17, tmp_path / "device", 4)["kv_capacity_tokens"] == str(8 * 32)


TICK = 1 / served_path.CLOCK_TICKS


def _stub(instance: str) -> tuple[str, ...]:
    return ("/r/backends/python/triton_python_backend_stub", "/r/orca/1/model.py", "shm", "1", "1", "100", "/b", "3",
            instance, "DEFAULT")  # fmt: skip


def test_a_burst_is_split_per_process_and_instance():
    def p(pid, ppid, ticks, argv=()):
        return served_path.ProcStat(pid, ppid, 1000, ticks * TICK, tuple(argv))

    core = ("python", "-c", "from multiprocessing.spawn import spawn_main")
    before = [p(100, 1, 10), p(101, 100, 10, _stub("orca_0_0")), p(102, 100, 10, _stub("orca_0_1")),
              p(103, 101, 10, core), p(104, 100, 0, ("sh",))]  # fmt: skip
    after = [p(100, 1, 40), p(101, 100, 70, _stub("orca_0_0")), p(102, 100, 30, _stub("orca_0_1")),
             p(103, 101, 110, core), p(104, 100, 2, ("sh",))]  # fmt: skip
    split = served_path.cpu_split(before, after, 100)
    assert {(x.pid, x.role, x.instance) for x in split.per_process} == {
        (100, "tritonserver", None), (101, "stub", "orca_0_0"), (102, "stub", "orca_0_1"),
        (103, "engine", "orca_0_0"),  # below the first stub
        (104, "other", None)}  # fmt: skip
    records = [RequestRecord(i, 0.0, 32, 4, 0.0, [0.1, 0.2], [2, 2], 0.2, "length") for i in range(50)]
    result = RunResult("orca", float("inf"), records, duration_s=2.0, client_cpu_s=0.05)
    counters0 = {sc.ITERATIONS: 10.0, sc.GENERATED: 100.0}
    counters1 = {sc.ITERATIONS: 35.0, sc.GENERATED: 300.0}
    gauge = {"samples": 3, "mean_while_busy": 7.0, "max": 8.0, "period_s": 0.5}
    out = sc.summarize(result, split, counters0, counters1, gauge)
    assert (out["tokens"], out["responses"], out["errors"]) == (200, 100, 0)
    assert out["tokens_per_s"] == pytest.approx(100.0) and out["responses_per_token"] == pytest.approx(0.5)
    per_token, per_response = out["us_per_token"], out["us_per_response"]
    assert per_token["tritonserver"] == pytest.approx(1e6 * 30 * TICK / 200)
    assert per_token["stub orca_0_0"] == pytest.approx(1e6 * 60 * TICK / 200)
    assert per_token["stub orca_0_1"] == pytest.approx(1e6 * 20 * TICK / 200)
    assert per_token["stubs"] == pytest.approx(1e6 * 80 * TICK / 200)
    assert per_token["core"] == pytest.approx(1e6 * 100 * TICK / 200)
    assert per_token["other"] == pytest.approx(1e6 * 2 * TICK / 200)
    assert per_token["client"] == pytest.approx(1e6 * 0.05 / 200)
    assert per_response["core"] == pytest.approx(2 * per_token["core"])
    assert out["cpu_s"]["server"] == pytest.approx(212 * TICK)
    # The running batch: tokens the engine generated per iteration over the burst.
    assert out["engine"]["avg_running_batch"] == pytest.approx(200 / 25)
    assert out["engine"]["running_gauge"] == gauge
    line = sc.table([{"instances": 2, "streams": 50, "repeat": 1, "result": out}]).splitlines()[-1]
    assert line.startswith("2 | 50 | 1 | 100 | 50 | 0.50 | 8.0") and "orca_0_1: " in line


def test_the_profile_summary_per_thread(tmp_path):
    frames = [{"name": "send", "file": "/x/orca_model.py", "line": 1}, {"name": "loop", "file": "/x/orca_model.py", "line": 9},
              {"name": "send", "file": "/x/orca_model.py", "line": 2}, {"name": "decode", "file": "/y/tokenizer.py", "line": 3}]  # fmt: skip
    profile = {"shared": {"frames": frames}, "profiles": [
        {"name": 'Thread 1 "orca-responses"', "unit": "seconds", "samples": [[1, 0], [1, 2], [1]], "weights": [0.01] * 3},
        {"name": 'Thread 2 "orca-output"', "unit": "seconds", "samples": [[3]], "weights": [0.01]}]}  # fmt: skip
    path = tmp_path / "p.speedscope.json"
    path.write_text(json.dumps(profile))
    summary = sc.speedscope_summary(path)
    responses = summary['Thread 1 "orca-responses"']
    assert responses["total"] == pytest.approx(0.03) and responses["unit"] == "seconds"
    # Two lines of one function are one entry; the outer loop is on every stack, innermost on one.
    assert dict(responses["self"]) == {"send (orca_model.py)": 0.6667, "loop (orca_model.py)": 0.3333}  # rounded to 4 places
    assert dict(responses["inclusive"])["loop (orca_model.py)"] == 1.0
    assert summary['Thread 2 "orca-output"']["self"] == [("decode (tokenizer.py)", 1.0)]


def test_thread_cpu_reads_every_thread_of_a_process():
    threads = sc.thread_cpu(os.getpid())
    assert os.getpid() in threads and all(seconds >= 0 for _, seconds in threads.values())
    assert sc._THREAD_NAME_RE.match('Thread 4242 "orca-responses"').groups() == ("4242", "orca-responses")


needs_server = pytest.mark.skipif(
    not (os.environ.get("TRITONSERVER") or shutil.which("tritonserver") or importlib.util.find_spec("pytriton")),
    reason="no tritonserver available (pip install nvidia-pytriton)",
)


@needs_server
@pytest.mark.integration
def test_a_short_run_on_a_real_server(tmp_path):
    out = tmp_path / "cost.json"
    argv = ["--streams", "8", "--instances", "1,2", "--tokens", "8", "--prompt", "4", "--repeats", "1",
            "--gauge-period", "0", "--client-cpus", "shared", "--step-ms", "1", "--out", str(out)]  # fmt: skip
    assert sc.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["command"] == "benchmarks/serving_cost.py " + " ".join(argv) and report["commit"]
    assert report["pinning"].startswith("not pinned") and report["device"]["step_time_ms"] == 1.0
    assert report["parameters"]["max_num_seqs"] == "8"
    assert [(r["instances"], r["streams"]) for r in report["runs"]] == [(1, 8), (2, 8)]
    for run in report["runs"]:
        r = run["result"]
        # Every token of every request arrived, and the engine counted exactly those.
        assert (r["tokens"], r["errors"], r["requests"]) == (64, 0, 8) and 1 <= r["responses"] <= 64
        assert r["engine"]["generated_tokens"] == 64 and 1 <= r["engine"]["avg_running_batch"] <= 8
        stubs = sorted(k for k in r["cpu_s"] if k.startswith("stub "))
        assert stubs == [f"stub orca_0_{i}" for i in range(run["instances"])]
        roles = [p["role"] for p in r["processes"]]
        assert roles.count("tritonserver") == 1 and roles.count("stub") == run["instances"] and "engine" in roles
        assert r["appeared"] == 0 and r["vanished"] == 0  # a warm server's tree is stable
        assert all(v is None or v >= 0 for v in r["us_per_token"].values())
