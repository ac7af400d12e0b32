"""Rank processes forked from one process that imported a training framework once.

Lightning or transformers take 6-7 s of CPU to import; four ranks importing them at every start of
a simulated job would cost ~25 s per job on two cores. A :class:`Zygote` is one fresh process
(spawned: no threads, nothing initialized) that imports the framework once and then runs
:func:`harness.run_ranks` itself, with the harness's start method switched to ``fork``: every
rank is a fork of the zygote and starts with the framework already imported. Everything else is
the harness's (environment, gloo world, node store roots, SIGKILL accounting, timeouts).

The zygote also runs a single function in a forked child (:meth:`Zygote.call_forked`), for
in-process framework tests that must not leave state (environment variables, process groups)
in the pytest process.
"""

from __future__ import annotations

import atexit
import importlib
import multiprocessing as mp
import traceback
from typing import Any, Callable, Sequence


def _serve(conn, preload: Sequence[str]) -> None:
    for name in preload:
        importlib.import_module(name)
    import harness

    harness._CTX = mp.get_context("fork")  # ranks are forks of this process
    while True:
        request = conn.recv()
        if request is None:
            return
        fn, args, kwargs = request
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException as e:  # the test re-raises it
            conn.send(("error", e, traceback.format_exc()))


def _in_child(fn, args, kwargs, conn) -> None:
    try:
        conn.send(("ok", fn(*args, **kwargs)))
    except BaseException as e:
        conn.send(("error", repr(e), traceback.format_exc()))


def _forked(fn: Callable[..., Any], args, kwargs, timeout: float) -> Any:
    ctx = mp.get_context("fork")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_in_child, args=(fn, args, kwargs, child))
    p.start()
    child.close()
    if not parent.poll(timeout):
        p.kill()
        p.join()
        raise TimeoutError(f"{fn.__name__} did not finish within {timeout} s")
    status, *payload = parent.recv()
    p.join()
    if status == "error":
        raise AssertionError(f"{fn.__name__} failed in its process: {payload[0]}\n{payload[1]}")
    return payload[0]


#: what the framework tests' ranks need imported (one zygote serves them all in a session)
FRAMEWORKS = (
    "torch",
    "torch.distributed",
    "lightning.pytorch",
    "nvidia_resiliency_ext.ptl_resiliency.local_checkpoint_callback",
    "resilient_ckpt.integrations.lightning",
    "transformers.trainer",
    "resilient_ckpt.integrations.huggingface",
)

_SHARED = None


class Zygote:
    @classmethod
    def shared(cls) -> "Zygote":
        """One zygote per test session, with :data:`FRAMEWORKS` imported; closed at exit."""
        global _SHARED
        if _SHARED is None:
            _SHARED = cls(FRAMEWORKS)
            atexit.register(_SHARED.close)  # before multiprocessing's exit hook joins it
        return _SHARED

    def __init__(self, preload: Sequence[str]):
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        # not daemonic: it starts the rank processes
        self._proc = ctx.Process(target=_serve, args=(child, list(preload)), daemon=False)
        self._proc.start()
        child.close()

    def _request(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        self._conn.send((fn, args, kwargs))
        status, *payload = self._conn.recv()
        if status == "error":
            err, tb = payload
            raise type(err)(f"{err}\n(in the zygote)\n{tb}") if isinstance(err, AssertionError) else err
        return payload[0]

    def run_ranks(self, fn: Callable[..., Any], world_size: int, tmp_root, **kwargs: Any) -> list:
        """``harness.run_ranks`` with the ranks forked from the zygote."""
        import harness

        return self._request(harness.run_ranks, fn, world_size, str(tmp_root), **kwargs)

    def call_forked(self, fn: Callable[..., Any], *args: Any, timeout: float = 120.0, **kwargs: Any) -> Any:
        """``fn(*args, **kwargs)`` in a process forked from the zygote; its result or its failure."""
        return self._request(_forked, fn, args, kwargs, timeout)

    def close(self) -> None:
        try:
            self._conn.send(None)
        except OSError:
            pass
        self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()
