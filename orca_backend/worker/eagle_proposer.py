"""Speculative decoding's EAGLE heads (vLLM's methods "eagle" and "eagle3", model/eagle.py) in the
model runner:
it proposes from the target's own hidden states, so it runs at two moments of a step.

After the target's step (`observe`): over every position the step kept (a prefill chunk's, a
decode's, a verify step's last token and its accepted proposals; not the rejected ones), the head
runs on (the token after the position, the target's hidden states at it: its final one, or with
EAGLE-3 those entering three of its layers) and writes its K/V there.
Its output at a request's last position, where the token after is the one just sampled, is the
request's first proposal for its next step, kept with the head's hidden state there.

Before the target's next step (`propose`): a request's first proposal is the one kept; each further
one is a one-token pass of the head on the proposal before it and the head's own hidden state at
the position before (the target has not run those positions yet). The next `observe` writes the
K/V of those positions again from the target's hidden states, where the target kept them.

So the head's K/V covers every position the target computed: a prefix-cache hit finds the head's
K/V beside the target's in the same blocks (written when another request computed them), a forked
request's copied block carries it (the runner copies both pools), and a resumed request's prefill
writes it again. Drafting is greedy, so the sampler verifies each proposal as an n-gram one (q = 1)
and sampling stays exact. With the head on, every step's forward returns the hidden states of
every token (a CUDA graph's too, from a buffer of its bucket's size). On CUDA the head's own
passes replay graphs of their own (`static_graphs`): each reads a hidden state per token from a
static buffer beside its tokens (`StepGraphs`' hidden_input) and returns its logits and output; the
tokens are taken outside the graph (an EAGLE-3 head's mapped onto the target's vocabulary there).
The tokens stay on the device from pass to pass: a proposing pass takes the one before's through
the graphs' `ahead` path, and a step's proposals are read back once, after its last pass (the
observing pass reads nothing back).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from orca_backend.config import EngineConfig
from orca_backend.families import AnyModelConfig
from orca_backend.model.device import torch_dtype
from orca_backend.model.eagle import EagleHead, load_eagle_head
from orca_backend.model.stage_input import StageInput, StageModel
from orca_backend.scheduler_output import SamplerOutput, SchedulerOutput
from orca_backend.worker.cuda_graphs import (
    DecodeGraphs,
    MixedGraphs,
    StepGraphs,
    capture_sizes,
    mixed_capture_sizes,
)
from orca_backend.worker.input_batch import InputBatch, StepInputs, ragged_arange
from orca_backend.worker.runner_proposer import RunnerProposer
from orca_kernels import AttentionMetadata


class EagleProposer(RunnerProposer):
    needs_hidden_states = True

    def __init__(self, config: EngineConfig, target_config: AnyModelConfig, target: StageModel,
                 device: torch.device) -> None:  # fmt: skip
        """Loads the head over `target`, refusing one that cannot serve it (naming the field)."""
        speculative = config.speculative()
        assert speculative is not None and speculative.method in ("eagle", "eagle3") and speculative.model
        if target_config.kv_window:
            raise ValueError(f"speculative_config: method {speculative.method} is not served for a model whose every "
                             "layer has a sliding window (the K/V blocks it gives back are ones the head re-reads); "
                             "use the ngram method")  # fmt: skip
        self.head: EagleHead = load_eagle_head(speculative.model, speculative.method, target,
                                               torch_dtype(config.dtype), device)  # fmt: skip
        head_config = self.head.config
        if head_config.max_context < min(target_config.max_context, config.max_model_len or target_config.max_context):
            raise ValueError(f"speculative_config: the EAGLE head's context ({head_config.max_context}) is shorter "
                             "than the target's; set max_model_len to at most it")  # fmt: skip
        super().__init__(len(self.head.weights.layers), self.head.num_kv_heads, head_config.head_dim,
                         config.block_size, torch_dtype(config.dtype), device)  # fmt: skip
        # Per input-batch row, after the row's last observed step: (the row's epoch then,
        # InputBatch.row_epoch; the position the head last ran at; its proposal for the token after
        # the next and its hidden state there, both on the device).
        self._next: dict[int, tuple[int, int, torch.Tensor, torch.Tensor]] = {}
        # Its passes' static buffers (`static_graphs`), None where they run eagerly: the pass over
        # what a step kept, and the one-token passes that propose.
        self.observe_graphs: MixedGraphs | None = None
        self.propose_graphs: DecodeGraphs | None = None

    @property
    def aux_layers(self) -> tuple[int, ...]:  # type: ignore[override]
        return self.head.aux_layers

    @torch.inference_mode()
    def observe(self, step: SchedulerOutput, batch: InputBatch, rows: np.ndarray, hidden: torch.Tensor,
                output: SamplerOutput) -> None:  # fmt: skip
        starts = np.asarray(step.num_computed, dtype=np.int64)
        kept = np.asarray(step.num_scheduled_tokens, dtype=np.int64)
        if step.spec_rows:  # a verify step keeps its last token and the proposals accepted
            kept[step.spec_rows] = 1 + np.asarray(output.num_accepted, dtype=np.int64)
        kept[batch.pooling[rows] != 0] = 0  # embedding requests have no next token
        ran = np.flatnonzero(kept)
        if not len(ran):
            return
        flat_start = np.concatenate([[0], np.cumsum(step.num_scheduled_tokens)])[:-1]
        rows, starts, kept, flat_start = rows[ran], starts[ran], kept[ran], flat_start[ran]
        total = int(kept.sum())
        offsets = ragged_arange(kept, total)
        token_rows, positions = np.repeat(rows, kept), np.repeat(starts, kept) + offsets
        # The token after each position: the row's (a prompt token, an accepted proposal), but at a
        # request's last position, if the step sampled there, the token it sampled.
        after = positions + 1
        next_ids = batch.token_ids[token_rows, np.minimum(after, batch.max_tokens - 1)].astype(np.int64)
        ends = np.cumsum(kept) - 1
        sampled = starts + kept >= batch.num_tokens[rows]  # the step reached the request's last token
        tokens = np.asarray(output.token_ids, dtype=np.int64)[ran]
        next_ids[ends[sampled]] = tokens[sampled]
        inputs = self.pass_inputs(batch, rows, token_rows, positions, kept, starts + kept, next_ids)
        source = self.put(np.repeat(flat_start, kept) + offsets)
        out, proposals = self._pass(self.observe_graphs, inputs, self.head.from_target(hidden.index_select(0, source)))
        last_hidden = out.index_select(0, self.put(ends))
        for i in np.flatnonzero(sampled).tolist():
            row = int(rows[i])
            self._next[row] = (int(batch.row_epoch[row]), int(positions[ends[i]]), proposals[i], last_hidden[i])

    def static_graphs(self, max_num_seqs: int, max_num_batched_tokens: int, max_blocks: int) -> list[StepGraphs]:
        """The head's pass over what a step kept, bucketed by token count as the target's mixed steps
        (a token or a few a request, after decode and verify steps), and its one-token passes by
        batch size as decode steps; each reads a hidden state per token beside its tokens (the
        target's, mapped by `from_target`, or the head's own) and returns the head's output too."""
        width = (self.head.config.hidden_size, self.dtype)
        self.observe_graphs = MixedGraphs(self._head_forward, mixed_capture_sizes(max_num_batched_tokens), max_num_seqs,
                                          max_blocks, self.block_size, self.device, hidden_layers=(),
                                          hidden_input=width)  # fmt: skip
        self.propose_graphs = DecodeGraphs(self._head_forward, capture_sizes(max_num_seqs), max_blocks, self.block_size,
                                           self.device, hidden_layers=(), hidden_input=width)  # fmt: skip
        return [self.observe_graphs, self.propose_graphs]

    def _pass(self, graphs: StepGraphs | None, inputs: StepInputs, hidden: torch.Tensor,
              input_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """One pass of the head on `inputs`' tokens (or `input_ids`, on the device) and `hidden` [T, H]:
        its output [T, H] and its greedy token at each request's last token, on the device."""
        logits, out = self.run_pass(graphs, self._head_forward, inputs, input_ids, hidden)
        return out[: inputs.num_tokens], self.head.draft_ids(logits)

    def _head_forward(self, stage_input: StageInput, metas: Sequence[AttentionMetadata],
                      logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A pass: (logits, the head's output), as a target step with hidden states returns them."""
        assert stage_input.hidden is not None
        out, logits = self.head.forward(stage_input.input_ids, stage_input.hidden, stage_input.positions, metas[0],
                                        self.kv_caches, logits_indices)  # fmt: skip
        return logits, out

    @torch.inference_mode()
    def propose(self, step: SchedulerOutput, batch: InputBatch, rows: np.ndarray) -> None:
        positions, spec_rows, counts = self.placeholders(step, rows)
        if not positions:
            return
        first, hidden = [], []
        for i, row in enumerate(spec_rows.tolist()):
            # The last observed step ran the head at the position before the last token.
            epoch, at, proposal, state = self._next.get(row, (-1, -1, 0, None))
            if epoch != batch.row_epoch[row] or at != batch.num_tokens[row] - 2:
                raise RuntimeError(f"request {step.scheduled_ids[step.spec_rows[positions[i]]]}: the EAGLE head last "
                                   f"ran at position {at} of it, not {batch.num_tokens[row] - 2} (the model runner "
                                   "lost its state)")  # fmt: skip
            first.append(proposal)
            hidden.append(state)
        drafts = torch.zeros((len(positions), int(counts.max())), dtype=torch.int64, device=self.device)
        drafts[:, 0] = torch.stack(first)
        states = torch.stack(hidden)  # of the requests still proposing, in order
        at = batch.num_tokens[spec_rows].astype(np.int64) - 2
        active = np.arange(len(positions))
        for j in range(1, drafts.shape[1]):  # one position a pass: the proposal before, the head's own state
            still = counts[active] > j
            if not still.all():
                active, states = active[still], states.index_select(0, self.put(np.flatnonzero(still)))
            where = at[active] + j
            inputs = self.pass_inputs(batch, spec_rows[active], spec_rows[active], where, np.ones_like(where), where + 1)
            index = self.put(active)
            states, tokens = self._pass(self.propose_graphs, inputs, states, drafts[:, j - 1].index_select(0, index))
            drafts[:, j].index_copy_(0, index, tokens)
        host = drafts.cpu().numpy()
        for i, position in enumerate(positions):
            self.fill(step, batch, position, int(spec_rows[i]), host[i, : counts[i]].tolist())
