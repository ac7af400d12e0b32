"""What the daemon's parts share, handed to each of them instead of the Daemon itself:

* :class:`DaemonContext` — configuration, authentication, the stores, the peer directory,
  metrics, the shared :class:`Ledger`, the stop and retention signals, logging, a way to run
  code in the router thread (``post``) and to open RPC channels to peers;
* :class:`Ledger` — state several threads read and write, under one lock;
* :class:`Workers` — the ``rc-daemon-work-<i>`` threads for requests that wait on peers;
* :class:`Replier` — answers on the ROUTER, and :class:`Connections` — what each peer said
  in its HELLO (router thread only).
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Deque, Dict, List, Mapping, Optional, Sequence, Tuple

import zmq

from ...version import __version__
from ..client import Rpc
from ..wire import (
    PROTOCOL_VERSION,
    Authenticator,
    ErrorCode,
    Limits,
    Message,
    MessageType,
    PeerTimeout,
    PeerUnreachable,
    ProtocolError,
    RejectCounters,
    ReplayGuard,
    error_body,
    send,
)
from .config import DATA_SOCKOPTS, DaemonConfig, RateLimit, log_event, logger
from .metrics import Metrics
from .peers import PeerDirectory
from .stores import Stores

Key = Tuple[str, int, int]  # (session, iteration, owner)


def daemon_version() -> str:
    """The running resilient_ckpt's version (HELLO_OK, STATUS, the log)."""
    return __version__


class Ledger:
    """State several threads share, under one lock: counters, ids being sent from (never
    recycled or retired meanwhile), peer liveness, pulls in progress, the recovery record.
    ``lock`` is re-entrant and also guards the replication records (ReplicationTable), so a
    decision about an id sees its records and whether it is being sent at once."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self._stats: collections.Counter = collections.Counter()
        self._busy: collections.Counter = collections.Counter()
        self._peer_state: Dict[int, Dict[str, Any]] = {}
        self._pulling: Dict[Key, Any] = {}  # key -> the Inbound being pulled (worker threads)
        self._recovery: Dict[str, Any] = {}
        #: (store bytes, checkpoints held) as last counted; the metrics gauges read it.
        self.usage: Tuple[int, int] = (0, 0)

    def count(self, **deltas: int) -> None:
        with self.lock:
            for name, n in deltas.items():
                self._stats[name] += n

    def counters(self) -> Dict[str, int]:
        with self.lock:
            return dict(self._stats)

    # ---- ids being sent from

    def hold(self, key: Key) -> None:
        with self.lock:
            self._busy[key] += 1

    def release(self, key: Key) -> None:
        with self.lock:
            self._busy[key] -= 1
            if self._busy[key] <= 0:
                del self._busy[key]

    def is_busy(self, key: Key) -> bool:
        with self.lock:
            return self._busy[key] > 0

    # ---- peers

    def record_ping(self, node: int, ok: bool, error: Optional[str]) -> Optional[bool]:
        """Store a ping's outcome; returns whether the peer was reachable before (None: unknown)."""
        with self.lock:
            st = self._peer_state.setdefault(node, {})
            was = st.get("reachable")
            st["reachable"] = ok
            st["error"] = error
            if ok:
                st["last_ok"] = time.monotonic()
        return was

    def peer_states(self) -> Dict[int, Dict[str, Any]]:
        with self.lock:
            return {n: dict(st) for n, st in self._peer_state.items()}

    def peers_up(self) -> int:
        with self.lock:
            return sum(1 for p in self._peer_state.values() if p.get("reachable"))

    # ---- pulls and recovery

    def pull_started(self, key: Key, inbound: Any) -> None:
        with self.lock:
            self._pulling[key] = inbound

    def pull_ended(self, key: Key) -> None:
        with self.lock:
            self._pulling.pop(key, None)

    def pulls_in(self) -> List[Dict[str, Any]]:
        with self.lock:
            return [t.describe("pull") for t in self._pulling.values()]

    def set_recovery(self, record: Dict[str, Any]) -> None:
        with self.lock:
            self._recovery = record

    def recovery(self) -> Dict[str, Any]:
        with self.lock:
            return dict(self._recovery)


