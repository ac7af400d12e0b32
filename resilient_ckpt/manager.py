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
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist

from . import checksum, collectives
from .distribution import ShardDistribution
from .errors import CheckpointingException, ReplicationError, StoreError, ValidationError
from .replication.placement import Placement, clique_placement, ring_placement
from .replication.transport import Incoming, Outgoing, P2PTransport, new_checkpoint_group
from .restore import Holdings, Retrieved, gather_holdings, retrieve
from .staging import SegmentPrefetcher, Stager, StagingHandle
from .store import DEFAULT_ROOT, CheckpointHeader, CheckpointId, CheckpointStore, Segment, plan_layout
from .tensor_aware_state_dict import MCoreTensorAwareStateDict
from .validation import StrictHandling

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


class CheckpointManager:
    """In-memory local checkpoints with peer replication (embedded mode).

    Args:
        session_id: names the job; a store never loads another session's data. Defaults to
            ``TORCHELASTIC_RUN_ID`` under torchrun.
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
        exchange_algo: fully-parallel load exchange, ``"broadcast"`` or ``"p2p"``.
        fault_hook: called with a point name from FAULT_POINTS (tests, chaos drills).
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
        exchange_algo: str = "broadcast",
        fault_hook: Optional[Callable[[str], None]] = None,
    ):
        session_id = session_id or os.environ.get("TORCHELASTIC_RUN_ID") or "default"
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
        self._transport: Optional[P2PTransport] = None
        self._distribution: Optional[ShardDistribution] = None
        self._in_flight: Deque[Tuple[int, Future]] = deque()
        self._last_saved = -1
        self._complete: List[int] = []
        self._lock = threading.Lock()
        self.latest_iteration = -1  # nvidia-resiliency-ext attribute name
        self.last_save_metrics: Optional[SaveMetrics] = None
        self.last_load_metrics: Optional[LoadMetrics] = None

    # ---- groups ------------------------------------------------------------------------------

    def _ckpt_group(self):
        """Created on first use (collective: every rank saves/loads together)."""
        if self._group is None and dist.is_initialized() and self.world_size > 1:
            self._group = new_checkpoint_group(timeout_s=self.timeout_s)
            self._transport = P2PTransport(self._group, timeout=self.timeout_s)
        return self._group

    # ---- save ------------------------------------------------------------------------------------

    def save_local(
        self, state_dict: Any, iteration: int, is_async: bool = True
    ) -> SaveHandle:
        """Snapshot ``state_dict`` (a sharded state dict or an MCoreTensorAwareStateDict).

        Returns once the copies have started (``is_async``) or once the checkpoint is complete
        on every rank. Collective on the first call (distribution, checkpoint group).
        """
        t0 = time.perf_counter()
        self._check_iteration(iteration)
        self._bound_queue()
        group = self._ckpt_group()
        if isinstance(state_dict, MCoreTensorAwareStateDict):
            tasd = state_dict
        else:
            tasd, dist_ = MCoreTensorAwareStateDict.from_state_dict(
                state_dict,
                algo="fully_parallel",
                parallelization_group=self.parallelization_group,
                cached_metadata=self._distribution,
            )
            self._distribution = dist_ or self._distribution
        tensors = list(tasd.tensors)
        layouts, total = plan_layout([(t.dtype, tuple(t.shape)) for t in tensors])
        segment = self._prefetcher.take(total)
        try:
            self.store.claim(segment, iteration, self.rank)
            staging = self._stager.stage(tensors, segment, layouts)
            popped = tasd.pop_tensors()
            try:
                meta = tasd.to_bytes()
            finally:
                tasd.insert_tensors(popped)
        except BaseException:
            self.store.release(segment)
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
            },
        )
        metrics = SaveMetrics(iteration=iteration, bytes_staged=total)
        job = _SaveJob(iteration, segment, header, staging, metrics, t0)
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
            received = self._replicate(header, job.segment, m)
            m.replication_s = time.perf_counter() - t
            self._fault("after_replication")
            ok = True
        except BaseException as e:  # reported after agreement, so peers are not left waiting
            error = e
            logger.warning("save of iteration %d failed on rank %d: %s", job.iteration, self.rank, e)
        finally:
            job.segment.close()
        t = time.perf_counter()
        try:
            self._fault("before_agreement")
            agreed = collectives.all_agree(ok, group) if group is not None else ok
        except CheckpointingException as e:
            agreed = False
            error = error or e
        m.agreement_s = time.perf_counter() - t
        m.durable_s = time.perf_counter() - job.t_start
        if not agreed:
            self._discard_failed(job.iteration, received)
            # A structure change on some rank invalidates the cached distribution everywhere.
            self._distribution = None
            raise CheckpointingException(
                f"local checkpoint of iteration {job.iteration} is not complete on every rank "
                f"(this rank: {'ok' if ok else repr(error)}); the previous complete iteration "
                f"{self._complete[-1] if self._complete else 'none'} stays loadable"
            ) from error
        self._complete.append(job.iteration)
        self._retire()
        self._prefetcher.prefetch(job.header.data_nbytes)
        self.last_save_metrics = m
        logger.debug("saved iteration %d: %s", job.iteration, m.as_dict())
        return m

    def _replicate(self, header: CheckpointHeader, segment: Segment, m: SaveMetrics) -> List[CheckpointId]:
        """Send this rank's checkpoint to its holders; receive the ones this rank holds."""
        holders = self.placement.holders_of(self.rank)
        sources = self.placement.sources_for(self.rank)
        if not holders and not sources:
            return []
        if self._transport is None:
            raise ReplicationError("replication needs an initialized process group")
        raw = header.pack()
        outgoing = [Outgoing(dst, raw, segment.buffer) for dst in holders]
        claimed: List[Tuple[Segment, bytes, CheckpointId]] = []

        def allocate_for(src: int):
            def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
                h = CheckpointHeader.unpack(hdr, source=f"replica header from rank {src}")
                if h.owner != src or h.session != self.session_id or h.iteration != header.iteration:
                    raise ReplicationError(
                        f"rank {src} sent {h.id} while replicating iteration {header.iteration}"
                    )
                seg = self.store.reserve(nbytes)
                self.store.claim(seg, h.iteration, h.owner)
                claimed.append((seg, hdr, h.id))
                return seg.buffer

            return allocate

        incoming = [Incoming(src, allocate_for(src)) for src in sources]
        try:
            stats = self._transport.exchange(outgoing, incoming)
        except BaseException:
            for seg, _, cid in claimed:
                seg.close()
                self.store.discard(cid)
            raise
        ids = []
        for seg, hdr, cid in claimed:
            seg.close()
            self.store.write_raw_header(hdr, cid)
            ids.append(cid)
        m.bytes_replicated_out = stats.bytes_sent
        m.bytes_replicated_in = stats.bytes_received
        return ids

    def _discard_failed(self, iteration: int, received: List[CheckpointId]) -> None:
        self.store.discard(CheckpointId(iteration, self.rank, self.session_id))
        for cid in received:
            self.store.discard(cid)
        for src in self.placement.sources_for(self.rank):
            self.store.discard(CheckpointId(iteration, src, self.session_id))

    def _retire(self) -> None:
        """Keep the newest ``keep_last`` complete iterations and anything newer (in flight)."""
        kept = sorted(set(self._complete))[-self.keep_last :]
        self._complete = kept
        threshold = kept[0]
        doomed = [c for c in self.store.list() if c.iteration < threshold]
        for cid in doomed:
            self.store.discard(cid)

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

    def _holdings(self) -> Holdings:
        group = self._ckpt_group()
        return gather_holdings(self.store, group, self.world_size)

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
        checkpoint's own structure.
        """
        t0 = time.perf_counter()
        retrieved, iteration = self._retrieve_latest()
        if retrieved is None:
            return None
        tasd = MCoreTensorAwareStateDict.from_bytes(retrieved.header.meta)
        tasd.insert_tensors(retrieved.tensors)
        _restore_devices(tasd)
        t1 = time.perf_counter()
        state = tasd.to_state_dict(
            template if template is not None else tasd.sharded_state_dict,
            algo="fully_parallel",
            exchange_algo=self.exchange_algo,
            parallelization_group=self.parallelization_group,
            strict=strict,
        )
        m = self.last_load_metrics
        m.to_state_dict_s = time.perf_counter() - t1
        m.total_s = time.perf_counter() - t0
        logger.info(
            "rank %d restored iteration %d from %s (rank %d) in %.3fs",
            self.rank, iteration, m.source, m.source_rank, m.total_s,
        )
        return state, iteration

    def _retrieve_latest(self) -> Tuple[Optional[Retrieved], int]:
        self.wait_for_saves()
        group = self._ckpt_group()
        holdings = gather_holdings(self.store, group, self.world_size)
        self._raise_if_only_foreign(holdings)
        complete = holdings.complete_iterations(self.world_size)
        if not complete:
            self.latest_iteration = -1
            return None, -1
        iteration = complete[0]
        # Everyone has drained its saves (the gather above is after each rank's drain), so
        # headerless data files are leftovers of a crashed save.
        self.store.sweep_orphans()
        retrieved = retrieve(
            self.store, holdings, iteration, group, self._transport, self.rank, self.world_size
        )
        self.latest_iteration = iteration
        self._last_saved = max(self._last_saved, iteration)
        self._complete = sorted(set(self._complete) | set(complete[: self.keep_last]))
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
        tasd = MCoreTensorAwareStateDict.from_bytes(retrieved.header.meta)
        tasd.insert_tensors(retrieved.tensors)
        _restore_devices(tasd)
        return tasd, (iteration, self.rank, self.session_id)

    # ---- lifecycle -------------------------------------------------------------------------------

    def close(self) -> None:
        """Finish queued saves and release threads and the spare segment (store files stay)."""
        self.wait_for_saves()
        self._worker.shutdown(wait=True)
        self._stager.shutdown()
        self._prefetcher.close()

    def __enter__(self) -> "CheckpointManager":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _noop() -> None:
    return None


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
    devices = {d for d in tasd._devices if d}
    if any(d.startswith("cuda") for d in devices) and not torch.cuda.is_available():
        logger.warning("checkpoint was saved from CUDA tensors; restoring on CPU (no GPU here)")
        return
    tasd.restore_tensor_device(non_blocking=True)
    if torch.cuda.is_available():
        torch.cuda.current_stream().synchronize()
