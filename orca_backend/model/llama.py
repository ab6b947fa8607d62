"""The Llama-style decoder (Llama, Mistral, Qwen2, Qwen3) written for selective batching.

As in gpt2.py, every scheduled token of every request is one flat ``[num_tokens, hidden]`` tensor
for the embedding, RMSNorms, projections and the SwiGLU MLP; attention alone is split per request
(`AttentionMetadata`). Rotary embeddings are applied to the new tokens' q and k at their own
positions before k is written to the pool, so the pool holds rotated keys, one row per **KV
head**: attention reads each KV head once for its whole query group (grouped-query attention).

Tensor parallelism splits query heads and KV heads over the ranks (q, k, v and gate/up
column-parallel; o_proj and down_proj row-parallel, one all-reduce each) and the vocabulary for
the embedding and LM head; pipeline parallelism gives each stage its layers.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from orca_backend.config import check_parallel_layout
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.families.llama import LlamaConfig, expert_names
from orca_backend.model import gemm
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.fp8 import Fp8Weight, concat_rows, load_linear
from orca_backend.model.lora import LoRAStack
from orca_backend.model.parallel_layers import row_parallel_linear, vocab_parallel_embed
from orca_backend.model.registry import ModelCode
from orca_backend.model.rope import cos_sin_table, inverse_frequencies
from orca_backend.model.stage_input import StageInput
from orca_kernels import AttentionMetadata, KernelOps


def llama_key(key: str) -> str | None:
    """Checkpoint keys are used as stored; rotary caches some exports carry are recomputed instead."""
    return None if key.endswith("rotary_emb.inv_freq") else key


@dataclass
class LlamaLayerWeights:
    input_norm_w: torch.Tensor
    # The linear weights are FP8 (with their scales) on CUDA from an FP8 checkpoint (model/fp8.py).
    qkv_w: torch.Tensor | Fp8Weight  # this rank's q heads, then its KV heads of k, then of v: [(hq + 2 hkv) d, hidden]
    qkv_b: torch.Tensor | None
    q_norm_w: torch.Tensor | None  # Qwen3: [head_dim]
    k_norm_w: torch.Tensor | None
    o_w: torch.Tensor | Fp8Weight  # [hidden, hq d] columns of this rank's heads
    o_b: torch.Tensor | None
    post_norm_w: torch.Tensor
    gate_up_w: torch.Tensor | Fp8Weight | None  # this rank's slice of gate, then of up: [2 i, hidden]
    down_w: torch.Tensor | Fp8Weight | None  # [hidden, i]
    # Mixtral (no dense MLP then): the router [experts, hidden] in float32, and every expert's slice
    # of gate then up [experts, 2 i, hidden] and of down [experts, hidden, i].
    router_w: torch.Tensor | None = None
    experts_w13: torch.Tensor | None = None
    experts_w2: torch.Tensor | None = None
    # Qwen2-MoE's shared expert (a dense SwiGLU of this rank's slice) and its gate [1, hidden].
    shared_gate_up_w: torch.Tensor | None = None
    shared_down_w: torch.Tensor | None = None
    shared_gate_w: torch.Tensor | None = None


@dataclass
class LlamaWeights:
    layers: list[LlamaLayerWeights]
    embed: torch.Tensor | None  # [vocab shard, hidden], first stage (and last, when tied)
    lm_head: torch.Tensor | None  # [vocab shard, hidden], last stage; the embedding itself when tied
    norm_w: torch.Tensor | None  # last stage

    def num_bytes(self) -> int:
        return decoder_num_bytes(self)

    @classmethod
    def load(
        cls, src: WeightSource, config: LlamaConfig, layout: ParallelLayout, dtype: torch.dtype, device: torch.device
    ) -> LlamaWeights:
        d = config.head_dim
        check_parallel_layout(config, layout.tp_size, layout.pp_size)
        q_lo, q_hi = layout.shard(config.num_attention_heads)
        kv_lo, kv_hi = layout.shard(config.num_key_value_heads)
        i_lo, i_hi = layout.shard(config.intermediate_size)

        def get(name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            return src.get(name, dim, lo, hi).to(device=device, dtype=dtype).contiguous()

        def linear(name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor | Fp8Weight:
            return load_linear(src, name, config.fp8_block, config.fp8, dim, lo, hi, dtype, device)

        layers = []
        for i in layout.layers(config.num_hidden_layers):
            p = f"model.layers.{i}."
            a = p + "self_attn."
            qkv_w = concat_rows([linear(a + "q_proj.weight", 0, q_lo * d, q_hi * d),
                                 linear(a + "k_proj.weight", 0, kv_lo * d, kv_hi * d),
                                 linear(a + "v_proj.weight", 0, kv_lo * d, kv_hi * d)])  # fmt: skip
            qkv_b = None
            if config.qkv_bias:
                qkv_b = torch.cat([get(a + "q_proj.bias", 0, q_lo * d, q_hi * d),
                                   get(a + "k_proj.bias", 0, kv_lo * d, kv_hi * d),
                                   get(a + "v_proj.bias", 0, kv_lo * d, kv_hi * d)])  # fmt: skip
            m = p + "mlp."
            moe = _load_experts(get, config, layout, p) if config.is_moe_layer(i) else {}
            layers.append(
                LlamaLayerWeights(
                    input_norm_w=get(p + "input_layernorm.weight"),
                    qkv_w=gemm.pack(qkv_w),
                    qkv_b=qkv_b,
                    q_norm_w=get(a + "q_norm.weight") if config.qk_norm else None,
                    k_norm_w=get(a + "k_norm.weight") if config.qk_norm else None,
                    o_w=gemm.pack(linear(a + "o_proj.weight", 1, q_lo * d, q_hi * d)),
                    o_b=get(a + "o_proj.bias") if config.o_bias else None,
                    post_norm_w=get(p + "post_attention_layernorm.weight"),
                    gate_up_w=None if moe else gemm.pack(concat_rows([linear(m + "gate_proj.weight", 0, i_lo, i_hi),
                                                                      linear(m + "up_proj.weight", 0, i_lo, i_hi)])),  # fmt: skip
                    down_w=None if moe else gemm.pack(linear(m + "down_proj.weight", 1, i_lo, i_hi)),
                    **moe,
                )
            )
        embed, lm_head = load_vocab(src, config, layout, get)
        return cls(layers, embed, lm_head, get("model.norm.weight") if layout.is_last_stage else None)


def load_vocab(
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


def decoder_num_bytes(weights: LlamaWeights) -> int:
    """The bytes of every tensor a decoder's weights hold, each once (a tied LM head is the embedding)."""
    tensors = {id(t): t for t in (weights.embed, weights.lm_head, weights.norm_w) if t is not None}
    for layer in weights.layers:
        tensors.update({id(t): t for t in vars(layer).values() if t is not None})
    return sum(t.nbytes for t in tensors.values())


