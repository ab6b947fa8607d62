"""Helpers for tests (and scripts) that talk to a real tritonserver started by
orca_backend.entrypoints.serve."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import tritonclient.grpc as grpcclient
import tritonclient.http as httpclient

from orca_backend.entrypoints.serve import ServerOptions, TritonServer
from orca_client.protocol import (
    STATUS_OUTPUTS,
    Delta,
    build_inputs,
    decode_response,
    get_model_config,
    is_batched,
)
from orca_client.served_path import process_tree, stub_model


def start_server(run_dir: Path, model_dir: Path, models: tuple[str, ...] = ("orca", "baseline"),
                 timeout_s: float = 300.0, **options: Any) -> TritonServer:
    """A ready server on free ports serving `model_dir`; its log is run_dir/tritonserver.log.

    Extra keyword arguments are ServerOptions fields; `parameters` merge over the model path.
    """
    parameters = {"model": str(model_dir), **options.pop("parameters", {})}
    run_dir.mkdir(parents=True, exist_ok=True)
    attempt = 1
    while True:
        server = TritonServer(ServerOptions(models=models, parameters=parameters, run_dir=run_dir,
                                            log_file=run_dir / "tritonserver.log", **options))
        server.start()
        try:
            server.wait_ready(timeout_s)
            return server
        except RuntimeError as exc:
            server.stop()
            # The ports were free when picked (net.free_ports), but another process (the other
            # worker's clients) may bind one before tritonserver does: it exits, and new ports are tried.
            if "already in use" not in str(exc) or attempt == 3:
                raise
            attempt += 1
        except BaseException:
            server.stop()
            raise


@dataclass
class StreamResult:
    request_id: str
    sent_at: float
    deltas: list[Delta] = field(default_factory=list)
    error: str | None = None
    done: threading.Event = field(default_factory=threading.Event)

    @property
    def ids(self) -> list[int]:
        return [t for d in self.deltas for t in d.ids]

    @property
    def text(self) -> str:
        return "".join(d.text for d in self.deltas)

    @property
    def finish_reason(self) -> str:
        return self.deltas[-1].finish_reason if self.deltas else ""

    @property
    def num_output_tokens(self) -> int:
        """The server's count: each response counts the tokens it carries."""
        return sum(d.num_output_tokens for d in self.deltas)

    @property
    def num_input_tokens(self) -> int:
        return self.deltas[-1].num_input_tokens if self.deltas else 0

    @property
    def finished_at(self) -> float:
        return self.deltas[-1].time

    @property
    def first_at(self) -> float:
        return self.deltas[0].time


class StreamSession:
    """One gRPC stream carrying any number of concurrent requests, told apart by request id.

    Triton's stream errors carry no request id, so send a request that may fail on a session of
    its own (errors are attributed to the only outstanding request).
    """

    def __init__(self, url: str) -> None:
        self.client = grpcclient.InferenceServerClient(url)
        self.results: dict[str, StreamResult] = {}
        self.stray_errors: list[str] = []
        self._lock = threading.Lock()
        self._batched: dict[str, bool] = {}
        self._closing = False
        self.client.start_stream(callback=self._on_response)

    def send(self, model: str, request_id: str | None = None, **request: Any) -> StreamResult:
        """Sends one request; `request` are orca_client.protocol.build_inputs keywords.

        Unless `request` says otherwise, the prompt is not echoed and finish_reason and the token
        counts are switched on (pass exclude_input_in_output=None or return_outputs=() to test
        the contract's defaults).
        """
        request.setdefault("exclude_input_in_output", True)
        request.setdefault("return_outputs", STATUS_OUTPUTS)
        return self.send_inputs(model, build_inputs(batched=self.is_batched(model), **request), request_id)

    def send_inputs(self, model: str, inputs: list[Any], request_id: str | None = None) -> StreamResult:
        request_id = request_id or f"r{len(self.results)}"
        result = StreamResult(request_id, time.perf_counter())
        with self._lock:
            self.results[request_id] = result
        self.client.async_stream_infer(model, inputs, request_id=request_id, enable_empty_final_response=True)
        return result

    def is_batched(self, model: str) -> bool:
        if model not in self._batched:
            self._batched[model] = is_batched(get_model_config(self.client, model))
        return self._batched[model]

    def _on_response(self, result: Any, error: Any) -> None:
        with self._lock:
            if error is not None and self._closing:
                return  # our own cancellation of the stream
            if error is not None:
                open_ = [r for r in self.results.values() if not r.done.is_set()]
                if len(open_) == 1:
                    open_[0].error = str(error)
                    open_[0].done.set()
                else:
                    self.stray_errors.append(str(error))
                return
            entry = self.results.get(result.get_response().id)
        if entry is None:
            return
        delta = decode_response(result)
        if delta.ids or delta.text or delta.finish_reason or not delta.final:
            entry.deltas.append(delta)
        if delta.final:
            entry.done.set()

    def wait(self, timeout_s: float = 120.0) -> list[StreamResult]:
        deadline = time.monotonic() + timeout_s
        for result in list(self.results.values()):
            if not result.done.wait(max(0.0, deadline - time.monotonic())):
                raise TimeoutError(f"request {result.request_id} unfinished after {timeout_s} s "
                                   f"({len(result.ids)} tokens so far); stray errors: {self.stray_errors}")
        return list(self.results.values())

    def close(self, cancel: bool = False) -> None:
        """Ends the stream (cancelling what is in flight when `cancel`); again is a no-op."""
        if self._closing:
            return
        self._closing = True
        self.client.stop_stream(cancel_requests=cancel)
        self.client.close()

    def __enter__(self) -> StreamSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(cancel=True)


