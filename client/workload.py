"""Synthetic workloads as ORCA §6 built them: Poisson arrivals, prompt and output lengths from
seeded distributions, every request generating exactly its length (ignore_eos); or a JSONL trace.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class TraceRequest:
    arrival: float  # seconds after the start of the run
    prompt_ids: list[int]
    max_tokens: int


def parse_dist(spec: str) -> tuple[str, float, float]:
    """'uniform:16:256' (inclusive bounds) or 'lognormal:MEDIAN:MAX' (long-tailed, like chat outputs)."""
    try:
        kind, a, b = spec.split(":")
        lo, hi = float(a), float(b)
    except ValueError:
        raise ValueError(f"length distribution must look like uniform:LO:HI or lognormal:MEDIAN:MAX, got {spec!r}") from None
    if kind not in ("uniform", "lognormal") or lo < 1 or hi < lo:
        raise ValueError(f"bad length distribution {spec!r}")
    return kind, lo, hi


def sample_length(spec: str, rng: random.Random) -> int:
    kind, a, b = parse_dist(spec)
    if kind == "uniform":
        return rng.randint(int(a), int(b))
    # Log-normal with the given median and sigma 1: median ~a, a long tail clipped at b.
    return max(1, min(int(b), round(rng.lognormvariate(math.log(a), 1.0))))


def synthetic_trace(
    num_requests: int,
    prompt_dist: str,
    output_dist: str,
    vocab_size: int,
    request_rate: float = math.inf,
    seed: int = 0,
) -> list[TraceRequest]:
    """request_rate in req/s (Poisson); inf puts every arrival at 0 (an offline batch)."""
    rng = random.Random(seed)
    t = 0.0
    trace = []
    for _ in range(num_requests):
        if math.isfinite(request_rate):
            t += rng.expovariate(request_rate)
        prompt = [rng.randrange(vocab_size) for _ in range(sample_length(prompt_dist, rng))]
        trace.append(TraceRequest(t, prompt, sample_length(output_dist, rng)))
    return trace


def load_trace(path: str | Path) -> list[TraceRequest]:
    """JSONL, one request per line: {"arrival": s, "prompt_ids": [...], "max_tokens": n}."""
    trace = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        missing = {"arrival", "prompt_ids", "max_tokens"} - set(row)
        if missing:
            raise ValueError(f"{path}:{n}: missing {', '.join(sorted(missing))}")
        trace.append(TraceRequest(float(row["arrival"]), [int(t) for t in row["prompt_ids"]], int(row["max_tokens"])))
    return sorted(trace, key=lambda r: r.arrival)


def save_trace(trace: list[TraceRequest], path: str | Path) -> None:
    Path(path).write_text("".join(json.dumps(asdict(r)) + "\n" for r in trace))
