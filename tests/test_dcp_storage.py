"""torch.distributed.checkpoint through resilient_ckpt's store: MemoryStorageWriter / Reader.

A torchtitan-style loop — ``Stateful`` app state built with
``torch.distributed.checkpoint.state_dict.get_state_dict``, ``dcp.async_save`` to save,
``dcp.load`` after a restart — changes nothing but the ``storage_writer`` / ``storage_reader``
it passes. Real processes (tests/harness.py): 2 ranks, each its own simulated node (its own
store root), replication factor 2. A restart is a new ``run_ranks`` call on the same store
roots; a node loss is a rank that SIGKILLs itself and whose store root is then removed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import KILLED, node_store_root, run_ranks
from resilient_ckpt.dcp.checkpoint_id import iteration_from_checkpoint_id

pytestmark = pytest.mark.multiprocess

WS = 2
RUN = dict(ranks_per_node=1, timeout=90, collective_timeout=30)


# ---- inside the ranks ------------------------------------------------------------------------


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 5)  # 5 rows: uneven FSDP2 shards (3 + 2)
        self.head = torch.nn.Linear(5, 1)  # 1 row: rank 1's FSDP2 shard is empty

    def forward(self, x):
        return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


class _AppState:
    """torchtitan's pattern: model + optimizer as one Stateful (a runtime-checkable Protocol:
    state_dict + load_state_dict make it one), plus plain training progress."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer
        self.progress = {"step": 0, "data_position": 0, "tag": "run7"}

    def state_dict(self):
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "progress": dict(self.progress)}

    def load_state_dict(self, sd):
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
        self.progress = dict(sd["progress"])


def _build(kind: str, seed: int):
    torch.manual_seed(seed)
    model = _Net()
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)  # broadcasts rank 0's parameters, as real DDP jobs do
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (dist.get_world_size(),))
        for m in (model.fc1, model.fc2, model.head, model):
            fully_shard(m, mesh=mesh)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return _AppState(model, opt)


def _train(app: _AppState, steps: int) -> None:
    for _ in range(steps):
        pos = app.progress["data_position"]
        g = torch.Generator().manual_seed(1000 * pos + dist.get_rank())
        x, y = torch.randn(4, 8, generator=g), torch.randn(4, 1, generator=g)
        app.optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.mse_loss(app.model(x), y).backward()
        app.optimizer.step()
        app.progress["step"] += 1
        app.progress["data_position"] += 1


