"""What speculative decoding's proposers in the model runner share (the draft model's,
worker/draft_proposer.py, and the EAGLE head's, worker/eagle_proposer.py): the scheduler leaves
them placeholders (PROPOSED_BY_RUNNER: it decided how many, within the token budget, max_tokens and
the blocks it took), which they fill in just before the target's forward verifies them.

Their model's K/V lives in a pool of its own beside the target's, slot for slot: the same block
tables and slot mapping, its own layers and heads, so the scheduler's blocks serve both models and
nothing is allocated for the proposer alone. Its passes are not counted in the step's token budget,
and on a GPU each pass reads its tokens back to the host.
"""

from __future__ import annotations

import numpy as np
import torch

from orca_backend.scheduler_output import PROPOSED_BY_RUNNER, SamplerOutput, SchedulerOutput
from orca_backend.worker.input_batch import InputBatch
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

    @property
    def kv_bytes_per_token(self) -> int:
        layers, heads, head_dim = self.kv_geometry
        return 2 * torch.tensor([], dtype=self.dtype).element_size() * layers * heads * head_dim

    def allocate(self, num_slots: int) -> None:
        """The proposer's K/V pool: as many slots as the target's."""
        from orca_backend.worker.model_runner import allocate_kv_pool

        layers, heads, head_dim = self.kv_geometry
        self.kv_caches = allocate_kv_pool(layers, num_slots, heads, head_dim, self.dtype, self.device)

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

    def metadata(self, batch: InputBatch, rows: np.ndarray, token_rows: np.ndarray, token_positions: np.ndarray,
                 lengths: np.ndarray, context_lens: np.ndarray) -> AttentionMetadata:  # fmt: skip
        """The attention metadata of a pass: each of `rows`' `lengths` tokens at `token_positions`
        (of `token_rows`), written to the slots the target's tables give them, each request
        attending to its first `context_lens` positions."""
        size = self.block_size
        slots = batch.block_table[token_rows, 0, token_positions // size].astype(np.int64) * size + token_positions % size
        width = -(-int(context_lens.max()) // size)
        query_start = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
        return AttentionMetadata(
            query_start=self.put(query_start), context_lens=self.put(context_lens.astype(np.int32)),
            block_tables=self.put(np.ascontiguousarray(batch.block_table[rows, 0, :width])),
            slot_mapping=self.put(slots), block_size=size, max_query_len=int(lengths.max()),
            max_context_len=int(context_lens.max()), num_requests=len(rows),
        )  # fmt: skip

    def put(self, array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(self.device)
