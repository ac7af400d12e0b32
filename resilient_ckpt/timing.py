"""Where a call's time goes, by phase (layer 0).

A restore's wall time is spent in a few kinds of work — collectives (waiting for the other
ranks included), waiting for reads and checksums, moving bytes between peers, copying into the
caller's tensors (on a GPU: queuing the H2D copies), waiting for the device — and the one that
bounds it is what to work on next. :class:`PhaseClock` is opened around a call on the calling
thread; the code below it marks its blocking steps with :func:`phase`. Time is *self* time: a
phase inside another is taken out of the outer one, so the phases add up to at most the call's
wall time, and the rest is the Python between them (planning, bookkeeping).

Marking costs one thread-local lookup when no clock is open on the thread (saves, the
daemon), so the marks stay in place everywhere.
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Dict, Iterator, List, Optional

__all__ = [
    "PhaseClock",
    "phase",
    "current",
    "COLLECTIVES",
    "READS",
    "PEERS",
    "COPY",
    "DEVICE",
    "DECODE",
    "OTHER",
]

# The phases the restore marks (names as the benchmark prints them).
COLLECTIVES = "collectives"  # all-gathers, all-reduces, all-to-alls: waiting for the others too
READS = "reads+checksums"  # waiting for the reader threads (store -> host or device, verified)
PEERS = "peer transfer"  # copies moved to or from other ranks (retrieval, load exchange)
COPY = "copy to targets"  # into the caller's tensors; on a GPU the H2D copies queued
DEVICE = "device wait"  # waiting for queued device copies to land
DECODE = "decode"  # the checkpoint's metadata decoded into a state dict
#: the name of what no phase covered: :meth:`PhaseClock.breakdown`'s remainder
OTHER = "other"

_open = threading.local()


class PhaseClock:
    """Seconds per phase of the calls made on this thread while it is open (a context manager;
    clocks do not nest: an inner one sees the phases, the outer sees them as its own)."""

    def __init__(self) -> None:
        self.seconds: Dict[str, float] = {}
        self.wall_s = 0.0
        self._t0 = 0.0
        self._stack: List[List] = []  # [name, start, seconds spent in phases inside it]
        self._outer: Optional[PhaseClock] = None
        #: seconds helper threads worked for the call, by kind, summed over threads (what a
        #: phase of the calling thread waited for: e.g. the reader threads' preads and hashes)
        self.busy: Dict[str, float] = {}
        self._busy_lock = threading.Lock()

    def __enter__(self) -> "PhaseClock":
        self._outer = getattr(_open, "clock", None)
        _open.clock = self
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        self.wall_s = time.perf_counter() - self._t0
        _open.clock = self._outer

    def _enter(self, name: str) -> List:
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        return frame

    def _leave(self, frame: List) -> None:
        elapsed = time.perf_counter() - frame[1]
        self._stack.pop()
        self.seconds[frame[0]] = self.seconds.get(frame[0], 0.0) + elapsed - frame[2]
        if self._stack:
            self._stack[-1][2] += elapsed

    def add_busy(self, name: str, seconds: float) -> None:
        """Count ``seconds`` of a helper thread's work for this call (any thread may call)."""
        with self._busy_lock:
            self.busy[name] = self.busy.get(name, 0.0) + seconds

    def breakdown(self) -> Dict[str, float]:
        """Every phase's seconds, and :data:`OTHER`: the wall time no phase covered."""
        out = dict(self.seconds)
        out[OTHER] = max(0.0, self.wall_s - sum(self.seconds.values()))
        return out


def current() -> Optional[PhaseClock]:
    """The clock open on this thread, if any (helper threads are handed it explicitly)."""
    return getattr(_open, "clock", None)


@contextmanager
def phase(name: str) -> Iterator[None]:
    """Count the block's time as ``name`` in the clock open on this thread (if any)."""
    clock = getattr(_open, "clock", None)
    if clock is None:
        yield
        return
    frame = clock._enter(name)
    try:
        yield
    finally:
        clock._leave(frame)
