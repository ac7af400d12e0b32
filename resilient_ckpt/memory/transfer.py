"""Moving a stored checkpoint's bytes into the tensors that restore them, at the copy limits.

A restore's bytes go from a store file (tmpfs: reads are memcpy from the page cache) straight
into each target tensor, verified on the way — every chunk is hashed (xxh3, streamed per
tensor) right after it was read, while it is still in cache, so there is no second pass:

* a **CPU** target is read into directly (``preadv`` into its own memory);
* a **CUDA** target is read chunk by chunk into a bounded ring of page-locked buffers
  (:class:`PinnedRing`), each chunk copied to the GPU asynchronously on a side stream while
  the next is read; a slot is reused once its copy has run (an event per slot).

Several threads move different tensors at once (preads and hashing release the GIL). Nothing
maps a whole segment: memory is the targets plus one ring. The caller gets, per read, whether
its bytes matched their checksum, and for CUDA targets an event the consumer's stream waits
on (the copies are queued, not waited for on the CPU).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch
import xxhash

from ..thread_pools import LazyThreadPool
from ..timing import READS, PhaseClock, current, phase
from .checksum import byte_view, digest

#: bytes moved per step: big enough for full-rate preads and H2D copies, small enough that a
#: chunk is still in cache when it is hashed
CHUNK_BYTES = 8 << 20
#: threads moving tensors at once (each keeps two ring slots for CUDA targets)
DEFAULT_THREADS = max(1, min(8, (os.cpu_count() or 2)))


@dataclass
class Read:
    """One stored tensor (``nbytes`` at ``offset`` of the file, ``checksum`` or None) into
    ``target`` (contiguous, its dtype and shape; CPU or CUDA). ``index``: for messages."""

    offset: int
    nbytes: int
    checksum: Optional[int]
    target: torch.Tensor
    index: int = -1


@dataclass
class Moved:
    """What :func:`read_into` did: reads whose bytes failed their checksum or came up short
    (their ``index``), bytes moved, and — CUDA targets — the event after their copies."""

    failed: List[int]
    short: List[int]
    nbytes: int
    event: Optional["torch.cuda.Event"] = None

    def fence(self, stream=None) -> None:
        """Later work on ``stream`` (default: the current one) runs after the device copies."""
        if self.event is not None:
            (stream if stream is not None else torch.cuda.current_stream()).wait_event(self.event)


class PinnedRing:
    """Page-locked host buffers for host-to-device copies: ``slots`` of ``chunk`` bytes, each
    reusable once the copy that read it has run. Allocated once per process and kept (pinning
    is slow): restores reuse it."""

    _shared: Optional["PinnedRing"] = None
    _shared_lock = threading.Lock()

    def __init__(self, slots: int, chunk: int = CHUNK_BYTES):
        self.chunk = chunk
        self._free: List[int] = list(range(slots))
        self._events: List[Optional[torch.cuda.Event]] = [None] * slots
        self._buffers = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self._cv = threading.Condition()

    @classmethod
    def shared(cls, slots: int) -> "PinnedRing":
        with cls._shared_lock:
            ring = cls._shared
            if ring is None or len(ring._buffers) < slots:
                ring = cls._shared = PinnedRing(slots)
            return ring

    @property
    def nbytes(self) -> int:
        return self.chunk * len(self._buffers)

    def take(self) -> int:
        """A free slot, once the copy that last read it has run."""
        with self._cv:
            while not self._free:
                self._cv.wait()
            slot = self._free.pop()
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()
        return slot

    def buffer(self, slot: int) -> torch.Tensor:
        return self._buffers[slot]

    def give(self, slot: int, event: Optional["torch.cuda.Event"]) -> None:
        self._events[slot] = event
        with self._cv:
            self._free.append(slot)
            self._cv.notify()


#: the process's reader threads, kept between calls: a restore reads the node's copy and
#: then a replica's shards, and starting threads on busy cores cost ~2 ms each (measured: 10 ms
#: of a 100 ms restore at 256 MiB on 2 vCPUs)
_READERS = LazyThreadPool("resilient_ckpt-read")


def prestart_readers(threads: int = DEFAULT_THREADS) -> None:
    """Start the reader threads now (a manager does at construction, while the process is
    idle): started by the first restore instead, each cost ~3 ms of it on 2 vCPUs busy with the
    other ranks' reads. Returns at once; a process that has them already keeps them."""
    _READERS.get(threads, prestart=True)


