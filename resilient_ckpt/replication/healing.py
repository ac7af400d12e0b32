"""Healing: after a restore, put back every copy the placement asks for that no store holds.

A node that was lost and replaced comes back with an empty store: its ranks were restored
from replicas, but until the next save completes the job would survive no further loss — a
second failure then loses progress. Healing closes that window: from facts every rank
gathered during the restore (which node store holds which owner's checkpoint), a pure plan
lists the missing copies — each owner's own node, then each replica holder's node — and one
rank of a node that holds the copy sends it; the receiver lands it in its node's store and
publishes the header after the last byte, exactly as replication does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Sequence, Set, Tuple

from .placement import Placement


@dataclass(frozen=True)
class Repair:
    """``source`` (its node store holds ``owner``'s checkpoint) sends it to ``dest`` (whose
    node store must hold it: the owner itself, or a replica holder)."""

    owner: int
    source: int
    dest: int


@dataclass(frozen=True)
class RepairPlan:
    repairs: Tuple[Repair, ...]
    #: owners with a missing copy that no store can provide (nothing to copy from)
    unrepairable: Tuple[int, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.repairs)


def plan_repairs(
    held: Sequence[Set[int]],
    node_of: Callable[[int], int],
    placement: Placement,
    nbytes: Mapping[int, int],
) -> RepairPlan:
    """The copies to re-create for one iteration.

    ``held[r]``: owners whose checkpoint rank ``r``'s node store holds (ranks sharing a store
    list the same set); ``node_of``: rank -> node store index; ``nbytes[owner]``: checkpoint
    size (balances senders). Every required (node, owner) pair — the owner's node and each
    holder's node of the placement — that no store of that node holds gets one repair, sent
    by the rank holding it with the fewest bytes to send so far (then lowest rank), so the
    work spreads over every surviving copy. Pure and deterministic: every rank computes the
    same plan.
    """
    world = len(held)
    on_node: Dict[int, Set[int]] = {}
    for r in range(world):
        on_node.setdefault(node_of(r), set()).update(held[r])
    load: Dict[int, int] = {}
    repairs: List[Repair] = []
    unrepairable: List[int] = []
    for owner in range(world):
        sources = [r for r in range(world) if owner in held[r]]
        for dest in (owner, *placement.holders_of(owner)):
            node = node_of(dest)
            if owner in on_node.setdefault(node, set()):
                continue
            if not sources:
                unrepairable.append(owner)
                break
            src = min(sources, key=lambda r: (load.get(r, 0), r))
            load[src] = load.get(src, 0) + int(nbytes.get(owner, 0))
            repairs.append(Repair(owner, src, dest))
            on_node[node].add(owner)  # one copy per node, whichever of its ranks receives it
    return RepairPlan(tuple(repairs), tuple(sorted(set(unrepairable))))
