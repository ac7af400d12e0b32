"""``CheckpointManager``: save every N steps into node memory, replicate, restore automatically.

Embedded mode (default): trainer processes write their node's shared-memory store
themselves and replicate over a torch.distributed group reserved for checkpoints.

Save path (rank r, iteration i): ``save_local`` builds the tensor-aware state dict (cached
fully-parallel distribution, so no collective after the first save), takes a pre-mapped store
segment, starts the copies into it and returns. A background thread (one per manager, named
``resilient_ckpt-save``) then waits for the copies, checksums, publishes the header, exchanges
replicas with the placement's holders, and runs one all-reduce so every rank agrees whether i
is complete. Only then are older iterations retired. Any failure leaves the previous complete
iteration loadable and surfaces in ``SaveHandle.wait()``.

Saves are queued, not refused: at most one save waits behind the one in flight; a third call
blocks until the oldest finished (bounded memory).

Every ``save_local`` call puts exactly one job on the worker, also when preparing the snapshot
failed on this rank (bad iteration, structure change, unencodable state, store full): then the
job tells the peers at once, so they are not left waiting for this rank's replica or vote until a
timeout. Jobs are therefore numbered alike on every rank, which keeps collective decisions (the
cached distribution) in step.
"""

from __future__ import annotations

import logging
import os
import re
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, Deque, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

from ..memory import checksum
from ..parallel import collectives
from ..parallel.distribution import ShardDistribution
from ..errors import (
    CheckpointingException,
    CorruptCheckpointError,
    ForeignCheckpointError,
    NoReplicaError,
    PeerFailedError,
    ReplicationError,
    StoreError,
    ValidationError,
)
from ..replication.placement import Placement, clique_placement, plan_retrieval, ring_placement
from ..replication.healing import RepairPlan, plan_repairs
from ..replication.peer import PeerReplicator
from ..replication.transport import P2PTransport, new_checkpoint_group
from .restore import Holdings, Retrieved, gather_holdings, read_local_shards, retrieve
from ..memory.staging import SegmentPrefetcher, Stager, StagingHandle
from ..memory.store import (
    DEFAULT_ROOT,
    CheckpointHeader,
    CheckpointId,
    CheckpointStore,
    Segment,
    plan_layout,
    validate_session_id,
)
from ..parallel.tensor_aware_state_dict import (
    MCoreTensorAwareStateDict,
    check_restorable,
    template_targets,
)
from ..model.nested import map_leaves
from ..model.validation import StrictHandling

logger = logging.getLogger(__name__)

MAX_ITERATION = (1 << 63) - 1

#: Points where tests (and chaos drills) can inject a fault: ``fault_hook(point)``.
FAULT_POINTS = ("after_staging", "after_publish", "before_replication", "after_replication", "before_agreement")


@dataclass
class SaveMetrics:
    iteration: int
    stall_s: float = 0.0
    staging_s: float = 0.0
    checksum_s: float = 0.0
    publish_s: float = 0.0
    replication_s: float = 0.0
    agreement_s: float = 0.0
    durable_s: float = 0.0
    bytes_staged: int = 0
    bytes_replicated_out: int = 0
    bytes_replicated_in: int = 0

    def as_dict(self) -> Dict[str, float]:
        return dict(self.__dict__)


@dataclass
class LoadMetrics:
    iteration: int = -1
    source: str = ""
    source_rank: int = -1
    retrieve_s: float = 0.0
    to_state_dict_s: float = 0.0
    total_s: float = 0.0
    bytes_read: int = 0
    attempts: int = 0
    failed_copies: List[Tuple[int, int]] = field(default_factory=list)
    #: when nothing could be restored although memory held part of a checkpoint: the owner
    #: ranks whose data was missing from the newest iteration
    missing_owners: List[int] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class HealMetrics:
    """Re-creating the copies a restore found missing (see ``replication.healing``)."""

    iteration: int
    copies: int = 0  # copies the plan re-created, over the whole job
    bytes: int = 0  # their bytes, over the whole job
    bytes_in: int = 0  # this rank's received bytes
    bytes_out: int = 0  # this rank's sent bytes
    seconds: float = 0.0  # from the restore's end to redundancy agreed whole
    whole: bool = False  # every copy the placement asks for exists again
    unrepairable: List[int] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


class SaveHandle:
    """The future of one ``save_local``."""

    def __init__(self, iteration: int, staging: StagingHandle, future: Future, metrics: SaveMetrics):
        self.iteration = iteration
        self._staging = staging
        self._future = future
        self.metrics = metrics

    def wait_staged(self) -> float:
        """Block until the snapshot's copies are done: call before mutating saved tensors
        (the optimizer step). Returns the seconds waited."""
        waited = self._staging.wait()
        self.metrics.stall_s += waited
        return waited

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: Optional[float] = None) -> SaveMetrics:
        """Block until stored + replicated + agreed complete; raises CheckpointingException."""
        self._future.result(timeout)
        return self.metrics

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None


@dataclass
class _SaveJob:
    iteration: int
    segment: Segment
    header: CheckpointHeader
    staging: StagingHandle
    metrics: SaveMetrics
    t_start: float
    seq: int = 0


