"""Greedy tokens and logits against Hugging Face transformers on the same random checkpoints."""

from __future__ import annotations

import pytest
import torch
from kv_modes import KV_MODES

from orca_backend import LLM, SamplingParams
from orca_backend.core.request import Request
from orca_backend.core.scheduler import ScheduledBatch, make_scheduler_output
from orca_backend.families.gpt2 import GPT2Config

transformers = pytest.importorskip("transformers")

GEOMETRIES = [
    # (hidden, layers, heads): head counts that are not powers of two, hidden sizes not multiples of 64
    GPT2Config(vocab_size=320, n_positions=96, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3),
    GPT2Config(vocab_size=400, n_positions=128, n_embd=96, n_layer=3, n_head=3, initializer_range=0.3),
    GPT2Config(vocab_size=300, n_positions=64, n_embd=120, n_layer=2, n_head=5, initializer_range=0.3),
    GPT2Config(vocab_size=512, n_positions=128, n_embd=160, n_layer=4, n_head=10, initializer_range=0.3),
]


def prompts_for(vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [1, 3, 7, 16, 29]
    return [torch.randint(0, vocab, (n,), generator=gen).tolist() for n in lengths]


@pytest.mark.parametrize("geometry", GEOMETRIES, ids=lambda g: f"h{g.n_embd}-l{g.n_layer}-nh{g.n_head}")
def test_greedy_tokens_equal_transformers(make_checkpoint, geometry):
    path, config = make_checkpoint(geometry, seed=7)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    prompts = prompts_for(config.vocab_size, seed=1)
    max_tokens = 20
    refs = []
    for prompt in prompts:
        with torch.no_grad():
            refs.append(hf.generate(
                torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                max_new_tokens=max_tokens, min_new_tokens=max_tokens, do_sample=False, pad_token_id=0,
            )[0, len(prompt):].tolist())  # fmt: skip
    for mode, options in KV_MODES.items():
        llm = LLM(str(path), max_num_seqs=8, **options)
        # Twice: the second run finds the first one's prompts in the prefix cache, when it is on.
        for _ in range(2):
            outs = llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
            for prompt, out, ref in zip(prompts, outs, refs, strict=True):
                assert out.output_ids == ref, f"{mode}: prompt {prompt}"
                assert out.finish_reason == "length"
        assert llm.engine.core.kv.used_tokens == 0


@pytest.mark.parametrize("geometry", GEOMETRIES[:2], ids=lambda g: f"h{g.n_embd}-nh{g.n_head}")
def test_last_token_logits_match_transformers(make_checkpoint, geometry):
    """Prefill and decode logits of a mixed flattened batch, against HF's full forward."""
    path, config = make_checkpoint(geometry, seed=3)
    hf = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    llm = LLM(str(path))
    engine = llm.engine
    prompts = prompts_for(config.vocab_size, seed=2)
    params = SamplingParams(max_tokens=4, temperature=0.0)
    requests = [Request(f"r{i}", p, params, arrival_time=0.0) for i, p in enumerate(prompts)]
    for r in requests:
        assert engine.core.kv.admit(r, others_running=True)
    runner = engine.core.executor.runner

    def logits_of(batch: ScheduledBatch, step: int, recorded: tuple[list[str], list[int]] = ([], [])) -> torch.Tensor:
        output = make_scheduler_output(batch, step, recorded)
        runner.update_states(output)
        return runner.run_stage(output)

    # Iteration 1: all prompts prefilled in one flat batch.
    prefill = logits_of(ScheduledBatch(requests, [len(p) for p in prompts]), 0)
    next_tokens = prefill.argmax(-1).tolist()
    for r, t in zip(requests, next_tokens, strict=True):
        r.num_computed = r.num_prompt_tokens
        r.output_ids.append(t)
    # Iteration 2: decode for the first three, while two fresh copies of prompts are prefilled beside them.
    fresh = [Request(f"f{i}", p, params, arrival_time=0.0) for i, p in enumerate(prompts[:2])]
    for r in fresh:
        assert engine.core.kv.admit(r, others_running=True)
    mixed = logits_of(ScheduledBatch(requests[:3] + fresh, [1, 1, 1] + [len(p) for p in prompts[:2]]), 1,
                      ([r.request_id for r in requests], next_tokens))  # fmt: skip

    with torch.no_grad():
        for i, p in enumerate(prompts):
            ref = hf(torch.tensor([p])).logits[0, -1]
            torch.testing.assert_close(prefill[i], ref, atol=1e-4, rtol=0)
        for i in range(3):
            ref = hf(torch.tensor([prompts[i] + [next_tokens[i]]])).logits[0, -1]
            torch.testing.assert_close(mixed[i], ref, atol=1e-4, rtol=0)
        for i in range(2):
            torch.testing.assert_close(mixed[3 + i], prefill[i], atol=1e-4, rtol=0)
