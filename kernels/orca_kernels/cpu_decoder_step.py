"""The layers of a model as one C call per decode step on CPU (csrc/decoder_step.c), float32 and
bfloat16: the Llama-style decoder's (`DecoderStep`) and GPT-2's (`Gpt2Step`).

At a few tokens the per-op path (the model calling each kernel's Python wrapper: add_rmsnorm_cpu,
linear_cpu, rotary_cpu, write_kv_cpu, attention_cpu, silu_and_mul_cpu) spends ~150 us of Python a
layer around its C calls, about a fifth of a batch-1 step of a 150M-parameter model. `DecoderStep`
runs the same C kernels in the same order, with the same arguments, from one loop in C: the outputs
(and the K/V written) are the per-op path's bit for bit, which the tests hold it to.

It covers the layers the per-op path runs with the CPU kernel set's C kernels and nothing else:
for the Llama style dense SwiGLU MLPs, no q/k norm or sandwich norms; K/V pools of the model's
dtype, and linear layers the C GEMM multiplies at the step's size; a step of more than `max_tokens`
tokens or with a request of more than SHORT_QUERIES queries (a prompt) takes the per-op path. The
models decide where it applies (orca_backend/model/decoder.py, gpt2.py); this module checks what
the C code would otherwise trust.
"""

from __future__ import annotations

import ctypes
import functools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orca_kernels import cpu_attention, cpu_gemm, cpu_gpt2_ops, cpu_llama_ops, native
from orca_kernels.attention import AttentionMetadata
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


class _Gpt2Layer(ctypes.Structure):
    _fields_ = [("ln1_w", ctypes.c_void_p), ("ln1_b", ctypes.c_void_p), ("ln2_w", ctypes.c_void_p),
                ("ln2_b", ctypes.c_void_p), ("qkv", _Linear), ("o", _Linear), ("fc", _Linear), ("proj", _Linear),
                ("fc_bias", ctypes.c_void_p), ("k_cache", ctypes.c_void_p), ("v_cache", ctypes.c_void_p)]  # fmt: skip


class _Gpt2Model(ctypes.Structure):
    _fields_ = [(name, ctypes.c_int64) for name in ("num_layers", "hidden", "heads", "head_dim", "inner")]
    _fields_ += [(name, ctypes.c_double) for name in ("eps", "scale")]
    _fields_ += [(name, ctypes.c_int64) for name in ("norm_lanes", "isa", "max_short")]
    _fields_ += [("layers", ctypes.POINTER(_Gpt2Layer))]


SUFFIX = {torch.float32: "f32", torch.bfloat16: "bf16"}


@functools.cache
def _kernels() -> dict[str, ctypes._CFuncPtr]:
    model, p, i64 = ctypes.POINTER(_Model), native.PTR, native.I64
    kernels = {
        "work": native.declare(LIBRARY, "orca_decoder_step_work", [model, i64], i64),
        "scratch": native.declare(LIBRARY, "orca_decoder_step_scratch", [model, i64, i64, ctypes.c_int], i64),
    }
    gpt2, batches = ctypes.POINTER(_Gpt2Model), ctypes.POINTER(_Batch)
    kernels["gpt2_work"] = native.declare(LIBRARY, "orca_gpt2_step_work", [gpt2, i64], i64)
    kernels["gpt2_scratch"] = native.declare(LIBRARY, "orca_gpt2_step_scratch", [gpt2, i64, i64, ctypes.c_int], i64)
    for suffix in SUFFIX.values():
        # model, batches, tokens, positions, x_in, x, residual, work, scratch, num_threads
        kernels[suffix] = native.declare(LIBRARY, f"orca_decoder_step_{suffix}",
                                         [model, batches, i64, p, p, p, p, p, p, ctypes.c_int], i64)  # fmt: skip
        # GPT-2: no positions
        kernels[f"gpt2_{suffix}"] = native.declare(LIBRARY, f"orca_gpt2_step_{suffix}",
                                                   [gpt2, batches, i64, p, p, p, p, p, ctypes.c_int], i64)  # fmt: skip
    return kernels


# The bfloat16 kernels whose probes must hold for each family's per-op path to run them (it keeps
# torch's op where one does not).
_BF16_ORDERS = {
    "llama": (cpu_llama_ops.add_rmsnorm_bf16_order, cpu_llama_ops.silu_and_mul_bf16_order),
    "gpt2": (cpu_gpt2_ops.add_layernorm_bf16_order,),
}


def unsupported(dtype: torch.dtype, family: str = "llama") -> str | None:
    """Why the C step cannot run a model of this family ("llama" or "gpt2") and dtype here (None: it
    can): the per-op path would not run the C kernels for it either, or they cannot be built."""
    if dtype not in SUFFIX:
        return f"the C kernels take float32 or bfloat16, not {dtype}"
    if dtype == torch.bfloat16 and not all(order().matches for order in _BF16_ORDERS[family]):
        return "a bfloat16 norm or activation kernel does not reproduce torch's rounding on this machine"
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


