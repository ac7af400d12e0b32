"""FETCH in both directions, and what this daemon asks its peers:

* :class:`FetchStreams` serves FETCH streams to peers (router thread): REPLICATE_BEGIN with
  the store header, then chunks as the puller grants credit, then END; never blocking on a
  slow puller (a full queue is retried on the next loop turn);
* :class:`Puller` brings checkpoints from peers into this store: FETCH ``pull`` requests (in
  the worker pool, answered through the router thread) and the start-up recovery;
* :func:`gather_peers` lists what every peer holds (LIST), over channels a thread may keep.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Tuple

import xxhash
import zmq

from ...errors import CheckpointingException, StoreFullError
from ...memory.layout import CheckpointHeader, CheckpointId
from ..client import Holding, Rpc, error_from_reply, header_digest
from ..wire import (
    CreditWindow,
    ErrorCode,
    Message,
    MessageType,
    ProtocolError,
    chunk_checksum,
    encode,
    error_body,
)
from .config import logger
from .context import Connections, DaemonContext, Key, Replier
from .inbound import Inbound, TransferError
from .stores import ReadOnlyMap

# --------------------------------------------------------------------------- asking peers


def peer_rpc(
    ctx: DaemonContext, node: int, endpoint: str, rpcs: Optional[Dict[int, Rpc]]
) -> Tuple[Rpc, bool]:
    """An RPC channel to a peer: from ``rpcs`` (kept by the calling thread) or a fresh one
    (second value True: the caller closes it)."""
    if rpcs is not None:
        rpc = rpcs.get(node)
        if rpc is not None and rpc.endpoint == endpoint:
            return rpc, False
        if rpc is not None:
            rpc.close()
    rpc = ctx.rpc(endpoint)
    if rpcs is not None:
        rpcs[node] = rpc
        return rpc, False
    return rpc, True


def gather_peers(
    ctx: DaemonContext,
    session: str,
    *,
    iteration: Optional[int] = None,
    owner: Optional[int] = None,
    rpcs: Optional[Dict[int, Rpc]] = None,
) -> Tuple[List[Holding], List[int]]:
    """Holdings of every peer daemon (each tagged with its node) and the unreachable ones."""
    body: Dict[str, Any] = {}
    if iteration is not None:
        body["iteration"] = iteration
    if owner is not None:
        body["owner_rank"] = owner
    out: List[Holding] = []
    unreachable: List[int] = []
    for node in ctx.peers.nodes():
        endpoint = ctx.peers.endpoint(node)
        if endpoint is None:
            unreachable.append(node)
            continue
        rpc, own = peer_rpc(ctx, node, endpoint, rpcs)
        try:
            reply = rpc.request(
                MessageType.LIST, session, body, timeout_s=min(ctx.config.peer_timeout_s, 5.0)
            )
            for h in reply.body.get("result", {}).get("holdings", ()):
                out.append(dataclasses.replace(Holding.from_wire(h), node=node))
        except (ProtocolError, CheckpointingException) as e:
            unreachable.append(node)
            rpc.reset()
            logger.debug("LIST on node %d failed: %s", node, e)
        finally:
            if own:
                rpc.close()
    return out, unreachable


# --------------------------------------------------------------------------- serving FETCH


@dataclass
class OutStream:
    """A FETCH being served: chunks go out as the puller grants credit (router thread only)."""

    rid: bytes
    req_id: int
    session: str
    key: Key
    peer: str
    mapping: ReadOnlyMap
    raw_header: bytes
    chunk: int
    window: CreditWindow
    version: int
    next_index: int = 0
    end_sent: bool = False
    pending: Optional[list] = None
    pending_is_end: bool = False
    last_progress: float = field(default_factory=time.monotonic)

    @property
    def num_chunks(self) -> int:
        return -(-self.mapping.nbytes // self.chunk) if self.mapping.nbytes else 0


class FetchStreams:
    """The FETCH streams this daemon serves, by (routing id, req_id); router thread only."""

    def __init__(self, ctx: DaemonContext, replies: Replier, conns: Connections):
        self.ctx, self.replies, self.conns = ctx, replies, conns
        self.streams: Dict[Tuple[bytes, int], OutStream] = {}

    def _window_and_chunk(self, rid: bytes, msg: Message) -> Tuple[int, int]:
        """Credit window and chunk size: the smallest of what both sides said they take."""
        cfg, limits = self.ctx.config, self.ctx.limits
        conn = self.conns.get(rid)
        window = (conn.credit_bytes if conn and conn.credit_bytes else None) or cfg.credit_bytes
        peer_frame = (
            conn.max_frame_bytes if conn and conn.max_frame_bytes else None
        ) or limits.max_frame_bytes
        chunk = min(
            msg.body.get("max_chunk_bytes") or cfg.chunk_bytes,
            cfg.chunk_bytes,
            window,
            peer_frame,
            limits.max_frame_bytes,
        )
        return window, chunk

    def serve(self, rid: bytes, label: str, msg: Message) -> None:
        ctx, b = self.ctx, msg.body
        key = (msg.session, b["iteration"], b["owner_rank"])
        cid = CheckpointId(key[1], key[2], key[0])
        store = ctx.stores.get(msg.session)
        raw = ctx.stores.raw_header(store, cid) if store is not None else None
        if raw is None:
            raise TransferError(
                ErrorCode.NOT_FOUND,
                f"this node does not hold {cid.stem()} of session {msg.session!r}; ask another holder (LIST)",
            )
        header = CheckpointHeader.unpack(raw, source=str(store.header_path(cid)))
        window, chunk = self._window_and_chunk(rid, msg)
        old = self.streams.get((rid, msg.req_id))
        if old is not None:
            self.end(old, "restarted by a repeated FETCH")
        mapping = ReadOnlyMap(store.data_path(cid), header.data_nbytes)
        s = OutStream(
            rid,
            msg.req_id,
            msg.session,
            key,
            msg.sender,
            mapping,
            raw,
            chunk,
            CreditWindow(window, peer=msg.sender),
            msg.version,
        )
        begin = msg.reply(
            MessageType.REPLICATE_BEGIN,
            sender=ctx.name,
            body={
                "iteration": key[1],
                "owner_rank": key[2],
                "world_size": header.world_size,
                "total_bytes": header.data_nbytes,
                "chunk_bytes": chunk,
                "num_chunks": s.num_chunks,
                "header_digest": header_digest(raw),
            },
            frames=(raw,),
        )
        if not self.replies.send(rid, begin):
            mapping.close()
            return
        self.streams[(rid, msg.req_id)] = s
        ctx.ledger.hold(key)
        self._pump(s)

    def pump_all(self) -> None:
        for s in list(self.streams.values()):
            self._pump(s)

    def _pump(self, s: OutStream) -> None:
        while self._prepare(s) and self._send_pending(s):
            pass

    def _prepare(self, s: OutStream) -> bool:
        """Have ``s.pending`` hold the next message; False if none is to be sent now (no credit
        for the next chunk, or the stream is complete and was ended)."""
        if s.pending is not None:
            return True
        if s.next_index < s.num_chunks:
            off = s.next_index * s.chunk
            size = min(s.chunk, s.mapping.nbytes - off)
            if s.window.available < size:
                return False
            s.window.acquire(size, timeout_s=0)
            view = s.mapping.view[off : off + size]
            m = Message(
                type=MessageType.REPLICATE_CHUNK,
                session=s.session,
                sender=self.ctx.name,
                req_id=s.req_id,
                version=s.version,
                frames=(view,),
                body={
                    "iteration": s.key[1],
                    "owner_rank": s.key[2],
                    "index": s.next_index,
                    "offset": off,
                    "checksum": chunk_checksum(view),
                },
            )
            s.pending, s.pending_is_end = encode(m, self.ctx.auth, limits=self.ctx.limits), False
            return True
        if not s.end_sent:
            m = Message(
                type=MessageType.REPLICATE_END,
                session=s.session,
                sender=self.ctx.name,
                req_id=s.req_id,
                version=s.version,
                frames=(s.raw_header,),
                body={
                    "iteration": s.key[1],
                    "owner_rank": s.key[2],
                    "num_chunks": s.num_chunks,
                    "total_bytes": s.mapping.nbytes,
                    "header_checksum": xxhash.xxh3_64_intdigest(s.raw_header),
                },
            )
            s.pending, s.pending_is_end = encode(m, self.ctx.auth, limits=self.ctx.limits), True
            return True
        self.end(s, None)
        return False

    def _send_pending(self, s: OutStream) -> bool:
        """Send ``s.pending`` without blocking; False if it could not go (yet, or ever)."""
        try:
            self.replies.socket.send_multipart([s.rid, *s.pending], flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False  # the peer's queue is full: try again on the next loop turn
        except zmq.ZMQError as e:
            self.end(s, f"peer disconnected ({e.strerror})")
            return False
        s.pending = None
        s.last_progress = time.monotonic()
        if s.pending_is_end:
            s.end_sent = True
        else:
            s.next_index += 1
        return True

    def end(self, s: OutStream, error: Optional[str]) -> None:
        ctx = self.ctx
        if self.streams.get((s.rid, s.req_id)) is s:
            del self.streams[(s.rid, s.req_id)]
            ctx.ledger.release(s.key)
        s.pending = None
        s.mapping.close()
        if error is None:
            ctx.ledger.count(fetches_served=1, bytes_served=s.mapping.nbytes)
            ctx.metrics.fetches.inc()
            ctx.event(
                logging.INFO,
                "fetch_served",
                peer=s.peer,
                session=s.key[0],
                iteration=s.key[1],
                owner=s.key[2],
                bytes=s.mapping.nbytes,
            )
        else:
            ctx.event(
                logging.WARNING,
                "fetch_aborted",
                peer=s.peer,
                session=s.key[0],
                iteration=s.key[1],
                owner=s.key[2],
                sent_chunks=s.next_index,
                reason=error,
            )

    def on_credit(self, rid: bytes, label: str, msg: Message) -> None:
        s = self.streams.get((rid, msg.req_id))
        if s is not None:
            s.window.release(msg.body["bytes"])
            s.last_progress = time.monotonic()
            self._pump(s)

    def on_peer_error(self, rid: bytes, label: str, msg: Message) -> None:
        s = self.streams.get((rid, msg.req_id))
        if s is not None:  # the puller gives up (e.g. its store is full): stop streaming
            self.end(s, f"the puller answered {msg.body.get('code')}: {msg.body.get('message', '')[:300]}")

    def expire(self, now: float) -> None:
        """Streams whose puller granted no credit for ``--peer-timeout`` are ended."""
        limit = self.ctx.config.peer_timeout_s
        for s in list(self.streams.values()):
            if now - s.last_progress > limit:
                self.end(s, f"no credit for {limit:g} s: the puller stopped reading")

    def blocked(self) -> bool:
        """Some stream hit its peer's queue limit (the router retries soon)."""
        return any(s.pending is not None for s in self.streams.values())

    def describe(self) -> List[Dict[str, Any]]:
        return [
            {
                "session": s.key[0],
                "iteration": s.key[1],
                "owner": s.key[2],
                "peer": s.peer,
                "sent_chunks": s.next_index,
                "num_chunks": s.num_chunks,
            }
            for s in self.streams.values()
        ]

    def close(self) -> None:
        for s in list(self.streams.values()):
            s.mapping.close()
        self.streams.clear()


