"""How the benchmark tests load a script of benchmarks/ (not a package) as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def load_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as the module `orca_bench_<name>` (registered in sys.modules, so its
    dataclasses and pickles resolve)."""
    spec = importlib.util.spec_from_file_location(f"orca_bench_{name}", BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
