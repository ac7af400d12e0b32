"""The save thread's side of ``CheckpointManager``'s saves (a mixin of it, under
:class:`~.saving.SavePath`; the state lives on the manager).

``_finish_save`` runs one job per ``save_local`` call, in order, on the save thread: wait for
the copies, checksum, publish, replicate (sealed replicas: checksums computed while the bytes
are on the wire), agree on every rank in one all-reduce, then complete — retention, the next
segment made ahead, the persistent tier's flush. A rank whose save failed before it started
still takes part (``_fail_save``: empty replicas, refusals, a "no" vote), so peers learn at
once. Also here: retirement of old checkpoints and segments, and ``wait_for_saves``.

Why retention waits for a second, confirming all-reduce: the agreement's answer can reach some
ranks and not others (a node lost between the two halves of its last exchange). A rank that
did not get it must treat the save as failed and discards its copy; had a rank that got "yes"
retired the previous iteration on that answer alone, neither iteration would be whole. A rank
retires only once every rank has confirmed that it heard "yes" — and one that did not hear it
never confirms — so whatever a rank discards, the previous iteration is still there.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator, List, Optional

from ..errors import CheckpointingException, ReplicationError, StoreError
from ..gc_pause import paused_gc
from ..memory import checksum, pinning
from ..memory.layout import CheckpointHeader, CheckpointId, ParityId, new_layout
from ..memory.segment import Segment
from ..memory.staging import StagingHandle
from ..parallel import collectives
from ..replication.replicator import SealingReplicator
from .metrics import SaveMetrics

logger = logging.getLogger(__name__)


#: how many times slower than the copies into the segment the last save's replication must
#: have been for the next one to send while staging (see SavePath._sends_while_staging)
WIRE_SLOWER_TO_SEND_WHILE_STAGING = 10


@dataclass
class _SaveJob:
    iteration: int
    segment: Optional[Segment]  # None until staging has reserved it (a device snapshot's)
    header: CheckpointHeader
    staging: StagingHandle
    metrics: SaveMetrics
    t_start: float
    #: a save that started before the ranks voted (``vote_in_background``): goes on only if
    #: every rank was ready with its cache's structure
    vote: Optional[collectives.PendingVotes] = None


@dataclass
class _Outcome:
    """This rank's side of a save before the agreement."""

    ok: bool = False
    error: Optional[BaseException] = None
    #: replicas this save published in the node's store (discarded if not agreed)
    received: List[CheckpointId] = field(default_factory=list)