def _snapshot(app: _AppState) -> dict:
    """Every value of the app state, flattened; DTensors as their local shard (cloned)."""
    from torch.distributed.tensor import DTensor

    out = {}

    def walk(prefix, v):
        if isinstance(v, dict):
            for k, x in v.items():
                walk(f"{prefix}/{k}", x)
        elif isinstance(v, (list, tuple)):
            for i, x in enumerate(v):
                walk(f"{prefix}/{i}", x)
        elif isinstance(v, torch.Tensor):
            t = (v.to_local() if isinstance(v, DTensor) else v).detach().contiguous()
            # Raw bytes: what bit-exact means, and it crosses the result queue as plain data.
            out[prefix] = (str(t.dtype), tuple(t.shape), t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            out[prefix] = v

    walk("", app.state_dict())
    return out


def _manager(ctx, **kw):
    from resilient_ckpt import CheckpointManager

    return CheckpointManager(
        session_id="dcp-storage",
        store_root=ctx.store_root,
        replication_factor=2,
        ranks_per_node=1,
        timeout_s=30,
        **kw,
    )


def _save(ctx, kind: str, steps, ckpt_dir: str, persistent_dir=None, die_after=False):
    """Train; ``dcp.async_save`` after each count of ``steps``; return the last snapshot."""
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.dcp import MemoryStorageWriter

    app = _build(kind, seed=0)
    manager = _manager(ctx, persistent_dir=persistent_dir)
    writer = MemoryStorageWriter(manager)
    done = 0
    for n in steps:
        _train(app, n - done)
        done = n
        fut = dcp.async_save({"app": app}, storage_writer=writer, checkpoint_id=f"{ckpt_dir}/step-{n}")
        fut.result()
        # The future completes only after the store's agreement (its metrics are set then).
        assert writer.last_save_metrics is not None and writer.last_save_metrics.iteration == n
        assert writer.last_save_metrics.durable_s > 0
    snap = _snapshot(app)
    if persistent_dir is not None:
        manager.flush().wait()
    if die_after:
        manager.wait_for_saves()
        dist.barrier()  # both saves agreed on both ranks before the node goes
        if ctx.rank == 1:
            ctx.kill_self()
        return snap
    manager.close()
    return snap


def _load(ctx, kind: str, checkpoint_id=None, persistent_dir=None):
    """A restarted job: fresh model and optimizer (other weights), ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.dcp import MemoryStorageReader

    app = _build(kind, seed=123)
    _train(app, 1)  # optimizer state exists (the shapes DCP loads into), with other values
    manager = _manager(ctx, persistent_dir=persistent_dir)
    reader = MemoryStorageReader(manager)
    found = reader.find_latest()  # what dcp.load will load (its first step, kept for it)
    dcp.load({"app": app}, storage_reader=reader, checkpoint_id=checkpoint_id)
    assert found == reader.iteration
    sources = (reader.metadata_load_metrics.source, reader.last_load_metrics.source)
    iteration = reader.iteration
    manager.close()
    return _snapshot(app), iteration, sources


# ---- in the test process ---------------------------------------------------------------------


def _bit_diffs(expected: dict, got: dict) -> list:
    problems = [f"keys differ: {sorted(set(expected) ^ set(got))}"] if set(expected) != set(got) else []
    for k, v in expected.items():
        if got.get(k) != v:  # tensors: (dtype, shape, raw bytes)
            problems.append(f"{k}: {str(v)[:80]} != {str(got.get(k))[:80]}")
    return problems


def _check_restored(saved, loaded, iteration, sources=None):
    for rank in range(WS):
        snap, it, (_, source) = loaded[rank]
        assert it == iteration
        if sources is not None:
            assert source in sources, f"rank {rank} loaded from {source!r}"
        assert _bit_diffs(saved[rank], snap) == [], f"rank {rank}"


def test_ddp_state_async_saved_with_dcp_loads_bit_exactly_after_a_restart(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_save, WS, tmp_path, args=("ddp", [2, 4], ckpt), **RUN)
    loaded = run_ranks(_load, WS, tmp_path, args=("ddp", f"{ckpt}/step-4"), **RUN)
    _check_restored(saved, loaded, 4, sources={"local"})
    assert saved[0]["/progress/step"] == 4


def test_fsdp2_state_async_saved_with_dcp_loads_bit_exactly_after_a_restart(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_save, WS, tmp_path, args=("fsdp2", [3], ckpt), **RUN)
    # fully_shard works on CPU with gloo: rank 1 holds 2 of fc2's 5 rows and none of head's.
    assert saved[1]["/model/fc2.weight"][1] == (2, 16)
    assert saved[1]["/model/head.weight"][1] == (0, 5)
    loaded = run_ranks(_load, WS, tmp_path, args=("fsdp2",), **RUN)
    _check_restored(saved, loaded, 3, sources={"local"})


def test_node_loss_loads_bit_exactly_from_the_replica(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_save, WS, tmp_path, args=("fsdp2", [2, 3], ckpt, None, True), expect_killed=[1], **RUN)
    assert saved[1] is KILLED
    shutil.rmtree(node_store_root(str(tmp_path), 1))  # node 1 is gone with its store
    loaded = run_ranks(_load, WS, tmp_path, args=("fsdp2",), **RUN)
    # Rank 1's payload (its FSDP2 shards and optimizer state) exists only as node 0's replica;
    # the expected values are rank 1's as rank 0 saw them: recompute them in a clean run.
    reference = run_ranks(_reference, WS, tmp_path / "ref", args=("fsdp2", 3), **RUN)
    _check_restored(reference, loaded, 3)
    assert _bit_diffs(saved[0], reference[0]) == []
    # Rank 1's node store was empty: its payload came from node 0's replica (the metadata step
    # found it there; healing then copied it back to node 1, where the data step read it).
    assert [sources[0] for _, _, sources in loaded] == ["local", "peer"]


def _train_with_saves_in_flight(ctx, ckpt_dir: str):
    """The documented loop: ``async_save`` at steps 2 and 6 and training goes on while each
    save is in flight (DDP's backward all-reduces on the default group meanwhile); the future
    is waited for only before the next save. Then node 1 dies once both saves are agreed."""
    from resilient_ckpt.dcp import MemoryStorageWriter, async_save

    app = _build("ddp", seed=0)
    manager = _manager(ctx)
    fut, snaps = None, {}
    for step in range(1, 13):
        _train(app, 1)
        if step in (2, 6):
            if fut is not None:
                fut.result()
            fut = async_save(
                {"app": app},
                checkpoint_id=f"{ckpt_dir}/step-{step}",
                storage_writer=MemoryStorageWriter(manager),
            )
            snaps[step] = _snapshot(app)  # async_save returned: the items are in the store
    fut.result()
    manager.wait_for_saves()
    dist.barrier()
    if ctx.rank == 1:
        ctx.kill_self()
    return snaps[6]


def test_ddp_training_goes_on_while_async_save_is_in_flight_and_a_node_loss_restores_bit_exactly(tmp_path):
    ckpt = str(tmp_path / "ckpt")
    saved = run_ranks(_train_with_saves_in_flight, WS, tmp_path, args=(ckpt,), expect_killed=[1], **RUN)
    assert saved[1] is KILLED
    shutil.rmtree(node_store_root(str(tmp_path), 1))
    loaded = run_ranks(_load, WS, tmp_path, args=("ddp",), **RUN)
    # DDP: both ranks hold the same state, so rank 0's snapshot at step 6 is rank 1's too.
    _check_restored([saved[0]] * WS, loaded, 6)
    assert [sources[0] for _, _, sources in loaded] == ["local", "peer"]


def _reference(ctx, kind: str, steps: int):
    app = _build(kind, seed=0)
    _train(app, steps)
    return _snapshot(app)


def test_empty_memory_falls_back_to_the_persistent_dcp_directory(tmp_path):
    ckpt, durable = str(tmp_path / "ckpt"), str(tmp_path / "durable")
    saved = run_ranks(_save, WS, tmp_path, args=("ddp", [2], ckpt, durable), **RUN)
    for node in range(WS):
        shutil.rmtree(node_store_root(str(tmp_path), node))
    assert any(Path(durable).iterdir()), "the flush wrote a DCP directory"
    loaded = run_ranks(_load, WS, tmp_path, args=("ddp", None, durable), **RUN)
    _check_restored(saved, loaded, 2, sources={"persistent"})


# ---- checkpoint ids (one process, no store needed for the rule itself) ----------------------


@pytest.mark.parametrize(
    "cid, iteration",
    [(100, 100), ("step-100", 100), ("/ckpt/run7/step-100/", 100), ("iter_0000100", 100), ("7", 7)],
)
def test_checkpoint_id_names_the_iteration_by_its_trailing_digits(cid, iteration):
    assert iteration_from_checkpoint_id(cid) == iteration
    assert iteration_from_checkpoint_id(Path(str(cid))) == iteration if isinstance(cid, str) else True


@pytest.mark.parametrize("cid", ["latest", "step-100.tmp", "", -1, True, 1.5, None])
def test_a_checkpoint_id_naming_no_iteration_is_a_clear_value_error(cid):
    with pytest.raises(ValueError, match="checkpoint_id"):
        iteration_from_checkpoint_id(cid)


def test_dcp_save_and_async_save_with_a_bad_checkpoint_id_raise_it(tmp_path):
    """Through DCP itself (one process, no_dist): ``dcp.save`` raises, and ``async_save``
    returns (it does not wait for staging that will never happen) with the error in its future."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.dcp import MemoryStorageReader, MemoryStorageWriter

    with CheckpointManager(session_id="bad-id", store_root=str(tmp_path), replication_factor=1) as m:
        writer = MemoryStorageWriter(m)
        sd = {"w": torch.ones(3)}
        with pytest.raises(ValueError, match="does not end in digits"):
            dcp.save(sd, storage_writer=writer, checkpoint_id="ckpt/latest", no_dist=True)
        fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id="ckpt/latest", no_dist=True)
        with pytest.raises(ValueError, match="does not end in digits"):
            fut.result(timeout=30)
        # Found while planning: DCP reports it on every rank as its CheckpointException.
        with pytest.raises(CheckpointException, match="does not know which iteration"):
            dcp.save(sd, storage_writer=MemoryStorageWriter(m), no_dist=True)
        with pytest.raises(ValueError, match="first argument is a CheckpointManager"):
            MemoryStorageWriter("ckpt/step-1")
        with pytest.raises(ValueError, match="does not end in digits"):
            MemoryStorageReader(m, checkpoint_id="ckpt/latest")
        # An empty store: nothing to load, said before dcp.load is tried.
        assert MemoryStorageReader(m).find_latest() is None


# ---- pure parts: metadata without pickle, who asks the store for what --------------------------


def _metadata():
    from torch.distributed.checkpoint.metadata import (
        BytesStorageMetadata,
        ChunkStorageMetadata,
        Metadata,
        StorageMeta,
        TensorProperties,
        TensorStorageMetadata,
    )

    rows = [
        ChunkStorageMetadata(torch.Size([0, 0]), torch.Size([3, 4])),
        ChunkStorageMetadata(torch.Size([3, 0]), torch.Size([2, 4])),
    ]
    return Metadata(
        state_dict_metadata={
            "model.w": TensorStorageMetadata(
                TensorProperties(dtype=torch.bfloat16), torch.Size([5, 4]), rows
            ),
            "optim.step": TensorStorageMetadata(
                TensorProperties(dtype=torch.float32),
                torch.Size([]),
                [ChunkStorageMetadata(torch.Size([]), torch.Size([]))],
            ),
            "optim.param_groups": BytesStorageMetadata(),
        },
        planner_data={"model.w": ("model", "w"), "optim.param_groups": ("optim", "param_groups")},
        storage_meta=StorageMeta(checkpoint_id=Path("/ckpt/step-3"), save_id="abc"),
        version="1.0.0",
    )


def test_dcp_metadata_round_trips_without_pickle():
    from resilient_ckpt.dcp import decode_metadata, encode_metadata

    md = _metadata()
    raw = encode_metadata(md)
    assert b"\x80\x04" not in raw[:2] and b"torch.distributed" not in raw  # no pickle, no class paths
    back = decode_metadata(raw)
    assert back.state_dict_metadata == md.state_dict_metadata
    assert back.planner_data == md.planner_data
    assert back.storage_meta.checkpoint_id == "/ckpt/step-3" and back.version == "1.0.0"


def test_damaged_dcp_metadata_is_a_corrupt_checkpoint_error_naming_the_field():
    from resilient_ckpt.dcp import decode_metadata
    from resilient_ckpt.errors import CorruptCheckpointError
    from resilient_ckpt.model import codec

    with pytest.raises(CorruptCheckpointError, match="does not decode"):
        decode_metadata(b"not an encoding")
    tree = codec.decode(__import__("resilient_ckpt.dcp", fromlist=["x"]).encode_metadata(_metadata()))
    tree["entries"][0]["chunks"][0] = ((0,), (3, 4))
    with pytest.raises(CorruptCheckpointError, match="'model.w' chunk 0 has 1 offsets"):
        decode_metadata(codec.encode(tree))


def test_each_stored_chunk_has_one_main_reader_and_unread_chunks_of_a_read_key_get_one():
    from torch.distributed.checkpoint.metadata import MetadataIndex
    from torch.distributed.checkpoint.planner import LoadItemType, ReadItem

    from resilient_ckpt.dcp.payload import assign_reads

    def read(fqn, offset, kind=LoadItemType.TENSOR):
        idx, zeros = MetadataIndex(fqn, offset), torch.Size([0] * len(offset or ()))
        return ReadItem(
            type=kind,
            dest_index=idx,
            dest_offsets=zeros,
            storage_index=idx,
            storage_offsets=zeros,
            lengths=zeros,
        )

    md = _metadata()
    plans = [
        [read("model.w", [0, 0]), read("optim.param_groups", None, LoadItemType.BYTE_IO)],  # rank 0
        [read("model.w", [0, 0]), read("optim.param_groups", None, LoadItemType.BYTE_IO)],  # rank 1
    ]
    a = assign_reads(plans, md)
    assert a[0].main == {("model.w", (0, 0))} and a[1].main == frozenset()
    assert a[0].main_objects == {"optim.param_groups"} and a[1].main_objects == frozenset()
    # Nobody reads model.w's rows 3-4 (a partial load): its first reader asks for them too, so
    # the key's main replicas still tile it; optim.step is read by nobody and stays out.
    assert a[0].fillers == (("model.w", (3, 0)),) and a[1].fillers == ()
