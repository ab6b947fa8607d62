"""`orca-serve` flags become config.pbtxt overrides: engine-wide ones for every model, the K/V and
chunking knobs for `orca` alone (the baseline stays ORCA-reserved, request-level serving)."""

from __future__ import annotations

import re

import pytest

from orca_backend.config import EngineConfig
from orca_backend.entrypoints.serve import build_parser, options_from_args, render_config


def test_kv_flags_reach_orca_only():
    args = build_parser().parse_args([
        "--kv-capacity-tokens", "4096", "--kv-policy", "paged", "--block-size", "32", "--enable-prefix-caching",
        "--max-num-batched-tokens", "512",
    ])  # fmt: skip
    options = options_from_args(args)
    assert options.parameters == {"kv_capacity_tokens": "4096"}
    assert options.model_parameters == {"orca": {"kv_policy": "paged", "block_size": "32",
                                                 "enable_prefix_caching": "true", "max_num_batched_tokens": "512"}}


@pytest.mark.parametrize(("flag", "value"), [("--async-scheduling", "true"), ("--no-async-scheduling", "false")])
def test_async_scheduling_is_set_either_way_for_orca_and_left_unset_without_a_flag(flag, value):
    options = options_from_args(build_parser().parse_args([flag]))
    assert options.model_parameters == {"orca": {"async_scheduling": value}}
    assert EngineConfig.from_parameters(options.model_parameters["orca"]).async_scheduling is (value == "true")
    assert options_from_args(build_parser().parse_args([])).model_parameters == {}


def test_checked_in_orca_config_parses_and_a_rendered_override_takes():
    from orca_backend.entrypoints.serve import default_model_repository

    text = (default_model_repository() / "orca" / "config.pbtxt").read_text()
    rendered = render_config(text, {"kv_policy": "paged", "enable_prefix_caching": "true"}, {})
    block = r'parameters\s*\{\s*key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}'
    params = dict(re.findall(block, rendered))
    assert params["kv_policy"] == "paged" and params["block_size"] == "16"
    config = EngineConfig.from_parameters(params)
    assert (config.kv_policy, config.enable_prefix_caching, config.block_size, config.max_num_batched_tokens) == (
        "paged", True, 16, 0)
    assert options_from_args(build_parser().parse_args([])).model_parameters == {}


def test_triton_args_pass_through_to_the_command_line(tmp_path):
    from pathlib import Path

    from orca_backend.entrypoints.serve import TritonBinary, TritonServer

    restricted = "--http-restricted-api=model-repository:admin-key=k"
    args = build_parser().parse_args([f"--triton-arg={restricted}", "--triton-arg=--log-info=false"])
    options = options_from_args(args)
    assert options.extra_args == (restricted, "--log-info=false")
    options.run_dir = tmp_path
    command = TritonServer(options).command(TritonBinary(Path("/opt/tritonserver/bin/tritonserver")), tmp_path)
    assert command[-2:] == [restricted, "--log-info=false"]
    assert "--model-control-mode=explicit" in command  # models can still unload themselves
    assert options_from_args(build_parser().parse_args([])).extra_args == ()


def test_the_model_repository_api_is_closed_unless_a_key_is_given(tmp_path, monkeypatch):
    """Triton's load API can carry model code: orca-serve restricts it to a key by default, a random
    one nobody is told, over HTTP and gRPC alike (test_serving.py checks a live server refuses)."""
    from pathlib import Path

    from orca_backend.entrypoints.serve import ServerOptions, TritonBinary, TritonServer

    binary = TritonBinary(Path("/opt/tritonserver/bin/tritonserver"))

    def keys(command: list[str]) -> dict[str, str]:
        return {arg.split("=", 1)[0]: arg.rsplit("admin-key=", 1)[1] for arg in command if "restricted" in arg}

    first, second = (keys(TritonServer(ServerOptions(run_dir=tmp_path)).command(binary, tmp_path)) for _ in range(2))
    assert set(first) == {"--http-restricted-api", "--grpc-restricted-protocol"}
    assert len(set(first.values())) == 1 and re.fullmatch("[0-9a-f]{64}", first["--http-restricted-api"])
    assert first != second  # random per server
    given = TritonServer(ServerOptions(run_dir=tmp_path, admin_key="k-1")).command(binary, tmp_path)
    assert set(keys(given).values()) == {"k-1"}
    monkeypatch.setenv("ORCA_ADMIN_KEY", "from_env")
    assert options_from_args(build_parser().parse_args([])).admin_key == "from_env"
    with pytest.raises(ValueError, match="letters, digits"):
        TritonServer(ServerOptions(admin_key="a key; rm -rf"))


def test_model_failure_monitor_confirms_a_failure_on_a_second_poll(tmp_path):
    """A model counts as failed when its readiness answers non-200 twice in a row; no answer at all
    (a busy or stopping server) is no verdict."""
    from orca_backend.entrypoints.serve import ModelFailureMonitor, ServerOptions, TritonServer

    server = TritonServer(ServerOptions(run_dir=tmp_path))
    statuses = {"/v2/models/orca/ready": 200, "/v2/models/baseline/ready": 200}
    server._get = statuses.__getitem__  # type: ignore[method-assign]
    monitor = ModelFailureMonitor(server, interval_s=0.0)
    assert monitor.poll() == []
    statuses["/v2/models/baseline/ready"] = 0  # timed out: not a failure
    assert monitor.poll() == [] and monitor.poll() == []
    statuses["/v2/models/orca/ready"] = 400
    assert monitor.poll() == []  # suspected
    statuses["/v2/models/orca/ready"] = 200
    assert monitor.poll() == []  # and cleared
    statuses["/v2/models/orca/ready"] = 400
    assert monitor.poll() == []
    assert monitor.poll() == ["orca"]


def test_exit_on_model_failure_is_off_by_default_and_documents_its_code():
    from orca_backend.entrypoints.serve import EXIT_MODEL_FAILED

    parser = build_parser()
    assert parser.parse_args([]).exit_on_model_failure is False
    assert parser.parse_args(["--exit-on-model-failure"]).exit_on_model_failure is True
    help_text = " ".join(parser.format_help().split())
    assert f"exit with code {EXIT_MODEL_FAILED}" in help_text and EXIT_MODEL_FAILED not in (0, 1)


def test_instances_set_orcas_instance_count_only(tmp_path):
    from orca_backend.entrypoints.serve import TritonServer, with_instance_count

    options = options_from_args(build_parser().parse_args(["--instances", "4"]))
    assert options.instances == 4
    options.run_dir = tmp_path
    repository = TritonServer(options).render_repository()
    groups = {name: re.findall(r"instance_group\s*\[[^\]]*\]", (repository / name / "config.pbtxt").read_text())
              for name in ("orca", "baseline")}  # fmt: skip
    assert groups["orca"] == ["instance_group [ { count: 4, kind: KIND_CPU } ]"]
    assert groups["baseline"] == ["instance_group [ { count: 1, kind: KIND_CPU } ]"]  # it refuses more
    assert with_instance_count("instance_group [ { kind: KIND_MODEL, count: 1 } ]", 2) == (
        "instance_group [ { kind: KIND_MODEL, count: 2 } ]")
    with pytest.raises(ValueError, match="one instance_group"):
        with_instance_count("name: 'x'", 2)
    with pytest.raises(ValueError, match=">= 1"):
        with_instance_count(groups["orca"][0], 0)
