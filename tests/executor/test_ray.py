"""Tensor and pipeline ranks on a Ray cluster (`distributed_executor_backend="ray"`): a cluster of four
simulated one-CPU nodes on this machine's loopback (tests/ray_cluster.py, started once for the
module), so every rank lands on a node of its own. Tokens equal one process for GPT-2 and a
Llama-family preset, offline and served; an engine joins the loopback cluster itself and every
connection stays on loopback; a node removed under load ends every stream with an error naming the
rank and its node, the model unloads, and nothing of this project is left on the cluster; a hung
rank fails the step within iteration_timeout_s; a dropped LLM frees its actors and placement group.

Run alone: `pytest -m ray`.
"""

from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import weakref

import pytest

from orca_backend import LLM, EngineConfig, SamplingParams

ray = pytest.importorskip("ray")

from ray_cluster import NODE, loopback_cluster, orca_leftovers, tcp_sockets  # noqa: E402 - needs ray
from serving_utils import wait_until  # noqa: E402

pytestmark = pytest.mark.ray

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster():
    with loopback_cluster(4) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def references() -> dict[str, list[list[int]]]:
    return {model: [o.output_ids for o in LLM(model).generate(PROMPTS, GREEDY)] for model in ("gpt2-tiny", "llama-tiny")}


@pytest.mark.parametrize("model", ["gpt2-tiny", "llama-tiny"])
@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (1, 2), (2, 2)])
def test_ranks_on_other_nodes_give_one_process_tokens(cluster, references, model, tp, pp):
    llm = LLM(model, tensor_parallel_size=tp, pipeline_parallel_size=pp, distributed_executor_backend="ray")
    try:
        executor = llm.engine.core.executor
        assert len({node_id for _, node_id in executor.nodes}) == tp * pp  # one node each
        assert [o.output_ids for o in llm.generate(PROMPTS, GREEDY)] == references[model]
    finally:
        llm.engine.shutdown()
    assert orca_leftovers() == ([], [])


def test_a_removed_node_fails_every_request_naming_the_rank_and_node(cluster):
    """Offline: the engine dies with the rank and node named; actors and placement group are gone."""
    llm = LLM("llama-tiny", tensor_parallel_size=2, distributed_executor_backend="ray")
    executor = llm.engine.core.executor
    head = cluster.head_node.node_id
    rank = next(r for r, (_, node_id) in enumerate(executor.nodes) if node_id != head)
    ip, node_id = executor.nodes[rank]
    events: dict[str, list] = {}
    streams = llm.engine.add_requests(PROMPTS, SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True),
                                      on_output=lambda o: events.setdefault(o.request_id, []).append(o))  # fmt: skip
    llm.engine.step()
    cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id))
    try:
        while llm.engine.has_work() and llm.engine.healthy:
            llm.engine.step()
        ends = [events[s.request_id][-1] for s in streams]
        assert all(e.finished and e.finish_reason == "error" for e in ends)
        assert f"worker {rank} (Ray actor on node {ip}" in ends[0].error
        assert not llm.engine.healthy
    finally:
        llm.engine.shutdown()
        cluster.add_node(**NODE)  # the next test's four nodes
        cluster.wait_for_nodes()
    assert orca_leftovers() == ([], [])


def test_without_ray_the_backend_is_refused_with_the_install_hint(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "ray" else real(name, *a))
    with pytest.raises(ValueError, match=r"pip install -e \.\[ray\]"):
        EngineConfig(distributed_executor_backend="ray", tensor_parallel_size=2)
    with pytest.raises(ValueError, match="'mp' or 'ray'"):
        EngineConfig(distributed_executor_backend="mpi")


def test_served_ranks_on_the_cluster_then_a_node_removed_under_load(cluster, references, tmp_path):
    """Through tritonserver: the engine core process joins the cluster at ray_address; streams give
    one process's tokens. Then a rank's node goes under load: every stream ends with an error within
    the watchdog's bound, the model unloads itself, and nothing of this project stays on the cluster."""
    grpc = pytest.importorskip("tritonclient.grpc", reason="needs the serve extras (tritonclient)")  # noqa: F841
    from serving_utils import StreamSession, start_server, wait_until

    server = start_server(tmp_path, "llama-tiny", models=("orca",), parameters={  # type: ignore[arg-type]
        "tensor_parallel_size": "2", "distributed_executor_backend": "ray", "ray_address": cluster.address,
        "iteration_timeout_s": "20", "kv_capacity_tokens": "4096"})  # fmt: skip
    try:
        with StreamSession(server.grpc_url) as session:
            for i, prompt in enumerate(PROMPTS):
                session.send("orca", f"r{i}", input_ids=prompt, max_tokens=GREEDY.max_tokens,
                             sampling={"temperature": 0, "ignore_eos": True}, stream=True)  # fmt: skip
            results = session.wait()
        assert [r.ids for r in results] == references["llama-tiny"] and all(r.error is None for r in results)
        # A rank on a node other than the head's (this process's node, which cannot be removed).
        names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("orca-"))
        nodes = [ray.get(ray.get_actor(name, namespace="orca").node.remote()) for name in names]
        rank = next(r for r, (_, node_id) in enumerate(nodes) if node_id != cluster.head_node.node_id)
        ip, node_id = nodes[rank]
        # One stream each: a stream's error callback does not say which of its requests it is for.
        sessions = [StreamSession(server.grpc_url) for _ in PROMPTS]
        try:
            long = [session.send("orca", f"long{i}", input_ids=prompt, max_tokens=240,
                                 sampling={"temperature": 0, "ignore_eos": True}, stream=True)
                    for i, (session, prompt) in enumerate(zip(sessions, PROMPTS, strict=True))]  # fmt: skip
            assert wait_until(lambda: all(r.ids for r in long), timeout_s=60)
            cluster.remove_node(next(n for n in cluster.list_all_nodes() if n.node_id == node_id))
            for session in sessions:
                session.wait(timeout_s=60)  # the watchdog's 20 s bound, and then some
        finally:
            for session in sessions:
                session.close()
        for result in long:
            assert result.error is not None and f"worker {rank} (Ray actor on node {ip}" in result.error, result.error
            assert result.error.startswith("the ORCA engine is unavailable")
        assert wait_until(lambda: server.model_ready_status("orca") != 200, timeout_s=60)
        assert wait_until(lambda: orca_leftovers() == ([], []), timeout_s=60)
    finally:
        server.stop()
        cluster.add_node(**NODE)
        cluster.wait_for_nodes()


