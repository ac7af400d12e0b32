"""CheckpointManager(mode="service") end to end: real daemon processes per node, real trainer
ranks; trainers killed right after save_local returns; a node lost with its daemon and store."""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import KILLED, run_ranks
from resilient_ckpt.model.mapping import ShardedTensor
from test_daemon import SESSION, ProcessCluster

pytestmark = pytest.mark.multiprocess


def _state(rank, world, it, empty=False):
    g = torch.Generator().manual_seed(10 * it + rank)
    own = torch.randn(128, 64, generator=g)
    rep = torch.arange(8192, dtype=torch.float32) * (it + 1)
    if empty:
        own, rep = torch.zeros_like(own), torch.zeros_like(rep)
    return {
        "own": ShardedTensor.from_rank_offsets("own", own, (0, rank, world)),
        "rep": ShardedTensor.from_rank_offsets("rep", rep, replica_id=rank),
        "it": it,
    }


def _manager(ctx, endpoints):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    return CheckpointManager(
        SESSION, store_root=ctx.store_root, mode="service", endpoint=endpoints[ctx.node], timeout_s=30
    )


def _save_then_die(ctx, endpoints):
    m = _manager(ctx, endpoints)
    m.save_local(_state(ctx.rank, ctx.world_size, 1), 1).wait()
    h = m.save_local(_state(ctx.rank, ctx.world_size, 2), 2)
    h.wait_staged()
    h.wait()
    h3 = m.save_local(_state(ctx.rank, ctx.world_size, 3), 3)
    h3.wait()  # committed and replicated by the daemon; now the trainer crashes
    ctx.kill_self()


def _restore(ctx, endpoints):
    m = _manager(ctx, endpoints)
    template = _state(ctx.rank, ctx.world_size, 0, empty=True)
    state, it = m.load_local(template)
    ref = _state(ctx.rank, ctx.world_size, it)
    exact = torch.equal(state["own"], ref["own"].data) and torch.equal(state["rep"], ref["rep"].data)
    source = m.last_load_metrics.source
    m.close()
    return it, exact, source


def test_service_mode_saves_survive_trainer_crashes_and_a_lost_node(tmp_path):
    pc = ProcessCluster(tmp_path, 2).start()
    try:
        out = run_ranks(
            _save_then_die,
            4,
            tmp_path,
            ranks_per_node=2,
            args=(pc.eps,),
            expect_killed=[0, 1, 2, 3],
            extra_env=pc.trainer_env,
            timeout=120,
        )
        assert out == [KILLED] * 4
        # Trainers restart on the same nodes: each restores from its own node's store.
        out = run_ranks(
            _restore, 4, tmp_path, ranks_per_node=2, args=(pc.eps,), extra_env=pc.trainer_env, timeout=120
        )
        assert out == [(3, True, "local")] * 4
        # Node 1 is lost (daemon SIGKILLed, memory gone) and replaced by an empty node: its
        # trainers' load_local asks the new daemon, which pulls from node 0's daemon.
        pc.nodes[1].kill()
        shutil.rmtree(tmp_path / "node1")
        pc.nodes[1].start()
        pc.nodes[1].wait_ready()
        out = run_ranks(
            _restore, 4, tmp_path, ranks_per_node=2, args=(pc.eps,), extra_env=pc.trainer_env, timeout=120
        )
        assert [o[:2] for o in out] == [(3, True)] * 4
        assert [o[2] for o in out[2:]] == ["local", "local"], "the daemon pulled them into node 1"
    finally:
        pc.stop()
