"""Offline throughput of `LLM.generate`: iteration-level (ORCA) vs request-level scheduling, one run.

    python benchmarks/offline.py                      # GPT-2-small preset, 64 requests, CPU fp32
    python benchmarks/offline.py --num-requests 16 --model gpt2-mini

Every request generates exactly its sampled length (ignore_eos), so both modes do the same work;
the difference is only who shares an iteration with whom. Best of --repeat runs each.
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from orca_backend import LLM, SamplingParams
from orca_client.workload import synthetic_trace


def run_once(llm: LLM, trace: list) -> tuple[float, int]:
    prompts = [r.prompt_ids for r in trace]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.output_ids) for o in outs)
    assert tokens == sum(r.max_tokens for r in trace), "a request stopped early"
    return elapsed, tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-small", help="preset name or HF checkpoint directory")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-dist", default="uniform:16:256")
    ap.add_argument("--output-dist", default="lognormal:32:256")
    ap.add_argument("--max-batch-size", type=int, default=16, help="below --num-requests, so slots free up and refill")
    ap.add_argument("--modes", default="iteration,request")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    results = {}
    for mode in args.modes.split(","):
        llm = LLM(args.model, device=args.device, dtype=args.dtype, max_batch_size=args.max_batch_size,
                  kv_capacity_tokens=args.num_requests * 512 + 1024, scheduling=mode)  # fmt: skip
        trace = synthetic_trace(args.num_requests, args.prompt_dist, args.output_dist,
                                llm.engine.model_config.vocab_size, seed=args.seed)  # fmt: skip
        run_once(llm, trace[:2])  # warm-up
        best = min(run_once(llm, trace) for _ in range(args.repeat))
        results[mode] = {"seconds": best[0], "output_tokens": best[1], "tokens_per_s": best[1] / best[0]}
        print(f"{mode:>9}-level: {best[1]} output tokens in {best[0]:.2f} s = {best[1] / best[0]:.1f} tok/s (best of {args.repeat})")
        del llm
    if {"iteration", "request"} <= results.keys():
        ratio = results["iteration"]["tokens_per_s"] / results["request"]["tokens_per_s"]
        results["ratio_iteration_over_request"] = ratio
        print(f"iteration-level / request-level throughput: {ratio:.2f}x")
    results["config"] = vars(args) | {"torch_threads": torch.get_num_threads()}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
