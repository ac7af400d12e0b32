"""The load path of ``CheckpointManager`` (a mixin of it; the state lives on the manager).

``load_local`` (collective): drain saves, gather holdings, pick the newest complete
iteration (or the persistent tier's, if newer), check the template before any byte is
written, retrieve (own node first, then the least-loaded holder), decode, fill the
template through the load exchange, then schedule healing. Every step fails together.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Set, Tuple

import torch

from ..errors import (
    CheckpointingException,
    CorruptCheckpointError,
    ForeignCheckpointError,
    NoReplicaError,
    StoreError,
)
from ..gc_pause import paused_gc
from ..memory.layout import CheckpointId
from ..model.mapping import owned_shard_id
from ..model.nested import map_leaves
from ..model.validation import StrictHandling
from ..parallel import collectives
from ..parallel.load_checks import RestoreCheck, check_restorable, same_structure
from ..parallel.opaque_state_dict import is_opaque, load_opaque
from ..parallel.template import ShardTargets, prepare_template
from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
from ..replication.parity import group_of
from ..replication.parity_peer import rebuild_lost
from ..replication.placement import plan_retrieval
from ..timing import COPY, DECODE, DEVICE, PhaseClock, phase
from .metrics import LoadMetrics
from .restore import Holdings, Retrieved, gather_holdings, retrieve
from .restore_plan import PERSISTENT, RESHARDED, RestorePlan, plan_restore

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Request:
    """What the caller asked a restore for, the template prepared once (see
    ``LoadPath._restore_request``). Only the stages that read or fill the template take it;
    what the restore learns on the way is its :class:`_Progress`."""

    raw: Any = None  # the caller's template as given
    strict: Any = StrictHandling.ASSUME_OK_UNEXPECTED
    reshard_objects: Optional[Callable] = None
    elastic_template: Optional[Callable[[], Any]] = None
    template: Any = None  # prepared (PreparedTemplate)
    targets: ShardTargets = field(default_factory=ShardTargets)
    t0: float = field(default_factory=time.perf_counter)


@dataclass
class _Progress:
    """What a restore learned on its way, kept apart from the template: the planning stage
    (holdings, the persistent tier, parity) takes this, never the template."""

    failure: Optional[BaseException] = None  # a local failure, raised together later
    #: the fill's inputs, prepared while the retrieval's gather was pending (``_FillInputs``)
    fill: Any = None
    #: (iteration, hollow state dict) of this rank's newest own checkpoint in its node's store,
    #: decoded for the structure vote that rides in the holdings gather
    own: Optional[Tuple[int, MCoreTensorAwareStateDict]] = None


@dataclass
class _FillInputs:
    """What the fill needs from one retrieved copy, and this rank's part of its vote."""

    retrieved: Retrieved
    tasd: Optional[MCoreTensorAwareStateDict]
    extra: Dict[Any, torch.Tensor]
    holds_all: bool
    error: Optional[BaseException]
    decode_error: Optional[BaseException]


