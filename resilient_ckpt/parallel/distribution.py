"""Fully parallel save distribution: which rank of the group saves each shard id.

Every shard id held by any rank of the parallelization group is saved by exactly one rank
that holds it (replicas deduplicated), with bytes balanced across ranks. The assignment is a
pure, deterministic function of the gathered metadata, so all ranks compute the same answer
from one all-gather, and the result is cached for later saves of the same structure.

Algorithm: Megatron-core's greedy order (shards with no main replica in the group last, then
fewest holders first, then largest first, then id), assigning each shard to its least-loaded
holder, followed by an improvement pass that moves shards off the most loaded rank while that
strictly lowers it. Starting from the same greedy result and never raising the maximum, it is
never less balanced than Megatron's.
"""

from __future__ import annotations

import bisect
import hashlib
import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import AbstractSet, Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import msgpack
import torch
import torch.distributed as dist

from ..errors import ValidationError
from ..model.mapping import ShardedTensor, ShardId
from ..model.validation import object_record, shard_record
from . import collectives

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardDistribution:
    """The cached result of one metadata exchange (``cached_metadata`` for later saves)."""

    group_size: int
    #: saving rank (in the parallelization group) per shard id
    main_rank_for_shard: Mapping[ShardId, int]
    #: bytes each rank saves
    rank_bytes: Tuple[int, ...]
    #: per-rank digest of the local structure the distribution was computed for
    fingerprints: Tuple[str, ...] = field(default=())

    def saving_rank(self, shard_id: ShardId) -> int:
        return self.main_rank_for_shard[shard_id]

    @property
    def imbalance(self) -> float:
        """max/mean bytes per rank (1.0 is perfect)."""
        total = sum(self.rank_bytes)
        if not total:
            return 1.0
        return max(self.rank_bytes) / (total / len(self.rank_bytes))


def structure_fingerprint(shards: Sequence[ShardedTensor], objects: Sequence[Any] = ()) -> str:
    """Digest of every shard's record (what the distribution and the integrity check read:
    key, offset, extent, global shape, dtype, main replica or not, shape-mismatch flag) and,
    when given, every ShardedObject's record: equal iff a cached distribution (and, with
    ``objects``, the integrity check made with it) still applies."""
    return fingerprint_records(map(shard_record, shards), map(object_record, objects))


def fingerprint_records(shard_records: Iterable[tuple], object_records: Iterable[tuple] = ()) -> str:
    """:func:`structure_fingerprint` of records already made (tuples, as ``shard_record`` and
    ``object_record`` make them)."""
    # One msgpack call for all records (repr per record cost ~2 us each at 50k shards); a
    # record digests alike as a tuple or as the list a gather decodes it to.
    h = hashlib.blake2b(digest_size=16)
    h.update(msgpack.packb(list(shard_records), use_bin_type=True))
    objects = list(object_records)
    if objects:
        h.update(b"objects")
        h.update(msgpack.packb(objects, use_bin_type=True))
    return h.hexdigest()


