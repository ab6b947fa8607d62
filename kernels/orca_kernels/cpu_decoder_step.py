"""The layers of a Llama-style decoder stage as one C call per decode step on CPU
(csrc/decoder_step.c), float32 and bfloat16.

At a few tokens the per-op path (the model calling each kernel's Python wrapper: add_rmsnorm_cpu,
linear_cpu, rotary_cpu, write_kv_cpu, attention_cpu, silu_and_mul_cpu) spends ~150 us of Python a
layer around its C calls, about a fifth of a batch-1 step of a 150M-parameter model. `DecoderStep`
runs the same C kernels in the same order, with the same arguments, from one loop in C: the outputs
(and the K/V written) are the per-op path's bit for bit, which the tests hold it to.

It covers the layers the per-op path runs with the CPU kernel set's C kernels and nothing else:
dense SwiGLU MLPs, no q/k norm or sandwich norms, K/V pools of the model's dtype, and linear layers
the C GEMM multiplies at the step's size; a step of more than `max_tokens` tokens or with a request
of more than SHORT_QUERIES queries (a prompt) takes the per-op path. The model decides where it
applies (orca_backend/model/decoder.py); this module checks what the C code would otherwise trust.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orca_kernels import cpu_gemm, cpu_llama_ops, native
from orca_kernels.attention import AttentionMetadata
from orca_kernels.cpu_attention import SHORT_QUERIES
from orca_kernels.cpu_gemm import CLinear

LIBRARY = "decoder_step"
LINEAR_PANELS, LINEAR_ROWS = 1, 2  # decoder_step.c's step_linear.kind


class _Linear(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("weight", ctypes.c_void_p), ("out_features", ctypes.c_int64),
                ("in_features", ctypes.c_int64), ("padded_in", ctypes.c_int64), ("bias", ctypes.c_void_p)]  # fmt: skip


class _Layer(ctypes.Structure):
    _fields_ = [("input_norm", ctypes.c_void_p), ("mlp_norm", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear),
                ("gate_up", _Linear), ("down", _Linear), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p),
                ("cos_sin", ctypes.c_void_p), ("cos_sin_stride", ctypes.c_int64), ("max_positions", ctypes.c_int64),
                ("window", ctypes.c_int64), ("group", ctypes.c_int64)]  # fmt: skip


class _Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_layers", "hidden", "q_heads", "kv_heads", "head_dim",
                                                    "intermediate")]  # fmt: skip
    _fields_ += [(name, ctypes.c_double) for name in ("eps", "scale", "softcap")]
    _fields_ += [(name, ctypes.c_int64) for name in ("norm_lanes", "silu_lanes", "isa", "max_short")]
    _fields_ += [("layers", ctypes.POINTER(_Layer))]


class _Batch(ctypes.Structure):
    _fields_ = [("query_start", ctypes.c_void_p), ("context_lens", ctypes.c_void_p), ("block_tables", ctypes.c_void_p),
                ("slot_mapping", ctypes.c_void_p), ("block_table_stride", ctypes.c_int64),
                ("block_size", ctypes.c_int64), ("num_requests", ctypes.c_int64),
                ("max_context", ctypes.c_int64)]  # fmt: skip


SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def _kernels() -> dict[str, ctypes._CFuncPtr]:
    model, p, i64 = ctypes.POINTER(_Model), native.PTR, native.I64
    kernels = {
        "work": native.declare(LIBRARY, "orca_decoder_step_work", [model, i64], i64),
        "scratch": native.declare(LIBRARY, "orca_decoder_step_scratch", [model, i64, i64, ctypes.c_int], i64),
    }
    for suffix in SUFFIX.values():
        # model, batches, tokens, positions, x_in, x, residual, work, scratch, num_threads
        kernels[suffix] = native.declare(LIBRARY, f"orca_decoder_step_{suffix}",
                                         [model, ctypes.POINTER(_Batch), i64, p, p, p, p, p, p, ctypes.c_int], i64)  # fmt: skip
    return kernels


def unsupported(dtype: torch.dtype) -> str | None:
    """Why the C step cannot run a model of this dtype here (None: it can): the per-op path would
    not run the C kernels for it either, or they cannot be built."""
    if dtype not in SUFFIX:
        return f"the C kernels take float32 or bfloat16, not {dtype}"
    # the per-op path keeps torch's op where a bfloat16 kernel's order is not torch's
    bf16_orders = (cpu_llama_ops.add_rmsnorm_bf16_order, cpu_llama_ops.silu_and_mul_bf16_order)
    if dtype == torch.bfloat16 and not all(order().matches for order in bf16_orders):
        return "the bfloat16 RMSNorm or SiLU kernel does not reproduce torch's rounding on this machine"
    try:
        _kernels()
    except (native.NativeBuildError, OSError) as e:
        return f"its C library could not be built: {e}"
    return None


@dataclass(frozen=True)
class StepLayer:
    """One layer's weights as the C step reads them (norm weights of the model's dtype, contiguous)."""

    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    qkv: CLinear
    qkv_bias: torch.Tensor | None
    o: CLinear
    o_bias: torch.Tensor | None
    gate_up: CLinear
    down: CLinear
    cos_sin: torch.Tensor  # float32 [positions, head_dim], unit column stride
    window: int  # 0: none
    group: int  # the K/V group whose AttentionMetadata it attends with


def _linear(spec: CLinear, bias: torch.Tensor | None) -> _Linear:
    kind = LINEAR_PANELS if spec.padded_in else LINEAR_ROWS
    return _Linear(kind, spec.address, spec.out_features, spec.in_features, spec.padded_in,
                   bias.data_ptr() if bias is not None else None)  # fmt: skip


class DecoderStep:
    """A stage's layers for the decode steps of up to `max_tokens` tokens, one C call each."""

    def __init__(
        self, layers: Sequence[StepLayer], *, dtype: torch.dtype, hidden: int, q_heads: int, kv_heads: int,
        head_dim: int, intermediate: int, eps: float, scale: float, softcap: float,
    ) -> None:  # fmt: skip
        reason = unsupported(dtype)
        if reason:
            raise ValueError(f"DecoderStep: {reason}")
        qkv_out, i = (q_heads + 2 * kv_heads) * head_dim, intermediate
        for n, layer in enumerate(layers):
            shapes = {"qkv": ((layer.qkv.out_features, layer.qkv.in_features), (qkv_out, hidden)),
                      "o": ((layer.o.out_features, layer.o.in_features), (hidden, q_heads * head_dim)),
                      "gate_up": ((layer.gate_up.out_features, layer.gate_up.in_features), (2 * i, hidden)),
                      "down": ((layer.down.out_features, layer.down.in_features), (hidden, i))}  # fmt: skip
            for name, (got, wanted) in shapes.items():
                if got != wanted:
                    raise ValueError(f"DecoderStep: layer {n}'s {name} weight is {got}, not {wanted}")
            vectors = [layer.input_norm, layer.mlp_norm, layer.qkv_bias, layer.o_bias]
            if any(t is not None and (t.dtype != dtype or not t.is_contiguous() or not t.is_cpu) for t in vectors):
                raise ValueError(f"DecoderStep: layer {n}'s norm weights and biases must be contiguous {dtype} CPU tensors")
            if layer.cos_sin.dtype != torch.float32 or layer.cos_sin.stride(1) != 1 or layer.cos_sin.shape[1] != head_dim:
                raise ValueError(f"DecoderStep: layer {n}'s rope table must be float32 [positions, {head_dim}] rows")
        self.dtype, self.hidden, self.kv_heads, self.head_dim = dtype, hidden, kv_heads, head_dim
        self.layers = list(layers)  # keeps every tensor the C structures point into alive
        self.max_tokens = min(s.max_tokens for x in layers for s in (x.qkv, x.o, x.gate_up, x.down))
        self.num_groups = max(x.group for x in layers) + 1
        self._layers = (_Layer * len(layers))(*(
            _Layer(x.input_norm.data_ptr(), x.mlp_norm.data_ptr(), _linear(x.qkv, x.qkv_bias), _linear(x.o, x.o_bias),
                   _linear(x.gate_up, None), _linear(x.down, None), None, None, x.cos_sin.data_ptr(),
                   x.cos_sin.stride(0), x.cos_sin.shape[0], x.window, x.group)
            for x in layers
        ))  # fmt: skip
        isa = cpu_gemm.cpu_isa()
        norm_lanes = (cpu_llama_ops.add_rmsnorm_bf16_order() if dtype == torch.bfloat16 else cpu_llama_ops.add_rmsnorm_order()).lanes
        silu_lanes = (cpu_llama_ops.silu_and_mul_bf16_order() if dtype == torch.bfloat16 else cpu_llama_ops.silu_and_mul_order()).lanes
        self._model = _Model(len(layers), hidden, q_heads, kv_heads, head_dim, intermediate, eps, scale, softcap,
                             norm_lanes, silu_lanes, cpu_gemm.ISAS[isa], SHORT_QUERIES, self._layers)  # fmt: skip
        self._pools: tuple[int, ...] = ()

    def runs(self, tokens: int, metas: Sequence[AttentionMetadata]) -> bool:
        """Whether a step of this many tokens and these batch layouts is one the C step runs."""
        return tokens <= self.max_tokens and all(m.max_query_len <= SHORT_QUERIES for m in metas)

    def _bind_pools(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Points the layers at their K/V pools (checked once per set of pools)."""
        pools = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if pools == self._pools:
            return
        if len(kv_caches) != len(self.layers):
            raise ValueError(f"DecoderStep: {len(kv_caches)} K/V pools for {len(self.layers)} layers")
        for layer, (k, v) in zip(self._layers, kv_caches, strict=True):
            if k.dtype != self.dtype or v.dtype != self.dtype or k.shape != v.shape or k.shape[1:] != (self.kv_heads, self.head_dim) \
                    or not (k.is_contiguous() and v.is_contiguous()):  # fmt: skip
                raise ValueError(f"DecoderStep needs contiguous {self.dtype} K/V pools [slots, {self.kv_heads}, "
                                 f"{self.head_dim}], got {tuple(k.shape)} {k.dtype}")  # fmt: skip
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self._pools = pools

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, metas: Sequence[AttentionMetadata],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(x, residual) after the layers, as the per-op loop leaves them, for the embedding's output
        x [tokens, hidden] (not modified), each token's position and each K/V group's metadata
        (`runs` must hold); this step's K/V is written to the pools."""
        tokens = x.shape[0]
        if x.dtype != self.dtype or x.shape != (tokens, self.hidden):
            raise ValueError(f"DecoderStep takes x [tokens, {self.hidden}] of {self.dtype}, got {tuple(x.shape)} {x.dtype}")
        if len(metas) < self.num_groups or not self.runs(tokens, metas):
            raise ValueError("DecoderStep: a step it does not run (see `runs`) or too few K/V groups' metadata")
        self._bind_pools(kv_caches)
        x = x.contiguous()
        positions = positions.to(torch.int64).contiguous()
        batches = (_Batch * len(metas))()
        for batch, meta in zip(batches, metas, strict=True):
            tables = meta.block_tables
            if any(t.dtype != torch.int32 or not t.is_contiguous() for t in (meta.query_start, meta.context_lens, tables)) \
                    or meta.slot_mapping.dtype != torch.int64 or not meta.slot_mapping.is_contiguous() \
                    or meta.slot_mapping.numel() != tokens or tables.dim() != 2 or meta.block_size < 1 \
                    or tables.shape[0] < meta.num_requests or tables.shape[1] * meta.block_size < meta.max_context_len:  # fmt: skip
                raise ValueError("DecoderStep needs contiguous int32 query_start, context_lens and block tables "
                                 "[requests, >= ceil(max_context_len / block_size)] and an int64 slot per token")  # fmt: skip
            batch.query_start, batch.context_lens = meta.query_start.data_ptr(), meta.context_lens.data_ptr()
            batch.block_tables, batch.slot_mapping = tables.data_ptr(), meta.slot_mapping.data_ptr()
            batch.block_table_stride, batch.block_size = tables.stride(0), meta.block_size
            batch.num_requests, batch.max_context = meta.num_requests, meta.max_context_len
        kernels, threads = _kernels(), torch.get_num_threads()
        max_context = max(m.max_context_len for m in metas)
        work = torch.empty(kernels["work"](self._model, tokens), dtype=self.dtype)
        scratch = torch.empty(kernels["scratch"](self._model, max_context, self.dtype == torch.bfloat16, threads),
                              dtype=torch.float32)  # fmt: skip
        out, residual = torch.empty_like(x), torch.empty_like(x)
        bad = kernels[SUFFIX[self.dtype]](self._model, batches, tokens, positions.data_ptr(), x.data_ptr(),
                                          out.data_ptr(), residual.data_ptr(), work.data_ptr(), scratch.data_ptr(),
                                          threads)  # fmt: skip
        if bad >= 0:
            raise IndexError(f"rotary position {int(positions[bad])} of token {bad} is outside the cos/sin "
                             f"table of {self.layers[0].cos_sin.shape[0]} positions")  # fmt: skip
        return out, residual
