"""The Llama-style decoder's family: Llama, Mistral, Qwen2, Qwen3 and the mixture-of-experts models
Mixtral, Qwen2-MoE and Qwen3-MoE. Its config (`LlamaConfig`), what each architecture reads
differently (`ARCHITECTURES`), its config.json parsing (FP8 fields too), presets, tensor-parallel
dimensions and LoRA targets. The model code is model/llama.py; families/gemma.py builds on this."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

from orca_backend.families import Family, LoRATargets, Projection, Shard
from orca_backend.quantization import METHODS, quantization_fields

SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


@dataclass(frozen=True)
class Architecture:
    """One config.json `architectures` name served by the Llama-style decoder (Gemma's too), and the
    switches its config.json leaves implicit: transformers' model code for it decides them."""

    name: str
    qkv_bias: bool = False  # q, k and v always biased, o never (Qwen2); else attention_bias biases all four
    qk_norm: bool = False  # RMSNorm over each head of q and k before the rotation (Qwen3, Gemma 3)
    # Mixture-of-experts, and under whose names (config.json's fields, the experts' tensors): "mixtral"
    # or "qwen"; "" for a dense model.
    moe: str = ""
    norm_topk_prob: bool = False  # Qwen MoE: whether the top k's weights are renormalised if config.json does not say
    # Which layers a sliding window applies to, given config.json and the layer count (None: the model code
    # has no window); with `window_flag`, only when config.json sets use_sliding_window (Qwen).
    layer_types: Callable[[dict[str, Any], int], list[str]] | None = None
    window_flag: bool = False
    rope_local: bool = False  # the sliding layers have a rope base of their own, rope_local_base_freq (Gemma 3)


def _every_layer(raw: dict[str, Any], layers: int) -> list[str]:
    """Mistral, Mixtral and Qwen3-MoE window every layer (config.json's layer_types aside)."""
    return [SLIDING] * layers


def _from_max_window_layers(raw: dict[str, Any], layers: int) -> list[str]:
    """Qwen2, Qwen3 and Qwen2-MoE window the layers layer_types names, by default those from max_window_layers on."""
    first = raw.get("max_window_layers", layers)
    return raw.get("layer_types") or [SLIDING if i >= first else FULL for i in range(layers)]


ARCHITECTURES: dict[str, Architecture] = {a.name: a for a in (
    Architecture("LlamaForCausalLM"),  # Llama's model code has no window
    Architecture("MistralForCausalLM", layer_types=_every_layer),
    Architecture("Qwen2ForCausalLM", qkv_bias=True, layer_types=_from_max_window_layers, window_flag=True),
    Architecture("Qwen3ForCausalLM", qk_norm=True, layer_types=_from_max_window_layers, window_flag=True),
    Architecture("MixtralForCausalLM", moe="mixtral", layer_types=_every_layer),
    Architecture("Qwen2MoeForCausalLM", qkv_bias=True, moe="qwen", layer_types=_from_max_window_layers,
                 window_flag=True),
    Architecture("Qwen3MoeForCausalLM", qk_norm=True, moe="qwen", norm_topk_prob=True, layer_types=_every_layer,
                 window_flag=True),
)}  # fmt: skip
MOE_ARCHITECTURES = tuple(name for name, arch in ARCHITECTURES.items() if arch.moe)


@dataclass(frozen=True)
class LlamaConfig:
    """One decoder for Llama, Mistral, Qwen2 and Qwen3: RMSNorm, rotary positions, SwiGLU MLP and
    grouped-query attention, with the switches those families differ by. Names as in Hugging Face's
    configs; `from_hf_dict` maps each family's spelling of a switch onto them."""

    architecture: str = "LlamaForCausalLM"
    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int = 4
    head_dim: int = 64
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # llama3 frequency scaling as (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None = None
    rope_linear: float = 1.0  # rope_type "linear": positions divided by this factor
    # yarn as (factor, original_max_position_embeddings, beta_fast, beta_slow, truncate)
    rope_yarn: tuple[float, int, float, float, bool] | None = None
    rope_dynamic: float = 1.0  # rope_type "dynamic" (NTK): its factor (1: none); max_position_embeddings is the original window
    # longrope: the original window (0: not longrope), and each frequency's divisor within it and beyond it
    rope_longrope_window: int = 0
    rope_short_factor: tuple[float, ...] = ()
    rope_long_factor: tuple[float, ...] = ()
    rope_attention_factor: float = 1.0  # cos and sin times this (yarn's mscale, longrope's), as transformers does
    qkv_bias: bool = False  # Qwen2 always; Llama and Qwen3 with attention_bias
    o_bias: bool = False  # Llama and Qwen3 with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k before the rotation
    tie_word_embeddings: bool = False
    eos_token_id: int | None = None
    initializer_range: float = 0.02
    # An FP8 checkpoint (quant_method "fp8", e4m3; model/fp8.py), and its scale blocks (out, in)
    # (None: one scale per tensor).
    fp8: bool = False
    fp8_block: tuple[int, int] | None = None
    # An integer weight checkpoint (model/int_quant.py): its format (orca_backend/quantization.py's
    # INT_FORMATS; "" for none), bits, columns per scale group (0: one group per row), whether it
    # has zero points of its own, and whether its groups follow g_idx (GPTQ's desc_act).
    int_format: str = ""
    int_bits: int = 0
    int_group: int = 0
    int_symmetric: bool = True
    int_act_order: bool = False
    # W8A8 (compressed-tensors): "int8" (int-quantized int8 weights) or "fp8" (FP8 weights): the
    # projections' activations are quantized per token as the model runs (kernels' w8a8.py); "": none.
    act_quant: str = ""
    # The quantization_config declares FP8 K/V scales (compressed-tensors' kv_cache_scheme): each
    # attention's k_scale and v_scale are in the checkpoint (model/kv_scales.py).
    kv_scales: bool = False
    # Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE): `num_experts` SwiGLU experts of
    # moe_intermediate_size per MoE layer, each token routed to its top `num_experts_per_tok`, their
    # weights renormalised when `norm_topk_prob`; Qwen2-MoE adds a gated shared expert. MoE layers:
    # every `decoder_sparse_step`-th, except `mlp_only_layers` (dense, of intermediate_size).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # Sliding-window attention: the layers whose `layer_types` entry is "sliding_attention" attend to
    # their last `sliding_window` positions only (kernels/orca_kernels/attention.py). Empty
    # layer_types: no window.
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} are not all {SLIDING!r} or {FULL!r}")
        if SLIDING in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"sliding layers need a sliding_window >= 1, got {self.sliding_window}")
        for name in ("rope_short_factor", "rope_long_factor"):
            if self.rope_longrope_window and len(getattr(self, name)) != self.head_dim // 2:
                raise ValueError(f"longrope's {name.removeprefix('rope_')} has {len(getattr(self, name))} entries, "
                                 f"not head_dim / 2 = {self.head_dim // 2}")  # fmt: skip

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.num_experts) and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0

    def window(self, layer: int) -> int:
        """The attention window of a layer (0: it sees the whole context)."""
        return self.sliding_window if self.layer_types and self.layer_types[layer] == SLIDING else 0

    @property
    def kv_window(self) -> int:
        """The window every layer attends within, or 0 if some layer sees the whole context: K/V
        positions before it are needed by no layer, so their blocks may be freed as a request grows."""
        if self.layer_types and all(t == SLIDING for t in self.layer_types):
            return self.sliding_window
        return 0

    @property
    def max_context(self) -> int:
        """The longest context served: max_position_embeddings, or the window a yarn or dynamic rope's
        factor extends the original one to where that is longer (Qwen2.5's long-context config keeps
        max_position_embeddings at its original 32k; dynamic NTK takes max_position_embeddings to be
        the original window). The rope table has this many rows (model/rope.py)."""
        if self.rope_yarn is not None:
            factor, original_context = self.rope_yarn[:2]
            return max(self.max_position_embeddings, int(factor * original_context))
        return int(self.max_position_embeddings * self.rope_dynamic)

    @property
    def num_layers(self) -> int:
        return self.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return self.num_key_value_heads

    def num_parameters(self) -> int:
        h, d = self.hidden_size, self.head_dim
        attn = h * d * (self.num_attention_heads * 2 + self.num_key_value_heads * 2)
        experts = 3 * h * (self.moe_intermediate_size * self.num_experts + self.shared_expert_intermediate_size)
        total = 0
        for layer in range(self.num_hidden_layers):
            mlp = experts + h * self.num_experts if self.is_moe_layer(layer) else 3 * h * self.intermediate_size
            total += attn + mlp + 2 * h
        embed = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return embed + total + h

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str) -> LlamaConfig:
        """Maps a Llama/Mistral/Qwen2/Qwen3 config.json onto this decoder, refusing, with the field named,
        anything it would not compute faithfully."""
        arch = raw["architectures"][0]
        spec = ARCHITECTURES[arch]
        for key in ("num_local_experts", "num_experts", "moe_intermediate_size"):
            if raw.get(key) and not spec.moe:
                raise ValueError(f"{source}: {key}={raw[key]!r}: mixture-of-experts is served for "
                                 f"{', '.join(MOE_ARCHITECTURES)} only")  # fmt: skip
        if raw.get("hidden_act", "silu") != "silu":
            raise ValueError(f"{source}: hidden_act {raw['hidden_act']!r} is not supported; only silu (SwiGLU) is")
        if raw.get("mlp_bias"):
            raise ValueError(f"{source}: mlp_bias=true is not supported")
        if raw.get("pretraining_tp", 1) not in (1, None):
            raise ValueError(f"{source}: pretraining_tp={raw['pretraining_tp']!r} is not supported")
        heads = raw["num_attention_heads"]
        hidden = raw["hidden_size"]
        max_pos = raw.get("max_position_embeddings", 2048)
        rope = rope_fields(raw.get("rope_parameters") or raw.get("rope_scaling") or {}, raw, source)
        if raw.get("partial_rotary_factor", 1.0) != 1.0:
            raise ValueError(f"{source}: partial_rotary_factor={raw['partial_rotary_factor']!r} is not supported")
        attention_bias = bool(raw.get("attention_bias", False))
        eos = raw.get("eos_token_id")
        return cls(
            architecture=arch,
            vocab_size=raw["vocab_size"],
            hidden_size=hidden,
            intermediate_size=raw["intermediate_size"],
            num_hidden_layers=raw["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads") or heads,
            head_dim=raw.get("head_dim") or hidden // heads,
            max_position_embeddings=max_pos,
            rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            **rope,
            qkv_bias=spec.qkv_bias or attention_bias,
            o_bias=not spec.qkv_bias and attention_bias,
            qk_norm=spec.qk_norm,
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,  # the engine stops on the first EOS id
            initializer_range=raw.get("initializer_range", 0.02),
            **_moe_fields(raw, spec),
            **window_fields(raw, spec),
        )


