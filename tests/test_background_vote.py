"""A checkpoint every step whose vote runs off the training thread
(``CheckpointHook(when_busy="skip_in_background")``, ``save_local(vote_in_background=True)``).

The training thread makes no collective for such a save and waits for no other rank: a rank
that is idle and whose state has its cache's structure starts its copies and returns; the
ranks' vote (busy? same structure? failed?) runs in the background, and a save some rank could
not take is dropped on every rank before anything reaches a peer. Specified here, over 3 real
gloo ranks: the calling thread's collectives per save (none), every rank keeping and dropping
the same saves while one holds a save in flight, a structure change and a failing state
function agreed by every rank, and the restored state bit-exact to what was saved.
"""

from __future__ import annotations

import threading

import pytest
import torch

from harness import run_ranks
from resilient_ckpt import CheckpointHook, CheckpointManager, ShardedTensor
from resilient_ckpt.errors import ValidationError
from test_skip_when_busy import _state, _train_step  # the same small model and step

pytestmark = [pytest.mark.multiprocess]


class _Hold:
    """Holds this process's save thread at ``point`` until ``release`` is set."""

    def __init__(self, point: str) -> None:
        self.point = point
        self.release = threading.Event()
        self.held = threading.Event()

    def __call__(self, point: str) -> None:
        if point == self.point and not self.release.is_set():
            self.held.set()
            assert self.release.wait(timeout=60), "the test never released the held save"


class _CountCollectives:
    """The collectives this thread makes (torch.distributed's, on any group): ``calls`` those it
    waits for, ``started`` those it starts without waiting (``async_op=True``)."""

    NAMES = ("all_reduce", "all_gather", "all_gather_into_tensor", "broadcast", "barrier", "all_to_all")

    def __init__(self, monkeypatch) -> None:
        import torch.distributed as dist

        self.calls, self.started = [], []
        me = threading.get_ident()
        for name in self.NAMES:
            real = getattr(dist, name)

            def counted(*a, _real=real, _name=name, **k):
                if threading.get_ident() == me:
                    (self.started if k.get("async_op") else self.calls).append(_name)
                return _real(*a, **k)

            monkeypatch.setattr(dist, name, counted)


def _slow_drop(point: str) -> None:
    """A dropped save's job takes its time (a loaded machine): the next step must not find its
    rank busy with it, or every rank would drop every save from then on. (Widens the window of
    that race; the outcome asserted holds whatever the timing.)"""
    if point == "before_drop":
        import time

        time.sleep(0.05)


def _rank_saves_every_step(ctx, steps: int, held_from: int, held_until: int):
    """Each rank trains with a save due at every step, each save finished before the next step;
    except that rank 1 holds the save of step ``held_from`` after its last collective (only rank
    1 stays busy) until step ``held_until``.
    Returns what each rank's hook did and what the calling thread's collectives were."""
    import torch.distributed as dist
    from _pytest.monkeypatch import MonkeyPatch

    hold = _Hold("after_confirmation")
    state = _state(seed=ctx.rank)
    holding = ctx.rank == 1
    with CheckpointManager(
        "bg",
        store_root=ctx.store_root,
        replication_factor=2,
        keep_last=1,
        fault_hook=lambda p: hold(p) if holding and armed.is_set() else _slow_drop(p),
    ) as m:
        armed = threading.Event()
        hook = CheckpointHook(m, every_n_steps=1, state=state, when_busy="skip_in_background")
        returned, collectives_per_step = [], []
        mp = MonkeyPatch()
        try:
            for step in range(steps):
                _train_step(state)
                if step == held_from:
                    armed.set()
                counter = _CountCollectives(mp) if step >= 2 else None
                h = hook.step(step)
                if counter is not None:
                    mp.undo()
                    collectives_per_step.append((list(counter.calls), list(counter.started)))
                returned.append(h is not None)
                if holding and step == held_from:
                    assert hold.held.wait(timeout=60), "the held save never reached its hold"
                    armed.clear()
                if holding and step == held_until:
                    hold.release.set()
                if not (holding and held_from <= step < held_until):
                    # every other save ends before the next step: which ones are kept is then
                    # decided by the hold alone, not by how fast this machine copies
                    hook.finish()
        finally:
            mp.undo()
        hook.finish()
        metrics = hook.metrics.as_dict()
        latest = m.find_latest()
        hook.close()
    t = torch.ones(1)
    dist.all_reduce(t)  # the job's own group still works
    return dict(
        saved_steps=list(hook.saved_steps),
        skipped=hook.skipped_saves,
        manager_skipped=m.saves_skipped,
        failed=hook.failed_saves,
        metrics=metrics,
        latest=latest,
        returned=returned,
        collectives=collectives_per_step,
        group_sum=float(t.item()),
    )


