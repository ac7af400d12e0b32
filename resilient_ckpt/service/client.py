"""The trainer's side of the node daemon: :class:`DaemonClient`, plus the pure helpers the
daemon shares with it (header digests, completeness of an iteration, recovery planning).

Every request gets an answer (OK, HELLO_OK or ERROR) and is retried after its deadline with
the same ``req_id``; the daemon treats every request as idempotent (docs/protocol.md,
"Daemon behaviour"), so a retry after a lost message or a daemon restart is always safe.
A client owns one DEALER socket; calls from several threads are serialized by a lock.
"""

from __future__ import annotations

import os
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import xxhash
import zmq

from ..errors import CorruptCheckpointError, NoReplicaError, ReplicationError, StoreFullError
from .wire import (
    DEFAULT_LIMITS,
    MIN_PROTOCOL_VERSION,
    PROTOCOL_VERSION,
    Authenticator,
    ErrorCode,
    Limits,
    Message,
    MessageType,
    PeerTimeout,
    ProtocolError,
    ReplayGuard,
    StaleMessage,
    authenticator_from_env,
    configure_socket,
    decode,
    encode,
    recv_raw,
    send,
)

#: States after which a replication does not change any more (until a new COMMIT).
TERMINAL_STATES = frozenset({"replicated", "failed"})


def header_digest(raw_header: bytes) -> bytes:
    """``header_digest`` of COMMIT / REPLICATE_BEGIN / LIST: XXH3-128 of the store header's
    exact bytes (16 bytes). Two copies of a checkpoint are the same save iff digests match."""
    return xxhash.xxh3_128_digest(raw_header)


# --------------------------------------------------------------------------- results


@dataclass(frozen=True)
class Holding:
    """One published checkpoint a daemon holds (an entry of LIST)."""

    iteration: int
    owner: int
    world_size: int
    total_bytes: int
    header_digest: Optional[bytes] = None
    replica: Optional[bool] = None
    #: the daemon (node id) holding it: set in LIST with peers=True and by the daemon itself
    node: Optional[int] = None
    ranks_per_node: Optional[int] = None

    @classmethod
    def from_wire(cls, d: Mapping[str, Any]) -> "Holding":
        digest = d.get("header_digest")
        return cls(
            iteration=d["iteration"],
            owner=d["owner_rank"],
            world_size=d["world_size"],
            total_bytes=d["total_bytes"],
            header_digest=bytes(digest) if digest is not None else None,
            replica=d.get("replica"),
            node=d.get("node"),
            ranks_per_node=d.get("ranks_per_node"),
        )

    def to_wire(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "iteration": self.iteration,
            "owner_rank": self.owner,
            "world_size": self.world_size,
            "total_bytes": self.total_bytes,
        }
        for key, value in (
            ("header_digest", self.header_digest),
            ("replica", self.replica),
            ("node", self.node),
            ("ranks_per_node", self.ranks_per_node),
        ):
            if value is not None:
                out[key] = value
        return out


@dataclass(frozen=True)
class ReplicationState:
    """Where the replication of one checkpoint id stands, as its daemon reports it.

    ``state``: ``unknown`` (no such checkpoint in the daemon's store), ``local`` (stored, no
    replication requested since the daemon started), ``replicating``, ``replicated`` (every
    holder node stored it) or ``failed`` (``error`` names the peer and the reason; a new
    COMMIT retries the failed holders).
    """

    iteration: int
    owner: int
    state: str
    holders: Tuple[int, ...] = ()
    acked: Tuple[int, ...] = ()
    bytes_out: int = 0
    seconds: float = 0.0
    error: str = ""
    failed_node: Optional[int] = None

    @property
    def done(self) -> bool:
        return self.state in TERMINAL_STATES

    @classmethod
    def from_wire(cls, iteration: int, owner: int, d: Optional[Mapping[str, Any]]) -> "ReplicationState":
        d = d or {"state": "unknown"}
        return cls(
            iteration=iteration,
            owner=owner,
            state=d["state"],
            holders=tuple(d.get("holders", ())),
            acked=tuple(d.get("acked", ())),
            bytes_out=int(d.get("bytes_out", 0)),
            seconds=float(d.get("seconds", 0.0)),
            error=d.get("error", ""),
            failed_node=d.get("failed_node"),
        )


