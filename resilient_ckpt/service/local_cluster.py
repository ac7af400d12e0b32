"""Daemon processes for simulated nodes on one machine (demo, benchmark): one real
``resilient-ckpt serve`` process per node on loopback, each owning that node's store root,
sharing a generated job secret."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from .client import DaemonClient
from .wire import Authenticator, load_secret, write_secret_file


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalDaemonCluster:
    def __init__(self, roots: Sequence[Path], workdir: Path, session: str):
        self.roots = [Path(r) for r in roots]
        self.workdir = Path(workdir)
        self.session = session
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.workdir / f"{session}.secret"
        write_secret_file(self.secret_file)
        self.endpoints: List[str] = [f"tcp://127.0.0.1:{_free_port()}" for _ in self.roots]
        self.procs: Dict[int, subprocess.Popen] = {}

    @property
    def env(self) -> Dict[str, str]:
        """What a trainer needs in its environment to talk to the daemons."""
        return {"RESILIENT_CKPT_SECRET_FILE": str(self.secret_file)}

    def start(self) -> "LocalDaemonCluster":
        for node in range(len(self.roots)):
            self.spawn(node)
        for node in range(len(self.roots)):
            self.wait_ready(node)
        return self

    def spawn(self, node: int, *extra: str) -> None:
        self.roots[node].mkdir(parents=True, exist_ok=True)
        peers = ",".join(f"{n}={e}" for n, e in enumerate(self.endpoints) if n != node)
        cmd = [
            sys.executable,
            "-m",
            "resilient_ckpt.service.daemon",
            "--store-root",
            str(self.roots[node]),
            "--bind",
            self.endpoints[node],
            "--node-id",
            str(node),
            "--secret-file",
            str(self.secret_file),
            "--log-format",
            "json",
            *(["--peers", peers] if peers else []),
            *extra,
        ]
        log = open(self.workdir / f"daemon-{self.session}-{node}.log", "a")
        self.procs[node] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )

    def wait_ready(self, node: int, timeout: float = 60.0) -> None:
        auth = Authenticator(load_secret(str(self.secret_file)))
        with DaemonClient(self.endpoints[node], self.session, auth, timeout_s=5) as c:
            c.wait_ready(timeout)

    def kill(self, node: int) -> None:
        """SIGKILL the node's daemon, the way a crash ends it."""
        p = self.procs.get(node)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGKILL)
            p.wait()

    def restart(self, node: int, recover: Optional[str] = None) -> None:
        """A (replacement) daemon on the node's store root; ``recover``: pull that session's
        newest checkpoints of the node's ranks from the peers first."""
        self.kill(node)
        self.spawn(node, *(["--recover", recover] if recover else []))
        self.wait_ready(node)

    def stop(self) -> None:
        for node in list(self.procs):
            self.kill(node)
