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

Speculative decoding verifies a request's proposed tokens on the rows before its last one, each
processed as its last row is (a request speculates only where that holds: core/scheduler.py). A
greedy row accepts its proposal where it is the argmax, and otherwise gives the argmax instead. A
row sampled at random accepts with probability min(1, p/q) (p the target's processed distribution,
q the proposer's; a proposer that names one token has q = 1 there) and otherwise draws from the
residual max(p - q, 0), normalised: the emitted tokens are distributed as the target's own (Leviathan
et al., 2023). The host finds each request's leading run of accepted rows in the step's one read.

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
    SpecRows,
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
    spec: SpecRows | None = None  # the step's rows verifying proposals, if any (packed after the logprobs)
    spec_top: int = 0  # top alternatives computed per verifying row that asks for logprobs
    landed: SamplerOutput | None = None  # what `result()` returned, once it has

    def result(self) -> SamplerOutput:
        """The ids as a list, and the logprobs, once their copy has landed (a wait for the step on a GPU)."""
        if self.landed is not None:
            return self.landed
        if self.copied is not None:
            self.copied.synchronize()
        packed = self.packed.numpy()  # the step's one read of what it computed
        size = len(self.tokens)
        tokens = packed[:size].tolist()
        logprobs = None
        end = size + _packed_size(len(self.logprobs_asked), self.top)
        if self.logprobs_asked:
            logprobs = _unpack_logprobs(packed[size:end], tokens, self.logprobs_asked, self.top)
        num_accepted: list[int] = []
        spec_logprobs: list[list[TokenLogprobs] | None] = []
        spec_tokens: list[list[int]] = []
        if self.spec is not None:
            end, num_accepted, spec_logprobs = _unpack_verified(packed, end, self.spec, self.spec_top, tokens, logprobs)
            bounds = np.cumsum(self.spec.counts)[:-1]
            spec_tokens = [part.tolist() for part in np.split(self.spec.draft_ids, bounds)]
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
        self.landed = SamplerOutput(tokens, logprobs, self.lora_failures, self.step_path, prompt_logprobs, pooled,
                                    num_accepted, spec_logprobs, spec_tokens)  # fmt: skip
        return self.landed


class Sampler:
    def __init__(self) -> None:
        # CUDA: where the packed results are copied to the host, two buffers in turn (under async
        # scheduling a step's copy is queued before the last one's results are read).
        self._pinned: list[torch.Tensor] = []
        self._turn = 0

    def launch(self, logits: torch.Tensor, batch: SamplingBatch, prompt_logits: torch.Tensor | None = None,
               prompt: PromptLogprobRows | None = None,
               pooled: tuple[torch.Tensor, PoolingRows] | None = None,
               spec_logits: torch.Tensor | None = None, spec: SpecRows | None = None) -> SampledTokens:  # fmt: skip
        """logits: [B, vocab] float32, one row per scheduled request (changed in place). One token id
        per request (the core ignores those of prefill chunks, `batch.sample` False), and the logprobs
        of the requests that asked for them, as `result()` gives them; on a GPU everything stays
        queued, with its copy to the host. `prompt_logits` [R, vocab]: the rows of `prompt`, whose
        prompt tokens' logprobs come back too (raw, as the sampled tokens'). `pooled`: the hidden
        states of the step's pooled tokens, whose sums per chunk come back too. `spec_logits` [S, vocab]:
        the rows of `spec`, whose proposals are verified (how many each request keeps comes back, and
        the token after them)."""
        raw_logprobs = None
        if len(batch.logprobs):  # before any processing
            raw_logprobs = logits.index_select(0, batch.logprobs).log_softmax(dim=-1)
        if len(batch.biased[0]) or len(batch.penalized[0]):
            batch.processors.apply(logits, batch.biased, batch.penalized, batch.repetition, batch.unrecorded)
        if spec is not None and len(spec.penalized_own[0]):  # with the proposals before it counted
            no_rows = spec.penalized_own[0][:0]
            batch.processors.apply(logits, (no_rows, no_rows), spec.penalized_own, spec.repetition,
                                   spec.penalized_own_unrecorded)  # fmt: skip
        _ban_stop_ids(logits, batch.banned, batch)
        tokens = _argmax(logits)
        positions = batch.random[0]
        if len(positions):
            tokens.index_copy_(0, positions, _sample_random(logits, batch))
        packed, asked, top = tokens, [], 0
        if raw_logprobs is not None:
            asked = list(zip(batch.logprobs_at, batch.num_logprobs, strict=True))
            top = min(max(batch.num_logprobs), logits.shape[1])
            packed = torch.cat([tokens, _pack_logprobs(raw_logprobs, tokens.index_select(0, batch.logprobs), top)])
        spec_top = 0
        if spec is not None:
            assert spec_logits is not None
            verified, spec_top = _verify(spec_logits, spec, batch)
            packed = torch.cat([packed, verified])
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
            return SampledTokens(tokens, packed, asked, top, prompt=prompt, prompt_top=prompt_top, pooling=pooling,
                                 spec=spec, spec_top=spec_top)  # fmt: skip
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
        return SampledTokens(tokens, host, asked, top, copied, prompt=prompt, prompt_top=prompt_top, pooling=pooling,
                             spec=spec, spec_top=spec_top)  # fmt: skip


