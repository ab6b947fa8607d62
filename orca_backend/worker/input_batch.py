"""The persistent input batch: every request a runner holds, as rows of fixed-size arrays, kept from
step to step and changed only by the scheduler's deltas (scheduler_output.py; vLLM v1's InputBatch,
in this project's words).

A running request owns one row from the step that brings it until it ends or is preempted: its token
ids, block table, computed count and sampling columns (temperature, top-k, top-p, min_tokens,
logprobs), and its logits processing (penalty counts, logit_bias; worker/logits_processors.py). What
the sampler reads of a row (temperature, top-p, top-k, the stop ids min_tokens bans, and the logits
processing) lives on the device, written once as the row is taken, through the staging arena
(worker/staging.py); a step sends the device only its index sets and random draws. Its
generator and its tokens live on in its `RequestState` while it is preempted, so a request's tokens
are the same whether its row moved or not. Rows are `max_rows` = the most requests that can run
(max_num_seqs per batch in flight), each `max_tokens` long (the model's context, or the K/V pool if
smaller): token ids take 4 bytes per token slot, block tables 4 per block.

`prepare` turns a step's batch into the model's flat inputs with whole-array operations over the
batch's rows: no per-request Python loop in the steady state. It writes them into persistent host
buffers (pinned on CUDA; the runner moves each with one copy into persistent device buffers).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from orca_backend.scheduler_output import NewRequest, SchedulerOutput
from orca_backend.worker.logits_processors import LogitsProcessors
from orca_backend.worker.staging import StagingArena

# Columns of the device's per-row sampling tables: `sampling_values` (float32) and `sampling_ids`
# (int64: top-k, 0 off, then the stop ids min_tokens bans, padded with the first one).
TEMPERATURE, TOP_P = 0, 1
TOP_K, STOP_IDS = 0, 1


@dataclass(eq=False)
class RequestState:
    """What a runner holds of a request from its first step to its end, row or not."""

    request_id: str
    num_prompt_tokens: int
    new: NewRequest  # as it was sent (parameters, seed, stop ids)
    generator: torch.Generator | None  # random sampling only
    row: int = -1  # -1 while preempted
    token_ids: list[int] = field(default_factory=list)  # while preempted only: its tokens (the row holds them otherwise)
    draw: float = float("nan")  # while preempted only: its next uniform draw, if taken (InputBatch._drawn)


# A step's index set on the device: (batch positions, their rows of the input batch).
Positions = tuple[torch.Tensor, torch.Tensor]


@dataclass
class SamplingBatch:
    """A step's sampling work: index sets of batch positions on the device (through the staging arena),
    into the per-row tables that hold the parameters; their sizes are known on the host, so no stage
    reads a value back. Positions are of requests that sample this step, except `banned`."""

    rows: np.ndarray  # host: each request's row of the input batch
    sample: np.ndarray  # host, bool: it computes its last token this step (a prefill chunk short of it does not)
    random: Positions  # temperature > 0: drawn at random
    draws: torch.Tensor  # float32 [len(random)]: their uniform draws, from each request's generator
    biased: Positions  # logit_bias
    penalized: Positions  # presence, frequency or repetition penalty
    repetition: bool  # some penalized request has a repetition penalty
    banned: Positions  # short of min_tokens (prefill chunks too): its stop ids cannot be sampled
    logprobs: torch.Tensor  # positions asking for logprobs
    logprobs_at: list[int]  # host: the same positions
    num_logprobs: list[int]  # host: the top alternatives each of those asked for
    values: torch.Tensor  # the input batch's per-row tables (sampling_values, sampling_ids)
    ids: torch.Tensor
    processors: LogitsProcessors
    # Async scheduling: the penalized requests run ahead of their last step, (index into `penalized`,
    # index into the step's ahead_rows), host; their last token is sampled but not recorded yet.
    penalized_ahead: np.ndarray = field(default_factory=lambda: _NO_PAIRS)
    # [2, n] on the device, set by the model runner from those: (index into `penalized`, that token),
    # which the penalties count beside the recorded tokens (LogitsProcessors.apply's `unrecorded`).
    unrecorded: torch.Tensor | None = None


@dataclass
class PromptLogprobRows:
    """The logits rows a step adds after its requests' last-token rows, for the prompt logprobs of
    the requests that asked (SamplingParams.prompt_logprobs): one per prompt position of their
    chunks whose next token is a prompt token, scoring that token."""

    targets: torch.Tensor  # int64 [R] on the device: the prompt token each row scores
    target_ids: list[int]  # host: the same
    # Per asking request, in batch order: (batch position, the prompt index of its first row's
    # target, its rows, the top alternatives it asked for).
    chunks: list[tuple[int, int, int, int]]


@dataclass
class SpecRows:
    """Speculative decoding: the logits rows a step adds after its requests' last-token rows, one per
    proposed token of the requests that verify proposals: row j of a request scores the token after
    its j-th scheduled token, so it verifies proposal j (its last row, the request's own, is the
    token after every proposal). Index sets as SamplingBatch's, into these rows."""

    positions: list[int]  # host: the verifying requests' batch positions
    counts: list[int]  # host: their proposals
    drafts: torch.Tensor  # int64 [S] on the device: each row's proposed token
    draft_ids: np.ndarray  # host: the same
    rows: torch.Tensor  # int64 [S]: each row's request's row of the input batch
    random: torch.Tensor  # rows of requests sampled at random
    uniforms: torch.Tensor  # float32 [len(random), 2]: each such row's acceptance and resampling draws
    biased: torch.Tensor  # rows of requests with a logit_bias
    # Requests with penalties: their verifying rows and their own (last) rows, each counting the
    # proposals before it as output tokens (`unrecorded`: (index into those rows, token) pairs).
    penalized: torch.Tensor  # rows
    penalized_unrecorded: torch.Tensor  # int64 [2, n]
    penalized_own: Positions  # batch positions, and their input-batch rows
    penalized_own_unrecorded: torch.Tensor  # int64 [2, n]
    repetition: bool  # some penalized one has a repetition penalty
    logprobs: torch.Tensor  # rows of requests asking for logprobs
    logprob_rows: np.ndarray  # host: the same
    num_logprobs: list[int]  # host: the top alternatives each of those rows asks for
    # Rows short of min_tokens (with the proposals before each counted): their stop ids are banned.
    banned: Positions = (torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=torch.int64))


