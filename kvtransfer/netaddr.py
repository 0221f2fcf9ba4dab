"""Which address a worker publishes to its KV peers. The only place kvtransfer asks Ray anything
(which node am I on), and only when asked for 'auto' inside a Ray worker; Ray stays optional."""

from __future__ import annotations

import socket

LOOPBACK = "127.0.0.1"


def resolve_host(host: str) -> str:
    """'auto': this Ray node's IP when running inside Ray (a multi-node cluster), else loopback;
    any other value as given."""
    if host != "auto":
        return host
    try:
        import ray
    except ImportError:
        return LOOPBACK
    return ray.util.get_node_ip_address() if ray.is_initialized() else LOOPBACK


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on `host` right now (the OS picks it; another process may take it before use)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
