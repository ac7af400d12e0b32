"""The manager's process groups, and their renewal after a failure (a mixin of
``CheckpointManager``).

A gloo group whose operation timed out or whose connection dropped is dead for good: its pairs
are closed ("Application timeout caused pair closure") and every later operation on it fails
at once. A partition that outlasts ``timeout_s`` in the middle of a save or a restore does
exactly that, so without renewal no save would ever complete again after the link came back.

Renewal replaces every group the manager made (data, control, parallel: ``dist.new_group`` on
the calling thread, in one fixed order, so every rank creates the same groups in the same
sequence) and rebuilds the transport and the replicator on them. It happens at the start of
``save_local`` / ``load_local`` / ``find_latest`` (the outermost call), after in-flight saves
drained, when every rank can tell it is due:

* this rank's previous manager call raised because a connection of a checkpoint group broke
  (:func:`broke_connections`: a collective or transfer timed out, a peer's connection
  dropped, or the peer whose failure every rank raises had one of those): such a call raises
  on every rank together (the fail-together rule), so every rank renews at its next call,
  asking nothing of the possibly broken control group first. A call that failed for another
  reason (a bad template, an encoding error on one rank) leaves the groups alone;
* a save-thread job failed on every rank since the last renewal. A restore (``load_local``,
  ``find_latest``, ``load``) drains the save thread first, so every rank counts the same failed
  saves (a save's outcome is agreed on every rank) and decides alone; ``save_local`` does not
  wait for the saves in flight, so it starts with one all-reduce (MIN) of this rank's count,
  every rank learns the same number and renews together (a rank whose save thread has not
  finished the failed save yet lags, and the renewal comes one call later).

A renewal that cannot complete (the partition is still there: ``new_group`` times out after
``timeout_s``) fails that call on every rank and is tried again at the next one.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Optional

from ..errors import (
    CollectiveTimeoutError,
    NoReplicaError,
    PeerFailedError,
    ReplicationError,
)
from ..parallel import collectives
from ..replication.parity_peer import ParityReplicator
from ..replication.peer import PeerReplicator
from ..replication.transport import P2PTransport, new_checkpoint_group, release_checkpoint_group

logger = logging.getLogger(__name__)


class SaveWorker(ThreadPoolExecutor):
    """The save thread (``resilient_ckpt-save``); counts the jobs that raised (failed saves)."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="resilient_ckpt-save")
        self._count_lock = threading.Lock()
        self.failed_jobs = 0

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = super().submit(fn, *args, **kwargs)
        future.add_done_callback(self._count)
        return future

    def _count(self, future: Future) -> None:
        if not future.cancelled() and future.exception() is not None:
            with self._count_lock:
                self.failed_jobs += 1


