"""Where ours deliberately differs from the reference, both behaviours pinned side by side.

The ported upstream tests (test_nvrx_*, test_mcore_*) take ours through the same scenarios
as the reference; where the reference's behaviour is what ours deliberately does differently,
the difference is pinned here, for both implementations, so neither side can drift unnoticed.
docs/upstream-tests.md lists each difference and why.
"""

import logging
from pathlib import Path

import pytest
import torch.distributed as dist

from upstream.support import IMPLS, SimpleTensorAwareStateDict, make_manager, ours_files

pytestmark = pytest.mark.multiprocess


# ---- 1. an opaque TensorAwareStateDict is only pickled when allowed --------------------------


def _opaque_state_dict(ctx, impl):
    mgr = make_manager(impl, ctx.tmp / "root")  # as upstream builds it: no extra options
    sd = SimpleTensorAwareStateDict(iteration=1, tensor_num=4)
    if impl == "reference":
        assert mgr.save(sd, 1, False) is None  # torch.save: unpickling it later runs code
        assert mgr.find_latest() == 1
        return
    from resilient_ckpt.errors import CodecError

    with pytest.raises(CodecError, match="allow_pickle=True"):
        mgr.save(sd, 1, False)
    assert not any(ours_files(ctx.tmp / "root", 1, r) for r in range(dist.get_world_size()))
    assert mgr.find_latest() == -1
    # opted in, it is stored (what the ported nvrx tests use)
    mgr = make_manager(impl, ctx.tmp / "root", opaque=True)
    assert mgr.save(sd, 1, False) is None
    assert mgr.find_latest() == 1


@pytest.mark.parametrize("impl", IMPLS)
def test_an_opaque_state_dict_is_pickled_only_when_allowed(pool, impl):
    pool.run(_opaque_state_dict, impl)


# ---- 2. a file named like a checkpoint is not a checkpoint -----------------------------------


def _empty_files(ctx, impl):
    mgr = make_manager(impl, ctx.tmp / "root", opaque=True)
    rank = dist.get_rank()
    if impl == "reference":
        d = Path(mgr.local_ckpt_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / mgr._filename_from_template(10, rank)).touch()
        dist.barrier()
        assert mgr.find_latest() == 10  # two empty files make a "complete" checkpoint
        return
    from resilient_ckpt.memory.layout import CheckpointId

    d = Path(mgr.local_ckpt_dir)
    d.mkdir(parents=True, exist_ok=True)
    for ext in ("hdr", "data"):
        (d / f"{CheckpointId(10, rank, '').stem()}.{ext}").touch()
    dist.barrier()
    assert mgr.find_latest() == -1  # headers are parsed and checked: empty files are not checkpoints


@pytest.mark.parametrize("impl", IMPLS)
def test_an_empty_file_named_like_a_checkpoint_is_not_a_checkpoint(pool, impl):
    pool.run(_empty_files, impl)


# ---- 3. no replica on the owner's own node ---------------------------------------------------


def _mcore_tasd():
    """A small Megatron-core MCoreTensorAwareStateDict (what Megatron-LM hands the manager)."""
    import torch
    from megatron.core.dist_checkpointing import ShardedTensor
    from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    r, w = dist.get_rank(), dist.get_world_size()
    sd = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(4.0) + r, (0, r, w), replica_id=0), "it": 1}
    return MCoreTensorAwareStateDict.from_state_dict(sd, algo="atomic")[0]


def _same_node_replication(ctx, impl):
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    # both ranks on one node (one root, LOCAL_WORLD_SIZE=2), as the upstream tests run them
    strategy = CliqueReplicationStrategy.from_replication_params(replication_jump=1, replication_factor=2)
    root = ctx.tmp / "root"
    with ctx.caplog.at_level(logging.WARNING):
        mgr = make_manager(impl, root, repl_strategy=strategy)
        mgr.save(_mcore_tasd(), 1, False)
    dist.barrier()
    assert mgr.find_latest() == 1
    world = dist.get_world_size()
    if impl == "reference":
        # every rank's directory holds every rank's checkpoint: one copy per rank, one machine
        files = sorted(p.name for p in Path(mgr.local_ckpt_dir).iterdir())
        assert files == [mgr._filename_from_template(1, r) for r in range(world)]
        return
    # the node's store holds each rank's checkpoint once; the skipped copy is said
    for owner in range(world):
        assert sorted(p.suffix for p in ours_files(root, 1, owner)) == [".data", ".hdr"]
    assert "no copy is made" in ctx.caplog.text


@pytest.mark.parametrize("impl", IMPLS)
def test_no_replica_on_the_owners_own_node(pool, impl):
    pool.run(_same_node_replication, impl)
