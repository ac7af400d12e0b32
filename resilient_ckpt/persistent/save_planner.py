"""Our DCP save planner: :class:`ResilientSavePlanner` and the pure global planning behind it.

- replicated pieces are written once: every rank offers what it holds, and the coordinator
  assigns each distinct chunk to one holder with :func:`distribution.assign_shards`, the
  function the in-memory tier uses (same inputs, same answer), balancing bytes;
  ShardedTensors whose ``data`` is None are metadata only (another rank saves them);
- plan caching: a rank whose local plan equals the previous one sends an empty marker
  instead; the coordinator reuses its cached plans (``stats.full_plans_received`` counts what
  it really received);
- the global plan is validated (every chunk inside its tensor, no overlap, full coverage,
  one dtype and size per key), failing with the key and the offending chunks named;
- non-tensor values are stored with our pickle-free codec (:mod:`resilient_ckpt.model.codec`).
  Plain DCP loads every tensor of such a checkpoint; the non-tensor entries need
  :class:`~.load_planner.ResilientLoadPlanner`.

:func:`build_global_save_plan` is the coordinator's step as a pure function: survey the
local plans (:class:`PlanSurvey`), choose one writer per chunk, keep each rank's share of the
items, describe the result as metadata, validate it.
"""

from __future__ import annotations

import dataclasses
import io
import math
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, DefaultDict, Dict, List, Optional, Sequence, Set, Tuple, Union

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import (
    BytesIOWriteData,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)

from ..errors import ValidationError
from ..model import codec
from ..parallel.distribution import assign_shards
from .checks import raise_problems, validate_global_plan
from .flatten import EMPTY_FLAT, ChunkId, flatten_for_save
from .layout import RawBytes, StatePath


@dataclass(frozen=True)
class LocalPlanData:
    """What a rank's local save plan tells the coordinator besides its write items."""

    #: (fqn, path) pairs: torch's flatten mapping, so the metadata can rebuild nesting
    mappings: Tuple[Tuple[str, StatePath], ...]
    #: chunk ids (fqn, offsets) this rank holds as the main replica
    mains: Tuple[Tuple[str, Tuple[int, ...]], ...]


@dataclass
class SavePlannerStats:
    """Counters of the last save (the coordinator's ``full_plans_received`` is what the plan
    cache saves: with caching, an unchanged rank sends only a marker)."""

    full_plans_received: int = 0
    cached_plans_received: int = 0
    local_plan_cached: bool = False
    global_plan_cached: bool = False
    items_written: int = 0
    bytes_written: int = 0


def _item_signature(item: WriteItem) -> tuple:
    td = item.tensor_data
    return (
        item.type.name,
        item.index.fqn,
        None if item.index.offset is None else tuple(item.index.offset),
        None
        if td is None
        else (tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size), str(td.properties.dtype)),
    )


def plan_signature(plan: SavePlan) -> tuple:
    """Equality key of a save plan (items, their chunks and the planner data)."""
    return (tuple(_item_signature(i) for i in plan.items), plan.planner_data, plan.usable)


def chunk_nbytes(item: WriteItem) -> int:
    """Bytes of a tensor write item's chunk."""
    td = item.tensor_data
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


# ---- the coordinator's global plan (pure) ------------------------------------------------


