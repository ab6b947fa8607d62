"""docker-compose.yml: the GPU deployment's structure (no Docker engine runs here)."""

from __future__ import annotations

import http.server
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orca_backend.entrypoints.serve import build_parser, options_from_args

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


# The `openai` service: Triton's OpenAI-compatible frontend (server repo python/openai) over a run
# copy of the repository holding `orca` alone.

FRONTEND = "/opt/tritonserver/python/openai/openai_frontend/main.py"


def frontend_flag(args: list[str], flag: str) -> str:
    assert args.count(flag) == 1, (flag, args)
    return args[args.index(flag) + 1]


def run_openai_command(compose: dict, tmp_path: Path, **env: str) -> tuple[subprocess.CompletedProcess, Path]:
    """Runs the openai service's shell command with stand-ins for cp, pip and the frontend (which
    prints its arguments); the rendering step runs for real, into tmp_path/render instead of
    /tmp/orca-openai, from the checked-in repository instead of the container's copy in /tmp/orca."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    frontend = f'if [ "$1" = {FRONTEND} ]; then shift; printf "%s\\0" "$@"; exit 0; fi'
    python3 = f'{frontend}\nexec {sys.executable} "$@"'
    for name, body in (("cp", "exit 0"), ("pip", 'printf "%s\\n" "$@" > "$PIP_ARGS"'), ("python3", python3),
                       ("orca-serve", 'printf "%s\\n" "$@" > "$ORCA_SERVE_ARGS"')):  # fmt: skip
        (bin_dir / name).write_text(f"#!/bin/sh\n{body}\n")
        (bin_dir / name).chmod(0o755)
    render = tmp_path / "render"
    service = compose["services"]["openai"]
    argv = [
        interpolate(word, {})
        .replace("/tmp/orca/model_repository", str(ROOT / "model_repository"))
        .replace("/tmp/orca-openai", str(render))
        .replace("/tmp/orca", str(tmp_path / "copy"))  # never the host's /tmp
        for word in service["command"]
    ]
    environment = {key: interpolate(str(value), env) for key, value in service["environment"].items()}
    run_env = {**os.environ, **environment, "PIP_ARGS": str(tmp_path / "pip-args"),
               "ORCA_SERVE_ARGS": str(tmp_path / "orca-serve-args"),
               "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}  # fmt: skip
    return subprocess.run(argv, env=run_env, capture_output=True, timeout=120), render


def test_openai_runs_on_demand_on_an_image_that_ships_the_frontend(compose):
    """A profile keeps `docker compose up -d triton` (and a bare `up`) as it was; the image must be
    new enough: the frontend ships in the image from 24.12, its tokenizer loading works with
    transformers 5 from 26.06."""
    openai = compose["services"]["openai"]
    assert openai["profiles"] == ["openai"]
    match = re.fullmatch(r"nvcr\.io/nvidia/tritonserver:(\d{2})\.(\d{2})-py3", openai["image"])
    assert match and (int(match[1]), int(match[2])) >= (26, 6), openai["image"]
    assert "profiles" not in compose["services"]["triton"], "triton must start by default"


def test_triton_service_is_unchanged_by_the_openai_service(compose):
    triton = compose["services"]["triton"]
    assert triton["image"] == "nvcr.io/nvidia/tritonserver:24.10-py3"
    assert "openai" not in command_text(triton) and "9000" not in " ".join(triton["ports"])
    assert compose["services"]["bench"]["depends_on"] == {"triton": {"condition": "service_healthy"}}
    ports = compose["services"]["triton"]["ports"] + compose["services"]["openai"]["ports"]
    published = [interpolate(p, {}).rsplit(":", 2)[1] for p in ports]
    assert len(published) == len(set(published)), f"the services publish the same host port: {published}"


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the service's bash command")
def test_openai_serves_an_orca_only_repository_through_the_vllm_converter(compose, tmp_path):
    checkpoint = tmp_path / "models" / "my-llama"
    checkpoint.mkdir(parents=True)
    (checkpoint / "tokenizer.json").write_text("{}")
    result, render = run_openai_command(compose, tmp_path, ORCA_MODEL=str(checkpoint))
    assert result.returncode == 0, result.stderr.decode()
    args = result.stdout.decode().split("\0")[:-1]

    assert frontend_flag(args, "--backend") == "vllm"
    assert frontend_flag(args, "--tokenizer") == str(checkpoint)
    assert frontend_flag(args, "--host") == "0.0.0.0"  # the published port is the boundary
    assert frontend_flag(args, "--openai-port") == "9000"
    # Default model control (none): every model of the repository loads, none can be loaded or
    # unloaded by a request; so the repository itself must hold orca alone.
    control = ("--model-control-mode", "--load-model", "--enable-kserve")
    assert not any(arg.startswith(control) for arg in args), args
    repository = Path(frontend_flag(args, "--model-repository"))
    assert repository == render / "model_repository"
    assert sorted(p.name for p in repository.iterdir()) == ["orca"]
    assert not (repository / "orca" / "1" / "model.py").exists()  # the `orca` backend's serves it
    # ... which the command installed into the image's backends directory, where the frontend's
    # in-process tritonserver looks.
    installed = (tmp_path / "orca-serve-args").read_text().split("\n")[:-1]
    assert installed == ["install-backend", "--backends-dir", "/opt/tritonserver/backends"]

    config = (repository / "orca" / "config.pbtxt").read_text()
    params = dict(re.findall(r'key:\s*"([^"]+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"', config))
    assert params["model"] == str(checkpoint.resolve())
    assert (params["device"], params["dtype"]) == ("cuda", "bfloat16")
    assert re.search(r"(?m)^max_batch_size:\s*0\b", config), "the vLLM converter sends no batch dimension"
    assert re.search(r'(?m)^backend:\s*"orca"', config)

    pip_args = (tmp_path / "pip-args").read_text().split("\n")
    assert str(tmp_path / "copy") in pip_args, pip_args  # the container's /tmp/orca
    assert any(arg.startswith("transformers") for arg in pip_args), pip_args


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the service's bash command")
@pytest.mark.parametrize("model", [None, "gpt2-small", "/models/does-not-exist"])
def test_openai_refuses_to_start_without_a_checkpoint_directory(compose, tmp_path, model):
    """Text prompts and chat templates need a tokenizer; a preset has none."""
    env = {} if model is None else {"ORCA_MODEL": model}
    result, render = run_openai_command(compose, tmp_path, **env)
    assert result.returncode != 0 and result.stdout == b"", "the frontend must not start"
    assert "ORCA_MODEL" in result.stderr.decode() and "tokenizer" in result.stderr.decode()
    assert not render.exists()


def test_openai_port_is_published_on_the_hosts_loopback_unless_widened(compose):
    ports = compose["services"]["openai"]["ports"]
    assert [interpolate(p, {}) for p in ports] == ["127.0.0.1:9000:9000"]
    assert [interpolate(p, {"ORCA_PUBLISH_ADDRESS": "0.0.0.0"}) for p in ports] == ["0.0.0.0:9000:9000"]


def test_openai_runs_like_triton_on_the_gpus(compose):
    openai, triton = compose["services"]["openai"], compose["services"]["triton"]
    assert openai["deploy"] == triton["deploy"]
    assert openai["shm_size"] and openai["ulimits"] == triton["ulimits"]
    assert openai["restart"] == "unless-stopped"
    assert [v.split(":")[:2] for v in openai["volumes"]] == [v.split(":")[:2] for v in triton["volumes"]]
    assert compose["x-orca-env"].items() <= openai["environment"].items()


class _OpenAIStandIn(http.server.BaseHTTPRequestHandler):
    models = ["orca"]
    failing: set[str] = set()
    completions: list[dict] = []

    def _reply(self, body: dict | None = None) -> None:
        status = 400 if self.path in self.failing else 200
        payload = json.dumps(body or {}).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_GET(self) -> None:  # noqa: N802 - http.server's naming
        self._reply({"object": "list", "data": [{"id": m, "object": "model"} for m in self.models]})

    def do_POST(self) -> None:  # noqa: N802
        length = int(self.headers["Content-Length"])
        _OpenAIStandIn.completions.append(json.loads(self.rfile.read(length)))
        self._reply({"choices": [{"text": "!"}]})

    def log_message(self, *args: object) -> None:
        pass


def test_openai_healthcheck_needs_a_ready_server_orca_alone_and_a_generated_token(compose):
    health = compose["services"]["openai"]["healthcheck"]
    command = health["test"]
    assert command[:3] == ["CMD", "python3", "-c"] and "localhost:9000" in command[3]
    assert health.get("start_period"), "pip install and model loading need a start period"
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OpenAIStandIn)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    code = command[3].replace("localhost:9000", f"127.0.0.1:{server.server_address[1]}")
    try:
        for models, failing, healthy in (
            (["orca"], set(), True),
            (["orca"], {"/health/ready"}, False),
            (["orca"], {"/v1/completions"}, False),  # orca's engine died: it answers UNAVAILABLE
            (["orca", "baseline"], set(), False),
            ([], set(), False),
        ):
            _OpenAIStandIn.models, _OpenAIStandIn.failing, _OpenAIStandIn.completions = models, failing, []
            result = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
            assert (result.returncode == 0) == healthy, (models, failing, result.stderr.decode())
            if healthy:
                assert _OpenAIStandIn.completions == [{"model": "orca", "prompt": "ping", "max_tokens": 1}]
    finally:
        server.shutdown()
        server.server_close()


# ---- the monitoring profile ---------------------------------------------------------------------
def _mounts(service: dict) -> dict[str, str]:
    """Container path -> host path (relative to the repository) of a service's bind mounts."""
    mounts = {}
    for volume in service.get("volumes", []):
        host, container, *_ = volume.split(":")
        if host.startswith("./"):
            mounts[container] = host[2:]
    return mounts


