"""The fused norm + GEMM kernel's tilings (kernels/orca_kernels/triton_norm_linear.py) swept at the
shapes the models launch it with: device time of each (BLOCK_M, BLOCK_N, BLOCK_K, num_warps,
num_stages) at 1 to 256 rows, from CUDA-graph replays with L2 flushed before each call, as a
fraction of a device copy's bandwidth over the weight's bytes. What `_blocks` chooses is marked, so a
run says how far the chosen tiling is from the best one here. Beside them, per row count, the unfused
path the models take beyond `gemm.NORM_LINEAR_MAX_TOKENS`: the Triton add + norm kernel, then the
GEMM as the model calls it (cuBLAS, its bias/GELU epilogue where it has one) and the Triton activation:
where that is faster, the fused kernel should not run.

    python benchmarks/norm_linear_configs.py --out DIR                  # on a GPU
    python benchmarks/norm_linear_configs.py --device cpu --quick --out DIR   # the plumbing (CI)

Compiling every tiling is most of the run: it is spread over --jobs processes first (each fills
Triton's on-disk cache), then one process times them all. Files in --out: norm_linear_configs.json
(every point) and norm_linear_configs.md (per shape and row count: the chosen tiling, the best, and
their times, and the unfused path's).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import itertools
import json
import multiprocessing
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import gpu_smoke  # beside this script: its loader of gpu_check.py, whose timing helpers this uses


@dataclass(frozen=True)
class Case:
    """One launch as a model makes it: the weight [rows_out, hidden] and what the kernel fuses."""

    name: str
    out_rows: int  # the weight's rows (gate and up rows together for a gated MLP)
    hidden: int
    activation: str
    layernorm: bool  # LayerNorm (GPT-2) or RMSNorm
    bias: bool
    x_bias: bool  # the previous linear's bias carried into the norm (GPT-2)


# GPT-2-medium and Qwen2.5-0.5B, the graphs stage's two models: each layer's QKV and MLP-in launch,
# and the final norm's LM head.
CASES = [
    Case("gpt2-medium qkv", 3072, 1024, "none", True, True, True),
    Case("gpt2-medium mlp_in", 4096, 1024, "gelu", True, True, True),
    Case("gpt2-medium lm_head", 50257, 1024, "none", True, False, True),
    Case("qwen2.5-0.5b qkv", 1152, 896, "none", False, True, False),
    Case("qwen2.5-0.5b gate_up", 2 * 4864, 896, "silu_and_mul", False, False, False),
    Case("qwen2.5-0.5b lm_head", 151936, 896, "none", False, False, False),
]
QUICK_CASES = [Case("tiny qkv", 96, 32, "none", True, True, True), Case("tiny gate_up", 128, 32, "silu_and_mul", False, False, False),
               Case("tiny lm_head", 257, 32, "none", True, False, True)]  # fmt: skip

# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) tried at each row count.
DECODE_TILINGS = [(16, n, k, 4, s) for n, k, s in itertools.product((16, 32, 64), (64, 128, 256), (3, 4))]
DECODE_TILINGS += [(16, 16, 256, 2, 4), (16, 32, 256, 8, 4)]
WIDE_TILINGS = [(64, 64, 64, 4, 3), (32, 64, 128, 4, 3), (64, 128, 64, 8, 3), (16, 64, 128, 4, 4), (32, 32, 128, 4, 4),
                (64, 64, 128, 8, 3), (16, 64, 128, 8, 3), (32, 64, 128, 8, 3)]  # fmt: skip
ROWS = {1: DECODE_TILINGS, 16: DECODE_TILINGS, 32: WIDE_TILINGS, 64: WIDE_TILINGS, 256: WIDE_TILINGS}
QUICK_ROWS = {1: [(16, 16, 16, 4, 1), (16, 32, 32, 4, 1)], 20: [(16, 32, 32, 4, 1), (32, 16, 16, 4, 1)]}


def operands(case: Case, rows: int, device: Any, dtype: Any) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=device).manual_seed(0)

    def randn(*dims: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*dims, generator=g, device=device) * scale).to(dtype)

    h = case.hidden
    return {"x": randn(rows, h), "x_bias": randn(h) if case.x_bias else None, "residual": randn(rows, h),
            "norm_w": randn(h), "norm_b": randn(h) if case.layernorm else None, "eps": 1e-5,
            "weight": randn(case.out_rows, h, scale=h**-0.5), "bias": randn(case.out_rows) if case.bias else None,
            "activation": case.activation}  # fmt: skip


def chosen_tiling(case: Case, rows: int, device: Any, dtype: Any) -> tuple[int, ...]:
    """The tiling the kernel picks for this launch."""
    from orca_kernels.triton_norm_linear import _blocks

    gated = case.activation.endswith("_and_mul")
    return _blocks(rows, case.out_rows // 2 if gated else case.out_rows, gated, device, dtype)


def launch(case: Case, rows: int, blocks: tuple[int, ...], device: Any, dtype: Any) -> Any:
    """A callable of one launch at this tiling (compiled by its first call)."""
    from orca_kernels.triton_norm_linear import norm_linear_triton

    return functools.partial(norm_linear_triton, **operands(case, rows, device, dtype), blocks=blocks)


def unfused(case: Case, rows: int, device: Any, dtype: Any) -> Any:
    """A callable of the unfused path, as the models run it beyond gemm.NORM_LINEAR_MAX_TOKENS: the
    kernel set's add + norm, the GEMM (GPT-2's MLP input with cuBLAS's bias + GELU epilogue), the
    gated activation."""
    from orca_backend.model import gemm
    from orca_kernels.dispatch import get_ops

    ops, o = get_ops(device, "triton"), operands(case, rows, device, dtype)

    def run() -> Any:
        x = o["x"] if o["x_bias"] is None else o["x"] + o["x_bias"]
        if o["norm_b"] is not None:
            h, _ = ops.add_layernorm(x, o["residual"], o["norm_w"], o["norm_b"], o["eps"])
        else:
            h, _ = ops.add_rmsnorm(x, o["residual"], o["norm_w"], o["eps"])
        if case.activation == "gelu":
            return gemm.linear_bias_gelu(h, o["weight"], o["bias"], ops.bias_gelu)
        y = gemm.linear(h, o["weight"], o["bias"])
        return ops.silu_and_mul(y) if case.activation == "silu_and_mul" else y

    return run


def head_logits(case: Case, rows: int, device: Any, dtype: Any, pad_to: int) -> Any:
    """A callable of an LM head's logits as the models take them (the GEMM, then float32), its weight
    padded with zero rows to a multiple of `pad_to` and the logits cut back (1: as stored). cuBLAS
    picks an unaligned kernel for an output of 50,257 columns (GPT-2's), three times slower at 16-64
    rows than an aligned head three times the size: vLLM pads its vocabulary to 64."""
    import torch

    o = operands(case, rows, device, dtype)
    weight, vocab = o["weight"], case.out_rows
    padded = -(-vocab // pad_to) * pad_to
    if padded != vocab:
        weight = torch.cat([weight, weight.new_zeros(padded - vocab, case.hidden)])
    return lambda: torch.nn.functional.linear(o["x"], weight)[:, :vocab].float()


def compile_shard(points: list[tuple[Case, int, tuple[int, ...]]], device: str, dtype: str) -> list[str]:
    """Runs each point once (its compile lands in Triton's cache); the errors, as text."""
    import torch

    errors = []
    for case, rows, blocks in points:
        try:
            launch(case, rows, blocks, torch.device(device), getattr(torch, dtype))()
        except Exception as exc:  # a tiling that does not compile is reported by the timing pass too
            errors.append(f"{case.name} rows {rows} {blocks}: {type(exc).__name__}: {exc}")
    return errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--quick", action="store_true", help="tiny shapes and two tilings (the CPU plumbing, CI)")
    p.add_argument("--jobs", type=int, default=min(12, os.cpu_count() or 1), help="compiling processes")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if args.quick:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 2
    gpu_check = gpu_smoke.load_gpu_check()
    cases, rows_tilings = (QUICK_CASES, QUICK_ROWS) if args.quick else (CASES, ROWS)
    points = [(c, rows, t) for c in cases for rows, tried in rows_tilings.items()
              for t in dict.fromkeys([*tried, chosen_tiling(c, rows, device, dtype)])]  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if device.type == "cuda" and args.jobs > 1:
        shards = [points[i :: args.jobs] for i in range(args.jobs)]
        with concurrent.futures.ProcessPoolExecutor(args.jobs, mp_context=multiprocessing.get_context("spawn")) as pool:
            for errors in pool.map(compile_shard, shards, itertools.repeat(args.device), itertools.repeat(args.dtype)):
                for e in errors:
                    print("compile:", e, flush=True)
    copy_bytes = (1 << 20) if args.quick else (1 << 30)
    copy_gb_s = 2 * copy_bytes / gpu_check.copy_seconds(device, copy_bytes, reps=10) / 1e9
    results: list[dict[str, Any]] = []
    for case, rows, blocks in points:
        point = {**asdict(case), "rows": rows, "blocks": list(blocks), "chosen": blocks == chosen_tiling(case, rows, device, dtype)}
        try:
            seconds = gpu_check.graph_seconds(launch(case, rows, blocks, device, dtype), device, reps=args.reps)
            weight_bytes = case.out_rows * case.hidden * dtype.itemsize
            point |= {"us": seconds * 1e6, "weight_gb_s": weight_bytes / seconds / 1e9,
                      "of_copy": weight_bytes / seconds / 1e9 / copy_gb_s}  # fmt: skip
        except Exception as exc:
            point["error"] = f"{type(exc).__name__}: {exc}"
        results.append(point)
        print(json.dumps(point), flush=True)
    # The unfused path's GEMM alone (torch's F.linear: cuBLAS on a GPU), and the whole unfused path.
    torch_us: dict[str, float] = {}
    unfused_us: dict[str, float] = {}
    for case, rows in itertools.product(cases, rows_tilings):
        o = operands(case, rows, device, dtype)
        linear = functools.partial(torch.nn.functional.linear, o["x"], o["weight"], o["bias"])
        torch_us[f"{case.name}/{rows}"] = gpu_check.graph_seconds(linear, device, reps=args.reps) * 1e6
        unfused_us[f"{case.name}/{rows}"] = gpu_check.graph_seconds(unfused(case, rows, device, dtype), device,
                                                                    reps=args.reps) * 1e6  # fmt: skip
    # LM heads whose vocabulary is not a multiple of 64: as stored, and padded (head_logits).
    head_us: dict[str, list[float]] = {}
    for case, rows in itertools.product(cases, rows_tilings):
        if case.name.endswith("lm_head") and case.out_rows % 64:
            stored, padded = (head_logits(case, rows, device, dtype, pad) for pad in (1, 64))
            torch.testing.assert_close(padded(), stored(), rtol=1e-2, atol=1e-2)  # the same logits either way
            head_us[f"{case.name}/{rows}"] = [gpu_check.graph_seconds(fn, device, reps=args.reps) * 1e6
                                              for fn in (stored, padded)]  # fmt: skip
    summary = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
               "dtype": args.dtype, "copy_gb_s": copy_gb_s, "points": results, "torch_linear_us": torch_us,
               "unfused_us": unfused_us, "lm_head_as_stored_and_padded_us": head_us}  # fmt: skip
    (out / "norm_linear_configs.json").write_text(json.dumps(summary, indent=1))
    lines = [f"# norm_linear tilings on {summary['device']} ({args.dtype})", "",
             f"Device copy: {copy_gb_s:.0f} GB/s (read + write). Times: CUDA-graph replays, L2 flushed before each call.",
             "Tilings: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages). Unfused: add + norm, GEMM, "
             "activation, as the models run them beyond gemm.NORM_LINEAR_MAX_TOKENS.",
             "", "| case | rows | chosen | us | of copy | best | us | of copy | F.linear alone us | unfused us |",
             "|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for case in cases:
        for rows in rows_tilings:
            mine = [r for r in results if r["name"] == case.name and r["rows"] == rows and "us" in r]
            if not mine:
                continue
            chosen = next((r for r in mine if r["chosen"]), None)
            best = min(mine, key=lambda r: r["us"])
            c = f"{tuple(chosen['blocks'])} | {chosen['us']:.1f} | {chosen['of_copy']:.0%}" if chosen else "failed | | "
            key = f"{case.name}/{rows}"
            lines.append(f"| {case.name} | {rows} | {c} | {tuple(best['blocks'])} | {best['us']:.1f} | {best['of_copy']:.0%} | "
                         f"{torch_us[key]:.1f} | {unfused_us[key]:.1f} |")
    if head_us:
        lines += ["", "LM head logits (F.linear, then float32), the vocabulary as stored and padded to a multiple of 64:", "",
                  "| case | rows | as stored us | padded us |", "|---|---|---|---|"]  # fmt: skip
        lines += [f"| {key.split('/')[0]} | {key.split('/')[1]} | {plain:.1f} | {padded:.1f} |"
                  for key, (plain, padded) in head_us.items()]  # fmt: skip
    (out / "norm_linear_configs.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
