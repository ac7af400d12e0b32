"""Parity groups: which ranks protect each other, how their bytes are striped, and what a
lost member is rebuilt from.

Pure functions of metadata (world size, ranks per node, k, m), like :mod:`.placement`: every
rank computes the same answer alone, and everything here is testable without processes.
Moving bytes is :mod:`.parity_peer`'s job, the arithmetic :mod:`.erasure`'s.

**Geometry** (RAID-5 for m = 1, RAID-6 style for m = 2). A group has ``n = k + m`` members,
one per node. Each member's saved bytes are cut into ``k`` blocks of ``B`` bytes (``B`` is the
same for the whole group: the largest member's bytes over ``k``, rounded up to 64; shorter
data counts as zero-padded). There are ``n`` stripes. Stripe ``s`` is made of one block of
each of the ``k`` *data members* and ``m`` parity blocks, held by the *parity holders*
``s, s+1, …, s+m-1 (mod n)`` — the holders rotate, so every member stores ``m`` parity blocks
(``m/k`` of its own bytes) and receives as much as it sends. A member is a data member of
exactly ``k`` stripes; its block ``b`` goes into the ``b``-th of them.

Share numbers within a stripe follow the erasure code's convention: ``0..k-1`` are the data
members' blocks in member order, ``k..k+m-1`` the parity blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, FrozenSet, Iterable, List, Mapping, Sequence, Set, Tuple

from ..errors import NoReplicaError, ReplicationError, ValidationError

#: block sizes are rounded up to this many bytes (vector width; int64 XOR needs 8)
BLOCK_ALIGN = 64
CODES = ("xor", "rs")


def code_for(m: int) -> str:
    """XOR for one parity share, Reed–Solomon over GF(2^8) (zfec) for more."""
    return "xor" if m == 1 else "rs"


@dataclass(frozen=True)
class Share:
    """One share of a stripe: ``number`` in the code's numbering, held by ``member`` (an
    index into the group), ``block`` its position in that member's data (data shares) or
    its parity index (parity shares)."""

    stripe: int
    number: int
    member: int
    parity: bool
    block: int


@dataclass(frozen=True)
class ParityGroup:
    """One group of ranks on distinct nodes protecting each other with ``m`` parity shares."""

    members: Tuple[int, ...]
    m: int
    _data: Tuple[Tuple[int, ...], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.members)
        if self.m < 1 or n < self.m + 1:
            raise ReplicationError(
                f"a parity group needs at least m+1 = {self.m + 1} members, got {list(self.members)}"
            )
        data = tuple(tuple(j for j in range(n) if (j - s) % n >= self.m) for s in range(n))
        object.__setattr__(self, "_data", data)

    @property
    def n(self) -> int:
        return len(self.members)

    @property
    def k(self) -> int:
        return self.n - self.m

    @property
    def code(self) -> str:
        return code_for(self.m)

    def index(self, rank: int) -> int:
        return self.members.index(rank)

    def holders(self, stripe: int) -> Tuple[int, ...]:
        """Member indices holding stripe ``stripe``'s parity shares, parity index order."""
        return tuple((stripe + i) % self.n for i in range(self.m))

    def data_members(self, stripe: int) -> Tuple[int, ...]:
        """Member indices whose blocks make up stripe ``stripe`` (share numbers 0..k-1)."""
        return self._data[stripe]

    def data_stripes(self, member: int) -> Tuple[int, ...]:
        """Stripes member ``member`` contributes data to; its block b goes to the b-th."""
        return tuple(s for s in range(self.n) if member in self._data[s])

    def parity_stripes(self, member: int) -> Tuple[Tuple[int, int], ...]:
        """(stripe, parity index) of the parity blocks member ``member`` holds, in stripe order
        (also the order they lie in its parity file)."""
        return tuple((s, (member - s) % self.n) for s in range(self.n) if (member - s) % self.n < self.m)

    def shares(self, stripe: int) -> Tuple[Share, ...]:
        out = [
            Share(stripe, i, j, False, self.data_stripes(j).index(stripe))
            for i, j in enumerate(self.data_members(stripe))
        ]
        out += [Share(stripe, self.k + i, h, True, i) for i, h in enumerate(self.holders(stripe))]
        return tuple(out)


