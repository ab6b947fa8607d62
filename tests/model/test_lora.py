"""Multi-LoRA against transformers + peft: tiny random checkpoints and random PEFT adapters (A and B
both random, so every targeted projection changes the tokens), greedy tokens of each request equal
those of the base model with its adapter merged by peft, float32, where the tiny checkpoints' margins
make exact equality sound (docs/architecture.md, Testing).

One batch mixes adapters A, B and none, for every family served (GPT-2's fused c_attn, the Llama
family's q/k/v/o and gate/up/down, Qwen3's q/k norm, Gemma 2, Mixtral's attention). Then: slots
evicted and reloaded (max_loras = 2, three adapters in flight), the prefix cache keyed by adapter,
preemption and chunked prefill, structured output, tensor and pipeline parallelism, the Triton
kernels through the engine, and every refusal with its reason.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hf_tiny import hf_greedy, randomize_norms, write_lora, write_tiny
from safetensors.torch import save_file

from orca_backend import LLM, SamplingParams
from orca_backend.config import model_config_from_hf
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, LoRARegistry, read_multi_lora_json

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")

N = 10
PROMPTS = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 254, 9, 11], [3], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69,
           70, 71, 72], [8, 9]]  # fmt: skip
NAMES = ["A", None, "B", "A", "B", None]  # each prompt's adapter in the mixed batch
LLAMA_A = ["q_proj", "v_proj", "o_proj", "down_proj"]
LLAMA_B = ["k_proj", "gate_proj", "up_proj"]
ALL_LLAMA = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# family -> (adapter A's targets and rank, adapter B's targets, rank and extra config)
ADAPTERS = {
    "GPT2": ((["c_attn", "c_proj"], 8, {"fan_in_fan_out": True}), (["c_fc", "c_proj"], 4, {"fan_in_fan_out": True})),
    "Llama": ((LLAMA_A, 8, {}), (LLAMA_B, 4, {"use_rslora": True})),
    "Qwen3": ((ALL_LLAMA, 16, {}), (["q_proj", "k_proj"], 8, {})),
    "Gemma2": ((ALL_LLAMA, 8, {}), (["v_proj", "down_proj"], 2, {})),
    "Mixtral": ((["q_proj", "k_proj", "v_proj", "o_proj"], 8, {}), (["o_proj"], 4, {})),
}


def write_base(family: str, path):  # noqa: ANN001, ANN201
    if family == "GPT2":
        from orca_backend.model.checkpoint import write_random_checkpoint

        config = GPT2Config(vocab_size=320, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
        write_random_checkpoint(path, config, seed=4, tokenizer=False)
        return transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    if family == "Gemma2":
        # untied: a tiny Gemma with tied embeddings repeats its last token, adapter or not
        base = write_tiny(family, path, seed=3, query_pre_attn_scalar=16, tie_word_embeddings=False)
        return randomize_norms(base, path, seed=2)
    extra = {"num_local_experts": 4, "num_experts_per_tok": 2} if family == "Mixtral" else {}
    return write_tiny(family, path, seed=3, **extra)


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """family -> (base path, {adapter name: path}, {adapter name or None: transformers model})."""
    out = {}
    for family, ((targets_a, rank_a, extra_a), (targets_b, rank_b, extra_b)) in ADAPTERS.items():
        root = tmp_path_factory.mktemp(family.lower())
        base = write_base(family, root / "base")
        models = {None: base, "A": write_lora(base, root / "A", 1, rank_a, targets_a, **extra_a),
                  "B": write_lora(base, root / "B", 2, rank_b, targets_b, **extra_b)}  # fmt: skip
        out[family] = (root / "base", {"A": str(root / "A"), "B": str(root / "B")}, models)
    return out


def params(name: str | None, n: int = N) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, lora_name=name)


def make_llm(path, adapters: dict[str, str], **engine) -> LLM:  # noqa: ANN001
    options = {"dtype": "float32", "max_num_seqs": 8, "enable_lora": True, "max_loras": 2, "max_lora_rank": 16,
               "lora_modules": adapters} | engine  # fmt: skip
    return LLM(str(path), **options)


def run(llm: LLM, prompts: list[list[int]], names: list[str | None]) -> list[list[int]]:
    return [o.output_ids for o in llm.generate(prompts, [params(n) for n in names])]


@pytest.fixture(scope="module")
def references(families):
    """family -> [(prompt, adapter) -> tokens] for every prompt under every adapter."""
    return {family: {(i, name): hf_greedy(models[name], prompt, N) for i, prompt in enumerate(PROMPTS) for name in models}
            for family, (_, _, models) in families.items()}  # fmt: skip


def expected(references, family: str, names: list[str | None]) -> list[list[int]]:  # noqa: ANN001
    return [references[family][(i, name)] for i, name in enumerate(names)]


@pytest.mark.parametrize("family", list(ADAPTERS))
def test_mixed_adapters_in_one_batch_equal_peft_merged(families, references, family):
    path, adapters, _ = families[family]
    # Control: each adapter changes the tokens of some prompt, so a delta dropped or misplaced is seen.
    for name in ("A", "B"):
        assert any(references[family][(i, name)] != references[family][(i, None)] for i in range(len(PROMPTS)))
    llm = make_llm(path, adapters)
    try:
        assert run(llm, PROMPTS, NAMES) == expected(references, family, NAMES)
        alone = run(llm, [PROMPTS[2]], ["B"])  # alone in its batch: the same tokens
        assert alone == [references[family][(2, "B")]]
    finally:
        llm.engine.shutdown()


def test_three_adapters_through_two_slots_stay_exact(families, references, tmp_path):
    """max_loras = 2 with adapters A, B and C in flight: C waits for a slot, evicts the least recently
    used adapter no running request holds, and every request's tokens stay peft's."""
    path, adapters, models = families["Llama"]
    c_model = write_lora(models[None], tmp_path / "C", 9, 8, ["v_proj", "up_proj"])
    llm = make_llm(path, {**adapters, "C": str(tmp_path / "C")}, max_num_seqs=3)
    names = ["A", "C", "B", "C", "A", "B"]
    want = [hf_greedy(c_model, p, N) if n == "C" else references["Llama"][(i, n)] for i, (p, n) in enumerate(zip(PROMPTS, names, strict=True))]
    try:
        assert run(llm, PROMPTS, names) == want
        assert llm.engine.stats().lora_loads >= 4  # three adapters through two slots: one was evicted and reloaded
    finally:
        llm.engine.shutdown()


def test_adapters_never_share_prefix_cache_entries(families, references):
    """The same prompt under A, under B, under none: no K/V computed with another adapter is reused
    (the adapters change k and v); under A again, A's own blocks are."""
    path, adapters, _ = families["Llama"]
    llm = make_llm(path, adapters, enable_prefix_caching=True, block_size=4)
    prompt, i = PROMPTS[4], 4
    try:
        hits = []
        for name in ("A", "B", None, "A"):
            before = llm.engine.stats().prefix_cache_hit_tokens
            assert run(llm, [prompt], [name]) == [references["Llama"][(i, name)]]
            hits.append(llm.engine.stats().prefix_cache_hit_tokens - before)
        assert hits[:3] == [0, 0, 0] and hits[3] == 12  # A's three full blocks, the last token recomputed
    finally:
        llm.engine.shutdown()


