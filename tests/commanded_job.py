"""A job of long-lived rank processes that the test drives one step at a time.

Model-based tests (hypothesis state machines) keep one ``CheckpointManager`` per rank across
many steps and compare every step's outcome on every rank with an oracle, so a rank cannot be a
function that runs and returns (``harness.run_ranks``): here each rank process builds its rank
object once (``make_rank(rank, *make_args)``, a module-level function the rank process can
import) and then runs commands from its queue — ``getattr(rank_object, what)(*args)`` — replying
with the outcome, the seconds it took, its thread and process-group counts, and whether the
job's own all-reduce still works after it. The rendezvous store is the test's (as torchrun's
agent holds it), so a rank frozen or killed never takes it down; a restart is every rank
SIGKILLed and started again.

Each rank replies on a pipe of its own, written on its own thread: a ``multiprocessing.Queue``
shared by the ranks writes from a feeder thread under a lock shared by every writer, and a rank
that froze itself (SIGSTOP) right after replying could stop holding that lock — every other
rank's reply then never arrived (the fault model hung this way under load).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from datetime import timedelta
from multiprocessing.connection import wait as wait_readable
from typing import Any, Callable, Dict, List, Sequence

from harness import _mp_context

#: the job's own groups: far above any checkpoint timeout, so a hang in them is a hang
JOB_TIMEOUT_S = 60


def _counts() -> List[int]:
    from torch.distributed import distributed_c10d as c10d

    return [threading.active_count(), len(c10d._world.pg_map)]


def _world_works(rank: int, world_size: int) -> bool:
    """The job's own process group still pairs up (one all-reduce on the default group)."""
    import torch
    import torch.distributed as dist

    t = torch.tensor([rank + 1.0])
    dist.all_reduce(t)
    return float(t) == sum(range(1, world_size + 1))


def _rank_main(rank: int, ws: int, rpn: int, port: int, make_rank, make_args, commands, replies) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(ws), LOCAL_RANK=str(rank % rpn), LOCAL_WORLD_SIZE=str(rpn)
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=JOB_TIMEOUT_S))
        dist.init_process_group(
            "gloo", store=store, rank=rank, world_size=ws, timeout=timedelta(seconds=JOB_TIMEOUT_S)
        )
        me = make_rank(rank, *make_args)
        replies.send((rank, -1, ["ready"], 0.0, _counts(), True))
    except BaseException as e:
        replies.send((rank, -1, ["error", f"{type(e).__name__}: {e}"], 0.0, [0, 0], False))
        return
    while True:
        seq, what, args, check_world = commands.get()
        if what == "exit":
            me.close()
            replies.send((rank, seq, ["closed"], 0.0, _counts(), True))
            return
        t = time.monotonic()
        try:
            outcome = getattr(me, what)(*args)
        except Exception as e:
            outcome = ["failed", f"{type(e).__name__}: {str(e)[:300]}"]
        seconds = time.monotonic() - t
        world = _world_works(rank, ws) if check_world else True
        replies.send((rank, seq, outcome, seconds, _counts(), world))


class CommandedJob:
    """``world_size`` rank processes (one generation of the job); restart = all SIGKILLed,
    started again (``start`` once more)."""

    def __init__(
        self,
        world_size: int,
        ranks_per_node: int,
        make_rank: Callable[..., Any],
        make_args: Sequence[Any] = (),
    ):
        self.ws, self.rpn = world_size, ranks_per_node
        self.make_rank, self.make_args = make_rank, tuple(make_args)
        self.procs: List[Any] = []
        self.seq = 0
        self.generation = 0

    def start(self) -> Dict[int, Any]:
        import torch.distributed as dist

        ctx = _mp_context()
        self.store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=JOB_TIMEOUT_S)
        )
        self.commands = [ctx.Queue() for _ in range(self.ws)]
        pipes = [ctx.Pipe(duplex=False) for _ in range(self.ws)]  # (reader, writer) per rank
        self.replies = [reader for reader, _ in pipes]
        self.procs = [
            ctx.Process(
                target=_rank_main,
                args=(
                    r,
                    self.ws,
                    self.rpn,
                    self.store.port,
                    self.make_rank,
                    self.make_args,
                    self.commands[r],
                    pipes[r][1],
                ),
                daemon=True,
            )
            for r in range(self.ws)
        ]
        for p in self.procs:
            p.start()
        for _, writer in pipes:
            writer.close()  # the rank holds its end: a rank that died reads as EOF here
        self.generation += 1
        got = self._collect(-1, range(self.ws), 60.0)
        assert all(got[r][0] == ["ready"] for r in range(self.ws)), got
        return got

    def kill(self) -> None:
        for p in self.procs:
            sigkill(p)
        for p in self.procs:
            p.join(timeout=10)
        self.procs = []
        for reader in getattr(self, "replies", []):
            reader.close()
        self.replies = []

    def close(self) -> None:
        if self.procs and all(p.is_alive() for p in self.procs):
            self.seq += 1
            for q in self.commands:
                q.put((self.seq, "exit", (), False))
            self._collect(self.seq, range(self.ws), 30.0)
        self.kill()

    def step(self, what: str, args_of, live, check_world: bool, wait_s: float) -> Dict[int, Any]:
        """Send ``what`` to every rank (``args_of(rank)``); the replies of the ``live`` ranks,
        each ``(outcome, seconds, [threads, process groups], the job's all-reduce works)``."""
        self.seq += 1
        for r in range(self.ws):
            self.commands[r].put((self.seq, what, args_of(r), check_world))
        return self._collect(self.seq, live, wait_s)

    def _collect(self, seq: int, live, wait_s: float) -> Dict[int, Any]:
        want, got = set(live), {}
        open_readers = list(self.replies)
        deadline = time.monotonic() + wait_s
        while want - set(got) and open_readers and time.monotonic() < deadline:
            for reader in wait_readable(open_readers, timeout=max(0.0, deadline - time.monotonic())):
                try:
                    rank, s, outcome, seconds, counts, world = reader.recv()
                except EOFError:  # that rank is gone (killed, or ended)
                    open_readers.remove(reader)
                    continue
                if s == seq:
                    got[rank] = (outcome, seconds, counts, world)
        missing = sorted(want - set(got))
        assert not missing, f"rank(s) {missing} did not answer within {wait_s:.0f}s (hung or died): {got}"
        return got

    def stopped_or_dead(self, rank: int) -> None:
        """SIGKILL a rank that froze itself (or confirm it died)."""
        p = self.procs[rank]
        sigkill(p)
        p.join(timeout=10)


def sigkill(p) -> None:
    """SIGKILL ``p`` unless it has ended (it may end between the check and the signal)."""
    if p.is_alive():
        try:
            os.kill(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
