"""Offline throughput with tensor / pipeline parallelism on CPU (gloo) or GPU (NCCL), side by side.

    python benchmarks/parallel.py --configs 1x1,1x2,2x1 --model gpt2-mini

Each config is TPxPP. With PP, the engine keeps one batch per stage in flight; the workload has
more requests than --max-num-seqs so the pipeline can fill.
"""

from __future__ import annotations

import argparse
import sys
import time

from orca_backend import LLM, SamplingParams
from orca_client import machine
from orca_client.workload import synthetic_trace


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", default="1x1,1x2,2x1")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    print(f"command: python {' '.join(sys.argv)}")
    print(f"commit: {machine.code_revision()}")
    print(f"machine: {machine.summary()}")
    rates = {}
    for spec in args.configs.split(","):
        tp, pp = (int(x) for x in spec.split("x"))
        llm = LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                  tensor_parallel_size=tp, pipeline_parallel_size=pp)  # fmt: skip
        trace = synthetic_trace(args.num_requests, "uniform:16:128", "uniform:16:64", llm.engine.model_config.vocab_size)
        params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
        llm.generate([trace[0].prompt_ids], params[0])  # warm-up
        best = float("inf")
        for _ in range(args.repeat):
            start = time.perf_counter()
            outs = llm.generate([r.prompt_ids for r in trace], params)
            best = min(best, time.perf_counter() - start)
        tokens = sum(len(o.output_ids) for o in outs)
        rates[spec] = tokens / best
        print(f"tp x pp = {spec}: {tokens / best:.1f} output tok/s, max batches in flight "
              f"{llm.engine.stats().max_batches_in_flight}")  # fmt: skip
        llm.engine.shutdown()
    if "1x1" in rates:
        for spec, rate in rates.items():
            print(f"{spec} / 1x1: {rate / rates['1x1']:.2f}x")


if __name__ == "__main__":
    main()
