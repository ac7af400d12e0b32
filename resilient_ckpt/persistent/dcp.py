"""Our own PyTorch Distributed Checkpoint (DCP) planners, reader and writer.

The persistent tier writes standard DCP directories (``.metadata`` + ``__<rank>_<n>.distcp``)
that plain ``torch.distributed.checkpoint.load`` reads, and reads directories written by
torch's own ``dcp.save``. The planners decide *what* goes where; torch's FileSystemWriter /
FileSystemReader move the bytes.

Keys (DCP "FQNs"): a :class:`ShardedTensor` is stored under its ``key`` with its chunk at
``global_offset``; a :class:`ShardedObject` under its ``unique_key``; plain tensors, DTensors and
plain values under their path in the nested state dict joined by ``"."`` (torch's own
flattening, so ``{"model": model.state_dict()}`` and ShardedTensors keyed ``"model.<name>"``
name the same entries).

Save (:class:`ResilientSavePlanner`):

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
  :class:`ResilientLoadPlanner`.

Load (:class:`ResilientLoadPlanner`): the same flattening; missing keys are an error unless
``allow_partial_load``; stored chunks are validated before anything is read; ShardedTensor
leaves are replaced in place by the loaded tensors (allocated when their ``data`` is None);
non-tensor entries decode with the codec, or, for checkpoints written by torch's ``dcp.save``,
with ``torch.load(weights_only=True)`` (full unpickling only with ``allow_pickle=True``).
:class:`MetadataStateDictLoadPlanner` rebuilds a whole state dict from the metadata alone
(one process: inspection, conversion).

The ``.metadata`` file is a pickle (DCP's format). :class:`SafeFileSystemReader` unpickles it
with an allow-list of DCP's own metadata classes, and checks that every data file the metadata
names exists and is long enough, so a damaged or foreign directory fails with the file named
instead of a deep torch error.
"""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import math
import os
import pickle
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple, Union

import torch
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
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
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    TensorWriteData,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.checkpoint.storage import StorageReader

from ..model import codec
from ..parallel.distribution import assign_shards
from ..errors import CodecError, CorruptCheckpointError, ValidationError
from ..model.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    adapt,
    is_factory,
)
from ..model.nested import HOLE
from ..model.validation import _find_overlap, _fmt_box

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment]

logger = logging.getLogger(__name__)

BACKEND = "dcp"
#: Version of what resilient_ckpt puts into a DCP directory (manifest, internal entries).
DCP_FORMAT_VERSION = 1
FORMAT_NAME = "resilient_ckpt/dcp"
MANIFEST_NAME = "resilient_ckpt.json"
METADATA_NAME = ".metadata"
#: Entries resilient_ckpt adds for its own use (never part of the user's state dict).
INTERNAL_PREFIX = "__resilient_ckpt__/"
_MAX_REPORTED = 20

Path_ = Tuple[Union[str, int], ...]


def hollow_fqn(rank: int) -> str:
    """The entry holding rank ``rank``'s hollow state dict (structure + common state)."""
    return f"{INTERNAL_PREFIX}hollow/rank_{rank:06d}"


def is_internal(fqn: str) -> bool:
    return fqn.startswith(INTERNAL_PREFIX)


class RawBytes:
    """A value already encoded (stored as is, e.g. a hollow state dict's codec bytes)."""

    __slots__ = ("data",)

    def __init__(self, data: bytes):
        self.data = bytes(data)


def _is_dtensor(x: Any) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def _is_tensorish(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, ShardedTensor, ShardedObject))


def _is_terminal(x: Any) -> bool:
    """torch's flattening rule (``_traverse.traverse_state_dict``), with our sharded types
    counting as tensors: dicts are always descended, a list only when it holds a tensor, a
    dict or a descended list; anything else is one value."""
    if isinstance(x, dict):
        return False
    if isinstance(x, list):
        for e in x:
            if isinstance(e, (dict, list)):
                if not _is_terminal(e):
                    return False
            elif _is_tensorish(adapt(e)) or isinstance(e, LocalNonpersistentObject) or is_factory(e):
                return False
        return True
    return True


def _fmt_path(path: Path_) -> str:
    return ".".join(map(str, path)) or "<root>"


# ---- validation of chunk layouts ---------------------------------------------------------


def _chunk_str(offsets: Sequence[int], sizes: Sequence[int]) -> str:
    return _fmt_box((tuple(offsets), tuple(o + s for o, s in zip(offsets, sizes))))


