"""What a served model exports on Triton's metrics port (pb_utils.MetricFamily), labelled with the
model name and version so that `orca` and `baseline` sit side by side:

- the engine's gauges and counters (`orca_*`), from EngineStats snapshots;
- per-request latency histograms and counters with the names, labels and buckets of Triton's vLLM
  backend (`vllm:*`, its src/utils/metrics.py), so dashboards built for it work unchanged, plus what
  it lacks: success by finish reason for every reason, and preemptions per request.

Every setter or observation is an IPC round trip to the Triton process. A finished request's
observations (~15 of them) are exported by the thread that answers it, before its final response
(`request_finished`), as vLLM's stat loggers record a request before its output goes out: a client
that reads /metrics after its last response sees its request counted. The engine's stats are
exported by the metrics thread (`MetricsPoller`, every 0.2 s), the values that changed only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from orca_backend.messages import FinishReason, RequestMetrics

# name -> (kind, help). Counters are monotonic engine totals exported as increments.
_FAMILIES: dict[str, tuple[str, str]] = {
    "orca_requests_waiting": ("GAUGE", "Requests queued in the engine, not yet scheduled"),
    "orca_requests_running": ("GAUGE", "Requests admitted to the engine's running batch"),
    "orca_kv_used_tokens": ("GAUGE", "K/V cache token slots in the blocks admitted requests hold"),
    "orca_kv_capacity_tokens": ("GAUGE", "K/V cache token slots in total"),
    "orca_kv_blocks_used": ("GAUGE", "K/V cache blocks held by requests"),
    "orca_kv_blocks_free": ("GAUGE", "K/V cache blocks free (cached prefixes among them are evicted on demand)"),
    "orca_preemptions_total": ("COUNTER", "Requests preempted (K/V swapped to the host tier, or freed and recomputed "
                               "later) for lack of K/V blocks"),
    "orca_prompt_tokens_computed_total": ("COUNTER", "Prompt tokens run through the model (prefix-cache hits are not)"),
    "orca_prefix_cache_queries_total": ("COUNTER", "Tokens of admitted requests looked up in the prefix cache"),
    "orca_prefix_cache_hits_total": ("COUNTER", "Tokens found in the prefix cache, and not computed"),
    "orca_prefix_cache_hit_rate": ("GAUGE", "Prefix-cache hits over queries, in tokens, since the model loaded"),
    "orca_iteration_seconds": ("GAUGE", "Wall time of the engine's latest iteration"),
    "orca_iterations_total": ("COUNTER", "Engine iterations run"),
    "orca_generated_tokens_total": ("COUNTER", "Output tokens generated"),
    "orca_requests_finished_total": ("COUNTER", "Requests finished, by finish_reason (length, stop, cancelled, "
                                     "timeout, error, invalid)"),
    "orca_model_steps_total": ("COUNTER", "Engine iterations by how the forward ran: path cuda_graph (replayed), "
                               "or the reason it ran eagerly (no_cuda_device, enforce_eager, tokens_above_buckets, ...)"),
    # The vLLM backend's names for some of the same stats.
    "vllm:num_requests_running": ("GAUGE", "Number of requests currently running."),
    "vllm:num_requests_waiting": ("GAUGE", "Number of requests waiting to be processed."),
    "vllm:gpu_cache_usage_perc": ("GAUGE", "KV-cache usage (on any device). 1 means 100 percent usage."),
    "vllm:num_preemptions_total": ("COUNTER", "Number of preemptions."),
    "orca_kv_host_blocks": ("GAUGE", "K/V blocks of the host tier (swap_space)"),
    "orca_kv_host_blocks_used": ("GAUGE", "Host-tier K/V blocks holding a swapped request's or a cached prefix's K/V"),
    "orca_kv_swapped_out_blocks_total": ("COUNTER", "K/V blocks copied to the host tier by preemptions"),
    "orca_kv_swapped_in_blocks_total": ("COUNTER", "K/V blocks copied back from the host tier as swapped requests resume"),
    "orca_prefix_cache_host_hit_blocks_total": ("COUNTER", "Prefix-cache blocks found on the host tier and copied back"),
    "orca_lora_loads_total": ("COUNTER", "LoRA adapters loaded into a slot (a resident one evicted, least recently "
                              "used, when every slot was taken)"),
    # vLLM's speculative-decoding counters (exported with speculative_config only).
    "vllm:spec_decode_num_drafts_total": ("COUNTER", "Number of spec decoding drafts."),
    "vllm:spec_decode_num_draft_tokens_total": ("COUNTER", "Number of draft tokens."),
    "vllm:spec_decode_num_accepted_tokens_total": ("COUNTER", "Number of accepted tokens."),
    "vllm:spec_decode_num_accepted_tokens_per_pos_total": ("COUNTER", "Accepted tokens per draft position."),
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
    "vllm:num_requests_running": "num_running",
    "vllm:num_requests_waiting": "num_waiting",
    "vllm:gpu_cache_usage_perc": "kv_usage",
    "vllm:num_preemptions_total": "num_preemptions",
}
_LORA_STATS = {"orca_lora_loads_total": "lora_loads"}  # exported with enable_lora only
_HOST_STATS = {  # exported with swap_space only
    "orca_kv_host_blocks": "kv_host_num_blocks",
    "orca_kv_host_blocks_used": "kv_host_used_blocks",
    "orca_kv_swapped_out_blocks_total": "kv_swapped_out_blocks",
    "orca_kv_swapped_in_blocks_total": "kv_swapped_in_blocks",
    "orca_prefix_cache_host_hit_blocks_total": "kv_host_hit_blocks",
}
_SPEC_STATS = {  # exported with speculative_config only
    "vllm:spec_decode_num_drafts_total": "spec_num_drafts",
    "vllm:spec_decode_num_draft_tokens_total": "spec_num_draft_tokens",
    "vllm:spec_decode_num_accepted_tokens_total": "spec_num_accepted_tokens",
}
SPEC_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"  # a series per position, labelled "position"
LORA_INFO = "vllm:lora_requests_info"  # vLLM's: the running and waiting adapters as labels, the time as value
LORA_INFO_HELP = "Running stats on lora requests."
# vLLM's: the K/V cache's configuration as labels (value 1). Autoscalers and routers read the pool's
# size from it (num_gpu_blocks x block_size tokens), so it is there from the engine's start.
CACHE_CONFIG_INFO = "vllm:cache_config_info"
CACHE_CONFIG_INFO_HELP = "Information of the LLMEngine CacheConfig"


def cache_config_labels(config: Any, host_blocks: int = 0) -> dict[str, str]:
    """The K/V pool's configuration as vLLM labels it (Python's str of each value). `num_gpu_blocks`
    keeps vLLM's name whatever the device: the pool's blocks, per layer; `num_cpu_blocks` the host
    tier's (`host_blocks`, swap_space; None without one); `cache_dtype` is kv_cache_dtype (auto: the
    model's dtype)."""
    return {
        "block_size": str(int(config.block_size)),
        "num_gpu_blocks": str(int(config.kv_capacity_tokens) // int(config.block_size)),
        "num_cpu_blocks": str(host_blocks or None),
        "cache_dtype": str(config.kv_cache_dtype),
        "enable_prefix_caching": str(bool(config.enable_prefix_caching)),
        "gpu_memory_utilization": str(float(config.gpu_memory_utilization)),
        "kv_cache_memory_bytes": str(int(config.kv_cache_memory_bytes) or None),
    }


# The vLLM backend's buckets (they are vLLM's own).
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0]
TPOT_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]  # fmt: skip
PREEMPTION_BUCKETS = [0, 1, 2, 5, 10, 20, 50]


