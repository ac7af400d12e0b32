"""Push replication: what the daemon does after a COMMIT. :class:`ReplicationTable` keeps
one record per committed checkpoint id (which holder nodes stored it) and one
:class:`PeerPusher` thread per holder node, which sends queued checkpoints to that node's
daemon one after another. The trainer may die right after its COMMIT was answered: the
replica still lands.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import queue
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import xxhash
import zmq
import zmq.utils.monitor

from ...errors import CheckpointingException
from ...memory.layout import CheckpointHeader, CheckpointId
from ...replication.placement import Placement
from ..client import Rpc, header_digest
from ..wire import (
    CreditWindow,
    ErrorCode,
    Message,
    MessageType,
    PeerTimeout,
    ProtocolError,
    chunk_checksum,
    format_time_ns,
    recv,
)
from .config import DaemonConfig, logger
from .context import DaemonContext, Key
from .stores import ReadOnlyMap


@dataclass
class Replication:
    """The daemon's record of one committed checkpoint's replication to its holder nodes."""

    key: Key
    digest: bytes
    world_size: int
    total_bytes: int
    holders: Tuple[int, ...]
    nodes: Dict[int, str] = field(default_factory=dict)  # node -> pending | ok | failed
    errors: Dict[int, str] = field(default_factory=dict)
    bytes_out: int = 0
    started: float = field(default_factory=time.monotonic)
    finished: Optional[float] = None
    cancelled: bool = False
    generation: int = 0

    def state(self) -> str:
        values = self.nodes.values()
        if any(v == "pending" for v in values):
            return "replicating"
        if any(v == "failed" for v in values):
            return "failed"
        return "replicated"

    def retry_failed(self) -> List[int]:
        """The failed holders go back to pending, as a new generation; returns them."""
        failed = [n for n, v in self.nodes.items() if v == "failed"]
        if failed:
            for n in failed:
                self.nodes[n] = "pending"
                self.errors.pop(n, None)
            self.finished = None
            self.generation += 1
        return failed

    def to_wire(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {
            "state": self.state(),
            "holders": list(self.holders),
            "acked": [n for n in self.holders if self.nodes.get(n) == "ok"],
            "bytes_out": self.bytes_out,
            "seconds": float((self.finished or time.monotonic()) - self.started),
        }
        failed = [n for n in self.holders if self.nodes.get(n) == "failed"]
        if failed:
            out["failed_node"] = failed[0]
            out["error"] = "; ".join(f"node {n}: {self.errors.get(n, '?')}" for n in failed)[:8192]
        return out


@functools.lru_cache(maxsize=256)
def _placement(world_size: int, factor: int, jump: int, rpn: int, kind: str) -> Placement:
    return Placement(world_size, factor, jump, rpn, kind)


def holder_nodes(header: CheckpointHeader) -> Tuple[int, ...]:
    """Nodes (in preference order) that must hold a replica of ``header``'s checkpoint."""
    rep = header.replication or {}
    factor = int(rep.get("factor", 1) or 1)
    if factor <= 1:
        return ()
    rpn = int(rep.get("ranks_per_node") or 1)
    jump = int(rep.get("jump") or rpn)
    kind = str(rep.get("kind") or "ring")
    placement = _placement(header.world_size, factor, jump, rpn, kind)
    out: List[int] = []
    for h in placement.holders_of(header.owner):
        n = h // rpn
        if n not in out and n != header.owner // rpn:
            out.append(n)
    return tuple(out)


#: Records kept at most; the oldest finished ones go first.
MAX_RECORDS = 10000
#: Failed and abandoned pushes STATUS lists (the newest; older ones stay in the log).
RECENT_FAILURES = 32


