"""Parity redundancy in embedded mode: encoding on save, rebuilding a lost member on restore.

**Save** (:class:`ParityReplicator`, the manager's replicator with ``redundancy="parity"``):
two exchanges over the checkpoint data group, among the members of this rank's group only.
1. Headers: every member sends its checkpoint header to every other member (so each parity
   file carries the others' headers: a lost member's header is rebuilt from any survivor,
   and every member learns the group's block size).
2. Blocks: each member sends data block ``b`` to the parity holders of its ``b``-th stripe;
   each holder codes its parity block(s) (:mod:`.erasure`) straight into a store segment and
   publishes it with a :data:`~..memory.layout.PARITY_MAGIC` header listing the digests of
   every share of its stripes. A member whose save failed still takes part in both
   exchanges (empty headers out, refusals in), so its partners fail at once, not at a timeout.

**Restore** (:func:`rebuild_lost`): every lost member's data is decoded by that rank itself,
from the ``k`` shares per stripe :func:`.parity.plan_rebuild` picks, sent by the ranks whose
stores hold them (several sources at once, one stripe of every lost member per exchange, so
scratch memory stays at one stripe). Each share is checked against the digests its stripe's
parity holders recorded; the decoded data against the lost header's tensor checksums. Bad
shares are gathered on every rank and the plan is redone without them (Reed–Solomon can
route around one); when it cannot, every rank raises the same error.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

import msgpack
import torch

from ..errors import CheckpointingException, CorruptCheckpointError, ReplicationError, StoreError
from ..memory import checksum
from ..memory.layout import (
    FORMAT_VERSION,
    PARITY_MAGIC,
    CheckpointHeader,
    CheckpointId,
    ParityId,
    failed_tensors,
    pack_envelope,
    writer_name,
)
from ..memory.reader import map_readonly
from ..memory.segment import Segment
from ..memory.store import CheckpointStore
from ..parallel import collectives
from . import erasure
from .parity import ParityGroup, Rebuild, Share, Unrecoverable, block_nbytes, group_of, plan_rebuild
from .replicator import ReplicationResult
from .transport import Incoming, Outgoing, P2PTransport

logger = logging.getLogger(__name__)

_EMPTY = torch.empty(0, dtype=torch.uint8)
_DATA_MARK = b"d"  # a data share's header: non-empty (an empty one means "could not send")
MAX_ATTEMPTS = 3


def _block(buf: torch.Tensor, nbytes: int, b: int, size: int) -> torch.Tensor:
    """Block ``b`` of a member's data (zero past its end)."""
    lo, hi = b * size, min((b + 1) * size, nbytes)
    if hi - lo == size:
        return buf[lo:hi]
    out = torch.zeros(size, dtype=torch.uint8)
    if hi > lo:
        out[: hi - lo].copy_(buf[lo:hi])
    return out


def _refuse(why: str):
    def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
        raise ReplicationError(why)

    return allocate


@dataclass
class EncodeStats:
    seconds: float = 0.0
    nbytes: int = 0  # data bytes coded


