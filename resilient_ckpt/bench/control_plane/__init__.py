"""Control-plane benchmark (issue 11, item 1): what the metadata side of saves and restores
costs, per phase, in time and in bytes each rank puts on (and takes off) the wire.

Two parts, one run (``resilient-ckpt bench --control-plane`` or ``benchmarks/control_plane.py``):

**Real** (:func:`run_real`): 2 gloo ranks, each its own simulated node (``ranks_per_node=1``,
ring placement, replication factor 2), for each tensor count N (default 1k / 10k / 50k per
rank) a Megatron-style sharded state dict (:class:`CPWorkload`: float32 ShardedTensors, half
replicated across the data-parallel ranks, half sharded along axis 0; 256 MiB per rank at 50k,
the same sizes scaled with N). Through the public API, in fresh processes per phase:

* ``first save``: ``save_local`` until ``wait_staged()`` returns (*staged*) and until
  ``wait()`` returns (*complete*: stored, replicated, agreed);
* ``cached save``: the same for the saves after it (distribution cached), each on a freshly
  built sharded state dict (``build_s``, as Megatron rebuilds it every save);
* ``restore``: new processes (a restart), a zero template, ``load_local(template)``.

The reference system (Megatron-core ``MCoreTensorAwareStateDict.from_state_dict`` + nvidia-
resiliency-ext ``LocalCheckpointManager``, run as
:class:`~resilient_ckpt.bench.baseline.BaselineInlineSystem`: its async request executed inside
the rank, its best case, with the bench's CPU patches) does the same three operations on the
same workload (Megatron-core mapping objects) in the same run.

Per phase, the functions the manager calls are wrapped for the duration of the run by a
:class:`PhaseProfiler` (the package itself is unchanged): each wrapped call adds its wall time
*exclusive* of the wrapped calls inside it to its phase, so the phases of one operation add up
to its time (what no wrapper covers is the ``unattributed`` row). :data:`PHASES` lists every
wrapped function and its phase. Collectives are wrapped too: ``collectives.all_gather_bytes``
records, per rank, the payload it contributes (*sent*) and the other ranks' payloads it gets
(*received*), ``all_reduce_int`` 8 bytes each way, the transport's header exchange the headers'
bytes; these rows are named after the phase they run in (``distribution: all-gather``). Bytes
are therefore exactly what the real encoders produced.

**Simulated** (:func:`run_simulated`): one process, synthetic metadata of W ranks (default
64 / 1,024 / 4,096) with S shards each (default 1,000): a TP x DP layout (TP = 8), half the
shards TP-sharded and replicated over DP, half sharded over all ranks, one ShardedObject per
rank. The per-rank payloads of every all-gather are encoded with the real encoder (msgpack,
exactly as ``collectives.all_gather_msgpack`` sends them) from records built the way the real
code builds them (checked against ``shard_record`` / ``load_facts`` on real ShardedTensors of
sample ranks), then decoded and fed to the pure planning functions every rank runs on the
gathered data: ``validate_sharding_integrity``, ``compute_distribution``, ``Holdings`` ->
``complete_iterations`` -> ``plan_retrieval``, ``plan_exchange`` and the whole load verdict
(``load_verdict``). Every rank runs these computations in full on the same gathered data, so
the single-process time *is* the per-rank time. Not simulated (needs a process group): the
collectives' own latency (the agreement is one 8-byte all-reduce; the gathers' wire time is
bytes / bandwidth) and the data movement.

Modules, by what they measure: :mod:`.workload` (:class:`CPWorkload`, the run's constants),
:mod:`.profiler` (:class:`PhaseProfiler`, :data:`PHASES`, the issue's phases), :mod:`.real`
(the real ranks, :func:`run_real`), :mod:`.simulated` (the simulated world sizes,
:func:`run_simulated`), :mod:`.reporting` (tables, targets, exponents, plot). Here: the entry
point (:func:`build_parser`, :func:`run`, :func:`main`), and every name callers use.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

# Every name callers use (tests, benchmarks/control_plane.py, the CLI) is importable from here.
from .profiler import CONTROL_PHASES as CONTROL_PHASES
from .profiler import ISSUE_PHASES, PHASES, PhaseProfiler, issue_phase
from .real import RealSpec, run_real
from .real import summarize_phases as summarize_phases
from .reporting import OPS as OPS
from .reporting import TARGETS as TARGETS
from .reporting import e2e_table as e2e_table
from .reporting import exponents, plot, report
from .reporting import real_tables as real_tables
from .reporting import sim_table as sim_table
from .reporting import slope as slope
from .reporting import targets_table as targets_table
from .simulated import SIM_RESTORE as SIM_RESTORE
from .simulated import SIM_SAVE as SIM_SAVE
from .simulated import SimLayout, run_simulated
from .simulated import _Rank as _Rank
from .simulated import sim_totals as sim_totals
from .workload import BYTES_AT_50K as BYTES_AT_50K
from .workload import FIRST_ITERATION as FIRST_ITERATION
from .workload import MIB as MIB
from .workload import SESSION as SESSION
from .workload import TENSORS_AT_BYTES as TENSORS_AT_BYTES
from .workload import CPWorkload
from .workload import tensor_numels as tensor_numels


def _ints(text: str) -> List[int]:
    try:
        return [int(float(x)) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected comma-separated integers") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="resilient-ckpt bench --control-plane",
        description="Control-plane benchmark: per phase time and bytes per rank, on 2 real ranks "
        "(tensors per rank) and simulated world sizes (issue 11, item 1).",
    )
    p.add_argument("--tensors", type=_ints, default=[1000, 10000, 50000], help="tensors per rank (real part)")
    p.add_argument("--world-sizes", type=_ints, default=[64, 1024, 4096], help="simulated world sizes")
    p.add_argument("--shards-per-rank", type=int, default=1000, help="shards per rank (simulated part)")
    p.add_argument("--reps", type=int, default=1, help="restore repetitions (fresh processes each)")
    p.add_argument("--saves", type=int, default=3, help="saves per run: the first, then cached ones")
    p.add_argument(
        "--total-bytes",
        type=int,
        default=None,
        help="bytes per rank at every tensor count (default: 256 MiB x N / 50k)",
    )
    p.add_argument("--no-reference", action="store_true", help="skip Megatron-core + nvidia-resiliency-ext")
    p.add_argument("--skip-real", action="store_true")
    p.add_argument("--skip-simulated", action="store_true")
    p.add_argument(
        "--no-check", action="store_true", help="skip checking the synthetic payloads against the real code"
    )
    p.add_argument(
        "--profile",
        action="store_true",
        help="cProfile rank 0's saves and restore (slower; hotspots into the JSON)",
    )
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write the log-log plot here (PNG)")
    return p


def run(args: argparse.Namespace, log: Callable[[str], None] = print) -> Dict[str, Any]:
    result: Dict[str, Any] = {
        "config": {k: v for k, v in vars(args).items()},
        "machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0]},
        "phases": [dict(phase=p, function=t, kind=k, issue_phase=issue_phase(p)) for p, t, k in PHASES],
    }
    t0 = time.perf_counter()
    if not args.skip_real:
        log(f"real: 2 ranks, tensors per rank {args.tensors}")
        result["real"] = [
            run_real(
                n,
                args.reps,
                args.saves,
                not args.no_reference,
                args.total_bytes,
                log,
                profile=getattr(args, "profile", False),
            )
            for n in args.tensors
        ]
    if not args.skip_simulated:
        log(f"simulated: world sizes {args.world_sizes} x {args.shards_per_rank} shards per rank")
        result["simulated"] = [
            run_simulated(w, args.shards_per_rank, check=not args.no_check, log=log) for w in args.world_sizes
        ]
    result["exponents"] = exponents(result.get("real", []), result.get("simulated", []))
    result["seconds"] = time.perf_counter() - t0
    return result


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.plot:
        from ...cli import extras

        extras.require("bench")
    result = run(args, log=lambda m: print(m, flush=True))
    print(report(result))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.plot:
        plot(result, args.plot)
        print(f"plot: {args.plot}")
    return 0


__all__ = [
    "PHASES",
    "ISSUE_PHASES",
    "CPWorkload",
    "PhaseProfiler",
    "RealSpec",
    "SimLayout",
    "main",
    "run",
    "run_real",
    "run_simulated",
]
