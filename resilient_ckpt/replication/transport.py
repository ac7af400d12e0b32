"""Moving checkpoint bytes between trainer ranks over torch.distributed (embedded mode).

A checkpoint travels as a small header (msgpack bytes, opaque here) and one contiguous uint8
payload — on CPU usually a store segment mapped onto /dev/shm. For each transfer the wire
protocol is, in this order on the (sender, receiver) pair:

1. sizes: one int64 tensor ``[header_len, payload_len, chunk_bytes, sealed]`` (the sender's
   chunking, so ranks configured with different ``chunk_bytes`` still agree on message
   boundaries; ``sealed``: a final header follows the payload);
2. the header bytes (omitted when empty); the receiver then calls ``allocate(header, n)``;
3. the payload in chunks of ``chunk_bytes``;
4. only for sealed transfers, after the last chunk: the final header's length, then its bytes
   (the receiver's ``seal(final header)``). A save's first header then only announces the
   checkpoint (id and size) and the payload's checksums are computed while it is on the wire
   (issue 34: the checksum no longer delays the first byte).

Every rank posts all of its sends and receives of one step together (``batch_isend_irecv``),
so simultaneous A→B / B→A transfers and rings cannot deadlock on ordering. Payload chunks go
in rounds — round ``i`` carries chunk ``i`` of every transfer — which keeps both ends' ops
matched per pair. Two rounds are in flight: round ``i + 1`` is posted before round ``i`` is
waited for, so a link never idles at a round's end while the slowest transfer of the round
finishes (measured on 1 Gbit/s links, 4 nodes in a ring: the round barrier cost 7 % of the
transfer); device bounce memory is two chunks per transfer (three with gloo when receives
are staged, below).

With gloo every receive is posted before any send of the same chunk (issue 34): a gloo pair is
one TCP connection per pair of ranks, a send goes out only after the peer's "receive ready"
notification for it, and a rank's messages to a peer leave in the order posted — a
notification posted after a send whose payload is still being written waits behind that whole
payload. Two nodes replicating to each other then ran one direction after the other (2.1x the
link limit in most runs, by which rank posted first). So the receives of every round are
posted at the start, before the first send (one round ahead instead when received chunks go
through bounce buffers), and every step posts its receives first. NCCL fuses a round's sends
and receives in one batch and keeps that.

Zero copies on CPU with gloo: chunks are sent straight from slices of the payload tensor and
received straight into slices of the tensor ``allocate`` returned. When a tensor is not on the
group's communication device (a CPU segment with NCCL, a CUDA tensor with gloo) its chunks go
through a reusable bounce buffer on that device (pinned on the host side where CUDA exists).

A dead or stuck peer surfaces as :class:`ReplicationError` naming the peer and what was in
flight, after the connection error or the timeout — never a hang. After such an error the
group's state is undefined: create a new one with :func:`new_checkpoint_group`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from types import MappingProxyType
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple, Union, cast

import torch
import torch.distributed as dist

from ..errors import CheckpointingException, ReplicationError
from ..parallel import collectives

logger = logging.getLogger(__name__)

__all__ = [
    "Incoming",
    "Outgoing",
    "P2PTransport",
    "PeerStats",
    "TransferStats",
    "new_checkpoint_group",
]

_DEFAULT_TIMEOUT_S = 600.0


@dataclass(frozen=True)
class Outgoing:
    """Send ``header`` and ``payload`` (1-D uint8, CPU or CUDA) to rank ``dst``."""

    dst: int
    header: bytes
    payload: torch.Tensor = field(repr=False)
    #: called as ``on_chunk(offset, nbytes)`` once that part of the payload was sent (e.g. to
    #: drop a mapped segment's pages from this process's resident set)
    on_chunk: Optional[Callable[[int, int], None]] = field(default=None, repr=False)
    #: the final header, sent after the payload (step 4): called once the last chunk is on its
    #: way, so work it waits for (the payload's checksums) overlaps the transfer. An exception
    #: from it fails this exchange on both ends (an empty final header tells the receiver).
    seal: Optional[Callable[[], bytes]] = field(default=None, repr=False)
    #: called as ``ready(end)`` before the chunk ending at byte ``end`` is sent: blocks until
    #: the payload holds its bytes up to there (a save sends what is staged while the rest is
    #: still being copied). An exception from it is raised after the exchange; the chunks go
    #: out regardless, so peers stay in step — seal the transfer, so the receiver drops it.
    ready: Optional[Callable[[int], None]] = field(default=None, repr=False)


@dataclass(frozen=True)
class Incoming:
    """Receive one transfer from rank ``src``; ``allocate(header, nbytes)`` returns the 1-D
    uint8 tensor (usually a store segment) the payload is written into."""

    src: int
    allocate: Callable[[bytes, int], torch.Tensor] = field(repr=False)
    #: called as ``on_chunk(offset, nbytes)`` once that part of the payload landed
    on_chunk: Optional[Callable[[int, int], None]] = field(default=None, repr=False)
    #: called as ``seal(final header)`` when the sender sealed the transfer (step 4), after the
    #: last byte landed — with ``b""`` when the sender could not make it (the transfer then
    #: fails: raise what that means here); without it a sealed transfer is refused
    seal: Optional[Callable[[bytes], None]] = field(default=None, repr=False)


@dataclass(frozen=True)
class PeerStats:
    bytes_sent: int = 0
    bytes_received: int = 0


@dataclass(frozen=True)
class TransferStats:
    """What one :meth:`P2PTransport.exchange` moved (headers + payloads) and how long it took."""

    bytes_sent: int
    bytes_received: int
    seconds: float
    per_peer: Mapping[int, PeerStats]

    @property
    def gib_per_s(self) -> float:
        """Bytes sent plus received per second, in GiB/s."""
        total = self.bytes_sent + self.bytes_received
        return total / (1 << 30) / self.seconds if self.seconds > 0 else 0.0


def new_checkpoint_group(backend: Optional[str] = None, timeout_s: float = 120) -> dist.ProcessGroup:
    """A process group of all ranks reserved for checkpoint traffic.

    Its own communicator keeps replication from interleaving with (or waiting behind) training
    collectives. ``backend`` defaults to NCCL when the default group uses NCCL and CUDA exists,
    else gloo. Every rank must call this together, like ``dist.new_group``.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise ReplicationError(
            "new_checkpoint_group needs an initialized default process group; call "
            "torch.distributed.init_process_group first"
        )
    if not timeout_s or timeout_s <= 0:
        raise ReplicationError(f"timeout_s must be positive seconds, got {timeout_s!r}")
    if backend is None:
        default = str(dist.get_backend()).lower()
        backend = "nccl" if "nccl" in default and torch.cuda.is_available() else "gloo"
    if "nccl" in backend.lower() and not torch.cuda.is_available():
        raise ReplicationError(
            f"backend {backend!r} needs CUDA, which is not available here; use backend='gloo'"
        )
    group = dist.new_group(backend=backend, timeout=timedelta(seconds=timeout_s))
    collectives.note_timeout(group, timeout_s)
    if _comm_device(group).type == "cuda":
        # NCCL requires the first operation on a communicator to involve all its ranks; later
        # point-to-point batches may then involve any subset.
        dist.all_reduce(torch.zeros(1, device=_comm_device(group)), group=group)
    return group


