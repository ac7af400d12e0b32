"""The collector pause around bulk (de)serialisation (resilient_ckpt.gc_pause): process-wide
while any thread is inside, and what it leaves alive skips the young generations — a 50k-tensor
save spent 0.6-1.1 s in the collections that followed its blocks."""

from __future__ import annotations

import contextlib
import gc
import os
import threading

import pytest

from resilient_ckpt import gc_pause
from resilient_ckpt.gc_pause import paused_gc


@pytest.fixture(autouse=True)
def _collector_on():
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


@contextlib.contextmanager
def _paused_elsewhere():
    """Another thread inside a paused block for the duration."""
    inside, leave = threading.Event(), threading.Event()

    def other():
        with paused_gc():
            inside.set()
            leave.wait(10)

    t = threading.Thread(target=other)
    t.start()
    try:
        assert inside.wait(10)
        yield
    finally:
        leave.set()
        t.join(10)


def _in_child(check) -> bool:
    """``check()`` in a forked child (which leaves without the parent's cleanup)."""
    if not hasattr(os, "fork"):
        pytest.skip("no fork here")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        ok = False
        try:
            ok = bool(check())
        finally:
            os.write(w, b"1" if ok else b"0")
            os._exit(0)
    os.close(w)
    got = os.read(r, 1)
    os.close(r)
    os.waitpid(pid, 0)
    return got == b"1"


def test_the_pause_holds_while_any_thread_is_inside():
    with contextlib.ExitStack() as elsewhere:
        with paused_gc():
            elsewhere.enter_context(_paused_elsewhere())
        # This thread's block ended first: the other's still runs uncollected.
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_restores_a_collector_that_was_off():
    gc.disable()
    with paused_gc():
        with paused_gc():
            pass
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_what_a_pause_keeps_is_not_walked_by_young_collections(monkeypatch):
    class Kept:
        pass

    # (An in-process daemon of an earlier test froze objects for good: the pause then leaves
    # generations alone, see the last test. Thawed here, into the oldest generation, and the
    # pause told to look again.)
    gc.unfreeze()
    monkeypatch.setattr(gc_pause, "_frozen_by_others_until", 0.0)
    with paused_gc():
        kept = [Kept() for _ in range(1000)]
    young = {id(o) for o in gc.get_objects(generation=0)} | {id(o) for o in gc.get_objects(generation=1)}
    assert not any(id(o) in young for o in kept)
    assert gc.get_count()[0] < 100  # the next young collection is not made of them


def test_objects_frozen_by_the_process_stay_frozen(monkeypatch):
    # Membership, not the freeze count: other threads of the process (a test's leftover
    # daemon) free frozen objects meanwhile, which lowers the count.
    monkeypatch.setattr(gc_pause, "_frozen_by_others_until", 0.0)
    frozen = [object()]  # a container: the collector tracks it
    gc.collect()
    gc.freeze()
    try:
        assert not _collected_by_gc(frozen)  # in the permanent generation
        with paused_gc():
            made = [[] for _ in range(10)]
        assert not _collected_by_gc(frozen)  # the daemon's freeze is not undone
        assert all(_collected_by_gc(m) for m in made)  # nor the block's survivors frozen for good
    finally:
        gc.unfreeze()


def test_blocks_do_not_count_what_the_process_froze_each_time(monkeypatch):
    """Counting frozen objects walks them all (22 ms per block with 500k frozen, what a daemon
    freezes after its imports): once found, a block takes them as frozen for RECHECK_S."""
    monkeypatch.setattr(gc_pause, "_frozen_by_others_until", 0.0)
    counted = []
    count = gc.get_freeze_count
    monkeypatch.setattr(gc, "get_freeze_count", lambda: counted.append(1) or count())
    gc.freeze()
    try:
        for _ in range(100):
            with paused_gc():
                pass
        assert len(counted) == 1
        monkeypatch.setattr(gc_pause, "_frozen_by_others_until", 0.0)  # RECHECK_S later
        gc.unfreeze()
        with paused_gc():
            kept = []
        assert len(counted) == 2 and gc.get_freeze_count() == 0  # the survivors aged again
        assert any(o is kept for o in gc.get_objects(generation=2))
    finally:
        gc.unfreeze()


def _collected_by_gc(obj) -> bool:
    """``obj`` is in one of the collector's generations (frozen objects are in none)."""
    return any(o is obj for o in gc.get_objects())


def test_a_child_forked_during_a_pause_collects_again():
    """A fork while another thread is inside a block (a data loader's worker forked during a
    background save): the child has no such thread, so the pause ends there at once."""
    with _paused_elsewhere():
        assert _in_child(gc.isenabled)
        assert not gc.isenabled()  # the parent's pause still holds
    assert gc.isenabled()


def test_a_child_forked_inside_its_own_pause_ends_it_there():
    block = paused_gc()
    block.__enter__()

    def check():
        ok = not gc.isenabled()  # still inside this thread's block
        block.__exit__(None, None, None)  # ... which ends normally
        ok = ok and gc.isenabled()
        with paused_gc():
            ok = ok and not gc.isenabled()
        return ok and gc.isenabled()

    try:
        assert _in_child(check)
    finally:
        block.__exit__(None, None, None)
