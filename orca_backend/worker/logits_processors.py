"""Logits processing before temperature, row-wise per request, in vLLM v1's order: logit_bias, then
the repetition, frequency and presence penalties.

The state belongs to a request's row of the input batch (worker/input_batch.py), from the step it
takes the row until it leaves it, and lives on the device: its penalty values and logit_bias (ids and
values, padded to the widest request's) in two [rows, columns] tables written once, when the row is
taken; for a penalized request, one row of a dense [slots, vocab] table of output-token counts and
one of a prompt-token mask. Counts are written when the row is taken (from every output token it
has: a request resumed after a preemption gets them back exactly) and then from each step's delta,
which carries only tokens the core has recorded, so nothing of a step that failed is ever counted.
A token sampled but not recorded yet (a speculative proposal before a verifying row; the last token
of a request that async scheduling runs ahead, still on the device) is counted for one step only,
on a copy of the request's counts (`apply`'s `unrecorded`).
Every update reaches the device through the step's staging arena (worker/staging.py): nothing here
waits for the device, and a step's processing reads no value back. Dense rows make a step one
gather for all the penalized rows, whatever the lengths of their histories; a request without
penalties has no slot. The count tables double when full and are kept: 5 bytes per vocabulary entry
per penalized request held at the peak (about 250 KB each for a 50k vocabulary).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from orca_backend.sampling_params import SamplingParams
from orca_backend.worker.staging import StagingArena

# Columns of the per-row tables: `values` (float32) holds the penalties, then the bias values;
# `ids` (int64) the count slot, then the bias token ids. Bias padding adds 0.0 to token 0.
PRESENCE, FREQUENCY, REPETITION, BIAS_VALUES = 0, 1, 2, 3
SLOT, BIAS_IDS = 0, 1


class LogitsProcessors:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device, staging: StagingArena) -> None:
        self.vocab_size, self.device, self.staging = vocab_size, device, staging
        # Host flags per row, for the step's index sets (worker/input_batch.py) and the deltas.
        self.biased = np.zeros(max_rows, dtype=bool)
        self.penalized = np.zeros(max_rows, dtype=bool)
        self.repetitive = np.zeros(max_rows, dtype=bool)  # a repetition penalty other than 1
        self._slot = np.full(max_rows, -1, dtype=np.int64)
        self.values = torch.zeros((max_rows, BIAS_VALUES), dtype=torch.float32, device=device)
        self.ids = torch.zeros((max_rows, BIAS_IDS), dtype=torch.int64, device=device)
        self._counts: torch.Tensor | None = None  # [slots, vocab] int32: each token's count in the output
        self._in_prompt: torch.Tensor | None = None  # [slots, vocab] bool (repetition penalty only)
        self._free: list[int] = []

    @property
    def processed(self) -> np.ndarray:
        """Per row: logit_bias or penalties."""
        return self.biased | self.penalized

    def add(self, row: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A request takes `row`: its setup, and the counts of the output tokens it already has."""
        if not (params.penalized or params.logit_bias):
            return
        bias = params.logit_bias or {}
        if BIAS_IDS + len(bias) > self.ids.shape[1]:
            self._widen(len(bias))
        width = self.ids.shape[1] - BIAS_IDS
        slot = self._new_slot() if params.penalized else -1
        values = np.zeros(self.values.shape[1], dtype=np.float32)
        values[:BIAS_VALUES] = params.presence_penalty, params.frequency_penalty, params.repetition_penalty
        values[BIAS_VALUES : BIAS_VALUES + len(bias)] = list(bias.values())
        ids = np.zeros(BIAS_IDS + width, dtype=np.int64)
        ids[SLOT] = slot
        ids[BIAS_IDS : BIAS_IDS + len(bias)] = list(bias)
        self.values[row].copy_(self.staging.put(values))
        self.ids[row].copy_(self.staging.put(ids))
        self.biased[row] = bool(bias)
        if not params.penalized:
            return
        self._slot[row] = slot
        self.penalized[row] = True
        self.repetitive[row] = params.repetition_penalty != 1.0
        assert self._counts is not None and self._in_prompt is not None
        if params.repetition_penalty != 1.0 and prompt_ids:
            self._in_prompt[slot].index_fill_(0, self.staging.put(np.array(prompt_ids, dtype=np.int64)), True)
        if output_ids:
            self.count([row], [output_ids])

    def remove(self, row: int) -> None:
        if self._slot[row] >= 0:
            self._free.append(int(self._slot[row]))
        self._slot[row] = -1
        self.biased[row] = self.penalized[row] = self.repetitive[row] = False

    def count(self, rows: list[int], token_ids: list[list[int]]) -> None:
        """Adds these output tokens to the counts of these (penalized) rows."""
        lengths = [len(ids) for ids in token_ids]
        slots = np.repeat(self._slot[rows], lengths)
        if not len(slots):
            return
        tokens = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=len(slots))
        assert self._counts is not None
        index = self.staging.put(np.stack((slots, tokens)))
        ones = torch.ones(len(slots), dtype=self._counts.dtype, device=self.device)
        self._counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def apply(
        self, logits: torch.Tensor, biased: tuple[torch.Tensor, torch.Tensor],
        penalized: tuple[torch.Tensor, torch.Tensor], repetition: bool, unrecorded: torch.Tensor | None = None,
    ) -> None:  # fmt: skip
        """logit_bias, then the penalties, in place: `biased` and `penalized` are (batch positions,
        their rows) on the device, of requests that sample this step; `repetition`: whether any
        penalized one has a repetition penalty. `unrecorded` [2, n]: (index into `penalized`, token)
        of output tokens its counts do not hold yet, counted too (speculative decoding: the proposals
        before a verifying row; async scheduling: the token a request runs ahead on)."""
        positions, rows = biased
        if len(positions):
            ids = self.ids.index_select(0, rows)[:, BIAS_IDS:]
            values = self.values.index_select(0, rows)[:, BIAS_VALUES:].to(logits.dtype)
            logits.index_put_((positions[:, None].expand_as(ids), ids), values, accumulate=True)
        positions, rows = penalized
        if not len(positions):
            return
        assert self._counts is not None and self._in_prompt is not None
        slots = self.ids[:, SLOT].index_select(0, rows)
        penalties = self.values[:, :BIAS_VALUES].index_select(0, rows).to(logits.dtype).T[:, :, None]
        x = logits.index_select(0, positions)
        counts = self._counts.index_select(0, slots)
        if unrecorded is not None and unrecorded.shape[1]:
            counts = counts.index_put((unrecorded[0], unrecorded[1]), counts.new_ones(()), accumulate=True)
        seen = counts > 0
        if repetition:
            rep = penalties[REPETITION]
            scaled = torch.where(x > 0, x / rep, x * rep)
            x = torch.where(seen | self._in_prompt.index_select(0, slots), scaled, x)
        x = x - penalties[FREQUENCY] * counts - penalties[PRESENCE] * seen
        logits.index_copy_(0, positions, x)

    def _widen(self, num_bias: int) -> None:
        """Room for `num_bias` logit_bias entries per row (the tables never shrink)."""
        width = max(num_bias, 2 * (self.ids.shape[1] - BIAS_IDS))
        values = torch.zeros((self.values.shape[0], BIAS_VALUES + width), dtype=self.values.dtype, device=self.device)
        ids = torch.zeros((self.ids.shape[0], BIAS_IDS + width), dtype=self.ids.dtype, device=self.device)
        values[:, : self.values.shape[1]] = self.values
        ids[:, : self.ids.shape[1]] = self.ids
        self.values, self.ids = values, ids

    def _new_slot(self) -> int:
        """A zeroed row of the tables, which double when full (and never shrink)."""
        if not self._free:
            old = 0 if self._counts is None else self._counts.shape[0]
            new = max(8, 2 * old)
            counts = torch.zeros((new, self.vocab_size), dtype=torch.int32, device=self.device)
            in_prompt = torch.zeros((new, self.vocab_size), dtype=torch.bool, device=self.device)
            if self._counts is not None and self._in_prompt is not None:
                counts[:old] = self._counts
                in_prompt[:old] = self._in_prompt
            self._counts, self._in_prompt = counts, in_prompt
            self._free = list(range(new - 1, old - 1, -1))
        slot = self._free.pop()
        assert self._counts is not None and self._in_prompt is not None
        self._counts[slot].zero_()
        self._in_prompt[slot].zero_()
        return slot
