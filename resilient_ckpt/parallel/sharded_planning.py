"""First-save planning without gathering everyone's metadata: each rank plans some keys.

The gathered planner (``from_state_dict``'s one all-gather) sends every rank every rank's
shard records: W x S records received and checked per rank, 1.2 GB at 4,096 ranks x 1,000
shards. Integrity and the save distribution are both *per key* (a key's pieces tile its
global shape; a shard id is saved by one of its holders in each parallelization group), so
the keys can be partitioned: key k is planned by rank ``crc32(k) mod W`` (its *planner*).

1. one small all-gather carries local errors (every rank raises together, as before);
2. ``all_to_all``: each rank sends each planner the records of that planner's keys (tensor
   records tagged with the sender's parallelization group and rank in it, object records);
3. each planner checks its keys' integrity (the same per-key checks) and assigns each of its
   shard ids, per parallelization group, to one holder (Megatron-core's greedy order on its
   share, ranks relabelled by a rotation per planner so ties do not all land on the same rank);
4. ``all_to_all`` back: for every record a rank sent, whether it saves that shard;
5. problems, if any, are merged in the gathered planner's order (one all-reduce of the count,
   then a gather of at most 20 messages per planner), so the error is word for word the same;
6. bytes and fingerprints are all-gathered within the parallelization group only.

Per rank: ~S records out and ~S in, O(S) work — independent of W. Balance: each planner's
share is balanced by the greedy; shares add up, so a rank's load is within about (planners
that assigned it shards) x (their largest shard) of the mean, not Megatron's single greedy
bound: below :data:`SHARDED_PLANNING_MIN_WORLD` ranks the gathered planner runs.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch.distributed as dist

from ..model.mapping import ShardedObject, ShardedTensor, ShardId
from ..model.validation import object_record, raise_problems, shard_record, sharding_problems
from . import collectives
from .distribution import ShardDistribution, assign_shards, shard_nbytes, structure_fingerprint
from .exchange import ExchangePlan, Transfer

#: Scope sizes (ranks) from which ``from_state_dict`` plans sharded. Below it one all-gather
#: is cheap and gives Megatron-core's balance guarantee.
SHARDED_PLANNING_MIN_WORLD = 64

_MAX_REPORTED = 20


def use_sharded_planning(scope_size: int) -> bool:
    return scope_size >= SHARDED_PLANNING_MIN_WORLD


def planner_of(key: str, world: int) -> int:
    """The scope rank that plans ``key`` (stable across processes and runs)."""
    return zlib.crc32(key.encode("utf-8", "surrogatepass")) % world


def plan_sharded(
    shards: Sequence[ShardedTensor],
    objects: Sequence[ShardedObject],
    group: Optional[dist.ProcessGroup],
    scope: Optional[dist.ProcessGroup],
    local_error: Optional[BaseException] = None,
) -> ShardDistribution:
    """Validate the job's sharding and compute this rank's side of the save distribution
    (collective over ``scope``, every rank of the job; ``group`` the parallelization group).
    Raises on every rank together: a rank's ``local_error``, or the integrity error."""
    payload: Dict[str, Any] = {}
    try:
        if local_error is not None:
            raise local_error
        payload = _outgoing(shards, objects, group, scope)
    except Exception as e:  # reported to every rank below
        local_error = e
    collectives.gather_or_fail(None, local_error, "planning the first save", scope)
    world = collectives.group_size(scope)
    received = collectives.all_to_all_msgpack([payload.get(r, {}) for r in range(world)], scope)
    problems, answers = _plan(received, collectives.group_rank(scope), world)
    _raise_merged(problems, scope)
    back = collectives.all_to_all_msgpack(answers, scope)
    saver = _savers(shards, back, group, scope)
    n = collectives.group_size(group)
    me = collectives.group_rank(group)
    mine = sum(sh.nbytes for sh in shards if saver.get(sh.shard_id) == me)
    facts = [[mine, structure_fingerprint(shards)]]
    if n > 1:
        facts = collectives.all_gather_msgpack(facts[0], group)
    return ShardDistribution(
        group_size=n,
        main_rank_for_shard=saver,
        rank_bytes=tuple(int(f[0]) for f in facts),
        fingerprints=tuple(f[1] for f in facts),
    )


