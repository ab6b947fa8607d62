"""The environment the engine's child processes start with (orca_backend/processes.py): torch's CPU
buffers on transparent huge pages unless the user chose otherwise."""

from __future__ import annotations

import os

import pytest
from core_hooks import RequireEnv

from orca_backend.config import EngineConfig
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.processes import HUGE_PAGES_ENV, child_env_vars, child_environment, huge_pages_description


def test_children_start_with_huge_pages_and_the_parent_is_left_as_it_was(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    with child_environment():
        assert os.environ[HUGE_PAGES_ENV] == "1"
        assert child_env_vars() == {HUGE_PAGES_ENV: "1"}
    assert HUGE_PAGES_ENV not in os.environ
    assert child_env_vars() == {HUGE_PAGES_ENV: "1"}  # what a Ray actor is given


@pytest.mark.parametrize("value", ["0", "1"])
def test_a_users_own_setting_is_kept(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv(HUGE_PAGES_ENV, value)
    with child_environment():
        assert os.environ[HUGE_PAGES_ENV] == value
    assert os.environ[HUGE_PAGES_ENV] == value
    assert child_env_vars() == {HUGE_PAGES_ENV: value}
    assert f"{HUGE_PAGES_ENV}={value}" in huge_pages_description()
    if value == "0":
        assert "huge pages for torch's CPU buffers of 2 MB and more: off" in huge_pages_description()


def test_the_core_process_runs_with_huge_pages(tiny_checkpoint, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(HUGE_PAGES_ENV, raising=False)
    engine = LLMEngine.launch(EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=2),
                              core_hook=RequireEnv(HUGE_PAGES_ENV, "1"))  # fmt: skip
    try:
        assert engine.healthy
        assert HUGE_PAGES_ENV not in os.environ
    finally:
        engine.shutdown()
