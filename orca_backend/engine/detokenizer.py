"""Exact incremental detokenization and stop strings, on the output processor's per-request state.

Streamed text deltas must concatenate to exactly the final text and never split a multi-byte
character (genai-perf re-tokenizes them to count tokens). Byte-level BPE tokens can end inside a
UTF-8 character, so text is only released once the decoded tail no longer ends in U+FFFD; a few
tokens of left context are re-decoded so merges across the boundary come out right. Bytes that
never complete a character (a model may emit continuation bytes forever) are released as U+FFFD
once _MAX_PENDING_TOKENS are waiting, as a final decode would show them: the decoded window stays
bounded, so each token costs the shared output thread the same, however long the stream.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from orca_backend.tokenizer import Tokenizer

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
