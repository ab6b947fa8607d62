"""Integer weight checkpoints: GPTQ (4 and 8 bits, symmetric or not, desc_act's g_idx, formats gptq
and gptq_v2), AWQ (GEMM) and compressed-tensors pack-quantized (group, channel; symmetric or not),
each written by tests/int_checkpoints.py as its quantizer packs it (compressed-tensors by its own
package), never by the engine's reader.

Greedy tokens equal transformers on the same weights: its own dequantizing load for
compressed-tensors, else the float checkpoint the writer's own dequantization makes (float32, tiny
checkpoints whose margins make exact equality sound); and differ from the unquantized checkpoint's.
Tensor parallelism splits whole groups (a split that cuts one is refused), MoE experts and LoRA on a
quantized base hold, and every scheme not served is refused at load naming its field. The Triton
GEMM that CUDA runs is tested against the torch reference under the interpreter."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest
import torch
from hf_tiny import hf_greedy, write_lora, write_tiny
from int_checkpoints import (
    dequantized_copy,
    pack_rows,
    v1_zeros,
    write_awq,
    write_compressed_tensors,
    write_gptq,
)
from safetensors.torch import load_file, save_file
from triton_testing import DEVICE, NEEDS_FRESH_PROCESS, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.config import model_config_from_hf
from orca_kernels.cpu_int_gemm import CpuIntWeight
from orca_kernels.int_quant import dequantize_int, pack_int32

transformers = pytest.importorskip("transformers")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 254, 9, 11], [3]]

# name -> writer of a quantized copy of a float checkpoint (returning the float weights it stands for)
SCHEMES = {
    "gptq-4bit-g16-sym": lambda src, out: write_gptq(src, out, 4, 16),
    "gptq-4bit-g32-asym-desc_act": lambda src, out: write_gptq(src, out, 4, 32, sym=False, desc_act=True),
    "gptq_v2-8bit-channel": lambda src, out: write_gptq(src, out, 8, -1, checkpoint_format="gptq_v2"),
    "awq-4bit-g32": lambda src, out: write_awq(src, out, 32),
    "ct-4bit-g16-sym": lambda src, out: write_compressed_tensors(src, out, 4, "group", 16, True),
    "ct-4bit-channel-asym": lambda src, out: write_compressed_tensors(src, out, 4, "channel", None, False),
    "ct-8bit-g32-asym": lambda src, out: write_compressed_tensors(src, out, 8, "group", 32, False),
}


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("llama")
    write_tiny("Llama", path, seed=11)
    return path


def engine_outputs(path: Path, **options) -> list:
    return LLM(str(path), dtype="float32", **options).generate(PROMPTS, SamplingParams(
        max_tokens=10, temperature=0.0, ignore_eos=True, logprobs=0))  # fmt: skip


def hf_tokens(path: Path, **load) -> list[list[int]]:
    """transformers' float32 greedy tokens for PROMPTS, the checkpoint's own architecture."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **load).eval()
    return [hf_greedy(model, prompt, GREEDY.max_tokens) for prompt in PROMPTS]


def chosen_logprobs(outputs: list) -> list[float]:
    return [lp[t].logprob for o in outputs for t, lp in zip(o.output_ids, o.logprobs, strict=True)]


@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_greedy_equals_transformers_on_the_same_weights(llama, tmp_path, scheme):
    quant_dir = tmp_path / scheme
    dense = SCHEMES[scheme](llama, quant_dir)
    config = model_config_from_hf(quant_dir / "config.json")
    assert config.int_format == scheme.split("-")[0].replace("ct", "compressed-tensors")
    outs = engine_outputs(quant_dir)
    expected = hf_tokens(dequantized_copy(quant_dir, dense))
    assert [o.output_ids for o in outs] == expected
    if scheme.startswith("ct"):  # transformers reads the format itself: its own decompression agrees
        assert hf_tokens(quant_dir, quantization_config=transformers.CompressedTensorsConfig(dequantize=True)) == expected
    # The quantization is really applied: other log-probs than the float checkpoint's (and at 4 bits
    # other tokens too).
    floats = engine_outputs(llama)
    assert chosen_logprobs(outs) != pytest.approx(chosen_logprobs(floats), abs=1e-4)
    if "4bit" in scheme:
        assert [o.output_ids for o in floats] != expected


