"""The engine-overhead suite of benchmarks/offline.py on this tree and on a baseline commit, run
alternately in one session on one machine, so a change to the per-iteration work is measured side
by side rather than against a figure from another day.

    python benchmarks/overhead_ab.py --baseline ff06023 --rounds 5 --json docs/bench/overhead-ab.json

The baseline is `git archive`d into a temporary directory and its `orca_backend` and kernels are put
first on the path of the runs made for it; both sides run this tree's suite code (offline.py's
`suite_overhead`), so they time the same scenarios. Each round runs the baseline, then this tree;
the report gives each scenario's range over the rounds and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))  # orca_client from this tree, installed or not


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


def run_suite(env: dict[str, str] | None, out: Path) -> dict:
    subprocess.run([sys.executable, str(ROOT / "benchmarks" / "offline.py"), "--suites", "overhead", "--json", str(out)],
                   env=env, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    return json.loads(out.read_text())["overhead"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", required=True, help="the git revision to compare against")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    from orca_client import machine

    runs: dict[str, list[dict]] = {"baseline": [], "tree": []}
    with tempfile.TemporaryDirectory(prefix="orca-baseline-") as tmp:
        env = baseline_tree(args.baseline, Path(tmp))
        for round_ in range(args.rounds):
            for side, side_env in (("baseline", env), ("tree", None)):
                runs[side].append(run_suite(side_env, Path(tmp) / f"{side}-{round_}.json"))
                print(f"round {round_ + 1}/{args.rounds}: {side} done", flush=True)
    report: dict = {"command": " ".join(sys.argv), "baseline": args.baseline, "tree": machine.code_revision(ROOT),
                    "machine": machine.describe(), "rounds": args.rounds, "scenarios": {}}  # fmt: skip
    print(f"machine: {machine.summary(report['machine'])}; baseline {args.baseline} vs tree {report['tree']}, "
          f"{args.rounds} rounds (each a median of 40 steps)")  # fmt: skip
    for scenario in runs["tree"][0]:
        row: dict = {}
        for measure in ("overhead_ms", "sampler_ms", "step_ms"):
            sides = {side: [r[scenario][measure] for r in runs[side] if scenario in r] for side in runs}
            row[measure] = {side: {"min": min(v), "median": statistics.median(v), "max": max(v), "all": v}
                            for side, v in sides.items() if v}  # fmt: skip
            if all(sides.values()):
                row[measure]["ratio_of_medians"] = statistics.median(sides["tree"]) / statistics.median(sides["baseline"])
        report["scenarios"][scenario] = row
        o = row["overhead_ms"]
        base = f"{o['baseline']['min']:.2f}-{o['baseline']['max']:.2f}" if "baseline" in o else "n/a"
        ratio = f"{o['ratio_of_medians']:.2f}x" if "ratio_of_medians" in o else ""
        print(f"{scenario:14s} overhead ms: baseline {base}  tree {o['tree']['min']:.2f}-{o['tree']['max']:.2f}  {ratio}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
