"""The worker pool on a Ray cluster (`distributed_executor_backend="ray"`): the model's tp x pp ranks
as Ray actors, placed by a placement group over the cluster's nodes, running the same worker code
as the local pool's processes (worker/worker_proc.py).

Placement: one bundle per rank (a GPU and a CPU on CUDA, a CPU otherwise), PACK by default: Ray fills
a node before the next, and ranks are numbered stage by stage, so a tensor-parallel group stays
inside a node where it fits and pipeline stages go to other nodes, as ORCA places them (intra-layer
parallelism within a node, inter-layer across nodes); `ray_placement_strategy` may say SPREAD,
STRICT_PACK or STRICT_SPREAD instead.

Control plane: each actor opens a TCP connection back to the engine core, a listener on the core's
node address as Ray knows it, authenticated both ways and under a deadline; bad peers are dropped
and the listener closes once every rank is in (executor/control_plane.py). On the connections flow the same messages as the local pipes:
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
import secrets
import socket
import uuid
from collections.abc import Iterator
from dataclasses import asdict

from orca_backend.config import EngineConfig
from orca_backend.executor.control_plane import ControlServer, connect_control
from orca_backend.executor.multiproc import LOOPBACK_SOCKET_ENV, WorkerPoolExecutor, worker_socket_env
from orca_backend.families import AnyModelConfig, model_config_to_json
from orca_backend.net import is_loopback, listen
from orca_backend.processes import child_env_vars
from orca_backend.worker.worker_proc import worker_main

logger = logging.getLogger("orca.workers")

RAY_NAMESPACE = "orca"


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
        env = {key: os.environ[key] for key in LOOPBACK_SOCKET_ENV if os.environ.get(key)} | child_env_vars()
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
