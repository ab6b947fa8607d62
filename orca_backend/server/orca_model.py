"""The `orca` model: a decoupled Python-backend adapter in front of the iteration-level engine.

The engine core runs in a process of its own (it schedules, runs the model, updates); in this stub
process three threads meet:
- Triton's execute() thread parses and validates each request, hands it to the engine and returns
  at once (nothing waits for tokens);
- the engine's output thread receives one frame per iteration, detokenizes and reports every event
  through `on_output`, which only puts it on a queue, so it never blocks on Triton;
- the response thread (this module) drains that queue and answers each touched request once per
  drain, merging the tokens that arrived since its last response (a lagging sender sends fewer,
  larger responses, never fewer tokens; `stream_interval` asks for that deliberately), polls
  cancellation and watches engine health (metrics have their own poller).
Who removes a request from `_pending` owns its sender's final response: no double finals.
"""

from __future__ import annotations

import itertools
import math
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import triton_python_backend_utils as pb_utils

from orca_backend.config import parameter_values
from orca_backend.server.adapter import EngineAdapter, is_cancelled
from orca_backend.server.protocol import (
    EngineUnavailable,
    ResponseBuilder,
    SamplesResponseBuilder,
    error_response,
    finished_request,
    make_response,
    read_request,
    request_failure,
    response_builder,
)

CANCEL_POLL_S = 0.1  # how often a slice of the pending requests is asked whether their client cancelled
# is_cancelled() is an IPC round trip to tritonserver: each pending request is asked about once per
# CANCEL_CHECK_PERIOD_S (a cancelled request computes at most that long), never more than
# CANCEL_CHECKS_PER_POLL per poll, so asking costs O(streams) round trips a second, not O(streams x polls).
CANCEL_CHECK_PERIOD_S = 1.0
CANCEL_CHECKS_PER_POLL = 64
HEALTH_POLL_S = 0.1
MAX_DRAIN = 8192  # events taken from the queue before responses go out


@dataclass
class _Pending:
    request_id: str
    request: Any
    sender: Any
    builder: ResponseBuilder | SamplesResponseBuilder
    abort_requested: bool = False


