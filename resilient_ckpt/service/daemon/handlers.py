"""The daemon's answers to HELLO, COMMIT, LIST, DROP, STATUS and FETCH (router thread; LIST
across peers runs in the worker pool), COMMIT / STATUS long-polls, the STATUS report, and the
answer to a message refused while decoding."""

from __future__ import annotations

import contextlib
import functools
import heapq
import itertools
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Tuple

from ...errors import CheckpointingException, ReplicationError
from ...memory.layout import CheckpointHeader, CheckpointId
from ...memory.store import CheckpointStore
from ..client import Holding, header_digest
from ..wire import (
    PROTOCOL_VERSION,
    ErrorCode,
    LimitExceeded,
    Message,
    MessageType,
    PredatesStart,
    ProtocolError,
    StaleMessage,
    error_body,
    format_time_ns,
    negotiate_version,
)
from .config import logger
from .context import Conn, Connections, DaemonContext, Key, Replier, daemon_version
from .fetch import FetchStreams, Puller, gather_peers
from .inbound import Receiver, TransferError
from .replication import ReplicationTable, holder_nodes

# --------------------------------------------------------------------------- refused messages


def rejection_body(
    exc: ProtocolError, *, node_id: int, window_ns: int, started_ns: int
) -> Optional[Dict[str, Any]]:
    """The ERROR body answering a message refused while decoding, None: not answered."""
    if exc.reason in ("malformed", "version", "unknown_type", "session"):
        return error_body(exc)
    where = f"node {node_id} ({socket.gethostname()})"
    if isinstance(exc, StaleMessage) and exc.skew_s is not None:
        return error_body(
            ErrorCode.CLOCK_SKEW,
            f"clock skew: your timestamp is {exc.skew_s:+.1f} s from the daemon's clock on {where}, outside "
            f"the ±{window_ns / 1e9:g} s replay window; the request was not executed. Fix: "
            "synchronise clocks (NTP/chrony) on this host and on the daemon's node",
            skew_s=float(exc.skew_s),
            daemon_time_ns=time.time_ns(),
            node=node_id,
        )
    if isinstance(exc, PredatesStart):
        return error_body(
            ErrorCode.REPLAYED,
            f"message predates this daemon's start at {format_time_ns(started_ns)} on {where}: a replay, "
            "or a message sent before the restart; it was not executed. Fix: resend it as a new message "
            "(a fresh timestamp is accepted; DaemonClient does so by itself)",
            retryable=True,
            daemon_start_ns=started_ns,
            daemon_time_ns=time.time_ns(),
            node=node_id,
        )
    return None


# --------------------------------------------------------------------------- long-polls

_WAITER_SEQ = itertools.count()


@dataclass
class Waiter:
    rid: bytes
    request: Message
    deadline: float
    kind: str  # "commit" | "status"
    seq: int = field(default_factory=lambda: next(_WAITER_SEQ))


class Waiters:
    """COMMIT / STATUS requests with ``wait_ms`` waiting for a replication to finish (router
    thread only). ``answer(rid, request, kind, key)`` answers one with the current state."""

    def __init__(self, answer: Callable[[bytes, Message, str, Key], None]):
        self._answer = answer
        self._by_key: Dict[Key, List[Waiter]] = {}
        self._heap: List[Tuple[float, int, Key]] = []

    def add(self, key: Key, w: Waiter) -> None:
        self._by_key.setdefault(key, []).append(w)
        heapq.heappush(self._heap, (w.deadline, w.seq, key))

    def wake(self, key: Key) -> None:
        """The replication of ``key`` finished: everyone waiting for it is answered."""
        for w in self._by_key.pop(key, ()):
            self._answer(w.rid, w.request, w.kind, key)

    def expire(self, now: float) -> None:
        """Long-polls whose wait is over get the current state."""
        while self._heap and self._heap[0][0] <= now:
            _, wid, key = heapq.heappop(self._heap)
            waiting = self._by_key.get(key, [])
            for w in [w for w in waiting if w.seq == wid]:
                waiting.remove(w)
                self._answer(w.rid, w.request, w.kind, key)
            if not waiting:
                self._by_key.pop(key, None)

    def next_deadline(self) -> Optional[float]:
        return self._heap[0][0] if self._heap else None


# --------------------------------------------------------------------------- requests


