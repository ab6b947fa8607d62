"""Picks the kernel implementation once per device: Triton kernels on CUDA; on CPU (``cpu``) the C
kernels (decode attention and the K/V write; in float32 and bfloat16 the Llama family's RMSNorm,
rotary and SiLU-and-mul; in float32 GPT-2's LayerNorm and bias-GELU) and the torch references for
the rest (float16, GPT-2's ops in bfloat16, GeGLU).

``ORCA_KERNELS=auto|triton|cpu|torch`` forces one for A/B runs (``triton`` on CPU needs
``TRITON_INTERPRET=1``, set before the process first imports triton; ``torch`` is the plain
references). A forced choice that cannot run is an error. Under ``auto`` on CPU, a machine with no
C compiler gets the torch references with a logged warning naming the reason, and so does any op whose C
kernel does not reproduce torch's rounding on this machine (native.probe_torch_order) — the documented
fallbacks, since the result is the same and only slower.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import cpu_gpt2_ops, cpu_llama_ops, native
from .attention import attention_torch, rotate_and_attend, write_kv_and_attend, write_kv_torch
from .cpu_attention import attention_cpu, load_decode_kernel, load_write_kv_kernel, write_kv_cpu
from .cpu_int_gemm import expert_linear_cpu
from .gelu import bias_gelu_torch
from .layernorm import add_layernorm_torch
from .lora import lora_torch
from .moe import moe_torch
from .rmsnorm import add_rmsnorm_torch
from .rotary import rotary_torch
from .silu import gelu_and_mul_torch, silu_and_mul_torch

logger = logging.getLogger("orca.kernels")

KERNEL_ENV = "ORCA_KERNELS"


@dataclass(frozen=True)
class KernelOps:
    """One implementation of every op the model families call; the signatures are the torch
    references' (GPT-2: add_layernorm, bias_gelu; Llama family: add_rmsnorm, silu_and_mul, rotary;
    attention and write_kv are shared, GQA included).

    The models call the compositions: GPT-2 write_kv_attention, the Llama family
    rotary_write_kv_attention. The torch and cpu sets compose their own ops (attention.py's
    write_kv_and_attend and rotate_and_attend, bound here, so replacing `rotary` on a set does not
    change its composition); the Triton set fuses them for a decode-only batch into the split-K
    decode launch (rotary, the K/V write and attention in one kernel, + its reduce)."""

    name: str  # "triton", "cpu" or "torch"
    add_layernorm: Callable
    bias_gelu: Callable
    attention: Callable
    write_kv: Callable
    add_rmsnorm: Callable
    silu_and_mul: Callable
    rotary: Callable
    # (q, k, v, k_cache, v_cache, meta, scale): write_kv, then attention; what the models call
    write_kv_attention: Callable
    # (q, k, v, positions, cos_sin, k_cache, v_cache, meta, scale): rotary of q and k, then
    # write_kv_attention; what the Llama family calls
    rotary_write_kv_attention: Callable
    # (x, w13, w2, topk_weights, topk_ids) -> [T, H]: the mixture-of-experts MLP (moe.py)
    moe: Callable
    # Gemma's GeGLU: as silu_and_mul with the tanh GELU. On CPU the torch reference (no C kernel:
    # one family uses it, and torch's vectorised GELU is within reach of a C loop).
    gelu_and_mul: Callable
    # (y, x, a, b, lora_meta): y += each token's adapter delta in place (multi-LoRA, lora.py); on CPU
    # the reference, which reads each active adapter's weights once per projection
    lora: Callable
    # (x, x_bias, residual, norm_w, norm_b, eps, weight, bias, activation) -> (y, residual): a layer's
    # pre-norm fused into the GEMM it feeds (norm_linear.py), which the models call for the steps of
    # up to gemm.NORM_LINEAR_MAX_TOKENS tokens. Only the Triton set has one (None elsewhere): the CPU
    # sets' GEMM is cpu_gemm's, and their norms and GEMMs stay separate calls so that their tokens
    # stay transformers' bit for bit.
    norm_linear: Callable | None = None


def _float32_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.float32 and t.is_cpu) for t in tensors)


def _bfloat16_cpu(*tensors: torch.Tensor | None) -> bool:
    return all(t is None or (t.dtype == torch.bfloat16 and t.is_cpu) for t in tensors)


# The C element-wise kernels: float32 and bfloat16 for both families (rounded where torch's bfloat16
# ops round; GPT-2's bfloat16 LayerNorm within one bfloat16 ulp of torch's; a bfloat16 kernel whose
# probe finds torch's rounding at no width on this machine gives way to the reference). float16
# keeps the references. These choose per
# call, on the tensors' dtypes, with the references' signatures.
def add_rmsnorm_cpu_or_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _float32_cpu(x, residual, weight) or (
            _bfloat16_cpu(x, residual, weight) and cpu_llama_ops.add_rmsnorm_bf16_order().matches):  # fmt: skip
        return cpu_llama_ops.add_rmsnorm_cpu(x, residual, weight, eps)
    return add_rmsnorm_torch(x, residual, weight, eps)


def rotary_cpu_or_torch(
    q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    if (_float32_cpu(q, k) or _bfloat16_cpu(q, k)) and _float32_cpu(cos_sin):
        return cpu_llama_ops.rotary_cpu(q, k, positions, cos_sin)
    return rotary_torch(q, k, positions, cos_sin)


def silu_and_mul_cpu_or_torch(x: torch.Tensor) -> torch.Tensor:
    if _float32_cpu(x) or (_bfloat16_cpu(x) and cpu_llama_ops.silu_and_mul_bf16_order().matches):
        return cpu_llama_ops.silu_and_mul_cpu(x)
    return silu_and_mul_torch(x)


def add_layernorm_cpu_or_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    if _float32_cpu(x, residual, weight, bias) or (
            _bfloat16_cpu(x, residual, weight, bias) and cpu_gpt2_ops.add_layernorm_bf16_order().matches):  # fmt: skip
        return cpu_gpt2_ops.add_layernorm_cpu(x, residual, weight, bias, eps)
    return add_layernorm_torch(x, residual, weight, bias, eps)


def bias_gelu_cpu_or_torch(x: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    if _float32_cpu(x, bias) or _bfloat16_cpu(x, bias):
        return cpu_gpt2_ops.bias_gelu_cpu(x, bias)
    return bias_gelu_torch(x, bias)


# GPT-2's LayerNorm and bias-GELU have C versions too (csrc/gpt2_ops.c, issue #19): at batch 1 each
# reference is 2 dispatch-bound aten ops, 37 calls per GPT-2-small step.
_write_kv_attention_torch = functools.partial(write_kv_and_attend, write_kv_torch, attention_torch)
_write_kv_attention_cpu = functools.partial(write_kv_and_attend, write_kv_cpu, attention_cpu)
TORCH_OPS = KernelOps(
    "torch", add_layernorm_torch, bias_gelu_torch, attention_torch, write_kv_torch,
    add_rmsnorm_torch, silu_and_mul_torch, rotary_torch, _write_kv_attention_torch,
    functools.partial(rotate_and_attend, rotary_torch, _write_kv_attention_torch),
    functools.partial(moe_torch, silu_and_mul=silu_and_mul_torch), gelu_and_mul_torch, lora_torch,
)  # fmt: skip
CPU_OPS = KernelOps(
    "cpu", add_layernorm_cpu_or_torch, bias_gelu_cpu_or_torch, attention_cpu, write_kv_cpu,
    add_rmsnorm_cpu_or_torch, silu_and_mul_cpu_or_torch, rotary_cpu_or_torch, _write_kv_attention_cpu,
    functools.partial(rotate_and_attend, rotary_cpu_or_torch, _write_kv_attention_cpu),
    functools.partial(moe_torch, silu_and_mul=silu_and_mul_cpu_or_torch, linear=expert_linear_cpu), gelu_and_mul_torch,
    lora_torch,
)  # fmt: skip

_logged: set[tuple[str, str]] = set()


def _interpret_requested() -> bool:
    import triton

    knobs = getattr(triton, "knobs", None)  # triton >= 3.4; older releases read the variable directly
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


def _check_import_mode(interpret: bool) -> None:
    """triton.language decorates its own helpers (tl.sum, tl.max, ...) with @triton.jit when triton
    is first imported, so TRITON_INTERPRET cannot change afterwards: kernels would fail obscurely."""
    import triton.language as tl
    from triton.runtime.jit import JITFunction

    imported_interpreted = not isinstance(tl.sum, JITFunction)
    if interpret != imported_interpreted:
        raise RuntimeError(
            f"TRITON_INTERPRET is {'on' if interpret else 'off'} but was "
            f"{'on' if imported_interpreted else 'off'} when triton was first imported; set it before "
            "the process imports triton"
        )


def _triton_ops(device: torch.device) -> KernelOps:
    try:
        import triton  # noqa: F401
    except ImportError as e:
        raise RuntimeError(f"{KERNEL_ENV}=triton needs the `triton` package, which is not installed") from e
    interpret = _interpret_requested()
    if device.type != "cuda" and not interpret:
        raise RuntimeError(
            f"Triton kernels cannot run on {device.type} tensors: use a CUDA device, set "
            f"TRITON_INTERPRET=1 (slow, for tests), or choose {KERNEL_ENV}=torch or auto"
        )
    _check_import_mode(interpret)
    # Imported here so that torch-only runs never import triton.
    from . import (
        triton_attention,
        triton_gelu,
        triton_int_quant,
        triton_layernorm,
        triton_lora,
        triton_moe,
        triton_norm_linear,
        triton_rmsnorm,
        triton_rotary,
        triton_silu,
    )

    # triton_int_quant before triton_moe: the grouped GEMM calls its dequantizing tile.
    modules = (triton_attention, triton_gelu, triton_int_quant, triton_layernorm, triton_lora, triton_moe,
               triton_norm_linear, triton_rmsnorm, triton_rotary, triton_silu)  # fmt: skip
    for module in modules:
        # @triton.jit fixes compiled-vs-interpreted when our kernel modules are imported, which may
        # have happened with TRITON_INTERPRET set differently (tests toggle it).
        if interpret != module.INTERPRETED:
            importlib.reload(module)
    return KernelOps(
        "triton",
        triton_layernorm.add_layernorm_triton,
        triton_gelu.bias_gelu_triton,
        triton_attention.attention_triton,
        triton_attention.write_kv_triton,
        triton_rmsnorm.add_rmsnorm_triton,
        triton_silu.silu_and_mul_triton,
        triton_rotary.rotary_triton,
        triton_attention.write_kv_attention_triton,
        triton_attention.rotary_write_kv_attention_triton,
        functools.partial(triton_moe.moe_triton, silu_and_mul=triton_silu.silu_and_mul_triton),
        triton_silu.gelu_and_mul_triton,
        triton_lora.lora_triton,
        triton_norm_linear.norm_linear_triton,
    )


def _cpu_ops(device: torch.device, forced: bool) -> KernelOps:
    if device.type != "cpu":
        raise RuntimeError(f"{KERNEL_ENV}=cpu runs on CPU tensors only, not {device.type}")
    # All or nothing: CPU_OPS is one bundle, and a machine that cannot build one kernel (no
    # compiler, usually) builds none of them.
    for kernel, load in (
        ("decode-attention", load_decode_kernel),
        ("K/V write", load_write_kv_kernel),
        ("Llama element-wise", cpu_llama_ops.load_llama_kernels),
        ("GPT-2 element-wise", cpu_gpt2_ops.load_gpt2_kernels),
    ):
        try:
            load()
        except (native.NativeBuildError, OSError) as e:
            if forced:
                raise RuntimeError(f"{KERNEL_ENV}=cpu: {e}") from e
            logger.warning("orca kernels: the C %s kernel is unavailable (%s); using the slower torch "
                           "references on CPU", kernel, e)  # fmt: skip
            return TORCH_OPS
    # A C kernel that reproduces torch's rounding but agrees with torch at no vector width on this
    # machine (probed at load, logged there) gives way to its torch reference: the op is slower, the
    # tokens stay transformers'.
    replaced = {
        op: reference
        for op, order, reference in (
            ("add_rmsnorm", cpu_llama_ops.add_rmsnorm_order(), add_rmsnorm_torch),
            ("silu_and_mul", cpu_llama_ops.silu_and_mul_order(), silu_and_mul_torch),
            ("add_layernorm", cpu_gpt2_ops.add_layernorm_order(), add_layernorm_torch),
        )
        if not order.matches
    }
    if replaced and forced:
        raise RuntimeError(f"{KERNEL_ENV}=cpu: the C kernels for {sorted(replaced)} do not reproduce torch's "
                           "rounding on this machine (see the log)")  # fmt: skip
    return dataclasses.replace(CPU_OPS, **replaced) if replaced else CPU_OPS


def get_ops(device: torch.device | str, choice: str | None = None) -> KernelOps:
    """choice: "auto" | "triton" | "cpu" | "torch"; defaults to $ORCA_KERNELS, else "auto"."""
    device = torch.device(device)
    choice = (choice or os.environ.get(KERNEL_ENV) or "auto").lower()
    if choice not in ("auto", "triton", "cpu", "torch"):
        raise ValueError(f"{KERNEL_ENV} must be auto, triton, cpu or torch, got {choice!r}")
    if choice == "torch":
        ops = TORCH_OPS
    elif choice == "triton" or (choice == "auto" and device.type == "cuda"):
        ops = _triton_ops(device)
    else:
        ops = _cpu_ops(device, forced=choice == "cpu")
    if (device.type, ops.name) not in _logged:
        _logged.add((device.type, ops.name))
        logger.info("orca kernels: using %s implementations on %s", ops.name, device.type)
    return ops
