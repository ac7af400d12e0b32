"""Healing after a restore (a mixin of ``CheckpointManager``): re-create, on the save
thread, every copy of the restored iteration that the placement asks for and no store holds;
the plan is pure (``replication.healing``), the bytes move like replicas."""

from __future__ import annotations

import logging
import time
from typing import Callable, Optional

from ..parallel import collectives
from ..replication.healing import plan_repairs
from ..replication.parity_peer import ParityReplicator
from ..replication.peer import PeerReplicator
from ..replication.replicator import ReplicationResult
from .loading import rank_ranges
from .metrics import HealMetrics

logger = logging.getLogger(__name__)


class Healing:
    """Mixed into ``CheckpointManager``."""

    def _heal_after_restore(self) -> None:
        """Re-create, in the background, every copy of the restored iteration that the
        placement asks for and no store holds (a replaced node's own data and the replicas it
        keeps): until then a second failure could lose progress. Runs on the save thread, so
        it finishes before the next save replicates; ``wait_healed()`` waits for it.
        Decided from the restore's gathered facts: every rank schedules it, or none."""
        facts, self._restore_facts = self._restore_facts, None
        if facts is not None and self._group is not None and isinstance(self._replicator, ParityReplicator):
            self._heal_parity(*facts)
            return
        if facts is None or self._group is None or not isinstance(self._replicator, PeerReplicator):
            return  # service mode: the node daemon pulls a replaced node's data
        holdings, iteration = facts
        held = [{o for it, o in per if it == iteration} for per in holdings.ids]
        plan = plan_repairs(held, holdings.node_of, self.placement, holdings.nbytes(iteration))
        if not plan and not plan.unrepairable:
            return
        metrics = HealMetrics(
            iteration=iteration,
            copies=len(plan.repairs),
            bytes=sum(holdings.nbytes(iteration).get(r.owner, 0) for r in plan.repairs),
            unrepairable=list(plan.unrepairable),
        )
        if self.rank == 0:
            logger.warning(
                "iteration %d was restored with %d copies missing (owners %s); re-creating them "
                "in the background (%.1f MiB) so a further failure loses nothing",
                iteration,
                metrics.copies,
                rank_ranges(sorted({r.owner for r in plan.repairs})),
                metrics.bytes / (1 << 20),
            )
        self._schedule_heal(
            lambda: self._replicator.repair(iteration, plan.repairs), metrics, bool(plan.unrepairable)
        )

    def _heal_parity(self, holdings, iteration: int) -> None:
        """Parity: the parity files of ``iteration`` no store holds (members rebuilt from
        parity lost theirs) are coded again by their holders, the group's members sending their
        blocks, so a further loss in the group is tolerated before the next save."""
        held = holdings.parity_at(iteration)
        missing = [r for g in self.parity_groups for r in g.members if r not in held]
        if not missing:
            return
        sizes = holdings.parity_block_sizes(iteration)
        block = max(sizes.values(), default=0)
        metrics = HealMetrics(
            iteration=iteration, copies=len(missing), bytes=block * self.parity_groups[0].m * len(missing)
        )
        if self.rank == 0:
            logger.warning(
                "iteration %d was restored with the parity of ranks %s missing; coding it again in the background",
                iteration,
                rank_ranges(missing),
            )
        self._schedule_heal(lambda: self._replicator.repair(iteration, missing), metrics, False)

    def _schedule_heal(
        self, work: Callable[[], ReplicationResult], metrics: HealMetrics, partial: bool
    ) -> None:
        future = self._worker.submit(self._heal, work, metrics, time.perf_counter(), partial)
        self._healing = future
        with self._lock:
            self._in_flight.append((-1, future))

    def _heal(self, work, m: HealMetrics, t0: float, partial: bool) -> HealMetrics:
        error: Optional[BaseException] = None
        try:
            res = work()
            m.bytes_in, m.bytes_out = res.bytes_in, res.bytes_out
        except Exception as e:
            error = e
        try:
            agreed = collectives.all_agree(error is None, self._group)
        except Exception as e:
            agreed, error = False, error or e
        if not agreed:
            self._failures.add()  # every rank's agreement said so: the groups renew (manager.groups)
        m.seconds = time.perf_counter() - t0
        m.whole = agreed and not partial
        self.last_heal_metrics = m
        if m.whole:
            if self.rank == 0:
                logger.warning(
                    "redundancy of iteration %d is whole again: %d copies (%.1f MiB) re-created in %.2fs",
                    m.iteration,
                    m.copies,
                    m.bytes / (1 << 20),
                    m.seconds,
                )
        else:
            logger.warning(
                "redundancy of iteration %d not restored (%s); the next complete save restores "
                "it — until then one more failure may lose progress",
                m.iteration,
                error or f"no copy left of owners {rank_ranges(list(m.unrepairable))}",
            )
        return m

    def wait_healed(self, timeout: Optional[float] = None) -> Optional[HealMetrics]:
        """Block until the healing that followed the last restore finished; its metrics
        (``whole``: every copy is back), or None if no healing was needed."""
        if self._healing is None:
            return None
        return self._healing.result(timeout)
