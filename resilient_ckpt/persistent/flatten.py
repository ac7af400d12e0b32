"""How a (sharded) state dict becomes DCP entries ("FQNs"), the same way for save and load.

- a :class:`ShardedTensor` is stored under its ``key`` with its chunk at ``global_offset``;
- a :class:`ShardedObject` under its ``unique_key``;
- plain tensors, DTensors and plain values under their path in the nested state dict joined
  by ``"."`` (torch's own flattening, so ``{"model": model.state_dict()}`` and ShardedTensors
  keyed ``"model.<name>"`` name the same entries).

Containers are descended as torch's ``_traverse.traverse_state_dict`` does (:func:`is_terminal`);
a container without any tensor below it is one value.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Tuple

import torch

from ..errors import ValidationError
from ..model.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, adapt, is_factory
from ..model.nested import HOLE
from .layout import StatePath

try:  # torch >= 2.4
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
except ImportError:  # pragma: no cover
    DTensor = None  # type: ignore[assignment]
    compute_local_shape_and_global_offset = None  # type: ignore[assignment]

#: (fqn, chunk offsets): one stored piece of a tensor.
ChunkId = Tuple[str, Tuple[int, ...]]


def is_dtensor(x: Any) -> bool:
    return DTensor is not None and isinstance(x, DTensor)


def _is_tensorish(x: Any) -> bool:
    return isinstance(x, (torch.Tensor, ShardedTensor, ShardedObject))


def is_terminal(x: Any) -> bool:
    """torch's flattening rule (``_traverse.traverse_state_dict``), with our sharded types
    counting as tensors: dicts are always descended, a list only when it holds a tensor, a
    dict or a descended list; anything else is one value."""
    if isinstance(x, dict):
        return False
    if isinstance(x, list):
        for e in x:
            if isinstance(e, (dict, list)):
                if not is_terminal(e):
                    return False
            elif _is_tensorish(adapt(e)) or isinstance(e, LocalNonpersistentObject) or is_factory(e):
                return False
        return True
    return True


def fmt_path(path: StatePath) -> str:
    """The DCP key of a position in a nested state dict (``"<root>"`` for the root)."""
    return ".".join(map(str, path)) or "<root>"


@dataclass(frozen=True)
class TensorEntry:
    """One tensor chunk to store: where it sits in its tensor, and the data."""

    fqn: str
    offsets: Tuple[int, ...]
    sizes: Tuple[int, ...]
    global_size: Tuple[int, ...]
    dtype: torch.dtype
    main: bool
    tensor: torch.Tensor = field(repr=False, compare=False)


@dataclass(frozen=True)
class ValueEntry:
    """One non-tensor value to store."""

    fqn: str
    main: bool
    value: Any = field(repr=False, compare=False)


@dataclass(frozen=True)
class FlatStateDict:
    """A state dict flattened into DCP entries."""

    tensors: Tuple[TensorEntry, ...]
    values: Tuple[ValueEntry, ...]
    #: fqn -> path in the nested state dict (torch's FLATTEN_MAPPING)
    mappings: Mapping[str, StatePath]


EMPTY_FLAT = FlatStateDict((), (), {})


def _object_mapping_path(path: StatePath, obj: ShardedObject) -> StatePath:
    # A grid of objects (per-rank state) gets one sub-key per piece when rebuilt from metadata.
    if all(s == 1 for s in obj.global_shape):
        return path
    return path + (obj.unique_key.rsplit("/", 1)[-1],)


def dtensor_entry(fqn: str, t: Any) -> Optional[TensorEntry]:
    """This rank's chunk of DTensor ``t`` (None when this rank is not in its mesh)."""
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
    return TensorEntry(fqn, tuple(offsets), tuple(sizes), tuple(t.shape), local.dtype, main, local)


def _sharded_tensor_entry(x: ShardedTensor) -> TensorEntry:
    extent = (1,) * x.prepend_axis_num + tuple(x.local_shape)
    data = x.data.detach()
    return TensorEntry(
        x.key,
        tuple(x.global_offset),
        extent,
        tuple(x.global_shape),
        x.dtype,
        x.is_main_replica(),
        data.reshape(extent),
    )


