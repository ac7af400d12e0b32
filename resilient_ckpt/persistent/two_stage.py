"""Two-stage data-parallel load: each stored entry is read by one rank of the group and
broadcast to the others that need it.

Planning is pure and the same on every rank: every rank plans its own reads (resharding as
DCP does, :func:`_plan_local_reads`), the group gathers what each needs, and
:func:`plan_two_stage` splits the union of stored entries among the ranks that need them,
balanced by bytes (:func:`distribution.assign_shards`), in one global order.

Execution has two stages running side by side on each rank:

1. :class:`_ReadAhead`: a reader thread (``resilient_ckpt-two-stage``) reads this rank's
   entries in order, at most ``read_ahead_bytes`` ahead of their use;
2. :class:`_Exchange`: the main thread walks the global order, broadcasting each entry from
   its reader and copying what this rank needs out of it. An entry only one rank needs is
   read by it and not sent; where a rank needs a stored chunk whole in one contiguous tensor,
   the chunk is read or received straight into it (:func:`_direct_destinations`).

Local failures are recorded and every rank keeps taking part in every broadcast, so no peer
is left waiting; the group raises together at the end.
"""

from __future__ import annotations

import io
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader

from ..bits import copy_bits
from ..errors import CheckpointingException, CorruptCheckpointError
from ..parallel import collectives
from ..parallel.distribution import assign_shards
from .load_planner import PassiveLoadPlanner, ResilientLoadPlanner, narrow, value_read_item
from .storage import StoredKey, stored_lengths

DEFAULT_READ_AHEAD_BYTES = 256 << 20


@dataclass
class TwoStageStats:
    """What one rank did in a two-stage load."""

    entries_read: int = 0
    bytes_read: int = 0  # stored bytes this rank read
    bytes_broadcast: int = 0  # tensor bytes this rank sent
    entries_total: int = 0
    seconds: float = 0.0
    read_seconds: float = 0.0


@dataclass(frozen=True)
class StoredEntry:
    """One stored entry the group needs: who reads it, who needs it, what it holds."""

    #: (fqn, chunk offsets) of a tensor chunk, (fqn, None) of a value
    key: StoredKey
    #: bytes it weighs in the balance and the read-ahead budget (at least 1)
    nbytes: int
    #: group rank reading it from storage
    reader: int
    #: group ranks that need it, in rank order
    needers: Tuple[int, ...]
    #: a tensor chunk's position among its tensor's stored chunks, and the chunk
    chunk_index: Optional[int] = None
    chunk: Optional[ChunkStorageMetadata] = None
    dtype: Optional[torch.dtype] = None

    @property
    def is_value(self) -> bool:
        return self.key[1] is None


def _key_order(k: StoredKey):
    return (k[0], () if k[1] is None else tuple(k[1]), k[1] is None)


# ---- planning (pure) ---------------------------------------------------------------------------


@dataclass
class _LocalReads:
    """This rank's own plan: the read items per stored entry, or why it could not plan."""

    metadata: Optional[Metadata]
    items: Dict[StoredKey, List[ReadItem]]
    error: Optional[BaseException] = None


def _plan_local_reads(
    state_dict: Dict[str, Any],
    reader: StorageReader,
    planner: ResilientLoadPlanner,
    metadata: Optional[Metadata],
    me: int,
) -> _LocalReads:
    """Plan this rank's reads as a DCP load would (errors kept, not raised: the group learns
    of them at the next step)."""
    mine: Dict[StoredKey, List[ReadItem]] = {}
    try:
        if metadata is None:
            metadata = reader.read_metadata()
        planner.set_up_planner(state_dict, metadata, me == 0)
        reader.set_up_storage_reader(metadata, me == 0)
        plan = planner.finish_plan(planner.create_local_plan())
        for ri in plan.items:
            idx = ri.storage_index
            key = (idx.fqn, None if ri.type == LoadItemType.BYTE_IO else tuple(idx.offset))
            mine.setdefault(key, []).append(ri)
    except BaseException as e:
        return _LocalReads(metadata, mine, e)
    return _LocalReads(metadata, mine)


def _gather_needs(local: _LocalReads, group: Optional[dist.ProcessGroup], n: int) -> List[List[StoredKey]]:
    """Every group rank's needed entries (collective); raises on every rank if any failed."""
    local_exc = local.error
    payload = {
        "err": "" if local_exc is None else f"{type(local_exc).__name__}: {local_exc}",
        "need": [[k[0], None if k[1] is None else list(k[1])] for k in sorted(local.items, key=_key_order)],
    }
    gathered = collectives.all_gather_msgpack(payload, group) if n > 1 else [payload]
    bad = [(r, g["err"]) for r, g in enumerate(gathered) if g["err"]]
    if bad:
        if local_exc is not None:
            raise local_exc
        raise CheckpointingException(
            f"two-stage load failed on group rank {bad[0][0]}, so every rank stops: {bad[0][1]}"
        )
    return [[(fqn, None if off is None else tuple(off)) for fqn, off in g["need"]] for g in gathered]


