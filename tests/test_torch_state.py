"""Plain PyTorch (DDP, FSDP2 / DTensor) training state round-trips bit-exactly through the manager.

Every test saves ``TrainState.sharded_state_dict()`` with ``CheckpointManager.save_local``,
restores with ``load_local()`` (no template: the checkpoint's own structure) into freshly built
objects holding different values, applies it with ``TrainState.load_state_dict`` and compares
bit for bit: model parameters, Adam state (exp_avg, exp_avg_sq, step), the LR scheduler, the
torch/numpy/python RNG states and the ``extra`` dict (dataloader position).
"""

from __future__ import annotations

import copy
import random

import numpy as np
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks

pytestmark = pytest.mark.multiprocess


# ---- helpers (run inside the ranks) ----------------------------------------------------------


def _dtensor_cls():
    from torch.distributed.tensor import DTensor

    return DTensor


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit equality (NaN payloads and -0.0 included), after unwrapping DTensors."""
    DTensor = _dtensor_cls()
    if isinstance(a, DTensor) or isinstance(b, DTensor):
        if not (isinstance(a, DTensor) and isinstance(b, DTensor)):
            return False
        if a.placements != b.placements or a.shape != b.shape:
            return False
        a, b = a.to_local(), b.to_local()
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def _diff(expected, got, path="") -> list:
    """Human-readable differences between two nested values (empty when bit-identical)."""
    if isinstance(expected, torch.Tensor) or isinstance(got, torch.Tensor):
        if not (isinstance(expected, torch.Tensor) and isinstance(got, torch.Tensor)):
            return [f"{path}: {type(expected).__name__} vs {type(got).__name__}"]
        return [] if _same_bits(expected, got) else [f"{path}: tensors differ"]
    if isinstance(expected, np.ndarray):
        ok = isinstance(got, np.ndarray) and expected.dtype == got.dtype and np.array_equal(expected, got)
        return [] if ok else [f"{path}: arrays differ"]
    if isinstance(expected, dict):
        if not isinstance(got, dict) or set(expected) != set(got):
            return [f"{path}: keys {sorted(map(str, expected))} vs {sorted(map(str, got or {}))}"]
        return [d for k in expected for d in _diff(expected[k], got[k], f"{path}/{k}")]
    if isinstance(expected, (list, tuple)):
        if type(got) is not type(expected) or len(expected) != len(got):
            return [f"{path}: sequence {expected!r} vs {got!r}"]
        return [d for i, (e, g) in enumerate(zip(expected, got)) for d in _diff(e, g, f"{path}[{i}]")]
    return [] if (type(expected) is type(got) and expected == got) else [f"{path}: {expected!r} vs {got!r}"]


def _clone(x):
    """Deep copy that clones tensors (``copy.deepcopy`` cannot copy DTensors' storage)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return type(x)(_clone(v) for v in x)
    return copy.deepcopy(x)


def _snapshot(state) -> dict:
    """Everything TrainState promises to restore, copied."""
    return {
        "model": _clone(state.model.state_dict()),
        "optimizer": _clone(state.optimizer.state_dict()),
        "lr_scheduler": _clone(state.lr_scheduler.state_dict()),
        "extra": _clone(state.extra),
        "rng": {"torch": torch.get_rng_state(), "numpy": np.random.get_state(), "python": random.getstate()},
    }


def _scramble_rng(seed: int) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)


def _seed_rank(seed: int, rank: int) -> None:
    torch.manual_seed(seed + rank)
    np.random.seed(seed + 7 * rank)
    random.seed(seed + 13 * rank)


def _unique_tensor_bytes(state) -> int:
    """Bytes the job saves: the global parameters and optimizer tensors each once, and every
    rank's buffers (each rank's own: BatchNorm statistics differ between data-parallel ranks)."""
    buffers = {name for name, _ in state.model.named_buffers()}
    world = dist.get_world_size()
    n = sum(
        t.numel() * t.element_size() * (world if name in buffers else 1)
        for name, t in state.model.state_dict().items()
    )
    for values in state.optimizer.state_dict()["state"].values():
        n += sum(v.numel() * v.element_size() for v in values.values() if isinstance(v, torch.Tensor))
    return n


