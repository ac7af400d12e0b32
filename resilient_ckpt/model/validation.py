"""Sharding integrity and strict-key handling.

Integrity: for every key, the main replicas of its shards tile the global shape exactly (no
overlap, no gap), each shard id has exactly one main replica, and every rank agrees on dtype and
global shape. Strictness: Megatron-core's ``StrictHandling`` flags, except that unexpected keys are
really dropped (or raised on every rank together), never left to assert or hang.
"""

from __future__ import annotations

import math
from collections import defaultdict
from enum import Enum
from typing import Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

from ..errors import ValidationError, strictness_error
from .mapping import dtype_name, is_main_replica

# A compact, msgpack-able description of one local shard, gathered from every rank:
# (key, global_offset, local_extent_per_global_axis, global_shape, dtype_name, is_main,
#  allow_shape_mismatch)
ShardRecord = Tuple[str, Tuple[int, ...], Tuple[int, ...], Tuple[int, ...], str, bool, bool]
ObjectRecord = Tuple[str, Tuple[int, ...], Tuple[int, ...], bool]

_MAX_REPORTED = 20


class StrictHandling(Enum):
    """How to treat keys that differ between the requested state dict and the checkpoint.

    Megatron-core vocabulary: *unexpected* keys are requested but absent from the checkpoint;
    *missing* keys are in the checkpoint but not requested.
    """

    ASSUME_OK_UNEXPECTED = "assume_ok_unexpected"
    LOG_UNEXPECTED = "log_unexpected"
    LOG_ALL = "log_all"
    RAISE_UNEXPECTED = "raise_unexpected"
    RAISE_ALL = "raise_all"
    RETURN_UNEXPECTED = "return_unexpected"
    RETURN_ALL = "return_all"
    IGNORE_ALL = "ignore_all"

    @staticmethod
    def requires_explicit_ckpt_mismatch_check(val: "StrictHandling") -> bool:
        return val != StrictHandling.ASSUME_OK_UNEXPECTED

    @staticmethod
    def requires_global_app_metadata(val: "StrictHandling") -> bool:
        return val in (
            StrictHandling.IGNORE_ALL,
            StrictHandling.RAISE_ALL,
            StrictHandling.RETURN_ALL,
            StrictHandling.LOG_ALL,
        )

    @staticmethod
    def requires_returning_mismatch_keys(val: "StrictHandling") -> bool:
        return val in (StrictHandling.RETURN_UNEXPECTED, StrictHandling.RETURN_ALL)


def parse_strict_flag(strict: Union[str, StrictHandling, object]) -> StrictHandling:
    if isinstance(strict, StrictHandling):
        return strict
    # Megatron-core's own enum members are accepted by value.
    value = getattr(strict, "value", strict)
    try:
        return StrictHandling(value)
    except ValueError:
        valid = ", ".join(m.value for m in StrictHandling)
        raise ValidationError(f"invalid strict flag {strict!r}; use one of: {valid}") from None


def shard_record(sh) -> ShardRecord:
    p = sh.prepend_axis_num
    extent = (1,) * p + tuple(sh.local_shape) if p else tuple(sh.local_shape)
    return (
        sh.key,
        tuple(sh.global_offset),
        extent,
        tuple(sh.global_shape),
        dtype_name(sh.dtype),
        sh.is_main_replica(),
        bool(sh.allow_shape_mismatch),
    )


def row_record(row: tuple) -> ShardRecord:
    """:func:`shard_record` of the ShardedTensor a shard-table row describes
    (``shard_table.shard_row``: key, dtype name, local shape, global shape, global offset,
    fragmentation, replica id, prepended axes, shape-mismatch flag)."""
    key, dtype, local, glob, off, _frag, replica, prepend, mismatch = row
    extent = (1,) * prepend + tuple(local) if prepend else tuple(local)
    return (key, tuple(off), extent, tuple(glob), dtype, is_main_replica(replica), bool(mismatch))


def object_record(obj) -> ObjectRecord:
    return (obj.key, tuple(obj.global_offset), tuple(obj.global_shape), obj.is_main_replica())


def validate_sharding_integrity(
    global_shards: Sequence[Iterable[ShardRecord]],
    global_objects: Sequence[Iterable[ObjectRecord]] = (),
) -> None:
    """Raise :class:`ValidationError` listing every inconsistent key (first 20).

    ``global_shards[r]`` are rank r's shard records (see :func:`shard_record`).
    """
    raise_problems([p for _kind, _key, p in sharding_problems(global_shards, global_objects)])


