"""Serving metrics from raw per-request timestamps, as ORCA and today's LLM benchmarks define them.

Per request (times in the load generator's clock, seconds after the run's start):
- end-to-end latency  = final response arrival - send time
- normalized latency  = end-to-end latency / output tokens (ORCA §6, ms/token)
- TTFT                = first response arrival - send time (the baseline answers once: TTFT = e2e)
- TPOT                = (e2e - TTFT) / (output tokens - 1), for streamed requests of 2+ tokens
- inter-token latency = the gap between consecutive responses of a stream (one sample per
  response after the first; a response carrying k tokens is one sample, as in vLLM's benchmark)
Per run: throughput = completed requests / run duration (trace time 0 to the last completion),
output-token throughput likewise, and goodput = requests whose normalized latency met the SLO.
Everything is recomputable from the JSON's raw records; tests do exactly that. The exceptions are
the engine's own numbers for orca-kind models (peak running requests, preemptions, prompt tokens
computed, prefix-cache hits), read from the server's metrics endpoint around the run.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from orca_client.loadgen import RequestRecord, RunResult
from orca_client.protocol import PERF_OUTPUTS


@dataclass
class Stats:
    """Distribution summary in milliseconds (count 0: every field is NaN)."""

    count: int
    mean: float
    median: float
    p90: float
    p99: float
    max: float

    @classmethod
    def of(cls, values_s: Iterable[float]) -> Stats:
        values = np.asarray(list(values_s), dtype=np.float64) * 1000.0
        if values.size == 0:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan)
        p50, p90, p99 = np.percentile(values, [50, 90, 99])  # linear interpolation between ranks
        return cls(int(values.size), float(values.mean()), float(p50), float(p90), float(p99), float(values.max()))


def e2e_s(r: RequestRecord) -> float:
    assert r.done_time is not None and r.send_time is not None
    return r.done_time - r.send_time


def normalized_s(r: RequestRecord) -> float:
    """ORCA's normalized latency in seconds per output token."""
    return e2e_s(r) / max(1, r.output_tokens)


def ttft_s(r: RequestRecord) -> float:
    assert r.send_time is not None
    return r.response_times[0] - r.send_time


def tpot_s(r: RequestRecord) -> float | None:
    """None for 1-token requests and for answers in one response (not streamed: no token pace to see)."""
    if r.output_tokens < 2 or len(r.response_times) < 2:
        return None
    return (e2e_s(r) - ttft_s(r)) / (r.output_tokens - 1)


def itl_s(r: RequestRecord) -> list[float]:
    return [b - a for a, b in zip(r.response_times, r.response_times[1:], strict=False)]


@dataclass
class RunMetrics:
    model: str
    offered_rate: float  # req/s of the trace (inf: burst)
    num_requests: int
    completed: int
    errors: int
    truncated: bool
    duration_s: float
    request_throughput: float  # completed / duration, req/s
    output_token_throughput: float  # output tokens of completed requests / duration, tokens/s
    e2e_ms: Stats
    normalized_ms: Stats  # ms per output token
    ttft_ms: Stats
    tpot_ms: Stats
    itl_ms: Stats
    send_lag_ms: Stats  # how late the load generator sent against the trace schedule
    slo_ms_per_token: float | None = None
    goodput_fraction: float | None = None  # completed requests meeting the SLO / all requests
    goodput_rps: float | None = None  # requests meeting the SLO / duration
    slo_met: bool | None = None  # median normalized latency within the SLO, no errors, not truncated
    token_mismatches: int = 0  # completed requests whose output tokens differ from the trace's max_tokens
    client_cpu_us_per_response: float = math.nan
    client_cpu_share: float = math.nan  # the load generator's CPU seconds per second of the run
    batches: int | None = None  # model executions during the run (Triton statistics; baseline: batches)
    first_error: str | None = None
    # Orca-kind models, from the engine's metrics (None: not an orca model, or unreadable: see the note).
    peak_running: int | None = None  # most orca_requests_running seen, sampled every ~0.2 s
    preemptions: int | None = None  # increase of orca_preemptions_total over the run
    prompt_tokens_computed: int | None = None  # ... of orca_prompt_tokens_computed_total (cache hits are not)
    prefix_cache_hits: int | None = None  # ... of orca_prefix_cache_hits_total (tokens)
    prefix_cache_queries: int | None = None  # ... of orca_prefix_cache_queries_total (tokens)
    engine_metrics_note: str | None = None  # why some of the five above are None
    # Where each request's time went, from the server's timeline of it (return_perf_metrics): "queue"
    # (arrival in the engine to first scheduled), "prefill" (to its first token), "decode" (to its last
    # token) and "outside" (the client's end-to-end less that span: the network, Triton, the response
    # path). None: no response carried a timeline.
    latency_split_ms: dict[str, Stats] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def saturated(self) -> bool:
        """Achieved clearly less than offered: the queue grew for the whole run."""
        return math.isfinite(self.offered_rate) and self.request_throughput < 0.8 * self.offered_rate

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def summarize(run: RunResult, slo_ms_per_token: float | None = None) -> RunMetrics:
    records = run.records
    done = [r for r in records if r.ok]
    duration = run.duration_s
    tokens = sum(r.output_tokens for r in done)
    responses = sum(len(r.response_times) for r in records)
    metrics = RunMetrics(
        model=run.model,
        offered_rate=run.rate,
        num_requests=len(records),
        completed=len(done),
        errors=sum(r.error is not None for r in records),
        truncated=run.truncated,
        duration_s=duration,
        request_throughput=len(done) / duration if duration > 0 else 0.0,
        output_token_throughput=tokens / duration if duration > 0 else 0.0,
        e2e_ms=Stats.of(e2e_s(r) for r in done),
        normalized_ms=Stats.of(normalized_s(r) for r in done),
        ttft_ms=Stats.of(ttft_s(r) for r in done),
        tpot_ms=Stats.of(t for r in done if (t := tpot_s(r)) is not None),
        itl_ms=Stats.of(gap for r in done for gap in itl_s(r)),
        send_lag_ms=Stats.of(r.send_time - r.scheduled for r in records if r.send_time is not None),
        token_mismatches=sum(r.output_tokens != r.max_tokens for r in done),
        client_cpu_us_per_response=1e6 * run.client_cpu_s / responses if responses else math.nan,
        client_cpu_share=run.client_cpu_s / duration if duration > 0 else math.nan,
        first_error=next((r.error for r in records if r.error is not None), None),
    )
    metrics.latency_split_ms = latency_split(done)
    if slo_ms_per_token is not None:
        apply_slo(metrics, done, slo_ms_per_token)
    return metrics


