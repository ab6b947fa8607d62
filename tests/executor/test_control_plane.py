"""The worker pools' control plane (orca_backend/executor/ray_executor.py, scheduler_output.py): how
a Ray pool's ranks connect to the engine core, and what a step is on the wire.

- `ControlServer` against real sockets on 127.0.0.1: a port scan, a wrong key, garbage, a silent
  peer, a bad hello, a rank out of range or twice are each dropped and logged with the peer's
  address while the real ranks connect; the listener closes once they are in; both ends bound the
  handshake in time and set TCP keepalive.
- A Ray pool's start with those peers hitting its listener: it starts and generates exact tokens.
- The step encoding: every field of a SchedulerOutput round-trips exactly; a malformed message is an
  error naming the field; a pickle sent to a worker is refused, never run.

Every socket is on loopback.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import pickle
import socket
import struct
import threading
import typing
from collections.abc import Callable
from multiprocessing import AuthenticationError
from multiprocessing.connection import Client, Connection, wait
from typing import Any

import msgpack
import pytest
from core_hooks import pid_alive
from serving_utils import wait_until

from orca_backend import LLM, SamplingParams
from orca_backend.executor.base import WorkerFailure
from orca_backend.executor.control_plane import ControlServer, connect_control
from orca_backend.lora import LoRARequest
from orca_backend.net import KEEPALIVE_IDLE_S
from orca_backend.sampling_params import StructuredOutputSpec
from orca_backend.scheduler_output import NewRequest, SchedulerOutput, decode_step, encode_step
from orca_backend.wire import WireFormatError

KEY = b"k" * 32
BOUND_S = 60.0  # failure bounds only: every wait below ends as soon as what it waits for happens


def in_thread(work: Callable[[], Any]) -> Callable[[], Any]:
    """Starts `work` on a thread; the returned function waits for it (at most BOUND_S) and returns
    its result or raises its exception."""
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["result"] = work()
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting test
            outcome["error"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()

    def result() -> Any:
        thread.join(BOUND_S)
        assert not thread.is_alive(), f"still running after {BOUND_S:g} s"
        if "error" in outcome:
            raise outcome["error"]
        return outcome["result"]

    return result


def read_until_closed(sock: socket.socket) -> bytes:
    """Everything the server sends `sock` until it closes the connection (at most BOUND_S)."""
    sock.settimeout(BOUND_S)
    data = b""
    while chunk := sock.recv(4096):
        data += chunk
    return data


def authenticated(address: tuple[str, int]) -> Connection:
    """A client with the right key (multiprocessing's own handshake) that has not said hello yet."""
    return Client(address, authkey=KEY)


def log_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "orca.workers"]


def dropped(caplog: pytest.LogCaptureFixture, port: int) -> str:
    """What the log says about the connection from local port `port`, once it says it."""
    assert wait_until(lambda: any(f" port {port}:" in line for line in log_lines(caplog)), timeout_s=BOUND_S)
    (line,) = [line for line in log_lines(caplog) if f" port {port}:" in line]
    return line


def test_bad_peers_are_dropped_and_logged_while_every_rank_connects(caplog):
    """Each bad peer is dropped (and logged) before the next comes; a silent one holds no one up."""
    caplog.set_level(logging.WARNING, logger="orca.workers")
    server = ControlServer("127.0.0.1", KEY, world_size=2, handshake_timeout_s=BOUND_S)
    address = server.address
    accepted = in_thread(lambda: server.accept_ranks(timeout_s=BOUND_S))

    silent = socket.create_connection(address)  # connects and says nothing, for as long as it is let
    scan = socket.create_connection(address)  # a port scan: connects and closes
    scan_port = scan.getsockname()[1]
    scan.close()
    assert "it closed the connection during the handshake" in dropped(caplog, scan_port)
    with pytest.raises(AuthenticationError):
        connect_control(address, b"wrong key", 0)
    assert wait_until(lambda: any("it failed authentication" in line for line in log_lines(caplog)), timeout_s=BOUND_S)
    garbage = socket.create_connection(address)
    garbage.sendall(struct.pack("!i", 2**30) + b"x" * 64)  # a frame that claims a gigabyte
    assert "bad message length" in dropped(caplog, garbage.getsockname()[1])
    not_json = authenticated(address)
    not_json.send_bytes(b"\xff not a hello")
    assert "bad hello" in dropped(caplog, _local_port(not_json))
    out_of_range = authenticated(address)
    out_of_range.send_bytes(json.dumps({"kind": "hello", "rank": 2}).encode())
    assert "rank 2 is not one of this pool's ranks 0..1" in dropped(caplog, _local_port(out_of_range))

    ranks = [connect_control(address, KEY, 1), connect_control(address, KEY, 0)]
    conns = accepted()
    for rank, (client, conn) in enumerate(zip(reversed(ranks), conns, strict=True)):  # rank order
        client.send_bytes(b"from rank %d" % rank)
        assert conn.recv_bytes() == b"from rank %d" % rank
    with pytest.raises(ConnectionRefusedError):  # the listener is closed once every rank is in
        socket.create_connection(address, timeout=BOUND_S)
    assert b"#CHALLENGE#" in read_until_closed(silent)  # challenged, then cut short
    assert "accepting ended before it authenticated" in dropped(caplog, silent.getsockname()[1])
    for conn in (not_json, out_of_range):
        with pytest.raises(EOFError):
            conn.recv_bytes()
    assert all(line.startswith("dropped a control connection from 127.0.0.1 port ") for line in log_lines(caplog))
    assert len(log_lines(caplog)) == 6


