"""Staging: copying a rank's tensors into its store segment without a torn snapshot.

The store segment *is* the staging buffer. On CUDA it is page-locked (``Segment.pin``) ahead
of time on the prefetcher's thread and stays locked across saves, so device-to-host copies
land in shared memory directly, asynchronously, on a side stream ordered after the
producer's stream; nothing is page-locked on the save's calling thread. A segment that is not
locked yet (the first save after a start, a size change) is filled from a *device snapshot*
when the GPU has room (a copy within the GPU, then device-to-host in the background), else by
copies into pageable memory. On CPU one background thread copies (torch ``copy_`` releases
the GIL; on this class of machine a single stream of memcpy already saturates memory
bandwidth — two threads measured slower).

Contract for the training loop: the tensors handed to a save must not be modified until the
copies have read them. :meth:`StagingHandle.fence` orders that without a CPU wait for device
copies — later work on the given CUDA stream (the optimizer's update) runs after them — and
waits on the CPU only for the copies of CPU tensors; :meth:`StagingHandle.wait_sources`
(``SaveHandle.wait_staged``) blocks until every source has been read — into the segment, or
into a device snapshot whose way down continues in the background — and
:meth:`StagingHandle.wait` until every copy is done. Reading them meanwhile (forward/backward)
is fine.
"""

from __future__ import annotations

import logging
import operator
import threading
import time
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..bits import bits, foreach_copy_bits, foreach_copy_run_bits, run_bits
from ..gc_pause import paused_gc
from ..thread_pools import background_executor
from .layout import DenseRun, TensorLayout, dense_runs
from .segment import Segment
from .store import CheckpointStore

logger = logging.getLogger(__name__)


class StagedPrefix:
    """How far the staging thread's copies into a segment have come, as a prefix of its
    bytes (CPU sources copied in offset order, a piece of about :data:`PIECE_BYTES` at a time):
    replication sends a chunk as soon as it is staged instead of after the last copy (issue 34)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._upto = 0
        self._over = False

    def advance(self, upto: int) -> None:
        with self._cond:
            self._upto = max(self._upto, upto)
            self._cond.notify_all()

    def close(self) -> None:
        """The copies ended (done or failed): waiters go on to the handle's result."""
        with self._cond:
            self._over = True
            self._cond.notify_all()

    def wait(self, nbytes: int) -> bool:
        """Block until the first ``nbytes`` are staged (True) or the copies ended (False)."""
        with self._cond:
            self._cond.wait_for(lambda: self._upto >= nbytes or self._over)
            return self._upto >= nbytes


#: how many bytes of a run the staging thread copies before it says how far it came
PIECE_BYTES = 8 << 20


