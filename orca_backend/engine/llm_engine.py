"""The engine front: a thread-safe LLMEngine over the engine core and the output processor.

Callers on any thread validate and add requests (tokenizing happens on the caller's thread) and
get each request's events through a sink or a `RequestStream`. Two ways to run the core:
- `LLMEngine.launch(config)`: in a process of its own (engine/core_client.py), as every served
  model runs it; this process's output thread ("orca-output") detokenizes each iteration's
  outputs, matches stop strings and calls the sinks, which must not block (a queue's put).
- `LLMEngine(config)` + `step()`: in this process, one iteration per call on the caller's thread,
  outputs processed right after it (the offline `LLM` does this).
Validation needs only the config, so a launched engine's process never imports torch.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import operator
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

from orca_backend.config import EngineConfig, check_parallel_layout, pool_capacity_tokens
from orca_backend.engine.core_client import AttachedCore, EngineCoreProcess
from orca_backend.engine.output_processor import Logprob, OutputProcessor, OutputSink, RequestOutput
from orca_backend.kv_groups import model_kv_groups
from orca_backend.lora import LoRARegistry, LoRARequest
from orca_backend.messages import (
    CoreAddress,
    CoreOutputs,
    EngineCoreRequest,
    EngineDeadError,
    EngineOverloadedError,
    EngineStats,
    FinishReason,
)
from orca_backend.sampling_params import POOLING_MODES, PoolingParams, SamplingParams, json_depth
from orca_backend.tokenizer import Tokenizer

if TYPE_CHECKING:
    from orca_backend.core.core_process import CoreHook
    from orca_backend.core.engine_core import EngineCore

__all__ = ["EngineDeadError", "EngineOverloadedError", "EngineStats", "LLMEngine", "Logprob", "OutputSink", "Prompt",
           "RequestOutput", "RequestStream"]

Prompt = str | Sequence[int]
# What an embedding request runs with: its prefill's last step samples one token, which is dropped.
EMBEDDING_PARAMS = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


class RequestStream:
    """Blocking iterator over one request's events, ending after the finished one (with n > 1,
    after every sample's: each event's `index` says whose it is)."""

    # The longest wait for the next event before iteration raises TimeoutError naming the request
    # (None: no bound). The test suite sets one (tests/conftest.py), so an event that never comes
    # fails that test with a message instead of hanging the run.
    wait_timeout_s: float | None = None

    def __init__(self, request_id: str, num_samples: int = 1) -> None:
        self.request_id = request_id
        self.num_samples = num_samples
        self._queue: queue.SimpleQueue[RequestOutput] = queue.SimpleQueue()

    def put(self, output: RequestOutput) -> None:
        self._queue.put(output)

    def __iter__(self) -> Iterator[RequestOutput]:
        unfinished = self.num_samples
        while True:
            try:
                output = self._queue.get(timeout=self.wait_timeout_s)
            except queue.Empty:
                raise TimeoutError(f"request {self.request_id}: no event for {self.wait_timeout_s:g} s "
                                   "(RequestStream.wait_timeout_s)") from None
            yield output
            unfinished -= output.finished
            if not unfinished:
                return


class _SampleSink:
    """Where one sample of a request with n > 1 sends its events: to the request's sink, as the
    request's (its id) with the sample's `index`. The last sample to finish retires the request's id."""

    def __init__(self, request_id: str, index: int, sink: OutputSink, group: _SampleGroup) -> None:
        self.request_id, self.index, self.sink, self.group = request_id, index, sink, group

    def __call__(self, output: RequestOutput) -> None:
        output.request_id, output.index = self.request_id, self.index
        if output.finished:
            self.group.finished(self.index, output.finish_reason)
        self.sink(output)


# A sample ending so fails its request: the other samples are cancelled rather than run on for nothing.
_FAILED = frozenset({FinishReason.ERROR, FinishReason.TIMEOUT, FinishReason.INVALID})


