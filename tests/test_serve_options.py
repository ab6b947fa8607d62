"""`orca-serve` flags become config.pbtxt overrides: engine-wide ones for every model, the K/V and
chunking knobs for `orca` alone (the baseline stays ORCA-reserved, request-level serving)."""

from __future__ import annotations

import re

from orca_backend.config import EngineConfig
from orca_backend.serve import build_parser, options_from_args, render_config


def test_kv_flags_reach_orca_only():
    args = build_parser().parse_args([
        "--kv-capacity-tokens", "4096", "--kv-policy", "paged", "--block-size", "32", "--enable-prefix-caching",
        "--max-num-batched-tokens", "512",
    ])  # fmt: skip
    options = options_from_args(args)
    assert options.parameters == {"kv_capacity_tokens": "4096"}
    assert options.model_parameters == {"orca": {"kv_policy": "paged", "block_size": "32",
                                                 "enable_prefix_caching": "true", "max_num_batched_tokens": "512"}}


def test_checked_in_orca_config_parses_and_a_rendered_override_takes():
    from orca_backend.serve import default_model_repository

    text = (default_model_repository() / "orca" / "config.pbtxt").read_text()
    rendered = render_config(text, {"kv_policy": "paged", "enable_prefix_caching": "true"}, {})
    block = r'parameters\s*\{\s*key:\s*"(\w+)"\s*value:\s*\{\s*string_value:\s*"([^"]*)"\s*\}\s*\}'
    params = dict(re.findall(block, rendered))
    assert params["kv_policy"] == "paged" and params["block_size"] == "16"
    config = EngineConfig.from_parameters(params)
    assert (config.kv_policy, config.enable_prefix_caching, config.block_size, config.max_num_batched_tokens) == (
        "paged", True, 16, 0)
    assert options_from_args(build_parser().parse_args([])).model_parameters == {}
