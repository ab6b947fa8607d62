"""The serving path's CPU per streamed token, without the model (issue #42, item 2).

    python benchmarks/serving_cost.py --streams 64,256,1024 --instances 1,2,4 --tokens 64 --repeats 3 \\
        --out docs/bench/served-path/serving-cost.json

Serves the constant-time measurement device (families/constant_time.py: a forward of a dozen
element-wise ops whatever the batch, with a real tokenizer, so the engine's scheduler, K/V
bookkeeping, sampler, output frames and detokenization all run; written to a directory by
model/constant_time.py's write_device_dir, with --step-ms as the wait each step stands for an
accelerator's) on a real tritonserver with orca's instance_group count N (orca-serve's --instances:
N stubs over one engine core) for each --instances N. For each
stream count S it sends --repeats bursts of S streaming requests (--prompt ids + --tokens output
tokens each, greedy, ignore_eos; all arrivals at t=0) and reports per burst: served tokens/s and
responses/s; CPU µs per streamed token and per response of tritonserver, each stub (per model
instance), the engine core (every process below a stub) and the load generator; and the average
running batch (generated tokens per engine iteration, from the engine's counters, and the mean of
the `orca_requests_running` gauge sampled every --gauge-period s).

Per token and per response are both reported because the stub merges the tokens that arrived while it
was sending into the request's next response: with --step-ms 0 the engine outruns any stub, responses
carry many tokens each, and the cost per token falls with the load while the cost per response does
not. --step-ms sets the pace instead (streams / step time tokens/s offered), as a GPU's step time would.

CPU is read from /proc as orca-bench's served-path stage reads it (orca_client/served_path.py). The
load generator (this process) runs on its own CPUs where the machine has some to spare: --client-cpus
(default `auto`: the last quarter of the usable CPUs when there are 4 or more) with tritonserver and
everything it starts on the rest; `shared` (and `auto` on fewer than 4 CPUs) pins nothing, and the
client's CPU is then reported beside the server's, on the same cores. The choice is in the JSON.

--py-spy DIR: after the measured bursts of each stream count in --profile-streams, --profile-bursts more
with `py-spy record` attached to every stub (--threads; --gil or --idle as --py-spy-mode asks), one
speedscope file per stub in DIR, and a per-thread summary in the JSON. Those bursts are not among the
measured ones (the profiler's sampling costs the stub CPU).

Raw JSON (--out) holds the command, the commit, the machine and every burst; it is rewritten after
each burst, so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))  # orca_client from this tree, installed or not

from orca_client import bench_server, machine, served_path  # noqa: E402
from orca_client.loadgen import LoadOptions, RunResult, run_trace  # noqa: E402
from orca_client.workload import burst_trace  # noqa: E402

MODEL = "orca"
PRESET = "constant-time-measure"  # a measurement device, not a model (served from a directory of its own here)
ITERATIONS, GENERATED = "orca_iterations_total", "orca_generated_tokens_total"
RUNNING = "orca_requests_running"


# ------------------------------------------------------------------------------ configuration
def parse_cpus(text: str) -> set[int]:
    """A CPU list as taskset takes it: "0-2,5" -> {0, 1, 2, 5}."""
    cpus: set[int] = set()
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or (hi and not hi.isdigit()) or (hi and int(hi) < int(lo)):
            raise ValueError(f"not a CPU list: {text!r} (e.g. 0-2,5)")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    if not cpus:
        raise ValueError(f"not a CPU list: {text!r} (e.g. 0-2,5)")
    return cpus


def cpu_sets(spec: str, usable: set[int]) -> tuple[set[int] | None, set[int] | None, str]:
    """(server CPUs, client CPUs, what was done) for --client-cpus: `shared` pins nothing; `auto` gives
    the client the last quarter of `usable` when there are 4 or more; a list gives it those CPUs."""
    if spec == "shared" or (spec == "auto" and len(usable) < 4):
        why = "as asked" if spec == "shared" else f"only {len(usable)} usable CPUs, none to spare"
        return None, None, (f"not pinned ({why}): the load generator shares the CPUs with the server; "
                            "its CPU is reported on its own")  # fmt: skip
    ordered = sorted(usable)
    client = set(ordered[-max(1, len(ordered) // 4):]) if spec == "auto" else parse_cpus(spec)
    if not client <= usable or client == usable:
        raise ValueError(f"--client-cpus {spec}: must be a proper subset of the usable CPUs {sorted(usable)}")
    server = usable - client
    return server, client, f"pinned: tritonserver and its processes on CPUs {sorted(server)}, the load generator on {sorted(client)}"


def server_parameters(streams: list[int], request_tokens: int, device_dir: Path, stream_interval: int,
                      block_size: int = 16) -> dict[str, str]:  # fmt: skip
    """orca's parameters: the device's directory (its tokenizer.json beside its config.json); the
    largest burst runs as one batch (its K/V in whole blocks per request: the manager's bookkeeping
    runs, though the device stores nothing)."""
    blocks = math.ceil(request_tokens / block_size)
    return {"model": str(device_dir), "device": "cpu", "max_num_seqs": str(max(streams)),
            "kv_capacity_tokens": str(max(streams) * blocks * block_size), "block_size": str(block_size),
            "stream_interval": str(stream_interval)}  # fmt: skip


def set_affinity(cpus: set[int] | None, every_thread: bool) -> None:
    """Pins this thread (and with `every_thread`, every thread of this process) to `cpus`."""
    if cpus is None:
        return
    tids = [int(t) for t in os.listdir("/proc/self/task")] if every_thread else [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, cpus)


# ------------------------------------------------------------------------------- engine metrics
class GaugeSampler:
    """The engine's `orca_requests_running` gauge, scraped every `period_s` on a thread of its own
    (its CPU counts in the client's). Each scrape also costs tritonserver a metrics export."""

    def __init__(self, metrics_url: str, period_s: float) -> None:
        self.metrics_url, self.period_s = metrics_url, period_s
        self.samples: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="gauge-sampler", daemon=True)

    def __enter__(self) -> GaugeSampler:
        if self.period_s > 0:
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _poll(self) -> None:
        while not self._stop.wait(self.period_s):
            values = bench_server.read_engine_metrics(self.metrics_url, [RUNNING], [MODEL])
            value = (values or {}).get(MODEL, {}).get(RUNNING)
            if value is not None:
                self.samples.append(value)

    def summary(self) -> dict[str, Any]:
        busy = [v for v in self.samples if v > 0]  # the burst's tail and the idle moments around it are 0
        return {"samples": len(self.samples), "mean_while_busy": statistics.fmean(busy) if busy else None,
                "max": max(self.samples, default=None), "period_s": self.period_s}  # fmt: skip


