"""EAGLE heads (speculative decoding's methods "eagle" and "eagle3", vLLM's EagleLlamaForCausalLM and
Eagle3LlamaForCausalLM): a few Llama decoder layers that predict the target's next token from the
token and the target's own hidden states.

At position p a head takes the token at p + 1 and what the target computed at p, runs its layers at
position p, and names the token at p + 2. Where the target has not run a position yet (the head's
own later proposals), the head's output at the position before stands in for the target's hidden
state (`propose` returns it).

EAGLE-1 (`EagleHead`): the target's final hidden state (its final norm's output) and the target's
embedding of the token are joined (embedding first; HASS heads norm both first) and `fc` maps the 2H
back to H; the first layer has no input norm, there is no final norm, and the target's LM head on
the output names the token. `fc`'s bias, where a checkpoint has one, is applied as EAGLE's own code
does (vLLM's loader drops it).

EAGLE-3 (`Eagle3Head`): `fc` maps the hidden states entering three of the target's layers, joined
(3H), to H (`from_target`); the first layer's q/k/v read the normed embedding and the normed hidden
state side by side (2H; its residual is the hidden state, or its norm with norm_before_residual), a
final norm comes before the head's own LM head, whose vocabulary maps onto the target's by the
checkpoint's `d2t` (target id = draft id + d2t[draft id]), and what stands in for the next hidden
state is the stream before that norm.

The checkpoints hold `fc` and the layers (`layers.N.*` or EAGLE-3's `midlayer.*`, with or without a
`model.` prefix); EAGLE-1 heads share the target's embedding and LM head (an embedding in the
checkpoint is not read, as in vLLM), EAGLE-3 heads their own LM head, `norm` and `d2t`, and their own
embedding where the checkpoint has one. A head runs in one process on the target's device, with its
own K/V pool (worker/eagle_proposer.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open

from orca_backend.distributed.layout import SINGLE_PROCESS
from orca_backend.families.llama import EagleHeadConfig, eagle_head_config
from orca_backend.model import gemm
from orca_backend.model.checkpoint import WeightSource
from orca_backend.model.decoder import Decoder, DecoderLayerWeights
from orca_backend.model.llama import LlamaWeights
from orca_backend.model.stage_input import StageModel
from orca_kernels import AttentionMetadata, KernelOps

_OWN = "eagle."  # the names of a head's tensors the shared decoder's loader does not ask for


def eagle_key(key: str) -> str | None:
    """A head's stored name -> the shared decoder's (model.layers.N.*, model.norm.weight) or its own
    (eagle.*), or None for what it is not read (rotary caches, EAGLE-3's t2d; d2t is read apart)."""
    key = key.removeprefix("model.")
    if key.endswith("rotary_emb.inv_freq") or key in ("t2d", "d2t"):
        return None
    if key.startswith("midlayer."):
        key = "layers.0." + key.removeprefix("midlayer.")
    if key.startswith(("embed_tokens.", "lm_head.", "fc.", "embedding_layernorm.", "hidden_states_layernorm.")):
        return _OWN + key
    return "model." + key


@dataclass
class EagleWeights(LlamaWeights):
    """The head's layers as the shared decoder holds them, and its own tensors."""

    fc_w: torch.Tensor | None = None  # EAGLE-1 [H, 2H]: (embedding, hidden state) -> H; EAGLE-3 [H, 3H]
    fc_b: torch.Tensor | None = None
    embed_norm_w: torch.Tensor | None = None  # HASS: the norms of the two inputs
    hidden_norm_w: torch.Tensor | None = None  # HASS; EAGLE-3: the hidden state's norm in its first layer
    head_lm_head: torch.Tensor | None = None  # EAGLE-3: [draft vocab, H]
    draft_to_target: torch.Tensor | None = None  # EAGLE-3: int64 [draft vocab], the target's id of each


class EagleHead(Decoder):
    """EAGLE-1 (see the module's docstring)."""

    def __init__(self, config: EagleHeadConfig, weights: EagleWeights, ops: KernelOps, embed: torch.Tensor,
                 lm_head: torch.Tensor) -> None:  # fmt: skip
        super().__init__(config.decoder, weights, ops)
        self.head_config = config
        self.embed_table, self.lm_head_table = embed, lm_head

    @property
    def aux_layers(self) -> tuple[int, ...]:
        """The target layers whose input hidden states the head reads (StageInput.aux_layers)."""
        return ()

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head reads of the target's hidden states of some tokens ([T, H + 3 H] with EAGLE-3's
        auxiliary ones after the final ones, as the runner has them), as the head's hidden input."""
        return hidden[:, : self.config.hidden_size]

    def _layers(self, x: torch.Tensor, residual: torch.Tensor, first_input: torch.Tensor, positions: torch.Tensor,
                meta: AttentionMetadata, kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The head's layers on the stream (x, residual); the first layer's q/k/v read `first_input`.
        Returns the last MLP's output and the residual."""
        cfg, w, ops, eps = self.config, self.weights, self.ops, self.config.rms_norm_eps
        t, d, hq, hkv = x.shape[0], cfg.head_dim, self.num_heads, self.num_kv_heads
        layers = zip(w.layers, self.layer_attention, kv_caches, strict=True)
        for i, (layer, (window, cos_sin), (k_cache, v_cache)) in enumerate(layers):
            if i == 0:
                h = first_input
            else:
                h, residual = ops.add_rmsnorm(x, residual, layer.input_norm_w, eps)
            q, k, v = gemm.linear(h, layer.qkv_w, layer.qkv_b).split([hq * d, hkv * d, hkv * d], dim=-1)
            q, k, v = q.view(t, hq, d), k.view(t, hkv, d), v.view(t, hkv, d)
            if cfg.qk_norm:
                q, k = self._head_norm(q, layer.q_norm_w), self._head_norm(k, layer.k_norm_w)
            attn = ops.rotary_write_kv_attention(q, k, v, positions, cos_sin, k_cache, v_cache, meta,
                                                 self.hooks.attn_scale, window, 0.0).reshape(t, hq * d)  # fmt: skip
            h, residual = ops.add_rmsnorm(gemm.linear(attn, layer.o_w, layer.o_b), residual, layer.pre_mlp_norm_w, eps)
            x = gemm.linear(self.activation(gemm.linear(h, layer.gate_up_w)), layer.down_w)
        return x, residual

    @torch.inference_mode()
    def propose(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], last: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The head at `positions` on tokens `input_ids` [T] and the hidden states [T, H] before them
        (`from_target`'s, or its own): its output [T, H] (what stands in for the target's hidden
        state at the next position), and its greedy token at the rows `last` [R], as the target's id."""
        out, logits = self.forward(input_ids, hidden, positions, meta, kv_caches, last)
        return out, self.draft_ids(logits)

    def draft_ids(self, logits: torch.Tensor) -> torch.Tensor:
        """The greedy token of each row of the head's logits, as the target's id."""
        return logits.argmax(dim=-1)

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], last: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`propose`'s output, and the logits at the rows `last` [R, its vocabulary] (what a CUDA
        graph of its passes returns: the tokens are taken outside it)."""
        w, ops, eps = self.weights, self.ops, self.config.rms_norm_eps
        embedded = F.embedding(input_ids, self.embed_table)
        hidden = hidden.to(embedded.dtype)
        if w.embed_norm_w is not None:
            embedded, _ = ops.add_rmsnorm(embedded, None, w.embed_norm_w, eps)
            hidden, _ = ops.add_rmsnorm(hidden, None, w.hidden_norm_w, eps)
        x = gemm.linear(torch.cat([embedded, hidden], dim=-1), w.fc_w, w.fc_b)
        # The first layer has no input norm (EAGLE's design): it reads fc's output as it is.
        x, residual = self._layers(x, x, x, positions, meta, kv_caches)
        out = x + residual
        return out, gemm.linear(out.index_select(0, last), self.lm_head_table)


class Eagle3Head(EagleHead):
    """EAGLE-3 (see the module's docstring)."""

    def __init__(self, config: EagleHeadConfig, weights: EagleWeights, ops: KernelOps, embed: torch.Tensor,
                 aux_layers: tuple[int, ...]) -> None:  # fmt: skip
        super().__init__(config, weights, ops, embed, weights.head_lm_head)  # type: ignore[arg-type]
        self._aux_layers = aux_layers

    @property
    def aux_layers(self) -> tuple[int, ...]:
        return self._aux_layers

    def from_target(self, hidden: torch.Tensor) -> torch.Tensor:
        aux = hidden[:, self.head_config.target_hidden_size :].to(self.weights.fc_w.dtype)
        return gemm.linear(aux, self.weights.fc_w)

    def draft_ids(self, logits: torch.Tensor) -> torch.Tensor:
        draft = logits.argmax(dim=-1)
        if self.weights.draft_to_target is not None:  # its draft vocabulary's ids onto the target's
            draft = draft + self.weights.draft_to_target.index_select(0, draft)
        return draft

    @torch.inference_mode()
    def forward(
        self, input_ids: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], last: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        w, ops, eps = self.weights, self.ops, self.config.rms_norm_eps
        embedded = F.embedding(input_ids, self.embed_table)
        hidden = hidden.to(embedded.dtype)
        first: DecoderLayerWeights = w.layers[0]
        embedded, _ = ops.add_rmsnorm(embedded, None, first.input_norm_w, eps)
        normed, _ = ops.add_rmsnorm(hidden, None, w.hidden_norm_w, eps)
        residual = normed if self.head_config.norm_before_residual else hidden
        x, residual = self._layers(hidden, residual, torch.cat([embedded, normed], dim=-1), positions, meta, kv_caches)
        out, before_norm = ops.add_rmsnorm(x, residual, w.norm_w, eps)
        return before_norm, gemm.linear(out.index_select(0, last), self.lm_head_table)


def load_eagle_head(head_dir: str, method: str, target: StageModel, dtype: torch.dtype,
                    device: torch.device) -> EagleHead:  # fmt: skip
    """The head of `method` ("eagle" or "eagle3") in `head_dir` over `target` (a single-process
    model), refusing, naming the field, a head that does not fit it; its weights packed as the
    target's kernel set multiplies them."""
    with gemm.packing_for(target.ops):
        return _load_eagle_head(head_dir, method, target, dtype, device)


def _load_eagle_head(head_dir: str, method: str, target: StageModel, dtype: torch.dtype,
                     device: torch.device) -> EagleHead:  # fmt: skip
    path = Path(head_dir)
    if not (path / "config.json").is_file():
        raise ValueError(f"speculative_config: the EAGLE head {head_dir!r} is not a checkpoint directory with a "
                         "config.json")  # fmt: skip
    config = eagle_head_config(json.loads((path / "config.json").read_text()), str(path / "config.json"), method)
    embed, lm_head = target.vocab_tables()
    aux_layers = target.eagle3_layers(config.aux_layers) if method == "eagle3" else ()
    hidden = config.decoder.hidden_size
    target_hidden = embed.shape[1]
    for name, size in (("hidden_size", hidden), ("target_hidden_size", config.target_hidden_size or hidden)):
        if size != target_hidden:
            raise ValueError(f"speculative_config: the EAGLE head's {name} ({size}) is not the target's hidden size "
                             f"({target_hidden})")  # fmt: skip
    source = WeightSource.from_dir(path, eagle_key)
    own_embed = method == "eagle3" and _OWN + "embed_tokens.weight" in source
    # What the shared decoder's loader asks for and the head does not have: an embedding (the
    # target's, or EAGLE-3's own), and unit weights for the norms its forward never applies
    # (EAGLE-1's first input norm and final norm).
    ones = torch.ones(hidden)
    filler = {"model.embed_tokens.weight": source.get(_OWN + "embed_tokens.weight") if own_embed else embed,
              "model.norm.weight": ones, "model.layers.0.input_layernorm.weight": ones}  # fmt: skip
    source = source.with_tensors({name: tensor for name, tensor in filler.items() if name not in source})
    weights = EagleWeights.load(source, config.decoder, SINGLE_PROCESS, dtype, device)
    head_embed = weights.embed if own_embed else embed
    weights.embed = weights.lm_head = None  # the head's tables are its own fields
    if method == "eagle":
        weights.norm_w = None

    def own(name: str) -> torch.Tensor | None:
        name = _OWN + name if not name.startswith("model.") else name
        return source.get(name).to(device=device, dtype=dtype).contiguous() if name in source else None

    width = 3 * target_hidden if method == "eagle3" else 2 * hidden
    fc_w = own("fc.weight")
    if fc_w is None or tuple(fc_w.shape) != (hidden, width):
        raise ValueError(f"{head_dir}: an EAGLE head needs fc.weight of shape [{hidden}, {width}]"
                         f"{'' if fc_w is None else f', got {list(fc_w.shape)}'}")  # fmt: skip
    weights.fc_w, weights.fc_b = gemm.pack(fc_w), own("fc.bias")
    if method == "eagle":
        if config.input_norms:
            weights.embed_norm_w, weights.hidden_norm_w = own("embedding_layernorm.weight"), own("hidden_states_layernorm.weight")
            if weights.embed_norm_w is None or weights.hidden_norm_w is None:
                raise ValueError(f"{head_dir}: add_para_norm is set, but embedding_layernorm.weight or "
                                 "hidden_states_layernorm.weight is missing")  # fmt: skip
        return EagleHead(config, weights, target.ops, embed, lm_head)
    weights.hidden_norm_w = own("model.layers.0.hidden_norm.weight")
    weights.head_lm_head = own("lm_head.weight")
    for name, tensor in (("midlayer.hidden_norm.weight", weights.hidden_norm_w), ("lm_head.weight", weights.head_lm_head)):
        if tensor is None:
            raise ValueError(f"{head_dir}: an EAGLE-3 head needs {name}")
    draft_vocab = weights.head_lm_head.shape[0]  # type: ignore[union-attr]
    d2t = _stored_tensor(path, "d2t")
    if d2t is not None:
        if tuple(d2t.shape) != (draft_vocab,):
            raise ValueError(f"{head_dir}: d2t has shape {list(d2t.shape)}, not [{draft_vocab}] (the draft vocabulary)")
        weights.draft_to_target = d2t.to(device=device, dtype=torch.int64)
    elif draft_vocab != embed.shape[0]:
        raise ValueError(f"{head_dir}: the head's vocabulary ({draft_vocab}) is not the target's ({embed.shape[0]}) "
                         "and the checkpoint has no d2t mapping it")  # fmt: skip
    return Eagle3Head(config, weights, target.ops, head_embed, aux_layers)  # type: ignore[arg-type]


def _stored_tensor(path: Path, name: str) -> torch.Tensor | None:
    """A tensor of the checkpoint's safetensors files by its stored name, read whole (None if none has it)."""
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as handle:
            if name in handle.keys():  # noqa: SIM118 - safe_open handles are not iterable
                return handle.get_tensor(name)
    return None
