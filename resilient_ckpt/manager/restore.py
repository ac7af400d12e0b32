"""The load path: find the newest complete iteration, plan retrieval, move and verify bytes.

Collective over the checkpoint group. Every decision (latest iteration, which holder serves
whom, which copies failed verification) is made from all-gathered facts, so all ranks reach
the same verdict and fail together — never some ranks loading while others raise.
"""

from __future__ import annotations

import functools
import logging
import os
import socket
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ..errors import (
    CheckpointingException,
    CorruptCheckpointError,
    ForeignCheckpointError,
    StoreError,
)
from ..memory import checksum
from ..memory.layout import CheckpointHeader, CheckpointId, failed_tensors
from ..memory.store import CheckpointStore
from ..memory.transfer import Moved, Pending, Read, start_checks, start_reads
from ..parallel import collectives
from ..parallel.template import ShardTargets
from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
from ..replication.parity import ParityGroup, recoverable_owners
from ..replication.placement import Fetch, plan_retrieval
from ..replication.transport import Incoming, Outgoing, P2PTransport
from ..timing import PEERS, phase

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 4


@dataclass(frozen=True)
class Holdings:
    """What every rank's node store holds, as all-gathered facts."""

    #: per rank: store identity (ranks with equal identity share one node store)
    store_keys: Tuple[str, ...]
    #: per rank: {(iteration, owner): data_nbytes}
    ids: Tuple[Mapping[Tuple[int, int], int], ...]
    #: per rank: human-readable notes about checkpoints that cannot be used here
    foreign: Tuple[Tuple[str, ...], ...]
    #: per rank: {(iteration, holder): block size} of the parity files its node store holds
    parity: Tuple[Mapping[Tuple[int, int], int], ...] = ()
    #: per rank: {(iteration, owner): world size} of this session's checkpoints saved by a job
    #: of another world size (restorable resharded, ``manager.elastic``)
    other_worlds: Tuple[Mapping[Tuple[int, int], int], ...] = ()
    #: per rank: the ``note`` it passed to :func:`gather_holdings` (None: none)
    notes: Tuple[Any, ...] = ()

    def node_of(self, rank: int) -> int:
        return self._node_index[self.store_keys[rank]]

    @functools.cached_property  # planning calls node_of O(world) times: build the index once
    def _node_index(self) -> Dict[str, int]:
        idx: Dict[str, int] = {}
        for k in self.store_keys:
            idx.setdefault(k, len(idx))
        return idx

    def owners_held(self) -> Dict[int, Set[int]]:
        """Per iteration: the owner ranks whose data some store holds."""
        owners: Dict[int, Set[int]] = {}
        for per_rank in self.ids:
            for it, owner in per_rank:
                owners.setdefault(it, set()).add(owner)
        return owners

    def complete_iterations(self, world_size: int, groups: Sequence[ParityGroup] = ()) -> List[int]:
        """Iterations for which every owner rank's data is held somewhere, or (with parity
        ``groups``) can be rebuilt from what is held, newest first."""
        full = set(range(world_size))
        owners = self.owners_held()
        if groups:
            for it in {it for per in self.parity for it, _ in per}:
                held = owners.get(it, set())
                owners[it] = held | recoverable_owners(groups, held, set(self.parity_at(it)))
        return sorted((it for it, o in owners.items() if o >= full), reverse=True)

    def parity_at(self, iteration: int) -> Dict[int, int]:
        """holder -> the lowest rank whose node store holds its parity file of ``iteration``."""
        out: Dict[int, int] = {}
        for rank, per_rank in enumerate(self.parity):
            for it, holder in per_rank:
                if it == iteration:
                    out.setdefault(holder, rank)
        return out

    def parity_block_sizes(self, iteration: int) -> Dict[int, int]:
        """holder -> block size its parity file of ``iteration`` records."""
        return {h: n for per in self.parity for (it, h), n in per.items() if it == iteration}

    def available(self, iteration: int) -> Dict[int, List[int]]:
        out: Dict[int, List[int]] = {}
        for rank, per_rank in enumerate(self.ids):
            for it, owner in per_rank:
                if it == iteration:
                    out.setdefault(owner, []).append(rank)
        return out

    def nbytes(self, iteration: int) -> Dict[int, int]:
        out: Dict[int, int] = {}
        for per_rank in self.ids:
            for (it, owner), n in per_rank.items():
                if it == iteration:
                    out[owner] = n
        return out


