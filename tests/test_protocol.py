"""Wire protocol and authentication of the per-node service (layer 7 foundations)."""

from __future__ import annotations

import mmap
import os
import pickle
import stat
import threading
import time
import tracemalloc

import msgpack
import pytest
import xxhash
import zmq
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_ckpt.errors import CheckpointingException
from resilient_ckpt.service.wire import (
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    AuthenticationError,
    CreditGranter,
    CreditWindow,
    ErrorCode,
    LimitExceeded,
    Limits,
    MalformedMessage,
    Message,
    MessageType,
    PeerTimeout,
    PeerUnreachable,
    ProtocolConfigError,
    ProtocolError,
    ReplayedMessage,
    StaleMessage,
    UnknownMessageType,
    UnsupportedVersion,
    WrongSession,
    chunk_checksum,
    configure_socket,
    decode,
    encode,
    error_body,
    negotiate_version,
    recv,
    recv_from,
    send,
)
from resilient_ckpt.service.wire import auth as auth_mod
from resilient_ckpt.service.wire.auth import (
    Authenticator,
    RejectCounters,
    ReplayGuard,
    authenticator_from_env,
    generate_secret,
    load_secret,
    write_secret_file,
)

SESSION = "llama-run7"
SECRET = generate_secret()
CHUNK = os.urandom(3000)
STORE_HEADER = msgpack.packb({"format": 1, "tensors": [["w", [4, 4], "float32"]]})

HOLDING = {"iteration": 100, "owner_rank": 3, "world_size": 8, "total_bytes": 3000, "replica": True}

#: A valid body and data frames for every message type.
SAMPLES = {
    MessageType.HELLO: (
        {"min_version": 1, "max_version": 1, "role": "client", "rank": 3, "credit_bytes": 1 << 26},
        (),
    ),
    MessageType.HELLO_OK: (
        {"version": 1, "role": "daemon", "max_frame_bytes": MAX_FRAME_BYTES, "credit_bytes": 1 << 26},
        (),
    ),
    MessageType.ERROR: (
        {"code": "NOT_FOUND", "message": "no iteration 100 of rank 3", "op": 9, "retryable": False},
        (),
    ),
    MessageType.OK: ({"op": int(MessageType.LIST), "result": {"holdings": [HOLDING]}}, ()),
    MessageType.COMMIT: (
        {
            "iteration": 100,
            "owner_rank": 3,
            "world_size": 8,
            "header_digest": b"\x07" * 8,
            "total_bytes": 3000,
        },
        (),
    ),
    MessageType.REPLICATE_BEGIN: (
        {
            "iteration": 100,
            "owner_rank": 3,
            "world_size": 8,
            "total_bytes": 3000,
            "chunk_bytes": 1024,
            "num_chunks": 3,
        },
        (),
    ),
    MessageType.REPLICATE_CHUNK: (
        {"iteration": 100, "owner_rank": 3, "index": 0, "offset": 0, "checksum": chunk_checksum(CHUNK)},
        (CHUNK,),
    ),
    MessageType.REPLICATE_END: (
        {
            "iteration": 100,
            "owner_rank": 3,
            "num_chunks": 3,
            "total_bytes": 3000,
            "header_checksum": xxhash.xxh3_64_intdigest(STORE_HEADER),
        },
        (STORE_HEADER,),
    ),
    MessageType.FETCH: ({"iteration": 100, "owner_rank": 3, "max_chunk_bytes": 1 << 20}, ()),
    MessageType.LIST: ({"iteration": 100}, ()),
    MessageType.DROP: ({"ids": [{"iteration": 90, "owner_rank": 3}, {"iteration": 95, "owner_rank": 3}]}, ()),
    MessageType.STATUS: ({}, ()),
    MessageType.CREDIT: ({"bytes": 1 << 20}, ()),
}


def sample(mtype: MessageType, **overrides) -> Message:
    body, frames = SAMPLES[mtype]
    fields = dict(type=mtype, session=SESSION, sender="node1", req_id=42, body=dict(body), frames=frames)
    fields.update(overrides)
    return Message(**fields)


def assert_same(decoded: Message, original: Message) -> None:
    assert decoded == original  # envelope + body (frames are compared below)
    assert [bytes(f) for f in decoded.frames] == [bytes(f) for f in original.frames]


def forge(header: object, frames=(), auth: Authenticator = None) -> list:
    """Frames with an arbitrary header, correctly signed: reaches the parser past the tag."""
    auth = auth or Authenticator(SECRET)
    raw = header if isinstance(header, bytes) else msgpack.packb(header, use_bin_type=True)
    views = [memoryview(f) for f in frames]
    return [raw, *views, auth.sign(raw, views)]


def envelope(mtype=MessageType.COMMIT, **overrides) -> dict:
    body, _ = SAMPLES[mtype]
    header = {
        "version": PROTOCOL_VERSION,
        "type": int(mtype),
        "session": SESSION,
        "sender": "node1",
        "req_id": 1,
        "nonce": os.urandom(16),
        "ts": time.time_ns(),
        "body": dict(body),
    }
    header.update(overrides)
    return header


