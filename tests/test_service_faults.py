"""Faults an operator found with real daemon processes (fault-tolerance issue, item 8):

1. an authenticated DROP captured before a daemon restart and replayed after it;
2. a peer that sends REPLICATE_BEGIN for a large checkpoint and then nothing;
3. a client whose clock is skewed beyond the replay window.

Daemons run as real processes (``python -m resilient_ckpt.service.daemon``) on loopback, each
with its own port and store root; ordering is by polling with deadlines, never by sleeping.
"""

from __future__ import annotations

import datetime
import threading
import time
from pathlib import Path

import pytest
import zmq

from harness import free_port
from resilient_ckpt.memory.store import CheckpointStore
from resilient_ckpt.service.client import ClockSkewError, DaemonClient, DaemonError, Rpc
from resilient_ckpt.service.daemon import Daemon, DaemonConfig
from resilient_ckpt.service.wire import (
    ErrorCode,
    Message,
    MessageType,
    PeerTimeout,
    configure_socket,
    decode,
    encode,
    recv_raw_from,
    send,
)
from test_daemon import (
    AUTH,
    SESSION,
    Cluster,
    ProcessCluster,
    RawPeer,
    checkpoint_files,
    commit,
    publish_checkpoint,
    wait_for,
)

MiB = 1 << 20


def captured(endpoint: str, mtype: MessageType, body: dict, req_id: int) -> list:
    """The frames a DaemonClient sends for this request (its own Rpc.message and encode), as
    someone on the wire would capture them."""
    rpc = Rpc(endpoint, AUTH, sender="operator@cli")
    try:
        return [bytes(f) for f in encode(rpc.message(mtype, SESSION, body, req_id=req_id), AUTH)]
    finally:
        rpc.close()


def drop_frames(endpoint: str, iteration: int, owner: int, req_id: int) -> list:
    return captured(
        endpoint, MessageType.DROP, {"ids": [{"iteration": iteration, "owner_rank": owner}]}, req_id
    )


def started_ns(status: dict) -> int:
    return int(datetime.datetime.fromisoformat(status["started_at"]).timestamp() * 1e9)


# --------------------------------------------------------------------------- 1. replay after restart


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_drop_captured_before_a_restart_is_refused_after_it_and_deletes_nothing(tmp_path):
    pc = ProcessCluster(tmp_path, 1).start()
    node, root = pc.nodes[0], tmp_path / "node0"
    try:
        store = CheckpointStore(root, SESSION)
        publish_checkpoint(store, 10, 0, 4, ranks_per_node=2, seed=1)
        publish_checkpoint(store, 20, 0, 4, ranks_per_node=2)
        # An operator drops iteration 10; someone on the wire keeps the DROP.
        drop_10 = drop_frames(node.endpoint, 10, 0, req_id=1)
        peer = RawPeer(node.endpoint)
        peer.send_frames(drop_10)
        reply = peer.recv(timeout_ms=10_000)
        assert reply.type is MessageType.OK and reply.body["result"]["dropped"] == 1
        peer.close()
        # A DROP of iteration 20 that was captured but never delivered.
        drop_20 = drop_frames(node.endpoint, 20, 0, req_id=2)
        # The job re-runs from an older checkpoint and saves iteration 10 again: a newer save.
        publish_checkpoint(store, 10, 0, 4, ranks_per_node=2, seed=2)
        before = {it: checkpoint_files(root, SESSION, it, 0) for it in (10, 20)}

        node.kill()
        node.start()
        node.wait_ready()

        peer = RawPeer(node.endpoint)
        try:
            for frames in (drop_10, drop_20):  # well within the ±60 s window of their timestamps
                peer.send_frames(frames)
                reply = peer.recv(timeout_ms=10_000)
                assert reply.type is MessageType.ERROR and reply.body["code"] == ErrorCode.REPLAYED.value
                assert "predates this daemon's start" in reply.body["message"]
                assert "a replay, or a message sent before the restart" in reply.body["message"]
                assert "resend" in reply.body["message"]
        finally:
            peer.close()
        assert {it: checkpoint_files(root, SESSION, it, 0) for it in (10, 20)} == before
        with node.client() as c:
            status = c.status()
            # and wait_ready's first HELLO, when it was encoded before the daemon was up
            assert status["rejected"].get("predates_start", 0) >= 2
            start = started_ns(status)
        logged = [
            e
            for e in node.events("message_rejected")
            if e.get("reason") == "predates_start" and "operator@cli" in e.get("peer", "")
        ]
        assert len(logged) == 2 and "predates this daemon's start" in logged[0]["error"]

        # A client whose clock reads a little before the daemon's start catches up and resends
        # a fresh message by itself; one far behind is told its clock is the problem.
        lag = time.time_ns() - start + 300_000_000
        with DaemonClient(node.endpoint, SESSION, AUTH, timeout_s=5, clock=lambda: time.time_ns() - lag) as c:
            assert {h.iteration for h in c.list()} == {10, 20}
        lag = time.time_ns() - start + 30 * 10**9
        with DaemonClient(
            node.endpoint, SESSION, AUTH, timeout_s=2, retries=0, clock=lambda: time.time_ns() - lag
        ) as c:
            with pytest.raises(DaemonError, match="predates this daemon's start") as err:
                c.status()
            assert "behind the daemon's clock" in str(err.value) and "NTP" in str(err.value)
        # The operator's own fresh DROP after the restart is executed.
        with node.client() as c:
            assert c.drop([(20, 0)]) == 1
        assert [(i.iteration, i.owner) for i in store.list()] == [(10, 0)]
    finally:
        pc.stop()