def store_identity(store: CheckpointStore) -> str:
    st = os.stat(store.dir)
    return f"{socket.gethostname()}:{st.st_dev}:{st.st_ino}"


def gather_holdings(
    store: CheckpointStore,
    group,
    world_size: int,
    failure: Optional[BaseException] = None,
    note: Optional[Callable[[Mapping[Tuple[int, int], int]], Any]] = None,
) -> Holdings:
    """One all-gather of every rank's view of its node store (headers parsed, not data).

    ``failure``: this rank already failed the step this gather belongs to; every rank raises
    together (see :func:`collectives.gather_or_fail`). ``note``: called with this rank's scan
    (``{(iteration, owner): data bytes}`` of the usable checkpoints in its node's store); its
    value (msgpack-able) rides along, so a vote on it needs no collective of its own
    (``Holdings.notes``)."""
    local = None
    if failure is None:
        try:
            local = _scan_holdings(store, world_size)
            local["note"] = note({(it, o): n for it, o, n in local["ids"]}) if note is not None else None
        except Exception as e:  # a local problem fails every rank together, never a hang
            failure = e
    gathered = collectives.gather_or_fail(local, failure, "listing the node stores", group)
    return Holdings(
        store_keys=tuple(g["store"] for g in gathered),
        ids=tuple({(int(it), int(o)): int(n) for it, o, n in g["ids"]} for g in gathered),
        foreign=tuple(tuple(g["foreign"]) for g in gathered),
        parity=tuple({(int(it), int(h)): int(n) for it, h, n in g.get("parity", ())} for g in gathered),
        other_worlds=tuple(
            {(int(it), int(o)): int(w) for it, o, w in g.get("other_worlds", ())} for g in gathered
        ),
        notes=tuple(g.get("note") for g in gathered),
    )


def _scan_holdings(store: CheckpointStore, world_size: int) -> dict:
    ids: Dict[Tuple[int, int], int] = {}
    foreign: List[str] = []
    other_worlds: List[List[int]] = []
    for cid in store.list():
        try:
            h = store.read_header(cid)
        except ForeignCheckpointError as e:
            other = _other_world(store, cid, world_size)
            if other is not None:
                other_worlds.append([cid.iteration, cid.owner, other])
            else:
                foreign.append(str(e))
            continue
        except (CorruptCheckpointError, StoreError, OSError) as e:
            # A local problem must not keep this rank from the gather (peers would wait).
            logger.warning("ignoring unreadable checkpoint %s: %s", cid.stem(), e)
            continue
        if h.owner >= world_size:
            foreign.append(f"{cid.stem()}: owner rank {h.owner} outside world size {world_size}")
            continue
        ids[(cid.iteration, cid.owner)] = h.data_nbytes
    parity = []
    for pid in store.list_parity():
        try:
            meta = store.read_parity_header(pid)
            if meta["world_size"] == world_size:
                parity.append([pid.iteration, pid.holder, int(meta["block_nbytes"])])
        except (CorruptCheckpointError, StoreError, OSError, KeyError, TypeError) as e:
            logger.warning("ignoring unreadable parity file %s: %s", pid.stem(), e)
    return {
        "store": store_identity(store),
        "ids": [[it, o, n] for (it, o), n in sorted(ids.items())],
        "foreign": foreign[:5],
        "parity": parity,
        "other_worlds": other_worlds,
    }


def _other_world(store: CheckpointStore, cid: CheckpointId, world_size: int) -> Optional[int]:
    """The world size of this session's checkpoint ``cid`` saved by another world size, or
    None (another session's, or unreadable)."""
    try:
        ws = store.read_header_any_world(cid).world_size
    except (StoreError, OSError):
        return None
    return ws if ws != world_size else None


