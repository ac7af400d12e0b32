"""A sharded state dict taken apart for saving or as a load template.

:func:`preprocess` splits a sharded state dict into its sharded, common and nonpersistent
parts and its factories (copying the structure, never the tensors); :func:`prepare_template`
does it once per restore (:class:`PreparedTemplate`: checked, targeted and filled from the
same walk); :func:`shard_targets` names the template tensors restored bytes can be written
into in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from ..errors import ValidationError
from ..model.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    apply_factories_and_adapt,
    is_factory,
    is_sharded,
)
from ..model.nested import map_leaves, map_leaves_inplace, nested_values, split
from .snapshot import from_parts, shallow_copy, snapshot_parts


def preprocess(sharded_state_dict: Any) -> Tuple[Any, Any, Any, Any]:
    """Copy the structure (never the tensors), build factories, adapt Megatron objects.

    Returns (sharded_part, common_part, nonpersistent_part, factories).
    """
    if not isinstance(sharded_state_dict, (dict, list)):
        raise ValidationError(
            f"a sharded state dict must be a dict (or list), got {type(sharded_state_dict).__name__}"
        )
    # Structural copy. Not split(x, lambda v: True): that leaves empty containers on the
    # non-matching side, so an empty list in the state dict was silently not saved.
    x = map_leaves(lambda v: v, sharded_state_dict)
    factories, _ = split(x, is_factory)
    factories = map_leaves(lambda f: f, factories)
    apply_factories_and_adapt(x)
    # Shallow copies: dropping data (fully parallel) or popping tensors must not reach into the
    # caller's ShardedTensors, which a trainer may pass again to the next save.
    map_leaves_inplace(lambda v: shallow_copy(v) if is_sharded(v) else v, x)
    nonpersistent, x = split(x, lambda v: isinstance(v, LocalNonpersistentObject))
    map_leaves_inplace(lambda o: o.unwrap(), nonpersistent)
    sharded, common = split(x, is_sharded)
    return sharded, common, nonpersistent, factories


def sharded_tensors(tree: Any) -> List[ShardedTensor]:
    return [v for v in nested_values(tree) if isinstance(v, ShardedTensor)]


def sharded_objects(tree: Any) -> List[ShardedObject]:
    return [v for v in nested_values(tree) if isinstance(v, ShardedObject)]


def sharded_leaves(tree: Any) -> Tuple[List[ShardedTensor], List[ShardedObject]]:
    """:func:`sharded_tensors` and :func:`sharded_objects` of ``tree`` in one walk."""
    shards: List[ShardedTensor] = []
    objects: List[ShardedObject] = []
    for v in nested_values(tree):
        if isinstance(v, ShardedTensor):
            shards.append(v)
        elif isinstance(v, ShardedObject):
            objects.append(v)
    return shards, objects


@dataclass
class PreparedTemplate:
    """A load template taken apart once (``preprocess`` and its leaves): a restore checks it,
    lists its target tensors and fills it, and accepts this wherever it takes a template, so
    a 50k-shard template is walked once, not once per step. The fill writes into
    ``sharded``: prepare again for another load."""

    sharded: Any
    common: Any
    nonpersistent: Any
    factories: Any
    shards: List[ShardedTensor]
    objects: List[ShardedObject]
    #: the tree's skeleton and shard rows (see ``to_bytes``), when known from its one walk
    structure: Optional[Tuple[Any, List[tuple]]] = None
    _targets: Optional["ShardTargets"] = field(default=None, repr=False, compare=False)

    def targets(self) -> "ShardTargets":
        """:func:`shard_targets` of its shards, found once (the retrieval and the fill ask)."""
        if self._targets is None:
            self._targets = shard_targets(self.shards)
        return self._targets


def prepare_template(template: Any) -> PreparedTemplate:
    if isinstance(template, PreparedTemplate):
        return template
    parts = snapshot_parts(template) if template else None
    if parts is not None:
        # A plain template in one walk: what preprocess would give (no factories, nothing
        # nonpersistent), plus its skeleton and rows for the same-structure check.
        sharded, common, shards, objects = from_parts(parts)
        empty = {} if isinstance(template, dict) else []
        return PreparedTemplate(
            sharded, common, empty, type(empty)(), shards, objects, (parts.skeleton, parts.rows)
        )
    sharded, common, nonpersistent, factories = preprocess(template or {})
    return PreparedTemplate(sharded, common, nonpersistent, factories, *sharded_leaves(sharded))


class ShardTargets(Dict[Any, torch.Tensor]):
    """Shard id -> the template tensor restored bytes may land in (materialized, of the
    shard's dtype and local shape; the first shard of an id wins), and for each what a stored
    tensor must match to be read straight into it: its dtype and shape, when it is
    contiguous on the CPU or a GPU. Every fact is read from the tensor once, here: a restore
    asks about 50,000 shards at several stages, and each torch attribute costs ~0.5 us."""

    def __init__(self) -> None:
        super().__init__()
        self._direct: Dict[Any, Tuple[torch.dtype, Tuple[int, ...]]] = {}
        self.on_cuda = False  # any target is on a GPU

    def direct(self, sid: Any, dtype: torch.dtype, shape: Tuple[int, ...]) -> Optional[torch.Tensor]:
        """The target of ``sid`` if a stored tensor of ``dtype`` and ``shape`` can be copied
        into it as it is; else None."""
        kind = self._direct.get(sid)
        if kind is not None and kind[0] == dtype and kind[1] == shape:
            return self[sid]
        return None


def shard_targets(template_shards: Sequence[ShardedTensor]) -> ShardTargets:
    """Template tensors received shards may land in directly (materialized, the shard's dtype
    and shape)."""
    targets = ShardTargets()
    direct = targets._direct
    for st in template_shards:
        d = st.data
        if d is None:
            continue
        sid = st.shard_id
        if sid in targets:
            continue
        shape = tuple(d.shape)
        dtype = d.dtype
        if shape != st.local_shape or dtype != st.dtype:
            continue
        # is_cpu / is_cuda: Tensor.device builds an object per call (3x slower)
        cpu = d.is_cpu
        cuda = not cpu and d.is_cuda
        if not (cpu or cuda) and d.is_meta:
            continue
        targets[sid] = d
        if cuda:
            targets.on_cuda = True
        if (cpu or cuda) and d.is_contiguous():
            direct[sid] = (dtype, shape)
    return targets
