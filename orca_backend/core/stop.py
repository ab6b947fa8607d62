"""Token-level stopping, decided in one place: EOS, stop token ids, min_tokens and max_tokens.

Stop *strings* are text-level and belong to the output processor (engine/output_processor.py),
which detokenizes; it reports a hit back to the core as an abort with reason "stop".
"""

from __future__ import annotations

from orca_backend.core.request import Request
from orca_backend.messages import FinishReason


def check_stop(request: Request, token: int, eos_token_id: int | None) -> FinishReason | None:
    """The finish reason once `token` has been appended to `request.output_ids`, or None."""
    params = request.params
    num_output = len(request.output_ids)
    is_eos = token == eos_token_id and not params.ignore_eos
    if (is_eos or token in params.stop_token_ids) and num_output > params.min_tokens:
        return FinishReason.STOP
    if num_output >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def stop_token_set(request: Request, eos_token_id: int | None) -> frozenset[int]:
    """The tokens on which `check_stop` may answer "stop" (EOS unless ignored, and the stop ids): a
    token outside it, short of max_tokens, needs no check at all (the scheduler's common case)."""
    params = request.params
    eos = {eos_token_id} if eos_token_id is not None and not params.ignore_eos else set()
    return frozenset(params.stop_token_ids) | eos


def banned_token_ids(request: Request, eos_token_id: int | None) -> list[int]:
    """Tokens the sampler must not pick for this request's next token.

    Before min_tokens, EOS (unless ignored) and the stop ids cannot be sampled at all (vLLM's
    semantics), so `check_stop` never sees one it would have to ignore.
    """
    params = request.params
    if not params.min_tokens or len(request.output_ids) >= params.min_tokens:
        return []
    # The set the scheduler computed once when it took the request in (bounded and deduplicated by
    # SamplingParams): the same tokens as stop_token_set's.
    return list(request.stop_ids if request.stop_ids is not None else stop_token_set(request, eos_token_id))
