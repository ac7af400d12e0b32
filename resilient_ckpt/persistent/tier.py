"""The persistent tier: flush in-memory checkpoints to DCP directories, restore from them.

Layout of a tier directory (a file system every rank sees, like any DCP checkpoint)::

    <dir>/iter_0000100/          a complete checkpoint: .metadata, __<rank>_0.distcp,
                                 resilient_ckpt.json (manifest: session, iteration, world size)
    <dir>/.iter_0000200.partial/ a flush in progress (never loaded; renamed when complete)

Flush (:meth:`PersistentTier.flush`, every ``every_n_saves`` complete saves via
:meth:`PersistentTier.maybe_flush`, on SIGTERM, on demand): each rank writes its own
checkpoint of the agreed iteration straight from the node store: the segment is mapped
read-only and every saved tensor is a view of the mapping (no device copy, no extra copy), so
the disk tier writes exactly the shards the memory tier's distribution gave each rank. Work
runs on one named thread (``resilient_ckpt-flush``) over a process group of its own, so it
never interleaves with training collectives. DCP writes ``.metadata`` last and the directory
is renamed into place only after it, so a partial flush is never loadable; older durable
checkpoints are removed only after the new one is complete. After writing, each rank checks
the source bytes against the store's checksums, so a segment retired and reused by a newer
save mid-flush fails the flush instead of writing mixed data.

Rounds: every flush request (periodic, on demand, SIGTERM) is one round of the flush thread,
and every rank issues the same number of requests. A round agrees on the iteration by one
all-reduce (MAX of each rank's candidate: the newest complete iteration it knows, or the one
asked for) and skips when that iteration is already durable, so ranks that learnt of a
completion at different moments still flush the same iteration, and a backlog of requests
collapses into one flush of the newest.

Restore (:meth:`PersistentTier.load`): the newest complete durable checkpoint of the session,
agreed by all ranks (the coordinator lists the directory and broadcasts its choice), loaded
into the caller's template (resharding as DCP does) or, without a template, into each rank's
own saved structure (as :meth:`CheckpointManager.load_local` returns it). With a
data-parallel ``parallelization_group`` the load is two-stage (:func:`two_stage_load`): each
stored entry is read by one rank of the group and broadcast to the others.
:func:`restore_latest` picks the newer of the memory and persistent tiers on every rank
together and reports which tier each rank restored from.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import logging
import mmap
import os
import queue
import re
import shutil
import signal
import socket
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import StorageReader

from ..memory import checksum
from ..parallel import collectives
from .dcp import (
    BACKEND,
    DCP_FORMAT_VERSION,
    FORMAT_NAME,
    MANIFEST_NAME,
    METADATA_NAME,
    LocalPlanData,
    PassiveLoadPlanner,
    RawBytes,
    ResilientFileSystemWriter,
    ResilientLoadPlanner,
    ResilientSavePlanner,
    SafeFileSystemReader,
    build_global_save_plan,
    hollow_fqn,
    load_local,
    read_manifest,
    read_values,
    stored_lengths,
    write_json_atomic,
)
from ..parallel.distribution import assign_shards
from ..errors import (
    CheckpointingException,
    CorruptCheckpointError,
    ForeignCheckpointError,
    StoreError,
    ValidationError,
)
from ..model.mapping import ShardedObject, apply_factory_merges
from ..model.nested import fill_holes, map_leaves, map_leaves_inplace, merge, split
from ..memory.store import CheckpointId, CheckpointStore

logger = logging.getLogger(__name__)

_ITER_DIR = re.compile(r"^iter_(\d+)$")
DEFAULT_READ_AHEAD_BYTES = 256 << 20


def iteration_dir_name(iteration: int) -> str:
    """``iter_0000100``: Megatron's naming (7 digits, more when needed)."""
    return f"iter_{iteration:07d}"


def _partial_dir_name(iteration: int) -> str:
    return f".{iteration_dir_name(iteration)}.partial"


@dataclass(frozen=True)
class DurableCheckpoint:
    """A complete checkpoint of the persistent tier."""

    iteration: int
    path: str
    manifest: Dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class FlushResult:
    """What one flush wrote (this rank's figures and the whole group's)."""

    iteration: int
    path: str
    #: tensor bytes this rank wrote
    bytes_written: int
    #: tensor bytes all ranks wrote
    total_bytes: int
    #: this rank's seconds from the agreed start until DCP's save returned here
    seconds: float
    #: seconds until the checkpoint was complete (metadata written, directory in place)
    durable_seconds: float

    @property
    def throughput_gbps(self) -> float:
        """Whole-group tensor bytes per second until durable, in GB/s (10^9)."""
        return self.total_bytes / self.durable_seconds / 1e9 if self.durable_seconds > 0 else 0.0


@dataclass(frozen=True)
class LoadReport:
    """Where a rank restored from."""

    tier: str  # "memory" or "persistent"
    iteration: int
    source: str  # store source ("local", "peer") or the checkpoint directory
    seconds: float
    bytes_read: int = 0
    two_stage: bool = False


# ---- store snapshot: one rank's stored checkpoint as a DCP state dict, zero-copy ----------


