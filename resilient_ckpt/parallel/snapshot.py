"""The one-walk snapshot of a plain sharded state dict (the cached save's path).

A state dict of only our ShardedTensor / ShardedObject leaves (no factories, no
LocalNonpersistentObject, str keys above every sharded leaf) is taken apart in one walk that
copies nothing (:func:`snapshot_parts`): its common part, its sharded skeleton and shard rows
(as :mod:`.hollow` stores them), its ShardedTensors and ShardedObjects. A save that finds them
unchanged reuses everything derived from them; :func:`from_parts` rebuilds what the general
path (:func:`.template.preprocess`) would give.
"""

from __future__ import annotations

import dataclasses
import operator
from dataclasses import dataclass, field
from itertools import chain, repeat
from typing import Any, List, Optional, Sequence, Tuple

from ..model import shard_table
from ..model.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, is_factory
from ..model.mapping import adapt as _adapt_leaf
from ..model.nested import HOLE, nonempty
from .hollow import tree_from_skeleton


class _NotPlain(Exception):
    """The state dict needs the general path (factories, Megatron objects, ...)."""


@dataclass
class SnapshotParts:
    """A sharded state dict taken apart in one walk, copying nothing: what
    ``preprocess`` + ``from_state_dict`` + ``to_bytes`` derive from it, for a plain state dict
    (only our ShardedTensor / ShardedObject leaves, no factories, no LocalNonpersistentObject,
    str keys above every sharded leaf). ``skeleton`` and ``rows`` equal
    :func:`hollow_parts` of the general path's sharded tree and ``common`` its common part, so
    a save that finds them unchanged reuses everything derived from them. ``rows`` are made
    when first asked for: a save that finds its shards unchanged by :func:`same_shards`
    never needs them."""

    common: Any = None
    #: the skeleton as the walk found it: a layer of only ShardedTensors is a :class:`Layer`
    #: (compared by its keys, in order, without a dict of them being made)
    raw_skeleton: Any = None
    shards: List[ShardedTensor] = field(default_factory=list)
    objects: List[ShardedObject] = field(default_factory=list)
    _rows: Optional[List[tuple]] = None
    _skeleton: Any = None

    def holds_data(self) -> bool:
        """Every shard has its tensor (none is None)."""
        return not any(map(operator.is_, map(_DATA, self.shards), repeat(None)))

    @property
    def rows(self) -> List[tuple]:
        if self._rows is None:
            self._rows = shard_rows(self.shards)
        return self._rows

    @property
    def skeleton(self) -> Any:
        """The skeleton as ``hollow_parts`` gives it (layers made into dicts, when first asked)."""
        if self._skeleton is None:
            self._skeleton = _dicts_of_layers(self.raw_skeleton)
        return self._skeleton


class Layer:
    """A dict of only ShardedTensors (a model's state dict) in a raw skeleton: its keys, in
    order, and the index of its first shard — it stands for ``{key: start + i}``."""

    __slots__ = ("keys", "start")

    def __init__(self, keys: List[str], start: int):
        self.keys = keys
        self.start = start

    def __eq__(self, other: Any) -> bool:
        return type(other) is Layer and self.start == other.start and self.keys == other.keys

    __hash__ = None  # type: ignore[assignment]

    def as_dict(self) -> dict:
        return dict(zip(self.keys, range(self.start, self.start + len(self.keys))))