class ParityReplicator:
    """The :class:`~.replicator.Replicator` of ``redundancy="parity"`` (embedded mode)."""

    def __init__(
        self,
        transport: P2PTransport,
        groups: Sequence[ParityGroup],
        store: CheckpointStore,
        rank: int,
        fault: Optional[Callable[[str], None]] = None,
    ):
        self.transport = transport
        self.groups = tuple(groups)
        self.group = group_of(groups, rank)
        self.store = store
        self.rank = rank
        self.me = self.group.index(rank)
        self.last_encode = EncodeStats()
        #: the manager's fault hook (tests, chaos drills): "parity_after_headers"
        self.fault = fault or (lambda point: None)

    @property
    def _others(self) -> List[int]:
        return [r for r in self.group.members if r != self.rank]

    def replicate(self, header: CheckpointHeader, segment: Segment) -> ReplicationResult:
        return self._encode(header, segment.buffer, set(self.group.members))

    def repair(self, iteration: int, missing: Sequence[int]) -> ReplicationResult:
        """Healing after a rebuild: re-create the parity files of ``missing`` holders (ranks
        whose parity file of ``iteration`` no store holds) in this rank's group, from the
        members' data in their stores. Every member of an affected group takes part."""
        targets = {r for r in missing if r in self.group.members}
        if not targets:
            return ReplicationResult()
        cid = CheckpointId(iteration, self.rank, self.store.session)
        header = self.store.read_header(cid)
        if not header.data_nbytes:
            return self._encode(header, _EMPTY, targets)
        _mapping, buf = map_readonly(self.store.data_path(cid), header.data_nbytes)
        return self._encode(header, buf, targets)  # unmapped once the last view is gone

    def _encode(self, header: CheckpointHeader, data: torch.Tensor, targets) -> ReplicationResult:
        """Headers, then blocks, to the parity holders in ``targets`` (every member on save);
        a holder in ``targets`` codes and publishes its parity file."""
        g, me = self.group, self.me
        raw = header.pack()
        headers: Dict[int, bytes] = {}
        sizes: Dict[int, int] = {self.rank: header.data_nbytes}
        coding = self.rank in targets
        # headers go to every holder being made; a holder being made hears from every member
        send_to = [r for r in self._others if r in targets]
        hear_from = self._others if coding else []

        def expect(src: int):
            def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
                if not hdr:
                    raise ReplicationError(
                        f"rank {src} of parity group {list(g.members)} could not save iteration "
                        f"{header.iteration} (see that rank's error)"
                    )
                h = CheckpointHeader.unpack(hdr, source=f"header from rank {src}")
                if h.owner != src or h.session != header.session or h.iteration != header.iteration:
                    raise ReplicationError(
                        f"rank {src} sent {h.id} while saving iteration {header.iteration}"
                    )
                headers[src], sizes[src] = hdr, h.data_nbytes
                return _EMPTY

            return allocate

        failure: Optional[BaseException] = None
        try:
            s1 = self.transport.exchange(
                [Outgoing(r, raw, _EMPTY) for r in send_to],
                [Incoming(r, expect(r)) for r in hear_from],
            )
            if coding:
                size = block_nbytes([sizes[r] for r in g.members], g.k)
            else:  # healing: this member's own parity file records the group's block size
                pid = ParityId(header.iteration, self.rank, self.store.session)
                size = int(self.store.read_parity_header(pid)["block_nbytes"])
        except (CheckpointingException, OSError, KeyError, TypeError) as e:
            failure = e  # still take part in the block exchange (peers wait for it)
        if failure is not None:
            self._blocks_nothing(f"rank {self.rank}: {failure}", targets)
            raise failure
        self.fault("parity_after_headers")
        # 2. blocks: to the parity holders of each of my stripes; theirs to me for mine
        outgoing = []
        for b, s in enumerate(g.data_stripes(me)):
            to = [g.members[h] for h in g.holders(s) if g.members[h] in targets]
            if to:
                blk = _block(data, header.data_nbytes, b, size)
                outgoing += [Outgoing(r, _DATA_MARK, blk) for r in to]
        mine = g.parity_stripes(me) if coding else ()
        scratch: Dict[Tuple[int, int], torch.Tensor] = {}

        def land(s: int, j: int):
            def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
                if not hdr:
                    raise ReplicationError(f"rank {g.members[j]} could not send its block of stripe {s}")
                scratch[(s, j)] = torch.empty(nbytes, dtype=torch.uint8)
                return scratch[(s, j)]

            return allocate

        incoming = [Incoming(g.members[j], land(s, j)) for s, _ in mine for j in g.data_members(s)]
        s2 = self.transport.exchange(outgoing, incoming)
        del outgoing
        pids = [self._publish_parity(header, headers, sizes, size, scratch)] if coding else []
        return ReplicationResult(
            pids,
            s1.bytes_sent + s2.bytes_sent,
            s1.bytes_received + s2.bytes_received,
        )

    def _publish_parity(self, header, headers, sizes, size: int, scratch) -> ParityId:
        """Code this member's parity blocks into a store segment and publish them."""
        g, me = self.group, self.me
        mine = g.parity_stripes(me)
        pid = ParityId(header.iteration, self.rank, self.store.session)
        seg = self.store.reserve(len(mine) * size, populate=False)
        try:
            t0 = time.perf_counter()
            blocks, data_digests = [], []
            for idx, (s, i) in enumerate(mine):
                data = [scratch[(s, j)] for j in g.data_members(s)]
                out = seg.buffer[idx * size : (idx + 1) * size]
                erasure.encode(g.k, g.m, data, i, out)
                blocks.append([s, i, idx * size, checksum.digest(checksum.byte_view(out)) if size else 0])
                data_digests += [
                    [s, n, checksum.digest(checksum.byte_view(d)) if size else 0] for n, d in enumerate(data)
                ]
            self.last_encode = EncodeStats(time.perf_counter() - t0, size * g.k * len(mine))
            raw = pack_envelope(
                {
                    "magic": PARITY_MAGIC,
                    "format_version": FORMAT_VERSION,
                    "session": self.store.session,
                    "iteration": header.iteration,
                    "holder": self.rank,
                    "world_size": header.world_size,
                    "members": list(g.members),
                    "m": g.m,
                    "code": g.code,
                    "block_nbytes": size,
                    "member_nbytes": {r: n for r, n in sizes.items()},
                    "blocks": blocks,
                    "data_digests": data_digests,
                    "member_headers": headers,
                    "created_ns": time.time_ns(),
                    "writer": writer_name(),
                }
            )
            self.store.claim_parity(seg, pid)
            seg.close()
            self.store.write_parity_header(raw, pid)
        except BaseException:
            seg.close()
            if seg.path == self.store.data_path(pid):
                self.store.discard(pid)
            else:
                self.store.release(seg)
            raise
        return pid

    def _blocks_nothing(self, why: str, targets=None) -> None:
        g, me = self.group, self.me
        targets = set(g.members) if targets is None else targets
        out = [
            Outgoing(g.members[h], b"", _EMPTY)
            for s in g.data_stripes(me)
            for h in g.holders(s)
            if g.members[h] in targets
        ]
        mine = g.parity_stripes(me) if self.rank in targets else ()
        inc = [Incoming(g.members[j], _refuse(why)) for s, _ in mine for j in g.data_members(s)]
        try:
            self.transport.exchange(out, inc)
        except ReplicationError as e:  # expected: our refusals come back as errors
            logger.debug("parity exchange after a failure: %s", e)

    def abstain(self) -> None:
        """This rank's save failed: empty headers and blocks out, refusals in (both exchanges)."""
        why = f"rank {self.rank}'s own save failed"
        try:
            self.transport.exchange(
                [Outgoing(r, b"", _EMPTY) for r in self._others],
                [Incoming(r, _refuse(why)) for r in self._others],
            )
        except ReplicationError as e:
            logger.debug("parity header exchange after a failure: %s", e)
        self._blocks_nothing(why)


