"""Networking helpers shared by orca-serve, the worker pools and the Ray pool's control plane."""

from __future__ import annotations

import contextlib
import ipaddress
import socket

# TCP keepalive on long-lived control connections: an idle connection is probed after KEEPALIVE_IDLE_S,
# then every KEEPALIVE_INTERVAL_S; KEEPALIVE_PROBES unanswered probes (a peer whose host vanished or was
# partitioned away, which sends no reset) turn it into an error, ~25 s after it fell silent. Data left
# unacknowledged that long (TCP_USER_TIMEOUT) does the same while a message is in flight, where
# keepalive does not probe.
KEEPALIVE_IDLE_S = 10
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_PROBES = 3
UNACKED_TIMEOUT_S = KEEPALIVE_IDLE_S + KEEPALIVE_INTERVAL_S * KEEPALIVE_PROBES


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free a moment ago on `host` (the caller binds them soon
    after). They are held together while they are picked: picked one at a time, the kernel may hand
    the same port out twice (a tritonserver then refused to start, its HTTP and metrics ports one)."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) for _ in range(count)]
        for sock in socks:
            sock.bind((host, 0))
        return [sock.getsockname()[1] for sock in socks]


def listen(host: str) -> socket.socket:
    """A TCP listener on `host` (an IPv4 or IPv6 address) alone, not every interface; its port
    ephemeral (`getsockname()[1]`)."""
    return socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)


def is_loopback(host: str) -> bool:
    """Whether `host` (an IP address or "localhost") names this machine's loopback."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def set_keepalive(sock: socket.socket) -> None:
    """Makes a connection fail, instead of waiting forever, once its peer is unreachable (see
    KEEPALIVE_IDLE_S)."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, UNACKED_TIMEOUT_S * 1000)

