"""A measurement device, not a model: the `constant-time-measure` preset, whose forward costs next to
nothing whatever the batch and the context, so that a served benchmark measures the serving path
(scheduler, K/V bookkeeping, sampler, output frames, detokenization, the Python backend's responses,
tritonserver) without the model's cost or its batching effects (benchmarks/serving_cost.py).

Its "next token" is a fixed function of the request's last token and its position, emitted as a
one-hot logit far above the rest, so every sampler setting picks it: outputs are deterministic, vary
from token to token (detokenizing them is real work), and never the EOS id (a request ends at its
max_tokens). It answers nothing a language model would. Served with a tokenizer (the `tokenizer`
parameter: a tokenizer.json of at most `vocab_size` ids), its outputs are detokenized like any
model's. The model code is model/constant_time.py; it writes no K/V (the K/V manager still assigns
blocks) and serves tp = pp = 1 only.

`step_time_ms` makes every forward wait that long without using the CPU, standing for an accelerator's
step: the engine then produces tokens at a set pace (batch / step time) instead of as fast as the host
allows. The preset's is 0; a directory written by model/constant_time.py's `write_device_dir` (its
config.json names this architecture, with a tokenizer.json beside it) sets it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, ClassVar

from orca_backend.families import Family, LoRATargets, Shard


@dataclass(frozen=True)
class ConstantTimeConfig:
    """The device's geometry: a vocabulary and a context, nothing to compute."""

    # Not a Hugging Face architecture: no checkpoint names it, only the preset serves it.
    architecture: ClassVar[str] = "OrcaConstantTimeMeasure"
    vocab_size: int = 1024  # the size of the tokenizer orca-bench's checkpoints train (model/checkpoint.py)
    n_positions: int = 4096
    eos_token_id: int | None = 0  # that tokenizer's <|endoftext|>: never emitted
    # The token pattern: next = (token_mult * last token + position_mult * position + offset) over the
    # ids other than EOS (model/constant_time.py).
    token_mult: int = 31
    position_mult: int = 17
    offset: int = 7
    step_time_ms: float = 0.0  # each forward waits this long (a sleep, no CPU): an accelerator's step

    # The names the engine uses for every family. One layer of one K/V head of width 1: the geometry
    # the engine's checks need; the model holds no layer, so no K/V pool is allocated.
    @property
    def max_context(self) -> int:
        return self.n_positions

    @property
    def hidden_size(self) -> int:
        return 1

    @property
    def num_layers(self) -> int:
        return 1

    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return 1

    @property
    def kv_window(self) -> int:
        return 0

    def window(self, layer: int) -> int:
        return 0

    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any], source: str) -> ConstantTimeConfig:
        """The config.json `write_device_dir` writes: this class's fields by name, nothing else."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known - {"architectures", "model_type"})
        if unknown:
            raise ValueError(f"{source}: {cls.architecture} (a measurement device) has no fields {unknown}")
        config = cls(**{k: v for k, v in raw.items() if k in known})
        if config.step_time_ms < 0:
            raise ValueError(f"{source}: step_time_ms must be >= 0, got {config.step_time_ms}")
        return config


PRESETS: dict[str, ConstantTimeConfig] = {"constant-time-measure": ConstantTimeConfig()}


def tp_divisible(config: ConstantTimeConfig) -> list[tuple[str, int]]:
    """Nothing to split: any tp > 1 is refused (one K/V head)."""
    return [("num_kv_heads (a measurement device: tp = 1 only)", config.num_kv_heads)]


def _no_projections(config: ConstantTimeConfig) -> dict:
    return {}  # nothing an adapter could target: every LoRA adapter is refused at registration


def _no_rows(config: ConstantTimeConfig, shard: Shard, name: str, index: int = 0) -> Any:
    raise ValueError("the constant-time measurement device has no LoRA targets")


FAMILY = Family(
    name="constant_time",
    config_class=ConstantTimeConfig,
    architectures=(ConstantTimeConfig.architecture,),
    from_hf_dict=ConstantTimeConfig.from_hf_dict,
    presets=PRESETS,
    tp_divisible=tp_divisible,
    lora=LoRATargets(_no_projections, {}, "", False, _no_rows, _no_rows),
    model="orca_backend.model.constant_time",
)
