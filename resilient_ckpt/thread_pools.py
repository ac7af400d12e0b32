"""Process-wide thread pools that a forked child remakes instead of inheriting; background
threads that yield the cores to training.

A forked child has none of its parent's threads, but it inherits a ``ThreadPoolExecutor``'s
queue and bookkeeping: work submitted there waits forever for workers that do not exist
(nvidia-resiliency-ext's async writer forks the trainer at every save, and a child that codes
parity or reads a checkpoint would hang). A :class:`LazyThreadPool` is made on first use and
forgotten in the child right after a fork (``os.register_at_fork``), so the child's first use
makes its own.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Dict, Iterable, Iterator, Optional

logger = logging.getLogger(__name__)

#: gloo's own threads (a group's TCP event loop and its collective workers), by their names
GLOO_THREADS = ("gloo_tcp_loop", "pt_gloo_runloop")


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


# ---- background priority ---------------------------------------------------------------------
#
# A save's background work (moving replicas, checksums, the next segment's pages) needs CPU
# while the training thread runs; on busy cores the scheduler shares them evenly, so the
# training thread is descheduled in the middle of its step and of the save call itself (on 2
# vCPUs: +51 % per step at a save every step). A thread ``nice`` levels lower gets the cores
# only where training leaves them idle (Linux: ``setpriority`` of a thread id acts on that
# thread alone). Not lowered: threads the training thread waits for — the copies out of the
# training state (the next optimizer step waits for them) and the save thread that
# orchestrates (a lowered waitee would invert the priorities).


def level_below(steps: int) -> int:
    """The nice level ``steps`` below the calling thread's (at most 19; Linux)."""
    if steps <= 0 or not sys.platform.startswith("linux"):
        return _own_level()
    return min(19, _own_level() + steps)


def _own_level() -> int:
    try:
        return os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    except (OSError, AttributeError):  # not Linux
        return 0


def lower_to(level: int, tid: Optional[int] = None) -> None:
    """Run thread ``tid`` (default: the calling thread) at nice ``level`` if that is lower
    than its own (a thread made by a lowered one starts at its maker's level: never lowered
    twice). Refused, or not Linux: a debug line, nothing else (raising a priority again
    needs privileges, so nothing here ever tries)."""
    if not sys.platform.startswith("linux"):
        return
    tid = threading.get_native_id() if tid is None else tid
    try:
        if os.getpriority(os.PRIO_PROCESS, tid) < level:
            os.setpriority(os.PRIO_PROCESS, tid, level)
    except OSError as e:
        logger.debug("thread %d keeps its priority: %s", tid, e)


def background_executor(name: str, nice: int) -> ThreadPoolExecutor:
    """One worker thread named ``name``, ``nice`` levels below the thread that makes it."""
    return ThreadPoolExecutor(
        max_workers=1, thread_name_prefix=name, initializer=lower_to, initargs=(level_below(nice),)
    )


def native_threads() -> Dict[int, str]:
    """This process's threads: native id -> name as the kernel knows it (``comm``)."""
    out: Dict[int, str] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:  # not Linux
        return out
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[int(tid)] = f.read().strip()
        except OSError:  # ended meanwhile
            pass
    return out


@contextlib.contextmanager
def new_threads_lowered(nice: int, names: Iterable[str] = GLOO_THREADS) -> Iterator[None]:
    """The native threads a library starts for us inside the block — a new process group's —
    named one of ``names`` or not named yet (a thread names itself once it runs: until then it
    shows the process's name) run ``nice`` levels below the calling thread once the block
    ends. Python threads are never touched; ``nice`` 0 (or not Linux) reads nothing."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        yield
        return
    level = level_below(nice)
    before = native_threads()
    yield
    now = native_threads()
    names = (*names, now.get(os.getpid(), ""))
    known = {t.native_id for t in threading.enumerate()}
    for tid, name in now.items():
        if tid not in before and tid not in known and name in names:
            lower_to(level, tid)
