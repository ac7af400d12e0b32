"""Side-by-side benchmark: our checkpointing against Megatron-core + nvidia-resiliency-ext.

One configuration = (system, bytes per rank B, world size W). Each repetition:

1. **save phase**: W fresh rank processes (gloo group, ``ranks_per_node`` ranks per simulated
   node, one store directory per node under a temporary directory on ``/dev/shm``) build the
   workload, ``setup`` the system, save ``--warmup-saves`` times (default 3, iterations 100,
   110, 120: the steady state a real job reaches after a few saves), advance, then save
   iteration 200 - timed: *stall* = the ``save`` call (the loop may mutate its tensors
   when it returns, and the runner does so at once), *durable* = until ``wait()`` on the
   returned handle returns (stored + replicated + agreed complete on all ranks). The ranks
   then get SIGKILL, no teardown: a crash.
2. **restore after process restart**: fresh processes on the same nodes build a zero template,
   ``setup`` (manager constructed, process group up), then ``restore(template)`` is timed;
   the result is checked bit-exactly against iteration 200 *after* timing.
3. **restore after node loss**: node 0's services (if the system runs any) are killed, its
   store directory is deleted, a replacement node starts empty, then as 2: its ranks must
   get their data from replicas on the other node.

``--device cuda``: every rank's workload tensors and restore templates live on
``cuda:<local rank % device count>`` (several ranks may share one GPU); process groups stay
gloo, so the systems' own CUDA paths (D2H staging, pinned buffers, H2D on restore) are what
differs from a CPU run. Restores must come back on that device.

``--fabric netns``: every simulated node is a network namespace with its own address, linked
to a bridge by a veth pair shaped to ``--link-rates`` (:mod:`resilient_ckpt.bench.fabric`); ranks
and daemons run inside their node, replication and restores cross the shaped links. Each
configuration then runs once per link rate, and the run also measures what one link delivers
(:func:`resilient_ckpt.bench.limits.link_limits`).

Figures per repetition are the max over ranks; reported figures are medians over repetitions.
Peak RSS is ``VmHWM`` from ``/proc/self/status`` (resident pages of the rank process, shared
and file pages it mapped included), reset through ``/proc/self/clear_refs`` right before the
timed save and before the restore. The same run measures the machine's limits
(:mod:`resilient_ckpt.bench.limits`).

Systems implement :class:`System` (see its docstring) and are named in :data:`SYSTEMS` or
given as ``module:Class``.
"""

from __future__ import annotations

import importlib
import os
import resource
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Dict, List, Optional, Protocol

from ..errors import ValidationError
from ..timing import DEVICE
from .fabric import Fabric, LinkShape, format_rate

# RankContext and node_store_root are part of the System interface, so named here too.
from .launcher import RankContext, launch, node_store_root
from .loop import COMPUTE_MARGIN, SAVE_EVERY, Compute, PrivateMemory, pinned_host_bytes, run_loop
from .workload import expected_saved_bytes, format_size

#: Built-in systems: name -> "module:Class". ``resilient_ckpt.bench.ours`` is the lead's.
SYSTEMS: Dict[str, str] = {
    "baseline": "resilient_ckpt.bench.baseline:BaselineSystem",
    # the baseline's AsyncRequest run inside the rank (no fork): its best case for durability
    "baseline-inline": "resilient_ckpt.bench.baseline:BaselineInlineSystem",
    "ours-embedded": "resilient_ckpt.bench.ours:EmbeddedSystem",
    "ours-service": "resilient_ckpt.bench.ours:ServiceSystem",
    # the least memory: newest complete iteration only, no spare segment
    "ours-lean": "resilient_ckpt.bench.ours:LeanSystem",
    # two complete iterations kept (the default before issue 22)
    "ours-keep2": "resilient_ckpt.bench.ours:KeepTwoSystem",
    # GPU state through a device snapshot on every save
    "ours-snapshot": "resilient_ckpt.bench.ours:SnapshotSystem",
    # the reference's retention, XOR parity groups of k=4 (nodes-1 when fewer) instead of replicas
    "ours-parity": "resilient_ckpt.bench.ours:ParitySystem",
    # Reed-Solomon parity_shares=2 (k=2 where groups of 4 nodes tile the job)
    "ours-parity-rs": "resilient_ckpt.bench.ours:ParityRSSystem",
}
BASELINE = "baseline"
TIME_METRICS = ("stall_s", "durable_s", "restore_restart_s", "restore_node_loss_s")
RSS_METRICS = ("peak_rss_save_bytes", "peak_rss_restore_bytes")
RSS_METHOD = (
    "VmHWM of each rank process (/proc/self/status: peak resident set incl. shared-memory and "
    "file pages it mapped), reset via /proc/self/clear_refs before the timed save and before "
    "the restore; max over ranks"
)
FIRST_ITERATION = 100
ITERATION = 200


