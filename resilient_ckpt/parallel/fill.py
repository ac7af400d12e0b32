"""The fill of a load template: where the exchange writes a received shard
(:func:`allocator`: the template's own tensor when it fits) and the template's sharded part
with every leaf replaced by its restored data (:func:`fill_template`), keys no checkpoint has
dropped.
"""

from __future__ import annotations

from typing import Any, Dict

import torch

from ..bits import copy_bits
from ..model.mapping import ShardedObject, ShardedTensor, apply_factory_merges
from ..model.nested import map_leaves_inplace
from ..timing import COPY, phase
from .hollow import tree_from_skeleton
from .load_checks import LoadRequest


def allocator(targets: Dict[Any, torch.Tensor], device: torch.device):
    """Where the exchange writes a received shard: its template tensor when dtype and shape
    match (no new pages), else a fresh tensor on the load device."""

    def allocate(sid, dtype, shape):
        t = targets.get(sid)
        if t is not None and t.dtype == dtype and tuple(t.shape) == tuple(shape):
            return t
        return torch.empty(shape, dtype=dtype, device=device)

    return allocate


def fill_template(req: LoadRequest, loaded, targets, objects, unexpected) -> Any:
    """The template's sharded part with every leaf replaced by its data (in the template's
    own tensor where possible); keys this rank requested but no checkpoint has are dropped.
    A template known by its skeleton (``req.skeleton``: prepared in one walk) is filled row by
    row and its tree built once from the skeleton, instead of walking the tree for leaves."""
    with phase(COPY):  # on a GPU: the H2D copies queued
        if req.skeleton is not None and not unexpected:
            shards = [_filled_shard(st, loaded, targets) for st in req.template_shards]
            objs = [_filled_object(o, req, objects) for o in req.template_objects]
            return apply_factory_merges(tree_from_skeleton(req.skeleton, shards, objs), req.factories)

        def fill(v):
            if isinstance(v, ShardedTensor):
                return _DROP if v.key in unexpected else _filled_shard(v, loaded, targets)
            if isinstance(v, ShardedObject):
                return _DROP if v.key in unexpected else _filled_object(v, req, objects)
            return v

        sharded = req.sharded
        map_leaves_inplace(fill, sharded)
    return apply_factory_merges(_drop_marked(sharded), req.factories)


def _filled_shard(st: ShardedTensor, loaded, targets) -> torch.Tensor:
    sid = st.shard_id
    t = loaded[sid]
    dst = targets.get(sid)
    if dst is not None and dst is not t and dst.dtype == t.dtype and dst.shape == t.shape:
        copy_bits(dst, t)
        return dst
    return t


def _filled_object(o: ShardedObject, req: LoadRequest, objects) -> Any:
    held = req.held_objects.get(o.object_id)
    return held.data if held is not None else objects[o.object_id]


class _Drop:
    def __repr__(self):
        return "DROP"


_DROP = _Drop()


def _drop_marked(x):
    if isinstance(x, dict):
        return {k: _drop_marked(v) for k, v in x.items() if v is not _DROP}
    if isinstance(x, list):
        return [None if v is _DROP else _drop_marked(v) for v in x]
    return x
