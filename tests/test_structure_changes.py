"""A state dict may change structure between saves: every save and restore decides as a fresh
manager would (issue 21).

Model-based (hypothesis stateful testing) on 2 real gloo ranks, one simulated node each:
random sequences of saves, restores and restarts, with structure changes between saves —
keys added, removed and renamed, tensors grown and shrunk, dtypes switched, ShardedObjects
added and removed, replica ids changed, a tensor's shards moved between the ranks, the state
switching between plain and non-plain (a ``LocalNonpersistentObject``), and one-off
inconsistent saves (a key on one rank only). Each step runs on the manager under test, which
keeps its caches across saves, and on the oracle: a fresh manager per save and per restore, in
stores of its own. Specified: the same outcome on both (the same data restored, or the same
error), the same outcome on every rank, a restore of the structure last saved returns exactly
that save's state, and ``SaveMetrics.structure_cached`` says whether the structure was reused.

Run on the embedded replicas path (factor 2) and the parity path (a mirror pair). The
examples in CI are bounded; ``RC_STRUCTURE_EXAMPLES=500`` runs a longer search.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
import zlib
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    precondition,
    rule,
    run_state_machine_as_test,
)

from upstream.pool import RankPool

pytestmark = [pytest.mark.multiprocess]

EXAMPLES = int(os.environ.get("RC_STRUCTURE_EXAMPLES", "6"))
STEPS = int(os.environ.get("RC_STRUCTURE_STEPS", "10"))
#: RC_STRUCTURE_SHRINK=0: report the first failing sequence as found (shrinking re-runs it a lot)
SHRINK = os.environ.get("RC_STRUCTURE_SHRINK", "1") != "0"

CONFIGS = {
    "replicas": dict(replication_factor=2),
    "parity": dict(redundancy="parity", parity_group=1, parity_shares=1),
}
DTYPES = ("float32", "bfloat16", "int64", "float16", "uint8")
#: how a tensor is held by the 2 ranks (every one a valid sharding)
KINDS = (
    "dp",  # replicated, replica_id = rank (rank 0 main)
    "dp_flip",  # replicated, replica_id = 1 - rank (rank 1 main)
    "dp_tuple",  # replicated, replica_id = (0, rank)
    "tp",  # split along axis 0, rank r holds chunk r
    "tp_swap",  # split along axis 0, rank r holds chunk 1 - r (the shards moved between ranks)
    "local0",  # held whole by rank 0 only
)
OBJECT_KINDS = ("per_rank", "shared")


# ---- the state a spec stands for (built alike in the ranks and in the model) -------------------


@dataclass(frozen=True)
class TensorSpec:
    name: str
    kind: str
    shape: Tuple[int, ...]  # of each rank's piece
    dtype: str


@dataclass(frozen=True)
class Spec:
    tensors: Tuple[TensorSpec, ...] = ()
    objects: Tuple[Tuple[str, str], ...] = ()
    plain: bool = True  # False: a LocalNonpersistentObject sends saves down the non-plain path
    #: a one-off inconsistency: rank 0 holds half of this key, rank 1 nothing (refused)
    broken: Optional[str] = None


def _values(name: str, step: int, shape, dtype: str) -> torch.Tensor:
    g = torch.Generator().manual_seed(zlib.crc32(f"{name}/{step}".encode()))
    return torch.randint(0, 100, tuple(shape), generator=g).to(getattr(torch, dtype))


def build(spec: Spec, step: int, rank: int, fill: bool = True) -> Dict[str, Any]:
    """Rank ``rank``'s sharded state dict of ``spec`` at ``step`` (``fill=False``: a template
    of zeros)."""
    from resilient_ckpt import ShardedObject, ShardedTensor
    from resilient_ckpt.model.mapping import LocalNonpersistentObject

    model: Dict[str, Any] = {}
    for t in spec.tensors:
        if t.kind == "local0" and rank != 0:
            continue
        split = t.kind in ("tp", "tp_swap")
        full_shape = (2 * t.shape[0], *t.shape[1:]) if split else t.shape
        full = (
            _values(t.name, step, full_shape, t.dtype)
            if fill
            else torch.zeros(full_shape).to(getattr(torch, t.dtype))
        )
        if split:
            chunk = rank if t.kind == "tp" else 1 - rank
            piece = full[chunk * t.shape[0] : (chunk + 1) * t.shape[0]].clone()
            model[t.name] = ShardedTensor.from_rank_offsets(t.name, piece, (0, chunk, 2))
        else:
            rid = {"dp": rank, "dp_flip": 1 - rank, "dp_tuple": (0, rank), "local0": 0}[t.kind]
            model[t.name] = ShardedTensor.from_rank_offsets(t.name, full, replica_id=rid)
    if spec.broken is not None and rank == 0:
        piece = _values(spec.broken, step, (2, 3), "float32") if fill else torch.zeros(2, 3)
        model[spec.broken] = ShardedTensor.from_rank_offsets(spec.broken, piece, (0, 0, 2))
    objects = {}
    for name, kind in spec.objects:
        value = (
            {"step": step if fill else -1, "rank": rank}
            if kind == "per_rank"
            else {"step": step if fill else -1}
        )
        if kind == "per_rank":
            objects[name] = ShardedObject(name, value, (2,), (rank,))
        else:
            objects[name] = ShardedObject(name, value, (1,), (0,), replica_id=rank)
    sd: Dict[str, Any] = {"model": model, "objects": objects, "step": step, "args": {"lr": 0.5 * step}}
    if not spec.plain:
        sd["local"] = LocalNonpersistentObject("kept local")
    return sd


def digest(tree: Any, prefix: str = "") -> Dict[str, Any]:
    """Leaf path -> comparable value (tensors: dtype, shape and a hash of their bytes)."""
    from resilient_ckpt import ShardedObject, ShardedTensor
    from resilient_ckpt.model.mapping import LocalNonpersistentObject

    if isinstance(tree, (ShardedTensor, ShardedObject)):
        tree = tree.data
    elif isinstance(tree, LocalNonpersistentObject):
        tree = tree.unwrap()
    out: Dict[str, Any] = {}
    if isinstance(tree, dict):
        for k, v in tree.items():
            out.update(digest(v, f"{prefix}/{k}"))
        return out
    if isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out.update(digest(v, f"{prefix}/{i}"))
        return out
    if isinstance(tree, torch.Tensor):
        t = tree.detach().cpu().contiguous()
        raw = t.view(torch.uint8).numpy().tobytes() if t.numel() else b""
        out[prefix] = (str(t.dtype), tuple(t.shape), hashlib.sha1(raw).hexdigest())
    else:
        out[prefix] = repr(tree)
    return out


# ---- the rank side (module-level: the pool pickles these by reference) -------------------------

_LIVE: Dict[str, Any] = {}


def _manager(root: str, which: str, config: str, rank: int):
    from resilient_ckpt import CheckpointManager

    return CheckpointManager(
        "structure",
        store_root=f"{root}/{which}/node{rank}",
        ranks_per_node=1,
        keep_last=2,
        timeout_s=30,
        **CONFIGS[config],
    )


def _outcome(fn) -> Tuple:
    """("ok", value) or ("error", exception class, message)."""
    try:
        return ("ok", fn())
    except Exception as e:
        return ("error", type(e).__name__, str(e))


def rank_start(ctx, root: str, config: str) -> None:
    rank_close(ctx)
    _LIVE.update(root=root, config=config, cached=_manager(root, "cached", config, ctx.rank))


def rank_close(ctx) -> None:
    m = _LIVE.pop("cached", None)
    if m is not None:
        m.close()


def _save(m, spec: Spec, step: int, rank: int):
    h = m.save_local(build(spec, step, rank), step)
    h.wait()
    return h.metrics.structure_cached


def rank_save(ctx, spec: Spec, step: int) -> dict:
    cached = _outcome(lambda: _save(_LIVE["cached"], spec, step, ctx.rank))
    fresh = _manager(_LIVE["root"], "oracle", _LIVE["config"], ctx.rank)
    try:
        oracle = _outcome(lambda: _save(fresh, spec, step, ctx.rank))
    finally:
        fresh.close()
    return {"cached": cached, "oracle": oracle}


def _restore(m, spec: Spec, rank: int):
    out = m.load_local(build(spec, 0, rank, fill=False))
    if out is None:
        return None
    state, iteration = out
    return iteration, digest(state)


def rank_restore(ctx, spec: Spec, restart: bool) -> dict:
    if restart:  # the trainer process restarts: a new manager, no caches, then it restores
        _LIVE.pop("cached").close()
        _LIVE["cached"] = _manager(_LIVE["root"], "cached", _LIVE["config"], ctx.rank)
    cached = _outcome(lambda: _restore(_LIVE["cached"], spec, ctx.rank))
    fresh = _manager(_LIVE["root"], "oracle", _LIVE["config"], ctx.rank)
    try:
        oracle = _outcome(lambda: _restore(fresh, spec, ctx.rank))
    finally:
        fresh.close()
    return {"cached": cached, "oracle": oracle}


# ---- the model -------------------------------------------------------------------------------

NAMES = st.sampled_from(["a", "b", "c", "d", "e", "f", "g"])
SHAPES = st.lists(st.integers(1, 4), min_size=1, max_size=2).map(tuple)
TENSORS = st.builds(TensorSpec, NAMES, st.sampled_from(KINDS), SHAPES, st.sampled_from(DTYPES))


def _same_words(outcomes: List[Tuple], root: str) -> List[Tuple]:
    """Outcomes with this run's paths taken out (the two managers' stores differ)."""
    return [
        tuple(
            str(x).replace(root, "<root>").replace("/oracle/", "/<m>/").replace("/cached/", "/<m>/")
            for x in o
        )
        for o in outcomes
    ]


class StructureMachine(RuleBasedStateMachine):
    pool: RankPool
    config: str

    def __init__(self):
        super().__init__()
        self.root = f"/dev/shm/rc-structure-{uuid.uuid4().hex[:8]}"
        self.step = 0
        self.spec = Spec(
            tensors=(TensorSpec("w", "dp", (3, 2), "float32"), TensorSpec("u", "tp", (2, 2), "float32"))
        )
        self.saved: Optional[Tuple[Spec, int]] = None  # the newest complete save
        self.cache_spec: Optional[Spec] = None  # what the manager's structure cache was made for
        self.log: List[str] = []

    @initialize()
    def start(self):
        self.pool.run(rank_start, self.root, self.config)

    def teardown(self):
        try:
            self.pool.run(rank_close)
        finally:
            shutil.rmtree(self.root, ignore_errors=True)

    # -- changes --

    def _change(self, data) -> Spec:
        spec = self.spec
        names = [t.name for t in spec.tensors]
        what = data.draw(
            st.sampled_from(
                [
                    "none",
                    "none",
                    "add",
                    "remove",
                    "rename",
                    "resize",
                    "dtype",
                    "kind",
                    "add_object",
                    "remove_object",
                    "plain",
                ]
            ),
            label="change",
        )
        tensors = list(spec.tensors)
        if what == "add":
            t = data.draw(TENSORS.filter(lambda t: t.name not in names), label="added")
            tensors.insert(data.draw(st.integers(0, len(tensors)), label="at"), t)
        elif what == "remove" and len(tensors) > 1:
            tensors.pop(data.draw(st.integers(0, len(tensors) - 1), label="removed"))
        elif what in ("rename", "resize", "dtype", "kind") and tensors:
            i = data.draw(st.integers(0, len(tensors) - 1), label="which")
            t = tensors[i]
            if what == "rename":
                new = data.draw(NAMES.filter(lambda n: n not in names), label="to")
                t = replace(t, name=new)
            elif what == "resize":
                t = replace(t, shape=data.draw(SHAPES.filter(lambda s: s != t.shape), label="shape"))
            elif what == "dtype":
                t = replace(
                    t, dtype=data.draw(st.sampled_from(DTYPES).filter(lambda d: d != t.dtype), label="dtype")
                )
            else:
                t = replace(
                    t, kind=data.draw(st.sampled_from(KINDS).filter(lambda k: k != t.kind), label="kind")
                )
            tensors[i] = t
        objects = list(spec.objects)
        if what == "add_object":
            name = data.draw(
                st.sampled_from(["o1", "o2", "o3"]).filter(lambda n: n not in dict(objects)), label="object"
            )
            objects.append((name, data.draw(st.sampled_from(OBJECT_KINDS), label="object kind")))
        elif what == "remove_object" and objects:
            objects.pop(data.draw(st.integers(0, len(objects) - 1), label="removed object"))
        plain = (not spec.plain) if what == "plain" else spec.plain
        return Spec(tuple(tensors), tuple(objects), plain)

    # -- rules --

    @rule(data=st.data(), broken=st.integers(0, 5))
    def save(self, data, broken):
        spec = self._change(data)
        if broken == 0:  # one save in six: a key on one rank only (refused on every rank)
            spec_used = replace(spec, broken="zz")
        else:
            spec_used = spec
        self.step += 1
        out = self.pool.run(rank_save, spec_used, self.step)
        self.log.append(f"save {self.step}: {spec_used} -> {[o['cached'][0] for o in out]}")
        cached = [o["cached"] for o in out]
        oracle = [o["oracle"] for o in out]
        # The oracle's saves are all first saves: only the outcome compares, not the flag.
        same = [o[:1] if o[0] == "ok" else o for o in cached + oracle]
        assert _same_words(same[:2], self.root) == _same_words(same[2:], self.root), (cached, oracle)
        assert len({o[0] for o in cached}) == 1, f"split outcome across ranks: {cached}"
        if spec_used.broken is not None:
            assert all(o[0] == "error" and o[1] == "ValidationError" for o in cached), cached
            self.cache_spec = None  # a failed save leaves no cache behind
            return
        assert all(o[0] == "ok" for o in cached), cached
        flags = {o[1] for o in cached}
        # truthful: reused exactly when the structure is the one the cache was made for
        assert flags == {spec.plain and self.cache_spec == spec}, (flags, self.cache_spec, spec)
        self.spec, self.saved = spec, (spec, self.step)
        if spec.plain:
            self.cache_spec = spec
        elif replace(spec, plain=True) != self.cache_spec:
            # a non-plain save of another structure renews the structure cache without what a
            # plain save reuses; one of the cached structure leaves the cache as it was
            self.cache_spec = None

    def _restore(self, restart: bool):
        out = self.pool.run(rank_restore, self.spec, restart)
        if restart:
            self.cache_spec = None
        cached = [o["cached"] for o in out]
        oracle = [o["oracle"] for o in out]
        self.log.append(f"restore (restart={restart}) of {self.spec} -> {[o[0] for o in cached]}")
        assert _same_words(cached, self.root) == _same_words(oracle, self.root), (cached, oracle)
        assert len({o[0] for o in cached}) == 1, f"split outcome across ranks: {cached}"
        if self.saved is None:
            assert all(o == ("ok", None) for o in cached), cached
            return
        spec, step = self.saved
        if spec == self.spec:  # the structure last saved: exactly that save's state comes back
            for rank, o in enumerate(cached):
                assert o[0] == "ok", o
                iteration, got = o[1]
                want = digest(build(spec, step, rank))
                assert iteration == step and got == want, (rank, iteration, step)

    @rule()
    def restore(self):
        self._restore(restart=False)

    @precondition(lambda self: self.step > 0)
    @rule()
    def restart_and_restore(self):
        self._restore(restart=True)


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    p = RankPool(tmp_path_factory.mktemp("structure-pool"), world_size=2, case_timeout=90)
    yield p
    p.close()


@pytest.mark.timeout(max(300, 20 * EXAMPLES * STEPS))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_sequence_of_structure_changes_saves_and_restores_as_a_fresh_manager_would(pool, config):
    StructureMachine.pool = pool
    StructureMachine.config = config
    run_state_machine_as_test(
        StructureMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            phases=[p for p in Phase if SHRINK or p is not Phase.shrink],
            suppress_health_check=list(HealthCheck),
        ),
    )


# ---- the reported scenario, by hand ------------------------------------------------------------


def _scenario(ctx, root: str, changes: List[str]) -> List[Any]:
    """One manager, factor 2: a sharded state dict, then each change in turn; after each save
    a restore returns exactly what was saved."""
    from resilient_ckpt import CheckpointManager

    base = Spec(tensors=(TensorSpec("w", "dp", (4, 3), "float32"), TensorSpec("u", "tp", (2, 3), "float32")))
    specs = {
        "same": base,
        "key added": replace(base, tensors=base.tensors + (TensorSpec("e", "dp", (3,), "float32"),)),
        "resized": replace(base, tensors=(TensorSpec("w", "dp", (5, 3), "float32"), base.tensors[1])),
        "key removed": replace(base, tensors=base.tensors[:1]),
        "dtype": replace(base, tensors=(TensorSpec("w", "dp", (4, 3), "bfloat16"), base.tensors[1])),
        "object added": replace(base, objects=(("o", "per_rank"),)),
    }
    m = CheckpointManager(
        "scenario", store_root=f"{root}/node{ctx.rank}", replication_factor=2, ranks_per_node=1, timeout_s=30
    )
    out = []
    for step, change in enumerate(changes, 1):
        spec = specs[change]
        h = m.save_local(build(spec, step, ctx.rank), step)
        h.wait()
        state, it = m.load_local(build(spec, 0, ctx.rank, fill=False))
        out.append(
            (change, it, digest(state) == digest(build(spec, step, ctx.rank)), h.metrics.structure_cached)
        )
    m.close()
    return out


@pytest.mark.parametrize(
    "changes",
    [
        ["same", "same", "key added", "key added", "same"],
        ["same", "resized", "same", "resized"],
        ["same", "key removed", "dtype", "object added", "same"],
    ],
    ids=["key added", "resized and back", "removed, dtype, object"],
)
def test_a_state_dict_that_changes_structure_keeps_saving_and_restores_what_it_saved(pool, changes):
    root = Path(f"/dev/shm/rc-scenario-{uuid.uuid4().hex[:8]}")
    try:
        out = pool.run(_scenario, str(root), changes)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    for per_rank in out:
        assert [(c, it, exact) for c, it, exact, _ in per_rank] == [
            (c, i, True) for i, c in enumerate(changes, 1)
        ]
        # the first save and every save after a change take the general path
        cached = [flag for *_, flag in per_rank]
        assert cached == [i > 0 and changes[i] == changes[i - 1] for i in range(len(changes))]
