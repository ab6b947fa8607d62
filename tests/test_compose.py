"""docker-compose.yml: the GPU deployment's structure (no Docker engine runs here)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

yaml = pytest.importorskip("yaml")

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "docker-compose.yml").read_text())


def command_text(service: dict) -> str:
    command = service["command"]
    return command if isinstance(command, str) else " ".join(command)


def test_triton_runs_a_pinned_ngc_tritonserver_image(compose):
    image = compose["services"]["triton"]["image"]
    assert re.fullmatch(r"nvcr\.io/nvidia/tritonserver:\d{2}\.\d{2}-py3", image), image


def test_triton_installs_this_package_and_serves_the_repository_on_all_interfaces(compose):
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
    assert {"8000:8000", "8001:8001", "8002:8002"} <= set(triton["ports"])
    assert triton.get("shm_size"), "the Python backend needs more than Docker's 64 MB of shared memory"


def test_triton_reserves_every_gpu(compose):
    devices = compose["services"]["triton"]["deploy"]["resources"]["reservations"]["devices"]
    assert any(d.get("driver") == "nvidia" and d.get("count") == "all" and "gpu" in d.get("capabilities", [])
               for d in devices)


def test_triton_healthcheck_asks_for_readiness(compose):
    health = compose["services"]["triton"]["healthcheck"]
    test = health["test"] if isinstance(health["test"], str) else " ".join(health["test"])
    assert "/v2/health/ready" in test and "8000" in test
    assert health.get("start_period"), "model loading needs a start period"


def test_bench_service_runs_orca_bench_against_triton(compose):
    bench = compose["services"]["bench"]
    text = command_text(bench)
    assert "orca-bench" in text and "triton:8001" in text
    assert bench["depends_on"]["triton"]["condition"] == "service_healthy"


def test_compose_console_scripts_exist():
    pyproject = (ROOT / "pyproject.toml").read_text()
    for script in ("orca-serve", "orca-bench"):
        assert re.search(rf'^{script}\s*=', pyproject, re.M), script
