"""The :class:`Daemon`: its parts wired together, its threads, and the router thread's loop.

Threads, each with a name and one owner of its sockets (ZeroMQ sockets are not thread-safe):

* ``rc-daemon-router``: the bound ROUTER. Every inbound message is decoded and handled here,
  including the receive side of replication (bytes are copied into the reserved segment here)
  and the send side of FETCH streams (credit-driven, never blocking). Other threads hand it
  work through ``DaemonContext.post`` (a queue plus a wake-up pipe in its poll set).
* ``rc-daemon-push-<node>``: one per holder node, owns a DEALER to that node's daemon and
  pushes queued replications one after another (credit window = bounded bytes in flight).
* ``rc-daemon-work-<i>``: a small pool for requests that wait on peers (FETCH pull, LIST
  peers); each task opens and closes its own channels to peers.
* ``rc-daemon-maint``: peer liveness pings, discovery refresh, retention.
* ``rc-daemon-recover``: the start-up recovery of ``--recover``.

Every thread closes the sockets it made before it ends; :meth:`Daemon.stop` terminates the
ZeroMQ context only once all of them have ended (``Context.destroy()`` would close sockets
from the stopping thread, under threads that may still use them: libzmq aborts).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import socket
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import zmq

from ...errors import CheckpointingException, StoreFullError
from ..wire import (
    Authenticator,
    ErrorCode,
    Message,
    MessageType,
    PeerTimeout,
    ProtocolConfigError,
    ProtocolError,
    RejectCounters,
    ReplayGuard,
    authenticated_request_info,
    configure_socket,
    decode,
    recv_raw_from,
)
from .config import DATA_SOCKOPTS, DaemonConfig, SessionFilter, logger
from .context import Connections, DaemonContext, Ledger, Replier, Workers, daemon_version
from .fetch import FetchStreams, Puller
from .handlers import Requests, rejection_body
from .inbound import Receiver, TransferError
from .maintenance import Maintenance, Recovery
from .metrics import Metrics
from .peers import PeerDirectory
from .stores import Stores

#: Messages read per loop turn before posted work and FETCH streams get their turn.
_RECEIVE_BATCH = 256
#: Types a refused message may have and still be answered: never answer an answer.
_ANSWERS = (MessageType.ERROR, MessageType.OK, MessageType.HELLO_OK, MessageType.CREDIT)


class _Mailbox:
    """Work other threads hand the router thread: a queue plus a wake-up pipe in its poll set."""

    def __init__(self) -> None:
        self._queue: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._r, self._w = os.pipe()
        os.set_blocking(self._w, False)
        os.set_blocking(self._r, False)
        self._lock = threading.Lock()  # no write to the pipe once close() closed it

    @property
    def fd(self) -> int:
        return self._r

    def post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the router thread (the only one that may touch the ROUTER)."""
        self._queue.put(fn)
        self.wake()

    def wake(self) -> None:
        with self._lock:
            if self._w >= 0:
                with contextlib.suppress(BlockingIOError, OSError):  # full pipe: already awake
                    os.write(self._w, b"\x01")

    def drain_pipe(self) -> None:
        with contextlib.suppress(BlockingIOError, OSError):
            os.read(self._r, 4096)

    def run_posted(self) -> None:
        while True:
            try:
                fn = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                logger.exception("posted task failed")

    def close(self) -> None:
        with self._lock:
            for fd in (self._r, self._w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._r = self._w = -1


def _join(threads: Sequence[threading.Thread], deadline: Optional[float]) -> None:
    """Join ``threads`` (not the calling one) until ``deadline`` (monotonic; None: no limit)."""
    me = threading.current_thread()
    for t in threads:
        if t is not me:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))


