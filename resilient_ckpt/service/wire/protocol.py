"""Wire protocol of the per-node checkpoint service (layer 7).

A message on the wire is one ZeroMQ multipart message::

    [header, data_0, ..., data_{n-1}, tag]

* ``header`` — a msgpack map: the *envelope* (version, type, session, sender, req_id, nonce,
  timestamp) and the type's *body* (a map of plain msgpack values, schema below).
* ``data_i`` — raw tensor bytes, sent zero-copy (``send_multipart(copy=False)``).
* ``tag`` — authentication tag (:mod:`.auth`) over the header, every data frame and their
  lengths, checked before the header is even unpacked.

Decoding checks, in this order and each before anything is allocated or parsed: frame count,
frame sizes, tag, header msgpack (with Unpacker limits), envelope, version, type, session,
body schema, replay window. Anything wrong raises a :class:`ProtocolError` subclass and
nothing else. docs/protocol.md is the specification for implementers of a compatible peer.

Socket types: the daemon binds one ``ROUTER`` (peers and local trainers connect to it); each
client (trainer or peer daemon pushing replicas) connects a ``DEALER``. ROUTER because one
daemon serves many peers concurrently and must address replies to a specific one; DEALER
because a client pipelines many requests (chunks, fetches) without REQ/REP's lock-step, which
would also wedge forever on one lost reply. :func:`configure_socket` sets the options that make
failures explicit (ROUTER_MANDATORY, IMMEDIATE, MAXMSGSIZE, LINGER=0, heartbeats).
"""

from __future__ import annotations

import enum
import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Collection, Mapping, Optional, Sequence, Tuple, Union

import msgpack
import xxhash
import zmq

from ...errors import CheckpointingException

if TYPE_CHECKING:  # pragma: no cover - typing only (auth imports this module)
    from .auth import Authenticator, RejectCounters, ReplayGuard

# --------------------------------------------------------------------------- versions

#: The version this build speaks by default (highest supported).
PROTOCOL_VERSION = 1
#: Oldest version this build still accepts.
MIN_PROTOCOL_VERSION = 1
SUPPORTED_VERSIONS = range(MIN_PROTOCOL_VERSION, PROTOCOL_VERSION + 1)

# --------------------------------------------------------------------------- limits

MAX_HEADER_BYTES = 64 * 1024
MAX_FRAME_BYTES = 64 * 1024 * 1024
#: Data frames per message (header and tag not counted).
MAX_FRAMES = 16
#: Header + data frames of one message (the tag is a fixed 33 bytes on top).
MAX_MESSAGE_BYTES = 256 * 1024 * 1024
#: Nesting depth of free-form maps/lists inside a body (msgpack's own C stack allows 1024,
#: Python recursion 1000: we stop far earlier).
MAX_NESTING = 16
NONCE_BYTES = 16

_U64 = (1 << 64) - 1
_I64 = (1 << 63) - 1
_MAX_RANK = (1 << 31) - 1


class ErrorCode(str, enum.Enum):
    """Machine-readable ``code`` of an ERROR message body."""

    MALFORMED = "MALFORMED"
    UNSUPPORTED_VERSION = "UNSUPPORTED_VERSION"
    UNKNOWN_TYPE = "UNKNOWN_TYPE"
    LIMIT_EXCEEDED = "LIMIT_EXCEEDED"
    AUTH_FAILED = "AUTH_FAILED"
    REPLAYED = "REPLAYED"
    CLOCK_SKEW = "CLOCK_SKEW"
    WRONG_SESSION = "WRONG_SESSION"
    TIMEOUT = "TIMEOUT"
    UNREACHABLE = "UNREACHABLE"
    BAD_CONFIG = "BAD_CONFIG"
    NOT_FOUND = "NOT_FOUND"
    STORE_FULL = "STORE_FULL"
    CHECKSUM_MISMATCH = "CHECKSUM_MISMATCH"
    BUSY = "BUSY"
    INTERNAL = "INTERNAL"

    @classmethod
    def of(cls, code: str) -> "ErrorCode":
        """The code of a received ERROR; codes from newer peers read as INTERNAL."""
        try:
            return cls(code)
        except ValueError:
            return cls.INTERNAL


# --------------------------------------------------------------------------- errors


class ProtocolError(CheckpointingException):
    """A message could not be sent, received or accepted.

    ``peer`` names the other side when known, ``fix`` says what to do about it, ``reason`` is
    the key under which :class:`~.auth.RejectCounters` counts it and ``code`` the ERROR code a
    daemon replies with.
    """

    reason = "protocol"
    code = ErrorCode.INTERNAL

    def __init__(self, what: str, *, peer: Optional[str] = None, fix: Optional[str] = None):
        self.what = what
        self.peer = peer
        self.fix = fix
        text = f"peer {peer}: {what}" if peer else what
        if fix:
            text = f"{text}. Fix: {fix}"
        super().__init__(text)

    def __reduce__(self):  # keep peer/fix across pickling (multi-process harness, executors)
        return (_rebuild_error, (type(self), self.what, self.peer, self.fix))


def _rebuild_error(cls, what, peer, fix):
    return cls(what, peer=peer, fix=fix)


class MalformedMessage(ProtocolError):
    """Frames, header or body do not follow the wire format (names the type and field)."""

    reason = "malformed"
    code = ErrorCode.MALFORMED


class UnsupportedVersion(ProtocolError):
    """The peer speaks a protocol version outside this node's supported range."""

    reason = "version"
    code = ErrorCode.UNSUPPORTED_VERSION


class UnknownMessageType(ProtocolError):
    """The type code is not defined in the message's protocol version."""

    reason = "unknown_type"
    code = ErrorCode.UNKNOWN_TYPE


class LimitExceeded(ProtocolError):
    """A header, frame, frame count or total size is over the configured limit."""

    reason = "limit"
    code = ErrorCode.LIMIT_EXCEEDED


class AuthenticationError(ProtocolError):
    """The tag does not verify: wrong secret, tampered frame, or a different tag scheme."""

    reason = "auth"
    code = ErrorCode.AUTH_FAILED


class ReplayedMessage(ProtocolError):
    """The message's nonce was already accepted within the replay window."""

    reason = "replay"
    code = ErrorCode.REPLAYED


