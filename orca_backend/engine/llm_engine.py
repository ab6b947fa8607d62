"""The engine: a thread-safe front (add/abort requests, per-request output streams) over one loop
that runs the model an iteration at a time.

Only the thread that drives `step()` (the background loop of `LLMEngine.launch()`, or the caller
of `LLM.generate`) touches the scheduler, the K/V manager and the runner. Other threads talk to it
through an inbox queue, so adding a request never waits for an iteration to end, and the loop
hands outputs to per-request sinks that must not block (a queue's put).
"""

from __future__ import annotations

import itertools
import logging
import operator
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from orca_backend.config import EngineConfig
from orca_backend.engine import detokenizer
from orca_backend.engine.batch import build_batch_meta
from orca_backend.engine.executor import Executor, LocalExecutor, WorkerFailure
from orca_backend.engine.kv_cache import make_kv_manager
from orca_backend.engine.model_runner import ModelRunner
from orca_backend.engine.request import Request, RequestOutput, RequestStatus
from orca_backend.engine.scheduler import ScheduledBatch, Scheduler
from orca_backend.sampling_params import SamplingParams
from orca_backend.tokenizer import Tokenizer

logger = logging.getLogger("orca.engine")

OutputSink = Callable[[RequestOutput], None]
Prompt = str | Sequence[int]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served until the model is reloaded."""


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_used_tokens: int
    kv_capacity_tokens: int
    num_iterations: int
    num_generated_tokens: int
    last_iteration_seconds: float
    max_batches_in_flight: int  # > 1 only with pipeline parallelism


class RequestStream:
    """Blocking iterator over one request's events, ending after the finished one."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        while True:
            output = self._queue.get()
            yield output
            if output.finished:
                return


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.model_config = config.model_config()
        tokenizer_path = config.tokenizer_path()
        self.tokenizer = Tokenizer(tokenizer_path) if tokenizer_path else None
        if self.tokenizer and self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_path} has {self.tokenizer.vocab_size} tokens, more than the model's "
                f"vocabulary of {self.model_config.vocab_size}"
            )
        self.executor = self._make_executor()
        self.kv = make_kv_manager(config.kv_policy, config.kv_capacity_tokens)
        self.scheduler = Scheduler(
            self.kv, config.max_batch_size, config.scheduling == "request", self.model_config.eos_token_id,
            pipeline_depth=self.executor.max_in_flight,
        )  # fmt: skip
        self._in_flight: deque[ScheduledBatch] = deque()
        self._released_ids: list[str] = []  # finished since the last batch: workers drop their sampler state
        self._batch_ids = itertools.count()
        self._seeds = random.Random(config.seed)  # seeds of requests that bring none
        self._inbox: queue.Queue[tuple] = queue.Queue()
        self._sinks: dict[str, OutputSink] = {}
        self._held: list[tuple[OutputSink, RequestOutput]] = []  # request-level mode: released per batch
        self._active_ids: set[str] = set()
        self._ids_lock = threading.Lock()
        self._next_id = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self.dead_reason: str | None = None
        self.num_iterations = 0
        self.num_generated_tokens = 0
        self.last_iteration_seconds = 0.0
        self.max_batches_in_flight = 0

    def _make_executor(self) -> Executor:
        if self.config.tensor_parallel_size * self.config.pipeline_parallel_size == 1:
            return LocalExecutor(ModelRunner(self.config, self.model_config))
        from orca_backend.parallel.workers import WorkerPoolExecutor

        return WorkerPoolExecutor(self.config, self.model_config)

    # ----------------------------------------------------------------- any thread
    @property
    def healthy(self) -> bool:
        return self.dead_reason is None

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        on_output: OutputSink | None = None,
    ) -> RequestStream:  # fmt: skip
        return self.add_requests([prompt], [params or SamplingParams()], [request_id], on_output)[0]

    def add_requests(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams],
        request_ids: Sequence[str | None] | None = None,
        on_output: OutputSink | None = None,
    ) -> list[RequestStream]:
        """Validates and queues requests, all or none; in request-level mode they are admitted together.

        Events go to `on_output` (called on the engine thread; it must not block) or, without one, to
        the returned streams. Raises ValueError for bad input and EngineDeadError once the loop died.
        """
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not serving: {self.dead_reason}")
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        if not (len(params_list) == len(ids) == len(prompts)):
            raise ValueError(f"got {len(prompts)} prompts, {len(params_list)} sampling params and {len(ids)} request ids")
        now = time.perf_counter()
        requests = []
        for prompt, p, rid in zip(prompts, params_list, ids, strict=True):
            rid = rid if rid is not None else f"req-{next(self._next_id)}"
            requests.append(Request(rid, self.validate(prompt, p), p, arrival_time=now))
        with self._ids_lock:
            for r in requests:
                r.sampling_seed = r.params.seed if r.params.seed is not None else self._seeds.getrandbits(63)
            new_ids = [r.request_id for r in requests]
            clash = (set(new_ids) & self._active_ids) or (len(set(new_ids)) != len(new_ids))
            if clash:
                raise ValueError(f"request id already in use: {sorted(clash) if isinstance(clash, set) else new_ids}")
            self._active_ids.update(new_ids)
        streams = [RequestStream(r.request_id) for r in requests]
        sinks = [on_output or s.put for s in streams]
        self._inbox.put(("add", requests, sinks))
        return streams

    def abort_request(self, request_id: str) -> None:
        """Ends the request with finish_reason "cancelled" and frees its K/V; unknown ids are ignored."""
        self._inbox.put(("abort", request_id))

    def stats(self) -> EngineStats:
        return EngineStats(
            num_waiting=len(self.scheduler.waiting),
            num_running=len(self.scheduler.running),
            kv_used_tokens=self.kv.used_tokens,
            kv_capacity_tokens=self.kv.capacity_tokens,
            num_iterations=self.num_iterations,
            num_generated_tokens=self.num_generated_tokens,
            last_iteration_seconds=self.last_iteration_seconds,
            max_batches_in_flight=self.max_batches_in_flight,
        )

    @classmethod
    def launch(cls, config: EngineConfig) -> LLMEngine:
        """Builds an engine on a new background thread and runs its loop there: iterations while work
        exists, idle otherwise. Returns once the model is loaded; a load error is raised here.

        The model loads on the thread that will run it because torch's CPU thread pool (OpenMP) is
        per calling thread: a forward on a second thread, after the loading thread ran parallel ops,
        measured 1.3-1.7x slower here. The caller's thread must keep off torch compute from then on.
        """
        built: queue.Queue[LLMEngine | BaseException] = queue.Queue(maxsize=1)

        def thread_main() -> None:
            try:
                engine = cls(config)
            except BaseException as exc:  # noqa: BLE001 - handed to the caller, who raises it
                built.put(exc)
                return
            engine._thread = threading.current_thread()
            built.put(engine)
            engine._loop()

        threading.Thread(target=thread_main, name="orca-engine", daemon=True).start()
        result = built.get()
        if isinstance(result, BaseException):
            raise result
        return result

    def shutdown(self) -> None:
        self._stopping = True
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.executor.shutdown()

    # ------------------------------------------------------------ validation (caller's thread)
    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a ValueError saying why this engine would refuse the request."""
        request = Request("validate", self._prompt_ids(prompt), params, arrival_time=0.0)
        self._check_fits(request)
        return request.prompt_ids

    def _prompt_ids(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer, and this model has none: send token ids instead")
            ids = self.tokenizer.encode(prompt)
        else:
            try:
                ids = [operator.index(t) for t in prompt]
            except TypeError:
                raise ValueError("a prompt must be a string or a sequence of integer token ids") from None
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token id {bad[0]} is outside the model's vocabulary [0, {vocab})")
        return ids

    def _check_fits(self, request: Request) -> None:
        if not isinstance(request.params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(request.params).__name__}")
        context = self.model_config.n_positions
        if request.max_total_tokens > context:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.params.max_tokens}) exceeds "
                f"the model's context length of {context} tokens"
            )
        if not self.kv.fits_ever(request):
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.params.max_tokens}) exceeds "
                f"the K/V capacity of {self.kv.capacity_tokens} tokens; raise kv_capacity_tokens"
            )

    # ------------------------------------------------------------------ engine thread
    def has_work(self) -> bool:
        return self.scheduler.has_work() or not self._inbox.empty()

    def step(self) -> None:
        """One iteration: take in new requests and aborts, schedule, run the model, emit outputs.

        With pipeline parallelism it first fills the pipeline (up to one batch per stage, each of
        requests not already in flight), then waits for the oldest batch only.
        """
        self._drain_inbox(block=False)
        while self.executor.num_in_flight < self.executor.max_in_flight:
            batch = self.scheduler.schedule()
            if batch is None:
                break
            released, self._released_ids = self._released_ids, []
            meta = build_batch_meta(batch, next(self._batch_ids), self.model_config.eos_token_id, released)
            self.executor.submit(meta)
            self._in_flight.append(batch)
            self.max_batches_in_flight = max(self.max_batches_in_flight, len(self._in_flight))
        if not self._in_flight:
            return
        batch = self._in_flight.popleft()
        started = time.perf_counter()
        try:
            sampled = self.executor.collect_oldest()
        except WorkerFailure as exc:
            self._in_flight.appendleft(batch)
            self._die(f"a model worker failed: {exc}")
            return
        except Exception as exc:  # a failed forward ends its batch, never the engine
            logger.exception("iteration failed; ending its %d requests", len(batch.requests))
            for request in batch.requests:
                request.in_flight = False
                self._finish(request, "error", f"model execution failed: {exc}")
            self._release_held()
            return
        updated = self.scheduler.update_from_output(batch, sampled)
        now = time.perf_counter()
        self.num_iterations += 1
        self.num_generated_tokens += len(updated)
        self.last_iteration_seconds = now - started
        for request in updated:
            self._update_text(request)
            self._emit(request, now)
        self._release_held()

    def _loop(self) -> None:
        try:
            while not self._stopping:
                if not self.scheduler.has_work():
                    self._drain_inbox(block=True)
                if not self._stopping:
                    self.step()
        except BaseException as exc:  # noqa: BLE001 - whatever killed the loop must reach every waiting client
            logger.exception("engine loop died")
            self._die(f"engine loop crashed: {exc!r}")

    def _drain_inbox(self, block: bool) -> None:
        while True:
            try:
                item = self._inbox.get(block=block)
            except queue.Empty:
                return
            block = False
            kind = item[0]
            if kind == "add":
                for request, sink in zip(item[1], item[2], strict=True):
                    detokenizer.start_offsets(request)
                    self._sinks[request.request_id] = sink
                    self.scheduler.add(request)
            elif kind == "abort":
                request = self.scheduler.find(item[1])
                if request is not None:
                    self._finish(request, "cancelled")
                    self._release_held()
            elif kind == "stop":
                return

    def _update_text(self, request: Request) -> None:
        if self.tokenizer is None:
            return
        detokenizer.update_text(self.tokenizer, request, final=request.finished)
        stop_at = detokenizer.find_stop(request)
        if stop_at is not None:
            request.text = request.text[:stop_at]
            if request.finished:
                request.finish_reason = "stop"
            else:
                self.scheduler.finish(request, "stop")

    def _finish(self, request: Request, reason: str, error: str | None = None) -> None:
        self.scheduler.finish(request, reason)
        self._emit(request, time.perf_counter(), error)

    def _emit(self, request: Request, now: float, error: str | None = None) -> None:
        # Runs for every request in every iteration: kept to plain attribute reads.
        output_ids = request.output_ids
        num_output = len(output_ids)
        new_ids = output_ids[request.sent_ids_len :]
        request.sent_ids_len = num_output
        new_text = ""
        if request.text:
            new_text = detokenizer.releasable_text(request)
            request.sent_text_len += len(new_text)
        finished = request.status is RequestStatus.FINISHED
        output = RequestOutput(
            request.request_id, new_ids, new_text, finished, request.finish_reason, len(request.prompt_ids),
            num_output, now, error,
        )  # fmt: skip
        rid = request.request_id
        sink = self._sinks[rid]
        if finished:
            del self._sinks[rid]
            self._released_ids.append(rid)
            with self._ids_lock:
                self._active_ids.discard(rid)
        if self.scheduler.request_level:
            self._held.append((sink, output))
        else:
            sink(output)

    def _release_held(self) -> None:
        """Request-level mode answers a batch only once its last request is done."""
        if self._held and not self.scheduler.running:
            held, self._held = self._held, []
            now = time.perf_counter()
            for sink, output in held:
                output.time = now  # the moment the client can see it, as for every other event
                sink(output)

    def _die(self, reason: str) -> None:
        logger.error("engine stops serving: %s", reason)
        self.dead_reason = reason
        self._stopping = True
        self._drain_inbox(block=False)
        self._in_flight.clear()
        for request in list(self.scheduler.running) + list(self.scheduler.waiting):
            request.in_flight = False
            self._finish(request, "error", reason)
        held, self._held = self._held, []
        for sink, output in held:
            sink(output)
        self.executor.shutdown()
