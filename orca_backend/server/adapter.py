"""What the two TritonPythonModels share: building the engine from config.pbtxt, metrics, the
engine-death message, cancellation polling, the served adapters' list and shutdown. Each model adds
its own scheduling and its own way of answering (`orca_model.py` streams, `baseline_model.py`
answers once per batch).

The served adapters' list is the model version's multi_lora.json (Triton's vLLM backend's file,
{adapter name: directory}), read at load and, with allow_runtime_lora_updating, again whenever it
or an adapter's files change (`MultiLoraFile`), so adapters are added, replaced and removed while the
model serves. A thread of its own looks (one stat of the file, a few of each adapter's) once a
second: reading and checking an adapter reads all its weights, which must never hold up Triton's
thread. An edited file takes effect within about a second. Adapters it no longer lists are refused
to new requests; those running finish with them. An adapter whose files changed is read and checked
again (a new adapter if its weights changed). An adapter the engine refuses (a bad directory or
file, a rank above max_lora_rank, a path outside lora_allowed_dir) is logged alone, and the others
still apply; it is tried again when its files or the list change.
"""

from __future__ import annotations

import dataclasses
import json
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import triton_python_backend_utils as pb_utils

from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.lora import MULTI_LORA_FILE, read_multi_lora_json
from orca_backend.server.instances import CoreRendezvous, instance_count
from orca_backend.server.metrics import EngineMetrics, MetricsPoller, NoMetrics, cache_config_labels
from orca_backend.server.protocol import install_fast_byte_serialization
from orca_backend.server.triton_config import (
    MODEL_JSON,
    auto_complete,
    engine_config,
    read_model_json,
    report_custom_metrics,
)


class EngineAdapter:
    """Base of OrcaModel and BaselineModel; subclasses set `scheduling` and check their Triton config."""

    scheduling: str  # "iteration" | "request"
    adapter_parameters: frozenset[str] = frozenset()  # config.pbtxt parameters the adapter reads itself

    @classmethod
    def auto_complete_config(cls, config: Any) -> Any:
        """Triton's auto-complete: a config.pbtxt of one line (`backend: "orca"`) gets the contract's
        inputs and outputs and its transaction policy or batcher (server/triton_config.py)."""
        return auto_complete(config, batching=cls.scheduling == "request")

    def initialize(self, args: dict[str, str]) -> None:
        # Triton's config.pbtxt as JSON; not to be confused with the engine's model config (geometry, families/).
        install_fast_byte_serialization(pb_utils)  # every response's string tensors (server/protocol.py)
        self.triton_config: dict[str, Any] = json.loads(args["model_config"])
        self.model_name = args["model_name"]
        version_dir = Path(args.get("model_repository", "")) / args.get("model_version", "1")
        self.model_json = read_model_json(version_dir / MODEL_JSON)  # vLLM's engine arguments, if any
        self.check_triton_config()
        config = self.engine_config()
        lora_file = multi_lora_path(args.get("model_repository", ""), args.get("model_version", "1"))
        if config.enable_lora:  # as Triton's vLLM backend: the adapters are the version's multi_lora.json
            config = dataclasses.replace(config, lora_modules=read_multi_lora_json(lora_file))
        self.instances = instance_count(self.triton_config)
        self.check_instance_count(self.instances)
        self.owns_core, self.engine = self._start_engine(config, args.get("model_version", "1"))
        self.tokenizer = self.engine.tokenizer
        self.lora_file: MultiLoraFile | None = None
        if config.allow_runtime_lora_updating:
            self.lora_file = MultiLoraFile(lora_file, self.engine.sync_loras, self.engine.changed_loras,
                                           pb_utils.Logger.log_warn).start()  # fmt: skip
        # Every instance exports its own requests' ends; the engine's stats only the one that owns the core
        # (Triton merges the instances' series of one name and labels: each is counted once).
        self.metrics: EngineMetrics | NoMetrics = NoMetrics()
        self._poller: MetricsPoller | None = None
        if report_custom_metrics(self.triton_config.get("parameters", {}) or {}, self.model_json):
            self.metrics = EngineMetrics(pb_utils, self.model_name, args.get("model_version", "1"),
                                         self.engine.model_config.max_context, lora=config.enable_lora,
                                         engine_stats=self.owns_core,
                                         cache_config=cache_config_labels(self.engine.config, self.engine.config
                                                                          .host_kv_blocks(self.engine.model_config)),
                                         speculative=bool(config.speculative_config),
                                         host_tier=float(config.swap_space) > 0)  # fmt: skip
            self._poller = MetricsPoller(self.engine, self.metrics).start()
        if not self.owns_core:
            pb_utils.Logger.log_info(f"{self.model_name}: instance {args.get('model_instance_name', '')} attached to "
                                     f"the engine core (pid {self.engine.core.pid})")  # fmt: skip
            return
        pb_utils.Logger.log_info(
            f"{self.model_name}: engine ready (model={config.model}, device={config.device}, dtype={config.dtype}, "
            f"scheduling={config.scheduling}, max_num_seqs={config.max_num_seqs}, "
            f"kv_capacity_tokens={config.kv_capacity_tokens}, kv_policy={config.kv_policy}, "
            f"block_size={config.block_size}, enable_prefix_caching={config.enable_prefix_caching}, "
            f"max_num_batched_tokens={config.max_num_batched_tokens}"
            + (f", LoRA adapters {self.engine.list_loras()} (max_loras={config.max_loras})" if config.enable_lora else "")
            + ")"
        )

    def _start_engine(self, config: EngineConfig, version: str) -> tuple[bool, LLMEngine]:
        """(owns the core, the engine): one instance launches the engine core process and returns once
        the model is loaded; with several instances the others attach to it (server/instances.py),
        each admitting its share of the queue limits."""
        self._rendezvous: CoreRendezvous | None = None
        if self.instances == 1:
            return True, LLMEngine.launch(config)
        config = dataclasses.replace(config, max_queued_requests=_share(config.max_queued_requests, self.instances),
                                     max_queued_prompt_tokens=_share(config.max_queued_prompt_tokens, self.instances))  # fmt: skip
        self._rendezvous = CoreRendezvous(self.model_name, version)
        try:
            if self._rendezvous.claim():
                return True, LLMEngine.launch(config, listen=self._rendezvous.owner_address())
            return False, self._rendezvous.wait_for_core(lambda address: LLMEngine.attach(config, address))
        except BaseException:
            self._rendezvous.release()
            raise

    def leads_unload(self) -> bool:
        """Whether this instance is the one to unload the model when its engine dies: the core's owner,
        or, when the owner is gone too, the one instance that takes over its lock."""
        return self.owns_core or (self._rendezvous is not None and self._rendezvous.claim())

    def check_instance_count(self, count: int) -> None:
        """Raises pb_utils.TritonModelException when this adapter cannot serve `count` instances."""

    def check_triton_config(self) -> None:
        """Raises pb_utils.TritonModelException when config.pbtxt does not fit this adapter, and reads the
        adapter's own parameters; runs before the engine starts."""
        raise NotImplementedError

    def engine_config(self) -> EngineConfig:
        """EngineConfig from model.json and config.pbtxt `parameters`, with the fields this adapter owns
        forced (server/triton_config.py)."""
        return engine_config(self.triton_config, self.model_json, self.adapter_parameters, scheduling=self.scheduling,
                             **self.owned_engine_fields())  # fmt: skip

    def owned_engine_fields(self) -> dict[str, Any]:
        """Engine fields this adapter sets itself, whatever `parameters` say."""
        return {}

    def engine_stopped_message(self, next_step: str) -> str:
        """What every request is told once the engine loop has stopped, and what happens next."""
        return f"the engine loop stopped ({self.engine.dead_reason or 'unknown reason'}); {next_step}"

    def finalize(self) -> None:
        if self.lora_file is not None:
            self.lora_file.stop()
        if self._poller is not None:
            self._poller.stop()
        self.engine.shutdown()  # the core's owner stops it; another instance detaches
        if self._rendezvous is not None:
            self._rendezvous.release()