def chunk_problems(
    key: str, size: Sequence[int], chunks: Sequence[ChunkStorageMetadata]
) -> List[str]:
    """What is wrong with ``chunks`` as a tiling of a tensor of ``size`` (empty list: fine).

    Every chunk must lie inside the tensor, no two may overlap, and together they must cover
    it. Pure function (used on save plans and on loaded metadata alike).
    """
    size = tuple(int(s) for s in size)
    out: List[str] = []
    boxes = []
    for c in chunks:
        off = tuple(int(o) for o in c.offsets)
        ext = tuple(int(s) for s in c.sizes)
        if len(off) != len(size) or len(ext) != len(size):
            out.append(
                f"{key!r}: chunk at offset {off} with sizes {ext} has a different number of axes "
                f"than the tensor size {list(size)}"
            )
            continue
        if any(o < 0 or e < 0 or o + e > s for o, e, s in zip(off, ext, size)):
            out.append(
                f"{key!r}: chunk {_chunk_str(off, ext)} lies outside the tensor of size {list(size)}"
            )
            continue
        boxes.append((off, tuple(o + e for o, e in zip(off, ext))))
    if out:
        return out
    if not size:
        if len(chunks) != 1:
            out.append(f"{key!r}: a 0-d tensor needs exactly one chunk, got {len(chunks)}")
        return out
    overlap = _find_overlap(boxes)
    if overlap is not None:
        a, b = overlap
        out.append(f"{key!r}: chunks {_fmt_box(a)} and {_fmt_box(b)} overlap")
        return out
    covered = sum(math.prod(e - s for s, e in zip(*box)) for box in boxes)
    total = math.prod(size)
    if covered != total:
        shown = ", ".join(_fmt_box(b) for b in sorted(boxes)[:8])
        more = f" (+{len(boxes) - 8} more)" if len(boxes) > 8 else ""
        out.append(
            f"{key!r}: chunks cover {covered} of {total} elements of size {list(size)} (gap); "
            f"chunks: {shown or 'none'}{more}"
        )
    return out


def _raise_problems(problems: List[str], what: str, fix: str) -> None:
    if not problems:
        return
    shown = problems[:_MAX_REPORTED]
    more = f"\n  ... and {len(problems) - len(shown)} more" if len(problems) > len(shown) else ""
    raise ValidationError(f"{what}:\n  " + "\n  ".join(shown) + more + f"\nfix: {fix}")


def validate_metadata(metadata: Metadata, keys: Optional[Iterable[str]] = None, source: str = "checkpoint") -> None:
    """Raise :class:`ValidationError` naming every key of ``metadata`` (or of ``keys``) whose
    stored chunks are out of bounds, overlap or leave a gap."""
    problems: List[str] = []
    md = metadata.state_dict_metadata
    for key in sorted(md if keys is None else set(keys) & md.keys()):
        v = md[key]
        if isinstance(v, TensorStorageMetadata):
            problems.extend(chunk_problems(key, v.size, v.chunks))
    _raise_problems(
        problems,
        f"{source} metadata describes inconsistent tensor chunks",
        "the checkpoint is damaged or was written by an inconsistent job; restore an older one",
    )


def validate_global_plan(plans: Sequence[SavePlan], metadata: Metadata) -> None:
    """Raise :class:`ValidationError` naming the key and chunks of every inconsistent tensor of
    a global save plan (chunks out of bounds, overlapping, or not covering the tensor)."""
    problems: List[str] = []
    for key, v in sorted(metadata.state_dict_metadata.items()):
        if isinstance(v, TensorStorageMetadata):
            problems.extend(chunk_problems(key, v.size, v.chunks))
    _raise_problems(
        problems,
        "the global save plan is inconsistent",
        "every key's saved pieces (ShardedTensor global_offset/local_shape, DTensor placements) "
        "must tile its global shape exactly once across ranks",
    )


# ---- flattening --------------------------------------------------------------------------


@dataclass(frozen=True)
class _TensorEntry:
    fqn: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    global_size: Tuple[int, ...]
    dtype: torch.dtype
    main: bool
    tensor: torch.Tensor = field(repr=False, compare=False)


@dataclass(frozen=True)
class _BytesEntry:
    fqn: str
    main: bool
    value: Any = field(repr=False, compare=False)


@dataclass(frozen=True)
class _Flat:
    tensors: Tuple[_TensorEntry, ...]
    values: Tuple[_BytesEntry, ...]
    #: fqn -> path in the nested state dict (torch's FLATTEN_MAPPING)
    mappings: Mapping[str, Path_]


def _object_mapping_path(path: Path_, obj: ShardedObject) -> Path_:
    # A grid of objects (per-rank state) gets one sub-key per piece when rebuilt from metadata.
    if all(s == 1 for s in obj.global_shape):
        return path
    return path + (obj.unique_key.rsplit("/", 1)[-1],)


def _dtensor_entry(fqn: str, t: Any) -> Optional[_TensorEntry]:
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if t.device_mesh.get_coordinate() is None:
        return None  # this rank is not in the DTensor's mesh
    if any(p.is_partial() for p in t.placements):
        raise ValidationError(
            f"{fqn!r}: DTensor with a Partial placement cannot be checkpointed; redistribute it "
            "to Replicate or Shard first"
        )
    sizes, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    local = t.to_local().detach()
    coords = t.device_mesh.get_coordinate() or []
    main = all(c == 0 for c, p in zip(coords, t.placements) if p.is_replicate())
    return _TensorEntry(fqn, tuple(offsets), tuple(sizes), tuple(t.shape), local.dtype, main, local)


