"""Embedded mode with real processes: gloo on loopback, 2 simulated nodes x 2 ranks.

Each simulated node has its own store root (``RankContext.store_root``); ``ranks_per_node`` sets
LOCAL_WORLD_SIZE, so the default replication jump is the node size and replicas land on the
other node. Crashes are SIGKILLs at exact code points (``CheckpointManager(fault_hook=...)``),
never sleeps. Process launches are shared: module fixtures run one scenario and several tests
check what it observed.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import resilient_ckpt.model.codec  # noqa: F401  (imported here so rank processes load it up front)
from harness import KILLED, node_store_root, run_ranks
from resilient_ckpt.errors import CheckpointingException, CodecError, ValidationError
from resilient_ckpt.manager.checkpoint_manager import CheckpointManager
from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor
from resilient_ckpt.parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict

pytestmark = pytest.mark.multiprocess

SESSION = "mp"
WS, RPN = 4, 2  # 2 nodes x 2 ranks
RUN = dict(timeout=120, collective_timeout=30)


# ---- state dicts ---------------------------------------------------------------------------------


def _sd(rank: int, ws: int, step: int, fill: bool = True, extra: bool = False):
    """A small trainer state: a data-parallel replicated weight (saved once, by whichever rank
    the distribution picks), a sharded bf16 tensor, a 0-dim per-rank counter, an object."""
    g = torch.Generator().manual_seed(1000 + step)
    w = torch.randn(64, 256, generator=g)
    g = torch.Generator().manual_seed(7919 * rank + step)
    u = torch.randn(32, 128, generator=g).to(torch.bfloat16)
    c = torch.tensor(10 * step + rank, dtype=torch.int64)
    if not fill:
        w, u, c = torch.empty_like(w), torch.empty_like(u), torch.empty_like(c)
    sd = {
        "model": {
            "w": ShardedTensor.from_rank_offsets("w", w, replica_id=rank),
            "u": ShardedTensor.from_rank_offsets("u", u, (0, rank, ws)),
        },
        "counter": ShardedTensor.from_rank_offsets("counter", c, (0, rank, ws), prepend_axis_num=1),
        "rng": ShardedObject("rng", {"rank": rank, "step": step}, (ws,), (rank,)),
        "step": step,
    }
    if extra:
        sd["model"]["new"] = ShardedTensor.from_rank_offsets("new", torch.ones(4), (0, rank, ws))
    return sd


def _bit_exact(state, rank: int, ws: int, step: int) -> bool:
    ref = _sd(rank, ws, step)
    return (
        torch.equal(state["model"]["w"], ref["model"]["w"].data)
        and torch.equal(state["model"]["u"], ref["model"]["u"].data)
        and torch.equal(state["counter"], ref["counter"].data)
        and state["rng"] == {"rank": rank, "step": step}
        and state["step"] == step
    )


def _manager(ctx, **kw) -> CheckpointManager:
    kw.setdefault("replication_factor", 2)
    kw.setdefault("timeout_s", 30)
    kw.setdefault("keep_last", 2)  # retention and fallback specs below keep two iterations
    return CheckpointManager(SESSION, store_root=ctx.store_root, **kw)


def _load(m: CheckpointManager, ctx, expect_step=None):
    res = m.load_local(_sd(ctx.rank, ctx.world_size, 0, fill=False))
    if res is None:
        return {"iteration": None}
    state, it = res
    lm = m.last_load_metrics
    return {
        "iteration": it,
        "exact": _bit_exact(state, ctx.rank, ctx.world_size, it if expect_step is None else expect_step),
        "source": lm.source,
        "failed_copies": [tuple(f) for f in lm.failed_copies],
        "attempts": lm.attempts,
    }


def _node_listing(root: str, keep: Path):
    """(iteration, owner) pairs published in a node store, and inodes of every segment file.

    Each segment file is also hard-linked into ``keep``: its inode stays allocated, so a file
    created later can never reuse the number and pass for a recycled segment.
    """
    d = Path(root) / SESSION
    ids = sorted((int(p.name[5:25]), int(p.name[32:38])) for p in d.iterdir() if p.name.endswith(".hdr"))
    keep.mkdir(exist_ok=True)
    while True:
        # The managers' prefetchers may rename a pooled segment (seg_* -> rsv_*) at any time
        # after a save completed: list again until one listing holds still. Inodes do not
        # change with a rename, so the set is the same whatever names it was seen under.
        files = [p for p in list(d.iterdir()) + list((d / "free").iterdir()) if p.name.endswith(".data")]
        try:
            inodes = {p: p.stat().st_ino for p in files}
            for p, ino in inodes.items():
                if not (keep / str(ino)).exists():
                    os.link(p, keep / str(ino))
        except FileNotFoundError:
            continue
        return ids, sorted(inodes.values())


def _copy_stores(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".lock", "keep*"))
    return dst


# ---- a job that saved five iterations ------------------------------------------------------------

STEPS = [10, 20, 30, 40, 50]


def _save_steps(ctx, steps):
    m = _manager(ctx)
    # Replicas leave as they are staged (on where a host has cores to spare; forced here so
    # the restores below read what that path stored).
    m.send_while_staging = True
    seen = []
    for s in steps:
        h = m.save_local(_sd(ctx.rank, ctx.world_size, s), s)
        h.wait_staged()
        h.wait()
        dist.barrier()  # every rank's save finished: the node store is quiet
        if ctx.local_rank == 0:
            seen.append(_node_listing(ctx.store_root, Path(ctx.tmp_root) / f"keep{ctx.node}"))
        dist.barrier()
    m.close()
    return seen


@pytest.fixture(scope="module")
def saved_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("saved")
    seen = run_ranks(_save_steps, WS, root, ranks_per_node=RPN, args=(STEPS,), **RUN)
    return root, seen


def test_retention_keeps_exactly_the_last_two_iterations_of_every_owner_on_every_node(saved_job):
    _, seen = saved_job
    for node_rank in (0, 2):  # local rank 0 of each node reported
        for i, step in enumerate(STEPS):
            ids, _ = seen[node_rank][i]
            kept = STEPS[max(0, i - 1) : i + 1]
            # Each node holds its own two ranks' data and replicas of the other node's two.
            assert ids == [(it, o) for it in kept for o in range(WS)], (node_rank, step)


def test_steady_state_saves_allocate_no_new_segment_on_any_node(saved_job):
    _, seen = saved_job
    for node_rank in (0, 2):
        inodes = [set(inos) for _, inos in seen[node_rank]]
        warm = set().union(*inodes[:3])
        assert all(later <= warm for later in inodes[3:]), node_rank


# ---- restart, then node loss ---------------------------------------------------------------------


def _restart_then_lose_node1(ctx, done_dir):
    m = _manager(ctx)
    restart = _load(m, ctx)
    m.save_local(_sd(ctx.rank, ctx.world_size, 60), 60, is_async=False)
    m.close()
    dist.barrier()
    (Path(done_dir) / f"restart_{ctx.rank}.json").write_text(json.dumps(restart))
    if ctx.node == 0:
        (Path(done_dir) / f"done_{ctx.rank}").write_text("ok")
        return restart
    # Node 1 dies (SIGKILL) only after node 0 has left every collective.
    deadline = time.monotonic() + 60
    while not all((Path(done_dir) / f"done_{r}").exists() for r in range(RPN)):
        if time.monotonic() > deadline:
            raise TimeoutError("node 0 never finished")
        time.sleep(0.01)
    ctx.kill_self()


def _load_only(ctx, kw=None):
    m = _manager(ctx, **(kw or {}))
    try:
        return _load(m, ctx)
    finally:
        m.close()


@pytest.fixture(scope="module")
def node_loss(saved_job, tmp_path_factory):
    root = _copy_stores(saved_job[0], tmp_path_factory.mktemp("nodeloss") / "job")
    restart = run_ranks(
        _restart_then_lose_node1, WS, root, ranks_per_node=RPN, args=(str(root),), expect_killed=[2, 3], **RUN
    )
    shutil.rmtree(node_store_root(root, 1))  # the node's memory is gone with it
    after = run_ranks(_load_only, WS, root, ranks_per_node=RPN, **RUN)
    restart = [json.loads((root / f"restart_{r}.json").read_text()) for r in range(WS)]
    return restart, after


def test_process_restart_restores_every_rank_from_its_own_node(node_loss):
    restart, _ = node_loss
    for r in range(WS):
        assert restart[r] == {
            "iteration": 50,
            "exact": True,
            "source": "local",
            "failed_copies": [],
            "attempts": 1,
        }


def test_losing_a_node_restores_its_ranks_from_replicas_bit_exactly(node_loss):
    _, after = node_loss
    assert [a["iteration"] for a in after] == [60] * WS
    assert all(a["exact"] for a in after)
    assert [a["source"] for a in after] == ["local", "local", "peer", "peer"]


# ---- corrupt copies ------------------------------------------------------------------------------


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x04]))


def test_corrupt_stored_copies_are_detected_and_served_from_replicas(saved_job, tmp_root):
    root = _copy_stores(saved_job[0], tmp_root / "job")
    node0, node1 = Path(node_store_root(root, 0)) / SESSION, Path(node_store_root(root, 1)) / SESSION
    stem = lambda o: f"iter_{50:020d}.owner_{o:06d}"  # noqa: E731
    _flip(node0 / f"{stem(0)}.data", 1000)  # rank 0's own tensor bytes: one flipped byte
    hdr = node0 / f"{stem(1)}.hdr"  # rank 1's own header: one flipped byte
    raw = bytearray(hdr.read_bytes())
    raw[len(raw) // 3] ^= 0x20
    hdr.write_bytes(bytes(raw))
    with open(node1 / f"{stem(2)}.data", "r+b") as f:  # rank 2's own data: truncated
        f.truncate(100)
    out = run_ranks(_load_only, WS, root, ranks_per_node=RPN, **RUN)
    assert [o["iteration"] for o in out] == [50] * WS and all(o["exact"] for o in out)
    assert [o["source"] for o in out] == ["peer", "peer", "peer", "local"]
    # Verification failures are gathered: every rank reports the same (source, owner) pairs.
    assert all(o["failed_copies"] == [(0, 0), (2, 2)] for o in out)
    assert out[0]["attempts"] == 2 and out[1]["attempts"] == 1


# ---- changed job shape between save and load -----------------------------------------------------


def _load_error(ctx, kw=None):
    m = _manager(ctx, **(kw or {}))
    try:
        return {"ok": _load(m, ctx)}
    except CheckpointingException as e:
        return {"error": str(e)}
    finally:
        m.close()


def test_world_size_changed_between_save_and_load_fails_alike_on_every_rank(saved_job, tmp_root):
    root = _copy_stores(saved_job[0], tmp_root / "job")
    out = run_ranks(_load_error, 2, root, ranks_per_node=1, args=({"replication_factor": 2},), **RUN)
    assert "error" in out[0] and out[0] == out[1]
    # Whole in the stores, so it is resharded (tests/test_elastic.py) — but this template's
    # global shapes depend on the world size: named, on every rank alike.
    assert "(saved by 4 ranks) cannot be resharded onto 2" in out[0]["error"]
    assert (
        "key 'counter' was saved as int64 of global shape [4], the template asks for int64 of [2]"
        in out[0]["error"]
    )


def test_replication_parameters_changed_between_save_and_load_still_restore_correctly(saved_job, tmp_root):
    root = _copy_stores(saved_job[0], tmp_root / "job")
    shutil.rmtree(node_store_root(root, 0))
    out = run_ranks(_load_only, WS, root, ranks_per_node=RPN, args=({"replication_factor": 1},), **RUN)
    assert [o["iteration"] for o in out] == [50] * WS and all(o["exact"] for o in out)
    assert [o["source"] for o in out] == ["peer", "peer", "local", "local"]


# ---- a rank killed in the middle of a save ---------------------------------------------------------

# (point, victim): victims cover sources and holders on both nodes.
KILLS = [("after_staging", 1), ("before_replication", 2), ("after_replication", 3), ("before_agreement", 0)]


def _save_with_kill(ctx, point, victim, restore):
    armed = {"on": False}

    def hook(p):
        if armed["on"] and p == point and ctx.rank == victim:
            ctx.kill_self()

    m = _manager(ctx, fault_hook=hook, timeout_s=20)
    out = {}
    if restore:
        out["load"] = _load(m, ctx)
    else:
        m.save_local(_sd(ctx.rank, ctx.world_size, 10), 10, is_async=False)
    armed["on"] = True
    t = time.monotonic()
    try:
        m.save_local(_sd(ctx.rank, ctx.world_size, 20), 20).wait()
        out["save20"] = "complete"
    except CheckpointingException as e:
        cause = e.__cause__
        out["save20"] = f"{e} | cause: {type(cause).__name__}: {cause}"
    out["seconds"] = time.monotonic() - t
    m.close()
    return out


def _resave_after_restart(ctx):
    m = _manager(ctx)
    out = {"load": _load(m, ctx)}
    for s in (20, 30):
        m.save_local(_sd(ctx.rank, ctx.world_size, s), s, is_async=False)
    out["after"] = _load(m, ctx)
    m.close()
    return out


@pytest.fixture(scope="module")
def killed_mid_save(tmp_path_factory):
    root = tmp_path_factory.mktemp("killed")
    runs = []
    for i, (point, victim) in enumerate(KILLS):
        res = run_ranks(
            _save_with_kill,
            WS,
            root,
            ranks_per_node=RPN,
            args=(point, victim, i > 0),
            expect_killed=[victim],
            **RUN,
        )
        runs.append(res)
    final = run_ranks(_resave_after_restart, WS, root, ranks_per_node=RPN, **RUN)
    return runs, final


def test_rank_killed_mid_save_leaves_the_previous_iteration_latest_for_the_restarted_job(killed_mid_save):
    runs, final = killed_mid_save
    restarts = [[r["load"] for r in res if r is not KILLED] for res in runs[1:]] + [
        [f["load"] for f in final]
    ]
    for i, loads in enumerate(restarts):  # the restart after each of the kills in KILLS
        assert all(
            l == {"iteration": 10, "exact": True, "source": "local", "failed_copies": [], "attempts": 1}
            for l in loads
        ), KILLS[i]


def test_survivors_of_a_rank_killed_mid_save_all_report_the_save_failed(killed_mid_save):
    runs, _ = killed_mid_save
    for (point, victim), res in zip(KILLS, runs):
        assert res[victim] is KILLED
        survivors = [r for i, r in enumerate(res) if i != victim]
        for r in survivors:  # never a split outcome, and nobody blocked until a timeout
            assert r["save20"].startswith("local checkpoint of iteration 20 is not complete"), (point, r)
            assert "previous complete iteration 10 stays loadable" in r["save20"]
            assert r["seconds"] < 20, (point, r)


def test_dead_peer_during_replication_is_reported_naming_the_peer(killed_mid_save):
    runs, _ = killed_mid_save
    res = runs[KILLS.index(("before_replication", 2))]
    # Rank 0 exchanges replicas with rank 2 (ring with jump 2): it names its dead partner.
    assert "ReplicationError" in res[0]["save20"] and "rank 2" in res[0]["save20"]


def test_restarted_job_saves_the_abandoned_iteration_again(killed_mid_save):
    _, final = killed_mid_save
    assert all(
        f["after"] == {"iteration": 30, "exact": True, "source": "local", "failed_copies": [], "attempts": 1}
        for f in final
    )


# ---- the agreement's answer reaches some ranks only -------------------------------------------------


def _answer_lost(ctx):
    """Node 1 dies in the middle of iteration 20's agreement: its ranks (2, 3) have sent their
    votes and are killed as the answer comes back; rank 0 receives the answer (complete), rank 1
    does not (its all-reduce raises, as gloo's does when a peer's connection drops)."""
    armed = {"on": False}

    def hook(point):
        if armed["on"] and point == "after_agreement":
            if ctx.node == 1:
                ctx.kill_self()
            if ctx.rank == 1:
                raise ConnectionError("injected: the agreement's answer never reached this rank")

    m = _manager(ctx, fault_hook=hook, keep_last=1, timeout_s=10)
    m.save_local(_sd(ctx.rank, ctx.world_size, 10), 10, is_async=False)
    armed["on"] = True
    t = time.monotonic()
    try:
        m.save_local(_sd(ctx.rank, ctx.world_size, 20), 20).wait()
        out = {"save20": "complete"}
    except CheckpointingException as e:
        out = {"save20": str(e)}
    out["seconds"] = time.monotonic() - t
    m.close()
    return out


def test_an_agreement_answered_on_some_ranks_only_never_loses_the_previous_iteration(tmp_root):
    """Rank 0 learns that iteration 20 is complete, rank 1 that it failed (and discards its
    copy): rank 0 must not retire iteration 10 on that answer alone — with node 1 lost, 10 is
    the newest iteration whose every rank's data survives (issue 41's CI: the service-mode demo
    restarted from scratch this way)."""
    root = tmp_root / "lost-answer"
    res = run_ranks(_answer_lost, WS, root, ranks_per_node=RPN, expect_killed=[2, 3], **RUN)
    assert res[2] is KILLED and res[3] is KILLED
    assert res[0]["save20"] == "complete", res[0]
    assert res[1]["save20"].startswith("local checkpoint of iteration 20 is not complete"), res[1]
    assert res[0]["seconds"] < 10 + 5 and res[1]["seconds"] < 10 + 5, res
    shutil.rmtree(node_store_root(root, 1))  # node 1 is replaced with an empty store
    out = run_ranks(_load_only, WS, root, ranks_per_node=RPN, args=({"keep_last": 1},), **RUN)
    assert [o["iteration"] for o in out] == [10] * WS, out
    assert all(o["exact"] for o in out), out
    assert [o["source"] for o in out] == ["local", "local", "peer", "peer"], out


# ---- a rank whose save fails locally does not leave the others waiting ---------------------------


def _local_failures(ctx, send_while_staging=None):
    fail_at = {"point": None}

    def hook(point):
        if point == fail_at["point"]:
            raise RuntimeError(f"injected failure at {point}")

    # timeout_s far beyond the run's deadline: a peer waiting for it would fail the test.
    m = _manager(ctx, timeout_s=300, fault_hook=hook)
    m.send_while_staging = send_while_staging
    out = {}

    def save(step, bad_common=False, **kw):
        iteration = kw.pop("iteration", step)
        sd = _sd(ctx.rank, ctx.world_size, step, **kw)
        if bad_common:
            sd["lock"] = threading.Lock()  # the codec refuses it (no pickle)
        try:
            m.save_local(sd, iteration).wait()
            return "complete"
        except (CodecError, ValidationError) as e:
            return f"local {type(e).__name__}: {e}"
        except CheckpointingException as e:
            return f"failed: {e} | {e.__cause__}"

    out[10] = save(10)
    out[20] = save(20, extra=ctx.rank == 3)  # structure changed on one rank (inconsistently)
    out[30] = save(30)
    out[40] = save(40)  # every rank recomputes the distribution at the same save
    if ctx.rank == 1:
        m.store.memory_budget = 1  # node 0's store cannot take the replica rank 1 holds
    out[50] = save(50)
    m.store.memory_budget = None
    out[60] = save(60, bad_common=ctx.rank == 1)
    out[70] = save(70, iteration=60 if ctx.rank == 2 else 70)  # one rank's iteration goes back
    out[80] = save(80)
    if ctx.rank == 0:
        fail_at["point"] = "after_staging"  # fails in the background, before replicating
    out[90] = save(90)
    fail_at["point"] = None
    out[100] = save(100)
    out["load"] = _load(m, ctx)
    m.close()
    return out


def test_a_rank_failing_in_save_fails_that_save_everywhere_without_blocking(tmp_root):
    # send_while_staging left to the manager (a failed copy under it: tests/test_transport.py)
    out = run_ranks(
        _local_failures, WS, tmp_root, ranks_per_node=RPN, args=(None,), timeout=90, collective_timeout=30
    )
    for r, o in enumerate(out):
        assert o[10] == o[30] == o[40] == o[80] == o[100] == "complete", (r, o)
        assert o["load"] == {
            "iteration": 100,
            "exact": True,
            "source": "local",
            "failed_copies": [],
            "attempts": 1,
        }
    # A structure change on one rank: every rank takes the general path (the save's vote) and
    # its integrity check refuses the new key, with the same words on every rank.
    for r in range(WS):
        assert out[r][20].startswith("local ValidationError: sharded state dict is inconsistent"), out[r][20]
        assert "'new'" in out[r][20] and out[r][20] == out[0][20]
    # Raised by save_local itself on the culprit.
    assert out[1][60].startswith("local CodecError")
    assert out[2][70].startswith("local IterationOrderError") and "does not increase" in out[2][70]
    # Over budget: raised by save_local, or in the background when the own segment was already
    # reserved ahead and the replica this rank holds did not fit (timing decides which).
    assert out[1][50].startswith("failed: ") and "over its memory budget of 1 bytes" in out[1][50]
    assert out[0][90].startswith("failed: ") and "injected failure at after_staging" in out[0][90]
    for step, culprit in ((50, 1), (60, 1), (90, 0)):
        for r in range(WS):
            if r != culprit:
                assert out[r][step].startswith(f"failed: local checkpoint of iteration {step}"), (
                    step,
                    r,
                    out[r][step],
                )
    # Every save votes before staging: a rank whose iteration goes back fails save 70 on every
    # rank at once, the others learning of the culprit from save_local itself.
    for r in range(WS):
        if r != 2:
            assert out[r][70].startswith(
                "failed: preparing the save of iteration 70 failed on rank 2, so every rank stops"
            ), (r, out[r][70])
    # Holders name the rank that could not save.
    assert "rank 1 could not save iteration 60" in out[3][60]
    assert "rank 0 could not save iteration 90" in out[2][90]


# ---- world size 3, ring placement ----------------------------------------------------------------


def _save_two(ctx):
    m = _manager(ctx)
    for s in (10, 20):
        m.save_local(_sd(ctx.rank, ctx.world_size, s), s, is_async=False)
    m.close()
    return m.placement.holders_of(ctx.rank)


@pytest.mark.parametrize(
    "rpn, lost_node, sources",
    [
        (1, 1, ["local", "peer", "local"]),
        (2, 0, ["peer", "peer", "local"]),  # a partial last node: rank 2 holds both replicas
    ],
)
def test_world_size_three_with_ring_placement_survives_a_node_loss(tmp_root, rpn, lost_node, sources):
    holders = run_ranks(_save_two, 3, tmp_root, ranks_per_node=rpn, **RUN)
    assert all(all(h // rpn != r // rpn for h in hs) for r, hs in enumerate(holders))
    shutil.rmtree(node_store_root(tmp_root, lost_node))
    out = run_ranks(_load_only, 3, tmp_root, ranks_per_node=rpn, **RUN)
    assert [o["iteration"] for o in out] == [20] * 3 and all(o["exact"] for o in out)
    assert [o["source"] for o in out] == sources


# ---- nvidia-resiliency-ext LocalCheckpointManager-style use ----------------------------------------


def _nvrx_save(ctx):
    m = _manager(ctx)
    tasd, cached = MCoreTensorAwareStateDict.from_state_dict(
        _sd(ctx.rank, ctx.world_size, 10), algo="fully_parallel"
    )
    req = m.save(tasd, 10, is_async=True)
    req.execute_sync()  # the AsyncRequest helper: async fn (waits for our save), finalize
    tasd, _ = MCoreTensorAwareStateDict.from_state_dict(
        _sd(ctx.rank, ctx.world_size, 20), algo="fully_parallel", cached_metadata=cached
    )
    assert m.save(tasd, 20, is_async=False) is None
    m.close()
    return type(req).__name__


def _nvrx_load(ctx):
    m = _manager(ctx)
    latest = m.find_latest()
    tasd, ckpt_id = m.load()
    state = tasd.to_state_dict(_sd(ctx.rank, ctx.world_size, 0, fill=False), algo="fully_parallel")
    m.close()
    return latest, tuple(ckpt_id), _bit_exact(state, ctx.rank, ctx.world_size, 20)


def test_nvrx_style_save_find_latest_and_load_across_a_restart(tmp_root):
    assert run_ranks(_nvrx_save, 2, tmp_root, ranks_per_node=1, **RUN) == ["LocalAsyncRequest"] * 2
    out = run_ranks(_nvrx_load, 2, tmp_root, ranks_per_node=1, **RUN)
    assert out == [(20, (20, r, SESSION), True) for r in range(2)]


def _managers_one_after_another(ctx, n: int):
    threads = []
    for i in range(n):
        m = CheckpointManager("one-after-another", store_root=ctx.store_root, ranks_per_node=1, timeout_s=30)
        m.save_local(_sd(ctx.rank, ctx.world_size, i + 1), i + 1).wait()
        m.close()
        threads.append(len(os.listdir("/proc/self/task")))  # native threads too (gloo's)
    dist.barrier()  # the job's own group still works after every manager's groups are gone
    return threads


@pytest.mark.multiprocess
def test_managers_made_one_after_another_release_their_groups_threads_on_close(tmp_root):
    # Each manager's groups hold gloo connections and threads; close() destroys them, so a job
    # (or a test suite) making many managers does not run out of threads.
    n = 12
    for threads in run_ranks(
        _managers_one_after_another, 2, tmp_root, ranks_per_node=1, args=(n,), timeout=120
    ):
        assert threads[-1] <= threads[1] + 2, f"threads after each manager closed: {threads}"
