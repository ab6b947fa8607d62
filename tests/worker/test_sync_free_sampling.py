"""Sampling on the GPU path waits for nothing (docs/architecture.md, "Sampling"): under the capture
guard of tests/graph_checks.py, the sampler's launch for sampled traffic (temperature, top-k,
top-p, seeds, penalties, logit_bias, min_tokens, logprobs, prompt logprobs) reads no value back and copies to the
device only from the registered staging arena; the step's one read is `SampledTokens.result`, which
async scheduling makes after the next step is launched; and the run-ahead index comes from the
staging arena too. On a CPU the device's memory is what the runner keeps (the per-row tables, the
penalty tables, the device side of the arena) and what the step's own ops made."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from graph_checks import HOST_READS, CaptureGuard, HostReadError, capture_guard

from orca_backend import LLM, SamplingParams
from orca_backend.worker import sampler as sampler_module
from orca_backend.worker.model_runner import ModelRunner
from orca_backend.worker.sampler import SampledTokens

PROMPTS = [[5, 6, 7], [100, 3, 250, 7, 7], [42], [17, 17, 300, 9], [5, 6, 7, 164, 202, 19, 109, 285], [8, 9]]


def sampled_traffic(n: int) -> list[SamplingParams]:
    """Every sampling feature, each on several requests, seeded; some greedy beside them."""
    params = []
    for i in range(n):
        params.append(SamplingParams(
            max_tokens=10 + i % 4, temperature=0.0 if i % 5 == 4 else 0.8, top_p=0.9, top_k=(0, 20, 50)[i % 3],
            seed=100 + i, repetition_penalty=1.2 if i % 2 else 1.0, presence_penalty=0.3 * (i % 3 == 1),
            frequency_penalty=0.4 * (i % 3 == 2), logit_bias={11: 2.0, 40 + i: -1.5} if i % 4 == 1 else None,
            min_tokens=4 if i % 3 == 0 else 0, stop_token_ids=[3, 19], logprobs=5 if i % 2 == 0 else None,
            prompt_logprobs=2 if i % 3 == 1 else None,
        ))  # fmt: skip
    return params


def device_memory(runner: ModelRunner) -> list[torch.Tensor]:
    """What stands for the device's memory of the sampling path on a CPU: the tables the runner keeps."""
    batch, processors = runner.input_batch, runner.input_batch.processors
    tensors = [batch.sampling_values, batch.sampling_ids, processors.values, processors.ids,
               batch.staging.device_buffer, processors._counts, processors._in_prompt]  # fmt: skip
    return [t for t in tensors if t is not None]


def guard_sampling(monkeypatch: pytest.MonkeyPatch, runner: ModelRunner) -> dict[str, list]:
    """Every sampler launch runs under a fresh CaptureGuard; every `result()` counts its host reads."""
    # On a CPU the argmax goes through numpy (faster there); the GPU path's is torch's.
    monkeypatch.setattr(sampler_module, "_argmax", lambda logits: logits.argmax(dim=-1))
    seen: dict[str, list] = {"batches": [], "reads": []}
    launch, result = runner.sampler.launch, SampledTokens.result

    def guarded_launch(logits, batch, *prompt):
        # The token a penalized request runs ahead on: made on the device before the launch (from the
        # staging arena and the last step's sampled ids, `ModelRunner._run_stage`).
        made = [batch.unrecorded] if batch.unrecorded is not None else []
        guard = CaptureGuard([logits, *device_memory(runner), *made], [runner.input_batch.staging.host])
        with capture_guard(monkeypatch, guard):
            sampled = launch(logits, batch, *prompt)
        seen["batches"].append(batch)
        return sampled

    def counted_result(self):
        reads = []
        with monkeypatch.context() as patch:
            for name in HOST_READS:
                real = getattr(torch.Tensor, name)

                def read(tensor, *args, _real=real, _name=name, **kwargs):
                    reads.append(_name)
                    return _real(tensor, *args, **kwargs)

                patch.setattr(torch.Tensor, name, read)
            out = result(self)
        seen["reads"].append(reads)
        return out

    monkeypatch.setattr(runner.sampler, "launch", guarded_launch)
    monkeypatch.setattr(SampledTokens, "result", counted_result)
    return seen


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sampled_traffic_reads_back_once_per_step(monkeypatch, async_scheduling):
    llm = LLM("gpt2-tiny", max_num_seqs=8, async_scheduling=async_scheduling)
    params = sampled_traffic(len(PROMPTS))
    expected = LLM("gpt2-tiny", max_num_seqs=8).generate(PROMPTS, params)
    seen = guard_sampling(monkeypatch, llm.engine.core.executor.runner)
    got = llm.generate(PROMPTS, params)
    assert [o.output_ids for o in got] == [o.output_ids for o in expected]  # the guard changed nothing
    assert [o.logprobs for o in got] == [o.logprobs for o in expected]
    assert [o.prompt_logprobs for o in got] == [o.prompt_logprobs for o in expected]
    assert sum(o.prompt_logprobs is not None for o in got) == 2
    batches = seen["batches"]
    assert len(batches) > 10 and len(seen["reads"]) == len(batches)
    assert all(reads == ["numpy"] for reads in seen["reads"])  # exactly the one read per step
    # Every stage ran under the guard, several times.
    for stage in ("random", "biased", "penalized", "banned"):
        assert sum(len(getattr(b, stage)[0]) > 0 for b in batches) > 3, stage
    assert sum(len(b.logprobs) > 0 for b in batches) > 3 and any(b.repetition for b in batches)
    # Under async scheduling penalized requests run ahead, counting their last token from the device.
    assert any(b.unrecorded is not None for b in batches) == async_scheduling


