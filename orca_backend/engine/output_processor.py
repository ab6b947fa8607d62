"""The output processor: turns the core's per-iteration token ids into each request's output events.

It runs beside the engine core, not inside its iteration: incremental detokenization and
stop-string search happen here (on the output thread of a launched engine, or after each `step()`
offline). A stop string ends the request here, at once, with reason "stop" and the text cut before
the stop; the core hears of it as an abort with that reason and frees the request's K/V, and any
tokens it produced meanwhile are dropped.

Detokenization is exact and incremental: streamed text deltas must concatenate to exactly the final
text and never split a multi-byte character (genai-perf re-tokenizes them to count tokens).
Byte-level BPE tokens can end inside a UTF-8 character, so text is only released once the decoded
tail no longer ends in U+FFFD; a few tokens of left context are re-decoded so merges across the
boundary come out right. Bytes that never complete a character (a model may emit continuation bytes
forever) are released as U+FFFD once _MAX_PENDING_TOKENS are waiting, as a final decode would show
them: the decoded window stays bounded, so each token costs the shared output thread the same,
however long the stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from orca_backend.messages import (
    CoreOutput,
    CoreOutputs,
    EngineOverloadedError,
    FinishReason,
    RequestMetrics,
    TokenLogprobs,
)
from orca_backend.sampling_params import SamplingParams
from orca_backend.tokenizer import Tokenizer

logger = logging.getLogger("orca.engine")


@dataclass(slots=True)
class Logprob:
    """One token's log-probability under the model's raw logits (vLLM's default "raw_logprobs":
    before logit_bias, penalties, temperature, top-k and top-p; a structured-output request's logits
    are masked first, as in vLLM v1, so a token its grammar forbids has -inf)."""

    logprob: float
    rank: int  # 1 + the number of tokens of the vocabulary more likely
    decoded_token: str  # tokenizer.decode([token id]) ("" without a tokenizer)


@dataclass(slots=True)  # one per request per iteration: slots make it cheaper to build
class RequestOutput:
    """One event on a request's stream: what is new since the previous event.

    Every request gets at least one event; the last has ``finished`` set and a ``finish_reason``
    (TIMEOUT, ERROR and INVALID with ``error`` holding the message).
    """

    request_id: str
    new_token_ids: list[int]
    new_text: str  # exact incremental detokenization ("" without a tokenizer)
    finished: bool
    finish_reason: FinishReason | None
    num_input_tokens: int
    num_output_tokens: int
    time: float  # time.perf_counter() when the event was handed to its sink
    error: str | None = None
    # With SamplingParams.logprobs set (else None): one dict per token of `new_token_ids`, in order,
    # holding the sampled token (with its own rank) and the top `logprobs` alternatives (ranks
    # 1..k), so k or k + 1 entries; and the sum of the sampled tokens' logprobs so far.
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    # With SamplingParams.prompt_logprobs set, on the event of the first token (else None): one entry
    # per prompt token, None for the first (nothing precedes it), then a dict as `logprobs` has, the
    # prompt token first (with its own rank) and the top `prompt_logprobs` alternatives (vLLM's shape).
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # With n > 1: the sample the event is of, 0..n-1 (each sample has its own events, and its own final
    # one; the request's id is every sample's).
    index: int = 0
    embedding: list[float] | None = None  # an embedding request's, on its final event
    # On the final event: the request's timeline and counts (arrival, first scheduled, first and last
    # token, on time.monotonic()), for the latency histograms and `return_perf_metrics`.
    metrics: RequestMetrics | None = None


OutputSink = Callable[[RequestOutput], None]


@dataclass
class _RequestState:
    sink: OutputSink
    num_prompt_tokens: int
    output_ids: list[int]
    sent_ids_len: int = 0
    detok: DetokenizerState | None = None  # None without a tokenizer
    cumulative_logprob: float | None = None  # 0.0 from the start when the request asked for logprobs
    arrival_time: float = 0.0  # time.monotonic() when the frontend took it
    first_token_time: float | None = None  # time.monotonic() when its first token was handed out


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer | None, max_queued_requests: int = 0, max_queued_prompt_tokens: int = 0) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}
        # Ended here (a stop string, a failed event) while the core still holds them: their ids stay in
        # use until the core's own final output for them arrives, so a new request cannot take the id
        # of one the core and the runners still hold.
        self._retiring: set[str] = set()
        self._lock = threading.Lock()  # guards id registration against the thread that processes
        # Admission control: requests registered that have had no event yet (waiting, or in their
        # first iteration), with their prompt tokens. 0 means no limit.
        self.max_queued_requests = max_queued_requests
        self.max_queued_prompt_tokens = max_queued_prompt_tokens
        self._queued: dict[str, int] = {}
        self._queued_tokens = 0
        self._token_texts: dict[int, str] = {}  # at most the vocabulary, filled by logprobs requests only

    @property
    def num_queued(self) -> tuple[int, int]:
        """(requests, prompt tokens) registered that have not had an event yet."""
        return len(self._queued), self._queued_tokens

    def add(self, request_ids: list[str], prompts: list[list[int]], params: list[SamplingParams],
            sinks: list[OutputSink], arrival_time: float = 0.0) -> None:  # fmt: skip
        """Registers requests before the core sees them; a ValueError if an id is still in use, an
        EngineOverloadedError if the queue is not empty and taking them would pass a queue limit
        (into an empty queue anything goes, so no request is refused for its size alone)."""
        with self._lock:
            clash = sorted({rid for rid in request_ids if rid in self._states or rid in self._retiring})
            if clash or len(set(request_ids)) != len(request_ids):
                raise ValueError(f"request id already in use: {clash or request_ids}")
            self._check_queue(len(request_ids), sum(len(p) for p in prompts))
            for rid, prompt, p, sink in zip(request_ids, prompts, params, sinks, strict=True):
                detok = DetokenizerState(list(prompt), p.stop) if self.tokenizer is not None else None
                cumulative = None if p.logprobs is None else 0.0
                self._states[rid] = _RequestState(sink, len(prompt), [], detok=detok, cumulative_logprob=cumulative,
                                                  arrival_time=arrival_time)  # fmt: skip
                self._queued[rid] = len(prompt)
                self._queued_tokens += len(prompt)

    def _check_queue(self, requests: int, tokens: int) -> None:
        queued, queued_tokens = len(self._queued), self._queued_tokens
        if not queued:
            return
        if self.max_queued_requests and queued + requests > self.max_queued_requests:
            limit = f"{queued} requests queued, max_queued_requests={self.max_queued_requests}"
        elif self.max_queued_prompt_tokens and queued_tokens + tokens > self.max_queued_prompt_tokens:
            limit = f"{queued_tokens} prompt tokens queued, max_queued_prompt_tokens={self.max_queued_prompt_tokens}"
        else:
            return
        raise EngineOverloadedError(f"the engine's queue is full ({limit}): retry later")

    def _dequeue(self, request_id: str) -> None:
        """The request had its first event: it no longer counts against the queue limits."""
        with self._lock:
            self._dequeue_locked(request_id)

    def _dequeue_locked(self, request_id: str) -> None:
        tokens = self._queued.pop(request_id, None)
        if tokens is not None:
            self._queued_tokens -= tokens

    def discard(self, request_ids: list[str]) -> None:
        """Forgets requests the core never accepted."""
        with self._lock:
            for rid in request_ids:
                self._dequeue_locked(rid)
                self._states.pop(rid, None)

    def process(self, outputs: CoreOutputs) -> list[str]:
        """Hands every request its event; returns the ids the core must abort (a stop string ended
        them, or making its event failed). One request's failure here (its text, its logprobs, its
        sink) ends that request alone with an error event: the rest of the step's events, finals
        included, are handed out all the same."""
        now, mono = time.perf_counter(), time.monotonic()
        to_abort: list[str] = []
        states, queued = self._states, self._queued
        # The columns (most of every step): one new token each, and the request goes on. Without text
        # to make, the event is that token; with text, the token takes the general path.
        for request_id, token in zip(outputs.request_ids, outputs.token_ids, strict=True):
            if queued and request_id in queued:  # its first event: a plain dict read, the lock only then
                self._dequeue(request_id)
            state = states.get(request_id)
            if state is None:  # a stop string already ended it: later tokens are dropped
                continue
            if state.first_token_time is None:
                state.first_token_time = mono
            try:
                if state.detok is not None or state.cumulative_logprob is not None:
                    self._hand_out(state, CoreOutput(request_id, [token]), now, to_abort)
                    continue
                output_ids = state.output_ids
                output_ids.append(token)
                num_output = state.sent_ids_len = len(output_ids)
                state.sink(RequestOutput(request_id, [token], "", False, None, state.num_prompt_tokens, num_output,
                                         now))  # fmt: skip
            except Exception as exc:  # noqa: BLE001 - that request alone ends
                self._fail_one(request_id, state, exc, now, to_abort)
        for out in outputs.others:
            if out.request_id in queued:
                self._dequeue(out.request_id)
            state = states.get(out.request_id)
            if state is not None:
                if state.first_token_time is None and out.new_token_ids:
                    state.first_token_time = mono
                try:
                    self._hand_out(state, out, now, to_abort)
                except Exception as exc:  # noqa: BLE001 - that request alone ends
                    self._fail_one(out.request_id, state, exc, now, to_abort, running=not out.finished)
            elif out.finished and self._retiring:  # the core let go of one ended here: its id is free
                with self._lock:
                    self._retiring.discard(out.request_id)
        if to_abort:
            with self._lock:
                self._retiring.update(to_abort)
        return to_abort

    def _fail_one(self, request_id: str, state: _RequestState, exc: Exception, now: float, to_abort: list[str],
                  running: bool = True) -> None:  # fmt: skip
        """Ends a request whose event could not be made or handed out: an error event (if its sink
        takes one), and the core aborts it if it still runs."""
        logger.exception("output processing failed for request %s; ending it", request_id)
        with self._lock:
            if self._states.pop(request_id, None) is None:
                return  # already ended (its final event was handed out before the failure)
        if running:
            to_abort.append(request_id)
        logprobs = None if state.cumulative_logprob is None else []
        try:
            state.sink(RequestOutput(request_id, [], "", True, FinishReason.ERROR, state.num_prompt_tokens,
                                     len(state.output_ids), now, f"output processing failed: {exc}", logprobs,
                                     state.cumulative_logprob, self._final_metrics(state, None)))  # fmt: skip
        except Exception:  # noqa: BLE001 - a sink that cannot take even this: logged above, nothing more to do
            logger.exception("request %s's sink refused its error event", request_id)

    def _hand_out(self, state: _RequestState, out: CoreOutput, now: float, to_abort: list[str]) -> None:
        """One output's event: its tokens, its text (a stop string ends the request here) and logprobs."""
        request_id = out.request_id
        finished, reason = out.finished, out.finish_reason
        output_ids = state.output_ids
        if state.detok is None:  # no text to make: the core's new ids are the event's
            new_ids = out.new_token_ids
            output_ids += new_ids
            new_text = ""
        else:
            if self._stop_string_hit(state, out):
                if not finished:
                    to_abort.append(request_id)
                finished, reason = True, FinishReason.STOP
            new_text = take_releasable_text(state.detok, finished)
            new_ids = output_ids[state.sent_ids_len :]
        state.sent_ids_len = len(output_ids)
        event = RequestOutput(request_id, new_ids, new_text, finished, reason, state.num_prompt_tokens,
                              len(output_ids), now, out.error)  # fmt: skip
        if state.cumulative_logprob is not None and out.logprobs is not None:
            # A stop string may have cut this output's tokens: its first len(new_ids) are the ones taken.
            self._add_logprobs(event, state, out.logprobs[: len(new_ids)])
        event.embedding = out.embedding
        if out.prompt_logprobs is not None:
            if len(out.prompt_logprobs) != state.num_prompt_tokens - 1:
                raise RuntimeError(f"request {request_id}: {len(out.prompt_logprobs)} prompt logprobs for "
                                   f"{state.num_prompt_tokens} prompt tokens")  # fmt: skip
            event.prompt_logprobs = [None, *self._logprob_dicts(out.prompt_logprobs)]
        if finished:
            with self._lock:
                del self._states[request_id]
            event.metrics = self._final_metrics(state, out.metrics)
        state.sink(event)

    @staticmethod
    def _final_metrics(state: _RequestState, core: RequestMetrics | None) -> RequestMetrics:
        """The core's account of the request (none when the frontend ended it: a stop string, a
        failure here, the core's death) with its first and last token's times added."""
        metrics = core or RequestMetrics(state.arrival_time, None, 0, 0)
        metrics.first_token_time = state.first_token_time
        metrics.last_token_time = time.monotonic() if state.output_ids else None
        return metrics

    def fail_all(self, reason: str) -> None:
        """Ends every registered request with an error event (the core that held them is gone)."""
        with self._lock:
            failed, self._states = self._states, {}
            self._queued, self._queued_tokens = {}, 0
        now = time.perf_counter()
        for request_id, state in failed.items():
            logprobs = None if state.cumulative_logprob is None else []
            state.sink(RequestOutput(request_id, [], "", True, FinishReason.ERROR, state.num_prompt_tokens, len(state.output_ids),
                                     now, reason, logprobs, state.cumulative_logprob,
                                     self._final_metrics(state, None)))  # fmt: skip

    def _add_logprobs(self, event: RequestOutput, state: _RequestState, logprobs: list[TokenLogprobs]) -> None:
        """The event's logprob dicts and running total: the sampled token first, with its own rank (a
        token tied with it in the top k keeps that rank), then the top-k alternatives."""
        assert state.cumulative_logprob is not None
        if len(logprobs) != len(event.new_token_ids):
            raise RuntimeError(f"request {event.request_id}: {len(event.new_token_ids)} new tokens but "
                               f"{len(logprobs)} logprobs")  # fmt: skip
        for _, values, _ in logprobs:
            state.cumulative_logprob += values[0]
        event.logprobs, event.cumulative_logprob = self._logprob_dicts(logprobs), state.cumulative_logprob

    def _logprob_dicts(self, logprobs: list[TokenLogprobs]) -> list[dict[int, Logprob]]:
        """One dict per token: the scored token first, with its own rank (a token tied with it in the
        top k keeps that rank), then the top-k alternatives."""
        dicts = []
        texts = self._token_texts  # each token decoded alone once: the top-k repeat from token to token
        for ids, values, ranks in logprobs:
            entry: dict[int, Logprob] = {}
            for token, value, rank in zip(ids, values, ranks, strict=True):
                if token not in entry:
                    text = texts.get(token)
                    if text is None:
                        text = texts[token] = self.tokenizer.decode([token]) if self.tokenizer is not None else ""
                    entry[token] = Logprob(value, rank, text)
            dicts.append(entry)
        return dicts

    def _stop_string_hit(self, state: _RequestState, out: CoreOutput) -> bool:
        """Detokenizes the new tokens; True if a stop string completed (text cut before it, later
        tokens not taken). Token by token when stop strings are set, so the cut is exact even when
        one output carries several tokens (request-level mode releases a batch's tokens at once)."""
        detok = state.detok
        assert detok is not None and self.tokenizer is not None
        chunks = [[t] for t in out.new_token_ids] if detok.stop else [out.new_token_ids]
        for i, chunk in enumerate(chunks):
            state.output_ids += chunk
            detok.token_ids += chunk
            last = i == len(chunks) - 1
            update_text(self.tokenizer, detok, final=out.finished and last)
            stop_at = find_stop(detok)
            if stop_at is not None:
                detok.text = detok.text[:stop_at]
                return True
        return False


