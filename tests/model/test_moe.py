"""Mixture-of-experts (Mixtral, Qwen2-MoE, Qwen3-MoE): greedy tokens equal transformers' on tiny
checkpoints it writes (float32, margins that make exact equality sound) in one batch, under both K/V
policies, with chunked prefill and prefix caching; tensor and pipeline parallelism equal one
process; the Triton grouped-GEMM path equals the torch reference under the interpreter without
reading anything back to the host."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_helpers import chunked_then_cached
from hf_tiny import write_tiny
from triton_testing import DEVICE, NEEDS_FRESH_PROCESS, no_host_reads, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.config import model_config_from_hf
from orca_kernels.moe import moe_torch
from orca_kernels.silu import silu_and_mul_torch

transformers = pytest.importorskip("transformers")
MIXTRAL = {"num_local_experts": 4, "num_experts_per_tok": 2}
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
PROMPTS = [[5, 17, 33, 2], [100, 7], [250, 251, 252, 253, 254, 9, 11], [3], [60, 61, 62],
           [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]]


QWEN_MOE = {
    # Qwen2-MoE: a gated shared expert beside the routed ones, no renormalisation of the top k, q/k/v bias.
    "Qwen2Moe": {"shared_expert_intermediate_size": 48, "norm_topk_prob": False, "mlp_only_layers": [],
                 "decoder_sparse_step": 1},
    # Qwen3-MoE: q/k norm, the top k renormalised, and layer 1 a dense MLP (mlp_only_layers).
    "Qwen3Moe": {"norm_topk_prob": True, "mlp_only_layers": [1], "decoder_sparse_step": 1, "head_dim": 16},
}
FAMILIES = ["Mixtral", *QWEN_MOE]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """family -> (path, transformers model) of a tiny checkpoint transformers wrote."""
    out = {}
    for family in FAMILIES:
        path = tmp_path_factory.mktemp(family.lower())
        if family == "Mixtral":
            out[family] = (path, write_tiny("Mixtral", path, seed=5, **MIXTRAL))
        else:
            out[family] = (path, write_tiny(family, path, seed=8, moe_intermediate_size=32, num_experts=4,
                                            num_experts_per_tok=2, **QWEN_MOE[family]))  # fmt: skip
    return out


@pytest.fixture(scope="module")
def references(checkpoints):
    return {family: [hf_greedy(model, p, GREEDY.max_tokens) for p in PROMPTS] for family, (_, model) in checkpoints.items()}


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=n, min_new_tokens=n, do_sample=False)
    return out[0, len(prompt):].tolist()


def generate(path, **engine) -> list[list[int]]:  # noqa: ANN001
    llm = LLM(str(path), dtype="float32", max_num_seqs=8, **engine)
    try:
        return [o.output_ids for o in llm.generate(PROMPTS, GREEDY)]
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("family", list(QWEN_MOE))
def test_qwen_moe_config(checkpoints, family):
    ours = model_config_from_hf(checkpoints[family][0] / "config.json")
    assert ours.num_experts == 4 and ours.norm_topk_prob == QWEN_MOE[family]["norm_topk_prob"]
    assert [ours.is_moe_layer(i) for i in range(2)] == [True, family == "Qwen2Moe"]


def test_mixtral_config(checkpoints):
    config = model_config_from_hf(checkpoints["Mixtral"][0] / "config.json")
    assert (config.num_experts, config.num_experts_per_tok) == (4, 2)


@pytest.mark.parametrize("policy", ["paged", "reserve"])
@pytest.mark.parametrize("family", FAMILIES)
def test_moe_greedy_equals_transformers_in_one_batch(checkpoints, references, family, policy):
    """Six requests routed together (several share each expert): each gets transformers' tokens for
    it alone, under both K/V policies."""
    assert generate(checkpoints[family][0], kv_policy=policy) == references[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_moe_chunked_prefill_and_prefix_caching_keep_the_tokens(checkpoints, references, family):
    """Prompts cut into 3-token chunks (a chunk's tokens routed beside other requests' decodes), then
    the same prompts again over a warm prefix cache."""
    first, again = chunked_then_cached(str(checkpoints[family][0]), PROMPTS, GREEDY, chunk=3)
    assert first == again == references[family]


@pytest.mark.slow
@pytest.mark.parametrize(("family", "tp", "pp"), [("Mixtral", 2, 1), ("Qwen2Moe", 2, 1), ("Qwen3Moe", 2, 1),
                                                  ("Mixtral", 1, 2), ("Qwen3Moe", 1, 2)])  # fmt: skip
def test_moe_parallel_equals_one_process(checkpoints, references, family, tp, pp):
    """Every expert's width split over two ranks (Qwen2-MoE's shared expert too, its gate replicated);
    layers (Qwen3-MoE: a MoE one and a dense one) over two pipeline stages."""
    path = checkpoints[family][0]
    assert generate(path, tensor_parallel_size=tp, pipeline_parallel_size=pp) == references[family]


def test_moe_reference_equals_each_expert_run_alone():
    """The reference against its definition, written per token: sum_k w_k * down(silu(gate x) * up x)."""
    g = torch.Generator().manual_seed(0)
    x, w13, w2 = torch.randn(6, 16, generator=g), torch.randn(5, 24, 16, generator=g), torch.randn(5, 16, 12, generator=g)
    ids = torch.tensor([[0, 3], [3, 1], [1, 0], [4, 3], [0, 1], [3, 4]])
    weights = torch.rand(6, 2, generator=g)
    out = moe_torch(x, w13, w2, weights, ids, silu_and_mul_torch)
    for t in range(6):
        expected = sum(weights[t, s] * (w2[e] @ silu_and_mul_torch(w13[e] @ x[t])) for s, e in enumerate(ids[t].tolist()))
        torch.testing.assert_close(out[t], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the kernel tests run in this process")
def test_kernels_in_fresh_process() -> None:
    run_in_fresh_process(__file__ + "::test_moe_triton_equals_the_reference")
    run_in_fresh_process(__file__ + "::test_moe_triton_with_integer_experts_equals_the_reference")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("tokens", "k", "experts"), [(5, 2, 4), (1, 2, 8), (19, 3, 6)])
def test_moe_triton_equals_the_reference(monkeypatch, dtype, tokens, k, experts):
    """Experts with no tokens, runs padded to the block, ragged widths (hidden 40, intermediate 24);
    the launch reads nothing back to the host."""
    use_import_mode(monkeypatch)
    from orca_kernels import triton_moe, triton_silu

    g = torch.Generator().manual_seed(tokens * experts)
    x = torch.randn(tokens, 40, generator=g).to(dtype)
    w13 = (torch.randn(experts, 48, 40, generator=g) * 0.3).to(dtype)
    w2 = (torch.randn(experts, 40, 24, generator=g) * 0.3).to(dtype)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])  # the last: no token
    weights = torch.rand(tokens, k, generator=g).to(dtype)
    expected = moe_torch(x.float(), w13.float(), w2.float(), weights.float(), ids, silu_and_mul_torch)
    args = [t.to(DEVICE) for t in (x, w13, w2, weights, ids)]
    triton_moe.moe_triton(*args, silu_and_mul=triton_silu.silu_and_mul_triton)  # compiled outside the guard
    with no_host_reads(monkeypatch, "the Triton mixture-of-experts launch"):
        out = triton_moe.moe_triton(*args, silu_and_mul=triton_silu.silu_and_mul_triton)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def int_experts(experts: int, out: int, cols: int, bits: int, group: int, g_idx: bool, g: torch.Generator):
    """Random integer experts (int_quant's layout, stacked) and the float weights they stand for."""
    from orca_kernels.int_quant import IntWeight, dequantize_values, pack_int32, stack_experts

    groups = -(-cols // group)
    weights, dense = [], []
    for _ in range(experts):
        q = torch.randint(0, 2**bits, (out, cols), generator=g, dtype=torch.int32)
        scales = (torch.rand(out, groups, generator=g) + 0.5) / 2 ** (bits + 2)  # weights within about +-0.4
        zeros = torch.randint(0, 2**bits, (out, groups), generator=g).float()
        order = (torch.arange(cols) // group)[torch.randperm(cols, generator=g)].to(torch.int32) if g_idx else None
        weights.append(IntWeight(pack_int32(q, bits), scales, zeros, bits, group, order))
        dense.append(dequantize_values(q, scales, zeros, group, order, torch.float32))
    return stack_experts(weights), torch.stack(dense)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("bits", "group", "g_idx"), [(4, 32, False), (4, 16, False), (8, 64, False), (4, 24, False),
                                                      (4, 16, True), (8, 32, True)])  # fmt: skip
def test_moe_triton_with_integer_experts_equals_the_reference(monkeypatch, dtype, bits, group, g_idx):
    """Integer experts stay packed in the grouped GEMMs: a group spanning several tiles (32, 64 with
    the interpreter's 16-wide and 32-wide steps), one per tile (16), a group no tile fits (24) and
    activation order (g_idx: the per-value gather), against the reference over the same weights
    dequantized, and the reference's own integer path against it; nothing read back to the host."""
    use_import_mode(monkeypatch)
    from orca_kernels import triton_moe, triton_silu

    g = torch.Generator().manual_seed(bits * group + g_idx)
    tokens, k, experts, hidden, inner = 7, 2, 4, 64, 32
    w13, w13_dense = int_experts(experts, 2 * inner, hidden, bits, group, g_idx, g)
    w2, w2_dense = int_experts(experts, hidden, inner, bits, group, g_idx, g)
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    ids = torch.stack([torch.randperm(experts - 1, generator=g)[:k] for _ in range(tokens)])  # the last: no token
    weights = torch.rand(tokens, k, generator=g).to(dtype)
    expected = moe_torch(x.float(), w13_dense, w2_dense, weights.float(), ids, silu_and_mul_torch)
    torch.testing.assert_close(moe_torch(x.float(), w13, w2, weights.float(), ids, silu_and_mul_torch), expected)
    def on_device(experts):  # noqa: ANN001, ANN202
        return dataclasses.replace(experts, **{name: t.to(DEVICE) for name in ("packed", "scales", "zeros", "g_idx")
                                               if (t := getattr(experts, name)) is not None})  # fmt: skip

    args = (x.to(DEVICE), on_device(w13), on_device(w2), weights.to(DEVICE), ids.to(DEVICE))
    triton_moe.moe_triton(*args, silu_and_mul=triton_silu.silu_and_mul_triton)  # compiled outside the guard
    with no_host_reads(monkeypatch, "the Triton mixture-of-experts launch over integer experts"):
        out = triton_moe.moe_triton(*args, silu_and_mul=triton_silu.silu_and_mul_triton)
    tol = 1e-4 if dtype == torch.float32 else 6e-2
    torch.testing.assert_close(out.float().cpu(), expected, atol=tol, rtol=tol)


def test_moe_align_places_every_pair_once_in_its_experts_run():
    from orca_kernels.triton_moe import moe_align

    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [1, 2]])
    sorted_ids, block_expert = moe_align(ids, num_experts=4, block_m=4)
    pairs = ids.numel()
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == list(range(pairs))
    flat = ids.flatten()
    for b, expert in enumerate(block_expert.tolist()):
        block = sorted_ids[b * 4 : (b + 1) * 4]
        block = block[block < pairs]
        assert expert < 4 or len(block) == 0
        assert all(flat[p] == expert for p in block.tolist())
