"""Exact incremental detokenization and stop strings.

Streamed text deltas must concatenate to exactly the final text and never split a multi-byte
character (genai-perf re-tokenizes them to count tokens). Byte-level BPE tokens can end inside a
UTF-8 character, so text is only released once the decoded tail no longer ends in U+FFFD; a few
tokens of left context are re-decoded so merges across the boundary come out right.
"""

from __future__ import annotations

from orca_backend.engine.request import Request
from orca_backend.tokenizer import Tokenizer

_CONTEXT_TOKENS = 5


def start_offsets(request: Request) -> None:
    request.read_offset = request.num_prompt_tokens
    request.prefix_offset = max(request.num_prompt_tokens - _CONTEXT_TOKENS, 0)


def update_text(tokenizer: Tokenizer, request: Request, final: bool = False) -> None:
    """Appends the text of the request's newest tokens to `request.text` once it is complete.

    With `final` (the request has ended) whatever is left is appended, even an incomplete character.
    """
    ids = request.all_token_ids()
    prefix_text = tokenizer.decode(ids[request.prefix_offset : request.read_offset])
    full_text = tokenizer.decode(ids[request.prefix_offset :])
    if len(full_text) > len(prefix_text) and (final or not full_text.endswith("\ufffd")):
        request.text += full_text[len(prefix_text) :]
        request.prefix_offset = request.read_offset
        request.read_offset = len(ids)


def find_stop(request: Request) -> int | None:
    """Index in `request.text` where the earliest stop string begins, if one appeared in new text."""
    stops = request.params.stop
    if not stops:
        return None
    # Only text not yet released can hold a new match; step back so a stop spanning the boundary counts.
    window = max(request.sent_text_len - max(len(s) for s in stops), 0)
    hits = [i for i in (request.text.find(s, window) for s in stops) if i >= 0]
    return min(hits) if hits else None


def releasable_text(request: Request) -> str:
    """Text safe to send now: while a stop string may still be completing, its possible prefix is held back."""
    end = len(request.text)
    if request.params.stop and not request.finished:
        end = max(end - (max(len(s) for s in request.params.stop) - 1), request.sent_text_len)
    return request.text[request.sent_text_len : end]