def sharding_problems(
    global_shards: Sequence[Iterable[ShardRecord]],
    global_objects: Sequence[Iterable[ObjectRecord]] = (),
) -> List[Tuple[int, str, str]]:
    """Every integrity problem as ``(kind, key, message)`` in report order: tensor keys
    (kind 0) sorted, then object keys (kind 1) sorted. Keys are independent of each other, so
    any partition of the keys can be checked apart and the problems merged in this order."""
    problems: List[Tuple[int, str, str]] = []
    by_key: Dict[str, List[Tuple[int, ShardRecord]]] = defaultdict(list)
    for rank, recs in enumerate(global_shards):
        for rec in recs:
            by_key[rec[0]].append((rank, rec))
    # Keys in any order (sorting 50k keys cost more than checking most of them); only the
    # keys with problems are sorted, for the report.
    bad = [key for key, entries in by_key.items() if not _tiles_along_one_axis(entries)]
    for key in sorted(bad):
        # No early exit: the message counts the problems it does not show.
        for p in _check_tensor_key(key, [(rank, _tuplify(rec)) for rank, rec in by_key[key]]):
            problems.append((0, key, p))
    obj_by_key: Dict[str, List[Tuple[int, ObjectRecord]]] = defaultdict(list)
    for rank, recs in enumerate(global_objects):
        for rec in recs:
            obj_by_key[rec[0]].append((rank, _tuplify(rec)))
    for key in sorted(obj_by_key):
        for p in _check_object_key(key, obj_by_key[key]):
            problems.append((1, key, p))
    return problems


def raise_problems(problems: Sequence[str], total: Optional[int] = None) -> None:
    """The integrity error for ``problems`` (the first 20 shown; ``total``: how many there
    are when only some were passed), or nothing."""
    total = len(problems) if total is None else total
    if not total:
        return
    shown = list(problems[:_MAX_REPORTED])
    more = f"\n  ... and {total - len(shown)} more" if total > len(shown) else ""
    raise ValidationError(
        "sharded state dict is inconsistent across ranks:\n  "
        + "\n  ".join(shown)
        + more
        + "\nfix: every key's main replicas (replica_id 0) must tile its global shape once; "
        "check the rank offsets / replica ids your model's sharded_state_dict() produces"
    )


def _whole_once(entries) -> bool:
    """The commonest key, in a few comparisons: one piece covering the whole global shape
    (offset zero), the same on every rank that holds it (a replicated parameter), exactly one
    main replica: :func:`_tiles_along_one_axis`'s first try (a quarter of the check's time at
    50k keys, against its general pieces-and-axis walk)."""
    first = entries[0][1]
    off, extent, shape, dtype = first[1], first[2], first[3], first[4]
    if first[6] or any(off) or list(extent) != list(shape):
        return False
    mains = 0
    for _rank, rec in entries:
        if rec[1] != off or rec[2] != extent or rec[3] != shape or rec[4] != dtype or rec[6]:
            return False
        if rec[5]:
            mains += 1
    return mains == 1


def _tiles_along_one_axis(entries) -> bool:
    """The common keys, checked in a few comparisons: pieces that split the global shape
    along one axis only (or not at all), back to back from offset zero to the end, each piece
    the same on every rank that holds it with exactly one main replica, one dtype and global
    shape everywhere (an unsharded or tensor-parallel tensor, possibly replicated over data
    parallel). False means only "not this case": :func:`_check_tensor_key` then decides
    (and words any problem). (Plain loops: generator expressions cost more than the checks at
    25k sharded keys.)"""
    if _whole_once(entries):
        return True
    first = entries[0][1]
    shape = tuple(first[3])
    pieces = None if first[6] else _pieces(entries, shape, first[4])  # mismatch: general rules
    if pieces is None:
        return False
    if not shape:  # a scalar: one piece
        return len(pieces) == 1
    axis = _split_axis(pieces, len(shape))
    if axis is None:
        return False
    pos = 0
    for off in sorted(pieces):
        ext = pieces[off][0]
        if off[axis] != pos:
            return False
        for a, (e, g) in enumerate(zip(ext, shape)):
            if a != axis and e != g:
                return False
        pos += ext[axis]
    return pos == shape[axis]