def test_a_save_every_step_makes_no_collective_on_the_training_thread_and_ranks_keep_the_same_saves(tmp_root):
    steps, held_from, held_until = 14, 4, 8
    results = run_ranks(
        _rank_saves_every_step, 3, tmp_root, ranks_per_node=1, args=(steps, held_from, held_until)
    )
    first = results[0]
    for r in results:
        # every rank kept and dropped the same saves, and counted them alike
        assert r["saved_steps"] == first["saved_steps"], results
        assert r["skipped"] == first["skipped"] == r["manager_skipped"], results
        assert r["failed"] == 0 and r["group_sum"] == 3.0
        # no collective that the calling thread waits for, after the first saves: one vote
        # started per due step, answered in the background
        assert all(c == ([], ["all_reduce"]) for c in r["collectives"]), r["collectives"]
    saved = first["saved_steps"]
    # rank 1 held the save of step 4 in flight (only there) until step 8: 5..8 skipped alike
    assert held_from in saved and not any(held_from < s <= held_until for s in saved), saved
    assert saved[-1] == steps - 1 and first["skipped"] == steps - len(saved)
    # rank 1 returned None where it was busy; the others returned handles the vote then dropped
    assert results[1]["returned"][held_from + 1 : held_until + 1] == [False] * (held_until - held_from)
    assert results[0]["returned"][held_from + 1] is True
    assert first["latest"] == steps - 1
    m = first["metrics"]
    assert m["saves_started"] == len(saved) and m["saves_skipped"] == first["skipped"]
    assert m["last_complete_step"] == steps - 1 and m["steps_at_risk"] == 0


def _rank_structure_change_and_failure(ctx):
    """Saves with the background vote: a steady structure, then a tensor added on rank 2
    only, then a state function that raises on rank 0; then steady again. Returns, per call,
    what this rank saw, and the restored state."""
    import torch.distributed as dist

    calls = []
    with CheckpointManager("bgs", store_root=ctx.store_root, replication_factor=2, keep_last=1) as m:

        def state(it: int, extra: bool = False):
            sd = {
                "w": ShardedTensor.from_rank_offsets(
                    "w", torch.full((4, 4), float(it + ctx.rank)), (0, ctx.rank, 3)
                ),
                "step": it,
            }
            if extra:
                sd["b"] = ShardedTensor.from_rank_offsets("b", torch.arange(3.0) + it)  # rank 2 only
            return sd

        def save(it: int, extra: bool = False, fail: bool = False):
            def build():
                if fail:
                    raise RuntimeError(f"state function failed on purpose at {it}")
                return state(it, extra)

            try:
                h = m.save_local(build, it, skip_if_busy=True, vote_in_background=True)
            except Exception as e:
                calls.append(("raised", type(e).__name__))
                return
            if h is None:
                calls.append(("none",))
                return
            try:
                h.wait()
                calls.append(("skipped",) if h.skipped() else ("complete", h.metrics.structure_cached))
            except Exception as e:
                calls.append(("failed", type(e).__name__))

        save(1)  # first save: the calling thread's vote, the general path
        save(2)  # cached, voted in the background
        save(3, extra=ctx.rank == 2)  # rank 2 changed: dropped on every rank
        save(3, extra=ctx.rank == 2)  # the general path on every rank (the answer said so);
        # a dropped save holds nothing, so its iteration is saved again
        save(5, extra=ctx.rank == 2)  # cached again
        save(6, extra=ctx.rank == 2, fail=ctx.rank == 0)  # rank 0 fails: dropped on every rank
        save(6, extra=ctx.rank == 2)  # groups renewed, the general path again, the same iteration
        save(8, extra=ctx.rank == 2)
        latest = m.find_latest()
        state_dict, it = m.load_local()
        restored = (it, state_dict["step"], state_dict["w"].data.tolist(), "b" in state_dict)
        group_sum = torch.ones(1)
        dist.all_reduce(group_sum)
        return dict(calls=calls, latest=latest, restored=restored, group=float(group_sum.item()))


