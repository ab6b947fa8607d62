"""Configuration dataclasses: the model geometry and the engine's tuning knobs.

Every knob a deployment tunes is also a config.pbtxt `parameters` entry (see
`EngineConfig.from_parameters`), so the offline API and the Triton model share one definition.
Plain data only: importing this module must not import torch (the client and orca-serve read it).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any, ClassVar

DTYPES = ("float32", "bfloat16", "float16")  # torch dtypes by name: see orca_backend.model.device


@dataclass(frozen=True)
class ModelConfig:
    """GPT-2 family geometry, named as in Hugging Face's GPT2Config."""

    architecture: ClassVar[str] = "GPT2LMHeadModel"
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    layer_norm_epsilon: float = 1e-5
    eos_token_id: int | None = 50256
    initializer_range: float = 0.02

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def n_inner(self) -> int:
        return 4 * self.n_embd

    # The names the engine uses for every family.
    @property
    def max_context(self) -> int:
        return self.n_positions

    @property
    def hidden_size(self) -> int:
        return self.n_embd

    @property
    def num_layers(self) -> int:
        return self.n_layer

    @property
    def num_kv_heads(self) -> int:
        return self.n_head

    @property
    def kv_window(self) -> int:
        return 0  # GPT-2 attends to the whole context

    def num_parameters(self) -> int:
        per_layer = 12 * self.n_embd * self.n_embd + 13 * self.n_embd
        return self.vocab_size * self.n_embd + self.n_positions * self.n_embd + self.n_layer * per_layer + 2 * self.n_embd

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str) -> ModelConfig:
        unsupported = {
            "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False,
            "scale_attn_weights": True,
            "add_cross_attention": False,
        }
        for key, expected in unsupported.items():
            if raw.get(key, expected) != expected:
                raise ValueError(f"{source}: {key}={raw[key]!r} is not supported (expected {expected!r})")
        activation = raw.get("activation_function", "gelu_new")
        if activation not in ("gelu_new", "gelu_pytorch_tanh"):
            raise ValueError(f"{source}: activation_function {activation!r} is not supported; only tanh GeLU is")
        if raw.get("n_inner") not in (None, 4 * raw.get("n_embd", 768)):
            raise ValueError(f"{source}: n_inner must be 4 * n_embd")
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in raw.items() if k in known})


LLAMA_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
                       "MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
MOE_ARCHITECTURES = ("MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM")
GEMMA_ARCHITECTURES = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
SLIDING, FULL = "sliding_attention", "full_attention"  # transformers' layer_types


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
    # their last `sliding_window` positions only (kernels/attention.py). Empty layer_types: no window.
    sliding_window: int = 0
    layer_types: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.layer_types and len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if any(t not in (SLIDING, FULL) for t in self.layer_types):
            raise ValueError(f"layer_types {sorted(set(self.layer_types))} are not all {SLIDING!r} or {FULL!r}")
        if SLIDING in self.layer_types and self.sliding_window < 1:
            raise ValueError(f"sliding layers need a sliding_window >= 1, got {self.sliding_window}")

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
        return self.max_position_embeddings

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
        for key in ("num_local_experts", "num_experts", "moe_intermediate_size"):
            if raw.get(key) and arch not in MOE_ARCHITECTURES:
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
        rope = _rope_fields(raw.get("rope_parameters") or raw.get("rope_scaling") or {}, raw, source)
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
            qkv_bias=arch in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") or attention_bias,
            o_bias=arch not in ("Qwen2ForCausalLM", "Qwen2MoeForCausalLM") and attention_bias,
            qk_norm=arch in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM"),
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,  # the engine stops on the first EOS id
            initializer_range=raw.get("initializer_range", 0.02),
            **_moe_fields(raw, arch),
            **_window_fields(raw, arch),
        )


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
        fields = _rope_fields(rope, raw, source)
        if arch == "Gemma3ForCausalLM":
            local_fields = _rope_fields(local, {"rope_theta": raw.get("rope_local_base_freq", 10000.0)}, source)
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
            qk_norm=arch == "Gemma3ForCausalLM",
            tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
            initializer_range=raw.get("initializer_range", 0.02),
            query_pre_attn_scalar=float(raw.get("query_pre_attn_scalar", 256)),
            **soft,
            **fields,
            **_window_fields(raw, arch),
        )


