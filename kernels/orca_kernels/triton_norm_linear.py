"""A decoder layer's pre-norm fused into the GEMM it feeds: one Triton launch for the previous linear
layer's bias, the residual add, the LayerNorm or RMSNorm, the GEMM, its bias and its activation (GELU,
or the gated MLPs' SiLU/GELU-and-multiply). Semantics: norm_linear.py.

Why: a decode step is launch-bound (issue #41). A layer of separate kernels is at least seven launches
(two norms, four GEMMs, attention), more at one row, where cuBLAS has no bias/GELU epilogue; with the
norms inside the GEMMs that read them, and the biases of the o/down projections carried into the next
norm, a layer is five or six (docs/architecture.md, "Kernels per decoder layer").

Program (row block m, column block n) reads its rows of x three times (twice for RMSNorm): the
statistics, the centred variance (LayerNorm: two-pass, as triton_layernorm.py), then the GEMM's K loop,
normalising each x tile as it loads it. Every column block recomputes its rows' statistics; at the
token counts this runs for (the models use it up to `gemm.NORM_LINEAR_MAX_TOKENS` rows) x is a few
hundred KB that stays in L2, while the weight, read once in all, is the traffic that counts. Only
column block 0 stores the summed residual; the others recompute the same sum, rounded the same way.

Rounding follows the references op by op: each add rounded to the residual's dtype, the normalised row
rounded to the model dtype before the GEMM (as the norm's output tensor is), the GEMM accumulated in
fp32; ``gelu`` and the gated activations start from the GEMM's output rounded to the model dtype (the
tensor the unfused path hands them), the plain linear adds its bias before its one rounding.
Arithmetic itself is fp32 (Triton's interpreter holds bf16 as raw uint16 and would add bit patterns).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from .norm_linear import check_activation
from .rows import as_rows

_ACTIVATION_CODES = {"none": 0, "gelu": 1, "silu_and_mul": 2, "gelu_and_mul": 3}


@triton.jit
def _summed_tile(x_ptr, xb_ptr, res_ptr, rows, cols, mask, hidden, stride_x, stride_res, SUM_TY: tl.constexpr,
                 HAS_X_BIAS: tl.constexpr, HAS_RESIDUAL: tl.constexpr):  # fmt: skip
    """x (+ x_bias) (+ residual) of a [rows, cols] tile in fp32, each add rounded to SUM_TY."""
    s = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    if HAS_X_BIAS:
        xb = tl.load(xb_ptr + cols, mask=cols < hidden, other=0.0).to(tl.float32)
        s = (s + xb[None, :]).to(SUM_TY).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + rows[:, None] * stride_res + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        s = (s + r).to(SUM_TY).to(tl.float32)
    return s


@triton.jit
def _sigmoid(z):
    e = tl.exp(-tl.abs(z))  # in (0, 1]: never overflows for very negative z
    return tl.where(z >= 0, 1.0 / (1.0 + e), e / (1.0 + e))


@triton.jit
def _gelu_tanh(s):
    # 0.5 s (1 + tanh(y)) == s sigmoid(2 y), y = sqrt(2 / pi) (s + 0.044715 s^3) (triton_gelu.py)
    return s * _sigmoid(2.0 * 0.7978845608028654 * (s + 0.044715 * s * s * s))


@triton.jit
def _norm_linear_kernel(
    x_ptr,
    xb_ptr,
    res_ptr,
    nw_ptr,
    nb_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    sum_ptr,
    num_rows,
    hidden,
    out_cols,
    stride_x,
    stride_res,
    stride_w,
    stride_out,
    stride_sum,
    eps,
    HAS_X_BIAS: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STORE_SUM: tl.constexpr,
    LAYERNORM: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr,  # _ACTIVATION_CODES
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    sum_ty = sum_ptr.dtype.element_ty  # the summed residual's dtype (x's when nothing is added)
    h_ty = w_ptr.dtype.element_ty  # the norm's output, the GEMM's input: the model dtype
    out_ty = out_ptr.dtype.element_ty
    rows = (tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    row_mask = rows < num_rows
    col_block = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)

    # The statistics (and, in column block 0, the stored sum).
    total = tl.zeros([BLOCK_M], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        cols = k0 + offs_k
        mask = row_mask[:, None] & (cols < hidden)[None, :]
        s = _summed_tile(x_ptr, xb_ptr, res_ptr, rows, cols, mask, hidden, stride_x, stride_res, sum_ty, HAS_X_BIAS,
                         HAS_RESIDUAL)  # fmt: skip
        if STORE_SUM and col_block == 0:
            tl.store(sum_ptr + rows[:, None] * stride_sum + cols[None, :], s.to(sum_ty), mask=mask)
        total += tl.sum(s if LAYERNORM else s * s, axis=1)  # masked columns are 0
    if LAYERNORM:
        mean = total / hidden
        var = tl.zeros([BLOCK_M], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            cols = k0 + offs_k
            mask = row_mask[:, None] & (cols < hidden)[None, :]
            s = _summed_tile(x_ptr, xb_ptr, res_ptr, rows, cols, mask, hidden, stride_x, stride_res, sum_ty, HAS_X_BIAS,
                             HAS_RESIDUAL)  # fmt: skip
            diff = tl.where(mask, s - mean[:, None], 0.0)
            var += tl.sum(diff * diff, axis=1)
        rstd = 1.0 / tl.sqrt(var / hidden + eps)
    else:
        mean = tl.zeros([BLOCK_M], dtype=tl.float32)
        rstd = tl.rsqrt(total / hidden + eps)

    # The GEMM, normalising each x tile as it is loaded. Gated: the gate rows n and the up rows
    # out_cols + n of the weight, two accumulators.
    offs_n = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < out_cols
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        cols = k0 + offs_k
        k_mask = cols < hidden
        mask = row_mask[:, None] & k_mask[None, :]
        s = _summed_tile(x_ptr, xb_ptr, res_ptr, rows, cols, mask, hidden, stride_x, stride_res, sum_ty, HAS_X_BIAS,
                         HAS_RESIDUAL)  # fmt: skip
        nw = tl.load(nw_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
        if LAYERNORM:
            nb = tl.load(nb_ptr + cols, mask=k_mask, other=0.0).to(tl.float32)
            h = ((s - mean[:, None]) * rstd[:, None] * nw[None, :] + nb[None, :]).to(h_ty)
        else:  # LlamaRMSNorm: rounded to the sum's dtype before the weight multiply
            h = (nw[None, :] * (s * rstd[:, None]).to(sum_ty).to(tl.float32)).to(h_ty)
        w_tile = w_ptr + offs_n[None, :].to(tl.int64) * stride_w + cols[:, None]  # [BLOCK_K, BLOCK_N] of W^T
        w_mask = k_mask[:, None] & n_mask[None, :]
        w = tl.load(w_tile, mask=w_mask, other=0.0)
        if DOT_FP32:
            acc += tl.dot(h.to(tl.float32), w.to(tl.float32), input_precision=INPUT_PRECISION)
        else:
            acc += tl.dot(h, w, input_precision=INPUT_PRECISION)
        if ACTIVATION >= 2:
            w_up = tl.load(w_tile + out_cols * stride_w, mask=w_mask, other=0.0)
            if DOT_FP32:
                acc_up += tl.dot(h.to(tl.float32), w_up.to(tl.float32), input_precision=INPUT_PRECISION)
            else:
                acc_up += tl.dot(h, w_up, input_precision=INPUT_PRECISION)

    if ACTIVATION == 0:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
        y = acc
    elif ACTIVATION == 1:  # bias_gelu of the rounded GEMM output, the sum rounded as `x + bias` is
        b = tl.load(b_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)
        y = _gelu_tanh((acc.to(out_ty).to(tl.float32) + b[None, :]).to(out_ty).to(tl.float32))
    else:  # act(gate) * up of the rounded gate/up GEMM output, one rounding at the store
        gate = acc.to(out_ty).to(tl.float32)
        up = acc_up.to(out_ty).to(tl.float32)
        y = (gate * _sigmoid(gate) if ACTIVATION == 2 else _gelu_tanh(gate)) * up
    out_mask = row_mask[:, None] & n_mask[None, :]
    tl.store(out_ptr + rows[:, None] * stride_out + offs_n[None, :], y.to(out_ty), mask=out_mask)


# @triton.jit picks compiled vs interpreted when this module is imported; dispatch re-imports the
# module if TRITON_INTERPRET changed since.
INTERPRETED: bool = not isinstance(_norm_linear_kernel, JITFunction)


# A launch's tiling: (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages).
Blocks = tuple[int, int, int, int, int]


# Weights wider than this (LM heads) take 64-column blocks at decode sizes, 128 beyond (measured).
WIDE_OUT_COLS = 16384


def _blocks(rows: int, out_cols: int, gated: bool, device: torch.device, dtype: torch.dtype) -> Blocks:
    """The tiling for `rows` rows of a weight with `out_cols` output columns, from the sweep on an H200
    (benchmarks/norm_linear_configs.py;
    docs/bench/gpu/smoke-2026-11-29/run2/norm_linear_configs.md) at GPT-2-medium's and
    Qwen2.5-0.5B's shapes. At decode sizes (up to 16 rows: tl.dot's smallest tile) the launch streams the
    weight, and what counts is how much of it each program has in flight: 256-wide K steps in
    32-column blocks cut the QKV and MLP launches from 19-20 us to 12-13, and 64-column blocks suit the
    LM head. Beyond 16 rows, 128-wide K steps with 8 warps (64-row tiles), 64-wide with 128-column
    blocks for the LM head. float32 keeps 32-wide K steps: its tiles are twice the bytes."""
    if device.type != "cuda":
        return 16, 32, 32, 4, 1  # the interpreter: small tiles, every mask path still exercised
    wide = out_cols > WIDE_OUT_COLS and not gated
    if dtype == torch.float32:
        return (16 if rows <= 16 else 64), 64, 32, 4, 2
    if rows <= 16:
        return 16, (64 if wide else 32), 256, 4, 3
    if rows <= 32:
        return 32, 64, 128, 4, 3
    return (64, 128, 64, 8, 3) if wide else (64, 64, 128, 8, 3)


def norm_linear_triton(
    x: torch.Tensor,
    x_bias: torch.Tensor | None,
    residual: torch.Tensor | None,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor | None,
    eps: float,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str = "none",
    blocks: Blocks | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``norm_linear_torch``, for 2-D x [T, hidden] and a contiguous weight [N, hidden].
    `blocks` overrides the tiling (the tuning sweep's knob; the models leave it to `_blocks`)."""
    check_activation(activation, bias)
    hidden = x.shape[-1]
    if x.dim() != 2 or weight.dim() != 2 or weight.shape[1] != hidden or weight.stride(1) != 1:
        raise ValueError(f"norm_linear needs x [T, {hidden}] and a row-major weight [N, {hidden}], got "
                         f"{tuple(x.shape)} and {tuple(weight.shape)} strides {weight.stride()}")  # fmt: skip
    x2 = as_rows(x, hidden)
    gated = activation.endswith("_and_mul")
    out_cols = weight.shape[0] // 2 if gated else weight.shape[0]
    summed_dtype = x.dtype if residual is None else torch.result_type(x, residual)
    store_sum = residual is not None or x_bias is not None
    # Without anything to add, the references return x itself as the residual.
    summed = torch.empty(x2.shape, dtype=summed_dtype, device=x.device) if store_sum else x
    res2 = as_rows(residual, hidden) if residual is not None else x2  # unread without a residual
    out = torch.empty((x2.shape[0], out_cols), dtype=weight.dtype, device=x.device)
    rows = x2.shape[0]
    if rows == 0:
        return out, summed
    block_m, block_n, block_k, num_warps, num_stages = blocks or _blocks(rows, out_cols, gated, x.device,
                                                                         weight.dtype)  # fmt: skip
    summed2 = summed if summed.dim() == 2 else summed.view(-1, hidden)
    grid = (triton.cdiv(rows, block_m), triton.cdiv(out_cols, block_n))
    _norm_linear_kernel[grid](
        x2,
        x_bias if x_bias is not None else norm_w,  # unread without HAS_X_BIAS
        res2,
        norm_w,
        norm_b if norm_b is not None else norm_w,  # unread for RMSNorm
        weight,
        bias if bias is not None else norm_w,  # unread without a bias
        out,
        summed2,
        rows,
        hidden,
        out_cols,
        x2.stride(0),
        res2.stride(0),
        weight.stride(0),
        out.stride(0),
        summed2.stride(0),
        eps,
        HAS_X_BIAS=x_bias is not None,
        HAS_RESIDUAL=residual is not None,
        STORE_SUM=store_sum,
        LAYERNORM=norm_b is not None,
        HAS_BIAS=bias is not None,
        ACTIVATION=_ACTIVATION_CODES[activation],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        INPUT_PRECISION="ieee" if weight.dtype == torch.float32 else "tf32",
        DOT_FP32=INTERPRETED and weight.dtype == torch.bfloat16,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out, summed
