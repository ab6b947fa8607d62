"""The shipped Grafana dashboard (monitoring/grafana/dashboards/orca.json) drawn with matplotlib from
a Prometheus server: every panel's own PromQL, evaluated by Prometheus over a time window, laid out
as the dashboard lays it out. For a picture of the dashboard where Grafana cannot run (this
project's CI machine), and as a check that the panels' queries work.

    python benchmarks/dashboard_snapshot.py --prometheus http://127.0.0.1:9090 --minutes 6 \\
        --out docs/monitoring/dashboard.png

Writes the PNG and, beside it, the query results as JSON (the raw data of every curve).
`$model` selects every model; `$__rate_interval` becomes --rate-interval.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "monitoring" / "grafana" / "dashboards" / "orca.json"
_UNIT_SCALE = {"s": (1e3, "ms"), "percentunit": (100.0, "%"), "short": (1.0, "")}


def query_range(prometheus: str, expr: str, start: float, end: float, step_s: float) -> list[dict]:
    params = urllib.parse.urlencode({"query": expr, "start": start, "end": end, "step": step_s})
    with urllib.request.urlopen(f"{prometheus}/api/v1/query_range?{params}", timeout=30) as response:
        body = json.load(response)
    if body.get("status") != "success":
        raise RuntimeError(f"Prometheus refused {expr!r}: {body}")
    return body["data"]["result"]


def legend(template: str, labels: dict[str, str]) -> str:
    for key, value in labels.items():
        template = template.replace("{{" + key + "}}", value)
    return template


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prometheus", default="http://127.0.0.1:9090")
    ap.add_argument("--minutes", type=float, default=10.0, help="the window: the last this many minutes")
    ap.add_argument("--step", type=float, default=5.0, help="seconds between evaluated points")
    ap.add_argument("--rate-interval", default="30s", help="what $__rate_interval stands for")
    ap.add_argument("--out", default="dashboard.png")
    args = ap.parse_args()

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dashboard = json.loads(DASHBOARD.read_text())
    end = time.time()
    start = end - 60 * args.minutes
    panels = dashboard["panels"]
    rows = max(p["gridPos"]["y"] + p["gridPos"]["h"] for p in panels)
    fig = plt.figure(figsize=(16, rows / 2.6), dpi=110)
    grid = fig.add_gridspec(rows, 24, hspace=0.9, wspace=0.6, top=0.95, bottom=0.03)
    raw: dict[str, list] = {}
    for panel in panels:
        pos = panel["gridPos"]
        ax = fig.add_subplot(grid[pos["y"] : pos["y"] + pos["h"] - 1, pos["x"] : pos["x"] + pos["w"]])
        scale, unit = _UNIT_SCALE.get(panel["fieldConfig"]["defaults"]["unit"], (1.0, ""))
        for target in panel["targets"]:
            expr = target["expr"].replace("$__rate_interval", args.rate_interval).replace('=~"$model"', '=~".*"')
            series = query_range(args.prometheus, expr, start, end, args.step)
            raw[f"{panel['title']} / {target['legendFormat']}"] = [{"expr": expr, **s} for s in series]
            for s in series:
                points = [(float(t) - start, float(v)) for t, v in s["values"] if v not in ("NaN", "+Inf", "-Inf")]
                if points:
                    xs, ys = zip(*points, strict=True)
                    ax.plot([x / 60 for x in xs], [y * scale for y in ys], label=legend(target["legendFormat"], s["metric"]))
        ax.set_title(panel["title"], fontsize=10, loc="left")
        ax.set_ylabel(unit, fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend(fontsize=6, loc="upper left", ncol=2)
    fig.suptitle(f"{dashboard['title']} (Prometheus data, drawn with matplotlib; minutes since the window's start)",
                 fontsize=11, y=0.985)  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, bbox_inches="tight")
    out.with_suffix(".json").write_text(json.dumps({"command": " ".join(sys.argv), "start": start,
                                                    "end": end, "series": raw}, indent=1))  # fmt: skip
    print(f"wrote {out} and {out.with_suffix('.json')}")


if __name__ == "__main__":
    main()
