"""A pool of rank processes that runs many ported test cases, each isolated from the last.

Starting ranks per test case (torch, Megatron-core and nvidia-resiliency-ext imports: ~3 s)
would cost minutes for the ~300 ported cases, so a :class:`RankPool` starts ``world_size``
processes once (the harness's forkserver, :func:`harness._mp_context`) and sends them one case
at a time. Each case is isolated from the previous one:

* **process groups**: after a case that failed on any rank, every rank destroys its default
  process group (and every group created from it) and the next case initialises gloo afresh,
  on its own prefix of one TCPStore held by the parent: collectives a failed case left
  unmatched cannot shift the next case's. After a case that passed on every rank, the
  ``teardown`` hook may keep the world (its collectives were matched on every rank): destroying
  a gloo group costs ~20 ms, and Megatron-core's model-parallel state is ~15 of them;
* **fresh directories**: ``ctx.tmp`` (shared by the ranks, under the pool's root) and
  ``ctx.shm`` (under /dev/shm) are new for every case;
* the pool's ``teardown`` hook resets module state the cases touch (Megatron's parallel
  state, patched attributes, log levels).

Failures come back as :class:`CaseFailed` with every rank's traceback and the tail of what the
rank printed during the case. A case that does not finish within its timeout, or a rank that
does not finish within ``grace`` seconds after another rank failed (typically blocked in a
collective the failed rank never entered), is reported with the Python stacks of all its
threads (faulthandler on SIGUSR1); the pool is then killed and restarted for the next case.
"""

from __future__ import annotations

import atexit
import faulthandler
import itertools
import logging
import os
import queue as _queue
import shutil
import signal
import sys
import time
import traceback
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, List, Optional

from harness import RankFailed, _mp_context


class CaseFailed(RankFailed):
    """A ported case failed on at least one rank (message: every rank's report)."""


_LOG_FORMAT = "%(levelname)-8s %(name)s:%(filename)s:%(lineno)d %(message)s"  # pytest's caplog


class LogCapture(logging.Handler):
    """What pytest's ``caplog`` gives the upstream tests, inside a rank: ``.text``, ``.records``
    and ``at_level``. Installed on the root logger for one case; the root level is WARNING
    unless a case lowers it (as under pytest)."""

    def __init__(self) -> None:
        super().__init__(level=0)
        self.records: List[logging.LogRecord] = []
        self._stream: List[str] = []
        self.setFormatter(logging.Formatter(_LOG_FORMAT))

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        self._stream.append(self.format(record) + "\n")

    @property
    def text(self) -> str:
        return "".join(self._stream)

    def clear(self) -> None:
        self.records.clear()
        self._stream.clear()

    @contextmanager
    def at_level(self, level, logger: Optional[str] = None):
        target = logging.getLogger(logger)
        old_logger, old_handler = target.level, self.level
        target.setLevel(level)
        self.setLevel(level)
        try:
            yield self
        finally:
            target.setLevel(old_logger)
            self.setLevel(old_handler)


@dataclass
class CaseContext:
    """What a case function gets as its first argument, on every rank."""

    rank: int
    world_size: int
    tmp: Path  # shared by the ranks, new per case
    shm: Path  # under /dev/shm when it exists, new per case
    case: int
    caplog: LogCapture = field(default_factory=LogCapture)


# ---- the rank side ---------------------------------------------------------------------------


def _worker(rank, world_size, store_port, requests, responses, out_path, dump_path, setup, teardown, parent):
    out = open(out_path, "ab", buffering=0)
    os.dup2(out.fileno(), 1)
    os.dup2(out.fileno(), 2)
    sys.stdout = os.fdopen(1, "w", buffering=1, closefd=False)
    sys.stderr = os.fdopen(2, "w", buffering=1, closefd=False)
    dump = open(dump_path, "w")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        GLOO_SOCKET_IFNAME=os.environ.get("GLOO_SOCKET_IFNAME", "lo"),
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=timedelta(seconds=60))
    try:
        if setup is not None:
            setup(rank, world_size)
        responses.put((-1, rank, "ok", None, ""))
    except BaseException:
        responses.put((-1, rank, "error", traceback.format_exc(), ""))
        return
    while True:
        try:
            req = requests.get(timeout=1.0)
        except _queue.Empty:
            if not _pid_alive(parent):
                return  # the test process is gone: nobody will ever send a case
            continue
        if req is None:
            return
        responses.put(_run_case(req, rank, world_size, store, out_path, teardown))


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


