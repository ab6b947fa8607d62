"""Offline throughput with tensor / pipeline parallelism on CPU (gloo) or GPU (NCCL), side by side,
and the per-iteration cost of the Ray executor's control plane against the local worker pool's.

    python benchmarks/parallel.py --configs 1x1,1x2,2x1 --model gpt2-mini
    python benchmarks/parallel.py --configs 2x1,1x2 --model gpt2-tiny --backends mp,ray --ray-nodes 2 --repeat 5

Each config is TPxPP. With PP, the engine keeps one batch per stage in flight; the workload has
more requests than --max-num-seqs so the pipeline can fill. With several --backends, each config runs
on each backend (mp: worker processes with pipes; ray: Ray actors with TCP connections to the core,
on RAY_ADDRESS's cluster or, with --ray-nodes N, a cluster of N one-CPU nodes simulated on this
machine), their runs alternated round by round; on a tiny model the step is mostly the engine's own
work, so the per-iteration difference is the control plane's cost.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from collections.abc import Iterator

from orca_backend import LLM, SamplingParams
from orca_client import machine
from orca_client.workload import synthetic_trace


@contextlib.contextmanager
def ray_cluster(nodes: int) -> Iterator[None]:
    """A connection to RAY_ADDRESS's cluster, or with `nodes` a simulated one of that many 1-CPU nodes."""
    import ray

    cluster = None
    if nodes:
        from ray.cluster_utils import Cluster

        cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1})
        for _ in range(nodes - 1):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
    ray.init(address=cluster.address if cluster else "auto", logging_level="WARNING")
    try:
        yield
    finally:
        ray.shutdown()
        if cluster is not None:
            cluster.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2-mini")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--configs", default="1x1,1x2,2x1")
    ap.add_argument("--backends", default="mp", help="comma-separated distributed_executor_backend values: mp, ray")
    ap.add_argument("--ray-nodes", type=int, default=0, help="ray: simulate a cluster of N one-CPU nodes here")
    ap.add_argument("--num-requests", type=int, default=32)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    backends = args.backends.split(",")
    print(f"command: python {' '.join(sys.argv)}")
    print(f"commit: {machine.code_revision()}")
    print(f"machine: {machine.summary()}")
    with ray_cluster(args.ray_nodes) if "ray" in backends else contextlib.nullcontext():
        rates = {}
        for spec in args.configs.split(","):
            tp, pp = (int(x) for x in spec.split("x"))
            # Synchronous steps in every layout (async scheduling, on by default on CUDA, runs one process
            # only): the layouts differ in their parallelism alone.
            engines = {backend: LLM(args.model, device=args.device, max_num_seqs=args.max_num_seqs,
                                    tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                    distributed_executor_backend=backend, async_scheduling=False)
                       for backend in backends}  # fmt: skip
            vocab = next(iter(engines.values())).engine.model_config.vocab_size
            trace = synthetic_trace(args.num_requests, "uniform:16:128", "uniform:16:64", vocab)
            params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
            seconds: dict[str, list[float]] = {b: [] for b in backends}
            per_iteration: dict[str, list[float]] = {b: [] for b in backends}
            tokens = 0
            for llm in engines.values():
                llm.generate([trace[0].prompt_ids], params[0])  # warm-up
            for _ in range(args.repeat):
                for backend, llm in engines.items():
                    iterations = llm.engine.stats().num_iterations
                    start = time.perf_counter()
                    outs = llm.generate([r.prompt_ids for r in trace], params)
                    elapsed = time.perf_counter() - start
                    seconds[backend].append(elapsed)
                    per_iteration[backend].append(elapsed / (llm.engine.stats().num_iterations - iterations))
                    tokens = sum(len(o.output_ids) for o in outs)
            for backend, llm in engines.items():
                label = f"{spec}" + (f" {backend}" if len(backends) > 1 else "")
                rates[label] = tokens / min(seconds[backend])
                ms = [1e3 * s for s in per_iteration[backend]]
                print(f"tp x pp = {label}: {rates[label]:.1f} output tok/s (best of {args.repeat}), per iteration "
                      f"{min(ms):.2f}-{max(ms):.2f} ms (median {statistics.median(ms):.2f}), max batches in flight "
                      f"{llm.engine.stats().max_batches_in_flight}")  # fmt: skip
                llm.engine.shutdown()
            if {"mp", "ray"} <= set(backends):
                extra = [1e3 * (r - m) for r, m in zip(per_iteration["ray"], per_iteration["mp"], strict=True)]
                print(f"tp x pp = {spec}: ray - mp per iteration, round by round: "
                      + ", ".join(f"{x:+.2f} ms" for x in extra))
        if "1x1" in rates:
            for spec, rate in rates.items():
                print(f"{spec} / 1x1: {rate / rates['1x1']:.2f}x")


if __name__ == "__main__":
    main()
