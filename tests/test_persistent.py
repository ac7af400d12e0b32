"""The persistent tier: flush from the store to DCP, fallback restore, two-stage load, CLI.

One two-rank job (two simulated nodes) saves with the CheckpointManager, flushes with the
PersistentTier and loads back several ways; the tests below check what it observed, and use
the files it left (node stores, the DCP directory) for single-process checks (export, inspect,
convert, resharded load).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from harness import node_store_root, run_ranks
from resilient_ckpt import ShardedObject, ShardedTensor
from resilient_ckpt.cli.inspect import convert_main, export_main, inspect_main
from resilient_ckpt.errors import CheckpointingException, CorruptCheckpointError, ForeignCheckpointError
from resilient_ckpt.memory.layout import CheckpointId
from resilient_ckpt.memory.store import CheckpointStore
from resilient_ckpt.persistent.layout import hollow_fqn
from resilient_ckpt.persistent.local_load import load_metadata_only
from resilient_ckpt.persistent.snapshot import StoreSnapshot
from resilient_ckpt.persistent.storage import CountingStorageReader, SafeFileSystemReader, read_metadata_file
from resilient_ckpt.persistent.tier import PersistentTier, restore_latest

SESSION = "persist-test"
DDP_DIM = (6, 5)
FSDP_ROWS, FSDP_COLS = 8, 3


def _ddp_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(*DDP_DIM), torch.nn.Linear(DDP_DIM[1], 2))


def _full_fsdp_weight(seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(FSDP_ROWS, FSDP_COLS, generator=g)


def _sharded_state(step: int, rank: int, world: int):
    """DDP-style replicated params (keys "model.<name>"), an FSDP-style row-sharded weight,
    per-rank objects and common values; its tensors differ per step."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from resilient_ckpt.model.torch_state import to_sharded_tensor

    model = _ddp_model(step)
    mesh = init_device_mesh("cpu", (world,))
    dt = distribute_tensor(_full_fsdp_weight(step), mesh, [Shard(0)])
    return {
        "model": {n: to_sharded_tensor(f"model.{n}", t, rank) for n, t in model.state_dict().items()},
        "fsdp": {"weight": to_sharded_tensor("fsdp.weight", dt)},
        "per_rank": ShardedObject("per_rank", {"rank": rank, "step": step}, (world,), (rank,)),
        "step": step,
        "sched": {"lr": 0.1 * step, "milestones": [1, 2, 3]},
    }


def _tier(ctx, **kw) -> PersistentTier:
    return PersistentTier(os.path.join(ctx.tmp_root, "durable"), session=SESSION, sync_files=False, **kw)