def _drop_world(teardown) -> None:
    """Destroy the default process group and every group made from it (after telling the
    teardown hook, which drops its references to them)."""
    import torch.distributed as dist

    if teardown is not None:
        try:
            teardown(False)
        except BaseException:
            traceback.print_exc()
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _run_case(req, rank, world_size, store, out_path, teardown):
    import torch.distributed as dist

    n, fn, args, kwargs, tmp, shm, collective_timeout, reset = req
    if reset and dist.is_initialized():  # the last case failed on some rank: a new world
        _drop_world(teardown)
    start = os.path.getsize(out_path)
    ctx = CaseContext(rank, world_size, Path(tmp), Path(shm), n)
    root = logging.getLogger()
    old_level = root.level
    root.setLevel(logging.WARNING)
    root.addHandler(ctx.caplog)
    status, payload = "ok", None
    try:
        if not dist.is_initialized():
            dist.init_process_group(
                "gloo",
                store=dist.PrefixStore(f"case{n}", store),
                rank=rank,
                world_size=world_size,
                timeout=timedelta(seconds=collective_timeout),
            )
        payload = fn(ctx, *args, **kwargs)
    except BaseException as e:  # everything goes back to the test, which decides
        status, payload = "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"
    finally:
        root.removeHandler(ctx.caplog)
        root.setLevel(old_level)
        keep = True
        try:
            if teardown is not None:
                keep = bool(teardown(status == "ok"))
        except BaseException:
            keep = False
            if status == "ok":
                status, payload = "error", "teardown failed:\n" + traceback.format_exc()
        if not (keep and status == "ok"):
            _drop_world(None)
    sys.stdout.flush()
    sys.stderr.flush()
    with open(out_path, "rb") as f:
        f.seek(start)
        printed = f.read().decode(errors="replace")
    return n, rank, status, payload, printed


# ---- the test side ---------------------------------------------------------------------------


def _tail(text: str, lines: int = 30) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


