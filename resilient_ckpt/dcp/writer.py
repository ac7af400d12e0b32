"""``MemoryStorageWriter``: torch.distributed.checkpoint saves into resilient_ckpt's store.

A drop-in ``storage_writer`` for ``dcp.save`` / ``dcp.async_save``::

    manager = CheckpointManager(session_id="run7", replication_factor=2, persistent_dir=...)
    writer = MemoryStorageWriter(manager)
    fut = dcp.async_save(state_dict, storage_writer=writer, checkpoint_id=f"{folder}/step-{step}",
                         process_group=writer.process_group)  # or resilient_ckpt.dcp.async_save

DCP's planner decides what each rank writes; ``write_data`` hands exactly those items (and,
on the coordinator, the global metadata) to ``CheckpointManager.save_local`` as this rank's
payload for the iteration named by ``checkpoint_id`` (:mod:`.checkpoint_id`), and returns
once the manager's agreement says the iteration is complete on every rank: stored, checksummed
and replicated to another node. A save that fails anywhere raises on every rank, through
``dcp.save`` or the future ``dcp.async_save`` returned.

``async_save``: the writer is its own stager and copies nothing in ``stage``; DCP's save thread
stages the items straight into the node's store while ``async_save`` waits in
``synchronize_staging`` (:mod:`.gate`), so the caller's stall is planning plus one copy into
memory that is already mapped, and the returned future completes at the agreement.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, List, Optional

import torch
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
from torch.distributed.checkpoint.metadata import STATE_DICT_TYPE, Metadata, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from ..errors import ValidationError
from ..manager.checkpoint_manager import CheckpointManager
from ..manager.metrics import SaveMetrics
from .backing import CheckpointId, ManagerBacked
from .checkpoint_id import iteration_from_checkpoint_id
from .gate import StagingGate
from .metadata_codec import encode_metadata
from .payload import build_payload

__all__ = ["MemoryStorageWriter", "async_save"]


class MemoryStorageWriter(ManagerBacked, StorageWriter, AsyncStager):
    """A DCP ``StorageWriter`` backed by a :class:`~resilient_ckpt.CheckpointManager`.

    Args:
        manager: the job's CheckpointManager (share it with the MemoryStorageReader).
            Omitted: one is built from ``manager_kwargs`` (``session_id=``, ``store_root=``,
            ``replication_factor=``, ``persistent_dir=``, ...) and closed by :meth:`close`.
        checkpoint_id: the iteration to save as, when DCP is not given one: an int, or a
            str/path whose last component ends in it (``".../step-100"``). ``dcp.save`` /
            ``dcp.async_save``'s ``checkpoint_id`` replaces it.

    One save at a time per writer, as with any DCP writer (wait for the previous
    ``async_save`` future before the next, as torchtitan does). ``async_save`` must use
    ``async_checkpointer_type=THREAD`` (the default): the manager's threads and process groups
    cannot move to another process. ``last_save_metrics``: the manager's timings of the last
    save through this writer.
    """

    # async_save waits in synchronize_staging until the items are in the store.
    _synchronize_after_execute: bool = True

    def __init__(
        self,
        manager: Optional[CheckpointManager] = None,
        *,
        checkpoint_id: Optional[CheckpointId] = None,
        **manager_kwargs: Any,
    ):
        self._init_backing(manager, manager_kwargs)
        self.iteration: Optional[int] = None
        self._save_id = uuid.uuid4().hex
        self._is_coordinator = False
        self._rank = self.manager.rank
        #: the gate the next save thread opens, and the one async_save's caller waits on
        self._gate: Optional[StagingGate] = None
        self._pending_gate: Optional[StagingGate] = None
        #: async_save: the caller's CUDA stream, captured in stage() (its own thread)
        self._caller_stream: Any = None
        self.last_save_metrics: Optional[SaveMetrics] = None
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    @property
    def process_group(self):
        """The group to pass as ``dcp.async_save(..., process_group=writer.process_group)``: a
        gloo group of every rank made once per manager for DCP's planning collectives
        (:meth:`CheckpointManager.dcp_process_group`). Without it DCP's async thread runs them
        on the default group while the training loop's collectives (DDP's backward all-reduce)
        run there too, and both deadlock. Collective on first use: every rank, same point."""
        return self.manager.dcp_process_group()

    # ---- StorageWriter -----------------------------------------------------------------------

    def reset(self, checkpoint_id: Optional[CheckpointId] = None) -> None:
        """A new save; ``checkpoint_id`` (if given) names its iteration. Raises ValueError for an
        id that names none (see :mod:`resilient_ckpt.dcp.checkpoint_id`)."""
        with self._guard():
            if checkpoint_id is not None:
                self.iteration = iteration_from_checkpoint_id(checkpoint_id)
                self._checkpoint_id = checkpoint_id
            self._save_id = uuid.uuid4().hex

    def storage_meta(self) -> Optional[StorageMeta]:
        with self._guard():
            return self._storage_meta()

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        with self._guard():
            if kwargs.get("use_collectives", True) is False:
                raise ValidationError(
                    "MemoryStorageWriter needs dcp.save(..., use_collectives=True) (the default): "
                    "the store agrees on every save collectively"
                )
            if self.iteration is None:
                raise ValidationError(
                    "MemoryStorageWriter does not know which iteration this save is: pass "
                    "checkpoint_id=<step> (or a name ending in it, e.g. '.../step-100') to "
                    "dcp.save / dcp.async_save or to MemoryStorageWriter"
                )
            self._is_coordinator = is_coordinator
            rank = kwargs.get("rank")
            self._rank = self.manager.rank if rank is None else int(rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: List[SavePlan]) -> List[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future:
        """Save this rank's items as its payload of the iteration; return when every rank's
        save is agreed complete (raises CheckpointingException on every rank otherwise)."""
        gate, self._gate = self._gate, None
        stream, self._caller_stream = self._caller_stream, None
        results: List[WriteResult] = []
        is_coordinator = self._is_coordinator

        def payload():
            # Built inside save_local, so an error here (on any rank) fails the save on every
            # rank together instead of leaving the others waiting in the store's collectives.
            md = self._metadata_bytes(planner) if is_coordinator else None
            built, results[:] = build_payload(plan.items, planner, self._rank, md)
            return built

        try:
            handle = self.manager.save_local(payload, self.iteration, is_async=True)
            # The caller may mutate once this returns (sync save) or the gate opens
            # (async_save): GPU copies ordered before its stream's later work, CPU ones done.
            handle.fence(stream)
        finally:
            if gate is not None:
                gate.release()
        handle.wait()
        self.last_save_metrics = handle.metrics
        fut: Future = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: List[List[WriteResult]]) -> None:
        # Nothing left to write: the metadata went into the coordinator's payload in
        # write_data, and every rank's save is agreed. Fill the fields FileSystemWriter fills,
        # so the Metadata dcp.save returns reads the same.
        metadata.version = CURRENT_DCP_VERSION
        metadata.storage_meta = self._storage_meta()

    # ---- AsyncStager -------------------------------------------------------------------------

    def stage(self, state_dict: STATE_DICT_TYPE) -> STATE_DICT_TYPE:
        """No copy here: the save thread copies the planned items straight into the store,
        and ``synchronize_staging`` holds ``async_save``'s caller until it has."""
        gate = StagingGate(self.manager.timeout_s)
        self._gate = self._pending_gate = gate
        # async_save: write_data runs on another thread; the fence is for the caller's stream.
        self._caller_stream = torch.cuda.current_stream() if torch.cuda.is_initialized() else None
        return state_dict

    def synchronize_staging(self) -> None:
        gate, self._pending_gate = self._pending_gate, None
        if gate is not None:
            gate.wait()

    # ---- helpers -----------------------------------------------------------------------------

    def _storage_meta(self) -> StorageMeta:
        cid = self._checkpoint_id
        return StorageMeta(checkpoint_id=str(cid) if isinstance(cid, int) else cid, save_id=self._save_id)

    def _metadata_bytes(self, planner: SavePlanner) -> bytes:
        md = getattr(planner, "metadata", None)
        if not isinstance(md, Metadata):
            raise ValidationError(
                f"{type(planner).__name__} keeps no global Metadata (.metadata) when write_data "
                "runs; MemoryStorageWriter stores the checkpoint's metadata with its data, so it "
                "needs DefaultSavePlanner or a subclass of it (they keep it)"
            )
        return encode_metadata(
            dataclasses.replace(md, version=CURRENT_DCP_VERSION, storage_meta=self._storage_meta())
        )

    def _guard(self):
        """Calls from a save thread: attach it to async_save's gate; open the gate if the call
        fails (the save ends here and stages nothing)."""
        return _GateGuard(self._gate)


class _GateGuard:
    def __init__(self, gate: Optional[StagingGate]):
        self.gate = gate

    def __enter__(self) -> None:
        if self.gate is not None:
            self.gate.attach()

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is not None and self.gate is not None:
            self.gate.release()
        return False


def async_save(
    state_dict: STATE_DICT_TYPE,
    *,
    checkpoint_id: CheckpointId,
    storage_writer: MemoryStorageWriter,
    **kwargs: Any,
):
    """``dcp.async_save`` into the manager's store with DCP's collectives on the writer's own
    group (:attr:`MemoryStorageWriter.process_group`) — what a training loop that keeps
    running collectives on the default group while the save is in flight needs (DDP does in
    every backward). Other keyword arguments go to ``dcp.async_save`` as they are; an explicit
    ``process_group=`` wins. Returns DCP's future (complete at the store's agreement)."""
    import torch.distributed.checkpoint as dcp

    kwargs.setdefault("process_group", storage_writer.process_group)
    return dcp.async_save(state_dict, checkpoint_id=checkpoint_id, storage_writer=storage_writer, **kwargs)