def _moe_fields(raw: dict[str, Any], spec: Architecture) -> dict[str, Any]:
    """The mixture-of-experts switches under each architecture's names (none for a dense model)."""
    if spec.moe == "mixtral":
        return {"num_experts": int(raw["num_local_experts"]), "num_experts_per_tok": int(raw["num_experts_per_tok"]),
                "moe_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True}  # fmt: skip
    if spec.moe == "qwen":
        return {
            # transformers 5 writes Qwen3-MoE's count as num_local_experts; the released configs say num_experts
            "num_experts": int(raw.get("num_experts") or raw["num_local_experts"]),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", spec.norm_topk_prob)),
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
            "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
            "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        }  # fmt: skip
    return {}


def rope_fields(rope: dict[str, Any], raw: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_theta and the frequency scaling of one rope_parameters / rope_scaling entry, with the values
    transformers' rope init functions default to (modeling_rope_utils.py) filled in: an entry's
    original_max_position_embeddings defaults to max_position_embeddings (transformers reads no
    top-level one for these families), yarn's and longrope's factor to their ratio, the attention
    factor to yarn's mscale or longrope's sqrt(1 + ln(factor) / ln(original))."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    fields: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))}
    if rope_type == "llama3":
        fields["rope_llama3"] = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                                 _original_window(rope, raw, source))  # fmt: skip
    elif rope_type == "linear":
        fields["rope_linear"] = float(rope["factor"])
    elif rope_type == "dynamic":
        fields["rope_dynamic"] = float(rope["factor"])
        if fields["rope_dynamic"] < 1.0:
            raise ValueError(f"{source}: rope factor {rope['factor']!r} of rope type 'dynamic' is under 1")
    elif rope_type == "yarn":
        original = _original_window(rope, raw, source)
        factor = _scaling_factor(rope, raw, original, source)
        fields["rope_yarn"] = (factor, original, float(rope.get("beta_fast") or 32), float(rope.get("beta_slow") or 1),
                               bool(rope.get("truncate", True)))  # fmt: skip
        fields["rope_attention_factor"] = _yarn_attention_factor(rope, factor)
    elif rope_type == "longrope":
        original = _original_window(rope, raw, source)
        for key in ("short_factor", "long_factor"):
            if not isinstance(rope.get(key), list):
                raise ValueError(f"{source}: rope type 'longrope' needs {key}, a list of head_dim / 2 numbers")
        factor = _scaling_factor(rope, raw, original, source)
        attention = rope.get("attention_factor")
        if attention is None:
            attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
        fields |= {"rope_longrope_window": original, "rope_attention_factor": float(attention),
                   "rope_short_factor": tuple(float(x) for x in rope["short_factor"]),
                   "rope_long_factor": tuple(float(x) for x in rope["long_factor"])}  # fmt: skip
    elif rope_type != "default":
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported "
                         f"(default, linear, llama3, yarn, dynamic and longrope are)")  # fmt: skip
    return fields


def _original_window(rope: dict[str, Any], raw: dict[str, Any], source: str) -> int:
    """A scaled rope's original_max_position_embeddings: its entry's, else max_position_embeddings."""
    original = rope.get("original_max_position_embeddings") or raw.get("max_position_embeddings")
    if not original:
        raise ValueError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} needs "
                         "original_max_position_embeddings (or max_position_embeddings)")  # fmt: skip
    return int(original)