class LoadPath:
    """``find_latest``, ``load_local`` and nvidia-resiliency-ext's ``load`` (mixed into
    ``CheckpointManager``)."""

    def _holdings(self, failure: Optional[BaseException] = None, note=None) -> Holdings:
        return gather_holdings(self.store, self._control_group(), self.world_size, failure, note)

    def find_latest(self) -> int:
        """Newest iteration whose every rank's data is held somewhere (collective); -1 if none."""
        self.wait_for_saves()
        holdings = self._holdings()
        complete = holdings.complete_iterations(self.world_size, self.parity_groups)
        self.latest_iteration = complete[0] if complete else -1
        elastic = self._elastic_choice(holdings, self.latest_iteration)
        if elastic is not None:  # another world size's, newer: load_local reshards it
            self.latest_iteration = elastic.iteration
        else:
            self._raise_if_only_foreign(holdings)
        # What this job saved above it is not restorable (copies lost, a save that failed):
        # the job resumes from older state (or the persistent tier) and may save those
        # iterations again, as with the reference. Whatever the stores still hold of them is
        # retired by the next save — decided from the gathered holdings, alike on every rank
        # (a rank's own last save differs after a save that failed on some ranks only: the
        # culprit never staged it, and the next save's collectives must pair up).
        self._last_saved = min(self._last_saved, self.latest_iteration)
        if any(k[0] > self.latest_iteration for per in holdings.ids for k in per):
            self._started = self._restored = False
        return self.latest_iteration

    def _raise_if_only_foreign(self, holdings: Holdings) -> None:
        complete = holdings.complete_iterations(self.world_size, self.parity_groups)
        notes = sorted({n for per in holdings.foreign for n in per})
        # another world size's checkpoints are restorable resharded only when held whole
        other: Dict[Tuple[int, int], Set[int]] = {}
        for per in holdings.other_worlds:
            for (it, owner), ws in per.items():
                other.setdefault((it, ws), set()).add(owner)
        notes += [
            f"iteration {it} was saved by a job of world size {ws}, this job has {self.world_size}, and "
            f"the stores hold the data of only {len(owners)} of its {ws} ranks (restorable resharded "
            "only when held whole)"
            for (it, ws), owners in sorted(other.items(), reverse=True)
            if owners != set(range(ws))
        ]
        if notes and not complete:
            raise CheckpointingException(
                "the store holds checkpoints this job cannot use: " + "; ".join(notes[:3])
            )
        if notes:
            logger.warning("ignoring checkpoints this job cannot use: %s", "; ".join(notes[:3]))

    def load_local(
        self,
        template: Optional[Any] = None,
        *,
        strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
        reshard_objects: Optional[Callable[[str, List[Any], int], List[Any]]] = None,
        elastic_template: Optional[Callable[[], Any]] = None,
    ) -> Optional[Tuple[Any, int]]:
        """Restore the newest complete iteration (collective). Returns ``(state_dict,
        iteration)``, or None when no complete local checkpoint exists on this job's ranks.

        ``template``: the sharded state dict to fill (as for ``to_state_dict``); default: the
        checkpoint's own structure. Template ShardedTensors that carry ``data`` of the stored
        dtype and shape are filled in place (the model's own tensors, typically): restoring then
        allocates nothing and copies each byte once, straight from the node's shared memory.
        With ``persistent_dir``, every rank together takes the persistent tier's newest
        checkpoint instead when memory holds no complete iteration or an older one
        (``last_load_metrics.source == "persistent"``).

        **Another world size or layout**: when the newest iteration the survivors' stores hold
        completely was saved by a different number of ranks, the template (laid out for this
        job) is filled from the saved shards' intersections with it, by global offsets
        (``last_load_metrics.source == "resharded"``; see ``manager.elastic`` for per-rank
        objects and ``reshard_objects``). Without a template, ``elastic_template()`` is called
        for one then (``CheckpointHook`` passes its TrainState's).
        """
        # The collector paused throughout: a restore makes many small objects (headers, shard
        # tables, plans) and no cyclic garbage; collections triggered meanwhile walked every
        # live object of the trainer (1-4 ms per restore at 256 MiB, on every rank).
        earlier = self.last_load_metrics
        with paused_gc(), PhaseClock() as clock:
            out = self._load_local(template, strict, reshard_objects, elastic_template)
        # Where the time went (collectives, reads and checksums, peers, copies, device waits):
        # what bounds a restore on this machine (``resilient-ckpt bench`` prints it per rank).
        # Only on this call's metrics: a restore that found nothing to say leaves an earlier
        # restore's metrics as they were.
        m = self.last_load_metrics
        if m is not None and m is not earlier:
            m.phases = clock.breakdown()
            m.reader_seconds = dict(clock.busy)
        return out

    def _load_local(self, template, strict, reshard_objects, elastic_template) -> Optional[Tuple[Any, int]]:
        request, progress = self._restore_request(template, strict, reshard_objects, elastic_template)
        # 1. plan: gathered facts, then a pure decision
        plan = self._plan_restore(progress, self._structure_vote(request, progress))
        if plan.kind == RESHARDED:  # another world size: its own plan/agree/move/fill
            return self._restore_resharded(plan, request, progress)
        if plan.kind == PERSISTENT:  # the tier's DCP checkpoint, newer than memory's
            out = self._restore_persistent(plan, request)
            if out is not None:
                return out
        retrieved, iteration = self._agree_and_move(plan, request, progress, borrow=True)  # 2. agree, 3. move
        if retrieved is None:
            return None
        return self._fill_restored(retrieved, iteration, request, progress)  # 4. fill

    # ---- the stages -----------------------------------------------------------------------

    def _restore_request(
        self, template, strict, reshard_objects=None, elastic_template=None
    ) -> Tuple["_Request", "_Progress"]:
        """What the caller asked for, the template prepared once (the stages that read or fill
        it take it), and the restore's progress. A failure here travels with the first
        collective, so every rank stops together."""
        progress = _Progress()
        prepared, targets = None, ShardTargets()
        try:
            if template is not None:
                prepared = prepare_template(template)
                targets = prepared.targets()
        except Exception as e:
            progress.failure = e
        req = _Request(template, strict, reshard_objects, elastic_template, prepared, targets)
        return req, progress

    def _structure_vote(self, req: "_Request", progress: "_Progress"):
        """The holdings gather's note (see ``_structure_note``); None without a template."""
        if req.template is None:
            return None
        return functools.partial(self._structure_note, req.template, progress)

    def _plan_restore(self, progress: "_Progress", note=None, memory_only: bool = False) -> RestorePlan:
        """Stage 1: drain saves, gather every node store's holdings (and the persistent tier's
        agreed newest iteration), then decide from those facts alone (``plan_restore``).
        ``note``: the structure vote the gather carries. ``memory_only``: this world size's
        checkpoints in memory, nothing else (the reference's ``load``)."""
        self.wait_for_saves()
        holdings = self._holdings(progress.failure, note)
        complete = holdings.complete_iterations(self.world_size, self.parity_groups)
        elastic = None if memory_only else self._elastic_choice(holdings, complete[0] if complete else -1)
        durable = None
        if elastic is None:
            self._raise_if_only_foreign(holdings)
            tier = None if memory_only else self._persistent_tier()
            if tier is not None:
                latest = tier.agreed_latest()  # collective over the tier's group
                durable = latest.iteration if latest is not None else None
        return plan_restore(holdings, complete, elastic, durable)

    def _structure_note(
        self, template, progress: "_Progress", held: Mapping[Tuple[int, int], int]
    ) -> Optional[List[Any]]:
        """``[iteration, same]``: whether the template has the structure of this rank's newest
        own checkpoint in its node's store (``held``: the holdings scan's; a restart's usual
        case). Carried by the holdings gather: when every rank says so for the iteration
        restored, that is the template check's verdict, with no collective of its own
        (``_check_template``). None: nothing to say."""
        newest = max((it for it, owner in held if owner == self.rank), default=None)
        if newest is None:
            return None
        try:
            header = self.store.read_header(CheckpointId(newest, self.rank, self.session_id))
            own = self._hollow(header.meta)
            same = same_structure(template, own)
        except Exception as e:  # the full check decides (and reports what is wrong)
            logger.debug("no structure vote before the holdings gather: %s", e)
            return None
        progress.own = (newest, own)
        return [newest, bool(same)]

    def _restore_resharded(
        self, plan: RestorePlan, req: "_Request", progress: "_Progress"
    ) -> Tuple[Any, int]:
        template, failure = req.template, progress.failure
        if template is None and req.elastic_template is not None and failure is None:
            try:
                template = prepare_template(req.elastic_template())
            except Exception as e:  # travels with the next collective: every rank stops
                failure = e
        return self._load_elastic(template, plan.elastic, plan.holdings, failure, req.t0, req.reshard_objects)

    def _restore_persistent(self, plan: RestorePlan, req: "_Request") -> Optional[Tuple[Any, int]]:
        return self._load_persistent(
            self._persistent_tier(), req.raw, req.t0, plan.newest_in_memory, plan.durable
        )

    def _fill_restored(
        self, retrieved: Retrieved, iteration: int, req: "_Request", progress: "_Progress"
    ) -> Tuple[Any, int]:
        """Stage 4: the checkpoint decoded, the shards this rank did not save found (replicas
        in the node's store, else the load exchange), the template filled; then healing, and
        the next save's segment made ahead."""
        f, progress.fill = progress.fill, None
        if f is None or f.retrieved is not retrieved:
            f = self._fill_inputs(retrieved, iteration, req)
        elif retrieved.notes is None:
            # Later attempts served other copies: the extra shards are found again (the
            # decoded copy is this rank's same one).
            f = self._fill_inputs(retrieved, iteration, req, decoded=(f.tasd, f.decode_error))
        # One vote for these steps: every rank decoded and found its extra shards, or all
        # stop; and whether every rank holds all its template asks for (no exchange at all).
        # Usually it rode in the retrieval's gather (no collective here).
        what, control = f"restoring iteration {iteration}", self._control_group()
        if retrieved.notes is not None:
            held_everywhere = collectives.agreed(retrieved.notes, f.error, what, control)
        else:
            held_everywhere = collectives.agree_or_fail(f.error, f.holds_all, what, control)
        t1 = time.perf_counter()
        state = self._fill(f.tasd, req.template, req.strict, f.extra, held_everywhere)
        state = _unborrow(state, retrieved.borrowed_storages())
        own_nbytes = retrieved.header.data_nbytes if retrieved.header is not None else 0
        del f, retrieved
        self._heal_after_restore()
        # The next save is of this size, usually: its segment is made (GPU state: locked) now.
        self.prepare_next_segment(own_nbytes, req.targets.on_cuda)
        m = self.last_load_metrics
        m.to_state_dict_s = time.perf_counter() - t1
        m.total_s = time.perf_counter() - req.t0
        logger.info("rank %d restored iteration %d from %s (rank %d) in %.3fs",
                    self.rank, iteration, m.source, m.source_rank, m.total_s)  # fmt: skip
        return state, iteration

    def _fill_inputs(
        self, retrieved: Retrieved, iteration: int, req: "_Request", decoded=None
    ) -> _FillInputs:
        """Decode the copy (unless ``decoded``: its earlier ``(tasd, error)``), find the extra
        shards, see whether this rank holds all its template asks for; an error is kept to be
        raised with every rank's vote."""
        tasd, failed = decoded if decoded is not None else self._decode_here(retrieved, iteration)
        local = failed
        extra: Dict[Any, torch.Tensor] = {}
        holds_all = False
        if local is None:
            try:
                extra = self._extra_shards(retrieved)
                holds_all = self._holds_template(tasd, req.template, extra)
            except Exception as e:
                local = e
        return _FillInputs(retrieved, tasd, extra, holds_all, local, failed)

    def _fill_vote(
        self, iteration: int, req: "_Request", progress: "_Progress"
    ) -> Callable[[Retrieved], Any]:
        """``retrieve``'s note: the fill's inputs prepared right after the move (the faster
        ranks while they wait for the slower), its vote carried by the retrieval's gather."""

        def note(retrieved: Retrieved) -> Any:
            progress.fill = self._fill_inputs(retrieved, iteration, req)
            return collectives.vote(progress.fill.error, progress.fill.holds_all)

        return note

    def _same_structure_checked(self, template) -> bool:
        """``template`` passed the agreed check as the checkpoint's own structure (every rank)."""
        checked = template is not None and self._integrity_checked_for is template
        return checked and self._restore_check is RestoreCheck.SAME_STRUCTURE

    def _holds_template(self, tasd, template, extra) -> bool:
        """This rank holds every shard ``template`` asks for (its own checkpoint's and
        ``extra``), the template being of the checkpoint's agreed structure."""
        if not self._same_structure_checked(template):
            return False
        # Of the checkpoint's structure, so its shards are the checkpoint's, row for row: those
        # this rank saved are held; the others must be among ``extra``. (Without to_state_dict's
        # walk of the tree for objects and keys: the fill makes that walk once anyway.)
        mask = tasd.saved_mask
        if len(mask) != len(template.shards):
            return False
        return all(saved or st.shard_id in extra for st, saved in zip(template.shards, mask))

    def _fill(self, tasd, template, strict, extra, held_everywhere: bool = False):
        """The template filled through the load exchange (collective; this manager's groups,
        none when every rank agreed it ``held_everywhere``)."""
        checked = template is not None and self._integrity_checked_for is template
        same = self._same_structure_checked(template)
        self._integrity_checked_for = None
        return tasd.to_state_dict(
            template if template is not None else tasd.sharded_state_dict,
            algo="fully_parallel",
            exchange_algo=self.exchange_algo,
            validate_access_integrity=not checked,
            parallelization_group=self._parallel_group(),
            strict=strict,
            load_into_template=True,
            extra_held=extra,
            validation_group=self._control_group(),
            same_structure=same,
            held_everywhere=held_everywhere,
        )

    def _extra_shards(self, retrieved: Retrieved) -> Dict[Any, torch.Tensor]:
        """Shards this rank can serve or fill beyond its own checkpoint: replicas of lost
        ranks it verified (it serves their shards in the exchange), and the template shards it
        did not save that the move read from replicas in this node's store."""
        extra: Dict[Any, torch.Tensor] = {}
        for owner, (hdr, views) in retrieved.serving.items():
            replica = retrieved.decoded.get(owner) or self._hollow(hdr.meta)
            for st, v in zip(replica.tensor_metadata, views):
                extra[st.shard_id] = v
                if st.rank_local:  # the owner's own copy: what it gets back, not this rank's
                    extra[owned_shard_id(st.shard_id, owner)] = v
        extra.update(retrieved.node_shards)
        return extra

    def _check_template(
        self, holdings: Holdings, iteration: int, template: Any, strict, own=None
    ) -> Dict[int, MCoreTensorAwareStateDict]:
        """Collective: raise on every rank, before anything is read into ``template``, if
        restoring ``iteration`` into it would fail a check (keys, shapes, dtypes, layout).
        Each rank vouches for the checkpoints the retrieval plan has it serve, read from its
        node's store (headers only); if any rank cannot read one, the checks run later, as
        part of the load, instead. Returns the hollow state dicts it decoded, by owner (the
        retrieval reuses them).

        No collective when every rank's structure vote in the holdings gather says its
        template has the structure of its own checkpoint of ``iteration`` (``own``: this
        rank's decoded, from ``_structure_note``): the verdict ``check_restorable`` reaches
        first, from the same facts."""
        if own is not None and own[0] == iteration and holdings.notes:
            if all(n is not None and n[0] == iteration and n[1] for n in holdings.notes):
                self._integrity_checked_for = template
                self._restore_check = RestoreCheck.SAME_STRUCTURE
                return {self.rank: own[1]}
        decoded: Dict[int, MCoreTensorAwareStateDict] = {}
        saved: Optional[List[MCoreTensorAwareStateDict]] = None
        try:
            plan = plan_retrieval(
                {r: r for r in range(self.world_size)},
                holdings.available(iteration),
                holdings.node_of,
                holdings.nbytes(iteration),
            )
            for f in plan:
                if f.source == self.rank:
                    header = self.store.read_header(CheckpointId(iteration, f.owner, self.session_id))
                    decoded[f.owner] = self._hollow(header.meta)
            saved = list(decoded.values())
        except (CheckpointingException, OSError) as e:
            logger.debug("cannot vouch for iteration %d before restoring it: %s", iteration, e)
            decoded = {}
        checked = check_restorable(
            template,
            saved,
            self._parallel_group(),
            strict,
            validation_group=self._control_group(),
            own=decoded.get(self.rank),
        )
        # The fill into this template need not validate its integrity again (a world-wide
        # gather and check of every shard record: seconds at 50k tensors).
        self._integrity_checked_for = template if checked else None
        self._restore_check = checked
        return decoded

    def _warn_unrestorable(self, holdings: Holdings) -> None:
        """Memory holds none of this job's checkpoints in full: say so loudly when it holds
        part of one (a node lost with its only copy) — progress is lost unless a fallback has
        it. Same facts on every rank, so the same warning everywhere."""
        held = holdings.owners_held()
        if held:
            newest = max(held)
            missing = sorted(set(range(self.world_size)) - held[newest])
            self.last_load_metrics = LoadMetrics(source="none", missing_owners=missing, iteration=-1)
            fallback = (
                f"the persistent tier {self._tier.directory} is tried first"
                if self._tier is not None
                else "no persistent tier is configured (CheckpointManager(persistent_dir=...))"
            )
            rep = self.options.replication
            redundancy = (
                f"redundancy='parity', parity_group={rep.parity_group}, parity_shares={rep.parity_shares}: "
                "more nodes of one group lost than it tolerates"
                if self.parity_groups
                else f"replication_factor={self.placement.replication_factor}"
            )
            logger.warning(
                "session %r: memory holds iterations %s but none completely: the newest, %d, "
                "lacks the data of ranks %s (their node and every copy are gone; %s). Nothing "
                "can be restored from memory; %s — restore from your own checkpoint or the run "
                "restarts from scratch",
                self.session_id,
                sorted(held, reverse=True)[:5],
                newest,
                rank_ranges(missing),
                redundancy,
                fallback,
            )
            return
        others = self.store.other_sessions()
        if others:
            logger.warning(
                "no complete checkpoint of session %r in %s; the same root holds checkpoints "
                "of sessions %s (pass session_id=... to restore one of them)",
                self.session_id,
                self.store.root,
                others[:5],
            )

    def _pull_missing(self, holdings: Holdings, iteration: int, group) -> Holdings:
        """Service mode: ask this node's daemon to pull this rank's checkpoint from a peer
        daemon when the node's store lacks it (a replacement node), then re-gather holdings
        (collective: every rank calls this at the same point)."""
        mine = holdings.ids[self.rank] if self.rank < len(holdings.ids) else {}
        if (iteration, self.rank) not in mine:
            try:
                res = self._client.fetch(iteration, self.rank, timeout=self.timeout_s)
                logger.info("daemon pulled iteration %d of rank %d: %s", iteration, self.rank, res)
            except Exception as e:  # the trainer-side exchange below is the fallback
                logger.warning(
                    "daemon could not pull iteration %d of rank %d (%s); peers serve it instead",
                    iteration,
                    self.rank,
                    e,
                )
        return gather_holdings(self.store, group, self.world_size)

    def _load_persistent(
        self, tier, template, t0: float, in_memory: int, durable: int
    ) -> Optional[Tuple[Any, int]]:
        """Load the persistent tier's newest checkpoint ``durable`` (the plan found it newer than
        memory's ``in_memory``: decided alike on every rank); None if the tier has none after all."""
        if in_memory < 0:
            logger.warning(
                "no complete in-memory checkpoint; restoring iteration %d from the persistent tier %s",
                durable,
                tier.directory,
            )
        out = tier.load(template, self._parallel_group())
        if out is None:
            return None
        iteration = out[1]
        self._restored = True
        self._drop_abandoned(newer_than=iteration)
        self._last_saved = iteration
        self.latest_iteration = iteration
        report = tier.last_load
        self.last_load_metrics = LoadMetrics(
            iteration=iteration,
            source="persistent",
            source_rank=self.rank,
            total_s=time.perf_counter() - t0,
            bytes_read=getattr(report, "bytes_read", 0) if report is not None else 0,
            attempts=1,
        )
        return out

    def _retrieve_latest(self) -> Tuple[Optional[Retrieved], int]:
        """nvidia-resiliency-ext's ``load``: this rank's newest complete checkpoint, in private
        memory (no template: nothing to agree on but the copies)."""
        req, progress = self._restore_request(None, StrictHandling.ASSUME_OK_UNEXPECTED)
        plan = self._plan_restore(progress, memory_only=True)
        return self._agree_and_move(plan, req, progress, borrow=False)

    def _agree_and_move(
        self, plan: RestorePlan, req: "_Request", progress: "_Progress", borrow: bool
    ) -> Tuple[Optional[Retrieved], int]:
        """Stages 2 and 3 of a memory restore, newest complete iteration first: make every
        owner's copy reachable (service pull, parity rebuild), **agree** on the template (one
        collective verdict, before any byte is written into it), **move** the bytes (the node's
        own copy straight into the template, peers' copies through the transport). Falls back
        to an older iteration only when every copy of the newer one fails verification —
        decided from gathered facts, so every rank falls back together."""
        holdings, complete = plan.holdings, list(plan.complete)
        if not complete:
            self.latest_iteration = -1
            self._warn_unrestorable(holdings)
            return None, -1
        # Everyone has drained its saves (the gather above is after each rank's drain), so
        # headerless data files are leftovers of a crashed save. The collectives of retrieve()
        # order this (and _drop_abandoned) before any rank's next save.
        try:
            self.store.sweep_orphans()
        except OSError as e:  # housekeeping: must not keep this rank from the collectives below
            logger.warning("could not recycle leftovers in %s: %s", self.store.dir, e)
        retrieved, iteration, holdings = self._first_restorable(complete, holdings, borrow, req, progress)
        self._adopt(retrieved, iteration, holdings, complete)
        return retrieved, iteration

    def _first_restorable(self, complete, holdings, borrow, req: "_Request", progress: "_Progress"):
        """Retrieve the newest complete iteration whose copies verify; older ones if not
        (decided from gathered facts, so every rank falls back together)."""
        targets, template, strict = req.targets, req.template, req.strict
        control = self._control_group()
        last_error: Optional[BaseException] = None
        for iteration in complete:
            self._drop_abandoned(newer_than=iteration)
            if self._client is not None:
                holdings = self._pull_missing(holdings, iteration, control)
            try:
                holdings = self._rebuild_from_parity(holdings, iteration, control)
            except (CorruptCheckpointError, NoReplicaError) as e:  # same facts, same words everywhere
                logger.warning(
                    "iteration %d cannot be rebuilt from parity (%s); trying an older one", iteration, e
                )
                last_error = e
                continue
            decoded: Dict[int, MCoreTensorAwareStateDict] = {}
            if template is not None:
                # Before any byte lands in the template: a restore that cannot succeed leaves
                # the caller's tensors untouched on every rank.
                decoded = self._check_template(holdings, iteration, template, strict, progress.own)
            try:
                retrieved = retrieve(
                    self.store,
                    holdings,
                    iteration,
                    control,
                    self._transport,
                    self.rank,
                    self.world_size,
                    borrow=borrow,
                    targets=targets,
                    decoded=decoded,
                    allow_pickle=self.options.allow_pickle,
                    note=self._fill_vote(iteration, req, progress) if borrow else None,
                )
                return retrieved, iteration, holdings
            except (CorruptCheckpointError, NoReplicaError) as e:
                logger.warning(
                    "iteration %d cannot be restored (%s); falling back to the previous complete iteration",
                    iteration,
                    e,
                )
                last_error = e
        raise CheckpointingException(
            f"no complete iteration could be restored (tried {complete}); last error: {last_error}"
        ) from last_error

    def _rebuild_from_parity(self, holdings: Holdings, iteration: int, control) -> Holdings:
        """Owners of ``iteration`` whose data no store holds are decoded from their parity
        group into their own rank's store, then holdings are gathered again (collective; a
        no-op, decided from gathered facts, when nothing is missing)."""
        available = holdings.available(iteration)
        if not self.parity_groups or all(r in available for r in range(self.world_size)):
            return holdings
        lost = sorted(set(range(self.world_size)) - set(available))
        sizes: Dict[int, int] = {}
        for holder, n in holdings.parity_block_sizes(iteration).items():
            sizes.setdefault(group_of(self.parity_groups, holder).members[0], n)
        report = rebuild_lost(
            self.store,
            self._transport,
            self.parity_groups,
            iteration,
            {owner: ranks[0] for owner, ranks in available.items()},
            holdings.parity_at(iteration),
            sizes,
            self.rank,
            control,
        )
        self._parity_rebuild = report
        if self.rank == 0:
            logger.warning(
                "iteration %d: rebuilt the data of ranks %s from parity (%d attempt(s)); their "
                "parity shares are back at the next save",
                iteration,
                rank_ranges(lost),
                report.attempts,
            )
        return gather_holdings(self.store, control, self.world_size)

    def _adopt(self, retrieved: Retrieved, iteration: int, holdings: Holdings, complete: List[int]) -> None:
        """The restored iteration defines the timeline (also for an in-process restart):
        newer ones were abandoned, so the trainer may save those iteration numbers again."""
        self._restored = True
        self._restore_facts = (holdings, iteration)
        self.latest_iteration = iteration
        self._last_saved = iteration
        self._complete = sorted(it for it in complete if it <= iteration)[-self.keep_last :]
        self.last_load_metrics = LoadMetrics(
            iteration=iteration,
            source=retrieved.source,
            source_rank=retrieved.source_rank,
            retrieve_s=retrieved.seconds,
            bytes_read=retrieved.bytes_read,
            attempts=retrieved.attempts,
            failed_copies=retrieved.failed_copies,
        )

    def load(self) -> Tuple[MCoreTensorAwareStateDict, Tuple[int, int, str]]:
        """``LocalCheckpointManager.load``: the newest complete iteration's state dict (call
        ``to_state_dict`` on it) and its checkpoint id (iteration, rank, session)."""
        retrieved, iteration = self._retrieve_latest()
        if retrieved is None:
            raise CheckpointingException(
                "no complete local checkpoint to load; call find_latest() first and check for -1"
            )
        tasd = self._decode(retrieved, iteration)
        self._heal_after_restore()
        return tasd, self.ckpt_id(iteration)

    def ckpt_id(self, iteration: int) -> Tuple[int, int, str]:
        """The id ``load()`` returns with the state: ``(iteration, rank, session_id)``."""
        return (iteration, self.rank, self.session_id)

    def _drop_abandoned(self, newer_than: int) -> None:
        """Discard this node's checkpoints newer than the iteration being restored: saves that
        never completed (a crash mid-save) or that cannot be restored. The restarted job saves
        those iterations again and must not find them taken. Other jobs' files (foreign) are
        left alone."""
        self._close_own_segments(newer_than)
        try:
            cids = self.store.list()
            stale_parity = [
                p for p in self.store.list_parity() if p.iteration > newer_than and self._is_ours_parity(p)
            ]
        except OSError as e:
            logger.warning("could not list %s: %s", self.store.dir, e)
            return
        for pid in stale_parity:
            try:
                self.store.discard(pid)
            except OSError as e:
                logger.warning("could not discard %s: %s", pid.stem(), e)
        for cid in cids:
            if cid.iteration <= newer_than:
                continue
            try:
                self.store.read_header(cid)
            except ForeignCheckpointError:
                continue
            except (StoreError, OSError):
                pass  # unreadable: garbage either way
            logger.info(
                "discarding %s in %s: newer than the restored iteration %d (not restorable)",
                cid.stem(),
                self.store.dir,
                newer_than,
            )
            try:
                self.store.discard(cid)
            except OSError as e:
                logger.warning("could not discard %s: %s", cid.stem(), e)

    def _hollow(self, meta: bytes) -> MCoreTensorAwareStateDict:
        """A checkpoint's hollow state dict (pickled values only if this manager allows them)."""
        return MCoreTensorAwareStateDict.from_bytes(meta, allow_pickle=self.options.allow_pickle)

    def _rebuild(self, retrieved: Retrieved) -> MCoreTensorAwareStateDict:
        tasd = retrieved.hollow or self._hollow(retrieved.header.meta)
        if retrieved.served_by is not None:
            # Lost node: the holder of the replica serves this rank's shards in the exchange.
            return tasd.holding_nothing()
        # Every tensor was made for, or read into after matching, its stored layout.
        tasd.insert_tensors(retrieved.tensors, layouts=retrieved.header.tensors)
        _restore_devices(tasd)
        return tasd

    def _decode(self, retrieved: Retrieved, iteration: int) -> MCoreTensorAwareStateDict:
        """The restored state dict, with tensors on their devices. Collective: a rank that cannot
        decode its checkpoint makes every rank raise (never some ranks loading while others
        fail)."""
        tasd, local = self._decode_here(retrieved, iteration)
        collectives.fail_together(
            local, f"rebuilding the state dict of iteration {iteration}", self._control_group()
        )
        return tasd

    def _decode_here(
        self, retrieved: Retrieved, iteration: int
    ) -> Tuple[Optional[MCoreTensorAwareStateDict], Optional[BaseException]]:
        """:meth:`_decode` without its collective: (the state dict, None) or (None, the error
        to raise together, naming the likely cause)."""
        try:
            with phase(DECODE):
                if is_opaque(retrieved.header.meta):
                    return load_opaque(retrieved.tensors[0], self.options.allow_pickle), None
                return self._rebuild(retrieved), None
        except Exception as e:
            err = CheckpointingException(
                f"rank {self.rank} could not rebuild its state dict from iteration {iteration}: "
                f"{collectives.describe(e)} (the checkpoint was written by an incompatible "
                "resilient_ckpt or with a type this process has not registered)"
            )
            err.__cause__ = e
            return None, err


def rank_ranges(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (lists of lost ranks get long)."""
    out: List[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _unborrow(state: Any, borrowed: Set[int]) -> Any:
    """Views of store segments must not escape a load (later saves recycle the segments):
    clone the tensors of ``state`` that view one."""
    if not borrowed:
        return state
    return map_leaves(
        lambda v: (
            v.clone()
            if isinstance(v, torch.Tensor)
            and v.device.type == "cpu"
            and v.untyped_storage().data_ptr() in borrowed
            else v
        ),
        state,
    )


def _restore_devices(tasd: MCoreTensorAwareStateDict) -> None:
    """Move restored tensors to the devices they were saved from, when this host has them."""
    devices = {d for d in tasd.pending_devices if d}
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        logger.warning("checkpoint was saved from CUDA tensors; restoring on CPU (no GPU here)")
        return
    with phase(COPY):
        tasd.restore_tensor_device(non_blocking=True)
    if torch.cuda.is_available():
        with phase(DEVICE):
            torch.cuda.current_stream().synchronize()
