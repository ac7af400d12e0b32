"""Who keeps replicas of whom, and where a restarting rank fetches its checkpoint from.

Pure functions of metadata (world size, ranks per node, replication factor, jump): every rank
computes the same answer without talking to anyone, and everything here is testable without
processes. Moving bytes is :mod:`.transport`'s job.

Two placements:

* **ring** (default): rank ``r``'s data goes to ``r+J, r+2J, …`` (mod ``W``), ``J`` = the jump
  (default: ranks per node). Works for any world size, including a partial last node. A copy
  never lands on the source's node and no two copies of one rank share a node; a candidate
  that breaks this (or whose holder is already full) is skipped in favour of the next one.

  Load bound (replicas held per rank), guaranteed and tested: every rank holds at most
  ``F-1`` replicas — the minimum possible, since ``W·(F-1)`` replicas are spread over ``W``
  ranks. The single exception is forced by the node constraint: with exactly ``F`` nodes and
  a partial last node of ``s`` ranks, every rank must send a copy to every other node, so the
  last node receives ``W-s`` copies and each of its ranks holds at most ``ceil((W-s)/s)``
  (again the minimum possible); full nodes' ranks still hold at most ``F-1``. With ``W``
  divisible by the node size and ``J`` = ranks per node the result is exactly the plain ring
  ``r+kJ`` and every rank holds exactly ``F-1``.

* **clique**: nvidia-resiliency-ext's grouping (``parse_group_sequence``) for parity: groups
  ``{n, n+J, …, n+(F-1)J}``; every member holds every other member's data. Needs ``W``
  divisible by ``J·F``.
"""

from __future__ import annotations

import logging
import math
import os
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Collection, Dict, Iterator, List, Mapping, Optional, Tuple

from ..errors import NoReplicaError, ReplicationError

logger = logging.getLogger(__name__)

RING = "ring"
CLIQUE = "clique"
KINDS = (RING, CLIQUE)


