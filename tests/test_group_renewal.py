"""Every rank renews the checkpoint groups together (issue 30): a save that fails on one rank,
for whatever reason, must leave the job's next checkpoint call working on every rank.

Real processes, 2 simulated nodes x 2 gloo ranks. Each case is a failure whose culprit sees a
different exception from the bystanders (its own error vs a ``PeerFailedError`` naming it, or a
save that raised in ``save_local`` on the culprit and in ``wait()`` on the others): the renewal
decision must not depend on which. Specified: every rank the same outcome within a small
multiple of ``timeout_s`` at every call, the next save completes, ``find_latest`` and the
restore agree on every rank, the data is exact, and the job's own group still pairs up.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import node_store_root, run_ranks
from resilient_ckpt import ShardedTensor
from resilient_ckpt.errors import CheckpointingException
from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

pytestmark = pytest.mark.multiprocess

WS, RPN = 4, 2
TIMEOUT_S = 4.0
#: the job's own groups time out far later than the manager's: a hang shows as the run's timeout
RUN = dict(timeout=90, collective_timeout=60)


def _sd(rank: int, step: int, mib: float = 0.0, fill: bool = True, extra=0):
    g = torch.Generator().manual_seed(7919 * rank + step)
    n = max(4096, int(mib * (1 << 20)) // 4)
    u = torch.randn(n, generator=g) if fill else torch.zeros(n)
    return {"u": ShardedTensor.from_rank_offsets("u", u, (0, rank, WS)), "step": step, "extra": extra}


def _call(fn):
    """(outcome, seconds) of one manager call: 'ok' with its value, or the error's class."""
    t = time.monotonic()
    try:
        value = fn()
        return ("ok", value), time.monotonic() - t
    except CheckpointingException as e:
        return ("failed", type(e).__name__), time.monotonic() - t
    except Exception as e:  # the culprit's own error (the codec's, the store's)
        return ("failed", "own " + type(e).__name__), time.monotonic() - t


def _world_sum_works(ctx) -> bool:
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)
    return float(t) == sum(range(1, ctx.world_size + 1))


def _failed_save_then_every_call(ctx, culprit_kind: str, first_mib: float, failing_mib: float, budget):
    kw = {}
    if budget is not None and ctx.node == 1:
        kw["memory_budget"] = budget
    m = CheckpointManager("renew", store_root=ctx.store_root, replication_factor=2, timeout_s=TIMEOUT_S, **kw)
    out = {}
    out["save10"] = _call(lambda: m.save_local(_sd(ctx.rank, 10, first_mib), 10).wait().iteration)
    # The failing save: rank 2's state holds an object the codec refuses, or node 1's store has
    # no room for the larger segment this save needs.
    extra = threading.Lock() if (culprit_kind == "codec" and ctx.rank == 2) else 0
    handle = []
    out["save20"] = _call(
        lambda: handle.append(m.save_local(_sd(ctx.rank, 20, failing_mib, extra=extra), 20))
    )
    if handle:  # the bystanders: their part went well, the save's agreement says no
        out["save20"] = _call(lambda: handle[0].wait().iteration)
    out["culprit"] = not handle
    out["find"] = _call(m.find_latest)
    out["save30"] = _call(lambda: m.save_local(_sd(ctx.rank, 30, first_mib), 30).wait().iteration)
    out["find2"] = _call(m.find_latest)

    def restore():
        state, it = m.load_local(_sd(ctx.rank, 0, first_mib, fill=False))
        return it, torch.equal(state["u"], _sd(ctx.rank, it, first_mib)["u"].data)

    out["load"] = _call(restore)
    out["world"] = _world_sum_works(ctx)
    m.close()
    return out


def _check(out, culprits):
    for r in range(WS):
        o = out[r]
        assert o["save10"][0] == ("ok", 10), (r, o)
        what, seconds = o["save20"]
        assert what[0] == "failed", (r, o)
        assert seconds < 3 * TIMEOUT_S, (r, seconds)
        # every call after the failure works on every rank, within the timeout's small multiple
        assert o["find"][0] == ("ok", 10), (r, o)
        assert o["save30"][0] == ("ok", 30), (r, o)
        assert o["find2"][0] == ("ok", 30), (r, o)
        assert o["load"][0] == ("ok", [30, True]) or o["load"][0] == ("ok", (30, True)), (r, o)
        for step in ("find", "save30", "find2", "load"):
            assert o[step][1] < 2 * TIMEOUT_S, (r, step, o[step])
        assert o["world"], "the job's own all-reduce works"
    # the culprits' save_local raised their own error; the others' wait() raised
    assert [r for r in range(WS) if out[r]["culprit"]] == culprits


def test_a_state_the_codec_refuses_on_one_rank_leaves_the_next_calls_working_on_every_rank(tmp_root):
    out = run_ranks(
        _failed_save_then_every_call, WS, tmp_root, ranks_per_node=RPN, args=("codec", 0, 0, None), **RUN
    )
    _check(out, culprits=[2])


def test_one_nodes_store_over_its_memory_budget_leaves_the_next_calls_working_on_every_rank(tmp_root):
    # 16 KiB per rank fits a 4 MiB budget many times; 8 MiB does not fit at all.
    out = run_ranks(
        _failed_save_then_every_call, WS, tmp_root, ranks_per_node=RPN, args=("store", 0, 8, 4 << 20), **RUN
    )
    _check(out, culprits=[2, 3])


