"""The worker pool on a Ray cluster (`distributed_executor_backend="ray"`): the model's tp x pp ranks
as Ray actors, placed by a placement group over the cluster's nodes, running the same worker code
as the local pool's processes (worker/worker_proc.py).

Placement: one bundle per rank (a GPU and a CPU on CUDA, a CPU otherwise), PACK by default: Ray fills
a node before the next, and ranks are numbered stage by stage, so a tensor-parallel group stays
inside a node where it fits and pipeline stages go to other nodes, as ORCA places them (intra-layer
parallelism within a node, inter-layer across nodes); `ray_placement_strategy` may say SPREAD,
STRICT_PACK or STRICT_SPREAD instead.

Control plane: each actor opens a TCP connection back to the engine core (`ControlServer`: a
listener on the core's node address as Ray knows it, its port ephemeral), authenticated both ways
with a random key (multiprocessing's HMAC challenge) and saying its rank, each within
HANDSHAKE_TIMEOUT_S; a peer that fails any of it (a port scan, a wrong key, garbage, silence, a rank
out of range or already in) is dropped and logged with its address, and accepting goes on until every
rank is in. Then the listener closes. On the connections flow the same messages as the local pipes:
a `SchedulerOutput` per step out (msgpack, never pickle: the connection is plaintext TCP, and a
message injected on it must not run code in a rank), tokens back; TCP keepalive turns a peer that
vanished without a reset into an error, and a step whose tokens do not come back within
`iteration_timeout_s` fails the pool (WorkerFailure), so a partitioned or hung node never hangs the
engine. Data plane: torch.distributed (NCCL on GPUs, gloo on CPU) rendezvousing at rank 0's node
address, where rank 0's actor bound the store's socket (torch's own would listen on every
interface). Both addresses are logged. GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, when set for the
engine, are passed to every actor (they pick the interface the ranks talk on); on a node whose
address is loopback they default to `lo`.

A cluster may live on loopback (every node started with node_ip_address 127.0.0.1): `connect_ray`
joins it there (Ray itself would swap a loopback address for this host's interface address).

Failures as the local pool's: an actor that dies (its process, or its node) closes its connection,
and the pool raises WorkerFailure naming the rank and its node; shutdown kills every actor and
removes the placement group, so nothing of this engine is left on the cluster (the actors are named
orca-<engine>-rank<r> in the namespace "orca", which Ray's listings show).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import secrets
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict
from multiprocessing import AuthenticationError
from multiprocessing.connection import Connection, answer_challenge, deliver_challenge

from orca_backend.config import AnyModelConfig, EngineConfig, model_config_to_json
from orca_backend.executor.base import WorkerFailure
from orca_backend.executor.multiproc import LOOPBACK_SOCKET_ENV, WorkerPoolExecutor, worker_socket_env
from orca_backend.net import is_loopback, listen, set_keepalive
from orca_backend.worker.worker_proc import worker_main

logger = logging.getLogger("orca.workers")

RAY_NAMESPACE = "orca"
# A control connection's TCP connect, mutual authentication and hello, from either end: a peer that
# takes longer is dropped (a real rank needs milliseconds; the bound only ends silent peers).
HANDSHAKE_TIMEOUT_S = 10.0
MAX_PENDING_HANDSHAKES = 64  # connections authenticating at once; more are refused at once
MAX_HELLO_BYTES = 256
ACCEPT_POLL_S = 0.25  # how often accepting looks at finished handshakes and at ranks that died


def import_ray():  # noqa: ANN201 - the ray module
    try:
        import ray
    except ImportError:
        raise RuntimeError("distributed_executor_backend 'ray' needs Ray, which is not installed: "
                           "pip install -e .[ray] (the same version on every host)") from None  # fmt: skip
    return ray


def connect_ray(ray, address: str) -> None:  # noqa: ANN001 - the ray module
    """Joins the Ray cluster at `address` ("auto": the one Ray finds from this host) in ORCA's
    namespace, also where the cluster lives on loopback.

    Ray swaps a loopback GCS address for this host's interface address before connecting
    (services.resolve_ip_for_localhost, ray-project/ray#59110), and a cluster started with
    node_ip_address 127.0.0.1 does not listen there: ray.init would wait for it forever. Ray takes
    this host's own address to be loopback only where it does not run multi-host clusters (its
    ENABLE_RAY_CLUSTER constant, false on Windows and macOS), so that is what it is told while
    joining a loopback address."""
    from ray._private import ray_constants, services

    try:
        gcs = services.get_ray_address_from_environment(address, None) if address == "auto" else address
        with _host_address_is_loopback(ray_constants) if is_loopback(gcs.rsplit(":", 1)[0].strip("[]")) \
                else contextlib.nullcontext():  # fmt: skip
            ray.init(address=address, namespace=RAY_NAMESPACE, logging_level=logging.WARNING)
    except ConnectionError as e:
        raise RuntimeError(f"no Ray cluster at ray_address={address!r} ({e}); start one with `ray start --head` "
                           "(and `ray start --address HEAD:6379` on every other host)") from None  # fmt: skip


@contextlib.contextmanager
def _host_address_is_loopback(ray_constants) -> Iterator[None]:  # noqa: ANN001 - ray's constants module
    if not hasattr(ray_constants, "ENABLE_RAY_CLUSTER"):
        raise RuntimeError("this Ray version cannot be joined at a loopback address by ORCA (ray._private."
                           "ray_constants.ENABLE_RAY_CLUSTER is gone): give the cluster a routable node address")  # fmt: skip
    saved = ray_constants.ENABLE_RAY_CLUSTER
    ray_constants.ENABLE_RAY_CLUSTER = False
    try:
        yield
    finally:
        ray_constants.ENABLE_RAY_CLUSTER = saved


class _Deadline:
    """Shuts `sock` down unless the block it guards ends within `timeout_s`, and then fails the block
    with TimeoutError: multiprocessing's handshake reads without a timeout, and a silent (or
    trickling) peer would hold it forever."""

    def __init__(self, sock: socket.socket, timeout_s: float) -> None:
        self._sock, self._timeout_s = sock, timeout_s
        self._lock = threading.Lock()
        self._ended = self._expired = False
        self._timer = threading.Timer(timeout_s, self._expire)
        self._timer.daemon = True

    def __enter__(self) -> _Deadline:
        self._timer.start()
        return self

    def __exit__(self, exc_type: object, exc: BaseException | None, tb: object) -> None:
        self._timer.cancel()
        with self._lock:
            self._ended = True
            if self._expired:
                raise TimeoutError(f"no handshake within {self._timeout_s:g} s") from exc

    def _expire(self) -> None:
        with self._lock:
            if self._ended:
                return
            self._expired = True
            with contextlib.suppress(OSError):  # already closed by its peer
                self._sock.shutdown(socket.SHUT_RDWR)


def connect_control(address: tuple[str, int], authkey: bytes, rank: int,
                    timeout_s: float = HANDSHAKE_TIMEOUT_S) -> Connection:  # fmt: skip
    """A rank's control connection to the engine core's ControlServer: connected, authenticated both
    ways and its rank said, each within `timeout_s` (TimeoutError, AuthenticationError or OSError
    otherwise)."""
    sock = socket.create_connection(address, timeout=timeout_s)
    try:
        sock.settimeout(None)  # a Connection reads a blocking descriptor
        set_keepalive(sock)
        conn = Connection(os.dup(sock.fileno()))
        try:
            with _Deadline(sock, timeout_s):
                answer_challenge(conn, authkey)
                deliver_challenge(conn, authkey)
                conn.send_bytes(json.dumps({"kind": "hello", "rank": rank}).encode())
        except BaseException:
            conn.close()
            raise
    finally:
        sock.close()
    return conn


class ControlServer:
    """The engine core's end of the control plane: a TCP listener on `host` (port ephemeral) that
    `accept_ranks` takes every rank's connection from, then closes."""

    def __init__(self, host: str, authkey: bytes, world_size: int,
                 handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S) -> None:  # fmt: skip
        self._listener = listen(host)
        self._listener.settimeout(ACCEPT_POLL_S)
        self.address: tuple[str, int] = self._listener.getsockname()[:2]
        self._authkey, self._world_size, self._handshake_timeout_s = authkey, world_size, handshake_timeout_s
        self._lock = threading.Lock()  # guards the three below
        self._closed = False
        self._handshaking: set[socket.socket] = set()
        self._accepted: queue.SimpleQueue[tuple[tuple, int, Connection]] = queue.SimpleQueue()

    def accept_ranks(self, timeout_s: float, ended: Callable[[], str | None] = lambda: None) -> list[Connection]:
        """Every rank's connection, in rank order. Each connection authenticates and says its rank on a
        thread of its own, so a bad peer delays no other; one that fails is dropped and logged with its
        address (the first connection of a rank wins). WorkerFailure if `timeout_s` passes first, or if
        `ended()` (asked about once a second) describes a rank that ended before connecting. The
        listener is closed when this returns or raises."""
        ranks: dict[int, Connection] = {}
        deadline = time.monotonic() + timeout_s
        next_check = 0.0
        try:
            while len(ranks) < self._world_size:
                now = time.monotonic()
                if now >= next_check:
                    why = ended()
                    if why:
                        raise WorkerFailure(f"a Ray worker ended before connecting: {why}")
                    next_check = now + 1.0
                if now > deadline:
                    missing = sorted(set(range(self._world_size)) - set(ranks))
                    raise WorkerFailure(f"the Ray workers did not all connect within {timeout_s:.0f} s "
                                        f"(ranks {missing} did not)")  # fmt: skip
                self._accept_one()
                self._take_accepted(ranks)
        except BaseException:
            for conn in ranks.values():
                conn.close()
            raise
        finally:
            self.close()
        return [ranks[rank] for rank in range(self._world_size)]

    def close(self) -> None:
        """Stops listening and ends the handshakes under way. Idempotent."""
        with self._lock:
            self._closed = True
            handshaking = list(self._handshaking)
        self._listener.close()
        for sock in handshaking:
            with contextlib.suppress(OSError):  # its handshake just ended
                sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(queue.Empty):
            while True:
                self._accepted.get_nowait()[2].close()  # authenticated after the last rank: not needed

    def _accept_one(self) -> None:
        try:
            sock, peer = self._listener.accept()
        except TimeoutError:
            return
        with self._lock:
            busy = len(self._handshaking) >= MAX_PENDING_HANDSHAKES
            if not busy:
                self._handshaking.add(sock)
        if busy:
            sock.close()
            _drop(peer, f"{MAX_PENDING_HANDSHAKES} connections are authenticating already")
            return
        threading.Thread(target=self._handshake, args=(sock, peer), name="orca-ray-handshake", daemon=True).start()

    def _handshake(self, sock: socket.socket, peer: tuple) -> None:
        """On its own thread: authenticates `sock`'s peer and reads its hello; queues (peer, rank,
        connection), or drops it."""
        try:
            sock.setblocking(True)
            set_keepalive(sock)
            conn = Connection(os.dup(sock.fileno()))
            try:
                with _Deadline(sock, self._handshake_timeout_s):
                    deliver_challenge(conn, self._authkey)
                    answer_challenge(conn, self._authkey)
                    rank = _read_hello(conn.recv_bytes(MAX_HELLO_BYTES), self._world_size)
            except BaseException:
                conn.close()
                raise
        except (EOFError, OSError, AuthenticationError, AssertionError, ValueError) as exc:
            with self._lock:
                closed = self._closed  # then close() cut it short
            _drop(peer, "accepting ended before it authenticated" if closed else _handshake_failure(exc))
            return
        finally:
            with self._lock:
                self._handshaking.discard(sock)
            sock.close()
        with self._lock:
            if not self._closed:
                self._accepted.put((peer, rank, conn))
                return
        conn.close()

    def _take_accepted(self, ranks: dict[int, Connection]) -> None:
        with contextlib.suppress(queue.Empty):
            while True:
                peer, rank, conn = self._accepted.get_nowait()
                if rank in ranks:
                    conn.close()
                    _drop(peer, f"rank {rank} is connected already")
                else:
                    ranks[rank] = conn


