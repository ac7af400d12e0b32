"""Sharded state dict vocabulary: ShardedTensor, ShardedObject and their ids.

Semantics follow Megatron-core's ``dist_checkpointing.mapping`` so a Megatron model's
``sharded_state_dict()`` works unchanged; Megatron's own objects are accepted wherever ours
are (see :func:`adapt`), without making megatron-core a dependency.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch

from ..errors import ValidationError
from .nested import map_leaves_inplace

ReplicaId = Union[int, Tuple[int, ...]]
#: Identifies the same piece of a global tensor on every rank that holds a copy.
ShardId = Tuple[str, Tuple[int, ...]]
#: ShardedObjects are atomic, so their id also carries the global shape (as in Megatron).
ObjectId = Tuple[str, Tuple[int, ...], Tuple[int, ...]]


#: separates a rank-local shard's key from its owner in :func:`owned_shard_id`
_OWNER_SEP = "\x00owner="


def owned_shard_id(shard_id: ShardId, owner: int) -> ShardId:
    """The id a load exchange gives rank ``owner``'s copy of a rank-local shard: every rank
    saves its own under the same shard id, and a restore must give each its own (a lost
    rank's from the replica of its checkpoint, not from the serving rank's own copy)."""
    return (f"{shard_id[0]}{_OWNER_SEP}{owner}", shard_id[1])


def plain_shard_id(shard_id: ShardId) -> ShardId:
    """The shard id an :func:`owned_shard_id` stands for (itself if it is a plain one)."""
    key = shard_id[0]
    return (key.split(_OWNER_SEP, 1)[0], shard_id[1]) if _OWNER_SEP in key else shard_id


def is_main_replica(replica_id: ReplicaId) -> bool:
    """``0`` or a tuple of zeros marks the main replica."""
    if isinstance(replica_id, int):
        return replica_id == 0
    return all(r == 0 for r in replica_id)


#: every torch dtype by its name (``float32``) and back: how shard records, layouts, the
#: shard table, the exchange and the codec name dtypes (looked up, not built per call: records
#: and layouts are made per shard)
TORCH_DTYPES: Dict[str, torch.dtype] = {
    str(d).split(".", 1)[1]: d for d in vars(torch).values() if isinstance(d, torch.dtype)
}
DTYPE_NAMES: Dict[torch.dtype, str] = {d: n for n, d in TORCH_DTYPES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    """``float32`` for ``torch.float32``."""
    name = DTYPE_NAMES.get(dtype)
    return name if name is not None else str(dtype).replace("torch.", "")


def dtype_nbytes(dtype: torch.dtype) -> int:
    # torch.dtype.itemsize exists from torch 2.1; bits covers sub-byte-free dtypes uniformly.
    return dtype.itemsize


@dataclass
class ShardedTensor:
    """A local tensor that is one (possibly replicated) piece of a global tensor.

    Args mirror Megatron-core: ``global_offset`` counts elements of the global tensor,
    ``prepend_axis_num`` leading global axes have local extent 1 and no local axis,
    ``axis_fragmentations`` is the regular grid (or None for an irregular one).

    ``rank_local`` (our extension; an attribute, not a field: the fields are Megatron-core's):
    each rank's value is its own although the shard is replicated by name — BatchNorm
    statistics under data parallelism, which every rank updates from its own batch. Every
    holder saves its copy and gets it back on restore (a replaced rank from its replica);
    integrity, the main replica and what a persistent flush or a restore on another layout
    reads are as for any replica.
    """

    key: str
    data: Optional[torch.Tensor] = field(repr=False)
    dtype: torch.dtype
    local_shape: Tuple[int, ...]
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    axis_fragmentations: Optional[Tuple[int, ...]]
    replica_id: ReplicaId = 0
    prepend_axis_num: int = 0
    allow_shape_mismatch: bool = False
    rank_local = False  # see the class docstring (set per instance)

    def __post_init__(self):
        self.local_shape = tuple(int(s) for s in self.local_shape)
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if self.axis_fragmentations is not None:
            self.axis_fragmentations = tuple(int(s) for s in self.axis_fragmentations)
        if isinstance(self.replica_id, list):
            self.replica_id = tuple(self.replica_id)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        """Raise :class:`ValidationError` naming the key if the metadata is inconsistent."""
        k = self.key
        if not isinstance(k, str) or not k:
            raise ValidationError(f"ShardedTensor key must be a non-empty string, got {k!r}")
        if self.data is not None:
            if self.data.dtype != self.dtype:
                raise ValidationError(
                    f"ShardedTensor {k!r}: data dtype {self.data.dtype} differs from dtype {self.dtype}"
                )
            if tuple(self.data.shape) != self.local_shape:
                raise ValidationError(
                    f"ShardedTensor {k!r}: data shape {tuple(self.data.shape)} differs from "
                    f"local_shape {self.local_shape}"
                )
        if len(self.global_shape) != len(self.global_offset):
            raise ValidationError(
                f"ShardedTensor {k!r}: global_offset {self.global_offset} and global_shape "
                f"{self.global_shape} have different numbers of axes"
            )
        if len(self.local_shape) + self.prepend_axis_num != len(self.global_shape):
            raise ValidationError(
                f"ShardedTensor {k!r}: local_shape {self.local_shape} plus prepend_axis_num "
                f"{self.prepend_axis_num} does not match global_shape {self.global_shape}"
            )
        if any(o < 0 for o in self.global_offset) or any(s < 0 for s in self.global_shape):
            raise ValidationError(f"ShardedTensor {k!r}: negative offset or shape")
        if not self.allow_shape_mismatch:
            for axis, (off, ext, glob) in enumerate(
                zip(self.global_offset, self._extent(), self.global_shape)
            ):
                if off + ext > glob:
                    raise ValidationError(
                        f"ShardedTensor {k!r}: axis {axis} covers [{off}, {off + ext}) outside "
                        f"global shape {self.global_shape}"
                    )
        if self.axis_fragmentations is not None:
            if len(self.axis_fragmentations) != len(self.global_shape):
                raise ValidationError(
                    f"ShardedTensor {k!r}: axis_fragmentations {self.axis_fragmentations} do "
                    f"not match global_shape {self.global_shape}"
                )
            for off, sh in zip(self.global_offset[self.prepend_axis_num :], self.local_shape):
                if sh != 0 and off % sh != 0:
                    raise ValidationError(
                        f"ShardedTensor {k!r}: global offset {off} is not divisible by the local "
                        f"shape {sh} (regular grid expected; pass axis_fragmentations=None for "
                        "an irregular one)"
                    )

    def _extent(self) -> Tuple[int, ...]:
        """Extent along each global axis (1 for prepended axes)."""
        return (1,) * self.prepend_axis_num + self.local_shape

    @property
    def shard_id(self) -> ShardId:
        return (self.key, self.global_offset)

    @property
    def numel(self) -> int:
        return math.prod(self.local_shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_nbytes(self.dtype)

    @property
    def has_regular_grid(self) -> bool:
        return self.axis_fragmentations is not None

    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)

    def global_slice(self) -> Tuple[Union[int, slice], ...]:
        p = self.prepend_axis_num
        return tuple(self.global_offset[:p]) + tuple(
            slice(o, o + s) for o, s in zip(self.global_offset[p:], self.local_shape)
        )

    def global_box(self) -> Tuple[Tuple[int, int], ...]:
        """``(start, stop)`` per global axis."""
        return tuple((o, o + e) for o, e in zip(self.global_offset, self._extent()))

    def local_chunk_offset_in_global(self) -> Tuple[int, ...]:
        p = self.prepend_axis_num
        out = list(self.global_offset[:p])
        for off, sh in zip(self.global_offset[p:], self.local_shape):
            out.append(off // sh if sh else 0)
        return tuple(out)

    def without_data(self) -> "ShardedTensor":
        return replace(self, data=None)

    def init_data(self, device: Union[str, torch.device], init_fn: Callable = torch.empty):
        """Allocate ``data`` (only when it is None)."""
        if self.data is None:
            self.data = init_fn(self.local_shape, dtype=self.dtype, device=device)

    @classmethod
    def from_rank_offsets(
        cls,
        key: str,
        data: torch.Tensor,
        *rank_offsets: Tuple[int, int, int],
        replica_id: ReplicaId = 0,
        prepend_axis_num: int = 0,
        **init_kwargs: Any,
    ) -> "ShardedTensor":
        """Build from ``(axis, rank_offset_on_axis, fragments_on_axis)`` tuples.

        ``(axis, r, n)`` says the global tensor is cut into ``n`` pieces along ``axis`` and
        ``data`` is piece ``r``; axes count the prepended ones first (Megatron semantics).
        """
        if init_kwargs.pop("flattened_range", None) is not None:
            raise ValidationError(
                f"ShardedTensor {key!r}: flattened_range is not supported; reshape the local "
                "shard or describe it with global_offset"
            )
        ndim = data.ndim + prepend_axis_num
        global_offset = [0] * ndim
        global_shape = [1] * prepend_axis_num + list(data.shape)
        axis_fragmentations = [1] * ndim
        seen = set()
        for ro in rank_offsets:
            if len(ro) != 3:
                raise ValidationError(f"ShardedTensor {key!r}: rank offset {ro} is not a triple")
            axis, axis_rank_offset, axis_fragm = (int(v) for v in ro)
            if (
                axis < 0
                or axis >= ndim
                or axis_fragm < 1
                or not 0 <= axis_rank_offset < axis_fragm
                or axis in seen
            ):
                raise ValidationError(
                    f"ShardedTensor {key!r}: invalid rank offsets {rank_offsets} for a "
                    f"{ndim}-axis global tensor (axis in range, 0 <= offset < fragments, each "
                    "axis once)"
                )
            seen.add(axis)
            local_axis = 1 if axis < prepend_axis_num else data.shape[axis - prepend_axis_num]
            global_shape[axis] = axis_fragm * local_axis
            global_offset[axis] = axis_rank_offset * local_axis
            axis_fragmentations[axis] = axis_fragm
        return cls(
            key,
            data,
            data.dtype,
            tuple(data.shape),
            tuple(global_shape),
            tuple(global_offset),
            tuple(axis_fragmentations),
            replica_id,
            prepend_axis_num,
            **init_kwargs,
        )

    def __repr__(self) -> str:
        return (
            f"ShardedTensor(key={self.key!r}, dtype={self.dtype}, local_shape={self.local_shape},"
            f" global_shape={self.global_shape}, global_offset={self.global_offset},"
            f" replica_id={self.replica_id})"
        )


@dataclass
class ShardedObject:
    """A non-tensor value that is one atomic piece of a global (grid of) objects."""

    key: str
    data: Any
    global_shape: Tuple[int, ...]
    global_offset: Tuple[int, ...]
    replica_id: ReplicaId = 0

    def __post_init__(self):
        self.global_shape = tuple(int(s) for s in self.global_shape)
        self.global_offset = tuple(int(s) for s in self.global_offset)
        if isinstance(self.replica_id, list):
            self.replica_id = tuple(self.replica_id)
        self.validate_metadata_integrity()

    def validate_metadata_integrity(self) -> None:
        if not isinstance(self.key, str) or not self.key:
            raise ValidationError(f"ShardedObject key must be a non-empty string: {self.key!r}")
        if len(self.global_shape) != len(self.global_offset):
            raise ValidationError(
                f"ShardedObject {self.key!r}: global_offset {self.global_offset} and "
                f"global_shape {self.global_shape} have different numbers of axes"
            )

    @property
    def object_id(self) -> ObjectId:
        return (self.key, self.global_offset, self.global_shape)

    @property
    def unique_key(self) -> str:
        return (
            f"{self.key}/shard_{'.'.join(map(str, self.global_offset))}_"
            f"{'.'.join(map(str, self.global_shape))}"
        )

    def is_main_replica(self) -> bool:
        return is_main_replica(self.replica_id)

    def without_data(self) -> "ShardedObject":
        return replace(self, data=None)

    def __repr__(self) -> str:
        return f"ShardedObject(key={self.key!r}, global_offset={self.global_offset})"


class LocalNonpersistentObject:
    """Kept out of the checkpoint; on load the caller's local value is placed in the result."""

    def __init__(self, obj: Any):
        self.obj = obj

    def unwrap(self) -> Any:
        return self.obj


ShardedBase = (ShardedTensor, ShardedObject)

# --- Megatron-core interop --------------------------------------------------------------

_MCORE_MAPPING = "megatron.core.dist_checkpointing.mapping"


def _is_mcore(obj: Any, name: str) -> bool:
    cls = type(obj)
    return cls.__name__ == name and cls.__module__ == _MCORE_MAPPING


def adapt(obj: Any) -> Any:
    """Return our equivalent of a Megatron-core mapping object; anything else unchanged.

    Megatron ShardedTensorFactory objects are built (their merge is applied by the caller via
    :func:`split_factories`); LocalNonpersistentObject is rewrapped.
    """
    if isinstance(obj, (ShardedTensor, ShardedObject, LocalNonpersistentObject)):
        return obj
    if _is_mcore(obj, "ShardedTensor"):
        if getattr(obj, "flattened_range", None) is not None:
            raise ValidationError(f"ShardedTensor {obj.key!r}: flattened_range is not supported")
        return ShardedTensor(
            obj.key,
            obj.data,
            obj.dtype,
            tuple(obj.local_shape),
            tuple(obj.global_shape),
            tuple(obj.global_offset),
            None if obj.axis_fragmentations is None else tuple(obj.axis_fragmentations),
            obj.replica_id,
            obj.prepend_axis_num,
            obj.allow_shape_mismatch,
        )
    if _is_mcore(obj, "ShardedObject"):
        return ShardedObject(
            obj.key, obj.data, tuple(obj.global_shape), tuple(obj.global_offset), obj.replica_id
        )
    if _is_mcore(obj, "LocalNonpersistentObject"):
        return LocalNonpersistentObject(obj.unwrap())
    return obj


def is_factory(obj: Any) -> bool:
    """Megatron-style ShardedTensorFactory: builds a sub-state-dict, merges it back on load."""
    return callable(getattr(obj, "build", None)) and callable(getattr(obj, "merge_fn", None))


def apply_factories_and_adapt(sharded_state_dict: Any) -> Any:
    """In place: build factories (recursively) and convert Megatron objects to ours."""

    def _apply(x: Any) -> Any:
        if is_factory(x):
            return map_leaves_inplace(_apply, x.build())
        return adapt(x)

    return map_leaves_inplace(_apply, sharded_state_dict)


def apply_factory_merges(loaded: Any, factories: Any, path: tuple = ()) -> Any:
    """Inverse of the factories' ``build``: merge loaded sub-dicts back into tensors."""
    if is_factory(factories):
        return factories.merge_fn(loaded)
    if isinstance(factories, dict):
        for k, f in factories.items():
            if k not in loaded:
                raise ValidationError(
                    f"factory at {'/'.join(map(str, path + (k,)))} has no loaded value to merge"
                )
            loaded[k] = apply_factory_merges(loaded[k], f, path + (k,))
        return loaded
    if isinstance(factories, list):
        for i, f in enumerate(factories):
            if f is None or (isinstance(f, (list, dict)) and not f):
                continue
            loaded[i] = apply_factory_merges(loaded[i], f, path + (i,))
        return loaded
    return loaded


def is_sharded(x: Any) -> bool:
    return isinstance(x, ShardedBase)
