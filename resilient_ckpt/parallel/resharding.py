"""Resharding: which bytes of which saved shards fill each shard of a template laid out for
another world size or parallel layout.

Every ShardedTensor names the box of its global tensor it holds (``global_offset`` plus its
extent; prepended axes have extent 1). A template shard is filled from the intersections of
its box with the saved shards' boxes of the same key — whatever fragmentation either side
has (data-parallel resize, tensor-parallel degree change, FSDP2 chunks of another mesh).

Pure functions of gathered metadata: every rank computes the same plan, so senders and
receivers agree on every piece and its order without another message, and every rank finds
the same errors.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from ..model.mapping import ShardedTensor

Box = Tuple[Tuple[int, int], ...]  # per axis [lo, hi) in global coordinates


def box_of(st: ShardedTensor) -> Box:
    extent = (1,) * st.prepend_axis_num + tuple(st.local_shape)
    return tuple((o, o + e) for o, e in zip(st.global_offset, extent))


def volume(box: Box) -> int:
    return math.prod(hi - lo for lo, hi in box)


def intersect(a: Box, b: Box) -> Optional[Box]:
    out = tuple((max(alo, blo), min(ahi, bhi)) for (alo, ahi), (blo, bhi) in zip(a, b))
    return out if all(lo < hi for lo, hi in out) or not out else None


def local_slices(box: Box, within: Box, prepend: int) -> Tuple[slice, ...]:
    """Index of ``box`` inside the tensor holding ``within`` (its prepended axes dropped)."""
    return tuple(slice(lo - wlo, hi - wlo) for (lo, hi), (wlo, _) in list(zip(box, within))[prepend:])


@dataclass(frozen=True)
class SavedShard:
    """One saved ShardedTensor: ``owner``'s ``index``-th stored tensor."""

    owner: int
    index: int
    key: str
    dtype: str
    global_shape: Tuple[int, ...]
    box: Box
    prepend: int
    nbytes: int


@dataclass(frozen=True)
class WantedShard:
    """Template shard ``slot`` of rank ``rank``."""

    rank: int
    slot: int
    key: str
    dtype: str
    global_shape: Tuple[int, ...]
    box: Box


@dataclass(frozen=True)
class Piece:
    """The part ``box`` of a saved shard that rank ``src`` sends to rank ``dst``'s template
    shard ``slot`` (``src == dst``: read from its own node's store)."""

    dst: int
    slot: int
    src: int
    owner: int
    index: int
    box: Box
    nbytes: int


def plan_reshard(
    wanted: Sequence[WantedShard],
    saved: Sequence[SavedShard],
    holders: Mapping[int, Sequence[int]],
    same_store: Callable[[int, int], bool],
    itemsize: Callable[[str], int],
) -> Tuple[List[Piece], List[str]]:
    """The pieces that fill every wanted shard, and the errors (same on every rank).

    ``holders``: owner -> ranks whose node store holds its data. A piece is read by its
    receiver when the receiver's store holds the owner, else sent by the holder with the
    fewest bytes assigned so far (several sources per receiver, spread by load)."""
    by_key: Dict[str, List[SavedShard]] = {}
    for s in saved:
        by_key.setdefault(s.key, []).append(s)
    load: Dict[int, int] = {}
    pieces: List[Piece] = []
    errors: List[str] = []
    for w in wanted:
        candidates = by_key.get(w.key)
        if not candidates:
            errors.append(f"rank {w.rank}: key {w.key!r} is not in the checkpoint")
            continue
        first = candidates[0]
        if first.dtype != w.dtype or first.global_shape != w.global_shape:
            errors.append(
                f"rank {w.rank}: key {w.key!r} was saved as {first.dtype} of global shape "
                f"{list(first.global_shape)}, the template asks for {w.dtype} of {list(w.global_shape)}"
            )
            continue
        covered = 0
        for s in candidates:
            part = intersect(w.box, s.box)
            if part is None:
                continue
            n = volume(part) * itemsize(s.dtype)
            src = _source(w.rank, holders.get(s.owner, ()), same_store, load)
            if src is None:
                errors.append(
                    f"rank {w.rank}: key {w.key!r}: the data of saved rank {s.owner} is held by no survivor"
                )
                covered = -1
                break
            load[src] = load.get(src, 0) + (0 if src == w.rank else n)
            pieces.append(Piece(w.rank, w.slot, src, s.owner, s.index, part, n))
            covered += volume(part)
        if covered == -1:
            continue
        need = volume(w.box)
        if covered != need:
            what = "covers only" if covered < need else "overlaps itself in"
            ranges = ", ".join(f"{lo}:{hi}" for lo, hi in w.box)
            errors.append(
                f"rank {w.rank}: key {w.key!r} range [{ranges}]: the checkpoint {what} {covered} of "
                f"its {need} elements"
            )
    errors += _unclaimed(wanted, by_key)
    return pieces, errors


#: beyond this many grid cells per key the coverage of the new layout is not checked
MAX_COVERAGE_CELLS = 1 << 16


def _unclaimed(wanted: Sequence[WantedShard], by_key: Mapping[str, List[SavedShard]]) -> List[str]:
    """Saved ranges no rank of the new layout asks for: the restore would drop them."""
    asked: Dict[str, List[Box]] = {}
    for w in wanted:
        asked.setdefault(w.key, []).append(w.box)
    out = []
    for key in sorted(asked):
        saved = [s.box for s in by_key.get(key, ())]
        boxes = list({*asked[key]})
        if not saved or not saved[0]:
            continue
        cuts = [sorted({c for b in saved + boxes for c in b[axis]}) for axis in range(len(saved[0]))]
        if math.prod(len(c) - 1 for c in cuts) > MAX_COVERAGE_CELLS:
            continue
        for cell in itertools.product(*[list(zip(c, c[1:])) for c in cuts]):
            if any(_inside(cell, b) for b in saved) and not any(_inside(cell, b) for b in boxes):
                ranges = ", ".join(f"{lo}:{hi}" for lo, hi in cell)
                out.append(
                    f"key {key!r}: no rank of the new layout asks for range [{ranges}] of it (it would be dropped)"
                )
                break
    return out


def _inside(cell: Box, box: Box) -> bool:
    return all(lo <= clo and chi <= hi for (clo, chi), (lo, hi) in zip(cell, box))


def _source(dst: int, holders: Sequence[int], same_store, load: Dict[int, int]) -> Optional[int]:
    if not holders:
        return None
    if any(same_store(h, dst) for h in holders):
        return dst
    return min(holders, key=lambda h: (load.get(h, 0), h))
