"""Small collectives on msgpack payloads (never pickle), with errors that name the group.

torch's ``all_gather_object`` pickles; checkpoint metadata crosses process boundaries and must
not be unpickled (DESIGN: wire formats), so metadata travels as msgpack bytes in uint8
tensors. On NCCL groups the byte tensors live on the current CUDA device.
"""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Dict, List, Optional, Sequence

import msgpack
import torch
import torch.distributed as dist

from ..errors import CheckpointingException, CollectiveTimeoutError, PeerFailedError
from ..gc_pause import paused_gc
from ..timing import COLLECTIVES, phase


def group_rank(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


def group_size(group: Optional[dist.ProcessGroup]) -> int:
    return dist.get_world_size(group) if dist.is_initialized() else 1


def default_group(group: Optional[dist.ProcessGroup]) -> Optional[dist.ProcessGroup]:
    """``group``, or the world group when it is None (None when not distributed)."""
    if group is None and dist.is_initialized():
        return dist.group.WORLD
    return group


def world_rank() -> int:
    """This process's rank in the job (0 when not distributed)."""
    return dist.get_rank() if dist.is_initialized() else 0


def global_rank(group: Optional[dist.ProcessGroup], rank_in_group: int) -> int:
    if group is None or group is dist.GroupMember.WORLD:
        return rank_in_group
    return dist.get_global_rank(group, rank_in_group)


def comm_device(group: Optional[dist.ProcessGroup]) -> torch.device:
    """The device collectives on ``group`` need their tensors on."""
    backend = dist.get_backend(group)
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


#: id(group) -> its timeout in seconds, for the groups whose timeout this package set
#: (:func:`note_timeout`): a collective that fails after about that long failed by a timeout,
#: whatever the transport's words
_TIMEOUTS: Dict[int, float] = {}
#: a collective that ran this share of its group's timeout before failing failed by a timeout:
#: the ranks entered it at slightly different times, so the first to give up (and close its
#: connections) does so a little before the others' own timeouts
_TIMED_OUT_SHARE = 0.8


def note_timeout(group: Optional[dist.ProcessGroup], seconds: float) -> None:
    """Remember ``group``'s timeout (set when it was made) for classifying its failures."""
    if group is not None:
        _TIMEOUTS[id(group)] = float(seconds)


def forget_timeout(group: Optional[dist.ProcessGroup]) -> None:
    _TIMEOUTS.pop(id(group), None)


def _wrap(err: BaseException, what: str, group, elapsed: float) -> CheckpointingException:
    """The collective's failure, named. A timeout is a :class:`CollectiveTimeoutError` on every
    rank: on the rank whose own wait expired (the transport says so) and on the ranks whose
    connection that rank then closed ("Connection closed by peer" after about the timeout)."""
    text = str(err)
    low = text.lower()
    timeout = _TIMEOUTS.get(id(group))
    said = "timed out" in low or "timeout" in low
    gave_up = not said and timeout is not None and elapsed >= _TIMED_OUT_SHARE * timeout
    cls = CollectiveTimeoutError if said or gave_up else CheckpointingException
    why = (
        f" (after {elapsed:.1f} s of the group's {timeout:g} s timeout: a peer rank gave up waiting)"
        if gave_up
        else ""
    )
    return cls(
        f"collective '{what}' failed on a group of {group_size(group)} ranks{why}: {text.strip()[:500]}"
        " — a peer rank probably died or is stuck; the job needs a restart"
    )


#: Bytes of the first round of :func:`all_gather_bytes`, summed over the group: every rank
#: sends its length and up to ``max(FIRST_ROUND_MIN, FIRST_ROUND_TOTAL // n)`` payload bytes
#: at once, so the small messages of the control path (holdings, votes, plans) take one
#: collective instead of two (sizes, then bytes), and a large group pays at most this much
#: extra traffic per gather for it.
FIRST_ROUND_TOTAL = 64 << 10
FIRST_ROUND_MIN = 256
_LEN = 8  # the length prefix of a first-round frame (little-endian int64)


def first_round_bytes(n: int) -> int:
    """Payload bytes each of ``n`` ranks sends in the first round of :func:`all_gather_bytes`."""
    return max(FIRST_ROUND_MIN, FIRST_ROUND_TOTAL // max(n, 1))


def _phase_marked(fn):
    """The collective's time counts as :data:`~resilient_ckpt.timing.COLLECTIVES` (waiting for
    the other ranks included) in a restore's breakdown."""

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        with phase(COLLECTIVES):
            return fn(*args, **kwargs)

    return marked


@_phase_marked
def all_gather_bytes(payload: bytes, group: Optional[dist.ProcessGroup] = None) -> List[bytes]:
    """Every rank's ``payload`` in group-rank order. One collective when every payload fits
    the first round's frame (:func:`first_round_bytes`), else a second one for the rest
    (every rank learns every length from the first round, so all take the same branch)."""
    n = group_size(group)
    if n == 1:
        return [bytes(payload)]
    dev = comm_device(group)
    head = first_round_bytes(n)
    t0 = time.monotonic()
    try:
        frame = torch.zeros(_LEN + head, dtype=torch.uint8)
        frame[:_LEN] = torch.frombuffer(bytearray(len(payload).to_bytes(_LEN, "little")), dtype=torch.uint8)
        first = payload[:head]
        if first:
            frame[_LEN : _LEN + len(first)] = torch.frombuffer(bytearray(first), dtype=torch.uint8)
        frames = [torch.empty(_LEN + head, dtype=torch.uint8, device=dev) for _ in range(n)]
        dist.all_gather(frames, frame.to(dev), group=group)
        heads = [f.cpu().numpy().tobytes() for f in frames]
        sizes = [int.from_bytes(h[:_LEN], "little") for h in heads]
        rest_cap = max(sizes) - head
        rests = [b""] * n
        if rest_cap > 0:  # someone's payload is longer than the frame: the rest, padded
            buf = torch.zeros(rest_cap, dtype=torch.uint8)
            tail = payload[head:]
            if tail:
                buf[: len(tail)] = torch.frombuffer(bytearray(tail), dtype=torch.uint8)
            outs = [torch.empty(rest_cap, dtype=torch.uint8, device=dev) for _ in range(n)]
            dist.all_gather(outs, buf.to(dev), group=group)
            rests = [o.cpu().numpy().tobytes() for o in outs]
    except RuntimeError as e:
        raise _wrap(e, "all_gather_bytes", group, time.monotonic() - t0) from e
    return [h[_LEN : _LEN + min(s, head)] + r[: max(s - head, 0)] for h, r, s in zip(heads, rests, sizes)]


def all_gather_msgpack(obj: Any, group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """all_gather of plain msgpack-able values (ints, strings, lists, dicts, bytes)."""
    raw = all_gather_bytes(msgpack.packb(obj, use_bin_type=True), group)
    with paused_gc():  # W ranks' metadata: many small objects, none garbage
        return [msgpack.unpackb(r, raw=False, strict_map_key=False, use_list=True) for r in raw]


@_phase_marked
def all_to_all_msgpack(per_rank: Sequence[Any], group: Optional[dist.ProcessGroup] = None) -> List[Any]:
    """Personalised exchange: this rank sends ``per_rank[r]`` to group rank ``r`` and gets, in
    group-rank order, what every rank sent it (two ``all_to_all_single``: sizes, then bytes).
    A rank's traffic is what it sends and receives, not everyone's (unlike an all-gather)."""
    n = group_size(group)
    blobs = [msgpack.packb(x, use_bin_type=True) for x in per_rank]
    if len(blobs) != n:
        raise ValueError(f"all_to_all_msgpack: {len(blobs)} payloads for a group of {n}")
    if n == 1:
        received = blobs
    else:
        dev = comm_device(group)
        t0 = time.monotonic()
        try:
            out_sizes = torch.tensor([len(b) for b in blobs], dtype=torch.int64, device=dev)
            in_sizes = torch.empty_like(out_sizes)
            dist.all_to_all_single(in_sizes, out_sizes, group=group)
            ins = [int(x) for x in in_sizes.cpu().tolist()]
            send = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)
            recv = torch.empty(max(sum(ins), 1), dtype=torch.uint8, device=dev)
            dist.all_to_all_single(
                recv[: sum(ins)],
                send[: sum(len(b) for b in blobs)].to(dev),
                ins,
                [len(b) for b in blobs],
                group=group,
            )
        except RuntimeError as e:
            raise _wrap(e, "all_to_all_msgpack", group, time.monotonic() - t0) from e
        flat = recv[: sum(ins)].cpu().numpy().tobytes()
        received, pos = [], 0
        for k in ins:
            received.append(flat[pos : pos + k])
            pos += k
    with paused_gc():
        return [msgpack.unpackb(r, raw=False, strict_map_key=False, use_list=True) for r in received]


def broadcast_msgpack(obj: Any, src: int, group: Optional[dist.ProcessGroup] = None) -> Any:
    """``obj`` from group rank ``src`` on every rank."""
    return all_gather_msgpack(obj if group_rank(group) == src else None, group)[src]


def all_reduce_int(value: int, op: str, group: Optional[dist.ProcessGroup] = None) -> int:
    """MIN / MAX / SUM of one int64 across the group: the cheap agreement primitive."""
    return all_reduce_ints((value,), op, group)[0]


@_phase_marked
def all_reduce_ints(values: Sequence[int], op: str, group: Optional[dist.ProcessGroup] = None) -> List[int]:
    """:func:`all_reduce_int` of several ints at once, element by element (one call)."""
    if group_size(group) == 1:
        return [int(v) for v in values]
    ops = {"min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX, "sum": dist.ReduceOp.SUM}
    t = torch.tensor([int(v) for v in values], dtype=torch.int64, device=comm_device(group))
    t0 = time.monotonic()
    try:
        dist.all_reduce(t, op=ops[op], group=group)
    except RuntimeError as e:
        raise _wrap(e, f"all_reduce({op})", group, time.monotonic() - t0) from e
    return [int(v) for v in t.tolist()]


def all_agree(ok: bool, group: Optional[dist.ProcessGroup] = None) -> bool:
    """True iff every rank passed ``ok=True``; all ranks learn the same answer."""
    return all_reduce_int(1 if ok else 0, "min", group) == 1


# ---- fail together ------------------------------------------------------------------------
#
# A step that every rank takes together (a gather, a plan, a restore) may fail on one rank
# only: a state function raises, a template does not match, a file is unreadable. If that rank
# simply raised, its peers would sit in the step's next collective until the group's timeout,
# and the collective would then pair with whatever that rank does next. Instead every local
# failure travels with the step's collective and every rank raises together: the one
# mechanism below, used by every collective step of save and restore.


def describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {err}"[:2000]


def _raise_together(errors: List[Any], what: str, local: Optional[BaseException], group) -> None:
    failed = [(r, e) for r, e in enumerate(errors) if e]
    if not failed:
        return
    if local is not None:
        raise local
    r, msg = failed[0]
    r = global_rank(group, r)
    more = f" (and {len(failed) - 1} other rank(s))" if len(failed) > 1 else ""
    raise PeerFailedError(f"{what} failed on rank {r}{more}, so every rank stops: {msg}", rank=r, reason=msg)


def fail_together(
    local: Optional[BaseException], what: str, group: Optional[dist.ProcessGroup] = None
) -> None:
    """A barrier that carries failures: returns on every rank if no rank passed an error,
    else raises on every rank — the failing rank its own exception, the others a
    :class:`PeerFailedError` naming the first failing rank and its error.

    One all-reduce when every rank is fine; a second collective (the messages) only on failure.
    """
    agree_or_fail(local, True, what, group)


def agree_or_fail(
    local: Optional[BaseException], agree: bool, what: str, group: Optional[dist.ProcessGroup] = None
) -> bool:
    """:func:`fail_together` that also carries a vote: True on every rank iff no rank failed
    and every rank passed ``agree=True`` — in the same one all-reduce (a failure costs the
    second collective, the messages, as in :func:`fail_together`)."""
    return votes_or_fail(local, (agree,), what, group)[0]


def votes_or_fail(
    local: Optional[BaseException],
    votes: Sequence[bool],
    what: str,
    group: Optional[dist.ProcessGroup] = None,
    least: Sequence[int] = (),
) -> List[Any]:
    """:func:`agree_or_fail` of several independent votes in the one all-reduce: for each, True
    on every rank iff no rank failed and every rank voted True (one slot per vote, the minimum
    over the group; slot 0 says no rank failed). ``least``: ints whose minimum over the group
    rides along, returned after the votes (a check that would otherwise cost an all-reduce of
    its own)."""
    if group_size(group) == 1:
        if local is not None:
            raise local
        return [bool(v) for v in votes] + [int(x) for x in least]
    flags = all_reduce_ints(_vote_slots(local is None, votes, least), "min", group)
    if flags[0]:
        return _votes_from(flags, len(votes))
    errors = all_gather_msgpack("" if local is None else describe(local), group)
    _raise_together(errors, what, local, group)
    raise AssertionError("unreachable: a rank voted failure without an error")  # pragma: no cover


def _vote_slots(ok: bool, votes: Sequence[bool], least: Sequence[int]) -> List[int]:
    """A rank's side of a vote's MIN all-reduce: whether it is fine, each vote, ``least``."""
    return [int(ok)] + [int(ok and bool(v)) for v in votes] + [int(x) for x in least]


def _votes_from(flags: Sequence[int], n: int) -> List[Any]:
    """The reduced slots of a vote in which no rank failed: ``n`` votes, then ``least``."""
    return [bool(f) for f in flags[1 : 1 + n]] + list(flags[1 + n :])


class PendingVotes:
    """:func:`votes_or_fail` started without waiting (:func:`start_votes`): the all-reduce runs
    on the group's own threads while the caller goes on, and :meth:`result` — callable from any
    thread, any number of times — gives the same answer on every rank. No second collective on
    failure: the lowest failing rank rides in the all-reduce, and the others name it (its own
    log says why), so waiting for the answer never orders anything on the group."""

    def __init__(self, work, flags: torch.Tensor, n: int, what: str, group, local, t0: float):
        self._work, self._flags, self._n, self._what, self._group = work, flags, n, what, group
        self._local, self._t0 = local, t0
        self._lock = threading.Lock()
        self._answer: Optional[List[Any]] = None
        self._error: Optional[BaseException] = None

    def result(self) -> List[Any]:
        """The votes (True iff every rank voted True) and the ``least`` values, as
        :func:`votes_or_fail` returns them; raises on every rank if a rank failed (that rank
        its own exception, the others a :class:`PeerFailedError` naming it) or if the
        collective did (a peer gone: the group's timeout)."""
        with self._lock:
            if self._answer is None and self._error is None:
                try:
                    self._answer = self._wait()
                except BaseException as e:
                    self._error = e
            if self._error is not None:
                raise self._error
            return list(self._answer)

    def _wait(self) -> List[Any]:
        if self._work is not None:
            try:
                flags = _completed(self._work, self._flags, self._group)
            except RuntimeError as e:
                raise _wrap(e, "all_reduce(min)", self._group, time.monotonic() - self._t0) from e
        else:
            flags = [int(v) for v in self._flags.tolist()]
        failed_rank, flags = flags[0], flags[1:]
        if flags[0]:
            return _votes_from(flags, self._n)
        if self._local is not None:
            raise self._local
        r = global_rank(self._group, failed_rank)
        raise PeerFailedError(
            f"{self._what} failed on rank {r}, so every rank drops it (rank {r}'s log says why)",
            rank=r,
            reason="",
        )


def start_votes(
    local: Optional[BaseException],
    votes: Sequence[bool],
    what: str,
    group: Optional[dist.ProcessGroup] = None,
    least: Sequence[int] = (),
) -> PendingVotes:
    """:func:`votes_or_fail` without waiting for the other ranks: the caller learns the answer
    later from :meth:`PendingVotes.result`. The group must see no other collective of this
    thread until then (a thread's collectives on one group pair up in order on every rank)."""
    size = group_size(group)
    # Slot 0: the lowest failing rank (the group's size where none failed).
    values = [size if local is None else group_rank(group)] + _vote_slots(local is None, votes, least)
    t0 = time.monotonic()
    if size == 1:
        return PendingVotes(None, torch.tensor(values, dtype=torch.int64), len(votes), what, group, local, t0)
    t = torch.tensor(values, dtype=torch.int64, device=comm_device(group))
    try:
        work = dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group, async_op=True)
    except RuntimeError as e:
        raise _wrap(e, "all_reduce(min)", group, time.monotonic() - t0) from e
    return PendingVotes(work, t, len(votes), what, group, local, t0)


def _completed(work, t: torch.Tensor, group) -> List[int]:
    """The result of an asynchronous all-reduce into ``t``. A CUDA tensor (an NCCL group) is
    read once the collective completed, on a stream of its own: waiting through the current
    stream would also wait for whatever the training queued there."""
    if t.device.type != "cuda":
        work.wait()
        return [int(v) for v in t.tolist()]
    deadline = time.monotonic() + _TIMEOUTS.get(id(group), 600.0)
    while not work.is_completed():
        if time.monotonic() > deadline:
            raise RuntimeError("timed out waiting for a vote's all-reduce")
        time.sleep(0.0002)
    with torch.cuda.stream(torch.cuda.Stream(t.device)):
        return [int(v) for v in t.to("cpu").tolist()]


def vote(local: Optional[BaseException], agree: bool) -> List[Any]:
    """This rank's part of :func:`agree_or_fail` as a value (msgpack-able) that another
    collective carries: decided by :func:`agreed` once every rank's is gathered."""
    return [describe(local) if local is not None else "", bool(agree)]


def agreed(
    votes: Sequence[Any], local: Optional[BaseException], what: str, group: Optional[dist.ProcessGroup] = None
) -> bool:
    """:func:`agree_or_fail`'s outcome from every rank's :func:`vote` (group-rank order),
    already gathered by another collective: the same decision and the same errors on every
    rank, with no collective of its own."""
    _raise_together([v[0] for v in votes], what, local, group)
    return all(v[1] for v in votes)


def gather_or_fail(
    payload: Any,
    local: Optional[BaseException],
    what: str,
    group: Optional[dist.ProcessGroup] = None,
) -> List[Any]:
    """All-gather of ``payload`` (msgpack-able) that doubles as :func:`fail_together`: a rank
    whose preparation failed passes ``local`` (its payload is then ignored) and every rank
    raises together; else every rank's payload in group-rank order."""
    mine = {"e": describe(local), "p": None} if local is not None else {"e": "", "p": payload}
    gathered = all_gather_msgpack(mine, group) if group_size(group) > 1 else [mine]
    _raise_together([g["e"] for g in gathered], what, local, group)
    return [g["p"] for g in gathered]
