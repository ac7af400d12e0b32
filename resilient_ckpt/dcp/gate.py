"""What ``dcp.async_save`` waits for before it returns: this rank's items are in the store.

``MemoryStorageWriter.stage`` copies nothing: DCP's save thread stages the planned items
straight into the node's store (one copy, into memory the manager has already mapped) while
``async_save``'s caller waits in ``synchronize_staging``. The gate opens when ``write_data``
has the copies done — or when the save thread ended before getting there (a bad checkpoint_id,
a planning error: its future carries the error and nothing reads the caller's tensors any
more). Never a sleep for ordering: an event, and the thread's liveness checked between waits.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

from ..errors import CheckpointingException

__all__ = ["StagingGate"]

#: How often a waiting caller checks that the save thread is still alive.
_POLL_S = 0.005


class StagingGate:
    """One ``async_save``'s staging: ``attach`` (save thread), ``release`` (save thread),
    ``wait`` (the caller of ``async_save``)."""

    def __init__(self, start_timeout_s: float):
        self.start_timeout_s = start_timeout_s
        self._released = threading.Event()
        self._attached = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def attach(self) -> None:
        """Called by the save thread at its first call into the writer."""
        if not self._attached.is_set():
            self._thread = threading.current_thread()
            self._attached.set()

    def release(self) -> None:
        """The caller's tensors are no longer read (copied, or the save gave up)."""
        self._released.set()

    def wait(self) -> float:
        """Block until released or the save thread is gone; returns the seconds waited."""
        t0 = time.perf_counter()
        if not self._attached.wait(self.start_timeout_s):
            raise CheckpointingException(
                f"async_save's save thread never called MemoryStorageWriter within "
                f"{self.start_timeout_s:.0f}s; was the writer handed to dcp.async_save with "
                "async_checkpointer_type=THREAD (the default)?"
            )
        while not self._released.wait(_POLL_S):
            if self._thread is not None and not self._thread.is_alive():
                break  # the save ended before staging; its future reports why
        return time.perf_counter() - t0
