"""`orca-bench`: the A/B of iteration-level (`orca`) vs request-level (`baseline`) serving on one Triton server.

    orca-bench                                  # GPT-2-small preset on CPU, auto rate sweep -> bench_results/
    orca-bench --model gpt2-mini --rates 0.5,1,2,4 --num-requests 32
    orca-bench --trace my_trace.jsonl --rates native
    orca-bench --echo                           # only the load generator's own overhead, against `echo`
    orca-bench --url host:8001 --baseline-models baseline   # a server that is already running
    orca-bench --served-path-only --model gpt2-mini   # served vs offline throughput and CPU per token
    orca-bench --orca-variants 'paged:kv_policy=paged' --kv-capacity-tokens 4096   # K/V policies side by side
    orca-bench --shared-prefix 256 --orca-variants 'cached:kv_policy=paged,enable_prefix_caching=true'
    orca-bench --max-tokens 512 --rates 1,2 --orca-variants 'paged:kv_policy=paged'   # answers stop early
    orca-bench --tune max_num_seqs=8,16,32,64 --slo-ms 40   # ORCA's tuning: best max_num_seqs within 40 ms/token
    orca-bench --lora 4 --model llama-150m                  # 4 random LoRA adapters mixed vs none (lora_stage.py)

Steps: start tritonserver with `orca`, one `orca_<name>` copy per --orca-variants entry (orca with
other engine parameters), one `baseline` copy per --baseline-batch-sizes and `echo`;
warm every model up; measure the unloaded per-token latency (one typical request alone on orca)
and set the SLO to --slo-factor times it; run a burst of equal-length requests on orca and on the
baseline (the fairness check, which also estimates orca's capacity for the auto rate grid); the
served-path stage (bursts of --served-path-streams requests on orca against the same requests on
the offline engine, with the CPU per token of each server process: served_path.py); sweep
the request rates (each rate: orca, its variants, then every baseline, same requests and arrival
pattern; orca-kind runs also record the engine's peak running requests, preemptions, prompt tokens
computed and prefix-cache hits from the metrics endpoint); run the
same trace against `echo` to measure the load generator's overhead; write bench.json, summary.md,
curve.png. A model stops climbing the rate grid after its first point that misses the SLO (its
curve has turned up; higher rates would only queue longer).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import platform
import random
import re
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from orca_client import bench_server, lora_stage, machine, protocol, served_path, tune
from orca_client.bench_metrics import RunMetrics, Sustained, ratio, summarize, sustained_throughput
from orca_client.bench_server import EngineRunStats, ServedModel
from orca_client.early_stop import with_early_stops
from orca_client.loadgen import LoadOptions, RunResult, run_trace
from orca_client.report import ITERATION_LOGS, write_all
from orca_client.tune import parse_tune
from orca_client.workload import (
    ARRIVAL_HELP,
    DIST_HELP,
    TraceRequest,
    at_rate,
    burst_trace,
    check_fits,
    dist_median,
    load_trace,
    mean_rate,
    salted,
    save_trace,
    shared_prefix_ids,
    synthetic_trace,
)

# ORCA §6 drew prompts from U(32, 512) and outputs from U(1, 128). On a 2-core CPU a 512-token
# prefill of GPT-2-small takes about a second, so the default prompts are shorter; outputs keep
# ORCA's range (their spread is what request-level batching pays for).
DEFAULT_PROMPT_DIST = "uniform:16:128"
DEFAULT_OUTPUT_DIST = "uniform:1:128"
# Auto rates: fractions of orca's measured burst capacity. Low fractions are where a request-level
# server can still meet the SLO; the top ones find where orca stops meeting it (a burst estimates
# capacity low: orca met the SLO at 1.05x of it, so the grid goes on; each model stops at its first miss).
AUTO_FRACTIONS = (0.1, 0.25, 0.45, 0.65, 0.85, 1.05, 1.3, 1.6, 2.0)
AUTO_START = 1  # the auto sweep starts at the second fraction and goes lower only for models that need it
FAIRNESS_TOLERANCE = 0.2  # |baseline / orca makespan - 1| within this counts as "about the same"
OVERHEAD_TARGET = 0.05  # docs/architecture.md, Performance targets: load generator overhead per token < 5% of measured latency


# ---------------------------------------------------------------------------- model geometry
@dataclass
class Geometry:
    vocab_size: int
    context_len: int


def model_geometry(model: str) -> Geometry:
    """Vocabulary and context of a preset or HF checkpoint dir (to draw valid prompt ids)."""
    from orca_backend.config import PRESETS, model_config_from_hf

    if model in PRESETS:
        config = PRESETS[model]
    else:
        path = Path(model) / "config.json"
        if not path.is_file():
            raise SystemExit(f"orca-bench: --model {model!r} is neither a preset ({', '.join(PRESETS)}) "
                             "nor a checkpoint directory with config.json")
        config = model_config_from_hf(path)
    return Geometry(config.vocab_size, config.max_context)


# ---------------------------------------------------------------------------------- progress
class Progress:
    """One status line on stderr, rewritten in place on a terminal, printed per step otherwise."""

    def __init__(self, total_steps: int, enabled: bool = True) -> None:
        self.total = total_steps
        self.step = 0
        self.enabled = enabled
        self.tty = sys.stderr.isatty()
        self.label = ""
        self.started = time.monotonic()
        self.step_started = self.started
        self._last_print = 0.0

    def begin(self, label: str) -> None:
        self.step += 1
        self.label = label
        self.step_started = self._last_print = time.monotonic()
        self._write(f"{label} …", final=not self.tty)

    def update(self, done: int, total: int, errors: int) -> None:
        now = time.monotonic()
        text = f"{self.label}: {done}/{total} done" + (f", {errors} errors" if errors else "") + \
            f", {now - self.step_started:.0f} s"
        if self.tty:
            self._write(text)
        elif now - self._last_print > 15:
            self._last_print = now
            self._write(text, final=True)

    def end(self, summary: str) -> None:
        self._write(f"{self.label}: {summary} ({time.monotonic() - self.step_started:.1f} s)", final=True)

    def info(self, text: str) -> None:
        if self.enabled:
            if self.tty:
                sys.stderr.write("\r\033[K")
            print(f"orca-bench: {text}", file=sys.stderr, flush=True)

    def _write(self, text: str, final: bool = False) -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.started
        line = f"[{self.step}/{self.total} {elapsed:4.0f}s] {text}"
        if self.tty:
            sys.stderr.write("\r\033[K" + line + ("\n" if final else ""))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()


# ---------------------------------------------------------------------------------- workload
@dataclass
class Workload:
    """One request set, replayed at every rate: a rate's run takes its first n requests."""

    base: list[TraceRequest]
    native_rate: float  # the base trace's mean rate (synthetic: 1 req/s by construction)
    description: str
    typical: TraceRequest  # the unloaded probe: median prompt and output lengths
    vocab_size: int = 0
    shared_prefix: int = 0  # tokens every synthetic prompt starts with (--shared-prefix)
    seed: int = 0
    # Set when a served engine caches prefixes (synthetic workloads only): each rate's prompts differ
    # from the first token after the shared prefix on, so a rate finds no prompt of an earlier one in
    # the cache (workload.salted); every model still gets the same requests at a given rate.
    distinct_per_rate: bool = False

    def at(self, rate: float | None, n: int) -> list[TraceRequest]:
        trace = self._scaled(rate, self.base[:n])
        if self.distinct_per_rate:
            trace = salted(trace, self.shared_prefix, self.vocab_size, f"{self.seed}:{rate!r}")
        return trace

    def _scaled(self, rate: float | None, prefix: list[TraceRequest]) -> list[TraceRequest]:
        if rate is None:  # "native": as recorded
            return prefix
        if not math.isfinite(rate):
            return at_rate(prefix, math.inf)
        scale = self.native_rate / rate
        start = prefix[0].arrival if prefix else 0.0
        return [dataclasses.replace(r, arrival=(r.arrival - start) * scale) for r in prefix]

    @property
    def mean_output(self) -> float:
        return statistics.fmean(r.max_tokens for r in self.base)