def test_a_second_connection_of_a_rank_is_dropped():
    """Whichever of a rank's two connections authenticated first is that rank's; the other is closed."""
    server = ControlServer("127.0.0.1", KEY, world_size=2)
    accepted = in_thread(lambda: server.accept_ranks(timeout_s=BOUND_S))
    twins = [connect_control(server.address, KEY, 0), connect_control(server.address, KEY, 0)]
    other = connect_control(server.address, KEY, 1)
    conns = accepted()
    conns[0].send_bytes(b"to rank 0")
    received = [in_thread(lambda twin=twin: _message_or_eof(twin))() for twin in twins]
    assert sorted(received, key=str) == [None, b"to rank 0"]
    other.send_bytes(b"from rank 1")
    assert conns[1].recv_bytes() == b"from rank 1"


def _message_or_eof(conn: Connection) -> bytes | None:
    try:
        return conn.recv_bytes()
    except EOFError:
        return None


def test_a_silent_peer_is_dropped_after_the_handshake_timeout(caplog):
    """Without any rank connecting: the silent peer's handshake ends at its deadline by itself."""
    caplog.set_level(logging.WARNING, logger="orca.workers")
    server = ControlServer("127.0.0.1", KEY, world_size=1, handshake_timeout_s=1.0)
    stop = threading.Event()
    accepted = in_thread(lambda: server.accept_ranks(BOUND_S, ended=lambda: "stopped by the test" if stop.is_set() else None))
    silent = socket.create_connection(server.address)
    read_until_closed(silent)
    assert "no handshake within 1 s" in dropped(caplog, silent.getsockname()[1])
    stop.set()
    with pytest.raises(WorkerFailure, match="a Ray worker ended before connecting: stopped by the test"):
        accepted()


def test_a_silent_engine_fails_the_ranks_connect_within_its_deadline():
    with socket.create_server(("127.0.0.1", 0)) as silent_engine:
        address = silent_engine.getsockname()[:2]
        connecting = in_thread(lambda: connect_control(address, KEY, 0, timeout_s=1.0))
        with pytest.raises(TimeoutError, match="no handshake within 1 s"):
            connecting()


def test_both_ends_of_a_control_connection_set_keepalive():
    server = ControlServer("127.0.0.1", KEY, world_size=1)
    accepted = in_thread(lambda: server.accept_ranks(timeout_s=BOUND_S))
    client = connect_control(server.address, KEY, 0)
    (conn,) = accepted()
    for end in (client, conn):
        with socket.socket(fileno=os.dup(end.fileno())) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S


def _local_port(conn: Connection) -> int:
    with socket.socket(fileno=os.dup(conn.fileno())) as sock:
        return sock.getsockname()[1]


# ------------------------------------------------------------------------------- the step's encoding