class StoreSnapshot:
    """One stored checkpoint (``owner``'s, iteration ``iteration``) as a state dict whose
    tensors are views of a read-only mapping of the store segment.

    ``state_dict()`` holds the common state, the sharded state (tensors this owner saved; the
    others as metadata only) and the hollow bytes under :func:`dcp.hollow_fqn`. ``verify()``
    checks the mapped bytes against the header's checksums (call it after writing them).
    """

    def __init__(self, store: CheckpointStore, iteration: int, owner: int):
        from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict

        self.iteration = iteration
        self.owner = owner
        self._mmap: Optional[mmap.mmap] = None
        self._views: List[Tuple[torch.Tensor, Optional[int], int]] = []
        cid = CheckpointId(int(iteration), int(owner), store.session)
        reader = store.open(cid)
        self.header = header = reader.header
        self.path = reader.path
        try:
            tasd = MCoreTensorAwareStateDict.from_bytes(header.meta)
        except Exception as e:
            raise CorruptCheckpointError(
                f"{store.header_path(cid)}: the stored state dict does not decode ({e})"
            ) from e
        metas = tasd.tensor_metadata
        if len(metas) != len(header.tensors):
            raise CorruptCheckpointError(
                f"{store.header_path(cid)}: {len(header.tensors)} tensors in the layout, "
                f"{len(metas)} saved shards in the state dict"
            )
        if header.data_nbytes:
            with open(reader.path, "rb") as f:
                self._mmap = mmap.mmap(f.fileno(), header.data_nbytes, prot=mmap.PROT_READ)
        for i, (st, lay) in enumerate(zip(metas, header.tensors)):
            if lay.torch_dtype != st.dtype or tuple(lay.shape) != tuple(st.local_shape):
                raise CorruptCheckpointError(
                    f"{store.header_path(cid)}: tensor {i} ({st.key!r}) is {lay.dtype} "
                    f"{list(lay.shape)} in the layout but {st.dtype} {list(st.local_shape)} in "
                    "the state dict"
                )
            if lay.offset + lay.nbytes > header.data_nbytes:
                raise CorruptCheckpointError(f"{store.header_path(cid)}: tensor {i} lies outside the segment")
            st.data = self._view(lay)
            self._views.append((st.data, lay.checksum, i))
        self._tasd = tasd

    def _view(self, lay) -> torch.Tensor:
        if lay.nbytes == 0:
            return torch.empty(lay.shape, dtype=lay.torch_dtype)
        # A view whose storage is exactly the tensor's bytes: DCP's writer then saves it
        # without cloning, and torch.save writes only these bytes.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mapping: we only read
            flat = torch.frombuffer(self._mmap, dtype=torch.uint8, offset=lay.offset, count=lay.nbytes)
        return flat.view(lay.torch_dtype).view(lay.shape)

    @property
    def tensor_bytes(self) -> int:
        return sum(lay.nbytes for lay in self.header.tensors)

    def state_dict(self) -> Dict[str, Any]:
        common = map_leaves(lambda v: v, self._tasd.common)
        sd = merge(common, self._tasd.sharded_state_dict)
        if not isinstance(sd, dict):
            raise CorruptCheckpointError("the stored state dict is not a dict at its top level")
        sd[hollow_fqn(self.owner)] = RawBytes(self.header.meta)
        return sd

    def verify(self) -> None:
        """Raise if the mapped bytes no longer match the stored checksums."""
        for t, ck, i in self._views:
            if ck is None or t.numel() == 0:
                continue
            if checksum.digest(checksum.byte_view(t)) != ck:
                raise CorruptCheckpointError(
                    f"{self.path}: tensor {i} of iteration {self.iteration} (owner {self.owner}) "
                    "changed while it was being written to the persistent tier (the store retired "
                    "and reused the segment); this flush is abandoned, the previous durable "
                    "checkpoint stays"
                )

    def close(self) -> None:
        self._views = []
        self._tasd = None
        if self._mmap is not None:
            try:
                self._mmap.close()
            except BufferError:
                pass  # a view is still referenced somewhere; the mapping goes when it does
            self._mmap = None

    def __enter__(self) -> "StoreSnapshot":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ---- agreement helpers -------------------------------------------------------------------


def _from_dcp(e: CheckpointException, what: str) -> CheckpointingException:
    """torch's CheckpointException (a BaseException holding every rank's error) as ours."""
    failures = getattr(e, "failures", {}) or {}
    parts = []
    first = None
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        first = first or exc
        parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    msg = f"{what} failed: " + ("; ".join(parts[:4]) or str(e)[:500])
    if isinstance(first, CheckpointingException):
        try:
            return type(first)(msg)
        except Exception:
            pass
    return CheckpointingException(msg)




# ---- the tier ------------------------------------------------------------------------------


@dataclass
class _Request:
    kind: str
    store: Optional[CheckpointStore]
    iteration: Optional[int]
    future: Future


class FlushHandle:
    """The future of one flush request: ``wait()`` returns a :class:`FlushResult`, or None when
    the round found nothing newer than the last durable checkpoint to flush."""

    def __init__(self, future: Future, kind: str):
        self._future = future
        self.kind = kind

    def wait(self, timeout: Optional[float] = None) -> Optional[FlushResult]:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None


