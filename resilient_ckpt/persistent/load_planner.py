"""Our DCP load planners, and the small pieces every reader of stored entries shares.

- :class:`ResilientLoadPlanner`: loads into a (sharded) state dict in place, with the
  flattening of :mod:`.flatten`; missing keys are an error unless ``allow_partial_load``;
  stored chunks are validated before anything is read; ShardedTensor leaves are replaced by
  the loaded tensors (allocated when their ``data`` is None); non-tensor entries decode with
  the codec, or, for checkpoints written by torch's ``dcp.save``, with
  ``torch.load(weights_only=True)`` (full unpickling only with ``allow_pickle=True``).
- :class:`MetadataStateDictLoadPlanner`: rebuilds a whole state dict from the metadata alone
  (one process: inspection, conversion).
- :class:`PassiveLoadPlanner`: the base for hand-made plans passed straight to
  ``StorageReader.read_data`` (only the data callbacks run).
- :func:`decode_value`, :func:`value_read_item`, :func:`narrow`: decoding a stored value,
  reading one, taking a slice of a stored chunk.
"""

from __future__ import annotations

import io
from collections import defaultdict
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from ..bits import copy_bits
from ..errors import CodecError, CorruptCheckpointError, ValidationError
from ..model import codec
from ..model.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, adapt, is_factory
from ..model.nested import HOLE
from .checks import validate_metadata
from .flatten import dtensor_entry, fmt_path, is_dtensor, is_terminal
from .layout import MAX_REPORTED, StatePath, is_internal

Setter = Callable[[Any], None]


def decode_value(raw: bytes, fqn: str, allow_pickle: bool = False) -> Any:
    """A stored non-tensor entry: our codec, or a torch.save payload (torch's ``dcp.save``)."""
    if raw[:4] == codec.MAGIC:
        return codec.decode(raw, allow_pickle=allow_pickle)
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=not allow_pickle)
    except Exception as e:
        hint = "; if you trust this checkpoint, load with allow_pickle=True" if not allow_pickle else ""
        raise CodecError(
            f"checkpoint entry {fqn!r} cannot be decoded safely ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:300] if str(e).strip() else ''}){hint}"
        ) from e


def value_read_item(fqn: str) -> ReadItem:
    """A read of a whole non-tensor (bytes) entry."""
    return ReadItem(
        type=LoadItemType.BYTE_IO,
        dest_index=MetadataIndex(fqn),
        dest_offsets=torch.Size([0]),
        storage_index=MetadataIndex(fqn),
        storage_offsets=torch.Size([0]),
        lengths=torch.Size([0]),
    )


def narrow(t: torch.Tensor, offsets: Sequence[int], lengths: Sequence[int]) -> torch.Tensor:
    """The region ``offsets``/``lengths`` of ``t`` (a view; ``t`` itself when it is all of it)."""
    for dim, (off, ln) in enumerate(zip(offsets, lengths)):
        if off != 0 or ln != t.shape[dim]:
            t = t.narrow(dim, off, ln)
    return t


def _set_path(root: Any, path: StatePath, value: Any) -> None:
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


class _Drop:
    def __repr__(self) -> str:
        return "DROP"


#: Marks a leaf to remove from the loaded state dict (absent, and nothing to keep).
_DROP = _Drop()


def _drop_marked_inplace(d: dict) -> None:
    for k in [k for k, v in d.items() if v is _DROP]:
        del d[k]