def _load_experts(get, config: LlamaConfig, layout: ParallelLayout, layer: str) -> dict[str, torch.Tensor]:  # noqa: ANN001
    """A MoE layer's weights: the router, kept in float32 (routing decides by small margins), and each
    expert's gate and up rows and down columns of this rank's slice of the expert width, under the
    architecture's names (families.llama.expert_names); Qwen2-MoE adds mlp.shared_expert (a dense
    SwiGLU) and its gate."""
    module, names = expert_names(config)
    prefix = f"{layer}{module}."
    lo, hi = layout.shard(config.moe_intermediate_size)

    def expert(e: int, name: str, dim: int) -> torch.Tensor:
        return get(f"{prefix}experts.{e}.{name}.weight", dim, lo, hi)

    experts = range(config.num_experts)
    weights = {
        "router_w": get(prefix + "gate.weight").float(),
        "experts_w13": torch.stack([torch.cat([expert(e, names[0], 0), expert(e, names[1], 0)]) for e in experts]),
        "experts_w2": torch.stack([expert(e, names[2], 1) for e in experts]),
    }
    if config.shared_expert_intermediate_size:
        s_lo, s_hi = layout.shard(config.shared_expert_intermediate_size)
        shared = prefix + "shared_expert."
        weights |= {
            "shared_gate_up_w": gemm.pack(torch.cat([get(shared + "gate_proj.weight", 0, s_lo, s_hi),
                                                     get(shared + "up_proj.weight", 0, s_lo, s_hi)])),
            "shared_down_w": gemm.pack(get(shared + "down_proj.weight", 1, s_lo, s_hi)),
            "shared_gate_w": get(prefix + "shared_expert_gate.weight"),
        }  # fmt: skip
    return weights