def block_nbytes(member_nbytes: Sequence[int], k: int) -> int:
    """The group's block size: every member's data fits in k blocks."""
    largest = max(member_nbytes, default=0)
    per = -(-largest // k) if largest else 0
    return -(-per // BLOCK_ALIGN) * BLOCK_ALIGN


def check_parameters(k: object, m: object) -> None:
    """``parity_group`` (k) and ``parity_shares`` (m) as a user may pass them."""
    for name, v in (("parity_group", k), ("parity_shares", m)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValidationError(f"{name} must be a positive integer, got {v!r}")
    if m > 2:
        raise ValidationError(f"parity_shares={m} is not supported; use 1 (XOR) or 2 (Reed-Solomon)")


def parity_groups(world_size: int, ranks_per_node: int, k: int, m: int = 1) -> Tuple[ParityGroup, ...]:
    """Groups of ``k+m`` ranks, each on a different node, covering every rank once.

    Ranks with the same local index on consecutive nodes form a group (a partial last node
    simply lacks some local indices). What is left over of one local index (fewer than
    ``k+m`` ranks) becomes a smaller group (``k' = left - m``; with m = 1 and two ranks that
    is a mirror); fewer than ``m+1`` left over borrow ranks from the previous group, or join
    it when it has none to spare (a larger k, the same losses tolerated). Raises
    when the job has fewer than ``m+1`` nodes (no group could survive a loss)."""
    check_parameters(k, m)
    rpn = max(1, ranks_per_node)
    nodes = -(-world_size // rpn)
    if nodes < k + m:
        raise ReplicationError(
            f"parity_group={k} with parity_shares={m} needs {k + m} nodes (one member per node), "
            f"this job has {nodes} ({world_size} ranks, {rpn} per node); use parity_group <= "
            f"{max(nodes - m, 0)}" + (" or more nodes" if nodes - m < 1 else "")
        )
    n = k + m
    groups: List[Tuple[int, ...]] = []
    for local in range(rpn):
        column = [node * rpn + local for node in range(nodes) if node * rpn + local < world_size]
        if not column:
            continue
        chunks = [column[i : i + n] for i in range(0, len(column), n)]
        if len(chunks) > 1 and len(chunks[-1]) < m + 1:
            short = m + 1 - len(chunks[-1])
            if len(chunks[-2]) - short >= m + 1:
                chunks[-1] = chunks[-2][-short:] + chunks[-1]
                chunks[-2] = chunks[-2][:-short]
            else:  # too few to lend: one larger group (same losses tolerated, larger k)
                chunks[-2:] = [chunks[-2] + chunks[-1]]
        if len(chunks[-1]) < m + 1:
            raise ReplicationError(
                f"ranks {chunks[-1]} (local index {local}) cannot form a parity group of at least "
                f"{m + 1} nodes; give every node the same number of ranks or lower parity_shares"
            )
        groups.extend(tuple(c) for c in chunks)
    return tuple(ParityGroup(g, m) for g in sorted(groups))


def group_of(groups: Sequence[ParityGroup], rank: int) -> ParityGroup:
    for g in groups:
        if rank in g.members:
            return g
    raise ReplicationError(f"rank {rank} is in no parity group")


@dataclass(frozen=True)
class Rebuild:
    """What rebuilding lost member ``member`` of ``group`` takes: per stripe it contributed
    to, the ``k`` shares read (share numbers and their holders)."""

    group: ParityGroup
    member: int
    stripes: Tuple[Tuple[int, Tuple[Share, ...]], ...]

    @property
    def rank(self) -> int:
        return self.group.members[self.member]


class Unrecoverable(NoReplicaError):
    """More of a group is gone than its parity tolerates."""


def plan_rebuild(
    group: ParityGroup,
    has_data: Mapping[int, bool],
    has_parity: Mapping[int, bool],
    bad: Iterable[Tuple[int, int]] = (),
) -> List[Rebuild]:
    """How to rebuild every member of ``group`` whose data is gone (``has_data[i]`` false,
    by member index), from the shares still held (``has_parity[i]``: member i's parity file
    is intact) minus ``bad`` ((stripe, share number) that failed verification). Data shares
    are preferred (no decoding work for them), then parity in order. Raises
    :class:`Unrecoverable` naming the members and stripes when a stripe has fewer than k."""
    bad_set = set(bad)
    lost = [i for i in range(group.n) if not has_data.get(i, False)]
    out = []
    short: Dict[int, List[int]] = {}
    for i in lost:
        stripes = []
        for s in group.data_stripes(i):
            usable = [
                sh
                for sh in group.shares(s)
                if (s, sh.number) not in bad_set
                and (has_parity.get(sh.member, False) if sh.parity else has_data.get(sh.member, False))
            ]
            if len(usable) < group.k:
                short.setdefault(i, []).append(s)
                continue
            stripes.append((s, tuple(usable[: group.k])))
        out.append(Rebuild(group, i, tuple(stripes)))
    if short:
        ranks = sorted(group.members[i] for i in lost)
        raise Unrecoverable(
            f"parity group {list(group.members)} (k={group.k}, m={group.m}) lost the data of ranks "
            f"{ranks}, more than its {group.m} parity share(s) per stripe can rebuild"
            + (f" ({len(bad_set)} share(s) failed verification)" if bad_set else "")
        )
    return out


def recoverable_owners(
    groups: Iterable[ParityGroup],
    held: Set[int],
    parity_held: Set[int],
    bad: Iterable[Tuple[int, int, int]] = (),
) -> FrozenSet[int]:
    """Owner ranks whose data is not held but can be rebuilt (``held``: owners whose data is
    held; ``parity_held``: ranks whose parity file is held; ``bad``: (group's first member,
    stripe, share number) that failed verification)."""
    out: Set[int] = set()
    bad_list = list(bad)
    for g in groups:
        if all(r in held for r in g.members):
            continue
        try:
            plan_rebuild(
                g,
                {i: r in held for i, r in enumerate(g.members)},
                {i: r in parity_held for i, r in enumerate(g.members)},
                [(s, n) for first, s, n in bad_list if first == g.members[0]],
            )
        except Unrecoverable:
            continue
        out.update(r for r in g.members if r not in held)
    return frozenset(out)