def _pieces(entries, shape: tuple, dtype: str) -> Optional[Dict[tuple, list]]:
    """offset -> [extent, main replicas] of a key's records, or None if the records disagree
    on dtype, global shape or a piece's extent, or a piece has not exactly one main."""
    pieces: Dict[tuple, list] = {}
    for _rank, rec in entries:
        if rec[4] != dtype or rec[6] or tuple(rec[3]) != shape:
            return None
        off = tuple(rec[1])
        piece = pieces.get(off)
        if piece is None:
            pieces[off] = piece = [tuple(rec[2]), 0]
        elif piece[0] != tuple(rec[2]):
            return None
        if rec[5]:
            piece[1] += 1
    for off, (ext, mains) in pieces.items():
        if mains != 1 or len(off) != len(shape) or len(ext) != len(shape):
            return None
    return pieces


def _split_axis(pieces: Dict[tuple, list], ndim: int) -> Optional[int]:
    """The one axis the pieces' offsets vary along (0 if none does); None if several do."""
    axis = -1
    for off in pieces:
        for a in range(ndim):
            if off[a]:
                if axis < 0:
                    axis = a
                elif axis != a:
                    return None
    return max(axis, 0)


def _tuplify(rec):
    # msgpack turns tuples into lists; compare as tuples.
    return tuple(tuple(x) if isinstance(x, list) else x for x in rec)


def _check_tensor_key(key: str, entries: List[Tuple[int, ShardRecord]]) -> List[str]:
    out: List[str] = []
    dtypes = {rec[4] for _, rec in entries}
    if len(dtypes) > 1:
        out.append(f"{key!r}: ranks disagree on dtype: {sorted(dtypes)}")
    shapes = {rec[3] for _, rec in entries}
    mismatch_ok = any(rec[6] for _, rec in entries)
    if len(shapes) > 1 and not mismatch_ok:
        out.append(f"{key!r}: ranks disagree on global shape: {sorted(shapes)}")
        return out
    global_shape = max(shapes)
    mains: Dict[Tuple[int, ...], List[int]] = defaultdict(list)
    extents: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
    all_ids: Dict[Tuple[int, ...], Tuple[int, ...]] = {}
    for rank, rec in entries:
        off, ext = rec[1], rec[2]
        prev = all_ids.setdefault(off, ext)
        if prev != ext:
            out.append(f"{key!r}: shard at offset {off} has extent {ext} on rank {rank} but {prev} elsewhere")
        if rec[5]:
            mains[off].append(rank)
            extents[off] = ext
    for off in all_ids:
        if off not in mains:
            out.append(f"{key!r}: shard at offset {off} has no main replica (replica_id 0) on any rank")
    for off, ranks in mains.items():
        if len(ranks) > 1:
            out.append(
                f"{key!r}: shard at offset {off} has {len(ranks)} main replicas (ranks {sorted(ranks)[:8]})"
            )
    if mismatch_ok:
        return out
    outside = [
        off
        for off, ext in extents.items()
        if len(off) != len(global_shape) or any(o < 0 or o + e > s for o, e, s in zip(off, ext, global_shape))
    ]
    if outside:
        # Checked here too: ShardedTensors are mutable and ranks' metadata arrives as plain data.
        out.append(
            f"{key!r}: shard at offset {outside[0]} with extent {extents[outside[0]]} lies outside "
            f"global shape {global_shape}"
        )
        return out
    boxes = [(off, tuple(o + e for o, e in zip(off, extents[off]))) for off in mains]
    overlap = find_overlap(boxes)
    if overlap is not None:
        a, b = overlap
        out.append(f"{key!r}: shards {fmt_box(a)} and {fmt_box(b)} overlap")
    covered = sum(math.prod(e) for e in extents.values())
    total = math.prod(global_shape)
    if overlap is None and covered != total:
        out.append(
            f"{key!r}: main replicas cover {covered} of {total} elements of global shape {global_shape} (gap)"
        )
    return out


def fmt_box(box) -> str:
    start, stop = box
    return "[" + ", ".join(f"{a}:{b}" for a, b in zip(start, stop)) + ")"


