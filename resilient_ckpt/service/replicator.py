"""Service-mode replication: the trainer hands its published checkpoint to the node daemon.

:class:`ServiceReplicator` has the interface of :class:`~resilient_ckpt.replication.peer.
PeerReplicator`, so ``CheckpointManager`` uses either. ``replicate`` commits the checkpoint the
trainer just published to its node's daemon and waits until every holder node's daemon stored
a copy; the daemon keeps pushing even if the trainer dies after the COMMIT was answered.
Nothing arrives at a trainer in service mode (daemons receive replicas), so ``received`` is
always empty and ``abstain`` has nothing to tell anyone.
"""

from __future__ import annotations

import time
from typing import Optional

from ..errors import ReplicationError, StoreError
from ..memory.layout import CheckpointHeader
from ..memory.segment import Segment
from ..memory.store import CheckpointStore
from ..replication.peer import ReplicationResult
from .client import DaemonClient, ReplicationState, header_digest, raise_unless_replicating

#: Longest single long-poll; the loop re-commits (idempotent) until the overall deadline, which
#: also re-arms replication if the daemon restarted meanwhile.
_POLL_S = 10.0


class ServiceReplicator:
    """Replicate through the node daemon (service mode).

    Args:
        client: connected to this node's daemon, for the job's session.
        store: this node's store (the daemon's store root), where the trainer published.
        rank: this trainer's rank (the owner of what it commits).
        timeout_s: how long ``replicate`` waits for every holder (default: the client's timeout).
    """

    def __init__(
        self, client: DaemonClient, store: CheckpointStore, rank: int, timeout_s: Optional[float] = None
    ):
        if store.session != client.session:
            raise ReplicationError(
                f"the store serves session {store.session!r} but the daemon client session {client.session!r}; "
                "use the same session for both"
            )
        self.client = client
        self.store = store
        self.rank = rank
        self.timeout_s = client.timeout_s if timeout_s is None else float(timeout_s)
        self.last_state: Optional[ReplicationState] = None

    def replicate(self, header: CheckpointHeader, segment: Segment) -> ReplicationResult:
        """COMMIT ``header``'s published checkpoint and wait until it is replicated.

        Raises ReplicationError naming the holder node that failed (or the timeout).
        """
        cid = header.id
        if cid.owner != self.rank:
            raise ReplicationError(f"rank {self.rank} cannot commit rank {cid.owner}'s checkpoint")
        try:
            raw = self.store.header_path(cid).read_bytes()  # the exact published bytes
        except FileNotFoundError:
            raise StoreError(
                f"{cid.stem()} is not published in {self.store.dir}: publish before replicating"
            ) from None
        digest = header_digest(raw)
        deadline = time.monotonic() + self.timeout_s
        while True:
            remaining = deadline - time.monotonic()
            state = self.client.commit(
                cid.iteration,
                cid.owner,
                header.world_size,
                digest,
                total_bytes=header.data_nbytes,
                wait_s=max(0.001, min(_POLL_S, remaining)),
            )
            self.last_state = state
            raise_unless_replicating(state, self.client.session)
            if state.state == "replicated":
                return ReplicationResult(received=[], bytes_out=state.bytes_out, bytes_in=0)
            if time.monotonic() >= deadline:
                raise ReplicationError(
                    f"replication of iteration {cid.iteration} of rank {cid.owner} is not finished after "
                    f"{self.timeout_s:g} s: holder nodes {list(state.holders)}, acknowledged "
                    f"{list(state.acked)}; fix: check those nodes' daemons (resilient-ckpt status) or raise "
                    "timeout_s"
                )

    def abstain(self) -> None:
        """This rank's save failed: in service mode no peer waits on this rank, nothing to do."""
        return None


__all__ = ["ServiceReplicator"]
