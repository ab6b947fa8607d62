"""EngineMetrics and MetricsPoller (server/metrics.py) against a stand-in `triton_python_backend_utils`
that keeps what tritonserver would export: the live series, by name and labels.

The stand-in follows Triton's lifetimes (python_backend src/metric_family.cc and src/metric.cc,
core src/metric_family.cc): a MetricFamily holds every Metric it made, so a series goes only when
its family is deleted; families of one name share their series by labels (prometheus-cpp merges
them), each series removed when the last Metric on it goes. It refuses what Triton refuses: buckets
on a gauge or counter, none on a histogram, a negative counter increment, an operation the kind lacks.
The served exports (names, labels, the dashboard's series) are checked on a real server in
test_serving.py and test_serving_lora.py; the vLLM-contract values of `observations` in
test_vllm_contract.py.
"""

from __future__ import annotations

import threading
import types
from dataclasses import dataclass, field
from typing import Any

import pytest

from orca_backend.config import EngineConfig
from orca_backend.messages import EngineStats, FinishReason, RequestMetrics
from orca_backend.server.metrics import (
    CACHE_CONFIG_INFO,
    LORA_INFO,
    EngineMetrics,
    FinishedRequest,
    MetricsPoller,
    cache_config_labels,
)


@dataclass
class Series:
    kind: str
    buckets: list[float] | None
    value: float = 0.0
    observed: list[float] = field(default_factory=list)
    metrics: int = 0  # Metric objects on it, over every family of its name


def fake_pb_utils() -> types.ModuleType:
    """A stand-in pb_utils whose `series` are what /metrics would show."""
    series: dict[tuple[str, frozenset], Series] = {}

    class Metric:
        def __init__(self, on: Series) -> None:
            self._on = on

        def set(self, value: float) -> None:
            assert self._on.kind == "gauge", f"set() on a {self._on.kind}"
            self._on.value = value

        def increment(self, value: float) -> None:
            assert self._on.kind in ("gauge", "counter"), f"increment() on a {self._on.kind}"
            assert self._on.kind != "counter" or value >= 0, "Triton refuses a negative counter increment"
            self._on.value += value

        def observe(self, value: float) -> None:
            assert self._on.kind == "histogram", f"observe() on a {self._on.kind}"
            self._on.observed.append(value)

    class MetricFamily:
        GAUGE, COUNTER, HISTOGRAM = "gauge", "counter", "histogram"

        def __init__(self, name: str, description: str, kind: str) -> None:
            self.name, self.kind = name, kind
            self._made: list[tuple[str, frozenset]] = []  # the python backend's metric_map_

        def Metric(self, labels: dict[str, str], buckets: list[float] | None = None) -> Metric:  # noqa: N802
            assert (buckets is not None) == (self.kind == "histogram"), "Triton wants buckets on histograms only"
            key = (self.name, frozenset(labels.items()))
            on = series.setdefault(key, Series(self.kind, buckets))
            on.metrics += 1
            self._made.append(key)
            return Metric(on)

        def __del__(self) -> None:  # the family clears every Metric it made
            for key in self._made:
                series[key].metrics -= 1
                if not series[key].metrics:
                    del series[key]

    pb = types.ModuleType("triton_python_backend_utils")
    pb.MetricFamily = MetricFamily
    pb.series = series
    return pb


