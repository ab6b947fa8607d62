"""Tensor and pipeline ranks on a Ray cluster (`distributed_executor_backend="ray"`): a cluster of four
simulated one-CPU nodes on this machine (`ray.cluster_utils.Cluster`, started once for the module),
so every rank lands on a node of its own. Tokens equal one process for GPT-2 and a Llama-family
preset, offline and served; a node removed under load ends every stream with an error naming the rank
and its node, the model unloads, and nothing of this project is left on the cluster.

Run alone: `pytest -m ray`.
"""

from __future__ import annotations

import importlib.util

import pytest

from orca_backend import LLM, EngineConfig, SamplingParams

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.ray

PROMPTS = [[5, 6, 7, 8], [9, 10], [11, 12, 13, 14, 15, 16], [17]]
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# One CPU each, so every rank gets a node of its own; a small object store (nothing big travels
# through it), so four nodes fit beside each other on a small machine.
NODE = {"num_cpus": 1, "object_store_memory": 100 * 2**20}


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args=NODE)
    for _ in range(3):
        cluster.add_node(**NODE)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address)
    try:
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


def orca_leftovers() -> tuple[list[str], list[str]]:
    """This project's actors still alive and placement groups not removed, as Ray lists them."""
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("orca-")]
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if g["name"].startswith("orca-") and g["state"] != "REMOVED"]  # fmt: skip
    return actors, groups


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