def test_preemption_and_chunked_prefill_with_adapters(families, references):
    path, adapters, _ = families["Llama"]
    llm = make_llm(path, adapters, kv_capacity_tokens=48, block_size=4, max_num_batched_tokens=5, kv_watermark=0.0)
    try:
        assert run(llm, PROMPTS, NAMES) == expected(references, "Llama", NAMES)
        assert llm.engine.stats().num_preemptions > 0
    finally:
        llm.engine.shutdown()


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tp", "pp"), [("Llama", 2, 1), ("GPT2", 2, 1), ("Qwen3", 1, 2)])
def test_parallel_equals_one_process(families, references, family, tp, pp):
    """tp: A and B shard as their base weights (column-parallel B rows, row-parallel A columns)."""
    path, adapters, _ = families[family]
    llm = make_llm(path, adapters, tensor_parallel_size=tp, pipeline_parallel_size=pp)
    try:
        assert run(llm, PROMPTS, NAMES) == expected(references, family, NAMES)
    finally:
        llm.engine.shutdown()


TRITON_SCRIPT = """
import json, sys
from orca_backend import LLM, SamplingParams
llm = LLM(sys.argv[1], kernels="triton", dtype="float32", max_num_seqs=8, enable_lora=True, max_loras=2,
          lora_modules=json.loads(sys.argv[2]))
assert llm.engine.core.executor.runner.model.ops.name == "triton"
names = json.loads(sys.argv[4])
outs = llm.generate(json.loads(sys.argv[3]), [SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, lora_name=n)
                                              for n in names])
print(json.dumps([o.output_ids for o in outs]))
"""


