"""Triton kernels vs their torch references (and, for attention, SDPA on a padded batch): GPT-2's
add_layernorm and bias_gelu, the Llama family's add_rmsnorm, silu_and_mul and rotary, write_kv, and
the attention step with as many K/V heads as query heads and with grouped-query K/V (--kv-heads).

Reports median time, achieved memory bandwidth and FLOP/s, and their fractions of the device peak
(defaults: H100 SXM, 3.35 TB/s HBM3 and 989 TFLOP/s dense bf16). Bytes and FLOPs count the useful
work of each op (every input read once, every output written once; attention counts only the
query/key pairs the causal rule allows), so the padded SDPA baseline is charged for the same work
it would do unpadded.

    python benchmarks/kernels.py                      # needs CUDA
    python benchmarks/kernels.py --interpret          # CPU, tiny shapes, correctness only
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from orca_client import machine

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# (atol, rtol) against the fp32 reference: a couple of ulps of the dtype (tests/kernels/test_kernels.py).
TOLERANCE = {torch.bfloat16: (2e-2, 2e-2), torch.float16: (3e-3, 3e-3), torch.float32: (1e-4, 1e-4)}


@dataclass
class Result:
    op: str
    impl: str
    ms: float | None
    gbytes: float
    gflops: float
    max_err: float
    ok: bool

    def row(self, peak_bw_gbs: float, peak_tflops: float) -> str:
        if self.ms is None:
            timing = f"{'-':>9} {'-':>9} {'-':>7} {'-':>9} {'-':>7}"
        else:
            bw = self.gbytes / (self.ms * 1e-3)
            tflops = self.gflops / (self.ms * 1e-3) / 1e3
            timing = f"{self.ms * 1e3:9.1f} {bw:9.1f} {bw / peak_bw_gbs:7.1%} {tflops:9.2f} {tflops / peak_tflops:7.1%}"
        return f"{self.op:<14} {self.impl:<14} {timing} {self.max_err:9.2e} {'ok' if self.ok else 'FAIL'}"


HEADER = f"{'op':<14} {'impl':<14} {'us':>9} {'GB/s':>9} {'%bw':>7} {'TFLOP/s':>9} {'%flop':>7} {'max_err':>9} check"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--interpret", action="store_true", help="run on CPU via TRITON_INTERPRET=1, tiny shapes")
    p.add_argument("--dtype", choices=list(DTYPES), default="bf16")
    p.add_argument("--tokens", type=int, default=4096, help="rows for layernorm and gelu")
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument(
        "--kv-heads", type=int, default=8, help="K/V heads of the GQA attention case (Llama-3-8B: 8)"
    )
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument(
        "--prefill", type=int, nargs=2, default=[2, 512], metavar=("N", "LEN"), help="prompts in the batch"
    )
    p.add_argument(
        "--decode", type=int, nargs=2, default=[62, 1024], metavar=("N", "CTX"), help="decodes in the batch"
    )
    p.add_argument("--block-size", type=int, default=16, help="K/V pool block size, tokens")
    p.add_argument("--peak-bw-gbs", type=float, default=3350.0, help="device memory bandwidth, GB/s")
    p.add_argument("--peak-tflops", type=float, default=989.0, help="device dense TFLOP/s for --dtype")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args(argv)
    if args.interpret:  # small enough for the interpreter, still ragged and non-power-of-two
        args.tokens, args.hidden, args.heads, args.kv_heads, args.head_dim = 5, 200, 2, 1, 80
        args.prefill, args.decode = [2, 20], [3, 37]
    return args


def bench(fn: Callable[[], object], interpret: bool) -> float | None:
    """Median milliseconds on CUDA; the interpreter's timings mean nothing, so None there."""
    if interpret:
        fn()
        return None
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def compare(actual: torch.Tensor, expected: torch.Tensor) -> tuple[float, bool]:
    """(max abs error, within the dtype's tolerance)."""
    atol, rtol = TOLERANCE[actual.dtype]
    actual, expected = actual.float(), expected.float()
    ok = torch.allclose(actual, expected, atol=atol, rtol=rtol)
    return (actual - expected).abs().max().item(), ok


