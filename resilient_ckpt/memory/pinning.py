"""Page-locked host memory for CUDA copies, and an account of it.

Device-to-host and host-to-device copies run asynchronously, at the link's rate, only between
the GPU and page-locked memory. Page-locking is slow (``cudaHostRegister`` of 1 GiB of a
tmpfs file: a few hundred ms, most of it faulting the pages in), so it must never sit on a
save's or restore's critical path: segments are locked ahead, on background threads, and kept
locked across saves (``memory.staging.SegmentPrefetcher``). This module does the locking and
keeps the ledger the metrics report: bytes locked now (process-wide) and bytes locked by the
calling thread (a save's calling thread locking anything is a regression the metrics show).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
from typing import Set

import torch

logger = logging.getLogger(__name__)

_lock = threading.Lock()
_held = 0
_by_thread = threading.local()
_warned: Set[str] = set()


def held_bytes() -> int:
    """Bytes of host memory this process has page-locked through :func:`register` now."""
    return _held


def locked_by_this_thread() -> int:
    """Bytes :func:`register` has page-locked on the calling thread so far (a running count)."""
    return getattr(_by_thread, "bytes", 0)


class CudaRuntime:
    """The three CUDA runtime calls page-locking needs, through promised interfaces only: the
    CUDA runtime's official Python bindings (cuda-python: ``cuda.bindings.runtime``, or the
    older ``cuda.cudart``) where installed, else ``torch.cuda.cudart()`` — torch's documented
    accessor, whose module has ``cudaHostRegister``/``cudaHostUnregister`` but (torch 2.11)
    no ``cudaGetLastError``: a refused registration's error cannot be cleared through it, which
    is why :func:`register` does not try where refusal is known ahead (a store not on tmpfs)."""

    def __init__(self) -> None:
        self._bindings = _official_bindings()
        self._torch = None if self._bindings is not None else torch.cuda.cudart()
        self.source = "cuda-python" if self._bindings is not None else "torch.cuda.cudart()"

    def host_register(self, ptr: int, nbytes: int) -> int:
        """0, or the CUDA error code of the refusal."""
        if self._bindings is not None:
            (err,) = self._bindings.cudaHostRegister(ptr, nbytes, 0)
            return int(err)
        return int(self._torch.cudaHostRegister(ptr, nbytes, 0))

    def host_unregister(self, ptr: int) -> None:
        if self._bindings is not None:
            self._bindings.cudaHostUnregister(ptr)
        else:
            self._torch.cudaHostUnregister(ptr)

    def clear_error(self) -> bool:
        """Reset this thread's last CUDA error (so a later launch check does not report a
        refusal as its own); False where no promised interface offers it."""
        fn = getattr(self._bindings if self._bindings is not None else self._torch, "cudaGetLastError", None)
        if fn is None:
            return False
        fn()
        return True


def _official_bindings():
    try:
        from cuda.bindings import runtime  # cuda-python >= 12.6
    except ImportError:
        try:
            from cuda import cudart as runtime  # older cuda-python
        except ImportError:
            return None
    return runtime


_runtime_made = None


def runtime() -> "CudaRuntime | None":
    """The process's :class:`CudaRuntime`, or None without CUDA (tests replace it)."""
    global _runtime_made
    if _runtime_made is None and torch.cuda.is_available():
        _runtime_made = CudaRuntime()
    return _runtime_made


#: file systems whose pages cudaHostRegister accepts (memory-backed); elsewhere it refuses
_LOCKABLE_FS = ("tmpfs", "ramfs", "hugetlbfs")


def filesystem_type(path: str) -> str:
    """The type of the file system ``path`` lives on (from /proc/mounts; "" if unknown)."""
    return _mount_of(path)[1]


@functools.lru_cache(maxsize=64)
def _mount_of(path: str):
    """(mount point, file system type) of ``path``; ("", "") if unknown. Cached: every
    segment a store locks asks for the same store directory, and /proc/mounts need not be
    parsed once per segment."""
    best, kind = "", ""
    try:
        real = os.path.realpath(path)
        with open("/proc/mounts") as f:
            for line in f:
                parts = line.split()
                if len(parts) >= 3:
                    mnt = parts[1].replace("\\040", " ")
                    if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                        best, kind = mnt, parts[2]
    except OSError:
        return "", ""
    return best, kind


def register(buffer: torch.Tensor, where: str = "") -> bool:
    """Page-lock ``buffer``'s memory (a CPU tensor over a mapping of a file under ``where``)
    for CUDA. Returns whether it is locked. Where it cannot be — the store is not on a
    memory-backed file system (cudaHostRegister refuses such pages: not tried), or the driver
    refuses — the memory stays pageable, copies into it are synchronous and still exact, and
    one WARNING per ``where`` names the store and the reason."""
    global _held
    nbytes = buffer.numel() * buffer.element_size()
    rt = runtime()
    if not nbytes or rt is None:
        return False
    mount, fs = _mount_of(where) if where else ("", "")
    if fs and fs not in _LOCKABLE_FS:
        _warn_unlocked(where, mount, f"its file system is {fs}, whose pages CUDA does not page-lock")
        return False
    rc = rt.host_register(buffer.data_ptr(), nbytes)
    if rc != 0:
        cleared = rt.clear_error()
        why = f"cudaHostRegister refused it (CUDA error {rc})"
        if not cleared:
            why += f"; {rt.source} offers no cudaGetLastError to clear it: install cuda-python"
        _warn_unlocked(where, mount, why)
        return False
    with _lock:
        _held += nbytes
    _by_thread.bytes = locked_by_this_thread() + nbytes
    return True


def _warn_unlocked(where: str, mount: str, why: str) -> None:
    """One WARNING per file system (a store's own and free segments live in different
    directories of it)."""
    if (mount or where) not in _warned:
        _warned.add(mount or where)
        logger.warning(
            "store segments under %s are not page-locked: %s. GPU tensors are staged through "
            "pageable memory (synchronous copies, slower, still exact). Fix: put the store root "
            "on a tmpfs such as /dev/shm (store_root=...)",
            where or "(unknown path)",
            why,
        )


def unregister(buffer: torch.Tensor) -> None:
    """Undo :func:`register` (the memory stays mapped)."""
    global _held
    rt = runtime()
    if rt is not None:
        rt.host_unregister(buffer.data_ptr())
    with _lock:
        _held -= buffer.numel() * buffer.element_size()
