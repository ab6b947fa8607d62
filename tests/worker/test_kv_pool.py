"""The K/V pool sized from memory (worker/kv_pool.py, gpu_memory_utilization): the arithmetic with
measured figures injected, the profile step run on a CPU, and the pool the core allocated reaching
the core's K/V manager and the frontend's request check.

Only a GPU measures real figures: `make gpu-smoke` reports the pool chosen there."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from orca_backend.config import EngineConfig
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import ParallelLayout
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.entrypoints.llm import LLM
from orca_backend.sampling_params import SamplingParams
from orca_backend.worker.kv_pool import (
    GIB,
    MemoryProfile,
    MemoryReading,
    check_free_memory,
    kv_pool_tokens,
    profile_memory,
)

# An 80 GiB GPU: 14 GiB of weights, 3 GiB more at the largest step's peak, 1 GiB outside torch.
H100 = MemoryProfile(total_bytes=80 * GIB, weights_bytes=14 * GIB, peak_bytes=17 * GIB, non_torch_bytes=1 * GIB)
LLAMA_8B_TOKEN = 2 * 2 * 32 * 8 * 128  # K and V, bf16, 32 layers, 8 KV heads of 128: 128 KiB a token


def test_the_pool_takes_the_budget_the_model_leaves_in_whole_blocks():
    tokens = kv_pool_tokens(H100, 0.9, LLAMA_8B_TOKEN, 16)
    budget = int(80 * GIB * 0.9) - 17 * GIB - 1 * GIB  # 54 GiB
    assert tokens == budget // LLAMA_8B_TOKEN // 16 * 16 == 442_368
    assert tokens * LLAMA_8B_TOKEN <= budget < (tokens + 16) * LLAMA_8B_TOKEN
    # Half the memory: the model's needs come off the smaller budget whole.
    assert kv_pool_tokens(H100, 0.5, LLAMA_8B_TOKEN, 16) == (40 * GIB - 18 * GIB) // LLAMA_8B_TOKEN // 16 * 16
    assert kv_pool_tokens(H100, 0.9, LLAMA_8B_TOKEN, 32) % 32 == 0


@pytest.mark.parametrize("utilization", [0.2, 0.225])
def test_a_budget_the_model_fills_is_refused_with_the_figures_and_what_to_change(utilization):
    """0.2 x 80 GiB = 16 GiB is less than the 18 GiB the model needs; 0.225 leaves 0 GiB: no block."""
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.2") as refused:
        kv_pool_tokens(H100, utilization, LLAMA_8B_TOKEN, 16)
    message = str(refused.value)
    assert "weights take 14.00 GiB" in message and "activations 3.00 GiB" in message
    assert "outside torch 1.00 GiB" in message and "kv_cache_memory_bytes" in message


def reading(free: float, reserved: float, allocated: float, peak: float) -> MemoryReading:
    """An 80 GiB device's reading, the figures in GiB."""
    return MemoryReading(total_bytes=80 * GIB, free_bytes=int(free * GIB), reserved_bytes=int(reserved * GIB),
                         allocated_bytes=int(allocated * GIB), peak_allocated_bytes=int(peak * GIB))  # fmt: skip


def test_the_profile_reads_the_memory_after_the_step_and_counts_what_torch_does_not_hold():
    ran = []

    def read():
        assert ran, "read before the step ran"
        return reading(free=50, reserved=28, allocated=14, peak=25)

    baseline = reading(free=79.5, reserved=0, allocated=0, peak=0)  # the CUDA context: 0.5 GiB
    profile = profile_memory(baseline, reading(free=65, reserved=14.5, allocated=14, peak=14),
                             lambda: ran.append(True), read)  # fmt: skip
    # Outside torch: 80 - 50 - 28 = 2 GiB after the step, 0.5 of it the context the baseline held.
    assert profile == MemoryProfile(total_bytes=80 * GIB, weights_bytes=14 * GIB, peak_bytes=25 * GIB,
                                    non_torch_bytes=int(1.5 * GIB))  # fmt: skip


def test_what_the_device_held_before_loading_is_not_counted_as_this_engines():
    """Another engine in the process (20 GiB allocated, 2 GiB of its workspaces outside torch): the
    weights, the step's peak and the memory outside torch are this engine's growth from the baseline."""
    baseline = reading(free=58, reserved=20, allocated=20, peak=20)
    loaded = reading(free=44, reserved=34, allocated=34, peak=34)
    profile = profile_memory(baseline, loaded, lambda: None, lambda: reading(free=40, reserved=37, allocated=34, peak=37))
    assert profile == MemoryProfile(total_bytes=80 * GIB, weights_bytes=14 * GIB, peak_bytes=17 * GIB,
                                    non_torch_bytes=1 * GIB)  # fmt: skip
    assert kv_pool_tokens(profile, 0.5, LLAMA_8B_TOKEN, 16) == (40 * GIB - 18 * GIB) // LLAMA_8B_TOKEN // 16 * 16


def test_an_engine_whose_budget_is_not_free_before_loading_is_refused_with_the_figures():
    check_free_memory(reading(free=79.5, reserved=0, allocated=0, peak=0), 0.9)  # 72 GiB of 79.5 free: starts
    with pytest.raises(ValueError, match="gpu_memory_utilization=0.9") as refused:
        check_free_memory(reading(free=58, reserved=20, allocated=20, peak=20), 0.9)
    message = str(refused.value)
    assert "72.00 GiB" in message and "58.00 GiB is free" in message and "add up to at most 1" in message


