"""Embedded-mode replication: trainer ranks exchange checkpoint segments directly.

Each rank sends its published checkpoint (header + segment) to the placement's holders and
receives, into freshly allocated segments of its own node's store, the checkpoints of the
ranks it holds; a received replica's header is published after its last byte. A rank whose
own save failed still takes part (:meth:`PeerReplicator.abstain`: empty replicas out, refusals
in), so its partners learn it at once instead of after the transport timeout.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import List, Tuple

import torch

from ..errors import ReplicationError
from ..store import CheckpointHeader, CheckpointId, CheckpointStore, Segment
from .placement import Placement
from .transport import Incoming, Outgoing, P2PTransport


@dataclass
class ReplicationResult:
    #: replicas this rank published in its node's store (discarded if the save is not agreed)
    received: List[CheckpointId] = field(default_factory=list)
    bytes_out: int = 0
    bytes_in: int = 0


class _PagePipeline:
    """For a segment being received in chunks: a helper thread keeps the next chunk's pages
    populated while the current one lands, and landed chunks leave this process's page tables
    (the bytes stay in the store)."""

    def __init__(self, segment: Segment, chunk: int):
        self.segment = segment
        self.chunk = max(1, chunk)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="resilient_ckpt-prefault")
        self._pool.submit(segment.populate_pages, 0, 2 * self.chunk)

    def landed(self, offset: int, nbytes: int) -> None:
        self.segment.release_pages(offset, nbytes)
        self._pool.submit(self.segment.populate_pages, offset + 2 * self.chunk, self.chunk)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class PeerReplicator:
    def __init__(self, transport: P2PTransport, placement: Placement, store: CheckpointStore, rank: int):
        self.transport = transport
        self.placement = placement
        self.store = store
        self.rank = rank

    def replicate(self, header: CheckpointHeader, segment: Segment) -> ReplicationResult:
        """Send this rank's checkpoint to its holders; receive the ones this rank holds."""
        holders = self.placement.holders_of(self.rank)
        sources = self.placement.sources_for(self.rank)
        if not holders and not sources:
            return ReplicationResult()
        raw = header.pack()
        # Pages already sent (received) leave this process's resident set as replication goes:
        # the bytes stay in the store, the trainer's RSS stays about one chunk above its state.
        outgoing = [Outgoing(dst, raw, segment.buffer, on_chunk=segment.release_pages) for dst in holders]
        claimed: List[Tuple[Segment, bytes, CheckpointId]] = []

        def allocate_for(src: int):
            def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
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
                # Populated one chunk ahead of the data and released once it landed (see
                # _PagePipeline): fast writes, resident set about two chunks.
                seg = self.store.allocate(h.iteration, h.owner, nbytes, populate=False)
                claimed.append((seg, hdr, h.id))
                pipes[src] = _PagePipeline(seg, self.transport.chunk_bytes)
                return seg.buffer

            return allocate

        pipes: dict = {}

        def landed_for(src: int):
            return lambda lo, n: pipes[src].landed(lo, n) if src in pipes else None

        incoming = [Incoming(src, allocate_for(src), on_chunk=landed_for(src)) for src in sources]
        result = ReplicationResult()
        try:
            try:
                stats = self.transport.exchange(outgoing, incoming)
            finally:
                for pipe in pipes.values():
                    pipe.close()
            for seg, hdr, cid in claimed:
                seg.close()
                self.store.write_raw_header(hdr, cid)
                result.received.append(cid)
        except BaseException:
            # Only what this save created: a replica header of the same id that existed before
            # made allocate() fail, so it is not in ``claimed``.
            for seg, _, cid in claimed:
                seg.close()
                self.store.discard(cid)
            raise
        result.bytes_out = stats.bytes_sent
        result.bytes_in = stats.bytes_received
        return result

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
