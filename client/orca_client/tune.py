"""ORCA's tuning step as a command (`orca-bench --tune`): serve one orca copy per value of a parameter
beside each other on the same traces, and pick the value with the highest throughput whose latency
stays within a budget (ORCA §5 tunes the maximum batch size this way).

`--tune max_num_seqs=8,16,32` becomes the orca variants `max_num_seqs-8`, `max_num_seqs-16`, ...
(served as models orca_max_num_seqs-8, ...); the sweep measures each one's throughput–latency curve
at the same rates, and `choose` reads them: a point counts when its median normalized latency (and,
with `p90`, its p90) is within the budget, it had no errors and was not cut short; a value's figure
is the highest achieved request throughput among its points that count.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from orca_client.bench_metrics import RunMetrics

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


@dataclass(frozen=True)
class TuneSpec:
    key: str
    values: tuple[str, ...]

    def variant_name(self, value: str) -> str:
        return _UNSAFE.sub("_", f"{self.key}-{value}")

    def variants(self) -> dict[str, dict[str, str]]:
        """The orca variants to serve: {name: {key: value}}."""
        return {self.variant_name(value): {self.key: value} for value in self.values}


def parse_tune(text: str) -> TuneSpec:
    """'key=v1,v2,...' (argparse type of --tune). Raises ArgumentTypeError naming what is wrong."""
    key, sep, values = (x.strip() for x in text.partition("="))
    parsed = tuple(dict.fromkeys(v.strip() for v in values.split(",") if v.strip()))
    if not sep or not key or len(parsed) < 2:
        raise argparse.ArgumentTypeError(f"--tune takes key=value1,value2[,...] (two values at least), got {text!r}")
    spec = TuneSpec(key, parsed)
    names = [spec.variant_name(v) for v in parsed]
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"--tune {text!r}: two values make the same model name ({', '.join(names)})")
    return spec


@dataclass
class Choice:
    value: str
    variant: str
    max_request_throughput: float  # req/s; 0 when no point of this value met the budget
    output_token_throughput: float  # tok/s of that point
    at_rate: float | None  # its offered rate
    median_ms_per_token: float | None
    p90_ms_per_token: float | None
    points_met: int
    points: int


def _counts(m: RunMetrics, budget_ms: float, p90: bool) -> bool:
    return (m.errors == 0 and not m.truncated and m.normalized_ms.median <= budget_ms
            and (not p90 or m.normalized_ms.p90 <= budget_ms))  # fmt: skip


def choose(spec: TuneSpec, curves: Mapping[str, Sequence[RunMetrics]], budget_ms: float, p90: bool = False) -> dict[str, Any]:
    """Each tuned value's best point within the budget, and the value with the highest throughput
    (ties: the earlier value as given). `curves`: the sweep's points by model name (orca_<variant>)."""
    choices = []
    for value in spec.values:
        variant = spec.variant_name(value)
        points = list(curves.get(f"orca_{variant}", []))
        met = [m for m in points if _counts(m, budget_ms, p90)]
        best = max(met, key=lambda m: m.request_throughput, default=None)
        choices.append(Choice(
            value, variant, best.request_throughput if best else 0.0, best.output_token_throughput if best else 0.0,
            best.offered_rate if best else None, best.normalized_ms.median if best else None,
            best.normalized_ms.p90 if best else None, len(met), len(points),
        ))  # fmt: skip
    winner = max((c for c in choices if c.points_met), key=lambda c: c.max_request_throughput, default=None)
    result: dict[str, Any] = {
        "key": spec.key, "budget_ms_per_token": budget_ms, "percentiles": ["median", "p90"] if p90 else ["median"],
        "choices": [asdict(c) for c in choices], "best": winner.value if winner else None,
    }  # fmt: skip
    if winner is not None:
        result["config_pbtxt"] = config_line(spec.key, winner.value)
    return result


def config_line(key: str, value: str) -> str:
    """The model's config.pbtxt parameter that sets `key` to `value`."""
    return f'parameters: {{ key: "{key}" value: {{ string_value: "{value}" }} }}'