class StaleMessage(ReplayedMessage):
    """The timestamp is outside the replay window (clock skew or a delayed replay).

    ``skew_s``: the message's timestamp minus the receiver's clock, when known. The ERROR
    answering it says CLOCK_SKEW: for a sender whose tag verifies, a skewed clock is by far
    the likelier cause (an old replay gets the same answer and learns nothing from it).
    """

    reason = "stale"
    code = ErrorCode.CLOCK_SKEW
    skew_s: Optional[float] = None


class PredatesStart(ReplayedMessage):
    """The timestamp is older than the receiving daemon's start: a replay of a message that an
    earlier incarnation of the daemon may have accepted (its nonces died with it), or a
    message encoded before the restart. ``not_before_ns`` is the start (receiver's clock)."""

    reason = "predates_start"
    not_before_ns: Optional[int] = None
    skew_s: Optional[float] = None


class WrongSession(ProtocolError):
    """The message belongs to another job session than the one this endpoint serves."""

    reason = "session"
    code = ErrorCode.WRONG_SESSION


class PeerTimeout(ProtocolError, TimeoutError):
    """Nothing arrived, or no send/credit became possible, before the deadline."""

    reason = "timeout"
    code = ErrorCode.TIMEOUT


class PeerUnreachable(ProtocolError):
    """The peer is not connected (ROUTER_MANDATORY) or its flow-control window was closed."""

    reason = "unreachable"
    code = ErrorCode.UNREACHABLE


class ProtocolConfigError(ProtocolError, ValueError):
    """A local configuration is unusable: limits, secret, socket type, credit window size."""

    reason = "config"
    code = ErrorCode.BAD_CONFIG


# --------------------------------------------------------------------------- message types


class MessageType(enum.IntEnum):
    """Type codes on the wire. Codes are never reused; 1-3 mean the same in every version."""

    HELLO = 1
    HELLO_OK = 2
    ERROR = 3
    OK = 4
    COMMIT = 5
    REPLICATE_BEGIN = 6
    REPLICATE_CHUNK = 7
    REPLICATE_END = 8
    FETCH = 9
    LIST = 10
    DROP = 11
    STATUS = 12
    CREDIT = 13


#: Types whose envelope and body are readable whatever the envelope version says, so two
#: builds with disjoint version ranges can still say hello and tell each other why not.
VERSION_INDEPENDENT_TYPES = frozenset({MessageType.HELLO, MessageType.HELLO_OK, MessageType.ERROR})

#: Which type codes exist in which version.
TYPES_BY_VERSION: Mapping[int, frozenset] = {1: frozenset(MessageType)}


def negotiate_version(
    peer_min: int,
    peer_max: int,
    *,
    peer: Optional[str] = None,
    supported: range = SUPPORTED_VERSIONS,
) -> int:
    """Highest version both sides support (the HELLO_OK ``version``); UnsupportedVersion if none."""
    low, high = max(peer_min, supported.start), min(peer_max, supported.stop - 1)
    if low > high:
        raise UnsupportedVersion(
            f"no common protocol version: peer supports {peer_min}..{peer_max}, this node "
            f"{supported.start}..{supported.stop - 1}",
            peer=peer,
            fix="install the same resilient-ckpt release on every node and trainer of the job",
        )
    return high


# --------------------------------------------------------------------------- body schemas
# A dozen lines of declarative schema instead of a dependency (msgspec, pydantic): bodies are
# a few flat maps, and the checks must run before any object is built from untrusted input.


@dataclass(frozen=True)
class Field:
    """One body field: ``kind`` is int|bool|float|str|bytes|map|list|record.

    ``lo``/``hi`` bound the value of an int and the length of a str, bytes or list. ``items``
    is a list's element field, ``record`` a nested schema, ``choices`` the allowed values.
    ``map`` is a free-form map of plain msgpack values with str keys.
    """

    kind: str
    required: bool = True
    lo: Optional[int] = None
    hi: Optional[int] = None
    items: Optional["Field"] = None
    record: Optional["BodySchema"] = None
    choices: Optional[frozenset] = None

    def describe(self) -> str:
        if self.choices is not None:
            return f"{self.kind} in {sorted(self.choices)}"
        if self.kind == "int":
            return f"int in [{self.lo}, {self.hi}]"
        if self.kind in ("str", "bytes"):
            return f"{self.kind} of length {self.lo}..{self.hi}"
        if self.kind == "list":
            inner = self.items.describe() if self.items else "plain value"
            return f"list of {self.lo}..{self.hi} × {inner}"
        if self.kind == "record":
            return f"map with fields {sorted(self.record.fields)}"
        return self.kind


@dataclass(frozen=True)
class BodySchema:
    """Fields of a body, how many data frames the message carries, cross-field rules."""

    fields: Mapping[str, Field]
    frames: Tuple[int, int] = (0, 0)
    allow_extra: bool = False  # HELLO/ERROR: later versions may add fields
    rules: Tuple[Tuple[Callable[[Mapping[str, Any]], bool], str], ...] = ()


def _int(lo: int = 0, hi: int = _I64, *, required: bool = True) -> Field:
    return Field("int", required, lo, hi)


def _str(lo: int = 1, hi: int = 256, *, required: bool = True, choices=None) -> Field:
    return Field("str", required, lo, hi, choices=frozenset(choices) if choices else None)


def _bytes(lo: int = 0, hi: int = MAX_HEADER_BYTES, *, required: bool = True) -> Field:
    return Field("bytes", required, lo, hi)


def _bool(*, required: bool = True) -> Field:
    return Field("bool", required)


def _map(*, required: bool = True) -> Field:
    return Field("map", required)


def _list(items: Field, lo: int = 0, hi: int = 4096, *, required: bool = True) -> Field:
    return Field("list", required, lo, hi, items=items)


def _record(schema: BodySchema, *, required: bool = True) -> Field:
    return Field("record", required, record=schema)


ROLES = frozenset({"daemon", "client"})


def _rank_below_world(body: Mapping[str, Any]) -> bool:
    return body["owner_rank"] < body["world_size"]