def _job(ctx):
    """Save 10 and 20 into memory, flush 10, then load it every way there is."""
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager
    from resilient_ckpt.model.nested import nested_values
    from resilient_ckpt.parallel.distribution import compute_distribution
    from resilient_ckpt.persistent.two_stage import two_stage_load

    r, w = ctx.rank, ctx.world_size
    out = {}
    mgr = CheckpointManager(SESSION, ctx.store_root, replication_factor=2, ranks_per_node=1, keep_last=2)
    tier = _tier(ctx)
    mgr.save_local(_sharded_state(10, r, w), 10, is_async=False)
    res = tier.flush(mgr.store, 10).wait()
    out["flush"] = (res.iteration, res.bytes_written, res.total_bytes)
    mgr.save_local(_sharded_state(20, r, w), 20, is_async=False)
    # What the memory tier's fully-parallel distribution assigned to each rank.
    shards = [v for v in nested_values(_sharded_state(10, r, w)) if isinstance(v, ShardedTensor)]
    out["dist_bytes"] = compute_distribution(shards).rank_bytes
    ckpt = os.path.join(ctx.tmp_root, "durable", "iter_0000010")

    # 1. plain torch DCP, no resilient_ckpt code on the load side: DDP-style state dict ...
    fresh = _ddp_model(999)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=ckpt)
    out["ddp_exact"] = all(
        torch.equal(a, b) for a, b in zip(sd["model"].values(), _ddp_model(10).state_dict().values())
    )
    # ... and a DTensor state dict (FSDP2-style), each rank receiving its rows.
    mesh = init_device_mesh("cpu", (w,))
    target = distribute_tensor(torch.zeros(FSDP_ROWS, FSDP_COLS), mesh, [Shard(0)])
    dsd = {"fsdp": {"weight": target}}
    dcp.load(dsd, checkpoint_id=ckpt)
    out["dtensor_exact"] = torch.equal(dsd["fsdp"]["weight"].full_tensor(), _full_fsdp_weight(10))

    # 2. two-stage load vs every rank reading everything, reads counted.
    def template():
        return {
            "model": {
                n: ShardedTensor.from_rank_offsets(f"model.{n}", torch.zeros_like(t), replica_id=r)
                for n, t in _ddp_model(0).state_dict().items()
            },
            "fsdp": {
                "weight": ShardedTensor.from_rank_offsets("fsdp.weight", torch.zeros(FSDP_ROWS, FSDP_COLS))
            },
        }

    counting = CountingStorageReader(SafeFileSystemReader(ckpt))
    two = template()
    stats = two_stage_load(two, counting, None)
    naive_reader = CountingStorageReader(SafeFileSystemReader(ckpt))
    naive = template()
    from resilient_ckpt.persistent.local_load import load_local

    load_local(naive, naive_reader)
    out["two_stage"] = {
        "reads": {f"{k[0]}@{k[1]}": v for k, v in counting.reads.items()},
        "bytes": counting.bytes_read,
        "naive_bytes": naive_reader.bytes_read,
        "entries_read": stats.entries_read,
        "entries_total": stats.entries_total,
        "equal": all(torch.equal(two["model"][k], naive["model"][k]) for k in naive["model"])
        and torch.equal(two["fsdp"]["weight"], naive["fsdp"]["weight"])
        and torch.equal(naive["fsdp"]["weight"], _full_fsdp_weight(10)),
    }
    # 3. the tier's own load into a template, and without one (own structure).
    loaded, it = tier.load()
    mine_expected = _sharded_state(10, r, w)
    out["own_structure"] = (
        it,
        sorted(loaded),
        loaded["per_rank"],
        loaded["step"],
        loaded["sched"],
        torch.equal(loaded["fsdp"]["weight"], mine_expected["fsdp"]["weight"].data),
        all(torch.equal(loaded["model"][n], t) for n, t in _ddp_model(10).state_dict().items()),
    )
    # 4. the tier's load with a data-parallel group: two-stage, into a template.
    state, it = tier.load(_sharded_state(0, r, w), parallelization_group=dist.group.WORLD)
    out["tier_two_stage"] = (
        it,
        tier.last_load.two_stage,
        torch.equal(state["fsdp"]["weight"], mine_expected["fsdp"]["weight"].data),
        all(torch.equal(state["model"][n], t) for n, t in _ddp_model(10).state_dict().items()),
        state["per_rank"] == {"rank": r, "step": 10} and state["step"] == 10,
    )
    tier.close()
    mgr.close()
    return out


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    root = tmp_path_factory.mktemp("persist")
    results = run_ranks(_job, 2, root, ranks_per_node=1, timeout=150)
    return root, results


@pytest.mark.multiprocess
def test_flushed_checkpoint_loads_with_plain_dcp_into_ddp_and_dtensor_state_dicts(job):
    _, results = job
    for r in results:
        assert r["ddp_exact"] and r["dtensor_exact"]


@pytest.mark.multiprocess
def test_flush_writes_exactly_the_shards_the_memory_distribution_gave_each_rank(job):
    _, results = job
    dist_bytes = results[0]["dist_bytes"]
    for rank, r in enumerate(results):
        iteration, mine, total = r["flush"]
        assert iteration == 10
        assert mine == dist_bytes[rank]
        assert total == sum(dist_bytes)
    # Each replicated parameter written once: the stored tensors are the model, once.
    n_model = sum(t.numel() * t.element_size() for t in _ddp_model(0).state_dict().values())
    assert sum(dist_bytes) == n_model + FSDP_ROWS * FSDP_COLS * 4