def make_workload(args: argparse.Namespace, geometry: Geometry, max_requests: int) -> Workload:
    rng = random.Random(args.seed + 1)
    if args.trace:
        base = load_trace(args.trace)
        if not base:
            raise SystemExit(f"orca-bench: {args.trace} holds no requests")
        check_fits(base, geometry.context_len, geometry.vocab_size)
        by_len = sorted(base, key=lambda r: (r.max_tokens, r.prompt_len))
        typical = by_len[len(by_len) // 2]
        typical = TraceRequest(0.0, typical.prompt_ids, typical.max_tokens, typical.prompt_text)
        return Workload(base, mean_rate(base), f"trace {args.trace} ({len(base)} requests, {mean_rate(base):.3f} req/s as recorded)",
                        typical)
    prefix_len = args.shared_prefix
    base = synthetic_trace(max_requests, args.prompt_dist, args.output_dist, geometry.vocab_size,
                           request_rate=1.0, seed=args.seed, arrival=args.arrival, shared_prefix=prefix_len)
    # The unloaded probe is a typical request of this workload: the shared prefix included.
    own = [rng.randrange(geometry.vocab_size) for _ in range(dist_median(args.prompt_dist))]
    typical = TraceRequest(0.0, shared_prefix_ids(prefix_len, geometry.vocab_size, args.seed) + own,
                           dist_median(args.output_dist))
    try:
        check_fits(base + [typical], geometry.context_len, geometry.vocab_size, shared_prefix=prefix_len)
    except ValueError as exc:
        raise SystemExit(f"orca-bench: {exc}") from None
    arrival = "Poisson" if args.arrival == "poisson" else args.arrival
    prompt = f"{prefix_len}-token shared prefix + {args.prompt_dist}" if prefix_len else args.prompt_dist
    return Workload(base, 1.0, f"{arrival} arrivals, prompt {prompt}, output {args.output_dist} tokens "
                               f"(ignore_eos), seed {args.seed}", typical,
                    vocab_size=geometry.vocab_size, shared_prefix=prefix_len, seed=args.seed)


def with_early_stop_workload(args: argparse.Namespace, workload: Workload, geometry: Geometry) -> Workload:
    """--max-tokens: the workload's requests end at stop tokens (early_stop.py)."""
    model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
    sys.stderr.write(f"computing the stop tokens of {len(workload.base)} requests offline ({model}) ...\n")
    try:
        base = with_early_stops(workload.base, args.max_tokens, model, args.device, args.dtype)
        check_fits(base, geometry.context_len, geometry.vocab_size, shared_prefix=workload.shared_prefix)
    except ValueError as exc:
        raise SystemExit(f"orca-bench: {exc}") from None
    mean = statistics.fmean(r.max_tokens for r in base)
    median = statistics.median(r.max_tokens for r in base)
    description = (f"{workload.description}; early stops: max_tokens {args.max_tokens} sent, each request ends "
                   f"at its stop token (outputs mean {mean:.1f}, median {median:g} tokens)")
    return dataclasses.replace(workload, base=base, description=description)


def requests_for(args: argparse.Namespace, rate: float | None, workload: Workload) -> int:
    if args.num_requests:
        n = args.num_requests
    elif rate is None or not math.isfinite(rate):
        n = len(workload.base)
    else:
        n = max(args.min_requests, math.ceil(rate * args.duration))
    return min(n, len(workload.base)) if args.trace else n


# ------------------------------------------------------------------------------------- bench
@dataclass
class Endpoint:
    """The server a bench runs against."""

    url: str  # gRPC
    metrics_url: str | None
    models: list[ServedModel]
    pid: int | None = None  # tritonserver's, when orca-bench started it (the served path reads its process tree)
    notes: list[str] = field(default_factory=list)  # settings changed for the served-path stage


class Bench:
    def __init__(self, args: argparse.Namespace, endpoint: Endpoint, geometry: Geometry, progress: Progress,
                 orca_parameters: dict[str, str] | None = None) -> None:
        self.args = args
        self.url = endpoint.url
        self.metrics_url = endpoint.metrics_url
        self.models = endpoint.models
        self.server_pid = endpoint.pid
        self.served_path_notes = endpoint.notes
        self.orca_parameters = orca_parameters or {}  # orca's config.pbtxt parameters as served
        self.geometry = geometry
        self.progress = progress
        self.result: dict[str, Any] = {"runs": [], "notes": []}
        self.batched = {m.name: m.kind == "baseline" for m in self.models}
        # Record the engine's metrics around orca-kind runs; off where a stage measures CPU itself.
        self.watch_engines = True
        self._dirty = False

    # -- helpers
    def model(self, kind: str) -> list[ServedModel]:
        return [m for m in self.models if m.kind == kind]

    def prefix_caching(self) -> list[str]:
        """Orca-kind models whose served config enables the prefix cache (variants: orca's value
        unless their overrides change it)."""
        default = self.orca_parameters.get("enable_prefix_caching", "false")
        return [m.name for m in self.models if m.is_orca
                and m.overrides.get("enable_prefix_caching", default).strip().lower() == "true"]

    def run(self, model: ServedModel, trace: list[TraceRequest], label: str, rate: float | None = None,
            slo: float | None = None) -> tuple[RunResult, RunMetrics]:
        self.progress.begin(label)
        # Engines must be empty before a run starts; after a cancelled run that can take a while.
        names = [m.name for m in self.models]
        if not bench_server.wait_idle(self.metrics_url, names, timeout_s=120 if self._dirty else 10):
            self.progress.info("warning: an engine still reports queued/running requests; measuring anyway")
        self._dirty = False
        before = bench_server.inference_counts(self.url, model.name) if model.kind == "baseline" else None
        span = trace[-1].arrival if trace else 0.0
        options = LoadOptions(num_channels=self.args.channels, deadline_s=span + self.args.run_timeout,
                              stream=not self.args.no_stream, progress=self.progress.update)
        watch = None
        if model.is_orca and self.watch_engines:
            watch = bench_server.EngineWatch(self.metrics_url, model.name).start()
        try:
            result = run_trace(self.url, model.name, trace, options, batched=self.batched[model.name],
                               rate=mean_rate(trace) if rate is None else rate)
        except BaseException:
            if watch is not None:
                watch.cancel()
            raise
        engine = watch.stop() if watch is not None else None
        metrics = summarize(result, slo)
        if engine is not None:
            apply_engine_stats(metrics, engine)
        if before is not None:
            metrics.batches = bench_server.batches_since(self.url, model.name, before, metrics.completed)
        self._dirty = result.truncated  # cancelled requests must leave the engine before the next run
        errors = f", {metrics.errors} errors ({metrics.first_error})" if metrics.errors else ""
        self.progress.end(f"{metrics.completed}/{metrics.num_requests} in {metrics.duration_s:.1f} s, "
                          f"{metrics.request_throughput:.3f} req/s, median normalized {metrics.normalized_ms.median:.1f} ms/token"
                          + errors)
        return result, metrics

    # -- steps
    def warm_up(self, workload: Workload) -> None:
        probe = TraceRequest(0.0, workload.typical.prompt_ids, min(4, workload.typical.max_tokens),
                             workload.typical.prompt_text)
        for model in self.models:
            _, m = self.run(model, [probe, probe], f"warm-up {model.label}")
            if m.errors:
                raise RuntimeError(f"warm-up of {model.name} failed: {m.first_error}")

    def unloaded(self, workload: Workload) -> float:
        orca = self.model("orca")[0]
        values, tpots = [], []
        for i in range(self.args.unloaded_repeats):
            _, m = self.run(orca, [workload.typical], f"unloaded latency {i + 1}/{self.args.unloaded_repeats}")
            if m.errors:
                raise RuntimeError(f"unloaded probe failed: {m.first_error}")
            values.append(m.normalized_ms.median)
            tpots.append(m.tpot_ms.median)
        median = statistics.median(values)
        self.result["unloaded"] = {
            "model": orca.name, "prompt_len": workload.typical.prompt_len, "max_tokens": workload.typical.max_tokens,
            "normalized_ms": values, "median_ms_per_token": median, "tpot_ms": statistics.median(tpots),
        }  # fmt: skip
        return median

    def fairness(self, workload: Workload) -> float | None:
        """Equal-length burst on orca and on the baseline: both should take about as long.

        Returns orca's output tokens/s in the burst (the auto rate grid's capacity estimate).
        """
        orca = self.model("orca")[0]
        baselines = self.model("baseline")
        size = orca.max_num_seqs or 32
        if baselines:
            size = min(size, max(b.max_batch_size or 1 for b in baselines))
        baseline = min((b for b in baselines if (b.max_batch_size or 0) >= size), key=lambda b: b.max_batch_size or 0,
                       default=None)
        prompt_len = max(1, workload.typical.prompt_len)
        tokens = min(self.args.fairness_tokens, self.geometry.context_len - prompt_len)
        trace = burst_trace(size, prompt_len, tokens, self.geometry.vocab_size, seed=self.args.seed + 2)
        rows, runs = [], {}
        for model in [orca] + ([baseline] if baseline and not self.args.skip_fairness else []):
            raw, m = self.run(model, trace, f"burst of {size}×({prompt_len}+{tokens}) on {model.label}", rate=math.inf)
            sends = [r.send_time for r in raw.records if r.send_time is not None]
            runs[model.name] = m
            rows.append({"model": model.name, "label": model.label, "requests": size, "makespan_s": m.duration_s,
                         "e2e_median_ms": m.e2e_ms.median, "token_throughput": m.output_token_throughput,
                         "batches": m.batches, "send_spread_ms": 1000 * (max(sends) - min(sends)) if sends else None,
                         "errors": m.errors, "metrics": m})
        capacity = runs[orca.name].output_token_throughput if not runs[orca.name].errors else None
        if baseline is not None and baseline.name in runs:
            b, o = runs[baseline.name], runs[orca.name]
            rel = ratio(b.duration_s, o.duration_s)
            ok = abs(rel - 1) <= FAIRNESS_TOLERANCE and not (b.errors or o.errors)
            spread = rows[-1]["send_spread_ms"]
            delay = baseline.max_queue_delay_us
            summary = (f"{size} requests of {prompt_len} prompt + {tokens} output tokens sent together "
                       f"(within {spread:.1f} ms): orca took {o.duration_s:.2f} s, {baseline.label} {b.duration_s:.2f} s "
                       f"in {b.batches if b.batches is not None else '?'} batch(es) → baseline/orca = {rel:.2f} "
                       f"({'about the same: fair' if ok else 'NOT within ±' + str(int(FAIRNESS_TOLERANCE * 100)) + '%'}).")
            if delay is not None and spread is not None and spread > delay / 1000:
                summary += (f" The sends spread over more than the batcher's max_queue_delay ({delay} µs), so the "
                            "baseline may have split the burst.")
            self.result["fairness"] = {"summary": summary, "ratio_baseline_over_orca": rel, "fair": ok,
                                       "tolerance": FAIRNESS_TOLERANCE, "runs": rows}
        return capacity

    def echo_overhead(self, workload: Workload, top_rate: float | None, unloaded_ms: float | None,
                      model_peak_tokens_s: float | None) -> None:
        echo = self.model("echo")
        if not echo:
            return
        echo_model = echo[0]
        runs: dict[str, RunMetrics] = {}
        rate = top_rate if top_rate is not None and math.isfinite(top_rate) else None
        # The overhead per token hardly depends on how many requests there are: a capped run is enough.
        n = min(requests_for(self.args, rate, workload), 32)
        if rate is not None or self.args.trace:
            _, runs["rate"] = self.run(echo_model, workload.at(rate, n), f"echo at {rate or 'native'} req/s (load generator overhead)",
                                       rate=rate)
        burst_n = max(n, 64) if not self.args.trace else n
        burst = workload.at(math.inf, burst_n) if len(workload.base) >= burst_n else \
            synthetic_trace(burst_n, self.args.prompt_dist, self.args.output_dist, self.geometry.vocab_size, seed=self.args.seed)
        _, runs["burst"] = self.run(echo_model, burst, f"echo burst of {len(burst)} (load generator capacity)", rate=math.inf)
        rate_run = runs.get("rate")
        parts = []
        fraction = None
        if rate_run is not None:
            echo_ms = rate_run.normalized_ms.median
            what = "The sweep's top-rate trace" if unloaded_ms else "The workload trace"
            parts.append(f"{what} ({_fmt_rate(rate)} req/s, {rate_run.num_requests} requests) "
                         f"against `echo`, which answers at once: median normalized latency {echo_ms:.3f} ms/token "
                         f"(p99 {rate_run.normalized_ms.p99:.3f}); client CPU {rate_run.client_cpu_us_per_response:.0f} µs "
                         f"per response; sends late by {rate_run.send_lag_ms.median:.2f} ms median, "
                         f"{rate_run.send_lag_ms.p99:.2f} ms p99.")
            if unloaded_ms:
                fraction = echo_ms / unloaded_ms
                parts.append(f"That is **{100 * fraction:.2f}%** of the unloaded per-token latency ({unloaded_ms:.1f} ms): "
                             f"{'within' if fraction < OVERHEAD_TARGET else 'ABOVE'} the {100 * OVERHEAD_TARGET:.0f}% target.")
        b = runs["burst"]
        parts.append(f"All {b.num_requests} requests at once: the load generator and Triton delivered "
                     f"{b.output_token_throughput:.0f} tokens/s ({b.client_cpu_us_per_response:.0f} µs client CPU per response)"
                     + (f", {b.output_token_throughput / model_peak_tokens_s:.0f}× the most any model run produced "
                        f"({model_peak_tokens_s:.1f} tokens/s)." if model_peak_tokens_s else "."))
        self.result["loadgen_overhead"] = {
            "summary": " ".join(parts), "fraction_of_unloaded": fraction, "target": OVERHEAD_TARGET,
            "rate_run": rate_run, "burst_run": b,
        }  # fmt: skip

    def sweep(self, workload: Workload, rates: list[float | None], slo: float,
              start: int = 0) -> dict[str, list[RunMetrics]]:
        """For each rate from rates[start] up: orca, then every baseline, on the same trace.

        A model stops climbing after its first point that misses the SLO (unless --no-early-stop).
        Models that already miss it at rates[start] then walk down the rates below it until one
        passes: low rates are the longest runs, so they are spent only where they tell something.
        """
        curves: dict[str, list[RunMetrics]] = {m.name: [] for m in self.models if m.kind != "echo"}
        serving = [m for m in self.models if m.kind != "echo"]
        early_stop = not self.args.no_early_stop
        start = 0 if not early_stop else start
        stopped: set[str] = set()
        missed_first: list[ServedModel] = []
        for i in range(start, len(rates)):
            for model in serving:
                if model.name in stopped:
                    self.progress.step += 1
                    continue
                m = self._point(model, workload, rates[i], slo, curves)
                if not m.slo_met and early_stop:
                    stopped.add(model.name)
                    if i == start and start > 0:
                        missed_first.append(model)
                    self.progress.info(f"{model.label} missed the SLO at {_fmt_rate(rates[i])} req/s; "
                                       "skipping its higher rates")
        for i in reversed(range(start)):
            for model in list(missed_first):
                if self._point(model, workload, rates[i], slo, curves).slo_met:
                    missed_first.remove(model)
        return curves

    def _point(self, model: ServedModel, workload: Workload, rate: float | None, slo: float,
               curves: dict[str, list[RunMetrics]]) -> RunMetrics:
        n = requests_for(self.args, rate, workload)
        trace = workload.at(rate, n)
        raw, m = self.run(model, trace, f"{model.label} at {_fmt_rate(rate)} req/s ({n} requests)",
                          rate=rate if rate is not None else mean_rate(trace), slo=slo)
        curves[model.name].append(m)
        self.result["runs"].append({"metrics": m, "raw": raw})
        return m


def apply_engine_stats(metrics: RunMetrics, engine: EngineRunStats) -> None:
    """Copies what the engine's metrics said about a run into its RunMetrics."""
    metrics.peak_running = engine.peak_running
    for key, value in engine.counters.items():
        setattr(metrics, key, value)
    metrics.engine_metrics_note = engine.note


def _fmt_rate(rate: float | None) -> str:
    if rate is None:
        return "native"
    return "burst" if not math.isfinite(rate) else f"{rate:.3g}"


def headline(sustained: dict[str, Sustained], models: list[ServedModel], baseline_rates: list[float]) -> dict[str, Any]:
    kinds = {m.name: m.kind for m in models}
    orca = next((s for name, s in sustained.items() if kinds.get(name) == "orca"), None)
    baselines = {name: s for name, s in sustained.items() if kinds.get(name) == "baseline"}
    if orca is None or not baselines:
        return {}
    best_name, best = max(baselines.items(), key=lambda kv: kv[1].max_throughput)
    out: dict[str, Any] = {
        "orca_rps": orca.max_throughput, "best_baseline": best_name, "best_baseline_rps": best.max_throughput,
        "ratio": ratio(orca.max_throughput, best.max_throughput),
    }  # fmt: skip
    o_i = orca.interpolated or orca.max_throughput
    b_i = best.interpolated or best.max_throughput
    out["ratio_interpolated"] = ratio(o_i, b_i) if (orca.interpolated or best.interpolated) and b_i > 0 else None
    qualifiers = []
    if best.max_throughput == 0 and baseline_rates:
        low = min(baseline_rates)
        out["ratio_lower_bound"] = ratio(orca.max_throughput, low)
        qualifiers.append(f"No baseline point met the SLO, down to {low:.3g} req/s: the ratio is at least "
                          f"{out['ratio_lower_bound']:.1f}× (add lower --rates to pin it)")
    if best.above_grid:
        qualifiers.append(f"{best_name} met the SLO at every rate tried: add higher --rates to find its maximum")
    if orca.above_grid:
        qualifiers.append("orca met the SLO at the highest rate tried, so its maximum (and the ratio) may be higher")
    if orca.max_throughput == 0:
        qualifiers.append("orca met the SLO at no rate tried: lower the --rates")
    out["qualifier"] = "; ".join(qualifiers)
    return out


# ------------------------------------------------------------------------------------ server
@contextlib.contextmanager
def serving(args: argparse.Namespace, out: Path, progress: Progress) -> Iterator[Endpoint]:
    """Yields the Endpoint of a server of our own, or of the one at --url."""
    variants = {} if args.echo else args.orca_variants
    if args.url:
        baselines = [n.strip() for n in args.baseline_models.split(",") if n.strip()]
        names = [] if args.echo else ["orca", *map(bench_server.variant_name, variants), *baselines]
        if any(variants.values()):
            progress.info("with --url the variants' key=value settings are not applied: orca-bench reads what "
                          "each orca_<name> serves (bench.json models[].overrides)")
        if args.echo or not args.no_echo:
            names.append("echo")
        models = []
        for name in names:
            try:
                models.append(bench_server.describe_model(args.url, name))
            except Exception as exc:
                if name == "echo":
                    progress.info(f"no echo model at {args.url} ({exc}); skipping the overhead check")
                    continue
                raise SystemExit(f"orca-bench: model {name!r} is not served at {args.url}: {exc}") from None
        bench_server.describe_variants(args.url, models)
        yield Endpoint(args.url, args.metrics_url, models)
        return

    from orca_backend.entrypoints.serve import ServerOptions, TritonServer

    sizes = [] if args.echo else args.baseline_batch_sizes
    run_dir = Path(tempfile.mkdtemp(prefix="orca-bench-"))
    names = bench_server.build_repository(run_dir / "repository", sizes, echo=args.echo or not args.no_echo,
                                          orca=not args.echo, max_queue_delay_us=args.max_queue_delay_us,
                                          orca_variants=variants)
    params: dict[str, str] = {}
    if not args.echo:
        model = str(Path(args.model).resolve()) if Path(args.model).exists() else args.model
        params = {"model": model, "device": args.device, "dtype": args.dtype}
        if args.kv_capacity_tokens:
            params["kv_capacity_tokens"] = str(args.kv_capacity_tokens)
    # Only orca's engine takes max_num_seqs; each baseline copy's batch is its Triton max_batch_size.
    per_model: dict[str, dict[str, str]] = {"orca": {}}
    if args.max_num_seqs:
        per_model["orca"]["max_num_seqs"] = str(args.max_num_seqs)
    if args.speculative_config:  # speculative decoding on orca only: the A/B measures it against the baseline
        per_model["orca"]["speculative_config"] = args.speculative_config
    if args.stream_interval:
        per_model["orca"]["stream_interval"] = str(args.stream_interval)
    notes = []
    if "orca" in names and args.served_path_streams:
        config = (run_dir / "repository" / "orca" / "config.pbtxt").read_text()
        raised = served_path.raised_limits(config, args.served_path_streams,
                                           args.served_path_prompt + args.served_path_tokens,
                                           args.max_num_seqs, args.kv_capacity_tokens)
        if raised:
            per_model.setdefault("orca", {}).update(raised)
            notes.append("orca runs with " + ", ".join(f"{k}={v}" for k, v in raised.items())
                         + " (above its config.pbtxt) so the served-path stage's largest burst is one batch; "
                         "every orca run of this bench used it (--served-path-streams '' keeps config.pbtxt's)"
                         + (", and so did its variants." if variants else "."))
    per_model.update(variant_parameters(per_model["orca"], variants))
    if args.iteration_log and not args.echo:
        logs = out / ITERATION_LOGS
        shutil.rmtree(logs, ignore_errors=True)  # the engines append: this run's lines only
        logs.mkdir(parents=True)
        for name in names:
            if name != "echo":
                per_model.setdefault(name, {})["iteration_log"] = str((logs / f"{name}.jsonl").resolve())
    lora_modules = {}
    if args.lora:
        lora_modules = lora_stage.write_adapters(out, args.model, args.lora, args.lora_rank)
        params |= {"max_loras": str(args.lora), "max_lora_rank": str(args.lora_rank)}
    options = ServerOptions(models=tuple(names), model_repository=run_dir / "repository",
                            parameters={} if args.echo else params, lora_modules=lora_modules,
                            model_parameters={} if args.echo else per_model,
                            log_file=out / "server.log", run_dir=run_dir / "run")
    (run_dir / "run").mkdir(parents=True, exist_ok=True)
    (out / "server.log").unlink(missing_ok=True)  # this run's log only
    progress.info(f"starting tritonserver with {', '.join(names)} (log: {out / 'server.log'})")
    started = time.monotonic()
    server = TritonServer(options)
    server.start()
    try:
        server.wait_ready(timeout_s=args.ready_timeout)
        progress.info(f"server ready in {time.monotonic() - started:.0f} s at {server.grpc_url}")
        models = [bench_server.describe_model(server.grpc_url, name) for name in names]
        bench_server.describe_variants(server.grpc_url, models)
        for m in models:  # configs unreadable: what we asked for is what it runs
            if m.kind == "orca_variant" and not m.overrides:
                m.overrides = dict(variants.get(m.variant or "", {}))
        yield Endpoint(server.grpc_url, server.metrics_url, models, server.process.pid if server.process else None, notes)
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)


