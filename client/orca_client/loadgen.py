"""Open-loop trace replay over gRPC streams (tritonclient.grpc.aio), many streams from one process.

Every request is sent at its trace arrival time whether or not earlier ones finished (open loop:
a slow server builds a queue, it does not slow the arrivals), on a stream of its own, as
independent clients would. Per request it records the send time, each response's arrival and
token count, completion and errors, all in seconds after the run's start (time.perf_counter).

Why it is not the bottleneck: the request tensors are built before the clock starts; one event
loop only awaits sockets; streams are spread over several gRPC channels (separate HTTP/2
connections) so no connection's stream limit queues requests client-side. Its remaining cost per
token is measured against the echo model (`orca-bench --echo`), and each run reports how late
sends left against the schedule and the client's CPU time per response.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from orca_client import protocol
from orca_client.workload import TraceRequest

Progress = Callable[[int, int, int], None]  # (finished, total, errors)


@dataclass
class RequestRecord:
    index: int
    scheduled: float  # the trace's arrival time: when the request should have been sent
    prompt_len: int
    max_tokens: int
    send_time: float | None = None  # when the request left (its stream's first message was handed to gRPC)
    response_times: list[float] = field(default_factory=list)
    response_tokens: list[int] = field(default_factory=list)  # output ids per response
    done_time: float | None = None  # arrival of the final response
    finish_reason: str = ""
    reported_output_tokens: int = 0  # the sum of the responses' num_output_tokens
    error: str | None = None
    # The server's timeline of it (protocol.PERF_OUTPUTS: ns on the server's clock, -1 for a moment
    # that never came), from its last response.
    perf: dict[str, int] | None = None

    @property
    def output_tokens(self) -> int:
        return sum(self.response_tokens)

    @property
    def ok(self) -> bool:
        return self.error is None and self.done_time is not None


@dataclass
class RunResult:
    model: str
    rate: float  # the trace's mean arrival rate (inf: a burst)
    records: list[RequestRecord]
    duration_s: float  # run start (trace time 0) to the last completion or the deadline
    client_cpu_s: float  # this process's CPU time during the run, all threads (gRPC's included)
    truncated: bool = False  # the deadline passed and outstanding requests were cancelled
    unix_start: float = 0.0  # wall-clock time of trace time 0, to line runs up with server logs

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "rate": self.rate, "duration_s": self.duration_s, "client_cpu_s": self.client_cpu_s,
            "truncated": self.truncated, "unix_start": self.unix_start,
            "requests": [vars(r) for r in self.records],
        }  # fmt: skip


@dataclass
class LoadOptions:
    num_channels: int = 4  # gRPC channels (TCP connections) the streams are spread over
    deadline_s: float | None = None  # cancel whatever is outstanding after this long
    sampling: dict[str, Any] = field(default_factory=lambda: {"temperature": 0, "ignore_eos": True})
    stream: bool = True  # ask for per-token responses (the baseline answers once regardless)
    progress: Progress | None = None
    progress_interval_s: float = 0.5


def request_inputs(req: TraceRequest, batched: bool, options: LoadOptions, timeline: bool = False) -> list[Any]:
    """InferInputs of one trace request: its prompt (text or ids) and sampling_parameters JSON carrying
    max_tokens (with options.sampling's temperature 0 and ignore_eos, so output length is the trace's;
    in early-stop mode the looser sent_max_tokens and the stop token that ends it at that length);
    with `timeline`, return_perf_metrics too (the server's timeline of it, in its last response)."""
    sampling = {**options.sampling, "max_tokens": req.sent_max_tokens or req.max_tokens}
    if req.stop_token_ids:
        sampling["stop_token_ids"] = list(req.stop_token_ids)
    if req.lora_name is not None:
        sampling["lora_name"] = req.lora_name
    ids = req.prompt_ids if req.prompt_text is None else None  # a text prompt is sent as text alone
    # The prompt is never echoed (the baseline's single answer would echo it by default) and only
    # the outputs READ_OUTPUTS names are switched on.
    return protocol.build_inputs(text=req.prompt_text, input_ids=ids, sampling=sampling, stream=options.stream,
                                 exclude_input_in_output=True, batched=batched,
                                 return_outputs=(protocol.FINISH_REASON, protocol.NUM_OUTPUT_TOKENS,
                                                 *((protocol.PERF_METRICS,) if timeline else ())))  # fmt: skip


def _client(url: str, channel: int) -> Any:
    import tritonclient.grpc.aio as aioclient
    from tritonclient.grpc import MAX_GRPC_MESSAGE_SIZE

    # A channel argument of its own makes gRPC open a separate connection instead of sharing one
    # subchannel between clients with the same target.
    args = [
        ("grpc.max_send_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.max_receive_message_length", MAX_GRPC_MESSAGE_SIZE),
        ("grpc.use_local_subchannel_pool", 1),
        ("orca_bench.channel", channel),
    ]
    return aioclient.InferenceServerClient(url, channel_args=args)


def _read_response(result: Any, record: RequestRecord, now: float) -> bool:
    """Records one response; returns whether it was the final one (it carries finish_reason)."""
    counts = protocol.read_response_counts(result.get_response())
    record.response_times.append(now)
    record.response_tokens.append(counts.output_ids)
    if counts.num_output_tokens is not None:
        record.reported_output_tokens += counts.num_output_tokens
    if counts.perf is not None:
        record.perf = counts.perf
    if counts.finish_reason:
        record.finish_reason = counts.finish_reason
        record.done_time = now
        return True
    return False


# What _read_response reads, and nothing else: the server builds and sends only the outputs a request
# names, and text would cost both sides per token without being looked at.
READ_OUTPUTS = (protocol.OUTPUT_IDS, protocol.FINISH_REASON, protocol.NUM_OUTPUT_TOKENS)


def requested_outputs(timeline: bool = False) -> list[Any]:
    import tritonclient.grpc as grpcclient

    return [grpcclient.InferRequestedOutput(name) for name in READ_OUTPUTS + (protocol.PERF_OUTPUTS if timeline else ())]


async def _one_request(client: Any, model: str, inputs: list[Any], record: RequestRecord, t0: float,
                       outputs: list[Any] | None = None) -> None:
    """One request on a stream of its own, from send to its final response (or an error)."""
    finished = asyncio.Event()

    async def request_iterator():
        record.send_time = time.perf_counter() - t0
        yield {"model_name": model, "inputs": inputs, "outputs": outputs, "request_id": str(record.index)}
        # Keep our side open until the answer is complete: the stream then ends on our terms.
        await finished.wait()

    responses = client.stream_infer(request_iterator())
    try:
        async for result, error in responses:
            now = time.perf_counter() - t0
            if error is not None:
                record.error = str(error)
                record.done_time = None
                break
            if _read_response(result, record, now):
                break
        else:
            if not record.ok:
                record.error = record.error or "the stream ended before a final response"
    except asyncio.CancelledError:
        record.error = record.error or "cancelled by the load generator (run deadline)"
        responses.cancel()
        raise
    except Exception as exc:  # a transport error ends this request, not the run
        record.error = f"{type(exc).__name__}: {exc}"
    finally:
        finished.set()
        if record.error is not None:
            responses.cancel()


async def replay(url: str, model: str, trace: list[TraceRequest], options: LoadOptions | None = None,
                 batched: bool | None = None, rate: float | None = None) -> RunResult:
    """Replays `trace` open-loop against `model`; returns every request's record."""
    from orca_client.workload import mean_rate

    options = options or LoadOptions()
    records = [RequestRecord(i, r.arrival, r.prompt_len, r.max_tokens) for i, r in enumerate(trace)]
    clients = [_client(url, c) for c in range(max(1, options.num_channels))]
    tasks: list[asyncio.Task] = []
    try:
        config = await protocol.get_model_config_async(clients[0], model)
        batched = protocol.is_batched(config) if batched is None else batched
        timeline = protocol.takes_input(config, "return_perf_metrics")  # orca and baseline: yes; echo: no
        payloads = [request_inputs(r, batched, options, timeline) for r in trace]  # built before the clock starts
        outputs = requested_outputs(timeline)
        # Open the connections first, so the first requests do not pay for TCP/HTTP2 setup.
        await asyncio.gather(*(c.is_server_live() for c in clients))
        cpu0 = time.process_time()
        t0 = time.perf_counter()
        unix0 = time.time()
        ticker = asyncio.create_task(_ticker(records, options)) if options.progress else None
        deadline = t0 + options.deadline_s if options.deadline_s else None
        for i, req in enumerate(trace):
            delay = t0 + req.arrival - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            if deadline is not None and time.perf_counter() >= deadline:
                break
            tasks.append(asyncio.create_task(
                _one_request(clients[i % len(clients)], model, payloads[i], records[i], t0, outputs)))
        truncated = len(tasks) < len(trace)
        if tasks:
            timeout = None if deadline is None else max(0.0, deadline - time.perf_counter())
            _, pending = await asyncio.wait(tasks, timeout=timeout)
            if pending:
                truncated = True
                for task in pending:
                    task.cancel()
                await asyncio.gather(*pending, return_exceptions=True)
        for record in records[len(tasks):]:
            record.error = "not sent: the run deadline passed first"
        if ticker is not None:
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
            options.progress(len(records), len(records), sum(r.error is not None for r in records))
        end = max((r.done_time for r in records if r.done_time is not None), default=0.0)
        duration = (time.perf_counter() - t0) if truncated else end
        return RunResult(model, mean_rate(trace) if rate is None else rate, records, duration,
                         time.process_time() - cpu0, truncated, unix0)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*(c.close() for c in clients), return_exceptions=True)


async def _ticker(records: list[RequestRecord], options: LoadOptions) -> None:
    assert options.progress is not None
    while True:
        done = sum(r.done_time is not None or r.error is not None for r in records)
        options.progress(done, len(records), sum(r.error is not None for r in records))
        await asyncio.sleep(options.progress_interval_s)


def run_trace(url: str, model: str, trace: list[TraceRequest], options: LoadOptions | None = None,
              batched: bool | None = None, rate: float | None = None) -> RunResult:
    """Synchronous wrapper: one event loop per run, so nothing carries over between runs."""
    return asyncio.run(replay(url, model, trace, options, batched, rate))
