"""Message authentication for the checkpoint service: one shared secret per job.

Why HMAC-SHA256 and not ZeroMQ CURVE (docs/protocol.md says more): CURVE needs a libzmq built
with libsodium and a key pair per node plus distribution of every peer's public key, while a
job already has one way to hand all its processes the same secret (a 0600 file or an env var
from the launcher). An HMAC binds the session, the sender, the message content and a fresh
nonce/timestamp, which is what we need: no process without the secret can inject, alter or
replay a message. Confidentiality is *not* provided: checkpoint bytes cross the cluster
fabric in clear, exactly as NCCL/gloo traffic of the same job does.

Tag frame = 1 scheme byte + HMAC-SHA256 over (domain, scheme, header length, header, frame
count, and for each data frame its length and digest). Two per-frame digests (measured in
docs/protocol.md: SHA-256 ~1.8 GB/s per core, about halving loopback replication throughput;
xxh3 ~25 GB/s):

* ``"xxh3-128"`` (default): xxh3-128 seeded per message from the secret and the header.
  Envelope and body are HMAC-authenticated; data frames are bound to them through a
  non-cryptographic digest: this stops anyone without the secret from injecting or replaying
  messages and catches any corruption, but does not claim to stop an on-path attacker who
  rewrites TCP streams and can craft xxh3 collisions.
* ``"sha256"``: hash-then-MAC with SHA-256, so every data byte is cryptographically bound.
  For fabrics with untrusted on-path devices; costs ~38 ms of CPU per 64 MiB on each side.

``RESILIENT_CKPT_FRAME_DIGEST`` selects it (:func:`authenticator_from_env`); a receiver only
accepts its own configured digest (no downgrade).
"""

from __future__ import annotations

import datetime
import hashlib
import heapq
import hmac
import os
import secrets
import stat
import struct
import tempfile
import threading
import time
from collections import Counter
from typing import Callable, Dict, Optional, Sequence, Union

import xxhash

from .errors import (
    AuthenticationError,
    PredatesStart,
    ProtocolConfigError,
    ProtocolError,
    ReplayedMessage,
    StaleMessage,
)

MIN_SECRET_BYTES = 16
SECRET_ENV = "RESILIENT_CKPT_SECRET"
SECRET_FILE_ENV = "RESILIENT_CKPT_SECRET_FILE"
FRAME_DIGEST_ENV = "RESILIENT_CKPT_FRAME_DIGEST"
DEFAULT_FRAME_DIGEST = "xxh3-128"

#: Frame digest name -> scheme byte at the start of the tag frame.
FRAME_DIGESTS: Dict[str, int] = {"sha256": 1, "xxh3-128": 2}
_SCHEME_NAMES = {v: k for k, v in FRAME_DIGESTS.items()}
TAG_BYTES = 1 + hashlib.sha256().digest_size

_DOMAIN = b"resilient-ckpt message tag v1\x00"
_SECRET_FIX = (
    f"give every daemon and trainer of the job the same secret in {SECRET_FILE_ENV} (a chmod "
    f"600 file) or {SECRET_ENV}"
)

BufferLike = Union[bytes, bytearray, memoryview]


