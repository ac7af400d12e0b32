"""Daemon processes for simulated nodes on one machine (demo, benchmark, tests): one real
``resilient-ckpt serve`` process per node, each owning that node's store root, sharing a
generated job secret — on loopback, or, given each node's address and a command prefix that
runs a process inside the node (``ip netns exec <ns>``: the bench's network fabric), on the
nodes' own addresses."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Dict, List, Optional, Sequence

from ..ports import free_port
from .client import DaemonClient
from .wire import Authenticator, load_secret, write_secret_file

#: the daemons' port on nodes with addresses of their own (each node's namespace is fresh)
NODE_PORT = 7465


class LocalDaemonCluster:
    """``hosts``: each node's address (default: loopback, a free port each); ``wrap(node,
    argv)``: the command that runs ``argv`` inside node ``node`` (default: as is). ``extra``:
    more ``resilient-ckpt serve`` options for every daemon."""

    def __init__(
        self,
        roots: Sequence[Path],
        workdir: Path,
        session: str,
        *,
        hosts: Optional[Sequence[str]] = None,
        wrap: Optional[Callable[[int, List[str]], List[str]]] = None,
        extra: Sequence[str] = (),
    ):
        self.roots = [Path(r) for r in roots]
        self.workdir = Path(workdir)
        self.session = session
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.secret_file = self.workdir / f"{session}.secret"
        write_secret_file(self.secret_file)
        if hosts is None:
            self.endpoints: List[str] = [f"tcp://127.0.0.1:{free_port()}" for _ in self.roots]
        else:
            self.endpoints = [f"tcp://{h}:{NODE_PORT}" for h in hosts]
        self.wrap = wrap
        self.extra = list(extra)
        self.procs: Dict[int, subprocess.Popen] = {}
        self._log_start: Dict[int, int] = {}

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
            *self.extra,
            *extra,
        ]
        if self.wrap is not None:
            cmd = self.wrap(node, cmd)
        self._log_start[node] = self.log_path(node).stat().st_size if self.log_path(node).exists() else 0
        log = open(self.log_path(node), "a")
        self.procs[node] = subprocess.Popen(
            cmd, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONWARNINGS": "ignore"}
        )

    def log_path(self, node: int) -> Path:
        return self.workdir / f"daemon-{self.session}-{node}.log"

    def events(self, node: int, name: Optional[str] = None) -> List[dict]:
        """The node's daemon log events (``--log-format json``), all of its starts."""
        out = []
        try:
            lines = self.log_path(node).read_text().splitlines()
        except FileNotFoundError:
            return out
        for line in lines:
            try:
                ev = json.loads(line)
            except ValueError:
                continue
            if isinstance(ev, dict) and (name is None or ev.get("event") == name):
                out.append(ev)
        return out

    def wait_ready(self, node: int, timeout: float = 60.0) -> None:
        if self.wrap is None:
            auth = Authenticator(load_secret(str(self.secret_file)))
            with DaemonClient(self.endpoints[node], self.session, auth, timeout_s=5) as c:
                c.wait_ready(timeout)
            return
        # Inside another namespace: not reachable from here; its log says when it serves.
        deadline = time.monotonic() + timeout
        while True:
            with open(self.log_path(node), "rb") as f:
                f.seek(self._log_start.get(node, 0))
                if b'"event": "serving"' in f.read():
                    return
            p = self.procs[node]
            if p.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"daemon of node {node} did not start serving (exit code {p.poll()}); see "
                    f"{self.log_path(node)}"
                )
            time.sleep(0.02)

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
