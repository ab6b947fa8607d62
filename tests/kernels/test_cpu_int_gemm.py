"""The CPU integer-weight linear layer (kernels/orca_kernels/cpu_int_gemm.py, csrc/int_gemm.c) against
the torch reference (int_quant.py: the weight dequantized in float32, then F.linear), on every
instruction set this CPU runs: 4 and 8 bits, groups of 16 to a whole row, activation-ordered groups,
bias, bfloat16 activations, every token count up to the kernel's and past it (where the weight is
dequantized in C and multiplied by the float GEMM). Its dequantized weight is bit-equal to the
reference's; its products are summed in another order than F.linear's, so the outputs agree within
float32 rounding; and a token's result does not depend on the other tokens of its step."""

from __future__ import annotations

import pytest
import torch
from cpu_isas import SUPPORTED_ISAS

from orca_kernels import cpu_int_gemm
from orca_kernels.int_quant import dequantize_values, int_linear_torch, pack_int32

pytestmark = pytest.mark.skipif(not SUPPORTED_ISAS, reason="the C kernels need AVX2")


def layer(n: int, k: int, bits: int, group: int, act_order: bool, seed: int):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 2**bits, (n, k), generator=gen)
    groups = k // group
    scales = torch.rand(n, groups, generator=gen) * 0.05 + 0.005
    zeros = torch.randint(0, 2**bits, (n, groups), generator=gen).float()
    g_idx = (torch.randperm(k, generator=gen) // group).to(torch.int32) if act_order else None
    return q, scales, zeros, g_idx


@pytest.mark.parametrize("isa", SUPPORTED_ISAS)
@pytest.mark.parametrize(("bits", "group", "act_order"), [(4, 32, False), (4, 64, False), (8, 32, False),
                                                          (8, 64, False), (4, 128, False), (4, 32, True)])  # fmt: skip
@pytest.mark.parametrize("tokens", [1, 3, 4, 5, 8, 9])
def test_int_linear_cpu_equals_the_reference(isa, bits, group, act_order, tokens):
    n, k = 72, 128
    q, scales, zeros, g_idx = layer(n, k, bits, group, act_order, seed=bits * group + tokens)
    weight = cpu_int_gemm.repack(q, scales, zeros, bits, group, g_idx)
    gen = torch.Generator().manual_seed(tokens)
    x, bias = torch.randn(tokens, k, generator=gen), torch.randn(n, generator=gen)
    expected = int_linear_torch(x, pack_int32(q, bits), scales, zeros, bits, group, g_idx, bias)
    out = cpu_int_gemm.int_linear_cpu(x, weight, bias, isa=isa)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    out_bf16 = cpu_int_gemm.int_linear_cpu(x.bfloat16(), weight, bias.bfloat16(), isa=isa)
    assert out_bf16.dtype == torch.bfloat16
    expected_bf16 = int_linear_torch(x.bfloat16().float(), pack_int32(q, bits), scales, zeros, bits, group, g_idx,
                                     bias.bfloat16().float())  # fmt: skip
    torch.testing.assert_close(out_bf16.float(), expected_bf16, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("bits", [4, 8])
def test_dequantized_weight_is_bit_equal_to_the_reference(bits):
    q, scales, zeros, _ = layer(40, 96, bits, 32, False, seed=bits)
    weight = cpu_int_gemm.repack(q, scales, zeros, bits, 32, None)
    assert torch.equal(cpu_int_gemm.dequantize_cpu(weight), dequantize_values(q, scales, zeros, 32, None, torch.float32))


@pytest.mark.parametrize("isa", SUPPORTED_ISAS)
def test_a_tokens_result_does_not_depend_on_its_batch(isa):
    q, scales, zeros, _ = layer(200, 256, 4, 32, False, seed=3)
    weight = cpu_int_gemm.repack(q, scales, zeros, 4, 32, None)
    x = torch.randn(cpu_int_gemm.NATIVE_MAX_TOKENS, 256, generator=torch.Generator().manual_seed(1))
    together = cpu_int_gemm.int_linear_cpu(x, weight, isa=isa)
    for i in range(x.shape[0]):
        assert torch.equal(cpu_int_gemm.int_linear_cpu(x[i : i + 1], weight, isa=isa)[0], together[i])


@pytest.mark.parametrize(("cols", "bits", "group", "uneven", "problem"), [
    (80, 4, 16, False, "80 input columns are not a multiple of 32"),
    (128, 4, 16, False, "groups of 16 columns are not a multiple of 32"),
    (128, 8, 16, False, "groups of 16 columns are not a multiple of 32"),
    (128, 4, 32, True, "its activation-ordered groups do not each hold group_size columns"),
    (64, 8, 32, False, None),
])  # fmt: skip
def test_layouts_the_kernel_cannot_read_are_named(cols, bits, group, uneven, problem):
    g_idx = None
    if uneven:  # a tensor-parallel shard of activation-ordered columns: its groups hold uneven counts
        g_idx = torch.cat([torch.zeros(40), torch.arange(cols - 40) // group + 1]).to(torch.int32)
    assert cpu_int_gemm.cpu_layout_problem(cols, bits, group, g_idx) == problem