def variant_parameters(orca: dict[str, str], variants: dict[str, dict[str, str]]) -> dict[str, dict[str, str]]:
    """Per-model parameter overrides of each orca_<name>: every orca-wide one, then its own keys.

    The variant's keys are in its config.pbtxt already; they are repeated here because the server
    applies per-model overrides over the file and over the settings of every model (--kv-capacity-tokens
    ...), and a variant's own key must win over all of those."""
    return {bench_server.variant_name(name): {**orca, **own} for name, own in variants.items()}


# -------------------------------------------------------------------------------------- main
# Values orca-bench can check before starting a server; other keys go to the engine as given.
_VARIANT_CHOICES = {"kv_policy": ("reserve", "paged"), "enable_prefix_caching": ("true", "false")}
_VARIANT_MIN_INT = {"block_size": 1, "max_num_batched_tokens": 0, "max_num_seqs": 1, "kv_capacity_tokens": 1,
                    "stream_interval": 1}
_VARIANT_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


def _orca_parameter_keys() -> set[str] | None:
    """Keys orca reads from its parameters: the engine's settings (EngineConfig) and the checked-in
    config.pbtxt's (the adapter's, like stream_interval). None: unreadable, keys not checked. A
    misspelt key would otherwise be carried along unread, and the variant would equal orca."""
    from dataclasses import fields

    from orca_backend.config import EngineConfig
    from orca_backend.entrypoints.serve import default_model_repository

    try:
        text = (default_model_repository() / "orca" / "config.pbtxt").read_text()
    except OSError:
        return None
    return {f.name for f in fields(EngineConfig)} | set(re.findall(r'parameters\s*\{\s*key:\s*"([^"]+)"', text))


