"""Workloads as ORCA §6 built them: Poisson arrivals, prompt and output lengths from seeded
distributions, every request generating exactly its length (ignore_eos); or a JSONL trace.

A sweep replays *one* request set at several rates: `synthetic_trace` draws arrivals at the given
rate, and `at_rate` rescales any trace's arrival times to another mean rate, so every point of a
throughput–latency curve serves the same requests in the same relative pattern.

A shared prefix (`shared_prefix` tokens, like a system prompt) starts every synthetic prompt; its
tokens come from their own seeded stream, so the rest of the trace is the same with or without it.
With a prefix cache on the server, replaying one request set at every rate would let a later rate
find whole prompts of an earlier one in the cache; `salted` varies the first token after the shared
prefix per rate (same lengths, same shared part) so only what the workload really shares is reused.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass, replace
from pathlib import Path

DIST_HELP = "uniform:LO:HI, lognormal:MEDIAN:MAX (long-tailed, like chat traffic) or fixed:N"
ARRIVAL_HELP = "poisson, or gamma:CV (bursty when CV > 1: inter-arrival coefficient of variation)"


@dataclass
class TraceRequest:
    arrival: float  # seconds after the start of the run
    prompt_ids: list[int]
    max_tokens: int  # the output tokens it generates
    prompt_text: str | None = None  # set only by JSONL traces that carry text; sent as text_input then
    # Early-stop mode (`orca-bench --max-tokens`, see early_stop.py): sent with this looser max_tokens,
    # the request ends at its stop token after `max_tokens` tokens, as an answer ends at EOS.
    sent_max_tokens: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    lora_name: str | None = None  # the LoRA adapter it runs (`orca-bench --lora`; a JSONL trace's "lora_name")

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)


def parse_dist(spec: str) -> tuple[str, float, float]:
    """'uniform:16:256' (inclusive bounds), 'lognormal:MEDIAN:MAX' or 'fixed:N' -> (kind, a, b)."""
    parts = spec.split(":")
    try:
        if len(parts) == 2 and parts[0] == "fixed":
            kind, lo, hi = "fixed", float(parts[1]), float(parts[1])
        else:
            kind, a, b = parts
            lo, hi = float(a), float(b)
    except ValueError:
        raise ValueError(f"length distribution must look like {DIST_HELP}; got {spec!r}") from None
    if kind not in ("uniform", "lognormal", "fixed") or lo < 1 or hi < lo:
        raise ValueError(f"bad length distribution {spec!r}; use {DIST_HELP}")
    return kind, lo, hi


def dist_max(spec: str) -> int:
    return int(parse_dist(spec)[2])


def dist_median(spec: str) -> int:
    kind, a, b = parse_dist(spec)
    return round((a + b) / 2) if kind == "uniform" else int(a)


def sample_length(spec: str, rng: random.Random) -> int:
    kind, a, b = parse_dist(spec)
    if kind == "fixed":
        return int(a)
    if kind == "uniform":
        return rng.randint(int(a), int(b))
    # Log-normal with the given median and sigma 1: median ~a, a long tail clipped at b.
    return max(1, min(int(b), round(rng.lognormvariate(math.log(a), 1.0))))


def parse_arrival(spec: str) -> float:
    """'poisson' -> CV 1.0; 'gamma:CV' -> CV (the inter-arrival coefficient of variation)."""
    if spec == "poisson":
        return 1.0
    kind, _, value = spec.partition(":")
    try:
        cv = float(value)
    except ValueError:
        cv = -1.0
    if kind != "gamma" or cv <= 0:
        raise ValueError(f"arrival process must be {ARRIVAL_HELP}; got {spec!r}")
    return cv


def inter_arrival(rate: float, cv: float, rng: random.Random) -> float:
    """One gap of a renewal process with mean 1/rate; CV 1 is Poisson (exponential gaps)."""
    if cv == 1.0:
        return rng.expovariate(rate)
    shape = 1.0 / (cv * cv)  # gamma with shape k has CV 1/sqrt(k)
    return rng.gammavariate(shape, 1.0 / (rate * shape))


def shared_prefix_ids(length: int, vocab_size: int, seed: int = 0) -> list[int]:
    """The `length` tokens every prompt of a --shared-prefix workload starts with (its own stream:
    adding a prefix leaves the rest of the trace as it was)."""
    rng = random.Random(f"shared-prefix:{seed}")
    return [rng.randrange(vocab_size) for _ in range(length)]


def synthetic_trace(
    num_requests: int,
    prompt_dist: str,
    output_dist: str,
    vocab_size: int,
    request_rate: float = math.inf,
    seed: int = 0,
    arrival: str = "poisson",
    shared_prefix: int = 0,
) -> list[TraceRequest]:
    """request_rate in req/s; inf puts every arrival at 0 (an offline batch or a burst).

    shared_prefix: every prompt is the same `shared_prefix` tokens followed by its own prompt
    drawn from prompt_dist (so prompt_len = shared_prefix + that draw)."""
    if shared_prefix < 0:
        raise ValueError(f"shared_prefix must be >= 0, got {shared_prefix}")
    cv = parse_arrival(arrival)
    rng = random.Random(seed)
    prefix = shared_prefix_ids(shared_prefix, vocab_size, seed)
    t = 0.0
    trace = []
    for _ in range(num_requests):
        if math.isfinite(request_rate):
            t += inter_arrival(request_rate, cv, rng)
        prompt = [rng.randrange(vocab_size) for _ in range(sample_length(prompt_dist, rng))]
        trace.append(TraceRequest(t, prefix + prompt, sample_length(output_dist, rng)))
    return trace


def salted(trace: list[TraceRequest], position: int, vocab_size: int, salt: str) -> list[TraceRequest]:
    """The trace with each prompt's token at `position` replaced by another one drawn from `salt`.

    Prefix caches hash whole blocks chained from the start, so one changed token makes everything
    from its block on new to the cache; lengths (and so the work) stay the same. A prompt no longer
    than `position` (or a text prompt) is left as it is."""
    rng = random.Random(f"salt:{salt}")
    out = []
    for r in trace:
        ids = r.prompt_ids
        if r.prompt_text is None and len(ids) > position and vocab_size > 1:
            token = (ids[position] + 1 + rng.randrange(vocab_size - 1)) % vocab_size  # never the original
            ids = [*ids[:position], token, *ids[position + 1:]]
        out.append(replace(r, prompt_ids=ids))
    return out


def burst_trace(num_requests: int, prompt_len: int, max_tokens: int, vocab_size: int, seed: int = 0) -> list[TraceRequest]:
    """Equal-length requests all arriving at 0: the fairness check (nothing for ORCA to win)."""
    return synthetic_trace(num_requests, f"fixed:{prompt_len}", f"fixed:{max_tokens}", vocab_size, seed=seed)


def mean_rate(trace: list[TraceRequest]) -> float:
    """Requests per second over the span of arrivals (inf for a burst)."""
    if len(trace) < 2:
        return math.inf
    span = trace[-1].arrival - trace[0].arrival
    return (len(trace) - 1) / span if span > 0 else math.inf


def at_rate(trace: list[TraceRequest], rate: float) -> list[TraceRequest]:
    """The same requests with arrival times scaled so the mean rate is `rate` (inf: all at 0)."""
    start = trace[0].arrival if trace else 0.0
    native = mean_rate(trace)
    if not math.isfinite(rate) or not math.isfinite(native):
        scale = 0.0 if not math.isfinite(rate) else 1.0
    else:
        scale = native / rate
    return [replace(r, arrival=(r.arrival - start) * scale) for r in trace]


def check_fits(trace: list[TraceRequest], context_len: int, vocab_size: int, shared_prefix: int = 0) -> None:
    """Raises ValueError naming the first request the model would refuse (so a sweep does not
    discover it as an error rate). Prompts include any shared prefix; `shared_prefix` only words
    the advice."""
    for i, r in enumerate(trace):
        if r.max_tokens < 1:
            raise ValueError(f"request {i}: max_tokens must be >= 1, got {r.max_tokens}")
        if r.prompt_text is None and (not r.prompt_ids or max(r.prompt_ids) >= vocab_size or min(r.prompt_ids) < 0):
            raise ValueError(f"request {i}: prompt ids must be non-empty and within the vocabulary [0, {vocab_size})")
        sent = max(r.max_tokens, r.sent_max_tokens or 0)
        if r.prompt_len + sent > context_len:
            prefix = f" (of which {shared_prefix} shared prefix)" if shared_prefix else ""
            flags = "--shared-prefix/--prompt-dist/--output-dist" if shared_prefix else "--prompt-dist/--output-dist"
            flags += "/--max-tokens" if r.sent_max_tokens else ""
            raise ValueError(
                f"request {i}: prompt ({r.prompt_len}{prefix}) + max_tokens ({sent}) exceeds the model's "
                f"context of {context_len} tokens; shorten {flags}"
            )


def load_trace(path: str | Path) -> list[TraceRequest]:
    """JSONL, one request per line: {"arrival": s, "prompt_ids": [...] or "prompt": "text", "max_tokens": n},
    optionally "lora_name": the LoRA adapter it runs.

    Text prompts are sent as text_input (the model needs a tokenizer); their prompt_len is unknown
    to the client and counts as 0 in context checks.
    """
    trace = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {"arrival", "max_tokens"} - set(row)
        if "prompt_ids" not in row and "prompt" not in row:
            missing.add("prompt_ids or prompt")
        if missing:
            raise ValueError(f"{path}:{n}: missing {', '.join(sorted(missing))}")
        if "prompt_ids" in row:
            ids, text = [int(t) for t in row["prompt_ids"]], None
        else:
            ids, text = [], str(row["prompt"])
        trace.append(TraceRequest(float(row["arrival"]), ids, int(row["max_tokens"]), text, lora_name=row.get("lora_name")))
    return sorted(trace, key=lambda r: r.arrival)


def save_trace(trace: list[TraceRequest], path: str | Path) -> None:
    lines = []
    for r in trace:
        row: dict = {"arrival": r.arrival, "max_tokens": r.max_tokens}
        if r.prompt_text is not None:
            row["prompt"] = r.prompt_text
        else:
            row["prompt_ids"] = r.prompt_ids
        if r.lora_name is not None:
            row["lora_name"] = r.lora_name
        lines.append(json.dumps(row) + "\n")
    Path(path).write_text("".join(lines))
