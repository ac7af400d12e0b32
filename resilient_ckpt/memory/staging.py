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
from typing import Optional, Sequence

import torch

from .store import CheckpointStore, Segment, TensorLayout

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
        self, tensors: Sequence[torch.Tensor], segment: Segment, layouts: Sequence[TensorLayout]
    ) -> StagingHandle:
        started = time.perf_counter()
        cuda = [i for i, t in enumerate(tensors) if t.device.type == "cuda"]
        cpu = [i for i, t in enumerate(tensors) if t.device.type != "cuda"]
        event = None
        if cuda:
            segment.pin()
            stream = self._side_stream()
            # Copy only after the kernels that produced the tensors (on the caller's stream).
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for i in cuda:
                    src = tensors[i]
                    segment.tensor(layouts[i]).copy_(src.detach(), non_blocking=True)
                    # Keep the caching allocator from reusing src's memory before the copy ran.
                    src.record_stream(stream)
                event = torch.cuda.Event()
                event.record(stream)
        future = None
        if cpu:
            srcs = [(tensors[i].detach(), segment.tensor(layouts[i])) for i in cpu]
            future = self._pool.submit(_copy_all, srcs)
        return StagingHandle(future, event, started)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True)


def _copy_all(pairs) -> None:
    for src, dst in pairs:
        if src.numel():
            dst.copy_(src)


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

    def prefetch(self, nbytes: int) -> None:
        """Start reserving a segment of ``nbytes`` in the background (no-op if one is ready)."""
        with self._lock:
            if self._pending is not None and not self._pending.done():
                return
            if self._ready is not None and self._ready.nbytes == nbytes:
                return
            self._pending = self._pool.submit(self._reserve, nbytes)

    def _reserve(self, nbytes: int) -> None:
        seg = self.store.reserve(nbytes)
        if self.pin:
            seg.pin()
        with self._lock:
            old, self._ready = self._ready, seg
        if old is not None:
            self.store.release(old)

    def take(self, nbytes: int) -> Segment:
        """A reserved segment of exactly ``nbytes`` (reserved now if none is ready)."""
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
        seg = self.store.reserve(nbytes)
        if self.pin:
            seg.pin()
        return seg

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            seg, self._ready = self._ready, None
        if seg is not None:
            self.store.release(seg)
