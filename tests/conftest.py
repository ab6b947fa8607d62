"""Shared fixtures (tiny random GPT-2 checkpoints written to disk in the HF format) and how the
suite shares the machine when pytest-xdist runs it on several workers (`make test`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="session")
def tiny_hf_float64(tiny_checkpoint) -> torch.nn.Module:
    """transformers' GPT-2 of `tiny_checkpoint` in float64: the oracle of the sampling and logprobs
    tests, which process its logits themselves."""
    import transformers

    return transformers.GPT2LMHeadModel.from_pretrained(tiny_checkpoint[0]).double().eval()


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity, capped by a cgroup v2 CPU quota (a container's
    `--cpus`), which neither os.cpu_count() nor psutil's core count sees."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            cpus = min(cpus, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return cpus


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """`-n auto` (`make test`): a worker per usable CPU (xdist's own count is psutil's physical
    cores, which is 1 on a 2-vCPU machine whose vCPUs are one core's two threads)."""
    return usable_cpus()


# Under pytest-xdist each worker takes its share of the cores: torch's OpenMP threads spin while they
# wait, so two workers with a thread per core each would spend the machine spinning. The children a
# test starts (engine core, tp/pp workers, tritonserver's stubs) inherit the same share through
# OMP_NUM_THREADS. The CPU kernels' own tests set their thread counts explicitly (torch_threads.py).
if "PYTEST_XDIST_WORKER_COUNT" in os.environ:
    _share = max(1, usable_cpus() // int(os.environ["PYTEST_XDIST_WORKER_COUNT"]))
    os.environ["OMP_NUM_THREADS"] = str(_share)
    torch.set_num_threads(_share)


@pytest.fixture(autouse=True)
def _fail_if_a_tritonserver_died(request):
    """A test whose tritonserver (a fixture of its module) exited under it fails at teardown with the
    exit status and the server's last log lines: otherwise every later test of the module reports only
    "connection refused", and the log, printed when the module ends, may be cut from the report."""
    yield
    serve = sys.modules.get("orca_backend.entrypoints.serve")  # not imported: no server to check
    if serve is None:
        return
    for name, value in request.node.funcargs.items():
        process = getattr(value, "process", None) if isinstance(value, serve.TritonServer) else None
        if process is not None and process.poll() is not None:
            code = process.returncode
            how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
            tail = "\n".join(line for line in value.log_tail(8000).splitlines() if not line.startswith(("|", "+")))
            pytest.fail(f"the tritonserver of fixture {name!r} {how} during this test; its log ends:\n{tail}",
                        pytrace=False)