@pytest.mark.slow
def test_triton_kernels_through_the_engine(families, references):
    """The grouped shrink/expand kernels (interpreter, a fresh process) in the Llama forward."""
    path, adapters, models = families["Llama"]
    prompts, names = PROMPTS[:3], NAMES[:3]
    proc = subprocess.run([sys.executable, "-c", TRITON_SCRIPT, str(path), json.dumps(adapters), json.dumps(prompts),
                           json.dumps(names)], env=os.environ | {"TRITON_INTERPRET": "1"}, capture_output=True, text=True,
                          timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = [hf_greedy(models[n], p, 6) for p, n in zip(prompts, names, strict=True)]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == want


def test_structured_output_with_an_adapter(make_checkpoint, tmp_path):
    """A constrained request runs its adapter and keeps to its grammar."""
    config = GPT2Config(vocab_size=384, n_positions=128, n_embd=64, n_layer=2, n_head=4, initializer_range=0.3)
    path, _ = make_checkpoint(config, seed=5, tokenizer=True)
    base = transformers.GPT2LMHeadModel.from_pretrained(path).eval()
    write_lora(base, tmp_path / "A", 3, 8, ["c_attn"], fan_in_fan_out=True)
    llm = make_llm(path, {"A": str(tmp_path / "A")})
    try:
        choice = SamplingParams(max_tokens=8, temperature=0.0, lora_name="A",
                                structured_outputs={"choice": ["alpha", "beta", "gamma"]})  # fmt: skip
        out = llm.generate(["the"], choice)[0]
        assert out.text in ("alpha", "beta", "gamma") and out.finish_reason == "stop"
    finally:
        llm.engine.shutdown()


def test_unknown_or_disabled_adapters_are_refused_by_name(families):
    path, adapters, _ = families["Llama"]
    llm = make_llm(path, adapters)
    try:
        with pytest.raises(ValueError, match="LoRA adapter 'nope' is not served by this model"):
            llm.generate([[1, 2]], params("nope"))
        assert run(llm, [[1, 2]], ["A"])  # the engine goes on
    finally:
        llm.engine.shutdown()
    plain = LLM(str(path), dtype="float32")
    with pytest.raises(ValueError, match="LoRA is not enabled on this model"):
        plain.generate([[1, 2]], params("A"))


def test_an_adapter_that_fails_to_load_fails_its_requests_alone(families, tmp_path):
    """Its file vanished after registration: its requests end with the reason, the others finish."""
    path, adapters, models = families["Llama"]
    broken = tmp_path / "broken"
    write_lora(models[None], broken, 5, 4, ["q_proj"])
    llm = make_llm(path, {**adapters, "broken": str(broken)})
    (broken / "adapter_model.safetensors").write_bytes(b"not safetensors")
    events: dict[str, list] = {}
    streams = llm.engine.add_requests(PROMPTS[:3], [params("A"), params("broken"), params(None)],
                                      on_output=lambda o: events.setdefault(o.request_id, []).append(o))  # fmt: skip
    try:
        while llm.engine.has_work():
            llm.engine.step()
        last = [events[s.request_id][-1] for s in streams]
        assert [o.finish_reason for o in last] == ["length", "error", "length"]
        assert "LoRA adapter 'broken'" in last[1].error and "could not be loaded" in last[1].error
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize(("change", "message"), [
    ({"r": 32}, "rank 32 exceeds max_lora_rank 16"),
    ({"use_dora": True}, "use_dora=True is not supported"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"bias": "all"}, "bias='all' is not supported"),
    ({"peft_type": "IA3"}, "peft_type 'IA3' is not supported"),
])  # fmt: skip
def test_adapter_configs_not_computed_faithfully_are_refused(families, tmp_path, change, message):
    path, adapters, _ = families["Llama"]
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "adapter_model.safetensors").symlink_to(f"{adapters['A']}/adapter_model.safetensors")
    config = json.loads(Path(adapters["A"], "adapter_config.json").read_text()) | change
    (bad / "adapter_config.json").write_text(json.dumps(config))
    registry = LoRARegistry(model_config_from_hf(path / "config.json"), max_lora_rank=16)
    with pytest.raises(ValueError, match=message):
        registry.add("bad", str(bad))


