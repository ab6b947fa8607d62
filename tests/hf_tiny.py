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


def randomize_norms(model: torch.nn.Module, path: Path, seed: int) -> torch.nn.Module:
    """Draws every norm weight of `model` anew (0.3 N(0, 1)) and saves it to `path` again: transformers
    starts Gemma's at 0 (it weighs by 1 + w), where a wrong fold of the 1 could not be seen, and such a
    tiny Gemma repeats its last token."""
    with torch.no_grad():
        gen = torch.Generator().manual_seed(seed)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(0.3 * torch.randn(p.shape, generator=gen))
    model.save_pretrained(path)
    return model


def write_lora(base: torch.nn.Module, path: Path, seed: int, r: int, targets: list[str], **config: Any) -> torch.nn.Module:
    """A PEFT LoRA adapter of `base` (which is left as it is) with random A and B, drawn after seeding
    torch with `seed`, saved to `path` in PEFT's format; returns a copy of `base` with the adapter
    merged by peft itself (the tests' oracle). lora_alpha is 2 r unless `config` says otherwise."""
    import copy

    import peft

    torch.manual_seed(seed)
    lora_config = peft.LoraConfig(**({"r": r, "lora_alpha": 2 * r, "target_modules": targets,
                                      "init_lora_weights": False} | config))  # fmt: skip
    model = peft.get_peft_model(copy.deepcopy(base), lora_config)
    model.save_pretrained(path)
    return model.merge_and_unload().eval()


def hf_greedy(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    """transformers' greedy continuation of one prompt: exactly `n` tokens, EOS or not (the oracle of
    the engine's greedy tokens with ignore_eos)."""
    with torch.no_grad():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, pad_token_id=0)  # fmt: skip
    return out[0, len(prompt) :].tolist()


def write_tiny_with_tokenizer(path: Path, tokenizer_seed: int, seed: int = 0) -> torch.nn.Module:
    """A Qwen2-style checkpoint with a byte-level BPE tokenizer of its own (384 ids, EOS its end of
    text), for tests that send text: transformers' model, weights drawn after seeding torch with `seed`."""
    import transformers

    from orca_backend.model.checkpoint import EOS_TOKEN, train_byte_level_bpe

    tokenizer = train_byte_level_bpe(384, seed=tokenizer_seed)
    config = transformers.Qwen2Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.3,
        eos_token_id=tokenizer.token_to_id(EOS_TOKEN), bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(seed)
    model = transformers.Qwen2ForCausalLM(config).eval()
    model.save_pretrained(path)
    tokenizer.save(str(path / "tokenizer.json"))
    return model
