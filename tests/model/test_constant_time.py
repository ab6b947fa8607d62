"""The constant-time measurement device (`constant-time-measure`, families/constant_time.py): it runs
through the real engine end to end with a real tokenizer, its tokens follow the documented pattern
whatever the sampling settings, and its forward does the same small, matmul-free work at any batch
size and context (counted op by op, never timed)."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from orca_backend import LLM, SamplingParams
from orca_backend.config import PRESETS, EngineConfig, check_parallel_layout, config_from_hf_dict
from orca_backend.model.checkpoint import EOS_TOKEN, train_byte_level_bpe
from orca_backend.model.loader import load_model
from orca_backend.model.stage_input import StageInput

PRESET = "constant-time-measure"
CONFIG = PRESETS[PRESET]


def expected_tokens(prompt: list[int], max_tokens: int) -> list[int]:
    """The pattern the device documents, computed in plain Python."""
    out, last, position = [], prompt[-1], len(prompt) - 1
    for _ in range(max_tokens):
        token = (CONFIG.token_mult * last + CONFIG.position_mult * position + CONFIG.offset) % (CONFIG.vocab_size - 1)
        token += token >= CONFIG.eos_token_id
        out.append(token)
        last, position = token, position + 1
    return out


@pytest.fixture(scope="module")
def tokenizer_file(tmp_path_factory):
    tok = train_byte_level_bpe(CONFIG.vocab_size, seed=0)
    assert (tok.get_vocab_size(), tok.token_to_id(EOS_TOKEN)) == (CONFIG.vocab_size, CONFIG.eos_token_id)
    path = tmp_path_factory.mktemp("tokenizer") / "tokenizer.json"
    tok.save(str(path))
    return path


def test_the_engine_serves_it_end_to_end_with_text(tokenizer_file):
    prompts = [[5, 900, 17], [1023], list(range(40, 80))]
    greedy = SamplingParams(max_tokens=24, temperature=0.0)  # EOS is never emitted: every request runs to 24
    sampled = SamplingParams(max_tokens=24, temperature=1.5, top_p=0.9, top_k=50, seed=3)
    with LLM(PRESET, tokenizer=str(tokenizer_file), max_num_seqs=2, kv_capacity_tokens=512, block_size=16) as llm:
        # A pool that holds nothing, while the K/V manager still assigns blocks: two requests at a time.
        assert llm.engine.core.executor.runner.kv_caches == []
        outs = llm.generate(prompts, greedy)
        again = llm.generate(prompts, [sampled] * len(prompts))
        stats = llm.engine.stats()
    for prompt, out, other in zip(prompts, outs, again, strict=True):
        assert out.output_ids == expected_tokens(prompt, 24) == other.output_ids
        assert out.finish_reason.value == "length"
        assert out.text == llm.tokenizer.decode(out.output_ids) and out.text  # detokenized like any model's
    assert len({t for o in outs for t in o.output_ids}) > 40  # varied: detokenizing them is real work
    assert stats.num_generated_tokens == 2 * 3 * 24


class _AtenLog(TorchDispatchMode):
    """Every aten op a forward runs, with the element count of its largest output."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (out if isinstance(out, (tuple, list)) else [out]) if isinstance(t, torch.Tensor)]
        self.ops.append((str(func.overloadpacket), max((t.numel() for t in tensors), default=0)))
        return out


def _forward_ops(model, batch: int, context: int) -> tuple[list[str], int, int, torch.Tensor]:
    """A forward of `batch` requests, the first prefilling `context` tokens and the rest decoding one:
    (the aten ops it ran, its largest tensor, its flops, the logits)."""
    num_tokens = context + batch - 1
    ids = torch.arange(num_tokens, dtype=torch.int64) % CONFIG.vocab_size
    positions = torch.cat([torch.arange(context), torch.full((batch - 1,), context + 7)])
    logits_indices = torch.arange(context - 1, num_tokens, dtype=torch.int32)
    log, flops = _AtenLog(), FlopCounterMode(display=False)
    with flops, log:
        logits = model.forward(StageInput(ids, positions), None, [], logits_indices)
    return [name for name, _ in log.ops], max(size for _, size in log.ops), flops.get_total_flops(), logits


def test_its_step_does_the_same_work_at_any_batch_and_context():
    model = load_model(EngineConfig(model=PRESET), CONFIG, torch.device("cpu"))
    assert model.weights.layers == [] and model.weights.num_bytes() == 0
    small_ops, small_largest, small_flops, small = _forward_ops(model, batch=1, context=1)
    large_ops, large_largest, large_flops, large = _forward_ops(model, batch=512, context=3000)
    # The same ops, none a matmul (a model's cost is matmuls of ~tokens x hidden): no flops at all.
    assert small_ops == large_ops and len(small_ops) <= 12
    assert not [op for op in large_ops if "mm" in op or "linear" in op or "conv" in op or "attention" in op]
    assert small_flops == large_flops == 0
    # The largest tensor is the logits the sampler needs, [batch, vocab]: nothing grows with the context.
    assert (small_largest, large_largest) == (CONFIG.vocab_size, 512 * CONFIG.vocab_size)
    # One entry per request stands out, and it is the documented next token.
    assert large.shape == (512, CONFIG.vocab_size) and int((large != 0).sum()) == 512
    assert small.argmax(1).tolist() == [expected_tokens([0], 1)[0]]


def test_a_device_directory_sets_a_step_time_and_brings_its_tokenizer(tmp_path, monkeypatch):
    from orca_backend.model import constant_time

    written = constant_time.write_device_dir(tmp_path / "device", step_time_ms=5)
    assert EngineConfig(model=str(tmp_path / "device")).model_config() == written
    assert written.step_time_ms == 5.0 and written.vocab_size == CONFIG.vocab_size
    waits = []
    monkeypatch.setattr(constant_time.time, "sleep", waits.append)  # the wait, counted rather than timed
    with LLM(str(tmp_path / "device"), max_num_seqs=4, kv_capacity_tokens=256) as llm:
        outs = llm.generate([[7, 8], [9]], SamplingParams(max_tokens=5, temperature=0.0))
        iterations = llm.engine.stats().num_iterations
    assert [o.output_ids for o in outs] == [expected_tokens([7, 8], 5), expected_tokens([9], 5)]
    assert all(o.text for o in outs)  # the directory's tokenizer.json is the model's
    assert waits == [0.005] * iterations and iterations >= 5


def test_it_refuses_what_it_cannot_be():
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_parallel_layout(CONFIG, 2, 1)
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        check_parallel_layout(CONFIG, 1, 2)
    with pytest.raises(ValueError, match=r"measurement device\) has no fields \['n_embd'\]"):
        config_from_hf_dict({"architectures": [CONFIG.architecture], "n_embd": 768}, "x/config.json")
    with pytest.raises(ValueError, match="step_time_ms must be >= 0"):
        config_from_hf_dict({"architectures": [CONFIG.architecture], "step_time_ms": -1}, "x/config.json")
