"""The bench launcher: run a function in W fresh rank processes (a gloo group on loopback, or
each node's ranks inside that node's namespace of a network fabric, :mod:`.fabric`).

Shared by :mod:`.runner` (the benchmark's save and restore phases) and :mod:`.limits` (the
transport measurements); it imports neither, so the two do not import each other.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue as queue_mod
import re
import signal
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

from ..errors import CheckpointingException, ValidationError
from ..ports import free_port
from .fabric import Fabric, NodeNet, join

_NOISE = (
    "The pynvml package is deprecated",
    "Transformer Engine and Apex are not installed",
    "The TemporalAsyncCaller will be deprecated",
    "`_get_pg_default_device` will be deprecated",
    "Multiple backends are registered with this ProcessGroup",
)


@dataclass(frozen=True)
class RankContext:
    """A rank's identity and its node's store root, as a system's ``setup`` receives it."""

    rank: int
    world_size: int
    ranks_per_node: int
    tmp_root: str
    session: str = "bench"
    replication_factor: int = 2
    phase: str = "save"  # "save" | "restore"
    services: Any = None  # NodeServices.info of the system's per-node services, if any
    net: Optional[NodeNet] = None  # this rank's node on a network fabric (None: loopback)

    @property
    def node(self) -> int:
        return self.rank // self.ranks_per_node

    @property
    def local_rank(self) -> int:
        return self.rank % self.ranks_per_node

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    @property
    def store_root(self) -> str:
        """This node's store directory: all node-local state of a system must live below it."""
        return node_store_root(self.tmp_root, self.node)

    @property
    def dp_group(self):
        """The data-parallel (fully parallel save/load) group: every rank."""
        import torch.distributed as dist

        return dist.group.WORLD


def node_store_root(tmp_root: str, node: int) -> str:
    return str(Path(tmp_root) / f"node{node}")


# resilient_ckpt first: it silences torch's pynvml warning before torch is imported. The
# baseline (megatron-core, ~3 s to import) is preloaded for every system alike, so all rank
# processes start from the same resident pages and RSS figures compare fairly.
_PRELOAD = [
    "resilient_ckpt",
    "torch",
    "torch.distributed",
    "numpy",
    "resilient_ckpt.bench.workload",
    "resilient_ckpt.bench.baseline",
]


#: What a fork server whose ranks use CUDA may preload: these modules do not initialise CUDA at
#: import. Preloading the baseline (megatron-core, nvrx's async queue) on a CUDA build left every
#: rank forked from the server failing its first CUDA call with "Cannot re-initialize CUDA in
#: forked subprocess" (seen on an H200 with torch 2.11+cu130).
CUDA_SAFE_PRELOAD = (
    "resilient_ckpt",
    "torch",
    "torch.distributed",
    "numpy",
    "resilient_ckpt.bench.workload",
)
_cuda_ranks = False  # set by mp_context(cuda=True) in the parent; sticky for the run


def mp_context(preload: Sequence[str] = (), *, cuda: bool = False):
    """The bench's fork server. ``cuda``: its ranks will use the GPU, so it preloads only
    :data:`CUDA_SAFE_PRELOAD` and each rank imports the rest itself right after it starts
    (:func:`deferred_imports`), every system alike. The first call that starts the server wins."""
    global _cuda_ranks
    _cuda_ranks = _cuda_ranks or cuda
    ctx = mp.get_context("forkserver")
    # Only effective before the fork server starts (the first launch): heavy imports such as
    # megatron-core (~3 s) then happen once, not in every rank of every phase.
    wanted = list(dict.fromkeys(_PRELOAD + list(preload)))
    ctx.set_forkserver_preload([m for m in wanted if m in CUDA_SAFE_PRELOAD] if _cuda_ranks else wanted)
    return ctx


def deferred_imports(preload: Sequence[str] = ()) -> List[str]:
    """The modules a rank imports itself after starting (the fork server left them out)."""
    if not _cuda_ranks:
        return []
    return [m for m in dict.fromkeys(_PRELOAD + list(preload)) if m not in CUDA_SAFE_PRELOAD]


def quiet() -> None:
    """Silence the known import-time warnings of torch, megatron-core and nvrx."""
    for msg in _NOISE:
        warnings.filterwarnings("ignore", message=f".*{re.escape(msg)}")
    import logging

    logging.getLogger("nvidia_resiliency_ext").setLevel(logging.ERROR)


