"""How DCP's write and read items map onto what the CheckpointManager stores.

Save: each rank stores exactly the WriteItems DCP's planner gave it, as one sharded state dict
(its payload for the iteration):

- a tensor item — chunk ``sizes`` at ``offsets`` of a global tensor of ``size`` — becomes
  ``ShardedTensor(key=fqn, global_shape=size, global_offset=offsets)``. DCP's planner already
  gave every chunk to exactly one rank (replicated tensors deduplicated), so each shard id has
  one holder and the manager's distribution leaves it where DCP put it;
- a bytes item (DCP serializes non-tensor values with ``torch.save``; they are kept as the
  opaque bytes DCP made and handed back to DCP's planner on load, as a file system does)
  becomes ``ShardedObject(key=fqn)``;
- the coordinator's payload also holds the checkpoint's global ``Metadata``, encoded without
  pickle (:mod:`.metadata_codec`), as ``ShardedObject(METADATA_KEY)``.

The manager checksums and replicates each rank's payload as a whole, so a node loss takes no
item and no metadata away: a lost rank's payload is restored from its replica.

Load: a template names what a rank's ReadItems need — the stored chunks (by shard id) and
bytes items, and the metadata object — and the manager delivers each from wherever it is
held (this node, a replica on this node, a peer through the load exchange, or the persistent
tier). The manager checks templates like any sharded state dict: every requested shard needs
exactly one main replica (replica_id 0) across ranks, and a key's main replicas must tile it.
DCP's load planning shows the coordinator every rank's ReadItems, so :func:`assign_reads`
decides there (no extra collective) which rank asks for each chunk as its main replica and
which rank also asks for chunks nobody reads of a key someone reads (a partial load), and the
assignment travels to each rank in its plan's ``storage_data``.

Pure functions: no I/O, no collectives.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, ReadItem, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult

from ..errors import CorruptCheckpointError, ValidationError
from ..model.mapping import ShardedObject, ShardedTensor

__all__ = [
    "FORMAT_KEY",
    "METADATA_KEY",
    "PAYLOAD_VERSION",
    "ReadAssignment",
    "ReadSlots",
    "assign_reads",
    "build_payload",
    "metadata_template",
    "read_template",
    "stored_chunk",
]

#: Common-state key marking a payload this module wrote (its value: the payload version).
FORMAT_KEY = "resilient_ckpt_dcp_payload"
PAYLOAD_VERSION = 1
#: The key of the checkpoint's DCP metadata; no DCP fqn may take it.
METADATA_KEY = "__resilient_ckpt_dcp__/metadata"

ShardKey = Tuple[str, Tuple[int, ...]]


def _object(key: str, data: Any = None, replica_id: int = 0) -> ShardedObject:
    # One atomic object per key: a grid of one.
    return ShardedObject(key, data, (1,), (0,), replica_id)


# ---- save --------------------------------------------------------------------------------------


def build_payload(
    items: Sequence[WriteItem],
    planner: SavePlanner,
    rank: int,
    metadata_bytes: Optional[bytes] = None,
) -> Tuple[Dict[str, Any], List[WriteResult]]:
    """This rank's payload for its ``items`` (resolved through ``planner``), and the
    WriteResults DCP expects back. ``metadata_bytes``: the encoded global metadata (the
    coordinator only)."""
    tensors: Dict[str, ShardedTensor] = {}
    objects: Dict[str, ShardedObject] = {}
    results: List[WriteResult] = []
    for item in items:
        fqn = item.index.fqn
        if fqn == METADATA_KEY:
            raise ValidationError(
                f"the state dict uses the key {fqn!r}, reserved for the checkpoint's metadata; rename it"
            )
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            raw = _bytes_of(fqn, data)
            objects[str(len(objects))] = _object(fqn, raw)
            nbytes = len(raw)
        else:
            st = _shard_of(item, data)
            tensors[str(len(tensors))] = st
            nbytes = st.nbytes
        results.append(WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=rank))
    payload: Dict[str, Any] = {FORMAT_KEY: PAYLOAD_VERSION, "tensors": tensors, "objects": objects}
    if metadata_bytes is not None:
        payload["metadata"] = _object(METADATA_KEY, metadata_bytes)
    return payload, results


def _bytes_of(fqn: str, data: Any) -> bytes:
    if not isinstance(data, io.BytesIO):
        raise ValidationError(
            f"the planner resolved bytes item {fqn!r} to a {type(data).__name__}; DCP's contract "
            "is an io.BytesIO (DefaultSavePlanner serializes non-tensor values that way)"
        )
    return data.getvalue()


def _shard_of(item: WriteItem, data: Any) -> ShardedTensor:
    fqn = item.index.fqn
    td = item.tensor_data
    if td is None or not isinstance(data, torch.Tensor):
        raise ValidationError(
            f"tensor item {fqn!r}: the planner resolved it to a {type(data).__name__} "
            f"(tensor metadata {'missing' if td is None else 'present'}); expected a tensor"
        )
    tensor = data.detach()
    sizes = tuple(int(s) for s in td.chunk.sizes)
    if tuple(tensor.shape) != sizes:
        raise ValidationError(
            f"tensor item {fqn!r} at offset {tuple(td.chunk.offsets)}: the planner resolved a "
            f"tensor of shape {tuple(tensor.shape)} for a chunk of size {sizes}"
        )
    if tensor.dtype != td.properties.dtype:
        raise ValidationError(
            f"tensor item {fqn!r}: the planner resolved dtype {tensor.dtype}, the plan records "
            f"{td.properties.dtype}; the store keeps tensors in the recorded dtype, so convert "
            "in the planner's create_local_plan (metadata) as well as in resolve_data"
        )
    return ShardedTensor(
        fqn,
        tensor,
        tensor.dtype,
        sizes,
        tuple(int(s) for s in td.size),
        tuple(int(o) for o in td.chunk.offsets),
        None,  # DCP's chunks need not form a regular grid
        0,  # DCP's planner gave this chunk to this rank alone: the main (only) replica
    )


# ---- load --------------------------------------------------------------------------------------


def metadata_template(rank: int) -> Dict[str, Any]:
    """The template that asks for the metadata object only (and the payload's common part);
    rank 0 asks as its main replica (every rank reads it)."""
    return {"metadata": _object(METADATA_KEY, replica_id=0 if rank == 0 else 1)}


@dataclass(frozen=True)
class ReadAssignment:
    """One rank's part of the load template's replica ids (see the module docstring)."""

    #: shard keys this rank asks for as the main replica (the others it asks for as copies)
    main: FrozenSet[ShardKey]
    #: bytes-item fqns this rank asks for as the main replica
    main_objects: FrozenSet[str]
    #: stored chunks no rank reads, of keys some rank reads: asked for only to tile the key
    fillers: Tuple[ShardKey, ...] = ()


def assign_reads(plans: Sequence[Sequence[ReadItem]], metadata: Metadata) -> List[ReadAssignment]:
    """Per rank (``plans[r]``: rank r's ReadItems): the lowest rank reading a chunk or bytes
    item asks for it as the main replica; a key's chunks nobody reads go to its lowest reader."""
    first_reader: Dict[ShardKey, int] = {}
    first_object_reader: Dict[str, int] = {}
    key_reader: Dict[str, int] = {}
    for rank, items in enumerate(plans):
        for ri in items:
            fqn = ri.storage_index.fqn
            if ri.type == LoadItemType.BYTE_IO:
                first_object_reader.setdefault(fqn, rank)
                continue
            _, chunk = stored_chunk(metadata, ri.storage_index)
            first_reader.setdefault(shard_key(fqn, chunk), rank)
            key_reader.setdefault(fqn, rank)
    fillers: Dict[int, List[ShardKey]] = {}
    for fqn, rank in key_reader.items():
        tmd = metadata.state_dict_metadata[fqn]
        for chunk in tmd.chunks:  # type: ignore[union-attr]  (stored_chunk checked: a tensor)
            key = shard_key(fqn, chunk)
            if key not in first_reader:
                fillers.setdefault(rank, []).append(key)
    return [
        ReadAssignment(
            main=frozenset(k for k, r in first_reader.items() if r == rank),
            main_objects=frozenset(f for f, r in first_object_reader.items() if r == rank),
            fillers=tuple(fillers.get(rank, ())),
        )
        for rank in range(len(plans))
    ]


@dataclass
class ReadSlots:
    """Where each ReadItem's data lands in the state a :func:`read_template` load returns."""

    #: shard key -> name under ``state["tensors"]``
    tensors: Dict[ShardKey, str]
    #: fqn -> name under ``state["objects"]``
    objects: Dict[str, str]


def read_template(
    items: Sequence[ReadItem],
    metadata: Metadata,
    assignment: ReadAssignment,
    into: Optional[Dict[ShardKey, torch.Tensor]] = None,
) -> Tuple[Dict[str, Any], ReadSlots]:
    """The template for ``items``: every stored chunk and bytes item they read, once each,
    plus ``assignment``'s fillers. ``into``: tensors to load a chunk straight into (the
    destination, when it is exactly the stored chunk)."""
    into = into or {}
    tensors: Dict[str, ShardedTensor] = {}
    objects: Dict[str, ShardedObject] = {}
    slots = ReadSlots({}, {})

    def add_chunk(fqn: str, chunk: ChunkStorageMetadata, main: bool) -> None:
        key = shard_key(fqn, chunk)
        if key in slots.tensors:
            return
        tmd = metadata.state_dict_metadata[fqn]
        slots.tensors[key] = name = str(len(tensors))
        tensors[name] = ShardedTensor(
            fqn,
            into.get(key),
            tmd.properties.dtype,  # type: ignore[union-attr]
            tuple(int(s) for s in chunk.sizes),
            tuple(int(s) for s in tmd.size),  # type: ignore[union-attr]
            key[1],
            None,
            0 if main else 1,
        )

    for ri in items:
        idx = ri.storage_index
        if ri.type == LoadItemType.BYTE_IO:
            if idx.fqn not in slots.objects:
                slots.objects[idx.fqn] = name = str(len(objects))
                objects[name] = _object(idx.fqn, replica_id=0 if idx.fqn in assignment.main_objects else 1)
            continue
        _, chunk = stored_chunk(metadata, idx)
        add_chunk(idx.fqn, chunk, shard_key(idx.fqn, chunk) in assignment.main)
    for fqn, offsets in assignment.fillers:
        add_chunk(fqn, stored_chunk(metadata, MetadataIndex(fqn, offsets))[1], True)
    return {"tensors": tensors, "objects": objects}, slots


def shard_key(fqn: str, chunk: ChunkStorageMetadata) -> ShardKey:
    return (fqn, tuple(int(o) for o in chunk.offsets))


def stored_chunk(
    metadata: Metadata, index: MetadataIndex
) -> Tuple[TensorStorageMetadata, ChunkStorageMetadata]:
    """The stored chunk ``index`` names (its index hint first, as DCP does, then a search)."""
    tmd = metadata.state_dict_metadata.get(index.fqn)
    if not isinstance(tmd, TensorStorageMetadata):
        raise CorruptCheckpointError(
            f"read item {index.fqn!r} asks for a tensor the checkpoint's metadata "
            f"{'does not list' if tmd is None else 'lists as bytes'}"
        )
    offsets = tuple(index.offset) if index.offset is not None else (0,) * len(tmd.size)
    hint = index.index
    if hint is not None and 0 <= hint < len(tmd.chunks) and tuple(tmd.chunks[hint].offsets) == offsets:
        return tmd, tmd.chunks[hint]
    for chunk in tmd.chunks:
        if tuple(chunk.offsets) == offsets:
            return tmd, chunk
    raise CorruptCheckpointError(
        f"read item {index.fqn!r} asks for the chunk at offset {offsets}, which the checkpoint's "
        f"metadata does not list ({len(tmd.chunks)} chunks)"
    )
