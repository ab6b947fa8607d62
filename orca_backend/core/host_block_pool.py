"""The host tier of the K/V pool (`swap_space`), as the engine core sees it: which host blocks hold
what (the model runners hold the tensors: worker/host_kv.py).

A host block holds one of: a block of a request preempted by swapping (until the request is
admitted again and its blocks come back), a cached prefix block the device pool evicted (kept
under its key, least recently stored evicted first), or nothing. Blocks of swapped requests are
never evicted; cached ones make way for them.

Copies run on the model runners before the step's forward, device-to-host ones first (`Transfers`),
so a host block whose K/V a step copies back to the device must not be written by that same step:
such blocks are `pinned` until the next step begins (`end_step`), as are the blocks a swapped
request gave back when it came in again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import TYPE_CHECKING

from orca_backend.core.block_pool import CacheKey, removed_event, stored_event
from orca_backend.core.kv_events import MEDIUM_CPU, KVCacheEvent

if TYPE_CHECKING:
    from orca_backend.lora import LoRARequest


class HostBlockPool:
    def __init__(self, num_blocks: int, block_size: int, record: Callable[[KVCacheEvent], None] | None = None,
                 windows: tuple[int, ...] = ()) -> None:  # fmt: skip
        """`record`: where host stores and evictions go as K/V events (the device pool's; None: nowhere);
        `windows`: each K/V group's, where there are several (BlockPool's)."""
        self.num_blocks = num_blocks
        self.windows = windows
        self.block_size = block_size
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # a stack: block 0 handed out first
        self._cached: OrderedDict[CacheKey, int] = OrderedDict()  # least recently stored first
        self._pinned: set[int] = set()  # read by this step's copies to the device: not written before the next
        self._returned: list[int] = []  # given back this step: free from the next
        self._record = record

    @property
    def num_held(self) -> int:
        """Blocks of swapped requests (neither free nor cached)."""
        return self.num_blocks - len(self._free) - len(self._cached) - len(self._returned)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def available(self) -> int:
        """Blocks `take` can hand out now: free ones, and cached ones not pinned by this step."""
        return len(self._free) + sum(block not in self._pinned for block in self._cached.values())

    def take(self, n: int) -> list[int]:
        """n blocks for a swapped request (evicting cached prefixes, oldest first); the caller checked
        `available`."""
        if n > self.available():
            raise RuntimeError(f"host K/V pool: {n} blocks asked, {self.available()} available")
        taken = [self._free.pop() for _ in range(min(n, len(self._free)))]
        if len(taken) < n:
            for key, block in list(self._cached.items()):
                if block in self._pinned:
                    continue
                self._evict(key)
                taken.append(block)
                if len(taken) == n:
                    break
        return taken

    def give_back(self, blocks: list[int]) -> None:
        """A swapped request's blocks, once copied back to the device this step: free from the next."""
        self._returned += blocks

    def store(self, key: CacheKey, first: bool, lora: LoRARequest | None) -> int | None:
        """A host block for a cached prefix block the device evicts (None: no room, or it is cached
        here already): a free one, or the oldest cached one not pinned."""
        if key in self._cached:
            self._cached.move_to_end(key)
            return None
        if not self._free:
            oldest = next((k for k, b in self._cached.items() if b not in self._pinned), None)
            if oldest is None:
                return None
            self._free.append(self._evict(oldest))
        block = self._free.pop()
        self._cached[key] = block
        if self._record is not None:
            self._record(stored_event(key, first, lora, self.block_size, MEDIUM_CPU, self.windows))
        return block

    def peek(self, key: CacheKey) -> int | None:
        """The host block caching `key`, or None, touching nothing (an admission's search)."""
        return self._cached.get(key)

    def lookup(self, key: CacheKey) -> int | None:
        """The host block caching `key`, or None; a hit is pinned for this step (its copy to the device
        reads it) and counts as recently used."""
        block = self._cached.get(key)
        if block is not None:
            self._cached.move_to_end(key)
            self._pinned.add(block)
        return block

    def end_step(self) -> None:
        """The step's copies are on their way: what it pinned and what it was given back are free to use."""
        self._pinned.clear()
        self._free += self._returned
        self._returned = []

    def _evict(self, key: CacheKey) -> int:
        block = self._cached.pop(key)
        if self._record is not None:
            self._record(removed_event(key, MEDIUM_CPU))
        return block