def release_checkpoint_group(group: Optional[dist.ProcessGroup]) -> None:
    """Destroy a group :func:`new_checkpoint_group` made, once its owner is done with it (gloo
    keeps connections and threads per group until then: a job that made managers one after
    another ran out of threads). Best effort: a broken group may refuse."""
    if group is None or group is dist.GroupMember.WORLD or group == dist.GroupMember.NON_GROUP_MEMBER:
        return
    collectives.forget_timeout(group)
    try:
        dist.destroy_process_group(group)
    except Exception as e:  # already destroyed, or its connections broken
        logger.debug("checkpoint group not destroyed cleanly: %s", e)


def _comm_device(group: dist.ProcessGroup) -> torch.device:
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _group_timeout_s(group: dist.ProcessGroup, device: torch.device) -> float:
    try:
        return group._get_backend(device).options._timeout.total_seconds()
    except Exception:  # private API; fall back to torch's default for process groups
        return _DEFAULT_TIMEOUT_S


def _stats(transfers: Sequence[_Transfer], seconds: float) -> TransferStats:
    per_peer: Dict[int, PeerStats] = {}
    for t in transfers:
        p = per_peer.get(t.peer, PeerStats())
        n = len(t.header) + (0 if t.discard else t.nbytes)
        per_peer[t.peer] = (
            PeerStats(p.bytes_sent + n, p.bytes_received)
            if t.send
            else PeerStats(p.bytes_sent, p.bytes_received + n)
        )
    return TransferStats(
        bytes_sent=sum(p.bytes_sent for p in per_peer.values()),
        bytes_received=sum(p.bytes_received for p in per_peer.values()),
        seconds=seconds,
        per_peer=MappingProxyType(per_peer),
    )


