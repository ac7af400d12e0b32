"""The first stage of a restore: what it will do, decided from gathered facts alone.

A restore is four stages (``manager/loading.py``: ``load_local``): **plan** (here: pure, from
the holdings every rank gathered and the persistent tier's agreed newest iteration), **agree**
(one collective verdict on the template before any byte is written), **move** (the bytes:
the node's own copy through ``memory/transfer``, peers' copies through the transport, lost
ranks rebuilt from parity first), **fill** (the template, through the load exchange). Every
input of :func:`plan_restore` is the same on every rank, so every rank takes the same kind of
restore: from memory at this world size, resharded from another world size's checkpoint
(``manager/elastic.py``, its own four stages), from the persistent tier, or none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Tuple

from .restore import Holdings

MEMORY = "memory"
RESHARDED = "resharded"
PERSISTENT = "persistent"
NONE = "none"


@dataclass(frozen=True)
class RestorePlan:
    """What a restore does (the same on every rank)."""

    kind: str  # MEMORY | RESHARDED | PERSISTENT | NONE
    holdings: Holdings
    #: complete iterations of this world size, newest first: a memory restore tries them in
    #: order (an older one only when every copy of a newer one fails verification)
    complete: Tuple[int, ...]
    #: RESHARDED: the other world size's iteration held whole (``manager.elastic.ElasticChoice``)
    elastic: Optional[object] = None
    #: PERSISTENT: the tier's newest complete iteration, newer than anything in memory
    durable: Optional[int] = None

    @property
    def newest_in_memory(self) -> int:
        return self.complete[0] if self.complete else -1


def plan_restore(
    holdings: Holdings, complete: Sequence[int], elastic: Optional[object], durable: Optional[int]
) -> RestorePlan:
    """The kind of restore, from gathered facts: another world size's checkpoint when it is
    the newest held whole (``elastic``, already compared with ``complete``), else the
    persistent tier's when it is newer than memory's, else memory's newest, else none."""
    complete = tuple(complete)
    if elastic is not None:
        return RestorePlan(RESHARDED, holdings, complete, elastic=elastic)
    newest = complete[0] if complete else -1
    if durable is not None and durable > newest:
        return RestorePlan(PERSISTENT, holdings, complete, durable=durable)
    return RestorePlan(MEMORY if complete else NONE, holdings, complete)
