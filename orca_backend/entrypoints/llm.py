"""The offline API: `LLM(...).generate(prompts, params)` runs the engine in the caller's thread.

An LLM owns its engine, and with tp x pp > 1 its worker processes or Ray actors: `shutdown()`, the
end of a `with LLM(...) as llm:` block, the LLM being garbage collected, or the interpreter exiting,
whichever comes first, stops them.
"""

from __future__ import annotations

import dataclasses
import weakref
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine, Prompt, RequestOutput
from orca_backend.engine.output_processor import Logprob
from orca_backend.messages import FinishReason
from orca_backend.sampling_params import PoolingParams, SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    num_input_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None when the model has no tokenizer
    finish_reason: FinishReason | None = None  # LENGTH, STOP or TIMEOUT (others raise: see LLM.generate)
    event_times: list[float] = field(default_factory=list)  # one per output event, the last is the finish
    # With SamplingParams.logprobs set (else None): one dict per output token, and their sum.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # With SamplingParams.prompt_logprobs set (else None): None for the first prompt token, then one
    # dict per prompt token (RequestOutput.prompt_logprobs).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    index: int = 0  # the sample, with n > 1
    # With n > 1: every sample, in order (this output's own fields are sample 0's); else None.
    samples: list[CompletionOutput] | None = None

    @property
    def finish_time(self) -> float:
        return self.event_times[-1]

    @property
    def first_token_time(self) -> float:
        return self.event_times[0]


@dataclass
class EmbeddingOutput:
    request_id: str
    num_input_tokens: int
    embedding: list[float]  # pooled as the checkpoint says, cut to `dimensions`, normalised where it says


class LLM:
    def __init__(
        self,
        model: str = "gpt2-tiny",
        *,
        tokenizer: str | None = None,
        device: str = "cpu",
        dtype: str = "float32",
        max_num_seqs: int = 32,
        kv_capacity_tokens: int = 16384,
        **engine_options: Any,
    ) -> None:
        config = EngineConfig(
            model=model, tokenizer=tokenizer, device=device, dtype=dtype, max_num_seqs=max_num_seqs,
            kv_capacity_tokens=kv_capacity_tokens, **engine_options,
        )  # fmt: skip
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer
        # Holds the engine, never the LLM (which it would keep alive): runs once, on shutdown(), when the
        # LLM is collected, or at interpreter exit.
        self._finalizer = weakref.finalize(self, self.engine.shutdown)

    def shutdown(self) -> None:
        """Stops the engine and its workers; later generate() calls raise. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        `prompts` is a string, a list of token ids, or a list of either; `params` one SamplingParams
        for all or one per prompt. Bad input raises ValueError before anything runs (a structured-output
        constraint that does not compile included); a request the engine failed raises RuntimeError.
        """
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # a single prompt
        params = params if params is not None else SamplingParams()
        for p in [params] if isinstance(params, SamplingParams) else params:
            spec = getattr(p, "structured_outputs", None)  # not SamplingParams: add_requests says so
            if spec is not None:
                # In this process the core's own check (ms, no tokenizer needed) can refuse a malformed
                # constraint before anything runs; a served engine ends such a request "invalid" instead.
                from orca_backend.core.structured_output import grammar_for

                grammar_for(spec)
        events: dict[str, list[RequestOutput]] = {}

        def collect(output: RequestOutput) -> None:
            events.setdefault(output.request_id, []).append(output)

        streams = self.engine.add_requests(list(prompts), params, on_output=collect)
        while any(sum(e.finished for e in events.get(s.request_id, ())) < s.num_samples for s in streams):
            self.engine.step()
        while self.engine.has_work():  # aborts of requests a stop string ended: their K/V is freed now
            self.engine.step()
        return [self._request_output(events[s.request_id], s.num_samples) for s in streams]

    def embed(self, prompts: Prompt | Sequence[Prompt], pooling: PoolingParams | None = None) -> list[EmbeddingOutput]:
        """Each prompt's embedding (vLLM's `LLM.embed`), in input order: its prompt's final hidden
        states pooled as the checkpoint's sentence-transformers config says (default: the last token,
        L2-normalised). A request the engine failed raises RuntimeError."""
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        events: dict[str, RequestOutput] = {}
        streams = self.engine.add_requests(list(prompts), SamplingParams(), on_output=lambda e: events.__setitem__(
            e.request_id, e), pooling=pooling or PoolingParams())  # fmt: skip
        while any(s.request_id not in events for s in streams):
            self.engine.step()
        outputs = []
        for s in streams:
            event = events[s.request_id]
            if event.embedding is None:
                raise RuntimeError(f"request {s.request_id} failed: {event.error}")
            outputs.append(EmbeddingOutput(s.request_id, event.num_input_tokens, event.embedding))
        return outputs

    def _request_output(self, events: list[RequestOutput], num_samples: int) -> CompletionOutput:
        """One prompt's output: its one sample's, or with n > 1 sample 0's with every sample in `samples`."""
        if num_samples == 1:
            return self._completion(events)
        samples = [self._completion([e for e in events if e.index == i]) for i in range(num_samples)]
        return dataclasses.replace(samples[0], samples=samples)

    def _completion(self, events: list[RequestOutput]) -> CompletionOutput:
        last = events[-1]
        if last.finish_reason is FinishReason.ERROR:
            raise RuntimeError(f"request {last.request_id} failed: {last.error}")
        if last.finish_reason is FinishReason.INVALID:  # the request could not run as sent (e.g. a grammar that does not compile)
            raise ValueError(f"request {last.request_id} was refused: {last.error}")
        out = CompletionOutput(last.request_id, last.num_input_tokens, finish_reason=last.finish_reason, index=last.index)
        for e in events:
            out.output_ids += e.new_token_ids
            out.event_times.append(e.time)
            if e.logprobs is not None:
                out.logprobs = out.logprobs or []
                out.logprobs += e.logprobs
            if e.prompt_logprobs is not None:
                out.prompt_logprobs = e.prompt_logprobs
        out.cumulative_logprob = last.cumulative_logprob
        if self.tokenizer is not None:
            out.text = "".join(e.new_text for e in events)
        return out
