"""A suite of benchmarks/offline.py on this tree and on a baseline commit, run alternately in one
session on one machine, so a change is measured side by side rather than against a figure from
another day (this machine is shared: its speed moves by tens of percent between hours).

    python benchmarks/ab.py --baseline ff06023 --rounds 5 --json docs/bench/overhead-ab.json
    python benchmarks/ab.py --baseline 6c6a658 --suite throughput --model llama-150m --dtype bfloat16 --rounds 2
    python benchmarks/ab.py --baseline 6c6a658 --suite prefill --dtype bfloat16 --rounds 3
    python benchmarks/ab.py --baseline f759017 --suite gemm --dtype float32 --rounds 2
    python benchmarks/ab.py --baseline HEAD --baseline-env THP_MEM_ALLOC_ENABLE=0 --suite roofline  # a setting

The baseline is `git archive`d into a temporary directory and its `orca_backend` and kernels are put
first on the path of the runs made for it; both sides run this tree's suite code (offline.py), so
they time the same scenarios. --baseline-env gives the baseline's runs variables of their own (with
--baseline HEAD: a setting against its default, on one tree). Each round runs the baseline, then
this tree; the report gives each measure's range over the rounds and the ratio of the medians (tree
/ baseline).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))  # orca_client from this tree, installed or not


def _overhead(result: dict) -> dict[str, float]:
    return {f"{scenario} {measure}": row[measure] for scenario, row in result.items()
            for measure in ("overhead_ms", "sampler_ms", "step_ms") if measure in row}  # fmt: skip


# Each suite's measures, read from its result: overhead's per scenario; throughput's best run of
# --repeat (offline.py keeps the best); prefill's and roofline's medians within the run.
MEASURES: dict[str, Callable[[dict], dict[str, float]]] = {
    "overhead": _overhead,
    "throughput": lambda r: {"seconds": r["orca"]["seconds"], "tokens_per_s": r["orca"]["tokens_per_s"]},
    "prefill": lambda r: {"step_s": statistics.median(r["step_s"]),
                          "fraction_of_peak": statistics.median(r["fraction_of_peak"])},  # fmt: skip
    "roofline": lambda r: {"decode_step_ms": r["decode_step_ms"], "fraction_of_roofline": r["fraction_of_roofline"]},
    "attention": lambda r: {**{f"decode {n:>2} requests ms": row["ms"] for n, row in r["decode"].items()},
                            **{f"prefill {shape} {kind} ms": row[kind]["ms"] for shape, row in r["prefill"].items()
                               for kind in row}},  # fmt: skip
    "gemm": lambda r: {f"{tokens:>4} tokens {kind} ms": row[kind]["ms"] for tokens, row in r["tokens"].items()
                       for kind in row if kind != "weight_bytes"},  # fmt: skip
}


def baseline_tree(revision: str, into: Path) -> dict[str, str]:
    """Extracts `revision` into `into` and returns the environment that makes its packages the ones
    imported (its orca_backend, and its orca_kernels: kernels/orca_kernels/, or kernels/ itself in
    revisions from before the package folders were named as they import)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    if (into / "kernels" / "orca_kernels").is_dir():
        return {**os.environ, "PYTHONPATH": os.pathsep.join([str(into / "kernels"), str(into)])}
    packages = into / "_packages"
    packages.mkdir()
    (packages / "orca_kernels").symlink_to(into / "kernels")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(packages), str(into)])}


def run_suite(suite: str, suite_args: list[str], env: dict[str, str] | None, out: Path) -> dict[str, float]:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline.py"), "--suites", suite, *suite_args,
                    "--json", str(out)], env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return MEASURES[suite](json.loads(out.read_text())[suite])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the git revision to compare against")
    ap.add_argument("--suite", choices=sorted(MEASURES), default="overhead")
    ap.add_argument("--model", help="offline.py's --model (its default if not given)")
    ap.add_argument("--dtype", help="offline.py's --dtype")
    ap.add_argument("--repeat", help="offline.py's --repeat (within each run)")
    ap.add_argument("--baseline-env", action="append", default=[], metavar="KEY=VALUE",
                    help="a variable the baseline's runs get (repeatable)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from orca_client import machine

    suite_args = [arg for name in ("model", "dtype", "repeat") if getattr(args, name) for arg in (f"--{name}", getattr(args, name))]
    runs: dict[str, list[dict[str, float]]] = {"baseline": [], "tree": []}
    with tempfile.TemporaryDirectory(prefix="orca-baseline-") as tmp:
        env = baseline_tree(args.baseline, Path(tmp)) | dict(kv.split("=", 1) for kv in args.baseline_env)
        for round_ in range(args.rounds):
            for side, side_env in (("baseline", env), ("tree", None)):
                runs[side].append(run_suite(args.suite, suite_args, side_env, Path(tmp) / f"{side}-{round_}.json"))
                print(f"round {round_ + 1}/{args.rounds}: {side} done", flush=True)
    report: dict = {"command": " ".join(sys.argv), "baseline": args.baseline, "baseline_env": args.baseline_env,
                    "tree": machine.code_revision(ROOT),
                    "machine": machine.describe(), "suite": args.suite, "rounds": args.rounds, "measures": {}}  # fmt: skip
    print(f"machine: {machine.summary(report['machine'])}; {args.suite}: baseline {args.baseline} vs tree "
          f"{report['tree']}, {args.rounds} alternating rounds")  # fmt: skip
    for measure in runs["tree"][0]:
        sides = {side: [r[measure] for r in runs[side] if measure in r] for side in runs}
        row: dict = {side: {"min": min(v), "median": statistics.median(v), "max": max(v), "all": v}
                     for side, v in sides.items() if v}  # fmt: skip
        if all(sides.values()):
            row["ratio_of_medians"] = statistics.median(sides["tree"]) / statistics.median(sides["baseline"])
        report["measures"][measure] = row
        base = f"{row['baseline']['min']:.4g}-{row['baseline']['max']:.4g}" if "baseline" in row else "n/a"
        ratio = f"{row['ratio_of_medians']:.2f}x" if "ratio_of_medians" in row else ""
        print(f"{measure:28s} baseline {base:>17s}  tree {row['tree']['min']:.4g}-{row['tree']['max']:.4g}  {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
