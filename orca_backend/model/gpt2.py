"""GPT-2 forward pass written for selective batching.

Every scheduled request's new tokens (whole prompts being prefilled and single decode tokens, any
mix) are one flat ``[num_tokens, hidden]`` tensor for embedding, LayerNorm, QKV, output projection,
MLP and GeLU: these ops do not care which request a token belongs to. Attention is the one op that
does, so it alone is split per request via `AttentionMetadata`, each request reading and appending
its own K/V region of the per-layer pool. Logits are computed only for each request's last token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from orca_backend.config import ModelConfig
from orca_kernels import AttentionMetadata, KernelOps


@dataclass
class LayerWeights:
    # Linear weights are stored [out, in] (torch.nn.Linear's layout), transposed from HF's Conv1D.
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor
    attn_out_w: torch.Tensor
    attn_out_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc_w: torch.Tensor
    fc_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor


@dataclass
class GPT2Weights:
    wte: torch.Tensor  # [vocab, hidden]; also the (tied) LM head
    wpe: torch.Tensor  # [positions, hidden]
    layers: list[LayerWeights]
    lnf_w: torch.Tensor
    lnf_b: torch.Tensor

    @classmethod
    def from_hf(cls, sd: dict[str, torch.Tensor], config: ModelConfig, dtype: torch.dtype, device: torch.device) -> GPT2Weights:
        def get(name: str, transpose: bool = False) -> torch.Tensor:
            if name not in sd:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            t = sd[name].t() if transpose else sd[name]
            return t.to(device=device, dtype=dtype).contiguous()

        layers = []
        for i in range(config.n_layer):
            p = f"transformer.h.{i}."
            layers.append(
                LayerWeights(
                    get(p + "ln_1.weight"), get(p + "ln_1.bias"),
                    get(p + "attn.c_attn.weight", True), get(p + "attn.c_attn.bias"),
                    get(p + "attn.c_proj.weight", True), get(p + "attn.c_proj.bias"),
                    get(p + "ln_2.weight"), get(p + "ln_2.bias"),
                    get(p + "mlp.c_fc.weight", True), get(p + "mlp.c_fc.bias"),
                    get(p + "mlp.c_proj.weight", True), get(p + "mlp.c_proj.bias"),
                )  # fmt: skip
            )
        weights = cls(get("transformer.wte.weight"), get("transformer.wpe.weight"), layers,
                      get("transformer.ln_f.weight"), get("transformer.ln_f.bias"))  # fmt: skip
        expected = (config.vocab_size, config.n_embd)
        if tuple(weights.wte.shape) != expected:
            raise ValueError(f"wte has shape {tuple(weights.wte.shape)}, config says {expected}")
        return weights


class GPT2:
    def __init__(self, config: ModelConfig, weights: GPT2Weights, ops: KernelOps) -> None:
        self.config = config
        self.weights = weights
        self.ops = ops
        self.scale = 1.0 / math.sqrt(config.head_dim)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T] the new tokens of every scheduled request, flattened
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # per layer: (k, v) pools [slots, heads, head_dim]
        logits_indices: torch.Tensor,  # [B] index of each request's last token in the flat batch
    ) -> torch.Tensor:
        cfg, w, ops = self.config, self.weights, self.ops
        num_tokens = input_ids.shape[0]
        x = w.wte[input_ids] + w.wpe[positions]
        residual = None
        for layer, (k_cache, v_cache) in zip(w.layers, kv_caches, strict=True):
            h, residual = ops.add_layernorm(x, residual, layer.ln1_w, layer.ln1_b, cfg.layer_norm_epsilon)
            qkv = F.linear(h, layer.qkv_w, layer.qkv_b).view(num_tokens, 3, cfg.n_head, cfg.head_dim)
            q, k, v = qkv.unbind(1)
            ops.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
            attn = ops.attention(q, k_cache, v_cache, meta, self.scale).reshape(num_tokens, cfg.n_embd)
            x = F.linear(attn, layer.attn_out_w, layer.attn_out_b)
            h, residual = ops.add_layernorm(x, residual, layer.ln2_w, layer.ln2_b, cfg.layer_norm_epsilon)
            h = ops.bias_gelu(F.linear(h, layer.fc_w), layer.fc_b)
            x = F.linear(h, layer.proj_w, layer.proj_b)
        # Only the last token of each request needs the final LayerNorm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        h, _ = ops.add_layernorm(x, residual, w.lnf_w, w.lnf_b, cfg.layer_norm_epsilon)
        return F.linear(h, w.wte).float()