def test_the_cpu_keeps_integer_layers_packed_where_its_kernel_reads_them(llama, tmp_path, caplog):
    """Groups of 32 columns: every projection stays packed for the C kernel (an eighth of float32's
    bytes); groups of 16, which it does not read at 4 bits, are dequantized at load, with a warning."""
    from orca_kernels.cpu_int_gemm import CpuIntWeight

    write_gptq(llama, tmp_path / "g32", 4, 32, sym=False, desc_act=True)
    layers = LLM(str(tmp_path / "g32"), dtype="float32").engine.core.executor.runner.model.weights.layers
    assert all(isinstance(getattr(layer, name), CpuIntWeight) for layer in layers
               for name in ("qkv_w", "o_w", "gate_up_w", "down_w"))  # fmt: skip
    write_gptq(llama, tmp_path / "g16", 4, 16)
    with caplog.at_level(logging.WARNING, logger="orca.model"):
        layers = LLM(str(tmp_path / "g16"), dtype="float32").engine.core.executor.runner.model.weights.layers
    assert not isinstance(layers[0].qkv_w, CpuIntWeight)  # a float weight (packed for oneDNN where it is used)
    assert "dequantized at load to torch.float32 (the CPU integer kernel cannot read it: groups of 16 columns" in caplog.text


def test_qwen2_biases_beside_integer_projections(tmp_path):
    """Qwen2's q/k/v biases stay float beside GPTQ integer projections."""
    write_tiny("Qwen2", tmp_path / "float", seed=5)
    dense = write_gptq(tmp_path / "float", tmp_path / "gptq", 4, 16, sym=False)
    expected = hf_tokens(dequantized_copy(tmp_path / "gptq", dense))
    assert [o.output_ids for o in LLM(str(tmp_path / "gptq"), dtype="float32").generate(PROMPTS, GREEDY)] == expected


@pytest.mark.parametrize(("group", "packed"), [(32, True), (16, False)])
def test_mixture_of_experts_with_integer_experts(tmp_path, group, packed):
    """Qwen2-MoE with every expert, shared expert and attention projection GPTQ-quantized (the
    router left in float, as quantizers leave it): groups of 32 keep every expert packed for the C
    kernel (one weight per expert), groups of 16, which it cannot read, are dequantized at load."""
    write_tiny("Qwen2Moe", tmp_path / "float", seed=3, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
               shared_expert_intermediate_size=48)  # fmt: skip
    dense = write_gptq(tmp_path / "float", tmp_path / "gptq", 4, group)
    assert any(".experts." in name for name in dense)
    expected = hf_tokens(dequantized_copy(tmp_path / "gptq", dense))
    llm = LLM(str(tmp_path / "gptq"), dtype="float32")
    layer = llm.engine.core.executor.runner.model.weights.layers[0]
    for experts in (layer.experts_w13, layer.experts_w2):
        if packed:
            assert isinstance(experts, list) and len(experts) == 4
            assert all(isinstance(w, CpuIntWeight) and w.bits == 4 and w.group == group for w in experts)
        else:
            assert isinstance(experts, torch.Tensor) and experts.dtype == torch.float32
    assert [o.output_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_mixtral_with_compressed_tensors_experts_keeps_them_packed(tmp_path):
    """Mixtral with every expert (w1, w2, w3) and attention projection pack-quantized by the
    compressed-tensors package (4 bits, asymmetric groups of 32): each expert stays packed for the C
    kernel, and the greedy tokens equal transformers' over the package's own dequantization."""
    write_tiny("Mixtral", tmp_path / "float", seed=5, num_local_experts=4, num_experts_per_tok=2,
               intermediate_size=64)  # fmt: skip
    dense = write_compressed_tensors(tmp_path / "float", tmp_path / "ct", 4, "group", 32, False)
    assert any(".experts.0.w2." in name for name in dense)
    expected = hf_tokens(dequantized_copy(tmp_path / "ct", dense))
    llm = LLM(str(tmp_path / "ct"), dtype="float32")
    layer = llm.engine.core.executor.runner.model.weights.layers[0]
    assert all(isinstance(w, CpuIntWeight) for w in [*layer.experts_w13, *layer.experts_w2])
    assert [o.output_ids for o in llm.generate(PROMPTS, GREEDY)] == expected


def test_lora_on_an_integer_base_equals_peft_on_the_dequantized_base(llama, tmp_path):
    dense = write_gptq(llama, tmp_path / "gptq", 4, 16, sym=False, desc_act=True)
    base = transformers.LlamaForCausalLM.from_pretrained(dequantized_copy(tmp_path / "gptq", dense),
                                                         dtype=torch.float32).eval()  # fmt: skip
    merged = write_lora(base, tmp_path / "adapter", seed=4, r=4, targets=["q_proj", "v_proj", "down_proj"])
    expected = [hf_greedy(merged, prompt, GREEDY.max_tokens) for prompt in PROMPTS]
    engine = LLM(str(tmp_path / "gptq"), dtype="float32", enable_lora=True, max_lora_rank=8,
                 lora_modules={"a": str(tmp_path / "adapter")})  # fmt: skip
    outs = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True, lora_name="a"))
    assert [o.output_ids for o in outs] == expected