@pytest.mark.parametrize("max_num_batched_tokens", [0, 96])
def test_the_profile_step_runs_the_largest_step_and_leaves_the_pool_alone(max_num_batched_tokens):
    """The step the pool is sized around runs on a CPU too: all padding, so the K/V pool is neither
    read nor written (on a GPU it is a pool of one block)."""
    llm = LLM("gpt2-tiny", max_num_seqs=4, kv_capacity_tokens=256, max_num_batched_tokens=max_num_batched_tokens)
    runner = llm.engine.core.executor.runner
    for k, v in runner.kv_caches:
        k.fill_(1.5)
        v.fill_(-2.5)
    seen: list[int] = []
    forward = runner._forward

    def counting(stage_input, metas, logits_indices):
        seen.append(stage_input.input_ids.shape[0])
        return forward(stage_input, metas, logits_indices)

    runner._forward = counting
    runner.run_profile_step(llm.engine.model_config, llm.engine.config)
    assert seen == [max_num_batched_tokens or 2048]
    assert all(bool((k == 1.5).all()) and bool((v == -2.5).all()) for k, v in runner.kv_caches)


def test_the_pool_the_core_allocated_is_the_one_requests_are_checked_against():
    """The core's ranks allocate whole blocks (and, from gpu_memory_utilization, what memory leaves):
    the frontend takes the core's figure from its ready answer, in a core process as in-process."""
    config = EngineConfig(model="gpt2-tiny", kv_capacity_tokens=200, block_size=16, max_num_seqs=2)
    for engine in (LLMEngine(config), LLMEngine.launch(config)):
        try:
            assert engine.config.kv_capacity_tokens == 192
            assert engine.core.stats().kv_capacity_tokens == 192
            with pytest.raises(ValueError, match="K/V capacity of 192 tokens"):
                engine.add_request([1] * 150, SamplingParams(max_tokens=43))
        finally:
            engine.shutdown()


def test_a_cpu_engine_ignores_gpu_memory_utilization_as_vllms_cpu_build_does():
    config = EngineConfig(model="gpt2-tiny", kv_capacity_tokens=512, gpu_memory_utilization=0.5)
    assert not config.sizes_kv_pool_from_memory()
    assert EngineConfig(device="cuda", gpu_memory_utilization=0.5).sizes_kv_pool_from_memory()
    assert not EngineConfig(device="cuda", gpu_memory_utilization=0.5, kv_cache_memory_bytes=2**30).sizes_kv_pool_from_memory()
    engine = LLMEngine(config)
    try:
        assert engine.config.kv_capacity_tokens == 512
    finally:
        engine.shutdown()


@pytest.mark.parametrize("pp_rank", [0, 1])
def test_the_runner_sizes_its_pool_from_the_reading_after_the_profile_step(monkeypatch, pp_rank):
    """The GPU path of ModelRunner on a CPU: the device's figures injected (torch.cuda's calls and the
    reading), the rest real: the weights loaded, the profile step run on a pool of one block, then
    the pool allocated at what the arithmetic gives. Each pipeline stage profiles its own layers (a
    stage after the first on zero activations)."""
    from orca_backend.worker import model_runner
    from orca_backend.worker.model_runner import ModelRunner

    mib = 2**20
    steps: list[int] = []
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    # Before loading (the CUDA context: 1 MiB), after loading (2 MiB of weights), after the step.
    readings = [(63, 0, 0, 0), (60, 2, 2, 2), (52, 8, 2, 8)]

    def read(device: object) -> MemoryReading:
        steps.append(len(runner_pool[0]))
        free, reserved, allocated, peak = readings[len(steps) - 1]
        return MemoryReading(total_bytes=64 * mib, free_bytes=free * mib, reserved_bytes=reserved * mib,
                             allocated_bytes=allocated * mib, peak_allocated_bytes=peak * mib)  # fmt: skip

    runner_pool: list[list] = [[]]
    original = ModelRunner.run_profile_step

    def profile_step(self, model_config, config):
        runner_pool[0] = self.kv_caches
        assert all(k.shape[0] == config.block_size for k, _ in self.kv_caches)  # one block while profiling
        original(self, model_config, config)

    monkeypatch.setattr(model_runner, "read_cuda_memory", read)
    monkeypatch.setattr(ModelRunner, "run_profile_step", profile_step)
    config = EngineConfig(model="gpt2-tiny", device="cuda", gpu_memory_utilization=0.5, max_num_seqs=4,
                          max_num_batched_tokens=64)  # fmt: skip
    model_config = config.model_config()
    layout = ParallelLayout(tp_size=1, pp_size=2, tp_rank=0, pp_rank=pp_rank)
    runner = ModelRunner(dataclasses.replace(config, pipeline_parallel_size=2), model_config, torch.device("cpu"),
                         layout, TensorParallelGroup(1, None))  # fmt: skip
    per_token = dataclasses.replace(config, pipeline_parallel_size=2).kv_bytes_per_token(model_config)
    # 32 MiB of 64, less the 8 MiB peak and 3 MiB that came to be held outside torch (64 - 52 free - 8
    # reserved, less the baseline's 1): 21 MiB.
    expected = 21 * mib // per_token // 16 * 16
    assert steps == [0, 0, len(runner_pool[0])] and runner.kv_capacity_tokens == expected
    assert all(k.shape[0] == v.shape[0] == expected for k, v in runner.kv_caches)