# --- what systems see ------------------------------------------------------------------------


@dataclass(frozen=True)
class ClusterSpec:
    """What a system's optional ``start_nodes`` gets in the runner (parent) process."""

    world_size: int
    ranks_per_node: int
    tmp_root: str
    session: str
    replication_factor: int
    #: the network fabric the nodes live on (``--fabric netns``), None on loopback
    fabric: Optional[Fabric] = None

    @property
    def num_nodes(self) -> int:
        return -(-self.world_size // self.ranks_per_node)

    def store_root(self, node: int) -> str:
        return node_store_root(self.tmp_root, node)


class PendingSave(Protocol):
    """Returned by ``System.save`` once the training loop may mutate its tensors again."""

    def wait(self) -> None:
        """Block until the checkpoint is stored, replicated and agreed complete by all ranks."""


@dataclass
class SaveHandle:
    """A ready-made :class:`PendingSave`: ``wait`` calls ``wait_fn``. ``saved_bytes`` (optional)
    is the tensor bytes this rank stores as its own after dedup; reported, not required."""

    wait_fn: Callable[[], Any]
    saved_bytes: Optional[int] = None
    #: optional breakdown in seconds (e.g. {"write_s": ...}), filled by the system, reported
    details: Dict[str, float] = field(default_factory=dict)
    #: optional: orders the loop's next mutation of the saved tensors after the save's copies
    #: (e.g. a CUDA stream wait); the runner calls it right before mutating
    fence_fn: Optional[Callable[[], Any]] = None

    def wait(self) -> None:
        self.wait_fn()

    def fence(self) -> None:
        if self.fence_fn is not None:
            self.fence_fn()


class NodeServices(Protocol):
    """Per-node services a system runs outside the trainer (e.g. daemons); optional.

    Node loss is simulated as ``kill_node(0)`` (SIGKILL the node's services), the runner
    wiping the node's store root, then ``start_node(0)`` (an empty replacement node).
    """

    info: Any  # picklable; every rank gets it as ``ctx.services`` (re-read before each phase)

    def kill_node(self, node: int) -> None:
        """End node ``node``'s services the way a crash would."""

    def start_node(self, node: int) -> None:
        """Start services for a replacement node ``node`` on its (now empty) store root."""

    def stop(self) -> None:
        """Stop all services; the runner removes the temporary directory afterwards."""


class System(Protocol):
    """One benchmarked checkpointing system; an instance lives in each rank process.

    Class attributes: ``name`` (shown in reports) and ``flavour`` - the workload's mapping
    objects it consumes: ``"ours"`` (resilient_ckpt.model.mapping) or ``"mcore"`` (megatron-core).
    Optional classmethods: ``start_nodes(cluster: ClusterSpec) -> NodeServices`` (called in
    the runner before each repetition's first phase) and
    ``memory_estimate(bytes_per_rank, world_size) -> int`` (host bytes for the whole run;
    configurations that do not fit in available memory are skipped with a line saying so).

    The runner times the calls itself; a system only has to return at the right moment.
    """

    name: ClassVar[str]
    flavour: ClassVar[str]

    def setup(self, ctx: RankContext) -> None:
        """Construct managers / connect to services (not timed). The process group is up."""

    def save(self, state: Any, iteration: int) -> PendingSave:
        """Start saving the sharded state dict; return when the loop may mutate ``state``'s
        tensors. ``state`` is a fresh sharded state dict (its wrappers may be consumed)."""

    def restore(self, template: Any) -> Any:
        """Restore the latest complete checkpoint into a plain state dict shaped like
        ``template`` (a sharded state dict whose tensors are zeros). All ranks call it."""

    def teardown(self) -> None:
        """Release resources (called after a restore phase, never after the save phase)."""


def load_system(spec: str) -> type:
    """Import ``module:Class``; raises ImportError/AttributeError with the reason."""
    module, _, cls = spec.partition(":")
    mod = importlib.import_module(module)
    return getattr(mod, cls)


def resolve_system(name: str) -> str:
    if name in SYSTEMS:
        return SYSTEMS[name]
    if ":" in name:
        return name
    raise ValidationError(f"unknown system {name!r}: use {', '.join(SYSTEMS)} or module:Class")


# --- measurements inside ranks -----------------------------------------------------------------


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _status_kib(field_name: str) -> Optional[int]:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_rss_bytes() -> int:
    """VmHWM; ``ru_maxrss`` (not resettable) where /proc is missing."""
    v = _status_kib("VmHWM")
    return v if v is not None else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def current_rss_bytes() -> Optional[int]:
    return _status_kib("VmRSS")


def _children_peak_rss_bytes() -> int:
    # largest waited-for child (e.g. nvrx's forked writer); not resettable, hence "info" only
    return resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024


@dataclass(frozen=True)
class RunSpec:
    system: str  # module:Class
    bytes_per_rank: int
    seed: int = 0
    #: saves before the timed one: a real job saves hundreds of times, so what matters is
    #: the steady state (buffers and pages reused), for every system alike
    warmup_saves: int = 3
    #: where the workload's tensors live: "cpu" or "cuda" (each rank on its local GPU)
    device: str = "cpu"
    #: saves in the training-loop phase (0: no loop phase; see bench.loop)
    loop_saves: int = 0


DEVICES = ("cpu", "cuda")


def rank_device(ctx: RankContext, device: str) -> str:
    """The device a rank's tensors live on; for CUDA also made the rank's current device
    (``cuda:<local rank % device count>``: ranks of a node share its GPUs round-robin)."""
    if device == "cpu":
        return "cpu"
    import torch

    if not torch.cuda.is_available():
        raise ValidationError(f"rank {ctx.rank}: device {device!r} asked for, but torch sees no CUDA device")
    index = ctx.local_rank % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def _save_phase(ctx: RankContext, spec: RunSpec) -> Dict[str, Any]:
    import torch.distributed as dist

    from .workload import Workload

    cls = load_system(spec.system)
    wl = Workload(
        spec.bytes_per_rank,
        ctx.world_size,
        ctx.rank,
        flavour=cls.flavour,
        seed=spec.seed,
        iteration=FIRST_ITERATION,
        device=rank_device(ctx, spec.device),
    )
    system = cls()
    system.setup(ctx)
    out: Dict[str, Any] = {"stalls_s": [], "durables_s": []}
    schedule = [("first", FIRST_ITERATION)]
    schedule += [("warmup", FIRST_ITERATION + 10 * k) for k in range(1, spec.warmup_saves)]
    schedule.append(("steady", ITERATION))
    cuda = wl.device.type == "cuda"
    with PrivateMemory() as private:
        for label, iteration in schedule:
            wl.advance(iteration)
            state = wl.sharded_state_dict()
            dist.barrier()
            if label == "steady":
                out["rss_reset"] = reset_peak_rss()
                out["rss_at_start_bytes"] = current_rss_bytes()
            t0 = time.perf_counter()
            pending = system.save(state, iteration)
            fence = getattr(pending, "fence", None)
            if fence is not None:
                fence()
            if cuda:  # stall = until the tensors may be mutated, the GPU's copies included
                import torch

                torch.cuda.synchronize(wl.device)
            t1 = time.perf_counter()
            # The loop goes on at once: a save that still reads the live tensors after
            # returning would store this, and the bit-exact restore check would catch it.
            wl.advance(iteration + 1)
            pending.wait()
            t2 = time.perf_counter()
            out["stalls_s"].append(t1 - t0)
            out["durables_s"].append(t2 - t0)
            if label != "warmup":
                out[f"{label}_stall_s"] = t1 - t0
                out[f"{label}_durable_s"] = t2 - t0
            out["saved_bytes"] = getattr(pending, "saved_bytes", None)
            out["details"] = dict(getattr(pending, "details", None) or {})
            del state, pending
    out["peak_rss_save_bytes"] = peak_rss_bytes()
    out["peak_private_save_bytes"] = private.peak
    out["pinned_host_bytes"] = pinned_host_bytes()
    out["writer_child_peak_rss_bytes"] = _children_peak_rss_bytes() or None
    return out


def _restore_phase(ctx: RankContext, spec: RunSpec) -> Dict[str, Any]:
    import torch.distributed as dist

    from .workload import Workload, layout, verify

    cls = load_system(spec.system)
    device = rank_device(ctx, spec.device)
    tmpl = Workload(
        spec.bytes_per_rank,
        ctx.world_size,
        ctx.rank,
        flavour=cls.flavour,
        seed=spec.seed,
        fill="zeros",
        device=device,
    )
    template = tmpl.sharded_state_dict()
    system = cls()
    system.setup(ctx)
    dist.barrier()
    rss_reset = reset_peak_rss()
    rss_start = current_rss_bytes()
    with PrivateMemory() as private:
        t0 = time.perf_counter()
        restored = system.restore(template)
        returned = time.perf_counter()
        if device != "cpu":
            # restored means usable: copies a system left in flight on the GPU count
            import torch

            torch.cuda.synchronize()
        t1 = time.perf_counter()
    peak = peak_rss_bytes()
    # Where this rank's restore spent its time, when the system can say (ours: by phase); the
    # device copies still in flight when it returned are waited for here.
    phases = system.restore_phases() if hasattr(system, "restore_phases") else None
    if phases is not None and device != "cpu":
        phases[DEVICE] = phases.get(DEVICE, 0.0) + t1 - returned
    del template, tmpl
    problems = verify(
        restored,
        layout(spec.bytes_per_rank, ctx.world_size, ctx.rank, seed=spec.seed),
        ITERATION,
        device=device,
    )
    del restored
    system.teardown()
    return {
        "restore_s": t1 - t0,
        "phases": phases,
        "peak_rss_bytes": peak,
        "peak_private_bytes": private.peak,
        "peak_unshared_bytes": private.peak_unshared,
        "rss_reset": rss_reset,
        "rss_at_start_bytes": rss_start,
        "problems": problems,
    }


def _loop_phase(ctx: RankContext, spec: RunSpec, durable_s: float) -> Dict[str, Any]:
    """One rank's loop-overhead measurement (see :mod:`.loop`): the same training loop without
    saves, then saving every SAVE_EVERY steps; compute between saves outlasts a save."""
    import torch.distributed as dist

    from .workload import Workload

    cls = load_system(spec.system)
    device = rank_device(ctx, spec.device)
    wl = Workload(
        spec.bytes_per_rank, ctx.world_size, ctx.rank, flavour=cls.flavour, seed=spec.seed, device=device
    )
    # every rank the same compute: the slowest rank's durable
    compute = Compute(wl.device, COMPUTE_MARGIN * durable_s / SAVE_EVERY)
    system = cls()
    system.setup(ctx)
    steps = SAVE_EVERY * spec.loop_saves
    dist.barrier()
    without = run_loop(wl, compute, system, steps, 1_000, save=False)
    dist.barrier()
    with PrivateMemory() as mem:
        saving = run_loop(wl, compute, system, steps, 1_000 + steps, save=True)
    dist.barrier()
    system.teardown()
    return {
        "without_s": without["seconds"],
        "with_s": saving["seconds"],
        "saves": saving["saves"],
        "overhead_per_save_s": (saving["seconds"] - without["seconds"]) / max(1, saving["saves"]),
        "step_s": without["seconds"] / max(1, steps),
        "peak_private_bytes": mem.peak,
    }


# --- one configuration -------------------------------------------------------------------------


def _dir_bytes(root: str) -> int:
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            try:
                total += os.stat(os.path.join(dirpath, f)).st_blocks * 512
            except OSError:
                pass
    return total


def _median(values: List[Any]) -> Optional[float]:
    vals = [v for v in values if isinstance(v, (int, float))]  # per-save lists have none
    return statistics.median(vals) if vals else None


def _max_or_none(values: List[Optional[float]]) -> Optional[float]:
    vals = [v for v in values if v is not None]
    return max(vals) if vals else None


def _metric(values: List[Optional[float]]) -> Dict[str, Any]:
    return {"median": _median(values), "values": values}


def lose_node(cluster: ClusterSpec, services: Optional[NodeServices], node: int) -> None:
    """Node ``node`` dies with its memory and comes back empty."""
    if services is not None:
        services.kill_node(node)
    shutil.rmtree(cluster.store_root(node), ignore_errors=True)
    os.makedirs(cluster.store_root(node), exist_ok=True)
    if services is not None:
        services.start_node(node)


def default_ranks_per_node(world_size: int) -> int:
    """Two simulated nodes (one for a single rank): replicas must cross a node boundary."""
    return max(1, world_size // 2)


#: Per-repetition figures of a configuration, in the order its record lists them (the
#: systems' ``details`` are appended as ``detail_<name>`` when first seen).
_REP_METRICS = (
    *TIME_METRICS,
    *RSS_METRICS,
    "first_stall_s",
    "first_durable_s",
    "saved_bytes",
    "store_bytes_per_rank",
    "writer_child_peak_rss_bytes",
    "peak_rss_restore_restart_bytes",
    "peak_rss_restore_node_loss_bytes",
    "rss_at_start_save_bytes",
    "rss_at_start_restore_bytes",
    "max_stall_s",
    "peak_private_save_bytes",
    "pinned_host_bytes",
    "host_bytes_per_rank",
    "loop_overhead_s",
    "loop_step_s",
)
#: The restore phases of a repetition, in order: (case, metric of its time).
_RESTORE_CASES = (("restart", "restore_restart_s"), ("node_loss", "restore_node_loss_s"))


@dataclass(frozen=True)
class _Config:
    """One configuration (system, size, world size) and how its phases are launched."""

    name: str
    spec: RunSpec
    cls: type
    world_size: int
    ranks_per_node: int
    replication_factor: int
    shm_dir: str
    log: Callable[[str], None]
    #: each node's link (``--fabric netns``); None: loopback
    link: Optional[LinkShape] = None

    @property
    def label(self) -> str:
        where = (
            f" @ {format_rate(self.link.rate_bps)}" if self.link is not None and self.link.rate_bps else ""
        )
        return f"{self.name} {format_size(self.spec.bytes_per_rank)} W={self.world_size}{where}"

    def session(self, rep: int) -> str:
        return f"bench-{self.name}-{format_size(self.spec.bytes_per_rank)}-w{self.world_size}-r{rep}"

    def launch_phase(
        self,
        fn: Callable[..., Any],
        cluster: ClusterSpec,
        phase: str,
        services: Optional[NodeServices],
        *args,
    ) -> List[Any]:
        """Run ``fn`` in every rank; the ranks are SIGKILLed afterwards, as in a crash."""
        gib = self.spec.bytes_per_rank / (1 << 30)
        return launch(
            fn,
            self.world_size,
            cluster.tmp_root,
            args=(self.spec, *args),
            phase=phase,
            # re-read for every phase: a replacement node's services may have changed it
            services=getattr(services, "info", None),
            ranks_per_node=self.ranks_per_node,
            session=cluster.session,
            replication_factor=self.replication_factor,
            timeout=300.0 + 240.0 * gib * self.world_size,
            preload=[self.spec.system.partition(":")[0]],
            hold=True,
            fabric=cluster.fabric,
        )


@dataclass
class _Tally:
    """What the repetitions of one configuration collect."""

    per_rep: Dict[str, List[Any]] = field(default_factory=lambda: {k: [] for k in _REP_METRICS})
    errors: List[str] = field(default_factory=list)
    rss_reset_ok: bool = True
    #: per restore case: per repetition, every rank's seconds by phase (systems that say)
    restore_phases: Dict[str, List[List[Dict[str, float]]]] = field(default_factory=dict)


def _start_cluster(cls: type, cluster: ClusterSpec) -> Optional[NodeServices]:
    """Create every node's store root and start the system's node services, if it has any."""
    for n in range(cluster.num_nodes):
        os.makedirs(cluster.store_root(n), exist_ok=True)
    return cls.start_nodes(cluster) if hasattr(cls, "start_nodes") else None


def _record_saves(tally: _Tally, rep: int, saves: List[Dict[str, Any]], cluster: ClusterSpec) -> None:
    per_rep = tally.per_rep
    per_rep["stall_s"].append(max(r["steady_stall_s"] for r in saves))
    per_rep["durable_s"].append(max(r["steady_durable_s"] for r in saves))
    per_rep["first_stall_s"].append(max(r["first_stall_s"] for r in saves))
    per_rep["first_durable_s"].append(max(r["first_durable_s"] for r in saves))
    per_rep["peak_rss_save_bytes"].append(max(r["peak_rss_save_bytes"] for r in saves))
    per_rep["rss_at_start_save_bytes"].append(_max_or_none([r["rss_at_start_bytes"] for r in saves]))
    sb = [r["saved_bytes"] for r in saves]
    per_rep["saved_bytes"].append(None if None in sb else max(sb))
    wc = [r["writer_child_peak_rss_bytes"] for r in saves if r["writer_child_peak_rss_bytes"]]
    per_rep["writer_child_peak_rss_bytes"].append(max(wc) if wc else None)
    store = _dir_bytes(cluster.tmp_root) / cluster.world_size
    per_rep["store_bytes_per_rank"].append(store)
    # Every save from the first after a start: nothing hidden by warm-up saves.
    per_rep["max_stall_s"].append(max(max(r["stalls_s"]) for r in saves))
    per_rep.setdefault("stalls_s", [None] * rep).append(
        [max(r["stalls_s"][i] for r in saves) for i in range(len(saves[0]["stalls_s"]))]
    )
    private = max(r["peak_private_save_bytes"] for r in saves)
    pinned = max(r["pinned_host_bytes"] for r in saves)
    per_rep["peak_private_save_bytes"].append(private)
    per_rep["pinned_host_bytes"].append(pinned)
    # What a node needs per rank: the store (shared pages, once) + private memory + page-locked
    # host allocations (counted apart: drivers do not always show them in RssAnon).
    per_rep["host_bytes_per_rank"].append(store + private + pinned)
    for k in sorted({k for r in saves for k in r["details"]}):
        # a detail first seen in a later repetition has no figure for the earlier ones
        per_rep.setdefault(f"detail_{k}", [None] * rep).append(
            _max_or_none([r["details"].get(k) for r in saves])
        )
    tally.rss_reset_ok &= all(r["rss_reset"] for r in saves)


def _restore_problems(rep: int, case: str, results: List[Dict[str, Any]]) -> List[str]:
    return [
        f"rep {rep} {case}: rank {rank} restore is not bit-exact: " + "; ".join(r["problems"])
        for rank, r in enumerate(results)
        if r["problems"]
    ]


def _restore_phases(
    cfg: _Config, cluster: ClusterSpec, services: Optional[NodeServices], rep: int, tally: _Tally
) -> None:
    """Restore after a process restart, then after losing node 0; each checked bit-exactly."""
    per_rep = tally.per_rep
    peaks, starts = [], []
    for case, metric in _RESTORE_CASES:
        if case == "node_loss":
            lose_node(cluster, services, 0)
        res = cfg.launch_phase(_restore_phase, cluster, "restore", services)
        per_rep[metric].append(max(r["restore_s"] for r in res))
        if all(r.get("phases") for r in res):
            tally.restore_phases.setdefault(case, []).append([r["phases"] for r in res])
        peak = max(r["peak_rss_bytes"] for r in res)
        per_rep[f"peak_rss_restore_{case}_bytes"].append(peak)
        per_rep.setdefault(f"peak_private_restore_{case}_bytes", [None] * rep).append(
            max(r["peak_private_bytes"] for r in res)
        )
        per_rep.setdefault(f"peak_unshared_restore_{case}_bytes", [None] * rep).append(
            max(r["peak_unshared_bytes"] for r in res)
        )
        peaks.append(peak)
        starts.append(_max_or_none([r["rss_at_start_bytes"] for r in res]))
        tally.rss_reset_ok &= all(r["rss_reset"] for r in res)
        tally.errors += _restore_problems(rep, case, res)
    per_rep["peak_rss_restore_bytes"].append(max(peaks))
    per_rep["rss_at_start_restore_bytes"].append(_max_or_none(starts))


def _rep_line(cfg: _Config, rep: int, reps: int, tally: _Tally) -> str:
    last = {k: tally.per_rep[k][-1] for k in TIME_METRICS}
    return (
        f"  {cfg.label} rep {rep + 1}/{reps}: "
        f"stall {last['stall_s']:.3f}s durable {last['durable_s']:.3f}s "
        f"restart {last['restore_restart_s']:.3f}s node-loss "
        f"{last['restore_node_loss_s']:.3f}s" + ("" if not tally.errors else "  [NOT BIT-EXACT]")
    )


def _stop_services(services: Optional[NodeServices], rep: int, tally: _Tally) -> None:
    if services is None:
        return
    try:
        services.stop()
    except Exception as e:  # a failed stop must not hide the measurement
        tally.errors.append(f"rep {rep}: stopping node services failed: {e}")


def _run_rep(cfg: _Config, rep: int, reps: int, tally: _Tally) -> bool:
    """One repetition on a fresh temporary cluster; False when it failed (error recorded)."""
    fabric = None
    if cfg.link is not None:  # the nodes' stores live in the fabric's scratch directory
        fabric = Fabric(-(-cfg.world_size // cfg.ranks_per_node), cfg.link)
        root = str(fabric.root)
    else:
        root = tempfile.mkdtemp(
            prefix="rckpt-bench-", dir=cfg.shm_dir if os.path.isdir(cfg.shm_dir) else None
        )
    cluster = ClusterSpec(
        cfg.world_size, cfg.ranks_per_node, root, cfg.session(rep), cfg.replication_factor, fabric
    )
    services = None
    try:
        services = _start_cluster(cfg.cls, cluster)
        saves = cfg.launch_phase(_save_phase, cluster, "save", services)
        _record_saves(tally, rep, saves, cluster)
        _restore_phases(cfg, cluster, services, rep, tally)
        if cfg.spec.loop_saves:
            durable = max(r["steady_durable_s"] for r in saves)
            loops = cfg.launch_phase(_loop_phase, cluster, "loop", services, durable)
            tally.per_rep["loop_overhead_s"].append(max(r["overhead_per_save_s"] for r in loops))
            tally.per_rep["loop_step_s"].append(max(r["step_s"] for r in loops))
        cfg.log(_rep_line(cfg, rep, reps, tally))
    except Exception as e:  # one configuration failing must not lose the others' figures
        tally.errors.append(f"rep {rep}: {type(e).__name__}: {e}")
        cfg.log(f"  {cfg.label} rep {rep + 1}: FAILED {str(e).splitlines()[0]}")
        return False
    finally:
        _stop_services(services, rep, tally)
        shutil.rmtree(root, ignore_errors=True)
        if fabric is not None:
            fabric.close()
    return True


def run_config(
    name: str,
    spec_str: str,
    cls: type,
    bytes_per_rank: int,
    world_size: int,
    *,
    reps: int,
    ranks_per_node: int,
    replication_factor: int = 2,
    shm_dir: str = "/dev/shm",
    log: Callable[[str], None] = print,
    warmup_saves: int = 3,
    device: str = "cpu",
    loop_saves: int = 0,
    link: Optional[LinkShape] = None,
) -> Dict[str, Any]:
    """All repetitions of one (system, size, world size[, link]); returns the JSON record."""
    spec = RunSpec(spec_str, bytes_per_rank, warmup_saves=warmup_saves, device=device, loop_saves=loop_saves)
    cfg = _Config(name, spec, cls, world_size, ranks_per_node, replication_factor, shm_dir, log, link)
    tally = _Tally()
    for rep in range(reps):
        if not _run_rep(cfg, rep, reps, tally):
            break
    return {
        "system": name,
        "spec": spec_str,
        "bytes_per_rank": bytes_per_rank,
        "world_size": world_size,
        "ranks_per_node": ranks_per_node,
        "replication_factor": replication_factor,
        "device": device,
        "link_rate_bps": None if link is None else link.rate_bps,
        "reps": reps,
        "expected_saved_bytes": expected_saved_bytes(bytes_per_rank, world_size),
        "rss_reset": tally.rss_reset_ok,
        "metrics": {k: _metric(v) for k, v in tally.per_rep.items()},
        "restore_phases": tally.restore_phases,
        "errors": tally.errors,
    }
