# spdx-filecopyrighttext: copyright (c) 2024 nvidia corporation & affiliates. all rights reserved.
# spdx-license-identifier: apache-2.0
#
# licensed under the apache license, version 2.0 (the "license");
# you may not use this file except in compliance with the license.
# you may obtain a copy of the license at
#
# http://www.apache.org/licenses/license-2.0
#
# unless required by applicable law or agreed to in writing, software
# distributed under the license is distributed on an "as is" basis,
# without warranties or conditions of any kind, either express or implied.
# see the license for the specific language governing permissions and
# limitations under the license.
#
# Ported to CPU/gloo from nvidia-resiliency-ext v0.4.1
# tests/checkpointing/unit/test_basic_local.py. What changed:
# - each test body runs on the 2 gloo ranks of the shared pool (upstream: torchrun on every GPU
#   with NCCL) and is parametrized over ``impl`` (reference nvrx manager / ours);
# - ``tmp_path_dist_ckpt`` is a fresh directory per case, and ``use_ramdisk`` uses a fresh
#   directory under /dev/shm instead of /dev/shm itself (concurrent runs must not collide);
# - where upstream reaches into the reference's file layout (``_ckpt_id``,
#   ``_local_ckpt_path_from_id``, ``_filename_from_template``), the ``reference`` branch keeps that
#   code and the ``ours`` branch does the same through our store (support.ckpt_exists /
#   remove_ckpt); see docs/upstream-tests.md;
# - test_find_latest_repl_disable needs world_size >= 2: with 2 ranks, rank 0 holds nothing and
#   rank 1 holds ckpt_0 and ckpt_1, as upstream.

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch.distributed as dist

from upstream.support import (
    IMPLS,
    SimpleTensorAwareStateDict,
    TempNamedDir,
    ckpt_exists,
    gone_soon,
    make_manager,
    remove_ckpt,
)

pytestmark = pytest.mark.multiprocess


def _async_save(async_save_request, async_save):
    if async_save:
        async_save_request.execute_sync()
    else:
        assert async_save_request is None


# ---- test_basic_save_load_scenarios ----------------------------------------------------------


def _basic_save_load_scenarios(ctx, impl, use_ramdisk, async_save):
    tmp_path_dist_ckpt = ctx.tmp
    if use_ramdisk:
        tmp_path_dist_ckpt = ctx.shm
    with TempNamedDir(tmp_path_dist_ckpt / "test_save_load") as local_ckpt_dir:
        local_ckpt_dir = local_ckpt_dir / "subdir"  # Test handling of non-existent directories

        # "Without restart"
        checkpoint_manager = make_manager(impl, local_ckpt_dir, opaque=True)
        intermediete_state_dict = SimpleTensorAwareStateDict(iteration=1)
        # SAVE
        async_save_request = checkpoint_manager.save(intermediete_state_dict, 1, async_save)
        _async_save(async_save_request, async_save)
        # LOAD
        iteration = checkpoint_manager.find_latest()
        assert iteration == 1
        loaded_state_dict, ckpt_id = checkpoint_manager.load()
        intermediete_state_dict.restore_tensor_device()
        assert loaded_state_dict == intermediete_state_dict
        assert ckpt_id == (1, dist.get_rank(), "")

        # "Succesfull load after restart"
        checkpoint_manager = make_manager(impl, local_ckpt_dir, opaque=True)
        # LOAD
        iteration = checkpoint_manager.find_latest()
        assert iteration == 1
        loaded_state_dict, ckpt_id = checkpoint_manager.load()
        assert loaded_state_dict == intermediete_state_dict
        assert ckpt_id == (1, dist.get_rank(), "")

        # "Failed load after restart"
        checkpoint_manager = make_manager(impl, local_ckpt_dir, opaque=True)
        dist.barrier()
        if impl == "reference":
            ckpt_id = checkpoint_manager._ckpt_id(iteration)
            first_ckpt_path = checkpoint_manager._local_ckpt_path_from_id(ckpt_id)
            os.remove(first_ckpt_path)
        else:  # the same loss in our store: this rank's checkpoint files are gone
            remove_ckpt(impl, checkpoint_manager, iteration)
        # LOAD
        iteration = checkpoint_manager.find_latest()
        assert iteration == -1

        # "Multiple saves"
        intermediete_state_dict = SimpleTensorAwareStateDict(iteration=1)
        # SAVE
        async_save_request = checkpoint_manager.save(intermediete_state_dict, 1, async_save)
        _async_save(async_save_request, async_save)
        assert ckpt_exists(impl, checkpoint_manager, 1)
        intermediete_state_dict = SimpleTensorAwareStateDict(iteration=2)
        # SAVE
        async_save_request = checkpoint_manager.save(intermediete_state_dict, 2, async_save)
        _async_save(async_save_request, async_save)
        assert gone_soon(lambda: ckpt_exists(impl, checkpoint_manager, 1))  # upstream: sleep(0.4)
        assert ckpt_exists(impl, checkpoint_manager, 2)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("use_ramdisk"), [True, False])