class RankPool:
    """``world_size`` long-lived rank processes; :meth:`run` executes one case on all of them.

    ``setup(rank, world_size)`` runs once per process (imports, CPU patches); ``teardown(ok)``
    after every case, on every rank (``ok``: the case passed on this rank); it returns whether
    the process groups may be kept for the next case (they are destroyed anyway when the case
    failed on any rank, see the module doc). Both must be module-level functions (they are
    pickled by reference), as must every case function.
    """

    def __init__(
        self,
        root: Path,
        world_size: int = 2,
        setup: Optional[Callable[[int, int], None]] = None,
        teardown: Optional[Callable[[bool], bool]] = None,
        case_timeout: float = 60.0,
        grace: float = 5.0,
        start_timeout: float = 120.0,
    ) -> None:
        self.root = Path(root)
        self.world_size = world_size
        self.setup, self.teardown = setup, teardown
        self.case_timeout, self.grace, self.start_timeout = case_timeout, grace, start_timeout
        self._cases = itertools.count()
        self._procs: List[Any] = []
        self.restarts = 0
        self._shm_root = Path("/dev/shm") if Path("/dev/shm").is_dir() else self.root
        self._shm_root = self._shm_root / f"upstream-pool-{os.getpid()}-{id(self):x}"
        self._reset_next = False  # the last case failed on some rank: the next gets a new world
        atexit.register(self.close)

    # -- life cycle --

    def _start(self) -> None:
        import torch.distributed as dist

        ctx = _mp_context()
        self.root.mkdir(parents=True, exist_ok=True)
        self._store = dist.TCPStore(
            "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60)
        )
        gen = self.restarts
        self._requests = [ctx.Queue() for _ in range(self.world_size)]
        self._responses = ctx.Queue()
        self._out = [self.root / f"rank{r}.gen{gen}.out" for r in range(self.world_size)]
        self._dumps = [self.root / f"rank{r}.gen{gen}.stacks" for r in range(self.world_size)]
        self._procs = []
        for r in range(self.world_size):
            p = ctx.Process(
                target=_worker,
                args=(
                    r,
                    self.world_size,
                    self._store.port,
                    self._requests[r],
                    self._responses,
                    str(self._out[r]),
                    str(self._dumps[r]),
                    self.setup,
                    self.teardown,
                    os.getpid(),
                ),
                # not a daemon: the code under test forks (Megatron-core's TemporalAsyncCaller);
                # close() / an atexit hook end the processes, and they end themselves when the
                # test process is gone
                daemon=False,
            )
            p.start()
            self._procs.append(p)
        replies = self._collect(-1, self.start_timeout, grace=self.start_timeout)
        errors = {r: rep[1] for r, rep in replies.items() if rep[0] != "ok"}
        if errors or len(replies) < self.world_size:
            report = self._report(replies, "pool start-up failed")
            self._kill()
            raise CaseFailed(report)

    def _alive(self) -> bool:
        return bool(self._procs) and all(p.is_alive() for p in self._procs)

    def _kill(self) -> None:
        for p in self._procs:
            if p.is_alive():
                p.kill()
        for p in self._procs:
            p.join(timeout=5)
        self._procs = []
        self.restarts += 1

    def close(self) -> None:
        if not self._procs:
            shutil.rmtree(self._shm_root, ignore_errors=True)
            return
        if self._alive():
            for q in self._requests:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        self._kill()
        shutil.rmtree(self._shm_root, ignore_errors=True)

    # -- running a case --

    def _collect(self, n: int, timeout: float, grace: float):
        """Replies of case ``n``: {rank: (status, payload, printed)}; stops at the deadline, at
        ``grace`` after the first error, or when a process has died."""
        replies = {}
        deadline = time.monotonic() + timeout
        while len(replies) < self.world_size:
            now = time.monotonic()
            if now > deadline:
                break
            try:
                case, rank, status, payload, printed = self._responses.get(timeout=min(0.2, deadline - now))
            except _queue.Empty:
                if any(not p.is_alive() for p in self._procs):
                    break
                continue
            if case != n:
                continue  # a late reply of an earlier case
            replies[rank] = (status, payload, printed)
            if status != "ok":
                deadline = min(deadline, time.monotonic() + grace)
        return replies

    def _stacks(self, ranks) -> dict:
        stacks = {}
        for r in ranks:
            p = self._procs[r]
            if p.is_alive():
                os.kill(p.pid, signal.SIGUSR1)
        time.sleep(0.5)
        for r in ranks:
            try:
                stacks[r] = self._dumps[r].read_text()
            except OSError as e:
                stacks[r] = f"(no stack dump: {e})"
        return stacks

    def _report(self, replies, headline: str, stacks=None) -> str:
        parts = [headline]
        for r in range(self.world_size):
            if r in replies:
                status, payload, printed = replies[r]
                if status == "ok":
                    parts.append(f"--- rank {r}: ok")
                    continue
                parts.append(f"--- rank {r}: FAILED\n{payload.rstrip()}")
            else:
                proc = self._procs[r] if r < len(self._procs) else None
                code = proc.exitcode if proc is not None else None
                state = f"died (exit code {code})" if code is not None else "did not finish"
                parts.append(f"--- rank {r}: {state}")
                if stacks and r in stacks:
                    parts.append(f"stacks of rank {r}:\n{_tail(stacks[r], 80)}")
                printed = ""
                try:
                    printed = self._out[r].read_text(errors="replace")
                except OSError:
                    pass
            if printed.strip():
                parts.append(f"output of rank {r} (tail):\n{_tail(printed)}")
        return "\n".join(parts)

    def run(self, fn: Callable, *args, timeout: Optional[float] = None, **kwargs) -> List[Any]:
        """Run ``fn(ctx, *args, **kwargs)`` on every rank; per-rank return values in rank order.

        Raises :class:`CaseFailed` (with every rank's traceback) if any rank raised, and also
        when a rank hung or died (then with its stacks; the pool restarts for the next case).
        """
        __tracebackhide__ = True  # pytest: the rank tracebacks in the message are the story
        if not self._alive():
            if self._procs:
                self._kill()
            self._start()
        timeout = timeout or self.case_timeout
        n = next(self._cases)
        tmp = self.root / f"case{n}"
        shm = self._shm_root / f"case{n}"
        tmp.mkdir(parents=True)
        shm.mkdir(parents=True)
        collective_timeout = max(5.0, timeout - 2.0)
        for q in self._requests:
            q.put((n, fn, args, kwargs, str(tmp), str(shm), collective_timeout, self._reset_next))
        replies = self._collect(n, timeout, self.grace)
        self._reset_next = not (
            len(replies) == self.world_size and all(rep[0] == "ok" for rep in replies.values())
        )
        try:
            if len(replies) < self.world_size:
                missing = [r for r in range(self.world_size) if r not in replies]
                failed = [r for r, rep in replies.items() if rep[0] != "ok"]
                why = (
                    f"rank(s) {missing} did not finish within {self.grace}s after rank(s) {failed} failed"
                    if failed
                    else f"rank(s) {missing} did not finish within {timeout}s (hung or died)"
                )
                stacks = self._stacks(missing)
                report = self._report(replies, f"{fn.__name__}: {why}; pool restarted", stacks)
                self._kill()
                raise CaseFailed(report)
            if any(rep[0] != "ok" for rep in replies.values()):
                failed = sorted(r for r, rep in replies.items() if rep[0] != "ok")
                raise CaseFailed(self._report(replies, f"{fn.__name__}: failed on rank(s) {failed}"))
            return [replies[r][1] for r in range(self.world_size)]
        finally:
            shutil.rmtree(shm, ignore_errors=True)
            shutil.rmtree(tmp, ignore_errors=True)
