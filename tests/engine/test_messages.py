"""The engine's messages and their wire encoding: between the frontend and the core
(orca_backend/messages.py), and each step's SchedulerOutput, which the core sends the model runners,
msgpack-encoded to worker processes (orca_backend/scheduler_output.py)."""

from __future__ import annotations

from orca_backend import SamplingParams
from orca_backend.messages import CoreOutput, CoreOutputs, EngineStats, loads, outputs_frame, read_frame
from orca_backend.scheduler_output import NewRequest, SchedulerOutput, decode_step, encode_step


def test_the_core_process_frame_carries_columns_other_outputs_and_stats():
    stats = EngineStats(*range(14))
    outputs = CoreOutputs(["a", "b"], [5, 6], [CoreOutput("c", [1, 2], True, "stop"), CoreOutput("d", [], True, "error", "boom")])
    read, read_stats, dead = read_frame(loads(outputs_frame(outputs, stats, "gone")))
    assert (read, read_stats, dead) == (outputs, stats, "gone")
    assert read.num_finished == 2 and len(read) == 4
    assert [o.request_id for o in read] == ["a", "b", "c", "d"]  # the columns first, then the others


def test_a_scheduler_output_crosses_the_worker_pipe_whole():
    """What the worker pool is sent (encode_step): a new request's parameters (logit_bias keys stay ints),
    the recorded tokens, the grown tables and the ends."""
    params = SamplingParams(max_tokens=5, temperature=0.5, presence_penalty=0.5, repetition_penalty=1.2,
                            logit_bias={3: 1.5}, logprobs=2, stop_token_ids=[7])  # fmt: skip
    step = SchedulerOutput(3, ["a", "b"], [4, 1], [0, 6], [NewRequest("a", [1, 2, 3, 4], 4, [0], params, 9, [7])],
                           ["b"], [5], ["b"], [[2]], ["c"], ["d"])  # fmt: skip
    back = decode_step(encode_step(step))
    assert back == step and back.new_requests[0].params.logit_bias == {3: 1.5}