def test_prometheus_and_grafana_run_only_in_the_monitoring_profile_on_loopback(compose):
    services = compose["services"]
    for name, port in (("prometheus", 9090), ("grafana", 3000)):
        service = services[name]
        assert service["profiles"] == ["monitoring"], name
        assert re.fullmatch(r"[\w./-]+:v?\d+(\.\d+)+", service["image"]), f"{name}: pin the image, got {service['image']}"
        assert service["ports"] == [f"${{ORCA_PUBLISH_ADDRESS:-127.0.0.1}}:{port}:{port}"]
    assert "profiles" not in services["triton"]  # `docker compose up -d triton` is unchanged


def test_prometheus_scrapes_tritons_metrics_port(compose):
    prometheus = compose["services"]["prometheus"]
    config = yaml.safe_load((ROOT / _mounts(prometheus)["/etc/prometheus/prometheus.yml"]).read_text())
    targets = [t for job in config["scrape_configs"] for group in job["static_configs"] for t in group["targets"]]
    assert targets == ["triton:8002"]
    published = {entry.rsplit(":", 1)[1] for entry in compose["services"]["triton"]["ports"]}
    assert "8002" in published  # the metrics port
    assert "triton" in prometheus["depends_on"]


def test_grafana_provisions_the_dashboard_on_the_prometheus_data_source(compose):
    grafana = compose["services"]["grafana"]
    mounts = _mounts(grafana)
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "orca.yml").read_text())["providers"]
    dashboards = ROOT / mounts[provider["options"]["path"]]
    dashboard = json.loads((dashboards / "orca.json").read_text())
    assert grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{provider['options']['path']}/orca.json"
    targets = [t for panel in dashboard["panels"] for t in panel["targets"]]
    assert targets and all(t["datasource"]["uid"] == source["uid"] for t in targets)
    assert all(panel["datasource"]["uid"] == source["uid"] for panel in dashboard["panels"])
    # Read-only: anonymous viewers, and no login form to guess a password at.
    assert grafana["environment"]["GF_AUTH_ANONYMOUS_ORG_ROLE"] == "Viewer"
    assert grafana["environment"]["GF_AUTH_DISABLE_LOGIN_FORM"] == "true"


