"""Sliding-window attention and the Gemma families, against transformers on tiny checkpoints it writes
(float32; the large initializer range gives top-2 margins that make exact token equality sound).

Mistral windows every layer, Qwen2 the layers from max_window_layers on, Gemma 2 every other layer
(and soft-caps scores and logits), Gemma 3 five of six by default (here every other, with a linear
rope scaling on the global layers and its own base on the local ones). Prompts and generations run
well past the 8-token window, so a window applied wrongly, or not at all, changes the tokens: a
control checks that it does. Both K/V policies, chunked prefill, prefix caching, tensor and pipeline
parallelism, and a K/V manager that frees the blocks behind the window (Mistral: every layer
windowed) while tokens stay transformers', and under K/V pressure (the mistral-sw-tiny preset: blocks
freed, reused and preempted) stay those of an ample pool.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys

import pytest
from engine_helpers import chunked_then_cached
from hf_tiny import hf_greedy, randomize_norms, write_tiny

from orca_backend import LLM, SamplingParams
from orca_backend.config import EngineConfig, model_config_from_hf
from orca_backend.core.engine_core import EngineCore
from orca_backend.families.gemma import GemmaConfig
from orca_backend.families.llama import FULL, SLIDING
from orca_backend.messages import EngineCoreRequest

transformers = pytest.importorskip("transformers")

WINDOW = 8
FAMILIES = {
    "Mistral": {"sliding_window": WINDOW},
    "Qwen2": {"sliding_window": WINDOW, "use_sliding_window": True, "max_window_layers": 1},
    "Gemma2": {"sliding_window": WINDOW, "query_pre_attn_scalar": 16, "num_hidden_layers": 4},
    "Gemma3": {"config_class": "Gemma3TextConfig", "sliding_window": WINDOW, "query_pre_attn_scalar": 16,
               "num_hidden_layers": 4, "sliding_window_pattern": 2,
               "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}},
}  # fmt: skip
EXPECTED_LAYERS = {
    "Mistral": (SLIDING, SLIDING),
    "Qwen2": (FULL, SLIDING),
    "Gemma2": (SLIDING, FULL) * 2,
    "Gemma3": (SLIDING, FULL) * 2,
}
GREEDY = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
PROMPTS = [
    [5, 17, 33, 2, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 40, 41, 42, 43],
    [100, 7],
    [250, 251, 252, 253, 254, 9, 11, 60, 61, 62, 63],
    [3],
    [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
]


def write_family(family: str, path, **overrides):  # noqa: ANN001, ANN202
    model = write_tiny(family, path, seed=11, **(FAMILIES[family] | overrides))
    return randomize_norms(model, path, seed=1) if family.startswith("Gemma") else model


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family.lower())
        out[family] = (path, write_family(family, path))
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    return {family: [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS] for family, (_, model) in checkpoints.items()}


def generate(path, prompts=PROMPTS, **engine) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, block_size=4, **engine)
    try:
        return [o.output_ids for o in llm.generate(prompts, GREEDY)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("family", list(FAMILIES))
def test_config_reads_the_windowed_layers(checkpoints, family):
    path, _ = checkpoints[family]
    config = model_config_from_hf(path / "config.json")
    assert config.sliding_window == WINDOW and config.layer_types == EXPECTED_LAYERS[family]
    assert config.kv_window == (WINDOW if family == "Mistral" else 0)  # a global layer keeps every block
    if family == "Gemma2":
        assert isinstance(config, GemmaConfig)
        assert (config.attn_logit_softcapping, config.final_logit_softcapping) == (50.0, 30.0)
    if family == "Gemma3":
        assert config.qk_norm and config.rope_linear == 2.0
        assert (config.rope_theta, config.rope_local_theta) == (1e6, 1e4)


@pytest.mark.parametrize("policy", ["paged", "reserve"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_equals_transformers_in_one_batch(checkpoints, references, family, policy):
    """Five requests of different lengths decode together: each gets transformers' tokens for it
    alone (batch invariance included)."""
    path, _ = checkpoints[family]
    assert generate(path, kv_policy=policy) == references[family]


@pytest.mark.parametrize("family", ["Mistral", "Gemma2"])
def test_the_window_changes_the_tokens(tmp_path, checkpoints, references, family):
    """Control: the same weights without a window answer differently, so the tests above would see
    a window ignored (or applied to the wrong layers)."""
    path, _ = checkpoints[family]
    unwindowed = tmp_path / "full"
    unwindowed.mkdir()
    raw = json.loads((path / "config.json").read_text())
    raw["sliding_window"] = None
    raw.pop("layer_types", None)
    if family == "Gemma2":
        raw["layer_types"] = [FULL] * raw["num_hidden_layers"]
    (unwindowed / "config.json").write_text(json.dumps(raw))
    (unwindowed / "model.safetensors").symlink_to(path / "model.safetensors")
    assert generate(unwindowed) != references[family]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_chunked_prefill_and_prefix_caching_keep_the_tokens(checkpoints, references, family):
    """Prompts cut into 5-token chunks over earlier K/V, then the same prompts again over a warm prefix
    cache (paged): chunks and cached blocks start inside and outside the window."""
    first, again = chunked_then_cached(str(checkpoints[family][0]), PROMPTS, GREEDY, chunk=5)
    assert first == again == references[family]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tp", "pp"), [("Mistral", 2, 1), ("Gemma2", 2, 2), ("Gemma3", 1, 2), ("Qwen2", 1, 2)])
def test_parallel_equals_one_process(checkpoints, references, family, tp, pp):
    """Heads over tensor-parallel ranks, layers (windowed and global) over pipeline stages."""
    path, _ = checkpoints[family]
    assert generate(path, tensor_parallel_size=tp, pipeline_parallel_size=pp) == references[family]


def test_a_long_mistral_generation_holds_a_window_of_blocks(checkpoints):
    """Every Mistral layer is windowed: a request generating 4x its window keeps at most
    ceil(window / block_size) + 1 blocks (measured from the K/V manager after every step, once its
    prompt is behind the window), and its tokens are still transformers'."""
    path, model = checkpoints["Mistral"]
    config = EngineConfig(model=str(path), dtype="float32", kv_policy="paged", block_size=4, max_num_seqs=2)
    core = EngineCore(config, model_config_from_hf(path / "config.json"))
    prompt, n = PROMPTS[2], 4 * WINDOW
    try:
        core.add_requests([EngineCoreRequest("r", prompt, SamplingParams(max_tokens=n, ignore_eos=True,
                                                                         temperature=0.0), 0.0, 0)])  # fmt: skip
        tokens, most = [], 0
        while core.has_work():
            tokens += [t for out in core.step() for t in out.new_token_ids]
            for request in core.scheduler.running:
                if request.num_computed >= len(prompt) + WINDOW:
                    most = max(most, core.kv.used_blocks)
    finally:
        core.shutdown()
    assert most <= -(-WINDOW // 4) + 1
    assert tokens == hf_greedy(model, prompt, n)


def test_mistral_preset_under_kv_pressure_keeps_its_tokens():
    """14 requests of mistral-sw-tiny (32-token window, blocks of 16) through a 200-token pool that
    must free the blocks behind the window and preempt: every request's tokens equal those of an
    ample reserved pool, which frees nothing. A block freed while the window still covers its last
    positions is handed to another request, which overwrites them."""
    rng = random.Random(0)
    prompts = [[rng.randrange(512) for _ in range(rng.randint(1, 40))] for _ in range(14)]
    params = [SamplingParams(max_tokens=rng.randint(40, 80), temperature=0.0, ignore_eos=True) for _ in prompts]
    outputs, preemptions = {}, {}
    for policy, capacity in (("reserve", 16384), ("paged", 200)):
        llm = LLM("mistral-sw-tiny", dtype="float32", max_num_seqs=16, kv_policy=policy, kv_capacity_tokens=capacity)
        try:
            outputs[policy] = [o.output_ids for o in llm.generate(prompts, params)]
            preemptions[policy] = llm.engine.stats().num_preemptions
        finally:
            llm.engine.shutdown()
    assert preemptions["paged"] > 0  # the pool was short, as meant
    assert outputs["paged"] == outputs["reserve"]


TRITON_SCRIPT = """
import json, sys
from orca_backend import LLM, SamplingParams
llm = LLM(sys.argv[1], kernels="triton", dtype="float32", max_num_seqs=8, block_size=4)
assert llm.engine.core.executor.runner.model.ops.name == "triton"
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=int(sys.argv[3]), temperature=0.0, ignore_eos=True))
print(json.dumps([o.output_ids for o in outs]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("family", ["Mistral", "Gemma2", "Gemma3"])
def test_triton_kernels_give_transformers_tokens(checkpoints, family):
    """The Triton set (interpreter, a fresh process): windowed prefill and split-K decode kernels,
    Gemma 2's soft-capping and the GeGLU kernel, through the engine, with blocks freed (Mistral)."""
    path, model = checkpoints[family]
    prompts, n = [PROMPTS[0], PROMPTS[1], PROMPTS[4]], 14
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(path), json.dumps(prompts), str(n)],
                          env=os.environ | {"TRITON_INTERPRET": "1"}, capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [hf_greedy(model, p, n) for p in prompts]


def test_gemma_presets_generate_the_same_alone_and_batched():
    for preset in ("gemma2-tiny", "gemma3-tiny", "mistral-sw-tiny"):
        llm = LLM(preset, max_num_seqs=4)
        try:
            prompts = [[5, 6, 7] * 15, [9]]
            outs = llm.generate(prompts, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))
            alone = llm.generate([prompts[0]], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
            assert alone.output_ids == outs[0].output_ids and len(outs[1].output_ids) == 40
        finally:
            llm.engine.shutdown()


@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
    ({"use_bidirectional_attention": True}, "use_bidirectional_attention"),
    ({"quantization_config": {"quant_method": "fp8"}}, "quant_method 'fp8'"),
])  # fmt: skip
def test_gemma_configs_it_cannot_serve_faithfully_are_refused(checkpoints, tmp_path, change, message):
    raw = json.loads((checkpoints["Gemma2"][0] / "config.json").read_text()) | change
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match=message):
        model_config_from_hf(tmp_path / "config.json")
