"""Shared fixtures: tiny random GPT-2 checkpoints written to disk in the HF format."""

from __future__ import annotations

from pathlib import Path

import pytest

from orca_backend.engine.llm_engine import RequestStream
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.model.checkpoint import write_random_checkpoint

# An event that never comes fails its test with the request named, well inside pytest's 15-minute
# timeout, instead of hanging the run (a regression that loses a final event, say).
RequestStream.wait_timeout_s = 120.0

# initializer_range 0.3: random weights with the default 0.02 repeat one token forever, which would
# let a broken attention pass token-equality tests (see docs/architecture.md, Testing).
TINY = GPT2Config(vocab_size=384, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)


@pytest.fixture(scope="session")
def make_checkpoint(tmp_path_factory):
    """Returns a function writing (once per geometry) a checkpoint dir; yields (path, GPT2Config)."""
    cache: dict[tuple, tuple[Path, GPT2Config]] = {}

    def make(config: GPT2Config = TINY, seed: int = 0, tokenizer: bool = True) -> tuple[Path, GPT2Config]:
        key = (config, seed, tokenizer)
        if key not in cache:
            path = tmp_path_factory.mktemp("ckpt")
            cache[key] = (path, write_random_checkpoint(path, config, seed=seed, tokenizer=tokenizer))
        return cache[key]

    return make


@pytest.fixture(scope="session")
def tiny_checkpoint(make_checkpoint) -> tuple[Path, GPT2Config]:
    return make_checkpoint()
