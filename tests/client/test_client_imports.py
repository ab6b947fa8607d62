"""The client package stays light: importing it never loads torch or the engine.

orca-client and orca-bench run beside a server, often in a process or container without the
engine's dependencies, and a CLI that imports torch pays seconds of start-up for nothing. Each
check runs in a fresh interpreter, since this test process has long imported torch itself.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=120)


def test_importing_every_client_module_loads_neither_torch_nor_the_engine():
    result = _run("""
        import importlib, pkgutil, sys
        import orca_client
        names = [m.name for m in pkgutil.iter_modules(orca_client.__path__, "orca_client.")]
        for name in names:
            importlib.import_module(name)
        print(len(names))
        heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "orca_backend")))
        assert not heavy, f"imported with orca_client: {heavy[:10]}"
    """)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) >= 8  # every module was found (bench, cli, loadgen, protocol, ...)


def test_bench_reads_a_preset_geometry_without_torch():
    # orca-bench needs a model's vocabulary and context to draw prompts: orca_backend.config's
    # presets, which must not drag in the engine (and torch) with them.
    result = _run("""
        import sys
        from orca_client.bench import model_geometry
        geometry = model_geometry("gpt2-tiny")
        assert geometry.vocab_size > 0 and geometry.context_len > 0
        assert "torch" not in sys.modules, "orca_backend.config imported torch"
    """)
    assert result.returncode == 0, result.stderr
