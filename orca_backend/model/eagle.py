"""An EAGLE head (speculative decoding's method "eagle", vLLM's EagleLlamaForCausalLM): a few Llama
decoder layers that predict the target's next token from the token and the target's own last
hidden state.

At position p the head takes the token at p + 1 and the target's hidden state at p (its final
norm's output), joins their vectors (the target's embedding of the token, then the hidden state:
`fc` maps the 2H back to H) and runs its layers at position p; its first layer has no input norm,
it has no final norm, and the target's LM head on its output names the token at p + 2. Where the
target has not run a position yet (the head's own later proposals), the head's output at the
position before stands in for the target's hidden state. HASS heads (`add_para_norm`) norm the two
vectors before joining them.

The checkpoint holds `fc` and the layers (`layers.N.*`, with or without a `model.` prefix, as
EAGLE's and vLLM's exports write them); an embedding or LM head in it is not read: the head shares
the target's, as vLLM does. The head runs in one process on the target's device, with its own K/V
pool (worker/eagle_proposer.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from orca_backend.distributed.layout import SINGLE_PROCESS
from orca_backend.families.llama import EagleHeadConfig, eagle_head_config
from orca_backend.model import gemm
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.decoder import Decoder
from orca_backend.model.llama import LlamaWeights
from orca_backend.model.stage_input import StageModel
from orca_kernels import AttentionMetadata, KernelOps

_OWN_NAMES = ("fc.", "embedding_layernorm.", "hidden_states_layernorm.")


def eagle_key(key: str) -> str | None:
    """A head's stored name -> the shared decoder's (model.layers.N.*), or None for what it shares
    with the target (embedding, LM head) and rotary caches."""
    if key.startswith(("embed_tokens.", "model.embed_tokens.", "lm_head.")) or key.endswith("rotary_emb.inv_freq"):
        return None
    key = key.removeprefix("model.")
    return key if key.startswith(_OWN_NAMES) else "model." + key


@dataclass
class EagleWeights(LlamaWeights):
    """The head's layers as the shared decoder holds them, and its own tensors."""

    fc_w: torch.Tensor | None = None  # [H, 2H]: (embedding, hidden state) -> H
    fc_b: torch.Tensor | None = None
    embed_norm_w: torch.Tensor | None = None  # HASS: the norms of the two inputs
    hidden_norm_w: torch.Tensor | None = None


class EagleHead(Decoder):
    def __init__(self, config: EagleHeadConfig, weights: EagleWeights, ops: KernelOps, embed: torch.Tensor,
                 lm_head: torch.Tensor) -> None:  # fmt: skip
        super().__init__(config.decoder, weights, ops)
        self.embed_table, self.lm_head_table = embed, lm_head  # the target's [vocab, H]

    @torch.inference_mode()
    def propose(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], last: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The head at `positions` on tokens `input_ids` [T] and the hidden states [T, H] before them:
        its output [T, H] (what stands in for the target's hidden state at the next position), and
        its greedy token at the rows `last` [R]."""
        cfg, w, ops, eps = self.config, self.weights, self.ops, self.config.rms_norm_eps
        t, d, hq, hkv = input_ids.shape[0], cfg.head_dim, self.num_heads, self.num_kv_heads
        embedded = F.embedding(input_ids, self.embed_table)
        hidden = hidden.to(embedded.dtype)
        if w.embed_norm_w is not None:
            embedded, _ = ops.add_rmsnorm(embedded, None, w.embed_norm_w, eps)
            hidden, _ = ops.add_rmsnorm(hidden, None, w.hidden_norm_w, eps)
        x = gemm.linear(torch.cat([embedded, hidden], dim=-1), w.fc_w, w.fc_b)
        residual = x
        layers = zip(w.layers, self.layer_attention, kv_caches, strict=True)
        for i, (layer, (window, cos_sin), (k_cache, v_cache)) in enumerate(layers):
            # The first layer has no input norm (EAGLE's design): it reads fc's output as it is.
            if i == 0:
                h = x
            else:
                h, residual = ops.add_rmsnorm(x, residual, layer.input_norm_w, eps)
            q, k, v = gemm.linear(h, layer.qkv_w, layer.qkv_b).split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if cfg.qk_norm:
                q, k = self._head_norm(q, layer.q_norm_w), self._head_norm(k, layer.k_norm_w)
            attn = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta,
                                                 self.hooks.attn_scale, window, 0.0).reshape(t, hq * d)  # fmt: skip
            h, residual = ops.add_rmsnorm(gemm.linear(attn, layer.o_w, layer.o_b), residual, layer.pre_mlp_norm_w, eps)
            x = gemm.linear(self.activation(gemm.linear(h, layer.gate_up_w)), layer.down_w)
        out = x + residual
        logits = gemm.linear(out.index_select(0, last), self.lm_head_table)
        return out, logits.argmax(dim=-1)


def load_eagle_head(head_dir: str, target: StageModel, dtype: torch.dtype, device: torch.device) -> EagleHead:
    """The head in `head_dir` over `target` (a single-process model), refusing, naming the field, a
    head that does not fit it."""
    path = Path(head_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config: the EAGLE head {head_dir!r} is not a checkpoint directory with a "
                         "config.json")  # fmt: skip
    config = eagle_head_config(json.loads((path / "config.json").read_text()), str(path / "config.json"))
    embed, lm_head = target.vocab_tables()
    hidden = config.decoder.hidden_size
    if hidden != embed.shape[1]:
        raise ValueError(f"speculative_config: the EAGLE head's hidden_size ({hidden}) is not the target's "
                         f"({embed.shape[1]})")  # fmt: skip
    source = WeightSource.from_dir(path, eagle_key)
    # What the shared decoder's loader asks for and the head does not have: the embedding (the
    # target's), and unit weights for the norms its forward never applies (its first layer's input
    # norm, the final norm).
    ones = torch.ones(hidden)
    filler = {"model.embed_tokens.weight": embed, "model.norm.weight": ones, "model.layers.0.input_layernorm.weight": ones}
    source = source.with_tensors({name: tensor for name, tensor in filler.items() if name not in source})
    weights = EagleWeights.load(source, config.decoder, SINGLE_PROCESS, dtype, device)
    weights.embed = weights.lm_head = weights.norm_w = None  # the target's tables serve (EagleHead)

    def own(name: str) -> torch.Tensor | None:
        return source.get(name).to(device=device, dtype=dtype).contiguous() if name in source else None

    fc_w = own("fc.weight")
    if fc_w is None or tuple(fc_w.shape) != (hidden, 2 * hidden):
        raise ValueError(f"{head_dir}: an EAGLE head needs fc.weight of shape [{hidden}, {2 * hidden}]"
                         f"{'' if fc_w is None else f', got {list(fc_w.shape)}'}")  # fmt: skip
    weights.fc_w, weights.fc_b = gemm.pack(fc_w), own("fc.bias")
    if config.input_norms:
        weights.embed_norm_w, weights.hidden_norm_w = own("embedding_layernorm.weight"), own("hidden_states_layernorm.weight")
        if weights.embed_norm_w is None or weights.hidden_norm_w is None:
            raise ValueError(f"{head_dir}: add_para_norm is set, but embedding_layernorm.weight or "
                             "hidden_states_layernorm.weight is missing")  # fmt: skip
    return EagleHead(config, weights, target.ops, embed, lm_head)
