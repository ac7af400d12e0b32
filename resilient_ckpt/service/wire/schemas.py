"""What may be on the wire: protocol versions, size limits, message types and the body schema
of every type, checked by :func:`validate_body` before any object is built from a body.

docs/protocol.md is the specification; this module is its machine-readable half.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Tuple

from .errors import MalformedMessage, ProtocolConfigError, UnsupportedVersion

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


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


#: Whether a value has the Python type a field kind reads as (msgpack's decoded types).
_KIND_TYPE_CHECKS: Mapping[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "bool": lambda v: isinstance(v, bool),
    "float": lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
    "str": lambda v: isinstance(v, str),
    "bytes": lambda v: isinstance(v, (bytes, bytearray, memoryview)),
    "map": lambda v: isinstance(v, dict),
    "record": lambda v: isinstance(v, dict),
    "list": lambda v: isinstance(v, (list, tuple)),
}


def _check_value(value: Any, spec: Field, path: str, depth: int) -> None:
    kind = spec.kind
    type_ok = _KIND_TYPE_CHECKS.get(kind)
    if type_ok is None:  # pragma: no cover - schema bug
        raise AssertionError(kind)
    if not type_ok(value):
        raise _Violation(path, f"expected {spec.describe()}, got {_type_name(value)}")
    if spec.choices is not None and value not in spec.choices:
        raise _Violation(path, f"expected one of {sorted(spec.choices)}, got {value!r}")
    _check_bounds(value, spec, path)
    if kind == "map":
        _check_plain(value, path, depth)
    elif kind == "record":
        _check_body(value, spec.record, path, depth + 1)
    elif kind == "list":
        for i, item in enumerate(value):
            _check_value(item, spec.items, f"{path}[{i}]", depth + 1)


def _check_bounds(value: Any, spec: Field, path: str) -> None:
    """An int's value, or a str's, bytes' or list's length, within ``[lo, hi]``."""
    if spec.kind == "int" and not (spec.lo <= value <= spec.hi):
        raise _Violation(path, f"{value} is outside [{spec.lo}, {spec.hi}]")
    if spec.kind in ("str", "bytes", "list"):
        n = memoryview(value).nbytes if isinstance(value, memoryview) else len(value)
        if not (spec.lo <= n <= spec.hi):
            raise _Violation(path, f"length {n} is outside [{spec.lo}, {spec.hi}]")


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


__all__ = [
    "BodySchema",
    "CHECKPOINT_ID",
    "DEFAULT_LIMITS",
    "Field",
    "HOLDING",
    "Limits",
    "MAX_FRAMES",
    "MAX_FRAME_BYTES",
    "MAX_HEADER_BYTES",
    "MAX_MESSAGE_BYTES",
    "MAX_NESTING",
    "MIN_PROTOCOL_VERSION",
    "MessageType",
    "NONCE_BYTES",
    "PROTOCOL_VERSION",
    "REPLICATION",
    "REPLICATION_STATES",
    "RESULT_SCHEMAS",
    "ROLES",
    "SCHEMAS",
    "SUPPORTED_VERSIONS",
    "TYPES_BY_VERSION",
    "VERSION_INDEPENDENT_TYPES",
    "negotiate_version",
    "validate_body",
]
