"""K/V block accounting (core/kv_cache_manager.py, core/block_pool.py): the block pool, both policies,
prefix caching, and the engine core's use of them under chunking, preemption, aborts and failed
batches, checked against a fake model; then prefix caching on the real (tiny) model, which computes
fewer prompt tokens, gives the same outputs and gives cached blocks up when the pool needs them.

The fake model (`TokenEchoExecutor`) keeps a pool of token ids where the real one keeps K/V: it
takes each step's deltas into the real persistent input batch (worker/input_batch.py), writes each
new token to its slot and answers with a function of the context it reads back through the
request's block table row. Any mistake in slots, block tables, the deltas, prefix sharing, chunk
positions or preemption then changes the answer, fast enough for many seeds. With a sliding window
it reads only the window's positions, so a block the manager frees while the window still covers
it (and hands to another request) changes the answer too.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
import torch
from engine_helpers import long_prompts, mixed_params

from orca_backend import LLM
from orca_backend.config import EngineConfig
from orca_backend.core.block_pool import BlockPool, block_key
from orca_backend.core.engine_core import EngineCore
from orca_backend.core.kv_cache_manager import PagedKVManager, ReservationKVManager
from orca_backend.core.request import Request
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.families.llama import SLIDING, LlamaConfig
from orca_backend.kv_groups import KVGroups, model_kv_groups
from orca_backend.messages import EngineCoreRequest
from orca_backend.sampling_params import SamplingParams
from orca_backend.scheduler_output import SamplerOutput, SchedulerOutput
from orca_backend.worker.input_batch import InputBatch

VOCAB = 97


def req(rid: str, prompt: list[int] | int, max_tokens: int) -> Request:
    ids = [1] * prompt if isinstance(prompt, int) else prompt
    return Request(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True), arrival_time=0.0)


# ---------------------------------------------------------------------------- the pool and policies
def test_reservation_holds_prompt_plus_max_tokens_in_blocks_and_frees():
    kv = ReservationKVManager(100, block_size=8)  # 12 whole blocks: 96 slots
    assert (kv.num_blocks, kv.capacity_tokens) == (12, 96)
    a, b = req("a", 10, 20), req("b", 5, 5)
    assert kv.admit(a, others_running=False) and kv.admit(b, others_running=True)
    assert (len(a.block_tables[0]), len(b.block_tables[0])) == (4, 2)
    assert not set(a.block_tables[0]) & set(b.block_tables[0])
    assert kv.grow(a, 20)  # a's whole future was reserved
    assert len(a.block_tables[0]) == 4 and kv.used_tokens == 48
    kv.free(a)
    assert kv.used_tokens == 16 and a.block_tables == []
    kv.free(a)  # double free is a no-op
    assert kv.used_tokens == 16
    assert not kv.admit(req("c", 50, 40), others_running=True)  # 12 blocks asked, 10 free
    kv.free(b)
    assert kv.used_blocks == 0 and kv.admit(req("c", 50, 40), others_running=False)


def test_paged_admits_the_prompt_and_grows_a_block_at_a_time():
    kv = PagedKVManager(64, block_size=4, watermark=0.0)
    a = req("a", 6, 100)  # would never fit under reservation: 106 > 64
    assert not kv.fits_ever(a)
    a = req("a", 6, 50)
    assert kv.fits_ever(a) and kv.admit(a, others_running=False)
    assert len(a.block_tables[0]) == 2
    a.num_computed = 6
    assert kv.grow(a, 1) and len(a.block_tables[0]) == 2  # position 6 is in block 1
    a.num_computed = 8
    assert kv.grow(a, 1) and len(a.block_tables[0]) == 3  # position 8 opens block 2
    hog = req("hog", 52, 1)
    assert kv.admit(hog, others_running=True) and kv.used_blocks == 16
    a.num_computed = 12
    assert not kv.grow(a, 1) and len(a.block_tables[0]) == 3  # full: the scheduler must preempt
    kv.free(hog)
    assert kv.grow(a, 1)


def test_paged_admission_keeps_the_watermark_unless_alone():
    kv = PagedKVManager(400, block_size=4, watermark=0.1)  # 100 blocks, 10 kept free
    assert kv.admit(req("a", 4 * 85, 4), others_running=False)
    assert not kv.admit(req("b", 4 * 6, 4), others_running=True)  # would leave 9 < 10 free
    assert kv.admit(req("c", 4 * 5, 4), others_running=True)  # leaves exactly 10


def test_prefix_cache_shares_full_blocks_and_always_computes_the_last_token():
    kv = ReservationKVManager(64, block_size=4, enable_prefix_caching=True)
    prompt = list(range(10, 22))  # 12 tokens: three full blocks
    a = req("a", prompt, 4)
    assert kv.admit(a, others_running=False) and a.num_computed == 0
    a.num_computed = 12
    kv.register_computed(a)
    assert kv.pool.num_cached == 3
    b = req("b", prompt, 4)  # the same prompt: the last block is recomputed for its logits
    assert kv.admit(b, others_running=True)
    assert b.num_computed == 8 and b.block_tables[0][:2] == a.block_tables[0][:2]
    assert b.block_tables[0][2] != a.block_tables[0][2]
    c = req("c", prompt[:6] + [99] * 6, 4)  # shares the first block only
    assert kv.admit(c, others_running=True) and c.num_computed == 4 and c.block_tables[0][0] == a.block_tables[0][0]
    assert kv.pool.blocks[a.block_tables[0][0]].ref_count == 3
    assert (kv.prefix_queried_tokens, kv.prefix_hit_tokens) == (36, 12)
    for r in (a, b, c):
        kv.free(r)
    assert kv.used_blocks == 0 and kv.pool.num_cached == 3  # cached, free, evictable


def test_cached_blocks_are_evicted_lru_and_never_while_held():
    pool = BlockPool(4)
    held, old = pool.allocate(1), pool.allocate(1)
    pool.cache(held[0], (block_key(None, (1,)), None))
    pool.cache(old[0], (block_key(None, (2,)), None))
    pool.release(old)  # free, still cached
    assert pool.lookup((block_key(None, (2,)), None)) == old[0]
    taken = pool.allocate(2)  # the two never-used blocks go first (freed before `old`)
    assert old[0] not in taken and pool.lookup((block_key(None, (2,)), None)) == old[0]
    assert pool.allocate(1) == old  # now evicted
    assert pool.lookup((block_key(None, (2,)), None)) is None
    assert pool.lookup((block_key(None, (1,)), None)) == held[0]  # held: never handed out
    with pytest.raises(RuntimeError):
        pool.allocate(1)


def test_block_keys_name_the_whole_prefix():
    first = block_key(None, (1, 2))
    assert block_key(first, (3, 4)) != block_key(block_key(None, (9, 9)), (3, 4))
    assert block_key(first, (3, 4)) == block_key(block_key(None, (1, 2)), (3, 4))


# ------------------------------------------------------------------------- the core, on a fake model
def expected_next(context: list[int], window: int = 0) -> int:
    return hash(tuple(context[-window:] if window else context)) % VOCAB


class TokenEchoExecutor:
    """A model whose K/V is the token id itself, and whose next token is a hash of the context it
    reads back through the block table. `fail_rate` makes batches raise, as a failed forward does."""

    def __init__(
        self, config: EngineConfig, max_in_flight: int, seed: int, fail_rate: float = 0.0, window: int = 0,
        groups: KVGroups | None = None,
    ) -> None:  # fmt: skip
        """`groups`: the model's K/V groups (one table if None), each with its block table; the pool
        holds their pages, as the runners' does."""
        num_slots = config.kv_capacity_tokens // config.block_size * config.block_size
        table_blocks = num_slots // config.block_size
        num_groups = groups.num_groups if groups is not None else 1
        num_pages = groups.num_pages(table_blocks) if groups is not None else table_blocks
        self.pool = [-1] * (num_pages * config.block_size)
        self.kv_capacity_tokens = num_slots
        self.max_in_flight = max_in_flight
        self.rng = random.Random(seed)
        self.fail_rate = fail_rate
        self.block_size = config.block_size
        self.window = window
        self.input_batch = InputBatch(config.max_num_seqs * max_in_flight, num_pages * config.block_size,
                                      config.block_size, VOCAB, torch.device("cpu"), num_groups)  # fmt: skip
        self._pending: deque[tuple[list[list[list[int]]], list[int], list[bool]]] = deque()

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def submit(self, step: SchedulerOutput) -> None:
        self.input_batch.apply(step)
        inputs = self.input_batch.prepare(step)  # views of buffers the next step reuses: copied out
        for slots in inputs.slot_mapping.tolist():  # each group's slots: every group keeps the token
            for token, slot in zip(inputs.input_ids.tolist(), slots, strict=True):
                self.pool[slot] = token
        self._pending.append((inputs.block_tables.tolist(), inputs.context_lens.tolist(), inputs.sampling.sample.tolist()))

    def collect_oldest(self) -> SamplerOutput:
        block_tables, context_lens, sample_flags = self._pending.popleft()
        if self.rng.random() < self.fail_rate:
            raise RuntimeError("injected forward failure")
        size, tokens = self.block_size, []
        for tables, ctx, sample in zip(zip(*block_tables, strict=True), context_lens, sample_flags, strict=True):
            start = max(ctx - self.window, 0) if self.window else 0  # what the last position sees
            # Read through every group's table: a group whose table is wrong gives a wrong token.
            reads = [[self.pool[table[j // size] * size + j % size] for j in range(start, ctx)] for table in tables]
            token = expected_next(reads[0])
            tokens.append((token if all(read == reads[0] for read in reads) else (token + 1) % VOCAB) if sample else -1)
        return SamplerOutput(tokens)

    def shutdown(self) -> None:
        self._pending.clear()


def reference_tokens(prompt: list[int], max_tokens: int, window: int = 0) -> list[int]:
    context, out = list(prompt), []
    for _ in range(max_tokens):
        out.append(expected_next(context, window))
        context.append(out[-1])
    return out


def run_fake(config: EngineConfig, seed: int, num_requests: int, pipeline_depth: int = 1, fail_rate: float = 0.0,
             abort_rate: float = 0.0, shared_prefix: int = 0, window: int = 0,
             max_tokens: int = 24) -> tuple[EngineCore, dict, dict, dict]:  # fmt: skip
    rng = random.Random(seed)
    model = GPT2Config(vocab_size=VOCAB, eos_token_id=None)
    if window:  # every layer windowed: the paged manager frees what falls out of it
        model = LlamaConfig(vocab_size=VOCAB, eos_token_id=None, num_hidden_layers=1, sliding_window=window,
                            layer_types=(SLIDING,))  # fmt: skip
    executor = TokenEchoExecutor(config, pipeline_depth, seed, fail_rate, window, model_kv_groups(model, config))
    core = EngineCore(config, model, executor=executor)
    prefix = [rng.randrange(VOCAB) for _ in range(shared_prefix)]
    prompts, got, ended = {}, {}, {}
    pending = []
    for i in range(num_requests):
        prompt = prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(1, 30))]
        params = SamplingParams(max_tokens=rng.randint(1, max_tokens), ignore_eos=True)
        r = EngineCoreRequest(f"r{i}", prompt, params, 0.0, 0)
        assert core.kv.fits_ever(Request.from_core_request(r))
        prompts[r.request_id] = (prompt, r.params.max_tokens)
        pending.append(r)
    steps = 0
    while pending or core.has_work():
        if pending and rng.random() < 0.5:
            core.add_requests([pending.pop(0)])
        if got and rng.random() < abort_rate:
            core.abort(rng.choice(sorted(got)), "cancelled")
        for out in core.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.finished:
                assert out.request_id not in ended, "a request ended twice"
                ended[out.request_id] = out.finish_reason
        steps += 1
        assert steps < 50_000
        check_accounting(core, window)
    return core, prompts, got, ended


def check_accounting(core: EngineCore, window: int = 0) -> None:
    """Every block is held exactly as often as block tables name it; free ones are held by none. With
    a window, a running request holds no block wholly before its window, once it has grown past it."""
    pool = core.kv.pool
    holders: dict[int, int] = {}
    for request in core.scheduler.running:
        for table in request.block_tables:
            for block_id in table:
                if block_id >= 0:  # -1: freed, outside its group's window
                    holders[block_id] = holders.get(block_id, 0) + 1
    for request in core.scheduler.waiting:
        assert request.block_tables == [], "a waiting request holds blocks"
    for block in pool.blocks:
        assert block.ref_count == holders.get(block.block_id, 0), f"block {block.block_id}"
    assert pool.num_free == pool.num_blocks - len(holders)


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("policy", ["reserve", "paged"])
def test_fake_model_tokens_are_exact_under_chunks_preemption_and_prefix_sharing(policy, seed):
    rng = random.Random(seed)
    config = EngineConfig(
        kv_policy=policy, block_size=rng.choice([1, 3, 4, 16]), kv_capacity_tokens=rng.choice([64, 96, 200]),
        max_num_seqs=rng.choice([2, 4, 8]), max_num_batched_tokens=rng.choice([0, 1, 7, 64]),
        enable_prefix_caching=rng.random() < 0.6, kv_watermark=0.0,
    )  # fmt: skip
    core, prompts, got, ended = run_fake(config, seed, num_requests=20, pipeline_depth=rng.choice([1, 2]),
                                         shared_prefix=rng.choice([0, 8, 20]))  # fmt: skip
    for rid, (prompt, max_tokens) in prompts.items():
        assert ended[rid] == "length"
        assert got[rid] == reference_tokens(prompt, max_tokens), rid
    assert core.kv.used_blocks == 0
    if policy == "reserve":
        assert core.scheduler.num_preemptions == 0


def test_a_small_paged_pool_preempts_and_still_gives_exact_tokens():
    preempted = 0
    for seed in range(8):
        config = EngineConfig(kv_policy="paged", block_size=4, kv_capacity_tokens=64, max_num_seqs=8, kv_watermark=0.0)
        core, prompts, got, _ = run_fake(config, seed, num_requests=16)
        for rid, (prompt, max_tokens) in prompts.items():
            assert got[rid] == reference_tokens(prompt, max_tokens), rid
        preempted += core.scheduler.num_preemptions
        assert core.stats().num_preemptions == core.scheduler.num_preemptions
    assert preempted > 10


@pytest.mark.parametrize("seed", range(8))
def test_aborts_and_failed_batches_never_leak_a_block(seed):
    rng = random.Random(seed)
    config = EngineConfig(
        kv_policy=rng.choice(["reserve", "paged"]), block_size=4, kv_capacity_tokens=96, max_num_seqs=4,
        max_num_batched_tokens=rng.choice([0, 5]), enable_prefix_caching=True, kv_watermark=0.0,
    )  # fmt: skip
    core, prompts, got, ended = run_fake(config, seed, num_requests=24, pipeline_depth=rng.choice([1, 2]),
                                         fail_rate=0.15, abort_rate=0.1, shared_prefix=8)  # fmt: skip
    assert set(ended) == set(prompts)
    assert {"error", "cancelled"} & set(ended.values())
    for rid, (prompt, max_tokens) in prompts.items():
        # Whatever ended it, every token it got is the right one, in order.
        assert got.get(rid, []) == reference_tokens(prompt, max_tokens)[: len(got.get(rid, []))], rid
    assert core.kv.used_blocks == 0
    assert core.kv.pool.num_free == core.kv.num_blocks  # only cached blocks left, and those are evictable
    every = core.kv.pool.allocate(core.kv.num_blocks)
    assert sorted(every) == list(range(core.kv.num_blocks)) and core.kv.pool.num_cached == 0


def test_shared_prefixes_compute_fewer_prompt_tokens():
    computed = {}
    for caching in (False, True):
        config = EngineConfig(kv_policy="paged", block_size=4, kv_capacity_tokens=512, max_num_seqs=4,
                              enable_prefix_caching=caching)  # fmt: skip
        core, prompts, got, _ = run_fake(config, 3, num_requests=12, shared_prefix=40)
        for rid, (prompt, max_tokens) in prompts.items():
            assert got[rid] == reference_tokens(prompt, max_tokens)
        stats = core.stats()
        computed[caching] = stats.num_prompt_tokens_computed
        assert (stats.prefix_cache_hit_tokens > 0) == caching
    assert computed[True] <= computed[False] - 40 * 6


@pytest.mark.parametrize("seed", range(24))
def test_sliding_window_frees_blocks_and_tokens_stay_exact(seed):
    """Every layer windowed: the paged manager frees the blocks behind the window as requests grow,
    under chunked prefill, prefix sharing, preemption, two batches in flight, failed batches and
    aborts; the fake model reads the window alone, through the runner's table, so a block freed too
    early (and rewritten by its next holder) changes the tokens."""
    rng = random.Random(seed)
    window = rng.choice([1, 5, 8, 16])
    config = EngineConfig(
        kv_policy=rng.choice(["paged", "paged", "reserve"]), block_size=rng.choice([1, 3, 4]),
        kv_capacity_tokens=rng.choice([96, 200]), max_num_seqs=rng.choice([2, 4]),
        max_num_batched_tokens=rng.choice([0, 5, 16]), enable_prefix_caching=rng.random() < 0.6, kv_watermark=0.0,
    )  # fmt: skip
    fail_rate, abort_rate = rng.choice([(0.0, 0.0), (0.1, 0.05)])
    core, prompts, got, ended = run_fake(config, seed, num_requests=16, pipeline_depth=rng.choice([1, 2]),
                                         fail_rate=fail_rate, abort_rate=abort_rate, shared_prefix=rng.choice([0, 8]),
                                         window=window, max_tokens=48)  # fmt: skip
    assert set(ended) == set(prompts)
    for rid, (prompt, max_tokens) in prompts.items():
        expected = reference_tokens(prompt, max_tokens, window)
        assert got.get(rid, []) == expected[: len(got.get(rid, []))], rid
        if ended[rid] == "length":
            assert got[rid] == expected, rid
    assert core.kv.used_blocks == 0


@pytest.mark.parametrize("window, block_size", [(8, 4), (6, 4), (16, 16), (5, 1)])
def test_a_long_generation_holds_a_window_of_blocks(window, block_size):
    """A request generating 4x its window holds at most ceil(window / block_size) + 1 blocks once its
    prompt is behind the window, measured from the K/V manager after every step; without the
    window (reservation, or a model with a full-attention layer) it holds them all."""
    held = {}
    for policy, windowed in (("paged", True), ("paged", False), ("reserve", True)):
        config = EngineConfig(kv_policy=policy, block_size=block_size, kv_capacity_tokens=512, max_num_seqs=2)
        model = LlamaConfig(vocab_size=VOCAB, eos_token_id=None, num_hidden_layers=2, sliding_window=window,
                            layer_types=(SLIDING, SLIDING if windowed else "full_attention"))  # fmt: skip
        executor = TokenEchoExecutor(config, 1, 0, window=window, groups=model_kv_groups(model, config))
        core = EngineCore(config, model, executor=executor)
        prompt = [3, 1, 4, 1, 5]
        core.add_requests([EngineCoreRequest("r", prompt, SamplingParams(max_tokens=4 * window, ignore_eos=True), 0.0, 0)])
        out, most = [], 0
        while core.has_work():
            out += [t for o in core.step() for t in o.new_token_ids]
            for request in core.scheduler.running:
                if request.num_computed >= len(prompt) + window:
                    # the most blocks one group's table holds (a full-attention group's: every block)
                    most = max(most, *(sum(b >= 0 for b in table) for table in request.block_tables))
                    assert core.kv.used_blocks == sum(b >= 0 for table in request.block_tables for b in table)
        assert out == reference_tokens(prompt, 4 * window, window)
        held[policy, windowed] = most
    bound = -(-window // block_size) + 1
    assert held["paged", True] <= bound
    total = -(-(len(prompt) + 4 * window) // block_size)
    # (the last token never gets K/V, and the request leaves the running list with the last step)
    assert held["paged", False] >= total - 2 and held["reserve", True] == total


# ------------------------------------------------------------------------- on the real (tiny) model
def test_prefix_caching_skips_shared_prompt_tokens_and_keeps_outputs(tiny_checkpoint):
    path, config = tiny_checkpoint
    prompts = long_prompts(6, config.vocab_size, seed=4, shared=64)  # a 64-token "system prompt"
    params = mixed_params(6, seed=4)
    runs = {}
    for caching in (False, True):
        llm = LLM(str(path), kv_policy="paged", enable_prefix_caching=caching, max_num_seqs=2)
        outs = llm.generate(prompts, params)
        runs[caching] = ([o.output_ids for o in outs], llm.engine.stats())
    assert runs[True][0] == runs[False][0]
    plain, cached = runs[False][1], runs[True][1]
    assert plain.num_prompt_tokens_computed == sum(len(p) for p in prompts)
    # Two run at a time: the first two compute the prefix, the other four find its 16 blocks cached.
    assert cached.num_prompt_tokens_computed == plain.num_prompt_tokens_computed - 4 * 64
    assert cached.prefix_cache_hit_tokens == 4 * 64 and 0 < cached.prefix_cache_hit_rate < 1


def test_cached_prefixes_are_evicted_when_the_pool_needs_their_blocks(tiny_checkpoint):
    path, config = tiny_checkpoint
    llm = LLM(str(path), kv_policy="paged", enable_prefix_caching=True, block_size=4, kv_capacity_tokens=128)
    greedy = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    gen = torch.Generator().manual_seed(7)
    first, big = (torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (64, 108))

    def hits_of(prompt: list[int]) -> tuple[list[int], int]:
        before = llm.engine.stats().prefix_cache_hit_tokens
        out = llm.generate([prompt], greedy)[0].output_ids
        return out, llm.engine.stats().prefix_cache_hit_tokens - before

    expected, _ = hits_of(first)
    assert hits_of(first) == (expected, 60)  # 15 of its 16 blocks: the last token is always computed
    # 108 + 4 tokens need 28 of the 32 blocks; at most 19 were ever handed out, so cached ones go.
    hits_of(big)
    out, hits = hits_of(first)
    assert out == expected and hits < 60
    assert llm.engine.stats().kv_used_blocks == 0