@dataclass
class Retrieved:
    """This rank's checkpoint bytes, verified, and where they came from."""

    header: CheckpointHeader
    tensors: List[torch.Tensor]
    source_rank: int
    source: str  # "local" | "node" | "peer"
    seconds: float
    bytes_read: int
    attempts: int
    failed_copies: List[Tuple[int, int]] = field(default_factory=list)
    #: tensors are read-only views of the node store's segment: copy what you keep
    borrowed: bool = False
    #: the buffer the tensors view (a store mapping when ``borrowed``)
    arena: Optional[torch.Tensor] = None
    #: borrow mode, this rank's data is on another node: that rank serves its shards during
    #: the load exchange (only the header came here); ``tensors`` is empty
    served_by: Optional[int] = None
    #: borrow mode: owner -> (header, verified read-only views) of replicas this rank serves
    serving: Dict[int, Tuple[CheckpointHeader, List[torch.Tensor]]] = field(default_factory=dict)
    #: the hollow state dict decoded from ``header.meta`` when retrieval needed it (reused)
    hollow: Any = None
    #: owner -> hollow state dict already decoded by the caller (reused, not decoded again)
    decoded: Mapping[int, Any] = field(default_factory=dict)
    #: borrow mode, the node's own copy: template shards this rank did not save, read in the
    #: same move from other owners' copies in its node's store (shard id -> filled target)
    node_shards: Dict[Any, torch.Tensor] = field(default_factory=dict)
    #: every rank's value of ``retrieve(note=...)``, in rank order, when the first attempt
    #: went well everywhere (the values rode in its gather); else None
    notes: Optional[List[Any]] = None

    def borrowed_storages(self) -> Set[int]:
        """Storage addresses of the store mappings this retrieval's tensors view: tensors on
        them must not escape a load (the segments are recycled by later saves)."""
        out: Set[int] = set()
        if self.borrowed and self.arena is not None and self.arena.numel():
            out.add(self.arena.untyped_storage().data_ptr())
        for _, views in self.serving.values():
            out.update(v.untyped_storage().data_ptr() for v in views[:1])
        return out


def retrieve(
    store: CheckpointStore,
    holdings: Holdings,
    iteration: int,
    group,
    transport: Optional[P2PTransport],
    me: int,
    world_size: int,
    borrow: bool = False,
    targets: Optional[ShardTargets] = None,
    decoded: Optional[Mapping[int, Any]] = None,
    allow_pickle: bool = False,
    note: Optional[Callable[[Retrieved], Any]] = None,
) -> Retrieved:
    """Bring this rank's checkpoint of ``iteration`` into memory, verified.

    ``borrow``: a copy in this node's store is returned as read-only views of its segment
    (zero copies, no new pages; the caller copies what it keeps), else as private memory.
    In borrow mode a rank whose data lives only on other nodes receives just the header; the
    remote holder verifies its copy and serves the shards in the load exchange
    (``Retrieved.served_by`` / ``Retrieved.serving``), so they travel once, straight into the
    receiver's tensors. ``targets`` (borrow mode; shard id -> tensor, e.g. the template's):
    tensors of the node's own copy are read straight into them — one copy, no new pages.
    ``decoded``: owner -> its hollow state dict, already decoded by the caller (not again).
    ``allow_pickle``: the manager's opt-in, for decoding headers here.
    ``note``: called on this rank's retrieved copy right after its move, before the attempt's
    gather, which carries its value (msgpack-able; it must not raise) to every rank: a caller's
    next vote then needs no collective of its own (``Retrieved.notes``).

    Local-first, then the least-loaded remote holder; copies failing their checksum are
    excluded and the plan is redone on every rank together.
    """
    t0 = time.perf_counter()
    available = holdings.available(iteration)
    sizes = holdings.nbytes(iteration)
    exclude: Set[Tuple[int, int]] = set()
    done: Optional[Retrieved] = None
    failed_log: List[Tuple[int, int]] = []
    pending = set(range(world_size))
    serving: Dict[int, Tuple[CheckpointHeader, List[torch.Tensor]]] = {}
    for attempt in range(1, MAX_ATTEMPTS + 1):
        wanted = {r: r for r in sorted(pending)}
        plan = plan_retrieval(wanted, available, holdings.node_of, sizes, exclude)
        at = _Attempt(
            store,
            holdings,
            iteration,
            me,
            borrow,
            serving,
            targets if targets is not None else ShardTargets(),
            decoded or {},
            allow_pickle,
        )
        result, all_failed, notes = _run_attempt(at, plan, transport, group, note if attempt == 1 else None)
        if result is not None and done is None:
            result.attempts = attempt
            done = result
        if not all_failed:
            if notes is not None and done is result:
                done.notes = notes
            break
        failed_log.extend(sorted(all_failed))
        exclude |= _node_copies(all_failed, holdings, world_size)
        # Receivers whose copy failed go again; everyone else is done.
        pending = {f.receiver for f in plan if (f.source, f.owner) in all_failed}
        if me in pending:
            done = None
        logger.warning(
            "checkpoint copies failed verification (source rank, owner): %s; retrying from other holders",
            sorted(all_failed),
        )
    else:
        raise CorruptCheckpointError(
            f"iteration {iteration}: no intact copy after {MAX_ATTEMPTS} attempts; failed copies "
            f"(source rank, owner): {sorted(set(failed_log))}"
        )
    assert done is not None
    done.failed_copies = failed_log
    done.serving = serving
    done.decoded = decoded or {}
    done.seconds = time.perf_counter() - t0
    return done


