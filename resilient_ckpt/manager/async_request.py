"""The ``AsyncRequest`` that ``save(..., is_async=True)`` returns, and how it tracks our save.

Megatron-LM schedules the request of a local save on an ``AsyncCallsQueue`` (Megatron-core's
or nvidia-resiliency-ext's) and calls ``maybe_finalize_async_calls(blocking=False)`` every
step. The queue runs ``async_fn`` in a checkpoint worker process (forked per call, or one
spawned persistent worker) and runs the finalize functions in the trainer once ``async_fn``
has returned on every rank. Our save already runs in the manager's own thread, so
``async_fn`` only has to *wait for it*, from another process:

* :class:`SaveDoneSignal` — the trainer holds an exclusive ``flock`` on a small file in the
  node's store from before ``save`` returns until the save thread has finished (stored,
  replicated, agreed); :func:`wait_for_save` (the request's ``async_fn``, picklable by name
  for a spawned worker) takes a shared lock on the same file and so returns exactly when the
  save is done. A kernel lock needs no polling, and it is released when the trainer dies.
* The finalize function then only collects the outcome (``SaveHandle.wait()``, instant) and
  raises on failure, as the reference's finalize does.

The request has the six fields of the *older* ``AsyncRequest`` (no ``call_idx``): both queues
convert a request with a different field count into their own class
("backward compatibility for local checkpointing"), which is what lets one request work on
either library's queue — a persistent worker drops any item that is not an instance of its
own library's class.
"""

from __future__ import annotations

import fcntl
import logging
import os
import threading
from pathlib import Path
from typing import Any, Callable, Dict, List, NamedTuple, Optional, Tuple

from .. import fork_safe_locks

logger = logging.getLogger(__name__)


class SaveDoneSignal:
    """A cross-process "this save has finished" flag backed by an ``flock`` (see module doc)."""

    def __init__(self, path: Path):
        self.path = str(path)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX)
        # Closed in forked children: a child keeping a copy of the locked file description
        # would otherwise keep the lock alive after the trainer died.
        fork_safe_locks.hold(fd, self.path)
        self._fd: Optional[int] = fd
        self._fd_lock = threading.Lock()

    def set(self) -> None:
        """The save finished (either way): release every waiter. Idempotent."""
        with self._fd_lock:
            fd, self._fd = self._fd, None
            if fd is None:
                return
            fork_safe_locks.release(fd)
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)


def wait_for_save(path: str) -> None:
    """``async_fn`` of the request: returns when the save behind ``path`` has finished."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # finished before the worker looked
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)
    finally:
        os.close(fd)


class LocalAsyncRequest(NamedTuple):
    """``AsyncRequest`` of a local save (fields of the pre-``call_idx`` request; see module doc).

    ``execute_sync()`` runs it in the calling process, as the reference's does."""

    async_fn: Optional[Callable]
    async_fn_args: Tuple
    finalize_fns: List[Callable]
    async_fn_kwargs: Dict = {}
    preload_fn: Optional[Callable] = None
    is_frozen: bool = False

    def add_finalize_fn(self, fn: Callable) -> None:
        if self.is_frozen:
            raise RuntimeError("Cannot add finalization functions to a frozen AsyncRequest")
        self.finalize_fns.append(fn)

    def freeze(self) -> "LocalAsyncRequest":
        return self._replace(is_frozen=True)

    def execute_sync(self) -> None:
        if self.async_fn is not None:
            self.async_fn(*self.async_fn_args, **self.async_fn_kwargs)
        self.execute_finalize_fns()

    def execute_finalize_fns(self, validate_matching_call_idx: bool = False) -> int:
        # Our finalize is agreed on every rank already (the save thread's all-reduce): no
        # extra collective is needed to keep ranks in step.
        for fn in self.finalize_fns:
            fn()
        return 0


def request_for(signal_path: Path, finalize: Callable[[], Any]) -> LocalAsyncRequest:
    """The request of one save: ``async_fn`` waits on ``signal_path``; ``finalize`` collects."""
    return LocalAsyncRequest(wait_for_save, (str(signal_path),), [finalize])