def live(pb: types.ModuleType, name: str, **labels: str) -> list[tuple[dict[str, str], Series]]:
    """The live series of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return [(dict(key), s) for (n, key), s in pb.series.items() if n == name and wanted <= key]


def value(pb: types.ModuleType, name: str, **labels: str) -> float:
    (_, series), = live(pb, name, **labels)
    return series.value


def stats(**fields: Any) -> EngineStats:
    return EngineStats(**({"num_waiting": 0, "num_running": 0, "kv_used_tokens": 0, "kv_capacity_tokens": 0,
                           "num_iterations": 0, "num_generated_tokens": 0, "last_iteration_seconds": 0.0,
                           "max_batches_in_flight": 1} | fields))  # fmt: skip


def finished(reason: FinishReason | None, lora_name: str | None = None, output_tokens: int = 4) -> FinishedRequest:
    timeline = RequestMetrics(arrival_time=10.0, first_scheduled_time=10.5, num_preemptions=2, num_cached_tokens=0,
                              first_token_time=11.0, last_token_time=13.0)  # fmt: skip
    return FinishedRequest(reason, timeline, num_input_tokens=7, num_output_tokens=output_tokens, lora_name=lora_name)


# --- vLLM's cache_config_info ----------------------------------------------------------------------


def test_cache_config_info_says_the_pool_from_the_start_on_the_cores_owner_only():
    """One series, value 1, the pool's configuration as labels (what autoscalers read the K/V size
    from: num_gpu_blocks x block_size), exported before any stats arrive; an instance attached to
    another's core leaves it to the owner, so the model has it once."""
    config = EngineConfig(kv_capacity_tokens=1000, block_size=16, enable_prefix_caching=True)
    pb = fake_pb_utils()
    owner = EngineMetrics(pb, "orca", cache_config=cache_config_labels(config))
    EngineMetrics(pb, "orca", engine_stats=False, cache_config=cache_config_labels(config))
    (labels, series), = live(pb, CACHE_CONFIG_INFO)
    assert series.kind == "gauge" and series.value == 1.0
    assert labels == {"model": "orca", "version": "1", "block_size": "16", "num_gpu_blocks": "62",
                      "num_cpu_blocks": "None", "cache_dtype": "auto", "enable_prefix_caching": "True",
                      "gpu_memory_utilization": "0.0", "kv_cache_memory_bytes": "None"}  # fmt: skip
    owner.update(stats(kv_capacity_tokens=992))
    assert live(pb, CACHE_CONFIG_INFO) == [(labels, series)]


def test_cache_config_info_of_a_pool_sized_in_bytes():
    """kv_cache_memory_bytes sizes the pool: the blocks are what those bytes hold (with_kv_capacity)."""
    model = EngineConfig(model="gpt2-tiny").model_config()
    per_token = 2 * 4 * model.num_layers * model.num_kv_heads * model.head_dim
    config = EngineConfig(model="gpt2-tiny", kv_cache_memory_bytes=100 * 16 * per_token + 5).with_kv_capacity(model)
    labels = cache_config_labels(config)
    assert labels["num_gpu_blocks"] == "100" and labels["kv_cache_memory_bytes"] == str(100 * 16 * per_token + 5)


# --- vLLM's lora_requests_info ----------------------------------------------------------------------


def test_lora_requests_info_keeps_only_the_current_series():
    """Eight adapters' traffic passes through many (running, waiting) combinations: one series is
    live, the current one, however many came before (each would otherwise stay on /metrics)."""
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca", lora=True)
    metrics.update(stats())  # no stats from the engine yet (max_loras 0): nothing exported
    assert live(pb, LORA_INFO) == []
    names = [f"a{i}" for i in range(8)]
    for step in range(40):
        running, waiting = ",".join(names[: step % 5 + 1]), ",".join(names[5 : 5 + step % 3])
        metrics.update(stats(max_loras=4, running_lora_adapters=running, waiting_lora_adapters=waiting))
        (labels, series), = live(pb, LORA_INFO)
        assert labels == {"model": "orca", "version": "1", "running_lora_adapters": running,
                          "waiting_lora_adapters": waiting, "max_lora": "4"}  # fmt: skip
        assert series.value > 1e9  # the time it became current (vLLM's set_to_current_time)
    became_current = series.value
    metrics.update(stats(max_loras=4, running_lora_adapters=running, waiting_lora_adapters=waiting))
    assert live(pb, LORA_INFO) == [(labels, series)] and series.value == became_current  # unchanged: kept as it is


def test_lora_requests_info_of_two_models_are_apart():
    pb = fake_pb_utils()
    orca, baseline = EngineMetrics(pb, "orca", lora=True), EngineMetrics(pb, "baseline", lora=True)
    for running in ("a", "b", "a,b"):
        orca.update(stats(max_loras=2, running_lora_adapters=running))
    baseline.update(stats(max_loras=2, waiting_lora_adapters="c"))
    assert [labels["running_lora_adapters"] for labels, _ in live(pb, LORA_INFO, model="orca")] == ["a,b"]
    assert [labels["waiting_lora_adapters"] for labels, _ in live(pb, LORA_INFO, model="baseline")] == ["c"]


def test_without_lora_no_adapter_series_are_made():
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca")
    metrics.update(stats(max_loras=4, running_lora_adapters="a", lora_loads=3))
    assert live(pb, LORA_INFO) == [] and live(pb, "orca_lora_loads_total") == []
    assert all("lora_name" not in labels for labels, _ in live(pb, "vllm:e2e_request_latency_seconds"))


# --- EngineMetrics ----------------------------------------------------------------------------------


