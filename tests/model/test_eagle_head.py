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
    head = load_eagle_head(str(write_eagle_head(tmp_path, modules, fc, fc_bias, prefix=prefix)), "eagle", target,
                           torch.float32,
                           torch.device("cpu"))  # fmt: skip
    embed, _ = target.vocab_tables()
    lm_head = embed  # GPT-2's LM head is its embedding (the model multiplies by a packed copy on CPU)
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
    with pytest.raises(ValueError, match="the EAGLE head.s hidden_size \\(32\\) is not the target.s hidden size \\(64\\)"):
        load_eagle_head(str(narrow), "eagle", target, torch.float32, torch.device("cpu"))
    modules = random_layers(head_config(64, 384), seed=0)
    eagle3 = write_eagle_head(tmp_path / "eagle3", modules, torch.zeros(64, 128), architecture="LlamaForCausalLMEagle3")
    with pytest.raises(ValueError, match="'LlamaForCausalLMEagle3' is not a head of method 'eagle'"):
        load_eagle_head(str(eagle3), "eagle", target, torch.float32, torch.device("cpu"))
    wrong_fc = write_eagle_head(tmp_path / "fc", modules, torch.zeros(64, 64))
    with pytest.raises(ValueError, match="needs fc.weight of shape \\[64, 128\\], got \\[64, 64\\]"):
        load_eagle_head(str(wrong_fc), "eagle", target, torch.float32, torch.device("cpu"))
    hass = write_eagle_head(tmp_path / "hass", modules, torch.zeros(64, 128))
    config = json.loads((hass / "config.json").read_text())
    (hass / "config.json").write_text(json.dumps(config | {"add_para_norm": True}))
    with pytest.raises(ValueError, match="add_para_norm is set, but embedding_layernorm.weight"):
        load_eagle_head(str(hass), "eagle", target, torch.float32, torch.device("cpu"))
    with pytest.raises(ValueError, match="is not a checkpoint directory with a config.json"):
        load_eagle_head(str(tmp_path / "none"), "eagle", target, torch.float32, torch.device("cpu"))


# ---- EAGLE-3 -------------------------------------------------------------------------------------
AUX = [1, 2, 3]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    """A four-layer tiny Llama (transformers' model, and the engine's over the same checkpoint)."""
    from hf_tiny import write_tiny

    path = tmp_path_factory.mktemp("llama4")
    model = write_tiny("Llama", path, seed=2, num_hidden_layers=4)
    config = EngineConfig(model=str(path))
    return model, load_model(config, config.model_config(), torch.device("cpu"))


def test_the_target_returns_the_hidden_states_entering_the_named_layers(llama):
    """StageInput.aux_layers: after each token's final hidden state, the residual stream entering
    each named layer, as transformers' hidden_states[layer] has it."""
    from orca_backend.model.stage_input import StageInput

    hf, target = llama
    tokens = torch.tensor([5, 17, 99, 3, 250, 41, 7])
    t = len(tokens)
    caches = [(torch.zeros(16 * BLOCK, 2, 16), torch.zeros(16 * BLOCK, 2, 16)) for _ in range(4)]
    stage_input = StageInput(tokens, torch.arange(t), pool_indices=torch.arange(t), aux_layers=(1, 3))
    _, hidden = target.forward(stage_input, [metadata(0, t)], caches, torch.tensor([t - 1]))
    with torch.no_grad():
        expected = hf(tokens[None], output_hidden_states=True).hidden_states
    torch.testing.assert_close(hidden, torch.cat([expected[-1][0], expected[1][0], expected[3][0]], dim=-1),
                               rtol=1e-4, atol=1e-4)  # fmt: skip


def test_the_eagle3_head_equals_its_reference_at_once_and_a_position_at_a_time(llama, tmp_path):
    from eagle_heads import random_eagle3, reference_eagle3, write_eagle3_head

    _, target = llama
    tensors = random_eagle3(64, 320, draft_vocab=100, seed=4)
    head = load_eagle_head(str(write_eagle3_head(tmp_path, tensors, 320, AUX)), "eagle3", target, torch.float32,
                           torch.device("cpu"))  # fmt: skip
    assert head.aux_layers == tuple(AUX)
    embed, _ = target.vocab_tables()
    gen = torch.Generator().manual_seed(5)
    t = 9
    tokens = torch.randint(0, 320, (t,), generator=gen)
    joined = torch.randn(t, 4 * 64, generator=gen)  # the final hidden state, then the three layers'
    expected_stream, expected_ids = reference_eagle3(tensors, embed, tokens.tolist(), joined[:, 64:])
    out, ids = head.propose(tokens, head.from_target(joined), torch.arange(t), metadata(0, t), pool(head),
                            torch.arange(t))  # fmt: skip
    torch.testing.assert_close(out, expected_stream, rtol=1e-3, atol=1e-3)
    assert ids.tolist() == expected_ids
    assert set(expected_ids) <= set((torch.arange(100) + tensors["d2t"]).tolist())  # the draft vocabulary's

    caches = pool(head)  # the first positions at once, then one a pass on the K/V they left
    head.propose(tokens[:5], head.from_target(joined[:5]), torch.arange(5), metadata(0, 5), caches, torch.tensor([4]))
    for p in range(5, t):
        out, ids = head.propose(tokens[p : p + 1], head.from_target(joined[p : p + 1]), torch.tensor([p]),
                                metadata(p, 1), caches, torch.tensor([0]))  # fmt: skip
        torch.testing.assert_close(out[0], expected_stream[p], rtol=1e-3, atol=1e-3)
        assert ids.item() == expected_ids[p]
    own = torch.randn(t, 64, generator=gen)
    own_stream, own_ids = reference_eagle3(tensors, embed, tokens.tolist(), own, from_target=False)
    # A whole pass on the head's own hidden states equals the reference on them.
    out, ids = head.propose(tokens, own, torch.arange(t), metadata(0, t), pool(head), torch.arange(t))
    torch.testing.assert_close(out, own_stream, rtol=1e-3, atol=1e-3)
    assert ids.tolist() == own_ids


def test_eagle3_heads_that_do_not_fit_are_refused(target, llama, tmp_path):
    from eagle_heads import random_eagle3, write_eagle3_head

    _, llama_target = llama
    tensors = random_eagle3(64, 320, draft_vocab=100, seed=4)
    with pytest.raises(ValueError, match="method 'eagle3' is not served for GPT2 models"):
        load_eagle_head(str(write_eagle3_head(tmp_path / "a", tensors, 320, AUX)), "eagle3", target, torch.float32,
                        torch.device("cpu"))  # fmt: skip
    with pytest.raises(ValueError, match="reads three distinct layers of the target's 4, got \\[2, 2, 1\\]"):
        load_eagle_head(str(write_eagle3_head(tmp_path / "b", tensors, 320, None)), "eagle3", llama_target,
                        torch.float32, torch.device("cpu"))  # fmt: skip
    bad = dict(tensors, d2t=tensors["d2t"][:50])
    with pytest.raises(ValueError, match="d2t has shape \\[50\\], not \\[100\\]"):
        load_eagle_head(str(write_eagle3_head(tmp_path / "c", bad, 320, AUX)), "eagle3", llama_target, torch.float32,
                        torch.device("cpu"))  # fmt: skip
    eagle1 = write_eagle3_head(tmp_path / "d", tensors, 320, AUX, architectures=["EagleLlamaForCausalLM"])
    with pytest.raises(ValueError, match="'EagleLlamaForCausalLM' is not a head of method 'eagle3'"):
        load_eagle_head(str(eagle1), "eagle3", llama_target, torch.float32, torch.device("cpu"))