def _chunk_index(metadata: Metadata, fqn: str) -> Dict[Tuple[int, ...], Tuple[int, ChunkStorageMetadata]]:
    return {tuple(c.offsets): (i, c) for i, c in enumerate(metadata.state_dict_metadata[fqn].chunks)}


def plan_two_stage(
    needs: Sequence[Sequence[StoredKey]], metadata: Metadata, num_ranks: int
) -> List[StoredEntry]:
    """Which rank reads each stored entry the group needs, in the global order every rank
    walks (pure: every rank computes the same plan from the gathered needs)."""
    holders: Dict[Tuple[str, Tuple[int, ...]], List[int]] = {}
    kinds: Dict[Tuple[str, Tuple[int, ...]], StoredKey] = {}
    sizes: Dict[Tuple[str, Tuple[int, ...]], int] = {}
    chunks: Dict[StoredKey, Tuple[int, ChunkStorageMetadata]] = {}
    stored = stored_lengths(metadata)
    indexed: Dict[str, Dict[Tuple[int, ...], Tuple[int, ChunkStorageMetadata]]] = {}
    for r, keys in enumerate(needs):
        for key in keys:
            fqn, off = key
            # assign_shards sorts its keys: offsets () stand for a value's None
            sid = (fqn, () if off is None else off)
            if sid not in holders:
                holders[sid], kinds[sid] = [], key
                if off is None:
                    sizes[sid] = max(1, stored.get(key, 0))
                else:
                    at = indexed.setdefault(fqn, _chunk_index(metadata, fqn)).get(off)
                    if at is None:
                        raise CorruptCheckpointError(f"{fqn!r}: no stored chunk at offset {list(off)}")
                    chunks[key] = at
                    itemsize = metadata.state_dict_metadata[fqn].properties.dtype.itemsize
                    sizes[sid] = max(1, _numel(at[1].sizes) * itemsize)
            holders[sid].append(r)
    readers = assign_shards(holders, sizes, num_ranks) if holders else {}
    return [
        _entry(kinds[sid], sizes[sid], readers[sid], holders[sid], chunks.get(kinds[sid]), metadata)
        for sid in sorted(holders, key=lambda s: _key_order(kinds[s]))
    ]


def _entry(
    key: StoredKey,
    nbytes: int,
    reader: int,
    needers: List[int],
    at: Optional[Tuple[int, ChunkStorageMetadata]],
    metadata: Metadata,
) -> StoredEntry:
    if at is None:
        return StoredEntry(key, nbytes, reader, tuple(needers))
    dtype = metadata.state_dict_metadata[key[0]].properties.dtype
    return StoredEntry(key, nbytes, reader, tuple(needers), at[0], at[1], dtype)


def _numel(sizes) -> int:
    n = 1
    for s in sizes:
        n *= int(s)
    return n


def _direct_destinations(
    entries: Sequence[StoredEntry],
    mine: Dict[StoredKey, List[ReadItem]],
    planner: LoadPlanner,
    me: int,
    dev: torch.device,
) -> Dict[StoredKey, torch.Tensor]:
    """Entries this rank needs whole, in one contiguous destination on the device the data
    arrives on: read or received straight into it (no staging buffer, no extra copy)."""
    direct: Dict[StoredKey, torch.Tensor] = {}
    for e in entries:
        items = mine.get(e.key) if not e.is_value else None
        if not items or len(items) != 1:
            continue
        ri = items[0]
        if any(o != 0 for o in ri.storage_offsets) or tuple(ri.lengths) != tuple(e.chunk.sizes):
            continue
        dest = planner.resolve_tensor(ri)
        want = torch.device("cpu") if e.reader == me else dev
        if dest.is_contiguous() and dest.device == want and dest.dtype == e.dtype:
            direct[e.key] = dest
    return direct


# ---- stage 1: reading ahead ------------------------------------------------------------------


class _BufferPlanner(PassiveLoadPlanner):
    """Reads whole stored entries into fresh buffers (the first stage of a two-stage load)."""

    def __init__(self, pin: bool):
        self.pin = pin
        self.tensor: Optional[torch.Tensor] = None
        self.raw: Optional[bytes] = None
        self._shape: Tuple[int, ...] = ()
        self._dtype = torch.uint8

    def expect(self, dtype: torch.dtype, shape: Tuple[int, ...], out: Optional[torch.Tensor] = None) -> None:
        self._dtype, self._shape = dtype, shape
        self.tensor = out if out is not None else torch.empty(shape, dtype=dtype, pin_memory=self.pin)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.raw = value.getvalue()

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        return self.tensor

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass


