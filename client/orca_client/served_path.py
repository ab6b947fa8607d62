"""The served-path stage of `orca-bench`: what serving through Triton costs against the offline engine.

For each stream count S (--served-path-streams, default 64 and 256) a burst of S equal requests
(prompt 32 + 64 output tokens, greedy, ignore_eos) goes to `orca` over gRPC streams, then the same
requests go through `LLM.generate` in a separate process, with the served orca's engine settings
and max_num_seqs = S, while the server is idle. Per S it reports served and offline output
tokens/s and their ratio, and the CPU time per output token of every part of the served path:
tritonserver, the `orca` model's Python backend stub, the processes below that stub (an engine
core or workers the model starts) and the load generator. "Server-CPU efficiency" is the offline
engine's CPU per token over the server's (tritonserver + stub + engine processes): below 1 the
serving path spends CPU per token that the engine alone does not, and on a CPU-bound host that is
throughput lost. The equal-burst orca/baseline ratio comes from the fairness burst.

CPU is utime + stime from /proc/<pid>/stat of tritonserver and all its descendants, read just before
and after each burst. A process is classified by its place in that tree: tritonserver itself; a
`triton_python_backend_stub` (its command line is `<stub> <repository>/<model>/<version>/model.py
<shm region> ... <model>_<instance>_<device> ...`, so the model is the script's grandparent
directory); any process below a stub (an engine process of that stub's model); anything else
below tritonserver ("other"). A process that starts during a burst counts from its start; one that
exits during a burst can no longer be read, so its CPU since the first snapshot is lost. Both are
counted (`appeared`, `vanished`) so a reader sees when that happened; on a warm server the tree is
stable and both are 0. The offline side reads the same tree rooted at its own process.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_client import bench_server
from orca_client.workload import TraceRequest, burst_trace

if TYPE_CHECKING:
    from orca_client.bench import Bench

PROC = Path("/proc")
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
STUB_NAME = "triton_python_backend_stub"


# ------------------------------------------------------------------------------ /proc sampling
@dataclass(frozen=True)
class ProcStat:
    pid: int
    ppid: int
    start_ticks: int  # start time after boot: tells a reused pid apart
    cpu_s: float  # utime + stime
    cmdline: tuple[str, ...] = ()


def parse_stat(text: str) -> ProcStat:
    """A /proc/<pid>/stat line. The command name sits in parentheses and may hold spaces and
    parentheses itself, so the fields are counted from the last ')'."""
    head, _, rest = text.rpartition(")")
    fields = rest.split()  # fields[0] is the state (stat field 3): utime/stime are fields 14/15, starttime 22
    return ProcStat(pid=int(head.split("(", 1)[0]), ppid=int(fields[1]), start_ticks=int(fields[19]),
                    cpu_s=(int(fields[11]) + int(fields[12])) / CLOCK_TICKS)


def process_tree(root: int, proc: Path = PROC) -> list[ProcStat]:
    """`root` and all its descendants as they are now, with command lines (a process that exits
    while being read is left out)."""
    stats: dict[int, ProcStat] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            try:
                stat = parse_stat((entry / "stat").read_text())
            except (OSError, ValueError, IndexError):
                continue
            stats[stat.pid] = stat
    children: dict[int, list[int]] = defaultdict(list)
    for stat in stats.values():
        children[stat.ppid].append(stat.pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid not in stats:
            continue
        try:
            argv = (proc / str(pid) / "cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        tree.append(replace(stats[pid], cmdline=tuple(a for a in argv if a)))
        todo += children[pid]
    return tree


def stub_model(cmdline: tuple[str, ...]) -> str | None:
    """The Triton model a Python backend stub serves, or None when `cmdline` is not a stub's."""
    if not cmdline or not cmdline[0].endswith(STUB_NAME):
        return None
    if len(cmdline) > 1 and cmdline[1].endswith(".py"):
        return Path(cmdline[1]).parents[1].name  # <repository>/<model>/<version>/model.py
    instance = cmdline[8] if len(cmdline) > 8 else ""  # <model>_<instance>_<device>
    return re.sub(r"_\d+_\d+$", "", instance) or "?"


def stub_instance(cmdline: tuple[str, ...]) -> str | None:
    """The Triton model instance a Python backend stub runs (`<model>_<instance>_<device>`, e.g.
    orca_1_0 for the second of `instance_group { count: N }`), or None when `cmdline` is not a stub's."""
    if stub_model(cmdline) is None:
        return None
    return cmdline[8] if len(cmdline) > 8 else "?"