class OrcaModel(EngineAdapter):
    """TritonPythonModel for model_repository/orca (decoupled, max_batch_size 0)."""

    scheduling = "iteration"
    adapter_parameters = frozenset({"stream_interval"})

    def check_triton_config(self) -> None:
        if not pb_utils.using_decoupled_model_transaction_policy(self.triton_config):
            raise pb_utils.TritonModelException(
                f"{self.model_name}: set model_transaction_policy {{ decoupled: true }} in config.pbtxt; "
                "the orca adapter streams tokens as the engine produces them"
            )
        if int(self.triton_config.get("max_batch_size", 0)) != 0:
            raise pb_utils.TritonModelException(
                f"{self.model_name}: max_batch_size must be 0 — the engine batches; set max_num_seqs "
                "in `parameters` instead"
            )
        self.stream_interval = stream_interval_parameter(self.triton_config)  # before the engine starts

    def initialize(self, args: dict[str, str]) -> None:
        self._events: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()
        self._ids = itertools.count()
        self._dead_reason: str | None = None
        self._cancel_cursor = 0
        self._stopping = threading.Event()
        super().initialize(args)
        self._id_prefix = f"{args.get('model_instance_name', '')}/" if self.instances > 1 else ""
        self._thread = threading.Thread(target=self._response_loop, name="orca-responses", daemon=True)
        self._thread.start()

    # ---- Triton's thread -------------------------------------------------------------------
    def execute(self, requests: list[Any]) -> None:
        for request in requests:
            sender = request.get_response_sender()
            try:
                self._submit(request, sender)
            except Exception as exc:  # the request alone fails; the engine and other requests go on
                _send_final(sender, error_response(exc))
        return None

    def _submit(self, request: Any, sender: Any) -> None:
        if self._dead_reason is not None:
            raise EngineUnavailable(self._dead_reason)
        parsed = read_request(request, self.engine.config)
        prompt_ids = self.engine.prompt_ids(parsed.prompt)  # the prompt's one tokenizing
        builder = response_builder(parsed, prompt_ids, self.tokenizer, stream=parsed.stream,
                                   stream_interval=self.stream_interval)  # fmt: skip
        # Client ids need not be unique; ours must be, across the instances that share the engine core.
        request_id = f"{request.request_id() or 'req'}#{self._id_prefix}{next(self._ids)}"
        pending = _Pending(request_id, request, sender, builder)
        # Registered before the engine sees it: its first event may come before add_request returns.
        with self._lock:
            self._pending[request_id] = pending
        try:
            self.engine.add_request(prompt_ids, parsed.params, request_id=request_id, on_output=self._events.put,
                                    priority=parsed.priority, timeout_s=parsed.timeout_s, pooling=parsed.pooling)  # fmt: skip
        except Exception:
            with self._lock:
                owned = self._pending.pop(request_id, None) is not None
            if owned:
                raise
            # The response thread already answered it (engine died meanwhile).

    # ---- response thread -------------------------------------------------------------------
    def _response_loop(self) -> None:
        last_cancel = last_health = 0.0
        while not self._stopping.is_set():
            try:
                events = [self._events.get(timeout=0.02)]
            except queue.Empty:
                events = []
            while events and len(events) < MAX_DRAIN:
                try:
                    events.append(self._events.get_nowait())
                except queue.Empty:
                    break
            try:
                self._deliver(events)
                now = time.monotonic()
                if now - last_cancel >= CANCEL_POLL_S:
                    last_cancel = now
                    self._poll_cancelled()
                if now - last_health >= HEALTH_POLL_S:
                    last_health = now
                    self._check_health()
            except Exception as exc:  # never let one bad send end the thread that serves everyone
                pb_utils.Logger.log_error(f"{self.model_name}: response thread: {type(exc).__name__}: {exc}")

    def _deliver(self, events: list[Any]) -> None:
        touched: dict[str, _Pending] = {}
        for event in events:
            pending = self._pending.get(event.request_id)
            if pending is None:  # already answered (error, engine death)
                continue
            pending.builder.add(event)
            touched[event.request_id] = pending
        for request_id, pending in touched.items():
            if pending.builder.ready:
                try:
                    self._respond(request_id, pending)
                except Exception as exc:  # e.g. an output that cannot be built: fail this request only
                    with self._lock:
                        owned = self._pending.pop(request_id, None) is not None
                    if owned:
                        _send_final(pending.sender, error_response(exc))
                        self._abort(pending)

    def _respond(self, request_id: str, pending: _Pending) -> None:
        builder = pending.builder
        if not builder.finished:
            if not _send(pending.sender, make_response(builder.flush())) and not pending.abort_requested:
                self._abort(pending)  # nobody can receive this stream any more: stop generating it
            return
        with self._lock:
            if self._pending.pop(request_id, None) is None:
                return
        self.metrics.request_finished(finished_request(builder))
        self._send_last(pending)

    def _send_last(self, pending: _Pending) -> None:
        """The request's one final response, whatever goes wrong: one that cannot be built or sent
        is replaced by an error (a client that has gone away gets nothing, and needs nothing)."""
        builder = pending.builder
        try:
            if builder.error is not None:
                response = error_response(request_failure(builder.error, self.engine.healthy, builder.finish_reason))
            else:
                response = make_response(builder.flush())
        except Exception as exc:
            response = error_response(exc)
        if not _send_final(pending.sender, response) and not _send_final(
                pending.sender, error_response(RuntimeError("the final response could not be sent"))):  # fmt: skip
            pb_utils.Logger.log_warn(f"{self.model_name}: {pending.request_id}: no final response could be sent "
                                     "(the client is gone)")  # fmt: skip

    def _poll_cancelled(self) -> None:
        """Checks a round-robin slice of the pending requests.

        Sending to a cancelled request does not fail, so cancellation is only seen by asking,
        and each question is an IPC round trip: the slice covers everyone once per
        CANCEL_CHECK_PERIOD_S, and a cap keeps a large crowd from starving sends.
        """
        with self._lock:
            request_ids = list(self._pending)
        if not request_ids:
            return
        start = self._cancel_cursor % len(request_ids)
        size = min(CANCEL_CHECKS_PER_POLL, math.ceil(len(request_ids) * CANCEL_POLL_S / CANCEL_CHECK_PERIOD_S))
        chosen = (request_ids[start:] + request_ids[:start])[:size]
        self._cancel_cursor = start + len(chosen)
        for request_id in chosen:
            pending = self._pending.get(request_id)
            if pending is not None and not pending.abort_requested and is_cancelled(pending.request, pending.sender):
                self._abort(pending)

    def _abort(self, pending: _Pending) -> None:
        # The engine ends it with a final "cancelled" event and frees its K/V; that event's
        # response releases the request inside Triton.
        pending.abort_requested = True
        pb_utils.Logger.log_info(f"{self.model_name}: {pending.request_id}: cancelled by the client; aborting")
        try:
            self.engine.abort_request(pending.request_id)
        except Exception as exc:
            pb_utils.Logger.log_warn(f"{self.model_name}: abort {pending.request_id}: {exc}")

    def _check_health(self) -> None:
        if self._dead_reason is not None or self.engine.healthy:
            return
        if self.engine.stopped_by_owner:  # the instance that owns the core is unloading the model
            self._dead_reason = "the model is being unloaded"
            self._fail_all(EngineUnavailable(self._dead_reason))
            return
        self._dead_reason = self.engine_stopped_message("the model is being unloaded")
        pb_utils.Logger.log_error(f"{self.model_name}: {self._dead_reason}")
        self._fail_all(EngineUnavailable(self._dead_reason))
        # Triton 2.51's Python backend has no readiness hook: unloading (explicit model control,
        # as orca-serve runs it) makes /v2/models/<name>/ready fail. From its own thread, since
        # unloading calls finalize(), which waits for this one. One instance asks, never several:
        # unload requests from the stubs of the model being unloaded can deadlock Triton's unload.
        if self.leads_unload():
            threading.Thread(target=self._unload_self, name="orca-unload", daemon=True).start()

    def _unload_self(self) -> None:
        try:
            pb_utils.unload_model(self.model_name)
        except Exception as exc:
            pb_utils.Logger.log_error(
                f"{self.model_name}: could not unload itself ({exc}); the model stays loaded but answers "
                "UNAVAILABLE — restart the server (run tritonserver with --model-control-mode=explicit)"
            )

    def _fail_all(self, exc: BaseException) -> None:
        with self._lock:
            failed = list(self._pending.values())
            self._pending.clear()
        for pending in failed:
            _send_final(pending.sender, error_response(exc))

    def finalize(self) -> None:
        if self._dead_reason is None:
            self._dead_reason = "the model is shutting down"
        self._stopping.set()
        self._thread.join(timeout=10)
        super().finalize()
        self._fail_all(EngineUnavailable(self._dead_reason))


def stream_interval_parameter(triton_config: dict[str, Any]) -> int:
    """The `stream_interval` parameter: tokens per streamed response after the first (default 1)."""
    value = parameter_values(triton_config.get("parameters", {}) or {}).get("stream_interval", "") or "1"
    if not value.isdigit() or int(value) < 1:
        raise pb_utils.TritonModelException(f"parameter stream_interval must be an integer >= 1, got {value!r}")
    return int(value)


def _send(sender: Any, response: Any, flags: int = 0) -> bool:
    try:
        sender.send(response, flags=flags)
        return True
    except Exception:  # the client went away, or Triton already released the request
        return False


def _send_final(sender: Any, response: Any) -> bool:
    return _send(sender, response, flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)
