"""``resilient-ckpt bench``: the side-by-side benchmark's command line (:func:`main`).

It parses the flags (:func:`build_parser`), refuses what this machine cannot run (``--device
cuda`` without a GPU, ``--fabric netns`` without its tools), measures the machine's limits (and,
with ``--fabric netns``, the links), runs every configuration through
:func:`~.runner.run_config`, and writes the JSON document, the tables and the plot
(:mod:`.report`). What one configuration does, and the :class:`~.runner.System` interface:
:mod:`.runner` (which does not import this module).
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from ..errors import ValidationError
from .fabric import Fabric, LinkShape, parse_rate
from .launcher import mp_context, quiet
from .runner import (
    DEVICES,
    ITERATION,
    RSS_METHOD,
    SYSTEMS,
    default_ranks_per_node,
    load_system,
    resolve_system,
    run_config,
)
from .workload import format_size, parse_size


def _sizes(text: str) -> List[int]:
    try:
        return [parse_size(s) for s in text.split(",") if s.strip()]
    except ValidationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _ints(text: str) -> List[int]:
    try:
        vals = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a comma-separated list of integers (e.g. 2,4)"
        ) from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{text!r}: give positive integers, e.g. 2,4")
    return vals


def _rates(text: str) -> List[int]:
    try:
        return [parse_rate(s) for s in text.split(",") if s.strip()]
    except ValidationError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt bench",
        description="Benchmark resilient_ckpt against Megatron-core + nvidia-resiliency-ext "
        "local checkpoints on a Megatron-like workload, with the machine's limits.",
    )
    p.add_argument(
        "--sizes", type=_sizes, help="bytes per rank, e.g. 64M,256M,1G,2G (default: that list; --quick: 64M)"
    )
    p.add_argument("--world-sizes", type=_ints, help="ranks, e.g. 2,4 (default 2,4; --quick: 2)")
    p.add_argument("--reps", type=int, help="repetitions per configuration (default 3; --quick: 1)")
    p.add_argument(
        "--systems",
        default="baseline,ours-embedded,ours-service",
        help=f"comma-separated: {', '.join(SYSTEMS)} or module:Class",
    )
    p.add_argument(
        "--ranks-per-node",
        type=int,
        default=None,
        help="ranks per simulated node (default: W/2, i.e. two nodes)",
    )
    p.add_argument("--replication-factor", type=int, default=2)
    p.add_argument(
        "--warmup-saves",
        type=int,
        default=3,
        help="saves before the timed one, identical for every system (default 3: "
        "steady state once retention recycles buffers)",
    )
    p.add_argument(
        "--loop-saves",
        type=int,
        default=0,
        help="also run a training loop saving every 4 steps this many times, against the same "
        "loop without saves: the overhead per save a user feels (default 0: no loop; "
        "scripts/gpu_check runs 3)",
    )
    p.add_argument(
        "--quick", action="store_true", help="small and fast (< 2 min): 64M, W=2, 1 rep, small limit buffers"
    )
    p.add_argument("--no-limits", action="store_true", help="skip measuring the machine's limits")
    p.add_argument(
        "--json",
        metavar="PATH",
        help='write results as JSON (also after each configuration, with "partial": true, '
        "so an interrupted run keeps what finished)",
    )
    p.add_argument("--plot", metavar="PATH", help="write a PNG: seconds vs size")
    p.add_argument("--shm-dir", default="/dev/shm", help="where node store roots go (tmpfs)")
    p.add_argument(
        "--fabric",
        choices=("loopback", "netns"),
        default="loopback",
        help="loopback (default): every node on 127.0.0.1; netns: each node in its own network "
        "namespace with its own address, linked to a bridge by a veth pair shaped with tc (needs root)",
    )
    p.add_argument(
        "--link-rates",
        type=_rates,
        help="with --fabric netns: each node's link speed, one set of runs per rate, e.g. 1G,10G,25G "
        "(bits/s; default: unshaped)",
    )
    p.add_argument(
        "--device",
        choices=DEVICES,
        default="cpu",
        help="where every rank's training state and restore templates live (default cpu); cuda: "
        "cuda:<local rank %% GPUs>, several ranks may share one GPU, process groups stay gloo, and "
        "the limits add device<->pinned-host copy bandwidths",
    )
    return p


def _fabric_problem(args: argparse.Namespace) -> Optional[str]:
    """Why ``--fabric netns`` cannot run here (None when it can, or is not asked for)."""
    if args.fabric != "netns":
        return None
    from .fabric import unavailable

    reason = unavailable()
    if reason is not None:
        return f"--fabric netns: {reason}"
    if args.plot:
        return "--plot draws loopback runs; with --fabric netns read the tables or --json"
    return None


def _measure_links(plan: "_Plan", args: argparse.Namespace, log: Callable[[str], None], results) -> None:
    """--fabric netns: what one link, and every link at once, delivers at each rate."""
    from .limits import link_limits

    nodes = max(2, *(-(-w // (args.ranks_per_node or default_ranks_per_node(w))) for w in plan.world_sizes))
    for link in plan.links:
        if link is None:
            continue
        with Fabric(nodes, link) as fab:
            measured = link_limits(fab, (256 << 20) if args.quick else (1 << 30))
        results.links[str(link.rate_bps)] = measured
        log(f"link: {measured['describe']}")


def device_problem(device: str) -> Optional[str]:
    """Why ``--device`` cannot be used on this machine (None when it can)."""
    if device != "cuda":
        return None
    import torch

    if torch.cuda.is_available():
        return None
    build = f"a CUDA {torch.version.cuda} build" if torch.version.cuda else "a CPU-only build"
    return (
        f"--device cuda: torch {torch.__version__} ({build}) sees no CUDA device "
        "(torch.cuda.is_available() is False); run on a machine with a GPU and a CUDA build "
        "of torch, or use --device cpu"
    )


def _machine() -> Dict[str, Any]:
    import platform

    import psutil
    import torch

    info: Dict[str, Any] = {
        "hostname": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "memory_bytes": psutil.virtual_memory().total,
        "cuda": torch.cuda.is_available(),
        "torch_cuda": torch.version.cuda,
    }
    if torch.cuda.is_available():
        info["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    from importlib import metadata

    for dist_name in ("megatron-core", "nvidia-resiliency-ext", "resilient-ckpt", "pyzmq"):
        try:
            info[dist_name] = metadata.version(dist_name)
        except metadata.PackageNotFoundError:
            info[dist_name] = None
    return info


def _cpu_pressure() -> Optional[str]:
    """PSI 'some' line: share of time runnable tasks waited for a CPU (other jobs' load)."""
    try:
        with open("/proc/pressure/cpu") as f:
            return f.readline().strip()
    except OSError:
        return None


@dataclass(frozen=True)
class _Plan:
    """What ``bench`` runs: the command line's choices with the defaults filled in."""

    sizes: List[int]
    world_sizes: List[int]
    reps: int
    #: one entry per link rate (--fabric netns), or [None]: loopback
    links: List[Optional[LinkShape]] = field(default_factory=lambda: [None])

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> "_Plan":
        sizes = args.sizes or ([64 << 20] if args.quick else [s << 20 for s in (64, 256, 1024, 2048)])
        world_sizes = args.world_sizes or ([2] if args.quick else [2, 4])
        reps = args.reps if args.reps is not None else (1 if args.quick else 3)
        if reps < 1 or args.replication_factor < 1:
            raise ValidationError("--reps and --replication-factor must be at least 1")
        links: List[Optional[LinkShape]] = [None]
        if args.fabric == "netns":
            links = [LinkShape(rate_bps=r) for r in (args.link_rates or [None])]
        elif args.link_rates:
            raise ValidationError("--link-rates shapes the links of --fabric netns; add --fabric netns")
        return cls(sizes, world_sizes, reps, links)


@dataclass
class _Results:
    """What the configurations produced, and what was skipped and why."""

    runs: List[Dict[str, Any]] = field(default_factory=list)
    skipped: List[Dict[str, Any]] = field(default_factory=list)
    patched: List[str] = field(default_factory=list)
    #: --fabric netns: what one link delivers at each rate (limits.link_limits), by rate
    links: Dict[str, Any] = field(default_factory=dict)


def _load_systems(names: str, log: Callable[[str], None], results: _Results) -> List[Tuple[str, str, type]]:
    """(name, module:Class, class) of each named system; unimportable ones are skipped."""
    systems: List[Tuple[str, str, type]] = []
    for name in [s.strip() for s in names.split(",") if s.strip()]:
        spec = resolve_system(name)
        try:
            cls = load_system(spec)
        except (ImportError, AttributeError) as e:
            reason = f"{spec} is not importable ({type(e).__name__}: {e})"
            log(f"skipping {name}: {reason}")
            results.skipped.append({"system": name, "reason": reason})
            continue
        systems.append((name, spec, cls))
    return systems


def _memory_shortfall(cls: type, bytes_per_rank: int, world_size: int) -> Optional[str]:
    """Why a configuration does not fit in the available host memory (None when it does)."""
    import psutil

    est = getattr(cls, "memory_estimate", None)
    need = est(bytes_per_rank, world_size) if est else 4 * bytes_per_rank * world_size
    avail = psutil.virtual_memory().available
    if need > 0.9 * avail:
        return f"needs ~{format_size(need)}B of host memory, {format_size(avail)}B available"
    return None


def _patches(cls: type, device: str) -> List[str]:
    """What a system changed in the libraries it runs, for this device (reported)."""
    fn = getattr(cls, "patches", None)
    if fn is not None:
        return list(fn(device))
    return list(getattr(cls, "patched_for_cpu", ()))


def _run_all(
    args: argparse.Namespace,
    plan: _Plan,
    systems: List[Tuple[str, str, type]],
    log: Callable[[str], None],
    results: _Results,
    after_each: Callable[[], None] = lambda: None,
    link: Optional[LinkShape] = None,
) -> None:
    """Every configuration: world sizes, then sizes, then systems; ``after_each`` runs after
    each configuration that ran. ``link``: the nodes' links (--fabric netns)."""
    for w in plan.world_sizes:
        rpn = args.ranks_per_node or default_ranks_per_node(w)
        for b in plan.sizes:
            for name, spec, cls in systems:
                reason = _memory_shortfall(cls, b, w)
                if reason is not None:
                    log(f"skipping {name} {format_size(b)} W={w}: {reason}")
                    results.skipped.append(
                        {"system": name, "bytes_per_rank": b, "world_size": w, "reason": reason}
                    )
                    continue
                results.patched += [p for p in _patches(cls, args.device) if p not in results.patched]
                results.runs.append(
                    run_config(
                        name,
                        spec,
                        cls,
                        b,
                        w,
                        reps=plan.reps,
                        ranks_per_node=rpn,
                        replication_factor=args.replication_factor,
                        shm_dir=args.shm_dir,
                        log=log,
                        warmup_saves=args.warmup_saves,
                        device=args.device,
                        loop_saves=args.loop_saves,
                        link=link,
                    )
                )
                after_each()


def _document(
    args: argparse.Namespace,
    plan: _Plan,
    systems: List[Tuple[str, str, type]],
    limits: Any,
    results: _Results,
    t_start: float,
    load_before: Tuple[Tuple[float, float, float], Optional[str]],
) -> Dict[str, Any]:
    """The JSON document of the run (``comparisons`` is added from it)."""
    loadavg_before, cpu_pressure_before = load_before
    return {
        "schema": "resilient_ckpt.bench/1",
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "elapsed_s": time.monotonic() - t_start,
        "machine": _machine(),
        # other work on the machine skews figures: 1/5/15-min load averages before and after
        "loadavg": {"start": list(loadavg_before), "end": list(os.getloadavg())},
        "cpu_pressure": {"start": cpu_pressure_before, "end": _cpu_pressure()},
        "config": {
            "sizes": plan.sizes,
            "world_sizes": plan.world_sizes,
            "reps": plan.reps,
            "systems": [s[0] for s in systems],
            "quick": args.quick,
            "replication_factor": args.replication_factor,
            "ranks_per_node": args.ranks_per_node or "W/2",
            "warmup_saves": args.warmup_saves,
            "timed_iteration": ITERATION,
            "device": args.device,
            "loop_saves": args.loop_saves,
            "fabric": args.fabric,
        },
        "rss_method": RSS_METHOD,
        "patched_for_cpu": results.patched if args.device == "cpu" else [],
        # what the systems changed in the libraries they run, for this device
        "patched": results.patched,
        "limits": limits.to_dict() if limits else None,
        "links": results.links,
        "skipped": results.skipped,
        "runs": results.runs,
    }


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``resilient-ckpt bench``; returns 0 when every configuration ran and restored exactly."""
    from ..cli import extras

    quiet()
    parser = build_parser()
    args = parser.parse_args(list(argv) if argv is not None else None)
    extras.require("bench")
    plan = _Plan.from_args(args)
    problem = device_problem(args.device) or _fabric_problem(args)
    if problem is not None:
        parser.error(problem)  # usage and the reason on stderr, exit status 2, nothing started
    from . import report

    console = report.console()

    def log(msg: str) -> None:
        console.print(msg, markup=False, highlight=False, soft_wrap=True)

    t_start = time.monotonic()
    results = _Results()
    systems = _load_systems(args.systems, log, results)
    # One fork server for the whole run, with every system's module preloaded (first use wins;
    # with --device cuda, the modules that initialise CUDA at import load in each rank instead).
    mp_context([spec.partition(":")[0] for _, spec, _ in systems], cuda=args.device == "cuda")
    load_before = os.getloadavg(), _cpu_pressure()
    limits = None
    if not args.no_limits:
        from .limits import measure_limits

        log("measuring the machine's limits" + (" (quick)" if args.quick else ""))
        limits = measure_limits(quick=args.quick, device=args.device)
        log(report.format_limits(limits.to_dict()))
        _measure_links(plan, args, log, results)

    def write_partial() -> None:
        # an interrupted run (a time limit, a crash) keeps the configurations that finished
        if args.json:
            doc = _document(args, plan, systems, limits, results, t_start, load_before)
            doc["comparisons"] = report.comparisons(doc)
            doc["partial"] = True
            report.write_json(doc, args.json)

    for link in plan.links:
        _run_all(args, plan, systems, log, results, after_each=write_partial, link=link)
    doc = _document(args, plan, systems, limits, results, t_start, load_before)
    doc["comparisons"] = report.comparisons(doc)
    report.render(doc, console)
    if args.json:
        report.write_json(doc, args.json)
        log(f"wrote {args.json}")
    if args.plot:
        report.plot(doc, args.plot)
        log(f"wrote {args.plot}")
    return 1 if any(r["errors"] for r in results.runs) else 0
