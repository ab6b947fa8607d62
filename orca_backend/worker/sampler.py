"""Token sampling: logits processing, greedy, temperature, top-k, top-p, with a per-request RNG,
and the logprobs of the sampled tokens.

Each request draws from its own generator (kept by the input batch, worker/input_batch.py), seeded
with the request's seed (its SamplingParams.seed, or one the engine drew for it at arrival), and
every transform is row-wise, so a request's tokens
do not depend on what else is in the batch, nor on which process samples them.

vLLM v1's order: a structured-output request's grammar mask is applied before the sampler
(worker/bitmask.py, by the model runner); logprobs are taken from those logits (vLLM's default
"raw_logprobs"); then logit_bias, the min_tokens ban and the penalties (worker/logits_processors.py);
then greedy's argmax, or temperature, top-k, top-p and a draw.

Nothing here waits for the device. The parameters are the input batch's per-row tables on the
device, the step's index sets and draws came through the staging arena before its forward, and the
sizes of every tensor are known on the host. What the host needs back (the ids, and the logprobs of
the requests that asked) is packed into one int64 tensor whose copy is queued; `SampledTokens.result`
is the step's one read of it, which async scheduling makes after the next step is launched.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from orca_backend.messages import TokenLogprobs
from orca_backend.scheduler_output import PooledChunk, PromptLogprobsChunk, SamplerOutput
from orca_backend.worker.input_batch import (
    STOP_IDS,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    PoolingRows,
    PromptLogprobRows,
    SamplingBatch,
)


@dataclass
class SampledTokens:
    """A step's sampled ids on the logits' device (`tokens`) and what the host reads back of the step,
    packed (`packed`: on a GPU the pinned buffer its copy lands in): the ids, then for the requests
    that asked for logprobs their sampled token's ranks, the top ids, and the float32 bits of the
    sampled token's logprob and the top values; then the same of the prompt-logprob rows, their
    prompt token in the sampled token's place."""

    tokens: torch.Tensor  # int64 [B]
    packed: torch.Tensor  # int64, on the host once `copied` is done
    logprobs_asked: list[tuple[int, int]] = field(default_factory=list)  # (position, top alternatives)
    top: int = 0  # top alternatives computed per asking request: the most any asked for (up to the vocabulary)
    copied: torch.cuda.Event | None = None
    lora_failures: dict[int, str] = field(default_factory=dict)  # passed on (SamplerOutput.lora_failures)
    step_path: str = ""  # passed on (SamplerOutput.step_path)
    prompt: PromptLogprobRows | None = None  # the step's prompt-logprob rows, if any
    prompt_top: int = 0  # top alternatives computed per prompt-logprob row
    pooling: PoolingRows | None = None  # the step's pooled chunks, if any (their sums are packed last)

    def result(self) -> SamplerOutput:
        """The ids as a list, and the logprobs, once their copy has landed (a wait for the step on a GPU)."""
        if self.copied is not None:
            self.copied.synchronize()
        packed = self.packed.numpy()  # the step's one read of what it computed
        size = len(self.tokens)
        tokens = packed[:size].tolist()
        logprobs = None
        end = size + _packed_size(len(self.logprobs_asked), self.top)
        if self.logprobs_asked:
            logprobs = _unpack_logprobs(packed[size:end], tokens, self.logprobs_asked, self.top)
        prompt_logprobs = []
        if self.prompt is not None:
            rows = sum(chunk[2] for chunk in self.prompt.chunks)
            prompt_logprobs = _unpack_prompt_logprobs(packed[end : end + _packed_size(rows, self.prompt_top)],
                                                      self.prompt, self.prompt_top)  # fmt: skip
            end += _packed_size(rows, self.prompt_top)
        pooled = []
        if self.pooling is not None:
            sums = _unpack_floats(packed[end:]).reshape(len(self.pooling.positions), -1)
            pooled = [PooledChunk(p, row) for p, row in zip(self.pooling.positions, sums.tolist(), strict=True)]
        return SamplerOutput(tokens, logprobs, self.lora_failures, self.step_path, prompt_logprobs, pooled)