def _plain_tensor_entry(fqn: str, x: torch.Tensor) -> TensorEntry:
    t = x.detach()
    return TensorEntry(fqn, (0,) * t.dim(), tuple(t.shape), tuple(t.shape), t.dtype, True, t)


class _Flattener:
    """One walk over a state dict, collecting entries and refusing key collisions."""

    def __init__(self) -> None:
        self.tensors: List[TensorEntry] = []
        self.values: List[ValueEntry] = []
        self.mappings: Dict[str, StatePath] = {}
        self._seen_values: Dict[str, StatePath] = {}
        self._seen_chunks: Dict[ChunkId, StatePath] = {}

    def result(self) -> FlatStateDict:
        return FlatStateDict(tuple(self.tensors), tuple(self.values), self.mappings)

    def add_tensor(self, e: TensorEntry, path: StatePath) -> None:
        prev = self._seen_chunks.get((e.fqn, e.offsets))
        if prev is not None:
            raise ValidationError(
                f"state dict holds two pieces of {e.fqn!r} at offset {e.offsets} (at "
                f"{fmt_path(prev)} and {fmt_path(path)}); each piece may appear once per rank"
            )
        if e.fqn in self._seen_values:
            raise ValidationError(
                f"{e.fqn!r} names both a tensor (at {fmt_path(path)}) and a value (at "
                f"{fmt_path(self._seen_values[e.fqn])}); rename one"
            )
        self._seen_chunks[(e.fqn, e.offsets)] = path
        self.mappings.setdefault(e.fqn, path)
        self.tensors.append(e)

    def add_value(self, fqn: str, path: StatePath, main: bool, value: Any, map_path: StatePath) -> None:
        if fqn in self._seen_values or any(k[0] == fqn for k in self._seen_chunks):
            raise ValidationError(
                f"two entries of the state dict flatten to the same key {fqn!r} (at "
                f"{fmt_path(self._seen_values.get(fqn, ()))} and {fmt_path(path)}); rename one"
            )
        self._seen_values[fqn] = path
        self.mappings[fqn] = map_path
        self.values.append(ValueEntry(fqn, main, value))

    def walk(self, x: Any, path: StatePath) -> None:
        if x is HOLE:
            return  # a list position whose value lives in the other half of a split
        if is_factory(x):
            raise ValidationError(
                f"ShardedTensorFactory at {fmt_path(path)}: build factories before saving "
                "(MCoreTensorAwareStateDict.from_state_dict does)"
            )
        x = adapt(x)
        if isinstance(x, dict):
            for k, v in x.items():
                self.walk(v, path + (str(k),))
        elif isinstance(x, list) and not is_terminal(x):
            for i, v in enumerate(x):
                self.walk(v, path + (i,))
        else:
            self._add_leaf(x, path)

    def _add_leaf(self, x: Any, path: StatePath) -> None:
        if isinstance(x, ShardedTensor):
            if x.data is not None:  # None: metadata only, another rank saves this piece
                self.add_tensor(_sharded_tensor_entry(x), path)
        elif isinstance(x, ShardedObject):
            if x.is_main_replica():
                self.add_value(x.unique_key, path, True, x.data, _object_mapping_path(path, x))
        elif isinstance(x, LocalNonpersistentObject):
            return
        elif is_dtensor(x):
            e = dtensor_entry(fmt_path(path), x)
            if e is not None:
                self.add_tensor(e, path)
        elif isinstance(x, torch.Tensor):
            self.add_tensor(_plain_tensor_entry(fmt_path(path), x), path)
        else:
            self.add_value(fmt_path(path), path, True, x, path)


def flatten_for_save(state_dict: Mapping[str, Any]) -> FlatStateDict:
    """Flatten a (sharded) state dict into DCP entries. Containers without any tensor below
    them are one value (as torch flattens them)."""
    if not isinstance(state_dict, dict):
        raise ValidationError(f"the state dict to save must be a dict, got {type(state_dict).__name__}")
    flattener = _Flattener()
    for k, v in state_dict.items():
        flattener.walk(v, (str(k),))
    return flattener.result()
