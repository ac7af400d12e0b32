"""A store data file mapped read-write: where staging copies and received replicas land.

A :class:`Segment` is reserved, claimed and released by :class:`.store.CheckpointStore`; this
module only maps it: tensor views, page-locking for CUDA (:mod:`.pinning`), and dropping or
populating its pages in this process's page tables.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
from pathlib import Path
from typing import Any, List, Optional, Tuple

import torch

from . import pinning
from .layout import TensorLayout

_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


def _libc_madvise():
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


#: libc's madvise through ctypes, which releases the GIL around the call: ``mmap.madvise``
#: holds it, and MADV_POPULATE_WRITE of a segment takes tens of milliseconds (more on a loaded
#: machine) — every other thread of the trainer stood still meanwhile (issue 34: a replica's
#: receiver could not post its receives; the retired segment populated as the next spare held
#: the training thread and the save's waiter for 20-30 ms after each save)
_MADVISE = _libc_madvise()


class Segment:
    """A data file mapped read-write: where staging copies land.

    ``buffer`` is a 1-D uint8 tensor over the mapping; ``tensor(layout)`` views one tensor.
    """

    def __init__(self, path: Path, nbytes: int, populate: bool = True):
        self.path = path
        self.nbytes = nbytes
        self._fd = os.open(path, os.O_RDWR)
        self._mmap: Optional[mmap.mmap] = None
        self.buffer: torch.Tensor
        if nbytes:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate and hasattr(mmap, "MAP_POPULATE") else 0)
            self._mmap = mmap.mmap(self._fd, nbytes, flags=flags)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            self.buffer = torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        self._pin_lock = threading.Lock()
        self._views: Optional[Tuple[Any, List[Any]]] = None

    def keep_views(self, runs: Any, views: List[Any]) -> None:
        """Remember staging's destination views for ``runs`` (made ahead by the prefetcher)."""
        self._views = (runs, views)

    def views_for(self, runs: Any) -> Optional[List[Any]]:
        """The views kept for exactly this ``runs`` object, if any."""
        kept = self._views
        return kept[1] if kept is not None and kept[0] is runs else None

    def tensor(self, layout: TensorLayout) -> torch.Tensor:
        return (
            self.buffer[layout.offset : layout.offset + layout.nbytes]
            .view(layout.torch_dtype)
            .view(layout.shape)
        )

    def release_pages(self, offset: int, nbytes: int) -> None:
        """Drop ``[offset, offset + nbytes)`` from this process's page tables (MADV_DONTNEED on
        a shared file mapping: the bytes stay in the store, the process's resident set shrinks;
        touching them again maps them back). No-op while page-locked for CUDA."""
        buf = self.buffer  # keeps the mapping alive while the GIL is released (see close)
        if self._mmap is None or self.pinned or buf.numel() < self.nbytes:
            return
        drop_pages(self._mmap, offset, nbytes, self.nbytes, base=buf.data_ptr())

    def populate_pages(self, offset: int, nbytes: int) -> None:
        """Map ``[offset, offset + nbytes)`` into this process's page tables now
        (MADV_POPULATE_WRITE, Linux >= 5.14; else a no-op): writing into populated pages runs
        ~2x faster than taking a fault per 4 KiB page (measured: gloo receives at 1.9 vs 1.0
        GiB/s). Other threads run meanwhile (the GIL is released)."""
        buf = self.buffer  # keeps the mapping alive while the GIL is released (see close)
        if self._mmap is None or nbytes <= 0 or offset >= self.nbytes or buf.numel() < self.nbytes:
            return
        page = mmap.PAGESIZE
        start = offset // page * page
        end = min(self.nbytes, -(-(offset + nbytes) // page) * page)
        if _MADVISE is not None:
            # An error (an older kernel without MADV_POPULATE_WRITE) leaves the pages to fault
            # in on first write.
            _MADVISE(buf.data_ptr() + start, end - start, _MADV_POPULATE_WRITE)
            return
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, start, end - start)
        except (OSError, ValueError):
            pass  # older kernel: pages fault in on first write instead

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA (D2H copies land here directly, asynchronously);
        returns whether it is pinned (see :func:`pinning.register`: measured on an H200, a file
        on a disk file system, not tmpfs, cannot be). Slow: callers do it off the critical path
        (the prefetcher's thread) and keep the segment mapped across saves."""
        with self._pin_lock:  # the prefetcher's and the save thread's may meet here
            if not self.pinned and self.nbytes and self._mmap is not None:
                self.pinned = pinning.register(self.buffer, str(self.path.parent.parent))
        return self.pinned

    def close(self) -> None:
        with self._pin_lock:
            if self.pinned:
                pinning.unregister(self.buffer)
                self.pinned = False
        # Never munmap explicitly: torch.frombuffer views keep a reference to the mmap object
        # but hold no buffer export, so mmap.close() would succeed under a live view and leave
        # it dangling (a later read segfaults). Dropping our references unmaps the segment as
        # soon as the last view is gone — at once in the normal case.
        self._views = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


def drop_pages(
    mapping: Optional[mmap.mmap], offset: int, nbytes: int, length: int, base: Optional[int] = None
) -> None:
    """Drop ``[offset, offset + nbytes)`` of a shared file ``mapping`` of ``length`` bytes from
    this process's page tables (MADV_DONTNEED: the bytes stay in the store's file, the resident
    set shrinks; touching them again maps them back) — a send from a mapping keeps the sender's
    resident set about one chunk above its own state instead of growing by the whole file.

    ``base``: the mapping's address (a tensor over it: ``data_ptr()``; the caller keeps that
    tensor alive). Then the call goes through libc with the GIL released: ``mmap.madvise``
    holds it for the whole page-table teardown — milliseconds per 16 MiB chunk, during which
    the training thread could not run a line of Python (measured: the largest holder of the
    GIL in a save every step)."""
    if mapping is None or nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
        return
    page = mmap.PAGESIZE
    start = offset // page * page
    end = min(length, -(-(offset + nbytes) // page) * page)
    if end <= start:
        return
    if (
        base is not None
        and _MADVISE is not None
        and _MADVISE(base + start, end - start, mmap.MADV_DONTNEED) == 0
    ):
        return
    mapping.madvise(mmap.MADV_DONTNEED, start, end - start)