# --------------------------------------------------------------------------- pulling


@dataclass
class PullTask:
    key: Key
    from_node: Optional[int]
    waiters: List[Tuple[bytes, Message]]


class _PullStream:
    """The receiving end of one FETCH stream from a peer (one pull attempt)."""

    def __init__(self, ctx: DaemonContext, rpc: Rpc, key: Key, node: int, timeout: float):
        self.ctx, self.rpc, self.key, self.node, self.timeout = ctx, rpc, key, node, timeout
        self.req_id = secrets.randbits(64)
        self.inbound: Optional[Inbound] = None
        self.header: Optional[CheckpointHeader] = None
        self.already = False
        self.nbytes = 0

    def take(self, msg: Message) -> bool:
        """Handle one message of the stream; True once END stored it."""
        if msg.type is MessageType.ERROR:
            raise error_from_reply(msg, f"node-{self.node}")
        if msg.type is MessageType.REPLICATE_BEGIN:
            self._begin(msg)
        elif msg.type is MessageType.REPLICATE_CHUNK and self.inbound is not None:
            self._chunk(msg)
        elif msg.type is MessageType.REPLICATE_END and self.inbound is not None:
            self.header, self.already = self.inbound.finish(msg.body, msg.frames[0])
            self.nbytes = self.inbound.received
            self.inbound = None
            return True
        else:
            raise TransferError(
                ErrorCode.MALFORMED, f"node {self.node} answered FETCH with {msg.type.name} out of sequence"
            )
        return False

    def _begin(self, msg: Message) -> None:
        ctx, session = self.ctx, self.key[0]
        if self.inbound is not None:
            self.inbound.abort()
            self.inbound = None
        store = ctx.stores.get(session, create=True)
        try:
            self.inbound = Inbound(
                ctx.stores,
                store,
                self.key,
                msg.body,
                peer=f"node-{self.node}",
                window=ctx.config.credit_bytes,
                budget=ctx.config.memory_budget,
                header_frame=msg.frames[0] if msg.frames else None,
            )
        except StoreFullError as e:
            self._refuse(e)
            raise
        ctx.ledger.pull_started(self.key, self.inbound)

    def _chunk(self, msg: Message) -> None:
        try:
            grant = self.inbound.consumed(self.inbound.write(msg.body, msg.frames[0]))
        except StoreFullError as e:  # the reservation could not grow
            self._refuse(e)
            raise
        if grant:
            self.rpc.send(
                self.rpc.message(MessageType.CREDIT, self.key[0], {"bytes": grant}, req_id=self.req_id),
                timeout_s=self.timeout,
            )

    def _refuse(self, e: StoreFullError) -> None:
        """Tell the stream's server to stop: this store has no room for it."""
        rpc = self.rpc
        with contextlib.suppress(ProtocolError):
            rpc.send(
                rpc.message(
                    MessageType.ERROR,
                    self.key[0],
                    error_body(ErrorCode.STORE_FULL, str(e), op=int(MessageType.FETCH)),
                    req_id=self.req_id,
                ),
                timeout_s=1.0,
            )

    def abort(self) -> None:
        if self.inbound is not None:
            self.inbound.abort()


