"""A request's state inside the engine, and the output events the engine emits for it."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from orca_backend.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)  # one per request per iteration: slots make it cheaper to build
class RequestOutput:
    """One event on a request's stream: what is new since the previous event.

    Every request gets at least one event; the last has ``finished`` set and a ``finish_reason``
    of "length" | "stop" | "cancelled" | "error" (with ``error`` holding the message).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str  # exact incremental detokenization ("" without a tokenizer)
    finished: bool
    finish_reason: str | None
    num_input_tokens: int
    num_output_tokens: int
    time: float  # time.perf_counter() when the engine produced this event
    error: str | None = None


@dataclass
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    in_flight: bool = False  # part of a batch that has not returned yet (pipeline parallelism)
    kv_start: int = -1  # first slot of the K/V region reserved for it, -1 while it has none
    num_computed: int = 0  # tokens whose K/V is in the cache
    sampling_seed: int = 0  # params.seed, or drawn by the engine at arrival (see Sampler)
    # Incremental detokenization state (see engine/detokenizer.py).
    text: str = ""
    sent_text_len: int = 0
    sent_ids_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def max_total_tokens(self) -> int:
        """What ORCA reserves at admission: the prompt plus every token it may generate."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids
