"""Pausing Python's cyclic garbage collector around bulk (de)serialisation.

Decoding the metadata of a 50,000-tensor checkpoint allocates a few million small objects
(msgpack lists, ExtTypes, dicts) and none of them is garbage; every allocation threshold
crossed meanwhile triggers a collection that walks all live objects, the trainer's included.
Measured in a process holding a 50k-tensor state: one decode 0.94 s with the collector paused,
2.3-4.7 s with it running. The objects made are not cyclic garbage, so pausing frees nothing
later than it would have been; the collector resumes (if it was on) when the block ends.

Two things make a pause cheap, not just later (measured on a 50k-tensor first save: 0.6-1.1 s
of collections, the largest item of its stall):

* **Process-wide.** The collector is one per process: a pause holds while *any* thread is in a
  block (a count), so a staging thread's block no longer runs collected because the caller's
  block ended first (it did: 0.8 s of full collections on the staging thread).
* **Survivors skip the young generations.** Objects made in a block and kept (shard tables,
  layouts, the structure cache) would be walked by the first collections after it — every one
  of them, at once (0.2 s per walk). When the last block ends, everything tracked goes straight
  to the oldest generation (``gc.freeze()`` then ``gc.unfreeze()``: two list splices), which only
  full collections walk, as they would have once those objects aged. Garbage among them is
  freed by reference counting as before; cyclic garbage waits for the next full collection.
  Skipped where something froze objects for good (the daemon does): unfreezing would undo it.
  Finding that out walks every frozen object (``gc.get_freeze_count`` counts a list: 22 ms per
  block with 500k objects frozen, so a daemon that froze its imports spent that on every
  message it decoded), so once a block found objects frozen by someone else, blocks take it as
  still true for :data:`RECHECK_S` before they look again.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from typing import Iterator

_lock = threading.Lock()
_depth = 0  # blocks open on all threads, nested ones counted
_mine = threading.local()  # blocks open on this thread (``n``)
_resume = False  # the collector was on when the first block began
#: how long blocks take objects frozen by someone else as still frozen before looking again
RECHECK_S = 10.0
_frozen_by_others_until = 0.0  # monotonic time until which they do


def _after_fork_in_child() -> None:
    # A fork while other threads were inside blocks (a DataLoader worker forked during a
    # background save): those threads do not exist in the child, so their blocks never end
    # there; only the forking thread's own blocks are still open.
    global _lock, _depth
    _lock = threading.Lock()
    _depth = getattr(_mine, "n", 0)
    if _depth == 0 and _resume:
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Collector off while any thread is in such a block; back to its previous state when the
    last one ends, with what the blocks left alive moved to the oldest generation."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
        _mine.n = getattr(_mine, "n", 0) + 1
    try:
        yield
    finally:
        with _lock:
            _mine.n -= 1
            _depth -= 1
            if _depth == 0:
                _age_survivors()
                if _resume:
                    gc.enable()


def _age_survivors() -> None:
    """Everything tracked to the oldest generation, unless someone froze objects for good."""
    global _frozen_by_others_until
    now = time.monotonic()
    if now < _frozen_by_others_until:
        return
    if gc.get_freeze_count() == 0:  # an empty list: no walk
        gc.freeze()
        gc.unfreeze()
    else:
        _frozen_by_others_until = now + RECHECK_S