def test_adapters_of_unsupported_modules_or_another_model_are_refused(families, tmp_path):
    path, _, models = families["Llama"]
    registry = LoRARegistry(model_config_from_hf(path / "config.json"), max_lora_rank=16)
    write_lora(models[None], tmp_path / "embed", 1, 4, ["embed_tokens"])
    with pytest.raises(ValueError, match="targets no projection this engine adapts"):
        registry.add("embed", str(tmp_path / "embed"))
    wider = write_tiny("Llama", tmp_path / "wider", seed=1, hidden_size=96)
    write_lora(wider, tmp_path / "other", 1, 4, ["q_proj"])
    with pytest.raises(ValueError, match="an adapter of another base model"):
        registry.add("other", str(tmp_path / "other"))
    # A MoE layer's MLP (transformers fuses Mixtral's experts; PEFT adapts them only through
    # target_parameters, refused above): an adapter naming an MLP projection there is refused.
    mixtral_path, mixtral_adapters, _ = families["Mixtral"]
    moe = LoRARegistry(model_config_from_hf(mixtral_path / "config.json"), max_lora_rank=16)
    experts = tmp_path / "experts"
    experts.mkdir()
    (experts / "adapter_config.json").write_text(Path(mixtral_adapters["A"], "adapter_config.json").read_text())
    key = "base_model.model.model.layers.0.mlp.gate_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(8, 64), key.format("B"): torch.zeros(96, 8)},
              str(experts / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="mixture-of-experts MLP of layer 0"):
        moe.add("experts", str(experts))
    # The layers under another family's prefix (GPT-2's transformer.h): PEFT never writes those for a Llama.
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "adapter_config.json").write_text(Path(families["Llama"][1]["A"], "adapter_config.json").read_text())
    key = "base_model.model.transformer.h.0.self_attn.q_proj.lora_{}.weight"
    save_file({key.format("A"): torch.zeros(8, 64), key.format("B"): torch.zeros(64, 8)},
              str(foreign / "adapter_model.safetensors"))  # fmt: skip
    with pytest.raises(ValueError, match="targets no projection this engine adapts"):
        registry.add("foreign", str(foreign))