def _sample_random(logits: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    positions, rows = batch.random
    probs, order = _filtered_probs(logits.index_select(0, positions), batch, rows)
    return order.gather(1, _draw(probs, batch.draws)).squeeze(1)


def _filtered_probs(logits: torch.Tensor, batch: SamplingBatch, rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each logits row's distribution after temperature, top-k and top-p (with the parameters of its
    input-batch row), in descending order, unnormalised after top-p; and that order."""
    vocab = logits.shape[1]
    temperature = batch.values[:, TEMPERATURE].index_select(0, rows)
    top_k = batch.ids[:, TOP_K].index_select(0, rows)
    top_k = torch.where(top_k > 0, top_k, vocab)
    top_p = batch.values[:, TOP_P].index_select(0, rows)

    values, order = (logits / temperature[:, None]).sort(dim=-1, descending=True)
    ranks = torch.arange(vocab, device=logits.device)[None, :]
    values = values.masked_fill(ranks >= top_k[:, None], float("-inf"))
    probs = values.softmax(dim=-1)
    # top-p keeps the smallest prefix whose mass reaches top_p: a token stays if the mass before it is < top_p.
    mass_before = probs.cumsum(dim=-1) - probs
    return probs.masked_fill(mass_before >= top_p[:, None], 0.0), order


def _draw(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Each row's index drawn from its (unnormalised) weights with its uniform draw in [0, 1), [n, 1]."""
    cdf = probs.cumsum(dim=-1)
    return torch.searchsorted(cdf, (uniforms * cdf[:, -1])[:, None]).clamp_(max=probs.shape[1] - 1)


def rejection_sample(
    probs: torch.Tensor, drafts: torch.Tensor, u_accept: torch.Tensor, u_resample: torch.Tensor,
    draft_probs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Speculative sampling of proposed tokens `drafts` [n] against the target's distributions
    `probs` [n, vocab] (rows summing to 1): whether each is accepted (with probability
    min(1, p/q)), and the token drawn from the normalised residual max(p - q, 0) in its place.
    `draft_probs` [n, vocab] is the proposer's q; None: it named one token (q = 1 there)."""
    p = probs.gather(1, drafts[:, None]).squeeze(1)
    if draft_probs is None:
        accept = u_accept < p
        residual = probs.scatter(1, drafts[:, None], 0.0)
    else:
        q = draft_probs.gather(1, drafts[:, None]).squeeze(1)
        accept = u_accept * q < p
        residual = (probs - draft_probs).clamp_(min=0.0)
    return accept, _draw(residual, u_resample).squeeze(1)


def _ban_stop_ids(logits: torch.Tensor, banned: tuple[torch.Tensor, torch.Tensor], batch: SamplingBatch) -> None:
    """Before min_tokens, EOS and stop tokens cannot be sampled (vLLM's semantics): -inf at the
    (logits rows, input-batch rows) of `banned`, for each row's stop ids."""
    positions, rows = banned
    if len(positions):
        stop_ids = batch.ids[:, STOP_IDS:].index_select(0, rows)
        # -inf made on the device (a Python float in `logits[...] = ` is a host tensor copied over).
        logits.index_put_((positions[:, None].expand_as(stop_ids), stop_ids), logits.new_full((), float("-inf")))


def _verify(logits: torch.Tensor, spec: SpecRows, batch: SamplingBatch) -> tuple[torch.Tensor, int]:
    """The verifying rows: whether each accepts its proposal, the token each gives in its place, and
    (for the rows asking for logprobs) the logprobs of the token each row emits (its proposal where
    it accepts it), packed; and the top alternatives computed."""
    raw_logprobs = logits.index_select(0, spec.logprobs).log_softmax(dim=-1) if len(spec.logprobs) else None
    if len(spec.biased) or len(spec.penalized):
        batch.processors.apply(logits, (spec.biased, spec.rows.index_select(0, spec.biased)),
                               (spec.penalized, spec.rows.index_select(0, spec.penalized)), spec.repetition,
                               spec.penalized_unrecorded)  # fmt: skip
    _ban_stop_ids(logits, spec.banned, batch)
    replacement = _argmax(logits).to(torch.int64)
    accept = replacement == spec.drafts
    if len(spec.random):
        rows = spec.rows.index_select(0, spec.random)
        sorted_probs, order = _filtered_probs(logits.index_select(0, spec.random), batch, rows)
        probs = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs)
        probs /= probs.sum(dim=1, keepdim=True)
        accepted, resampled = rejection_sample(probs, spec.drafts.index_select(0, spec.random), spec.uniforms[:, 0],
                                               spec.uniforms[:, 1])  # fmt: skip
        accept.index_copy_(0, spec.random, accepted)
        replacement.index_copy_(0, spec.random, resampled)
    packed = torch.cat([accept.to(torch.int64), replacement])
    top = 0
    if raw_logprobs is not None:
        top = min(max(spec.num_logprobs), logits.shape[1])
        emitted = torch.where(accept, spec.drafts, replacement).index_select(0, spec.logprobs)
        packed = torch.cat([packed, _pack_logprobs(raw_logprobs, emitted, top)])
    return packed, top


def _unpack_verified(
    packed: np.ndarray, start: int, spec: SpecRows, top: int, tokens: list[int],
    logprobs: list[TokenLogprobs | None] | None,
) -> tuple[int, list[int], list[list[TokenLogprobs] | None]]:  # fmt: skip
    """`_verify`'s part of the read: each verifying request's leading run of accepted proposals, and
    its token after them written over `tokens` where a proposal was rejected; the logprobs of its
    emitted tokens, if it asked (its last row's from `logprobs` when every proposal was accepted).
    Returns where the part ends too."""
    size = len(spec.draft_ids)
    accept, replacement = packed[start : start + size].astype(bool), packed[start + size : start + 2 * size]
    end = start + 2 * size
    row_logprobs: list[TokenLogprobs | None] = []
    if spec.num_logprobs:
        asking = len(spec.num_logprobs)
        emitted = np.where(accept, spec.draft_ids, replacement)[spec.logprob_rows].tolist()
        row_logprobs = _unpack_logprobs(packed[end : end + _packed_size(asking, top)], emitted,
                                        list(enumerate(spec.num_logprobs)), top)  # fmt: skip
        end += _packed_size(asking, top)
    num_accepted, spec_logprobs, at, asked = [], [], 0, 0
    for position, count in zip(spec.positions, spec.counts, strict=True):
        rejected = np.flatnonzero(~accept[at : at + count])
        accepted = int(rejected[0]) if len(rejected) else count
        if accepted < count:
            tokens[position] = int(replacement[at + accepted])
        num_accepted.append(accepted)
        if logprobs is not None and logprobs[position] is not None:
            rows = row_logprobs[asked : asked + min(accepted + 1, count)]
            spec_logprobs.append([*rows, *([logprobs[position]] if accepted == count else [])])  # type: ignore[list-item]
            asked += count
        else:
            spec_logprobs.append(None)
        at += count
    return end, num_accepted, spec_logprobs


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