def one_two_five_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's token-count buckets)."""
    buckets, scale = [], 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > limit:
                return buckets
            buckets.append(float(mantissa * scale))
        scale *= 10


# name -> (help, buckets or None for the context-length token buckets). Observed once per request.
_HISTOGRAMS: dict[str, tuple[str, list[float] | None]] = {
    "vllm:time_to_first_token_seconds": ("Histogram of time to first token in seconds.", TTFT_BUCKETS),
    "vllm:time_per_output_token_seconds": ("Histogram of time per output token in seconds (each request's mean "
                                           "between its first and last token).", TPOT_BUCKETS),
    "vllm:e2e_request_latency_seconds": ("Histogram of end to end request latency in seconds.", REQUEST_LATENCY_BUCKETS),
    "vllm:request_queue_time_seconds": ("Histogram of time spent in WAITING phase for request (arrival to first "
                                        "scheduled).", REQUEST_LATENCY_BUCKETS),
    "vllm:request_inference_time_seconds": ("Histogram of time spent in RUNNING phase for request.",
                                            REQUEST_LATENCY_BUCKETS),
    "vllm:request_prefill_time_seconds": ("Histogram of time spent in PREFILL phase for request.",
                                          REQUEST_LATENCY_BUCKETS),
    "vllm:request_decode_time_seconds": ("Histogram of time spent in DECODE phase for request.",
                                         REQUEST_LATENCY_BUCKETS),
    "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", None),
    "vllm:request_generation_tokens": ("Number of generation tokens processed.", None),
    "vllm:request_params_n": ("Histogram of the n request parameter.", [1, 2, 5, 10, 20]),
    "orca_request_preemptions": ("Histogram of the times each request was preempted.", PREEMPTION_BUCKETS),
}
_REQUEST_COUNTERS = {
    "vllm:prompt_tokens_total": "Number of prefill tokens processed (counted as each request ends).",
    "vllm:generation_tokens_total": "Number of generation tokens processed (counted as each request ends).",
    "vllm:request_success_total": "Requests finished, by finished_reason (stop, length, abort, timeout, error, "
                                  "invalid).",
}
# The contract's names for finish reasons (a cancel is vLLM's "abort").
_REASON_LABEL = {FinishReason.CANCELLED: "abort"}