def engine_counters(metrics_url: str, timeout_s: float = 30.0) -> dict[str, float]:
    """The engine's counters, scraped until they are there: a scrape can fail while a loaded 2-core
    server answers late, and the engine's first export follows its start by an export period."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = bench_server.read_engine_metrics(metrics_url, [ITERATIONS, GENERATED], [MODEL])
        counters = (values or {}).get(MODEL, {})
        if ITERATIONS in counters and GENERATED in counters:
            return counters
        if time.monotonic() > deadline:
            raise RuntimeError(f"the metrics endpoint exports no {ITERATIONS} / {GENERATED} for {MODEL}"
                               + (" (unreadable)" if values is None else ""))  # fmt: skip
        time.sleep(0.25)


# ---------------------------------------------------------------------------------- one burst
def burst(url: str, metrics_url: str, server_pid: int, streams: int, args: argparse.Namespace,
          seed: int) -> dict[str, Any]:  # fmt: skip
    """One measured burst: the load, the process tree's CPU around it, the engine's counters."""
    from orca_backend.config import PRESETS

    trace = burst_trace(streams, args.prompt, args.tokens, PRESETS[PRESET].vocab_size, seed=seed)
    options = LoadOptions(num_channels=args.channels, deadline_s=args.run_timeout)
    if not bench_server.wait_idle(metrics_url, [MODEL], timeout_s=60):
        raise RuntimeError("the engine still holds requests from the last burst")
    counters0 = engine_counters(metrics_url)
    before = served_path.process_tree(server_pid)
    with GaugeSampler(metrics_url, args.gauge_period) as gauge:
        result = run_trace(url, MODEL, trace, options, batched=False, rate=math.inf)
    after = served_path.process_tree(server_pid)  # before the settle below: the server's idle CPU is not the burst's
    time.sleep(bench_server.ENGINE_EXPORT_PERIOD_S + 0.1)  # the engine's last counts reach the metrics port
    counters1 = engine_counters(metrics_url)
    return summarize(result, served_path.cpu_split(before, after, server_pid), counters0, counters1, gauge.summary())


def summarize(result: RunResult, cpu: served_path.CpuSplit, counters0: dict[str, float], counters1: dict[str, float],
              gauge: dict[str, Any]) -> dict[str, Any]:  # fmt: skip
    """One burst's figures: throughput, CPU per token and per response by process, the running batch."""
    tokens = sum(r.output_tokens for r in result.records)
    responses = sum(len(r.response_times) for r in result.records)
    errors = [r.error for r in result.records if r.error is not None]
    stubs: dict[str, float] = defaultdict(float)
    core = other = 0.0
    for p in cpu.per_process:
        if p.role == "stub" and p.model == MODEL:
            stubs[p.instance or "?"] += p.cpu_s
        elif p.role == "engine" and p.model == MODEL:
            core += p.cpu_s
        elif p.role in ("stub", "engine", "other"):
            other += p.cpu_s
    seconds = {"tritonserver": cpu.tritonserver, **{f"stub {name}": s for name, s in sorted(stubs.items())},
               "stubs": sum(stubs.values()), "core": core, "other": other, "client": result.client_cpu_s}
    seconds["server"] = cpu.tritonserver + seconds["stubs"] + core + other
    iterations = counters1[ITERATIONS] - counters0[ITERATIONS]
    generated = counters1[GENERATED] - counters0[GENERATED]
    return {
        "tokens": tokens, "responses": responses, "requests": len(result.records), "errors": len(errors),
        "first_error": errors[0] if errors else None, "truncated": result.truncated, "duration_s": result.duration_s,
        "tokens_per_s": tokens / result.duration_s if result.duration_s else None,
        "responses_per_s": responses / result.duration_s if result.duration_s else None,
        "responses_per_token": responses / tokens if tokens else None,
        "cpu_s": seconds,
        "us_per_token": {k: 1e6 * v / tokens if tokens else None for k, v in seconds.items()},
        "us_per_response": {k: 1e6 * v / responses if responses else None for k, v in seconds.items()},
        "engine": {"iterations": iterations, "generated_tokens": generated,
                   "avg_running_batch": generated / iterations if iterations else None, "running_gauge": gauge},
        "processes": [asdict(p) for p in cpu.per_process], "appeared": cpu.appeared, "vanished": cpu.vanished,
    }  # fmt: skip


