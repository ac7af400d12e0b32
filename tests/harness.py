"""The one multi-process harness every distributed test uses.

``run_ranks(fn, world_size, ...)`` starts ``world_size`` real processes (forkserver with torch
preloaded, so a rank starts in well under a second), joins them into a gloo process group on
127.0.0.1 with a free port, calls ``fn(ctx, *args)`` in each and returns the per-rank results
in rank order. Nodes are simulated by giving each group of ``ranks_per_node`` ranks its own
store root under ``tmp_root``. A rank may end itself with SIGKILL (fault injection at an exact
code point, no sleeps); its result is then :data:`KILLED`.

An exception in any rank is re-raised in the test with that rank's traceback. A run that
exceeds ``timeout`` is killed and reported with whatever ranks did finish.
"""

from __future__ import annotations

import contextlib
import faulthandler
import multiprocessing as mp
import os
import signal
import tempfile
import threading
import traceback
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from resilient_ckpt.bench.fabric import Fabric, NodeNet, join
from resilient_ckpt.ports import free_port


class _Killed:
    def __repr__(self) -> str:
        return "KILLED"


KILLED = _Killed()


@dataclass
class RankContext:
    """What a rank function gets: its identity, its node's store root and scratch space."""

    rank: int
    world_size: int
    ranks_per_node: int
    tmp_root: str
    extra_env: Dict[str, str] = field(default_factory=dict)
    #: this rank's node on a network fabric (run_ranks(fabric=...)); None: loopback
    net: Optional[NodeNet] = None

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def store_root(self) -> str:
        return node_store_root(self.tmp_root, self.node)

    def kill_self(self) -> None:
        """End this rank the way a crash does: SIGKILL, no cleanup, no atexit."""
        os.kill(os.getpid(), signal.SIGKILL)


def node_store_root(tmp_root: str, node: int) -> str:
    return str(Path(tmp_root) / f"node{node}")


class RankFailed(AssertionError):
    pass


