"""The same Megatron sharded state dict through Megatron-core's MCoreTensorAwareStateDict and
ours: equal restored state dicts (bit-exact), and ours at least as balanced.

Megatron-core 0.16's fully parallel ``to_state_dict`` exchanges shards through CUDA
unconditionally (``tensor.cuda()``, ``ShardedTensor.init_data("cuda")``,
``torch.empty_like(..., device="cuda")``, ``torch.cuda.synchronize()``). Only in this test's
rank processes, and only for Megatron's load, those calls are monkeypatched to stay on the CPU;
our class runs unpatched.
"""

import contextlib
import math
import warnings

import pytest
import torch

from harness import run_ranks
from test_tensor_aware_state_dict import dp_group, megatron_like, plain_values, same


@contextlib.contextmanager
def _megatron_cuda_calls_on_cpu():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor as McoreShardedTensor

    def cpu(device):
        return "cpu" if device is not None and torch.device(device).type == "cuda" else device

    real = (torch.Tensor.cuda, torch.cuda.synchronize, torch.empty_like, McoreShardedTensor.init_data)
    real_empty_like, real_init = real[2], real[3]
    torch.Tensor.cuda = lambda self, *a, **k: self
    torch.cuda.synchronize = lambda *a, **k: None
    torch.empty_like = lambda t, *a, device=None, **k: real_empty_like(t, *a, device=cpu(device), **k)
    McoreShardedTensor.init_data = lambda self, device, *a, **k: real_init(self, cpu(device), *a, **k)
    try:
        yield
    finally:
        torch.Tensor.cuda, torch.cuda.synchronize, torch.empty_like, McoreShardedTensor.init_data = real


def _both_rank(ctx, tp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
            MCoreTensorAwareStateDict as Theirs,
        )

    from resilient_ckpt.parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict as Ours

    r, w = ctx.rank, ctx.world_size
    group = dp_group(ctx, tp)

    def layout(empty=False):
        # Megatron's own objects, no list mixing tensors and values (Megatron cannot load those).
        return megatron_like(r, w, tp, step=3, empty=empty, use_mcore=True, mixed=False)

    results = {}
    for name, cls in (("ours", Ours), ("theirs", Theirs)):
        tasd, distribution = cls.from_state_dict(layout(), parallelization_group=group)
        saved = sum(t.nbytes for t in tasd.tensors)
        tasd.insert_tensors(tasd.pop_tensors())
        guard = _megatron_cuda_calls_on_cpu() if name == "theirs" else contextlib.nullcontext()
        with guard:
            out = tasd.to_state_dict(layout(empty=True), algo="fully_parallel", parallelization_group=group)
        if name == "ours":
            per_rank = list(distribution.rank_bytes)
        else:
            main_rank, _, metadata, _ = distribution
            per_rank = [0] * (w // tp)
            for sid, rank in main_rank.items():
                per_rank[rank] += math.prod(metadata[sid].local_shape) * metadata[sid].dtype.itemsize
        results[name] = (out, saved, per_rank)
    expected = plain_values(layout())
    ours, theirs = results["ours"], results["theirs"]
    return (same(ours[0], theirs[0]), same(ours[0], expected), ours[1], theirs[1], ours[2], theirs[2])


@pytest.mark.multiprocess
def test_megatron_and_ours_restore_the_same_state_dict_and_ours_is_as_balanced(tmp_root):
    out = run_ranks(_both_rank, 4, tmp_root, args=(2,), timeout=150)
    for rank, (vs_megatron, vs_expected, _ours_saved, _theirs_saved, ours_bytes, theirs_bytes) in enumerate(
        out
    ):
        assert vs_megatron == "", f"rank {rank}: {vs_megatron}"
        assert vs_expected == "", f"rank {rank}: {vs_expected}"
        assert sum(ours_bytes) == sum(theirs_bytes), "both save each shard of the group once"
        assert max(ours_bytes) <= max(theirs_bytes), (ours_bytes, theirs_bytes)
    # What each rank actually kept matches the distribution it computed.
    for a, b in ((0, 2), (1, 3)):
        assert [out[a][2], out[b][2]] == out[a][4]
        assert [out[a][3], out[b][3]] == out[a][5]


def _megatron_lm_local_ckpt_rank(ctx, tp):
    """What Megatron-LM does with --non-persistent-ckpt-type local, our manager in place of
    nvidia-resiliency-ext's LocalCheckpointManager: Megatron-core builds the state dict, the
    manager saves / finds / loads it, Megatron-LM calls to_state_dict on what load() returns."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import (
            MCoreTensorAwareStateDict as Theirs,
        )
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    r, w = ctx.rank, ctx.world_size
    group = dp_group(ctx, tp)

    def layout(empty=False):
        return megatron_like(r, w, tp, step=3, empty=empty, use_mcore=True, mixed=False)

    manager = CheckpointManager("megatron-lm", store_root=ctx.store_root, parallelization_group=group)
    tasd, _ = Theirs.from_state_dict(layout(), parallelization_group=group)
    assert manager.save(tasd, 3, is_async=False) is None
    assert manager.find_latest() == 3
    loaded, ckpt_id = manager.load()
    out = loaded.to_state_dict(layout(empty=True), algo="fully_parallel", parallelization_group=group)
    manager.close()
    return same(out, plain_values(layout())), ckpt_id  # same(): "" when equal, else the difference


@pytest.mark.multiprocess
def test_megatron_lm_local_checkpointing_works_with_our_manager(tmp_root):
    out = run_ranks(_megatron_lm_local_ckpt_rank, 4, tmp_root, ranks_per_node=2, args=(2,), timeout=120)
    assert [o[0] for o in out] == [""] * 4, out
    assert [o[1][:2] for o in out] == [(3, r) for r in range(4)]