@pytest.mark.parametrize(("async_save"), [True, False])
def test_basic_save_load_scenarios(pool, impl, use_ramdisk, async_save):
    pool.run(_basic_save_load_scenarios, impl, use_ramdisk, async_save)


# ---- test_find_latest_repl_disable -----------------------------------------------------------


@contextmanager
def find_latest_skeleton(tmp_path_dist_ckpt, extra_suffix, repl_strategy=None):
    with TempNamedDir(name=tmp_path_dist_ckpt / "test_find_latest_disabled_repl") as root_local_ckpt_dir:
        checkpoint_manager = make_manager("reference", root_local_ckpt_dir, repl_strategy=repl_strategy)
        my_local_ckpt_subdir = Path(checkpoint_manager.local_ckpt_dir)
        my_local_ckpt_subdir.mkdir(parents=True, exist_ok=True)

        ckpt_filenames = [
            checkpoint_manager._filename_from_template(10, i, extra_suffix)
            for i in range(dist.get_world_size())
        ]
        ckpt_files = [my_local_ckpt_subdir / filename for filename in ckpt_filenames]

        yield checkpoint_manager, ckpt_files


@contextmanager
def find_latest_skeleton_ours(tmp_path_dist_ckpt, extra_suffix, repl_strategy=None):
    """Ours: the files a rank "holds" are files named like our store's checkpoints (header and
    data of iteration 10, owner i, with the extra suffix after the name), in our store's session
    directory."""
    from resilient_ckpt.memory.layout import CheckpointId

    with TempNamedDir(name=tmp_path_dist_ckpt / "test_find_latest_disabled_repl") as root_local_ckpt_dir:
        checkpoint_manager = make_manager(
            "ours", root_local_ckpt_dir, repl_strategy=repl_strategy, opaque=True
        )
        session_dir = Path(checkpoint_manager.local_ckpt_dir)  # shared by the node's ranks
        session_dir.mkdir(parents=True, exist_ok=True)
        ckpt_files = [
            [session_dir / f"{CheckpointId(10, i, '').stem()}{extra_suffix}.{ext}" for ext in ("hdr", "data")]
            for i in range(dist.get_world_size())
        ]
        yield checkpoint_manager, ckpt_files


def _find_latest_repl_disable(ctx, impl, extra_suffix):
    assert dist.get_world_size() >= 2, f"This test needs world_size >= 2, got {dist.get_world_size()}"
    skeleton = find_latest_skeleton if impl == "reference" else find_latest_skeleton_ours
    with skeleton(ctx.tmp, extra_suffix, repl_strategy=None) as (checkpoint_manager, ckpt_files):
        my_rank = dist.get_rank()
        # rank 0: []
        # rank 1: [ckpt_0, ckpt_1]
        # rank i: [ckpt_i] for i >= 2
        touch = (lambda f: f.touch()) if impl == "reference" else (lambda fs: [f.touch() for f in fs])
        if my_rank == 1:
            touch(ckpt_files[0])
        if my_rank != 0:
            touch(ckpt_files[my_rank])

        assert checkpoint_manager.find_latest() == -1, (
            "It's impossible to retrieve ckpt 0 with replication disabled!"
        )


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("extra_suffix"), ["", "some_suffix", "some suffix with spaces"])
def test_find_latest_repl_disable(pool, impl, extra_suffix):
    pool.run(_find_latest_repl_disable, impl, extra_suffix)
