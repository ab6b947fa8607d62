"""The C decode step (kernels/orca_kernels/cpu_decoder_step.py: a model's layers in one C call)
against the per-op path it replaces, on checkpoints transformers writes: the same tokens and the
same logprobs, bit for bit, for the Llama style and GPT-2 in float32 and bfloat16, on each
instruction set of the C GEMM, in
a batch where requests join (prompts of up to 32 tokens run in the C step too) and leave, with
steps it does not run (a longer prompt) between the ones it does. Where a model has what the C
step does not cover (Qwen3's q/k norm), every step runs op by op."""

from __future__ import annotations

import pytest
import torch
from cpu_isas import SUPPORTED_ISAS, force_isa, forget_choices
from hf_tiny import write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.model.decoder import Decoder
from orca_backend.model.gpt2 import GPT2
from orca_kernels import AttentionMetadata
from orca_kernels.cpu_decoder_step import DecoderStep, Gpt2Step

pytest.importorskip("transformers")

# (family, overrides): GQA with an untied LM head; q/k/v and o biases; a sliding window shorter
# than the prompts (the window's start moves inside the C step's attention); multi-head with q/k/v bias.
CASES = {
    "llama-gqa2-untied": ("Llama", {"tie_word_embeddings": False}),
    "llama-mha-bias": ("Llama", {"num_key_value_heads": 4, "attention_bias": True}),
    "mistral-window8": ("Mistral", {"sliding_window": 8}),
    "qwen2-bias-tied": ("Qwen2", {"tie_word_embeddings": True}),
}
PROMPT_LENGTHS = (1, 5, 12, 31, 40, 3)  # 40: a prompt the C step leaves to the per-op path


def run(path, dtype: str, use_c_step: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list, int]:
    """(each request's (tokens, logprobs), the C step's calls) of one engine over the prompts."""
    calls = []

    def counted(real):
        def call(self, *args):
            calls.append(args[0].shape[0])
            return real(self, *args)

        return call

    with monkeypatch.context() as m:
        for step, model in ((DecoderStep, Decoder), (Gpt2Step, GPT2)):
            m.setattr(step, "__call__", counted(step.__call__))
            if not use_c_step:
                m.setattr(model, "cpu_step", None)
        llm = LLM(str(path), device="cpu", dtype=dtype, max_num_seqs=3, block_size=4)
        gen = torch.Generator().manual_seed(3)
        prompts = [torch.randint(0, 320, (n,), generator=gen).tolist() for n in PROMPT_LENGTHS]
        outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=3))
        llm.shutdown()
    results = [(o.output_ids, [{t: lp.logprob for t, lp in d.items()} for d in o.logprobs]) for o in outs]
    return results, len(calls)


@pytest.fixture
def isa(request, monkeypatch):
    force_isa(monkeypatch, request.param)
    yield request.param
    monkeypatch.undo()
    forget_choices()


@pytest.mark.parametrize("isa", [SUPPORTED_ISAS[-1]], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("case_id", list(CASES))
def test_c_step_equals_the_per_op_path_bit_for_bit(tmp_path, monkeypatch, case_id, dtype, isa):
    family, overrides = CASES[case_id]
    write_tiny(family, tmp_path, seed=5, **overrides)
    c_step, c_calls = run(tmp_path, dtype, True, monkeypatch)
    per_op, per_op_calls = run(tmp_path, dtype, False, monkeypatch)
    assert c_calls > 0 and per_op_calls == 0
    assert c_step == per_op


@pytest.mark.parametrize("isa", SUPPORTED_ISAS[:-1], indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_c_step_equals_the_per_op_path_on_narrower_instruction_sets(tmp_path, monkeypatch, dtype, isa):
    """The plain-weight GEMM (AVX2 machines) and AVX-512 without VDPBF16PS."""
    write_tiny("Llama", tmp_path, seed=6)
    c_step, c_calls = run(tmp_path, dtype, True, monkeypatch)
    per_op, _ = run(tmp_path, dtype, False, monkeypatch)
    assert c_calls > 0
    assert c_step == per_op


# GPT-2 with 12 heads of 8 (vocab 320, as the prompts draw)
GPT2_GEOMETRY = GPT2Config(vocab_size=320, n_positions=128, n_embd=96, n_layer=2, n_head=12, initializer_range=0.3)


@pytest.mark.parametrize("isa", SUPPORTED_ISAS, indirect=True)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_gpt2_c_step_equals_the_per_op_path_bit_for_bit(make_checkpoint, monkeypatch, dtype, isa):
    path, _ = make_checkpoint(GPT2_GEOMETRY, seed=4, tokenizer=False)
    c_step, c_calls = run(path, dtype, True, monkeypatch)
    per_op, per_op_calls = run(path, dtype, False, monkeypatch)
    assert c_calls > 0 and per_op_calls == 0
    assert c_step == per_op


def test_a_model_the_c_step_does_not_cover_runs_op_by_op(tmp_path, monkeypatch):
    write_tiny("Qwen3", tmp_path, seed=7)  # q/k norm
    _, calls = run(tmp_path, "float32", True, monkeypatch)
    assert calls == 0


def test_a_position_outside_the_rope_table_is_an_index_error(tmp_path):
    write_tiny("Llama", tmp_path, seed=8)
    llm = LLM(str(tmp_path), device="cpu", dtype="float32", max_num_seqs=1, block_size=4)
    runner = llm.engine.core.executor.runner
    step = runner.model.cpu_step
    assert step is not None
    meta = AttentionMetadata(query_start=torch.tensor([0, 1], dtype=torch.int32),
                             context_lens=torch.tensor([1], dtype=torch.int32),
                             block_tables=torch.tensor([[0]], dtype=torch.int32),
                             slot_mapping=torch.tensor([0]), block_size=4, max_query_len=1, max_context_len=1,
                             num_requests=1)  # fmt: skip
    x = torch.zeros(1, 64)
    with pytest.raises(IndexError, match="rotary position 100000 of token 0"):
        step(x, torch.tensor([100000]), [meta], runner.kv_caches)
    # the engine goes on
    out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    assert len(out[0].output_ids) == 4
    llm.shutdown()
