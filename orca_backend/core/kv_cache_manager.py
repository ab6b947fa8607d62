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

from orca_backend.config import EngineConfig, fits_in_pool
from orca_backend.core.block_pool import Block, BlockKey, BlockPool, block_key, lora_root
from orca_backend.core.host_block_pool import HostBlockPool
from orca_backend.core.request import Request


class KVCacheManager(ABC):
    def __init__(self, capacity_tokens: int, block_size: int = 16, enable_prefix_caching: bool = False,
                 record_events: bool = False, host_blocks: int = 0) -> None:  # fmt: skip
        """`record_events`: the pool records what its prefix cache stores and evicts (K/V events);
        `host_blocks`: the host tier's blocks (0: none)."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.pool = BlockPool(capacity_tokens // block_size, block_size, record_events)
        self.enable_prefix_caching = enable_prefix_caching
        # Prefix-cache counters, in tokens: what admissions looked up, and what they found (on either tier).
        self.prefix_queried_tokens = 0
        self.prefix_hit_tokens = 0
        self.host = HostBlockPool(host_blocks, block_size, self.pool.record) if host_blocks else None
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
        return fits_in_pool(request.max_total_tokens, self.capacity_tokens, self.block_size)

    @abstractmethod
    def _tokens_at_admission(self, request: Request) -> int:
        """How many of the request's tokens get blocks when it is admitted."""

    def _watermark_blocks(self) -> int:
        return 0

    def admit(self, request: Request, others_running: bool, fork_of: Request | None = None) -> bool:
        """Gives a waiting request its block table if the pool allows; False leaves it untouched.

        Cached prefix blocks are shared and count as computed (`request.num_computed`). The
        watermark is only kept while `others_running`: alone, a request that fits is admitted.
        `fork_of`: a request that has computed all of this one's prompt but its last token (sample 0
        of the same request with n > 1): its blocks wholly before that token are shared, and its
        partly filled block there is copied into a block of this one's own (copy-on-write), recorded
        in `request.block_copy` for the runners; this one computes its last prompt token alone.
        """
        if request.host_table:
            return self._swap_in(request, others_running)
        host_hits: list[int] = []
        if fork_of is not None:
            computed = request.num_prompt_tokens - 1
            hits = fork_of.block_table[: computed // self.block_size]
        else:
            hits, host_hits = self._prefix_hits(request)
            computed = (len(hits) + len(host_hits)) * self.block_size
        new_blocks = self.blocks_for(self._tokens_at_admission(request)) - len(hits)
        from_free = new_blocks + sum(self.pool.blocks[b].ref_count == 0 for b in hits)
        if from_free + (self._watermark_blocks() if others_running else 0) > self.pool.num_free:
            return False
        for block_id in hits:
            self.pool.share(block_id)
        request.block_table = hits + self.pool.allocate(new_blocks)
        request.num_computed = computed
        request.num_registered_blocks = len(hits)
        if host_hits:  # copied back before the step's forward, and cached on the device again
            self.to_device += zip(host_hits, request.block_table[len(hits) :], strict=False)
            self.host_hit_blocks += len(host_hits)
            self.register_computed(request)
        if fork_of is not None:
            if computed % self.block_size:
                request.block_copy = (fork_of.block_table[len(hits)], request.block_table[len(hits)])
        elif self._reads_prefix_cache(request):
            self.prefix_queried_tokens += request.num_tokens
            self.prefix_hit_tokens += request.num_computed
        return True

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Makes room for the request's next `num_new_tokens` after those already scheduled; False if
        the pool has too few free blocks (never under reservation, whose blocks were all taken at
        admission)."""
        missing = self.blocks_for(request.num_scheduled + num_new_tokens) - len(request.block_table)
        if missing <= 0:
            return True
        if missing > self.pool.num_free:
            return False
        request.block_table += self.pool.allocate(missing)
        return True

    def trim(self, request: Request) -> bool:
        """Speculative decoding, after a step landed: gives back the blocks past the request's tokens
        (taken for proposed tokens that were rejected; never registered, as they hold no computed
        token). True if its table shrank. Under reservation a table is the reservation, and stays."""
        keep = self.blocks_for(request.num_tokens)
        extra = request.block_table[keep:]
        if not extra:
            return False
        self.pool.release(extra)
        del request.block_table[keep:]
        return True

    def free(self, request: Request) -> None:
        """Returns everything the request holds, on either tier; a no-op for a request holding nothing."""
        self.pool.release(request.block_table[request.num_dropped_blocks :])
        if request.host_table:
            assert self.host is not None
            self.host.give_back(request.host_table)
            request.host_table = []
        request.block_table = []
        request.num_registered_blocks = 0
        request.num_dropped_blocks = 0

    def swap_out(self, request: Request) -> bool:
        """Preemption by swapping: the request's blocks are copied to host blocks (`to_host`) and go
        back to the device pool; it keeps its computed tokens. False, with nothing done, without a
        host tier or room there for them (evicting host-cached prefixes as needed)."""
        held = request.block_table[request.num_dropped_blocks :]
        if self.host is None or not held or len(held) > self.host.available():
            return False
        request.host_table = self.host.take(len(held))
        self.to_host += zip(held, request.host_table, strict=True)
        self.pool.release(held)
        request.block_table = []
        request.num_registered_blocks = 0
        self.swapped_out_blocks += len(held)
        return True

    def _swap_in(self, request: Request, others_running: bool) -> bool:
        """A swapped request admitted again: fresh device blocks for its table (the dropped entries
        stay -1), its host blocks' K/V copied into them (`to_device`) and given back; its full blocks
        are cached prefixes again."""
        dropped = request.num_dropped_blocks
        needed = max(self.blocks_for(self._tokens_at_admission(request)) - dropped, len(request.host_table))
        if needed + (self._watermark_blocks() if others_running else 0) > self.pool.num_free:
            return False
        assert self.host is not None
        blocks = self.pool.allocate(needed)
        self.to_device += zip(request.host_table, blocks, strict=False)
        self.host.give_back(request.host_table)
        self.swapped_in_blocks += len(request.host_table)
        request.block_table = [-1] * dropped + blocks
        request.host_table = []
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
        prefixes (a no-op without prefix caching)."""
        if not self.enable_prefix_caching:
            return
        num_full = request.num_computed // self.block_size
        if num_full <= request.num_registered_blocks:
            return
        keys = self._block_keys(request, num_full)
        for index in range(max(request.num_registered_blocks, request.num_dropped_blocks), num_full):
            self.pool.cache(request.block_table[index], keys[index], first=index == 0, lora=request.lora)
        request.num_registered_blocks = num_full

    def _reads_prefix_cache(self, request: Request) -> bool:
        """Whether the request looks its prompt up in the prefix cache. One asking for prompt logprobs
        does not (a cached prefix has no logits; vLLM's rule), nor does an embedding request (its
        pooling reads the hidden states of its prompt's tokens): each computes its whole prompt, and
        its blocks are cached for others as any request's."""
        return self.enable_prefix_caching and request.params.prompt_logprobs is None and request.pooling is None

    def _prefix_hits(self, request: Request) -> tuple[list[int], list[int]]:
        """The cached blocks the request's tokens start with, stopping short of its last token: those
        on the device, then those that follow them on the host tier."""
        if not self._reads_prefix_cache(request):
            return [], []
        hits: list[int] = []
        host_hits: list[int] = []
        for key in self._block_keys(request, (request.num_tokens - 1) // self.block_size):
            block_id = self.pool.lookup(key) if not host_hits else None
            if block_id is not None:
                hits.append(block_id)
                continue
            host_block = self.host.lookup(key) if self.host is not None else None
            if host_block is None:
                break
            host_hits.append(host_block)
        return hits, host_hits

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

    def _tokens_at_admission(self, request: Request) -> int:
        return request.max_total_tokens

    def trim(self, request: Request) -> bool:
        return False


class PagedKVManager(KVCacheManager):
    """vLLM: blocks for the tokens the request has now; decoding grows the table a block at a time."""

    def __init__(
        self, capacity_tokens: int, block_size: int = 16, enable_prefix_caching: bool = False, watermark: float = 0.01,
        sliding_window: int = 0, record_events: bool = False, host_blocks: int = 0,
    ) -> None:  # fmt: skip
        super().__init__(capacity_tokens, block_size, enable_prefix_caching, record_events, host_blocks)
        if not 0.0 <= watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {watermark}")
        if sliding_window < 0:
            raise ValueError(f"sliding_window must be >= 0 (0: none), got {sliding_window}")
        self.watermark = watermark
        self.sliding_window = sliding_window  # every layer's window; 0: some layer sees every position

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        if self.sliding_window:
            self._drop_outside_window(request)
        return super().grow(request, num_new_tokens)

    def _drop_outside_window(self, request: Request) -> None:
        """Releases the leading blocks no layer reads again. Every position the request has yet to
        compute is at least `num_computed` (a step in flight, or run ahead, too), and a query at p
        sees positions p - window + 1 .. p, so a block wholly before num_computed - window + 1 is
        done with. Such a block is full and computed, so it was registered as a cached prefix first
        (with prefix caching on): it stays cached, evictable, as any released block does."""
        end = max(request.num_computed - self.sliding_window + 1, 0) // self.block_size
        start = request.num_dropped_blocks
        if end <= start:
            return
        table = request.block_table
        self.pool.release(table[start:end])
        table[start:end] = [-1] * (end - start)
        request.num_dropped_blocks = end

    def _tokens_at_admission(self, request: Request) -> int:
        return request.num_tokens

    def _watermark_blocks(self) -> int:
        return int(self.watermark * self.num_blocks)


def make_kv_manager(config: EngineConfig, kv_window: int = 0, host_blocks: int = 0) -> KVCacheManager:
    """The K/V manager `config.kv_policy` names, over `config.kv_capacity_tokens` slots. `kv_window`:
    the model's window on every layer (0: none), whose out-of-window blocks the paged policy frees;
    `host_blocks`: the host tier's (swap_space; 0: none)."""
    events = config.kv_events()
    record = events is not None and events.enable_kv_cache_events
    if config.kv_policy == "reserve":
        return ReservationKVManager(config.kv_capacity_tokens, config.block_size, config.enable_prefix_caching, record,
                                    host_blocks)  # fmt: skip
    if config.kv_policy == "paged":
        return PagedKVManager(config.kv_capacity_tokens, config.block_size, config.enable_prefix_caching,
                              config.kv_watermark, kv_window, record, host_blocks)  # fmt: skip
    raise ValueError(f"kv_policy must be 'reserve' or 'paged', got {config.kv_policy!r}")
