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

import logging
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


def register(buffer: torch.Tensor, where: str = "") -> bool:
    """Page-lock ``buffer``'s memory (a CPU tensor over a mapping) for CUDA. Returns whether it
    is locked. Where the driver refuses (a file on a disk file system, not tmpfs: "invalid
    argument"), the memory stays pageable — copies into it are then synchronous, still
    correct — one warning per ``where`` says so, and the CUDA error is cleared so the trainer's
    next CUDA call does not inherit it."""
    global _held
    nbytes = buffer.numel() * buffer.element_size()
    if not nbytes or not torch.cuda.is_available():
        return False
    cudart = torch.cuda.cudart()
    rc = cudart.cudaHostRegister(buffer.data_ptr(), nbytes, 0)
    if int(rc) != 0:
        cudart.cudaGetLastError()  # clears the sticky error of the failed registration
        if where not in _warned:
            _warned.add(where)
            logger.warning(
                "cudaHostRegister of store segments under %s failed (%s): GPU tensors are staged "
                "through pageable memory (synchronous copies, slower). Fix: put the store root on "
                "a tmpfs such as /dev/shm (store_root=...)",
                where,
                rc,
            )
        return False
    with _lock:
        _held += nbytes
    _by_thread.bytes = locked_by_this_thread() + nbytes
    return True


def unregister(buffer: torch.Tensor) -> None:
    """Undo :func:`register` (the memory stays mapped)."""
    global _held
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    with _lock:
        _held -= buffer.numel() * buffer.element_size()
