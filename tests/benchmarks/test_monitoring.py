"""benchmarks/dashboard_snapshot.py: the shipped dashboard's panels drawn from Prometheus, against a
stand-in Prometheus that answers every range query (the compose profile's structure is checked in
test_compose.py, and that a running server exports every series the dashboard reads in
test_serving.py)."""

from __future__ import annotations

import http.server
import json
import subprocess
import sys
import threading
import urllib.parse
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


class _PrometheusStandIn(http.server.BaseHTTPRequestHandler):
    queries: list[dict[str, str]] = []

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        url = urllib.parse.urlparse(self.path)
        params = dict(urllib.parse.parse_qsl(url.query))
        type(self).queries.append(params)
        start, end = float(params["start"]), float(params["end"])
        values = [[start + i * (end - start) / 4, str(i)] for i in range(5)]
        body = {"status": "success", "data": {"resultType": "matrix", "result": [
            {"metric": {"model": model, "finished_reason": "stop"}, "values": values} for model in ("orca", "baseline")]}}
        data = json.dumps(body).encode() if url.path == "/api/v1/query_range" else b"{}"
        self.send_response(200 if url.path == "/api/v1/query_range" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_the_snapshot_draws_every_panels_query(tmp_path):
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _PrometheusStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    _PrometheusStandIn.queries = []
    out = tmp_path / "dashboard.png"
    try:
        subprocess.run([sys.executable, str(ROOT / "benchmarks" / "dashboard_snapshot.py"), "--prometheus",
                        f"http://127.0.0.1:{server.server_address[1]}", "--minutes", "2", "--rate-interval", "15s",
                        "--out", str(out)], check=True, capture_output=True, timeout=120)  # fmt: skip
    finally:
        server.shutdown()
        server.server_close()
    dashboard = json.loads((ROOT / "monitoring" / "grafana" / "dashboards" / "orca.json").read_text())
    expected = [t["expr"].replace("$__rate_interval", "15s").replace('=~"$model"', '=~".*"')
                for panel in dashboard["panels"] for t in panel["targets"]]  # fmt: skip
    asked = [q["query"] for q in _PrometheusStandIn.queries]
    assert asked == expected and not any("$" in q for q in asked)
    assert all(abs(float(q["end"]) - float(q["start"]) - 120) < 1e-3 for q in _PrometheusStandIn.queries)
    assert out.read_bytes()[:4] == b"\x89PNG"
    raw = json.loads(out.with_suffix(".json").read_text())
    assert len(raw["series"]) == len(expected) and all(len(series) == 2 for series in raw["series"].values())
