"""The control-plane benchmark's real part: 2 gloo ranks per tensor count, our saves and restores
(and the reference's) in fresh processes, per phase through :class:`~.profiler.PhaseProfiler`
(:func:`run_real`); the rank functions the launcher runs, and the per-phase summaries."""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence

from .profiler import PhaseProfiler, issue_phase
from .workload import FIRST_ITERATION, SESSION, CPWorkload, tensor_numels


@dataclass(frozen=True)
class RealSpec:
    tensors: int
    saves: int = 3  # the first save, then cached ones
    total_bytes: Optional[int] = None
    #: cProfile rank 0's operations (slower: for finding hotspots, not for the figures)
    profile: bool = False


def _profiled(spec: "RealSpec", rank: int):
    """A cProfile.Profile enabled by ``with`` when ``spec.profile`` on rank 0, else a no-op;
    ``text()`` gives the top functions by own and by cumulative time."""
    import contextlib

    class _P(contextlib.AbstractContextManager):
        def __init__(self):
            self.prof = None
            if spec.profile and rank == 0:
                import cProfile

                self.prof = cProfile.Profile()

        def __enter__(self):
            if self.prof is not None:
                self.prof.enable()
            return self

        def __exit__(self, *exc):
            if self.prof is not None:
                self.prof.disable()

        def text(self, top: int = 30) -> Optional[str]:
            if self.prof is None:
                return None
            import io
            import pstats

            out = io.StringIO()
            st = pstats.Stats(self.prof, stream=out).strip_dirs()
            st.sort_stats("tottime").print_stats(top)
            st.sort_stats("cumulative").print_stats(top)
            return out.getvalue()

    return _P()


def _manager(ctx):
    from ...manager.checkpoint_manager import CheckpointManager

    return CheckpointManager(
        session_id=ctx.session,
        store_root=ctx.store_root,
        replication_factor=ctx.replication_factor,
        ranks_per_node=ctx.ranks_per_node,
        parallelization_group=ctx.dp_group,
        timeout_s=900,
    )


def _encoder_checks(mgr, wl: CPWorkload, sd: Dict[str, Any], iteration: int) -> Dict[str, int]:
    """What the real encoders produce for this rank, computed apart from the measured run: the
    benchmark's byte counts must equal these (see the smoke test)."""
    import msgpack

    from ...memory.layout import CheckpointId
    from ...model.validation import object_record, shard_record
    from ...parallel.distribution import structure_fingerprint
    from ...parallel.template import preprocess, sharded_objects, sharded_tensors
    from ...replication.peer import announcement

    sharded, *_ = preprocess(sd)
    shards = sharded_tensors(sharded)
    payload = {
        "rank": mgr.rank,
        "error": None,
        "shards": [list(shard_record(sh)) for sh in shards],
        "objects": [list(object_record(o)) for o in sharded_objects(sharded)],
        "fp": structure_fingerprint(shards),
    }
    cid = CheckpointId(iteration, mgr.rank, mgr.session_id)
    header = mgr.store.read_header(cid)
    return {
        "distribution_payload": len(msgpack.packb(payload, use_bin_type=True)),
        "header_file": mgr.store.header_path(cid).stat().st_size,
        # a sealed replica's first header (the final one is the header file's bytes)
        "announcement": len(announcement(header)) if mgr._seals_replicas() else 0,
        "hollow": len(header.meta),
        "tensors_saved": len(header.tensors),
    }