@pytest.mark.slow
@pytest.mark.parametrize("scheme", ["gptq-4bit-g32-asym-desc_act", "ct-4bit-g16-sym", "awq-4bit-g32"])
def test_tensor_parallel_equals_one_process(llama, tmp_path, scheme):
    """tp = 2 splits o_proj's 64 input columns and down_proj's 96 on group boundaries (32 and 48:
    groups of 16; desc_act's g_idx takes any split; AWQ's groups of 32 fit o_proj's and down_proj's
    halves only where they divide, so its checkpoint has groups of 16 here)."""
    quant_dir = tmp_path / scheme
    if scheme.startswith("awq"):
        write_awq(llama, quant_dir, 16)
    else:
        SCHEMES[scheme](llama, quant_dir)
    one = [o.output_ids for o in LLM(str(quant_dir), dtype="float32").generate(PROMPTS, GREEDY)]
    two = LLM(str(quant_dir), dtype="float32", tensor_parallel_size=2)
    try:
        assert [o.output_ids for o in two.generate(PROMPTS, GREEDY)] == one
    finally:
        two.engine.shutdown()


def test_a_tensor_parallel_split_that_cuts_a_group_is_refused(llama, tmp_path):
    """down_proj's 96 input columns split in halves of 48 cut the groups of 32."""
    write_gptq(llama, tmp_path / "gptq", 4, 32)
    with pytest.raises(Exception, match="cuts the checkpoint's quantization groups of group_size 32"):
        LLM(str(tmp_path / "gptq"), dtype="float32", tensor_parallel_size=2, distributed_executor_backend="mp")


def test_projections_left_in_float_are_served_and_logged(llama, tmp_path, caplog):
    dense = write_gptq(llama, tmp_path / "gptq", 4, 16)
    tensors = load_file(str(tmp_path / "gptq" / "model.safetensors"))
    floats = load_file(str(llama / "model.safetensors"))
    layer = "model.layers.1.mlp.down_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        del tensors[f"{layer}.{suffix}"]
    tensors[layer + ".weight"] = dense[layer + ".weight"] = floats[layer + ".weight"]
    save_file(tensors, str(tmp_path / "gptq" / "model.safetensors"), metadata={"format": "pt"})
    with caplog.at_level(logging.WARNING, logger="orca.model"):
        outs = LLM(str(tmp_path / "gptq"), dtype="float32").generate(PROMPTS, GREEDY)
    assert "1 decoder projections are not quantized and are served in float (13 are): " + layer in caplog.text
    assert [o.output_ids for o in outs] == hf_tokens(dequantized_copy(tmp_path / "gptq", dense))


# --- refusals -----------------------------------------------------------------------------------


def with_quantization(llama: Path, out: Path, quantization: dict) -> Path:
    shutil.copytree(llama, out)
    config = json.loads((out / "config.json").read_text())
    config["quantization_config"] = quantization
    (out / "config.json").write_text(json.dumps(config))
    return out


CT_W4 = {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 16}}


@pytest.mark.parametrize(("quantization", "message"), [
    ({"quant_method": "gptq", "bits": 3, "group_size": 16}, "gptq quantization_config bits=3 is not served"),
    ({"quant_method": "gptq", "bits": 2, "group_size": 16}, "bits=2 is not served"),
    ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "checkpoint_format='marlin'"),
    ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "awq quantization_config version='gemv'"),
    ({"quant_method": "awq", "bits": 4, "zero_point": False}, "zero_point=False"),
    ({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized",
      "config_groups": {"g": {"weights": {"num_bits": 4, "type": "float", "strategy": "tensor_group",
                                          "group_size": 16}}}}, "format='nvfp4-pack-quantized'"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": CT_W4 | {"input_activations": {"num_bits": 8, "type": "int", "strategy": "token",
                                                            "dynamic": True}}}}, "input_activations"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"g": CT_W4},
      "kv_cache_scheme": {"num_bits": 8, "type": "int", "strategy": "tensor"}}, "kv_cache_scheme"),
    ({"quant_method": "compressed-tensors", "format": "pack-quantized",
      "config_groups": {"g": {"weights": CT_W4["weights"] | {"actorder": "group"}}}}, "weights.actorder='group'"),
    ({"quant_method": "bitsandbytes", "load_in_4bit": True}, "quant_method 'bitsandbytes'"),
])  # fmt: skip
def test_schemes_not_served_are_refused_naming_the_field(llama, tmp_path, quantization, message):
    with pytest.raises(ValueError, match=message.replace("(", "\\(").replace(")", "\\)")):
        model_config_from_hf(with_quantization(llama, tmp_path / "q", quantization) / "config.json")


