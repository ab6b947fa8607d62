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


def mirror_head(target: torch.nn.Module, path: Path) -> Path:
    """A head that computes what a one-layer Llama target computes, one position earlier: fc passes
    the token's embedding through (it ignores the hidden state), its layer is the target's layer, and
    the target's norms are made all but identities (unit-RMS embedding rows, unit weights; the final
    norm then scales a vector, which keeps its argmax). It proposes the target's own next tokens but
    for what the target sees of the first token, which the head never does."""
    with torch.no_grad():
        embed = target.model.embed_tokens.weight
        embed.div_(embed.pow(2).mean(-1, keepdim=True).sqrt())
        target.model.layers[0].input_layernorm.weight.fill_(1.0)
        target.model.norm.weight.fill_(1.0)
    size = target.config.hidden_size
    return write_eagle_head(path, target.model.layers, torch.cat([torch.eye(size), torch.zeros(size, size)], dim=1))


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


# ---- EAGLE-3 -------------------------------------------------------------------------------------
def random_eagle3(hidden: int, vocab: int, draft_vocab: int, seed: int, heads: int = 4, kv_heads: int = 2,
                  head_dim: int = 16, inter: int = 96, fc_scale: float = 0.3) -> dict[str, torch.Tensor]:  # fmt: skip
    """An EAGLE-3 head's tensors under SpecForge's and vLLM's names (`midlayer.*`, `fc`, `norm`,
    `lm_head`, `d2t`, `t2d`): N(0, 0.3) matrices (`fc` N(0, fc_scale): a small one leaves the
    residual stream to attention), norms 1 + 0.1 N(0, 1), and a draft vocabulary of `draft_vocab`
    target ids drawn at random (d2t[i] = its i-th id - i)."""
    gen = torch.Generator().manual_seed(seed)

    def normal(*shape: int) -> torch.Tensor:
        return 0.3 * torch.randn(*shape, generator=gen)

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    m = "midlayer."
    targets = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    tensors = {
        m + "self_attn.q_proj.weight": normal(heads * head_dim, 2 * hidden),
        m + "self_attn.k_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.v_proj.weight": normal(kv_heads * head_dim, 2 * hidden),
        m + "self_attn.o_proj.weight": normal(hidden, heads * head_dim),
        m + "mlp.gate_proj.weight": normal(inter, hidden), m + "mlp.up_proj.weight": normal(inter, hidden),
        m + "mlp.down_proj.weight": normal(hidden, inter),
        m + "input_layernorm.weight": norm(), m + "hidden_norm.weight": norm(), m + "post_attention_layernorm.weight": norm(),
        "norm.weight": norm(), "fc.weight": normal(hidden, 3 * hidden) * (fc_scale / 0.3), "lm_head.weight": normal(draft_vocab, hidden),
        "d2t": targets - torch.arange(draft_vocab), "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill(0, targets, True),
    }  # fmt: skip
    return tensors


def write_eagle3_head(path: Path, tensors: dict[str, torch.Tensor], vocab: int, aux_layers: list[int] | None,
                      **config: Any) -> Path:  # fmt: skip
    """The head's checkpoint: config.json (Eagle3 architecture, draft_vocab_size, and the target
    layers it reads where `aux_layers` names them) and its tensors."""
    path.mkdir(parents=True, exist_ok=True)
    hidden = tensors["norm.weight"].shape[0]
    heads = tensors["midlayer.self_attn.q_proj.weight"].shape[0] // 16
    kv_heads = tensors["midlayer.self_attn.k_proj.weight"].shape[0] // 16
    raw = HEAD | dict(hidden_size=hidden, vocab_size=vocab, num_hidden_layers=1, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, intermediate_size=tensors["midlayer.mlp.gate_proj.weight"].shape[0],
                      draft_vocab_size=tensors["lm_head.weight"].shape[0], architectures=["LlamaForCausalLMEagle3"])  # fmt: skip
    if aux_layers is not None:
        raw["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers}
    (path / "config.json").write_text(json.dumps(raw | config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(path / "model.safetensors"))
    return path


def reference_eagle3(tensors: dict[str, torch.Tensor], embed: torch.Tensor, tokens: list[int], hidden: torch.Tensor,
                     from_target: bool = True, eps: float = 1e-6) -> tuple[torch.Tensor, list[int]]:  # fmt: skip
    """The EAGLE-3 head over one sequence, written out (transformers' rotary and norm modules, plain
    causal attention): position p takes tokens[p] and hidden[p] (the three target hidden states
    joined, [T, 3H], or with from_target False the head's own [T, H]). Its stream before the final
    norm [T, H] and greedy tokens as the target's ids."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    m = "midlayer."
    size = tensors["norm.weight"].shape[0]

    def rms(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def lin(x: torch.Tensor, name: str) -> torch.Tensor:
        return x @ tensors[name].t()

    with torch.no_grad():
        t = len(tokens)
        h = hidden @ tensors["fc.weight"].t() if from_target else hidden
        e = rms(embed[torch.tensor(tokens)], tensors[m + "input_layernorm.weight"])
        x = torch.cat([e, rms(h, tensors[m + "hidden_norm.weight"])], dim=-1)
        q, k, v = (lin(x, m + f"self_attn.{n}_proj.weight").view(t, -1, 16).transpose(0, 1) for n in "qkv")
        config = LlamaConfig(**(HEAD | dict(hidden_size=size, num_attention_heads=q.shape[0])))
        cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(t)[None])
        q, k = apply_rotary_pos_emb(q[None], k[None], cos, sin)
        k, v = k[0].repeat_interleave(q.shape[1] // k.shape[1], 0), v.repeat_interleave(q.shape[1] // v.shape[0], 0)
        scores = (q[0] @ k.transpose(1, 2)) / 4.0 + torch.full((t, t), float("-inf")).triu(1)  # head_dim 16
        attn = (scores.softmax(-1) @ v).transpose(0, 1).reshape(t, -1)
        stream = lin(attn, m + "self_attn.o_proj.weight") + h
        g = rms(stream, tensors[m + "post_attention_layernorm.weight"])
        stream = stream + lin(torch.nn.functional.silu(lin(g, m + "mlp.gate_proj.weight")) * lin(g, m + "mlp.up_proj.weight"),
                              m + "mlp.down_proj.weight")  # fmt: skip
        draft = (rms(stream, tensors["norm.weight"]) @ tensors["lm_head.weight"].t()).argmax(-1)
        return stream, (draft + tensors["d2t"][draft]).tolist()


def target_and_head(root: Path, method: str) -> tuple[Any, Path, Path]:
    """A tiny Llama target and a head over it, in `root`: for "eagle" a one-layer target and a head
    mirroring it (most proposals accepted), for "eagle3" a four-layer target and an EAGLE-3 head of
    random weights over layers 1-3 (a draft vocabulary of 160). Returns (transformers' model, the
    target's directory, the head's)."""
    from hf_tiny import write_tiny

    target = root / "target"
    if method == "eagle":
        model = write_tiny("Llama", target, seed=5, num_hidden_layers=1)
        head = mirror_head(model, root / "head")
        model.save_pretrained(target)  # with the norms mirror_head made identities
    else:
        model = write_tiny("Llama", target, seed=5, num_hidden_layers=4)
        head = write_eagle3_head(root / "head", random_eagle3(64, 320, draft_vocab=160, seed=9), 320, [1, 2, 3])
    return model, target, head
