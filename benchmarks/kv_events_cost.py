"""What K/V events cost a step (core/kv_events.py): the engine loop's part (taking the pool's events and
queueing them) and the publisher thread's (encoding the batch as vLLM's msgpack and sending it on the
PUB socket), for steps that store and evict 1, 16 and 256 blocks of 16 tokens.

    python benchmarks/kv_events_cost.py [--out docs/bench/kv/kv-events-cost.json]

Each figure is the median of --repeats timings of --steps steps, in µs per step; the JSON holds every
timing, the machine and the commit.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "client"))

from orca_backend.config import KVEventsConfig  # noqa: E402
from orca_backend.core.block_pool import BlockPool, block_key  # noqa: E402
from orca_backend.core.kv_events import ZmqEventPublisher, encode_batch  # noqa: E402
from orca_client import machine  # noqa: E402

BLOCK = 16


def step_events(pool: BlockPool, blocks: int, step: int) -> None:
    """One step's worth of pool work that records `blocks` stores (and, once the pool is full, as
    many evictions): the events a step of that many newly full blocks makes."""
    ids = pool.allocate(blocks)
    parent = None
    for i, block_id in enumerate(ids):
        key = block_key(parent, tuple(range(step * 1000 + i * BLOCK, step * 1000 + (i + 1) * BLOCK)))
        pool.cache(block_id, key, first=parent is None)
        parent = key
    pool.release(ids)


def measure(blocks: int, steps: int, publisher: ZmqEventPublisher) -> dict[str, float]:
    pool = BlockPool(4 * blocks, BLOCK, record_events=True)
    for step in range(8):  # fill the pool, so that every measured step evicts too
        step_events(pool, blocks, step)
    pool.take_events()
    loop_s = encode_s = 0.0
    for step in range(steps):
        step_events(pool, blocks, 100 + step)
        started = time.perf_counter()
        events = pool.take_events()
        publisher.publish(events)  # the loop's part: one queue put
        loop_s += time.perf_counter() - started
        started = time.perf_counter()
        encode_batch(time.time(), events, 0)  # the publisher thread's encoding (it also sends)
        encode_s += time.perf_counter() - started
    return {"loop_us": loop_s / steps * 1e6, "encode_us": encode_s / steps * 1e6, "events": len(events)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    endpoint = f"ipc://{tempfile.mkdtemp(prefix='orca-kv-events-')}/pub"
    publisher = ZmqEventPublisher(KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint))
    results = {}
    try:
        for blocks in (1, 16, 256):
            runs = [measure(blocks, args.steps if blocks < 256 else args.steps // 10, publisher)
                    for _ in range(args.repeats)]  # fmt: skip
            results[blocks] = {"runs": runs, "events_per_step": runs[0]["events"],
                               "loop_us_median": statistics.median(r["loop_us"] for r in runs),
                               "encode_us_median": statistics.median(r["encode_us"] for r in runs)}  # fmt: skip
            r = results[blocks]
            print(f"{blocks:>4} blocks stored a step ({r['events_per_step']} events): engine loop "
                  f"{r['loop_us_median']:.1f} us, encoding {r['encode_us_median']:.1f} us (publisher thread)")
    finally:
        publisher.shutdown()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"command": " ".join(sys.argv), "commit": machine.code_revision(ROOT),
                                        "machine": machine.summary(), "results": results}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