@dataclass
class PlanSurvey:
    """What the local plans of every rank offer, and where they disagree."""

    #: chunk -> ranks offering it (in rank order)
    holders: DefaultDict[ChunkId, List[int]] = field(default_factory=lambda: defaultdict(list))
    #: chunk -> bytes
    sizes: Dict[ChunkId, int] = field(default_factory=dict)
    #: chunk -> (its sizes, the first rank offering it)
    shapes: Dict[ChunkId, Tuple[Tuple[int, ...], int]] = field(default_factory=dict)
    #: chunks some rank holds as the main replica
    has_main: Set[ChunkId] = field(default_factory=set)
    #: value fqn -> the rank writing it (the lowest offering it)
    value_writer: Dict[str, int] = field(default_factory=dict)
    #: tensor fqn -> (properties, global size, first rank offering it)
    tensor_props: Dict[str, Tuple[TensorProperties, Tuple[int, ...], int]] = field(default_factory=dict)
    problems: List[str] = field(default_factory=list)

    def add_plan(self, rank: int, plan: SavePlan) -> None:
        pd = plan.planner_data
        if isinstance(pd, LocalPlanData):
            self.has_main.update((f, tuple(o)) for f, o in pd.mains)
        for item in plan.items:
            if item.type == WriteItemType.BYTE_IO:
                self._add_value(rank, item.index.fqn)
            else:
                self._add_chunk(rank, item)

    def _add_value(self, rank: int, fqn: str) -> None:
        if fqn in self.tensor_props:
            self.problems.append(
                f"{fqn!r} is a tensor on rank {self.tensor_props[fqn][2]} and a value on rank {rank}"
            )
        self.value_writer.setdefault(fqn, rank)

    def _add_chunk(self, rank: int, item: WriteItem) -> None:
        fqn = item.index.fqn
        td = item.tensor_data
        if td is None or td.chunk is None:
            self.problems.append(f"{fqn!r} on rank {rank}: tensor write item without a chunk")
            return
        if fqn in self.value_writer:
            self.problems.append(
                f"{fqn!r} is a value on rank {self.value_writer[fqn]} and a tensor on rank {rank}"
            )
        self._check_tensor_props(rank, fqn, td)
        cid = (fqn, tuple(td.chunk.offsets))
        shape = (tuple(td.chunk.sizes), rank)
        if cid in self.shapes and self.shapes[cid][0] != shape[0]:
            self.problems.append(
                f"{fqn!r}: the chunk at offset {list(cid[1])} has sizes {list(self.shapes[cid][0])} on "
                f"rank {self.shapes[cid][1]} but {list(shape[0])} on rank {rank}"
            )
            return
        self.shapes.setdefault(cid, shape)
        if not self.holders[cid] or self.holders[cid][-1] != rank:
            self.holders[cid].append(rank)
        self.sizes[cid] = chunk_nbytes(item)

    def _check_tensor_props(self, rank: int, fqn: str, td: TensorWriteData) -> None:
        prev = self.tensor_props.get(fqn)
        if prev is None:
            self.tensor_props[fqn] = (td.properties, tuple(td.size), rank)
        elif prev[0].dtype != td.properties.dtype or prev[1] != tuple(td.size):
            self.problems.append(
                f"{fqn!r}: rank {prev[2]} saves {prev[0].dtype} of size {list(prev[1])}, rank "
                f"{rank} saves {td.properties.dtype} of size {list(td.size)}"
            )


def survey_plans(all_plans: Sequence[SavePlan]) -> PlanSurvey:
    """Gather what every rank offers; raise :class:`ValidationError` when ranks disagree on a
    key's dtype, global shape, kind (tensor or value) or a chunk's sizes."""
    survey = PlanSurvey()
    for rank, plan in enumerate(all_plans):
        survey.add_plan(rank, plan)
    raise_problems(
        survey.problems,
        "ranks' save plans disagree",
        "every rank must describe each key with the same dtype and global shape",
    )
    return survey


def choose_chunk_writers(survey: PlanSurvey, num_ranks: int) -> Dict[ChunkId, int]:
    """One writer per offered chunk: :func:`assign_shards` (balanced bytes, chunks with a
    main replica in the group first)."""
    if not survey.holders:
        return {}
    cross = {cid for cid in survey.holders if cid not in survey.has_main}
    return assign_shards(survey.holders, survey.sizes, num_ranks, cross_group=cross)


def _rank_items(
    rank: int,
    plan: SavePlan,
    value_writer: Dict[str, int],
    writer: Optional[Dict[ChunkId, int]],
    md: Dict[str, Any],
) -> List[WriteItem]:
    """The items of ``plan`` that ``rank`` writes (``writer`` None: every offered chunk),
    each recorded in the metadata ``md``."""
    items = []
    for item in plan.items:
        fqn = item.index.fqn
        if item.type == WriteItemType.BYTE_IO:
            if value_writer[fqn] != rank:
                continue
            md[fqn] = BytesStorageMetadata()
            items.append(item)
            continue
        if writer is not None and writer[(fqn, tuple(item.tensor_data.chunk.offsets))] != rank:
            continue
        tmd = md.get(fqn)
        if tmd is None:
            tmd = md[fqn] = TensorStorageMetadata(
                properties=item.tensor_data.properties, size=item.tensor_data.size, chunks=[]
            )
        # The index hint lets readers find the chunk without a search (torch does the same).
        items.append(dataclasses.replace(item, index=dataclasses.replace(item.index, index=len(tmd.chunks))))
        tmd.chunks.append(item.tensor_data.chunk)
    return items


