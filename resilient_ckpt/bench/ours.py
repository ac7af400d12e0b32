"""resilient_ckpt as a benchmarked system (embedded mode; service mode with per-node daemons).

``save`` returns after ``wait_staged()``: the copies into the store segment are done and the
loop may mutate its tensors — the honest stall, although a real loop overlaps the copies with
forward/backward and only the optimizer step waits.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict

from ..manager.checkpoint_manager import CheckpointManager
from .launcher import RankContext
from .runner import SaveHandle


class EmbeddedSystem:
    name = "ours-embedded"
    flavour = "ours"

    @classmethod
    def memory_estimate(cls, bytes_per_rank: int, world_size: int) -> int:
        # Per rank: ~0.5 GiB libraries + the state B + restore arena B; store per rank:
        # (keep_last + 1 in flight) x (own + one replica) x 0.75 B, plus one spare segment.
        b = bytes_per_rank
        return world_size * ((1 << 29) + 2 * b + int(3 * 2 * 0.75 * b) + int(0.75 * b))

    def setup(self, ctx: RankContext) -> None:
        logging.getLogger("resilient_ckpt").setLevel(logging.ERROR)
        self.manager = CheckpointManager(**self.manager_kwargs(ctx))

    def manager_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        return dict(
            session_id=ctx.session,
            store_root=ctx.store_root,
            replication_factor=ctx.replication_factor,
            ranks_per_node=ctx.ranks_per_node,
            parallelization_group=ctx.dp_group,
            timeout_s=300,
        )

    def save(self, state: Dict[str, Any], iteration: int) -> SaveHandle:
        handle = self.manager.save_local(state, iteration)
        handle.wait_staged()
        details: Dict[str, float] = {}

        def wait() -> None:
            m = handle.wait()
            details.update(
                staging_s=m.staging_s,
                checksum_s=m.checksum_s,
                publish_s=m.publish_s,
                replication_s=m.replication_s,
                agreement_s=m.agreement_s,
            )

        return SaveHandle(wait, saved_bytes=handle.metrics.bytes_staged, details=details)

    def restore(self, template: Any) -> Any:
        result = self.manager.load_local(template)
        if result is None:
            raise RuntimeError("ours-embedded: no complete local checkpoint found")
        return result[0]

    def teardown(self) -> None:
        self.manager.close()


class _NodeDaemons:
    """ours-service's per-node services for the runner: one daemon process per node."""

    def __init__(self, cluster):
        from ..service.local_cluster import LocalDaemonCluster

        roots = [cluster.store_root(n) for n in range(cluster.num_nodes)]
        self.session = cluster.session
        self.daemons = LocalDaemonCluster(roots, Path(cluster.tmp_root) / "daemons", cluster.session).start()
        self.info = {"endpoints": list(self.daemons.endpoints), "env": self.daemons.env}

    def kill_node(self, node: int) -> None:
        self.daemons.kill(node)

    def start_node(self, node: int) -> None:
        # A replacement daemon without --recover: the trainers' restore asks it to pull, so the
        # pull is inside the timed restore.
        self.daemons.restart(node)

    def stop(self) -> None:
        self.daemons.stop()


class ServiceSystem(EmbeddedSystem):
    """Service mode: each node's daemon replicates (and serves pulls); trainers commit to it."""

    name = "ours-service"

    @classmethod
    def start_nodes(cls, cluster) -> _NodeDaemons:
        return _NodeDaemons(cluster)

    def manager_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        os.environ.update(ctx.services["env"])  # the job secret for the daemon client
        return dict(super().manager_kwargs(ctx), mode="service", endpoint=ctx.services["endpoints"][ctx.node])
