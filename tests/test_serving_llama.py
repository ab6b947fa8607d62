"""A Llama-family checkpoint with its own tokenizer files through a real tritonserver: text in,
streamed text out, equal to the offline engine on the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from orca_backend.llm import LLM
from orca_backend.model.checkpoint import train_byte_level_bpe
from orca_backend.sampling_params import SamplingParams

pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")
transformers = pytest.importorskip("transformers")

from serving_utils import StreamSession, start_server  # noqa: E402 - after the skips

pytestmark = pytest.mark.integration

CHAT_TEMPLATE = "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """Qwen3-style GQA decoder (q/k norm, explicit head_dim) written by transformers, with a trained
    byte-level BPE tokenizer.json and a tokenizer_config.json carrying a chat template."""
    path = tmp_path_factory.mktemp("qwen3")
    tokenizer = train_byte_level_bpe(384, seed=2)
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHAT_TEMPLATE}))
    config = transformers.Qwen3Config(
        vocab_size=tokenizer.get_vocab_size(), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, max_position_embeddings=512,
        initializer_range=0.3, eos_token_id=None, bos_token_id=None,
    )  # fmt: skip
    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(config).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(checkpoint, tmp_path_factory):
    server = start_server(tmp_path_factory.mktemp("triton-llama"), checkpoint, parameters={"kv_capacity_tokens": "4096"})
    try:
        yield server
    finally:
        server.stop()


def test_text_streams_equal_offline_generate_on_both_models(server, checkpoint):
    prompts = ["the kalo mine", "a b c", "mine the naïve one"]
    lengths = [20, 9, 14]
    llm = LLM(str(checkpoint))
    assert llm.tokenizer.chat_template == CHAT_TEMPLATE  # kept for the serving layer
    expected = llm.generate(prompts, [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True) for n in lengths])
    for model in ("orca", "baseline"):
        with StreamSession(server.grpc_url) as session:
            for i, (prompt, n) in enumerate(zip(prompts, lengths, strict=True)):
                session.send(model, f"{model}{i}", text=prompt, max_tokens=n,
                             sampling={"temperature": 0, "ignore_eos": True}, stream=True)
            results = session.wait()
        for result, want in zip(results, expected, strict=True):
            assert result.error is None, result.error
            assert result.text == want.text and result.ids == want.output_ids
            if model == "orca":
                assert len(result.deltas) > 1  # streamed as generated
