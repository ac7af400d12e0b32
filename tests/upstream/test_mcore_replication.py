# Copyright (c) 2024, NVIDIA CORPORATION. All rights reserved.
#
# Ported to CPU/gloo from Megatron-LM core_v0.16.1
# tests/unit_tests/dist_checkpointing/test_replication.py (BSD-3-Clause, see Megatron-LM's
# LICENSE). What changed:
# - each test body runs on the 2 gloo ranks of the shared pool (upstream: 8 GPUs, NCCL) and is
#   parametrized over ``impl`` (the LocalCheckpointManager under test: nvrx's or ours, handed
#   the same CliqueReplicationStrategy / GroupWrapper objects and the same Megatron-core
#   MCoreTensorAwareStateDict);
# - (tp, pp) = (2, 4) needs 8 ranks: on 2 ranks it becomes (2, 1); (1, 1) stays;
# - replication groups on 8 ranks ([[0, 1], [2, 3], [4, 5], [6, 7]] and
#   [[2, 6, 7], [3, 1], [5], [0, 4]], breaking ranks 6, 3, 4) become on 2 ranks [[0, 1]]
#   breaking rank 1, and [[1, 0]] (a group listed out of rank order) breaking rank 0: in both,
#   as upstream, every broken rank has a peer that holds its replica;
# - test_all_gather_batch: tensors on the CPU; its group is both ranks (upstream: 3 of 8) and it
#   gathers two batches, [[t1, t2], [t0]] and [[t0], []] (upstream: [[t1, t2], [t0], []]);
# - megatron.training's save_checkpoint / load_checkpoint are the port in
#   upstream/megatron_training.py (``mt``), patched as upstream patches megatron.training;
# - the file checks: upstream lists the rank's directory (``local_ckpt_dir``) and empties it
#   ("break"); the ours branch asks our store which checkpoints that directory holds and
#   empties ours' ``local_ckpt_dir`` (the node's store directory of the session);
# - the upstream test models every rank as its own failure domain (the reference keeps a
#   private directory per rank, the test wipes one), so ours gets a store root per rank and
#   LOCAL_WORLD_SIZE=1 (a node per rank): ours never copies a checkpoint to another rank of the
#   same node (D3 in docs/upstream-tests.md, pinned in test_deliberate.py);
# - ``tmp_dir_per_class`` is a fresh directory per case.

import os
from contextlib import contextmanager
from pathlib import Path
from shutil import rmtree
from unittest import mock

import pytest
import torch
import torch.distributed as dist

from upstream import megatron_training as mt
from upstream.megatron_training import (
    init_basic_mock_args,
    init_checkpointing_mock_args,
    load_checkpoint,
    maybe_finalize_async_save,
    parse_args,
    save_checkpoint,
    setup_model_and_optimizer,
)
from upstream.support import IMPLS, Utils, make_manager, ours_files

pytestmark = pytest.mark.multiprocess


def equal_(a, b):
    def bool_generator():
        if isinstance(a, list):
            yield isinstance(b, list)
            yield len(a) == len(b)
            yield all(equal_(aa, bb) for aa, bb in zip(a, b))
        elif isinstance(a, torch.Tensor):
            yield isinstance(b, torch.Tensor)
            yield torch.equal(a, b)
        else:
            yield a == b

    return all(bool_generator())


def _all_gather_batch(ctx, impl, tp, pp):
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper

    Utils.initialize_model_parallel(tp, pp)
    t0 = torch.arange(4, device="cpu").reshape((2, 2))
    t1 = torch.arange(6, device="cpu").reshape((3, 1, 2))
    t2 = torch.arange(12, device="cpu").reshape((2, 3, 2))
    test_ranks = [0, 1]
    test_group = GroupWrapper(dist.new_group(test_ranks))
    rank = dist.get_rank()
    if rank not in test_ranks:
        dist.barrier()
        return
    for batch in ([[t1, t2], [t0]], [[t0], []]):
        pred_batch = test_group.all_gather_batch(batch[test_group.my_group_rank])
        assert equal_(batch, pred_batch)
    dist.barrier()
    Utils.destroy_model_parallel()


@pytest.mark.parametrize("impl", IMPLS)
# (tp, pp) varies slowest: cases with the same sizes share Megatron's model-parallel state
@pytest.mark.parametrize(("tp,pp"), [(2, 1), (1, 1)])
def test_all_gather_batch(pool, impl, tp, pp):
    """The same body for both: the code under test is nvrx's GroupWrapper, which a
    CliqueReplicationStrategy handed to either manager carries."""
    pool.run(_all_gather_batch, impl, tp, pp)


# ---- TestLocalCheckpointingReplication ------------------------------------------------------