def test_a_drop_never_removes_a_save_published_after_it_was_sent(tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="resilient_ckpt.daemon")
    c = Cluster(tmp_path, 1)
    try:
        store = c.store(0)
        publish_checkpoint(store, 10, 0, 4, ranks_per_node=2, seed=1)
        late = drop_frames(c.eps[0], 10, 0, req_id=5)  # sent now, delivered late
        sent_ns = decode(late, AUTH, expected_session=None, replay_guard=None).timestamp_ns
        probe = tmp_path / "fs-clock"
        # file times come from a coarse clock (one tick behind): the new save must be stamped later
        wait_for(
            lambda: probe.write_bytes(b"x") is not None and probe.stat().st_mtime_ns > sent_ns,
            timeout=5,
            what="the filesystem clock to pass the DROP's timestamp",
        )
        store.discard(store.list()[0])
        publish_checkpoint(store, 10, 0, 4, ranks_per_node=2, seed=2)  # saved again meanwhile
        before = checkpoint_files(c.root(0), SESSION, 10, 0)
        peer = RawPeer(c.eps[0])
        try:
            peer.send_frames(late)
            reply = peer.recv(timeout_ms=5000)
        finally:
            peer.close()
        assert reply.type is MessageType.OK and reply.body["result"]["dropped"] == 0
        assert checkpoint_files(c.root(0), SESSION, 10, 0) == before
        assert any(getattr(r, "event", None) == "drop_kept_newer" for r in caplog.records)
    finally:
        c.stop()


# --------------------------------------------------------------------------- 2. silent BEGIN


