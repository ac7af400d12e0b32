"""What saves, loads and healing report: metrics dataclasses and the save's handle."""

from __future__ import annotations

from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..memory.staging import StagingHandle


@dataclass
class SaveMetrics:
    iteration: int
    stall_s: float = 0.0
    staging_s: float = 0.0
    #: the save thread's wait for the checksums: all of their time, or (peer replicas, which
    #: are sent while the checksums are computed) what was left of it after the transfer
    checksum_s: float = 0.0
    publish_s: float = 0.0
    replication_s: float = 0.0
    agreement_s: float = 0.0
    durable_s: float = 0.0
    #: after ``durable_s``: the all-reduce confirming every rank heard the agreement, which
    #: retention waits for (manager/save_completion.py says why)
    confirmation_s: float = 0.0
    bytes_staged: int = 0
    bytes_replicated_out: int = 0
    bytes_replicated_in: int = 0
    #: the save reused the previous save's structure, encoding and layout (a cached save of an
    #: unchanged plain state dict: no per-shard encoding on the calling thread)
    structure_cached: bool = False
    #: host memory the node's store (this session) occupies once this save is complete and
    #: older iterations are retired: allocated blocks of every file — own data, replicas or
    #: parity, headers, the free pool (the next save's spare segment among them)
    store_bytes: int = 0
    #: redundancy="parity": seconds coding this rank's parity blocks, and the data bytes coded
    parity_encode_s: float = 0.0
    parity_coded_bytes: int = 0
    #: host memory page-locked on the calling thread during ``save_local`` (GPU state: the
    #: store's segments are locked ahead, off the save's path; anything but 0 is a regression)
    pinned_on_save_bytes: int = 0
    #: host memory this process holds page-locked once the save is complete (its segments)
    pinned_held_bytes: int = 0
    #: the GPU tensors were staged through a copy within the GPU (the stall ended there)
    device_snapshot: bool = False
    #: started before the ranks voted (``vote_in_background``) and dropped on every rank: a
    #: rank was busy or its structure had changed (``SaveHandle.skipped``)
    skipped: bool = False

    def as_dict(self) -> Dict[str, float]:
        return dict(self.__dict__)


@dataclass
class LoadMetrics:
    iteration: int = -1
    source: str = ""
    source_rank: int = -1
    retrieve_s: float = 0.0
    to_state_dict_s: float = 0.0
    total_s: float = 0.0
    bytes_read: int = 0
    attempts: int = 0
    failed_copies: List[Tuple[int, int]] = field(default_factory=list)
    #: when nothing could be restored although memory held part of a checkpoint: the owner
    #: ranks whose data was missing from the newest iteration
    missing_owners: List[int] = field(default_factory=list)
    #: seconds per phase of the restore on this rank (``resilient_ckpt.timing``: collectives,
    #: reads+checksums, peer transfer, copy to targets, device wait, decode, other)
    phases: Dict[str, float] = field(default_factory=dict)
    #: seconds the reader threads spent for it, summed over threads (pread, checksum, ring slot
    #: wait, H2D queued): what the "reads+checksums" phase waited for
    reader_seconds: Dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class HealMetrics:
    """Re-creating the copies a restore found missing (see ``replication.healing``)."""

    iteration: int
    copies: int = 0  # copies the plan re-created, over the whole job
    bytes: int = 0  # their bytes, over the whole job
    bytes_in: int = 0  # this rank's received bytes
    bytes_out: int = 0  # this rank's sent bytes
    seconds: float = 0.0  # from the restore's end to redundancy agreed whole
    whole: bool = False  # every copy the placement asks for exists again
    unrepairable: List[int] = field(default_factory=list)

    def as_dict(self) -> Dict[str, Any]:
        return dict(self.__dict__)


class SaveHandle:
    """The future of one ``save_local``."""

    def __init__(
        self,
        iteration: int,
        staging: StagingHandle,
        future: Future,
        metrics: SaveMetrics,
        dropped: Optional[Callable[[], bool]] = None,
    ):
        self.iteration = iteration
        self._staging = staging
        self._future = future
        self.metrics = metrics
        self._dropped = dropped

    def skipped(self) -> bool:
        """True if this save was dropped on every rank: it started before the ranks' vote
        (``vote_in_background``), which found a rank busy or with a changed structure. Waits
        for that vote's answer (normally in by the next step); False for any other save."""
        return self._dropped is not None and self._dropped()

    def fence(self, stream=None) -> None:
        """Order the mutation of the saved tensors after their copies, without a CPU wait for
        device copies: later work on ``stream`` (default: the current CUDA stream) runs after
        the copies that read CUDA tensors; the copies of CPU tensors are waited for here. Call
        it right before mutating (an optimizer step); ``wait_staged`` blocks instead."""
        self.metrics.stall_s += self._staging.fence(stream)

    def wait_staged(self) -> float:
        """Block until every saved tensor has been read, so it may be mutated (the optimizer
        step): its bytes are in the store's segment or — after a device snapshot (a GPU save
        without a ready page-locked segment) — in the snapshot on the GPU, whose way down to
        the segment goes on in the background (:meth:`wait` and the agreement wait for it).
        Returns the seconds waited; re-raises a failed copy."""
        waited = self._staging.wait_sources()
        self.metrics.stall_s += waited
        return waited

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once the save has finished, either way (now, if it has)."""
        self._future.add_done_callback(lambda _f: fn())

    def wait(self, timeout: Optional[float] = None) -> SaveMetrics:
        """Block until stored + replicated + agreed complete; raises CheckpointingException."""
        self._future.result(timeout)
        return self.metrics

    def exception(self) -> Optional[BaseException]:
        return self._future.exception() if self._future.done() else None
