"""Multi-LoRA as two grouped Triton kernels, shrink then expand (Punica's SGMV; semantics lora.py's).

Both grids are (token blocks, rank or output blocks, slots) from plain integers: the step's token
count, the stack's rank and width, and its slot count. Program (m, ., s) takes the m-th block of ``BLOCK_M`` tokens of slot s
from `LoRAMetadata.sorted_tokens` (the slot's start and count read on the device) and exits at once
when the slot has fewer tokens, so a slot with no token this step costs a program that reads two
integers, and nothing is read back to the host: any step with adapters is capture-safe (a CUDA
graph's bucket pads the tokens with slot -1; worker/cuda_graphs.py).

shrink: ``s[t] = x[t] A[slot]^T`` into a float32 [T, R] buffer (rows of tokens without an adapter
are not written and never read); expand: ``y[t] += s[t] B[slot]^T`` in place. Every token has one
slot, so each element of y is written by one program: no atomics.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .lora import LoRAMetadata


@triton.jit
def _slot_tokens(sorted_ptr, starts_ptr, count, pid_m, slot, BLOCK_M: tl.constexpr):
    """The token indices of block `pid_m` of the slot's `count` tokens (int64), and which are real."""
    offs = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    valid = offs < count
    tokens = tl.load(sorted_ptr + tl.load(starts_ptr + slot) + offs, mask=valid, other=0).to(tl.int64)
    return tokens, valid


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, s_ptr, sorted_ptr, starts_ptr, counts_ptr,
    K, R, stride_xm, stride_as, stride_ar, stride_sm,
    PRECISION: tl.constexpr, DOT_FP32: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
):  # fmt: skip
    pid_m, pid_r, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    tokens, valid = _slot_tokens(sorted_ptr, starts_ptr, count, pid_m, slot, BLOCK_M)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    a_base = a_ptr + slot.to(tl.int64) * stride_as
    acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + tokens[:, None] * stride_xm + offs_k[None, :], mask=valid[:, None] & k_mask[None, :], other=0.0)
        a = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                    other=0.0)  # fmt: skip
        if DOT_FP32:
            x = x.to(tl.float32)
            a = a.to(tl.float32)
        acc += tl.dot(x, tl.trans(a), input_precision=PRECISION)
    tl.store(s_ptr + tokens[:, None] * stride_sm + offs_r[None, :], acc, mask=valid[:, None] & r_mask[None, :])


@triton.jit
def _expand_kernel(
    s_ptr, b_ptr, y_ptr, sorted_ptr, starts_ptr, counts_ptr,
    N, R, stride_sm, stride_bs, stride_bn, stride_ym,
    PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid_m, pid_n, slot = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    count = tl.load(counts_ptr + slot)
    if pid_m * BLOCK_M >= count:
        return
    tokens, valid = _slot_tokens(sorted_ptr, starts_ptr, count, pid_m, slot, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + slot.to(tl.int64) * stride_bs
    delta = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for r0 in range(0, R, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        s = tl.load(s_ptr + tokens[:, None] * stride_sm + offs_r[None, :], mask=valid[:, None] & r_mask[None, :],
                    other=0.0)  # fmt: skip
        b = tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :],
                    other=0.0).to(tl.float32)  # fmt: skip
        delta += tl.dot(s, tl.trans(b), input_precision=PRECISION)
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + offs_n[None, :]
    mask = valid[:, None] & n_mask[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, (y + delta).to(y_ptr.dtype.element_ty), mask=mask)


INTERPRETED: bool = not isinstance(_shrink_kernel, JITFunction)


def lora_triton(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, meta: LoRAMetadata) -> None:
    """Same contract as ``lora_torch``: y [T, out] += each token's (x A^T) B^T, in place."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if y.stride(-1) != 1:
        raise ValueError("lora_triton adds into y in place: it needs unit column stride")
    tokens, k = x.shape
    slots, r = a.shape[0], a.shape[1]
    n = b.shape[1]
    if tokens == 0 or slots == 0:
        return
    block_m = 16
    block_r = min(max(16, triton.next_power_of_2(r)), 64)  # ranks above 64 are tiled
    block_n, block_k = (64, 64) if x.device.type == "cuda" else (16, 32)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    shrunk = torch.empty((tokens, r), dtype=torch.float32, device=x.device)
    args = (meta.sorted_tokens, meta.slot_starts, meta.slot_counts)
    _shrink_kernel[(triton.cdiv(tokens, block_m), triton.cdiv(r, block_r), slots)](
        x, a, shrunk, *args, k, r, x.stride(0), a.stride(0), a.stride(1), shrunk.stride(0),
        PRECISION=precision,
        # Triton's CPU interpreter multiplies bf16 bit patterns in tl.dot; GPUs never take this path.
        DOT_FP32=INTERPRETED and x.dtype == torch.bfloat16, BLOCK_M=block_m, BLOCK_R=block_r, BLOCK_K=block_k,
    )  # fmt: skip
    _expand_kernel[(triton.cdiv(tokens, block_m), triton.cdiv(n, block_n), slots)](
        shrunk, b, y, *args, n, r, shrunk.stride(0), b.stride(0), b.stride(1), y.stride(0),
        PRECISION=precision, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
    )  # fmt: skip
