"""The persistent tier: flush in-memory checkpoints to DCP directories, restore from them.

Layout of a tier directory (a file system every rank sees, like any DCP checkpoint)::

    <dir>/iter_0000100/          a complete checkpoint: .metadata, __<rank>_0.distcp,
                                 resilient_ckpt.json (manifest: session, iteration, world size)
    <dir>/.iter_0000200.partial/ a flush in progress (never loaded; renamed when complete)

Flush (:meth:`PersistentTier.flush`, every ``every_n_saves`` complete saves via
:meth:`PersistentTier.maybe_flush`, on SIGTERM, on demand): each rank writes its own
checkpoint of the agreed iteration straight from the node store (:class:`~.snapshot.StoreSnapshot`:
every saved tensor is a view of a read-only mapping of the segment, no device copy, no extra
copy), so the disk tier writes exactly the shards the memory tier's distribution gave each
rank. Work runs on one named thread (``resilient_ckpt-flush``) over a process group of its
own, so it never interleaves with training collectives. DCP writes ``.metadata`` last and the
directory is renamed into place only after it, so a partial flush is never loadable; older
durable checkpoints are removed only after the new one is complete. After writing, each rank
checks the source bytes against the store's checksums, so a segment retired and reused by a
newer save mid-flush fails the flush instead of writing mixed data.

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
data-parallel ``parallelization_group`` the load is two-stage (:func:`~.two_stage.two_stage_load`):
each stored entry is read by one rank of the group and broadcast to the others.
:func:`restore_latest` picks the newer of the memory and persistent tiers on every rank
together and reports which tier each rank restored from.

:class:`PersistentTier` satisfies :class:`~.interface.PersistentTierProtocol`, what the
checkpoint manager uses of it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import shutil
import signal
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.storage import StorageReader

from ..errors import CheckpointingException, CorruptCheckpointError, ForeignCheckpointError, ValidationError
from ..memory.store import CheckpointStore
from ..model.mapping import ShardedObject, apply_factory_merges
from ..model.nested import fill_holes, map_leaves, map_leaves_inplace, merge, split
from ..parallel import collectives
from ..parallel.template import preprocess as preprocess_template

# The template preprocessing the memory tier's load uses (private there until parallel/ exports it).
from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
from ..replication.transport import new_checkpoint_group, release_checkpoint_group
from .interface import DurableCheckpoint, FlushHandle, FlushResult, LoadReport
from .layout import (
    BACKEND,
    DCP_FORMAT_VERSION,
    ITER_DIR,
    METADATA_NAME,
    PARTIAL_DIR,
    hollow_fqn,
    iteration_dir_name,
    new_manifest,
    partial_dir_name,
    writer_id,
)
from .load_planner import ResilientLoadPlanner
from .local_load import load_local, read_values
from .save_planner import ResilientSavePlanner
from .snapshot import StoreSnapshot
from .storage import ResilientFileSystemWriter, SafeFileSystemReader, error_from_dcp, fsync_dir, read_manifest
from .two_stage import DEFAULT_READ_AHEAD_BYTES, two_stage_load

logger = logging.getLogger(__name__)


@dataclass
class _Request:
    kind: str
    store: Optional[CheckpointStore]
    iteration: Optional[int]
    future: Future


@dataclass
class _FlushSource:
    """What a flush writes: the snapshot and its state dict (dropped before unmapping)."""

    snapshot: StoreSnapshot
    state: Optional[Dict[str, Any]]


@dataclass
class _PreparedLoad:
    """Everything a load needs before reading tensors (read on every rank, then agreed)."""

    reader: StorageReader
    metadata: Metadata
    #: what DCP loads into: the template's sharded part, or the saved sharded structure
    target: Dict[str, Any]
    common: Any = field(default_factory=dict)
    nonpersistent: Any = field(default_factory=dict)
    factories: Any = field(default_factory=dict)
    #: device types the tensors were saved from (no template only)
    saved_devices: set = field(default_factory=set)


def _check_tier_args(every_n_saves: int, keep_last: int, thread_count: int) -> None:
    if every_n_saves < 0:
        raise ValidationError(f"every_n_saves must be >= 0 (0: no periodic flush), got {every_n_saves}")
    if keep_last < 1:
        raise ValidationError(f"keep_last must be >= 1, got {keep_last}")
    if thread_count < 1:
        raise ValidationError(f"thread_count must be >= 1, got {thread_count}")


def _check_loadable(chosen: DurableCheckpoint, template: Optional[Any], world_size: int) -> None:
    """The chosen checkpoint is of a format this build reads, and (without a template) of
    this job's world size."""
    m = chosen.manifest
    if m.get("version", 0) > DCP_FORMAT_VERSION or m.get("backend") != BACKEND:
        raise ForeignCheckpointError(
            f"{chosen.path}: written as backend {m.get('backend')!r} version {m.get('version')}; "
            f"this build reads backend {BACKEND!r} up to version {DCP_FORMAT_VERSION}"
        )
    saved_world = int(m.get("world_size", -1))
    if template is None and saved_world != world_size:
        raise ForeignCheckpointError(
            f"{chosen.path} was written by a job of world size {saved_world}, this job has "
            f"{world_size}; without a template each rank needs its own saved structure. "
            "Pass a template (sharded state dict) to load it resharded"
        )


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
        _check_tier_args(every_n_saves, keep_last, thread_count)
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
            group = new_checkpoint_group(backend="gloo", timeout_s=timeout_s)
        self._group = group if self._distributed else None
        self._own_group = self._distributed and group is None  # made here: destroyed by close()
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
        #: iterations of queued requests (a periodic flush names the save that asked for it):
        #: retention keeps them until their round has read them
        self._queued: Dict[int, int] = {}
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
        with self._lock:
            queued = [it for it, n in self._queued.items() if n > 0]
        return sorted(set(queued + ([] if p is None else [p])))

    # ---- listing -------------------------------------------------------------------------

    def _final_dir(self, iteration: int) -> Path:
        return self.directory / iteration_dir_name(iteration)

    def _partial_dir(self, iteration: int) -> Path:
        return self.directory / partial_dir_name(iteration)

    def list_complete(self, include_foreign: bool = False) -> List[DurableCheckpoint]:
        """Complete checkpoints of this tier's session in the directory, oldest first (local
        listing, no collective)."""
        out = []
        try:
            entries = list(self.directory.iterdir())
        except FileNotFoundError:
            return []
        for p in entries:
            m = ITER_DIR.match(p.name)
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
        (collective over the tier's group: the coordinator's listing, broadcast)."""
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
            # This iteration, pinned from now on: with keep_last=1 the next save would retire
            # it before a round that starts later could read it.
            return self._request("periodic", store, iteration)
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
            if iteration is not None:
                self._queued[iteration] = self._queued.get(iteration, 0) + 1
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
            try:
                if not req.future.set_running_or_notify_cancel():
                    continue
                try:
                    req.future.set_result(self._round(req))
                except BaseException as e:  # reported through the handle
                    self.flushes_failed += 1
                    logger.warning("flush (%s) failed on rank %d: %s", req.kind, self.rank, e)
                    req.future.set_exception(e)
            finally:
                if req.iteration is not None:
                    with self._lock:
                        self._queued[req.iteration] -= 1

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
            latest = self.agreed_latest()  # every rank's first round: same point everywhere
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
        source = self._open_source(store, iteration, partial)
        self._write(source, partial, iteration, store.session)
        seconds = time.perf_counter() - t0
        mine = self._planner.stats.bytes_written
        total = collectives.all_reduce_int(mine, "sum", self._group) if self._group is not None else mine
        final = self._final_dir(iteration)
        self._publish_together(partial, final, iteration)
        self._last_flushed = iteration
        result = FlushResult(iteration, str(final), mine, total, seconds, time.perf_counter() - t0)
        self.last_flush = result
        logger.info(
            "flushed iteration %d to %s: %.3f GB in %.2fs (%.2f GB/s for the group)",
            iteration,
            final,
            total / 1e9,
            result.durable_seconds,
            result.throughput_gbps,
        )
        return result

    def _open_source(self, store: Optional[CheckpointStore], iteration: int, partial: Path) -> _FlushSource:
        """Prepare the partial directory and this rank's snapshot; fails on every rank
        together (collective)."""
        snapshot: Optional[StoreSnapshot] = None
        state: Optional[Dict[str, Any]] = None
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
        return _FlushSource(snapshot, state)

    def _write(self, source: _FlushSource, partial: Path, iteration: int, session: Optional[str]) -> None:
        """DCP's save of the snapshot into ``partial`` (collective); the snapshot is closed
        whatever happens."""
        manifest = new_manifest(
            "flush",
            session=session,
            iteration=iteration,
            world_size=self.world_size,
            group_size=collectives.group_size(self._group) if self._group is not None else 1,
            writer=writer_id(),
        )
        writer = ResilientFileSystemWriter(
            partial,
            manifest=manifest,
            after_write=source.snapshot.verify,
            sync_files=self.sync_files,
            thread_count=self.thread_count,
        )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(
                    source.state,
                    storage_writer=writer,
                    planner=self._planner,
                    process_group=self._group,
                    no_dist=self._group is None,
                )
        except CheckpointException as e:
            self._cleanup_partial(partial)
            raise error_from_dcp(e, f"flush of iteration {iteration} to {partial}") from None
        except BaseException:
            self._cleanup_partial(partial)
            raise
        finally:
            source.state = None
            self._planner.release()  # drop its views of the mapping before unmapping
            source.snapshot.close()

    def _publish_together(self, partial: Path, final: Path, iteration: int) -> None:
        """The coordinator renames the flush into place and retires old ones; every rank
        learns the outcome (collective) and raises if it failed."""
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
        fsync_dir(self.directory)

    def _retire(self, newest: int) -> None:
        complete = [c for c in self.list_complete() if c.iteration <= newest]
        for c in complete[: max(0, len(complete) - self.keep_last)]:
            logger.info("removing durable checkpoint %s (keep_last=%d)", c.path, self.keep_last)
            shutil.rmtree(c.path, ignore_errors=True)
        for p in self.directory.iterdir():
            m = PARTIAL_DIR.match(p.name)
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
        chosen = self.agreed_latest()
        if chosen is None:
            self._raise_if_only_foreign()
            return None
        _check_loadable(chosen, template, self.world_size)
        two_stage = parallelization_group is not None and collectives.group_size(parallelization_group) > 1
        planner = ResilientLoadPlanner(allow_partial_load=not strict, allow_pickle=allow_pickle)
        prepared = self._together(f"load of {chosen.path}", self._prepare_load, chosen, template)
        bytes_read = self._together(
            f"load of {chosen.path}",
            self._read_tensors,
            prepared,
            planner,
            parallelization_group if two_stage else None,
        )
        result = _assemble(prepared, template)
        self._last_flushed = max(
            self._last_flushed if self._last_flushed is not None else -1, chosen.iteration
        )
        self.last_load = LoadReport(
            "persistent", chosen.iteration, chosen.path, time.perf_counter() - t0, bytes_read, two_stage
        )
        logger.info(
            "rank %d restored iteration %d from the persistent tier (%s) in %.3fs",
            self.rank,
            chosen.iteration,
            chosen.path,
            self.last_load.seconds,
        )
        return result, chosen.iteration

    def _together(self, what: str, step: Callable[..., Any], *args: Any) -> Any:
        """``step(*args)`` on every rank; a failure on any rank raises on all (collective)."""
        out = None
        local_exc: Optional[BaseException] = None
        try:
            out = step(*args)
        except BaseException as e:
            local_exc = e
        collectives.fail_together(local_exc, what, self._group)
        return out

    def _raise_if_only_foreign(self) -> None:
        foreign = self._foreign
        if foreign:
            raise ForeignCheckpointError(
                f"{self.directory} holds only checkpoints of other sessions ("
                + ", ".join(f"{p} of session {s!r}" for p, s in foreign)
                + f"), not of session {self.session!r}; pass session= of the job that wrote "
                "them, or point the tier at another directory"
            )

    def _prepare_load(self, chosen: DurableCheckpoint, template: Optional[Any]) -> _PreparedLoad:
        """Open the checkpoint, read this rank's hollow entry (the common state, and without a
        template the saved structure), and build what DCP loads into."""
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
        prepared = _PreparedLoad(reader, metadata, {}, common=tasd.common)
        if template is None:
            prepared.saved_devices = {d for d in tasd.pending_devices if d}
            # The rank's own objects are in its hollow state dict already: kept aside.
            objects, prepared.target = split(tasd.sharded_state_dict, lambda v: isinstance(v, ShardedObject))
            prepared.nonpersistent = map_leaves_inplace(lambda o: o.data, objects)
        else:
            prepared.target, _tpl_common, prepared.nonpersistent, prepared.factories = preprocess_template(
                template
            )
        if not isinstance(prepared.target, dict):
            prepared.target = {}
        return prepared

    def _read_tensors(
        self, prepared: _PreparedLoad, planner: ResilientLoadPlanner, dp_group: Optional[dist.ProcessGroup]
    ) -> int:
        """Load into ``prepared.target``, two-stage over ``dp_group`` when given; returns the
        bytes read."""
        if dp_group is not None:
            stats = two_stage_load(
                prepared.target,
                prepared.reader,
                dp_group,
                planner=planner,
                metadata=prepared.metadata,
                read_ahead_bytes=self.read_ahead_bytes,
            )
            return stats.bytes_read
        load_local(prepared.target, prepared.reader, planner, prepared.metadata)
        return planner.bytes_requested

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
        if self._own_group:
            release_checkpoint_group(self._group)
        ours = getattr(self, "_sigterm_handler", None)
        if ours is not None and threading.current_thread() is threading.main_thread():
            with contextlib.suppress(Exception):
                if signal.getsignal(signal.SIGTERM) is ours:  # not if someone replaced it since
                    signal.signal(signal.SIGTERM, self._prev_sigterm or signal.SIG_DFL)

    def __enter__(self) -> "PersistentTier":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _decode_hollow(value: Any, path: str, fqn: str) -> MCoreTensorAwareStateDict:
    try:
        return MCoreTensorAwareStateDict.from_bytes(bytes(value))
    except Exception as e:
        raise CorruptCheckpointError(f"{path}: entry {fqn!r} does not decode ({e})") from e


def _assemble(prepared: _PreparedLoad, template: Optional[Any]) -> Any:
    """The loaded state dict: common state, loaded tensors and values, local objects, merged
    factories (what ``CheckpointManager.load_local`` returns)."""
    target = prepared.target
    if (
        template is None
        and torch.cuda.is_available()
        and any(d.startswith("cuda") for d in prepared.saved_devices)
    ):
        # As load_local does: tensors go back to the device type they were saved from.
        map_leaves_inplace(lambda v: v.cuda() if isinstance(v, torch.Tensor) else v, target)
    result = map_leaves(lambda v: v, prepared.common)
    merge(result, target)
    merge(result, prepared.nonpersistent)
    if prepared.factories:
        result = apply_factory_merges(result, prepared.factories)
    return fill_holes(result)


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
    durable = tier.agreed_latest()
    out: Optional[Tuple[Any, int]] = None
    name = ""
    source = ""
    if mem >= 0 and (durable is None or mem >= durable.iteration):
        out = manager.load_local(template)
        if out is not None:
            m = manager.last_load_metrics
            name, source = "memory", f"memory:{getattr(m, 'source', '')}"
            tier.last_load = LoadReport(
                "memory",
                out[1],
                getattr(m, "source", ""),
                getattr(m, "total_s", 0.0),
                getattr(m, "bytes_read", 0),
            )
    if out is None:
        out = tier.load(template, parallelization_group, strict=strict)
        if out is not None:
            name, source = "persistent", f"persistent:{tier.last_load.source}"
    group = tier.group
    sources = collectives.all_gather_msgpack(source, group) if group is not None else [source]
    if out is None:
        return None
    return Restored(out[0], out[1], name, tuple(sources))
