"""What protects the saved tensors from the training loop's next update, per integration.

A save returns once its copies are started; the caller mutates the saved tensors (the optimizer
step) only after ``SaveHandle.fence()``: GPU copies are ordered before the current stream's
later work (the GPU waits, the CPU does not), CPU tensors' copies are waited for. Each
integration places that fence for its user:

* ``CheckpointHook``: an optimizer pre-step hook fences the latest save;
* ``CheckpointManager.save`` (``LocalCheckpointManager``, Megatron-LM's loop): fences before
  returning;
* DCP's ``MemoryStorageWriter``: fences before ``dcp.save`` returns (``async_save``: before
  its staging gate opens), on the caller's stream.

Each test saves, lets the integration fence, mutates the tensors at once and checks that the
stored checkpoint holds the values from before the mutation. On CPU the same fence code runs
with CPU tensors; with a GPU every test also runs on ``cuda`` (large tensors, so a missing
fence would lose the race). Also specified: nothing is page-locked on a save's calling thread,
from the first save after a start on, whatever the retention; the device snapshot stores
exactly what the GPU held.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from resilient_ckpt import (
    CheckpointHook,
    CheckpointManager,
    LocalCheckpointManager,
    ShardedTensor,
    TrainState,
)

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
#: big enough on a GPU that an unordered in-place update would overtake the device-to-host copy
N = 8 << 20


@pytest.fixture
def shm_root():
    d = tempfile.mkdtemp(prefix="rckpt-test-order-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _weights(device: str, n: int = N) -> torch.Tensor:
    return torch.arange(n, dtype=torch.float32, device=device)


def _stored(manager: CheckpointManager, key: str = "w") -> torch.Tensor:
    """The newest complete checkpoint's tensor ``key``, read back through a restore."""
    state, _ = manager.load_local({key: ShardedTensor.from_rank_offsets(key, torch.zeros(N))})
    return state[key]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("snapshot", ["never", "always"])
def test_a_fenced_update_never_reaches_the_checkpoint(shm_root, device, snapshot):
    with CheckpointManager("order", store_root=str(shm_root), device_snapshot=snapshot) as m:
        for it in (1, 2, 3):  # the first save after a start, then segments made ahead
            w = _weights(device)
            handle = m.save_local({"w": ShardedTensor.from_rank_offsets("w", w)}, it)
            handle.fence()
            w.mul_(-1.0)  # the optimizer's update, on the current stream
            handle.wait()
            assert torch.equal(_stored(m), torch.arange(N, dtype=torch.float32)), it


@pytest.mark.parametrize("device", DEVICES)
def test_checkpoint_hook_fences_before_the_optimizer_step(shm_root, device):
    model = torch.nn.Linear(1024, 1024, bias=False).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    with CheckpointManager("hook", store_root=str(shm_root)) as m:
        hook = CheckpointHook(m, every_n_steps=1, state=TrainState(model, opt))
        before = []
        for step in range(3):
            model.weight.grad = torch.ones_like(model.weight)
            if step:
                before.append(model.weight.detach().cpu().clone())
                opt.step()  # runs right after the save of step - 1: the hook fences first
            hook.step(step)
            if step == 0:
                before.append(model.weight.detach().cpu().clone())
        hook.finish()
        # what each save stored is the weight before the next step's update
        restored = torch.nn.Linear(1024, 1024, bias=False).to(device)
        hook2 = CheckpointHook(
            m, every_n_steps=1, state=TrainState(restored, torch.optim.SGD(restored.parameters(), lr=1.0))
        )
        assert hook2.restore() == 3
        assert torch.equal(restored.weight.detach().cpu(), model.weight.detach().cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_local_checkpoint_manager_save_returns_when_the_update_may_run(shm_root, device):
    from resilient_ckpt import MCoreTensorAwareStateDict

    m = LocalCheckpointManager(str(shm_root), session_id="mlm")
    try:
        w = _weights(device)
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict({"w": ShardedTensor.from_rank_offsets("w", w)})
        request = m.save(tasd, 7, is_async=True)
        w.mul_(-1.0)  # Megatron's next step, on the current stream
        request.execute_sync()
        assert m.find_latest() == 7
        loaded, _ = m.load()
        got = loaded.to_state_dict({"w": ShardedTensor.from_rank_offsets("w", torch.zeros(N))})
        assert torch.equal(got["w"].cpu(), torch.arange(N, dtype=torch.float32))
    finally:
        m.close()


@pytest.mark.parametrize("device", DEVICES)
def test_dcp_memory_storage_writer_fences_before_save_returns(shm_root, device):
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.dcp import MemoryStorageReader, MemoryStorageWriter

    with CheckpointManager("dcp", store_root=str(shm_root)) as m:
        w = _weights(device)
        dcp.save({"w": w}, storage_writer=MemoryStorageWriter(m, checkpoint_id="step-5"))
        w.mul_(-1.0)
        out = {"w": torch.zeros(N)}
        dcp.load(out, storage_reader=MemoryStorageReader(m))
        assert torch.equal(out["w"], torch.arange(N, dtype=torch.float32))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("keep_last", [1, 2])
def test_nothing_is_page_locked_on_the_save_path(shm_root, device, keep_last):
    with CheckpointManager("pin", store_root=str(shm_root), keep_last=keep_last) as m:
        for it in range(1, 6):
            w = _weights(device)
            h = m.save_local({"w": ShardedTensor.from_rank_offsets("w", w)}, it)
            h.fence()
            metrics = h.wait()
            assert metrics.pinned_on_save_bytes == 0, (it, metrics)
            if device == "cuda" and it >= 3:
                # complete segments stay locked: the next save copies at the link's rate
                assert metrics.pinned_held_bytes >= N * 4
            if device == "cpu":
                assert metrics.pinned_held_bytes == 0 and not metrics.device_snapshot


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_first_save_after_a_start_goes_through_a_device_snapshot_and_later_ones_do_not(shm_root):
    with CheckpointManager("snap", store_root=str(shm_root)) as m:
        flags = []
        for it in range(1, 5):
            w = _weights("cuda")
            h = m.save_local({"w": ShardedTensor.from_rank_offsets("w", w)}, it)
            h.fence()
            w.add_(1.0)
            flags.append(h.wait().device_snapshot)
            assert torch.equal(_stored(m), torch.arange(N, dtype=torch.float32))
        assert flags[0] and not flags[-1], flags
