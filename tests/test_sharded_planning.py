"""Sharded first-save planning: each rank plans some keys (parallel/sharded_planning.py).

Jobs of SHARDED_PLANNING_MIN_WORLD ranks or more plan the first save without an all-gather of
every rank's records. Specified here on real gloo ranks, with the threshold lowered inside
each rank: the same verdicts, word for word, as the gathered planner; every shard id saved by
exactly one holder per parallelization group; balance; a full save/restore; a local error
failing every rank together.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import run_ranks
from resilient_ckpt.errors import CheckpointingException, ValidationError
from resilient_ckpt.manager.checkpoint_manager import CheckpointManager
from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor
from resilient_ckpt.parallel import sharded_planning
from resilient_ckpt.parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict

pytestmark = pytest.mark.multiprocess

WS = 4
RUN = dict(timeout=120, collective_timeout=30)


def _state(rank: int, ws: int, tp: int = 2, n: int = 40, broken: bool = False, step: int = 1):
    """Megatron-like: TP-sharded weights replicated over DP, DP-sharded optimizer state, an
    unsharded bias replicated everywhere, one object per rank."""
    tp_rank, dp_rank = rank % tp, rank // tp
    g = torch.Generator().manual_seed(step)
    sd = {}
    for i in range(n):
        w = torch.randn(8 * (1 + i % 3), 4, generator=g)
        rows = w.shape[0] // tp
        sd[f"w{i}"] = ShardedTensor.from_rank_offsets(
            f"w{i}", w[tp_rank * rows : (tp_rank + 1) * rows], (0, tp_rank, tp), replica_id=dp_rank
        )
        m = torch.randn(ws * 2, 3, generator=g)
        sd[f"m{i}"] = ShardedTensor.from_rank_offsets(f"m{i}", m[rank * 2 : rank * 2 + 2], (0, rank, ws))
    sd["bias"] = ShardedTensor.from_rank_offsets("bias", torch.arange(6.0) + step, replica_id=rank)
    sd["rng"] = ShardedObject("rng", {"rank": rank, "step": step}, (ws,), (rank,))
    sd["step"] = step
    if broken and rank == 3:
        # a gap: rank 3's piece of m7 claims the wrong offset (and so overlaps rank 2's)
        sd["m7"] = ShardedTensor.from_rank_offsets("m7", torch.zeros(2, 3), (0, 2, ws))
    return sd


def _plan(ctx, sharded: bool, broken: bool, dp_groups: bool):
    sharded_planning.SHARDED_PLANNING_MIN_WORLD = 1 if sharded else 10**9
    group = None
    if dp_groups:  # parallelization group = the data-parallel ranks of one TP rank
        groups = [dist.new_group([r for r in range(WS) if r % 2 == t]) for t in range(2)]
        group = groups[ctx.rank % 2]
    try:
        tasd, distribution = MCoreTensorAwareStateDict.from_state_dict(
            _state(ctx.rank, WS, broken=broken), "fully_parallel", parallelization_group=group
        )
    except ValidationError as e:
        return {"error": str(e)}
    saved = [st.shard_id for st in tasd.tensor_metadata]
    return {"saved": saved, "rank_bytes": list(distribution.rank_bytes), "error": None}


@pytest.mark.parametrize("dp_groups", [False, True])
def test_every_shard_is_saved_once_per_group_and_bytes_balance(tmp_root, dp_groups):
    out = run_ranks(_plan, WS, tmp_root, args=(True, False, dp_groups), **RUN)
    groups = [[0, 1, 2, 3]] if not dp_groups else [[0, 2], [1, 3]]
    for members in groups:
        saved = [
            tuple(map(tuple, sid)) if isinstance(sid, list) else sid
            for r in members
            for sid in out[r]["saved"]
        ]
        assert len(saved) == len(set(saved)), "a shard saved twice in one group"
        held = set()
        for r in members:
            held |= {st.shard_id for st in _all_shards(r)}
        assert set(saved) == held, "every shard id held in the group is saved by one holder"
        loads = out[members[0]]["rank_bytes"]
        assert all(out[r]["rank_bytes"] == loads for r in members)
        assert max(loads) <= 1.25 * (sum(loads) / len(loads)), loads


def _all_shards(rank):
    return [v for v in _state(rank, WS).values() if isinstance(v, ShardedTensor)]


def test_a_broken_layout_gets_the_gathered_planners_error_word_for_word_on_every_rank(tmp_root):
    sharded = run_ranks(_plan, WS, tmp_root, args=(True, True, False), **RUN)
    gathered = run_ranks(_plan, WS, tmp_root, args=(False, True, False), **RUN)
    messages = {o["error"] for o in sharded + gathered}
    assert len(messages) == 1 and None not in messages, messages
    assert "'m7'" in messages.pop()


def _save_restore(ctx):
    sharded_planning.SHARDED_PLANNING_MIN_WORLD = 1
    m = CheckpointManager("sharded", store_root=ctx.store_root, replication_factor=2, timeout_s=30)
    for step in (1, 2):
        m.save_local(_state(ctx.rank, WS, step=step), step).wait()
    m.close()
    m = CheckpointManager("sharded", store_root=ctx.store_root, replication_factor=2, timeout_s=30)
    state, it = m.load_local(_state(ctx.rank, WS, step=0))
    m.close()
    want = _state(ctx.rank, WS, step=2)
    exact = all(torch.equal(state[k], v.data) for k, v in want.items() if isinstance(v, ShardedTensor))
    return it, exact, state["rng"]


def test_a_job_planned_sharded_saves_and_restores_bit_exactly(tmp_root):
    out = run_ranks(_save_restore, WS, tmp_root, ranks_per_node=2, **RUN)
    for rank, (it, exact, rng) in enumerate(out):
        assert it == 2 and exact and rng == {"rank": rank, "step": 2}


def _one_rank_fails(ctx):
    sharded_planning.SHARDED_PLANNING_MIN_WORLD = 1
    m = CheckpointManager("sharded", store_root=ctx.store_root, replication_factor=1, timeout_s=30)

    def state():
        if ctx.rank == 1:
            raise RuntimeError("rank 1 cannot build its state")
        return _state(ctx.rank, WS)

    try:
        m.save_local(state, 1).wait()
        outcome = "saved"
    except (CheckpointingException, RuntimeError) as e:
        outcome = type(e).__name__
    m.close()
    t = torch.ones(1)
    dist.all_reduce(t)  # the job's own group still works
    return outcome, float(t.item())


def test_a_rank_failing_before_planning_fails_every_rank_together(tmp_root):
    out = run_ranks(_one_rank_fails, WS, tmp_root, ranks_per_node=2, **RUN)
    assert out[1][0] == "RuntimeError"
    assert all(o[0] != "saved" and o[1] == WS for o in out), out


def _restore_through_the_exchange(ctx):
    sharded_planning.SHARDED_PLANNING_MIN_WORLD = 1
    # No replicas: what a rank did not save comes from its data-parallel peer on the other
    # node, through the exchange planned by key.
    m = CheckpointManager("xchg", store_root=ctx.store_root, replication_factor=1, timeout_s=30)
    m.save_local(_state(ctx.rank, WS, step=3), 3).wait()
    m.close()
    m = CheckpointManager("xchg", store_root=ctx.store_root, replication_factor=1, timeout_s=30)
    state, it = m.load_local(_state(ctx.rank, WS, step=0))
    m.close()
    want = _state(ctx.rank, WS, step=3)
    return it, all(torch.equal(state[k], v.data) for k, v in want.items() if isinstance(v, ShardedTensor))


def test_shards_a_rank_did_not_save_arrive_through_the_exchange_planned_by_key(tmp_root):
    out = run_ranks(_restore_through_the_exchange, WS, tmp_root, ranks_per_node=2, **RUN)
    assert all(it == 3 and exact for it, exact in out), out


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_planning_the_exchange_by_key_moves_what_the_gathered_plan_moves(data):
    """Pure: the planners' matches (all of them together) give every rank every shard it
    lacks from a rank that holds it, and report the same first absent shard."""
    from resilient_ckpt.parallel.exchange import plan_exchange

    n = data.draw(st.integers(1, 5))
    keys = [f"k{i}" for i in range(data.draw(st.integers(1, 6)))]
    sids = [(k, (o,)) for k in keys for o in range(2)]
    held = [data.draw(st.lists(st.sampled_from(sids), unique=True, max_size=6)) for _ in range(n)]
    need = [data.draw(st.lists(st.sampled_from(sids), unique=True, max_size=6)) for _ in range(n)]
    need = [[s for s in nd if s not in h] for nd, h in zip(need, held)]
    gathered = [
        {"held": [[k, list(o), "float32", [2]] for k, o in h], "need": [[k, list(o)] for k, o in nd]}
        for h, nd in zip(held, need)
    ]
    plan, absent = plan_exchange(gathered)
    # what every planner receives, as plan_exchange_sharded routes it
    by_planner = [[{"n": [], "h": []} for _ in range(n)] for _ in range(n)]  # [planner][sender]
    for r in range(n):
        for i, (k, o) in enumerate(need[r]):
            by_planner[sharded_planning.planner_of(k, n)][r]["n"].append([k, list(o), i])
        for k, o in held[r]:
            by_planner[sharded_planning.planner_of(k, n)][r]["h"].append([k, list(o), "float32", [2]])
    moved, absents = set(), []
    for p in range(n):
        per_rank, ab = sharded_planning._match(by_planner[p], n)
        absents += ab
        for rows in per_rank:
            for key, off, src, dst, nbytes, _dt, _shape in rows:
                assert (key, tuple(off)) in held[src] and nbytes == 8
                moved.add(((key, tuple(off)), dst))
    assert moved == {(t.shard_id, t.dst) for t in plan.transfers}
    first = min(absents)[:1] + [(min(absents)[2], tuple(min(absents)[3]))] if absents else None
    want = None
    if absent:
        r = min(absent)
        want = [r, absent[r][0]]
    assert first == want
