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
from collections import deque
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch.distributed as dist

from ..errors import StoreError, ValidationError
from ..memory import transfer
from ..memory.segment import Segment
from ..memory.staging import SegmentPrefetcher, Stager
from ..memory.store import DEFAULT_ROOT, CheckpointStore, validate_session_id
from ..parallel import collectives
from ..replication.parity import ParityGroup, parity_groups
from ..replication.placement import Placement, clique_placement, ring_placement
from ..replication.replicator import Replicator
from ..replication.transport import P2PTransport
from ..thread_pools import background_executor
from .async_request import LocalAsyncRequest, SaveDoneSignal, request_for
from .elastic import ElasticLoad
from .groups import FailureCount, GroupRenewal, SaveWorker
from .healing import Healing
from .loading import LoadPath
from .metrics import HealMetrics, LoadMetrics, SaveHandle, SaveMetrics
from .options import (
    FLAT,
    PersistentOptions,
    ReplicationOptions,
    ServiceOptions,
    ranks_per_node,
    resolve,
    service_endpoint,
)
from .restore import Holdings, store_identity
from .saving import FAULT_POINTS, MAX_ITERATION, SavePath

__all__ = [
    "FAULT_POINTS",
    "MAX_ITERATION",
    "CheckpointManager",
    "HealMetrics",
    "LoadMetrics",
    "PersistentOptions",
    "ReplicationOptions",
    "SaveHandle",
    "SaveMetrics",
    "ServiceOptions",
]

logger = logging.getLogger(__name__)