def _outgoing(shards, objects, group, scope) -> Dict[int, Dict[str, list]]:
    """Per planner: this rank's tensor records (+ group leader, rank and size in the
    parallelization group) and object records of the planner's keys."""
    world = collectives.group_size(scope)
    leader = collectives.global_rank(group, 0)
    tag = [leader, collectives.group_rank(group), collectives.group_size(group)]
    out: Dict[int, Dict[str, list]] = defaultdict(lambda: {"t": [], "o": []})
    for sh in shards:
        out[planner_of(sh.key, world)]["t"].append([*shard_record(sh), *tag])
    for o in objects:
        out[planner_of(o.key, world)]["o"].append(list(object_record(o)))
    return out


def _plan(received: List[Dict[str, list]], me: int, world: int) -> Tuple[List[tuple], List[List[int]]]:
    """A planner's work on what it received (pure): its keys' problems, and per sender one
    0/1 per tensor record it sent (1: that sender saves the shard)."""
    tensors = [[rec[:7] for rec in g.get("t", ())] for g in received]
    objects = [g.get("o", []) for g in received]
    problems = sharding_problems(tensors, objects)
    # Per parallelization group (its leader): holders (ranks in the group) of each shard id.
    holders: Dict[int, Dict[ShardId, List[int]]] = defaultdict(dict)
    sizes: Dict[int, Dict[ShardId, int]] = defaultdict(dict)
    has_main: Dict[int, set] = defaultdict(set)
    group_size: Dict[int, int] = {}
    for g in received:
        for key, off, extent, _gshape, dtype, main, _mm, leader, grank, gsize in g.get("t", ()):
            sid = (key, tuple(off))
            hs = holders[leader].setdefault(sid, [])
            if not hs or hs[-1] != grank:
                hs.append(grank)
            sizes[leader].setdefault(sid, shard_nbytes(extent, dtype))
            if main:
                has_main[leader].add(sid)
            group_size[leader] = gsize
    saver: Dict[Tuple[int, ShardId], int] = {}
    for leader, by_sid in holders.items():
        n = group_size[leader]
        shift = me % n  # this planner's rotation: its ties go to other ranks than its peers'
        relabelled = {sid: [(r - shift) % n for r in hs] for sid, hs in by_sid.items()}
        cross = by_sid.keys() - has_main[leader]
        for sid, r in assign_shards(relabelled, sizes[leader], n, cross_group=cross).items():
            saver[(leader, sid)] = (r + shift) % n
    answers = [
        [int(saver.get((rec[7], (rec[0], tuple(rec[1])))) == rec[8]) for rec in g.get("t", ())]
        for g in received
    ]
    return problems, answers


def _raise_merged(problems: List[tuple], scope) -> None:
    """Every rank raises the gathered planner's error (same words) if any planner found a
    problem: one all-reduce when all is well."""
    total = len(problems)
    if collectives.group_size(scope) > 1:
        total = collectives.all_reduce_int(total, "sum", scope)
    if not total:
        return
    mine = [list(p) for p in problems[:_MAX_REPORTED]]
    everyone = collectives.all_gather_msgpack(mine, scope) if collectives.group_size(scope) > 1 else [mine]
    merged = sorted((kind, key, i, msg) for part in everyone for i, (kind, key, msg) in enumerate(part))
    raise_problems([msg for _kind, _key, _i, msg in merged], total)


def _savers(shards, back: List[List[int]], group, scope) -> Dict[ShardId, int]:
    """This rank's shard ids -> the group rank that saves each (this rank where a planner said
    so; another holder otherwise, recorded as -1: all _drop_unsaved needs is "not me")."""
    world = collectives.group_size(scope)
    me = collectives.group_rank(group)
    pos: Dict[int, int] = defaultdict(int)
    saver: Dict[ShardId, int] = {}
    for sh in shards:
        p = planner_of(sh.key, world)
        i = pos[p]
        pos[p] += 1
        if back[p][i]:
            saver[sh.shard_id] = me
        else:
            saver.setdefault(sh.shard_id, -1)
    return saver