class Llama:
    def __init__(
        self, config: LlamaConfig, weights: LlamaWeights, ops: KernelOps,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        self.config = config
        self.weights = weights
        self.ops = ops
        self.layout = layout
        self.tp = tp or TensorParallelGroup()
        self.num_heads = config.num_attention_heads // layout.tp_size
        self.num_kv_heads = config.num_key_value_heads // layout.tp_size
        self.vocab_lo, self.vocab_hi = layout.vocab_shard(config.vocab_size)
        self.scale = 1.0 / math.sqrt(config.head_dim)
        device = weights.norm_w.device if weights.norm_w is not None else weights.layers[0].input_norm_w.device
        inv_freq = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_llama3, config.rope_linear)
        self.cos_sin = cos_sin_table(inv_freq, config.max_position_embeddings, device)
        self.windows = [config.window(i) for i in layout.layers(config.num_hidden_layers)]  # this stage's layers
        self.lora: LoRAStack | None = None  # the adapters' slots, with enable_lora (worker/lora_manager.py)

    def _experts(self, h: torch.Tensor, layer: LlamaLayerWeights) -> torch.Tensor:
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

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Qwen3's RMSNorm over each head's vector ([T, heads, d])."""
        t, heads, d = x.shape
        normed, _ = self.ops.add_rmsnorm(x.reshape(t * heads, d), None, weight, self.config.rms_norm_eps)
        return normed.view(t, heads, d)

    @torch.inference_mode()
    def forward(
        self,
        stage_input: StageInput,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # this stage's layers: (k, v) pools [slots, kv heads, d]
        logits_indices: torch.Tensor,  # [B] index of each request's last token in the flat batch
    ) -> torch.Tensor:
        """Returns [B, vocab] float32 logits on the last stage, else the [2, T, hidden] activations to pass on."""
        cfg, w, ops = self.config, self.weights, self.ops
        t, d, eps = stage_input.input_ids.shape[0], cfg.head_dim, cfg.rms_norm_eps
        hq, hkv = self.num_heads, self.num_kv_heads
        if self.layout.is_first_stage:
            x, residual = vocab_parallel_embed(stage_input.input_ids, w.embed, self.vocab_lo, self.tp), None
        else:
            x, residual = stage_input.hidden.unbind(0)
        lora = self.lora.step(ops, stage_input.lora) if self.lora is not None else None
        for i, (layer, window, (k_cache, v_cache)) in enumerate(zip(w.layers, self.windows, kv_caches, strict=True)):
            h, residual = ops.add_rmsnorm(x, residual, layer.input_norm_w, eps)
            qkv = gemm.linear(h, layer.qkv_w, layer.qkv_b)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if cfg.qk_norm:
                q, k = self._head_norm(q, layer.q_norm_w), self._head_norm(k, layer.k_norm_w)
            # Rotary, the K/V write and attention: one launch (+ a reduce) for a decode on the Triton set.
            attn = ops.rotary_write_kv_attention(
                q, k, v, stage_input.positions, self.cos_sin, k_cache, v_cache, meta, self.scale, window
            ).reshape(t, hq * d)
            x = row_parallel_linear(attn, layer.o_w, layer.o_b, self.tp, lora and lora.adder(i, "o"))
            h, residual = ops.add_rmsnorm(x, residual, layer.post_norm_w, eps)
            if layer.router_w is not None:
                x = self._experts(h, layer)
            else:
                gate_up = gemm.linear(h, layer.gate_up_w)
                if lora is not None:
                    lora.add(i, "gate_up", h, gate_up)
                x = row_parallel_linear(ops.silu_and_mul(gate_up), layer.down_w, None, self.tp, lora and lora.adder(i, "down"))
        if not self.layout.is_last_stage:
            return torch.stack([x, residual if residual is not None else torch.zeros_like(x)])
        # Only the last token of each request needs the final norm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        h, _ = ops.add_rmsnorm(x, residual, w.norm_w, eps)
        return self.tp.gather_vocab(gemm.linear(h, w.lm_head).float(), cfg.vocab_size)


def random_llama_state_dict(config: LlamaConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights under Hugging Face's names (for presets): normal(0, initializer_range)
    matrices, RMSNorm weights near 1 so activations keep their scale."""
    gen = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (1.0 + 0.1 * torch.randn(size, generator=gen)).to(dtype)

    sd = {"model.embed_tokens.weight": normal(config.vocab_size, h), "model.norm.weight": norm(h)}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = normal(config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        sd |= {
            p + "input_layernorm.weight": norm(h), p + "post_attention_layernorm.weight": norm(h),
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
            module, (gate, up, down) = expert_names(config)
            e = f"model.layers.{i}.{module}."
            width = config.moe_intermediate_size
            sd[e + "gate.weight"] = normal(config.num_experts, h)
            for x in range(config.num_experts):
                sd |= {f"{e}experts.{x}.{gate}.weight": normal(width, h), f"{e}experts.{x}.{up}.weight": normal(width, h),
                       f"{e}experts.{x}.{down}.weight": normal(h, width)}  # fmt: skip
            if config.shared_expert_intermediate_size:
                shared = config.shared_expert_intermediate_size
                sd |= {e + "shared_expert.gate_proj.weight": normal(shared, h), e + "shared_expert.up_proj.weight":
                       normal(shared, h), e + "shared_expert.down_proj.weight": normal(h, shared),
                       e + "shared_expert_gate.weight": normal(1, h)}  # fmt: skip
    return sd


MODEL_CODE = ModelCode(LlamaWeights, Llama, llama_key, random_llama_state_dict)