def _ours_save_rank(ctx, spec: RealSpec) -> Dict[str, Any]:
    import torch.distributed as dist

    from ..launcher import quiet

    quiet()
    wl = CPWorkload(spec.tensors, ctx.rank, ctx.world_size, "ours", total_bytes=spec.total_bytes)
    mgr = _manager(ctx)
    ops: List[Dict[str, Any]] = []
    profiles: Dict[str, str] = {}
    with PhaseProfiler() as prof:
        for k in range(spec.saves):
            it = FIRST_ITERATION + 10 * k
            t0 = time.perf_counter()
            sd = wl.sharded_state_dict(it)
            build_s = time.perf_counter() - t0
            dist.barrier()
            prof.reset()
            cprof = _profiled(spec, ctx.rank)
            with cprof:
                t0 = time.perf_counter()
                handle = mgr.save_local(sd, it)
                t_call = time.perf_counter()
                handle.wait_staged()
                t1 = time.perf_counter()
                handle.wait()
                t2 = time.perf_counter()
            if cprof.text() is not None:
                profiles[f"{'first' if k == 0 else 'cached'} save {k}"] = cprof.text()
            phases = prof.snapshot(unattributed_s=t_call - t0)
            phases["staging wait (caller)"] = [t1 - t_call, 1, 0, 0, 0]
            ops.append(
                dict(
                    op="first save" if k == 0 else "cached save",
                    build_s=build_s,
                    staged_s=t1 - t0,
                    complete_s=t2 - t0,
                    phases=phases,
                )
            )
    checks = _encoder_checks(mgr, wl, wl.sharded_state_dict(it), it)
    return {
        "ops": ops,
        "checks": checks,
        "saved_bytes": mgr.last_save_metrics.bytes_staged,
        "profiles": profiles,
    }


def _ours_restore_rank(ctx, spec: RealSpec) -> Dict[str, Any]:
    import msgpack
    import torch.distributed as dist

    from ...manager.restore import _scan_holdings
    from ...memory.layout import CheckpointId
    from ...parallel.load_checks import same_structure
    from ...parallel.template import prepare_template
    from ...parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from ..launcher import quiet

    quiet()
    tmpl = CPWorkload(
        spec.tensors, ctx.rank, ctx.world_size, "ours", zeros=True, total_bytes=spec.total_bytes
    )
    template = tmpl.sharded_state_dict()
    mgr = _manager(ctx)
    # What gather_holdings sends: the store listing, and the structure vote riding along
    # (the newest own iteration, and whether the template has its saved structure).
    local = _scan_holdings(mgr.store, ctx.world_size)
    newest = max(it for it, owner, _ in local["ids"] if owner == ctx.rank)
    saved = MCoreTensorAwareStateDict.from_bytes(
        mgr.store.read_header(CheckpointId(newest, ctx.rank, mgr.session_id)).meta
    )
    local["note"] = [newest, same_structure(prepare_template(template), saved)]
    holdings_payload = len(msgpack.packb({"e": "", "p": local}, use_bin_type=True))
    dist.barrier()
    cprof = _profiled(spec, ctx.rank)
    with PhaseProfiler() as prof, cprof:
        t0 = time.perf_counter()
        out = mgr.load_local(template)
        t1 = time.perf_counter()
    phases = prof.snapshot(unattributed_s=t1 - t0)
    if out is None:
        raise RuntimeError("control-plane bench: nothing restored")
    state, _ = out
    tmpl_ok = CPWorkload(spec.tensors, ctx.rank, ctx.world_size, "ours", total_bytes=spec.total_bytes)
    problems = tmpl_ok.check(state)
    return {
        "ops": [dict(op="restore", restore_s=t1 - t0, phases=phases)],
        "checks": {"holdings_payload": holdings_payload},
        "problems": problems,
        "load_metrics": mgr.last_load_metrics.as_dict(),
        "profiles": {"restore": cprof.text()} if cprof.text() else {},
    }


def _ref_save_rank(ctx, spec: RealSpec) -> Dict[str, Any]:
    import torch.distributed as dist

    from ..baseline import BaselineInlineSystem
    from ..launcher import quiet

    quiet()
    wl = CPWorkload(spec.tensors, ctx.rank, ctx.world_size, "mcore", total_bytes=spec.total_bytes)
    system = BaselineInlineSystem()
    system.setup(ctx)
    ops = []
    for k in range(spec.saves):
        it = FIRST_ITERATION + 10 * k
        t0 = time.perf_counter()
        sd = wl.sharded_state_dict(it)
        build_s = time.perf_counter() - t0
        dist.barrier()
        t0 = time.perf_counter()
        pending = system.save(sd, it)  # from_state_dict + LocalCheckpointManager.save (clones)
        t1 = time.perf_counter()
        pending.wait()  # the write (torch.save) + find_latest
        t2 = time.perf_counter()
        ops.append(
            dict(
                op="first save" if k == 0 else "cached save",
                build_s=build_s,
                staged_s=t1 - t0,
                complete_s=t2 - t0,
                details=dict(pending.details),
            )
        )
    return {"ops": ops}


