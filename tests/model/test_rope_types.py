"""The long-context rope types `yarn`, `dynamic` (NTK) and `longrope`, against transformers.

Tables: every row of the engine's cos/sin table (model/rope.py: attention factor folded in) against
transformers' own rotary embedding fed one position at a time, as its greedy generation feeds it (for
dynamic and longrope it recomputes the frequencies from `max(position_ids) + 1` at each call).

Tokens: tiny checkpoints written by transformers (float32; the large initializer range gives top-2
margins that make exact token equality sound) whose original context is 64 tokens, prompts inside it
and generations running up to twice past it; the engine's tokens equal transformers' one-prompt-at-a-
time greedy ones in one mixed batch, prefilled in chunks and again over a warm prefix cache. A
control shows the scaling changes the tokens, so a scaling ignored would fail. Gemma 3's global
layers read the same fields: their table is checked against its rotary.

Where tokens can differ from transformers: for dynamic and longrope, transformers rotates a prompt
*longer than the original window* with the frequencies of its whole length, the engine position by
position (row p with those of a sequence of p + 1 tokens; model/rope.py's docstring says why: batch
invariance, chunked prefill and the prefix cache). The prompts here stay inside the window, where
both rotate identically: the whole prompt with the window's frequencies, each later token with those
of its own position. Dynamic's table rows beyond the window are within a few float32 ulps of
transformers' (its NTK base is computed per row, vectorised); yarn's and longrope's are bit-equal.
"""

from __future__ import annotations

import json

import pytest
import torch
from engine_helpers import chunked_then_cached
from hf_tiny import hf_greedy, write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.config import model_config_from_hf
from orca_backend.families import model_config_from_json, model_config_to_json
from orca_backend.families.gemma import GemmaConfig
from orca_backend.families.llama import LlamaConfig
from orca_backend.model.rope import cos_sin_table, inverse_frequencies, rope_table

transformers = pytest.importorskip("transformers")

WINDOW = 64  # the checkpoints' original context
SHORT = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.8, 2.0]  # longrope's per-frequency divisors (head_dim 16: 8 of each)
LONG = [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 12.0, 16.0]