class Sampler:
    def __init__(self) -> None:
        # CUDA: where the packed results are copied to the host, two buffers in turn (under async
        # scheduling a step's copy is queued before the last one's results are read).
        self._pinned: list[torch.Tensor] = []
        self._turn = 0

    def launch(self, logits: torch.Tensor, batch: SamplingBatch, prompt_logits: torch.Tensor | None = None,
               prompt: PromptLogprobRows | None = None,
               pooled: tuple[torch.Tensor, PoolingRows] | None = None) -> SampledTokens:  # fmt: skip
        """logits: [B, vocab] float32, one row per scheduled request (changed in place). One token id
        per request (the core ignores those of prefill chunks, `batch.sample` False), and the logprobs
        of the requests that asked for them, as `result()` gives them; on a GPU everything stays
        queued, with its copy to the host. `prompt_logits` [R, vocab]: the rows of `prompt`, whose
        prompt tokens' logprobs come back too (raw, as the sampled tokens'). `pooled`: the hidden
        states of the step's pooled tokens, whose sums per chunk come back too."""
        raw_logprobs = None
        if len(batch.logprobs):  # before any processing
            raw_logprobs = logits.index_select(0, batch.logprobs).log_softmax(dim=-1)
        if len(batch.biased[0]) or len(batch.penalized[0]):
            batch.processors.apply(logits, batch.biased, batch.penalized, batch.repetition)
        positions, rows = batch.banned
        if len(positions):  # before min_tokens, EOS and stop tokens cannot be sampled (vLLM's semantics)
            stop_ids = batch.ids[:, STOP_IDS:].index_select(0, rows)
            # -inf made on the device (a Python float in `logits[...] = ` is a host tensor copied over).
            logits.index_put_((positions[:, None].expand_as(stop_ids), stop_ids), logits.new_full((), float("-inf")))
        tokens = _argmax(logits)
        positions = batch.random[0]
        if len(positions):
            tokens.index_copy_(0, positions, _sample_random(logits, batch))
        packed, asked, top = tokens, [], 0
        if raw_logprobs is not None:
            asked = list(zip(batch.logprobs_at, batch.num_logprobs, strict=True))
            top = min(max(batch.num_logprobs), logits.shape[1])
            packed = torch.cat([tokens, _pack_logprobs(raw_logprobs, tokens.index_select(0, batch.logprobs), top)])
        prompt_top = 0
        if prompt is not None:
            assert prompt_logits is not None
            prompt_top = min(max(chunk[3] for chunk in prompt.chunks), prompt_logits.shape[1])
            packed = torch.cat([packed, _pack_logprobs(prompt_logits.log_softmax(dim=-1), prompt.targets, prompt_top)])
        pooling = None
        if pooled is not None:
            hidden, pooling = pooled
            sums = hidden.new_zeros((len(pooling.positions), hidden.shape[1])).index_add_(0, pooling.segments, hidden)
            packed = torch.cat([packed, _pack_floats(sums.reshape(-1))])
        if not tokens.is_cuda:
            return SampledTokens(tokens, packed, asked, top, prompt=prompt, prompt_top=prompt_top, pooling=pooling)
        # One non-blocking copy into a persistent pinned buffer (a plain `tolist` stages through
        # pageable memory and waits for the stream).
        self._turn ^= 1
        if len(self._pinned) < 2 or self._pinned[self._turn].numel() < packed.numel():
            size = max(packed.numel(), 256, 2 * self._pinned[self._turn].numel() if self._pinned else 0)
            self._pinned = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        host = self._pinned[self._turn][: packed.numel()]
        host.copy_(packed, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return SampledTokens(tokens, host, asked, top, copied, prompt=prompt, prompt_top=prompt_top, pooling=pooling)


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    positions, rows = batch.random
    vocab = logits.shape[1]
    temperature = batch.values[:, TEMPERATURE].index_select(0, rows)
    top_k = batch.ids[:, TOP_K].index_select(0, rows)
    top_k = torch.where(top_k > 0, top_k, vocab)
    top_p = batch.values[:, TOP_P].index_select(0, rows)

    values, order = (logits.index_select(0, positions) / temperature[:, None]).sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_p[:, None], 0.0)
    cdf = probs.cumsum(dim=-1)
    pick = torch.searchsorted(cdf, (batch.draws * cdf[:, -1])[:, None]).clamp_(max=vocab - 1)
    return order.gather(1, pick).squeeze(1)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first on ties, as torch's). On the CPU numpy's is several times
    faster than torch's for the [batch, vocab] logits of every iteration; the tensor shares its memory."""
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64) and logits.is_contiguous() \
            and not logits.requires_grad:  # fmt: skip
        return torch.from_numpy(logits.numpy().argmax(axis=-1))
    return logits.argmax(dim=-1)


