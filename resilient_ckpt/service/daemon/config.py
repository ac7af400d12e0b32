"""What ``resilient-ckpt serve`` is configured with: :class:`DaemonConfig`, its defaults, the
parsers of its command-line values (byte sizes, peer lists, fault points, session names), and
its log: one event name plus fields per line (``--log-format json``: one JSON object per line),
rate-limited where a flood of bad input could flood the log."""

from __future__ import annotations

import argparse
import collections.abc
import json
import logging
import os
import re
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Dict, FrozenSet, List, Mapping, Optional, Tuple

import zmq

from ...memory.store import DEFAULT_ROOT
from ..wire import DEFAULT_LIMITS, Limits, ProtocolConfigError

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
DATA_SOCKOPTS = {zmq.SNDBUF: SOCKET_BUFFER_BYTES, zmq.RCVBUF: SOCKET_BUFFER_BYTES}
FAULTS_ENV = "RESILIENT_CKPT_DAEMON_FAULTS"
#: Fault points a test (or chaos drill) can arm through $RESILIENT_CKPT_DAEMON_FAULTS.
FAULT_NAMES = frozenset({"hold_inbound_after_chunks", "hold_outbound_after_chunks"})
DISCOVERY_PREFIX = "resilient_ckpt/daemon/"


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
                raise ProtocolConfigError(
                    f"{name} must be >= 1", fix=f"pass a positive --{name.replace('_', '-')}"
                )
        if self.chunk_bytes > self.limits.max_frame_bytes:
            raise ProtocolConfigError(
                f"chunk_bytes {self.chunk_bytes} exceeds the frame limit {self.limits.max_frame_bytes}",
                fix="lower --chunk-bytes",
            )
        if self.keep_last is not None and self.keep_last < 1:
            raise ProtocolConfigError(
                f"keep_last {self.keep_last} must be >= 1", fix="pass --keep-last 1 or more"
            )
        if self.memory_budget is not None and self.memory_budget < 0:
            raise ProtocolConfigError("memory budget must be >= 0", fix="pass --memory-budget 64G")
        unknown = set(self.faults) - FAULT_NAMES
        if unknown:
            raise ProtocolConfigError(
                f"unknown fault points {sorted(unknown)}", fix=f"use {sorted(FAULT_NAMES)}"
            )
        for n, ep in self.peers.items():
            _check_endpoint(ep, f"peer {n}")
        _check_endpoint(self.bind, "--bind")


def _check_endpoint(ep: str, what: str) -> None:
    if not isinstance(ep, str) or not re.match(r"^(tcp|ipc|inproc)://\S+$", ep):
        raise ProtocolConfigError(
            f"{what} endpoint {ep!r} is not a ZeroMQ endpoint", fix="use tcp://HOST:PORT"
        )


# --------------------------------------------------------------------------- value parsers

_SUFFIXES = {
    "": 1,
    "B": 1,
    "K": 1 << 10,
    "KB": 1 << 10,
    "KIB": 1 << 10,
    "M": 1 << 20,
    "MB": 1 << 20,
    "MIB": 1 << 20,
    "G": 1 << 30,
    "GB": 1 << 30,
    "GIB": 1 << 30,
    "T": 1 << 40,
    "TB": 1 << 40,
    "TIB": 1 << 40,
}


def parse_bytes(text: str) -> int:
    """``"512M"`` → 536870912. Binary units (K = 1024); accepts K/M/G/T with optional (i)B."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
    if not m or m.group(2).upper() not in _SUFFIXES:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte size; use e.g. 1073741824, 512M, 64G")
    return int(float(m.group(1)) * _SUFFIXES[m.group(2).upper()])


def parse_peers(spec: str) -> Dict[int, str]:
    """``"0=tcp://h:p,1=tcp://h:p"`` or a file with one ``id endpoint`` per line (# comments)."""
    if "=" not in spec and os.path.exists(spec):
        entries = _peer_entries_from_file(spec)
    else:
        entries = _peer_entries_from_list(spec)
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


#: (node id text, endpoint, where it was read: for error messages)
_PeerEntry = Tuple[str, str, str]


def _peer_entries_from_file(path: str) -> List[_PeerEntry]:
    entries = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            parts = line.split()
            if len(parts) != 2:
                raise argparse.ArgumentTypeError(f"{path}:{lineno}: expected 'ID ENDPOINT', got {line!r}")
            entries.append((parts[0], parts[1], f"{path}:{lineno}"))
    return entries


def _peer_entries_from_list(spec: str) -> List[_PeerEntry]:
    entries = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        if "=" not in item:
            raise argparse.ArgumentTypeError(
                f"peer {item!r} is not ID=ENDPOINT; use 0=tcp://host:port,1=tcp://host:port or a file path"
            )
        a, b = item.split("=", 1)
        entries.append((a.strip(), b.strip(), repr(item)))
    return entries


def parse_faults(text: Optional[str]) -> Dict[str, int]:
    out: Dict[str, int] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        name, _, value = item.partition("=")
        if name not in FAULT_NAMES or not value.isdigit():
            raise ProtocolConfigError(
                f"{FAULTS_ENV} entry {item!r} is invalid",
                fix=f"use NAME=INT with NAME in {sorted(FAULT_NAMES)}",
            )
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


class SessionFilter(collections.abc.Collection):
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

logger = logging.getLogger("resilient_ckpt.daemon")


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


def log_event(level: int, event: str, node: int, **fields: Any) -> None:
    """Log ``event`` with its fields (None-valued ones left out) and this daemon's node id."""
    fields = {k: v for k, v in fields.items() if v is not None}
    fields.setdefault("node", node)
    text = " ".join(f"{k}={v}" for k, v in fields.items())
    logger.log(level, "%s %s", event, text, extra={"event": event, "fields": fields})


class RateLimit:
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