def read_into(path: str, reads: Sequence[Read], threads: int = DEFAULT_THREADS) -> Moved:
    """Move every read's bytes from the file at ``path`` into its target, verified on the way
    (see the module docstring). CUDA copies are queued on a side stream of the targets'
    device; ``Moved.event`` follows them."""
    return read_files([(path, reads)], threads)[0]


def read_files(sources: Sequence[Tuple[str, Sequence[Read]]], threads: int = DEFAULT_THREADS) -> List[Moved]:
    """:func:`read_into` for several files at once, one :class:`Moved` per ``(path, reads)``:
    every file's reads share the reader threads (largest first across files), so a restore
    that takes tensors from its own copy and from replicas in the node's store moves them in
    one pass — no thread idles at the end of one file while another waits its turn."""
    return start_reads(sources, threads).wait()


class Pending:
    """Work started on the reader threads: :meth:`wait` returns its result (and raises what a
    job raised). Lets a caller queue several moves and checks, then do its own work meanwhile."""

    def __init__(self, futures: list, finish):
        self._futures = futures
        self._finish = finish
        self._result = None
        self._done = False

    def wait(self):
        if not self._done:
            try:
                with phase(READS):
                    for f in self._futures:
                        f.result()
            finally:
                self._done = True
                self._result = self._finish()
        return self._result


def _run(jobs: list, fn, threads: int) -> list:
    """``fn`` on every job, in order: on up to ``threads`` reader threads that each take the next
    job until none is left (futures), or here when one thread would do. One task per thread,
    not per job: submitting ~100 jobs one by one to threads already busy with the first ones
    held the caller 4-5 ms (2 vCPUs, 256 MiB restore)."""
    if threads <= 1 or len(jobs) <= 1:
        with phase(READS):
            for job in jobs:
                fn(job)
        return []
    queue = iter(jobs)
    lock = threading.Lock()

    def drain() -> None:
        while True:
            with lock:
                job = next(queue, _DONE)
            if job is _DONE:
                return
            fn(job)

    pool = _READERS.get(threads)
    return [pool.submit(drain) for _ in range(min(threads, len(jobs)))]


_DONE = object()


def start_reads(sources: Sequence[Tuple[str, Sequence[Read]]], threads: int = DEFAULT_THREADS) -> Pending:
    """:func:`read_files`, started: ``wait()`` returns its list of :class:`Moved` (the files stay
    open until then)."""
    per_file = [[r for r in reads if r.nbytes] for _, reads in sources]
    cuda = [r for reads in per_file for r in reads if r.target.is_cuda]
    stream = ring = None
    if cuda:
        device = cuda[0].target.device
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))  # targets written after their last use
        ring = PinnedRing.shared(2 * max(1, min(threads, len(cuda))))
    failed: List[List[int]] = [[] for _ in sources]
    short: List[List[int]] = [[] for _ in sources]
    lock = threading.Lock()
    fds: List[int] = []
    busy = _Busy(current())

    def move(job: Tuple[int, List[Read]]) -> None:
        k, unit = job
        fd = fds[k]
        if len(unit) > 1:
            done = (
                _batch_to_device(fd, unit, ring, stream, busy)
                if unit[0].target.is_cuda
                else _batch_to_host(fd, unit, busy)
            )
        else:
            r = unit[0]
            done = [
                (
                    r.index,
                    *(_to_device(fd, r, ring, stream, busy) if r.target.is_cuda else _to_host(fd, r, busy)),
                )
            ]
        bad = [(index, complete) for index, ok, complete in done if not (ok and complete)]
        if bad:
            with lock:
                for index, complete in bad:
                    (failed[k] if complete else short[k]).append(index)

    def finish() -> List[Moved]:
        for fd in fds:
            os.close(fd)
        event = None
        if stream is not None:
            event = torch.cuda.Event()
            event.record(stream)
        return [
            Moved(sorted(f), sorted(sh), sum(r.nbytes for r in reads), event)
            for f, sh, reads in zip(failed, short, per_file)
        ]

    try:
        for path, _ in sources:
            fds.append(os.open(path, os.O_RDONLY))
        # Largest first: one big tensor should not start last and finish alone.
        jobs = [(k, u) for k, reads in enumerate(per_file) for u in _units(reads)]
        jobs.sort(key=lambda job: -sum(r.nbytes for r in job[1]))
        futures = _run(jobs, move, threads)
    except BaseException:
        finish()
        raise
    return Pending(futures, finish)


