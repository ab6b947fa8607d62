"""The K/V groups' layout (orca_backend/kv_groups.py) and the manager's per-group bookkeeping, with
no model: which layers share a table and a page slot, how many pages the same memory makes, what a
request holds in each group as it grows past its window, and the events that name the groups."""

from __future__ import annotations

from orca_backend.core.kv_cache_manager import PagedKVManager
from orca_backend.core.request import Request
from orca_backend.kv_groups import kv_groups, pages_needed
from orca_backend.sampling_params import SamplingParams

LOCAL = 512


def gemma3_windows(layers: int) -> list[int]:
    return [0 if (i + 1) % 6 == 0 else LOCAL for i in range(layers)]


def test_gemma3_1b_layers_share_pages_of_four():
    """26 layers, 22 local and 4 global: pages of 4 layer slots (2 padding slots in all, within a
    tenth), one global group and six local ones; every group holds at most 4 layers, one per slot."""
    groups = kv_groups(gemma3_windows(26), [range(26)])
    assert groups.slots == 4 and groups.windows == (0,) + (LOCAL,) * 6
    for g in range(groups.num_groups):
        members = [i for i in range(26) if groups.layer_group[i] == g]
        assert len(members) <= 4 and len({groups.layer_slot[i] for i in members}) == len(members)
        assert {groups.layer_group[i] for i in members} == {g} and len({gemma3_windows(26)[i] for i in members}) == 1
    assert groups.num_pages(100) == 100 * 26 // 4  # the same bytes as 100 blocks of one table


def test_pipeline_stages_each_fill_their_own_slots():
    """Over two stages, a group's layers on each stage take distinct slots of that stage's pages."""
    stages = [range(13), range(13, 26)]
    groups = kv_groups(gemma3_windows(26), stages)
    for stage in stages:
        for g in range(groups.num_groups):
            slots = [groups.layer_slot[i] for i in stage if groups.layer_group[i] == g]
            assert len(slots) == len(set(slots)) and all(s < groups.slots for s in slots)
    assert groups.num_pages(10) == 10 * 13 // groups.slots


def test_alike_layers_keep_one_table():
    assert kv_groups([0] * 4, [range(4)]).windows == (0,)
    assert kv_groups([32] * 4, [range(2), range(2, 4)]).windows == (32,)  # Mistral: one windowed table
    one = kv_groups([32, 0, 32, 0], [range(4)], hybrid=False)
    assert one.windows == (0,) and one.slots == 4 and one.num_pages(7) == 7


def test_a_request_holds_its_global_blocks_and_each_local_window():
    """Groups (global, local window 8), blocks of 4: a request generating far past its window holds
    every block in the global group and ceil(8 / 4) + 1 in the local one; its admission takes only the
    first chunk's blocks; everything goes back when it ends."""
    kv = PagedKVManager(64 * 4, block_size=4, windows=(0, 8), step_tokens=4)
    request = Request("r", list(range(10)), SamplingParams(max_tokens=90, ignore_eos=True), 0.0)
    assert kv.admit(request, others_running=False, step_tokens=4)
    assert request.num_blocks == 1 and kv.used_blocks == 2  # the first chunk of 4 tokens, in both groups
    while request.num_computed < 100:
        step = min(4, 100 - request.num_computed)
        assert kv.grow(request, step)
        request.num_computed += step
    global_table, local_table = request.block_tables
    assert -1 not in global_table and len(global_table) == 25
    held = [b for b in local_table if b >= 0]
    assert len(held) <= 3 and local_table[: request.num_dropped_blocks[1]] == [-1] * request.num_dropped_blocks[1]
    assert kv.used_blocks == 25 + len(held)
    kv.free(request)
    assert kv.used_blocks == 0 and request.block_tables == []


def test_pages_needed_bounds_a_windowed_group_by_its_window_and_a_step():
    assert pages_needed((0,), 100, 4, 8) == 25
    assert pages_needed((0, 8), 100, 4, 8) == 25 + (-(-(8 + 9) // 4) + 1)
    assert pages_needed((0, 8), 100, 4, 0) == 50  # unchunked: a prompt may need every block at once


def test_prefix_cache_events_name_the_group_and_its_kind():
    kv = PagedKVManager(32 * 4, block_size=4, enable_prefix_caching=True, record_events=True, windows=(0, 8))
    request = Request("r", list(range(9)), SamplingParams(max_tokens=1), 0.0)
    assert kv.admit(request, others_running=False)
    request.num_computed = 9
    kv.register_computed(request)
    stored = kv.pool.take_events()
    assert [(e.group_idx, e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window) for e in stored] == \
        [(0, "full_attention", None)] * 2 + [(1, "sliding_window", 8)] * 2  # fmt: skip
    assert kv.pool.cached_hashes() == {(e.block_hashes[0], e.group_idx) for e in stored}


def test_a_long_gemma3_1b_request_holds_about_a_sixth_of_one_tables_bytes():
    """Gemma 3 1B's geometry (26 layers, 22 local with a 512-token window, pages of 4 layer slots),
    blocks of 16, a 32k-token request computed in chunks of 256: at its peak it holds its global
    group's blocks and about a window and a chunk per local group, under a fifth of the bytes one
    table over every layer holds for it (a sixth as the context grows)."""
    groups = kv_groups(gemma3_windows(26), [range(26)])
    size, chunk, tokens = 16, 256, 32768
    kv = PagedKVManager(groups.num_pages(tokens // size) * size, block_size=size, windows=groups.windows,
                        step_tokens=chunk)  # fmt: skip
    request = Request("r", list(range(tokens)), SamplingParams(max_tokens=1), 0.0)
    assert kv.admit(request, others_running=False, step_tokens=chunk)
    peak = 0
    while request.num_computed < tokens:
        step = min(chunk, tokens - request.num_computed)
        assert kv.grow(request, step)
        peak = max(peak, kv.used_blocks)
        request.num_computed += step
    one_table_bytes = (tokens // size) * 26  # layer-blocks
    assert peak * groups.slots < one_table_bytes / 5
