"""The server side of `orca-bench`: one tritonserver holding `orca`, its `orca_<name>` variants
(copies with other engine parameters: --orca-variants), one `baseline` copy per dynamic-batcher
max batch size, and the `echo` model; plus the few control-plane reads the benchmark needs (model
configs, execution counts, engine gauges and counters).

Why one server with several baseline copies rather than a server per batch size: every model
then runs in the same process tree, start-up is paid once, and an A/B point is two runs a few
seconds apart on the same machine state. The copies only differ in `name` and `max_batch_size`;
weights come from the same preset/checkpoint and seed. Idle copies cost memory, not CPU (their
engine threads block on an empty inbox).
"""

from __future__ import annotations

import re
import shutil
import threading
import time
import urllib.request
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orca_client import protocol

ECHO_REPOSITORY = Path(__file__).resolve().parents[2] / "benchmarks" / "echo_repository"
VARIANT_PREFIX = "orca_"  # an --orca-variants NAME is served as model orca_NAME
# Kinds served by the iteration-level engine: both stream, take unbatched requests and export the
# engine's metrics. Only plain "orca" is the reference (SLO probe, capacity, fairness, served path).
ORCA_KINDS = ("orca", "orca_variant")


@dataclass
class ServedModel:
    name: str
    kind: str  # "orca" | "orca_variant" | "baseline" | "echo"
    max_batch_size: int | None = None  # baseline: Triton's dynamic-batcher max_batch_size
    max_queue_delay_us: int | None = None  # baseline: the batcher's max_queue_delay_microseconds
    max_num_seqs: int | None = None  # orca kinds: the engine's batch limit (its `max_num_seqs` parameter)
    variant: str | None = None  # orca_variant: its --orca-variants name (the model name without "orca_")
    overrides: dict[str, str] = field(default_factory=dict)  # orca_variant: parameters that differ from orca's

    @property
    def is_orca(self) -> bool:
        return self.kind in ORCA_KINDS

    @property
    def label(self) -> str:
        if self.kind == "baseline" and self.max_batch_size is not None:
            return f"baseline (batch {self.max_batch_size})"
        if self.kind == "orca_variant":
            return f"orca ({self.variant})"
        return self.kind


def baseline_name(batch_size: int) -> str:
    return f"baseline_bs{batch_size}"


def variant_name(name: str) -> str:
    return VARIANT_PREFIX + name


def _renamed(text: str, name: str) -> str:
    """A config.pbtxt with its `name:` line rewritten (Triton refuses a name that is not the directory's)."""
    return re.sub(r'(?m)^name:\s*"[^"]*"', f'name: "{name}"', text, count=1)


def build_repository(target: Path, baseline_batch_sizes: list[int], echo: bool = True, orca: bool = True,
                     source: Path | None = None, max_queue_delay_us: int | None = None,
                     orca_variants: Mapping[str, Mapping[str, str]] | None = None) -> list[str]:
    """Writes a repository of orca + orca_<name> variants + baseline_bs<N> copies (+ echo) to
    `target`; returns model names in that order.

    A variant is orca's directory with the `name:` line and the variant's own parameters rewritten;
    settings that apply to every orca-kind model are passed to the server as per-model overrides.
    """
    from orca_backend.entrypoints.serve import default_model_repository, render_config

    source = Path(source or default_model_repository())
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    names = []
    if orca:
        shutil.copytree(source / "orca", target / "orca", ignore=shutil.ignore_patterns("__pycache__"))
        names.append("orca")
        for variant, overrides in (orca_variants or {}).items():
            name = variant_name(variant)
            shutil.copytree(source / "orca", target / name, ignore=shutil.ignore_patterns("__pycache__"))
            config = target / name / "config.pbtxt"
            config.write_text(render_config(_renamed(config.read_text(), name), dict(overrides)))
            names.append(name)
    for size in baseline_batch_sizes:
        name = baseline_name(size)
        shutil.copytree(source / "baseline", target / name, ignore=shutil.ignore_patterns("__pycache__"))
        config = target / name / "config.pbtxt"
        text = _renamed(config.read_text(), name)
        top_level = {"max_batch_size": size}
        if max_queue_delay_us is not None:
            top_level["max_queue_delay_microseconds"] = max_queue_delay_us
        config.write_text(render_config(text, {}, top_level))
        names.append(name)
    if echo:
        shutil.copytree(ECHO_REPOSITORY / "echo", target / "echo", ignore=shutil.ignore_patterns("__pycache__"))
        names.append("echo")
    return names


