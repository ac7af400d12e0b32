"""The replicator: the manager's extension point for getting a published checkpoint to its
holders. Two implementations: peers over torch.distributed (``replication.peer``, embedded
mode) and the node daemon (``service.replicator``, service mode)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, List, Optional, Protocol, runtime_checkable

from ..memory.layout import CheckpointHeader, CheckpointId
from ..memory.segment import Segment


@dataclass
class ReplicationResult:
    #: replicas this rank published in its node's store (discarded if the save is not agreed)
    received: List[CheckpointId] = field(default_factory=list)
    bytes_out: int = 0
    bytes_in: int = 0


@runtime_checkable
class Replicator(Protocol):
    """What ``CheckpointManager`` needs to replicate one save (called on the save thread)."""

    def replicate(self, header: CheckpointHeader, segment: Segment) -> ReplicationResult:
        """Get this rank's published checkpoint to its holders (and, for peers, receive the
        ones this rank holds); raise on failure. Every rank calls it at the same save."""
        ...

    def abstain(self) -> None:
        """This rank's save failed before replicating: take part anyway, so partners learn
        at once instead of after a timeout."""
        ...


@runtime_checkable
class SealingReplicator(Protocol):
    """A replicator that can send a checkpoint while it is still being staged and before its
    checksums are known: ``header`` without them (announced by id and size), ``ready(end)``
    blocking until the segment's bytes up to ``end`` are copied (each chunk leaves as soon as
    it is), ``seal()`` the final header, called after the last byte left and sent behind the
    payload (the peers', over the transport). Time to durable is then the link's time plus the
    first chunk's copy, not plus every copy and checksum (issue 34)."""

    #: marks the capability (a runtime check sees attributes, not signatures)
    seals_replicas: bool

    def replicate(
        self,
        header: CheckpointHeader,
        segment: Segment,
        seal: Optional[Callable[[], CheckpointHeader]] = None,
        ready: Optional[Callable[[int], None]] = None,
    ) -> ReplicationResult: ...

    def abstain(self) -> None: ...
