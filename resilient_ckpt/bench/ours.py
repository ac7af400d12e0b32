"""resilient_ckpt as a benchmarked system (embedded mode; service mode with per-node daemons).

``save`` returns once the copies are started; the runner calls the handle's ``fence`` right
before it mutates the tensors (``SaveHandle.fence``: CPU tensors' copies waited for, GPU
copies ordered before the stream's later work) — what ``CheckpointHook`` does before the
optimizer step. The runner's stall is until then (CUDA: synchronised).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any, Dict, Optional

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
        details: Dict[str, float] = {}

        def wait() -> None:
            m = handle.wait()
            details.update(
                pinned_on_save_bytes=m.pinned_on_save_bytes,
                pinned_held_bytes=m.pinned_held_bytes,
                device_snapshot=float(m.device_snapshot),
                staging_s=m.staging_s,
                checksum_s=m.checksum_s,
                publish_s=m.publish_s,
                replication_s=m.replication_s,
                agreement_s=m.agreement_s,
                store_bytes_node=m.store_bytes,
            )
            if m.parity_encode_s > 0:
                details["parity_encode_gbps"] = m.parity_coded_bytes / m.parity_encode_s / 1e9

        return SaveHandle(
            wait, saved_bytes=handle.metrics.bytes_staged, details=details, fence_fn=handle.fence
        )

    def restore(self, template: Any) -> Any:
        result = self.manager.load_local(template)
        if result is None:
            raise RuntimeError("ours-embedded: no complete local checkpoint found")
        return result[0]

    def restore_phases(self) -> Optional[Dict[str, float]]:
        """Seconds per phase of the last restore on this rank (``LoadMetrics.phases``), and the
        reader threads' seconds as ``readers/<kind>``."""
        m = self.manager.last_load_metrics
        if m is None or not m.phases:
            return None
        return {**m.phases, **{f"readers/{k}": v for k, v in m.reader_seconds.items()}}

    def teardown(self) -> None:
        self.manager.close()


class LeanSystem(EmbeddedSystem):
    """The least memory: the newest complete iteration only and no spare segment (each save
    copies into fresh pages)."""

    name = "ours-lean"

    def manager_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        return dict(super().manager_kwargs(ctx), keep_last=1, spare_segment=False)


class KeepTwoSystem(EmbeddedSystem):
    """Two complete iterations in memory (the default before issue 22) and a spare."""

    name = "ours-keep2"

    def manager_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        return dict(super().manager_kwargs(ctx), keep_last=2)


class SnapshotSystem(EmbeddedSystem):
    """GPU state staged through a copy within the GPU on every save (device_snapshot="always")."""

    name = "ours-snapshot"

    def manager_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        return dict(super().manager_kwargs(ctx), device_snapshot="always")


class ParitySystem(LeanSystem):
    """XOR parity groups (k = 4 where it tiles the nodes, see :meth:`group_size`) instead of
    full replicas, with the reference's retention."""

    name = "ours-parity"

    @classmethod
    def memory_estimate(cls, bytes_per_rank: int, world_size: int) -> int:
        b = bytes_per_rank  # store: 2 iterations x (own + a quarter) + spare; encode scratch B
        return world_size * ((1 << 29) + 3 * b + int(2 * 1.25 * 0.75 * b) + int(0.75 * b))

    def manager_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        kw = super().manager_kwargs(ctx)
        del kw["replication_factor"]
        return dict(kw, redundancy="parity", parity_group=self.group_size(ctx), parity_shares=1)

    @staticmethod
    def group_size(ctx: RankContext) -> int:
        """k = 4 where groups of 5 nodes tile the job, else the largest k < 4 that tiles it
        (so every group has the same k), else nodes - 1."""
        nodes = -(-ctx.world_size // ctx.ranks_per_node)
        tiling = [k for k in (4, 3, 2, 1) if nodes % (k + 1) == 0]
        return tiling[0] if tiling else max(1, min(4, nodes - 1))


class ParityRSSystem(ParitySystem):
    """Reed-Solomon parity (m = 2: any two nodes of a group may be lost), k = 2 where groups
    of 4 nodes tile the job, else nodes - 2."""

    name = "ours-parity-rs"

    def manager_kwargs(self, ctx: RankContext) -> Dict[str, Any]:
        nodes = -(-ctx.world_size // ctx.ranks_per_node)
        k = 2 if nodes % 4 == 0 else max(1, min(2, nodes - 2))
        return dict(super().manager_kwargs(ctx), parity_group=k, parity_shares=2)


class _NodeDaemons:
    """ours-service's per-node services for the runner: one daemon process per node."""

    def __init__(self, cluster):
        from ..service.local_cluster import LocalDaemonCluster

        roots = [cluster.store_root(n) for n in range(cluster.num_nodes)]
        self.session = cluster.session
        fab = cluster.fabric  # --fabric netns: each daemon inside its node, on the node's address
        self.daemons = LocalDaemonCluster(
            roots,
            Path(cluster.tmp_root) / "daemons",
            cluster.session,
            hosts=None if fab is None else [fab.address(n) for n in range(cluster.num_nodes)],
            wrap=None if fab is None else fab.command,
        ).start()
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
