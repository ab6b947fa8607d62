"""`orca-bench --lora N`: served throughput with N LoRA adapters mixed against none.

orca-bench writes N random adapters of rank --lora-rank for the model (PEFT's format), serves `orca`
alone with them (max_loras = N), and sends bursts of --lora-streams equal requests: without an
adapter, then with request i running adapter i mod N, alternated for --lora-repeats rounds (this
machine's pace drifts; each round's ratio compares neighbouring runs). Greedy, ignore_eos: both runs
generate the same number of tokens.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orca_client.workload import burst_trace

if TYPE_CHECKING:
    from orca_client.bench import Bench


def adapter_names(count: int) -> list[str]:
    return [f"adapter{i}" for i in range(count)]


def write_adapters(out: Path, model: str, count: int, rank: int) -> dict[str, str]:
    """{name: directory} of `count` random adapters for `model` (a preset or a checkpoint directory)."""
    from orca_backend.config import EngineConfig
    from orca_backend.lora import write_random_adapter

    model_config = EngineConfig(model=model).model_config()
    adapters = {}
    for i, name in enumerate(adapter_names(count)):
        path = out / "adapters" / name
        write_random_adapter(path, model_config, rank, seed=i)
        adapters[name] = str(path.resolve())
    return adapters


def run_stage(bench: Bench) -> dict[str, Any]:
    """bench.json's `lora` section."""
    args, orca = bench.args, bench.model("orca")[0]
    names = adapter_names(args.lora)
    base = burst_trace(args.lora_streams, args.lora_prompt, args.lora_tokens, bench.geometry.vocab_size, seed=args.seed + 5)
    mixed = [dataclasses.replace(r, lora_name=names[i % len(names)]) for i, r in enumerate(base)]
    rows = []
    for round_ in range(args.lora_repeats):
        row: dict[str, Any] = {"round": round_ + 1}
        for label, trace in (("none", base), ("mixed", mixed)):
            _, metrics = bench.run(orca, trace, f"LoRA: burst of {len(trace)} on orca, adapters {label}, "
                                                f"round {round_ + 1}/{args.lora_repeats}")  # fmt: skip
            row[f"{label}_tokens_per_s"] = metrics.output_token_throughput
            row[f"{label}_errors"] = metrics.errors
        row["mixed_over_none"] = row["mixed_tokens_per_s"] / row["none_tokens_per_s"] if row["none_tokens_per_s"] else None
        rows.append(row)
    ratios = [r["mixed_over_none"] for r in rows if r["mixed_over_none"] is not None]
    return {"adapters": args.lora, "rank": args.lora_rank, "streams": args.lora_streams, "prompt_len": args.lora_prompt,
            "max_tokens": args.lora_tokens, "rows": rows,
            "mixed_over_none_range": [min(ratios), max(ratios)] if ratios else None}  # fmt: skip


def report_lines(section: dict[str, Any]) -> list[str]:
    """summary.md's LoRA section."""
    lines = [
        "## LoRA: adapters mixed against none",
        "",
        f"Bursts of {section['streams']} equal requests ({section['prompt_len']} prompt + {section['max_tokens']} output "
        f"tokens, greedy, ignore_eos) on `orca` serving {section['adapters']} random adapters of rank "
        f"{section['rank']}: without an adapter, then request i with adapter i mod {section['adapters']}, alternated.",
        "",
        "| round | none tok/s | mixed tok/s | mixed / none |",
        "|---|---|---|---|",
    ]
    for row in section["rows"]:
        ratio = row["mixed_over_none"]
        lines.append(f"| {row['round']} | {row['none_tokens_per_s']:.1f} | {row['mixed_tokens_per_s']:.1f} | "
                     + (f"{ratio:.2f}" if ratio is not None else "–") + " |")
    if section.get("mixed_over_none_range"):
        low, high = section["mixed_over_none_range"]
        lines += ["", f"mixed / none over the rounds: {low:.2f}–{high:.2f}."]
    return lines + [""]
