"""Gemma 2 and Gemma 3 (text): the shared decoder (model/decoder.py) with Gemma's hooks.

Gemma's differences (families.gemma.GemmaConfig): the embedding is scaled by sqrt(hidden); every
RMSNorm weighs by (1 + w), folded into the stored weight at load; each of attention and the MLP has
a norm before and after it (four per layer), the MLP is GeGLU (tanh GELU of the gate times up);
scores are scaled by query_pre_attn_scalar^-0.5 and, on Gemma 2, soft-capped, as are its final
logits. Local layers attend within a sliding window and global layers to the whole context (the
config's windows, as for the Llama family); Gemma 3 gives its local layers their own rope base and
normalises q and k per head (the config's qk_norm).

The post-norms sit between a sublayer and the residual add, so the residual stream is carried as
Llama's is (`add_rmsnorm(x, residual)` returns the norm of the sum and the sum): the post-norm of
attention feeds the pre-norm of the MLP as its `x`, and the post-norm of the MLP the next layer's
input norm.
"""

from __future__ import annotations

from orca_backend.families.gemma import GemmaConfig
from orca_backend.model.decoder import Decoder, DecoderHooks, DecoderWeights
from orca_backend.model.registry import ModelCode


def gemma_key(key: str) -> str | None:
    return key


class GemmaWeights(DecoderWeights):
    @staticmethod
    def hooks(config: GemmaConfig) -> DecoderHooks:
        return DecoderHooks(
            attn_scale=config.query_pre_attn_scalar**-0.5,
            pre_attn_norm="input_layernorm",
            post_attn_norm="post_attention_layernorm",
            pre_mlp_norm="pre_feedforward_layernorm",
            post_mlp_norm="post_feedforward_layernorm",
            norm_offset=1.0,
            embed_scale=config.hidden_size**0.5,
            activation="gelu_and_mul",
            attn_softcap=config.attn_logit_softcapping,
            final_softcap=config.final_logit_softcapping,
            rope_local_theta=config.rope_local_theta,
        )


MODEL_CODE = ModelCode(GemmaWeights, Decoder, gemma_key, GemmaWeights.random_state_dict)
