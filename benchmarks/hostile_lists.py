"""A bystander's engine step beside requests that carry the longest per-request token lists the
validation allows (1,024 stop_token_ids each, banned until min_tokens), against the same batch with
plain requests: issue #29's "one request slows every iteration" measure.

    .venv/bin/python benchmarks/hostile_lists.py [--rounds 3] [--steps 150]

Prints the median step of each round, interleaved (plain, hostile, plain, ...), and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

from orca_backend import EngineConfig, SamplingParams
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.model.checkpoint import write_random_checkpoint
from orca_backend.sampling_params import MAX_STOP_TOKEN_IDS
from orca_client import machine

VOCAB = 4096
BYSTANDERS, HOSTILE = 8, 4


def median_step_ms(model_dir: Path, hostile: bool, steps: int) -> float:
    engine = LLMEngine(EngineConfig(model=str(model_dir), kv_capacity_tokens=65536))
    plain = SamplingParams(max_tokens=steps + 50, temperature=0.0, ignore_eos=True)
    banned = SamplingParams(max_tokens=steps + 50, min_tokens=steps + 50, temperature=0.0, ignore_eos=True,
                            stop_token_ids=list(range(1, MAX_STOP_TOKEN_IDS + 1)))  # fmt: skip
    engine.add_requests([[1, 2, 3]] * BYSTANDERS, plain)
    engine.add_requests([[4, 5]] * HOSTILE, banned if hostile else plain)
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    engine.shutdown()
    return 1e3 * statistics.median(times[20:])  # past admission and the first prefills


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150)
    args = ap.parse_args()
    print(f"machine: {machine.summary()}")
    model_dir = Path(tempfile.mkdtemp(prefix="orca-hostile-"))
    write_random_checkpoint(model_dir, GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=64, n_layer=2, n_head=4,
                                                  initializer_range=0.3), seed=0, tokenizer=False)  # fmt: skip
    ratios = []
    for round_ in range(args.rounds):
        plain, hostile = median_step_ms(model_dir, False, args.steps), median_step_ms(model_dir, True, args.steps)
        ratios.append(hostile / plain)
        print(f"round {round_}: {BYSTANDERS} + {HOSTILE} plain {plain:.3f} ms/step; {BYSTANDERS} + {HOSTILE} with "
              f"{MAX_STOP_TOKEN_IDS} banned ids each {hostile:.3f} ms/step; ratio {hostile / plain:.2f}")
    print(f"ratio over {args.rounds} rounds: {min(ratios):.2f}-{max(ratios):.2f} (target <= 2)")


if __name__ == "__main__":
    main()