def start_checks(
    data: torch.Tensor, checks: Sequence[Tuple[int, int, Optional[int]]], threads: int = DEFAULT_THREADS
) -> Pending:
    """Verify bytes in memory on the reader threads — a store segment mapped to serve from:
    mapped without populating it, the hashing threads fault its pages in side by side (2 vCPUs,
    192 MiB: 16 ms, against 25-34 ms to populate the mapping first and hash after). ``checks``
    are ``(offset, nbytes, checksum)`` into the flat uint8 CPU tensor ``data``; ``wait()``
    returns the indexes (into ``checks``) whose bytes fail."""
    view = byte_view(data) if data.numel() else memoryview(b"")
    failed: List[int] = []
    lock = threading.Lock()
    busy = _Busy(current())

    def check(job: Tuple[int, Tuple[int, int, Optional[int]]]) -> None:
        index, (offset, nbytes, expected) = job
        t0 = time.perf_counter()
        bad = expected is not None and digest(view[offset : offset + nbytes]) != expected
        busy.since(CHECKSUM, t0)
        if bad:
            with lock:
                failed.append(index)

    jobs = sorted(enumerate(checks), key=lambda job: -job[1][1])
    return Pending(_run(jobs, check, threads), lambda: sorted(failed))


#: reads under this size are moved in batches (one ``preadv`` per batch, one pool task): a
#: state dict of 50k small tensors spent ~60 us per tensor in per-read overhead alone
SMALL_BYTES = 256 << 10
#: reads per batch (``preadv`` takes at most IOV_MAX = 1024 buffers, gaps included)
BATCH_READS = 480
#: bytes between two stored tensors a batch reads over (the layout's alignment padding)
BATCH_GAP = 4096
_GAP = memoryview(bytearray(BATCH_GAP))  # padding lands here (written, never read)


def _units(reads: Sequence[Read]) -> List[List[Read]]:
    """Each large read alone; small ones batched by file position: neighbours (at most
    BATCH_GAP apart), of one device kind, at most CHUNK_BYTES from the first's start to the
    last's end (a CUDA batch goes through one ring slot)."""
    units: List[List[Read]] = [[r] for r in reads if r.nbytes >= SMALL_BYTES]
    batch: List[Read] = []
    for r in sorted((r for r in reads if r.nbytes < SMALL_BYTES), key=lambda r: r.offset):
        if batch:
            first, last = batch[0], batch[-1]
            end = last.offset + last.nbytes
            if (
                r.offset < end
                or r.offset - end > BATCH_GAP
                or r.offset + r.nbytes - first.offset > CHUNK_BYTES
                or len(batch) >= BATCH_READS
                or r.target.is_cuda != first.target.is_cuda
            ):
                units.append(batch)
                batch = []
        batch.append(r)
    if batch:
        units.append(batch)
    return units


def _batch_to_host(fd: int, batch: Sequence[Read], busy: "_Busy") -> List[Tuple[int, bool, bool]]:
    """(index, checksum ok, complete) per read: the batch's file span read by one ``preadv``
    into the targets (padding between them into a scratch buffer)."""
    views = [_host_buffer(r) for r in batch]
    iov: list = []
    pos = batch[0].offset
    for r, v in zip(batch, views):
        if r.offset > pos:
            iov.append(_GAP[: r.offset - pos])
        iov.append(v)
        pos = r.offset + r.nbytes
    t0 = time.perf_counter()
    if os.preadv(fd, iov, batch[0].offset) != pos - batch[0].offset:
        return [(r.index, *_to_host(fd, r, busy)) for r in batch]  # short: read one by one to say which
    t0 = busy.since(PREAD, t0)
    out = [(r.index, r.checksum is None or digest(v) == r.checksum, True) for r, v in zip(batch, views)]
    busy.since(CHECKSUM, t0)
    return out