def test_a_structure_change_or_a_failure_on_one_rank_drops_that_save_on_every_rank(tmp_root):
    results = run_ranks(_rank_structure_change_and_failure, 3, tmp_root, ranks_per_node=1)
    for rank, r in enumerate(results):
        calls = r["calls"]
        assert calls[0] == ("complete", False) and calls[1] == ("complete", True), (rank, calls)
        # save 3: rank 2's structure changed: it returns None, the others' saves are dropped
        assert calls[2] == (("none",) if rank == 2 else ("skipped",)), (rank, calls)
        assert calls[3] == ("complete", False) and calls[4] == ("complete", True), (rank, calls)
        # save 6: rank 0's state function raised there; the others' saves fail naming it
        assert calls[5] == (
            ("raised", "RuntimeError") if rank == 0 else ("failed", "CheckpointingException")
        ), (
            rank,
            calls,
        )
        assert calls[6] == ("complete", False) and calls[7] == ("complete", True), (rank, calls)
        assert r["latest"] == 8 and r["group"] == 3.0
        it, step, w, has_b = r["restored"]
        assert it == 8 and step == 8 and w == torch.full((4, 4), float(8 + rank)).tolist()
        assert has_b == (rank == 2)


def test_vote_in_background_needs_skip_if_busy(tmp_root):
    with CheckpointManager("bgv", store_root=str(tmp_root), replication_factor=1) as m:
        with pytest.raises(ValidationError, match="needs skip_if_busy=True"):
            m.save_local({"x": 1}, 1, vote_in_background=True)


TIMEOUT_S = 2.0


def _rank_freezes_while_saves_vote_in_background(ctx):
    """Saves every step voting in the background; rank 2 freezes itself (SIGSTOP: its sockets
    stay open) after step 3. The survivors' next step starts its vote and returns; the step
    after learns the answer never came (the group's timeout) and every survivor fails the same
    saves. Returns per step: the seconds hook.step took; the failed steps; or the frozen rank's
    never-reached marker."""
    import os
    import signal
    import time
    from pathlib import Path

    state = _state(seed=ctx.rank)
    m = CheckpointManager("bgf", store_root=ctx.store_root, replication_factor=2, timeout_s=TIMEOUT_S)
    hook = CheckpointHook(m, every_n_steps=1, state=state, when_busy="skip_in_background")
    pid_file = Path(ctx.tmp_root) / "frozen.pid"
    seconds = {}
    for step in range(6):
        _train_step(state)
        if ctx.rank == 2 and step == 4:
            pid_file.write_text(str(os.getpid()))
            os.kill(os.getpid(), signal.SIGSTOP)
            return "thawed"  # never reached: rank 0 SIGKILLs it
        t = time.monotonic()
        hook.step(step)
        seconds[step] = time.monotonic() - t
        if step < 4:
            hook.finish()  # the saves before the freeze complete
    t = time.monotonic()
    hook.finish()
    seconds["finish"] = time.monotonic() - t
    failed = sorted(hook.failed_steps)
    (Path(ctx.tmp_root) / f"done.{ctx.rank}").write_text("")
    if ctx.rank == 0:
        while not all((Path(ctx.tmp_root) / f"done.{r}").exists() for r in range(2)):
            time.sleep(0.01)
        os.kill(int(pid_file.read_text()), signal.SIGKILL)
    return seconds, failed


def test_a_frozen_rank_fails_the_same_saves_on_every_survivor_within_the_timeout(tmp_root):
    from harness import KILLED

    out = run_ranks(
        _rank_freezes_while_saves_vote_in_background,
        3,
        tmp_root,
        ranks_per_node=1,
        expect_killed=[2],
        timeout=120,
        collective_timeout=600,
    )
    assert out[2] is KILLED
    (s0, failed0), (s1, failed1) = out[0], out[1]
    assert failed0 == failed1 == [4, 5], (failed0, failed1)
    for seconds in (s0, s1):
        assert seconds[4] < TIMEOUT_S / 2, seconds  # the vote is started, not waited for
        assert seconds[5] < 3 * TIMEOUT_S and seconds["finish"] < 3 * TIMEOUT_S, seconds


