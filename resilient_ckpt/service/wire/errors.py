"""Errors of the wire protocol: the ERROR codes on the wire and the :class:`ProtocolError`
family raised by encoding, decoding, authentication, flow control and the socket helpers.

The bottom of ``wire``: every other wire module imports this one, it imports none of them.
"""

from __future__ import annotations

import enum
from typing import Optional

from ...errors import CheckpointingException


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


__all__ = [
    "AuthenticationError",
    "ErrorCode",
    "LimitExceeded",
    "MalformedMessage",
    "PeerTimeout",
    "PeerUnreachable",
    "PredatesStart",
    "ProtocolConfigError",
    "ProtocolError",
    "ReplayedMessage",
    "StaleMessage",
    "UnknownMessageType",
    "UnsupportedVersion",
    "WrongSession",
]
