"""Logits processing before temperature, row-wise per request, in vLLM v1's order: logit_bias, then
the repetition, frequency and presence penalties.

The state lives in the sampling worker, per request, from the first batch that carries its setup
(`RowExtras.setup`) until the request is released: its bias and penalty values and, for a penalized
request, one row of a dense [slots, vocab] table of output-token counts and one of a prompt-token
mask. The core tells the sampler a request's output tokens only once it has recorded them, with
their offset (`RowExtras.output_offset`), so nothing of an iteration that failed is ever counted and
a re-run batch may repeat an update harmlessly. Dense rows make a step one gather for all the
penalized rows, whatever the lengths of their histories; a request without penalties has no row.
The tables double when full and are kept: 5 bytes per vocabulary entry per penalized request held
at the peak (about 250 KB each for a 50k vocabulary).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca_backend.worker.batch_meta import BatchMeta, LogitsSetup


@dataclass
class _State:
    setup: LogitsSetup
    slot: int = -1  # its row of the count and prompt tables; -1 without penalties
    num_outputs: int = 0  # output tokens counted so far


class LogitsProcessors:
    def __init__(self) -> None:
        self._states: dict[str, _State] = {}
        self._counts: torch.Tensor | None = None  # [slots, vocab] int32: each token's count in the output
        self._in_prompt: torch.Tensor | None = None  # [slots, vocab] bool (repetition penalty only)
        self._free: list[int] = []

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            state = self._states.pop(request_id, None)
            if state is not None and state.slot >= 0:
                self._free.append(state.slot)

    def update(self, logits: torch.Tensor, batch_meta: BatchMeta) -> None:
        """Takes in every extras row's setup and new output tokens, whether the row samples this
        iteration or not (a prefill chunk's batch may be the one that carries the setup)."""
        count_slots: list[int] = []
        count_tokens: list[int] = []
        for extra in batch_meta.extras:
            request_id = batch_meta.request_ids[extra.row]
            state = self._states.get(request_id)
            if state is None:
                if extra.setup is None:
                    if extra.processed:
                        raise RuntimeError(f"request {request_id}: the sampler does not hold its logits "
                                           "processing")  # fmt: skip
                    continue  # logprobs only: nothing to hold
                state = self._states[request_id] = _State(extra.setup)
                if extra.setup.penalized:
                    state.slot = self._new_slot(logits.shape[1], logits.device)
                    if extra.setup.prompt_ids:
                        assert self._in_prompt is not None
                        self._in_prompt[state.slot, extra.setup.prompt_ids] = True
            if state.slot < 0:
                continue
            # The core sends every output token from the last offset it knows to have arrived: skip
            # those a failed batch already brought.
            skip = state.num_outputs - extra.output_offset
            if not 0 <= skip <= len(extra.output_ids):
                raise RuntimeError(f"request {request_id}: the sampler has counted {state.num_outputs} output tokens, "
                                   f"but an update starts at {extra.output_offset} with {len(extra.output_ids)}")
            new = extra.output_ids[skip:]
            count_slots += [state.slot] * len(new)
            count_tokens += new
            state.num_outputs += len(new)
        if count_slots:
            assert self._counts is not None
            index = torch.tensor([count_slots, count_tokens], dtype=torch.long).to(logits.device)
            ones = torch.ones(len(count_slots), dtype=self._counts.dtype, device=logits.device)
            self._counts.index_put_((index[0], index[1]), ones, accumulate=True)

    def apply(self, logits: torch.Tensor, batch_meta: BatchMeta) -> None:
        """logit_bias, then the penalties, in place on the rows that sample this iteration."""
        bias_rows: list[int] = []
        bias_ids: list[int] = []
        bias_values: list[float] = []
        rows: list[int] = []
        slots: list[int] = []
        presence: list[float] = []
        frequency: list[float] = []
        repetition: list[float] = []
        for extra in batch_meta.extras:
            if not batch_meta.sample[extra.row]:
                continue
            state = self._states.get(batch_meta.request_ids[extra.row])
            if state is None:  # logprobs only (update() refused a processed row it does not hold)
                continue
            setup = state.setup
            if setup.bias_ids:
                bias_rows += [extra.row] * len(setup.bias_ids)
                bias_ids += setup.bias_ids
                bias_values += setup.bias_values
            if state.slot >= 0:
                rows.append(extra.row)
                slots.append(state.slot)
                presence.append(setup.presence_penalty)
                frequency.append(setup.frequency_penalty)
                repetition.append(setup.repetition_penalty)
        device = logits.device
        if bias_rows:
            index = torch.tensor([bias_rows, bias_ids], dtype=torch.long).to(device)
            logits.index_put_((index[0], index[1]), torch.tensor(bias_values, dtype=logits.dtype).to(device),
                              accumulate=True)  # fmt: skip
        if not rows:
            return
        assert self._counts is not None and self._in_prompt is not None
        row_index = torch.tensor(rows, dtype=torch.long).to(device)
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

    def _new_slot(self, vocab: int, device: torch.device) -> int:
        """A zeroed row of the tables, which double when full (and never shrink)."""
        if not self._free:
            old = 0 if self._counts is None else self._counts.shape[0]
            new = max(8, 2 * old)
            counts = torch.zeros((new, vocab), dtype=torch.int32, device=device)
            in_prompt = torch.zeros((new, vocab), dtype=torch.bool, device=device)
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
