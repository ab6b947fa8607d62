"""K/V bookkeeping: the block table of every request, over the block pool (core/block_pool.py).

Both policies page the pool into blocks of `block_size` slots and give each request a block table;
they differ in how much a request holds, and when:

- `ReservationKVManager` is ORCA's: at admission a request gets blocks for ``prompt + max_tokens``,
  so a running request can never run out and nothing is ever preempted, but a request that stops
  early held memory it never used.
- `PagedKVManager` is vLLM's: at admission a request gets blocks for the tokens it has (its prompt),
  and one more block each time its context crosses a block boundary. When none is free the
  scheduler preempts (core/scheduler.py). Admission keeps a watermark of blocks free, so requests
  just admitted do not preempt each other at once.

With a sliding window on every layer (Mistral; `LlamaConfig.kv_window`), the paged policy also
gives back, as a request grows, the blocks that lie wholly before the window of every position it
has yet to compute: no layer reads them again, so a long generation holds about
``window / block_size + 1`` blocks. Their table entries become -1 here; the runners keep their
copies of the old ids, which no windowed kernel reads (kernels/orca_kernels/attention.py).

Prefix caching works the same under both: a full, computed block is registered under its key, and
a request admitted later whose tokens start with registered blocks shares them (reference counts)
instead of computing them again. The last token is always computed, since its logits are needed.

With a host tier (`swap_space`, core/host_block_pool.py), a preempted request's blocks are copied
to host blocks instead of being recomputed (`swap_out`), and copied back into fresh device blocks
when it is admitted again, resuming where it stopped; with prefix caching, a cached block the device
evicts is copied to the host tier, and a prompt that finds its next blocks there (after those cached
on the device) gets them copied back instead of computing them. The copies (`to_host`, then
`to_device`) go to the runners with the next step, which makes them before its forward.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

from orca_backend.config import EngineConfig
from orca_backend.core.block_pool import Block, BlockKey, BlockPool, block_key, lora_root
from orca_backend.core.host_block_pool import HostBlockPool
from orca_backend.core.request import Request
from orca_backend.kv_groups import KVGroups, pages_needed


class KVCacheManager(ABC):
    def __init__(
        self, capacity_tokens: int, block_size: int = 16, enable_prefix_caching: bool = False,
        record_events: bool = False, host_blocks: int = 0, windows: tuple[int, ...] = (0,), step_tokens: int = 0,
    ) -> None:  # fmt: skip
        """`capacity_tokens`: the pool's blocks (pages: orca_backend/kv_groups.py) times `block_size`;
        `record_events`: the pool records what its prefix cache stores and evicts (K/V events);
        `host_blocks`: the host tier's blocks (0: none); `windows`: each K/V group's window, a block
        table per group (one: one table), the paged policy giving back blocks behind a window;
        `step_tokens`: the most tokens a step schedules (max_num_batched_tokens; 0: no limit)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        if not windows or min(windows) < 0:
            raise ValueError(f"K/V groups' windows must be >= 0 (0: none), got {list(windows)}")
        self.block_size = block_size
        self.windows = windows
        self.step_tokens = step_tokens
        grouped = len(windows) > 1
        # Each group's part of the keys its blocks are cached under (None: the pool has one group).
        self._group_ids: list[int | None] = list(range(len(windows))) if grouped else [None]
        self.pool = BlockPool(capacity_tokens // block_size, block_size, record_events, windows if grouped else ())
        self.enable_prefix_caching = enable_prefix_caching
        # Prefix-cache counters, in tokens: what admissions looked up, and what they found (on either tier).
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.host = HostBlockPool(host_blocks, block_size, self.pool.record, windows if grouped else ()) \
            if host_blocks else None  # fmt: skip
        if self.host is not None and enable_prefix_caching:
            self.pool.on_evict = self._offload
        # The copies the next step's runners make before its forward: (device block, host block) first,
        # then (host block, device block).
        self.to_host: list[tuple[int, int]] = []
        self.to_device: list[tuple[int, int]] = []
        # Host-tier counters, in blocks: swapped out and in (preemptions), and prefix blocks copied back.
        self.swapped_out_blocks = 0
        self.swapped_in_blocks = 0
        self.host_hit_blocks = 0

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.pool.num_blocks * self.block_size

    @property
    def used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free

    @property
    def used_tokens(self) -> int:
        return self.used_blocks * self.block_size

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def fits_ever(self, request: Request) -> bool:
        """Whether the request can run to `max_tokens` in an empty pool; if not, queueing it would
        wait (or be preempted) forever."""
        return pages_needed(self.windows, request.max_total_tokens, self.block_size, self.step_tokens) <= self.num_blocks

    @abstractmethod
    def _tokens_at_admission(self, request: Request, num_computed: int, step_tokens: int) -> int:
        """How many of the request's tokens get blocks when it is admitted, `num_computed` of them
        cached and at most `step_tokens` computed by its first step."""

    def _watermark_blocks(self) -> int:
        return 0

    def admit(self, request: Request, others_running: bool, fork_of: Request | None = None,
              step_tokens: int = 0) -> bool:  # fmt: skip
        """Gives a waiting request its block tables if the pool allows; False leaves it untouched.

        Cached prefix blocks are shared and count as computed (`request.num_computed`); in a windowed
        group, only those its window still reads. The watermark is only kept while `others_running`:
        alone, a request that fits is admitted. `step_tokens`: the most its first step may compute
        (0: no limit). `fork_of`: a request that has computed all of this one's prompt but its last
        token (sample 0 of the same request with n > 1) and given back nothing behind a window: its
        blocks wholly before that token are shared, and its partly filled block there is copied into a
        block of this one's own (copy-on-write), recorded in `request.block_copies` for the runners;
        this one computes its last prompt token alone.
        """
        if request.host_tables:
            return self._swap_in(request, others_running, step_tokens)
        groups = range(self.num_groups)
        if fork_of is not None:
            computed = request.num_prompt_tokens - 1
            count = computed // self.block_size
            starts = [0] * self.num_groups
            device: list[list[int | None]] = [list(table[:count]) for table in fork_of.block_tables]
            host: list[list[int | None]] = [[None] * count for _ in groups]
        else:
            count, starts, device, host = self._prefix_hits(request)
            computed = count * self.block_size
        fresh = self.blocks_for(self._tokens_at_admission(request, computed, step_tokens)) - count
        hits = [block for found in device for block in found if block is not None]
        new_blocks = self.num_groups * fresh + sum(block is not None for found in host for block in found)
        from_free = new_blocks + sum(self.pool.blocks[b].ref_count == 0 for b in hits)
        if from_free + (self._watermark_blocks() if others_running else 0) > self.pool.num_free:
            return False
        for block_id in hits:
            self.pool.share(block_id)
        blocks = iter(self.pool.allocate(new_blocks))
        keys = self._block_keys(request, count) if any(b is not None for found in host for b in found) else []
        request.block_tables = []
        for g in groups:
            table = [-1] * starts[g]
            for index, (on_device, on_host) in enumerate(zip(device[g], host[g], strict=True), start=starts[g]):
                if on_device is None:  # copied back before the step's forward, and cached on the device again
                    assert on_host is not None
                    on_device = next(blocks)
                    self.to_device.append((on_host, on_device))
                    self.host_hit_blocks += 1
                    self.pool.cache(on_device, (keys[index], self._group_ids[g]), index == 0, request.lora)
                table.append(on_device)
            request.block_tables.append(table + [next(blocks) for _ in range(fresh)])
        request.num_dropped_blocks = starts
        request.num_computed = computed
        request.num_registered_blocks = count
        if fork_of is not None:
            if computed % self.block_size:
                request.block_copies = [(source[count], table[count])
                                        for source, table in zip(fork_of.block_tables, request.block_tables, strict=True)]  # fmt: skip
        elif self._reads_prefix_cache(request):
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += request.num_computed
        return True

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Makes room for the request's next `num_new_tokens` after those already scheduled, in every
        group; False if the pool has too few free blocks (never under reservation, whose blocks were
        all taken at admission)."""
        missing = self.blocks_for(request.num_scheduled + num_new_tokens) - request.num_blocks
        if missing <= 0:
            return True
        if missing * self.num_groups > self.pool.num_free:
            return False
        for table in request.block_tables:
            table += self.pool.allocate(missing)
        return True

    def trim(self, request: Request) -> bool:
        """Speculative decoding, after a step landed: gives back the blocks past the request's tokens
        (taken for proposed tokens that were rejected; never registered, as they hold no computed
        token). True if its tables shrank. Under reservation a table is the reservation, and stays."""
        keep = self.blocks_for(request.num_tokens)
        if request.num_blocks <= keep:
            return False
        for table in request.block_tables:
            self.pool.release(table[keep:])
            del table[keep:]
        return True

    def free(self, request: Request) -> None:
        """Returns everything the request holds, on either tier; a no-op for a request holding nothing."""
        for table, dropped in zip(request.block_tables, request.num_dropped_blocks, strict=True):
            self.pool.release(table[dropped:])
        if request.host_tables:
            assert self.host is not None
            for table in request.host_tables:
                self.host.give_back(table)
            request.host_tables = []
        request.block_tables = []
        request.num_registered_blocks = 0
        request.num_dropped_blocks = []

    def swap_out(self, request: Request) -> bool:
        """Preemption by swapping: the request's blocks are copied to host blocks (`to_host`) and go
        back to the device pool; it keeps its computed tokens. False, with nothing done, without a
        host tier or room there for them (evicting host-cached prefixes as needed)."""
        held = [table[dropped:] for table, dropped in zip(request.block_tables, request.num_dropped_blocks, strict=True)]
        total = sum(map(len, held))
        if self.host is None or not total or total > self.host.available():
            return False
        request.host_tables = [self.host.take(len(blocks)) for blocks in held]
        for blocks, host_blocks in zip(held, request.host_tables, strict=True):
            self.to_host += zip(blocks, host_blocks, strict=True)
            self.pool.release(blocks)
        request.block_tables = []
        request.num_registered_blocks = 0
        self.swapped_out_blocks += total
        return True

    def _swap_in(self, request: Request, others_running: bool, step_tokens: int) -> bool:
        """A swapped request admitted again: fresh device blocks for its tables (the dropped entries
        stay -1), its host blocks' K/V copied into them (`to_device`) and given back; its full blocks
        are cached prefixes again."""
        length = self.blocks_for(self._tokens_at_admission(request, request.num_computed, step_tokens))
        needed = [max(length - dropped, len(host_blocks))
                  for dropped, host_blocks in zip(request.num_dropped_blocks, request.host_tables, strict=True)]  # fmt: skip
        if sum(needed) + (self._watermark_blocks() if others_running else 0) > self.pool.num_free:
            return False
        assert self.host is not None
        request.block_tables = []
        for count, dropped, host_blocks in zip(needed, request.num_dropped_blocks, request.host_tables, strict=True):
            blocks = self.pool.allocate(count)
            self.to_device += zip(host_blocks, blocks, strict=False)
            self.host.give_back(host_blocks)
            self.swapped_in_blocks += len(host_blocks)
            request.block_tables.append([-1] * dropped + blocks)
        request.host_tables = []
        self.register_computed(request)
        return True

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies for the step being sent ((device, host) pairs, then (host, device) ones); the
        host tier's blocks that step reads or gave back become usable again for the next."""
        transfers = self.to_host, self.to_device
        self.to_host, self.to_device = [], []
        if self.host is not None:
            self.host.end_step()
        return transfers

    def _offload(self, block: Block) -> None:
        """A cached block the device pool evicts: to a host block, if the host tier has room."""
        assert self.host is not None and block.key is not None
        host = self.host.store(block.key, block.first, block.lora)
        if host is not None:
            self.to_host.append((block.block_id, host))

    def register_computed(self, request: Request) -> None:
        """After a step landed: the request's blocks that are now full and computed become cached
        prefixes, in every group (a no-op without prefix caching)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        keys = self._block_keys(request, num_full)
        for table, dropped, group in zip(request.block_tables, request.num_dropped_blocks, self._group_ids, strict=True):
            for index in range(max(request.num_registered_blocks, dropped), num_full):
                self.pool.cache(table[index], (keys[index], group), first=index == 0, lora=request.lora)
        request.num_registered_blocks = num_full

    def _reads_prefix_cache(self, request: Request) -> bool:
        """Whether the request looks its prompt up in the prefix cache. One asking for prompt logprobs
        does not (a cached prefix has no logits; vLLM's rule), nor does an embedding request (its
        pooling reads the hidden states of its prompt's tokens): each computes its whole prompt, and
        its blocks are cached for others as any request's."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None and request.pooling is None

    def _window_start(self, group: int, num_computed: int) -> int:
        """The first block a group still reads once `num_computed` tokens are computed: every position
        yet to compute is at least `num_computed`, and a query at p sees p - window + 1 .. p."""
        window = self.windows[group]
        return max(num_computed - window + 1, 0) // self.block_size if window else 0

    def _prefix_hits(self, request: Request) -> tuple[int, list[int], list[list[int | None]], list[list[int | None]]]:
        """The most leading blocks of the request's tokens, stopping short of its last token, that are
        cached for every group where it reads them (a global group: all of them; a windowed one: those
        its window still reads after them): (count, each group's first block read, and per group, for
        each block from there, the device block caching it or None, the host block where the device
        has none or None). A host hit is pinned for this step (HostBlockPool.lookup)."""
        groups = range(self.num_groups)
        if not self._reads_prefix_cache(request):
            return 0, [0] * self.num_groups, [[] for _ in groups], [[] for _ in groups]
        keys = self._block_keys(request, (request.num_tokens - 1) // self.block_size)

        def found(group: int, index: int) -> bool:
            key = (keys[index], self._group_ids[group])
            return self.pool.lookup(key) is not None or (self.host is not None and self.host.peek(key) is not None)

        count = len(keys)
        for g in groups:  # a global group: its first block that is cached nowhere
            if not self.windows[g]:
                count = next((i for i in range(count) if not found(g, i)), count)
        while count and not all(found(g, i) for g in groups if self.windows[g]
                                for i in range(self._window_start(g, count * self.block_size), count)):  # fmt: skip
            count -= 1
        starts = [self._window_start(g, count * self.block_size) for g in groups]
        device: list[list[int | None]] = [[] for _ in groups]
        host: list[list[int | None]] = [[] for _ in groups]
        for g in groups:
            for index in range(starts[g], count):
                key = (keys[index], self._group_ids[g])
                on_device = self.pool.lookup(key)
                device[g].append(on_device)
                host[g].append(self.host.lookup(key) if on_device is None and self.host is not None else None)
        return count, starts, device, host

    def _block_keys(self, request: Request, num_blocks: int) -> list[BlockKey]:
        """The keys of the request's first `num_blocks` full blocks, computed once per request."""
        keys = request.block_keys
        if len(keys) < num_blocks:
            tokens, size = request.all_token_ids(), self.block_size
            root = lora_root(request.lora.lora_id) if request.lora is not None else 0
            for index in range(len(keys), num_blocks):
                keys.append(block_key(keys[-1] if keys else None, tuple(tokens[index * size : (index + 1) * size]), root))
        return keys


class ReservationKVManager(KVCacheManager):
    """ORCA: every token the request may ever have gets its block at admission."""

    def _tokens_at_admission(self, request: Request, num_computed: int, step_tokens: int) -> int:
        return request.max_total_tokens

    def trim(self, request: Request) -> bool:
        return False


class PagedKVManager(KVCacheManager):
    """vLLM: blocks for the tokens the request has now; decoding grows the tables a block at a time;
    windowed groups give back the blocks behind their window."""

    def __init__(
        self, capacity_tokens: int, block_size: int = 16, enable_prefix_caching: bool = False, watermark: float = 0.01,
        record_events: bool = False, host_blocks: int = 0, windows: tuple[int, ...] = (0,), step_tokens: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(capacity_tokens, block_size, enable_prefix_caching, record_events, host_blocks, windows,
                         step_tokens)  # fmt: skip
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        self.watermark = watermark
        self.windowed = any(windows)

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        if self.windowed:
            self._drop_outside_window(request)
        return super().grow(request, num_new_tokens)

    def _drop_outside_window(self, request: Request) -> None:
        """Releases, in each windowed group, the leading blocks it does not read again
        (`_window_start`). Such a block is full and computed, so it was registered as a cached
        prefix first (with prefix caching on): it stays cached, evictable, as any released block does."""
        for g, table in enumerate(request.block_tables):
            end, start = self._window_start(g, request.num_computed), request.num_dropped_blocks[g]
            if end > start:
                self.pool.release(table[start:end])
                table[start:end] = [-1] * (end - start)
                request.num_dropped_blocks[g] = end

    def _tokens_at_admission(self, request: Request, num_computed: int, step_tokens: int) -> int:
        """The tokens it has; with a windowed group, only those its first step computes (its next
        chunks grow the tables step by step, as the windowed groups give blocks back), so a long
        prompt never holds all its blocks in every group."""
        if self.windowed and step_tokens:
            return min(request.num_tokens, num_computed + step_tokens)
        return request.num_tokens

    def _watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


def make_kv_manager(config: EngineConfig, groups: KVGroups, host_blocks: int = 0) -> KVCacheManager:
    """The K/V manager `config.kv_policy` names, over the pages of `config.kv_capacity_tokens` slots of
    one table cut into `groups`' pages; `host_blocks`: the host tier's (swap_space; 0: none)."""
    events = config.kv_events()
    record = events is not None and events.enable_kv_cache_events
    size = int(config.block_size)
    capacity = groups.num_pages(int(config.kv_capacity_tokens) // size) * size
    step_tokens = int(config.max_num_batched_tokens)
    if config.kv_policy == "reserve":
        return ReservationKVManager(capacity, size, config.enable_prefix_caching, record, host_blocks, groups.windows,
                                    step_tokens)  # fmt: skip
    if config.kv_policy == "paged":
        return PagedKVManager(capacity, size, config.enable_prefix_caching, config.kv_watermark, record, host_blocks,
                              groups.windows, step_tokens)  # fmt: skip
    raise ValueError(f"kv_policy must be 'reserve' or 'paged', got {config.kv_policy!r}")