class Authenticator:
    """Signs and verifies message tags with the job's shared secret.

    ``frame_digest``: "xxh3-128" (default, fast) or "sha256" (every data byte
    cryptographically bound); the module docstring says what each gives. Every endpoint of a
    job must use the same setting. Thread-safe (no mutable state after construction).
    """

    def __init__(self, secret: bytes, *, frame_digest: str = DEFAULT_FRAME_DIGEST):
        if not isinstance(secret, (bytes, bytearray)):
            raise ProtocolConfigError(
                f"the secret must be bytes, got {type(secret).__name__}", fix="pass secret.encode()"
            )
        if len(secret) < MIN_SECRET_BYTES:
            raise ProtocolConfigError(
                f"the secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required",
                fix="use generate_secret() (64 hex characters)",
            )
        if frame_digest not in FRAME_DIGESTS:
            raise ProtocolConfigError(
                f"unknown frame_digest {frame_digest!r}", fix=f"use one of {sorted(FRAME_DIGESTS)}"
            )
        # A derived key keeps the job secret usable for other purposes without cross-use.
        key = hmac.new(bytes(secret), b"resilient-ckpt mac key", hashlib.sha256).digest()
        self._base = hmac.new(key, _DOMAIN, hashlib.sha256)
        self._seed_base = hmac.new(key, b"resilient-ckpt xxh3 seed", hashlib.sha256)
        self.frame_digest = frame_digest
        self._scheme = FRAME_DIGESTS[frame_digest]

    def __repr__(self) -> str:  # never show the secret
        return f"Authenticator(frame_digest={self.frame_digest!r})"

    def _mac(self, scheme: int, header: BufferLike, frames: Sequence[memoryview]) -> bytes:
        header_len = memoryview(header).nbytes
        mac = self._base.copy()
        mac.update(struct.pack("<BQI", scheme, header_len, len(frames)))
        mac.update(header)
        if scheme == 1:
            for f in frames:
                mac.update(struct.pack("<Q", f.nbytes))
                mac.update(hashlib.sha256(f).digest())  # hashlib reads the view; no copy
        else:
            seed_mac = self._seed_base.copy()
            seed_mac.update(header)  # header holds the nonce: a fresh seed per message
            seed = int.from_bytes(seed_mac.digest()[:8], "little")
            for f in frames:
                mac.update(struct.pack("<Q", f.nbytes))
                mac.update(xxhash.xxh3_128_digest(f, seed=seed))
        return mac.digest()

    def sign(self, header: BufferLike, frames: Sequence[memoryview]) -> bytes:
        """The tag frame for a header and its data frames (flat byte views)."""
        return bytes((self._scheme,)) + self._mac(self._scheme, header, frames)

    def verify(
        self, header: BufferLike, frames: Sequence[memoryview], tag: BufferLike, *, peer: Optional[str] = None
    ) -> None:
        """Raise AuthenticationError unless ``tag`` is this secret's tag over the frames."""
        tag = memoryview(tag)
        if tag.nbytes != TAG_BYTES:
            raise AuthenticationError(
                f"tag frame has {tag.nbytes} bytes, expected {TAG_BYTES}", peer=peer, fix=_SECRET_FIX
            )
        scheme = tag[0]
        if scheme != self._scheme:
            theirs = _SCHEME_NAMES.get(scheme, f"unknown scheme {scheme}")
            raise AuthenticationError(
                f"message is tagged with frame digest {theirs!r}, this endpoint requires "
                f"{self.frame_digest!r}",
                peer=peer,
                fix="configure the same frame_digest on every daemon and trainer of the job",
            )
        expected = self._mac(scheme, header, frames)
        if not hmac.compare_digest(expected, tag[1:]):
            raise AuthenticationError(
                "tag does not match the message (wrong secret, or frames altered in transit)",
                peer=peer,
                fix=_SECRET_FIX,
            )


# --------------------------------------------------------------------------- secrets


def generate_secret(nbytes: int = 32) -> bytes:
    """A new random job secret: ``nbytes`` of entropy as ASCII hex, usable in a file or env var."""
    if nbytes < MIN_SECRET_BYTES:
        raise ProtocolConfigError(
            f"generate_secret(nbytes={nbytes}) is below {MIN_SECRET_BYTES}", fix="use the default 32"
        )
    return secrets.token_hex(nbytes).encode("ascii")


