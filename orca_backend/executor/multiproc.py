"""The engine master's side of distributed execution: starts tp x pp worker processes and talks
to them over the control channel (one pipe each: the scheduler's steps out, msgpack-encoded
(scheduler_output.encode_step); tokens, logprobs and errors back, as JSON).

A worker that raises or dies turns into `WorkerFailure` within one poll interval; every other
worker is then stopped too, so no process is left behind and nothing waits forever.

The workers listen on loopback only (single node): they meet through a file store in a private
temporary directory (torch's TCP store listens on every interface, whatever address it is given),
and gloo/NCCL open their sockets on `lo` unless GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME are set.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing as mp
import os
import re
import shutil
import tempfile
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, replace
from multiprocessing.connection import Connection, wait

from orca_backend.config import EngineConfig
from orca_backend.executor.base import BatchFailed, WorkerFailure
from orca_backend.families import AnyModelConfig, model_config_to_json
from orca_backend.processes import child_environment, exit_description
from orca_backend.scheduler_output import (
    PooledChunk,
    PromptLogprobsChunk,
    SamplerOutput,
    SchedulerOutput,
    encode_step,
)
from orca_backend.worker.worker_proc import STOP, worker_main

logger = logging.getLogger("orca.workers")

# The data plane's sockets: on loopback, where the ranks of one node reach each other.
LOOPBACK_SOCKET_ENV = {"GLOO_SOCKET_IFNAME": "lo", "NCCL_SOCKET_IFNAME": "lo"}
STORE_DIR_PREFIX = "orca-dist-"


def worker_socket_env(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """The interface settings the workers get: loopback for each one the user did not set."""
    environ = os.environ if environ is None else environ
    return {key: value for key, value in LOOPBACK_SOCKET_ENV.items() if not environ.get(key)}


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return "0"


def make_store_dir() -> str:
    """A private (0700) directory for the workers' file store, named after its master process:
    orca-dist-<pid namespace>-<pid>-<random>."""
    return tempfile.mkdtemp(prefix=f"{STORE_DIR_PREFIX}{_pid_namespace()}-{os.getpid()}-")


def remove_stale_store_dirs(parent: str | None = None) -> list[str]:
    """Removes this user's store directories whose master is gone: a master killed before its
    shutdown (an engine core killed by SIGKILL, or with its whole process group) leaves one behind.
    Only masters of this pid namespace are judged; returns the removed paths."""
    pattern = re.compile(rf"{re.escape(STORE_DIR_PREFIX)}{_pid_namespace()}-(\d+)-")
    removed = []
    with os.scandir(parent or tempfile.gettempdir()) as entries:
        for entry in entries:
            match = pattern.match(entry.name)
            if match is None:
                continue
            try:
                mine = entry.is_dir(follow_symlinks=False) and entry.stat(follow_symlinks=False).st_uid == os.getuid()
            except OSError:  # removed meanwhile
                continue
            if mine and not _process_exists(int(match.group(1))):
                shutil.rmtree(entry.path, ignore_errors=True)
                removed.append(entry.path)
    return removed


def _process_exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


class WorkerPoolExecutor:
    """tp x pp worker processes on this host, each with its control pipe. The messaging (`submit`,
    `collect_oldest`, failures) is every pool's; how the ranks start, how a dead one is described and
    how they are stopped is this class's (the Ray pool, executor/ray_executor.py, places them
    elsewhere)."""

    def __init__(self, config: EngineConfig, model_config: AnyModelConfig, start_timeout_s: float = 600.0) -> None:
        self._init_pool(config)
        ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA or threads
        # Removed by shutdown(), by orphaned workers (worker_proc), or by the next pool's sweep.
        for path in remove_stale_store_dirs():
            logger.info("removed the file store of a killed worker pool: %s", path)
        self.store_dir = make_store_dir()
        init_method = f"file://{os.path.join(self.store_dir, 'store')}"
        socket_env = worker_socket_env()
        interfaces = {key: os.environ.get(key, "") for key in LOOPBACK_SOCKET_ENV} | socket_env
        logger.info("workers meet through a file store in %s; data-plane sockets on %s (loopback unless set "
                    "by the user: single node only)", self.store_dir,
                    ", ".join(f"{k}={v}" for k, v in interfaces.items()))  # fmt: skip
        config_json, model_json = json.dumps(asdict(config)), model_config_to_json(model_config)
        self.processes: list[mp.process.BaseProcess] = []
        for rank in range(self.world_size):
            parent_end, child_end = ctx.Pipe(duplex=True)
            proc = ctx.Process(target=worker_main,
                               args=(rank, config_json, model_json, init_method, child_end, socket_env),
                               name=f"orca-worker-{rank}", daemon=True)  # fmt: skip
            with child_environment():  # a core in the user's process (offline) starts them too
                proc.start()
            child_end.close()
            self.conns.append(parent_end)
            self.processes.append(proc)
        self._await_ready(start_timeout_s)
        logger.info("started %d workers (tp=%d, pp=%d): pids %s", self.world_size, config.tensor_parallel_size,
                    config.pipeline_parallel_size, self.pids)  # fmt: skip

    def _init_pool(self, config: EngineConfig) -> None:
        tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
        self.world_size = tp * pp
        self.max_in_flight = pp  # one batch per pipeline stage
        self._sampler_rank = (pp - 1) * tp  # first tensor-parallel rank of the last stage
        self._pending: deque[int] = deque()
        self._closed = False
        self.conns: list[Connection] = []  # rank i's control channel
        self.rank_pids = [0] * self.world_size  # each rank's process id, on its own host (its "ready" says it)
        # How long collect_oldest waits for a step's tokens (None: as long as it takes): a local worker
        # that dies is seen by its sentinel; a hung one is the served watchdog's (core_client.py).
        self._step_timeout_s: float | None = None

    def _await_ready(self, timeout_s: float) -> None:
        """Waits for every rank's "ready" (its model loaded): a rank that fails stops them all."""
        self.weight_bytes = [0] * self.world_size
        capacities = [0] * self.world_size
        try:
            for _ in range(self.world_size):
                msg = self._next_message(timeout_s=timeout_s)
                self.weight_bytes[msg["rank"]] = msg["weight_bytes"]
                self.rank_pids[msg["rank"]] = msg["pid"]
                capacities[msg["rank"]] = msg["kv_capacity_tokens"]
            if len(set(capacities)) != 1:  # the ranks agree on a pool sized from memory (smallest_over_ranks)
                raise WorkerFailure(f"the ranks' K/V pools differ: {capacities} token slots")
        except WorkerFailure:
            self.shutdown()
            raise
        self.kv_capacity_tokens = capacities[0]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    @property
    def num_in_flight(self) -> int:
        return len(self._pending)

    def submit(self, step: SchedulerOutput) -> None:
        data = encode_step(step)
        # Structured output's bitmask rows (a few KB per constrained row) matter to the sampling rank alone.
        others = encode_step(replace(step, bitmask_rows=[], bitmask=b"", spec_bitmask_rows=[], spec_bitmask=b"")) \
            if step.bitmask_rows else data  # fmt: skip
        try:
            for rank, conn in enumerate(self.conns):
                conn.send_bytes(data if rank == self._sampler_rank else others)
        except OSError as exc:
            self.shutdown()
            raise WorkerFailure(f"cannot reach a worker: {exc}") from None
        self._pending.append(step.step_id)

    def collect_oldest(self) -> SamplerOutput:
        expected = self._pending.popleft()
        msg = self._next_message(self._step_timeout_s, bound="iteration_timeout_s: a rank or its node is hung or cut off")
        if msg.get("kind") == "batch_failed" and msg["batch_id"] == expected:
            raise BatchFailed(f"sampling failed in a worker:\n{msg['message']}")
        if msg.get("kind") != "tokens" or msg["batch_id"] != expected:
            self.shutdown()
            raise WorkerFailure(f"protocol error: expected tokens of batch {expected}, got {msg}")
        logprobs = msg.get("logprobs")
        if logprobs is not None:  # JSON made each row's (ids, logprobs, ranks) a list
            logprobs = [tuple(row) if row is not None else None for row in logprobs]
        failures = {int(lora_id): why for lora_id, why in msg.get("lora_failures", {}).items()}  # JSON keys are strings
        prompt_logprobs = [PromptLogprobsChunk(position, first, [tuple(row) for row in rows])
                           for position, first, rows in msg.get("prompt_logprobs", [])]  # fmt: skip
        pooled = [PooledChunk(position, vector) for position, vector in msg.get("pooled", [])]
        spec_logprobs = [None if rows is None else [tuple(row) for row in rows] for rows in msg.get("spec_logprobs", [])]
        return SamplerOutput(msg["tokens"], logprobs, failures, msg.get("step_path", ""), prompt_logprobs, pooled,
                             msg.get("num_accepted", []), spec_logprobs, msg.get("spec_tokens", []))  # fmt: skip

    def _next_message(self, timeout_s: float | None = None, bound: str = "the start timeout") -> dict:
        """The next message from any worker; a dead worker, an error report or no message within
        `timeout_s` (`bound` says what set it) raises WorkerFailure."""
        sentinels = self._sentinels()
        ready = wait(self.conns + list(sentinels), timeout=timeout_s)
        if not ready:
            self.shutdown()
            raise WorkerFailure(f"no answer from the workers within {timeout_s:g} s ({bound})")
        closed = None
        for obj in ready:  # messages first: a worker that reported an error has also exited
            if obj in sentinels:
                continue
            try:
                msg = json.loads(obj.recv_bytes())
            except (EOFError, OSError):  # its end closed: the rank is gone
                closed = self.conns.index(obj)
                continue
            if msg.get("kind") == "error":
                # A collective fails in every rank when one rank dies (its peers' sockets are reset),
                # and a survivor's report may arrive first: the death is the cause, so it is named (a
                # genuine error waits at most a second for a peer that is not dying).
                dead = self._dead_peer(msg["rank"], timeout_s=1.0)
                cause = f"{self._death(dead)}; then " if dead is not None else ""
                self.shutdown()
                raise WorkerFailure(f"{cause}worker {msg['rank']} raised:\n{msg['message']}")
            return msg
        dead_ranks = [sentinels[o] for o in ready if o in sentinels]
        description = self._death(dead_ranks[0] if dead_ranks else closed)
        self.shutdown()
        raise WorkerFailure(description)

    # How this pool's ranks live and die: worker processes of this host.
    def _sentinels(self) -> dict[object, int]:
        """What turns readable when a rank's process ends, by rank."""
        return {p.sentinel: rank for rank, p in enumerate(self.processes)}

    def _dead_peer(self, rank: int, timeout_s: float) -> int | None:
        """A rank other than `rank` that ended (waiting up to `timeout_s` for one), or None."""
        peers = {p.sentinel: r for r, p in enumerate(self.processes) if r != rank}
        dead = wait(list(peers), timeout=timeout_s)
        return peers[dead[0]] if dead else None

    def _death(self, rank: int) -> str:
        """How worker `rank`, whose sentinel is readable, ended."""
        # The sentinel turns readable when the process's descriptors close, a moment before its exit
        # status can be collected: join it briefly, or a SIGKILL would read as "no exit code yet".
        self.processes[rank].join(timeout=5)
        return f"worker {rank} (pid {self.processes[rank].pid}) {exit_description(self.processes[rank].exitcode)}"

    def shutdown(self) -> None:
        """Stops every worker: politely, then by force. Idempotent."""
        if self._closed:
            return
        self._closed = True
        for conn in self.conns:
            with contextlib.suppress(OSError):  # an already dead worker's pipe is closed
                conn.send_bytes(STOP)
        self._stop_ranks()
        for conn in self.conns:
            conn.close()
        self._pending.clear()

    def _stop_ranks(self) -> None:
        """After STOP was sent: the processes join, or are killed; the file store goes."""
        for proc in self.processes:
            proc.join(timeout=5)
        for proc in self.processes:
            if proc.is_alive():  # blocked in a collective with a dead peer
                proc.kill()
                proc.join(timeout=5)
        shutil.rmtree(self.store_dir, ignore_errors=True)