class _SampleGroup:
    """The samples of one request with n > 1 (their ids in the core), until the last one finished."""

    def __init__(self, sample_ids: list[str], retire: Callable[[], None], abort: Callable[[str], None]) -> None:
        self.sample_ids = sample_ids
        self._unfinished = len(sample_ids)
        self._retire = retire
        self._abort = abort
        self._failed = False

    def finished(self, index: int, reason: FinishReason | None) -> None:
        self._unfinished -= 1
        if reason in _FAILED and not self._failed and self._unfinished:
            self._failed = True
            for other, sample in enumerate(self.sample_ids):
                if other != index:
                    self._abort(sample)  # a finished one is ignored
        if not self._unfinished:
            self._retire()


def sample_id(request_id: str, index: int) -> str:
    """The id of sample `index` of a request with n > 1, in the core (vLLM's naming)."""
    return f"{index}_{request_id}"


class LLMEngine:
    def __init__(self, config: EngineConfig, *, core_process: bool = False, core_hook: CoreHook | None = None,
                 listen: CoreAddress | None = None, attach_to: CoreAddress | None = None) -> None:  # fmt: skip
        """The core runs in this process, with `core_process` in its own (prefer `launch`), or with
        `attach_to` in one another engine launched (prefer `attach`)."""
        self.model_config = config.model_config()
        self.config = config = config.with_kv_capacity(self.model_config)
        check_parallel_layout(self.model_config, config.tensor_parallel_size, config.pipeline_parallel_size)
        if config.max_model_len > self.model_config.max_context:
            raise ValueError(f"max_model_len={config.max_model_len} exceeds the model's context of "
                             f"{self.model_config.max_context} tokens")  # fmt: skip
        self.max_model_len = config.max_model_len or self.model_config.max_context
        self.kv_groups = model_kv_groups(self.model_config, config)  # what a request holds of the pool
        tokenizer_path = config.tokenizer_path()
        self.tokenizer = Tokenizer(tokenizer_path) if tokenizer_path else None
        if self.tokenizer and self.tokenizer.vocab_size > self.model_config.vocab_size:
            raise ValueError(
                f"tokenizer {tokenizer_path} has {self.tokenizer.vocab_size} tokens, more than the model's "
                f"vocabulary of {self.model_config.vocab_size}"
            )
        self.pooling_config = config.pooling_config()  # how embedding requests are pooled
        self.outputs = OutputProcessor(self.tokenizer, config.max_queued_requests, config.max_queued_prompt_tokens)
        # Multi-LoRA: the adapters requests may name (orca_backend/lora.py), each checked as it is added.
        self.loras: LoRARegistry | None = None
        self._loras_lock = threading.Lock()
        if config.enable_lora:
            self.loras = LoRARegistry(self.model_config, config.max_lora_rank, config.lora_allowed_dir)
            for name, path in config.lora_modules.items():
                self.loras.add(name, path)
        self._seeds = random.Random(config.seed)  # seeds of requests that bring none
        self._seeds_lock = threading.Lock()
        self._next_id = itertools.count()
        # Requests with n > 1, by id, until their last sample finished (abort_request ends them all).
        self._groups: dict[str, _SampleGroup] = {}
        self.core: EngineCore | EngineCoreProcess | AttachedCore
        if attach_to is not None:
            self.core = AttachedCore(config, attach_to, self._process, self._core_died)
        elif core_process:
            self.core = EngineCoreProcess(config, self._process, self._core_died, hook=core_hook, listen=listen)
        else:
            from orca_backend.core.engine_core import EngineCore  # this process runs the model: torch and all

            self.core = EngineCore(config, self.model_config)
            if core_hook is not None:
                core_hook(self.core)
        # The pool the core allocated (gpu_memory_utilization sizes it there): what requests must fit.
        self.config = dataclasses.replace(self.config, kv_capacity_tokens=self.core.kv_capacity_tokens)

    @classmethod
    def launch(cls, config: EngineConfig, core_hook: CoreHook | None = None,
               listen: CoreAddress | None = None) -> LLMEngine:  # fmt: skip
        """An engine whose core runs in its own process; returns once the model is loaded there, and
        raises what loading raised. `core_hook` runs in that process on the built core (tests use it).
        With `listen`, other engines may `attach` to that core there (several Triton instances of one
        model share one core: core/frontends.py); it stops when this engine does."""
        return cls(config, core_process=True, core_hook=core_hook, listen=listen)

    @classmethod
    def attach(cls, config: EngineConfig, address: CoreAddress) -> LLMEngine:
        """An engine over the core another engine launched with `listen=address` (the same config):
        its own requests, tokenizer and output processing, the launched engine's core. Its shutdown
        detaches (its unfinished requests are aborted); the core's end ends its requests."""
        return cls(config, attach_to=address)

    @property
    def stopped_by_owner(self) -> bool:
        """An attached engine's core was shut down by the engine that launched it (not a failure)."""
        return isinstance(self.core, AttachedCore) and self.core.stopped_by_owner

    # ----------------------------------------------------------------- any thread
    @property
    def healthy(self) -> bool:
        return self.core.dead_reason is None

    @property
    def dead_reason(self) -> str | None:
        return self.core.dead_reason

    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        on_output: OutputSink | None = None, priority: int = 0, timeout_s: float | None = None,
        pooling: PoolingParams | None = None,
    ) -> RequestStream:  # fmt: skip
        return self.add_requests([prompt], [params or SamplingParams()], [request_id], on_output, priority, timeout_s,
                                 [pooling])[0]  # fmt: skip

    def add_requests(
        self,
        prompts: Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams],
        request_ids: Sequence[str | None] | None = None,
        on_output: OutputSink | None = None,
        priority: int | Sequence[int] = 0,
        timeout_s: float | Sequence[float | None] | None = None,
        pooling: PoolingParams | Sequence[PoolingParams | None] | None = None,
    ) -> list[RequestStream]:
        """Validates and queues requests, all or none; in request-level mode they are admitted together.

        Events go to `on_output` (it must not block) or, without one, to the returned streams.
        `priority` (one for all, or one each): lower is served first (default 0; equal priorities are
        first come, first served). `timeout_s` (likewise): the request ends with finish_reason
        "timeout" that long after now, queued or running. `pooling` (likewise; None: generation): an
        embedding request, whose prompt is pooled into one vector (its final event's `embedding`;
        its `params` are not used).
        Raises ValueError for bad input, EngineOverloadedError when the queue limits are reached
        (config.max_queued_requests / max_queued_prompt_tokens) and EngineDeadError once the loop died.
        """
        if self.core.dead_reason is not None:
            raise EngineDeadError(f"the engine is not serving: {self.core.dead_reason}")
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = list(request_ids) if request_ids is not None else [None] * len(prompts)
        if not (len(params_list) == len(ids) == len(prompts)):
            raise ValueError(f"got {len(prompts)} prompts, {len(params_list)} sampling params and {len(ids)} request ids")
        priorities = list(priority) if isinstance(priority, Sequence) else [priority] * len(prompts)
        timeouts = list(timeout_s) if isinstance(timeout_s, Sequence) else [timeout_s] * len(prompts)
        poolings = list(pooling) if isinstance(pooling, Sequence) else [pooling] * len(prompts)
        if not (len(priorities) == len(timeouts) == len(poolings) == len(prompts)):
            raise ValueError(f"got {len(prompts)} prompts, {len(priorities)} priorities, {len(timeouts)} timeouts and "
                             f"{len(poolings)} pooling params")  # fmt: skip
        now = time.monotonic()
        validated = []
        for prompt, p, rid, prio, timeout, pool in zip(prompts, params_list, ids, priorities, timeouts, poolings,
                                                       strict=True):  # fmt: skip
            check_priority(prio, self.config.max_priority)
            check_timeout(timeout)
            if pool is not None:  # an embedding request's params are its own
                self.check_pooling(pool)
                p = EMBEDDING_PARAMS
            rid = rid if rid is not None else f"req-{next(self._next_id)}"
            validated.append((rid, self.validate(prompt, p), p, prio, timeout))
        clash = sorted({rid for rid, *_ in validated if rid in self._groups})
        if clash:
            raise ValueError(f"request id already in use: {clash}")
        streams = [RequestStream(rid, p.n) for rid, _, p, _, _ in validated]
        requests: list[EngineCoreRequest] = []
        sinks: list[OutputSink] = []
        groups: dict[str, _SampleGroup] = {}
        with self._seeds_lock:
            for (rid, prompt_ids, p, prio, timeout), stream, pool in zip(validated, streams, poolings, strict=True):
                sink = on_output or stream.put
                if p.n == 1:
                    seed = p.seed if p.seed is not None else self._seeds.getrandbits(63)
                    requests.append(EngineCoreRequest(rid, prompt_ids, p, now, seed, prio, timeout, self._lora(p),
                                                      pooling=pool))  # fmt: skip
                    sinks.append(sink)
                    continue
                group = groups[rid] = _SampleGroup([sample_id(rid, i) for i in range(p.n)],
                                                   functools.partial(self._groups.pop, rid, None),
                                                   functools.partial(self.core.abort, reason=FinishReason.CANCELLED))  # fmt: skip
                for index, child_id in enumerate(group.sample_ids):
                    # vLLM's derivation: sample i of a seeded request draws with seed + i. Only sample 0
                    # computes the prompt's logprobs (the others compute only its last token).
                    seed = p.seed + index if p.seed is not None else self._seeds.getrandbits(63)
                    child = dataclasses.replace(p, n=1, seed=p.seed if p.seed is None else seed,
                                                prompt_logprobs=p.prompt_logprobs if index == 0 else None)
                    requests.append(EngineCoreRequest(child_id, prompt_ids, child, now, seed, prio, timeout,
                                                      self._lora(p), group.sample_ids[0] if index else None))
                    sinks.append(_SampleSink(rid, index, sink, group))
        new_ids = [r.request_id for r in requests]
        self.outputs.add(new_ids, [r.prompt_ids for r in requests], [r.params for r in requests], sinks,
                         arrival_time=now)  # fmt: skip
        self._groups.update(groups)
        try:
            self.core.add_requests(requests)
        except EngineDeadError:
            self.outputs.discard(new_ids)
            for rid in groups:
                self._groups.pop(rid, None)
            raise
        return streams

    def abort_request(self, request_id: str) -> None:
        """Ends the request (every sample of one with n > 1) with finish_reason "cancelled" and frees
        its K/V; unknown ids are ignored."""
        group = self._groups.get(request_id)
        for core_id in group.sample_ids if group is not None else [request_id]:
            self.core.abort(core_id, FinishReason.CANCELLED)

    def stats(self) -> EngineStats:
        return self.core.stats()

    # ------------------------------------------------------------ validation (caller's thread)
    def validate(self, prompt: Prompt, params: SamplingParams) -> list[int]:
        """The prompt's token ids, or a ValueError saying why this engine would refuse the request."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling params must be SamplingParams, got {type(params).__name__}")
        self._check_stop_strings(params.stop)
        ids = self.prompt_ids(prompt)
        self._check_in_vocabulary(params.stop_token_ids, "stop_token_ids:")
        if params.logit_bias:
            self._check_in_vocabulary(list(params.logit_bias), "logit_bias:")
        self._check_something_can_be_sampled(params)
        self._check_structured_output(params)
        self._lora(params)
        limit = self.config.max_input_tokens
        if limit and len(ids) > limit:
            raise ValueError(f"the prompt has {len(ids)} tokens, more than this deployment's max_input_tokens of {limit}")
        total = len(ids) + params.max_tokens
        if total > self.max_model_len:
            limit = "max_model_len" if self.config.max_model_len else "the model's context length"
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"{limit} of {self.max_model_len} tokens"
            )
        config = self.config
        if not self.kv_groups.fits(total, config.kv_capacity_tokens, config.block_size, config.max_num_batched_tokens):
            capacity = pool_capacity_tokens(config.kv_capacity_tokens, config.block_size)
            raise ValueError(
                f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds "
                f"the K/V capacity of {capacity} tokens; raise kv_capacity_tokens"
            )
        return ids

    # ------------------------------------------------------------------ LoRA adapters
    def add_lora(self, name: str, path: str) -> LoRARequest:
        """Registers a PEFT adapter directory under `name` (again: from another directory); requests may
        name it from now on. ValueError if it is refused (the reason named), or LoRA is off."""
        with self._loras_lock:
            return self._registry().add(name, path)

    def remove_lora(self, name: str) -> None:
        """New requests may no longer name the adapter; those admitted finish with it."""
        with self._loras_lock:
            self._registry().remove(name)

    def sync_loras(self, adapters: dict[str, str]) -> list[str]:
        """Makes the served adapters exactly `adapters` (a re-read multi_lora.json); returns the
        errors of the adapters refused."""
        with self._loras_lock:
            return self._registry().sync(adapters)

    def changed_loras(self) -> list[str]:
        """The adapters whose files changed since they were read (multi_lora.json's watcher re-applies them)."""
        with self._loras_lock:
            return self._registry().changed()

    def list_loras(self) -> list[str]:
        return self.loras.names if self.loras is not None else []

    def _registry(self) -> LoRARegistry:
        if self.loras is None:
            raise ValueError("LoRA is not enabled on this engine (enable_lora)")
        return self.loras

    def _lora(self, params: SamplingParams) -> LoRARequest | None:
        """The adapter a request names, or None; ValueError naming an unknown one."""
        name = params.lora_name
        if name is None:
            return None
        if self.loras is None:
            raise ValueError(f"the request names LoRA adapter {name!r}, but LoRA is not enabled on this model (enable_lora)")
        # No lock: a registration reads whole adapters (seconds for a large one) under it, and one dict
        # read sees either the adapter before or after a change, never a half-made one.
        return self.loras.get(name)

    def check_pooling(self, pooling: PoolingParams) -> None:
        """An embedding request, refused (ValueError) where this model's pooling is one not computed
        here, or its `dimensions` is not a Matryoshka model's (one of the sizes it was trained at,
        where config.json lists them, and no more than its hidden size)."""
        config = self.pooling_config
        if config.mode not in POOLING_MODES:
            raise ValueError(f"this model's sentence-transformers pooling ({config.mode}) is not computed here: "
                             f"embedding requests need one of {', '.join(POOLING_MODES)} (1_Pooling/config.json)")  # fmt: skip
        dims = pooling.dimensions
        if dims is None:
            return
        if not config.matryoshka:
            raise ValueError(f"this model does not support Matryoshka representation (is_matryoshka or "
                             f"matryoshka_dimensions in config.json): dimensions={dims} would give poor embeddings")  # fmt: skip
        if config.matryoshka_dimensions and dims not in config.matryoshka_dimensions:
            raise ValueError(f"dimensions must be one of {list(config.matryoshka_dimensions)}, got {dims}")
        if dims > self.model_config.hidden_size:
            raise ValueError(f"dimensions={dims} exceeds the model's hidden size of {self.model_config.hidden_size}")

    def _check_something_can_be_sampled(self, params: SamplingParams) -> None:
        """Before min_tokens, EOS and the stop ids are banned from sampling (core/stop.py): they
        must leave at least one token, or the sampler would have nothing to draw from."""
        if not params.min_tokens:
            return
        eos = self.model_config.eos_token_id
        banned = set(params.stop_token_ids) | ({eos} if eos is not None and not params.ignore_eos else set())
        if len(banned) >= self.model_config.vocab_size:
            raise ValueError(f"with min_tokens={params.min_tokens}, stop_token_ids and EOS ban every token of the "
                             f"vocabulary ({self.model_config.vocab_size}) until then: nothing could be sampled")

    def _check_structured_output(self, params: SamplingParams) -> None:
        """What a constraint needs of the model; the constraint itself is compiled by the engine core
        (a malformed one ends that request with finish_reason "invalid")."""
        spec = params.structured_outputs
        if spec is None:
            return
        # Bounded before anything compiles: compile time grows steeply with a schema's depth.
        size = sum(len(part.encode()) for part in ((spec.value,) if isinstance(spec.value, str) else spec.value))
        max_bytes, max_depth = self.config.max_structured_output_bytes, self.config.max_structured_output_depth
        if max_bytes and size > max_bytes:
            raise ValueError(f"the structured-output {spec.kind} holds {size} bytes, more than this deployment's "
                             f"max_structured_output_bytes of {max_bytes}")  # fmt: skip
        depth = json_depth(spec.value) if spec.kind == "json" else 0
        if max_depth and depth > max_depth:
            raise ValueError(f"the structured-output JSON schema nests {depth} levels deep, more than this "
                             f"deployment's max_structured_output_depth of {max_depth}")  # fmt: skip
        if self.tokenizer is None:
            raise ValueError("structured output needs the model's tokenizer (tokenizer.json), and this model has none")
        if self.model_config.eos_token_id is None:
            raise ValueError("structured output needs the model's EOS token id (eos_token_id in config.json): a "
                             "complete grammar ends on it, and this model has none")  # fmt: skip

    def _check_stop_strings(self, stop: list[str]) -> None:
        """Before any tokenizing: each stop string is searched for in every new piece of text."""
        if not stop:
            return
        if self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer, and this model has none: use stop_token_ids instead")
        limit, length = self.config.max_stop_sequences, self.config.max_stop_length
        if limit and len(stop) > limit:
            raise ValueError(f"{len(stop)} stop strings, more than this deployment's max_stop_sequences of {limit}")
        longest = max(len(s) for s in stop)
        if length and longest > length:
            raise ValueError(f"a stop string of {longest} characters, longer than this deployment's "
                             f"max_stop_length of {length}")  # fmt: skip

    def prompt_ids(self, prompt: Prompt) -> list[int]:
        """The prompt as token ids: a text tokenized (the one place it is), ids checked against the
        vocabulary; ValueError for an empty prompt or a text without a tokenizer. A frontend that
        needs the ids itself (the served adapters echo the prompt) calls it once and passes the ids on."""
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
        self._check_in_vocabulary(ids, "token id")
        return ids

    def _check_in_vocabulary(self, ids: Sequence[int], what: str) -> None:
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{what} {bad[0]} is outside the model's vocabulary [0, {vocab})")

    # ------------------------------------------------------------------ driving it
    def has_work(self) -> bool:
        return self._in_process_core().has_work()

    def step(self) -> None:
        """One iteration on the caller's thread, outputs processed right after it. While the only
        requests left wait for their structured-output grammars, it first waits for them to compile."""
        core = self._in_process_core()
        outputs = core.wait_for_grammars()
        outputs += core.step()
        self._process(outputs)

    def _in_process_core(self) -> EngineCore:
        if isinstance(self.core, EngineCoreProcess | AttachedCore):
            raise RuntimeError("this engine's core runs in its own process; step() drives an in-process core")
        return self.core

    def _process(self, outputs: CoreOutputs) -> None:
        for request_id in self.outputs.process(outputs):
            self.core.abort(request_id, FinishReason.STOP)

    def _core_died(self, reason: str) -> None:
        """The core process is gone: every request it had not finished ends with an error."""
        self.outputs.fail_all(reason)

    def shutdown(self) -> None:
        """Stops the engine: every request not finished ends with an error, later adds are refused."""
        if not isinstance(self.core, EngineCoreProcess | AttachedCore):
            self._process(self.core.shutdown())
        else:
            self.core.shutdown()  # the output thread then fails what the core process left unfinished


def check_priority(priority: int, max_priority: int) -> None:
    """A priority in [-max_priority, max_priority] (config.max_priority): a bounded range keeps the
    classes few and lets aging close any gap between them in bounded time."""
    if isinstance(priority, bool) or not isinstance(priority, int) or not -max_priority <= priority <= max_priority:
        raise ValueError(f"priority must be an integer in [{-max_priority}, {max_priority}] (lower is served first; "
                         f"this deployment's max_priority is {max_priority}), got {priority!r}")  # fmt: skip


def check_timeout(timeout_s: float | None) -> None:
    if timeout_s is None:
        return
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, int | float) or not (
            math.isfinite(timeout_s) and timeout_s > 0):  # fmt: skip
        raise ValueError(f"timeout_s must be a number of seconds > 0, got {timeout_s!r}")