def _grpc_client(url: str) -> Any:
    import tritonclient.grpc as grpcclient

    return grpcclient.InferenceServerClient(url)


def fetch_model_config(url: str, name: str) -> dict[str, Any]:
    """A served model's config as Triton loaded it."""
    client = _grpc_client(url)
    try:
        return protocol.get_model_config(client, name)
    finally:
        client.close()


def served_model(name: str, config: Mapping[str, Any]) -> ServedModel:
    """Kind and batch settings of a served model, from its config: a model with Triton's batch
    dimension is a baseline, `echo` is the load generator check, `orca_<name>` an orca variant,
    anything else an orca engine."""
    if name == "echo":
        return ServedModel(name, "echo")
    if protocol.is_batched(config):
        delay = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds")
        return ServedModel(name, "baseline", protocol.triton_max_batch_size(config),
                           int(delay) if delay is not None else None)
    max_num_seqs = protocol.string_parameters(config).get("max_num_seqs")
    seqs = int(max_num_seqs) if max_num_seqs else None
    if name.startswith(VARIANT_PREFIX) and len(name) > len(VARIANT_PREFIX):
        return ServedModel(name, "orca_variant", max_num_seqs=seqs, variant=name[len(VARIANT_PREFIX):])
    return ServedModel(name, "orca", max_num_seqs=seqs)


# Per model by construction, not what a variant tests.
_OWN_PARAMETERS = ("iteration_log",)


def parameter_differences(variant: Mapping[str, str], orca: Mapping[str, str]) -> dict[str, str]:
    """The string parameters where a variant's served config differs from orca's (what it tests)."""
    return {key: value for key, value in variant.items() if orca.get(key) != value and key not in _OWN_PARAMETERS}


def describe_variants(url: str, models: Iterable[ServedModel]) -> None:
    """Fills each variant's `overrides` from the served configs: what the server really runs, which
    with --url need not be what our flags asked. Descriptive only: unreadable configs leave it empty."""
    variants = [m for m in models if m.kind == "orca_variant"]
    if not variants:
        return
    try:
        orca = protocol.string_parameters(fetch_model_config(url, "orca"))
        for m in variants:
            m.overrides = parameter_differences(protocol.string_parameters(fetch_model_config(url, m.name)), orca)
    except Exception:
        return


def describe_model(url: str, name: str) -> ServedModel:
    """served_model() of a model on the server at `url`."""
    return served_model(name, fetch_model_config(url, name))


def inference_counts(url: str, name: str) -> tuple[int, int] | None:
    """Triton's (inference_count, execution_count) for a model: requests it answered, and for the
    baseline the number of batches it ran (None: statistics unreadable)."""
    client = _grpc_client(url)
    try:
        stats = client.get_inference_statistics(name, as_json=True)
        model_stats = stats.get("model_stats", [])
        if not model_stats:
            return None
        return int(model_stats[0].get("inference_count", 0)), int(model_stats[0].get("execution_count", 0))
    except Exception:
        return None
    finally:
        client.close()


def batches_since(url: str, name: str, before: tuple[int, int], requests: int, timeout_s: float = 5.0) -> int | None:
    """Batches the model ran since `before`, once its statistics count all `requests` answered.

    Triton records a batch's statistics after execute() returns, so a client that already has every
    response can read the counts before the last batch is in them."""
    deadline = time.monotonic() + timeout_s
    while True:
        after = inference_counts(url, name)
        if after is None:
            return None
        if after[0] - before[0] >= requests or time.monotonic() > deadline:
            return after[1] - before[1]
        time.sleep(0.02)


