"""nvidia-resiliency-ext's own LocalCheckpointManager saves, finds and loads our
MCoreTensorAwareStateDict on gloo/CPU, with and without its CliqueReplicationStrategy.

nvrx 0.4.1's synchronous save (``is_async=False``) and local load run on CPU as they are: the
save path only calls ``copy_tensors_to_cpu``/``torch.save``/a barrier, and
``torch.cuda.synchronize`` is reached only with ``is_async=True`` (not covered here). Its
replica-retrieval path (a rank whose own file is gone receives it from a peer) moves tensors
through CUDA unconditionally: ``GroupWrapper.isend_state_dict`` calls ``tensor.cuda()`` and
``irecv_state_dict`` calls ``torch.empty_like(..., device="cuda")``. Only in that test, and only
inside the rank processes, those two calls are monkeypatched to stay on the CPU.
"""

from pathlib import Path

import pytest
import torch

from harness import run_ranks
from test_tensor_aware_state_dict import megatron_like, plain_values, same

SESSION = "interop"


def _keep_cuda_calls_on_cpu(calls):
    """The two CUDA calls of nvrx's replica transfer (see the module docstring); ``calls``
    counts them, which shows the transfer really happened."""

    def cuda(self, *a, **k):
        calls["send"] += 1
        return self

    real_empty_like = torch.empty_like

    def empty_like(t, *a, device=None, **k):
        if device is not None and torch.device(device).type == "cuda":
            calls["recv"] += 1
            device = "cpu"
        return real_empty_like(t, *a, device=device, **k)

    torch.Tensor.cuda = cuda
    torch.empty_like = empty_like


def _nvrx_rank(ctx, replicate, lose_own_copy):
    from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
        LocalCheckpointManager,
    )
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import (
        CliqueReplicationStrategy,
    )

    from resilient_ckpt.parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict as TASD

    r, w = ctx.rank, ctx.world_size

    def manager():
        strategy = None
        if replicate:
            # Every rank's checkpoint is copied to the other rank (another simulated node).
            strategy = CliqueReplicationStrategy.from_replication_params(
                replication_jump=1, replication_factor=w
            )
        return LocalCheckpointManager(ctx.store_root, session_id=SESSION, repl_strategy=strategy)

    mgr = manager()
    tasd, distribution = TASD.from_state_dict(megatron_like(r, w, 1, step=5))
    assert mgr.save(tasd, 5, is_async=False) is None
    # The next save reuses the distribution: no metadata exchange.
    tasd, _ = TASD.from_state_dict(megatron_like(r, w, 1, step=10), cached_metadata=distribution)
    mgr.save(tasd, 10, is_async=False)
    my_dir = Path(ctx.store_root) / SESSION / str(r)
    files = sorted(p.name for p in my_dir.iterdir())
    calls = {"send": 0, "recv": 0}
    if lose_own_copy:
        if r == 1:
            (my_dir / f"iter_{10:07d}_1_local.pt").unlink()
        _keep_cuda_calls_on_cpu(calls)

    restarted = manager()  # a fresh manager, as after a restart
    latest = restarted.find_latest()
    loaded, ckpt_id = restarted.load()
    out = loaded.to_state_dict(megatron_like(r, w, 1, empty=True), algo="fully_parallel")
    return latest, ckpt_id, files, same(out, plain_values(megatron_like(r, w, 1, step=10))), calls


@pytest.mark.multiprocess
def test_local_checkpoint_manager_saves_finds_and_loads_our_state_dict(tmp_root):
    out = run_ranks(_nvrx_rank, 2, tmp_root, args=(False, False), ranks_per_node=1, timeout=120)
    for rank, (latest, ckpt_id, files, diff, _) in enumerate(out):
        assert latest == 10 and ckpt_id == (10, rank, SESSION)
        assert files == [f"iter_0000010_{rank}_local.pt"], "iteration 5 was cleaned up"
        assert diff == "", diff


@pytest.mark.multiprocess
def test_clique_replication_keeps_each_ranks_checkpoint_on_the_other_node(tmp_root):
    out = run_ranks(_nvrx_rank, 2, tmp_root, args=(True, False), ranks_per_node=1, timeout=120)
    for rank, (latest, ckpt_id, files, diff, _) in enumerate(out):
        assert latest == 10 and ckpt_id == (10, rank, SESSION)
        assert files == ["iter_0000010_0_local.pt", "iter_0000010_1_local.pt"]
        assert diff == "", diff


@pytest.mark.multiprocess
def test_a_rank_that_lost_its_file_loads_the_replica_from_its_peer(tmp_root):
    out = run_ranks(_nvrx_rank, 2, tmp_root, args=(True, True), ranks_per_node=1, timeout=120)
    for rank, (latest, ckpt_id, _files, diff, _) in enumerate(out):
        assert latest == 10 and ckpt_id == (10, rank, SESSION)
        assert diff == "", diff
    n_tensors = out[0][4]["send"]
    assert n_tensors > 0 and out[1][4]["recv"] == n_tensors, "rank 0 sent rank 1 its tensors"
    assert out[0][4]["recv"] == 0 and out[1][4]["send"] == 0
