"""What crosses between the engine core and the model runners each step, torch-free: the scheduler's
`SchedulerOutput` out, the sampler's `SamplerOutput` back (vLLM v1's SchedulerOutput and
ModelRunnerOutput, in this project's words).

A SchedulerOutput is a delta. Every runner (the one in the core's process, or each worker process)
keeps the state of every unfinished request it has been sent, in its persistent input batch
(worker/input_batch.py); a step brings only what changed since the one before:

- `new_requests`: a request's first step: its tokens, sampling parameters and blocks;
- `recorded_ids` / `recorded_tokens`: the tokens the core recorded since its last step (what the steps
  that landed sampled, one per request that sampled): every rank appends them, so the sampling rank
  holds nothing the others do not, and a step that failed recorded nothing;
- `grown_ids` / `grown_block_ids`: blocks appended to requests' tables (after a preemption, a whole
  new table), every K/V group's as `NewRequest.block_ids` holds them;
- `preempted_ids`: requests that lost their blocks (preemption by recompute): a runner frees their
  rows and keeps their tokens and generator; a preempted request that is scheduled again takes a row
  again;
- `finished_ids`: requests that ended: a runner forgets them;
- `lora_loads`: adapters to put in slots (multi-LoRA), before the step's rows are taken;
- `kv_to_host` / `kv_to_device`: the host tier's copies (swap_space: preempted requests swapped
  out and in, prefix blocks evicted to the host and found there), (device block, host block) then
  (host block, device block), made in that order before the step's forward;
- `block_copies`: blocks whose K/V a forked request (a later sample of a request with n > 1) copies
  from its sample 0's, before the step's forward;
- `shrunk_ids` / `shrunk_num_blocks`: tables cut back to their first blocks (speculative decoding:
  blocks taken for proposed tokens that were rejected go back to the pool), before any growth.

Speculative decoding: a request of `spec_rows` runs its last token and then its proposed tokens
(`spec_tokens`, that many more scheduled tokens; PROPOSED_BY_RUNNER for a token the runner's draft
model proposes first); the sampler verifies each proposal on the logits of the position before it
(SamplerOutput.num_accepted, and the proposals as verified in SamplerOutput.spec_tokens).

The step's batch is `scheduled_ids`, in order, each running `num_scheduled_tokens` tokens from
position `num_computed`. Every rank gets the same message, so every rank holds the same rows; a
runner takes it in as it arrives (before the step's forward, whatever that then does), and the core
counts it as held once sent.

On the wire (a worker pool's pipes, and the Ray pool's TCP connections, which cross hosts in
plaintext) a step travels as msgpack, never pickled (orca_backend/wire.py: a message injected on the
way may be wrong, but it cannot run code in a rank).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orca_backend.lora import LoRARequest
from orca_backend.messages import TokenLogprobs
from orca_backend.sampling_params import SamplingParams
from orca_backend.wire import decode, encode

PROPOSED_BY_RUNNER = -1  # a proposed token the model runner's draft model fills in (SchedulerOutput.spec_tokens)


@dataclass(slots=True)
class NewRequest:
    """A request as the runners first see it."""

    request_id: str
    token_ids: list[int]  # its prompt and every output token recorded so far
    num_prompt_tokens: int
    # Its K/V blocks in context order, each K/V group's table (orca_backend/kv_groups.py) one after the
    # other, all of one length (a windowed group's entries behind its window -1).
    block_ids: list[int]
    params: SamplingParams
    seed: int  # its generator's seed: params.seed, or one the engine drew at arrival
    # The tokens that end it with "stop" (stop ids, EOS unless ignored): the sampler bans them while it is
    # short of min_tokens.
    stop_ids: list[int] = field(default_factory=list)
    lora_id: int = 0  # its adapter (LoRARequest.lora_id), resident when it runs; 0: none
    # An embedding request: how its prompt's final hidden states are pooled ("last", "mean", "cls");
    # "": a generation request.
    pooling: str = ""


@dataclass(slots=True)
class SchedulerOutput:
    step_id: int
    scheduled_ids: list[str]  # the batch, in order
    num_scheduled_tokens: list[int]  # per scheduled request
    num_computed: list[int]  # per scheduled request: tokens whose K/V is in the cache before this step
    new_requests: list[NewRequest] = field(default_factory=list)
    recorded_ids: list[str] = field(default_factory=list)
    recorded_tokens: list[int] = field(default_factory=list)
    grown_ids: list[str] = field(default_factory=list)
    grown_block_ids: list[list[int]] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)
    finished_ids: list[str] = field(default_factory=list)
    # Structured output: the batch positions of constrained requests that sample this step, and their
    # grammars' token bitmask rows in that order (int32 words, ceil(vocab / 32) per row, as raw bytes;
    # worker/bitmask.py). Only the sampling rank of a worker pool is sent them.
    bitmask_rows: list[int] = field(default_factory=list)
    bitmask: bytes = b""
    # Async scheduling: the batch positions of requests run ahead of their last step, which has not
    # returned: their input token is the one that step samples, not yet recorded. The runner takes it
    # from that step's sampled ids on the device (always the step submitted just before this one).
    ahead_rows: list[int] = field(default_factory=list)
    # LoRA: adapters to load before this step, each into a slot (core/lora_slots.py), replacing the
    # one there; every request of the step whose adapter it is finds it resident.
    lora_loads: list[tuple[int, LoRARequest]] = field(default_factory=list)
    # Copy-on-write of forked requests (n > 1): each (source, destination) block's K/V is copied, in
    # every layer, before this step's forward; the destination is a block of a request this step brings.
    block_copies: list[tuple[int, int]] = field(default_factory=list)
    # The host tier (swap_space): (device, host) block copies, then (host, device) ones, before the
    # step's forward and its block_copies, in every layer (core/kv_cache_manager.py).
    kv_to_host: list[tuple[int, int]] = field(default_factory=list)
    kv_to_device: list[tuple[int, int]] = field(default_factory=list)
    # Speculative decoding: the batch positions of requests whose step verifies proposed tokens, and
    # those tokens (each request's last len(spec_tokens[i]) scheduled tokens).
    spec_rows: list[int] = field(default_factory=list)
    spec_tokens: list[list[int]] = field(default_factory=list)
    shrunk_ids: list[str] = field(default_factory=list)
    shrunk_num_blocks: list[int] = field(default_factory=list)
    # Constrained requests that verify proposals: the rows verifying their proposals (indices among
    # every request's proposals, in spec_rows' order) and their grammars' masks there, as `bitmask`.
    spec_bitmask_rows: list[int] = field(default_factory=list)
    spec_bitmask: bytes = b""

    @property
    def num_tokens(self) -> int:
        return sum(self.num_scheduled_tokens)


@dataclass(slots=True)
class PromptLogprobsChunk:
    """What a step's prefill chunk computed of one request's prompt logprobs: those of its prompt
    tokens `first_token`, `first_token` + 1, ... (each given the tokens before it; the first prompt
    token has none, so `first_token` >= 1), as the sampler returns logprobs, the prompt token first."""

    position: int  # the request's position in the step's batch
    first_token: int
    logprobs: list[TokenLogprobs]


@dataclass(slots=True)
class PooledChunk:
    """What a step's prefill chunk pooled of one embedding request: the sum of the final hidden
    states of its rows the request's pooling takes (all of them for "mean"; the last prompt token's
    for "last", the first's for "cls", in the chunk that holds it)."""

    position: int  # the request's position in the step's batch
    vector: list[float]


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]  # one per scheduled request (one that samples nothing has a placeholder the core ignores)
    # One per request when any asked for logprobs (None for those that did not), else None.
    logprobs: list[TokenLogprobs | None] | None = None
    # LoRA adapters that could not be loaded on some rank since the last output, {lora_id: why} (the
    # reason fit for a client): the core ends their requests, whatever this step sampled for them.
    lora_failures: dict[int, str] = field(default_factory=dict)
    # How the sampling rank's forward ran: "cuda_graph" (replayed), or why it ran eagerly
    # (worker/cuda_graphs.py, EAGER_REASONS).
    step_path: str = ""
    # The prompt logprobs the step's prefill chunks computed, for the requests that asked
    # (SamplingParams.prompt_logprobs).
    prompt_logprobs: list[PromptLogprobsChunk] = field(default_factory=list)
    pooled: list[PooledChunk] = field(default_factory=list)  # the step's embedding requests' chunks
    # Speculative decoding, per request of SchedulerOutput.spec_rows: how many of its proposed tokens
    # were accepted (a leading run). Its entry of `token_ids` is then the token after them: the
    # target's own where a proposal was rejected, else the one its last row sampled. Logprobs of
    # such a request (when it asked) are one per emitted token: `spec_logprobs[i]`.
    num_accepted: list[int] = field(default_factory=list)
    spec_logprobs: list[list[TokenLogprobs] | None] = field(default_factory=list)
    spec_tokens: list[list[int]] = field(default_factory=list)  # the proposals verified, per request of spec_rows


def encode_step(step: SchedulerOutput) -> bytes:
    """A step as the control channel carries it (orca_backend/wire.py)."""
    return encode(step)


def decode_step(data: bytes) -> SchedulerOutput:
    """The step `data` encodes; WireFormatError (a ValueError) naming what is wrong otherwise."""
    return decode(data, SchedulerOutput)