def _chunk_plan_consistent(body: Mapping[str, Any]) -> bool:
    total, chunk, n = body["total_bytes"], body["chunk_bytes"], body["num_chunks"]
    return n == -(-total // chunk)


_RANK_RULE = (_rank_below_world, "owner_rank must be < world_size")

CHECKPOINT_ID = BodySchema({"iteration": _int(), "owner_rank": _int(hi=_MAX_RANK)})

HOLDING = BodySchema(
    {
        "iteration": _int(),
        "owner_rank": _int(hi=_MAX_RANK),
        "world_size": _int(1, _MAX_RANK),
        "total_bytes": _int(),
        "header_digest": _bytes(8, 64, required=False),
        "replica": _bool(required=False),
        # Daemon extensions: which node holds it (LIST with peers=true) and the job's ranks per
        # node (from the store header), so a replacement node knows which owners are its own.
        "node": _int(hi=_MAX_RANK, required=False),
        "ranks_per_node": _int(1, _MAX_RANK, required=False),
    },
    rules=(_RANK_RULE,),
)

#: Replication state of one checkpoint id, as the daemon reports it (COMMIT, STATUS).
REPLICATION_STATES = frozenset({"unknown", "local", "replicating", "replicated", "failed"})
REPLICATION = BodySchema(
    {
        "state": _str(choices=REPLICATION_STATES),
        "holders": _list(_int(hi=_MAX_RANK), 0, 4096, required=False),  # holder node ids
        "acked": _list(_int(hi=_MAX_RANK), 0, 4096, required=False),  # nodes that stored it
        "bytes_out": _int(required=False),
        "seconds": Field("float", required=False),
        "error": _str(0, 8192, required=False),
        "failed_node": _int(hi=_MAX_RANK, required=False),
    }
)

#: How long a daemon may hold an answer (COMMIT / STATUS ``wait_ms``): at most a day.
_MAX_WAIT_MS = 86_400_000


def _id_query_consistent(body: Mapping[str, Any]) -> bool:
    has_it, has_owner = "iteration" in body, "owner_rank" in body
    return has_it == has_owner and ("wait_ms" not in body or has_it)

#: Body schema of every message type (request side; OK results are in RESULT_SCHEMAS).
SCHEMAS: Mapping[MessageType, BodySchema] = {
    MessageType.HELLO: BodySchema(
        {
            "min_version": _int(1, 0xFFFF),
            "max_version": _int(1, 0xFFFF),
            "role": _str(choices=ROLES),
            "rank": _int(hi=_MAX_RANK, required=False),
            "max_frame_bytes": _int(1, _I64, required=False),
            "credit_bytes": _int(1, _I64, required=False),
        },
        allow_extra=True,
        rules=((lambda b: b["min_version"] <= b["max_version"], "min_version must be <= max_version"),),
    ),
    MessageType.HELLO_OK: BodySchema(
        {
            "version": _int(1, 0xFFFF),
            "role": _str(choices=ROLES),
            "max_frame_bytes": _int(1, _I64, required=False),
            "credit_bytes": _int(1, _I64, required=False),
        },
        allow_extra=True,
    ),
    MessageType.ERROR: BodySchema(
        {
            "code": _str(1, 64),
            "message": _str(0, 8192),
            "op": _int(1, 0xFFFF, required=False),
            "retryable": _bool(required=False),
        },
        allow_extra=True,
    ),
    MessageType.OK: BodySchema({"op": _int(1, 0xFFFF), "result": _map(required=False)}),
    MessageType.COMMIT: BodySchema(
        {
            "iteration": _int(),
            "owner_rank": _int(hi=_MAX_RANK),
            "world_size": _int(1, _MAX_RANK),
            "header_digest": _bytes(8, 64),
            "total_bytes": _int(required=False),
            # Daemon extension: answer once replication finished or after this many ms.
            "wait_ms": _int(0, _MAX_WAIT_MS, required=False),
        },
        rules=(_RANK_RULE,),
    ),
    MessageType.REPLICATE_BEGIN: BodySchema(
        {
            "iteration": _int(),
            "owner_rank": _int(hi=_MAX_RANK),
            "world_size": _int(1, _MAX_RANK),
            "total_bytes": _int(),
            "chunk_bytes": _int(1, _I64),
            "num_chunks": _int(0, 0xFFFFFFFF),
            "header_digest": _bytes(8, 64, required=False),
        },
        rules=(
            _RANK_RULE,
            (_chunk_plan_consistent, "num_chunks must equal ceil(total_bytes / chunk_bytes)"),
        ),
        # Optional: the store header (the one END carries) up front, so the receiver can refuse
        # early and verify tensor checksums while each chunk is still in cache.
        frames=(0, 1),
    ),
    MessageType.REPLICATE_CHUNK: BodySchema(
        {
            "iteration": _int(),
            "owner_rank": _int(hi=_MAX_RANK),
            "index": _int(0, 0xFFFFFFFF),
            "offset": _int(),
            "checksum": _int(0, _U64),
        },
        frames=(1, 1),
    ),
    MessageType.REPLICATE_END: BodySchema(
        {
            "iteration": _int(),
            "owner_rank": _int(hi=_MAX_RANK),
            "num_chunks": _int(0, 0xFFFFFFFF),
            "total_bytes": _int(),
            "header_checksum": _int(0, _U64),
        },
        frames=(1, 1),  # the store's checkpoint header bytes
    ),
    MessageType.FETCH: BodySchema(
        {
            "iteration": _int(),
            "owner_rank": _int(hi=_MAX_RANK),
            "max_chunk_bytes": _int(1, _I64, required=False),
            # Daemon extensions: ``pull`` asks the daemon to bring the id into its own store
            # (from ``from_node``, else any holder among its peers) instead of streaming it.
            "pull": _bool(required=False),
            "from_node": _int(hi=_MAX_RANK, required=False),
        }
    ),
    MessageType.LIST: BodySchema(
        {
            "iteration": _int(required=False),
            "owner_rank": _int(hi=_MAX_RANK, required=False),
            # Daemon extension: also the holdings of every peer daemon (each with ``node``).
            "peers": _bool(required=False),
        }
    ),
    MessageType.DROP: BodySchema({"ids": _list(_record(CHECKPOINT_ID), 1, 4096)}),
    MessageType.STATUS: BodySchema(
        {
            # Daemon extension: the replication state of one id, optionally waiting for it.
            "iteration": _int(required=False),
            "owner_rank": _int(hi=_MAX_RANK, required=False),
            "wait_ms": _int(0, _MAX_WAIT_MS, required=False),
        },
        rules=((_id_query_consistent, "iteration and owner_rank go together; wait_ms needs both"),),
    ),
    MessageType.CREDIT: BodySchema({"bytes": _int(1, _I64)}),
}

#: Schema of OK ``result`` by the op it answers; ops not listed carry a free-form plain map.
RESULT_SCHEMAS: Mapping[MessageType, BodySchema] = {
    MessageType.LIST: BodySchema(
        {
            "holdings": _list(_record(HOLDING), 0, 65536),
            "unreachable": _list(_int(hi=_MAX_RANK), 0, 4096, required=False),  # peers=true
        }
    ),
    MessageType.DROP: BodySchema({"dropped": _int(0, 1 << 32)}),
    MessageType.COMMIT: BodySchema({"stored": _bool(), "replication": _record(REPLICATION, required=False)}),
    MessageType.REPLICATE_END: BodySchema({"stored": _bool()}),
    # The receiver already holds this exact checkpoint: the sender skips the chunks.
    MessageType.REPLICATE_BEGIN: BodySchema({"stored": _bool(), "already": _bool(required=False)}),
    # FETCH with pull=true: the id is now in the answering daemon's store.
    MessageType.FETCH: BodySchema(
        {
            "stored": _bool(),
            "already": _bool(required=False),
            "source_node": _int(hi=_MAX_RANK, required=False),
            "total_bytes": _int(required=False),
        }
    ),
}


class _Violation(Exception):
    """Internal: a body value does not match its schema (turned into MalformedMessage)."""

    def __init__(self, path: str, problem: str):
        self.path, self.problem = path, problem


def _type_name(value: Any) -> str:
    return type(value).__name__


def _check_plain(value: Any, path: str, depth: int) -> None:
    if depth > MAX_NESTING:
        raise _Violation(path, f"nested deeper than {MAX_NESTING} levels")
    if isinstance(value, int) and not isinstance(value, bool):
        if not -(1 << 63) <= value <= _U64:
            raise _Violation(path, f"int {value} does not fit msgpack (-2**63..2**64-1)")
        return
    if value is None or isinstance(value, (bool, float, str, bytes)):
        return
    if isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{path}[{i}]", depth + 1)
        return
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, str):
                raise _Violation(path, f"map key {k!r} is {_type_name(k)}, keys must be str")
            _check_plain(v, f"{path}.{k}", depth + 1)
        return
    raise _Violation(path, f"{_type_name(value)} is not a plain msgpack value")