@pytest.mark.multiprocess
def test_two_stage_load_reads_each_stored_entry_once_across_the_group(job):
    root, results = job
    reads = {}
    for r in results:
        ts = r["two_stage"]
        assert ts["equal"]
        for k, v in ts["reads"].items():
            reads[k] = reads.get(k, 0) + v
    md = read_metadata_file(Path(root) / "durable" / "iter_0000010" / ".metadata")
    stored_tensors = {
        f"{i.fqn}@{tuple(i.offset)}"
        for i in md.storage_data
        if i.offset is not None and not i.fqn.startswith("__")
    } - {k for k in ()}
    needed = {k for k in stored_tensors if k.startswith(("model.", "fsdp."))}
    assert set(reads) == needed and all(v == 1 for v in reads.values())
    total_two_stage = sum(r["two_stage"]["bytes"] for r in results)
    total_naive = sum(r["two_stage"]["naive_bytes"] for r in results)
    assert total_two_stage == results[0]["two_stage"]["naive_bytes"]  # the group read it once
    assert total_naive == 2 * total_two_stage  # every rank reading everything reads it twice
    assert sum(r["two_stage"]["entries_read"] for r in results) == results[0]["two_stage"]["entries_total"]


@pytest.mark.multiprocess
def test_tier_load_without_template_returns_each_ranks_own_structure(job):
    _, results = job
    for rank, r in enumerate(results):
        it, keys, per_rank, step, sched, fsdp_ok, model_ok = r["own_structure"]
        assert it == 10
        assert keys == ["fsdp", "model", "per_rank", "sched", "step"]
        assert per_rank == {"rank": rank, "step": 10}
        assert step == 10 and sched == {"lr": pytest.approx(1.0), "milestones": [1, 2, 3]}
        assert fsdp_ok and model_ok


@pytest.mark.multiprocess
def test_tier_load_with_a_data_parallel_group_is_two_stage_and_exact(job):
    _, results = job
    for r in results:
        assert r["tier_two_stage"] == (10, True, True, True, True)


def test_checkpoint_of_two_ranks_needs_a_template_to_load_in_one_process(job):
    root, _ = job
    tier = PersistentTier(Path(root) / "durable", session=SESSION)
    with pytest.raises(ForeignCheckpointError, match="world size 2.*Pass a template"):
        tier.load()
    # With a template the layout may differ: one process asks for whole tensors.
    template = {
        "fsdp": {"weight": ShardedTensor.from_rank_offsets("fsdp.weight", torch.zeros(FSDP_ROWS, FSDP_COLS))},
        "per_rank": ShardedObject("per_rank", None, (2,), (1,)),
    }
    state, it = tier.load(template)
    assert it == 10
    assert torch.equal(state["fsdp"]["weight"], _full_fsdp_weight(10))
    assert state["per_rank"] == {"rank": 1, "step": 10}
    assert state["step"] == 10  # common state comes with it


def test_tier_refuses_a_directory_of_another_session(job):
    root, _ = job
    other = PersistentTier(Path(root) / "durable", session="someone-else")
    with pytest.raises(ForeignCheckpointError, match="other sessions.*persist-test"):
        other.load()


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_export_writes_metadata_only_once_every_rank_is_exported(job, tmp_path, capsys):
    root, _ = job
    out = tmp_path / "exported"
    args = ["--session", SESSION, "--iteration", "20", "--to", str(out), "--no-fsync"]
    # Each simulated node's store holds its own rank and (replication factor 2) the other's.
    # Export from a copy of node 0's store with rank 1's replica removed: incomplete.
    node0 = tmp_path / "node0"
    shutil.copytree(node_store_root(str(root), 0), node0)
    store0 = CheckpointStore(node0, SESSION)
    store0.discard(CheckpointId(20, 1, SESSION), recycle=False)
    assert export_main(["--store-root", str(node0), *args]) == 0
    assert "ranks [1] of 2 still missing" in capsys.readouterr().out
    assert not (out / ".metadata").exists()
    assert inspect_main([str(out)]) == 1
    assert "missing ranks [1]" in capsys.readouterr().out
    # Node 1 holds both ranks; rank 0 is already exported, so only rank 1 is written.
    assert export_main(["--store-root", node_store_root(str(root), 1), *args]) == 0
    text = capsys.readouterr().out
    assert "exported ranks [1]" in text and "already exported" in text and "checkpoint complete" in text
    # A complete, standard DCP checkpoint: plain torch loads it.
    fresh = _ddp_model(5)
    sd = {"model": fresh.state_dict()}
    dcp.load(sd, checkpoint_id=str(out), no_dist=True)
    assert all(torch.equal(a, b) for a, b in zip(sd["model"].values(), _ddp_model(20).state_dict().values()))
    full = load_metadata_only(out)
    assert torch.equal(full["fsdp"]["weight"], _full_fsdp_weight(20))
    assert full["per_rank"] == {"shard_0_2": {"rank": 0, "step": 20}, "shard_1_2": {"rank": 1, "step": 20}}