def _saved_tensor_bytes(manager, iteration: int) -> int:
    """Tensor bytes this rank's own checkpoint of ``iteration`` holds (from its header)."""
    from resilient_ckpt.memory.layout import CheckpointId

    header = manager.store.read_header(CheckpointId(iteration, dist.get_rank(), manager.session_id))
    return sum(layout.nbytes for layout in header.tensors)


class _Net(torch.nn.Module):
    """Small MLP with dropout, so the RNG state matters for the next losses."""

    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(6, 16)
        self.drop = torch.nn.Dropout(0.2)
        self.fc2 = torch.nn.Linear(16, 3)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(x))))


def _batch(position: int, rank: int):
    """Data depends on the dataloader position (``extra``) and on numpy's and python's RNG."""
    g = torch.Generator().manual_seed(1000 * position + rank)
    x = torch.randn(4, 6, generator=g)
    x = x + torch.from_numpy(np.random.standard_normal((4, 6)).astype(np.float32)) * random.random()
    return x, x[:, :3].sum(dim=1, keepdim=True).tanh().expand(4, 3)


def _ddp_state(seed: int):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from resilient_ckpt import TrainState

    torch.manual_seed(seed)
    model = DDP(_Net())  # broadcasts rank 0's parameters, as in real DDP jobs
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainState(model, opt, sched, extra={"data_position": 0})


def _ddp_train_step(state) -> float:
    x, y = _batch(state.extra["data_position"], dist.get_rank())
    state.optimizer.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(state.model(x), y)
    loss.backward()
    state.optimizer.step()
    state.lr_scheduler.step()
    state.extra["data_position"] += 1
    return loss.item()


def _manager(ctx, session: str):
    from resilient_ckpt import CheckpointManager

    nodes = ctx.world_size // ctx.ranks_per_node
    return CheckpointManager(
        session_id=session,
        store_root=ctx.store_root,
        replication_factor=min(2, nodes),
        ranks_per_node=ctx.ranks_per_node,
        timeout_s=30,
    )


# ---- DDP -------------------------------------------------------------------------------------


def _ddp_round_trip(ctx):
    state = _ddp_state(seed=0)
    _seed_rank(100, ctx.rank)
    for _ in range(3):
        _ddp_train_step(state)
    manager = _manager(ctx, "ddp")
    expected = _snapshot(state)
    manager.save_local(state.sharded_state_dict(), iteration=2).wait()
    saved_bytes = _saved_tensor_bytes(manager, 2)
    unique_bytes = _unique_tensor_bytes(state)
    manager.close()

    # The restarted job: other weights, an optimizer without state, other RNG streams.
    fresh = _ddp_state(seed=1)
    fresh.extra.clear()
    _scramble_rng(4242)
    assert _diff(expected["model"], _snapshot(fresh)["model"]), "fresh model must differ"
    restored = _manager(ctx, "ddp").load_local()
    assert restored is not None, "no checkpoint found"
    sd, iteration = restored
    fresh.load_state_dict(sd)
    return _diff(expected, _snapshot(fresh)), iteration, saved_bytes, unique_bytes


def test_ddp_state_round_trips_bit_exactly_and_is_saved_once_across_data_parallel_ranks(tmp_root):
    out = run_ranks(_ddp_round_trip, 3, tmp_root, ranks_per_node=3)
    for rank, (diffs, iteration, _, _) in enumerate(out):
        assert iteration == 2
        assert diffs == [], f"rank {rank}: {diffs}"
    # Replicated DDP tensors are deduplicated: the ranks together store each byte once.
    unique = out[0][3]
    assert sum(o[2] for o in out) == unique
    assert all(o[2] < unique for o in out), "work is spread over the data-parallel ranks"