def _batch_to_device(
    fd: int, batch: Sequence[Read], ring: PinnedRing, stream, busy: "_Busy"
) -> List[Tuple[int, bool, bool]]:
    """(index, checksum ok, complete) per read: the batch's file span read into one ring slot,
    each read verified there and copied to its CUDA target."""
    start = batch[0].offset
    total = batch[-1].offset + batch[-1].nbytes - start
    t0 = time.perf_counter()
    slot = ring.take()
    t0 = busy.since(SLOT_WAIT, t0)
    buf = ring.buffer(slot)
    event = None
    try:
        view = byte_view(buf)[:total]
        if pread_full(fd, view, start) != total:
            return [(r.index, False, False) for r in batch]
        t0 = busy.since(PREAD, t0)
        out = []
        for r in batch:
            a = r.offset - start
            out.append((r.index, r.checksum is None or digest(view[a : a + r.nbytes]) == r.checksum, True))
        t0 = busy.since(CHECKSUM, t0)
        with torch.cuda.stream(stream):
            for r in batch:
                a = r.offset - start
                _flat_bytes(r.target).copy_(buf[a : a + r.nbytes], non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        busy.since(H2D_QUEUE, t0)
        return out
    finally:
        ring.give(slot, event)


# What the reader threads' time goes to (``timing.PhaseClock.busy``, summed over threads): a
# restore waiting on READS is bound by whichever of these is largest — the kernel's copy out of
# the store, the hash, a ring slot whose H2D copy has not run yet, or queuing H2D copies.
PREAD = "pread"
CHECKSUM = "checksum"
SLOT_WAIT = "ring slot wait (H2D behind)"
H2D_QUEUE = "H2D queued"


class _Busy:
    """Adds a reader thread's seconds to the restore's clock (a no-op without one)."""

    __slots__ = ("clock",)

    def __init__(self, clock: Optional[PhaseClock]):
        self.clock = clock

    def since(self, name: str, t0: float) -> float:
        """Count the time since ``t0`` as ``name``; returns now (the next step's ``t0``)."""
        t = time.perf_counter()
        if self.clock is not None:
            self.clock.add_busy(name, t - t0)
        return t


_c_char = ctypes.c_char


def _host_buffer(r: Read):
    """A writable buffer over ``r``'s CPU target's bytes, for ``preadv`` and the hash. A ctypes
    array at the tensor's address costs a sixth of a flat uint8 view's ``numpy()`` — which was
    three quarters of a reader thread's time at 50k small tensors. Only where the target is
    contiguous and exactly ``r.nbytes`` long; otherwise the view (which refuses the former)."""
    t = r.target
    if t.nbytes == r.nbytes and t.is_contiguous():
        return (_c_char * r.nbytes).from_address(t.data_ptr())
    return _flat_bytes(t).numpy()


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes, as a flat uint8 view (half the cost of ``byte_view``, which
    also accepts non-contiguous tensors: it counts at 50k tensors)."""
    return t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


def pread_full(fd: int, view, offset: int) -> int:
    """Read ``len(view)`` bytes at ``offset`` into ``view``; the bytes read (fewer: the file
    ended)."""
    done = 0
    while done < len(view):
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


def _to_host(fd: int, r: Read, busy: "_Busy"):
    """(checksum ok, read complete): ``r`` read chunk by chunk into its CPU target."""
    view = byte_view(r.target)
    h = xxhash.xxh3_64()
    for start in range(0, r.nbytes, CHUNK_BYTES):
        part = view[start : start + CHUNK_BYTES]
        t0 = time.perf_counter()
        if pread_full(fd, part, r.offset + start) != len(part):
            return False, False
        t0 = busy.since(PREAD, t0)
        h.update(part)
        busy.since(CHECKSUM, t0)
    return r.checksum is None or h.intdigest() == r.checksum, True


def _to_device(fd: int, r: Read, ring: PinnedRing, stream, busy: "_Busy"):
    """(checksum ok, read complete): ``r`` through ring slots into its CUDA target."""
    dst = _flat_bytes(r.target)
    h = xxhash.xxh3_64()
    for start in range(0, r.nbytes, ring.chunk):
        n = min(ring.chunk, r.nbytes - start)
        t0 = time.perf_counter()
        slot = ring.take()
        t0 = busy.since(SLOT_WAIT, t0)
        buf = ring.buffer(slot)
        event = None
        try:
            view = byte_view(buf)[:n]
            if pread_full(fd, view, r.offset + start) != n:
                return False, False
            t0 = busy.since(PREAD, t0)
            h.update(view)
            t0 = busy.since(CHECKSUM, t0)
            with torch.cuda.stream(stream):
                dst[start : start + n].copy_(buf[:n], non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            busy.since(H2D_QUEUE, t0)
        finally:
            ring.give(slot, event)
    return r.checksum is None or h.intdigest() == r.checksum, True
