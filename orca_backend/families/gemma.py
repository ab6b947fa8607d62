"""Gemma 2 and Gemma 3 (text): the Llama-style decoder with Gemma's differences. Its config
(`GemmaConfig`, a LlamaConfig), what each architecture reads differently, its config.json parsing
and presets; tensor-parallel dimensions and LoRA targets are the Llama family's. The model code is
model/gemma.py."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from orca_backend.families import Family
from orca_backend.families.llama import (
    FULL,
    LORA,
    SLIDING,
    Architecture,
    LlamaConfig,
    rope_fields,
    tp_divisible,
    window_fields,
)


def _every_other_layer(raw: dict[str, Any], layers: int) -> list[str]:
    """Gemma 2 windows the layers layer_types names, by default every other one."""
    return raw.get("layer_types") or [SLIDING if (i + 1) % 2 else FULL for i in range(layers)]


def _sliding_window_pattern(raw: dict[str, Any], layers: int) -> list[str]:
    """Gemma 3 windows the layers layer_types names, by default all but every sliding_window_pattern-th (5 of 6)."""
    pattern = int(raw.get("sliding_window_pattern", 6))
    return raw.get("layer_types") or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("Gemma2ForCausalLM", layer_types=_every_other_layer),
    Architecture("Gemma3ForCausalLM", qk_norm=True, layer_types=_sliding_window_pattern, rope_local=True),
)}  # fmt: skip


@dataclass(frozen=True)
class GemmaConfig(LlamaConfig):
    """Gemma 2 and Gemma 3 (text): the Llama-style decoder with Gemma's differences (model/gemma.py):
    embeddings scaled by sqrt(hidden_size), RMSNorm weights applied as (1 + w), a GeGLU MLP (tanh
    GELU), norms before and after both attention and MLP, scores scaled by query_pre_attn_scalar^-0.5,
    local (sliding-window) and global layers; Gemma 2 soft-caps the attention scores and the final
    logits, Gemma 3 normalises q and k per head (`qk_norm`) and gives its local layers their own
    rope base (`rope_local_theta`; the global layers' is rope_theta, with its scaling)."""

    architecture: str = "Gemma2ForCausalLM"
    query_pre_attn_scalar: float = 256.0
    attn_logit_softcapping: float = 0.0  # 0: none
    final_logit_softcapping: float = 0.0
    rope_local_theta: float = 0.0  # 0: the local layers use rope_theta as the global ones do

    def num_parameters(self) -> int:
        norms = self.num_hidden_layers * (2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0))
        return super().num_parameters() + norms

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str) -> GemmaConfig:
        arch = raw["architectures"][0]
        spec = ARCHITECTURES[arch]
        activation = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
        if activation != "gelu_pytorch_tanh":
            raise ValueError(f"{source}: hidden_activation {activation!r} is not supported (gelu_pytorch_tanh is)")
        if raw.get("use_bidirectional_attention"):
            raise ValueError(f"{source}: use_bidirectional_attention is not supported (a causal decoder is served)")
        if raw.get("attention_bias"):
            raise ValueError(f"{source}: attention_bias=true is not supported")
        rope = raw.get("rope_parameters") or {}
        local: dict[str, Any] = {}
        if "full_attention" in rope:  # Gemma 3 as transformers 5 writes it: one entry per layer type
            local, rope = rope.get("sliding_attention") or {}, rope["full_attention"]
        elif raw.get("rope_scaling"):
            rope = raw["rope_scaling"]
        fields = rope_fields(rope, raw, source)
        if spec.rope_local:
            local_fields = rope_fields(local, {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}, source)
            if set(local_fields) != {"rope_theta"}:
                raise ValueError(f"{source}: scaled rope on the sliding layers is not supported")
            fields["rope_local_theta"] = local_fields["rope_theta"]
        heads = raw["num_attention_heads"]
        eos = raw.get("eos_token_id")
        soft = {name: float(raw.get(name) or 0.0) for name in ("attn_logit_softcapping", "final_logit_softcapping")}
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=raw["hidden_size"],
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            max_position_embeddings=raw.get("max_position_embeddings", 8192),
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            qk_norm=spec.qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            initializer_range=raw.get("initializer_range", 0.02),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            **soft,
            **fields,
            **window_fields(raw, spec),
        )


PRESETS: dict[str, GemmaConfig] = {
    # Gemma 2 (alternating local/global layers, soft-capping) and Gemma 3 (5 local : 1 global, q/k norm,
    # a local rope base), with 32-token windows
    "gemma2-tiny": GemmaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                               initializer_range=0.3, tie_word_embeddings=True, query_pre_attn_scalar=16.0,
                               attn_logit_softcapping=50.0, final_logit_softcapping=30.0, sliding_window=32,
                               layer_types=(SLIDING, FULL) * 2),
    "gemma3-tiny": GemmaConfig(architecture="Gemma3ForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=160,
                               num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               max_position_embeddings=256, initializer_range=0.3, tie_word_embeddings=True,
                               query_pre_attn_scalar=16.0, qk_norm=True, rope_theta=1000000.0,
                               rope_local_theta=10000.0, sliding_window=32, layer_types=(SLIDING,) * 5 + (FULL,)),
}

FAMILY = Family(
    name="gemma",
    config_class=GemmaConfig,
    architectures=tuple(ARCHITECTURES),
    from_hf_dict=GemmaConfig.from_hf_dict,
    presets=PRESETS,
    tp_divisible=tp_divisible,
    lora=LORA,
    model="orca_backend.model.gemma",
)
