"""The receive side of replication: a checkpoint arriving (a pushed replica, or a FETCH
stream this daemon pulls) is written chunk by chunk into a reserved segment, every chunk and
tensor checksum verified as it lands, and published (header last) only once complete. A cut
transfer leaves nothing visible.

:class:`Inbound` is one such transfer; :class:`Receiver` handles REPLICATE_BEGIN / CHUNK /
END in the router thread.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import OrderedDict
from typing import Any, Dict, List, Mapping, Optional, Tuple

import numpy as np
import xxhash

from ...errors import CheckpointingException, StoreFullError
from ...memory import checksum
from ...memory.layout import CheckpointHeader, CheckpointId
from ...memory.store import CheckpointStore
from ..client import header_digest
from ..wire import CreditGranter, ErrorCode, Message, MessageType, chunk_checksum
from .config import DEFAULT_CREDIT_BYTES
from .context import DaemonContext, Key, Replier
from .stores import Reservation, Stores


class TransferError(Exception):
    """A transfer or request cannot proceed: ``code`` goes into the ERROR reply."""

    def __init__(self, code: ErrorCode, text: str, retryable: bool = False):
        super().__init__(text)
        self.code = code
        self.text = text
        self.retryable = retryable


class TensorVerifier:
    """Checks the header's tensor checksums as chunks land, while each chunk is still in the
    CPU cache (one pass at the end would read the whole segment again from memory)."""

    def __init__(self, header: CheckpointHeader, total: int):
        if header.checksum_algo != checksum.ALGO:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"the header's tensors use checksum {header.checksum_algo!r}; "
                f"this daemon verifies {checksum.ALGO!r} (run the same resilient-ckpt release)",
            )
        self.items = []
        for i, lay in enumerate(header.tensors):
            if lay.offset < 0 or lay.nbytes < 0 or lay.offset + lay.nbytes > total:
                raise TransferError(
                    ErrorCode.MALFORMED, f"tensor {i} lies outside the segment of {total} bytes"
                )
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
                        raise TransferError(
                            ErrorCode.CHECKSUM_MISMATCH,
                            f"tensor {idx} fails its checksum (corrupted at the source or in transit)",
                            retryable=True,
                        )
                    self._done.add(idx)
            k += 1
        while self._first < len(items) and items[self._first][3] in self._done:
            self._first += 1

    @property
    def complete(self) -> bool:
        return self._first == len(self.items)


class Inbound:
    """One checkpoint arriving (pushed replica or pulled FETCH stream): a reserved segment
    written chunk by chunk, verified, then claimed and published (header last)."""

    def __init__(
        self,
        stores: Stores,
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
        self.verifier: Optional[TensorVerifier] = None
        if header_frame is not None:
            raw = bytes(header_frame)
            header = self._check_header(raw)
            self.digest = header_digest(raw)
            self.verifier = TensorVerifier(header, self.total)
        self.segment: Optional[Reservation] = stores.open_inbound(store, session, self.total, window, budget)
        self._dst = self.segment.array
        self._view = memoryview(self._dst) if self.total else None

    def describe(self, kind: str) -> Dict[str, Any]:
        seg = self.segment
        return {
            "session": self.key[0],
            "iteration": self.key[1],
            "owner": self.key[2],
            "peer": self.peer,
            "kind": kind,
            "received": self.received,
            "total_bytes": self.total,
            "reserved_bytes": seg.claim if seg is not None else 0,
        }

    def _check_header(self, raw: bytes) -> CheckpointHeader:
        if self.digest is not None and header_digest(raw) != self.digest:
            raise TransferError(
                ErrorCode.CHECKSUM_MISMATCH,
                "the store header does not match the digest announced in REPLICATE_BEGIN",
            )
        try:
            header = CheckpointHeader.unpack(
                raw, source=f"replica header of {self.cid.stem()} from {self.peer}"
            )
        except CheckpointingException as e:
            raise TransferError(ErrorCode.CHECKSUM_MISMATCH, str(e)) from None
        if header.id != self.cid or header.data_nbytes != self.total or header.world_size != self.world_size:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"the header describes {header.id.stem()} of "
                f"{header.data_nbytes} bytes (world {header.world_size}), the transfer "
                f"{self.cid.stem()} of {self.total} bytes (world {self.world_size})",
            )
        return header

    def write(self, body: Mapping[str, Any], frame: memoryview) -> int:
        index, offset = body["index"], body["offset"]
        if index != self.next_index:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"chunk {index} arrived while chunk {self.next_index} "
                "was expected (chunks are sent in order; a message was lost)",
                retryable=True,
            )
        if index >= self.num_chunks:
            raise TransferError(
                ErrorCode.MALFORMED, f"chunk {index} is beyond the announced {self.num_chunks}"
            )
        expected_offset = index * self.chunk_bytes
        expected_len = min(self.chunk_bytes, self.total - expected_offset)
        n = frame.nbytes
        if offset != expected_offset or n != expected_len:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"chunk {index} has offset {offset} and {n} bytes; "
                f"expected offset {expected_offset} and {expected_len} bytes",
            )
        if offset + n > self.segment.claim:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"chunk {index} ends at byte {offset + n}, beyond the "
                f"{self.segment.claim} bytes granted so far (credit window {self.window} bytes): "
                "the sender ignores flow control (docs/protocol.md section 7)",
            )
        if chunk_checksum(frame) != body["checksum"]:
            raise TransferError(
                ErrorCode.CHECKSUM_MISMATCH,
                f"chunk {index} of {self.cid.stem()} fails its "
                "checksum (corrupted in transit or at the source)",
                retryable=True,
            )
        np.copyto(self._dst[offset : offset + n], np.frombuffer(frame, dtype=np.uint8))
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
            self.stores.grow_inbound(
                self.segment,
                self.granted + grant + self.window,
                self.budget,
                f"receiving {self.cid.stem()} of session {self.key[0]!r} from {self.peer}",
            )
            self.granted += grant
        return grant

    def finish(self, body: Mapping[str, Any], raw: memoryview) -> Tuple[CheckpointHeader, bool]:
        """Verify everything, then claim + publish. Returns (header, already_held)."""
        if body["num_chunks"] != self.num_chunks or body["total_bytes"] != self.total:
            raise TransferError(
                ErrorCode.MALFORMED, "REPLICATE_END disagrees with REPLICATE_BEGIN on the chunk count or size"
            )
        if self.next_index != self.num_chunks:
            raise TransferError(
                ErrorCode.MALFORMED,
                f"REPLICATE_END after {self.next_index} of {self.num_chunks} chunks",
                retryable=True,
            )
        raw = bytes(raw)
        if xxhash.xxh3_64_intdigest(raw) != body["header_checksum"]:
            raise TransferError(
                ErrorCode.CHECKSUM_MISMATCH, "the store header fails its checksum", retryable=True
            )
        header = self._check_header(raw)
        digest = header_digest(raw)
        if self.verifier is None and self.total:
            verifier = TensorVerifier(header, self.total)  # no header at BEGIN: one pass now
            verifier.feed(self._view, 0, self.total)
        elif self.verifier is not None and not self.verifier.complete:
            raise TransferError(ErrorCode.MALFORMED, "some tensors were not covered by the chunks")
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


#: What became of a transfer that is no longer in progress: (None, "stored" / "already held")
#: or (the ERROR code, its text).
Outcome = Tuple[Optional[ErrorCode], str]


class Receiver:
    """Pushed replicas arriving, in the router thread: REPLICATE_BEGIN admits and reserves,
    each CHUNK is written and verified (CREDIT granted as bytes are consumed), END verifies the
    whole and publishes. Transfers that ended or were refused are remembered (the last 1024):
    their late chunks are dropped silently and their END answered with the same outcome."""

    def __init__(self, ctx: DaemonContext, replies: Replier):
        self.ctx, self.replies = ctx, replies
        self.transfers: Dict[Key, Inbound] = {}
        self._ended: "OrderedDict[Tuple[bytes, int], Outcome]" = OrderedDict()

    def _remember(self, rid: bytes, req_id: int, code: Optional[ErrorCode], text: str) -> None:
        self._ended[(rid, req_id)] = (code, text)
        while len(self._ended) > 1024:
            self._ended.popitem(last=False)

    def on_begin(self, rid: bytes, label: str, msg: Message) -> None:
        try:
            self._begin(rid, msg)
        except StoreFullError as e:
            self._remember(rid, msg.req_id, ErrorCode.STORE_FULL, str(e))
            raise
        except TransferError as e:
            self._remember(rid, msg.req_id, e.code, e.text)
            raise

    def _begin(self, rid: bytes, msg: Message) -> None:
        ctx, b = self.ctx, msg.body
        key = (msg.session, b["iteration"], b["owner_rank"])
        cid = CheckpointId(key[1], key[2], key[0])
        most = min(ctx.limits.max_frame_bytes, ctx.config.credit_bytes)
        if b["chunk_bytes"] > most and b["total_bytes"]:
            raise TransferError(
                ErrorCode.LIMIT_EXCEEDED,
                f"chunk_bytes {b['chunk_bytes']} exceeds this "
                f"daemon's frame limit / credit window ({most} bytes)",
            )
        store = ctx.stores.get(msg.session, create=True)
        existing = ctx.stores.raw_header(store, cid)
        digest = b.get("header_digest")
        if existing is not None and digest is not None and header_digest(existing) == bytes(digest):
            self._remember(rid, msg.req_id, None, "already held")
            self.replies.ok(rid, msg, {"stored": True, "already": True})
            return
        old = self.transfers.pop(key, None)
        if old is not None:
            old.abort()
            ctx.event(
                logging.INFO,
                "transfer_superseded",
                peer=old.peer,
                session=key[0],
                iteration=key[1],
                owner=key[2],
                reason=f"a new REPLICATE_BEGIN from {msg.sender}",
            )
        # Admission counts all announced bytes, but the reservation only holds what the
        # sender may have sent (one credit window beyond what was granted): a sender that
        # goes silent after BEGIN does not keep other replicas out until --inbound-timeout.
        self.transfers[key] = Inbound(
            ctx.stores,
            store,
            key,
            b,
            peer=msg.sender,
            rid=rid,
            req_id=msg.req_id,
            window=ctx.config.credit_bytes,
            budget=ctx.config.memory_budget,
            header_frame=msg.frames[0] if msg.frames else None,
        )

    def _transfer_for(self, rid: bytes, msg: Message) -> Optional[Inbound]:
        key = (msg.session, msg.body["iteration"], msg.body["owner_rank"])
        t = self.transfers.get(key)
        if t is not None and t.rid == rid and t.req_id == msg.req_id:
            return t
        return None

    def on_chunk(self, rid: bytes, label: str, msg: Message) -> None:
        t = self._transfer_for(rid, msg)
        if t is None:
            if (rid, msg.req_id) in self._ended:
                return  # refused or finished earlier: its reason was sent once
            text = (
                "no transfer in progress for this chunk (the receiver restarted, timed the transfer "
                "out, or a newer REPLICATE_BEGIN replaced it); send REPLICATE_BEGIN again"
            )
            self._remember(rid, msg.req_id, ErrorCode.NOT_FOUND, text)
            raise TransferError(ErrorCode.NOT_FOUND, text, retryable=True)
        hold = self.ctx.config.faults.get("hold_inbound_after_chunks")
        if hold is not None and t.next_index >= hold:
            t.last_activity = time.monotonic()  # fault: stop consuming, keep the transfer open
            return
        try:
            grant = t.consumed(t.write(msg.body, msg.frames[0]))
        except TransferError as e:
            self.abort(t, e.text)
            self._remember(rid, msg.req_id, e.code, e.text)
            raise
        except StoreFullError as e:  # the reservation could not grow
            self.abort(t, str(e))
            self._remember(rid, msg.req_id, ErrorCode.STORE_FULL, str(e))
            raise
        if grant:
            self.replies.reply(rid, msg, MessageType.CREDIT, {"bytes": grant})

    def abort(self, t: Inbound, reason: str) -> None:
        if self.transfers.get(t.key) is t:
            del self.transfers[t.key]
        t.abort()
        self._log_aborted(t, reason, received=t.received, total=t.total)

    def _log_aborted(self, t: Inbound, reason: str, **fields) -> None:
        session, iteration, owner = t.key
        self.ctx.event(
            logging.WARNING,
            "transfer_aborted",
            peer=t.peer,
            session=session,
            iteration=iteration,
            owner=owner,
            **fields,
            reason=reason,
        )

    def on_end(self, rid: bytes, label: str, msg: Message) -> None:
        t = self._transfer_for(rid, msg)
        if t is None:
            self._answer_ended(rid, msg)
            return
        del self.transfers[t.key]
        try:
            header, already = t.finish(msg.body, msg.frames[0])
        except TransferError as e:
            t.abort()
            self._log_aborted(t, e.text)
            raise
        except BaseException:
            t.abort()
            raise
        self._remember(rid, msg.req_id, None, "stored")
        self._stored(t, already)
        self.replies.ok(rid, msg, {"stored": True})
        self.ctx.retention_due.set()

    def _answer_ended(self, rid: bytes, msg: Message) -> None:
        """An END for no transfer in progress: the outcome of the one it ends, if remembered."""
        prior = self._ended.get((rid, msg.req_id))
        if prior is not None and prior[0] is None:  # stored, or already held
            self.replies.ok(rid, msg, {"stored": True})
            return
        if prior is not None:
            raise TransferError(prior[0], prior[1], retryable=True)
        raise TransferError(
            ErrorCode.NOT_FOUND,
            "no transfer in progress for this REPLICATE_END; send REPLICATE_BEGIN again",
            retryable=True,
        )

    def _stored(self, t: Inbound, already: bool) -> None:
        ctx = self.ctx
        seconds = time.monotonic() - t.started
        ctx.ledger.count(bytes_in=t.received, replicas_stored=1)
        ctx.metrics.bytes.labels("in").inc(t.received)
        ctx.event(
            logging.INFO,
            "replica_stored",
            peer=t.peer,
            session=t.key[0],
            iteration=t.key[1],
            owner=t.key[2],
            bytes=t.received,
            seconds=round(seconds, 4),
            already=already or None,
        )

    def expire(self, now: float) -> None:
        """Transfers without data for ``--inbound-timeout`` are dropped."""
        limit = self.ctx.config.inbound_timeout_s
        for t in list(self.transfers.values()):
            if now - t.last_activity > limit:
                self.abort(t, f"no data for {limit:g} s: the sender stopped or disappeared mid-transfer")

    def describe(self) -> List[Dict[str, Any]]:
        return [t.describe("push") for t in self.transfers.values()]

    def close(self) -> None:
        """The router stops: every transfer in progress is discarded."""
        for t in list(self.transfers.values()):
            t.abort()
        self.transfers.clear()
