"""Exchange on load: ranks receive the shards they need from the rank that holds them.

The plan is computed from what ranks actually hold (not re-derived from a distribution), so it
stays correct if the saving distribution changed. Only necessary transfers happen: a shard
needed only by its holder costs nothing, and ``p2p`` sends each shard only to the ranks that need
it. Small shards are coalesced into buckets of at most ``bucket_bytes`` (bounded scratch);
large contiguous shards move directly between source and destination tensors.

Algorithms:
- ``broadcast``: for each source rank, its needed shards are broadcast bucket by bucket to the
  group; good when most ranks need most shards (data-parallel replicas).
- ``p2p``: batched point-to-point sends of exactly what each receiver needs.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

import torch
import torch.distributed as dist

from ..bits import bits
from ..errors import CheckpointingException, ValidationError
from ..model.mapping import ShardId, dtype_name  # noqa: F401 (re-exported: the exchange names dtypes so)
from ..timing import PEERS, phase
from . import collectives

logger = logging.getLogger(__name__)

EXCHANGE_ALGOS = ("broadcast", "p2p")
DEFAULT_BUCKET_BYTES = 64 << 20


@dataclass(frozen=True)
class ShardSpec:
    """What the exchange needs to know about a shard to receive it."""

    shard_id: ShardId
    dtype: torch.dtype
    shape: Tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = self.dtype.itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class Transfer:
    shard_id: ShardId
    src: int
    dst: int
    nbytes: int


@dataclass(frozen=True)
class ExchangePlan:
    transfers: Tuple[Transfer, ...]
    specs: Mapping[ShardId, Tuple[str, Tuple[int, ...]]]

    def bytes_moved(self) -> int:
        return sum(t.nbytes for t in self.transfers)


def check_algo(exchange_algo: str) -> str:
    if exchange_algo in ("point_to_point", "p2p_batched"):
        return "p2p"
    # Megatron-core's all-gather based names: the same collective pattern as our broadcast.
    if exchange_algo in ("gather_rounds", "gather_object"):
        return "broadcast"
    if exchange_algo not in EXCHANGE_ALGOS:
        raise ValidationError(
            f"unknown exchange_algo {exchange_algo!r}; use one of {', '.join(EXCHANGE_ALGOS)}"
        )
    return exchange_algo


def plan_exchange(gathered: Sequence[dict]) -> Tuple[ExchangePlan, Dict[int, List[ShardId]]]:
    """Pure planning from every rank's ``{"held": [[key, off, dtype, shape]...], "need": [[key, off, ...]...]}``.

    Returns the plan and, per rank, the needed shard ids nobody holds (unexpected keys).
    Each shard has one source for all its receivers (so ``broadcast`` sends it once), chosen
    deterministically: the holder with the fewest bytes sent so far.
    """
    holders: Dict[ShardId, List[int]] = defaultdict(list)
    specs: Dict[ShardId, Tuple[str, Tuple[int, ...]]] = {}
    for rank, g in enumerate(gathered):
        for key, off, dtype, shape in g["held"]:
            sid = (key, tuple(off))
            holders[sid].append(rank)
            specs.setdefault(sid, (dtype, tuple(shape)))
    receivers: Dict[ShardId, List[int]] = {}
    absent: Dict[int, List[ShardId]] = defaultdict(list)
    for dst, g in enumerate(gathered):
        for key, off, *_template in g["need"]:
            sid = (key, tuple(off))
            hs = holders.get(sid)
            if not hs:
                absent[dst].append(sid)
            elif dst not in hs:
                receivers.setdefault(sid, []).append(dst)
    sent = defaultdict(int)
    transfers: List[Transfer] = []
    for sid, dsts in receivers.items():
        src = min(holders[sid], key=lambda r: (sent[r], r))
        dtype, shape = specs[sid]
        nbytes = _nbytes(dtype, shape)
        sent[src] += nbytes * len(dsts)
        transfers.extend(Transfer(sid, src, dst, nbytes) for dst in dsts)
    return ExchangePlan(tuple(transfers), specs), dict(absent)


def _nbytes(dtype: str, shape) -> int:
    n = getattr(torch, dtype).itemsize
    for s in shape:
        n *= s
    return n


def execute_exchange(
    plan: ExchangePlan,
    held: Mapping[ShardId, torch.Tensor],
    allocate,
    group: Optional[dist.ProcessGroup] = None,
    exchange_algo: str = "broadcast",
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> Dict[ShardId, torch.Tensor]:
    """Run ``plan``; returns the tensors this rank received, by shard id.

    ``allocate(shard_id, dtype, shape)`` makes the destination tensor for a received shard.
    Collective: every rank of ``group`` calls it with the same plan.
    """
    exchange_algo = check_algo(exchange_algo)
    me = collectives.group_rank(group)
    dev = collectives.comm_device(group) if dist.is_initialized() else torch.device("cpu")
    received: Dict[ShardId, torch.Tensor] = {}
    for t in plan.transfers:
        if t.dst == me and t.shard_id not in received:
            dtype, shape = plan.specs[t.shard_id]
            received[t.shard_id] = allocate(t.shard_id, getattr(torch, dtype), shape)
    if not plan.transfers:
        return received
    try:
        with phase(PEERS):
            if exchange_algo == "p2p":
                _run_p2p(plan, held, received, me, group, dev, bucket_bytes)
            else:
                _run_broadcast(plan, held, received, me, group, dev, bucket_bytes)
    except RuntimeError as e:
        raise CheckpointingException(
            f"shard exchange ({exchange_algo}) failed on rank {me}: {str(e).strip()[:400]} — a peer "
            "rank probably died; restart the job"
        ) from e
    return received


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.view(-1).view(torch.uint8) if t.dim() else t.reshape(1).view(torch.uint8)


#: shards at least this large move on their own, straight from the source tensor into the
#: destination tensor; smaller ones are coalesced into buckets (per-message overhead)
DIRECT_MIN_BYTES = 1 << 20


def _buckets(items: Sequence[Tuple[ShardId, int]], bucket_bytes: int) -> List[List[Tuple[ShardId, int]]]:
    """Group small (shard, nbytes) in order into buckets of at most ``bucket_bytes``."""
    out: List[List[Tuple[ShardId, int]]] = []
    cur: List[Tuple[ShardId, int]] = []
    size = 0
    for sid, n in items:
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((sid, n))
        size += n
    if cur:
        out.append(cur)
    return out


class _Scratch:
    """Bucket buffers reused for the whole exchange: one per (role, peer) slot, allocated once
    (fresh pages cost more than the copy), so scratch is bounded by slots x bucket size."""

    def __init__(self, dev: torch.device, bucket_bytes: int):
        self.dev = dev
        self.bucket_bytes = bucket_bytes
        self._bufs: Dict[Tuple[str, int], torch.Tensor] = {}

    def get(self, role: str, peer: int, n: int) -> torch.Tensor:
        buf = self._bufs.get((role, peer))
        if buf is None or buf.numel() < n:
            # Exactly what this bucket needs (later, larger buckets grow it): never more, since
            # under torch.use_deterministic_algorithms every allocation is also filled.
            buf = torch.empty(n, dtype=torch.uint8, device=self.dev)
            self._bufs[(role, peer)] = buf
        return buf[:n]


def _source_view(t: torch.Tensor, dev: torch.device) -> torch.Tensor:
    b = _as_bytes(t)
    return b if b.device == dev else b.to(dev)


def _direct_dest(dst: Optional[torch.Tensor], dev: torch.device) -> Optional[torch.Tensor]:
    if dst is not None and dst.device == dev and dst.is_contiguous():
        return _as_bytes(dst)
    return None


def _pack(bucket, held, buf: torch.Tensor) -> torch.Tensor:
    pos = 0
    for sid, n in bucket:
        buf[pos : pos + n].copy_(_as_bytes(held[sid]))
        pos += n
    return buf


def _unpack(buf: torch.Tensor, bucket, received) -> None:
    pos = 0
    for sid, n in bucket:
        dst = received.get(sid)
        if dst is not None and n:
            src = buf[pos : pos + n]
            if dst.is_contiguous():
                _as_bytes(dst).copy_(src)
            else:  # a strided destination: reinterpret the bytes, then copy element-wise
                bits(dst).copy_(src.clone().view(bits(dst).dtype).view(dst.shape))
        pos += n


def _wait_all(ops) -> None:
    if ops:
        for w in dist.batch_isend_irecv(ops):
            w.wait()


def _run_p2p(plan, held, received, me, group, dev, bucket_bytes) -> None:
    per_pair: Dict[Tuple[int, int], List[Tuple[ShardId, int]]] = defaultdict(list)
    for t in plan.transfers:
        if me in (t.src, t.dst):
            per_pair[(t.src, t.dst)].append((t.shard_id, t.nbytes))
    # 1. Large shards: every one of this rank's sends and receives posted in a single batch,
    #    in plan order per pair (gloo/NCCL match them in posting order): fully pipelined, no
    #    scratch, no copies on the comm device.
    ops, staged = [], []
    for (src, dst), items in sorted(per_pair.items()):
        peer = collectives.global_rank(group, dst if src == me else src)
        for sid, n in items:
            if n < DIRECT_MIN_BYTES:
                continue
            if src == me:
                ops.append(dist.P2POp(dist.isend, _source_view(held[sid], dev), peer, group))
            else:
                buf = _direct_dest(received.get(sid), dev)
                if buf is None:
                    buf = torch.empty(n, dtype=torch.uint8, device=dev)
                    staged.append((buf, [(sid, n)]))
                ops.append(dist.P2POp(dist.irecv, buf, peer, group))
    _wait_all(ops)
    for buf, bucket in staged:
        _unpack(buf, bucket, received)
    # 2. Small shards: bucket k of every pair in round k, through reused scratch buffers.
    scratch = _Scratch(dev, bucket_bytes)
    pair_buckets = {
        p: _buckets([(sid, n) for sid, n in items if n < DIRECT_MIN_BYTES], bucket_bytes)
        for p, items in per_pair.items()
    }
    rounds = max((len(b) for b in pair_buckets.values()), default=0)
    for k in range(rounds):
        ops, to_unpack = [], []
        for (src, dst), buckets in sorted(pair_buckets.items()):
            if k >= len(buckets):
                continue
            bucket = buckets[k]
            total = sum(n for _, n in bucket)
            if src == me:
                buf = _pack(bucket, held, scratch.get("send", dst, total))
                ops.append(dist.P2POp(dist.isend, buf, collectives.global_rank(group, dst), group))
            else:
                buf = scratch.get("recv", src, total)
                ops.append(dist.P2POp(dist.irecv, buf, collectives.global_rank(group, src), group))
                to_unpack.append((buf, bucket))
        _wait_all(ops)
        for buf, bucket in to_unpack:
            _unpack(buf, bucket, received)


def _run_broadcast(plan, held, received, me, group, dev, bucket_bytes) -> None:
    per_src: Dict[int, List[Tuple[ShardId, int]]] = defaultdict(list)
    seen = set()
    for t in plan.transfers:
        if (t.src, t.shard_id) not in seen:
            seen.add((t.src, t.shard_id))
            per_src[t.src].append((t.shard_id, t.nbytes))
    scratch = _Scratch(dev, bucket_bytes)
    for src in sorted(per_src):
        root = collectives.global_rank(group, src)
        items = per_src[src]
        for sid, n in items:
            if n < DIRECT_MIN_BYTES:
                continue
            if src == me:
                dist.broadcast(_source_view(held[sid], dev), root, group=group)
                continue
            buf = _direct_dest(received.get(sid), dev)
            if buf is None:
                buf = scratch.get("recv", -1, n)
                dist.broadcast(buf, root, group=group)
                _unpack(buf, [(sid, n)], received)
            else:
                dist.broadcast(buf, root, group=group)
        for bucket in _buckets([(sid, n) for sid, n in items if n < DIRECT_MIN_BYTES], bucket_bytes):
            total = sum(n for _, n in bucket)
            if src == me:
                dist.broadcast(_pack(bucket, held, scratch.get("send", -1, total)), root, group=group)
            else:
                buf = scratch.get("recv", -1, total)
                dist.broadcast(buf, root, group=group)
                _unpack(buf, bucket, received)