class ReplicationTable:
    """Replication records by checkpoint id and the pusher thread of each holder node. Both
    are guarded by the ledger's lock. ``on_finished(key)`` is called (from a pusher thread)
    when an id's replication reached a terminal state."""

    def __init__(self, ctx: DaemonContext, on_finished: Callable[[Key], None]):
        self.ctx = ctx
        self._lock = ctx.ledger.lock
        self._records: Dict[Key, Replication] = {}
        self._pushers: Dict[int, PeerPusher] = {}
        self._on_finished = on_finished
        #: the newest pushes that did not deliver: which node, which checkpoint, when, why
        self.recent_failures: "collections.deque[Dict[str, Any]]" = collections.deque(maxlen=RECENT_FAILURES)

    def start(
        self, key: Key, digest: bytes, header: CheckpointHeader, holders: Tuple[int, ...], committer: str
    ) -> Replication:
        """Replicate ``key`` to ``holders``. A repeated COMMIT of the same save retries the
        failed holders, or only reports; a new save of the id supersedes the old record."""
        with self._lock:
            rec = self._records.get(key)
            if rec is not None and rec.digest == digest and not rec.cancelled:
                targets = rec.retry_failed()
                if not targets:
                    return rec  # in progress or done: a repeated COMMIT only reports
            else:
                rec = self._new_record(key, digest, header, holders, superseded=rec)
                targets = list(holders)
            for n in targets:
                self._pusher(n).submit(rec, n)
        self.ctx.event(
            logging.INFO,
            "commit",
            peer=committer,
            session=key[0],
            iteration=key[1],
            owner=key[2],
            holders=list(holders),
            retry=bool(rec.generation) or None,
        )
        return rec

    def _new_record(
        self,
        key: Key,
        digest: bytes,
        header: CheckpointHeader,
        holders: Tuple[int, ...],
        superseded: Optional[Replication],
    ) -> Replication:
        if superseded is not None:
            superseded.cancelled = True  # a new save of the same id
        rec = Replication(
            key, digest, header.world_size, header.data_nbytes, holders, nodes={n: "pending" for n in holders}
        )
        if not holders:
            rec.finished = rec.started
        self._records[key] = rec
        self._prune()
        return rec

    def _prune(self) -> None:
        if len(self._records) <= MAX_RECORDS:
            return
        done = sorted((r.finished, k) for k, r in self._records.items() if r.finished is not None)
        for _, k in done[: len(self._records) - MAX_RECORDS]:
            self._records.pop(k, None)

    def _pusher(self, node: int) -> "PeerPusher":
        p = self._pushers.get(node)
        if p is None:
            p = self._pushers[node] = PeerPusher(self.ctx, node, self.push_done)
            p.thread.start()
        return p

    def push_done(
        self,
        rec: Replication,
        node: int,
        generation: int,
        ok: bool,
        error: str,
        nbytes: int,
        seconds: float,
        abandoned: bool = False,
    ) -> None:
        """A pusher is done with one holder node: delivered (``ok``), given up on after its
        retries (failed: the node unreachable or refusing), or ``abandoned`` (the checkpoint was
        removed, re-saved or dropped meanwhile: the trainers' save failed, nothing to deliver)."""
        ctx = self.ctx
        outcome = "ok" if ok else "abandoned" if abandoned else "failed"
        with self._lock:
            if rec.generation != generation or rec.nodes.get(node) != "pending":
                return
            rec.nodes[node] = "ok" if ok else "failed"
            if not ok:
                rec.errors[node] = error
                self.recent_failures.append(
                    {
                        "node": node,
                        "session": rec.key[0],
                        "iteration": rec.key[1],
                        "owner": rec.key[2],
                        "outcome": outcome,
                        "reason": error[:500],
                        "at": format_time_ns(time.time_ns()),
                    }
                )
            rec.bytes_out += nbytes
            finished = rec.state() != "replicating"
            if finished:
                rec.finished = time.monotonic()
            ctx.ledger.count(**{f"replications_{outcome}": 1, "bytes_out": nbytes})
        ctx.metrics.replications.labels(outcome).inc()
        ctx.metrics.bytes.labels("out").inc(nbytes)
        if ok:
            ctx.metrics.seconds.observe(seconds)
        session, it, owner = rec.key
        ctx.event(
            logging.INFO if ok or abandoned else logging.WARNING,
            {"ok": "replicated", "abandoned": "replication_abandoned", "failed": "replication_failed"}[
                outcome
            ],
            peer=f"node-{node}",
            session=session,
            iteration=it,
            owner=owner,
            bytes=nbytes,
            seconds=round(seconds, 4),
            reason=None if ok else error,
        )
        if finished:
            self._on_finished(rec.key)
            ctx.retention_due.set()

    def is_replicating(self, rec: Replication) -> bool:
        with self._lock:
            return rec.state() == "replicating"

    def state(self, key: Key) -> Optional[str]:
        """The id's replication state, None if there is no record of it."""
        with self._lock:
            rec = self._records.get(key)
            return None if rec is None else rec.state()

    def wire(self, key: Key) -> Dict[str, Any]:
        """The REPLICATION body of ``key``: its record, else whether the store holds it."""
        with self._lock:
            rec = self._records.get(key)
            if rec is not None:
                return rec.to_wire()
        store = self.ctx.stores.get(key[0])
        if store is not None and store.header_path(CheckpointId(key[1], key[2], key[0])).exists():
            return {"state": "local"}
        return {"state": "unknown"}

    def cancel(self, key: Key) -> bool:
        """Forget (and stop pushing) ``key``; returns whether it is being sent from right now."""
        with self._lock:
            rec = self._records.pop(key, None)
            if rec is not None:
                rec.cancelled = True
            return self.ctx.ledger.is_busy(key)

    def retire(self, key: Key) -> bool:
        """Forget ``key`` unless it is being sent or replicated (then False: try later)."""
        with self._lock:
            rec = self._records.get(key)
            if self.ctx.ledger.is_busy(key) or (rec is not None and rec.state() == "replicating"):
                return False
            self._records.pop(key, None)
            return True

    def summary(self) -> Tuple[List[Dict[str, Any]], int]:
        """(the replications in progress as STATUS lists them, how many failed)."""
        with self._lock:
            in_flight = [
                {"session": k[0], "iteration": k[1], "owner": k[2], **r.to_wire()}
                for k, r in self._records.items()
                if r.state() == "replicating"
            ]
            failed = sum(1 for r in self._records.values() if r.state() == "failed")
        return in_flight, failed

    def stop(self) -> List[threading.Thread]:
        """Ask every pusher to stop; returns their threads (to join)."""
        with self._lock:
            pushers = list(self._pushers.values())
        for p in pushers:
            p.stop()
        return [p.thread for p in pushers]