def _plain_state(rank: int, it: int, extra: bool = False):
    sd = {
        "w": ShardedTensor.from_rank_offsets("w", torch.full((64, 64), float(it + rank)), (0, rank, 3)),
        "step": it,
    }
    if extra:
        sd["b"] = ShardedTensor.from_rank_offsets("b", torch.arange(3.0) + it)
    return sd


def _rank_copies_start_after_the_vote(ctx):
    """Background-voted saves: the order of the calling thread's vote and copies; a dropped
    save's segment; copies that cannot start on rank 1 once the vote went out."""
    import torch.distributed as dist

    from resilient_ckpt.parallel import collectives

    out = {}
    with CheckpointManager("bgc", store_root=ctx.store_root, replication_factor=2, keep_last=1) as m:

        def save(it: int, **kw):
            h = m.save_local(
                lambda: _plain_state(ctx.rank, it, **kw), it, skip_if_busy=True, vote_in_background=True
            )
            return h

        save(1).wait()  # the general path, its vote on the calling thread
        save(2).wait()  # cached: from now on the vote runs in the background

        # 1. The copies start after the vote went out, on the calling thread's side.
        order, me = [], threading.get_ident()
        stage, start_votes = m._stager.stage, collectives.start_votes

        def staged(*a, **k):
            order.append("copies") if threading.get_ident() == me else None
            return stage(*a, **k)

        def voted(*a, **k):
            order.append("vote")
            return start_votes(*a, **k)

        m._stager.stage = staged
        collectives.start_votes = voted
        try:
            save(3).wait()
        finally:
            collectives.start_votes = start_votes
            m._stager.stage = stage
        out["order"] = order

        # 2. A save dropped by the vote (rank 2's structure changed) keeps its segment, still
        # mapped, as the next save's spare: that save reserves nothing on the calling thread.
        h = save(4, extra=ctx.rank == 2)
        if h is not None:
            h.wait()
        out["dropped"] = h is None or h.skipped()
        reserved, reserve = [], m.store.reserve

        def counted(*a, **k):
            reserved.append(threading.get_ident() == me)
            return reserve(*a, **k)

        m.store.reserve = counted
        save(4, extra=ctx.rank == 2).wait()  # the general path on every rank
        out["reserved_on_caller"] = sum(reserved)
        m.store.reserve = reserve
        save(5, extra=ctx.rank == 2).wait()  # cached again

        # 3. Rank 1's copies cannot start once its vote went out: the save fails on every rank
        # in its agreement; the previous one stays the newest; the next one completes.
        def refused(*a, **k):
            raise RuntimeError("the staging thread is gone (on purpose)")

        m._stager.stage = refused if ctx.rank == 1 else stage
        h = save(6, extra=ctx.rank == 2)
        try:
            h.wait()
            out["refused"] = "complete"
        except Exception as e:
            out["refused"] = type(e).__name__
        m._stager.stage = stage
        out["latest_after_refusal"] = m.find_latest()
        h = save(7, extra=ctx.rank == 2)
        if h is None:  # the failure sent this save down the calling thread's vote: None is not it
            h = save(8, extra=ctx.rank == 2)
        h.wait()
        out["latest"] = m.find_latest()
        state_dict, it = m.load_local()
        out["restored"] = (it, state_dict["step"], state_dict["w"].data.tolist())
    t = torch.ones(1)
    dist.all_reduce(t)
    out["group"] = float(t.item())
    return out


def test_copies_start_after_the_vote_and_a_dropped_save_leaves_its_segment_as_the_spare(tmp_root):
    """The staging thread's first work takes the GIL at the calling thread's next release of
    it: the background vote goes out first. A dropped save's segment is not handed to the pool
    (the next save would map and populate it again on the calling thread) but kept as the
    spare. And copies that fail to start after the vote fail that save on every rank."""
    results = run_ranks(_rank_copies_start_after_the_vote, 3, tmp_root, ranks_per_node=1)
    for rank, r in enumerate(results):
        assert r["order"] == ["vote", "copies"], (rank, r["order"])
        assert r["dropped"], rank
        if rank != 2:  # (rank 2's state grew: its next segment is a new size)
            assert r["reserved_on_caller"] == 0, (rank, r)
        assert r["refused"] == "CheckpointingException", (rank, r)
        assert r["latest_after_refusal"] == 5, (rank, r)
        it, step, w = r["restored"]
        assert it == r["latest"] and step == it and w == torch.full((64, 64), float(it + rank)).tolist()
        assert r["group"] == 3.0
