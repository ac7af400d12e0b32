"""A save's background work yields the cores to training (``background_nice``, issue 41).

On cores the training keeps busy, a save's replication, checksums and agreement took an even
share of them and descheduled the training thread, in the middle of its step and of the save
call itself. Specified here, on real gloo ranks: the checksum thread, the segment prefetcher
and the checkpoint data group's own gloo threads run ``background_nice`` levels below the
training thread; the staging thread (the next optimizer step waits for its copies), the save
thread (the training thread waits for it at times), the control group's gloo threads (the
calling thread waits for their votes), the training thread and the job's own groups keep
theirs; 0 lowers nothing; a bad value is refused with its name and range. And a save's job ends with the next save's segment ready, so a save
due right after never waits for that segment on the calling thread.
"""

from __future__ import annotations

import os
import threading
import time
from typing import Dict

import pytest
import torch

from harness import run_ranks
from resilient_ckpt import CheckpointManager, ShardedTensor
from resilient_ckpt.errors import ValidationError
from resilient_ckpt.thread_pools import GLOO_THREADS, native_threads

LOWERED = ("resilient_ckpt-checksum", "resilient_ckpt-prefetch")
#: the staging thread (the next optimizer step waits for its copies), the save thread (the
#: training thread waits for it at times: a lowered one would invert their priorities)
KEPT = ("resilient_ckpt-stage", "resilient_ckpt-save")


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def _python_threads(prefixes) -> Dict[str, int]:
    """Native id of the live Python threads whose names start with one of ``prefixes``."""
    return {t.name: t.native_id for t in threading.enumerate() if t.name.startswith(tuple(prefixes))}


def _state(rank: int, step: int, world: int = 3):
    return {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((256,), float(step)), replica_id=rank),
        "own": ShardedTensor.from_rank_offsets("own", torch.arange(64.0) + rank, (0, rank, world)),
        "step": step,
    }


def _rank_priorities(ctx, nice: int):
    import torch.distributed as dist

    base = _nice(threading.get_native_id())
    before = native_threads()
    with CheckpointManager(
        "prio", store_root=ctx.store_root, replication_factor=2, background_nice=nice
    ) as m:
        for step in range(2):  # the second save: every pool has started its thread
            m.save_local(_state(ctx.rank, step), step).wait()
        m.wait_for_saves()
        ours = {name: _nice(tid) for name, tid in _python_threads(LOWERED + KEPT).items()}
        gloo = [
            _nice(tid) for tid, name in native_threads().items() if tid not in before and name in GLOO_THREADS
        ]
        job_gloo = [_nice(tid) for tid, name in before.items() if name in GLOO_THREADS]
        latest = m.find_latest()
    t = torch.ones(1)
    dist.all_reduce(t)  # the job's own group still pairs up
    return dict(
        base=base,
        main=_nice(threading.get_native_id()),
        ours=ours,
        gloo=gloo,
        job_gloo=job_gloo,
        latest=latest,
        group_sum=float(t.item()),
    )


@pytest.mark.multiprocess
def test_a_saves_background_threads_run_below_the_training_thread(tmp_root):
    nice = 7  # an explicit value: the option, not a constant, sets it
    results = run_ranks(_rank_priorities, 3, tmp_root, ranks_per_node=1, args=(nice,))
    for r in results:
        low = min(19, r["base"] + nice)
        assert r["latest"] == 1 and r["group_sum"] == 3.0, r
        assert r["main"] == r["base"], r  # the training thread keeps its priority
        for name, value in r["ours"].items():
            want = low if name.startswith(LOWERED) else r["base"]
            assert value == want, (name, value, r)
        assert {n.rsplit("_", 1)[0] for n in r["ours"]} >= {*LOWERED, *KEPT}, r["ours"]
        # The data group's gloo threads lowered; the control group's not; the job's own alone.
        assert r["gloo"].count(low) >= 1 and r["gloo"].count(r["base"]) >= 1, r["gloo"]
        assert set(r["gloo"]) <= {low, r["base"]}, r["gloo"]
        assert r["job_gloo"] and set(r["job_gloo"]) == {r["base"]}, r["job_gloo"]


@pytest.mark.multiprocess
def test_background_nice_zero_lowers_nothing(tmp_root):
    results = run_ranks(_rank_priorities, 3, tmp_root, ranks_per_node=1, args=(0,))
    for r in results:
        assert set(r["ours"].values()) == {r["base"]}, r
        assert set(r["gloo"]) == {r["base"]}, r


@pytest.mark.parametrize("bad", [-1, 20, 2.5, "19", True])
def test_a_bad_background_nice_is_refused_with_its_range(tmp_root, bad):
    with pytest.raises(ValidationError, match=r"background_nice must be an int from 0 .* to 19"):
        CheckpointManager("bad", store_root=str(tmp_root), background_nice=bad)


def test_a_save_due_right_after_another_never_waits_for_its_segment(tmp_root):
    """The next save's segment is made on the (lowered) prefetch thread after a save
    completes; the save's job ends only once it is ready, so nothing in flight means nothing
    to wait for: a save started then reserves nothing on the calling thread."""
    slow_s = 0.6
    with CheckpointManager("spare", store_root=str(tmp_root), replication_factor=1) as m:
        reserve = m.store.reserve

        def slow_reserve(*args, **kwargs):
            if threading.current_thread().name.startswith("resilient_ckpt-prefetch"):
                time.sleep(slow_s)  # a large segment's pages on a busy machine
            return reserve(*args, **kwargs)

        m.store.reserve = slow_reserve
        m.save_local(_state(0, 0, 1), 0, skip_if_busy=True).wait()
        m.wait_for_saves()
        t0 = time.perf_counter()
        handle = m.save_local(_state(0, 1, 1), 1, skip_if_busy=True)
        call_s = time.perf_counter() - t0
        assert handle is not None  # nothing was in flight: not skipped
        handle.wait()
        assert call_s < slow_s / 2, f"the save call waited {call_s:.3f} s for its segment"
        assert m.find_latest() == 1
