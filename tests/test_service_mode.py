"""Service mode with real processes: daemon processes per simulated node (own store root and
port on loopback) and trainer ranks from the shared harness, killed with SIGKILL where the
scenario says so. What is checked is what a user relies on: replicas land (bit-exact) even if
the trainer dies at once, a replaced node gets its ranks back before its trainers start, and a
daemon dying mid-transfer never leaves a partial checkpoint visible."""

from __future__ import annotations

import shutil

import pytest
import torch

from harness import run_ranks
from resilient_ckpt.errors import ReplicationError
from resilient_ckpt.memory.layout import CheckpointId
from resilient_ckpt.memory.store import CheckpointStore
from resilient_ckpt.service.client import DaemonClient
from resilient_ckpt.service.daemon import FAULTS_ENV
from test_daemon import (
    SESSION,
    DaemonProcess,
    ProcessCluster,
    checkpoint_files,
    commit,
    publish_checkpoint,
    service_mode_example,
    service_mode_load,
    wait_for,
)

pytestmark = pytest.mark.multiprocess


def _rank_tensors(rank: int, iteration: int):
    g = torch.Generator().manual_seed(1000 * iteration + rank)
    return [torch.randn(50_000, generator=g), torch.randint(0, 1 << 30, (3, 1000), generator=g)]


# --------------------------------------------------------------------------- trainers die


def _save_commit_and_die(ctx, endpoints, nbytes):
    store = CheckpointStore(ctx.store_root, SESSION)
    header = publish_checkpoint(
        store, 100, ctx.rank, ctx.world_size, ranks_per_node=ctx.ranks_per_node, nbytes=nbytes
    )
    # secret from RESILIENT_CKPT_SECRET_FILE, like a trainer launched with the job's environment
    with DaemonClient(endpoints[ctx.node], SESSION, timeout_s=30, rank=ctx.rank) as c:
        commit(c, store, header)  # answered: the daemon owns the replication from here on
    ctx.kill_self()


def test_replication_completes_after_trainers_are_killed_right_after_commit(tmp_path):
    pc = ProcessCluster(tmp_path, 2).start()
    try:
        run_ranks(
            _save_commit_and_die,
            4,
            tmp_path,
            ranks_per_node=2,
            args=(pc.eps, 8_000_000),
            expect_killed=[0, 1, 2, 3],
            extra_env=pc.trainer_env,
        )
        for owner in range(4):
            holder = 1 - owner // 2
            with pc.nodes[holder].client() as c:
                wait_for(
                    lambda owner=owner: any(h.owner == owner and h.iteration == 100 for h in c.list()),
                    what=f"the replica of rank {owner} on node {holder}",
                )
            assert checkpoint_files(tmp_path / f"node{holder}", SESSION, 100, owner) == checkpoint_files(
                tmp_path / f"node{owner // 2}", SESSION, 100, owner
            )
    finally:
        pc.stop()


# --------------------------------------------------------------------------- node replacement


def _train_and_save(ctx, endpoints, iterations):
    store = CheckpointStore(ctx.store_root, SESSION)
    with DaemonClient(endpoints[ctx.node], SESSION, timeout_s=30, rank=ctx.rank) as c:
        for it in iterations:
            service_mode_example(
                c, store, ctx.rank, ctx.world_size, ctx.ranks_per_node, it, _rank_tensors(ctx.rank, it)
            )
    return True


def test_a_replacement_node_pulls_its_ranks_from_peers_bit_exact(tmp_path):
    pc = ProcessCluster(tmp_path, 3).start()
    try:
        run_ranks(
            _train_and_save, 6, tmp_path, ranks_per_node=2, args=(pc.eps, (10, 20)), extra_env=pc.trainer_env
        )
        originals = {o: checkpoint_files(tmp_path / "node1", SESSION, 20, o) for o in (2, 3)}
        # node 1 is lost: its daemon and its memory
        pc.nodes[1].kill()
        shutil.rmtree(tmp_path / "node1")
        fresh = DaemonProcess(1, tmp_path / "node1-replacement", pc.eps[1], pc.eps, pc.secret_file, tmp_path)
        fresh.start("--recover", SESSION, "--recover-timeout", "60")
        fresh.wait_ready()
        with fresh.client() as c:
            report = c.wait_recovered(timeout=60)
            assert report["state"] == "done" and report["iteration"] == 20 and report["owners"] == [2, 3]
            assert sorted((h.iteration, h.owner) for h in c.list()) == [(20, 2), (20, 3)]
            new_store = CheckpointStore(tmp_path / "node1-replacement", SESSION)
            for owner in (2, 3):
                assert (
                    checkpoint_files(tmp_path / "node1-replacement", SESSION, 20, owner) == originals[owner]
                )
                restored = service_mode_load(c, new_store, 20, owner)  # local now, no fetch needed
                assert all(torch.equal(a, b) for a, b in zip(restored, _rank_tensors(owner, 20)))
        fresh.kill()
    finally:
        pc.stop()