@dataclass
class _Exported:
    metric: Any
    counter: bool
    value: float = 0.0


@dataclass(frozen=True)
class FinishedRequest:
    """What a request's end adds to the histograms and counters."""

    finish_reason: FinishReason | None
    metrics: RequestMetrics | None
    num_input_tokens: int
    num_output_tokens: int
    lora_name: str | None = None  # its LoRA adapter (None: the base model)
    n: int = 1  # its samples (the n sampling parameter); num_output_tokens counts every sample's


class EngineMetrics:
    """The gauges of one model instance, labelled with the model name and version."""

    def __init__(
        self, pb_utils: Any, model_name: str, model_version: str = "1", max_context: int = 2048, lora: bool = False,
        engine_stats: bool = True, cache_config: dict[str, str] | None = None, speculative: bool = False,
        host_tier: bool = False,
    ) -> None:  # fmt: skip
        """`lora` (enable_lora): the per-request series carry a `lora_name` label too ("" for the base
        model), and the adapters' gauges are exported. Without `engine_stats` (a model instance that
        attached to another's engine core) only the requests' ends are: the core's owner exports its
        stats, and `cache_config` (cache_config_labels) as vLLM's cache_config_info. `speculative`
        (speculative_config): vLLM's spec_decode counters are exported too; `host_tier` (swap_space):
        the host tier's."""
        self._pb_utils = pb_utils
        self._labels = {"model": model_name, "version": str(model_version)}
        self._lora = lora
        kinds = pb_utils.MetricFamily
        families = {name: (kind, text) for name, (kind, text) in _FAMILIES.items()}
        families |= {name: ("HISTOGRAM", text) for name, (text, _) in _HISTOGRAMS.items()}
        families |= {name: ("COUNTER", text) for name, text in _REQUEST_COUNTERS.items()}
        self._families = {
            name: pb_utils.MetricFamily(name=name, description=text, kind=getattr(kinds, kind))
            for name, (kind, text) in families.items()
        }
        self._engine_stats = engine_stats
        self._stats = {**_STAT_OF, **(_LORA_STATS if lora else {}), **(_SPEC_STATS if speculative else {}),
                       **(_HOST_STATS if host_tier else {})} if engine_stats else {}  # fmt: skip
        self._metrics = {
            name: _Exported(self._families[name].Metric(labels=self._labels), families[name][0] == "COUNTER")
            for name in self._stats
        }
        self._token_buckets = one_two_five_buckets(max_context)
        # The per-request series, by the labels a request's end adds (its adapter with enable_lora):
        # histograms, token counters, and the counters by finish reason.
        self._per_request: dict[tuple[tuple[str, str], ...], dict[str, Any]] = {}
        self._finished: dict[tuple[tuple[tuple[str, str], ...], str], _Exported] = {}
        self._success: dict[tuple[tuple[tuple[str, str], ...], str], Any] = {}
        base = (("lora_name", ""),) if lora else ()  # the base model's series exist from the start
        self._per_request[base] = self._request_series({**self._labels, **dict(base)})
        # vLLM's lora_requests_info: its own family, made anew with each change (_export_lora_info).
        self._lora_info: tuple[Any, Any] | None = None  # (family, its one metric)
        self._lora_info_labels: tuple[str, str, int] | None = None
        self._steps_by_path: dict[str, _Exported] = {}  # orca_model_steps_total, a series per path seen
        self._accepted_per_pos: list[_Exported] = []  # SPEC_PER_POS, a series per position
        self._cache_config_info: tuple[Any, Any] | None = None  # (family, its one metric)
        if engine_stats and cache_config is not None:
            family = pb_utils.MetricFamily(name=CACHE_CONFIG_INFO, description=CACHE_CONFIG_INFO_HELP,
                                           kind=kinds.GAUGE)  # fmt: skip
            metric = family.Metric(labels={**self._labels, **cache_config})
            metric.set(1.0)
            self._cache_config_info = (family, metric)

    def update(self, stats: Any) -> None:
        """Exports an EngineStats snapshot."""
        if not self._engine_stats:
            return
        for name, attr in self._stats.items():
            self._write(self._metrics[name], float(getattr(stats, attr)))
        for path, count in stats.steps_by_path.items():
            exported = self._steps_by_path.get(path)
            if exported is None:
                metric = self._families["orca_model_steps_total"].Metric(labels={**self._labels, "path": path})
                exported = self._steps_by_path[path] = _Exported(metric, counter=True)
            self._write(exported, float(count))
        for position, count in enumerate(stats.spec_accepted_per_pos):
            if position == len(self._accepted_per_pos):
                metric = self._families[SPEC_PER_POS].Metric(labels={**self._labels, "position": str(position)})
                self._accepted_per_pos.append(_Exported(metric, counter=True))
            self._write(self._accepted_per_pos[position], float(count))
        if self._lora:
            self._export_lora_info(stats)

    def _export_lora_info(self, stats: Any) -> None:
        """vLLM's lora_requests_info: one series, labelled with the current (running, waiting, max) and
        set to the time it became current. A series per combination ever seen would grow /metrics
        without bound, but the Python backend removes a Metric only with its MetricFamily (the family
        holds every Metric it made: python_backend's src/metric_family.cc): so each change makes a new
        family with the new series, then drops the old family, and its series with it. Triton merges
        families of one name (as `orca` and `baseline` share theirs), so the name never lacks a series."""
        labels = (stats.running_lora_adapters, stats.waiting_lora_adapters, stats.max_loras)
        if not stats.max_loras or labels == self._lora_info_labels:  # no stats from the engine yet
            return
        self._lora_info_labels = labels
        family = self._pb_utils.MetricFamily(name=LORA_INFO, description=LORA_INFO_HELP,
                                             kind=self._pb_utils.MetricFamily.GAUGE)  # fmt: skip
        metric = family.Metric(labels={**self._labels, "running_lora_adapters": labels[0],
                                       "waiting_lora_adapters": labels[1], "max_lora": str(labels[2])})  # fmt: skip
        metric.set(time.time())
        self._lora_info = (family, metric)  # the old family goes, and its series

    def zero_gauges(self) -> None:
        """After the engine stopped nothing is running or reserved any more."""
        for exported in self._metrics.values():
            if not exported.counter:
                self._write(exported, 0.0)

    def request_finished(self, finished: FinishedRequest) -> None:
        """Exports a request's end now (its counters and histogram observations): the caller sends the
        request's final response after it. One thread per model instance calls it (the response
        thread, or the baseline's execute())."""
        self._export(finished)

    def _export(self, finished: FinishedRequest) -> None:
        extra = (("lora_name", finished.lora_name or ""),) if self._lora else ()
        labels = {**self._labels, **dict(extra)}
        reason = finished.finish_reason.value if finished.finish_reason is not None else "unknown"
        exported = self._finished.get((extra, reason))
        if exported is None:
            metric = self._families["orca_requests_finished_total"].Metric(labels={**labels, "reason": reason})
            exported = self._finished[(extra, reason)] = _Exported(metric, counter=True)
        exported.metric.increment(1.0)
        exported.value += 1.0
        label = _REASON_LABEL.get(finished.finish_reason, reason)
        success = self._success.get((extra, label))
        if success is None:
            success = self._success[(extra, label)] = self._families["vllm:request_success_total"].Metric(
                labels={**labels, "finished_reason": label})  # fmt: skip
        success.increment(1.0)
        series = self._per_request.get(extra)
        if series is None:
            series = self._per_request[extra] = self._request_series(labels)
        for name, count in (("vllm:prompt_tokens_total", finished.num_input_tokens),
                            ("vllm:generation_tokens_total", finished.num_output_tokens)):  # fmt: skip
            if count:
                series[name].increment(float(count))
        for name, value in observations(finished).items():
            series[name].observe(value)

    def _request_series(self, labels: dict[str, str]) -> dict[str, Any]:
        """The histograms and token counters of the requests with these labels."""
        series = {name: self._families[name].Metric(labels=labels, buckets=buckets or self._token_buckets)
                  for name, (_, buckets) in _HISTOGRAMS.items()}  # fmt: skip
        for name in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            series[name] = self._families[name].Metric(labels=labels)
        return series

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