def parse_orca_variants(text: str) -> dict[str, dict[str, str]]:
    """'name:key=value,key=value;name2:key=value' -> {name: {key: value}} (argparse type of --orca-variants).

    A bare 'name' is an unchanged copy of orca (an A/A check of the bench's noise). Raises
    ArgumentTypeError naming the part that is wrong."""
    known = _orca_parameter_keys()
    variants: dict[str, dict[str, str]] = {}
    for part in (p.strip() for p in text.split(";")):
        if not part:
            continue
        name, _, settings = (x.strip() for x in part.partition(":"))
        if not _VARIANT_NAME_RE.fullmatch(name):
            raise argparse.ArgumentTypeError(f"variant {part!r}: the name before ':' must be letters, digits, "
                                             f"'_' or '-' (it is served as model orca_<name>), got {name!r}")
        if name in variants:
            raise argparse.ArgumentTypeError(f"variant {name!r} is given twice")
        variants[name] = _variant_settings(name, settings, known)
    return variants


def _variant_settings(name: str, settings: str, known: set[str] | None) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in (i.strip() for i in settings.split(",")):
        if not item:
            continue
        key, sep, value = (x.strip() for x in item.partition("="))
        if not sep or not key:
            raise argparse.ArgumentTypeError(f"variant {name!r}: {item!r} is not key=value")
        if known is not None and key not in known:
            raise argparse.ArgumentTypeError(f"variant {name!r}: {key!r} is not a parameter of orca's config.pbtxt "
                                             f"(known: {', '.join(sorted(known))})")
        if key in out:
            raise argparse.ArgumentTypeError(f"variant {name!r}: {key!r} is given twice")
        if key in _VARIANT_CHOICES:
            value = value.lower()
            if value not in _VARIANT_CHOICES[key]:
                raise argparse.ArgumentTypeError(f"variant {name!r}: {key}={value!r}, expected one of "
                                                 + ", ".join(_VARIANT_CHOICES[key]))
        if key in _VARIANT_MIN_INT:
            try:
                number = int(value)
            except ValueError:
                number = None
            if number is None or number < _VARIANT_MIN_INT[key]:
                raise argparse.ArgumentTypeError(f"variant {name!r}: {key}={value!r}, expected an integer "
                                                 f">= {_VARIANT_MIN_INT[key]}")
        out[key] = value
    return out


