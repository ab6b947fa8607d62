"""benchmarks/norm_linear_configs.py (the fused norm + GEMM tiling sweep) on CPU, as CI runs it: every
tiling of --quick through Triton's interpreter, the files written, and the tiling the kernel chooses
among those timed. The figures are whatever this machine measures, so only their structure is checked."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_sweep_times_every_tiling_and_marks_the_chosen_one(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "norm_linear_configs.py"), "--device", "cpu",
                           "--quick", "--reps", "2", "--out", str(tmp_path)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "norm_linear_configs.json").read_text())
    points = summary["points"]
    assert points and all("us" in p and p["us"] > 0 for p in points), [p for p in points if "us" not in p]
    for name in {p["name"] for p in points}:
        for rows in {p["rows"] for p in points}:
            mine = [p for p in points if p["name"] == name and p["rows"] == rows]
            assert sum(p["chosen"] for p in mine) == 1 and len(mine) >= 2
            assert summary["torch_linear_us"][f"{name}/{rows}"] > 0 and summary["unfused_us"][f"{name}/{rows}"] > 0
    # The odd-vocabulary LM head, as stored and padded to 64 rows.
    heads = summary["lm_head_as_stored_and_padded_us"]
    assert set(heads) == {f"tiny lm_head/{rows}" for rows in {p["rows"] for p in points}}
    assert all(len(us) == 2 and min(us) > 0 for us in heads.values())
    table = (tmp_path / "norm_linear_configs.md").read_text()
    assert table.count("| tiny ") == len({(p["name"], p["rows"]) for p in points}) + len(heads)