# ---- restore ---------------------------------------------------------------------------------


@dataclass
class RebuildReport:
    """What :func:`rebuild_lost` did on this rank."""

    rebuilt: List[int] = field(default_factory=list)  # owners decoded into this rank's store
    bytes_in: int = 0
    seconds: float = 0.0
    attempts: int = 1


def rebuild_lost(
    store: CheckpointStore,
    transport: Optional[P2PTransport],
    groups: Sequence[ParityGroup],
    iteration: int,
    data_at: Mapping[int, int],
    parity_at: Mapping[int, int],
    block_sizes: Mapping[int, int],
    me: int,
    control,
) -> RebuildReport:
    """Decode every lost owner's checkpoint of ``iteration`` into that owner rank's store
    (collective: every rank calls it with the same facts). ``data_at``: owner -> a rank whose
    store holds its data; ``parity_at``: holder -> a rank whose store holds its parity file;
    ``block_sizes``: a group's first member -> its block size (from its parity headers).
    Raises, with the same words on every rank, :class:`.parity.Unrecoverable` when a group
    lost more than it tolerates (also once shares failed verification), and
    CorruptCheckpointError when decoded data fails its checksums."""
    t0 = time.perf_counter()
    bad: List[Tuple[int, int, int]] = []  # (group's first member, stripe, share number)
    report = RebuildReport()
    for attempt in range(1, MAX_ATTEMPTS + 1):
        plans = _plans(groups, data_at, parity_at, bad)
        if not plans:
            break
        local: Optional[BaseException] = None
        found: dict = {"bad": [], "wrong": []}
        try:
            found, report.rebuilt, report.bytes_in = _run(
                store, transport, plans, iteration, data_at, parity_at, block_sizes, me
            )
        except Exception as e:  # a dead peer, an unusable store: every rank stops together
            local = e
        gathered = collectives.gather_or_fail(
            found, local, f"rebuilding iteration {iteration} from parity", control
        )
        new_bad = sorted({tuple(b) for per in gathered for b in per["bad"]})
        wrong = sorted({w for per in gathered for w in per["wrong"]})
        report.attempts = attempt
        if wrong or new_bad:
            for r in report.rebuilt:
                store.discard(CheckpointId(iteration, r, store.session))
            report.rebuilt = []
        if wrong:
            raise CorruptCheckpointError(
                f"iteration {iteration}: the data of ranks {wrong} decoded from parity fails its "
                "checksums (a share was corrupted without its digest noticing); not restored"
            )
        if not new_bad:
            break
        logger.warning(
            "iteration %d: parity shares (group, stripe, share) %s failed verification; re-planning without them",
            iteration,
            new_bad,
        )
        bad += [tuple(b) for b in new_bad]
    else:
        raise Unrecoverable(f"iteration {iteration}: no consistent rebuild after {MAX_ATTEMPTS} attempts")
    report.seconds = time.perf_counter() - t0
    return report


