"""What crosses between the engine front and the engine core, and how it travels: torch-free.

The frontend (engine/: validation, tokenizing, the output processor, the core client) and the
server adapters import these and nothing from core/, worker/ or model/, so the Triton stub's process
never loads the scheduler, the K/V bookkeeping or torch. The core (core/) imports them too: they are
its public boundary (vLLM v1's EngineCoreRequest / EngineCoreOutputs, in this project's words).

- frontend -> core: `EngineCoreRequest` (a validated, tokenized request), aborts, stop;
- core -> frontend: one `CoreOutputs` per step with `EngineStats`, and the reason if the core died;
- `FinishReason`: why a request ended, the one vocabulary every layer uses.

The wire encoding (pickled tuples over the core process's pipe) is here too, beside the types it
carries, so both ends share one definition.
"""

from __future__ import annotations

import enum
import operator
import pickle
from collections.abc import Iterator
from dataclasses import dataclass, field, fields

from orca_backend.lora import LoRARequest
from orca_backend.sampling_params import PoolingParams, SamplingParams


class FinishReason(str, enum.Enum):
    """Why a request ended. A str enum: a member equals its value ("stop" == FinishReason.STOP), which
    is what metrics labels and the vLLM-backend contract carry."""

    LENGTH = "length"  # max_tokens reached
    STOP = "stop"  # EOS, a stop token id, a stop string, or a complete structured-output grammar
    CANCELLED = "cancelled"  # the client cancelled (the contract calls it "abort")
    TIMEOUT = "timeout"  # its deadline passed, queued or running (an error response)
    ERROR = "error"  # the engine failed it (an error response, with the message)
    INVALID = "invalid"  # it cannot run as sent, e.g. a grammar that does not compile (INVALID_ARG)

    def __str__(self) -> str:
        return self.value


# A token's logprobs as the sampler returns them: (ids, logprobs, ranks), the sampled token first (its
# rank: 1 + the number of tokens more likely), then the top-k alternatives (ranks 1..k). A tuple: it
# crosses two process boundaries per token, and a tuple is the cheapest thing to pickle.
TokenLogprobs = tuple[list[int], list[float], list[int]]


class EngineDeadError(RuntimeError):
    """The engine loop has stopped; no request can be served until the model is reloaded."""


class EngineOverloadedError(RuntimeError):
    """The engine's queue is full: the request was refused at once and may be retried later."""


@dataclass(slots=True)
class EngineCoreRequest:
    """A request the frontend has validated and tokenized, as the core takes it in."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float  # time.monotonic() when the frontend took it (one clock for every process)
    sampling_seed: int  # params.seed, or drawn by the frontend (worker/sampler.py)
    priority: int = 0  # lower is served first (vLLM's convention); equal priorities are FCFS
    timeout_s: float | None = None  # it ends with FinishReason.TIMEOUT this long after arrival
    lora: LoRARequest | None = None  # params.lora_name, resolved by the frontend's registry
    # A later sample of a request with n > 1: the id of its sample 0, which prefills the prompt they
    # share; this one then takes those blocks (core/kv_cache_manager.py, `admit`) and computes only
    # its last prompt token.
    prefix_from: str | None = None
    # An embedding request: its prompt is prefilled and pooled into one vector (its final output's
    # `embedding`); no token is generated.
    pooling: PoolingParams | None = None


@dataclass(slots=True)
class RequestMetrics:
    """A finished request's life as the core saw it, times on time.monotonic() (CLOCK_MONOTONIC: one
    clock for every process of the host). The frontend adds when its first and last tokens were handed
    out; the server exports them as latency histograms and, on request, in the response."""

    arrival_time: float
    first_scheduled_time: float | None  # None: it ended before it was ever scheduled
    num_preemptions: int
    num_cached_tokens: int  # prompt tokens its first admission found in the prefix cache
    first_token_time: float | None = None  # set by the output processor
    last_token_time: float | None = None
    # Speculative decoding: the tokens proposed for it, and how many of them were accepted.
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0


@dataclass(slots=True)  # one per request per iteration: slots make it cheaper to build
class CoreOutput:
    """What one iteration (or an abort) did to one request: its new tokens, and whether it ended
    (`error` holds the message of TIMEOUT, ERROR and INVALID; `metrics` comes with the end)."""

    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: FinishReason | None = None
    error: str | None = None
    logprobs: list[TokenLogprobs] | None = None  # one per new token when the request asked; else None
    metrics: RequestMetrics | None = None
    # With its first token, when it asked for prompt logprobs: one per prompt token but the first.
    prompt_logprobs: list[TokenLogprobs] | None = None
    embedding: list[float] | None = None  # an embedding request's, with its end


@dataclass(slots=True)
class CoreOutputs:
    """Everything the core reports at once (an iteration, with the aborts and timeouts taken in
    before it): one object per step, not one per request. The common result, a request's one new
    token with nothing else to say, is two columns (`request_ids`, `token_ids`); it is most of every
    step, and columns cost a fraction of a `CoreOutput` each to build, pickle and read. Everything
    else (a finish, several tokens, logprobs, an error) is a `CoreOutput` in `others`.

    Consumers take the columns first, then `others`: a request has at most one entry in a step's
    outputs, and where several steps' are held together (request-level mode) they are all in `others`,
    in order.
    """

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    others: list[CoreOutput] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.request_ids) + len(self.others)

    def __iter__(self) -> Iterator[CoreOutput]:
        """Every entry as a CoreOutput, the columns' first (for tests and tools; the hot paths read the columns)."""
        for request_id, token in zip(self.request_ids, self.token_ids, strict=True):
            yield CoreOutput(request_id, [token])
        yield from self.others

    def __iadd__(self, more: CoreOutputs) -> CoreOutputs:
        self.request_ids += more.request_ids
        self.token_ids += more.token_ids
        self.others += more.others
        return self

    @property
    def num_finished(self) -> int:
        return sum(o.finished for o in self.others)


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    kv_used_tokens: int  # in whole blocks: the blocks requests hold, times the block size
    kv_capacity_tokens: int
    num_iterations: int
    num_generated_tokens: int
    last_iteration_seconds: float
    max_batches_in_flight: int  # > 1 only with pipeline parallelism
    kv_used_blocks: int = 0
    kv_num_blocks: int = 0
    num_preemptions: int = 0
    num_prompt_tokens_computed: int = 0  # prompt tokens run through the model; prefix-cache hits are not
    prefix_cache_queried_tokens: int = 0  # tokens of admitted requests looked up in the prefix cache
    prefix_cache_hit_tokens: int = 0  # of those, found cached (and not computed)
    # The host tier (swap_space): its blocks, those holding a swapped request's or a cached prefix's
    # K/V, and the blocks copied out and back for preemptions and copied back for prefix-cache hits.
    kv_host_num_blocks: int = 0
    kv_host_used_blocks: int = 0
    kv_swapped_out_blocks: int = 0
    kv_swapped_in_blocks: int = 0
    kv_host_hit_blocks: int = 0
    # Multi-LoRA (enable_lora): the adapters resident slots hold at most, those the running and the
    # waiting requests use (comma-separated names, as vLLM's lora_requests_info labels carry them),
    # and the adapters loaded into a slot so far.
    max_loras: int = 0
    running_lora_adapters: str = ""
    waiting_lora_adapters: str = ""
    lora_loads: int = 0
    # Iterations by how their forward ran: "cuda_graph" (replayed), or why it ran eagerly (the reasons
    # of worker/cuda_graphs.py: "no_cuda_device", "tokens_above_buckets", ...).
    steps_by_path: dict[str, int] = field(default_factory=dict)
    # Speculative decoding (vLLM's spec_decode counters): verifications (one per request per step),
    # proposed tokens, accepted ones, and accepted ones by their place in the proposal (0-based).
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)

    @property
    def kv_free_blocks(self) -> int:
        return self.kv_num_blocks - self.kv_used_blocks

    @property
    def kv_usage(self) -> float:
        """The share of K/V blocks in use (vLLM's gpu_cache_usage_perc: 1 is all of them)."""
        return self.kv_used_blocks / self.kv_num_blocks if self.kv_num_blocks else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hit_tokens / self.prefix_cache_queried_tokens if self.prefix_cache_queried_tokens else 0.0