def _check_value(value: Any, spec: Field, path: str, depth: int) -> None:
    kind = spec.kind
    if kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif kind == "str":
        ok = isinstance(value, str)
    elif kind == "bytes":
        ok = isinstance(value, (bytes, bytearray, memoryview))
    elif kind in ("map", "record"):
        ok = isinstance(value, dict)
    elif kind == "list":
        ok = isinstance(value, (list, tuple))
    else:  # pragma: no cover - schema bug
        raise AssertionError(kind)
    if not ok:
        raise _Violation(path, f"expected {spec.describe()}, got {_type_name(value)}")
    if spec.choices is not None and value not in spec.choices:
        raise _Violation(path, f"expected one of {sorted(spec.choices)}, got {value!r}")
    if kind == "int" and not (spec.lo <= value <= spec.hi):
        raise _Violation(path, f"{value} is outside [{spec.lo}, {spec.hi}]")
    if kind in ("str", "bytes", "list"):
        n = memoryview(value).nbytes if isinstance(value, memoryview) else len(value)
        if not (spec.lo <= n <= spec.hi):
            raise _Violation(path, f"length {n} is outside [{spec.lo}, {spec.hi}]")
    if kind == "map":
        _check_plain(value, path, depth)
    elif kind == "record":
        _check_body(value, spec.record, path, depth + 1)
    elif kind == "list":
        for i, item in enumerate(value):
            _check_value(item, spec.items, f"{path}[{i}]", depth + 1)


def _check_body(body: Mapping[str, Any], schema: BodySchema, prefix: str, depth: int) -> None:
    if depth > MAX_NESTING:
        raise _Violation(prefix or "body", f"nested deeper than {MAX_NESTING} levels")
    for name, spec in schema.fields.items():
        path = f"{prefix}.{name}" if prefix else name
        if name not in body:
            if spec.required:
                raise _Violation(path, f"required field is missing (expected {spec.describe()})")
            continue
        _check_value(body[name], spec, path, depth)
    for name, value in body.items():
        if name in schema.fields:
            continue
        path = f"{prefix}.{name}" if prefix else str(name)
        if not isinstance(name, str):
            raise _Violation(path, f"field name is {_type_name(name)}, must be str")
        if not schema.allow_extra:
            raise _Violation(path, f"unknown field (this version knows {sorted(schema.fields)})")
        _check_plain(value, path, depth + 1)
    for rule, text in schema.rules:
        if not rule(body):
            raise _Violation(prefix or "body", text)


def validate_body(
    mtype: MessageType,
    body: Mapping[str, Any],
    nframes: int,
    *,
    peer: Optional[str] = None,
    outgoing: bool = False,
) -> None:
    """Check ``body`` and the data-frame count against the type's schema (MalformedMessage)."""
    schema = SCHEMAS[mtype]
    where = f"refusing to send {mtype.name}" if outgoing else f"{mtype.name} message"
    fix = (
        "build the body as docs/protocol.md specifies for this type"
        if outgoing
        else "the sender does not follow this protocol version; run the same resilient-ckpt "
        "release on both sides"
    )
    if not isinstance(body, dict):
        raise MalformedMessage(f"{where}: body is {_type_name(body)}, must be a map", peer=peer, fix=fix)
    try:
        _check_body(body, schema, "", 0)
        if mtype is MessageType.OK:
            op = body["op"]
            try:
                op_type = MessageType(op)
            except ValueError:
                raise _Violation("op", f"{op} is not a message type code") from None
            if "result" in body:
                result_schema = RESULT_SCHEMAS.get(op_type)
                if result_schema is not None:
                    _check_body(body["result"], result_schema, "result", 1)
    except _Violation as v:
        raise MalformedMessage(f"{where}: body field {v.path!r}: {v.problem}", peer=peer, fix=fix) from None
    lo, hi = schema.frames
    if not lo <= nframes <= hi:
        want = str(lo) if lo == hi else f"{lo}..{hi}"
        raise MalformedMessage(
            f"{where}: carries {nframes} data frame(s), this type carries {want}", peer=peer, fix=fix
        )


# --------------------------------------------------------------------------- limits


