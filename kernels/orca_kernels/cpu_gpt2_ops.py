"""GPT-2's element-wise ops as C kernels on CPU (csrc/gpt2_ops.c): residual-add + LayerNorm and
bias + GeLU, float32 and bfloat16.

At batch 1 a decode step of the torch references is dispatch-bound: residual-add + LayerNorm is
2 aten ops (add, layer_norm) and bias + GeLU 2 more (add, gelu), 25 + 12 calls per GPT-2-small
step, at a few microseconds each against well under a microsecond of arithmetic; at prefill each
reference makes an extra pass over a large activation. Each op here is one ctypes call that reads
its inputs and writes its outputs once, with tokens spread over torch's threads when there are
enough of them.

The wrappers keep the signatures and contracts of the torch references (layernorm.py, gelu.py).
They take the CPU dtypes they have kernels for and say so with a ValueError otherwise; choosing them
where they apply and the references elsewhere is dispatch's job (dispatch.py).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from orca_kernels.layernorm import add_layernorm_torch
from orca_kernels.native import I64 as _I64
from orca_kernels.native import PTR as _P
from orca_kernels.native import TorchOrder, check_float32, check_float32_or_bf16, declare, probe_torch_order
from orca_kernels.rows import as_rows, empty_rows

LIBRARY = "gpt2_ops"


@functools.cache
def load_add_layernorm_kernel(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr:
    # x, x_stride, residual, res_stride, weight, bias, out, summed, rows, hidden, eps, lanes, num_threads
    # (bfloat16: + scratch, one float32 row per thread)
    args = [_P, _I64, _P, _I64, _P, _P, _P, _P, _I64, _I64, ctypes.c_float, _I64, ctypes.c_int]
    if dtype == torch.bfloat16:
        return declare(LIBRARY, "orca_add_layernorm_bf16", [*args, _P], None)
    return declare(LIBRARY, "orca_add_layernorm_f32", args, None)


@functools.cache
def load_bias_gelu_kernel(dtype: torch.dtype = torch.float32) -> ctypes._CFuncPtr:
    # x, x_stride, bias, out, rows, inner, num_threads
    name = "orca_bias_gelu_bf16" if dtype == torch.bfloat16 else "orca_bias_gelu_f32"
    return declare(LIBRARY, name, [_P, _I64, _P, _P, _I64, _I64, ctypes.c_int], None)


def load_gpt2_kernels() -> None:
    """Builds (once per machine) and declares every kernel; raises NativeBuildError or OSError with
    the reason, as `load_decode_kernel` does."""
    load_add_layernorm_kernel(torch.float32)
    load_add_layernorm_kernel(torch.bfloat16)
    load_bias_gelu_kernel(torch.float32)
    load_bias_gelu_kernel(torch.bfloat16)
    add_layernorm_order()


@functools.cache
def add_layernorm_order() -> TorchOrder:
    """The width torch's LayerNorm computes its moments in here. The kernel's variance is torch's to
    an ulp or two, not bit for bit (gpt2_ops.c, row_moments), so this compares within 1e-5; rows
    with a large common offset tell the widths apart (at the wrong one outputs move by ~1e-4)."""
    gen = torch.Generator().manual_seed(0)
    probes = [torch.randn(16, hidden, generator=gen) + offset for hidden in (100, 768, 4099) for offset in (0.0, 1000.0)]
    weight, bias = torch.randn(4099, generator=gen), torch.randn(4099, generator=gen)

    def agrees(lanes: int) -> bool:
        for x in probes:
            w, b = weight[: x.shape[1]], bias[: x.shape[1]]
            got, ref = add_layernorm_cpu(x, None, w, b, 1e-5, lanes)[0], add_layernorm_torch(x, None, w, b, 1e-5)[0]
            if not torch.allclose(got, ref, rtol=1e-5, atol=1e-5):
                return False
        return True

    return probe_torch_order("add+LayerNorm", agrees)


@functools.cache
def add_layernorm_bf16_order() -> TorchOrder:
    """The bfloat16 kernel at the float32 kernel's width, against torch's bfloat16 LayerNorm: it
    matches where every output is torch's or one bfloat16 ulp from it, and at most one in 1000
    differs (gpt2_ops.c says why some may; about one in 10^4 does)."""
    gen = torch.Generator().manual_seed(1)
    probes = [(torch.randn(16, hidden, generator=gen) * 3 + offset).to(torch.bfloat16) for hidden in (100, 768, 4099)
              for offset in (0.0, 8.0)]  # fmt: skip
    weight, bias = (torch.randn(4099, generator=gen).to(torch.bfloat16) for _ in range(2))

    def agrees(lanes: int) -> bool:
        differ = total = 0
        for x in probes:
            w, b = weight[: x.shape[1]], bias[: x.shape[1]]
            got, ref = add_layernorm_cpu(x, None, w, b, 1e-5, lanes)[0], add_layernorm_torch(x, None, w, b, 1e-5)[0]
            steps = (got.view(torch.int16).int() - ref.view(torch.int16).int()).abs()  # bfloat16 ulps (same signs)
            if (steps > 1).any():
                return False
            differ, total = differ + int(steps.count_nonzero()), total + steps.numel()
        return differ * 1000 <= total

    lanes = add_layernorm_order().lanes
    if agrees(lanes):
        return TorchOrder(lanes, True)
    return probe_torch_order("bfloat16 add+LayerNorm", agrees)


# As in cpu_llama_ops: written for speed at one token, where each wrapper costs about as much as
# the ctypes call itself.


def add_layernorm_cpu(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    bias: torch.Tensor,
    eps: float,
    lanes: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as `add_layernorm_torch`: (LayerNorm(x + residual), x + residual), the sum
    being x itself when residual is None. Any leading shape; x and residual may be strided; all
    float32 or all bfloat16. `lanes` (0: the width probed on this machine, `add_layernorm_order`) is
    the vector width of torch's moments order."""
    dtype = check_float32_or_bf16("add_layernorm_cpu", x, residual, weight, bias)
    hidden = x.shape[-1]
    if (
        weight.shape != (hidden,)
        or bias.shape != (hidden,)
        or (residual is not None and residual.shape != x.shape)
    ):
        shape = None if residual is None else tuple(residual.shape)
        raise ValueError(f"add_layernorm_cpu needs x [..., {hidden}], residual of x's shape or None and weight "
                         f"and bias [{hidden}], got x {tuple(x.shape)}, residual {shape}, weight "
                         f"{tuple(weight.shape)}, bias {tuple(bias.shape)}")  # fmt: skip
    x2 = as_rows(x, hidden)
    rows = x2.shape[0]
    out = empty_rows(x, rows, hidden, dtype)
    if residual is None:
        summed, res_ptr, res_stride = x, None, 0
    else:
        summed, res2 = empty_rows(x, rows, hidden, dtype), as_rows(residual, hidden)
        res_ptr, res_stride = res2.data_ptr(), res2.stride(0)
    if rows and hidden:
        threads = torch.get_num_threads()
        args = [x2.data_ptr(), x2.stride(0), res_ptr, res_stride, weight.contiguous().data_ptr(),
                bias.contiguous().data_ptr(), out.data_ptr(), summed.data_ptr(), rows, hidden, eps,
                lanes or add_layernorm_order().lanes, threads]  # fmt: skip
        scratch = torch.empty(threads * hidden if dtype == torch.bfloat16 else 0, dtype=torch.float32)
        if dtype == torch.bfloat16:  # one float32 row per thread for the widened sum (kept alive through the call)
            args.append(scratch.data_ptr())
        load_add_layernorm_kernel(dtype)(*args)
    return out, summed


def bias_gelu_cpu(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """Same contract as `bias_gelu_torch`: gelu_tanh(x + bias) for x [..., inner], bias [inner], both
    float32 or both bfloat16 (the GeLU in float32, rounded once: gpt2_ops.c)."""
    if not (x.dtype == bias.dtype == torch.bfloat16 and x.device.type == bias.device.type == "cpu"):
        check_float32("bias_gelu_cpu", x, bias)
    inner = x.shape[-1]
    if bias.shape != (inner,):
        raise ValueError(f"bias_gelu_cpu needs x [..., {inner}] and bias [{inner}], got x {tuple(x.shape)}, "
                         f"bias {tuple(bias.shape)}")  # fmt: skip
    x2 = as_rows(x, inner)
    rows = x2.shape[0]
    out = empty_rows(x, rows, inner, x.dtype)
    if rows and inner:
        load_bias_gelu_kernel(x.dtype)(
            x2.data_ptr(),
            x2.stride(0),
            bias.contiguous().data_ptr(),
            out.data_ptr(),
            rows,
            inner,
            torch.get_num_threads(),
        )
    return out