def _positive_int(name: str, value: object, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ReplicationError(f"{name} must be a positive integer, got {value!r}; {fix}")
    return value


@dataclass(frozen=True)
class Placement:
    """Replica placement for one job: a frozen, hashable value every rank computes alike.

    ``holders_of(r)`` lists the ``F-1`` ranks that keep a replica of rank ``r``'s data, in
    preference order; ``sources_for(h)`` is the inverse. Ranks on one node share a store (and
    fail together), so placement constraints are per node: ``node_of(r) = r // ranks_per_node``.
    """

    world_size: int
    replication_factor: int
    jump: int
    ranks_per_node: int
    kind: str = RING
    #: clique only: a group member on the owner's node is dropped from its holders (the node's
    #: store holds the owner's data already) instead of refusing the placement — what
    #: nvidia-resiliency-ext's jump 1 on one host amounts to (LocalCheckpointManager).
    skip_same_node: bool = False
    _holders: Tuple[Tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    _sources: Tuple[Tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _positive_int("world_size", self.world_size, "pass the number of trainer ranks")
        _positive_int(
            "replication_factor",
            self.replication_factor,
            "use 1 for no replicas, 2 for one copy on another node, …",
        )
        _positive_int("jump", self.jump, "use the number of ranks per node (the default)")
        _positive_int("ranks_per_node", self.ranks_per_node, "use LOCAL_WORLD_SIZE (ranks on one host)")
        if self.kind not in KINDS:
            raise ReplicationError(f"unknown placement kind {self.kind!r}; use one of {', '.join(KINDS)}")
        if self.kind == RING:
            holders = _ring(self.world_size, self.replication_factor, self.jump, self.ranks_per_node)
        else:
            holders = _clique(
                self.world_size, self.replication_factor, self.jump, self.ranks_per_node, self.skip_same_node
            )
        sources: List[List[int]] = [[] for _ in range(self.world_size)]
        for src, hs in enumerate(holders):
            for h in hs:
                sources[h].append(src)
        object.__setattr__(self, "_holders", tuple(tuple(h) for h in holders))
        object.__setattr__(self, "_sources", tuple(tuple(s) for s in sources))

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def _check_rank(self, rank: int) -> int:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < self.world_size:
            raise ReplicationError(
                f"rank {rank!r} is outside this placement's world of {self.world_size} ranks; "
                f"pass a rank in 0..{self.world_size - 1}"
            )
        return rank

    def holders_of(self, rank: int) -> Tuple[int, ...]:
        """Ranks (≠ ``rank``, all on other nodes) keeping a replica of ``rank``'s data."""
        return self._holders[self._check_rank(rank)]

    def sources_for(self, rank: int) -> Tuple[int, ...]:
        """Ranks whose replicas ``rank`` keeps, ascending."""
        return self._sources[self._check_rank(rank)]

    def node_of(self, rank: int) -> int:
        return self._check_rank(rank) // self.ranks_per_node

    def ranks_on_node(self, node: int) -> range:
        return range(node * self.ranks_per_node, min((node + 1) * self.ranks_per_node, self.world_size))

    @property
    def max_replicas_held(self) -> int:
        """Most replicas any one rank keeps (sizes a store's memory budget)."""
        return max((len(s) for s in self._sources), default=0)


def _default_ranks_per_node() -> int:
    raw = os.environ.get("LOCAL_WORLD_SIZE")
    if raw is None:
        return 1
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ReplicationError(
            f"LOCAL_WORLD_SIZE={raw!r} is not a positive integer; launch with torchrun (which "
            f"sets it to the ranks per node) or pass ranks_per_node explicitly"
        )
    return value


def ring_placement(
    world_size: int,
    replication_factor: int = 2,
    jump: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
) -> Placement:
    """Ring placement. ``ranks_per_node`` defaults to ``LOCAL_WORLD_SIZE`` (else 1) and
    ``jump`` to ``ranks_per_node``."""
    rpn = _default_ranks_per_node() if ranks_per_node is None else ranks_per_node
    return Placement(world_size, replication_factor, rpn if jump is None else jump, rpn, RING)


def clique_placement(
    world_size: int,
    replication_factor: int = 2,
    jump: Optional[int] = None,
    ranks_per_node: Optional[int] = None,
    skip_same_node: bool = False,
) -> Placement:
    """nvidia-resiliency-ext's clique groups ``{n, n+J, …}``; needs ``W % (J·F) == 0``."""
    rpn = _default_ranks_per_node() if ranks_per_node is None else ranks_per_node
    return Placement(
        world_size, replication_factor, rpn if jump is None else jump, rpn, CLIQUE, skip_same_node
    )


def placement_from_env(
    world_size: int, replication_factor: int, jump: Optional[int] = None, kind: str = RING
) -> Placement:
    """Placement with ranks per node (and the default jump) taken from ``LOCAL_WORLD_SIZE``."""
    if "LOCAL_WORLD_SIZE" not in os.environ and replication_factor > 1:
        # Without it every rank counts as its own node, so "another node" may be the same host.
        logger.warning(
            "LOCAL_WORLD_SIZE is not set: treating every rank as its own node, so replicas may "
            "share a host with their source; launch with torchrun or set LOCAL_WORLD_SIZE"
        )
    rpn = _default_ranks_per_node()
    if kind not in KINDS:
        raise ReplicationError(f"unknown placement kind {kind!r}; use one of {', '.join(KINDS)}")
    return Placement(world_size, replication_factor, rpn if jump is None else jump, rpn, kind)


# --------------------------------------------------------------------------------------------
# ring


def _too_few_nodes(world_size: int, ranks_per_node: int, factor: int) -> ReplicationError:
    nodes = -(-world_size // ranks_per_node)
    return ReplicationError(
        f"replication factor {factor} needs at least {factor} nodes (each copy on a different "
        f"node), but world size {world_size} with {ranks_per_node} ranks per node spans only "
        f"{nodes} node(s); lower replication_factor to at most {nodes}, run on more nodes, or "
        f"check ranks_per_node / LOCAL_WORLD_SIZE"
    )


def _candidates(rank: int, world_size: int, jump: int) -> Iterator[int]:
    """``rank+J, rank+2J, …`` (mod W); when J shares a factor with W that orbit misses ranks,
    so continue with the orbits of ``rank+1``, ``rank+2``, … — every rank appears once."""
    g = math.gcd(jump, world_size)
    period = world_size // g
    for t in range(g):
        for k in range(1, period + 1):
            yield (rank + t + k * jump) % world_size


def _rank_caps(world_size: int, rpn: int, factor: int) -> List[int]:
    """Replicas each node's ranks may hold: F-1, or the forced minimum when nodes == F."""
    nodes = -(-world_size // rpn)
    caps = []
    for node in range(nodes):
        size = min(rpn, world_size - node * rpn)
        if nodes == factor:  # every source must use every other node: forced, and minimal
            caps.append(max(factor - 1, -(-(world_size - size) // size)))
        else:
            caps.append(factor - 1)
    return caps


def _ring(world_size: int, factor: int, jump: int, rpn: int) -> List[List[int]]:
    copies = factor - 1
    if copies == 0:
        return [[] for _ in range(world_size)]
    nodes = -(-world_size // rpn)
    if nodes < factor:
        raise _too_few_nodes(world_size, rpn, factor)

    def node_of(r: int) -> int:
        return r // rpn

    def node_size(m: int) -> int:
        return min(rpn, world_size - m * rpn)

    rank_cap = _rank_caps(world_size, rpn, factor)
    node_cap = [rank_cap[m] * node_size(m) for m in range(nodes)]

    # Stage 1, node level: a b-matching of sources (F-1 distinct foreign nodes each) to nodes
    # (capacity node_cap). Greedy along each source's jump order, then augmenting paths when the
    # greedy gets stuck — hand-rolled because it is a few lines on a small graph and no flow
    # library is a dependency. Augmenting paths make it exact, so the caps above (which are
    # feasible) are always met.
    assigned: List[List[int]] = [[] for _ in range(world_size)]  # nodes per source, in order
    entry: Dict[Tuple[int, int], int] = {}  # (source, node) -> preferred rank on that node
    held_by_node: List[List[int]] = [[] for _ in range(nodes)]
    node_load = [0] * nodes

    for r in range(world_size):
        used = {node_of(r)}
        for c in _candidates(r, world_size, jump):
            m = node_of(c)
            if m in used:
                continue
            used.add(m)
            if node_load[m] < node_cap[m]:
                assigned[r].append(m)
                entry[(r, m)] = c
                held_by_node[m].append(r)
                node_load[m] += 1
                if len(assigned[r]) == copies:
                    break
        while len(assigned[r]) < copies:
            _augment(r, assigned, held_by_node, node_load, node_cap, node_of, nodes)

    # Stage 2, rank level: on each chosen node take the jump-order rank if it has room, else
    # the next rank of that node (cyclically). The node totals fit the caps, so one always has.
    rank_load = [0] * world_size
    holders: List[List[int]] = [[] for _ in range(world_size)]
    for r in range(world_size):
        for m in assigned[r]:
            size = node_size(m)
            first = entry.get((r, m), m * rpn + (r % rpn) % size)
            base = m * rpn
            for i in range(size):
                h = base + (first - base + i) % size
                if rank_load[h] < rank_cap[m]:
                    break
            else:  # unreachable: node_load[m] <= rank_cap[m] * size
                raise AssertionError(f"node {m} over capacity")
            holders[r].append(h)
            rank_load[h] += 1
    return holders


def _augment(
    r: int,
    assigned: List[List[int]],
    held_by_node: List[List[int]],
    node_load: List[int],
    node_cap: List[int],
    node_of: Callable[[int], int],
    nodes: int,
) -> None:
    """Give source ``r`` one more node by shifting other sources along a chain of full nodes."""
    blocked = set(assigned[r]) | {node_of(r)}
    parent: Dict[int, Optional[Tuple[int, int]]] = {m: None for m in range(nodes) if m not in blocked}
    queue = deque(parent)
    # Nodes not reached yet, ascending (deterministic). Almost any source can move to almost any
    # node, so the first scan empties this list and the search stays about O(nodes).
    unvisited = [m for m in range(nodes) if m in blocked]
    while queue:
        m = queue.popleft()
        for other in held_by_node[m]:
            own = set(assigned[other]) | {node_of(other)}
            still: List[int] = []
            for m2 in unvisited:
                if m2 in own:
                    still.append(m2)
                    continue
                parent[m2] = (m, other)
                if node_load[m2] < node_cap[m2]:
                    # Walk back: each mover shifts from prev to cur; the start node goes to r.
                    node_load[m2] += 1
                    cur = m2
                    while parent[cur] is not None:
                        prev, mover = parent[cur]  # type: ignore[misc]
                        assigned[mover][assigned[mover].index(prev)] = cur
                        held_by_node[prev].remove(mover)
                        held_by_node[cur].append(mover)
                        cur = prev
                    assigned[r].append(cur)
                    held_by_node[cur].append(r)
                    return
                queue.append(m2)
            unvisited = still
    raise ReplicationError(  # only if the caps were infeasible: a bug, not a user error
        f"internal error: no node can take another replica of rank {r} "
        f"(node loads {node_load}, capacities {node_cap}); please report this"
    )


# --------------------------------------------------------------------------------------------
# clique


def clique_groups(world_size: int, factor: int, jump: int) -> List[Tuple[int, ...]]:
    """The groups of nvidia-resiliency-ext's ``parse_group_sequence``, sorted."""
    if world_size % (jump * factor):
        raise ReplicationError(
            f"clique placement needs world size divisible by jump × replication factor, but "
            f"{world_size} is not divisible by {jump} × {factor} = {jump * factor}; use "
            f"kind='ring' (any world size) or change the jump / replication factor"
        )
    groups: List[Tuple[int, ...]] = []
    for start in range(jump):
        column = list(range(start, world_size, jump))
        groups.extend(tuple(column[i : i + factor]) for i in range(0, len(column), factor))
    return sorted(groups)


def _clique(
    world_size: int, factor: int, jump: int, rpn: int, skip_same_node: bool = False
) -> List[List[int]]:
    holders: List[List[int]] = [[] for _ in range(world_size)]
    for group in clique_groups(world_size, factor, jump):
        nodes = [r // rpn for r in group]
        if skip_same_node:
            for r in group:
                holders[r] = [h for h in _clique_order(group, r) if h // rpn != r // rpn]
            continue
        if len(set(nodes)) != len(nodes):
            raise ReplicationError(
                f"clique placement with jump {jump} puts ranks {list(group)} (nodes {nodes}) in "
                f"one replica group, so copies would share a node with ranks_per_node={rpn}; "
                f"use a jump that is a multiple of ranks_per_node ({rpn})"
            )
        for r in group:
            holders[r] = _clique_order(group, r)
    return holders


def _clique_order(group: Tuple[int, ...], r: int) -> List[int]:
    """Preference order of ``r``'s holders: the members after r, wrapping around."""
    i = group.index(r)
    return [group[(i + k) % len(group)] for k in range(1, len(group))]


# --------------------------------------------------------------------------------------------
# retrieval planning


@dataclass(frozen=True)
class Fetch:
    """``receiver`` needs ``owner``'s checkpoint and gets it from ``source``."""

    receiver: int
    owner: int
    source: int

    @property
    def is_local(self) -> bool:
        return self.receiver == self.source


def plan_retrieval(
    wanted: Mapping[int, int],
    available: Mapping[int, Collection[int]],
    node_of: Callable[[int], int],
    nbytes: Optional[Mapping[int, int]] = None,
    exclude: Collection[Tuple[int, int]] = (),
) -> Tuple[Fetch, ...]:
    """Choose, for each ``receiver → owner`` in ``wanted``, the rank that serves the bytes.

    ``available[owner]``: ranks able to serve ``owner``'s data. Preference: the receiver itself;
    else a rank on the receiver's node (fewest bytes already served locally, then lowest rank);
    else the remote rank with the fewest bytes already assigned over the network (then lowest
    rank). ``exclude`` holds ``(source, owner)`` pairs known to be bad (failed checksum).
    Requests are placed largest first (``nbytes[owner]``, default 1), which keeps the greedy's
    usual bound: each source's remote bytes minus its smallest assignment never exceed any
    alternative source's total. Deterministic: every rank computes the same plan. Returns the
    fetches sorted by receiver. Raises :class:`NoReplicaError` for an owner nobody can serve.
    """
    bad = {(int(s), int(o)) for s, o in exclude}
    size = (lambda o: 1) if nbytes is None else (lambda o: int(nbytes.get(o, 0)))
    remote_load: Dict[int, int] = {}
    local_load: Dict[int, int] = {}
    order = sorted(wanted.items(), key=lambda ro: (-size(ro[1]), ro[0]))
    chosen: List[Fetch] = []
    missing: List[str] = []
    for receiver, owner in order:
        asked = sorted(set(available.get(owner, ())))
        usable = [s for s in asked if (s, owner) not in bad]
        if not usable:
            where = ", ".join(f"rank {s} (node {node_of(s)})" for s in asked) or "none"
            rejected = sorted(s for s in asked if (s, owner) in bad)
            missing.append(
                f"owner {owner} (wanted by rank {receiver}): holders {where}"
                + (f"; rejected as corrupt: ranks {rejected}" if rejected else "")
            )
            continue
        n = size(owner)
        if receiver in usable:
            source = receiver
        else:
            here = node_of(receiver)
            local = [s for s in usable if node_of(s) == here]
            if local:
                source = min(local, key=lambda s: (local_load.get(s, 0), s))
                local_load[source] = local_load.get(source, 0) + n
            else:
                source = min(usable, key=lambda s: (remote_load.get(s, 0), s))
                remote_load[source] = remote_load.get(source, 0) + n
        chosen.append(Fetch(receiver, owner, source))
    if missing:
        raise NoReplicaError(
            "no live, intact replica for " + "; ".join(missing) + ". The checkpoint iteration "
            "is not restorable from memory: fall back to an older iteration or the persistent "
            "tier, or bring the nodes holding these replicas back"
        )
    return tuple(sorted(chosen, key=lambda f: f.receiver))