@dataclass(frozen=True)
class Limits:
    """Size limits enforced before anything is allocated, hashed or unpacked."""

    max_header_bytes: int = MAX_HEADER_BYTES
    max_frame_bytes: int = MAX_FRAME_BYTES
    max_frames: int = MAX_FRAMES
    max_message_bytes: int = MAX_MESSAGE_BYTES

    def __post_init__(self) -> None:
        for name in ("max_header_bytes", "max_frame_bytes", "max_frames", "max_message_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ProtocolConfigError(
                    f"Limits.{name} = {value!r} is not a positive int", fix=f"pass {name}=<positive int>"
                )
        if self.max_header_bytes < 256:
            raise ProtocolConfigError(
                f"Limits.max_header_bytes = {self.max_header_bytes} cannot hold an envelope",
                fix="use at least 256 bytes (default 64 KiB)",
            )


DEFAULT_LIMITS = Limits()


# --------------------------------------------------------------------------- message


def _new_nonce() -> bytes:
    return os.urandom(NONCE_BYTES)


Buffer = Union[bytes, bytearray, memoryview, "zmq.Frame"]


@dataclass(frozen=True)
class Message:
    """One protocol message. Build a new one for every send: each gets a fresh nonce.

    ``body`` holds plain msgpack values (treat it as read-only); ``frames`` are buffers sent
    zero-copy (bytes, memoryview, zmq.Frame, anything exporting the buffer protocol). A decoded
    message's frames are read-only memoryviews over the received zmq frames (no copy).
    """

    type: MessageType
    session: str
    sender: str
    req_id: int = 0
    body: Mapping[str, Any] = field(default_factory=dict, hash=False)
    frames: Tuple[Buffer, ...] = field(default=(), compare=False, hash=False)
    version: int = PROTOCOL_VERSION
    nonce: bytes = field(default_factory=_new_nonce)
    timestamp_ns: int = field(default_factory=time.time_ns)

    def __post_init__(self) -> None:
        if not isinstance(self.type, MessageType):
            try:
                object.__setattr__(self, "type", MessageType(self.type))
            except ValueError:
                raise UnknownMessageType(
                    f"{self.type!r} is not a message type code",
                    fix=f"use a MessageType member ({', '.join(t.name for t in MessageType)})",
                ) from None
        if not isinstance(self.frames, tuple):
            object.__setattr__(self, "frames", tuple(self.frames))

    @property
    def data_bytes(self) -> int:
        """Total bytes of the data frames (what a CreditWindow accounts)."""
        return sum(_byte_view(f, i, None).nbytes for i, f in enumerate(self.frames))

    def reply(
        self,
        type: MessageType,
        *,
        sender: str,
        body: Optional[Mapping[str, Any]] = None,
        frames: Sequence[Buffer] = (),
    ) -> "Message":
        """A new message answering this one: same session, req_id and version, fresh nonce."""
        return Message(
            type=type,
            session=self.session,
            sender=sender,
            req_id=self.req_id,
            body=dict(body or {}),
            frames=tuple(frames),
            version=self.version,
        )

    def __repr__(self) -> str:
        sizes = ", ".join(str(_safe_nbytes(f)) for f in self.frames)
        return (
            f"Message({self.type.name}, session={self.session!r}, sender={self.sender!r}, "
            f"req_id={self.req_id}, v{self.version}, body={self.body!r}, frames=[{sizes}] bytes)"
        )


def _safe_nbytes(buf: Any) -> Any:
    try:
        return _byte_view(buf, 0, None).nbytes
    except ProtocolError:
        return "?"


def error_body(exc_or_code: Union[ProtocolError, ErrorCode, str], message: str = "", **extra: Any) -> dict:
    """Body of an ERROR reply for a ProtocolError (its code and text) or an explicit code."""
    if isinstance(exc_or_code, ProtocolError):
        code, text = exc_or_code.code, message or str(exc_or_code)
    else:
        code, text = exc_or_code, message
    code = code.value if isinstance(code, ErrorCode) else str(code)
    return {"code": code, "message": text[:8192], **extra}


def chunk_checksum(data: Buffer) -> int:
    """The per-chunk checksum REPLICATE_CHUNK carries: xxh3_64 of the chunk bytes."""
    return xxhash.xxh3_64_intdigest(_byte_view(data, 0, None))


def _byte_view(buf: Any, index: int, peer: Optional[str]) -> memoryview:
    """A flat unsigned-byte view of ``buf`` without copying it."""
    if isinstance(buf, zmq.Frame):
        view = buf.buffer
    else:
        try:
            view = memoryview(buf)
        except TypeError:
            raise MalformedMessage(
                f"frame {index} is a {_type_name(buf)}, not a buffer",
                peer=peer,
                fix="pass bytes, memoryview, zmq.Frame or an object exporting the buffer protocol",
            ) from None
    if view.format != "B" or view.ndim != 1:
        try:
            view = view.cast("B")
        except TypeError:
            raise MalformedMessage(
                f"frame {index} is not C-contiguous", peer=peer, fix="send a contiguous copy"
            ) from None
    return view


# --------------------------------------------------------------------------- encode / decode

_ENVELOPE_KEYS = frozenset({"version", "type", "session", "sender", "req_id", "nonce", "ts", "body"})


def _check_count(nframes: int, limits: Limits, peer: Optional[str], outgoing: bool) -> None:
    if nframes > limits.max_frames:
        raise LimitExceeded(
            f"{'refusing to send' if outgoing else 'rejected'}: {nframes} data frames exceed "
            f"max_frames={limits.max_frames}",
            peer=peer,
            fix="split the payload over several messages, or raise Limits.max_frames on both sides",
        )


def _check_sizes(
    nbytes: Sequence[int], header_len: int, limits: Limits, peer: Optional[str], outgoing: bool
) -> None:
    verb = "refusing to send" if outgoing else "rejected"
    _check_count(len(nbytes), limits, peer, outgoing)
    if header_len > limits.max_header_bytes:
        raise LimitExceeded(
            f"{verb}: header of {header_len} bytes exceeds max_header_bytes={limits.max_header_bytes}",
            peer=peer,
            fix="move bulk data into data frames, or raise Limits.max_header_bytes on both sides",
        )
    total = header_len
    for i, n in enumerate(nbytes):
        if n > limits.max_frame_bytes:
            raise LimitExceeded(
                f"{verb}: data frame {i} of {n} bytes exceeds max_frame_bytes={limits.max_frame_bytes}",
                peer=peer,
                fix="send smaller chunks (the receiver's HELLO_OK max_frame_bytes), or raise "
                "Limits.max_frame_bytes on the receiver",
            )
        total += n
    if total > limits.max_message_bytes:
        raise LimitExceeded(
            f"{verb}: message of {total} bytes exceeds max_message_bytes={limits.max_message_bytes}",
            peer=peer,
            fix="split the payload over several messages, or raise Limits.max_message_bytes",
        )