def write_secret_file(path: Union[str, os.PathLike], secret: Optional[bytes] = None) -> bytes:
    """Atomically write ``secret`` (a new one if None) to ``path`` with mode 0600; return it."""
    secret = generate_secret() if secret is None else secret
    if len(secret) < MIN_SECRET_BYTES:
        raise ProtocolConfigError(
            f"refusing to write a {len(secret)}-byte secret", fix=f"use at least {MIN_SECRET_BYTES} bytes"
        )
    path = os.fspath(path)
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(path)), prefix=".secret-")
    try:  # mkstemp creates the file 0600 already: the secret is never readable by others
        with os.fdopen(fd, "wb") as f:
            f.write(secret + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return secret


def load_secret(
    path: Union[str, os.PathLike, None] = None,
    env: str = SECRET_ENV,
    *,
    file_env: str = SECRET_FILE_ENV,
) -> bytes:
    """The job secret: from ``path``, else the file named by ``$RESILIENT_CKPT_SECRET_FILE``,
    else ``$RESILIENT_CKPT_SECRET`` itself.

    A file must not be readable or writable by others (fix: ``chmod 600``); a trailing newline
    is ignored. Fewer than 16 bytes are refused.
    """
    if path is None:
        path = os.environ.get(file_env) or None
    if path is not None:
        path = os.fspath(path)
        try:
            st = os.stat(path)
        except FileNotFoundError:
            raise ProtocolConfigError(
                f"secret file {path} does not exist",
                fix=f"create it with write_secret_file({path!r}) in the job's launcher, or fix {file_env}",
            ) from None
        except OSError as exc:
            raise ProtocolConfigError(
                f"cannot stat secret file {path}: {exc}", fix="check the path"
            ) from None
        if not stat.S_ISREG(st.st_mode):
            raise ProtocolConfigError(f"secret file {path} is not a regular file", fix="point at a file")
        if st.st_mode & (stat.S_IROTH | stat.S_IWOTH):
            raise ProtocolConfigError(
                f"secret file {path} is accessible by every user (mode {stat.S_IMODE(st.st_mode):03o})",
                fix=f"chmod 600 {path}",
            )
        try:
            with open(path, "rb") as f:
                secret = f.read(64 * 1024).rstrip(b"\r\n")
        except OSError as exc:
            raise ProtocolConfigError(
                f"cannot read secret file {path}: {exc}", fix="run as the file's owner, or chmod 600 it"
            ) from None
        source = f"secret file {path}"
    elif os.environ.get(env):
        secret = os.environ[env].encode("utf-8")
        source = f"${env}"
    else:
        raise ProtocolConfigError(
            f"no job secret: neither {file_env} nor {env} is set",
            fix=f"have the launcher run write_secret_file(path) on shared storage and export {file_env}=path "
            f"to every daemon and trainer (or export {env}=<secret>)",
        )
    if len(secret) < MIN_SECRET_BYTES:
        raise ProtocolConfigError(
            f"{source} holds {len(secret)} bytes; at least {MIN_SECRET_BYTES} are required",
            fix="generate one with generate_secret() (64 hex characters)",
        )
    return secret


def authenticator_from_env(path: Union[str, os.PathLike, None] = None) -> Authenticator:
    """The job's Authenticator: :func:`load_secret` plus ``$RESILIENT_CKPT_FRAME_DIGEST``."""
    digest = os.environ.get(FRAME_DIGEST_ENV) or DEFAULT_FRAME_DIGEST
    if digest not in FRAME_DIGESTS:
        raise ProtocolConfigError(
            f"{FRAME_DIGEST_ENV}={digest!r} is not a frame digest",
            fix=f"set it to one of {sorted(FRAME_DIGESTS)} on every daemon and trainer",
        )
    return Authenticator(load_secret(path), frame_digest=digest)


# --------------------------------------------------------------------------- replay


class ReplayGuard:
    """Rejects messages outside ``±window_s`` of this node's clock and nonces seen before.

    A nonce is remembered until its message's timestamp leaves the window (at most
    ``2 × window_s``), so memory is bounded by the authenticated message rate and, hard, by
    ``max_entries`` (about 200 bytes each). The guard runs after tag verification: a sender
    without the secret cannot add entries at all. If ``max_entries`` is reached, the entry that
    expires first is evicted and every message that would expire no later than it is refused
    as stale from then on: the guard never accepts a replay, it only narrows the window under
    overload. Thread-safe.

    ``not_before_ns`` (a daemon passes its start, ``time.time_ns()``): messages timestamped
    earlier are refused with :class:`PredatesStart`. The nonces remembered by an earlier
    incarnation of the daemon died with it; without this floor a message captured before a
    restart could be replayed within the window. Legitimate senders build a fresh message
    (fresh timestamp) for every send, so after the restart theirs are newer than the start.
    """

    def __init__(
        self,
        window_s: float = 60.0,
        max_entries: int = 131_072,
        *,
        clock: Callable[[], int] = time.time_ns,
        not_before_ns: Optional[int] = None,
    ):
        if not window_s > 0 or max_entries < 1:
            raise ProtocolConfigError(
                f"ReplayGuard(window_s={window_s}, max_entries={max_entries}) is invalid",
                fix="window_s > 0 and max_entries >= 1",
            )
        self.window_ns = int(window_s * 1e9)
        self.max_entries = max_entries
        self.not_before_ns = not_before_ns
        self._clock = clock
        self._seen: Dict[bytes, int] = {}  # nonce -> expiry (ns)
        self._expiries: list = []  # heap of (expiry, nonce)
        self._floor_ns = 0  # messages expiring at or before this are refused (after eviction)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            return len(self._seen)

    def check(self, nonce: bytes, timestamp_ns: int, *, peer: Optional[str] = None) -> None:
        """Accept (and remember) the nonce, or raise StaleMessage / ReplayedMessage."""
        now = self._clock()
        skew_s = (timestamp_ns - now) / 1e9
        if abs(timestamp_ns - now) > self.window_ns:
            exc = StaleMessage(
                f"clock skew: timestamp is {skew_s:+.1f} s from this node's clock, outside the "
                f"±{self.window_ns / 1e9:g} s replay window",
                peer=peer,
                fix="synchronise node clocks (NTP/chrony); a much older message is a replay",
            )
            exc.skew_s = skew_s
            raise exc
        # Checked after the window: a skewed sender must hear about its clock, not a restart.
        if self.not_before_ns is not None and timestamp_ns < self.not_before_ns:
            exc = PredatesStart(
                f"message predates this daemon's start at {format_time_ns(self.not_before_ns)} by "
                f"{(self.not_before_ns - timestamp_ns) / 1e9:.3f} s: a replay, or a message sent "
                "before the restart",
                peer=peer,
                fix="resend it as a new message (a fresh timestamp is accepted); if fresh messages "
                "are refused too, the sender's clock is behind this node's: synchronise clocks (NTP/chrony)",
            )
            exc.not_before_ns, exc.skew_s = self.not_before_ns, skew_s
            raise exc
        expiry = timestamp_ns + self.window_ns
        with self._lock:
            self._expire(now)
            if nonce in self._seen:
                raise ReplayedMessage(
                    "nonce already seen within the replay window: this is a replayed or duplicated message",
                    peer=peer,
                    fix="build a new Message for every send (each gets a fresh nonce); if you did, "
                    "someone is replaying traffic",
                )
            if expiry <= self._floor_ns:
                raise StaleMessage(
                    f"timestamp {skew_s:+.1f} s is older than what the saturated replay guard "
                    f"({self.max_entries} entries) can still vouch for",
                    peer=peer,
                    fix="raise ReplayGuard max_entries, or send fewer, larger messages",
                )
            while len(self._seen) >= self.max_entries:
                evicted_expiry, evicted = heapq.heappop(self._expiries)
                del self._seen[evicted]
                self._floor_ns = max(self._floor_ns, evicted_expiry)
            if expiry <= self._floor_ns:  # this message is no younger than what we just evicted
                raise StaleMessage(
                    "message is older than every nonce the saturated replay guard still holds",
                    peer=peer,
                    fix="raise ReplayGuard max_entries, or send fewer, larger messages",
                )
            self._seen[nonce] = expiry
            heapq.heappush(self._expiries, (expiry, nonce))

    def _expire(self, now: int) -> None:
        heap = self._expiries
        while heap and heap[0][0] < now:
            _, nonce = heapq.heappop(heap)
            del self._seen[nonce]


def format_time_ns(t_ns: int) -> str:
    """``time.time_ns()`` value as UTC ISO 8601 with milliseconds (for error texts and logs)."""
    return datetime.datetime.fromtimestamp(t_ns / 1e9, datetime.timezone.utc).isoformat(
        timespec="milliseconds"
    )


# --------------------------------------------------------------------------- counters


class RejectCounters:
    """Rejected messages by reason (``ProtocolError.reason``), for the daemon's metrics."""

    def __init__(self) -> None:
        self._counts: Counter = Counter()
        self._lock = threading.Lock()

    def record(self, exc_or_reason: Union[ProtocolError, str]) -> None:
        reason = exc_or_reason.reason if isinstance(exc_or_reason, ProtocolError) else str(exc_or_reason)
        with self._lock:
            self._counts[reason] += 1

    def snapshot(self) -> Dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def __getitem__(self, reason: str) -> int:
        with self._lock:
            return self._counts[reason]

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


__all__ = [
    "Authenticator",
    "DEFAULT_FRAME_DIGEST",
    "FRAME_DIGESTS",
    "FRAME_DIGEST_ENV",
    "MIN_SECRET_BYTES",
    "RejectCounters",
    "ReplayGuard",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "TAG_BYTES",
    "authenticator_from_env",
    "format_time_ns",
    "generate_secret",
    "load_secret",
    "write_secret_file",
]