@contextlib.contextmanager
def _timed(metrics: SaveMetrics, field_name: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        setattr(metrics, field_name, time.perf_counter() - t)


def _own_part(out: "_Outcome") -> str:
    """This rank's side of a failed save, for its error: its own failure, or — its part went
    well — why the agreement failed (a peer unreachable: the vote timed out) if it raised."""
    if not out.ok:
        return repr(out.error)
    return "ok" if out.error is None else f"ok, but the agreement with the other ranks failed: {out.error!r}"


def _with_checksums(header: CheckpointHeader, segment: Segment) -> CheckpointHeader:
    if not header.data_nbytes:
        return header
    mv = checksum.byte_view(segment.buffer)
    digest = checksum.digest
    with paused_gc():  # one layout per tensor, all kept (see gc_pause)
        tensors = tuple(
            new_layout(l.offset, l.nbytes, l.dtype, l.shape, digest(mv[l.offset : l.offset + l.nbytes]))
            for l in header.tensors
        )
    return replace(header, tensors=tensors)


class SaveCompletion:
    """The save thread's job and retirement (mixed into ``CheckpointManager`` through
    :class:`~.saving.SavePath`)."""

    #: replicas leave chunk by chunk while the rest is being copied (True), after every copy
    #: (False), or where the wire is much slower than the copies (None, see
    #: ``_sends_while_staging``)
    send_while_staging: Optional[bool] = None
    _replicated_bps: float = 0.0  # the last save's replication rate
    _staged_bps: float = 0.0  # the last save's copy rate into its segment

    def _fail_save(self, iteration, group, error: BaseException) -> None:
        """Tell the peers at once: an empty replica to every holder, refuse incoming replicas,
        vote no. Nothing is discarded here (this rank created nothing for the save). Counted
        as a failed save, as the peers' agreement counts it (manager.groups)."""
        if group is not None:
            try:
                self._replicate_nothing()
            except Exception as e:  # expected: our refusals come back as an error
                logger.debug("failed save of iteration %s: exchange: %s", iteration, e)
            try:
                collectives.all_agree(False, group)
            except Exception as e:
                logger.debug("failed save of iteration %s: agreement: %s", iteration, e)
        self._failures.add()

    def _replicate_nothing(self) -> None:
        if self._replicator is not None:
            self._replicator.abstain()

    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point)

    def _finish_save(self, job: _SaveJob, group) -> SaveMetrics:
        """The save thread's job: store and replicate, agree on every rank, then retire."""
        if job.vote is not None and not self._voted_on(job):
            return job.metrics  # dropped on every rank (a rank was busy or its structure changed)
        outcome = self._store_and_replicate(job, group)
        agreed = self._agree(job, group, outcome)
        m = job.metrics
        m.durable_s = time.perf_counter() - job.t_start
        if not agreed:
            self._failures.add()  # on every rank alike: the agreement said so (manager.groups)
            if job.segment is not None:
                job.segment.close()
            self._discard_failed(job.iteration, outcome.received)
            raise CheckpointingException(
                f"local checkpoint of iteration {job.iteration} is not complete on every rank "
                f"(this rank: {_own_part(outcome)}); the previous complete "
                f"iteration {self._complete[-1] if self._complete else 'none'} stays loadable"
            ) from outcome.error
        self._note_rates(job)
        confirmed = self._confirm(job, group)
        self._fault("after_confirmation")
        self._complete_save(job, confirmed)
        return m

    def _voted_on(self, job: _SaveJob) -> bool:
        """A save that started before its vote: the answer, before anything reaches a peer.
        True: every rank goes on. Else the save is dropped here on every rank alike — its
        copies are let finish and its segment goes back to the pool — and counted skipped, or
        (the vote failed) raised; the calling thread counts that failure at its next call."""
        try:
            holds, ready, _least = job.vote.result()
            error = None
        except BaseException as e:
            holds, ready, error = False, False, e
        if holds and ready:
            return True
        self._fault("before_drop")
        self._release_once_copied(job.staging, job.segment, job.iteration)
        if error is not None:
            raise CheckpointingException(
                f"local checkpoint of iteration {job.iteration} was dropped on every rank: {error}"
            ) from error
        job.metrics.skipped = True
        with self._lock:
            self.saves_skipped += 1
        return False

    def _release_once_copied(
        self, staging: Optional[StagingHandle], segment: Optional[Segment], claimed: Optional[int] = None
    ) -> None:
        """A save that will not be stored: its segment back once its copies stopped using it
        (a failed copy changes nothing here). ``claimed``: its iteration, the segment claimed
        under it (a save the vote dropped) — kept mapped as the next save's spare, as a retired
        one is: back in the pool it would be mapped and populated again on the calling thread
        of the next save (~10 ms at 66 MiB)."""
        if staging is not None:
            try:
                staging.wait()
            except Exception as e:
                logger.debug("copies of a save given up: %s", e)
            segment = segment or staging.segment()
        if segment is None:
            return
        if claimed is not None and self.spare_segment:
            cid = CheckpointId(claimed, self.rank, self.session_id)
            if self.store.unpublish_mapped(cid, segment) and self._prefetcher.adopt(segment):
                self._prefetcher.wait_prepared()  # (as a completed save's job: see _complete_save)
                return
        self.store.release(segment)

    def _store_and_replicate(self, job: _SaveJob, group) -> "_Outcome":
        """Wait for the copies, checksum, publish, replicate — timed stage by stage. A failure
        is kept for the agreement (peers must not be left waiting), and a rank that failed
        before replicating still takes part in the exchange (empty replicas, refusals)."""
        m, out = job.metrics, _Outcome()
        replicating = False
        try:
            if self._seals_replicas():
                # The checksums are computed while the bytes are on the wire (and, where the
                # wire is much slower than the copies, the bytes leave as they are staged): the
                # peers get an announcement first and the final header behind the payload; this
                # node's own copy is published once the checksums are known (issue 34).
                early = self._sends_while_staging()
                with _timed(m, "staging_s"):  # early: the segment only, its copies go on
                    if not early:
                        job.staging.wait()
                    job.segment = job.staging.segment()
                    if job.segment is None:
                        job.staging.wait()  # raises why it could not be reserved
                sums = self._checksummer.submit(
                    self._checksums_once_staged, job.staging, job.header, job.segment
                )
                with _timed(m, "replication_s"):
                    self._fault("before_replication")
                    replicating = True
                    out.received = self._replicate(
                        job.header,
                        job.segment,
                        m,
                        seal=sums.result,
                        ready=job.staging.wait_prefix if early else None,
                    )
                with _timed(m, "checksum_s"):  # what was left of them after the transfer
                    header = sums.result()
                with _timed(m, "publish_s"):
                    self.store.publish(job.segment, header)
                self._fault("after_publish")
            else:
                with _timed(m, "staging_s"):
                    job.staging.wait()
                    job.segment = job.staging.segment()
                self._fault("after_staging")
                with _timed(m, "checksum_s"):
                    header = _with_checksums(job.header, job.segment)
                with _timed(m, "publish_s"):
                    self.store.publish(job.segment, header)
                self._fault("after_publish")
                with _timed(m, "replication_s"):
                    self._fault("before_replication")
                    replicating = True
                    out.received = self._replicate(header, job.segment, m)
            self._fault("after_replication")
            self._check_published([header.id, *out.received])
            out.ok = True
        except BaseException as e:  # reported after agreement, so peers are not left waiting
            out.error = e
            logger.warning("save of iteration %d failed on rank %d: %s", job.iteration, self.rank, e)
        if not replicating and group is not None:
            # So holders and sources learn now instead of after the transport timeout.
            try:
                self._replicate_nothing()
            except Exception as e:
                logger.debug("failed save of iteration %d: exchange: %s", job.iteration, e)
        return out

    def _check_published(self, cids: List[CheckpointId]) -> None:
        """Read back what this rank is about to vote complete: a write that failed silently
        (a full or misbehaving file system, a lost rename) must fail the save on every rank,
        not surface as a missing copy at restore time. (Existence only: parsing a header of
        50k tensors costs more than the rest of the check is worth.)"""
        for cid in cids:
            path = self.store.header_path(cid)
            if not (path.is_file() and path.stat().st_size > 0):
                raise StoreError(
                    f"{path} is missing after it was published: the store's file system lost the "
                    "write; check free space and errors of /dev/shm (dmesg)"
                )

    def _agree(self, job: _SaveJob, group, out: "_Outcome") -> bool:
        """One all-reduce: complete on every rank or not (a failing rank still votes)."""
        with _timed(job.metrics, "agreement_s"):
            try:
                self._fault("before_agreement")
            except BaseException as e:  # still vote (no), so peers are not left waiting
                out.ok, out.error = False, out.error or e
            try:
                agreed = collectives.all_agree(out.ok, group) if group is not None else out.ok
                self._fault("after_agreement")
                return agreed
            except Exception as e:
                out.error = out.error or e
                return False

    def _confirm(self, job: _SaveJob, group) -> bool:
        """The second all-reduce (module docstring): did every rank hear the agreement's "yes"?
        False (logged) when it cannot be reached; the save is complete all the same, only its
        retention waits for a later save."""
        if group is None:
            return True
        with _timed(job.metrics, "confirmation_s"):
            try:
                return collectives.all_agree(True, group)
            except Exception as e:
                logger.warning(
                    "iteration %d is complete, but not every rank confirmed hearing so (%s): older "
                    "iterations are kept until a later save is confirmed, in case a rank that did "
                    "not hear it discarded its copy",
                    job.iteration,
                    e,
                )
                return False

    def _complete_save(self, job: _SaveJob, confirmed: bool) -> None:
        """After the agreement: persistent flush (every M saves), retention (once ``confirmed``:
        see the module docstring), next segment."""
        self._complete.append(job.iteration)
        # Kept mapped (and page-locked, GPU state) while retained: retired, it becomes the
        # spare as it is, so a steady run maps and locks nothing (see _retire).
        self._own_segments[job.iteration] = job.segment
        if self._prefetcher.pin:
            job.segment.pin()  # on the save thread, off the training loop's path; once
        if self._tier is not None:
            # Every rank reaches this at the same save (after the agreement), so the tier's
            # collective flush rounds pair up.
            try:
                self._tier.maybe_flush(self.store, job.iteration)
            except Exception as e:
                logger.warning("persistent flush after iteration %d not started: %s", job.iteration, e)
        try:
            if confirmed:
                self._retire()
        except OSError as e:  # the save itself is complete; retiring is retried next time
            logger.warning("could not retire old checkpoints in %s: %s", self.store.dir, e)
        structure = self._structure
        cache = structure.snapshot if structure is not None else None
        plan = cache.plan if cache is not None and cache.total == job.header.data_nbytes else None
        try:
            job.metrics.store_bytes = self.store.store_bytes()
        except OSError as e:
            logger.debug("store bytes not measured: %s", e)
        if self.spare_segment:
            self._prefetcher.prefetch(job.header.data_nbytes, plan)
            # The save's job ends with the next one's segment ready: a save due meanwhile is
            # skipped (or queued) as behind any save in flight, instead of waiting for that
            # segment on the calling thread (the prefetcher runs below training's priority).
            self._prefetcher.wait_prepared()
        job.metrics.pinned_held_bytes = pinning.held_bytes()
        self.last_save_metrics = job.metrics
        logger.debug("saved iteration %d: %s", job.iteration, job.metrics.as_dict())

    def _checksums_once_staged(
        self, staging: StagingHandle, header: CheckpointHeader, segment: Segment
    ) -> CheckpointHeader:
        """The final header (sealed replicas): after the last copy, the checksums. A failed
        copy (or fault) fails the seal: the receivers drop the replica and name this rank."""
        staging.wait()
        self._fault("after_staging")
        return _with_checksums(header, segment)

    def _sends_while_staging(self) -> bool:
        """Whether a replica's chunks leave while the rest of it is still being copied
        (``send_while_staging``; None: decided from the previous save). Sending takes CPU in
        proportion to the link's rate, and during the copies — what the training loop waits
        for — that CPU is theirs: it pays where the wire is much slower than the copies
        (:data:`WIRE_SLOWER_TO_SEND_WHILE_STAGING` times or more; what it saves is the copies'
        time), and on a fast link it mostly slows the copies down. Measured on this project's
        2-core machine: at 1 Gbit/s (64 MiB, the wire ~25x slower than the copies) time to
        durable fell from 1.19-1.32x to 1.16-1.19x the link limit; on loopback (256 MiB, ~6x)
        the save's stall doubled, 0.06-0.09 -> 0.15-0.17 s, for 0.05 s of durable."""
        if self.send_while_staging is not None:
            return bool(self.send_while_staging)
        wire, copies = self._replicated_bps, self._staged_bps
        return bool(wire and copies and copies >= WIRE_SLOWER_TO_SEND_WHILE_STAGING * wire)

    def _note_rates(self, job: "_SaveJob") -> None:
        """The last save's copy and send rates (bytes per second), for _sends_while_staging."""
        m, staging = job.metrics, job.staging
        if m.replication_s > 0 and m.bytes_replicated_out:
            self._replicated_bps = m.bytes_replicated_out / m.replication_s
        if staging.finished is not None and staging.finished > staging.started and m.bytes_staged:
            self._staged_bps = m.bytes_staged / (staging.finished - staging.started)

    def _seals_replicas(self) -> bool:
        """Whether this save's replicas go out before their checksums are known (peers over
        the transport, sealed behind the payload); the daemon and parity shares take the
        final header up front."""
        if not isinstance(self._replicator, SealingReplicator) or not self._replicator.seals_replicas:
            return False
        return bool(self.placement.holders_of(self.rank) or self.placement.sources_for(self.rank))

    def _replicate(
        self,
        header: CheckpointHeader,
        segment: Segment,
        m: SaveMetrics,
        seal: Optional[Callable[[], CheckpointHeader]] = None,
        ready: Optional[Callable[[int], None]] = None,
    ) -> List[CheckpointId]:
        """Hand the checkpoint to the replicator (peers or the node daemon); ``seal`` and
        ``ready``: see :class:`~..replication.replicator.SealingReplicator`."""
        if self._replicator is None:
            if self.placement.holders_of(self.rank) or self.placement.sources_for(self.rank):
                raise ReplicationError("replication needs an initialized process group")
            return []
        if seal is not None:
            result = self._replicator.replicate(header, segment, seal=seal, ready=ready)
        else:
            result = self._replicator.replicate(header, segment)
        m.bytes_replicated_out = result.bytes_out
        m.bytes_replicated_in = result.bytes_in
        encoded = getattr(self._replicator, "last_encode", None)
        if encoded is not None:
            m.parity_encode_s, m.parity_coded_bytes = encoded.seconds, encoded.nbytes
        return result.received

    def _discard_failed(self, iteration: int, received: List[CheckpointId]) -> None:
        """Remove what this save created: its own checkpoint and the replicas it published
        (not other ids of that iteration, which may predate this save)."""
        self.store.discard(CheckpointId(iteration, self.rank, self.session_id))
        for cid in received:
            self.store.discard(cid)

    def _retire(self) -> None:
        """Keep the newest ``keep_last`` complete iterations and anything newer (in flight);
        retired segments go to the free pool (with ``keep_last=1`` only the node's own)."""
        kept = sorted(set(self._complete))[-self.keep_last :]
        self._complete = kept
        threshold = kept[0]
        if self._tier is not None:
            # A flush reading an older iteration from the store keeps it alive until done.
            threshold = min([threshold, *self._tier.pinned_iterations()])
        # keep_last=1 with a spare: retired replicas and parity are pooled too, so the next
        # ones land in populated pages (fresh tmpfs pages cost ~10x a memcpy: durable 0.44 ->
        # 0.27 s at 256 MiB on 2 cores) — the pool holds what the next save claims anyway, so
        # the store's peak is unchanged. Without a spare (the least memory) they are freed.
        lean = self.keep_last == 1 and not self.spare_segment
        p = self.placement
        for it in [it for it in self._own_segments if it < threshold]:
            self._retire_own(it, self._own_segments.pop(it))
        for cid in self.store.list():
            if cid.iteration < threshold and self._is_ours(cid):
                own = cid.owner < self.world_size and p.node_of(cid.owner) == p.node_of(self.rank)
                if own and cid.owner != self.rank:
                    continue  # its owner, a rank of this node, retires it (it may hold it mapped)
                self.store.discard(cid, recycle=not lean)
        for pid in self.store.list_parity():
            if pid.iteration < threshold and self._is_ours_parity(pid):
                self.store.discard(pid, recycle=not lean)
        if getattr(self, "_elastic_from", None) is not None:
            self._retire_resharded(threshold)

    def _close_own_segments(self, newer_than: int = -1) -> None:
        """Unmap this rank's kept segments of iterations above ``newer_than`` (all by default):
        the manager closes, or a restore abandons them; their files are the store's business."""
        for it in [it for it in self._own_segments if it > newer_than]:
            self._own_segments.pop(it).close()

    def prepare_next_segment(self, nbytes: int, gpu: bool) -> None:
        """GPU state: have the next save's segment (``nbytes``) made and page-locked ahead, on
        the prefetcher's thread (after a restore: the restored state's size is the next
        save's, usually), so locking never sits on a save's path. CPU state is left as it
        is: its first save populates its own pages (a prefetch here would compete with the
        other ranks' restores for the cores)."""
        if not gpu:
            return
        self._prefetcher.pin = True
        if self.spare_segment and nbytes:
            self._prefetcher.prefetch(nbytes)

    def _retire_own(self, iteration: int, segment: Segment) -> None:
        """This rank's retired checkpoint: its segment, still mapped (and locked), becomes the
        next save's spare as it is; else it goes to the pool, or (``keep_last=1``) is freed."""
        cid = CheckpointId(iteration, self.rank, self.session_id)
        recycle = self.keep_last > 1
        if self.spare_segment and self.store.unpublish_mapped(cid, segment):
            if not self._prefetcher.adopt(segment):
                self.store.release(segment, recycle=recycle)
            return
        segment.close()
        self.store.discard(cid, recycle=recycle)

    def _retire_resharded(self, threshold: int) -> None:
        """After a resharded restore, the saving job's world-size checkpoints are this job's
        past: retired like its own once a newer iteration is complete."""
        for cid in self.store.list():
            if cid.iteration >= threshold:
                continue
            try:
                if self.store.read_header_any_world(cid).world_size == self._elastic_from:
                    self.store.discard(cid, recycle=False)
            except (StoreError, OSError) as e:
                logger.debug("not retiring %s: %s", cid.stem(), e)

    def _is_ours_parity(self, pid: ParityId) -> bool:
        try:
            return self.store.read_parity_header(pid)["world_size"] == self.world_size
        except (StoreError, OSError, KeyError, TypeError) as e:
            logger.debug("not retiring %s: %s", pid.stem(), e)
            return False

    def _is_ours(self, cid: CheckpointId) -> bool:
        """Deletions act only on checkpoints whose header names this session and world size:
        another job sharing the directory (same session id, another world) keeps its data."""
        try:
            self.store.read_header(cid)
            return True
        except (StoreError, OSError) as e:
            logger.debug("not retiring %s: %s", cid.stem(), e)
            return False

    def wait_for_saves(self) -> None:
        """Block until every queued save finished (errors are reported by their handles)."""
        with self._lock:
            futures = [f for _, f in self._in_flight]
        for f in futures:
            try:
                f.result()
            except Exception:
                pass
        with self._lock:
            self._in_flight.clear()