_SAMPLE_RE = re.compile(r'^(orca_[A-Za-z0-9_]+)\{([^}]*)\}\s+(\S+)', re.M)
_MODEL_LABEL_RE = re.compile(r'(?:^|,)\s*model="([^"]*)"')
BUSY_GAUGES = ("orca_requests_waiting", "orca_requests_running", "orca_kv_used_tokens")


def scrape(metrics_url: str) -> str:
    """The metrics endpoint's Prometheus text (raises OSError when unreadable)."""
    with urllib.request.urlopen(metrics_url, timeout=2) as response:
        return response.read().decode()


def engine_samples(text: str, metrics: Iterable[str], models: Iterable[str]) -> dict[str, dict[str, float]]:
    """model -> metric -> value of the engine's `orca_*` series in a scrape, summed over the other
    labels (version, reason). A metric a model does not export is absent from its dict."""
    wanted, names = set(metrics), set(models)
    out: dict[str, dict[str, float]] = {}
    for metric, labels, value in _SAMPLE_RE.findall(text):
        model = _MODEL_LABEL_RE.search(labels)
        if metric in wanted and model and model.group(1) in names:
            per_model = out.setdefault(model.group(1), {})
            per_model[metric] = per_model.get(metric, 0.0) + float(value)
    return out


def read_engine_metrics(metrics_url: str, metrics: Iterable[str], models: Iterable[str]) -> dict[str, dict[str, float]] | None:
    """engine_samples() of a fresh scrape (None: the endpoint is unreadable)."""
    try:
        text = scrape(metrics_url)
    except (OSError, ValueError):
        return None
    return engine_samples(text, metrics, models)


Reader = Any  # (metrics_url, metrics, models) -> read_engine_metrics()'s result


def engine_busy(metrics_url: str, models: list[str], read: Reader | None = None) -> dict[str, float] | None:
    """Sum of waiting + running requests and used K/V per model, from the engine gauges (None: unreadable)."""
    samples = (read or read_engine_metrics)(metrics_url, BUSY_GAUGES, models)
    if samples is None:
        return None
    return {model: sum(values.values()) for model, values in samples.items()}


def wait_idle(metrics_url: str | None, models: list[str], timeout_s: float = 60.0, read: Reader | None = None,
              interval_s: float = 0.25) -> bool:  # fmt: skip
    """Waits until no engine holds requests or K/V (after a cancelled run); True when idle or unreadable."""
    if not metrics_url:
        return True
    deadline = time.monotonic() + timeout_s
    while True:
        busy = engine_busy(metrics_url, models, read)
        if busy is None or not any(busy.values()):
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


# ------------------------------------------------------------------ engine metrics over one run
RUNNING_GAUGE = "orca_requests_running"
# RunMetrics field -> the engine counter whose increase over a run it records.
ENGINE_COUNTERS = {
    "preemptions": "orca_preemptions_total",
    "prompt_tokens_computed": "orca_prompt_tokens_computed_total",
    "prefix_cache_hits": "orca_prefix_cache_hits_total",
    "prefix_cache_queries": "orca_prefix_cache_queries_total",
}
# The engine exports its stats every 0.2 s (orca_backend/server/metrics.py, MetricsPoller): a run's
# last increments reach the metrics port up to about one period after its last response.
ENGINE_EXPORT_PERIOD_S = 0.2


@dataclass
class EngineRunStats:
    """What the engine's metrics say about one run (None: not available, `note` says why)."""

    peak_running: int | None = None
    counters: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(ENGINE_COUNTERS))
    note: str | None = None


