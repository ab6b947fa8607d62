"""docker-compose.yml: the GPU deployment's structure (no Docker engine runs here)."""

from __future__ import annotations

import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orca_backend.serve import build_parser, options_from_args

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def command_text(service: dict) -> str:
    command = service["command"]
    return command if isinstance(command, str) else " ".join(command)


def interpolate(text: str, env: dict[str, str]) -> str:
    """Compose's variable substitution for what this file uses: ${VAR:-default}, ${VAR} and $$."""
    def substitute(match: re.Match[str]) -> str:
        name, default = match.group(1), match.group(3) or ""
        return env.get(name) or default

    text = re.sub(r"(?<!\$)\$\{(\w+)(:-([^}]*))?\}", substitute, text)
    return text.replace("$$", "$")


def run_triton_command(compose: dict, tmp_path: Path, **env: str) -> list[str]:
    """Runs the triton service's shell command with stand-ins for cp, pip and orca-serve (which
    prints its arguments); returns the arguments orca-serve got."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, body in (("cp", "exit 0"), ("pip", "exit 0"), ("orca-serve", 'printf "%s\\0" "$@"')):
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    if not (bin_dir / "python3").exists():
        (bin_dir / "python3").symlink_to(sys.executable)  # the image has python3; here the venv's
    triton = compose["services"]["triton"]
    argv = [interpolate(word, {}) for word in triton["command"]]
    environment = {key: interpolate(str(value), env) for key, value in triton["environment"].items() if key != "<<"}
    run_env = {**os.environ, **environment, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(argv, env=run_env, capture_output=True, check=True, timeout=60).stdout
    return out.decode().split("\0")[:-1]


def test_triton_runs_a_pinned_ngc_tritonserver_image(compose):
    image = compose["services"]["triton"]["image"]
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3", image), image


def test_triton_installs_this_package_and_serves_the_repository_inside_the_container(compose):
    triton = compose["services"]["triton"]
    text = command_text(triton)
    assert "pip install" in text and "orca-serve" in text
    words = shlex.split(text.split("orca-serve", 1)[1].replace("$$", "$"))
    assert words[words.index("--host") + 1] == "0.0.0.0"
    assert words[words.index("--device") + 1] == "cuda"
    repository = words[words.index("--model-repository") + 1]
    assert repository.endswith("model_repository")
    mounts = [v.split(":") for v in triton["volumes"]]
    assert any(src == "." for src, *_ in mounts), "the repository must be mounted into the container"
    assert triton.get("shm_size"), "the Python backend needs more than Docker's 64 MB of shared memory"


def test_triton_ports_are_published_on_the_hosts_loopback_unless_widened(compose):
    ports = compose["services"]["triton"]["ports"]
    assert [interpolate(p, {}) for p in ports] == ["127.0.0.1:8000:8000", "127.0.0.1:8001:8001", "127.0.0.1:8002:8002"]
    widened = [interpolate(p, {"ORCA_PUBLISH_ADDRESS": "0.0.0.0"}) for p in ports]
    assert widened == ["0.0.0.0:8000:8000", "0.0.0.0:8001:8001", "0.0.0.0:8002:8002"]


def test_triton_exits_on_model_failure_and_is_restarted(compose):
    """A model whose engine died unloads itself; orca-serve exits then, and compose restarts it
    (compose never restarts a container for being unhealthy)."""
    triton = compose["services"]["triton"]
    assert triton["restart"] == "unless-stopped"
    assert "--exit-on-model-failure" in shlex.split(command_text(triton).split("exec orca-serve", 1)[1])
    assert not build_parser().parse_args([]).exit_on_model_failure  # off unless asked for


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the service's bash command")
def test_triton_restricts_the_model_repository_api_to_an_admin_key(compose, tmp_path):
    """Without ORCA_ADMIN_KEY the key is random (nobody can load or unload models over the network);
    with it, that key. The run reaches orca-serve with --exit-on-model-failure either way."""

    def restrictions(**env: str) -> tuple[str, ...]:
        args = build_parser().parse_args(run_triton_command(compose, tmp_path, **env))
        assert args.exit_on_model_failure and args.host == "0.0.0.0" and args.device == "cuda"
        return options_from_args(args).extra_args

    def keys(extra_args: tuple[str, ...]) -> set[str]:
        wanted = {"--http-restricted-api", "--grpc-restricted-protocol"}
        found = {}
        for arg in extra_args:
            flag, _, value = arg.partition("=")
            groups, _, header = value.partition(":")
            if flag in wanted:
                assert groups.split(",") == ["model-repository"], arg
                name, _, key = header.partition("=")
                assert name == "admin-key", arg
                found[flag] = key
        assert set(found) == wanted, extra_args
        return set(found.values())

    first, second = keys(restrictions()), keys(restrictions())
    assert len(first) == 1 and re.fullmatch(r"[0-9a-f]{64}", next(iter(first))), first
    assert first != second, "an unset key must be random, not a default anyone knows"
    assert keys(restrictions(ORCA_ADMIN_KEY="s3cret-key")) == {"s3cret-key"}


def test_triton_reserves_every_gpu(compose):
    devices = compose["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and d.get("count") == "all" and "gpu" in d.get("capabilities", [])
               for d in devices)


def test_triton_healthcheck_asks_for_readiness(compose):
    health = compose["services"]["triton"]["healthcheck"]
    test = health["test"] if isinstance(health["test"], str) else " ".join(health["test"])
    for path in ("/v2/health/ready", "/v2/models/orca/ready", "/v2/models/baseline/ready"):
        assert path in test
    assert "localhost:8000" in test
    assert health.get("start_period"), "model loading needs a start period"


class _Readiness(http.server.BaseHTTPRequestHandler):
    unready: set[str] = set()

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self.send_response(400 if self.path in self.unready else 200)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def test_triton_healthcheck_fails_when_one_model_is_not_ready(compose):
    """Runs the healthcheck's Python against a stand-in server: Triton's /v2/health/ready stays 200
    after a model unloaded itself, so only the per-model paths can tell."""
    command = compose["services"]["triton"]["healthcheck"]["test"]
    assert command[:3] == ["CMD", "python3", "-c"]
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Readiness)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = command[3].replace("localhost:8000", f"127.0.0.1:{server.server_address[1]}")
    try:
        for unready, healthy in ((set(), True), ({"/v2/models/baseline/ready"}, False),
                                 ({"/v2/models/orca/ready"}, False)):  # fmt: skip
            _Readiness.unready = unready
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
            assert (result.returncode == 0) == healthy, (unready, result.stderr.decode())
    finally:
        server.shutdown()
        server.server_close()


def test_bench_service_runs_orca_bench_against_triton(compose):
    bench = compose["services"]["bench"]
    text = command_text(bench)
    assert "orca-bench" in text and "triton:8001" in text
    assert bench["depends_on"]["triton"]["condition"] == "service_healthy"


def test_compose_console_scripts_exist():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for script in ("orca-serve", "orca-bench"):
        assert re.search(rf'^{script}\s*=', pyproject, re.M), script