@dataclass(frozen=True)
class FetchResult:
    """Outcome of :meth:`DaemonClient.fetch`: the id is now in the local daemon's store."""

    iteration: int
    owner: int
    already: bool
    source_node: Optional[int]
    total_bytes: int


@dataclass(frozen=True)
class RecoveryPlan:
    """What a node must pull to restore its own ranks: ``sources[i] = (owner, holder nodes)``,
    the nodes in the order to try them (spread over holders, lowest load first)."""

    iteration: int
    world_size: int
    ranks_per_node: int
    sources: Tuple[Tuple[int, Tuple[int, ...]], ...]

    @property
    def owners(self) -> Tuple[int, ...]:
        return tuple(o for o, _ in self.sources)


# --------------------------------------------------------------------------- pure planning


def complete_iterations(holdings: Iterable[Holding]) -> List[int]:
    """Iterations (newest first) where every rank ``0..world_size-1`` is held somewhere.

    This is the design's "complete" minus the checksum (verified when the bytes move).
    Iterations whose holdings disagree on the world size are never complete.
    """
    owners: Dict[int, set] = {}
    worlds: Dict[int, set] = {}
    for h in holdings:
        owners.setdefault(h.iteration, set()).add(h.owner)
        worlds.setdefault(h.iteration, set()).add(h.world_size)
    out = []
    for it, ws in worlds.items():
        if len(ws) == 1:
            (w,) = ws
            if owners[it] >= set(range(w)):
                out.append(it)
    return sorted(out, reverse=True)


def plan_recovery(
    holdings: Iterable[Holding],
    node_id: int,
    *,
    ranks_per_node: Optional[int] = None,
    held_locally: Iterable[Tuple[int, int]] = (),
) -> Optional[RecoveryPlan]:
    """What node ``node_id`` must pull to restore its ranks of the newest complete iteration.

    ``holdings`` are every reachable daemon's (each with ``node``); ``held_locally`` the
    ``(iteration, owner)`` pairs this node already has (skipped). Returns None when no
    iteration is complete (nothing to recover: a fresh job, or too many nodes lost).
    ``ranks_per_node`` defaults to what the checkpoints' headers say.
    """
    holdings = list(holdings)
    complete = complete_iterations(holdings)
    if not complete:
        return None
    it = complete[0]
    of_it = [h for h in holdings if h.iteration == it]
    rpn = ranks_per_node
    if rpn is None:
        found = {h.ranks_per_node for h in of_it if h.ranks_per_node}
        if len(found) != 1:
            raise ReplicationError(
                f"cannot tell which ranks live on node {node_id}: the holdings of iteration {it} "
                f"report ranks_per_node {sorted(found) or 'nowhere'}; pass ranks_per_node explicitly"
            )
        (rpn,) = found
    world = of_it[0].world_size
    have = {(int(i), int(o)) for i, o in held_locally}
    load: Dict[int, int] = {}
    sources = []
    for owner in range(node_id * rpn, min((node_id + 1) * rpn, world)):
        if (it, owner) in have:
            continue
        nodes = sorted(
            {h.node for h in of_it if h.owner == owner and h.node is not None and h.node != node_id}
        )
        if not nodes:
            continue  # complete means someone has it; only this node itself (already local)
        nbytes = max(h.total_bytes for h in of_it if h.owner == owner)
        nodes.sort(key=lambda n: (load.get(n, 0), n))
        load[nodes[0]] = load.get(nodes[0], 0) + nbytes
        sources.append((owner, tuple(nodes)))
    return RecoveryPlan(it, world, rpn, tuple(sources))


# --------------------------------------------------------------------------- errors


class DaemonError(ProtocolError):
    """A daemon answered a request with ERROR; ``code`` is its ErrorCode."""

    reason = "daemon"

    def __init__(
        self,
        what: str,
        *,
        peer: Optional[str] = None,
        fix: Optional[str] = None,
        code: ErrorCode = ErrorCode.INTERNAL,
        retryable: bool = False,
    ):
        super().__init__(what, peer=peer, fix=fix)
        self.code = code
        self.retryable = retryable

    def __reduce__(self):
        return (
            _rebuild_daemon_error,
            (type(self), self.what, self.peer, self.fix, self.code, self.retryable),
        )