def _node_copies(failed: Set[Tuple[int, int]], holdings: Holdings, world_size: int) -> Set[Tuple[int, int]]:
    """Ranks of one node serve the same store file: a copy that failed there fails for all of
    them, so the node's copy is excluded at once (else a corrupt local file would take one
    attempt per rank of the node and exhaust MAX_ATTEMPTS before a remote replica)."""
    return {
        (s, o)
        for s_failed, o in failed
        for s in range(world_size)
        if holdings.node_of(s) == holdings.node_of(s_failed)
    }


def _run_attempt(at: "_Attempt", plan, transport, group, note=None):
    """One retrieval attempt on every rank: run the plan, then learn (one gather) which
    copies failed anywhere, with every rank's ``note`` of its result (see :func:`retrieve`).
    Returns (this rank's result or None, failed (source, owner), every rank's note or None)."""
    local_exc: Optional[BaseException] = None
    failures: List[Tuple[int, int]] = []
    mine = None
    try:
        result, failures = _execute(at, plan, transport)
        if note is not None and result is not None and not failures:
            result.serving, result.decoded = at.serving, at.decoded
            mine = note(result)
    except Exception as e:  # e.g. a peer died mid-transfer: every rank stops together
        local_exc, result = e, None
    gathered = collectives.gather_or_fail(
        {"f": [list(f) for f in failures], "n": mine},
        local_exc,
        f"retrieving iteration {at.iteration}",
        group,
    )
    notes = [g["n"] for g in gathered]
    failed = {(int(s), int(o)) for g in gathered for s, o in g["f"]}
    return result, failed, (notes if all(n is not None for n in notes) else None)


@dataclass
class _Attempt:
    """What one retrieval attempt works with (one rank's view)."""

    store: CheckpointStore
    holdings: Holdings
    iteration: int
    me: int
    borrow: bool
    #: borrow mode: owner -> (header, verified views) of replicas this rank serves
    serving: Dict[int, Tuple[CheckpointHeader, List[torch.Tensor]]]
    targets: ShardTargets
    decoded: Mapping[int, Any]
    allow_pickle: bool = False

    def cid(self, owner: int) -> CheckpointId:
        return CheckpointId(self.iteration, owner, self.store.session)

    def same_node(self, a: int, b: int) -> bool:
        return self.holdings.node_of(a) == self.holdings.node_of(b)