# --------------------------------------------------------------------------- pushers


class PushFailed(Exception):
    """One attempt failed. ``abandoned``: there is nothing to deliver any more (the checkpoint
    was removed, re-published or dropped); never retried."""

    def __init__(
        self, text: str, retryable: bool = True, code: Optional[ErrorCode] = None, abandoned: bool = False
    ):
        super().__init__(text)
        self.retryable = retryable and not abandoned
        self.code = code
        self.abandoned = abandoned


#: ERROR codes after which pushing the same bytes again cannot succeed.
_FINAL_CODES = (ErrorCode.STORE_FULL, ErrorCode.LIMIT_EXCEEDED, ErrorCode.WRONG_SESSION, ErrorCode.MALFORMED)

PushDone = Callable[..., None]


@dataclass(frozen=True)
class PushPlan:
    """How a checkpoint of ``total`` bytes goes out: chunks no larger than this daemon's chunk
    size, the receiver's credit window and either side's frame limit."""

    total: int
    chunk: int
    num_chunks: int
    window_bytes: int

    @classmethod
    def for_peer(cls, total: int, peer_hello: Mapping[str, Any], cfg: DaemonConfig) -> "PushPlan":
        window_bytes = int(peer_hello.get("credit_bytes") or cfg.credit_bytes)
        max_frame = int(peer_hello.get("max_frame_bytes") or cfg.limits.max_frame_bytes)
        chunk = max(1, min(cfg.chunk_bytes, window_bytes, max_frame, cfg.limits.max_frame_bytes))
        return cls(total, chunk, -(-total // chunk) if total else 0, window_bytes)

    def span(self, index: int) -> Tuple[int, int]:
        """(offset, size) of chunk ``index``."""
        off = index * self.chunk
        return off, min(self.chunk, self.total - off)


@dataclass
class _Attempt:
    """One push attempt: the channel, the req_id all its messages carry, the credit window,
    and what the receiver answered so far."""

    rpc: Rpc
    session: str
    req_id: int
    window: CreditWindow
    timeout: float
    already: bool = False  # the receiver holds this exact checkpoint: nothing to send
    stored: bool = False  # REPLICATE_END was answered


class PeerPusher:
    """Pushes committed checkpoints to one holder node's daemon, one at a time, over its own
    DEALER (thread ``rc-daemon-push-<node>``). Bytes in flight are bounded by the receiver's
    credit window; every wait has a deadline; a lost connection (socket monitor) or an ERROR
    ends the attempt, which is retried ``retries`` times with back-off."""

    def __init__(self, ctx: DaemonContext, node: int, done: PushDone):
        self.ctx = ctx
        self.node = node
        self.label = f"node-{node}"
        self._done = done
        self.queue: "queue.Queue[Optional[Tuple[Replication, int]]]" = queue.Queue()  # None: stop
        self.thread = threading.Thread(target=self._main, name=f"rc-daemon-push-{node}", daemon=True)
        self._rpc: Optional[Rpc] = None
        self._monitor: Optional[zmq.Socket] = None
        self._stop = threading.Event()

    def submit(self, rec: Replication, node: int) -> None:
        self.queue.put((rec, rec.generation))

    def stop(self) -> None:
        self._stop.set()
        self.queue.put(None)  # wakes the thread at once

    def _stopping(self) -> bool:
        return self._stop.is_set() or self.ctx.stopping.is_set()

    def _main(self) -> None:
        try:
            while not self._stopping():
                try:
                    item = self.queue.get(timeout=0.25)
                except queue.Empty:
                    continue
                if item is not None:
                    self._handle(*item)
        finally:
            self._disconnect()  # this thread's sockets, closed by this thread before it ends

    def _handle(self, rec: Replication, generation: int) -> None:
        t0 = time.monotonic()
        self.ctx.ledger.hold(rec.key)  # until the record says how it went: not retired meanwhile
        try:
            ok, error, nbytes, abandoned = self._attempts(rec, generation)
            self._done(rec, self.node, generation, ok, error, nbytes, time.monotonic() - t0, abandoned)
        except Exception as e:  # a bug: report it on the record instead of killing the thread
            logger.exception("pusher to node %d failed", self.node)
            self._done(rec, self.node, generation, False, f"internal error: {e}", 0, time.monotonic() - t0)
        finally:
            self.ctx.ledger.release(rec.key)

    def _attempts(self, rec: Replication, generation: int) -> Tuple[bool, str, int, bool]:
        """Push with retries: (ok, error, bytes sent, abandoned)."""
        retries = self.ctx.config.retries
        error = ""
        for attempt in range(retries + 1):
            if rec.cancelled or rec.generation != generation or self.ctx.stopping.is_set():
                error = "cancelled (dropped or superseded)"
                return False, error, 0, not self.ctx.stopping.is_set()
            try:
                return True, "", self._transfer(rec), False
            except PushFailed as e:
                error = str(e)
                self._disconnect()
                if e.abandoned:
                    return False, error, 0, True
                if not e.retryable:
                    break
            except (ProtocolError, CheckpointingException, OSError) as e:
                error = f"{type(e).__name__}: {e}"
                self._disconnect()
            if attempt < retries:
                self.ctx.event(
                    logging.INFO,
                    "replication_retry",
                    peer=self.label,
                    session=rec.key[0],
                    iteration=rec.key[1],
                    owner=rec.key[2],
                    attempt=attempt + 1,
                    reason=error,
                )
                if self._stop.wait(min(2.0, 0.2 * 2**attempt)):
                    break
        return False, error or "stopped", 0, False

    # -- connection --------------------------------------------------------------------------

    def _connect(self, session: str) -> Rpc:
        ctx = self.ctx
        endpoint = ctx.peers.endpoint(self.node)
        if endpoint is None:
            raise PushFailed(
                f"node {self.node} has no known endpoint: add it to --peers (or register it in "
                "the discovery store)"
            )
        if self._rpc is not None and self._rpc.endpoint == endpoint and not self._drain_monitor():
            return self._rpc
        self._disconnect()
        rpc = self._rpc = ctx.rpc(endpoint, data=True)  # kept first: _disconnect closes it whatever fails
        self._monitor = rpc.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        try:
            rpc.hello(session, timeout_s=ctx.config.peer_timeout_s)
        except PeerTimeout as e:
            raise PushFailed(
                f"node {self.node} ({endpoint}) does not answer HELLO within "
                f"{ctx.config.peer_timeout_s:g} s (daemon down or wrong secret)"
            ) from e
        self._drain_monitor()  # the connect event of this socket
        return rpc

    def _disconnect(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(Exception):
                self._rpc.socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._rpc is not None:
            self._rpc.close()
            self._rpc = None

    def _drain_monitor(self) -> bool:
        """True if the connection dropped since the last look."""
        lost = False
        while self._monitor is not None and self._monitor.poll(0):
            ev = zmq.utils.monitor.recv_monitor_message(self._monitor)
            if ev["event"] == zmq.EVENT_DISCONNECTED:
                lost = True
        return lost

    # -- one attempt -------------------------------------------------------------------------

    def _published(self, rec: Replication) -> Tuple[Any, bytes]:
        """(store, raw header) of the committed checkpoint, if it is still the one committed."""
        stores = self.ctx.stores
        session, it, owner = rec.key
        cid = CheckpointId(it, owner, session)
        store = stores.get(session)
        raw = stores.raw_header(store, cid) if store is not None else None
        if raw is None:
            raise PushFailed(
                f"{cid.stem()} was removed from this node's store before it was replicated (its save "
                "failed on the trainers, or it was dropped)",
                abandoned=True,
            )
        if header_digest(raw) != rec.digest:
            raise PushFailed(f"{cid.stem()} was re-published since the COMMIT", abandoned=True)
        return store, raw

    def _check_still_published(self, rec: Replication, store: Any) -> None:
        """Between chunks: the trainers discard a save that failed on any rank; its push stops
        there instead of delivering a replica of an iteration that is not complete."""
        session, it, owner = rec.key
        if rec.cancelled:
            raise PushFailed("cancelled (dropped or superseded)", abandoned=True)
        if not store.header_path(CheckpointId(it, owner, session)).exists():
            raise PushFailed(
                f"{CheckpointId(it, owner, session).stem()} was removed from this node's store while "
                "it was being replicated (its save failed on the trainers, or it was dropped)",
                abandoned=True,
            )

    def _transfer(self, rec: Replication) -> int:
        """One attempt: BEGIN, the chunks as credit allows, END. Returns the bytes sent (0 if
        the receiver already held it)."""
        session, it, owner = rec.key
        store, raw = self._published(rec)
        rpc = self._connect(session)
        plan = PushPlan.for_peer(rec.total_bytes, rpc.peer_hello, self.ctx.config)
        a = _Attempt(
            rpc,
            session,
            secrets.randbits(64),
            CreditWindow(plan.window_bytes, peer=self.label),
            self.ctx.config.peer_timeout_s,
        )
        try:
            mapping = ReadOnlyMap(store.data_path(CheckpointId(it, owner, session)), plan.total)
        except FileNotFoundError:  # removed between the header check and here
            self._check_still_published(rec, store)
            raise
        try:
            self._out(
                a,
                MessageType.REPLICATE_BEGIN,
                {
                    "iteration": it,
                    "owner_rank": owner,
                    "world_size": rec.world_size,
                    "total_bytes": plan.total,
                    "chunk_bytes": plan.chunk,
                    "num_chunks": plan.num_chunks,
                    "header_digest": rec.digest,
                },
                (raw,),
            )
            sent = self._send_chunks(rec, a, plan, mapping, store)
            if a.already:
                return 0
            self._check_still_published(rec, store)
            self._out(
                a,
                MessageType.REPLICATE_END,
                {
                    "iteration": it,
                    "owner_rank": owner,
                    "num_chunks": plan.num_chunks,
                    "total_bytes": plan.total,
                    "header_checksum": xxhash.xxh3_64_intdigest(raw),
                },
                (raw,),
            )
            self._pump(a, need=None, deadline=time.monotonic() + a.timeout)
            return 0 if a.already else sent
        finally:
            mapping.close()

    def _send_chunks(
        self, rec: Replication, a: _Attempt, plan: PushPlan, mapping: ReadOnlyMap, store: Any
    ) -> int:
        """Every chunk, each once its bytes of credit are free; stops early if the receiver
        turns out to hold the checkpoint already, or once the checkpoint is no longer published
        (abandoned). Returns the bytes sent."""
        hold = self.ctx.config.faults.get("hold_outbound_after_chunks")
        sent = 0
        for i in range(plan.num_chunks):
            self._check_still_published(rec, store)
            if hold is not None and i >= hold:
                self._hold_until_cancelled(rec)
            off, size = plan.span(i)
            self._pump(a, need=size, deadline=time.monotonic() + a.timeout)
            if a.already:
                return sent
            a.window.acquire(size, timeout_s=0)
            view = mapping.view[off : off + size]
            self._out(
                a,
                MessageType.REPLICATE_CHUNK,
                {
                    "iteration": rec.key[1],
                    "owner_rank": rec.key[2],
                    "index": i,
                    "offset": off,
                    "checksum": chunk_checksum(view),
                },
                (view,),
            )
            sent += size
        return sent

    def _hold_until_cancelled(self, rec: Replication) -> None:
        """Fault point: a sender stuck mid-transfer."""
        while not (rec.cancelled or self._stopping()):
            time.sleep(0.05)
        raise PushFailed("stopped while held by a fault point", retryable=False)

    def _out(self, a: _Attempt, mtype: MessageType, body: Dict[str, Any], frames: Sequence[Any] = ()) -> None:
        try:
            a.rpc.send(
                a.rpc.message(mtype, a.session, body, req_id=a.req_id, frames=frames), timeout_s=a.timeout
            )
        except PeerTimeout as e:
            raise PushFailed(
                f"node {self.node} did not take {mtype.name} within {a.timeout:g} s "
                "(connection down or peer not reading)"
            ) from e

    def _pump(self, a: _Attempt, *, need: Optional[int], deadline: float) -> None:
        """Read answers until ``need`` bytes of credit are available (or, with need=None, until
        the END is answered); raises PushFailed on ERROR, lost connection or deadline."""
        sock = a.rpc.socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while not (a.already or (need is None and a.stored)):
            self._check_link()
            waiting = need is None or a.window.available < need
            if not waiting and not sock.poll(0, zmq.POLLIN):
                return  # enough credit; an early answer (ERROR) would be read here, none is queued
            remaining = deadline - time.monotonic()
            if waiting and remaining <= 0:
                what = (
                    f"no credit for {need} bytes ({a.window.in_flight} bytes unacknowledged)"
                    if need is not None
                    else "no answer to REPLICATE_END"
                )
                raise PushFailed(
                    f"node {self.node}: {what} within {self.ctx.config.peer_timeout_s:g} s: the peer "
                    "stopped reading or is overloaded"
                )
            events = dict(poller.poll(min(250, max(1, int(remaining * 1000))) if waiting else 0))
            if sock in events:
                msg = self._recv(a.rpc)
                if msg is not None and msg.req_id == a.req_id:
                    self._take_answer(a, msg)

    def _check_link(self) -> None:
        if self._drain_monitor():
            raise PushFailed(
                f"connection to node {self.node} lost mid-transfer (its daemon died or the network dropped)"
            )
        if self._stopping():
            raise PushFailed("this daemon is stopping", retryable=False)

    def _take_answer(self, a: _Attempt, msg: Message) -> None:
        """CREDIT frees window; ERROR ends the attempt; OK to BEGIN (already held) or to END."""
        if msg.type is MessageType.CREDIT:
            a.window.release(msg.body["bytes"])
        elif msg.type is MessageType.ERROR:
            code = ErrorCode.of(msg.body.get("code", ""))
            raise PushFailed(
                f"node {self.node} refused: {code.value}: {msg.body.get('message', '')}",
                retryable=code not in _FINAL_CODES,
                code=code,
            )
        elif msg.type is MessageType.OK:
            op = msg.body.get("op")
            result = msg.body.get("result") or {}
            if op == MessageType.REPLICATE_BEGIN and result.get("already"):
                a.already = True
            elif op == MessageType.REPLICATE_END:
                a.stored = True

    def _recv(self, rpc: Rpc) -> Optional[Message]:
        ctx = self.ctx
        try:
            return recv(
                rpc.socket,
                ctx.auth,
                timeout_ms=100,
                expected_session=None,
                replay_guard=ctx.peer_guard,
                limits=ctx.limits,
                counters=ctx.rejects,
            )
        except PeerTimeout:
            return None
        except ProtocolError as e:
            ctx.log_reject(e, self.label)
            return None