# ------------------------------------------------------------------------------------ profiles
def stub_pids(server_pid: int) -> dict[str, int]:
    """instance -> pid of every `orca` stub below tritonserver."""
    tree = served_path.process_tree(server_pid)
    roles = served_path.classify(tree, server_pid)
    return {served_path.stub_instance(p.cmdline) or str(p.pid): p.pid for p in tree
            if roles.get(p.pid) == ("stub", MODEL)}  # fmt: skip


def profiled_burst(url: str, metrics_url: str, server_pid: int, streams: int, args: argparse.Namespace,
                   into: Path, tag: str) -> dict[str, Any]:  # fmt: skip
    """--profile-bursts more bursts with `py-spy record` on every stub; returns the files and their summaries."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).with_name("py-spy"))
    if not Path(py_spy).is_file():
        raise RuntimeError("--py-spy needs py-spy (pip install py-spy)")
    into.mkdir(parents=True, exist_ok=True)
    flags = ["--threads", "--nonblocking", "--rate", str(args.py_spy_rate), "--format", "speedscope"]
    flags += ["--gil"] if args.py_spy_mode == "gil" else ["--idle"] if args.py_spy_mode == "idle" else []
    recorders = {}
    for instance, pid in stub_pids(server_pid).items():
        path = into / f"{tag}_{instance}_{args.py_spy_mode}.speedscope.json"
        recorders[instance] = (path, subprocess.Popen([py_spy, "record", "--pid", str(pid), "--output", str(path), *flags],
                                                      stdout=subprocess.DEVNULL, stderr=subprocess.PIPE))
    time.sleep(1.0)  # py-spy attaches
    pids = stub_pids(server_pid)
    before = {instance: thread_cpu(pid) for instance, pid in pids.items()}
    measured = [burst(url, metrics_url, server_pid, streams, args, seed=args.seed + 999 + i)
                for i in range(args.profile_bursts)]  # fmt: skip
    after = {instance: thread_cpu(pid) for instance, pid in pids.items()}
    tokens = sum(b["tokens"] for b in measured)
    responses = sum(b["responses"] for b in measured)
    profiles = {}
    for instance, (path, proc) in recorders.items():
        proc.send_signal(signal.SIGINT)  # py-spy writes its file on SIGINT
        _, err = proc.communicate(timeout=60)
        if not path.is_file():
            raise RuntimeError(f"py-spy wrote no profile for {instance}: {err.decode(errors='replace')[-500:]}")
        threads = speedscope_summary(path)
        # py-spy names each thread by its OS id and Python name: the /proc figures get the names.
        names = {int(m.group(1)): m.group(2) for m in map(_THREAD_NAME_RE.match, threads) if m}
        cpu = {f"{tid} {names.get(tid, comm)}": seconds - before[instance].get(tid, (comm, 0.0))[1]
               for tid, (comm, seconds) in after[instance].items()}  # fmt: skip
        profiles[instance] = {
            "file": str(path), "threads": threads,
            "thread_cpu_us_per_token": {k: round(1e6 * v / tokens, 2) for k, v in cpu.items() if v > 0},
            "thread_cpu_us_per_response": {k: round(1e6 * v / responses, 2) for k, v in cpu.items() if v > 0},
        }  # fmt: skip
    return {"mode": args.py_spy_mode, "rate": args.py_spy_rate, "bursts": measured, "profiles": profiles}


_THREAD_NAME_RE = re.compile(r'Thread (\d+) "(.*)"')


def thread_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """tid -> (its comm, CPU seconds) of every thread of `pid` now."""
    out = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError, ValueError, IndexError):
            text = (task / "stat").read_text()
            out[int(task.name)] = (text[text.index("(") + 1 : text.rindex(")")], served_path.parse_stat(text).cpu_s)
    return out


def speedscope_summary(path: Path, top: int = 12) -> dict[str, Any]:
    """Per thread (py-spy --threads writes a speedscope profile each): the time its samples stand for,
    and the functions (lines of one function merged) with the largest shares of it, inclusive (on the
    stack) and self (the innermost frame)."""
    data = json.loads(path.read_text())
    frames = [f"{f['name']} ({Path(f.get('file') or '?').name})" for f in data["shared"]["frames"]]
    out = {}
    for profile in data["profiles"]:
        weights = profile.get("weights") or [1] * len(profile["samples"])
        total = sum(weights)
        inclusive: Counter[str] = Counter()
        own: Counter[str] = Counter()
        for stack, weight in zip(profile["samples"], weights, strict=True):  # each stack runs outermost first
            for name in {frames[i] for i in stack}:
                inclusive[name] += weight
            if stack:
                own[frames[stack[-1]]] += weight
        out[profile["name"]] = {
            "total": round(total, 4), "unit": profile.get("unit", "samples"),
            "inclusive": [(name, round(n / total, 4)) for name, n in inclusive.most_common(top)] if total else [],
            "self": [(name, round(n / total, 4)) for name, n in own.most_common(top)] if total else [],
        }  # fmt: skip
    return out


# ------------------------------------------------------------------------------------- report
def table(runs: list[dict[str, Any]]) -> str:
    """One line per burst: what the issue's targets table reads."""
    head = ("N", "S", "rep", "tok/s", "resp/s", "resp/tok", "batch", "triton", "stubs", "core", "client",
            "triton/r", "stubs/r", "per stub µs/tok")  # fmt: skip
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for run in runs:
        r = run["result"]
        t, pr = r["us_per_token"], r["us_per_response"]
        per_stub = ", ".join(f"{k[5:]}: {v:.0f}" for k, v in t.items() if k.startswith("stub ") and v is not None)

        def f(value: float | None, digits: int = 0) -> str:
            return "-" if value is None else f"{value:,.{digits}f}"

        lines.append(" | ".join([
            str(run["instances"]), str(run["streams"]), str(run["repeat"]), f(r["tokens_per_s"]), f(r["responses_per_s"]),
            f(r["responses_per_token"], 2), f(r["engine"]["avg_running_batch"], 1), f(t["tritonserver"]), f(t["stubs"]),
            f(t["core"]), f(t["client"]), f(pr["tritonserver"]), f(pr["stubs"]), per_stub,
        ]))  # fmt: skip
    return "\n".join(lines)