class CheckpointManager:
    """In-memory local checkpoints with peer replication (embedded mode).

    Args:
        session_id: names the job; a store never loads (or retires) another session's data.
            Default: ``TORCHELASTIC_RUN_ID`` under torchrun, ``slurm-$SLURM_JOB_ID`` under
            Slurm, else ``job-$MASTER_ADDR-$MASTER_PORT`` (unique among running jobs, with a
            warning: a restart on another port would not find it). Validated: letters, digits
            and ``._+=@:-``.
        store_root: tmpfs directory of this node's store.
        replication_factor: copies of each rank's data (1 = no replication).
        replication_jump: rank distance between copies (default: ranks per node, from
            ``LOCAL_WORLD_SIZE``) so copies land on other nodes.
        keep_last: complete iterations kept in memory.
        parallelization_group: group over which replicated shards are deduplicated on save
            and exchanged on load (default: the world).
        placement: ``"ring"`` (any world size) or ``"clique"`` (nvidia-resiliency-ext parity).
        memory_budget: bytes this node's store may use for the session (None: filesystem size).
        timeout_s: deadline of checkpoint collectives and transfers.
        exchange_algo: fully-parallel load exchange: ``"p2p"`` (default: each shard goes only
            to the ranks that need it, all pairs at once) or ``"broadcast"``.
        fault_hook: called with a point name from FAULT_POINTS (tests, chaos drills).
        replication_backend: backend of the checkpoint group. Default ``"gloo"``: checkpoint
            bytes live in host memory, and gloo moves them from there without two PCIe copies
            and without sharing NCCL resources with training collectives running on the main
            thread at the same time. ``"nccl"`` routes them through device bounce buffers.
        session: alias of ``session_id``.
        persistent_dir: a directory (shared file system) for the persistent tier: the newest
            complete in-memory iteration is flushed there as a standard
            torch.distributed.checkpoint (from the store, in the background), and
            ``load_local`` falls back to it, on every rank together, when memory holds no
            complete iteration (or an older one).
        flush_every: flush every this many complete saves (0: only on demand or SIGTERM).
        flush_on_sigterm: flush the newest complete iteration when SIGTERM arrives.
        mode: ``"embedded"`` (default: trainers replicate among themselves) or ``"service"``
            (this node's daemon replicates, so replication completes even if the trainer dies;
            implied by ``endpoint``). The store root must be the daemon's ``--store-root``.
        endpoint: this node's daemon, e.g. ``tcp://127.0.0.1:7555`` (default from
            ``RESILIENT_CKPT_ENDPOINT``); the job secret comes from ``RESILIENT_CKPT_SECRET`` or
            ``RESILIENT_CKPT_SECRET_FILE``.
    """

    def __init__(
        self,
        session_id: Optional[str] = None,
        store_root: str = DEFAULT_ROOT,
        replication_factor: int = 2,
        replication_jump: Optional[int] = None,
        keep_last: int = 2,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        *,
        placement: str = "ring",
        ranks_per_node: Optional[int] = None,
        memory_budget: Optional[int] = None,
        timeout_s: float = 120.0,
        exchange_algo: str = "p2p",
        fault_hook: Optional[Callable[[str], None]] = None,
        replication_backend: str = "gloo",
        session: Optional[str] = None,
        persistent_dir: Optional[str] = None,
        flush_every: int = 0,
        flush_on_sigterm: bool = False,
        mode: Optional[str] = None,
        endpoint: Optional[str] = None,
    ):
        session_id = _session_id(session_id if session_id is not None else session)
        if keep_last < 1:
            raise ValidationError(f"keep_last must be >= 1, got {keep_last}")
        self.session_id = session_id
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.keep_last = keep_last
        self.parallelization_group = parallelization_group
        self.timeout_s = timeout_s
        self.exchange_algo = exchange_algo
        self.fault_hook = fault_hook
        self.replication_backend = replication_backend
        if self.world_size == 1 and replication_factor > 1:
            logger.warning(
                "a single process has no peer to hold a replica: checkpoints stay in this node's "
                "memory only (replication_factor=%d ignored)", replication_factor,
            )
            replication_factor = 1
        rpn = ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", "0") or 0) or None
        make = {"ring": ring_placement, "clique": clique_placement}.get(placement)
        if make is None:
            raise ValidationError(f"placement must be 'ring' or 'clique', got {placement!r}")
        self.placement: Placement = make(
            self.world_size, replication_factor, replication_jump, ranks_per_node=rpn
        )
        self.store = CheckpointStore(store_root, session_id, self.world_size, memory_budget)
        self._stager = Stager()
        self._prefetcher = SegmentPrefetcher(self.store, pin=torch.cuda.is_available())
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient_ckpt-save")
        self._group: Optional[dist.ProcessGroup] = None
        self._control: Optional[dist.ProcessGroup] = None
        self._par_group: Optional[dist.ProcessGroup] = None
        self._transport: Optional[P2PTransport] = None
        self._replicator = None
        self._distribution: Optional[ShardDistribution] = None
        self._in_flight: Deque[Tuple[int, Future]] = deque()
        #: jobs submitted so far (equal on every rank, see the module docstring)
        self._seq = 0
        #: sequence numbers of jobs whose agreement failed (written by the worker)
        self._failed_seqs: set = set()
        #: failures up to this sequence number were already acted on
        self._dist_checked_upto = -1
        self._last_saved = -1
        #: "tasd" or "dict": what save_local was given (decides whether a save is collective)
        self._kind: Optional[str] = None
        #: a checkpoint was restored (or looked up for loading) by this manager
        self._restored = False
        #: a save was started by this manager
        self._started = False
        self._complete: List[int] = []
        self._lock = threading.Lock()
        self.latest_iteration = -1  # nvidia-resiliency-ext attribute name
        self.last_save_metrics: Optional[SaveMetrics] = None
        self.last_load_metrics: Optional[LoadMetrics] = None
        self.last_heal_metrics: Optional[HealMetrics] = None
        #: holdings and iteration of the last restore, for healing
        self._restore_facts: Optional[Tuple[Holdings, int]] = None
        self._healing: Optional[Future] = None
        self._persistent_args = (persistent_dir, flush_every, flush_on_sigterm)
        self._tier = None
        endpoint = endpoint or (os.environ.get("RESILIENT_CKPT_ENDPOINT") if mode == "service" else None)
        self.mode = mode or ("service" if endpoint else "embedded")
        self._client = None
        if self.mode == "service":
            if not endpoint:
                raise ValidationError(
                    "service mode needs the node daemon's endpoint: pass endpoint='tcp://HOST:PORT' "
                    "or set RESILIENT_CKPT_ENDPOINT (start it with `resilient-ckpt serve`)"
                )
            from ..service.client import DaemonClient
            from ..service.replicator import ServiceReplicator

            self._client = DaemonClient(endpoint, session_id, timeout_s=timeout_s, rank=self.rank)
            self._replicator = ServiceReplicator(self._client, self.store, self.rank, timeout_s=timeout_s)
        elif self.mode != "embedded":
            raise ValidationError(f"mode must be 'embedded' or 'service', got {mode!r}")

    # ---- groups ------------------------------------------------------------------------------

    def _ckpt_group(self):
        """The manager's data group (replication, agreement votes: the save thread), created
        on first use with the control and parallelization groups (collective: every rank
        saves/loads together)."""
        self._persistent_tier()
        if self._group is None and dist.is_initialized() and self.world_size > 1:
            self._group = new_checkpoint_group(self.replication_backend, timeout_s=self.timeout_s)
            # Collectives of the calling thread (votes, holdings, distribution, restore) run on a
            # group of their own: the save thread may be in the middle of the previous save's
            # exchange on the data group, and two threads must never interleave on one group.
            self._control = new_checkpoint_group(self.replication_backend, timeout_s=self.timeout_s)
            self._par_group = self._mirror_parallelization_group()
            self._transport = P2PTransport(self._group, timeout=self.timeout_s)
            if self._replicator is None:
                self._replicator = PeerReplicator(self._transport, self.placement, self.store, self.rank)
        return self._group

    def _control_group(self):
        """Group of every rank for the calling thread's collectives (see ``_ckpt_group``)."""
        self._ckpt_group()
        return self._control

    def _parallel_group(self):
        """The checkpoint's own copy of ``parallelization_group`` (same ranks, this manager's
        backend and timeout): dedup on save and the load exchange never run on the job's
        groups, so a stuck peer surfaces after ``timeout_s`` and a failure cannot leave the
        job's own collectives mismatched."""
        self._ckpt_group()
        return self._par_group

    def _mirror_parallelization_group(self):
        pg = self.parallelization_group
        if pg is None or collectives.group_size(pg) == self.world_size and _is_world(pg):
            return self._control
        mine = sorted(dist.get_process_group_ranks(pg))
        # Every rank must create every group, in the same order (dist.new_group is collective
        # over the world): gather each rank's member list first.
        everyone = collectives.all_gather_msgpack(mine, self._control)
        out = None
        for ranks in sorted({tuple(r) for r in everyone}):
            g = dist.new_group(list(ranks), timeout=timedelta(seconds=self.timeout_s),
                               backend=self.replication_backend)
            if list(ranks) == mine:
                out = g
        return out

    def _persistent_tier(self):
        """The persistent tier, built on first use (collective: it creates its own group)."""
        directory, every, on_sigterm = self._persistent_args
        if self._tier is None and directory is not None:
            from ..persistent.tier import PersistentTier

            self._tier = PersistentTier(
                directory, every_n_saves=every, session=self.session_id, keep_last=self.keep_last
            )
            if on_sigterm:
                self._tier.install_sigterm_handler()
        return self._tier

    def flush(self, iteration: Optional[int] = None):
        """Write the newest complete in-memory iteration (or ``iteration``) to the persistent
        tier in the background (collective); returns a handle with ``wait()``."""
        tier = self._persistent_tier()
        if tier is None:
            raise ValidationError("flush() needs CheckpointManager(persistent_dir=...)")
        self.wait_for_saves()
        return tier.flush(self.store, iteration)

    # ---- save ------------------------------------------------------------------------------------

    def save_local(
        self, state_dict: Any, iteration: int, is_async: bool = True
    ) -> SaveHandle:
        """Snapshot ``state_dict`` (a sharded state dict, an MCoreTensorAwareStateDict, or a
        callable returning one — preferred in loops: if it raises on some ranks, every rank
        still fails this save together instead of waiting for a timeout).

        Returns once the copies have started (``is_async``) or once the checkpoint is complete
        on every rank. Collective on the first call (distribution, checkpoint group).
        """
        t0 = time.perf_counter()
        self._bound_queue()
        group = self._ckpt_group()
        control = self._control_group()
        seq = self._seq
        self._seq += 1
        self._refresh_distribution(seq)
        segment: Optional[Segment] = None
        staging: Optional[StagingHandle] = None
        # A save whose distribution is not cached is a collective step on this thread (the
        # distribution gather; the first save also sizes up an earlier run's data). Every rank
        # votes before it, so a rank whose state function or arguments fail takes every rank
        # out of the step together instead of leaving them in the gather (same decision on all
        # ranks: the cache is dropped in step and the kind of state is the same every save).
        collective = self._distribution is None and self._kind != "tasd"
        try:
            local: Optional[BaseException] = None
            try:
                if callable(state_dict) and not isinstance(state_dict, MCoreTensorAwareStateDict):
                    # Built here so a rank whose state function raises still queues its (failed)
                    # job and votes: peers are told at once and job numbering stays in step.
                    state_dict = state_dict()
                self._check_iteration(iteration)
            except BaseException as e:
                local = e
            if collective:
                collectives.fail_together(local, f"preparing the save of iteration {iteration}", control)
            elif local is not None:
                raise local
            if not self._restored and not self._started:
                self._retire_earlier_run(iteration, control)
            self._started = True
            if isinstance(state_dict, MCoreTensorAwareStateDict) or _is_foreign_tasd(state_dict):
                # Megatron-LM hands Megatron-core's class to a LocalCheckpointManager.
                tasd = MCoreTensorAwareStateDict.adapt(state_dict)
                self._kind = "tasd"
            else:
                # When it is a collective (no cached distribution), every rank reaches it (the
                # vote above), and a bad state dict on one rank raises everywhere together.
                tasd, dist_ = MCoreTensorAwareStateDict.from_state_dict(
                    state_dict,
                    algo="fully_parallel",
                    parallelization_group=self._parallel_group(),
                    cached_metadata=self._distribution,
                    validation_group=control,
                )
                self._distribution = dist_ or self._distribution
                self._kind = "dict"
            self._check_iteration(iteration)
            tensors = list(tasd.tensors)
            layouts, total = plan_layout([(t.dtype, tuple(t.shape)) for t in tensors])
            segment = self._prefetcher.take(total)
            self.store.claim(segment, iteration, self.rank)
            # Copies start first; the hollow form (metadata + common state) is encoded while
            # they run (the copy thread releases the GIL), off the stall's critical path.
            staging = self._stager.stage(tensors, segment, layouts)
            popped = tasd.pop_tensors()
            try:
                meta = tasd.to_bytes()
            finally:
                tasd.insert_tensors(popped)
        except BaseException as e:
            if staging is not None:
                try:
                    staging.wait()  # the segment is in use until its copies finished
                except Exception:
                    pass
            if segment is not None:
                self.store.release(segment)
            self._submit_failed(iteration, seq, group, e)
            raise
        header = CheckpointHeader(
            session=self.session_id,
            iteration=iteration,
            owner=self.rank,
            world_size=self.world_size,
            tensors=tuple(layouts),
            data_nbytes=total,
            meta=meta,
            replication={
                "kind": self.placement.kind,
                "factor": self.placement.replication_factor,
                "jump": self.placement.jump,
                "ranks_per_node": self.placement.ranks_per_node,
            },
        )
        metrics = SaveMetrics(iteration=iteration, bytes_staged=total)
        job = _SaveJob(iteration, segment, header, staging, metrics, t0, seq)
        self._last_saved = iteration
        self.latest_iteration = -1  # invalidates find_latest's cache, like nvidia-resiliency-ext
        future = self._worker.submit(self._finish_save, job, group)
        with self._lock:
            self._in_flight.append((iteration, future))
        metrics.stall_s = time.perf_counter() - t0
        handle = SaveHandle(iteration, staging, future, metrics)
        if not is_async:
            handle.wait_staged()
            handle.wait()
        return handle

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
            except OSError as e:
                local = e
        if self.rank == 0:
            logger.warning(
                "session %r: this job did not restore before saving iteration %d, so it starts "
                "fresh; retiring iterations %s of an earlier run held in memory (call load_local() "
                "or CheckpointHook.restore() before the first save to resume them instead)",
                self.session_id, iteration, sorted({it for it, _ in stale}),
            )
        collectives.fail_together(local, "retiring an earlier run's checkpoints", control)

    def _refresh_distribution(self, seq: int) -> None:
        """Drop the cached distribution if a save up to ``seq - 2`` failed (a structure change
        on some rank invalidates it everywhere).

        Decided from jobs that are finished on every rank by now (``_bound_queue`` leaves at most
        the previous job in flight), so all ranks drop it at the same save and the collective
        that recomputes it pairs up. The previous job's outcome counts one save later.
        """
        horizon = seq - 2
        if horizon <= self._dist_checked_upto:
            return
        with self._lock:
            failed = any(self._dist_checked_upto < s <= horizon for s in self._failed_seqs)
        self._dist_checked_upto = horizon
        if failed:
            self._distribution = None

    def _submit_failed(self, iteration: int, seq: int, group, error: BaseException) -> None:
        """Queue the stand-in of a save that failed on this rank before it started."""
        logger.warning("save of iteration %s failed on rank %d: %s", iteration, self.rank, error)
        future = self._worker.submit(self._fail_save, iteration, seq, group, error)
        with self._lock:
            self._in_flight.append((-1, future))

    def _fail_save(self, iteration, seq: int, group, error: BaseException) -> None:
        """Tell the peers at once: an empty replica to every holder, refuse incoming replicas,
        vote no. Nothing is discarded here (this rank created nothing for the save)."""
        if group is not None:
            try:
                self._replicate_nothing()
            except Exception as e:  # expected: our refusals come back as an error
                logger.debug("failed save of iteration %s: exchange: %s", iteration, e)
            try:
                collectives.all_agree(False, group)
            except Exception as e:
                logger.debug("failed save of iteration %s: agreement: %s", iteration, e)
        with self._lock:
            self._failed_seqs.add(seq)

    def _replicate_nothing(self) -> None:
        if self._replicator is not None:
            self._replicator.abstain()

    def _check_iteration(self, iteration: int) -> None:
        if isinstance(iteration, bool) or not isinstance(iteration, int):
            raise ValidationError(f"iteration must be an int, got {type(iteration).__name__}")
        if not 0 <= iteration <= MAX_ITERATION:
            raise ValidationError(f"iteration {iteration} outside [0, 2**63-1]")
        if iteration <= self._last_saved:
            raise ValidationError(
                f"iteration {iteration} does not increase (last saved or restored: "
                f"{self._last_saved}); iterations going backwards would overwrite newer state — "
                "pass the training step, which only grows"
            )

    def _bound_queue(self) -> None:
        with self._lock:
            while self._in_flight and self._in_flight[0][1].done():
                self._in_flight.popleft()
            oldest = self._in_flight[0][1] if len(self._in_flight) >= 2 else None
        if oldest is not None:
            try:
                oldest.result()
            except Exception:
                pass  # its own handle reports it

    def _fault(self, point: str) -> None:
        if self.fault_hook is not None:
            self.fault_hook(point)

    def _finish_save(self, job: _SaveJob, group) -> SaveMetrics:
        m = job.metrics
        ok = False
        received: List[CheckpointId] = []
        error: Optional[BaseException] = None
        replicating = False
        try:
            t = time.perf_counter()
            job.staging.wait()
            m.staging_s = time.perf_counter() - t
            self._fault("after_staging")
            t = time.perf_counter()
            header = _with_checksums(job.header, job.segment)
            m.checksum_s = time.perf_counter() - t
            t = time.perf_counter()
            self.store.publish(job.segment, header)
            m.publish_s = time.perf_counter() - t
            self._fault("after_publish")
            t = time.perf_counter()
            self._fault("before_replication")
            replicating = True
            received = self._replicate(header, job.segment, m)
            m.replication_s = time.perf_counter() - t
            self._fault("after_replication")
            ok = True
        except BaseException as e:  # reported after agreement, so peers are not left waiting
            error = e
            logger.warning("save of iteration %d failed on rank %d: %s", job.iteration, self.rank, e)
        finally:
            job.segment.close()
        if not replicating and group is not None:
            # Failed before the exchange: take part in it anyway (empty replicas, refusals),
            # so holders and sources learn now instead of after the transport timeout.
            try:
                self._replicate_nothing()
            except Exception as e:
                logger.debug("failed save of iteration %d: exchange: %s", job.iteration, e)
        t = time.perf_counter()
        try:
            self._fault("before_agreement")
        except BaseException as e:  # still vote (no), so peers are not left waiting
            ok = False
            error = error or e
        try:
            agreed = collectives.all_agree(ok, group) if group is not None else ok
        except Exception as e:
            agreed = False
            error = error or e
        m.agreement_s = time.perf_counter() - t
        m.durable_s = time.perf_counter() - job.t_start
        if not agreed:
            self._discard_failed(job.iteration, received)
            # A structure change on some rank invalidates the cached distribution everywhere
            # (applied in step on every rank, see _refresh_distribution).
            with self._lock:
                self._failed_seqs.add(job.seq)
            raise CheckpointingException(
                f"local checkpoint of iteration {job.iteration} is not complete on every rank "
                f"(this rank: {'ok' if ok else repr(error)}); the previous complete iteration "
                f"{self._complete[-1] if self._complete else 'none'} stays loadable"
            ) from error
        self._complete.append(job.iteration)
        if self._tier is not None:
            # Every rank reaches this at the same save (after the agreement), so the tier's
            # collective flush rounds pair up.
            try:
                self._tier.maybe_flush(self.store, job.iteration)
            except Exception as e:
                logger.warning("persistent flush after iteration %d not started: %s", job.iteration, e)
        try:
            self._retire()
        except OSError as e:  # the save itself is complete; retiring is retried next time
            logger.warning("could not retire old checkpoints in %s: %s", self.store.dir, e)
        self._prefetcher.prefetch(job.header.data_nbytes)
        self.last_save_metrics = m
        logger.debug("saved iteration %d: %s", job.iteration, m.as_dict())
        return m

    def _replicate(self, header: CheckpointHeader, segment: Segment, m: SaveMetrics) -> List[CheckpointId]:
        """Hand the published checkpoint to the replicator (peers or the node daemon)."""
        if self._replicator is None:
            if self.placement.holders_of(self.rank) or self.placement.sources_for(self.rank):
                raise ReplicationError("replication needs an initialized process group")
            return []
        result = self._replicator.replicate(header, segment)
        m.bytes_replicated_out = result.bytes_out
        m.bytes_replicated_in = result.bytes_in
        return result.received

    def _discard_failed(self, iteration: int, received: List[CheckpointId]) -> None:
        """Remove what this save created: its own checkpoint and the replicas it published
        (not other ids of that iteration, which may predate this save)."""
        self.store.discard(CheckpointId(iteration, self.rank, self.session_id))
        for cid in received:
            self.store.discard(cid)

    def _retire(self) -> None:
        """Keep the newest ``keep_last`` complete iterations and anything newer (in flight)."""
        kept = sorted(set(self._complete))[-self.keep_last :]
        self._complete = kept
        threshold = kept[0]
        if self._tier is not None:
            # A flush reading an older iteration from the store keeps it alive until done.
            threshold = min([threshold, *self._tier.pinned_iterations()])
        for cid in self.store.list():
            if cid.iteration < threshold and self._is_ours(cid):
                self.store.discard(cid)

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

    # ---- find / load -------------------------------------------------------------------------

    def _holdings(self, failure: Optional[BaseException] = None) -> Holdings:
        return gather_holdings(self.store, self._control_group(), self.world_size, failure)

    def find_latest(self) -> int:
        """Newest iteration whose every rank's data is held somewhere (collective); -1 if none."""
        self.wait_for_saves()
        holdings = self._holdings()
        self._raise_if_only_foreign(holdings)
        complete = holdings.complete_iterations(self.world_size)
        self.latest_iteration = complete[0] if complete else -1
        return self.latest_iteration

    def _raise_if_only_foreign(self, holdings: Holdings) -> None:
        complete = holdings.complete_iterations(self.world_size)
        notes = sorted({n for per in holdings.foreign for n in per})
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
        """
        t0 = time.perf_counter()
        # Local steps that may fail on one rank only travel with the next collective, so every
        # rank stops together (never a peer left in a gather until a timeout).
        local: Optional[BaseException] = None
        try:
            targets = template_targets(template) if template is not None else {}
        except Exception as e:
            local, targets = e, {}
        tier = self._persistent_tier()
        holdings = None
        if tier is not None:
            out, holdings = self._maybe_load_persistent(tier, template, t0, local)
            if out is not None:
                return out
        retrieved, iteration = self._retrieve_latest(
            borrow=True, targets=targets, holdings=holdings, failure=local,
            template=template, strict=strict,
        )
        if retrieved is None:
            return None
        tasd = self._decode(retrieved, iteration)
        extra: Dict[Any, torch.Tensor] = {}
        try:
            # Replicas of lost ranks that this rank verified: it serves their shards below.
            for hdr, views in retrieved.serving.values():
                replica = MCoreTensorAwareStateDict.from_bytes(hdr.meta)
                extra.update((st.shard_id, v) for st, v in zip(replica.tensor_metadata, views))
            # Shards the template needs that this rank did not save but a replica in this
            # node's store holds (ring placement puts the previous node's ranks here: typically
            # half of the data-parallel replicated shards): read locally, not over the network.
            if targets and retrieved.served_by is None:
                own = {st.shard_id for st in tasd.tensor_metadata}
                wanted = {sid: t for sid, t in targets.items() if sid not in own and sid not in extra}
                if wanted:
                    extra.update(read_local_shards(self.store, iteration, wanted, skip_owner=self.rank))
        except Exception as e:
            local = e
        collectives.fail_together(local, f"restoring iteration {iteration}", self._control_group())
        t1 = time.perf_counter()
        state = tasd.to_state_dict(
            template if template is not None else tasd.sharded_state_dict,
            algo="fully_parallel",
            exchange_algo=self.exchange_algo,
            parallelization_group=self._parallel_group(),
            strict=strict,
            load_into_template=True,
            extra_held=extra,
            validation_group=self._control_group(),
        )
        borrowed = retrieved.borrowed_storages()
        if borrowed:
            # Views of store segments must not escape: they are recycled by later saves.
            state = map_leaves(
                lambda v: v.clone()
                if isinstance(v, torch.Tensor) and v.device.type == "cpu"
                and v.untyped_storage().data_ptr() in borrowed
                else v,
                state,
            )
        del tasd, retrieved, extra
        self._heal_after_restore()
        m = self.last_load_metrics
        m.to_state_dict_s = time.perf_counter() - t1
        m.total_s = time.perf_counter() - t0
        logger.info(
            "rank %d restored iteration %d from %s (rank %d) in %.3fs",
            self.rank, iteration, m.source, m.source_rank, m.total_s,
        )
        return state, iteration

    def _check_template(self, holdings: Holdings, iteration: int, template: Any, strict) -> None:
        """Collective: raise on every rank, before anything is read into ``template``, if
        restoring ``iteration`` into it would fail a check (keys, shapes, dtypes, layout).
        Each rank vouches for the checkpoints the retrieval plan has it serve, read from its
        node's store (headers only); if any rank cannot read one, the checks run later, as
        part of the load, instead."""
        saved: Optional[List[MCoreTensorAwareStateDict]] = []
        try:
            plan = plan_retrieval(
                {r: r for r in range(self.world_size)}, holdings.available(iteration),
                holdings.node_of, holdings.nbytes(iteration),
            )
            for f in plan:
                if f.source == self.rank:
                    header = self.store.read_header(CheckpointId(iteration, f.owner, self.session_id))
                    saved.append(MCoreTensorAwareStateDict.from_bytes(header.meta))
        except (CheckpointingException, OSError) as e:
            logger.debug("cannot vouch for iteration %d before restoring it: %s", iteration, e)
            saved = None
        check_restorable(template, saved, self._parallel_group(), strict,
                         validation_group=self._control_group())

    def _warn_unrestorable(self, holdings: Holdings) -> None:
        """Memory holds none of this job's checkpoints in full: say so loudly when it holds
        part of one (a node lost with its only copy) — progress is lost unless a fallback has
        it. Same facts on every rank, so the same warning everywhere."""
        held: Dict[int, Set[int]] = {}
        for per in holdings.ids:
            for it, owner in per:
                held.setdefault(it, set()).add(owner)
        if held:
            newest = max(held)
            missing = sorted(set(range(self.world_size)) - held[newest])
            self.last_load_metrics = LoadMetrics(source="none", missing_owners=missing, iteration=-1)
            fallback = (
                f"the persistent tier {self._tier.directory} is tried first" if self._tier is not None
                else "no persistent tier is configured (CheckpointManager(persistent_dir=...))"
            )
            logger.warning(
                "session %r: memory holds iterations %s but none completely: the newest, %d, "
                "lacks the data of ranks %s (their node and every replica are gone; "
                "replication_factor=%d). Nothing can be restored from memory; %s — restore from "
                "your own checkpoint or the run restarts from scratch",
                self.session_id, sorted(held, reverse=True)[:5], newest, _ranges(missing),
                self.placement.replication_factor, fallback,
            )
            return
        others = self.store.other_sessions()
        if others:
            logger.warning(
                "no complete checkpoint of session %r in %s; the same root holds checkpoints "
                "of sessions %s (pass session_id=... to restore one of them)",
                self.session_id, self.store.root, others[:5],
            )

    def _heal_after_restore(self) -> None:
        """Re-create, in the background, every copy of the restored iteration that the
        placement asks for and no store holds (a replaced node's own data and the replicas it
        keeps): until then a second failure could lose progress. Runs on the save thread, so
        it finishes before the next save replicates; ``wait_healed()`` waits for it.
        Decided from the restore's gathered facts: every rank schedules it, or none."""
        facts, self._restore_facts = self._restore_facts, None
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
                iteration, metrics.copies, _ranges(sorted({r.owner for r in plan.repairs})),
                metrics.bytes / (1 << 20),
            )
        future = self._worker.submit(self._heal, plan, metrics, time.perf_counter())
        self._healing = future
        with self._lock:
            self._in_flight.append((-1, future))

    def _heal(self, plan: RepairPlan, m: HealMetrics, t0: float) -> HealMetrics:
        error: Optional[BaseException] = None
        try:
            res = self._replicator.repair(m.iteration, plan.repairs)
            m.bytes_in, m.bytes_out = res.bytes_in, res.bytes_out
        except Exception as e:
            error = e
        try:
            agreed = collectives.all_agree(error is None, self._group)
        except Exception as e:
            agreed, error = False, error or e
        m.seconds = time.perf_counter() - t0
        m.whole = agreed and not plan.unrepairable
        self.last_heal_metrics = m
        if m.whole:
            if self.rank == 0:
                logger.warning(
                    "redundancy of iteration %d is whole again: %d copies (%.1f MiB) re-created "
                    "in %.2fs", m.iteration, m.copies, m.bytes / (1 << 20), m.seconds,
                )
        else:
            logger.warning(
                "redundancy of iteration %d not restored (%s); the next complete save restores "
                "it — until then one more failure may lose progress",
                m.iteration,
                error or f"no copy left of owners {_ranges(list(m.unrepairable))}",
            )
        return m

    def wait_healed(self, timeout: Optional[float] = None) -> Optional[HealMetrics]:
        """Block until the healing that followed the last restore finished; its metrics
        (``whole``: every copy is back), or None if no healing was needed."""
        if self._healing is None:
            return None
        return self._healing.result(timeout)

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
                    iteration, self.rank, e,
                )
        return gather_holdings(self.store, group, self.world_size)

    def _maybe_load_persistent(
        self, tier, template, t0: float, failure: Optional[BaseException] = None
    ) -> Tuple[Optional[Tuple[Any, int]], Holdings]:
        """Load from the persistent tier if it is newer than memory (decided collectively).
        Returns (result or None, the gathered holdings, reused by the memory path)."""
        self.wait_for_saves()
        holdings = self._holdings(failure)
        self._raise_if_only_foreign(holdings)
        complete = holdings.complete_iterations(self.world_size)
        in_memory = complete[0] if complete else -1
        durable = tier.agreed_latest()
        if durable is None or durable.iteration <= in_memory:
            return None, holdings
        if in_memory < 0:
            logger.warning(
                "no complete in-memory checkpoint; restoring iteration %d from the persistent tier %s",
                durable.iteration, tier.directory,
            )
        out = tier.load(template, self._parallel_group())
        if out is None:
            return None, holdings
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
        return out, holdings

    def _retrieve_latest(
        self,
        borrow: bool = False,
        targets=None,
        holdings: Optional[Holdings] = None,
        failure: Optional[BaseException] = None,
        template: Any = None,
        strict: StrictHandling = StrictHandling.ASSUME_OK_UNEXPECTED,
    ) -> Tuple[Optional[Retrieved], int]:
        self.wait_for_saves()
        control = self._control_group()
        if holdings is None:  # else gathered just before, after the same drain
            holdings = gather_holdings(self.store, control, self.world_size, failure)
            self._raise_if_only_foreign(holdings)
        complete = holdings.complete_iterations(self.world_size)
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
        last_error: Optional[BaseException] = None
        for iteration in complete:
            self._drop_abandoned(newer_than=iteration)
            if self._client is not None:
                holdings = self._pull_missing(holdings, iteration, control)
            if template is not None:
                # Before any byte lands in the template: a restore that cannot succeed leaves
                # the caller's tensors untouched on every rank.
                self._check_template(holdings, iteration, template, strict)
            try:
                retrieved = retrieve(
                    self.store, holdings, iteration, control, self._transport, self.rank,
                    self.world_size, borrow=borrow, targets=targets,
                )
                break
            except (CorruptCheckpointError, NoReplicaError) as e:
                # Decided from gathered facts, so every rank falls back together.
                logger.warning(
                    "iteration %d cannot be restored (%s); falling back to the previous complete "
                    "iteration", iteration, e,
                )
                last_error = e
        else:
            raise CheckpointingException(
                f"no complete iteration could be restored (tried {complete}); last error: "
                f"{last_error}"
            ) from last_error
        self._restored = True
        self._restore_facts = (holdings, iteration)
        self.latest_iteration = iteration
        # The restored iteration defines the timeline (also for an in-process restart): newer
        # ones were abandoned above, so the trainer may save those iteration numbers again.
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
        return retrieved, iteration

    # ---- nvidia-resiliency-ext LocalCheckpointManager compatibility ---------------------------

    def save(self, state_dict: MCoreTensorAwareStateDict, iteration: int, is_async: bool = False):
        """``LocalCheckpointManager.save``: returns an nvidia-resiliency-ext ``AsyncRequest``
        when ``is_async`` (its work runs in our own thread; the finalize step waits and raises)."""
        handle = self.save_local(state_dict, iteration, is_async=True)
        handle.wait_staged()
        if not is_async:
            handle.wait()
            return None
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

        return AsyncRequest(_noop, (), [lambda: handle.wait() and None])

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
        return tasd, (iteration, self.rank, self.session_id)

    def _drop_abandoned(self, newer_than: int) -> None:
        """Discard this node's checkpoints newer than the iteration being restored: saves that
        never completed (a crash mid-save) or that cannot be restored. The restarted job saves
        those iterations again and must not find them taken. Other jobs' files (foreign) are
        left alone."""
        try:
            cids = self.store.list()
        except OSError as e:
            logger.warning("could not list %s: %s", self.store.dir, e)
            return
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
                cid.stem(), self.store.dir, newer_than,
            )
            try:
                self.store.discard(cid)
            except OSError as e:
                logger.warning("could not discard %s: %s", cid.stem(), e)

    def _decode(self, retrieved: Retrieved, iteration: int) -> MCoreTensorAwareStateDict:
        """The restored state dict, with tensors on their devices. Collective: a rank that cannot
        decode its checkpoint makes every rank raise (never some ranks loading while others
        fail)."""
        tasd = None
        local: Optional[BaseException] = None
        try:
            tasd = retrieved.hollow or MCoreTensorAwareStateDict.from_bytes(retrieved.header.meta)
            if retrieved.served_by is not None:
                # Lost node: the holder of the replica serves this rank's shards in the exchange.
                tasd = tasd.holding_nothing()
            else:
                tasd.insert_tensors(retrieved.tensors)
                _restore_devices(tasd)
        except Exception as e:
            local = e
        try:
            collectives.gather_or_fail(None, local, f"rebuilding the state dict of iteration {iteration}",
                                       self._control_group())
            assert tasd is not None
            return tasd
        except PeerFailedError as e:
            rank, reason = e.rank, e.reason
        except Exception:
            if local is None:
                raise
            rank, reason = self.rank, collectives.describe(local)
        raise CheckpointingException(
            f"rank {rank} could not rebuild its state dict from iteration {iteration}: "
            f"{reason}; every rank stops (the checkpoint was written by an incompatible "
            "resilient_ckpt or with a type this process has not registered)"
        ) from local

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued saves and release threads and the spare segment (store files stay)."""
        self.wait_for_saves()
        if self._tier is not None:
            self._tier.close()
        if self._client is not None:
            self._client.close()
        self._worker.shutdown(wait=True)
        self._stager.shutdown()
        self._prefetcher.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _session_id(given: Optional[str]) -> str:
    """The session id: the one given (validated), else one the launch makes unique among the
    jobs running at the same time and stable across their restarts — never a shared default
    that would let two jobs on a node retire each other's checkpoints."""
    if given is not None:
        return validate_session_id(given)
    env = os.environ
    run_id = env.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":  # torchrun's own default rendezvous id is "none"
        derived, source = run_id, "TORCHELASTIC_RUN_ID (torchrun)"
    elif env.get("SLURM_JOB_ID"):
        derived, source = f"slurm-{env['SLURM_JOB_ID']}", "SLURM_JOB_ID"
    elif env.get("MASTER_PORT"):
        # Two jobs running at once cannot share a rendezvous address and port.
        derived = f"job-{env.get('MASTER_ADDR', 'localhost')}-{env['MASTER_PORT']}"
        source = "MASTER_ADDR/MASTER_PORT (a restart on another port will not find it)"
    else:
        derived, source = "default", "nothing (no launcher variables; two such jobs on a node share it)"
    derived = re.sub(r"[^A-Za-z0-9._+=@:-]", "_", derived).lstrip(".")[:200] or "default"
    stable = source.startswith(("TORCHELASTIC", "SLURM"))
    logger.log(
        logging.INFO if stable else logging.WARNING,
        "no session_id given: using %r, derived from %s; pass CheckpointManager(session_id=...) "
        "naming the job so its restarts find its checkpoints", derived, source,
    )
    return derived


