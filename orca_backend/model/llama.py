"""The Llama family's model code (Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen2-MoE, Qwen3-MoE): the
shared decoder (model/decoder.py) as it is, its differences all switches of `LlamaConfig` (q/k/v
and o biases, q/k norm, rope scaling, sliding windows, experts, FP8 weights)."""

from __future__ import annotations

import math

from orca_backend.families.llama import LlamaConfig
from orca_backend.model.decoder import Decoder, DecoderHooks, DecoderWeights
from orca_backend.model.registry import ModelCode


def llama_key(key: str) -> str | None:
    """Checkpoint keys are used as stored; rotary caches some exports carry are recomputed instead."""
    return None if key.endswith("rotary_emb.inv_freq") else key


class LlamaWeights(DecoderWeights):
    @staticmethod
    def hooks(config: LlamaConfig) -> DecoderHooks:
        """Pre-norms only, w as stored, SwiGLU, scores scaled by head_dim^-0.5."""
        return DecoderHooks(attn_scale=1.0 / math.sqrt(config.head_dim))


MODEL_CODE = ModelCode(LlamaWeights, Decoder, llama_key, LlamaWeights.random_state_dict)