def latency_split(done: Sequence[RequestRecord]) -> dict[str, Stats] | None:
    """RunMetrics.latency_split_ms of the completed requests whose timeline has every moment."""
    spans = []
    for r in done:
        perf = r.perf
        if perf is None:
            continue
        arrival, scheduled, first, last = (perf[name] for name in PERF_OUTPUTS[:4])
        if min(arrival, scheduled, first, last) < 0:  # a moment that never came (no token, say)
            continue
        spans.append(((scheduled - arrival) / 1e9, (first - scheduled) / 1e9, (last - first) / 1e9,
                      e2e_s(r) - (last - arrival) / 1e9))  # fmt: skip
    if not spans:
        return None
    return {part: Stats.of(s[i] for s in spans) for i, part in enumerate(("queue", "prefill", "decode", "outside"))}


def apply_slo(metrics: RunMetrics, done: Sequence[RequestRecord], slo_ms_per_token: float) -> None:
    good = sum(1000.0 * normalized_s(r) <= slo_ms_per_token for r in done)
    metrics.slo_ms_per_token = slo_ms_per_token
    metrics.goodput_fraction = good / metrics.num_requests if metrics.num_requests else 0.0
    metrics.goodput_rps = good / metrics.duration_s if metrics.duration_s > 0 else 0.0
    metrics.slo_met = (
        metrics.completed > 0 and metrics.errors == 0 and not metrics.truncated
        and metrics.normalized_ms.median <= slo_ms_per_token
    )  # fmt: skip


@dataclass
class Sustained:
    """The most a model sustains under the SLO, read off its throughput–latency curve."""

    model: str
    max_throughput: float  # req/s: the highest achieved throughput among points meeting the SLO (0: none)
    at_rate: float | None  # the offered rate of that point
    interpolated: float | None  # req/s where the curve crosses the SLO, between that point and the next
    points_met: int
    points: int
    below_grid: bool = False  # no point met the SLO: the true maximum lies below the lowest rate tried
    above_grid: bool = False  # the highest rate tried met it: the true maximum may lie above


def sustained_throughput(points: Sequence[RunMetrics], slo_ms_per_token: float) -> Sustained:
    """Max throughput with median normalized latency <= SLO (points sorted by offered rate).

    `interpolated` linearly interpolates throughput against median normalized latency between the
    last point meeting the SLO and the first one above it: a finer estimate than the grid's.
    """
    ordered = sorted(points, key=lambda m: m.offered_rate)
    met = [m for m in ordered if m.slo_met]
    model = ordered[0].model if ordered else ""
    if not met:
        return Sustained(model, 0.0, None, None, 0, len(ordered), below_grid=bool(ordered))
    best = max(met, key=lambda m: m.request_throughput)
    interpolated = None
    later = [m for m in ordered if m.offered_rate > best.offered_rate and not m.slo_met]
    if later:
        nxt = later[0]
        y0, y1 = best.normalized_ms.median, nxt.normalized_ms.median
        if math.isfinite(y1) and y1 > y0 and not nxt.truncated and nxt.errors == 0:
            frac = (slo_ms_per_token - y0) / (y1 - y0)
            x0, x1 = best.request_throughput, nxt.request_throughput
            interpolated = max(x0, x0 + frac * (x1 - x0))
    return Sustained(model, best.request_throughput, best.offered_rate, interpolated, len(met), len(ordered),
                     above_grid=ordered[-1].slo_met is True)


def hit_rate(hits: int | None, queries: int | None) -> float | None:
    """Prefix-cache hits over queries, in tokens (None: unknown or no query)."""
    if hits is None or not queries:
        return None
    return hits / queries


def ratio(numerator: float, denominator: float) -> float:
    """numerator / denominator with inf for a zero denominator (and NaN for 0/0)."""
    if denominator > 0:
        return numerator / denominator
    return math.inf if numerator > 0 else math.nan
