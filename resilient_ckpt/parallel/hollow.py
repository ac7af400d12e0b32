"""The hollow state dict's bytes: a sharded tree without its tensors (format 2).

The tree is stored as a *skeleton* whose ShardedTensor leaves are their index in a shard table
(:mod:`..model.shard_table`, packed in C) and whose ShardedObject leaves are ``-1 - j`` for
the j-th of its objects (a sharded tree holds no other ints), beside the common state, the
saved mask and the device bookkeeping, all through the msgpack codec.
:class:`~.tensor_aware_state_dict.MCoreTensorAwareStateDict` encodes (``to_bytes``) and
decodes (``from_bytes``) with these; a cached save passes the skeleton and table it encoded
before (:func:`encode_hollow`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, List, Sequence, Tuple

from ..gc_pause import paused_gc
from ..model import codec, shard_table
from ..model.mapping import ShardedObject, ShardedTensor
from ..model.nested import map_leaves

#: ``to_bytes`` format with the sharded tree split into skeleton + shard table (1: whole tree).
HOLLOW_FORMAT = 2


@dataclass
class HollowEncoding:
    """A hollow state dict's bytes (``meta``) and the parts they were made from."""

    meta: bytes
    skeleton: Any
    rows: List[tuple]
    skeleton_bytes: bytes
    table_bytes: bytes


def hollow_parts(sharded: Any) -> Tuple[Any, List[tuple], List[ShardedObject]]:
    """The sharded tree as ``(skeleton, shard table rows, objects)`` (see ``to_bytes``)."""
    rows: List[tuple] = []
    objects: List[ShardedObject] = []

    def strip(v):
        if isinstance(v, ShardedTensor):
            rows.append(shard_table.shard_row(v))
            return len(rows) - 1
        if isinstance(v, ShardedObject):
            objects.append(v)
            return -len(objects)
        return v

    return map_leaves(strip, sharded), rows, objects


def encode_hollow(common, skeleton: bytes, table: bytes, objects, saved, devices, allow_pickle) -> bytes:
    """The hollow bytes from their parts; a cached save passes the skeleton and table it
    encoded before, so only the common state and the objects are encoded again."""
    return codec.encode(
        {
            "format": HOLLOW_FORMAT,
            "common": common,
            "skeleton": skeleton,
            "shards": table,
            "objects": list(objects),
            "saved": bytes(saved),
            "devices": list(devices),
        },
        allow_pickle=allow_pickle,
    )


def tree_from_skeleton(skeleton: Any, shards: Sequence[ShardedTensor], objects: Sequence[ShardedObject]):
    """The sharded tree a skeleton stands for (ints are ShardedTensor ``i`` or, negative,
    ShardedObject ``-1 - i``; see ``to_bytes``), built out of place."""
    with paused_gc():
        return map_leaves(
            lambda v: (shards[v] if v >= 0 else objects[-1 - v]) if type(v) is int else v, skeleton
        )
