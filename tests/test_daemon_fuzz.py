"""A live daemon process under a flood of malformed, unauthenticated, replayed and
wrong-session messages through a real DEALER socket: it must stay up and answer STATUS, its
store must not change by a single byte, and every rejected message must be counted."""

from __future__ import annotations

import os
import random
import time

import msgpack
import pytest
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_ckpt.memory.store import CheckpointStore
from resilient_ckpt.service.wire import (
    PROTOCOL_VERSION,
    Message,
    MessageType,
    ProtocolError,
    configure_socket,
    decode,
    encode,
)
from resilient_ckpt.service.wire.auth import Authenticator, ReplayGuard, generate_secret
from test_daemon import AUTH, SESSION, ProcessCluster, publish_checkpoint, tree_snapshot

pytestmark = pytest.mark.multiprocess

WRONG_AUTH = Authenticator(generate_secret())
REQUEST_TYPES = [
    t
    for t in MessageType
    if t
    not in (MessageType.HELLO, MessageType.OK, MessageType.HELLO_OK, MessageType.ERROR, MessageType.CREDIT)
]
plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(1 << 63), (1 << 64) - 1)
    | st.floats(allow_nan=False)
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=10,
)


class Flood:
    """Sends frames to the daemon and drains whatever it answers (ERRORs, HELLO_OKs)."""

    def __init__(self, endpoint: str):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        configure_socket(self.sock)
        self.sock.setsockopt(zmq.SNDTIMEO, 10_000)
        self.sock.connect(endpoint)
        self.sent = 0
        self.expected_rejects = 0
        self.answers = []

    def send(self, frames, *, rejected: bool = True) -> None:
        self.sock.send_multipart([bytes(f) for f in frames], copy=True)
        self.sent += 1
        self.expected_rejects += rejected
        while self.sock.poll(0):
            self.answers.append(self.sock.recv_multipart())

    def wait_handled(self, timeout_s: float = 60.0) -> None:
        """Return once the daemon handled everything sent so far. A STATUS on this connection is
        answered only after every message sent before it (one connection's messages arrive and
        are handled in order); a STATUS on another connection would not wait for them (the
        ROUTER reads its connections in turn), so a daemon behind the flood would count fewer
        rejections than were sent. Sent again when its answer does not come: a daemon drops
        the answers of a peer that does not read fast enough instead of blocking on it."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            req_id = random.getrandbits(63)
            marker = encode(
                Message(type=MessageType.STATUS, session=SESSION, sender="fuzzer", req_id=req_id), AUTH
            )
            self.sock.send_multipart([bytes(f) for f in marker], copy=True)
            retry_at = time.monotonic() + 5.0
            while time.monotonic() < min(retry_at, deadline):
                if not self.sock.poll(100):
                    continue
                answer = self.sock.recv_multipart()
                self.answers.append(answer)
                header = msgpack.unpackb(answer[0], raw=False)
                if header["req_id"] == req_id and header["type"] == int(MessageType.OK):
                    return
        raise AssertionError(
            f"the daemon did not answer a STATUS sent after the flood within {timeout_s:g} s"
        )

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def signed(header: dict, frames=(), auth: Authenticator = AUTH) -> list:
    raw = msgpack.packb(header, use_bin_type=True)
    views = [memoryview(f) for f in frames]
    return [raw, *views, auth.sign(raw, views)]


def envelope(mtype: int, body, **over) -> dict:
    h = {
        "version": PROTOCOL_VERSION,
        "type": mtype,
        "session": SESSION,
        "sender": "fuzzer",
        "req_id": 1,
        "nonce": os.urandom(16),
        "ts": time.time_ns(),
        "body": body,
    }
    h.update(over)
    return h


# The reference decoder's replay guard, kept across the flood like the daemon's: hypothesis
# readily generates the same 16-byte value twice for the nonce field, and the daemon rejects
# the second one as a replay.
_MODEL_GUARD = ReplayGuard()


def would_accept(frames) -> bool:
    """What the reference decoder says (a changed field may still be valid, e.g. version=1)."""
    try:
        decode(frames, AUTH, expected_session=SESSION, replay_guard=_MODEL_GUARD)
        return True
    except ProtocolError:
        return False


def valid_status() -> list:
    return [
        bytes(f) for f in encode(Message(type=MessageType.STATUS, session=SESSION, sender="fuzzer"), AUTH)
    ]


# One scenario told in order (six kinds of hostile traffic, then the checks): kept as one
# function so the flood and its accounting read top to bottom.
def test_ten_thousand_hostile_messages_change_nothing_and_are_all_counted(tmp_path):  # noqa: C901
    root = tmp_path / "node0"
    store = CheckpointStore(root, SESSION)
    for it in (10, 20):
        for owner in (0, 1):
            publish_checkpoint(store, it, owner, 4, ranks_per_node=2, nbytes=50_000)
    pc = ProcessCluster(tmp_path, 1, "--session", SESSION).start()
    daemon = pc.nodes[0]
    t_start = time.monotonic()
    try:
        before = tree_snapshot(root)
        with daemon.client() as c:
            rejected_before = sum(c.status()["rejected"].values())
        flood = Flood(daemon.endpoint)
        rnd = random.Random(1234)

        # 1. raw garbage: random frames, random counts (never a valid tag)
        for _ in range(3000):
            n = rnd.choice([0, 1, 1, 2, 2, 3, 5, 17, 20])
            frames = [rnd.randbytes(rnd.choice([0, 1, 33, 64, 200, 1000])) for _ in range(n)]
            flood.send(frames or [b""])

        # 2. valid messages mutated after signing: flipped, truncated, grown, dropped, reordered
        base = [
            valid_status(),
            [
                bytes(f)
                for f in encode(
                    Message(
                        type=MessageType.DROP,
                        session=SESSION,
                        sender="fuzzer",
                        body={"ids": [{"iteration": 10, "owner_rank": 0}]},
                    ),
                    AUTH,
                )
            ],
        ]
        for _ in range(2000):
            frames = list(rnd.choice(base))
            i = rnd.randrange(len(frames))
            f = bytearray(frames[i])
            op = rnd.choice(["flip", "cut", "grow", "drop", "swap"])
            if op == "flip" and f:
                f[rnd.randrange(len(f))] ^= rnd.randrange(1, 256)
            elif op == "cut":
                del f[rnd.randrange(len(f) + 1) - 1 if f else 0 :]
                if bytes(f) == frames[i]:
                    f = f[:-1] if f else bytearray(b"x")
            elif op == "grow":
                f.insert(rnd.randrange(len(f) + 1), rnd.randrange(256))
            elif op == "drop":
                del frames[i]
                f = None
            elif op == "swap":
                frames[0], frames[-1] = frames[-1], frames[0]
                f = None
            if f is not None:
                frames[i] = bytes(f)
            flood.send(frames or [b""])

        # 3. correctly signed by someone with another secret
        for _ in range(1000):
            flood.send(signed(envelope(int(MessageType.STATUS), {}), auth=WRONG_AUTH))

        # 4. authenticated but wrong: other sessions, future versions, unknown types, bad bodies
        for k in range(1000):
            kind = k % 4
            if kind == 0:
                h = envelope(
                    int(MessageType.DROP),
                    {"ids": [{"iteration": 10, "owner_rank": 0}]},
                    session=rnd.choice(["other-job", "../escape", ".hidden", "x" * 200]),
                )
            elif kind == 1:
                h = envelope(int(MessageType.STATUS), {}, version=rnd.choice([0, 2, 9, 65535]))
            elif kind == 2:
                h = envelope(rnd.choice([0, 14, 99, 4096]), {})
            else:
                h = envelope(int(rnd.choice(REQUEST_TYPES)), {"iteration": 10, "owner_rank": 0, "zz_fuzz": k})
            flood.send(signed(h))

        # 5. replays of an accepted, harmless request
        for _ in range(500):
            frames = valid_status()
            flood.send(frames, rejected=False)
            flood.send(frames)

        # 6. over the limits: headers over 64 KiB, more than 16 data frames
        for k in range(200):
            if k % 2:
                flood.send([b"\x80" + os.urandom(70 * 1024), os.urandom(33)])
            else:
                flood.send([b"h"] + [b"d"] * 20 + [os.urandom(33)])

        # 7. hypothesis: arbitrary frames, and signed envelopes with arbitrary fields and bodies
        @settings(
            max_examples=1200,
            deadline=None,
            database=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
        )
        @given(
            st.lists(st.binary(max_size=120), min_size=1, max_size=6),
            st.sampled_from(REQUEST_TYPES),
            st.dictionaries(st.text(max_size=10), plain, max_size=4),
            st.sampled_from(["version", "type", "session", "sender", "req_id", "nonce", "ts"]),
            plain,
        )
        def hostile(frames, mtype, body, field, value):
            flood.send(frames)
            h = envelope(int(mtype), {**body, "zz_fuzz": 1})  # an unknown field: never a valid request
            flood.send(signed(h))
            h2 = envelope(int(MessageType.STATUS), {})
            h2[field] = value
            frames2 = signed(h2)
            flood.send(frames2, rejected=not would_accept(frames2))

        hostile()
        assert flood.sent >= 10_000

        # everything sent was read and handled: a STATUS queued behind the flood is answered
        flood.wait_handled()
        with daemon.client(timeout_s=30) as c:
            status = c.status()
            assert daemon.alive() and status["node_id"] == 0
            rejected = sum(status["rejected"].values()) - rejected_before
            by_reason = status["rejected"]
        flood.close()
        assert tree_snapshot(root) == before  # not a byte changed, no file appeared
        # each one counted once, nothing more (accepted messages are not rejections)
        assert rejected == flood.expected_rejects, (rejected, flood.expected_rejects, by_reason)
        for reason in ("malformed", "auth", "replay", "session", "version", "unknown_type", "limit"):
            assert by_reason.get(reason, 0) > 0, (reason, by_reason)
        answered = [msgpack.unpackb(a[0], raw=False)["type"] for a in flood.answers]
        assert set(answered) <= {int(MessageType.ERROR), int(MessageType.OK), int(MessageType.HELLO_OK)}
        assert time.monotonic() - t_start < 60
    finally:
        pc.stop()
