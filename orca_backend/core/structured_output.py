"""Structured output in the engine core: a request's constraint (sampling_params.StructuredOutputSpec)
compiled with xgrammar against the model's tokenizer, each constrained request's grammar matcher, and the
token bitmasks that the workers apply to its logits (worker/bitmask.py).

vLLM v1's design: the matchers live here, beside the scheduler. A constrained request waits, not admitted,
until its grammar has compiled on a background thread (`StructuredOutputManager`; vLLM's WAITING_FOR_FSM);
each step the core fills a bitmask row for every constrained request that samples in the batch and sends
the rows with it (`SchedulerOutput.bitmask`); when the batch returns, each constrained request's matcher accepts
its sampled token (`Scheduler.update_from_output`), never a failed batch's nor a prefill chunk's that
sampled nothing.

The pieces, each usable alone:
- `grammar_for` checks a spec without a tokenizer, well under a millisecond;
- `StructuredOutputCompiler` compiles a spec against the model's tokenizer and vocabulary, with a bounded
  cache, turning every malformed schema/regex/grammar into a ValueError for that request alone;
- `StructuredOutputMatchers` keeps each constrained request's matcher state: it fills bitmask rows for
  the next step and accepts the sampled tokens;
- `StructuredOutputManager` is the engine core's: compiles off the loop, holds the matchers, and hands
  the bitmask rows over as SchedulerOutput carries them.

A bitmask row is xgrammar's layout: int32 words, ceil(vocab_size / 32) per row, bit (id % 32) of word
(id // 32) set when token `id` is allowed. When a grammar is complete the matcher allows only EOS (plus
whatever could still extend the text, e.g. more digits after `\\d+`); once it has accepted EOS it is
terminated, and the request ends.

xgrammar (which imports torch: about 1 s in a process that has torch) and torch are imported where they
are used: the frontend imports this package's scheduler, and must stay free of torch.
"""

from __future__ import annotations

import json
import logging
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from orca_backend.messages import FinishReason
from orca_backend.sampling_params import StructuredOutputSpec

if TYPE_CHECKING:
    import torch
    import xgrammar as xgr

logger = logging.getLogger("orca.engine")