def test_gpt2_integer_checkpoints_are_refused(tmp_path):
    raw = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 320, "n_embd": 64,
           "n_layer": 2, "n_head": 4, "n_positions": 128, "quantization_config": {"quant_method": "gptq", "bits": 4}}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ValueError, match="quant_method 'gptq'\\) is not supported on GPT2LMHeadModel"):
        model_config_from_hf(tmp_path / "config.json")


def test_an_integer_config_over_float_weights_is_refused_at_load(llama, tmp_path):
    plain = with_quantization(llama, tmp_path / "plain", {"quant_method": "gptq", "bits": 4, "group_size": 16})
    with pytest.raises(ValueError, match="declares integer weights, but the checkpoint holds no qweight tensor"):
        LLM(str(plain), dtype="float32")


def test_integer_tensors_under_a_float_config_are_refused(llama, tmp_path):
    write_gptq(llama, tmp_path / "gptq", 4, 16)
    config = json.loads((tmp_path / "gptq" / "config.json").read_text())
    del config["quantization_config"]
    (tmp_path / "gptq" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="belongs to a quantized checkpoint"):
        LLM(str(tmp_path / "gptq"), dtype="float32")


# --- the layout and the Triton dequantizing GEMM ---------------------------------------------------


def random_layout(n: int, k: int, bits: int, group: int, act_order: bool, seed: int):
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=g)
    groups = -(-k // group)
    scales = torch.rand(n, groups, generator=g) * 0.1 + 0.01
    zeros = torch.randint(0, 2**bits, (n, groups), generator=g).float()
    g_idx = (torch.randperm(k, generator=g) // group).to(torch.int32) if act_order else None
    return q, pack_int32(q, bits), scales, zeros, g_idx


@pytest.mark.parametrize(("bits", "group", "act_order"), [(4, 16, False), (8, 32, False), (4, 16, True)])
def test_dequantize_is_each_entry_minus_its_zero_times_its_scale(bits, group, act_order):
    q, packed, scales, zeros, g_idx = random_layout(12, 64, bits, group, act_order, seed=bits)
    dense = dequantize_int(packed, scales, zeros, bits, group, g_idx, torch.float32)
    for r, c in [(0, 0), (3, 17), (11, 63), (5, 40)]:
        gr = int(g_idx[c]) if g_idx is not None else c // group
        assert dense[r, c] == (q[r, c] - zeros[r, gr]) * scales[r, gr]


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zero_points_of_zero_read_back(bits):
    """Format `gptq` subtracts one from each packed word's fields across the word: a zero point of 0
    borrows from the field above. The reader undoes it exactly (adding one per unpacked value would
    read 2^bits and the next field one short)."""
    from orca_backend.model.int_quant import gptq_v1_zeros_to_v2
    from orca_kernels.int_quant import unpack_int32

    zeros = torch.randint(0, 2**bits, (64, 3), generator=torch.Generator().manual_seed(bits))
    zeros[0], zeros[1, 1], zeros[-1] = 0, 0, 2**bits - 1  # whole words of zeros, one alone, the largest
    stored = v1_zeros(pack_rows(zeros, bits).t().contiguous(), bits)
    assert torch.equal(unpack_int32(gptq_v1_zeros_to_v2(stored, bits), bits, dim=1).t().long(), zeros)


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_kernel_in_fresh_process() -> None:
    run_in_fresh_process(__file__ + "::test_int_linear_triton_equals_the_reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("m", "n", "k", "bits", "group", "act_order"), [
    (3, 40, 64, 4, 16, False),   # a few rows: split along the input
    (17, 33, 96, 8, 32, False),  # edges the tiles do not divide
    (5, 24, 128, 4, 32, True),   # desc_act's g_idx
    (2, 16, 64, 4, 64, False),   # one group per row
    (20, 48, 256, 4, 128, False),  # prefill over several output tiles; groups of four tiles
    (1, 16, 512, 4, 128, False),   # four input slices of one group each
    (3, 40, 96, 4, 24, False),     # groups no block of 16 or more divides: scales per value
    (4, 24, 128, 8, 32, True),     # desc_act at 8 bits
    (2, 24, 96, 8, 96, False),     # one group per row of three tiles
])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_int_linear_triton_equals_the_reference(monkeypatch, dtype, m, n, k, bits, group, act_order, bias):
    use_import_mode(monkeypatch)
    from orca_kernels import triton_int_quant

    _, packed, scales, zeros, g_idx = random_layout(n, k, bits, group, act_order, seed=m + n)
    gen = torch.Generator().manual_seed(m)
    x = torch.randn(m, k, generator=gen).to(dtype)
    b = torch.randn(n, generator=gen).to(dtype) if bias else None

    def on(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(DEVICE)

    out = triton_int_quant.int_linear_triton(on(x), on(packed), on(scales), on(zeros), bits, group, on(g_idx), on(b))
    # The reference multiplies in float32 the weight rounded to x's dtype, as the MMA reads it.
    weight = dequantize_int(packed, scales, zeros, bits, group, g_idx, dtype).float()
    expected = torch.nn.functional.linear(x.float(), weight, None if b is None else b.float())
    assert out.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
    else:  # the interpreter rounds the weight toward zero (GPUs to nearest): a bf16 ulp of the largest terms
        torch.testing.assert_close(out.float().cpu(), expected, atol=1e-2 * float(expected.abs().max()), rtol=2e-2)


def test_the_tiles_take_a_group_vector_where_a_block_divides_the_group():
    """Under the interpreter a group may be one tile, less, or several; on CUDA the stages of
    every path stay well inside Hopper's 227 KB of shared memory (x and packed-word tiles, and
    the per-value path's two float32 gathers, per stage)."""
    from orca_kernels.triton_int_quant import config

    def cpu(group: int, has_g_idx: bool = False) -> tuple[int, bool]:
        c = config(3, 4, group, has_g_idx, torch.bfloat16, cuda=False)
        return c.block_k, c.group_tile

    assert cpu(16) == (16, True) and cpu(32) == (32, True) and cpu(128) == (32, True) and cpu(96) == (32, True)
    assert cpu(24) == (32, False) and cpu(8) == (32, False) and cpu(128, has_g_idx=True) == (32, False)
    assert config(1, 4, 128, False, torch.bfloat16, cuda=True).block_k == 128
    for m in (1, 16, 17, 4096):
        for bits in (4, 8):
            for group, has_g_idx in ((16, False), (32, False), (128, False), (4096, False), (24, False), (128, True)):
                for dtype in (torch.bfloat16, torch.float16, torch.float32):
                    c = config(m, bits, group, has_g_idx, dtype, cuda=True)
                    assert c.group_tile == (not has_g_idx and group % 16 == 0)
                    assert not c.group_tile or group % c.block_k == 0
                    stage = c.block_m * c.block_k * dtype.itemsize + c.block_n * c.block_k * bits // 8
                    if not c.group_tile:
                        stage += 2 * c.block_n * c.block_k * 4 + c.block_k * 4
                    assert stage * c.num_stages <= 128 * 1024, (m, bits, group, has_g_idx, dtype, c)


def test_split_k_fills_the_programs_at_decode_and_not_at_prefill():
    from orca_kernels.triton_int_quant import split_k

    assert split_k(1, 4096, 4096, 16, 64, 64, programs=264) == 5  # 64 output tiles: split 5 ways to reach 264
    assert split_k(1, 128, 256, 16, 64, 64, programs=264) == 1  # too short to split in slices of 4 blocks
    assert split_k(512, 4096, 4096, 64, 128, 64, programs=264) == 1


def test_vllms_quantization_argument_must_match_the_checkpoint(llama, tmp_path):
    """model.json's `quantization` (vLLM's engine argument; its marlin kernel names read the same
    formats) is checked against what the checkpoint declares; nothing is quantized online."""
    from orca_backend.server.triton_config import vllm_parameters

    write_gptq(llama, tmp_path / "gptq", 4, 32)
    assert vllm_parameters({"model": "m", "quantization": "gptq_marlin"})["quantization"] == "gptq_marlin"
    outs = LLM(str(tmp_path / "gptq"), dtype="float32", quantization="gptq_marlin").generate(PROMPTS[:1], GREEDY)
    assert len(outs[0].output_ids) == GREEDY.max_tokens
    with pytest.raises(ValueError, match="quantization='awq' does not match the method .* declares \\('gptq'\\)"):
        LLM(str(tmp_path / "gptq"), dtype="float32", quantization="awq")
    with pytest.raises(ValueError, match="declares no quantization_config: this engine quantizes nothing at load"):
        LLM(str(llama), dtype="float32", quantization="fp8")