def _plans(groups, data_at, parity_at, bad) -> List[Rebuild]:
    out: List[Rebuild] = []
    for g in groups:
        if all(r in data_at for r in g.members):
            continue
        out += plan_rebuild(
            g,
            {i: r in data_at for i, r in enumerate(g.members)},
            {i: r in parity_at for i, r in enumerate(g.members)},
            [(s, n) for first, s, n in bad if first == g.members[0]],
        )
    return out


def _source(share: Share, g: ParityGroup, data_at, parity_at) -> int:
    r = g.members[share.member]
    return parity_at[r] if share.parity else data_at[r]


class _Sources:
    """This rank's store files serving shares: read-only mappings, kept until the rebuild
    ends (views of them are in flight)."""

    def __init__(self, store: CheckpointStore, iteration: int):
        self.store = store
        self.iteration = iteration
        self._data: Dict[int, Tuple[CheckpointHeader, torch.Tensor]] = {}
        self._parity: Dict[int, Tuple[dict, torch.Tensor]] = {}
        self._maps: list = []

    def _map(self, path, nbytes: int) -> torch.Tensor:
        m, buf = map_readonly(path, nbytes, populate=True)  # one kernel pass, not a fault per page
        self._maps.append(m)
        return buf

    def data(self, owner: int):
        if owner not in self._data:
            reader = self.store.open(CheckpointId(self.iteration, owner, self.store.session))
            self._data[owner] = (reader.header, self._map(reader.path, reader.header.data_nbytes))
        return self._data[owner]

    def parity(self, holder: int):
        if holder not in self._parity:
            pid = ParityId(self.iteration, holder, self.store.session)
            meta = self.store.read_parity_header(pid)
            n = len(meta["blocks"]) * int(meta["block_nbytes"])
            self._parity[holder] = (meta, self._map(self.store.data_path(pid), n))
        return self._parity[holder]