def _rebuild_daemon_error(cls, what, peer, fix, code, retryable):
    return cls(what, peer=peer, fix=fix, code=code, retryable=retryable)


class DaemonStoreFullError(DaemonError, StoreFullError):
    """The daemon's store (memory budget or tmpfs) has no room: nothing was written."""


class DaemonNotFoundError(DaemonError, NoReplicaError):
    """The daemon (or every holder it asked) does not have the requested checkpoint."""


class DaemonChecksumError(DaemonError, CorruptCheckpointError):
    """The bytes or header did not match their checksums (or the committed digest)."""


class ClockSkewError(DaemonError):
    """The daemon refused the request (without executing it) because its timestamp is outside
    the replay window of the daemon's clock: this host's and the daemon's clocks disagree.
    ``skew_s`` is this request's timestamp minus the daemon's clock, when the daemon said."""

    skew_s: Optional[float] = None


_ERROR_CLASSES = {
    ErrorCode.STORE_FULL: DaemonStoreFullError,
    ErrorCode.NOT_FOUND: DaemonNotFoundError,
    ErrorCode.CHECKSUM_MISMATCH: DaemonChecksumError,
    ErrorCode.CLOCK_SKEW: ClockSkewError,
}


def error_from_reply(reply: Message, peer: str, fix: Optional[str] = None) -> DaemonError:
    code = ErrorCode.of(reply.body.get("code", "INTERNAL"))
    cls = _ERROR_CLASSES.get(code, DaemonError)
    op = reply.body.get("op")
    try:
        op_name = MessageType(op).name if op is not None else "request"
    except ValueError:
        op_name = f"type {op}"
    exc = cls(
        f"{op_name} refused with {code.value}: {reply.body.get('message', '')}",
        peer=peer,
        fix=fix,
        code=code,
        retryable=bool(reply.body.get("retryable", False)),
    )
    skew = reply.body.get("skew_s")
    if isinstance(exc, ClockSkewError) and isinstance(skew, (int, float)) and not isinstance(skew, bool):
        exc.skew_s = float(skew)
    return exc


# --------------------------------------------------------------------------- RPC


def default_sender(rank: Optional[int] = None) -> str:
    host = socket.gethostname()
    who = f"rank-{rank}" if rank is not None else f"client-{os.getpid()}"
    return f"{who}@{host}"[:256]