class StagingHandle:
    """Completion of one snapshot's copies into its segment.

    ``event``: recorded on the copy stream once every CUDA source has been read (into the
    segment, or into the device snapshot); ``future``: the background copies (CPU tensors,
    the device snapshot's way down), done when the segment holds every byte."""

    def __init__(
        self,
        future: Optional[Future] = None,
        event=None,
        started: float = 0.0,
        snapshot: bool = False,
        segment: Optional[Segment] = None,
    ):
        self._future = future
        self._event = event
        self._cpu_sources = False
        #: set by the staging thread once every CPU source was copied (before a device
        #: snapshot's way down): the sources may change from then on
        self._cpu_read: Optional[threading.Event] = None
        self._segment = segment
        self.started = started
        self.snapshot = snapshot  # CUDA sources were copied within the GPU first
        self.finished: Optional[float] = None
        #: set when every byte is copied by the staging thread, in offset order (CPU sources
        #: only): :meth:`wait_prefix` then waits for a prefix instead of every copy
        self._prefix: Optional[StagedPrefix] = None

    @classmethod
    def failed(cls, error: BaseException, segment: Optional[Segment] = None) -> "StagingHandle":
        """Copies that never started: waiting for them raises ``error``."""
        future: Future = Future()
        future.set_exception(error)
        handle = cls(future, segment=segment)
        handle._cpu_sources = True
        return handle

    def wait_prefix(self, nbytes: int) -> None:
        """Block until the segment's first ``nbytes`` hold their bytes (every copy, where the
        copies are not tracked by offset: CUDA sources, a device snapshot). Re-raises a failed
        copy."""
        if self._prefix is not None and self._prefix.wait(nbytes):
            return
        self.wait()

    def segment(self) -> Optional[Segment]:
        """The segment the copies land in (reserved by the staging thread when the caller
        passed a function: waits for it; None if reserving it failed)."""
        if self._segment is None and self._future is not None:
            try:
                self._segment = self._future.result()
            except Exception:
                return None
        return self._segment

    def done(self) -> bool:
        if self._future is not None and not self._future.done():
            return False
        if self._event is not None and not self._event.query():
            return False
        return True

    def fence(self, stream=None) -> float:
        """Order the mutation of the saved tensors after the copies that read them, without a
        CPU wait for device copies: later work on ``stream`` (default: the current CUDA stream)
        waits for the CUDA sources' copies on the GPU; the copies of CPU tensors (done by the
        staging thread) are waited for here (returns the seconds). Re-raises a failed CPU copy."""
        if self._event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self._event)
        t0 = time.perf_counter()
        self._wait_cpu_sources()
        return time.perf_counter() - t0

    def wait_sources(self) -> float:
        """Block until every source tensor has been read, so it may be mutated: its bytes are in
        the segment or in the device snapshot (a snapshot's way down to the segment may still
        run: :meth:`wait` waits for that too). Returns the seconds waited; re-raises a failed
        copy of a CPU source."""
        t0 = time.perf_counter()
        self._wait_cpu_sources()
        if self._event is not None:
            self._event.synchronize()
        return time.perf_counter() - t0

    def _wait_cpu_sources(self) -> None:
        if not (self._cpu_sources and self._future is not None):
            return
        if self._cpu_read is not None:
            self._cpu_read.wait()
            if not self._future.done():
                return  # copied; the rest (a snapshot's way down) runs on
        self._future.result()  # re-raises a failure (the event is set on failure too)

    def wait(self) -> float:
        """Block until every copy finished; returns seconds spent waiting. Re-raises failures."""
        t0 = time.perf_counter()
        if self._future is not None:
            self._future.result()
        if self._event is not None:
            self._event.synchronize()
        if self.finished is None:
            self.finished = time.perf_counter()
        return time.perf_counter() - t0


class Stager:
    """Copies tensors into segment slots; one per manager (owns a thread and a CUDA stream)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient_ckpt-stage")
        self._stream = None

    def _side_stream(self):
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def stage(
        self,
        tensors: Sequence[torch.Tensor],
        segment: Union[Segment, Callable[[], Segment]],
        layouts: Sequence[TensorLayout],
        plan: Optional["RunPlan"] = None,
        device_snapshot: bool = False,
        same_sources: Optional[bool] = None,
    ) -> StagingHandle:
        """Start copying ``tensors`` into ``segment`` at ``layouts``. ``plan``: the layouts'
        :class:`RunPlan` when the caller keeps one across saves: where it saw the same tensors
        before (:meth:`RunPlan.same_sources`), nothing is derived per tensor again. Each run's
        destination views are made in one call (or ahead, by the prefetcher) and filled with
        one ``_foreach_copy_`` per device (a few Python calls per tensor cost more than the
        bytes at 50,000 small tensors). ``same_sources``: the caller already asked the plan
        about ``tensors``.

        CUDA sources go to the segment on a side stream: asynchronously when it is
        page-locked; with ``device_snapshot``, through a copy within the GPU first (the sources
        are free once that copy ran; the way down runs on the staging thread); else
        synchronously into pageable memory. ``segment`` may be a function that reserves it,
        called on the staging thread (with a device snapshot nothing else needs it sooner).
        Nothing is page-locked here."""
        started = time.perf_counter()
        if plan is None:
            plan = RunPlan(dense_runs(layouts), layouts)
        if same_sources is None:
            plan.same_sources(tensors)
        dests = _Destinations(plan.runs, tensors, layouts)
        cuda, cpu, src_bits = plan.items(tensors)
        now = segment if isinstance(segment, Segment) else None
        if now is None and cuda and not device_snapshot:
            now = segment = segment()  # type: ignore[operator]
        event = None
        down: List[Tuple[_Item, List[Tuple[List[int], List[torch.Tensor]]]]] = []
        if cuda:
            stream = self._side_stream()
            # Copy only after the kernels that produced the tensors (on the caller's stream).
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad(), paused_gc():
                for item in cuda:
                    srcs = item[2]
                    if device_snapshot:
                        down.append((item, _snapshot(srcs)))
                    else:
                        assert now is not None
                        _copy_run(dests.of(now, item), srcs, non_blocking=now.pinned, src_bits=src_bits(item))
                    for src in srcs:
                        # Keep the caching allocator from reusing src's memory before the copy.
                        src.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
        future = None
        cpu_read = threading.Event()
        # Every copy on the staging thread, in offset order: it tells how far it came.
        prefix = StagedPrefix() if cpu and not cuda and not down and all(i[1] is None for i in cpu) else None
        if cpu or down or now is None:
            future = self._pool.submit(
                _finish, segment, dests, cpu, down, self._stream, cpu_read, prefix, src_bits
            )
            future.add_done_callback(lambda _f: cpu_read.set())  # however the job ended
            if prefix is not None:
                future.add_done_callback(lambda _f: prefix.close())
        handle = StagingHandle(future, event, started, snapshot=bool(down), segment=now)
        handle._cpu_sources = bool(cpu)
        handle._cpu_read = cpu_read
        handle._prefix = prefix
        return handle

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def run_region(segment: Segment, run: DenseRun) -> torch.Tensor:
    """A run's bytes in ``segment`` as one flat tensor of its dtype."""
    return segment.buffer[run.offset : run.offset + run.nbytes].view(run.dtype)


