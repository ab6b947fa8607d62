"""Token sampling: greedy, temperature, top-k, top-p, with a per-request RNG.

Each request draws from its own generator, seeded with the request's seed (its SamplingParams.seed,
or one the engine drew for it at arrival), and every transform is row-wise, so a request's tokens
do not depend on what else is in the batch, nor on which process samples them.
"""

from __future__ import annotations

import torch

from orca_backend.worker.batch_meta import BatchMeta


class Sampler:
    def __init__(self) -> None:
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_ids: list[str]) -> None:
        for request_id in request_ids:
            self._generators.pop(request_id, None)

    def _generator(self, request_id: str, seed: int) -> torch.Generator:
        gen = self._generators.get(request_id)
        if gen is None:
            gen = self._generators[request_id] = torch.Generator().manual_seed(seed)
        return gen

    def sample(self, logits: torch.Tensor, batch_meta: BatchMeta) -> list[int]:
        """logits: [B, vocab] float32, one row per request. Returns one token id per request (the
        scheduler ignores the rows of prefill chunks, `batch_meta.sample` False)."""
        for row, banned in enumerate(batch_meta.banned_ids):
            if banned:  # before min_tokens, EOS and stop tokens cannot be sampled at all (vLLM's semantics)
                logits[row, banned] = float("-inf")
        tokens = logits.argmax(dim=-1)
        # A prefill chunk short of its last token samples nothing: its generator must not advance.
        random_rows = [i for i, (t, s) in enumerate(zip(batch_meta.temperature, batch_meta.sample, strict=True)) if t > 0 and s]
        if random_rows:
            tokens[random_rows] = self._sample_random(logits[random_rows], batch_meta, random_rows)
        return tokens.tolist()

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