def find_overlap(boxes):
    """An overlapping pair among axis-aligned ``(start, stop)`` boxes, or None.

    Sweep along the axis with the most distinct starts (a tensor sharded only along axis 1
    would make an axis-0 sweep quadratic in its shard count).
    """
    if not boxes:
        return None
    ndim = len(boxes[0][0])
    ax = max(range(ndim), key=lambda a: len({b[0][a] for b in boxes})) if ndim else 0
    perm = ([ax] if ndim else []) + [a for a in range(ndim) if a != ax]
    order = sorted(range(len(boxes)), key=lambda i: [boxes[i][0][a] for a in perm])
    active: List = []
    for i in order:
        box = boxes[i]
        start, stop = box
        active = [b for b in active if b[1][ax] > start[ax]] if ndim else active
        for other in active:
            if all(max(s1, s2) < min(e1, e2) for s1, e1, s2, e2 in zip(other[0], other[1], start, stop)):
                # Empty boxes never overlap anything.
                return other, box
        if all(e > s for s, e in zip(start, stop)):
            active.append(box)
    return None


def _check_object_key(key: str, entries: List[Tuple[int, ObjectRecord]]) -> List[str]:
    out: List[str] = []
    mains: Dict[Tuple[int, ...], List[int]] = defaultdict(list)
    shapes = {rec[2] for _, rec in entries}
    if len(shapes) > 1:
        out.append(f"{key!r} (object): ranks disagree on global shape: {sorted(shapes)}")
        return out
    for rank, rec in entries:
        if rec[3]:
            mains[rec[1]].append(rank)
    for off, ranks in mains.items():
        if len(ranks) > 1:
            out.append(
                f"{key!r} (object): offset {off} has {len(ranks)} main replicas (ranks {sorted(ranks)[:8]})"
            )
    (shape,) = shapes
    outside = [
        off
        for off in mains
        if len(off) != len(shape) or any(o < 0 or (s >= 0 and o >= s) for o, s in zip(off, shape))
    ]
    if outside:
        out.append(f"{key!r} (object): offset {outside[0]} lies outside the grid {shape}")
        return out
    if all(s >= 0 for s in shape) and len(mains) != math.prod(shape):
        out.append(f"{key!r} (object): {len(mains)} main replicas for a grid of {math.prod(shape)} objects")
    return out


def determine_mismatch(requested: Set[str], in_checkpoint: Set[str]) -> Tuple[Set[str], Set[str]]:
    """(missing, unexpected): missing = in checkpoint but not requested; unexpected = requested
    but absent from the checkpoint (Megatron-core's definitions)."""
    return in_checkpoint - requested, requested - in_checkpoint


def apply_strictness(strict: StrictHandling, missing: Set[str], unexpected: Set[str], log) -> None:
    """Log or raise per ``strict``. Must be called with the same sets on every rank."""

    def names(keys: Set[str]) -> str:
        ks = sorted(keys)
        return ", ".join(ks[:_MAX_REPORTED]) + (
            f" (+{len(ks) - _MAX_REPORTED} more)" if len(ks) > _MAX_REPORTED else ""
        )

    # Megatron-core's words ("Missing keys", "Unexpected keys"), which its users grep for,
    # with what they mean spelled out.
    missing_text = f"Missing keys (in the checkpoint, not requested by the state dict): {names(missing)}"
    unexpected_text = (
        f"Unexpected keys (requested by the state dict, not in the checkpoint): {names(unexpected)}"
    )
    raise_unexpected = bool(unexpected) and strict in (
        StrictHandling.RAISE_UNEXPECTED,
        StrictHandling.RAISE_ALL,
        StrictHandling.ASSUME_OK_UNEXPECTED,
    )
    raise_missing = bool(missing) and strict == StrictHandling.RAISE_ALL
    if raise_unexpected or raise_missing:
        parts = [missing_text] if raise_missing else []
        fixes = [
            "add the missing keys to the state dict, or pass strict='log_all' to ignore them"
        ] * raise_missing
        if raise_unexpected:
            parts.append(unexpected_text)
            fixes.append("remove the unexpected keys, or pass strict='log_unexpected' to skip them")
        raise strictness_error(". ".join(parts) + ". Fix: " + "; ".join(fixes))
    if strict in (StrictHandling.LOG_UNEXPECTED, StrictHandling.LOG_ALL) and unexpected:
        log.warning("%s (skipped)", unexpected_text)
    if strict == StrictHandling.LOG_ALL and missing:
        log.warning("%s (left out of the result)", missing_text)
