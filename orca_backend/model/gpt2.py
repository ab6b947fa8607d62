"""GPT-2 forward pass written for selective batching, shardable Megatron-style.

Every scheduled request's new tokens (whole prompts being prefilled and single decode tokens, any
mix) are one flat ``[num_tokens, hidden]`` tensor for embedding, LayerNorm, QKV, output projection,
MLP and GeLU: these ops do not care which request a token belongs to. Attention is the one op that
does, so it alone is split per request via `AttentionMetadata`, each request reading and appending
its own K/V region of the per-layer pool. Logits are computed only for each request's last token.

Under tensor parallelism a rank holds a slice of the heads (QKV and MLP-in column-parallel) and the
matching input slice of attention-out and MLP-out (row-parallel, one all-reduce each); embedding
and LM head are split over the vocabulary. Under pipeline parallelism a rank holds its stage's
layers; the hidden state and residual travel between stages.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from orca_backend.config import check_parallel_layout
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import SINGLE_PROCESS, ParallelLayout
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.model import gemm
from orca_backend.model.checkpoint import WeightSource, gpt2_key, random_hf_state_dict
from orca_backend.model.parallel_layers import row_parallel_linear, vocab_parallel_embed
from orca_backend.model.registry import ModelCode
from orca_backend.model.stage_input import StageInput, StageModel, stage_output
from orca_kernels import AttentionMetadata, KernelOps
from orca_kernels.cpu_decoder_step import Gpt2Layer, Gpt2Step, unsupported
from orca_kernels.cpu_gemm import c_linear

logger = logging.getLogger("orca.model")


@dataclass
class LayerWeights:
    # Linear weights are [out, in] (torch.nn.Linear's layout, transposed from HF's Conv1D), then
    # gemm.pack()ed into the form the device multiplies fastest.
    ln1_w: torch.Tensor
    ln1_b: torch.Tensor
    qkv_w: torch.Tensor  # this rank's heads of q, k and v, stacked
    qkv_b: torch.Tensor
    attn_out_w: torch.Tensor  # columns of this rank's heads
    attn_out_b: torch.Tensor
    ln2_w: torch.Tensor
    ln2_b: torch.Tensor
    fc_w: torch.Tensor
    fc_b: torch.Tensor
    proj_w: torch.Tensor
    proj_b: torch.Tensor


@dataclass
class GPT2Weights:
    layers: list[LayerWeights]
    wte: torch.Tensor | None  # [vocab shard, hidden]: the embedding (first stage; on the last, the LM head unpacked)
    lm_head: gemm.Weight | None  # last stage only: wte, tied, packed as the layers are (gemm.pack_lm_head)
    wpe: torch.Tensor | None  # first stage only
    lnf_w: torch.Tensor | None  # last stage only
    lnf_b: torch.Tensor | None

    def num_bytes(self) -> int:
        """The bytes of every tensor held, each once (an LM head left unpacked is wte)."""
        tensors = [self.wte, self.lm_head, self.wpe, self.lnf_w, self.lnf_b]
        tensors += [t for layer in self.layers for t in vars(layer).values()]
        return sum(t.nbytes for t in {id(t): t for t in tensors if t is not None}.values())

    @classmethod
    def load(
        cls, src: WeightSource, config: GPT2Config, layout: ParallelLayout, dtype: torch.dtype, device: torch.device
    ) -> GPT2Weights:
        e = config.n_embd
        check_parallel_layout(config, layout.tp_size, layout.pp_size)
        h_lo, h_hi = layout.shard(e)  # this rank's heads, as a range of hidden channels
        f_lo, f_hi = layout.shard(config.n_inner)

        def get(name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            # contiguous: a slice of an in-memory tensor would keep the whole tensor alive
            return src.get(name, dim, lo, hi).to(device=device, dtype=dtype).contiguous()

        def linear_w(name: str, dim: int | None = None, lo: int = 0, hi: int | None = None) -> torch.Tensor:
            return get(name, dim, lo, hi).t().contiguous()  # HF Conv1D [in, out] -> [out, in]

        layers = []
        for i in layout.layers(config.n_layer):
            p = f"transformer.h.{i}."
            # c_attn's output is [q | k | v]: take this rank's heads of each block.
            qkv_w = torch.cat([linear_w(p + "attn.c_attn.weight", 1, b * e + h_lo, b * e + h_hi) for b in range(3)])
            qkv_b = torch.cat([get(p + "attn.c_attn.bias", 0, b * e + h_lo, b * e + h_hi) for b in range(3)])
            layers.append(
                LayerWeights(
                    get(p + "ln_1.weight"), get(p + "ln_1.bias"), qkv_w, qkv_b,
                    linear_w(p + "attn.c_proj.weight", 0, h_lo, h_hi), get(p + "attn.c_proj.bias"),
                    get(p + "ln_2.weight"), get(p + "ln_2.bias"),
                    linear_w(p + "mlp.c_fc.weight", 1, f_lo, f_hi), get(p + "mlp.c_fc.bias", 0, f_lo, f_hi),
                    linear_w(p + "mlp.c_proj.weight", 0, f_lo, f_hi), get(p + "mlp.c_proj.bias"),
                )  # fmt: skip
            )
        for layer in layers:
            for name in ("qkv_w", "attn_out_w", "fc_w", "proj_w"):
                setattr(layer, name, gemm.pack(getattr(layer, name)))
        v_lo, v_hi = layout.vocab_shard(config.vocab_size)
        wte = get("transformer.wte.weight", 0, v_lo, v_hi) if layout.is_first_stage or layout.is_last_stage else None
        if wte is not None and tuple(wte.shape) != (v_hi - v_lo, e):
            raise ValueError(f"wte shard has shape {tuple(wte.shape)}, config says {(v_hi - v_lo, e)}")
        lm_head = None
        if layout.is_last_stage:
            lm_head, wte = gemm.pack_lm_head(wte, wte, layout.is_first_stage)
        weights = cls(
            layers,
            wte=wte,
            lm_head=lm_head,
            wpe=get("transformer.wpe.weight") if layout.is_first_stage else None,
            lnf_w=get("transformer.ln_f.weight") if layout.is_last_stage else None,
            lnf_b=get("transformer.ln_f.bias") if layout.is_last_stage else None,
        )
        return weights


class GPT2(StageModel):
    def __init__(
        self, config: GPT2Config, weights: GPT2Weights, ops: KernelOps,
        layout: ParallelLayout = SINGLE_PROCESS, tp: TensorParallelGroup | None = None,
    ) -> None:  # fmt: skip
        super().__init__(config, weights, ops, layout, tp, config.n_head, config.n_head)  # one K/V head per query head
        self.scale = 1.0 / math.sqrt(config.head_dim)
        self.can_fuse_norms = gemm.can_fuse_norms(ops, [layer.qkv_w for layer in weights.layers])

    @functools.cached_property
    def cpu_step(self) -> Gpt2Step | None:
        """The C decode step (kernels/orca_kernels/cpu_decoder_step.py) for this stage's layers, built
        at the first step, or None where the per-op path runs every step (logged once, with why): the
        CPU kernel set, one process, K/V pools of the model's dtype and linear layers the C GEMM
        multiplies; and the steps of up to its `max_tokens` tokens without prompts
        (`Gpt2Step.runs`) or LoRA."""
        cfg, w = self.config, self.weights
        dtype = w.layers[0].ln1_w.dtype
        linears = [x for layer in w.layers for x in (layer.qkv_w, layer.attn_out_w, layer.fc_w, layer.proj_w)]
        reason = self.c_step_obstacle(linears) or unsupported(dtype, "gpt2")
        if reason:
            logger.info("decode steps on CPU run op by op (%s)", reason)
            return None
        layers = [Gpt2Layer(x.ln1_w, x.ln1_b, c_linear(x.qkv_w), x.qkv_b, c_linear(x.attn_out_w), x.attn_out_b, x.ln2_w,
                            x.ln2_b, c_linear(x.fc_w), x.fc_b, c_linear(x.proj_w), x.proj_b)
                  for x in w.layers]  # fmt: skip
        step = Gpt2Step(layers, dtype=dtype, hidden=cfg.n_embd, heads=self.num_heads, head_dim=cfg.head_dim, inner=cfg.n_inner,
                        eps=cfg.layer_norm_epsilon, scale=self.scale)  # fmt: skip
        logger.info("decode steps of up to %d tokens on CPU run as one C call (csrc/decoder_step.c)", step.max_tokens)
        return step

    def vocab_tables(self) -> tuple[torch.Tensor, torch.Tensor]:
        assert self.weights.wte is not None and self.weights.lm_head is not None, "a single-process model"
        return self.weights.wte, self.weights.lm_head  # the LM head is tied; positions are not the token's

    @torch.inference_mode()
    def forward(
        self,
        stage_input: StageInput,
        metas: Sequence[AttentionMetadata],  # one K/V group: GPT-2's layers all see the whole context
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],  # this stage's layers: (k, v) pools [slots, heads, head_dim]
        logits_indices: torch.Tensor,  # [B] index of each request's last token in the flat batch
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Returns [B, vocab] float32 logits on the last stage (with `stage_input.pool_indices`, and the
        final norm's output at those tokens), else the [2, T, hidden] activations to pass on."""
        cfg, w, ops = self.config, self.weights, self.ops
        (meta,) = metas
        num_tokens = stage_input.input_ids.shape[0]
        if self.layout.is_first_stage:
            x = vocab_parallel_embed(stage_input.input_ids, w.wte, self.vocab_lo, self.tp) + w.wpe[stage_input.positions]
            residual = None
        else:
            x, residual = stage_input.hidden.unbind(0)
        local_hidden = self.num_heads * cfg.head_dim
        lora = self.lora.step(ops, stage_input.lora) if self.lora is not None else None
        if self.can_fuse_norms and lora is None and num_tokens <= gemm.NORM_LINEAR_MAX_TOKENS["layernorm"]:
            return self._forward_fused(x, residual, meta, kv_caches, logits_indices, stage_input.pool_indices)
        cpu_step = self.cpu_step
        if cpu_step is not None and lora is None and cpu_step.runs(num_tokens, metas):
            x, residual = cpu_step(x, meta, kv_caches)
            return self._logits(x, residual, stage_input, logits_indices)
        layers = zip(w.layers, kv_caches, self.kv_scales, strict=True)
        for i, (layer, (k_cache, v_cache), kv_scales) in enumerate(layers):
            h, residual = ops.add_layernorm(x, residual, layer.ln1_w, layer.ln1_b, cfg.layer_norm_epsilon)
            qkv = gemm.linear(h, layer.qkv_w, layer.qkv_b)
            if lora is not None:
                lora.add(i, "qkv", h, qkv)
            q, k, v = qkv.view(num_tokens, 3, self.num_heads, cfg.head_dim).unbind(1)
            attn = ops.write_kv_attention(q, k, v, k_cache, v_cache, meta, self.scale, 0, 0.0,
                                          kv_scales).reshape(num_tokens, local_hidden)  # fmt: skip
            x = row_parallel_linear(attn, layer.attn_out_w, layer.attn_out_b, self.tp, lora and lora.adder(i, "o"))
            h, residual = ops.add_layernorm(x, residual, layer.ln2_w, layer.ln2_b, cfg.layer_norm_epsilon)
            if lora is not None and "fc" in lora.targeted:  # the adapter's delta goes in before the GELU
                fc = gemm.linear(h, layer.fc_w)
                lora.add(i, "fc", h, fc)
                h = ops.bias_gelu(fc, layer.fc_b)
            else:
                h = gemm.linear_bias_gelu(h, layer.fc_w, layer.fc_b, ops.bias_gelu)
            x = row_parallel_linear(h, layer.proj_w, layer.proj_b, self.tp, lora and lora.adder(i, "down"))
        if not self.layout.is_last_stage:
            return stage_output(x, residual)
        return self._logits(x, residual, stage_input, logits_indices)

    def _logits(self, x: torch.Tensor, residual: torch.Tensor, stage_input: StageInput,
                logits_indices: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The last stage's [B, vocab] float32 logits from the last layer's output x and the residual
        stream (with the pooled final hidden states where `stage_input.pool_indices` asks for them)."""
        cfg, w = self.config, self.weights
        pooled = self._final_hidden(x, None, residual, stage_input.pool_indices)
        # Only the last token of each request needs the final LayerNorm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        h, _ = self.ops.add_layernorm(x, residual, w.lnf_w, w.lnf_b, cfg.layer_norm_epsilon)
        logits = self.tp.gather_vocab(gemm.linear(h, w.lm_head).float(), cfg.vocab_size)
        return logits if pooled is None else (logits, pooled)

    def _final_hidden(self, x: torch.Tensor, pending: torch.Tensor | None, residual: torch.Tensor,
                      indices: torch.Tensor | None) -> torch.Tensor | None:  # fmt: skip
        """The final LayerNorm's output at `indices` (what embedding requests pool), float32; None without."""
        if indices is None:
            return None
        x, w = x.index_select(0, indices), self.weights
        h, _ = self.ops.add_layernorm(x if pending is None else x + pending, residual.index_select(0, indices),
                                      w.lnf_w, w.lnf_b, self.config.layer_norm_epsilon)  # fmt: skip
        return h.float()

    def _forward_fused(
        self, x: torch.Tensor, residual: torch.Tensor | None, meta: AttentionMetadata,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]], logits_indices: torch.Tensor,
        pool_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """`forward` with each LayerNorm inside the GEMM it feeds (`ops.norm_linear`, gemm.py): a layer
        is the LayerNorm + qkv GEMM, attention, the o GEMM, the LayerNorm + fc GEMM + GELU and the
        proj GEMM. The o and proj GEMMs leave their bias (`pending`) to the next norm, which adds it
        to the residual stream with the sum; tensor parallelism adds it once, after the all-reduce,
        as row_parallel_linear does."""
        cfg, w, ops, eps = self.config, self.weights, self.ops, self.config.layer_norm_epsilon
        num_tokens, local_hidden = x.shape[0], self.num_heads * cfg.head_dim
        pending: torch.Tensor | None = None  # the bias of the linear that made x, not added yet
        for layer, (k_cache, v_cache), kv_scales in zip(w.layers, kv_caches, self.kv_scales, strict=True):
            qkv, residual = ops.norm_linear(x, pending, residual, layer.ln1_w, layer.ln1_b, eps, layer.qkv_w, layer.qkv_b)
            q, k, v = qkv.view(num_tokens, 3, self.num_heads, cfg.head_dim).unbind(1)
            attn = ops.write_kv_attention(q, k, v, k_cache, v_cache, meta, self.scale, 0, 0.0,
                                          kv_scales).reshape(num_tokens, local_hidden)  # fmt: skip
            x, pending = row_parallel_linear(attn, layer.attn_out_w, None, self.tp), layer.attn_out_b
            # fmt: off
            h, residual = ops.norm_linear(x, pending, residual, layer.ln2_w, layer.ln2_b, eps, layer.fc_w, layer.fc_b,
                                          "gelu")
            # fmt: on
            x, pending = row_parallel_linear(h, layer.proj_w, None, self.tp), layer.proj_b
        if not self.layout.is_last_stage:
            return stage_output(x if pending is None else x + pending, residual)
        pooled = self._final_hidden(x, pending, residual, pool_indices)
        # Only the last token of each request needs the final LayerNorm and the LM head.
        x, residual = x[logits_indices], residual[logits_indices]
        logits, _ = ops.norm_linear(x, pending, residual, w.lnf_w, w.lnf_b, eps, w.lm_head, None)
        logits = self.tp.gather_vocab(logits.float(), cfg.vocab_size)
        return logits if pooled is None else (logits, pooled)

MODEL_CODE = ModelCode(GPT2Weights, GPT2, gpt2_key, random_hf_state_dict)