def classify(tree: Iterable[ProcStat], root: int) -> dict[int, tuple[str, str | None]]:
    """pid -> (role, model): ("tritonserver", None) for the root, ("stub", model), ("engine", model)
    for any process below a stub, ("other", None) for the rest of the tree."""
    procs = list(tree)
    children: dict[int, list[ProcStat]] = defaultdict(list)
    for p in procs:
        children[p.ppid].append(p)
    roles: dict[int, tuple[str, str | None]] = {root: ("tritonserver", None)}
    todo = [root]
    while todo:
        parent = todo.pop()
        role, model = roles[parent]
        for child in children[parent]:
            if role in ("stub", "engine"):
                roles[child.pid] = ("engine", model)
            elif (served := stub_model(child.cmdline)) is not None:
                roles[child.pid] = ("stub", served)
            else:
                roles[child.pid] = ("other", None)
            todo.append(child.pid)
    return roles


@dataclass
class ProcessCpu:
    """One process's CPU seconds between two snapshots, with its place in the tree."""

    pid: int
    role: str  # as classify() names it
    model: str | None
    instance: str | None  # a stub's model instance; for an engine process, the instance of the stub above it
    command: str  # its command line, cut to 120 characters
    cpu_s: float


@dataclass
class CpuSplit:
    """CPU seconds between two snapshots of a server's process tree, per role (stub and engine per model)."""

    tritonserver: float = 0.0
    stub: dict[str, float] = field(default_factory=dict)
    engine: dict[str, float] = field(default_factory=dict)
    other: float = 0.0
    processes: dict[str, int] = field(default_factory=dict)  # per role, in the second snapshot
    appeared: int = 0  # processes started between the snapshots (counted from their start)
    vanished: int = 0  # processes gone by the second snapshot (their CPU since the first is lost)
    per_process: list[ProcessCpu] = field(default_factory=list)  # the same seconds, process by process


def cpu_deltas(before: Iterable[ProcStat], after: Iterable[ProcStat]) -> tuple[dict[int, float], int, int]:
    """(pid -> CPU seconds used between the snapshots, processes appeared, processes vanished)."""
    old = {(p.pid, p.start_ticks): p.cpu_s for p in before}
    new = {(p.pid, p.start_ticks): p.cpu_s for p in after}
    used = {pid: cpu - old.get((pid, start), 0.0) for (pid, start), cpu in new.items()}
    return used, len(new.keys() - old.keys()), len(old.keys() - new.keys())


def cpu_split(before: list[ProcStat], after: list[ProcStat], root: int) -> CpuSplit:
    used, appeared, vanished = cpu_deltas(before, after)
    split = CpuSplit(appeared=appeared, vanished=vanished)
    by_pid = {p.pid: p for p in after}
    for pid, (role, model) in classify(after, root).items():
        seconds = used.get(pid, 0.0)
        split.per_process.append(ProcessCpu(pid, role, model, _instance_above(by_pid, pid) if model else None,
                                            " ".join(by_pid[pid].cmdline)[:120], seconds))
        split.processes[role] = split.processes.get(role, 0) + 1
        if role == "tritonserver":
            split.tritonserver += seconds
        elif role == "other":
            split.other += seconds
        else:
            per_model = split.stub if role == "stub" else split.engine
            per_model[model or "?"] = per_model.get(model or "?", 0.0) + seconds
    return split


def _instance_above(by_pid: Mapping[int, ProcStat], pid: int) -> str | None:
    """The model instance of the stub that is `pid` or its nearest ancestor."""
    while pid in by_pid:
        instance = stub_instance(by_pid[pid].cmdline)
        if instance is not None:
            return instance
        pid = by_pid[pid].ppid
    return None


# ------------------------------------------------------------------------------ offline side
def offline_main(payload: Mapping[str, Any]) -> dict[str, Any]:
    """In the subprocess: LLM.generate on the burst's prompts, best of `repeats` after a warm-up;
    wall time and the CPU of this process and its children (the engine may start workers)."""
    from orca_backend.config import EngineConfig
    from orca_backend.entrypoints.llm import LLM
    from orca_backend.sampling_params import SamplingParams

    # The served model's engine settings, less its iteration log: that file is the served engine's.
    engine = {key: value for key, value in payload["engine"].items() if key != "iteration_log"}
    llm = LLM(**asdict(EngineConfig.from_parameters(engine)))
    prompts: list[list[int]] = payload["prompts"]
    params = SamplingParams(max_tokens=payload["max_tokens"], temperature=0.0, ignore_eos=True)
    llm.generate(prompts[:2], params)  # warm-up
    best: dict[str, Any] = {}
    for _ in range(payload["repeats"]):
        before = process_tree(os.getpid())
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        seconds = time.perf_counter() - start
        used, _, _ = cpu_deltas(before, process_tree(os.getpid()))
        tokens = sum(len(o.output_ids) for o in outputs)
        if tokens != len(prompts) * payload["max_tokens"]:
            raise RuntimeError(f"offline run produced {tokens} tokens, expected {len(prompts) * payload['max_tokens']}")
        if not best or seconds < best["seconds"]:
            best = {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds,
                    "cpu_s": sum(used.values()), "cpu_us_per_token": 1e6 * sum(used.values()) / tokens}
    llm.engine.shutdown()
    return best


