"""The engine core: the one loop that schedules, executes and updates, an iteration at a time.

It owns the scheduler, the K/V bookkeeping and the executor, and is driven by a single thread (the
background loop of `run_forever`, or the caller of `step()`). Other threads reach it only through
its inbox (`add_requests`, `abort`), so adding a request never waits for an iteration to end.
Each step returns its `CoreOutputs` (new token ids, finish reasons: core/request.py); turning them into text and
watching for stop strings is the output processor's job, off this thread's critical path.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence

from orca_backend.config import EngineConfig
from orca_backend.core.iteration_log import IterationLog
from orca_backend.core.kv_cache_manager import make_kv_manager
from orca_backend.core.kv_events import make_publisher
from orca_backend.core.request import Request
from orca_backend.core.scheduler import ScheduledBatch, Scheduler
from orca_backend.core.structured_output import StructuredOutputManager
from orca_backend.executor import Executor, WorkerFailure, make_executor
from orca_backend.families import AnyModelConfig
from orca_backend.kv_groups import model_kv_groups
from orca_backend.messages import CoreOutputs, EngineCoreRequest, EngineDeadError, EngineStats, FinishReason

logger = logging.getLogger("orca.engine")
HEARTBEAT_S = 1.0  # an idle loop's frames while grammars compile (the frontend's watchdog needs signs of life)


def resolved_config(config: EngineConfig) -> EngineConfig:
    """The settings left to the engine made concrete: `device="auto"` cuda or cpu, by what this process
    sees (vLLM's default); an unset `async_scheduling` on where it applies on CUDA, off elsewhere."""
    if config.device == "auto":
        import torch

        config = dataclasses.replace(config, device="cuda" if torch.cuda.is_available() else "cpu")
        logger.info("device auto: %s", config.device)
    if config.async_scheduling is None:
        config = dataclasses.replace(config, async_scheduling=config.device.startswith("cuda") and config.async_applies())
        logger.info("async_scheduling unset: %s (%s)", "on" if config.async_scheduling else "off",
                    "CUDA, one process, iteration-level" if config.async_scheduling
                    else "on only on CUDA, in one process with iteration-level scheduling")  # fmt: skip
    return config


class EngineCore:
    def __init__(self, config: EngineConfig, model_config: AnyModelConfig, executor: Executor | None = None) -> None:
        config = resolved_config(config).with_kv_capacity(model_config)
        self.model_config = model_config
        self.executor = executor if executor is not None else make_executor(config, model_config)
        # The pool the ranks allocated: kv_capacity_tokens, or what gpu_memory_utilization left.
        self.config = config = dataclasses.replace(config, kv_capacity_tokens=self.executor.kv_capacity_tokens)
        self.kv_groups = groups = model_kv_groups(model_config, config)
        self.kv = make_kv_manager(config, groups, groups.num_pages(config.host_kv_blocks(model_config)))
        self.kv_events = make_publisher(config.kv_events())  # the prefix cache's events for routers, or None
        self._inbox: queue.Queue[tuple] = queue.Queue()
        # Structured output: grammars compile on a thread of their own; a finished compile wakes the loop
        # (idle while requests only wait for their grammars) through the inbox. Nothing is built or
        # imported until the first constrained request.
        self.structured = StructuredOutputManager(
            config.tokenizer_path(), model_config.vocab_size, model_config.eos_token_id,
            wake=lambda: self._inbox.put(("wake",)), compile_timeout_s=config.structured_output_compile_timeout_s,
        )  # fmt: skip
        # Batches in flight hold different requests under pipeline parallelism (that many batches' worth
        # may run), the same ones under async scheduling (one step ahead of the other).
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.scheduling == "request", model_config.eos_token_id,
            pipeline_depth=1 if config.async_scheduling else self.executor.max_in_flight,
            max_num_batched_tokens=config.max_num_batched_tokens, priority_aging_s=config.priority_aging_s,
            structured=self.structured, async_scheduling=config.async_scheduling,
            max_loras=config.max_loras if config.enable_lora else 0, pooling=config.pooling_config(),
            speculative=config.speculative(),
        )  # fmt: skip
        self._in_flight: deque[ScheduledBatch] = deque()
        # Taken by add_requests and by _die: a request is either refused or failed, never lost.
        self._inbox_lock = threading.Lock()
        self._stopping = False
        self._pinged = False  # a health check asked for a frame (ping())
        self.dead_reason: str | None = None
        self.num_iterations = 0
        self.last_iteration_seconds = 0.0
        self.max_batches_in_flight = 0
        # Iterations by how their forward ran: "cuda_graph", or why it ran eagerly (SamplerOutput.step_path).
        self.steps_by_path: dict[str, int] = {}
        self._failed_in_a_row = 0  # the failure budget's count (config.max_consecutive_failed_iterations)
        self.iteration_log = IterationLog(config.iteration_log) if config.iteration_log else None
        self._logged = (0, 0, 0)  # generated tokens, preemptions, prefix-cache hit tokens at the last line

    # ----------------------------------------------------------------- any thread
    def add_requests(self, requests: Sequence[EngineCoreRequest]) -> None:
        """Queues validated requests; in request-level mode requests added together are admitted together."""
        with self._inbox_lock:
            if self.dead_reason is not None:
                raise EngineDeadError(f"the engine is not serving: {self.dead_reason}")
            self._inbox.put(("add", [Request.from_core_request(r) for r in requests]))

    def abort(self, request_id: str, reason: FinishReason = FinishReason.CANCELLED) -> None:
        """Ends the request with `reason` and frees its K/V; unknown or finished ids are ignored."""
        self._inbox.put(("abort", request_id, FinishReason(reason)))

    def ping(self) -> None:
        """Asks the loop for a frame (an idle engine's health check): the loop answers from its own
        thread, so an answer shows the loop is not wedged, not only that a reader thread runs."""
        self._inbox.put(("ping",))

    def stop(self) -> None:
        self._stopping = True
        self._inbox.put(("stop",))

    @property
    def kv_capacity_tokens(self) -> int:
        return self.config.kv_capacity_tokens

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting) + self.scheduler.num_compiling,
            num_running=len(self.scheduler.running),
            kv_used_tokens=self.kv.used_tokens,
            kv_capacity_tokens=self.kv.capacity_tokens,
            num_iterations=self.num_iterations,
            num_generated_tokens=self.scheduler.num_generated_tokens,
            last_iteration_seconds=self.last_iteration_seconds,
            max_batches_in_flight=self.max_batches_in_flight,
            kv_used_blocks=self.kv.used_blocks,
            kv_num_blocks=self.kv.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens_computed=self.scheduler.num_prompt_tokens_computed,
            prefix_cache_queried_tokens=self.kv.prefix_queried_tokens,
            prefix_cache_hit_tokens=self.kv.prefix_hit_tokens,
            kv_host_num_blocks=self.kv.host.num_blocks if self.kv.host is not None else 0,
            kv_host_used_blocks=self.kv.host.num_held + self.kv.host.num_cached if self.kv.host is not None else 0,
            kv_swapped_out_blocks=self.kv.swapped_out_blocks,
            kv_swapped_in_blocks=self.kv.swapped_in_blocks,
            kv_host_hit_blocks=self.kv.host_hit_blocks,
            steps_by_path=dict(self.steps_by_path),
            spec_num_drafts=self.scheduler.num_spec_drafts,
            spec_num_draft_tokens=self.scheduler.num_spec_draft_tokens,
            spec_num_accepted_tokens=self.scheduler.num_spec_accepted_tokens,
            spec_accepted_per_pos=list(self.scheduler.spec_accepted_per_pos),
            **self._lora_stats(),
        )

    def _lora_stats(self) -> dict[str, object]:
        """The adapters of the running and the waiting requests (vLLM's lora_requests_info)."""
        loras = self.scheduler.loras
        if loras is None:
            return {}
        waiting = sorted({r.lora.name for r in self.scheduler.waiting if r.lora is not None})
        return {"max_loras": loras.max_loras, "running_lora_adapters": ",".join(loras.running_names()),
                "waiting_lora_adapters": ",".join(waiting), "lora_loads": loras.num_loads}  # fmt: skip

    # ------------------------------------------------------------------ core thread
    def has_work(self) -> bool:
        """Requests to run or waiting for their grammar, batches to collect (aborted requests' K/V is
        freed then) or inbox items."""
        return (self.scheduler.has_work() or bool(self._in_flight) or not self._inbox.empty()
                or self.scheduler.num_compiling > 0)  # fmt: skip

    def wait_for_grammars(self, timeout_s: float = 1.0) -> CoreOutputs:
        """For a caller driving `step()` in a loop (the offline LLM): takes in the inbox, then, with nothing
        to run but requests waiting for their grammars, waits (up to `timeout_s`) until every one has
        compiled, instead of spinning. Requests added together then start together, in arrival order,
        whatever each compile took. Returns the outputs of the aborts taken in."""
        outputs = self._drain_inbox(block=False)
        if self.scheduler.num_compiling and not (self.scheduler.has_work() or self._in_flight):
            self.structured.wait(timeout_s)
        return outputs

    def step(self) -> CoreOutputs:
        """One iteration: take in new requests and aborts, schedule, run the model, update; then the
        K/V events the iteration made go out as one batch.

        With pipeline parallelism it first fills the pipeline (up to one batch per stage, each of
        requests not already in flight), then waits for the oldest batch only.
        """
        outputs = self._step()
        if self.kv_events is not None:
            events = self.kv.pool.take_events()
            if events:
                self.kv_events.publish(events)
        return outputs

    def _step(self) -> CoreOutputs:
        outputs = self._drain_inbox(block=False)
        if self.dead_reason is not None:
            return outputs
        outputs += self.scheduler.expire()
        outputs += self.scheduler.take_compiled()
        while self.executor.num_in_flight < self.executor.max_in_flight:
            batch = self.scheduler.schedule()
            if batch is None:
                break
            assert batch.output is not None
            self.executor.submit(batch.output)
            self._in_flight.append(batch)
            self.max_batches_in_flight = max(self.max_batches_in_flight, len(self._in_flight))
        if not self._in_flight:
            return outputs
        batch = self._in_flight.popleft()
        started = time.perf_counter()
        try:
            sampled = self.executor.collect_oldest()
        except WorkerFailure as exc:
            outputs += self._die(f"a model worker failed: {exc}")
            return outputs
        except Exception as exc:  # a failed forward ends only the request that fails alone; a run of them, the engine
            logger.exception("iteration failed; %s", "ending its request" if len(batch.requests) == 1
                             else f"re-running its {len(batch.requests)} requests in halves to find the one that fails")
            outputs += self._discard_later_batches()
            outputs += self.scheduler.fail_batch(batch, f"model execution failed: {exc}")
            # The budget is for failures bisection cannot attribute (a sticky device error fails every
            # fresh batch): the re-runs that narrow a failure down to its request never spend it, so
            # any number of poison requests fail alone while the engine goes on.
            self._failed_in_a_row += not batch.rerun
            budget = self.config.max_consecutive_failed_iterations
            if budget and self._failed_in_a_row >= budget:
                outputs += self._die(f"{self._failed_in_a_row} iterations in a row failed; the last: {exc}")
            return outputs
        self._failed_in_a_row = 0
        if sampled.lora_failures:  # never a failed iteration: the adapter's requests end, the rest go on
            outputs += self.scheduler.fail_adapters(sampled.lora_failures)
        updated = self.scheduler.update_from_output(batch, sampled.token_ids, sampled.logprobs,
                                                    sampled.prompt_logprobs, sampled.pooled,
                                                    sampled.num_accepted, sampled.spec_logprobs,
                                                    sampled.spec_tokens)  # fmt: skip
        self.num_iterations += 1
        self.last_iteration_seconds = time.perf_counter() - started
        self.steps_by_path[sampled.step_path] = self.steps_by_path.get(sampled.step_path, 0) + 1
        if self.iteration_log is not None:
            self._log_iteration(batch, sampled.step_path)
        outputs += updated
        return outputs

    def _discard_later_batches(self) -> CoreOutputs:
        """Async scheduling: the batches submitted after a failed one ran on its tokens; their results
        are dropped (collected, so the executor holds nothing) and their requests untouched."""
        outputs = CoreOutputs()
        while self._in_flight:
            later = self._in_flight.popleft()
            try:
                self.executor.collect_oldest()
            except WorkerFailure as exc:
                outputs += self._die(f"a model worker failed: {exc}")
            except Exception:  # noqa: BLE001 - it ran on a failed step's tokens: its own error says nothing more
                pass
            self.scheduler.discard_batch(later)
        return outputs

    def _log_iteration(self, batch: ScheduledBatch, step_path: str) -> None:
        """One line of the iteration log: what this iteration did, and what happened since the last."""
        s, kv = self.scheduler, self.kv
        totals = (s.num_generated_tokens, s.num_preemptions, kv.prefix_hit_tokens)
        generated, preemptions, hits = (now - before for now, before in zip(totals, self._logged, strict=True))
        self._logged = totals
        self.iteration_log.record({
            "time": time.time(), "iteration": self.num_iterations, "seconds": self.last_iteration_seconds,
            "requests": len(batch.requests), "decode_tokens": batch.num_decodes,
            "prompt_tokens": batch.num_tokens - batch.num_decodes, "generated_tokens": generated,
            "running": len(s.running), "waiting": len(s.waiting) + s.num_compiling,
            "kv_blocks_used": kv.used_blocks, "kv_blocks_free": kv.num_blocks - kv.used_blocks,
            "preemptions": preemptions, "prefix_cache_hit_tokens": hits, "step_path": step_path,
            **self._batch_adapters(batch),
        })  # fmt: skip

    @staticmethod
    def _batch_adapters(batch: ScheduledBatch) -> dict[str, dict[str, int]]:
        """With LoRA: the tokens the iteration ran per adapter ("" for the base model)."""
        if not any(r.lora is not None for r in batch.requests):
            return {}
        tokens: dict[str, int] = {}
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            name = request.lora.name if request.lora is not None else ""
            tokens[name] = tokens.get(name, 0) + num_new
        return {"lora_tokens": tokens}

    def run_forever(self, emit: Callable[[CoreOutputs], None]) -> None:
        """The background loop: iterations while work exists, idle on the inbox otherwise. Every
        step's outputs go to `emit` (which must not block); the last call carries the failure of
        every request if the loop dies."""
        try:
            while not self._stopping:
                idle = not (self.scheduler.has_work() or self._in_flight)
                # Idle with grammars compiling: a finished compile wakes the loop, and a frame at least
                # every second tells the watchdog the loop is alive (it is waiting, not hung).
                compiling = self.scheduler.num_compiling > 0
                outputs = self._drain_inbox(block=True, timeout_s=HEARTBEAT_S if compiling else None) if idle else CoreOutputs()
                iterations = self.num_iterations
                if not self._stopping:
                    outputs += self.step()
                # Every iteration is reported, outputs or not (a prompt chunk has none): the
                # frontend's watchdog takes silence while requests are outstanding as a hang.
                if outputs or self.num_iterations != iterations or (idle and compiling) or self._pinged:
                    self._pinged = False
                    emit(outputs)
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop must reach every waiting client
            logger.exception("engine loop died")
            emit(self._die(f"engine loop crashed: {exc!r}"))

    def shutdown(self) -> CoreOutputs:
        """Stops serving and the executor: every request not finished fails, and later adds are
        refused. Returns the failed requests' outputs."""
        if self.dead_reason is not None:
            return CoreOutputs()
        return self._die("the engine was shut down", expected=True)

    def _drain_inbox(self, block: bool, timeout_s: float | None = None) -> CoreOutputs:
        outputs = CoreOutputs()
        while True:
            try:
                item = self._inbox.get(block=block, timeout=timeout_s if block else None)
            except queue.Empty:
                return outputs
            block = False
            kind = item[0]
            if kind == "add":
                for request in item[1]:
                    outputs += self.scheduler.add(request)
            elif kind == "abort":
                outputs += self.scheduler.finish(item[1], item[2])
            elif kind == "ping":
                self._pinged = True
            elif kind == "stop":
                return outputs
            # "wake": a grammar compiled; step() takes it in

    def _die(self, reason: str, expected: bool = False) -> CoreOutputs:
        (logger.info if expected else logger.error)("engine stops serving: %s", reason)
        with self._inbox_lock:
            self.dead_reason = reason
            self._stopping = True
            outputs = self._drain_inbox(block=False)  # queued adds join the scheduler, and fail below
        self._in_flight.clear()
        outputs += self.scheduler.fail_all(reason)
        self.structured.shutdown()
        self.executor.shutdown()
        if self.kv_events is not None:
            self.kv_events.shutdown()
        if self.iteration_log is not None:
            self.iteration_log.close()
        return outputs