# --------------------------------------------------------------------------- daemons die mid-transfer


def test_a_receiver_killed_mid_replication_leaves_no_partial_replica_and_a_retry_completes(tmp_path):
    pc = ProcessCluster(
        tmp_path,
        2,
        "--peer-timeout",
        "2",
        "--retries",
        "1",
        "--chunk-bytes",
        "256K",
        "--credit-bytes",
        "1M",
        env_by_node={1: {FAULTS_ENV: "hold_inbound_after_chunks=2"}},
    ).start()
    try:
        store0 = CheckpointStore(tmp_path / "node0", SESSION)
        header = publish_checkpoint(store0, 10, 0, 4, ranks_per_node=2, nbytes=8_000_000)
        with pc.nodes[0].client() as c0, pc.nodes[1].client() as c1:
            commit(c0, store0, header)
            wait_for(
                lambda: [t for t in c1.status()["inbound"] if t["received"] == 2 * 256 * 1024],
                what="node 1 holding a half-received replica",
            )
            pc.nodes[1].kill()
            with pytest.raises(ReplicationError, match="node 1"):
                c0.wait_replicated(10, 0, timeout=30)
        failed = pc.nodes[0].events("replication_failed")
        assert failed and failed[-1]["peer"] == "node-1" and failed[-1]["iteration"] == 10
        assert any("lost" in ev.get("reason", "") for ev in pc.nodes[0].events("replication_retry"))
        node1 = tmp_path / "node1" / SESSION
        cid = CheckpointId(10, 0, SESSION)
        assert not (node1 / f"{cid.stem()}.hdr").exists() and not (node1 / f"{cid.stem()}.data").exists()
        assert any(p.name.startswith("rsv_") for p in (node1 / "free").iterdir())  # the partial copy, unnamed
        pc.nodes[1].start(env={FAULTS_ENV: ""})
        pc.nodes[1].wait_ready()
        with pc.nodes[0].client() as c0:
            assert commit(c0, store0, header, wait_s=20).state == "replicated"
        assert not any(p.name.startswith("rsv_") for p in (node1 / "free").iterdir())  # swept at restart
        assert checkpoint_files(tmp_path / "node1", SESSION, 10, 0) == checkpoint_files(
            tmp_path / "node0", SESSION, 10, 0
        )
    finally:
        pc.stop()


def test_a_sender_killed_mid_transfer_leaves_nothing_visible_on_the_receiver(tmp_path):
    pc = ProcessCluster(
        tmp_path,
        2,
        "--chunk-bytes",
        "256K",
        "--credit-bytes",
        "1M",
        "--inbound-timeout",
        "1",
        env_by_node={0: {FAULTS_ENV: "hold_outbound_after_chunks=2"}},
    ).start()
    try:
        store0 = CheckpointStore(tmp_path / "node0", SESSION)
        header = publish_checkpoint(store0, 10, 0, 4, ranks_per_node=2, nbytes=4_000_000)
        with pc.nodes[0].client() as c0, pc.nodes[1].client() as c1:
            commit(c0, store0, header)
            wait_for(
                lambda: [t for t in c1.status()["inbound"] if t["received"] == 2 * 256 * 1024],
                what="node 1 receiving",
            )
            pc.nodes[0].kill()
            wait_for(lambda: not c1.status()["inbound"], what="node 1 to drop the orphaned transfer")
            assert c1.list() == []
        aborted = pc.nodes[1].events("transfer_aborted")
        assert aborted and aborted[0]["peer"] == "node-0" and "disappeared" in aborted[0]["reason"]
        assert not list((tmp_path / "node1" / SESSION).glob("iter_*"))
    finally:
        pc.stop()