def _scaling_factor(rope: dict[str, Any], raw: dict[str, Any], original: int, source: str) -> float:
    """yarn's or longrope's factor: the entry's, else max_position_embeddings / original (Phi-3's way)."""
    factor = rope.get("factor") or raw.get("max_position_embeddings", 0) / original
    if not factor:
        raise ValueError(f"{source}: rope type {rope.get('rope_type', rope.get('type'))!r} needs a factor")
    return float(factor)


def _yarn_attention_factor(rope: dict[str, Any], factor: float) -> float:
    """yarn's attention factor: the entry's attention_factor, else 0.1 ln(factor) + 1, or the ratio of
    that for mscale and for mscale_all_dim (each 0.1 m ln(factor) + 1) where both are given."""

    def mscale(m: float) -> float:
        return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

    if rope.get("attention_factor") is not None:
        return float(rope["attention_factor"])
    if rope.get("mscale") and rope.get("mscale_all_dim"):
        return mscale(rope["mscale"]) / mscale(rope["mscale_all_dim"])
    return mscale(1.0)


def window_fields(raw: dict[str, Any], spec: Architecture) -> dict[str, Any]:
    """Which layers attend within a sliding window, as transformers' model code decides for each
    architecture (`Architecture.layer_types`, `window_flag`)."""
    window, layers = raw.get("sliding_window"), raw["num_hidden_layers"]
    unknown = sorted(set(raw.get("layer_types") or ()) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported ({SLIDING!r} and {FULL!r} are)")
    if not window or (spec.window_flag and not raw.get("use_sliding_window")) or spec.layer_types is None:
        return {}
    layer_types = spec.layer_types(raw, layers)
    if SLIDING not in layer_types:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(layer_types)}


