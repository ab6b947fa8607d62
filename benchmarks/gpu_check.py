"""GPU check: the device's own ceilings, the Triton kernels against them, the engine's rooflines, and the
engine-level A/B of iteration-level vs request-level scheduling. Writes gpu_check.json and summary.md
to --out.

    python benchmarks/gpu_check.py --out gpu_results                     # every section (needs CUDA)
    python benchmarks/gpu_check.py --sections ceilings,decode            # some of them
    python benchmarks/gpu_check.py --device cpu --quick --out DIR        # plumbing check on a CPU (CI)

--quick gives every knob not set explicitly a small value (gpt2-tiny, float32 on CPU, a short A/B):
every section runs end to end in well under a minute on a small CPU (tests/test_gpu_check.py, `make
gpu-check-cpu`). On CPU its figures prove the code paths, not a GPU's: the ceilings are host memory
and CPU matmul, the kernels run in Triton's interpreter (correctness against torch, no timings), and
the device profile is absent (it needs CUDA); each says so in the report.

Sections (all measured in this run, each figure against what this device measured, not a datasheet):
  ceilings  device-to-device copy bandwidth (bytes read + written) and a large bf16 matmul's FLOP/s
  kernels   benchmarks/kernels.py (Triton kernels vs torch and SDPA) with those ceilings as the peaks;
            on CPU its --interpret mode (TRITON_INTERPRET=1, set before triton is imported)
  decode    the engine's batch-1 decode step vs the HBM roofline: (weight bytes + K/V bytes read) /
            copy bandwidth; also the GPU kernel time per step (torch profiler) to show where it goes
  prefill   one large prefill step (many prompts in one iteration) vs the measured matmul peak
  ab        the SAME engine with scheduling="iteration" vs "request" on one seeded Poisson trace with
            long-tailed outputs, requests fed in at their arrival times; median normalized latency
            (end-to-end / output tokens) per rate, and the max rate each mode sustains under an SLO
            set relative to the unloaded per-token latency measured in this run
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import math
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from orca_backend import LLM, EngineConfig, ModelConfig
from orca_client import machine
from orca_client.workload import TraceRequest, synthetic_trace

BENCH_DIR = Path(__file__).resolve().parent
SECTIONS = ("ceilings", "kernels", "decode", "prefill", "ab")


def load_sibling(name: str) -> ModuleType:
    """A script beside this one, by path: `kernels` would clash with the repository's kernels/ package."""
    spec = importlib.util.spec_from_file_location(f"orca_bench_{name}", BENCH_DIR / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


offline = load_sibling("offline")  # its greedy() is the benchmarks' one definition of a request's params


# ------------------------------------------------------------------------------------------ timing
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], device: torch.device, reps: int, warmup: int = 3) -> float:
    """Median of `reps` timed calls of a device op: CUDA events on the GPU (no host clock in the loop)."""
    for _ in range(warmup):
        fn()
    sync(device)
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def wall_seconds(fn: Callable[[], object], device: torch.device) -> float:
    """Host wall time of one engine call, the device drained on both sides: what a caller waits."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def gpu_kernel_time(fn: Callable[[], object], calls: int, device: torch.device) -> dict[str, Any] | None:
    """GPU time per call summed over its kernels and copies (torch profiler), and launches per call.

    Set against the wall time of the same call, this says whether the GPU or the host is the limit.
    Off CUDA the calls still run (callers count on their effects), unprofiled, and the reason comes back."""
    if device.type != "cuda":
        for _ in range(calls):
            fn()
        return {"skipped": f"the device profile needs CUDA (torch profiler), not {device.type}"}
    try:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(calls):
                fn()
            sync(device)
        events = prof.key_averages()
        on_device = [
            e for e in events if getattr(e, "self_device_time_total", 0.0) > 0
        ]  # not the launch calls
        total_us = sum(e.self_device_time_total for e in on_device)
        launches = sum(e.count for e in on_device)
        if total_us <= 0:
            return {"error": "the profiler recorded no device time"}
        return {"gpu_ms_per_call": total_us / 1e3 / calls, "device_ops_per_call": launches / calls}
    except Exception as exc:  # the profiler is a diagnosis only: its failure must not sink the run
        return {"error": repr(exc)}


def host_profile(fn: Callable[[], object], calls: int, top: int = 15) -> list[dict[str, Any]]:
    """Where the host's time per call goes (cProfile, by self time). A blocking read of a GPU result
    (the sampled tokens' .tolist()) shows up as that call's self time: the wait for the device."""
    import cProfile
    import pstats

    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        fn()
    profiler.disable()
    rows = sorted(pstats.Stats(profiler).stats.items(), key=lambda item: -item[1][2])[:top]  # type: ignore[attr-defined]
    return [
        {"function": f"{Path(file).name}:{line}({name})", "calls_per_call": ncalls / calls,
         "self_ms_per_call": self_s * 1e3 / calls, "cumulative_ms_per_call": cum_s * 1e3 / calls}
        for (file, line, name), (_, ncalls, self_s, cum_s, _) in rows
    ]  # fmt: skip


def print_host_profile(rows: list[dict[str, Any]], limit: int = 8) -> None:
    for r in rows[:limit]:
        print(
            f"    host {r['self_ms_per_call']:7.3f} ms self, {r['calls_per_call']:6.0f} calls  {r['function']}"
        )


# -------------------------------------------------------------------------------------- the engine
def model_config(args: argparse.Namespace) -> ModelConfig:
    return EngineConfig(model=args.model).model_config()


def make_llm(args: argparse.Namespace, scheduling: str) -> LLM:
    cfg = model_config(args)
    # ORCA reserves prompt + max_tokens at admission: room for every request of a full batch.
    kv_tokens = args.max_seqs * cfg.n_positions
    return LLM(
        args.model, device=args.device, dtype=args.dtype, kv_capacity_tokens=kv_tokens, scheduling=scheduling,
        max_num_seqs=args.max_seqs,
    )  # fmt: skip


def drain(llm: LLM) -> None:
    while llm.engine.has_work():
        llm.engine.step()


def release(llm: LLM | None) -> None:
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------- sections
def section_ceilings(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    # A copy over buffers far larger than L2 (50 MB on an H100) reads and writes every byte once.
    n = args.copy_mib << 20
    src = torch.randint(0, 256, (n,), dtype=torch.uint8, device=device)  # not zeros (see METHOD.md)
    dst = torch.empty_like(src)
    copy_s = median_seconds(lambda: dst.copy_(src), device, reps=20)
    # The matmul peak in the engine's dtype, on random data, two operand sets alternated.
    mm_dtype = getattr(torch, args.dtype)
    n_mm = args.matmul_n
    sets = [(torch.randn(n_mm, n_mm, device=device, dtype=mm_dtype), torch.randn(n_mm, n_mm, device=device, dtype=mm_dtype)) for _ in range(2)]  # fmt: skip
    out = torch.empty(n_mm, n_mm, device=device, dtype=mm_dtype)
    turn = [0]

    def matmul() -> None:
        a, b = sets[turn[0] % 2]
        turn[0] += 1
        torch.matmul(a, b, out=out)

    mm_s = median_seconds(matmul, device, reps=20)
    result = {
        "copy_bytes": 2 * n,
        "copy_ms": copy_s * 1e3,
        "copy_gb_s": 2 * n / copy_s / 1e9,
        "matmul_n": n_mm,
        "matmul_dtype": args.dtype,
        "matmul_ms": mm_s * 1e3,
        "matmul_tflops": 2 * n_mm**3 / mm_s / 1e12,
    }
    print(f"device-to-device copy: {result['copy_gb_s']:.0f} GB/s (read + write of {n >> 20} MiB); "
          f"{n_mm}^3 {args.dtype} matmul: {_sig(result['matmul_tflops'])} TFLOP/s")  # fmt: skip
    return result


def section_kernels(
    args: argparse.Namespace, device: torch.device, ceilings: dict[str, Any]
) -> dict[str, Any]:
    """On CUDA the compiled kernels at full sizes; elsewhere benchmarks/kernels.py --interpret: Triton's
    interpreter at tiny shapes, every kernel still checked against its torch reference, no timings."""
    interpret = device.type != "cuda"
    if interpret and (reason := interpreter_unavailable()):
        return {"skipped": f"{device.type}: {reason}"}
    kernels = load_sibling("kernels")
    kargs = kernels.parse_args(
        [
            *(["--interpret"] if interpret else []),
            "--dtype",
            KERNEL_DTYPES[args.dtype],
            "--peak-bw-gbs",
            f"{ceilings['copy_gb_s']:.1f}",
            "--peak-tflops",
            f"{ceilings['matmul_tflops']:.3f}",
        ]
    )
    results = kernels.run(kargs)
    lines = [kernels.HEADER] + [r.row(kargs.peak_bw_gbs, kargs.peak_tflops) for r in results]
    print("\n".join(lines))
    result = {
        "mode": "interpreted" if interpret else "compiled",
        "args": vars(kargs),
        "results": [asdict(r) for r in results],
        "table": lines,
        "all_triton_ok": all(r.ok for r in results if r.impl == "triton"),
    }
    if interpret:
        result["note"] = (f"{device.type}: Triton interpreter (TRITON_INTERPRET=1) at tiny shapes; correctness "
                          "against torch only, no timings (the interpreter's would mean nothing)")  # fmt: skip
    return result


KERNEL_DTYPES = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}  # benchmarks/kernels.py's names


def interpreter_unavailable() -> str | None:
    """Why Triton's interpreter cannot run in this process, or None when it can."""
    try:
        import triton.language as tl
        from triton.runtime.jit import JITFunction
    except ImportError as exc:
        return f"the triton package is unavailable ({exc})"
    if isinstance(tl.sum, JITFunction):  # triton.language decorated its helpers compiled at import
        return ("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run "
                "interpreted in this process (run benchmarks/kernels.py --interpret)")  # fmt: skip
    return None


def decode_bytes(cfg: ModelConfig, elt: int, context: float) -> tuple[int, float]:
    """(weight bytes, K/V bytes) one decode step must read at batch 1: every weight once (the tied
    embedding as the LM head; one row of the position table), and K and V of every layer's context."""
    weights = (cfg.num_parameters() - cfg.n_positions * cfg.n_embd + cfg.n_embd) * elt
    kv = 2 * cfg.n_layer * context * cfg.n_embd * elt
    return weights, kv


def section_decode(
    args: argparse.Namespace, device: torch.device, llm: LLM, ceilings: dict[str, Any]
) -> dict[str, Any]:
    cfg, elt = model_config(args), getattr(torch, args.dtype).itemsize
    engine = llm.engine
    prompt = list(range(1, args.decode_prompt + 1))
    # Tokens for the warm-up, the timed steps and both profiles, so every profiled step decodes.
    budget = args.decode_warmup + args.decode_steps + 2 * args.profile_steps + 2
    ended: list[str] = []
    stream = engine.add_request(
        prompt,
        offline.greedy(TraceRequest(0.0, prompt, budget)),
        on_output=lambda o: ended.append(o.request_id) if o.finished else None,
    )
    for _ in range(args.decode_warmup):  # the prefill, then decodes (compiles the decode-shaped kernels)
        engine.step()
    steps = [wall_seconds(engine.step, device) for _ in range(args.decode_steps)]
    profile = gpu_kernel_time(engine.step, args.profile_steps, device)
    host = host_profile(engine.step, args.profile_steps)
    if ended:
        raise RuntimeError("the decode request ended before the profiles did: raise its token budget")
    engine.abort_request(stream.request_id)
    drain(llm)

    step = statistics.median(steps)
    # The context grows by one token a step: the K/V read at the middle of the timed steps.
    context = args.decode_prompt + args.decode_warmup + args.decode_steps / 2
    weight_bytes, kv_bytes = decode_bytes(cfg, elt, context)
    bw = ceilings["copy_gb_s"] * 1e9
    roofline = (weight_bytes + kv_bytes) / bw
    result = {
        "model": args.model, "dtype": args.dtype, "prompt_tokens": args.decode_prompt, "mean_context": context,
        "step_ms_median": step * 1e3, "step_ms_p10": _pct(steps, 10) * 1e3, "step_ms_p90": _pct(steps, 90) * 1e3,
        "weight_bytes": weight_bytes, "kv_bytes": kv_bytes, "bandwidth_gb_s": bw / 1e9,
        "roofline_ms": roofline * 1e3, "fraction_of_roofline": roofline / step, "gpu_profile": profile,
        "host_profile": host,
    }  # fmt: skip
    extra = ""
    if profile and "gpu_ms_per_call" in profile:
        extra = (f"; GPU busy {profile['gpu_ms_per_call']:.3f} ms/step over {profile['device_ops_per_call']:.0f} "
                 f"kernels+copies ({roofline / (profile['gpu_ms_per_call'] / 1e3):.0%} of roofline if launches were free)")  # fmt: skip
    print(f"batch-1 decode step {step * 1e3:.3f} ms (median of {len(steps)}); roofline {roofline * 1e3:.3f} ms = "
          f"{(weight_bytes + kv_bytes) / 1e6:.0f} MB / {bw / 1e9:.0f} GB/s -> {roofline / step:.1%} of roofline{extra}")  # fmt: skip
    print_host_profile(host)
    return result


def prefill_flops(cfg: ModelConfig, num_prompts: int, prompt_len: int) -> float:
    """FLOPs of one prefill step: the linear layers for every token (24 e^2 a layer: qkv 6, attention
    out 2, MLP 8 + 8), causal attention (QK^T and PV, 4 e per visible query-key pair a layer) and the
    LM head for each prompt's last token only (the engine computes no other logits)."""
    e, tokens = cfg.n_embd, num_prompts * prompt_len
    linear = 2 * 12 * e * e * cfg.n_layer * tokens
    pairs = num_prompts * prompt_len * (prompt_len + 1) / 2
    attention = 4 * e * pairs * cfg.n_layer
    lm_head = 2 * cfg.vocab_size * e * num_prompts
    return linear + attention + lm_head


def section_prefill(
    args: argparse.Namespace, device: torch.device, llm: LLM, ceilings: dict[str, Any]
) -> dict[str, Any]:
    cfg = model_config(args)
    num_prompts, prompt_len = args.prefill
    if num_prompts > args.max_seqs:
        raise SystemExit(
            f"--prefill {num_prompts} prompts exceeds --max-seqs {args.max_seqs}: they would not share one step"
        )
    engine = llm.engine
    rng = random.Random(1)

    def submit() -> list[str]:
        """Queues a fresh batch of prompts (outside any timed region); returns the list of finished ids."""
        prompts = [[rng.randrange(cfg.vocab_size) for _ in range(prompt_len)] for _ in range(num_prompts)]
        done: list[str] = []
        params = offline.greedy(TraceRequest(0.0, prompts[0], 1))  # one token: the prefill step ends them
        engine.add_requests(
            prompts, params, on_output=lambda o: done.append(o.request_id) if o.finished else None
        )
        return done

    def check(done: list[str]) -> None:
        if len(done) != num_prompts:
            raise RuntimeError(
                f"one step finished {len(done)} of {num_prompts} prompts: they did not share the iteration"
            )

    def one_step() -> float:
        done = submit()
        seconds = wall_seconds(engine.step, device)
        check(done)
        return seconds

    for _ in range(2):
        one_step()
    steps = [one_step() for _ in range(args.prefill_reps)]
    done = submit()
    profile = gpu_kernel_time(engine.step, 1, device)
    check(done)
    done = submit()
    host = host_profile(engine.step, 1)
    check(done)
    step = statistics.median(steps)
    flops = prefill_flops(cfg, num_prompts, prompt_len)
    peak = ceilings["matmul_tflops"] * 1e12
    result = {
        "model": args.model, "dtype": args.dtype, "prompts": num_prompts, "prompt_len": prompt_len,
        "tokens": num_prompts * prompt_len, "flops": flops, "step_ms_median": step * 1e3,
        "achieved_tflops": flops / step / 1e12, "peak_tflops": peak / 1e12, "fraction_of_peak": flops / step / peak,
        "gpu_profile": profile, "host_profile": host,
    }  # fmt: skip
    extra = ""
    if profile and "gpu_ms_per_call" in profile:
        extra = f"; GPU busy {profile['gpu_ms_per_call']:.2f} ms of the step"
    print(f"prefill step of {num_prompts} x {prompt_len} tokens: {step * 1e3:.2f} ms (median of {len(steps)}), "
          f"{flops / 1e12:.3g} TFLOP -> {_sig(flops / step / 1e12)} TFLOP/s = {flops / step / peak:.1%} of the measured peak{extra}")  # fmt: skip
    print_host_profile(host)
    return result


# ---------------------------------------------------------------------------------------------- A/B
@dataclass
class Point:
    mode: str
    offered_rate: float  # req/s of the trace
    num_requests: int
    completed: int
    censored: int  # unfinished at the point's time limit: their latency is a lower bound
    duration_s: float  # trace start to the last completion (or the time limit)
    achieved_rate: float
    output_tokens_per_s: float
    norm_median_ms: float  # median normalized latency, ms per output token
    norm_p90_ms: float
    e2e_median_ms: float

    def meets(self, slo_ms: float) -> bool:
        return self.censored == 0 and self.norm_median_ms <= slo_ms


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def replay(
    llm: LLM, trace: list[TraceRequest], time_limit_s: float
) -> tuple[list[float], list[float], int, float]:
    """Feeds each request into the engine at its arrival time (between iterations, as a server's loop
    would) and steps the engine on this thread. Latency runs from the trace's arrival time, so time a
    request waits for the iteration in progress counts, as it would for a client.

    Returns (normalized latencies s/token, end-to-end latencies s, censored count, duration s)."""
    engine = llm.engine
    finish: dict[str, float] = {}

    def on_output(out) -> None:
        if out.finished and out.finish_reason == "length":
            finish[out.request_id] = out.time

    sent: dict[str, tuple[float, int]] = {}  # request id -> (arrival, output tokens)
    start = time.perf_counter()
    deadline = start + time_limit_s
    i = 0
    while True:
        now = time.perf_counter()
        while i < len(trace) and start + trace[i].arrival <= now:
            r = trace[i]
            stream = engine.add_request(r.prompt_ids, offline.greedy(r), on_output=on_output)
            sent[stream.request_id] = (start + r.arrival, r.max_tokens)
            i += 1
        if now > deadline:
            break
        if engine.has_work():
            engine.step()
        elif i < len(trace):
            time.sleep(max(0.0, start + trace[i].arrival - time.perf_counter()))
        else:
            break
    end = time.perf_counter()
    unfinished = [rid for rid in sent if rid not in finish]
    for rid in unfinished:  # an overloaded point: stop it, free the engine for the next one
        engine.abort_request(rid)
    drain(llm)
    norm, e2e = [], []
    for rid, (arrival, tokens) in sent.items():
        done = finish.get(rid, end)  # censored: a lower bound of the latency it would have had
        e2e.append(done - arrival)
        norm.append((done - arrival) / tokens)
    censored = len(unfinished) + (len(trace) - i)
    duration = (max(finish.values()) if finish and not censored else end) - start
    return norm, e2e, censored, duration


def run_point(args: argparse.Namespace, llm: LLM, mode: str, rate: float, cfg: ModelConfig) -> Point:
    n = min(args.ab_max_requests, max(args.ab_min_requests, math.ceil(rate * args.ab_seconds)))
    # Same seed at every rate: the same requests in the same order, arrival gaps scaled by 1 / rate.
    trace = synthetic_trace(
        n, args.prompt_dist, args.output_dist, cfg.vocab_size, request_rate=rate, seed=args.seed
    )
    limit = trace[-1].arrival + args.ab_drain_s
    norm, e2e, censored, duration = replay(llm, trace, limit)
    completed = len(trace) - censored
    tokens = sum(r.max_tokens for r in trace)
    point = Point(
        mode, rate, len(trace), completed, censored, duration, completed / duration, tokens / duration,
        statistics.median(norm) * 1e3, _pct(norm, 90) * 1e3, statistics.median(e2e) * 1e3,
    )  # fmt: skip
    flag = f", {censored} unfinished at the {limit:.0f} s limit (lower bounds)" if censored else ""
    print(f"  {mode:>9} @ {rate:7.2f} req/s, {n:4d} requests: median normalized {point.norm_median_ms:8.2f} ms/token, "
          f"p90 {point.norm_p90_ms:8.2f}, achieved {point.achieved_rate:6.2f} req/s in {duration:5.1f} s{flag}", flush=True)  # fmt: skip
    return point


def warm_up(llm: LLM, args: argparse.Namespace, cfg: ModelConfig) -> None:
    """Compiles the kernels' shape variants (prefill and decode tiles, mixed batches) before timing."""
    trace = synthetic_trace(
        min(args.max_seqs, 24), args.prompt_dist, "uniform:1:24", cfg.vocab_size, seed=args.seed + 1
    )
    llm.generate([r.prompt_ids for r in trace], [offline.greedy(r) for r in trace])
    llm.generate([trace[0].prompt_ids], offline.greedy(trace[0]))


def unloaded_latency(args: argparse.Namespace, llm: LLM, cfg: ModelConfig) -> dict[str, Any]:
    """The trace's first requests one at a time, each alone in the engine: the per-token latency of an
    idle server for this workload's mix of prompt and output lengths. They are the same requests the
    lowest-rate points replay (--ab-min-requests), so that comparison is like for like: with long-tailed
    outputs a median over a few requests depends on which requests they are."""
    trace = synthetic_trace(
        args.unloaded_requests, args.prompt_dist, args.output_dist, cfg.vocab_size, seed=args.seed
    )
    norm, e2e = [], []
    for r in trace:
        n, e, _, _ = replay(llm, [TraceRequest(0.0, r.prompt_ids, r.max_tokens)], time_limit_s=600.0)
        norm += n
        e2e += e
    result = {
        "requests": len(trace),
        "each": [
            {"prompt": r.prompt_len, "output": r.max_tokens, "e2e_ms": t * 1e3}
            for r, t in zip(trace, e2e, strict=True)
        ],
        "norm_median_ms": statistics.median(norm) * 1e3,
        "mean_e2e_ms": statistics.mean(e2e) * 1e3,
        # Serving requests strictly one after another sustains 1 / mean service time.
        "one_at_a_time_rate": 1.0 / statistics.mean(e2e),
    }
    print(f"unloaded: median normalized latency {result['norm_median_ms']:.2f} ms/token over {len(trace)} requests "
          f"alone; one-at-a-time capacity {result['one_at_a_time_rate']:.2f} req/s")  # fmt: skip
    return result


def sweep(
    args: argparse.Namespace, llm: LLM, mode: str, base_rate: float, slos_ms: list[float], cfg: ModelConfig
) -> list[Point]:
    """Rates from base_rate up by 4x until the loosest SLO is missed, down by 2x while the tightest one
    is missed at the lowest rate, then geometric bisection of the headline SLO's crossing (--ab-refine
    times: 4x -> 2x -> 1.4x apart). Every point is a full trace: an overloaded rate shows as a growing
    queue (or unfinished requests), never as a short trace that ended before the queue built up."""
    points: dict[float, Point] = {}
    deadline = time.perf_counter() + args.ab_budget_s / 2  # each mode gets half of the A/B's time

    def run(rate: float) -> Point:
        if rate not in points:
            points[rate] = run_point(args, llm, mode, rate, cfg)
        return points[rate]

    def more() -> bool:
        return len(points) < args.ab_max_points and time.perf_counter() < deadline

    loosest, tightest, headline = max(slos_ms), min(slos_ms), slos_ms[0]
    rate = base_rate
    while run(rate).meets(loosest) and rate * 4 <= base_rate * args.ab_max_factor and more():
        rate *= 4
    rate = min(points)
    while not run(rate).meets(tightest) and rate / 2 >= base_rate / args.ab_max_factor and more():
        rate /= 2
    for _ in range(args.ab_refine):
        passing = [r for r, p in points.items() if p.meets(headline)]
        failing = [r for r, p in points.items() if passing and r > max(passing) and not p.meets(headline)]
        if not passing or not failing or not more():
            break
        run(math.sqrt(max(passing) * min(failing)))
    return [points[r] for r in sorted(points)]


def sustained(points: list[Point], slo_ms: float) -> dict[str, Any]:
    """The highest rate run whose median met the SLO (and every lower one did), and the rate where the
    median crosses the SLO by linear interpolation between the last pass and the next point."""
    best, crossing = None, None
    for i, p in enumerate(points):
        if not p.meets(slo_ms):
            if best is not None and p.censored == 0:
                prev = points[i - 1]
                frac = (slo_ms - prev.norm_median_ms) / (p.norm_median_ms - prev.norm_median_ms)
                crossing = prev.offered_rate + frac * (p.offered_rate - prev.offered_rate)
            elif best is not None:
                crossing = best
            break
        best = p.offered_rate
    else:
        crossing = best  # never missed: a lower bound
    return {
        "max_rate": best,
        "crossing_rate": crossing,
        "never_missed": bool(points) and points[-1].meets(slo_ms),
    }


def section_ab(args: argparse.Namespace, llm: LLM) -> dict[str, Any]:
    cfg = model_config(args)
    warm_up(llm, args, cfg)
    unloaded = unloaded_latency(args, llm, cfg)
    slos = {f"{m:g}x": m * unloaded["norm_median_ms"] for m in args.slo_multiples}
    base = unloaded["one_at_a_time_rate"]
    print(
        "SLOs (median normalized latency): " + ", ".join(f"{k} = {v:.2f} ms/token" for k, v in slos.items())
    )
    results: dict[str, Any] = {"unloaded": unloaded, "slos_ms": slos, "points": {}, "sustained": {}}
    for mode in ("iteration", "request"):
        engine_llm = llm if mode == "iteration" else make_llm(args, "request")
        if mode == "request":
            warm_up(engine_llm, args, cfg)
        started = time.perf_counter()
        points = sweep(args, engine_llm, mode, base, list(slos.values()), cfg)
        results["points"][mode] = [asdict(p) for p in points]
        results["sustained"][mode] = {k: sustained(points, v) for k, v in slos.items()}
        results.setdefault("sweep_seconds", {})[mode] = time.perf_counter() - started
        if mode == "request":
            release(engine_llm)
    ratios = {}
    for k in slos:
        it, rq = results["sustained"]["iteration"][k], results["sustained"]["request"][k]
        ratios[k] = {
            "max_rate_ratio": _ratio(it["max_rate"], rq["max_rate"]),
            "crossing_ratio": _ratio(it["crossing_rate"], rq["crossing_rate"]),
            "lower_bound": it["never_missed"],
        }
        if ratios[k]["max_rate_ratio"] is None:
            missed = [m for m in ("iteration", "request") if results["sustained"][m][k]["max_rate"] is None]
            ratios[k]["reason"] = (f"{' and '.join(missed)}-level met this SLO at none of the rates run "
                                   f"(lowest {min(p['offered_rate'] for m in missed for p in results['points'][m]):.2f} req/s)")  # fmt: skip
        print(f"SLO {k} ({slos[k]:.2f} ms/token): iteration {_fmt(it['max_rate'])} req/s vs request {_fmt(rq['max_rate'])} "
              f"-> {_fmt(ratios[k]['max_rate_ratio'])}x{' (lower bound: iteration never missed it)' if it['never_missed'] else ''}; "
              f"at the crossings {_fmt(ratios[k]['crossing_ratio'])}x")  # fmt: skip
    results["ratios"] = ratios
    return results


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def _fmt(value: float | None, digits: int = 2) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _sig(value: float) -> str:
    """Whole numbers for a GPU's hundreds of TFLOP/s, three significant digits for a CPU's fractions."""
    return f"{value:.0f}" if value >= 10 else f"{value:.3g}"


# ------------------------------------------------------------------------------------------ report
def render_markdown(result: dict[str, Any]) -> str:
    env, args = result["environment"], result["args"]
    lines = [
        "# GPU check",
        "",
        f"{env['device']} (host: {env.get('host_cpu', '?')}); torch {env['torch']}, triton {env['triton']}, Python {env['python']}. "
        f"Model `{args['model']}` ({args['dtype']}), max {args['max_seqs']} requests per iteration. "
        f"Command: `{result['command']}`, at commit `{result.get('commit', 'unknown')}`. Every percentage is against this device's ceilings measured in the same run.",
        "",
    ]
    if not str(args["device"]).startswith("cuda"):
        lines += [f"**Not a GPU run** (`--device {args['device']}`, torch threads: {env.get('torch_threads', '?')}): "
                  "a plumbing check of every section's code path. "
                  "The ceilings are this host's memory copy and matmul, Triton kernels run only in Triton's "
                  "interpreter (correctness only) and there is no device profile; no figure here says anything "
                  "about a GPU.", ""]  # fmt: skip
    if seconds := result.get("seconds"):
        lines += ["Section wall times: " + ", ".join(f"{k} {v:.1f} s" for k, v in seconds.items()) + ".", ""]
    if c := result.get("ceilings"):
        lines += ["## Device ceilings", "", f"| device-to-device copy (read + write) | {c['matmul_dtype']} matmul |", "|---|---|",
                  f"| {c['copy_gb_s']:.0f} GB/s ({c['copy_bytes'] >> 20} MiB moved per copy) | "
                  f"{_sig(c['matmul_tflops'])} TFLOP/s ({c['matmul_n']}^3, random data) |", ""]  # fmt: skip
    if (k := result.get("kernels")) and "table" in k:
        against = (
            "Triton interpreter: correctness only"
            if k.get("mode") == "interpreted"
            else "against the ceilings above"
        )
        lines += [
            f"## Kernels (`benchmarks/kernels.py`, {k['args']['dtype']}, {against})",
            "",
            *([k["note"], ""] if "note" in k else []),
            "```",
            *k["table"],
            "```",
            "",
        ]
    roof, unprofiled = [], {}
    if d := result.get("decode"):
        prof = d.get("gpu_profile") or {}
        busy = f"{prof['gpu_ms_per_call']:.3f} ms" if "gpu_ms_per_call" in prof else "-"
        unprofiled.update({"decode": prof.get("skipped") or prof.get("error")} if busy == "-" else {})
        roof.append(f"| batch-1 decode step (context ~{d['mean_context']:.0f}) | {d['step_ms_median']:.3f} ms | "
                    f"{d['roofline_ms']:.3f} ms ({(d['weight_bytes'] + d['kv_bytes']) / 1e6:.0f} MB / {d['bandwidth_gb_s']:.0f} GB/s) | "
                    f"**{d['fraction_of_roofline']:.1%}** | {busy} | ≥ 70% |")  # fmt: skip
    if p := result.get("prefill"):
        prof = p.get("gpu_profile") or {}
        busy = f"{prof['gpu_ms_per_call']:.2f} ms" if "gpu_ms_per_call" in prof else "-"
        unprofiled.update({"prefill": prof.get("skipped") or prof.get("error")} if busy == "-" else {})
        roof.append(f"| prefill step, {p['prompts']} x {p['prompt_len']} tokens | {p['step_ms_median']:.2f} ms "
                    f"({_sig(p['achieved_tflops'])} TFLOP/s) | {p['flops'] / 1e12:.3g} TFLOP at {_sig(p['peak_tflops'])} TFLOP/s | "
                    f"**{p['fraction_of_peak']:.1%}** | {busy} | ≥ 50% |")  # fmt: skip
    if roof:
        lines += ["## Engine vs rooflines", "",
                  "| step | engine (wall, median) | roofline / peak | engine at | GPU busy per step (profiler) | target |",
                  "|---|---|---|---|---|---|", *roof, ""]  # fmt: skip
        lines += [f"No GPU busy time for {name}: {why}" for name, why in unprofiled.items()]
        lines += [""] if unprofiled else []
    if ab := result.get("ab"):
        u = ab["unloaded"]
        lines += [
            "## Engine-level A/B: iteration-level vs request-level scheduling (same engine, same trace)",
            "",
            f"Poisson arrivals (seed {args['seed']}), prompts {args['prompt_dist']}, outputs {args['output_dist']} "
            f"(ignore_eos), about {args['ab_seconds']:g} s of arrivals per point ({args['ab_min_requests']}-{args['ab_max_requests']} "
            f"requests). Unloaded per-token latency (median of {u['requests']} requests run alone): "
            f"**{u['norm_median_ms']:.2f} ms/token**; SLOs on the median normalized latency: "
            + ", ".join(f"{k} = {v:.2f} ms/token" for k, v in ab["slos_ms"].items()) + ".",
            "",
            "| SLO | iteration-level max req/s | request-level max req/s | ratio | ratio at interpolated crossings |",
            "|---|---|---|---|---|",
        ]  # fmt: skip
        for k in ab["slos_ms"]:
            it, rq, r = ab["sustained"]["iteration"][k], ab["sustained"]["request"][k], ab["ratios"][k]
            bound = "≥ " if r["lower_bound"] else ""
            lines.append(f"| {k} | {bound}{_fmt(it['max_rate'])} | {_fmt(rq['max_rate'])} | **{bound}{_fmt(r['max_rate_ratio'])}×** | "
                         f"{bound}{_fmt(r['crossing_ratio'])}× |")  # fmt: skip
        if reasons := [f"No ratio at {k}: {r['reason']}." for k, r in ab["ratios"].items() if "reason" in r]:
            lines += ["", *reasons]
        lines += ["", "| mode | offered req/s | requests | achieved req/s | out tok/s | norm. median ms/tok | norm. p90 | e2e median ms | unfinished |",
                  "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for mode in ("iteration", "request"):
            for p in ab["points"][mode]:
                lines.append(f"| {mode} | {p['offered_rate']:.2f} | {p['num_requests']} | {p['achieved_rate']:.2f} | "
                             f"{p['output_tokens_per_s']:.0f} | {p['norm_median_ms']:.2f} | {p['norm_p90_ms']:.2f} | "
                             f"{p['e2e_median_ms']:.0f} | {p['censored']} |")  # fmt: skip
        lines.append("")
    skipped = {n: v["skipped"] for n in SECTIONS if isinstance(v := result.get(n), dict) and "skipped" in v}
    if skipped:
        lines += ["## Not run on this device", "", *[f"- {name}: {why}" for name, why in skipped.items()], ""]
    if errors := result.get("errors"):
        lines += ["## Errors", "", *[f"- {name}: `{msg}`" for name, msg in errors.items()], ""]
    return "\n".join(lines)


# Each knob's default for the full run on a GPU, and (QUICK) for --quick: every section end to end in
# well under a minute on a small CPU, as CI runs it (tests/test_gpu_check.py). Flags given on the
# command line win over both.
DEFAULTS: dict[str, Any] = {
    "model": "gpt2-medium", "dtype": "bfloat16", "max_seqs": 64, "copy_mib": 2048, "matmul_n": 8192,
    "decode_prompt": 32, "decode_warmup": 10, "decode_steps": 200, "profile_steps": 20,
    "prefill": [32, 512], "prefill_reps": 5, "prompt_dist": "uniform:32:512",
    "output_dist": "lognormal:32:512", "unloaded_requests": 24, "ab_seconds": 8.0, "ab_min_requests": 24,
    "ab_max_requests": 5000, "ab_drain_s": 10.0, "ab_refine": 2, "ab_max_points": 9,
    "ab_max_factor": 256.0, "ab_budget_s": 200.0, "cpu_threads": 0,
}  # fmt: skip
QUICK: dict[str, Any] = {
    "model": "gpt2-tiny", "dtype": "float32", "max_seqs": 8, "copy_mib": 16,
    "matmul_n": 256, "decode_prompt": 16, "decode_warmup": 3, "decode_steps": 20, "profile_steps": 3,
    "prefill": [4, 64], "prefill_reps": 3, "prompt_dist": "uniform:8:48", "output_dist": "lognormal:8:48",
    "unloaded_requests": 4, "ab_seconds": 1.0, "ab_min_requests": 8, "ab_max_requests": 64,
    "ab_drain_s": 2.0, "ab_refine": 1, "ab_max_points": 3, "ab_max_factor": 4.0, "ab_budget_s": 10.0,
    "cpu_threads": 1,
}  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)

    def knob(flag: str, help: str = "", **kw: Any) -> None:
        """A flag whose default comes from DEFAULTS or, with --quick, QUICK (resolved after parsing)."""
        name = flag[2:].replace("-", "_")
        shown = " ".join(map(str, v)) if isinstance(v := DEFAULTS[name], list) else v
        quick = " ".join(map(str, q)) if isinstance(q := QUICK[name], list) else q
        if name == "dtype":
            quick = f"{quick} on CPU, {shown} on CUDA"
        text = f"{help}; default" if help else "default"
        p.add_argument(flag, default=None, help=f"{text} {shown} (--quick: {quick})", **kw)

    p.add_argument("--out", default="gpu_results", help="folder for gpu_check.json and summary.md")
    p.add_argument(
        "--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {', '.join(SECTIONS)}"
    )
    p.add_argument("--device", default="cuda")
    p.add_argument("--quick", action="store_true",
                   help="small, fast settings for every knob not given explicitly (the CI check on CPU)")  # fmt: skip
    knob("--model", "preset or HF GPT-2 checkpoint directory")
    knob("--dtype", choices=["bfloat16", "float16", "float32"])
    knob("--max-seqs", "requests per iteration, both scheduling modes", type=int)
    knob("--copy-mib", type=int)
    knob("--matmul-n", type=int)
    knob("--decode-prompt", type=int)
    knob("--decode-warmup", type=int)
    knob("--decode-steps", type=int)
    knob("--profile-steps", type=int)
    knob("--prefill", type=int, nargs=2, metavar=("PROMPTS", "LEN"))
    knob("--prefill-reps", type=int)
    knob("--prompt-dist", "A/B prompt lengths (ORCA §6: U(32, 512))")
    knob("--output-dist", "A/B output lengths: long-tailed")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--slo-multiples", type=float, nargs="+", default=[2.0, 3.0, 6.0],
                   help="SLOs as multiples of the unloaded per-token latency; the first is the headline")  # fmt: skip
    knob("--unloaded-requests", type=int)
    knob("--ab-seconds", "arrival span aimed at per point", type=float)
    knob("--ab-min-requests", type=int)
    knob("--ab-max-requests", "a memory bound, not a time bound", type=int)
    knob("--ab-drain-s", "a point stops this long after its last arrival", type=float)
    knob("--ab-refine", "bisections of the headline SLO's crossing", type=int)
    knob("--ab-max-points", "per mode", type=int)
    knob("--ab-max-factor", "rates stay within base / F .. base x F", type=float)
    knob("--ab-budget-s", "no new A/B point starts after this (both modes)", type=float)
    # One thread by default in --quick: on a small machine shared with other jobs, torch's OpenMP
    # threads spin against them (a CI run took 30-50 s with 2 threads on 2 busy cores, 11 s with 1).
    knob("--cpu-threads", "torch's intra-op threads with --device cpu, 0 = torch's own choice", type=int)
    args = p.parse_args(argv)
    for name, full in DEFAULTS.items():
        if getattr(args, name) is None:
            quick = args.quick and (name != "dtype" or torch.device(args.device).type == "cpu")
            setattr(args, name, QUICK[name] if quick else full)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = set(sections) - set(SECTIONS)
    if unknown:
        raise SystemExit(f"unknown section(s) {sorted(unknown)}; choose from {', '.join(SECTIONS)}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "benchmarks/gpu_check.py needs a CUDA GPU (or --device cpu for a plumbing check)", file=sys.stderr
        )
        return 2
    if device.type != "cuda" and "kernels" in sections and "triton" not in sys.modules:
        # The kernels section runs Triton's interpreter off CUDA, and triton.language fixes the mode
        # when it is first imported: set it now. The engine on CPU uses its own kernels, not Triton's.
        os.environ["TRITON_INTERPRET"] = "1"
    import triton

    if device.type == "cpu" and args.cpu_threads > 0:
        torch.set_num_threads(args.cpu_threads)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "command": " ".join(["benchmarks/gpu_check.py", *(argv if argv is not None else sys.argv[1:])]),
        "commit": machine.code_revision(BENCH_DIR.parent),
        "args": vars(args),
        "environment": {
            "device": torch.cuda.get_device_name(device)
            if device.type == "cuda"
            else platform.processor() or "cpu",
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "host_cpu": machine.summary(),
            "torch_threads": torch.get_num_threads(),
        },  # fmt: skip
        "errors": {},
        "seconds": {},  # wall time of each section
    }
    needs_ceilings = {"kernels", "decode", "prefill"} & set(sections)
    if "ceilings" in sections or needs_ceilings:
        print("== ceilings", flush=True)
        started = time.perf_counter()
        result["ceilings"] = section_ceilings(args, device)
        result["seconds"]["ceilings"] = time.perf_counter() - started
    llm: LLM | None = None
    for name in sections:
        if name == "ceilings":
            continue
        print(f"== {name}", flush=True)
        started = time.perf_counter()
        try:
            if name == "kernels":
                result[name] = section_kernels(args, device, result["ceilings"])
            else:
                if llm is None:  # one iteration-level engine serves decode, prefill and the A/B's first half
                    llm = make_llm(args, "iteration")
                    warm_up(llm, args, model_config(args))
                if name == "decode":
                    result[name] = section_decode(args, device, llm, result["ceilings"])
                elif name == "prefill":
                    result[name] = section_prefill(args, device, llm, result["ceilings"])
                elif name == "ab":
                    result[name] = section_ab(args, llm)
        except Exception as exc:  # one broken section must not cost the others' figures
            import traceback

            traceback.print_exc()
            result["errors"][name] = repr(exc)
        result["seconds"][name] = time.perf_counter() - started
        if isinstance(result.get(name), dict) and "skipped" in result[name]:
            print(f"   {name} skipped: {result[name]['skipped']}", flush=True)
        print(f"   ({name}: {result['seconds'][name]:.1f} s)", flush=True)
        # After every section: a run cut short by a time limit still leaves what it measured.
        (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
        (out / "summary.md").write_text(render_markdown(result))
    (out / "gpu_check.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "summary.md").write_text(render_markdown(result))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'summary.md'}")
    kernels_bad = isinstance(result.get("kernels"), dict) and result["kernels"].get("all_triton_ok") is False
    return 1 if result["errors"] or kernels_bad else 0


if __name__ == "__main__":
    sys.exit(main())
