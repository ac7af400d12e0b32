"""Elastic restore (a mixin of ``CheckpointManager``): resume on another world size or
parallel layout straight from the survivors' memory.

When the newest iteration the node stores hold completely was saved by N ranks and this job
has M != N, ``load_local(template)`` assembles every template shard from the intersections of
the saved shards with it, by global offsets (``parallel.resharding``): from this node's store
when it holds the saved rank's data, else from the least-loaded rank whose store does,
several sources at once over the checkpoint data group. Collective; every decision comes
from gathered facts, so every rank raises the same error or restores together.

Per-rank objects (a ShardedObject of global shape ``(N,)``: RNG states, dataloader positions)
cannot be resharded by offsets. Policy: new rank m takes saved rank m's object when m < N
and keeps its template's value otherwise (a rank that did not exist has no saved state of
its own); ``load_local(..., reshard_objects=f)`` replaces this with ``f(key, saved_values,
new_world_size) -> new_values``. Objects of any other global shape must match by offset.
Common state (iteration counters, scheduler and optimizer hyper-parameters) carries over.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from ..bits import copy_bits
from ..errors import CorruptCheckpointError, ValidationError
from ..memory.checksum import digest
from ..memory.layout import CheckpointHeader, CheckpointId
from ..memory.reader import map_readonly
from ..memory.store import CheckpointStore
from ..memory.transfer import Pending, Read, read_into, start_reads
from ..model.mapping import ShardedObject, ShardedTensor, apply_factory_merges, dtype_name
from ..model.nested import fill_holes, map_leaves, map_leaves_inplace, merge
from ..parallel import collectives
from ..parallel.resharding import (
    Piece,
    SavedShard,
    WantedShard,
    box_of,
    local_slices,
    plan_reshard,
)
from ..parallel.template import PreparedTemplate, sharded_objects
from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
from ..replication.transport import Incoming, Outgoing
from .metrics import LoadMetrics
from .restore import Holdings

logger = logging.getLogger(__name__)

ObjectResharder = Callable[[str, List[Any], int], List[Any]]
MAX_ATTEMPTS = 3


@dataclass(frozen=True)
class ElasticChoice:
    """The newest iteration held completely that was saved by another world size."""

    iteration: int
    world_size: int  # N, the saving job's
    holders: Mapping[int, Tuple[int, ...]]  # owner -> ranks (this job's) whose store holds it


def _itemsize(dtype: str) -> int:
    return torch.empty(0, dtype=getattr(torch, dtype)).element_size()


class ElasticLoad:
    """Mixed into ``CheckpointManager``."""

    def _elastic_choice(self, holdings: Holdings, newest_same_size: int) -> Optional[ElasticChoice]:
        """The newest iteration of another world size the stores hold completely (from the
        gathered holdings: the same answer on every rank), if newer than ``newest_same_size``;
        None otherwise (and in service mode)."""
        if self._client is not None:
            return None
        held: Dict[Tuple[int, int], Dict[int, List[int]]] = {}
        for rank, per in enumerate(holdings.other_worlds):
            for (it, owner), ws in per.items():
                held.setdefault((it, ws), {}).setdefault(owner, []).append(rank)
        complete = [(it, ws) for (it, ws), owners in held.items() if set(owners) == set(range(ws))]
        if not complete:
            return None
        it, ws = max(complete)
        if it <= newest_same_size:
            return None
        return ElasticChoice(it, ws, {o: tuple(r) for o, r in held[(it, ws)].items()})

    def _load_elastic(
        self,
        template: Optional[PreparedTemplate],
        choice: ElasticChoice,
        holdings: Holdings,
        failure: Optional[BaseException],
        t0: float,
        reshard_objects: Optional[ObjectResharder] = None,
    ) -> Tuple[Any, int]:
        control = self._control_group()
        n, it = choice.world_size, choice.iteration
        if failure is None and template is None:
            failure = ValidationError(
                f"iteration {it} was saved by {n} ranks and this job has {self.world_size}: restoring "
                "it needs a template laid out for this job (load_local(template))"
            )
        wanted: List[list] = []
        headers: Dict[int, bytes] = {}
        if failure is None:
            try:
                wanted = [
                    [i, st.key, dtype_name(st.dtype), list(st.global_shape), [list(b) for b in box_of(st)]]
                    for i, st in enumerate(template.shards)
                ]
                for owner, ranks in choice.holders.items():
                    if ranks[0] == self.rank:  # the lowest holder contributes the header
                        headers[owner] = self.store.header_path(
                            CheckpointId(it, owner, self.session_id)
                        ).read_bytes()
            except Exception as e:  # every rank raises together below
                failure = e
        gathered = collectives.gather_or_fail(
            {"wanted": wanted, "headers": headers},
            failure,
            f"planning the resharded restore of iteration {it}",
            control,
        )
        parsed = _parse_headers(gathered, it, n, self.session_id, self.options.allow_pickle)
        saved = [s for h in parsed.values() for s in h.shards]
        want = [
            WantedShard(r, int(i), key, dtype, tuple(gs), tuple(tuple(b) for b in box))
            for r, g in enumerate(gathered)
            for i, key, dtype, gs, box in g["wanted"]
        ]
        same_node = lambda a, b: holdings.node_of(a) == holdings.node_of(b)  # noqa: E731
        excluded: Set[Tuple[int, int]] = set()  # (saved rank, holder) copies that failed
        for attempt in range(1, MAX_ATTEMPTS + 1):
            holders = {o: tuple(r for r in rs if (o, r) not in excluded) for o, rs in choice.holders.items()}
            pieces, errors = plan_reshard(want, saved, holders, same_node, _itemsize)
            if errors:
                cls = ValidationError if attempt == 1 else CorruptCheckpointError
                raise cls(
                    f"iteration {it} (saved by {n} ranks) cannot be resharded onto {self.world_size}: "
                    + "; ".join(errors[:8])
                    + (f" (and {len(errors) - 8} more)" if len(errors) > 8 else "")
                    + (
                        ""
                        if attempt == 1
                        else f" (copies failing their checksum excluded: {sorted(excluded)[:8]})"
                    )
                )
            local: Optional[BaseException] = None
            bad: List[List[int]] = []
            try:
                bad = self._move_pieces(pieces, parsed, template, it)
            except Exception as e:  # a dead or stuck peer: every rank stops together below
                local = e
            gathered_bad = collectives.gather_or_fail(bad, local, f"resharding iteration {it}", control)
            failed = sorted({tuple(b) for per in gathered_bad for b in per})
            if not failed:
                break
            # one file per node store: the copy failed for every rank of that node
            excluded |= {
                (owner, r) for owner, _i, src in failed for r in range(self.world_size) if same_node(r, src)
            }
            logger.warning(
                "iteration %d: saved tensors (saved rank, index, holder) %s fail their checksum; "
                "re-planning from other holders",
                it,
                failed[:8],
            )
        else:
            raise CorruptCheckpointError(f"iteration {it}: no intact copy after {MAX_ATTEMPTS} attempts")
        state = self._fill_elastic(template, parsed, n, reshard_objects)
        self._adopt_elastic(it, n, t0, sum(p.nbytes for p in pieces if p.dst == self.rank))
        return state, it

    def _move_pieces(
        self, pieces: Sequence[Piece], parsed, template: PreparedTemplate, it: int
    ) -> List[List[int]]:
        """Send the pieces this rank serves, receive and place the ones it needs. Returns
        the saved tensors that failed their checksum here."""
        me = self.rank
        targets = [_target(st) for st in template.shards]
        sources = _Sources(self.store, it, self.session_id, parsed, me)
        bad: List[List[int]] = []
        sources.load([p for p in pieces if p.src == me], template, targets, bad)
        out_by_dst: Dict[int, List[Piece]] = {}
        in_by_src: Dict[int, List[Piece]] = {}
        for p in pieces:
            if p.src == me and p.dst == me:
                view = sources.piece(p)
                if view is not None and (p.owner, p.index, p.slot) not in sources.placed:
                    _place(targets, template.shards, p, view)
            elif p.src == me:
                out_by_dst.setdefault(p.dst, []).append(p)
            elif p.dst == me:
                in_by_src.setdefault(p.src, []).append(p)
        outgoing = []
        for dst, ps in sorted(out_by_dst.items()):
            views = [sources.piece(p) for p in ps]
            if any(v is None for v in views):
                outgoing.append(Outgoing(dst, b"", torch.empty(0, dtype=torch.uint8)))
                continue
            payload = torch.cat([v.contiguous().view(-1).view(torch.uint8) for v in views])
            outgoing.append(Outgoing(dst, b"r", payload))
        received: Dict[int, Tuple[bytes, torch.Tensor]] = {}

        def land(src: int):
            def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
                buf = torch.empty(nbytes, dtype=torch.uint8)
                received[src] = (hdr, buf)
                return buf

            return allocate

        incoming = [Incoming(src, land(src)) for src in sorted(in_by_src)]
        self._fault("reshard_before_exchange")
        if outgoing or incoming:
            self._transport.exchange(outgoing, incoming)
        del outgoing
        for src, ps in in_by_src.items():
            hdr, buf = received.get(src, (b"", None))
            if not hdr:
                bad.extend([p.owner, p.index, src] for p in ps)
                continue
            at = 0
            for p in ps:
                sh = template.shards[p.slot]
                shape = [hi - lo for lo, hi in p.box][sh.prepend_axis_num :]
                piece = buf[at : at + p.nbytes].view(sh.dtype).view(shape)
                _place(targets, template.shards, p, piece)
                at += p.nbytes
        return bad

    def _fill_elastic(self, template: PreparedTemplate, parsed, n: int, reshard_objects) -> Any:
        saved_objects: Dict[Tuple[str, Tuple[int, ...], Tuple[int, ...]], Any] = {}
        for owner in sorted(parsed):
            for o in parsed[owner].objects:
                saved_objects.setdefault((o.key, tuple(o.global_shape), tuple(o.global_offset)), o.data)
        values = _object_values(
            template.objects, saved_objects, n, self.world_size, self.rank, reshard_objects
        )
        by_id = {id(st): st for st in template.shards}

        def fill(v):
            if isinstance(v, ShardedTensor) and id(v) in by_id:
                return v.data
            if isinstance(v, ShardedObject):
                return values[id(v)]
            return v

        sharded = template.sharded
        map_leaves_inplace(fill, sharded)
        result = map_leaves(lambda v: v, parsed[0].common)
        merge(result, template.nonpersistent)
        merge(result, apply_factory_merges(sharded, template.factories))
        return fill_holes(result)

    def _adopt_elastic(self, iteration: int, n: int, t0: float, nbytes: int) -> None:
        self._restored = True
        self._elastic_from = n
        self.latest_iteration = iteration
        self._last_saved = iteration
        self._complete = []
        self.last_load_metrics = LoadMetrics(
            iteration=iteration,
            source="resharded",
            source_rank=-1,
            total_s=time.perf_counter() - t0,
            bytes_read=nbytes,
            attempts=1,
        )
        if self.rank == 0:
            logger.warning(
                "restored iteration %d saved by %d ranks onto %d ranks (resharded from memory)",
                iteration,
                n,
                self.world_size,
            )


@dataclass
class _Parsed:
    header: CheckpointHeader
    shards: List[SavedShard]
    objects: List[ShardedObject]
    common: Any


def _parse_headers(gathered, iteration: int, n: int, session: str, allow_pickle: bool) -> Dict[int, _Parsed]:
    raw: Dict[int, bytes] = {}
    for g in gathered:
        for owner, h in g["headers"].items():
            raw.setdefault(int(owner), bytes(h))
    out: Dict[int, _Parsed] = {}
    for owner in range(n):
        if owner not in raw:
            raise CorruptCheckpointError(
                f"iteration {iteration}: no header of saved rank {owner} was gathered"
            )
        h = CheckpointHeader.unpack(raw[owner], source=f"header of saved rank {owner}")
        if h.id != CheckpointId(iteration, owner, session) or h.world_size != n:
            raise CorruptCheckpointError(
                f"iteration {iteration}: the header gathered for rank {owner} describes {h.id}"
            )
        hollow = MCoreTensorAwareStateDict.from_bytes(h.meta, allow_pickle=allow_pickle)
        metas = hollow.tensor_metadata
        if len(metas) != len(h.tensors):
            raise CorruptCheckpointError(
                f"{h.id.stem()}: header lists {len(h.tensors)} tensors, metadata {len(metas)}"
            )
        shards = [
            SavedShard(
                owner,
                i,
                st.key,
                dtype_name(st.dtype),
                tuple(st.global_shape),
                box_of(st),
                st.prepend_axis_num,
                lay.nbytes,
            )
            for i, (st, lay) in enumerate(zip(metas, h.tensors))
        ]
        objects = [o for o in sharded_objects(hollow.sharded_state_dict) if o.data is not None]
        out[owner] = _Parsed(h, shards, objects, hollow.common)
    return out


class _Sources:
    """Saved tensors this rank reads from its node's store, moved through ``memory/transfer``
    (verified on the way): a local piece that is a whole saved tensor and a contiguous part of a
    template tensor (a tensor-parallel shard joined along its first axis, a data-parallel
    resize) is read straight into the template; a saved tensor needed only in parts, or by
    other ranks, is viewed through a read-only mapping of its segment (:meth:`_map_partial`)."""

    def __init__(self, store: CheckpointStore, iteration: int, session: str, parsed, me: int):
        self.me = me
        self.store = store
        self.iteration = iteration
        self.session = session
        self.parsed = parsed
        self._read: Dict[Tuple[int, int], Optional[torch.Tensor]] = {}  # None: failed its checksum
        self.placed: Set[Tuple[int, int, int]] = set()  # (owner, index, slot) read into the template

    def load(
        self, pieces: Sequence[Piece], template: PreparedTemplate, targets: List[torch.Tensor], bad
    ) -> None:
        """Read every saved tensor the pieces this rank serves need (one pass over every saved
        rank's file)."""
        by_owner: Dict[int, List[Read]] = {}
        partial: Dict[int, List[int]] = {}
        for p in pieces:
            key = (p.owner, p.index)
            if key in self._read:
                continue
            lay = self.parsed[p.owner].header.tensors[p.index]
            shard = self.parsed[p.owner].shards[p.index]
            region = _region(targets, template.shards, p) if p.dst == self.me and p.box == shard.box else None
            whole = (
                region is not None
                and region.is_contiguous()
                and region.dtype == lay.torch_dtype
                and region.numel() * region.element_size() == lay.nbytes
            )
            if not whole:
                partial.setdefault(p.owner, []).append(p.index)
                self._read[key] = None  # set once mapped and verified
                continue
            buf = region.view(lay.shape)
            self.placed.add((p.owner, p.index, p.slot))
            self._read[key] = buf
            by_owner.setdefault(p.owner, []).append(Read(lay.offset, lay.nbytes, lay.checksum, buf, p.index))
        owners = list(by_owner)
        paths = [str(self.store.data_path(CheckpointId(self.iteration, o, self.session))) for o in owners]
        try:  # every saved rank's whole tensors in one pass, the partial ones mapped meanwhile
            pending: Optional[Pending] = start_reads([(path, by_owner[o]) for o, path in zip(owners, paths)])
        except OSError:
            pending = None  # a file is unreadable: one pass per saved rank says which
        try:
            for owner, indices in partial.items():
                self._map_partial(owner, indices, bad)
        finally:
            moved = pending.wait() if pending is not None else [None] * len(owners)
        for owner, path, m in zip(owners, paths, moved):
            reads = by_owner[owner]
            try:
                m = m if m is not None else read_into(path, reads)
                m.fence()
                failed = set(m.failed) | set(m.short)
            except OSError as e:
                logger.warning("cannot read saved rank %d's tensors: %s", owner, e)
                failed = {r.index for r in reads}
            for index in failed:
                self._read[(owner, index)] = None
                self.placed = {x for x in self.placed if x[:2] != (owner, index)}
                bad.append([owner, index, self.me])

    def _map_partial(self, owner: int, indices: List[int], bad) -> None:
        """Saved tensors of ``owner`` that pieces need only parts of (or that go to other ranks):
        viewed through a read-only mapping of its segment, each verified in place once, its
        pieces copied from there (mapping page-cache pages costs less than faulting in private
        memory to read them into, then copying again)."""
        header = self.parsed[owner].header
        path = self.store.data_path(CheckpointId(self.iteration, owner, self.session))
        try:
            _, flat = map_readonly(path, header.data_nbytes)
        except OSError as e:
            logger.warning("cannot read saved rank %d's tensors: %s", owner, e)
            flat = None
        for index in indices:
            lay = header.tensors[index]
            raw = flat[lay.offset : lay.offset + lay.nbytes] if flat is not None else None
            if raw is None or (lay.checksum is not None and digest(raw.numpy()) != lay.checksum):
                bad.append([owner, index, self.me])
                continue
            self._read[(owner, index)] = raw.view(lay.torch_dtype).view(lay.shape)

    def piece(self, p: Piece) -> Optional[torch.Tensor]:
        """A view of the saved tensor's part ``p.box`` (None when it failed its checksum)."""
        t = self._read.get((p.owner, p.index))
        if t is None:
            return None
        shard = self.parsed[p.owner].shards[p.index]
        return t[local_slices(p.box, shard.box, shard.prepend)]


def _target(st: ShardedTensor) -> torch.Tensor:
    d = st.data
    if d is None or d.is_meta or tuple(d.shape) != st.local_shape or d.dtype != st.dtype:
        st.data = torch.empty(st.local_shape, dtype=st.dtype)
    return st.data


def _region(targets: List[torch.Tensor], shards: Sequence[ShardedTensor], p: Piece) -> torch.Tensor:
    """The part of template tensor ``p.slot`` that piece ``p`` fills."""
    st = shards[p.slot]
    return targets[p.slot][local_slices(p.box, box_of(st), st.prepend_axis_num)]


def _place(
    targets: List[torch.Tensor], shards: Sequence[ShardedTensor], p: Piece, piece: torch.Tensor
) -> None:
    dst = _region(targets, shards, p)
    copy_bits(dst, piece.reshape(dst.shape))


def _object_values(
    wanted: Sequence[ShardedObject],
    saved: Mapping[Tuple[str, Tuple[int, ...], Tuple[int, ...]], Any],
    n: int,
    m: int,
    rank: int,
    reshard: Optional[ObjectResharder],
) -> Dict[int, Any]:
    """Each template object's value under the policy in the module docstring."""
    out: Dict[int, Any] = {}
    kept: Set[str] = set()
    for o in wanted:
        shape, off = tuple(o.global_shape), tuple(o.global_offset)
        per_rank = shape == (m,) and (o.key, (n,), (0,)) in saved
        if per_rank:
            olds = [saved.get((o.key, (n,), (r,))) for r in range(n)]
            if reshard is not None:
                news = list(reshard(o.key, olds, m))
                if len(news) != m:
                    raise ValidationError(
                        f"reshard_objects returned {len(news)} values for {o.key!r}, expected {m}"
                    )
                out[id(o)] = news[off[0]]
            elif off[0] < n:
                out[id(o)] = olds[off[0]]
            else:
                out[id(o)] = o.data
                kept.add(o.key)
            continue
        if (o.key, shape, off) in saved:
            out[id(o)] = saved[(o.key, shape, off)]
            continue
        raise ValidationError(
            f"object {o.key!r} at offset {list(off)} of {list(shape)} has no counterpart in the checkpoint "
            f"(saved by {n} ranks); per-rank objects need global shape (world size,) "
            "or a reshard_objects callback"
        )
    if kept:
        logger.warning(
            "rank %d did not exist in the saved job (%d ranks): it keeps its own %s (pass "
            "load_local(..., reshard_objects=f) to derive them from the saved ones)",
            rank,
            n,
            sorted(kept),
        )
    return out
