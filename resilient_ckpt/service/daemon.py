"""The per-node checkpoint daemon: ``resilient-ckpt serve`` (docs/protocol.md, "Daemon behaviour").

One daemon per node owns the node's store root (one :class:`CheckpointStore` per session) and:

* replicates what local trainers COMMIT to the placement's holder nodes' daemons, in the
  background, so a replica lands even if the trainer dies right after COMMIT;
* receives replicas from peers into reserved segments and publishes a header only after the
  last byte was verified (a cut transfer leaves nothing visible);
* serves FETCH streams to peers and pulls checkpoints for local clients (FETCH ``pull``);
* answers LIST / DROP / STATUS; retires old iterations (``--keep-last``) and refuses replicas
  beyond ``--memory-budget``; restores a replacement node's ranks from its peers (``--recover``).

Threads, each with a name and one owner of its sockets (ZeroMQ sockets are not thread-safe):

* ``rc-daemon-router``: the bound ROUTER. Every inbound message is decoded and handled here,
  including the receive side of replication (bytes are copied into the reserved segment here)
  and the send side of FETCH streams (credit-driven, never blocking). Other threads hand it
  work through :meth:`Daemon._post` (a queue plus a wake-up pipe in its poll set).
* ``rc-daemon-push-<node>``: one per holder node, owns a DEALER to that node's daemon and
  pushes queued replications one after another (credit window = bounded bytes in flight).
* ``rc-daemon-work_*``: a small pool for requests that wait on peers (FETCH pull, LIST peers).
* ``rc-daemon-maint``: peer liveness pings, discovery refresh, retention.
* ``rc-daemon-recover``: the start-up recovery of ``--recover``.
"""

from __future__ import annotations

import argparse
import collections.abc
import contextlib
import dataclasses
import errno
import functools
import gc
import heapq
import itertools
import json
import logging
import mmap
import os
import queue
import re
import secrets
import signal
import socket
import sys
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, FrozenSet, Iterable, List, Mapping, Optional, Sequence, Tuple

import numpy as np
import xxhash
import zmq
import zmq.utils.monitor

from ..memory import checksum
from ..errors import (
    CheckpointingException,
    CorruptCheckpointError,
    ReplicationError,
    StoreError,
    StoreFullError,
)
from ..replication.placement import Placement
from ..memory.store import DEFAULT_ROOT, CheckpointHeader, CheckpointId, CheckpointStore
from .wire.auth import (
    Authenticator,
    RejectCounters,
    ReplayGuard,
    authenticator_from_env,
    format_time_ns,
)
from .client import (
    ClockSkewError,
    DaemonError,
    Holding,
    Rpc,
    complete_iterations,
    error_from_reply,
    header_digest,
    plan_recovery,
)
from .wire.protocol import (
    DEFAULT_LIMITS,
    PROTOCOL_VERSION,
    CreditGranter,
    CreditWindow,
    ErrorCode,
    LimitExceeded,
    Limits,
    Message,
    MessageType,
    PeerTimeout,
    PeerUnreachable,
    PredatesStart,
    ProtocolConfigError,
    ProtocolError,
    StaleMessage,
    authenticated_request_info,
    chunk_checksum,
    configure_socket,
    decode,
    encode,
    error_body,
    negotiate_version,
    recv_raw_from,
    send,
)

logger = logging.getLogger("resilient_ckpt.daemon")

Key = Tuple[str, int, int]  # (session, iteration, owner)

DEFAULT_BIND = "tcp://127.0.0.1:7465"
#: 4 MiB: glibc reuses message buffers of this size (64 MiB ones are fresh mappings faulted in
#: per message: ~0.6 GB/s on loopback against ~2 GB/s), and each chunk is hashed, copied and
#: verified while it is still in L3 (benchmarks/service_figures.py, docs/protocol.md 12.10).
DEFAULT_CHUNK_BYTES = 4 << 20
DEFAULT_CREDIT_BYTES = 64 << 20
#: Kernel socket buffers of the data sockets (the kernel caps them at net.core.{r,w}mem_max).
#: TCP autotuning starts small; in a loopback side test with 4 MiB frames, 4 MiB buffers gave a
#: steady 1.8-2.5 GB/s where the defaults varied between 0.1 and 2.4 GB/s.
SOCKET_BUFFER_BYTES = 4 << 20
_DATA_SOCKOPTS = {zmq.SNDBUF: SOCKET_BUFFER_BYTES, zmq.RCVBUF: SOCKET_BUFFER_BYTES}
FAULTS_ENV = "RESILIENT_CKPT_DAEMON_FAULTS"
#: Fault points a test (or chaos drill) can arm through $RESILIENT_CKPT_DAEMON_FAULTS.
FAULT_NAMES = frozenset({"hold_inbound_after_chunks", "hold_outbound_after_chunks"})
DISCOVERY_PREFIX = "resilient_ckpt/daemon/"
_DATA_NAME = re.compile(r"^iter_(\d{20})\.owner_(\d{6})\.(data|hdr)$")  # store.py's layout


def _version() -> str:
    from .. import __version__

    return __version__


# --------------------------------------------------------------------------- configuration


@dataclass(frozen=True)
class DaemonConfig:
    """Everything ``resilient-ckpt serve`` takes (see :func:`build_parser` for the meaning)."""

    store_root: str = DEFAULT_ROOT
    bind: str = DEFAULT_BIND
    node_id: int = 0
    peers: Mapping[int, str] = field(default_factory=dict)
    discover: Optional[str] = None
    discover_master: bool = False
    advertise: Optional[str] = None
    sessions: Optional[FrozenSet[str]] = None
    memory_budget: Optional[int] = None
    keep_last: Optional[int] = 2
    recover: Optional[str] = None
    recover_timeout_s: float = 300.0
    chunk_bytes: int = DEFAULT_CHUNK_BYTES
    credit_bytes: int = DEFAULT_CREDIT_BYTES
    peer_timeout_s: float = 30.0
    inbound_timeout_s: float = 60.0
    retries: int = 3
    ping_interval_s: float = 5.0
    orphan_grace_s: float = 300.0
    metrics_port: Optional[int] = None
    metrics_addr: str = "0.0.0.0"
    io_threads: int = 2
    limits: Limits = DEFAULT_LIMITS
    faults: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if isinstance(self.node_id, bool) or not isinstance(self.node_id, int) or self.node_id < 0:
            raise ProtocolConfigError(f"node id {self.node_id!r} must be an int >= 0", fix="pass --node-id N")
        for name in ("chunk_bytes", "credit_bytes"):
            if getattr(self, name) < 1:
                raise ProtocolConfigError(f"{name} must be >= 1", fix=f"pass a positive --{name.replace('_', '-')}")
        if self.chunk_bytes > self.limits.max_frame_bytes:
            raise ProtocolConfigError(
                f"chunk_bytes {self.chunk_bytes} exceeds the frame limit {self.limits.max_frame_bytes}",
                fix="lower --chunk-bytes",
            )
        if self.keep_last is not None and self.keep_last < 1:
            raise ProtocolConfigError(f"keep_last {self.keep_last} must be >= 1", fix="pass --keep-last 1 or more")
        if self.memory_budget is not None and self.memory_budget < 0:
            raise ProtocolConfigError("memory budget must be >= 0", fix="pass --memory-budget 64G")
        unknown = set(self.faults) - FAULT_NAMES
        if unknown:
            raise ProtocolConfigError(f"unknown fault points {sorted(unknown)}", fix=f"use {sorted(FAULT_NAMES)}")
        for n, ep in self.peers.items():
            _check_endpoint(ep, f"peer {n}")
        _check_endpoint(self.bind, "--bind")


def _check_endpoint(ep: str, what: str) -> None:
    if not isinstance(ep, str) or not re.match(r"^(tcp|ipc|inproc)://\S+$", ep):
        raise ProtocolConfigError(f"{what} endpoint {ep!r} is not a ZeroMQ endpoint", fix="use tcp://HOST:PORT")


_SUFFIXES = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
             "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30, "T": 1 << 40, "TB": 1 << 40, "TIB": 1 << 40}


def parse_bytes(text: str) -> int:
    """``"512M"`` → 536870912. Binary units (K = 1024); accepts K/M/G/T with optional (i)B."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size; use e.g. 1073741824, 512M, 64G")
    return int(float(m.group(1)) * _SUFFIXES[m.group(2).upper()])


def parse_peers(spec: str) -> Dict[int, str]:
    """``"0=tcp://h:p,1=tcp://h:p"`` or a file with one ``id endpoint`` per line (# comments)."""
    if "=" not in spec and os.path.exists(spec):
        entries = []
        with open(spec) as f:
            for lineno, line in enumerate(f, 1):
                line = line.split("#", 1)[0].strip()
                if not line:
                    continue
                parts = line.split()
                if len(parts) != 2:
                    raise argparse.ArgumentTypeError(f"{spec}:{lineno}: expected 'ID ENDPOINT', got {line!r}")
                entries.append((parts[0], parts[1], f"{spec}:{lineno}"))
    else:
        entries = []
        for item in filter(None, (s.strip() for s in spec.split(","))):
            if "=" not in item:
                raise argparse.ArgumentTypeError(
                    f"peer {item!r} is not ID=ENDPOINT; use 0=tcp://host:port,1=tcp://host:port or a file path"
                )
            a, b = item.split("=", 1)
            entries.append((a.strip(), b.strip(), repr(item)))
    peers: Dict[int, str] = {}
    for node, ep, where in entries:
        if not node.isdigit():
            raise argparse.ArgumentTypeError(f"{where}: node id {node!r} is not a non-negative integer")
        if not re.match(r"^(tcp|ipc)://\S+$", ep):
            raise argparse.ArgumentTypeError(f"{where}: {ep!r} is not tcp://HOST:PORT or ipc://PATH")
        if int(node) in peers:
            raise argparse.ArgumentTypeError(f"{where}: node {node} is listed twice")
        peers[int(node)] = ep
    return peers


def parse_faults(text: Optional[str]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, _, value = item.partition("=")
        if name not in FAULT_NAMES or not value.isdigit():
            raise ProtocolConfigError(f"{FAULTS_ENV} entry {item!r} is invalid",
                                      fix=f"use NAME=INT with NAME in {sorted(FAULT_NAMES)}")
        out[name] = int(value)
    return out


def valid_session_name(name: object) -> bool:
    """A session the store can hold: a plain directory name."""
    return (
        isinstance(name, str)
        and 0 < len(name.encode("utf-8", "surrogatepass")) <= 255
        and "/" not in name
        and "\x00" not in name
        and not name.startswith(".")
    )


class _SessionFilter(collections.abc.Collection):
    """``expected_session`` for :func:`decode`: the configured sessions, or any valid name."""

    def __init__(self, allowed: Optional[FrozenSet[str]]):
        self.allowed = allowed

    def __contains__(self, name: object) -> bool:
        return valid_session_name(name) and (self.allowed is None or name in self.allowed)

    def __iter__(self):
        return iter(sorted(self.allowed) if self.allowed is not None else ["<any plain session name>"])

    def __len__(self) -> int:
        return len(self.allowed) if self.allowed is not None else 1


# --------------------------------------------------------------------------- logging


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ts, level, event, and the event's fields (peer, reason, ids)."""

    def format(self, record: logging.LogRecord) -> str:
        out: Dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": getattr(record, "event", None) or record.getMessage(),
        }
        out.update(getattr(record, "fields", {}) or {})
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, sort_keys=False)


