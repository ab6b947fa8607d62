"""A worker process: one rank of the model (a tensor-parallel shard of one pipeline stage).

It receives every step's `SchedulerOutput` on its control pipe (msgpack: scheduler_output.py), applies its deltas to its
input batch, runs its slice of the model, and passes activations to the next stage with point-to-point sends on the tensor data
plane (torch.distributed: NCCL on GPUs, gloo on CPU). The first tensor-parallel rank of the last
stage samples and answers the master with the batch's tokens (and the logprobs of the rows that
asked for them); any failure is reported on the pipe
before the process exits, so the master never waits on a dead worker.

The ranks meet through the master's file store (`init_method` file://<private dir>/store) and
open their data-plane sockets on the interface `socket_env` names (loopback; executor/multiproc.py).
On a Ray cluster the same loop runs inside an actor (executor/ray_executor.py): its control channel
is a TCP connection to the engine core, and the ranks meet at rank 0's node (tcp://), where rank 0
serves torch's store on the socket its actor bound (`store_listen_fd`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import traceback
from datetime import timedelta
from multiprocessing.connection import Connection
from urllib.parse import urlsplit

import torch
import torch.distributed as dist

from orca_backend.config import EngineConfig
from orca_backend.distributed.comm import TensorParallelGroup
from orca_backend.distributed.layout import ParallelLayout
from orca_backend.families import AnyModelConfig, model_config_from_json
from orca_backend.model.device import torch_dtype
from orca_backend.scheduler_output import decode_step
from orca_backend.worker.model_runner import ModelRunner

STOP = b"stop"
logger = logging.getLogger("orca.worker")


def send_message(conn: Connection, **message: object) -> None:
    conn.send_bytes(json.dumps(message).encode())


def worker_main(rank: int, config_json: str, model_config_json: str, init_method: str, conn: Connection,
                socket_env: dict[str, str] | None = None, store_listen_fd: int | None = None) -> None:
    # Before torch.distributed reads them: gloo and NCCL pick their interface when a group is made.
    os.environ.update(socket_env or {})
    master = os.getppid()
    try:
        _serve(rank, EngineConfig(**json.loads(config_json)), model_config_from_json(model_config_json), init_method, conn,
               store_listen_fd)
    except (EOFError, ConnectionError):  # the master's end closed without a STOP: it died
        # The kernel closes a dying process's descriptors before it reparents its children: wait for
        # the reparenting, or a killed master's store would outlive it.
        _remove_store_if_orphaned(master, init_method, wait_s=5.0)
        os._exit(1)
    except Exception:  # noqa: BLE001 - the master must hear why this rank is gone
        try:
            send_message(conn, kind="error", rank=rank, message=traceback.format_exc())
        finally:
            _remove_store_if_orphaned(master, init_method)
            os._exit(1)
    _remove_store_if_orphaned(master, init_method)


def _serve(rank: int, config: EngineConfig, model_config: AnyModelConfig, init_method: str, conn: Connection,
           store_listen_fd: int | None) -> None:
    tp, pp = config.tensor_parallel_size, config.pipeline_parallel_size
    layout = ParallelLayout(tp_size=tp, pp_size=pp, tp_rank=rank % tp, pp_rank=rank // tp)
    if config.device.startswith("cuda"):
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // layout.world_size))
        backend = "gloo"
    _init_distributed(backend, init_method, rank, layout.world_size, store_listen_fd)
    # Every rank creates every stage's group, in the same order (torch.distributed requires it).
    groups = [dist.new_group([s * tp + t for t in range(tp)]) for s in range(pp)]
    runner = ModelRunner(config, model_config, device, layout, TensorParallelGroup(tp, groups[layout.pp_rank]))
    send_message(conn, kind="ready", rank=rank, pid=os.getpid(), weight_bytes=runner.model.weights.num_bytes(),
                 kv_capacity_tokens=runner.kv_capacity_tokens)  # fmt: skip

    parent = os.getppid()
    hidden_shape_tail = (model_config.hidden_size,)
    samples = layout.is_last_stage and layout.tp_rank == 0
    while True:
        if not conn.poll(1.0):
            if os.getppid() != parent:  # the master is gone: do not linger as an orphan
                return
            continue
        data = conn.recv_bytes()
        if data == STOP:
            break
        step = decode_step(data)  # a malformed message raises, naming the field: reported as this rank's error
        runner.update_states(step)
        hidden = None
        if not layout.is_first_stage:
            hidden = torch.empty((2, step.num_tokens, *hidden_shape_tail), dtype=torch_dtype(config.dtype), device=device)
            dist.recv(hidden, src=rank - tp)
        out = runner.run_stage(step, hidden)
        if not layout.is_last_stage:
            dist.send(out.contiguous(), dst=rank + tp)
        elif samples:
            try:
                sampled = runner.sample(out, step)
            except Exception:  # noqa: BLE001 - after every collective: this batch alone failed, the ranks stay in step
                send_message(conn, kind="batch_failed", batch_id=step.step_id, message=traceback.format_exc())
                continue
            send_message(conn, kind="tokens", batch_id=step.step_id, tokens=sampled.token_ids,
                         logprobs=sampled.logprobs, lora_failures=sampled.lora_failures,
                         step_path=sampled.step_path,
                         prompt_logprobs=[[c.position, c.first_token, c.logprobs] for c in sampled.prompt_logprobs],
                         pooled=[[c.position, c.vector] for c in sampled.pooled],
                         num_accepted=sampled.num_accepted, spec_logprobs=sampled.spec_logprobs,
                         spec_tokens=sampled.spec_tokens)  # fmt: skip
    dist.destroy_process_group()


def _init_distributed(backend: str, init_method: str, rank: int, world_size: int, store_listen_fd: int | None) -> None:
    timeout = timedelta(minutes=10)
    if not init_method.startswith("tcp://"):
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timeout)
        return
    # A TCP rendezvous (the Ray pool): rank 0 serves torch's store on the socket its actor bound to its
    # node's address (torch would listen on every interface), the others connect to it.
    if rank == 0 and store_listen_fd is None:
        raise ValueError("rank 0 serves a tcp:// rendezvous on a socket bound beforehand: store_listen_fd is required")
    url = urlsplit(init_method)
    store = dist.TCPStore(url.hostname, url.port, world_size, is_master=rank == 0, timeout=timeout,
                          master_listen_fd=store_listen_fd)  # fmt: skip
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=timeout)


def _remove_store_if_orphaned(master: int, init_method: str, wait_s: float = 0.0) -> None:
    """A killed master cannot remove its file store's private directory: its orphaned workers do
    (waiting up to `wait_s` to be reparented, where the master is known to be dying)."""
    if not init_method.startswith("file://"):
        return
    deadline = time.monotonic() + wait_s
    while os.getppid() == master and time.monotonic() < deadline:
        time.sleep(0.05)
    if os.getppid() != master:
        shutil.rmtree(os.path.dirname(init_method[len("file://"):]), ignore_errors=True)