def _ddp_resume(ctx, total_steps: int, crash_after: int, every: int):
    from resilient_ckpt import CheckpointHook

    # The uninterrupted reference.
    ref = _ddp_state(seed=0)
    _seed_rank(100, ctx.rank)
    ref_losses = [_ddp_train_step(ref) for _ in range(total_steps)]
    ref_params = {k: v.clone() for k, v in ref.model.state_dict().items()}

    # The run that fails: same seeds, saves every ``every`` steps, dies after ``crash_after``.
    run = _ddp_state(seed=0)
    _seed_rank(100, ctx.rank)
    hook = CheckpointHook(_manager(ctx, "resume"), every_n_steps=every, state=run)
    assert hook.restore() == 0
    for step in range(crash_after + 1):
        _ddp_train_step(run)
        hook.step(step)
    hook.close()
    hook.manager.close()

    # The restart: new processes' state (new DDP, other init, other RNG), automatic restore.
    again = _ddp_state(seed=5)
    again.extra.clear()
    _scramble_rng(777)
    hook = CheckpointHook(_manager(ctx, "resume"), every_n_steps=every, state=again)
    start = hook.restore()
    losses = [_ddp_train_step(again) for _ in range(start, total_steps)]
    hook.close()
    params = {k: v.clone() for k, v in again.model.state_dict().items()}
    return start, ref_losses[start:], losses, _diff(ref_params, params)


def test_ddp_training_resumed_from_a_local_checkpoint_follows_the_uninterrupted_losses(tmp_root):
    # Two ranks: DDP's all-reduce adds two values per element, so the result does not depend on
    # DDP re-bucketing after the restarted job's first iteration (see docs/architecture.md).
    out = run_ranks(_ddp_resume, 2, tmp_root, args=(8, 4, 3))
    for rank, (start, ref_losses, losses, param_diffs) in enumerate(out):
        assert start == 3, "newest complete checkpoint is the one after step 2"
        assert losses == ref_losses, f"rank {rank}: resumed losses differ"
        assert param_diffs == [], f"rank {rank}: {param_diffs}"


# ---- FSDP2-style DTensors ----------------------------------------------------------------------


class _ShardedNet(torch.nn.Module):
    """Parameters as DTensors on a mesh (what FSDP2 / tensor parallelism hand to a state dict)."""

    def __init__(self, mesh, placements, seed: int, rows: int):
        super().__init__()
        from torch.distributed.tensor import distribute_tensor

        g = torch.Generator().manual_seed(seed)
        self.w = torch.nn.Parameter(distribute_tensor(torch.randn(rows, 5, generator=g), mesh, placements))
        self.b = torch.nn.Parameter(distribute_tensor(torch.randn(rows, generator=g), mesh, placements))
        self.register_buffer("scale", torch.full((3,), float(seed)))  # a plain replicated buffer


def _dtensor_state(mesh, placements, seed: int, rows: int):
    from resilient_ckpt import TrainState

    model = _ShardedNet(mesh, placements, seed, rows)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.9)
    return TrainState(model, opt, sched, extra={"data_position": 0})


def _dtensor_step(state, mesh, placements, step: int) -> None:
    """One optimizer step with the same global gradients on every rank (no forward needed)."""
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(10_000 + step)
    for p in state.model.parameters():
        p.grad = distribute_tensor(torch.randn(p.shape, generator=g), mesh, placements)
    state.optimizer.step()
    state.lr_scheduler.step()
    state.extra["data_position"] += 1


def _dtensor_round_trip(ctx, mesh_shape, placement_names, rows):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard

    mesh = init_device_mesh("cpu", tuple(mesh_shape))
    placements = [Shard(0) if n == "shard" else Replicate() for n in placement_names]
    state = _dtensor_state(mesh, placements, seed=0, rows=rows)
    _seed_rank(300, ctx.rank)
    for step in range(2):
        _dtensor_step(state, mesh, placements, step)
    local_rows = state.model.w.to_local().shape[0]
    manager = _manager(ctx, "dtensor")
    expected = _snapshot(state)
    manager.save_local(state.sharded_state_dict(), iteration=1).wait()
    saved_bytes = _saved_tensor_bytes(manager, 1)
    unique_bytes = _unique_tensor_bytes(state)
    manager.close()

    fresh = _dtensor_state(mesh, placements, seed=3, rows=rows)
    fresh.extra.clear()
    _scramble_rng(99)
    assert _diff(expected["model"], _snapshot(fresh)["model"]), "fresh model must differ"
    restored = _manager(ctx, "dtensor").load_local()
    assert restored is not None, "no checkpoint found"
    fresh.load_state_dict(restored[0])
    diffs = _diff(expected, _snapshot(fresh))
    # The restored optimizer state is usable: one more step gives the same parameters.
    _dtensor_step(state, mesh, placements, 2)
    _dtensor_step(fresh, mesh, placements, 2)
    diffs += _diff(dict(state.model.named_parameters()), dict(fresh.model.named_parameters()), "after-step")
    return diffs, local_rows, saved_bytes, unique_bytes


