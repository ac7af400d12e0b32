"""The manager's process groups, and their renewal after a failure (a mixin of
``CheckpointManager``).

A gloo group whose operation timed out or whose connection dropped is dead for good: its pairs
are closed ("Application timeout caused pair closure") and every later operation on it fails
at once. A partition that outlasts ``timeout_s`` in the middle of a save or a restore does
exactly that, so without renewal no save would ever complete again after the link came back.

Renewal replaces every group the manager made (data, control, parallel: ``dist.new_group`` on
the calling thread, in one fixed order, so every rank creates the same groups in the same
sequence) and rebuilds the transport and the replicator on them. ``new_group`` is collective:
a rank that renews while another does not waits in its rendezvous while the other waits in a
collective of the old groups, and neither returns. So **whether to renew is decided only from
facts every rank holds alike** — the outcome of a checkpoint call, which the fail-together
rule makes the same on every rank — never from what a rank's own exception says (the culprit
of a failure sees its own error, the bystanders a ``PeerFailedError`` naming it: their texts
differ, their outcome does not).

The rule: at the start of ``save_local`` / ``load_local`` / ``find_latest`` / ``load`` (the
outermost call), after the saves in flight drained, every rank renews iff checkpoint calls
failed since the last renewal (:class:`FailureCount`), counted where each failure is agreed:

* **calls on the calling thread** (restores, ``find_latest``, a save's preparation vote, the
  renewal check itself) fail on every rank together — a rank whose part failed still takes
  part in the step's vote, so every rank raises at the same call (a collective that timed out
  or lost its peer raises on every rank of it too). Each counts its failure as it raises;
  every rank has counted it before its next call starts, so that call renews first, with no
  collective at all — the one that failed may have closed its group's pairs (a vote that timed
  out: every later operation on the control group fails at once, so asking it whether to
  renew failed every save after, for good);
* **saves** finish on the save thread with one agreement all-reduce, which says on every rank
  alike whether the save completed; a save that did not (the agreement said no, or could not
  be reached) counts, on every rank, whichever part failed — including the stand-in job of a
  rank whose own staging failed (``SavePath._fail_save``), which still votes. A restore drains
  the save thread first, so every rank compares the same count; ``save_local`` does not wait
  for the saves in flight, so it takes the MIN of the ranks' counts (a rank whose save thread
  is still finishing the failed save lags, and the renewal comes a call later on every rank
  together) — in the save's own structure vote, the one all-reduce a cached save makes on the
  calling thread, and renews after it, before the save uses the groups; only a save that does
  not vote (a caller-built tensor-aware state dict, queued) takes the MIN in an all-reduce of
  its own first;
* a healing whose agreement did not say whole counts the same way.

Every failure renews, whatever caused it: a failure that broke no connection (a state function
raising, a template that does not match) costs one renewal (three ``new_group`` rendezvous,
milliseconds) at the next call, which is the price of never asking a rank whose groups may be
dead whether they are. A renewal that cannot complete (the partition is still there:
``new_group`` times out after ``timeout_s``) fails that call on every rank, which counts, and
is tried again at the next one. What no rule can make agree is a collective that completes on
some ranks and fails on others (the link cut between the two halves of its last exchange):
one side then counts a failure the other does not see, and the groups keep failing with
timeouts until the job restarts (docs/architecture.md, "Process groups and failing together").
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional

import torch.distributed as dist

from ..errors import CheckpointingException, CollectiveTimeoutError
from ..parallel import collectives
from ..replication.parity_peer import ParityReplicator
from ..replication.peer import PeerReplicator
from ..replication.transport import P2PTransport, new_checkpoint_group, release_checkpoint_group
from ..thread_pools import new_threads_lowered

logger = logging.getLogger(__name__)

#: the manager's transport chunk: a save's replica leaves chunk by chunk as it is staged, so
#: the first byte waits for one chunk's copy, not the whole segment's (issue 34); two rounds
#: in flight keep the link busy from 1 to 25 Gbit/s at this size
REPLICATION_CHUNK_BYTES = 16 << 20


class SaveWorker(ThreadPoolExecutor):
    """The save thread (``resilient_ckpt-save``): saves, their agreement, healing. It keeps
    the training thread's priority (``background_nice`` lowers the threads it hands the heavy
    work to): the training thread waits for it at times — a dropped save's settling, a third
    queued save, closing — and a lowered one would make it wait longer on busy cores."""

    def __init__(self) -> None:
        super().__init__(max_workers=1, thread_name_prefix="resilient_ckpt-save")


class FailureCount:
    """Checkpoint calls that failed, counted alike on every rank (the module docstring says
    where each kind is counted). Two threads add to it: the calling thread and the save
    thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._value = 0

    def add(self) -> None:
        with self._lock:
            self._value += 1

    @property
    def value(self) -> int:
        with self._lock:
            return self._value


