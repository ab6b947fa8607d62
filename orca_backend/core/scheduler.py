"""Iteration-level FCFS scheduling (ORCA §4.2), and the request-level mode the baseline uses.

Between two iterations `schedule()` builds the next batch: running requests' decodes, then their
unfinished prefills, then waiting requests admitted first come, first served (within a priority,
core/waiting_queue.py) while the batch stays within `max_num_seqs` and the K/V manager gives them
blocks. With a token budget
(`max_num_batched_tokens`) a long prompt is prefilled in chunks over several iterations, beside the
decodes (chunked prefill); without one, a prompt runs whole. `update_from_output()` appends the
sampled tokens, ends the requests that are done (`check_stop`), so they leave before the next
iteration, and returns what changed as CoreOutputs (core/request.py). With pipeline parallelism several batches are
in flight; a request in flight is never scheduled again until its batch returns.

Under the paged K/V policy a decode may find no free block: the most recently admitted running
request of the lowest priority is then preempted and waits at the head of its queue (FCFS order is
kept): by swapping its blocks to the host tier where there is one with room (`swap_space`), so it
resumes where it stopped, else by recompute. Under ORCA's reservation nothing is ever preempted.

A request with structured output waits out of the queue until its grammar has compiled (on the
StructuredOutputManager's thread, `take_compiled`), then takes its place in the queue by arrival; a
grammar that does not compile ends it with finish_reason "invalid". Each token it samples advances its
grammar's matcher when the batch lands (`update_from_output`); once the grammar accepted EOS it ends
with "stop".

Speculative decoding (`speculative_config`): as a step is built, each running decode that can
speculate (`Request.can_speculate`) gets proposed tokens (core/ngram_proposer.py), cut where its
`max_tokens` or a stop token would end it, and runs them with its last token: 1 + k tokens from the
token budget, and K/V slots taken as any others, but never by preempting another request (without
free blocks it decodes plainly), nor while its proposals keep being rejected (a pause that grows
with each further fruitless round, `_pace_proposals`). When the step lands it keeps the accepted
proposals and the token after them; the K/V of the rejected ones is garbage past its computed
count, and the blocks that held only them go back to the pool (paged). A request's next step needs its tokens to propose from, so
with speculation no request runs ahead (async scheduling).

A request with a timeout ends with finish_reason "timeout" once its deadline passes, queued or
running (`expire`). A batch whose forward failed is not failed whole: its requests are re-run in
halves, each half alone, until the request that fails alone is found (`fail_batch`), so one poison
request costs the others about 2 log2(batch size) iterations and nothing else.

Request-level mode (the baseline's FasterTransformer-style serving) lives here too, whole: a batch
is admitted only when nothing runs, it runs until its last request finishes (nobody joins), and
its outputs are held until then, because a request-level server answers a batch at once.
"""

from __future__ import annotations

import heapq
import itertools
import operator
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from orca_backend.config import SpeculativeConfig
from orca_backend.core.kv_cache_manager import KVCacheManager
from orca_backend.core.lora_slots import LoRASlots
from orca_backend.core.ngram_proposer import NgramProposer
from orca_backend.core.request import Request, RequestStatus
from orca_backend.core.stop import check_stop, stop_token_set
from orca_backend.core.structured_output import StructuredOutputManager
from orca_backend.core.waiting_queue import WaitingQueue
from orca_backend.messages import CoreOutput, CoreOutputs, FinishReason, RequestMetrics, TokenLogprobs
from orca_backend.sampling_params import PoolingConfig
from orca_backend.scheduler_output import (
    PROPOSED_BY_RUNNER,
    NewRequest,
    PooledChunk,
    PromptLogprobsChunk,
    SchedulerOutput,
)

# The statuses the per-iteration loops test, as module constants: an Enum member read through its
# class costs several times a global read.
_RUNNING = RequestStatus.RUNNING
_FINISHED = RequestStatus.FINISHED

# Speculative decoding's pause (`Scheduler._pace_proposals`): after this many fruitless rounds in a
# row a request stops proposing for SPEC_PAUSE_FIRST of its steps, each further fruitless round
# multiplying the pause by SPEC_PAUSE_GROWTH (up to speculative_config's max_pause_steps). Two rounds,
# as a single miss is common where proposals pay (the end of a repeated span), and a round after a
# pause proposes k as every round does (where proposals pay again, that round gains as much as any
# other). A first pause of 64: most of a round's cost where nothing is accepted is the
# proposer's (a draft model's k passes), and a request of 64 tokens then verifies two rounds, not 63.
SPEC_PAUSE_AFTER = 2
SPEC_PAUSE_FIRST = 64
SPEC_PAUSE_GROWTH = 4


@dataclass
class ScheduledBatch:
    requests: list[Request]
    num_new_tokens: list[int]  # a prompt (or a chunk of it) on a request's first iterations, then 1
    # The leading requests that compute exactly their last token (and so sample): decodes. All of them
    # in the steady state; before the prompts of requests admitted this iteration under load.
    num_decodes: int = 0
    # A half of a failed batch, re-run alone to find the request that fails (`fail_batch`): its
    # failure is being attributed, so it does not spend the engine's failure budget.
    rerun: bool = False
    # What the model runners are sent for it (`Scheduler.schedule` sets it).
    output: SchedulerOutput | None = None
    # Speculative decoding: batch position -> the tokens proposed after that request's last token,
    # which it runs after it (its num_new_tokens count them).
    spec: dict[int, list[int]] = field(default_factory=dict)

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.requests)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


