"""The K/V pool's blocks as the engine core sees them: who holds each, which are free, which cache a prefix.

The pool is `num_blocks` fixed-size blocks (the model runners hold the tensors:
worker/model_runner.py). A block is held by the requests whose block tables name it (its reference
count); at zero it is free. A free block may still hold a cached prefix: it keeps its key until it
is handed out again, and free blocks are handed out least recently freed first, so cached prefixes
are evicted LRU and never while held.

A block's key is (its parent block's hash, its own token ids): the key of a block therefore names
every token before it (and the LoRA adapter the request runs, through the first block's root), and two requests whose prompts agree up to a block boundary share the keys
of every block up to it. The dictionary compares keys by value, so a hash collision can never match
different tokens in this block; only a collision of two parents' 64-bit hashes could.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from orca_backend.core.kv_events import MEDIUM_GPU, BlockRemoved, BlockStored, KVCacheEvent

if TYPE_CHECKING:
    from orca_backend.lora import LoRARequest

BlockKey = tuple[int, tuple[int, ...]]  # (hash of the parent block's key, or the root for the first; token ids)
# What the pool caches a block under: its key and its K/V group (orca_backend/kv_groups.py; None when
# the pool serves one group), as K/V events name it (group_idx).
CacheKey = tuple[BlockKey, "int | None"]


def block_key(parent: BlockKey | None, token_ids: tuple[int, ...], root: int = 0) -> BlockKey:
    """`root` stands for the parent of a request's first block: 0, or its LoRA adapter's
    (`lora_root`), so that K/V computed with one adapter is never shared with another, nor the base."""
    return (root if parent is None else hash(parent), token_ids)


def lora_root(lora_id: int) -> int:
    return hash(("lora", lora_id))


def stored_event(cached: CacheKey, first: bool, lora: LoRARequest | None, block_size: int, medium: str,
                 windows: tuple[int, ...] = ()) -> BlockStored:  # fmt: skip
    """The K/V event of a block cached under `cached` on `medium` (`first`: its request's first block,
    whose key's parent part is the root, not a block; `lora`: the adapter it was computed with;
    `windows`: each group's window, where the pool has several groups)."""
    key, group = cached
    window = windows[group] if group is not None else None
    kind = None if window is None else "sliding_window" if window else "full_attention"
    return BlockStored([hash(key)], None if first else key[0], list(key[1]), block_size,
                       lora.lora_id if lora is not None else None, medium, lora.name if lora is not None else None,
                       group_idx=group, kv_cache_spec_kind=kind, kv_cache_spec_sliding_window=window or None)  # fmt: skip


def removed_event(cached: CacheKey, medium: str) -> BlockRemoved:
    return BlockRemoved([hash(cached[0])], medium, group_idx=cached[1])


@dataclass(slots=True)
class Block:
    block_id: int
    ref_count: int = 0
    key: CacheKey | None = None  # set while the block's K/V is a cached prefix
    first: bool = False  # (cached) its request's first block: its key's parent part is the root
    lora: LoRARequest | None = None  # (cached) the adapter it was computed with


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int = 16, record_events: bool = False,
                 windows: tuple[int, ...] = ()) -> None:  # fmt: skip
        """`windows`: each K/V group's window where the pool serves several (their blocks' events say it)."""
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.windows = windows
        self.blocks = [Block(i) for i in range(num_blocks)]
        # Free blocks in the order they are handed out: least recently freed first.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[CacheKey, int] = {}
        # What the cache stored and evicted since the last `take_events` (K/V events for routers:
        # core/kv_events.py); None when nobody publishes them.
        self._events: list[KVCacheEvent] | None = [] if record_events else None
        # Called with each cached block evicted to be handed out again, before it is (the host tier's
        # offload: core/kv_cache_manager.py); None: evicted blocks are dropped.
        self.on_evict: Callable[[Block], None] | None = None

    def record(self, event: KVCacheEvent) -> None:
        """An event of another tier, in order with this pool's (a no-op when not recording)."""
        if self._events is not None:
            self._events.append(event)

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call, oldest first (none when not recording)."""
        if self._events is None:
            return []
        events, self._events = self._events, []
        return events

    def cached_hashes(self) -> set[tuple[int, int | None]]:
        """(hash, group) of every cached block (what a subscriber rebuilds from the events)."""
        return {(hash(key), group) for key, group in self._cached}

    @property
    def num_free(self) -> int:
        """Blocks no request holds, cached ones included (they are evicted on demand)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def lookup(self, key: CacheKey) -> int | None:
        """The block caching `key`, held or free, or None."""
        return self._cached.get(key)

    def allocate(self, n: int) -> list[int]:
        """Hands out n free blocks (evicting what they cached); the caller checked `num_free`."""
        if n > len(self._free):
            raise RuntimeError(f"K/V pool: {n} blocks asked, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                if self.on_evict is not None:
                    self.on_evict(block)
                del self._cached[block.key]
                if self._events is not None:
                    self._events.append(removed_event(block.key, MEDIUM_GPU))
                block.key, block.lora = None, None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def share(self, block_id: int) -> None:
        """One more holder of a cached block (a prefix hit); a free one leaves the free list."""
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self._free[block_id]
        block.ref_count += 1

    def release(self, block_ids: list[int]) -> None:
        """Drops one holder of each block. A block table is released tail first, so a request's
        last blocks, the least likely to be shared, are the first evicted."""
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None
            elif block.ref_count < 0:
                raise RuntimeError(f"K/V block {block_id} released more often than held")

    def cache(self, block_id: int, key: CacheKey, first: bool = False, lora: LoRARequest | None = None) -> None:
        """Marks a full, computed block as caching `key` (`first`: the first block of its request, whose
        key's parent part is the root, not a block; `lora`: the adapter it was computed with). If another
        block already caches the same tokens (two requests computed one prefix at once), that one
        stays the cached copy."""
        block = self.blocks[block_id]
        if block.key is None and key not in self._cached:
            block.key, block.first, block.lora = key, first, lora
            self._cached[key] = block_id
            if self._events is not None:
                self._events.append(stored_event(key, first, lora, self.block_size, MEDIUM_GPU, self.windows))