class Daemon:
    """One node's checkpoint daemon. ``start()`` binds and runs it in background threads;
    ``stop()`` ends it. Tests run it in-process; ``resilient-ckpt serve`` runs :func:`main`."""

    def __init__(self, config: DaemonConfig, authenticator: Authenticator):
        self.config = config
        self.auth = authenticator
        self.node_id = config.node_id
        self.name = f"node-{config.node_id}"
        self.limits = config.limits
        self.rejects = RejectCounters()
        # Replay protection that survives a restart without any I/O per message: nothing
        # timestamped before this start is accepted. Whatever an earlier incarnation accepted
        # (and whose nonces died with it) was sent before now; legitimate senders build a fresh
        # message per send, and clients re-send one the daemon refused as older than its start
        # once their clock passed it. (A persisted high-water mark would only add the messages
        # of a sender whose clock runs ahead, sent in the last moments before a crash, at the
        # cost of a write per accepted message or a window of loss; the ±window check assumes
        # synchronised clocks anyway.)
        self.started_ns = time.time_ns()
        self.guard = ReplayGuard(not_before_ns=self.started_ns)
        self.peer_guard = ReplayGuard()
        self.stores = Stores(config.store_root, config.node_id)
        self.peers = PeerDirectory(
            config.node_id, config.peers, config.discover, config.discover_master, config.peer_timeout_s
        )
        ledger = Ledger()
        self.metrics = Metrics(lambda: ledger.usage, ledger.peers_up, self.rejects)
        self.metrics_port: Optional[int] = None
        self.endpoint: Optional[str] = None
        self._mailbox = _Mailbox()
        self.ctx = DaemonContext(
            config=config,
            auth=authenticator,
            stores=self.stores,
            peers=self.peers,
            ledger=ledger,
            metrics=self.metrics,
            rejects=self.rejects,
            peer_guard=self.peer_guard,
            post=self._mailbox.post,
            workers=Workers(4),
            started_ns=self.started_ns,
        )
        self._retention_due = self.ctx.retention_due  # set it to run a retention pass soon
        self._sessions = SessionFilter(config.sessions)
        self._replies = Replier(self.ctx)
        self._conns = Connections()
        self._receiver = Receiver(self.ctx, self._replies)
        self._streams = FetchStreams(self.ctx, self._replies, self._conns)
        puller = Puller(self.ctx, self._replies)
        self._requests = Requests(self.ctx, self._replies, self._conns, self._receiver, self._streams, puller)
        self._maintenance = Maintenance(self.ctx, self._requests.table)
        self._recovery = Recovery(self.ctx, puller)
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._threads: List[threading.Thread] = []  # router first, then maint, recover
        self._term_lock = threading.Lock()

    def event(self, level: int, event: str, **fields: Any) -> None:
        self.ctx.event(level, event, **fields)

    def status(self) -> Dict[str, Any]:
        """The STATUS result (plain msgpack values)."""
        return self._requests.status()

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "Daemon":
        self._spawn(self._router_main, "rc-daemon-router")
        if not self._started.wait(timeout):
            raise ProtocolConfigError(f"the daemon did not start within {timeout:g} s", fix="see its log")
        if self._start_error is not None:
            self.stop(timeout)
            raise self._start_error
        self._spawn(self._maintenance.run, "rc-daemon-maint")
        if self.config.recover:
            self._spawn(self._recovery.run, "rc-daemon-recover", self.config.recover)
        return self

    def _spawn(self, target: Callable[..., None], name: str, *args: Any) -> None:
        t = threading.Thread(target=target, args=args, name=name, daemon=True)
        self._threads.append(t)
        t.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Stop serving and end every thread, within ``timeout`` seconds in all.

        Each thread closes the sockets it made as it ends, and the ZeroMQ context is terminated
        only once every thread that could own one has ended: a socket closed under the thread
        using it makes libzmq abort the process. A thread still running at the deadline is
        named in a ``stop_incomplete`` WARNING and the context is left to a background thread
        that terminates it once they have all ended."""
        ctx = self.ctx
        deadline = time.monotonic() + timeout
        ctx.stopping.set()  # every loop and every peer request checks it
        ctx.retention_due.set()  # wakes the maintenance thread
        self._mailbox.wake()
        # The router first: while it runs it may still start pushers and hand work to workers.
        _join(self._threads[:1], deadline)
        threads = self._threads + self._requests.table.stop() + ctx.workers.stop()
        _join(threads, deadline)
        self.metrics.close()
        self.peers.close()
        alive = [t for t in threads if t.is_alive()]
        if not alive:
            self._terminate(threads)
            return
        self.event(
            logging.WARNING,
            "stop_incomplete",
            threads=[t.name for t in alive],
            seconds=timeout,
            meaning="these threads may still use their ZeroMQ sockets: the daemon's context is "
            "terminated only once they end (closing sockets under them would abort the process)",
        )
        threading.Thread(target=self._terminate, args=(threads,), name="rc-daemon-term", daemon=True).start()

    def _terminate(self, threads: Sequence[threading.Thread]) -> None:
        """Once ``threads`` (all that may own a socket) have ended: close the mailbox and
        terminate the ZeroMQ context (every socket was closed by its own thread)."""
        _join(threads, None)
        with self._term_lock:
            self._mailbox.close()
            zctx = self.ctx.zmq_context
            if zctx is None or zctx.closed:
                return
            # A socket a thread left open: a bug (logged); its thread has ended, so closing it
            # here is safe, and term() would wait for it forever.
            left = [s for s in list(getattr(zctx, "_sockets", None) or ()) if not s.closed]
            for s in left:
                s.close(linger=0)
            if left:
                self.event(logging.WARNING, "stop_socket_left_open", sockets=len(left))
            zctx.term()

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def context(self) -> zmq.Context:
        assert self.ctx.zmq_context is not None
        return self.ctx.zmq_context

    @property
    def alive(self) -> bool:
        """True while the router thread serves (False after stop() or a crash)."""
        return bool(self._threads) and self._threads[0].is_alive()

    # ---- router thread ------------------------------------------------------------------------

    def _router_main(self) -> None:
        router = self._bind()
        if router is None:
            return
        cfg = self.config
        self.event(
            logging.INFO,
            "serving",
            endpoint=self.endpoint,
            store_root=str(self.stores.root),
            peers=dict(cfg.peers) or None,
            discover=cfg.discover,
            metrics_port=self.metrics_port,
            pid=os.getpid(),
            version=daemon_version(),
        )
        self._started.set()
        try:
            self._serve(router)
        except BaseException:  # a bug: log it loudly, never die silently
            logger.exception("router thread crashed")
            raise
        finally:
            self._receiver.close()
            self._streams.close()
            router.close(linger=0)

    def _bind(self) -> Optional[zmq.Socket]:
        """Bind the ROUTER and get ready to serve; None (start error recorded) if that fails."""
        cfg, ctx = self.config, self.ctx
        router = None
        try:
            ctx.zmq_context = zmq.Context(io_threads=max(1, cfg.io_threads))
            ctx.zmq_context.set(zmq.BLOCKY, 0)  # term() never waits on a socket's linger
            router = ctx.zmq_context.socket(zmq.ROUTER)
            configure_socket(router, limits=self.limits)
            for opt, value in DATA_SOCKOPTS.items():
                router.setsockopt(opt, value)
            router.bind(cfg.bind)
            self._replies.socket = router
            self.endpoint = ctx.endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            advertise = cfg.advertise or self.endpoint.replace("0.0.0.0", socket.gethostname())
            self.peers.start(advertise)
            self.stores.sweep(cfg.orphan_grace_s)
            ctx.refresh_usage()
            if cfg.metrics_port is not None:
                self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
            return router
        except BaseException as e:
            self._start_error = (
                e
                if isinstance(e, CheckpointingException)
                else ProtocolConfigError(
                    f"cannot start the daemon on {cfg.bind}: {type(e).__name__}: {e}",
                    fix="check --bind (address in use? interface exists?) and --store-root",
                )
            )
            if router is not None:
                router.close(linger=0)
            self._replies.socket = None
            if ctx.zmq_context is not None:  # its only socket (the router) is closed
                ctx.zmq_context.term()
                ctx.zmq_context = None
            self.metrics.close()
            self._started.set()
            return None

    def _serve(self, router: zmq.Socket) -> None:
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._mailbox.fd, zmq.POLLIN)
        next_timer = 0.0
        while not self.ctx.stopping.is_set():
            events = dict(poller.poll(self._poll_timeout_ms()))
            if self._mailbox.fd in events:
                self._mailbox.drain_pipe()
            self._mailbox.run_posted()
            if router in events:
                self._receive_batch(router)
            self._streams.pump_all()
            now = time.monotonic()
            self._requests.waiters.expire(now)  # every turn: the poll timeout is computed from them
            if now >= next_timer:
                self._receiver.expire(now)
                self._streams.expire(now)
                next_timer = now + 0.25

    def _receive_batch(self, router: zmq.Socket) -> None:
        for _ in range(_RECEIVE_BATCH):
            if self.ctx.stopping.is_set() or not router.poll(0, zmq.POLLIN):
                break
            self._receive_one()
            if self._streams.streams:
                self._streams.pump_all()

    def _poll_timeout_ms(self) -> int:
        if self._streams.blocked():
            return 2  # a stream hit the peer's queue limit: retry soon
        timeout = 250.0
        deadline = self._requests.waiters.next_deadline()
        if deadline is not None:
            timeout = min(timeout, max(0.0, (deadline - time.monotonic()) * 1000))
        return max(1, int(timeout))

    def _receive_one(self) -> None:
        try:
            rid, label, frames = recv_raw_from(
                self._replies.socket, timeout_ms=100, limits=self.limits, counters=self.rejects
            )
        except PeerTimeout:
            return
        except ProtocolError as exc:  # over the limits: counted, dropped
            self.ctx.log_reject(exc, None)
            return
        try:
            msg = decode(
                frames,
                self.auth,
                expected_session=self._sessions,
                replay_guard=self.guard,
                limits=self.limits,
                counters=self.rejects,
                peer=label,
            )
        except ProtocolError as exc:
            self.ctx.log_reject(exc, label)
            self._answer_refused(rid, frames, exc)
            return
        self._conns.touch(rid)
        self._handle(rid, label, msg)

    def _answer_refused(self, rid: bytes, frames: list, exc: ProtocolError) -> None:
        """Answer authenticated senders (never an unauthenticated one, never a duplicate
        nonce: the original was answered). Out of the window or older than this start:
        answered, never executed; the answer says what this daemon's clock reads, which a
        replayer learns nothing from and a skewed or restarted-upon client needs."""
        body = rejection_body(
            exc, node_id=self.node_id, window_ns=self.guard.window_ns, started_ns=self.started_ns
        )
        if body is None:
            return
        info = authenticated_request_info(frames, self.auth, limits=self.limits)
        if info is None or info.type_code in _ANSWERS:
            return
        if info.type_code is not None:
            body["op"] = info.type_code
        reply = Message(
            type=MessageType.ERROR,
            session=info.session,
            sender=self.name,
            req_id=info.req_id,
            body=body,
            version=info.version,
        )
        self._replies.send(rid, reply)

    def _handle(self, rid: bytes, label: str, msg: Message) -> None:
        """Run the request's handler; whatever it raises becomes the ERROR answer."""
        handler = self._requests.handler(msg.type)
        if handler is None:  # OK / HELLO_OK are answers, not requests: never answer an answer
            self.rejects.record("unexpected")
            return
        replies = self._replies
        try:
            handler(rid, label, msg)
        except TransferError as e:
            replies.error(rid, msg, e.code, e.text, retryable=e.retryable)
        except StoreFullError as e:
            replies.error(rid, msg, ErrorCode.STORE_FULL, str(e))
        except ProtocolError as e:
            replies.error(rid, msg, e.code, str(e))
        except CheckpointingException as e:
            replies.error(rid, msg, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        except Exception as e:  # never let one request take the daemon down
            logger.exception("handling %s from %s failed", msg.type.name, label)
            replies.error(rid, msg, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