def _moe_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """The mixture-of-experts switches under each family's names (none for a dense model)."""
    if arch == "MixtralForCausalLM":
        return {"num_experts": int(raw["num_local_experts"]), "num_experts_per_tok": int(raw["num_experts_per_tok"]),
                "moe_intermediate_size": int(raw["intermediate_size"]), "norm_topk_prob": True}  # fmt: skip
    if arch in ("Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"):
        return {
            # transformers 5 writes Qwen3-MoE's count as num_local_experts; the released configs say num_experts
            "num_experts": int(raw.get("num_experts") or raw["num_local_experts"]),
            "num_experts_per_tok": int(raw["num_experts_per_tok"]),
            "moe_intermediate_size": int(raw["moe_intermediate_size"]),
            "norm_topk_prob": bool(raw.get("norm_topk_prob", arch == "Qwen3MoeForCausalLM")),
            "shared_expert_intermediate_size": int(raw.get("shared_expert_intermediate_size") or 0),
            "decoder_sparse_step": int(raw.get("decoder_sparse_step") or 1),
            "mlp_only_layers": tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
        }  # fmt: skip
    return {}


def _rope_fields(rope: dict[str, Any], raw: dict[str, Any], source: str) -> dict[str, Any]:
    """rope_theta and the frequency scaling of one rope_parameters / rope_scaling entry."""
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    fields: dict[str, Any] = {"rope_theta": float(rope.get("rope_theta", raw.get("rope_theta", 10000.0)))}
    if rope_type == "llama3":
        fields["rope_llama3"] = (float(rope["factor"]), float(rope["low_freq_factor"]), float(rope["high_freq_factor"]),
                                 int(rope["original_max_position_embeddings"]))  # fmt: skip
    elif rope_type == "linear":
        fields["rope_linear"] = float(rope["factor"])
    elif rope_type != "default":
        raise ValueError(f"{source}: rope type {rope_type!r} is not supported (default, linear and llama3 are)")
    return fields


def _window_fields(raw: dict[str, Any], arch: str) -> dict[str, Any]:
    """Which layers attend within a sliding window, as transformers' model code decides for each
    family: Mistral and Mixtral window every layer when `sliding_window` is set, and so does
    Qwen3-MoE with `use_sliding_window`; Qwen2, Qwen3 and Qwen2-MoE with `use_sliding_window` window
    the layers `layer_types` names (by default those from `max_window_layers` on); Gemma 2 and 3
    window the layers `layer_types` names (by default every other one, and five of six)."""
    window, layers = raw.get("sliding_window"), raw["num_hidden_layers"]
    unknown = sorted(set(raw.get("layer_types") or ()) - {SLIDING, FULL})
    if unknown:
        raise ValueError(f"layer_types {unknown} are not supported ({SLIDING!r} and {FULL!r} are)")
    if not window or (arch.startswith("Qwen") and not raw.get("use_sliding_window")):
        return {}
    layer_types = raw.get("layer_types")
    if arch in ("MistralForCausalLM", "MixtralForCausalLM", "Qwen3MoeForCausalLM"):
        layer_types = [SLIDING] * layers
    elif arch in ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen2MoeForCausalLM"):
        first = raw.get("max_window_layers", layers)
        layer_types = layer_types or [SLIDING if i >= first else FULL for i in range(layers)]
    elif arch in GEMMA_ARCHITECTURES:
        pattern = 2 if arch == "Gemma2ForCausalLM" else int(raw.get("sliding_window_pattern", 6))
        layer_types = layer_types or [SLIDING if (i + 1) % pattern else FULL for i in range(layers)]
    else:
        return {}  # Llama's model code has no window
    if SLIDING not in layer_types:
        return {}
    return {"sliding_window": int(window), "layer_types": tuple(layer_types)}


AnyModelConfig = ModelConfig | LlamaConfig  # GemmaConfig is a LlamaConfig


def model_config_from_hf(path: str | Path) -> AnyModelConfig:
    """The engine's config for a Hugging Face config.json, chosen by its `architectures`."""
    raw = json.loads(Path(path).read_text())
    archs = raw.get("architectures") or (["GPT2LMHeadModel"] if raw.get("model_type", "gpt2") == "gpt2" else [])
    if not archs:
        raise ValueError(f"{path}: no `architectures` entry: cannot tell which model this is")
    arch = archs[0]
    fp8_block = _fp8_quantization(raw.get("quantization_config"), arch, path)
    if arch == ModelConfig.architecture:
        return ModelConfig.from_hf_dict(raw, str(path))
    if arch in GEMMA_ARCHITECTURES:
        return GemmaConfig.from_hf_dict(raw, str(path))
    if arch in LLAMA_ARCHITECTURES:
        config = LlamaConfig.from_hf_dict(raw, str(path))
        if raw.get("quantization_config") and config.num_experts:
            raise ValueError(f"{path}: FP8 mixture-of-experts checkpoints are not served (FP8 is, for dense models)")
        return replace(config, fp8=True, fp8_block=fp8_block) if raw.get("quantization_config") else config
    raise ValueError(
        f"{path}: architectures {arch!r} is not supported; served: "
        f"{', '.join((ModelConfig.architecture, *LLAMA_ARCHITECTURES, *GEMMA_ARCHITECTURES))}"
    )


