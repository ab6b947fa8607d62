"""The shared decoder of the Llama-style families and Gemma, written for selective batching.

As in gpt2.py, every scheduled token of every request is one flat ``[num_tokens, hidden]`` tensor
for the embedding, RMSNorms, projections and the gated MLP; attention alone is split per request
(`AttentionMetadata`). Rotary embeddings are applied to the new tokens' q and k at their own
positions before k is written to the pool, so the pool holds rotated keys, one row per **KV
head**: attention reads each KV head once for its whole query group (grouped-query attention).

A layer is: RMSNorm, the fused q/k/v projection (bias and LoRA where there are), q/k norm per head
(Qwen3, Gemma 3), rotary + the K/V write + attention in one kernel call (the layer's window and
rope table, the family's scale and soft-cap), the o projection (row-parallel), then RMSNorm and the
MLP: a gated one (SwiGLU or GeGLU) or mixture-of-experts (`Decoder._experts`). The residual stream
is carried by the norms (`add_rmsnorm(x, residual)` returns the norm of the sum and the sum).

Everything a family does differently is config switches of `LlamaConfig` (biases, q/k norm, MoE,
windows, rope scaling, FP8: one loader and one forward serve them all) and the few hooks of
`DecoderHooks`, which a family's `DecoderWeights` subclass returns for its config: the layer's
norms and their checkpoint names, sandwich norms, (1 + w) norm weights, the embedding scale, the
MLP's activation, the attention scale and soft-cap, the final-logit soft-cap and the local layers'
rope base. The hooks are read once, when the model is built: the per-layer loop tests plain locals.

Tensor parallelism splits query heads and KV heads over the ranks (q, k, v and gate/up
column-parallel; o_proj and down_proj row-parallel, one all-reduce each) and the vocabulary for
the embedding and LM head; pipeline parallelism gives each stage its layers.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from orca_backend.config import check_parallel_layout
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.families.llama import LlamaConfig, expert_names
from orca_backend.model import gemm
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.int_quant import is_int_quantized
from orca_backend.model.linear_weights import Experts, LinearWeight, concat_rows, load_linear, stack_experts
from orca_backend.model.parallel_layers import row_parallel_linear, vocab_parallel_embed
from orca_backend.model.rope import cos_sin_table, inverse_frequencies, rope_table
from orca_backend.model.stage_input import StageInput, StageModel, stage_output
from orca_kernels import AttentionMetadata, KernelOps
from orca_kernels.cpu_decoder_step import DecoderStep, StepLayer, unsupported
from orca_kernels.cpu_gemm import c_linear

logger = logging.getLogger("orca.model")


@dataclass(frozen=True)
class DecoderHooks:
    """What a family of the shared decoder does differently from Llama, beyond LlamaConfig's switches."""

    attn_scale: float  # the scores' scale: head_dim^-0.5 (Llama), query_pre_attn_scalar^-0.5 (Gemma)
    # A layer's norms by their checkpoint names (under model.layers.N.): before attention and before
    # the MLP; the sandwich norms after attention and after the MLP, before the residual add (Gemma).
    pre_attn_norm: str = "input_layernorm"
    pre_mlp_norm: str = "post_attention_layernorm"
    post_attn_norm: str | None = None
    post_mlp_norm: str | None = None
    # Norms weigh by (norm_offset + w), folded into the stored weight at load in float32 (Gemma: 1),
    # so one RMSNorm kernel computes every family's norm (q/k norms and the final norm too).
    norm_offset: float = 0.0
    embed_scale: float = 0.0  # the embedding times this, rounded to the model's dtype (Gemma: sqrt(hidden)); 0: not scaled
    activation: str = "silu_and_mul"  # the gated MLP's KernelOps op: SwiGLU, or GeGLU's gelu_and_mul (Gemma)
    attn_softcap: float = 0.0  # cap * tanh(score / cap) inside attention (Gemma 2); 0: none
    final_softcap: float = 0.0  # the same on the float32 logits
    rope_local_theta: float = 0.0  # the windowed layers' own rope base, unscaled (Gemma 3); 0: rope_theta's table

    @property
    def norm_names(self) -> tuple[str, ...]:
        """A layer's norms in the order they run."""
        return tuple(n for n in (self.pre_attn_norm, self.post_attn_norm, self.pre_mlp_norm, self.post_mlp_norm) if n)