class Puller:
    """Pulls checkpoints from peers into this store. FETCH ``pull`` requests run in the worker
    pool (a retried request joins the pull in progress) and are answered from the router
    thread; :meth:`pull` itself runs in any thread but the router."""

    def __init__(self, ctx: DaemonContext, replies: Replier):
        self.ctx, self.replies = ctx, replies
        self.tasks: Dict[Key, PullTask] = {}  # router thread only

    def on_pull(self, rid: bytes, msg: Message) -> None:
        ctx, b = self.ctx, msg.body
        key = (msg.session, b["iteration"], b["owner_rank"])
        cid = CheckpointId(key[1], key[2], key[0])
        store = ctx.stores.get(msg.session)
        raw = ctx.stores.raw_header(store, cid) if store is not None else None
        if raw is not None:
            total = CheckpointHeader.unpack(raw, source=str(store.header_path(cid))).data_nbytes
            self.replies.ok(
                rid, msg, {"stored": True, "already": True, "source_node": ctx.node_id, "total_bytes": total}
            )
            return
        task = self.tasks.get(key)
        if task is not None:
            task.waiters.append((rid, msg))  # a retried request joins the pull in progress
            return
        task = self.tasks[key] = PullTask(key, b.get("from_node"), [(rid, msg)])
        ctx.workers.submit(self._run, task)

    def _run(self, task: PullTask) -> None:
        try:
            result = self._pull_from_any(task)
        except TransferError as e:
            self.ctx.post(functools.partial(self._finish, task, None, e))
            return
        except Exception as e:
            logger.exception("pull of %s failed", task.key)
            self.ctx.post(
                functools.partial(
                    self._finish, task, None, TransferError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
                )
            )
            return
        self.ctx.post(functools.partial(self._finish, task, result, None))

    def _pull_from_any(self, task: PullTask) -> Dict[str, Any]:
        """The task's id from its ``from_node``, else from the first holder that has it."""
        session, it, owner = task.key
        if task.from_node is not None:
            candidates = [task.from_node]
        else:
            everywhere, _ = gather_peers(self.ctx, session, iteration=it, owner=owner)
            candidates = sorted({h.node for h in everywhere if h.node is not None})
        if not candidates:
            raise TransferError(
                ErrorCode.NOT_FOUND,
                f"no reachable peer holds iteration {it} of rank {owner} "
                f"(session {session!r}); peers: {self.ctx.peers.nodes()}",
            )
        errors = []
        for node in candidates:
            try:
                return self.pull(session, it, owner, node)
            except StoreFullError as e:  # this node's store: another holder would not help
                raise TransferError(ErrorCode.STORE_FULL, str(e)) from None
            except (TransferError, ProtocolError, CheckpointingException, OSError) as e:
                errors.append(f"node {node}: {getattr(e, 'text', None) or e}")
        raise TransferError(
            ErrorCode.NOT_FOUND,
            "could not pull it from any holder: " + "; ".join(errors)[:7000],
            retryable=True,
        )

    def _finish(
        self, task: PullTask, result: Optional[Dict[str, Any]], error: Optional[TransferError]
    ) -> None:
        self.tasks.pop(task.key, None)
        for rid, msg in task.waiters:
            if error is None:
                self.replies.ok(rid, msg, result)
            else:
                self.replies.error(rid, msg, error.code, error.text, retryable=error.retryable)

    def pull(self, session: str, it: int, owner: int, node: int) -> Dict[str, Any]:
        """Bring ``(session, it, owner)`` from ``node``'s daemon into this store (any thread but
        the router). Returns the FETCH-pull result."""
        ctx = self.ctx
        endpoint = ctx.peers.endpoint(node)
        if endpoint is None:
            raise TransferError(
                ErrorCode.UNREACHABLE, f"node {node} has no known endpoint (add it to --peers)"
            )
        rpc = ctx.rpc(endpoint, data=True)
        key = (session, it, owner)
        t0 = time.monotonic()
        try:
            stream = self._receive(rpc, key, node)
        except BaseException:
            ctx.ledger.count(pulls_failed=1)
            ctx.metrics.pulls.labels("failed").inc()
            raise
        finally:
            ctx.ledger.pull_ended(key)
            rpc.close()
        seconds = time.monotonic() - t0
        ctx.ledger.count(pulls_ok=1, bytes_in=stream.nbytes)
        ctx.metrics.pulls.labels("ok").inc()
        ctx.metrics.bytes.labels("in").inc(stream.nbytes)
        ctx.event(
            logging.INFO,
            "pulled",
            peer=f"node-{node}",
            session=session,
            iteration=it,
            owner=owner,
            bytes=stream.nbytes,
            seconds=round(seconds, 4),
            already=stream.already or None,
        )
        ctx.retention_due.set()
        return {
            "stored": True,
            "already": stream.already,
            "source_node": node,
            "total_bytes": stream.header.data_nbytes,
        }

    def _receive(self, rpc: Rpc, key: Key, node: int) -> _PullStream:
        """HELLO, FETCH, then the stream until its END was stored (or an error)."""
        cfg = self.ctx.config
        timeout = cfg.peer_timeout_s
        rpc.hello(key[0], timeout_s=timeout, credit_bytes=cfg.credit_bytes)
        with rpc.lock:
            stream = _PullStream(self.ctx, rpc, key, node, timeout)
            try:
                rpc.send(
                    rpc.message(
                        MessageType.FETCH,
                        key[0],
                        {"iteration": key[1], "owner_rank": key[2], "max_chunk_bytes": cfg.chunk_bytes},
                        req_id=stream.req_id,
                    ),
                    timeout_s=timeout,
                )
                while not stream.take(rpc.await_reply(stream.req_id, time.monotonic() + timeout)):
                    pass
            except BaseException:
                stream.abort()
                raise
        return stream