def every_field_set() -> SchedulerOutput:
    """A step with every field of every dataclass it holds away from its default (the two requests'
    parameters between them: min_tokens and structured output exclude each other)."""
    samples = {str: "adapter", int: 7, float: 0.75, bool: True}
    lora = LoRARequest(**{name: samples[_plain(hint)] for name, hint in typing.get_type_hints(LoRARequest).items()})
    constrained = SamplingParams(max_tokens=40, temperature=0.7, top_p=0.9, top_k=50, seed=2**64 - 1, stop=["\n", "END"],
                                 stop_token_ids=[2, 3], ignore_eos=True, presence_penalty=-1.5, frequency_penalty=0.25,
                                 repetition_penalty=1.3, logit_bias={5: -100, 9: 2.5}, logprobs=20, prompt_logprobs=5,
                                 n=3, structured_outputs=StructuredOutputSpec("choice", ("yes", "no")), lora_name="adapter")  # fmt: skip
    bounded = SamplingParams(max_tokens=8, min_tokens=3, temperature=0, top_p=0.0, top_k=-1, seed=0, stop="x",
                             structured_outputs=None, logprobs=0)  # fmt: skip
    json_spec = SamplingParams(structured_outputs={"json": {"type": "object"}, "disable_any_whitespace": True})
    step = SchedulerOutput(
        step_id=12, scheduled_ids=["a", "b", "c"], num_scheduled_tokens=[4, 1, 1], num_computed=[0, 9, 0],
        new_requests=[NewRequest("a", [1, 2, 3, 4], 4, [0, 5], constrained, 99, [2, 3, 50256], lora_id=7, pooling="mean"),
                      NewRequest("b", [6], 1, [1], bounded, 0), NewRequest("c", [8], 1, [2], json_spec, 1)],
        recorded_ids=["b"], recorded_tokens=[8], grown_ids=["b"], grown_block_ids=[[6, 7]], preempted_ids=["c"],
        finished_ids=["d", "e"], bitmask_rows=[0, 1], bitmask=bytes(range(256)) * 3, ahead_rows=[1],
        lora_loads=[(1, lora)], block_copies=[(3, 8), (4, 9)], kv_to_host=[(5, 0), (6, 1)], kv_to_device=[(2, 10)],
        spec_rows=[1], spec_tokens=[[5, 6, -1]],
        shrunk_ids=["b"], shrunk_num_blocks=[1], spec_bitmask_rows=[0], spec_bitmask=bytes(range(96)),
    )  # fmt: skip
    for instances in ([step], [step.new_requests[0]], [constrained, bounded], [lora]):
        unset = [f.name for f in dataclasses.fields(instances[0])
                 if all(getattr(i, f.name) == _default(f) for i in instances)]  # fmt: skip
        assert unset == [], f"{type(instances[0]).__name__} fields left at their defaults: {unset}"
    return step


def _plain(hint: Any) -> Any:
    """`hint` without `| None`."""
    members = [m for m in typing.get_args(hint) if m is not type(None)]
    return members[0] if members else hint


def _default(f: dataclasses.Field) -> object:
    if f.default is not dataclasses.MISSING:
        return f.default
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else object()


def test_every_field_of_a_step_round_trips_exactly():
    step = every_field_set()
    back = decode_step(encode_step(step))
    assert back == step
    # Equal is not enough where types differ but compare equal (1 == 1.0, a tuple and a list are not):
    assert _typed(back) == _typed(step)
    assert type(back.new_requests[1].params.temperature) is int  # 0 stays 0


