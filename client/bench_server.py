"""The server side of `orca-bench`: one tritonserver holding `orca`, one `baseline` copy per
dynamic-batcher max batch size, and the `echo` model; plus the few control-plane reads the
benchmark needs (model configs, execution counts, engine gauges).

Why one server with several baseline copies rather than a server per batch size: every model
then runs in the same process tree, start-up is paid once, and an A/B point is two runs a few
seconds apart on the same machine state. The copies only differ in `name` and `max_batch_size`;
weights come from the same preset/checkpoint and seed. Idle copies cost memory, not CPU (their
engine threads block on an empty inbox).
"""

from __future__ import annotations

import re
import shutil
import time
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orca_client import protocol

ECHO_REPOSITORY = Path(__file__).resolve().parents[1] / "benchmarks" / "echo_repository"


@dataclass
class ServedModel:
    name: str
    kind: str  # "orca" | "baseline" | "echo"
    max_batch_size: int | None = None  # baseline: Triton's dynamic-batcher max_batch_size
    max_queue_delay_us: int | None = None  # baseline: the batcher's max_queue_delay_microseconds
    max_num_seqs: int | None = None  # orca: the engine's batch limit (its `max_num_seqs` parameter)

    @property
    def label(self) -> str:
        if self.kind == "baseline" and self.max_batch_size is not None:
            return f"baseline (batch {self.max_batch_size})"
        return self.kind


def baseline_name(batch_size: int) -> str:
    return f"baseline_bs{batch_size}"


def build_repository(target: Path, baseline_batch_sizes: list[int], echo: bool = True, orca: bool = True,
                     source: Path | None = None, max_queue_delay_us: int | None = None) -> list[str]:
    """Writes a repository of orca + baseline_bs<N> copies (+ echo) to `target`; returns model names."""
    from orca_backend.serve import default_model_repository, render_config

    source = Path(source or default_model_repository())
    if target.exists():
        shutil.rmtree(target)
    target.mkdir(parents=True)
    names = []
    if orca:
        shutil.copytree(source / "orca", target / "orca", ignore=shutil.ignore_patterns("__pycache__"))
        names.append("orca")
    for size in baseline_batch_sizes:
        name = baseline_name(size)
        shutil.copytree(source / "baseline", target / name, ignore=shutil.ignore_patterns("__pycache__"))
        config = target / name / "config.pbtxt"
        text = re.sub(r'(?m)^name:\s*"[^"]*"', f'name: "{name}"', config.read_text(), count=1)
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
    dimension is a baseline, `echo` is the load generator check, anything else an orca engine."""
    if name == "echo":
        return ServedModel(name, "echo")
    if protocol.is_batched(config):
        delay = (config.get("dynamic_batching") or {}).get("max_queue_delay_microseconds")
        return ServedModel(name, "baseline", protocol.triton_max_batch_size(config),
                           int(delay) if delay is not None else None)
    max_num_seqs = protocol.string_parameters(config).get("max_num_seqs")
    return ServedModel(name, "orca", max_num_seqs=int(max_num_seqs) if max_num_seqs else None)


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


_GAUGE_RE = re.compile(r'^(orca_requests_waiting|orca_requests_running|orca_kv_used_tokens)\{([^}]*)\}\s+(\S+)', re.M)


def engine_busy(metrics_url: str, models: list[str]) -> dict[str, float] | None:
    """Sum of waiting + running requests and used K/V per model, from the engine gauges (None: unreadable)."""
    try:
        with urllib.request.urlopen(metrics_url, timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return None
    busy: dict[str, float] = {}
    for _name, labels, value in _GAUGE_RE.findall(text):
        model = re.search(r'model="([^"]*)"', labels)
        if model and model.group(1) in models:
            busy[model.group(1)] = busy.get(model.group(1), 0.0) + float(value)
    return busy


def wait_idle(metrics_url: str | None, models: list[str], timeout_s: float = 60.0) -> bool:
    """Waits until no engine holds requests or K/V (after a cancelled run); True when idle."""
    if not metrics_url:
        return True
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        busy = engine_busy(metrics_url, models)
        if busy is None or not any(busy.values()):
            return True
        time.sleep(0.25)
    return False