# The `ray` profile: a Ray head running tritonserver and Ray workers on other hosts.
def run_service_command(compose: dict, name: str, tmp_path: Path, **env: str) -> dict[str, list[str]]:
    """Runs a service's shell command with stand-ins for cp, pip, ray and orca-serve, each recording
    its arguments; returns {program: arguments} of the last call of each."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for program in ("cp", "pip", "ray", "orca-serve"):
        (bin_dir / program).write_text(f'#!/bin/sh\nprintf "%s\\0" "$@" > "{tmp_path}/{program}.args"\n')
        (bin_dir / program).chmod(0o755)
    if not (bin_dir / "python3").exists():
        (bin_dir / "python3").symlink_to(sys.executable)
    service = compose["services"][name]
    argv = [interpolate(word, {}) for word in service["command"]]
    environment = {key: interpolate(str(value), env) for key, value in service["environment"].items() if key != "<<"}
    run_env = {**os.environ, **environment, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    subprocess.run(argv, env=run_env, capture_output=True, check=True, timeout=60)
    return {p: (tmp_path / f"{p}.args").read_text().split("\0")[:-1] for p in ("pip", "ray", "orca-serve")
            if (tmp_path / f"{p}.args").exists()}  # fmt: skip


def test_ray_profile_is_opt_in_on_host_networking(compose):
    for name in ("ray-head", "ray-worker"):
        service = compose["services"][name]
        assert service["profiles"] == ["ray"] and service["network_mode"] == "host", name
        assert "ports" not in service  # host networking publishes nothing: Triton binds ORCA_PUBLISH_ADDRESS
    assert "profiles" not in compose["services"]["triton"]


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the service's bash command")
def test_ray_head_starts_the_cluster_and_serves_orca_over_it(compose, tmp_path):
    calls = run_service_command(compose, "ray-head", tmp_path, ORCA_TP="2", ORCA_PP="2", ORCA_MODEL="/models/m")
    assert calls["pip"][-1] == "/tmp/orca[ray]"
    assert calls["ray"][:3] == ["start", "--head", "--port"] and "6379" in calls["ray"]
    options = options_from_args(build_parser().parse_args(calls["orca-serve"]))
    assert options.models == ("orca",) and options.host == "127.0.0.1"
    p = options.parameters
    assert (p["distributed_executor_backend"], p["ray_address"]) == ("ray", "auto")
    assert (p["tensor_parallel_size"], p["pipeline_parallel_size"], p["model"]) == ("2", "2", "/models/m")


@pytest.mark.skipif(shutil.which("bash") is None, reason="runs the service's bash command")
def test_ray_worker_joins_the_heads_cluster(compose, tmp_path):
    calls = run_service_command(compose, "ray-worker", tmp_path, ORCA_RAY_HEAD="10.0.0.5:6379")
    assert calls["ray"] == ["start", "--address", "10.0.0.5:6379", "--block", "--disable-usage-stats"]
    assert calls["pip"][-1] == "/tmp/orca[ray]"