def _read_hello(data: bytes, world_size: int) -> int:
    """The rank a hello message says, or ValueError."""
    hello = json.loads(data)  # a ValueError if it is not JSON (or not UTF-8)
    if not isinstance(hello, dict) or hello.get("kind") != "hello":
        raise ValueError(f"expected {{\"kind\": \"hello\", \"rank\": <rank>}}, got {data[:80]!r}")
    rank = hello.get("rank")
    if type(rank) is not int or not 0 <= rank < world_size:
        raise ValueError(f"rank {rank!r} is not one of this pool's ranks 0..{world_size - 1}")
    return rank


def _handshake_failure(exc: BaseException) -> str:
    if isinstance(exc, TimeoutError):
        return str(exc)
    if isinstance(exc, EOFError):
        return "it closed the connection during the handshake"
    if isinstance(exc, AuthenticationError | AssertionError):  # AssertionError: not a challenge at all
        return f"it failed authentication ({exc or 'not a challenge'})"
    if isinstance(exc, ValueError):
        return f"bad hello: {exc}"
    return f"{exc or type(exc).__name__} (a malformed frame, or a reset)"


def _drop(peer: tuple, why: str) -> None:
    logger.warning("dropped a control connection from %s port %s: %s", peer[0], peer[1], why)


class RankActor:
    """One rank on some node of the cluster (made a Ray actor class by `_actor_class`)."""

    def __init__(self) -> None:
        self._rendezvous: socket.socket | None = None

    def node(self) -> tuple[str, str]:
        """(node IP, node id) of the node it runs on."""
        import ray

        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def open_rendezvous(self) -> int:
        """Rank 0's: a listening socket on its node's address as Ray is configured with it (not every
        interface), which the data plane's store then serves on; returns its port."""
        ip, _ = self.node()
        self._rendezvous = listen(ip)
        return self._rendezvous.getsockname()[1]

    def run(self, rank: int, config_json: str, model_json: str, init_method: str, control: tuple[str, int],
            authkey: bytes, socket_env: dict[str, str]) -> None:  # fmt: skip
        """Connects to the engine core, says which rank it is, and serves steps until told to stop
        (worker_main)."""
        conn = connect_control(tuple(control), authkey, rank)
        ip, _ = self.node()
        if is_loopback(ip):  # the whole cluster is on this host's loopback: so is the data plane
            socket_env = worker_socket_env(socket_env) | socket_env
        listen_fd = self._rendezvous.detach() if self._rendezvous is not None else None
        worker_main(rank, config_json, model_json, init_method, conn, socket_env, store_listen_fd=listen_fd)


