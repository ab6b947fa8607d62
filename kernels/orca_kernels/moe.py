"""Mixture-of-experts MLP for selective batching: the torch reference, which the CPU runs.

Every token of the flat batch is routed together: `topk_ids` [T, k] names each token's experts and
`topk_weights` [T, k] their weights. Each expert's MLP is SwiGLU with its gate and up projections
stacked (`w13` [E, 2 I, H]: gate rows, then up rows) and its down projection `w2` [E, H, I]. The
tokens of each expert that any token chose are gathered and multiplied by that expert's weights
once, so a step reads each active expert's weights once however many tokens chose it; the
weighted outputs are summed per token in expert order (transformers' order). The expert GEMMs go
through `linear` (F.linear by default; the CPU kernel set binds cpu_int_gemm.expert_linear_cpu, whose
C kernels read an expert's float or integer weights at streaming bandwidth for the few tokens a
decode step routes to it). Experts stored as integers come as `int_quant.IntExperts` (or, on the CPU,
a list of the C kernel's weights); this reference multiplies an `IntWeight` dequantized.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from .int_quant import IntWeight, int_linear_torch


def moe_torch(
    x: torch.Tensor, w13: Sequence, w2: Sequence, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor], linear: Callable = F.linear,
) -> torch.Tensor:  # fmt: skip
    """x [T, H] -> [T, H]: sum over each token's k experts of weight * down(silu(gate(x)) * up(x)).
    `w13` and `w2` hold one weight per expert: stacked tensors, IntExperts, or lists of weights."""
    out = torch.zeros_like(x)
    flat, flat_weights = topk_ids.flatten(), topk_weights.flatten()
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=len(w13)).tolist()  # the host needs them to slice (CPU path)

    def expert_linear(a: torch.Tensor, weight: object) -> torch.Tensor:
        if isinstance(weight, IntWeight):
            return int_linear_torch(a, weight.packed, weight.scales, weight.zeros, weight.bits, weight.group,
                                    weight.g_idx)  # fmt: skip
        return linear(a, weight)

    k = topk_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // k
        hidden = expert_linear(silu_and_mul(expert_linear(x[tokens], w13[expert])), w2[expert])
        out.index_add_(0, tokens, hidden * flat_weights[pairs, None])
    return out