def test_the_guard_fails_a_sampling_step_that_reads_back_or_copies_from_elsewhere(monkeypatch):
    """The guard is not blind: a value read in a stage, or a tensor made from a list in a step, fails it."""
    llm = LLM("gpt2-tiny", max_num_seqs=8)
    runner = llm.engine.core.executor.runner
    guard_sampling(monkeypatch, runner)
    params = sampled_traffic(2)
    real_sample = sampler_module._sample_random

    # A host array read in the step (alive throughout, so no temporary of the step can share its address).
    pageable = torch.from_numpy(np.zeros(len(params), dtype=np.float32))
    for cheat in (lambda batch: batch.draws.tolist(), lambda batch: batch.draws + pageable):
        def cheating(logits, batch, cheat=cheat):
            cheat(batch)
            return real_sample(logits, batch)

        monkeypatch.setattr(sampler_module, "_sample_random", cheating)
        with pytest.raises(HostReadError), torch.inference_mode():
            runner.sampler.launch(*_one_step(llm, params))


runner_steps: list = []


def _one_step(llm: LLM, params: list[SamplingParams]):
    """A prefill of two sampled requests, prepared and run by hand: (logits, sampling batch)."""
    from orca_backend.core.request import Request
    from orca_backend.core.scheduler import ScheduledBatch, make_scheduler_output

    requests = [Request(f"probe{i}-{len(runner_steps)}", PROMPTS[i], p, arrival_time=0.0) for i, p in enumerate(params)]
    runner_steps.append(requests)
    kv = llm.engine.core.kv
    for r in requests:
        assert kv.admit(r, others_running=False)
    runner = llm.engine.core.executor.runner
    step = make_scheduler_output(ScheduledBatch(requests, [len(r.prompt_ids) for r in requests]), -1)
    runner.update_states(step)
    logits = runner.run_stage(step)
    return logits, runner._step[1].sampling


def test_the_run_ahead_index_comes_from_the_staging_arena(monkeypatch):
    """Async scheduling: the (positions, sources) index of the requests run ahead is copied to the device
    from the registered staging arena (pinned on CUDA), not made from a pageable array."""
    llm = LLM("gpt2-tiny", max_num_seqs=8, async_scheduling=True)
    runner = llm.engine.core.executor.runner
    ahead, indexes = runner._ahead_tokens, []

    def guarded(step):
        staging = runner.input_batch.staging
        assert runner._last_sampled is not None
        guard = CaptureGuard([staging.device_buffer, runner._last_sampled[1]], [staging.host])
        with capture_guard(monkeypatch, guard):
            positions, ids = ahead(step)
        indexes.append(positions)
        return positions, ids

    monkeypatch.setattr(runner, "_ahead_tokens", guarded)
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=1, ignore_eos=True)
    llm.generate(PROMPTS, params)
    assert len(indexes) > 5
    buffer = runner.input_batch.staging.device_buffer
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel()
    assert all(start <= p.data_ptr() < end for p in indexes)  # views of the arena's device side
