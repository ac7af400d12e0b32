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
resiliency-ext ``LocalCheckpointManager``, run as :class:`~.baseline.BaselineInlineSystem`:
its async request executed inside the rank, its best case, with the bench's CPU patches) does
the same three operations on the same workload (Megatron-core mapping objects) in the same run.

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
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

MIB = 1 << 20
#: the issue's workload: 50k float32 tensors totalling 256 MiB per rank
BYTES_AT_50K = 256 * MIB
TENSORS_AT_BYTES = 50_000
SESSION = "cp"
FIRST_ITERATION = 100

# --- the workload --------------------------------------------------------------------------


def tensor_numels(n: int, total_bytes: Optional[int] = None) -> List[int]:
    """Element counts of ``n`` float32 tensors of varied size (each a multiple of 8) summing
    to ``total_bytes`` (default: 256 MiB x n / 50k, i.e. the 50k workload's mean size)."""
    if n < 2:
        raise ValueError("at least 2 tensors")
    total = (BYTES_AT_50K * n // TENSORS_AT_BYTES if total_bytes is None else total_bytes) // 4
    total -= total % 8
    weights = [1.0 + (i * 7919 % 97) / 24.0 for i in range(n)]  # 1x .. 5x, deterministic
    scale = total / sum(weights)
    numels = [max(8, int(w * scale) // 8 * 8) for w in weights]
    numels[-1] = max(8, total - sum(numels[:-1]))
    return numels


def _fill_value(i: int, rank: int, replicated: bool) -> float:
    return float(i % 251 + 1 + (0 if replicated else 1000 * (rank + 1)))


class CPWorkload:
    """One rank's sharded state dict of ``n`` float32 tensors (live tensors allocated once).

    Even-numbered tensors are parameters replicated over the data-parallel ranks
    (``replica_id`` = rank: one main replica), odd-numbered ones optimizer state sharded along
    axis 0 (``from_rank_offsets(key, t, (0, rank, W))``), all 2-D ``(rows, 8)``; plus one
    ShardedObject per rank and a small common part. ``flavour``: ``"ours"`` or ``"mcore"``
    (Megatron-core's mapping classes, for the reference). ``zeros``: a template.
    """

    def __init__(
        self,
        n: int,
        rank: int,
        world_size: int,
        flavour: str = "ours",
        zeros: bool = False,
        total_bytes: Optional[int] = None,
    ):
        import torch

        from .workload import _mapping_module

        self.n, self.rank, self.world_size = n, rank, world_size
        self._m = _mapping_module(flavour)
        self.numels = tensor_numels(n, total_bytes)
        self.tensors = []
        for i, numel in enumerate(self.numels):
            t = torch.empty((numel // 8, 8), dtype=torch.float32)
            t.fill_(0.0 if zeros else _fill_value(i, rank, i % 2 == 0))
            self.tensors.append(t)

    @property
    def nbytes(self) -> int:
        return 4 * sum(self.numels)

    def sharded_state_dict(self, iteration: int = 0) -> Dict[str, Any]:
        import argparse as _ap

        m, r, w = self._m, self.rank, self.world_size
        model: Dict[str, Any] = {}
        state: Dict[str, Any] = {}
        for i, t in enumerate(self.tensors):
            if i % 2 == 0:
                model[f"t{i}"] = m.ShardedTensor.from_rank_offsets(f"decoder.{i}.weight", t, replica_id=r)
            else:
                state[f"t{i}"] = m.ShardedTensor.from_rank_offsets(f"optimizer.{i}.exp_avg", t, (0, r, w))
        return {
            "model": model,
            "optimizer": {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}]},
            "rng_state": m.ShardedObject("rng_state", {"seed": 1234 + r}, (w,), (r,), replica_id=0),
            "iteration": iteration,
            "args": _ap.Namespace(num_tensors=self.n, world_size=w),
            "checkpoint_version": 3.0,
        }

    def check(self, restored: Dict[str, Any], sample: int = 200) -> List[str]:
        """Compare a sample of restored tensors with the values saved (cheap, not exhaustive)."""
        problems = []
        step = max(1, self.n // sample)
        for i in range(0, self.n, step):
            sub = restored["model"] if i % 2 == 0 else restored["optimizer"]["state"]
            t = sub.get(f"t{i}")
            want = _fill_value(i, self.rank, i % 2 == 0)
            if t is None or tuple(t.shape) != tuple(self.tensors[i].shape) or not bool((t == want).all()):
                problems.append(f"rank {self.rank}: tensor t{i} not restored")
                if len(problems) >= 5:
                    break
        return problems


# --- the phase profiler --------------------------------------------------------------------

#: (phase, "module:attribute path", kind). ``kind``: "phase" (time exclusive of the wrapped
#: calls inside), "encode" (a phase whose result's ``len`` is recorded), "gather" / "reduce" /
#: "p2p" (wire rows, named after the phase they run in), "msgpack" (encode + decode around a
#: gather, named likewise). Several entries wrap one function where modules import it by name.
_PKG = "resilient_ckpt."
PHASES: Tuple[Tuple[str, str, str], ...] = (
    # structure walk: copying the tree, splitting common / sharded, listing ShardedTensors
    ("structure walk", _PKG + "parallel.tensor_aware_state_dict:preprocess", "phase"),
    ("structure walk", _PKG + "parallel.template:preprocess", "phase"),
    ("structure walk", _PKG + "parallel.tensor_aware_state_dict:sharded_tensors", "phase"),
    ("structure walk", _PKG + "parallel.template:sharded_tensors", "phase"),
    ("structure walk", _PKG + "parallel.load_checks:sharded_tensors", "phase"),
    ("structure walk", _PKG + "parallel.tensor_aware_state_dict:sharded_objects", "phase"),
    ("structure walk", _PKG + "parallel.template:sharded_objects", "phase"),
    ("structure walk", _PKG + "parallel.load_checks:sharded_objects", "phase"),
    ("structure walk", _PKG + "parallel.template:template_targets", "phase"),
    ("structure walk", _PKG + "manager.loading:template_targets", "phase"),
    # the cached save's one walk (tree, shard rows) and its comparison with the cache
    ("structure walk", _PKG + "manager.saving:snapshot_parts", "phase"),
    ("fingerprint", _PKG + "manager.saving:SavePath._probe", "phase"),
    ("fingerprint", _PKG + "manager.saving:SavePath._stage_cached", "phase"),
    # fingerprint: the structure digest (first save), the cached distribution's check
    ("fingerprint", _PKG + "parallel.tensor_aware_state_dict:structure_fingerprint", "phase"),
    ("fingerprint", _PKG + "parallel.distribution:structure_fingerprint", "phase"),
    ("fingerprint", _PKG + "parallel.tensor_aware_state_dict:check_cached", "phase"),
    # distribution: from_state_dict's own part (shard records, meta check, dropping unsaved
    # data, the world all-gather) and the assignment
    (
        "distribution",
        _PKG + "parallel.tensor_aware_state_dict:MCoreTensorAwareStateDict.from_state_dict",
        "phase",
    ),
    ("distribution compute", _PKG + "parallel.tensor_aware_state_dict:compute_distribution", "phase"),
    ("validation", _PKG + "parallel.tensor_aware_state_dict:validate_sharding_integrity", "phase"),
    ("validation", _PKG + "parallel.load_checks:validate_sharding_integrity", "phase"),
    # hollow state dict <-> codec bytes
    # (to_bytes delegates to hollow_encoding: wrapping both would count the bytes twice)
    (
        "hollow decoding",
        _PKG + "parallel.tensor_aware_state_dict:MCoreTensorAwareStateDict.from_bytes",
        "phase",
    ),
    (
        "hollow encoding",
        _PKG + "parallel.tensor_aware_state_dict:MCoreTensorAwareStateDict.hollow_encoding",
        "encode",
    ),
    ("hollow encoding", _PKG + "manager.saving:encode_hollow", "encode"),
    # header: the tensor table, pack / unpack, the files
    ("layout planning", _PKG + "manager.saving:plan_layout_runs", "phase"),
    ("header pack", _PKG + "memory.layout:CheckpointHeader.pack", "encode"),
    ("header unpack", _PKG + "memory.layout:CheckpointHeader.unpack", "phase"),
    ("header publish", _PKG + "memory.store:CheckpointStore.publish", "phase"),
    ("header read", _PKG + "memory.store:CheckpointStore.read_header", "phase"),
    ("header read", _PKG + "memory.store:CheckpointStore.open", "phase"),
    ("header: p2p exchange", _PKG + "replication.transport:P2PTransport._exchange_headers", "p2p"),
    # agreement and the fail-together votes
    ("agreement", _PKG + "manager.saving:SavePath._agree", "phase"),
    ("vote", _PKG + "parallel.collectives:agree_or_fail", "phase"),
    # holdings
    ("holdings gather", _PKG + "manager.loading:gather_holdings", "phase"),
    ("holdings gather", _PKG + "manager.saving:gather_holdings", "phase"),
    ("holdings gather", _PKG + "manager.restore:gather_holdings", "phase"),
    ("store scan", _PKG + "manager.restore:_scan_holdings", "phase"),
    # planning
    ("retrieval planning", _PKG + "manager.loading:plan_retrieval", "phase"),
    ("retrieval planning", _PKG + "manager.restore:plan_retrieval", "phase"),
    ("exchange planning", _PKG + "parallel.load_exchange:plan_exchange", "phase"),
    ("exchange planning", _PKG + "parallel.load_checks:plan_exchange", "phase"),
    # load checks (facts, the gathered verdict), template fill
    ("restore check", _PKG + "manager.loading:LoadPath._check_template", "phase"),
    ("restore check", _PKG + "manager.loading:check_restorable", "phase"),
    ("load facts", _PKG + "parallel.load_exchange:_gather_load_facts", "phase"),
    ("load verdict", _PKG + "parallel.load_exchange:load_verdict", "phase"),
    ("load verdict", _PKG + "parallel.load_checks:load_verdict", "phase"),
    (
        "to_state_dict (rest)",
        _PKG + "parallel.tensor_aware_state_dict:MCoreTensorAwareStateDict.to_state_dict",
        "phase",
    ),
    ("objects exchange", _PKG + "parallel.load_exchange:_exchange_objects", "phase"),
    ("template fill", _PKG + "parallel.load_exchange:fill_template", "phase"),
    ("template fill", _PKG + "manager.loading:_unborrow", "phase"),
    # data plane (reported so the operations add up; not the subject of this benchmark)
    ("staging start", _PKG + "manager.saving:SavePath._stage", "phase"),
    ("staging start", _PKG + "manager.saving:SavePath._start_copies", "phase"),
    ("staging wait", _PKG + "manager.saving:SavePath._store_and_replicate", "phase"),
    ("checksum", _PKG + "manager.saving:_with_checksums", "phase"),
    ("replication (data)", _PKG + "manager.saving:SavePath._replicate", "phase"),
    ("retrieval (data)", _PKG + "manager.loading:retrieve", "phase"),
    ("local replica shards", _PKG + "manager.restore:_plan_node_copies", "phase"),
    ("local replica shards", _PKG + "manager.loading:LoadPath._extra_shards", "phase"),
    ("rebuild", _PKG + "manager.loading:LoadPath._decode_here", "phase"),
    ("data exchange", _PKG + "parallel.load_exchange:execute_exchange", "phase"),
    # housekeeping
    ("group setup", _PKG + "manager.checkpoint_manager:CheckpointManager._ckpt_group", "phase"),
    ("retire earlier run", _PKG + "manager.saving:SavePath._retire_earlier_run", "phase"),
    ("retention + prefetch", _PKG + "manager.saving:SavePath._complete_save", "phase"),
    ("save thread (rest)", _PKG + "manager.saving:SavePath._finish_save", "phase"),
    ("housekeeping", _PKG + "manager.loading:LoadPath._drop_abandoned", "phase"),
    ("housekeeping", _PKG + "memory.store:CheckpointStore.sweep_orphans", "phase"),
    ("healing (plan)", _PKG + "manager.healing:Healing._heal_after_restore", "phase"),
    # collectives
    ("all-gather", _PKG + "parallel.collectives:all_gather_bytes", "gather"),
    ("msgpack", _PKG + "parallel.collectives:all_gather_msgpack", "msgpack"),
    ("all-reduce", _PKG + "parallel.collectives:all_reduce_int", "reduce"),
)

#: The issue's phases (and the extra ones this benchmark reports), from the profiler's.
ISSUE_PHASES: Dict[str, Tuple[str, ...]] = {
    "structure walk": ("structure walk",),
    "fingerprint": ("fingerprint",),
    "distribution": ("distribution", "distribution compute"),
    "validation": ("validation",),
    "hollow encoding": ("hollow encoding",),
    "hollow decoding": ("hollow decoding",),
    "header": ("layout planning", "header pack", "header unpack", "header publish", "header read", "header"),
    "agreement": ("agreement", "vote"),
    "holdings gather": ("holdings gather", "store scan"),
    "retrieval planning": ("retrieval planning",),
    "exchange planning": ("exchange planning",),
    "load checks": (
        "restore check",
        "load facts",
        "load verdict",
        "to_state_dict (rest)",
        "objects exchange",
    ),
    "template fill": ("template fill",),
    "data plane": (
        "staging wait (caller)",
        "staging start",
        "staging wait",
        "checksum",
        "replication (data)",
        "retrieval (data)",
        "local replica shards",
        "rebuild",
        "data exchange",
    ),
    "housekeeping": (
        "group setup",
        "retire earlier run",
        "retention + prefetch",
        "save thread (rest)",
        "housekeeping",
        "healing (plan)",
    ),
    "unattributed": ("caller (unattributed)", "save thread (unattributed)"),
}
_ISSUE_OF = {p: issue for issue, ps in ISSUE_PHASES.items() for p in ps}
#: the control-plane phases the issue names, in its order (plus validation and load checks)
CONTROL_PHASES = (
    "structure walk",
    "fingerprint",
    "distribution",
    "validation",
    "hollow encoding",
    "hollow decoding",
    "header",
    "agreement",
    "holdings gather",
    "retrieval planning",
    "exchange planning",
    "load checks",
    "template fill",
)


def issue_phase(row: str) -> str:
    """The issue phase of a profiler row (``"distribution: all-gather"`` -> distribution)."""
    return _ISSUE_OF.get(row.split(":")[0], "unattributed")


def _resolve(target: str) -> Tuple[Any, str]:
    import importlib

    mod_name, _, path = target.partition(":")
    owner: Any = importlib.import_module(mod_name)
    *parents, attr = path.split(".")
    for p in parents:
        owner = getattr(owner, p)
    return owner, attr


class PhaseProfiler:
    """Wraps :data:`PHASES` in place for the duration of ``with profiler:``; rows accumulate
    ``[seconds exclusive, calls, bytes sent, bytes received, bytes encoded]`` per phase, over
    every thread (each thread has its own stack of wrapped calls; the calling thread's share
    of the seconds is kept apart, for the ``caller (unattributed)`` row)."""

    def __init__(self, phases: Sequence[Tuple[str, str, str]] = PHASES):
        self.phases = phases
        self._tls = threading.local()
        self._lock = threading.Lock()
        self.rows: Dict[str, List[float]] = {}
        self._undo: List[Tuple[Any, str, Any]] = []

    # -- install / uninstall
    def __enter__(self) -> "PhaseProfiler":
        for phase, target, kind in self.phases:
            owner, attr = _resolve(target)
            raw = owner.__dict__[attr] if isinstance(owner, type) else getattr(owner, attr)
            if isinstance(raw, (classmethod, staticmethod)):
                new = type(raw)(self._wrap(raw.__func__, phase, kind))
            else:
                new = self._wrap(raw, phase, kind)
            self._undo.append((owner, attr, raw))
            setattr(owner, attr, new)
        return self

    def __exit__(self, *exc) -> None:
        for owner, attr, raw in reversed(self._undo):
            setattr(owner, attr, raw)
        self._undo.clear()

    def reset(self) -> None:
        with self._lock:
            self.rows = {}

    def snapshot(self, unattributed_s: Optional[float] = None) -> Dict[str, List[float]]:
        """The rows so far; ``unattributed_s``: the caller's wall time of the operation, whose
        part no calling-thread row covers becomes ``caller (unattributed)``."""
        with self._lock:
            rows = {k: list(v) for k, v in self.rows.items()}
        if unattributed_s is not None:
            covered = sum(v[5] for v in rows.values())
            rows["caller (unattributed)"] = [max(0.0, unattributed_s - covered), 1, 0, 0, 0, 0]
        return {k: v[:5] for k, v in rows.items()}

    # -- the wrapper
    def _frames(self) -> list:
        frames = getattr(self._tls, "frames", None)
        if frames is None:
            frames = self._tls.frames = []
        return frames

    def _enclosing(self, frames: list) -> str:
        for f in reversed(frames):
            if f[1] in ("phase", "encode"):
                return f[0]
        if threading.current_thread().name.startswith("resilient_ckpt-save"):
            return "save thread (unattributed)"
        return "caller (unattributed)"

    def _add(self, label: str, seconds: float, sent: int, recv: int, enc: int) -> None:
        main = threading.current_thread() is threading.main_thread()
        with self._lock:
            row = self.rows.setdefault(label, [0.0, 0, 0, 0, 0, 0.0])
            row[0] += seconds
            row[5] += seconds if main else 0.0
            row[1] += 1
            row[2] += sent
            row[3] += recv
            row[4] += enc

    def _wrap(self, fn: Callable, phase: str, kind: str) -> Callable:
        prof = self

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            frames = prof._frames()
            if kind in ("phase", "encode"):
                label = phase
            elif kind == "p2p":
                label = phase
            else:
                label = f"{prof._enclosing(frames)}: {phase}"
            sent = recv = enc = 0
            if kind == "p2p":  # P2PTransport._exchange_headers(self, transfers)
                transfers = args[1]
                sent = sum(len(t.header) for t in transfers if t.send)
                recv = sum(t.header_len for t in transfers if not t.send)
            frame = [label, kind, 0.0]
            frames.append(frame)
            t0 = time.perf_counter()
            try:
                out = fn(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                frames.pop()
                if frames:
                    frames[-1][2] += dt
            if kind == "encode":
                enc = len(getattr(out, "meta", out))  # bytes, or a HollowEncoding's bytes
            elif kind == "gather":
                payload = args[0]
                sent = len(payload)
                recv = sum(len(b) for b in out) - sent
            elif kind == "reduce":
                group = args[2] if len(args) > 2 else kwargs.get("group")
                from ..parallel import collectives

                if collectives.group_size(group) > 1:
                    sent = recv = 8
            prof._add(label, dt - frame[2], sent, recv, enc)
            return out

        return wrapper


# --- real ranks ----------------------------------------------------------------------------


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
    from ..manager.checkpoint_manager import CheckpointManager

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

    from ..memory.layout import CheckpointId
    from ..model.validation import object_record, shard_record
    from ..parallel.distribution import structure_fingerprint
    from ..parallel.template import preprocess, sharded_objects, sharded_tensors

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
        "hollow": len(header.meta),
        "tensors_saved": len(header.tensors),
    }


def _ours_save_rank(ctx, spec: RealSpec) -> Dict[str, Any]:
    import torch.distributed as dist

    from .launcher import quiet

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

    from ..manager.restore import _scan_holdings
    from ..memory.layout import CheckpointId
    from ..parallel.load_checks import same_structure
    from ..parallel.template import prepare_template
    from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
    from .launcher import quiet

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

    from .baseline import BaselineInlineSystem
    from .launcher import quiet

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

    from .baseline import BaselineInlineSystem
    from .launcher import quiet

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
    from .launcher import launch

    return launch(
        fn,
        2,
        tmp_root,
        ranks_per_node=1,
        args=(spec,),
        session=session,
        replication_factor=2,
        timeout=timeout,
        preload=["resilient_ckpt.bench.control_plane", "resilient_ckpt.manager.checkpoint_manager"],
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


# --- simulated world sizes -----------------------------------------------------------------


@dataclass(frozen=True)
class SimLayout:
    """W ranks x S shards: TP-sharded parameters replicated over DP, optimizer state sharded
    over every rank, one ShardedObject per rank. The parallelization group is the world (the
    manager's default, and the largest planning problem)."""

    world: int
    shards: int
    tp: int = 8
    ranks_per_node: int = 8
    keep_last: int = 2
    replication_factor: int = 2

    @property
    def tp_size(self) -> int:
        return min(self.tp, self.world)

    def rows(self, i: int) -> int:
        return 16 + (i * 37) % 64

    def n_params(self) -> int:
        return self.shards // 2

    def entries(self, rank: int):
        """(key, offset, local shape, global shape, is_main) per shard of ``rank``."""
        tp = self.tp_size
        t, d = rank % tp, rank // tp
        out = []
        for i in range(self.shards):
            rows = self.rows(i)
            if i < self.n_params():
                out.append((f"decoder.{i}.weight", (t * rows, 0), (rows, 64), (tp * rows, 64), d == 0))
            else:
                out.append(
                    (f"optimizer.{i}.exp_avg", (rank * rows, 0), (rows, 64), (self.world * rows, 64), True)
                )
        return out

    def sharded_tensors(self, rank: int, data: bool = False):
        """Real ShardedTensors of ``rank`` (no data, or meta tensors), for checks and the
        per-rank local phases."""
        import torch

        from ..model.mapping import ShardedTensor

        tp = self.tp_size
        out = []
        for key, off, shape, gshape, _main in self.entries(rank):
            replica = (rank // tp) if key.startswith("decoder") else 0
            t = torch.empty(shape, dtype=torch.float32, device="meta") if data else None
            out.append(
                ShardedTensor(key, t, torch.float32, shape, gshape, off, (gshape[0] // shape[0], 1), replica)
            )
        return out

    def state_dict(self, rank: int, data: bool = False) -> Dict[str, Any]:
        from ..model.mapping import ShardedObject

        sts = self.sharded_tensors(rank, data)
        return {
            "model": {f"t{i}": st for i, st in enumerate(sts)},
            "rng_state": ShardedObject("rng_state", {"seed": rank}, (self.world,), (rank,)),
            "iteration": 0,
        }


def _records(lay: SimLayout, rank: int) -> List[list]:
    """shard_record() of every shard of ``rank``, as msgpack delivers it (lists)."""
    return [
        [key, list(off), list(shape), list(gshape), "float32", main, False]
        for key, off, shape, gshape, main in lay.entries(rank)
    ]


def _fingerprint_of(lay: SimLayout, rank: int) -> str:
    from ..parallel.distribution import fingerprint_records

    return fingerprint_records(
        (key, tuple(off), tuple(shape), tuple(g), "float32", main, False)
        for key, off, shape, g, main in lay.entries(rank)
    )


class _Rank:
    """One simulated rank's metadata in decoded form (what ``all_gather_msgpack`` returns for
    it on every rank). Lists are shared between payloads where the real ones are equal (the
    computations only read them)."""

    def __init__(self, lay: SimLayout, rank: int):
        self.rank = rank
        self.records = _records(lay, rank)
        self.obj = ["rng_state", [rank], [lay.world]]
        self.obj_record = ["rng_state", [rank], [lay.world], True]
        self.keys = sorted({r[0] for r in self.records} | {"rng_state"})
        self.fp = _fingerprint_of(lay, rank)
        self.held: List[list] = []
        self.need_all: List[list] = []
        self.need_rest: List[list] = []

    def dist_payload(self) -> dict:
        """What ``from_state_dict`` contributes to the world all-gather (first save)."""
        return {
            "rank": self.rank,
            "error": None,
            "shards": self.records,
            "objects": [self.obj_record],
            "fp": self.fp,
        }

    def set_saved(self, saved: set) -> None:
        self.held = [[r[0], r[1], "float32", r[2]] for r in self.records if (r[0], tuple(r[1])) in saved]
        self.need_all = [[r[0], r[1], "float32", r[2], False] for r in self.records]
        self.need_rest = [n for n in self.need_all if (n[0], tuple(n[1])) not in saved]

    def facts_payload(self, need_all: bool) -> dict:
        """What ``check_restorable`` (``need_all``) or ``to_state_dict`` contributes to its
        all-gather: :func:`load_checks.load_facts` with validation records (the
        manager validates in both)."""
        head: Dict[str, Any] = {"rank": self.rank, "error": None}
        if need_all:
            head["unknown"] = False
        return {
            **head,
            "held": self.held,
            "need": self.need_all if need_all else self.need_rest,
            "need_obj": [self.obj] if need_all else [],
            "held_obj": [self.obj],
            "ckpt_keys": self.keys,
            "requested": self.keys,
            "records": self.records,
            "obj_records": [self.obj_record],
        }


def _holdings_payload(lay: SimLayout, rank: int, nbytes: Sequence[int]) -> dict:
    """What ``gather_holdings`` contributes: the rank's node store listing (its node's ranks'
    checkpoints and the replicas ring placement puts there, ``keep_last`` iterations)."""
    rpn = lay.ranks_per_node
    node = rank // rpn
    nodes = -(-lay.world // rpn)
    owners = list(range(node * rpn, min(lay.world, (node + 1) * rpn)))
    if lay.replication_factor > 1 and nodes > 1:
        prev = (node - 1) % nodes
        owners += list(range(prev * rpn, min(lay.world, (prev + 1) * rpn)))
    its = [FIRST_ITERATION + 10 * k for k in range(lay.keep_last)]
    ids = sorted([it, o, nbytes[o]] for it in its for o in owners)
    return {"e": "", "p": {"store": f"node{node}:2049:{1000 + node}", "ids": ids, "foreign": []}}


def _check_synthetic(lay: SimLayout, ranks: Sequence[_Rank]) -> None:
    """The synthetic payloads equal what the real code builds from real ShardedTensors."""
    import msgpack

    from ..model.validation import object_record, shard_record
    from ..parallel.distribution import structure_fingerprint
    from ..parallel.exchange import dtype_name
    from ..parallel.load_checks import load_facts
    from ..parallel.template import preprocess, sharded_objects, sharded_tensors

    def rt(x):
        return msgpack.unpackb(msgpack.packb(x, use_bin_type=True), raw=False, strict_map_key=False)

    for rank in sorted({0, lay.world // 2, lay.world - 1}):
        sd = lay.state_dict(rank)
        sharded, *_ = preprocess(sd)
        shards = sharded_tensors(sharded)
        objects = sharded_objects(sharded)
        real = {
            "rank": rank,
            "error": None,
            "shards": [list(shard_record(s)) for s in shards],
            "objects": [list(object_record(o)) for o in objects],
            "fp": structure_fingerprint(shards),
        }
        mine = ranks[rank]
        if rt(real) != mine.dist_payload():
            raise AssertionError(f"synthetic distribution payload differs from the real one (rank {rank})")
        held_ids = {(h[0], tuple(h[1])) for h in mine.held}
        held = [
            (s.shard_id, dtype_name(s.dtype), tuple(s.local_shape)) for s in shards if s.shard_id in held_ids
        ]
        keys = {s.key for s in shards} | {o.key for o in objects}
        for need_all in (True, False):
            facts = load_facts(shards, objects, held, objects, keys, True, need_all=need_all)
            head = {"rank": rank, "error": None, **({"unknown": False} if need_all else {})}
            if rt({**head, **facts}) != mine.facts_payload(need_all):
                raise AssertionError(
                    f"synthetic load facts differ from the real ones (rank {rank}, need_all={need_all})"
                )


def _timed(fn: Callable[..., Any], *args: Any) -> Tuple[float, Any]:
    t0 = time.perf_counter()
    out = fn(*args)
    return time.perf_counter() - t0, out


def _facts_of(ranks: Sequence["_Rank"], need_all: bool, rank: int) -> dict:
    return ranks[rank].facts_payload(need_all)


def _holdings_table(gathered: List[dict]):
    """``gather_holdings``' code after its gather: the Holdings every rank builds."""
    from ..manager.restore import Holdings

    ps = [g["p"] for g in gathered]
    return Holdings(
        store_keys=tuple(g["store"] for g in ps),
        ids=tuple({(int(it), int(o)): int(n) for it, o, n in g["ids"]} for g in ps),
        foreign=tuple(tuple(g["foreign"]) for g in ps),
    )


def _retrieval_plan(holdings, world: int):
    """The newest complete iteration, then ``plan_retrieval`` as the restore calls it."""
    from ..replication.placement import plan_retrieval

    it = holdings.complete_iterations(world)[0]
    return plan_retrieval(
        {r: r for r in range(world)}, holdings.available(it), holdings.node_of, holdings.nbytes(it)
    )


def _gather(make: Callable[[int], Any], world: int) -> Tuple[Dict[str, float], List[Any]]:
    """An all-gather of ``make(rank)`` payloads, as every rank sees it: each encoded with the
    real encoder (msgpack, as ``all_gather_msgpack``), then all W decoded, timed, as
    ``all_gather_msgpack`` does on every rank. Returns the row (bytes of rank 0: sent = its
    payload, received = the other ranks'; gloo pads each to the largest: ``received_padded``)
    and the decoded payloads, which the planning functions are then fed."""
    import msgpack

    raws = [msgpack.packb(make(r), use_bin_type=True) for r in range(world)]
    t0 = time.perf_counter()
    decoded = [msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True) for raw in raws]
    t = time.perf_counter() - t0
    sizes = [len(r) for r in raws]
    del raws
    if decoded[0] != make(0):
        raise AssertionError("a synthetic payload does not survive msgpack unchanged")
    row = dict(
        seconds=t,
        sent=sizes[0],
        received=sum(sizes) - sizes[0],
        received_padded=max(sizes) * (world - 1),
        max_payload=max(sizes),
    )
    return row, decoded


def _local_phases(lay: SimLayout, dist_, rows: Dict[str, Dict[str, float]]) -> None:
    """Rank 0's local phases (no gathered data: independent of W but for the object grid):
    structure walk, fingerprint, hollow encoding / decoding, header pack / unpack."""
    from ..memory.layout import CheckpointHeader, plan_layout
    from ..parallel.distribution import check_cached, structure_fingerprint
    from ..parallel.load_checks import same_structure
    from ..parallel.template import prepare_template, preprocess, sharded_tensors
    from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict

    sd = lay.state_dict(0, data=True)
    t, (sharded, *_rest) = _timed(preprocess, sd)
    shards = sharded_tensors(sharded)
    rows["structure walk"] = dict(seconds=t)
    t, _ = _timed(structure_fingerprint, shards)
    rows["fingerprint"] = dict(seconds=t)
    t, _ = _timed(check_cached, dist_, shards, 0, lay.world)
    rows["fingerprint (cached check)"] = dict(seconds=t)
    saved = tuple(dist_.main_rank_for_shard[s.shard_id] == 0 for s in shards)
    for s in shards:
        s.data = None
    hollow = MCoreTensorAwareStateDict(common={}, sharded_state_dict=sharded, _is_hollow=True, _saved=saved)
    t, meta = _timed(hollow.to_bytes)
    rows["hollow encoding"] = dict(seconds=t, encoded=len(meta))
    t, decoded = _timed(MCoreTensorAwareStateDict.from_bytes, meta)
    rows["hollow decoding"] = dict(seconds=t)
    # a restart's template, walked once, compared with the decoded checkpoint's structure
    template = lay.state_dict(0, data=True)
    t0 = time.perf_counter()
    same = same_structure(prepare_template(template), decoded)
    rows["restore check (same structure)"] = dict(seconds=time.perf_counter() - t0)
    if not same:
        raise AssertionError("the simulated template does not have its checkpoint's structure")
    kept = [s for s, k in zip(shards, saved) if k]
    layouts, total = plan_layout([(s.dtype, s.local_shape) for s in kept])
    header = CheckpointHeader(
        session=SESSION,
        iteration=FIRST_ITERATION,
        owner=0,
        world_size=lay.world,
        tensors=tuple(layouts),
        data_nbytes=total,
        meta=meta,
        replication={
            "kind": "ring",
            "factor": 2,
            "jump": lay.ranks_per_node,
            "ranks_per_node": lay.ranks_per_node,
        },
    )
    t, raw = _timed(header.pack)
    # p2p, not gathered: sent to each holder (factor - 1), one received per replica held
    rows["header pack"] = dict(
        seconds=t, encoded=len(raw), sent=len(raw) * (lay.replication_factor - 1), received=len(raw)
    )
    t, _ = _timed(CheckpointHeader.unpack, raw)
    rows["header unpack"] = dict(seconds=t)


def _planners(keys: Sequence[str], world: int) -> Tuple[Dict[str, int], Dict[int, int], int]:
    """Each key's planner, keys per planner, and the busiest planner (every key is held by
    every rank in the simulated layout, so the one with the most keys)."""
    from ..parallel.sharded_planning import planner_of

    planner = {k: planner_of(k, world) for k in keys}
    keys_of: Dict[int, int] = {}
    for p in planner.values():
        keys_of[p] = keys_of.get(p, 0) + 1
    return planner, keys_of, max(keys_of, key=lambda p: (keys_of[p], -p))


def _all_to_all(outgoing: Callable[[int, int], Any], world: int, busiest: int):
    """An all_to_all_msgpack as rank 0 sends (``outgoing(0, d)`` to every d) and the busiest
    planner receives (``outgoing(r, busiest)`` from every r, decoded and timed). Returns the
    row and the decoded messages."""
    import msgpack

    sent = sum(len(msgpack.packb(outgoing(0, d), use_bin_type=True)) for d in range(world))
    raws = [msgpack.packb(outgoing(r, busiest), use_bin_type=True) for r in range(world)]
    t0 = time.perf_counter()
    received = [msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True) for raw in raws]
    row = dict(seconds=time.perf_counter() - t0, sent=sent, received=sum(len(r) for r in raws))
    return row, received


def _sim_sharded_save(lay: SimLayout, ranks: Sequence["_Rank"], rows: Dict[str, Dict[str, float]]) -> None:
    """The sharded planner (parallel/sharded_planning.py) as rank 0 sends and as the busiest
    planner receives and computes: messages built and encoded as the real code does
    (``_outgoing``'s records + tag, ``all_to_all_msgpack``'s msgpack), decoded and planned
    with the real ``_plan``. The parallelization group is the world (the largest problem)."""
    import msgpack

    from ..parallel import sharded_planning as sp

    world = lay.world
    rows["planning: error gather: all-gather"], _ = _gather(lambda r: {"e": "", "p": None}, world)
    planner, keys_of, busiest = _planners(ranks[0].keys, world)
    load: Dict[int, int] = {}
    for rec in ranks[0].records:
        load[planner[rec[0]]] = load.get(planner[rec[0]], 0) + 1

    def outgoing(r: int, dest: int) -> dict:
        tag = [0, r, world]
        out = {"t": [[*rec, *tag] for rec in ranks[r].records if planner[rec[0]] == dest], "o": []}
        if planner["rng_state"] == dest:
            out["o"].append(ranks[r].obj_record)
        return out

    rows["planning: records: all-to-all"], received = _all_to_all(outgoing, world, busiest)
    rows["planning: records: all-to-all"]["planner_keys"] = keys_of[busiest]
    t, (problems, answers) = _timed(sp._plan, received, busiest, world)
    if problems:
        raise AssertionError(f"the simulated layout fails its integrity check: {problems[:3]}")
    rows["planning: checks + assignment"] = dict(seconds=t)
    # rank 0 gets, from every planner, one 0/1 per record it sent there
    back = [msgpack.packb([1] * load.get(q, 0), use_bin_type=True) for q in range(world)]
    t0 = time.perf_counter()
    for raw in back:
        msgpack.unpackb(raw, raw=False, use_list=True)
    t = time.perf_counter() - t0
    rows["planning: answers: all-to-all"] = dict(
        seconds=t,
        sent=sum(len(msgpack.packb(a, use_bin_type=True)) for a in answers),
        received=sum(len(b) for b in back),
    )
    rows["planning: problem count: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    rows["planning: group facts: all-gather"], _ = _gather(lambda r: [1 << 30, ranks[r].fp], world)


def _sim_same_structure_fill(ranks: Sequence["_Rank"], world: int, rows: Dict[str, Dict[str, float]]) -> None:
    """``to_state_dict(same_structure=True)`` for every rank's missing shards (here every
    shard it did not save: an upper bound, replicas in the node's store would cover some).
    From SHARDED_PLANNING_MIN_WORLD ranks, planned by key (``plan_exchange_sharded``, as rank 0
    sends and the busiest planner receives and plans); below, a gather of the missing shards,
    a gather of their holders and the exchange plan every rank computes."""
    import msgpack

    from ..parallel import sharded_planning as sp
    from ..parallel.exchange import plan_exchange

    if not sp.use_sharded_planning(world):
        rows["to_state_dict: needs: all-gather"], needs = _gather(
            lambda r: {"rank": r, "error": None, "need": [n[:2] for n in ranks[r].need_rest], "held": []},
            world,
        )
        wanted = {(key, tuple(off)) for g in needs for key, off in g["need"]}
        rows["to_state_dict: holders: all-gather"], holders = _gather(
            lambda r: [h for h in ranks[r].held if (h[0], tuple(h[1])) in wanted], world
        )
        t, (xplan, _absent) = _timed(
            plan_exchange, [{"need": g["need"], "held": h} for g, h in zip(needs, holders)]
        )
        rows["exchange planning"] = dict(seconds=t, transfers=len(xplan.transfers))
        return
    rows["to_state_dict: error gather: all-gather"], _ = _gather(lambda r: {"e": "", "p": None}, world)
    planner, keys_of, busiest = _planners(ranks[0].keys, world)

    def outgoing(r: int, dest: int) -> dict:
        rk = ranks[r]
        return {
            "n": [[n[0], n[1], i] for i, n in enumerate(rk.need_rest) if planner[n[0]] == dest],
            "h": [h for h in rk.held if planner[h[0]] == dest],
        }

    sent = sum(len(msgpack.packb(outgoing(0, d), use_bin_type=True)) for d in range(world))
    raws = [msgpack.packb(outgoing(r, busiest), use_bin_type=True) for r in range(world)]
    t0 = time.perf_counter()
    received = [msgpack.unpackb(raw, raw=False, strict_map_key=False, use_list=True) for raw in raws]
    t = time.perf_counter() - t0
    rows["to_state_dict: needs + holdings: all-to-all"] = dict(
        seconds=t, sent=sent, received=sum(map(len, raws))
    )
    del raws
    t, (per_rank, absent) = _timed(sp._match, received, world)
    if absent:
        raise AssertionError("the simulated restore needs a shard nobody holds")
    rows["exchange planning"] = dict(seconds=t, transfers=sum(len(x) for x in per_rank) // 2)
    rows["to_state_dict: absent count: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    # rank 0 receives its transfers from every planner: at most one row per shard it lacks,
    # one per (shard, receiver) it serves; the busiest planner's rows to rank 0 stand for a
    # planner's, their share of rank 0's transfers scaled to all of them
    mine = per_rank[0]
    t0 = time.perf_counter()
    raw = msgpack.packb(mine, use_bin_type=True)
    msgpack.unpackb(raw, raw=False, use_list=True)
    t = time.perf_counter() - t0
    share = max(1, keys_of[busiest]) / max(1, len(ranks[0].keys))
    rows["to_state_dict: transfers: all-to-all"] = dict(
        seconds=t / share,
        sent=int(sum(len(msgpack.packb(x, use_bin_type=True)) for x in per_rank)),
        received=int(len(raw) / share),
    )


def run_simulated(
    world: int, shards: int, tp: int = 8, check: bool = True, log: Callable[[str], None] = print
):
    """One simulated world size: per-rank seconds of every planning computation and the bytes
    each rank contributes to / receives from every all-gather (rank 0's figures)."""
    from ..model.validation import validate_sharding_integrity
    from ..parallel.distribution import compute_distribution
    from ..parallel.sharded_planning import use_sharded_planning

    lay = SimLayout(world, shards, tp)
    rows: Dict[str, Dict[str, float]] = {}
    t_start = time.perf_counter()
    ranks = [_Rank(lay, r) for r in range(world)]
    gen_s = time.perf_counter() - t_start

    # first save: the gathered planner (W < SHARDED_PLANNING_MIN_WORLD) or the sharded one
    if use_sharded_planning(world):
        _sim_sharded_save(lay, ranks, rows)
        t_untimed = time.perf_counter()  # the assignment the restore part needs (not timed)
        dist_ = compute_distribution((), None, [rk.dist_payload() for rk in ranks])
        gen_s += time.perf_counter() - t_untimed
    else:
        rows["distribution: all-gather"], gathered = _gather(lambda r: ranks[r].dist_payload(), world)
        shards_by_rank, objects_by_rank = [g["shards"] for g in gathered], [g["objects"] for g in gathered]
        t, _ = _timed(validate_sharding_integrity, shards_by_rank, objects_by_rank)
        rows["validation (save)"] = dict(seconds=t)
        t, dist_ = _timed(compute_distribution, (), None, gathered)
        rows["distribution compute"] = dict(seconds=t)
        del gathered, shards_by_rank, objects_by_rank
    saved_by: Dict[int, set] = {r: set() for r in range(world)}
    for sid, r in dist_.main_rank_for_shard.items():
        saved_by[r].add(sid)
    for rk in ranks:
        rk.set_saved(saved_by[rk.rank])
    del saved_by
    if check:
        _check_synthetic(lay, ranks)
    rows["agreement: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    _local_phases(lay, dist_, rows)

    # restore: holdings, retrieval plan, then (the restart's template is the saved structure on
    # every rank) one all-reduce for the checks and to_state_dict's two small gathers
    nbytes = list(dist_.rank_bytes)
    del dist_
    rows["holdings gather: all-gather"], gathered = _gather(
        lambda r: _holdings_payload(lay, r, nbytes), world
    )
    t, holdings = _timed(_holdings_table, gathered)
    rows["holdings gather (table)"] = dict(seconds=t)
    t, plan = _timed(_retrieval_plan, holdings, world)
    if len(plan) != world:
        raise AssertionError("retrieval plan incomplete")
    rows["retrieval planning"] = dict(seconds=t, calls=2)  # _check_template and retrieve
    del gathered, holdings, plan
    rows["restore check: all-reduce"] = dict(seconds=float("nan"), sent=8, received=8)
    _sim_same_structure_fill(ranks, world, rows)
    for r in rows.values():
        r.setdefault("sent", 0)
        r.setdefault("received", 0)
    out = dict(world=world, shards_per_rank=shards, tp=lay.tp_size, rows=rows, generate_s=gen_s)
    out["totals"] = sim_totals(rows)
    out["seconds"] = time.perf_counter() - t_start
    log(
        f"  simulated W={world:>5d} x {shards} shards: first-save planning {out['totals']['save_planning_s']:.2f}s, "
        f"restore planning {out['totals']['restore_planning_s']:.2f}s, received per rank "
        f"{out['totals']['received_bytes'] / MIB:.1f} MiB ({out['seconds']:.0f}s)"
    )
    return out


#: simulated rows making up a first save's planning: the gathered planner's (every rank, on
#: the gathered data), or the sharded planner's (the busiest planner's share)
SIM_SAVE = (
    "distribution: all-gather",
    "validation (save)",
    "distribution compute",
    "planning: error gather: all-gather",
    "planning: records: all-to-all",
    "planning: checks + assignment",
    "planning: answers: all-to-all",
    "planning: group facts: all-gather",
)
#: a restore's: holdings, retrieval plan (x2), the same-structure comparison, to_state_dict's
#: gathers of missing shards and of their holders, the exchange plan
SIM_RESTORE = (
    "holdings gather: all-gather",
    "holdings gather (table)",
    "retrieval planning",
    "restore check (same structure)",
    "to_state_dict: needs: all-gather",
    "to_state_dict: holders: all-gather",
    "to_state_dict: error gather: all-gather",
    "to_state_dict: needs + holdings: all-to-all",
    "to_state_dict: transfers: all-to-all",
    "exchange planning",
)


def sim_totals(rows: Dict[str, Dict[str, float]]) -> Dict[str, float]:
    def s(name):
        r = rows[name]
        return r["seconds"] * r.get("calls", 1) if r["seconds"] == r["seconds"] else 0.0

    wire = [r for n, r in rows.items() if n.endswith(("all-gather", "all-to-all"))]
    return dict(
        save_planning_s=sum(s(n) for n in SIM_SAVE if n in rows),
        restore_planning_s=sum(s(n) for n in SIM_RESTORE if n in rows),
        received_bytes=sum(r["received"] for r in wire),
        received_padded_bytes=sum(r.get("received_padded", 0) for r in rows.values()),
        sent_bytes=sum(r["sent"] for r in wire),
        largest_gather_received_bytes=max(r["received"] for r in wire),
    )


# --- report --------------------------------------------------------------------------------


def slope(xs: Sequence[float], ys: Sequence[float]) -> Optional[float]:
    """Least-squares exponent k of y ~ x^k (log-log); None with fewer than 2 usable points."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys) if x > 0 and y and y > 0 and y == y]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    den = sum((p[0] - mx) ** 2 for p in pts)
    return sum((p[0] - mx) * (p[1] - my) for p in pts) / den if den else None


#: the issue's targets (2 ranks, CPU, 50k tensors / 256 MiB per rank; simulated 1,024 / 4,096)
TARGETS = dict(
    cached_staged_s=0.3, first_save_s=3.0, restore_s=3.0, ratio=0.2, planning_s=1.0, wire_bytes=10 * MIB
)


def _fmt_s(x: Optional[float]) -> str:
    if x is None or x != x:
        return "-"
    return f"{x * 1e3:.1f}ms" if x < 1 else f"{x:.2f}s"


def _fmt_b(n: Optional[float]) -> str:
    if not n:
        return "-"
    if n < 1024:
        return f"{int(n)}B"
    if n < MIB:
        return f"{n / 1024:.1f}K"
    return f"{n / MIB:.1f}M"


OPS = ("first save", "cached save", "restore")


def real_tables(real: List[Dict[str, Any]]) -> List[str]:
    """Per operation: the issue's phases (rows) x tensor counts (time, bytes sent/received)."""
    lines: List[str] = []
    counts = [r["tensors"] for r in real]
    for op in OPS:
        lines.append(f"\n### ours, {op} (2 ranks; slowest rank; bytes per rank sent/received)\n")
        lines.append(
            "| phase | " + " | ".join(f"{n // 1000}k: time | {n // 1000}k: bytes" for n in counts) + " |"
        )
        lines.append("|---|" + "---|---|" * len(counts))
        phases = [p for p in list(CONTROL_PHASES) + ["data plane", "housekeeping", "unattributed"]]
        for ph in phases:
            cells = []
            for r in real:
                p = r["ours"][op].get("phases", {}).get(ph)
                if p is None:
                    cells += ["-", "-"]
                else:
                    b = f"{_fmt_b(p['sent'])}/{_fmt_b(p['received'])}" if p["sent"] or p["received"] else "-"
                    cells += [_fmt_s(p["seconds"]), b]
            lines.append(f"| {ph} | " + " | ".join(cells) + " |")
        totals = [("total", "restore_s")] if op == "restore" else [("until staged", "staged_s")]
        if op != "restore":
            totals.append(("until complete", "complete_s"))
        for label, key in totals:
            lines.append(_bold_row(label, [(_fmt_s(r["ours"][op].get(key)), "") for r in real]))
    return lines


def _bold_row(label: str, pairs: Sequence[Tuple[str, str]]) -> str:
    cells = [f"**{a}**" if a else "" for pair in pairs for a in pair]
    return f"| **{label}** | " + " | ".join(cells) + " |"


def e2e_table(real: List[Dict[str, Any]]) -> List[str]:
    lines = [
        "\n### end to end, ours vs reference (2 ranks, slowest rank, median of repetitions)\n",
        "| tensors/rank | bytes/rank | operation | ours | reference | ours/ref |",
        "|---|---|---|---|---|---|",
    ]
    for r in real:
        for op, key in (
            ("build state dict", ("cached save", "build_s")),
            ("first save until staged", ("first save", "staged_s")),
            ("first save until complete", ("first save", "complete_s")),
            ("cached save until staged", ("cached save", "staged_s")),
            ("cached save until complete", ("cached save", "complete_s")),
            ("restore after restart", ("restore", "restore_s")),
        ):
            ours = r["ours"][key[0]].get(key[1])
            ref = r.get("reference", {}).get(key[0], {}).get(key[1])
            ratio = f"{ours / ref:.2f}" if ours and ref else "-"
            lines.append(
                f"| {r['tensors']} | {_fmt_b(r['bytes_per_rank'])} | {op} | {_fmt_s(ours)} | {_fmt_s(ref)} | {ratio} |"
            )
    return lines


def sim_table(sim: List[Dict[str, Any]]) -> List[str]:
    worlds = [s["world"] for s in sim]
    s0 = sim[0]["shards_per_rank"] if sim else 0
    lines = [
        f"\n### simulated, per rank ({s0} shards/rank; time = what every rank computes on the gathered data)\n",
        "| computation | " + " | ".join(f"W={w}: time | W={w}: sent/received" for w in worlds) + " |",
        "|---|" + "---|---|" * len(worlds),
    ]
    names = list(sim[0]["rows"]) if sim else []
    for name in names:
        cells = []
        for s in sim:
            r = s["rows"][name]
            b = f"{_fmt_b(r['sent'])}/{_fmt_b(r['received'])}" if r["sent"] or r["received"] else "-"
            cells += [_fmt_s(r["seconds"] * r.get("calls", 1)), b]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    for key, label in (
        ("save_planning_s", "first-save planning"),
        ("restore_planning_s", "restore planning"),
    ):
        lines.append(_bold_row(label, [(_fmt_s(s["totals"][key]), "") for s in sim]))
    lines.append(
        _bold_row(
            "received per rank, all gathers", [("", _fmt_b(s["totals"]["received_bytes"])) for s in sim]
        )
    )
    return lines


def exponents(real: List[Dict[str, Any]], sim: List[Dict[str, Any]]) -> Dict[str, Dict[str, Optional[float]]]:
    """Fitted exponents: per issue phase (summed over first save + cached save + restore)
    against tensors per rank; per simulated computation against world size."""
    out: Dict[str, Dict[str, Optional[float]]] = {"tensors": {}, "ranks": {}}
    if len(real) >= 2:
        xs = [r["tensors"] for r in real]
        for ph in CONTROL_PHASES:
            ys = [
                sum(r["ours"][op].get("phases", {}).get(ph, {}).get("seconds", 0) for op in OPS) for r in real
            ]
            out["tensors"][ph] = slope(xs, ys)
        for op, key in (("first save", "staged_s"), ("cached save", "staged_s"), ("restore", "restore_s")):
            out["tensors"][f"{op} ({key})"] = slope(xs, [r["ours"][op].get(key) for r in real])
            if all(r.get("reference") for r in real):
                out["tensors"][f"reference {op} ({key})"] = slope(
                    xs, [r["reference"][op].get(key) for r in real]
                )
    if len(sim) >= 2:
        xs = [s["world"] for s in sim]
        for name in sim[0]["rows"]:
            out["ranks"][name] = slope(xs, [s["rows"][name]["seconds"] for s in sim])
        for key in ("save_planning_s", "restore_planning_s", "received_bytes"):
            out["ranks"][key] = slope(xs, [s["totals"][key] for s in sim])
    return out


def targets_table(real: List[Dict[str, Any]], sim: List[Dict[str, Any]]) -> List[str]:
    lines = [
        "\n### against the issue's targets\n",
        "| target | measured | ratio to target |",
        "|---|---|---|",
    ]
    big = max(real, key=lambda r: r["tensors"]) if real else None

    def row(label, value, target, fmt=_fmt_s):
        ratio = f"{value / target:.1f}x" if value and value == value else "-"
        lines.append(f"| {label} <= {fmt(target)} | {fmt(value)} | {ratio} |")

    if big:
        n = big["tensors"]
        o = big["ours"]
        row(
            f"cached save until staged ({n} tensors)",
            o["cached save"].get("staged_s"),
            TARGETS["cached_staged_s"],
        )
        row(f"first save until staged ({n})", o["first save"].get("staged_s"), TARGETS["first_save_s"])
        row(f"first save until complete ({n})", o["first save"].get("complete_s"), TARGETS["first_save_s"])
        row(f"restore after restart ({n})", o["restore"].get("restore_s"), TARGETS["restore_s"])
        ref = big.get("reference")
        if ref:
            for op, key in (
                ("cached save", "staged_s"),
                ("first save", "staged_s"),
                ("restore", "restore_s"),
            ):
                a, b = o[op].get(key), ref[op].get(key)
                if a and b:
                    lines.append(
                        f"| {op} ours/reference <= 0.2 | {a / b:.2f} | {a / b / TARGETS['ratio']:.1f}x |"
                    )
    for s in sim:
        if s["world"] in (1024, 4096) or s is sim[-1]:
            t = s["totals"]
            row(
                f"planning per rank, W={s['world']} (first save)", t["save_planning_s"], TARGETS["planning_s"]
            )
            row(
                f"planning per rank, W={s['world']} (restore)", t["restore_planning_s"], TARGETS["planning_s"]
            )
            row(
                f"metadata received per rank, W={s['world']} (all gathers)",
                t["received_bytes"],
                TARGETS["wire_bytes"],
                _fmt_b,
            )
            row(
                f"metadata received per rank, W={s['world']} (largest gather)",
                t["largest_gather_received_bytes"],
                TARGETS["wire_bytes"],
                _fmt_b,
            )
    return lines


def plot(result: Dict[str, Any], path: str) -> None:
    """Log-log: left, each control phase (seconds summed over a first save, a cached save and
    a restore) and the three operations' totals against tensors per rank; right, each
    W-dependent planning computation and the per-rank totals against simulated ranks, with the
    metadata each rank receives on a second axis. Legends carry the fitted exponents."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real, sim = result.get("real", []), result.get("simulated", [])
    ex = result.get("exponents", {})
    colors = plt.get_cmap("tab20").colors

    def label(name, k):
        return f"{name} (k={k:.2f})" if k is not None else name

    fig, axes = plt.subplots(1, 2, figsize=(16, 7))
    ax = axes[0]
    if real:
        xs = [r["tensors"] for r in real]
        for i, ph in enumerate(CONTROL_PHASES):
            ys = [
                sum(r["ours"][op].get("phases", {}).get(ph, {}).get("seconds", 0) for op in OPS) for r in real
            ]
            if all(y > 0 for y in ys):
                ax.plot(xs, ys, "o-", color=colors[i % 20], label=label(ph, ex.get("tensors", {}).get(ph)))
        for op, key, style in (
            ("first save", "staged_s", "k--"),
            ("cached save", "staged_s", "k:"),
            ("restore", "restore_s", "k-."),
        ):
            ys = [r["ours"][op].get(key) for r in real]
            k = ex.get("tensors", {}).get(f"{op} ({key})")
            ax.plot(xs, ys, style[1:], color="k", lw=2, label=label(f"ours: {op} ({key[:-2]})", k))
            if all(r.get("reference") for r in real):
                ys = [r["reference"][op].get(key) for r in real]
                k = ex.get("tensors", {}).get(f"reference {op} ({key})")
                ax.plot(xs, ys, style[1:], color="tab:gray", lw=2, label=label(f"reference: {op}", k))
        ax.set_xscale("log")
        ax.set_yscale("log")
    ax.set_xlabel("tensors per rank (2 real ranks)")
    ax.set_ylabel("seconds (phases: first save + cached save + restore; slowest rank)")
    ax.set_title("cost vs tensors per rank")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    ax = axes[1]
    if sim:
        xs = [s["world"] for s in sim]
        names = [n for n in SIM_SAVE + SIM_RESTORE if n in sim[0]["rows"]]
        for i, name in enumerate(names):
            ys = [s["rows"][name]["seconds"] * s["rows"][name].get("calls", 1) for s in sim]
            if all(y > 0 for y in ys):
                ax.plot(xs, ys, "o-", color=colors[i % 20], label=label(name, ex.get("ranks", {}).get(name)))
        for key, style in (("save_planning_s", "k--"), ("restore_planning_s", "k-.")):
            ys = [s["totals"][key] for s in sim]
            ax.plot(
                xs,
                ys,
                style,
                lw=2,
                label=label(key.replace("_s", "").replace("_", " "), ex["ranks"].get(key)),
            )
        ax.axhline(TARGETS["planning_s"], color="tab:red", lw=1, label="target: 1 s per rank")
        ax2 = ax.twinx()
        ys = [s["totals"]["received_bytes"] / MIB for s in sim]
        k = ex.get("ranks", {}).get("received_bytes")
        ax2.plot(xs, ys, color="tab:purple", lw=2, ls=(0, (1, 1)), label=label("MiB received per rank", k))
        ax2.axhline(TARGETS["wire_bytes"] / MIB, color="tab:purple", lw=1, label="target: 10 MiB")
        ax2.set_yscale("log")
        ax2.set_ylabel("MiB received per rank (all gathers)")
        ax2.legend(loc="lower right", fontsize=7)
        ax.set_xscale("log")
        ax.set_yscale("log")
    s0 = sim[0]["shards_per_rank"] if sim else 0
    ax.set_xlabel(f"ranks (simulated, {s0} shards per rank)")
    ax.set_ylabel("seconds per rank (every rank computes the whole plan)")
    ax.set_title("cost vs ranks")
    ax.legend(fontsize=7, loc="upper left")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(result: Dict[str, Any]) -> str:
    lines: List[str] = []
    real, sim = result.get("real", []), result.get("simulated", [])
    if real:
        lines += real_tables(real)
        lines += e2e_table(real)
    if sim:
        lines += sim_table(sim)
    ex = result.get("exponents", {})
    if ex.get("tensors") or ex.get("ranks"):
        lines.append("\n### fitted exponents k (cost ~ x^k, least squares on log-log)\n")
        for axis, label in (("tensors", "vs tensors per rank"), ("ranks", "vs simulated ranks")):
            for name, k in ex.get(axis, {}).items():
                if k is not None:
                    lines.append(f"- {label}: {name}: k = {k:.2f}")
    lines += targets_table(real, sim)
    return "\n".join(lines)


# --- entry point ---------------------------------------------------------------------------


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
        from ..cli import extras

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