# ------------------------------------------------------------------------- the wire (core process)
# Over the core process's duplex pipe (core/core_process.py, engine/core_client.py):
# - frontend -> core: ("add", [EngineCoreRequest, ...]), ("abort", request_id, FinishReason), ("stop",);
# - core -> frontend: ("ready", info) or ("failed", exception) once at start-up, then one
#   ("outputs", request_ids, token_ids, rows, stats, dead_reason) frame per iteration that produced
#   anything: `CoreOutputs`' two columns as they are, its other outputs as rows of `CoreOutput` fields
#   in plain tuples (pickling a tuple costs a seventh of pickling the dataclass), the stats as a tuple.
def dumps(message: tuple) -> bytes:
    return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> tuple:
    return pickle.loads(data)


def add_message(requests: list[EngineCoreRequest]) -> bytes:
    return dumps(("add", requests))


def abort_message(request_id: str, reason: FinishReason) -> bytes:
    return dumps(("abort", request_id, reason))


STOP_MESSAGE = dumps(("stop",))
PING_MESSAGE = dumps(("ping",))  # an idle engine's health check: the core's loop answers with a frame
# From an attached frontend (core/frontends.py): it is going; and to one: the frontend that started
# the core stopped it.
DETACH_MESSAGE = dumps(("detach",))
STOPPED_MESSAGE = dumps(("stopped",))


@dataclass(frozen=True)
class CoreAddress:
    """Where an engine core listens for frontends beyond the one that started it: an AF_UNIX
    socket, and the key both ends prove they hold (multiprocessing's HMAC handshake)."""

    path: str
    authkey: bytes

# EngineStats' fields as a tuple: dataclasses.astuple copies each value deeply, ~30 µs a frame.
_stats_tuple = operator.attrgetter(*(f.name for f in fields(EngineStats)))


def outputs_frame(outputs: CoreOutputs, stats: EngineStats, dead_reason: str | None) -> bytes:
    rows = [(o.request_id, o.new_token_ids, o.finished, o.finish_reason, o.error, o.logprobs, o.metrics,
             o.prompt_logprobs, o.embedding) for o in outputs.others]  # fmt: skip
    return dumps(("outputs", outputs.request_ids, outputs.token_ids, rows, _stats_tuple(stats), dead_reason))


def read_frame(message: tuple) -> tuple[CoreOutputs, EngineStats, str | None]:
    """(outputs, stats, dead_reason) of an "outputs" message."""
    _, request_ids, token_ids, rows, stats, dead_reason = message
    return CoreOutputs(request_ids, token_ids, [CoreOutput(*row) for row in rows]), EngineStats(*stats), dead_reason