class _Case:
    """The upstream test class's state (``self``) for one parametrization."""

    @contextmanager
    def post_init(self, root_tmp_dir, impl, tp, pp, async_save, algo, repl_groups):
        from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import GroupWrapper
        from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

        Utils.initialize_model_parallel(tp, pp)

        mock_args = parse_args(ignore_unknown_args=True)
        with (
            mock.patch.object(mt, "get_args", new=lambda: mock_args),
            mock.patch.object(mt, "update_num_microbatches"),
            _own_node_per_rank(impl),
        ):
            self.local_ckpt_dir = root_tmp_dir / "subdir"  # Test handling of non-existent directories
            if impl == "ours":  # a node (store root) per rank, see the header
                self.local_ckpt_dir = self.local_ckpt_dir / f"node{dist.get_rank()}"
            init_basic_mock_args(mock_args, tp, pp)
            init_checkpointing_mock_args(mock_args, None)
            mock_args.non_persistent_ckpt_type = "local"
            mock_args.non_persistent_local_ckpt_algo = algo
            mock_args.async_save = async_save
            mock_args.ckpt_fully_parallel_save = True  # ensure proper sharding_type is set
            repl_groups_init = [dist.new_group(g) for g in repl_groups]
            my_process_group = GroupWrapper.from_list_of_groups(repl_groups_init)
            repl_strategy = CliqueReplicationStrategy(my_process_group, target_device="cpu")
            self.checkpointing_context = {
                "local_checkpoint_manager": make_manager(
                    impl, self.local_ckpt_dir, repl_strategy=repl_strategy
                )
            }
            if impl == "reference":
                self.local_ckpt_dir /= str(dist.get_rank())
            else:  # the directory the manager keeps this rank's checkpoints in, as upstream
                self.local_ckpt_dir = Path(
                    self.checkpointing_context["local_checkpoint_manager"].local_ckpt_dir
                )
            yield
        Utils.destroy_model_parallel()


@contextmanager
def _own_node_per_rank(impl):
    if impl != "ours":
        yield
        return
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "1"}):
        yield


def _ours_held(local_ckpt_dir: Path, world_size: int):
    """Names (upstream's spelling) of the checkpoints this rank's node holds in our store."""
    return {
        f"iter_0000001_{owner}_local.pt"
        for owner in range(world_size)
        if any(p.suffix == ".hdr" for p in ours_files(local_ckpt_dir, 1, owner))
    }


def _repl_save_and_load(ctx, impl, tp, pp, async_save, algo, repl_groups, ranks_to_break):
    self = _Case()
    tmp_dir_per_class = ctx.tmp
    with self.post_init(tmp_dir_per_class, impl, tp, pp, async_save, algo, repl_groups):
        num_floating_point_operations_so_far = 0
        model, optimizer = setup_model_and_optimizer(1, tp, pp)
        opt_param_scheduler = None

        save_checkpoint(
            1,
            model,
            optimizer,
            opt_param_scheduler,
            num_floating_point_operations_so_far,
            checkpointing_context=self.checkpointing_context,
            non_persistent_ckpt=True,
        )
        if async_save:
            maybe_finalize_async_save(True)

        my_group = [group for group in repl_groups if dist.get_rank() in group][0]
        if impl == "reference":
            held = {f.name for f in self.local_ckpt_dir.rglob("*")}
        else:
            held = _ours_held(self.local_ckpt_dir, dist.get_world_size())
        assert {f"iter_0000001_{rank}_local.pt" for rank in my_group} == held
    with self.post_init(tmp_dir_per_class, impl, tp, pp, async_save, algo, repl_groups):
        if dist.get_rank() in ranks_to_break:  # ours: the node's store directory is emptied
            rmtree(self.local_ckpt_dir)
            os.makedirs(self.local_ckpt_dir)

        model, optimizer = setup_model_and_optimizer(2, tp, pp)
        opt_param_scheduler = None

        iteration, _ = load_checkpoint(
            model,
            optimizer,
            opt_param_scheduler,
            checkpointing_context=self.checkpointing_context,
        )
        assert iteration == 1
    # Perform cleanup to ensure no side effects on subsequent tests
    torch.distributed.barrier()
    rmtree(self.local_ckpt_dir)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("async_save"), [True, False])
@pytest.mark.parametrize(("algo"), ["atomic", "fully_parallel"])
@pytest.mark.parametrize(("repl_groups", "ranks_to_break"), [([[0, 1]], [1]), ([[1, 0]], [0])])
# (tp, pp) varies slowest: cases with the same sizes share Megatron's model-parallel state
@pytest.mark.parametrize(("tp,pp"), [(2, 1), (1, 1)])
def test_repl_save_and_load(pool, impl, tp, pp, async_save, algo, repl_groups, ranks_to_break):
    pool.run(_repl_save_and_load, impl, tp, pp, async_save, algo, repl_groups, ranks_to_break)
