"""The fixtures every kernel test file shares (triton_testing.py holds the helpers)."""

from __future__ import annotations

import pytest
from triton_testing import triton_ops, use_import_mode

from orca_kernels import KernelOps


@pytest.fixture
def ops(monkeypatch: pytest.MonkeyPatch) -> KernelOps:
    """The Triton bundle, in the mode this process imported triton in."""
    return triton_ops(monkeypatch)


@pytest.fixture
def triton_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """TRITON_INTERPRET as triton was imported with, for tests that build their own ops."""
    use_import_mode(monkeypatch)
