"""Rank-side support shared by the ported upstream tests: which implementation, CPU patches,
the upstream test utilities they import (ported), and file-layout helpers for both stores.

Implementations (every ported test is parametrized over ``impl``):

* ``reference``: nvidia-resiliency-ext 0.4.1's
  ``nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager.LocalCheckpointManager``
  (and for the state-dict tests, Megatron-core 0.16.1's ``MCoreTensorAwareStateDict``);
* ``ours``: ``resilient_ckpt.LocalCheckpointManager`` (same constructor), handed the very same
  state dict and replication-strategy objects (and ``resilient_ckpt.MCoreTensorAwareStateDict``
  for the state-dict tests).

CPU adaptations made here, once per rank process (:func:`worker_setup`):

* ``resilient_ckpt.bench.baseline.apply_cpu_patches()`` (``torch.cuda.synchronize`` no-op; CUDA
  placement -> CPU inside nvrx ``GroupWrapper`` send/recv and Megatron-core's
  ``exchange_by_distribution``);
* ``torch.cuda.current_device()`` returns ``torch.device("cpu")``: the async call queues of
  nvrx and Megatron-core put their 1-element all-reduces (call-index check, "is any call still
  alive") on ``torch.cuda.current_device()``, and Megatron-core's DDP allocates its parameter and
  gradient buffers there.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
import weakref
from pathlib import Path
from shutil import rmtree
from tempfile import TemporaryDirectory
from typing import Callable, List, Optional, Union

import torch
from nvidia_resiliency_ext.checkpointing.local.base_state_dict import TensorAwareStateDict

IMPLS = ("reference", "ours")

_PATCHED = False


def worker_setup(rank: int, world_size: int) -> None:
    """Once per rank process: imports (so a case does not pay them), CPU patches, Utils."""
    global _PATCHED
    warnings.filterwarnings("ignore")
    Utils.rank, Utils.world_size = rank, world_size
    if not _PATCHED:
        from resilient_ckpt.bench.baseline import apply_cpu_patches

        apply_cpu_patches()
        torch.cuda.current_device = _cpu_device
        _PATCHED = True
    # Megatron-core and nvrx are imported by the patches above; Megatron's model/optimizer
    # stack once more here, so the first Megatron case does not pay ~1 s.
    import megatron.core.models.gpt  # noqa: F401
    import megatron.core.models.gpt.gpt_layer_specs  # noqa: F401
    import megatron.core.optimizer  # noqa: F401

    logging.getLogger("nvidia_resiliency_ext").setLevel(logging.NOTSET)


def _cpu_device() -> torch.device:
    return torch.device("cpu")


def worker_teardown(ok: bool) -> bool:
    """After every case, on every rank; True: the process groups may serve the next case.

    ``ok=False`` (the case failed here, or the pool is about to destroy the world): forget
    Megatron's model-parallel state, whose groups die with the world. Groups a passing case
    created and left (test_replication's, test_all_gather_batch's) stay until the world is
    destroyed; past a few of them, it is.
    """
    import sys

    mt = sys.modules.get("upstream.megatron_training")
    if mt is not None:
        mt.reset_async_queue()
    for name in ("nvidia_resiliency_ext", "megatron", "resilient_ckpt"):
        logging.getLogger(name).setLevel(logging.NOTSET)
    if ok and _stray_groups() <= _MAX_STRAY_GROUPS:
        Utils.inited = False
        return True
    Utils.forget_model_parallel()
    return False


_MAX_STRAY_GROUPS = 48


def _stray_groups() -> int:
    """Process groups alive besides the default one and Megatron's cached ones."""
    from torch.distributed import distributed_c10d as c10d

    return len(c10d._world.pg_map) - 1 - len(Utils._mp_groups)


# ---- the implementations ---------------------------------------------------------------------


def manager_cls(impl: str):
    if impl == "reference":
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )

        return LocalCheckpointManager
    if impl == "ours":
        import resilient_ckpt

        return resilient_ckpt.LocalCheckpointManager
    raise ValueError(impl)


def make_manager(impl: str, root_local_ckpt_dir, session_id: str = "", repl_strategy=None, opaque=False):
    """The manager under test, built as upstream builds it.

    ``opaque``: the test saves nvrx's test ``SimpleTensorAwareStateDict`` (a TensorAwareStateDict
    that only pickling can store). Ours refuses pickle unless told (deliberate, see
    docs/upstream-tests.md and test_deliberate.py), so such tests build ours with
    ``allow_pickle=True``; the reference always pickles.
    """
    kwargs = {"allow_pickle": True} if opaque and impl == "ours" else {}
    return manager_cls(impl)(
        root_local_ckpt_dir, session_id=session_id, repl_strategy=repl_strategy, **kwargs
    )