def _views(dst, likes: Sequence[torch.Tensor]) -> List[torch.Tensor]:
    """``dst`` as per-tensor views shaped like ``likes`` (one call for a whole flat region);
    views already made are returned as they are."""
    if isinstance(dst, (list, tuple)):
        return dst
    # Integer views of the flat region (one view for the whole run): copies into them move
    # bits (resilient_ckpt.bits), and no per-tensor view is needed on this side.
    return torch._C._nn.unflatten_dense_tensors(_flat_bits(dst), likes)


def _flat_bits(flat: torch.Tensor) -> torch.Tensor:
    """A flat region as integers of its element's size (complex128, 16 bytes, has none of one
    element: left as it is, each of its views is taken apart by the copy instead)."""
    return bits(flat) if flat.element_size() <= 8 else flat


def run_views(segment: Segment, runs: Sequence[DenseRun], likes: Sequence[Sequence[torch.Tensor]]):
    """Every run's destination views in ``segment`` (``likes``: per run, tensors of the
    shapes to view, e.g. on the meta device)."""
    with paused_gc():
        return [_views(run_region(segment, run), like) for run, like in zip(runs, likes)]


def _copy_run(dst, srcs: Sequence[torch.Tensor], non_blocking: bool = False, src_bits=None) -> None:
    """Copy ``srcs`` (one dtype) into ``dst``: a flat region (viewed in one call) or its
    views (integer views: ``_views`` makes no other kind). ``src_bits``: the sources' integer
    views, where the plan keeps them."""
    if srcs:
        foreach_copy_run_bits(_views(dst, srcs), srcs, srcs[0].dtype, non_blocking, src_bits)


def _copy_run_in_pieces(
    dst, srcs: Sequence[torch.Tensor], sizes: Sequence[int], start: int, prefix: StagedPrefix, src_bits=None
) -> None:
    """:func:`_copy_run` of a CPU run starting at byte ``start`` of its segment, about
    :data:`PIECE_BYTES` at a time (a tensor is never split), saying after each piece how far
    the segment is staged. ``sizes``: each source's bytes (from its layout: asking 50,000
    tensors for theirs costs more than the piece bookkeeping is worth)."""
    if not srcs:
        return
    views = _views(dst, srcs)
    dtype = srcs[0].dtype
    i, pos = 0, start
    while i < len(srcs):
        j, n = i, 0
        while j < len(srcs) and (j == i or n < PIECE_BYTES):
            n += sizes[j]
            j += 1
        foreach_copy_run_bits(
            views[i:j], srcs[i:j], dtype, src_bits=None if src_bits is None else src_bits[i:j]
        )
        i, pos = j, pos + n
        prefix.advance(pos)


