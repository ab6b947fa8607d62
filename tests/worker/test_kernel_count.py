"""Kernels per decoder layer on the Triton kernel path (issue #41 item 4: at most 6 at every decode
bucket, batch 1 included), counted on the CPU through Triton's interpreter as a GPU would launch them,
and the fused path's greedy tokens equal to the torch references'.

Counting rule (what one model forward launches on a CUDA device):
- every Triton launch is one kernel (its interpreter's own torch ops are not counted: a GPU runs none);
- a GEMM (`gemm.linear`: F.linear on CUDA) is one kernel, its bias in cuBLASLt's epilogue, and
  `gemm.linear_bias_gelu` (torch._addmm_activation) one, bias and GELU in the epilogue: at one row
  too (an H200 trace with torch 2.11, docs/bench/gpu/smoke-2026-11-30); cuBLAS's split-K reduction,
  which it picks for some shapes at run time, is not counted;
- every other torch op is one kernel, except those that only make a view or allocate (`FREE_OPS`).
The GEMMs run on the CPU through cpu_gemm (patched here to record, not to change what they compute).

Per layer: the launches of a forward of a 3-layer model minus those of the same model with 1 layer,
halved, so the embedding, the final norm and the LM head drop out exactly.
"""

from __future__ import annotations

import json
from collections import Counter

import pytest
from hf_tiny import write_tiny
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
from triton_testing import INTERPRETED, NEEDS_FRESH_PROCESS, run_in_fresh_process, use_import_mode

from orca_backend import LLM, SamplingParams
from orca_backend.families.gpt2 import GPT2Config
from orca_backend.model import gemm

# torch ops that launch no CUDA kernel: views, metadata and allocations.
FREE_OPS = {
    "view", "_unsafe_view", "reshape", "t", "transpose", "permute", "unbind", "split", "split_with_sizes",
    "slice", "select", "expand", "as_strided", "alias", "detach", "unsqueeze", "squeeze", "empty",
    "empty_strided", "lift_fresh", "_reshape_alias", "result_type",
}  # fmt: skip
DECODE_BUCKETS = [1, 2, 16]  # batch 1 (the M = 1 cases), 2, and a larger bucket: the count is the same above 2
MAX_KERNELS_PER_LAYER = 6
GPT2_UNFUSED_KERNELS = [8, 8, 8]  # per layer at DECODE_BUCKETS


class KernelCounter(TorchDispatchMode):
    """Counts a forward's kernels by the module docstring's rule; `launches` names each one."""

    def __init__(self) -> None:
        super().__init__()
        self.launches: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in FREE_OPS:
            self.launches.append(f"aten.{name}")
        return func(*args, **(kwargs or {}))


def _install_counting(monkeypatch: pytest.MonkeyPatch, active: list[KernelCounter | None]) -> None:
    from triton.runtime.interpreter import InterpretedFunction

    real_run, real_linear, real_bias_gelu = InterpretedFunction.run, gemm.linear_cpu, gemm.linear_bias_gelu

    def run(self, *args, grid, warmup, **kwargs):
        if active[0] is not None and not warmup:
            active[0].launches.append(f"triton.{self.__name__}")
        with _disable_current_modes():
            return real_run(self, *args, grid=grid, warmup=warmup, **kwargs)

    def linear(x, weight, bias=None):
        if active[0] is not None:
            active[0].launches.append("gemm")
        with _disable_current_modes():
            return real_linear(x, weight, bias)

    def linear_bias_gelu(x, weight, bias, bias_gelu):
        counter, active[0] = active[0], None  # its CPU form (GEMM + bias_gelu) is not what CUDA runs
        try:
            with _disable_current_modes():
                out = real_bias_gelu(x, weight, bias, bias_gelu)
        finally:
            active[0] = counter
        if counter is not None:
            counter.launches.append("gemm_gelu")
        return out

    monkeypatch.setattr(InterpretedFunction, "run", run)
    monkeypatch.setattr(gemm, "linear_cpu", linear)
    monkeypatch.setattr(gemm, "linear_bias_gelu", linear_bias_gelu)


def _count_steps(model_path: str, batch: int, monkeypatch: pytest.MonkeyPatch) -> dict[str, list[str]]:
    """The launches of the prefill step and of the decode step of `batch` requests (eager: on a CPU
    the static-buffer step runs this same forward)."""
    active: list[KernelCounter | None] = [None]
    _install_counting(monkeypatch, active)
    llm = LLM(model_path, kernels="triton", max_num_seqs=max(DECODE_BUCKETS), kv_capacity_tokens=2048)
    model = llm.engine.core.executor.runner.model
    steps: dict[str, list[str]] = {}
    forward = model.forward

    def counted(stage_input, metas, kv_caches, logits_indices):
        counter = active[0] = KernelCounter()
        try:
            with counter:
                return forward(stage_input, metas, kv_caches, logits_indices)
        finally:
            active[0] = None
            kind = "decode" if metas[0].max_query_len == 1 else "prefill"
            steps[kind] = counter.launches

    monkeypatch.setattr(model, "forward", counted)
    prompts = [[(7 * i + j) % 200 + 1 for j in range(3)] for i in range(batch)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True, temperature=0.0))
    return steps