def _silent_begin(endpoint: str, total: int, *, iteration: int = 9, owner: int = 1) -> RawPeer:
    """A peer that announces a checkpoint of ``total`` bytes and then sends nothing."""
    peer = RawPeer(endpoint)
    peer.send(
        Message(
            type=MessageType.HELLO,
            session=SESSION,
            sender="node-7",
            req_id=1,
            body={"min_version": 1, "max_version": 1, "role": "daemon"},
        )
    )
    assert peer.recv(timeout_ms=10_000).type is MessageType.HELLO_OK
    chunk = 256 << 10
    peer.send(
        Message(
            type=MessageType.REPLICATE_BEGIN,
            session=SESSION,
            sender="node-7",
            req_id=2,
            body={
                "iteration": iteration,
                "owner_rank": owner,
                "world_size": 4,
                "total_bytes": total,
                "chunk_bytes": chunk,
                "num_chunks": -(-total // chunk),
            },
        )
    )
    return peer


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_peer_silent_after_begin_does_not_keep_a_legitimate_replica_out(tmp_path):
    # The inbound timeout is an hour: the replica below must get in without it.
    pc = ProcessCluster(
        tmp_path,
        2,
        "--memory-budget",
        "48M",
        "--credit-bytes",
        "1M",
        "--chunk-bytes",
        "256K",
        "--inbound-timeout",
        "3600",
        "--peer-timeout",
        "10",
        "--retries",
        "0",
    ).start()
    silent = None
    try:
        announced = 47 * MiB  # with the whole of it reserved, a 2 MB replica would not fit 48M
        silent = _silent_begin(pc.eps[1], announced)
        with pc.nodes[1].client() as c1:
            (held,) = wait_for(
                lambda: c1.status()["inbound"], what="the silent transfer to be open on node 1"
            )
            assert held["total_bytes"] == announced and held["received"] == 0
            assert held["reserved_bytes"] <= 1 * MiB
            assert c1.status()["store"]["total_bytes"] <= 2 * MiB  # memory actually held

        store0 = CheckpointStore(tmp_path / "node0", SESSION)
        header = publish_checkpoint(store0, 10, 0, 4, ranks_per_node=2, nbytes=2_000_000)
        t0 = time.monotonic()
        with pc.nodes[0].client() as c0:
            state = commit(c0, store0, header, wait_s=15)
        assert state.state == "replicated", state.error
        assert time.monotonic() - t0 < 5
        assert checkpoint_files(tmp_path / "node1", SESSION, 10, 0) == checkpoint_files(
            tmp_path / "node0", SESSION, 10, 0
        )
        with pc.nodes[1].client() as c1:
            still = [t for t in c1.status()["inbound"] if t["peer"] == "node-7"]
            assert still and still[0]["received"] == 0  # not timed out: it simply held no room
    finally:
        if silent is not None:
            silent.close()
        pc.stop()


def test_a_silent_transfer_on_a_reused_segment_gives_its_pages_back_under_pressure(tmp_path):
    budget = 90 * MiB
    c = Cluster(
        tmp_path,
        2,
        per_node={1: {"memory_budget": budget, "credit_bytes": 1 * MiB, "inbound_timeout_s": 3600}},
    )
    silent = None
    try:
        store1 = c.store(1)
        pooled = store1.reserve(44 * MiB)  # a retired checkpoint's segment, back in the pool
        store1.release(pooled)
        silent = _silent_begin(c.eps[1], 44 * MiB)  # takes that segment: 44 MiB of pages
        with c.client(1) as c1:
            wait_for(lambda: c1.status()["inbound"], what="the silent transfer to be open on node 1")
            assert not list(store1.free_dir.glob("seg_*"))  # it reused the pooled segment
        publish_checkpoint(store1, 10, 2, 4, ranks_per_node=2, nbytes=45 * MiB)  # node 1's own save
        # 44 (silent) + 45 (own) + 2 > 90: the silent transfer's unwritten pages must go
        store0 = c.store(0)
        header = publish_checkpoint(store0, 10, 0, 4, ranks_per_node=2, nbytes=2_000_000)
        with c.client(0) as c0:
            state = commit(c0, store0, header, wait_s=10)
        assert state.state == "replicated", state.error
        with c.client(1) as c1:
            status = c1.status()
        assert status["store"]["total_bytes"] <= budget
        (held,) = [t for t in status["inbound"] if t["peer"] == "node-7"]
        assert held["reserved_bytes"] <= 1 * MiB
    finally:
        if silent is not None:
            silent.close()
        c.stop()


# --------------------------------------------------------------------------- 3. clock skew


@pytest.mark.multiprocess
@pytest.mark.timeout(60)
def test_a_client_with_a_skewed_clock_is_told_so_instead_of_timing_out(tmp_path):
    pc = ProcessCluster(tmp_path, 1).start()
    node = pc.nodes[0]
    try:
        store = CheckpointStore(tmp_path / "node0", SESSION)
        publish_checkpoint(store, 10, 0, 4, ranks_per_node=2)
        for skew_s in (+400.0, -400.0):
            offset = int(skew_s * 1e9)
            with DaemonClient(
                node.endpoint,
                SESSION,
                AUTH,
                timeout_s=5,
                retries=2,
                clock=lambda offset=offset: time.time_ns() + offset,
            ) as c:
                t0 = time.monotonic()
                with pytest.raises(ClockSkewError) as err:
                    c.drop([(10, 0)])
                assert time.monotonic() - t0 < 4  # an answer, not the end of a 5 s attempt
                text = str(err.value)
                assert "clock skew" in text and f"{skew_s:+.0f}." in text and "node 0" in text
                assert "NTP" in text and err.value.code is ErrorCode.CLOCK_SKEW
                assert err.value.skew_s == pytest.approx(skew_s, abs=5)
                with pytest.raises(ClockSkewError):
                    c.wait_ready(timeout=5)  # not retried as if the daemon were still starting
        assert [(i.iteration, i.owner) for i in store.list()] == [(10, 0)]  # never executed
        with node.client() as c:
            assert c.status()["rejected"].get("stale", 0) >= 4
    finally:
        pc.stop()


def test_a_timeout_blames_the_clock_only_when_an_answer_showed_skew():
    """A peer whose answers come back outside the window (e.g. a daemon that predates the
    CLOCK_SKEW answer): the timeout names the skew; with no evidence it does not."""
    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    configure_socket(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    stop = threading.Event()

    def skewed_daemon():
        while not stop.is_set():
            try:
                rid, label, frames = recv_raw_from(router, timeout_ms=100)
            except PeerTimeout:
                continue
            msg = decode(frames, AUTH, expected_session=None, replay_guard=None, peer=label)
            answer = Message(
                type=MessageType.OK,
                session=msg.session,
                sender="old-daemon",
                req_id=msg.req_id + 1,
                body={"op": int(msg.type)},
                timestamp_ns=time.time_ns() - 400 * 10**9,
            )
            send(router, answer, AUTH, to=rid, timeout_ms=1000)

    t = threading.Thread(target=skewed_daemon, daemon=True)
    t.start()
    try:
        with DaemonClient(f"tcp://127.0.0.1:{port}", SESSION, AUTH, timeout_s=0.5, retries=0) as c:
            with pytest.raises(PeerTimeout) as err:
                c.status()
        assert "-400." in str(err.value) and "synchronise clocks" in str(err.value)
        with DaemonClient(f"tcp://127.0.0.1:{free_port()}", SESSION, AUTH, timeout_s=0.3, retries=0) as c:
            with pytest.raises(PeerTimeout) as err:
                c.status()
        assert "clock" not in str(err.value) and "secret" in str(err.value)
    finally:
        stop.set()
        t.join(5)
        router.close(0)
        ctx.term()


def test_the_replay_guard_refuses_what_predates_its_floor_and_names_the_start():
    from resilient_ckpt.service.wire import PredatesStart, StaleMessage
    from resilient_ckpt.service.wire.auth import ReplayGuard

    now = [10**18]
    guard = ReplayGuard(window_s=60, clock=lambda: now[0], not_before_ns=now[0])
    with pytest.raises(PredatesStart, match="predates this daemon's start at .* by 1.000 s") as err:
        guard.check(b"a" * 16, now[0] - 10**9)
    assert err.value.reason == "predates_start" and err.value.code is ErrorCode.REPLAYED
    guard.check(b"b" * 16, now[0])  # from the start on: accepted
    with pytest.raises(StaleMessage, match="clock skew") as err:  # skew is named before the start
        guard.check(b"c" * 16, now[0] - 400 * 10**9)
    assert err.value.skew_s == pytest.approx(-400) and err.value.code is ErrorCode.CLOCK_SKEW


def test_an_in_process_daemon_refuses_a_message_encoded_before_it_started(tmp_path):
    frames = captured("tcp://unused:1", MessageType.STATUS, {}, req_id=3)
    d = Daemon(
        DaemonConfig(store_root=str(Path(tmp_path) / "n"), bind=f"tcp://127.0.0.1:{free_port()}"), AUTH
    ).start()
    try:
        peer = RawPeer(d.endpoint)
        try:
            peer.send_frames(frames)
            reply = peer.recv(timeout_ms=5000)
        finally:
            peer.close()
        assert (
            reply.type is MessageType.ERROR and reply.body["code"] == "REPLAYED" and reply.body["retryable"]
        )
        assert reply.body["daemon_start_ns"] == d.started_ns and d.rejects["predates_start"] == 1
    finally:
        d.stop()
