"""K/V memory benchmarks, every configuration side by side in one run (rounds interleaved).

    python benchmarks/kv_capacity.py                       # --suite dtype: FP8 K/V against the model's dtype
    python benchmarks/kv_capacity.py --suite swap --prompt 32 --output 192   # preemption by swap vs recompute
    python benchmarks/kv_capacity.py --model llama-150m --pool-tokens 4096 --repeat 3
    python benchmarks/kv_capacity.py --suite hybrid --model gemma3-tiny --prompt 96 --output 128   # K/V groups

Each configuration serves the same --requests requests (prompts of --prompt tokens, --output tokens
each, ignore_eos) with kv_cache_memory_bytes fixed to what --pool-tokens tokens take in the model's
dtype (GPT-2-small geometry, float32, 2,048 tokens by default).

Suites:
  dtype  how many requests run at once, and the throughput: the pool in the model's dtype against an
         FP8 pool (kv_cache_dtype fp8) of the same bytes, under both K/V policies: `reserve` (ORCA's:
         prompt + max_tokens reserved at admission, so the running batch is what the pool holds)
         and `paged` (vLLM's: blocks as contexts grow, the newest request preempted when they run
         out).
  swap   a preemption-heavy workload (short prompts, long outputs, paged): preempted requests
         recomputed against swapped to a host tier (swap_space, --swap-gib).
  hybrid a model with local and global layers (--model gemma3-tiny: Gemma 3's five local layers to one
         global, a 32-token window), paged, chunks of 256: a block table per K/V group, the local
         groups giving back the blocks behind their window, against one table over every layer
         (disable_hybrid_kv_cache_manager) in the same bytes.
Reported per configuration: the peak of running requests, the preemptions, the prompt tokens
computed, output tokens/s (range over --repeat rounds). The weights are the preset's seeded random ones.
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


SUITES = {  # name -> {configuration: its engine options}
    "dtype": {"auto/reserve": {"kv_policy": "reserve"}, "fp8/reserve": {"kv_policy": "reserve", "kv_cache_dtype": "fp8"},
              "auto/paged": {"kv_policy": "paged"}, "fp8/paged": {"kv_policy": "paged", "kv_cache_dtype": "fp8"}},
    "swap": {"recompute": {"kv_policy": "paged"}, "swap": {"kv_policy": "paged", "swap_space": None}},
    "hybrid": {"one-table": {"disable_hybrid_kv_cache_manager": True, "max_num_batched_tokens": 256},
               "hybrid": {"max_num_batched_tokens": 256}},
}
RATIOS = {"dtype": [("reserve", "fp8/reserve", "auto/reserve"), ("paged", "fp8/paged", "auto/paged")],
          "swap": [("swap_over_recompute", "swap", "recompute")],
          "hybrid": [("hybrid_over_one_table", "hybrid", "one-table")]}  # fmt: skip


def run_once(model: str, dtype: str, options: dict, pool_bytes: int, args) -> dict:
    llm = LLM(model, dtype=dtype, kv_cache_memory_bytes=pool_bytes, max_num_seqs=args.requests, block_size=16,
              **options)  # fmt: skip
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
              "preemptions": after.num_preemptions - before.num_preemptions,
              "prompt_tokens_computed": after.num_prompt_tokens_computed - before.num_prompt_tokens_computed,
              "swapped_out_blocks": after.kv_swapped_out_blocks - before.kv_swapped_out_blocks, "seconds": seconds,
              "output_tokens": tokens, "tokens_per_s": tokens / seconds}  # fmt: skip
    engine.shutdown()
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--suite", default="dtype", choices=sorted(SUITES))
    p.add_argument("--swap-gib", type=float, default=1.0, help="swap: the host tier, GiB")
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
    configs = {name: {k: (args.swap_gib if v is None else v) for k, v in options.items()}
               for name, options in SUITES[args.suite].items()}  # fmt: skip
    rounds: dict[str, list[dict]] = {name: [] for name in configs}
    for round_ in range(args.repeat):
        for name, options in configs.items():
            result = run_once(args.model, args.dtype, options, pool_bytes, args)
            rounds[name].append(result)
            print(f"round {round_ + 1} {name:>12} pool {result['kv_capacity_tokens']:>6} tokens: peak running "
                  f"{result['peak_running']:>3}, preemptions {result['preemptions']:>3}, prompt tokens computed "
                  f"{result['prompt_tokens_computed']:>6}, {result['tokens_per_s']:.1f} tok/s", flush=True)  # fmt: skip
    summary: dict = {name: {key: [r[key] for r in results] for key in ("peak_running", "preemptions",
                                                                        "prompt_tokens_computed", "tokens_per_s")}
                     for name, results in rounds.items()}  # fmt: skip
    for label, over, under in RATIOS[args.suite]:
        ratios = [a["tokens_per_s"] / b["tokens_per_s"] for a, b in zip(rounds[over], rounds[under], strict=True)]
        summary[label] = [round(min(ratios), 3), round(max(ratios), 3)]
        print(f"{label}: {over} / {under} throughput {min(ratios):.2f}-{max(ratios):.2f}x")
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
