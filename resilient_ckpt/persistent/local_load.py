"""Loading in this process only (no collective): each caller reads what it needs.

- :func:`load_local`: a whole DCP load (plan, read, fill) with a reader and a planner;
- :func:`load_metadata_only`: a checkpoint (or some keys) as a nested state dict, no model;
- :func:`read_values`: a few non-tensor entries, decoded or raw;
- :func:`tensors_metadata`: Megatron's ``load_tensors_metadata`` view of the metadata.
"""

from __future__ import annotations

import io
import os
from typing import Any, Dict, Iterable, Optional, Sequence, Union

from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ..errors import ValidationError
from ..model.mapping import ShardedTensor
from .layout import MAX_REPORTED, is_internal
from .load_planner import (
    MetadataStateDictLoadPlanner,
    PassiveLoadPlanner,
    ResilientLoadPlanner,
    decode_value,
    value_read_item,
)
from .storage import SafeFileSystemReader


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
        raise ValidationError(f"checkpoint has no value entries {missing[:MAX_REPORTED]}")
    planner = _ValueCollector(allow_pickle, raw)
    reader.read_data(LoadPlan([value_read_item(f) for f in fqns]), planner).wait()
    return planner.values


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
            out[fqn] = ShardedTensor(fqn, None, v.properties.dtype, shape, shape, (0,) * len(shape), None)
    return out