def assign_shards(
    shard_to_ranks: Mapping[ShardId, Sequence[int]],
    shard_to_size: Mapping[ShardId, int],
    num_ranks: int,
    improve: bool = True,
    cross_group: AbstractSet[ShardId] = frozenset(),
) -> Dict[ShardId, int]:
    """Balanced assignment of each shard to one of the ranks holding it (pure function).

    ``cross_group``: shards whose main replica lives outside the group; Megatron assigns them
    last (so save and load distributions stay alike) and so do we, to start from its result.
    """
    load = [0] * num_ranks
    assignment: Dict[ShardId, int] = {}
    # A shard only one rank holds goes to that rank, and in the order below those come first
    # (unless cross-group): assigned here, without sorting them, the loads that the rest sees
    # are the same (sums do not depend on order). Optimizer state sharded over data parallel
    # is half of a 50k-tensor state dict.
    rest = []
    for sid, holders in shard_to_ranks.items():
        if len(holders) == 1 and sid not in cross_group:
            rank = holders[0]
            assignment[sid] = rank
            load[rank] += shard_to_size[sid]
        else:
            rest.append(sid)
    order = sorted(
        rest, key=lambda sid: (sid in cross_group, len(shard_to_ranks[sid]), -shard_to_size[sid], sid)
    )
    everyone = tuple(range(num_ranks))
    # Shards every rank holds (data-parallel replicas) are the common case: a lazy min-heap
    # over all ranks makes them O(log W) instead of O(W). Every load change pushes a fresh
    # entry; stale ones are popped (not refreshed, which kept them alive and made mixed
    # layouts quadratic: 20k shards took seconds).
    heap = sorted((load[r], r) for r in everyone)  # a valid heap
    for sid in order:
        holders = shard_to_ranks[sid]
        size = shard_to_size[sid]
        if len(holders) == num_ranks:
            while heap[0][0] != load[heap[0][1]]:
                heapq.heappop(heap)
            rank = heap[0][1]
        else:
            rank = min(holders, key=lambda r: (load[r], r))
        assignment[sid] = rank
        load[rank] += size
        if len(holders) == num_ranks:
            heapq.heapreplace(heap, (load[rank], rank))
        else:
            heapq.heappush(heap, (load[rank], rank))
    if improve and num_ranks > 1:
        _improve(assignment, shard_to_ranks, shard_to_size, load)
    return assignment


def _improve(assignment, shard_to_ranks, shard_to_size, load, max_moves: Optional[int] = None) -> None:
    """Move shards off the most loaded rank while that strictly lowers it.

    Each move takes, from the most loaded rank, the shard that leaves it and its least loaded
    co-holder closest to each other. Shards are grouped by holder set (few distinct sets in
    practice: the whole group, or a tensor-parallel slice of it) and sorted by size, so the
    best shard of a group is found by bisection: a move costs O(sets x (holders + log n)), not
    a scan of every shard on the rank (which made random layouts of 100k shards take minutes).
    At most ``max_moves`` (default: the shard count) moves keep the pass O(n log n) overall.
    """
    num_ranks = len(load)
    groups: Dict[int, Dict[Tuple[int, ...], List[Tuple[int, ShardId]]]] = {r: {} for r in range(num_ranks)}
    canonical: Dict[Tuple[int, ...], Tuple[int, ...]] = {}  # holders as given -> as a set
    for sid, r in assignment.items():
        holders = shard_to_ranks[sid]
        size = shard_to_size[sid]
        if size > 0 and len(holders) > 1:
            given = tuple(holders)
            key = canonical.get(given)
            if key is None:
                key = canonical[given] = tuple(sorted(set(given)))
            groups[r].setdefault(key, []).append((size, sid))
    for per_rank in groups.values():
        for entries in per_rank.values():
            entries.sort()
    if max_moves is None:
        max_moves = len(assignment)
    for _ in range(max_moves):
        top = max(range(num_ranks), key=lambda r: (load[r], -r))
        best = None
        for holders, entries in groups[top].items():
            if not entries:
                continue
            dst = min((r for r in holders if r != top), key=lambda r: (load[r], r))
            room = load[top] - load[dst]  # a move of size s helps iff 0 < s < room
            i = bisect.bisect_right(entries, room / 2, key=lambda e: e[0])
            for j in (i - 1, i):
                if 0 <= j < len(entries) and entries[j][0] < room:
                    size, sid = entries[j]
                    cand = (abs(room - 2 * size), -size, sid, j, holders, dst)
                    if best is None or cand < best:
                        best = cand
        if best is None:
            return
        _, neg_size, sid, j, holders, dst = best
        del groups[top][holders][j]
        bisect.insort(groups[dst].setdefault(holders, []), (-neg_size, sid))
        assignment[sid] = dst
        load[top] += neg_size
        load[dst] -= neg_size


def megatron_greedy(
    shard_to_ranks, shard_to_size, num_ranks, cross_group: AbstractSet[ShardId] = frozenset()
) -> Dict[ShardId, int]:
    """Megatron-core's greedy assignment, for comparisons (tests, docs)."""
    return assign_shards(shard_to_ranks, shard_to_size, num_ranks, False, cross_group)


