"""Speculative decoding through a real tritonserver: both models with `speculative_config` as a
config.pbtxt parameter stream the offline engine's tokens (several may land in one response), and
vLLM's spec_decode counters and each request's perf metrics count exactly what the offline engine
with the same proposer counted for the same requests, run one at a time."""

from __future__ import annotations

import json

import pytest

from orca_backend.entrypoints.llm import LLM
from orca_backend.sampling_params import SamplingParams
from orca_client.protocol import PERF_METRICS, STATUS_OUTPUTS

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")

from engine_helpers import random_prompts  # noqa: E402
from serving_utils import dashboard_series, metric, one_request, read_metrics, start_server, wait_until  # noqa: E402

pytestmark = pytest.mark.integration

SPECULATIVE = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1})
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint[0]


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("triton-speculative"), checkpoint,
                          parameters={"kv_capacity_tokens": "2048", "speculative_config": SPECULATIVE})  # fmt: skip
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def offline(checkpoint):
    """Per prompt, run alone on an offline engine with speculation: the prompt, its tokens, and the
    counts its steps added to (drafts, draft tokens, accepted tokens, accepted per position). Of 30
    random prompts, the two whose proposals were accepted most (the random model's text repeats
    itself a little) and one whose proposals were all rejected."""
    llm = LLM(str(checkpoint), speculative_config=SPECULATIVE)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    results = []
    for prompt in random_prompts(30, llm.engine.model_config.vocab_size, seed=1):
        before = llm.engine.core.stats()
        tokens = llm.generate([prompt], params)[0].output_ids
        after = llm.engine.core.stats()
        counts = (after.spec_num_drafts - before.spec_num_drafts,
                  after.spec_num_draft_tokens - before.spec_num_draft_tokens,
                  after.spec_num_accepted_tokens - before.spec_num_accepted_tokens,
                  [a - b for a, b in zip(after.spec_accepted_per_pos, before.spec_accepted_per_pos, strict=True)])  # fmt: skip
        results.append((prompt, tokens, counts))
    plain = LLM(str(checkpoint)).generate([p for p, _, _ in results], params)
    assert [t for _, t, _ in results] == [o.output_ids for o in plain]  # speculation changes no token
    results.sort(key=lambda result: -result[2][2])
    chosen = [*results[:2], next(r for r in results if r[2][1] and not r[2][2])]
    assert chosen[0][2][2] > 0  # some proposals were accepted
    return chosen


@pytest.mark.parametrize("model", ["orca", "baseline"])
def test_streams_equal_offline_and_the_counts_are_exact(server, offline, model):
    def counters():
        return (metric(server, "vllm:spec_decode_num_drafts_total", model),
                metric(server, "vllm:spec_decode_num_draft_tokens_total", model),
                metric(server, "vllm:spec_decode_num_accepted_tokens_total", model),
                [metric(server, "vllm:spec_decode_num_accepted_tokens_per_pos_total", model, position=str(i))
                 for i in range(3)])  # fmt: skip

    before = counters()
    for prompt, tokens, counts in offline:
        result = one_request(server.grpc_url, model, input_ids=prompt, max_tokens=MAX_TOKENS,
                             sampling={"temperature": 0, "ignore_eos": True}, stream=True,
                             return_outputs=(*STATUS_OUTPUTS, PERF_METRICS))  # fmt: skip
        assert result.error is None and result.ids == tokens
        perf = result.deltas[-1].perf
        assert (perf["num_draft_tokens"], perf["num_accepted_draft_tokens"]) == (counts[1], counts[2])
    drafts, draft_tokens, accepted = (sum(c[i] for _, _, c in offline) for i in range(3))
    per_pos = [sum(c[3][i] for _, _, c in offline) for i in range(3)]
    expected = (before[0] + drafts, before[1] + draft_tokens, before[2] + accepted,
                [b + p for b, p in zip(before[3], per_pos, strict=True)])  # fmt: skip
    assert wait_until(lambda: counters() == expected, timeout_s=10), (counters(), expected)
    # The dashboard's speculative-decoding panel has its series for this model.
    samples = read_metrics(server)
    spec_series = {name for name in dashboard_series() if name.startswith("vllm:spec_decode")}
    assert len(spec_series) == 3
    assert all(any(n == name and ("model", model) in labels for n, labels in samples) for name in spec_series)


def test_an_eagle_head_serves_both_models_with_the_offline_tokens_and_counts(checkpoint, tmp_path):
    """An EAGLE head (random weights: its proposals are mostly rejected) through tritonserver: the
    engine core process runs the head after each step and before the next, and both models stream
    the offline engine's tokens and count its drafts."""
    import torch
    from eagle_heads import head_config, random_layers, write_eagle_head

    layers = random_layers(head_config(64, 384), seed=3)
    head = write_eagle_head(tmp_path / "head", layers, 0.3 * torch.randn(64, 128, generator=torch.Generator().manual_seed(4)))
    spec = json.dumps({"method": "eagle", "model": str(head), "num_speculative_tokens": 3})
    prompts = random_prompts(3, 384, seed=5)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    llm = LLM(str(checkpoint), speculative_config=spec)
    expected = []
    for prompt in prompts:  # one at a time, as the server is sent them
        before = llm.engine.core.stats().spec_num_draft_tokens
        expected.append((llm.generate([prompt], params)[0].output_ids, llm.engine.core.stats().spec_num_draft_tokens - before))
    assert [t for t, _ in expected] == [o.output_ids for o in LLM(str(checkpoint)).generate(prompts, params)]
    server = start_server(tmp_path / "server", checkpoint, parameters={"kv_capacity_tokens": "2048",
                                                                        "speculative_config": spec})  # fmt: skip
    try:
        for model in ("orca", "baseline"):
            for prompt, (tokens, drafts) in zip(prompts, expected, strict=True):
                result = one_request(server.grpc_url, model, input_ids=prompt, max_tokens=MAX_TOKENS,
                                     sampling={"temperature": 0, "ignore_eos": True}, stream=True,
                                     return_outputs=(*STATUS_OUTPUTS, PERF_METRICS))  # fmt: skip
                assert result.error is None and result.ids == tokens
                assert result.deltas[-1].perf["num_draft_tokens"] == drafts > 0
    finally:
        server.stop()
