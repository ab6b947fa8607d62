"""Every request gets exactly one final event on every path, proved by injecting the fault of each:
a request whose event cannot be made (its text, its sink) inside a step's outputs, an output thread
that dies, and a shutdown with streams still open. (The failed forward's paths are
tests/core/test_scheduler.py's: poison requests, sticky failures, a batch-mate aborted mid-flight; the
hang's is tests/executor/test_reliability.py's.)"""

from __future__ import annotations

import pytest
from engine_helpers import GREEDY

from orca_backend import EngineConfig, SamplingParams
from orca_backend.engine import core_client
from orca_backend.engine.llm_engine import LLMEngine
from orca_backend.engine.output_processor import OutputProcessor, RequestOutput
from orca_backend.messages import CoreOutput, CoreOutputs, FinishReason


class CharTokenizer:
    """One token per character; decoding token 0 fails, as a broken tokenizer would."""

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, ids: list[int]) -> str:
        if 0 in ids:
            raise RuntimeError("injected: this token cannot be decoded")
        return "".join(chr(i) for i in ids)


def finals(events: list[RequestOutput]) -> list[RequestOutput]:
    return [e for e in events if e.finished]


def test_a_request_whose_event_fails_ends_alone_and_the_rest_of_the_step_is_handed_out():
    processor = OutputProcessor(CharTokenizer())
    events: dict[str, list[RequestOutput]] = {rid: [] for rid in ("broken", "column", "ending", "refusing")}

    def refusing_sink(event: RequestOutput) -> None:
        events["refusing"].append(event)
        if not event.finished:
            raise RuntimeError("injected: this sink refuses")

    sinks = [events["broken"].append, events["column"].append, events["ending"].append, refusing_sink]
    processor.add(list(events), [[65], [66], [67], [68]], [SamplingParams()] * 4, sinks)
    to_abort = processor.process(CoreOutputs(
        request_ids=["broken", "column", "refusing"], token_ids=[0, 70, 71],
        others=[CoreOutput("ending", [72, 73], finished=True, finish_reason=FinishReason.LENGTH)],
    ))  # fmt: skip
    # The one whose text failed and the one whose sink refused end with an error, once; the core
    # aborts both; the others' events, the final one included, arrive as if nothing had happened.
    for rid in ("broken", "refusing"):
        (final,) = finals(events[rid])
        assert final.finish_reason == FinishReason.ERROR and "output processing failed: injected" in final.error
    assert sorted(to_abort) == ["broken", "refusing"]
    assert [e.new_text for e in events["column"]] == ["F"] and not finals(events["column"])
    (ending,) = events["ending"]
    assert ending.finished and ending.finish_reason == FinishReason.LENGTH and ending.new_text == "HI"
    # Later outputs of the ended requests are dropped: still one final each.
    processor.process(CoreOutputs(["broken", "column"], [74, 75]))
    processor.process(CoreOutputs(others=[CoreOutput("refusing", [76], True, FinishReason.LENGTH)]))
    assert len(finals(events["broken"])) == len(finals(events["refusing"])) == 1
    assert [e.new_text for e in events["column"]] == ["F", "K"]


def test_an_output_thread_that_dies_ends_every_request_and_marks_the_engine_dead(tiny_checkpoint, monkeypatch):
    """No thread would deliver another output: every open request ends with an error naming the
    cause, the core process is killed, and later requests are refused."""
    calls = 0
    read_frame = core_client.read_frame

    def failing(message: tuple):
        nonlocal calls
        calls += 1
        if calls == 2:  # the first frame goes through; the second breaks the thread
            raise RuntimeError("injected: the output thread breaks")
        return read_frame(message)

    monkeypatch.setattr(core_client, "read_frame", failing)
    engine = LLMEngine.launch(EngineConfig(model=str(tiny_checkpoint[0])))
    try:
        streams = [engine.add_request([1, 2, 3], SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True))
                   for _ in range(3)]  # fmt: skip
        for stream in streams:
            events = list(stream)
            assert len(finals(events)) == 1 and events[-1].finish_reason == FinishReason.ERROR
            assert "the engine's output thread failed" in events[-1].error
        assert not engine.healthy
        engine.core.process.join(timeout=30)
        assert not engine.core.process.is_alive()
        with pytest.raises(Exception, match="not serving"):
            engine.add_request([1], SamplingParams(max_tokens=2))
    finally:
        engine.shutdown()


def test_shutdown_ends_every_open_stream_and_refuses_later_requests(tiny_checkpoint):
    from orca_backend.messages import EngineDeadError

    engine = LLMEngine(EngineConfig(model=str(tiny_checkpoint[0]), max_num_seqs=1))
    streams = [engine.add_request([1, 2], GREEDY) for _ in range(3)]
    engine.step()
    engine.shutdown()
    for s in streams:
        last = list(s)[-1]
        assert last.finish_reason == "error" and "shut down" in last.error
    with pytest.raises(EngineDeadError, match="shut down"):
        engine.add_request([1, 2], GREEDY)