class CheckpointManager(GroupRenewal, SavePath, LoadPath, ElasticLoad, Healing):
    """In-memory local checkpoints with peer replication (embedded mode).

    Options come as groups — ``replication=ReplicationOptions(...)``,
    ``persistent=PersistentOptions(...)``, ``service=ServiceOptions(...)`` (see
    ``manager.options``) — or as the flat keyword arguments below, which keep working; one value
    given both ways with two meanings raises. ``manager.options`` holds the resolved result.

    With torch.distributed initialized, constructing the manager is collective (it makes the
    checkpoint's gloo groups, as nvidia-resiliency-ext's manager does with its replication
    strategy): every rank constructs its manager, in the same order relative to the job's
    own ``new_group`` calls.

    Args:
        session_id: names the job; a store never loads (or retires) another session's data.
            Default: ``TORCHELASTIC_RUN_ID`` under torchrun, ``slurm-$SLURM_JOB_ID`` under
            Slurm, else ``job-$MASTER_ADDR-$MASTER_PORT`` (unique among running jobs, with a
            warning: a restart on another port would not find it). Validated: letters, digits
            and ``._+=@:-``.
        store_root: tmpfs directory of this node's store.
        replication_factor: copies of each rank's data (1 = no replication; default 2).
        replication_jump: rank distance between copies (default: ranks per node, from
            ``LOCAL_WORLD_SIZE``) so copies land on other nodes.
        keep_last: complete iterations kept in memory (default 1: the newest complete
            iteration, the retention nvidia-resiliency-ext has). More keep older iterations
            restorable, at one more copy each.
        spare_segment: keep the next save's segment allocated, populated and — GPU state —
            page-locked between saves (default on), so the save copies at memory speed (GPU:
            device-to-host at the link's rate) instead of into fresh pages (measured: 14 ms vs
            72 ms per 162 MiB on 2 vCPUs), at the cost of one more copy of the rank's own
            bytes in the store (nvidia-resiliency-ext holds as much in its host copy); with
            ``keep_last=1`` retired replicas are pooled for the next ones to land in populated
            pages (the store's peak, reached while a save completes, is unchanged). ``False``:
            the least memory between saves, everything retired is freed.
        device_snapshot: GPU state saved when no page-locked segment is ready (the first save
            after a start, a new size): ``"auto"`` (default) copies it within the GPU first
            when the GPU has room, so the save's stall ends there and the way down to the store
            runs in the background; ``"always"`` does so on every save; ``"never"`` copies
            into pageable memory instead (synchronous).
        background_nice: how many nice levels below the training thread a save's background
            work runs (checksums, the next segment's pages, landing replicas' pages, the
            checkpoint data group's gloo threads that move the bytes; Linux; 0 to 19, default
            0: the same). Made for a checkpoint every step with
            ``CheckpointHook(when_busy="skip_in_background")`` on cores the training keeps
            busy: at 19 the background takes what the training leaves idle instead of
            descheduling it mid-step and mid-save (2 vCPUs, 2 ranks: the step +50-55 % at 0,
            +17-19 % at 19), and saves come as often as those idle cycles allow (a due save
            meanwhile is skipped). Not with ``when_busy="queue"``: a third save waits on the
            training thread for the oldest, which would then crawl. What the training thread
            waits for keeps its priority: the copies out of the training state (the next
            optimizer step waits for them), the save thread, the votes.
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
        redundancy: ``"replicas"`` (default: ``replication_factor`` full copies) or
            ``"parity"``: ranks of ``parity_group + parity_shares`` different nodes form a group
            whose members store erasure-coded parity of each other (RAID-5 style rotation: each
            rank keeps ``parity_shares / parity_group`` of its own bytes as parity); any
            ``parity_shares`` lost nodes of a group are rebuilt from the survivors at restore.
            Any world size (leftover ranks form a smaller group). Embedded mode only.
        parity_group: k, data blocks per stripe (memory overhead m/k, rebuild reads k blocks).
        parity_shares: m, 1 (XOR) or 2 (Reed-Solomon via zfec: survives two lost nodes).
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
        allow_pickle: store values the pickle-free codec cannot encode (and tensor-aware state
            dicts other than Megatron-core's) pickled, and unpickle them on load. Only for data
            that never leaves the job: unpickling runs code.
        endpoint: this node's daemon, e.g. ``tcp://127.0.0.1:7555`` (default from
            ``RESILIENT_CKPT_ENDPOINT``); the job secret comes from ``RESILIENT_CKPT_SECRET`` or
            ``RESILIENT_CKPT_SECRET_FILE``.
    """

    def __init__(
        self,
        session_id: Optional[str] = None,
        store_root: str = DEFAULT_ROOT,
        replication_factor: Optional[int] = None,
        replication_jump: Optional[int] = None,
        keep_last: int = 1,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        *,
        spare_segment: bool = True,
        device_snapshot: str = "auto",
        background_nice: int = 0,
        replication: Optional[ReplicationOptions] = None,
        persistent: Optional[PersistentOptions] = None,
        service: Optional[ServiceOptions] = None,
        placement: str = "ring",
        ranks_per_node: Optional[int] = None,
        memory_budget: Optional[int] = None,
        timeout_s: float = 120.0,
        exchange_algo: str = "p2p",
        fault_hook: Optional[Callable[[str], None]] = None,
        replication_backend: str = "gloo",
        redundancy: str = "replicas",
        parity_group: int = 4,
        parity_shares: int = 1,
        session: Optional[str] = None,
        persistent_dir: Optional[str] = None,
        flush_every: int = 0,
        flush_on_sigterm: bool = False,
        mode: Optional[str] = None,
        endpoint: Optional[str] = None,
        allow_pickle: bool = False,
    ):
        if redundancy == "parity" and replication_factor is not None:
            raise ValidationError(
                f"replication_factor={replication_factor} and redundancy='parity' are two redundancy "
                "schemes; pass one: parity_group/parity_shares for parity, or redundancy='replicas'"
            )
        flat = {k: v for k, v in locals().items() if k in FLAT and v is not None}
        self.options = opts = resolve(
            flat,
            replication,
            persistent,
            service,
            mode,
            store_root=store_root,
            keep_last=keep_last,
            spare_segment=spare_segment,
            device_snapshot=device_snapshot,
            background_nice=background_nice,
            memory_budget=memory_budget,
            timeout_s=timeout_s,
            exchange_algo=exchange_algo,
            fault_hook=fault_hook,
            allow_pickle=allow_pickle,
        )
        self.session_id = _session_id(session_id if session_id is not None else session)
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.keep_last = opts.keep_last
        self.spare_segment = bool(opts.spare_segment)
        self.background_nice = opts.background_nice
        self.parallelization_group = parallelization_group
        self.timeout_s = opts.timeout_s
        self.exchange_algo = opts.exchange_algo
        self.fault_hook = opts.fault_hook
        self.replication_backend = opts.replication.backend
        self.mode = opts.mode
        self.placement: Placement = self._make_placement(opts.replication)
        self.parity_groups = self._make_parity_groups()
        self.store = CheckpointStore(opts.store_root, self.session_id, self.world_size, opts.memory_budget)
        self._init_state()
        self._client = None
        if self.mode == "service":
            self._connect_daemon(service_endpoint(opts))
        if dist.is_initialized() and self.world_size > 1:
            # Collective, like nvidia-resiliency-ext's manager and its replication strategy:
            # the groups are made when every rank constructs its manager, not inside the first
            # save or restore (a restart's restore paid ~3 ms of its ~70 at 256 MiB for them).
            self._connect_groups()

    #: LocalCheckpointManager: holders on the owner's node are dropped, not refused
    _skip_same_node = False

    def _make_parity_groups(self) -> Tuple[ParityGroup, ...]:
        """The parity groups (``redundancy="parity"``), from the placement's nodes; () else."""
        rep = self.options.replication
        if rep.redundancy != "parity":
            return ()
        if self.world_size == 1:
            logger.warning(
                "a single process has no peer to hold parity: checkpoints stay in this node's memory only"
            )
            return ()
        return parity_groups(
            self.world_size, self.placement.ranks_per_node, rep.parity_group, rep.parity_shares
        )

    def _make_placement(self, rep: ReplicationOptions, rpn: Optional[int] = None) -> Placement:
        factor = 1 if rep.redundancy == "parity" else rep.factor
        if self.world_size == 1 and factor > 1:
            logger.warning(
                "a single process has no peer to hold a replica: checkpoints stay in this node's "
                "memory only (replication_factor=%d ignored)",
                factor,
            )
            factor = 1
        rpn = rpn or ranks_per_node(self.options)
        nodes = -(-self.world_size // rpn) if rpn else self.world_size
        if rep.placement == "ring" and factor > nodes:
            # A job resumed on fewer nodes (no replacement came: see manager.elastic) keeps
            # running with as many copies as it has nodes, rather than refusing to start.
            if self.rank == 0:
                logger.warning(
                    "replication_factor=%d needs %d nodes, this job spans %d (%d ranks, %s per node): "
                    "keeping %d cop%s of each rank's data until it runs on more nodes",
                    factor,
                    factor,
                    nodes,
                    self.world_size,
                    rpn,
                    nodes,
                    "y" if nodes == 1 else "ies",
                )
            factor = nodes
        if rep.placement == "ring":
            return ring_placement(self.world_size, factor, rep.jump, ranks_per_node=rpn)
        return clique_placement(self.world_size, factor, rep.jump, rpn, skip_same_node=self._skip_same_node)

    def _check_shared_stores(self) -> None:
        """Ranks sharing one store (one node's tmpfs) must count as one node: a replica sent to
        a rank of the owner's own store would land on the owner's own files. Collective (once,
        with the groups). When the placement's ranks per node (LOCAL_WORLD_SIZE) split ranks
        that share a store into different nodes, the sharing decides, if it forms contiguous
        equal blocks; otherwise the layout is refused with the fix."""
        everyone = collectives.all_gather_msgpack(store_identity(self.store), self._control)
        p = self.placement
        first: dict = {}
        for r, e in enumerate(everyone):
            first.setdefault(e, r)
        if all(p.node_of(r) == p.node_of(first[e]) for r, e in enumerate(everyone)):
            return
        rpn = everyone.count(everyone[0])
        blocks = all(everyone[r] == everyone[(r // rpn) * rpn] for r in range(self.world_size))
        if not blocks or len(set(everyone)) != -(-self.world_size // rpn):
            raise StoreError(
                f"ranks share stores in a pattern that is not contiguous blocks of ranks per node "
                f"(store of each rank: {[sorted(set(everyone)).index(e) for e in everyone]}); give "
                "each node's ranks consecutive ranks (torchrun does) or one store_root per rank"
            )
        logger.warning(
            "ranks 0-%d share the store %s (one node) but ranks_per_node/LOCAL_WORLD_SIZE is %d: "
            "treating every %d consecutive ranks as one node, so no replica lands in its owner's "
            "own store; set LOCAL_WORLD_SIZE=%d to silence this",
            rpn - 1,
            self.store.dir,
            p.ranks_per_node,
            rpn,
            rpn,
        )
        self.placement = self._make_placement(self.options.replication, rpn)
        self.parity_groups = self._make_parity_groups()

    def _init_state(self) -> None:
        """Threads, the slots of the groups (the constructor makes them) and the bookkeeping of
        saves and loads."""
        self._stager = Stager()
        transfer.prestart_readers()  # a restore's reads then start at once (memory.transfer)
        # Pinned ahead only once a save staged GPU tensors (a CPU-only job on a GPU host never
        # page-locks its segments).
        self._prefetcher = SegmentPrefetcher(self.store, pin=False, nice=self.background_nice)
        self._worker = SaveWorker()
        #: the payload's checksums while replication sends it (manager.saving)
        self._checksummer = background_executor("resilient_ckpt-checksum", self.background_nice)
        #: group renewal after failures (manager.groups): this thread's call depth, the failed
        #: calls counted alike on every rank, and that count when the groups were last renewed;
        #: the same for the calling thread's own failures (no lag: known alike at the next call)
        self._calls = threading.local()
        self._failures = FailureCount()
        self._renewed_after_failures = 0
        self._calls_failed = 0
        self._renewed_after_calls = 0
        self._group: Optional[dist.ProcessGroup] = None
        self._control: Optional[dist.ProcessGroup] = None
        self._par_group: Optional[dist.ProcessGroup] = None
        self._dcp_group: Optional[dist.ProcessGroup] = None  # made on demand (dcp_process_group)
        self._transport: Optional[P2PTransport] = None
        self._replicator: Optional[Replicator] = None
        #: what the last general-path save established (distribution, and what a cached save
        #: of the same structure reuses: manager.saving); None until then or after a failure
        self._structure = None
        self._in_flight: Deque[Tuple[int, Future]] = deque()
        #: saves skipped on every rank because an earlier one was in flight (skip_if_busy)
        self.saves_skipped = 0
        #: saves that vote in the background (manager.saving): every rank's structure cache
        #: holds, as the last answer every rank received said, and that call's vote unanswered
        self._caches_agreed = False
        self._pending_vote = None
        self._settled_least: Optional[int] = None
        #: this rank's complete checkpoints' segments, kept mapped (GPU state: page-locked)
        #: until retired, when one becomes the next save's spare (manager.saving)
        self._own_segments: Dict[int, Segment] = {}
        self._last_saved = -1
        #: "tasd" or "dict": what save_local was given (decides whether a save is collective)
        self._kind: Optional[str] = None
        #: a checkpoint was restored by this manager
        self._restored = False
        self._integrity_checked_for = None  # the template check_restorable validated (load_local)
        self._restore_check = None  # and what it established (a RestoreCheck)
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
        self._tier = None  # the persistent tier, built on first use

    def _connect_daemon(self, endpoint: str) -> None:
        # Lazy: service mode only (pulls ZeroMQ and the wire protocol into the trainer).
        from ..service.client import DaemonClient
        from ..service.replicator import ServiceReplicator

        self._client = DaemonClient(endpoint, self.session_id, timeout_s=self.timeout_s, rank=self.rank)
        self._replicator = ServiceReplicator(self._client, self.store, self.rank, timeout_s=self.timeout_s)

    # ---- groups ------------------------------------------------------------------------------

    def _ckpt_group(self):
        """The manager's data group (replication, agreement votes: the save thread), made
        with the control and parallelization groups when the manager is (collective: every
        rank constructs its manager)."""
        self._persistent_tier()
        if self._group is None and dist.is_initialized() and self.world_size > 1:
            self._connect_groups()  # used again after close()
        return self._group

    def _connect_groups(self) -> None:
        self._make_groups()  # manager.groups: also what renews them after a failure
        self._check_shared_stores()
        self._make_replicator()

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
            g = dist.new_group(
                list(ranks), timeout=timedelta(seconds=self.timeout_s), backend=self.replication_backend
            )
            if list(ranks) == mine:
                out = g
        collectives.note_timeout(out, self.timeout_s)
        return out

    def _persistent_tier(self):
        """The persistent tier, built on first use (collective: it creates its own group)."""
        p = self.options.persistent
        if self._tier is None and p.directory is not None:
            # Lazy: only with a persistent tier (torch.distributed.checkpoint is heavy to import).
            from ..persistent.tier import PersistentTier

            self._tier = PersistentTier(
                p.directory,
                every_n_saves=p.flush_every,
                session=self.session_id,
                # at least two durable checkpoints whatever memory keeps (a shared file system
                # is not the scarce resource, and the newest may be the one a crash cut short)
                keep_last=max(2, self.keep_last),
            )
            if p.flush_on_sigterm:
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

    # ---- find / load -------------------------------------------------------------------------

    # ---- nvidia-resiliency-ext LocalCheckpointManager compatibility ---------------------------

    def save(self, state_dict: Any, iteration: int, is_async: bool = False) -> Optional[LocalAsyncRequest]:
        """``LocalCheckpointManager.save``. Returns once the optimizer may change the tensors:
        CPU tensors are staged in the node's store, and the copies of GPU tensors are ordered
        before any later work on the current CUDA stream (``SaveHandle.fence``: the GPU waits
        for them, the CPU does not). ``is_async=False``: once the save is complete on every
        rank. ``is_async=True``: an ``AsyncRequest`` for Megatron's ``AsyncCallsQueue`` whose
        worker-side function returns when our save thread has finished (so a non-blocking
        finalize poll never waits on replication) and whose finalize raises if the save failed
        (see ``manager.async_request``)."""
        handle = self.save_local(state_dict, iteration, is_async=True)
        handle.fence()
        if not is_async:
            handle.wait()
            return None
        signal = SaveDoneSignal(self.store.dir / f".save-{self.rank}-{iteration}-{os.getpid()}.inflight")
        handle.add_done_callback(signal.set)
        return request_for(Path(signal.path), lambda: _finalized(handle))

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued saves and release threads, process groups and the spare segment
        (store files stay)."""
        self._settle_vote()  # its collective must end before the groups are released
        self.wait_for_saves()
        if self._tier is not None:
            self._tier.close()
        if self._client is not None:
            self._client.close()
        self._worker.shutdown(wait=True)
        self._checksummer.shutdown(wait=True)
        self._stager.shutdown()
        self._prefetcher.close()
        self._close_own_segments()
        self._release_groups()
        # The structure cache keeps integer views of the model's tensors (their storage, GPU
        # memory too) and a record per shard: a closed manager holds none of it.
        self._structure = None

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
        "naming the job so its restarts find its checkpoints",
        derived,
        source,
    )
    return derived


def _is_world(group) -> bool:
    return group is dist.GroupMember.WORLD or group is dist.group.WORLD


def _finalized(handle: SaveHandle) -> None:
    handle.wait()
