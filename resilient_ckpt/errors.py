"""Exception types.

Every error derives from nvidia-resiliency-ext's ``CheckpointingException`` so code written
for its ``LocalCheckpointManager`` (Megatron-LM's local-checkpoint path) catches ours too.
Messages name the offending key/file/peer and the fix.
"""

from __future__ import annotations

import sys

from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.base_manager import (
    CheckpointingException as _NrxCheckpointingException,
)


class CheckpointingException(_NrxCheckpointingException):
    """Base class of every resilient_ckpt error."""


class ValidationError(CheckpointingException, ValueError):
    """A sharded state dict is inconsistent (overlap, gap, dtype or shape mismatch, bad key)."""


class IterationOrderError(ValidationError, AssertionError):
    """A save's iteration does not increase. Also an ``AssertionError``: that is what
    nvidia-resiliency-ext's ``LocalCheckpointManager.save`` raises for it."""


class StrictnessError(ValidationError):
    """A load's keys differ from the checkpoint's under a raising ``StrictHandling``."""


_MCORE_STRICTNESS: dict = {}


def strictness_error(message: str) -> StrictnessError:
    """A :class:`StrictnessError` that is also Megatron-core's ``CheckpointingException`` when
    Megatron-core is loaded (its strict-load callers catch that class) — looked up, never
    imported: resilient_ckpt does not depend on Megatron-core."""
    mcore = sys.modules.get("megatron.core.dist_checkpointing.core")
    base = getattr(mcore, "CheckpointingException", None)
    if not (isinstance(base, type) and issubclass(base, Exception)):
        return StrictnessError(message)
    cls = _MCORE_STRICTNESS.get(base)
    if cls is None:
        cls = _MCORE_STRICTNESS[base] = type(
            "StrictnessError",
            (StrictnessError, base),
            {"__module__": __name__, "__doc__": StrictnessError.__doc__},
        )
    return cls(message)


class HollowStateError(CheckpointingException):
    """An operation needs tensors but the state dict is hollow (or the reverse)."""


class CodecError(CheckpointingException, ValueError):
    """A value cannot be encoded without pickle, or stored bytes do not decode."""


class StoreError(CheckpointingException):
    """The in-memory store cannot satisfy a request."""


class StoreFullError(StoreError):
    """Not enough shared memory or memory budget for a checkpoint; nothing was written."""


class CorruptCheckpointError(StoreError):
    """Stored bytes fail their checksum or their header does not parse."""


class ForeignCheckpointError(StoreError):
    """Stored data belongs to another session, world size or format version."""


class ReplicationError(CheckpointingException):
    """A replica could not be sent or received (peer dead, timeout, mismatch)."""


class CollectiveTimeoutError(CheckpointingException, TimeoutError):
    """A collective among checkpoint ranks did not finish in time."""


class NoReplicaError(ReplicationError):
    """No live holder can serve some rank's checkpoint (all replicas lost or corrupt)."""


class PeerFailedError(CheckpointingException):
    """Another rank failed a step that every rank takes together; this rank stops with it.

    ``rank`` is the (global) rank that failed first and ``reason`` its error, so every rank
    reports the same cause."""

    def __init__(self, message: str, rank: int = -1, reason: str = ""):
        super().__init__(message)
        self.rank = rank
        self.reason = reason