def _flatten_mappings(all_plans: Sequence[SavePlan]) -> Dict[str, StatePath]:
    mappings: Dict[str, StatePath] = {}
    for plan in all_plans:
        if isinstance(plan.planner_data, LocalPlanData):
            for fqn, path in plan.planner_data.mappings:
                mappings.setdefault(fqn, tuple(path))
    return mappings


def build_global_save_plan(
    all_plans: Sequence[SavePlan], dedup: bool = True
) -> Tuple[List[SavePlan], Metadata, Dict[Tuple[str, Tuple[int, ...]], int]]:
    """Deduplicate, index and describe the local plans of every rank (pure function).

    Returns ``(plans, metadata, writer)``: each rank's final plan, the checkpoint metadata
    (validated, raising :class:`ValidationError` naming the key and chunks), and which rank
    writes each tensor chunk. A chunk offered by several ranks (a replica) is written by one of
    them, chosen by :func:`distribution.assign_shards` (balanced bytes, main replicas first);
    a value offered by several ranks is written by the lowest one.
    """
    survey = survey_plans(all_plans)
    writer = choose_chunk_writers(survey, len(all_plans)) if dedup else None
    md: Dict[str, Any] = {}
    new_plans = [
        dataclasses.replace(plan, items=_rank_items(rank, plan, survey.value_writer, writer, md))
        for rank, plan in enumerate(all_plans)
    ]
    metadata = Metadata(state_dict_metadata=md, planner_data=_flatten_mappings(all_plans))
    validate_global_plan(new_plans, metadata)
    return new_plans, metadata, writer if writer is not None else {}


# ---- the planner ---------------------------------------------------------------------------