def from_hf(raw: dict[str, Any], source: str) -> LlamaConfig:
    """The family's config for a config.json, with its quantization fields: the registry has already
    refused any quantization_config method the family does not serve (families/__init__.py)."""
    config = LlamaConfig.from_hf_dict(raw, source)
    quantization = raw.get("quantization_config")
    if not quantization:
        return config
    fields = quantization_fields(quantization, source)
    if fields.get("fp8") and config.num_experts:
        raise ValueError(f"{source}: FP8 mixture-of-experts checkpoints are not served (FP8 is, for dense models)")
    if fields.get("act_quant") and config.num_experts:
        raise ValueError(f"{source}: W8A8 mixture-of-experts checkpoints are not served (W8A8 is, for dense models)")
    return replace(config, **fields)


# EAGLE heads (speculative_config methods "eagle" and "eagle3"): a few Llama decoder layers over the
# target's hidden states, under vLLM's architecture names and that of EAGLE's own exports (a plain
# Llama config for EAGLE-1).
EAGLE_HEAD_ARCHITECTURES = {
    "eagle": ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle", "LlamaForCausalLM"),
    "eagle3": ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3"),
}


@dataclass(frozen=True)
class EagleHeadConfig:
    """An EAGLE head's config.json: its layers' geometry as a LlamaConfig, and what its method adds.
    EAGLE-1: whether it norms its two inputs before joining them (HASS heads' add_para_norm).
    EAGLE-3: the target layers whose input hidden states it joins (None: vLLM's default, layers 2,
    L // 2 and L - 3 of an L-layer target), the target's hidden size, and whether its first layer's
    residual is the normed hidden state (norm_before_residual). (Its own vocabulary's size is its
    LM head's, model/eagle.py.)"""

    decoder: LlamaConfig
    input_norms: bool = False
    aux_layers: tuple[int, ...] | None = None
    target_hidden_size: int = 0
    norm_before_residual: bool = False