# --------------------------------------------------------------------------------------- compiling
def build_tokenizer_info(tokenizer_file: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> xgr.TokenizerInfo:
    """xgrammar's view of a Hugging Face tokenizer.json, built without `transformers`.

    The vocabulary is the tokenizer's, cut or padded to the model's `vocab_size`: ids the tokenizer lacks
    (lm_head padding) and special tokens other than EOS get an empty string, which xgrammar treats as
    special, i.e. never allowed (`skip_special_tokens` decoding would drop them from the text anyway).
    The vocab type says how tokens spell bytes: GPT-2 style byte-level BPE, Llama/sentencepiece style
    ("▁" for space, <0xNN> pieces) or raw; it is read from the tokenizer's decoder.
    """
    import xgrammar as xgr
    from tokenizers import Tokenizer as HFTokenizer

    text = Path(tokenizer_file).read_text(encoding="utf-8")
    config = json.loads(text)
    hf = HFTokenizer.from_str(text)
    encoded = [""] * vocab_size
    for token, token_id in hf.get_vocab(with_added_tokens=True).items():
        if token_id < vocab_size:
            encoded[token_id] = token
    for token_id, added in hf.get_added_tokens_decoder().items():
        if added.special and token_id < vocab_size and token_id not in eos_token_ids:
            encoded[token_id] = ""
    return xgr.TokenizerInfo(encoded, _vocab_type(config), vocab_size=vocab_size,
                             stop_token_ids=list(eos_token_ids), add_prefix_space=_adds_prefix_space(config))


def _parts(component: Any, list_key: str) -> list[dict]:
    """A tokenizer.json component (decoder, normalizer, pre_tokenizer) as its flat list of steps."""
    if not isinstance(component, dict):
        return []
    if component.get("type") == "Sequence":
        return [part for child in component.get(list_key, []) for part in _parts(child, list_key)]
    return [component]


def _vocab_type(config: dict) -> xgr.VocabType:
    import xgrammar as xgr

    decoders = _parts(config.get("decoder"), "decoders")
    types = {d.get("type") for d in decoders}
    if "ByteLevel" in types:
        return xgr.VocabType.BYTE_LEVEL
    # xgrammar's BYTE_FALLBACK decodes both <0xNN> pieces and "▁" as space, which also covers a
    # sentencepiece vocabulary without byte pieces (Metaspace decoder, or a Replace of "▁").
    if ("ByteFallback" in types or "Metaspace" in types
            or any(d.get("type") == "Replace" and d.get("pattern", {}).get("String") == "▁" for d in decoders)
            or config.get("model", {}).get("byte_fallback")):
        return xgr.VocabType.BYTE_FALLBACK
    if any(p.get("type") == "ByteLevel" for p in _parts(config.get("pre_tokenizer"), "pretokenizers")):
        return xgr.VocabType.BYTE_LEVEL  # a byte-level tokenizer saved without its decoder
    return xgr.VocabType.RAW


def _adds_prefix_space(config: dict) -> bool:
    normalizers = _parts(config.get("normalizer"), "normalizers")
    if any(n.get("type") == "Prepend" and n.get("prepend") == "▁" for n in normalizers):
        return True
    for p in _parts(config.get("pre_tokenizer"), "pretokenizers"):
        if p.get("type") == "Metaspace" and (p.get("prepend_scheme") in ("first", "always") or p.get("add_prefix_space")):
            return True
        if p.get("type") == "ByteLevel" and p.get("add_prefix_space"):
            return True
    return False


# xgrammar reports errors as RuntimeError("[12:00:00] /project/cpp/x.cc:42: Check failed: (...) is false: msg").
_XGR_PREFIX = re.compile(r"^\s*\[[\d:]+\]\s+\S+:\d+:\s*(Check failed: .*? is false:\s*)?")


def _xgrammar_message(exc: Exception) -> str:
    return _XGR_PREFIX.sub("", str(exc)).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


class StructuredOutputCompiler:
    """Compiles specs for one model: its tokenizer, its vocabulary size (the logits' width) and its EOS.

    Compiled grammars are cached by spec, least recently used first out: xgrammar's own cache is off
    because it has no bound by default, and every distinct schema a client sends would stay forever.
    """

    def __init__(self, tokenizer_file: str | Path, vocab_size: int, eos_token_ids: int | Sequence[int], *,
                 cache_size: int = 256, max_threads: int = 1) -> None:
        # One thread by default: compiling shares the machine with the serving loop, a JSON schema takes
        # tens of ms on one core, and xgrammar's default of 8 threads made no schema faster on 2 cores
        # while adding ~3 ms of thread start-up to every small regex or choice.
        import xgrammar as xgr

        eos = [eos_token_ids] if isinstance(eos_token_ids, int) else list(eos_token_ids)
        if not eos:
            raise ValueError("structured output needs the model's EOS token id: a finished grammar ends on it")
        if not all(0 <= t < vocab_size for t in eos):
            raise ValueError(f"EOS token ids {eos} must be within the vocabulary [0, {vocab_size})")
        self.vocab_size = vocab_size
        self.eos_token_ids: tuple[int, ...] = tuple(eos)
        self.tokenizer_info = build_tokenizer_info(tokenizer_file, vocab_size, self.eos_token_ids)
        self._compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max_threads, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputSpec, xgr.CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()  # compile() may be called from a thread pool

    def compile(self, spec: StructuredOutputSpec) -> xgr.CompiledGrammar:
        """The compiled grammar for `spec`; ValueError (naming the problem) when it is malformed."""
        with self._lock:
            if spec in self._cache:
                self._cache.move_to_end(spec)
                return self._cache[spec]
        grammar = grammar_for(spec)
        try:
            compiled = self._compiler.compile_grammar(grammar)
        except RuntimeError as exc:
            raise ValueError(f"invalid {spec.kind} for structured output: {_xgrammar_message(exc)}") from None
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled


def grammar_for(spec: StructuredOutputSpec) -> xgr.Grammar:
    """The spec as an xgrammar Grammar, without a tokenizer: fractions of a millisecond, the cheap way to
    refuse a malformed schema/regex/grammar (ValueError) before the tokenizer-bound compile."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            # Passed as is. Note xgrammar 0.2.8 turns a string with minLength/maxLength into a character
            # class that admits raw control characters and no escapes (mlc-ai/xgrammar#800).
            return xgr.Grammar.from_json_schema(spec.value, any_whitespace=spec.any_whitespace)
        if spec.kind == "json_object":  # any JSON object, as OpenAI's response_format json_object
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=spec.any_whitespace)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.value)
        if spec.kind == "choice":
            # json.dumps quotes and escapes a string the way xgrammar's EBNF string literals read it.
            return xgr.Grammar.from_ebnf("root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.value))
        if spec.kind == "grammar":
            return xgr.Grammar.from_ebnf(spec.value)
    except RuntimeError as exc:  # xgrammar's way to say the input is malformed or unsupported
        raise ValueError(f"invalid {spec.kind} for structured output: {_xgrammar_message(exc)}") from None
    raise ValueError(f"unknown structured output kind {spec.kind!r}")


# -------------------------------------------------------------------------------- per-request state
class StructuredOutputMatchers:
    """Each constrained request's grammar matcher, by request id."""

    def __init__(self, compiler: StructuredOutputCompiler) -> None:
        self.compiler = compiler
        self._matchers: dict[str, xgr.GrammarMatcher] = {}
        # What a terminated request may still emit: EOS alone (xgrammar refuses to fill a mask then).
        self._eos_row = _row_allowing(compiler.eos_token_ids, compiler.vocab_size)

    def add(self, request_id: str, grammar: StructuredOutputSpec | xgr.CompiledGrammar) -> None:
        """Starts a request's matcher; compiles a spec (ValueError when malformed) unless given compiled
        (which must have been compiled, or deserialized, with this compiler's tokenizer_info)."""
        import xgrammar as xgr

        compiled = self.compiler.compile(grammar) if isinstance(grammar, StructuredOutputSpec) else grammar
        self._matchers[request_id] = xgr.GrammarMatcher(compiled)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._matchers

    def __len__(self) -> int:
        return len(self._matchers)

    def allocate_bitmask(self, num_rows: int) -> torch.Tensor:
        import xgrammar as xgr

        return xgr.allocate_token_bitmask(num_rows, self.compiler.vocab_size)

    def fill_bitmask(self, request_ids: Sequence[str], bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Row i of the (CPU, int32) bitmask becomes the allowed next tokens of request_ids[i]."""
        if bitmask is None:
            bitmask = self.allocate_bitmask(len(request_ids))
        for row, request_id in enumerate(request_ids):
            matcher = self._matchers[request_id]
            if matcher.is_terminated():
                bitmask[row] = self._eos_row
            else:
                matcher.fill_next_token_bitmask(bitmask, row)
        return bitmask

    def fill_bitmask_along(self, request_id: str, tokens: Sequence[int], bitmask: torch.Tensor, row: int) -> None:
        """Speculative decoding: rows row .. row + len(tokens) of the bitmask become the request's allowed
        next tokens before each of `tokens` and after the last (each must be accepted in turn:
        `valid_prefix`); the matcher's state is left as it was."""
        matcher = self._matchers[request_id]
        for i, token in enumerate(tokens):
            self.fill_bitmask([request_id], bitmask[row + i : row + i + 1])
            if not matcher.accept_token(token):
                if i:
                    matcher.rollback(i)
                raise ValueError(f"request {request_id}: proposed token {token} breaks its grammar")
        self.fill_bitmask([request_id], bitmask[row + len(tokens) : row + len(tokens) + 1])
        if tokens:
            matcher.rollback(len(tokens))

    def valid_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        """Speculative decoding: how many of `tokens`, in order, the request's grammar accepts from its
        state (left as it was)."""
        matcher = self._matchers[request_id]
        accepted = 0
        for token in tokens:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            accepted += 1
        if accepted:
            matcher.rollback(accepted)
        return accepted

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advances the request's matcher by its sampled token. False (state unchanged) means the token
        breaks the grammar, or follows the accepted EOS: the caller must end the request with an error.
        Every request id passed here, or to fill_bitmask / is_terminated, must have been added."""
        matcher = self._matchers[request_id]
        return not matcher.is_terminated() and matcher.accept_token(token_id)

    def is_terminated(self, request_id: str) -> bool:
        """True once the request's grammar is complete and EOS was accepted."""
        return self._matchers[request_id].is_terminated()

    def remove(self, request_id: str) -> None:
        self._matchers.pop(request_id, None)


def _row_allowing(token_ids: Sequence[int], vocab_size: int) -> torch.Tensor:
    import torch

    words = [0] * ((vocab_size + 31) // 32)
    for token_id in token_ids:
        words[token_id // 32] |= 1 << (token_id % 32)
    return torch.tensor([w - (1 << 32) if w >= 1 << 31 else w for w in words], dtype=torch.int32)  # as int32


@dataclass(eq=False)
class _Compile:
    """One request's grammar compile: what it compiles, its future, and when a thread started it."""

    spec: StructuredOutputSpec
    future: Future[Any] = field(init=False)
    started_at: float | None = None  # set on the compile thread


# ------------------------------------------------------------------------------ the engine core's
class StructuredOutputManager:
    """The engine core's structured output, used from its loop thread: compiles grammars on one background
    thread, holds each admitted constrained request's matcher, fills a batch's bitmask rows and advances
    matchers by sampled tokens.

    The compiler is built by the first compile, on the compile thread (reading the tokenizer's vocabulary
    and importing xgrammar take a while: never on the loop). One thread: compiling shares the machine
    with the forward, and xgrammar releases the GIL while it compiles, so the loop goes on meanwhile.
    `wake` is called (on the compile thread) when a compile ends: the core's loop, idle while requests
    only wait for their grammars, wakes up to admit them.
    """

    def __init__(self, tokenizer_file: str | Path | None, vocab_size: int, eos_token_id: int | None,
                 wake: Callable[[], None] | None = None, compile_timeout_s: float = 0.0) -> None:  # fmt: skip
        self._tokenizer_file = tokenizer_file
        self._vocab_size = vocab_size
        self._eos_token_id = eos_token_id
        self._wake = wake
        # A compile running longer than this fails its request (0: no limit); see poll().
        self._compile_timeout_s = compile_timeout_s
        self._compiler: StructuredOutputCompiler | None = None  # written by the compile threads only
        self._matchers: StructuredOutputMatchers | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pending: dict[str, _Compile] = {}  # request id -> its compile

    @property
    def num_pending(self) -> int:
        return len(self._pending)

    @property
    def num_matchers(self) -> int:
        return 0 if self._matchers is None else len(self._matchers)

    def submit(self, request_id: str, spec: StructuredOutputSpec) -> None:
        """Starts compiling a request's grammar; `poll` says when it is done."""
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orca-grammar")
        task = _Compile(spec)
        task.future = self._pool.submit(self._compile, task)
        self._pending[request_id] = task
        if self._wake is not None:
            wake = self._wake
            task.future.add_done_callback(lambda _: wake())

    def _compile(self, task: _Compile) -> xgr.CompiledGrammar:  # on a compile thread
        task.started_at = time.monotonic()
        spec = task.spec
        if self._compiler is None:
            if self._tokenizer_file is None or self._eos_token_id is None:
                raise RuntimeError("structured output needs the model's tokenizer.json and EOS token id, and this "
                                   "model lacks one")  # fmt: skip
            try:
                self._compiler = StructuredOutputCompiler(self._tokenizer_file, self._vocab_size, self._eos_token_id)
            except Exception as exc:  # the server's problem, not the request's: not a ValueError
                raise RuntimeError(f"cannot build the grammar compiler from {self._tokenizer_file}: {exc}") from exc
        return self._compiler.compile(spec)

    def poll(self) -> list[tuple[str, FinishReason | None, str | None]]:
        """The requests whose compile has ended, each as (request id, None, None) when its matcher is
        ready, or (request id, finish reason, message) when it cannot run: INVALID for a malformed
        schema/regex/grammar (the client's to fix), ERROR for anything else."""
        results = self._expire_compiles()
        done = [request_id for request_id, task in self._pending.items() if task.future.done()]
        for request_id in done:
            future = self._pending.pop(request_id).future
            try:
                compiled = future.result()
            except ValueError as exc:
                results.append((request_id, FinishReason.INVALID, str(exc)))
                continue
            except Exception as exc:  # noqa: BLE001 - that request alone fails
                logger.warning("structured output failed for %s: %s", request_id, exc)
                results.append((request_id, FinishReason.ERROR, f"structured output failed: {exc}"))
                continue
            if self._matchers is None:
                assert self._compiler is not None  # built by the compile that just succeeded
                self._matchers = StructuredOutputMatchers(self._compiler)
            self._matchers.add(request_id, compiled)
            results.append((request_id, None, None))
        return results

    def _expire_compiles(self) -> list[tuple[str, FinishReason | None, str | None]]:
        """Fails the requests whose compile has run past the timeout (INVALID: the constraint is too
        complex for this deployment). A compile cannot be stopped once it runs, so its thread is left
        to finish alone and the compiles queued behind it move to a fresh thread: one pathological
        grammar never holds up the others for longer than the timeout."""
        limit = self._compile_timeout_s
        if not limit or not self._pending:
            return []
        now = time.monotonic()
        expired = [request_id for request_id, task in self._pending.items()
                   if not task.future.done() and task.started_at is not None and now - task.started_at > limit]
        if not expired:
            return []
        for request_id in expired:
            logger.warning("structured output for %s did not compile within %g s; abandoning that compile",
                           request_id, limit)
            del self._pending[request_id]
        assert self._pool is not None
        old, self._pool = self._pool, ThreadPoolExecutor(max_workers=1, thread_name_prefix="orca-grammar")
        for request_id, task in list(self._pending.items()):
            if task.future.cancel():  # still queued on the stuck thread: start it again on the new one
                self._pending.pop(request_id)
                self.submit(request_id, task.spec)
        old.shutdown(wait=False)
        message = (f"its structured-output constraint did not compile within {limit:g} s "
                   "(structured_output_compile_timeout_s): simplify it")
        return [(request_id, FinishReason.INVALID, message) for request_id in expired]

    def wait(self, timeout_s: float) -> None:
        """Blocks until every pending compile has ended (or the timeout): a caller with nothing else to run
        waits here instead of spinning, and then admits the requests together, in arrival order."""
        if self._pending:
            wait_futures([task.future for task in self._pending.values()], timeout=timeout_s)

    def fill_bitmask(self, request_ids: Sequence[str]) -> bytes:
        """The next-token bitmask rows of these requests (in this order), as SchedulerOutput carries them: the
        int32 words, row after row."""
        assert self._matchers is not None
        return self._matchers.fill_bitmask(request_ids).numpy().tobytes()

    def fill_bitmask_speculative(self, request_ids: Sequence[str], proposals: Sequence[Sequence[int]]) -> tuple[bytes, bytes]:
        """The bitmask rows of requests that verify proposals (`proposals[i]`, each a valid prefix):
        each one's row after all its proposals (what its own logits row samples), and its rows before
        each proposal (those verifying them), in order, as SchedulerOutput's `bitmask` and `spec_bitmask`."""
        assert self._matchers is not None
        rows = [len(p) + 1 for p in proposals]
        bitmask = self._matchers.allocate_bitmask(sum(rows))
        at = 0
        for request_id, tokens in zip(request_ids, proposals, strict=True):
            self._matchers.fill_bitmask_along(request_id, tokens, bitmask, at)
            at += len(tokens) + 1
        words = bitmask.numpy()
        ends = np.cumsum(rows) - 1
        return words[ends].tobytes(), np.delete(words, ends, axis=0).tobytes()

    def valid_prefix(self, request_id: str, tokens: Sequence[int]) -> int:
        """How many of the proposed `tokens` the request's grammar accepts in order (state unchanged)."""
        assert self._matchers is not None
        return self._matchers.valid_prefix(request_id, tokens)

    def accept(self, request_id: str, token_id: int) -> bool:
        """Advances the request's matcher; False if the token breaks its grammar (state unchanged)."""
        assert self._matchers is not None
        return self._matchers.accept(request_id, token_id)

    def is_terminated(self, request_id: str) -> bool:
        assert self._matchers is not None
        return self._matchers.is_terminated(request_id)

    def remove(self, request_id: str) -> None:
        """Forgets a request (finished, aborted, failed): its pending compile or its matcher. Idempotent."""
        task = self._pending.pop(request_id, None)
        if task is not None:
            task.future.cancel()  # a compile under way runs to its end; its result is dropped
        if self._matchers is not None:
            self._matchers.remove(request_id)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