def _share(limit: int, instances: int) -> int:
    """One instance's share of a queue limit (0: none): each instance admits its own requests."""
    return -(-limit // instances) if limit else 0


def is_cancelled(request: Any, sender: Any = None) -> bool:
    """Whether the client cancelled: the response sender knows in decoupled mode, the request always.

    Each question is an IPC round trip to Triton; a failing one counts as not cancelled.
    """
    for source in (sender, request):
        if source is None:
            continue
        try:
            return bool(source.is_cancelled())
        except Exception:
            continue
    return False


# ------------------------------------------------------------------ the served adapters' list
CHECK_INTERVAL_S = 1.0  # how often MultiLoraFile looks at the file and the adapters' files


def multi_lora_path(model_dir: str | Path, version: str) -> Path:
    """Where the vLLM backend (and Triton's OpenAI frontend, to list a model's adapters) look for it."""
    return Path(model_dir) / str(version) / MULTI_LORA_FILE


class MultiLoraFile:
    """The model version's multi_lora.json, re-read and re-applied on its own thread when it or an
    adapter's files change (module docstring)."""

    def __init__(
        self, path: Path, apply: Callable[[dict[str, str]], list[str]], changed: Callable[[], list[str]],
        log: Callable[[str], None],
    ) -> None:  # fmt: skip
        """`apply` makes the engine serve exactly the given adapters and returns the refusals;
        `changed` names the adapters whose files changed since they were read; `log` reports (the
        model's Triton log)."""
        self.path, self._apply, self._changed, self._log = path, apply, changed, log
        self._stamp = self._stat()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="orca-multi-lora", daemon=True)

    def start(self) -> MultiLoraFile:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)

    def _run(self) -> None:
        while not self._stop.wait(CHECK_INTERVAL_S):
            try:
                self.refresh()
            except Exception as e:  # noqa: BLE001 - the watcher outlives any one bad re-read
                self._log(f"{self.path}: re-read failed ({e!r}); the adapters served stay as they were")

    def _stat(self) -> tuple[int, int] | None:
        try:
            info = self.path.stat()
        except OSError:
            return None
        return info.st_mtime_ns, info.st_size

    def refresh(self) -> None:
        """Re-reads the file and re-applies it if it, or some adapter's files, changed."""
        stamp = self._stat()
        changed = self._changed()
        if stamp == self._stamp and not changed:
            return
        self._stamp = stamp
        try:
            adapters = read_multi_lora_json(self.path)
        except ValueError as e:  # a half-written or removed file: the adapters served stay as they were
            self._log(f"{self.path}: not applied ({e})")
            return
        errors = self._apply(adapters)
        for error in errors:
            self._log(f"{self.path}: {error}")
        why = f"the files of {', '.join(changed)} changed" if changed else "it changed"
        self._log(f"{self.path}: re-read ({why}); serving LoRA adapters {sorted(set(adapters))} less {len(errors)} refused")
