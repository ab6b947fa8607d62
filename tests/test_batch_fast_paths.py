"""The per-iteration fast paths (issue #19) build exactly what the general code builds: a decode-only
batch flattens to the same BatchMeta, so does every batch with decodes of a churning run (the kept
block-table rows), the kept sampling columns follow a changing set of requests, the core process's
frame carries a step's CoreOutputs whole, and the sampler's CPU argmax is torch's."""

from __future__ import annotations

import pytest
import torch

from orca_backend import EngineConfig, SamplingParams
from orca_backend.core.batch_builder import BatchBuilder, _TableRows
from orca_backend.core.request import Request
from orca_backend.core.scheduler import ScheduledBatch
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.messages import CoreOutput, CoreOutputs, EngineStats, loads, outputs_frame, read_frame
from orca_backend.worker.sampler import _argmax


def _engine(policy: str, running: int = 6) -> LLMEngine:
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", max_num_seqs=8, kv_capacity_tokens=2048, block_size=4,
                                    kv_policy=policy))  # fmt: skip
    params = [SamplingParams(max_tokens=40, temperature=0.7 * (i % 2), top_k=i, top_p=0.9, seed=i, ignore_eos=True,
                             min_tokens=3 * (i % 3), stop_token_ids=[7]) for i in range(running)]  # fmt: skip
    engine.add_requests([[i + 1] * (3 + i) for i in range(running)], params, on_output=lambda o: None)
    return engine


@pytest.mark.parametrize("policy", ["paged", "reserve"])
def test_a_decode_only_batch_flattens_as_the_general_path_does(policy):
    engine = _engine(policy)
    core = engine.core
    for step in range(12):
        engine.step()
        batch = core.scheduler.schedule()
        assert batch is not None and batch.decode_only, f"step {step}: every request decodes"
        fast = core.batch_builder.build(batch, 1, ["gone"])
        general = BatchBuilder(core.kv.block_size, None, []).build(ScheduledBatch(batch.requests, batch.num_new_tokens), 1,
                                                               ["gone"])  # fmt: skip
        assert fast == general
        core.scheduler.update_from_output(batch, [1] * len(batch.requests))


@pytest.mark.parametrize("policy,prefix_caching", [("paged", False), ("paged", True), ("reserve", False)])
def test_the_kept_block_tables_follow_joins_ends_growth_and_preemption(policy, prefix_caching):
    """Every batch with decodes of a churning run (requests joining and ending at every few steps,
    tables growing a block at a time, a pool small enough to preempt, shared prefix blocks) is built
    from the kept table rows (its decodes; newcomers' prompts joined after them) exactly as the
    general path builds it from the request lists."""
    engine = LLMEngine(EngineConfig(model="gpt2-tiny", max_num_seqs=8, kv_capacity_tokens=96, block_size=4,
                                    kv_policy=policy, enable_prefix_caching=prefix_caching))  # fmt: skip
    core = engine.core
    kept_build = core.batch_builder.build
    request_sets = []
    mixed = 0

    def build_and_compare(batch: ScheduledBatch, batch_id: int, released: list[str]):
        nonlocal mixed
        meta = kept_build(batch, batch_id, released)
        if batch.num_decodes:
            general = BatchBuilder(core.kv.block_size, None, []).build(
                ScheduledBatch(batch.requests, batch.num_new_tokens), batch_id, released
            )
            assert meta == general, f"batch {batch_id}"
            request_sets.append(frozenset(r.request_id for r in batch.requests))
            mixed += not batch.decode_only
        return meta

    core.batch_builder.build = build_and_compare
    shared = [5, 6, 7, 8, 9, 10, 11, 12]  # two full blocks every prompt starts with
    added = 0
    for step in range(400):
        if step % 3 == 0 and added < 24:
            prompt = shared + [added + 20] * (1 + added % 5)
            engine.add_request(prompt, SamplingParams(max_tokens=4 + (7 * added) % 29, ignore_eos=True),
                               on_output=lambda o: None)  # fmt: skip
            added += 1
        if not engine.has_work() and added == 24:
            break
        engine.step()
    assert added == 24 and not engine.has_work()
    assert len(set(request_sets)) > 20  # the set of decoding requests changed again and again
    assert mixed > 5  # decodes beside newcomers' prompts
    if policy == "paged":
        assert core.scheduler.num_preemptions > 0
    assert len(core.batch_builder._table_rows._copied_from) < 24  # rows of ended requests were reused


def test_a_logged_table_change_of_an_ended_request_leaves_the_row_of_a_new_one_with_its_id():
    """With pipeline parallelism a request aborted in flight frees its K/V (a logged change) only when
    its batch returns, possibly after a new request reusing its id got a row: that row is not its."""
    rows = _TableRows()
    old = Request("x", [1], SamplingParams(), 0.0, block_table=[3, 4])
    (row,) = rows.assign([old])
    rows.release(["x"])
    new = Request("x", [1], SamplingParams(), 0.0, block_table=[7])
    assert rows.assign([new]) == [row]  # the freed row is reused
    old.block_table = []  # its K/V freed late
    rows.follow([old])
    assert rows.array[row].tolist()[:2] == [7, 0]
    new.block_table = [7, 8]
    rows.follow([new])
    assert rows.array[row].tolist()[:2] == [7, 8]


def test_the_kept_sampling_columns_follow_the_requests_of_each_batch():
    engine = _engine("reserve")  # every block held from the start: any subset can be run as it is
    core, builder = engine.core, engine.core.batch_builder
    engine.step()
    requests = list(core.scheduler.running)
    for subset in (requests, requests[1:], requests[::2], requests, requests[:1]):
        batch = ScheduledBatch(subset, [1] * len(subset))
        meta = builder.build(batch, 0, [])
        assert meta.request_ids == [r.request_id for r in subset]
        assert meta.seeds == [r.sampling_seed for r in subset]
        assert meta.top_k == [r.params.top_k for r in subset]
        assert meta.temperature == [r.params.temperature for r in subset]
        assert meta.banned_ids == [[7] if r.params.min_tokens > len(r.output_ids) else [] for r in subset]


def test_the_cpu_argmax_is_torchs_first_maximum():
    logits = torch.randn(64, 300)
    logits[3, 10] = logits[3, 20] = logits[3].max() + 1  # a tie: the first wins, as in torch
    logits[5] = float("-inf")
    assert torch.equal(_argmax(logits), logits.argmax(dim=-1))
    assert torch.equal(_argmax(logits[:, ::2]), logits[:, ::2].argmax(dim=-1))  # not contiguous: torch's own


def test_the_core_process_frame_carries_columns_other_outputs_and_stats():
    stats = EngineStats(*range(14))
    outputs = CoreOutputs(["a", "b"], [5, 6], [CoreOutput("c", [1, 2], True, "stop"), CoreOutput("d", [], True, "error", "boom")])
    read, read_stats, dead = read_frame(loads(outputs_frame(outputs, stats, "gone")))
    assert (read, read_stats, dead) == (outputs, stats, "gone")
    assert read.num_finished == 2 and len(read) == 4
    assert [o.request_id for o in read] == ["a", "b", "c", "d"]  # the columns first, then the others