class ResilientSavePlanner(SavePlanner):
    """DCP save planner for sharded state dicts (see the module docstring).

    Reuse one instance across saves of the same structure to benefit from plan caching: ranks
    whose local plan did not change send only a marker to the coordinator, and when no rank's
    plan changed the coordinator reuses its validated global plan and metadata.

    Args:
        enable_plan_caching: send only changed local plans (and reuse the global plan).
        dedup_replicas: write each replicated chunk once (otherwise every offered chunk is
            written and duplicates fail validation as overlaps).
    """

    def __init__(self, *, enable_plan_caching: bool = True, dedup_replicas: bool = True):
        self.enable_plan_caching = enable_plan_caching
        self.dedup_replicas = dedup_replicas
        self.stats = SavePlannerStats()
        self.mappings: Dict[str, StatePath] = {}
        self._tensors: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self._values: Dict[str, Any] = {}
        self._cached_local: Optional[SavePlan] = None
        self._pending_local: Optional[SavePlan] = None
        self._cached_final: Optional[SavePlan] = None
        # coordinator only
        self._cached_all: Optional[List[SavePlan]] = None
        self._cached_global: Optional[List[SavePlan]] = None
        self._cached_metadata: Optional[Metadata] = None
        self.is_coordinator = False
        self.metadata: Optional[Metadata] = None
        self.writer_of_chunk: Dict[Tuple[str, Tuple[int, ...]], int] = {}

    def release(self) -> None:
        """Drop references to the last saved state dict (its tensors), keeping plan caches."""
        self._tensors = {}
        self._values = {}
        self._flat = EMPTY_FLAT

    def reset_plan_cache(self) -> None:
        """Forget cached plans (call on every rank together)."""
        self._cached_local = self._pending_local = self._cached_final = None
        self._cached_all = self._cached_global = self._cached_metadata = None

    def set_up_planner(
        self,
        state_dict: Dict[str, Any],
        storage_meta: Optional[StorageMeta] = None,
        is_coordinator: bool = False,
    ) -> None:
        flat = flatten_for_save(state_dict)
        self._tensors = {(e.fqn, e.offsets): e.tensor for e in flat.tensors}
        self._values = {e.fqn: e.value for e in flat.values}
        self._flat = flat
        self.mappings = dict(flat.mappings)
        self.is_coordinator = is_coordinator
        self.stats = SavePlannerStats()

    def create_local_plan(self) -> SavePlan:
        items: List[WriteItem] = []
        for e in self._flat.tensors:
            items.append(
                WriteItem(
                    index=MetadataIndex(e.fqn, e.offsets),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=torch.Size(e.offsets), sizes=torch.Size(e.sizes)),
                        properties=TensorProperties(dtype=e.dtype),
                        size=torch.Size(e.global_size),
                    ),
                )
            )
        for e in self._flat.values:
            items.append(
                WriteItem(
                    index=MetadataIndex(e.fqn),
                    type=WriteItemType.BYTE_IO,
                    bytes_io_data=BytesIOWriteData(nbytes=0),
                )
            )
        pd = LocalPlanData(
            mappings=tuple(sorted(self.mappings.items(), key=lambda kv: kv[0])),
            mains=tuple(sorted((e.fqn, e.offsets) for e in self._flat.tensors if e.main)),
        )
        plan = SavePlan(items, planner_data=pd)
        if (
            self.enable_plan_caching
            and self._cached_local is not None
            and self._cached_final is not None
            and plan_signature(plan) == plan_signature(self._cached_local)
        ):
            self.stats.local_plan_cached = True
            self._pending_local = None
            return SavePlan([], usable=False)
        self._pending_local = plan
        return plan

    def create_global_plan(self, all_plans: List[SavePlan]) -> Tuple[List[SavePlan], Metadata]:
        full = [p.usable for p in all_plans]
        self.stats.full_plans_received = sum(full)
        self.stats.cached_plans_received = len(full) - sum(full)
        if not all(full):
            if self._cached_all is None or len(self._cached_all) != len(all_plans):
                stale = [r for r, u in enumerate(full) if not u]
                raise ValidationError(
                    f"ranks {stale[:8]} sent a cached-plan marker but the coordinator holds no "
                    "cached plans for this group; the planners' caches are out of step (reuse one "
                    "planner per rank for every save, or call reset_plan_cache() on every rank)"
                )
        if self.enable_plan_caching and not any(full) and self._cached_global is not None:
            self.stats.global_plan_cached = True
            self.metadata = dataclasses.replace(self._cached_metadata)
            return [SavePlan([], usable=False) for _ in all_plans], self.metadata
        merged = [p if p.usable else self._cached_all[r] for r, p in enumerate(all_plans)]
        global_plans, metadata, writer = build_global_save_plan(merged, self.dedup_replicas)
        self.writer_of_chunk = writer
        if (
            self.enable_plan_caching
            and self._cached_global is not None
            and len(self._cached_global) == len(global_plans)
        ):
            deltas = [
                SavePlan([], usable=False) if plan_signature(old) == plan_signature(new) else new
                for old, new in zip(self._cached_global, global_plans)
            ]
        else:
            deltas = global_plans
        if self.enable_plan_caching:
            self._cached_all = merged
            self._cached_global = global_plans
            self._cached_metadata = metadata
        self.metadata = dataclasses.replace(metadata)
        return deltas, self.metadata

    def finish_plan(self, new_plan: SavePlan) -> SavePlan:
        if not new_plan.usable:
            if self._cached_final is None:
                raise ValidationError(
                    "the coordinator sent a cached-plan marker but this rank holds no cached plan "
                    "(planner caches out of step); call reset_plan_cache() on every rank"
                )
            plan = self._cached_final
        else:
            plan = new_plan
        if self.enable_plan_caching:
            self._cached_final = plan
            if self._pending_local is not None:
                self._cached_local = self._pending_local
                self._pending_local = None
        self.plan = plan
        self.stats.items_written = len(plan.items)
        self.stats.bytes_written = sum(chunk_nbytes(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)
        return plan

    def resolve_data(self, write_item: WriteItem) -> Union[torch.Tensor, io.BytesIO]:
        fqn = write_item.index.fqn
        if write_item.type == WriteItemType.BYTE_IO:
            if fqn not in self._values:
                raise ValidationError(f"save plan asks for value {fqn!r}, which this rank's state dict lacks")
            v = self._values[fqn]
            return io.BytesIO(v.data if isinstance(v, RawBytes) else codec.encode(v))
        key = (fqn, tuple(write_item.index.offset))
        t = self._tensors.get(key)
        if t is None:
            raise ValidationError(
                f"save plan asks for {fqn!r} at offset {key[1]}, which this rank's state dict lacks"
            )
        return t