def run_offline(engine: Mapping[str, str], trace: list[TraceRequest], repeats: int, timeout_s: float) -> dict[str, Any]:
    """offline_main in a fresh interpreter (the bench process holds gRPC threads and its own CPU
    clock); its JSON result is the last line of its stdout."""
    payload = {"engine": dict(engine), "prompts": [r.prompt_ids for r in trace],
               "max_tokens": trace[0].max_tokens, "repeats": repeats}
    done = subprocess.run([sys.executable, "-m", "orca_client.served_path", "--offline"], input=json.dumps(payload),
                          capture_output=True, text=True, timeout=timeout_s)
    if done.returncode != 0:
        raise RuntimeError(f"offline run failed (exit {done.returncode}): {done.stderr.strip()[-1500:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


# ---------------------------------------------------------------------------- server settings
_LIMIT_RE = re.compile(r'key:\s*"(max_num_seqs|kv_capacity_tokens)"\s*value:\s*\{\s*string_value:\s*"(\d+)"')


def raised_limits(config_text: str, streams: list[int], request_tokens: int, max_num_seqs: int | None,
                  kv_capacity_tokens: int | None) -> dict[str, str]:
    """orca parameters that let the stage's largest burst run as one batch: max_num_seqs ≥ max(S) and
    kv_capacity_tokens ≥ max(S) × (prompt + output), raised above config.pbtxt's values only where
    they fall short and only where no flag set them (a burst that does not fit is then skipped)."""
    if not streams:
        return {}
    current = {key: int(value) for key, value in _LIMIT_RE.findall(config_text)}
    needed = {"max_num_seqs": (max_num_seqs, max(streams)),
              "kv_capacity_tokens": (kv_capacity_tokens, max(streams) * request_tokens)}
    return {key: str(need) for key, (flag, need) in needed.items() if flag is None and need > current.get(key, 0)}


def does_not_fit(streams: int, request_tokens: int, context_len: int, max_num_seqs: int | None,
                 kv_capacity_tokens: int | None) -> str | None:
    """Why a burst of `streams` requests would not be a real `streams`-stream test, or None."""
    if request_tokens > context_len:
        return f"prompt + output = {request_tokens} tokens exceeds the model's context of {context_len}"
    if max_num_seqs is not None and streams > max_num_seqs:
        return f"orca's max_num_seqs is {max_num_seqs} < {streams}: the burst would queue"
    if kv_capacity_tokens is not None and streams * request_tokens > kv_capacity_tokens:
        return (f"orca's kv_capacity_tokens is {kv_capacity_tokens} < {streams} × {request_tokens}: "
                "the burst would queue")
    return None


# ---------------------------------------------------------------------------------- the stage
def _served_repeat(bench: Bench, trace: list[TraceRequest], label: str) -> dict[str, Any]:
    orca = bench.model("orca")[0]
    pid = bench.server_pid
    before = process_tree(pid) if pid else []
    raw, m = bench.run(orca, trace, label, rate=math.inf)
    split = cpu_split(before, process_tree(pid), pid) if pid else None
    return {"tokens_per_s": m.output_token_throughput, "duration_s": m.duration_s, "errors": m.errors,
            "first_error": m.first_error, "output_tokens": sum(r.output_tokens for r in raw.records),
            "responses": sum(len(r.response_times) for r in raw.records), "client_cpu_s": raw.client_cpu_s,
            "server_cpu_s": asdict(split) if split else None}


def _row(streams: int, model: str, served: list[dict[str, Any]], offline: dict[str, Any]) -> dict[str, Any]:
    best = max(served, key=lambda r: (r["errors"] == 0, r["tokens_per_s"]))
    tokens = best["output_tokens"]

    def per_token(seconds: float | None) -> float | None:
        return None if seconds is None or not tokens else 1e6 * seconds / tokens

    cpu = best["server_cpu_s"]
    stub = per_token(cpu["stub"].get(model, 0.0)) if cpu else None
    engine = per_token(cpu["engine"].get(model, 0.0)) if cpu else None
    triton = per_token(cpu["tritonserver"]) if cpu else None
    server = None if stub is None or engine is None or triton is None else stub + engine + triton
    return {
        "streams": streams, "skipped": None,
        "offline_tokens_per_s": offline["tokens_per_s"], "offline_cpu_us_per_token": offline["cpu_us_per_token"],
        "served_tokens_per_s": best["tokens_per_s"], "served_over_offline": best["tokens_per_s"] / offline["tokens_per_s"],
        "stub_cpu_us_per_token": stub, "engine_cpu_us_per_token": engine, "tritonserver_cpu_us_per_token": triton,
        "client_cpu_us_per_token": per_token(best["client_cpu_s"]),
        "server_cpu_efficiency": offline["cpu_us_per_token"] / server if server else None,
        "responses_per_token": best["responses"] / tokens if tokens else None,
        "served_errors": best["errors"], "served_runs": served, "offline": offline,
    }  # fmt: skip


def fairness_ratio(fairness: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """orca / baseline output tokens/s in the equal-length burst (None: no baseline ran it)."""
    runs = (fairness or {}).get("runs", [])
    if len(runs) < 2:
        return None
    orca, baseline = runs[0], runs[-1]
    return {"baseline": baseline["label"], "requests": orca["requests"], "orca_tokens_per_s": orca["token_throughput"],
            "baseline_tokens_per_s": baseline["token_throughput"],
            "orca_over_baseline": orca["token_throughput"] / baseline["token_throughput"]
            if baseline["token_throughput"] else None}


def run_stage(bench: Bench) -> dict[str, Any]:
    """The served-path stage on the bench's server; returns bench.json's `served_path` section."""
    args, orca = bench.args, bench.model("orca")[0]
    prompt, tokens, repeats = args.served_path_prompt, args.served_path_tokens, args.served_path_repeats
    kv = bench.orca_parameters.get("kv_capacity_tokens")
    section: dict[str, Any] = {
        "prompt_len": prompt, "max_tokens": tokens, "repeats": repeats, "orca_max_num_seqs": orca.max_num_seqs,
        "orca_kv_capacity_tokens": int(kv) if kv else None, "rows": [], "notes": list(bench.served_path_notes),
    }  # fmt: skip
    if not bench.server_pid:
        section["notes"].append("Server CPU per process is measured only on a server orca-bench starts itself "
                                "(it reads tritonserver's process tree); with --url those columns stay empty.")
    for streams in args.served_path_streams:
        reason = does_not_fit(streams, prompt + tokens, bench.geometry.context_len, orca.max_num_seqs,
                              section["orca_kv_capacity_tokens"])
        if reason:
            section["rows"].append({"streams": streams, "skipped": reason})
            bench.progress.info(f"served path: skipping {streams} streams: {reason}")
            continue
        trace = burst_trace(streams, prompt, tokens, bench.geometry.vocab_size, seed=args.seed + 3)
        served = [_served_repeat(bench, trace, f"served path: burst of {streams}×({prompt}+{tokens}) on orca, "
                                               f"repeat {i + 1}/{repeats}") for i in range(repeats)]
        bench.progress.begin(f"served path: the same {streams} requests offline (LLM.generate, best of {repeats})")
        engine = {**bench.orca_parameters, "max_num_seqs": str(streams)}
        bench_server.wait_idle(bench.metrics_url, [orca.name], timeout_s=30)
        before = process_tree(bench.server_pid) if bench.server_pid else []
        try:
            offline = run_offline(engine, trace, repeats, timeout_s=(repeats + 1) * args.run_timeout + 300)
        except (RuntimeError, subprocess.TimeoutExpired, ValueError) as exc:
            bench.progress.end(f"failed: {exc}")
            section["rows"].append({"streams": streams, "skipped": f"the offline run failed: {exc}", "served_runs": served})
            continue
        if bench.server_pid:  # the server should be idle meanwhile: its CPU over the whole offline subprocess
            idle, _, _ = cpu_deltas(before, process_tree(bench.server_pid))
            offline["server_cpu_s_meanwhile"] = sum(idle.values())
        bench.progress.end(f"{offline['tokens_per_s']:.0f} tok/s, {offline['cpu_us_per_token']:.0f} µs CPU/token")
        section["rows"].append(_row(streams, orca.name, served, offline))
    section["fairness"] = fairness_ratio(bench.result.get("fairness"))
    return section


if __name__ == "__main__":
    if sys.argv[1:] != ["--offline"]:
        sys.exit("usage: python -m orca_client.served_path --offline < payload.json (run by orca-bench)")
    print(json.dumps(offline_main(json.load(sys.stdin))))