def _spawned(p: Any) -> bool:
    """Spawning also starts multiprocessing's resource tracker beside each child: it is none of ours."""
    return "resource_tracker" not in " ".join(p.cmdline)


def model_processes(root_pid: int, model: str = "orca") -> tuple[list[int], list[int]]:
    """(stubs, cores): `model`'s Python-backend stub processes (one per Triton instance) and the engine
    core processes below them."""
    tree = process_tree(root_pid)
    stubs = [p.pid for p in tree if stub_model(p.cmdline) == model]
    return stubs, [p.pid for p in tree if p.ppid in stubs and _spawned(p)]


def engine_processes(root_pid: int, model: str = "orca") -> tuple[int, int, list[int]]:
    """(stub, core, workers) of a model of one instance: its stub, the engine core process below it,
    and the workers the core spawned (sorted)."""
    (stub,), (core,) = model_processes(root_pid, model)
    return stub, core, sorted(p.pid for p in process_tree(core) if p.pid != core and _spawned(p))


# Runs the engine for one slice per line read (the line: its seconds): a process of its own, because
# the test's own process can wait hundreds of milliseconds for its GIL (the gRPC stream's threads hold
# it) between the two signals, while the engine makes hundreds of tokens. It asks for real-time
# scheduling first (its first line says whether it got it): on a loaded 2-core machine the kernel has
# been seen to leave a woken process waiting seconds for a CPU (6.18, EEVDF: a sleeping probe waited
# up to 6 s beside two busy loops and a serving tritonserver), and the engine runs on all that time.
_SLICER = """
import os, signal, sys, time
pid = int(sys.argv[1])
try:
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
    sys.stdout.write("fifo\\n")
except (AttributeError, OSError) as exc:
    sys.stdout.write(f"fair ({exc})\\n")
sys.stdout.flush()
for line in iter(sys.stdin.readline, ""):
    os.kill(pid, signal.SIGCONT)
    time.sleep(float(line))
    os.kill(pid, signal.SIGSTOP)
    sys.stdout.write("\\n")
    sys.stdout.flush()
"""
MAX_SLICE_S = 0.04


