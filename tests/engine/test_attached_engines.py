"""Several frontends over one engine core (core/frontends.py): the engine a Triton model's first
instance launches listens, the other instances' engines attach. Each gets exactly its own requests'
outputs, a frontend that goes has its requests aborted, and the core's end reaches them all."""

from __future__ import annotations

import secrets
import shutil
import tempfile
from pathlib import Path

import pytest
from core_hooks import StepGate
from serving_utils import wait_until

from orca_backend.config import EngineConfig
from orca_backend.core.frontends import OWNER, Frontends
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.messages import (
    CoreAddress,
    CoreOutput,
    CoreOutputs,
    EngineStats,
    FinishReason,
    loads,
    read_frame,
)
from orca_backend.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture
def address():
    directory = Path(tempfile.mkdtemp(prefix="orca-t"))  # short: an AF_UNIX path has at most 107 bytes
    yield CoreAddress(str(directory / "core.sock"), secrets.token_bytes(32))
    shutil.rmtree(directory, ignore_errors=True)


def prompts(n: int, offset: int) -> list[list[int]]:
    return [[(offset + 7 * i + j) % 50 + 1 for j in range(3 + i % 4)] for i in range(n)]


def generated(events: list) -> list[int]:
    return [t for event in events for t in event.new_token_ids]


def tokens(engine: LLMEngine, batch: list[list[int]], prefix: str) -> list[list[int]]:
    streams = [engine.add_request(p, GREEDY, request_id=f"{prefix}{i}") for i, p in enumerate(batch)]
    return [generated(list(stream)) for stream in streams]


def test_each_attached_engine_gets_its_own_requests_tokens_from_the_one_core(tiny_checkpoint, address):
    config = EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=8)
    reference = LLMEngine(config)
    batches = [prompts(4, offset) for offset in (0, 11, 23)]
    expected = [tokens_in_process(reference, batch) for batch in batches]
    owner = LLMEngine.launch(config, listen=address)
    attached = [LLMEngine.attach(config, address) for _ in range(2)]
    try:
        engines = [owner, *attached]
        assert {e.core.pid for e in engines} == {owner.core.process.pid}  # one core process
        seen: list[list[str]] = [[] for _ in engines]
        streams = []
        for index, (engine, batch) in enumerate(zip(engines, batches, strict=True)):
            for i, prompt in enumerate(batch):
                stream = engine.add_request(prompt, GREEDY, request_id=f"e{index}-{i}")
                streams.append((index, stream))
        got: list[list[list[int]]] = [[] for _ in engines]
        for index, stream in streams:
            events = list(stream)
            seen[index].extend(e.request_id for e in events)
            assert events[-1].finish_reason == FinishReason.LENGTH
            got[index].append(generated(events))
        assert got == expected
        for index, ids in enumerate(seen):  # nobody saw another frontend's request
            assert ids and all(rid.startswith(f"e{index}-") for rid in ids), (index, set(ids))
        # Every frontend hears of every iteration: each one's stats come to the whole core's.
        for engine in engines:
            assert wait_until(lambda e=engine: e.stats().num_generated_tokens == 3 * 4 * 6), engine.stats()
    finally:
        for engine in (*attached, owner):
            engine.shutdown()


def tokens_in_process(engine: LLMEngine, batch: list[list[int]]) -> list[list[int]]:
    streams = [engine.add_request(p, GREEDY) for p in batch]
    while engine.has_work():
        engine.step()
    return [generated(list(stream)) for stream in streams]


def test_a_detaching_engines_requests_are_aborted_and_their_kv_freed(tiny_checkpoint, address):
    gate = StepGate()
    config = EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=8)
    owner = LLMEngine.launch(config, core_hook=gate, listen=address)
    leaving = LLMEngine.attach(config, address)
    try:
        stream = leaving.add_request([1, 2, 3], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True),
                                     request_id="leaving-0")  # fmt: skip
        gate.allow(2)
        events = iter(stream)
        next(events)  # it runs and holds K/V
        leaving.shutdown()  # the stub goes: its request must not keep computing
        assert gate.wait_for_abort(), "the core never took in the detached frontend's abort"
        gate.open()
        assert list(events)[-1].finished  # ended here (the engine was shut down), not left hanging
        stayed = owner.add_request([4, 5], GREEDY, request_id="owner-0")
        assert list(stayed)[-1].finish_reason == FinishReason.LENGTH  # the core serves on
        stats = owner.stats()
        assert stats.num_running == 0 and stats.kv_used_tokens == 0
        assert owner.healthy
    finally:
        leaving.shutdown()
        owner.shutdown()


