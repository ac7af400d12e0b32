"""File locks a forked child does not keep alive.

An ``flock`` belongs to the open file description, which ``fork`` shares with the child. A
child forked while the lock is held (nvidia-resiliency-ext's async writer forks the trainer
at every save) keeps the lock alive after the parent released it by closing its fd — until the
child exits. The parent's next wait on that lock can then wait for the child, which itself may
wait for the parent's save: a deadlock until a timeout (seen in a Megatron-LM call-sequence
test under load). Every fd registered here is closed in forked children, which leaves the
parent's lock to the parent. ``os.register_at_fork`` runs in the child right after the fork,
before any user code.
"""

from __future__ import annotations

import os
import threading
from typing import Dict

_HELD: Dict[int, str] = {}
_HELD_LOCK = threading.Lock()


def hold(fd: int, what: str) -> None:
    """``fd`` carries a lock this process holds: close it in forked children."""
    with _HELD_LOCK:
        _HELD[fd] = what


def release(fd: int) -> None:
    """``fd`` is about to be closed by this process (its lock released)."""
    with _HELD_LOCK:
        _HELD.pop(fd, None)


def _close_inherited() -> None:
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


os.register_at_fork(after_in_child=_close_inherited)
