"""The K/V pool's host tier (swap_space): preemption by swapping instead of recompute, and prefix
blocks the device evicts kept on the host and copied back on a hit. Tokens never change: each
request's equal what it produces alone in a roomy pool (greedy and seeded sampling; a recompute or
a lost K/V block would show), while the counters show the host tier did the work."""

from __future__ import annotations

import random

import pytest
import torch
from engine_helpers import long_prompts, mixed_params

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.core.block_pool import block_key
from orca_backend.core.host_block_pool import HostBlockPool
from orca_backend.core.kv_cache_manager import PagedKVManager
from orca_backend.core.request import Request
from orca_backend.worker.host_kv import HostKV, block_runs


def swap_space_for(path, blocks: int, block_size: int = 4) -> float:
    """The swap_space (GiB) that holds `blocks` blocks of the checkpoint's K/V."""
    config = EngineConfig(model=str(path), block_size=block_size)
    return blocks * config.kv_bytes_per_token(config.model_config()) * block_size / 2**30


def alone(path, prompts, params) -> list[list[int]]:
    llm = LLM(str(path))
    return [llm.generate([p], [sp])[0].output_ids for p, sp in zip(prompts, params, strict=True)]


@pytest.mark.parametrize(("seed", "async_scheduling"), [(0, False), (1, False), (2, False), (0, True), (3, True)])
def test_swapped_preemptions_keep_every_token_and_compute_no_prompt_twice(tiny_checkpoint, seed, async_scheduling):
    """A pool too small for the batch preempts; with room on the host every preempted request is
    swapped out and back (as many blocks in as out), resumes where it stopped (no prompt token is
    computed twice), and ends with the tokens it gives alone; with async scheduling too (a step is
    scheduled while the one before runs: the copies still come before the forward that needs them)."""
    path, config = tiny_checkpoint
    prompts, params = long_prompts(8, config.vocab_size, seed=seed), mixed_params(8, seed=seed)
    llm = LLM(str(path), kv_policy="paged", block_size=4, kv_capacity_tokens=64, max_num_seqs=8, kv_watermark=0.0,
              max_num_batched_tokens=random.Random(seed).choice([0, 16]), swap_space=swap_space_for(path, 64),
              async_scheduling=async_scheduling)  # fmt: skip
    assert [o.output_ids for o in llm.generate(prompts, params)] == alone(path, prompts, params)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0, "the workload was meant to preempt"
    assert stats.kv_swapped_out_blocks > 0 and stats.kv_swapped_in_blocks == stats.kv_swapped_out_blocks
    assert stats.num_prompt_tokens_computed == sum(map(len, prompts))
    assert stats.kv_used_blocks == 0 and stats.kv_host_used_blocks == 0


def test_a_host_tier_too_small_falls_back_to_recompute(tiny_checkpoint):
    """A request whose blocks do not fit on the host is recomputed, as without a host tier."""
    path, config = tiny_checkpoint
    prompts, params = long_prompts(8, config.vocab_size, seed=0), mixed_params(8, seed=0)
    llm = LLM(str(path), kv_policy="paged", block_size=4, kv_capacity_tokens=64, max_num_seqs=8, kv_watermark=0.0,
              swap_space=swap_space_for(path, 1))  # fmt: skip
    assert [o.output_ids for o in llm.generate(prompts, params)] == alone(path, prompts, params)
    stats = llm.engine.stats()
    assert stats.num_preemptions > 0 and stats.kv_swapped_out_blocks == 0
    assert stats.num_prompt_tokens_computed > sum(map(len, prompts))  # recomputed


def test_prefix_blocks_evicted_to_the_host_come_back_on_a_hit(tiny_checkpoint):
    """With prefix caching, a shared prefix the device pool had to evict is found on the host: its
    blocks are copied back instead of computed, and the tokens are those computed from scratch."""
    path, config = tiny_checkpoint
    rng = random.Random(3)
    prefix = [rng.randrange(config.vocab_size) for _ in range(24)]
    first = prefix + [5, 6]
    others = [[rng.randrange(config.vocab_size) for _ in range(30)] for _ in range(3)]  # evict the prefix's blocks
    again = prefix + [7, 8, 9]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    llm = LLM(str(path), kv_policy="paged", block_size=4, kv_capacity_tokens=48, enable_prefix_caching=True,
              swap_space=swap_space_for(path, 32))  # fmt: skip
    outs = [llm.generate([p], params)[0].output_ids for p in [first, *others, again]]
    assert outs == alone(path, [first, *others, again], [params] * 5)
    stats = llm.engine.stats()
    assert stats.kv_host_hit_blocks == len(prefix) // 4  # every block of the prefix came back from the host
    assert stats.prefix_cache_hit_tokens >= len(prefix)
    without = LLM(str(path), kv_policy="paged", block_size=4, kv_capacity_tokens=48, enable_prefix_caching=True)
    for p in [first, *others, again]:
        without.generate([p], params)
    assert without.engine.stats().num_prompt_tokens_computed - stats.num_prompt_tokens_computed == len(prefix)


