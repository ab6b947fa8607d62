"""N-gram proposals for speculative decoding (vLLM's `method: "ngram"`, "prompt lookup decoding"):
the tokens a request's context continued with after the latest earlier occurrence of its last n
tokens, n tried from `prompt_lookup_max` down to `prompt_lookup_min`. It reads token ids only, so it
runs in the engine core as the scheduler builds a step, and costs no forward.

The longest n wins (a longer match is a stronger hint), and among its occurrences the latest (text
that repeats tends to repeat its most recent form). A match found near the end proposes fewer than
k tokens: what followed it, up to the context's end.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max or num_speculative_tokens < 1:
            raise ValueError("an n-gram proposer needs 1 <= prompt_lookup_min <= prompt_lookup_max and k >= 1")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max

    def propose(self, tokens: np.ndarray, limit: int) -> list[int]:
        """Up to min(k, limit) proposed next tokens for a context `tokens` (int array), or [] when
        its last `prompt_lookup_min` tokens occurred nowhere before."""
        count = min(self.k, limit)
        size = len(tokens)
        if count < 1 or size <= self.min_n:
            return []
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            # Windows starting at 0 .. size - n - 1: every earlier n-gram (the suffix itself excluded).
            windows = sliding_window_view(tokens[: size - 1], n)
            hits = np.flatnonzero((windows == tokens[size - n :]).all(axis=1))
            if len(hits):
                start = int(hits[-1]) + n  # what followed its latest occurrence
                return tokens[start : start + count].tolist()
        return []
