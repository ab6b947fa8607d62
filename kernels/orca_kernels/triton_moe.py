"""The mixture-of-experts MLP as grouped GEMMs in Triton (the semantics are moe.py's).

Experts stored as integers (GPTQ, AWQ, compressed-tensors: int_quant.IntExperts) stay packed: each
tile of an expert's weight is unpacked and dequantized in registers as the integer linear layer's is
(triton_int_quant.dequantized_tile), so a step reads 4 or 8 bits a weight of each active expert.

The (token, slot) pairs of a step are sorted by expert on the device and each expert's run is
padded to a multiple of ``BLOCK_M`` (`moe_align`), so every program of one grouped GEMM multiplies
``BLOCK_M`` rows that all go to one expert by that expert's weight tile: the gate/up GEMM reads
token rows of x, the down GEMM rows of the activations, scaled by each pair's routing weight in its
epilogue. The grid is sized from plain integers (tokens, k, experts) and the padding's bound, with
spare programs exiting at once, and nothing is read back to the host: a decode step with experts is
capture-safe like the rest. Per-pair outputs are summed over each token's k slots at the end.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .int_quant import IntExperts
from .triton_int_quant import dequantized_tile, tile_k


@triton.jit
def _moe_gemm_kernel(
    a_ptr, w_ptr, out_ptr, sorted_ptr, block_expert_ptr, weights_ptr, s_ptr, z_ptr, g_ptr,
    N, K, num_pairs, stride_am, stride_we, stride_wn, stride_om, stride_se, stride_sn, stride_ge,
    A_ROW_DIV: tl.constexpr, MUL_WEIGHT: tl.constexpr, NUM_EXPERTS: tl.constexpr, PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr, HAS_G_IDX: tl.constexpr,
    GROUP_TILE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= NUM_EXPERTS:
        return  # past the last expert's padded run: a spare program
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    valid = pair < num_pairs  # padding rows hold num_pairs
    a_rows = (pair // A_ROW_DIV).to(tl.int64)  # the token (gate/up GEMM) or the pair (down GEMM)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    expert = expert.to(tl.int64)
    w_base = w_ptr + expert * stride_we
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(a_ptr + a_rows[:, None] * stride_am + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        if BITS == 0:
            w = tl.load(w_base + offs_n[:, None] * stride_wn + offs_k[None, :], mask=n_mask[:, None] & k_mask[None, :],
                        other=0.0)  # fmt: skip
        else:  # packed integers: dequantized in float32, then rounded to the activations' dtype as the MMA reads it
            w = dequantized_tile(w_base, s_ptr + expert * stride_se, z_ptr + expert * stride_se, g_ptr + expert * stride_ge,
                                 offs_n.to(tl.int64), n_mask, k0, K, stride_wn, stride_sn, BITS, GROUP, HAS_G_IDX,
                                 GROUP_TILE, BLOCK_N, BLOCK_K).to(a.dtype)  # fmt: skip
        if DOT_FP32:
            a = a.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(a, tl.trans(w), input_precision=PRECISION)
    if MUL_WEIGHT:
        acc *= tl.load(weights_ptr + pair, mask=valid, other=0.0).to(tl.float32)[:, None]
    tl.store(out_ptr + pair.to(tl.int64)[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=valid[:, None] & n_mask[None, :])  # fmt: skip


INTERPRETED: bool = not isinstance(_moe_gemm_kernel, JITFunction)


def moe_align(topk_ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(sorted pair ids, each with padding = T * k, [T * k + E * (block_m - 1)]; the expert of each
    block of block_m of them, num_experts past the last run), by device ops alone."""
    flat = topk_ids.flatten().long()
    pairs, device = flat.numel(), flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device).scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)
    experts = flat[order]
    rank = torch.arange(pairs, device=device) - (torch.cumsum(counts, 0) - counts)[experts]  # place within its expert
    size = pairs + num_experts * (block_m - 1)
    sorted_ids = torch.full((triton.cdiv(size, block_m) * block_m,), pairs, dtype=torch.int64, device=device)
    sorted_ids[(ends - padded)[experts] + rank] = order
    starts = torch.arange(0, sorted_ids.numel(), block_m, device=device)
    block_expert = torch.searchsorted(ends, starts, right=True)  # num_experts for the blocks past every run
    return sorted_ids, block_expert


def _grouped_gemm(
    a: torch.Tensor, w: torch.Tensor | IntExperts, out: torch.Tensor, sorted_ids: torch.Tensor,
    block_expert: torch.Tensor, weights: torch.Tensor | None, a_row_div: int, num_pairs: int, block_m: int,
) -> None:  # fmt: skip
    """out[pair] = a[pair // a_row_div] @ w[expert of pair].T (times the pair's weight, if given)."""
    num_experts, n, k = w.shape
    cuda = a.device.type == "cuda"
    block_n, block_k = (64, 64) if cuda else (16, 16)
    if isinstance(w, IntExperts):
        # A tile inside one group takes one scale and zero point a row.
        block_k, group_tile = tile_k(w.group, w.g_idx is not None, block_k if cuda else 32, 32 if cuda else 16)
        words, s, z = w.packed, w.scales, w.zeros
        g = w.g_idx if w.g_idx is not None else w.packed  # unread without g_idx
        quant = {"BITS": w.bits, "GROUP": w.group, "HAS_G_IDX": w.g_idx is not None, "GROUP_TILE": group_tile}
        strides = (s.stride(0), s.stride(1), g.stride(0))
    else:
        words = s = z = g = w  # unread for float weights
        quant = {"BITS": 0, "GROUP": 0, "HAS_G_IDX": False, "GROUP_TILE": False}
        strides = (0, 0, 0)
    grid = (block_expert.numel(), triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](
        a, words, out, sorted_ids, block_expert, weights if weights is not None else out, s, z, g,
        n, k, num_pairs, a.stride(0), words.stride(0), words.stride(1), out.stride(0), *strides,
        A_ROW_DIV=a_row_div, MUL_WEIGHT=weights is not None, NUM_EXPERTS=num_experts,
        PRECISION="ieee" if a.dtype == torch.float32 else "tf32",
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; GPUs never take this path.
        DOT_FP32=INTERPRETED and a.dtype == torch.bfloat16, **quant, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k,
    )  # fmt: skip


def moe_triton(
    x: torch.Tensor, w13: torch.Tensor | IntExperts, w2: torch.Tensor | IntExperts, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:  # fmt: skip
    """Same contract as ``moe_torch``: two grouped GEMMs around the kernel set's SiLU-and-multiply."""
    if isinstance(w13, list) or isinstance(w2, list):
        raise ValueError("the Triton MoE kernel reads stacked experts; integer experts loaded for a CPU (one C-kernel "
                         "weight per expert) run on the CPU kernel set")  # fmt: skip
    if x.stride(-1) != 1:
        x = x.contiguous()
    tokens, k = topk_ids.shape
    block_m = 16 if x.device.type != "cuda" or tokens * k <= 1024 else 64
    sorted_ids, block_expert = moe_align(topk_ids, w13.shape[0], block_m)
    pairs = tokens * k
    gate_up = torch.empty((pairs, w13.shape[1]), dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, sorted_ids, block_expert, None, k, pairs, block_m)
    activation = silu_and_mul(gate_up)
    out = torch.empty((pairs, w2.shape[1]), dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).contiguous()
    _grouped_gemm(activation, w2, out, sorted_ids, block_expert, weights, 1, pairs, block_m)
    return out.view(tokens, k, -1).sum(dim=1)