@dataclass
class DecoderLayerWeights:
    # Norm weights are stored as (norm_offset + w) (DecoderHooks).
    input_norm_w: torch.Tensor
    # The linear weights are FP8 or integers (with their scales) on CUDA from a quantized checkpoint
    # (model/linear_weights.py).
    qkv_w: LinearWeight  # this rank's q heads, then its KV heads of k, then of v: [(hq + 2 hkv) d, hidden]
    qkv_b: torch.Tensor | None
    q_norm_w: torch.Tensor | None  # Qwen3, Gemma 3: [head_dim]
    k_norm_w: torch.Tensor | None
    o_w: LinearWeight  # [hidden, hq d] columns of this rank's heads
    o_b: torch.Tensor | None
    pre_mlp_norm_w: torch.Tensor
    gate_up_w: LinearWeight | None  # this rank's slice of gate, then of up: [2 i, hidden]
    down_w: LinearWeight | None  # [hidden, i]
    # The sandwich norms (Gemma): after attention and after the MLP.
    post_attn_norm_w: torch.Tensor | None = None
    post_mlp_norm_w: torch.Tensor | None = None
    # Mixtral (no dense MLP then): the router [experts, hidden] in float32, and every expert's slice
    # of gate then up [experts, 2 i, hidden] and of down [experts, hidden, i]: float tensors, or
    # integer experts kept packed (`Experts`).
    router_w: torch.Tensor | None = None
    experts_w13: Experts | None = None
    experts_w2: Experts | None = None
    # Qwen2-MoE's shared expert (a dense SwiGLU of this rank's slice) and its gate [1, hidden].
    shared_gate_up_w: torch.Tensor | None = None
    shared_down_w: torch.Tensor | None = None
    shared_gate_w: torch.Tensor | None = None