def flatten_for_save(state_dict: Mapping[str, Any]) -> _Flat:
    """Flatten a (sharded) state dict into DCP entries. Containers without any tensor below
    them are one value (as torch flattens them)."""
    tensors: List[_TensorEntry] = []
    values: List[_BytesEntry] = []
    mappings: Dict[str, Path_] = {}
    seen_values: Dict[str, Path_] = {}
    seen_chunks: Dict[Tuple[str, Tuple[int, ...]], Path_] = {}

    def add_tensor(e: _TensorEntry, path: Path_) -> None:
        prev = seen_chunks.get((e.fqn, e.offsets))
        if prev is not None:
            raise ValidationError(
                f"state dict holds two pieces of {e.fqn!r} at offset {e.offsets} (at "
                f"{_fmt_path(prev)} and {_fmt_path(path)}); each piece may appear once per rank"
            )
        if e.fqn in seen_values:
            raise ValidationError(
                f"{e.fqn!r} names both a tensor (at {_fmt_path(path)}) and a value (at "
                f"{_fmt_path(seen_values[e.fqn])}); rename one"
            )
        seen_chunks[(e.fqn, e.offsets)] = path
        mappings.setdefault(e.fqn, path)
        tensors.append(e)

    def add_value(fqn: str, path: Path_, main: bool, value: Any, map_path: Path_) -> None:
        if fqn in seen_values or any(k[0] == fqn for k in seen_chunks):
            raise ValidationError(
                f"two entries of the state dict flatten to the same key {fqn!r} (at "
                f"{_fmt_path(seen_values.get(fqn, ()))} and {_fmt_path(path)}); rename one"
            )
        seen_values[fqn] = path
        mappings[fqn] = map_path
        values.append(_BytesEntry(fqn, main, value))

    def walk(x: Any, path: Path_) -> None:
        if x is HOLE:
            return  # a list position whose value lives in the other half of a split
        if is_factory(x):
            raise ValidationError(
                f"ShardedTensorFactory at {_fmt_path(path)}: build factories before saving "
                "(MCoreTensorAwareStateDict.from_state_dict does)"
            )
        x = adapt(x)
        if isinstance(x, ShardedTensor):
            if x.data is None:
                return  # metadata only: another rank saves this piece
            extent = (1,) * x.prepend_axis_num + tuple(x.local_shape)
            data = x.data.detach()
            add_tensor(
                _TensorEntry(
                    x.key, tuple(x.global_offset), extent, tuple(x.global_shape), x.dtype,
                    x.is_main_replica(), data.reshape(extent),
                ),
                path,
            )
        elif isinstance(x, ShardedObject):
            if x.is_main_replica():
                add_value(x.unique_key, path, True, x.data, _object_mapping_path(path, x))
        elif isinstance(x, LocalNonpersistentObject):
            return
        elif _is_dtensor(x):
            e = _dtensor_entry(_fmt_path(path), x)
            if e is not None:
                add_tensor(e, path)
        elif isinstance(x, torch.Tensor):
            t = x.detach()
            add_tensor(
                _TensorEntry(
                    _fmt_path(path), (0,) * t.dim(), tuple(t.shape), tuple(t.shape), t.dtype, True, t
                ),
                path,
            )
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, path + (str(k),))
        elif isinstance(x, list) and not _is_terminal(x):
            for i, v in enumerate(x):
                walk(v, path + (i,))
        else:
            add_value(_fmt_path(path), path, True, x, path)

    if not isinstance(state_dict, dict):
        raise ValidationError(f"the state dict to save must be a dict, got {type(state_dict).__name__}")
    for k, v in state_dict.items():
        walk(v, (str(k),))
    return _Flat(tuple(tensors), tuple(values), mappings)


# ---- save planner ------------------------------------------------------------------------


@dataclass(frozen=True)
class LocalPlanData:
    """What a rank's local save plan tells the coordinator besides its write items."""

    #: (fqn, path) pairs: torch's flatten mapping, so the metadata can rebuild nesting
    mappings: Tuple[Tuple[str, Path_], ...]
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
        None if td is None else (tuple(td.chunk.offsets), tuple(td.chunk.sizes), tuple(td.size), str(td.properties.dtype)),
    )


def plan_signature(plan: SavePlan) -> tuple:
    """Equality key of a save plan (items, their chunks and the planner data)."""
    return (tuple(_item_signature(i) for i in plan.items), plan.planner_data, plan.usable)


