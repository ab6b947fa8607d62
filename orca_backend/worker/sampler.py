"""Token sampling: logits processing, greedy, temperature, top-k, top-p, with a per-request RNG,
and the logprobs of the sampled tokens.

Each request draws from its own generator (kept by the input batch, worker/input_batch.py), seeded
with the request's seed (its SamplingParams.seed, or one the engine drew for it at arrival), and
every transform is row-wise, so a request's tokens
do not depend on what else is in the batch, nor on which process samples them.

vLLM v1's order: a structured-output request's grammar mask is applied before the sampler
(worker/bitmask.py, by the model runner); logprobs are taken from those logits (vLLM's default
"raw_logprobs"); then logit_bias, the min_tokens ban and the penalties (worker/logits_processors.py);
then greedy's argmax, or temperature, top-k, top-p and a draw.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import numpy as np
import torch

from orca_backend.messages import TokenLogprobs
from orca_backend.scheduler_output import SamplerOutput
from orca_backend.worker.input_batch import SamplingBatch


@dataclass
class SampledTokens:
    """A step's sampled ids, on the logits' device (`tokens`), on their way to the host."""

    tokens: torch.Tensor  # int64 [B]
    logprobs: list[TokenLogprobs | None] | None
    host: torch.Tensor | None = None  # CUDA: the pinned buffer the ids are copied into
    copied: torch.cuda.Event | None = None
    lora_failures: dict[int, str] = field(default_factory=dict)  # passed on (SamplerOutput.lora_failures)
    step_path: str = ""  # passed on (SamplerOutput.step_path)

    def result(self) -> SamplerOutput:
        """The ids as a list, once their copy has landed (a wait for the step on a GPU)."""
        if self.host is None:
            return SamplerOutput(self.tokens.tolist(), self.logprobs, self.lora_failures, self.step_path)
        assert self.copied is not None
        self.copied.synchronize()
        return SamplerOutput(self.host.tolist(), self.logprobs, self.lora_failures, self.step_path)


class Sampler:
    def __init__(self) -> None:
        # CUDA: where the sampled ids are copied to the host, two buffers in turn (under async
        # scheduling a step's copy is queued before the last one's ids are read).
        self._pinned: list[torch.Tensor] = []
        self._turn = 0

    def launch(self, logits: torch.Tensor, batch: SamplingBatch) -> SampledTokens:
        """logits: [B, vocab] float32, one row per scheduled request (changed in place). One token id
        per request (the core ignores those of prefill chunks, `batch.sample` False), and the logprobs
        of the requests that asked for them, as `result()` gives them; the ids stay on the device
        with their copy to the host queued (on a GPU nothing waits for the step here, unless a
        request asked for logprobs)."""
        raw_logprobs = None
        if batch.logprobs:  # before any processing
            raw_logprobs = logits[[position for position, _ in batch.logprobs]].log_softmax(dim=-1)
        if batch.processed:  # logit_bias and the penalties
            batch.processors.apply(logits, batch.processed, batch.rows[batch.processed].tolist())
        if batch.banned:  # before min_tokens, EOS and stop tokens cannot be sampled (vLLM's semantics)
            logits[_ban_index(batch.banned, logits.device)] = float("-inf")
        tokens = _argmax(logits)
        # A prefill chunk short of its last token samples nothing: its generator must not advance.
        random_rows = np.flatnonzero((batch.temperature > 0) & batch.sample).tolist() if batch.generators else []
        if random_rows:
            tokens[random_rows] = _sample_random(logits[random_rows], batch, random_rows)
        logprobs = None
        if raw_logprobs is not None:
            logprobs = _gather_logprobs(raw_logprobs, tokens, batch.logprobs, len(batch.sample))
        if not tokens.is_cuda:
            return SampledTokens(tokens, logprobs)
        # One non-blocking copy into a persistent pinned buffer (a plain `tolist` stages through
        # pageable memory and waits for the stream).
        self._turn ^= 1
        if len(self._pinned) < 2 or self._pinned[self._turn].numel() < tokens.numel():
            size = max(tokens.numel(), 256)
            self._pinned = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        host = self._pinned[self._turn][: tokens.numel()]
        host.copy_(tokens, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return SampledTokens(tokens, logprobs, host, copied)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch, rows: list[int]) -> torch.Tensor:
    device, vocab = logits.device, logits.shape[1]
    temperature = torch.from_numpy(batch.temperature[rows]).to(device)
    top_k = batch.top_k[rows]
    top_k = torch.from_numpy(np.where(top_k > 0, top_k, vocab)).to(device)
    top_p = torch.from_numpy(batch.top_p[rows]).to(device)

    values, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    cdf = probs.cumsum(dim=-1)
    u = torch.stack([torch.rand((), generator=batch.generators[i]) for i in rows])
    pick = torch.searchsorted(cdf, (u.to(device) * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)
    return order.gather(1, pick).squeeze(1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties, as torch's). On the CPU numpy's is several times
    faster than torch's for the [batch, vocab] logits of every iteration; the tensor shares its memory."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and logits.is_contiguous() \
            and not logits.requires_grad:  # fmt: skip
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _gather_logprobs(
    logprobs: torch.Tensor, tokens: torch.Tensor, rows: list[tuple[int, int]], batch_size: int
) -> list[TokenLogprobs | None]:
    """Per row of the batch: the sampled token's logprob and rank, then the top-k (ranks 1..k); None
    for the rows that did not ask. `logprobs` holds the asking rows only, in `rows`' order."""
    sampled = tokens[[row for row, _ in rows]].to(logprobs.device)[:, None]
    sampled_logprobs = logprobs.gather(1, sampled)
    ranks = (logprobs > sampled_logprobs).sum(dim=1) + 1  # ties share the better rank
    k_max = min(max(k for _, k in rows), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(k_max, dim=1) if k_max else (logprobs[:, :0], sampled[:, :0])
    out: list[TokenLogprobs | None] = [None] * batch_size
    for (row, k), token, value, rank, ids, values in zip(
        rows, sampled[:, 0].tolist(), sampled_logprobs[:, 0].tolist(), ranks.tolist(), top_ids.tolist(),
        top_values.tolist(), strict=True,
    ):  # fmt: skip
        out[row] = ([token, *ids[:k]], [value, *values[:k]], [rank, *range(1, min(k, k_max) + 1)])
    return out


def _ban_index(banned: list[tuple[int, list[int]]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(batch positions, token ids) of every banned entry, as one index: built through numpy, since a
    tensor made from a Python list of a thousand ids costs ~80 µs and numpy's ~10 µs."""
    lengths = [len(ids) for _, ids in banned]
    tokens = np.fromiter(itertools.chain.from_iterable(ids for _, ids in banned), dtype=np.int64, count=sum(lengths))
    rows = np.repeat(np.array([position for position, _ in banned], dtype=np.int64), lengths)
    return torch.from_numpy(rows).to(device), torch.from_numpy(tokens).to(device)
