"""``MemoryStorageReader``: torch.distributed.checkpoint loads from resilient_ckpt's store.

A drop-in ``storage_reader`` for ``dcp.load``::

    dcp.load(state_dict, storage_reader=MemoryStorageReader(manager))

It loads the newest complete iteration (``CheckpointManager.load_local``'s choice: memory, or
the persistent DCP directory when memory holds nothing newer), in two collective steps:

1. ``read_metadata``: the checkpoint's DCP metadata (stored with the coordinator's payload,
   replicated like any data) — a restore that asks for that object only;
2. ``read_data``: the stored chunks and bytes items this rank's ReadItems name, restored by the
   manager from this node, a replica on this node, or a peer (a lost node's data from its
   replica), each checked against its checksum. Where a ReadItem is exactly a stored chunk
   and its destination is a contiguous CPU tensor of the stored dtype, the bytes land in the
   destination directly (the model's own memory, one copy); otherwise they are copied in.

With a ``checkpoint_id`` the load must find that iteration as the newest: the store restores
its newest complete iteration only, and loading an older one silently would be worse.
"""

from __future__ import annotations

import dataclasses
import io
import uuid
from typing import Any, Dict, List, Optional, Tuple

import torch
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from ..bits import copy_bits
from ..errors import CheckpointingException, ForeignCheckpointError, ValidationError
from ..manager.checkpoint_manager import CheckpointManager
from ..manager.metrics import LoadMetrics
from .backing import CheckpointId, ManagerBacked
from .checkpoint_id import iteration_from_checkpoint_id
from .metadata_codec import decode_metadata
from .payload import (
    FORMAT_KEY,
    PAYLOAD_VERSION,
    ReadAssignment,
    ShardKey,
    assign_reads,
    metadata_template,
    read_template,
    shard_key,
    stored_chunk,
)

__all__ = ["MemoryStorageReader"]