def test_a_host_block_a_step_reads_is_not_written_by_it():
    """A prefix hit pins its host block for the step (its copy to the device runs then), so an
    eviction in the same step stores elsewhere or nowhere; blocks given back are reused only from
    the next step, after the copies that read them."""
    host = HostBlockPool(2, block_size=2)
    a, b, c = ((block_key(None, tokens), None) for tokens in ((1, 2), (3, 4), (5, 6)))  # (key, group)
    block_a, block_b = host.store(a, True, None), host.store(b, True, None)
    assert host.lookup(a) == block_a and host.lookup(b) == block_b
    assert host.store(c, True, None) is None and host.available() == 0  # both pinned: no room
    host.end_step()
    assert host.store(c, True, None) == block_a  # the oldest (a, looked up first) is evicted now
    taken = host.take(2)
    host.give_back(taken)
    assert host.available() == 0 and host.num_held == 0
    host.end_step()
    assert host.available() == 2


def test_swap_out_copies_every_held_block_and_keeps_dropped_entries():
    """A windowed request's table past its dropped blocks goes to the host in order; swapped in, it
    gets fresh blocks for the same entries (the dropped ones stay -1), and the copies pair them."""
    kv = PagedKVManager(16 * 4, block_size=4, windows=(4,), host_blocks=8)
    request = Request("r", list(range(12)), SamplingParams(max_tokens=8), arrival_time=0.0)
    assert kv.admit(request, others_running=False)
    request.num_computed = 12
    assert kv.grow(request, 1)  # drops the blocks wholly before the window
    held = request.block_tables[0][request.num_dropped_blocks[0] :]
    assert request.num_dropped_blocks == [2] and len(held) == 2
    assert kv.swap_out(request)
    to_host, _ = kv.take_transfers()
    assert [d for d, _ in to_host] == held and [h for _, h in to_host] == request.host_tables[0]
    host_blocks = list(request.host_tables[0])
    assert kv.admit(request, others_running=False)
    _, to_device = kv.take_transfers()
    assert request.block_tables[0][:2] == [-1, -1] and request.num_computed == 12
    assert to_device == list(zip(host_blocks, request.block_tables[0][2:4], strict=True))


def test_block_runs_coalesce_consecutive_pairs_in_order():
    assert block_runs([(3, 7), (4, 8), (5, 9), (9, 1), (2, 2), (3, 3)]) == [(3, 7, 3), (9, 1, 1), (2, 2, 2)]
    assert block_runs([]) == []


def test_host_copies_round_trip_every_layer_bit_for_bit():
    """Out to the host and back into other device blocks: the same bytes, FP8 pools included."""
    for dtype in (torch.float32, torch.float8_e4m3fn):
        layers = [tuple(torch.randn(8 * 2, 2, 4).to(dtype) for _ in range(2)) for _ in range(3)]
        host = HostKV(layers, num_blocks=4, block_size=2)
        before = [[cache[2:6].clone() for cache in layer] for layer in layers]  # blocks 1 and 2
        host.copy([(1, 3), (2, 0)], [])
        host.copy([], [(3, 6), (0, 7)])  # into blocks 6 and 7
        for layer, saved in zip(layers, before, strict=True):
            for cache, rows in zip(layer, saved, strict=True):
                assert torch.equal(cache[12:16].view(torch.uint8), rows.view(torch.uint8))


@pytest.mark.slow
@pytest.mark.parametrize("layout", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}])
def test_worker_processes_swap_as_one_process(tiny_checkpoint, layout):
    """Each rank swaps its share of every block (its heads, or its stage's layers; two batches in
    flight under pipeline parallelism): two ranks give one process's tokens."""
    path, config = tiny_checkpoint
    prompts, params = long_prompts(8, config.vocab_size, seed=1), mixed_params(8, seed=1)
    options = dict(kv_policy="paged", block_size=4, kv_capacity_tokens=64, max_num_seqs=8, kv_watermark=0.0,
                   swap_space=swap_space_for(path, 64))  # fmt: skip
    one = [o.output_ids for o in LLM(str(path), **options).generate(prompts, params)]
    two = LLM(str(path), **layout, **options)
    try:
        assert [o.output_ids for o in two.generate(prompts, params)] == one
        assert two.engine.stats().kv_swapped_out_blocks > 0
    finally:
        two.engine.shutdown()