def _serve(src: _Sources, share: Share, g: ParityGroup, dest: int, with_header: bool, size: int) -> Outgoing:
    """The Outgoing carrying ``share`` (blocks of ``size`` bytes) to ``dest``; an empty header
    when it cannot be read."""
    r = g.members[share.member]
    try:
        if not share.parity:
            header, buf = src.data(r)
            return Outgoing(dest, _DATA_MARK, _block(buf, header.data_nbytes, share.block, size))
        meta, buf = src.parity(r)
        if int(meta["block_nbytes"]) != size or list(meta["members"]) != list(g.members):
            raise CorruptCheckpointError(f"parity file of rank {r} describes another group layout")
        entry = next(b for b in meta["blocks"] if b[0] == share.stripe and b[1] == share.block)
        digests = {n: d for s, n, d in meta["data_digests"] if s == share.stripe}
        digests[share.number] = entry[3]
        info = {"digests": digests}
        if with_header:
            info["header"] = meta["member_headers"].get(dest)
        return Outgoing(dest, msgpack.packb(info, use_bin_type=True), buf[entry[2] : entry[2] + size])
    except (StoreError, OSError, KeyError, TypeError, StopIteration) as e:
        logger.warning("cannot serve share %s of rank %d for rebuilding rank %d: %s", share, r, dest, e)
        return Outgoing(dest, b"", _EMPTY)


def _run(store, transport, plans: List[Rebuild], iteration: int, data_at, parity_at, block_sizes, me: int):
    """Every step of every plan on this rank. Returns ({"bad": shares failing verification
    here, "wrong": owners whose decoded data failed its checksums}, owners rebuilt here,
    bytes received)."""
    sources = _Sources(store, iteration)
    states = {
        p.rank: _Target(store, iteration, p, block_sizes[p.group.members[0]]) for p in plans if p.rank == me
    }
    steps = max(len(p.stripes) for p in plans)
    bad: List[List[int]] = []
    received = 0
    try:
        for t in range(steps):
            outgoing, incoming = _step(t, plans, sources, states, data_at, parity_at, block_sizes, me)
            if outgoing or incoming:
                if transport is None:
                    raise ReplicationError("rebuilding from parity needs the checkpoint group")
                received += transport.exchange(outgoing, incoming).bytes_received
            del outgoing
            for st in states.values():
                if t < len(st.plan.stripes):
                    bad += st.decode(t, st.take())
        wrong = [r for r, st in states.items() if not bad and not st.verified()]
        rebuilt = [r for r, st in states.items() if not bad and not wrong and st.publish()]
        if bad or wrong:
            for st in states.values():
                st.undo()
    except BaseException:
        for st in states.values():
            st.undo()
        raise
    return {"bad": bad, "wrong": wrong}, rebuilt, received


def _step(t: int, plans: List[Rebuild], sources: _Sources, states, data_at, parity_at, block_sizes, me: int):
    """Step ``t`` of the rebuild on this rank: what it sends (the shares its store holds for
    the lost owners' ``t``-th stripes) and receives (those of its own lost data)."""
    outgoing, incoming = [], []
    for p in plans:
        if t >= len(p.stripes):
            continue
        s, shares = p.stripes[t]
        size = block_sizes[p.group.members[0]]
        first_parity = next(sh.number for sh in shares if sh.parity)
        for sh in shares:
            src = _source(sh, p.group, data_at, parity_at)
            with_header = t == 0 and sh.number == first_parity
            if src == me and p.rank != me:
                outgoing.append(_serve(sources, sh, p.group, p.rank, with_header, size))
            elif p.rank == me and src != me:
                incoming.append(Incoming(src, states[me].landing(sh, t)))
            elif p.rank == me:  # a share in this rank's own store
                states[me].local(sh, _serve(sources, sh, p.group, me, with_header, size))
    return outgoing, incoming