def _rate_list(text: str) -> list[float] | str:
    if text in ("auto", "native"):
        return text
    try:
        rates = [math.inf if t.strip() in ("inf", "burst") else float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--rates takes auto, native or comma-separated req/s, got {text!r}") from None
    if not rates or any(r <= 0 for r in rates):
        raise argparse.ArgumentTypeError(f"--rates must be positive, got {text!r}")
    return sorted(rates)


def _int_list(text: str) -> list[int]:
    try:
        values = sorted({int(t) for t in text.split(",") if t.strip()})
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"values must be >= 1, got {text!r}")
    return values


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="orca-bench", description=__doc__.splitlines()[0],
                                epilog=__doc__.split("\n", 2)[2], formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model and server")
    g.add_argument("--model", default="gpt2-small", help="preset name or HF checkpoint directory (default: gpt2-small)")
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    g.add_argument("--baseline-batch-sizes", type=_int_list, default=[8, 32],
                   help="dynamic-batcher max_batch_size of each baseline copy (default 8,32)")
    g.add_argument("--max-num-seqs", type=int,
                   help="orca's engine batch limit, its max_num_seqs parameter (default: its config.pbtxt, 32)")
    g.add_argument("--stream-interval", type=int,
                   help="orca: tokens per streamed response after the first (default: config.pbtxt, 1)")
    g.add_argument("--speculative-config", metavar="JSON",
                   help="orca: speculative decoding (vLLM's speculative_config JSON, e.g. "
                        "'{\"method\": \"ngram\", \"num_speculative_tokens\": 4}')")
    g.add_argument("--max-queue-delay-us", type=int, help="baseline max_queue_delay_microseconds (default: config.pbtxt)")
    g.add_argument("--kv-capacity-tokens", type=int, help="K/V pool size of every engine (default: config.pbtxt)")
    g.add_argument("--url", help="use the tritonserver at this gRPC address instead of starting one")
    g.add_argument("--metrics-url", help="with --url: its metrics endpoint (to wait for idle engines between runs)")
    g.add_argument("--baseline-models", default="baseline", help="with --url: baseline model names (comma-separated)")
    g.add_argument("--orca-variants", type=parse_orca_variants, default={}, metavar="SPEC",
                   help="extra copies of orca with other config.pbtxt parameters, swept beside it on the same "
                        "traces: 'name:key=value,key=value;name2:key=value', each served as model orca_<name> "
                        "with every orca-wide flag too (e.g. 'paged:kv_policy=paged' or "
                        "'cached:kv_policy=paged,enable_prefix_caching=true;chunked:max_num_batched_tokens=256'; "
                        "keys: kv_policy, block_size, enable_prefix_caching, max_num_batched_tokens, ...). "
                        "With --url: the orca_<name> models already served")
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds to wait for the models to load")
    w = p.add_argument_group("workload")
    w.add_argument("--trace", help="JSONL trace (arrival, prompt_ids or prompt, max_tokens) instead of a synthetic one")
    w.add_argument("--prompt-dist", default=DEFAULT_PROMPT_DIST, help=f"prompt lengths: {DIST_HELP}")
    w.add_argument("--output-dist", default=DEFAULT_OUTPUT_DIST, help=f"output lengths: {DIST_HELP}")
    w.add_argument("--arrival", default="poisson", help=f"arrival process: {ARRIVAL_HELP}")
    w.add_argument("--shared-prefix", type=int, default=0, metavar="N",
                   help="every synthetic prompt starts with the same N random tokens (a system prompt), then "
                        "its own --prompt-dist tokens (default 0)")
    w.add_argument("--max-tokens", type=int, default=None, metavar="M",
                   help="early stops: send max_tokens M and end each request with a stop token at about its "
                        "--output-dist length, as answers end at EOS well inside a loose bound (greedy outputs "
                        "computed once offline with the served weights; needs explicit --rates)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--rates", type=_rate_list, default="auto",
                   help="request rates in req/s, comma-separated; 'auto' (default): fractions of orca's measured "
                        "capacity; 'native': a --trace as recorded")
    w.add_argument("--num-requests", type=int, help="requests per run (default: --duration worth, at least --min-requests)")
    w.add_argument("--duration", type=float, default=16.0, help="seconds of arrivals per run (default 16)")
    w.add_argument("--min-requests", type=int, default=8)
    s = p.add_argument_group("SLO and checks")
    s.add_argument("--slo-factor", type=float, default=6.0, help="SLO = this × the unloaded per-token latency (default 6)")
    s.add_argument("--slo-ms", type=float, help="an absolute SLO in ms/token instead")
    s.add_argument("--unloaded-repeats", type=int, default=3)
    s.add_argument("--fairness-tokens", type=int, default=32, help="output tokens of each fairness-burst request")
    s.add_argument("--skip-fairness", action="store_true",
                   help="no equal-length burst on the baseline; with explicit --rates, none on orca either")
    s.add_argument("--no-echo", action="store_true", help="skip the load generator overhead check")
    s.add_argument("--iteration-log", action="store_true",
                   help="every served engine writes its iteration log to OUT/iteration_logs/<model>.jsonl, "
                        "plotted as OUT/iterations.png (batch size and K/V use over time, all models)")
    s.add_argument("--echo", action="store_true", help="only measure the load generator's overhead against `echo`")
    s.add_argument("--no-early-stop", action="store_true", help="run every rate even after a model missed the SLO")
    t = p.add_argument_group("tuning (ORCA's step: the highest throughput within a latency budget)")
    t.add_argument("--tune", type=parse_tune, metavar="KEY=V1,V2,...",
                   help="serve one orca copy per value of this orca parameter beside the others on the same traces "
                        "(e.g. max_num_seqs=8,16,32,64 or kv_policy=reserve,paged) and report the value with the "
                        "highest request throughput whose median normalized latency is within the SLO (the budget: "
                        "--slo-ms, or --slo-factor × the unloaded latency), with its config.pbtxt line")
    t.add_argument("--tune-p90", action="store_true", help="with --tune: the p90 normalized latency must be within the "
                                                          "budget too")
    sp = p.add_argument_group("served path (served vs offline throughput, server CPU per token)")
    sp.add_argument("--served-path-streams", type=_int_list, default=[64, 256],
                    help="burst sizes (concurrent streams) of the served-path stage, comma-separated; '' skips "
                         "it (default 64,256; orca's max_num_seqs and K/V pool are raised to fit unless set)")
    sp.add_argument("--served-path-prompt", type=int, default=32, help="prompt tokens of each request (default 32)")
    sp.add_argument("--served-path-tokens", type=int, default=64, help="output tokens of each request (default 64)")
    sp.add_argument("--served-path-repeats", type=int, default=2,
                    help="bursts per stream count, served and offline; the best throughput is reported (default 2)")
    sp.add_argument("--served-path-only", action="store_true",
                    help="only warm-up, the fairness burst and the served-path stage (no SLO probe, sweep or echo)")
    lo = p.add_argument_group("LoRA (only this stage runs: orca serving N random adapters, bursts with them and without)")
    lo.add_argument("--lora", type=int, default=0, metavar="N", help="serve N random LoRA adapters and compare bursts "
                    "with request i on adapter i mod N against bursts with none")
    lo.add_argument("--lora-rank", type=int, default=16, help="the adapters' rank (default 16)")
    lo.add_argument("--lora-streams", type=int, default=32, help="requests per burst (default 32)")
    lo.add_argument("--lora-prompt", type=int, default=32, help="prompt tokens of each request (default 32)")
    lo.add_argument("--lora-tokens", type=int, default=64, help="output tokens of each request (default 64)")
    lo.add_argument("--lora-repeats", type=int, default=3, help="rounds of (none, mixed) (default 3)")
    r = p.add_argument_group("run")
    r.add_argument("--no-stream", action="store_true",
                   help="ask orca for one response per request instead of one per token (the baseline always answers once)")
    r.add_argument("--run-timeout", type=float, default=90.0, help="seconds a run may take after its last arrival")
    r.add_argument("--channels", type=int, default=4, help="gRPC connections the streams are spread over")
    r.add_argument("--out", default="bench_results", help="output directory (default bench_results/)")
    r.add_argument("--save-trace", action="store_true", help="also write the workload as trace.jsonl")
    r.add_argument("--quiet", action="store_true", help="no progress output")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    if args.echo and args.no_echo:
        raise SystemExit("orca-bench: --echo and --no-echo exclude each other")
    if args.rates == "native" and not args.trace:
        raise SystemExit("orca-bench: --rates native needs --trace")
    if args.shared_prefix < 0 or (args.shared_prefix and args.trace):
        raise SystemExit("orca-bench: --shared-prefix takes N >= 0 and applies to synthetic workloads (not --trace)")
    if args.max_tokens is not None and (args.trace or args.echo or not isinstance(args.rates, list)):
        raise SystemExit("orca-bench: --max-tokens applies to synthetic workloads at explicit --rates (each "
                         "request's stop token is computed offline, once)")
    if args.orca_variants and (args.echo or args.served_path_only):
        raise SystemExit("orca-bench: --orca-variants are swept beside orca; --echo and --served-path-only run no sweep")
    if args.tune_p90 and not args.tune:
        raise SystemExit("orca-bench: --tune-p90 goes with --tune")
    if args.tune:
        _add_tune_variants(args)
    if args.lora:
        if args.lora < 1 or args.echo or args.served_path_only or args.orca_variants or args.url:
            raise SystemExit("orca-bench: --lora N (N >= 1) runs its own stage on a server it starts, alone (no --echo, "
                             "--served-path-only, --orca-variants, --tune or --url)")
        args.no_echo, args.baseline_batch_sizes, args.served_path_streams = True, [], []
    if args.served_path_only:
        if args.echo or not args.served_path_streams:
            raise SystemExit("orca-bench: --served-path-only needs orca and non-empty --served-path-streams")
        args.no_echo = True  # the stage does not need the load generator check: do not even load `echo`
    if min(args.served_path_prompt, args.served_path_tokens, args.served_path_repeats) < 1:
        raise SystemExit("orca-bench: --served-path-prompt, --served-path-tokens and --served-path-repeats must be >= 1")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    geometry = model_geometry(args.model) if not args.echo or not args.trace else Geometry(1 << 30, 1 << 30)
    explicit_rates = args.rates if isinstance(args.rates, list) else None
    max_rate = max((r for r in explicit_rates or [] if math.isfinite(r)), default=0.0)
    max_requests = max(args.num_requests or 0, args.min_requests, math.ceil(max_rate * args.duration), 64)
    # Auto rates are unknown until the capacity probe; leave room for a fast machine.
    if explicit_rates is None and not args.num_requests:
        max_requests = max(max_requests, 2000)
    workload = make_workload(args, geometry, max_requests)
    if args.max_tokens is not None:
        workload = with_early_stop_workload(args, workload, geometry)
    if args.save_trace:
        save_trace(workload.base, out / "trace.jsonl")

    n_baselines = 0 if args.echo else (len(args.baseline_batch_sizes) if not args.url else len(args.baseline_models.split(",")))
    n_baselines += len(args.orca_variants)  # progress only: variants run wherever a baseline does
    n_rates = len(explicit_rates) if explicit_rates else (1 if args.rates == "native" else len(AUTO_FRACTIONS))
    stage = 0 if args.echo else len(args.served_path_streams) * (args.served_path_repeats + 1)
    if args.lora:
        steps = 1 + 2 * args.lora_repeats
    elif args.served_path_only:
        steps = (1 + n_baselines) + 2 + stage
    else:
        steps = (2 if args.echo else (1 + n_baselines) * (1 + n_rates) + args.unloaded_repeats + 2 + (0 if args.no_echo else 3))
        steps += stage
    progress = Progress(steps, enabled=not args.quiet)
    started_wall, started = datetime.now(timezone.utc), time.monotonic()
    result: dict[str, Any] = {}
    served: dict[str, str] = {}
    interrupted = False
    with serving(args, out, progress) as endpoint:
        served = {}
        # What the server really runs (with --url it need not match our flags).
        if any(m.kind == "orca" for m in endpoint.models):
            with contextlib.suppress(Exception):
                served = protocol.string_parameters(bench_server.fetch_model_config(endpoint.url, "orca"))
        bench = Bench(args, endpoint, geometry, progress, orca_parameters=served)
        result = bench.result
        result["labels"] = {m.name: m.label for m in endpoint.models}
        result["models"] = [asdict(m) for m in endpoint.models]
        try:
            _run_all(args, bench, workload, explicit_rates)
        except KeyboardInterrupt:
            interrupted = True
            result["notes"].append("interrupted: partial results")
    host = machine.describe()
    result.update({
        "command": "orca-bench " + shlex.join(argv),
        "commit": machine.code_revision(),
        "started": started_wall.isoformat(timespec="seconds"),
        "finished": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "wall_s": time.monotonic() - started,
        "setup": {
            "model": "echo (load generator check)" if args.echo else _model_name(served.get("model") or args.model),
            "device": served.get("device") or args.device, "dtype": served.get("dtype") or args.dtype,
            "server_parameters": served, "workload": workload.description,
            "host": f"Client and server on {platform.node()}: {machine.summary(host)}; load average at the end "
                    f"{', '.join(f'{x:.1f}' for x in os.getloadavg())}.",
            "machine": host,
            "arguments": vars(args),
        },
    })  # fmt: skip
    paths = write_all(result, out)
    progress.info("wrote " + ", ".join(str(p) for p in paths.values()))
    if not args.quiet and (out / "summary.md").is_file():
        text = (out / "summary.md").read_text()
        head = text.split("## Throughput", 1)[0].strip()
        if "## Served path" in text and "## Served path" not in head:
            head += "\n\n## Served path" + text.partition("## Served path")[2].split("\n## ", 1)[0].rstrip()
        print(head, file=sys.stderr)
    return 130 if interrupted else 0