def _chunk_nbytes(item: WriteItem) -> int:
    td = item.tensor_data
    return math.prod(td.chunk.sizes) * td.properties.dtype.itemsize


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
    n = len(all_plans)
    holders: Dict[Tuple[str, Tuple[int, ...]], List[int]] = defaultdict(list)
    sizes: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    shapes: Dict[Tuple[str, Tuple[int, ...]], Tuple[Tuple[int, ...], int]] = {}
    has_main: set = set()
    value_writer: Dict[str, int] = {}
    tensor_props: Dict[str, Tuple[TensorProperties, Tuple[int, ...], int]] = {}
    problems: List[str] = []
    for rank, plan in enumerate(all_plans):
        pd = plan.planner_data
        if isinstance(pd, LocalPlanData):
            has_main.update((f, tuple(o)) for f, o in pd.mains)
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if fqn in tensor_props:
                    problems.append(f"{fqn!r} is a tensor on rank {tensor_props[fqn][2]} and a value on rank {rank}")
                value_writer.setdefault(fqn, rank)
                continue
            td = item.tensor_data
            if td is None or td.chunk is None:
                problems.append(f"{fqn!r} on rank {rank}: tensor write item without a chunk")
                continue
            if fqn in value_writer:
                problems.append(f"{fqn!r} is a value on rank {value_writer[fqn]} and a tensor on rank {rank}")
            prev = tensor_props.get(fqn)
            if prev is None:
                tensor_props[fqn] = (td.properties, tuple(td.size), rank)
            elif prev[0].dtype != td.properties.dtype or prev[1] != tuple(td.size):
                problems.append(
                    f"{fqn!r}: rank {prev[2]} saves {prev[0].dtype} of size {list(prev[1])}, rank "
                    f"{rank} saves {td.properties.dtype} of size {list(td.size)}"
                )
            cid = (fqn, tuple(td.chunk.offsets))
            shape = (tuple(td.chunk.sizes), rank)
            if cid in shapes and shapes[cid][0] != shape[0]:
                problems.append(
                    f"{fqn!r}: the chunk at offset {list(cid[1])} has sizes {list(shapes[cid][0])} on "
                    f"rank {shapes[cid][1]} but {list(shape[0])} on rank {rank}"
                )
                continue
            shapes.setdefault(cid, shape)
            if not holders[cid] or holders[cid][-1] != rank:
                holders[cid].append(rank)
            sizes[cid] = _chunk_nbytes(item)
    _raise_problems(
        problems,
        "ranks' save plans disagree",
        "every rank must describe each key with the same dtype and global shape",
    )
    if dedup:
        cross = {cid for cid in holders if cid not in has_main}
        writer = assign_shards(holders, sizes, n, cross_group=cross) if holders else {}
    else:
        writer = {}
    md: Dict[str, Any] = {}
    new_plans: List[SavePlan] = []
    for rank, plan in enumerate(all_plans):
        items = []
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                if value_writer[fqn] != rank:
                    continue
                md[fqn] = BytesStorageMetadata()
                items.append(item)
                continue
            cid = (fqn, tuple(item.tensor_data.chunk.offsets))
            if dedup and writer[cid] != rank:
                continue
            tmd = md.get(fqn)
            if tmd is None:
                tmd = md[fqn] = TensorStorageMetadata(
                    properties=item.tensor_data.properties, size=item.tensor_data.size, chunks=[]
                )
            # The index hint lets readers find the chunk without a search (torch does the same).
            items.append(dataclasses.replace(item, index=dataclasses.replace(item.index, index=len(tmd.chunks))))
            tmd.chunks.append(item.tensor_data.chunk)
        new_plans.append(dataclasses.replace(plan, items=items))
    mappings: Dict[str, Path_] = {}
    for plan in all_plans:
        if isinstance(plan.planner_data, LocalPlanData):
            for fqn, path in plan.planner_data.mappings:
                mappings.setdefault(fqn, tuple(path))
    metadata = Metadata(state_dict_metadata=md, planner_data=mappings)
    validate_global_plan(new_plans, metadata)
    return new_plans, metadata, writer


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
        self.mappings: Dict[str, Path_] = {}
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
        self._flat = _Flat((), (), {})

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
                WriteItem(index=MetadataIndex(e.fqn), type=WriteItemType.BYTE_IO, bytes_io_data=BytesIOWriteData(nbytes=0))
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
        if self.enable_plan_caching and self._cached_global is not None and len(self._cached_global) == len(global_plans):
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
        self.stats.bytes_written = sum(_chunk_nbytes(i) for i in plan.items if i.type != WriteItemType.BYTE_IO)
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


# ---- load planners -----------------------------------------------------------------------


def decode_value(raw: bytes, fqn: str, allow_pickle: bool = False) -> Any:
    """A stored non-tensor entry: our codec, or a torch.save payload (torch's ``dcp.save``)."""
    if raw[:4] == codec.MAGIC:
        return codec.decode(raw, allow_pickle=allow_pickle)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=not allow_pickle)
    except Exception as e:
        hint = (
            "; if you trust this checkpoint, load with allow_pickle=True"
            if not allow_pickle
            else ""
        )
        raise CodecError(
            f"checkpoint entry {fqn!r} cannot be decoded safely ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}){hint}"
        ) from e


def _narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    for dim, (off, ln) in enumerate(zip(offsets, lengths)):
        if off != 0 or ln != t.shape[dim]:
            t = t.narrow(dim, off, ln)
    return t


def _set_path(root: Any, path: Path_, value: Any) -> None:
    """Set ``value`` at ``path``, creating dicts (str keys) and lists (int keys) on the way."""
    cur = root
    for i, k in enumerate(path[:-1]):
        nxt_is_list = isinstance(path[i + 1], int)
        if isinstance(cur, list):
            while len(cur) <= k:
                cur.append(None)
            if cur[k] is None:
                cur[k] = [] if nxt_is_list else {}
            cur = cur[k]
        else:
            if k not in cur:
                cur[k] = [] if nxt_is_list else {}
            cur = cur[k]
    last = path[-1]
    if isinstance(cur, list):
        while len(cur) <= last:
            cur.append(None)
    cur[last] = value


_MISSING = object()