def _actor_class(ray, config: EngineConfig):  # noqa: ANN001, ANN202
    resources = {"num_gpus": 1, "num_cpus": 1} if config.device.startswith("cuda") else {"num_cpus": 1}
    # Two calls at once: `run` holds one for the engine's life.
    return ray.remote(max_concurrency=2, **resources)(RankActor)


class RayExecutor(WorkerPoolExecutor):
    def __init__(self, config: EngineConfig, model_config: AnyModelConfig, start_timeout_s: float = 600.0) -> None:
        ray = self._ray = import_ray()
        self._init_pool(config)
        # A step's tokens not back within iteration_timeout_s (the served watchdog's bound, 60 s by default:
        # CPU steps under load take seconds, never a minute) mean a rank or its node is hung or cut off,
        # which a partition does without a TCP reset: the pool fails instead of waiting forever.
        self._step_timeout_s = float(config.iteration_timeout_s) or None
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            connect_ray(ray, config.ray_address)
        self.engine_id = uuid.uuid4().hex[:8]
        self._actors: list = []
        self._runs: list = []
        self._placement_group = None
        self._control: ControlServer | None = None
        self.nodes: list[tuple[str, str]] = []  # each rank's (node IP, node id)
        try:
            self._start(config, model_config, start_timeout_s)
        except BaseException:
            self.shutdown()
            raise
        self._await_ready(start_timeout_s)
        logger.info("started %d Ray actors (tp=%d, pp=%d) on nodes %s", self.world_size, config.tensor_parallel_size,
                    config.pipeline_parallel_size, [ip for ip, _ in self.nodes])  # fmt: skip

    def _start(self, config: EngineConfig, model_config: AnyModelConfig, timeout_s: float) -> None:
        ray = self._ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = {"GPU": 1, "CPU": 1} if config.device.startswith("cuda") else {"CPU": 1}
        self._placement_group = placement_group([bundle] * self.world_size, strategy=config.ray_placement_strategy,
                                                name=f"orca-{self.engine_id}")  # fmt: skip
        if not ray.get(self._placement_group.ready(), timeout=timeout_s):
            raise RuntimeError(f"the Ray cluster could not place {self.world_size} bundles of {bundle} "
                               f"({config.ray_placement_strategy}) within {timeout_s:.0f} s")  # fmt: skip
        actor_class = _actor_class(ray, config)
        env = {key: os.environ[key] for key in LOOPBACK_SOCKET_ENV if os.environ.get(key)}
        self._actors = [
            actor_class.options(
                name=f"orca-{self.engine_id}-rank{rank}", namespace=RAY_NAMESPACE,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._placement_group,
                                                                     placement_group_bundle_index=rank),
                runtime_env={"env_vars": env} if env else None,
            ).remote()
            for rank in range(self.world_size)
        ]  # fmt: skip
        self.nodes = ray.get([a.node.remote() for a in self._actors], timeout=timeout_s)
        master_ip = self.nodes[0][0]
        init_method = f"tcp://{master_ip}:{ray.get(self._actors[0].open_rendezvous.remote(), timeout=timeout_s)}"
        here = ray.util.get_node_ip_address()  # this node's address as Ray is configured with it
        authkey = secrets.token_bytes(32)
        self._control = ControlServer(here, authkey, self.world_size)
        logger.info("Ray workers: control connections to %s:%d, data plane (%s) rendezvous at %s",
                    here, self._control.address[1], "nccl" if config.device.startswith("cuda") else "gloo",
                    init_method)  # fmt: skip
        config_json, model_json = json.dumps(asdict(config)), model_config_to_json(model_config)
        self._runs = [a.run.remote(rank, config_json, model_json, init_method, self._control.address, authkey, env)
                      for rank, a in enumerate(self._actors)]  # fmt: skip
        # An actor that died before connecting fails the start at once, not after the timeout.
        self.conns = self._control.accept_ranks(timeout_s, ended=self._ended_before_connecting)

    def _ended_before_connecting(self) -> str | None:
        ended = [rank for rank in range(self.world_size) if self._run_ended(rank)]
        return "; ".join(map(self._death, ended)) or None

    @property
    def pids(self) -> list[int]:
        return []  # the actors' processes live on other nodes

    # How this pool's ranks live and die: Ray actors. Their connections are the only sentinels.
    def _sentinels(self) -> dict[object, int]:
        return {}

    def _dead_peer(self, rank: int, timeout_s: float) -> int | None:
        refs = {ref: r for r, ref in enumerate(self._runs) if r != rank}
        done, _ = self._ray.wait(list(refs), num_returns=1, timeout=timeout_s)
        return refs[done[0]] if done else None

    def _run_ended(self, rank: int) -> bool:
        done, _ = self._ray.wait([self._runs[rank]], timeout=0)
        return bool(done)

    def _death(self, rank: int) -> str:
        """How rank `rank`'s actor ended (asked of Ray, waiting a few seconds for it to know), and where."""
        ip, node_id = self.nodes[rank]
        where = f"worker {rank} (Ray actor on node {ip}, id {node_id[:12]})"
        done, _ = self._ray.wait([self._runs[rank]], timeout=5)
        if not done:
            return f"{where} closed its connection"
        try:
            self._ray.get(done[0])
        except Exception as e:  # noqa: BLE001 - how it ended is the message
            return f"{where} died: {str(e).strip().splitlines()[0][:400]}"
        return f"{where} returned"

    def _stop_ranks(self) -> None:
        """After STOP: the actors' runs end (briefly waited for), then every actor is killed and the
        placement group removed, whatever state they were in."""
        ray = self._ray
        if self._control is not None:
            self._control.close()
        if not ray.is_initialized():  # Ray's own exit hook ran first: the cluster ends a gone driver's actors
            return
        if self._runs:
            ray.wait(self._runs, num_returns=len(self._runs), timeout=5)
        for actor in self._actors:
            with contextlib.suppress(Exception):  # already gone with its node
                ray.kill(actor, no_restart=True)
        if self._placement_group is not None:
            from ray.util.placement_group import remove_placement_group

            with contextlib.suppress(Exception):  # the cluster may be gone
                remove_placement_group(self._placement_group)
        if self._owns_ray:
            ray.shutdown()