def filter_holdings(holdings: Iterable[Holding], body: Mapping[str, Any]) -> List[Holding]:
    """The holdings a LIST body's optional ``iteration`` / ``owner_rank`` select."""
    it, owner = body.get("iteration"), body.get("owner_rank")
    return [h for h in holdings if (it is None or h.iteration == it) and (owner is None or h.owner == owner)]


def saved_after(store: CheckpointStore, key: Key, sent_ns: int) -> bool:
    """True if ``key`` was published (header written) or, unpublished, claimed (data file
    renamed into place) after ``sent_ns``: a DROP names the save that existed when it was
    sent, never a newer save of the same id (a re-run that saved that iteration again)."""
    cid = CheckpointId(key[1], key[2], key[0])
    with contextlib.suppress(OSError):
        return store.header_path(cid).stat().st_mtime_ns > sent_ns
    with contextlib.suppress(OSError):
        return store.data_path(cid).stat().st_ctime_ns > sent_ns
    return False


class Requests:
    """The request handlers, by message type (:meth:`handler`). COMMIT starts replication in
    :attr:`table`; the receive side, FETCH streams and pulls are the given collaborators."""

    def __init__(
        self,
        ctx: DaemonContext,
        replies: Replier,
        conns: Connections,
        receiver: Receiver,
        streams: FetchStreams,
        puller: Puller,
    ):
        self.ctx, self.replies, self.conns = ctx, replies, conns
        self.receiver, self.streams, self.puller = receiver, streams, puller
        self.waiters = Waiters(self._answer_replication)
        self.table = ReplicationTable(ctx, on_finished=self._replication_finished)
        self._handlers: Dict[MessageType, Callable[[bytes, str, Message], None]] = {
            MessageType.HELLO: self.on_hello,
            MessageType.COMMIT: self.on_commit,
            MessageType.REPLICATE_BEGIN: receiver.on_begin,
            MessageType.REPLICATE_CHUNK: receiver.on_chunk,
            MessageType.REPLICATE_END: receiver.on_end,
            MessageType.FETCH: self.on_fetch,
            MessageType.LIST: self.on_list,
            MessageType.DROP: self.on_drop,
            MessageType.STATUS: self.on_status,
            MessageType.CREDIT: streams.on_credit,
            MessageType.ERROR: streams.on_peer_error,
        }

    def handler(self, mtype: MessageType) -> Optional[Callable[[bytes, str, Message], None]]:
        """The handler of a request type; None for answers (OK, HELLO_OK): never answered."""
        return self._handlers.get(mtype)

    # ---- HELLO, LIST, DROP -----------------------------------------------------------------

    def on_hello(self, rid: bytes, label: str, msg: Message) -> None:
        ctx, b = self.ctx, msg.body
        version = negotiate_version(b["min_version"], b["max_version"], peer=label)
        self.conns.add(
            rid,
            Conn(
                role=b["role"],
                version=version,
                credit_bytes=b.get("credit_bytes"),
                max_frame_bytes=b.get("max_frame_bytes"),
                sender=msg.sender,
            ),
        )
        self.replies.reply(
            rid,
            msg,
            MessageType.HELLO_OK,
            {
                "version": version,
                "role": "daemon",
                "max_frame_bytes": ctx.limits.max_frame_bytes,
                "credit_bytes": ctx.config.credit_bytes,
                "node": ctx.node_id,
                "daemon_version": daemon_version(),
            },
        )

    def on_list(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        if b.get("peers"):
            self.ctx.workers.submit(self._list_everywhere, rid, msg)
            return
        holdings = filter_holdings(self.ctx.stores.holdings(msg.session), b)
        self.replies.ok(rid, msg, {"holdings": [h.to_wire() for h in holdings]})

    def _list_everywhere(self, rid: bytes, msg: Message) -> None:
        """LIST with ``peers``: this node's holdings and every peer's (worker thread)."""
        ctx = self.ctx
        try:
            local = filter_holdings(ctx.stores.holdings(msg.session), msg.body)
            others, unreachable = gather_peers(
                ctx, msg.session, iteration=msg.body.get("iteration"), owner=msg.body.get("owner_rank")
            )
            result = {"holdings": [h.to_wire() for h in local + others], "unreachable": unreachable}
            ctx.post(lambda: self._answer_list(rid, msg, result))
        except Exception as e:
            logger.exception("LIST peers failed")
            text = f"{type(e).__name__}: {e}"  # bound now: ``e`` is unset after this block
            ctx.post(lambda: self.replies.error(rid, msg, ErrorCode.INTERNAL, text))

    def _answer_list(self, rid: bytes, msg: Message, result: Dict[str, Any]) -> None:
        try:
            self.replies.ok(rid, msg, result)
        except LimitExceeded:
            self.replies.error(
                rid,
                msg,
                ErrorCode.LIMIT_EXCEEDED,
                (
                    f"{len(result['holdings'])} holdings across the peers do not fit one answer "
                    f"({self.ctx.limits.max_header_bytes} header bytes); filter LIST by iteration or owner_rank, or "
                    "let the daemon plan the recovery itself (serve --recover)"
                ),
            )

    def on_drop(self, rid: bytes, label: str, msg: Message) -> None:
        ctx = self.ctx
        store = ctx.stores.get(msg.session)
        dropped = 0
        kept = []
        for item in msg.body["ids"]:
            key = (msg.session, item["iteration"], item["owner_rank"])
            if store is None:
                continue
            if saved_after(store, key, msg.timestamp_ns):
                kept.append(f"{key[1]}/{key[2]}")
                continue
            if self._drop(store, key):
                dropped += 1
        if dropped:
            ctx.event(logging.INFO, "dropped", peer=msg.sender, session=msg.session, count=dropped)
        if kept:
            ctx.event(
                logging.INFO,
                "drop_kept_newer",
                peer=msg.sender,
                session=msg.session,
                ids=",".join(kept[:50]),
                reason="saved again after the DROP was sent: the DROP named an "
                "older save of these ids (delayed, or the sender's clock is behind this node's)",
            )
        self.replies.ok(rid, msg, {"dropped": dropped})

    def _drop(self, store: CheckpointStore, key: Key) -> bool:
        cid = CheckpointId(key[1], key[2], key[0])
        exists = store.header_path(cid).exists() or store.data_path(cid).exists()
        busy = self.table.cancel(key)
        if exists:
            # A mapping being sent from stays valid when the file is unlinked; recycling it
            # into the pool could let a new save overwrite bytes still in flight.
            store.discard(cid, recycle=not busy)
        return exists

    # ---- COMMIT and STATUS -----------------------------------------------------------------

    def on_commit(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        key = (msg.session, b["iteration"], b["owner_rank"])
        digest, header = self._committed_header(msg, key)
        holders = self._holders(header, key)
        rec = self.table.start(key, digest, header, holders, msg.sender)
        if b.get("wait_ms") and self.table.is_replicating(rec):
            self.waiters.add(key, Waiter(rid, msg, time.monotonic() + b["wait_ms"] / 1000, "commit"))
            return
        self._answer_replication(rid, msg, "commit", key)

    def _committed_header(self, msg: Message, key: Key) -> Tuple[bytes, CheckpointHeader]:
        """(digest, header) of the published checkpoint a COMMIT names, checked against it."""
        stores, b = self.ctx.stores, msg.body
        session = key[0]
        cid = CheckpointId(key[1], key[2], session)
        store = stores.get(session)
        raw = stores.raw_header(store, cid) if store is not None else None
        if raw is None:
            raise TransferError(
                ErrorCode.NOT_FOUND,
                f"{cid.stem()} of session {session!r} is not published in this node's store "
                f"{stores.root}; publish it (header written) before COMMIT, and make sure the "
                "trainer and this daemon use the same store root",
            )
        digest = header_digest(raw)
        if digest != bytes(b["header_digest"]):
            raise TransferError(
                ErrorCode.CHECKSUM_MISMATCH,
                f"the committed header digest does not match the published header of {cid.stem()} "
                "(it was re-published since?); commit the digest of the current header file",
            )
        try:
            header = CheckpointHeader.unpack(raw, source=str(store.header_path(cid)))
        except CheckpointingException as e:
            raise TransferError(ErrorCode.CHECKSUM_MISMATCH, str(e)) from None
        if header.world_size != b["world_size"]:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"COMMIT says world size {b['world_size']}, the header {header.world_size}",
            )
        return digest, header

    def _holders(self, header: CheckpointHeader, key: Key) -> Tuple[int, ...]:
        """The other nodes that must hold a replica (never this one)."""
        try:
            holders = holder_nodes(header)
        except ReplicationError as e:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"the header's replication parameters {header.replication} are unusable: {e}",
            ) from None
        node_id = self.ctx.node_id
        if node_id in holders:
            self.ctx.event(
                logging.WARNING,
                "own_node_is_holder",
                session=key[0],
                iteration=key[1],
                owner=key[2],
                reason="this daemon's --node-id is a holder of a checkpoint committed to it: node ids "
                "and ranks_per_node disagree",
            )
            holders = tuple(n for n in holders if n != node_id)
        return holders

    def _replication_finished(self, key: Key) -> None:
        """Called from a pusher thread: long-polls on ``key`` are answered by the router."""
        self.ctx.post(functools.partial(self.waiters.wake, key))

    def _answer_replication(self, rid: bytes, request: Message, kind: str, key: Key) -> None:
        wire = self.table.wire(key)
        if kind == "commit":
            self.replies.ok(rid, request, {"stored": True, "replication": wire})
        else:
            self.replies.ok(rid, request, {"replication": wire})

    def on_status(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        if "iteration" not in b:
            self.replies.ok(rid, msg, self.status())
            return
        key = (msg.session, b["iteration"], b["owner_rank"])
        if b.get("wait_ms") and self.table.state(key) == "replicating":
            self.waiters.add(key, Waiter(rid, msg, time.monotonic() + b["wait_ms"] / 1000, "status"))
            return
        self._answer_replication(rid, msg, "status", key)

    # ---- FETCH -----------------------------------------------------------------------------

    def on_fetch(self, rid: bytes, label: str, msg: Message) -> None:
        if msg.body.get("pull"):
            self.puller.on_pull(rid, msg)
        else:
            self.streams.serve(rid, label, msg)

    # ---- the STATUS report -----------------------------------------------------------------

    def status(self) -> Dict[str, Any]:
        """The STATUS result (plain msgpack values)."""
        ctx = self.ctx
        usage = ctx.refresh_usage()
        in_flight, failed = self.table.summary()
        recovery = ctx.ledger.recovery()
        out = {
            "node_id": ctx.node_id,
            "version": daemon_version(),
            "protocol_version": PROTOCOL_VERSION,
            "endpoint": ctx.endpoint,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - ctx.started_monotonic, 3),
            "started_at": format_time_ns(ctx.started_ns),
            "store": self._store_report(usage),
            "peers": self._peer_report(),
            "replicating": in_flight[:1000],
            "replications_failed": failed,
            # which holder node did not get which checkpoint, when, and whether the push gave up
            # (failed: unreachable after its retries) or had nothing left to deliver (abandoned)
            "recent_failures": list(self.table.recent_failures),
            "inbound": (self.receiver.describe() + ctx.ledger.pulls_in())[:1000],
            "serving": self.streams.describe()[:1000],
            "pulling": [{"session": k[0], "iteration": k[1], "owner": k[2]} for k in self.puller.tasks][
                :1000
            ],
            "counters": ctx.ledger.counters(),
            "rejected": ctx.rejects.snapshot(),
        }
        if recovery:
            out["recovery"] = recovery
        return out

    def _store_report(self, usage: Mapping[str, Mapping[str, int]]) -> Dict[str, Any]:
        ctx = self.ctx
        sessions = []
        for s, u in sorted(usage.items()):
            store = ctx.stores.get(s)
            sessions.append(
                {
                    "session": s,
                    "checkpoints": len(store.list()) if store else 0,
                    "data_bytes": u["data_bytes"],
                    "free_pool_bytes": u["free_pool_bytes"],
                }
            )
        fs: Dict[str, int] = {}
        with contextlib.suppress(OSError):
            st = os.statvfs(ctx.stores.root)
            fs = {"fs_total_bytes": st.f_blocks * st.f_frsize, "fs_free_bytes": st.f_bavail * st.f_frsize}
        total, held = ctx.ledger.usage
        return {
            "root": str(ctx.stores.root),
            "total_bytes": total,
            **fs,
            "checkpoints": held,
            "memory_budget": ctx.config.memory_budget,
            "keep_last": ctx.config.keep_last,
            "sessions": sessions,
        }

    def _peer_report(self) -> List[Dict[str, Any]]:
        ctx = self.ctx
        now = time.monotonic()
        nodes = ctx.peers.nodes()
        endpoints = {n: ctx.peers.endpoint(n) or "" for n in nodes}
        states = ctx.ledger.peer_states()
        peers = []
        for node in sorted(set(nodes) | set(states)):
            st = states.get(node, {})
            last = st.get("last_ok")
            peers.append(
                {
                    "node": node,
                    "endpoint": endpoints.get(node, ""),
                    "reachable": st.get("reachable"),
                    "last_seen_s": None if last is None else round(now - last, 3),
                    "error": st.get("error"),
                }
            )
        return peers
