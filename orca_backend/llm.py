"""The offline API: `LLM(...).generate(prompts, params)` runs the engine in the caller's thread."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine, Prompt, RequestOutput
from orca_backend.sampling_params import SamplingParams


@dataclass
class CompletionOutput:
    request_id: str
    num_input_tokens: int
    output_ids: list[int] = field(default_factory=list)
    text: str | None = None  # None when the model has no tokenizer
    finish_reason: str | None = None  # "length" | "stop"
    event_times: list[float] = field(default_factory=list)  # one per output event, the last is the finish

    @property
    def finish_time(self) -> float:
        return self.event_times[-1]

    @property
    def first_token_time(self) -> float:
        return self.event_times[0]


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

    def generate(
        self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | Sequence[SamplingParams] | None = None
    ) -> list[CompletionOutput]:
        """Runs every prompt to completion; outputs come back in input order.

        `prompts` is a string, a list of token ids, or a list of either; `params` one SamplingParams
        for all or one per prompt. Bad input raises ValueError before anything runs.
        """
        if isinstance(prompts, str) or (prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]  # a single prompt
        params = params if params is not None else SamplingParams()
        events: dict[str, list[RequestOutput]] = {}

        def collect(output: RequestOutput) -> None:
            events.setdefault(output.request_id, []).append(output)

        streams = self.engine.add_requests(list(prompts), params, on_output=collect)
        while any(not (events.get(s.request_id) and events[s.request_id][-1].finished) for s in streams):
            self.engine.step()
        while self.engine.has_work():  # aborts of requests a stop string ended: their K/V is freed now
            self.engine.step()
        return [self._completion(events[s.request_id]) for s in streams]

    def _completion(self, events: list[RequestOutput]) -> CompletionOutput:
        last = events[-1]
        if last.finish_reason == "error":
            raise RuntimeError(f"request {last.request_id} failed: {last.error}")
        out = CompletionOutput(last.request_id, last.num_input_tokens, finish_reason=last.finish_reason)
        for e in events:
            out.output_ids += e.new_token_ids
            out.event_times.append(e.time)
        if self.tokenizer is not None:
            out.text = "".join(e.new_text for e in events)
        return out
