"""What the engine's front refuses before a request reaches the scheduler because of a deployment's
limits (EngineConfig): prompts and stop strings past max_input_tokens, max_stop_sequences and
max_stop_length, priorities outside [-max_priority, max_priority] and bad timeouts, bad limit
settings, and a full waiting queue (max_queued_requests, max_queued_prompt_tokens: refused at once
with a retry-later error, open again as requests start). Bad input itself is tests/engine/test_validation.py's.
"""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY, drain

from orca_backend import EngineConfig, SamplingParams
from orca_backend.engine.llm_engine import LLMEngine


@pytest.mark.parametrize(
    ("config", "prompt", "params", "message"),
    [
        ({"max_input_tokens": 8}, [1] * 9, GREEDY, "9 tokens, more than this deployment's max_input_tokens of 8"),
        ({"max_input_tokens": 8}, [1] * 8, GREEDY, None),
        ({"max_stop_sequences": 2}, [1, 2], SamplingParams(stop=["a", "b", "c"]), "3 stop strings, more than .*max_stop_sequences of 2"),
        ({"max_stop_sequences": 2}, [1, 2], SamplingParams(max_tokens=2, stop=["a", "b"]), None),
        ({"max_stop_length": 4}, [1, 2], SamplingParams(stop=["abcde"]), "a stop string of 5 characters, longer than .*max_stop_length of 4"),
        ({"max_stop_length": 4}, [1, 2], SamplingParams(max_tokens=2, stop=["abcd"]), None),
    ],
)
def test_deployment_limits_refuse_with_the_limit_named(tiny_checkpoint, config, prompt, params, message):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), **config))
    if message is None:
        stream = engine.add_request(prompt, params)
        drain(engine)
        assert list(stream)[-1].finished
    else:
        with pytest.raises(ValueError, match=message):
            engine.add_request(prompt, params)
        assert not engine.has_work()


def test_stop_limits_are_checked_before_the_prompt_is_tokenized(tiny_checkpoint):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), max_stop_sequences=1))
    calls = []
    encode = engine.tokenizer.encode
    engine.tokenizer.encode = lambda text: calls.append(text) or encode(text)
    with pytest.raises(ValueError, match="max_stop_sequences"):
        engine.add_request("a long prompt " * 100, SamplingParams(stop=["x", "y"]))
    assert calls == []


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"priority": 1.5}, "priority must be an integer"),
        ({"priority": True}, "priority must be an integer"),
        ({"priority": 2**31}, r"priority must be an integer in \[-20, 20\]"),
        ({"priority": -(2**31) + 1}, r"priority must be an integer in \[-20, 20\] .*max_priority is 20"),
        ({"priority": 21}, r"priority must be an integer in \[-20, 20\]"),
        ({"timeout_s": 0}, "timeout_s must be a number of seconds > 0"),
        ({"timeout_s": float("inf")}, "timeout_s must be a number of seconds > 0"),
        ({"timeout_s": "5"}, "timeout_s must be a number of seconds > 0"),
    ],
)
def test_bad_priority_or_timeout_is_refused(tiny_checkpoint, kwargs, message):
    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0])))
    with pytest.raises(ValueError, match=message):
        engine.add_request([1, 2], GREEDY, **kwargs)
    assert not engine.has_work()


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"max_input_tokens": -1}, "max_input_tokens must be >= 1, or 0"),
        ({"max_request_bytes": -1}, "max_request_bytes must be >= 1, or 0"),
        ({"priority_aging_s": -1}, "priority_aging_s must be > 0, or 0 for strict priority"),
        ({"max_priority": -1}, "max_priority must be >= 1, or 0"),
    ],
)
def test_bad_limit_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs)


def test_queue_limits_refuse_at_once_and_reopen_as_requests_start(tiny_checkpoint):
    from orca_backend.engine.llm_engine import EngineOverloadedError, LLMEngine

    config = EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=2, max_queued_requests=3,
                          max_queued_prompt_tokens=40)  # fmt: skip
    engine = LLMEngine(config)
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    streams = [engine.add_request([1] * 5, params) for _ in range(3)]
    with pytest.raises(EngineOverloadedError, match=r"3 requests queued, max_queued_requests=3.*retry later"):
        engine.add_request([1] * 5, params, request_id="refused")
    engine.step()  # two start (max_num_seqs 2) and get their first token: one is still queued
    assert engine.outputs.num_queued == (1, 5)
    streams.append(engine.add_request([2] * 30, params))  # 2 queued, 35 prompt tokens
    with pytest.raises(EngineOverloadedError, match="35 prompt tokens queued, max_queued_prompt_tokens=40"):
        engine.add_request([3] * 10, params)
    # Exactly at both limits, under the id refused before (a refusal leaves nothing behind).
    streams.append(engine.add_request([3] * 5, params, request_id="refused"))
    with pytest.raises(EngineOverloadedError, match="3 requests queued, max_queued_requests=3"):
        engine.add_request([1], params)
    while engine.has_work():
        engine.step()
    assert all(list(s)[-1].num_output_tokens == 3 for s in streams)  # every accepted request finished
    assert engine.outputs.num_queued == (0, 0)
    # An empty queue takes a request of any size: none is refused for its size alone.
    big = engine.add_request([5] * 60, params)
    while engine.has_work():
        engine.step()
    assert list(big)[-1].finish_reason == "length"