# The engine in a process of its own, which joins the cluster itself (ray_address): it prints its tokens
# and its ranks' pids, then waits for a line on stdin while the test looks at every socket.
JOINING_ENGINE = """
import json, sys
from orca_backend import LLM, SamplingParams
llm = LLM("gpt2-tiny", tensor_parallel_size=2, distributed_executor_backend="ray", ray_address=sys.argv[1])
outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True))
print(json.dumps({"tokens": [o.output_ids for o in outs], "ranks": llm.engine.core.executor.rank_pids}), flush=True)
sys.stdin.readline()
"""


@pytest.mark.timeout(300)  # the failure bound where the engine cannot join (it used to wait forever)
def test_an_engine_joins_a_loopback_cluster_and_every_connection_stays_on_loopback(cluster, references, tmp_path):
    """An engine process joins the cluster at 127.0.0.1 (Ray would swap it for the interface address,
    where nothing listens), and while it serves, every TCP socket of the cluster's processes, the
    engine's and its ranks' is on loopback: connections at both ends, listeners too (the data plane's
    store listens on 127.0.0.1, where torch's own would listen on every interface). Left to the
    interpreter's exit, the engine then ends its actors without a traceback."""
    stderr = tmp_path / "stderr"
    engine = subprocess.Popen([sys.executable, "-c", JOINING_ENGINE, cluster.address, json.dumps(PROMPTS)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr.open("w"), text=True)  # fmt: skip
    try:
        report = json.loads(engine.stdout.readline())
        assert report["tokens"] == references["gpt2-tiny"]
        sockets = tcp_sockets(os.getpid())  # this process's tree: the cluster's nodes, the engine and its actors
        ours = {engine.pid, *report["ranks"]}
        assert {s.pid for s in sockets} >= ours
        assert [s for s in sockets if not s.on_loopback] == []
        engine.stdin.write("done\n")
        engine.stdin.flush()
        assert engine.wait(timeout=120) == 0
    finally:
        engine.kill()
        engine.wait()
    assert "Traceback" not in stderr.read_text(), stderr.read_text()
    assert wait_until(lambda: orca_leftovers() == ([], []), timeout_s=60)


@pytest.mark.timeout(300)  # the failure bound where nothing bounds the step (it used to wait forever)
def test_a_hung_rank_fails_the_step_within_iteration_timeout(cluster):
    """A rank that stops answering without its connection closing (SIGSTOP: what a partitioned node
    looks like from here, no reset) fails the pool within iteration_timeout_s; the control
    connections carry TCP keepalive for a node that vanished outright."""
    from orca_backend.net import KEEPALIVE_IDLE_S

    llm = LLM("gpt2-tiny", tensor_parallel_size=2, distributed_executor_backend="ray", iteration_timeout_s=5)
    executor = llm.engine.core.executor
    for conn in executor.conns:
        with socket_of(conn) as sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
    hung = executor.rank_pids[1]
    os.kill(hung, signal.SIGSTOP)
    try:
        with pytest.raises(RuntimeError, match=r"no answer from the workers within 5 s \(iteration_timeout_s"):
            llm.generate(PROMPTS, GREEDY)
        assert not llm.engine.healthy
    finally:
        os.kill(hung, signal.SIGCONT)
        llm.shutdown()
    assert wait_until(lambda: orca_leftovers() == ([], []), timeout_s=60)


def test_dropped_llms_free_their_actors_and_placement_groups(cluster):
    """Three engines in a row, each dropped with `del`: nothing keeps an LLM alive, and its finalizer
    kills its actors and removes its placement group (a second engine used to wait for the CPUs the
    first one's actors held)."""
    for _ in range(3):
        llm = LLM("gpt2-tiny", tensor_parallel_size=2, distributed_executor_backend="ray")
        assert [len(found) for found in orca_leftovers()] == [2, 1]
        collected = weakref.ref(llm)
        del llm
        assert collected() is None  # freed by its reference count: no cycle holds it
        gc.collect()
        assert wait_until(lambda: orca_leftovers() == ([], []), timeout_s=60)


def socket_of(conn):  # noqa: ANN001, ANN201 - a Connection; a socket sharing its descriptor
    return socket.socket(fileno=os.dup(conn.fileno()))