class MemoryStorageReader(ManagerBacked, StorageReader):
    """A DCP ``StorageReader`` backed by a :class:`~resilient_ckpt.CheckpointManager`.

    Args:
        manager: the job's CheckpointManager (the one its MemoryStorageWriter uses). Omitted:
            one is built from ``manager_kwargs`` and closed by :meth:`close`.
        checkpoint_id: the iteration the load must find (int, or a name ending in it). None:
            the newest complete one. ``dcp.load``'s ``checkpoint_id`` replaces it.

    After a load: ``iteration`` (what was loaded), ``last_load_metrics`` (the manager's, of the
    data: ``source`` is ``"persistent"`` when it came from the persistent tier) and
    ``metadata_load_metrics`` (of step 1: ``source == "peer"`` on a rank whose node lost its
    copy — healing right after step 1 puts it back, so step 2 may then read it locally).
    """

    def __init__(
        self,
        manager: Optional[CheckpointManager] = None,
        *,
        checkpoint_id: Optional[CheckpointId] = None,
        **manager_kwargs: Any,
    ):
        self._init_backing(manager, manager_kwargs)
        self.expected_iteration: Optional[int] = None
        self.iteration: Optional[int] = None
        #: the manager's metrics of step 1 (the metadata's restore: it shows where the newest
        #: checkpoint was found; healing after it may put a lost node's data back before step 2)
        self.metadata_load_metrics: Optional[LoadMetrics] = None
        #: what find_latest restored, for the next read_metadata
        self._found: Optional[Tuple[Metadata, int]] = None
        self._metadata: Optional[Metadata] = None
        self._load_id = uuid.uuid4().hex
        if checkpoint_id is not None:
            self.reset(checkpoint_id)

    # ---- StorageReader -----------------------------------------------------------------------

    def reset(self, checkpoint_id: Optional[CheckpointId] = None) -> None:
        """A new load; ``checkpoint_id`` (if given) names the iteration it must find. Raises
        ValueError for an id that names none."""
        if checkpoint_id is not None:
            self.expected_iteration = iteration_from_checkpoint_id(checkpoint_id)
            self._checkpoint_id = checkpoint_id
        self._load_id = uuid.uuid4().hex
        self._metadata = None
        self.iteration = None

    def find_latest(self) -> Optional[int]:
        """The iteration the next ``dcp.load`` through this reader loads — the newest complete
        one in memory, or the persistent tier's when memory holds nothing newer — or None when
        there is none (a first start). Collective. It is the load's first step (the metadata's
        restore), kept for that ``dcp.load``, so checking first costs nothing extra."""
        self._found = self._restore_metadata()
        return None if self._found is None else self._found[1]

    # No **kwargs: DCP would then retry a failed read_metadata as "rank-local metadata",
    # a second collective restore.
    def read_metadata(self) -> Metadata:
        """The newest complete checkpoint's DCP metadata (collective: every rank restores
        together, unless :meth:`find_latest` just did). Raises if there is none, or if it is not
        the one ``checkpoint_id`` names."""
        found, self._found = self._found, None
        if found is None:
            found = self._restore_metadata()
        if found is None:
            raise CheckpointingException(self._nothing_to_load())
        md, iteration = found
        if self.expected_iteration is not None and iteration != self.expected_iteration:
            raise ValidationError(
                f"checkpoint_id {self._checkpoint_id!r} names iteration {self.expected_iteration}, "
                f"but the newest complete checkpoint is iteration {iteration}; the store restores "
                "its newest complete iteration only: pass checkpoint_id=None (or that step)"
            )
        if md.storage_meta is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self._load_id
        self._metadata, self.iteration = md, iteration
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if kwargs.get("use_collectives", True) is False:
            raise ValidationError(
                "MemoryStorageReader needs collective loads (dcp.load's default): the store "
                "restores every rank together"
            )
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        """The coordinator sees every rank's ReadItems: it decides who asks the store for each
        chunk as its main replica (:func:`~.payload.assign_reads`); the decision reaches each
        rank in its plan's ``storage_data``."""
        md = self._metadata
        if md is None:
            raise CheckpointingException(
                "prepare_global_plan before read_metadata: call dcp.load, which orders them"
            )
        assignments = assign_reads([p.items for p in plans], md)
        return [dataclasses.replace(p, storage_data=a) for p, a in zip(plans, assignments)]

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future:
        """Restore what this rank's ReadItems need (collective) and hand it to ``planner``."""
        md = self._metadata
        if md is None or self.iteration is None:
            raise CheckpointingException("read_data before read_metadata: call dcp.load, which orders them")
        assignment = plan.storage_data
        if not isinstance(assignment, ReadAssignment):
            raise CheckpointingException(
                "the load plan carries no MemoryStorageReader assignment (storage_data); the "
                "planner's create_global_plan must keep each plan's storage_data"
            )
        targets, direct = self._destinations(plan.items, planner, md)
        template, slots = read_template(plan.items, md, assignment, direct)
        out = self.manager.load_local(template)
        if out is None or out[1] != self.iteration:
            raise CheckpointingException(
                f"the store's newest complete iteration changed during the load (metadata of "
                f"{self.iteration}, data of {None if out is None else out[1]}); was a save running "
                "at the same time? Load again"
            )
        state = out[0]
        for i, ri in enumerate(plan.items):
            if ri.type == LoadItemType.BYTE_IO:
                planner.load_bytes(ri, io.BytesIO(state["objects"][slots.objects[ri.storage_index.fqn]]))
                continue
            _, chunk = stored_chunk(md, ri.storage_index)
            stored = state["tensors"][slots.tensors[shard_key(ri.storage_index.fqn, chunk)]]
            target = targets[i]
            if not _same_memory(stored, target):
                src = _narrow(stored, ri.storage_offsets, ri.lengths)
                if src.shape != target.shape:
                    raise CheckpointingException(
                        f"{ri.storage_index.fqn!r}: the stored chunk gives {tuple(src.shape)}, the "
                        f"destination is {tuple(target.shape)}"
                    )
                copy_bits(target, src)
            planner.commit_tensor(ri, target)
        fut: Future = Future()
        fut.set_result(None)
        return fut

    @property
    def last_load_metrics(self) -> Optional[LoadMetrics]:
        return self.manager.last_load_metrics

    # ---- helpers -----------------------------------------------------------------------------

    def _destinations(
        self, items: List[ReadItem], planner: LoadPlanner, md: Metadata
    ) -> Tuple[Dict[int, torch.Tensor], Dict[ShardKey, torch.Tensor]]:
        """Each tensor item's destination (resolved once), and the ones the store can fill in
        place: exactly a stored chunk, contiguous, on CPU, in the stored dtype."""
        targets: Dict[int, torch.Tensor] = {}
        direct: Dict[ShardKey, torch.Tensor] = {}
        for i, ri in enumerate(items):
            if ri.type == LoadItemType.BYTE_IO:
                continue
            target = planner.resolve_tensor(ri).detach()
            targets[i] = target
            tmd, chunk = stored_chunk(md, ri.storage_index)
            key = shard_key(ri.storage_index.fqn, chunk)
            whole = all(o == 0 for o in ri.storage_offsets) and tuple(ri.lengths) == tuple(chunk.sizes)
            if (
                whole
                and key not in direct
                and target.device.type == "cpu"
                and target.is_contiguous()
                and target.dtype == tmd.properties.dtype
                and tuple(target.shape) == tuple(chunk.sizes)
            ):
                direct[key] = target
        return targets, direct

    def _restore_metadata(self) -> Optional[Tuple[Metadata, int]]:
        """Step 1 of a load: restore the metadata object only (collective)."""
        out = self.manager.load_local(metadata_template(self.manager.rank))
        if out is None:
            return None
        state, iteration = out
        self.metadata_load_metrics = self.manager.last_load_metrics
        version = state.get(FORMAT_KEY)
        if not isinstance(version, int) or not 1 <= version <= PAYLOAD_VERSION:
            raise ForeignCheckpointError(
                f"iteration {iteration} of session {self.manager.session_id!r} was not saved by "
                f"MemoryStorageWriter (payload version {version!r}); load it with "
                "CheckpointManager.load_local instead"
            )
        return decode_metadata(state["metadata"]), iteration

    def _nothing_to_load(self) -> str:
        m = self.manager
        tier = m.options.persistent.directory
        return (
            f"nothing to load: session {m.session_id!r} has no complete checkpoint in memory "
            f"({m.store.root})"
            + (f" nor in the persistent tier {tier}" if tier else " and no persistent tier is configured")
            + "; start from scratch, or check session_id and store_root (a restarted job must "
            "use the same ones)"
        )


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """``a`` is ``b``'s memory (the store filled the destination in place)."""
    return (
        a.device == b.device
        and a.data_ptr() == b.data_ptr()
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.dtype == b.dtype
    )


def _narrow(t: torch.Tensor, offsets, lengths) -> torch.Tensor:
    for axis, (off, n) in enumerate(zip(offsets, lengths)):
        if n != t.shape[axis] or off != 0:
            t = t.narrow(axis, off, n)
    return t