# (id, family, config overrides): the original window is 64 in each, the served context 128 or 256.
CASES = [
    # DeepSeek-V3's and Qwen3's way: max_position_embeddings is the extended context
    ("llama-yarn", "Llama", {"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": WINDOW, "rope_theta": 10000.0}}),
    # Qwen2.5's long-context config: max_position_embeddings stays the original, the factor extends it
    ("qwen2-yarn", "Qwen2", {"max_position_embeddings": WINDOW, "rope_parameters": {
        "rope_type": "yarn", "factor": 2.0, "rope_theta": 10000.0}}),
    ("qwen3-dynamic", "Qwen3", {"max_position_embeddings": WINDOW, "rope_parameters": {
        "rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}}),
    ("llama-dynamic", "Llama", {"max_position_embeddings": WINDOW, "rope_parameters": {
        "rope_type": "dynamic", "factor": 4.0, "rope_theta": 500.0}}),
    # Phi-3's way: no factor, max_position_embeddings / original sets the attention factor
    ("llama-longrope", "Llama", {"max_position_embeddings": 256, "rope_parameters": {
        "rope_type": "longrope", "original_max_position_embeddings": WINDOW, "short_factor": SHORT,
        "long_factor": LONG, "rope_theta": 10000.0}}),
]  # fmt: skip
CONTEXT = {"llama-yarn": 256, "qwen2-yarn": 128, "qwen3-dynamic": 128, "llama-dynamic": 256, "llama-longrope": 256}
PROMPTS = [[5, 17, 33, 2, 8], [100, 7, 250, 251, 252, 253, 254, 9, 11, 60, 61, 62, 63, 1, 2, 3, 4, 5, 6, 7],
           [7 + i for i in range(40)], [3 + (7 * i) % 300 for i in range(58)]]  # fmt: skip
GREEDY = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for case_id, family, overrides in CASES:
        path = tmp_path_factory.mktemp(case_id)
        out[case_id] = (path, write_tiny(family, path, seed=5, **overrides))
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    return {case_id: [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS] for case_id, (_, model) in checkpoints.items()}


def generate(path, **engine) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(path), dtype="float32", max_num_seqs=4, block_size=4, **engine)
    try:
        return [o.output_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.shutdown()


def hf_table(model: torch.nn.Module, positions: int, **layer_type: str) -> torch.Tensor:
    """transformers' cos/sin at each position, asked one position at a time in increasing order (as
    its greedy decoding asks), laid out as the engine's table: cos of each frequency, then sin.
    `layer_type`: which of Gemma 3's tables."""
    rotary = model.model.rotary_emb
    half = model.config.head_dim // 2
    x = torch.zeros(1, dtype=torch.float32)
    rows = []
    for p in range(positions):
        cos, sin = rotary(x, torch.tensor([[p]]), **layer_type)
        rows.append(torch.cat([cos[0, 0, :half], sin[0, 0, :half]]))
    return torch.stack(rows)


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_table_equals_transformers_rotary_at_every_position(checkpoints, case_id):
    path, model = checkpoints[case_id]
    config = model_config_from_hf(path / "config.json")
    assert config.max_context == CONTEXT[case_id]
    rotary = model.model.rotary_emb
    assert config.rope_attention_factor == pytest.approx(rotary.attention_scaling, rel=1e-12)
    table = rope_table(config, torch.device("cpu"))
    torch.testing.assert_close(table, hf_table(model, config.max_context), rtol=0, atol=1e-5)
    # Not the default rope: the scaling shows beyond the window at least (within it for yarn and longrope too).
    default = cos_sin_table(inverse_frequencies(config.head_dim, config.rope_theta), config.max_context, torch.device("cpu"))
    assert not torch.allclose(table[WINDOW:], default[WINDOW:], atol=1e-3)
    if case_id.endswith("dynamic"):  # NTK leaves the original window alone
        assert torch.equal(table[:WINDOW], default[:WINDOW])


@pytest.mark.parametrize(
    ("rope", "attention_factor"),
    [
        ({"rope_type": "yarn", "factor": 3.0, "mscale": 0.8, "mscale_all_dim": 0.5, "beta_fast": 16, "beta_slow": 2,
          "truncate": False}, None),  # fmt: skip
        ({"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 16, "attention_factor": 0.9}, 0.9),
        ({"rope_type": "longrope", "factor": 2.0, "attention_factor": 1.3, "short_factor": SHORT, "long_factor": LONG,
          "original_max_position_embeddings": 32}, 1.3),  # fmt: skip
    ],
)
def test_yarn_and_longrope_variants_match_transformers_init(rope, attention_factor):
    """The optional fields transformers' init functions read (mscale, mscale_all_dim, beta_fast,
    beta_slow, truncate, attention_factor, an explicit longrope factor), table and attention factor."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=64,
                                  rope_parameters=rope | {"rope_theta": 10000.0})  # fmt: skip
    config = LlamaConfig.from_hf_dict(hf.to_dict() | {"architectures": ["LlamaForCausalLM"]}, "config.json")
    _, factor = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf)
    assert config.rope_attention_factor == pytest.approx(factor, rel=1e-12)
    if attention_factor is not None:
        assert config.rope_attention_factor == attention_factor
    model = transformers.LlamaForCausalLM(hf)
    table = rope_table(config, torch.device("cpu"))
    torch.testing.assert_close(table, hf_table(model, config.max_context), rtol=0, atol=1e-5)


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_gemma3_global_layers_take_the_same_scaling(case_id):
    """Gemma 3's global layers read rope_parameters["full_attention"] through the same fields; its
    local layers keep their own unscaled base (a scaled one there is refused). Table level only: a
    tiny random Gemma repeats one token, where token equality would show nothing."""
    rope = next(overrides for c, _, overrides in CASES if c == case_id)
    hf = transformers.Gemma3TextConfig(
        vocab_size=320, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
        head_dim=16, num_hidden_layers=2, sliding_window_pattern=2, max_position_embeddings=rope["max_position_embeddings"],
        rope_parameters={"full_attention": rope["rope_parameters"], "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}},
    )  # fmt: skip
    config = GemmaConfig.from_hf_dict(hf.to_dict() | {"architectures": ["Gemma3ForCausalLM"]}, "config.json")
    assert config.max_context == CONTEXT[case_id] and config.rope_local_theta == 1e4
    model = transformers.Gemma3ForCausalLM(hf)
    table = rope_table(config, torch.device("cpu"))
    torch.testing.assert_close(table, hf_table(model, config.max_context, layer_type="full_attention"), rtol=0, atol=1e-5)


@pytest.mark.parametrize("policy", ["paged", "reserve"])
@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_greedy_equals_transformers_past_the_original_window(checkpoints, references, case_id, policy):
    """Four prompts inside the window decode together, 64 tokens each, so every one runs past the
    window (up to 122 of 128): each gets transformers' tokens for it alone."""
    assert all(len(p) < WINDOW < len(p) + GREEDY.max_tokens <= CONTEXT[case_id] for p in PROMPTS)
    path, _ = checkpoints[case_id]
    assert generate(path, kv_policy=policy) == references[case_id]


@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_chunked_prefill_and_prefix_caching_keep_the_tokens(checkpoints, references, case_id):
    """Prompts prefilled in 7-token chunks, then again over a warm prefix cache: the rotation of a
    position does not depend on how it was scheduled."""
    first, again = chunked_then_cached(str(checkpoints[case_id][0]), PROMPTS, GREEDY, chunk=7)
    assert first == again == references[case_id]


@pytest.mark.parametrize("case_id", ["qwen2-yarn", "llama-dynamic", "llama-longrope"])
def test_the_scaling_changes_the_tokens(tmp_path, checkpoints, references, case_id):
    """Control: the same weights with the default rope (and a context long enough) answer
    differently, so the tests above would see a scaling ignored."""
    path, _ = checkpoints[case_id]
    raw = json.loads((path / "config.json").read_text())
    raw["rope_parameters"] = {"rope_type": "default", "rope_theta": raw["rope_parameters"]["rope_theta"]}
    raw["max_position_embeddings"] = 256
    (tmp_path / "config.json").write_text(json.dumps(raw))
    (tmp_path / "model.safetensors").symlink_to(path / "model.safetensors")
    assert generate(tmp_path) != references[case_id]


def test_a_request_past_the_served_context_is_refused(checkpoints):
    """qwen2-yarn serves 64 x 2 = 128 tokens: 128 fit, 129 do not."""
    path, _ = checkpoints["qwen2-yarn"]
    llm = LLM(str(path), dtype="float32", max_num_seqs=2)
    try:
        assert len(llm.generate([[5] * 64], SamplingParams(max_tokens=64, ignore_eos=True))[0].output_ids) == 64
        with pytest.raises(ValueError, match="context length of 128"):
            llm.generate([[5] * 65], SamplingParams(max_tokens=64, ignore_eos=True))
    finally:
        llm.engine.shutdown()


def test_rope_fields_cross_to_the_workers(checkpoints):
    """The worker processes get the config as JSON: longrope's factor tuples and yarn's come back equal."""
    for case_id in ("llama-yarn", "llama-longrope"):
        config = model_config_from_hf(checkpoints[case_id][0] / "config.json")
        assert model_config_from_json(model_config_to_json(config)) == config


BASE = {"architectures": ["LlamaForCausalLM"], "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
        "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16, "max_position_embeddings": 128}  # fmt: skip


@pytest.mark.parametrize(
    ("rope", "message"),
    [
        ({"rope_type": "mrope", "mrope_section": [2, 3, 3]}, "rope type 'mrope' is not supported"),
        ({"type": "su", "short_factor": SHORT, "long_factor": LONG}, "rope type 'su' is not supported"),
        ({"rope_type": "longrope", "short_factor": SHORT, "long_factor": LONG[:4]}, "long_factor has 4 entries"),
        ({"rope_type": "longrope", "long_factor": LONG}, "needs short_factor"),
        ({"rope_type": "dynamic", "factor": 0.5}, "rope factor 0.5 of rope type 'dynamic'"),
    ],
)
def test_rope_variants_not_served_are_refused_naming_the_field(tmp_path, rope, message):
    (tmp_path / "config.json").write_text(json.dumps(BASE | {"rope_scaling": rope}))
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(tmp_path / "config.json")
