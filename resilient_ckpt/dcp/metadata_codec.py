"""DCP's ``Metadata`` as bytes without pickle.

DCP pickles its ``Metadata`` into a ``.metadata`` file; our store never holds pickles
(decoding must be safe on bytes read back from shared memory or a peer). This module turns a
``Metadata`` into a plain value tree — dicts, lists, tuples, ints, strs and ``torch.dtype`` —
and encodes it with :mod:`resilient_ckpt.model.codec`; decoding checks every field and raises
:class:`~resilient_ckpt.errors.CorruptCheckpointError` naming the first one that is wrong.

Layout of the tree (``FORMAT``, ``VERSION`` 1)::

    {"format": FORMAT, "version": 1,
     "entries": [{"fqn": str, "kind": "tensor", "dtype": torch.dtype, "layout": "strided",
                  "requires_grad": bool, "memory_format": "contiguous_format",
                  "pin_memory": bool, "size": (int, ...),
                  "chunks": [((offsets...), (sizes...)), ...]}
                 | {"fqn": str, "kind": "bytes"}, ...],
     "planner_data": <codec value>, "storage_data": <codec value>,
     "storage_meta": None | {"checkpoint_id": str | None, "save_id": str | None,
                             "load_id": str | None, "modules": [str, ...]},
     "dcp_version": str | None}

``planner_data`` and ``storage_data`` are whatever the planner / storage layer put there
(DefaultSavePlanner: fqn -> path tuple); a value the codec cannot encode raises naming it.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import CodecError, CorruptCheckpointError, ValidationError
from ..model import codec

__all__ = ["FORMAT", "VERSION", "decode_metadata", "encode_metadata"]

FORMAT = "resilient_ckpt/dcp-metadata"
VERSION = 1

# Named, not pickled: the layouts and memory formats DCP's TensorProperties can carry.
_LAYOUTS = {
    name: getattr(torch, name)
    for name in ("strided", "sparse_coo", "sparse_csr", "sparse_csc", "sparse_bsr", "sparse_bsc", "jagged")
    if isinstance(getattr(torch, name, None), torch.layout)
}
_MEMORY_FORMATS = {
    name: getattr(torch, name)
    for name in ("contiguous_format", "channels_last", "channels_last_3d", "preserve_format")
}


def encode_metadata(metadata: Metadata) -> bytes:
    """``metadata`` as codec bytes (no pickle). Raises ValidationError naming what cannot be
    encoded."""
    if not isinstance(metadata, Metadata):
        raise ValidationError(f"expected DCP Metadata, got {type(metadata).__name__}")
    tree = {
        "format": FORMAT,
        "version": VERSION,
        "entries": [_entry_to_plain(fqn, v) for fqn, v in metadata.state_dict_metadata.items()],
        "planner_data": metadata.planner_data,
        "storage_data": metadata.storage_data,
        "storage_meta": _storage_meta_to_plain(metadata.storage_meta),
        "dcp_version": metadata.version,
    }
    try:
        return codec.encode(tree)
    except CodecError as e:
        raise ValidationError(
            f"the checkpoint's DCP metadata cannot be stored without pickle: {e}. The planner's "
            "planner_data (or storage_data) must hold plain values (dicts, lists, tuples, "
            "numbers, strings) or types registered with resilient_ckpt.model.codec.register_type"
        ) from e


def decode_metadata(data: Any) -> Metadata:
    """The ``Metadata`` :func:`encode_metadata` wrote. Raises CorruptCheckpointError (also for
    bytes that are not such an encoding)."""
    try:
        tree = codec.decode(data)
    except CodecError as e:
        raise CorruptCheckpointError(f"the stored DCP metadata does not decode: {e}") from e
    _expect(isinstance(tree, dict), "is not a map")
    _expect(tree.get("format") == FORMAT, f"has format {tree.get('format')!r}, expected {FORMAT!r}")
    version = tree.get("version")
    _expect(
        isinstance(version, int) and 1 <= version <= VERSION,
        f"has version {version!r}; this build reads versions 1 to {VERSION} (a newer "
        "resilient_ckpt wrote it: upgrade to load it)",
    )
    entries = tree.get("entries")
    _expect(isinstance(entries, list), "has no entry list")
    state: Dict[str, Any] = {}
    for i, e in enumerate(entries):
        fqn, value = _entry_from_plain(i, e)
        _expect(fqn not in state, f"lists {fqn!r} twice")
        state[fqn] = value
    dcp_version = tree.get("dcp_version")
    _expect(dcp_version is None or isinstance(dcp_version, str), "has a dcp_version that is not a str")
    return Metadata(
        state_dict_metadata=state,
        planner_data=tree.get("planner_data"),
        storage_data=tree.get("storage_data"),
        storage_meta=_storage_meta_from_plain(tree.get("storage_meta")),
        version=dcp_version,
    )


# ---- entries ---------------------------------------------------------------------------------


def _entry_to_plain(fqn: str, value: Any) -> Dict[str, Any]:
    if not isinstance(fqn, str):
        raise ValidationError(f"DCP metadata key {fqn!r} is not a str")
    if isinstance(value, BytesStorageMetadata):
        return {"fqn": fqn, "kind": "bytes"}
    if not isinstance(value, TensorStorageMetadata):
        raise ValidationError(
            f"DCP metadata entry {fqn!r} is a {type(value).__name__}; only TensorStorageMetadata "
            "and BytesStorageMetadata are stored"
        )
    p = value.properties
    return {
        "fqn": fqn,
        "kind": "tensor",
        "dtype": p.dtype,
        "layout": _name_of(p.layout, _LAYOUTS, fqn, "layout"),
        "requires_grad": bool(p.requires_grad),
        "memory_format": _name_of(p.memory_format, _MEMORY_FORMATS, fqn, "memory_format"),
        "pin_memory": bool(p.pin_memory),
        "size": tuple(int(s) for s in value.size),
        "chunks": [(tuple(int(o) for o in c.offsets), tuple(int(s) for s in c.sizes)) for c in value.chunks],
    }


def _entry_from_plain(i: int, e: Any):
    _expect(isinstance(e, dict) and isinstance(e.get("fqn"), str), f"entry {i} has no str fqn")
    fqn = e["fqn"]
    kind = e.get("kind")
    if kind == "bytes":
        return fqn, BytesStorageMetadata()
    _expect(kind == "tensor", f"entry {fqn!r} has kind {kind!r} (expected 'tensor' or 'bytes')")
    dtype = e.get("dtype")
    _expect(isinstance(dtype, torch.dtype), f"entry {fqn!r} has no dtype")
    _expect(e.get("layout") in _LAYOUTS, f"entry {fqn!r} has an unknown layout {e.get('layout')!r}")
    _expect(
        e.get("memory_format") in _MEMORY_FORMATS,
        f"entry {fqn!r} has an unknown memory_format {e.get('memory_format')!r}",
    )
    size = _ints(e.get("size"), f"entry {fqn!r} size")
    chunks_in = e.get("chunks")
    _expect(isinstance(chunks_in, list), f"entry {fqn!r} has no chunk list")
    chunks: List[ChunkStorageMetadata] = []
    for j, c in enumerate(chunks_in):
        _expect(isinstance(c, (tuple, list)) and len(c) == 2, f"entry {fqn!r} chunk {j} is malformed")
        offsets = _ints(c[0], f"entry {fqn!r} chunk {j} offsets")
        sizes = _ints(c[1], f"entry {fqn!r} chunk {j} sizes")
        _expect(
            len(offsets) == len(sizes) == len(size),
            f"entry {fqn!r} chunk {j} has {len(offsets)} offsets and {len(sizes)} sizes for a "
            f"{len(size)}-axis tensor",
        )
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    props = TensorProperties(
        dtype=dtype,
        layout=_LAYOUTS[e["layout"]],
        requires_grad=bool(e.get("requires_grad", False)),
        memory_format=_MEMORY_FORMATS[e["memory_format"]],
        pin_memory=bool(e.get("pin_memory", False)),
    )
    return fqn, TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


# ---- storage_meta ------------------------------------------------------------------------------


def _storage_meta_to_plain(sm: Optional[StorageMeta]) -> Optional[Dict[str, Any]]:
    if sm is None:
        return None
    cid = sm.checkpoint_id
    return {
        # A path is kept as its string: the id names the checkpoint, its type does not matter.
        "checkpoint_id": None
        if cid is None
        else os.fspath(cid)
        if isinstance(cid, os.PathLike)
        else str(cid),
        "save_id": sm.save_id,
        "load_id": sm.load_id,
        "modules": [str(m) for m in (sm.modules or [])],
    }


def _storage_meta_from_plain(sm: Any) -> Optional[StorageMeta]:
    if sm is None:
        return None
    _expect(isinstance(sm, dict), "has a storage_meta that is not a map")
    for k in ("checkpoint_id", "save_id", "load_id"):
        _expect(sm.get(k) is None or isinstance(sm.get(k), str), f"storage_meta {k} is not a str")
    modules = sm.get("modules") or []
    _expect(
        isinstance(modules, list) and all(isinstance(m, str) for m in modules),
        "storage_meta modules is not a list of str",
    )
    return StorageMeta(
        checkpoint_id=sm.get("checkpoint_id"),
        save_id=sm.get("save_id"),
        load_id=sm.get("load_id"),
        modules=list(modules),
    )


# ---- helpers -----------------------------------------------------------------------------------


def _name_of(value: Any, table: Dict[str, Any], fqn: str, what: str) -> str:
    for name, v in table.items():
        if v == value:
            return name
    raise ValidationError(f"DCP metadata entry {fqn!r}: {what} {value!r} is not one this codec names")


def _ints(value: Any, what: str) -> tuple:
    _expect(
        isinstance(value, (tuple, list))
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value),
        f"{what} is not a sequence of non-negative ints",
    )
    return tuple(value)


def _expect(ok: bool, problem: str) -> None:
    if not ok:
        raise CorruptCheckpointError(
            f"the stored DCP metadata {problem}; the checkpoint cannot be loaded with "
            "MemoryStorageReader (was it written by MemoryStorageWriter?)"
        )