def _ref_restore_rank(ctx, spec: RealSpec) -> Dict[str, Any]:
    import torch.distributed as dist

    from ..baseline import BaselineInlineSystem
    from ..launcher import quiet

    quiet()
    tmpl = CPWorkload(
        spec.tensors, ctx.rank, ctx.world_size, "mcore", zeros=True, total_bytes=spec.total_bytes
    )
    template = tmpl.sharded_state_dict()
    system = BaselineInlineSystem()
    system.setup(ctx)
    dist.barrier()
    t0 = time.perf_counter()
    state = system.restore(template)
    t1 = time.perf_counter()
    problems = CPWorkload(spec.tensors, ctx.rank, ctx.world_size, "ours", total_bytes=spec.total_bytes).check(
        state
    )
    return {"ops": [dict(op="restore", restore_s=t1 - t0)], "problems": problems}


def _launch(fn, tmp_root: str, spec: RealSpec, session: str, timeout: float) -> List[Any]:
    from ..launcher import launch

    return launch(
        fn,
        2,
        tmp_root,
        ranks_per_node=1,
        args=(spec,),
        session=session,
        replication_factor=2,
        timeout=timeout,
        preload=["resilient_ckpt.bench.control_plane.real", "resilient_ckpt.manager.checkpoint_manager"],
        hold=True,  # SIGKILLed afterwards: a crash, nothing cleaned up (as the side-by-side bench)
    )


def _merge_phase_rows(per_rank: List[Dict[str, List[float]]]) -> Dict[str, Dict[str, float]]:
    """Per row: the slowest rank's seconds, the largest byte counts (per rank)."""
    out: Dict[str, Dict[str, float]] = {}
    for rows in per_rank:
        for label, (s, calls, sent, recv, enc) in rows.items():
            o = out.setdefault(label, dict(seconds=0.0, calls=0, sent=0, received=0, encoded=0))
            o["seconds"] = max(o["seconds"], s)
            o["calls"] = max(o["calls"], calls)
            o["sent"] = max(o["sent"], sent)
            o["received"] = max(o["received"], recv)
            o["encoded"] = max(o["encoded"], enc)
    return out


def _median_rows(reps: List[Dict[str, Dict[str, float]]]) -> Dict[str, Dict[str, float]]:
    labels = sorted({k for r in reps for k in r})
    out = {}
    for k in labels:
        out[k] = {
            f: statistics.median([r.get(k, {}).get(f, 0) for r in reps])
            for f in ("seconds", "calls", "sent", "received", "encoded")
        }
    return out


def summarize_phases(rows: Dict[str, Dict[str, float]]) -> Dict[str, Dict[str, float]]:
    """Profiler rows -> the issue's phases (seconds and bytes summed)."""
    out: Dict[str, Dict[str, float]] = {}
    for label, r in rows.items():
        o = out.setdefault(issue_phase(label), dict(seconds=0.0, sent=0, received=0))
        o["seconds"] += r["seconds"]
        o["sent"] += r["sent"]
        o["received"] += r["received"]
    return out