def _snapshot(srcs: Sequence[torch.Tensor]) -> List[Tuple[List[int], List[torch.Tensor]]]:
    """Copy ``srcs`` (one dtype) into new device memory, one flat buffer per device, on the
    current (side) stream; returns (indexes into ``srcs``, their snapshot views) per device."""
    by_device: Dict[torch.device, List[int]] = {}
    for i, t in enumerate(srcs):
        by_device.setdefault(t.device, []).append(i)
    out = []
    for device, idx in by_device.items():
        group = [srcs[i] for i in idx]
        flat = _flat_bits(torch.empty(sum(t.numel() for t in group), dtype=group[0].dtype, device=device))
        views = _views(flat, group)
        foreach_copy_run_bits(views, group, group[0].dtype, non_blocking=True)
        out.append((idx, views))
    return out


_DATA_PTR = torch.Tensor.data_ptr
_DEREF = weakref.ref.__call__

#: (run index, position in a mixed run or None for the whole run, its sources)
_Item = Tuple[int, Optional[int], List[torch.Tensor]]


def _classify(runs: Sequence[DenseRun], tensors: Sequence[torch.Tensor]) -> Tuple[List[_Item], List[_Item]]:
    """Each run's sources as CUDA or CPU items (a mixed run: each tensor an item of its own,
    copied through its own view)."""
    cuda: List[_Item] = []
    cpu: List[_Item] = []
    for k, run in enumerate(runs):
        srcs = [tensors[i] for i in run.indexes]
        on_cuda = [t.is_cuda for t in srcs]
        if not any(on_cuda):
            cpu.append((k, None, srcs))
        elif all(on_cuda):
            cuda.append((k, None, srcs))
        else:
            for j, (src, dev) in enumerate(zip(srcs, on_cuda)):
                (cuda if dev else cpu).append((k, j, [src]))
    return cuda, cpu


class _Destinations:
    """Where each staged item lands in a segment: its run's views made ahead by the prefetcher,
    or its flat region (a mixed run's tensors: their own views of it)."""

    def __init__(
        self, runs: Sequence[DenseRun], tensors: Sequence[torch.Tensor], layouts: Sequence[TensorLayout]
    ):
        self._runs = runs
        self._tensors = tensors
        self._layouts = layouts
        self._split: Dict[int, List[torch.Tensor]] = {}

    def sizes(self, item: _Item) -> List[int]:
        """The bytes of each of a whole run's tensors, from their layouts."""
        lay = self._layouts
        return [lay[i].nbytes for i in self._runs[item[0]].indexes]

    def offset(self, item: _Item) -> int:
        """Where the item's run starts in the segment."""
        return self._runs[item[0]].offset

    def of(self, segment: Segment, item: _Item):
        k, j, _srcs = item
        prepared = segment.views_for(self._runs)
        region = prepared[k] if prepared is not None else run_region(segment, self._runs[k])
        if j is None:
            return region
        if k not in self._split:
            self._split[k] = _views(region, [self._tensors[i] for i in self._runs[k].indexes])
        return [self._split[k][j]]


def _finish(
    segment,
    dests: _Destinations,
    cpu: Sequence[_Item],
    down,
    stream,
    cpu_read=None,
    prefix=None,
    src_bits: Callable[[_Item], Optional[List[torch.Tensor]]] = lambda item: None,
) -> Segment:
    """The staging thread's part: reserve the segment if the caller did not, copy the CPU
    tensors (then set ``cpu_read``: the CPU sources may change), bring the device snapshot
    down. Returns the segment. ``prefix``: every item is a whole CPU run, copied in offset
    order and reported piece by piece (the runs of a layout are back to back from byte 0, but
    a gap between them, alignment, holds nothing to wait for)."""
    try:
        if not isinstance(segment, Segment):
            segment = segment()
        # Grad mode is per thread: a Parameter source must not record history. The collector
        # is paused while the views' Python objects (one per tensor) are made.
        with torch.no_grad(), paused_gc():
            if prefix is None:
                for item in cpu:
                    _copy_run(dests.of(segment, item), item[2], src_bits=src_bits(item))
            else:
                for item in sorted(cpu, key=dests.offset):
                    start = dests.offset(item)
                    prefix.advance(start)  # the alignment gap before this run
                    sizes = dests.sizes(item)
                    _copy_run_in_pieces(
                        dests.of(segment, item), item[2], sizes, start, prefix, src_bits(item)
                    )
    finally:
        if cpu_read is not None:
            cpu_read.set()  # on failure too: the waiter then finds the future's exception
    with torch.no_grad(), paused_gc():
        if down:
            # On the stream that made the snapshot (so after it); its memory returns to the
            # caching allocator once this stream has passed the copies down.
            with torch.cuda.stream(stream):
                for item, parts in down:
                    dsts = _views(dests.of(segment, item), item[2])
                    for idx, snap in parts:
                        foreach_copy_bits([dsts[i] for i in idx], snap, non_blocking=segment.pinned)
                stream.synchronize()
    return segment