def _model_name(model: str) -> str:
    """A preset's name, or a checkpoint directory's last component (paths are noise in a report)."""
    return Path(model).name if Path(model).exists() else model


def _run_all(args: argparse.Namespace, bench: Bench, workload: Workload, explicit_rates: list[float] | None) -> None:
    result = bench.result
    if args.echo:
        rate = max((r for r in explicit_rates or [] if math.isfinite(r)), default=None)
        bench.echo_overhead(workload, rate if rate is not None else 4.0, None, None)
        return
    cached = bench.prefix_caching()
    if cached and args.max_tokens is not None:
        raise SystemExit("orca-bench: --max-tokens computes each prompt's stop token once, but with prefix caching "
                         f"({', '.join(cached)}) each rate's prompts change; run them apart")
    if cached and not args.trace:
        workload.distinct_per_rate = True
        result["notes"].append(f"{', '.join(cached)} cache(s) prompt prefixes: each rate's prompts differ from the "
                               "first token after the shared prefix on, so no rate reuses an earlier rate's prompts "
                               "(every model still got the same requests at a given rate).")
    elif cached:
        result["notes"].append(f"{', '.join(cached)} cache(s) prompt prefixes and the same trace is replayed at every "
                               "rate: later rates can find earlier rates' prompts in the cache.")
    bench.warm_up(workload)
    if args.lora:
        result["lora"] = lora_stage.run_stage(bench)
        return
    if args.served_path_only:
        bench.fairness(workload)
        result["served_path"] = _served_path(bench)
        return
    unloaded_ms = bench.unloaded(workload)
    slo = args.slo_ms if args.slo_ms else args.slo_factor * unloaded_ms
    result["slo"] = {"factor": args.slo_factor if not args.slo_ms else None, "ms_per_token": slo,
                     "definition": "median normalized latency (end-to-end / output tokens) of a run ≤ this"}
    # orca's burst is the fairness check's first half and the auto grid's capacity estimate: with
    # --skip-fairness and rates given, nothing reads it (long prompts make it cost tens of seconds).
    capacity_tokens = bench.fairness(workload) if not (args.skip_fairness and args.rates != "auto") else None
    if args.served_path_streams:
        result["served_path"] = _served_path(bench)
    if explicit_rates is not None:
        rates: list[float | None] = list(explicit_rates)
    elif args.rates == "native":
        rates = [None]
    else:
        if not capacity_tokens:
            raise RuntimeError("the capacity probe on orca failed; pass --rates explicitly")
        capacity = capacity_tokens / workload.mean_output
        rates = [round(f * capacity, 3) for f in AUTO_FRACTIONS]
        result["capacity_estimate"] = {
            "orca_burst_tokens_per_s": capacity_tokens, "mean_output_tokens": workload.mean_output,
            "requests_per_s": capacity, "fractions": list(AUTO_FRACTIONS), "rates": rates,
        }  # fmt: skip
        bench.progress.info(f"orca's burst capacity ≈ {capacity:.3f} req/s for this workload; rates: "
                            + ", ".join(f"{r:g}" for r in rates))
    result["rates"] = rates
    curves = bench.sweep(workload, rates, slo, start=AUTO_START if explicit_rates is None and len(rates) > 1 else 0)
    sustained = {name: sustained_throughput(points, slo) for name, points in curves.items() if points}
    result["sustained"] = sustained
    if args.tune:
        result["tune"] = tune.choose(args.tune, curves, slo, args.tune_p90)
        best = result["tune"].get("config_pbtxt")
        bench.progress.info(f"--tune {args.tune.key}: " + (f"best {result['tune']['best']}: {best}" if best else
                                                           "no value met the budget at any rate tried"))
    kinds = {m.name: m.kind for m in bench.models}
    baseline_rates = [m.offered_rate for name, points in curves.items() for m in points
                      if kinds.get(name) == "baseline" and math.isfinite(m.offered_rate)]
    result["headline"] = headline(sustained, bench.models, baseline_rates)
    if not args.no_echo:
        top = max((r for r in rates if r is not None and math.isfinite(r)), default=None)
        peak = max((m.output_token_throughput for points in curves.values() for m in points), default=None)
        bench.echo_overhead(workload, top, unloaded_ms, peak)
    result["notes"] += sweep_notes([run["metrics"] for run in result["runs"]], bench.models)


