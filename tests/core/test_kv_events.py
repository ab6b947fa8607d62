"""K/V events for KV-aware routers (core/kv_events.py): the prefix cache's stores and evictions,
published on ZMQ as vLLM's event stream. A subscriber that knows only the events rebuilds the cache's
contents exactly, after joins, ends, preemptions and evictions; the wire format is checked by a
decoder written from vLLM's msgspec definitions (vllm/distributed/kv_events.py @ 0181ea31)."""

from __future__ import annotations

import json
import random
import tempfile
from pathlib import Path
from typing import Any

import msgpack
import pytest
from serving_utils import wait_until

from orca_backend.config import EngineConfig, KVEventsConfig
from orca_backend.core.block_pool import BlockPool, block_key, lora_root
from orca_backend.core.kv_events import encode_batch
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.lora import LoRARequest
from orca_backend.sampling_params import SamplingParams

zmq = pytest.importorskip("zmq")

# vLLM's structs as msgspec encodes them (tag field "type", fields in declaration order, fields with a
# default omitted when they hold it): (required fields, optional fields with their defaults).
SCHEMA = {
    "BlockStored": (("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium", "lora_name"),
                    ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window")),
    "BlockRemoved": (("block_hashes", "medium"), ("group_idx",)),
    "AllBlocksCleared": ((), ()),
}  # fmt: skip


def is_hash(value: Any) -> bool:  # ExternalBlockHash: bytes | int
    return isinstance(value, bytes | int) and not isinstance(value, bool)


def decode(payload: bytes) -> tuple[float, list[dict[str, Any]], int | None]:
    """A KVEventBatch as vLLM's msgspec decoder would take it, or an AssertionError saying why not."""
    batch = msgpack.unpackb(payload)
    assert isinstance(batch, dict) and set(batch) <= {"ts", "events", "data_parallel_rank"}, batch
    assert isinstance(batch["ts"], float) and isinstance(batch["events"], list)
    for event in batch["events"]:
        assert isinstance(event, dict) and event.get("type") in SCHEMA, event
        required, optional = SCHEMA[event["type"]]
        assert list(event)[0] == "type" and list(event)[1 : 1 + len(required)] == list(required), event
        assert set(event) - {"type"} <= set(required) | set(optional), event
        if event["type"] == "BlockStored":
            assert all(map(is_hash, event["block_hashes"])) and event["block_hashes"]
            assert event["parent_block_hash"] is None or is_hash(event["parent_block_hash"])
            assert all(isinstance(t, int) for t in event["token_ids"])
            assert len(event["token_ids"]) == event["block_size"] * len(event["block_hashes"])
            assert event["lora_id"] is None or isinstance(event["lora_id"], int)
            assert event["medium"] in (None, "GPU", "CPU") and (event["lora_name"] is None or isinstance(event["lora_name"], str))
            kind, window = event.get("kv_cache_spec_kind"), event.get("kv_cache_spec_sliding_window")
            assert kind in (None, "full_attention", "sliding_window") and (window is None) == (kind != "sliding_window")
            assert ("group_idx" in event) == (kind is not None)  # a kind only where the pool has several groups
        elif event["type"] == "BlockRemoved":
            assert all(map(is_hash, event["block_hashes"])) and event["medium"] in (None, "GPU", "CPU")
        assert event.get("group_idx") is None or isinstance(event["group_idx"], int) and event["group_idx"] >= 0
    rank = batch.get("data_parallel_rank")
    assert rank is None or isinstance(rank, int)
    return batch["ts"], batch["events"], rank


class Subscriber:
    """A router's view: the cached blocks (medium, K/V group, hash) and their token ids, from the events
    alone."""

    def __init__(self) -> None:
        self.blocks: dict[Any, list[int]] = {}
        self.next_sequence = 0

    def apply(self, payload: bytes) -> None:
        for event in decode(payload)[1]:
            medium, group = event.get("medium"), event.get("group_idx")
            if event["type"] == "BlockStored":
                size = event["block_size"]
                for i, block_hash in enumerate(event["block_hashes"]):
                    assert (medium, group, block_hash) not in self.blocks, "stored twice without a removal"
                    # On the device a block of a global group is cached after its parent and evicted
                    # before it; a windowed group caches only what its window still reads; the host
                    # tier takes evicted blocks in eviction order, and may have dropped a parent since.
                    parent = event["parent_block_hash"]
                    windowed = event.get("kv_cache_spec_kind") == "sliding_window"
                    assert medium != "GPU" or windowed or parent is None or (medium, group, parent) in self.blocks \
                        or i > 0, "a block whose parent the router never saw stored"  # fmt: skip
                    self.blocks[medium, group, block_hash] = event["token_ids"][i * size : (i + 1) * size]
            elif event["type"] == "BlockRemoved":
                for block_hash in event["block_hashes"]:
                    assert (medium, group, block_hash) in self.blocks, "removed a block never stored"
                    del self.blocks[medium, group, block_hash]
            else:
                self.blocks.clear()

    def replay(self, socket: Any) -> None:
        """Everything published since the last replay, from the publisher's replay socket."""
        socket.send_multipart((b"", self.next_sequence.to_bytes(8, "big")))
        while True:
            _, sequence, payload = socket.recv_multipart()
            number = int.from_bytes(sequence, "big", signed=True)
            if number == -1:
                return
            assert number == self.next_sequence, "a gap or a repeat in the sequence"
            self.apply(payload)
            self.next_sequence += 1


@pytest.fixture
def endpoints():
    directory = Path(tempfile.mkdtemp(prefix="orca-ev"))
    yield f"ipc://{directory}/pub", f"ipc://{directory}/replay"


@pytest.mark.parametrize(("model", "host_blocks"), [("tiny", 0), ("tiny", 6), ("gemma2-tiny", 6)])
def test_a_subscriber_rebuilds_the_prefix_cache_from_the_events_alone(tiny_checkpoint, endpoints, model, host_blocks):
    """Both tiers with a host tier (swap_space) of 6 blocks: evicted prefixes stored on the host and
    dropped from it, swapped preemptions; the router's view is the device's and the host's caches.
    Gemma 2's local and global layers make two K/V groups (events name them), generating past the
    32-token window so that the local group gives blocks back."""
    pub, replay = endpoints
    grouped = model != "tiny"
    model = model if grouped else str(tiny_checkpoint[0])
    events = json.dumps({"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay,
                         "topic": "kv"})  # fmt: skip
    # A pool of 12 blocks of 4 for requests of up to 20 tokens: prefixes are cached, evicted to make room,
    # and paged growth preempts.
    probe = EngineConfig(model=model, block_size=4)
    block_bytes = probe.kv_bytes_per_token(probe.model_config()) * 4
    engine = LLMEngine(EngineConfig(model=model, kv_policy="paged", block_size=4,
                                    kv_capacity_tokens=96 if grouped else 48, max_num_seqs=4, enable_prefix_caching=True,
                                    max_num_batched_tokens=8 if grouped else 0,
                                    kv_events_config=events, swap_space=host_blocks * block_bytes / 2**30))  # fmt: skip
    assert engine.core.kv.num_groups == (2 if grouped else 1)
    context = zmq.Context.instance()
    live = context.socket(zmq.SUB)
    live.setsockopt(zmq.SUBSCRIBE, b"kv")
    live.connect(pub)
    asker = context.socket(zmq.DEALER)
    asker.connect(replay)
    router = Subscriber()
    rng = random.Random(0)
    shared = [[rng.randrange(1, 50) for _ in range(8)] for _ in range(3)]
    try:
        for round_ in range(4):
            prompts = [rng.choice(shared) + [rng.randrange(1, 50) for _ in range(rng.randrange(1, 5))] for _ in range(6)]
            longest = 48 if grouped else 8
            streams = [engine.add_request(p, SamplingParams(max_tokens=rng.randrange(2, longest), temperature=0.0,
                                                            ignore_eos=True)) for p in prompts]  # fmt: skip
            while engine.has_work():
                engine.step()
            assert all(list(s)[-1].finished for s in streams)
            kv = engine.core.kv
            expected = {("GPU", group, hash(key)): list(key[1]) for key, group in kv.pool._cached}
            if kv.host is not None:
                expected |= {("CPU", group, hash(key)): list(key[1]) for key, group in kv.host._cached}
            assert not grouped or {group for _, group, _ in expected} == {0, 1}
            assert wait_until(lambda want=expected: router.replay(asker) or router.blocks == want, timeout_s=60), (
                round_, len(router.blocks), len(expected))
        stats = engine.stats()
        assert stats.num_preemptions > 0, "the workload was meant to preempt"
        if host_blocks:
            assert stats.kv_host_hit_blocks > 0 and stats.kv_swapped_out_blocks > 0, "and to use the host tier"
        assert router.next_sequence > 4
        # The live stream carries the same batches, framed (topic, 8-byte sequence, payload).
        topic, sequence, payload = live.recv_multipart()
        assert topic == b"kv" and len(sequence) == 8
        decode(payload)
    finally:
        live.close(linger=0)
        asker.close(linger=0)
        engine.shutdown()


def test_evictions_and_stores_are_recorded_in_order_with_parents_and_adapters():
    pool = BlockPool(2, block_size=2, record_events=True)
    lora = LoRARequest("A", 7, "/adapters/A")
    first = block_key(None, (1, 2), lora_root(7))
    second = block_key(first, (3, 4))
    blocks = pool.allocate(2)
    pool.cache(blocks[0], (first, None), first=True, lora=lora)
    pool.cache(blocks[1], (second, None), lora=lora)
    pool.cache(blocks[1], (second, None), lora=lora)  # already cached: no second event
    pool.release(blocks)
    pool.allocate(1)  # evicts the least recently freed: the last block, released first
    stored_first, stored_second, removed = pool.take_events()
    assert (stored_first.parent_block_hash, stored_second.parent_block_hash) == (None, hash(first))
    assert (stored_second.lora_id, stored_second.lora_name, stored_second.token_ids) == (7, "A", [3, 4])
    assert removed.block_hashes == [hash(second)]
    assert pool.take_events() == [] and pool.cached_hashes() == {(hash(first), None)}
    assert BlockPool(2).take_events() == []  # not recording: nothing kept


def test_the_wire_format_follows_vllms_structs():
    from orca_backend.core.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

    payload = encode_batch(12.5, [BlockStored([11], None, [1, 2], 2, None, "GPU", None), BlockRemoved([11], "GPU"),
                                  AllBlocksCleared()], 0)  # fmt: skip
    ts, events, rank = decode(payload)
    assert (ts, rank, [e["type"] for e in events]) == (12.5, 0, ["BlockStored", "BlockRemoved", "AllBlocksCleared"])
    assert "data_parallel_rank" not in msgpack.unpackb(encode_batch(1.0, [], None))  # omitted at its default
    grouped = encode_batch(1.0, [BlockStored([11], None, [1, 2], 2, None, "GPU", None, group_idx=1,
                                             kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=32),
                                 BlockRemoved([11], "GPU", group_idx=1)], None)  # fmt: skip
    stored, removed = decode(grouped)[1]
    assert list(stored)[-3:] == ["group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"]
    assert (stored["group_idx"], stored["kv_cache_spec_sliding_window"], removed["group_idx"]) == (1, 32, 1)
    assert "group_idx" not in events[0] and "extra_keys" not in events[0]  # one group: left out


@pytest.mark.parametrize(("text", "message"), [
    ('{"enable_kv_cache_events": true, "publisher": "kafka"}', "publisher must be 'zmq' or 'null'"),
    ('{"enable_kv_events": true}', "unknown field(s) enable_kv_events"),
    ('{"buffer_steps": 0}', "buffer_steps must be an integer >= 1"),
    ("[1]", "a JSON object"),
])  # fmt: skip
def test_a_bad_kv_events_config_is_refused_naming_the_field(text, message):
    with pytest.raises(ValueError, match="kv_events_config") as failure:
        KVEventsConfig.from_json(text)
    assert message in str(failure.value)


def test_events_need_the_prefix_cache():
    with pytest.raises(ValueError, match="set enable_prefix_caching"):
        EngineConfig(kv_events_config='{"enable_kv_cache_events": true, "publisher": "zmq"}')