class SpyAuth(Authenticator):
    """Counts tag computations, to show over-limit input is rejected before any hashing."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.calls = 0

    def _mac(self, *a, **k):
        self.calls += 1
        return super()._mac(*a, **k)


@pytest.fixture(params=["xxh3-128", "sha256"])
def auth(request) -> Authenticator:
    return Authenticator(SECRET, frame_digest=request.param)


@pytest.fixture
def zctx():
    ctx = zmq.Context()
    yield ctx
    ctx.destroy(linger=0)


def router_dealer(ctx, *, router_limits=None, dealer_limits=None):
    router_limits, dealer_limits = router_limits or Limits(), dealer_limits or Limits()
    router = ctx.socket(zmq.ROUTER)
    configure_socket(router, limits=router_limits)
    port = router.bind_to_random_port("tcp://127.0.0.1")  # a free port, no bind race
    dealer = ctx.socket(zmq.DEALER)
    configure_socket(dealer, limits=dealer_limits)
    dealer.connect(f"tcp://127.0.0.1:{port}")
    return router, dealer


# --------------------------------------------------------------------------- round trips


def test_samples_cover_every_message_type():
    assert set(SAMPLES) == set(MessageType)


@pytest.mark.parametrize("mtype", list(MessageType), ids=lambda t: t.name)
def test_every_message_type_round_trips_through_encode_decode(mtype, auth):
    msg = sample(mtype)
    frames = encode(msg, auth)
    assert len(frames) == 2 + len(msg.frames)
    decoded = decode(frames, auth, expected_session=SESSION, replay_guard=ReplayGuard())
    assert_same(decoded, msg)
    assert decoded.type is mtype


def test_every_message_type_round_trips_over_router_dealer_on_loopback(zctx, auth):
    router, dealer = router_dealer(zctx)
    guard_daemon, guard_client = ReplayGuard(), ReplayGuard()
    for mtype in MessageType:
        request = sample(mtype, sender="trainer-3")
        send(dealer, request, auth, timeout_ms=5000)
        routing_id, got = recv_from(
            router, auth, timeout_ms=5000, expected_session=SESSION, replay_guard=guard_daemon
        )
        assert_same(got, request)
        body, frames = SAMPLES[mtype]
        answer = got.reply(mtype, sender="daemon-0", body=body, frames=frames)
        send(router, answer, auth, to=routing_id, timeout_ms=5000)
        back = recv(dealer, auth, timeout_ms=5000, expected_session=SESSION, replay_guard=guard_client)
        assert_same(back, answer)
        assert back.req_id == request.req_id and back.sender == "daemon-0"


def test_reply_has_same_request_id_and_a_fresh_nonce():
    request = sample(MessageType.FETCH)
    answer = request.reply(MessageType.ERROR, sender="d", body=error_body(ErrorCode.NOT_FOUND, "gone"))
    assert (answer.req_id, answer.session, answer.version) == (
        request.req_id,
        request.session,
        request.version,
    )
    assert answer.nonce != request.nonce
    encode(answer, Authenticator(SECRET))  # a valid ERROR body


def test_error_body_from_protocol_error_carries_its_code():
    body = error_body(WrongSession("for session x", peer="n2", fix="point it elsewhere"))
    assert body["code"] == "WRONG_SESSION" and "n2" in body["message"]
    assert ErrorCode.of(body["code"]) is ErrorCode.WRONG_SESSION
    assert ErrorCode.of("SOME_FUTURE_CODE") is ErrorCode.INTERNAL


# --------------------------------------------------------------------------- authentication


@pytest.mark.parametrize("position", ["header", "data", "tag"])
def test_tampering_with_any_frame_is_rejected(auth, position):
    frames = [bytes(f) for f in encode(sample(MessageType.REPLICATE_CHUNK), auth)]
    index = {"header": 0, "data": 1, "tag": 2}[position]
    for byte in (0, len(frames[index]) // 2, len(frames[index]) - 1):
        tampered = list(frames)
        b = bytearray(tampered[index])
        b[byte] ^= 0x01
        tampered[index] = bytes(b)
        with pytest.raises(AuthenticationError):
            decode(tampered, auth, expected_session=SESSION, replay_guard=ReplayGuard())


def test_moving_bytes_between_frames_or_reordering_them_is_rejected(auth):
    frames = forge(envelope(MessageType.OK, body={"op": 4}), [b"abc", b"def"], auth)
    tag = frames[-1]
    for variant in ([b"ab", b"cdef"], [b"def", b"abc"], [b"abcdef"], [b"abc"], [b"abc", b"def", b""]):
        with pytest.raises(AuthenticationError):
            decode([frames[0], *variant, tag], auth, expected_session=SESSION, replay_guard=None)


def test_message_signed_with_another_secret_is_rejected(auth):
    other = Authenticator(generate_secret(), frame_digest=auth.frame_digest)
    frames = encode(sample(MessageType.COMMIT), other)
    with pytest.raises(AuthenticationError, match="wrong secret"):
        decode(frames, auth, expected_session=SESSION, replay_guard=ReplayGuard())


def test_receiver_refuses_a_different_frame_digest_than_its_own():
    frames = encode(sample(MessageType.REPLICATE_CHUNK), Authenticator(SECRET, frame_digest="xxh3-128"))
    with pytest.raises(AuthenticationError, match="frame_digest"):
        decode(
            frames, Authenticator(SECRET, frame_digest="sha256"), expected_session=SESSION, replay_guard=None
        )


def test_replayed_message_is_rejected(auth):
    frames = encode(sample(MessageType.DROP), auth)
    guard = ReplayGuard()
    decode(frames, auth, expected_session=SESSION, replay_guard=guard)
    with pytest.raises(ReplayedMessage, match="replayed"):
        decode(frames, auth, expected_session=SESSION, replay_guard=guard)


def test_replayed_message_over_a_socket_is_rejected_and_counted(zctx, auth):
    router, dealer = router_dealer(zctx)
    frames = encode(sample(MessageType.DROP), auth)
    dealer.send_multipart(frames)
    dealer.send_multipart(frames)  # an attacker re-sending captured bytes
    guard, counters = ReplayGuard(), RejectCounters()
    kw = dict(timeout_ms=5000, expected_session=SESSION, replay_guard=guard, counters=counters)
    recv_from(router, auth, **kw)
    with pytest.raises(ReplayedMessage):
        recv_from(router, auth, **kw)
    assert counters.snapshot() == {"replay": 1}


@pytest.mark.parametrize("skew_s", [-120, +120])
def test_message_with_a_timestamp_outside_the_window_is_rejected(auth, skew_s):
    msg = sample(MessageType.STATUS, timestamp_ns=time.time_ns() + skew_s * 10**9)
    with pytest.raises(StaleMessage, match="outside the ±60 s replay window") as err:
        decode(encode(msg, auth), auth, expected_session=SESSION, replay_guard=ReplayGuard(window_s=60))
    assert "NTP" in str(err.value)


def test_message_for_another_session_is_rejected(auth):
    frames = encode(sample(MessageType.COMMIT, session="other-job"), auth)
    with pytest.raises(WrongSession, match="other-job"):
        decode(frames, auth, expected_session=SESSION, replay_guard=ReplayGuard())
    decode(frames, auth, expected_session={SESSION, "other-job"}, replay_guard=ReplayGuard())


def test_error_names_the_peer_by_address(zctx):
    router, dealer = router_dealer(zctx)
    send(dealer, sample(MessageType.STATUS), Authenticator(generate_secret()), timeout_ms=5000)
    with pytest.raises(AuthenticationError) as err:
        recv_from(
            router,
            Authenticator(SECRET),
            timeout_ms=5000,
            expected_session=SESSION,
            replay_guard=ReplayGuard(),
        )
    assert "127.0.0.1" in str(err.value) and "Fix:" in str(err.value)


def test_protocol_errors_survive_pickling_with_peer_and_fix():
    err = pickle.loads(pickle.dumps(LimitExceeded("too big", peer="node3", fix="smaller")))
    assert (type(err), err.peer, err.fix) == (LimitExceeded, "node3", "smaller")
    assert isinstance(err, CheckpointingException)


# --------------------------------------------------------------------------- versions, types, bodies


def test_message_with_an_unsupported_version_is_rejected():
    frames = forge(envelope(version=PROTOCOL_VERSION + 1))
    with pytest.raises(UnsupportedVersion, match=f"version {PROTOCOL_VERSION + 1}"):
        decode(frames, Authenticator(SECRET), expected_session=SESSION, replay_guard=None)


def test_hello_from_a_newer_build_is_readable_and_negotiates_the_highest_common_version():
    body = {"min_version": 1, "max_version": 9, "role": "daemon", "future_capability": [1, 2]}
    frames = forge(envelope(MessageType.HELLO, version=9, body=body))
    hello = decode(frames, Authenticator(SECRET), expected_session=SESSION, replay_guard=None)
    assert negotiate_version(hello.body["min_version"], hello.body["max_version"]) == PROTOCOL_VERSION


def test_version_negotiation_without_overlap_is_refused():
    with pytest.raises(UnsupportedVersion, match="no common protocol version"):
        negotiate_version(PROTOCOL_VERSION + 1, PROTOCOL_VERSION + 3, peer="node9")


def test_unknown_message_type_is_rejected():
    frames = forge(envelope(type=99))
    with pytest.raises(UnknownMessageType, match="type code 99"):
        decode(frames, Authenticator(SECRET), expected_session=SESSION, replay_guard=None)
    with pytest.raises(UnknownMessageType):
        Message(99, SESSION, "n")


BAD_BODIES = [
    (MessageType.COMMIT, lambda b: b.pop("iteration"), "'iteration'.*missing"),
    (MessageType.COMMIT, lambda b: b.update(iteration="100"), "'iteration'.*expected int"),
    (MessageType.COMMIT, lambda b: b.update(iteration=True), "'iteration'.*got bool"),
    (MessageType.COMMIT, lambda b: b.update(iteration=-1), "'iteration'.*outside"),
    (MessageType.COMMIT, lambda b: b.update(owner_rank=8), "owner_rank must be < world_size"),
    (MessageType.COMMIT, lambda b: b.update(colour="red"), "'colour'.*unknown field"),
    (MessageType.COMMIT, lambda b: b.update(header_digest=b"x"), "'header_digest'.*length 1"),
    (MessageType.REPLICATE_BEGIN, lambda b: b.update(num_chunks=2), "ceil"),
    (MessageType.DROP, lambda b: b.update(ids=[]), "'ids'.*length 0"),
    (MessageType.DROP, lambda b: b.update(ids=[{"iteration": 1}]), r"'ids\[0\].owner_rank'.*missing"),
    (MessageType.HELLO, lambda b: b.update(role="root"), "'role'.*one of"),
    (MessageType.OK, lambda b: b.update(result={"holdings": [{"iteration": 1}]}), r"result.holdings\[0\]"),
    (MessageType.OK, lambda b: b.update(op=77), "'op'.*not a message type"),
    (MessageType.STATUS, lambda b: b.update(x=None), "'x'.*unknown field"),
]


@pytest.mark.parametrize(
    "mtype, mutate, pattern", BAD_BODIES, ids=[f"{t.name}-{p}" for t, _, p in BAD_BODIES]
)
def test_wrong_or_missing_body_field_is_rejected_naming_type_and_field(mtype, mutate, pattern):
    body = dict(SAMPLES[mtype][0])
    mutate(body)
    frames = forge(envelope(mtype, body=body), SAMPLES[mtype][1])
    with pytest.raises(MalformedMessage, match=pattern) as err:
        decode(frames, Authenticator(SECRET), expected_session=SESSION, replay_guard=None)
    assert mtype.name in str(err.value)
    with pytest.raises(MalformedMessage, match=f"refusing to send {mtype.name}"):  # same check on send
        encode(sample(mtype, body=body), Authenticator(SECRET))


def test_wrong_number_of_data_frames_is_rejected():
    frames = forge(envelope(MessageType.REPLICATE_CHUNK, body=SAMPLES[MessageType.REPLICATE_CHUNK][0]))
    with pytest.raises(MalformedMessage, match="REPLICATE_CHUNK.*0 data frame.*carries 1"):
        decode(frames, Authenticator(SECRET), expected_session=SESSION, replay_guard=None)


def test_header_that_is_not_a_complete_envelope_is_rejected():
    header = envelope()
    del header["nonce"]
    with pytest.raises(MalformedMessage, match="missing \\['nonce'\\]"):
        decode(forge(header), Authenticator(SECRET), expected_session=SESSION, replay_guard=None)
    with pytest.raises(MalformedMessage, match="not valid msgpack"):
        decode(forge(b"\xc1"), Authenticator(SECRET), expected_session=SESSION, replay_guard=None)


# --------------------------------------------------------------------------- limits


def test_oversized_header_is_rejected_before_hashing_or_unpacking():
    spy = SpyAuth(SECRET)
    big = envelope(MessageType.STATUS, body={"pad": "x" * (70 * 1024)})
    frames = forge(big)
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded, match="header of .* exceeds max_header_bytes=65536"):
            decode(frames, spy, expected_session=SESSION, replay_guard=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert spy.calls == 0 and peak < 32 * 1024


def test_oversized_data_frame_is_rejected_without_allocating_or_hashing():
    spy = SpyAuth(SECRET)
    with mmap.mmap(-1, 1 << 30) as huge:  # 1 GiB of untouched virtual memory
        frames = [b"h" * 100, memoryview(huge), b"t" * 33]
        tracemalloc.start()
        try:
            with pytest.raises(
                LimitExceeded, match="data frame 0 of 1073741824 bytes exceeds max_frame_bytes"
            ):
                decode(frames, spy, expected_session=SESSION, replay_guard=None)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
        del frames
    assert spy.calls == 0 and peak < 32 * 1024


def test_too_many_frames_are_rejected_before_looking_at_them():
    spy = SpyAuth(SECRET)
    frames = [b"h"] + [b"d"] * 100_000 + [b"t" * 33]
    tracemalloc.start()
    try:
        with pytest.raises(LimitExceeded, match="100000 data frames exceed max_frames=16"):
            decode(frames, spy, expected_session=SESSION, replay_guard=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert spy.calls == 0 and peak < 32 * 1024


def test_message_over_the_total_size_limit_is_rejected_on_both_sides():
    limits = Limits(max_frame_bytes=1024, max_message_bytes=2048)
    frames = forge(envelope(MessageType.OK, body={"op": 4}), [b"x" * 1000] * 3)
    with pytest.raises(LimitExceeded, match="exceeds max_message_bytes=2048"):
        decode(frames, Authenticator(SECRET), expected_session=SESSION, replay_guard=None, limits=limits)
    big = sample(MessageType.REPLICATE_CHUNK, frames=(b"x" * 2000,))
    with pytest.raises(LimitExceeded, match="refusing to send.*max_frame_bytes=1024"):
        encode(big, Authenticator(SECRET), limits=limits)


def test_invalid_limits_are_refused():
    with pytest.raises(ProtocolConfigError, match="max_frames"):
        Limits(max_frames=0)


def test_message_with_too_many_frames_is_dropped_and_the_socket_stays_usable(zctx):
    auth = Authenticator(SECRET)
    router, dealer = router_dealer(zctx)
    counters = RejectCounters()
    kw = dict(timeout_ms=5000, expected_session=SESSION, replay_guard=ReplayGuard(), counters=counters)
    dealer.send_multipart(forge(envelope(MessageType.OK, body={"op": 4}), [b"x"] * 40))
    with pytest.raises(LimitExceeded, match="dropped"):
        recv_from(router, auth, **kw)
    send(dealer, sample(MessageType.STATUS), auth, timeout_ms=5000)
    _, msg = recv_from(router, auth, **kw)
    assert msg.type is MessageType.STATUS and counters.snapshot() == {"limit": 1}


def test_frame_over_the_receivers_limit_never_reaches_it_and_the_connection_recovers(zctx):
    auth = Authenticator(SECRET)
    router, dealer = router_dealer(zctx, router_limits=Limits(max_frame_bytes=1 << 20))
    big = sample(MessageType.REPLICATE_CHUNK, frames=(b"x" * (2 << 20),))
    kw = dict(expected_session=SESSION, replay_guard=ReplayGuard())
    send(dealer, big, auth, timeout_ms=5000)
    with pytest.raises(PeerTimeout):  # libzmq dropped the peer at MAXMSGSIZE, before buffering it
        recv_from(router, auth, timeout_ms=300, **kw)
    send(dealer, sample(MessageType.STATUS), auth, timeout_ms=10_000)  # waits for the reconnect
    _, msg = recv_from(router, auth, timeout_ms=10_000, **kw)
    assert msg.type is MessageType.STATUS


# --------------------------------------------------------------------------- fuzzing

FUZZ = settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
FUZZ_AUTH = Authenticator(SECRET)
VALID_FRAMES = {t: [bytes(f) for f in encode(sample(t), FUZZ_AUTH)] for t in MessageType}

plain = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=20)
    | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(st.lists(st.binary(max_size=128), max_size=6))
def test_garbage_frames_raise_only_protocol_errors(frames):
    with pytest.raises(ProtocolError):
        decode(frames, FUZZ_AUTH, expected_session=SESSION, replay_guard=ReplayGuard())


@FUZZ
@given(
    st.sampled_from(list(MessageType)),
    st.lists(
        st.tuples(
            st.sampled_from(["flip", "cut", "grow", "drop", "dup", "swap"]),
            st.integers(0, 1 << 16),
            st.integers(0, 255),
        ),
        min_size=1,
        max_size=3,
    ),
)
def test_mutated_valid_messages_raise_only_protocol_errors(mtype, mutations):
    frames = list(VALID_FRAMES[mtype])
    for op, pos, value in mutations:
        if not frames:
            break
        i = pos % len(frames)
        f = bytearray(frames[i])
        if op == "flip" and f:
            f[pos % len(f)] ^= value or 1
        elif op == "cut":
            del f[pos % (len(f) + 1) :]
        elif op == "grow":
            f.insert(pos % (len(f) + 1), value)
        elif op == "drop":
            del frames[i]
            continue
        elif op == "dup":
            frames.insert(i, frames[i])
            continue
        elif op == "swap":
            j = value % len(frames)
            frames[i], frames[j] = frames[j], frames[i]
            continue
        frames[i] = bytes(f)
    try:
        got = decode(frames, FUZZ_AUTH, expected_session=SESSION, replay_guard=None)
    except ProtocolError:
        return
    assert frames == VALID_FRAMES[mtype] and got.type is mtype  # only a no-op mutation may pass


@FUZZ
@given(
    st.sampled_from(list(MessageType)),
    st.one_of(
        st.tuples(
            st.just("field"),
            st.sampled_from(["version", "type", "session", "sender", "req_id", "nonce", "ts", "body"]),
            plain,
        ),
        st.tuples(st.just("body_field"), st.text(max_size=12), plain),
        st.tuples(st.just("drop_body_field"), st.integers(0, 10), st.none()),
        st.tuples(st.just("whole"), st.none(), plain),
        st.tuples(st.just("bytes"), st.none(), st.binary(max_size=64)),
    ),
    st.lists(st.binary(max_size=16), max_size=3),
)
def test_signed_but_malformed_headers_raise_only_protocol_errors(mtype, mutation, frames):
    """Past the tag (signed with the real secret) the parser and schemas see arbitrary input."""
    kind, key, value = mutation
    header = envelope(mtype)
    body = header["body"] = dict(header["body"])
    if kind == "field":
        header[key] = value
    elif kind == "body_field":
        body[key if key not in body else sorted(body)[0]] = value
    elif kind == "drop_body_field" and body:
        del body[sorted(body)[key % len(body)]]
    elif kind in ("whole", "bytes"):
        header = value
    raw = value if kind == "bytes" else msgpack.packb(header, use_bin_type=True)
    try:
        msg = decode(forge(raw, frames), FUZZ_AUTH, expected_session=SESSION, replay_guard=ReplayGuard())
    except ProtocolError:
        return
    # Whatever decodes is a valid message: it re-encodes under the same rules.
    decode(encode(msg, FUZZ_AUTH), FUZZ_AUTH, expected_session=SESSION, replay_guard=None)


@settings(max_examples=500, deadline=None)
@given(
    st.sampled_from(list(MessageType)),
    st.dictionaries(st.text(max_size=12), plain | st.integers(), max_size=4),
    st.lists(st.binary(max_size=16), max_size=2),
)
def test_encoding_an_invalid_message_raises_only_protocol_errors(mtype, extra, frames):
    body = {**SAMPLES[mtype][0], **extra}
    try:
        out = encode(sample(mtype, body=body, frames=tuple(frames)), FUZZ_AUTH)
    except ProtocolError:
        return
    got = decode(out, FUZZ_AUTH, expected_session=SESSION, replay_guard=None).body
    assert msgpack.packb(got) == msgpack.packb(body)  # (NaN != NaN: compare encodings)


def test_integer_too_large_for_msgpack_is_refused_before_packing():
    with pytest.raises(MalformedMessage, match="'result.x'.*does not fit msgpack"):
        encode(sample(MessageType.OK, body={"op": 12, "result": {"x": 2**70}}), Authenticator(SECRET))


def test_deeply_nested_body_is_rejected_as_malformed():
    deep: object = 0
    for _ in range(500):
        deep = [deep]
    frames = forge(envelope(MessageType.OK, body={"op": 12, "result": {"x": deep}}))
    with pytest.raises(MalformedMessage, match="nested deeper"):
        decode(frames, Authenticator(SECRET), expected_session=SESSION, replay_guard=None)


# --------------------------------------------------------------------------- replay guard


def test_replay_guard_forgets_nonces_once_their_window_has_passed():
    now = [10**18]
    guard = ReplayGuard(window_s=60, clock=lambda: now[0])
    for _ in range(100):
        guard.check(os.urandom(16), now[0])
    assert len(guard) == 100
    now[0] += 61 * 10**9
    guard.check(os.urandom(16), now[0])
    assert len(guard) == 1


@settings(max_examples=300, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.integers(-70, 70), st.integers(0, 5)), max_size=120))
def test_saturated_replay_guard_stays_bounded_and_never_accepts_a_replay(events):
    """Messages (nonce + signed timestamp) delivered and re-delivered around a moving clock into
    a tiny guard: no message is ever accepted twice, and memory never exceeds max_entries."""
    now = [10**18]
    guard = ReplayGuard(window_s=60, max_entries=8, clock=lambda: now[0])
    timestamps, accepted = {}, set()
    for msg_id, offset_s, advance_s in events:
        now[0] += advance_s * 10**9
        ts = timestamps.setdefault(msg_id, now[0] + offset_s * 10**9)  # a re-delivery keeps its ts
        try:
            guard.check(bytes([msg_id]) * 16, ts)
        except ReplayedMessage:
            pass
        else:
            assert msg_id not in accepted, "replay accepted"
            accepted.add(msg_id)
        assert len(guard) <= 8


# --------------------------------------------------------------------------- flow control


def test_credit_window_blocks_until_the_receiver_grants_credit():
    window = CreditWindow(1000, peer="node2")
    window.acquire(600, timeout_s=1)
    window.acquire(400, timeout_s=1)
    got = []
    waiter = threading.Thread(target=lambda: got.append(window.acquire(500, timeout_s=30)))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive() and window.in_flight == 1000  # blocked: the window is full
    window.release(600)  # a CREDIT for the first message
    waiter.join(10)
    assert not waiter.is_alive() and got == [None] and window.in_flight == 900


def test_credit_window_times_out_when_the_peer_stops_granting():
    window = CreditWindow(1000, peer="node2")
    window.acquire(1000, timeout_s=1)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="no credit for 1 bytes within 0.2 s") as err:
        window.acquire(1, timeout_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 5 and "node2" in str(err.value)
    assert isinstance(err.value, TimeoutError)


def test_message_larger_than_the_credit_window_is_refused_at_once():
    with pytest.raises(LimitExceeded, match="can never fit"):
        CreditWindow(1000).acquire(1001, timeout_s=60)


def test_closing_a_credit_window_wakes_blocked_senders():
    window = CreditWindow(10)
    window.acquire(10, timeout_s=1)
    errors = []

    def blocked():
        try:
            window.acquire(5, timeout_s=30)
        except PeerUnreachable as e:
            errors.append(e)

    waiter = threading.Thread(target=blocked)
    waiter.start()
    window.close("node2 disconnected")
    waiter.join(10)
    assert len(errors) == 1 and "node2 disconnected" in str(errors[0])


def test_excess_credit_does_not_widen_the_window():
    window = CreditWindow(100)
    window.acquire(50, timeout_s=1)
    window.release(10_000)
    assert window.available == 100


def test_credit_granter_batches_grants():
    granter = CreditGranter(1000, grant_fraction=0.5)
    assert [granter.consumed(200), granter.consumed(200), granter.consumed(200)] == [0, 0, 600]
    granter.consumed(100)
    assert granter.flush() == 100 and granter.flush() == 0


def test_peer_that_stops_reading_bounds_buffering_and_times_out(zctx):
    """A sender that respects credit holds at most the window in flight, then times out;
    once the receiver reads and grants, sending resumes."""
    auth = Authenticator(SECRET)
    router, dealer = router_dealer(zctx)
    chunk = os.urandom(1 << 20)
    window = CreditWindow(4 << 20, peer="daemon-0")
    body = {"iteration": 1, "owner_rank": 0, "index": 0, "offset": 0, "checksum": chunk_checksum(chunk)}
    sent = 0
    with pytest.raises(PeerTimeout):
        for i in range(10):
            window.acquire(len(chunk), timeout_s=0.3)
            send(
                dealer,
                sample(MessageType.REPLICATE_CHUNK, body={**body, "index": i}, frames=(chunk,)),
                auth,
                timeout_ms=5000,
            )
            sent += 1
    assert sent == 4 and window.in_flight == 4 << 20  # buffering bounded by the window

    granter, guard = CreditGranter(4 << 20), ReplayGuard()
    for _ in range(sent):
        routing_id, msg = recv_from(
            router, auth, timeout_ms=5000, expected_session=SESSION, replay_guard=guard
        )
        grant = granter.consumed(len(msg.frames[0]))
        if grant:
            send(
                router,
                msg.reply(MessageType.CREDIT, sender="daemon-0", body={"bytes": grant}),
                auth,
                to=routing_id,
                timeout_ms=5000,
            )
    while window.in_flight:
        credit = recv(dealer, auth, timeout_ms=5000, expected_session=SESSION, replay_guard=ReplayGuard())
        assert credit.type is MessageType.CREDIT
        window.release(credit.body["bytes"])
    window.acquire(len(chunk), timeout_s=0.3)  # the sender may go on


# --------------------------------------------------------------------------- sockets


class SpySocket(zmq.Socket):
    """Records the parts handed to libzmq."""

    handed = None

    def send_multipart(self, msg_parts, *args, **kwargs):
        self.handed = list(msg_parts)
        return super().send_multipart(msg_parts, *args, **kwargs)


@pytest.mark.parametrize("track", [False, True])
def test_large_frame_is_sent_and_received_without_copies(zctx, track):
    auth = Authenticator(SECRET)
    router = zctx.socket(zmq.ROUTER)
    configure_socket(router)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer = zctx.socket(zmq.DEALER, socket_class=SpySocket)
    configure_socket(dealer)
    dealer.connect(f"tcp://127.0.0.1:{port}")

    import numpy as np

    payload = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)  # 64 MiB, writable
    body = {"iteration": 1, "owner_rank": 0, "index": 0, "offset": 0, "checksum": chunk_checksum(payload)}
    tracker = send(
        dealer,
        sample(MessageType.REPLICATE_CHUNK, body=body, frames=(payload,)),
        auth,
        timeout_ms=10_000,
        track=track,
    )
    handed = dealer.handed[1]
    handed_view = handed.buffer if isinstance(handed, zmq.Frame) else handed
    assert np.shares_memory(np.frombuffer(handed_view, np.uint8), payload)  # libzmq got our memory
    dealer.handed = handed = handed_view = None  # the spy must not keep the frame alive

    _, msg = recv_from(router, auth, timeout_ms=30_000, expected_session=SESSION, replay_guard=ReplayGuard())
    frame = msg.frames[0]
    assert isinstance(frame.obj, zmq.Frame) and frame.nbytes == 64 << 20  # a view of the zmq frame
    assert chunk_checksum(frame) == msg.body["checksum"]
    if track:
        tracker.wait(10)  # libzmq released our buffer: safe to reuse it now
        assert tracker.done


def test_recv_times_out_when_nothing_arrives(zctx):
    _, dealer = router_dealer(zctx)
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match="no message within 200 ms"):
        recv(
            dealer,
            Authenticator(SECRET),
            timeout_ms=200,
            expected_session=SESSION,
            replay_guard=ReplayGuard(),
        )
    assert 0.19 <= time.monotonic() - t0 < 5


def test_send_to_a_peer_that_is_not_connected_fails_fast(zctx):
    router, _ = router_dealer(zctx)
    with pytest.raises(PeerUnreachable, match="not connected"):
        send(router, sample(MessageType.OK), Authenticator(SECRET), to=b"\x00ghost", timeout_ms=1000)


def test_send_times_out_when_no_daemon_is_listening(zctx):
    dealer = zctx.socket(zmq.DEALER)
    configure_socket(dealer)
    from harness import free_port

    dealer.connect(f"tcp://127.0.0.1:{free_port()}")  # nobody there: IMMEDIATE queues nothing
    with pytest.raises(PeerTimeout, match="could not send STATUS within 200 ms"):
        send(dealer, sample(MessageType.STATUS), Authenticator(SECRET), timeout_ms=200)


def test_sending_on_a_router_needs_a_routing_id(zctx):
    router, _ = router_dealer(zctx)
    with pytest.raises(ProtocolConfigError, match="routing id"):
        send(router, sample(MessageType.OK), Authenticator(SECRET), timeout_ms=100)


def test_rejections_are_counted_by_reason():
    auth, counters, guard = Authenticator(SECRET), RejectCounters(), ReplayGuard()
    kw = dict(expected_session=SESSION, replay_guard=guard, counters=counters)
    good = encode(sample(MessageType.STATUS), auth)
    decode(good, auth, **kw)
    for frames in (
        good,
        [b"x", b"y"],
        encode(sample(MessageType.STATUS, session="x"), auth),
        [b"h"] + [b"d"] * 20 + [b"t"],
    ):
        with pytest.raises(ProtocolError):
            decode(frames, auth, **kw)
    assert counters.snapshot() == {"replay": 1, "auth": 1, "session": 1, "limit": 1}
    assert counters.total == 4 and counters["auth"] == 1


# --------------------------------------------------------------------------- secrets


@pytest.fixture
def no_secret_env(monkeypatch):
    for name in ("RESILIENT_CKPT_SECRET", "RESILIENT_CKPT_SECRET_FILE", "RESILIENT_CKPT_FRAME_DIGEST"):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_secret_is_loaded_from_a_private_file_named_by_the_environment(tmp_path, no_secret_env):
    path = tmp_path / "job.secret"
    secret = write_secret_file(path)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    no_secret_env.setenv("RESILIENT_CKPT_SECRET_FILE", str(path))
    assert load_secret() == secret and len(secret) == 64


def test_secret_is_loaded_from_the_environment_variable(no_secret_env):
    no_secret_env.setenv("RESILIENT_CKPT_SECRET", "s" * 20)
    assert load_secret() == b"s" * 20


def test_world_readable_secret_file_is_refused_with_the_chmod_fix(tmp_path, no_secret_env):
    path = tmp_path / "job.secret"
    path.write_bytes(generate_secret())
    path.chmod(0o644)
    with pytest.raises(ProtocolConfigError, match=f"chmod 600 {path}"):
        load_secret(path)


@pytest.mark.parametrize("secret", [b"short", b"0123456789abcde\n"])
def test_secret_shorter_than_16_bytes_is_refused(tmp_path, no_secret_env, secret):
    path = tmp_path / "job.secret"
    path.write_bytes(secret)
    path.chmod(0o600)
    with pytest.raises(ProtocolConfigError, match="at least 16"):
        load_secret(path)
    with pytest.raises(ProtocolConfigError, match="at least 16"):
        Authenticator(secret.strip())


def test_missing_secret_says_how_to_provide_one(tmp_path, no_secret_env):
    with pytest.raises(ProtocolConfigError, match="RESILIENT_CKPT_SECRET_FILE"):
        load_secret()
    with pytest.raises(ProtocolConfigError, match="does not exist"):
        load_secret(tmp_path / "nope")


def test_generated_secrets_are_distinct_and_long_enough():
    a, b = generate_secret(), generate_secret()
    assert a != b and len(a) >= 32 and a.isalnum()


def test_authenticator_from_env_uses_the_configured_frame_digest(no_secret_env):
    no_secret_env.setenv("RESILIENT_CKPT_SECRET", SECRET.decode())
    assert authenticator_from_env().frame_digest == auth_mod.DEFAULT_FRAME_DIGEST
    no_secret_env.setenv("RESILIENT_CKPT_FRAME_DIGEST", "sha256")
    assert authenticator_from_env().frame_digest == "sha256"
    no_secret_env.setenv("RESILIENT_CKPT_FRAME_DIGEST", "md5")
    with pytest.raises(ProtocolConfigError, match="md5"):
        authenticator_from_env()


def test_authenticator_repr_does_not_reveal_the_secret():
    assert SECRET.decode() not in repr(Authenticator(SECRET))
