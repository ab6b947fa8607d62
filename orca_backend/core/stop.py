"""Token-level stopping, decided in one place: EOS, stop token ids, min_tokens and max_tokens.

Stop *strings* are text-level and belong to the output processor (engine/output_processor.py),
which detokenizes; it reports a hit back to the core as an abort with reason "stop". Before
min_tokens the sampler bans the stop tokens (worker/sampler.py, from the same `stop_token_set`), so
`check_stop` never sees one it would have to ignore.
"""

from __future__ import annotations

from orca_backend.core.request import Request
from orca_backend.messages import FinishReason


def check_stop(request: Request, token: int) -> FinishReason | None:
    """The finish reason once `token` has been appended to `request.output_ids`, or None. It runs for
    every sampled token, so it reads the stop set the scheduler computed once (`stop_token_set`)."""
    num_output = len(request.output_ids)
    params = request.params
    if token in request.stop_ids and num_output > params.min_tokens:
        return FinishReason.STOP
    if num_output >= params.max_tokens:
        return FinishReason.LENGTH
    return None


def stop_token_set(request: Request, eos_token_id: int | None) -> frozenset[int]:
    """The tokens that end the request with "stop": EOS unless ignored, and its stop ids."""
    params = request.params
    eos = {eos_token_id} if eos_token_id is not None and not params.ignore_eos else set()
    return frozenset(params.stop_token_ids) | eos