def _ranges(ranks: List[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5' (lists of lost ranks get long)."""
    out: List[str] = []
    for r in ranks:
        if out and out[-1].split("-")[-1] == str(r - 1):
            out[-1] = f"{out[-1].split('-')[0]}-{r}"
        else:
            out.append(str(r))
    return ", ".join(out)


def _is_world(group) -> bool:
    return group is dist.GroupMember.WORLD or group is dist.group.WORLD


def _noop() -> None:
    return None


def _is_foreign_tasd(obj: Any) -> bool:
    from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

    return isinstance(obj, TensorAwareStateDict) and not isinstance(obj, MCoreTensorAwareStateDict)


def _with_checksums(header: CheckpointHeader, segment: Segment) -> CheckpointHeader:
    from dataclasses import replace

    if not header.data_nbytes:
        return header
    mv = checksum.byte_view(segment.buffer)
    tensors = tuple(
        replace(l, checksum=checksum.digest(mv[l.offset : l.offset + l.nbytes])) for l in header.tensors
    )
    return replace(header, tensors=tensors)


def _restore_devices(tasd: MCoreTensorAwareStateDict) -> None:
    """Move restored tensors to the devices they were saved from, when this host has them."""
    devices = {d for d in tasd.pending_devices if d}
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        logger.warning("checkpoint was saved from CUDA tensors; restoring on CPU (no GPU here)")
        return
    tasd.restore_tensor_device(non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