class ResilientLoadPlanner(LoadPlanner):
    """DCP load planner for sharded state dicts (see the module docstring).

    Loads in place: plain tensors and DTensors are filled; ShardedTensor leaves are replaced by
    their loaded tensors (``data`` is used when allocated, else a CPU tensor is allocated);
    ShardedObject and plain-value leaves are replaced by the stored values;
    LocalNonpersistentObject leaves by their local value.

    Args:
        allow_partial_load: skip keys absent from the checkpoint (ShardedTensors without data
            and ShardedObjects are then dropped, other leaves keep their value) instead of
            raising.
        allow_pickle: decode non-tensor entries written by torch's ``dcp.save`` with full
            unpickling (only for trusted checkpoints; default: torch's weights-only loader).
        validate: check the stored chunks of requested keys before reading.
    """

    def __init__(self, *, allow_partial_load: bool = False, allow_pickle: bool = False, validate: bool = True):
        self.allow_partial_load = allow_partial_load
        self.allow_pickle = allow_pickle
        self.validate = validate
        self.keys_not_in_checkpoint: List[str] = []
        self.state_dict: Dict[str, Any] = {}
        self.metadata: Optional[Metadata] = None
        self._chunks: Dict[str, List[ChunkStorageMetadata]] = {}
        self._dest: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self._copy_back: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self._value_setters: Dict[str, List[Callable[[Any], None]]] = defaultdict(list)
        self.bytes_requested = 0

    # -- registration helpers (shared with the metadata-only planner) --

    def _register_tensor(self, fqn: str, offsets: Tuple[int, ...], dest: torch.Tensor, target: Optional[torch.Tensor] = None) -> None:
        key = (fqn, tuple(offsets))
        self._chunks.setdefault(fqn, []).append(
            ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(dest.shape))
        )
        self._dest[key] = dest
        if target is not None:
            self._copy_back[key] = target
        self.bytes_requested += dest.numel() * dest.element_size()

    def _tensor_md(self, fqn: str, what: str) -> Optional[TensorStorageMetadata]:
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            self.keys_not_in_checkpoint.append(fqn)
            return None
        if not isinstance(md, TensorStorageMetadata):
            raise ValidationError(f"{what} {fqn!r} is a tensor in the state dict but a non-tensor value in the checkpoint")
        return md

    def set_up_planner(
        self,
        state_dict: Dict[str, Any],
        metadata: Optional[Metadata] = None,
        is_coordinator: bool = False,
    ) -> None:
        if metadata is None:
            raise CorruptCheckpointError("no checkpoint metadata to plan the load from")
        self.metadata = metadata
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        self.keys_not_in_checkpoint = []
        if not isinstance(state_dict, dict):
            raise ValidationError(f"the state dict to load into must be a dict, got {type(state_dict).__name__}")
        for k in list(state_dict):
            self._walk(state_dict, k, (str(k),))
        _drop_marked_inplace(state_dict)
        if self.keys_not_in_checkpoint and not self.allow_partial_load:
            ks = sorted(set(self.keys_not_in_checkpoint))
            shown = ", ".join(repr(k) for k in ks[:_MAX_REPORTED])
            more = f" (+{len(ks) - _MAX_REPORTED} more)" if len(ks) > _MAX_REPORTED else ""
            raise ValidationError(
                f"keys requested but not in the checkpoint: {shown}{more}; fix: load with "
                "allow_partial_load=True to skip them, or check what the checkpoint holds "
                "(resilient-ckpt inspect DIR)"
            )
        if self.validate:
            validate_metadata(metadata, keys=self._chunks.keys())

    def _walk(self, container: Any, k: Any, path: Path_) -> None:
        x = container[k]
        if x is HOLE:
            return
        if is_factory(x):
            raise ValidationError(
                f"ShardedTensorFactory at {_fmt_path(path)}: apply factories before loading "
                "(PersistentTier.load does)"
            )
        x = adapt(x)

        def setter(v, c=container, key=k):
            c[key] = v

        if isinstance(x, ShardedTensor):
            md = self._tensor_md(x.key, "ShardedTensor")
            if md is None:
                if x.data is None:
                    setter(_DROP)
                else:
                    setter(x.data)
                return
            if tuple(md.size) != tuple(x.global_shape):
                raise ValidationError(
                    f"{x.key!r}: the checkpoint holds global size {list(md.size)}, the state dict "
                    f"asks for {list(x.global_shape)}"
                )
            if md.properties.dtype != x.dtype:
                raise ValidationError(
                    f"{x.key!r}: the checkpoint holds {md.properties.dtype}, the state dict asks "
                    f"for {x.dtype}"
                )
            extent = (1,) * x.prepend_axis_num + tuple(x.local_shape)
            data = x.data if x.data is not None else torch.empty(x.local_shape, dtype=x.dtype)
            if data.is_contiguous():
                self._register_tensor(x.key, tuple(x.global_offset), data.view(extent))
            else:
                tmp = torch.empty(x.local_shape, dtype=x.dtype, device=data.device)
                self._register_tensor(x.key, tuple(x.global_offset), tmp.view(extent), data)
            setter(data)
        elif isinstance(x, ShardedObject):
            fqn = x.unique_key
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                self.keys_not_in_checkpoint.append(fqn)
                setter(_DROP)
                return
            if not isinstance(md, BytesStorageMetadata):
                raise ValidationError(f"ShardedObject {fqn!r} is a tensor in the checkpoint")
            self._value_setters[fqn].append(setter)
        elif isinstance(x, LocalNonpersistentObject):
            setter(x.unwrap())
        elif _is_dtensor(x):
            e = _dtensor_entry(_fmt_path(path), x)
            if e is None:
                return
            md = self._tensor_md(e.fqn, "DTensor")
            if md is None:
                return
            if tuple(md.size) != e.global_size:
                raise ValidationError(
                    f"{e.fqn!r}: the checkpoint holds size {list(md.size)}, the DTensor has "
                    f"{list(e.global_size)}"
                )
            self._register_tensor(e.fqn, e.offsets, e.tensor)
        elif isinstance(x, torch.Tensor):
            fqn = _fmt_path(path)
            md = self._tensor_md(fqn, "tensor")
            if md is None:
                return
            if tuple(md.size) != tuple(x.shape):
                raise ValidationError(
                    f"{fqn!r}: the checkpoint holds size {list(md.size)}, the state dict's tensor "
                    f"has {list(x.shape)}"
                )
            self._register_tensor(fqn, (0,) * x.dim(), x.detach())
        elif isinstance(x, dict):
            for kk in list(x):
                self._walk(x, kk, path + (str(kk),))
            _drop_marked_inplace(x)
        elif isinstance(x, list) and not _is_terminal(x):
            for i in range(len(x)):
                self._walk(x, i, path + (i,))
            for i, v in enumerate(x):
                if v is _DROP:
                    x[i] = None
        else:
            fqn = _fmt_path(path)
            md = self.metadata.state_dict_metadata.get(fqn)
            if md is None:
                self.keys_not_in_checkpoint.append(fqn)
                return
            if not isinstance(md, BytesStorageMetadata):
                raise ValidationError(f"{fqn!r} is a value in the state dict but a tensor in the checkpoint")
            self._value_setters[fqn].append(setter)

    def create_local_plan(self) -> LoadPlan:
        items: List[ReadItem] = []
        md = self.metadata.state_dict_metadata
        for fqn, chunks in self._chunks.items():
            items.extend(create_read_items_for_chunk_list(fqn, md[fqn], chunks))
        items.extend(_value_read_item(fqn) for fqn in self._value_setters)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: List[LoadPlan]) -> List[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        raw = value.getvalue() if isinstance(value, io.BytesIO) else value.read()
        v = decode_value(raw, fqn, self.allow_pickle)
        for set_ in self._value_setters.get(fqn, ()):
            set_(v)

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        return _narrow(self._dest[key], read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        target = self._copy_back.get(key)
        if target is not None:
            # The template's tensor is not contiguous: it was loaded into a contiguous stand-in.
            target.copy_(self._dest[key].reshape(target.shape))


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


_DROP = _Drop()


def _drop_marked_inplace(d: dict) -> None:
    for k in [k for k, v in d.items() if v is _DROP]:
        del d[k]


class MetadataStateDictLoadPlanner(ResilientLoadPlanner):
    """Rebuilds a state dict from the checkpoint metadata alone (no model needed).

    Tensors come back whole (every chunk assembled) at the nesting the saver recorded;
    non-tensor entries decoded. Meant for one process (inspection, conversion): the whole
    state dict is materialized.

    Args:
        keys: load only these entries (DCP keys, or prefixes of them ending at a ``"."`` or
            ``"/"``); default all.
        include_internal: also return resilient_ckpt's own entries (hollow state dicts).
    """

    def __init__(self, keys: Optional[Iterable[str]] = None, include_internal: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.keys = None if keys is None else set(keys)
        self.include_internal = include_internal

    def _wanted(self, fqn: str) -> bool:
        if is_internal(fqn) and not self.include_internal:
            return False
        if self.keys is None:
            return True
        return fqn in self.keys or any(fqn.startswith(k + ".") or fqn.startswith(k + "/") for k in self.keys)

    def set_up_planner(
        self,
        state_dict: Dict[str, Any],
        metadata: Optional[Metadata] = None,
        is_coordinator: bool = False,
    ) -> None:
        if state_dict:
            raise ValidationError("MetadataStateDictLoadPlanner fills an empty dict; pass {}")
        if metadata is None:
            raise CorruptCheckpointError("no checkpoint metadata to rebuild the state dict from")
        self.metadata = metadata
        self.state_dict = state_dict
        self.is_coordinator = is_coordinator
        mappings = metadata.planner_data if isinstance(metadata.planner_data, dict) else {}
        if self.keys is not None:
            absent = sorted(k for k in self.keys if not any(
                f == k or f.startswith(k + ".") or f.startswith(k + "/") for f in metadata.state_dict_metadata
            ))
            if absent:
                raise ValidationError(
                    f"keys not in the checkpoint: {', '.join(map(repr, absent[:_MAX_REPORTED]))}; "
                    "see `resilient-ckpt inspect DIR` for what it holds"
                )
        for fqn, md in metadata.state_dict_metadata.items():
            if not self._wanted(fqn):
                continue
            path = mappings.get(fqn)
            path = tuple(path) if isinstance(path, (tuple, list)) and path else (fqn,)
            if isinstance(md, TensorStorageMetadata):
                t = torch.empty(tuple(md.size), dtype=md.properties.dtype)
                _set_path(state_dict, path, t)
                self._register_tensor(fqn, (0,) * t.dim(), t)
            else:
                _set_path(state_dict, path, None)
                self._value_setters[fqn].append(lambda v, p=path: _set_path(state_dict, p, v))
        if self.validate:
            validate_metadata(metadata, keys=self._chunks.keys())


# ---- storage: reader with safe metadata, writer with manifest and a post-write check --------


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata with an allow-list: DCP's own dataclasses and torch scalars."""

    _MODULES_ANY = {"torch.distributed.checkpoint.metadata"}
    _ALLOWED = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib", "Path"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
        ("pathlib._local", "Path"),
    }

    def __init__(self, f, source: str):
        super().__init__(f)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES_ANY or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        raise CorruptCheckpointError(
            f"{self.source} refers to {module}.{name}, which is not part of DCP metadata; it is "
            "not unpickled. If you trust this checkpoint, open it with allow_pickle=True"
        )


def read_metadata_file(path: Union[str, os.PathLike], allow_pickle: bool = False) -> Metadata:
    """Read a DCP ``.metadata`` file with clear errors for a missing, truncated or foreign file."""
    path = Path(path)
    directory = path.parent
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if not directory.exists():
            raise CorruptCheckpointError(f"{directory} does not exist; pass a DCP checkpoint directory") from None
        raise CorruptCheckpointError(
            f"{path} is missing: {directory} is not a complete DCP checkpoint (a save that did not "
            "finish writes its metadata last); use an older checkpoint"
        ) from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{path} is a directory, not DCP metadata") from None
    if not raw:
        raise CorruptCheckpointError(f"{path} is empty (truncated); the checkpoint cannot be read")
    try:
        if allow_pickle:
            md = pickle.loads(raw)
        else:
            md = _MetadataUnpickler(io.BytesIO(raw), str(path)).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(
            f"{path} is truncated or corrupt ({type(e).__name__}: {e}); the checkpoint cannot be read"
        ) from e
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{path} does not hold DCP Metadata (got {type(md).__name__})")
    return md


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with safe metadata unpickling and up-front file checks."""

    def __init__(self, path: Union[str, os.PathLike], *, allow_pickle: bool = False, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.allow_pickle = allow_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = read_metadata_file(self._get_metadata_path(rank), self.allow_pickle)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.path}/{METADATA_NAME} has no storage layout (storage_data)")
        check_data_files(self.path, metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


def check_data_files(directory: Union[str, os.PathLike], metadata: Metadata) -> None:
    """Every data file the metadata refers to exists and holds the bytes it should."""
    need: Dict[str, Tuple[int, str]] = {}
    for idx, info in (metadata.storage_data or {}).items():
        rel = getattr(info, "relative_path", None)
        if rel is None:
            continue
        end = int(info.offset) + int(info.length)
        cur = need.get(rel)
        if cur is None or end > cur[0]:
            need[rel] = (end, idx.fqn)
    for rel, (end, fqn) in sorted(need.items()):
        p = Path(directory) / rel
        try:
            size = p.stat().st_size
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{p} is missing (it holds {fqn!r} among others): the checkpoint in {directory} is "
                "incomplete; restore an older checkpoint or copy the file back"
            ) from None
        if size < end:
            raise CorruptCheckpointError(
                f"{p} is truncated: {size} bytes, the metadata needs {end} (for {fqn!r}); the "
                f"checkpoint in {directory} is damaged"
            )


class ResilientFileSystemWriter(FileSystemWriter):
    """torch's FileSystemWriter plus: a manifest written before ``.metadata`` (so metadata is
    still the last file), and an ``after_write`` check run once this rank's data is written
    (raising there fails the save on every rank before any metadata exists)."""

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        manifest: Optional[Dict[str, Any]] = None,
        after_write: Optional[Callable[[], None]] = None,
        **kwargs: Any,
    ):
        kwargs.setdefault("overwrite", True)
        super().__init__(path, **kwargs)
        self.manifest = manifest
        self.after_write = after_write
        self.bytes_written = 0

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        fut = super().write_data(plan, planner)
        results = fut.wait()
        self.bytes_written = sum(int(r.size_in_bytes) for r in results)
        if self.after_write is not None:
            self.after_write()
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        if self.manifest is not None:
            m = dict(self.manifest)
            m["entries"] = len(metadata.state_dict_metadata)
            m["tensor_bytes"] = metadata_tensor_bytes(metadata)
            write_json_atomic(Path(self.path) / MANIFEST_NAME, m)
        super().finish(metadata, results)


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: Union[str, os.PathLike]) -> Optional[Dict[str, Any]]:
    """The resilient_ckpt manifest of a DCP directory, or None (a plain DCP checkpoint)."""
    p = Path(directory) / MANIFEST_NAME
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{p} is unreadable ({e}); the checkpoint is damaged") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{p} is not a resilient_ckpt manifest")
    return m


def metadata_tensor_bytes(metadata: Metadata) -> int:
    return sum(
        math.prod(v.size) * v.properties.dtype.itemsize
        for v in metadata.state_dict_metadata.values()
        if isinstance(v, TensorStorageMetadata)
    )


class CountingStorageReader(StorageReader):
    """Wraps a StorageReader and counts what it reads (items, and stored bytes per item).

    ``bytes_read`` counts each read item's stored length (the whole stored entry: DCP's
    FileSystemReader reads an entry entirely before narrowing it).
    """

    def __init__(self, inner: StorageReader):
        self.inner = inner
        self.items_read = 0
        self.bytes_read = 0
        self.reads: Dict[Tuple[str, Optional[Tuple[int, ...]]], int] = defaultdict(int)
        self._storage_data: Mapping = {}
        self._lock = threading.Lock()

    def reset(self, checkpoint_id=None) -> None:
        self.inner.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.inner.read_metadata(*args, **kwargs)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._storage_data = metadata.storage_data or {}
        self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return self.inner.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        with self._lock:
            for ri in plan.items:
                idx = ri.storage_index
                info = self._storage_data.get(idx)
                n = int(getattr(info, "length", 0) or 0)
                self.items_read += 1
                self.bytes_read += n
                self.reads[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] += 1
        return self.inner.read_data(plan, planner)

    @property
    def checkpoint_id(self):
        return getattr(self.inner, "checkpoint_id", None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


def stored_lengths(metadata: Metadata) -> Dict[Tuple[str, Optional[Tuple[int, ...]]], int]:
    """Bytes the storage layer holds per entry, keyed ``(fqn, offsets or None)`` (empty when
    the storage layout is not a file layout)."""
    out = {}
    for idx, info in (metadata.storage_data or {}).items():
        out[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] = int(getattr(info, "length", 0) or 0)
    return out


def read_values(
    reader: StorageReader,
    metadata: Metadata,
    fqns: Sequence[str],
    allow_pickle: bool = False,
    raw: bool = False,
) -> Dict[str, Any]:
    """Read and decode some non-tensor entries (``raw``: their stored bytes), locally (no
    collective). The reader must have been set up with ``metadata``."""
    missing = [f for f in fqns if not isinstance(metadata.state_dict_metadata.get(f), BytesStorageMetadata)]
    if missing:
        raise ValidationError(f"checkpoint has no value entries {missing[:_MAX_REPORTED]}")
    planner = _ValueCollector(allow_pickle, raw)
    reader.read_data(LoadPlan([_value_read_item(f) for f in fqns]), planner).wait()
    return planner.values


def _value_read_item(fqn: str) -> ReadItem:
    """A read of a whole non-tensor (bytes) entry."""
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(fqn),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex(fqn),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )


class PassiveLoadPlanner(LoadPlanner):
    """A LoadPlanner for direct ``StorageReader.read_data`` calls with a hand-made plan: the
    planning steps of a ``dcp.load`` are never run, only the data callbacks."""

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False) -> None:  # pragma: no cover
        pass

    def create_local_plan(self) -> LoadPlan:  # pragma: no cover
        return LoadPlan([])

    def create_global_plan(self, global_plan):  # pragma: no cover
        return global_plan

    def finish_plan(self, central_plan):  # pragma: no cover
        return central_plan


class _ValueCollector(PassiveLoadPlanner):
    def __init__(self, allow_pickle: bool, raw: bool = False):
        self.allow_pickle = allow_pickle
        self.raw = raw
        self.values: Dict[str, Any] = {}

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        data = value.getvalue()
        self.values[fqn] = data if self.raw else decode_value(data, fqn, self.allow_pickle)

    def resolve_tensor(self, read_item):  # pragma: no cover
        raise ValidationError("value collector reads no tensors")

    def commit_tensor(self, read_item, tensor) -> None:  # pragma: no cover
        pass


def load_local(
    state_dict: Dict[str, Any],
    reader: StorageReader,
    planner: Optional[LoadPlanner] = None,
    metadata: Optional[Metadata] = None,
) -> Metadata:
    """Load into ``state_dict`` in this process only (no collective: every rank reads what it
    needs). Returns the metadata read."""
    planner = planner or ResilientLoadPlanner()
    if metadata is None:
        metadata = reader.read_metadata()
    planner.set_up_planner(state_dict, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = planner.create_local_plan()
    plan = reader.prepare_local_plan(plan)
    plan = reader.prepare_global_plan([plan])[0]
    plan = planner.finish_plan(plan)
    reader.read_data(plan, planner).wait()
    return metadata


def load_metadata_only(
    directory: Union[str, os.PathLike],
    keys: Optional[Iterable[str]] = None,
    *,
    include_internal: bool = False,
    allow_pickle: bool = False,
) -> Dict[str, Any]:
    """The whole checkpoint (or ``keys``) as a nested state dict, in this process."""
    reader = SafeFileSystemReader(directory, allow_pickle=allow_pickle)
    sd: Dict[str, Any] = {}
    load_local(
        sd,
        reader,
        MetadataStateDictLoadPlanner(keys=keys, include_internal=include_internal, allow_pickle=allow_pickle),
    )
    return sd


def tensors_metadata(metadata: Metadata) -> Dict[str, ShardedTensor]:
    """Megatron's ``load_tensors_metadata`` shape: key -> an unsharded ShardedTensor (only
    ``global_shape`` and ``dtype`` are meaningful)."""
    out = {}
    for fqn, v in metadata.state_dict_metadata.items():
        if isinstance(v, TensorStorageMetadata) and not is_internal(fqn):
            shape = tuple(v.size)
            out[fqn] = ShardedTensor(
                fqn, None, v.properties.dtype, shape, shape, (0,) * len(shape), None
            )
    return out