class _Target:
    """One lost owner being decoded on this rank: shares land in scratch (one stripe at a
    time), each stripe's block is decoded into a segment of this rank's store, published once
    every tensor checksum holds."""

    def __init__(self, store: CheckpointStore, iteration: int, plan: Rebuild, size: int):
        self.store = store
        self.iteration = iteration
        self.plan = plan
        self.g = plan.group
        self.size = size
        self.got: Dict[int, Tuple[bytes, torch.Tensor]] = {}
        #: receive buffers per share slot, reused by every step (fresh pages cost several
        #: times a copy: fault them once, not once per stripe)
        self.scratch: Dict[int, torch.Tensor] = {}
        self.header_raw: Optional[bytes] = None
        self.header: Optional[CheckpointHeader] = None
        self.segment: Optional[Segment] = None

    def landing(self, share: Share, t: int):
        key = len(self.got)
        got = self.got
        got[share.number] = (b"", _EMPTY)  # until it lands

        def allocate(hdr: bytes, nbytes: int) -> torch.Tensor:
            buf = self.scratch.get(key)
            if buf is None or buf.numel() != nbytes:
                buf = self.scratch[key] = torch.empty(nbytes, dtype=torch.uint8)
            got[share.number] = (hdr, buf)
            return buf

        return allocate

    def take(self) -> Dict[int, Tuple[bytes, torch.Tensor]]:
        """This step's shares (received and local), handed to its decode."""
        got, self.got = self.got, {}
        return got

    def local(self, share: Share, out: Outgoing) -> None:
        self.got[share.number] = (out.header, out.payload)

    def decode(self, t: int, got: Dict[int, Tuple[bytes, torch.Tensor]]) -> List[List[int]]:
        """Decode step ``t``'s block from its shares; returns those that failed verification."""
        s, shares = self.plan.stripes[t]
        first, size = self.g.members[0], self.size
        digests: Dict[int, int] = {}
        for sh in shares:
            hdr = got.get(sh.number, (b"",))[0]
            if sh.parity and hdr:
                info = msgpack.unpackb(hdr, raw=False, strict_map_key=False)
                digests.update({int(n): d for n, d in info["digests"].items()})
                if info.get("header") and self.header is None:
                    self.header_raw = bytes(info["header"])
                    self.header = CheckpointHeader.unpack(
                        self.header_raw, source="header rebuilt from parity"
                    )
        bad, blocks = [], {}
        for sh in shares:
            hdr, buf = got.get(sh.number, (b"", _EMPTY))
            ok = bool(hdr) and buf.numel() == size and sh.number in digests
            if ok and size and checksum.digest(checksum.byte_view(buf)) != digests[sh.number]:
                ok = False
            if not ok:
                bad.append([first, s, sh.number])
            blocks[sh.number] = buf
        if bad:
            return bad
        if self.header is None:  # the share that carries it failed: count it as bad
            return [[first, s, next(sh.number for sh in shares if sh.parity)]]
        h = self.header
        if self.segment is None:  # not populated: decoding writes every page once
            self.segment = self.store.allocate(self.iteration, h.owner, h.data_nbytes, populate=False)
        b = self.g.data_stripes(self.plan.member).index(s)
        lo, hi = b * size, min((b + 1) * size, h.data_nbytes)
        if hi > lo:
            want = self.g.data_members(s).index(self.plan.member)
            out = self.segment.buffer[lo:hi] if hi - lo == size else torch.empty(size, dtype=torch.uint8)
            erasure.decode(self.g.k, self.g.m, blocks, want, out)
            if out.data_ptr() != self.segment.buffer[lo:hi].data_ptr():
                self.segment.buffer[lo:hi].copy_(out[: hi - lo])
        return []

    def verified(self) -> bool:
        h = self.header
        if h is None:
            return False
        if self.segment is None:  # no data bytes at all
            self.segment = self.store.allocate(self.iteration, h.owner, h.data_nbytes)
        mv = checksum.byte_view(self.segment.buffer) if h.data_nbytes else memoryview(b"")
        return not failed_tensors(h, mv)

    def publish(self) -> bool:
        assert self.segment is not None and self.header_raw is not None and self.header is not None
        self.segment.close()
        self.segment = None
        self.store.write_raw_header(self.header_raw, self.header.id)
        return True

    def undo(self) -> None:
        if self.segment is not None:
            self.segment.close()
            self.segment = None
            self.store.discard(CheckpointId(self.iteration, self.plan.rank, self.store.session))


__all__ = ["EncodeStats", "ParityReplicator", "RebuildReport", "rebuild_lost", "Unrecoverable"]
