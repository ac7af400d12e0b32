"""The control-plane benchmark's phase profiler: :data:`PHASES` (every wrapped function and its
phase), :data:`ISSUE_PHASES` / :data:`CONTROL_PHASES` (the issue's phases) and
:class:`PhaseProfiler`, which wraps them in place for the duration of a run."""

from __future__ import annotations

import functools
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

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
    ("structure walk", _PKG + "parallel.template:sharded_leaves", "phase"),
    ("structure walk", _PKG + "parallel.tensor_aware_state_dict:sharded_leaves", "phase"),
    ("structure walk", _PKG + "parallel.load_checks:sharded_leaves", "phase"),
    ("structure walk", _PKG + "parallel.tensor_aware_state_dict:sharded_objects", "phase"),
    ("structure walk", _PKG + "parallel.template:sharded_objects", "phase"),
    ("structure walk", _PKG + "parallel.load_checks:sharded_objects", "phase"),
    ("structure walk", _PKG + "parallel.template:shard_targets", "phase"),
    # the cached save's one walk (tree, shard rows) and its comparison with the cache
    ("structure walk", _PKG + "manager.saving:snapshot_parts", "phase"),
    ("fingerprint", _PKG + "manager.saving:SavePath._probe", "phase"),
    ("fingerprint", _PKG + "manager.saving:SavePath._stage_cached", "phase"),
    # fingerprint: the structure digest (first save), the cached distribution's check
    ("fingerprint", _PKG + "parallel.tensor_aware_state_dict:fingerprint_records", "phase"),
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
    # a sealed replica's final header, behind its payload (the first one only announces it)
    ("header: p2p exchange", _PKG + "replication.transport:P2PTransport._exchange_seals", "p2p-seal"),
    # agreement and the fail-together votes
    ("agreement", _PKG + "manager.save_completion:SaveCompletion._agree", "phase"),
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
    ("staging wait", _PKG + "manager.save_completion:SaveCompletion._store_and_replicate", "phase"),
    ("checksum", _PKG + "manager.save_completion:_with_checksums", "phase"),
    ("replication (data)", _PKG + "manager.save_completion:SaveCompletion._replicate", "phase"),
    ("retrieval (data)", _PKG + "manager.loading:retrieve", "phase"),
    ("local replica shards", _PKG + "manager.restore:_plan_node_copies", "phase"),
    ("local replica shards", _PKG + "manager.loading:LoadPath._extra_shards", "phase"),
    ("rebuild", _PKG + "manager.loading:LoadPath._decode_here", "phase"),
    ("data exchange", _PKG + "parallel.load_exchange:execute_exchange", "phase"),
    # housekeeping
    ("group setup", _PKG + "manager.checkpoint_manager:CheckpointManager._ckpt_group", "phase"),
    ("retire earlier run", _PKG + "manager.saving:SavePath._retire_earlier_run", "phase"),
    ("retention + prefetch", _PKG + "manager.save_completion:SaveCompletion._complete_save", "phase"),
    ("save thread (rest)", _PKG + "manager.save_completion:SaveCompletion._finish_save", "phase"),
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
            elif kind in ("p2p", "p2p-seal"):
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
            elif kind == "p2p-seal":  # P2PTransport._exchange_seals(self, sealed): after the call
                sent = sum(len(t.final) for t in args[1] if t.send)
                recv = sum(len(t.final) for t in args[1] if not t.send)
            elif kind == "reduce":
                group = args[2] if len(args) > 2 else kwargs.get("group")
                from ...parallel import collectives

                if collectives.group_size(group) > 1:
                    sent = recv = 8
            prof._add(label, dt - frame[2], sent, recv, enc)
            return out

        return wrapper
