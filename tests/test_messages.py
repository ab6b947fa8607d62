"""The frontend<->core messages and their wire encoding (orca_backend/messages.py)."""

from __future__ import annotations

from orca_backend.messages import CoreOutput, CoreOutputs, EngineStats, loads, outputs_frame, read_frame


def test_the_core_process_frame_carries_columns_other_outputs_and_stats():
    stats = EngineStats(*range(14))
    outputs = CoreOutputs(["a", "b"], [5, 6], [CoreOutput("c", [1, 2], True, "stop"), CoreOutput("d", [], True, "error", "boom")])
    read, read_stats, dead = read_frame(loads(outputs_frame(outputs, stats, "gone")))
    assert (read, read_stats, dead) == (outputs, stats, "gone")
    assert read.num_finished == 2 and len(read) == 4
    assert [o.request_id for o in read] == ["a", "b", "c", "d"]  # the columns first, then the others
