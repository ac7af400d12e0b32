"""The one-walk snapshot of a plain sharded state dict (the cached save's path).

A state dict of only our ShardedTensor / ShardedObject leaves (no factories, no
LocalNonpersistentObject, str keys above every sharded leaf) is taken apart in one walk that
copies nothing (:func:`snapshot_parts`): its common part, its sharded skeleton and shard rows
(as :mod:`.hollow` stores them), its ShardedTensors and ShardedObjects. A save that finds them
unchanged reuses everything derived from them; :func:`from_parts` rebuilds what the general
path (:func:`.template.preprocess`) would give.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

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
    a save that finds them unchanged reuses everything derived from them."""

    common: Any = None
    skeleton: Any = None
    rows: List[tuple] = field(default_factory=list)
    shards: List[ShardedTensor] = field(default_factory=list)
    objects: List[ShardedObject] = field(default_factory=list)


def snapshot_parts(sharded_state_dict: Any) -> Optional[SnapshotParts]:
    """:class:`SnapshotParts` of ``sharded_state_dict``, or None if it is not plain."""
    if not isinstance(sharded_state_dict, (dict, list)):
        return None
    parts = SnapshotParts()
    try:
        parts.skeleton, parts.common = _split_strip(sharded_state_dict, parts)
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
    shards, rows, objects, row = parts.shards, parts.rows, parts.objects, shard_table.shard_row
    if isinstance(x, dict):
        match: dict = {}
        rest: dict = {}
        for k, v in x.items():
            t = type(v)
            if t is ShardedTensor:
                _check_key(k)
                match[k] = len(rows)
                shards.append(v)
                rows.append(row(v))
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
    match_l: list = []
    rest_l: list = []
    for v in x:
        t = type(v)
        if t is ShardedTensor:
            match_l.append(len(rows))
            rest_l.append(HOLE)
            shards.append(v)
            rows.append(row(v))
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


def _check_key(k: Any) -> None:
    # Cached parts are compared with ==, under which 1 == True == 1.0: only str keys above a
    # sharded leaf keep that comparison exact (Megatron's state dicts have nothing else).
    if type(k) is not str:
        raise _NotPlain
