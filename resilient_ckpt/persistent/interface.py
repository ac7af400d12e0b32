"""The persistent tier as the checkpoint manager sees it.

:class:`PersistentTierProtocol` lists exactly what
:class:`~resilient_ckpt.manager.checkpoint_manager.CheckpointManager` calls on its tier;
:class:`~.tier.PersistentTier` is the implementation, and another durable backend only needs
these members. The values those methods return live here too (:class:`DurableCheckpoint`,
:class:`FlushHandle`, :class:`FlushResult`, :class:`LoadReport`), so this module stays light:
it imports neither torch nor DCP.
"""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Protocol, Tuple

if TYPE_CHECKING:  # annotations only: keep this module free of torch imports
    import torch.distributed as dist

    from ..memory.store import CheckpointStore


@dataclass(frozen=True)
class DurableCheckpoint:
    """A complete checkpoint of the persistent tier."""

    iteration: int
    path: str
    manifest: Dict[str, Any] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class FlushResult:
    """What one flush wrote (this rank's figures and the whole group's)."""

    iteration: int
    path: str
    #: tensor bytes this rank wrote
    bytes_written: int
    #: tensor bytes all ranks wrote
    total_bytes: int
    #: this rank's seconds from the agreed start until DCP's save returned here
    seconds: float
    #: seconds until the checkpoint was complete (metadata written, directory in place)
    durable_seconds: float

    @property
    def throughput_gbps(self) -> float:
        """Whole-group tensor bytes per second until durable, in GB/s (10^9)."""
        return self.total_bytes / self.durable_seconds / 1e9 if self.durable_seconds > 0 else 0.0


@dataclass(frozen=True)
class LoadReport:
    """Where a rank restored from."""

    tier: str  # "memory" or "persistent"
    iteration: int
    source: str  # store source ("local", "peer") or the checkpoint directory
    seconds: float
    bytes_read: int = 0
    two_stage: bool = False


class FlushHandle:
    """The future of one flush request: ``wait()`` returns a :class:`FlushResult`, or None when
    the round found nothing newer than the last durable checkpoint to flush."""

    def __init__(self, future: Future, kind: str):
        self._future = future
        self.kind = kind

    def wait(self, timeout: Optional[float] = None) -> Optional[FlushResult]:
        return self._future.result(timeout)

    def done(self) -> bool:
        return self._future.done()

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None


class PersistentTierProtocol(Protocol):
    """What the checkpoint manager uses of a persistent tier (all collective over the tier's
    group unless noted)."""

    #: where the checkpoints are (named in the manager's messages)
    directory: Path
    #: where the last :meth:`load` restored from (None before any load)
    last_load: Optional[LoadReport]

    def maybe_flush(self, store: "CheckpointStore", iteration: int) -> Optional[FlushHandle]:
        """After every complete save: record it and flush every n saves (in the background)."""
        ...

    def flush(self, store: "CheckpointStore", iteration: Optional[int] = None) -> FlushHandle:
        """Flush ``iteration`` (default: the newest complete one) in the background."""
        ...

    def pinned_iterations(self) -> List[int]:
        """Iterations a flush is reading from the store now; retention keeps them (local)."""
        ...

    def agreed_latest(self) -> Optional[DurableCheckpoint]:
        """The newest complete durable checkpoint of the session, the same on every rank."""
        ...

    def load(
        self, template: Optional[Any] = None, parallelization_group: Optional["dist.ProcessGroup"] = None
    ) -> Optional[Tuple[Any, int]]:
        """Restore the newest durable checkpoint: ``(state_dict, iteration)`` or None."""
        ...

    def install_sigterm_handler(self) -> None:
        """Flush the newest complete iteration on SIGTERM (call from the main thread)."""
        ...

    def close(self) -> None:
        """Finish queued flushes and stop (every rank together)."""
        ...
