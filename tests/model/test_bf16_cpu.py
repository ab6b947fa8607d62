"""The engine in bfloat16 on CPU against transformers' float32 forward of the same checkpoint
(tests/bf16_oracle.py's rule), GPT-2 and the Llama family, on every instruction set of the C decode
GEMM this CPU runs: the decode steps multiply bfloat16 weights in C (VDPBF16PS, or widened to float32
in registers), the prefills in oneDNN's bfloat16 GEMM."""

from __future__ import annotations

import pytest
import torch
from bf16_oracle import MAX_TOKENS, assert_near_top, prompts_for
from cpu_isas import SUPPORTED_ISAS, force_isa, forget_choices
from hf_tiny import write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.families.gpt2 import GPT2Config
from orca_kernels import cpu_gemm

transformers = pytest.importorskip("transformers")

# The geometries the oracle's tolerance was measured on (head_dim 16, and 24: masked lanes).
GPT2_GEOMETRIES = [
    GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3),
    GPT2Config(vocab_size=300, n_positions=128, n_embd=120, n_layer=2, n_head=5, initializer_range=0.3),
]
# GQA, and Qwen3's q/k norm with head_dim 24 (as test_cuda's bfloat16 cases).
LLAMA_CASES = {"llama-gqa2": ("Llama", {}), "qwen3-qknorm": ("Qwen3", {"head_dim": 24})}


@pytest.fixture
def bf16_decodes(monkeypatch):
    """Forces an instruction set and counts the bfloat16 matrices the C kernel multiplies, on plain
    weights or (AVX-512) on oneDNN's packed ones."""
    calls = []

    def spy(real):
        def counted(x, *args):
            calls.append(x.dtype)
            return real(x, *args)

        return counted

    for name in ("native_linear", "packed_native_linear"):
        monkeypatch.setattr(cpu_gemm, name, spy(getattr(cpu_gemm, name)))

    def force(isa: str) -> list[torch.dtype]:
        force_isa(monkeypatch, isa)
        return calls

    yield force
    monkeypatch.undo()
    forget_choices()


def generate_bf16(path, vocab: int) -> tuple[list[list[int]], list[list[int]]]:
    llm = LLM(str(path), device="cpu", dtype="bfloat16", max_num_seqs=16)
    prompts = prompts_for(vocab, seed=2)
    outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True))
    return prompts, [o.output_ids for o in outs]


@pytest.mark.parametrize("isa", SUPPORTED_ISAS)
@pytest.mark.parametrize("geometry", GPT2_GEOMETRIES, ids=lambda g: f"h{g.n_embd}-nh{g.n_head}")
def test_gpt2_bf16_tokens_are_near_top_under_fp32_reference(make_checkpoint, bf16_decodes, geometry, isa):
    calls = bf16_decodes(isa)
    path, config = make_checkpoint(geometry, seed=7, tokenizer=False)
    prompts, outputs = generate_bf16(path, config.vocab_size)
    assert calls and set(calls) == {torch.bfloat16}  # the decode steps ran the C kernel, in bfloat16
    hf = transformers.GPT2LMHeadModel.from_pretrained(path, dtype=torch.float32).eval()
    assert_near_top(hf, prompts, outputs)


@pytest.mark.parametrize("isa", SUPPORTED_ISAS)
@pytest.mark.parametrize("case_id", list(LLAMA_CASES))
def test_llama_family_bf16_tokens_are_near_top_under_fp32_reference(tmp_path, bf16_decodes, case_id, isa):
    calls = bf16_decodes(isa)
    family, overrides = LLAMA_CASES[case_id]
    hf = write_tiny(family, tmp_path, seed=1, **overrides)
    prompts, outputs = generate_bf16(tmp_path, hf.config.vocab_size)
    # the C GEMM multiplied in bfloat16 (the LM head of every step, the layers of the steps the C
    # decode step does not run; its own calls are the same kernel, tests/model/test_cpu_decoder_step.py)
    assert calls and set(calls) == {torch.bfloat16}
    assert_near_top(hf, prompts, outputs)