# ---------------------------------------------------------------- incremental detokenization
# One request's text as its tokens arrive (module docstring): the output processor's per-request
# state and the three steps it takes on each output.
_CONTEXT_TOKENS = 5
_MAX_PENDING_TOKENS = 8  # a UTF-8 character spans at most 4 bytes, so at most 4 byte-level tokens


@dataclass
class DetokenizerState:
    token_ids: list[int]  # the prompt, then every output token as it arrives
    stop: list[str]
    text: str = ""  # output text decoded so far (without an incomplete trailing character)
    sent_text_len: int = 0
    prefix_offset: int = 0
    read_offset: int = 0
    max_stop_len: int = field(init=False)

    def __post_init__(self) -> None:
        self.read_offset = len(self.token_ids)
        self.prefix_offset = max(len(self.token_ids) - _CONTEXT_TOKENS, 0)
        self.max_stop_len = max((len(s) for s in self.stop), default=0)


def update_text(tokenizer: Tokenizer, state: DetokenizerState, final: bool = False) -> None:
    """Appends the text of the newest tokens to `state.text` once it is complete.

    With `final` (the request has ended) whatever is left is appended, even an incomplete character.
    """
    ids = state.token_ids
    prefix_text = tokenizer.decode(ids[state.prefix_offset : state.read_offset])
    full_text = tokenizer.decode(ids[state.prefix_offset :])
    complete = final or not full_text.endswith("\ufffd") or len(ids) - state.read_offset >= _MAX_PENDING_TOKENS
    if len(full_text) > len(prefix_text) and complete:
        state.text += full_text[len(prefix_text) :]
        state.prefix_offset = state.read_offset
        state.read_offset = len(ids)


def find_stop(state: DetokenizerState) -> int | None:
    """Index in `state.text` where the earliest stop string begins, if one appeared in new text."""
    if not state.stop:
        return None
    # Only text not yet released can hold a new match; step back so a stop spanning the boundary counts.
    window = max(state.sent_text_len - state.max_stop_len, 0)
    hits = [i for i in (state.text.find(s, window) for s in state.stop) if i >= 0]
    return min(hits) if hits else None


def take_releasable_text(state: DetokenizerState, finished: bool) -> str:
    """Text safe to send now, marked as sent: while a stop string may still be completing, its
    possible prefix is held back."""
    end = len(state.text)
    if state.stop and not finished:
        end = max(end - (state.max_stop_len - 1), state.sent_text_len)
    new_text = state.text[state.sent_text_len : end]
    state.sent_text_len += len(new_text)
    return new_text