def test_update_sets_gauges_and_exports_counters_as_increments():
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca", model_version="3")
    metrics.update(stats(num_running=3, num_waiting=2, kv_used_blocks=6, kv_num_blocks=8, num_iterations=10,
                         num_generated_tokens=40, num_preemptions=1))  # fmt: skip
    metrics.update(stats(num_running=1, kv_used_blocks=2, kv_num_blocks=8, num_iterations=25, num_generated_tokens=90,
                         num_preemptions=1))  # fmt: skip
    assert value(pb, "orca_requests_running", model="orca", version="3") == 1
    assert value(pb, "vllm:num_requests_waiting", model="orca") == 0
    assert value(pb, "vllm:gpu_cache_usage_perc", model="orca") == 0.25
    assert value(pb, "orca_kv_blocks_free", model="orca") == 6
    assert value(pb, "orca_iterations_total", model="orca") == 25  # 10, then 15 more
    assert value(pb, "orca_generated_tokens_total", model="orca") == 90
    assert value(pb, "vllm:num_preemptions_total", model="orca") == 1


def test_steps_are_exported_by_path_a_series_each():
    """orca_model_steps_total{path}: a series per path as it first appears, each the engine's total."""
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca")
    metrics.update(stats(num_iterations=3, steps_by_path={"mixed_step": 3}))
    metrics.update(stats(num_iterations=10, steps_by_path={"mixed_step": 4, "cuda_graph": 6}))
    assert value(pb, "orca_model_steps_total", model="orca", path="mixed_step") == 4
    assert value(pb, "orca_model_steps_total", model="orca", path="cuda_graph") == 6
    assert len(live(pb, "orca_model_steps_total")) == 2


def test_counters_never_decrease():
    """An engine total that reads lower (a restarted engine's) leaves the counter where it was, and
    later growth is counted from the highest total exported."""
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca")
    metrics.update(stats(num_iterations=50))
    metrics.update(stats(num_iterations=5))
    assert value(pb, "orca_iterations_total") == 50
    metrics.update(stats(num_iterations=60))
    assert value(pb, "orca_iterations_total") == 60


def test_zero_gauges_zeroes_the_gauges_and_keeps_the_counters():
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca")
    metrics.update(stats(num_running=4, kv_used_tokens=64, kv_capacity_tokens=128, num_iterations=7))
    metrics.zero_gauges()
    assert value(pb, "orca_requests_running") == 0 and value(pb, "orca_kv_used_tokens") == 0
    assert value(pb, "orca_kv_capacity_tokens") == 0
    assert value(pb, "orca_iterations_total") == 7
    metrics.update(stats(num_running=2, num_iterations=7))  # serving again: the gauges follow
    assert value(pb, "orca_requests_running") == 2


def test_request_ends_are_exported_by_reason_and_adapter():
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca", max_context=100, lora=True)
    for end in (finished(FinishReason.LENGTH, "sql"), finished(FinishReason.LENGTH, "sql"),
                finished(FinishReason.CANCELLED), finished(None, "sql", output_tokens=1)):  # fmt: skip
        metrics.request_finished(end)  # exported at once: the final response goes out after it
    assert value(pb, "orca_requests_finished_total", lora_name="sql", reason="length") == 2
    assert value(pb, "orca_requests_finished_total", lora_name="sql", reason="unknown") == 1
    assert value(pb, "vllm:request_success_total", lora_name="", finished_reason="abort") == 1  # the contract's name
    assert value(pb, "vllm:prompt_tokens_total", lora_name="sql") == 21
    assert value(pb, "vllm:generation_tokens_total", lora_name="sql") == 9
    (_, latency), = live(pb, "vllm:e2e_request_latency_seconds", lora_name="sql")
    assert latency.observed == [3.0, 3.0, 3.0]
    (_, per_token), = live(pb, "vllm:time_per_output_token_seconds", lora_name="sql")
    assert per_token.observed == [pytest.approx(2 / 3)] * 2  # 2 s over 3 gaps; none for the one-token request
    (_, prompt_tokens), = live(pb, "vllm:request_prompt_tokens", lora_name="")
    assert prompt_tokens.buckets == [1, 2, 5, 10, 20, 50, 100] and prompt_tokens.observed == [7]
    (_, preemptions), = live(pb, "orca_request_preemptions", lora_name="")
    assert preemptions.observed == [2]


# --- MetricsPoller ----------------------------------------------------------------------------------


