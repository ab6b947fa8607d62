"""Logits processing before temperature, row-wise per request, in vLLM v1's order: logit_bias, then
the repetition, frequency and presence penalties.

The state belongs to a request's row of the input batch (worker/input_batch.py), from the step it
takes the row until it leaves it: its bias and penalty values and, for a penalized request, one row
of a dense [slots, vocab] table of output-token counts and one of a prompt-token mask. Counts are
written when the row is taken (from every output token it has: a request resumed after a preemption
gets them back exactly) and then from each step's delta, which carries only tokens the core has
recorded, so nothing of a step that failed is ever counted. Dense rows make a step one gather for
all the penalized rows, whatever the lengths of their histories; a request without penalties has
no slot. The tables double when full and are kept: 5 bytes per vocabulary entry per penalized
request held at the peak (about 250 KB each for a 50k vocabulary).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from orca_backend.sampling_params import SamplingParams


@dataclass
class _RowSetup:
    presence: float
    frequency: float
    repetition: float
    bias_ids: list[int]
    bias_values: list[float]
    slot: int = -1  # its row of the count and prompt tables; -1 without penalties


class LogitsProcessors:
    def __init__(self, max_rows: int, vocab_size: int, device: torch.device) -> None:
        self.vocab_size, self.device = vocab_size, device
        self._setups: list[_RowSetup | None] = [None] * max_rows
        self.processed = np.zeros(max_rows, dtype=bool)  # logit_bias or penalties
        self.penalized = np.zeros(max_rows, dtype=bool)
        self._counts: torch.Tensor | None = None  # [slots, vocab] int32: each token's count in the output
        self._in_prompt: torch.Tensor | None = None  # [slots, vocab] bool (repetition penalty only)
        self._free: list[int] = []

    def add(self, row: int, params: SamplingParams, prompt_ids: list[int], output_ids: list[int]) -> None:
        """A request takes `row`: its setup, and the counts of the output tokens it already has."""
        if not (params.penalized or params.logit_bias):
            return
        bias = params.logit_bias or {}
        setup = self._setups[row] = _RowSetup(params.presence_penalty, params.frequency_penalty,
                                              params.repetition_penalty, list(bias), list(bias.values()))  # fmt: skip
        self.processed[row] = True
        if not params.penalized:
            return
        setup.slot = self._new_slot()
        self.penalized[row] = True
        assert self._counts is not None and self._in_prompt is not None
        if params.repetition_penalty != 1.0 and prompt_ids:
            self._in_prompt[setup.slot, prompt_ids] = True
        if output_ids:
            self.count([row], [output_ids])

    def remove(self, row: int) -> None:
        setup = self._setups[row]
        if setup is None:
            return
        if setup.slot >= 0:
            self._free.append(setup.slot)
        self._setups[row] = None
        self.processed[row] = self.penalized[row] = False

    def count(self, rows: list[int], token_ids: list[list[int]]) -> None:
        """Adds these output tokens to the counts of these (penalized) rows."""
        lengths = [len(ids) for ids in token_ids]
        slots = np.repeat(np.array([self._setups[row].slot for row in rows], dtype=np.int64), lengths)  # type: ignore[union-attr]
        if not len(slots):
            return
        tokens = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=len(slots))
        assert self._counts is not None
        index = torch.from_numpy(np.stack((slots, tokens))).to(self.device)
        ones = torch.ones(len(slots), dtype=self._counts.dtype, device=self.device)
        self._counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def apply(self, logits: torch.Tensor, positions: list[int], rows: list[int]) -> None:
        """logit_bias, then the penalties, in place on these batch positions (requests that sample
        this step), whose input-batch rows are `rows`."""
        bias_positions: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        penalized: list[int] = []
        slots: list[int] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        for position, row in zip(positions, rows, strict=True):
            setup = self._setups[row]
            assert setup is not None
            if setup.bias_ids:
                bias_positions += [position] * len(setup.bias_ids)
                bias_ids += setup.bias_ids
                bias_values += setup.bias_values
            if setup.slot >= 0:
                penalized.append(position)
                slots.append(setup.slot)
                presence.append(setup.presence)
                frequency.append(setup.frequency)
                repetition.append(setup.repetition)
        device = logits.device
        if bias_positions:
            index = torch.tensor([bias_positions, bias_ids], dtype=torch.long).to(device)
            logits.index_put_((index[0], index[1]), torch.tensor(bias_values, dtype=logits.dtype).to(device),
                              accumulate=True)  # fmt: skip
        if not penalized:
            return
        assert self._counts is not None and self._in_prompt is not None
        row_index = torch.tensor(penalized, dtype=torch.long).to(device)
        slot_index = torch.tensor(slots, dtype=torch.long).to(device)
        penalties = torch.tensor([presence, frequency, repetition], dtype=logits.dtype).to(device)[:, :, None]
        x = logits[row_index]
        counts = self._counts[slot_index]
        seen = counts > 0
        if any(r != 1.0 for r in repetition):
            rep = penalties[2]
            scaled = torch.where(x > 0, x / rep, x * rep)
            x = torch.where(seen | self._in_prompt[slot_index], scaled, x)
        x = x - penalties[1] * counts - penalties[0] * seen
        logits[row_index] = x

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