def write(out: Path, report: dict[str, Any]) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    tmp.replace(out)


# --------------------------------------------------------------------------------------- main
def _int_list(text: str) -> list[int]:
    values = [int(v) for v in text.split(",") if v.strip()]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"a comma-separated list of positive integers, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--streams", type=_int_list, default=[64, 256, 1024], help="burst sizes (default 64,256,1024)")
    p.add_argument("--instances", type=_int_list, default=[1], help="orca model instances, one server each (e.g. 1,2,4)")
    p.add_argument("--tokens", type=int, default=64, help="output tokens of each request (default 64)")
    p.add_argument("--prompt", type=int, default=32, help="prompt ids of each request (default 32)")
    p.add_argument("--repeats", type=int, default=3, help="measured bursts per (instances, streams) (default 3)")
    p.add_argument("--step-ms", type=float, default=0.0,
                   help="each engine step waits this long without CPU, as an accelerator's step would (default 0)")
    p.add_argument("--stream-interval", type=int, default=1, help="orca's stream_interval (default 1: a response per token)")
    p.add_argument("--client-cpus", default="auto", help="the load generator's CPUs: a list (0-1,3), auto or shared")
    p.add_argument("--channels", type=int, default=4, help="gRPC connections the streams are spread over (default 4)")
    p.add_argument("--gauge-period", type=float, default=0.5, help="seconds between scrapes of the running gauge; 0: none")
    p.add_argument("--run-timeout", type=float, default=300.0, help="seconds a burst may take (default 300)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--py-spy", metavar="DIR", help="profile every stub with py-spy over one extra burst (see above)")
    p.add_argument("--py-spy-mode", choices=("cpu", "gil", "idle"), default="cpu",
                   help="cpu: active samples; gil: only while holding the GIL; idle: wall time, waits included")
    p.add_argument("--py-spy-rate", type=int, default=100, help="samples per second (default 100)")
    p.add_argument("--profile-streams", type=_int_list, default=[256], help="stream counts profiled with --py-spy")
    p.add_argument("--profile-bursts", type=int, default=5, help="bursts under the profiler (default 5)")
    p.add_argument("--out", default="serving_cost.json", help="the raw JSON (default serving_cost.json)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from orca_backend.entrypoints.serve import ServerOptions, TritonServer

    out = Path(args.out)
    usable = os.sched_getaffinity(0)
    server_cpus, client_cpus, pinning = cpu_sets(args.client_cpus, usable)
    report: dict[str, Any] = {
        "command": " ".join(["benchmarks/serving_cost.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": machine.code_revision(ROOT), "machine": machine.describe(), "usable_cpus": sorted(usable),
        "pinning": pinning, "prompt": args.prompt, "tokens": args.tokens,
        "stream_interval": args.stream_interval, "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "runs": [], "profiles": [],
    }  # fmt: skip
    print(f"serving cost: {pinning}", flush=True)
    with tempfile.TemporaryDirectory(prefix="orca-serving-cost-") as tmp:
        work = Path(tmp)
        from orca_backend.model.constant_time import write_device_dir

        report["device"] = asdict(write_device_dir(work / "device", step_time_ms=args.step_ms))
        parameters = server_parameters(args.streams, args.prompt + args.tokens, work / "device", args.stream_interval)
        report["parameters"] = {k: v for k, v in parameters.items() if k != "model"}
        for instances in args.instances:
            set_affinity(server_cpus, every_thread=False)  # tritonserver inherits this thread's CPUs
            options = ServerOptions(models=(MODEL,), instances=instances, parameters=parameters,
                                    log_file=out.with_name(f"{out.stem}-server-{instances}.log"),
                                    run_dir=work / f"run{instances}")  # fmt: skip
            server = TritonServer(options).start()
            try:
                set_affinity(client_cpus, every_thread=True)
                server.wait_ready(timeout_s=args.ready_timeout)
                assert server.process is not None
                pid = server.process.pid
                stubs = stub_pids(pid)
                if len(stubs) != instances:
                    raise RuntimeError(f"{instances} instances asked, {len(stubs)} orca stubs run: {sorted(stubs)}")
                burst(server.grpc_url, server.metrics_url, pid, min(8, max(args.streams)), args, seed=args.seed + 1)  # warm-up
                for streams in args.streams:
                    for repeat in range(args.repeats):
                        result = burst(server.grpc_url, server.metrics_url, pid, streams, args,
                                       seed=args.seed + 10 * repeat)  # fmt: skip
                        report["runs"].append({"instances": instances, "streams": streams, "repeat": repeat + 1,
                                               "result": result})  # fmt: skip
                        write(out, report)
                        print(table(report["runs"][-1:]).splitlines()[-1], flush=True)
                    if args.py_spy and streams in args.profile_streams:
                        tag = f"{out.stem}_N{instances}_S{streams}"
                        profile = profiled_burst(server.grpc_url, server.metrics_url, pid, streams, args,
                                                 Path(args.py_spy), tag)  # fmt: skip
                        report["profiles"].append({"instances": instances, "streams": streams, **profile})
                        write(out, report)
            finally:
                server.stop()
    report["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    write(out, report)
    print(table(report["runs"]))
    print(f"raw: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