def _execute(at: "_Attempt", plan: Sequence[Fetch], transport):
    """Run one retrieval plan; returns (my result or None, failed (source, owner) pairs I saw).
    ``at.serving`` (borrow mode) collects the replicas this rank verified and will serve."""
    me = at.me
    mine = next((f for f in plan if f.receiver == me), None)
    remote: Dict[str, Any] = {}

    def _alloc(header: bytes, nbytes: int) -> torch.Tensor:
        remote["header"] = header
        remote["arena"] = torch.empty(nbytes, dtype=torch.uint8)
        return remote["arena"]

    incoming = (
        [Incoming(mine.source, _alloc)] if mine is not None and not at.same_node(mine.source, me) else []
    )
    failures: List[Tuple[int, int]] = []
    outgoing: List[Outgoing] = []
    maps: list = []
    checks: List[Tuple[int, Pending]] = []  # owner -> verification of the copy served
    try:
        for f in plan:
            if f.source == me and f.receiver != me and not at.same_node(f.source, f.receiver):
                out, mapping, check = _serve(at, f)
                outgoing.append(out)
                if mapping is None and not out.header:
                    failures.append((me, f.owner))
                elif mapping is not None:
                    maps.append(mapping)
                if check is not None:
                    checks.append((f.owner, check))
        if outgoing or incoming:
            if transport is None:
                raise CheckpointingException("a remote checkpoint copy is needed but no transport is set up")
            with phase(PEERS):
                transport.exchange(outgoing, incoming)
        # Unmapped when the last tensor viewing them is gone (never close() under a live view).
        del outgoing
        maps.clear()
        return _receive(at, mine, remote, failures), failures
    finally:
        # Served copies are verified while this rank's own bytes move (the same reader
        # threads); one that fails is reported with this attempt's failures, so its receiver
        # retries from another holder like any failed copy.
        for owner, check in checks:
            bad = check.wait()
            if bad:
                logger.warning(
                    "%s: tensors %s fail their checksum on rank %d; not serving it",
                    at.cid(owner).stem(),
                    bad[:8],
                    me,
                )
                at.serving.pop(owner, None)
                failures.append((me, owner))


def _receive(
    at: "_Attempt", mine: Optional[Fetch], remote: Mapping[str, Any], failures
) -> Optional[Retrieved]:
    """This rank's own copy, from its node's store or the peer that sent it; None (and the copy
    in ``failures``) if it is unusable."""
    if mine is None:
        return None
    try:
        if at.same_node(mine.source, at.me):
            return _from_node(at, mine)
        return _from_peer(at, mine, remote)
    except (CorruptCheckpointError, StoreError, OSError) as e:
        logger.warning("copy of %s from rank %d unusable: %s", at.cid(mine.owner).stem(), mine.source, e)
        failures.append((mine.source, mine.owner))
        return None


def _serve(at: _Attempt, f: Fetch):
    """This rank holds ``f.owner``'s copy for a receiver on another node: (the Outgoing, the
    mapping to keep alive while it is sent, or None; the copy's verification, started, or None).
    Borrow mode verifies the copy here (on the reader threads, while this rank's own bytes
    move) and serves its shards in the load exchange later, so only the header travels now. A
    copy that cannot be read still takes part, with an empty header, so the receiver learns it
    at once."""
    cid = at.cid(f.owner)
    empty = torch.empty(0, dtype=torch.uint8)
    try:
        reader = at.store.open(cid)
        raw = at.store.header_path(cid).read_bytes()
        if not at.borrow:
            m, buf = _map_readonly(reader)
            return Outgoing(f.receiver, raw, buf), m, None
        _, buf = _map_readonly(reader, populate=False)  # the checks fault its pages in
        tensors = reader.header.tensors
        check = start_checks(buf, [(lay.offset, lay.nbytes, lay.checksum) for lay in tensors])
        at.serving[f.owner] = (reader.header, _views(reader.header, buf))
        return Outgoing(f.receiver, raw, empty), _NullMap(), check
    except (StoreError, OSError) as e:
        logger.warning("cannot serve %s to rank %d: %s", cid.stem(), f.receiver, e)
        return Outgoing(f.receiver, b"", empty), None, None


