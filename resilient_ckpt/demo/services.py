"""Per-node daemons for ``resilient-ckpt demo --mode service``: one real ``resilient-ckpt
serve`` process per simulated node and run, on loopback, sharing a generated job secret."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DemoDaemons:
    """Daemon processes per (run, node); the store root of each is that node's root."""

    def __init__(self, demo, nodes: int):
        from ..service.auth import write_secret_file

        self.demo = demo
        self.nodes = nodes
        self.secret_file = Path(demo.base) / "job.secret"
        write_secret_file(self.secret_file)
        self.endpoints: Dict[str, List[str]] = {}
        self.procs: Dict[Tuple[str, int], subprocess.Popen] = {}

    @property
    def env(self) -> Dict[str, str]:
        return {"RESILIENT_CKPT_SECRET_FILE": str(self.secret_file)}

    def start(self, run: str) -> None:
        self.endpoints[run] = [f"tcp://127.0.0.1:{_free_port()}" for _ in range(self.nodes)]
        for node in range(self.nodes):
            self._spawn(run, node)
        for node in range(self.nodes):
            self._wait_ready(run, node)
        self.demo.log(f"started {self.nodes} node daemons for the {run} run")

    def _spawn(self, run: str, node: int, *extra: str) -> None:
        eps = self.endpoints[run]
        root = self.demo.node_root(run, node)
        root.mkdir(parents=True, exist_ok=True)
        peers = ",".join(f"{n}={e}" for n, e in enumerate(eps) if n != node)
        cmd = [sys.executable, "-m", "resilient_ckpt.service.daemon", "--store-root", str(root),
               "--bind", eps[node], "--node-id", str(node), "--secret-file", str(self.secret_file),
               "--log-format", "json", *(["--peers", peers] if peers else []), *extra]
        log = open(Path(self.demo.base) / f"daemon-{run}-{node}.log", "a")
        self.procs[(run, node)] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )

    def _wait_ready(self, run: str, node: int, timeout: float = 60.0) -> None:
        from ..service.auth import Authenticator, load_secret
        from ..service.client import DaemonClient

        auth = Authenticator(load_secret(str(self.secret_file)))
        deadline = time.time() + timeout
        with DaemonClient(self.endpoints[run][node], f"demo-{run}", auth, timeout_s=5) as c:
            c.wait_ready(max(1.0, deadline - time.time()))

    def endpoint(self, node: int, run: str = "faulty") -> str:
        return self.endpoints[run][node]

    def kill(self, node: int, run: str = "faulty") -> None:
        p = self.procs.get((run, node))
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def restart_lost(self, victims: List[int], run: str = "faulty") -> None:
        """A replacement node's daemon starts on its (possibly empty) store root and pulls its
        ranks' newest checkpoints from the peers before its trainers ask."""
        nodes = sorted({r // self.demo.args.ranks_per_node for r in victims})
        for node in nodes:
            self.kill(node, run)
            self._spawn(run, node, "--recover", f"demo-{run}")
            self._wait_ready(run, node)
            self.demo.log(f"replacement daemon for node {node} started (--recover: pulls from peers)")

    def stop(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
                p.wait()