POOLING_CODES = {"": 0, "last": 1, "mean": 2, "cls": 3}  # InputBatch.pooling: each row's NewRequest.pooling


@dataclass
class PoolingRows:
    """The tokens of a step whose final hidden states its embedding requests pool, and the chunk
    each belongs to: the forward returns their hidden states, summed per chunk."""

    indices: torch.Tensor  # int64 [R] on the device: the tokens, in the flat batch
    segments: torch.Tensor  # int64 [R] on the device: each token's chunk, 0..len(positions) - 1
    positions: list[int]  # host: each chunk's request's position in the batch


@dataclass
class StepInputs:
    """A step's flat model inputs (views of the persistent host buffers, valid until the next step)."""

    input_ids: np.ndarray  # int64 [T]
    positions: np.ndarray  # int64 [T]
    slot_mapping: np.ndarray  # int64 [G, T]: the K/V slot each new token is written to, in each K/V group's pages
    flat64: np.ndarray  # the three above, one buffer [(2 + G) * T]
    query_start: np.ndarray  # int32 [B + 1]
    context_lens: np.ndarray  # int32 [B]
    # int32 [B + S + R]: each request's last token, then the rows verifying proposals, then the prompt
    # logprobs' rows
    logits_indices: np.ndarray
    flat32: np.ndarray  # the three above, one buffer [3 * B + 1 + R]
    block_tables: np.ndarray  # int32 [G, B, W], W the most blocks any context of the batch fills
    max_query_len: int
    max_context_len: int
    sampling: SamplingBatch | None  # None: a proposer's pass (worker/runner_proposer.py), which samples nothing
    lora_slots: np.ndarray | None = None  # int32 [T]: each token's adapter slot (-1: none); None when no token has one
    prompt_logprobs: PromptLogprobRows | None = None  # None: no request of the step computes prompt logprobs
    pooling: PoolingRows | None = None  # None: no embedding request pools in this step
    spec: SpecRows | None = None  # None: no request of the step verifies proposed tokens

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)

    @property
    def num_requests(self) -> int:
        return len(self.context_lens)


def ragged_arange(lengths: np.ndarray, total: int) -> np.ndarray:
    """0..n-1 for each n of `lengths`, concatenated: [2, 3] -> [0, 1, 0, 1, 2]."""
    starts = np.repeat(np.cumsum(lengths) - lengths, lengths)
    return np.arange(total, dtype=np.int64) - starts


