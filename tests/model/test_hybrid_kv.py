"""Per-group K/V (orca_backend/kv_groups.py) on a Gemma 3 checkpoint with real Gemma 3's five local
layers to one global, against transformers: long generations (several windows past the prompt) keep
their tokens while the local groups give back the blocks behind their window, and a request then holds
its global group's blocks plus a window's worth per local group: measured from the K/V manager after
every step, against the one-table layout (`disable_hybrid_kv_cache_manager`) in the same pool.
Prefix caching, chunked prefill, preemption by recompute and by swapping (swap_space), and pipeline
parallelism run over the groups with the same tokens."""

from __future__ import annotations

import pytest
from hf_tiny import hf_greedy, randomize_norms, write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.config import EngineConfig, model_config_from_hf
from orca_backend.core.engine_core import EngineCore
from orca_backend.kv_groups import model_kv_groups
from orca_backend.messages import EngineCoreRequest

transformers = pytest.importorskip("transformers")

WINDOW, BLOCK, LAYERS = 8, 4, 6
MAX_TOKENS = 5 * WINDOW
PROMPTS = [
    [5, 17, 33, 2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 40, 41, 42, 43],
    [5, 17, 33, 2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 40, 41, 42, 43, 44, 45, 46],  # shares 4 blocks
    [100, 7],
    [250, 251, 252, 253, 254, 9, 11, 60, 61, 62, 63],
]
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3-hybrid")
    model = write_tiny("Gemma3", path, seed=11, config_class="Gemma3TextConfig", sliding_window=WINDOW,
                       query_pre_attn_scalar=16, num_hidden_layers=LAYERS, sliding_window_pattern=6,
                       max_position_embeddings=256)  # fmt: skip
    model = randomize_norms(model, path, seed=1)
    return path, model, [hf_greedy(model, p, MAX_TOKENS) for p in PROMPTS]


def run_core(path, prompts, **engine) -> tuple[list[list[int]], int, tuple[int, int]]:  # noqa: ANN001
    """Each prompt's tokens, the most pool blocks in use after any step, and (preemptions, blocks
    swapped out)."""
    config = EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, max_num_seqs=4, **engine)
    core = EngineCore(config, model_config_from_hf(path / "config.json"))
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(prompts))}
    most = 0
    try:
        core.add_requests([EngineCoreRequest(str(i), p, GREEDY, 0.0, 0) for i, p in enumerate(prompts)])
        while core.has_work():
            for out in core.step():
                tokens[out.request_id] += out.new_token_ids
            most = max(most, core.kv.used_blocks)
        counts = core.scheduler.num_preemptions, core.kv.swapped_out_blocks
    finally:
        core.shutdown()
    return [tokens[str(i)] for i in range(len(prompts))], most, counts


def test_gemma3_gets_a_global_group_and_local_groups(gemma3):
    path, _, _ = gemma3
    config = EngineConfig(model=str(path), dtype="float32", block_size=BLOCK)
    core = EngineCore(config, model_config_from_hf(path / "config.json"))
    try:
        assert core.kv.windows == (0,) + (WINDOW,) * 5  # one layer per page: 1 global, 5 local groups
        assert core.kv.num_blocks == 6 * config.kv_capacity_tokens // BLOCK  # the same bytes, in pages of one layer
    finally:
        core.shutdown()


def test_a_long_request_holds_its_global_blocks_and_a_window_per_local_group(gemma3):
    """One request generating five windows past its prompt: the most pages it ever holds is its global
    group's blocks plus, per local group, the window's blocks and those of one step ahead (the hybrid
    bound), about a sixth of what one table over every layer holds; tokens are transformers'."""
    path, _, references = gemma3
    prompt = PROMPTS[0]
    hybrid, hybrid_most, _ = run_core(path, [prompt], max_num_batched_tokens=8)
    table, table_most, _ = run_core(path, [prompt], max_num_batched_tokens=8, disable_hybrid_kv_cache_manager=True)
    assert hybrid == table == [references[0]]
    total_blocks = -(-(len(prompt) + MAX_TOKENS) // BLOCK)
    local = -(-(WINDOW + 8 + 1) // BLOCK) + 1  # the window and a chunk of 8, at most, per local group
    assert table_most == total_blocks  # one table: every block, all layers (a page is the six layers)
    assert hybrid_most <= total_blocks + 5 * local  # pages of one layer each
    # memory: a one-table block is six pages' bytes
    assert hybrid_most * 2 < table_most * 6


@pytest.mark.parametrize("engine", [
    {},
    {"max_num_batched_tokens": 6},
    {"enable_prefix_caching": True},
    {"enable_prefix_caching": True, "max_num_batched_tokens": 5},
    # preemption by recompute, then by swapping: 72 pages, a request's windows and globals at most 45
    {"kv_capacity_tokens": 12 * BLOCK, "max_num_batched_tokens": 8},
    {"kv_capacity_tokens": 12 * BLOCK, "max_num_batched_tokens": 8, "swap_space": 0.001, "enable_prefix_caching": True},
], ids=["plain", "chunked", "prefix", "prefix-chunked", "pressure", "pressure-swap"])  # fmt: skip
def test_tokens_equal_transformers_over_the_groups(gemma3, engine):
    path, _, references = gemma3
    tokens, _, (preemptions, swapped) = run_core(path, PROMPTS, **engine)
    assert tokens == references
    if "kv_capacity_tokens" in engine:  # the pool was short: requests were preempted (and swapped)
        assert preemptions > 0 and (swapped > 0) == ("swap_space" in engine)


def test_prefix_hits_share_the_global_blocks_and_the_local_window(gemma3):
    """A request whose prompt starts with a finished one's finds its cached blocks: every block of the
    global group, the window's in each local group (those behind it are not needed), so it computes
    only its own tail."""
    path, _, references = gemma3
    config = EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, enable_prefix_caching=True)
    core = EngineCore(config, model_config_from_hf(path / "config.json"))
    try:
        for i in (0, 1):
            core.add_requests([EngineCoreRequest(str(i), PROMPTS[i], GREEDY, 0.0, 0)])
            out: list[int] = []
            while core.has_work():
                out += [t for o in core.step() for t in o.new_token_ids]
            assert out == references[i]
        # the second prompt (22 tokens) found the first's four full prompt blocks
        assert core.kv.prefix_hit_tokens == 4 * BLOCK
    finally:
        core.shutdown()


def test_a_draft_model_keeps_one_table(gemma3):
    """A draft model proposes over the target's one block table: with one (the target as its own
    draft), the engine keeps one table, and its tokens are transformers'."""
    path, _, references = gemma3
    spec = f'{{"method": "draft_model", "model": "{path}", "num_speculative_tokens": 2}}'
    tokens, _, _ = run_core(path, PROMPTS[:2], speculative_config=spec)
    assert tokens == references[:2]
    config = EngineConfig(model=str(path), dtype="float32", block_size=BLOCK, speculative_config=spec)
    assert model_kv_groups(model_config_from_hf(path / "config.json"), config).num_groups == 1


@pytest.mark.slow
def test_pipeline_parallel_stages_share_the_groups(gemma3):
    path, _, references = gemma3
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, block_size=BLOCK, pipeline_parallel_size=2)
    try:
        assert [o.output_ids for o in llm.generate(PROMPTS, GREEDY)] == references
    finally:
        llm.engine.shutdown()
