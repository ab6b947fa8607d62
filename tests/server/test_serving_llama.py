"""A Llama-family checkpoint with its own tokenizer files through a real tritonserver: text in,
streamed text out, equal to the offline engine on the same checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from orca_backend.entrypoints.llm import LLM
from orca_backend.model.checkpoint import EOS_TOKEN, train_byte_level_bpe
from orca_backend.sampling_params import SamplingParams

grpcclient = pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")
transformers = pytest.importorskip("transformers")

from serving_utils import StreamSession, frontend_inputs, start_server  # noqa: E402 - after the skips

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
        initializer_range=0.3, eos_token_id=tokenizer.token_to_id(EOS_TOKEN), bos_token_id=None,
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
            if model == "baseline":  # request-level: one answer; orca's split depends on the sender's lag
                assert len(result.deltas) == 1


# ---- Triton's OpenAI-compatible frontend, replayed (serving_utils.frontend_inputs) ----------------
def usage(result) -> tuple[int, int]:
    """(prompt_tokens, completion_tokens) as the frontend computes them."""
    return result.deltas[0].num_input_tokens, sum(d.num_output_tokens for d in result.deltas)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint))


def test_openai_completion_and_streamed_completion_with_usage(server, llm):
    prompt, n = "the kalo mine", 12
    (want,) = llm.generate([prompt], SamplingParams(max_tokens=n, temperature=0.0))
    for stream in (False, True):
        with StreamSession(server.grpc_url) as session:
            session.send_inputs("orca", frontend_inputs(prompt, stream=stream, max_tokens=n, temperature=0.0), "c")
            (result,) = session.wait()
        assert result.error is None, result.error
        assert result.text == want.text  # completion only: the frontend sent exclude_input_in_output
        assert usage(result) == (want.num_input_tokens, len(want.output_ids))
        assert all(d.finish_reason == "" for d in result.deltas)  # not asked for: never sent
        assert result.deltas[-1].final and all(not d.final for d in result.deltas[:-1])
        assert stream or len(result.deltas) == 1  # streamed: as many as the sender's lag leaves, >= 1


def test_openai_chat_completion_renders_the_checkpoints_chat_template(server, checkpoint, llm):
    # The frontend renders the chat template of the tokenizer it loads (--tokenizer: the checkpoint
    # directory, whose tokenizer_config.json carries it) with transformers, and sends the text.
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(checkpoint))
    messages = [{"role": "system", "content": "a b c"}, {"role": "user", "content": "mine the naïve one"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == "<|system|>a b c<|user|>mine the naïve one"
    (want,) = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0.0))
    with StreamSession(server.grpc_url) as session:
        session.send_inputs("orca", frontend_inputs(prompt, stream=True, max_tokens=10, temperature=0.0), "chat")
        (result,) = session.wait()
    assert result.error is None, result.error
    assert result.text == want.text and usage(result) == (want.num_input_tokens, len(want.output_ids))


def test_structured_output_as_the_openai_frontend_sends_it_and_a_bad_schema_fails_alone(server, llm):
    # Tool calls with a schema reach the backend as `structured_outputs`: a JSON *string* of vLLM's
    # StructuredOutputsParams, every unset field null.
    schema = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                               "age": {"type": "integer"}}, "required": ["name", "age"]}  # fmt: skip
    fields = dict.fromkeys(["json", "regex", "choice", "grammar", "json_object", "disable_fallback",
                            "disable_any_whitespace", "disable_additional_properties", "whitespace_pattern",
                            "structural_tag"])  # fmt: skip
    constrained = {"temperature": 0, "max_tokens": 60,
                   "structured_outputs": json.dumps({**fields, "json": schema, "disable_any_whitespace": True})}
    bad = {"temperature": 0, "max_tokens": 8, "structured_outputs": json.dumps({**fields, "regex": "(unclosed"})}
    with StreamSession(server.grpc_url) as session:
        good = session.send("orca", "good", text="the kalo mine", sampling=constrained, stream=True)
        session.wait()
    with StreamSession(server.grpc_url) as session:
        broken = session.send("orca", "bad", text="the kalo mine", sampling=bad, stream=True)
        session.wait()
    assert good.error is None and good.finish_reason == "stop", good.error
    value = json.loads(good.text)
    assert set(value) == {"name", "age"} and isinstance(value["age"], int)
    (want,) = llm.generate(["the kalo mine"], SamplingParams.from_dict(constrained))
    assert good.ids == want.output_ids
    # (its code, INVALID_ARG, is checked in test_triton_adapters.py: the stream callback's error here is a message)
    assert broken.error is not None and broken.error.startswith("invalid regex for structured output"), broken.error