class EngineWatch:
    """Peak `orca_requests_running` and the counters' increase over one run of an orca-kind model.

    start() reads the counters and starts a thread that scrapes the gauge every `period_s`; stop()
    ends it, lets the engine's exporter catch up, and reads the counters again. Nothing here may
    fail a run: any read error leaves the affected values None and says why in `note`. The
    sampled peak can miss a spike shorter than the period (the engine exports at 0.2 s too).
    The thread's CPU counts in the load generator's client_cpu_s: a scrape every 0.2 s is small.
    """

    def __init__(self, metrics_url: str | None, model: str, period_s: float = 0.2,
                 settle_s: float = ENGINE_EXPORT_PERIOD_S + 0.1, read: Reader | None = None) -> None:
        self.metrics_url = metrics_url
        self.model = model
        self.period_s = period_s
        self.settle_s = settle_s
        self._read = read or read_engine_metrics  # looked up now: tests replace the module's reader
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._peak: float | None = None
        self._peak_error: str | None = None
        self._before: dict[str, float] | str = "not started"

    def start(self) -> EngineWatch:
        if not self.metrics_url:
            return self
        self._before = self._counters()
        self._thread = threading.Thread(target=self._poll, name=f"engine-watch-{self.model}", daemon=True)
        self._thread.start()
        return self

    def cancel(self) -> None:
        """Ends the thread without reading anything (the run itself failed)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def stop(self) -> EngineRunStats:
        if not self.metrics_url:
            return EngineRunStats(note="no metrics endpoint (with --url, pass --metrics-url)")
        self.cancel()
        notes = []
        peak = None
        if self._peak_error is not None:
            notes.append(f"peak running not recorded: {self._peak_error}")
        elif self._peak is None:
            notes.append("peak running not recorded: no sample")
        else:
            peak = round(self._peak)
        # Completed requests were all prefilled (and any preemption happened) before the last
        # response; the exporter publishes that within one period, and the model is idle after it.
        time.sleep(self.settle_s)
        idle = self._wait_idle(timeout_s=5.0)
        counters, note = _deltas(self._before, self._counters())
        if note:
            notes.append(note)
        if not idle:
            notes.append("the engine still held requests 5 s after the run: counters may miss their last work")
        return EngineRunStats(peak, counters, "; ".join(notes) or None)

    def _wait_idle(self, timeout_s: float) -> bool:
        """wait_idle() for this model through our reader, whose errors read as unreadable (idle)."""

        def read(url: str, metrics: Iterable[str], models: Iterable[str]) -> dict[str, dict[str, float]] | None:
            try:
                return self._read(url, metrics, models)
            except Exception:
                return None

        return wait_idle(self.metrics_url, [self.model], timeout_s, read=read, interval_s=0.1)

    def _poll(self) -> None:
        while not self._stop.is_set():
            try:
                samples = self._read(self.metrics_url, [RUNNING_GAUGE], [self.model])
            except Exception as exc:  # a watcher must never take the run down
                samples, reason = None, f"{type(exc).__name__}: {exc}"
            else:
                reason = "metrics endpoint unreadable"
            if samples is None:
                self._peak_error = reason
                return
            value = samples.get(self.model, {}).get(RUNNING_GAUGE)
            if value is None:
                self._peak_error = f"{self.model} exports no {RUNNING_GAUGE}"
                return
            self._peak = value if self._peak is None else max(self._peak, value)
            self._stop.wait(self.period_s)

    def _counters(self) -> dict[str, float] | str:
        """The model's counter values, or why they are unreadable."""
        try:
            samples = self._read(self.metrics_url, list(ENGINE_COUNTERS.values()), [self.model])
        except Exception as exc:
            return f"{type(exc).__name__}: {exc}"
        if samples is None:
            return "metrics endpoint unreadable"
        return samples.get(self.model, {})


def _deltas(before: dict[str, float] | str, after: dict[str, float] | str) -> tuple[dict[str, int | None], str | None]:
    """Per RunMetrics field, after - before of its counter; and a note for the ones left None."""
    counters: dict[str, int | None] = dict.fromkeys(ENGINE_COUNTERS)
    if isinstance(before, str) or isinstance(after, str):
        return counters, f"counters not recorded: {before if isinstance(before, str) else after}"
    missing, backwards = [], []
    for key, metric in ENGINE_COUNTERS.items():
        if metric not in before or metric not in after:
            missing.append(metric)
        elif after[metric] < before[metric]:
            backwards.append(metric)  # the model reloaded during the run: its totals restarted
        else:
            counters[key] = round(after[metric] - before[metric])
    notes = []
    if missing:
        notes.append("not exported: " + ", ".join(missing))
    if backwards:
        notes.append("went backwards (model reloaded?): " + ", ".join(backwards))
    return counters, "; ".join(notes) or None
