"""The Llama family's element-wise ops as C kernels on CPU (csrc/llama_ops.c), float32 and bfloat16.

At batch 1 a decode step of the torch references is dispatch-bound: residual-add + RMSNorm is
~6 aten ops, rotary ~15 (gather, split, per-tensor mul/sub/cat, casts) and SiLU-and-mul ~4, at a
few microseconds each against well under a microsecond of arithmetic. Each op here is one ctypes
call that reads its inputs and writes its outputs once, with tokens spread over torch's threads
when there are enough of them.

The wrappers keep the signatures and contracts of the torch references (rmsnorm.py, rotary.py,
silu.py). They take CPU tensors all float32 or all bfloat16 and say so with a ValueError otherwise;
choosing them, or the references for other dtypes, is dispatch's job (dispatch.py). bfloat16 rounds
where torch's bfloat16 ops round (csrc/llama_ops.c), so the tokens of a bfloat16 model are the
references' bit for bit too; its own probes (`*_bf16_order`) check that on this machine.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Callable

import torch

from orca_kernels.native import I64 as _I64
from orca_kernels.native import PTR as _P
from orca_kernels.native import TorchOrder, check_float32_or_bf16, declare, probe_torch_order
from orca_kernels.rmsnorm import add_rmsnorm_torch
from orca_kernels.rotary import check_rotary_args
from orca_kernels.rows import as_rows, empty_rows
from orca_kernels.silu import gate_up_split, silu_and_mul_torch

LIBRARY = "llama_ops"


SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def load_add_rmsnorm_kernel(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr:
    # x, x_stride, residual, res_stride, weight, out, summed, rows, hidden, eps, lanes, num_threads
    # (bfloat16: + scratch, one float32 row per thread)
    args = [_P, _I64, _P, _I64, _P, _P, _P, _I64, _I64, ctypes.c_float, _I64, ctypes.c_int]
    return declare(LIBRARY, f"orca_add_rmsnorm_{SUFFIX[dtype]}", args + [_P] * (dtype == torch.bfloat16), None)


@functools.cache
def load_rotary_kernel(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr:
    # q, q_tok_stride, q_head_stride, k, k_tok_stride, k_head_stride, positions, cos_sin, cs_stride,
    # max_positions, q_out, k_out, tokens, q_heads, k_heads, head_dim, num_threads
    return declare(LIBRARY, f"orca_rotary_{SUFFIX[dtype]}", [_P, _I64, _I64, _P, _I64, _I64, _P, _P, _I64, _I64, _P,
                                                         _P, _I64, _I64, _I64, _I64, ctypes.c_int], _I64)  # fmt: skip


@functools.cache
def load_silu_and_mul_kernel(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr:
    # x, x_stride, out, rows, inner, lanes, num_threads
    return declare(LIBRARY, f"orca_silu_and_mul_{SUFFIX[dtype]}", [_P, _I64, _P, _I64, _I64, _I64, ctypes.c_int], None)


def load_llama_kernels() -> None:
    """Builds (once per machine) and declares every kernel and probes the vector widths torch adds
    in; raises NativeBuildError or OSError with the reason, as `load_decode_kernel` does."""
    for dtype in SUFFIX:
        load_add_rmsnorm_kernel(dtype)
        load_rotary_kernel(dtype)
        load_silu_and_mul_kernel(dtype)
    add_rmsnorm_order()
    silu_and_mul_order()


def _probe_rows(rows: int, width: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(rows, width, generator=torch.Generator().manual_seed(seed)) * scale


@functools.cache
def add_rmsnorm_order() -> TorchOrder:
    """The width torch's sum (which the reference's mean runs) adds in here. The probe widths
    exercise every part of its order (scalar rows, whole ILP rows, leftover vectors, the scalar
    tail, the cascade's levels); random rows differ between 8 and 16 lanes in about half of them."""
    probes = [(_probe_rows(8, hidden, seed=hidden), _probe_rows(8, hidden, seed=hidden + 1), _probe_rows(1, hidden, seed=2)[0])
              for hidden in (64, 100, 773, 4099, 40000)]  # fmt: skip

    def agrees(lanes: int) -> bool:
        return all(torch.equal(add_rmsnorm_cpu(x, r, w, 1e-6, lanes)[0], add_rmsnorm_torch(x, r, w, 1e-6)[0])
                   for x, r, w in probes)  # fmt: skip

    return probe_torch_order("add+RMSNorm", agrees)


@functools.cache
def silu_and_mul_order() -> TorchOrder:
    """The width torch's element-wise loop splits SiLU's rows at here (two vectors with SLEEF's exp,
    the rest with std::exp): inner widths that are 16 or more past a multiple of 32 split
    differently at 8 and 16 lanes, and the two exps differ in the last bit for a few percent of
    inputs."""
    probes = [_probe_rows(64, 2 * inner, seed=inner, scale=4.0) for inner in (24, 56, 1016)]

    def agrees(lanes: int) -> bool:
        return all(torch.equal(silu_and_mul_cpu(x, lanes), silu_and_mul_torch(x)) for x in probes)

    return probe_torch_order("SiLU-and-mul", agrees)


@functools.cache
def add_rmsnorm_bf16_order() -> TorchOrder:
    """`add_rmsnorm_order` for bfloat16 rows (the squares are float32's, the roundings bfloat16's)."""
    probes = [tuple(t.to(torch.bfloat16) for t in (_probe_rows(8, hidden, seed=hidden), _probe_rows(8, hidden, seed=hidden + 1),
                                                   _probe_rows(1, hidden, seed=2)[0]))
              for hidden in (64, 100, 773, 4099)]  # fmt: skip

    def agrees(lanes: int) -> bool:
        return all(torch.equal(add_rmsnorm_cpu(x, r, w, 1e-6, lanes)[0], add_rmsnorm_torch(x, r, w, 1e-6)[0])
                   for x, r, w in probes)  # fmt: skip

    # The squares are float32's whatever the rows' dtype: the float32 probe's width first (bfloat16's
    # rounding can hide a last-bit difference in the sum on some probe rows, and agree at any width).
    float32 = add_rmsnorm_order()
    return float32 if float32.matches and agrees(float32.lanes) else probe_torch_order("bfloat16 add+RMSNorm", agrees)


@functools.cache
def silu_and_mul_bf16_order() -> TorchOrder:
    """`silu_and_mul_order` for bfloat16 rows: torch's loop splits them at pairs of bfloat16 vectors,
    so inner widths past multiples of 32 and 64 tell the widths apart."""
    probes = [_probe_rows(64, 2 * inner, seed=inner, scale=4.0).to(torch.bfloat16) for inner in (24, 56, 100, 1016)]

    def agrees(lanes: int) -> bool:
        return all(torch.equal(silu_and_mul_cpu(x, lanes), silu_and_mul_torch(x)) for x in probes)

    return probe_torch_order("bfloat16 SiLU-and-mul", agrees)


def _order(dtype: torch.dtype, float32: Callable[[], TorchOrder], bfloat16: Callable[[], TorchOrder]) -> int:
    """The vector width probed for the dtype's kernel."""
    return (bfloat16 if dtype == torch.bfloat16 else float32)().lanes


# The wrappers below are written for speed at one token, where each of them costs about as much as
# the ctypes call itself (see rows.py).


def add_rmsnorm_cpu(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, lanes: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_rmsnorm_torch`: (RMSNorm(x + residual), x + residual), the sum being x
    itself when residual is None. Any leading shape ([T, hidden], or [T * heads, head_dim] for
    Qwen3's per-head norm); x and residual may be strided. `lanes` (0: the width probed on this
    machine, `add_rmsnorm_order`) is the vector width of torch's order the squares are added in."""
    dtype = check_float32_or_bf16("add_rmsnorm_cpu", x, residual, weight)
    hidden = x.shape[-1]
    if weight.shape != (hidden,) or (residual is not None and residual.shape != x.shape):
        shape = None if residual is None else tuple(residual.shape)
        raise ValueError(f"add_rmsnorm_cpu needs x [..., {hidden}], residual of x's shape or None and weight "
                         f"[{hidden}], got x {tuple(x.shape)}, residual {shape}, weight {tuple(weight.shape)}")  # fmt: skip
    x2 = as_rows(x, hidden)
    rows = x2.shape[0]
    out = empty_rows(x, rows, hidden, dtype)
    if residual is None:
        summed, res2, res_ptr, res_stride = x, None, None, 0
    else:
        summed, res2 = empty_rows(x, rows, hidden, dtype), as_rows(residual, hidden)
        res_ptr, res_stride = res2.data_ptr(), res2.stride(0)
    if rows:
        threads = torch.get_num_threads()
        args = [x2.data_ptr(), x2.stride(0), res_ptr, res_stride, weight.contiguous().data_ptr(), out.data_ptr(),
                summed.data_ptr(), rows, hidden, eps, lanes or _order(dtype, add_rmsnorm_order, add_rmsnorm_bf16_order),
                threads]  # fmt: skip
        scratch = torch.empty(threads * hidden if dtype == torch.bfloat16 else 0, dtype=torch.float32)
        if dtype == torch.bfloat16:  # one float32 row per thread for the widened sum (kept alive through the call)
            args.append(scratch.data_ptr())
        load_add_rmsnorm_kernel(dtype)(*args)
    return out, summed


def rotary_cpu(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `rotary_torch`: q [T, Hq, D], k [T, Hkv, D] (any strides; views of the fused
    qkv projection, never modified), positions [T], cos_sin [P, D] -> new contiguous (q_out, k_out).

    A position outside [0, P) raises IndexError (the reference's indexing raises too, except that
    it would also wrap negative positions, which no caller produces)."""
    dtype = check_float32_or_bf16("rotary_cpu", q, k)
    if cos_sin.dtype != torch.float32:
        raise ValueError(f"rotary_cpu takes a float32 cos/sin table, got {cos_sin.dtype}")
    head_dim = check_rotary_args(q, k, positions, cos_sin)
    if q.stride(2) != 1:
        q = q.contiguous()
    if k.stride(2) != 1:
        k = k.contiguous()
    if cos_sin.stride(1) != 1:
        cos_sin = cos_sin.contiguous()
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        positions = positions.to(torch.int64).contiguous()
    tokens, q_heads, _ = q.shape
    k_heads = k.shape[1]
    q_out = torch.empty(tokens, q_heads, head_dim, dtype=dtype)
    k_out = torch.empty(tokens, k_heads, head_dim, dtype=dtype)
    if tokens:
        bad = load_rotary_kernel(dtype)(
            q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), k.stride(1), positions.data_ptr(),
            cos_sin.data_ptr(), cos_sin.stride(0), cos_sin.shape[0], q_out.data_ptr(), k_out.data_ptr(), tokens,
            q_heads, k_heads, head_dim, torch.get_num_threads(),
        )  # fmt: skip
        if bad >= 0:
            raise IndexError(f"rotary position {int(positions[bad])} of token {bad} is outside the cos/sin "
                             f"table of {cos_sin.shape[0]} positions")  # fmt: skip
    return q_out, k_out


def silu_and_mul_cpu(x: torch.Tensor, lanes: int = 0) -> torch.Tensor:
    """Same contract as `silu_and_mul_torch`: x [..., 2 * inner] (gate, then up) -> silu(gate) * up
    [..., inner]. `lanes` (0: the width probed on this machine, `silu_and_mul_order`) is the vector
    width whose pairs take SLEEF's exp, as in torch's loop."""
    dtype = check_float32_or_bf16("silu_and_mul_cpu", x)
    inner = gate_up_split(x.shape[-1])
    x2 = as_rows(x, 2 * inner)
    rows = x2.shape[0]
    out = empty_rows(x, rows, inner, dtype)
    if rows and inner:
        load_silu_and_mul_kernel(dtype)(
            x2.data_ptr(),
            x2.stride(0),
            out.data_ptr(),
            rows,
            inner,
            lanes or _order(dtype, silu_and_mul_order, silu_and_mul_bf16_order),
            torch.get_num_threads(),
        )
    return out