def _fp8_quantization(quantization: Any, arch: str, path: str | Path) -> tuple[int, int] | None:
    """A checkpoint's quantization_config: none, or FP8 (e4m3) on a Llama-family model, whose scale
    blocks it returns (None: per tensor). Anything else is refused: it would load and answer wrongly."""
    if not quantization:
        return None
    method = quantization.get("quant_method", "unnamed") if isinstance(quantization, dict) else quantization
    if method != "fp8" or arch not in LLAMA_ARCHITECTURES:
        served = "" if method != "fp8" else f" on {arch} (served for {', '.join(LLAMA_ARCHITECTURES)})"
        raise ValueError(f"{path}: quantization_config (quant_method {method!r}) is not supported{served}: this "
                         "engine computes with unquantized weights, or FP8 ones on the Llama family, and any other "
                         "quantized checkpoint would load and answer wrongly; serve the unquantized checkpoint")  # fmt: skip
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise ValueError(f"{path}: FP8 format {quantization['fmt']!r} is not supported (e4m3 is)")
    block = quantization.get("weight_block_size")
    if block is not None and (len(block) != 2 or min(block) < 1):
        raise ValueError(f"{path}: weight_block_size {block!r} is not two positive sizes")
    return (int(block[0]), int(block[1])) if block is not None else None


def model_config_to_json(config: AnyModelConfig) -> str:
    """For the worker processes' command line: the fields plus which family."""
    return json.dumps({"family": type(config).__name__, "fields": asdict(config)})


def model_config_from_json(text: str) -> AnyModelConfig:
    data = json.loads(text)
    cls = {"ModelConfig": ModelConfig, "LlamaConfig": LlamaConfig, "GemmaConfig": GemmaConfig}[data["family"]]
    values = data["fields"]
    for name in ("rope_llama3", "fp8_block", "mlp_only_layers", "layer_types"):
        if values.get(name) is not None:
            values[name] = tuple(values[name])
    return cls(**values)