def test_registry_paths_multi_lora_json_and_sync(families, tmp_path):
    path, adapters, _ = families["Llama"]
    model_config = model_config_from_hf(path / "config.json")
    jail = LoRARegistry(model_config, 16, allowed_dir=str(tmp_path))
    with pytest.raises(ValueError, match="outside lora_allowed_dir"):
        jail.add("A", adapters["A"])
    (tmp_path / "multi_lora.json").write_text(json.dumps({"A": adapters["A"], "B": adapters["B"]}))
    registry = LoRARegistry(model_config, 16)
    assert registry.sync(read_multi_lora_json(tmp_path / "multi_lora.json")) == []
    first_a = registry.get("A")
    assert registry.names == ["A", "B"]
    errors = registry.sync({"A": adapters["A"], "bad": str(tmp_path)})  # B removed, a bad one refused
    assert registry.names == ["A"] and registry.get("A") is first_a and "no adapter_config.json" in errors[0]
    registry.sync({"A": adapters["B"]})  # the name moved to another directory: a new adapter
    assert registry.get("A").lora_id != first_a.lora_id
    with pytest.raises(ValueError, match="does not exist"):
        read_multi_lora_json(tmp_path / "missing.json")


# ------------------------------------------------------------------ adapters that go bad, and hostile files
def copy_adapter(source: str, target: Path) -> Path:
    shutil.copytree(source, target)
    return target


def test_an_adapter_that_cannot_load_fails_alone_and_never_spends_the_failure_budget(families, references, tmp_path):
    """Its weights truncated after registration: more requests than the failure budget name it one
    after another on an idle engine; each ends with the reason (no server path), and the engine goes
    on serving the other adapters exactly."""
    path, adapters, _ = families["Llama"]
    broken = copy_adapter(adapters["B"], tmp_path / "broken")
    llm = make_llm(path, {**adapters, "broken": str(broken)}, max_consecutive_failed_iterations=3)
    weights = broken / ADAPTER_WEIGHTS
    weights.write_bytes(weights.read_bytes()[:-8])
    try:
        for _ in range(5):
            with pytest.raises(RuntimeError, match="LoRA adapter 'broken' could not be loaded: its weights changed "
                                                   "since it was registered") as failed:  # fmt: skip
                llm.generate([PROMPTS[0]], params("broken"))
            assert str(tmp_path) not in str(failed.value)
        assert llm.engine.healthy
        assert run(llm, PROMPTS[:2], ["A", None]) == expected(references, "Llama", ["A", None])
    finally:
        llm.engine.shutdown()


def test_an_adapter_that_cannot_load_under_tensor_parallelism(families, references, tmp_path):
    """Both ranks fail to load it and agree: its requests end with the reason, the batch's others are
    exact, and so are later requests (every rank zeroed the same slot)."""
    path, adapters, _ = families["Llama"]
    broken = copy_adapter(adapters["B"], tmp_path / "broken")
    llm = make_llm(path, {**adapters, "broken": str(broken)}, tensor_parallel_size=2)
    (broken / ADAPTER_WEIGHTS).unlink()
    events: dict[str, list] = {}
    try:
        streams = llm.engine.add_requests(PROMPTS[:3], [params("A"), params("broken"), params(None)],
                                          on_output=lambda o: events.setdefault(o.request_id, []).append(o))  # fmt: skip
        while any(not (events.get(s.request_id) and events[s.request_id][-1].finished) for s in streams):
            llm.engine.step()
        last = [events[s.request_id][-1] for s in streams]
        assert [o.finish_reason for o in last] == ["length", "error", "length"]
        assert "LoRA adapter 'broken' could not be loaded" in last[1].error
        tokens = [[t for o in events[s.request_id] for t in o.new_token_ids] for s in streams]
        assert [tokens[0], tokens[2]] == [references["Llama"][(0, "A")], references["Llama"][(2, None)]]
        assert run(llm, PROMPTS[3:5], ["B", "A"]) == [references["Llama"][(3, "B")], references["Llama"][(4, "A")]]
    finally:
        llm.engine.shutdown()