def _setter(container: Any, key: Any) -> Setter:
    def set_(v: Any) -> None:
        container[key] = v

    return set_


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

    def __init__(
        self, *, allow_partial_load: bool = False, allow_pickle: bool = False, validate: bool = True
    ):
        self.allow_partial_load = allow_partial_load
        self.allow_pickle = allow_pickle
        self.validate = validate
        self.keys_not_in_checkpoint: List[str] = []
        self.state_dict: Dict[str, Any] = {}
        self.metadata: Optional[Metadata] = None
        self._chunks: Dict[str, List[ChunkStorageMetadata]] = {}
        self._dest: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self._copy_back: Dict[Tuple[str, Tuple[int, ...]], torch.Tensor] = {}
        self._value_setters: Dict[str, List[Setter]] = defaultdict(list)
        self.bytes_requested = 0

    # -- registration helpers (shared with the metadata-only planner) --

    def _register_tensor(
        self, fqn: str, offsets: Tuple[int, ...], dest: torch.Tensor, target: Optional[torch.Tensor] = None
    ) -> None:
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
            raise ValidationError(
                f"{what} {fqn!r} is a tensor in the state dict but a non-tensor value in the checkpoint"
            )
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
            raise ValidationError(
                f"the state dict to load into must be a dict, got {type(state_dict).__name__}"
            )
        for k in list(state_dict):
            self._walk(state_dict, k, (str(k),))
        _drop_marked_inplace(state_dict)
        if self.keys_not_in_checkpoint and not self.allow_partial_load:
            ks = sorted(set(self.keys_not_in_checkpoint))
            shown = ", ".join(repr(k) for k in ks[:MAX_REPORTED])
            more = f" (+{len(ks) - MAX_REPORTED} more)" if len(ks) > MAX_REPORTED else ""
            raise ValidationError(
                f"keys requested but not in the checkpoint: {shown}{more}; fix: load with "
                "allow_partial_load=True to skip them, or check what the checkpoint holds "
                "(resilient-ckpt inspect DIR)"
            )
        if self.validate:
            validate_metadata(metadata, keys=self._chunks.keys())

    # -- the walk over the state dict: one planning step per kind of leaf --

    def _walk(self, container: Any, k: Any, path: StatePath) -> None:
        x = container[k]
        if x is HOLE:
            return
        if is_factory(x):
            raise ValidationError(
                f"ShardedTensorFactory at {fmt_path(path)}: apply factories before loading "
                "(PersistentTier.load does)"
            )
        x = adapt(x)
        setter = _setter(container, k)
        if isinstance(x, ShardedTensor):
            self._plan_sharded_tensor(x, setter)
        elif isinstance(x, ShardedObject):
            self._plan_sharded_object(x, setter)
        elif isinstance(x, LocalNonpersistentObject):
            setter(x.unwrap())
        elif is_dtensor(x):
            self._plan_dtensor(x, path)
        elif isinstance(x, torch.Tensor):
            self._plan_tensor(x, path)
        elif isinstance(x, dict):
            for kk in list(x):
                self._walk(x, kk, path + (str(kk),))
            _drop_marked_inplace(x)
        elif isinstance(x, list) and not is_terminal(x):
            for i in range(len(x)):
                self._walk(x, i, path + (i,))
            for i, v in enumerate(x):
                if v is _DROP:
                    x[i] = None
        else:
            self._plan_value(fmt_path(path), setter)

    def _plan_sharded_tensor(self, x: ShardedTensor, setter: Setter) -> None:
        md = self._tensor_md(x.key, "ShardedTensor")
        if md is None:
            setter(_DROP if x.data is None else x.data)
            return
        if tuple(md.size) != tuple(x.global_shape):
            raise ValidationError(
                f"{x.key!r}: the checkpoint holds global size {list(md.size)}, the state dict "
                f"asks for {list(x.global_shape)}"
            )
        if md.properties.dtype != x.dtype:
            raise ValidationError(
                f"{x.key!r}: the checkpoint holds {md.properties.dtype}, the state dict asks for {x.dtype}"
            )
        extent = (1,) * x.prepend_axis_num + tuple(x.local_shape)
        data = x.data if x.data is not None else torch.empty(x.local_shape, dtype=x.dtype)
        if data.is_contiguous():
            self._register_tensor(x.key, tuple(x.global_offset), data.view(extent))
        else:
            tmp = torch.empty(x.local_shape, dtype=x.dtype, device=data.device)
            self._register_tensor(x.key, tuple(x.global_offset), tmp.view(extent), data)
        setter(data)

    def _plan_sharded_object(self, x: ShardedObject, setter: Setter) -> None:
        fqn = x.unique_key
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            self.keys_not_in_checkpoint.append(fqn)
            setter(_DROP)
            return
        if not isinstance(md, BytesStorageMetadata):
            raise ValidationError(f"ShardedObject {fqn!r} is a tensor in the checkpoint")
        self._value_setters[fqn].append(setter)

    def _plan_dtensor(self, x: Any, path: StatePath) -> None:
        e = dtensor_entry(fmt_path(path), x)
        if e is None:
            return
        md = self._tensor_md(e.fqn, "DTensor")
        if md is None:
            return
        if tuple(md.size) != e.global_size:
            raise ValidationError(
                f"{e.fqn!r}: the checkpoint holds size {list(md.size)}, the DTensor has {list(e.global_size)}"
            )
        self._register_tensor(e.fqn, e.offsets, e.tensor)

    def _plan_tensor(self, x: torch.Tensor, path: StatePath) -> None:
        fqn = fmt_path(path)
        md = self._tensor_md(fqn, "tensor")
        if md is None:
            return
        if tuple(md.size) != tuple(x.shape):
            raise ValidationError(
                f"{fqn!r}: the checkpoint holds size {list(md.size)}, the state dict's tensor "
                f"has {list(x.shape)}"
            )
        self._register_tensor(fqn, (0,) * x.dim(), x.detach())

    def _plan_value(self, fqn: str, setter: Setter) -> None:
        md = self.metadata.state_dict_metadata.get(fqn)
        if md is None:
            self.keys_not_in_checkpoint.append(fqn)
            return
        if not isinstance(md, BytesStorageMetadata):
            raise ValidationError(f"{fqn!r} is a value in the state dict but a tensor in the checkpoint")
        self._value_setters[fqn].append(setter)

    # -- DCP's planning and data callbacks --

    def create_local_plan(self) -> LoadPlan:
        items: List[ReadItem] = []
        md = self.metadata.state_dict_metadata
        for fqn, chunks in self._chunks.items():
            items.extend(create_read_items_for_chunk_list(fqn, md[fqn], chunks))
        items.extend(value_read_item(fqn) for fqn in self._value_setters)
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
        return narrow(self._dest[key], read_item.dest_offsets, read_item.lengths)

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        key = (read_item.dest_index.fqn, tuple(read_item.dest_index.offset))
        target = self._copy_back.get(key)
        if target is not None:
            # The template's tensor is not contiguous: it was loaded into a contiguous stand-in.
            copy_bits(target, self._dest[key].reshape(target.shape))


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

    def _check_keys_present(self, metadata: Metadata) -> None:
        if self.keys is None:
            return
        absent = sorted(
            k
            for k in self.keys
            if not any(
                f == k or f.startswith(k + ".") or f.startswith(k + "/") for f in metadata.state_dict_metadata
            )
        )
        if absent:
            raise ValidationError(
                f"keys not in the checkpoint: {', '.join(map(repr, absent[:MAX_REPORTED]))}; "
                "see `resilient-ckpt inspect DIR` for what it holds"
            )

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
        self._check_keys_present(metadata)
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
