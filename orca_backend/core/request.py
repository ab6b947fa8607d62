"""A request's scheduling state inside the engine core (what the core reports about it is in
orca_backend/messages.py)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from orca_backend.core.block_pool import BlockKey
from orca_backend.lora import LoRARequest
from orca_backend.messages import EngineCoreRequest, FinishReason, TokenLogprobs
from orca_backend.sampling_params import PoolingParams, SamplingParams


class RequestStatus(enum.Enum):
    WAITING_FOR_GRAMMAR = "waiting_for_grammar"  # its structured-output grammar compiles (vLLM: WAITING_FOR_FSM)
    WAITING = "waiting"  # not admitted yet, or preempted
    RUNNING = "running"
    FINISHED = "finished"


# eq=False: requests compare (and hash) by identity. The scheduler's lists search them (`remove`, `in`),
# and a generated field-by-field __eq__ would make each of those comparisons build two tuples of fields.
# slots: the scheduler reads several fields of every running request every
# iteration, and a slot is read faster than an instance dict's entry.
@dataclass(eq=False, slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the frontend took it (one clock for every process)
    sampling_seed: int = 0  # params.seed, or drawn by the engine at arrival (see worker/sampler.py)
    priority: int = 0  # lower is served first (vLLM's convention); equal priorities are FCFS
    timeout_s: float | None = None  # it ends with finish_reason "timeout" this long after arrival
    arrival_order: int = 0  # set by the scheduler as it takes requests in: breaks ties of arrival_time
    lora: LoRARequest | None = None  # its adapter: resident (core/lora_slots.py) while it runs
    # A later sample of a request with n > 1: its sample 0's id (EngineCoreRequest.prefix_from), until
    # it was admitted once (the scheduler then clears it).
    prefix_from: str | None = None
    pooling: PoolingParams | None = None  # an embedding request (EngineCoreRequest.pooling)
    pooled_sum: list[float] | None = None  # an embedding request: the sum of its chunks' pooled rows so far
    output_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: FinishReason | None = None
    # Written by the scheduler alone: the batches holding it that have not returned yet (one at most,
    # except under async scheduling: its next decode is scheduled while one is in flight), and the
    # tokens those batches compute.
    in_flight: int = 0
    num_in_flight_tokens: int = 0
    # Its K/V blocks in context order, a table per K/V group (orca_backend/kv_groups.py), all of one
    # length; empty while it holds none.
    block_tables: list[list[int]] = field(default_factory=list)
    block_keys: list[BlockKey] = field(default_factory=list)  # prefix-cache keys of its full blocks
    num_registered_blocks: int = 0  # leading blocks of its tables that are cached prefixes
    # Per group: leading blocks given back as outside the group's window (entries -1).
    num_dropped_blocks: list[int] = field(default_factory=list)
    # Preempted by swapping (swap_space): per group, the host blocks holding its table's blocks past
    # the dropped ones, in order, until it is admitted again (KVCacheManager.swap_out).
    host_tables: list[list[int]] = field(default_factory=list)
    num_computed: int = 0  # tokens whose K/V is in the cache
    num_reported: int = 0  # output tokens already handed out in a CoreOutput
    output_logprobs: list[TokenLogprobs] | None = None  # one per output token when it asks for logprobs
    # When it asks for prompt logprobs: those of its prompt tokens 1, 2, ... computed so far (the
    # first has none); None once they went out, with its first token.
    prompt_logprobs: list[TokenLogprobs] | None = None
    # What its final output reports (messages.RequestMetrics): when it was first scheduled (time.monotonic),
    # how often it was preempted, and how many prompt tokens its first admission found in the prefix cache.
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    num_cached_tokens: int = 0
    # The blocks of its table the model runners hold (scheduler_output.py): -1 until they are sent the
    # request (whole), 0 after a preemption freed them.
    num_blocks_sent: int = -1
    # Admitted as a fork (KVCacheManager.admit): in each group, the block whose K/V its first block past
    # the shared ones copies (source, destination), until the scheduler sends the copies to the runners.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the tokens its steps proposed, and how many of them were accepted, so far
    # (RequestMetrics).
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Its verify steps in a row that accepted none of their proposals, and how many of its decodes
    # go on without proposals (the scheduler's pause after fruitless rounds).
    spec_fruitless: int = 0
    spec_paused: int = 0
    # Structured output: its grammar's matcher lives in the scheduler's StructuredOutputManager, and the
    # steps it samples in carry its bitmask row (read for every request every iteration: one attribute).
    structured: bool = field(init=False, default=False)
    # The prompt never changes: its length is read for every request every iteration, so it is kept.
    num_prompt_tokens: int = field(init=False, default=0)
    # The tokens that end it with "stop" (stop ids, and EOS unless ignored), set by the scheduler (which
    # knows EOS) as it takes the request in (core/stop.py).
    stop_ids: frozenset[int] = field(init=False, default=frozenset())
    # Async scheduling may run its next step before its token lands: not for a grammar (its next mask
    # needs the token). Penalties count that token on the device (SamplingBatch.unrecorded).
    can_run_ahead: bool = field(init=False, default=True)
    # Speculative decoding proposes for it: the rows that verify its proposals are sampled as its own
    # last row is, with what depends on the tokens before each row made per row (the penalties count
    # the proposals before it, a grammar's mask is its matcher's after them, a min_tokens ban counts
    # them too). Not an embedding request.
    can_speculate: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        p = self.params
        self.structured = p.structured_outputs is not None
        if p.logprobs is not None:
            self.output_logprobs = []
        if p.prompt_logprobs is not None:
            self.prompt_logprobs = []
        self.num_prompt_tokens = len(self.prompt_ids)
        self.can_run_ahead = not self.structured
        self.can_speculate = self.pooling is None

    @property
    def num_tokens(self) -> int:
        return self.num_prompt_tokens + len(self.output_ids)

    @property
    def num_blocks(self) -> int:
        """The length of its block tables (every group's)."""
        return len(self.block_tables[0]) if self.block_tables else 0

    @property
    def num_scheduled(self) -> int:
        """Tokens computed, or being computed by a batch in flight: where its next step starts."""
        return self.num_computed + self.num_in_flight_tokens

    @property
    def max_total_tokens(self) -> int:
        """What ORCA reserves at admission: the prompt plus every token it may generate."""
        return len(self.prompt_ids) + self.params.max_tokens

    @property
    def deadline(self) -> float | None:
        return None if self.timeout_s is None else self.arrival_time + self.timeout_s

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def all_token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @classmethod
    def from_core_request(cls, r: EngineCoreRequest) -> Request:
        return cls(r.request_id, r.prompt_ids, r.params, r.arrival_time, r.sampling_seed, r.priority, r.timeout_s,
                   lora=r.lora, prefix_from=r.prefix_from, pooling=r.pooling)