def tasd_cls(impl: str):
    """The MCoreTensorAwareStateDict under test in the state-dict tests (test_strict and
    test_local's test_sharded_tensors)."""
    if impl == "reference":
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

        return MCoreTensorAwareStateDict
    if impl == "ours":
        import resilient_ckpt

        return resilient_ckpt.MCoreTensorAwareStateDict
    raise ValueError(impl)


# ---- where a rank's checkpoint lives --------------------------------------------------------
#
# The reference keeps ``{root}/{session}/{rank}/iter_{iteration:07d}_{owner}_local.pt``; ours a
# header and a data segment per checkpoint, ``iter_{iteration:020d}.owner_{owner:06d}.{hdr,data}``
# (named by resilient_ckpt/memory/layout.py, kept by store.py), with the header published
# last: a checkpoint exists iff its header does. The helpers below answer the tests' file
# questions for either layout.


def ours_files(root, iteration: int, owner: int) -> List[Path]:
    """Our store's files (header and data) of checkpoint (iteration, owner) under ``root``."""
    from resilient_ckpt.memory.layout import CheckpointId

    stem = CheckpointId(iteration, owner, "").stem()
    return sorted(p for p in Path(root).rglob(stem + ".*") if p.suffix in (".hdr", ".data"))


def ours_header(root, iteration: int, owner: int) -> Optional[Path]:
    hdrs = [p for p in ours_files(root, iteration, owner) if p.suffix == ".hdr"]
    assert len(hdrs) <= 1, hdrs
    return hdrs[0] if hdrs else None


def ckpt_exists(impl: str, mgr, iteration: int, owner: Optional[int] = None) -> bool:
    """Whether this node holds checkpoint (iteration, owner) (owner: this rank by default)."""
    owner = torch.distributed.get_rank() if owner is None else owner
    if impl == "reference":
        ckpt_id = (iteration, owner, mgr.session_id)
        return mgr._local_ckpt_path_from_id(ckpt_id).exists()
    return ours_header(mgr.root_local_ckpt_dir, iteration, owner) is not None


def gone_soon(exists: Callable[[], bool], timeout_s: float = 30.0) -> bool:
    """Whether what ``exists`` checks is gone within ``timeout_s``: the reference removes old
    checkpoints in a cleanup process of its own, so upstream's fixed sleeps (10-800 ms) before
    asserting it are a race on a loaded machine. Polled; True at once when already gone."""
    deadline = time.monotonic() + timeout_s
    while exists():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def remove_ckpt(impl: str, mgr, iteration: int, owner: Optional[int] = None) -> None:
    """Lose checkpoint (iteration, owner) on this node, as a crash or a wiped disk would."""
    owner = torch.distributed.get_rank() if owner is None else owner
    if impl == "reference":
        os.remove(mgr._local_ckpt_path_from_id((iteration, owner, mgr.session_id)))
        return
    files = ours_files(mgr.root_local_ckpt_dir, iteration, owner)
    assert files, f"no stored files of iteration {iteration}, owner {owner}"
    for p in files:
        p.unlink()


# ---- ported from nvidia-resiliency-ext v0.4.1 tests/checkpointing/unit/ ----------------------
# (test_utilities.py and __init__.py; Apache-2.0, header below)
#
# SPDX-FileCopyrightText: Copyright (c) 2024 NVIDIA CORPORATION & AFFILIATES. All rights reserved.
# SPDX-License-Identifier: Apache-2.0
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
# http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.
#
# Ported to CPU/gloo: ``Utils`` no longer initialises torch.distributed (the pool provides the
# gloo group) and takes rank/world size from the pool; ``initialize_model_parallel`` /
# ``destroy_model_parallel`` are those of Megatron-LM's tests/unit_tests/test_utilities.py (same
# class name there), with the model-parallel state kept for the next case of the same sizes.
# ``SimpleTensorAwareStateDict`` creates its tensors on the CPU, ``restore_tensor_device`` moves
# them back to the CPU instead of "cuda", and it holds 100 tensors of 128x128 by default instead
# of 1000 (6.4 MiB instead of 64 MiB per save: the suite runs on 2 CPU cores).