def _check_envelope_values(msg: Message, peer: Optional[str], outgoing: bool) -> None:
    verb = f"refusing to send {msg.type.name}" if outgoing else f"{msg.type.name} message"
    checks = (
        ("session", isinstance(msg.session, str) and 1 <= len(msg.session) <= 256, "a str of 1..256 chars"),
        ("sender", isinstance(msg.sender, str) and 1 <= len(msg.sender) <= 256, "a str of 1..256 chars"),
        ("req_id", isinstance(msg.req_id, int) and not isinstance(msg.req_id, bool) and 0 <= msg.req_id <= _U64,
         "an int in [0, 2**64-1]"),
        ("version", isinstance(msg.version, int) and not isinstance(msg.version, bool) and 1 <= msg.version <= 0xFFFF,
         "an int in [1, 65535]"),
        ("nonce", isinstance(msg.nonce, bytes) and len(msg.nonce) == NONCE_BYTES, f"{NONCE_BYTES} bytes"),
        ("timestamp_ns", isinstance(msg.timestamp_ns, int) and not isinstance(msg.timestamp_ns, bool)
         and 0 <= msg.timestamp_ns <= _I64, "an int in [0, 2**63-1] (time.time_ns())"),
    )
    for name, ok, want in checks:
        if not ok:
            value = getattr(msg, name)
            raise MalformedMessage(
                f"{verb}: envelope field {name!r} is {value!r}, must be {want}",
                peer=peer,
                fix="construct messages with resilient_ckpt.service.wire.protocol.Message defaults"
                if outgoing
                else "the sender does not follow the wire format",
            )


def encode(msg: Message, authenticator: "Authenticator", *, limits: Limits = DEFAULT_LIMITS) -> list:
    """Frames for ``msg``: ``[header, *data frames, tag]``; data frames are not copied.

    The message is validated as strictly as :func:`decode` would, so a local bug fails here
    with a clear error instead of at the peer.
    """
    if not isinstance(msg, Message):
        raise MalformedMessage(f"refusing to send a {_type_name(msg)}", fix="pass a Message")
    _check_envelope_values(msg, None, outgoing=True)
    if msg.version not in SUPPORTED_VERSIONS and msg.type not in VERSION_INDEPENDENT_TYPES:
        raise UnsupportedVersion(
            f"refusing to send {msg.type.name} as version {msg.version}: this build speaks "
            f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}",
            fix="use the version negotiated by HELLO/HELLO_OK",
        )
    validate_body(msg.type, msg.body, len(msg.frames), outgoing=True)
    views = [_byte_view(f, i, None) for i, f in enumerate(msg.frames)]
    _check_sizes([v.nbytes for v in views], 0, limits, None, outgoing=True)
    header = msgpack.packb(
        {
            "version": msg.version,
            "type": int(msg.type),
            "session": msg.session,
            "sender": msg.sender,
            "req_id": msg.req_id,
            "nonce": msg.nonce,
            "ts": msg.timestamp_ns,
            "body": msg.body,
        },
        use_bin_type=True,
    )
    _check_sizes([v.nbytes for v in views], len(header), limits, None, outgoing=True)
    tag = authenticator.sign(header, views)
    return [header, *views, tag]


def _unpack_header(view: memoryview, peer: Optional[str]) -> dict:
    n = view.nbytes
    try:
        header = msgpack.unpackb(
            view,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=n,
            max_bin_len=n,
            max_array_len=n,
            max_map_len=n,
            max_ext_len=0,
        )
    # msgpack signals bad input with ValueError, TypeError (unhashable key), ExtraData,
    # FormatError, StackError, UnicodeDecodeError, OverflowError depending on the byte: all
    # of them mean "not a header", none may escape.
    except Exception as exc:
        raise MalformedMessage(
            f"header is not valid msgpack ({type(exc).__name__}: {exc})",
            peer=peer,
            fix="the sender does not follow the wire format",
        ) from None
    if not isinstance(header, dict):
        raise MalformedMessage(
            f"header is a msgpack {_type_name(header)}, must be a map", peer=peer,
            fix="the sender does not follow the wire format",
        )
    keys = set(header)
    if keys != _ENVELOPE_KEYS:
        missing, extra = sorted(_ENVELOPE_KEYS - keys), sorted(map(repr, keys - _ENVELOPE_KEYS))
        raise MalformedMessage(
            f"header envelope keys wrong (missing {missing}, unexpected {extra})",
            peer=peer,
            fix="the sender does not follow the wire format",
        )
    return header


def decode(
    frames: Sequence[Buffer],
    authenticator: "Authenticator",
    *,
    expected_session: Union[str, Collection[str], None],
    replay_guard: Optional["ReplayGuard"],
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional["RejectCounters"] = None,
    peer: Optional[str] = None,
) -> Message:
    """Check and decode ``[header, *data frames, tag]``; raises only ProtocolError subclasses.

    ``expected_session``: the session(s) this endpoint serves (None accepts any).
    ``replay_guard``: None only when decoding offline (a capture, a test), never on a socket.
    ``counters``: rejections are recorded there by reason. ``peer``: transport-level name of
    the sender, used in errors until the authenticated header names it.
    """
    try:
        return _decode(frames, authenticator, expected_session, replay_guard, limits, peer)
    except ProtocolError as exc:
        if counters is not None:
            counters.record(exc)
        raise