def _read_entry(
    reader: StorageReader, entry: StoredEntry, pin: bool, out: Optional[torch.Tensor] = None
) -> Any:
    """One whole stored entry: its bytes (a value) or a tensor of the chunk (into ``out``)."""
    planner = _BufferPlanner(pin)
    if entry.is_value:
        reader.read_data(LoadPlan([value_read_item(entry.key[0])]), planner).wait()
        return planner.raw or b""
    fqn, off = entry.key
    planner.expect(entry.dtype, tuple(entry.chunk.sizes), out)
    zeros = torch.Size([0] * len(off))
    item = ReadItem(
        type=LoadItemType.TENSOR,
        dest_index=MetadataIndex(fqn, off),
        dest_offsets=zeros,
        storage_index=MetadataIndex(fqn, off, entry.chunk_index),
        storage_offsets=zeros,
        lengths=torch.Size(entry.chunk.sizes),
    )
    reader.read_data(LoadPlan([item]), planner).wait()
    return planner.tensor


class _ReadAhead:
    """A thread reading this rank's entries in order, at most ``budget_bytes`` of them read
    and not yet used (one entry always goes, however large)."""

    def __init__(
        self,
        reader: StorageReader,
        entries: List[StoredEntry],
        direct: Dict[StoredKey, torch.Tensor],
        budget_bytes: int,
        stats: TwoStageStats,
    ):
        self._reader = reader
        self._entries = entries
        self._direct = direct
        self._budget_bytes = budget_bytes
        self._stats = stats
        self._pin = torch.cuda.is_available()
        self._results: "queue.Queue[Tuple[Any, Optional[BaseException]]]" = queue.Queue()
        self._budget = threading.Condition()
        self._in_flight = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="resilient_ckpt-two-stage", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def next(self) -> Tuple[Any, Optional[BaseException]]:
        """The next entry's data, or the error reading it raised."""
        return self._results.get()

    def release(self, nbytes: int) -> None:
        """An entry was used: its bytes no longer count against the budget."""
        with self._budget:
            self._in_flight -= nbytes
            self._budget.notify_all()

    def stop(self) -> None:
        self._stop.set()
        with self._budget:
            self._budget.notify_all()
        self._thread.join(timeout=60)

    def _run(self) -> None:
        for e in self._entries:
            with self._budget:
                while (
                    self._in_flight > 0
                    and self._in_flight + e.nbytes > self._budget_bytes
                    and not self._stop.is_set()
                ):
                    self._budget.wait(0.5)
                self._in_flight += e.nbytes
            if self._stop.is_set():
                return
            t = time.perf_counter()
            try:
                self._results.put((_read_entry(self._reader, e, self._pin, self._direct.get(e.key)), None))
            except BaseException as exc:
                self._results.put((None, exc))
            self._stats.read_seconds += time.perf_counter() - t


# ---- stage 2: broadcasting and copying out --------------------------------------------------------


def _broadcast_bytes(raw: bytes, src_global: int, group, dev: torch.device, is_src: bool) -> bytes:
    n = torch.tensor([len(raw) if is_src else 0], dtype=torch.int64, device=dev)
    dist.broadcast(n, src_global, group=group)
    size = int(n.item())
    if is_src:
        buf = (
            torch.frombuffer(bytearray(raw), dtype=torch.uint8) if size else torch.empty(0, dtype=torch.uint8)
        )
        buf = buf.to(dev)
    else:
        buf = torch.empty(size, dtype=torch.uint8, device=dev)
    if size:
        dist.broadcast(buf, src_global, group=group)
    return raw if is_src else buf.cpu().numpy().tobytes()


def _apply_bytes(planner: LoadPlanner, items: Sequence[ReadItem], raw: bytes) -> None:
    for ri in items:
        planner.load_bytes(ri, io.BytesIO(raw))


def _apply_tensor(planner: LoadPlanner, items: Sequence[ReadItem], chunk: torch.Tensor) -> None:
    for ri in items:
        src = narrow(chunk, ri.storage_offsets, ri.lengths)
        dest = planner.resolve_tensor(ri)
        copy_bits(dest, src)
        planner.commit_tensor(ri, dest)