@dataclass
class DecoderWeights:
    """A stage's weights. A family subclasses it to supply `hooks`; the model runs with its weights'."""

    layers: list[DecoderLayerWeights]
    embed: torch.Tensor | None  # [vocab shard, hidden], first stage (and last, when tied and left unpacked)
    lm_head: gemm.Weight | None  # [vocab shard, hidden], last stage; a tied one unpacked is the embedding itself
    norm_w: torch.Tensor | None  # last stage

    @staticmethod
    def hooks(config: Any) -> DecoderHooks:
        """The family's hooks for a config (each family's subclass says)."""
        raise NotImplementedError

    def num_bytes(self) -> int:
        """The bytes of every tensor held, each once (a tied LM head left unpacked is the embedding; experts kept one
        weight per expert count each)."""
        tensors = {id(t): t for t in (self.embed, self.lm_head, self.norm_w) if t is not None}
        for layer in self.layers:
            for value in vars(layer).values():
                tensors.update({id(t): t for t in (value if isinstance(value, list) else [value]) if t is not None})
        return sum(t.nbytes for t in tensors.values())

    @classmethod
    def load(
        cls, src: WeightSource, config: LlamaConfig, layout: ParallelLayout, dtype: torch.dtype, device: torch.device
    ) -> DecoderWeights:
        hooks = cls.hooks(config)
        d = config.head_dim
        check_parallel_layout(config, layout.tp_size, layout.pp_size)
        q_lo, q_hi = layout.shard(config.num_attention_heads)
        kv_lo, kv_hi = layout.shard(config.num_key_value_heads)
        i_lo, i_hi = layout.shard(config.intermediate_size)

        def get(name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            return src.get(name, dim, lo, hi).to(device=device, dtype=dtype).contiguous()

        def linear(layer: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> LinearWeight:
            return load_linear(src, layer, config, dim, lo, hi, dtype, device)

        def dense(layer: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            return load_linear(src, layer, config, dim, lo, hi, dtype, device, dense=True)  # type: ignore[return-value]

        def norm(name: str) -> torch.Tensor:
            if not hooks.norm_offset:
                return get(name)
            # (offset + w) in float32, as transformers computes Gemma's, then stored in the model's dtype.
            return (hooks.norm_offset + src.get(name).float()).to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in layout.layers(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_w = concat_rows([linear(a + "q_proj", 0, q_lo * d, q_hi * d),
                                 linear(a + "k_proj", 0, kv_lo * d, kv_hi * d),
                                 linear(a + "v_proj", 0, kv_lo * d, kv_hi * d)])  # fmt: skip
            qkv_b = None
            if config.qkv_bias:
                qkv_b = torch.cat([get(a + "q_proj.bias", 0, q_lo * d, q_hi * d),
                                   get(a + "k_proj.bias", 0, kv_lo * d, kv_hi * d),
                                   get(a + "v_proj.bias", 0, kv_lo * d, kv_hi * d)])  # fmt: skip
            m = p + "mlp."
            norms = {name: norm(f"{p}{name}.weight") for name in hooks.norm_names}
            moe = _load_experts(src, dense, linear, config, layout, p) if config.is_moe_layer(i) else {}
            layers.append(
                DecoderLayerWeights(
                    input_norm_w=norms[hooks.pre_attn_norm],
                    qkv_w=gemm.pack(qkv_w),
                    qkv_b=qkv_b,
                    q_norm_w=norm(a + "q_norm.weight") if config.qk_norm else None,
                    k_norm_w=norm(a + "k_norm.weight") if config.qk_norm else None,
                    o_w=gemm.pack(linear(a + "o_proj", 1, q_lo * d, q_hi * d)),
                    o_b=get(a + "o_proj.bias") if config.o_bias else None,
                    pre_mlp_norm_w=norms[hooks.pre_mlp_norm],
                    gate_up_w=None if moe else gemm.pack(concat_rows([linear(m + "gate_proj", 0, i_lo, i_hi),
                                                                      linear(m + "up_proj", 0, i_lo, i_hi)])),  # fmt: skip
                    down_w=None if moe else gemm.pack(linear(m + "down_proj", 1, i_lo, i_hi)),
                    post_attn_norm_w=norms.get(hooks.post_attn_norm),
                    post_mlp_norm_w=norms.get(hooks.post_mlp_norm),
                    **moe,
                )
            )
        embed, lm_head = _load_vocab(src, config, layout, get)
        if lm_head is not None:
            lm_head, embed = gemm.pack_lm_head(lm_head, embed, layout.is_first_stage)
        return cls(layers, embed, lm_head, norm("model.norm.weight") if layout.is_last_stage else None)

    @classmethod
    def random_state_dict(cls, config: LlamaConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        """Seeded random weights under Hugging Face's names (for presets): normal(0, initializer_range)
        matrices, norm weights near 1 as the family applies them (near 1 - norm_offset as stored), so
        activations keep their scale."""
        hooks = cls.hooks(config)
        gen = torch.Generator().manual_seed(seed)
        std = config.initializer_range
        h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
        hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d

        def normal(*shape: int) -> torch.Tensor:
            return (torch.randn(*shape, generator=gen) * std).to(dtype)

        def norm(size: int) -> torch.Tensor:
            noise = 0.1 * torch.randn(size, generator=gen)
            return (noise if hooks.norm_offset else 1.0 + noise).to(dtype)

        sd = {"model.embed_tokens.weight": normal(config.vocab_size, h), "model.norm.weight": norm(h)}
        if not config.tie_word_embeddings:
            sd["lm_head.weight"] = normal(config.vocab_size, h)
        for i in range(config.num_hidden_layers):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            sd |= {p + name + ".weight": norm(h) for name in hooks.norm_names}
            sd |= {
                a + "q_proj.weight": normal(hq, h), a + "k_proj.weight": normal(hkv, h), a + "v_proj.weight": normal(hkv, h),
                a + "o_proj.weight": normal(h, hq),
                m + "gate_proj.weight": normal(inter, h), m + "up_proj.weight": normal(inter, h),
                m + "down_proj.weight": normal(h, inter),
            }  # fmt: skip
            if config.qkv_bias:
                sd |= {a + "q_proj.bias": normal(hq), a + "k_proj.bias": normal(hkv), a + "v_proj.bias": normal(hkv)}
            if config.o_bias:
                sd[a + "o_proj.bias"] = normal(h)
            if config.qk_norm:
                sd |= {a + "q_norm.weight": norm(d), a + "k_norm.weight": norm(d)}
            if config.is_moe_layer(i):  # experts instead of the dense MLP, under the family's names
                for key in ("gate_proj.weight", "up_proj.weight", "down_proj.weight"):
                    del sd[m + key]
                sd |= _random_experts(config, i, normal)
        return sd


def _load_vocab(
    src: WeightSource, config: LlamaConfig, layout: ParallelLayout, get: Callable[..., torch.Tensor]
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(embedding, LM head) of this rank's vocabulary shard, each None where its stage needs none; a
    tied LM head (or a checkpoint without one) is the embedding itself. `get(name, dim, lo, hi)`
    reads a tensor in the model's dtype and device."""
    v_lo, v_hi = layout.vocab_shard(config.vocab_size)
    tied = config.tie_word_embeddings or "lm_head.weight" not in src
    embed = None
    if layout.is_first_stage or (layout.is_last_stage and tied):
        embed = get("model.embed_tokens.weight", 0, v_lo, v_hi)
    lm_head = None
    if layout.is_last_stage:
        lm_head = embed if tied else get("lm_head.weight", 0, v_lo, v_hi)
    return embed, lm_head


def _load_experts(src: WeightSource, dense, linear, config: LlamaConfig, layout: ParallelLayout,  # noqa: ANN001
                  layer: str) -> dict[str, Any]:  # fmt: skip
    """A MoE layer's weights: the router, kept in float32 (routing decides by small margins), and each
    expert's gate and up rows and down columns of this rank's slice of the expert width, under the
    architecture's names (families.llama.expert_names); Qwen2-MoE adds mlp.shared_expert (a dense
    SwiGLU) and its gate. `dense` reads a linear layer's weight in float whatever its checkpoint
    stores, `linear` as the kernels read it: integer experts stay packed (the grouped GEMMs and the
    CPU's C kernel read them), FP8 and W8A8 ones are dequantized at load (no grouped GEMM reads them)."""
    module, names = expert_names(config)
    prefix = f"{layer}{module}."
    lo, hi = layout.shard(config.moe_intermediate_size)
    packed = is_int_quantized(src, f"{prefix}experts.0.{names[0]}", config.int_format)
    read = linear if packed else dense

    def expert(e: int, name: str, dim: int) -> LinearWeight:
        return read(f"{prefix}experts.{e}.{name}", dim, lo, hi)

    experts = range(config.num_experts)
    weights = {
        "router_w": dense(prefix + "gate").float(),
        "experts_w13": stack_experts([concat_rows([expert(e, names[0], 0), expert(e, names[1], 0)]) for e in experts]),
        "experts_w2": stack_experts([expert(e, names[2], 1) for e in experts]),
    }
    if config.shared_expert_intermediate_size:
        s_lo, s_hi = layout.shard(config.shared_expert_intermediate_size)
        shared = prefix + "shared_expert."
        weights |= {
            "shared_gate_up_w": gemm.pack(torch.cat([dense(shared + "gate_proj", 0, s_lo, s_hi),
                                                     dense(shared + "up_proj", 0, s_lo, s_hi)])),
            "shared_down_w": gemm.pack(dense(shared + "down_proj", 1, s_lo, s_hi)),
            "shared_gate_w": dense(prefix + "shared_expert_gate"),
        }  # fmt: skip
    return weights


def _random_experts(config: LlamaConfig, layer: int, normal: Callable[..., torch.Tensor]) -> dict[str, torch.Tensor]:
    """A MoE layer's random router and experts (and Qwen2-MoE's shared expert), under the family's names."""
    h = config.hidden_size
    module, (gate, up, down) = expert_names(config)
    e = f"model.layers.{layer}.{module}."
    width = config.moe_intermediate_size
    sd = {e + "gate.weight": normal(config.num_experts, h)}
    for x in range(config.num_experts):
        sd |= {f"{e}experts.{x}.{gate}.weight": normal(width, h), f"{e}experts.{x}.{up}.weight": normal(width, h),
               f"{e}experts.{x}.{down}.weight": normal(h, width)}  # fmt: skip
    if config.shared_expert_intermediate_size:
        shared = config.shared_expert_intermediate_size
        sd |= {e + "shared_expert.gate_proj.weight": normal(shared, h), e + "shared_expert.up_proj.weight":
               normal(shared, h), e + "shared_expert.down_proj.weight": normal(h, shared),
               e + "shared_expert_gate.weight": normal(1, h)}  # fmt: skip
    return sd


class Decoder(StageModel):
    """One stage of the shared decoder, run with its weights' family hooks (`DecoderWeights.hooks`)."""

    def __init__(
        self, config: LlamaConfig, weights: DecoderWeights, ops: KernelOps,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, weights, ops, layout, tp, config.num_attention_heads, config.num_key_value_heads)
        self.hooks = hooks = weights.hooks(config)
        self.activation = getattr(ops, hooks.activation)
        dtype, device = weights.layers[0].input_norm_w.dtype, weights.layers[0].input_norm_w.device  # every stage has a layer
        # transformers multiplies by the scale rounded to the embedding's dtype
        self.embed_scale = torch.tensor(hooks.embed_scale, dtype=dtype, device=device) if hooks.embed_scale else None
        global_table = rope_table(config, device)  # rope_theta with its scaling, config.max_context rows
        local_table = global_table
        if hooks.rope_local_theta:  # the local layers' own base, unscaled
            local_table = cos_sin_table(inverse_frequencies(config.head_dim, hooks.rope_local_theta),
                                        config.max_context, device)  # fmt: skip
        # This stage's layers: (window, rope table) of each; a window marks a local layer.
        self.layer_attention = [
            (config.window(i), local_table if config.window(i) else global_table)
            for i in layout.layers(config.num_hidden_layers)
        ]
        # The fused pre-norms (gemm.py) for the families whose layer is norm -> GEMM twice: not with
        # sandwich norms (Gemma's post-norms come between a GEMM and the residual add) nor experts
        # (the router and the experts read the norm's output).
        self.can_fuse_norms = (
            hooks.post_attn_norm is None
            and all(layer.router_w is None for layer in weights.layers)
            and gemm.can_fuse_norms(ops, [x for layer in weights.layers for x in (layer.qkv_w, layer.gate_up_w)])
        )

    def kv_scale_names(self, layer: int) -> list[tuple[str, str]]:
        attn = f"model.layers.{layer}.self_attn."
        return [(attn + "k_scale", attn + "v_scale"), (attn + "k_proj.output_scale", attn + "v_proj.output_scale")]

    def eagle3_layers(self, layers: tuple[int, ...] | None) -> tuple[int, ...]:
        count = self.config.num_hidden_layers
        chosen = layers if layers is not None else (2, count // 2, count - 3)  # vLLM's default
        if len(set(chosen)) != 3 or not all(0 <= i < count for i in chosen):
            raise ValueError(f"speculative_config: an EAGLE-3 head reads three distinct layers of the target's "
                             f"{count}, got {list(chosen)} (set eagle_config.eagle_aux_hidden_state_layer_ids in "
                             "the head's config.json)")  # fmt: skip
        return tuple(chosen)

    def vocab_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.embed_scale is not None:
            raise ValueError("speculative_config: method 'eagle' is not served for a model that scales its "
                             "embedding (Gemma): EAGLE heads read the plain embedding")  # fmt: skip
        assert self.weights.embed is not None and self.weights.lm_head is not None, "a single-process model"
        return self.weights.embed, self.weights.lm_head

    def _experts(self, h: torch.Tensor, layer: DecoderLayerWeights) -> torch.Tensor:
        """A MoE layer on the flat tokens of the whole batch: router logits in float32, softmax over
        the experts, each token's top k (renormalised where the family does: Mixtral, Qwen3-MoE), then
        every chosen expert on its tokens (`ops.moe`), plus Qwen2-MoE's gated shared expert; under
        tensor parallelism each rank holds a slice of every expert's width, and one all-reduce sums
        them, as for the dense MLP."""
        assert layer.router_w is not None and layer.experts_w13 is not None and layer.experts_w2 is not None
        probs = torch.softmax(h.float() @ layer.router_w.t(), dim=-1)
        weights, experts = torch.topk(probs, self.config.num_experts_per_tok, dim=-1)
        if self.config.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.ops.moe(h, layer.experts_w13, layer.experts_w2, weights.to(h.dtype), experts)
        if layer.shared_gate_up_w is not None:  # Qwen2-MoE: + sigmoid(gate x) * shared expert (each rank's part)
            shared = gemm.linear(self.ops.silu_and_mul(gemm.linear(h, layer.shared_gate_up_w)), layer.shared_down_w)
            out = out + torch.sigmoid(gemm.linear(h, layer.shared_gate_w)) * shared
        return self.tp.all_reduce(out) if self.tp.size > 1 else out

    @functools.cached_property
    def cpu_step(self) -> DecoderStep | None:
        """The C decode step (kernels/orca_kernels/cpu_decoder_step.py) for this stage's layers, built
        at the first step, or None where the per-op path runs every step (logged once, with why): the
        CPU kernel set, one process, dense SwiGLU layers without q/k or sandwich norms, K/V pools of
        the model's dtype, linear layers the C GEMM multiplies; and the steps of up to its
        `max_tokens` tokens without prompts (`DecoderStep.runs`), LoRA or EAGLE-3 taps."""
        cfg, w, hooks = self.config, self.weights, self.hooks
        dtype = w.layers[0].input_norm_w.dtype
        reason = (
            "q/k norms, sandwich norms or an activation other than SwiGLU" if cfg.qk_norm or hooks.post_attn_norm or hooks.activation != "silu_and_mul"
            else "mixture-of-experts layers" if any(layer.gate_up_w is None for layer in w.layers)
            else self.c_step_obstacle([x for layer in w.layers for x in (layer.qkv_w, layer.o_w, layer.gate_up_w, layer.down_w)])
            or unsupported(dtype)
        )  # fmt: skip
        if reason:
            logger.info("decode steps on CPU run op by op (%s)", reason)
            return None
        layers = [
            StepLayer(layer.input_norm_w, layer.pre_mlp_norm_w, c_linear(layer.qkv_w), layer.qkv_b, c_linear(layer.o_w),
                      layer.o_b, c_linear(layer.gate_up_w), c_linear(layer.down_w), cos_sin, window, group)
            for layer, (window, cos_sin), group in zip(w.layers, self.layer_attention, self.kv_groups, strict=True)
        ]  # fmt: skip
        step = DecoderStep(layers, dtype=dtype, hidden=cfg.hidden_size, q_heads=self.num_heads, kv_heads=self.num_kv_heads,
                           head_dim=cfg.head_dim, intermediate=cfg.intermediate_size, eps=cfg.rms_norm_eps,
                           scale=hooks.attn_scale, softcap=hooks.attn_softcap)  # fmt: skip
        logger.info("decode steps of up to %d tokens on CPU run as one C call (csrc/decoder_step.c)", step.max_tokens)
        return step

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm over each head's vector ([T, heads, d]): Qwen3's and Gemma 3's q/k norm."""
        t, heads, d = x.shape
        normed, _ = self.ops.add_rmsnorm(x.reshape(t * heads, d), None, weight, self.config.rms_norm_eps)
        return normed.view(t, heads, d)

    @torch.inference_mode()
    def forward(
        self,
        stage_input: StageInput,
        metas: Sequence[AttentionMetadata],  # per K/V group (StageModel)
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # this stage's layers: (k, v) pools [slots, kv heads, d]
        logits_indices: torch.Tensor,  # [B] index of each request's last token in the flat batch
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns [B, vocab] float32 logits on the last stage (with `stage_input.pool_indices`, and the
        final norm's output at those tokens), else the [2, T, hidden] activations to pass on."""
        cfg, w, ops, tp, hooks = self.config, self.weights, self.ops, self.tp, self.hooks
        t, d, eps = stage_input.input_ids.shape[0], cfg.head_dim, cfg.rms_norm_eps
        hq, hkv = self.num_heads, self.num_kv_heads
        add_rmsnorm, activation, positions = ops.add_rmsnorm, self.activation, stage_input.positions
        scale, softcap, qk_norm = hooks.attn_scale, hooks.attn_softcap, cfg.qk_norm
        sandwich = hooks.post_attn_norm is not None
        if self.layout.is_first_stage:
            x, residual = vocab_parallel_embed(stage_input.input_ids, w.embed, self.vocab_lo, tp), None
            if self.embed_scale is not None:
                x = x * self.embed_scale
        else:
            x, residual = stage_input.hidden.unbind(0)
        lora = self.lora.step(ops, stage_input.lora) if self.lora is not None else None
        if self.can_fuse_norms and lora is None and t <= gemm.NORM_LINEAR_MAX_TOKENS["rmsnorm"]:
            return self._forward_fused(x, residual, stage_input, metas, kv_caches, logits_indices)
        cpu_step = self.cpu_step
        if cpu_step is not None and lora is None and not stage_input.aux_layers and cpu_step.runs(t, metas):
            x, residual = cpu_step(x, positions, metas, kv_caches)
            return self._logits(x, residual, stage_input, logits_indices, [])
        layers = zip(w.layers, self.layer_attention, kv_caches, self.kv_scales, self.kv_groups, strict=True)
        aux_layers, aux = stage_input.aux_layers, []
        for i, (layer, (window, cos_sin), (k_cache, v_cache), kv_scales, group) in enumerate(layers):
            if i in aux_layers:
                aux.append(x if residual is None else x + residual)
            h, residual = add_rmsnorm(x, residual, layer.input_norm_w, eps)
            qkv = gemm.linear(h, layer.qkv_w, layer.qkv_b)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if qk_norm:
                q, k = self._head_norm(q, layer.q_norm_w), self._head_norm(k, layer.k_norm_w)
            # Rotary, the K/V write and attention: one launch (+ a reduce) for a decode on the Triton set.
            attn = ops.rotary_write_kv_attention(
                q, k, v, positions, cos_sin, k_cache, v_cache, metas[group], scale, window, softcap, kv_scales
            ).reshape(t, hq * d)
            x = row_parallel_linear(attn, layer.o_w, layer.o_b, tp, lora and lora.adder(i, "o"))
            if sandwich:  # the post-norm's output is the x of the pre-norm's residual add
                x, _ = add_rmsnorm(x, None, layer.post_attn_norm_w, eps)
            h, residual = add_rmsnorm(x, residual, layer.pre_mlp_norm_w, eps)
            if layer.router_w is not None:
                x = self._experts(h, layer)
            else:
                gate_up = gemm.linear(h, layer.gate_up_w)
                if lora is not None:
                    lora.add(i, "gate_up", h, gate_up)
                x = row_parallel_linear(activation(gate_up), layer.down_w, None, tp, lora and lora.adder(i, "down"))
            if sandwich:
                x, _ = add_rmsnorm(x, None, layer.post_mlp_norm_w, eps)
        if not self.layout.is_last_stage:
            return stage_output(x, residual)
        return self._logits(x, residual, stage_input, logits_indices, aux)

    def _logits(self, x: torch.Tensor, residual: torch.Tensor, stage_input: StageInput, logits_indices: torch.Tensor,
                aux: list[torch.Tensor]) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The last stage's [B, vocab] float32 logits from the last layer's output x and the residual
        stream (with the pooled final hidden states where `stage_input.pool_indices` asks for them)."""
        cfg, w, hooks = self.config, self.weights, self.hooks
        pooled = self._final_hidden(x, None, residual, stage_input.pool_indices, aux)
        # Only the last token of each request needs the final norm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        h, _ = self.ops.add_rmsnorm(x, residual, w.norm_w, cfg.rms_norm_eps)
        logits = self.tp.gather_vocab(gemm.linear(h, w.lm_head).float(), cfg.vocab_size)
        if hooks.final_softcap:
            logits = torch.tanh(logits / hooks.final_softcap) * hooks.final_softcap
        return logits if pooled is None else (logits, pooled)

    def _final_hidden(self, x: torch.Tensor, pending: torch.Tensor | None, residual: torch.Tensor,
                      indices: torch.Tensor | None, aux: list[torch.Tensor]) -> torch.Tensor | None:  # fmt: skip
        """The final norm's output at `indices` (what embedding requests pool), float32, then the
        `aux` hidden states there (StageInput.aux_layers); None without indices."""
        if indices is None:
            return None
        x = x.index_select(0, indices)
        h, _ = self.ops.add_rmsnorm(x if pending is None else x + pending, residual.index_select(0, indices),
                                    self.weights.norm_w, self.config.rms_norm_eps)  # fmt: skip
        if aux:
            h = torch.cat([h, *(a.index_select(0, indices) for a in aux)], dim=-1)
        return h.float()

    def _forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor | None, stage_input: StageInput, metas: Sequence[AttentionMetadata],
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`forward` with each RMSNorm inside the GEMM it feeds (`ops.norm_linear`, gemm.py): a layer
        is the RMSNorm + q/k/v GEMM (+ bias), the q/k norms where there are, rotary + K/V write +
        attention, the o GEMM, the RMSNorm + gate/up GEMM + activation-and-multiply and the down GEMM.
        An o projection's bias (`pending`) goes to the next norm, added once after the all-reduce."""
        cfg, w, ops, tp, hooks = self.config, self.weights, self.ops, self.tp, self.hooks
        t, d, eps = x.shape[0], cfg.head_dim, cfg.rms_norm_eps
        hq, hkv = self.num_heads, self.num_kv_heads
        pending: torch.Tensor | None = None  # the bias of the linear that made x, not added yet
        layers = zip(w.layers, self.layer_attention, kv_caches, self.kv_scales, self.kv_groups, strict=True)
        aux_layers, aux = stage_input.aux_layers, []
        for i, (layer, (window, cos_sin), (k_cache, v_cache), kv_scales, group) in enumerate(layers):
            if i in aux_layers:  # (no bias is pending between layers)
                aux.append(x if residual is None else x + residual)
            qkv, residual = ops.norm_linear(x, pending, residual, layer.input_norm_w, None, eps, layer.qkv_w, layer.qkv_b)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if cfg.qk_norm:
                q, k = self._head_norm(q, layer.q_norm_w), self._head_norm(k, layer.k_norm_w)
            # fmt: off
            attn = ops.rotary_write_kv_attention(q, k, v, stage_input.positions, cos_sin, k_cache, v_cache, metas[group],
                                                 hooks.attn_scale, window, hooks.attn_softcap,
                                                 kv_scales).reshape(t, hq * d)
            x, pending = row_parallel_linear(attn, layer.o_w, None, tp), layer.o_b
            h, residual = ops.norm_linear(x, pending, residual, layer.pre_mlp_norm_w, None, eps, layer.gate_up_w, None,
                                          hooks.activation)
            # fmt: on
            x, pending = row_parallel_linear(h, layer.down_w, None, tp), None
        if not self.layout.is_last_stage:
            return stage_output(x if pending is None else x + pending, residual)
        pooled = self._final_hidden(x, pending, residual, stage_input.pool_indices, aux)
        # Only the last token of each request needs the final norm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        logits, _ = ops.norm_linear(x, pending, residual, w.norm_w, None, eps, w.lm_head, None)
        logits = tp.gather_vocab(logits.float(), cfg.vocab_size)
        if hooks.final_softcap:
            logits = torch.tanh(logits / hooks.final_softcap) * hooks.final_softcap
        return logits if pooled is None else (logits, pooled)