def _from_node(at: _Attempt, mine: Fetch) -> Retrieved:
    """This rank's copy is in its own node's store: read (borrow mode: straight into the
    template's tensors) and verify."""
    cid = at.cid(mine.owner)
    source = "local" if mine.source == at.me else "node"
    if at.borrow:
        header, tensors, hollow, bad, node_shards = _read_local_into(at, cid)
        _raise_if_bad(cid, mine.source, header, bad)
        nread = header.data_nbytes + sum(t.numel() * t.element_size() for t in node_shards.values())
        return Retrieved(
            header, tensors, mine.source, source, 0.0, nread, 1, hollow=hollow, node_shards=node_shards
        )
    header, arena, nread = _read_local(at.store, cid)
    _raise_if_bad(cid, mine.source, header, _verify(header, arena))
    return Retrieved(header, _views(header, arena), mine.source, source, 0.0, nread, 1, arena=arena)


def _from_peer(at: _Attempt, mine: Fetch, remote: Mapping[str, Any]) -> Retrieved:
    """This rank's copy came from another node (borrow mode: only its header; the holder
    serves the shards in the load exchange)."""
    cid = at.cid(mine.owner)
    raw = remote.get("header", b"")
    if not raw:
        raise CorruptCheckpointError(f"rank {mine.source} could not serve {cid.stem()}")
    header = CheckpointHeader.unpack(raw, source=f"header of {cid.stem()} from rank {mine.source}")
    if header.id != cid or header.world_size != len(at.holdings.store_keys):
        raise CorruptCheckpointError(f"rank {mine.source} sent {header.id} for {cid}")
    if at.borrow:
        return Retrieved(header, [], mine.source, "peer", 0.0, header.data_nbytes, 1, served_by=mine.source)
    arena = remote["arena"]
    _raise_if_bad(cid, mine.source, header, _verify(header, arena))
    return Retrieved(
        header, _views(header, arena), mine.source, "peer", 0.0, header.data_nbytes, 1, arena=arena
    )


def _raise_if_bad(cid: CheckpointId, source: int, header: CheckpointHeader, bad: List[int]) -> None:
    if bad:
        raise CorruptCheckpointError(
            f"{cid.stem()} from rank {source}: tensors {bad[:8]} fail their {header.checksum_algo} checksum"
        )


def _views(header: CheckpointHeader, arena: torch.Tensor) -> List[torch.Tensor]:
    return [arena[l.offset : l.offset + l.nbytes].view(l.torch_dtype).view(l.shape) for l in header.tensors]


def _map_readonly(reader, populate: bool = True):
    with warnings.catch_warnings():
        # torch warns that the mapping is read-only; we only ever read (send) from it.
        warnings.simplefilter("ignore", UserWarning)
        if reader.header.data_nbytes == 0:
            return _NullMap(), torch.empty(0, dtype=torch.uint8)
        return reader.map(populate=populate)


class _NullMap:
    def close(self):
        pass


def _read_local(store: CheckpointStore, cid: CheckpointId):
    """A private copy of the node store's checkpoint (borrow mode uses _read_local_into)."""
    reader = store.open(cid)
    n = reader.header.data_nbytes
    arena = torch.empty(n, dtype=torch.uint8)
    if n:
        reader.read_range(0, checksum.byte_view(arena))
    return reader.header, arena, n