def eagle_head_config(raw: dict[str, Any], source: str, method: str) -> EagleHeadConfig:
    """An EAGLE head's config, refusing one this engine would not run as vLLM does."""
    arch = (raw.get("architectures") or ["LlamaForCausalLM"])[0]
    if arch not in EAGLE_HEAD_ARCHITECTURES[method]:
        raise ValueError(f"{source}: architecture {arch!r} is not a head of method {method!r} (served: "
                         f"{', '.join(EAGLE_HEAD_ARCHITECTURES[method])})")  # fmt: skip
    if raw.get("quantization_config"):
        raise ValueError(f"{source}: a quantized EAGLE head is not served")
    decoder = LlamaConfig.from_hf_dict({**raw, "architectures": ["LlamaForCausalLM"]}, source)
    if method == "eagle":
        return EagleHeadConfig(decoder, input_norms=bool(raw.get("add_para_norm", False)))
    eagle = raw.get("eagle_config") or {}
    if eagle.get("use_aux_hidden_state", True) is False:
        raise ValueError(f"{source}: an EAGLE-3 head without auxiliary hidden states (use_aux_hidden_state "
                         "false) is not served")  # fmt: skip
    layers = eagle.get("eagle_aux_hidden_state_layer_ids")
    if layers is not None and (len(layers) != 3 or not all(isinstance(i, int) and i >= 0 for i in layers)):
        raise ValueError(f"{source}: eagle_aux_hidden_state_layer_ids must name three layers, got {layers!r}")
    return EagleHeadConfig(decoder, aux_layers=tuple(layers) if layers is not None else None,
                           target_hidden_size=int(raw.get("target_hidden_size") or decoder.hidden_size),
                           norm_before_residual=bool(raw.get("norm_before_residual", False)))  # fmt: skip


def hf_moe_fields(config: LlamaConfig) -> dict[str, Any]:
    """The mixture-of-experts fields of config.json under the architecture's names, as `_moe_fields`
    reads them back (none for a dense model; benchmarks build transformers' model from them)."""
    spec = ARCHITECTURES.get(config.architecture)
    if spec is not None and spec.moe == "mixtral":
        return dict(num_local_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                    intermediate_size=config.moe_intermediate_size)  # fmt: skip
    if spec is not None and spec.moe == "qwen":
        return dict(num_experts=config.num_experts, num_experts_per_tok=config.num_experts_per_tok,
                    moe_intermediate_size=config.moe_intermediate_size, norm_topk_prob=config.norm_topk_prob,
                    decoder_sparse_step=config.decoder_sparse_step, mlp_only_layers=list(config.mlp_only_layers),
                    shared_expert_intermediate_size=config.shared_expert_intermediate_size)  # fmt: skip
    return {}


def expert_names(config: LlamaConfig) -> tuple[str, tuple[str, str, str]]:
    """Where a MoE layer's checkpoint holds its experts: the module under the layer that holds the
    router (`gate`) and the experts, and each expert's gate, up and down projections. Mixtral names
    them block_sparse_moe.experts.E.w1 / w3 / w2, the Qwen MoE families mlp.experts.E.gate_proj /
    up_proj / down_proj."""
    if ARCHITECTURES[config.architecture].moe == "mixtral":
        return "block_sparse_moe", ("w1", "w3", "w2")
    return "mlp", ("gate_proj", "up_proj", "down_proj")