# ---- restore: the load exchange, planned by key ----------------------------------------------


def plan_exchange_sharded(
    need: Sequence[Tuple[str, Tuple[int, ...]]],
    held: Sequence[Tuple[str, Tuple[int, ...], str, Tuple[int, ...]]],
    group: Optional[dist.ProcessGroup],
) -> Tuple[ExchangePlan, Optional[Tuple[int, ShardId]]]:
    """This rank's part of the load exchange (collective over ``group``): the transfers it
    sends or receives, ordered alike on both ends of every pair (what the ``p2p`` exchange
    needs), planned by the keys' planners instead of from every rank's gathered lists.

    ``need``: shard ids this rank lacks, in its template's order; ``held``: ``(key, offset,
    dtype name, shape)`` it can serve. Returns the plan and, if some needed shard is held by
    nobody, the first such ``(group rank, shard id)`` in the gathered planner's order (every
    rank gets the same)."""
    n = collectives.group_size(group)
    out: List[Dict[str, list]] = [{"n": [], "h": []} for _ in range(n)]
    for i, (key, off) in enumerate(need):
        out[planner_of(key, n)]["n"].append([key, list(off), i])
    for key, off, dtype, shape in held:
        out[planner_of(key, n)]["h"].append([key, list(off), dtype, list(shape)])
    received = collectives.all_to_all_msgpack(out, group)
    per_rank, absent = _match(received, n)
    first_absent = _first_absent(absent, group)
    mine = collectives.all_to_all_msgpack(per_rank, group)
    transfers, specs = [], {}
    for part in mine:
        for key, off, src, dst, nbytes, dtype, shape in part:
            sid = (key, tuple(off))
            transfers.append(Transfer(sid, src, dst, nbytes))
            specs[sid] = (dtype, tuple(shape))
    transfers.sort(key=lambda t: (t.src, t.dst, t.shard_id))
    return ExchangePlan(tuple(transfers), specs), first_absent


def _match(received: List[Dict[str, list]], n: int) -> Tuple[List[List[list]], List[list]]:
    """A planner's work (pure): each needed shard of its keys from the holder with the fewest
    bytes sent so far (as ``plan_exchange``); every transfer goes to both its ends."""
    holders: Dict[ShardId, List[int]] = defaultdict(list)
    spec: Dict[ShardId, Tuple[str, list]] = {}
    for rank, g in enumerate(received):
        for key, off, dtype, shape in g["h"]:
            sid = (key, tuple(off))
            holders[sid].append(rank)
            spec.setdefault(sid, (dtype, shape))
    sent: Dict[int, int] = defaultdict(int)
    per_rank: List[List[list]] = [[] for _ in range(n)]
    absent: List[list] = []
    for dst, g in enumerate(received):
        for key, off, pos in g["n"]:
            sid = (key, tuple(off))
            hs = holders.get(sid)
            if not hs:
                absent.append([dst, pos, key, off])
                continue
            if dst in hs:
                continue
            src = min(hs, key=lambda r: (sent[r], r))
            dtype, shape = spec[sid]
            nbytes = shard_nbytes(shape, dtype)
            sent[src] += nbytes
            row = [key, off, src, dst, nbytes, dtype, shape]
            per_rank[src].append(row)
            per_rank[dst].append(row)
    return per_rank, absent


def _first_absent(absent: List[list], group) -> Optional[Tuple[int, ShardId]]:
    """The first needed-but-absent shard over all planners, by (rank, its position in that
    rank's needs): one all-reduce when there is none."""
    count = len(absent)
    if collectives.group_size(group) > 1:
        count = collectives.all_reduce_int(count, "sum", group)
    if not count:
        return None
    mine = min(absent) if absent else None
    everyone = collectives.all_gather_msgpack(mine, group) if collectives.group_size(group) > 1 else [mine]
    dst, _pos, key, off = min(a for a in everyone if a is not None)
    return dst, (key, tuple(off))