# Named presets: geometry only; weights are seeded random (no model hub is reachable at run time).
PRESETS: dict[str, AnyModelConfig] = {
    "gpt2-small": ModelConfig(),  # GPT-2 124M geometry, the default for CPU benchmarks
    "gpt2-medium": ModelConfig(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-tiny": ModelConfig(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4, eos_token_id=None, initializer_range=0.3),
    "gpt2-mini": ModelConfig(vocab_size=1024, n_positions=512, n_embd=192, n_layer=4, n_head=6, eos_token_id=None, initializer_range=0.3),
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
    # Qwen2.5-0.5B geometry (its config.json): GQA 14/2, biased q/k/v, tied embeddings, 152k vocabulary
    "qwen2.5-0.5b": LlamaConfig(architecture="Qwen2ForCausalLM", vocab_size=151936, hidden_size=896,
                                intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                num_key_value_heads=2, head_dim=64, max_position_embeddings=32768,
                                rms_norm_eps=1e-6, rope_theta=1000000.0, qkv_bias=True, tie_word_embeddings=True,
                                eos_token_id=151643),
}


@dataclass
class EngineConfig:
    model: str = "gpt2-tiny"  # local HF checkpoint directory, or a preset name from PRESETS
    tokenizer: str | None = None  # tokenizer.json or a directory holding one; default: the model dir's
    device: str = "cpu"
    dtype: str = "float32"
    max_num_seqs: int = 32  # requests in one iteration (Triton's max_batch_size is the baseline batcher's)
    kv_capacity_tokens: int = 16384  # K/V pool size in token slots, per layer (whole blocks of it are used)
    # "paged" (vLLM): blocks as the context grows, preempting the newest request when they run out;
    # "reserve" (ORCA): blocks for prompt + max_tokens at admission, never preempted.
    kv_policy: str = "paged"
    block_size: int = 16  # K/V slots per block
    enable_prefix_caching: bool = False  # share the K/V of full blocks of equal prefixes
    max_num_batched_tokens: int = 0  # tokens per iteration, long prompts chunked to fit; 0: no limit
    kv_watermark: float = 0.01  # paged: share of blocks admission leaves free for running requests
    # Admission control: requests accepted but not started (no token yet) beyond these are refused
    # at once with a retry-later error; 0 means no limit.
    max_queued_requests: int = 0
    max_queued_prompt_tokens: int = 0
    # Watchdog (served engines): with requests outstanding and no iteration finished for this long,
    # the engine core process is killed and every request ends with an error; 0 turns it off. A Ray
    # worker pool (offline too) fails when a step's tokens take this long (executor/ray_executor.py).
    iteration_timeout_s: float = 60.0
    # Failure budget: this many failed iterations in a row end the engine (a sticky device error
    # fails every batch); 0 never does.
    max_consecutive_failed_iterations: int = 10
    # One JSON line per iteration appended to this file (core/iteration_log.py); "" turns it off.
    iteration_log: str = ""
    # Limits a deployment sets on each request, checked before it reaches the engine (0: none).
    max_input_tokens: int = 0  # prompt tokens; the model's context length bounds it anyway
    max_stop_sequences: int = 16  # stop strings per request
    max_stop_length: int = 256  # characters per stop string
    max_request_bytes: int = 4 * 2**20  # a served request's inputs and parameters, before any decoding
    # Structured output: a constraint's size (schema JSON, regex, grammar or choices, in bytes) and a
    # JSON schema's nesting depth (of its objects and arrays), checked before anything compiles (an
    # array schema nested 800 deep took 48 s to compile; 64 deep, 13 ms); a grammar that has not
    # compiled after the timeout fails its request alone with INVALID_ARG, and the compiles queued
    # behind it go on on a fresh thread.
    max_structured_output_bytes: int = 64 * 2**10
    max_structured_output_depth: int = 64
    structured_output_compile_timeout_s: float = 30.0
    # Priorities: a waiting request gains one priority level (lower is served first) per this many
    # seconds it waits, so no class starves; 0 turns aging off (strict priority). Accepted priorities
    # lie in [-max_priority, max_priority] (Unix nice levels' span by default), so at most
    # 2 * max_priority * priority_aging_s (400 s) of waiting closes any gap between two classes.
    priority_aging_s: float = 10.0
    max_priority: int = 20
    scheduling: str = "iteration"  # "iteration" (ORCA) or "request" (the baseline's batch-to-completion)
    seed: int = 0  # weights of presets, and the RNG of unseeded sampling
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    kernels: str = "auto"  # "auto" | "triton" | "cpu" | "torch" (see orca_kernels.dispatch)
    # CUDA: decode-only steps replay CUDA graphs captured at load (worker/cuda_graphs.py); True runs
    # every step eagerly (vLLM's name). Graphs are CUDA and tp = pp = 1 only.
    enforce_eager: bool = False
    # Schedule step N+1 while step N runs (vLLM's name): a request's token from N reaches N+1 on the
    # device, and the host's work of a step overlaps the model's. tp = pp = 1, iteration-level only.
    async_scheduling: bool = False
    # Multi-LoRA (vLLM's names): requests name an adapter (`lora_name`) of `lora_modules` ({name: PEFT
    # adapter directory}; served: the model's multi_lora.json); `max_loras` adapters are resident at
    # once (the others wait, evicted least recently used), each of rank at most `max_lora_rank`;
    # `max_cpu_loras` keep their weights in host memory (0: as many as max_loras).
    enable_lora: bool = False
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int = 0
    lora_modules: dict[str, str] = field(default_factory=dict)
    # Served: re-read multi_lora.json when it changes, adding and removing adapters at run time (vLLM's
    # VLLM_ALLOW_RUNTIME_LORA_UPDATING); every adapter must then lie in lora_allowed_dir.
    allow_runtime_lora_updating: bool = False
    lora_allowed_dir: str = ""
    # Where tp x pp > 1 ranks run (vLLM's name): "mp", worker processes on this host, or "ray", actors
    # on the Ray cluster at ray_address (executor/ray_executor.py), placed by a placement group.
    distributed_executor_backend: str = "mp"
    ray_address: str = "auto"
    ray_placement_strategy: str = "PACK"

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.scheduling not in ("iteration", "request"):
            raise ValueError(f"scheduling must be 'iteration' or 'request', got {self.scheduling!r}")
        if self.kv_policy not in ("reserve", "paged"):
            raise ValueError(f"kv_policy must be 'reserve' or 'paged', got {self.kv_policy!r}")
        if int(self.block_size) < 1 or int(self.kv_capacity_tokens) < int(self.block_size):
            raise ValueError(f"block_size must be >= 1 and at most kv_capacity_tokens ({self.kv_capacity_tokens}), "
                             f"got {self.block_size!r}")  # fmt: skip
        if int(self.max_num_batched_tokens) < 0:
            raise ValueError(f"max_num_batched_tokens must be >= 1, or 0 for no limit, got {self.max_num_batched_tokens!r}")
        if float(self.iteration_timeout_s) < 0:
            raise ValueError(f"iteration_timeout_s must be > 0, or 0 to turn the watchdog off, got {self.iteration_timeout_s!r}")
        if float(self.structured_output_compile_timeout_s) < 0:
            raise ValueError("structured_output_compile_timeout_s must be > 0, or 0 for no limit, got "
                             f"{self.structured_output_compile_timeout_s!r}")
        if float(self.priority_aging_s) < 0:
            raise ValueError(f"priority_aging_s must be > 0, or 0 for strict priority, got {self.priority_aging_s!r}")
        for name in ("max_queued_requests", "max_queued_prompt_tokens", "max_consecutive_failed_iterations",
                     "max_input_tokens", "max_stop_sequences", "max_stop_length", "max_request_bytes",
                     "max_structured_output_bytes", "max_structured_output_depth", "max_priority"):
            if int(getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 1, or 0 for no limit, got {getattr(self, name)!r}")
        if not 0.0 <= float(self.kv_watermark) < 1.0:
            raise ValueError(f"kv_watermark must be in [0, 1), got {self.kv_watermark!r}")
        if self.kernels not in ("auto", "triton", "cpu", "torch"):
            raise ValueError(f"kernels must be auto, triton, cpu or torch, got {self.kernels!r}")
        for name in ("max_num_seqs", "kv_capacity_tokens", "tensor_parallel_size", "pipeline_parallel_size"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if self.async_scheduling and (self.scheduling != "iteration" or int(self.tensor_parallel_size) != 1
                                      or int(self.pipeline_parallel_size) != 1):  # fmt: skip
            raise ValueError("async_scheduling runs one process with iteration-level scheduling: it needs "
                             "tensor_parallel_size = pipeline_parallel_size = 1 and scheduling 'iteration'")
        if self.distributed_executor_backend not in ("mp", "ray"):
            raise ValueError(f"distributed_executor_backend must be 'mp' or 'ray', got {self.distributed_executor_backend!r}")
        if self.ray_placement_strategy not in ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"):
            raise ValueError("ray_placement_strategy must be PACK, SPREAD, STRICT_PACK or STRICT_SPREAD, got "
                             f"{self.ray_placement_strategy!r}")
        if self.distributed_executor_backend == "ray" and importlib.util.find_spec("ray") is None:
            raise ValueError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                             "pip install -e .[ray] (the same version on every host)")
        for name in ("max_loras", "max_lora_rank"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)!r}")
        if int(self.max_lora_rank) > 512:
            raise ValueError(f"max_lora_rank must be at most 512, got {self.max_lora_rank!r}")
        if int(self.max_cpu_loras) < 0:
            raise ValueError(f"max_cpu_loras must be >= max_loras, or 0 for max_loras, got {self.max_cpu_loras!r}")
        if self.max_cpu_loras and int(self.max_cpu_loras) < int(self.max_loras):
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")
        if (self.lora_modules or self.allow_runtime_lora_updating) and not self.enable_lora:
            raise ValueError("lora_modules and allow_runtime_lora_updating need enable_lora")
        if self.allow_runtime_lora_updating and not self.lora_allowed_dir:
            raise ValueError("allow_runtime_lora_updating needs lora_allowed_dir: adapters added at run time must "
                             "lie in a directory the deployment chose")  # fmt: skip
        if not (self.device == "cpu" or re.fullmatch(r"cuda(:\d+)?", self.device)):
            raise ValueError(f"device must be cpu, cuda or cuda:N, got {self.device!r}")

    def model_config(self) -> AnyModelConfig:
        if self.model in PRESETS:
            return PRESETS[self.model]
        config_path = Path(self.model) / "config.json"
        if not config_path.is_file():
            raise ValueError(
                f"model {self.model!r} is neither a preset ({', '.join(PRESETS)}) nor a directory with config.json"
            )
        return model_config_from_hf(config_path)

    def tokenizer_path(self) -> Path | None:
        if self.tokenizer:
            path = Path(self.tokenizer)
            path = path / "tokenizer.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"tokenizer {self.tokenizer!r}: no tokenizer.json found")
            return path
        if self.model not in PRESETS and (Path(self.model) / "tokenizer.json").is_file():
            return Path(self.model) / "tokenizer.json"
        return None

    @classmethod
    def from_parameters(cls, parameters: Mapping[str, Any]) -> EngineConfig:
        """Builds a config from config.pbtxt parameters (see `parameter_values`).

        Keys that are not engine fields are left for the caller; empty values keep the default.
        """
        known = {f.name: f for f in fields(cls)}
        values = parameter_values(parameters)
        if "max_batch_size" in values:
            raise ValueError("parameter max_batch_size is now max_num_seqs (the engine's batch); Triton's own "
                             "top-level max_batch_size stays the baseline batcher's setting")
        kwargs: dict[str, Any] = {}
        for key, value in values.items():
            if key not in known or value == "":
                continue
            if key == "lora_modules":
                raise ValueError("parameter lora_modules is not read: list the adapters in the model version's "
                                 "multi_lora.json (Triton's vLLM backend's file)")  # fmt: skip
            default = known[key].default
            if isinstance(default, bool):
                if value.lower() not in ("1", "true", "yes", "0", "false", "no"):
                    raise ValueError(f"parameter {key} must be true or false, got {value!r}")
                kwargs[key] = value.lower() in ("1", "true", "yes")
            elif isinstance(default, (int, float)):
                try:
                    kwargs[key] = type(default)(value)
                except ValueError:
                    kind = "an integer" if isinstance(default, int) else "a number"
                    raise ValueError(f"parameter {key} must be {kind}, got {value!r}") from None
            else:
                kwargs[key] = value
        return cls(**kwargs)


def check_parallel_layout(config: AnyModelConfig, tp: int, pp: int) -> None:
    """Refuses, at load and naming the field, a tp x pp layout the model's geometry cannot split:
    each tensor-parallel rank holds an equal share of the attention heads, the KV heads (never
    replicated) and the MLP width, and each pipeline stage at least one layer."""
    if isinstance(config, LlamaConfig):
        dims = [("num_attention_heads", config.num_attention_heads), ("num_key_value_heads", config.num_key_value_heads),
                ("intermediate_size", config.intermediate_size), ("moe_intermediate_size", config.moe_intermediate_size),
                ("shared_expert_intermediate_size", config.shared_expert_intermediate_size)]  # fmt: skip
    else:
        dims = [("n_head", config.n_head), ("n_inner (4 * n_embd)", config.n_inner)]
    for name, size in dims:
        if size % tp:
            raise ValueError(f"tensor_parallel_size {tp} does not divide {name} {size}: each rank must hold an equal "
                             "share (heads are split, never replicated)")  # fmt: skip
    if config.num_layers < pp:
        raise ValueError(f"pipeline_parallel_size {pp} exceeds the model's {config.num_layers} layers")


# The K/V pool's geometry, which the frontend's validation and the core's K/V manager both need.
def pool_capacity_tokens(capacity_tokens: int, block_size: int) -> int:
    """The slots of a pool of `capacity_tokens` cut into whole blocks."""
    return capacity_tokens // block_size * block_size


def fits_in_pool(num_tokens: int, capacity_tokens: int, block_size: int) -> bool:
    """Whether `num_tokens` tokens fit an empty pool of whole blocks (validation needs no pool)."""
    return -(-num_tokens // block_size) <= capacity_tokens // block_size


def parameter_values(parameters: Mapping[str, Any], expand_env: bool = True) -> dict[str, str]:
    """config.pbtxt `parameters` as plain strings: the one reader of them (server and client).

    Triton hands a model its parameters as {key: {"string_value": ...}}; `orca-serve` and tests may
    pass plain strings. Inside the server `${ENV}` references expand (the compose file sets the
    model that way); surrounding whitespace goes.
    """
    out = {}
    for key, raw in parameters.items():
        value = raw.get("string_value", "") if isinstance(raw, Mapping) else str(raw)
        out[key] = (os.path.expandvars(value) if expand_env else value).strip()
    return out