def test_adapter_files_linked_out_of_lora_allowed_dir_are_refused(families, tmp_path):
    path, adapters, _ = families["Llama"]
    model_config = model_config_from_hf(path / "config.json")
    jail = tmp_path / "jail"
    copy_adapter(adapters["A"], jail / "real")
    registry = LoRARegistry(model_config, 16, allowed_dir=str(jail))
    for linked, outside in ((ADAPTER_CONFIG, ADAPTER_WEIGHTS), (ADAPTER_WEIGHTS, ADAPTER_CONFIG)):
        directory = jail / f"links-{linked}"
        directory.mkdir()
        (directory / linked).symlink_to(Path(adapters["A"]) / linked)  # out of the jail
        shutil.copy(Path(adapters["A"]) / outside, directory / outside)
        with pytest.raises(ValueError, match=f"{linked} lies outside lora_allowed_dir"):
            registry.add("linked", str(directory))
    inside = jail / "inside"  # links that stay in the jail are followed
    inside.mkdir()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        (inside / name).symlink_to(jail / "real" / name)
    assert registry.add("inside", str(inside)).weights_file == str(jail / "real" / ADAPTER_WEIGHTS)


def test_an_adapter_directory_swapped_for_a_link_after_registration_is_not_served(families, references, tmp_path):
    """The directory of a registered adapter becomes a link to another adapter outside lora_allowed_dir:
    its requests fail (what would load is not what was checked), the watcher sees the change, and
    registering it again refuses it."""
    path, adapters, _ = families["Llama"]
    jail = tmp_path / "jail"
    served = copy_adapter(adapters["A"], jail / "A")
    llm = make_llm(path, {"A": str(served)}, lora_allowed_dir=str(jail))
    served.rename(jail / "A-old")
    served.symlink_to(adapters["B"])
    try:
        with pytest.raises(RuntimeError, match="LoRA adapter 'A' could not be loaded: its weights changed"):
            llm.generate([PROMPTS[0]], params("A"))
        assert llm.engine.changed_loras() == ["A"]
        errors = llm.engine.sync_loras({"A": str(served)})
        assert len(errors) == 1 and "lies outside lora_allowed_dir" in errors[0]
        assert llm.engine.list_loras() == [] and llm.engine.healthy
    finally:
        llm.engine.shutdown()


def test_an_adapter_rewritten_in_place_is_read_again_with_a_new_id(families, references, tmp_path):
    path, adapters, _ = families["Llama"]
    live = copy_adapter(adapters["A"], tmp_path / "live")
    llm = make_llm(path, {"A": str(live)})
    try:
        assert run(llm, [PROMPTS[0]], ["A"]) == [references["Llama"][(0, "A")]]
        first = llm.engine.loras.get("A")
        for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):  # the same files (inodes), rewritten
            (live / name).write_bytes((Path(adapters["B"]) / name).read_bytes())
        assert llm.engine.changed_loras() == ["A"]
        llm.engine.add_lora("A", str(live))  # what multi_lora.json's watcher does for a changed adapter
        assert llm.engine.loras.get("A").lora_id != first.lora_id and llm.engine.changed_loras() == []
        assert run(llm, [PROMPTS[0]], ["A"]) == [references["Llama"][(0, "B")]]
        llm.engine.add_lora("A", str(live))  # nothing changed: the same adapter
        assert llm.engine.loras.get("A").lora_id != first.lora_id
    finally:
        llm.engine.shutdown()


def _weights_with(path: Path, change) -> None:  # noqa: ANN001
    """Rewrites an adapter's safetensors file through `change(header: dict, body: bytearray) -> bytes`."""
    data = (path / ADAPTER_WEIGHTS).read_bytes()
    (size,) = struct.unpack("<Q", data[:8])
    (path / ADAPTER_WEIGHTS).write_bytes(change(json.loads(data[8 : 8 + size]), bytearray(data[8 + size :])))


def _pack(header: object, body: bytes = b"") -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + body