def test_the_cores_death_ends_every_engines_requests(tiny_checkpoint, address):
    gate = StepGate()
    config = EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=8)
    owner = LLMEngine.launch(config, core_hook=gate, listen=address)
    attached = LLMEngine.attach(config, address)
    try:
        long = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
        streams = [owner.add_request([1, 2], long, request_id="o"), attached.add_request([3, 4], long, request_id="a")]
        owner.core.process.kill()
        for stream in streams:
            last = list(stream)[-1]
            assert last.finish_reason == FinishReason.ERROR and "engine core process" in last.error
        assert not owner.healthy and not attached.healthy
        assert not attached.stopped_by_owner
    finally:
        attached.shutdown()
        owner.shutdown()


def test_the_owners_shutdown_ends_attached_engines_as_an_orderly_stop(tiny_checkpoint, address):
    gate = StepGate()
    config = EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=8)
    owner = LLMEngine.launch(config, core_hook=gate, listen=address)
    attached = LLMEngine.attach(config, address)
    try:
        stream = attached.add_request([3, 4], SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True))
        gate.open()
        owner.shutdown()
        last = list(stream)[-1]
        assert last.finish_reason == FinishReason.ERROR and "started it" in last.error
        assert attached.stopped_by_owner and not attached.healthy
        assert not Path(address.path).exists()  # nobody attaches to a core that is gone
        with pytest.raises(ConnectionError):
            LLMEngine.attach(config, address)
    finally:
        attached.shutdown()
        owner.shutdown()


def test_a_peer_without_the_key_is_refused_and_the_core_serves_on(tiny_checkpoint, address):
    config = EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=8)
    owner = LLMEngine.launch(config, listen=address)
    try:
        with pytest.raises(ConnectionError):
            LLMEngine.attach(config, CoreAddress(address.path, b"wrong key"))
        attached = LLMEngine.attach(config, address)
        assert tokens(attached, [[1, 2, 3]], "a") == tokens(owner, [[1, 2, 3]], "o")
        attached.shutdown()
    finally:
        owner.shutdown()


# ------------------------------------------------------------------ the core's side, without processes
class FakeConnection:
    def __init__(self, fail: bool = False) -> None:
        self.frames: list[tuple] = []
        self.fail = fail

    def send_bytes(self, data: bytes) -> None:
        if self.fail:
            raise BrokenPipeError("gone")
        self.frames.append(loads(data))


STATS = EngineStats(0, 0, 0, 64, 0, 0, 0.0, 0)


def test_frames_are_split_by_frontend_and_every_frontend_hears_every_iteration():
    owner, first, second = FakeConnection(), FakeConnection(), FakeConnection()
    frontends = Frontends(owner)
    a, b = frontends.attach(first), frontends.attach(second)
    frontends.register(OWNER, ["o1"])  # the owner's are not listed: they are the default
    frontends.register(a, ["a1", "a2"])
    frontends.register(b, ["b1"])
    step = CoreOutputs(["o1", "a1", "a2"], [10, 11, 12],
                       [CoreOutput("b1", [13], finished=True, finish_reason=FinishReason.LENGTH)])  # fmt: skip
    frontends.send(step, STATS, None)
    outputs = [read_frame(conn.frames[-1])[0] for conn in (owner, first, second)]
    assert [(o.request_ids, o.token_ids, [x.request_id for x in o.others]) for o in outputs] == [
        (["o1"], [10], []), (["a1", "a2"], [11, 12], []), ([], [], ["b1"])]  # fmt: skip
    frontends.send(CoreOutputs(["o1"], [20]), STATS, None)  # a step with nothing for the attached ones
    assert [len(conn.frames) for conn in (owner, first, second)] == [2, 2, 2]
    assert read_frame(second.frames[-1])[0].request_ids == []


def test_a_detached_frontends_last_outputs_go_nowhere_and_its_ids_are_forgotten():
    owner, attached = FakeConnection(), FakeConnection()
    frontends = Frontends(owner)
    index = frontends.attach(attached)
    frontends.register(index, ["a1"])
    assert frontends.detach(index) == ["a1"]
    # The abort's final output arrives after the detach: not the owner's, and never sent anywhere.
    frontends.send(CoreOutputs([], [], [CoreOutput("a1", [], finished=True, finish_reason=FinishReason.CANCELLED)]),
                   STATS, None)  # fmt: skip
    assert read_frame(owner.frames[-1])[0].others == []
    assert frontends.detach(index) == []


def test_an_attached_frontend_that_cannot_be_sent_to_is_dropped_and_the_owner_still_served():
    owner, broken = FakeConnection(), FakeConnection(fail=True)
    frontends = Frontends(owner)
    frontends.attach(broken)
    frontends.send(CoreOutputs(["o1"], [1]), STATS, None)
    assert frontends.attached() == []
    assert read_frame(owner.frames[-1])[0].request_ids == ["o1"]
    with pytest.raises(BrokenPipeError):  # the owner's pipe failing stops the core (core_process.py)
        Frontends(FakeConnection(fail=True)).send(CoreOutputs(), STATS, None)
