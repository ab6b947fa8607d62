"""The CPU kernels and the transformers oracles under each of torch's x86 CPU builds, whichever
machine runs the suite.

torch picks the vector width of its CPU kernels by the CPU (AVX512 on Intel Xeons and AMD Zen 4,
AVX2 on older EPYCs) and `ATEN_CPU_CAPABILITY` forces a narrower one. The C kernels that
reproduce torch's rounding probe the width per kernel (orca_kernels.native.probe_torch_order):
this runs their tests and the exact-token oracles again in a fresh process under each capability
other than the machine's own, so both widths are checked on whichever machine CI gets (under AVX2
the C decode GEMM runs its AVX2 path too, `ORCA_CPU_ISA=avx2`: the whole of an AVX2 machine); DEFAULT
(torch's unvectorised build) checks that an op whose order matches nowhere keeps its reference and
the tokens stay transformers'.
"""

from __future__ import annotations

import os
import platform
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
NATIVE = torch.backends.cpu.get_cpu_capability()
# The kernels' own tests and the greedy-token and logits oracles against transformers on tiny
# checkpoints (GPT-2 and the Llama family), about 10 s a capability.
SUITE = [
    "tests/kernels/test_cpu_llama_ops.py",
    "tests/kernels/test_cpu_gpt2_ops.py",
    "tests/kernels/test_cpu_attention.py",
    "tests/model/test_exactness.py",
    "tests/model/test_llama.py::test_greedy_tokens_equal_transformers_in_a_mixed_batch",
    "tests/model/test_llama.py::test_last_token_logits_match_transformers",
]


@pytest.mark.slow  # two reruns of the CPU kernels' and oracles' tests: `make test` runs them, not test-fast
@pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64"), reason="x86 capabilities")
@pytest.mark.parametrize("capability", [c for c in ("AVX2", "DEFAULT") if c != NATIVE])
def test_kernels_and_oracles_under_a_forced_capability(capability: str) -> None:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability.lower()}
    if capability == "AVX2":
        env["ORCA_CPU_ISA"] = "avx2"
    probe = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.backends.cpu.get_cpu_capability())"],
        env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    assert probe.stdout.strip() == capability  # torch honoured the override
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SUITE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert result.returncode == 0, (
        f"under ATEN_CPU_CAPABILITY={capability}:\n{result.stdout[-6000:]}{result.stderr[-2000:]}"
    )
