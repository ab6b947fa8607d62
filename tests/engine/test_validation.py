"""Bad input raises a clear ValueError and leaves the engine serving everyone else: sampling
parameters, prompts, engine and K/V settings, requests that could never fit. (What a deployment's
limits and a full queue refuse is tests/engine/test_engine_limits.py's.)"""

from __future__ import annotations

import json

import pytest

from orca_backend import LLM, EngineConfig, SamplingParams


@pytest.fixture(scope="module")
def llm(tiny_checkpoint) -> LLM:
    return LLM(str(tiny_checkpoint[0]), kv_capacity_tokens=200)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: SamplingParams(max_tokens=0), "max_tokens must be a positive integer"),
        (lambda: SamplingParams(max_tokens=-3), "max_tokens must be a positive integer"),
        (lambda: SamplingParams(temperature=-0.5), "temperature must be a finite number >= 0"),
        (lambda: SamplingParams(temperature=float("inf")), "temperature must be a finite number"),
        (lambda: SamplingParams.from_json('{"temperature": NaN}'), "temperature must be a finite number"),
        (lambda: SamplingParams(seed=2**64), r"seed must be an integer in \[0, 18446744073709551615\]"),
        (lambda: SamplingParams(seed=-1), "seed must be an integer in"),
        (lambda: SamplingParams(top_k=2**63), "top_k must be -1, 0 or a positive integer up to 2147483647"),
        (lambda: SamplingParams(top_p=-0.1), r"top_p must be in \[0, 1\] \(0 is greedy\)"),
        (lambda: SamplingParams(top_p=1.5), r"top_p must be in \[0, 1\]"),
        (lambda: SamplingParams(n=129), "n must be an integer in \\[1, 128\\]"),
        (lambda: SamplingParams.from_json('{"n": "0"}'), "n must be an integer"),
        (lambda: SamplingParams(n=0), "n must be an integer in"),
        (lambda: SamplingParams(presence_penalty=2.5), r"presence_penalty must be a number in \[-2, 2\], got 2.5"),
        (lambda: SamplingParams(frequency_penalty=-3), r"frequency_penalty must be a number in \[-2, 2\]"),
        (lambda: SamplingParams.from_json('{"frequency_penalty": NaN}'), "frequency_penalty must be a number"),
        (lambda: SamplingParams.from_json('{"presence_penalty": "much"}'), "presence_penalty must be a number"),
        (lambda: SamplingParams(repetition_penalty=0.0), "repetition_penalty must be a finite number > 0"),
        (lambda: SamplingParams(repetition_penalty=float("inf")), "repetition_penalty must be a finite number > 0"),
        (lambda: SamplingParams(logit_bias={5: 100.5}), r"logit_bias values must be numbers in \[-100, 100\], got 100.5 for token 5"),
        (lambda: SamplingParams(logit_bias={-1: 1.0}), "logit_bias keys must be token ids"),
        (lambda: SamplingParams(logit_bias={"5": 1.0}), "logit_bias keys must be token ids"),
        (lambda: SamplingParams.from_json('{"logit_bias": {"abc": 1}}'), "logit_bias keys must be token ids, got 'abc'"),
        (lambda: SamplingParams.from_json('{"logit_bias": {"5": "x"}}'), "logit_bias values must be numbers, got 'x'"),
        (lambda: SamplingParams.from_json('{"logit_bias": {"5": -101}}'), r"logit_bias values must be numbers in \[-100, 100\]"),
        (lambda: SamplingParams.from_json('{"logit_bias": [5]}'), "logit_bias must be an object"),
        (lambda: SamplingParams(logprobs=21), r"logprobs must be an integer in \[0, 20\]"),
        (lambda: SamplingParams(logprobs=-1), r"logprobs must be an integer in \[0, 20\]"),
        (lambda: SamplingParams.from_json('{"logprobs": true}'), "logprobs must be an integer, got True"),
        (lambda: SamplingParams(top_k=-2), "top_k must be"),
        (lambda: SamplingParams(min_tokens=20, max_tokens=10), "min_tokens must be"),
        (lambda: SamplingParams.from_dict({"max_tokens": 4, "temprature": 0.5}), "unknown sampling parameter.*temprature"),
        (lambda: SamplingParams.from_json("{not json"), "not valid JSON"),
        (lambda: SamplingParams.from_json('{"max_tokens": "ten"}'), "max_tokens must be an integer"),
        (lambda: SamplingParams.from_json("[1, 2]"), "must be a JSON object"),
        # Per-request lists reach every iteration: bounded (before anything is converted, from JSON).
        (lambda: SamplingParams.from_json(json.dumps({"stop_token_ids": [7] * 200_000})),
         "stop_token_ids has 200000 entries, more than the limit of 1024"),
        (lambda: SamplingParams(stop_token_ids=list(range(1025))), "1025 distinct stop_token_ids, more than the limit of 1024"),
        (lambda: SamplingParams(logit_bias={t: 1.0 for t in range(1025)}), "logit_bias has 1025 entries, more than the limit"),
        (lambda: SamplingParams.from_json(json.dumps({"logit_bias": {str(t): 1 for t in range(2000)}})),
         "logit_bias has 2000 entries, more than the limit of 1024"),
    ],
)
def test_bad_sampling_params(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_stop_token_ids_are_deduplicated_in_order():
    assert SamplingParams(stop_token_ids=[9, 5, 9, 9, 5, 2]).stop_token_ids == [9, 5, 2]
    assert len(SamplingParams(stop_token_ids=[3] * 1024 + list(range(1023))).stop_token_ids) == 1023


def test_numeric_strings_are_accepted_as_genai_perf_sends_them():
    p = SamplingParams.from_json('{"max_tokens": "32", "min_tokens": "32", "temperature": "0", "ignore_eos": "true"}')
    assert (p.max_tokens, p.min_tokens, p.temperature, p.ignore_eos) == (32, 32, 0.0, True)


def test_sampling_extras_are_coerced_from_json():
    p = SamplingParams.from_json('{"n": "1", "presence_penalty": "0.5", "frequency_penalty": -1, "repetition_penalty": "1.2", '
                                 '"logit_bias": {"7": "-100", "9": 3}, "logprobs": "5", "top_p": 0}')
    assert (p.n, p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (1, 0.5, -1.0, 1.2)
    assert p.logit_bias == {7: -100.0, 9: 3.0} and p.logprobs == 5
    assert p.greedy  # top_p 0 is greedy, as OpenAI allows it
    assert SamplingParams.from_json('{"logprobs": null, "logit_bias": null}') == SamplingParams()


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "the prompt is empty"),
        ("", SamplingParams(), "the prompt is empty"),
        ([1, 2, 10_000], SamplingParams(), "outside the model's vocabulary"),
        ([1] * 100, SamplingParams(max_tokens=29), "exceeds the model's context length of 128"),
        ([1] * 100, SamplingParams(max_tokens=20), None),  # fits the context: must be accepted
        ([1.5, 2], SamplingParams(), "string or a sequence of integer"),
        ([1, 2], SamplingParams(stop_token_ids=[5, 10_000]), r"stop_token_ids: 10000 is outside the model's vocabulary"),
        ([1, 2], SamplingParams(min_tokens=1, stop_token_ids=list(range(384))), "ban every token of the vocabulary"),
        ([1, 2], SamplingParams(logit_bias={5: 1.0, 384: 2.0}), r"logit_bias: 384 is outside the model's vocabulary \[0, 384\)"),
        ([1, 2], SamplingParams(max_tokens=4, logit_bias={0: -100, 383: 100}, logprobs=20, presence_penalty=2,
                                frequency_penalty=-2, repetition_penalty=1e-3, top_p=0.0, ignore_eos=True), None),
        ([1, 2], SamplingParams(max_tokens=2, min_tokens=1, stop_token_ids=list(range(1, 384)), ignore_eos=True), None),
        # The largest values the params accept must run, not fail inside the batch.
        ([1, 2], SamplingParams(max_tokens=4, seed=2**64 - 1, top_k=2**31 - 1, ignore_eos=True), None),
    ],
)
def test_bad_prompts_fail_alone_and_engine_keeps_serving(llm, prompt, params, message):
    good = [[1, 2, 3]]
    before = llm.generate(good, SamplingParams(max_tokens=6, temperature=0.0))[0].output_ids
    if message is None:
        assert len(llm.generate([prompt], params)[0].output_ids) == params.max_tokens
    else:
        with pytest.raises(ValueError, match=message):
            llm.generate(good + [prompt], [SamplingParams(max_tokens=6, temperature=0.0), params])
    assert llm.generate(good, SamplingParams(max_tokens=6, temperature=0.0))[0].output_ids == before
    assert llm.engine.core.kv.used_tokens == 0 and not llm.engine.has_work()