def _dicts_of_layers(x: Any) -> Any:
    if type(x) is Layer:
        return x.as_dict()
    if isinstance(x, dict):
        return {k: _dicts_of_layers(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_dicts_of_layers(v) for v in x]
    return x


def shard_rows(shards: Sequence[ShardedTensor]) -> List[tuple]:
    """Every shard's table row (:func:`..model.shard_table.shard_row`)."""
    return list(map(shard_table.shard_row, shards))


_DATA = operator.attrgetter("data")


#: every field of a ShardedTensor but its data, read at C speed: what a cached save compares
#: (a training loop's wrappers are fresh objects at every save, or the very same ones changed
#: in place: either way their fields are read again; nothing of them is kept). Derived from
#: the dataclass, so a field added to it is compared too; ``rank_local`` is an attribute.
_FIELDS = operator.attrgetter(
    *(f.name for f in dataclasses.fields(ShardedTensor) if f.name != "data"), "rank_local"
)


def shard_fields(shards: Sequence[ShardedTensor]) -> List[tuple]:
    """Every shard's metadata fields (``rank_local`` included: the table rows leave it out)."""
    return list(map(_FIELDS, shards))


def snapshot_parts(sharded_state_dict: Any) -> Optional[SnapshotParts]:
    """:class:`SnapshotParts` of ``sharded_state_dict``, or None if it is not plain."""
    if not isinstance(sharded_state_dict, (dict, list)):
        return None
    parts = SnapshotParts()
    try:
        parts.raw_skeleton, parts.common = _split_strip(sharded_state_dict, parts)
    except _NotPlain:
        return None
    return parts


def _special(v: Any) -> bool:
    return isinstance(v, (ShardedTensor, ShardedObject, LocalNonpersistentObject)) or (
        is_factory(v) or _adapt_leaf(v) is not v
    )


def from_parts(parts: SnapshotParts):
    """What ``preprocess`` and the leaf listings give, rebuilt from one-walk parts: the sharded
    tree (from the skeleton, with shallow copies: dropping data must not reach the caller's
    objects), the common part, its ShardedTensors and ShardedObjects in nested order."""
    shards = [shallow_copy(st) for st in parts.shards]
    objects = [shallow_copy(o) for o in parts.objects]
    return tree_from_skeleton(parts.skeleton, shards, objects), parts.common, shards, objects


def shallow_copy(obj: Any) -> Any:
    # copy.copy goes through __reduce_ex__ and costs ~10x more; state dicts have 100k shards.
    new = object.__new__(type(obj))
    new.__dict__.update(obj.__dict__)
    return new


def _split_strip(x: Any, parts: SnapshotParts) -> Tuple[Any, Any]:
    """``split(x, is_sharded)`` of the structural copy ``preprocess`` makes (plain dicts and
    lists), with the sharded side's leaves replaced as in :func:`hollow_parts`. (Leaf tests
    are inlined: this runs once per leaf of every cached save.)"""
    if isinstance(x, dict):
        return _split_dict(x, parts)
    return _split_list(x, parts)


def _split_dict(x: dict, parts: SnapshotParts) -> Tuple[Any, Any]:
    shards, objects = parts.shards, parts.objects
    if len(x) > 1 and _only_shards(x):
        # A layer of ShardedTensors (a model's state dict): taken in bulk.
        n = len(shards)
        shards.extend(x.values())
        return Layer(list(x), n), {}
    if len(x) > 1 and _only_layers(x):
        # Layers of ShardedTensors (an optimizer's state: one small dict per parameter): each
        # taken in bulk, as the loop below would take it, without its per-entry tests.
        match = {}
        for k, v in x.items():
            n = len(shards)
            shards.extend(v.values())
            match[k] = Layer(list(v), n) if len(v) > 1 else {next(iter(v)): n}
        return match, {}
    match: dict = {}
    rest: dict = {}
    for k, v in x.items():
        t = type(v)
        if t is ShardedTensor:
            _check_key(k)
            match[k] = len(shards)
            shards.append(v)
        elif t is ShardedObject:
            _check_key(k)
            objects.append(v)
            match[k] = -len(objects)
        elif isinstance(v, (dict, list)):
            m, r = _split_strip(v, parts)
            if nonempty(m):
                _check_key(k)
                match[k] = m
            if nonempty(r) or not v:
                rest[k] = r
        elif _special(v):
            raise _NotPlain
        else:
            rest[k] = v
    return match, rest


def _split_list(x: list, parts: SnapshotParts) -> Tuple[Any, Any]:
    if len(x) > 16 and set(map(type, x)) <= _PLAIN_TYPES:
        # A long list of plain values (an optimizer's parameter names): all common, at C speed.
        return [], list(x)
    shards, objects = parts.shards, parts.objects
    match_l: list = []
    rest_l: list = []
    for v in x:
        t = type(v)
        if t is ShardedTensor:
            match_l.append(len(shards))
            rest_l.append(HOLE)
            shards.append(v)
        elif t is ShardedObject:
            objects.append(v)
            match_l.append(-len(objects))
            rest_l.append(HOLE)
        elif isinstance(v, (dict, list)):
            if v:
                m, r = _split_strip(v, parts)
                match_l.append(m if nonempty(m) else HOLE)
                rest_l.append(r if nonempty(r) else HOLE)
            else:
                match_l.append(HOLE)
                rest_l.append({} if isinstance(v, dict) else [])
        elif _special(v):
            raise _NotPlain
        else:
            match_l.append(HOLE)
            rest_l.append(v)
    return (match_l if nonempty(match_l) else []), rest_l


def _only_shards(x: dict) -> bool:
    """Every value of ``x`` a ShardedTensor and every key a str (see :func:`_check_key`)."""
    return set(map(type, x.values())) == _SHARD_TYPE and set(map(type, x)) == _STR_TYPE


def _only_layers(x: dict) -> bool:
    """Every value of ``x`` a non-empty dict of only ShardedTensors, every key on both levels a
    str (tested at C speed over the flattened level below)."""
    values = x.values()
    return (
        set(map(type, values)) == _DICT_TYPE
        and all(values)
        and set(map(type, x)) == _STR_TYPE
        and set(map(type, chain.from_iterable(values))) == _STR_TYPE
        and set(map(type, chain.from_iterable(map(dict.values, values)))) == _SHARD_TYPE
    )


_DICT_TYPE = {dict}
_SHARD_TYPE = {ShardedTensor}
_PLAIN_TYPES = frozenset((str, int, float, bool, bytes, type(None)))
_STR_TYPE = {str}


def _check_key(k: Any) -> None:
    # Cached parts are compared with ==, under which 1 == True == 1.0: only str keys above a
    # sharded leaf keep that comparison exact (Megatron's state dicts have nothing else).
    if type(k) is not str:
        raise _NotPlain
