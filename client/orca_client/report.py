"""`orca-bench` outputs: bench.json (everything, raw records included), summary.md, curve.png.

The markdown and the plot are views of the JSON: `render_markdown(json.load(...))` and
`plot_curves(...)` regenerate them from a saved result.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from orca_client import lora_stage

JSON_NAME, MARKDOWN_NAME, PLOT_NAME = "bench.json", "summary.md", "curve.png"
ITERATION_LOGS, ITERATIONS_PLOT = "iteration_logs", "iterations.png"  # --iteration-log


def _json_default(value: Any) -> Any:
    if hasattr(value, "to_dict"):
        return value.to_dict()
    if hasattr(value, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(value)
    raise TypeError(f"not JSON serializable: {type(value).__name__}")


def _clean(value: Any) -> Any:
    """NaN/inf are not JSON: write them as null / "inf" strings."""
    if isinstance(value, float):
        if math.isnan(value):
            return None
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return value
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    return value


def write_json(result: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / JSON_NAME
    plain = json.loads(json.dumps(result, default=_json_default, allow_nan=True))
    path.write_text(json.dumps(_clean(plain), indent=1))
    return path


def _num(value: Any) -> float:
    if value is None:
        return math.nan
    if value == "inf":
        return math.inf
    return float(value)


def _f(value: Any, digits: int = 1) -> str:
    x = _num(value)
    if math.isnan(x):
        return "–"
    if math.isinf(x):
        return "∞"
    return f"{x:.{digits}f}"


def _rate(value: Any) -> str:
    x = _num(value)
    return "burst" if math.isinf(x) else _f(x, 3)


def render_markdown(result: dict[str, Any]) -> str:
    lines = ["# orca-bench: iteration-level (orca) vs request-level (baseline) on one Triton server", ""]
    setup = result.get("setup", {})
    if setup:
        lines += [
            f"Model `{setup.get('model')}` on {setup.get('device')} ({setup.get('dtype')}); workload: "
            f"{setup.get('workload')}. {setup.get('host', '')} Code: commit `{result.get('commit', 'unknown')}`.",
            "",
        ]
    headline = result.get("headline")
    if headline:
        lines += ["## Headline", "", _headline_text(result), ""]
        table = ["| model | max req/s under SLO | at offered req/s | interpolated req/s | points met |",
                 "|---|---|---|---|---|"]
        kinds = _kinds(result)
        for name, s in result.get("sustained", {}).items():
            if kinds.get(name) == "orca_variant":
                continue  # orca's variants have their own section; the headline is orca vs the baselines
            label = result.get("labels", {}).get(name, name)
            flag = " (below the lowest rate)" if s.get("below_grid") else (" (≥: top rate met)" if s.get("above_grid") else "")
            table.append(f"| {label} | {_f(s['max_throughput'], 3)}{flag} | {_rate(s.get('at_rate'))} | "
                         f"{_f(s.get('interpolated'), 3)} | {s['points_met']}/{s['points']} |")
        lines += table + [""]
    if result.get("tune"):
        lines += tune_lines(result["tune"])
    if any(kind == "orca_variant" for kind in _kinds(result).values()):
        lines += _variants_lines(result)
    unloaded = result.get("unloaded")
    if unloaded:
        lines += [
            "## SLO",
            "",
            f"Unloaded per-token latency (one request alone on `orca`: prompt {unloaded['prompt_len']} tokens, "
            f"{unloaded['max_tokens']} output tokens; median of {len(unloaded['normalized_ms'])}): "
            f"**{_f(unloaded['median_ms_per_token'], 2)} ms/token** (TPOT {_f(unloaded.get('tpot_ms'), 2)} ms). "
            f"SLO: median normalized latency ≤ {_f(result['slo']['factor'], 1)}× that = "
            f"**{_f(result['slo']['ms_per_token'], 1)} ms/token**.",
            "",
        ]
    runs = [r["metrics"] for r in result.get("runs", [])]
    if runs:
        lines += [
            "## Throughput–latency points",
            "",
            "Latencies in ms; normalized = end-to-end / output tokens (ms/token); goodput = share of requests "
            "whose normalized latency met the SLO.",
            "",
            "| model | offered req/s | reqs | achieved req/s | out tok/s | norm. median | norm. p90 | norm. p99 | "
            "e2e median | TTFT median | TPOT median | ITL p99 | goodput | batches | SLO |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        for m in runs:
            label = result.get("labels", {}).get(m["model"], m["model"])
            status = "✅" if m.get("slo_met") else ("❌ truncated" if m.get("truncated") else "❌")
            if m.get("errors"):
                status += f" {m['errors']} errors"
            good = m.get("goodput_fraction")
            lines.append(
                f"| {label} | {_rate(m['offered_rate'])} | {m['num_requests']} | {_f(m['request_throughput'], 3)} | "
                f"{_f(m['output_token_throughput'])} | {_f(m['normalized_ms']['median'])} | {_f(m['normalized_ms']['p90'])} | "
                f"{_f(m['normalized_ms']['p99'])} | {_f(m['e2e_ms']['median'], 0)} | {_f(m['ttft_ms']['median'], 0)} | "
                f"{_f(m['tpot_ms']['median'])} | {_f(m['itl_ms']['p99'])} | "
                f"{'–' if good is None else f'{100 * good:.0f}%'} | {m.get('batches') if m.get('batches') is not None else '–'} | {status} |"
            )
        lines.append("")
    split = [m for m in runs if m.get("latency_split_ms")]
    if split:
        lines += [
            "## Where the time went",
            "",
            "Medians in ms, from the server's timeline of each request (`return_perf_metrics`): queue = arrival in the "
            "engine to first scheduled, prefill = to the first token, decode = to the last token, outside = the "
            "client's end-to-end less that span (network, Triton, the response path).",
            "",
            "| model | offered req/s | queue | prefill | decode | outside | requests |",
            "|---|---|---|---|---|---|---|",
        ]
        for m in split:
            parts = m["latency_split_ms"]
            label = result.get("labels", {}).get(m["model"], m["model"])
            lines.append(f"| {label} | {_rate(m['offered_rate'])} | " + " | ".join(
                _f(parts[p]["median"]) for p in ("queue", "prefill", "decode", "outside")) + f" | {parts['queue']['count']} |")
        lines.append("")
    fairness = result.get("fairness")
    if fairness:
        lines += ["## Fairness: a burst of equal-length requests", "", fairness["summary"], "",
                  "| model | requests | makespan s | e2e median ms | out tok/s | batches |", "|---|---|---|---|---|---|"]
        for row in fairness["runs"]:
            lines.append(f"| {row['label']} | {row['requests']} | {_f(row['makespan_s'], 2)} | {_f(row['e2e_median_ms'], 0)} | "
                         f"{_f(row['token_throughput'])} | {row.get('batches') if row.get('batches') is not None else '–'} |")
        lines.append("")
    if result.get("served_path"):
        lines += _served_path_lines(result["served_path"])
    if result.get("lora"):
        lines += lora_stage.report_lines(result["lora"])
    overhead = result.get("loadgen_overhead")
    if overhead:
        lines += ["## Load generator overhead (echo model)", "", overhead["summary"], ""]
    if result.get("notes"):
        lines += ["## Notes", ""] + [f"- {note}" for note in result["notes"]] + [""]
    lines += ["## Command", "", "```", result.get("command", ""), "```", ""]
    if result.get("wall_s") is not None:
        lines.append(f"Finished {result.get('finished', '')} after {_f(result['wall_s'], 0)} s.")
    return "\n".join(lines) + "\n"


def _kinds(result: dict[str, Any]) -> dict[str, str]:
    """Model name -> kind ("orca", "orca_variant", "baseline", "echo") from the result's models."""
    return {m["name"]: m["kind"] for m in result.get("models", []) if "name" in m and "kind" in m}