def _typed(value: object) -> object:
    """`value` with the type of every leaf beside it."""
    if dataclasses.is_dataclass(value):
        return type(value).__name__, [_typed(getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, list | tuple):
        return type(value).__name__, [_typed(v) for v in value]
    if isinstance(value, dict):
        return "dict", [(_typed(k), _typed(v)) for k, v in value.items()]
    return type(value).__name__, value


def at(cls: type, name: str) -> int:
    """Where field `name` of `cls` sits in its wire array."""
    return [f.name for f in dataclasses.fields(cls)].index(name)


STEP, REQUEST, PARAMS = SchedulerOutput, NewRequest, SamplingParams
N_STEP_FIELDS = len(dataclasses.fields(SchedulerOutput))


def first_params(wire: list) -> list:
    return wire[at(STEP, "new_requests")][0][at(REQUEST, "params")]


@pytest.mark.parametrize(("change", "error"), [
    (lambda w: first_params(w).__setitem__(at(PARAMS, "top_k"), "high"),
     r"^SchedulerOutput\.new_requests\[0\]\.params\.top_k: expected int, got str$"),
    (lambda w: w[at(STEP, "new_requests")][0][at(REQUEST, "token_ids")].__setitem__(2, True),
     r"^SchedulerOutput\.new_requests\[0\]\.token_ids\[2\]: expected int, got bool$"),
    (lambda w: first_params(w)[at(PARAMS, "logit_bias")].__setitem__("5", 1.0),
     r"^SchedulerOutput\.new_requests\[0\]\.params\.logit_bias\['5'\]: expected int, got str$"),
    (lambda w: first_params(w)[at(PARAMS, "structured_outputs")].__setitem__(0, "yaml"),
     r"^SchedulerOutput\.new_requests\[0\]\.params\.structured_outputs\.kind: expected one of 'json'"),
    (lambda w: first_params(w).__setitem__(at(PARAMS, "temperature"), -1.0),
     r"^SchedulerOutput\.new_requests\[0\]\.params: not a valid SamplingParams: temperature must be"),
    (lambda w: w[at(STEP, "lora_loads")][0].pop(),
     r"^SchedulerOutput\.lora_loads\[0\]: expected a tuple of 2, got 1 items$"),
    (lambda w: w.__setitem__(at(STEP, "bitmask"), "text"),
     r"^SchedulerOutput\.bitmask: expected bytes, got str$"),
    (lambda w: w.pop(), rf"^SchedulerOutput: expected SchedulerOutput's {N_STEP_FIELDS} fields, got {N_STEP_FIELDS - 1} fields$"),
])  # fmt: skip
def test_a_malformed_step_is_an_error_naming_the_field(change, error):
    wire = msgpack.unpackb(encode_step(every_field_set()), strict_map_key=False)
    change(wire)
    with pytest.raises(WireFormatError, match=error):
        decode_step(msgpack.packb(wire, use_bin_type=True))


def test_what_is_not_msgpack_is_refused():
    with pytest.raises(WireFormatError, match="not a msgpack message"):
        decode_step(encode_step(every_field_set())[:-3])
    with pytest.raises(WireFormatError, match=f"expected SchedulerOutput's {N_STEP_FIELDS} fields, got dict"):
        decode_step(msgpack.packb({"step_id": 1}))


class _RunsCode:
    """A pickle that runs code when loaded (touches `path`)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple:
        return exec, (f"open({self.path!r}, 'w').close()",)


def test_a_pickle_sent_to_a_worker_is_refused_not_run(tmp_path):
    """What an injector on the control channel would send: each rank reports it malformed and
    nothing in it runs (the pipes used to carry pickles, and the rank ran it)."""
    marker = tmp_path / "ran"
    with LLM("gpt2-tiny", tensor_parallel_size=2) as llm:
        executor = llm.engine.core.executor
        for conn in executor.conns:
            conn.send_bytes(pickle.dumps(_RunsCode(str(marker))))
        reports = []
        for conn in executor.conns:
            assert wait([conn], timeout=BOUND_S)
            reports.append(json.loads(conn.recv_bytes()))
        assert wait_until(lambda: not any(map(pid_alive, executor.pids)), timeout_s=BOUND_S)
    assert not marker.exists()
    assert [(r["kind"], r["rank"]) for r in reports] == [("error", 0), ("error", 1)]
    assert all("WireFormatError: not a msgpack message" in r["message"] for r in reports)


# ------------------------------------------------------------------------------- a Ray pool's start


class StrayPeers(logging.Handler):
    """When the executor logs its control address, hits it from threads of its own, while the real
    ranks connect: a port scan, a client with the wrong key and a silent peer (held open)."""

    def __init__(self) -> None:
        super().__init__()
        self.address: tuple[str, int] | None = None
        self.silent: socket.socket | None = None
        self.wrong_key: Callable[[], Any] | None = None

    def emit(self, record: logging.LogRecord) -> None:
        if not record.getMessage().startswith("Ray workers: control connections to "):
            return
        self.address = (record.args[0], record.args[1])
        socket.create_connection(self.address).close()
        self.silent = socket.create_connection(self.address)
        self.wrong_key = in_thread(lambda: connect_control(self.address, b"wrong key", 0))


@pytest.mark.ray
@pytest.mark.timeout(300)  # the failure bound where the pool never starts (it used to wait 600 s)
def test_a_ray_pool_starts_while_stray_bad_and_silent_peers_hit_its_listener(caplog):
    pytest.importorskip("ray")
    from ray_cluster import loopback_cluster, orca_leftovers

    caplog.set_level(logging.INFO, logger="orca.workers")
    prompts = [[5, 6, 7, 8], [9, 10]]
    greedy = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected = [o.output_ids for o in LLM("gpt2-tiny").generate(prompts, greedy)]
    peers = StrayPeers()
    logging.getLogger("orca.workers").addHandler(peers)
    with loopback_cluster(1, num_cpus=2):
        try:
            llm = LLM("gpt2-tiny", tensor_parallel_size=2, distributed_executor_backend="ray")
        finally:
            logging.getLogger("orca.workers").removeHandler(peers)
        with llm:
            assert [o.output_ids for o in llm.generate(prompts, greedy)] == expected
            with pytest.raises(ConnectionRefusedError):  # the listener closed once the ranks were in
                socket.create_connection(peers.address, timeout=BOUND_S)
        assert wait_until(lambda: orca_leftovers() == ([], []), timeout_s=BOUND_S)
    with pytest.raises(AuthenticationError):
        peers.wrong_key()
    read_until_closed(peers.silent)
    drops = [line for line in log_lines(caplog) if line.startswith("dropped a control connection")]
    assert any("it closed the connection during the handshake" in line for line in drops)
    assert any("it failed authentication" in line for line in drops)
    silent = [line for line in drops if f" port {peers.silent.getsockname()[1]}:" in line]
    assert len(silent) == 1 and ("accepting ended" in silent[0] or "no handshake within" in silent[0])
