"""Credit-based flow control: a sender never has more than the receiver's window of data
bytes unacknowledged in flight (docs/protocol.md, section 7)."""

from __future__ import annotations

import threading
import time
from typing import Optional

from .errors import LimitExceeded, PeerTimeout, PeerUnreachable, ProtocolConfigError


class CreditWindow:
    """Sender-side accounting of data bytes in flight to one peer.

    The receiver advertises a window (HELLO_OK ``credit_bytes``) and sends CREDIT messages as
    it consumes data; the sender :meth:`acquire`\\ s before each data message and
    :meth:`release`\\ s what a CREDIT grants. A peer that stops reading therefore costs at most
    ``max_inflight_bytes`` of buffering and a :class:`PeerTimeout`, never unbounded memory.
    Thread-safe.
    """

    def __init__(self, max_inflight_bytes: int, *, peer: Optional[str] = None):
        if (
            not isinstance(max_inflight_bytes, int)
            or isinstance(max_inflight_bytes, bool)
            or max_inflight_bytes < 1
        ):
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


__all__ = ["CreditGranter", "CreditWindow"]
