"""The bfloat16 oracle: the engine's own greedy tokens scored teacher-forced by transformers' float32
forward of the same checkpoint. Exact equality is not a sound test in bfloat16 (DESIGN's testing
notes): a token is accepted when it lies within `BF16_GAP_NATS` of the reference's top token at its
position, and most of them must be the top itself. Shared by the CUDA tests (test_cuda.py) and the CPU
ones (test_bf16_cpu.py)."""

from __future__ import annotations

import torch

# 1-token and short prompts, and prompts past 16 and 64 tokens: the attention kernels' 16- and 64-row
# query tiles, several key blocks per request, and a decode context up to 77 + 24 = 101 tokens.
PROMPT_LENGTHS = [1, 3, 17, 40, 77]
MAX_TOKENS = 24

# Teacher-forced bf16 tolerance, in nats below the reference's top token at the same position.
# bf16 keeps 8 significant bits, so one rounding moves a logit of ~10 (these checkpoints' logits have a
# std of ~5) by up to ~0.04, and a random init-0.3 network compounds such errors layer after layer.
# Measured on the CPU over 5 seeds, scored by the float32 reference on the same tokens: on the hidden-64
# and hidden-120 geometries this engine's bf16 picks lie at most 0.22 / 0.28 nats below the top, and
# transformers' own bf16 forward's at most 0.20 / 0.28 (93-99% of positions exactly the top). So 0.5
# nats admits bf16's near-ties with ~2x headroom, while a broken kernel (a wrong mask, a stale K/V slot,
# a mis-scaled softmax) puts tokens several nats down (the logits spread ~5 nats) and also fails the
# share of exact top-1 picks. Wider geometries are left out on purpose: there bf16 rounding is
# amplified chaotically (transformers' own bf16 forward picks tokens up to 2.5 nats below the top on the
# hidden-256 checkpoint), so no fixed tolerance separates rounding from bugs; the kernel tests cover
# bf16 at wider shapes against exact references instead.
BF16_GAP_NATS = 0.5
BF16_MIN_EXACT = 0.85


def prompts_for(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]


@torch.no_grad()
def reference_gaps(model: torch.nn.Module, prompt: list[int], output: list[int]) -> torch.Tensor:
    """Teacher-forced on the engine's own tokens: for each output position, how many nats the chosen
    token's log-prob lies below the reference's best token there (0 where they agree)."""
    logprobs = model(torch.tensor([prompt + output])).logits[0].float().log_softmax(-1)
    rows = logprobs[len(prompt) - 1 : len(prompt) - 1 + len(output)]
    chosen = rows.gather(1, torch.tensor(output)[:, None])[:, 0]
    return rows.max(-1).values - chosen


def assert_near_top(model: torch.nn.Module, prompts: list[list[int]], outputs: list[list[int]]) -> None:
    """Every output token within BF16_GAP_NATS of the float32 `model`'s top, and at least
    BF16_MIN_EXACT of them the top itself."""
    gaps = torch.cat([reference_gaps(model, p, o) for p, o in zip(prompts, outputs, strict=True)])
    exact = (gaps == 0).float().mean().item()
    summary = f"max gap {gaps.max().item():.3f} nats, {exact:.1%} of {gaps.numel()} positions the reference's top"
    assert gaps.max().item() <= BF16_GAP_NATS, summary
    assert exact >= BF16_MIN_EXACT, summary
