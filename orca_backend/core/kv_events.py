"""K/V cache events for KV-aware routers: what the prefix cache stores and evicts, published as vLLM's
event stream, so a router in front of several replicas (Dynamo's KV router, llm-d's precise-prefix
scorer) sends each request to the replica that holds its prefix.

The block pool records an event whenever a full, computed block becomes a cached prefix
(`BlockStored`: its hash, its parent's, its token ids) and whenever a cached block is evicted to be
reused (`BlockRemoved`); the engine core publishes each step's events as one batch. The stream is
vLLM's (`vllm/distributed/kv_events.py`, read at 0181ea31): a ZMQ PUB socket sends multipart
messages (topic, an 8-byte big-endian sequence number, the batch), the batch encoded as msgpack the
way msgspec encodes vLLM's structs — `EventBatch` a map {ts, events, data_parallel_rank}, each event a
map tagged with its class name under "type", fields in declaration order, fields equal to their
default left out. A ROUTER socket (`replay_endpoint`) answers a request (an 8-byte start sequence
number) with every buffered batch from there, then an end marker (sequence -1, empty payload): a
subscriber that joined late, or missed messages, catches up from it.

Block hashes are this engine's (the hash of a block's key: core/block_pool.py), opaque to a router,
which matches stored and removed blocks by them and prefixes by their token ids. The events exist
only with prefix caching on, as in vLLM.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import msgpack

from orca_backend.config import KVEventsConfig

logger = logging.getLogger("orca.engine")

MEDIUM_GPU = "GPU"  # vLLM's name for the device tier, whatever the device (it has no other for one)
MEDIUM_CPU = "CPU"  # vLLM's name for the host tier (its CPU offloading; here swap_space)


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    # The block's K/V group (orca_backend/kv_groups.py) when the pool has several, with its kind and
    # window as vLLM names them; None (left out) with one group.
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
# The fields vLLM declares with a default (None), which msgspec leaves out while they hold it.
OPTIONAL_FIELDS: dict[type, tuple[str, ...]] = {
    BlockStored: ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"),
    BlockRemoved: ("group_idx",),
}


def encode_batch(ts: float, events: list[KVCacheEvent], data_parallel_rank: int | None) -> bytes:
    """One batch as msgspec encodes vLLM's KVEventBatch (module docstring). vLLM's optional trailing
    fields (extra_keys, group_idx, the spec kind and window) are left out where they hold their
    default, None, as msgspec leaves them: this engine has no extra keys, and names groups only when
    its pool has several."""
    batch: dict[str, Any] = {"ts": ts, "events": [_event_map(event) for event in events]}
    if data_parallel_rank is not None:
        batch["data_parallel_rank"] = data_parallel_rank
    return msgpack.packb(batch)


def _event_map(event: KVCacheEvent) -> dict[str, Any]:
    """msgspec's map of a tagged struct: the tag, then every field in declaration order (a dataclass's
    __dict__ holds its fields in that order), the optional ones only where they differ from None."""
    fields = vars(event)
    optional = OPTIONAL_FIELDS.get(type(event), ())
    return {"type": type(event).__name__, **{k: v for k, v in fields.items() if v is not None or k not in optional}}


class ZmqEventPublisher:
    """PUB socket plus an optional ROUTER for replay, fed from a queue by a thread of its own: the
    engine loop only appends a batch to the queue."""

    END_SEQ = (-1).to_bytes(8, "big", signed=True)

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0) -> None:
        import zmq  # pyzmq: only an engine that publishes events needs it

        self._zmq = zmq
        self._rank = data_parallel_rank
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]] | None] = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self._topic = config.topic.encode()
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(config.hwm)
        # vLLM's rule: an address with a wildcard (or ipc/inproc) is bound, any other connected to.
        if any(mark in config.endpoint for mark in ("*", "::")) or config.endpoint.startswith(("ipc://", "inproc://")):
            self._pub.bind(config.endpoint)
        else:
            self._pub.connect(config.endpoint)
        self._replay = None
        if config.replay_endpoint:
            self._replay = self._context.socket(zmq.ROUTER)
            self._replay.bind(config.replay_endpoint)
        self._sequence = itertools.count()
        self._running = True
        self.dropped = 0  # batches refused because the queue was full (the publisher fell behind)
        self._thread = threading.Thread(target=self._run, name="orca-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: list[KVCacheEvent]) -> None:
        """Queues one step's events (never blocks the engine loop: a full queue drops the batch, counted)."""
        try:
            self._queue.put_nowait((time.time(), events))
        except queue.Full:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("K/V events: the publisher is behind; %d batches dropped", self.dropped)

    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Sends what is queued (for at most `timeout_s`), then closes the sockets."""
        self._running = False
        with contextlib.suppress(queue.Full):  # full: the thread stops when it sees _running is off
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout=timeout_s)
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _run(self) -> None:
        while True:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    logger.exception("K/V events: replay request failed")
            try:
                item = self._queue.get(timeout=0.05)
            except queue.Empty:
                if not self._running:
                    return
                continue
            if item is None:
                return
            ts, events = item
            sequence = next(self._sequence)
            payload = encode_batch(ts, events, self._rank)
            try:
                self._pub.send_multipart((self._topic, sequence.to_bytes(8, "big"), payload))
            except Exception:  # noqa: BLE001 - the replay buffer still has it
                logger.exception("K/V events: publishing batch %d failed", sequence)
            self._buffer.append((sequence, payload))

    def _answer_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            logger.warning("K/V events: a replay request of %d frames, not 3 (identity, empty, start)", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for sequence, payload in list(self._buffer):
            if sequence >= first:
                self._replay.send_multipart((client, b"", sequence.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", self.END_SEQ, b""))


def make_publisher(config: KVEventsConfig | None) -> ZmqEventPublisher | None:
    """The publisher the config asks for, or None (events off, or the `null` publisher)."""
    if config is None or not config.enable_kv_cache_events or config.publisher == "null":
        return None
    return ZmqEventPublisher(config)
