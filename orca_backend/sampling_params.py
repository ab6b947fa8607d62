"""Per-request sampling and stopping parameters, validated at construction."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Any

MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed's range
MAX_TOP_K = 2**31 - 1  # anything at or above the vocabulary means no cut


@dataclass
class SamplingParams:
    max_tokens: int = 16
    min_tokens: int = 0  # EOS and stop conditions are ignored until this many tokens exist
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None  # same seed, same tokens, whatever else is in the batch
    stop: list[str] = field(default_factory=list)  # stop strings; excluded from the returned text
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _check(isinstance(self.max_tokens, int) and self.max_tokens > 0, f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _check(isinstance(self.min_tokens, int) and 0 <= self.min_tokens <= self.max_tokens,
               f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], got {self.min_tokens!r}")
        # Every value below reaches the sampler in a batch with other requests: one the sampler cannot
        # take (an infinite temperature, a seed torch refuses, a top_k beyond int64) must be refused here.
        _check(isinstance(self.temperature, int | float) and math.isfinite(self.temperature) and self.temperature >= 0,
               f"temperature must be a finite number >= 0, got {self.temperature!r}")
        _check(isinstance(self.top_p, int | float) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        _check(isinstance(self.top_k, int) and -1 <= self.top_k <= MAX_TOP_K,
               f"top_k must be -1, 0 or a positive integer up to {MAX_TOP_K}, got {self.top_k!r}")
        _check(self.seed is None or (isinstance(self.seed, int) and 0 <= self.seed <= MAX_SEED),
               f"seed must be an integer in [0, {MAX_SEED}], got {self.seed!r}")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop must be a list of non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids), "stop_token_ids must be non-negative integers")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @classmethod
    def from_dict(cls, values: dict[str, Any]) -> SamplingParams:
        """Builds params from a client's dict (e.g. Triton's `sampling_parameters` JSON).

        Numbers may arrive as strings (genai-perf sends ``{"max_tokens": "32"}``); unknown keys are
        an error rather than silently ignored, so a typo never changes what a user gets.
        """
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(values) - set(known))
        _check(not unknown, f"unknown sampling parameter(s): {', '.join(unknown)}; known: {', '.join(known)}")
        kwargs: dict[str, Any] = {}
        for key, raw in values.items():
            kwargs[key] = _coerce(key, raw)
        return cls(**kwargs)

    @classmethod
    def from_json(cls, text: str) -> SamplingParams:
        return cls.from_dict(parse_sampling_json(text))


def parse_sampling_json(text: str) -> dict[str, Any]:
    """A `sampling_parameters` JSON object as a dict (empty text: no parameters)."""
    if not text.strip():
        return {}
    try:
        values = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"sampling_parameters is not valid JSON ({exc}); send e.g. "
                         '{"temperature": 0, "max_tokens": 16}') from None
    _check(isinstance(values, dict), f"sampling_parameters must be a JSON object, got {type(values).__name__}")
    return values


_INT_KEYS = {"max_tokens", "min_tokens", "top_k", "seed"}
_FLOAT_KEYS = {"temperature", "top_p"}


def _coerce(key: str, raw: Any) -> Any:
    if raw is None and key == "seed":
        return None
    if key in _INT_KEYS:
        if isinstance(raw, bool):
            raise ValueError(f"{key} must be an integer, got {raw!r}")
        if isinstance(raw, float) and raw.is_integer():
            return int(raw)
        if isinstance(raw, str):
            try:
                return int(raw.strip())
            except ValueError:
                raise ValueError(f"{key} must be an integer, got {raw!r}") from None
        _check(isinstance(raw, int), f"{key} must be an integer, got {raw!r}")
        return raw
    if key in _FLOAT_KEYS:
        if isinstance(raw, bool):
            raise ValueError(f"{key} must be a number, got {raw!r}")
        try:
            return float(raw)
        except (TypeError, ValueError):
            raise ValueError(f"{key} must be a number, got {raw!r}") from None
    if key == "ignore_eos":
        if isinstance(raw, str) and raw.lower() in ("true", "false"):
            return raw.lower() == "true"
        _check(isinstance(raw, bool), f"ignore_eos must be a boolean, got {raw!r}")
        return raw
    if key == "stop":
        _check(isinstance(raw, (str, list)), f"stop must be a string or a list of strings, got {raw!r}")
        return raw
    if key == "stop_token_ids":
        _check(isinstance(raw, list), f"stop_token_ids must be a list of integers, got {raw!r}")
        return [_coerce("seed", t) for t in raw]
    return raw


def _check(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)
