"""Which layers share a K/V block table: the pool's groups (vLLM's hybrid K/V cache manager, in this
project's words). Torch-free: the engine core, the frontend's admission check and every runner read it.

A model whose layers do not all attend alike (Gemma 2/3: local layers within a sliding window,
global ones to the whole context) wastes a single block table's memory: the local layers never read
the K/V before their window, yet one table keeps it for every layer. With groups, layers of the same
window share a block table, and a local group gives its blocks back behind the window while a global
group keeps them (core/kv_cache_manager.py). A long Gemma 3 request then holds a global group's
blocks plus a window's worth per local group: about a sixth of one table over every layer.

The groups still share one pool, so blocks flow to whichever group needs them. That needs every
block to be the same size: a *page* is `slots` layers' K and V for `block_size` tokens, and a group
holds at most `slots` layers on each pipeline stage (the runners' pool is `slots` tensors per stage,
each of every page: worker/model_runner.py). Each window's layers on a stage are cut, in order, into
runs of `slots`; a window's j-th group is the j-th run of every stage. When the counts do not divide,
a group's last page slots on some stage hold no layer (padding); `slots` is the largest size whose
padding costs at most a tenth of the layers, so few groups are needed.

With one group (every layer alike, or `disable_hybrid_kv_cache_manager`) the layout is the one-table
layout: a page is every layer of a stage, and the group's window is the model's where every layer has
the same one. Under the `reserve` policy, whose point is what a request holds from admission, no
block is given back early: one table, no window.
"""

from __future__ import annotations

from dataclasses import dataclass

from orca_backend.config import EngineConfig, stage_layers
from orca_backend.families import AnyModelConfig

MAX_PADDING = 0.1  # the share of a stage's layers padding may add to a page's slots


@dataclass(frozen=True)
class KVGroups:
    windows: tuple[int, ...]  # each group's window (0: its layers see the whole context)
    layer_group: tuple[int, ...]  # each layer's group
    layer_slot: tuple[int, ...]  # each layer's slot in a page on its stage
    slots: int  # layer slots in a page
    stage_layers: int  # the most layers any stage holds (what one table's page holds)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def num_pages(self, table_blocks: int) -> int:
        """The pages of a pool whose memory holds `table_blocks` blocks of one table over every layer of
        a stage (kv_capacity_tokens // block_size): the same memory, cut into pages of `slots` layers."""
        return table_blocks * self.stage_layers // self.slots

    def fits(self, num_tokens: int, capacity_tokens: int, block_size: int, step_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens fits an empty pool of `capacity_tokens` slots of one
        table (kv_capacity_tokens), cut into these groups' pages (validation needs no pool)."""
        return pages_needed(self.windows, num_tokens, block_size, step_tokens) <= self.num_pages(capacity_tokens // block_size)


def pages_needed(windows: tuple[int, ...], num_tokens: int, block_size: int, step_tokens: int) -> int:
    """The most blocks a request of `num_tokens` tokens holds at once in groups of these `windows`:
    every block in a global group; in a windowed one, those a step of up to `step_tokens` new tokens
    (0: the whole request) and one run ahead of it read and write, its window before them included."""
    blocks = -(-num_tokens // block_size)
    reach = num_tokens if not step_tokens else step_tokens + 1
    return sum(blocks if not w else min(blocks, -(-(w + reach) // block_size) + 1) for w in windows)


def one_table(windows: list[int], stages: list[range]) -> KVGroups:
    """Every layer in one group: a page is every layer of a stage; the window is the layers' common one,
    else 0."""
    common = windows[0] if len(set(windows)) == 1 else 0
    most = max(len(stage) for stage in stages)
    slot = tuple(i - stage.start for stage in stages for i in stage)
    return KVGroups((common,), (0,) * len(windows), slot, most, most)


def kv_groups(windows: list[int], stages: list[range], hybrid: bool = True) -> KVGroups:
    """The groups of a model whose layer i attends within `windows[i]` (0: the whole context), cut
    into pipeline `stages` (module docstring). `hybrid` False: one table."""
    kinds = sorted(set(windows))
    if not hybrid or len(kinds) == 1:
        return one_table(windows, stages)
    # each window's layers on each stage, in order
    runs = {w: [[i for i in stage if windows[i] == w] for stage in stages] for w in kinds}
    most = {w: max(len(layers) for layers in runs[w]) for w in kinds}
    total = sum(most.values())
    slots = next(k for k in range(min(most.values()), 0, -1)
                 if sum(-(-most[w] // k) * k for w in kinds) <= (1 + MAX_PADDING) * total)  # fmt: skip
    group_windows: list[int] = []
    layer_group, layer_slot = [0] * len(windows), [0] * len(windows)
    for w in kinds:
        first = len(group_windows)
        group_windows += [w] * -(-most[w] // slots)
        for layers in runs[w]:
            for index, layer in enumerate(layers):
                layer_group[layer], layer_slot[layer] = first + index // slots, index % slots
    return KVGroups(tuple(group_windows), tuple(layer_group), tuple(layer_slot), slots,
                    max(len(stage) for stage in stages))  # fmt: skip


def model_kv_groups(model_config: AnyModelConfig, config: EngineConfig) -> KVGroups:
    """The groups an engine gives the model: per window under the paged policy, unless
    `disable_hybrid_kv_cache_manager`, or a draft model or an EAGLE head shares the target's block
    table (speculative decoding: its K/V is addressed by the target's one table); one table otherwise
    (module docstring)."""
    count, pp = model_config.num_layers, int(config.pipeline_parallel_size)
    stages = [stage_layers(count, pp, rank) for rank in range(pp)]
    paged = config.kv_policy == "paged"  # the policy that gives blocks back behind a window
    windows = [model_config.window(i) if paged else 0 for i in range(count)]
    return kv_groups(windows, stages, hybrid=not (config.disable_hybrid_kv_cache_manager or shares_one_table(config)))


def shares_one_table(config: EngineConfig) -> bool:
    """Whether a draft model or an EAGLE head proposes in the runners, over the target's block table."""
    speculative = config.speculative()
    return speculative is not None and speculative.method in ("draft_model", "eagle", "eagle3")
