"""Early-stop workloads: requests that end well before their `max_tokens`, as real answers end at EOS.

A synthetic request generates exactly its drawn length (ignore_eos), so the `max_tokens` a server
sees equals what it produces, and ORCA's reservation of `prompt + max_tokens` wastes nothing.
Clients of a real deployment send a loose bound (often 512 or more) and the model stops far sooner.
Random weights never choose EOS, so this mode makes a stop token play its part: each request's
greedy output is computed once, offline, with the served weights; the token at its drawn length
becomes its stop token, and it is sent with `--max-tokens` as max_tokens. Greedy decoding of random
weights repeats itself, so the stop token often appears earlier: the request then ends at its
first occurrence, which this computes, and that length is what the request is expected to produce.
Every model of a bench sees the same tokens (the engine's outputs do not depend on the batch), so
every model gets the same early stops.
"""

from __future__ import annotations

import dataclasses

from orca_client.workload import TraceRequest


def with_early_stops(trace: list[TraceRequest], max_tokens: int, model: str, device: str, dtype: str) -> list[TraceRequest]:
    """The trace's requests sent with `max_tokens` and ending at a stop token near their drawn length."""
    from orca_backend import LLM, SamplingParams  # the engine, in this process: only this mode needs it

    short = [i for i, r in enumerate(trace) if r.max_tokens > max_tokens]
    if short:
        raise ValueError(f"--max-tokens {max_tokens} is below request {short[0]}'s output length "
                         f"({trace[short[0]].max_tokens}): early stops need max_tokens above every output")  # fmt: skip
    llm = LLM(model, device=device, dtype=dtype, max_num_seqs=64)
    prompts = [r.prompt_text if r.prompt_text is not None else r.prompt_ids for r in trace]
    params = [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in trace]
    outputs = llm.generate(prompts, params)
    llm.engine.shutdown()
    stopped = []
    for request, output in zip(trace, outputs, strict=True):
        stop = output.output_ids[-1]
        length = output.output_ids.index(stop) + 1  # where greedy decoding first emits it
        stopped.append(dataclasses.replace(request, max_tokens=length, sent_max_tokens=max_tokens, stop_token_ids=(stop,)))
    return stopped