def make_batch(args: argparse.Namespace, device: torch.device):
    """A selectively batched step: prompts (n == ctx) then decodes, over a paged K/V pool whose
    blocks are handed out in a shuffled order, as a pool that has served for a while would."""
    from orca_kernels import AttentionMetadata

    requests = [(args.prefill[1], args.prefill[1])] * args.prefill[0] + [(1, args.decode[1])] * args.decode[0]
    size = args.block_size
    counts = [-(-ctx // size) for _, ctx in requests]
    free = list(range(sum(counts)))
    random.Random(0).shuffle(free)
    query_start, tables, slot_mapping = [0], [], []
    for (n, ctx), count in zip(requests, counts, strict=True):
        query_start.append(query_start[-1] + n)
        table, free = free[:count], free[count:]
        tables.append(table)
        slot_mapping.extend(table[j // size] * size + j % size for j in range(ctx - n, ctx))
    context_lens = [ctx for _, ctx in requests]
    width = max(counts)

    def dev(values: list, dtype: torch.dtype) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype, device=device)

    meta = AttentionMetadata(
        query_start=dev(query_start, torch.int32),
        context_lens=dev(context_lens, torch.int32),
        block_tables=dev([t + [0] * (width - len(t)) for t in tables], torch.int32),
        slot_mapping=dev(slot_mapping, torch.int64),
        block_size=size,
        max_query_len=max(n for n, _ in requests),
        max_context_len=max(context_lens),
        num_requests=len(requests),
    )
    return requests, meta, sum(counts) * size


def padded_sdpa_inputs(q, k_cache, v_cache, requests, meta):
    """[B, H, max_q, D] queries, [B, H, max_ctx, D] keys/values and a bottom-right causal mask."""
    b, max_q, max_ctx = len(requests), meta.max_query_len, meta.max_context_len
    heads, dim = q.shape[1:]
    qp = q.new_zeros(b, heads, max_q, dim)
    kp, vp = q.new_zeros(b, heads, max_ctx, dim), q.new_zeros(b, heads, max_ctx, dim)
    mask = torch.zeros(b, 1, max_q, max_ctx, dtype=torch.bool, device=q.device)
    mask[:, :, :, 0] = True  # padded query rows see key 0, so no row is all -inf (NaN)
    for i, (n, ctx) in enumerate(requests):
        lo, slots = meta.host_lens()[0][i], meta.context_slots(i)
        qp[i, :, :n] = q[lo : lo + n].transpose(0, 1)
        kp[i, :, :ctx] = k_cache[slots].transpose(0, 1)
        vp[i, :, :ctx] = v_cache[slots].transpose(0, 1)
        rows = torch.arange(n, device=q.device)[:, None] + (ctx - n)
        mask[i, 0, :n, :ctx] = torch.arange(ctx, device=q.device)[None, :] <= rows
    return qp, kp, vp, mask


def run(args: argparse.Namespace) -> list[Result]:
    from orca_kernels import get_ops
    from orca_kernels.dispatch import TORCH_OPS

    device = torch.device("cpu" if args.interpret else "cuda")
    dtype, elt = DTYPES[args.dtype], DTYPES[args.dtype].itemsize
    ops = get_ops(device, "triton")
    g = torch.Generator(device=device).manual_seed(0)
    results: list[Result] = []

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    def measure(
        op: str, impl: str, fn: Callable[[], torch.Tensor], expected: torch.Tensor, gb: float, gf: float
    ):
        err, ok = compare(fn(), expected)  # also the warm-up that compiles the kernel
        results.append(Result(op, impl, bench(fn, args.interpret), gb, gf, err, ok))

    # add + LayerNorm: read x, residual, weight and bias; write the output and the new residual.
    t, h = args.tokens, args.hidden
    x, res, w, b = randn(t, h), randn(t, h), randn(h), randn(h)
    expected = TORCH_OPS.add_layernorm((x + res).float(), None, w.float(), b.float(), 1e-5)[0]
    gb, gf = (4 * t * h + 2 * h) * elt / 1e9, 8 * t * h / 1e9
    measure("add_layernorm", "triton", lambda: ops.add_layernorm(x, res, w, b, 1e-5)[0], expected, gb, gf)
    measure(
        "add_layernorm", "torch", lambda: TORCH_OPS.add_layernorm(x, res, w, b, 1e-5)[0], expected, gb, gf
    )

    # bias + GeLU over the MLP's 4 * hidden activations; about 12 FLOPs an element.
    inner = 4 * h
    a, bias = randn(t, inner), randn(inner)
    expected = TORCH_OPS.bias_gelu((a + bias).float(), torch.zeros(inner, device=device))
    gb, gf = (2 * t * inner + inner) * elt / 1e9, 12 * t * inner / 1e9
    measure("bias_gelu", "triton", lambda: ops.bias_gelu(a, bias), expected, gb, gf)
    measure("bias_gelu", "torch", lambda: TORCH_OPS.bias_gelu(a, bias), expected, gb, gf)

    # Llama family. add + RMSNorm: read x, residual and weight; write the output and the new residual.
    expected = TORCH_OPS.add_rmsnorm((x + res).float(), None, w.float(), 1e-5)[0]
    gb, gf = (4 * t * h + h) * elt / 1e9, 5 * t * h / 1e9
    measure("add_rmsnorm", "triton", lambda: ops.add_rmsnorm(x, res, w, 1e-5)[0], expected, gb, gf)
    measure("add_rmsnorm", "torch", lambda: TORCH_OPS.add_rmsnorm(x, res, w, 1e-5)[0], expected, gb, gf)

    # SiLU-and-mul over the fused gate/up projection (Llama's MLP is ~3.5 * hidden wide; 4 * hidden
    # here keeps one size for both MLPs): read 2 * inner, write inner; about 6 FLOPs an output.
    gate_up = randn(t, 2 * inner)
    expected = TORCH_OPS.silu_and_mul(gate_up.float())
    gb, gf = 3 * t * inner * elt / 1e9, 6 * t * inner / 1e9
    measure("silu_and_mul", "triton", lambda: ops.silu_and_mul(gate_up), expected, gb, gf)
    measure("silu_and_mul", "torch", lambda: TORCH_OPS.silu_and_mul(gate_up), expected, gb, gf)

    # Rotary on q and k, both views of a fused qkv projection: read and write Hq + Hkv heads per
    # token (the cos/sin rows are a small, cached table); 6 FLOPs per rotated pair.
    hq, hkv, dim = args.heads, args.kv_heads, args.head_dim
    qkv = randn(t, (hq + 2 * hkv) * dim)
    q_view = qkv[:, : hq * dim].view(t, hq, dim)
    k_view = qkv[:, hq * dim : (hq + hkv) * dim].view(t, hkv, dim)
    positions = torch.randint(0, 8192, (t,), generator=g, device=device)
    freqs = torch.arange(8192, device=device, dtype=torch.float32)[:, None] * (
        10000.0 ** (-torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim)
    )
    cos_sin = torch.cat([freqs.cos(), freqs.sin()], dim=-1)
    expected = torch.cat(
        [o.flatten(1) for o in TORCH_OPS.rotary(q_view.float(), k_view.float(), positions, cos_sin)], dim=1
    )

    def rotary(kernel_ops) -> torch.Tensor:
        return torch.cat([o.flatten(1) for o in kernel_ops.rotary(q_view, k_view, positions, cos_sin)], dim=1)

    gb, gf = 2 * t * (hq + hkv) * dim * elt / 1e9, 3 * t * (hq + hkv) * dim / 1e9
    err, ok = compare(rotary(ops), expected)
    call = lambda: ops.rotary(q_view, k_view, positions, cos_sin)  # noqa: E731
    results.append(Result("rotary", "triton", bench(call, args.interpret), gb, gf, err, ok))
    err, ok = compare(rotary(TORCH_OPS), expected)
    call = lambda: TORCH_OPS.rotary(q_view, k_view, positions, cos_sin)  # noqa: E731
    results.append(Result("rotary", "torch", bench(call, args.interpret), gb, gf, err, ok))

    # The attention step: a ragged batch of prompts and decodes over a shared K/V pool.
    heads, dim, scale = args.heads, args.head_dim, args.head_dim**-0.5
    requests, meta, slots = make_batch(args, device)
    tokens = sum(n for n, _ in requests)
    q, k_new, v_new = randn(tokens, heads, dim), randn(tokens, heads, dim), randn(tokens, heads, dim)
    k_cache, v_cache = randn(slots, heads, dim), randn(slots, heads, dim)

    # write_kv: read and write k and v once each, plus the slot indices. The check reads back the
    # written slots; rewriting the same values while timing keeps the pool unchanged.
    gb = (4 * tokens * heads * dim * elt + 8 * tokens) / 1e9
    expected = torch.cat([k_new, v_new])
    for impl, kv_ops in (("triton", ops), ("torch", TORCH_OPS)):
        kc, vc = k_cache.clone(), v_cache.clone()

        def write(kv_ops=kv_ops, kc=kc, vc=vc) -> torch.Tensor:
            kv_ops.write_kv(k_new, v_new, kc, vc, meta.slot_mapping)
            return torch.cat([kc[meta.slot_mapping], vc[meta.slot_mapping]])

        err, ok = compare(write(), expected)
        call = lambda kv_ops=kv_ops, kc=kc, vc=vc: kv_ops.write_kv(k_new, v_new, kc, vc, meta.slot_mapping)  # noqa: E731
        results.append(Result("write_kv", impl, bench(call, args.interpret), gb, 0.0, err, ok))
    TORCH_OPS.write_kv(k_new, v_new, k_cache, v_cache, meta.slot_mapping)

    pairs = sum(n * (ctx - n) + n * (n + 1) // 2 for n, ctx in requests)  # causally visible (q, k)
    gf = 4 * heads * dim * pairs / 1e9  # QK^T and PV: 2 FLOPs per multiply-add each
    gb = (2 * tokens + 2 * sum(ctx for _, ctx in requests)) * heads * dim * elt / 1e9
    expected = TORCH_OPS.attention(q.float(), k_cache.float(), v_cache.float(), meta, scale)
    measure("attention", "triton", lambda: ops.attention(q, k_cache, v_cache, meta, scale), expected, gb, gf)
    measure(
        "attention",
        "torch loop",
        lambda: TORCH_OPS.attention(q, k_cache, v_cache, meta, scale),
        expected,
        gb,
        gf,
    )
    # SDPA gets its padded inputs for free (untimed) and then computes B x max_q x max_ctx.
    qp, kp, vp, mask = padded_sdpa_inputs(q, k_cache, v_cache, requests, meta)
    sdpa = lambda: F.scaled_dot_product_attention(qp, kp, vp, attn_mask=mask, scale=scale)  # noqa: E731
    unpad = lambda out: torch.cat([out[i, :, :n].transpose(0, 1) for i, (n, _) in enumerate(requests)])  # noqa: E731
    err, ok = compare(unpad(sdpa()), expected)
    results.append(Result("attention", "sdpa padded", bench(sdpa, args.interpret), gb, gf, err, ok))

    # The same step with grouped-query attention: the pool holds only --kv-heads heads, so the
    # useful K/V traffic shrinks by the group size while the FLOPs stay the same.
    kg_cache, vg_cache = k_cache[:, :hkv].contiguous(), v_cache[:, :hkv].contiguous()
    gb = (2 * tokens * heads + 2 * sum(ctx for _, ctx in requests) * hkv) * dim * elt / 1e9
    expected = TORCH_OPS.attention(q.float(), kg_cache.float(), vg_cache.float(), meta, scale)
    op = f"gqa {heads}/{hkv}"
    measure(op, "triton", lambda: ops.attention(q, kg_cache, vg_cache, meta, scale), expected, gb, gf)
    measure(
        op, "torch loop", lambda: TORCH_OPS.attention(q, kg_cache, vg_cache, meta, scale), expected, gb, gf
    )
    return results


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.interpret:
        # Before anything imports triton: triton.language decorates its own helpers at import.
        os.environ["TRITON_INTERPRET"] = "1"
    elif not torch.cuda.is_available():
        print(
            "benchmarks/kernels.py needs a CUDA GPU: its timings mean nothing on CPU. "
            "Use --interpret to check the kernels' correctness on CPU with tiny shapes.",
            file=sys.stderr,
        )
        return 2
    device = "cpu (Triton interpreter)" if args.interpret else torch.cuda.get_device_name()
    print(f"host: {machine.summary()}")
    print(
        f"device: {device}; dtype {args.dtype}; peak {args.peak_bw_gbs:.0f} GB/s, {args.peak_tflops:.0f} TFLOP/s"
    )
    print(
        f"rows {args.tokens} x hidden {args.hidden}; attention: {args.prefill[0]} prompts of {args.prefill[1]}"
        f" + {args.decode[0]} decodes at context {args.decode[1]}, {args.heads} heads x {args.head_dim}"
        f" (GQA case: {args.kv_heads} K/V heads), K/V blocks of {args.block_size} tokens"
    )
    results = run(args)
    print(HEADER)
    for r in results:
        print(r.row(args.peak_bw_gbs, args.peak_tflops))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "machine": machine.describe(), "results": [asdict(r) for r in results]}, f,
                      indent=2)
    bad = [r for r in results if r.impl == "triton" and not r.ok]
    for r in bad:
        print(
            f"FAIL: triton {r.op} differs from the fp32 reference (max abs error {r.max_err:.3g})",
            file=sys.stderr,
        )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