class RunPlan:
    """A layout's dense runs and what staging derives from them, kept across saves of one
    structure: made once on first use (in the prefetcher's thread), a meta tensor per tensor
    of the shape to view (what preparing a segment's views needs); and, for the tensors the
    last save staged, their items (which runs go to which device) and their integer views.

    The tensors of a training loop are the same objects save after save (changed in place):
    :meth:`same_sources` tells, from their identity and storage address, that what was derived
    from them still holds, so a cached save does no per-tensor work on its sources. The plan
    refers to the last save's tensors weakly; only once the same tensors come back does it keep
    what it derived from them (integer views: their storage, which the tensors hold anyway)
    until the structure changes or the manager closes — a caller that brings new tensors at
    every save is never made to keep the old ones (nor to free them in its next save)."""

    def __init__(self, runs: Sequence[DenseRun], layouts: Sequence[TensorLayout]):
        self.runs = runs
        self._layouts = layouts
        self._likes: Optional[List[List[torch.Tensor]]] = None
        self._refs: Optional[List[weakref.ref]] = None  # the last save's tensors, weakly
        self._addresses: Optional[List[int]] = None
        #: (CUDA items, CPU items, per-run integer views) of tensors seen at two saves in a
        #: row: the views are made by whichever thread copies a run first, into this
        #: generation's dict (new tensors start a new one: no thread writes into another's)
        self._derived: Optional[Tuple[List[_Item], List[_Item], Dict[int, List[torch.Tensor]]]] = None

    def same_sources(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are the very tensors the last save through this plan staged, at
        the same storage (``Tensor.data_ptr``: a ``.data`` swap or a re-allocation moves it —
        the old storage stays alive in the kept views, so no other tensor can take its
        address), with what was derived from them kept: then nothing is derived again."""
        prev = self._refs
        if (
            prev is not None
            and len(prev) == len(tensors)
            and all(map(operator.is_, map(_DEREF, prev), tensors))
        ):
            addresses = list(map(_DATA_PTR, tensors))
            if self._derived is not None and addresses == self._addresses:
                return True
            # The same tensors again: a training loop's. From now on what staging derives from
            # them is kept (a .data swap since: derived again, from the new storage).
            self._addresses = addresses
            self._derived = (*_classify(self.runs, tensors), {})
            return False
        self._refs = list(map(weakref.ref, tensors))
        self._addresses = self._derived = None
        return False

    def items(self, tensors: Sequence[torch.Tensor]):
        """``(cuda items, cpu items, src_bits)`` for staging ``tensors``, which the plan was
        last asked about (:meth:`same_sources`); ``src_bits(item)`` gives an item's integer
        source views (kept in the plan for tensors it keeps; None for a mixed run's single
        tensors)."""
        derived = self._derived
        if derived is None:  # tensors seen once: derived for this save only
            cuda, cpu = _classify(self.runs, tensors)
            kept: Optional[Dict[int, List[torch.Tensor]]] = None
        else:
            cuda, cpu, kept = derived
        runs = self.runs

        def src_bits(item: _Item) -> Optional[List[torch.Tensor]]:
            k, j, srcs = item
            if j is not None:
                return None
            views = kept.get(k) if kept is not None else None
            if views is None:
                views = run_bits(srcs, runs[k].dtype)
                if views is not None and kept is not None:
                    kept[k] = views
            return views

        return cuda, cpu, src_bits

    def likes(self) -> List[List[torch.Tensor]]:
        if self._likes is None:
            lay = self._layouts
            with paused_gc():
                self._likes = [
                    [torch.empty(lay[i].shape, dtype=run.dtype, device="meta") for i in run.indexes]
                    for run in self.runs
                ]
        return self._likes


class SegmentPrefetcher:
    """Keeps the next save's segment reserved, mapped, populated and (``pin``: once a save
    staged GPU tensors) page-locked ahead of time, on its own thread.

    Reserving off the critical path hides the mapping cost (minor faults on a recycled tmpfs
    file cost ~3x a memcpy) and the page-locking (hundreds of ms per GiB). A retired segment of
    this process can be adopted (:meth:`adopt`) as it is — still mapped and locked — so a steady run
    maps and locks nothing at all; one spare is kept at a time.
    """

    def __init__(self, store: CheckpointStore, pin: bool = False, nice: int = 0):
        self.store = store
        self.pin = pin
        self._lock = threading.Lock()
        self._ready: Optional[Segment] = None
        self._pending: Optional[Future] = None  # a reservation (and its locking) being made
        self._views_pending: Optional[Future] = None  # views of the ready segment being made
        #: (``nice``: its thread's priority below its creator's, see thread_pools)
        self._pool = background_executor("resilient_ckpt-prefetch", nice)

    def prefetch(self, nbytes: int, plan: Optional["RunPlan"] = None) -> None:
        """Start reserving a segment of ``nbytes`` in the background (no-op if one is ready).
        ``plan``: the layout the next save is expected to use (a cached save's): its views
        into the segment are made ahead too, off the save's critical path."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return
            if self._ready is not None and self._ready.nbytes == nbytes:
                if plan is not None and self._ready.views_for(plan.runs) is None:
                    self._views_pending = self._pool.submit(self._prepare_views, self._ready, plan)
                return
            self._pending = self._pool.submit(self._reserve, nbytes, plan)

    def _reserve(self, nbytes: int, plan: Optional["RunPlan"] = None) -> None:
        seg = self.store.reserve(nbytes)
        if self.pin:
            seg.pin()
        if plan is not None:
            self._prepare_views(seg, plan)
        self._set_ready(seg)

    def _set_ready(self, seg: Segment) -> None:
        with self._lock:
            old, self._ready = self._ready, seg
        if old is not None:
            self.store.release(old)

    def adopt(self, seg: Segment) -> bool:
        """Keep ``seg`` (reserved in this process: a retired segment of this manager, still
        mapped) as the spare, unless one is ready or being made; returns whether it was kept."""
        with self._lock:
            busy = self._ready is not None or (self._pending is not None and not self._pending.done())
            if not busy:
                self._ready = seg
                # Replication dropped its pages from this process's page tables as they were
                # sent (the trainer's RSS stays flat): map them back now, off the save's path,
                # or the next save's copy takes a fault per page.
                self._views_pending = self._pool.submit(seg.populate_pages, 0, seg.nbytes)
        return not busy

    def has_ready(self, nbytes: int, pinned: bool = False) -> bool:
        """Whether :meth:`take` of ``nbytes`` would return at once a segment made ahead
        (``pinned``: page-locked too)."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return False
            seg = self._ready
            return seg is not None and seg.nbytes == nbytes and (seg.pinned or not pinned)

    @staticmethod
    def _prepare_views(seg: Segment, plan: "RunPlan") -> None:
        try:
            seg.keep_views(plan.runs, run_views(seg, plan.runs, plan.likes()))
        except Exception as e:  # only an optimisation: staging makes them itself
            logger.debug("views for the next save not prepared: %s", e)

    def wait_prepared(self) -> Optional[BaseException]:
        """Until the segment being reserved, and its pages or views being made, are ready;
        the failure of either, if one failed (:meth:`take` then reserves one itself)."""
        error = None
        for pending in (self._pending, self._views_pending):
            if pending is not None:
                try:
                    pending.result()
                except Exception as e:
                    error = e
        return error

    def take(self, nbytes: int, populate: bool = True) -> Segment:
        """A reserved segment of exactly ``nbytes`` (reserved now if none is ready, its pages
        populated up front only if ``populate``)."""
        error = self.wait_prepared()
        if error is not None:  # fall back to a synchronous reservation with its own error
            logger.warning("background segment reservation failed: %s", error)
        with self._lock:
            seg, self._ready = self._ready, None
        if seg is not None and seg.nbytes == nbytes:
            return seg
        if seg is not None:
            self.store.release(seg)
        # Never page-locked here: this is the save's critical path (the save stages GPU
        # tensors through a device snapshot or pageable copies instead; see Stager.stage).
        return self.store.reserve(nbytes, populate=populate)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            seg, self._ready = self._ready, None
        if seg is not None:
            self.store.release(seg)