def _entry(fn, ctx: RankContext, port: int, args, result_q, timeout_s: float) -> None:
    node_env = join(ctx.net)  # before any socket or thread exists: they all live on the node
    master = node_env["MASTER_ADDR"]
    os.environ.update(
        {
            "MASTER_PORT": str(port),
            "RANK": str(ctx.rank),
            "WORLD_SIZE": str(ctx.world_size),
            "LOCAL_RANK": str(ctx.local_rank),
            "LOCAL_WORLD_SIZE": str(ctx.ranks_per_node),
            **node_env,
            **ctx.extra_env,  # a test may override the launcher's variables
        }
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    # A rank the parent finds still running at its timeout is asked for every thread's stack
    # (SIGUSR1): dumped from C, so even a rank stuck with the GIL held says where it is.
    faulthandler.register(signal.SIGUSR1, file=open(_stacks_path(port, ctx.rank), "w"), all_threads=True)
    try:
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://{master}:{port}",
            rank=ctx.rank,
            world_size=ctx.world_size,
            timeout=timedelta(seconds=timeout_s),
        )
        out = fn(ctx, *args)
        result_q.put((ctx.rank, "ok", out))
    except BaseException as e:  # report everything, the parent decides
        result_q.put((ctx.rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


def _contexts(world_size: int, rpn: int, tmp_root, extra_env, fabric: Optional[Fabric]) -> List[RankContext]:
    if fabric is not None and fabric.nodes * rpn < world_size:
        raise ValueError(f"{world_size} ranks at {rpn} per node need {-(-world_size // rpn)} fabric nodes")
    return [
        RankContext(
            r,
            world_size,
            rpn,
            str(tmp_root),
            dict(extra_env or {}),
            fabric.net(r // rpn) if fabric is not None else None,
        )
        for r in range(world_size)
    ]


_CTX = None


def _mp_context():
    global _CTX
    if _CTX is None:
        _CTX = mp.get_context("forkserver")
        # Everything a rank imports, once: each rank then starts in a fraction of a second.
        # A process has one forkserver, started with the preload list in force at its first use:
        # the demo's modules are listed too (resilient_ckpt/demo/orchestrator.py), or a demo test
        # run after a harness test in the same pytest worker paid ~1.2 s of CPU per rank for
        # them after every fork (demo tests 3x slower; the suite's time depended on its order).
        _CTX.set_forkserver_preload(
            [
                "resilient_ckpt",
                "torch",
                "torch.distributed",
                "torch._inductor.config",
                "resilient_ckpt.model.codec",
                "resilient_ckpt.manager.checkpoint_manager",
                "resilient_ckpt.manager.hooks",
                "resilient_ckpt.demo.worker",
            ]
        )
    return _CTX


def _stacks_path(port: int, rank: int) -> str:
    # Outside tmp_root: tests list what their store roots hold.
    return os.path.join(tempfile.gettempdir(), f"rc-stacks-{port}-rank{rank}")


def _stacks_of(procs, ranks: List[int], port: int) -> str:
    """Every thread's stack of each rank in ``ranks`` (still running at the timeout), as its
    faulthandler wrote them on SIGUSR1: what a hang report needs first."""
    import time

    paths = {r: _stacks_path(port, r) for r in ranks}
    for r in ranks:
        if procs[r].is_alive():
            os.kill(procs[r].pid, signal.SIGUSR1)
    # Diagnostics only (nothing is ordered by it): give the dumps up to 3 s to appear.
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline and not all(
        os.path.exists(p) and os.path.getsize(p) for p in paths.values()
    ):
        time.sleep(0.05)
    time.sleep(0.2)  # a dump of many threads is written in pieces
    out = []
    for r, path in paths.items():
        try:
            with open(path) as f:
                text = f.read()[-20000:]
        except OSError:
            text = "(no dump)"
        out.append(f"\n--- rank {r}: every thread's stack at the timeout ---\n{text}")
    return "".join(out)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    tmp_root: str | os.PathLike,
    *,
    ranks_per_node: Optional[int] = None,
    args: Sequence[Any] = (),
    timeout: float = 120.0,
    collective_timeout: float = 60.0,
    expect_killed: Sequence[int] = (),
    extra_env: Optional[Dict[str, str]] = None,
    allow_children: bool = False,
    fabric: Optional[Fabric] = None,
) -> List[Any]:
    """Run ``fn(ctx, *args)`` on ``world_size`` gloo ranks; results in rank order.

    ``expect_killed`` lists ranks that are meant to SIGKILL themselves; any other rank that
    dies or raises fails the test. Ranks that fail *because* a killed peer vanished are the
    test's business: ``fn`` should catch and return what it observed.

    ``allow_children``: ranks are not daemonic, so they may start processes of their own
    (checkpoint workers of the async queues); they are still killed on timeout.

    ``fabric``: each node's ranks run in that node's network namespace and reach each other
    over its links (gloo bound to the node's interface, the TCPStore on node 0's address);
    the fabric needs at least ``world_size / ranks_per_node`` nodes.
    """
    ctx_mp = _mp_context()
    port = free_port()
    q = ctx_mp.Queue()
    procs = []
    for ctx in _contexts(world_size, ranks_per_node or world_size, tmp_root, extra_env, fabric):
        p = ctx_mp.Process(
            target=_entry,
            args=(fn, ctx, port, tuple(args), q, collective_timeout),
            daemon=not allow_children,
        )
        p.start()
        procs.append(p)
    try:
        results, errors = _collect(procs, q, world_size, timeout, expect_killed, port)
    finally:
        for r in range(world_size):
            with contextlib.suppress(OSError):
                os.remove(_stacks_path(port, r))
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()
    unexpected_kills = [r for r in expect_killed if results.get(r) is not KILLED]
    if errors:
        msg = "\n".join(f"--- rank {r} ---\n{e}" for r, e in sorted(errors.items()))
        raise RankFailed(f"{len(errors)} rank(s) failed:\n{msg}")
    if unexpected_kills:
        raise RankFailed(f"ranks {unexpected_kills} were expected to be killed but finished")
    return [results[r] for r in range(world_size)]


def _collect(procs, q, world_size: int, timeout: float, expect_killed, port: int):
    """Every rank's result or error (a rank that died without one: its exit code), or
    RankFailed with the stacks of the ranks still running at ``timeout``."""
    import queue as _queue
    import time

    results: Dict[int, Any] = {}
    errors: Dict[int, str] = {}
    deadline = time.monotonic() + timeout
    pending = set(range(world_size))
    while pending:
        try:
            rank, status, payload = q.get(timeout=0.2)
        except _queue.Empty:
            for r in list(pending):
                if not procs[r].is_alive() and procs[r].exitcode is not None:
                    # died without reporting: SIGKILL (expected or not)
                    if procs[r].exitcode == -signal.SIGKILL and r in expect_killed:
                        results[r] = KILLED
                    else:
                        errors[r] = f"process exited with code {procs[r].exitcode} and no result"
                    pending.discard(r)
            if time.monotonic() > deadline:
                stacks = _stacks_of(procs, sorted(pending), port)
                for p in procs:
                    if p.is_alive():
                        p.kill()
                raise RankFailed(
                    f"timeout after {timeout}s; ranks still running: {sorted(pending)}; "
                    f"finished: {sorted(results)}; errors: {errors}{stacks}"
                ) from None
            continue
        pending.discard(rank)
        if status == "ok":
            results[rank] = payload
        else:
            errors[rank] = payload
    return results, errors


@dataclass
class HeldCopies:
    """What :func:`hold_copies_until_fenced` hands back."""

    release: threading.Event  # set: the held copies run
    done: threading.Event  # set once they ran


def hold_copies_until_fenced(patch: Callable[[Any, str, Any], None] = setattr) -> HeldCopies:
    """Staging's copies wait until the calling (training) thread fences a save, or until
    ``release`` is set; ``done`` is set once they ran. ``patch(obj, name, value)`` replaces the
    two hooks: ``monkeypatch.setattr`` in the test process (undone after the test), plain
    ``setattr`` in a rank process that ends with its test."""
    from resilient_ckpt.memory import staging

    main = threading.current_thread()
    held = HeldCopies(threading.Event(), threading.Event())
    real_copy, real_fence = staging._finish, staging.StagingHandle.fence

    def held_copy(*args):
        held.release.wait(timeout=60)  # the timeout only guards against a hung test
        segment = real_copy(*args)
        held.done.set()
        return segment

    def fence(self, stream=None):
        if threading.current_thread() is main:
            held.release.set()  # the training thread fences the save: let the copies run
        return real_fence(self, stream)

    patch(staging, "_finish", held_copy)
    patch(staging.StagingHandle, "fence", fence)
    return held