def _mib(n: int) -> str:
    return f"{n / (1 << 20):.1f} MiB" if n >= 1 << 20 else f"{n} B"


@dataclass
class _Op:
    """One posted send/recv and how to describe it when it fails."""

    send: bool
    peer: int
    tensor: torch.Tensor
    what: str


@dataclass
class _Round:
    """One posted payload round: its index, ops, works and bounce buffers to copy out."""

    index: int
    step: str
    ops: List["_Op"]
    works: list
    unstage: List[Tuple[torch.Tensor, torch.Tensor]]


@dataclass
class _Transfer:
    peer: int
    send: bool
    header: bytes = b""
    header_len: int = 0
    payload: Optional[torch.Tensor] = None  # outgoing payload or incoming destination
    allocate: Optional[Callable[[bytes, int], torch.Tensor]] = None
    nbytes: int = 0
    chunk: int = 1
    discard: bool = False  # incoming whose allocate failed: drain into scratch, keep in sync
    index: int = 0  # position among this rank's sends / receives (bounce buffer slot)
    on_chunk: Optional[Callable[[int, int], None]] = None
    #: sender: makes the final header (step 4); receiver: takes it
    seal: Optional[Callable] = None
    sealed: bool = False  # a final header follows the payload (receivers learn it in step 1)
    ready: Optional[Callable[[int], None]] = None  # sender: see Outgoing.ready
    final: bytes = b""  # the final header sent or received (step 4)
    not_ready: Optional[BaseException] = None  # what ``ready`` raised

    def chunks(self) -> int:
        return -(-self.nbytes // self.chunk)


class P2PTransport:
    """Point-to-point byte mover for checkpoint replication over a torch.distributed group.

    ``group``: ideally from :func:`new_checkpoint_group` (default: the world group); peers are
    named by global rank. ``chunk_bytes``: payload message size and bounce-buffer size.
    ``timeout``: seconds one step (sizes, headers, one round of chunks) may take before the
    peer counts as stuck; default: the group's own timeout.
    """

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        chunk_bytes: int = 64 << 20,
        timeout: Optional[float] = None,
    ) -> None:
        if not dist.is_available() or not dist.is_initialized():
            raise ReplicationError(
                "P2PTransport needs an initialized process group; call "
                "torch.distributed.init_process_group (and new_checkpoint_group) first"
            )
        if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 1:
            raise ReplicationError(
                f"chunk_bytes must be a positive integer, got {chunk_bytes!r}; the default, "
                f"64 MiB, suits both gloo and NCCL"
            )
        if timeout is not None and not timeout > 0:
            raise ReplicationError(f"timeout must be positive seconds or None, got {timeout!r}")
        self.group = group if group is not None else dist.group.WORLD
        self.chunk_bytes = chunk_bytes
        self.device = _comm_device(self.group)
        self.timeout_s = float(timeout) if timeout is not None else _group_timeout_s(self.group, self.device)
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size(self.group)
        self._peers = set(dist.get_process_group_ranks(self.group))
        self._bounce: Dict[Tuple[str, int], torch.Tensor] = {}
        # Stage even tensors already on the communication device. Off in real use; tests turn
        # it on to exercise the bounce path (NCCL + host memory, gloo + CUDA) on CPU-only CI.
        self._stage_all = False
        # Payload rounds posted before the oldest is waited for (see the module docstring); 1
        # waits for each round before posting the next (measurements compare the two).
        self._rounds_in_flight = 2
        self._slots = self._rounds_in_flight  # bounce buffers per transfer (set per exchange)
        # gloo: receives posted before sends (see _receive_lead); False posts each round's
        # sends first, as before issue 34 (measurements compare the two)
        self._receives_ahead = True

    # ---------------------------------------------------------------------------------------
    def exchange(self, outgoing: Sequence[Outgoing], incoming: Sequence[Incoming]) -> TransferStats:
        """Send every ``outgoing`` and receive every ``incoming`` concurrently.

        Several transfers between the same two ranks are matched in list order. Returns byte
        counts and wall time. Raises :class:`ReplicationError` naming the peer on a dead or
        stuck peer; an exception from ``allocate`` is re-raised after the remaining transfers
        completed (its payload is drained and dropped, so the group stays in sync).
        """
        start = time.perf_counter()
        sends = [self._check_outgoing(i, o) for i, o in enumerate(outgoing)]
        recvs = [self._check_incoming(i, inc) for i, inc in enumerate(incoming)]
        self._exchange_sizes(sends, recvs)
        self._exchange_headers(sends + recvs)
        deferred = self._allocate_all(recvs)
        transfers = sends + recvs
        rounds = max([t.chunks() for t in transfers], default=0)
        lead = self._receive_lead(recvs, rounds)
        self._slots = self._rounds_in_flight + (lead > 0)
        ahead: Dict[int, _Round] = {}  # receive halves of rounds posted ahead of their sends
        next_recv = 0  # the first round whose receives are not posted yet
        posted: List[_Round] = []
        for i in range(rounds):  # round i = chunk i of every transfer
            if lead:  # gloo: receives first, ``lead`` rounds ahead (see _receive_lead)
                while next_recv < min(rounds, i + 1 + lead):
                    ahead[next_recv] = self._post_round(recvs, next_recv, rounds)
                    next_recv += 1
                posted.append(self._merge(ahead.pop(i), self._post_round(sends, i, rounds)))
            else:  # NCCL: the round's sends and receives in one fused batch
                posted.append(self._post_round(transfers, i, rounds))
            if len(posted) == self._rounds_in_flight:  # round i queued behind i - 1: finish that one
                self._finish_round(transfers, posted.pop(0))
        for r in posted:
            self._finish_round(transfers, r)
        sealing = self._exchange_seals([t for t in transfers if t.sealed])
        if self.device.type == "cuda" or any(
            t.payload is not None and t.payload.device.type == "cuda" for t in transfers
        ):
            torch.cuda.synchronize()  # non-blocking device<->pinned copies must land before return
        if deferred is not None:
            if isinstance(deferred, CheckpointingException):
                raise deferred
            raise ReplicationError(
                f"allocate() failed for an incoming checkpoint: {deferred!r}; its bytes were "
                f"received and dropped"
            ) from deferred
        not_ready = next((t.not_ready for t in sends if t.not_ready is not None), None)
        if not_ready is not None:
            raise not_ready
        if sealing is not None:
            raise sealing
        return _stats(transfers, time.perf_counter() - start)

    def _exchange_sizes(self, sends: List[_Transfer], recvs: List[_Transfer]) -> None:
        """Step 1: ``[header_len, payload_len, chunk]`` of every transfer."""
        size_out = [
            torch.tensor(
                [len(t.header), t.nbytes, t.chunk, int(t.sealed)], dtype=torch.int64, device=self.device
            )
            for t in sends
        ]
        size_in = [torch.empty(4, dtype=torch.int64, device=self.device) for _ in recvs]
        self._run(
            [_Op(True, t.peer, s, "transfer sizes") for t, s in zip(sends, size_out, strict=True)]
            + [_Op(False, t.peer, s, "transfer sizes") for t, s in zip(recvs, size_in, strict=True)],
            "sizes",
        )
        for t, s in zip(recvs, size_in, strict=True):
            t.header_len, t.nbytes, t.chunk, sealed = (int(v) for v in s.tolist())
            t.sealed = sealed == 1
            if t.nbytes < 0 or t.header_len < 0 or t.chunk < 1 or sealed not in (0, 1):
                raise ReplicationError(
                    f"rank {t.peer} announced malformed sizes (header {t.header_len}, payload "
                    f"{t.nbytes}, chunk {t.chunk}); it runs an incompatible resilient_ckpt"
                )

    def _exchange_headers(self, transfers: List[_Transfer]) -> None:
        """Step 2: the (opaque) headers; received ones land in ``t.header``."""
        moves = [(t, t.header if t.send else t.header_len) for t in transfers]
        for t, header in self._move_bytes(moves, "header", "headers"):
            t.header = header

    def _exchange_seals(self, sealed: List[_Transfer]) -> Optional[Exception]:
        """Step 4: the final headers of sealed transfers, after their last chunk (length, then
        bytes); they land in ``t.final``. A sender whose ``seal`` raises (or whose ``ready``
        did) sends an empty one, and a receiver that cannot take it drops it: both ends stay in
        step, and the error (the local one, else the receiver's refusal of an empty seal) is
        returned to be raised after the exchange."""
        if not sealed:
            return None
        error: Optional[Exception] = None
        for t in sealed:
            if t.send and t.not_ready is None:
                try:
                    t.final = bytes(cast(Callable[[], bytes], t.seal)())
                except Exception as e:  # the receiver learns it from the empty seal
                    error = error or e
        lens = {id(t): torch.tensor([len(t.final)], dtype=torch.int64, device=self.device) for t in sealed}
        self._run(
            [_Op(t.send, t.peer, lens[id(t)], "final header size") for t in sealed], "final header sizes"
        )
        moves = [(t, t.final if t.send else int(lens[id(t)].item())) for t in sealed]
        for t, final in self._move_bytes(moves, "final header", "final headers"):
            t.final = final
        for t in sealed:
            if t.send or t.discard:
                continue
            try:
                if t.seal is None:
                    raise ReplicationError(
                        f"rank {t.peer} sealed its transfer with a final header and this receiver "
                        "takes none; both ends must run the same resilient_ckpt"
                    )
                t.seal(t.final)  # b"": the receiver may say what that means to it
                if not t.final:
                    raise ReplicationError(
                        f"rank {t.peer} sent its payload but could not make its final header (see "
                        "that rank's error); the transfer is dropped"
                    )
            except Exception as e:
                error = error or e
        return error

    def _move_bytes(
        self, moves: Sequence[Tuple[_Transfer, Union[bytes, int]]], what: str, step: str
    ) -> List[Tuple[_Transfer, bytes]]:
        """One step of small byte strings (headers): per transfer, the bytes a send sends or
        the length a receive expects (empty moves nothing); returns what each receive got."""
        ops: List[_Op] = []
        received: List[Tuple[_Transfer, torch.Tensor]] = []
        for t, data in moves:
            n = len(data) if t.send else data
            if not n:
                continue
            if t.send:
                buf = self._to_device(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            else:
                buf = torch.empty(n, dtype=torch.uint8, device=self.device)
                received.append((t, buf))
            ops.append(_Op(t.send, t.peer, buf, f"{what} ({n} B)"))
        self._run(ops, step)
        return [(t, buf.cpu().numpy().tobytes()) for t, buf in received]

    def _allocate_all(self, recvs: List[_Transfer]) -> Optional[Exception]:
        """Destinations of every incoming payload. A failing ``allocate`` marks its transfer
        to be drained and dropped (peers stay in step); the first such error is returned."""
        deferred: Optional[Exception] = None
        for t in recvs:
            allocate = cast(Callable[[bytes, int], torch.Tensor], t.allocate)
            try:
                t.payload = self._check_allocated(t, allocate(t.header, t.nbytes))
            except Exception as e:  # drain its bytes and re-raise later: keeps peers in step
                deferred = deferred or e
                t.discard = True
                t.payload = None
        return deferred

    def _receive_lead(self, recvs: List[_Transfer], rounds: int) -> int:
        """How many rounds ahead of the sends the receives are posted: 0 with NCCL (a round is
        one fused batch); with gloo, every round's receives before the first send when all
        of them land in place, else one round ahead (each outstanding staged receive holds a
        bounce buffer).

        Why (issue 34): a gloo pair is one TCP connection, and a send goes out only once the
        peer's "receive ready" notification for it arrived. A rank queues its messages to a
        peer in order, so a notification posted after a send whose payload is still being
        written waits behind all of that payload: the peer cannot start sending until this
        rank's chunk went through, and two nodes replicating to each other ran one direction
        after the other (2.1x the link limit in two runs of three, by who posted first).
        Receives posted before the sends put every notification on the wire ahead of the
        bulk data, so both directions move at once."""
        if self.device.type != "cpu" or not recvs or not self._receives_ahead:
            return 0
        staged = any(
            t.discard or (t.payload is not None and (t.payload.device != self.device or self._stage_all))
            for t in recvs
        )
        return 1 if staged else rounds

    @staticmethod
    def _merge(first: "_Round", second: "_Round") -> "_Round":
        """One round from its receive half (posted ahead) and its send half."""
        return _Round(
            first.index,
            first.step,
            first.ops + second.ops,
            first.works + second.works,
            first.unstage + second.unstage,
        )

    def _post_round(self, transfers: List[_Transfer], i: int, rounds: int) -> "_Round":
        """Step 3, round ``i``: chunk ``i`` of every transfer that has one, posted together."""
        ops: List[_Op] = []
        unstage: List[Tuple[torch.Tensor, torch.Tensor]] = []
        for t in transfers:
            if i < t.chunks():
                if t.ready is not None and t.not_ready is None:
                    try:
                        t.ready(min((i + 1) * t.chunk, t.nbytes))
                    except Exception as e:  # sent anyway (peers in step); raised after the exchange
                        t.not_ready = e
                ops.append(self._chunk_op(t, i, unstage))
        step = f"payload round {i + 1}/{rounds}"
        return _Round(i, step, ops, self._post(ops, step), unstage)

    def _finish_round(self, transfers: List[_Transfer], r: "_Round") -> None:
        """Wait for round ``r``; bounce buffers copied out, ``on_chunk`` called for its chunks."""
        self._wait(r.ops, r.works, r.step)
        for view, buf in r.unstage:
            self._copy(view, buf)
        for t in transfers:
            if t.on_chunk is not None and not t.discard and r.index < t.chunks():
                lo = r.index * t.chunk
                t.on_chunk(lo, min(t.chunk, t.nbytes - lo))

    def _chunk_op(self, t: _Transfer, i: int, unstage: List[Tuple[torch.Tensor, torch.Tensor]]) -> _Op:
        """The op moving chunk ``i`` of ``t``: straight from/into the payload when it lives on
        the communication device, else through a bounce buffer (received ones are copied out
        after the round: ``unstage``)."""
        lo = i * t.chunk
        n = min(t.chunk, t.nbytes - lo)
        what = f"payload chunk {i + 1}/{t.chunks()} (bytes {lo}..{lo + n} of {_mib(t.nbytes)})"
        # rounds in flight (+ 1 when receives are posted a round ahead): buffers per transfer
        slot = (t.index, i % self._slots)
        if t.discard:
            return _Op(False, t.peer, self._bounce_buffer("drain", slot, n, self.device), what)
        view = t.payload[lo : lo + n]  # type: ignore[index]
        if view.device == self.device and not self._stage_all:
            return _Op(t.send, t.peer, view, what)
        buf = self._bounce_buffer("send" if t.send else "recv", slot, n, self.device)
        if t.send:
            self._copy(buf, view)
        else:
            unstage.append((view, buf))
        return _Op(t.send, t.peer, buf, what)

    # ---------------------------------------------------------------------------------------
    def _check_peer(self, peer: object, role: str) -> int:
        if isinstance(peer, bool) or not isinstance(peer, int) or peer not in self._peers:
            raise ReplicationError(
                f"{role} rank {peer!r} is not a member of the checkpoint group (ranks "
                f"{sorted(self._peers)[:8]}{'…' if len(self._peers) > 8 else ''})"
            )
        if peer == self.rank:
            raise ReplicationError(
                f"rank {self.rank} cannot replicate to or from itself; drop that transfer "
                f"(its own store already holds the data)"
            )
        return peer

    def _check_outgoing(self, index: int, o: Outgoing) -> _Transfer:
        dst = self._check_peer(o.dst, "destination")
        p = o.payload
        if not isinstance(p, torch.Tensor) or p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous():
            raise ReplicationError(
                f"payload for rank {dst} must be a contiguous 1-D uint8 tensor, got "
                f"{_describe(p)}; pass the store segment (or tensor.view(-1).view(torch.uint8))"
            )
        if not isinstance(o.header, (bytes, bytearray, memoryview)):
            raise ReplicationError(
                f"header for rank {dst} must be bytes (msgpack), got {type(o.header).__name__}"
            )
        header = bytes(o.header)
        return _Transfer(
            dst,
            True,
            header,
            len(header),
            p,
            None,
            p.numel(),
            self.chunk_bytes,
            index=index,
            on_chunk=o.on_chunk,
            seal=o.seal,
            sealed=o.seal is not None,
            ready=o.ready,
        )

    def _check_incoming(self, index: int, inc: Incoming) -> _Transfer:
        src = self._check_peer(inc.src, "source")
        if not callable(inc.allocate):
            raise ReplicationError(f"Incoming from rank {src}: allocate must be callable")
        return _Transfer(src, False, allocate=inc.allocate, index=index, on_chunk=inc.on_chunk, seal=inc.seal)

    def _check_allocated(self, t: _Transfer, out: object) -> torch.Tensor:
        if (
            not isinstance(out, torch.Tensor)
            or out.dtype != torch.uint8
            or out.dim() != 1
            or out.numel() != t.nbytes
            or not out.is_contiguous()
        ):
            raise ReplicationError(
                f"allocate() for the transfer from rank {t.peer} must return a contiguous 1-D "
                f"uint8 tensor of {t.nbytes} bytes, got {_describe(out)}"
            )
        return out

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t if t.device == self.device else t.to(self.device)

    def _bounce_buffer(self, role: str, slot: Tuple[int, int], n: int, device: torch.device) -> torch.Tensor:
        """A reused staging buffer per (role, slot) on the communication device."""
        buf = self._bounce.get((role, slot))
        if buf is None or buf.numel() < n:
            size = max(n, self.chunk_bytes)
            pin = device.type == "cpu" and torch.cuda.is_available()
            buf = torch.empty(size, dtype=torch.uint8, device=device, pin_memory=pin)
            self._bounce[(role, slot)] = buf
        return buf[:n]

    def _copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        # Into a CUDA buffer: async on the current stream (NCCL orders itself after it). Into a
        # CPU buffer that gloo reads next: blocking, gloo does not wait for CUDA streams.
        dst.copy_(src, non_blocking=dst.device.type == "cuda")

    def _run(self, ops: List[_Op], step: str) -> None:
        self._wait(ops, self._post(ops, step), step)

    def _post(self, ops: List[_Op], step: str) -> list:
        """Post ``ops`` together; their works, in order. With gloo ``ops`` is first reordered
        in place, receives before sends (see :meth:`_receive_lead`), so the caller's list
        stays matched to the works."""
        if not ops:
            return []
        if self.device.type == "cpu" and self._receives_ahead:
            ops.sort(key=lambda op: op.send)  # stable: the order among receives (sends) holds
        p2p = [
            dist.P2POp(dist.isend if op.send else dist.irecv, op.tensor, op.peer, self.group) for op in ops
        ]
        try:
            return dist.batch_isend_irecv(p2p)
        except Exception as e:
            raise self._failure(ops, None, step, e) from e

    def _wait(self, ops: List[_Op], works: list, step: str) -> None:
        """Wait for ``works`` (of ``ops``) for at most the transport's timeout from now."""
        deadline = time.monotonic() + self.timeout_s
        # One work per op (gloo) or one for the coalesced batch (NCCL).
        for i, work in enumerate(works):
            left = max(deadline - time.monotonic(), 0.001)
            try:
                ok = work.wait(timedelta(seconds=left))
            except Exception as e:
                raise self._failure(ops, i if len(works) == len(ops) else None, step, e) from e
            if ok is False:
                raise self._failure(
                    ops,
                    i if len(works) == len(ops) else None,
                    step,
                    TimeoutError("wait() returned False"),
                )

    def _failure(
        self, ops: List[_Op], index: Optional[int], step: str, cause: BaseException
    ) -> ReplicationError:
        if index is not None:
            op = ops[index]
            peers = f"rank {op.peer}"
            verb, prep = ("sending", "to") if op.send else ("receiving", "from")
            what = f"{verb} {op.what} {prep} rank {op.peer}"
        else:
            involved = sorted({op.peer for op in ops})
            peers = "ranks " + ", ".join(map(str, involved))
            what = f"{step} with {peers}"
        peer_ranks = (ops[index].peer,) if index is not None else tuple(sorted({op.peer for op in ops}))
        return _with_peers(
            ReplicationError(
                f"replication between rank {self.rank} and {peers} failed while {what} "
                f"(step: {step}; timeout {self.timeout_s:g} s): {type(cause).__name__}: {cause}. The "
                f"peer is dead, stuck or unreachable; this checkpoint group is no longer usable — "
                f"create a new one with new_checkpoint_group() after the job's membership is settled"
            ),
            peer_ranks,
        )


def _with_peers(error: ReplicationError, peers: Sequence[int]) -> ReplicationError:
    """``error`` with ``peers``: the ranks it concerns (callers that know nodes name them)."""
    error.peers = tuple(peers)
    return error


def _describe(x: object) -> str:
    if isinstance(x, torch.Tensor):
        return (
            f"tensor(dtype={x.dtype}, shape={tuple(x.shape)}, device={x.device}, "
            f"contiguous={x.is_contiguous()})"
        )
    return type(x).__name__