def test_request_that_can_never_fit_the_kv_pool_is_rejected(tiny_checkpoint):
    small = LLM(str(tiny_checkpoint[0]), kv_capacity_tokens=64)
    with pytest.raises(ValueError, match="K/V capacity of 64 tokens"):
        small.generate([[1] * 50], SamplingParams(max_tokens=20))  # within the context of 128
    assert len(small.generate([[1] * 50], SamplingParams(max_tokens=14))[0].output_ids) == 14


def test_text_prompt_without_tokenizer_is_an_error():
    llm = LLM("gpt2-tiny")
    with pytest.raises(ValueError, match="needs a tokenizer"):
        llm.generate("hello")


def test_stop_strings_without_tokenizer_are_an_error_not_ignored():
    llm = LLM("gpt2-tiny")
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        llm.generate([[1, 2]], SamplingParams(stop=["x"]))


def test_duplicate_request_id_is_rejected(tiny_checkpoint):
    from orca_backend.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0])))
    engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="same")
    with pytest.raises(ValueError, match="already in use"):
        engine.add_request([1, 2], SamplingParams(max_tokens=2), request_id="same")


def test_the_id_of_a_request_a_stop_string_ended_stays_in_use_until_the_core_lets_go(tiny_checkpoint):
    """A stop string ends a request in the frontend while the core still holds it (its abort is
    queued): a new request under that id is refused until the core's own end of the old one arrives,
    and then runs exactly as alone; it never receives the old request's events."""
    from orca_backend.engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0])))
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    alone: list = []
    engine.add_request([5, 6, 7], greedy, request_id="alone", on_output=alone.append)
    while not alone or not alone[-1].finished:
        engine.step()
    text = "".join(o.new_text for o in alone)
    assert text, "the tiny model's first token has text"
    first: list = []
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, stop=[text[:1]]),
                       request_id="same", on_output=first.append)  # fmt: skip
    while not first or not first[-1].finished:
        engine.step()
    assert first[-1].finish_reason == "stop"
    with pytest.raises(ValueError, match="already in use"):  # the core has not taken in its abort yet
        engine.add_request([5, 6, 7], greedy, request_id="same")
    while engine.has_work():
        engine.step()
    second: list = []
    engine.add_request([5, 6, 7], greedy, request_id="same", on_output=second.append)
    while not second or not second[-1].finished:
        engine.step()
    assert [t for o in second for t in o.new_token_ids] == [t for o in alone for t in o.new_token_ids]
    assert second[-1].finish_reason == "length"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float64"}, "dtype must be one of"),
        ({"scheduling": "batch"}, "scheduling must be"),
        ({"max_num_seqs": 0}, "max_num_seqs must be >= 1"),
        ({"model": "/no/such/dir"}, "neither a preset"),
        ({"device": "tpu"}, "device must be cpu, cuda, cuda:N or auto"),
        ({"health_check_interval_s": 5.0, "iteration_timeout_s": 0}, "health_check_interval_s needs iteration_timeout_s > 0"),
        ({"kv_policy": "lru"}, "kv_policy must be 'reserve' or 'paged'"),
        ({"block_size": 0}, "block_size must be >= 1"),
        ({"block_size": 32, "kv_capacity_tokens": 16}, "at most kv_capacity_tokens"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens must be >= 1, or 0"),
        ({"kv_watermark": 1.0}, r"kv_watermark must be in \[0, 1\)"),
        ({"max_queued_requests": -1}, "max_queued_requests must be >= 1, or 0 for no limit"),
    ],
)
def test_bad_engine_config(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**kwargs).model_config()


