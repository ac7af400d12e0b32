"""Per-node daemons for ``resilient-ckpt demo --mode service``: a LocalDaemonCluster per run."""

from __future__ import annotations

from typing import Dict, List

from ..service.local_cluster import LocalDaemonCluster


class DemoDaemons:
    def __init__(self, demo, nodes: int):
        self.demo = demo
        self.nodes = nodes
        self.clusters: Dict[str, LocalDaemonCluster] = {}

    def env(self, run: str = "faulty") -> Dict[str, str]:
        return self.clusters[run].env

    def start(self, run: str) -> None:
        roots = [self.demo.node_root(run, n) for n in range(self.nodes)]
        self.clusters[run] = LocalDaemonCluster(roots, self.demo.base, f"demo-{run}").start()
        self.demo.log(f"started {self.nodes} node daemons for the {run} run")

    def endpoint(self, node: int, run: str = "faulty") -> str:
        return self.clusters[run].endpoints[node]

    def kill(self, node: int, run: str = "faulty") -> None:
        self.clusters[run].kill(node)

    def restart_lost(self, victims: List[int], run: str = "faulty") -> None:
        """A replacement node's daemon starts on its (possibly empty) store root and pulls its
        ranks' newest checkpoints from the peers before its trainers ask."""
        for node in sorted({r // self.demo.args.ranks_per_node for r in victims}):
            self.clusters[run].restart(node, recover=f"demo-{run}")
            self.demo.log(f"replacement daemon for node {node} started (--recover: pulls from peers)")

    def stop(self) -> None:
        for c in self.clusters.values():
            c.stop()