@pytest.mark.parametrize(
    "world, mesh_shape, placements, rows, local_rows",
    [
        # 7 rows over 3 ranks: torch.chunk gives 3, 3, 1 rows (uneven shards).
        pytest.param(3, (3,), ("shard",), 7, [3, 3, 1], id="1d-uneven"),
        # 5 rows over 4 ranks: 2, 2, 1, 0 rows — the last rank holds an empty shard.
        pytest.param(4, (4,), ("shard",), 5, [2, 2, 1, 0], id="1d-empty-shard"),
        # HSDP-like 2-D mesh: replicated over dim 0, sharded over dim 1.
        pytest.param(4, (2, 2), ("replicate", "shard"), 6, [3, 3, 3, 3], id="2d-replicate-shard"),
    ],
)
def test_dtensor_state_round_trips_bit_exactly(tmp_root, world, mesh_shape, placements, rows, local_rows):
    out = run_ranks(_dtensor_round_trip, world, tmp_root, args=(mesh_shape, placements, rows))
    assert [o[1] for o in out] == local_rows, "the test's sharding is what it claims"
    for rank, (diffs, *_rest) in enumerate(out):
        assert diffs == [], f"rank {rank}: {diffs}"
    # Shards are saved once; the replicated mesh dimension and plain parameters are deduplicated
    # (the buffer is each rank's own: saved by every rank, see _unique_tensor_bytes).
    assert sum(o[2] for o in out) == out[0][3]


# ---- real FSDP2 ----------------------------------------------------------------------------------


def _fsdp2_state(mesh, seed: int):
    from torch.distributed.fsdp import fully_shard

    from resilient_ckpt import TrainState

    torch.manual_seed(seed)
    model = _Net()
    fully_shard(model.fc1, mesh=mesh)
    fully_shard(model.fc2, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return TrainState(model, opt, sched, extra={"data_position": 0})


def _fsdp2_resume(ctx, total_steps: int, save_after: int):
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    ref = _fsdp2_state(mesh, seed=0)
    _seed_rank(500, ctx.rank)
    ref_losses = []
    manager = _manager(ctx, "fsdp2")
    for step in range(total_steps):
        ref_losses.append(_ddp_train_step(ref))
        if step == save_after:
            expected = _snapshot(ref)
            manager.save_local(ref.sharded_state_dict(), iteration=step).wait()
    manager.close()
    is_dtensor = isinstance(ref.model.fc1.weight, _dtensor_cls())

    fresh = _fsdp2_state(mesh, seed=9)
    fresh.extra.clear()
    _scramble_rng(31)
    assert _diff(expected["model"], _snapshot(fresh)["model"]), "fresh model must differ"
    restored = _manager(ctx, "fsdp2").load_local()
    assert restored is not None, "no checkpoint found"
    fresh.load_state_dict(restored[0])
    diffs = _diff(expected, _snapshot(fresh))
    losses = [_ddp_train_step(fresh) for _ in range(save_after + 1, total_steps)]
    diffs += _diff(_clone(ref.model.state_dict()), _clone(fresh.model.state_dict()), "final")
    return is_dtensor, diffs, ref_losses[save_after + 1 :], losses


def test_fsdp2_fully_shard_state_round_trips_and_training_resumes_bit_exactly(tmp_root):
    """Real FSDP2 (``torch.distributed.fsdp.fully_shard``) on CPU with gloo: parameters and Adam
    state are DTensors sharded over the mesh, restored into a freshly sharded model."""
    out = run_ranks(_fsdp2_resume, 2, tmp_root, args=(6, 2))
    for rank, (is_dtensor, diffs, ref_losses, losses) in enumerate(out):
        assert is_dtensor, "fully_shard must hand DTensor parameters to the state dict"
        assert diffs == [], f"rank {rank}: {diffs}"
        assert losses == ref_losses, f"rank {rank}: resumed losses differ"
