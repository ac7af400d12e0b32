"""Embedded-mode replication: trainer ranks exchange checkpoint segments directly.

Each rank sends its published checkpoint (header + segment) to the placement's holders and
receives, into freshly allocated segments of its own node's store, the checkpoints of the
ranks it holds; a received replica's header is published after its last byte. A rank whose
own save failed still takes part (:meth:`PeerReplicator.abstain`: empty replicas out, refusals
in), so its partners learn it at once instead of after the transport timeout.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import replace
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ReplicationError, StoreError
from ..memory.layout import CheckpointHeader, CheckpointId
from ..memory.segment import Segment, drop_pages
from ..memory.store import CheckpointStore
from ..thread_pools import background_executor
from .healing import Repair
from .placement import Placement
from .replicator import ReplicationResult
from .transport import Incoming, Outgoing, P2PTransport

logger = logging.getLogger(__name__)


class _PagePipeline:
    """For a segment being received in chunks: a helper thread keeps the next chunk's pages
    populated while the current one lands (``Segment.populate_pages`` releases the GIL: the
    save thread must post its receives meanwhile, before the peer may send a byte), and
    landed chunks leave this process's page tables (the bytes stay in the store)."""

    def __init__(self, segment: Segment, chunk: int, nice: int = 0):
        self.segment = segment
        self.chunk = max(1, chunk)
        self._pool = background_executor("resilient_ckpt-prefault", nice)
        self._pool.submit(segment.populate_pages, 0, 2 * self.chunk)

    def landed(self, offset: int, nbytes: int) -> None:
        self.segment.release_pages(offset, nbytes)
        self._pool.submit(self.segment.populate_pages, offset + 2 * self.chunk, self.chunk)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Landing:
    """Lands incoming checkpoints in the node store: a segment claimed when the header
    arrives, populated one chunk ahead and released as chunks land (see _PagePipeline); the
    header is published only after the last byte (:meth:`publish`), and everything claimed is
    discarded if the transfer fails (:meth:`undo`)."""

    def __init__(self, store: CheckpointStore, chunk: int, nice: int = 0):
        self.store = store
        self.chunk = chunk
        self.nice = nice  # the page pipelines' threads: levels below the landing thread
        #: (segment, parsed header to publish, id): the header as ``check`` parsed it, so
        #: publishing it parses its 50k tensor entries no second time
        self.claimed: List[Tuple[Segment, CheckpointHeader, CheckpointId]] = []
        self.pipes: Dict[int, _PagePipeline] = {}

    def incoming(self, src: int, check: Callable[[bytes], CheckpointHeader]) -> Incoming:
        """An Incoming from ``src``; ``check(raw header)`` returns the parsed header or raises
        (an empty header means the sender could not send). A sender may seal the transfer
        with its final header (tensor table and checksums, computed while the bytes
        travelled; the first header then only announces id and size): that one is published
        instead, once it is checked to describe the same checkpoint."""
        first: Dict[str, CheckpointHeader] = {}

        def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
            h = check(hdr)
            seg = self.store.allocate(h.iteration, h.owner, nbytes, populate=False)
            self.claimed.append((seg, h, h.id))
            first["header"] = h
            self.pipes[src] = _PagePipeline(seg, self.chunk, self.nice)
            return seg.buffer

        def landed(lo: int, n: int) -> None:
            if src in self.pipes:
                self.pipes[src].landed(lo, n)

        def seal(final: bytes) -> None:
            h = first["header"]
            if not final:
                raise ReplicationError(
                    f"rank {src} could not save iteration {h.iteration} (see that rank's error); "
                    "the replica it sent was dropped"
                )
            f = check(final)
            if f.id != h.id or f.data_nbytes != h.data_nbytes:
                raise ReplicationError(
                    f"rank {src} announced {h.id} of {h.data_nbytes} bytes and sealed it with the "
                    f"header of {f.id} of {f.data_nbytes} bytes; both ends must run the same "
                    "resilient_ckpt"
                )
            for i, (seg, _, cid) in enumerate(self.claimed):
                if cid == h.id:
                    self.claimed[i] = (seg, f, cid)

        return Incoming(src, allocate, on_chunk=landed, seal=seal)

    def close(self) -> None:
        for pipe in self.pipes.values():
            pipe.close()

    def publish(self) -> List[CheckpointId]:
        out = []
        for seg, header, cid in self.claimed:
            seg.close()
            self.store.write_header(header)
            out.append(cid)
        return out

    def undo(self) -> None:
        # Only what this transfer created: a header of the same id that existed before made
        # allocate() fail, so it is not in ``claimed``.
        for seg, _, cid in self.claimed:
            seg.close()
            self.store.discard(cid)


def announcement(header: CheckpointHeader) -> bytes:
    """The first header of a sealed replica: the checkpoint's id and size, what its receiver
    allocates by (the tensor table and metadata follow, once, in the final header)."""
    return replace(header, tensors=(), meta=b"").pack()