class Utils:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    inited = False
    # CPU/gloo port: Megatron's model-parallel state of the last case, kept for the next case
    # with the same sizes (worker_teardown): making and destroying its ~15 gloo groups per
    # case would cost ~0.3 s each time.
    _mp_key = None
    _mp_groups: list = []

    @staticmethod
    def initialize_distributed():
        assert torch.distributed.is_initialized(), "the pool initialises a gloo group per case"
        Utils.inited = True

    @staticmethod
    def initialize_model_parallel(
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        virtual_pipeline_model_parallel_size=None,
        **kwargs,
    ):
        import megatron.core.parallel_state as ps
        from torch.distributed import distributed_c10d as c10d

        key = (
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            tuple(sorted(kwargs.items())),
        )
        Utils.initialize_distributed()
        if key == Utils._mp_key and ps.model_parallel_is_initialized():
            return  # the same state as the last case's
        Utils.forget_model_parallel(destroy_groups=True)
        before = set(c10d._world.pg_map)
        ps.initialize_model_parallel(
            tensor_model_parallel_size,
            pipeline_model_parallel_size,
            virtual_pipeline_model_parallel_size,
            **kwargs,
        )
        Utils._mp_groups = [g for g in c10d._world.pg_map if g not in before]
        Utils._mp_key = key
        Utils.inited = True

    @staticmethod
    def destroy_model_parallel():
        if not Utils.inited:
            return
        torch.distributed.barrier()
        # CPU/gloo port: ps.destroy_model_parallel() is left to the next case with other sizes
        # (or to a failure); see _mp_key
        Utils.inited = False

    @staticmethod
    def forget_model_parallel(destroy_groups: bool = False):
        import sys

        ps = sys.modules.get("megatron.core.parallel_state")
        if ps is not None:
            ps.destroy_model_parallel()
        if destroy_groups and torch.distributed.is_initialized():
            from torch.distributed import distributed_c10d as c10d

            for g in Utils._mp_groups:
                if g in c10d._world.pg_map:  # Megatron may have destroyed some itself
                    torch.distributed.destroy_process_group(g)
        Utils._mp_key, Utils._mp_groups = None, []
        Utils.inited = False


def empty_dir(path: Path):
    if Utils.rank > 0:
        return
    for p in path.iterdir():
        if p.is_dir():
            rmtree(p)
        else:
            p.unlink()


class TempNamedDir(TemporaryDirectory):
    """TemporaryDirectory with a fully named directory. Empties the dir if not empty."""

    def __init__(self, name: Union[str, Path], sync=True, ignore_cleanup_errors=False) -> None:
        self.name = str(name)
        if Utils.rank == 0:
            os.makedirs(name, exist_ok=True)
            empty_dir(Path(name))
        if sync:
            torch.distributed.barrier()
        else:
            os.makedirs(name, exist_ok=True)

        self._ignore_cleanup_errors = ignore_cleanup_errors
        self._finalizer = weakref.finalize(
            self, self._cleanup, self.name, warn_message="Implicitly cleaning up {!r}".format(self)
        )
        self.sync = sync

    def cleanup(self, override_sync: Optional[bool] = None) -> None:
        sync = self.sync if override_sync is None else override_sync
        if sync:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
        if Utils.rank == 0:
            super().cleanup()

    def __enter__(self):
        path = Path(super().__enter__())
        if self.sync:
            if torch.distributed.is_available() and torch.distributed.is_initialized():
                torch.distributed.barrier()
        return path

    def __exit__(self, exc_type, exc_val, exc_tb):
        raised = exc_type is not None
        if not raised:
            self.cleanup()


class SimpleTensorAwareStateDict(TensorAwareStateDict):
    def __init__(self, iteration, tensor_num=100):  # upstream 1000 (64 MiB per save; 2 CPU cores here)
        self._tensors = [torch.empty((128, 128), device="cpu").random_() for _ in range(tensor_num)]
        self.iteration = iteration

    def pop_tensors(self):
        raise NotImplementedError

    @property
    def tensors(self):
        raise NotImplementedError

    def tensors_to_orig_device(self):
        raise NotImplementedError

    def is_hollow(self) -> bool:
        raise NotImplementedError

    def insert_tensors(self, tensor_data):
        raise NotImplementedError

    def init_tensors(self):
        raise NotImplementedError

    def copy_tensors_to_cpu(self, non_blocking=False):
        for i, ten in enumerate(self._tensors):
            self._tensors[i] = ten.to("cpu")

    def restore_tensor_device(self, non_blocking=False):
        for i, ten in enumerate(self._tensors):
            self._tensors[i] = ten.to("cpu")

    def to_state_dict(self):
        raise NotImplementedError

    def __eq__(self, other):
        if len(self._tensors) != len(other._tensors):
            return False
        for self_ten, other_ten in zip(self._tensors, other._tensors):
            if not torch.equal(self_ten, other_ten):
                return False
        return self.iteration == other.iteration