def _decode(frames, authenticator, expected_session, replay_guard, limits, peer) -> Message:
    fix_format = "the sender does not follow the wire format"
    if not isinstance(frames, (list, tuple)):
        raise MalformedMessage(f"frames must be a list, got {_type_name(frames)}", peer=peer, fix=fix_format)
    if len(frames) < 2:
        raise MalformedMessage(
            f"{len(frames)} frame(s): a message has at least a header frame and a tag frame",
            peer=peer,
            fix=fix_format,
        )
    _check_count(len(frames) - 2, limits, peer, outgoing=False)  # before touching any frame
    views = [_byte_view(f, i, peer) for i, f in enumerate(frames)]
    header_view, data_views, tag_view = views[0], views[1:-1], views[-1]
    _check_sizes([v.nbytes for v in data_views], header_view.nbytes, limits, peer, outgoing=False)
    authenticator.verify(header_view, data_views, tag_view, peer=peer)

    header = _unpack_header(header_view, peer)
    sender = header["sender"]
    if isinstance(sender, str) and 1 <= len(sender) <= 256:
        peer = f"{sender} ({peer})" if peer else sender
    type_code = header["type"]
    if not isinstance(type_code, int) or isinstance(type_code, bool):
        raise MalformedMessage(f"envelope field 'type' is {type_code!r}, must be an int", peer=peer, fix=fix_format)
    try:
        mtype = MessageType(type_code)
    except ValueError:
        mtype = None
    version = header["version"]
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= 0xFFFF:
        raise MalformedMessage(f"envelope field 'version' is {version!r}, must be an int in [1, 65535]",
                               peer=peer, fix=fix_format)
    if mtype not in VERSION_INDEPENDENT_TYPES and version not in SUPPORTED_VERSIONS:
        raise UnsupportedVersion(
            f"message uses protocol version {version}; this node supports "
            f"{MIN_PROTOCOL_VERSION}..{PROTOCOL_VERSION}",
            peer=peer,
            fix="say HELLO first and use the version HELLO_OK returns; run the same "
            "resilient-ckpt release on every node",
        )
    known = TYPES_BY_VERSION.get(version, frozenset(VERSION_INDEPENDENT_TYPES))
    if mtype is None or mtype not in known:
        raise UnknownMessageType(
            f"type code {type_code} is not defined in protocol version {version}",
            peer=peer,
            fix="run the same resilient-ckpt release on both sides",
        )
    try:
        msg = Message(
            type=mtype,
            session=header["session"],
            sender=sender,
            req_id=header["req_id"],
            body=header["body"],
            frames=tuple(v.toreadonly() for v in data_views),
            version=version,
            nonce=header["nonce"],
            timestamp_ns=header["ts"],
        )
    except ProtocolError as exc:  # pragma: no cover - type already checked
        raise MalformedMessage(str(exc), peer=peer, fix=fix_format) from None
    _check_envelope_values(msg, peer, outgoing=False)
    if expected_session is not None:
        allowed = (expected_session,) if isinstance(expected_session, str) else expected_session
        if msg.session not in allowed:
            raise WrongSession(
                f"{mtype.name} is for session {msg.session!r}, this endpoint serves {sorted(allowed)}",
                peer=peer,
                fix="point the trainer/peer at the daemon of its own job, or start the daemon with "
                "its session",
            )
    validate_body(mtype, msg.body, len(data_views), peer=peer)
    if replay_guard is not None:
        replay_guard.check(msg.nonce, msg.timestamp_ns, peer=peer)
    return msg


# --------------------------------------------------------------------------- flow control


