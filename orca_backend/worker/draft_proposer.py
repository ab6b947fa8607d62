"""Speculative decoding's draft model (vLLM's method "draft_model"): a smaller checkpoint with the
target's vocabulary, run greedily by the model runner to fill in the proposals the scheduler left
to it (worker/runner_proposer.py), just before the target's forward verifies them. Its K/V lives
slot for slot beside the target's; a verify step's table covers the request's last token and its k
proposals, and the draft writes only up to its (k-1)-th proposal, so it never writes outside the
request's blocks.

A request's first pass computes the draft's K/V for what the draft has not seen yet: after its
prompt or a preemption, its whole context; else the tokens accepted since its last proposals (those
of its proposals the target accepted keep the K/V the draft wrote for them) and its last token.
Then k - 1 passes of one token each, each one's input the token the pass before chose, on the
device: the proposals are read back once, after the last pass. Drafting is greedy: each proposal
names one token, so the sampler verifies it as it does an n-gram proposal (q = 1 there), and
sampling stays exact. (A first pass after a preemption is as long as the context.)

On CUDA the passes replay CUDA graphs (worker/cuda_graphs.py), captured at load beside the
target's in the same memory pool: first passes bucketed by token count as the target's mixed
steps are (one or two tokens a request once it proposes every step, padded to 16), the one-token
passes by batch size as decode steps are. A first pass above the largest bucket (a whole prompt)
runs eagerly; `pass_paths` counts how each pass ran (RunnerProposer.run_pass).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from orca_backend.config import EngineConfig
from orca_backend.families import AnyModelConfig
from orca_backend.model.device import torch_dtype
from orca_backend.model.loader import load_model
from orca_backend.model.stage_input import StageInput
from orca_backend.scheduler_output import SchedulerOutput
from orca_backend.worker.cuda_graphs import (
    DecodeGraphs,
    MixedGraphs,
    StepGraphs,
    capture_sizes,
    mixed_capture_sizes,
)
from orca_backend.worker.input_batch import InputBatch, ragged_arange
from orca_backend.worker.runner_proposer import RunnerProposer
from orca_kernels import AttentionMetadata


class DraftProposer(RunnerProposer):
    def __init__(self, config: EngineConfig, target: AnyModelConfig, device: torch.device) -> None:
        """Loads the draft model, refusing one that cannot serve `target` (naming the field)."""
        draft_config = config.draft_config()
        assert draft_config is not None, "a draft proposer needs speculative_config's method draft_model"
        self.model_config = draft_config.model_config()
        if self.model_config.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config: the draft model's vocab_size ({self.model_config.vocab_size}) is "
                             f"not the target's ({target.vocab_size}): it must share the target's tokenizer")  # fmt: skip
        if target.kv_window:
            raise ValueError("speculative_config: method draft_model is not served for a model whose every layer has "
                             "a sliding window (the K/V blocks it gives back are ones a draft re-reads after a "
                             "preemption); use the ngram method")  # fmt: skip
        if self.model_config.max_context < min(target.max_context, config.max_model_len or target.max_context):
            raise ValueError(f"speculative_config: the draft model's context ({self.model_config.max_context}) is "
                             f"shorter than the target's; set max_model_len to at most it")  # fmt: skip
        self.model = load_model(draft_config, self.model_config, device)
        super().__init__(len(self.model.weights.layers), self.model.num_kv_heads, self.model_config.head_dim,
                         config.block_size, torch_dtype(config.dtype), device)  # fmt: skip
        # Per input-batch row: the draft K/V is valid below `valid` while the row holds the request it
        # held then (`epoch`, InputBatch.row_epoch); `last` is where its last proposals started and
        # what they were (those the target accepted keep their K/V).
        self._valid: dict[int, tuple[int, int]] = {}  # row -> (epoch, valid)
        self._last: dict[int, tuple[int, list[int]]] = {}  # row -> (start, proposals)
        # Its passes' static buffers (`static_graphs`), None where its passes run eagerly: a round's
        # first pass, and the one-token passes after it.
        self.first_graphs: MixedGraphs | None = None
        self.next_graphs: DecodeGraphs | None = None

    def static_graphs(self, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int) -> list[StepGraphs]:
        """A round's first pass, ragged (what the draft has not seen, through the last token: one or
        two tokens a request once it proposes every step), bucketed by token count as the target's
        mixed steps are; the one-token passes after it by batch size as decode steps are."""
        self.first_graphs = MixedGraphs(self._model_forward, mixed_capture_sizes(max_num_batched_tokens), max_num_seqs,
                                        max_blocks, self.block_size, self.device)  # fmt: skip
        self.next_graphs = DecodeGraphs(self._model_forward, capture_sizes(max_num_seqs), max_blocks, self.block_size,
                                        self.device)  # fmt: skip
        return [self.first_graphs, self.next_graphs]

    @torch.inference_mode()
    def propose(self, step: SchedulerOutput, batch: InputBatch, rows: np.ndarray) -> None:
        positions, spec_rows, counts = self.placeholders(step, rows)
        if not positions:
            return
        ends = batch.num_tokens[spec_rows].astype(np.int64)  # each one's tokens: its last one is at ends - 1
        starts = np.array([self._valid_from(row, end, batch) for row, end in
                           zip(spec_rows.tolist(), ends.tolist(), strict=True)], dtype=np.int64)  # fmt: skip
        # Pass 1: what the draft has not seen, through the last token; then one token a pass, each
        # pass's input the one before's output, on the device (one read-back for them all).
        lengths = ends - starts
        total = int(lengths.sum())
        token_positions = np.repeat(starts, lengths) + ragged_arange(lengths, total)
        token_rows = np.repeat(spec_rows, lengths)
        first = self.pass_inputs(batch, spec_rows, token_rows, token_positions, lengths, ends,
                                 batch.token_ids[token_rows, token_positions])  # fmt: skip
        drafts = torch.zeros((len(positions), int(counts.max())), dtype=torch.int64, device=self.device)
        drafts[:, 0] = self.run_pass(self.first_graphs, self._model_forward, first).argmax(dim=-1)
        for j in range(1, drafts.shape[1]):
            active = np.flatnonzero(counts > j)
            at = ends[active] + j - 1  # where proposal j - 1 goes in
            inputs = self.pass_inputs(batch, spec_rows[active], spec_rows[active], at, np.ones_like(at), at + 1)
            index = self.put(active)
            logits = self.run_pass(self.next_graphs, self._model_forward, inputs, drafts[:, j - 1].index_select(0, index))
            drafts[:, j].index_copy_(0, index, logits.argmax(dim=-1))
        host = drafts.cpu().numpy()
        for i, position in enumerate(positions):
            row, proposal = int(spec_rows[i]), host[i, : counts[i]].tolist()
            self.fill(step, batch, position, row, proposal)
            self._valid[row] = (int(batch.row_epoch[row]), int(ends[i]))
            self._last[row] = (int(ends[i]), proposal[:-1])  # the last one is never fed to the draft

    def _valid_from(self, row: int, end: int, batch: InputBatch) -> int:
        """Where the draft's K/V of the row's request stops being valid: 0 for a row it has not
        seen with this request, else past what it computed and those of its last proposals the
        request kept; never past the last token, which is fed again for its logits."""
        epoch, valid = self._valid.get(row, (-1, 0))
        if epoch != batch.row_epoch[row]:
            return 0
        start, proposal = self._last.get(row, (valid, []))
        kept = 0
        for j, token in enumerate(proposal):
            if start + j >= end or batch.token_ids[row, start + j] != token:
                break
            kept += 1
        return min(max(valid, start + kept), end - 1)

    def _model_forward(self, stage_input: StageInput, metas: Sequence[AttentionMetadata],
                       logits_indices: torch.Tensor) -> torch.Tensor:  # fmt: skip
        return self.model.forward(stage_input, metas, self.kv_caches, logits_indices)