def make_scheduler_output(
    batch: ScheduledBatch, step_id: int, recorded: tuple[list[str], list[int]] = ([], []),
    preempted_ids: list[str] | None = None, finished_ids: list[str] | None = None,
    structured: StructuredOutputManager | None = None, tables_changed: list[Request] | None = None,
    pooling_mode: str = "last",
) -> SchedulerOutput:  # fmt: skip
    """The batch as deltas against what the runners hold (scheduler_output.py): a request they have
    never been sent comes whole, any other with the blocks its table gained since (a whole table
    after a preemption); `recorded` are the tokens recorded since the last step (request ids, token
    ids). `tables_changed`: the requests whose table may have changed since the last step (the
    scheduler's record; default: look at every request of the batch). Constrained requests that
    sample get their grammar's bitmask row from `structured`; embedding requests are sent the
    model's `pooling_mode` (PoolingConfig.mode)."""
    requests = batch.requests
    new: list[NewRequest] = []
    grown_ids: list[str] = []
    grown_block_ids: list[list[int]] = []
    for request in tables_changed if tables_changed is not None else requests:
        tables, sent, length = request.block_tables, request.num_blocks_sent, request.num_blocks
        if length == sent:  # unchanged, or already sent (a request recorded twice)
            continue
        if sent < 0:
            new.append(NewRequest(request.request_id, request.all_token_ids(), request.num_prompt_tokens,
                                  _group_major(tables, 0),
                                  request.params, request.sampling_seed, sorted(request.stop_ids),
                                  request.lora.lora_id if request.lora is not None else 0,
                                  pooling_mode if request.pooling is not None else ""))  # fmt: skip
        else:
            grown_ids.append(request.request_id)
            grown_block_ids.append(_group_major(tables, sent))
        request.num_blocks_sent = length
    # Each request's first position this step: what it had scheduled before this batch, which the
    # scheduler has counted in flight already (a batch built by hand, as tests do, is not: its
    # requests' computed counts are the positions). A request in flight in an earlier batch too runs
    # ahead (async scheduling): its input token is the one that batch samples, which the runner fills
    # in on the device.
    num_computed = [r.num_scheduled - n if r.in_flight else r.num_computed
                    for r, n in zip(requests, batch.num_new_tokens, strict=True)]  # fmt: skip
    output = SchedulerOutput(
        step_id, list(map(_request_id, requests)), batch.num_new_tokens, num_computed, new,
        recorded[0], recorded[1], grown_ids, grown_block_ids, preempted_ids or [], finished_ids or [],
    )  # fmt: skip
    output.ahead_rows = [i for i, r in enumerate(requests) if r.in_flight > 1]
    if batch.spec:
        output.spec_rows, output.spec_tokens = list(batch.spec), list(batch.spec.values())
    # The bitmask rows of the constrained requests that sample (compute their last token) this step.
    if not any(map(_structured, requests)):
        return output
    spec = batch.spec
    bitmask_rows = [i for i, (r, n) in enumerate(zip(requests, batch.num_new_tokens, strict=True))
                    if r.structured and r.num_computed + n - len(spec.get(i, ())) == r.num_tokens]  # fmt: skip
    if not bitmask_rows:
        return output
    assert structured is not None, "a constrained request in a batch built without its matchers"
    output.bitmask_rows = bitmask_rows
    if not spec or not any(i in spec for i in bitmask_rows):
        output.bitmask = structured.fill_bitmask([requests[i].request_id for i in bitmask_rows])
        return output
    # With proposals: its own row's mask is its grammar's after them, and each row verifying one
    # gets the grammar's before it (SchedulerOutput.spec_bitmask_rows: those rows among spec_rows').
    output.bitmask, output.spec_bitmask = structured.fill_bitmask_speculative(
        [requests[i].request_id for i in bitmask_rows], [spec.get(i, []) for i in bitmask_rows])
    starts = dict(zip(spec, itertools.accumulate(map(len, spec.values()), initial=0), strict=False))
    output.spec_bitmask_rows = [starts[i] + j for i in bitmask_rows if i in spec for j in range(len(spec[i]))]
    return output


def _group_major(tables: list[list[int]], start: int) -> list[int]:
    """Every group's blocks from `start` on, one group after the other (NewRequest.block_ids); one
    group's a plain slice, as this runs for every request whose table changed."""
    return tables[0][start:] if len(tables) == 1 else [block for table in tables for block in table[start:]]


_request_id = operator.attrgetter("request_id")
_structured = operator.attrgetter("structured")


def _hold_prompt_logprobs(requests: list[Request], chunks: list[PromptLogprobsChunk]) -> None:
    """Each chunk's prompt logprobs onto its request, in prompt order. A request's chunks come in
    order; a recompute after a preemption computes those it holds again, and they are dropped."""
    for chunk in chunks:
        request = requests[chunk.position]
        held = request.prompt_logprobs
        if held is None or request.status is _FINISHED:  # they went out already, or it ended
            continue
        repeated = len(held) + 1 - chunk.first_token
        if repeated < 0:
            raise ValueError(f"request {request.request_id}: prompt logprobs from token {chunk.first_token} "
                             f"while it holds them up to token {len(held)}")  # fmt: skip
        held += chunk.logprobs[repeated:]


def _hold_pooled(request: Request, vector: list[float]) -> None:
    """Adds a chunk's pooled rows to the embedding request's sum (chunks come in order; a preemption
    resets the sum, and its recompute pools from the start)."""
    if request.status is _FINISHED:
        return
    if request.pooled_sum is None:
        request.pooled_sum = list(vector)
    else:
        request.pooled_sum = [a + b for a, b in zip(request.pooled_sum, vector, strict=True)]


def _mark(request: Request, batches: int, tokens: int | None = None) -> None:
    """Counts a batch (and its tokens; one by default) in flight for the request, or with negative
    numbers one that returned or was taken back."""
    request.in_flight += batches
    request.num_in_flight_tokens += batches if tokens is None else tokens