class Rpc:
    """Request/answer over one DEALER socket: deadline, retries with the same ``req_id``,
    stale answers (of earlier timed-out attempts) skipped. Thread-safe (one lock).

    Used by :class:`DaemonClient` and by a daemon talking to its peers.
    """

    def __init__(
        self,
        endpoint: str,
        authenticator: Authenticator,
        *,
        sender: str,
        role: str = "client",
        context: Optional[zmq.Context] = None,
        limits: Limits = DEFAULT_LIMITS,
        replay_guard: Optional[ReplayGuard] = None,
        hello_extra: Optional[Mapping[str, Any]] = None,
        sockopts: Optional[Mapping[int, int]] = None,
        cancel: Optional[threading.Event] = None,
        clock: Callable[[], int] = time.time_ns,
    ):
        self.endpoint = endpoint
        self.cancel = cancel
        self.authenticator = authenticator
        self.sender = sender
        self.role = role
        self.limits = limits
        self._ctx = context or zmq.Context.instance()
        # The clock stamps every message and judges every answer (tests inject a skewed one).
        self._clock = clock
        self._guard = replay_guard or ReplayGuard(clock=clock)
        #: timestamp minus this host's clock of the last answer refused as stale (evidence of
        #: clock skew for the timeout message), None if none was seen during the last request
        self.stale_skew_s: Optional[float] = None
        self._hello_extra = dict(hello_extra or {})
        self._sockopts = dict(sockopts or {})
        self._sock: Optional[zmq.Socket] = None
        self._lock = threading.RLock()
        self.version = PROTOCOL_VERSION
        self.peer_hello: Dict[str, Any] = {}

    # -- socket -------------------------------------------------------------------------------

    @property
    def socket(self) -> zmq.Socket:
        """The DEALER (created on first use). Hold ``lock`` while using it directly."""
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            configure_socket(s, limits=self.limits)
            for opt, value in self._sockopts.items():
                s.setsockopt(opt, value)
            s.connect(self.endpoint)
            self._sock = s
        return self._sock

    @property
    def lock(self) -> threading.RLock:
        return self._lock

    def reset(self) -> None:
        """Drop the connection (queued messages and late answers go with it)."""
        with self._lock:
            if self._sock is not None:
                self._sock.close(linger=0)
                self._sock = None

    close = reset

    # -- requests -----------------------------------------------------------------------------

    def message(
        self,
        mtype: MessageType,
        session: str,
        body: Mapping[str, Any],
        *,
        req_id: int,
        frames: Sequence[Any] = (),
    ) -> Message:
        version = PROTOCOL_VERSION if mtype in (MessageType.HELLO,) else self.version
        return Message(
            type=mtype,
            session=session,
            sender=self.sender,
            req_id=req_id,
            body=dict(body),
            frames=tuple(frames),
            version=version,
            timestamp_ns=self._clock(),
        )

    def hello(
        self, session: str, *, timeout_s: float, retries: int = 0, credit_bytes: Optional[int] = None
    ) -> Dict[str, Any]:
        body: Dict[str, Any] = {
            "min_version": MIN_PROTOCOL_VERSION,
            "max_version": PROTOCOL_VERSION,
            "role": self.role,
            "max_frame_bytes": self.limits.max_frame_bytes,
            **self._hello_extra,
        }
        if credit_bytes is not None:
            body["credit_bytes"] = credit_bytes
        reply = self.request(
            MessageType.HELLO,
            session,
            body,
            timeout_s=timeout_s,
            retries=retries,
            expect=MessageType.HELLO_OK,
        )
        self.version = reply.body["version"]
        self.peer_hello = dict(reply.body)
        return dict(reply.body)

    def request(
        self,
        mtype: MessageType,
        session: str,
        body: Mapping[str, Any],
        *,
        timeout_s: float,
        retries: int = 0,
        expect: MessageType = MessageType.OK,
        wait_s: float = 0.0,
    ) -> Message:
        """Send and wait for the answer (``wait_s`` extra for long-polls); ERROR raises
        :class:`DaemonError`; no answer after ``retries`` re-sends raises PeerTimeout."""
        req_id = secrets.randbits(64)
        last: Optional[ProtocolError] = None
        with self._lock:
            self.stale_skew_s = None
            attempt = resends = 0
            while attempt <= retries:
                try:
                    reply = self._attempt(mtype, session, body, req_id, timeout_s=timeout_s, wait_s=wait_s)
                except PeerTimeout as exc:
                    last = exc
                    attempt += 1
                    continue
                if reply.type is MessageType.ERROR:
                    wait = self._predates_start_wait(reply)
                    if wait is not None and wait <= timeout_s and resends < _MAX_FRESH_RESENDS:
                        resends += 1  # not an attempt: the daemon answered, it wants a fresh message
                        self._sleep(wait)
                        continue
                    fix = None
                    if wait is not None:  # fresh messages were refused too: this clock is behind
                        fix = (
                            f"this host's clock still reads {wait:.3f} s before the daemon's start: it is "
                            "behind the daemon's clock; synchronise clocks (NTP/chrony)"
                        )
                    raise error_from_reply(reply, self.endpoint, fix)
                if reply.type is not expect:
                    raise DaemonError(
                        f"{mtype.name} was answered with {reply.type.name}, expected {expect.name}",
                        peer=self.endpoint,
                        fix="run the same resilient-ckpt release on the daemon and its clients",
                    )
                return reply
        raise self._no_answer(mtype, retries, timeout_s + wait_s) from last

    def _attempt(
        self,
        mtype: MessageType,
        session: str,
        body: Mapping[str, Any],
        req_id: int,
        *,
        timeout_s: float,
        wait_s: float,
    ) -> Message:
        """One send and the wait for its answer. A new Message per send: fresh nonce and
        timestamp (a daemon refuses a message older than its start, e.g. one encoded before it
        restarted), stamped once the socket can take it: one stamped while the daemon was still
        starting up would be refused (and counted among its rejected messages)."""
        self._wait_sendable(mtype, timeout_s)
        msg = self.message(mtype, session, body, req_id=req_id)
        self.send(msg, timeout_s=timeout_s)
        return self.await_reply(req_id, time.monotonic() + timeout_s + wait_s)

    def _wait_sendable(self, mtype: MessageType, timeout_s: float) -> None:
        """Until the socket can take a message (with IMMEDIATE: a connection is up); the same
        PeerTimeout a send waiting that long would raise, early if cancelled."""
        sock = self.socket
        deadline = time.monotonic() + timeout_s
        while not sock.poll(0, zmq.POLLOUT):
            remaining = deadline - time.monotonic()
            cancelled = self.cancel is not None and self.cancel.is_set()
            if remaining <= 0 or cancelled:
                raise PeerTimeout(
                    f"gave up sending {mtype.name}: shutting down"
                    if cancelled
                    else f"could not send {mtype.name} within {timeout_s:g} s (peer not connected or not reading)",
                    peer=self.endpoint,
                    fix="check that the peer's daemon is up and reachable; retry later or another holder",
                )
            sock.poll(_ms(min(remaining, _SLICE_S)), zmq.POLLOUT)

    def _no_answer(self, mtype: MessageType, retries: int, seconds: float) -> PeerTimeout:
        fix = (
            "check that the daemon is running at this endpoint (resilient-ckpt serve) and that it "
            "uses the job's secret: it drops messages it cannot authenticate without answering"
        )
        if self.stale_skew_s is not None:  # only with evidence: an answer came back outside the window
            fix += (
                f"; also, an answer from it was timestamped {self.stale_skew_s:+.1f} s from this host's "
                "clock: the clocks disagree beyond the replay window and each side drops the other's "
                "messages, synchronise clocks (NTP/chrony)"
            )
        exc = PeerTimeout(
            f"no answer to {mtype.name} after {retries + 1} attempt(s) of {seconds:g} s",
            peer=self.endpoint,
            fix=fix,
        )
        exc.clock_skew_s = self.stale_skew_s  # for callers that word their own message (the CLI)
        return exc

    def _predates_start_wait(self, reply: Message) -> Optional[float]:
        """Seconds until this host's clock passes the daemon's start, if ``reply`` refuses a
        message as older than that start (else None)."""
        start = reply.body.get("daemon_start_ns")
        if (
            ErrorCode.of(reply.body.get("code", "")) is not ErrorCode.REPLAYED
            or not isinstance(start, int)
            or isinstance(start, bool)
        ):
            return None
        return max(0.0, (start - self._clock()) / 1e9) + 0.001

    def _sleep(self, seconds: float) -> None:
        if self.cancel is None:
            time.sleep(seconds)
        elif self.cancel.wait(seconds):
            raise PeerTimeout("shutting down", peer=self.endpoint)

    def send(self, msg: Message, *, timeout_s: float) -> None:
        """Send on this channel's socket (hold ``lock``); PeerTimeout, early if cancelled."""
        send_until(
            self.socket,
            msg,
            self.authenticator,
            timeout_s=timeout_s,
            limits=self.limits,
            cancel=self.cancel,
            peer=self.endpoint,
        )

    def await_reply(self, req_id: int, deadline: float) -> Message:
        """The next message echoing ``req_id``; others (late answers, stray CREDIT) are skipped."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self.cancel is not None and self.cancel.is_set()):
                raise PeerTimeout(
                    "no answer within the deadline" if remaining <= 0 else "shutting down", peer=self.endpoint
                )
            if self.cancel is not None:
                remaining = min(remaining, _SLICE_S)
            try:
                label, frames = recv_raw(self.socket, timeout_ms=max(1, _ms(remaining)), limits=self.limits)
                reply = decode(
                    frames,
                    self.authenticator,
                    expected_session=None,
                    replay_guard=self._guard,
                    limits=self.limits,
                    peer=label,
                )
            except PeerTimeout:
                if self.cancel is not None:
                    continue  # one slice passed; the loop checks the deadline and the cancel
                raise
            except StaleMessage as exc:
                # Authenticated (the guard runs after the tag) but outside the window of this
                # host's clock. An answer echoing this request's random req_id was made for it,
                # so it is no replay: take it (a daemon's CLOCK_SKEW error carries its own
                # clock, which a skewed client's guard refuses in turn); note the skew.
                if exc.skew_s is not None:
                    self.stale_skew_s = exc.skew_s
                try:
                    reply = decode(
                        frames,
                        self.authenticator,
                        expected_session=None,
                        replay_guard=None,
                        limits=self.limits,
                        peer=label,
                    )
                except ProtocolError:
                    continue
            except ProtocolError:
                continue  # not a valid answer (counted nowhere: a client has no metrics)
            if reply.req_id == req_id and reply.type is not MessageType.CREDIT:
                return reply


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


#: Longest single wait while a cancel event may be set (daemon shutdown stays prompt).
_SLICE_S = 0.1
#: Re-sends of a request the daemon refused as older than its start, per request.
_MAX_FRESH_RESENDS = 3


def send_until(
    sock: zmq.Socket,
    msg: Message,
    authenticator: Authenticator,
    *,
    timeout_s: float,
    limits: Limits = DEFAULT_LIMITS,
    cancel: Optional[threading.Event] = None,
    peer: str = "",
) -> None:
    """:func:`~.wire.sockets.send` on a DEALER that gives up early when ``cancel`` is set (the
    message is encoded once; waiting for the socket to take it happens in short slices)."""
    if cancel is None:
        send(sock, msg, authenticator, timeout_ms=_ms(timeout_s), limits=limits)
        return
    frames = encode(msg, authenticator, limits=limits)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
            return
        except zmq.Again:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or cancel.is_set():
                raise PeerTimeout(
                    f"could not send {msg.type.name} within {timeout_s:g} s (peer not connected or not reading)"
                    if remaining <= 0
                    else f"gave up sending {msg.type.name}: shutting down",
                    peer=peer,
                    fix="check that the peer's daemon is up and reachable; retry later or another holder",
                ) from None
            sock.poll(_ms(min(remaining, _SLICE_S)), zmq.POLLOUT)


# --------------------------------------------------------------------------- client


class DaemonClient:
    """A trainer's connection to its node's daemon (``resilient-ckpt serve``).

    Args:
        endpoint: the daemon's ``tcp://host:port`` (or ``ipc://``).
        session: the job session every request is for.
        authenticator: the job's; default :func:`authenticator_from_env`
            (``RESILIENT_CKPT_SECRET_FILE`` / ``RESILIENT_CKPT_SECRET``).
        timeout_s: deadline of one attempt of a request; requests are retried ``retries`` times.
        rank: names this trainer in the daemon's logs (``rank-<r>@<host>``).
        clock: ``time.time_ns``-like source of message timestamps (a test injects a skewed one).
    """

    def __init__(
        self,
        endpoint: str,
        session: str,
        authenticator: Optional[Authenticator] = None,
        timeout_s: float = 30.0,
        *,
        rank: Optional[int] = None,
        sender: Optional[str] = None,
        retries: int = 2,
        context: Optional[zmq.Context] = None,
        limits: Limits = DEFAULT_LIMITS,
        clock: Callable[[], int] = time.time_ns,
    ):
        if not isinstance(session, str) or not 1 <= len(session) <= 256:
            raise ReplicationError(f"session {session!r} must be a str of 1..256 characters")
        if not timeout_s > 0:
            raise ReplicationError(f"timeout_s must be > 0, got {timeout_s!r}")
        self.endpoint = endpoint
        self.session = session
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.authenticator = authenticator or authenticator_from_env()
        self._rpc = Rpc(
            endpoint,
            self.authenticator,
            sender=sender or default_sender(rank),
            role="client",
            context=context,
            limits=limits,
            hello_extra={"rank": rank} if rank is not None else None,
            clock=clock,
        )

    def __repr__(self) -> str:
        return f"DaemonClient({self.endpoint!r}, session={self.session!r})"

    def _call(
        self,
        mtype: MessageType,
        body: Mapping[str, Any],
        *,
        timeout_s: Optional[float] = None,
        wait_s: float = 0.0,
        retries: Optional[int] = None,
    ) -> Message:
        return self._rpc.request(
            mtype,
            self.session,
            body,
            timeout_s=timeout_s or self.timeout_s,
            retries=self.retries if retries is None else retries,
            wait_s=wait_s,
        )

    # -- basic --------------------------------------------------------------------------------

    def hello(self) -> Dict[str, Any]:
        """Handshake; returns the daemon's HELLO_OK body (version, node, limits, credit)."""
        return self._rpc.hello(self.session, timeout_s=self.timeout_s, retries=self.retries)

    def wait_ready(self, timeout: float = 30.0) -> Dict[str, Any]:
        """HELLO until the daemon answers (it may still be starting); PeerTimeout after ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            attempt = min(1.0, max(0.05, deadline - time.monotonic()))
            try:
                return self._rpc.hello(self.session, timeout_s=attempt)
            except PeerTimeout:
                if time.monotonic() >= deadline:
                    raise

    def status(self) -> Dict[str, Any]:
        """The daemon's STATUS: node id, version, store usage, peers, transfers, counters."""
        return dict(self._call(MessageType.STATUS, {}).body.get("result", {}))

    def list(
        self, iteration: Optional[int] = None, owner: Optional[int] = None, *, peers: bool = False
    ) -> List[Holding]:
        """Checkpoints of this session held by the daemon (and by its peers with ``peers``)."""
        body: Dict[str, Any] = {}
        if iteration is not None:
            body["iteration"] = iteration
        if owner is not None:
            body["owner_rank"] = owner
        if peers:
            body["peers"] = True
        result = self._call(MessageType.LIST, body).body.get("result", {})
        return sorted(
            (Holding.from_wire(h) for h in result.get("holdings", ())),
            key=lambda h: (h.iteration, h.owner, -1 if h.node is None else h.node),
        )

    def drop(self, ids: Iterable[Tuple[int, int]]) -> int:
        """Retire ``(iteration, owner)`` ids from the daemon's store; returns how many existed."""
        wire = [{"iteration": int(i), "owner_rank": int(o)} for i, o in ids]
        dropped = 0
        for start in range(0, len(wire), 4096):
            result = self._call(MessageType.DROP, {"ids": wire[start : start + 4096]}).body["result"]
            dropped += result["dropped"]
        return dropped

    # -- replication --------------------------------------------------------------------------

    def commit(
        self,
        iteration: int,
        owner: int,
        world_size: int,
        header_digest: bytes,
        total_bytes: Optional[int] = None,
        *,
        wait_s: float = 0.0,
    ) -> ReplicationState:
        """Tell the daemon that ``(iteration, owner)`` is published in the node's store: it
        replicates it to the placement's holder nodes in the background (also if this process
        dies now). Returns the state at once, or after up to ``wait_s`` if replication is not
        finished by then. Idempotent: committing again reports the state (and retries holders
        that failed)."""
        body: Dict[str, Any] = {
            "iteration": iteration,
            "owner_rank": owner,
            "world_size": world_size,
            "header_digest": bytes(header_digest),
        }
        if total_bytes is not None:
            body["total_bytes"] = total_bytes
        if wait_s > 0:
            body["wait_ms"] = _ms(wait_s)
        result = self._call(MessageType.COMMIT, body, wait_s=wait_s).body.get("result", {})
        return ReplicationState.from_wire(iteration, owner, result.get("replication"))

    def replication(self, iteration: int, owner: int, *, wait_s: float = 0.0) -> ReplicationState:
        """The replication state of an id (waiting up to ``wait_s`` for it to finish)."""
        body: Dict[str, Any] = {"iteration": iteration, "owner_rank": owner}
        if wait_s > 0:
            body["wait_ms"] = _ms(wait_s)
        result = self._call(MessageType.STATUS, body, wait_s=wait_s).body.get("result", {})
        return ReplicationState.from_wire(iteration, owner, result.get("replication"))

    def wait_replicated(
        self, iteration: int, owner: int, timeout: Optional[float] = None
    ) -> ReplicationState:
        """Block until every holder node acknowledged the id; ReplicationError naming the failed
        peer if replication failed, or if the daemon has no replication of it (not committed,
        or the daemon restarted since: commit again)."""
        timeout = self.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            state = self.replication(iteration, owner, wait_s=max(0.0, min(remaining, 10.0)))
            raise_unless_replicating(state, self.session)
            if state.state == "replicated":
                return state
            if time.monotonic() >= deadline:
                raise ReplicationError(
                    f"replication of iteration {iteration} of rank {owner} (session {self.session!r}) "
                    f"is not finished after {timeout:g} s: holders {list(state.holders)}, "
                    f"acknowledged {list(state.acked)}; fix: check the holder daemons (resilient-ckpt "
                    "status) or raise the timeout"
                )

    # -- retrieval ----------------------------------------------------------------------------

    def fetch(
        self, iteration: int, owner: int, from_node: Optional[int] = None, *, timeout: Optional[float] = None
    ) -> FetchResult:
        """Have the daemon bring ``(iteration, owner)`` into this node's store (from
        ``from_node``, else any peer holding it) and return when it is published there; then
        read it locally. Idempotent; NoReplicaError (DaemonNotFoundError) if nobody has it."""
        body: Dict[str, Any] = {"iteration": iteration, "owner_rank": owner, "pull": True}
        if from_node is not None:
            body["from_node"] = from_node
        timeout = max(self.timeout_s, timeout or 0.0)
        result = self._call(MessageType.FETCH, body, timeout_s=timeout).body.get("result", {})
        return FetchResult(
            iteration,
            owner,
            bool(result.get("already", False)),
            result.get("source_node"),
            int(result.get("total_bytes", 0)),
        )

    def wait_recovered(self, timeout: float = 300.0) -> Dict[str, Any]:
        """Wait for a daemon started with ``--recover`` to finish pulling its node's ranks;
        returns its recovery report; ReplicationError if recovery failed."""
        deadline = time.monotonic() + timeout
        while True:
            rec = self.status().get("recovery") or {}
            if rec.get("state") in ("done", "nothing"):
                return rec
            if rec.get("state") == "failed":
                raise ReplicationError(
                    f"daemon {self.endpoint} could not recover session "
                    f"{rec.get('session')!r}: {rec.get('error')}"
                )
            if not rec:
                raise ReplicationError(
                    f"daemon {self.endpoint} is not recovering anything; start it with --recover "
                    f"{self.session} or call DaemonClient.recover()"
                )
            if time.monotonic() >= deadline:
                raise ReplicationError(f"daemon {self.endpoint} still recovering after {timeout:g} s: {rec}")
            time.sleep(0.05)

    def recover(self, timeout: Optional[float] = None) -> Optional[RecoveryPlan]:
        """Pull this node's ranks of the newest complete iteration from the peer daemons (what
        ``serve --recover`` does at start). Returns the plan carried out, None if no iteration
        is complete anywhere (nothing to restore)."""
        node = self.status()["node_id"]
        everywhere = self.list(peers=True)
        local = [(h.iteration, h.owner) for h in everywhere if h.node == node]
        plan = plan_recovery(everywhere, node, held_locally=local)
        if plan is None:
            return None
        for owner, nodes in plan.sources:
            errors = []
            for src in nodes:
                try:
                    self.fetch(plan.iteration, owner, from_node=src, timeout=timeout)
                    break
                except (DaemonError, PeerTimeout) as exc:
                    errors.append(f"node {src}: {exc}")
            else:
                raise NoReplicaError(
                    f"could not pull rank {owner} of iteration {plan.iteration} from any holder: "
                    + "; ".join(errors)
                )
        return plan

    def close(self) -> None:
        self._rpc.close()

    def __enter__(self) -> "DaemonClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def raise_unless_replicating(state: ReplicationState, session: str) -> None:
    where = f"iteration {state.iteration} of rank {state.owner} (session {session!r})"
    if state.state == "failed":
        node = f"node {state.failed_node}" if state.failed_node is not None else "a holder"
        raise ReplicationError(
            f"replication of {where} to {node} failed: {state.error}; acknowledged by nodes "
            f"{list(state.acked)} of {list(state.holders)}. Fix: bring that node's daemon back and "
            "commit again (retries only the failed holders)"
        )
    if state.state in ("unknown", "local"):
        raise ReplicationError(
            f"the daemon has no replication of {where} in progress (state {state.state!r}: "
            f"{'not in its store' if state.state == 'unknown' else 'never committed since it started'}); "
            "fix: publish it and commit it (again)"
        )


__all__ = [
    "ClockSkewError",
    "DaemonChecksumError",
    "DaemonClient",
    "DaemonError",
    "DaemonNotFoundError",
    "DaemonStoreFullError",
    "FetchResult",
    "Holding",
    "RecoveryPlan",
    "ReplicationState",
    "Rpc",
    "TERMINAL_STATES",
    "complete_iterations",
    "default_sender",
    "error_from_reply",
    "header_digest",
    "plan_recovery",
    "send_until",
]
