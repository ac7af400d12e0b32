"""ZeroMQ sockets of the service: the options every socket gets, and send/receive with
deadlines and limits on top of :mod:`.envelope`.

Socket types: the daemon binds one ``ROUTER`` (peers and local trainers connect to it); each
client (trainer or peer daemon pushing replicas) connects a ``DEALER``. ROUTER because one
daemon serves many peers concurrently and must address replies to a specific one; DEALER
because a client pipelines many requests (chunks, fetches) without REQ/REP's lock-step, which
would also wedge forever on one lost reply. :func:`configure_socket` sets the options that make
failures explicit (ROUTER_MANDATORY, IMMEDIATE, MAXMSGSIZE, LINGER=0, heartbeats).
"""

from __future__ import annotations

import time
from typing import Collection, Optional, Tuple, Union

import zmq

from .auth import Authenticator, RejectCounters, ReplayGuard
from .envelope import Message, decode, encode
from .errors import LimitExceeded, PeerTimeout, PeerUnreachable, ProtocolConfigError
from .schemas import DEFAULT_LIMITS, Limits


def configure_socket(
    sock: zmq.Socket,
    *,
    limits: Limits = DEFAULT_LIMITS,
    hwm: int = 16,
    heartbeat_ms: int = 5000,
) -> None:
    """Options every service socket gets (see the module docstring for socket types).

    * LINGER=0 — closing never hangs on a dead peer.
    * MAXMSGSIZE — libzmq drops a peer that sends a frame over the limit before buffering it.
    * SNDHWM/RCVHWM=hwm messages — bounded queues; bytes in flight are bounded by credit.
    * ROUTER_MANDATORY (ROUTER) — sending to a gone peer fails instead of vanishing silently.
    * IMMEDIATE (DEALER) — no queueing onto connections that are not up yet.
    * ZMTP heartbeats — a silently dead peer is detected in about 3 × heartbeat_ms.

    With IMMEDIATE and LINGER=0, messages not yet read when a connection drops, or not yet
    sent when a socket closes, are discarded: every request gets an answer and requesters
    retry after their deadline (docs/protocol.md, section 1).
    """
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max(limits.max_header_bytes, limits.max_frame_bytes, 64))
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    sock.setsockopt(zmq.HEARTBEAT_IVL, heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 3 * heartbeat_ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, 3 * heartbeat_ms)
    if sock.type == zmq.ROUTER:
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    elif sock.type == zmq.DEALER:
        sock.setsockopt(zmq.IMMEDIATE, 1)


def _check_socket(sock: zmq.Socket, to: Optional[bytes]) -> bool:
    if sock.type == zmq.ROUTER:
        if not isinstance(to, (bytes, bytearray)) or not to:
            raise ProtocolConfigError(
                "sending on a ROUTER socket needs the peer's routing id",
                fix="pass to=<routing id from recv_from>",
            )
        return True
    if sock.type == zmq.DEALER:
        if to is not None:
            raise ProtocolConfigError(
                "a DEALER socket has one peer; do not pass to=", fix="drop the to= argument"
            )
        return False
    raise ProtocolConfigError(
        f"socket type {sock.type} is not used by this protocol",
        fix="use ROUTER (daemon) or DEALER (clients, peers)",
    )


def _socket_label(sock: zmq.Socket) -> str:
    try:
        endpoint = sock.getsockopt(zmq.LAST_ENDPOINT)
        return endpoint.decode(errors="replace") if endpoint else "unconnected socket"
    except zmq.ZMQError:
        return "closed socket"


def send(
    sock: zmq.Socket,
    msg: Message,
    authenticator: Authenticator,
    *,
    timeout_ms: int,
    to: Optional[bytes] = None,
    limits: Limits = DEFAULT_LIMITS,
    track: bool = False,
) -> Optional[zmq.MessageTracker]:
    """Encode and send ``msg`` zero-copy; PeerTimeout if the socket cannot take it in time.

    ``to`` is the routing id on a ROUTER. With ``track=True`` returns a MessageTracker that is
    done once libzmq no longer references the data frames: wait on it before reusing or
    freeing their memory (a shared-memory segment, a pinned staging buffer).
    """
    router = _check_socket(sock, to)
    frames = encode(msg, authenticator, limits=limits)
    parts: list = [bytes(to)] if router else []
    tracked = []
    for i, f in enumerate(frames):
        if track and 0 < i < len(frames) - 1 and f.nbytes >= zmq.COPY_THRESHOLD:
            f = zmq.Frame(f, copy=False, track=True)
            tracked.append(f)
        parts.append(f)
    label = to.hex() if router else _socket_label(sock)
    deadline = time.monotonic() + timeout_ms / 1000
    while True:
        try:
            # Multipart messages are atomic in libzmq: once the first part is queued the rest
            # is accepted, so NOBLOCK cannot leave half a message behind.
            sock.send_multipart(parts, flags=zmq.NOBLOCK, copy=False)
            break
        except zmq.Again:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise PeerTimeout(
                    f"could not send {msg.type.name} within {timeout_ms} ms (peer not connected "
                    f"or not reading)",
                    peer=label,
                    fix="check that the peer's daemon is up and reachable; retry later or another holder",
                ) from None
            sock.poll(max(1, int(remaining * 1000)), zmq.POLLOUT)
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerUnreachable(
                    f"cannot send {msg.type.name}: peer is not connected to this ROUTER",
                    peer=label,
                    fix="the peer disconnected; wait for it to reconnect and say HELLO again",
                ) from None
            raise
    if track:
        return zmq.MessageTracker(*tracked)
    return None


