"""Replication: placement (who holds whose replicas; pure) and transports (moving the bytes)."""

from .placement import (
    Fetch,
    Placement,
    clique_placement,
    placement_from_env,
    plan_retrieval,
    ring_placement,
)
from .transport import (
    Incoming,
    Outgoing,
    P2PTransport,
    PeerStats,
    TransferStats,
    new_checkpoint_group,
)

__all__ = [
    "Fetch",
    "Incoming",
    "Outgoing",
    "P2PTransport",
    "PeerStats",
    "Placement",
    "TransferStats",
    "clique_placement",
    "new_checkpoint_group",
    "placement_from_env",
    "plan_retrieval",
    "ring_placement",
]