def _op_summary(
    per_rank_ops: List[List[Dict[str, Any]]], op: str, time_keys: Sequence[str]
) -> Dict[str, Any]:
    """Median over repetitions of the slowest rank."""
    reps = []
    n_reps = min(sum(1 for o in ops if o["op"] == op) for ops in per_rank_ops)
    for i in range(n_reps):
        mine = [[o for o in ops if o["op"] == op][i] for ops in per_rank_ops]
        rep = {k: max(o[k] for o in mine) for k in time_keys}
        if all("phases" in o for o in mine):
            rep["phases"] = _merge_phase_rows([o["phases"] for o in mine])
        reps.append(rep)
    if not reps:
        return {}
    out: Dict[str, Any] = {k: statistics.median([r[k] for r in reps]) for k in time_keys}
    out["reps"] = len(reps)
    out["all"] = {k: [r[k] for r in reps] for k in time_keys}
    if "phases" in reps[0]:
        out["rows"] = _median_rows([r["phases"] for r in reps])
        out["phases"] = summarize_phases(out["rows"])
        # the first repetition's rows of each rank as measured (bytes are exact per rank)
        first = [[o for o in ops if o["op"] == op][0] for ops in per_rank_ops]
        out["rows_per_rank"] = [_merge_phase_rows([o["phases"]]) for o in first]
    return out


def run_real(
    tensors: int,
    reps: int = 1,
    saves: int = 3,
    reference: bool = True,
    total_bytes: Optional[int] = None,
    log: Callable[[str], None] = print,
    shm_dir: Optional[str] = None,
    profile: bool = False,
) -> Dict[str, Any]:
    """One tensor count on 2 ranks: ours (and the reference), save phases then ``reps``
    restores in fresh processes each. Returns the per-operation summaries. The reference
    saves at most twice (its cached save costs what its first does; it is the slow part)."""
    specs = {
        "ours": RealSpec(tensors, saves, total_bytes, profile),
        "reference": RealSpec(tensors, min(saves, 2), total_bytes),
    }
    base = shm_dir or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    root = tempfile.mkdtemp(prefix="rc-control-plane-", dir=base)
    timeout = 600.0 + tensors / 50.0
    out: Dict[str, Any] = {"tensors": tensors, "bytes_per_rank": 4 * sum(tensor_numels(tensors, total_bytes))}
    systems = [("ours", _ours_save_rank, _ours_restore_rank)]
    if reference:
        systems.append(("reference", _ref_save_rank, _ref_restore_rank))
    try:
        for name, save_fn, restore_fn in systems:
            tmp = os.path.join(root, name)
            os.makedirs(tmp)
            session = f"{SESSION}-{name}-{tensors}"
            t0 = time.perf_counter()
            spec = specs[name]
            saves_out = _launch(save_fn, tmp, spec, session, timeout)
            restores = []
            for _ in range(reps):
                res = _launch(restore_fn, tmp, spec, session, timeout)
                problems = [p for r in res for p in r.get("problems", [])]
                if problems:
                    raise RuntimeError(f"{name}: restore wrong: {problems[:3]}")
                restores.append(res)
            save_ops = [r["ops"] for r in saves_out]
            restore_ops = [[op for rep in restores for op in rep[rank]["ops"]] for rank in range(2)]
            sys_out = {
                "first save": _op_summary(save_ops, "first save", ("build_s", "staged_s", "complete_s")),
                "cached save": _op_summary(save_ops, "cached save", ("build_s", "staged_s", "complete_s")),
                "restore": _op_summary(restore_ops, "restore", ("restore_s",)),
            }
            if name == "ours":
                sys_out["checks"] = [r["checks"] for r in saves_out]
                sys_out["restore_checks"] = [r["checks"] for r in restores[0]]
                sys_out["saved_bytes"] = saves_out[0]["saved_bytes"]
                sys_out["load_metrics"] = restores[0][0]["load_metrics"]
                profiles = {**saves_out[0].get("profiles", {}), **restores[0][0].get("profiles", {})}
                if profiles:
                    sys_out["profiles"] = profiles
            else:
                sys_out["details"] = [o.get("details") for o in saves_out[0]["ops"]]
            out[name] = sys_out
            log(
                f"  {name:9s} {tensors:>6d} tensors: first save staged "
                f"{sys_out['first save']['staged_s']:.2f}s complete {sys_out['first save']['complete_s']:.2f}s"
                f" | cached staged {sys_out['cached save'].get('staged_s', float('nan')):.2f}s"
                f" complete {sys_out['cached save'].get('complete_s', float('nan')):.2f}s"
                f" | restore {sys_out['restore']['restore_s']:.2f}s  ({time.perf_counter() - t0:.0f}s)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out