def observations(finished: FinishedRequest) -> dict[str, float]:
    """The histogram observations of one request's end: a duration only where both of its ends are
    known (no TTFT without a token, no queue time for a request never scheduled, no time per
    output token for fewer than two)."""
    values: dict[str, float] = {
        "vllm:request_prompt_tokens": finished.num_input_tokens,
        "vllm:request_generation_tokens": finished.num_output_tokens,
        "vllm:request_params_n": finished.n,
    }
    m = finished.metrics
    if m is None:
        return values
    values["orca_request_preemptions"] = m.num_preemptions
    end = m.last_token_time
    if end is not None:
        values["vllm:e2e_request_latency_seconds"] = end - m.arrival_time
    if m.first_token_time is not None:
        values["vllm:time_to_first_token_seconds"] = m.first_token_time - m.arrival_time
        if end is not None and finished.num_output_tokens > 1:
            values["vllm:time_per_output_token_seconds"] = (end - m.first_token_time) / (finished.num_output_tokens - 1)
            values["vllm:request_decode_time_seconds"] = end - m.first_token_time
    if m.first_scheduled_time is not None:
        values["vllm:request_queue_time_seconds"] = m.first_scheduled_time - m.arrival_time
        if m.first_token_time is not None:
            values["vllm:request_prefill_time_seconds"] = m.first_token_time - m.first_scheduled_time
        if end is not None:
            values["vllm:request_inference_time_seconds"] = end - m.first_scheduled_time
    return values


class NoMetrics:
    """A model whose metrics are off (REPORT_CUSTOM_METRICS false, or model.json's disable_log_stats)."""

    def request_finished(self, finished: FinishedRequest) -> None:
        pass


class MetricsPoller:
    """Exports engine.stats() every `interval_s` from its own thread until stop(): every changed value
    is an IPC round trip to tritonserver, and 5 exports a second are plenty for a scrape."""

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
            self._thread.join(timeout=2 * self._interval_s + 1.0)
        if not self._thread.is_alive():  # never two threads writing the gauges at once
            self._metrics.zero_gauges()