class PersistentTier:
    """Durable DCP checkpoints beside the in-memory store (see the module docstring).

    Construction is collective when torch.distributed is initialized (it creates the tier's
    own gloo group unless ``group`` is given, and agrees on what the directory holds).

    Args:
        directory: where checkpoints go (shared by all ranks, e.g. a parallel file system).
        every_n_saves: :meth:`maybe_flush` flushes every this many complete saves (0: never).
        group: process group for flush and load coordination (default: a new gloo group of
            all ranks, so flushes never interleave with training collectives).
        keep_last: complete durable checkpoints kept (older ones are removed after a newer
            one is complete).
        session: the job's session id; checkpoints of other sessions are not loaded
            (default: learnt from the store at the first flush; None accepts any session).
        thread_count: writer threads per rank (files per rank).
        sync_files: fsync data and metadata (durability; off only for tests on tmpfs).
        read_ahead_bytes: memory bound of the two-stage load's read-ahead.
        reader_factory: builds the StorageReader for a checkpoint directory (wrap it to
            count or throttle reads).
        timeout_s: deadline of the tier's collectives.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        every_n_saves: int = 0,
        group: Optional[dist.ProcessGroup] = None,
        *,
        keep_last: int = 2,
        session: Optional[str] = None,
        thread_count: int = 1,
        sync_files: bool = True,
        enable_plan_caching: bool = True,
        read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
        reader_factory: Optional[Callable[[str], StorageReader]] = None,
        timeout_s: float = 600.0,
    ):
        if every_n_saves < 0:
            raise ValidationError(f"every_n_saves must be >= 0 (0: no periodic flush), got {every_n_saves}")
        if keep_last < 1:
            raise ValidationError(f"keep_last must be >= 1, got {keep_last}")
        if thread_count < 1:
            raise ValidationError(f"thread_count must be >= 1, got {thread_count}")
        self.directory = Path(directory)
        self.every_n_saves = every_n_saves
        self.keep_last = keep_last
        self.session = session
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.read_ahead_bytes = read_ahead_bytes
        self.reader_factory = reader_factory or (lambda p: SafeFileSystemReader(p))
        self.timeout_s = timeout_s
        self._distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
        if self._distributed and group is None:
            from ..replication.transport import new_checkpoint_group

            group = new_checkpoint_group(backend="gloo", timeout_s=timeout_s)
        self._group = group if self._distributed else None
        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        self._group_rank = collectives.group_rank(self._group) if self._group is not None else 0
        self._planner = ResilientSavePlanner(enable_plan_caching=enable_plan_caching)
        self._queue: "queue.Queue[Optional[_Request]]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._store: Optional[CheckpointStore] = None
        self._latest_known = -1
        self._saves_seen = 0
        self._pinned: Optional[int] = None
        self._closed = False
        self._prev_sigterm: Any = None
        self.sigterm_received = False
        self.last_flush: Optional[FlushResult] = None
        self.last_load: Optional[LoadReport] = None
        self.flushes_failed = 0
        self._foreign: Optional[list] = None
        self._futures: List[Future] = []
        #: newest durable iteration of this session, agreed; learnt at the first round (the
        #: session may only be known then)
        self._last_flushed: Optional[int] = None
        if self.is_coordinator:
            with contextlib.suppress(OSError):
                self.directory.mkdir(parents=True, exist_ok=True)

    # ---- identity ------------------------------------------------------------------------

    @property
    def is_coordinator(self) -> bool:
        return self._group_rank == 0

    @property
    def group(self) -> Optional[dist.ProcessGroup]:
        return self._group

    @property
    def planner(self) -> ResilientSavePlanner:
        return self._planner

    def pinned_iterations(self) -> List[int]:
        """Iterations a flush is reading from the store right now: retention should keep them
        (a retired segment reused mid-flush fails that flush)."""
        p = self._pinned
        return [] if p is None else [p]

    # ---- listing -------------------------------------------------------------------------

    def _final_dir(self, iteration: int) -> Path:
        return self.directory / iteration_dir_name(iteration)

    def _partial_dir(self, iteration: int) -> Path:
        return self.directory / _partial_dir_name(iteration)

    def list_complete(self, include_foreign: bool = False) -> List[DurableCheckpoint]:
        """Complete checkpoints of this tier's session in the directory, oldest first (local
        listing, no collective)."""
        out = []
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        for p in entries:
            m = _ITER_DIR.match(p.name)
            if not m or not (p / METADATA_NAME).is_file():
                continue
            try:
                manifest = read_manifest(p)
            except CorruptCheckpointError as e:
                logger.warning("ignoring %s: %s", p, e)
                continue
            if manifest is None:
                continue  # not written by resilient_ckpt (plain dcp.save): not ours to manage
            if not include_foreign and self.session is not None and manifest.get("session") != self.session:
                continue
            out.append(DurableCheckpoint(int(m.group(1)), str(p), manifest))
        return sorted(out, key=lambda c: c.iteration)

    def latest_complete(self) -> Optional[DurableCheckpoint]:
        """The newest complete checkpoint of this session (local listing, no collective)."""
        found = self.list_complete()
        return found[-1] if found else None

    def agreed_latest(self) -> Optional[DurableCheckpoint]:
        """The newest complete durable checkpoint of this session, the same on every rank
        (collective over the tier's group)."""
        return self._agreed_latest()

    def _agreed_latest(self) -> Optional[DurableCheckpoint]:
        """The coordinator's listing, on every rank (collective)."""
        mine = None
        self._foreign = None
        if self.is_coordinator:
            latest = self.latest_complete()
            if latest is not None:
                mine = {"iteration": latest.iteration, "path": latest.path, "manifest": latest.manifest}
            else:
                foreign = [c for c in self.list_complete(include_foreign=True)]
                if foreign:
                    mine = {"foreign": [[c.path, str(c.manifest.get("session"))] for c in foreign[-3:]]}
        if self._group is not None:
            mine = collectives.broadcast_msgpack(mine, 0, self._group)
        if mine is None:
            return None
        if "foreign" in mine:
            self._foreign = mine["foreign"]
            return None
        return DurableCheckpoint(int(mine["iteration"]), str(mine["path"]), dict(mine["manifest"]))

    # ---- flush requests ------------------------------------------------------------------

    def note_complete(self, store: CheckpointStore, iteration: int) -> None:
        """Record that ``iteration`` is complete in memory (what SIGTERM and periodic flushes
        write). Cheap; call after every complete save."""
        with self._lock:
            self._store = store
            if self.session is None:
                self.session = store.session
            self._latest_known = max(self._latest_known, int(iteration))

    def maybe_flush(self, store: CheckpointStore, iteration: int) -> Optional[FlushHandle]:
        """Call after every complete save (on every rank): records it and, every
        ``every_n_saves`` saves, starts a background flush of the newest complete iteration."""
        self.note_complete(store, iteration)
        self._saves_seen += 1
        if self.every_n_saves and self._saves_seen % self.every_n_saves == 0:
            return self._request("periodic", store, None)
        return None

    def flush(self, store: CheckpointStore, iteration: Optional[int] = None) -> FlushHandle:
        """Flush ``iteration`` (default: the newest complete one this rank knows) from ``store``
        to the tier, in the background. Collective: call on every rank. ``.wait()`` on the
        handle blocks until it is durable (raising its error)."""
        if iteration is not None:
            self.note_complete(store, iteration)
        else:
            with self._lock:
                self._store = store
                if self.session is None:
                    self.session = store.session
        return self._request("on_demand", store, iteration)

    def _request(self, kind: str, store: Optional[CheckpointStore], iteration: Optional[int]) -> FlushHandle:
        if self._closed:
            raise CheckpointingException("PersistentTier is closed; create a new one to flush")
        fut: Future = Future()
        with self._lock:
            self._futures = [f for f in self._futures if not f.done()] + [fut]
        self._queue.put(_Request(kind, store, iteration, fut))
        self._ensure_thread()
        return FlushHandle(fut, kind)

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="resilient_ckpt-flush", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            req = self._queue.get()
            if req is None:
                return
            if not req.future.set_running_or_notify_cancel():
                continue
            try:
                req.future.set_result(self._round(req))
            except BaseException as e:  # reported through the handle
                self.flushes_failed += 1
                logger.warning("flush (%s) failed on rank %d: %s", req.kind, self.rank, e)
                req.future.set_exception(e)

    # ---- one flush round (flush thread) ----------------------------------------------------

    def _round(self, req: _Request) -> Optional[FlushResult]:
        with self._lock:
            store = req.store or self._store
            cand = req.iteration if req.iteration is not None else self._latest_known
        if store is None:
            cand = -1
        self._pinned = cand if cand >= 0 else None  # from before the agreement: it is the likely one
        target = collectives.all_reduce_int(cand, "max", self._group) if self._group is not None else cand
        if self._last_flushed is None:
            latest = self._agreed_latest()  # every rank's first round: same point everywhere
            self._last_flushed = latest.iteration if latest is not None else -1
        if target < 0 or target <= self._last_flushed:
            logger.debug("flush round (%s): iteration %d is already durable or none known", req.kind, target)
            self._pinned = None
            return None
        self._pinned = target
        try:
            return self._flush_iteration(store, target)
        finally:
            self._pinned = None

    def _flush_iteration(self, store: Optional[CheckpointStore], iteration: int) -> FlushResult:
        t0 = time.perf_counter()
        partial = self._partial_dir(iteration)
        snapshot: Optional[StoreSnapshot] = None
        local_exc: Optional[BaseException] = None
        try:
            if self.is_coordinator:
                # Before anyone writes (the agreement below orders it): a stale partial of the
                # same iteration (a flush that died) must not mix into this one.
                shutil.rmtree(partial, ignore_errors=True)
                partial.mkdir(parents=True, exist_ok=False)
            if store is None:
                raise CheckpointingException(
                    f"rank {self.rank} has no store to flush iteration {iteration} from (call "
                    "maybe_flush/flush with the manager's store on every rank)"
                )
            snapshot = StoreSnapshot(store, iteration, self.rank)
            state = snapshot.state_dict()
        except BaseException as e:
            local_exc = e
        try:
            collectives.fail_together(local_exc, f"flush of iteration {iteration}", self._group)
        except BaseException:
            if snapshot is not None:
                snapshot.close()
            self._cleanup_partial(partial)
            raise
        manifest = {
            "format": FORMAT_NAME,
            "backend": BACKEND,
            "version": DCP_FORMAT_VERSION,
            "session": store.session,
            "iteration": iteration,
            "world_size": self.world_size,
            "group_size": collectives.group_size(self._group) if self._group is not None else 1,
            "created": time.time(),
            "writer": f"{socket.gethostname()}:{os.getpid()}",
            "torch": torch.__version__,
            "source": "flush",
        }
        writer = ResilientFileSystemWriter(
            partial,
            manifest=manifest,
            after_write=snapshot.verify,
            sync_files=self.sync_files,
            thread_count=self.thread_count,
        )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(
                    state,
                    storage_writer=writer,
                    planner=self._planner,
                    process_group=self._group,
                    no_dist=self._group is None,
                )
        except CheckpointException as e:
            self._cleanup_partial(partial)
            raise _from_dcp(e, f"flush of iteration {iteration} to {partial}") from None
        except BaseException:
            self._cleanup_partial(partial)
            raise
        finally:
            del state
            self._planner.release()  # drop its views of the mapping before unmapping
            snapshot.close()
        seconds = time.perf_counter() - t0
        mine = self._planner.stats.bytes_written
        total = collectives.all_reduce_int(mine, "sum", self._group) if self._group is not None else mine
        final = self._final_dir(iteration)
        outcome = ""
        if self.is_coordinator:
            try:
                self._publish(partial, final)
                self._retire(iteration)
            except Exception as e:
                outcome = f"{type(e).__name__}: {e}"
                self._cleanup_partial(partial)
        if self._group is not None:
            outcome = collectives.broadcast_msgpack(outcome, 0, self._group)
        if outcome:
            raise CheckpointingException(
                f"flush of iteration {iteration}: publishing {final} failed: {outcome}; the previous "
                "durable checkpoint stays"
            )
        self._last_flushed = iteration
        result = FlushResult(iteration, str(final), mine, total, seconds, time.perf_counter() - t0)
        self.last_flush = result
        logger.info(
            "flushed iteration %d to %s: %.3f GB in %.2fs (%.2f GB/s for the group)",
            iteration, final, total / 1e9, result.durable_seconds, result.throughput_gbps,
        )
        return result

    def _cleanup_partial(self, partial: Path) -> None:
        if self.is_coordinator:
            shutil.rmtree(partial, ignore_errors=True)

    def _publish(self, partial: Path, final: Path) -> None:
        if not (partial / METADATA_NAME).is_file():
            raise CorruptCheckpointError(f"{partial} has no {METADATA_NAME} after the save")
        if final.exists():
            # Same iteration flushed before (e.g. by a previous run): replace it, moving the old
            # one aside first so a crash in between leaves one complete copy.
            old = final.with_name(f".{final.name}.old-{os.getpid()}")
            os.replace(final, old)
            os.replace(partial, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(partial, final)
        _fsync_dir(self.directory)

    def _retire(self, newest: int) -> None:
        complete = [c for c in self.list_complete() if c.iteration <= newest]
        for c in complete[: max(0, len(complete) - self.keep_last)]:
            logger.info("removing durable checkpoint %s (keep_last=%d)", c.path, self.keep_last)
            shutil.rmtree(c.path, ignore_errors=True)
        for p in self.directory.iterdir():
            m = re.match(r"^\.iter_(\d+)\.partial$", p.name)
            if m and int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)

    # ---- SIGTERM -------------------------------------------------------------------------

    def install_sigterm_handler(self, *, timeout_s: Optional[float] = None, exit: bool = True) -> None:
        """On SIGTERM, flush the newest complete in-memory iteration before the process ends.

        Every rank must receive SIGTERM (schedulers send it to every task) since the flush is
        collective. The handler asks the flush thread for a round and waits for it (at most
        ``timeout_s``, default the tier's timeout); with ``exit`` it then hands the signal to
        the previous handler (or the default action, ending the process). Call from the main
        thread.
        """
        if threading.current_thread() is not threading.main_thread():
            raise CheckpointingException("install_sigterm_handler must be called from the main thread")
        prev = signal.getsignal(signal.SIGTERM)
        self._prev_sigterm = prev
        wait_s = self.timeout_s if timeout_s is None else timeout_s

        def handler(signum, frame):
            self.sigterm_received = True
            logger.warning("rank %d: SIGTERM: flushing the newest complete iteration", self.rank)
            try:
                if not self._closed:
                    self._request("sigterm", None, None).wait(wait_s)
            except BaseException as e:  # the process is ending anyway; say why the flush failed
                logger.error("rank %d: flush on SIGTERM failed: %s", self.rank, e)
            if not exit:
                return
            signal.signal(signal.SIGTERM, prev if prev is not None else signal.SIG_DFL)
            if callable(prev):
                prev(signum, frame)
            elif prev == signal.SIG_IGN:
                return
            else:
                os.kill(os.getpid(), signal.SIGTERM)

        self._sigterm_handler = handler
        signal.signal(signal.SIGTERM, handler)

    # ---- load ------------------------------------------------------------------------------

    def load(
        self,
        template: Optional[Any] = None,
        parallelization_group: Optional[dist.ProcessGroup] = None,
        *,
        strict: bool = True,
        allow_pickle: bool = False,
    ) -> Optional[Tuple[Any, int]]:
        """Restore the newest complete durable checkpoint (collective over the tier's group).

        Returns ``(state_dict, iteration)`` like ``CheckpointManager.load_local``: tensors where
        the template had ShardedTensors, the checkpoint's common state, ShardedObjects' values;
        ``template=None`` rebuilds each rank's own saved structure (needs the world size it was
        saved with). None when the tier holds no checkpoint of this session.
        ``parallelization_group`` (data parallel): two-stage load, each entry read once per
        group. ``strict=False`` skips template keys absent from the checkpoint.
        """
        t0 = time.perf_counter()
        chosen = self._agreed_latest()
        if chosen is None:
            foreign = getattr(self, "_foreign", None)
            if foreign:
                raise ForeignCheckpointError(
                    f"{self.directory} holds only checkpoints of other sessions ("
                    + ", ".join(f"{p} of session {s!r}" for p, s in foreign)
                    + f"), not of session {self.session!r}; pass session= of the job that wrote "
                    "them, or point the tier at another directory"
                )
            return None
        m = chosen.manifest
        if m.get("version", 0) > DCP_FORMAT_VERSION or m.get("backend") != BACKEND:
            raise ForeignCheckpointError(
                f"{chosen.path}: written as backend {m.get('backend')!r} version {m.get('version')}; "
                f"this build reads backend {BACKEND!r} up to version {DCP_FORMAT_VERSION}"
            )
        saved_world = int(m.get("world_size", -1))
        if template is None and saved_world != self.world_size:
            raise ForeignCheckpointError(
                f"{chosen.path} was written by a job of world size {saved_world}, this job has "
                f"{self.world_size}; without a template each rank needs its own saved structure. "
                "Pass a template (sharded state dict) to load it resharded"
            )
        two_stage = parallelization_group is not None and collectives.group_size(parallelization_group) > 1
        local_exc: Optional[BaseException] = None
        target: Dict[str, Any] = {}
        saved_devices: set = set()
        common: Any = {}
        nonpersistent: Any = {}
        factories: Any = {}
        reader = None
        metadata = None
        planner = ResilientLoadPlanner(allow_partial_load=not strict, allow_pickle=allow_pickle)
        try:
            reader = self.reader_factory(chosen.path)
            metadata = reader.read_metadata()
            reader.set_up_storage_reader(metadata, self.is_coordinator)
            own = hollow_fqn(self.rank)
            fqn = own if own in metadata.state_dict_metadata else hollow_fqn(0)
            if fqn not in metadata.state_dict_metadata:
                raise CorruptCheckpointError(
                    f"{chosen.path} lacks resilient_ckpt's per-rank entries ({own!r}); it was not "
                    "written by a PersistentTier flush or export"
                )
            if template is None and fqn != own:
                raise ForeignCheckpointError(f"{chosen.path} holds no saved structure for rank {self.rank}")
            tasd = _decode_hollow(read_values(reader, metadata, [fqn], raw=True)[fqn], chosen.path, fqn)
            common = tasd.common
            if template is None:
                saved_devices = {d for d in tasd._devices if d}
                # The rank's own objects are in its hollow state dict already: kept aside.
                objects, target = split(tasd.sharded_state_dict, lambda v: isinstance(v, ShardedObject))
                nonpersistent = map_leaves_inplace(lambda o: o.data, objects)
            else:
                from ..parallel.tensor_aware_state_dict import _preprocess

                target, _tpl_common, nonpersistent, factories = _preprocess(template)
            if not isinstance(target, dict):
                target = {}
        except BaseException as e:
            local_exc = e
        collectives.fail_together(local_exc, f"load of {chosen.path}", self._group)
        bytes_read = 0
        try:
            if two_stage:
                stats = two_stage_load(
                    target, reader, parallelization_group, planner=planner, metadata=metadata,
                    read_ahead_bytes=self.read_ahead_bytes,
                )
                bytes_read = stats.bytes_read
            else:
                load_local(target, reader, planner, metadata)
                bytes_read = planner.bytes_requested
            local_exc = None
        except BaseException as e:
            local_exc = e
        collectives.fail_together(local_exc, f"load of {chosen.path}", self._group)
        if template is None and torch.cuda.is_available() and any(d.startswith("cuda") for d in saved_devices):
            # As load_local does: tensors go back to the device type they were saved from.
            map_leaves_inplace(lambda v: v.cuda() if isinstance(v, torch.Tensor) else v, target)
        result = map_leaves(lambda v: v, common)
        merge(result, target)
        merge(result, nonpersistent)
        if factories:
            result = apply_factory_merges(result, factories)
        result = fill_holes(result)
        self._last_flushed = max(self._last_flushed if self._last_flushed is not None else -1, chosen.iteration)
        self.last_load = LoadReport(
            "persistent", chosen.iteration, chosen.path, time.perf_counter() - t0, bytes_read, two_stage
        )
        logger.info(
            "rank %d restored iteration %d from the persistent tier (%s) in %.3fs",
            self.rank, chosen.iteration, chosen.path, self.last_load.seconds,
        )
        return result, chosen.iteration

    # ---- lifecycle -----------------------------------------------------------------------------

    def wait(self, timeout: Optional[float] = None) -> None:
        """Block until every flush requested so far has finished (errors stay with their
        handles)."""
        with self._lock:
            futures = list(self._futures)
        deadline = None if timeout is None else time.monotonic() + timeout
        for f in futures:
            with contextlib.suppress(Exception):
                f.exception(None if deadline is None else max(0.0, deadline - time.monotonic()))

    def close(self) -> None:
        """Finish queued flushes (every rank together) and stop the flush thread."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()
        ours = getattr(self, "_sigterm_handler", None)
        if ours is not None and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(Exception):
                if signal.getsignal(signal.SIGTERM) is ours:  # not if someone replaced it since
                    signal.signal(signal.SIGTERM, self._prev_sigterm or signal.SIG_DFL)

    def __enter__(self) -> "PersistentTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _decode_hollow(value: Any, path: str, fqn: str):
    from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict

    try:
        return MCoreTensorAwareStateDict.from_bytes(bytes(value))
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: entry {fqn!r} does not decode ({e})") from e


# ---- two-stage data-parallel load ------------------------------------------------------------


@dataclass
class TwoStageStats:
    """What one rank did in a two-stage load."""

    entries_read: int = 0
    bytes_read: int = 0  # stored bytes this rank read
    bytes_broadcast: int = 0  # tensor bytes this rank sent
    entries_total: int = 0
    seconds: float = 0.0
    read_seconds: float = 0.0


class _BufferPlanner(PassiveLoadPlanner):
    """Reads whole stored entries into fresh buffers (the first stage of a two-stage load)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.tensor: Optional[torch.Tensor] = None
        self.raw: Optional[bytes] = None
        self._shape: Tuple[int, ...] = ()
        self._dtype = torch.uint8

    def expect(self, dtype: torch.dtype, shape: Tuple[int, ...], out: Optional[torch.Tensor] = None) -> None:
        self._dtype, self._shape = dtype, shape
        self.tensor = out if out is not None else torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw = value.getvalue()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


_SKey = Tuple[str, Optional[Tuple[int, ...]]]


def two_stage_load(
    state_dict: Dict[str, Any],
    reader: StorageReader,
    group: Optional[dist.ProcessGroup],
    *,
    planner: Optional[ResilientLoadPlanner] = None,
    metadata: Optional[Metadata] = None,
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
) -> TwoStageStats:
    """Load ``state_dict`` with each stored entry read by one rank of ``group`` (collective).

    Every rank plans its own reads (resharding as DCP does); the union of stored entries the
    group needs is split among the ranks that need them, balanced by bytes
    (:func:`distribution.assign_shards`). A reader thread per rank (``resilient_ckpt-two-stage``)
    reads its entries ahead, at most ``read_ahead_bytes`` in flight, while the main thread
    broadcasts entries in a fixed global order and copies what it needs out of each; an entry
    only one rank needs is read by it and not sent. Memory: the read-ahead plus one entry in
    transit. Errors (a missing file, a bad key) surface on every rank of the group together.
    """
    t0 = time.perf_counter()
    planner = planner or ResilientLoadPlanner()
    n = collectives.group_size(group)
    me = collectives.group_rank(group)
    stats = TwoStageStats()
    local_exc: Optional[BaseException] = None
    mine: Dict[_SKey, List[ReadItem]] = {}
    try:
        if metadata is None:
            metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, me == 0)
        reader.set_up_storage_reader(metadata, me == 0)
        plan = planner.finish_plan(planner.create_local_plan())
        for ri in plan.items:
            idx = ri.storage_index
            key = (idx.fqn, None if ri.type == LoadItemType.BYTE_IO else tuple(idx.offset))
            mine.setdefault(key, []).append(ri)
    except BaseException as e:
        local_exc = e
    payload = {
        "err": "" if local_exc is None else f"{type(local_exc).__name__}: {local_exc}",
        "need": [[k[0], None if k[1] is None else list(k[1])] for k in sorted(mine, key=_skey_order)],
    }
    gathered = collectives.all_gather_msgpack(payload, group) if n > 1 else [payload]
    bad = [(r, g["err"]) for r, g in enumerate(gathered) if g["err"]]
    if bad:
        if local_exc is not None:
            raise local_exc
        raise CheckpointingException(f"two-stage load failed on group rank {bad[0][0]}, so every rank stops: {bad[0][1]}")
    holders: Dict[Tuple[str, Tuple[int, ...]], List[int]] = {}
    kinds: Dict[Tuple[str, Tuple[int, ...]], _SKey] = {}
    sizes: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    md = metadata.state_dict_metadata
    stored = stored_lengths(metadata)
    chunk_at: Dict[_SKey, Tuple[int, ChunkStorageMetadata]] = {}
    indexed: set = set()
    for r, g in enumerate(gathered):
        for fqn, off in g["need"]:
            skey: _SKey = (fqn, None if off is None else tuple(off))
            sid = (fqn, () if off is None else tuple(off))
            if sid not in holders:
                holders[sid] = []
                kinds[sid] = skey
                if off is None:
                    sizes[sid] = max(1, stored.get(skey, 0))
                else:
                    if fqn not in indexed:
                        indexed.add(fqn)
                        for i, c in enumerate(md[fqn].chunks):
                            chunk_at[(fqn, tuple(c.offsets))] = (i, c)
                    if skey not in chunk_at:
                        raise CorruptCheckpointError(f"{fqn!r}: no stored chunk at offset {list(off)}")
                    c = chunk_at[skey][1]
                    sizes[sid] = max(1, _numel(c.sizes) * md[fqn].properties.dtype.itemsize)
            holders[sid].append(r)
    readers = assign_shards(holders, sizes, n) if holders else {}
    order = sorted(holders, key=lambda s: _skey_order(kinds[s]))
    stats.entries_total = len(order)
    dev = collectives.comm_device(group) if n > 1 else torch.device("cpu")
    pin = torch.cuda.is_available()
    my_reads = [s for s in order if readers[s] == me]
    # Where this rank needs a stored chunk whole, in one contiguous destination, the chunk is
    # read or received straight into that destination (no staging buffer, no extra copy).
    direct: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
    for sid in order:
        fqn, off = kinds[sid]
        items = mine.get(kinds[sid]) if off is not None else None
        if not items or len(items) != 1:
            continue
        ri = items[0]
        c = chunk_at[kinds[sid]][1]
        if any(o != 0 for o in ri.storage_offsets) or tuple(ri.lengths) != tuple(c.sizes):
            continue
        dest = planner.resolve_tensor(ri)
        want = torch.device("cpu") if readers[sid] == me else dev
        if dest.is_contiguous() and dest.device == want and dest.dtype == md[fqn].properties.dtype:
            direct[sid] = dest

    # Stage 1: this rank's reads, ahead of use, bounded by read_ahead_bytes.
    results: "queue.Queue[Tuple[Any, Optional[BaseException]]]" = queue.Queue()
    budget = threading.Condition()
    in_flight = [0]
    stop = threading.Event()

    def read_loop() -> None:
        for sid in my_reads:
            size = sizes[sid]
            with budget:
                while in_flight[0] > 0 and in_flight[0] + size > read_ahead_bytes and not stop.is_set():
                    budget.wait(0.5)
                in_flight[0] += size
            if stop.is_set():
                return
            t = time.perf_counter()
            try:
                results.put((_read_entry(reader, metadata, kinds[sid], chunk_at.get(kinds[sid]), pin, direct.get(sid)), None))
            except BaseException as e:
                results.put((None, e))
            stats.read_seconds += time.perf_counter() - t

    thread = threading.Thread(target=read_loop, name="resilient_ckpt-two-stage", daemon=True)
    thread.start()
    first_error: Optional[BaseException] = None
    try:
        for sid in order:
            src = readers[sid]
            fqn, off = kinds[sid]
            needers = holders[sid]
            data = None
            if src == me:
                data, err = results.get()
                if err is not None and first_error is None:
                    first_error = err
                stats.entries_read += 1
                stats.bytes_read += stored.get(kinds[sid], 0)
            # Local failures (a read, a copy) are recorded, not raised: this rank keeps taking
            # part in every broadcast so no peer is left waiting, and all raise together below.
            if off is None:
                raw = data if src == me else None
                if len(needers) > 1:
                    raw = _broadcast_bytes(raw if raw is not None else b"", collectives.global_rank(group, src), group, dev, src == me)
                if me in needers and raw is not None and first_error is None:
                    try:
                        _apply_bytes(planner, mine[(fqn, None)], raw)
                    except Exception as e:
                        first_error = e
            else:
                tmd = md[fqn]
                chunk = chunk_at[kinds[sid]][1]
                if src == me:
                    buf = data if data is not None else torch.zeros(tuple(chunk.sizes), dtype=tmd.properties.dtype)
                else:
                    buf = None
                if len(needers) > 1:
                    if src == me:
                        send = buf.to(dev) if buf.device != dev else buf
                        stats.bytes_broadcast += send.numel() * send.element_size()
                    elif sid in direct:
                        send = direct[sid]
                    else:
                        send = torch.empty(tuple(chunk.sizes), dtype=tmd.properties.dtype, device=dev)
                    dist.broadcast(send, collectives.global_rank(group, src), group=group)
                    buf = send if src != me else buf
                if me in needers and first_error is None:
                    try:
                        if sid in direct and buf is direct[sid]:
                            ri = mine[(fqn, off)][0]
                            planner.commit_tensor(ri, buf)  # already in place
                        else:
                            _apply_tensor(planner, mine[(fqn, off)], buf)
                    except Exception as e:
                        first_error = e
            if src == me:
                with budget:
                    in_flight[0] -= sizes[sid]
                    budget.notify_all()
    except BaseException as e:
        first_error = first_error or e
        stop.set()
        raise
    finally:
        stop.set()
        with budget:
            budget.notify_all()
        thread.join(timeout=60)
    collectives.fail_together(first_error, "two-stage load", group if n > 1 else None)
    stats.seconds = time.perf_counter() - t0
    return stats


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _skey_order(k: _SKey):
    return (k[0], () if k[1] is None else tuple(k[1]), k[1] is None)