class _Exchange:
    """Stage 2 on one rank: every entry in the global order, broadcast from its reader and
    copied into this rank's destinations. The first local failure is kept in
    ``first_error`` (later entries are still broadcast, not applied)."""

    def __init__(
        self,
        planner: LoadPlanner,
        mine: Dict[StoredKey, List[ReadItem]],
        direct: Dict[StoredKey, torch.Tensor],
        group: Optional[dist.ProcessGroup],
        me: int,
        dev: torch.device,
        stats: TwoStageStats,
    ):
        self.planner = planner
        self.mine = mine
        self.direct = direct
        self.group = group
        self.me = me
        self.dev = dev
        self.stats = stats
        self.first_error: Optional[BaseException] = None

    def run(self, entries: Sequence[StoredEntry], ahead: _ReadAhead, stored: Dict[StoredKey, int]) -> None:
        for e in entries:
            data = None
            if e.reader == self.me:
                data, err = ahead.next()
                self._fail(err)
                self.stats.entries_read += 1
                self.stats.bytes_read += stored.get(e.key, 0)
            if e.is_value:
                self._share_value(e, data)
            else:
                self._share_chunk(e, data)
            if e.reader == self.me:
                ahead.release(e.nbytes)

    def _fail(self, err: Optional[BaseException]) -> None:
        if err is not None and self.first_error is None:
            self.first_error = err

    def _src(self, e: StoredEntry) -> int:
        return collectives.global_rank(self.group, e.reader)

    def _share_value(self, e: StoredEntry, data: Optional[bytes]) -> None:
        is_src = e.reader == self.me
        raw = data if is_src else None
        if len(e.needers) > 1:
            raw = _broadcast_bytes(
                raw if raw is not None else b"", self._src(e), self.group, self.dev, is_src
            )
        if self.me in e.needers and raw is not None and self.first_error is None:
            try:
                _apply_bytes(self.planner, self.mine[e.key], raw)
            except Exception as exc:
                self.first_error = exc

    def _share_chunk(self, e: StoredEntry, data: Optional[torch.Tensor]) -> None:
        is_src = e.reader == self.me
        buf = None
        if is_src:
            # A failed read still takes its turn in the broadcast (zeros): the peers wait for it,
            # and the whole load fails together at the end.
            buf = data if data is not None else torch.zeros(tuple(e.chunk.sizes), dtype=e.dtype)
        if len(e.needers) > 1:
            buf = self._broadcast_chunk(e, buf)
        if self.me in e.needers and self.first_error is None:
            try:
                direct = self.direct.get(e.key)
                if direct is not None and buf is direct:
                    self.planner.commit_tensor(self.mine[e.key][0], buf)  # already in place
                else:
                    _apply_tensor(self.planner, self.mine[e.key], buf)
            except Exception as exc:
                self.first_error = exc

    def _broadcast_chunk(self, e: StoredEntry, buf: Optional[torch.Tensor]) -> torch.Tensor:
        if e.reader == self.me:
            send = buf.to(self.dev) if buf.device != self.dev else buf
            self.stats.bytes_broadcast += send.numel() * send.element_size()
        elif e.key in self.direct:
            send = self.direct[e.key]
        else:
            send = torch.empty(tuple(e.chunk.sizes), dtype=e.dtype, device=self.dev)
        dist.broadcast(send, self._src(e), group=self.group)
        return buf if e.reader == self.me else send


# ---- the load -----------------------------------------------------------------------------------


def two_stage_load(
    state_dict: Dict[str, Any],
    reader: StorageReader,
    group: Optional[dist.ProcessGroup],
    *,
    planner: Optional[ResilientLoadPlanner] = None,
    metadata: Optional[Metadata] = None,
    read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
) -> TwoStageStats:
    """Load ``state_dict`` with each stored entry read by one rank of ``group`` (collective).

    Every rank plans its own reads (resharding as DCP does); the union of stored entries the
    group needs is split among the ranks that need them, balanced by bytes
    (:func:`distribution.assign_shards`). A reader thread per rank (``resilient_ckpt-two-stage``)
    reads its entries ahead, at most ``read_ahead_bytes`` in flight, while the main thread
    broadcasts entries in a fixed global order and copies what it needs out of each; an entry
    only one rank needs is read by it and not sent. Memory: the read-ahead plus one entry in
    transit. Errors (a missing file, a bad key) surface on every rank of the group together.
    """
    t0 = time.perf_counter()
    planner = planner or ResilientLoadPlanner()
    n = collectives.group_size(group)
    me = collectives.group_rank(group)
    stats = TwoStageStats()
    local = _plan_local_reads(state_dict, reader, planner, metadata, me)
    needs = _gather_needs(local, group, n)
    entries = plan_two_stage(needs, local.metadata, n)
    stats.entries_total = len(entries)
    dev = collectives.comm_device(group) if n > 1 else torch.device("cpu")
    direct = _direct_destinations(entries, local.items, planner, me, dev)
    ahead = _ReadAhead(reader, [e for e in entries if e.reader == me], direct, read_ahead_bytes, stats)
    exchange = _Exchange(planner, local.items, direct, group, me, dev, stats)
    ahead.start()
    try:
        exchange.run(entries, ahead, stored_lengths(local.metadata))
    except BaseException as e:
        exchange.first_error = exchange.first_error or e
        raise
    finally:
        ahead.stop()
    collectives.fail_together(exchange.first_error, "two-stage load", group if n > 1 else None)
    stats.seconds = time.perf_counter() - t0
    return stats