class FakeEngine:
    """stats() raises on its first call, then reports `running`; `called` is set once it has
    answered twice after the failure, so the poller has exported at least one tick."""

    def __init__(self, running: int) -> None:
        self.healthy = True
        self.running = running
        self.calls = 0
        self.called = threading.Event()

    def stats(self) -> EngineStats:
        self.calls += 1
        if self.calls == 1:
            raise RuntimeError("the engine's stats failed once")
        if self.calls >= 3:
            self.called.set()
        return stats(num_running=self.running, num_iterations=self.calls)


def test_the_poller_survives_a_failing_stats_call_and_exports_each_tick():
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca")
    engine = FakeEngine(running=5)
    poller = MetricsPoller(engine, metrics, interval_s=0.001).start()
    try:
        metrics.request_finished(finished(FinishReason.LENGTH))
        assert engine.called.wait(30), "the poller stopped ticking after stats() raised"
    finally:
        poller.stop()
    assert value(pb, "orca_iterations_total") >= 2  # a tick after the failure exported the stats
    assert value(pb, "orca_requests_finished_total", reason="length") == 1
    assert value(pb, "orca_requests_running") == 0  # stop() zeroes the gauges


def test_an_unhealthy_engine_zeroes_the_gauges_without_asking_its_stats():
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca")
    metrics.update(stats(num_running=3))
    engine = FakeEngine(running=3)
    engine.healthy = False
    zeroed = threading.Event()
    zero_gauges = metrics.zero_gauges

    def zero_and_tell() -> None:
        zero_gauges()
        zeroed.set()

    metrics.zero_gauges = zero_and_tell  # type: ignore[method-assign]
    poller = MetricsPoller(engine, metrics, interval_s=0.001).start()
    try:
        assert zeroed.wait(30)
    finally:
        poller.stop()
    assert value(pb, "orca_requests_running") == 0 and engine.calls == 0


def test_stop_exports_the_ends_still_queued():
    """A poller whose next tick is an hour away: stop() itself exports what is queued."""
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca")
    poller = MetricsPoller(FakeEngine(running=0), metrics, interval_s=3600).start()
    metrics.request_finished(finished(FinishReason.STOP))
    metrics.request_finished(finished(FinishReason.CANCELLED))
    poller.stop()
    assert value(pb, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(pb, "vllm:request_success_total", finished_reason="abort") == 1


@pytest.mark.parametrize("kind", ["gauge", "counter"])
def test_the_stand_in_removes_a_series_with_its_family_only(kind):
    """The stand-in's own lifetimes, which the lora_requests_info test relies on."""
    pb = fake_pb_utils()
    family = pb.MetricFamily(name="x", description="", kind=kind)
    metric = family.Metric(labels={"a": "1"})
    del metric
    assert len(pb.series) == 1  # the family still holds it, as Triton's does
    twin = pb.MetricFamily(name="x", description="", kind=kind)
    twin.Metric(labels={"a": "1"})
    del family
    assert len(pb.series) == 1  # the same series, held by the other family of the name
    del twin
    assert pb.series == {}


def test_cache_config_info_names_an_fp8_pool():
    """kv_cache_dtype as vLLM labels it: fp8 when the pool is FP8."""
    assert cache_config_labels(EngineConfig(kv_cache_dtype="fp8"))["cache_dtype"] == "fp8"


def test_the_host_tier_is_exported_with_swap_space_only():
    """swap_space: the host tier's blocks, their use and the blocks copied out, in and back on
    prefix hits; vLLM's num_cpu_blocks label names its size. Without it, none of its series."""
    pb = fake_pb_utils()
    metrics = EngineMetrics(pb, "orca", host_tier=True)
    metrics.update(stats(kv_host_num_blocks=64, kv_host_used_blocks=10, kv_swapped_out_blocks=12,
                         kv_swapped_in_blocks=8, kv_host_hit_blocks=3))  # fmt: skip
    assert value(pb, "orca_kv_host_blocks", model="orca") == 64
    assert value(pb, "orca_kv_host_blocks_used", model="orca") == 10
    assert value(pb, "orca_kv_swapped_out_blocks_total", model="orca") == 12
    assert value(pb, "orca_kv_swapped_in_blocks_total", model="orca") == 8
    assert value(pb, "orca_prefix_cache_host_hit_blocks_total", model="orca") == 3
    plain = fake_pb_utils()
    EngineMetrics(plain, "orca").update(stats(kv_host_num_blocks=64))
    assert live(plain, "orca_kv_host_blocks") == []
    assert cache_config_labels(EngineConfig(), host_blocks=64)["num_cpu_blocks"] == "64"