def _recv_parts(sock: zmq.Socket, timeout_ms: int, limits: Limits, extra_parts: int, label: str) -> list:
    deadline = time.monotonic() + timeout_ms / 1000
    first = None
    while first is None:
        remaining_ms = int((deadline - time.monotonic()) * 1000)
        if remaining_ms <= 0 or not sock.poll(remaining_ms, zmq.POLLIN):
            raise PeerTimeout(
                f"no message within {timeout_ms} ms",
                peer=label,
                fix="the peer is slow, dead or not connected; check its daemon or raise the timeout",
            )
        try:
            first = sock.recv(flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:  # spurious wake-up: keep waiting until the deadline
            continue
    max_parts = extra_parts + limits.max_frames + 2
    max_part = max(limits.max_header_bytes, limits.max_frame_bytes)
    max_total = limits.max_message_bytes + 64 + extra_parts * 256
    parts, total, overflow = [first], len(first), None
    frame = first
    # Parts of a multipart message are all present once the first is; read them one at a time
    # so an over-limit message is dropped as it is read instead of being held.
    while frame.more:
        frame = sock.recv(copy=False)
        total += len(frame)
        if overflow is None and (len(parts) >= max_parts or len(frame) > max_part or total > max_total):
            overflow = (len(parts) + 1, total)
            parts.clear()
        if overflow is None:
            parts.append(frame)
    if overflow is not None:
        raise LimitExceeded(
            f"message over the limits (at least {overflow[0]} parts, {overflow[1]} bytes; limits "
            f"{limits.max_frames} data frames, {max_part} bytes a frame, "
            f"{limits.max_message_bytes} bytes a message); dropped",
            peer=label,
            fix="send smaller chunks, or raise the receiver's Limits",
        )
    return parts


def recv(
    sock: zmq.Socket,
    authenticator: Authenticator,
    *,
    timeout_ms: int,
    expected_session: Union[str, Collection[str], None],
    replay_guard: Optional[ReplayGuard],
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional[RejectCounters] = None,
) -> Message:
    """Receive and decode one message on a DEALER; PeerTimeout after ``timeout_ms``."""
    label, parts = recv_raw(sock, timeout_ms=timeout_ms, limits=limits, counters=counters)
    return decode(
        parts,
        authenticator,
        expected_session=expected_session,
        replay_guard=replay_guard,
        limits=limits,
        counters=counters,
        peer=label,
    )


def recv_raw(
    sock: zmq.Socket,
    *,
    timeout_ms: int,
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional[RejectCounters] = None,
) -> Tuple[str, list]:
    """One message on a DEALER, not yet decoded: ``(peer label, frames)``.

    For a requester that must look at an authenticated answer the replay guard refuses (a
    daemon's CLOCK_SKEW error carries the daemon's clock, which a skewed requester's guard
    rejects in turn); decode with :func:`decode` and ``peer=label``.
    """
    _check_socket(sock, None)
    label = _socket_label(sock)
    try:
        return label, _recv_parts(sock, timeout_ms, limits, 0, label)
    except LimitExceeded as exc:
        if counters is not None:
            counters.record(exc)
        raise


def recv_from(
    sock: zmq.Socket,
    authenticator: Authenticator,
    *,
    timeout_ms: int,
    expected_session: Union[str, Collection[str], None],
    replay_guard: Optional[ReplayGuard],
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional[RejectCounters] = None,
) -> Tuple[bytes, Message]:
    """Receive one message on a ROUTER: ``(routing id, message)``; reply with ``send(to=id)``.

    A message that fails to decode is consumed entirely before the error is raised, so the
    socket stays usable; the error names the peer by routing id and TCP address.
    """
    routing_id, label, parts = recv_raw_from(sock, timeout_ms=timeout_ms, limits=limits, counters=counters)
    msg = decode(
        parts,
        authenticator,
        expected_session=expected_session,
        replay_guard=replay_guard,
        limits=limits,
        counters=counters,
        peer=label,
    )
    return routing_id, msg


def recv_raw_from(
    sock: zmq.Socket,
    *,
    timeout_ms: int,
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional[RejectCounters] = None,
) -> Tuple[bytes, str, list]:
    """One message on a ROUTER, not yet decoded: ``(routing id, peer label, frames)``.

    For a server that must answer an authenticated request that fails validation (it needs the
    routing id, see :func:`authenticated_request_info`); decode the frames with :func:`decode`
    and ``peer=label``. Over-limit messages are consumed, counted and raised as LimitExceeded.
    """
    if sock.type != zmq.ROUTER:
        raise ProtocolConfigError("recv_from is for ROUTER sockets", fix="use recv() on a DEALER")
    try:
        parts = _recv_parts(sock, timeout_ms, limits, 1, _socket_label(sock))
    except LimitExceeded as exc:
        if counters is not None:
            counters.record(exc)
        raise
    routing = parts[0]
    routing_id = routing.bytes
    label = routing_id.hex()
    try:
        address = routing.get("Peer-Address")
        if address:
            label = f"{address} [{label}]"
    except (zmq.ZMQError, KeyError, TypeError, ValueError):
        pass
    return routing_id, label, parts[1:]


__all__ = ["configure_socket", "recv", "recv_from", "recv_raw", "recv_raw_from", "send"]
