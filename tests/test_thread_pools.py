"""Shared thread pools: made once, grown on demand, started ahead when asked, and remade in a
forked child — whose inherited pool would have no threads and queue work forever."""

from __future__ import annotations

import multiprocessing as mp
import threading

from resilient_ckpt.thread_pools import LazyThreadPool


def _named(prefix: str) -> int:
    return sum(t.name.startswith(prefix) for t in threading.enumerate())


def test_the_pool_is_shared_and_grows_to_the_largest_size_asked():
    pools = LazyThreadPool("tp-grow")
    a = pools.get(2)
    assert pools.get(1) is a and pools.get(2) is a
    b = pools.get(3)
    assert b is not a and pools.get(2) is b
    assert sorted(b.map(lambda x: x * x, range(6))) == [0, 1, 4, 9, 16, 25]


def test_prestart_starts_every_thread_before_any_work():
    pools = LazyThreadPool("tp-prestart")
    pools.get(3, prestart=True)
    pools.get(3).submit(lambda: None).result(timeout=10)
    assert _named("tp-prestart") == 3


_FORKED = LazyThreadPool("tp-fork")


def _use_in_child(q) -> None:
    q.put(_FORKED.get(2).submit(lambda: "ran").result(timeout=10))


def test_a_forked_child_gets_a_working_pool_of_its_own():
    _FORKED.get(2).submit(lambda: None).result()  # the parent's pool exists when it forks
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_use_in_child, args=(q,))
    child.start()
    child.join(timeout=30)
    if child.is_alive():  # the inherited pool queued the work forever
        child.kill()
        child.join()
    assert child.exitcode == 0 and q.get(timeout=5) == "ran"