def _gpt2(make_checkpoint, layers: int) -> str:
    config = GPT2Config(vocab_size=256, n_positions=64, n_embd=64, n_layer=layers, n_head=2, initializer_range=0.3)
    return str(make_checkpoint(config, seed=3, tokenizer=False)[0])


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, dict[int, str]]:
    """Llama and Qwen2 (biased q/k/v) checkpoints written by transformers, of 1 and 3 layers."""
    pytest.importorskip("transformers")
    paths: dict[str, dict[int, str]] = {}
    for family in ("Llama", "Qwen2"):
        for layers in (1, 3):
            path = tmp_path_factory.mktemp(f"{family}{layers}")
            write_tiny(family, path, seed=11, num_hidden_layers=layers)
            paths.setdefault(family, {})[layers] = str(path)
    return paths


@pytest.mark.skipif(not NEEDS_FRESH_PROCESS, reason="the Triton cases run in this process")
def test_kernel_count_cases_in_fresh_process() -> None:
    run_in_fresh_process(__file__)


def _triton(monkeypatch: pytest.MonkeyPatch) -> None:
    use_import_mode(monkeypatch)  # skips where this process cannot run Triton (the fresh-process test does)
    if not INTERPRETED:
        pytest.skip("counted on the CPU, where Triton runs in its interpreter")


def _per_layer(paths: dict[int, str], monkeypatch: pytest.MonkeyPatch) -> tuple[dict[int, Counter[str]], str]:
    """Each decode bucket's launches per decoder layer, and their report."""
    per_layer: dict[int, Counter[str]] = {}
    for batch in DECODE_BUCKETS:
        one = Counter(_count_steps(paths[1], batch, monkeypatch)["decode"])
        three = Counter(_count_steps(paths[3], batch, monkeypatch)["decode"])
        extra = three - one  # two more layers' launches
        assert not one - three and extra and all(n % 2 == 0 for n in extra.values()), (one, three)
        per_layer[batch] = Counter({launch: n // 2 for launch, n in extra.items()})
    return per_layer, json.dumps({b: dict(per_layer[b]) for b in DECODE_BUCKETS}, indent=1)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["GPT2", "Llama", "Qwen2"])
def test_at_most_six_kernels_per_decoder_layer_at_every_decode_bucket(family, models, make_checkpoint, monkeypatch):
    """The fused path. GPT-2 runs it only under a raised cap (gemm.NORM_LINEAR_MAX_TOKENS: 0 for
    LayerNorm, measured slower on an H200), which the next kernel may earn back: it is counted as such."""
    _triton(monkeypatch)
    monkeypatch.setitem(gemm.NORM_LINEAR_MAX_TOKENS, "layernorm", max(DECODE_BUCKETS))
    paths = {n: _gpt2(make_checkpoint, n) for n in (1, 3)} if family == "GPT2" else models[family]
    per_layer, report = _per_layer(paths, monkeypatch)
    assert all(layer.total() <= MAX_KERNELS_PER_LAYER for layer in per_layer.values()), report
    # Every layer's GEMMs were counted.
    assert all(layer["gemm"] + layer["triton._norm_linear_kernel"] == 4 for layer in per_layer.values()), report


@pytest.mark.slow
def test_gpt2_takes_the_unfused_path_at_every_bucket(make_checkpoint, monkeypatch):
    """LayerNorm's cap is 0: every GPT-2 step runs two add + LayerNorm kernels, four cuBLAS GEMMs (biases
    and GELU in their epilogues) and the split-K decode attention's two launches: 8 a layer."""
    _triton(monkeypatch)
    assert gemm.NORM_LINEAR_MAX_TOKENS["layernorm"] == 0
    per_layer, report = _per_layer({n: _gpt2(make_checkpoint, n) for n in (1, 3)}, monkeypatch)
    assert not any(layer["triton._norm_linear_kernel"] for layer in per_layer.values()), report
    assert all(layer["triton._add_layernorm_kernel"] == 2 for layer in per_layer.values()), report
    assert [layer.total() for layer in per_layer.values()] == GPT2_UNFUSED_KERNELS, report


@pytest.mark.slow
@pytest.mark.parametrize("family", ["GPT2", "Llama", "Qwen2"])
def test_fused_norm_path_gives_the_torch_references_greedy_tokens(family, models, make_checkpoint, monkeypatch):
    """Prefill and decode steps within the cap take the fused path (gemm.NORM_LINEAR_MAX_TOKENS, raised to
    cover these prompts); greedy tokens equal the torch references' on the same checkpoint."""
    _triton(monkeypatch)
    monkeypatch.setitem(gemm.NORM_LINEAR_MAX_TOKENS, "layernorm", 16)
    monkeypatch.setitem(gemm.NORM_LINEAR_MAX_TOKENS, "rmsnorm", 16)
    path = _gpt2(make_checkpoint, 3) if family == "GPT2" else models[family][3]
    prompts = [[5, 9, 13, 2, 7], [40], [100, 50, 25, 12]]
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    expected = [o.output_ids for o in LLM(path, kernels="torch", max_num_seqs=4).generate(prompts, params)]
    llm = LLM(path, kernels="triton", max_num_seqs=4)
    assert llm.engine.core.executor.runner.model.can_fuse_norms
    assert [o.output_ids for o in llm.generate(prompts, params)] == expected
