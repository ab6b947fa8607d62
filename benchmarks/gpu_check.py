"""GPU check: the device's own ceilings, the Triton kernels against them, the engine's rooflines, CUDA
graphs on vs off, and the engine-level A/B of iteration-level vs request-level scheduling. Writes
gpu_check.json (every raw figure) and summary.md to --out, after every section.

    python benchmarks/gpu_check.py --out gpu_results                     # every section (needs CUDA)
    python benchmarks/gpu_check.py --sections ceilings,decode            # some of them
    python benchmarks/gpu_check.py --device cpu --quick --out DIR        # plumbing check on a CPU (CI)

--quick gives every knob not set explicitly a small value (gpt2-tiny, float32 on CPU, a short A/B):
every section runs end to end in well under a minute on a small CPU (tests/benchmarks/test_gpu_check.py, `make
gpu-check-cpu`). On CPU its figures prove the code paths, not a GPU's: the ceilings are host memory
and CPU matmul, the kernels run in Triton's interpreter (correctness against torch, no timings), no
CUDA graph is captured (the static-buffer decode path runs eagerly instead) and the device profile is
absent (it needs CUDA); each says so in the report.

Sections (all measured in this run, each figure against what this device measured, not a datasheet):
  ceilings  device-to-device copy bandwidth (bytes read + written) and a large bf16 matmul's FLOP/s
  kernels   benchmarks/kernels.py (Triton kernels vs torch and SDPA) with those ceilings as the peaks;
            on CPU its --interpret mode (TRITON_INTERPRET=1, set before triton is imported)
  decode    the engine's batch-1 decode step vs the HBM roofline: (weight bytes + K/V bytes read) /
            copy bandwidth; also the GPU kernel time per step (torch profiler) to show where it goes
  prefill   one large prefill step (many prompts in one iteration) vs the measured matmul peak
  graphs    for each of --graph-models (GPT-2-medium and Qwen2.5-0.5B geometry), an engine with CUDA
            graphs (the default) and one with enforce_eager=True, one after the other: the batch-1
            decode step, decode throughput at 1, 8, 64 and 256 running, on CUDA the GPU busy time per
            step (so host time and GPU idle) and kernels per decoder layer, and graph tokens == eager
            tokens (exact; a mismatch fails the run); each figure against the issue's targets
  ab        the same engine code with scheduling="iteration" vs "request" (its max batch swept) on one
            seeded Poisson trace with long-tailed outputs, requests fed in at their arrival times, each
            point run three times (overloaded ones once); median normalized latency (end-to-end /
            output tokens) per rate, and the max achieved rate each mode sustains under an SLO set
            relative to the unloaded per-token latency measured in this run
"""

from __future__ import annotations

import argparse
import functools
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

from orca_backend import LLM, EngineConfig, SamplingParams
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.worker.cuda_graphs import capture_sizes
from orca_client import machine
from orca_client.workload import TraceRequest, synthetic_trace

BENCH_DIR = Path(__file__).resolve().parent
SECTIONS = ("ceilings", "kernels", "decode", "prefill", "graphs", "ab")


def load_sibling(name: str) -> ModuleType:
    """A script beside this one, by path: the name `kernels` would clash with the repository's kernels/
    folder (and with the PyPI package of that name)."""
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


def copy_seconds(device: torch.device, nbytes: int, reps: int = 20,
                 timer: Callable[..., float] = median_seconds) -> float:  # fmt: skip
    """Seconds of a device copy of `nbytes` random bytes by `timer` (median_seconds, or graph_seconds
    for a device time beside others taken so): over buffers far larger than L2 (50 MB on an H100) it
    reads and writes every byte once, the memory's ceiling."""
    src = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, device=device)  # not zeros (see METHOD.md)
    dst = torch.empty_like(src)
    return timer(functools.partial(dst.copy_, src), device, reps=reps)


# What the L2 flush writes between graph-timed calls: larger than any lent GPU's L2 (50 MB on an H100,
# 60 MB on an H200), so every call reads its operands from memory, as a layer does inside a step.
FLUSH_BYTES = 256 << 20


def graph_seconds(fn: Callable[[], object], device: torch.device, reps: int, calls: int = 10) -> float:
    """Median device time of one call of a capture-safe op, the host's launch cost left out (what a
    step replayed from a CUDA graph pays): a graph of `calls` x (L2 flush, call) replayed `reps` times,
    less a graph of the flushes alone. On a CPU: median_seconds."""
    if device.type != "cuda":
        return median_seconds(fn, device, reps)
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
    side = torch.cuda.Stream(device)  # capture's warm-up on a side stream, as torch.cuda.graphs asks
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    with_call, flushes = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(with_call):
        for _ in range(calls):
            flush.zero_()
            fn()
    with torch.cuda.graph(flushes):
        for _ in range(calls):
            flush.zero_()
    total = median_seconds(with_call.replay, device, reps, warmup=1)
    return max(total - median_seconds(flushes.replay, device, reps, warmup=1), 0.0) / calls


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
def model_config(args: argparse.Namespace) -> GPT2Config:
    return EngineConfig(model=args.model).model_config()


