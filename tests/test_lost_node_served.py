"""A lost node's ranks get their shards served by the replica holders in the load exchange."""

import shutil
from pathlib import Path

import pytest
import torch

from harness import node_store_root, run_ranks
from resilient_ckpt.model.mapping import ShardedTensor


def _state(rank, world, it, empty=False):
    g = torch.Generator().manual_seed(100 * it + rank)
    own = torch.randn(64, 32, generator=g)
    rep = torch.arange(4096, dtype=torch.float32) * (it + 1)
    if empty:
        own, rep = torch.zeros_like(own), torch.zeros_like(rep)
    return {
        "own": ShardedTensor.from_rank_offsets("own", own, (0, rank, world)),
        "rep": ShardedTensor.from_rank_offsets("rep", rep, replica_id=rank),
        "it": it,
    }


def _save(ctx):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    m = CheckpointManager("served", store_root=ctx.store_root, ranks_per_node=1, replication_factor=3)
    m.save_local(_state(ctx.rank, ctx.world_size, 5), 5).wait()
    m.close()


def _load(ctx):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    m = CheckpointManager("served", store_root=ctx.store_root, ranks_per_node=1, replication_factor=3)
    template = _state(ctx.rank, ctx.world_size, 0, empty=True)
    state, it = m.load_local(template)
    ref = _state(ctx.rank, ctx.world_size, 5)
    exact = torch.equal(state["own"], ref["own"].data) and torch.equal(state["rep"], ref["rep"].data)
    in_place = state["own"] is template["own"].data
    mm = m.last_load_metrics
    return it, exact, in_place, mm.source, mm.source_rank, [tuple(c) for c in mm.failed_copies]


@pytest.mark.multiprocess
def test_lost_rank_is_served_by_an_intact_replica_when_another_is_corrupt(tmp_root):
    run_ranks(_save, 3, tmp_root, ranks_per_node=1, timeout=90)
    shutil.rmtree(node_store_root(str(tmp_root), 0))  # node 0 lost with its memory
    # Node 1's replica of rank 0 has a flipped byte.
    (data,) = Path(node_store_root(str(tmp_root), 1), "served").glob("iter_*.owner_000000.data")
    with open(data, "r+b") as f:
        b = bytearray(f.read(1))
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    out = run_ranks(_load, 3, tmp_root, ranks_per_node=1, timeout=90)
    it, exact, in_place, source, source_rank, failed = out[0]
    assert (it, exact, in_place, source) == (5, True, True, "peer")
    assert source_rank == 2 and (1, 0) in failed, "the corrupt copy on node 1 was skipped"
    assert all(o[1] for o in out), "every rank restored bit-exactly"


def _save2(ctx):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    m = CheckpointManager("local-replica", store_root=ctx.store_root, ranks_per_node=1)
    m.save_local(_state(ctx.rank, ctx.world_size, 6), 6).wait()
    m.close()


def _load2(ctx):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    m = CheckpointManager("local-replica", store_root=ctx.store_root, ranks_per_node=1)
    state, it = m.load_local(_state(ctx.rank, ctx.world_size, 0, empty=True))
    ref = _state(ctx.rank, ctx.world_size, 6)
    return it, torch.equal(state["own"], ref["own"].data) and torch.equal(state["rep"], ref["rep"].data)


@pytest.mark.multiprocess
def test_replicated_shards_read_from_a_local_replica_fall_back_to_the_network_when_corrupt(tmp_root):
    """Rank 0 reads the data-parallel shard rank 1 saved from node 0's replica of rank 1; when
    that replica's bytes are damaged, the shard comes from rank 1 instead — still bit-exact."""
    run_ranks(_save2, 2, tmp_root, ranks_per_node=1, timeout=90)
    (data,) = Path(node_store_root(str(tmp_root), 0), "local-replica").glob("iter_*.owner_000001.data")
    size = data.stat().st_size
    with open(data, "r+b") as f:  # damage every tensor of the replica
        for off in range(0, size, 4096):
            f.seek(off)
            b = f.read(1)
            f.seek(off)
            f.write(bytes([b[0] ^ 0x5A]))
    out = run_ranks(_load2, 2, tmp_root, ranks_per_node=1, timeout=90)
    assert out == [(6, True), (6, True)]