def rank_loads(assignment: Mapping[ShardId, int], shard_to_size, num_ranks) -> Tuple[int, ...]:
    load = [0] * num_ranks
    for sid, r in assignment.items():
        load[r] += shard_to_size[sid]
    return tuple(load)


def compute_distribution(
    local_shards: Sequence[ShardedTensor],
    group: Optional[dist.ProcessGroup] = None,
    gathered: Optional[List[list]] = None,
) -> ShardDistribution:
    """Collective (one all-gather of compact metadata) unless ``gathered`` is given.

    ``gathered[r]`` is rank r's list of shard records (see :func:`validation.shard_record`),
    letting callers that validate integrity reuse the same exchange.
    """
    if gathered is None:
        gathered = gather_shard_records(local_shards, group)
    fingerprints = tuple(rec_fp for rec_fp in gathered_fingerprints(gathered))
    n = len(gathered)
    shard_to_ranks: Dict[ShardId, List[int]] = {}
    shard_to_size: Dict[ShardId, int] = {}
    has_main = set()
    for rank, recs in enumerate(gathered):
        for rec in recs["shards"]:
            key, off, extent, _gshape, dtype, main, _mm = rec
            sid = (key, tuple(off))
            holders = shard_to_ranks.get(sid)
            if holders is None:
                shard_to_ranks[sid] = [rank]
                shard_to_size[sid] = shard_nbytes(extent, dtype)
            elif holders[-1] != rank:
                holders.append(rank)
            if main:
                has_main.add(sid)
    cross_group = shard_to_ranks.keys() - has_main
    assignment = assign_shards(shard_to_ranks, shard_to_size, n, cross_group=cross_group)
    dist_ = ShardDistribution(
        group_size=n,
        main_rank_for_shard=assignment,
        rank_bytes=rank_loads(assignment, shard_to_size, n),
        fingerprints=fingerprints,
    )
    logger.debug("distribution: bytes per rank %s (max/mean %.4f)", dist_.rank_bytes, dist_.imbalance)
    return dist_


def shard_nbytes(extent: Sequence[int], dtype_name: str) -> int:
    """Bytes of a shard record's piece."""
    return math.prod(extent) * _itemsize(dtype_name)


def gather_shard_records(local_shards: Sequence[ShardedTensor], group) -> List[dict]:
    payload = {
        "shards": [list(shard_record(sh)) for sh in local_shards],
        "fp": structure_fingerprint(local_shards),
    }
    return collectives.all_gather_msgpack(payload, group)


def gathered_fingerprints(gathered: Iterable[dict]) -> Iterable[str]:
    for g in gathered:
        yield g["fp"]


def check_cached(
    distribution: ShardDistribution,
    local_shards: Sequence[ShardedTensor],
    rank: int,
    group_size: Optional[int] = None,
) -> None:
    """A cached distribution applies only to the structure (and group) it was computed for."""
    if not isinstance(distribution, ShardDistribution):
        raise ValidationError(
            f"cached_metadata must be the ShardDistribution returned by from_state_dict, got "
            f"{type(distribution).__name__}"
        )
    if group_size is not None and distribution.group_size != group_size:
        raise ValidationError(
            f"cached_metadata was computed for a parallelization group of "
            f"{distribution.group_size} ranks, this one has {group_size}; pass the same "
            "parallelization_group, or cached_metadata=None to recompute it"
        )
    if distribution.fingerprints and distribution.fingerprints[rank] != structure_fingerprint(local_shards):
        raise ValidationError(
            "cached_metadata was computed for a different sharded state dict structure (keys, "
            "offsets, shapes or dtypes changed); pass cached_metadata=None to recompute it"
        )


_ITEMSIZE: Dict[str, int] = {}


def _itemsize(dtype_name: str) -> int:
    size = _ITEMSIZE.get(dtype_name)
    if size is None:
        dt = getattr(torch, dtype_name, None)
        if not isinstance(dt, torch.dtype):
            raise ValidationError(f"unknown dtype {dtype_name!r} in shard metadata")
        size = _ITEMSIZE[dtype_name] = dt.itemsize
    return size
