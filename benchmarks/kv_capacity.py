"""How many requests run at once in a fixed K/V memory, and what that does to throughput: the pool in
the model's dtype against an FP8 pool (kv_cache_dtype fp8) of the same bytes, side by side in one run.

    python benchmarks/kv_capacity.py                       # GPT-2-small geometry, float32, 2,048 float32 tokens of K/V
    python benchmarks/kv_capacity.py --model llama-150m --pool-tokens 4096 --repeat 3

Each configuration serves the same --requests requests (prompts of --prompt tokens, --output tokens
each, ignore_eos) with kv_cache_memory_bytes fixed to what --pool-tokens tokens take in the model's
dtype, under both K/V policies: `reserve` (ORCA's: prompt + max_tokens reserved at admission, so the
running batch is exactly what the pool holds) and `paged` (vLLM's: blocks as contexts grow, the
newest request preempted and recomputed when they run out). Reported per configuration: the peak
of running requests, the preemptions, output tokens/s (range over --repeat rounds, configurations
interleaved within a round). The weights are the preset's seeded random ones.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import time
from pathlib import Path

import orca_backend
from orca_backend import LLM, SamplingParams
from orca_backend.config import PRESETS, EngineConfig
from orca_client import machine

ROOT = Path(__file__).resolve().parent.parent


def run_once(model: str, dtype: str, kv_cache_dtype: str, kv_policy: str, pool_bytes: int, args) -> dict:
    llm = LLM(model, dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_policy=kv_policy, kv_cache_memory_bytes=pool_bytes,
              max_num_seqs=args.requests, block_size=16)  # fmt: skip
    engine = llm.engine
    params = SamplingParams(max_tokens=args.output, temperature=0.0, ignore_eos=True)
    prompts = [[(7 * i + j) % 1000 + 3 for j in range(args.prompt)] for i in range(args.requests)]
    engine.add_requests(prompts[:1], params)  # warm-up: one request through prefill and decode
    while engine.has_work():
        engine.step()
    before = engine.stats()
    engine.add_requests(prompts, params)
    peak, start = 0, time.perf_counter()
    while engine.has_work():
        engine.step()
        peak = max(peak, engine.stats().num_running)
    seconds = time.perf_counter() - start
    after = engine.stats()
    tokens = after.num_generated_tokens - before.num_generated_tokens
    result = {"kv_capacity_tokens": after.kv_capacity_tokens, "peak_running": peak,
              "preemptions": after.num_preemptions - before.num_preemptions, "seconds": seconds,
              "output_tokens": tokens, "tokens_per_s": tokens / seconds}  # fmt: skip
    engine.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="gpt2-small", choices=sorted(PRESETS))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--pool-tokens", type=int, default=2048, help="the K/V memory: this many tokens in --dtype")
    p.add_argument("--requests", type=int, default=48)
    p.add_argument("--prompt", type=int, default=192)
    p.add_argument("--output", type=int, default=64)
    p.add_argument("--repeat", type=int, default=2)
    p.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    args = p.parse_args()
    config = EngineConfig(model=args.model, dtype=args.dtype)
    pool_bytes = args.pool_tokens * config.kv_bytes_per_token(config.model_config())
    configs = [(kv, policy) for policy in ("reserve", "paged") for kv in ("auto", "fp8")]
    rounds: dict[str, list[dict]] = {f"{kv}/{policy}": [] for kv, policy in configs}
    for round_ in range(args.repeat):
        for kv, policy in configs:
            result = run_once(args.model, args.dtype, kv, policy, pool_bytes, args)
            rounds[f"{kv}/{policy}"].append(result)
            print(f"round {round_ + 1} {kv:>4}/{policy:<7} pool {result['kv_capacity_tokens']:>6} tokens: peak running "
                  f"{result['peak_running']:>3}, preemptions {result['preemptions']:>3}, "
                  f"{result['tokens_per_s']:.1f} tok/s", flush=True)  # fmt: skip
    summary = {}
    for policy in ("reserve", "paged"):
        auto, fp8 = rounds[f"auto/{policy}"], rounds[f"fp8/{policy}"]
        ratios = [f["tokens_per_s"] / a["tokens_per_s"] for a, f in zip(auto, fp8, strict=True)]
        summary[policy] = {
            "peak_running": {"auto": max(r["peak_running"] for r in auto), "fp8": max(r["peak_running"] for r in fp8)},
            "preemptions": {"auto": [r["preemptions"] for r in auto], "fp8": [r["preemptions"] for r in fp8]},
            "tokens_per_s": {"auto": [round(r["tokens_per_s"], 1) for r in auto],
                             "fp8": [round(r["tokens_per_s"], 1) for r in fp8]},  # fmt: skip
            "fp8_over_auto": [round(min(ratios), 2), round(max(ratios), 2)],
        }
        print(f"{policy}: peak running {summary[policy]['peak_running']}, fp8 / auto throughput "
              f"{summary[policy]['fp8_over_auto'][0]:.2f}-{summary[policy]['fp8_over_auto'][1]:.2f}x")  # fmt: skip
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    record = {"command": "python benchmarks/kv_capacity.py " + " ".join(
                  f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "out" and v is not None),
              "commit": commit, "orca_backend": orca_backend.__file__, "machine": machine.describe(),
              "pool_bytes": pool_bytes, "args": {k: str(v) for k, v in vars(args).items()}, "summary": summary,
              "rounds": rounds}  # fmt: skip
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(record, indent=1) + "\n")


if __name__ == "__main__":
    main()