def setup_logging(fmt: str = "text", level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("resilient_ckpt")
    root.handlers[:] = [handler]
    root.setLevel(level)
    root.propagate = False


class _RateLimit:
    """At most ``burst`` log lines per key per ``window_s`` (a flood of garbage must not turn
    into a flood of log lines); the suppressed count is reported with the next line."""

    def __init__(self, burst: int = 10, window_s: float = 10.0):
        self.burst, self.window_s = burst, window_s
        self._state: Dict[str, List[float]] = {}
        self._lock = threading.Lock()

    def allow(self, key: str) -> Tuple[bool, int]:
        now = time.monotonic()
        with self._lock:
            start, count, suppressed = self._state.get(key, [now, 0, 0])
            if now - start > self.window_s:
                start, count = now, 0
            if count < self.burst:
                self._state[key] = [start, count + 1, 0]
                return True, int(suppressed)
            self._state[key] = [start, count, suppressed + 1]
            return False, 0


# --------------------------------------------------------------------------- store access


def _read_or_none(path: Path) -> Optional[bytes]:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


class _Stores:
    """The daemon's store root: one CheckpointStore per session (created when first written)."""

    def __init__(self, root: str, node_id: int):
        self.root = Path(root)
        self.node_id = node_id
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the store root {self.root}: {e}; fix: pass --store-root pointing at a "
                "writable tmpfs directory"
            ) from e
        self._stores: Dict[str, CheckpointStore] = {}
        self._cache: Dict[Tuple[str, str], Tuple[Tuple[int, int, int], Holding]] = {}
        self._lock = threading.Lock()
        # Inbound reservations (router thread: pushes; workers: pulls) and every budget
        # decision about them: one lock, so two admissions never both take the last room.
        self._inflight: Dict[int, "_Reservation"] = {}
        self._budget_lock = threading.RLock()

    def get(self, session: str, create: bool = False) -> Optional[CheckpointStore]:
        with self._lock:
            store = self._stores.get(session)
        if store is not None:
            return store
        if not create and not (self.root / session).is_dir():
            return None
        store = CheckpointStore(self.root, session)
        with self._lock:
            return self._stores.setdefault(session, store)

    def sessions(self) -> List[str]:
        out = []
        with contextlib.suppress(FileNotFoundError):
            for p in self.root.iterdir():
                if valid_session_name(p.name) and p.is_dir():
                    out.append(p.name)
        return sorted(out)

    @staticmethod
    def raw_header(store: CheckpointStore, cid: CheckpointId) -> Optional[bytes]:
        return _read_or_none(store.header_path(cid))

    def holdings(self, session: str) -> List[Holding]:
        """Published checkpoints of a session, read from the headers (the store is the truth:
        trainers publish and retire without telling the daemon). Parsed headers are cached."""
        store = self.get(session)
        if store is None:
            return []
        out = []
        seen = set()
        with contextlib.suppress(FileNotFoundError):
            for p in store.dir.iterdir():
                m = _DATA_NAME.match(p.name)
                if not m or m.group(3) != "hdr":
                    continue
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                key = (session, p.name)
                seen.add(key)
                stamp = (st.st_ino, st.st_mtime_ns, st.st_size)
                with self._lock:
                    cached = self._cache.get(key)
                if cached is not None and cached[0] == stamp:
                    out.append(cached[1])
                    continue
                raw = _read_or_none(p)
                if raw is None:
                    continue
                try:
                    h = CheckpointHeader.unpack(raw, source=str(p))
                except CheckpointingException as e:
                    logger.warning("skipping unreadable header %s: %s", p, e)
                    continue
                if h.session != session or (h.iteration, h.owner) != (int(m.group(1)), int(m.group(2))):
                    logger.warning("skipping %s: it describes %s", p, h.id)
                    continue
                rpn = h.replication.get("ranks_per_node")
                rpn = rpn if isinstance(rpn, int) and not isinstance(rpn, bool) and rpn >= 1 else None
                holding = Holding(
                    iteration=h.iteration,
                    owner=h.owner,
                    world_size=h.world_size,
                    total_bytes=h.data_nbytes,
                    header_digest=header_digest(raw),
                    replica=None if rpn is None else (h.owner // rpn != self.node_id),
                    node=self.node_id,
                    ranks_per_node=rpn,
                )
                with self._lock:
                    self._cache[key] = (stamp, holding)
                out.append(holding)
        with self._lock:
            for key in [k for k in self._cache if k[0] == session and k not in seen]:
                del self._cache[key]
        return sorted(out, key=lambda h: (h.iteration, h.owner))

    def usage(self) -> Dict[str, Dict[str, int]]:
        """Bytes per session as the store counts them, except that an inbound reservation
        counts the memory it holds (allocated bytes), not the size its sender announced."""
        out = {}
        with self._budget_lock:  # no reservation appears or is renamed away mid-scan
            for s in self.sessions():
                store = self.get(s)
                if store is not None:
                    with contextlib.suppress(OSError):
                        out[s] = store.usage()
            for res in self._inflight.values():
                u = out.get(res.session)
                if u is not None:
                    held = res.allocated()
                    u["free_pool_bytes"] += held - res.total
                    u["total_bytes"] += held - res.total
        return out

    def total_bytes(self) -> int:
        return sum(u["total_bytes"] for u in self.usage().values())

    def check_budget(self, budget: Optional[int], session: str, need: int, *,
                     exclude: Optional["_Reservation"] = None, what: Optional[str] = None) -> None:
        """StoreFullError unless ``need`` more bytes fit the daemon-wide memory budget (all
        sessions' data, reusable pools and the memory inbound transfers hold); idle pooled
        segments and the not-yet-granted tails of inbound reservations (``exclude`` aside) are
        released first. Stored checkpoints are never evicted to make room."""
        if budget is None:
            return
        with self._budget_lock:
            total = self.total_bytes()
            if total + need <= budget:
                return
            for s in self.sessions():
                store = self.get(s)
                if store is not None:
                    with contextlib.suppress(OSError):
                        store.trim_free_pool()
            for res in self._inflight.values():
                if res is not exclude:
                    res.reclaim()
            total = self.total_bytes()
            if total + need <= budget:
                return
        if what is None:
            raise StoreFullError(
                f"a replica of {need} bytes for session {session!r} would bring this daemon's store "
                f"{self.root} to {total + need} bytes, over its memory budget of {budget} bytes; "
                "nothing was written or removed. Fix: raise --memory-budget (at least (keep_last + 1) x "
                "(own + replicated bytes) per node), lower --keep-last, or save fewer bytes per rank"
            )
        raise StoreFullError(
            f"{what}: {need} more bytes would bring this daemon's store {self.root} to {total + need} "
            f"bytes, over its memory budget of {budget} bytes (replicas arriving at the same time took "
            "the room since this one was admitted); the partial replica was discarded, nothing stored was "
            "removed. Fix: COMMIT again once the other transfers finished, or raise --memory-budget"
        )

    # ---- inbound reservations ----------------------------------------------------------------

    def open_inbound(self, store: CheckpointStore, session: str, total: int, window: int,
                     budget: Optional[int]) -> "_Reservation":
        """Admit an inbound checkpoint of ``total`` bytes (StoreFullError unless all of it fits
        next to what is held) and reserve its segment, backed for the first credit window."""
        with self._budget_lock:
            self.check_budget(budget, session, total)
            res = _Reservation(store, session, total)
            self._inflight[id(res)] = res
            try:
                # Admission counted all of it, so the first window needs no second check.
                res.grow(window)
            except BaseException:
                self.forget(res)
                res.release(store)
                raise
        return res

    def grow_inbound(self, res: "_Reservation", claim: int, budget: Optional[int], what: str) -> None:
        """Back ``[0, claim)`` of ``res`` before credit for it is granted (StoreFullError if the
        budget has no room left for the growth)."""
        with self._budget_lock:
            need = max(0, min(claim, res.total) - res.backed)
            if need:
                self.check_budget(budget, res.session, need, exclude=res, what=what)
            res.grow(claim)

    def forget(self, res: "_Reservation") -> None:
        """``res`` stops being in flight (before it is claimed or released: renamed away)."""
        with self._budget_lock:
            self._inflight.pop(id(res), None)

    def sweep(self, grace_s: float) -> None:
        """Orphan data (no header) of crashed saves or transfers goes back to the pools; a data
        file claimed within ``grace_s`` may be a save in progress and is left alone."""
        now = time.time()
        for s in self.sessions():
            store = self.get(s)
            if store is None:
                continue
            recent = []
            with contextlib.suppress(FileNotFoundError):
                for p in store.dir.iterdir():
                    m = _DATA_NAME.match(p.name)
                    if m and m.group(3) == "data":
                        with contextlib.suppress(FileNotFoundError):
                            if now - p.stat().st_ctime < grace_s:  # claim = rename, sets ctime
                                recent.append(CheckpointId(int(m.group(1)), int(m.group(2)), s))
            try:
                store.sweep_orphans(in_flight=recent)
            except OSError as e:
                logger.warning("could not sweep orphans in %s: %s", store.dir, e)


class _ReadOnlyMap:
    """A read-only mapping of a published segment: what replication and FETCH send from
    (zero-copy: the frames handed to ZeroMQ are slices of this mapping)."""

    def __init__(self, path: Path, nbytes: int):
        self.nbytes = nbytes
        self._mm: Optional[mmap.mmap] = None
        if nbytes == 0:
            self.view = memoryview(b"")
            return
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < nbytes:
                raise CorruptCheckpointError(f"{path} has {size} bytes, its header says {nbytes} (truncated)")
            # Populated: one batched fault-in instead of a page fault per 4 KiB on first touch.
            self._mm = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                                 prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.view = memoryview(self._mm)

    def close(self) -> None:
        # ZeroMQ may still reference slices (zero-copy frames being sent); then the mapping
        # goes when the last of them does.
        with contextlib.suppress(BufferError):
            self.view.release()
        if self._mm is not None:
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None


_RSV_SEQ = itertools.count()
_PAGE = mmap.PAGESIZE
_MADV_POPULATE_WRITE = 23  # Linux >= 5.14; as store.Segment.populate_pages


class _Reservation:
    """The segment an inbound checkpoint is written into, backed by memory only as far as its
    sender may have written.

    ``[0, claim)`` is what the sender may write (credit granted plus one window) and is always
    allocated; ``[0, backed)`` is allocated (reused pool pages, or fallocated ahead); beyond is a
    hole. So a sender that announces N bytes and stalls holds one credit window, not N, and
    reused pages beyond ``claim`` can be handed back under budget pressure (:meth:`reclaim`).
    Writes never touch a hole: a full tmpfs then fails fallocate with STORE_FULL instead of
    killing the daemon with SIGBUS. Quacks like a store Segment (``path``, ``close()``) for
    ``CheckpointStore.claim``; the file is named ``free/rsv_<pid>_…`` like store reservations,
    so a crashed daemon's is recycled by the next start's sweep.
    """

    def __init__(self, store: CheckpointStore, session: str, total: int):
        self.session, self.total = session, total
        self.claim = 0
        self.backed = 0
        self.path = store.free_dir / f"rsv_{os.getpid()}_{time.time_ns()}_{next(_RSV_SEQ)}.data"
        candidate = None
        if total:
            # Reuse a pooled segment's pages (fresh tmpfs pages cost ~10x a memcpy); under the
            # store's lock, which the node's trainers take to pick from the same pool.
            with store._locked():
                candidate = store._pick_free(total)
                if candidate is not None:
                    os.replace(candidate, self.path)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self._mm: Optional[mmap.mmap] = None
        try:
            st = os.fstat(self._fd)
            if candidate is not None and st.st_blocks * 512 >= st.st_size:  # no holes: all reusable
                self.backed = min(st.st_size, total)
            if st.st_size != total:
                os.ftruncate(self._fd, total)  # shrinking frees the excess, growing adds a hole
            if total:
                self._mm = mmap.mmap(self._fd, total, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            self.close()
            with contextlib.suppress(OSError):
                self.path.unlink()
            raise
        self.array = np.frombuffer(self._mm, dtype=np.uint8) if total else None

    def allocated(self) -> int:
        """Bytes of memory the file holds now."""
        try:
            return os.fstat(self._fd).st_blocks * 512
        except OSError:
            return 0

    def grow(self, claim: int) -> None:
        """Make ``[0, claim)`` writable: allocate what is a hole and map it in one batch."""
        claim = min(claim, self.total)
        if claim <= self.claim:
            return
        if claim > self.backed:
            end = min(self.total, -(-claim // _PAGE) * _PAGE)
            try:
                os.posix_fallocate(self._fd, self.backed, end - self.backed)
            except OSError as e:
                if e.errno == errno.ENOSPC:
                    raise StoreFullError(
                        f"out of space for {end - self.backed} more bytes of an incoming replica in "
                        f"{self.path.parent.parent}; the partial replica was discarded, nothing stored was "
                        "removed. Fix: enlarge the shared-memory filesystem (docker run --shm-size, "
                        "Kubernetes emptyDir medium: Memory) or lower --keep-last"
                    ) from e
                raise StoreError(f"cannot allocate {end - self.backed} bytes in {self.path}: {e}") from e
            self.backed = end
        start = self.claim // _PAGE * _PAGE
        with contextlib.suppress(OSError, ValueError):  # older kernel: pages fault in on first write
            self._mm.madvise(_MADV_POPULATE_WRITE, start, claim - start)
        self.claim = claim

    def reclaim(self) -> int:
        """Free the allocated bytes beyond ``claim`` (budget pressure); returns how many."""
        start = min(self.backed, -(-self.claim // _PAGE) * _PAGE)
        n = self.backed - start
        if n <= 0 or self._mm is None:
            return 0
        try:
            self._mm.madvise(mmap.MADV_REMOVE, start, n)  # punches a hole in the file
        except (OSError, ValueError, AttributeError):  # a filesystem that cannot: keep them
            return 0
        self.backed = start
        return n

    def _unmap(self) -> None:
        self.array = None
        if self._mm is not None:
            # Views may still be alive elsewhere: the mapping then goes with the last of them.
            with contextlib.suppress(BufferError):
                self._mm.close()
            self._mm = None

    def close(self) -> None:
        self._unmap()
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def release(self, store: CheckpointStore) -> None:
        """Back to the pool (a transfer that did not complete), holes cut off: pooled
        segments are fully allocated, which is what their reuse counts on."""
        self._unmap()
        if self._fd >= 0 and self.backed < self.total:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self.backed)
        self.close()
        store.release(self)  # type: ignore[arg-type]  # duck-typed Segment


class _TransferError(Exception):
    """A transfer or request cannot proceed: ``code`` goes into the ERROR reply."""

    def __init__(self, code: ErrorCode, text: str, retryable: bool = False):
        super().__init__(text)
        self.code = code
        self.text = text
        self.retryable = retryable


class _TensorVerifier:
    """Checks the header's tensor checksums as chunks land, while each chunk is still in the
    CPU cache (one pass at the end would read the whole segment again from memory)."""

    def __init__(self, header: CheckpointHeader, total: int):
        if header.checksum_algo != checksum.ALGO:
            raise _TransferError(ErrorCode.MALFORMED, f"the header's tensors use checksum {header.checksum_algo!r}; "
                                 f"this daemon verifies {checksum.ALGO!r} (run the same resilient-ckpt release)")
        self.items = []
        for i, lay in enumerate(header.tensors):
            if lay.offset < 0 or lay.nbytes < 0 or lay.offset + lay.nbytes > total:
                raise _TransferError(ErrorCode.MALFORMED, f"tensor {i} lies outside the segment of {total} bytes")
            if lay.checksum is not None and lay.nbytes > 0:
                self.items.append((lay.offset, lay.offset + lay.nbytes, lay.checksum, i))
        self.items.sort()
        self._hashers: Dict[int, Any] = {}
        self._done: set = set()
        self._first = 0  # items before this index are all verified

    def feed(self, view: memoryview, start: int, end: int) -> None:
        """Bytes ``[start, end)`` of the segment were just written (chunks arrive in order)."""
        items = self.items
        k = self._first
        while k < len(items):
            a, b, expected, idx = items[k]
            if a >= end:
                break
            if idx not in self._done:
                lo, hi = max(a, start), min(b, end)
                if lo < hi:
                    h = self._hashers.get(idx)
                    if h is None:
                        h = self._hashers[idx] = xxhash.xxh3_64()  # streaming = one-shot digest
                    h.update(view[lo:hi])
                if b <= end:
                    h = self._hashers.pop(idx, None)
                    if h is None or h.intdigest() != expected:
                        raise _TransferError(ErrorCode.CHECKSUM_MISMATCH, f"tensor {idx} fails its checksum "
                                             "(corrupted at the source or in transit)", retryable=True)
                    self._done.add(idx)
            k += 1
        while self._first < len(items) and items[self._first][3] in self._done:
            self._first += 1

    @property
    def complete(self) -> bool:
        return self._first == len(self.items)


class _Inbound:
    """One checkpoint arriving (pushed replica or pulled FETCH stream): a reserved segment
    written chunk by chunk, verified, then claimed and published (header last)."""

    def __init__(
        self,
        stores: _Stores,
        store: CheckpointStore,
        key: Key,
        begin: Mapping[str, Any],
        *,
        peer: str,
        header_frame: Optional[memoryview] = None,
        rid: bytes = b"",
        req_id: int = 0,
        window: int = DEFAULT_CREDIT_BYTES,
        budget: Optional[int] = None,
    ):
        session, it, owner = key
        self.stores, self.store, self.key = stores, store, key
        self.window, self.budget = window, budget
        self.cid = CheckpointId(it, owner, session)
        self.total = int(begin["total_bytes"])
        self.chunk_bytes = int(begin["chunk_bytes"])
        self.num_chunks = int(begin["num_chunks"])
        self.world_size = int(begin["world_size"])
        digest = begin.get("header_digest")
        self.digest = bytes(digest) if digest is not None else None
        self.peer, self.rid, self.req_id = peer, rid, req_id
        self.next_index = 0
        self.received = 0
        self.granted = 0
        self.started = self.last_activity = time.monotonic()
        self.granter = CreditGranter(window)
        self.verifier: Optional[_TensorVerifier] = None
        if header_frame is not None:
            raw = bytes(header_frame)
            header = self._check_header(raw)
            self.digest = header_digest(raw)
            self.verifier = _TensorVerifier(header, self.total)
        self.segment: Optional[_Reservation] = stores.open_inbound(store, session, self.total, window, budget)
        self._dst = self.segment.array
        self._view = memoryview(self._dst) if self.total else None

    def describe(self, kind: str) -> Dict[str, Any]:
        seg = self.segment
        return {"session": self.key[0], "iteration": self.key[1], "owner": self.key[2], "peer": self.peer,
                "kind": kind, "received": self.received, "total_bytes": self.total,
                "reserved_bytes": seg.claim if seg is not None else 0}

    def _check_header(self, raw: bytes) -> CheckpointHeader:
        if self.digest is not None and header_digest(raw) != self.digest:
            raise _TransferError(ErrorCode.CHECKSUM_MISMATCH, "the store header does not match the digest "
                                 "announced in REPLICATE_BEGIN")
        try:
            header = CheckpointHeader.unpack(raw, source=f"replica header of {self.cid.stem()} from {self.peer}")
        except CheckpointingException as e:
            raise _TransferError(ErrorCode.CHECKSUM_MISMATCH, str(e)) from None
        if header.id != self.cid or header.data_nbytes != self.total or header.world_size != self.world_size:
            raise _TransferError(ErrorCode.MALFORMED, f"the header describes {header.id.stem()} of "
                                 f"{header.data_nbytes} bytes (world {header.world_size}), the transfer "
                                 f"{self.cid.stem()} of {self.total} bytes (world {self.world_size})")
        return header

    def write(self, body: Mapping[str, Any], frame: memoryview) -> int:
        index, offset = body["index"], body["offset"]
        if index != self.next_index:
            raise _TransferError(ErrorCode.MALFORMED, f"chunk {index} arrived while chunk {self.next_index} "
                                 "was expected (chunks are sent in order; a message was lost)", retryable=True)
        if index >= self.num_chunks:
            raise _TransferError(ErrorCode.MALFORMED, f"chunk {index} is beyond the announced {self.num_chunks}")
        expected_offset = index * self.chunk_bytes
        expected_len = min(self.chunk_bytes, self.total - expected_offset)
        n = frame.nbytes
        if offset != expected_offset or n != expected_len:
            raise _TransferError(ErrorCode.MALFORMED, f"chunk {index} has offset {offset} and {n} bytes; "
                                 f"expected offset {expected_offset} and {expected_len} bytes")
        if offset + n > self.segment.claim:
            raise _TransferError(ErrorCode.MALFORMED, f"chunk {index} ends at byte {offset + n}, beyond the "
                                 f"{self.segment.claim} bytes granted so far (credit window {self.window} bytes): "
                                 "the sender ignores flow control (docs/protocol.md section 7)")
        if chunk_checksum(frame) != body["checksum"]:
            raise _TransferError(ErrorCode.CHECKSUM_MISMATCH, f"chunk {index} of {self.cid.stem()} fails its "
                                 "checksum (corrupted in transit or at the source)", retryable=True)
        np.copyto(self._dst[offset:offset + n], np.frombuffer(frame, dtype=np.uint8))
        if self.verifier is not None:
            self.verifier.feed(self._view, offset, offset + n)
        self.next_index += 1
        self.received += n
        self.last_activity = time.monotonic()
        return n

    def consumed(self, n: int) -> int:
        """CREDIT to grant after ``n`` bytes were written (0: not yet). The reservation grows
        first: once granted, the sender may put that many more bytes in flight."""
        grant = self.granter.consumed(n)
        if grant:
            self.stores.grow_inbound(self.segment, self.granted + grant + self.window, self.budget,
                                     f"receiving {self.cid.stem()} of session {self.key[0]!r} from {self.peer}")
            self.granted += grant
        return grant

    def finish(self, body: Mapping[str, Any], raw: memoryview) -> Tuple[CheckpointHeader, bool]:
        """Verify everything, then claim + publish. Returns (header, already_held)."""
        if body["num_chunks"] != self.num_chunks or body["total_bytes"] != self.total:
            raise _TransferError(ErrorCode.MALFORMED, "REPLICATE_END disagrees with REPLICATE_BEGIN on the "
                                 "chunk count or size")
        if self.next_index != self.num_chunks:
            raise _TransferError(ErrorCode.MALFORMED, f"REPLICATE_END after {self.next_index} of "
                                 f"{self.num_chunks} chunks", retryable=True)
        raw = bytes(raw)
        if xxhash.xxh3_64_intdigest(raw) != body["header_checksum"]:
            raise _TransferError(ErrorCode.CHECKSUM_MISMATCH, "the store header fails its checksum", retryable=True)
        header = self._check_header(raw)
        digest = header_digest(raw)
        if self.verifier is None and self.total:
            verifier = _TensorVerifier(header, self.total)  # no header at BEGIN: one pass now
            verifier.feed(self._view, 0, self.total)
        elif self.verifier is not None and not self.verifier.complete:
            raise _TransferError(ErrorCode.MALFORMED, "some tensors were not covered by the chunks")
        self._release_views()
        seg, self.segment = self.segment, None
        self.stores.forget(seg)
        seg.close()
        existing = self.stores.raw_header(self.store, self.cid)
        if existing is not None:
            if header_digest(existing) == digest:
                seg.release(self.store)
                return header, True
            self.store.discard(self.cid)  # an older save of the same id: this one replaces it
        try:
            self.store.claim(seg, self.cid.iteration, self.cid.owner)
        except BaseException:
            seg.release(self.store)
            raise
        self.store.write_raw_header(raw, self.cid)
        return header, False

    def _release_views(self) -> None:
        if self._view is not None:
            with contextlib.suppress(BufferError):
                self._view.release()
        self._view = None
        self._dst = None

    def abort(self) -> None:
        self._release_views()
        seg, self.segment = self.segment, None
        if seg is not None:
            self.stores.forget(seg)
            with contextlib.suppress(Exception):
                seg.release(self.store)


# --------------------------------------------------------------------------- replication records


@dataclass
class _Replication:
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


class _PushFailed(Exception):
    def __init__(self, text: str, retryable: bool = True, code: Optional[ErrorCode] = None):
        super().__init__(text)
        self.retryable = retryable
        self.code = code


# --------------------------------------------------------------------------- peers


class _PeerDirectory:
    """Node id → daemon endpoint: a static ``--peers`` map and/or a torch TCPStore
    (``--discover``) where every daemon registers ``resilient_ckpt/daemon/<node-id>``."""

    def __init__(self, node_id: int, static: Mapping[int, str], discover: Optional[str], master: bool,
                 timeout_s: float):
        self.node_id = node_id
        self._static = dict(static)
        self._found: Dict[int, str] = {}
        self._discover = discover
        self._master = master
        self._timeout_s = timeout_s
        self._store = None
        self._lock = threading.Lock()

    def start(self, advertise: str) -> None:
        if not self._discover:
            return
        from datetime import timedelta

        from torch.distributed import TCPStore

        host, _, port = self._discover.rpartition(":")
        if not host or not port.isdigit():
            raise ProtocolConfigError(f"--discover {self._discover!r} is not HOST:PORT",
                                      fix="pass e.g. --discover node0:29500")
        try:
            self._store = TCPStore(host, int(port), is_master=self._master, wait_for_workers=False,
                                   timeout=timedelta(seconds=max(1.0, self._timeout_s)))
            self._store.set(DISCOVERY_PREFIX + str(self.node_id), advertise)
        except Exception as e:  # torch raises RuntimeError/DistNetworkError/TimeoutError
            raise ProtocolConfigError(
                f"cannot register in the discovery store {self._discover}: {e}",
                fix="start the TCPStore first (or pass --discover-master on one daemon) and check HOST:PORT",
            ) from e

    def endpoint(self, node: int) -> Optional[str]:
        if node in self._static:
            return self._static[node]
        with self._lock:
            if node in self._found:
                return self._found[node]
            return self._lookup(node)

    def _lookup(self, node: int) -> Optional[str]:
        if self._store is None:
            return None
        key = DISCOVERY_PREFIX + str(node)
        try:
            if not self._store.check([key]):
                return None
            ep = self._store.get(key).decode()
        except Exception as e:
            logger.warning("discovery lookup of node %d failed: %s", node, e)
            return None
        self._found[node] = ep
        return ep

    def refresh(self) -> None:
        """Re-read discovered endpoints (a restarted daemon may have moved) and probe for new
        nodes: ids up to 8 past the highest known."""
        if self._store is None:
            return
        with self._lock:
            known = set(self._found) | set(self._static) | {self.node_id}
            self._found.clear()
            misses = 0
            node = 0
            while misses < 8 or node <= max(known):
                if node != self.node_id and node not in self._static:
                    misses = 0 if self._lookup(node) else misses + 1
                node += 1
                if node > 65536:
                    break

    def nodes(self) -> List[int]:
        with self._lock:
            return sorted((set(self._static) | set(self._found)) - {self.node_id})

    def close(self) -> None:
        self._store = None


# --------------------------------------------------------------------------- metrics


class _RejectCollector:
    def __init__(self, counters: RejectCounters):
        self.counters = counters

    def describe(self):
        from prometheus_client.core import CounterMetricFamily

        yield CounterMetricFamily("resilient_ckpt_rejected_messages", "Rejected messages by reason", labels=["reason"])

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        fam = CounterMetricFamily("resilient_ckpt_rejected_messages", "Rejected messages by reason", labels=["reason"])
        for reason, n in sorted(self.counters.snapshot().items()):
            fam.add_metric([reason], n)
        yield fam


class _Metrics:
    """Prometheus metrics of one daemon (its own registry, so in-process daemons coexist)."""

    def __init__(self, daemon: "Daemon"):
        from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

        r = self.registry = CollectorRegistry()
        self.bytes = Counter("resilient_ckpt_replicated_bytes", "Checkpoint bytes replicated, by direction",
                             ["direction"], registry=r)
        self.replications = Counter("resilient_ckpt_replications", "Replications of a checkpoint to one holder node",
                                    ["result"], registry=r)
        self.fetches = Counter("resilient_ckpt_fetches_served", "FETCH streams served to peers", registry=r)
        self.pulls = Counter("resilient_ckpt_pulls", "Checkpoints pulled from peers", ["result"], registry=r)
        self.seconds = Histogram("resilient_ckpt_replication_seconds", "Seconds to replicate a checkpoint to one node",
                                 buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300), registry=r)
        Gauge("resilient_ckpt_store_bytes", "Bytes in this daemon's store (data and reusable segments)",
              registry=r).set_function(lambda: daemon._cached_usage[0])
        Gauge("resilient_ckpt_checkpoints_held", "Published checkpoints in this daemon's store",
              registry=r).set_function(lambda: daemon._cached_usage[1])
        Gauge("resilient_ckpt_peers_up", "Peer daemons that answered the last ping",
              registry=r).set_function(daemon._peers_up)
        r.register(_RejectCollector(daemon.rejects))
        self._server = None

    def serve(self, port: int, addr: str) -> int:
        from prometheus_client import start_http_server

        result = start_http_server(port, addr=addr, registry=self.registry)
        if isinstance(result, tuple):
            self._server = result[0]
            return self._server.server_address[1]
        return port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


# --------------------------------------------------------------------------- router-side state


@dataclass
class _Conn:
    role: str = "client"
    version: int = PROTOCOL_VERSION
    credit_bytes: Optional[int] = None
    max_frame_bytes: Optional[int] = None
    sender: str = ""


@dataclass
class _OutStream:
    """A FETCH being served: chunks go out as the puller grants credit (router thread only)."""

    rid: bytes
    req_id: int
    session: str
    key: Key
    peer: str
    mapping: _ReadOnlyMap
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


_WAITER_SEQ = __import__("itertools").count()


@dataclass
class _Waiter:
    rid: bytes
    request: Message
    deadline: float
    kind: str  # "commit" | "status"
    seq: int = field(default_factory=lambda: next(_WAITER_SEQ))


@dataclass
class _PullTask:
    key: Key
    from_node: Optional[int]
    waiters: List[Tuple[bytes, Message]]


# --------------------------------------------------------------------------- the daemon


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
        # Answers to this daemon's own requests to peers: they echo a random req_id, so a
        # pre-start floor would add nothing there, only refuse a peer whose clock lags.
        self.peer_guard = ReplayGuard()
        self.stores = _Stores(config.store_root, config.node_id)
        self.peers = _PeerDirectory(config.node_id, config.peers, config.discover, config.discover_master,
                                    config.peer_timeout_s)
        self.metrics = _Metrics(self)
        self.metrics_port: Optional[int] = None
        self.endpoint: Optional[str] = None
        self._sessions = _SessionFilter(config.sessions)
        self._ctx: Optional[zmq.Context] = None
        self._router: Optional[zmq.Socket] = None
        self._stop = threading.Event()
        self._started = threading.Event()
        self._start_error: Optional[BaseException] = None
        self._threads: List[threading.Thread] = []
        self._lock = threading.RLock()
        self._posted: "queue.SimpleQueue[Callable[[], None]]" = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        os.set_blocking(self._wake_r, False)
        self._wake_lock = threading.Lock()  # no write to the pipe once stop() closed it
        # shared (under _lock)
        self._repls: Dict[Key, _Replication] = {}
        self._pushers: Dict[int, "_PeerPusher"] = {}
        self._busy: collections.Counter = collections.Counter()
        self._peer_state: Dict[int, Dict[str, Any]] = {}
        self._pulling: Dict[Key, _Inbound] = {}  # pulls in progress (worker threads), for STATUS
        self._stats = collections.Counter()
        self._recovery: Dict[str, Any] = {}
        self._cached_usage = (0, 0)
        self._retention_due = threading.Event()
        # router thread only
        self._conns: "OrderedDict[bytes, _Conn]" = OrderedDict()
        self._inbound: Dict[Key, _Inbound] = {}
        self._aborted: "OrderedDict[Tuple[bytes, int], Tuple[Optional[ErrorCode], str]]" = OrderedDict()
        self._streams: Dict[Tuple[bytes, int], _OutStream] = {}
        self._waiters: Dict[Key, List[_Waiter]] = {}
        self._waiter_heap: List[Tuple[float, int, Key]] = []
        self._pulls: Dict[Key, _PullTask] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="rc-daemon-work")
        self._log_limit = _RateLimit()
        self._t0 = time.monotonic()

    # ---- logging ------------------------------------------------------------------------------

    def event(self, level: int, event: str, **fields: Any) -> None:
        fields = {k: v for k, v in fields.items() if v is not None}
        fields.setdefault("node", self.node_id)
        text = " ".join(f"{k}={v}" for k, v in fields.items())
        logger.log(level, "%s %s", event, text, extra={"event": event, "fields": fields})

    def _log_reject(self, exc: ProtocolError, peer: Optional[str]) -> None:
        ok, suppressed = self._log_limit.allow(exc.reason)
        if ok:
            self.event(logging.WARNING, "message_rejected", reason=exc.reason, peer=exc.peer or peer,
                       error=str(exc), suppressed_since_last=suppressed or None)

    # ---- lifecycle ----------------------------------------------------------------------------

    def start(self, timeout: float = 30.0) -> "Daemon":
        t = threading.Thread(target=self._router_main, name="rc-daemon-router", daemon=True)
        self._threads.append(t)
        t.start()
        if not self._started.wait(timeout):
            raise ProtocolConfigError(f"the daemon did not start within {timeout:g} s", fix="see its log")
        if self._start_error is not None:
            self._stop.set()
            raise self._start_error
        m = threading.Thread(target=self._maintenance_main, name="rc-daemon-maint", daemon=True)
        self._threads.append(m)
        m.start()
        if self.config.recover:
            r = threading.Thread(target=self._recover_main, args=(self.config.recover,), name="rc-daemon-recover",
                                 daemon=True)
            self._threads.append(r)
            r.start()
        return self

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._retention_due.set()  # wakes the maintenance thread
        self._wake()
        with self._lock:
            pushers = list(self._pushers.values())
        for p in pushers:
            p.stop()
        for t in self._threads + [p.thread for p in pushers]:
            if t is not threading.current_thread():
                t.join(timeout)
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.metrics.close()
        self.peers.close()
        with self._wake_lock:
            for fd in (self._wake_r, self._wake_w):
                if fd >= 0:
                    with contextlib.suppress(OSError):
                        os.close(fd)
            self._wake_r = self._wake_w = -1
        if self._ctx is not None:
            alive = [t.name for t in self._threads if t.is_alive()]
            if alive:  # destroying the context under a live socket is unsafe: leave it to exit
                logger.warning("daemon threads still running at stop: %s", alive)
            else:
                self._ctx.destroy(linger=0)

    def __enter__(self) -> "Daemon":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def context(self) -> zmq.Context:
        assert self._ctx is not None
        return self._ctx

    def _post(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` in the router thread (the only one that may touch the ROUTER)."""
        self._posted.put(fn)
        self._wake()

    def _wake(self) -> None:
        with self._wake_lock:
            if self._wake_w >= 0:
                with contextlib.suppress(BlockingIOError, OSError):  # full pipe: already awake
                    os.write(self._wake_w, b"\x01")

    @property
    def alive(self) -> bool:
        """True while the router thread serves (False after stop() or a crash)."""
        return bool(self._threads) and self._threads[0].is_alive()

    # ---- router thread ------------------------------------------------------------------------

    def _router_main(self) -> None:
        cfg = self.config
        router = None
        try:
            self._ctx = zmq.Context(io_threads=max(1, cfg.io_threads))
            router = self._ctx.socket(zmq.ROUTER)
            configure_socket(router, limits=self.limits)
            for opt, value in _DATA_SOCKOPTS.items():
                router.setsockopt(opt, value)
            router.bind(cfg.bind)
            self._router = router
            self.endpoint = router.getsockopt(zmq.LAST_ENDPOINT).decode()
            advertise = cfg.advertise or self.endpoint.replace("0.0.0.0", socket.gethostname())
            self.peers.start(advertise)
            self.stores.sweep(cfg.orphan_grace_s)
            self._refresh_usage()
            if cfg.metrics_port is not None:
                self.metrics_port = self.metrics.serve(cfg.metrics_port, cfg.metrics_addr)
        except BaseException as e:
            self._start_error = e if isinstance(e, CheckpointingException) else ProtocolConfigError(
                f"cannot start the daemon on {cfg.bind}: {type(e).__name__}: {e}",
                fix="check --bind (address in use? interface exists?) and --store-root",
            )
            if router is not None:
                router.close(linger=0)
            self._router = None
            if self._ctx is not None:
                self._ctx.destroy(linger=0)
                self._ctx = None
            self.metrics.close()
            self._started.set()
            return
        self.event(logging.INFO, "serving", endpoint=self.endpoint, store_root=str(self.stores.root),
                   peers=dict(cfg.peers) or None, discover=cfg.discover, metrics_port=self.metrics_port,
                   pid=os.getpid(), version=_version())
        self._started.set()
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        next_timer = 0.0
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(self._poll_timeout_ms()))
                if self._wake_r in events:
                    with contextlib.suppress(BlockingIOError, OSError):
                        os.read(self._wake_r, 4096)
                self._run_posted()
                if router in events:
                    for _ in range(256):
                        if not router.poll(0, zmq.POLLIN):
                            break
                        self._receive_one()
                        if self._streams:
                            self._pump_streams()
                self._pump_streams()
                now = time.monotonic()
                self._expire_waiters(now)  # every turn: the poll timeout is computed from them
                if now >= next_timer:
                    self._timers(now)
                    next_timer = now + 0.25
        except BaseException:  # a bug: log it loudly, never die silently
            logger.exception("router thread crashed")
            raise
        finally:
            for t in list(self._inbound.values()):
                t.abort()
            self._inbound.clear()
            for s in list(self._streams.values()):
                s.mapping.close()
            self._streams.clear()
            router.close(linger=0)

    def _run_posted(self) -> None:
        while True:
            try:
                fn = self._posted.get_nowait()
            except queue.Empty:
                return
            try:
                fn()
            except Exception:
                logger.exception("posted task failed")

    def _poll_timeout_ms(self) -> int:
        if any(s.pending is not None for s in self._streams.values()):
            return 2  # a stream hit the peer's queue limit: retry soon
        timeout = 250.0
        if self._waiter_heap:
            timeout = min(timeout, max(0.0, (self._waiter_heap[0][0] - time.monotonic()) * 1000))
        return max(1, int(timeout))

    def _receive_one(self) -> None:
        try:
            rid, label, frames = recv_raw_from(self._router, timeout_ms=100, limits=self.limits,
                                               counters=self.rejects)
        except PeerTimeout:
            return
        except ProtocolError as exc:  # over the limits: counted, dropped
            self._log_reject(exc, None)
            return
        try:
            msg = decode(frames, self.auth, expected_session=self._sessions, replay_guard=self.guard,
                         limits=self.limits, counters=self.rejects, peer=label)
        except ProtocolError as exc:
            self._log_reject(exc, label)
            # Answer authenticated senders (never an unauthenticated one, never a duplicate
            # nonce: the original was answered). Out of the window or older than this start:
            # answered, never executed; the answer says what this daemon's clock reads, which
            # a replayer learns nothing from and a skewed or restarted-upon client needs.
            body = self._rejection_body(exc)
            if body is not None:
                info = authenticated_request_info(frames, self.auth, limits=self.limits)
                if info is not None and info.type_code not in (MessageType.ERROR, MessageType.OK,
                                                               MessageType.HELLO_OK, MessageType.CREDIT):
                    if info.type_code is not None:
                        body["op"] = info.type_code
                    reply = Message(type=MessageType.ERROR, session=info.session, sender=self.name,
                                    req_id=info.req_id, body=body, version=info.version)
                    self._send(rid, reply)
            return
        conn = self._conns.get(rid)
        if conn is not None:
            self._conns.move_to_end(rid)
        try:
            self._dispatch(rid, label, msg)
        except _TransferError as e:
            self._reply_error(rid, msg, e.code, e.text, retryable=e.retryable)
        except StoreFullError as e:
            self._reply_error(rid, msg, ErrorCode.STORE_FULL, str(e))
        except ProtocolError as e:
            self._reply_error(rid, msg, e.code, str(e))
        except CheckpointingException as e:
            self._reply_error(rid, msg, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")
        except Exception as e:  # never let one request take the daemon down
            logger.exception("handling %s from %s failed", msg.type.name, label)
            self._reply_error(rid, msg, ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")

    def _rejection_body(self, exc: ProtocolError) -> Optional[Dict[str, Any]]:
        """The ERROR body answering a message refused while decoding, None: not answered."""
        if exc.reason in ("malformed", "version", "unknown_type", "session"):
            return error_body(exc)
        where = f"node {self.node_id} ({socket.gethostname()})"
        if isinstance(exc, StaleMessage) and exc.skew_s is not None:
            return error_body(
                ErrorCode.CLOCK_SKEW,
                f"clock skew: your timestamp is {exc.skew_s:+.1f} s from the daemon's clock on {where}, outside "
                f"the ±{self.guard.window_ns / 1e9:g} s replay window; the request was not executed. Fix: "
                "synchronise clocks (NTP/chrony) on this host and on the daemon's node",
                skew_s=float(exc.skew_s), daemon_time_ns=time.time_ns(), node=self.node_id)
        if isinstance(exc, PredatesStart):
            return error_body(
                ErrorCode.REPLAYED,
                f"message predates this daemon's start at {format_time_ns(self.started_ns)} on {where}: a replay, "
                "or a message sent before the restart; it was not executed. Fix: resend it as a new message "
                "(a fresh timestamp is accepted; DaemonClient does so by itself)",
                retryable=True, daemon_start_ns=self.started_ns, daemon_time_ns=time.time_ns(),
                node=self.node_id)
        return None

    def _send(self, rid: bytes, msg: Message) -> bool:
        """Non-blocking send on the ROUTER: a peer that does not read loses the answer (and
        retries its request), it never stalls the daemon."""
        try:
            send(self._router, msg, self.auth, to=rid, timeout_ms=0, limits=self.limits)
            return True
        except (PeerTimeout, PeerUnreachable) as e:
            with self._lock:
                self._stats["replies_dropped"] += 1
            ok, _ = self._log_limit.allow("reply_dropped")
            if ok:
                self.event(logging.INFO, "reply_dropped", peer=msg.sender, type=msg.type.name, reason=e.reason)
            return False

    def _reply(self, rid: bytes, request: Message, mtype: MessageType, body: Mapping[str, Any],
               frames: Sequence[Any] = ()) -> bool:
        return self._send(rid, request.reply(mtype, sender=self.name, body=body, frames=frames))

    def _reply_ok(self, rid: bytes, request: Message, result: Optional[Mapping[str, Any]] = None) -> bool:
        body: Dict[str, Any] = {"op": int(request.type)}
        if result is not None:
            body["result"] = dict(result)
        return self._reply(rid, request, MessageType.OK, body)

    def _reply_error(self, rid: bytes, request: Message, code: ErrorCode, text: str, *,
                     retryable: bool = False) -> None:
        ok, suppressed = self._log_limit.allow(f"request_failed:{code.value}")
        if ok:
            self.event(logging.WARNING, "request_failed", peer=request.sender, op=request.type.name,
                       code=code.value, session=request.session, iteration=request.body.get("iteration"),
                       owner=request.body.get("owner_rank"), reason=text[:500],
                       suppressed_since_last=suppressed or None)
        body = error_body(code, text, op=int(request.type))
        if retryable:
            body["retryable"] = True
        self._reply(rid, request, MessageType.ERROR, body)

    def _dispatch(self, rid: bytes, label: str, msg: Message) -> None:
        handler = {
            MessageType.HELLO: self._on_hello,
            MessageType.COMMIT: self._on_commit,
            MessageType.REPLICATE_BEGIN: self._on_begin,
            MessageType.REPLICATE_CHUNK: self._on_chunk,
            MessageType.REPLICATE_END: self._on_end,
            MessageType.FETCH: self._on_fetch,
            MessageType.LIST: self._on_list,
            MessageType.DROP: self._on_drop,
            MessageType.STATUS: self._on_status,
            MessageType.CREDIT: self._on_credit,
            MessageType.ERROR: self._on_peer_error,
        }.get(msg.type)
        if handler is None:  # OK / HELLO_OK are answers, not requests: never answer an answer
            self.rejects.record("unexpected")
            return
        handler(rid, label, msg)

    # ---- simple requests ----------------------------------------------------------------------

    def _on_hello(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        version = negotiate_version(b["min_version"], b["max_version"], peer=label)
        self._conns[rid] = _Conn(role=b["role"], version=version, credit_bytes=b.get("credit_bytes"),
                                 max_frame_bytes=b.get("max_frame_bytes"), sender=msg.sender)
        self._conns.move_to_end(rid)
        while len(self._conns) > 4096:
            self._conns.popitem(last=False)
        self._reply(rid, msg, MessageType.HELLO_OK, {
            "version": version,
            "role": "daemon",
            "max_frame_bytes": self.limits.max_frame_bytes,
            "credit_bytes": self.config.credit_bytes,
            "node": self.node_id,
            "daemon_version": _version(),
        })

    def _on_list(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        if b.get("peers"):
            self._pool.submit(self._list_everywhere_task, rid, msg)
            return
        holdings = self._filter(self.stores.holdings(msg.session), b)
        self._reply_ok(rid, msg, {"holdings": [h.to_wire() for h in holdings]})

    @staticmethod
    def _filter(holdings: Iterable[Holding], body: Mapping[str, Any]) -> List[Holding]:
        it, owner = body.get("iteration"), body.get("owner_rank")
        return [h for h in holdings if (it is None or h.iteration == it) and (owner is None or h.owner == owner)]

    def _on_drop(self, rid: bytes, label: str, msg: Message) -> None:
        store = self.stores.get(msg.session)
        dropped = 0
        kept = []
        for item in msg.body["ids"]:
            key = (msg.session, item["iteration"], item["owner_rank"])
            if store is None:
                continue
            if self._saved_after(store, key, msg.timestamp_ns):
                kept.append(f"{key[1]}/{key[2]}")
                continue
            if self._drop(store, key):
                dropped += 1
        if dropped:
            self.event(logging.INFO, "dropped", peer=msg.sender, session=msg.session, count=dropped)
        if kept:
            self.event(logging.INFO, "drop_kept_newer", peer=msg.sender, session=msg.session,
                       ids=",".join(kept[:50]), reason="saved again after the DROP was sent: the DROP named an "
                       "older save of these ids (delayed, or the sender's clock is behind this node's)")
        self._reply_ok(rid, msg, {"dropped": dropped})

    @staticmethod
    def _saved_after(store: CheckpointStore, key: Key, sent_ns: int) -> bool:
        """True if ``key`` was published (header written) or, unpublished, claimed (data file
        renamed into place) after ``sent_ns``: a DROP names the save that existed when it was
        sent, never a newer save of the same id (a re-run that saved that iteration again)."""
        cid = CheckpointId(key[1], key[2], key[0])
        with contextlib.suppress(OSError):
            return store.header_path(cid).stat().st_mtime_ns > sent_ns
        with contextlib.suppress(OSError):
            return store.data_path(cid).stat().st_ctime_ns > sent_ns
        return False

    def _drop(self, store: CheckpointStore, key: Key) -> bool:
        cid = CheckpointId(key[1], key[2], key[0])
        exists = store.header_path(cid).exists() or store.data_path(cid).exists()
        with self._lock:
            rec = self._repls.pop(key, None)
            if rec is not None:
                rec.cancelled = True
            busy = self._busy[key] > 0
        if exists:
            # A mapping being sent from stays valid when the file is unlinked; recycling it
            # into the pool could let a new save overwrite bytes still in flight.
            store.discard(cid, recycle=not busy)
        return exists

    def _on_status(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        if "iteration" not in b:
            self._reply_ok(rid, msg, self.status())
            return
        key = (msg.session, b["iteration"], b["owner_rank"])
        with self._lock:
            rec = self._repls.get(key)
            terminal = rec is not None and rec.state() != "replicating"
        if b.get("wait_ms") and rec is not None and not terminal:
            self._add_waiter(key, _Waiter(rid, msg, time.monotonic() + b["wait_ms"] / 1000, "status"))
            return
        self._answer_replication(rid, msg, "status", key)

    def _replication_wire(self, key: Key) -> Dict[str, Any]:
        with self._lock:
            rec = self._repls.get(key)
            if rec is not None:
                return rec.to_wire()
        store = self.stores.get(key[0])
        if store is not None and store.header_path(CheckpointId(key[1], key[2], key[0])).exists():
            return {"state": "local"}
        return {"state": "unknown"}

    def _answer_replication(self, rid: bytes, request: Message, kind: str, key: Key) -> None:
        wire = self._replication_wire(key)
        if kind == "commit":
            self._reply_ok(rid, request, {"stored": True, "replication": wire})
        else:
            self._reply_ok(rid, request, {"replication": wire})

    def _add_waiter(self, key: Key, w: _Waiter) -> None:
        self._waiters.setdefault(key, []).append(w)
        heapq.heappush(self._waiter_heap, (w.deadline, w.seq, key))

    def _wake_waiters(self, key: Key) -> None:
        for w in self._waiters.pop(key, ()):
            self._answer_replication(w.rid, w.request, w.kind, key)

    # ---- COMMIT + push replication ------------------------------------------------------------

    def _on_commit(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        session, it, owner = msg.session, b["iteration"], b["owner_rank"]
        key = (session, it, owner)
        cid = CheckpointId(it, owner, session)
        store = self.stores.get(session)
        raw = self.stores.raw_header(store, cid) if store is not None else None
        if raw is None:
            raise _TransferError(
                ErrorCode.NOT_FOUND,
                f"{cid.stem()} of session {session!r} is not published in this node's store "
                f"{self.stores.root}; publish it (header written) before COMMIT, and make sure the "
                "trainer and this daemon use the same store root",
            )
        digest = header_digest(raw)
        if digest != bytes(b["header_digest"]):
            raise _TransferError(
                ErrorCode.CHECKSUM_MISMATCH,
                f"the committed header digest does not match the published header of {cid.stem()} "
                "(it was re-published since?); commit the digest of the current header file",
            )
        try:
            header = CheckpointHeader.unpack(raw, source=str(store.header_path(cid)))
        except CheckpointingException as e:
            raise _TransferError(ErrorCode.CHECKSUM_MISMATCH, str(e)) from None
        if header.world_size != b["world_size"]:
            raise _TransferError(ErrorCode.MALFORMED, f"COMMIT says world size {b['world_size']}, the header "
                                 f"{header.world_size}")
        try:
            holders = holder_nodes(header)
        except ReplicationError as e:
            raise _TransferError(ErrorCode.MALFORMED, f"the header's replication parameters "
                                 f"{header.replication} are unusable: {e}") from None
        if self.node_id in holders:
            self.event(logging.WARNING, "own_node_is_holder", session=session, iteration=it, owner=owner,
                       reason="this daemon's --node-id is a holder of a checkpoint committed to it: node ids "
                       "and ranks_per_node disagree")
            holders = tuple(n for n in holders if n != self.node_id)
        rec = self._start_replication(key, digest, header, holders, msg.sender)
        with self._lock:
            terminal = rec.state() != "replicating"
        if b.get("wait_ms") and not terminal:
            self._add_waiter(key, _Waiter(rid, msg, time.monotonic() + b["wait_ms"] / 1000, "commit"))
            return
        self._answer_replication(rid, msg, "commit", key)

    def _start_replication(self, key: Key, digest: bytes, header: CheckpointHeader, holders: Tuple[int, ...],
                           committer: str) -> _Replication:
        with self._lock:
            rec = self._repls.get(key)
            if rec is not None and rec.digest == digest and not rec.cancelled:
                failed = [n for n, v in rec.nodes.items() if v == "failed"]
                if not failed:
                    return rec  # in progress or done: a repeated COMMIT only reports
                for n in failed:
                    rec.nodes[n] = "pending"
                    rec.errors.pop(n, None)
                rec.finished = None
                rec.generation += 1
                targets = failed
            else:
                if rec is not None:
                    rec.cancelled = True  # superseded by a new save of the same id
                rec = _Replication(key, digest, header.world_size, header.data_nbytes, holders,
                                   nodes={n: "pending" for n in holders})
                if not holders:
                    rec.finished = rec.started
                self._repls[key] = rec
                targets = list(holders)
                self._prune_records()
            for n in targets:
                self._pusher(n).submit(rec, n)
        self.event(logging.INFO, "commit", peer=committer, session=key[0], iteration=key[1], owner=key[2],
                   holders=list(holders), retry=bool(rec.generation) or None)
        return rec

    def _prune_records(self) -> None:
        if len(self._repls) <= 10000:
            return
        done = sorted((r.finished, k) for k, r in self._repls.items() if r.finished is not None)
        for _, k in done[: len(self._repls) - 10000]:
            self._repls.pop(k, None)

    def _pusher(self, node: int) -> "_PeerPusher":
        p = self._pushers.get(node)
        if p is None:
            p = self._pushers[node] = _PeerPusher(self, node)
            p.thread.start()
        return p

    def _push_done(self, rec: _Replication, node: int, generation: int, ok: bool, error: str, nbytes: int,
                   seconds: float) -> None:
        """Called by a pusher thread when one holder node is done (either way)."""
        with self._lock:
            if rec.generation != generation or rec.nodes.get(node) != "pending":
                return
            rec.nodes[node] = "ok" if ok else "failed"
            if not ok:
                rec.errors[node] = error
            rec.bytes_out += nbytes
            finished = rec.state() != "replicating"
            if finished:
                rec.finished = time.monotonic()
            self._stats["replications_ok" if ok else "replications_failed"] += 1
            self._stats["bytes_out"] += nbytes
        self.metrics.replications.labels("ok" if ok else "failed").inc()
        self.metrics.bytes.labels("out").inc(nbytes)
        if ok:
            self.metrics.seconds.observe(seconds)
        session, it, owner = rec.key
        self.event(logging.INFO if ok else logging.WARNING, "replicated" if ok else "replication_failed",
                   peer=f"node-{node}", session=session, iteration=it, owner=owner, bytes=nbytes,
                   seconds=round(seconds, 4), reason=None if ok else error)
        if finished:
            self._post(functools.partial(self._wake_waiters, rec.key))
            self._retention_due.set()

    # ---- receiving replicas (router thread) ---------------------------------------------------

    def _remember_aborted(self, rid: bytes, req_id: int, code: Optional[ErrorCode], text: str) -> None:
        """Transfers that ended (code None: stored / already held) or were refused: their late
        chunks are dropped silently and their END answered with the same outcome."""
        self._aborted[(rid, req_id)] = (code, text)
        while len(self._aborted) > 1024:
            self._aborted.popitem(last=False)

    def _on_begin(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        key = (msg.session, b["iteration"], b["owner_rank"])
        cid = CheckpointId(key[1], key[2], key[0])
        try:
            if b["chunk_bytes"] > min(self.limits.max_frame_bytes, self.config.credit_bytes) and b["total_bytes"]:
                raise _TransferError(ErrorCode.LIMIT_EXCEEDED, f"chunk_bytes {b['chunk_bytes']} exceeds this "
                                     f"daemon's frame limit / credit window "
                                     f"({min(self.limits.max_frame_bytes, self.config.credit_bytes)} bytes)")
            store = self.stores.get(msg.session, create=True)
            existing = self.stores.raw_header(store, cid)
            digest = b.get("header_digest")
            if existing is not None and digest is not None and header_digest(existing) == bytes(digest):
                self._remember_aborted(rid, msg.req_id, None, "already held")
                self._reply_ok(rid, msg, {"stored": True, "already": True})
                return
            old = self._inbound.pop(key, None)
            if old is not None:
                old.abort()
                self.event(logging.INFO, "transfer_superseded", peer=old.peer, session=key[0], iteration=key[1],
                           owner=key[2], reason=f"a new REPLICATE_BEGIN from {msg.sender}")
            # Admission counts all announced bytes, but the reservation only holds what the
            # sender may have sent (one credit window beyond what was granted): a sender that
            # goes silent after BEGIN does not keep other replicas out until --inbound-timeout.
            self._inbound[key] = _Inbound(self.stores, store, key, b, peer=msg.sender, rid=rid, req_id=msg.req_id,
                                          window=self.config.credit_bytes, budget=self.config.memory_budget,
                                          header_frame=msg.frames[0] if msg.frames else None)
        except StoreFullError as e:
            self._remember_aborted(rid, msg.req_id, ErrorCode.STORE_FULL, str(e))
            raise
        except _TransferError as e:
            self._remember_aborted(rid, msg.req_id, e.code, e.text)
            raise

    def _transfer_for(self, rid: bytes, msg: Message) -> Optional[_Inbound]:
        key = (msg.session, msg.body["iteration"], msg.body["owner_rank"])
        t = self._inbound.get(key)
        if t is not None and t.rid == rid and t.req_id == msg.req_id:
            return t
        return None

    def _on_chunk(self, rid: bytes, label: str, msg: Message) -> None:
        t = self._transfer_for(rid, msg)
        if t is None:
            if (rid, msg.req_id) in self._aborted:
                return  # refused or finished earlier: its reason was sent once
            text = ("no transfer in progress for this chunk (the receiver restarted, timed the transfer "
                    "out, or a newer REPLICATE_BEGIN replaced it); send REPLICATE_BEGIN again")
            self._remember_aborted(rid, msg.req_id, ErrorCode.NOT_FOUND, text)
            raise _TransferError(ErrorCode.NOT_FOUND, text, retryable=True)
        hold = self.config.faults.get("hold_inbound_after_chunks")
        if hold is not None and t.next_index >= hold:
            t.last_activity = time.monotonic()  # fault: stop consuming, keep the transfer open
            return
        try:
            grant = t.consumed(t.write(msg.body, msg.frames[0]))
        except _TransferError as e:
            self._abort_inbound(t, e.text)
            self._remember_aborted(rid, msg.req_id, e.code, e.text)
            raise
        except StoreFullError as e:  # the reservation could not grow
            self._abort_inbound(t, str(e))
            self._remember_aborted(rid, msg.req_id, ErrorCode.STORE_FULL, str(e))
            raise
        if grant:
            self._send(rid, msg.reply(MessageType.CREDIT, sender=self.name, body={"bytes": grant}))

    def _abort_inbound(self, t: _Inbound, reason: str) -> None:
        if self._inbound.get(t.key) is t:
            del self._inbound[t.key]
        t.abort()
        self.event(logging.WARNING, "transfer_aborted", peer=t.peer, session=t.key[0], iteration=t.key[1],
                   owner=t.key[2], received=t.received, total=t.total, reason=reason)

    def _on_end(self, rid: bytes, label: str, msg: Message) -> None:
        t = self._transfer_for(rid, msg)
        if t is None:
            prior = self._aborted.get((rid, msg.req_id))
            if prior is not None and prior[0] is None:  # stored, or already held
                self._reply_ok(rid, msg, {"stored": True})
                return
            if prior is not None:
                raise _TransferError(prior[0], prior[1], retryable=True)
            raise _TransferError(ErrorCode.NOT_FOUND, "no transfer in progress for this REPLICATE_END; send "
                                 "REPLICATE_BEGIN again", retryable=True)
        del self._inbound[t.key]
        try:
            header, already = t.finish(msg.body, msg.frames[0])
        except _TransferError as e:
            t.abort()
            self.event(logging.WARNING, "transfer_aborted", peer=t.peer, session=t.key[0], iteration=t.key[1],
                       owner=t.key[2], reason=e.text)
            raise
        except BaseException:
            t.abort()
            raise
        self._remember_aborted(rid, msg.req_id, None, "stored")
        seconds = time.monotonic() - t.started
        with self._lock:
            self._stats["bytes_in"] += t.received
            self._stats["replicas_stored"] += 1
        self.metrics.bytes.labels("in").inc(t.received)
        self.event(logging.INFO, "replica_stored", peer=t.peer, session=t.key[0], iteration=t.key[1],
                   owner=t.key[2], bytes=t.received, seconds=round(seconds, 4), already=already or None)
        self._reply_ok(rid, msg, {"stored": True})
        self._retention_due.set()

    # ---- FETCH: serving streams (router thread) and pulling (pool) ----------------------------

    def _on_fetch(self, rid: bytes, label: str, msg: Message) -> None:
        if msg.body.get("pull"):
            self._start_pull(rid, msg)
        else:
            self._serve_fetch(rid, label, msg)

    def _serve_fetch(self, rid: bytes, label: str, msg: Message) -> None:
        b = msg.body
        key = (msg.session, b["iteration"], b["owner_rank"])
        cid = CheckpointId(key[1], key[2], key[0])
        store = self.stores.get(msg.session)
        raw = self.stores.raw_header(store, cid) if store is not None else None
        if raw is None:
            raise _TransferError(ErrorCode.NOT_FOUND, f"this node does not hold {cid.stem()} of session "
                                 f"{msg.session!r}; ask another holder (LIST)")
        header = CheckpointHeader.unpack(raw, source=str(store.header_path(cid)))
        conn = self._conns.get(rid)
        window = (conn.credit_bytes if conn and conn.credit_bytes else None) or self.config.credit_bytes
        chunk = min(b.get("max_chunk_bytes") or self.config.chunk_bytes, self.config.chunk_bytes, window,
                    (conn.max_frame_bytes if conn and conn.max_frame_bytes else None) or self.limits.max_frame_bytes,
                    self.limits.max_frame_bytes)
        old = self._streams.get((rid, msg.req_id))
        if old is not None:
            self._end_stream(old, "restarted by a repeated FETCH")
        mapping = _ReadOnlyMap(store.data_path(cid), header.data_nbytes)
        s = _OutStream(rid, msg.req_id, msg.session, key, msg.sender, mapping, raw, chunk,
                       CreditWindow(window, peer=msg.sender), msg.version)
        begin = msg.reply(MessageType.REPLICATE_BEGIN, sender=self.name, body={
            "iteration": key[1], "owner_rank": key[2], "world_size": header.world_size,
            "total_bytes": header.data_nbytes, "chunk_bytes": chunk, "num_chunks": s.num_chunks,
            "header_digest": header_digest(raw),
        }, frames=(raw,))
        if not self._send(rid, begin):
            mapping.close()
            return
        self._streams[(rid, msg.req_id)] = s
        with self._lock:
            self._busy[key] += 1
        self._pump(s)

    def _pump_streams(self) -> None:
        for s in list(self._streams.values()):
            self._pump(s)

    def _pump(self, s: _OutStream) -> None:
        while True:
            if s.pending is None:
                if s.next_index < s.num_chunks:
                    off = s.next_index * s.chunk
                    size = min(s.chunk, s.mapping.nbytes - off)
                    if s.window.available < size:
                        return
                    s.window.acquire(size, timeout_s=0)
                    view = s.mapping.view[off:off + size]
                    m = Message(type=MessageType.REPLICATE_CHUNK, session=s.session, sender=self.name,
                                req_id=s.req_id, version=s.version, frames=(view,), body={
                                    "iteration": s.key[1], "owner_rank": s.key[2], "index": s.next_index,
                                    "offset": off, "checksum": chunk_checksum(view)})
                    s.pending, s.pending_is_end = encode(m, self.auth, limits=self.limits), False
                elif not s.end_sent:
                    m = Message(type=MessageType.REPLICATE_END, session=s.session, sender=self.name,
                                req_id=s.req_id, version=s.version, frames=(s.raw_header,), body={
                                    "iteration": s.key[1], "owner_rank": s.key[2], "num_chunks": s.num_chunks,
                                    "total_bytes": s.mapping.nbytes,
                                    "header_checksum": xxhash.xxh3_64_intdigest(s.raw_header)})
                    s.pending, s.pending_is_end = encode(m, self.auth, limits=self.limits), True
                else:
                    self._end_stream(s, None)
                    return
            try:
                self._router.send_multipart([s.rid, *s.pending], flags=zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # the peer's queue is full: try again on the next loop turn
            except zmq.ZMQError as e:
                self._end_stream(s, f"peer disconnected ({e.strerror})")
                return
            s.pending = None
            s.last_progress = time.monotonic()
            if s.pending_is_end:
                s.end_sent = True
            else:
                s.next_index += 1

    def _end_stream(self, s: _OutStream, error: Optional[str]) -> None:
        if self._streams.get((s.rid, s.req_id)) is s:
            del self._streams[(s.rid, s.req_id)]
            with self._lock:
                self._busy[s.key] -= 1
                if self._busy[s.key] <= 0:
                    del self._busy[s.key]
        s.pending = None
        s.mapping.close()
        if error is None:
            with self._lock:
                self._stats["fetches_served"] += 1
                self._stats["bytes_served"] += s.mapping.nbytes
            self.metrics.fetches.inc()
            self.event(logging.INFO, "fetch_served", peer=s.peer, session=s.key[0], iteration=s.key[1],
                       owner=s.key[2], bytes=s.mapping.nbytes)
        else:
            self.event(logging.WARNING, "fetch_aborted", peer=s.peer, session=s.key[0], iteration=s.key[1],
                       owner=s.key[2], sent_chunks=s.next_index, reason=error)

    def _on_credit(self, rid: bytes, label: str, msg: Message) -> None:
        s = self._streams.get((rid, msg.req_id))
        if s is not None:
            s.window.release(msg.body["bytes"])
            s.last_progress = time.monotonic()
            self._pump(s)

    def _on_peer_error(self, rid: bytes, label: str, msg: Message) -> None:
        s = self._streams.get((rid, msg.req_id))
        if s is not None:  # the puller gives up (e.g. its store is full): stop streaming
            self._end_stream(s, f"the puller answered {msg.body.get('code')}: {msg.body.get('message', '')[:300]}")

    def _start_pull(self, rid: bytes, msg: Message) -> None:
        b = msg.body
        key = (msg.session, b["iteration"], b["owner_rank"])
        cid = CheckpointId(key[1], key[2], key[0])
        store = self.stores.get(msg.session)
        raw = self.stores.raw_header(store, cid) if store is not None else None
        if raw is not None:
            total = CheckpointHeader.unpack(raw, source=str(store.header_path(cid))).data_nbytes
            self._reply_ok(rid, msg, {"stored": True, "already": True, "source_node": self.node_id,
                                      "total_bytes": total})
            return
        task = self._pulls.get(key)
        if task is not None:
            task.waiters.append((rid, msg))  # a retried request joins the pull in progress
            return
        task = self._pulls[key] = _PullTask(key, b.get("from_node"), [(rid, msg)])
        self._pool.submit(self._pull_task, task)

    def _pull_task(self, task: _PullTask) -> None:
        session, it, owner = task.key
        try:
            if task.from_node is not None:
                candidates = [task.from_node]
            else:
                everywhere, _ = self._gather_peers(session, iteration=it, owner=owner)
                candidates = sorted({h.node for h in everywhere if h.node is not None})
            if not candidates:
                raise _TransferError(ErrorCode.NOT_FOUND, f"no reachable peer holds iteration {it} of rank {owner} "
                                     f"(session {session!r}); peers: {self.peers.nodes()}")
            errors = []
            for node in candidates:
                try:
                    result = self._pull(session, it, owner, node)
                    break
                except StoreFullError as e:  # this node's store: another holder would not help
                    raise _TransferError(ErrorCode.STORE_FULL, str(e)) from None
                except (_TransferError, ProtocolError, CheckpointingException, OSError) as e:
                    errors.append(f"node {node}: {getattr(e, 'text', None) or e}")
            else:
                code = ErrorCode.NOT_FOUND
                raise _TransferError(code, "could not pull it from any holder: " + "; ".join(errors)[:7000],
                                     retryable=True)
        except _TransferError as e:
            self._post(functools.partial(self._finish_pull, task, None, e))
            return
        except Exception as e:
            logger.exception("pull of %s failed", task.key)
            self._post(functools.partial(self._finish_pull, task, None,
                                         _TransferError(ErrorCode.INTERNAL, f"{type(e).__name__}: {e}")))
            return
        self._post(functools.partial(self._finish_pull, task, result, None))

    def _finish_pull(self, task: _PullTask, result: Optional[Dict[str, Any]], error: Optional[_TransferError]) -> None:
        self._pulls.pop(task.key, None)
        for rid, msg in task.waiters:
            if error is None:
                self._reply_ok(rid, msg, result)
            else:
                self._reply_error(rid, msg, error.code, error.text, retryable=error.retryable)

    def _pull(self, session: str, it: int, owner: int, node: int, *, rpc: Optional[Rpc] = None) -> Dict[str, Any]:
        """Bring ``(session, it, owner)`` from ``node``'s daemon into this store (any thread but
        the router). Returns the FETCH-pull result."""
        endpoint = self.peers.endpoint(node)
        if endpoint is None:
            raise _TransferError(ErrorCode.UNREACHABLE, f"node {node} has no known endpoint (add it to --peers)")
        timeout = self.config.peer_timeout_s
        own = rpc is None
        rpc = rpc or Rpc(endpoint, self.auth, sender=self.name, role="daemon", context=self.context,
                         limits=self.limits, replay_guard=self.peer_guard, hello_extra={"node": self.node_id},
                         cancel=self._stop,
                         sockopts=_DATA_SOCKOPTS)
        key = (session, it, owner)
        inbound: Optional[_Inbound] = None
        t0 = time.monotonic()
        try:
            rpc.hello(session, timeout_s=timeout, credit_bytes=self.config.credit_bytes)
            with rpc.lock:
                req_id = secrets.randbits(64)
                rpc.send(rpc.message(MessageType.FETCH, session, {
                    "iteration": it, "owner_rank": owner, "max_chunk_bytes": self.config.chunk_bytes}, req_id=req_id),
                    timeout_s=timeout)
                while True:
                    msg = rpc.await_reply(req_id, time.monotonic() + timeout)
                    if msg.type is MessageType.ERROR:
                        raise error_from_reply(msg, f"node-{node}")
                    if msg.type is MessageType.REPLICATE_BEGIN:
                        if inbound is not None:
                            inbound.abort()
                            inbound = None
                        store = self.stores.get(session, create=True)
                        try:
                            inbound = _Inbound(self.stores, store, key, msg.body, peer=f"node-{node}",
                                               window=self.config.credit_bytes, budget=self.config.memory_budget,
                                               header_frame=msg.frames[0] if msg.frames else None)
                        except StoreFullError as e:
                            self._refuse_stream(rpc, session, req_id, e)
                            raise
                        with self._lock:
                            self._pulling[key] = inbound
                    elif msg.type is MessageType.REPLICATE_CHUNK and inbound is not None:
                        try:
                            grant = inbound.consumed(inbound.write(msg.body, msg.frames[0]))
                        except StoreFullError as e:  # the reservation could not grow
                            self._refuse_stream(rpc, session, req_id, e)
                            raise
                        if grant:
                            rpc.send(rpc.message(MessageType.CREDIT, session, {"bytes": grant}, req_id=req_id),
                                     timeout_s=timeout)
                    elif msg.type is MessageType.REPLICATE_END and inbound is not None:
                        header, already = inbound.finish(msg.body, msg.frames[0])
                        nbytes = inbound.received
                        inbound = None
                        break
                    else:
                        raise _TransferError(ErrorCode.MALFORMED, f"node {node} answered FETCH with "
                                             f"{msg.type.name} out of sequence")
        except BaseException:
            if inbound is not None:
                inbound.abort()
            with self._lock:
                self._stats["pulls_failed"] += 1
            self.metrics.pulls.labels("failed").inc()
            raise
        finally:
            with self._lock:
                self._pulling.pop(key, None)
            if own:
                rpc.close()
        seconds = time.monotonic() - t0
        with self._lock:
            self._stats["pulls_ok"] += 1
            self._stats["bytes_in"] += nbytes
        self.metrics.pulls.labels("ok").inc()
        self.metrics.bytes.labels("in").inc(nbytes)
        self.event(logging.INFO, "pulled", peer=f"node-{node}", session=session, iteration=it, owner=owner,
                   bytes=nbytes, seconds=round(seconds, 4), already=already or None)
        self._retention_due.set()
        return {"stored": True, "already": already, "source_node": node, "total_bytes": header.data_nbytes}

    @staticmethod
    def _refuse_stream(rpc: Rpc, session: str, req_id: int, e: StoreFullError) -> None:
        """Tell a FETCH stream's server to stop: this store has no room for it."""
        with contextlib.suppress(ProtocolError):
            rpc.send(rpc.message(MessageType.ERROR, session, error_body(
                ErrorCode.STORE_FULL, str(e), op=int(MessageType.FETCH)), req_id=req_id), timeout_s=1.0)

    # ---- LIST across peers --------------------------------------------------------------------

    def _peer_rpc(self, node: int, endpoint: str, rpcs: Optional[Dict[int, Rpc]]) -> Tuple[Rpc, bool]:
        """An RPC channel to a peer: from ``rpcs`` (kept by the calling thread) or a fresh one
        (second value True: the caller closes it)."""
        if rpcs is not None:
            rpc = rpcs.get(node)
            if rpc is not None and rpc.endpoint == endpoint:
                return rpc, False
            if rpc is not None:
                rpc.close()
        rpc = Rpc(endpoint, self.auth, sender=self.name, role="daemon", context=self.context, limits=self.limits,
                  replay_guard=self.peer_guard, hello_extra={"node": self.node_id}, cancel=self._stop)
        if rpcs is not None:
            rpcs[node] = rpc
            return rpc, False
        return rpc, True

    def _gather_peers(self, session: str, *, iteration: Optional[int] = None, owner: Optional[int] = None,
                      rpcs: Optional[Dict[int, Rpc]] = None) -> Tuple[List[Holding], List[int]]:
        """Holdings of every peer daemon (each tagged with its node) and the unreachable ones."""
        body: Dict[str, Any] = {}
        if iteration is not None:
            body["iteration"] = iteration
        if owner is not None:
            body["owner_rank"] = owner
        out: List[Holding] = []
        unreachable: List[int] = []
        for node in self.peers.nodes():
            endpoint = self.peers.endpoint(node)
            if endpoint is None:
                unreachable.append(node)
                continue
            rpc, own = self._peer_rpc(node, endpoint, rpcs)
            try:
                reply = rpc.request(MessageType.LIST, session, body, timeout_s=min(self.config.peer_timeout_s, 5.0))
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

    def _list_everywhere_task(self, rid: bytes, msg: Message) -> None:
        try:
            local = self._filter(self.stores.holdings(msg.session), msg.body)
            others, unreachable = self._gather_peers(msg.session, iteration=msg.body.get("iteration"),
                                                     owner=msg.body.get("owner_rank"))
            result = {"holdings": [h.to_wire() for h in local + others], "unreachable": unreachable}
            self._post(lambda: self._answer_list(rid, msg, result))
        except Exception as e:
            logger.exception("LIST peers failed")
            text = f"{type(e).__name__}: {e}"  # bound now: ``e`` is unset after this block
            self._post(lambda: self._reply_error(rid, msg, ErrorCode.INTERNAL, text))

    def _answer_list(self, rid: bytes, msg: Message, result: Dict[str, Any]) -> None:
        try:
            self._reply_ok(rid, msg, result)
        except LimitExceeded:
            self._reply_error(rid, msg, ErrorCode.LIMIT_EXCEEDED, (
                f"{len(result['holdings'])} holdings across the peers do not fit one answer "
                f"({self.limits.max_header_bytes} header bytes); filter LIST by iteration or owner_rank, or "
                "let the daemon plan the recovery itself (serve --recover)"))

    # ---- timers (router thread) ---------------------------------------------------------------

    def _timers(self, now: float) -> None:
        for t in list(self._inbound.values()):
            if now - t.last_activity > self.config.inbound_timeout_s:
                self._abort_inbound(t, f"no data for {self.config.inbound_timeout_s:g} s: the sender stopped "
                                    "or disappeared mid-transfer")
        for s in list(self._streams.values()):
            if now - s.last_progress > self.config.peer_timeout_s:
                self._end_stream(s, f"no credit for {self.config.peer_timeout_s:g} s: the puller stopped reading")

    def _expire_waiters(self, now: float) -> None:
        """Long-polls whose wait is over get the current state."""
        while self._waiter_heap and self._waiter_heap[0][0] <= now:
            deadline, wid, key = heapq.heappop(self._waiter_heap)
            waiting = self._waiters.get(key, [])
            for w in [w for w in waiting if w.seq == wid]:
                waiting.remove(w)
                self._answer_replication(w.rid, w.request, w.kind, key)
            if not waiting:
                self._waiters.pop(key, None)

    # ---- status -------------------------------------------------------------------------------

    def _refresh_usage(self) -> Dict[str, Dict[str, int]]:
        usage = self.stores.usage()
        held = 0
        for s in usage:
            store = self.stores.get(s)
            if store is not None:
                held += len(store.list())
        self._cached_usage = (sum(u["total_bytes"] for u in usage.values()), held)
        return usage

    def _peers_up(self) -> int:
        with self._lock:
            return sum(1 for p in self._peer_state.values() if p.get("reachable"))

    def status(self) -> Dict[str, Any]:
        """The STATUS result (plain msgpack values)."""
        usage = self._refresh_usage()
        sessions = []
        for s, u in sorted(usage.items()):
            store = self.stores.get(s)
            sessions.append({"session": s, "checkpoints": len(store.list()) if store else 0,
                             "data_bytes": u["data_bytes"], "free_pool_bytes": u["free_pool_bytes"]})
        now = time.monotonic()
        fs: Dict[str, int] = {}
        with contextlib.suppress(OSError):
            st = os.statvfs(self.stores.root)
            fs = {"fs_total_bytes": st.f_blocks * st.f_frsize, "fs_free_bytes": st.f_bavail * st.f_frsize}
        nodes = self.peers.nodes()
        endpoints = {n: self.peers.endpoint(n) or "" for n in nodes}
        with self._lock:
            peers = []
            for node in sorted(set(nodes) | set(self._peer_state)):
                st = self._peer_state.get(node, {})
                last = st.get("last_ok")
                peers.append({"node": node, "endpoint": endpoints.get(node, ""), "reachable": st.get("reachable"),
                              "last_seen_s": None if last is None else round(now - last, 3),
                              "error": st.get("error")})
            in_flight = [{"session": k[0], "iteration": k[1], "owner": k[2], **r.to_wire()}
                         for k, r in self._repls.items() if r.state() == "replicating"]
            failed = sum(1 for r in self._repls.values() if r.state() == "failed")
            counters = dict(self._stats)
            recovery = dict(self._recovery)
            pulls_in = [t.describe("pull") for t in self._pulling.values()]
        out = {
            "node_id": self.node_id,
            "version": _version(),
            "protocol_version": PROTOCOL_VERSION,
            "endpoint": self.endpoint,
            "pid": os.getpid(),
            "uptime_s": round(now - self._t0, 3),
            "started_at": format_time_ns(self.started_ns),
            "store": {"root": str(self.stores.root), "total_bytes": self._cached_usage[0], **fs,
                      "checkpoints": self._cached_usage[1], "memory_budget": self.config.memory_budget,
                      "keep_last": self.config.keep_last, "sessions": sessions},
            "peers": peers,
            "replicating": in_flight[:1000],
            "replications_failed": failed,
            "inbound": ([t.describe("push") for t in self._inbound.values()] + pulls_in)[:1000],
            "serving": [{"session": s.key[0], "iteration": s.key[1], "owner": s.key[2], "peer": s.peer,
                         "sent_chunks": s.next_index, "num_chunks": s.num_chunks}
                        for s in self._streams.values()][:1000],
            "pulling": [{"session": k[0], "iteration": k[1], "owner": k[2]} for k in self._pulls][:1000],
            "counters": counters,
            "rejected": self.rejects.snapshot(),
        }
        if recovery:
            out["recovery"] = recovery
        return out

    # ---- maintenance thread -------------------------------------------------------------------

    def _maintenance_main(self) -> None:
        rpcs: Dict[int, Rpc] = {}
        next_ping = 0.0
        last_retention = 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                if now >= next_ping:
                    self._ping_peers(rpcs)
                    with contextlib.suppress(Exception):
                        self._refresh_usage()
                    next_ping = time.monotonic() + self.config.ping_interval_s
                    continue
                due = self._retention_due.is_set()
                if due and not self.config.keep_last:
                    self._retention_due.clear()  # retention is off: nothing will ever clear it
                    due = False
                if due and now - last_retention >= 0.5:
                    self._retention_due.clear()
                    last_retention = now
                    try:
                        self._retention_pass(rpcs)
                    except Exception:
                        logger.exception("retention pass failed")
                    continue
                until_ping = max(0.01, next_ping - now)
                if due:  # at most one pass per 0.5 s: sleep until the next one is allowed
                    self._stop.wait(max(0.01, min(until_ping, 0.5 - (now - last_retention))))
                else:
                    self._retention_due.wait(until_ping)
        finally:
            for r in rpcs.values():
                r.close()

    def _ping_peers(self, rpcs: Dict[int, Rpc]) -> None:
        with contextlib.suppress(Exception):
            self.peers.refresh()
        for node in self.peers.nodes():
            if self._stop.is_set():
                return
            endpoint = self.peers.endpoint(node)
            if endpoint is None:
                continue
            rpc, _ = self._peer_rpc(node, endpoint, rpcs)
            sessions = sorted(self.config.sessions) if self.config.sessions else self.stores.sessions()
            try:
                rpc.hello(sessions[0] if sessions else "-", timeout_s=min(2.0, self.config.peer_timeout_s))
                ok, err = True, None
            except ClockSkewError as e:  # up, but nothing will work until the clocks agree
                ok, err = True, str(e)[:300]
            except DaemonError:  # an authenticated answer (e.g. it serves other sessions): it is up
                ok, err = True, None
            except (ProtocolError, CheckpointingException) as e:
                ok, err = False, str(e)[:300]
                rpc.reset()
            with self._lock:
                st = self._peer_state.setdefault(node, {})
                was = st.get("reachable")
                st["reachable"] = ok
                st["error"] = err
                if ok:
                    st["last_ok"] = time.monotonic()
            if was is not None and was != ok:
                self.event(logging.INFO if ok else logging.WARNING, "peer_up" if ok else "peer_down",
                           peer=f"node-{node}", endpoint=endpoint, reason=err)

    def _retention_pass(self, rpcs: Dict[int, Rpc]) -> None:
        """Keep the newest ``keep_last`` complete iterations per session (complete: every rank's
        checkpoint held by some reachable daemon), and everything newer; never the newest
        complete one, never an id being sent. Unreachable peers only make it keep more."""
        keep = self.config.keep_last
        for session in self.stores.sessions():
            local = self.stores.holdings(session)
            if not local:
                continue
            others, _ = self._gather_peers(session, rpcs=rpcs)
            complete = complete_iterations(local + others)
            if not complete:
                continue
            threshold = min(complete[:keep])
            store = self.stores.get(session)
            for h in local:
                if h.iteration >= threshold:
                    continue
                key = (session, h.iteration, h.owner)
                with self._lock:
                    if self._busy[key] > 0 or (key in self._repls and self._repls[key].state() == "replicating"):
                        self._retention_due.set()  # try again later
                        continue
                    self._repls.pop(key, None)
                store.discard(CheckpointId(h.iteration, h.owner, session))
                self.event(logging.INFO, "retired", session=session, iteration=h.iteration, owner=h.owner,
                           reason=f"older than the {keep} newest complete iterations {complete[:keep]}")
        with self._lock:
            self._stats["retention_passes"] += 1

    # ---- recovery -----------------------------------------------------------------------------

    def _recover_main(self, session: str) -> None:
        t0 = time.monotonic()
        deadline = t0 + self.config.recover_timeout_s
        with self._lock:
            self._recovery = {"session": session, "state": "running"}
        self.event(logging.INFO, "recovery_started", session=session)
        rpcs: Dict[int, Rpc] = {}
        last_error = ""
        try:
            while not self._stop.is_set():
                with contextlib.suppress(Exception):
                    self.peers.refresh()  # discovery: peers may register after this daemon
                if not self.peers.nodes() and not self.config.discover:
                    self._set_recovery("failed", session, t0, error="no peers to recover from: start the daemon "
                                       "with --peers (or --discover) naming the other nodes' daemons")
                    return
                everywhere, unreachable = self._gather_peers(session, rpcs=rpcs)
                local = self.stores.holdings(session)
                plan = None
                try:
                    plan = plan_recovery(everywhere + local, self.node_id,
                                         held_locally=[(h.iteration, h.owner) for h in local])
                except ReplicationError as e:
                    last_error = str(e)
                if plan is None and not last_error:
                    if self.peers.nodes() and not unreachable:
                        self._set_recovery("nothing", session, t0, note="no complete iteration on any peer: "
                                           "nothing to restore (a fresh job)")
                        return
                    last_error = f"no complete iteration among reachable peers (unreachable: {unreachable})"
                if plan is not None:
                    failed = self._carry_out(plan, session)
                    if not failed:
                        self._set_recovery("done", session, t0, iteration=plan.iteration, owners=list(plan.owners))
                        return
                    last_error = "; ".join(failed)
                if time.monotonic() >= deadline:
                    break
                self._stop.wait(0.5)
            self._set_recovery("failed", session, t0, error=last_error or "stopped")
        except Exception as e:
            logger.exception("recovery failed")
            self._set_recovery("failed", session, t0, error=f"{type(e).__name__}: {e}")
        finally:
            for r in rpcs.values():
                r.close()

    def _carry_out(self, plan, session: str) -> List[str]:
        failed = []
        for owner, nodes in plan.sources:
            errors = []
            for node in nodes:
                try:
                    self._pull(session, plan.iteration, owner, node)
                    break
                except (_TransferError, ProtocolError, CheckpointingException, OSError) as e:
                    errors.append(f"node {node}: {getattr(e, 'text', None) or e}")
            else:
                failed.append(f"rank {owner}: " + ", ".join(errors))
        return failed

    def _set_recovery(self, state: str, session: str, t0: float, **extra: Any) -> None:
        rec = {"session": session, "state": state, "seconds": round(time.monotonic() - t0, 3), **extra}
        with self._lock:
            self._recovery = rec
        self.event(logging.INFO if state != "failed" else logging.ERROR, f"recovery_{state}",
                   **{k: v for k, v in rec.items() if k != "state"})


# --------------------------------------------------------------------------- pushers


class _PeerPusher:
    """Pushes committed checkpoints to one holder node's daemon, one at a time, over its own
    DEALER (thread ``rc-daemon-push-<node>``). Bytes in flight are bounded by the receiver's
    credit window; every wait has a deadline; a lost connection (socket monitor) or an ERROR
    ends the attempt, which is retried ``retries`` times with back-off."""

    def __init__(self, daemon: Daemon, node: int):
        self.d = daemon
        self.node = node
        self.label = f"node-{node}"
        self.queue: "queue.Queue[Tuple[_Replication, int]]" = queue.Queue()
        self.thread = threading.Thread(target=self._main, name=f"rc-daemon-push-{node}", daemon=True)
        self._rpc: Optional[Rpc] = None
        self._monitor: Optional[zmq.Socket] = None
        self._stop = threading.Event()

    def submit(self, rec: _Replication, node: int) -> None:
        self.queue.put((rec, rec.generation))

    def stop(self) -> None:
        self._stop.set()

    def _main(self) -> None:
        try:
            while not self._stop.is_set() and not self.d._stop.is_set():
                try:
                    rec, generation = self.queue.get(timeout=0.25)
                except queue.Empty:
                    continue
                self._handle(rec, generation)
        finally:
            self._disconnect()

    def _handle(self, rec: _Replication, generation: int) -> None:
        cfg = self.d.config
        t0 = time.monotonic()
        error = ""
        with self.d._lock:
            self.d._busy[rec.key] += 1
        try:
            for attempt in range(cfg.retries + 1):
                if rec.cancelled or rec.generation != generation or self.d._stop.is_set():
                    error = "cancelled (dropped or superseded)"
                    break
                try:
                    nbytes = self._transfer(rec)
                    self.d._push_done(rec, self.node, generation, True, "", nbytes, time.monotonic() - t0)
                    return
                except _PushFailed as e:
                    error = str(e)
                    self._disconnect()
                    if not e.retryable:
                        break
                except (ProtocolError, CheckpointingException, OSError) as e:
                    error = f"{type(e).__name__}: {e}"
                    self._disconnect()
                if attempt < cfg.retries:
                    self.d.event(logging.INFO, "replication_retry", peer=self.label, session=rec.key[0],
                                 iteration=rec.key[1], owner=rec.key[2], attempt=attempt + 1, reason=error)
                    if self._stop.wait(min(2.0, 0.2 * 2 ** attempt)):
                        break
            self.d._push_done(rec, self.node, generation, False, error or "stopped", 0, time.monotonic() - t0)
        except Exception as e:  # a bug: report it on the record instead of killing the thread
            logger.exception("pusher to node %d failed", self.node)
            self.d._push_done(rec, self.node, generation, False, f"internal error: {e}", 0, time.monotonic() - t0)
        finally:
            with self.d._lock:
                self.d._busy[rec.key] -= 1
                if self.d._busy[rec.key] <= 0:
                    del self.d._busy[rec.key]

    # -- connection --------------------------------------------------------------------------

    def _connect(self, session: str) -> Rpc:
        endpoint = self.d.peers.endpoint(self.node)
        if endpoint is None:
            raise _PushFailed(f"node {self.node} has no known endpoint: add it to --peers (or register it in "
                              "the discovery store)")
        if self._rpc is not None and self._rpc.endpoint == endpoint and not self._drain_monitor():
            return self._rpc
        self._disconnect()
        rpc = Rpc(endpoint, self.d.auth, sender=self.d.name, role="daemon", context=self.d.context,
                  limits=self.d.limits, replay_guard=self.d.peer_guard, hello_extra={"node": self.d.node_id},
                  cancel=self.d._stop,
                  sockopts=_DATA_SOCKOPTS)
        self._monitor = rpc.socket.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECTED)
        self._rpc = rpc
        try:
            rpc.hello(session, timeout_s=self.d.config.peer_timeout_s)
        except PeerTimeout as e:
            raise _PushFailed(f"node {self.node} ({endpoint}) does not answer HELLO within "
                              f"{self.d.config.peer_timeout_s:g} s (daemon down or wrong secret)") from e
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

    def _transfer(self, rec: _Replication) -> int:
        d, cfg = self.d, self.d.config
        session, it, owner = rec.key
        cid = CheckpointId(it, owner, session)
        store = d.stores.get(session)
        raw = d.stores.raw_header(store, cid) if store is not None else None
        if raw is None:
            raise _PushFailed(f"{cid.stem()} was removed from this node's store before it was replicated",
                              retryable=False)
        if header_digest(raw) != rec.digest:
            raise _PushFailed(f"{cid.stem()} was re-published since the COMMIT", retryable=False)
        rpc = self._connect(session)
        hello = rpc.peer_hello
        window_bytes = int(hello.get("credit_bytes") or cfg.credit_bytes)
        max_frame = int(hello.get("max_frame_bytes") or d.limits.max_frame_bytes)
        chunk = max(1, min(cfg.chunk_bytes, window_bytes, max_frame, d.limits.max_frame_bytes))
        total = rec.total_bytes
        n = -(-total // chunk) if total else 0
        window = CreditWindow(window_bytes, peer=self.label)
        req_id = secrets.randbits(64)
        timeout = cfg.peer_timeout_s
        outcome: Dict[str, Any] = {}
        mapping = _ReadOnlyMap(store.data_path(cid), total)
        sent = 0

        def out(mtype: MessageType, body: Dict[str, Any], frames: Sequence[Any] = ()) -> None:
            try:
                rpc.send(rpc.message(mtype, session, body, req_id=req_id, frames=frames), timeout_s=timeout)
            except PeerTimeout as e:
                raise _PushFailed(f"node {self.node} did not take {mtype.name} within {timeout:g} s "
                                  "(connection down or peer not reading)") from e

        try:
            out(MessageType.REPLICATE_BEGIN, {
                "iteration": it, "owner_rank": owner, "world_size": rec.world_size, "total_bytes": total,
                "chunk_bytes": chunk, "num_chunks": n, "header_digest": rec.digest}, (raw,))
            hold = cfg.faults.get("hold_outbound_after_chunks")
            for i in range(n):
                if rec.cancelled:
                    raise _PushFailed("cancelled (dropped or superseded)", retryable=False)
                if hold is not None and i >= hold:
                    while not (rec.cancelled or self._stop.is_set() or d._stop.is_set()):
                        time.sleep(0.05)  # fault: a sender stuck mid-transfer
                    raise _PushFailed("stopped while held by a fault point", retryable=False)
                off = i * chunk
                size = min(chunk, total - off)
                self._pump(rpc, req_id, window, outcome, need=size, deadline=time.monotonic() + timeout)
                if outcome.get("already"):
                    return 0
                window.acquire(size, timeout_s=0)
                view = mapping.view[off:off + size]
                out(MessageType.REPLICATE_CHUNK, {"iteration": it, "owner_rank": owner, "index": i, "offset": off,
                                                  "checksum": chunk_checksum(view)}, (view,))
                sent += size
            out(MessageType.REPLICATE_END, {"iteration": it, "owner_rank": owner, "num_chunks": n,
                                            "total_bytes": total, "header_checksum": xxhash.xxh3_64_intdigest(raw)},
                (raw,))
            self._pump(rpc, req_id, window, outcome, need=None, deadline=time.monotonic() + timeout)
            return 0 if outcome.get("already") else sent
        finally:
            mapping.close()

    def _pump(self, rpc: Rpc, req_id: int, window: CreditWindow, outcome: Dict[str, Any], *,
              need: Optional[int], deadline: float) -> None:
        """Read answers until ``need`` bytes of credit are available (or, with need=None, until
        the END is answered); raises _PushFailed on ERROR, lost connection or deadline."""
        d = self.d
        sock = rpc.socket
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        if self._monitor is not None:
            poller.register(self._monitor, zmq.POLLIN)
        while True:
            if outcome.get("already") or (need is None and outcome.get("stored")):
                return
            if self._drain_monitor():
                raise _PushFailed(f"connection to node {self.node} lost mid-transfer (its daemon died or "
                                  "the network dropped)")
            if self._stop.is_set() or d._stop.is_set():
                raise _PushFailed("this daemon is stopping", retryable=False)
            waiting = need is None or window.available < need
            if not waiting and not sock.poll(0, zmq.POLLIN):
                return  # enough credit; an early answer (ERROR) would be read here, none is queued
            remaining = deadline - time.monotonic()
            if waiting and remaining <= 0:
                what = (f"no credit for {need} bytes ({window.in_flight} bytes unacknowledged)" if need is not None
                        else "no answer to REPLICATE_END")
                raise _PushFailed(f"node {self.node}: {what} within {d.config.peer_timeout_s:g} s: the peer "
                                  "stopped reading or is overloaded")
            events = dict(poller.poll(min(250, max(1, int(remaining * 1000))) if waiting else 0))
            if sock not in events:
                continue
            msg = self._recv(rpc)
            if msg is None or msg.req_id != req_id:
                continue
            if msg.type is MessageType.CREDIT:
                window.release(msg.body["bytes"])
            elif msg.type is MessageType.ERROR:
                code = ErrorCode.of(msg.body.get("code", ""))
                raise _PushFailed(f"node {self.node} refused: {code.value}: {msg.body.get('message', '')}",
                                  retryable=code not in (ErrorCode.STORE_FULL, ErrorCode.LIMIT_EXCEEDED,
                                                         ErrorCode.WRONG_SESSION, ErrorCode.MALFORMED), code=code)
            elif msg.type is MessageType.OK:
                op = msg.body.get("op")
                result = msg.body.get("result") or {}
                if op == MessageType.REPLICATE_BEGIN and result.get("already"):
                    outcome["already"] = True
                elif op == MessageType.REPLICATE_END:
                    outcome["stored"] = True

    def _recv(self, rpc: Rpc) -> Optional[Message]:
        from .wire.protocol import recv

        try:
            return recv(rpc.socket, self.d.auth, timeout_ms=100, expected_session=None, replay_guard=self.d.peer_guard,
                        limits=self.d.limits, counters=self.d.rejects)
        except PeerTimeout:
            return None
        except ProtocolError as e:
            self.d._log_reject(e, self.label)
            return None


# --------------------------------------------------------------------------- command line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt serve",
        description="Run this node's checkpoint daemon: stores, replicates and serves in-memory checkpoints.",
    )
    p.add_argument("--store-root", default=DEFAULT_ROOT,
                   help="tmpfs directory of this node's store (default %(default)s)")
    p.add_argument("--bind", default=DEFAULT_BIND, help="ZeroMQ endpoint to listen on, tcp://HOST:PORT (default "
                   "%(default)s; use the cluster interface's address)")
    p.add_argument("--node-id", type=int, default=int(os.environ.get("GROUP_RANK", os.environ.get("NODE_RANK", 0))),
                   help="this node's index: ranks r with r // ranks_per_node == N live here (default $NODE_RANK or 0)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--peers", type=parse_peers, default={}, help="the other daemons: 0=tcp://h:p,1=tcp://h:p or a file "
                   "with one 'ID ENDPOINT' per line")
    g.add_argument("--discover", metavar="HOST:PORT", help="register in and look peers up from a torch.distributed "
                   "TCPStore (key resilient_ckpt/daemon/<node-id>)")
    p.add_argument("--discover-master", action="store_true", help="host the --discover TCPStore in this daemon")
    p.add_argument("--advertise", help="endpoint peers should use for this daemon (default: the bound one)")
    p.add_argument("--session", action="append", dest="sessions", metavar="NAME",
                   help="serve only these sessions (repeatable; default: any); others are rejected and counted")
    p.add_argument("--secret-file", help="the job's secret (else $RESILIENT_CKPT_SECRET_FILE / $RESILIENT_CKPT_SECRET)")
    p.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port")
    p.add_argument("--metrics-addr", default="0.0.0.0", help="address of the metrics server (default %(default)s)")
    p.add_argument("--memory-budget", type=parse_bytes, help="bytes this store may hold (K/M/G/T suffixes); replicas "
                   "that do not fit are refused with STORE_FULL")
    p.add_argument("--keep-last", type=int, default=2,
                   help="complete iterations kept per session (default %(default)s; "
                   "0 = no retention by the daemon)")
    p.add_argument("--recover", metavar="SESSION", help="at start, pull this node's ranks of SESSION's newest complete "
                   "iteration from the peers (a replacement node, before its trainers start)")
    p.add_argument("--recover-timeout", type=float, default=300.0, help="seconds to keep trying (default %(default)s)")
    p.add_argument("--chunk-bytes", type=parse_bytes, default=DEFAULT_CHUNK_BYTES, help="replication chunk size "
                   "(default 4M: small enough that each chunk is hashed and copied while in cache)")
    p.add_argument("--credit-bytes", type=parse_bytes, default=DEFAULT_CREDIT_BYTES, help="bytes a peer may have in "
                   "flight to this daemon (default 64M)")
    p.add_argument("--peer-timeout", type=float, default=30.0, help="seconds before a silent peer fails a transfer "
                   "(default %(default)s)")
    p.add_argument("--inbound-timeout", type=float, default=60.0, help="seconds before a stalled incoming transfer "
                   "is dropped (default %(default)s)")
    p.add_argument("--retries", type=int, default=3, help="retries of a failed replication (default %(default)s)")
    p.add_argument("--ping-interval", type=float, default=5.0, help="seconds between peer liveness checks")
    p.add_argument("--orphan-grace", type=float, default=300.0, help="headerless data younger than this many seconds "
                   "is a save in progress, not an orphan (default %(default)s)")
    p.add_argument("--log-format", choices=("text", "json"), default="text", help="json: one object per event")
    p.add_argument("--log-level", default="INFO", choices=("DEBUG", "INFO", "WARNING", "ERROR"))
    return p


def config_from_args(args: argparse.Namespace) -> DaemonConfig:
    return DaemonConfig(
        store_root=args.store_root,
        bind=args.bind,
        node_id=args.node_id,
        peers=args.peers or {},
        discover=args.discover,
        discover_master=args.discover_master,
        advertise=args.advertise,
        sessions=frozenset(args.sessions) if args.sessions else None,
        memory_budget=args.memory_budget,
        keep_last=args.keep_last or None,
        recover=args.recover,
        recover_timeout_s=args.recover_timeout,
        chunk_bytes=args.chunk_bytes,
        credit_bytes=args.credit_bytes,
        peer_timeout_s=args.peer_timeout,
        inbound_timeout_s=args.inbound_timeout,
        retries=args.retries,
        ping_interval_s=args.ping_interval,
        orphan_grace_s=args.orphan_grace,
        metrics_port=args.metrics_port,
        metrics_addr=args.metrics_addr,
        faults=parse_faults(os.environ.get(FAULTS_ENV)),
    )


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``resilient-ckpt serve``: run until SIGTERM/SIGINT. Exit 2 on a configuration error."""
    parser = build_parser()
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    setup_logging(args.log_format, getattr(logging, args.log_level))
    # Every import (torch) is done: move those objects out of the cyclic GC's sight, or each
    # full collection walks millions of them while holding the GIL (measured: ~5% of the
    # receiving thread's time during replication).
    gc.collect()
    gc.freeze()
    try:
        if args.sessions:
            bad = [s for s in args.sessions if not valid_session_name(s)]
            if bad:
                raise ProtocolConfigError(f"invalid session names {bad}", fix="use plain names without '/'")
        config = config_from_args(args)
        auth = authenticator_from_env(args.secret_file)
        daemon = Daemon(config, auth).start()
    except (CheckpointingException, ValueError) as e:
        logger.error("cannot start: %s", e, extra={"event": "start_failed", "fields": {"reason": str(e)}})
        return 2
    done = threading.Event()

    def _on_signal(signum, frame):
        done.set()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    while not done.wait(1.0):
        if not daemon.alive:  # the router thread died (a bug, logged): let the supervisor restart us
            logger.error("the daemon stopped serving; exiting", extra={"event": "crashed", "fields": {}})
            daemon.stop(timeout=5)
            return 1
    daemon.event(logging.INFO, "stopping")
    daemon.stop()
    return 0


__all__ = [
    "DEFAULT_BIND",
    "Daemon",
    "DaemonConfig",
    "JsonFormatter",
    "build_parser",
    "config_from_args",
    "holder_nodes",
    "main",
    "parse_bytes",
    "parse_faults",
    "parse_peers",
    "setup_logging",
    "valid_session_name",
]

if __name__ == "__main__":
    sys.exit(main())
