"""A simulated Ray cluster on this machine's loopback for the Ray tests (tests/executor/test_ray.py,
tests/executor/test_control_plane.py), what ORCA leaves on it, and the TCP sockets a process tree holds.

Every node is pinned to 127.0.0.1 (`node_ip_address`), so the cluster's traffic, the control plane's
and the data plane's stay on loopback; Ray's usage reporting (which would reach the Internet) is
off.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import ray

from orca_backend.executor.ray_executor import connect_ray
from orca_client.served_path import process_tree

# One CPU each, so every rank gets a node of its own; a small object store (nothing big travels
# through it), so several nodes fit beside each other on a small machine; no dashboard.
NODE = {"num_cpus": 1, "object_store_memory": 100 * 2**20, "node_ip_address": "127.0.0.1", "include_dashboard": False}
TCP_STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "03": "SYN_RECV", "06": "TIME_WAIT", "0A": "LISTEN"}


@contextlib.contextmanager
def loopback_cluster(nodes: int, **node_args: object) -> Iterator[object]:
    """A cluster of `nodes` nodes (NODE, updated with `node_args`) that this process has joined
    (connect_ray, as the executor joins one); left and shut down on exit."""
    from ray.cluster_utils import Cluster

    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"  # read by the nodes this process starts, and by ray.init
    args = NODE | node_args
    cluster = Cluster(initialize_head=True, head_node_args=args)
    try:
        for _ in range(nodes - 1):
            cluster.add_node(**args)
        cluster.wait_for_nodes()
        connect_ray(ray, cluster.address)
        try:
            yield cluster
        finally:
            ray.shutdown()
    finally:
        cluster.shutdown()


def orca_leftovers() -> tuple[list[str], list[str]]:
    """This project's actors still alive and placement groups not removed, as Ray lists them."""
    actors = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("orca-")]
    groups = [g["name"] for g in ray.util.placement_group_table().values()
              if g["name"].startswith("orca-") and g["state"] != "REMOVED"]  # fmt: skip
    return actors, groups


@dataclass(frozen=True)
class TcpSocket:
    pid: int
    local: tuple[str, int]
    remote: tuple[str, int]
    state: str

    @property
    def on_loopback(self) -> bool:
        """Both ends on loopback (a listener's unspecified remote end counts as such)."""
        ips = [self.local[0]] + ([] if self.state == "LISTEN" else [self.remote[0]])
        return all(_loopback_ip(ip) for ip in ips)


def tcp_sockets(root: int) -> list[TcpSocket]:
    """Every TCP socket `root` and its descendants hold, as /proc shows them (what `ss -tnp` lists)."""
    table = {inode: ends for name in ("tcp", "tcp6") for inode, ends in _proc_net(Path("/proc/net") / name).items()}
    found = []
    for stat in process_tree(root):
        with contextlib.suppress(OSError):  # the process ended meanwhile
            for fd in os.listdir(f"/proc/{stat.pid}/fd"):
                with contextlib.suppress(OSError):
                    target = os.readlink(f"/proc/{stat.pid}/fd/{fd}")
                    if target.startswith("socket:[") and target[8:-1] in table:
                        found.append(TcpSocket(stat.pid, *table[target[8:-1]]))
    return found


def _proc_net(path: Path) -> dict[str, tuple[tuple[str, int], tuple[str, int], str]]:
    """inode -> (local, remote, state) of /proc/net/tcp or tcp6."""
    rows = {}
    for line in path.read_text().splitlines()[1:]:
        parts = line.split()
        local, remote, state, inode = parts[1], parts[2], parts[3], parts[9]
        rows[inode] = (_address(local), _address(remote), TCP_STATES.get(state, state))
    return rows


def _address(text: str) -> tuple[str, int]:
    """/proc/net's hex address: each 32-bit word in host (little-endian) order, then the port."""
    ip_hex, port_hex = text.split(":")
    raw = bytes.fromhex(ip_hex)
    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4))
    family = socket.AF_INET if len(raw) == 4 else socket.AF_INET6
    return socket.inet_ntop(family, raw), int(port_hex, 16)


def _loopback_ip(ip: str) -> bool:
    address = ipaddress.ip_address(ip)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return address.is_loopback