class Scheduler:
    def __init__(
        self, kv: KVCacheManager, max_num_seqs: int, request_level: bool, eos_token_id: int | None,
        pipeline_depth: int = 1, max_num_batched_tokens: int = 0, priority_aging_s: float = 0.0,
        clock: Callable[[], float] = time.monotonic, structured: StructuredOutputManager | None = None,
        async_scheduling: bool = False, max_loras: int = 0, pooling: PoolingConfig | None = None,
        speculative: SpeculativeConfig | None = None,
    ) -> None:  # fmt: skip
        self.kv = kv
        # Speculative decoding: the proposer, and the counts vLLM's spec_decode metrics export: steps
        # that verified proposals (one per request), proposed tokens, accepted ones, and accepted ones
        # by their place in the proposal.
        self.proposer: NgramProposer | None = None  # n-gram proposals, made here
        self.runner_proposes = 0  # draft_model, eagle: the tokens each decode leaves the model runner to propose
        # No request proposes while more than this many run (speculative_config.disable_by_batch_size).
        self.speculate_below = sys.maxsize
        if speculative is not None and speculative.method == "ngram":
            self.proposer = NgramProposer(speculative.num_speculative_tokens, speculative.prompt_lookup_min,
                                          speculative.prompt_lookup_max)  # type: ignore[arg-type]
        elif speculative is not None:
            self.runner_proposes = speculative.num_speculative_tokens
        if speculative is not None and speculative.disable_by_batch_size is not None:
            self.speculate_below = speculative.disable_by_batch_size + 1
        self.max_pause_steps = speculative.max_pause_steps if speculative is not None else 0
        self.num_spec_drafts = 0
        self.num_spec_draft_tokens = 0
        self.num_spec_accepted_tokens = 0
        self.spec_accepted_per_pos = [0] * (speculative.num_speculative_tokens if speculative is not None else 0)
        self.pooling = pooling or PoolingConfig()  # how embedding requests are pooled and normalised
        # Multi-LoRA (max_loras > 0): the adapters resident in the runners' slots; a request is admitted
        # only with its adapter resident, and holds it while it runs.
        self.loras = LoRASlots(max_loras) if max_loras else None
        # Async scheduling: a running request's next decode may be scheduled while its last step is in
        # flight (`_runs_ahead`); the executor then holds two steps at once.
        self.async_scheduling = async_scheduling
        self.max_num_seqs = max_num_seqs  # requests in one batch
        # With `pipeline_depth` batches in flight, that many batches' worth of requests may run.
        self.max_running = max_num_seqs * pipeline_depth
        # Tokens in one batch; 0 means none: a prompt is prefilled whole in one iteration, ORCA's way.
        self.max_num_batched_tokens = max_num_batched_tokens
        self.request_level = request_level
        self.eos_token_id = eos_token_id
        self.waiting = WaitingQueue(priority_aging_s)
        self.running: list[Request] = []  # in admission order: the last is preempted first
        self._requests: dict[str, Request] = {}  # waiting and running, by id
        # Structured output: the grammars' compiler and matchers, and the requests waiting for a grammar
        # (not in `waiting` until it compiled, so they never hold up the queue).
        self.structured = structured if structured is not None else StructuredOutputManager(None, 0, None)
        self._compiling: dict[str, Request] = {}
        self._arrival_order = itertools.count()
        self._deadlines: list[tuple[float, int, Request]] = []  # a heap; finished requests leave it lazily
        self._deadline_seq = itertools.count()
        # Halves of failed batches, each to be re-run alone (see fail_batch); head first.
        self._suspects: deque[list[Request]] = deque()
        # LoRA adapters that failed to load in the runners, {lora_id: why}: their requests are refused.
        self._failed_loras: dict[int, str] = {}
        self.clock = clock
        self.num_preemptions = 0
        self.num_prompt_tokens_computed = 0  # prompt tokens run through the model (prefix hits are not)
        self.num_generated_tokens = 0
        self._held: list[CoreOutput] = []  # request-level mode: the running batch's outputs
        # Since the last SchedulerOutput: the tokens recorded (request ids, token ids), the requests that
        # ended, and those preempted: the runners are sent them with the next step (scheduler_output.py).
        self._recorded_ids: list[str] = []
        self._recorded_tokens: list[int] = []
        self._finished_ids: list[str] = []
        self._preempted_ids: list[str] = []
        # The requests whose block table was given or grown since the last SchedulerOutput.
        self._tables_changed: list[Request] = []
        # Blocks to copy before the next step (source, destination): forks' partly filled blocks.
        self._block_copies: list[tuple[int, int]] = []
        # Tables cut back since the last step (speculative decoding's rejected blocks): id -> blocks kept.
        self._shrunk: dict[str, int] = {}
        self._step_ids = itertools.count()

    def has_work(self) -> bool:
        """Requests to schedule. Requests waiting for their grammar are not: nothing can run them yet."""
        return bool(self.waiting or self.running)

    @property
    def num_compiling(self) -> int:
        """Requests waiting for their structured-output grammar to compile."""
        return len(self._compiling)

    def add(self, request: Request) -> CoreOutputs:
        """Queues a request (or, first, its grammar's compile). One whose LoRA adapter failed to load
        ends at once with that reason."""
        request.arrival_order = next(self._arrival_order)
        request.stop_ids = stop_token_set(request, self.eos_token_id)
        if request.structured:
            assert request.params.structured_outputs is not None
            request.status = RequestStatus.WAITING_FOR_GRAMMAR
            self._compiling[request.request_id] = request
            self.structured.submit(request.request_id, request.params.structured_outputs)
        else:
            self.waiting.append(request)
        self._requests[request.request_id] = request
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, next(self._deadline_seq), request))
        failed = self._failed_loras.get(request.lora.lora_id) if request.lora is not None else None
        if failed is not None:
            return self.finish(request.request_id, FinishReason.ERROR, failed)
        return CoreOutputs()

    def fail_adapters(self, failures: dict[int, str]) -> CoreOutputs:
        """LoRA adapters that could not be loaded ({lora_id: why}): every request of each ends with
        the reason, waiting or running (a batch in flight with their rows lands as for any ended
        request), its slot is freed, and later requests naming it end at once (`add`). A registration
        with changed files is a new id, so a fixed adapter serves again."""
        self._failed_loras |= failures
        ended = [r for r in [*self.running, *self.waiting, *self._compiling.values()]
                 if r.lora is not None and r.lora.lora_id in failures]  # fmt: skip
        outputs = []
        for request in ended:
            self._end(request, FinishReason.ERROR)
            outputs.append(self._output(request, failures[request.lora.lora_id]))
        if self.loras is not None:
            for lora_id in failures:
                self.loras.forget(lora_id)
        return self._release(CoreOutputs(others=outputs))

    def take_compiled(self) -> CoreOutputs:
        """Queues the requests whose grammar has compiled, each at its place by arrival; ends those whose
        grammar cannot be built ("invalid" with the compiler's message, or "error")."""
        if not self._compiling:
            return CoreOutputs()
        outputs = []
        for request_id, reason, message in self.structured.poll():
            request = self._compiling.get(request_id)
            if request is None:  # ended meanwhile
                continue
            if reason is not None:
                self._end(request, reason)
                outputs.append(self._output(request, message))
                continue
            del self._compiling[request_id]
            request.status = RequestStatus.WAITING
            self.waiting.insert(request)
        return self._release(CoreOutputs(others=outputs))

    def expire(self) -> CoreOutputs:
        """Ends every request whose deadline has passed, queued or running, with finish_reason "timeout"."""
        outputs: list[CoreOutput] = []
        if len(self._deadlines) > 2 * len(self._requests) + 64:  # mostly finished requests: drop them
            self._deadlines = [entry for entry in self._deadlines if not entry[2].finished]
            heapq.heapify(self._deadlines)
        now = self.clock()
        while self._deadlines and self._deadlines[0][0] <= now:
            request = heapq.heappop(self._deadlines)[2]
            if request.finished:
                continue
            where = {RequestStatus.WAITING: "waiting in the queue", RequestStatus.RUNNING: "running",
                     RequestStatus.WAITING_FOR_GRAMMAR: "waiting for its grammar to compile"}[request.status]
            self._end(request, FinishReason.TIMEOUT)
            error = (f"the request timed out: its timeout of {request.timeout_s:g} s passed while it was {where} "
                     f"({len(request.output_ids)} tokens generated)")
            outputs.append(self._output(request, error))
        return self._release(CoreOutputs(others=outputs))

    def schedule(self) -> ScheduledBatch | None:
        """The next batch: running decodes first, then running prefills, then newly admitted
        requests (FCFS), within `max_num_seqs` requests and the token budget. A prompt longer than
        the budget left is split into chunks over several iterations. Its `output` is what the model
        runners are sent."""
        budget = self.max_num_batched_tokens or sys.maxsize
        batch = self._schedule_suspects(budget) if self._suspects else self._schedule(budget)
        if batch is not None:
            batch.output = self._scheduler_output(batch)
        return batch

    def _scheduler_output(self, batch: ScheduledBatch) -> SchedulerOutput:
        output = make_scheduler_output(batch, next(self._step_ids), (self._recorded_ids, self._recorded_tokens),
                                       self._preempted_ids, self._finished_ids, self.structured, self._tables_changed,
                                       self.pooling.mode)  # fmt: skip
        if self.loras is not None:
            output.lora_loads = self.loras.take_loads()
        output.kv_to_host, output.kv_to_device = self.kv.take_transfers()
        if self._block_copies:
            output.block_copies, self._block_copies = self._block_copies, []
        if self._shrunk:
            output.shrunk_ids, output.shrunk_num_blocks = list(self._shrunk), list(self._shrunk.values())
            self._shrunk = {}
        self._recorded_ids, self._recorded_tokens, self._preempted_ids, self._finished_ids = [], [], [], []
        self._tables_changed = []
        return output

    def _schedule(self, budget: int) -> ScheduledBatch | None:
        idle, preemptions = not self.running, self.num_preemptions
        # One pass over the running requests (this runs every iteration for every one of them): what
        # each has left to compute, and which decodes cross into a block they do not hold yet. Each
        # decode is marked in flight here, as the steady state below takes them all; the general path
        # takes the marks back first.
        block_size = self.kv.block_size
        decodes: list[Request] = []
        prefills: list[Request] = []
        need_block: list[Request] = []
        last_prompt_tokens = 0  # decodes of a prompt's last token (the rest was a prefix-cache hit)
        proposals: dict[str, list[int]] = {}  # speculative decoding: decodes' proposed tokens
        speculating = (self.proposer is not None or self.runner_proposes) and len(self.running) < self.speculate_below
        for request in self.running:
            # In flight: its batch has not returned (pipeline parallelism), unless async scheduling
            # runs its next decode now, on the token that batch samples (counted in `left`).
            ahead = 0
            if request.in_flight:
                if not self._runs_ahead(request):
                    continue
                ahead = 1
            num_output = len(request.output_ids)
            scheduled = request.num_computed + request.num_in_flight_tokens  # Request.num_scheduled, inlined
            left = request.num_prompt_tokens + num_output + ahead - scheduled
            if left == 1:
                request.in_flight += 1  # _mark(request, 1), inlined: this loop runs for every request
                request.num_in_flight_tokens += 1
                decodes.append(request)
                last_prompt_tokens += not (num_output or ahead)  # (run ahead: its first output token)
                if scheduled >= len(request.block_tables[0]) * block_size:  # (num_blocks, inlined: running, it holds some)
                    need_block.append(request)
                if speculating and num_output and request.can_speculate:
                    if request.spec_paused:
                        request.spec_paused -= 1
                    else:
                        drafts = self._propose(request)
                        if drafts:
                            proposals[request.request_id] = drafts
            elif left > 1:
                prefills.append(request)
        if not prefills and not proposals and len(decodes) <= min(self.max_num_seqs, budget) \
                and self._grow_all(need_block):  # fmt: skip
            # The steady state: every request decodes, all fit, and no block is missing, so nothing is
            # preempted and the loop below would take every decode as it is, in order.
            batch = ScheduledBatch(decodes, [1] * len(decodes), num_decodes=len(decodes))
            budget -= len(decodes)
            self.num_prompt_tokens_computed += last_prompt_tokens
        else:
            for request in decodes:  # only what the loop below schedules is in flight
                _mark(request, -1)
            batch = ScheduledBatch([], [])
            for i, request in enumerate(decodes + prefills):
                if len(batch.requests) == self.max_num_seqs or budget == 0:
                    break
                if request.status is not _RUNNING:  # preempted in this loop
                    continue
                num_new = min(request.num_tokens + (request.in_flight > 0) - request.num_scheduled, budget)
                drafts = self._fit_proposals(request, proposals[request.request_id], budget) \
                    if proposals and request.request_id in proposals else None  # fmt: skip
                if self._make_room(request, num_new + len(drafts or ()), batch):
                    budget -= self._add(batch, request, num_new + len(drafts or ()), drafts)
                    batch.num_decodes += i < len(decodes)  # the decodes come first
        # Nobody is admitted in an iteration that had to preempt: the blocks it freed would go straight
        # to a newcomer, and the pool would thrash (vLLM's rule too). In request-level mode a request
        # whose grammar is still compiling does not hold the batch back: it joins the next one.
        if (not self.request_level or idle) and self.num_preemptions == preemptions:
            self._admit(batch, budget)
        return batch if batch.requests else None

    def _admit(self, batch: ScheduledBatch, budget: int) -> None:
        """Admits waiting requests into the batch, first come first served, while they fit. A request
        whose LoRA adapter cannot be made resident (every slot holds an adapter in use) is passed over
        and keeps its place, as vLLM does; a request the K/V pool cannot take stops admission (strict
        FCFS: a later, smaller request does not overtake it)."""
        passed_over: list[Request] = []
        while self.waiting and len(self.running) < self.max_running and len(batch.requests) < self.max_num_seqs \
                and budget > 0:  # fmt: skip
            request = self.waiting.head(self.clock())
            assert request is not None
            wait, fork_of = self._fork_source(request) if request.prefix_from is not None else (False, None)
            if wait:  # a later sample: its sample 0 is computing the prompt it will share
                self.waiting.remove(request)
                passed_over.append(request)
                continue
            if request.lora is not None and self.loras is not None and not self.loras.acquire(request.lora):
                self.waiting.remove(request)
                passed_over.append(request)
                continue
            if not self.kv.admit(request, others_running=bool(self.running), fork_of=fork_of, step_tokens=budget):
                self._release_adapter(request)
                break
            self._tables_changed.append(request)
            if request.block_copies:
                self._block_copies += request.block_copies
                request.block_copies = []
            request.prefix_from = None  # admitted again (after a preemption), it computes its own
            if request.first_scheduled_time is None:  # its queue time ends; its prefix-cache hits count
                request.first_scheduled_time = self.clock()
                request.num_cached_tokens = request.num_computed if fork_of is None else 0
            self.waiting.remove(request)
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            budget -= self._add(batch, request, min(request.num_tokens - request.num_computed, budget))
        for request in reversed(passed_over):  # back at the head of its class, in order
            self.waiting.appendleft(request)

    def _fork_source(self, request: Request) -> tuple[bool, Request | None]:
        """For a later sample of a request with n > 1 (`prefix_from`): (wait, sample 0). It waits
        while sample 0 computes their prompt; once that one has computed all but the last token, this
        one is admitted as its fork (KVCacheManager.admit). It computes its own prompt where sample 0
        has ended, has given back blocks outside a sliding window, or in request-level mode (a batch
        is admitted at once, so no sample could wait for another)."""
        source = self._requests.get(request.prefix_from)  # type: ignore[arg-type]
        if source is None or self.request_level:
            return False, None
        if source.status is not RequestStatus.RUNNING or source.num_computed < request.num_prompt_tokens - 1:
            return True, None
        return False, (None if any(source.num_dropped_blocks) else source)

    def _release_adapter(self, request: Request) -> None:
        """The request no longer runs (or was not admitted after all): its adapter loses a holder."""
        if request.lora is not None and self.loras is not None:
            self.loras.release(request.lora)

    def _grow_all(self, requests: list[Request]) -> bool:
        """Gives each decode (already marked scheduled) its next block, if the pool has one for every
        one of them (no preemption needed); False, holding nothing more, if it has not."""
        if not requests:
            return True
        if len(requests) * self.kv.num_groups > self.kv.pool.num_free:
            return False
        return all([self._grow(request, 0) for request in requests])

    def _grow(self, request: Request, num_new_tokens: int) -> bool:
        """KVCacheManager.grow, recording a request whose table it grew (the runners are sent its new blocks)."""
        num_blocks = request.num_blocks
        if not self.kv.grow(request, num_new_tokens):
            return False
        if request.num_blocks != num_blocks:
            self._tables_changed.append(request)
        return True

    def _schedule_suspects(self, budget: int) -> ScheduledBatch | None:
        """The next half of a failed batch, alone: its members still running, nobody else."""
        while self._suspects:
            batch = ScheduledBatch([], [], rerun=True)
            for request in self._suspects.popleft():
                if request.status is not RequestStatus.RUNNING or request.in_flight or budget == 0:
                    continue  # ended or preempted meanwhile: no longer a suspect
                num_new = min(request.num_tokens - request.num_computed, budget)
                if self._make_room(request, num_new, batch):
                    budget -= self._add(batch, request, num_new)
            if batch.requests:
                return batch
        return None

    def _add(self, batch: ScheduledBatch, request: Request, num_new: int, drafts: list[int] | None = None) -> int:
        first = request.num_scheduled
        _mark(request, 1, num_new)
        if drafts:
            batch.spec[len(batch.requests)] = drafts
        batch.requests.append(request)
        batch.num_new_tokens.append(num_new)
        self.num_prompt_tokens_computed += max(min(first + num_new, request.num_prompt_tokens) - first, 0)
        return num_new

    def _propose(self, request: Request) -> list[int]:
        """The tokens proposed after a decode's last one: at most what its `max_tokens` leaves after
        the token the step samples anyway, and up to (with) the first stop token among them (while
        a min_tokens ban is on, the rows it covers reject a stop token). With a draft model or an
        EAGLE head, placeholders (PROPOSED_BY_RUNNER) the model runner fills in."""
        limit = request.params.max_tokens - len(request.output_ids) - 1
        if self.runner_proposes:  # a grammar's masks need the proposals here: constrained requests go without
            return [] if request.structured else [PROPOSED_BY_RUNNER] * min(self.runner_proposes, limit)
        assert self.proposer is not None
        drafts = self.proposer.propose(request, limit)
        for i, token in enumerate(drafts):
            if token in request.stop_ids:
                drafts = drafts[: i + 1]
                break
        if request.structured and drafts:  # what its grammar refuses could never be accepted
            drafts = drafts[: self.structured.valid_prefix(request.request_id, drafts)]
        return drafts

    def _pace_proposals(self, request: Request, accepted: int) -> None:
        """After a request's verify step: from its SPEC_PAUSE_AFTER-th fruitless round in a row (none
        of its proposals accepted) its decodes pause proposing, SPEC_PAUSE_FIRST of its steps and
        SPEC_PAUSE_GROWTH times longer after each further one, at most `max_pause_steps`; a round
        that accepts any resumes at once. Where proposals are never right (a draft that does not fit
        the text, text that does not repeat) their cost is then two rounds in a request's first 64
        steps and one in each pause after, instead of every step's; where they are, one miss (a
        phrase's end) pauses nothing. Each request paces itself by its own steps, so a seeded
        request's tokens do not depend on what else runs."""
        if accepted:
            request.spec_fruitless = 0
            return
        request.spec_fruitless += 1
        beyond = request.spec_fruitless - SPEC_PAUSE_AFTER
        if self.max_pause_steps and beyond >= 0:  # (the exponent bounded: any cap is reached long before)
            request.spec_paused = min(SPEC_PAUSE_FIRST * SPEC_PAUSE_GROWTH ** min(beyond, 8), self.max_pause_steps)

    def _fit_proposals(self, request: Request, drafts: list[int], budget: int) -> list[int] | None:
        """The proposals the decode runs: those the token budget leaves room for after its last
        token, if the pool has their blocks free (they never preempt a request)."""
        drafts = drafts[: budget - 1]
        if drafts and not self._grow(request, 1 + len(drafts)):
            return None
        return drafts or None

    def _runs_ahead(self, request: Request) -> bool:
        """Async scheduling: whether a request in flight gets its next decode now. Its one batch in
        flight must sample its next token (the placeholder the runner fills on the device), that
        token must not end it by length, and nothing of its next step may need the token on the host
        (`Request.can_run_ahead`). A stop token found when the batch lands costs the step run ahead,
        which is dropped (`update_from_output`)."""
        speculates = self.proposer is not None or self.runner_proposes  # proposals are made from the host's tokens
        return (self.async_scheduling and not speculates and request.in_flight == 1 and request.can_run_ahead
                and request.num_scheduled == request.num_tokens
                and len(request.output_ids) + 1 < request.params.max_tokens)  # fmt: skip

    def _make_room(self, request: Request, num_new: int, batch: ScheduledBatch) -> bool:
        """Grows the request's block table for its next tokens, preempting running requests (the
        lowest priority, the most recently admitted of it first; never one in flight or in this batch)
        until it fits. False if it cannot run this iteration: nothing left to preempt, or it was
        itself the one preempted."""
        while not self._grow(request, num_new):
            candidates = (r for r in reversed(self.running) if not r.in_flight and r not in batch.requests)
            victim = max(candidates, key=lambda r: r.priority, default=None)  # max keeps the first, the newest
            if victim is None:
                return False
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        """Its blocks go back to the pool and it waits at the head of the queue with the tokens it
        produced. Swapped (`KVCacheManager.swap_out`), it keeps its computed tokens, and re-admitted
        it gets its K/V back and goes on; else preempted by recompute, it prefills prompt and outputs
        together when re-admitted. Its reported tokens are never sent again. The runners free its
        row and keep its tokens and generator (worker/input_batch.py), as its grammar's matcher lives
        on here: it has accepted exactly the tokens the request keeps."""
        if not self.kv.swap_out(request):
            self.kv.free(request)
            request.num_computed = 0
            request.pooled_sum = None  # its recompute pools its prompt again
        request.num_blocks_sent = 0
        self._shrunk.pop(request.request_id, None)  # the runners free its whole table
        self._preempted_ids.append(request.request_id)
        self.num_preemptions += 1
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.running.remove(request)
        self._release_adapter(request)
        self.waiting.appendleft(request)

    def update_from_output(
        self, batch: ScheduledBatch, sampled: list[int], logprobs: list[TokenLogprobs | None] | None = None,
        prompt_logprobs: list[PromptLogprobsChunk] | None = None, pooled: list[PooledChunk] | None = None,
        num_accepted: list[int] | None = None, spec_logprobs: list[list[TokenLogprobs] | None] | None = None,
        spec_tokens: list[list[int]] | None = None,
    ) -> CoreOutputs:  # fmt: skip
        """Appends each request's new token (and its logprobs, if it asked; its prompt logprobs go
        out with its first token) and finishes those that hit a token-level stop. A request whose
        prompt chunk did not reach its last token gets no token and no output; an embedding request
        whose prompt is computed ends with its embedding. A constrained request's matcher accepts
        its token first: once its grammar accepted EOS it ends with "stop" (with `ignore_eos` too: a
        complete grammar allows nothing else); a token its grammar refuses (the mask should make
        that impossible) ends it with "error", and the token is dropped. A request that verified
        proposals (`batch.spec`) gets its accepted ones and the token after them (`num_accepted`, and
        `spec_logprobs`, per request of batch.spec in order; `spec_tokens`: the proposals as the runner
        verified them, which it made itself where the batch holds placeholders)."""
        requests = batch.requests
        # The lengths are checked once here, so the loop's zip need not be strict.
        if not len(requests) == len(batch.num_new_tokens) == len(sampled) or (logprobs and len(logprobs) != len(sampled)):
            raise ValueError(f"{len(requests)} requests scheduled, {len(sampled)} tokens sampled")
        if prompt_logprobs:
            _hold_prompt_logprobs(requests, prompt_logprobs)
        for chunk in pooled or ():
            _hold_pooled(requests[chunk.position], chunk.vector)
        verified: dict[int, tuple[list[int], int, list[TokenLogprobs] | None]] = {}
        if batch.spec:
            if num_accepted is None or len(num_accepted) != len(batch.spec):
                raise ValueError(f"{len(batch.spec)} requests verified proposals, {len(num_accepted or ())} results")
            if spec_tokens:  # the runner's own proposals, where it made them
                if [len(t) for t in spec_tokens] != [len(d) for d in batch.spec.values()]:
                    raise ValueError("the runner verified proposals of other lengths than the batch scheduled")
                batch.spec = dict(zip(batch.spec, spec_tokens, strict=True))
            verified = {position: (drafts, accepted, spec_logprobs[i] if spec_logprobs else None)
                        for i, ((position, drafts), accepted) in enumerate(zip(batch.spec.items(), num_accepted, strict=True))}  # fmt: skip
        # This loop runs for every request every iteration. A request that goes on, with nothing to
        # report but its new token (no logprobs, nothing held back), goes out in the two columns.
        outputs: list[CoreOutput] = []
        request_ids: list[str] = []
        token_ids: list[int] = []
        prefix_caching, generated = self.kv.enable_prefix_caching, 0
        for position, (request, num_new, token, token_logprobs) in enumerate(zip(
                requests, batch.num_new_tokens, sampled, logprobs or itertools.repeat(None), strict=False)):  # fmt: skip
            request.in_flight -= 1  # _mark(request, -1, -num_new), inlined: this loop runs for every request
            request.num_in_flight_tokens -= num_new
            if request.status is _FINISHED:  # ended while in flight: only with no batch left is its K/V free
                if not request.in_flight:
                    self.kv.free(request)
                continue
            if verified and position in verified:
                outputs.append(self._land_speculative(request, token, *verified[position]))
                continue
            output_ids = request.output_ids
            num_computed = request.num_computed = request.num_computed + num_new
            if prefix_caching:
                self.kv.register_computed(request)
            if num_computed < request.num_prompt_tokens + len(output_ids):
                continue  # a prefill chunk short of the last token: nothing was sampled
            if request.pooling is not None:  # an embedding request: its prompt is pooled, no token kept
                outputs.append(self._embedded(request))
                continue
            if request.structured:
                outputs.append(self._land_constrained(request, token, token_logprobs))
                continue
            generated += 1
            output_ids.append(token)
            if token_logprobs is not None:  # the sampler returns them for the rows that asked only
                request.output_logprobs.append(token_logprobs)
            reason = check_stop(request, token)
            if reason is None and request.output_logprobs is None and request.num_reported == len(output_ids) - 1 \
                    and request.prompt_logprobs is None:  # fmt: skip
                request.num_reported += 1
                request_ids.append(request.request_id)
                token_ids.append(token)
                continue
            self._recorded_ids.append(request.request_id)
            self._recorded_tokens.append(token)
            if reason is not None:
                self._end(request, reason)
            outputs.append(self._output(request))
        self.num_generated_tokens += generated
        self._recorded_ids += request_ids  # the columns' tokens are recorded too
        self._recorded_tokens += token_ids
        return self._release(CoreOutputs(request_ids, token_ids, outputs))

    def _land_speculative(self, request: Request, token: int, drafts: list[int], accepted: int,
                          token_logprobs: list[TokenLogprobs] | None) -> CoreOutput:  # fmt: skip
        """A request whose step verified `drafts`: its last token and the first `accepted` proposals
        are computed now, and it gets those proposals and `token` after them, each checked for a stop
        in turn (what follows a stop is dropped). Blocks taken for rejected proposals go back."""
        if not 0 <= accepted <= len(drafts):
            raise ValueError(f"request {request.request_id}: {accepted} of {len(drafts)} proposals accepted")
        self.num_spec_drafts += 1
        self.num_spec_draft_tokens += len(drafts)
        self.num_spec_accepted_tokens += accepted
        for i in range(accepted):
            self.spec_accepted_per_pos[i] += 1
        request.num_draft_tokens += len(drafts)
        request.num_accepted_tokens += accepted
        self._pace_proposals(request, accepted)
        request.num_computed += 1 + accepted
        self.kv.register_computed(request)
        ended = self._land_tokens(request, [*drafts[:accepted], token], token_logprobs)
        if ended is not None:
            return ended
        if self.kv.trim(request):  # the runners cut their copy too
            self._shrunk[request.request_id] = request.num_blocks
            request.num_blocks_sent = min(request.num_blocks_sent, request.num_blocks)
        return self._output(request)

    def _embedded(self, request: Request) -> CoreOutput:
        """An embedding request whose prompt is computed: its pooled vector (the mean divides the sum
        by the prompt's length), cut to its `dimensions`, then L2-normalised where the model's pooling
        says so (vLLM's order); it ends with "stop"."""
        assert request.pooling is not None
        if request.pooled_sum is None:
            self._end(request, FinishReason.ERROR)
            return self._output(request, "the model returned no pooled hidden state for this embedding request")
        vector = np.array(request.pooled_sum, dtype=np.float64)
        if self.pooling.mode == "mean":
            vector /= request.num_prompt_tokens
        if request.pooling.dimensions is not None:
            vector = vector[: request.pooling.dimensions]
        if self.pooling.normalize:
            vector /= max(float(np.linalg.norm(vector)), 1e-12)  # torch's F.normalize eps
        self._end(request, FinishReason.STOP)
        output = self._output(request)
        output.embedding = vector.tolist()
        return output

    def _land_constrained(self, request: Request, token: int, token_logprobs: TokenLogprobs | None) -> CoreOutput:
        """A constrained request's sampled token: its matcher accepts it first. Once its grammar
        accepted EOS it ends with "stop" (with `ignore_eos` too: a complete grammar allows nothing
        else); a token its grammar refuses (the mask should make that impossible) ends it with
        "error", and the token is dropped."""
        return self._land_tokens(request, [token], None if token_logprobs is None else [token_logprobs]) \
            or self._output(request)  # fmt: skip

    def _land_tokens(self, request: Request, tokens: list[int],
                     token_logprobs: list[TokenLogprobs] | None) -> CoreOutput | None:  # fmt: skip
        """Appends the request's new tokens (and their logprobs) one at a time, recorded for the
        runners, each checked for a stop in turn (what follows a stop is dropped); a constrained
        request's matcher accepts each first, and it ends with "stop" once its grammar accepted EOS,
        or with "error" on a token its grammar refuses (the masks should make that impossible; the
        token is dropped). Returns the request's output if it ended, else None."""
        for i, token in enumerate(tokens):
            if request.structured and not self.structured.accept(request.request_id, token):
                self._end(request, FinishReason.ERROR)
                return self._output(request, f"the sampled token {token} breaks the request's structured-output grammar")
            request.output_ids.append(token)
            self._recorded_ids.append(request.request_id)
            self._recorded_tokens.append(token)
            self.num_generated_tokens += 1
            if token_logprobs is not None:
                request.output_logprobs.append(token_logprobs[i])
            if request.structured and self.structured.is_terminated(request.request_id):
                reason: FinishReason | None = FinishReason.STOP
            else:
                reason = check_stop(request, token)
            if reason is not None:
                self._end(request, reason)
                return self._output(request)
        return None

    def finish(self, request_id: str, reason: FinishReason, error: str | None = None) -> CoreOutputs:
        """Ends a waiting or running request now (an abort: cancelled, a stop string, an error).

        An unknown or already finished id is ignored: an abort may race the request's own end.
        """
        request = self._find(request_id)
        if request is None:
            return CoreOutputs()
        self._end(request, reason)
        return self._release(CoreOutputs(others=[self._output(request, error)]))

    def fail_batch(self, batch: ScheduledBatch, error: str) -> CoreOutputs:
        """A batch whose forward failed. A request that failed alone ends with the error; a larger
        batch is split in halves, each re-run alone next (head of the line), so the failure is
        narrowed down to the request that causes it while the others go on. Nothing of the failed
        iteration was recorded, so a re-run computes the same tokens (a request's sampler state has
        advanced only if the failure came after its token was drawn). The engine goes on, unless
        the failure budget (EngineCore's) is spent."""
        landed = [r for r, n in zip(batch.requests, batch.num_new_tokens, strict=True) if self._landed(r, n)]
        if len(landed) > 1:
            middle = len(landed) // 2
            self._suspects.extendleft([landed[middle:], landed[:middle]])
            return CoreOutputs()
        if landed and len(batch.requests) > 1:
            # Its batch-mates were aborted while the batch ran: any of them may have been the cause,
            # so it is re-run alone before it is blamed.
            self._suspects.appendleft(landed)
            return CoreOutputs()
        outputs = []
        for request in landed:
            self._end(request, FinishReason.ERROR)
            outputs.append(self._output(request, error))
        return self._release(CoreOutputs(others=outputs))

    def fail_all(self, error: str) -> CoreOutputs:
        """The model is gone: every request ends with the error, held outputs included."""
        outputs, self._held = self._held, []
        self._suspects.clear()
        for request in [*self.running, *self.waiting, *self._compiling.values()]:
            request.in_flight = request.num_in_flight_tokens = 0
            self._end(request, FinishReason.ERROR)
            outputs.append(self._output(request, error))
        return CoreOutputs(others=outputs)

    def _landed(self, request: Request, num_new: int) -> bool:
        """Its batch has returned. False for a request that ended while the batch was in flight: with
        no batch left in flight its K/V is now safe to free, and nothing more happens to it."""
        _mark(request, -1, -num_new)
        if request.finished:
            if not request.in_flight:
                self.kv.free(request)
            return False
        return True

    def discard_batch(self, batch: ScheduledBatch) -> None:
        """A batch run ahead of one that failed (async scheduling): its results are dropped unread and
        its requests are as if it had never been scheduled; the failed batch's handling goes on."""
        for request, num_new in zip(batch.requests, batch.num_new_tokens, strict=True):
            self._landed(request, num_new)

    def _end(self, request: Request, reason: FinishReason) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
            self._release_adapter(request)
        elif request.status is RequestStatus.WAITING_FOR_GRAMMAR:
            del self._compiling[request.request_id]
        else:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        if self.proposer is not None:
            self.proposer.forget(request.request_id)
        self._finished_ids.append(request.request_id)
        del self._requests[request.request_id]
        if request.structured:  # its matcher (or its compile) goes with it
            self.structured.remove(request.request_id)
        if not request.in_flight:
            self.kv.free(request)

    def _output(self, request: Request, error: str | None = None) -> CoreOutput:
        reported = request.num_reported
        new_ids = request.output_ids[reported:]
        request.num_reported = len(request.output_ids)
        logprobs = request.output_logprobs[reported:] if request.output_logprobs is not None else None
        prompt_logprobs = None
        if new_ids and request.prompt_logprobs is not None:  # its first token: its prompt's logprobs go with it
            prompt_logprobs, request.prompt_logprobs = request.prompt_logprobs, None
        metrics = None
        if request.finished:
            metrics = RequestMetrics(request.arrival_time, request.first_scheduled_time, request.num_preemptions,
                                     request.num_cached_tokens, num_draft_tokens=request.num_draft_tokens,
                                     num_accepted_tokens=request.num_accepted_tokens)  # fmt: skip
        return CoreOutput(request.request_id, new_ids, request.finished, request.finish_reason, error, logprobs,
                          metrics, prompt_logprobs)  # fmt: skip

    def _release(self, outputs: CoreOutputs) -> CoreOutputs:
        """Iteration-level: every output goes out now. Request-level: once the batch has ended, every
        step's outputs as CoreOutputs, in order."""
        if not self.request_level:
            return outputs
        self._held += outputs
        if self.running:
            return CoreOutputs()
        released, self._held = self._held, []
        return CoreOutputs(others=released)

    def _find(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)