def _entry(
    fn,
    ctx: RankContext,
    port: int,
    args,
    result_q,
    hold: bool,
    init_pg: bool,
    pg_timeout_s: float,
    imports: Sequence[str] = (),
) -> None:
    # A process group of its own: the launcher ends the rank with the writers it forks
    # (nvidia-resiliency-ext's async saves fork them), as a job's end takes its children.
    os.setpgid(0, 0)
    node_env = join(ctx.net)  # first: every socket and thread of the rank lives on its node
    master = node_env["MASTER_ADDR"]
    os.environ.update(
        MASTER_PORT=str(port),
        RANK=str(ctx.rank),
        WORLD_SIZE=str(ctx.world_size),
        LOCAL_RANK=str(ctx.local_rank),
        LOCAL_WORLD_SIZE=str(ctx.ranks_per_node),
        **node_env,
    )
    quiet()
    import importlib

    import torch
    import torch.distributed as dist

    for module in imports:  # what the fork server could not preload (see mp_context)
        importlib.import_module(module)

    # W ranks share this machine's cores: one intra-op thread each, as one rank per GPU would.
    torch.set_num_threads(1)
    try:
        if init_pg:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://{master}:{port}",
                rank=ctx.rank,
                world_size=ctx.world_size,
                timeout=timedelta(seconds=pg_timeout_s),
            )
        result_q.put((ctx.rank, "ok", fn(ctx, *args)))
    except BaseException as e:  # the parent decides; it kills every rank on any error
        result_q.put((ctx.rank, "error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}"))
    if hold:
        # Wait for SIGKILL: the phase ends the way a crash ends a job, with nothing cleaned up.
        threading.Event().wait()
    if init_pg and dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass


def _start_rank(ctx_mp, fn: Callable[..., Any], ctx: RankContext, entry_args: tuple):
    p = ctx_mp.Process(
        target=_entry,
        args=(fn, ctx, *entry_args),
        # not daemonic: systems may fork writers (nvrx does); launch() always reaps them
        daemon=False,
        name=f"bench-rank{ctx.rank}",
    )
    p.start()
    return p


def _kill_all(procs: list) -> None:
    """SIGKILL every rank still running, and what it forked (its process group)."""
    for p in procs:
        if p.is_alive():
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):  # not yet its own group leader
                p.kill()
    for p in procs:
        p.join(timeout=30)


def _check_ranks_alive(procs: list, results: Dict[int, Any], deadline: float, timeout: float) -> None:
    """Raise when a rank without a result died or the phase ran out of time."""
    dead = [r for r, p in enumerate(procs) if r not in results and not p.is_alive()]
    if dead:
        raise CheckpointingException(
            f"bench rank(s) {dead} died without a result (exit codes "
            f"{[procs[r].exitcode for r in dead]}); out of memory? Try smaller --sizes"
        ) from None  # the empty queue is only the poll's timeout
    if time.monotonic() > deadline:
        raise CheckpointingException(
            f"bench phase timed out after {timeout:.0f}s; ranks without a result: "
            f"{sorted(set(range(len(procs))) - set(results))}"
        ) from None


def _collect_results(q, procs: list, timeout: float, results: Dict[int, Any]) -> None:
    """Fill ``results`` (rank -> payload) until every rank reported; raise on the first error."""
    deadline = time.monotonic() + timeout
    while len(results) < len(procs):
        try:
            rank, status, payload = q.get(timeout=0.2)
        except queue_mod.Empty:
            _check_ranks_alive(procs, results, deadline, timeout)
            continue
        if status != "ok":
            raise CheckpointingException(f"bench rank {rank} failed:\n{payload}")
        results[rank] = payload


def launch(
    fn: Callable[..., Any],
    world_size: int,
    tmp_root: str,
    *,
    ranks_per_node: Optional[int] = None,
    args: Sequence[Any] = (),
    hold: bool = False,
    init_process_group: bool = True,
    timeout: float = 300.0,
    session: str = "bench",
    replication_factor: int = 2,
    phase: str = "save",
    services: Any = None,
    preload: Sequence[str] = (),
    fabric: Optional[Fabric] = None,
) -> List[Any]:
    """Run ``fn(ctx, *args)`` in ``world_size`` fresh processes; results in rank order.

    With ``hold`` every rank waits after reporting and is then SIGKILLed (all of them, only
    after all reported). Any rank error, unexpected death or timeout kills all ranks and
    raises :class:`CheckpointingException` with the rank's traceback. ``fabric``: node n's
    ranks run in the fabric's node n (``ctx.net``), which must exist.
    """
    if world_size < 1:
        raise ValidationError(f"world_size={world_size}: pass at least 1 rank")
    rpn = ranks_per_node or world_size
    if fabric is not None and fabric.nodes < -(-world_size // rpn):
        raise ValidationError(
            f"{world_size} ranks at {rpn} per node need more than {fabric.nodes} fabric nodes"
        )
    ctx_mp = mp_context(preload)
    port = free_port()
    q = ctx_mp.Queue()
    imports = tuple(deferred_imports(preload))
    entry_args = (port, tuple(args), q, hold, init_process_group, max(timeout, 60.0), imports)
    procs = [
        _start_rank(
            ctx_mp,
            fn,
            RankContext(
                r,
                world_size,
                rpn,
                str(tmp_root),
                session,
                replication_factor,
                phase,
                services,
                fabric.net(r // rpn) if fabric is not None else None,
            ),
            entry_args,
        )
        for r in range(world_size)
    ]
    results: Dict[int, Any] = {}
    try:
        _collect_results(q, procs, timeout, results)
    finally:
        if not hold and len(results) == world_size:  # they exit by themselves: let them
            for p in procs:
                p.join(timeout=30)
        _kill_all(procs)
        q.close()
    return [results[r] for r in range(world_size)]
