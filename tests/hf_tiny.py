"""Tiny Llama-family checkpoints written by transformers itself (the tests' oracle), seeded: one
geometry for every test that needs a family's own model class (Qwen2/3, their MoE relatives,
Mixtral), with the family's switches passed on top."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

TINY = dict(vocab_size=320, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=256, initializer_range=0.3,
            eos_token_id=None, bos_token_id=None)  # fmt: skip


def write_tiny(family: str, path: Path, seed: int, config_class: str | None = None, **overrides: Any) -> torch.nn.Module:
    """transformers' <family>ForCausalLM of the TINY geometry (with `overrides`), its weights drawn
    after seeding torch with `seed`, saved to `path`; returned in eval mode. `config_class`: where
    the config is not <family>Config (Gemma 3's text model: Gemma3TextConfig)."""
    import transformers

    config = getattr(transformers, config_class or f"{family}Config")(**(TINY | overrides))
    torch.manual_seed(seed)
    model = getattr(transformers, f"{family}ForCausalLM")(config).eval()
    model.save_pretrained(path)
    return model
