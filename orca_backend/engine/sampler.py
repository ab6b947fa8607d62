"""Token sampling: greedy, temperature, top-k, top-p, with a per-request RNG.

Each request draws from its own generator, seeded from `SamplingParams.seed` (or from the engine's
seed when unset), and every transform is row-wise, so a request's tokens do not depend on what else
is in the batch.
"""

from __future__ import annotations

import random

import torch

from orca_backend.engine.request import Request


class Sampler:
    def __init__(self, eos_token_id: int | None, seed: int) -> None:
        self.eos_token_id = eos_token_id
        self._seeds = random.Random(seed)
        self._generators: dict[str, torch.Generator] = {}

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def _generator(self, request: Request) -> torch.Generator:
        gen = self._generators.get(request.request_id)
        if gen is None:
            seed = request.params.seed if request.params.seed is not None else self._seeds.getrandbits(63)
            gen = self._generators[request.request_id] = torch.Generator().manual_seed(seed)
        return gen

    def _banned_ids(self, request: Request) -> list[int]:
        """Before min_tokens, EOS and stop tokens cannot be sampled at all (vLLM's semantics)."""
        params = request.params
        if len(request.output_ids) >= params.min_tokens:
            return []
        banned = list(params.stop_token_ids)
        if self.eos_token_id is not None and not params.ignore_eos:
            banned.append(self.eos_token_id)
        return banned

    def sample(self, logits: torch.Tensor, requests: list[Request]) -> list[int]:
        """logits: [B, vocab] float32, one row per request. Returns one token id per request."""
        for row, request in enumerate(requests):
            banned = self._banned_ids(request)
            if banned:
                logits[row, banned] = float("-inf")
        tokens = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if random_rows:
            picked = self._sample_random(logits[random_rows], [requests[i] for i in random_rows])
            tokens[random_rows] = picked
        return tokens.tolist()

    def _sample_random(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        device = logits.device
        temperature = torch.tensor([r.params.temperature for r in requests], device=device)
        top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else logits.shape[1] for r in requests], device=device)
        top_p = torch.tensor([r.params.top_p for r in requests], device=device)

        values, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
        ranks = torch.arange(values.shape[1], device=device)[None, :]
        values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
        probs = values.softmax(dim=-1)
        # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
        cdf = probs.cumsum(dim=-1)
        u = torch.stack([torch.rand((), generator=self._generator(r)) for r in requests]).to(device)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=values.shape[1] - 1)
        return order.gather(1, pick).squeeze(1)