class Workers:
    """Up to ``size`` threads ``rc-daemon-work-<i>`` (started as work arrives) for requests that
    wait on peers: FETCH pulls, LIST with peers. Unlike a ThreadPoolExecutor, :meth:`stop` hands
    back every thread it started, so the daemon can join each one within its own deadline before
    it terminates the ZeroMQ context their peer sockets belong to."""

    def __init__(self, size: int, name: str = "rc-daemon-work"):
        self._size, self._name = size, name
        self._cond = threading.Condition()
        self._tasks: Deque[Tuple[Callable[..., None], Tuple[Any, ...]]] = collections.deque()
        self._threads: List[threading.Thread] = []
        self._idle = 0  # threads waiting for a task and not yet promised one
        self._stopped = False

    def submit(self, fn: Callable[..., None], *args: Any) -> bool:
        """Run ``fn(*args)`` in a worker thread. False once :meth:`stop` was called: the task is
        dropped, like those not started by then (their requesters get no answer and retry)."""
        with self._cond:
            if self._stopped:
                return False
            self._tasks.append((fn, args))
            if self._idle:
                self._idle -= 1
                self._cond.notify()
            elif len(self._threads) < self._size:
                t = threading.Thread(target=self._run, name=f"{self._name}-{len(self._threads)}", daemon=True)
                self._threads.append(t)
                t.start()
        return True

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._tasks and not self._stopped:
                    self._idle += 1
                    self._cond.wait()
                if self._stopped:
                    return
                fn, args = self._tasks.popleft()
            try:
                fn(*args)  # a task closes the sockets it opens (its peer channels) before it ends
            except Exception:
                logger.exception("worker task failed")

    def stop(self) -> List[threading.Thread]:
        """Refuse new work, drop what has not started, let the threads end after their
        current task; returns them (to join)."""
        with self._cond:
            self._stopped = True
            self._tasks.clear()
            self._cond.notify_all()
            return list(self._threads)


@dataclass
class DaemonContext:
    """The daemon's shared parts. ``post`` runs a function in the router thread (the only one
    that may touch the ROUTER); ``zmq_context`` and ``endpoint`` are set once it has bound."""

    config: DaemonConfig
    auth: Authenticator
    stores: Stores
    peers: PeerDirectory
    ledger: Ledger
    metrics: Metrics
    rejects: RejectCounters
    #: guards the answers to this daemon's own requests to peers: they echo a random req_id,
    #: so a pre-start floor would add nothing there, only refuse a peer whose clock lags.
    peer_guard: ReplayGuard
    post: Callable[[Callable[[], None]], None]
    workers: Workers
    started_ns: int = field(default_factory=time.time_ns)
    started_monotonic: float = field(default_factory=time.monotonic)
    stopping: threading.Event = field(default_factory=threading.Event)
    retention_due: threading.Event = field(default_factory=threading.Event)
    log_limit: RateLimit = field(default_factory=RateLimit)
    zmq_context: Optional[zmq.Context] = None
    endpoint: Optional[str] = None

    @property
    def node_id(self) -> int:
        return self.config.node_id

    @property
    def name(self) -> str:
        return f"node-{self.config.node_id}"

    @property
    def limits(self) -> Limits:
        return self.config.limits

    def event(self, level: int, event: str, **fields: Any) -> None:
        log_event(level, event, self.node_id, **fields)

    def log_reject(self, exc: ProtocolError, peer: Optional[str]) -> None:
        ok, suppressed = self.log_limit.allow(exc.reason)
        if ok:
            self.event(
                logging.WARNING,
                "message_rejected",
                reason=exc.reason,
                peer=exc.peer or peer,
                error=str(exc),
                suppressed_since_last=suppressed or None,
            )

    def rpc(self, endpoint: str, *, data: bool = False) -> Rpc:
        """A channel to a peer daemon (``data``: sized socket buffers for checkpoint bytes)."""
        assert self.zmq_context is not None
        return Rpc(
            endpoint,
            self.auth,
            sender=self.name,
            role="daemon",
            context=self.zmq_context,
            limits=self.limits,
            replay_guard=self.peer_guard,
            hello_extra={"node": self.node_id},
            cancel=self.stopping,
            sockopts=DATA_SOCKOPTS if data else None,
        )

    def refresh_usage(self) -> Dict[str, Dict[str, int]]:
        """The stores' usage per session; updates the (bytes, checkpoints) the metrics read."""
        usage = self.stores.usage()
        held = 0
        for s in usage:
            store = self.stores.get(s)
            if store is not None:
                held += len(store.list())
        self.ledger.usage = (sum(u["total_bytes"] for u in usage.values()), held)
        return usage