def _read_local_into(at: "_Attempt", cid: CheckpointId):
    """Borrow mode, the node's own copy: every tensor moved from the store file straight into
    its target (same dtype and shape, contiguous; CPU, or CUDA through page-locked chunks),
    else into new CPU memory, verified on the way (``memory.transfer``; no segment is mapped).
    The template's shards this rank did not save move in the same pass, from other owners'
    copies in the node's store (ring placement puts the previous node's ranks here: typically
    half of the data-parallel replicated shards) — read locally, not over the network.
    Returns (header, tensors, decoded hollow state dict or None, indexes of own tensors failing
    their checksum, shard id -> target filled from the node's other copies). CUDA copies are
    ordered before the current stream's later work."""
    reader = at.store.open(cid)
    header = reader.header
    tensors: List[Optional[torch.Tensor]] = [None] * len(header.tensors)
    hollow = at.decoded.get(cid.owner)
    others: List[_NodeCopy] = []
    if at.targets:
        hollow = hollow or MCoreTensorAwareStateDict.from_bytes(header.meta, allow_pickle=at.allow_pickle)
        sids = [st.shard_id for st in hollow.tensor_metadata]
        if len(sids) != len(header.tensors):
            raise CorruptCheckpointError(
                f"{cid.stem()}: header lists {len(header.tensors)} tensors, metadata {len(sids)}"
            )
        direct = at.targets.direct
        for i, (lay, sid) in enumerate(zip(header.tensors, sids)):
            tensors[i] = direct(sid, lay.torch_dtype, lay.shape)
    for i, lay in enumerate(header.tensors):
        if tensors[i] is None:
            tensors[i] = torch.empty(lay.shape, dtype=lay.torch_dtype)
    own_move = start_reads([(str(reader.path), reader.reads(tensors))])
    node_move = None
    try:  # the other copies are looked up while the own copy's bytes move
        if at.targets:
            own = set(sids)
            wanted = {sid for sid in at.targets if sid not in own}
            if wanted:
                others = _plan_node_copies(
                    at.store, at.iteration, at.targets, wanted, cid.owner, at.allow_pickle
                )
        if others:
            try:
                node_move = start_reads([(o.path, o.reads) for o in others])
            except OSError as e:  # the load exchange brings those shards from their holders
                logger.warning("cannot read the node's other copies of %s: %s", cid.stem(), e)
                others = []
    finally:  # nothing may still be writing into the targets when this returns or raises
        own_moved = own_move.wait()
        node_moved = node_move.wait() if node_move is not None else []
    failed = reader.check(own_moved[0])
    return header, tensors, hollow, failed, _node_shards_read(others, node_moved, at.targets)


@dataclass
class _NodeCopy:
    """Template shards read from another owner's copy of the iteration in this node's store."""

    cid: CheckpointId
    path: str
    reads: List[Read]
    shard_of: Dict[int, Any]  # index of the file's tensor read -> the shard id it fills


def _plan_node_copies(
    store: CheckpointStore,
    iteration: int,
    targets: ShardTargets,
    wanted: Set[Any],
    skip_owner: int,
    allow_pickle: bool = False,
) -> List[_NodeCopy]:
    """Reads of the ``wanted`` shard ids into their ``targets`` from other owners' checkpoints
    of ``iteration`` in this node's store, each shard from the first copy that has it in the
    target's dtype and shape. Unreadable copies are skipped (the load exchange brings their
    shards from another rank instead)."""
    out: List[_NodeCopy] = []
    taken: Set[Any] = set()
    for cid in store.list():
        if cid.iteration != iteration or cid.owner == skip_owner or len(taken) == len(wanted):
            continue
        try:
            reader = store.open(cid)
            sids = MCoreTensorAwareStateDict.saved_shard_ids_from_bytes(reader.header.meta, allow_pickle)
        except (StoreError, OSError, CheckpointingException) as e:
            logger.warning("cannot read %s for local shards: %s", cid.stem(), e)
            continue
        copy = _NodeCopy(cid, str(reader.path), [], {})
        for i, (lay, sid) in enumerate(zip(reader.header.tensors, sids)):
            if sid not in wanted or sid in taken:
                continue
            t = targets.direct(sid, lay.torch_dtype, lay.shape)
            if t is not None:
                copy.reads.append(Read(lay.offset, lay.nbytes, lay.checksum, t, i))
                copy.shard_of[i] = sid
                taken.add(sid)
        if copy.reads:
            out.append(copy)
    return out


def _node_shards_read(copies: Sequence[_NodeCopy], moved: Sequence[Moved], wanted) -> Dict[Any, torch.Tensor]:
    """Shard id -> its target, for every read of ``copies`` that arrived whole and verified; the
    load exchange brings the others from another rank (it overwrites the target)."""
    filled: Dict[Any, torch.Tensor] = {}
    for copy, m in zip(copies, moved):
        m.fence()
        bad = set(m.failed) | set(m.short)
        for i, sid in copy.shard_of.items():
            if i in bad:
                logger.warning(
                    "%s: shard %s fails its checksum; fetching it from a peer", copy.cid.stem(), sid
                )
            else:
                filled[sid] = wanted[sid]
    return filled


def _verify(header: CheckpointHeader, arena: torch.Tensor) -> List[int]:
    if not header.data_nbytes:
        return []
    return failed_tensors(header, checksum.byte_view(arena))
