"""Gemma 2 and Gemma 3 (text) written for selective batching, as llama.py is for the Llama family.

The layer is Llama's with Gemma's differences (families.gemma.GemmaConfig): the embedding is scaled by
sqrt(hidden); every RMSNorm weighs by (1 + w), folded into the stored weight at load; each of
attention and the MLP has a norm before and after it (four per layer), the MLP is GeGLU (tanh GELU
of the gate times up); scores are scaled by query_pre_attn_scalar^-0.5 and, on Gemma 2, soft-capped,
as are its final logits. Local layers attend within a sliding window and global layers to the whole
context; Gemma 3 gives its local layers their own rope base and normalises q and k per head.

The post-norms sit between a sublayer and the residual add, so the residual stream is carried as
Llama's is (`add_rmsnorm(x, residual)` returns the norm of the sum and the sum): the post-norm of
attention feeds the pre-norm of the MLP as its `x`, and the post-norm of the MLP the next layer's
input norm. Tensor and pipeline parallelism split heads, MLP width, vocabulary and layers as for Llama.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from orca_backend.config import check_parallel_layout
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.families.gemma import GemmaConfig
from orca_backend.model import gemm
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.llama import decoder_num_bytes, load_vocab
from orca_backend.model.lora import LoRAStack
from orca_backend.model.parallel_layers import row_parallel_linear, vocab_parallel_embed
from orca_backend.model.registry import ModelCode
from orca_backend.model.rope import cos_sin_table, inverse_frequencies
from orca_backend.model.stage_input import StageInput
from orca_kernels import AttentionMetadata, KernelOps

NORMS = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm", "post_feedforward_layernorm")


def gemma_key(key: str) -> str | None:
    return key


@dataclass
class GemmaLayerWeights:
    # Norm weights are stored as (1 + w): Gemma's RMSNorm, computed by the plain RMSNorm kernels.
    input_norm_w: torch.Tensor
    qkv_w: torch.Tensor  # this rank's q heads, then its KV heads of k, then of v: [(hq + 2 hkv) d, hidden]
    q_norm_w: torch.Tensor | None  # Gemma 3: [head_dim]
    k_norm_w: torch.Tensor | None
    o_w: torch.Tensor  # [hidden, hq d] columns of this rank's heads
    post_attn_norm_w: torch.Tensor
    pre_ff_norm_w: torch.Tensor
    post_ff_norm_w: torch.Tensor
    gate_up_w: torch.Tensor  # this rank's slice of gate, then of up: [2 i, hidden]
    down_w: torch.Tensor  # [hidden, i]


@dataclass
class GemmaWeights:
    layers: list[GemmaLayerWeights]
    embed: torch.Tensor | None  # [vocab shard, hidden], first stage and (tied) last
    lm_head: torch.Tensor | None  # the embedding itself when tied
    norm_w: torch.Tensor | None  # last stage, (1 + w)

    def num_bytes(self) -> int:
        return decoder_num_bytes(self)

    @classmethod
    def load(
        cls, src: WeightSource, config: GemmaConfig, layout: ParallelLayout, dtype: torch.dtype, device: torch.device
    ) -> GemmaWeights:
        d = config.head_dim
        check_parallel_layout(config, layout.tp_size, layout.pp_size)
        q_lo, q_hi = layout.shard(config.num_attention_heads)
        kv_lo, kv_hi = layout.shard(config.num_key_value_heads)
        i_lo, i_hi = layout.shard(config.intermediate_size)

        def get(name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            return src.get(name, dim, lo, hi).to(device=device, dtype=dtype).contiguous()

        def norm(name: str) -> torch.Tensor:
            # (1 + w) in float32, as transformers computes it, then stored in the model's dtype.
            return (1.0 + src.get(name).float()).to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in layout.layers(config.num_hidden_layers):
            p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
            norms = [norm(p + name + ".weight") for name in NORMS]
            layers.append(
                GemmaLayerWeights(
                    input_norm_w=norms[0],
                    qkv_w=gemm.pack(torch.cat([get(a + "q_proj.weight", 0, q_lo * d, q_hi * d),
                                               get(a + "k_proj.weight", 0, kv_lo * d, kv_hi * d),
                                               get(a + "v_proj.weight", 0, kv_lo * d, kv_hi * d)])),  # fmt: skip
                    q_norm_w=norm(a + "q_norm.weight") if config.qk_norm else None,
                    k_norm_w=norm(a + "k_norm.weight") if config.qk_norm else None,
                    o_w=gemm.pack(get(a + "o_proj.weight", 1, q_lo * d, q_hi * d)),
                    post_attn_norm_w=norms[1],
                    pre_ff_norm_w=norms[2],
                    post_ff_norm_w=norms[3],
                    gate_up_w=gemm.pack(torch.cat([get(m + "gate_proj.weight", 0, i_lo, i_hi),
                                                   get(m + "up_proj.weight", 0, i_lo, i_hi)])),  # fmt: skip
                    down_w=gemm.pack(get(m + "down_proj.weight", 1, i_lo, i_hi)),
                )
            )
        embed, lm_head = load_vocab(src, config, layout, get)
        return cls(layers, embed, lm_head, norm("model.norm.weight") if layout.is_last_stage else None)


class Gemma:
    def __init__(
        self, config: GemmaConfig, weights: GemmaWeights, ops: KernelOps,
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
        self.scale = config.query_pre_attn_scalar**-0.5
        dtype, device = weights.layers[0].input_norm_w.dtype, weights.layers[0].input_norm_w.device  # every stage has a layer
        # transformers multiplies by sqrt(hidden) rounded to the embedding's dtype
        self.embed_scale = torch.tensor(config.hidden_size**0.5, dtype=dtype, device=device)
        d, positions = config.head_dim, config.max_position_embeddings
        global_table = cos_sin_table(
            inverse_frequencies(d, config.rope_theta, config.rope_llama3, config.rope_linear), positions, device
        )
        local_table = global_table
        if config.rope_local_theta:  # Gemma 3: the local layers' own base, unscaled
            local_table = cos_sin_table(inverse_frequencies(d, config.rope_local_theta, None), positions, device)
        self.lora: LoRAStack | None = None  # the adapters' slots, with enable_lora (worker/lora_manager.py)
        # This stage's layers: (window, rope table) of each; a window marks a local layer.
        self.layer_attention = [
            (config.window(i), local_table if config.window(i) else global_table)
            for i in layout.layers(config.num_hidden_layers)
        ]

    def _head_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Gemma 3's RMSNorm over each head's vector ([T, heads, d])."""
        t, heads, d = x.shape
        normed, _ = self.ops.add_rmsnorm(x.reshape(t * heads, d), None, weight, self.config.rms_norm_eps)
        return normed.view(t, heads, d)

    @torch.inference_mode()
    def forward(
        self,
        stage_input: StageInput,
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        logits_indices: torch.Tensor,
    ) -> torch.Tensor:
        """As `Llama.forward`: [B, vocab] float32 logits on the last stage, else [2, T, hidden]."""
        cfg, w, ops = self.config, self.weights, self.ops
        t, d, eps = stage_input.input_ids.shape[0], cfg.head_dim, cfg.rms_norm_eps
        hq, hkv = self.num_heads, self.num_kv_heads
        softcap = cfg.attn_logit_softcapping
        if self.layout.is_first_stage:
            x = vocab_parallel_embed(stage_input.input_ids, w.embed, self.vocab_lo, self.tp) * self.embed_scale
            residual = None
        else:
            x, residual = stage_input.hidden.unbind(0)
        lora = self.lora.step(ops, stage_input.lora) if self.lora is not None else None
        layers = zip(w.layers, self.layer_attention, kv_caches, strict=True)
        for i, (layer, (window, cos_sin), (k_cache, v_cache)) in enumerate(layers):
            h, residual = ops.add_rmsnorm(x, residual, layer.input_norm_w, eps)
            qkv = gemm.linear(h, layer.qkv_w)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            q, k, v = qkv.split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if cfg.qk_norm:
                q, k = self._head_norm(q, layer.q_norm_w), self._head_norm(k, layer.k_norm_w)
            attn = ops.rotary_write_kv_attention(
                q, k, v, stage_input.positions, cos_sin, k_cache, v_cache, meta, self.scale, window, softcap
            ).reshape(t, hq * d)
            o = row_parallel_linear(attn, layer.o_w, None, self.tp, lora and lora.adder(i, "o"))
            x, _ = ops.add_rmsnorm(o, None, layer.post_attn_norm_w, eps)
            h, residual = ops.add_rmsnorm(x, residual, layer.pre_ff_norm_w, eps)
            gate_up = gemm.linear(h, layer.gate_up_w)
            if lora is not None:
                lora.add(i, "gate_up", h, gate_up)
            mlp = row_parallel_linear(ops.gelu_and_mul(gate_up), layer.down_w, None, self.tp, lora and lora.adder(i, "down"))
            x, _ = ops.add_rmsnorm(mlp, None, layer.post_ff_norm_w, eps)
        if not self.layout.is_last_stage:
            return torch.stack([x, residual if residual is not None else torch.zeros_like(x)])
        x, residual = x[logits_indices], residual[logits_indices]
        h, _ = ops.add_rmsnorm(x, residual, w.norm_w, eps)
        logits = self.tp.gather_vocab(gemm.linear(h, w.lm_head).float(), cfg.vocab_size)
        if cfg.final_logit_softcapping:
            cap = cfg.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits


def random_gemma_state_dict(config: GemmaConfig, seed: int, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Seeded random weights under Hugging Face's names (for presets): normal(0, initializer_range)
    matrices, norm weights near 0 (Gemma's norms weigh by 1 + w)."""
    gen = torch.Generator().manual_seed(seed)
    std = config.initializer_range
    h, d, inter = config.hidden_size, config.head_dim, config.intermediate_size
    hq, hkv = config.num_attention_heads * d, config.num_key_value_heads * d

    def normal(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen) * std).to(dtype)

    def norm(size: int) -> torch.Tensor:
        return (0.1 * torch.randn(size, generator=gen)).to(dtype)

    sd = {"model.embed_tokens.weight": normal(config.vocab_size, h), "model.norm.weight": norm(h)}
    if not config.tie_word_embeddings:
        sd["lm_head.weight"] = normal(config.vocab_size, h)
    for i in range(config.num_hidden_layers):
        p, a, m = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        sd |= {p + name + ".weight": norm(h) for name in NORMS}
        sd |= {
            a + "q_proj.weight": normal(hq, h), a + "k_proj.weight": normal(hkv, h), a + "v_proj.weight": normal(hkv, h),
            a + "o_proj.weight": normal(h, hq), m + "gate_proj.weight": normal(inter, h),
            m + "up_proj.weight": normal(inter, h), m + "down_proj.weight": normal(h, inter),
        }  # fmt: skip
        if config.qk_norm:
            sd |= {a + "q_norm.weight": norm(d), a + "k_norm.weight": norm(d)}
    return sd


MODEL_CODE = ModelCode(GemmaWeights, Gemma, gemma_key, random_gemma_state_dict)
