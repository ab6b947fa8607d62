"""GPT-2: its config (`GPT2Config`, named as in Hugging Face's GPT2Config), its config.json parsing,
presets, tensor-parallel dimensions and LoRA targets. The model code is model/gpt2.py."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from orca_backend.families import Family, LoRATargets, Projection, Shard


@dataclass(frozen=True)
class GPT2Config:
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

    def window(self, layer: int) -> int:
        return 0

    def num_parameters(self) -> int:
        per_layer = 12 * self.n_embd * self.n_embd + 13 * self.n_embd
        return self.vocab_size * self.n_embd + self.n_positions * self.n_embd + self.n_layer * per_layer + 2 * self.n_embd

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str) -> GPT2Config:
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


PRESETS: dict[str, GPT2Config] = {
    "gpt2-small": GPT2Config(),  # GPT-2 124M geometry, the default for CPU benchmarks
    "gpt2-medium": GPT2Config(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-tiny": GPT2Config(vocab_size=512, n_positions=256, n_embd=64, n_layer=2, n_head=4, eos_token_id=None, initializer_range=0.3),
    "gpt2-mini": GPT2Config(vocab_size=1024, n_positions=512, n_embd=192, n_layer=4, n_head=6, eos_token_id=None, initializer_range=0.3),
}


def tp_divisible(config: GPT2Config) -> list[tuple[str, int]]:
    """What each tensor-parallel rank holds an equal share of: the heads and the MLP width."""
    return [("n_head", config.n_head), ("n_inner (4 * n_embd)", config.n_inner)]


# LoRA: PEFT's module names (relative to a layer) -> (projection, slice). c_attn is one fused module in
# the checkpoint and in PEFT alike, so each projection has one slice.
PEFT_MODULES = {"attn.c_attn": ("qkv", 0), "attn.c_proj": ("o", 0), "mlp.c_fc": ("fc", 0), "mlp.c_proj": ("down", 0)}


def lora_projections(config: GPT2Config) -> dict[str, Projection]:
    e, inner = config.n_embd, config.n_inner
    return {"qkv": Projection("qkv", ((e, 3 * e),), False), "o": Projection("o", ((e, e),), True),
            "fc": Projection("fc", ((e, inner),), False), "down": Projection("down", ((inner, e),), True)}  # fmt: skip


def lora_output_rows(config: GPT2Config, shard: Shard, name: str, index: int) -> list[tuple[int, int]]:
    """The rows of a column-parallel slice's output this rank holds, as its base weight's shard."""
    if name == "qkv":  # c_attn's [q | k | v]: this rank's heads of each
        e = config.n_embd
        lo, hi = shard(e)
        return [(part * e + lo, part * e + hi) for part in range(3)]
    return [shard(config.n_inner)]  # fc


def lora_input_columns(config: GPT2Config, shard: Shard, name: str) -> tuple[int, int]:
    """The columns of a row-parallel projection's input this rank holds."""
    return shard(config.n_embd if name == "o" else config.n_inner)


FAMILY = Family(
    name="gpt2",
    config_class=GPT2Config,
    architectures=(GPT2Config.architecture,),
    from_hf_dict=GPT2Config.from_hf_dict,
    presets=PRESETS,
    tp_divisible=tp_divisible,
    lora=LoRATargets(lora_projections, PEFT_MODULES, "base_model.model.transformer.h", True, lora_output_rows,
                     lora_input_columns),  # fmt: skip
    model="orca_backend.model.gpt2",
)
