"""EAGLE heads for the tests, written as EAGLE's and vLLM's EagleLlamaForCausalLM checkpoints are:
`fc.weight` [H, 2H] (and `fc.bias`) and transformers' Llama decoder layers under `layers.N.`, the
first without its input norm; no embedding, final norm or LM head (the head shares the target's).

`reference_head` is the oracle: the same layers as transformers' own LlamaDecoderLayer modules run
them (the first one's input norm an identity, as vLLM's EAGLE model makes it), on the target's
hidden states and embedding, with the target's LM head on the output.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

HEAD = dict(intermediate_size=96, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, initializer_range=0.3, rms_norm_eps=1e-6)  # fmt: skip


def head_config(hidden_size: int, vocab_size: int, num_layers: int = 1, **overrides: Any) -> Any:
    import transformers

    return transformers.LlamaConfig(**(HEAD | dict(hidden_size=hidden_size, vocab_size=vocab_size,
                                                   num_hidden_layers=num_layers) | overrides))  # fmt: skip


def random_layers(config: Any, seed: int) -> torch.nn.ModuleList:
    """transformers' Llama decoder layers of `config`, every weight drawn N(0, initializer_range)
    (norms 1 + 0.1 N(0, 1)) after seeding with `seed`."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer

    layers = torch.nn.ModuleList(LlamaDecoderLayer(config, i) for i in range(config.num_hidden_layers)).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layers.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.1 * noise if "norm" in name else config.initializer_range * noise)
    return layers


def write_eagle_head(path: Path, layers: torch.nn.ModuleList, fc: torch.Tensor, fc_bias: torch.Tensor | None = None,
                     architecture: str = "EagleLlamaForCausalLM", prefix: str = "") -> Path:  # fmt: skip
    """The head's checkpoint in `path`: config.json of `layers`' config, and its tensors under
    `prefix` ("" as vLLM's exports, "model." as some others)."""
    path.mkdir(parents=True, exist_ok=True)
    config = layers[0].self_attn.config.to_dict() | {"architectures": [architecture]}
    (path / "config.json").write_text(json.dumps(config))
    tensors = {f"{prefix}layers.{name}": p.detach().clone() for name, p in layers.named_parameters()
               if name != "0.input_layernorm.weight"}  # fmt: skip
    tensors["fc.weight"] = fc.detach().clone()
    if fc_bias is not None:
        tensors["fc.bias"] = fc_bias.detach().clone()
    save_file(tensors, str(path / "model.safetensors"))
    return path


def reference_head(layers: torch.nn.ModuleList, fc: torch.Tensor, fc_bias: torch.Tensor | None, embed: torch.Tensor,
                   lm_head: torch.Tensor, tokens: list[int], hidden: torch.Tensor) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """The head over one sequence: position p takes tokens[p] (the token after the target's p) and
    hidden[p] (the target's final hidden state at p). Its output [T, H] and greedy tokens."""
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = layers[0].self_attn.config
    t = len(tokens)
    with torch.no_grad():
        x = torch.nn.functional.linear(torch.cat([embed[torch.tensor(tokens)], hidden], dim=-1), fc, fc_bias)[None]
        positions = torch.arange(t)[None]
        rotary = LlamaRotaryEmbedding(config)(x, positions)
        mask = torch.full((t, t), float("-inf")).triu(1)[None, None]
        for i, layer in enumerate(layers):
            norm = layer.input_layernorm
            if i == 0:
                layer.input_layernorm = torch.nn.Identity()
            try:
                out = layer(x, attention_mask=mask, position_ids=positions, position_embeddings=rotary)
            finally:
                layer.input_layernorm = norm
            x = out[0] if isinstance(out, tuple) else out
        x = x[0]
        return x, (x @ lm_head.t()).argmax(dim=-1).tolist()