def test_export_of_an_iteration_the_store_lacks_names_what_it_holds(job, tmp_path, capsys):
    root, _ = job
    rc = export_main(
        [
            "--store-root",
            node_store_root(str(root), 0),
            "--session",
            SESSION,
            "--iteration",
            "15",
            "--to",
            str(tmp_path / "x"),
        ]
    )
    assert rc == 1
    err = capsys.readouterr().err
    assert "no checkpoint of iteration 15" in err and "[10, 20]" in err


def test_inspect_lists_keys_shapes_dtypes_sizes_and_iteration(job, capsys):
    root, _ = job
    d = str(Path(root) / "durable" / "iter_0000010")
    assert inspect_main([d]) == 0
    text = capsys.readouterr().out
    assert "iteration 10 of session 'persist-test', world size 2" in text
    assert "fsdp.weight" in text and "(8, 3)" in text and "float32" in text and "96 B" in text
    assert "model.0.weight" in text and "(5, 6)" in text
    assert hollow_fqn(0) not in text
    assert inspect_main([d, "--json", "--all"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["iteration"] == 10 and info["tensor_bytes"] == 96 + sum(
        t.numel() * 4 for t in _ddp_model(0).state_dict().values()
    )
    keys = {e["key"]: e for e in info["entries"]}
    assert keys["fsdp.weight"]["chunks"] == 2 and keys[hollow_fqn(1)]["internal"]


def test_convert_writes_one_torch_save_file_equal_to_the_checkpoint(job, tmp_path, capsys):
    root, _ = job
    out = tmp_path / "model.pt"
    assert convert_main([str(Path(root) / "durable" / "iter_0000010"), "--to", str(out)]) == 0
    state = torch.load(out, weights_only=True)
    assert torch.equal(state["fsdp"]["weight"], _full_fsdp_weight(10))
    for n, t in _ddp_model(10).state_dict().items():
        assert torch.equal(state["model"][n], t)
    assert state["step"] == 10 and state["sched"]["milestones"] == [1, 2, 3]
    out2 = tmp_path / "only.pt"
    assert (
        convert_main([str(Path(root) / "durable" / "iter_0000010"), "--to", str(out2), "--keys", "fsdp"]) == 0
    )
    assert set(torch.load(out2, weights_only=True)) == {"fsdp"}


def test_inspect_and_convert_name_a_missing_or_truncated_metadata_file(job, tmp_path, capsys):
    root, _ = job
    d = tmp_path / "ckpt"
    shutil.copytree(Path(root) / "durable" / "iter_0000010", d)
    (d / ".metadata").write_bytes((d / ".metadata").read_bytes()[:40])
    assert inspect_main([str(d)]) == 1
    assert f"{d}/.metadata is truncated or corrupt" in capsys.readouterr().err
    (d / ".metadata").unlink()
    assert convert_main([str(d), "--to", str(tmp_path / "x.pt")]) == 1
    assert f"{d}/.metadata is missing" in capsys.readouterr().err


def test_a_missing_shard_file_is_named_before_anything_is_read(job, tmp_path):
    root, _ = job
    d = tmp_path / "ckpt"
    shutil.copytree(Path(root) / "durable" / "iter_0000010", d)
    (d / "__1_0.distcp").unlink()
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp is missing"):
        load_metadata_only(d)
    shutil.copy(Path(root) / "durable" / "iter_0000010" / "__1_0.distcp", d / "__1_0.distcp")
    with open(d / "__1_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match=r"__1_0\.distcp is truncated"):
        load_metadata_only(d)


# ---- fallback restore -------------------------------------------------------------------------


def _fallback(ctx):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    r, w = ctx.rank, ctx.world_size
    mgr = CheckpointManager(SESSION, ctx.store_root, replication_factor=2, ranks_per_node=1, keep_last=2)
    tier = _tier(ctx)
    for it in (10, 20):
        mgr.save_local(_sharded_state(it, r, w), it, is_async=False)
        tier.maybe_flush(mgr.store, it)  # how the manager reports complete saves
    tier.flush(mgr.store).wait()  # on demand: the newest complete one, 20
    template = _sharded_state(0, r, w)
    expected, it = mgr.load_local(_sharded_state(0, r, w))  # what the memory tier restores
    assert it == 20
    mgr.close()
    # Both copies of rank 1's data are lost: its own node's and the replica on the other node.
    store = CheckpointStore(ctx.store_root, SESSION)
    for cid in store.list():
        if cid.owner == 1:
            store.discard(cid, recycle=False)
    dist.barrier()
    mgr = CheckpointManager(SESSION, ctx.store_root, replication_factor=2, ranks_per_node=1, keep_last=2)
    tier2 = _tier(ctx)
    restored = restore_latest(mgr, tier2, template)
    state = restored.state_dict

    def same(a, b):
        if isinstance(a, dict):
            return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
        if isinstance(a, torch.Tensor):
            return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
        return a == b

    ok = same(state, expected)
    mgr.close()
    tier.close()
    tier2.close()
    return restored.tier, restored.iteration, restored.sources, ok, tier2.last_load.tier


@pytest.mark.multiprocess
def test_restore_falls_back_to_the_persistent_tier_on_every_rank_when_a_rank_is_lost(tmp_root):
    results = run_ranks(_fallback, 2, tmp_root, ranks_per_node=1, timeout=150)
    for tier, iteration, sources, same_as_memory, report in results:
        assert tier == "persistent" and report == "persistent"
        assert iteration == 20
        assert len(sources) == 2 and all(
            s.startswith("persistent:") and s.endswith("iter_0000020") for s in sources
        )
        assert same_as_memory  # exactly what load_local returned before the loss


# ---- periodic flush, SIGTERM, failures -------------------------------------------------------


def _periodic(ctx):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    r, w = ctx.rank, ctx.world_size
    # keep_last=10: the manager must not retire an iteration while it is being flushed (see
    # PersistentTier.pinned_iterations; test_failed_flush_... covers a segment reused mid-flush).
    mgr = CheckpointManager(SESSION, ctx.store_root, replication_factor=1, ranks_per_node=1, keep_last=10)
    tier = _tier(ctx, every_n_saves=2, keep_last=1)
    flushed = []
    for it in (1, 2, 3, 4, 5):
        mgr.save_local(_sharded_state(it, r, w), it, is_async=False)
        h = tier.maybe_flush(mgr.store, it)
        # Waited for here only so the test knows which iteration each flush wrote (a round
        # writes the newest complete iteration when it starts).
        flushed.append(None if h is None else h.wait(60).iteration)
    listing = [c.iteration for c in tier.list_complete()]
    thread_name = tier._thread.name
    # SIGTERM: the newest complete iteration (5) is flushed before the handler returns.
    tier.install_sigterm_handler(exit=False)
    os.kill(os.getpid(), signal.SIGTERM)
    after_sigterm = tier.latest_complete().iteration
    # Nothing newer: a second request is a no-op round on every rank.
    again = tier.flush(mgr.store).wait(60)
    tier.close()
    mgr.close()
    return flushed, listing, tier.sigterm_received, after_sigterm, again, thread_name


@pytest.mark.multiprocess
def test_periodic_flush_every_m_saves_keeps_last_k_and_sigterm_flushes_the_newest(tmp_root):
    for flushed, listing, got_sigterm, after_sigterm, again, thread in run_ranks(
        _periodic, 2, tmp_root, timeout=150
    ):
        assert flushed == [None, 2, None, 4, None]
        assert thread == "resilient_ckpt-flush"
        assert listing == [4]  # keep_last=1 removed iteration 2 once 4 was complete
        assert got_sigterm and after_sigterm == 5
        assert again is None
    durable = sorted(p.name for p in (Path(tmp_root) / "durable").iterdir())
    assert durable == ["iter_0000005"]


def _single_process_store(root: Path, iterations=(10,)):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    mgr = CheckpointManager(SESSION, str(root / "shm"), replication_factor=1, keep_last=len(iterations))
    for it in iterations:
        model = _ddp_model(it)
        mgr.save_local(
            {
                "model": {
                    n: ShardedTensor.from_rank_offsets(f"model.{n}", t) for n, t in model.state_dict().items()
                },
                "step": it,
            },
            it,
            is_async=False,
        )
    return mgr


def test_failed_flush_keeps_the_previous_durable_checkpoint_and_leaves_nothing_loadable(tmp_path):
    mgr = _single_process_store(tmp_path, (10, 20))
    tier = PersistentTier(tmp_path / "durable", session=SESSION, sync_files=False)
    assert tier.flush(mgr.store, 10).wait().iteration == 10
    # The store segment of iteration 20 changes under the flush (as when retention reuses it):
    # the post-write check against the store's checksums must fail the flush.
    data = mgr.store.data_path(CheckpointId(20, 0, SESSION))
    with open(data, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0xFF]))
    with pytest.raises(CorruptCheckpointError, match="changed while it was being written"):
        tier.flush(mgr.store, 20).wait()
    assert sorted(p.name for p in (tmp_path / "durable").iterdir()) == ["iter_0000010"]
    state, it = tier.load()
    assert it == 10 and state["step"] == 10
    assert tier.flushes_failed == 1
    tier.close()
    mgr.close()


def test_a_checkpoint_directory_without_metadata_is_never_chosen(tmp_path):
    mgr = _single_process_store(tmp_path, (10, 20))
    tier = PersistentTier(tmp_path / "durable", session=SESSION, sync_files=False)
    tier.flush(mgr.store, 10).wait()
    tier.flush(mgr.store, 20).wait()
    (tmp_path / "durable" / "iter_0000020" / ".metadata").unlink()  # as if the flush died last
    assert tier.latest_complete().iteration == 10
    state, it = tier.load()
    assert it == 10 and torch.equal(state["model"]["0.bias"], _ddp_model(10).state_dict()["0.bias"])
    tier.close()
    mgr.close()


def test_flush_reads_the_store_segment_through_a_mapping_without_copies(tmp_path):
    mgr = _single_process_store(tmp_path)
    snap = StoreSnapshot(mgr.store, 10, 0)
    sd = snap.state_dict()
    w = sd["model"]["0.weight"].data
    # The tensor is a view of the mapped segment whose storage is exactly its bytes (DCP's
    # writer then saves it without cloning it).
    assert w.untyped_storage().size() == w.numel() * w.element_size()
    assert torch.equal(w, _ddp_model(10).state_dict()["0.weight"])
    assert isinstance(sd[hollow_fqn(0)].data, bytes)
    snap.verify()
    snap.close()
    mgr.close()


def test_sigterm_handler_flushes_then_hands_the_signal_to_the_previous_handler(tmp_path):
    mgr = _single_process_store(tmp_path)
    tier = PersistentTier(tmp_path / "durable", session=SESSION, sync_files=False)
    tier.note_complete(mgr.store, 10)
    seen = []
    old = signal.signal(signal.SIGTERM, lambda s, f: seen.append(tier.latest_complete()))
    try:
        tier.install_sigterm_handler()
        os.kill(os.getpid(), signal.SIGTERM)
        assert len(seen) == 1 and seen[0].iteration == 10  # durable before the old handler ran
    finally:
        signal.signal(signal.SIGTERM, old)
        tier.close()
        mgr.close()


def test_tier_arguments_are_validated(tmp_path):
    with pytest.raises(CheckpointingException, match="every_n_saves"):
        PersistentTier(tmp_path, every_n_saves=-1)
    with pytest.raises(CheckpointingException, match="keep_last"):
        PersistentTier(tmp_path, keep_last=0)


def test_persistent_tier_provides_what_the_manager_uses_of_a_tier(tmp_path):
    """PersistentTierProtocol lists what CheckpointManager calls on its tier (checked against
    the manager's source); PersistentTier has each member, accepting the same arguments."""
    import inspect
    import re

    import resilient_ckpt.manager as manager_pkg
    from resilient_ckpt.persistent.interface import PersistentTierProtocol

    methods = {n for n, v in vars(PersistentTierProtocol).items() if callable(v) and not n.startswith("_")}
    attributes = set(PersistentTierProtocol.__annotations__)
    used = set()
    for src in Path(manager_pkg.__file__).parent.glob("*.py"):
        used |= set(re.findall(r"\b(?:self\._tier|tier)\.([A-Za-z_]\w*)", src.read_text()))
    assert used == methods | attributes

    tier: PersistentTierProtocol = PersistentTier(tmp_path / "durable", session=SESSION, sync_files=False)
    try:
        for name in attributes:
            assert hasattr(tier, name), name
        for name in methods:
            wanted = inspect.signature(getattr(PersistentTierProtocol, name)).parameters
            offered = inspect.signature(getattr(PersistentTier, name)).parameters
            for p in wanted.values():
                assert p.name in offered and offered[p.name].kind == p.kind, (name, p.name)
            extra = [p for n, p in offered.items() if n not in wanted]
            assert all(p.default is not inspect.Parameter.empty for p in extra), (name, extra)
    finally:
        tier.close()
