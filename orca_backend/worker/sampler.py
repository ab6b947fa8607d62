"""Token sampling: logits processing, greedy, temperature, top-k, top-p, with a per-request RNG,
and the logprobs of the sampled tokens.

Each request draws from its own generator, seeded with the request's seed (its SamplingParams.seed,
or one the engine drew for it at arrival), and every transform is row-wise, so a request's tokens
do not depend on what else is in the batch, nor on which process samples them.

vLLM v1's order: a structured-output request's grammar mask is applied before the sampler
(worker/bitmask.py, by the model runner); logprobs are taken from those logits (vLLM's default
"raw_logprobs"); then logit_bias, the min_tokens ban and the penalties (worker/logits_processors.py);
then greedy's argmax, or temperature, top-k, top-p and a draw.
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from orca_backend.messages import TokenLogprobs
from orca_backend.worker.batch_meta import BatchMeta, SamplerOutput
from orca_backend.worker.logits_processors import LogitsProcessors


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}
        self.processors = LogitsProcessors()

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)
        self.processors.release(request_ids)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, batch_meta: BatchMeta) -> SamplerOutput:
        """logits: [B, vocab] float32, one row per request (changed in place). Returns one token id
        per request (the scheduler ignores the rows of prefill chunks, `batch_meta.sample` False),
        and the logprobs of the rows that asked for them."""
        logprob_rows: list[tuple[int, int]] = []  # (row, top alternatives)
        raw_logprobs = None
        if batch_meta.extras:  # only requests with penalties, logit_bias or logprobs have extras
            self.processors.update(logits, batch_meta)
            logprob_rows = [(e.row, e.num_logprobs) for e in batch_meta.extras
                            if e.num_logprobs >= 0 and batch_meta.sample[e.row]]  # fmt: skip
            if logprob_rows:  # before any processing
                raw_logprobs = logits[[row for row, _ in logprob_rows]].log_softmax(dim=-1)
            self.processors.apply(logits, batch_meta)
        if any(batch_meta.banned_ids):  # before min_tokens, EOS and stop tokens cannot be sampled (vLLM's semantics)
            logits[_ban_index(batch_meta.banned_ids, logits.device)] = float("-inf")
        tokens = _argmax(logits)
        # A prefill chunk short of its last token samples nothing: its generator must not advance.
        random_rows = [i for i, (t, s) in enumerate(zip(batch_meta.temperature, batch_meta.sample, strict=True)) if t > 0 and s] \
            if any(batch_meta.temperature) else []  # fmt: skip
        if random_rows:
            tokens[random_rows] = self._sample_random(logits[random_rows], batch_meta, random_rows)
        if raw_logprobs is None:
            return SamplerOutput(tokens.tolist())
        logprobs = _gather_logprobs(raw_logprobs, tokens, logprob_rows, len(batch_meta.sample))
        return SamplerOutput(tokens.tolist(), logprobs)

    def _sample_random(self, logits: torch.Tensor, batch_meta: BatchMeta, rows: list[int]) -> torch.Tensor:
        device, vocab = logits.device, logits.shape[1]
        temperature = torch.tensor([batch_meta.temperature[i] for i in rows], device=device)
        top_k = torch.tensor([batch_meta.top_k[i] or vocab for i in rows], device=device)
        top_p = torch.tensor([batch_meta.top_p[i] for i in rows], device=device)

        values, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = values.softmax(dim=-1)
        # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        cdf = probs.cumsum(dim=-1)
        u = torch.stack([torch.rand((), generator=self._generator(batch_meta.request_ids[i], batch_meta.seeds[i])) for i in rows])
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


def _ban_index(banned: list[list[int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, token ids) of every banned entry of the batch, as one index: built through numpy, since
    a tensor made from a Python list of a thousand ids costs ~80 µs and numpy's ~10 µs."""
    lengths = [len(ids) for ids in banned]
    tokens = np.fromiter(itertools.chain.from_iterable(banned), dtype=np.int64, count=sum(lengths))
    rows = np.repeat(np.arange(len(banned), dtype=np.int64), lengths)
    return torch.from_numpy(rows).to(device), torch.from_numpy(tokens).to(device)
