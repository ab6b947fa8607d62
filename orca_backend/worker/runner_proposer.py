"""What speculative decoding's proposers in the model runner share (the draft model's,
worker/draft_proposer.py, and the EAGLE head's, worker/eagle_proposer.py): the scheduler leaves
them placeholders (PROPOSED_BY_RUNNER: it decided how many, within the token budget, max_tokens and
the blocks it took), which they fill in just before the target's forward verifies them.

Their model's K/V lives in a pool of its own beside the target's, slot for slot: the same block
tables and slot mapping, its own layers and heads, so the scheduler's blocks serve both models and
nothing is allocated for the proposer alone. Its passes are not counted in the step's token budget.
A pass's inputs are laid out as a target step's (`pass_inputs`: input_batch.StepInputs), so the
graphs' static buffers take them: on CUDA a proposer's passes replay graphs of their own
(`static_graphs`), captured with the target's.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
import torch

from orca_backend.model.stage_input import StageInput
from orca_backend.scheduler_output import PROPOSED_BY_RUNNER, SamplerOutput, SchedulerOutput
from orca_backend.worker.cuda_graphs import Forward, StepGraphs
from orca_backend.worker.input_batch import InputBatch, StepInputs
from orca_kernels import AttentionMetadata


class RunnerProposer:
    # Whether the runner hands `observe` every step's final hidden states (the target's forward then
    # returns them for every token).
    needs_hidden_states = False
    # With `needs_hidden_states`: the target layers whose input hidden states `observe` reads too
    # (StageInput.aux_layers), after the final ones.
    aux_layers: tuple[int, ...] = ()

    def __init__(self, num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:  # fmt: skip
        self.kv_geometry = (num_layers, num_kv_heads, head_dim)
        self.block_size, self.dtype, self.device = block_size, dtype, device
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        # How its passes ran: cuda_graphs.GRAPH_REPLAYED, "static_buffers", or why eagerly (an
        # EAGER_REASONS key, "tokens_above_buckets" say; "no_graphs" where it has none).
        self.pass_paths: Counter[str] = Counter()

    @property
    def kv_bytes_per_token(self) -> int:
        layers, heads, head_dim = self.kv_geometry
        return 2 * torch.tensor([], dtype=self.dtype).element_size() * layers * heads * head_dim

    def allocate(self, num_slots: int) -> None:
        """The proposer's K/V pool: as many slots as the target's."""
        from orca_backend.worker.model_runner import allocate_kv_pool

        layers, heads, head_dim = self.kv_geometry
        self.kv_caches = allocate_kv_pool(layers, num_slots, heads, head_dim, self.dtype, self.device)

    def static_graphs(self, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int) -> list[StepGraphs]:
        """The static buffers its passes run on where they fit (not captured yet: the runner captures
        them on CUDA; on a CPU the passes run on them eagerly, as the tests do). None here: its passes
        run eagerly."""
        return []

    def run_pass(self, graphs: StepGraphs | None, forward: Forward, inputs: StepInputs,
                 input_ids: torch.Tensor | None = None, hidden: torch.Tensor | None = None) -> Any:  # fmt: skip
        """One pass of its model, `forward` (the one `graphs` were built on), on `inputs`: on the
        graphs' static buffers where they hold it (their graph replayed on CUDA), else eagerly.
        `input_ids`: the pass's tokens on the device (else `inputs.input_ids`); `hidden`: a hidden
        state per token (an EAGLE head's). Returns what `forward` does; from a graph, a row per
        request and (with hidden states out) the bucket's whole buffer."""
        reason = "no_graphs" if graphs is None else graphs.eager_reason(inputs)
        if graphs is not None and not reason:
            self.pass_paths[graphs.path(inputs)] += 1
            ahead = None if input_ids is None else (torch.arange(len(input_ids), device=self.device), input_ids)
            return graphs.run(inputs, ahead, hidden)
        self.pass_paths[reason] += 1
        ids = self.put(inputs.input_ids) if input_ids is None else input_ids
        return forward(StageInput(ids, self.put(inputs.positions), hidden), [self.metadata(inputs)],
                       self.put(inputs.logits_indices))  # fmt: skip

    def propose(self, step: SchedulerOutput, batch: InputBatch, rows: np.ndarray) -> None:
        """Fills in the step's placeholder proposals (in `step.spec_tokens`, and past each request's
        tokens in its row, where the target's forward reads them). `rows`: the step's rows."""
        raise NotImplementedError

    def observe(self, step: SchedulerOutput, batch: InputBatch, rows: np.ndarray, hidden: torch.Tensor,
                output: SamplerOutput) -> None:  # fmt: skip
        """What a step computed, once sampled: `hidden` [T, H (1 + len(aux_layers))], the target's final
        hidden states of its tokens, then those entering `aux_layers` (with `needs_hidden_states`)."""

    def placeholders(self, step: SchedulerOutput, rows: np.ndarray) -> tuple[list[int], np.ndarray, np.ndarray]:
        """The step's requests whose proposals are left to this proposer: their places among the
        step's proposals (`spec_tokens`), their input-batch rows, and how many each proposes."""
        places = [i for i, drafts in enumerate(step.spec_tokens) if drafts and drafts[0] == PROPOSED_BY_RUNNER]
        counts = np.array([len(step.spec_tokens[i]) for i in places], dtype=np.int64)
        return places, rows[[step.spec_rows[i] for i in places]], counts

    @staticmethod
    def fill(step: SchedulerOutput, batch: InputBatch, position: int, row: int, proposal: list[int]) -> None:
        """A request's proposals, where the scheduler left placeholders and where the forward reads them."""
        step.spec_tokens[position] = proposal
        end = int(batch.num_tokens[row])
        batch.token_ids[row, end : end + len(proposal)] = proposal

    def pass_inputs(self, batch: InputBatch, rows: np.ndarray, token_rows: np.ndarray, token_positions: np.ndarray,
                    lengths: np.ndarray, context_lens: np.ndarray, input_ids: np.ndarray | None = None) -> StepInputs:  # fmt: skip
        """A pass's inputs, as a target step's are laid out (so the graphs' static buffers take them):
        each of `rows`' `lengths` tokens (`input_ids`; zeros where the device supplies them) at
        `token_positions` (of `token_rows`), written to the slots the target's tables give them,
        each request attending to its first `context_lens` positions, a logits row at its last
        token. The target's first K/V group's tables: the proposer's pool has one."""
        size, count = self.block_size, len(token_positions)
        flat64 = np.zeros(3 * count, dtype=np.int64)
        if input_ids is not None:
            flat64[:count] = input_ids
        flat64[count : 2 * count] = token_positions
        flat64[2 * count :] = batch.block_table[token_rows, 0, token_positions // size].astype(np.int64) * size \
            + token_positions % size  # fmt: skip
        flat32 = np.zeros(3 * len(rows) + 1, dtype=np.int32)
        query_start, context, logits_indices = np.split(flat32, [len(rows) + 1, 2 * len(rows) + 1])
        np.cumsum(lengths, out=query_start[1:])
        context[:] = context_lens
        logits_indices[:] = query_start[1:] - 1
        width = -(-int(context_lens.max()) // size)
        return StepInputs(
            flat64[:count], flat64[count : 2 * count], flat64[2 * count :].reshape(1, count), flat64, query_start,
            context, logits_indices, flat32, np.ascontiguousarray(batch.block_table[rows, 0, :width])[None],
            max_query_len=int(lengths.max()), max_context_len=int(context_lens.max()), sampling=None,
        )  # fmt: skip

    def metadata(self, inputs: StepInputs) -> AttentionMetadata:
        """The attention metadata of a pass run eagerly."""
        return AttentionMetadata(
            query_start=self.put(inputs.query_start), context_lens=self.put(inputs.context_lens),
            block_tables=self.put(inputs.block_tables[0]), slot_mapping=self.put(inputs.slot_mapping[0]),
            block_size=self.block_size, max_query_len=inputs.max_query_len, max_context_len=inputs.max_context_len,
            num_requests=inputs.num_requests,
        )  # fmt: skip

    def put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
