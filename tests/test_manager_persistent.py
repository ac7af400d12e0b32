"""CheckpointManager with a persistent tier: periodic flush, fallback restore on every rank."""

import shutil

import pytest
import torch

from harness import node_store_root, run_ranks
from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor


def _state(rank, world, it, empty=False):
    g = torch.Generator().manual_seed(1000 * it + rank)
    shard = torch.randn(4, 8, generator=g)
    rep = torch.arange(16, dtype=torch.float32) + it
    if empty:
        shard, rep = torch.zeros_like(shard), torch.zeros_like(rep)
    return {
        "w": ShardedTensor.from_rank_offsets("w", shard, (0, rank, world)),
        "b": ShardedTensor.from_rank_offsets("b", rep, replica_id=rank),
        "rng": ShardedObject("rng", {"seed": rank * 7 + it}, (world,), (rank,)),
        "step": it,
    }


def _save(ctx, durable_dir):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    m = CheckpointManager(
        "persist",
        store_root=ctx.store_root,
        ranks_per_node=1,
        persistent_dir=durable_dir,
        flush_every=2,
        timeout_s=30,
    )
    for it in (10, 20, 30):
        m.save_local(_state(ctx.rank, ctx.world_size, it), it).wait()
    m.flush().wait()  # on demand: iteration 30 (20 was flushed by flush_every=2)
    m.close()
    return sorted(d.iteration for d in m._tier.list_complete())


def _load(ctx, durable_dir):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    m = CheckpointManager(
        "persist", store_root=ctx.store_root, ranks_per_node=1, persistent_dir=durable_dir, timeout_s=30
    )
    state, it = m.load_local(_state(ctx.rank, ctx.world_size, 0, empty=True))
    ref = _state(ctx.rank, ctx.world_size, it)
    exact = torch.equal(state["w"], ref["w"].data) and torch.equal(state["b"], ref["b"].data)
    return it, exact, state["rng"], state["step"], m.last_load_metrics.source


@pytest.mark.multiprocess
def test_memory_lost_everywhere_restores_from_the_persistent_tier_on_every_rank(tmp_root):
    durable = str(tmp_root / "durable")
    flushed = run_ranks(_save, 2, tmp_root, ranks_per_node=1, args=(durable,), timeout=120)
    assert flushed[0] == [20, 30], "every 2nd complete save and the on-demand flush are durable"
    # Both copies of every rank's data are gone (both nodes' memory).
    for node in (0, 1):
        shutil.rmtree(node_store_root(str(tmp_root), node))
    out = run_ranks(_load, 2, tmp_root, ranks_per_node=1, args=(durable,), timeout=120)
    for rank, (it, exact, rng, step, source) in enumerate(out):
        assert (it, exact, source) == (30, True, "persistent")
        assert rng == {"seed": rank * 7 + 30} and step == 30


@pytest.mark.multiprocess
def test_memory_wins_when_it_is_as_new_as_the_persistent_tier(tmp_root):
    durable = str(tmp_root / "durable")
    run_ranks(_save, 2, tmp_root, ranks_per_node=1, args=(durable,), timeout=120)
    out = run_ranks(_load, 2, tmp_root, ranks_per_node=1, args=(durable,), timeout=120)
    assert [(o[0], o[1], o[4]) for o in out] == [(30, True, "local"), (30, True, "local")]


def test_train_state_flush_loads_with_plain_torch_dcp(tmp_path):
    """A user without resilient_ckpt reads the flushed model with torch's own dcp.load."""
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt import CheckpointManager, TrainState

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    opt = torch.optim.Adam(model.parameters())
    model(torch.randn(3, 6)).sum().backward()
    opt.step()
    m = CheckpointManager(
        "plain", store_root=str(tmp_path / "store"), persistent_dir=str(tmp_path / "durable")
    )
    m.save_local(TrainState(model, opt).sharded_state_dict(), 7).wait()
    m.flush().wait()
    m.close()
    (ckpt,) = [p for p in (tmp_path / "durable").iterdir() if p.name.startswith("iter_")]

    fresh = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 2))
    target = {"model": fresh.state_dict()}
    dcp.load(target, checkpoint_id=str(ckpt))
    for name, t in model.state_dict().items():
        assert torch.equal(target["model"][name], t), name
