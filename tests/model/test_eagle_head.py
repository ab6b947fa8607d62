"""The EAGLE head (model/eagle.py) against transformers' own Llama decoder layers run as vLLM's EAGLE
model runs them (tests/eagle_heads.py): the same output hidden states and greedy tokens over a
sequence, at once and a position at a time on its K/V; the checkpoint's spellings it reads, and the
heads it refuses."""

from __future__ import annotations

import json

import pytest
import torch
from eagle_heads import head_config, random_layers, reference_head, write_eagle_head

from orca_backend.config import EngineConfig
from orca_backend.model.eagle import load_eagle_head
from orca_backend.model.loader import load_model
from orca_kernels import AttentionMetadata

BLOCK = 4


def metadata(start: int, count: int, num_blocks: int = 16) -> AttentionMetadata:
    """One request's `count` positions from `start`, its slots its positions (blocks 0, 1, ... in order)."""
    return AttentionMetadata(
        query_start=torch.tensor([0, count], dtype=torch.int32), context_lens=torch.tensor([start + count], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None], slot_mapping=torch.arange(start, start + count),
        block_size=BLOCK, max_query_len=count, max_context_len=start + count, num_requests=1,
    )  # fmt: skip


def pool(head) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (16 * BLOCK, head.num_kv_heads, head.config.head_dim)
    return [(torch.zeros(shape), torch.zeros(shape)) for _ in head.weights.layers]


@pytest.fixture(scope="module")
def target(tiny_checkpoint):
    path, _ = tiny_checkpoint
    config = EngineConfig(model=str(path))
    return load_model(config, config.model_config(), torch.device("cpu"))


@pytest.mark.parametrize(("layers", "bias", "prefix"), [(1, False, ""), (2, True, "model.")])
def test_the_head_equals_transformers_layers_at_once_and_a_position_at_a_time(target, tmp_path, layers, bias, prefix):
    config = head_config(64, 384, num_layers=layers)
    modules = random_layers(config, seed=layers)
    gen = torch.Generator().manual_seed(7)
    fc = 0.3 * torch.randn(64, 128, generator=gen)
    fc_bias = 0.3 * torch.randn(64, generator=gen) if bias else None
    head = load_eagle_head(str(write_eagle_head(tmp_path, modules, fc, fc_bias, prefix=prefix)), target, torch.float32,
                           torch.device("cpu"))  # fmt: skip
    embed, lm_head = target.vocab_tables()
    t = 11
    tokens = torch.randint(0, 384, (t,), generator=gen)
    hidden = torch.randn(t, 64, generator=gen)
    expected_out, expected_tokens = reference_head(modules, fc, fc_bias, embed, lm_head, tokens.tolist(), hidden)

    caches = pool(head)
    out, greedy = head.propose(tokens, hidden, torch.arange(t), metadata(0, t), caches, torch.arange(t))
    torch.testing.assert_close(out, expected_out, rtol=1e-3, atol=1e-3)
    assert greedy.tolist() == expected_tokens

    # The first positions at once, then one a pass on the K/V they left (as proposals are made).
    caches = pool(head)
    head.propose(tokens[:7], hidden[:7], torch.arange(7), metadata(0, 7), caches, torch.tensor([6]))
    for p in range(7, t):
        out, greedy = head.propose(tokens[p : p + 1], hidden[p : p + 1], torch.tensor([p]), metadata(p, 1), caches,
                                   torch.tensor([0]))  # fmt: skip
        torch.testing.assert_close(out[0], expected_out[p], rtol=1e-3, atol=1e-3)
        assert greedy.item() == expected_tokens[p]


def test_heads_that_do_not_fit_are_refused(target, tmp_path):
    modules = random_layers(head_config(32, 384, num_attention_heads=2, num_key_value_heads=2), seed=0)
    narrow = write_eagle_head(tmp_path / "narrow", modules, torch.zeros(32, 64))
    with pytest.raises(ValueError, match="the EAGLE head's hidden_size \\(32\\) is not the target's \\(64\\)"):
        load_eagle_head(str(narrow), target, torch.float32, torch.device("cpu"))
    modules = random_layers(head_config(64, 384), seed=0)
    eagle3 = write_eagle_head(tmp_path / "eagle3", modules, torch.zeros(64, 128), architecture="LlamaForCausalLMEagle3")
    with pytest.raises(ValueError, match="'LlamaForCausalLMEagle3' is not an EAGLE head this engine serves"):
        load_eagle_head(str(eagle3), target, torch.float32, torch.device("cpu"))
    wrong_fc = write_eagle_head(tmp_path / "fc", modules, torch.zeros(64, 64))
    with pytest.raises(ValueError, match="needs fc.weight of shape \\[64, 128\\], got \\[64, 64\\]"):
        load_eagle_head(str(wrong_fc), target, torch.float32, torch.device("cpu"))
    hass = write_eagle_head(tmp_path / "hass", modules, torch.zeros(64, 128))
    config = json.loads((hass / "config.json").read_text())
    (hass / "config.json").write_text(json.dumps(config | {"add_para_norm": True}))
    with pytest.raises(ValueError, match="add_para_norm is set, but embedding_layernorm.weight"):
        load_eagle_head(str(hass), target, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="is not a checkpoint directory with a config.json"):
        load_eagle_head(str(tmp_path / "none"), target, torch.float32, torch.device("cpu"))
