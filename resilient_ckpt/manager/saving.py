"""The save path of ``CheckpointManager`` (a mixin of it; the state lives on the manager).

``save_local`` (calling thread): build the state, vote if the step is collective, retire an
earlier run's data on the first save, build the tensor-aware state dict (distribution), lay
out and stage the copies into a store segment, queue the job. ``_finish_save`` (the save
thread, in stages: :mod:`.save_completion`): wait for the copies, checksum, publish,
replicate, agree, retire.
Every ``save_local`` call puts exactly one job on the save thread, also when preparing the
snapshot failed on this rank: jobs are numbered alike on every rank, which keeps collective
decisions (the cached distribution) in step.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

from ..errors import (
    IterationOrderError,
    ValidationError,
)
from ..gc_pause import paused_gc
from ..memory import pinning
from ..memory.layout import (
    CheckpointHeader,
    CheckpointId,
    ParityId,
    TensorLayout,
    plan_layout_runs,
    writer_name,
)
from ..memory.segment import Segment
from ..memory.staging import RunPlan, StagingHandle
from ..model.validation import object_record, row_record
from ..parallel import collectives
from ..parallel.distribution import ShardDistribution, fingerprint_records, structure_fingerprint
from ..parallel.hollow import HollowEncoding, encode_hollow
from ..parallel.opaque_state_dict import OpaqueStateDict
from ..parallel.snapshot import SnapshotParts, shard_fields, snapshot_parts
from ..parallel.template import preprocess, sharded_leaves
from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
from .metrics import SaveHandle, SaveMetrics
from .restore import gather_holdings
from .save_completion import SaveCompletion, _SaveJob

logger = logging.getLogger(__name__)


MAX_ITERATION = (1 << 63) - 1

#: Points where tests (and chaos drills) can inject a fault: ``fault_hook(point)``. With
#: ``redundancy="parity"`` the hook is also called at ``"parity_after_headers"`` (between the
#: parity group's header and block exchanges), a resharded restore at
#: ``"reshard_before_exchange"``, and a save the background vote dropped at ``"before_drop"``.
FAULT_POINTS = (
    "after_staging",
    "after_publish",
    "before_replication",
    "after_replication",
    "before_agreement",
)


@dataclass
class _SnapshotCache:
    """What a cached save of a plain state dict reuses: everything derived from its structure
    (its rows, skeleton and object records, which ``encoding`` and ``objects`` hold)."""

    encoding: HollowEncoding
    objects: List[tuple]  # the ShardedObjects' records (keys, offsets: validated with the rest)
    saved: Tuple[int, ...]  # the stored mask (``stored_mask``: 2 for a rank-local shard)
    layouts: List[TensorLayout]
    total: int
    #: the dense runs (the prefetcher makes their views ahead in the next segment) and what
    #: staging derived from the last save's tensors (kept while they are the same objects)
    plan: RunPlan
    #: the structure's raw skeleton and its shards' metadata (``shard_fields``: nothing of the
    #: caller's tensors or wrappers is held), and the last save's tensors' device types
    raw_skeleton: Any = None
    fields: List[tuple] = field(default_factory=list)
    devices: List[str] = field(default_factory=list)
    saved_index: List[int] = field(init=False)

    def __post_init__(self):
        self.saved_index = [i for i, s in enumerate(self.saved) if s]

    def covers(self, parts: SnapshotParts) -> bool:
        """``parts`` has exactly the structure this cache was made for: the same skeleton, every
        shard's metadata read at C speed (``shard_fields``) and every object's record equal."""
        return (
            parts.raw_skeleton == self.raw_skeleton
            and shard_fields(parts.shards) == self.fields
            and [object_record(o) for o in parts.objects] == self.objects
        )


@dataclass
class _StructureCache:
    """What the last general-path save established on this rank, in one collective round that
    every rank took: the integrity check and the distribution for ``key`` (this rank's shard
    and object records), and for a plain state dict everything a cached save reuses. Valid
    for a save only if every rank's structure is its cache's (the save's vote decides)."""

    #: structure_fingerprint(shards, objects); None after a plain state dict's save, whose
    #: later saves compare their one-walk parts instead: derived from the snapshot's rows
    #: only if a general-path save asks (:meth:`matches`)
    key: Optional[str]
    distribution: Optional[ShardDistribution]
    snapshot: Optional[_SnapshotCache] = None

    def matches(self, key: str) -> bool:
        """The general path's test: ``key`` is the digest of this cache's structure."""
        if self.key is None and self.snapshot is not None:
            snap = self.snapshot
            self.key = fingerprint_records(map(row_record, snap.encoding.rows), snap.objects)
        return self.key == key


@dataclass
class _Probe:
    """This rank's side of a save's structure vote: the state taken apart (one walk for a
    plain state dict, ``preprocess`` otherwise) and whether the structure cache covers it."""

    parts: Optional[SnapshotParts] = None
    preprocessed: Optional[tuple] = None
    covered: bool = False
    #: covered plain state: the tensors this rank saves and their device types
    tensors: List[Any] = field(default_factory=list)
    devices: List[str] = field(default_factory=list)
    same_sources: bool = False  # the same tensor objects as the last save's (RunPlan)


@dataclass
class _BackgroundVote:
    """A background-voting save's vote, settled at the next manager call: its iteration and
    the last saved iteration before it (restored if the vote dropped it)."""

    votes: collectives.PendingVotes
    iteration: int
    last_saved: int
    #: this rank's save, if it started one (dropped: waited for at the settling)
    handle: Optional[SaveHandle] = None


@dataclass
class _Staged:
    """What ``_stage`` built so far (a failure releases whatever is set)."""

    segment: Optional[Segment] = None
    staging: Optional[StagingHandle] = None
    header: Optional[CheckpointHeader] = None
    cached: bool = False  # staged by _stage_cached
    #: the copies, made ready but not started (see SavePath._submit_copies)
    submit: Optional[Callable[[], None]] = None


class SavePath(SaveCompletion):
    """``save_local`` (mixed into ``CheckpointManager``; the save thread's job: its base)."""

    def save_local(
        self,
        state_dict: Any,
        iteration: int,
        is_async: bool = True,
        skip_if_busy: bool = False,
        vote_in_background: bool = False,
    ) -> Optional[SaveHandle]:
        """Snapshot ``state_dict`` (a sharded state dict, an MCoreTensorAwareStateDict, or a
        callable returning one — preferred in loops: if it raises on some ranks, every rank
        still fails this save together instead of waiting for a timeout).

        Returns once the copies have started (``is_async``) or once the checkpoint is complete
        on every rank. Collective on the first call (distribution, checkpoint group).

        ``skip_if_busy``: where an earlier save is still copying, replicating or agreeing on
        any rank, this one is skipped on every rank alike (None is returned, and counted in
        ``saves_skipped``) instead of waiting for it; a state function is then not called on
        a rank that is busy itself. Decided in the save's one structure vote (see
        :meth:`_prepare`), so it costs no collective of its own.

        ``vote_in_background`` (with ``skip_if_busy``): the calling thread makes no collective
        and waits for no other rank. A rank that is idle and whose state has its cache's
        structure starts its copies at once and returns the handle; the ranks' vote runs in
        the background, and a save that some rank could not take (busy, a changed structure)
        is dropped on every rank — ``handle.skipped()`` says so once the vote is in, and
        ``saves_skipped`` counts it. A rank busy itself returns None, as it skips whatever the
        others vote. The first save, and the first after a structure change or a failure that
        every rank heard of, still vote on the calling thread (see :meth:`_save_voting_later`).
        """
        if vote_in_background and not skip_if_busy:
            raise ValidationError(
                "vote_in_background=True needs skip_if_busy=True: only a save that every rank may "
                "drop can start before the ranks have voted"
            )
        if vote_in_background and is_async and self._caches_agreed and self.world_size > 1:
            return self._save_voting_later(state_dict, iteration)
        t0 = time.perf_counter()
        locked0 = pinning.locked_by_this_thread()
        busy = skip_if_busy and self._busy()
        if not skip_if_busy:
            self._bound_queue()
        group = self._ckpt_group()
        staged = _Staged()  # filled as staging goes, so a failure releases what was taken
        # Objects are made per shard below (records, copies, layouts), none of them garbage: a
        # collection meanwhile would walk the trainer's whole heap, repeatedly. One pause for
        # the whole call (see gc_pause: what it keeps skips the young generations).
        self._caches_agreed = False  # until this save's collective parts agree again
        with paused_gc():
            try:
                state_dict, probe, cached, failed = self._prepare(
                    state_dict, iteration, busy if skip_if_busy else None
                )
            except BaseException as e:
                self._abandon(iteration, group, staged, e)
                raise
            if probe is None:  # skipped on every rank: some rank was busy
                self.saves_skipped += 1
                return None
            # The renewal check the vote carried (manager.groups): a renewal that fails raises
            # here, counted, with nothing of this save queued — as the check's own failure did.
            if self._renew_groups_after_vote(failed):
                group = self._ckpt_group()
            try:
                if cached and probe.parts is not None:
                    self._caches_agreed = True  # every rank voted that its cache covers its state
                    self._stage_cached(probe, iteration, staged)
                else:
                    tasd = self._snapshot(state_dict, probe, cached)
                    # the general path's checks passed on every rank: every cache is renewed
                    self._caches_agreed = self._kind == "dict"
                    self._stage(tasd, iteration, staged, probe.parts)
            except BaseException as e:
                self._abandon(iteration, group, staged, e)
                raise
        return self._queue_save(iteration, staged, group, t0, locked0, is_async)

    def _queue_save(
        self,
        iteration: int,
        staged: "_Staged",
        group,
        t0: float,
        locked0: int,
        is_async: bool = True,
        vote: Optional[collectives.PendingVotes] = None,
    ) -> SaveHandle:
        """Queue the save thread's job for a staged save (``vote``: the background vote that
        decides whether it goes on) and return its handle."""
        metrics = SaveMetrics(
            iteration=iteration,
            bytes_staged=staged.header.data_nbytes,
            structure_cached=staged.cached,
            pinned_on_save_bytes=pinning.locked_by_this_thread() - locked0,
            device_snapshot=staged.staging.snapshot,
        )
        job = _SaveJob(iteration, staged.segment, staged.header, staged.staging, metrics, t0, vote)
        self._last_saved = iteration
        self.latest_iteration = -1  # invalidates find_latest's cache, like nvidia-resiliency-ext
        future = self._worker.submit(self._finish_save, job, group)
        with self._lock:
            self._in_flight.append((iteration, future))
        metrics.stall_s = time.perf_counter() - t0
        dropped = (lambda: _dropped(vote)) if vote is not None else None
        handle = SaveHandle(iteration, staged.staging, future, metrics, dropped)
        if not is_async:
            handle.wait_staged()
            handle.wait()
        return handle

    def _save_voting_later(self, state_dict: Any, iteration: int) -> Optional[SaveHandle]:
        """A skip-if-busy save whose vote runs in the background (``vote_in_background``):
        this rank decides from what it knows alone and starts its all-reduce without waiting.

        Which way a call goes must be the same on every rank, so it follows only answers every
        rank received: this way while the last answer said every rank's structure cache holds
        (``_caches_agreed``), else :meth:`save_local`'s own vote on the calling thread. Here:

        * busy (a save in flight on this rank): vote "not ready", return None (skipped);
        * else the state is built and taken apart; its cache's structure: the copies start
          (:meth:`_stage_cached`) and the job is queued with the vote; the save thread waits
          for the answer before anything reaches a peer, and drops the save on every rank
          unless every rank was ready with its cache's structure;
        * a structure change: vote "changed", return None — every rank drops this save and the
          next call takes the general path together (the answer says so on every rank);
        * a failure (the state function, staging): vote it and raise; every rank drops the save
          (the others' handles fail, naming this rank) and counts one failed call.

        The answer is settled at the next manager call (:meth:`_settle_vote`), when every rank
        has long voted: a training loop with a save due each step waits for no other rank.
        """
        t0 = time.perf_counter()
        locked0 = pinning.locked_by_this_thread()
        self._settle_vote()  # (done already by the call's guard: manager.groups)
        least, self._settled_least = self._settled_least, None  # the settled vote's check, once
        self._renew_groups_after_vote(least)
        busy = self._busy()
        last_saved = self._last_saved  # back to it if the vote drops this save
        group, control = self._ckpt_group(), self._control_group()
        staged, probe = _Staged(), _Probe()
        local: Optional[BaseException] = None
        with paused_gc():  # objects per shard, none of them garbage (see save_local)
            try:
                state_dict, probe = self._built_and_probed(state_dict, iteration, busy)
                if not busy:
                    if _is_tasd(state_dict):
                        raise ValidationError(
                            "save_local was given a tensor-aware state dict after sharded state "
                            "dicts; pass one kind of state to a CheckpointManager"
                        )
                    if probe.covered and probe.parts is not None:
                        self._stage_cached(probe, iteration, staged, submit_later=True)
                    elif probe.covered:
                        tasd = self._snapshot(state_dict, probe, True)
                        self._stage(tasd, iteration, staged)
            except BaseException as e:
                local = e
            # A busy rank's structure is not looked at now: it holds unless a failure dropped it.
            holds = probe.covered if not busy else self._structure is not None
            what = f"the save of iteration {iteration}"
            try:
                vote = collectives.start_votes(
                    local, (holds, not busy), what, control, least=(self._failures.value,)
                )
            except BaseException:
                self._structure = None
                self._release(staged)
                self._failed_together()  # the other ranks' answers fail with it
                raise
        self._pending_vote = _BackgroundVote(vote, iteration, last_saved)
        if local is not None:
            # Nothing of it reaches a peer: the answer drops it on every rank (no stand-in job).
            self._structure = None
            self._release(staged)
            logger.warning("save of iteration %s failed on rank %d: %s", iteration, self.rank, local)
            raise local
        if staged.header is None:  # busy, or a changed structure: dropped on every rank
            with self._lock:
                self.saves_skipped += 1
            return None
        self._submit_copies(staged)
        handle = self._queue_save(iteration, staged, group, t0, locked0, vote=vote)
        self._pending_vote.handle = handle
        return handle

    def _settle_vote(self) -> None:
        """Take in the answer of the last background vote (every manager call starts here, so
        every rank takes it in at the same call): a changed structure or a failure sends the
        next save down the calling thread's vote; a failure counts as a failed call on every
        rank (the groups are renewed before this call's collectives); the lowest failure count
        it carried is kept for the next save's renewal check. A save the vote dropped holds
        nothing anywhere: its iteration may be saved again."""
        pending, self._pending_vote = self._pending_vote, None
        if pending is None:
            return
        holds = ready = False
        try:
            holds, ready, self._settled_least = pending.votes.result()
        except BaseException as e:
            self._failed_together()
            logger.debug("background vote failed: %s", e)
        if not holds:
            self._caches_agreed = False
        if holds and ready:
            return
        if self._last_saved == pending.iteration:
            self._last_saved = pending.last_saved
        if pending.handle is not None:
            # Its job only gives the segment back now (its copies were fenced before this step):
            # waited for, or this rank would still count as busy and vote so — each rank's
            # dropped save would drop the next one everywhere, for good, once steps are shorter
            # than a vote's round trip (seen under the suite's load).
            with contextlib.suppress(Exception):
                pending.handle.wait()

    def _prepare(
        self, state_dict: Any, iteration: int, busy: Optional[bool] = None
    ) -> Tuple[Any, Optional["_Probe"], bool, Optional[int]]:
        """Stage 1: the state (a state function is called here), the iteration checked, the
        structure vote; the first save of a job that did not restore retires an earlier run's
        newer data. Returns the state, this rank's probe, whether every rank's structure
        cache covers its state (then the save needs no other collective on this thread) and
        the lowest count of failed checkpoint calls over the ranks (the group-renewal check,
        carried by the vote: manager.groups; None where the save does not vote).
        ``busy`` (skip-if-busy saves: whether an earlier save is in flight here) is voted on
        too; the probe is None when some rank was busy: every rank skips this save.

        Every save of a sharded state dict votes, in one all-reduce that also carries
        failures: a rank whose state function or arguments fail takes every rank out of the
        save together, and a structure change on any rank (a key added, a tensor resized, a
        shard moved) sends every rank down the general path, whose collective checks and
        distribution then decide as on a first save. (A tensor-aware state dict built by the
        caller — Megatron-LM's — has no caches and no collective here.)"""
        control = self._control_group()
        probe = _Probe()
        local: Optional[BaseException] = None
        try:
            state_dict, probe = self._built_and_probed(state_dict, iteration, busy)
        except BaseException as e:
            local = e
        cached, ready, failed = False, True, None
        try:
            what = f"preparing the save of iteration {iteration}"
            counts = (self._failures.value,)
            if self._kind != "tasd":  # the same on every rank: every save is of the same kind
                cached, ready, failed = collectives.votes_or_fail(
                    local, (probe.covered, not busy), what, control, least=counts
                )
            elif busy is not None:  # a tensor-aware state dict saved only if every rank is idle
                ready, failed = collectives.votes_or_fail(local, (not busy,), what, control, least=counts)
            elif local is not None:
                raise local  # this rank alone: the save's agreement counts it (manager.groups)
            if not ready:
                return state_dict, None, False, failed
            if not self._restored and not self._started:
                self._retire_earlier_run(iteration, control)
        except BaseException:
            if self._kind != "tasd" or busy is not None or local is None:
                self._failed_together()  # a vote's outcome: raised on every rank at this call
            raise
        self._started = True
        return state_dict, probe, cached, failed

    def _built_and_probed(
        self, state_dict: Any, iteration: int, busy: Optional[bool]
    ) -> Tuple[Any, "_Probe"]:
        """This rank's part before a save's vote: the state built (not on a busy rank, which
        skips whatever the others vote), the iteration checked, a sharded state dict taken
        apart and compared with the structure cache. Raises what fails: the caller votes it,
        so a rank whose state function raises still takes part and its peers are told at once
        (job numbering stays in step)."""
        if not busy and callable(state_dict) and not isinstance(state_dict, MCoreTensorAwareStateDict):
            state_dict = state_dict()
        self._check_iteration(iteration)
        if busy or _is_tasd(state_dict):
            return state_dict, _Probe()
        with paused_gc():  # one object per shard, none of them garbage (see save_local)
            return state_dict, self._probe(state_dict)

    def _probe(self, state_dict: Any) -> "_Probe":
        """Take the state apart and compare its structure with this rank's cache (local)."""
        cache = self._structure
        parts = _plain_parts(state_dict)
        if parts is not None:
            snap = cache.snapshot if cache is not None else None
            if snap is None or not snap.covers(parts):
                return _Probe(parts=parts)
            shards = parts.shards
            tensors = [shards[i].data for i in snap.saved_index]
            same = snap.plan.same_sources(tensors)  # then their devices are the last save's too
            devices = snap.devices if same else _device_types(tensors)
            snap.devices = devices
            # A tensor on the meta device: the general path names the error, on every rank.
            covered = "meta" not in devices
            return _Probe(parts=parts, covered=covered, tensors=tensors, devices=devices, same_sources=same)
        pre = preprocess(state_dict)
        sharded = pre[0]
        key = structure_fingerprint(*sharded_leaves(sharded))
        return _Probe(preprocessed=pre, covered=cache is not None and cache.matches(key))

    def _snapshot(self, state_dict: Any, probe: "_Probe", cached: bool) -> MCoreTensorAwareStateDict:
        """Stage 2: the tensor-aware state dict of what this rank saves: its distribution
        computed (collectively, every rank raising together; the structure cache renewed), or
        — ``cached``: every rank's structure is its cache's — reused with no collective."""
        if _is_tasd(state_dict):
            # Megatron-LM hands Megatron-core's class to a LocalCheckpointManager.
            self._kind = "tasd"
            if MCoreTensorAwareStateDict.can_adapt(state_dict):
                return MCoreTensorAwareStateDict.adapt(state_dict)
            return OpaqueStateDict(state_dict, self.options.allow_pickle)
        self._kind = "dict"
        group = self._parallel_group()
        if cached:
            assert self._structure is not None and probe.preprocessed is not None
            return MCoreTensorAwareStateDict.from_validated(
                probe.preprocessed, self._structure.distribution, group
            )[0]
        self._structure = None  # until this round's collective checks pass
        tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(
            state_dict,
            algo="fully_parallel",
            parallelization_group=group,
            validation_group=self._control_group(),
            parts=probe.parts,
            preprocessed=probe.preprocessed,  # a state dict that is not plain: walked once
        )
        # A plain state dict's later saves compare its one-walk parts instead (the snapshot
        # cache): its digest (another 50k records) is made only if a general-path save asks.
        tree = tasd.sharded_state_dict
        key = None if probe.parts is not None else structure_fingerprint(*sharded_leaves(tree))
        self._structure = _StructureCache(key, distribution)
        return tasd

    def _stage(
        self,
        tasd: MCoreTensorAwareStateDict,
        iteration: int,
        staged: "_Staged",
        parts: Optional[SnapshotParts] = None,
    ) -> None:
        """Stage 3: lay the tensors out in a store segment, start the copies, encode the hollow
        state dict while they run (the copy thread releases the GIL), build the header. The
        encoding of a plain state dict (``parts``: what ``tasd`` was built from) is kept for
        the cached saves that follow (:meth:`_stage_cached`)."""
        tensors = list(tasd.tensors)
        layouts, total, runs = plan_layout_runs([(t.dtype, t.shape) for t in tensors])
        plan = RunPlan(runs, layouts)
        self._start_copies(tensors, layouts, total, plan, iteration, staged)
        if parts is not None and self._kind == "dict" and self._structure is not None:
            # Encoded from the parts, tensors left in place (no pop and re-insert).
            devices = _device_types(tensors)
            enc = tasd.hollow_encoding(self.options.allow_pickle, parts, devices)
            meta = enc.meta
            objects = [object_record(o) for o in parts.objects]
            self._structure.snapshot = _SnapshotCache(
                enc,
                objects,
                tasd.stored_mask,
                layouts,
                total,
                plan,
                parts.raw_skeleton,
                shard_fields(parts.shards),
                devices,
            )
        else:
            popped = tasd.pop_tensors()
            try:
                meta = tasd.to_bytes(allow_pickle=self.options.allow_pickle)
            finally:
                tasd.insert_tensors(popped)
        staged.header = self._header(iteration, layouts, total, meta)

    def _stage_cached(
        self, probe: "_Probe", iteration: int, staged: "_Staged", submit_later: bool = False
    ) -> None:
        """Stage 2+3 of a cached save (every rank's plain state dict has its cache's structure:
        tree, every shard's and object's metadata): the distribution, hollow skeleton, shard
        table and layout are reused; only the common state and ShardedObjects are encoded
        again. Produces the same header as the general path (tests/test_save_cache.py)."""
        assert self._structure is not None and self._structure.snapshot is not None
        cache = self._structure.snapshot
        parts, tensors, devices = probe.parts, probe.tensors, probe.devices
        enc = cache.encoding

        def start() -> None:
            self._start_copies(
                tensors,
                cache.layouts,
                cache.total,
                cache.plan,
                iteration,
                staged,
                devices,
                probe.same_sources,
                submit_later,
            )

        # CPU state: encoded before the copies start, which take the memory bandwidth; GPU
        # state: the copies go first (the device moves the bytes meanwhile).
        gpu = "cuda" in devices
        if gpu:
            start()
        meta = encode_hollow(
            parts.common,
            enc.skeleton_bytes,
            enc.table_bytes,
            parts.objects,
            cache.saved,
            devices,
            self.options.allow_pickle,
        )
        if not gpu:
            start()
        staged.header = self._header(iteration, cache.layouts, cache.total, meta)
        staged.cached = True

    def _start_copies(
        self,
        tensors,
        layouts,
        total: int,
        plan: RunPlan,
        iteration: int,
        staged: "_Staged",
        devices: Optional[List[str]] = None,
        same_sources: Optional[bool] = None,
        submit_later: bool = False,
    ) -> None:
        """Reserve the segment (or have the staging thread do it) and start the copies through
        ``plan`` (``devices``, ``same_sources``: what the probe already knows of ``tensors``).
        ``submit_later``: CPU copies are only made ready (``staged.submit``), for
        :meth:`_submit_copies` once the caller's own work is done."""
        on_gpu = _gpu_bytes(tensors, layouts, devices)
        if on_gpu and not self._prefetcher.pin:
            # GPU state: from now on segments are page-locked ahead, off the save's path (a
            # complete one stays locked across saves: it becomes the spare when retired).
            self._prefetcher.pin = True
        pinned_ready = self._prefetcher.has_ready(total, pinned=True)
        snapshot = bool(on_gpu) and self._device_snapshot(pinned_ready, on_gpu)

        def segment() -> Segment:
            # Without a spare: a fresh segment, not populated here: the copy faults its pages in
            # on the staging thread (one pass instead of populate + copy).
            seg = self._prefetcher.take(total, populate=self.spare_segment)
            try:
                self.store.claim(seg, iteration, self.rank)
            except BaseException:
                self.store.release(seg)
                raise
            return seg

        if snapshot and not self._prefetcher.has_ready(total):
            # Nothing made ahead (the first save after a start, a new size): the GPU copy
            # ends the stall; reserving the segment waits for the staging thread.
            staged.staging = self._stager.stage(
                tensors, segment, layouts, plan, device_snapshot=True, same_sources=same_sources
            )
            return
        staged.segment = segment()

        def submit() -> None:
            staged.staging = self._stager.stage(
                tensors, staged.segment, layouts, plan, device_snapshot=snapshot, same_sources=same_sources
            )

        if submit_later and not on_gpu:
            staged.submit = submit
        else:
            submit()

    def _submit_copies(self, staged: "_Staged") -> None:
        """Start the copies :meth:`_start_copies` made ready: after the background vote went
        out, because the staging thread's first work (a few hundred microseconds of Python per
        save) takes the GIL at the calling thread's next release of it — the vote's own calls
        — and held it there for milliseconds on busy cores. Their segment is already reserved
        and claimed (what can fail, before the vote); if starting them fails all the same, the
        save fails in its agreement on every rank, as a failed copy does."""
        submit, staged.submit = staged.submit, None
        if submit is None:
            return
        try:
            submit()
        except Exception as e:
            logger.warning("copies of a save could not start on rank %d: %s", self.rank, e)
            staged.staging = StagingHandle.failed(e, staged.segment)

    def _device_snapshot(self, pinned_ready: bool, on_gpu: Dict[Any, int]) -> bool:
        """Stage the GPU tensors through a copy within the GPU first? ``"always"``; ``"auto"``:
        when no page-locked segment is ready (device-to-host copies would be synchronous, or
        wait for a reservation) and every device has room for its bytes plus a margin."""
        mode = self.options.device_snapshot
        if mode == "never" or (mode == "auto" and pinned_ready):
            return False
        return mode == "always" or all(_gpu_room(dev) >= n for dev, n in on_gpu.items())

    def _header(self, iteration: int, layouts, total: int, meta: bytes) -> CheckpointHeader:
        return CheckpointHeader(
            session=self.session_id,
            iteration=iteration,
            owner=self.rank,
            world_size=self.world_size,
            tensors=tuple(layouts),
            data_nbytes=total,
            meta=meta,
            created_ns=time.time_ns(),
            writer=writer_name(),
            replication={
                "kind": self.placement.kind,
                "factor": self.placement.replication_factor,
                "jump": self.placement.jump,
                "ranks_per_node": self.placement.ranks_per_node,
            },
        )

    def _release(self, staged: "_Staged") -> None:
        """A save that failed while staging: what it took goes back (save_completion)."""
        self._release_once_copied(staged.staging, staged.segment)

    def _retire_earlier_run(self, iteration: int, control) -> None:
        """First save of a job that did not restore: it starts fresh on purpose, so this
        session's checkpoints at ``iteration`` or newer are an earlier run's and would shadow
        the new run's saves (a later restore would return the old run's newer iteration).
        They are retired before this save claims anything; older ones age out through
        retention once the new run's saves complete. Collective (this thread's group)."""
        holdings = gather_holdings(self.store, control, self.world_size)
        stale = sorted({k for per in holdings.ids for k in per if k[0] >= iteration})
        if not stale:
            return
        local: Optional[BaseException] = None
        # One rank per node store removes that node's files; the vote below orders it before
        # any rank's claim.
        leader = min(r for r, k in enumerate(holdings.store_keys) if k == holdings.store_keys[self.rank])
        if leader == self.rank:
            mine = holdings.ids[self.rank]
            try:
                for it, owner in stale:
                    if (it, owner) in mine:
                        self.store.discard(CheckpointId(it, owner, self.session_id))
                for pid in holdings.parity[self.rank] if holdings.parity else ():
                    if pid[0] >= iteration:
                        self.store.discard(ParityId(pid[0], pid[1], self.session_id))
            except OSError as e:
                local = e
        if self.rank == 0:
            logger.warning(
                "session %r: this job did not restore before saving iteration %d, so it starts "
                "fresh; retiring iterations %s of an earlier run held in memory (call load_local() "
                "or CheckpointHook.restore() before the first save to resume them instead)",
                self.session_id,
                iteration,
                sorted({it for it, _ in stale}),
            )
        collectives.fail_together(local, "retiring an earlier run's checkpoints", control)

    def _abandon(self, iteration: int, group, staged: "_Staged", error: BaseException) -> None:
        """This save failed on this rank: release what it took and queue its stand-in job.
        Whatever it left half-made must not decide the next one: this rank's next vote says
        "not cached", so every rank takes the general path together."""
        self._structure = None
        self._release(staged)
        self._submit_failed(iteration, group, error)

    def _submit_failed(self, iteration: int, group, error: BaseException) -> None:
        """Queue the stand-in of a save that failed on this rank before it started."""
        logger.warning("save of iteration %s failed on rank %d: %s", iteration, self.rank, error)
        future = self._worker.submit(self._fail_save, iteration, group, error)
        with self._lock:
            self._in_flight.append((-1, future))

    def _check_iteration(self, iteration: int) -> None:
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise ValidationError(f"iteration must be an int, got {type(iteration).__name__}")
        if not 0 <= iteration <= MAX_ITERATION:
            raise ValidationError(f"iteration {iteration} outside [0, 2**63-1]")
        if iteration <= self._last_saved:
            raise IterationOrderError(
                f"iteration {iteration} does not increase (last saved or restored: "
                f"{self._last_saved}); iterations going backwards would overwrite newer state — "
                "pass the training step, which only grows"
            )

    def _unfinished(self) -> List:
        """The futures of this rank's saves still in flight (copying, replicating, agreeing),
        oldest first; finished ones leave the queue here (their handles report them)."""
        with self._lock:
            while self._in_flight and self._in_flight[0][1].done():
                self._in_flight.popleft()
            return [f for _, f in self._in_flight]

    def _busy(self) -> bool:
        return bool(self._unfinished())

    def _bound_queue(self) -> None:
        """At most one save queued behind the running one: a third waits for the oldest."""
        unfinished = self._unfinished()
        if len(unfinished) >= 2:
            try:
                unfinished[0].result()
            except Exception:
                pass  # its own handle reports it


def _plain_parts(state_dict: Any) -> Optional[SnapshotParts]:
    """The one-walk parts of a plain state dict whose every shard holds data (then which
    shards this rank saves follows from the structure and the distribution alone), else None."""
    if callable(state_dict) or isinstance(state_dict, TensorAwareStateDict):
        return None
    parts = snapshot_parts(state_dict)
    return parts if parts is not None and parts.holds_data() else None


def _gpu_bytes(
    tensors: Sequence[torch.Tensor], layouts: Sequence[TensorLayout], devices: Optional[List[str]] = None
) -> Dict[Any, int]:
    """Bytes to stage per CUDA device (empty for CPU state: the common case, checked first,
    from the device types where the caller has them)."""
    out: Dict[Any, int] = {}
    on_gpu = "cuda" in devices if devices is not None else any(t.is_cuda for t in tensors)
    if on_gpu and torch.cuda.is_available():
        for t, lay in zip(tensors, layouts):
            if t.is_cuda:
                out[t.device] = out.get(t.device, 0) + lay.nbytes
    return out


def _gpu_room(device) -> int:
    """Bytes a device snapshot may take on ``device``: free memory plus the caching allocator's
    unused blocks, less a margin for the training step (max(1 GiB, 5 % of the device))."""
    free, total = torch.cuda.mem_get_info(device)
    cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    return free + cached - max(1 << 30, total // 20)


def _is_tasd(obj: Any) -> bool:
    """A tensor-aware state dict (ours, Megatron-core's, any other), not a sharded state dict."""
    return isinstance(obj, TensorAwareStateDict)


def _device_types(tensors) -> List[str]:
    """Each tensor's device type, as ``pop_tensors`` records them (``Tensor.device`` builds an
    object per call: 3x slower than ``is_cpu``)."""
    return [("cpu" if t.is_cpu else t.device.type) for t in tensors]


def _dropped(vote: collectives.PendingVotes) -> bool:
    """A background vote answered that some rank was busy or had another structure: the save
    is dropped on every rank (False when the vote failed: the save's handle reports that)."""
    try:
        holds, ready, _least = vote.result()
    except BaseException:
        return False
    return not (holds and ready)