PRESETS: dict[str, LlamaConfig] = {
    # ~150M parameters of Llama geometry (GQA 12/4) for CPU benchmarks
    "llama-150m": LlamaConfig(),
    "llama-tiny": LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                              initializer_range=0.3),
    "mixtral-tiny": LlamaConfig(architecture="MixtralForCausalLM", vocab_size=512, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                max_position_embeddings=256, initializer_range=0.3, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=96),
    "qwen2-moe-tiny": LlamaConfig(architecture="Qwen2MoeForCausalLM", vocab_size=512, hidden_size=64,
                                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=256, initializer_range=0.3, qkv_bias=True,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=False,
                                  shared_expert_intermediate_size=48),
    # A small Mixtral for CPU benchmarks: 8 experts, top 2, ~140M parameters of which ~45M active per token
    "mixtral-small": LlamaConfig(architecture="MixtralForCausalLM", vocab_size=32000, hidden_size=512,
                                 intermediate_size=1024, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                                 head_dim=64, max_position_embeddings=2048, num_experts=8, num_experts_per_tok=2,
                                 moe_intermediate_size=1024),
    "qwen3-moe-tiny": LlamaConfig(architecture="Qwen3MoeForCausalLM", vocab_size=512, hidden_size=64,
                                  intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  head_dim=16, max_position_embeddings=256, initializer_range=0.3, qk_norm=True,
                                  num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, mlp_only_layers=(1,)),
    # Mistral with a 32-token sliding window on every layer: long requests hold ~3 blocks of 16
    "mistral-sw-tiny": LlamaConfig(architecture="MistralForCausalLM", vocab_size=512, hidden_size=64,
                                   intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                                   initializer_range=0.3, sliding_window=32, layer_types=(SLIDING, SLIDING)),
    # Qwen2.5-0.5B geometry (its config.json): GQA 14/2, biased q/k/v, tied embeddings, 152k vocabulary
    "qwen2.5-0.5b": LlamaConfig(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
                                intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                                rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                                eos_token_id=151643),
}


def tp_divisible(config: LlamaConfig) -> list[tuple[str, int]]:
    """What each tensor-parallel rank holds an equal share of: the attention heads, the KV heads (never
    replicated), the MLP width and the experts' widths (0 when there are none)."""
    return [("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", config.num_key_value_heads),
            ("intermediate_size", config.intermediate_size), ("moe_intermediate_size", config.moe_intermediate_size),
            ("shared_expert_intermediate_size", config.shared_expert_intermediate_size)]  # fmt: skip


# LoRA: PEFT's module names (relative to a layer) -> (projection, slice). The checkpoint's q_proj, k_proj
# and v_proj are three slices of the engine's fused qkv, gate_proj and up_proj two of gate_up.
PEFT_MODULES = {"self_attn.q_proj": ("qkv", 0), "self_attn.k_proj": ("qkv", 1), "self_attn.v_proj": ("qkv", 2),
                "self_attn.o_proj": ("o", 0), "mlp.gate_proj": ("gate_up", 0), "mlp.up_proj": ("gate_up", 1),
                "mlp.down_proj": ("down", 0)}  # fmt: skip


def lora_projections(config: LlamaConfig) -> dict[str, Projection]:
    h, d, i = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * d, config.num_key_value_heads * d
    return {"qkv": Projection("qkv", ((h, q), (h, kv), (h, kv)), False), "o": Projection("o", ((q, h),), True),
            "gate_up": Projection("gate_up", ((h, i), (h, i)), False), "down": Projection("down", ((i, h),), True)}  # fmt: skip


def lora_output_rows(config: LlamaConfig, shard: Shard, name: str, index: int) -> list[tuple[int, int]]:
    """The rows of a column-parallel slice's output this rank holds, as its base weight's shard."""
    d = config.head_dim
    if name == "qkv":
        heads = config.num_attention_heads if index == 0 else config.num_key_value_heads
        lo, hi = shard(heads)
        return [(lo * d, hi * d)]
    return [shard(config.intermediate_size)]  # gate_up


def lora_input_columns(config: LlamaConfig, shard: Shard, name: str) -> tuple[int, int]:
    """The columns of a row-parallel projection's input this rank holds."""
    if name == "o":
        lo, hi = shard(config.num_attention_heads)
        return lo * config.head_dim, hi * config.head_dim
    return shard(config.intermediate_size)


LORA = LoRATargets(lora_projections, PEFT_MODULES, "base_model.model.model.layers", False, lora_output_rows,
                   lora_input_columns)  # fmt: skip

FAMILY = Family(
    name="llama",
    config_class=LlamaConfig,
    architectures=tuple(ARCHITECTURES),
    from_hf_dict=from_hf,
    presets=PRESETS,
    tp_divisible=tp_divisible,
    lora=LORA,
    model="orca_backend.model.llama",
    quant_methods=METHODS,
)
