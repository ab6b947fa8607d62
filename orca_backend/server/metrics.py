"""Engine gauges and counters exported on Triton's metrics port (pb_utils.MetricFamily).

Each setter is an IPC round trip to the Triton process, so values are written only when they
changed, from the adapter's response thread (never from the engine loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orca_backend.messages import FinishReason

# name -> (kind, help). Counters are monotonic engine totals exported as increments.
_FAMILIES: dict[str, tuple[str, str]] = {
    "orca_requests_waiting": ("GAUGE", "Requests queued in the engine, not yet scheduled"),
    "orca_requests_running": ("GAUGE", "Requests admitted to the engine's running batch"),
    "orca_kv_used_tokens": ("GAUGE", "K/V cache token slots in the blocks admitted requests hold"),
    "orca_kv_capacity_tokens": ("GAUGE", "K/V cache token slots in total"),
    "orca_kv_blocks_used": ("GAUGE", "K/V cache blocks held by requests"),
    "orca_kv_blocks_free": ("GAUGE", "K/V cache blocks free (cached prefixes among them are evicted on demand)"),
    "orca_preemptions_total": ("COUNTER", "Requests preempted (K/V freed, recomputed later) for lack of K/V blocks"),
    "orca_prompt_tokens_computed_total": ("COUNTER", "Prompt tokens run through the model (prefix-cache hits are not)"),
    "orca_prefix_cache_queries_total": ("COUNTER", "Tokens of admitted requests looked up in the prefix cache"),
    "orca_prefix_cache_hits_total": ("COUNTER", "Tokens found in the prefix cache, and not computed"),
    "orca_prefix_cache_hit_rate": ("GAUGE", "Prefix-cache hits over queries, in tokens, since the model loaded"),
    "orca_iteration_seconds": ("GAUGE", "Wall time of the engine's latest iteration"),
    "orca_iterations_total": ("COUNTER", "Engine iterations run"),
    "orca_generated_tokens_total": ("COUNTER", "Output tokens generated"),
    "orca_requests_finished_total": ("COUNTER", "Requests finished, by finish_reason (length, stop, cancelled, "
                                     "timeout, error, invalid)"),
}
_STAT_OF = {
    "orca_requests_waiting": "num_waiting",
    "orca_requests_running": "num_running",
    "orca_kv_used_tokens": "kv_used_tokens",
    "orca_kv_capacity_tokens": "kv_capacity_tokens",
    "orca_kv_blocks_used": "kv_used_blocks",
    "orca_kv_blocks_free": "kv_free_blocks",
    "orca_preemptions_total": "num_preemptions",
    "orca_prompt_tokens_computed_total": "num_prompt_tokens_computed",
    "orca_prefix_cache_queries_total": "prefix_cache_queried_tokens",
    "orca_prefix_cache_hits_total": "prefix_cache_hit_tokens",
    "orca_prefix_cache_hit_rate": "prefix_cache_hit_rate",
    "orca_iteration_seconds": "last_iteration_seconds",
    "orca_iterations_total": "num_iterations",
    "orca_generated_tokens_total": "num_generated_tokens",
}


@dataclass
class _Exported:
    metric: Any
    counter: bool
    value: float = 0.0


class EngineMetrics:
    """The gauges of one model instance, labelled with the model name and version."""

    def __init__(self, pb_utils: Any, model_name: str, model_version: str = "1") -> None:
        self._pb_utils = pb_utils
        self._labels = {"model": model_name, "version": str(model_version)}
        self._families = {
            name: pb_utils.MetricFamily(name=name, description=text, kind=getattr(pb_utils.MetricFamily, kind))
            for name, (kind, text) in _FAMILIES.items()
        }
        self._metrics = {
            name: _Exported(self._families[name].Metric(labels=self._labels), _FAMILIES[name][0] == "COUNTER")
            for name in _STAT_OF
        }
        self._finished: dict[str, _Exported] = {}

    def update(self, stats: Any) -> None:
        """Exports an EngineStats snapshot."""
        for name, attr in _STAT_OF.items():
            self._write(self._metrics[name], float(getattr(stats, attr)))

    def zero_gauges(self) -> None:
        """After the engine stopped nothing is running or reserved any more."""
        for exported in self._metrics.values():
            if not exported.counter:
                self._write(exported, 0.0)

    def request_finished(self, finish_reason: FinishReason | None) -> None:
        reason = finish_reason.value if finish_reason is not None else "unknown"
        exported = self._finished.get(reason)
        if exported is None:
            metric = self._families["orca_requests_finished_total"].Metric(labels={**self._labels, "reason": reason})
            exported = self._finished[reason] = _Exported(metric, counter=True)
        exported.metric.increment(1.0)
        exported.value += 1.0

    @staticmethod
    def _write(exported: _Exported, value: float) -> None:
        if value == exported.value:
            return
        if exported.counter:
            if value > exported.value:  # engine totals only grow; never export a negative increment
                exported.metric.increment(value - exported.value)
                exported.value = value
        else:
            exported.metric.set(value)
            exported.value = value


class MetricsPoller:
    """Exports engine.stats() every `interval_s` from its own thread until stop().

    Every changed value is an IPC round trip to tritonserver; 5 a second is plenty for a scrape.
    """

    def __init__(self, engine: Any, metrics: EngineMetrics, interval_s: float = 0.2) -> None:
        import threading

        self._engine = engine
        self._metrics = metrics
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orca-metrics", daemon=True)

    def start(self) -> MetricsPoller:
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                if self._engine.healthy:
                    self._metrics.update(self._engine.stats())
                else:
                    self._metrics.zero_gauges()
            except Exception:  # metrics must never take serving down; the next tick retries
                continue

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
        self._metrics.zero_gauges()