def common_rate(result: dict[str, Any], models: list[str]) -> float | None:
    """The highest finite offered rate at which every one of `models` has a sweep run (None: none)."""
    rates: set[float] | None = None
    for name in models:
        mine = {_num(r["metrics"]["offered_rate"]) for r in result.get("runs", []) if r["metrics"]["model"] == name}
        rates = mine if rates is None else rates & mine
    finite = [r for r in rates or () if math.isfinite(r)]
    return max(finite) if finite else None


def _prompt_tokens_sent(run: dict[str, Any]) -> int | None:
    raw = run.get("raw") or {}
    requests = raw.get("requests") if isinstance(raw, dict) else None
    return sum(r.get("prompt_len", 0) for r in requests) if requests else None


def _count(value: Any) -> str:
    return "–" if value is None else f"{int(value):,}"


def _variants_lines(result: dict[str, Any]) -> list[str]:
    """One row per orca-kind model: sustained throughput against plain orca, and the engine's numbers.

    Latencies and engine counters come from the one rate every orca-kind model ran (the same trace
    for all), so they compare like for like; the early stop leaves higher rates to some models only."""
    kinds, labels = _kinds(result), result.get("labels", {})
    names = [m["name"] for m in result.get("models", []) if kinds.get(m["name"]) in ("orca", "orca_variant")]
    overrides = {m["name"]: m.get("overrides") or {} for m in result.get("models", [])}
    sustained = result.get("sustained", {})
    rate = common_rate(result, names)
    at_rate = {r["metrics"]["model"]: r for r in result.get("runs", [])
               if rate is not None and _num(r["metrics"]["offered_rate"]) == rate}
    reference = sustained.get("orca", {})
    o_max, o_i = _num(reference.get("max_throughput")), _num(reference.get("interpolated"))
    where = (f"at {_rate(rate)} req/s, the highest rate every orca-kind model ran" if rate is not None
             else "no rate was run by every orca-kind model: –")
    lines = [
        "## K/V policies and variants",
        "",
        "Each variant is a copy of `orca` with only the listed config.pbtxt parameters changed, swept on the same "
        "traces. Max req/s under the SLO as in the headline (interpolated at the SLO crossing in parentheses); "
        "peak running = most requests in the engine's running batch in any of its runs (sampled every ~0.2 s); "
        f"preemptions, prompt tokens computed (of those sent), prefix-cache hit rate (tokens), TTFT and ITL {where} "
        "(preemptions over all its runs in parentheses).",
        "",
        "| model | changes | max req/s under SLO | vs orca | peak running | preemptions | TTFT p50 ms | TTFT p99 ms | "
        "ITL p99 ms | prompt tokens computed | prefix-cache hit rate |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in names:
        s = sustained.get(name, {})
        mine = [r["metrics"] for r in result.get("runs", []) if r["metrics"]["model"] == name]
        best, interp = _num(s.get("max_throughput")), _num(s.get("interpolated"))
        flag = " (below the lowest rate)" if s.get("below_grid") else (" (≥: top rate met)" if s.get("above_grid") else "")
        throughput = f"{_f(best, 3)}{flag}" + (f" ({_f(interp, 3)})" if math.isfinite(interp) else "")
        vs = "1.00×" if name == "orca" else _vs(best, o_max, interp, o_i)
        peaks = [m["peak_running"] for m in mine if m.get("peak_running") is not None]
        total_pre = [m["preemptions"] for m in mine if m.get("preemptions") is not None]
        run = at_rate.get(name)
        m = run["metrics"] if run else {}
        pre = _count(m.get("preemptions")) + (f" ({sum(total_pre):,})" if total_pre else "")
        sent = _prompt_tokens_sent(run) if run else None
        computed = _count(m.get("prompt_tokens_computed")) + (f" of {sent:,}" if sent and m.get("prompt_tokens_computed") is not None else "")
        queries, hits = m.get("prefix_cache_queries"), m.get("prefix_cache_hits")
        hit_rate = f"{100 * hits / queries:.0f}%" if queries and hits is not None else "–"
        changes = ", ".join(f"{k}={v}" for k, v in overrides.get(name, {}).items()) or ("reference" if name == "orca" else "none")
        lines.append(
            f"| {labels.get(name, name)} | {changes} | {throughput} | {vs} | {max(peaks) if peaks else '–'} | {pre} | "
            f"{_f((m.get('ttft_ms') or {}).get('median'), 0)} | {_f((m.get('ttft_ms') or {}).get('p99'), 0)} | "
            f"{_f((m.get('itl_ms') or {}).get('p99'), 1)} | {computed} | {hit_rate} |"
        )
    return lines + [""]


def _vs(best: float, orca: float, interp: float, orca_interp: float) -> str:
    """A variant's max throughput over orca's, and the interpolated ratio as the headline forms it."""
    if not orca > 0:
        return "–"
    text = f"{best / orca:.2f}×"
    if math.isfinite(interp) or math.isfinite(orca_interp):
        num = interp if math.isfinite(interp) else best
        den = orca_interp if math.isfinite(orca_interp) else orca
        if den > 0:
            text += f" ({num / den:.2f}×)"
    return text


def _served_path_lines(section: dict[str, Any]) -> list[str]:
    """The served-path stage (served_path.py): served vs offline throughput, CPU per token."""
    lines = [
        "## Served path: orca through Triton vs the offline engine",
        "",
        f"Bursts of S equal requests ({section['prompt_len']} prompt + {section['max_tokens']} output tokens, greedy, "
        f"ignore_eos) on `orca` over gRPC streams, and the same requests through `LLM.generate` in a separate process "
        f"with orca's engine settings and max_num_seqs = S, while the server is idle; best throughput of "
        f"{section['repeats']} each, with that repeat's CPU. CPU is µs per output token (utime + stime from /proc): "
        "the `orca` stub, the processes below it (engine), tritonserver, and the load generator (client). "
        "Server-CPU efficiency = offline CPU/token ÷ (tritonserver + stub + engine) CPU/token.",
        "",
        "| streams | offline tok/s | offline CPU µs/tok | served tok/s | served/offline | stub µs/tok | "
        "engine procs µs/tok | tritonserver µs/tok | client µs/tok | server-CPU efficiency | responses/token |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in section.get("rows", []):
        if row.get("skipped"):
            lines.append(f"| {row['streams']} | skipped: {row['skipped']} |" + " |" * 9)
            continue
        errors = f" ({row['served_errors']} errors)" if row.get("served_errors") else ""
        lines.append(
            f"| {row['streams']} | {_f(row['offline_tokens_per_s'])} | {_f(row['offline_cpu_us_per_token'], 0)} | "
            f"{_f(row['served_tokens_per_s'])}{errors} | {_f(row['served_over_offline'], 2)} | "
            f"{_f(row['stub_cpu_us_per_token'], 0)} | {_f(row['engine_cpu_us_per_token'], 0)} | "
            f"{_f(row['tritonserver_cpu_us_per_token'], 0)} | {_f(row['client_cpu_us_per_token'], 0)} | "
            f"{_f(row['server_cpu_efficiency'], 2)} | {_f(row['responses_per_token'], 2)} |"
        )
    lines.append("")
    fairness = section.get("fairness")
    if fairness:
        lines += [f"Equal-length burst ({fairness['requests']} requests, the fairness check): orca "
                  f"{_f(fairness['orca_tokens_per_s'])} tok/s vs {fairness['baseline']} "
                  f"{_f(fairness['baseline_tokens_per_s'])} tok/s → orca/baseline = "
                  f"**{_f(fairness['orca_over_baseline'], 2)}×** output-token throughput.", ""]
    else:
        lines += ["Equal-length burst: no baseline ran it (--skip-fairness or no baseline model).", ""]
    lines += [f"- {note}" for note in section.get("notes", [])]
    return lines + ([""] if section.get("notes") else [])


def tune_lines(tune: dict[str, Any]) -> list[str]:
    """The summary's section for `orca-bench --tune` (tune.py)."""
    which = " and ".join(tune["percentiles"])
    lines = ["## Tuning", "",
             f"`{tune['key']}`: the highest throughput whose {which} normalized latency is within "
             f"{_f(tune['budget_ms_per_token'])} ms/token, each value served beside the others on the same traces.", "",
             "| value | max req/s within the budget | out tok/s | at offered req/s | norm. median | norm. p90 | points met |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for c in tune["choices"]:
        mark = " **(best)**" if c["value"] == tune.get("best") else ""
        lines.append(f"| {c['value']}{mark} | {_f(c['max_request_throughput'], 3)} | {_f(c['output_token_throughput'])} | "
                     f"{_rate(c['at_rate'])} | {_f(c['median_ms_per_token'])} | {_f(c['p90_ms_per_token'])} | "
                     f"{c['points_met']}/{c['points']} |")  # fmt: skip
    if tune.get("best") is None:
        lines += ["", "No value met the budget at any rate tried: lower the rates, or raise the budget."]
    else:
        lines += ["", f"Use: `{tune['config_pbtxt']}`"]
    return lines + [""]


def _headline_text(result: dict[str, Any]) -> str:
    h = result["headline"]
    ratio = _num(h.get("ratio"))
    best = result.get("labels", {}).get(h.get("best_baseline"), h.get("best_baseline"))
    text = (f"Max request throughput with median normalized latency ≤ {_f(result['slo']['ms_per_token'], 1)} ms/token: "
            f"**orca {_f(h['orca_rps'], 3)} req/s** vs best baseline **{best} {_f(h['best_baseline_rps'], 3)} req/s** "
            f"→ **{'∞' if math.isinf(ratio) else _f(ratio, 2)}×**")
    if h.get("ratio_interpolated") is not None:
        text += f" (interpolated at the SLO crossing: {_f(h['ratio_interpolated'], 2)}×)"
    if h.get("qualifier"):
        text += f". {h['qualifier']}"
    return text + "."


def write_markdown(result: dict[str, Any], out_dir: Path) -> Path:
    path = out_dir / MARKDOWN_NAME
    plain = json.loads(json.dumps(_clean(json.loads(json.dumps(result, default=_json_default)))))
    path.write_text(render_markdown(plain))
    return path


def plot_curves(result: dict[str, Any], out_dir: Path) -> Path | None:
    """Median normalized latency vs achieved throughput per model, like ORCA's Figure 8-10."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [r["metrics"] for r in result.get("runs", [])]
    if not runs:
        return None
    labels = result.get("labels", {})
    kinds = _kinds(result)
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=120)
    markers = iter("os^Dv<>p")
    all_y = []
    for model in dict.fromkeys(m["model"] for m in runs):
        points = sorted((m for m in runs if m["model"] == model), key=lambda m: _num(m["offered_rate"]))
        xs = [_num(m["request_throughput"]) for m in points]
        ys = [_num(m["normalized_ms"]["median"]) for m in points]
        all_y += [y for y in ys if math.isfinite(y)]
        style = "-" if model == "orca" else ("-." if kinds.get(model) == "orca_variant" else "--")
        ax.plot(xs, ys, style, marker=next(markers, "o"), label=labels.get(model, model), linewidth=2 if model == "orca" else 1.3)
    slo = result.get("slo", {}).get("ms_per_token")
    if slo:
        ax.axhline(_num(slo), color="grey", linestyle=":", label=f"SLO {_f(slo, 0)} ms/token")
        all_y.append(_num(slo))
    if all_y and max(all_y) / max(min(all_y), 1e-9) > 30:
        ax.set_yscale("log")
    ax.set_xlabel("throughput (req/s)")
    ax.set_ylabel("median normalized latency (ms/token)")
    setup = result.get("setup", {})
    ax.set_title(f"{setup.get('model', '')} on {setup.get('device', '')}: orca vs request-level baseline", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path = out_dir / PLOT_NAME
    fig.savefig(path)
    plt.close(fig)
    return path


def read_iteration_logs(log_dir: Path) -> dict[str, list[dict[str, Any]]]:
    """Each model's iteration-log lines (its iterations only), by model name."""
    logs = {}
    for path in sorted(log_dir.glob("*.jsonl")):
        lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        logs[path.stem] = [line for line in lines if "iteration" in line]
    return logs


def plot_iterations(log_dir: Path, out_dir: Path) -> Path | None:
    """Batch size (requests per iteration) and K/V blocks in use over the run, one line per model:
    what iteration-level scheduling does differently, beside the A/B curve."""
    logs = {model: lines for model, lines in read_iteration_logs(log_dir).items() if lines}
    if not logs:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    start = min(lines[0]["time"] for lines in logs.values())
    fig, (batch_ax, kv_ax) = plt.subplots(2, 1, figsize=(8, 5.5), dpi=120, sharex=True)
    for model, lines in logs.items():
        times = [line["time"] - start for line in lines]
        width = 1.6 if model == "orca" else 1.0
        batch_ax.plot(times, [line["requests"] for line in lines], label=model, linewidth=width)
        kv_ax.plot(times, [line["kv_blocks_used"] for line in lines], label=model, linewidth=width)
    batch_ax.set_ylabel("requests per iteration")
    kv_ax.set_ylabel("K/V blocks in use")
    kv_ax.set_xlabel("seconds since the first iteration")
    for ax in (batch_ax, kv_ax):
        ax.grid(True, alpha=0.3)
    batch_ax.legend(fontsize=8)
    batch_ax.set_title("iteration logs: batch size and K/V use over the run", fontsize=10)
    fig.tight_layout()
    path = out_dir / ITERATIONS_PLOT
    fig.savefig(path)
    plt.close(fig)
    return path


def write_all(result: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": write_json(result, out_dir), "markdown": write_markdown(result, out_dir)}
    plot = plot_curves(json.loads(paths["json"].read_text()), out_dir)
    if plot is not None:
        paths["plot"] = plot
    if (out_dir / ITERATION_LOGS).is_dir() and (iterations := plot_iterations(out_dir / ITERATION_LOGS, out_dir)):
        paths["iterations"] = iterations
    return paths