class _Step:
    """What both steps share: which steps they run, the K/V pools they write and the batch layouts."""

    dtype: torch.dtype
    hidden: int
    kv_heads: int
    head_dim: int
    max_tokens: int
    _layers: ctypes.Array
    _model: _Model | _Gpt2Model

    def runs(self, tokens: int, metas: Sequence[AttentionMetadata]) -> bool:
        """Whether a step of this many tokens and these batch layouts is one the C step runs: every
        request is one the decode attention kernel attends (cpu_attention.SHORT_QUERIES, read as
        attention_cpu reads it)."""
        return tokens <= self.max_tokens and all(m.max_query_len <= cpu_attention.SHORT_QUERIES for m in metas)

    def _bind_pools(self, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> None:
        """Points the layers at their K/V pools (checked once per set of pools)."""
        pools = tuple(t.data_ptr() for pair in kv_caches for t in pair)
        if pools == getattr(self, "_pools", None):
            return
        if len(kv_caches) != len(self._layers):
            raise ValueError(f"{type(self).__name__}: {len(kv_caches)} K/V pools for {len(self._layers)} layers")
        for layer, (k, v) in zip(self._layers, kv_caches, strict=True):
            if k.dtype != self.dtype or v.dtype != self.dtype or k.shape != v.shape or k.shape[1:] != (self.kv_heads, self.head_dim) \
                    or not (k.is_contiguous() and v.is_contiguous()):  # fmt: skip
                raise ValueError(f"{type(self).__name__} needs contiguous {self.dtype} K/V pools [slots, {self.kv_heads}, "
                                 f"{self.head_dim}], got {tuple(k.shape)} {k.dtype}")  # fmt: skip
            layer.k_cache, layer.v_cache = k.data_ptr(), v.data_ptr()
        self._pools = pools

    def _prepare(self, x: torch.Tensor, metas: Sequence[AttentionMetadata],
                 kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> ctypes.Array:  # fmt: skip
        """Checks a step's input (made contiguous by the caller) and layouts as the per-op wrappers
        would, binds the pools; the layouts as the C step reads them."""
        tokens = x.shape[0]
        if x.dtype != self.dtype or x.shape != (tokens, self.hidden):
            raise ValueError(f"{type(self).__name__} takes x [tokens, {self.hidden}] of {self.dtype}, got "
                             f"{tuple(x.shape)} {x.dtype}")  # fmt: skip
        if not self.runs(tokens, metas):
            raise ValueError(f"{type(self).__name__}: a step it does not run (see `runs`)")
        self._bind_pools(kv_caches)
        self._model.max_short = cpu_attention.SHORT_QUERIES
        batches = (_Batch * len(metas))()
        for batch, meta in zip(batches, metas, strict=True):
            cpu_attention.check_layout(type(self).__name__, meta)
            cpu_attention.check_slots(type(self).__name__, meta.slot_mapping, tokens)
            tables = meta.block_tables
            batch.query_start, batch.context_lens = meta.query_start.data_ptr(), meta.context_lens.data_ptr()
            batch.block_tables, batch.slot_mapping = tables.data_ptr(), meta.slot_mapping.data_ptr()
            batch.block_table_stride, batch.block_size = tables.stride(0), meta.block_size
            batch.num_requests, batch.max_context = meta.num_requests, meta.max_context_len
        return batches


def _check_shapes(n: int, shapes: dict[str, tuple[CLinear, tuple[int, int]]]) -> None:
    for name, (spec, wanted) in shapes.items():
        if (spec.out_features, spec.in_features) != wanted:
            raise ValueError(f"layer {n}'s {name} weight is {(spec.out_features, spec.in_features)}, not {wanted}")


def _check_vectors(n: int, dtype: torch.dtype, *vectors: torch.Tensor | None) -> None:
    if any(t is not None and (t.dtype != dtype or not t.is_contiguous() or not t.is_cpu) for t in vectors):
        raise ValueError(f"layer {n}'s norm weights and biases must be contiguous {dtype} CPU tensors")


class DecoderStep(_Step):
    """A Llama-style stage's layers for the decode steps of up to `max_tokens` tokens, one C call each."""

    def __init__(
        self, layers: Sequence[StepLayer], *, dtype: torch.dtype, hidden: int, q_heads: int, kv_heads: int,
        head_dim: int, intermediate: int, eps: float, scale: float, softcap: float,
    ) -> None:  # fmt: skip
        reason = unsupported(dtype)
        if reason:
            raise ValueError(f"DecoderStep: {reason}")
        qkv_out, i = (q_heads + 2 * kv_heads) * head_dim, intermediate
        for n, x in enumerate(layers):
            _check_shapes(n, {"qkv": (x.qkv, (qkv_out, hidden)), "o": (x.o, (hidden, q_heads * head_dim)),
                              "gate_up": (x.gate_up, (2 * i, hidden)), "down": (x.down, (hidden, i))})  # fmt: skip
            _check_vectors(n, dtype, x.input_norm, x.mlp_norm, x.qkv_bias, x.o_bias)
            if x.cos_sin.dtype != torch.float32 or x.cos_sin.stride(1) != 1 or x.cos_sin.shape[1] != head_dim:
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
        bf16 = dtype == torch.bfloat16
        norm_lanes = (cpu_llama_ops.add_rmsnorm_bf16_order() if bf16 else cpu_llama_ops.add_rmsnorm_order()).lanes
        silu_lanes = (cpu_llama_ops.silu_and_mul_bf16_order() if bf16 else cpu_llama_ops.silu_and_mul_order()).lanes
        self._model = _Model(len(layers), hidden, q_heads, kv_heads, head_dim, intermediate, eps, scale, softcap,
                             norm_lanes, silu_lanes, cpu_gemm.ISAS[cpu_gemm.cpu_isa()], cpu_attention.SHORT_QUERIES, self._layers)  # fmt: skip

    def __call__(
        self, x: torch.Tensor, positions: torch.Tensor, metas: Sequence[AttentionMetadata],
        kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(x, residual) after the layers, as the per-op loop leaves them, for the embedding's output
        x [tokens, hidden] (not modified), each token's position and each K/V group's metadata
        (`runs` must hold); this step's K/V is written to the pools."""
        if len(metas) < self.num_groups:
            raise ValueError(f"DecoderStep: {len(metas)} K/V groups' metadata for {self.num_groups} groups")
        x = x.contiguous()
        batches = self._prepare(x, metas, kv_caches)
        positions = positions.to(torch.int64).contiguous()
        kernels, threads, tokens = _kernels(), torch.get_num_threads(), x.shape[0]
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


@dataclass(frozen=True)
class Gpt2Layer:
    """One GPT-2 layer's weights as the C step reads them (the model's dtype, contiguous)."""

    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv: CLinear
    qkv_bias: torch.Tensor
    o: CLinear
    o_bias: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc: CLinear
    fc_bias: torch.Tensor  # added by the GeLU kernel, as on the per-op path
    proj: CLinear
    proj_bias: torch.Tensor


class Gpt2Step(_Step):
    """GPT-2's layers for the decode steps of up to `max_tokens` tokens, one C call each."""

    def __init__(self, layers: Sequence[Gpt2Layer], *, dtype: torch.dtype, hidden: int, heads: int, head_dim: int,
                 inner: int, eps: float, scale: float) -> None:  # fmt: skip
        reason = unsupported(dtype, "gpt2")
        if reason:
            raise ValueError(f"Gpt2Step: {reason}")
        for n, x in enumerate(layers):
            _check_shapes(n, {"qkv": (x.qkv, (3 * heads * head_dim, hidden)), "o": (x.o, (hidden, heads * head_dim)),
                              "fc": (x.fc, (inner, hidden)), "proj": (x.proj, (hidden, inner))})  # fmt: skip
            _check_vectors(n, dtype, x.ln1_w, x.ln1_b, x.ln2_w, x.ln2_b, x.qkv_bias, x.o_bias, x.fc_bias, x.proj_bias)
        self.dtype, self.hidden, self.kv_heads, self.head_dim = dtype, hidden, heads, head_dim
        self.layers = list(layers)
        self.max_tokens = min(s.max_tokens for x in layers for s in (x.qkv, x.o, x.fc, x.proj))
        self._layers = (_Gpt2Layer * len(layers))(*(
            _Gpt2Layer(x.ln1_w.data_ptr(), x.ln1_b.data_ptr(), x.ln2_w.data_ptr(), x.ln2_b.data_ptr(),
                       _linear(x.qkv, x.qkv_bias), _linear(x.o, x.o_bias), _linear(x.fc, None),
                       _linear(x.proj, x.proj_bias), x.fc_bias.data_ptr(), None, None)
            for x in layers
        ))  # fmt: skip
        norm = cpu_gpt2_ops.add_layernorm_bf16_order() if dtype == torch.bfloat16 else cpu_gpt2_ops.add_layernorm_order()
        self._model = _Gpt2Model(len(layers), hidden, heads, head_dim, inner, eps, scale, norm.lanes,
                                 cpu_gemm.ISAS[cpu_gemm.cpu_isa()], cpu_attention.SHORT_QUERIES, self._layers)  # fmt: skip

    def __call__(self, x: torch.Tensor, meta: AttentionMetadata,
                 kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """(x, residual) after the layers, as the per-op loop leaves them, for the embeddings' sum x
        [tokens, hidden] (not modified) and the step's metadata; this step's K/V is written."""
        x = x.contiguous()
        batches = self._prepare(x, [meta], kv_caches)
        kernels, threads, tokens, bf16 = _kernels(), torch.get_num_threads(), x.shape[0], self.dtype == torch.bfloat16
        work = torch.empty(kernels["gpt2_work"](self._model, tokens), dtype=self.dtype)
        scratch = torch.empty(kernels["gpt2_scratch"](self._model, meta.max_context_len, bf16, threads))
        out, residual = torch.empty_like(x), torch.empty_like(x)
        kernels[f"gpt2_{SUFFIX[self.dtype]}"](self._model, batches, tokens, x.data_ptr(), out.data_ptr(),
                                              residual.data_ptr(), work.data_ptr(), scratch.data_ptr(), threads)  # fmt: skip
        return out, residual