def _read_entry(reader: StorageReader, metadata: Metadata, key: _SKey, at, pin: bool,
                out: Optional[torch.Tensor] = None) -> Any:
    fqn, off = key
    planner = _BufferPlanner(pin)
    if off is None:
        item = ReadItem(
            type=LoadItemType.BYTE_IO,
            dest_index=MetadataIndex(fqn),
            dest_offsets=torch.Size([0]),
            storage_index=MetadataIndex(fqn),
            storage_offsets=torch.Size([0]),
            lengths=torch.Size([0]),
        )
        reader.read_data(LoadPlan([item]), planner).wait()
        return planner.raw or b""
    tmd = metadata.state_dict_metadata[fqn]
    idx, chunk = at
    planner.expect(tmd.properties.dtype, tuple(chunk.sizes), out)
    zeros = torch.Size([0] * len(off))
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, off),
        dest_offsets=zeros,
        storage_index=MetadataIndex(fqn, off, idx),
        storage_offsets=zeros,
        lengths=torch.Size(chunk.sizes),
    )
    reader.read_data(LoadPlan([item]), planner).wait()
    return planner.tensor


def _broadcast_bytes(raw: bytes, src_global: int, group, dev: torch.device, is_src: bool) -> bytes:
    n = torch.tensor([len(raw) if is_src else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, src_global, group=group)
    size = int(n.item())
    if is_src:
        buf = torch.frombuffer(bytearray(raw), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        buf = buf.to(dev)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
    if size:
        dist.broadcast(buf, src_global, group=group)
    return raw if is_src else buf.cpu().numpy().tobytes()


def _apply_bytes(planner: LoadPlanner, items: Sequence[ReadItem], raw: bytes) -> None:
    for ri in items:
        planner.load_bytes(ri, io.BytesIO(raw))


def _apply_tensor(planner: LoadPlanner, items: Sequence[ReadItem], chunk: torch.Tensor) -> None:
    from .dcp import _narrow

    for ri in items:
        src = _narrow(chunk, ri.storage_offsets, ri.lengths)
        dest = planner.resolve_tensor(ri)
        dest.copy_(src)
        planner.commit_tensor(ri, dest)


# ---- restore across tiers -------------------------------------------------------------------


@dataclass(frozen=True)
class Restored:
    """The outcome of :func:`restore_latest`."""

    state_dict: Any
    iteration: int
    tier: str
    #: per global rank: "memory:<source>" or "persistent:<directory>"
    sources: Tuple[str, ...]


def restore_latest(
    manager: Any,
    tier: PersistentTier,
    template: Optional[Any] = None,
    *,
    parallelization_group: Optional[dist.ProcessGroup] = None,
    strict: bool = True,
) -> Optional[Restored]:
    """Restore the newest iteration either tier holds, on every rank together (collective).

    The memory tier wins ties (it is faster); when no complete in-memory iteration exists, or
    the persistent one is newer, every rank loads from the persistent tier. Returns None when
    neither tier holds anything.
    """
    if tier.session is None:
        tier.session = manager.session_id
    mem = manager.find_latest()
    durable = tier._agreed_latest()
    out: Optional[Tuple[Any, int]] = None
    name = ""
    source = ""
    if mem >= 0 and (durable is None or mem >= durable.iteration):
        out = manager.load_local(template)
        if out is not None:
            m = manager.last_load_metrics
            name, source = "memory", f"memory:{getattr(m, 'source', '')}"
            tier.last_load = LoadReport("memory", out[1], getattr(m, "source", ""), getattr(m, "total_s", 0.0), getattr(m, "bytes_read", 0))
    if out is None:
        out = tier.load(template, parallelization_group, strict=strict)
        if out is not None:
            name, source = "persistent", f"persistent:{tier.last_load.source}"
    group = tier.group
    sources = collectives.all_gather_msgpack(source, group) if group is not None else [source]
    if out is None:
        return None
    return Restored(out[0], out[1], name, tuple(sources))


# ---- export: a node's store to a DCP directory, one process, no torch.distributed -----------


@dataclass(frozen=True)
class ExportResult:
    directory: str
    iteration: int
    owners_exported: Tuple[int, ...]
    owners_skipped: Tuple[int, ...]
    world_size: int
    complete: bool
    bytes_written: int


_EXPORT_DIR = ".export"


def export_store_iteration(
    store_root: str | os.PathLike,
    session: str,
    iteration: int,
    directory: str | os.PathLike,
    *,
    sync_files: bool = True,
) -> ExportResult:
    """Write every owner's checkpoint of ``iteration`` held in this node's store to the DCP
    directory ``directory``, and its metadata once every owner of the job is there.

    A node store holds its own ranks' checkpoints and replicas of some peers'. Run this on
    every node (concurrently is fine): each owner is written once (a claim file under
    ``.export/`` decides who), each node records what it wrote beside its data, and whichever
    run finds all ``world_size`` owners present writes ``.metadata`` (last), making the
    directory a complete checkpoint that :class:`PersistentTier` and plain DCP load.
    """
    store = CheckpointStore(store_root, session)
    ids = [c for c in store.list() if c.iteration == iteration]
    if not ids:
        held = sorted({c.iteration for c in store.list()})
        raise StoreError(
            f"store {store.dir} holds no checkpoint of iteration {iteration} (it holds "
            f"{held[-10:] if held else 'none'}); pick one of those with --iteration"
        )
    headers = {c.owner: store.read_header(c) for c in ids}
    worlds = {h.world_size for h in headers.values()}
    if len(worlds) != 1:
        raise CorruptCheckpointError(f"store {store.dir}: iteration {iteration} was saved with world sizes {sorted(worlds)}")
    (world,) = worlds
    out = Path(directory)
    meta_dir = out / _EXPORT_DIR
    meta_dir.mkdir(parents=True, exist_ok=True)
    existing = read_manifest(out) if (out / MANIFEST_NAME).exists() else None
    if existing is not None and (existing.get("session") != session or existing.get("iteration") != iteration):
        raise ForeignCheckpointError(
            f"{out} already holds iteration {existing.get('iteration')} of session "
            f"{existing.get('session')!r}; export into an empty directory"
        )
    exported, skipped = [], []
    written = 0
    for owner in sorted(headers):
        claim = meta_dir / f"owner_{owner:06d}.claim"
        try:
            fd = os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            skipped.append(owner)
            continue
        with os.fdopen(fd, "w") as f:
            f.write(f"{socket.gethostname()}:{os.getpid()}\n")
        try:
            written += _export_owner(store, iteration, owner, out, meta_dir, session, world, sync_files)
        except BaseException:
            with contextlib.suppress(OSError):
                claim.unlink()
            raise
        exported.append(owner)
    complete = _finalize_export(out, meta_dir, session, iteration, world)
    return ExportResult(str(out), iteration, tuple(exported), tuple(skipped), world, complete, written)


def _export_owner(store, iteration, owner, out: Path, meta_dir: Path, session, world, sync_files) -> int:
    from torch.distributed.checkpoint.filesystem import FileSystemWriter, _StoragePrefix

    with StoreSnapshot(store, iteration, owner) as snap:
        planner = ResilientSavePlanner(enable_plan_caching=False, dedup_replicas=False)
        planner.set_up_planner(snap.state_dict(), is_coordinator=owner == 0)
        local = planner.create_local_plan()
        writer = FileSystemWriter(out, sync_files=sync_files, overwrite=True)
        writer.set_up_storage_writer(owner == 0)
        local = writer.prepare_local_plan(local)
        final = dataclasses.replace(local, storage_data=_StoragePrefix(f"__{owner}_"))
        final = planner.finish_plan(final)
        results = writer.write_data(final, planner).wait()
        snap.verify()
    record = {
        "owner": owner,
        "iteration": iteration,
        "session": session,
        "world_size": world,
        "items": [_item_record(i) for i in local.items],
        "mains": [[f, list(o)] for f, o in local.planner_data.mains],
        "mappings": [[f, list(p)] for f, p in local.planner_data.mappings],
        "results": [
            [r.index.fqn, None if r.index.offset is None else list(r.index.offset),
             r.storage_data.relative_path, int(r.storage_data.offset), int(r.storage_data.length)]
            for r in results
        ],
    }
    write_json_atomic(meta_dir / f"owner_{owner:06d}.json", record)
    return planner.stats.bytes_written


def _item_record(item: WriteItem) -> list:
    if item.type == WriteItemType.BYTE_IO:
        return ["bytes", item.index.fqn]
    td = item.tensor_data
    return [
        "tensor", item.index.fqn, list(td.chunk.offsets), list(td.chunk.sizes), list(td.size),
        str(td.properties.dtype).replace("torch.", ""),
    ]


def _plan_from_record(rec: dict) -> SavePlan:
    items = []
    for it in rec["items"]:
        if it[0] == "bytes":
            items.append(WriteItem(index=MetadataIndex(it[1]), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(0)))
        else:
            _, fqn, off, sizes, gsize, dtype = it
            items.append(
                WriteItem(
                    index=MetadataIndex(fqn, off),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(torch.Size(off), torch.Size(sizes)),
                        properties=TensorProperties(dtype=getattr(torch, dtype)),
                        size=torch.Size(gsize),
                    ),
                )
            )
    pd = LocalPlanData(
        mappings=tuple((f, tuple(p)) for f, p in rec["mappings"]),
        mains=tuple((f, tuple(o)) for f, o in rec["mains"]),
    )
    return SavePlan(items, planner_data=pd)


def _finalize_export(out: Path, meta_dir: Path, session: str, iteration: int, world: int) -> bool:
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    records = {}
    for owner in range(world):
        p = meta_dir / f"owner_{owner:06d}.json"
        try:
            records[owner] = json.loads(p.read_text())
        except FileNotFoundError:
            return False
    plans = [_plan_from_record(records[o]) for o in range(world)]
    final_plans, metadata, _ = build_global_save_plan(plans, dedup=True)
    results = []
    for owner, plan in enumerate(final_plans):
        chosen = {(i.index.fqn, None if i.index.offset is None else tuple(i.index.offset)) for i in plan.items}
        for fqn, off, rel, offset, length in records[owner]["results"]:
            key = (fqn, None if off is None else tuple(off))
            if key in chosen:
                results.append(
                    WriteResult(
                        index=MetadataIndex(fqn, off), size_in_bytes=length,
                        storage_data=_StorageInfo(rel, offset, length),
                    )
                )
    manifest = {
        "format": FORMAT_NAME,
        "backend": BACKEND,
        "version": DCP_FORMAT_VERSION,
        "session": session,
        "iteration": iteration,
        "world_size": world,
        "group_size": world,
        "created": time.time(),
        "writer": f"{socket.gethostname()}:{os.getpid()}",
        "torch": torch.__version__,
        "source": "export",
    }
    writer = ResilientFileSystemWriter(out, manifest=manifest)
    writer.set_up_storage_writer(True)
    writer.finish(metadata, [results])
    return True
