"""Elastic restore: a checkpoint saved by N ranks restored on M != N ranks (and another parallel
layout) straight from the survivors' node stores, by global offsets."""

import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import node_store_root, run_ranks
from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor

ROWS, COLS = 12, 10


def _global(name: str, it: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(hash((name, it)) % (1 << 31))
    return torch.randn(ROWS, COLS, generator=g)


def _rows(rank: int, world: int):
    per = -(-ROWS // world)
    return rank * per, min(ROWS, (rank + 1) * per)


def _state(rank, world, it, tp_axis=0, empty=False):
    """A Megatron-style sharded state dict for ``world`` ranks: "w" split along ``tp_axis``
    (tensor parallel), "emb" split unevenly by rows, "bias" replicated (saved once), a per-rank
    object and common state."""
    w = _global("w", it)
    if tp_axis == 0:
        local_w = w.chunk(world, 0)[rank]
    else:
        local_w = w.chunk(world, 1)[rank]
    lo, hi = _rows(rank, world)
    emb = _global("emb", it)[lo:hi]
    bias = _global("bias", it)[0]
    if empty:
        local_w, emb, bias = torch.zeros_like(local_w), torch.zeros_like(emb), torch.zeros_like(bias)
    return {
        "w": ShardedTensor.from_rank_offsets("w", local_w.clone(), (tp_axis, rank, world)),
        "emb": ShardedTensor("emb", emb.clone(), emb.dtype, tuple(emb.shape), (ROWS, COLS), (lo, 0), None),
        "bias": ShardedTensor.from_rank_offsets("bias", bias.clone(), replica_id=rank),
        "per_rank": ShardedObject("per_rank", {"rank": rank, "it": it}, (world,), (rank,)),
        "iteration": it,
    }


def _manager(ctx, **kw):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    # replication_factor=2 (the default) also on one surviving node: it keeps one copy, warned
    return CheckpointManager(
        "elastic", store_root=ctx.store_root, ranks_per_node=ctx.ranks_per_node, timeout_s=30, **kw
    )


def _save(ctx, iterations, tp_axis=0):
    m = _manager(ctx)
    for it in iterations:
        m.save_local(_state(ctx.rank, ctx.world_size, it, tp_axis), it).wait()
    m.close()


def _restore(ctx, saved_world, tp_axis=0):
    m = _manager(ctx)
    latest = m.find_latest()
    template = _state(ctx.rank, ctx.world_size, 0, tp_axis, empty=True)
    out = m.load_local(template)
    assert out is not None
    state, it = out
    ref = _state(ctx.rank, ctx.world_size, it, tp_axis)
    exact = all(torch.equal(state[k], ref[k].data) for k in ("w", "emb", "bias"))
    in_place = state["w"] is template["w"].data
    obj = state["per_rank"]
    expect_obj = {"rank": ctx.rank, "it": it} if ctx.rank < saved_world else {"rank": ctx.rank, "it": 0}
    t = torch.ones(1)
    torch.distributed.all_reduce(t)  # the job's own group still works
    source = m.last_load_metrics.source
    m.close()
    return latest, it, exact, in_place, obj == expect_obj, state["iteration"], source, t.item()


def _lose(root, *nodes):
    for n in nodes:
        shutil.rmtree(node_store_root(str(root), n))


@pytest.mark.multiprocess
def test_four_ranks_on_two_nodes_resume_on_the_surviving_node_with_two(tmp_root):
    run_ranks(_save, 4, tmp_root, ranks_per_node=2, args=([3, 5],), timeout=120)
    _lose(tmp_root, 1)  # ranks 2, 3 lost; their replicas are on node 0
    out = run_ranks(_restore, 2, tmp_root, ranks_per_node=2, args=(4,), timeout=120)
    assert out == [(5, 5, True, True, True, 5, "resharded", 2.0)] * 2


@pytest.mark.multiprocess
def test_four_to_three(tmp_root):
    run_ranks(_save, 4, tmp_root, ranks_per_node=1, args=([5],), timeout=120)
    _lose(tmp_root, 3)
    out = run_ranks(_restore, 3, tmp_root, ranks_per_node=1, args=(4,), timeout=120)
    assert out == [(5, 5, True, True, True, 5, "resharded", 3.0)] * 3


@pytest.mark.multiprocess
def test_two_to_four_grows_onto_empty_nodes(tmp_root):
    run_ranks(_save, 2, tmp_root, ranks_per_node=1, args=([5],), timeout=120)
    out = run_ranks(_restore, 4, tmp_root, ranks_per_node=1, args=(2,), timeout=120)
    # ranks 2 and 3 did not exist: their per-rank objects stay their own
    assert out == [(5, 5, True, True, True, 5, "resharded", 4.0)] * 4


@pytest.mark.multiprocess
@pytest.mark.parametrize("saved, restored", [(2, 1), (1, 2)])
def test_tensor_parallel_degree_change(tmp_root, saved, restored):
    run_ranks(_save, saved, tmp_root, ranks_per_node=2, args=([5], 1), timeout=120)
    out = run_ranks(_restore, restored, tmp_root, ranks_per_node=2, args=(saved, 1), timeout=120)
    assert [o[:6] for o in out] == [(5, 5, True, True, True, 5)] * restored


def _bad_template(ctx, what):
    m = _manager(ctx)
    template = _state(ctx.rank, ctx.world_size, 0, empty=True)
    if what == "shape":
        bad = torch.zeros(ROWS + 1, COLS)[: ROWS + 1].chunk(ctx.world_size, 0)[ctx.rank].clone()
        template["w"] = ShardedTensor.from_rank_offsets("w", bad, (0, ctx.rank, ctx.world_size))
    elif what == "key" and ctx.rank == 1:
        template["extra"] = ShardedTensor.from_rank_offsets("not_saved", torch.zeros(3))
    try:
        m.load_local(template)
        return "restored"
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    finally:
        m.close()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "what, words",
    [
        ("shape", "key 'w' was saved as float32 of global shape [12, 10]"),
        ("key", "key 'not_saved' is not in"),
    ],
)
def test_a_template_that_does_not_fit_fails_alike_on_every_rank(tmp_root, what, words):
    run_ranks(_save, 3, tmp_root, ranks_per_node=1, args=([5],), timeout=120)
    out = run_ranks(_bad_template, 2, tmp_root, ranks_per_node=1, args=(what,), timeout=120)
    assert out[0] == out[1] and words in out[0], out


# ---- FSDP2 through TrainState and the hook -------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 4)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)))


def _fsdp2(world, seed):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from resilient_ckpt import TrainState

    mesh = init_device_mesh("cpu", (world,))
    torch.manual_seed(seed)
    model = _Net()
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainState(model, opt, sched, extra={"data_position": 0})


def _train(state, step):
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
    state.model(x).square().mean().backward()
    state.optimizer.step()
    state.lr_scheduler.step()
    state.optimizer.zero_grad()
    state.extra["data_position"] += 4


def _full(state):
    """Every parameter and Adam state as full tensors (collective), and the scheduler."""
    out = {f"p.{n}": p.full_tensor().clone() for n, p in state.model.named_parameters()}
    names = {id(p): n for n, p in state.model.named_parameters()}
    for p, s in state.optimizer.state.items():
        for k, v in s.items():
            out[f"o.{names[id(p)]}.{k}"] = v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
    out["sched"] = state.lr_scheduler.state_dict()["last_epoch"]
    return out


def _fsdp2_save(ctx):
    from resilient_ckpt import CheckpointHook

    state = _fsdp2(ctx.world_size, seed=0)
    hook = CheckpointHook(_manager(ctx), every_n_steps=3, state=state)
    for step in range(3):
        _train(state, step)
        hook.step(step)  # saves after step 2
    hook.finish()
    full = _full(state)
    if ctx.rank == 0:
        torch.save(full, f"{ctx.tmp_root}/expected.pt")
    hook.close()
    hook.manager.close()


def _fsdp2_restore(ctx):
    from resilient_ckpt import CheckpointHook

    state = _fsdp2(ctx.world_size, seed=9)
    hook = CheckpointHook(_manager(ctx), every_n_steps=3, state=state)
    start = hook.restore()
    got = _full(state)
    expected = torch.load(f"{ctx.tmp_root}/expected.pt")
    diffs = [
        k
        for k in expected
        if not (torch.equal(got[k], expected[k]) if torch.is_tensor(got[k]) else got[k] == expected[k])
    ]
    position = state.extra["data_position"]
    _train(state, start)  # and training goes on on the new mesh
    hook.close()
    hook.manager.close()
    return start, sorted(got) == sorted(expected), diffs, position, hook.restored_from["source"]


@pytest.mark.multiprocess
def test_fsdp2_on_four_ranks_resumes_on_a_two_rank_mesh(tmp_root):
    run_ranks(_fsdp2_save, 4, tmp_root, ranks_per_node=2, timeout=180)
    _lose(tmp_root, 1)
    out = run_ranks(_fsdp2_restore, 2, tmp_root, ranks_per_node=2, timeout=180)
    # ranks 0, 1 take saved ranks 0, 1's per-rank state (their data positions)
    assert out == [(3, True, [], 12, "resharded")] * 2


# ---- the memory tier agrees with torch DCP's own resharding of the flushed copy ------------------


def _save_and_flush(ctx, pdir):
    m = _manager(ctx, persistent_dir=pdir)
    m.save_local(_state(ctx.rank, ctx.world_size, 5), 5).wait()
    m.flush().wait()
    m.close()


def _memory_vs_dcp(ctx, pdir):
    import torch.distributed.checkpoint as dcp

    m = _manager(ctx)
    state, it = m.load_local(_state(ctx.rank, ctx.world_size, 0, empty=True))
    m.close()
    # plain torch DCP, no resilient_ckpt code: each rank reads the full tensors, resharded by DCP
    full = {"w": torch.zeros(ROWS, COLS), "emb": torch.zeros(ROWS, COLS), "bias": torch.zeros(COLS)}
    dcp.load(full, checkpoint_id=f"{pdir}/iter_{it:07d}")
    lo, hi = _rows(ctx.rank, ctx.world_size)
    mine = {
        "w": full["w"].chunk(ctx.world_size, 0)[ctx.rank],
        "emb": full["emb"][lo:hi],
        "bias": full["bias"],
    }
    return it, [k for k in mine if not torch.equal(mine[k], state[k])]


@pytest.mark.multiprocess
def test_resharded_from_memory_equals_torch_dcp_resharding_the_flushed_copy(tmp_root):
    pdir = str(tmp_root / "persistent")
    run_ranks(_save_and_flush, 4, tmp_root, ranks_per_node=1, args=(pdir,), timeout=180)
    _lose(tmp_root, 3)
    out = run_ranks(_memory_vs_dcp, 3, tmp_root, ranks_per_node=1, args=(pdir,), timeout=180)
    assert out == [(5, [])] * 3


# ---- faults and what survives ----------------------------------------------------------------


def _restore_or_die(ctx):
    import time as _time

    def hook(point):
        if point == "reshard_before_exchange" and ctx.rank == 2:
            ctx.kill_self()

    m = _manager(ctx, fault_hook=hook)
    t0 = _time.monotonic()
    try:
        m.load_local(_state(ctx.rank, ctx.world_size, 0, empty=True))
        return "restored", _time.monotonic() - t0
    except Exception as e:
        return type(e).__mro__[-3].__name__, _time.monotonic() - t0


@pytest.mark.multiprocess
def test_a_survivor_killed_during_the_resharded_restore_fails_every_rank_in_bounded_time(tmp_root):
    from harness import KILLED

    run_ranks(_save, 4, tmp_root, ranks_per_node=1, args=([5],), timeout=120)
    _lose(tmp_root, 3)
    out = run_ranks(_restore_or_die, 3, tmp_root, ranks_per_node=1, expect_killed=[2], timeout=120)
    assert out[2] is KILLED
    for outcome, seconds in out[:2]:
        assert outcome != "restored" and seconds < 3 * 30, out


def _drop(root, node, owner, it):
    for p in (root / f"node{node}" / "elastic").glob(f"iter_{it:020d}.owner_{owner:06d}.*"):
        p.unlink()


@pytest.mark.multiprocess
def test_find_latest_on_the_survivors_answers_the_newest_iteration_they_hold_whole(tmp_root):
    run_ranks(_save_keep, 4, tmp_root, ranks_per_node=1, args=([3, 5],), timeout=120)
    _lose(tmp_root, 3)
    # iteration 5 of saved rank 1 is gone from both its copies (nodes 1 and 2): 3 is the newest whole
    _drop(tmp_root, 1, 1, 5)
    _drop(tmp_root, 2, 1, 5)
    out = run_ranks(_restore, 3, tmp_root, ranks_per_node=1, args=(4,), timeout=120)
    assert [o[:3] for o in out] == [(3, 3, True)] * 3


def _save_keep(ctx, iterations):
    m = _manager(ctx, keep_last=2)
    for it in iterations:
        m.save_local(_state(ctx.rank, ctx.world_size, it), it).wait()
    m.close()


# ---- the planner alone (pure) ------------------------------------------------------------------


def _plan(saved_boxes, wanted_boxes, shape=(8,)):
    from resilient_ckpt.parallel.resharding import SavedShard, WantedShard, plan_reshard

    saved = [SavedShard(o, 0, "k", "float32", shape, b, 0, 0) for o, b in enumerate(saved_boxes)]
    wanted = [WantedShard(r, 0, "k", "float32", shape, b) for r, b in enumerate(wanted_boxes)]
    holders = {o: (o,) for o in range(len(saved_boxes))}
    return plan_reshard(wanted, saved, holders, lambda a, b: a == b, lambda d: 4)


def test_planner_names_gaps_overlaps_and_ranges_the_new_layout_drops():
    _, errors = _plan([((0, 4),)], [((0, 8),)])
    assert errors == ["rank 0: key 'k' range [0:8]: the checkpoint covers only 4 of its 8 elements"]
    _, errors = _plan([((0, 6),), ((4, 8),)], [((0, 8),)])
    assert "overlaps itself in 10 of its 8 elements" in errors[0]
    _, errors = _plan([((0, 4),), ((4, 8),)], [((0, 4),)])
    assert errors == ["key 'k': no rank of the new layout asks for range [4:8] of it (it would be dropped)"]


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 6), st.integers(1, 6), st.integers(1, 30))
def test_planner_pieces_tile_every_template_shard_exactly(n, m, length):
    import math as _math

    def split(k):
        step = -(-length // k)
        return [((lo, min(length, lo + step)),) for lo in range(0, length, step)]

    pieces, errors = _plan(split(n), split(m), (length,))
    assert errors == []
    for r, box in enumerate(split(m)):
        mine = sorted(p.box for p in pieces if p.dst == r)
        # pieces of one template shard are disjoint and add up to it
        assert sum(_math.prod(hi - lo for lo, hi in b) for b in mine) == box[0][1] - box[0][0]
        assert all(a[0][1] <= b[0][0] for a, b in zip(mine, mine[1:]))


@pytest.mark.multiprocess
def test_a_corrupt_copy_is_routed_around_through_another_holder(tmp_root):
    run_ranks(_save, 4, tmp_root, ranks_per_node=1, args=([5],), timeout=120)
    _lose(tmp_root, 3)
    # saved rank 1's own file on node 1 has a flipped byte; its replica on node 2 is intact
    (data,) = (tmp_root / "node1" / "elastic").glob(f"iter_{5:020d}.owner_{1:06d}.data")
    with open(data, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    out = run_ranks(_restore, 3, tmp_root, ranks_per_node=1, args=(4,), timeout=120)
    assert [o[:3] for o in out] == [(5, 5, True)] * 3