class GroupRenewal:
    """Creates the manager's groups and renews them after a failure (see the module docstring)."""

    def _make_groups(self) -> None:
        """Every group the manager uses (collective: every rank, the same order)."""
        # Its gloo threads move replicas in the background: below training (``background_nice``;
        # the control group's keep their priority: the calling thread waits for its votes).
        with new_threads_lowered(self.background_nice):
            self._group = new_checkpoint_group(self.replication_backend, timeout_s=self.timeout_s)
        # Collectives of the calling thread (votes, holdings, distribution, restore) run on a
        # group of their own: the save thread may be in the middle of the previous save's
        # exchange on the data group, and two threads must never interleave on one group.
        self._control = new_checkpoint_group(self.replication_backend, timeout_s=self.timeout_s)
        self._par_group = self._mirror_parallelization_group()

    def _make_replicator(self) -> None:
        """The transport on the data group, and (embedded mode) the replicator on it."""
        self._transport = P2PTransport(
            self._group, chunk_bytes=REPLICATION_CHUNK_BYTES, timeout=self.timeout_s
        )
        if self._replicator is None or isinstance(self._replicator, (PeerReplicator, ParityReplicator)):
            if self.parity_groups:
                self._replicator = ParityReplicator(
                    self._transport, self.parity_groups, self.store, self.rank, fault=self._fault
                )
            else:
                self._replicator = PeerReplicator(
                    self._transport, self.placement, self.store, self.rank, nice=self.background_nice
                )

    # ---- renewal -------------------------------------------------------------------------------

    def _entered(self) -> bool:
        """Count one more manager call on this thread; True for the outermost."""
        depth = getattr(self._calls, "depth", 0)
        self._calls.depth = depth + 1
        return depth == 0

    def _left(self) -> None:
        self._calls.depth -= 1

    def _failed_together(self) -> None:
        """Count a failure that every rank raises at the same call (see the module docstring)."""
        self._failures.add()
        self._calls_failed += 1

    def _guarded(
        self, method, *args, drain: bool = True, counts_failure: bool = True, check: bool = True, **kwargs
    ) -> Any:
        """Run a collective manager call with the renewal check first (outermost call only;
        ``drain``: the call waits for the saves in flight anyway, so the check does first;
        ``check=False``: the call carries the check in a vote of its own, see
        :meth:`_renew_groups_after_vote`). ``counts_failure``: the call raises on every rank
        together when it fails, so its failure counts here (``save_local`` counts its own: a
        rank whose staging failed raises alone, and the save's agreement counts that save on
        every rank)."""
        outer = self._entered()
        try:
            if outer:
                # The last background vote's answer (manager.saving) first: a failure it reports
                # counts here, at the same call on every rank, and renews below.
                self._settle_vote()
                try:
                    if drain:
                        self.wait_for_saves()
                    if not self._renew_if_calls_failed() and check:
                        self._renew_groups_if_due(drained=drain)
                except BaseException:
                    self._failed_together()  # the check's all-reduce or the renewal: every rank
                    raise
            try:
                return method(*args, **kwargs)
            except BaseException:
                if outer and counts_failure:
                    self._failed_together()
                raise
        finally:
            self._left()

    def _renew_if_grown(self, failed: int, renewed_after: int) -> bool:
        """Renew if the count ``failed`` (of failures counted alike on every rank) grew past
        ``renewed_after``, its value at the last renewal. True if the groups were renewed."""
        if self._group is None or self.world_size == 1 or failed <= renewed_after:
            return False  # (no group yet: first use creates them)
        self._renew_groups(f"{failed - renewed_after} checkpoint call(s) failed on every rank")
        return True

    def _renew_if_calls_failed(self) -> bool:
        """Renew at once if a call on this thread failed since the last renewal: every rank
        counted it at the same call, so every rank knows without a collective — and the
        collective that failed may have taken its group down with it (a vote that timed out:
        every later operation on that group fails at once, so a check on it would fail every
        call after, for good). True if the groups were renewed."""
        return self._renew_if_grown(self._calls_failed, self._renewed_after_calls)

    def _renew_groups_after_vote(self, failed: Optional[int]) -> bool:
        """The renewal check a save's vote carried (``failed``: the lowest count of failed calls
        over the ranks, None if the save did not vote): renew now, before the save uses the
        groups, if it grew since the last renewal — decided from the vote, so on every rank
        alike. A renewal that fails counts and raises on every rank, as the check's does.
        True if the groups were renewed."""
        if failed is None:
            return False
        try:
            return self._renew_if_grown(failed, self._renewed_after_failures)
        except BaseException:
            self._failed_together()
            raise

    def _renew_groups_if_due(self, drained: bool) -> None:
        if self._group is None or self.world_size == 1:
            return  # first use creates them (and no check runs on a group not made yet)
        failed = self._failures.value
        if not drained:  # saves may still be finishing: every rank takes the lowest count
            failed = collectives.all_reduce_int(failed, "min", self._control)
        self._renew_if_grown(failed, self._renewed_after_failures)

    def _own_groups(self) -> list:
        """The groups this manager made (each once: the parallel group may be the control)."""
        return list(
            {id(g): g for g in (self._group, self._control, self._par_group) if g is not None}.values()
        )

    def _release_groups(self) -> None:
        """On close: destroy the manager's groups (their threads and connections go with them)."""
        for g in [*self._own_groups(), self._dcp_group]:
            release_checkpoint_group(g)
        self._group = self._control = self._par_group = self._dcp_group = None

    def dcp_process_group(self):
        """A gloo group of every rank for PyTorch DCP's own planning collectives, to pass as
        ``dcp.async_save(..., process_group=...)`` (``MemoryStorageWriter.process_group`` and
        ``resilient_ckpt.dcp.async_save`` do). DCP's async thread must not run its collectives
        on the default group while the training loop's (DDP's backward) run there: two threads
        on one group pair up each other's messages and both wait forever. Made on the first
        call — collective, so every rank calls it at the same point, as it builds its writer —
        and kept until :meth:`close`: group renewal never replaces it, since DCP may hold it
        across the manager calls of one save. None when torch.distributed is not initialized."""
        if self._dcp_group is None and dist.is_initialized():
            self._dcp_group = new_checkpoint_group("gloo", timeout_s=self.timeout_s)
        return self._dcp_group

    def _renew_groups(self, why: str) -> None:
        """Drain the save thread, replace every group, note the failures now counted."""
        self.wait_for_saves()
        old = self._own_groups()
        try:
            self._make_groups()
            self._make_replicator()
        except CheckpointingException:
            raise
        except Exception as e:  # torch's own (a DistStoreError from the rendezvous): named here
            cls = CollectiveTimeoutError if "timeout" in str(e).lower() else CheckpointingException
            raise cls(
                f"renewing the checkpoint process groups failed ({type(e).__name__}: "
                f"{str(e)[:300]}): a rank did not join within timeout_s={self.timeout_s:g} s — it "
                "died, is frozen or unreachable. Checkpoint calls fail until it is back (each "
                "call tries again) or the job restarts with its membership settled"
            ) from e
        for g in old:
            release_checkpoint_group(g)
        self._renewed_after_failures = self._failures.value  # drained: the same on every rank
        self._renewed_after_calls = self._calls_failed
        if self.rank == 0:
            logger.warning("checkpoint process groups renewed (%s)", why)

    # ---- the collective calls ------------------------------------------------------------------

    def save_local(
        self,
        state_dict: Any,
        iteration: int,
        is_async: bool = True,
        skip_if_busy: bool = False,
        vote_in_background: bool = False,
    ):
        # A save that votes (a plain state dict's, or any skip-if-busy save) carries the renewal
        # check in that vote: one all-reduce on the training thread instead of two.
        votes = skip_if_busy or self._kind != "tasd"
        handle = self._guarded(
            super().save_local,
            state_dict,
            iteration,
            True,
            skip_if_busy,
            vote_in_background,
            drain=False,
            counts_failure=False,
            check=not votes,
        )
        if not is_async and handle is not None:
            # Waited for outside the guard: a failed save counts through its agreement.
            handle.wait_staged()
            handle.wait()
        return handle

    def load_local(self, template: Optional[Any] = None, **kwargs):
        return self._guarded(super().load_local, template, **kwargs)

    def find_latest(self) -> int:
        return self._guarded(super().find_latest)

    def load(self):
        return self._guarded(super().load)
