"""Where the other nodes' daemons are: a static ``--peers`` map and/or a torch TCPStore
(``--discover``) where every daemon registers its endpoint."""

from __future__ import annotations

import threading
from datetime import timedelta
from typing import Dict, List, Mapping, Optional

# The store layer imports torch.distributed already (the daemon needs it anyway).
from torch.distributed import TCPStore

from ..wire import ProtocolConfigError
from .config import DISCOVERY_PREFIX, logger


class PeerDirectory:
    """Node id → daemon endpoint: a static ``--peers`` map and/or a torch TCPStore
    (``--discover``) where every daemon registers ``resilient_ckpt/daemon/<node-id>``."""

    def __init__(
        self, node_id: int, static: Mapping[int, str], discover: Optional[str], master: bool, timeout_s: float
    ):
        self.node_id = node_id
        self._static = dict(static)
        self._found: Dict[int, str] = {}
        self._discover = discover
        self._master = master
        self._timeout_s = timeout_s
        self._store = None
        self._lock = threading.Lock()

    def start(self, advertise: str) -> None:
        if not self._discover:
            return
        host, _, port = self._discover.rpartition(":")
        if not host or not port.isdigit():
            raise ProtocolConfigError(
                f"--discover {self._discover!r} is not HOST:PORT", fix="pass e.g. --discover node0:29500"
            )
        try:
            self._store = TCPStore(
                host,
                int(port),
                is_master=self._master,
                wait_for_workers=False,
                timeout=timedelta(seconds=max(1.0, self._timeout_s)),
            )
            self._store.set(DISCOVERY_PREFIX + str(self.node_id), advertise)
        except Exception as e:  # torch raises RuntimeError/DistNetworkError/TimeoutError
            raise ProtocolConfigError(
                f"cannot register in the discovery store {self._discover}: {e}",
                fix="start the TCPStore first (or pass --discover-master on one daemon) and check HOST:PORT",
            ) from e

    def endpoint(self, node: int) -> Optional[str]:
        if node in self._static:
            return self._static[node]
        with self._lock:
            if node in self._found:
                return self._found[node]
            return self._lookup(node)

    def _lookup(self, node: int) -> Optional[str]:
        if self._store is None:
            return None
        key = DISCOVERY_PREFIX + str(node)
        try:
            if not self._store.check([key]):
                return None
            ep = self._store.get(key).decode()
        except Exception as e:
            logger.warning("discovery lookup of node %d failed: %s", node, e)
            return None
        self._found[node] = ep
        return ep

    def refresh(self) -> None:
        """Re-read discovered endpoints (a restarted daemon may have moved) and probe for new
        nodes: ids up to 8 past the highest known."""
        if self._store is None:
            return
        with self._lock:
            known = set(self._found) | set(self._static) | {self.node_id}
            self._found.clear()
            misses = 0
            node = 0
            while misses < 8 or node <= max(known):
                if node != self.node_id and node not in self._static:
                    misses = 0 if self._lookup(node) else misses + 1
                node += 1
                if node > 65536:
                    break

    def nodes(self) -> List[int]:
        with self._lock:
            return sorted((set(self._static) | set(self._found)) - {self.node_id})

    def close(self) -> None:
        self._store = None
