"""Staging: copying a rank's tensors into its store segment without a torn snapshot.

The store segment *is* the staging buffer: on CUDA it is page-locked with cudaHostRegister
(``Segment.pin``) so device-to-host copies land in shared memory directly, asynchronously, on
a side stream ordered after the producer's stream; on CPU one background thread copies
(torch ``copy_`` releases the GIL; on this class of machine a single stream of memcpy already
saturates memory bandwidth — two threads measured slower). Buffers are reused across saves:
the next segment is reserved and mapped ahead of time by :class:`SegmentPrefetcher`.

Contract for the training loop: the tensors handed to a save must not be modified until
:meth:`StagingHandle.wait` (``SaveHandle.wait_staged``) returns — call it right before the
optimizer step. Reading them (forward/backward) is fine meanwhile.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import List, Optional, Sequence

import torch

from ..gc_pause import paused_gc
from .store import CheckpointStore, DenseRun, Segment, TensorLayout, dense_runs

logger = logging.getLogger(__name__)


class StagingHandle:
    """Completion of one snapshot's copies into its segment."""

    def __init__(self, future: Optional[Future] = None, event=None, started: float = 0.0):
        self._future = future
        self._event = event
        self.started = started
        self.finished: Optional[float] = None

    def done(self) -> bool:
        if self._future is not None and not self._future.done():
            return False
        if self._event is not None and not self._event.query():
            return False
        return True

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
        segment: Segment,
        layouts: Sequence[TensorLayout],
        runs: Optional[Sequence[DenseRun]] = None,
    ) -> StagingHandle:
        """Start copying ``tensors`` into ``segment`` at ``layouts``. ``runs``: the layouts'
        :func:`dense_runs` when the caller has them cached. Each run's destination views are
        made in one call and filled with one ``_foreach_copy_`` per device (a few Python calls
        per tensor cost more than the bytes at 50,000 small tensors)."""
        started = time.perf_counter()
        if runs is None:
            runs = dense_runs(layouts)
        prepared = segment.views_for(runs)
        cuda, cpu = [], []
        for k, run in enumerate(runs):
            srcs = [tensors[i] for i in run.indexes]
            # The run's destination: its views made ahead by the prefetcher, or its flat region.
            dst = prepared[k] if prepared is not None else run_region(segment, run)
            on_cuda = [t.is_cuda for t in srcs]
            if not any(on_cuda):
                cpu.append((dst, srcs))
            elif all(on_cuda):
                cuda.append((dst, srcs))
            else:  # a mixed run: each device's tensors separately, through their own views
                dsts = _views(dst, srcs)
                for d, src, dev in zip(dsts, srcs, on_cuda):
                    (cuda if dev else cpu).append(([d], [src]))
        event = None
        if cuda:
            segment.pin()
            stream = self._side_stream()
            # Copy only after the kernels that produced the tensors (on the caller's stream).
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.no_grad(), paused_gc():
                for region, srcs in cuda:
                    _copy_run(region, srcs, non_blocking=True)
                    for src in srcs:
                        # Keep the caching allocator from reusing src's memory before the copy.
                        src.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
        future = self._pool.submit(_copy_all, cpu) if cpu else None
        return StagingHandle(future, event, started)

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
    return torch._C._nn.unflatten_dense_tensors(dst, likes)


def run_views(segment: Segment, runs: Sequence[DenseRun], likes: Sequence[Sequence[torch.Tensor]]):
    """Every run's destination views in ``segment`` (``likes``: per run, tensors of the
    shapes to view, e.g. on the meta device)."""
    with paused_gc():
        return [_views(run_region(segment, run), like) for run, like in zip(runs, likes)]


def _copy_run(dst, srcs: Sequence[torch.Tensor], non_blocking: bool = False) -> None:
    """Copy ``srcs`` into ``dst``: a flat region (viewed in one call) or its views."""
    torch._foreach_copy_(_views(dst, srcs), srcs, non_blocking=non_blocking)


def _copy_all(runs) -> None:
    # Grad mode is per thread: a Parameter source must not record history. The collector is
    # paused while the views' Python objects (one per tensor) are made.
    with torch.no_grad(), paused_gc():
        for region, srcs in runs:
            _copy_run(region, srcs)


class RunPlan:
    """A layout's dense runs and, made once on first use (in the prefetcher's thread), a meta
    tensor per tensor of the shape to view: what preparing a segment's views needs."""

    def __init__(self, runs: Sequence[DenseRun], layouts: Sequence[TensorLayout]):
        self.runs = runs
        self._layouts = layouts
        self._likes: Optional[List[List[torch.Tensor]]] = None

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
    """Keeps the next save's segment reserved, mapped and populated ahead of time.

    Reserving off the critical path hides the mapping cost (minor faults on a recycled tmpfs
    file cost ~3x a memcpy); one spare segment is mapped at a time, so resident memory grows by
    one segment, not by every retained checkpoint.
    """

    def __init__(self, store: CheckpointStore, pin: bool = False):
        self.store = store
        self.pin = pin
        self._lock = threading.Lock()
        self._ready: Optional[Segment] = None
        self._pending: Optional[Future] = None
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient_ckpt-prefetch")

    def prefetch(self, nbytes: int, plan: Optional["RunPlan"] = None) -> None:
        """Start reserving a segment of ``nbytes`` in the background (no-op if one is ready).
        ``plan``: the layout the next save is expected to use (a cached save's): its views
        into the segment are made ahead too, off the save's critical path."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return
            if self._ready is not None and self._ready.nbytes == nbytes:
                if plan is not None and self._ready.views_for(plan.runs) is None:
                    self._pending = self._pool.submit(self._prepare_views, self._ready, plan)
                return
            self._pending = self._pool.submit(self._reserve, nbytes, plan)

    def _reserve(self, nbytes: int, plan: Optional["RunPlan"] = None) -> None:
        seg = self.store.reserve(nbytes)
        if self.pin:
            seg.pin()
        if plan is not None:
            self._prepare_views(seg, plan)
        with self._lock:
            old, self._ready = self._ready, seg
        if old is not None:
            self.store.release(old)

    @staticmethod
    def _prepare_views(seg: Segment, plan: "RunPlan") -> None:
        try:
            seg.keep_views(plan.runs, run_views(seg, plan.runs, plan.likes()))
        except Exception as e:  # only an optimisation: staging makes them itself
            logger.debug("views for the next save not prepared: %s", e)

    def take(self, nbytes: int, populate: bool = True) -> Segment:
        """A reserved segment of exactly ``nbytes`` (reserved now if none is ready, its pages
        populated up front only if ``populate``)."""
        pending = self._pending
        if pending is not None:
            try:
                pending.result()
            except Exception as e:  # fall back to a synchronous reservation with its own error
                logger.warning("background segment reservation failed: %s", e)
        with self._lock:
            seg, self._ready = self._ready, None
        if seg is not None and seg.nbytes == nbytes:
            return seg
        if seg is not None:
            self.store.release(seg)
        seg = self.store.reserve(nbytes, populate=populate)
        if self.pin:
            seg.pin()
        return seg

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            seg, self._ready = self._ready, None
        if seg is not None:
            self.store.release(seg)
