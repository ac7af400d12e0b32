"""The envelope: one protocol message on the wire, and its encoding and checked decoding.

A message on the wire is one ZeroMQ multipart message::

    [header, data_0, ..., data_{n-1}, tag]

* ``header`` — a msgpack map: the *envelope* (version, type, session, sender, req_id, nonce,
  timestamp) and the type's *body* (a map of plain msgpack values, :mod:`.schemas`).
* ``data_i`` — raw tensor bytes, sent zero-copy (``send_multipart(copy=False)``).
* ``tag`` — authentication tag (:mod:`.auth`) over the header, every data frame and their
  lengths, checked before the header is even unpacked.

Decoding checks, in this order and each before anything is allocated or parsed: frame count,
frame sizes, tag, header msgpack (with Unpacker limits), envelope, version, type, session,
body schema, replay window. Anything wrong raises a :class:`~.errors.ProtocolError` subclass
and nothing else. docs/protocol.md is the specification for implementers of a compatible peer.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Collection, Mapping, Optional, Sequence, Tuple, Union

import msgpack
import xxhash
import zmq

from .auth import Authenticator, RejectCounters, ReplayGuard
from .errors import (
    ErrorCode,
    LimitExceeded,
    MalformedMessage,
    ProtocolError,
    UnknownMessageType,
    UnsupportedVersion,
    WrongSession,
)
from .schemas import (
    DEFAULT_LIMITS,
    MIN_PROTOCOL_VERSION,
    NONCE_BYTES,
    PROTOCOL_VERSION,
    SUPPORTED_VERSIONS,
    TYPES_BY_VERSION,
    VERSION_INDEPENDENT_TYPES,
    Limits,
    MessageType,
    validate_body,
)

_U64 = (1 << 64) - 1
_I64 = (1 << 63) - 1


def _type_name(value: Any) -> str:
    return type(value).__name__


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
        (
            "req_id",
            isinstance(msg.req_id, int) and not isinstance(msg.req_id, bool) and 0 <= msg.req_id <= _U64,
            "an int in [0, 2**64-1]",
        ),
        (
            "version",
            isinstance(msg.version, int) and not isinstance(msg.version, bool) and 1 <= msg.version <= 0xFFFF,
            "an int in [1, 65535]",
        ),
        ("nonce", isinstance(msg.nonce, bytes) and len(msg.nonce) == NONCE_BYTES, f"{NONCE_BYTES} bytes"),
        (
            "timestamp_ns",
            isinstance(msg.timestamp_ns, int)
            and not isinstance(msg.timestamp_ns, bool)
            and 0 <= msg.timestamp_ns <= _I64,
            "an int in [0, 2**63-1] (time.time_ns())",
        ),
    )
    for name, ok, want in checks:
        if not ok:
            value = getattr(msg, name)
            raise MalformedMessage(
                f"{verb}: envelope field {name!r} is {value!r}, must be {want}",
                peer=peer,
                fix="construct messages with resilient_ckpt.service.wire.Message defaults"
                if outgoing
                else "the sender does not follow the wire format",
            )


def encode(msg: Message, authenticator: Authenticator, *, limits: Limits = DEFAULT_LIMITS) -> list:
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
            f"header is a msgpack {_type_name(header)}, must be a map",
            peer=peer,
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
    authenticator: Authenticator,
    *,
    expected_session: Union[str, Collection[str], None],
    replay_guard: Optional[ReplayGuard],
    limits: Limits = DEFAULT_LIMITS,
    counters: Optional[RejectCounters] = None,
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


_FIX_FORMAT = "the sender does not follow the wire format"


def _decode(frames, authenticator, expected_session, replay_guard, limits, peer) -> Message:
    header, data_views = _authenticated_header(frames, authenticator, limits, peer)
    sender = header["sender"]
    if isinstance(sender, str) and 1 <= len(sender) <= 256:
        peer = f"{sender} ({peer})" if peer else sender
    mtype, version = _type_and_version(header, peer)
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
        raise MalformedMessage(str(exc), peer=peer, fix=_FIX_FORMAT) from None
    _check_envelope_values(msg, peer, outgoing=False)
    _check_session(msg, expected_session, peer)
    validate_body(mtype, msg.body, len(data_views), peer=peer)
    if replay_guard is not None:
        replay_guard.check(msg.nonce, msg.timestamp_ns, peer=peer)
    return msg


def _authenticated_header(
    frames, authenticator: Authenticator, limits: Limits, peer: Optional[str]
) -> Tuple[dict, list]:
    """Frame count, sizes and tag checked (in that order, before anything is parsed), then
    the header unpacked: ``(header map, data frame views)``."""
    if not isinstance(frames, (list, tuple)):
        raise MalformedMessage(f"frames must be a list, got {_type_name(frames)}", peer=peer, fix=_FIX_FORMAT)
    if len(frames) < 2:
        raise MalformedMessage(
            f"{len(frames)} frame(s): a message has at least a header frame and a tag frame",
            peer=peer,
            fix=_FIX_FORMAT,
        )
    _check_count(len(frames) - 2, limits, peer, outgoing=False)  # before touching any frame
    views = [_byte_view(f, i, peer) for i, f in enumerate(frames)]
    header_view, data_views, tag_view = views[0], views[1:-1], views[-1]
    _check_sizes([v.nbytes for v in data_views], header_view.nbytes, limits, peer, outgoing=False)
    authenticator.verify(header_view, data_views, tag_view, peer=peer)
    return _unpack_header(header_view, peer), data_views


def _type_and_version(header: Mapping[str, Any], peer: Optional[str]) -> Tuple[MessageType, int]:
    """The envelope's type and version, both known to this build (or the matching error)."""
    type_code = header["type"]
    if not isinstance(type_code, int) or isinstance(type_code, bool):
        raise MalformedMessage(
            f"envelope field 'type' is {type_code!r}, must be an int", peer=peer, fix=_FIX_FORMAT
        )
    try:
        mtype = MessageType(type_code)
    except ValueError:
        mtype = None
    version = header["version"]
    if not isinstance(version, int) or isinstance(version, bool) or not 1 <= version <= 0xFFFF:
        raise MalformedMessage(
            f"envelope field 'version' is {version!r}, must be an int in [1, 65535]",
            peer=peer,
            fix=_FIX_FORMAT,
        )
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
    return mtype, version


def _check_session(
    msg: Message, expected_session: Union[str, Collection[str], None], peer: Optional[str]
) -> None:
    if expected_session is None:
        return
    allowed = (expected_session,) if isinstance(expected_session, str) else expected_session
    if msg.session not in allowed:
        raise WrongSession(
            f"{msg.type.name} is for session {msg.session!r}, this endpoint serves {sorted(allowed)}",
            peer=peer,
            fix="point the trainer/peer at the daemon of its own job, or start the daemon with its session",
        )


@dataclass(frozen=True)
class RequestInfo:
    """Envelope fields of an authenticated message that failed validation (to answer it)."""

    type_code: Optional[int]
    req_id: int
    version: int
    session: str


def authenticated_request_info(
    frames: Sequence[Buffer], authenticator: Authenticator, *, limits: Limits = DEFAULT_LIMITS
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
    req_id, version, session, type_code = (
        header["req_id"],
        header["version"],
        header["session"],
        header["type"],
    )
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
    "Buffer",
    "Message",
    "RequestInfo",
    "authenticated_request_info",
    "chunk_checksum",
    "decode",
    "encode",
    "error_body",
]
