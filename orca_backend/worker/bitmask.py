"""Structured output's token mask on the sampling rank: the engine core's bitmask rows (one per
constrained request that samples this step, core/structured_output.py) set every token a request's
grammar does not allow to -inf, before the sampler, so logprobs, logit_bias, penalties, temperature,
top-k and top-p all see the masked logits (vLLM v1 applies its grammar bitmask there too).

Plain torch (no xgrammar in the workers): a row is xgrammar's layout, ceil(vocab / 32) int32 words,
bit (id % 32) of word (id // 32) set when token `id` is allowed. Read as bytes (little-endian, as the
core wrote them), bit j of byte b is token 8 * b + j, so one lookup of each byte in a [256, 8] table of
0 / -inf expands a row into an additive mask, which is added to the row's logits (x + 0 is x exactly).
The cost is memory-bound; on 2 CPU cores, 64 rows of a 128k vocabulary took ~4-7 ms, against ~22 ms for
xgrammar's own CPU kernel.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Sequence

import torch

# The core writes int32 words in its byte order, and this reads them as bytes; both run on one machine.
assert sys.byteorder == "little", "bitmask rows are read as little-endian int32 words"
# The additive mask is built a few rows at a time, so that it stays in cache: a 40 MB one (64 rows of a
# 152k vocabulary at once) measured 4x slower than eight 5 MB ones.
_CHUNK_BYTES = 4 << 20


def decode_bitmask(data: bytes, num_rows: int) -> torch.Tensor:
    """SchedulerOutput.bitmask (the rows' int32 words as bytes) as a [num_rows, words * 4] uint8 tensor."""
    if num_rows == 0 or len(data) % (4 * num_rows):
        raise ValueError(f"a bitmask of {len(data)} bytes does not split into {num_rows} rows of int32 words")
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).view(num_rows, -1)


@functools.cache
def _additive_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[256, 8]: entry (b, j) is 0 where bit j of byte b is set (allowed), -inf where it is not."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.zeros((256, 8), dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: Sequence[int]) -> None:
    """Sets to -inf, in place, every token of logits[rows[i]] that bitmask row i does not allow; other rows
    are left as they are. `bitmask`: the rows as uint8 bytes [len(rows), words * 4] (decode_bitmask), or
    as xgrammar's int32 words [len(rows), words]; `logits`: [batch, vocab], any float dtype and device."""
    if not rows:
        return
    if bitmask.dtype == torch.int32:
        bitmask = bitmask.contiguous().view(torch.uint8)  # the same bytes, little-endian
    num_rows, vocab = len(rows), logits.shape[-1]
    if bitmask.shape[0] != num_rows or bitmask.shape[1] * 8 < vocab:
        raise ValueError(f"bitmask {tuple(bitmask.shape)} (bytes) does not cover {num_rows} rows of logits "
                         f"{tuple(logits.shape)}")
    device = logits.device
    table = _additive_table(logits.dtype, device)
    codes = bitmask.to(device).int()  # index_select takes int32 / int64 indices
    index = torch.tensor(list(rows), dtype=torch.long, device=device)
    step = max(1, _CHUNK_BYTES // (vocab * logits.element_size()))
    for start in range(0, num_rows, step):
        end = min(start + step, num_rows)
        mask = torch.index_select(table, 0, codes[start:end].reshape(-1)).view(end - start, -1)[:, :vocab]
        logits.index_add_(0, index[start:end], mask)