class CreditWindow:
    """Sender-side accounting of data bytes in flight to one peer.

    The receiver advertises a window (HELLO_OK ``credit_bytes``) and sends CREDIT messages as
    it consumes data; the sender :meth:`acquire`\\ s before each data message and
    :meth:`release`\\ s what a CREDIT grants. A peer that stops reading therefore costs at most
    ``max_inflight_bytes`` of buffering and a :class:`PeerTimeout`, never unbounded memory.
    Thread-safe.
    """

    def __init__(self, max_inflight_bytes: int, *, peer: Optional[str] = None):
        if not isinstance(max_inflight_bytes, int) or isinstance(max_inflight_bytes, bool) or max_inflight_bytes < 1:
            raise ProtocolConfigError(
                f"CreditWindow max_inflight_bytes={max_inflight_bytes!r} must be a positive int",
                peer=peer,
                fix="use the receiver's HELLO_OK credit_bytes",
            )
        self.max_inflight_bytes = max_inflight_bytes
        self.peer = peer
        self._available = max_inflight_bytes
        self._closed: Optional[str] = None
        self._cond = threading.Condition(threading.Lock())

    @property
    def available(self) -> int:
        with self._cond:
            return self._available

    @property
    def in_flight(self) -> int:
        with self._cond:
            return self.max_inflight_bytes - self._available

    def acquire(self, nbytes: int, *, timeout_s: float) -> None:
        """Block until ``nbytes`` of credit are available, then take them.

        PeerTimeout after ``timeout_s``; LimitExceeded at once if ``nbytes`` can never fit;
        PeerUnreachable if the window is closed meanwhile.
        """
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ProtocolConfigError(f"cannot acquire {nbytes!r} bytes of credit", peer=self.peer)
        if nbytes > self.max_inflight_bytes:
            raise LimitExceeded(
                f"a message of {nbytes} data bytes can never fit the credit window of "
                f"{self.max_inflight_bytes} bytes",
                peer=self.peer,
                fix="send chunks no larger than the window (HELLO_OK credit_bytes)",
            )
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                if self._closed is not None:
                    raise PeerUnreachable(f"credit window closed: {self._closed}", peer=self.peer)
                if self._available >= nbytes:
                    self._available -= nbytes
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise PeerTimeout(
                        f"no credit for {nbytes} bytes within {timeout_s:g} s "
                        f"({self.max_inflight_bytes - self._available} bytes in flight, unacknowledged)",
                        peer=self.peer,
                        fix="the peer stopped reading or is overloaded: check its daemon (status, "
                        "logs); retry another holder",
                    )
                self._cond.wait(remaining)

    def release(self, nbytes: int) -> None:
        """Return ``nbytes`` of credit (a CREDIT message arrived, or an unsent acquire)."""
        if nbytes < 0:
            raise ProtocolConfigError(f"cannot release {nbytes} bytes of credit", peer=self.peer)
        with self._cond:
            # A confused peer granting more than was taken must not widen the window.
            self._available = min(self.max_inflight_bytes, self._available + nbytes)
            self._cond.notify_all()

    def close(self, reason: str = "peer disconnected") -> None:
        """Wake every waiter with PeerUnreachable (the peer is gone; stop sending to it)."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()


class CreditGranter:
    """Receiver side: turns consumed bytes into CREDIT grants, batched to save messages.

    ``consumed(n)`` returns how many bytes to grant now (0 = not yet): grants go out once at
    least ``grant_fraction`` of the window was consumed, so the sender never stalls on a
    window that is actually free for long.
    """

    def __init__(self, window_bytes: int, *, grant_fraction: float = 0.25):
        if window_bytes < 1 or not 0 < grant_fraction <= 1:
            raise ProtocolConfigError(
                f"CreditGranter(window_bytes={window_bytes}, grant_fraction={grant_fraction}) is invalid",
                fix="window_bytes >= 1 and 0 < grant_fraction <= 1",
            )
        self.window_bytes = window_bytes
        self._threshold = max(1, int(window_bytes * grant_fraction))
        self._pending = 0
        self._lock = threading.Lock()

    def consumed(self, nbytes: int) -> int:
        with self._lock:
            self._pending += nbytes
            if self._pending < self._threshold:
                return 0
            grant, self._pending = self._pending, 0
            return grant

    def flush(self) -> int:
        """Whatever is pending, e.g. at the end of a stream."""
        with self._lock:
            grant, self._pending = self._pending, 0
            return grant


# --------------------------------------------------------------------------- sockets


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
                "sending on a ROUTER socket needs the peer's routing id", fix="pass to=<routing id from recv_from>"
            )
        return True
    if sock.type == zmq.DEALER:
        if to is not None:
            raise ProtocolConfigError("a DEALER socket has one peer; do not pass to=", fix="drop the to= argument")
        return False
    raise ProtocolConfigError(
        f"socket type {sock.type} is not used by this protocol", fix="use ROUTER (daemon) or DEALER (clients, peers)"
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
    authenticator: "Authenticator",
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
    authenticator: "Authenticator",
    *,
    timeout_ms: int,
    expected_session: Union[str, Collection[str], None],
    replay_guard: Optional["ReplayGuard"],
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional["RejectCounters"] = None,
) -> Message:
    """Receive and decode one message on a DEALER; PeerTimeout after ``timeout_ms``."""
    label, parts = recv_raw(sock, timeout_ms=timeout_ms, limits=limits, counters=counters)
    return decode(
        parts, authenticator, expected_session=expected_session, replay_guard=replay_guard,
        limits=limits, counters=counters, peer=label,
    )


def recv_raw(
    sock: zmq.Socket,
    *,
    timeout_ms: int,
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional["RejectCounters"] = None,
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
    authenticator: "Authenticator",
    *,
    timeout_ms: int,
    expected_session: Union[str, Collection[str], None],
    replay_guard: Optional["ReplayGuard"],
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional["RejectCounters"] = None,
) -> Tuple[bytes, Message]:
    """Receive one message on a ROUTER: ``(routing id, message)``; reply with ``send(to=id)``.

    A message that fails to decode is consumed entirely before the error is raised, so the
    socket stays usable; the error names the peer by routing id and TCP address.
    """
    routing_id, label, parts = recv_raw_from(sock, timeout_ms=timeout_ms, limits=limits, counters=counters)
    msg = decode(
        parts, authenticator, expected_session=expected_session, replay_guard=replay_guard,
        limits=limits, counters=counters, peer=label,
    )
    return routing_id, msg


def recv_raw_from(
    sock: zmq.Socket,
    *,
    timeout_ms: int,
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional["RejectCounters"] = None,
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


@dataclass(frozen=True)
class RequestInfo:
    """Envelope fields of an authenticated message that failed validation (to answer it)."""

    type_code: Optional[int]
    req_id: int
    version: int
    session: str


def authenticated_request_info(
    frames: Sequence[Buffer], authenticator: "Authenticator", *, limits: Limits = DEFAULT_LIMITS
) -> Optional[RequestInfo]:
    """What an ERROR reply needs, only if ``frames`` carry a valid tag; else None.

    The reply policy (docs/protocol.md, section 10) answers authenticated but otherwise
    invalid messages and never unauthenticated ones: this re-checks the limits and the tag
    before reading anything from the header, and reads the header with the same bounds as
    :func:`decode`. Never raises.
    """
    try:
        if not isinstance(frames, (list, tuple)) or len(frames) < 2 or len(frames) - 2 > limits.max_frames:
            return None
        views = [_byte_view(f, i, None) for i, f in enumerate(frames)]
        _check_sizes([v.nbytes for v in views[1:-1]], views[0].nbytes, limits, None, outgoing=False)
        authenticator.verify(views[0], views[1:-1], views[-1])
        header = _unpack_header(views[0], None)
    except ProtocolError:
        return None
    req_id, version, session, type_code = header["req_id"], header["version"], header["session"], header["type"]
    if not (isinstance(req_id, int) and not isinstance(req_id, bool) and 0 <= req_id <= _U64):
        req_id = 0
    if not (isinstance(version, int) and not isinstance(version, bool) and version in SUPPORTED_VERSIONS):
        version = PROTOCOL_VERSION
    if not (isinstance(session, str) and 1 <= len(session) <= 256):
        session = "-"
    if not (isinstance(type_code, int) and not isinstance(type_code, bool) and 1 <= type_code <= 0xFFFF):
        type_code = None
    return RequestInfo(type_code, req_id, version, session)


__all__ = [
    "AuthenticationError",
    "BodySchema",
    "CHECKPOINT_ID",
    "CreditGranter",
    "CreditWindow",
    "DEFAULT_LIMITS",
    "ErrorCode",
    "Field",
    "HOLDING",
    "Limits",
    "LimitExceeded",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "MIN_PROTOCOL_VERSION",
    "MalformedMessage",
    "Message",
    "MessageType",
    "PROTOCOL_VERSION",
    "PeerTimeout",
    "PeerUnreachable",
    "ProtocolConfigError",
    "ProtocolError",
    "RESULT_SCHEMAS",
    "PredatesStart",
    "ReplayedMessage",
    "SCHEMAS",
    "SUPPORTED_VERSIONS",
    "StaleMessage",
    "TYPES_BY_VERSION",
    "UnknownMessageType",
    "UnsupportedVersion",
    "VERSION_INDEPENDENT_TYPES",
    "WrongSession",
    "chunk_checksum",
    "configure_socket",
    "decode",
    "encode",
    "error_body",
    "negotiate_version",
    "recv",
    "recv_raw",
    "recv_from",
    "recv_raw_from",
    "RequestInfo",
    "authenticated_request_info",
    "REPLICATION",
    "REPLICATION_STATES",
    "send",
    "validate_body",
]
