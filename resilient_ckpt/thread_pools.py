"""Process-wide thread pools that a forked child remakes instead of inheriting.

A forked child has none of its parent's threads, but it inherits a ``ThreadPoolExecutor``'s
queue and bookkeeping: work submitted there waits forever for workers that do not exist
(nvidia-resiliency-ext's async writer forks the trainer at every save, and a child that codes
parity or reads a checkpoint would hang). A :class:`LazyThreadPool` is made on first use and
forgotten in the child right after a fork (``os.register_at_fork``), so the child's first use
makes its own.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Optional


class LazyThreadPool:
    """One shared pool of threads named ``name``, made on first use, at least as large as the
    largest size asked for (a larger one replaces it: work already running finishes on the
    old threads), remade in a forked child."""

    def __init__(self, name: str):
        self.name = name
        self._forget()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        # In a child the lock may have been held by a parent thread at the fork: a new one.
        self._pool: Optional[ThreadPoolExecutor] = None
        self._size = 0
        self._lock = threading.Lock()

    def get(self, threads: int, prestart: bool = False) -> ThreadPoolExecutor:
        """The pool, with at least ``threads`` workers. ``prestart``: a pool made now starts
        all its threads at once instead of at its first submits (each start costs ~2-3 ms on
        busy cores, on the path of whatever submits first)."""
        with self._lock:
            if self._pool is None or self._size < threads:
                old, self._size = self._pool, threads
                self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=self.name)
                if old is not None:
                    old.shutdown(wait=False)
                if prestart:
                    # First in the new pool's queue, each task holds its thread until all have
                    # one, so every submit starts a thread (an idle one would take the next).
                    gate = threading.Barrier(threads)
                    for _ in range(threads):
                        self._pool.submit(_wait_at, gate)
            return self._pool


def _wait_at(gate: threading.Barrier) -> None:
    try:
        gate.wait(timeout=10)
    except threading.BrokenBarrierError:  # pragma: no cover - a thread failed to start
        pass