def run_in_slices(pid: int, progress: Callable[[], float], until: Callable[[], bool], slice_s: float = 0.01,
                  catch_up_s: float = 1.0, timeout_s: float = 120.0) -> bool:
    """Lets a stopped engine run a slice at a time until `until()`, and leaves it stopped.

    After each slice the engine waits, stopped, until `progress()` (e.g. the iterations the server
    exports every 0.2 s) moves, or catch_up_s when nothing does: so what the test reads is about one
    slice behind the engine, however slowly a loaded machine passes it along. A slice in which no
    iteration ended doubles the next (up to MAX_SLICE_S: a loaded machine may give the engine little
    of a slice); one that made progress starts again from slice_s. False if `until()` did not come
    within timeout_s."""
    slicer = subprocess.Popen([sys.executable, "-c", _SLICER, str(pid)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        policy = slicer.stdout.readline().strip()
        if policy != "fifo":  # the slices may then run long on a loaded machine: said, not hidden
            warnings.warn(f"the engine's slicer runs without real-time scheduling: {policy or 'it ended'}", stacklevel=2)
        deadline, length = time.monotonic() + timeout_s, slice_s
        while not until():
            if time.monotonic() > deadline:
                return False
            seen = progress()
            slicer.stdin.write(f"{length}\n")
            slicer.stdin.flush()
            if not slicer.stdout.readline():
                raise RuntimeError(f"the slicer ended (exit code {slicer.wait()})")
            moved = wait_until(lambda: progress() != seen or until(), timeout_s=catch_up_s, interval_s=0.01)  # noqa: B023
            length = slice_s if moved else min(2 * length, MAX_SLICE_S)
        return True
    finally:
        slicer.stdin.close()
        slicer.wait()
        os.kill(pid, signal.SIGSTOP)  # stopped whatever happened to the slicer


def iteration_lines(log: Path, offset: int = 0) -> list[dict]:
    """The iteration log's (EngineConfig.iteration_log) iteration lines written whole after byte `offset`."""
    if not log.exists():
        return []
    with log.open() as f:
        f.seek(offset)
        text = f.read()
    return [line for line in map(json.loads, text[: text.rfind("\n") + 1].splitlines()) if "iteration" in line]


def log_size(log: Path) -> int:
    return log.stat().st_size if log.exists() else 0


def run_until_decoding(core: int, log: Path, offset: int, count: int, stop: Callable[[], bool],
                       min_iterations: int = 2) -> bool:
    """Lets a stopped engine core run in slices (run_in_slices) until one of its iterations decodes
    `count` requests, at least `min_iterations` after byte `offset` of its iteration log (every one of
    them has its prompt's K/V and tokens to go), or until `stop()` (say, one ran to max_tokens); the
    core is left stopped. True in the first case.

    Progress is the core's own iteration log, which its writer thread flushes within the slice: the
    exported metrics pass through the instances, which a loaded machine can leave seconds behind the
    core, and the core would run on (slice after slice, each making tokens) while they catch up."""
    def decoding() -> bool:
        lines = iteration_lines(log, offset)
        return len(lines) >= min_iterations and lines[-1]["decode_tokens"] == count

    assert run_in_slices(core, progress=lambda: len(iteration_lines(log, offset)), until=lambda: decoding() or stop())
    return decoding()


def finished_counts(server: TritonServer, model: str = "orca") -> dict[str, float]:
    """`model`'s requests ended so far, cancelled and run to max_tokens (orca_requests_finished_total)."""
    return {reason: metric(server, "orca_requests_finished_total", model, reason=reason)
            for reason in ("cancelled", "length")}  # fmt: skip


def ran_to_length(server: TritonServer, before: dict[str, float], model: str = "orca") -> int:
    """How many of `model`'s requests ran to max_tokens since `before` (finished_counts): a test that
    runs the engine in slices until its requests all run stops waiting when one has ended instead (a
    loaded machine may pass a request to the engine so late that another one has made every token)."""
    return int(metric(server, "orca_requests_finished_total", model, reason="length") - before["length"])


def all_cancelled(server: TritonServer, before: dict[str, float], count: int, model: str = "orca") -> bool:
    """Waits until `count` more requests ended (cancelled, or run to max_tokens) since `before`
    (finished_counts); True when every one was cancelled, False when some ran to max_tokens first."""
    def ended(reason: str) -> float:
        return metric(server, "orca_requests_finished_total", model, reason=reason) - before[reason]

    assert wait_until(lambda: ended("cancelled") + ended("length") == count, timeout_s=30), finished_counts(server, model)
    return not ended("length")


def one_request(url: str, model: str, timeout_s: float = 120.0, **request: Any) -> StreamResult:
    """Streams a single request on its own session and waits for its end (or error)."""
    with StreamSession(url) as session:
        session.send(model, **request)
        return session.wait(timeout_s)[0]


_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)$')


def read_metrics(server: TritonServer) -> dict[tuple[str, frozenset], float]:
    """Prometheus samples from the metrics port: {(name, frozenset(labels)): value}."""
    with urllib.request.urlopen(server.metrics_url, timeout=5) as response:
        body = response.read().decode()
    samples = {}
    for line in body.splitlines():
        match = _SAMPLE.match(line)
        if match is None or line.startswith("#"):
            continue
        labels = frozenset(re.findall(r'(\w+)="([^"]*)"', match.group("labels") or ""))
        samples[(match.group("name"), labels)] = float(match.group("value"))
    return samples


def dashboard_series() -> set[str]:
    """Every metric the shipped Grafana dashboard (monitoring/grafana/dashboards/orca.json) queries."""
    root = Path(__file__).resolve().parents[1]
    dashboard = json.loads((root / "monitoring" / "grafana" / "dashboards" / "orca.json").read_text())
    exprs = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    exprs += [dashboard["templating"]["list"][0]["query"]["query"]]
    return {name for expr in exprs for name in re.findall(r"\b(?:vllm:|orca_)[a-z0-9_:]+", expr)}


def metric(server: TritonServer, name: str, model: str, **labels: str) -> float:
    """Sum of `name` samples of `model` matching `labels` (0 when absent)."""
    wanted = {("model", model), *labels.items()}
    return sum(v for (n, ls), v in read_metrics(server).items() if n == name and wanted <= ls)


def wait_until(predicate: Callable[[], bool], timeout_s: float = 30.0, interval_s: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return predicate()


def model_statistics(server: TritonServer, model: str) -> tuple[int, int]:
    """(inference_count, execution_count) of `model` from Triton's statistics extension."""
    client = httpclient.InferenceServerClient(server.http_url)
    try:
        stats = client.get_inference_statistics(model)["model_stats"]
    finally:
        client.close()
    entry = next(s for s in stats if s["name"] == model)
    return int(entry.get("inference_count", 0)), int(entry.get("execution_count", 0))


def http_generate(server: TritonServer, model: str, body: dict[str, Any], stream: bool = False,
                  timeout_s: float = 60.0) -> tuple[int, list[dict[str, Any]]]:
    """POSTs to generate (or generate_stream, parsing the SSE events); returns (status, events)."""
    endpoint = "generate_stream" if stream else "generate"
    request = urllib.request.Request(f"http://{server.http_url}/v2/models/{model}/{endpoint}",
                                     data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout_s) as response:
            status, raw = response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        status, raw = exc.code, exc.read().decode()
    if not stream:
        return status, [json.loads(raw)]
    events = [json.loads(line[len("data:"):]) for line in raw.splitlines() if line.startswith("data:")]
    return status, events


# ---- Triton's OpenAI-compatible frontend, replayed ------------------------------------------------
# The frontend (server repo, python/openai, `--backend vllm`) turns each OpenAI request into the tensors
# below: `_create_vllm_generate_request` in openai_frontend/engine/utils/triton.py, read at server
# main @ e1db8a60 (unchanged since r26.01). `sampling_parameters` is the request's pydantic dump
# without None fields and without the keys the frontend handles itself, so the schema's defaults are
# always there (ints where the schema's default is an int literal), plus max_tokens; with
# `--lora-separator`, a request for `model: base<sep>adapter` adds `lora_name` (`extra`). It reads usage
# from num_input_tokens (first response) and the sum of num_output_tokens, and ends a stream at the
# response flagged final; it never asks for finish_reason.
def frontend_inputs(prompt: str, *, stream: bool, max_tokens: int, temperature: float, **extra: Any) -> list:
    sampling = {"frequency_penalty": 0, "ignore_eos": False, "n": 1, "presence_penalty": 0,
                "temperature": temperature, "top_p": 1, "max_tokens": max_tokens, **extra}  # fmt: skip
    tensors = [("text_input", np.array([prompt.encode()], dtype=np.object_), "BYTES"),
               ("stream", np.array([stream]), "BOOL"),
               ("exclude_input_in_output", np.array([True]), "BOOL"),  # echo unset or false
               ("sampling_parameters", np.array([json.dumps(sampling).encode()], dtype=np.object_), "BYTES"),
               ("return_logprobs", np.array([False]), "BOOL"),
               ("return_num_input_tokens", np.array([True]), "BOOL"),
               ("return_num_output_tokens", np.array([True]), "BOOL")]  # fmt: skip
    inputs = []
    for name, array, datatype in tensors:
        inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    return inputs


def frontend_embedding_inputs(prompt: str | list[int], *, dimensions: int | None = None, batched: bool = False) -> list:
    """/v1/embeddings as the frontend sends it with `--backend vllm` (`_create_vllm_embedding_request`,
    same file and commit as above): the OpenAI request's input and `dimensions` (as a one-element
    list) in an `embedding_request` JSON, and the two usage outputs switched on; it reads the vector
    from text_output as JSON. `batched`: the baseline's batch dimension."""
    pooling = {"dimensions": [dimensions]} if dimensions is not None else {}
    tensors = [("embedding_request", np.array([json.dumps({"input": prompt, "pooling_params": pooling}).encode()],
                                              dtype=np.object_), "BYTES"),
               ("return_num_input_tokens", np.array([True]), "BOOL"),
               ("return_num_output_tokens", np.array([True]), "BOOL")]  # fmt: skip
    inputs = []
    for name, array, datatype in tensors:
        array = array[np.newaxis, ...] if batched else array
        inputs.append(grpcclient.InferInput(name, list(array.shape), datatype))
        inputs[-1].set_data_from_numpy(array)
    return inputs