def test_one_nodes_store_filesystem_full_leaves_the_next_calls_working_on_every_rank(tmp_root):
    """Node 1's store on a 6 MiB tmpfs of its own (root mounts it): the 8 MiB save cannot fit."""
    root = Path(node_store_root(tmp_root, 1))
    root.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=6m", "tmpfs", str(root)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here (needs root): {mounted.stderr.decode().strip()}")
    try:
        out = run_ranks(
            _failed_save_then_every_call, WS, tmp_root, ranks_per_node=RPN, args=("store", 0, 8, None), **RUN
        )
    finally:
        subprocess.run(["umount", "-l", str(root)], capture_output=True)
    _check(out, culprits=[2, 3])


# ---- the renewal check rides on the save's vote ----------------------------------------------------


def _calling_thread_collectives(counts: dict):
    """Count the collectives this thread (the training loop's) enters, by name."""
    me = threading.get_ident()
    for name in ("all_reduce", "all_gather", "all_gather_object", "broadcast", "barrier", "all_to_all"):
        orig = getattr(dist, name)

        def counted(*a, _orig=orig, _name=name, **k):
            if threading.get_ident() == me:
                counts[_name] = counts.get(_name, 0) + 1
            return _orig(*a, **k)

        setattr(dist, name, counted)


def _saves_counting_collectives(ctx):
    m = CheckpointManager("vote", store_root=ctx.store_root, replication_factor=2, timeout_s=TIMEOUT_S)
    m.save_local(_sd(ctx.rank, 1), 1, is_async=False)  # the first save plans (collectives)
    counts: dict = {}
    _calling_thread_collectives(counts)
    per_save = []
    for step in (2, 3):
        counts.clear()
        m.save_local(_sd(ctx.rank, step), step).wait()
        per_save.append(dict(counts))

    def fails_on_rank_1():
        if ctx.rank == 1:
            raise RuntimeError("state function failed on purpose")
        return _sd(ctx.rank, 4)

    failed = _call(lambda: m.save_local(fails_on_rank_1, 4).wait())[0]
    control = m._control
    after = _call(lambda: m.save_local(_sd(ctx.rank, 5), 5).wait() and None)[0]
    renewed = m._control is not control
    counts.clear()
    m.save_local(_sd(ctx.rank, 6), 6).wait()
    per_save.append(dict(counts))
    latest = m.find_latest()
    m.close()
    return dict(per_save=per_save, failed=failed[0], after=after[0], renewed=renewed, latest=latest)


def test_a_cached_save_costs_the_training_thread_one_all_reduce_and_still_renews_after_a_failure(tmp_root):
    """The renewal check (the lowest count of failed calls over the ranks) travels in the save's
    structure vote: a cached save enters one all-reduce on the calling thread, not two; after a
    failed save, the next save's vote decides the renewal on every rank and that save
    completes on the new groups."""
    out = run_ranks(_saves_counting_collectives, WS, tmp_root, ranks_per_node=RPN, **RUN)
    for o in out:
        assert all(c == {"all_reduce": 1} for c in o["per_save"]), o
        assert o["failed"] == "failed" and o["after"] == "ok" and o["renewed"], o
        assert o["latest"] == 6, o


def _late_for_a_vote(ctx):
    """Rank 1 reaches save 2's vote only after rank 0's vote timed out (told through the job's
    store, no sleeps): the control group's pairs are closed on both sides from then on."""
    from torch.distributed import distributed_c10d as c10d

    store = c10d._get_default_store()
    m = CheckpointManager("late", store_root=ctx.store_root, replication_factor=2, timeout_s=TIMEOUT_S)
    m.save_local(_sd(ctx.rank, 1), 1, is_async=False)
    if ctx.rank == 1:
        store.wait(["late/rank0-failed"])
    outcomes = [_call(lambda: m.save_local(_sd(ctx.rank, 2), 2).wait())]
    if ctx.rank == 0:
        store.set("late/rank0-failed", "1")
    for step in (3, 4):
        outcomes.append(_call(lambda step=step: m.save_local(_sd(ctx.rank, step), step).wait() and None))
    latest = m.find_latest()
    m.close()
    return dict(outcomes=outcomes, latest=latest, world=_world_sum_works(ctx))


def test_a_rank_late_for_a_saves_vote_fails_that_save_and_the_next_one_renews_and_completes(tmp_root):
    """A vote that timed out takes the control group down (gloo closes the pairs: every later
    operation on it fails at once). The failure is counted at the same call on every rank, so
    the next save renews the groups before anything else — without asking the dead group —
    and completes; before, every save after the late one failed until the job restarted."""
    out = run_ranks(_late_for_a_vote, WS, tmp_root, ranks_per_node=RPN, **RUN)
    for o in out:
        (first, seconds), *rest = o["outcomes"]
        assert first[0] == "failed", o
        assert seconds < 2 * TIMEOUT_S + 2, o
        assert [r[0] for r in rest] == [("ok", None), ("ok", None)], o
        assert o["latest"] == 4 and o["world"], o
