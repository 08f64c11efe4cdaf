"""A free TCP port for a rendezvous on this host that no outgoing connection will take meanwhile.

Binding to port 0 returns a port from the kernel's ephemeral range, the range it also hands out
to outgoing connections. Between choosing that port and the rank-0 store binding it (seconds,
while the processes import), any connection on the host (gloo opens many) may take it, and the
store fails with EADDRINUSE. Ports below the ephemeral range are only ever taken by an explicit
bind, so a random free one there stays free.
"""
from __future__ import annotations

import random
import socket

__all__ = ["free_port"]

_LOWEST = 10_000


def _ephemeral_start() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32_768  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def free_port() -> int:
    """A port that is free now and outside the ephemeral range when the host leaves room for one."""
    top = _ephemeral_start() - 1
    if top > _LOWEST:
        for _ in range(100):
            port = random.SystemRandom().randint(_LOWEST, top)
            if _bindable(port):
                return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:  # no room below the range: any free port
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