class GroupRenewal:
    """Creates the manager's groups and renews them after a failure (see the module docstring)."""

    def _make_groups(self) -> None:
        """Every group the manager uses (collective: every rank, the same order)."""
        self._group = new_checkpoint_group(self.replication_backend, timeout_s=self.timeout_s)
        # Collectives of the calling thread (votes, holdings, distribution, restore) run on a
        # group of their own: the save thread may be in the middle of the previous save's
        # exchange on the data group, and two threads must never interleave on one group.
        self._control = new_checkpoint_group(self.replication_backend, timeout_s=self.timeout_s)
        self._par_group = self._mirror_parallelization_group()

    def _make_replicator(self) -> None:
        """The transport on the data group, and (embedded mode) the replicator on it."""
        self._transport = P2PTransport(self._group, timeout=self.timeout_s)
        if self._replicator is None or isinstance(self._replicator, (PeerReplicator, ParityReplicator)):
            if self.parity_groups:
                self._replicator = ParityReplicator(
                    self._transport, self.parity_groups, self.store, self.rank, fault=self._fault
                )
            else:
                self._replicator = PeerReplicator(self._transport, self.placement, self.store, self.rank)

    # ---- renewal -------------------------------------------------------------------------------

    def _entered(self) -> bool:
        """Count one more manager call on this thread; True for the outermost."""
        depth = getattr(self._calls, "depth", 0)
        self._calls.depth = depth + 1
        return depth == 0

    def _left(self) -> None:
        self._calls.depth -= 1

    def _guarded(self, method, *args, drain: bool = True, **kwargs) -> Any:
        """Run a collective manager call with the renewal check first (outermost call only;
        ``drain``: the call waits for the saves in flight anyway, so the check does first);
        a call that raises on a broken connection marks this rank's groups for renewal."""
        outer = self._entered()
        try:
            if outer:
                if drain:
                    self.wait_for_saves()
                self._renew_groups_if_due(drained=drain)
            return method(*args, **kwargs)
        except BaseException as e:
            if outer and self._group is not None and broke_connections(e):
                self._renew_at_next_call = True
            raise
        finally:
            self._left()

    def _renew_groups_if_due(self, drained: bool) -> None:
        if self._group is None or self.world_size == 1:
            return  # first use creates them
        if self._renew_at_next_call:
            self._renew_groups("the previous checkpoint call failed")
            self._renew_at_next_call = False
            return
        failed = self._worker.failed_jobs
        if not drained:  # saves may still be finishing: every rank takes the lowest count
            failed = collectives.all_reduce_int(failed, "min", self._control)
        if failed > self._renewed_after_failures:
            self._renew_groups(f"{failed - self._renewed_after_failures} save(s) failed on every rank")

    def _own_groups(self) -> list:
        """The groups this manager made (each once: the parallel group may be the control)."""
        return list(
            {id(g): g for g in (self._group, self._control, self._par_group) if g is not None}.values()
        )

    def _release_groups(self) -> None:
        """On close: destroy the manager's groups (their threads and connections go with them)."""
        for g in self._own_groups():
            release_checkpoint_group(g)
        self._group = self._control = self._par_group = None

    def _renew_groups(self, why: str) -> None:
        """Drain the save thread, replace every group, agree on the failures now counted."""
        self.wait_for_saves()
        old = self._own_groups()
        self._make_groups()
        self._make_replicator()
        for g in old:
            release_checkpoint_group(g)
        self._renewed_after_failures = self._worker.failed_jobs  # drained: the same on every rank
        if self.rank == 0:
            logger.warning("checkpoint process groups renewed (%s)", why)

    # ---- the collective calls ------------------------------------------------------------------

    def save_local(self, state_dict: Any, iteration: int, is_async: bool = True):
        handle = self._guarded(super().save_local, state_dict, iteration, True, drain=False)
        if not is_async:
            # Waited for outside the guard: a failed save renews through the agreed count of
            # failed saves (a rank whose own part went well may not have seen the broken link).
            handle.wait_staged()
            handle.wait()
        return handle

    def load_local(self, template: Optional[Any] = None, **kwargs):
        return self._guarded(super().load_local, template, **kwargs)

    def find_latest(self) -> int:
        return self._guarded(super().find_latest)

    def load(self):
        return self._guarded(super().load)


#: What torch's gloo errors say when a connection timed out or dropped.
_LINK_WORDS = ("timed out", "timeout", "connection closed", "pair closure", "connection reset", "broken pipe")


def broke_connections(error: BaseException) -> bool:
    """Whether ``error`` (or what caused it) is a checkpoint group's connection failing: a
    collective or transfer that timed out or lost its peer — or, for a
    :class:`PeerFailedError`, the failure of the peer every rank names was one."""
    seen = set()
    e: Optional[BaseException] = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, PeerFailedError):
            reason = (e.reason or "").lower()
            return reason.startswith(("replicationerror", "collectivetimeouterror")) or any(
                w in reason for w in _LINK_WORDS
            )
        if isinstance(e, NoReplicaError):
            return False
        if isinstance(e, (CollectiveTimeoutError, ReplicationError, TimeoutError, ConnectionError)):
            return True
        text = str(e).lower()
        if isinstance(e, RuntimeError) and any(w in text for w in _LINK_WORDS):
            return True
        if "collective '" in text and "failed on a group" in text:
            return True
        e = e.__cause__ or e.__context__
    return False