class Replier:
    """Answers on the ROUTER (router thread only). Sends never block: a peer that does not
    read loses the answer (and retries its request), it never stalls the daemon."""

    def __init__(self, ctx: DaemonContext):
        self.ctx = ctx
        self.socket: Optional[zmq.Socket] = None  # the ROUTER, once bound

    def send(self, rid: bytes, msg: Message) -> bool:
        ctx = self.ctx
        try:
            send(self.socket, msg, ctx.auth, to=rid, timeout_ms=0, limits=ctx.limits)
            return True
        except (PeerTimeout, PeerUnreachable) as e:
            ctx.ledger.count(replies_dropped=1)
            ok, _ = ctx.log_limit.allow("reply_dropped")
            if ok:
                ctx.event(logging.INFO, "reply_dropped", peer=msg.sender, type=msg.type.name, reason=e.reason)
            return False

    def reply(
        self,
        rid: bytes,
        request: Message,
        mtype: MessageType,
        body: Mapping[str, Any],
        frames: Sequence[Any] = (),
    ) -> bool:
        return self.send(rid, request.reply(mtype, sender=self.ctx.name, body=body, frames=frames))

    def ok(self, rid: bytes, request: Message, result: Optional[Mapping[str, Any]] = None) -> bool:
        body: Dict[str, Any] = {"op": int(request.type)}
        if result is not None:
            body["result"] = dict(result)
        return self.reply(rid, request, MessageType.OK, body)

    def error(
        self, rid: bytes, request: Message, code: ErrorCode, text: str, *, retryable: bool = False
    ) -> None:
        ctx = self.ctx
        ok, suppressed = ctx.log_limit.allow(f"request_failed:{code.value}")
        if ok:
            ctx.event(
                logging.WARNING,
                "request_failed",
                peer=request.sender,
                op=request.type.name,
                code=code.value,
                session=request.session,
                iteration=request.body.get("iteration"),
                owner=request.body.get("owner_rank"),
                reason=text[:500],
                suppressed_since_last=suppressed or None,
            )
        body = error_body(code, text, op=int(request.type))
        if retryable:
            body["retryable"] = True
        self.reply(rid, request, MessageType.ERROR, body)


@dataclass
class Conn:
    """What a peer (by routing id) announced in its HELLO."""

    role: str = "client"
    version: int = PROTOCOL_VERSION
    credit_bytes: Optional[int] = None
    max_frame_bytes: Optional[int] = None
    sender: str = ""


class Connections:
    """The HELLOs of the most recently active peers (router thread only; the least recently
    active are forgotten beyond ``capacity``)."""

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self._conns: "OrderedDict[bytes, Conn]" = OrderedDict()

    def get(self, rid: bytes) -> Optional[Conn]:
        return self._conns.get(rid)

    def touch(self, rid: bytes) -> None:
        if rid in self._conns:
            self._conns.move_to_end(rid)

    def add(self, rid: bytes, conn: Conn) -> None:
        self._conns[rid] = conn
        self._conns.move_to_end(rid)
        while len(self._conns) > self.capacity:
            self._conns.popitem(last=False)
