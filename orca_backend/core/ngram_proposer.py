"""N-gram proposals for speculative decoding (vLLM's `method: "ngram"`, "prompt lookup decoding"):
the tokens a request's context continued with after the latest earlier occurrence of its last n
tokens, n tried from `prompt_lookup_max` down to `prompt_lookup_min`. It reads token ids only, so it
runs in the engine core as the scheduler builds a step, and costs no forward.

The longest n wins (a longer match is a stronger hint), and among its occurrences the latest (text
that repeats tends to repeat its most recent form). A match found near the end proposes fewer than
k tokens: what followed it, up to the context's end.

The lookup runs for every decode of every step, so it must cost next to nothing beside the step:
each request keeps an index of its n-grams (n-gram -> where its latest occurrence ends), extended
by the tokens it gained since its last step, and a proposal is at most one dictionary lookup per n.
"""

from __future__ import annotations

from collections.abc import Sequence

from orca_backend.core.request import Request


class NgramProposer:
    def __init__(self, num_speculative_tokens: int, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max or num_speculative_tokens < 1:
            raise ValueError("an n-gram proposer needs 1 <= prompt_lookup_min <= prompt_lookup_max and k >= 1")
        self.k = num_speculative_tokens
        self.min_n, self.max_n = prompt_lookup_min, prompt_lookup_max
        # Per request: how many of its tokens end an indexed n-gram, and its n-grams' latest ends.
        self._indexes: dict[str, tuple[int, dict[tuple[int, ...], int]]] = {}

    def propose(self, request: Request, limit: int) -> list[int]:
        """Up to min(k, limit) proposed tokens to follow the request's tokens, or [] when its last
        `prompt_lookup_min` tokens occurred nowhere before."""
        return self.propose_tokens(request.request_id, _Tokens(request), limit)

    def propose_tokens(self, key: str, tokens: Sequence[int], limit: int) -> list[int]:
        """`propose` for any token sequence, indexed under `key` (which must keep growing the same
        sequence: a later call sees it longer, never changed)."""
        count, size = min(self.k, limit), len(tokens)
        if count < 1 or size <= self.min_n:
            return []
        indexed, ends = self._indexes.get(key, (0, {}))
        # Earlier occurrences end at size - 1 at the latest (the suffix itself, ending at size, is not
        # one): index the n-grams ending at indexed + 1 .. size - 1.
        for end in range(max(indexed + 1, self.min_n), size):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends[tuple(tokens[end - n : end])] = end
        self._indexes[key] = (max(indexed, size - 1), ends)
        for n in range(min(self.max_n, size - 1), self.min_n - 1, -1):
            end = ends.get(tuple(tokens[size - n : size]))
            if end is not None:
                return list(tokens[end : end + count])
        return []

    def forget(self, key: str) -> None:
        """The request ended: its index goes."""
        self._indexes.pop(key, None)


class _Tokens(Sequence[int]):
    """A request's prompt and output tokens as one sequence, without copying them (sliced only near
    its end, where the proposer reads)."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, request: Request) -> None:
        self._prompt, self._output = request.prompt_ids, request.output_ids

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    def __getitem__(self, index):  # noqa: ANN001, ANN204 - Sequence's int and slice overloads
        if isinstance(index, slice):
            start, stop, _ = index.indices(len(self))
            cut = len(self._prompt)
            if start >= cut:
                return self._output[start - cut : stop - cut]
            if stop <= cut:
                return self._prompt[start:stop]
            return self._prompt[start:] + self._output[: stop - cut]
        return self[index : index + 1][0] if index >= 0 else self[len(self) + index]