class PeerReplicator:
    #: replicate() takes ``seal`` (see :class:`~.replicator.SealingReplicator`)
    seals_replicas = True

    def __init__(
        self, transport: P2PTransport, placement: Placement, store: CheckpointStore, rank: int, nice: int = 0
    ):
        self.transport = transport
        self.placement = placement
        self.store = store
        self.rank = rank
        #: nice levels below the calling thread for the threads that prefault landing pages
        self.nice = nice

    def _move(self, outgoing: List[Outgoing], landing: _Landing, incoming: List[Incoming]):
        """One exchange; received checkpoints are published after their last byte."""
        try:
            try:
                stats = self.transport.exchange(outgoing, incoming)
            finally:
                landing.close()
            received = landing.publish()
        except ReplicationError as e:
            landing.undo()
            peers = getattr(e, "peers", ())
            if not peers:
                raise
            nodes = ", ".join(f"rank {r} on node {self.placement.node_of(r)}" for r in peers)
            raise ReplicationError(f"{e} [unreachable or failed: {nodes}]") from e
        except BaseException:
            landing.undo()
            raise
        return stats, received

    def replicate(
        self,
        header: CheckpointHeader,
        segment: Segment,
        seal: Optional[Callable[[], CheckpointHeader]] = None,
        ready: Optional[Callable[[int], None]] = None,
    ) -> ReplicationResult:
        """Send this rank's checkpoint to its holders; receive the ones this rank holds.

        ``seal``: ``header`` lacks the payload's checksums, and ``seal()`` returns the final
        header, with them; it is called after the last byte was sent and travels behind the
        payload (only an :func:`announcement` of ``header`` goes first), so the checksums are
        computed while the bytes are on the wire. ``ready(end)``
        blocks until the segment's bytes up to ``end`` are staged: chunks leave as they are
        copied (:class:`~.replicator.SealingReplicator`)."""
        holders = self.placement.holders_of(self.rank)
        sources = self.placement.sources_for(self.rank)
        if not holders and not sources:
            return ReplicationResult()
        raw, final = b"", None
        if seal is None:
            raw = header.pack()
        else:
            # Sealed: the first header only announces the checkpoint (id and size: what the
            # receiver allocates by); its tensor table and metadata travel once, in the final
            # header (at 50k tensors they are megabytes).
            raw = announcement(header)
            final = lambda: seal().pack()  # noqa: E731
        # Pages already sent (received) leave this process's resident set as replication goes:
        # the bytes stay in the store, the trainer's RSS stays about one chunk above its state.
        outgoing = [
            Outgoing(dst, raw, segment.buffer, on_chunk=segment.release_pages, seal=final, ready=ready)
            for dst in holders
        ]

        def expect_from(src: int):
            def check(hdr: bytes) -> CheckpointHeader:
                if not hdr:
                    raise ReplicationError(
                        f"rank {src} could not save iteration {header.iteration} (see that "
                        "rank's error); its replica was not sent"
                    )
                h = CheckpointHeader.unpack(hdr, source=f"replica header from rank {src}")
                if h.owner != src or h.session != header.session or h.iteration != header.iteration:
                    raise ReplicationError(
                        f"rank {src} sent {h.id} while replicating iteration {header.iteration}"
                    )
                return h

            return check

        landing = _Landing(self.store, self.transport.chunk_bytes, self.nice)
        incoming = [landing.incoming(src, expect_from(src)) for src in sources]
        stats, received = self._move(outgoing, landing, incoming)
        return ReplicationResult(received, stats.bytes_sent, stats.bytes_received)

    def repair(self, iteration: int, repairs: Sequence[Repair]) -> ReplicationResult:
        """Carry out this rank's part of a healing plan (see :mod:`.healing`): send the
        copies it is the source of, from its node's store; land the ones it receives."""
        outgoing: List[Outgoing] = []
        maps = []
        for r in repairs:
            if r.source != self.rank:
                continue
            cid = CheckpointId(iteration, r.owner, self.store.session)
            try:
                reader = self.store.open(cid)
                raw = self.store.header_path(cid).read_bytes()
                n = reader.header.data_nbytes
                release = None
                if n:
                    # Not populated, and each chunk dropped from the page tables once sent:
                    # healing runs right after a restore, and mapping whole files would count
                    # them in the trainer's resident set (as replicate() avoids for saves).
                    m, buf = reader.map(populate=False)
                    maps.append(m)
                    release = functools.partial(drop_pages, m, length=n, base=buf.data_ptr())
                else:
                    buf = torch.empty(0, dtype=torch.uint8)
                outgoing.append(Outgoing(r.dest, raw, buf, on_chunk=release))
            except (StoreError, OSError) as e:
                # Still take part (an empty header tells the receiver at once).
                logger.warning("cannot send %s to rank %d for healing: %s", cid.stem(), r.dest, e)
                outgoing.append(Outgoing(r.dest, b"", torch.empty(0, dtype=torch.uint8)))

        def expect(r: Repair):
            def check(hdr: bytes) -> CheckpointHeader:
                if not hdr:
                    raise ReplicationError(
                        f"rank {r.source} could not send owner {r.owner}'s checkpoint of "
                        f"iteration {iteration} for healing (see that rank's log)"
                    )
                h = CheckpointHeader.unpack(hdr, source=f"healing header from rank {r.source}")
                if h.id != CheckpointId(iteration, r.owner, self.store.session):
                    raise ReplicationError(f"rank {r.source} sent {h.id} while healing owner {r.owner}")
                return h

            return check

        landing = _Landing(self.store, self.transport.chunk_bytes, self.nice)
        incoming = [landing.incoming(r.source, expect(r)) for r in repairs if r.dest == self.rank]
        if not outgoing and not incoming:
            return ReplicationResult()
        try:
            stats, received = self._move(outgoing, landing, incoming)
        finally:
            del outgoing
            maps.clear()  # unmapped once the last view is gone
        return ReplicationResult(received, stats.bytes_sent, stats.bytes_received)

    def abstain(self) -> None:
        """This rank's save failed: empty replicas to its holders, refuse its sources' ones."""
        holders = self.placement.holders_of(self.rank)
        sources = self.placement.sources_for(self.rank)
        if not holders and not sources:
            return

        def refuse(hdr: bytes, nbytes: int) -> torch.Tensor:
            raise ReplicationError("this rank's own save failed; replica dropped")

        empty = torch.empty(0, dtype=torch.uint8)
        self.transport.exchange(
            [Outgoing(dst, b"", empty) for dst in holders],
            [Incoming(src, refuse) for src in sources],
        )