def _pack_logprobs(logprobs: torch.Tensor, sampled: torch.Tensor, top: int) -> torch.Tensor:
    """Of the asking rows (`logprobs`, their raw log-softmax): the sampled tokens' ranks, the `top`
    ids, then the float32 bits of the sampled tokens' logprobs and of the top values, as int64."""
    sampled_logprobs = logprobs.gather(1, sampled[:, None])
    ranks = (logprobs > sampled_logprobs).sum(dim=1) + 1  # ties share the better rank
    top_values, top_ids = logprobs.topk(top, dim=1)
    values = torch.cat([sampled_logprobs[:, 0], top_values.reshape(-1)])
    return torch.cat([ranks, top_ids.reshape(-1), _pack_floats(values)])


def _pack_floats(values: torch.Tensor) -> torch.Tensor:
    """float32 values as int64 words holding their bits, to travel in the step's one packed read."""
    return values.view(torch.int32).to(torch.int64)


def _unpack_floats(words: np.ndarray) -> np.ndarray:
    """The float32 values `_pack_floats` packed."""
    return words.astype(np.int32).view(np.float32)


def _packed_size(rows: int, top: int) -> int:
    """The int64 words `_pack_logprobs` writes for `rows` rows of `top` alternatives."""
    return rows * (2 + 2 * top)


def _unpack_prompt_logprobs(packed: np.ndarray, prompt: PromptLogprobRows, top: int) -> list[PromptLogprobsChunk]:
    """The prompt-logprob rows (`_pack_logprobs`' layout, the prompt tokens in the sampled tokens'
    place), per request: each chunk's rows keep the top alternatives it asked for."""
    asked = list(enumerate(k for _, _, num_rows, k in prompt.chunks for _ in range(num_rows)))
    rows = _unpack_logprobs(packed, prompt.target_ids, asked, top)
    chunks, at = [], 0
    for position, first_token, num_rows, _ in prompt.chunks:
        chunks.append(PromptLogprobsChunk(position, first_token, rows[at : at + num_rows]))  # type: ignore[arg-type]
        at += num_rows
    return chunks


def _unpack_logprobs(
    packed: np.ndarray, tokens: list[int], asked: list[tuple[int, int]], top: int
) -> list[TokenLogprobs | None]:
    """Per row of the batch: the sampled token's logprob and rank, then the top-k (ranks 1..k); None
    for the rows that did not ask (`_pack_logprobs`' layout)."""
    n = len(asked)
    ranks = packed[:n].tolist()
    top_ids = packed[n : n + n * top].reshape(n, top).tolist()
    values = _unpack_floats(packed[n + n * top :])
    sampled_values = values[:n].tolist()
    top_values = values[n:].reshape(n, top).tolist()
    out: list[TokenLogprobs | None] = [None] * len(tokens)
    for i, (row, k) in enumerate(asked):
        out[row] = ([tokens[row], *top_ids[i][:k]], [sampled_values[i], *top_values[i][:k]],
                    [ranks[i], *range(1, min(k, top) + 1)])  # fmt: skip
    return out