def test_kv_parameters_from_config_pbtxt_are_typed_and_checked():
    config = EngineConfig.from_parameters({
        "kv_policy": {"string_value": "paged"}, "block_size": {"string_value": "8"},
        "enable_prefix_caching": {"string_value": "true"}, "max_num_batched_tokens": {"string_value": "256"},
        "kv_watermark": {"string_value": "0.05"},
    })  # fmt: skip
    assert (config.kv_policy, config.block_size, config.enable_prefix_caching, config.max_num_batched_tokens,
            config.kv_watermark) == ("paged", 8, True, 256, 0.05)  # fmt: skip
    with pytest.raises(ValueError, match="enable_prefix_caching must be true or false"):
        EngineConfig.from_parameters({"enable_prefix_caching": "ture"})
    with pytest.raises(ValueError, match="kv_watermark must be a number"):
        EngineConfig.from_parameters({"kv_watermark": "a lot"})


def test_paged_policy_still_refuses_what_could_never_finish(tiny_checkpoint):
    small = LLM(str(tiny_checkpoint[0]), kv_capacity_tokens=64, kv_policy="paged")
    with pytest.raises(ValueError, match="K/V capacity of 64 tokens"):
        small.generate([[1] * 50], SamplingParams(max_tokens=20))


def test_a_cuda_device_this_machine_lacks_is_refused():
    """One past the last CUDA device (cuda:0 on a CPU machine): refused before anything loads."""
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError, match="CUDA device"):
        LLM("gpt2-tiny", device=f"cuda:{count}")