def _nan_first_value(header: dict, body: bytearray) -> bytes:
    key = next(k for k in header if k != "__metadata__")
    begin = header[key]["data_offsets"][0]
    body[begin : begin + 4] = struct.pack("<f", float("nan"))
    return _pack(header, bytes(body))


def _as_int64(header: dict, body: bytearray) -> bytes:
    key = next(k for k in header if k != "__metadata__")
    header[key]["dtype"] = "I64"
    return _pack(header, bytes(body))


# name -> (what is done to a copy of a good adapter, what its refusal says)
MALFORMED = {
    "config-list": (lambda d: (d / ADAPTER_CONFIG).write_text("[1, 2]"), "must hold a JSON object"),
    "alpha-null": ({"lora_alpha": None}, "lora_alpha must be a finite number"),
    "alpha-nan": ({"lora_alpha": float("nan")}, "lora_alpha must be a finite number"),
    "alpha-huge": ({"lora_alpha": 1e300}, "lora_alpha must be a finite number"),
    "rank-bool": ({"r": True}, "r must be a positive integer"),
    "header-list": (lambda d: (d / ADAPTER_WEIGHTS).write_bytes(_pack([1, 2])), "header must be a JSON object"),
    "header-huge": (lambda d: (d / ADAPTER_WEIGHTS).write_bytes(struct.pack("<Q", 100 * 2**20) + b"{}"),
                    "declares a header of 104857600 bytes"),
    "truncated": (lambda d: _weights_with(d, lambda h, b: _pack(h, bytes(b[:-4]))), "truncated"),
    "trailing": (lambda d: _weights_with(d, lambda h, b: _pack(h, bytes(b) + b"junk")), "after its last tensor"),
    "nan-weights": (lambda d: _weights_with(d, _nan_first_value), "holds NaN or infinite values"),
    "int-weights": (lambda d: _weights_with(d, _as_int64), "malformed entry"),
    "weights-fifo": (lambda d: ((d / ADAPTER_WEIGHTS).unlink(), os.mkfifo(d / ADAPTER_WEIGHTS)), "not a regular file"),
}  # fmt: skip


def test_a_re_read_refuses_each_malformed_adapter_alone(families, tmp_path):
    """A multi_lora.json re-read with good adapters around malformed ones: each bad one is refused with
    its reason, the good ones are served, nothing raises."""
    path, adapters, _ = families["Llama"]
    registry = LoRARegistry(model_config_from_hf(path / "config.json"), max_lora_rank=16)
    listed = {"A": adapters["A"]}
    for name, (damage, _) in MALFORMED.items():
        directory = copy_adapter(adapters["A"], tmp_path / name)
        if isinstance(damage, dict):
            config = json.loads((directory / ADAPTER_CONFIG).read_text()) | damage
            (directory / ADAPTER_CONFIG).write_text(json.dumps(config))
        else:
            damage(directory)
        listed[name] = str(directory)
    listed["B"] = adapters["B"]
    errors = registry.sync(listed)
    assert registry.names == ["A", "B"]
    assert len(errors) == len(MALFORMED)
    for name, (_, message) in MALFORMED.items():
        assert any(f"{tmp_path / name}:" in e and message in e for e in errors), (name, errors)


def test_speculative_decoding_with_adapters_equals_peft(families, references):
    """Proposals verified under each request's adapter (its rows carry its slot like its tokens):
    right up to a cycling place, every request's tokens stay peft's."""
    from engine_helpers import OracleProposer

    path, adapters, models = families["Llama"]
    spec = f'{{"method": "ngram", "num_speculative_tokens": {OracleProposer.K}}}'
    llm = make_llm(path, adapters, speculative_config=spec)
    want = expected(references, "Llama", NAMES)
    llm.engine.core.scheduler.proposer = OracleProposer(PROMPTS, want, models[None].config.vocab_size, "cycle")
    try:
        assert run(llm, PROMPTS, NAMES) == want
        assert llm.engine.stats().spec_num_accepted_tokens > 0
    finally:
        llm.engine.shutdown()