class InputBatch:
    def __init__(
        self, max_rows: int, max_tokens: int, block_size: int, vocab_size: int, device: torch.device,
        num_groups: int = 1,
    ) -> None:  # fmt: skip
        """`num_groups`: the K/V groups (orca_backend/kv_groups.py), each with its block table per row."""
        self.max_rows, self.max_tokens, self.block_size = max_rows, max_tokens, block_size
        self.num_groups = num_groups
        self.device = device
        self.states: dict[str, RequestState] = {}
        self.row_of: dict[str, int] = {}
        self._free_rows = list(range(max_rows - 1, -1, -1))  # the lowest row first
        self.token_ids = np.zeros((max_rows, max_tokens), dtype=np.int32)
        self.num_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_computed = np.zeros(max_rows, dtype=np.int64)
        self.block_table = np.zeros((max_rows, num_groups, -(-max_tokens // block_size)), dtype=np.int32)
        self.num_blocks = np.zeros(max_rows, dtype=np.int64)
        self.temperature = np.zeros(max_rows, dtype=np.float32)
        self.min_tokens = np.zeros(max_rows, dtype=np.int64)
        self.num_logprobs = np.full(max_rows, -1, dtype=np.int64)
        self.num_prompt_logprobs = np.full(max_rows, -1, dtype=np.int64)  # -1: no prompt logprobs
        self._prompt_logprob_requests = 0  # rows whose request asks for prompt logprobs: none, the common case
        self.pooling = np.zeros(max_rows, dtype=np.int8)  # POOLING_CODES: the row's embedding request's pooling
        self._pooling_requests = 0
        self.generators: list[torch.Generator | None] = [None] * max_rows
        self.num_stop_ids = np.zeros(max_rows, dtype=np.int64)
        self.staging = StagingArena(device)
        self.sampling_values = torch.zeros((max_rows, 2), dtype=torch.float32, device=device)
        self.sampling_ids = torch.zeros((max_rows, STOP_IDS + 1), dtype=torch.int64, device=device)
        # Each row's next uniform draw, taken from its generator by the step that first needs it and
        # kept until a step sampled with it (`draws_used`): a step that fails before sampling leaves its
        # generators where a step that never ran would (NaN: none drawn).
        self._draws = torch.full((max_rows,), float("nan"), dtype=torch.float32)
        self._drawn = self._draws.numpy()
        self._random_rows = _NO_POSITIONS  # the rows of the last step's draws
        self._no_positions = torch.empty(0, dtype=torch.int64, device=device)
        # Multi-LoRA: each row's adapter slot (-1: none), found when the row is taken in `lora_slot_of`
        # (lora_id -> slot; the runner's LoRAManager keeps it); the slot stays while the row is held.
        self.lora_slot = np.full(max_rows, -1, dtype=np.int32)
        self.lora_slot_of: dict[int, int] = {}
        self.processors = LogitsProcessors(max_rows, vocab_size, device, self.staging)
        self._flat64 = _HostBuffer(np.int64, device)
        self._flat32 = _HostBuffer(np.int32, device)
        self._tables = _HostBuffer(np.int32, device)
        self._arange = np.arange(max_rows + 1, dtype=np.int32)  # a decode batch's query starts
        self._rows: tuple[int, np.ndarray] | None = None  # the last step applied, and its requests' rows
        # The rows of the last list of ids looked up, while no row was taken or freed since (`_layout`
        # counts those): in the steady state a step schedules, and records the tokens of, the same
        # requests as the one before, and the lookup is one list comparison. The sampling columns of
        # those rows are kept with them.
        self._layout = 0
        self._looked_up: tuple[int, list[str], np.ndarray, bool] | None = None
        self._columns: tuple[np.ndarray, _RowColumns] | None = None
        # A step may record several tokens of one request (set by the runner): speculative decoding's
        # accepted proposals, and under async scheduling or pipeline parallelism the tokens of two
        # steps that landed before the next was scheduled. And how often each row was taken (a draft
        # model's K/V of a row is its holder's only).
        self.several_tokens_per_step = False
        self.row_epoch = np.zeros(max_rows, dtype=np.int64)

    # ------------------------------------------------------------------ deltas
    def apply(self, step: SchedulerOutput) -> None:
        """Brings the rows up to the step (scheduler_output.py): recorded tokens are appended, ended and
        preempted requests leave their rows, new ones take rows, and so does every scheduled request
        without one (resumed after a preemption); tables grow; computed counts are the core's."""
        self.staging.begin()
        if step.recorded_ids:
            self._append_tokens(step.recorded_ids, step.recorded_tokens)
        for request_id in step.finished_ids:
            state = self.states.pop(request_id, None)
            if state is not None and state.row >= 0:
                self._free(state)
        for request_id in step.preempted_ids:
            state = self.states.get(request_id)
            if state is not None and state.row >= 0:
                row = state.row
                state.token_ids = self.token_ids[row, : self.num_tokens[row]].tolist()
                self._free(state)
        for new in step.new_requests:
            self._add(new)
        for request_id, num_blocks in zip(step.shrunk_ids, step.shrunk_num_blocks, strict=True):
            row = self.row_of.get(request_id, -1)
            if row >= 0:  # blocks of rejected proposals went back to the pool
                self.block_table[row, :, num_blocks : self.num_blocks[row]] = 0
                self.num_blocks[row] = min(num_blocks, self.num_blocks[row])
        ids = step.scheduled_ids
        rows, missing = self._lookup(ids)
        if missing:  # resumed after a preemption: its tokens go back in a row
            rows = rows.copy()
            for index in np.flatnonzero(rows < 0).tolist():
                rows[index] = self._take_row(self.states[ids[index]], [])
        if step.grown_ids:
            grown = np.fromiter(map(self.row_of.__getitem__, step.grown_ids), dtype=np.int64, count=len(step.grown_ids))
            self._append_blocks(grown, step.grown_block_ids)
        self.num_computed[rows] = step.num_computed
        for position, drafts in zip(step.spec_rows, step.spec_tokens, strict=True):
            # Proposals are not the request's tokens: they sit past its count, where the step reads its
            # inputs, until the core records the accepted ones.
            row = int(rows[position])
            end = int(self.num_tokens[row])
            if end + len(drafts) > self.max_tokens:
                raise RuntimeError(f"request {ids[position]}: {len(drafts)} proposed tokens outgrow its row "
                                   f"({self.max_tokens} tokens)")  # fmt: skip
            self.token_ids[row, end : end + len(drafts)] = drafts
        self._rows = (step.step_id, rows)

    def _append_blocks(self, rows: np.ndarray, values: list[list[int]]) -> None:
        """Appends each row's new blocks (each group's, one group after the other) after its tables'."""
        groups = self.num_groups
        counts = np.fromiter((len(blocks) // groups for blocks in values), dtype=np.int64, count=len(values))
        total = int(counts.sum())
        if not total:
            return
        at_rows = np.repeat(rows, counts)
        at_columns = np.repeat(self.num_blocks[rows], counts) + ragged_arange(counts, total)
        if int(at_columns.max()) >= self.block_table.shape[2]:
            raise RuntimeError(f"a request outgrew its row ({self.block_table.shape[2]} blocks)")
        flat = np.fromiter(itertools.chain.from_iterable(values), dtype=np.int32, count=total * groups)
        if groups == 1:
            self.block_table[:, 0][at_rows, at_columns] = flat
        else:  # [group, block] per row -> [block, group] over all rows
            parts = np.split(flat, np.cumsum(counts * groups)[:-1])
            self.block_table[at_rows, :, at_columns] = np.concatenate([part.reshape(groups, -1).T for part in parts])
        self.num_blocks[rows] += counts

    def _append_tokens(self, request_ids: list[str], tokens: list[int]) -> None:
        """The recorded tokens, into their requests' rows: one each, unless a step may bring several
        (`several_tokens_per_step`), whose ids repeat in order."""
        rows, missing = self._lookup(request_ids)
        if missing:
            rowless = [request_id for request_id, row in zip(request_ids, rows.tolist(), strict=True) if row < 0]
            raise RuntimeError(f"tokens were recorded for requests that hold no row: {rowless[:5]}")
        ends = self.num_tokens[rows]
        repeated = self.several_tokens_per_step and len(set(request_ids)) < len(request_ids)
        if repeated:  # a request's tokens go one after the other, in order
            ends = ends + _occurrence(request_ids)
        if int(ends.max()) >= self.max_tokens:
            raise RuntimeError(f"a request outgrew its row ({self.max_tokens} tokens)")
        self.token_ids[rows, ends] = tokens
        if repeated:
            np.add.at(self.num_tokens, rows, 1)
        else:
            self.num_tokens[rows] = ends + 1
        counted = np.flatnonzero(self.processors.penalized[rows]).tolist() if self.processors.penalized.any() else []
        if counted:
            self.processors.count([int(rows[i]) for i in counted], [[tokens[i]] for i in counted])

    def step_rows(self, step: SchedulerOutput) -> np.ndarray:
        """The rows of the step's scheduled requests, once `apply` took it in."""
        assert self._rows is not None and self._rows[0] == step.step_id, "step_rows() follows apply() of the same step"
        return self._rows[1]

    def _lookup(self, request_ids: list[str]) -> tuple[np.ndarray, bool]:
        """The rows of these requests (-1 for one without a row; not to be changed by the caller), and
        whether any has none."""
        looked_up = self._looked_up
        if looked_up is not None and looked_up[0] == self._layout and looked_up[1] == request_ids:
            return looked_up[2], looked_up[3]
        rows = np.fromiter(map(self.row_of.get, request_ids, itertools.repeat(-1)), dtype=np.int64, count=len(request_ids))
        missing = bool((rows < 0).any())
        self._looked_up = (self._layout, request_ids, rows, missing)
        return rows, missing

    def _add(self, new: NewRequest) -> None:
        if new.request_id in self.states:
            raise RuntimeError(f"request {new.request_id} was sent as new twice")
        p = new.params
        generator = None if p.greedy else torch.Generator().manual_seed(new.seed)
        state = self.states[new.request_id] = RequestState(new.request_id, new.num_prompt_tokens, new, generator,
                                                           token_ids=new.token_ids)  # fmt: skip
        self._take_row(state, new.block_ids)

    def _take_row(self, state: RequestState, block_ids: list[int]) -> int:
        """Writes the request's whole row: its tokens (then dropped from the state), blocks and columns."""
        if not self._free_rows:
            raise RuntimeError(f"the input batch has no free row for request {state.request_id} (all {self.max_rows} "
                               "hold running requests)")  # fmt: skip
        tokens = state.token_ids
        num_blocks = len(block_ids) // self.num_groups  # each group's table, one after the other
        if len(tokens) > self.max_tokens or num_blocks > self.block_table.shape[2]:
            raise RuntimeError(f"request {state.request_id} has {len(tokens)} tokens and {num_blocks} blocks; "
                               f"a row holds {self.max_tokens} and {self.block_table.shape[2]}")  # fmt: skip
        row = state.row = self._free_rows.pop()
        self._layout += 1
        self.row_epoch[row] += 1
        self.row_of[state.request_id] = row
        self.token_ids[row, : len(tokens)] = tokens
        self.num_tokens[row] = len(tokens)
        self.num_prompt_tokens[row] = state.num_prompt_tokens
        self.block_table[row, :, :num_blocks] = np.reshape(block_ids, (self.num_groups, num_blocks))
        self.num_blocks[row] = num_blocks
        new, p = state.new, state.new.params
        self.temperature[row] = 0.0 if p.greedy else p.temperature
        self.min_tokens[row] = p.min_tokens
        self.num_logprobs[row] = -1 if p.logprobs is None else p.logprobs
        if p.prompt_logprobs is not None:
            self.num_prompt_logprobs[row] = p.prompt_logprobs
            self._prompt_logprob_requests += 1
        if new.pooling:
            self.pooling[row] = POOLING_CODES[new.pooling]
            self._pooling_requests += 1
        self.generators[row] = state.generator
        self._drawn[row] = state.draw
        if not p.greedy or p.min_tokens:  # else the sampler never reads the row's device columns
            self._write_sampling_row(row, p.top_p, max(p.top_k, 0), new.stop_ids)
        if new.lora_id:
            slot = self.lora_slot_of.get(new.lora_id)
            if slot is None:
                raise RuntimeError(f"request {state.request_id} takes a row while its LoRA adapter (id {new.lora_id}) "
                                   "is in no slot")  # fmt: skip
            self.lora_slot[row] = slot
        self.processors.add(row, p, tokens[: state.num_prompt_tokens], tokens[state.num_prompt_tokens :])
        state.token_ids = []
        return row

    def _write_sampling_row(self, row: int, top_p: float, top_k: int, stop_ids: list[int]) -> None:
        """The row's device sampling columns, staged (the stop ids padded with the first one: banning
        a token twice is banning it)."""
        self.num_stop_ids[row] = len(stop_ids)
        if STOP_IDS + len(stop_ids) > self.sampling_ids.shape[1]:
            width = max(STOP_IDS + len(stop_ids), 2 * self.sampling_ids.shape[1])
            wider = torch.zeros((self.max_rows, width), dtype=torch.int64, device=self.device)
            wider[:, : self.sampling_ids.shape[1]] = self.sampling_ids
            self.sampling_ids = wider
        ids = np.zeros(self.sampling_ids.shape[1], dtype=np.int64)
        ids[TOP_K] = top_k
        if stop_ids:
            ids[STOP_IDS:] = stop_ids[0]
            ids[STOP_IDS : STOP_IDS + len(stop_ids)] = stop_ids
        self.sampling_ids[row].copy_(self.staging.put(ids))
        self.sampling_values[row].copy_(self.staging.put(np.array([self.temperature[row], top_p], dtype=np.float32)))

    def _free(self, state: RequestState) -> None:
        row = state.row
        # A step's tables are W columns of the rows, W its widest context: zeros past a request's blocks,
        # as a from-scratch build has, never the blocks of a row's earlier holder.
        self.block_table[row, :, : self.num_blocks[row]] = 0
        self.num_blocks[row] = 0
        del self.row_of[state.request_id]
        self.processors.remove(row)
        self.generators[row] = None
        state.draw, self._drawn[row] = float(self._drawn[row]), np.nan
        self.lora_slot[row] = -1
        if self.num_prompt_logprobs[row] >= 0:
            self.num_prompt_logprobs[row] = -1
            self._prompt_logprob_requests -= 1
        if self.pooling[row]:
            self.pooling[row] = 0
            self._pooling_requests -= 1
        state.row = -1
        self._free_rows.append(row)
        self._layout += 1

    # ------------------------------------------------------------------ a step's inputs
    def prepare(self, step: SchedulerOutput) -> StepInputs:
        """The step's flat inputs and sampling columns, from the rows of its scheduled requests."""
        assert self._rows is not None and self._rows[0] == step.step_id, "prepare() follows apply() of the same step"
        rows = self._rows[1]
        count = len(rows)
        total = sum(step.num_scheduled_tokens)
        first = self.num_computed[rows]  # each request's first new position
        prompt_rows, prompt_indices = None, None
        if self._prompt_logprob_requests:
            prompt_rows, prompt_indices = self._prompt_logprob_rows(rows, first, step.num_scheduled_tokens)
        num_spec, spec_indices = None, None
        if step.spec_rows:
            num_spec = np.zeros(count, dtype=np.int64)
            num_spec[step.spec_rows] = [len(drafts) for drafts in step.spec_tokens]
            ends = np.cumsum(step.num_scheduled_tokens)[step.spec_rows] - 1  # each one's last token, in the flat batch
            counts = num_spec[step.spec_rows]
            spec_indices = np.repeat(ends - counts, counts) + ragged_arange(counts, int(counts.sum()))
        extra = [part for part in (spec_indices, prompt_indices) if part is not None]
        num_extra = sum(map(len, extra))
        flat32 = self._flat32.take(3 * count + 1 + num_extra)
        query_start, context_lens = flat32[: count + 1], flat32[count + 1 : 2 * count + 1]
        logits_indices = flat32[2 * count + 1 :]
        if extra:
            logits_indices[count:] = np.concatenate(extra)
            logits_indices = logits_indices[:count]  # filled below; the view the step takes is the whole tail
        groups = self.num_groups
        flat64 = self._flat64.take((2 + groups) * total)
        input_ids, positions = flat64[:total], flat64[total : 2 * total]
        slot_mapping = flat64[2 * total :].reshape(groups, total)
        if total == count:  # one token each (decodes): the requests' rows are the tokens' rows
            query_start[:] = self._arange[: count + 1]
            logits_indices[:] = self._arange[:count]
            np.add(first, 1, out=context_lens, casting="unsafe")
            token_rows = rows
            positions[:] = first
            max_query_len = 1
        else:
            num_new = np.array(step.num_scheduled_tokens, dtype=np.int64)
            query_start[0] = 0
            np.cumsum(num_new, out=query_start[1:])
            np.add(first, num_new, out=context_lens, casting="unsafe")
            np.subtract(query_start[1:], 1, out=logits_indices)
            token_rows = np.repeat(rows, num_new)
            np.add(np.repeat(first, num_new), ragged_arange(num_new, total), out=positions)
            max_query_len = int(num_new.max())
        input_ids[:] = self.token_ids[token_rows, positions]
        block_index, offset = np.divmod(positions, self.block_size)
        if groups == 1:
            np.multiply(self.block_table[token_rows, 0, block_index], self.block_size, out=slot_mapping[0])
        else:
            np.multiply(self.block_table[token_rows, :, block_index].T, self.block_size, out=slot_mapping)
        slot_mapping += offset
        max_context_len = int(context_lens.max())
        width = -(-max_context_len // self.block_size)
        block_tables = self._tables.take(groups * count * width).reshape(groups, count, width)
        if groups == 1:
            np.take(self.block_table[:, 0, :width], rows, axis=0, out=block_tables[0])
        else:
            block_tables[:] = self.block_table[rows, :, :width].transpose(1, 0, 2)
        lora_slots = None
        if self.lora_slot_of:  # LoRA is on: the batch's tokens' adapters, if any token has one
            row_slots = self.lora_slot[rows]
            if row_slots.max() >= 0:
                lora_slots = row_slots if total == count else np.repeat(row_slots, num_new)
        return StepInputs(
            input_ids, positions, slot_mapping, flat64, query_start, context_lens, flat32[2 * count + 1 :], flat32,
            block_tables, max_query_len=max_query_len, max_context_len=max_context_len,
            sampling=self._sampling(rows, context_lens, step.ahead_rows, num_spec), lora_slots=lora_slots,
            prompt_logprobs=prompt_rows, spec=self._spec_rows(step, rows) if step.spec_rows else None,
            pooling=self._pooling_rows(rows, first, step.num_scheduled_tokens) if self._pooling_requests else None,
        )  # fmt: skip

    def _pooling_rows(self, rows: np.ndarray, first: np.ndarray, num_scheduled: list[int]) -> PoolingRows | None:
        """The tokens the step's embedding requests pool: every token of a chunk for "mean", the
        prompt's last for "last" and its first for "cls" where the chunk holds it."""
        indices: list[np.ndarray] = []
        positions: list[int] = []
        starts = list(itertools.accumulate(num_scheduled, initial=0))
        for position in np.flatnonzero(self.pooling[rows]).tolist():
            mode, start = int(self.pooling[rows[position]]), int(first[position])
            end, num_prompt = start + num_scheduled[position], int(self.num_prompt_tokens[rows[position]])
            if mode == POOLING_CODES["mean"]:
                taken = np.arange(starts[position], starts[position + 1], dtype=np.int64)
            elif mode == POOLING_CODES["last"] and end == num_prompt:
                taken = np.array([starts[position + 1] - 1], dtype=np.int64)
            elif mode == POOLING_CODES["cls"] and start == 0:
                taken = np.array([starts[position]], dtype=np.int64)
            else:
                continue
            indices.append(taken)
            positions.append(position)
        if not positions:
            return None
        segments = np.repeat(np.arange(len(positions), dtype=np.int64), [len(i) for i in indices])
        return PoolingRows(self.staging.put(np.concatenate(indices)), self.staging.put(segments), positions)

    def _prompt_logprob_rows(
        self, rows: np.ndarray, first: np.ndarray, num_scheduled: list[int]
    ) -> tuple[PromptLogprobRows | None, np.ndarray | None]:  # fmt: skip
        """The step's prompt-logprob rows, and their tokens' indices in the flat batch: position p of a
        chunk (p from its first new position) scores prompt token p + 1, for every p + 1 < the prompt's
        length. A request that has sampled already (a recompute after a preemption) computes none:
        its prompt logprobs went out with its first token."""
        chunks: list[tuple[int, int, int, int]] = []
        indices: list[np.ndarray] = []
        targets: list[np.ndarray] = []
        starts = list(itertools.accumulate(num_scheduled, initial=0))
        for position in np.flatnonzero(self.num_prompt_logprobs[rows] >= 0).tolist():
            row = int(rows[position])
            num_prompt = int(self.num_prompt_tokens[row])
            if self.num_tokens[row] > num_prompt:
                continue
            start = int(first[position])
            end = min(start + num_scheduled[position], num_prompt - 1)
            if end <= start:
                continue
            indices.append(np.arange(starts[position], starts[position] + end - start, dtype=np.int32))
            targets.append(self.token_ids[row, start + 1 : end + 1].astype(np.int64))
            chunks.append((position, start + 1, end - start, int(self.num_prompt_logprobs[row])))
        if not chunks:
            return None, None
        target_ids = np.concatenate(targets)
        rows_out = PromptLogprobRows(self.staging.put(target_ids), target_ids.tolist(), chunks)
        return rows_out, np.concatenate(indices)

    def _spec_rows(self, step: SchedulerOutput, rows: np.ndarray) -> SpecRows:
        """The rows verifying the step's proposals, and the draws of those sampled at random. A
        request's draws come from a generator seeded by its seed and its length: the same at the
        same place of its text, whatever ran before (a failed step's retry included)."""
        positions, drafts = step.spec_rows, step.spec_tokens
        counts = [len(d) for d in drafts]
        spec_rows = np.repeat(rows[positions], counts)
        starts = list(itertools.accumulate(counts, initial=0))
        random, biased, logprobs, num_logprobs, uniforms = [], [], [], [], []
        penalized, unrecorded, own, own_rows, own_unrecorded, repetition = [], [], [], [], [], False
        banned: list[int] = []
        for i, position in enumerate(positions):
            row = int(rows[position])
            span = range(starts[i], starts[i + 1])
            short = int(self.min_tokens[row]) - int(self.num_tokens[row] - self.num_prompt_tokens[row])
            if short > 0 and self.num_stop_ids[row]:  # row j follows j proposals: banned while still short
                banned += span[:short]
            if self.processors.penalized[row]:  # row j counts proposals 0 .. j-1; its own row all of them
                for j in range(counts[i]):
                    unrecorded += [(len(penalized), token) for token in drafts[i][:j]]
                    penalized.append(starts[i] + j)
                own_unrecorded += [(len(own), token) for token in drafts[i]]
                own.append(position)
                own_rows.append(row)
                repetition |= bool(self.processors.repetitive[row])
            if self.temperature[row] > 0:
                random += span
                seed = self.states[step.scheduled_ids[position]].new.seed
                uniforms.append(np.random.default_rng([seed, int(self.num_tokens[row])]).random((counts[i], 2)))
            if self.processors.biased[row]:
                biased += span
            if self.num_logprobs[row] >= 0:
                logprobs += span
                num_logprobs += [int(self.num_logprobs[row])] * counts[i]
        pairs = [np.array(p, dtype=np.int64).reshape(-1, 2).T.reshape(-1) for p in (unrecorded, own_unrecorded)]
        index = np.concatenate([np.concatenate(drafts), spec_rows, random, biased, logprobs, penalized, own, own_rows,
                                *pairs, banned, spec_rows[banned]]).astype(np.int64)  # fmt: skip
        sizes = [len(spec_rows), len(spec_rows), len(random), len(biased), len(logprobs), len(penalized), len(own),
                 len(own), len(pairs[0]), len(pairs[1]), len(banned), len(banned)]  # fmt: skip
        split = self.staging.put(index).split_with_sizes(sizes)
        draws = self.staging.put(np.concatenate(uniforms).astype(np.float32)) if uniforms else self._draws[:0]
        return SpecRows(list(positions), counts, split[0], index[: len(spec_rows)], split[1], split[2], draws, split[3],
                        split[5], split[8].view(2, -1), (split[6], split[7]), split[9].view(2, -1), repetition,
                        split[4], np.array(logprobs, dtype=np.int64), num_logprobs, (split[10], split[11]))  # fmt: skip

    def _sampling(self, rows: np.ndarray, context_lens: np.ndarray, ahead_rows: list[int],
                  num_spec: np.ndarray | None = None) -> SamplingBatch:  # fmt: skip
        """The step's index sets, from the host's columns (numpy over the batch), and each random
        request's draw from its generator, staged for the device in one copy each."""
        columns = self._columns[1] if self._columns is not None and self._columns[0] is rows else None
        if columns is None:
            columns = self._row_columns(rows)
            self._columns = (rows, columns)
        num_tokens = self.num_tokens[rows]
        if ahead_rows:  # their last token, sampled by the step still in flight, is not recorded yet
            num_tokens = num_tokens.copy()
            num_tokens[ahead_rows] += 1
        # A request verifying proposals samples its last row: its count of tokens stops before them.
        sample = (context_lens if num_spec is None else context_lens - num_spec) == num_tokens
        empty = _NO_POSITIONS
        # A prefill chunk short of its last token samples nothing: its generator must not advance.
        random = np.flatnonzero(columns.random & sample) if columns.random.any() else empty
        banned = empty
        if columns.min_tokens.any():  # a verifying request's own row follows its proposals
            outputs = num_tokens - self.num_prompt_tokens[rows] + (num_spec if num_spec is not None else 0)
            banned = np.flatnonzero((outputs < columns.min_tokens) & columns.has_stop_ids)
        logprobs = np.flatnonzero(columns.asking_logprobs & sample) if columns.asking_logprobs.any() else empty
        biased = np.flatnonzero(columns.biased & sample) if columns.biased.any() else empty
        penalized = empty
        if columns.penalized.any():  # a request verifying proposals has its own row penalized with them (SpecRows)
            penalized = np.flatnonzero(columns.penalized & sample & (num_spec == 0 if num_spec is not None else True))
        sets = (random, biased, penalized, banned)
        sizes = [len(a) for a in sets for _ in range(2)] + [len(logprobs)]
        index = self._no_positions
        if sum(sizes):
            index = self.staging.put(np.concatenate([part for a in sets for part in (a, rows[a])] + [logprobs]))
        split = index.split_with_sizes(sizes)
        draws = self._draws[:0]
        self._random_rows = random_rows = rows[random]
        if len(random):
            for position, row in zip(random.tolist(), random_rows.tolist(), strict=True):
                if np.isnan(self._drawn[row]):
                    torch.rand(1, generator=columns.generators[position], out=self._draws[row : row + 1])
            draws = self.staging.put(self._drawn[random_rows])
        penalized_ahead = _NO_PAIRS
        if ahead_rows and len(penalized):
            ahead_at = {position: k for k, position in enumerate(ahead_rows)}
            pairs = [(i, ahead_at[p]) for i, p in enumerate(penalized.tolist()) if p in ahead_at]
            if pairs:
                penalized_ahead = np.array(pairs, dtype=np.int64).T
        return SamplingBatch(
            rows, sample, (split[0], split[1]), draws, (split[2], split[3]), (split[4], split[5]),
            bool(columns.repetitive[penalized].any()), (split[6], split[7]), split[8],
            logprobs.tolist(), columns.num_logprobs[logprobs].tolist(), self.sampling_values, self.sampling_ids, self.processors,
            penalized_ahead,
        )  # fmt: skip

    def draws_used(self) -> None:
        """The last prepared step has sampled (its kernels are queued): its rows draw anew next time."""
        self._drawn[self._random_rows] = np.nan
        self._random_rows = _NO_POSITIONS

    def _row_columns(self, rows: np.ndarray) -> _RowColumns:
        temperature = self.temperature[rows]
        num_logprobs = self.num_logprobs[rows]
        processors = self.processors
        return _RowColumns(
            temperature > 0, self.min_tokens[rows], self.num_stop_ids[rows] > 0, num_logprobs, num_logprobs >= 0,
            processors.biased[rows], processors.penalized[rows], processors.repetitive[rows],
            # Greedy requests have no generator: a batch of them (the common case) skips the list.
            [self.generators[row] for row in rows.tolist()] if temperature.any() else [],
        )  # fmt: skip


_NO_POSITIONS = np.zeros(0, dtype=np.int64)
_NO_PAIRS = np.zeros((2, 0), dtype=np.int64)


def _occurrence(ids: list[str]) -> np.ndarray:
    """Each entry's count of equal entries before it: [a, b, a, a] -> [0, 0, 1, 2]."""
    seen: dict[str, int] = {}
    counts = []
    for key in ids:
        count = seen[key] = seen.get(key, -1) + 1
        counts.append(count)
    return np.array(counts, dtype=np.int64)


@dataclass
class _RowColumns:
    """The host's sampling columns of some rows, in their order: what does not change while they hold
    the same requests."""

    random: np.ndarray  # bool: temperature > 0
    min_tokens: np.ndarray
    has_stop_ids: np.ndarray  # bool: something for min_tokens to ban
    num_logprobs: np.ndarray
    asking_logprobs: np.ndarray  # bool
    biased: np.ndarray  # bool
    penalized: np.ndarray  # bool
    repetitive: np.ndarray  # bool
    generators: list[torch.Generator | None]


class _HostBuffer:
    """A persistent host array (pinned for a CUDA runner), grown by doubling: a step's inputs are
    views of it, so nothing is allocated per step."""

    def __init__(self, dtype: type, device: torch.device) -> None:
        self.dtype, self.pin = dtype, device.type == "cuda"
        self.array = self._allocate(1024)

    def _allocate(self, size: int) -> np.ndarray:
        return torch.empty(size, dtype=torch.from_numpy(np.empty(0, self.dtype)).dtype, pin_memory=self.pin).numpy()

    def take(self, size: int) -> np.ndarray:
        if size > len(self.array):
            self.array = self._allocate(max(size, 2 * len(self.array)))
        return self.array[:size]
