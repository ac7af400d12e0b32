"""Free TCP ports for the processes this package starts on one host (rank groups, daemons).

A port taken by binding port 0 comes from the kernel's ephemeral range — the range it also
hands to outgoing connections. Between picking it and the process that binds it for real
(a rank's TCPStore, a daemon), another connection may be given that very port, and the bind
fails (seen as a rare test flake). Ports below the ephemeral range are only ever taken by an
explicit bind, so a free one stays free unless another picker chooses it too: picks are
random, and one process never hands out the same port twice in a row.
"""

from __future__ import annotations

import random
import socket
import threading
from typing import Set, Tuple

#: how far below the ephemeral range ports are drawn from
SPAN = 16384
_recent: Set[int] = set()
_lock = threading.Lock()


def ephemeral_range() -> Tuple[int, int]:
    """The kernel's ephemeral port range (Linux; the IANA default elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split())
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on ``host`` that nothing is bound to, below the ephemeral range when one is
    free there (else any free port)."""
    lo, _ = ephemeral_range()
    first = max(1024, lo - SPAN)
    with _lock:
        for _ in range(64 if lo > first else 0):
            port = random.randrange(first, lo)
            if port in _recent or not _bindable(host, port):
                continue
            if len(_recent) > 1024:
                _recent.clear()
            _recent.add(port)
            return port
    with socket.socket() as s:  # nothing free below the range: let the kernel pick
        s.bind((host, 0))
        return s.getsockname()[1]


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True