def make_llm(args: argparse.Namespace, scheduling: str, max_seqs: int | None = None) -> LLM:
    """The A/B's (and decode's, prefill's) engine: graphs on where the device has them (the default),
    steps synchronous in both modes (these sections time whole steps; the graphs section measures
    async scheduling, on by default on CUDA for iteration-level engines, with its own engine)."""
    cfg = model_config(args)
    max_seqs = max_seqs or args.max_seqs
    # Room for every request of a full batch at the model's whole context: nothing is ever preempted.
    kv_tokens = max_seqs * cfg.max_context
    return LLM(
        args.model, device=args.device, dtype=args.dtype, kv_capacity_tokens=kv_tokens, scheduling=scheduling,
        max_num_seqs=max_seqs, async_scheduling=False,
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
    n = args.copy_mib << 20
    copy_s = copy_seconds(device, n)
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


def decode_bytes(cfg: GPT2Config, elt: int, context: float) -> tuple[int, float]:
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


def prefill_flops(cfg: GPT2Config, num_prompts: int, prompt_len: int) -> float:
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


# ------------------------------------------------------------------------------------------ graphs
# Time on an H100: per model two engines, each built in ~5-10 s (seeded random weights; graphed, nine
# captures), plus ~10-30 s of Triton compiles the first time a model family's shapes run (Qwen2.5's
# kernels: the engine before it ran GPT-2). Each engine then runs ~480 decode steps: the token check
# (16 requests, 64 steps), batch 1 (10 warm-up + 200 timed + 40 profiled) and 8, 64, 256 (10 + 50
# each, + 40 profiled at 64), and 5 prefills: at ~1-2 ms a graphed step and ~12-20 ms an eager one,
# ~1 s graphed and ~8 s eager, plus ~5 s of profiler overhead. The section takes ~60-100 s.
# The targets the graphs section reports against (the table), for the models they name. The
# step-time and rate targets are for graphed steps; kernels per layer is counted in an eager step.
GRAPH_TARGETS: list[dict[str, Any]] = [
    {"key": "batch1_step_ms", "model": "gpt2-medium", "what": "batch-1 decode step (graphs on)", "op": "<=",
     "target": 1.0, "stretch": 0.5, "unit": "ms"},
    {"key": "batch1_step_ms", "model": "qwen2.5-0.5b", "what": "batch-1 decode step (graphs on)", "op": "<=",
     "target": 1.2, "unit": "ms"},
    {"key": "tokens_per_s@256", "model": "gpt2-medium", "what": "decode throughput at 256 running (graphs on)",
     "op": ">=", "target": 15000.0, "unit": "tok/s"},
    {"key": "kernels_per_layer", "model": None, "what": "kernels per decoder layer in a decode step", "op": "<=",
     "target": 6.0, "unit": ""},
    {"key": "host_ms@1", "model": None, "what": "host time per graphed decode step at 1 running (step - GPU busy)",
     "op": "<=", "target": 0.3, "unit": "ms"},
    {"key": "host_ms@64", "model": None, "what": "host time per graphed decode step at 64 running (step - GPU busy)",
     "op": "<=", "target": 0.3, "unit": "ms"},
    {"key": "gpu_idle@64", "model": None, "what": "GPU idle between decode steps at 64 running (1 - busy / step; async scheduling)",
     "op": "<=", "target": 0.10, "unit": "of the step"},
]  # fmt: skip
PROFILED_BATCHES = (1, 64)  # the batches whose GPU busy time is profiled (CUDA), where present
LAYER_MARK = "gpu_check.decoder_layer"


class _MarkedLayers(list):
    """A runner's K/V pool list whose iteration opens a profiler range around each step of the
    consumer's loop: the model's layer loop zips over the pool, so each range holds one decoder layer's
    launches (the last closes when zip(strict=True) checks the pool is exhausted)."""

    def __iter__(self):  # type: ignore[override]
        for item in list.__iter__(self):
            with torch.profiler.record_function(LAYER_MARK):
                yield item


def kernels_per_layer(llm: LLM, device: torch.device, num_layers: int) -> dict[str, Any]:
    """Kernels per decoder layer in one eager decode step: the kernel launches (cudaLaunchKernel*,
    cuLaunchKernel*: cuBLAS, torch and Triton alike) the torch profiler records on the host inside each
    layer's range, over the layers; what is launched outside them (embedding, final norm, LM head,
    sampling) is reported apart. The device kernel count of the same step is the cross-check."""
    if device.type != "cuda":
        return {"skipped": f"counting kernels needs CUDA (torch profiler), not {device.type}"}
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    runner = llm.engine.core.executor.runner
    pool = runner.kv_caches
    runner.kv_caches = _MarkedLayers(pool)
    try:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            llm.engine.step()
            sync(device)
    finally:
        runner.kv_caches = pool
    events = prof.events()
    layers = sorted((e.time_range.start, e.time_range.end) for e in events if e.name == LAYER_MARK)
    launches = sorted((e for e in events if e.device_type == DeviceType.CPU and "LaunchKernel" in e.name),
                      key=lambda e: e.time_range.start)  # fmt: skip
    kernels = sorted((e for e in events if e.device_type == DeviceType.CUDA and not e.name.startswith(("Memcpy", "Memset"))),
                     key=lambda e: e.time_range.start)  # fmt: skip

    def layer_of(start: float) -> int | None:
        return next((i for i, (lo, hi) in enumerate(layers) if lo <= start <= hi), None)

    where = [layer_of(e.time_range.start) for e in launches]
    in_layers = sum(w is not None for w in where)
    result: dict[str, Any] = {
        "layers_marked": len(layers), "layers": num_layers, "launches": len(launches), "device_kernels": len(kernels),
        "launches_in_layers": in_layers, "launches_outside_layers": len(launches) - in_layers,
        "how": "kernel launch calls (cudaLaunchKernel*/cuLaunchKernel*) the torch profiler recorded on the host "
               "inside each decoder layer's loop iteration (a record_function range per layer) in one eager "
               "batch-1 decode step, divided by the layers; outside the layers: embedding, final norm, LM head, "
               "sampling",
    }  # fmt: skip
    if len(layers) != num_layers or not in_layers:
        # No usable ranges (or no launch calls seen): the device's count over the layers, an upper bound.
        result["kernels_per_layer"] = len(kernels) / num_layers
        result["upper_bound"] = True
        result["how"] = (f"{len(layers)} layer ranges and {in_layers} launch calls inside them for {num_layers} layers: "
                         "instead every device kernel of the step over the layers (an upper bound: it includes "
                         "embedding, final norm, LM head and sampling)")  # fmt: skip
        return result
    result["kernels_per_layer"] = in_layers / num_layers
    result["per_layer"] = [where.count(i) for i in range(num_layers)]
    if len(launches) == len(kernels):  # one stream: the i-th launch is the i-th kernel to run
        result["first_layer_kernels"] = [k.name[:120] for k, w in zip(kernels, where, strict=True) if w == 0]
        result["outside_kernels"] = [k.name[:120] for k, w in zip(kernels, where, strict=True) if w is None]
    else:
        result["note"] = f"{len(launches)} launch calls but {len(kernels)} device kernels: names not matched"
    return result


def graph_kv_tokens(args: argparse.Namespace, block_size: int = 16) -> int:
    """A pool for the largest batch's requests at their longest (prompt + every step the measurement
    takes), whole blocks each, and for the batch-1 request's longer run."""

    def need(n: int, tokens: int) -> int:
        return n * (-(-tokens // block_size) + 1) * block_size

    return max(need(max(args.graph_batches), args.decode_prompt + decode_budget(args, args.graph_steps) + 1),
               need(1, args.decode_prompt + decode_budget(args, args.decode_steps) + 1),
               need(args.graph_token_requests, args.decode_prompt + 4 * args.graph_token_requests + 1))  # fmt: skip


def decode_budget(args: argparse.Namespace, steps: int) -> int:
    """Tokens a request of the decode measurement generates: the prefill's, the warm-up, the timed
    steps, both profiles and the kernel count, so every measured step decodes every request."""
    return 1 + args.decode_warmup + steps + 2 * args.profile_steps + 3


def graph_engine(
    args: argparse.Namespace, device: torch.device, model: str, graphs: bool, async_scheduling: bool = False
) -> tuple[LLM, str]:  # fmt: skip
    """One engine of the graphs section and how its decode-only steps run: "captured" (CUDA graphs
    replayed), "static" (a CPU: the same padded static-buffer forward run eagerly, nothing captured)
    or "eager" (graphs off, or not captured: the runner logged why); "+async" with async scheduling."""
    llm = LLM(model, device=args.device, dtype=args.dtype, kv_capacity_tokens=graph_kv_tokens(args),
              max_num_seqs=args.graph_max_seqs, enforce_eager=not graphs, async_scheduling=async_scheduling)  # fmt: skip
    runner = llm.engine.core.executor.runner
    suffix = "+async" if async_scheduling else ""
    if not graphs:
        return llm, "eager" + suffix
    if runner.decode_graphs is not None and runner.decode_graphs.graphs:
        return llm, "captured" + suffix
    if device.type != "cuda":
        runner.decode_graphs = runner.static_decode(capture_sizes(args.graph_max_seqs))
        return llm, "static" + suffix
    return llm, "eager" + suffix


def float32_tokens(
    args: argparse.Namespace, model: str, graphs: bool, prompts: list[list[int]], params: list[SamplingParams]
) -> list[list[int]]:
    """The token check's outputs from a float32 engine of its own (graphs on or off), sized for it."""
    llm = LLM(model, device=args.device, dtype="float32", kv_capacity_tokens=graph_kv_tokens(args),
              max_num_seqs=len(prompts), enforce_eager=not graphs)  # fmt: skip
    try:
        return [o.output_ids for o in llm.generate(prompts, params)]
    finally:
        del llm
        release(None)


def token_workload(
    vocab: int, n: int, prompt_len: int, seed: int
) -> tuple[list[list[int]], list[SamplingParams]]:
    """n greedy requests whose outputs end one after another (4, 8, 12, ... tokens), so the decode
    batch shrinks through every size from n to 1: every bucket, most of them padded."""
    rng = random.Random(seed)
    prompts = [
        [rng.randrange(1, vocab) for _ in range(rng.randint(max(1, prompt_len // 2), prompt_len))]
        for _ in range(n)
    ]
    params = [SamplingParams(max_tokens=4 + 4 * i, temperature=0.0, ignore_eos=True) for i in range(n)]
    return prompts, params


def decode_batch(
    args: argparse.Namespace,
    device: torch.device,
    llm: LLM,
    mode: str,
    n: int,
    steps: int,
    count_kernels: bool,
) -> dict[str, Any]:
    """n requests decoding together: one prefill step for all of them, warm-up steps, then `steps`
    timed decode-only steps (each synchronized, as section_decode times them). On CUDA at the
    PROFILED_BATCHES: the GPU busy time per step (profiler) and, graphed, one graph replay's GPU time."""
    engine = llm.engine
    rng = random.Random(n)
    vocab = engine.model_config.vocab_size
    prompts = [[rng.randrange(1, vocab) for _ in range(args.decode_prompt)] for _ in range(n)]
    params = SamplingParams(max_tokens=decode_budget(args, steps), temperature=0.0, ignore_eos=True)
    tokens, ended = [0], []

    def on_output(out) -> None:
        tokens[0] += len(out.new_token_ids)
        if out.finished:
            ended.append(out.request_id)

    streams = engine.add_requests(prompts, params, on_output=on_output)
    try:
        return _decode_batch(args, device, llm, mode, n, steps, count_kernels, tokens, ended)
    finally:  # the engine is left empty, whatever happened
        for s in streams:
            engine.abort_request(s.request_id)
        drain(llm)


def _decode_batch(
    args: argparse.Namespace, device: torch.device, llm: LLM, mode: str, n: int, steps: int,
    count_kernels: bool, tokens: list[int], ended: list[str],
) -> dict[str, Any]:  # fmt: skip
    engine = llm.engine
    engine.step()
    if tokens[0] != n:
        raise RuntimeError(
            f"the prefill step gave {tokens[0]} first tokens for {n} prompts: they did not share it"
        )
    for _ in range(args.decode_warmup):
        engine.step()
    before = tokens[0]
    if mode.endswith("+async"):
        # Steps overlap (one is launched while the last runs): a synchronized step would stop that,
        # so the steps are timed together and each is their mean.
        total = wall_seconds(lambda: [engine.step() for _ in range(steps)], device)
        times = [total / steps] * steps
    else:
        times = [wall_seconds(engine.step, device) for _ in range(steps)]
    if tokens[0] - before != n * steps:
        raise RuntimeError(
            f"{tokens[0] - before} tokens in {steps} steps of {n} requests: not every step decoded them all"
        )
    step = statistics.median(times)
    result: dict[str, Any] = {
        "running": n, "steps": steps, "step_ms_median": step * 1e3, "step_ms_p10": _pct(times, 10) * 1e3,
        "step_ms_p90": _pct(times, 90) * 1e3, "tokens_per_s": n * steps / sum(times),
    }  # fmt: skip
    if device.type == "cuda" and n in PROFILED_BATCHES:
        profile = gpu_kernel_time(engine.step, args.profile_steps, device)
        result["gpu_profile"] = profile
        busy_ms, source = (profile or {}).get("gpu_ms_per_call"), "profiler"
        if mode.startswith("captured"):
            graphs = engine.core.executor.runner.decode_graphs
            graph = graphs.graphs[graphs.bucket(n)]
            # The buffers hold the last step: a replay recomputes it, writing the same K/V to the same slots.
            result["graph_replay_ms"] = median_seconds(graph.replay, device, reps=20) * 1e3
            if busy_ms is None or busy_ms < 0.8 * result["graph_replay_ms"]:
                # No profile, or one that missed the graph's kernels (less GPU time than a replay takes).
                busy_ms, source = result["graph_replay_ms"], "graph replay (CUDA events; forward only)"
        if busy_ms is not None:
            result |= {"gpu_busy_ms": busy_ms, "gpu_busy_source": source, "host_ms": step * 1e3 - busy_ms,
                       "gpu_idle_fraction": 1.0 - busy_ms / (step * 1e3)}  # fmt: skip
    if count_kernels:
        result["kernel_count"] = kernels_per_layer(llm, device, engine.model_config.num_layers)
    if ended:
        raise RuntimeError(
            f"{len(ended)} of the {n} requests ended before the measurement did: raise their budget"
        )
    return result


def graph_model(args: argparse.Namespace, device: torch.device, model: str) -> dict[str, Any]:
    """One model's graphs-on vs graphs-off figures: two engines, built and measured one after the other."""
    cfg = EngineConfig(model=model).model_config()
    result: dict[str, Any] = {
        "model": model, "dtype": args.dtype, "layers": cfg.num_layers, "parameters": cfg.num_parameters(),
        "max_num_seqs": args.graph_max_seqs, "capture_sizes": capture_sizes(args.graph_max_seqs),
        "prompt_tokens": args.decode_prompt, "kv_capacity_tokens": graph_kv_tokens(args), "modes": {},
        "build_seconds": {}, "decode": {},
    }  # fmt: skip
    outputs: dict[str, list[list[int]]] = {}
    errors: list[str] = []
    # "async": graphs on and async scheduling (the next step scheduled while one runs), where the GPU's
    # idle time between steps is what changes.
    for name, graphs, async_scheduling in (("on", True, False), ("off", False, False), ("async", True, True)):
        started = time.perf_counter()
        llm, mode = graph_engine(args, device, model, graphs, async_scheduling)
        try:
            result["build_seconds"][name] = time.perf_counter() - started
            result["modes"][name] = mode
            prompts, params = token_workload(
                cfg.vocab_size, args.graph_token_requests, args.decode_prompt, args.seed
            )
            completions = llm.generate(prompts, params)  # also the warm-up of every bucket
            # The token check (graphs on vs off) is exact in float32 only: in half precision a padded
            # batch's GEMMs may round differently from an unpadded one's and flip a near-tie, with
            # nothing wrong. Async scheduling's tokens are checked by the CUDA tests.
            if name != "async":
                outputs[name] = ([o.output_ids for o in completions] if args.dtype == "float32"
                                 else float32_tokens(args, model, graphs, prompts, params))  # fmt: skip
            result["decode"][name] = {}
            for n in args.graph_batches:
                steps = args.decode_steps if n == 1 else args.graph_steps
                try:
                    figures = decode_batch(
                        args, device, llm, mode, n, steps, count_kernels=not graphs and n == 1
                    )
                except Exception as exc:  # this batch's figures are lost, not the others'
                    import traceback

                    traceback.print_exc()
                    result["decode"][name][str(n)] = {"running": n, "error": repr(exc)}
                    errors.append(f"graphs {name}, {n} running: {exc!r}")
                    continue
                if "kernel_count" in figures:
                    result["kernels"] = figures.pop("kernel_count")
                result["decode"][name][str(n)] = figures
                extra = (f", GPU busy {figures['gpu_busy_ms']:.3f} ms, host {figures['host_ms']:.3f} ms, "
                         f"idle {figures['gpu_idle_fraction']:.0%}") if "gpu_busy_ms" in figures else ""  # fmt: skip
                print(f"  {model} graphs {name} ({mode}): {n:4d} running: step {figures['step_ms_median']:.3f} ms "
                      f"(median of {steps}), {figures['tokens_per_s']:.0f} tok/s{extra}", flush=True)  # fmt: skip
        finally:
            del llm  # the only reference: the engine's memory goes before the next one is built
            release(None)
    result["captured"] = result["modes"]["on"] == "captured"
    mismatched = [
        {"request": i, "tokens": len(a), "first_difference": next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))}
        for i, (a, b) in enumerate(zip(outputs["on"], outputs["off"], strict=True)) if a != b
    ]  # fmt: skip
    result["token_check"] = {
        "dtype": "float32", "requests": len(outputs["on"]), "tokens": sum(map(len, outputs["off"])), "mismatched": mismatched,
        "max_tokens": [4 + 4 * i for i in range(args.graph_token_requests)],
    }  # fmt: skip
    result["tokens_equal"] = not mismatched
    on, off = result["decode"]["on"], result["decode"]["off"]
    if "step_ms_median" in on.get("1", {}) and "step_ms_median" in off.get("1", {}):
        result["batch1_step_ms"] = {"on": on["1"]["step_ms_median"], "off": off["1"]["step_ms_median"]}
        result["batch1_speedup"] = off["1"]["step_ms_median"] / on["1"]["step_ms_median"]
    result["targets"] = graph_targets(result, device)
    result["errors"] = errors
    print(f"  {model}: graph tokens == eager tokens: {result['tokens_equal']} ({len(outputs['on'])} requests, "
          f"{result['token_check']['tokens']} tokens); graphs on: {result['modes']['on']}", flush=True)  # fmt: skip
    return result


def graph_targets(m: dict[str, Any], device: torch.device) -> list[dict[str, Any]]:
    """Each target of GRAPH_TARGETS that names this model (or any model), with the measured value and
    whether it is met; on a device other than CUDA, or without the figure, `met` is None and says why."""
    on = m["decode"].get("on", {})
    values: dict[str, float | None] = {
        "batch1_step_ms": on.get("1", {}).get("step_ms_median"),
        "tokens_per_s@256": on.get("256", {}).get("tokens_per_s"),
        "kernels_per_layer": (m.get("kernels") or {}).get("kernels_per_layer"),
        "host_ms@1": on.get("1", {}).get("host_ms"), "host_ms@64": on.get("64", {}).get("host_ms"),
        "gpu_idle@64": (m["decode"].get("async") or on).get("64", {}).get("gpu_idle_fraction"),
    }  # fmt: skip
    rows = []
    for t in GRAPH_TARGETS:
        if t["model"] not in (None, m["model"]):
            continue
        value = values[t["key"]]
        row = {**t, "value": value, "met": None}
        if device.type != "cuda":
            row["why"] = f"not a GPU run ({device.type})"
        elif value is None:
            row["why"] = "not measured in this run"
        elif t["key"] in ("host_ms@1", "host_ms@64", "gpu_idle@64") and m["modes"]["on"] != "captured":
            row["why"] = "graphs were not captured"
        else:
            row["met"] = value <= t["target"] if t["op"] == "<=" else value >= t["target"]
            if "stretch" in t:
                row["stretch_met"] = value <= t["stretch"]
        rows.append(row)
    return rows


def section_graphs(args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    """CUDA graphs on vs off (enforce_eager) for each of --graph-models, side by side in this run."""
    result: dict[str, Any] = {"models": {}, "errors": {}}
    if device.type != "cuda":
        result["note"] = (f"no CUDA graph is captured on {device.type}: 'graphs on' ran the padded static-buffer "
                          "decode forward a CUDA graph would replay, eagerly (runner.static_decode); its timings "
                          "say nothing about CUDA graphs, its tokens check the static path")  # fmt: skip
    for model in args.graph_models:
        try:
            result["models"][model] = m = graph_model(args, device, model)
            if m["errors"]:
                result["errors"][model] = "; ".join(m["errors"])
        except Exception as exc:  # one model's failure must not cost the other's figures
            import traceback

            traceback.print_exc()
            result["errors"][model] = repr(exc)
    models = result["models"].values()
    result["captured"] = bool(models) and all(m["captured"] for m in models)
    result["tokens_equal"] = bool(models) and all(m["tokens_equal"] for m in models)
    return result


# ---------------------------------------------------------------------------------------------- A/B
# Time on an H100 (GPT-2-medium, bf16; graphed decode steps of ~1-3 ms, eager prefill and mixed steps
# of ~10-15 ms on these hosts' slow cores). Every point is --ab-reps (3) replays of one seeded trace,
# each lasting its arrival span, max(--ab-seconds, --ab-min-requests / rate) = 2.5 s at >= 6.4 req/s
# (16 s at 1 req/s), plus its tail (the longest request's decode, ~1-3 s; at most --ab-drain-s, 8 s,
# when overloaded, and then the point runs once): ~10-15 s a point where the one-at-a-time rate is
# ~10 req/s (graphed decode), ~35 s where it is ~1.5 req/s (the eager engine of the last recorded
# run). --ab-budget-s (150 s) bounds the section from its start: warm-up and the unloaded latency (16
# requests alone, ~3-10 s), then iteration-level gets 1.5 shares of what is left and each
# request-level max batch one share, its engine's build (random weights, graph capture, warm-up:
# ~5-10 s) included: ~45 s (3-4 points) and ~30 s (about 2 points) each at ~10 req/s. A point starts
# only when its three runs are estimated (span + the longest unloaded request, each) to fit its
# engine's share, but each engine's first point always runs: the section takes ~150-180 s.
@dataclass
class Run:
    """One replay of a point's trace."""

    num_requests: int
    completed: int
    censored: int  # unfinished at the time limit (or never sent): their latency is a lower bound
    duration_s: float  # trace start to the last completion (or the time limit): the run's wall time
    achieved_rate: float  # completed requests / duration
    output_tokens_per_s: float  # output tokens of the finished requests only / duration
    norm_median_ms: float  # median normalized latency (end-to-end / output tokens), ms per token
    norm_p90_ms: float
    e2e_median_ms: float


@dataclass
class Point:
    """One offered rate of one engine, replayed `reps` times (once when overloaded: see run_point):
    each figure is the median over the runs, with its range (min, max) beside it; `censored` is the
    most any run left unfinished."""

    mode: str  # "iteration" or "request"
    max_batch: int  # the engine's max_num_seqs
    offered_rate: float  # req/s of the trace: what the sweep steps along, not what is reported as sustained
    num_requests: int
    reps: int
    completed: int  # fewest completed in a run
    censored: int
    duration_s: float
    achieved_rate: float
    achieved_rate_range: tuple[float, float]
    output_tokens_per_s: float
    output_tokens_per_s_range: tuple[float, float]
    norm_median_ms: float
    norm_median_ms_range: tuple[float, float]
    norm_p90_ms: float
    e2e_median_ms: float
    runs: list[dict[str, Any]]

    @classmethod
    def of(cls, mode: str, max_batch: int, rate: float, runs: list[Run]) -> Point:
        def med(name: str) -> float:
            return statistics.median(getattr(r, name) for r in runs)

        def span(name: str) -> tuple[float, float]:
            values = [getattr(r, name) for r in runs]
            return min(values), max(values)

        return cls(
            mode, max_batch, rate, runs[0].num_requests, len(runs), min(r.completed for r in runs),
            max(r.censored for r in runs), med("duration_s"), med("achieved_rate"), span("achieved_rate"),
            med("output_tokens_per_s"), span("output_tokens_per_s"), med("norm_median_ms"), span("norm_median_ms"),
            med("norm_p90_ms"), med("e2e_median_ms"), [asdict(r) for r in runs],
        )  # fmt: skip

    def meets(self, slo_ms: float) -> bool:
        """Every run finished every request and the runs' median normalized latency met the SLO."""
        return self.censored == 0 and self.norm_median_ms <= slo_ms


def _pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


def replay(llm: LLM, trace: list[TraceRequest], time_limit_s: float) -> tuple[Run, list[float], list[float]]:
    """Feeds each request into the engine at its arrival time (between iterations, as a server's loop
    would) and steps the engine on this thread. Latency runs from the trace's arrival time, so time a
    request waits for the iteration in progress counts, as it would for a client.

    Returns the run's figures and its normalized (s/token) and end-to-end (s) latencies."""
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
    completed = len(finish)
    finished_tokens = sum(sent[rid][1] for rid in finish)  # unfinished requests' tokens do not count
    run = Run(
        len(trace), completed, censored, duration, completed / duration, finished_tokens / duration,
        statistics.median(norm) * 1e3, _pct(norm, 90) * 1e3, statistics.median(e2e) * 1e3,
    )  # fmt: skip
    return run, norm, e2e


def point_trace(args: argparse.Namespace, rate: float, cfg: GPT2Config) -> list[TraceRequest]:
    n = min(args.ab_max_requests, max(args.ab_min_requests, math.ceil(rate * args.ab_seconds)))
    # Same seed at every rate: the same requests in the same order, arrival gaps scaled by 1 / rate.
    return synthetic_trace(
        n, args.prompt_dist, args.output_dist, cfg.vocab_size, request_rate=rate, seed=args.seed
    )


def run_point(
    args: argparse.Namespace, llm: LLM, mode: str, max_batch: int, rate: float, cfg: GPT2Config
) -> Point:
    """--ab-reps replays of the same trace (the same requests at the same arrival times). An
    overloaded point (its first run left requests unfinished at the time limit) is not repeated: it
    fails every SLO whatever the other runs would give, and each would cost the whole time limit."""
    trace = point_trace(args, rate, cfg)
    limit = trace[-1].arrival + args.ab_drain_s
    runs = [replay(llm, trace, limit)[0]]
    while len(runs) < args.ab_reps and not runs[0].censored:
        runs.append(replay(llm, trace, limit)[0])
    point = Point.of(mode, max_batch, rate, runs)
    lo, hi = point.norm_median_ms_range
    flag = (
        f", up to {point.censored} unfinished at the {limit:.0f} s limit (lower bounds)"
        if point.censored
        else ""
    )
    print(f"  {mode:>9} (batch {max_batch:3d}) @ {rate:7.2f} req/s offered, {len(trace):4d} requests x {len(runs)}: "
          f"median normalized {point.norm_median_ms:8.2f} ms/token ({lo:.2f}-{hi:.2f}), achieved "
          f"{point.achieved_rate:6.2f} req/s ({point.achieved_rate_range[0]:.2f}-{point.achieved_rate_range[1]:.2f}), "
          f"{point.duration_s:5.1f} s a run{flag}", flush=True)  # fmt: skip
    return point


def warm_up(llm: LLM, args: argparse.Namespace, cfg: GPT2Config) -> None:
    """Compiles the kernels' shape variants (prefill and decode tiles, mixed batches) before timing."""
    trace = synthetic_trace(
        min(args.max_seqs, 24), args.prompt_dist, "uniform:1:24", cfg.vocab_size, seed=args.seed + 1
    )
    llm.generate([r.prompt_ids for r in trace], [offline.greedy(r) for r in trace])
    llm.generate([trace[0].prompt_ids], offline.greedy(trace[0]))


def unloaded_latency(args: argparse.Namespace, llm: LLM, cfg: GPT2Config) -> dict[str, Any]:
    """The trace's first requests one at a time, each alone in the engine: the per-token latency of an
    idle server for this workload's mix of prompt and output lengths. They are the same requests the
    lowest-rate points replay (--ab-min-requests), so that comparison is like for like: with long-tailed
    outputs a median over a few requests depends on which requests they are."""
    trace = synthetic_trace(
        args.unloaded_requests, args.prompt_dist, args.output_dist, cfg.vocab_size, seed=args.seed
    )
    norm, e2e = [], []
    for r in trace:
        _, n, e = replay(llm, [TraceRequest(0.0, r.prompt_ids, r.max_tokens)], time_limit_s=600.0)
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
        "max_e2e_ms": max(e2e) * 1e3,
        # Serving requests strictly one after another sustains 1 / mean service time.
        "one_at_a_time_rate": 1.0 / statistics.mean(e2e),
    }
    print(f"unloaded: median normalized latency {result['norm_median_ms']:.2f} ms/token over {len(trace)} requests "
          f"alone; one-at-a-time capacity {result['one_at_a_time_rate']:.2f} req/s")  # fmt: skip
    return result


def sweep(
    args: argparse.Namespace, llm: LLM, mode: str, max_batch: int, base_rate: float, slos_ms: list[float],
    cfg: GPT2Config, deadline: float, tail_s: float,
) -> list[Point]:  # fmt: skip
    """Rates from base_rate up by 4x until the loosest SLO is missed, down by 2x while the tightest one
    is missed at the lowest rate, then geometric bisection of the headline SLO's crossing (--ab-refine
    times: 4x -> 2x -> 1.4x apart). Every point is a full trace: an overloaded rate shows as a growing
    queue (or unfinished requests), never as a short trace that ended before the queue built up.
    The first point always runs; a later one only if its runs (arrival span + tail_s each) fit before
    the deadline."""
    points: dict[float, Point] = {}

    def run(rate: float) -> Point:
        if rate not in points:
            points[rate] = run_point(args, llm, mode, max_batch, rate, cfg)
        return points[rate]

    def more(rate: float) -> bool:
        trace = point_trace(args, rate, cfg)
        cost = args.ab_reps * (trace[-1].arrival + tail_s)
        return rate in points or (len(points) < args.ab_max_points and time.perf_counter() + cost < deadline)

    loosest, tightest, headline = max(slos_ms), min(slos_ms), slos_ms[0]
    rate = base_rate
    while run(rate).meets(loosest) and rate * 4 <= base_rate * args.ab_max_factor and more(rate * 4):
        rate *= 4
    rate = min(points)
    while not run(rate).meets(tightest) and rate / 2 >= base_rate / args.ab_max_factor and more(rate / 2):
        rate /= 2
    for _ in range(args.ab_refine):
        passing = [r for r, p in points.items() if p.meets(headline)]
        failing = [r for r, p in points.items() if passing and r > max(passing) and not p.meets(headline)]
        if not passing or not failing:
            break
        middle = math.sqrt(max(passing) * min(failing))
        if not more(middle):
            break
        run(middle)
    return [points[r] for r in sorted(points)]


def sustained(points: list[Point], slo_ms: float) -> dict[str, Any]:
    """In achieved rates (completed requests / wall time, medians over the runs), never offered ones:
    the highest achieved by a point that met the SLO with every lower offered rate meeting it too, and
    where the median crosses the SLO by linear interpolation between the last pass and the next point."""
    best, best_offered, crossing = None, None, None
    for i, p in enumerate(points):
        if not p.meets(slo_ms):
            if best is not None and p.censored == 0:
                prev = points[i - 1]
                frac = (slo_ms - prev.norm_median_ms) / (p.norm_median_ms - prev.norm_median_ms)
                crossing = prev.achieved_rate + frac * (p.achieved_rate - prev.achieved_rate)
            elif best is not None:
                crossing = best
            break
        best = p.achieved_rate if best is None else max(best, p.achieved_rate)
        best_offered = p.offered_rate
    else:
        crossing = best  # never missed: a lower bound
    return {
        "max_rate": best,  # achieved req/s
        "max_offered_rate": best_offered,
        "crossing_rate": crossing,
        "never_missed": bool(points) and points[-1].meets(slo_ms),
    }


def section_ab(args: argparse.Namespace, llm: LLM) -> dict[str, Any]:
    cfg = model_config(args)
    deadline = time.perf_counter() + args.ab_budget_s
    warm_up(llm, args, cfg)
    unloaded = unloaded_latency(args, llm, cfg)
    slos = {f"{m:g}x": m * unloaded["norm_median_ms"] for m in args.slo_multiples}
    base = unloaded["one_at_a_time_rate"]
    print(
        "SLOs (median normalized latency): " + ", ".join(f"{k} = {v:.2f} ms/token" for k, v in slos.items())
    )
    results: dict[str, Any] = {
        "unloaded": unloaded, "slos_ms": slos, "reps": args.ab_reps, "rates": "achieved",
        "iteration_max_batch": args.max_seqs, "request_batches": list(args.ab_request_batches),
        "points": {"iteration": [], "request": []}, "sustained": {}, "sustained_request_by_batch": {},
        "sweep_seconds": {},
    }  # fmt: skip
    # Iteration-level gets 1.5 shares of the time left, each request-level max batch one.
    configs = [("iteration", args.max_seqs, 1.5)] + [("request", b, 1.0) for b in args.ab_request_batches]
    for i, (mode, batch, weight) in enumerate(configs):
        started = time.perf_counter()
        engine_llm = llm if mode == "iteration" else make_llm(args, "request", batch)
        try:
            if mode == "request":
                warm_up(engine_llm, args, cfg)
            now = time.perf_counter()
            own_deadline = now + max(0.0, deadline - now) * weight / sum(w for *_, w in configs[i:])
            points = sweep(args, engine_llm, mode, batch, base, list(slos.values()), cfg, own_deadline,
                           unloaded["max_e2e_ms"] / 1e3)  # fmt: skip
        finally:
            if mode == "request":
                del engine_llm
                release(None)
        results["points"][mode] += [asdict(p) for p in points]
        by_slo = {k: sustained(points, v) for k, v in slos.items()}
        if mode == "iteration":
            results["sustained"]["iteration"] = by_slo
        else:
            results["sustained_request_by_batch"][str(batch)] = by_slo
        results["sweep_seconds"][mode if mode == "iteration" else f"request:{batch}"] = (
            time.perf_counter() - started
        )
    # The request-level baseline at each SLO: its best max batch there.
    results["sustained"]["request"] = {}
    for k in slos:
        batch, best = max(results["sustained_request_by_batch"].items(),
                          key=lambda item: (item[1][k]["max_rate"] or -1.0, item[1][k]["crossing_rate"] or -1.0))  # fmt: skip
        results["sustained"]["request"][k] = {
            **best[k],
            "max_batch": int(batch) if best[k]["max_rate"] else None,
        }
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
                                   f"(lowest offered {min(p['offered_rate'] for m in missed for p in results['points'][m]):.2f} req/s)")  # fmt: skip
        print(f"SLO {k} ({slos[k]:.2f} ms/token): iteration {_fmt(it['max_rate'])} req/s achieved vs request "
              f"{_fmt(rq['max_rate'])} (max batch {rq['max_batch']}) -> {_fmt(ratios[k]['max_rate_ratio'])}x"
              f"{' (lower bound: iteration never missed it)' if it['never_missed'] else ''}; "
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
def _figure(figures: dict[str, Any], key: str, spec: str) -> str:
    """One measured figure formatted; "-" when not measured, "error" when its measurement failed."""
    if key in figures:
        return format(figures[key], spec)
    return "error" if "error" in figures else "-"


def render_graphs(g: dict[str, Any], device: str) -> list[str]:
    """The graphs section's part of the report: figures side by side, tokens, kernels, targets."""
    lines = [
        "## CUDA graphs: decode steps graphed vs eager (`enforce_eager=True`), same models, same run",
        "",
    ]
    if "note" in g:
        lines += [f"**Graphs not captured**: {g['note']}.", ""]
    models = g["models"]
    if not models:
        return lines + ["No model was measured (see Errors).", ""]
    first = next(iter(models.values()))
    batches = list(first["decode"].get("on", {}))
    lines += [f"Each model built three times (graphs on: the default; off: `enforce_eager=True`; async: graphs on and "
              "`async_scheduling=True`, its steps timed together since they overlap), "
              f"{first['dtype']}, seeded "
              f"random weights, max_num_seqs {first['max_num_seqs']} (capture sizes {first['capture_sizes']}); "
              f"prompts of {first['prompt_tokens']} tokens. Decode-only steps timed one at a time, synchronized: "
              "the median step, and tok/s = running requests x steps / the steps' total time (the prefill excluded).",
              "", "| model | graphs | build s | batch-1 step ms (p10-p90) | " + " | ".join(f"tok/s at {b}" for b in batches) + " |",
              "|---|---|---|---|" + "---|" * len(batches)]  # fmt: skip
    profiled, kernels, tokens = [], [], []
    for name, m in models.items():
        for mode in ("on", "off", "async"):
            if mode not in m["decode"]:
                continue
            d = m["decode"][mode]
            b1 = d.get("1", {})
            step = _figure(b1, "step_ms_median", ".3f")
            if "step_ms_p10" in b1:
                step += f" ({b1['step_ms_p10']:.3f}-{b1['step_ms_p90']:.3f})"
            rates = " | ".join(_figure(d.get(b, {}), "tokens_per_s", ".0f") for b in batches)
            lines.append(
                f"| {name} | {mode} ({m['modes'].get(mode, '?')}) | {m['build_seconds'].get(mode, 0):.1f} | {step} | {rates} |"
            )
            for b, f in d.items():
                if "gpu_profile" in f:
                    busy = (f"{f['gpu_busy_ms']:.3f} ({f['gpu_busy_source']})" if "gpu_busy_ms" in f
                            else str(f["gpu_profile"].get("error", "-")))  # fmt: skip
                    host = f"{f['host_ms']:.3f}" if "host_ms" in f else "-"
                    idle = f"{f['gpu_idle_fraction']:.0%}" if "gpu_idle_fraction" in f else "-"
                    replay = f"{f['graph_replay_ms']:.3f}" if "graph_replay_ms" in f else "-"
                    profiled.append(
                        f"| {name} | {mode} | {b} | {f['step_ms_median']:.3f} | {busy} | {host} | {idle} | {replay} |"
                    )
        k = m.get("kernels") or {}
        if "kernels_per_layer" in k:
            bound = " (upper bound)" if k.get("upper_bound") else ""
            kernels.append(f"- {name}: **{k['kernels_per_layer']:.1f}**{bound} kernels per decoder layer "
                           f"({k['launches_in_layers']} launches in {k['layers']} layers, {k['launches_outside_layers']} outside, "
                           f"{k['device_kernels']} device kernels in the step); counted as {k['how']}.")  # fmt: skip
            if k.get("first_layer_kernels"):
                kernels.append(
                    f"  First layer: {', '.join(f'`{n[:60]}`' for n in k['first_layer_kernels'])}."
                )
        elif k:
            kernels.append(f"- {name}: {k.get('skipped') or k.get('error')}")
        t = m["token_check"]
        verdict = f"**{m['tokens_equal']}**"
        detail = "; ".join(f"request {x['request']} first differs at token {x['first_difference']} of {x['tokens']}"
                           for x in t["mismatched"][:8])  # fmt: skip
        tokens.append(f"- {name}: {verdict} ({t['requests']} greedy requests in {t.get('dtype', 'float32')}, {t['tokens']} tokens, outputs of "
                      f"{t['max_tokens'][0]}-{t['max_tokens'][-1]} tokens so the batch shrinks through every bucket"
                      f"{'; ' + detail if detail else ''})")  # fmt: skip
    speedups = [f"{n} {m['batch1_speedup']:.1f}x" for n, m in models.items() if "batch1_speedup" in m]
    if speedups:
        lines += ["", "Batch-1 step, graphs off / on: " + ", ".join(speedups) + "."]
    lines += [
        "",
        "Graph tokens == eager tokens (the same greedy prompts through both engines, exact equality):",
        *tokens,
        "",
    ]
    if profiled:
        lines += ["Device profile (torch profiler: GPU busy = the kernels' and copies' time per step; host = step - busy; "
                  "idle = 1 - busy / step; graph replay = one replay of the bucket's graph, CUDA events):", "",
                  "| model | graphs | running | step ms | GPU busy ms | host ms | GPU idle | graph replay ms |",
                  "|---|---|---|---|---|---|---|---|", *profiled, ""]  # fmt: skip
    elif not device.startswith("cuda"):
        lines += [
            f"No device profile: it needs CUDA, not {device} (so no host time, GPU idle or kernel counts).",
            "",
        ]
    if kernels:
        lines += ["Kernels per decoder layer (one eager batch-1 decode step, graphs off):", *kernels, ""]
    rows = [t | {"model_name": name} for name, m in models.items() for t in m["targets"]]
    lines += ["| target | model | measured | target | met |", "|---|---|---|---|---|"]
    for t in rows:
        value = t["value"]
        shown = "-" if value is None else (f"{value:.0%}" if t["key"].startswith("gpu_idle") else
                                           f"{value:.0f} {t['unit']}" if t["unit"] == "tok/s" else f"{value:.3g} {t['unit']}".strip())  # fmt: skip
        target = (f"{t['op'].replace('<=', '≤').replace('>=', '≥')} "
                  + (f"{t['target']:.0%}" if t["key"].startswith("gpu_idle") else f"{t['target']:g} {t['unit']}".strip())
                  + (f" (stretch {t['stretch']:g})" if "stretch" in t else ""))  # fmt: skip
        met = ("**met**" + (", stretch met" if t.get("stretch_met") else "") if t["met"] else
               "**not met**" if t["met"] is False else f"n/a ({t.get('why', '')})")  # fmt: skip
        lines.append(f"| {t['what']} | {t['model_name']} | {shown} | {target} | {met} |")
    return lines + [""]


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
    if g := result.get("graphs"):
        lines += render_graphs(g, str(args["device"]))
    if ab := result.get("ab"):
        u = ab["unloaded"]
        lines += [
            "## Engine-level A/B: iteration-level vs request-level scheduling (same engine code, same trace)",
            "",
            f"Poisson arrivals (seed {args['seed']}), prompts {args['prompt_dist']}, outputs {args['output_dist']} "
            f"(ignore_eos), about {args['ab_seconds']:g} s of arrivals per point ({args['ab_min_requests']}-{args['ab_max_requests']} "
            f"requests), **each point run {ab['reps']} times** on the same trace: medians, with the (min-max) of the runs "
            "(an overloaded point, whose first run left requests unfinished, once: it fails every SLO). "
            "Rates are **achieved** (completed requests / wall time of the run), not offered; output tokens/s count "
            f"finished requests only. Iteration-level runs max batch {ab['iteration_max_batch']}; request-level's max "
            f"batch is swept over {', '.join(map(str, ab['request_batches']))} and its best at each SLO is the baseline. "
            f"Unloaded per-token latency (median of {u['requests']} requests run alone): "
            f"**{u['norm_median_ms']:.2f} ms/token**; SLOs on the median normalized latency: "
            + ", ".join(f"{k} = {v:.2f} ms/token" for k, v in ab["slos_ms"].items()) + ".",
            "",
            "| SLO | iteration-level max achieved req/s | request-level baseline (best max batch) | ratio | ratio at interpolated crossings | request-level by max batch |",
            "|---|---|---|---|---|---|",
        ]  # fmt: skip
        for k in ab["slos_ms"]:
            it, rq, r = ab["sustained"]["iteration"][k], ab["sustained"]["request"][k], ab["ratios"][k]
            bound = "≥ " if r["lower_bound"] else ""
            by_batch = ", ".join(
                f"{b}: {_fmt(s[k]['max_rate'])}" for b, s in ab["sustained_request_by_batch"].items()
            )
            baseline = "-" if rq["max_rate"] is None else f"{rq['max_rate']:.2f} (batch {rq['max_batch']})"
            lines.append(f"| {k} | {bound}{_fmt(it['max_rate'])} | {baseline} | "
                         f"**{bound}{_fmt(r['max_rate_ratio'])}×** | {bound}{_fmt(r['crossing_ratio'])}× | {by_batch} |")  # fmt: skip
        if reasons := [f"No ratio at {k}: {r['reason']}." for k, r in ab["ratios"].items() if "reason" in r]:
            lines += ["", *reasons]
        lines += ["", "| mode | max batch | offered req/s | requests | runs | achieved req/s | out tok/s (finished) | "
                  "norm. median ms/tok | norm. p90 | e2e median ms | unfinished (most in a run) |",
                  "|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for mode in ("iteration", "request"):
            for p in ab["points"][mode]:
                (alo, ahi), (tlo, thi), (nlo, nhi) = (
                    p["achieved_rate_range"],
                    p["output_tokens_per_s_range"],
                    p["norm_median_ms_range"],
                )
                lines.append(f"| {mode} | {p['max_batch']} | {p['offered_rate']:.2f} | {p['num_requests']} | {p['reps']} | "
                             f"{p['achieved_rate']:.2f} ({alo:.2f}-{ahi:.2f}) | {p['output_tokens_per_s']:.0f} ({tlo:.0f}-{thi:.0f}) | "
                             f"{p['norm_median_ms']:.2f} ({nlo:.2f}-{nhi:.2f}) | {p['norm_p90_ms']:.2f} | "
                             f"{p['e2e_median_ms']:.0f} | {p['censored']} |")  # fmt: skip
        lines += [
            "",
            "Sweep wall times: " + ", ".join(f"{k} {v:.0f} s" for k, v in ab["sweep_seconds"].items()) + ".",
            "",
        ]
    skipped = {n: v["skipped"] for n in SECTIONS if isinstance(v := result.get(n), dict) and "skipped" in v}
    if skipped:
        lines += ["## Not run on this device", "", *[f"- {name}: {why}" for name, why in skipped.items()], ""]
    if errors := result.get("errors"):
        lines += ["## Errors", "", *[f"- {name}: `{msg}`" for name, msg in errors.items()], ""]
    return "\n".join(lines)


# Each knob's default for the full run on a GPU, and (QUICK) for --quick: every section end to end in
# well under a minute on a small CPU, as CI runs it (tests/benchmarks/test_gpu_check.py). Flags given on the
# command line win over both.
DEFAULTS: dict[str, Any] = {
    "model": "gpt2-medium", "dtype": "bfloat16", "max_seqs": 64, "copy_mib": 2048, "matmul_n": 8192,
    "decode_prompt": 32, "decode_warmup": 10, "decode_steps": 200, "profile_steps": 20,
    "prefill": [32, 512], "prefill_reps": 5, "graph_models": ["gpt2-medium", "qwen2.5-0.5b"],
    "graph_max_seqs": 256, "graph_batches": [1, 8, 64, 256], "graph_steps": 50, "graph_token_requests": 16,
    "prompt_dist": "uniform:32:512", "output_dist": "lognormal:32:512", "unloaded_requests": 16,
    "ab_seconds": 2.5, "ab_min_requests": 16, "ab_max_requests": 2000, "ab_drain_s": 8.0, "ab_refine": 1,
    "ab_max_points": 6, "ab_max_factor": 256.0, "ab_reps": 3, "ab_request_batches": [8, 32, 128],
    "ab_budget_s": 150.0, "cpu_threads": 0,
}  # fmt: skip
QUICK: dict[str, Any] = {
    "model": "gpt2-tiny", "dtype": "float32", "max_seqs": 8, "copy_mib": 16,
    "matmul_n": 256, "decode_prompt": 16, "decode_warmup": 3, "decode_steps": 20, "profile_steps": 3,
    "prefill": [4, 64], "prefill_reps": 3, "graph_models": ["gpt2-tiny", "llama-tiny"], "graph_max_seqs": 8,
    "graph_batches": [1, 2, 8], "graph_steps": 4, "graph_token_requests": 8, "prompt_dist": "uniform:8:48",
    "output_dist": "lognormal:8:48", "unloaded_requests": 4, "ab_seconds": 0.5, "ab_min_requests": 8,
    "ab_max_requests": 64, "ab_drain_s": 2.0, "ab_refine": 1, "ab_max_points": 3, "ab_max_factor": 4.0,
    "ab_reps": 3, "ab_request_batches": [2, 8], "ab_budget_s": 6.0, "cpu_threads": 1,
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
    knob("--graph-models", "graphs section: presets (or checkpoint dirs) run graphs on vs off", nargs="+")
    knob("--graph-max-seqs", "graphs section: max_num_seqs (graphs captured up to it)", type=int)
    knob(
        "--graph-batches",
        "graphs section: running requests whose decode steps are timed",
        type=int,
        nargs="+",
    )
    knob(
        "--graph-steps",
        "graphs section: timed decode steps per batch above 1 (batch 1: --decode-steps)",
        type=int,
    )
    knob(
        "--graph-token-requests",
        "graphs section: greedy requests whose graph and eager tokens must be equal",
        type=int,
    )
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
    knob("--ab-reps", "runs of each point (the same trace); medians and ranges reported", type=int)
    knob("--ab-request-batches", "the request-level engine's max_num_seqs, swept", type=int, nargs="+")
    knob("--ab-budget-s", "no new A/B point starts after this (every engine)", type=float)
    # One thread by default in --quick: on a small machine shared with other jobs, torch's OpenMP
    # threads spin against them (a CI run took 30-50 s with 2 threads on 2 busy cores, 11 s with 1).
    knob("--cpu-threads", "torch's intra-op threads with --device cpu, 0 = torch's own choice", type=int)
    args = p.parse_args(argv)
    for name, full in DEFAULTS.items():
        if getattr(args, name) is None:
            quick = args.quick and (name != "dtype" or torch.device(args.device).type == "cpu")
            setattr(args, name, QUICK[name] if quick else full)
    if max(args.graph_batches) > args.graph_max_seqs:
        p.error(f"--graph-batches {args.graph_batches} exceed --graph-max-seqs {args.graph_max_seqs}")
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
            elif name == "graphs":  # its own engines, one at a time
                result[name] = section_graphs(args, device)
                for model, msg in result[name]["errors"].items():
                    result["errors"][f"graphs:{model}"] = msg
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
    # Graphed decode steps must give the eager path's tokens, exactly: a mismatch fails the check.
    tokens_bad = isinstance(result.get("graphs"), dict) and result["graphs"].get("tokens_equal") is False
    if tokens_bad:
        print("graph tokens differ from eager tokens: " + ", ".join(
            f"{m}: {len(v['token_check']['mismatched'])} of {v['token_check']['requests']} requests"
            for m, v in result["graphs"]["models"].items() if not v["tokens_equal"]), file=sys.stderr)  # fmt: skip
    return 1 if result["errors"] or kernels_bad or tokens_bad else 0


if __name__ == "__main__":
    sys.exit(main())