def _add_tune_variants(args: argparse.Namespace) -> None:
    """--tune's values as orca variants, beside any --orca-variants."""
    if args.echo or args.served_path_only:
        raise SystemExit("orca-bench: --tune sweeps orca copies; --echo and --served-path-only run no sweep")
    known = _orca_parameter_keys()
    if known is not None and args.tune.key not in known:
        raise SystemExit(f"orca-bench: --tune {args.tune.key}: not a parameter of orca's config.pbtxt "
                         f"(known: {', '.join(sorted(known))})")
    for name, settings in args.tune.variants().items():
        if name in args.orca_variants:
            raise SystemExit(f"orca-bench: --tune's variant {name!r} is also in --orca-variants")
        args.orca_variants[name] = settings


def _served_path(bench: Bench) -> dict[str, Any]:
    """The served-path stage, without the engine-metrics watcher: the stage measures client and
    server CPU per token, and the watcher's scrapes would add to both."""
    bench.watch_engines = False
    try:
        return served_path.run_stage(bench)
    finally:
        bench.watch_engines = True


def sweep_notes(points: list[RunMetrics], models: list[ServedModel]) -> list[str]:
    """What a reader needs to trust (or discount) the sweep's numbers."""
    notes = []
    if any(m.kind == "baseline" for m in models):
        notes.append("The baseline answers once per request (request-level, not streamed): its TTFT is its "
                     "end-to-end latency and it has no TPOT or inter-token latency. Normalized latency is comparable.")
    lags = [m.send_lag_ms for m in points if m.send_lag_ms.count]
    if lags:
        notes.append(f"Open-loop fidelity: requests left a median {max(s.median for s in lags):.2f} ms (worst run) "
                     f"after their scheduled time; worst p99 {max(s.p99 for s in lags):.1f} ms.")
    shares = [m.client_cpu_share for m in points if math.isfinite(m.client_cpu_share)]
    if shares:
        notes.append(f"The load generator used at most {100 * max(shares):.1f}% of one CPU during a run "
                     f"(it shares the machine with the server).")
    missing: dict[tuple[str, str], int] = {}
    for m in points:
        if m.engine_metrics_note:
            missing[(m.model, m.engine_metrics_note)] = missing.get((m.model, m.engine_metrics_note), 0) + 1
    for (model, why), count in list(missing.items())[:5]:
        notes.append(f"Engine metrics of {model} incomplete in {count} run(s): {why}.")
    return notes


if __name__ == "__main__":
    sys.exit(main())
