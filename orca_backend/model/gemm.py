"""The matrix multiply of every linear layer (weights `[out, in]`, torch.nn.Linear's layout).

On CPU in float32 and bfloat16 kernels/orca_kernels/cpu_gemm.py picks the weights' layout (plain, or
oneDNN's blocked one on AVX-512 machines) and the multiply by the number of tokens (a C kernel for
decodes, oneDNN, MKL; `ORCA_CPU_GEMM` overrides it). CUDA and float16 use F.linear; FP8 and integer
weights on CUDA a Triton dequantizing GEMM each; integer weights on CPU the C kernel of
kernels/orca_kernels/cpu_int_gemm.py; W8A8 weights kernels/orca_kernels/w8a8.py (activations
quantized per token, int8 sums by torch._int_mm, FP8 by torch._scaled_mm on CUDA).

On the Triton kernel set, steps of up to `NORM_LINEAR_MAX_TOKENS[norm]` tokens run each layer's pre-norm
inside the GEMM it feeds (`ops.norm_linear`, kernels/orca_kernels/triton_norm_linear.py): the q/k/v
and MLP-input GEMMs are Triton's there, and the o/down projections leave their bias to the next
norm. The caps are measured, per norm (below).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextvars import ContextVar

import torch

from orca_backend.model.fp8 import Fp8Weight
from orca_backend.model.int_quant import IntWeight
from orca_backend.model.w8a8 import W8A8Weight
from orca_kernels import KernelOps
from orca_kernels.cpu_gemm import PackedWeight, linear_cpu, pack_weight
from orca_kernels.cpu_int_gemm import CpuIntWeight, int_linear_cpu
from orca_kernels.w8a8 import w8a8_linear

# Up to how many tokens a step runs its pre-norms inside the GEMMs they feed (`ops.norm_linear`), by the
# norm. Measured on an H200 (docs/bench/gpu/smoke-2026-11-30): the fused kernel takes about twice
# cuBLAS's time for the GEMM alone, so it pays only where the launches it saves outweigh that.
# RMSNorm (the Llama family): a batch-1 Qwen2.5-0.5B step replays in 1.032 ms fused, 1.085 ms not;
# beyond 16 tokens the unfused path wins (GPT-2-medium at 256 running: 1.93 ms a step against 3.38).
# LayerNorm (GPT-2: two passes over x and the carried bias in every K step) loses at every size: a
# batch-1 GPT-2-medium step is 0.963 ms unfused, 1.116 ms fused.
NORM_LINEAR_MAX_TOKENS = {"rmsnorm": 16, "layernorm": 0}


def can_fuse_norms(ops: KernelOps, weights: list[object]) -> bool:
    """Whether a model may run its pre-norms inside their GEMMs (`ops.norm_linear`): the kernel set
    has the fused op and every weight it would multiply is a plain tensor (an FP8 or integer weight
    takes its own dequantizing GEMM). A step then does for up to NORM_LINEAR_MAX_TOKENS[norm] tokens, without LoRA
    (whose adapters read the norm's output)."""
    return ops.norm_linear is not None and not any(isinstance(w, QUANTIZED) for w in weights)


QUANTIZED = (Fp8Weight, IntWeight, CpuIntWeight, W8A8Weight)  # weights each multiplied by a kernel of their own
Weight = torch.Tensor | PackedWeight | Fp8Weight | IntWeight | CpuIntWeight | W8A8Weight  # what `pack` returns

# Whether `pack` may reorder weights for oneDNN: set around a model's load by `packing_for` its kernel
# set. Only the CPU sets multiply every weight through `linear`; the Triton set's fused norm + GEMM
# (and a GPU) read plain weights.
_PACKS_FOR_ONEDNN: ContextVar[bool] = ContextVar("packs_for_onednn", default=False)


@contextlib.contextmanager
def packing_for(ops: KernelOps) -> Iterator[None]:
    """Weights `pack`ed inside this block are for a model running `ops`."""
    token = _PACKS_FOR_ONEDNN.set(ops.name in ("cpu", "torch"))
    try:
        yield
    finally:
        _PACKS_FOR_ONEDNN.reset(token)


def pack(weight: torch.Tensor | Fp8Weight | IntWeight | CpuIntWeight | W8A8Weight) -> Weight:
    """The weight as `linear` wants it: contiguous (a tensor-parallel shard may be a strided view), and
    for the CPU kernel sets on AVX-512 CPUs reordered for oneDNN (cpu_gemm.pack_weight, inside
    `packing_for`)."""
    if isinstance(weight, QUANTIZED):
        return weight
    return pack_weight(weight) if _PACKS_FOR_ONEDNN.get() else weight.contiguous()


def pack_lm_head(lm_head: torch.Tensor, embed: torch.Tensor | None,
                 first_stage: bool) -> tuple[Weight, torch.Tensor | None]:
    """(LM head, embedding) of the last stage: the head `pack`ed as the layers are (CPU: 1.2-2.0x
    faster at 8-64 sampled rows, docs/cpu-gemm.md), a tied one too, as vLLM's CPU backend does. A
    tied head's embedding then stays only where the lookup reads it, the first stage: there the
    vocabulary table is held twice (GPT-2 small in bfloat16: 77 MB more)."""
    packed = pack(lm_head)
    if lm_head is embed and packed is not embed and not first_stage:
        embed = None
    return packed, embed


def linear(
    x: torch.Tensor, weight: Weight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, weight, bias) for 2-D x and a `pack`ed weight: an FP8 or integer weight on CUDA
    through its Triton dequantizing GEMM (FP8 is dequantized at load elsewhere), an integer weight on
    CPU through the C kernel."""
    if isinstance(weight, Fp8Weight):
        from orca_kernels.triton_fp8 import fp8_linear_triton  # triton is imported where FP8 runs only

        return fp8_linear_triton(x, weight.weight, weight.scale, weight.block, bias)
    if isinstance(weight, CpuIntWeight):
        return int_linear_cpu(x, weight, bias)
    if isinstance(weight, W8A8Weight):
        return w8a8_linear(x, weight.weight, weight.scale, weight.act, bias)
    if isinstance(weight, IntWeight):
        from orca_kernels.triton_int_quant import int_linear_triton

        return int_linear_triton(x, weight.packed, weight.scales, weight.zeros, weight.bits, weight.group,
                                 weight.g_idx, bias)  # fmt: skip
    return linear_cpu(x, weight, bias)


def linear_bias_gelu(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, bias_gelu: Callable) -> torch.Tensor:
    """bias_gelu(linear(x, weight), bias): GPT-2's MLP input. On CUDA it is one cuBLASLt GEMM whose
    epilogue adds the bias and applies GELU in its tanh form, GPT-2's `gelu_new` (torch's
    _addmm_activation; one launch per layer instead of two); elsewhere the GEMM, then `bias_gelu`
    (the kernel set's, which on CPU reproduces torch's rounding)."""
    if x.is_cuda:
        return torch._addmm_activation(bias, x, weight.t(), use_gelu=True)
    return bias_gelu(linear(x, weight), bias)

