"""Cached saves: reusing the previous save's structure is invisible except in speed.

A save of a plain sharded state dict whose structure (tree, every shard's metadata, which
shards hold data) is unchanged reuses the hollow skeleton, the shard table and the layout of
the save before (``SaveMetrics.structure_cached``). Specified here: the one-walk parts equal
what the general path derives, for any structure (property test); the stored checkpoint is
bit-identical to the general path's; any structure change is detected and saved correctly.
"""

from __future__ import annotations

import collections

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_ckpt.manager.checkpoint_manager import CheckpointManager
from resilient_ckpt.memory.layout import CheckpointId, dense_runs, plan_layout, plan_layout_runs
from resilient_ckpt.model import codec, shard_table
from resilient_ckpt.model.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor
from resilient_ckpt.model.nested import nested_values
from resilient_ckpt.parallel.hollow import hollow_parts
from resilient_ckpt.parallel.snapshot import snapshot_parts
from resilient_ckpt.parallel.template import prepare_template, preprocess
from resilient_ckpt.parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict

DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.float16, torch.uint8]

# ---- random sharded state dicts --------------------------------------------------------------


@st.composite
def sharded_tensors(draw):
    dtype = draw(st.sampled_from(DTYPES))
    shape = tuple(draw(st.lists(st.integers(0, 4), min_size=0, max_size=3)))
    key = draw(st.text("abcxyz.", min_size=1, max_size=6))
    data = torch.zeros(shape, dtype=dtype)
    if draw(st.booleans()) and shape:
        n = draw(st.integers(1, 3))
        return ShardedTensor.from_rank_offsets(
            key, data, (0, draw(st.integers(0, n - 1)), n), replica_id=draw(st.integers(0, 2))
        )
    return ShardedTensor.from_rank_offsets(
        key, data, replica_id=draw(st.one_of(st.integers(0, 2), st.tuples(st.integers(0, 1))))
    )


def sharded_objects():
    return st.builds(
        lambda key, v: ShardedObject(key, v, (1,), (0,)),
        st.text("ko", min_size=1, max_size=3),
        st.one_of(st.integers(), st.text(max_size=4), st.lists(st.integers(), max_size=3)),
    )


COMMON = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(-5, 5),
    st.floats(allow_nan=False),
    st.text(max_size=4),
    st.tuples(st.integers(), st.text(max_size=2)),
)
LEAVES = st.one_of(COMMON, sharded_tensors(), sharded_objects())
KEYS = st.text("abk", min_size=1, max_size=3)


def _ordered(d):
    return collections.OrderedDict(d)


#: an optimizer's state: a small dict of ShardedTensors per parameter (taken as layers of layers)
LAYERS = st.dictionaries(
    KEYS, st.dictionaries(KEYS, sharded_tensors(), min_size=1, max_size=3), min_size=2, max_size=3
)

TREES = st.recursive(
    LEAVES,
    lambda kids: st.one_of(
        LAYERS,
        st.lists(kids, max_size=4),
        st.dictionaries(KEYS, kids, max_size=4),
        st.dictionaries(KEYS, kids, max_size=3).map(_ordered),
        st.dictionaries(st.integers(0, 3), kids, max_size=3),
    ),
    max_leaves=25,
)
STATE_DICTS = st.one_of(st.dictionaries(KEYS, TREES, max_size=5), st.lists(TREES, max_size=4))


def _general(sd):
    """What the general save path derives: preprocess's split, then to_bytes' parts."""
    sharded, common, _nonpersistent, _factories = preprocess(sd)
    skeleton, rows, objects = hollow_parts(sharded)
    return common, skeleton, rows, objects


def _has_non_str_key_above_sharded(x, under_bad=False):
    if isinstance(x, dict):
        return any(_has_non_str_key_above_sharded(v, under_bad or type(k) is not str) for k, v in x.items())
    if isinstance(x, list):
        return any(_has_non_str_key_above_sharded(v, under_bad) for v in x)
    return under_bad and isinstance(x, (ShardedTensor, ShardedObject))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STATE_DICTS)
def test_one_walk_parts_equal_what_the_general_path_derives(sd):
    parts = snapshot_parts(sd)
    if _has_non_str_key_above_sharded(sd):
        assert parts is None  # the cached comparison is exact only under str keys
        return
    assert parts is not None
    common, skeleton, rows, objects = _general(sd)
    # Byte-identical encodings: types (OrderedDict -> dict as the general path copies, tuple,
    # bool vs int) included, not just ==.
    assert codec.encode(parts.common) == codec.encode(common)
    assert codec.encode(parts.skeleton) == codec.encode(skeleton)
    assert shard_table.encode_rows(parts.rows) == shard_table.encode_rows(rows)
    assert parts.rows == rows and parts.skeleton == skeleton
    assert codec.encode(parts.objects) == codec.encode(objects)
    assert [s.data for s in parts.shards] == [s.data for s in parts.shards]  # the caller's, not copies
    assert all(
        a is b for a, b in zip(parts.shards, [v for v in nested_values(sd) if isinstance(v, ShardedTensor)])
    )


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(STATE_DICTS)
def test_a_template_prepared_in_one_walk_equals_the_general_preparation(sd):
    if _has_non_str_key_above_sharded(sd) or not sd:
        return
    fast = prepare_template(sd)
    assert fast.structure is not None  # plain: prepared from its one-walk parts
    sharded, common, nonpersistent, factories = preprocess(sd)
    assert codec.encode(fast.common) == codec.encode(common)
    assert fast.nonpersistent == nonpersistent and fast.factories == factories
    assert codec.encode(hollow_parts(fast.sharded)[0]) == codec.encode(hollow_parts(sharded)[0])
    assert hollow_parts(fast.sharded)[1] == hollow_parts(sharded)[1] == fast.structure[1]
    assert fast.structure[0] == hollow_parts(sharded)[0]
    # the prepared tree holds copies: filling it never reaches the caller's objects
    originals = [v for v in nested_values(sd) if isinstance(v, ShardedTensor)]
    assert len(fast.shards) == len(originals)
    assert all(a is not b and a.key == b.key for a, b in zip(fast.shards, originals))


@settings(max_examples=200, deadline=None)
@given(STATE_DICTS)
def test_hollow_bytes_round_trip_through_the_shard_table(sd):
    if _has_non_str_key_above_sharded(sd):
        return
    sharded, common, _nonpersistent, _factories = preprocess(sd)
    tasd = MCoreTensorAwareStateDict(common=common, sharded_state_dict=sharded)
    tasd.pop_tensors()
    back = MCoreTensorAwareStateDict.from_bytes(tasd.to_bytes())
    assert back.to_bytes() == tasd.to_bytes()
    assert back.structure() == tasd.structure()  # decoded as stored == derived from the tree
    assert [(s.key, s.global_offset, s.local_shape, s.replica_id, s.dtype) for s in back.tensor_metadata] == [
        (s.key, s.global_offset, s.local_shape, s.replica_id, s.dtype) for s in tasd.tensor_metadata
    ]


def test_state_dicts_that_need_the_general_path_are_not_plain():
    t = ShardedTensor.from_rank_offsets("w", torch.zeros(2))
    assert snapshot_parts({"w": t}) is not None
    assert snapshot_parts({"w": t, "n": LocalNonpersistentObject(3)}) is None
    assert snapshot_parts({1: {"w": t}}) is None  # non-str key above a sharded leaf
    assert snapshot_parts({1: "common only", "w": t}) is not None
    assert snapshot_parts(t) is None


@pytest.mark.parametrize(
    "specs",
    [
        [(torch.float32, (3, 5)), (torch.bfloat16, (7,)), (torch.float32, (0, 4)), (torch.int64, ())],
        [(torch.uint8, (1,)), (torch.uint8, (3,)), (torch.float64, (2, 2))],
        [],
    ],
)
def test_layout_packs_each_dtype_densely_and_runs_cover_every_byte_once(specs):
    layouts, total = plan_layout(specs)
    runs = dense_runs(layouts)
    assert plan_layout_runs(specs) == (layouts, total, runs)  # planned together, derived apart
    covered = sorted(i for r in runs for i in r.indexes)
    assert covered == [i for i, lay in enumerate(layouts) if lay.nbytes]
    assert len({r.dtype for r in runs}) == len(runs)  # one run per dtype
    for r in runs:
        assert r.offset % 256 == 0 and r.nbytes == sum(layouts[i].nbytes for i in r.indexes)
    assert total % 256 == 0 and total >= sum(lay.nbytes for lay in layouts)


# ---- the manager ----------------------------------------------------------------------------


def _state(step: int, *, rename=False, shape=(6, 4), dtype=torch.float32, replica=0, extra=False):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(shape, generator=g).to(dtype)
    sd = {
        "model": {
            ("w2" if rename else "w"): ShardedTensor.from_rank_offsets("w", w, replica_id=replica),
            "layers": [
                ShardedTensor.from_rank_offsets(f"l{i}", torch.randn(3, 5, generator=g)) for i in range(4)
            ],
            "b": ShardedTensor.from_rank_offsets("b", torch.arange(5, dtype=torch.int64) + step),
        },
        "rng": ShardedObject("rng", {"step": step}, (1,), (0,)),
        "args": collections.OrderedDict(lr=0.1 * step, name="run"),
        "iteration": step,
    }
    if extra:
        sd["model"]["extra"] = ShardedTensor.from_rank_offsets("extra", torch.ones(2))
    return sd


def _manager(root):
    return CheckpointManager("cache", store_root=str(root), replication_factor=1, keep_last=10)


def _header_and_bytes(root, iteration):
    m = _manager(root)
    try:
        hdr = m.store.read_header(CheckpointId(iteration, 0, "cache"))
        raw = m.store.data_path(CheckpointId(iteration, 0, "cache")).read_bytes()
        return hdr, raw
    finally:
        m.close()


def test_cached_saves_store_exactly_what_the_general_path_stores(tmp_path):
    cached_root, fresh_root = tmp_path / "cached", tmp_path / "fresh"
    with _manager(cached_root) as m:
        flags = []
        for step in range(1, 5):
            h = m.save_local(_state(step), step, is_async=False)
            flags.append(h.metrics.structure_cached)
    assert flags == [False, True, True, True]
    for step in range(2, 5):
        with _manager(fresh_root / str(step)) as fresh:  # a first save: the general path
            assert not fresh.save_local(_state(step), step, is_async=False).metrics.structure_cached
        got, want = _header_and_bytes(cached_root, step), _header_and_bytes(fresh_root / str(step), step)
        assert got[0].meta == want[0].meta
        assert got[0].tensors == want[0].tensors and got[0].data_nbytes == want[0].data_nbytes
        assert got[1] == want[1]


CHANGES = {
    "renamed dict key": dict(rename=True),
    "shape": dict(shape=(4, 6)),
    "dtype": dict(dtype=torch.bfloat16),
    "replica id": dict(replica=(0, 0)),
    "added shard": dict(extra=True),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
def test_a_structure_change_is_detected_and_saved_as_it_is(tmp_root, change):
    with _manager(tmp_root) as m:
        for step in (1, 2):
            m.save_local(_state(step), step, is_async=False)
        changed = _state(3, **CHANGES[change])
        h = m.save_local(changed, 3, is_async=False)
        assert not h.metrics.structure_cached
        # ... and the save after it caches the new structure.
        assert m.save_local(_state(4, **CHANGES[change]), 4, is_async=False).metrics.structure_cached
    template = _state(0, **CHANGES[change])
    with _manager(tmp_root) as again:
        state, it = again.load_local(template)
    want = _state(4, **CHANGES[change])
    assert it == 4
    wkey = "w2" if CHANGES[change].get("rename") else "w"
    assert torch.equal(state["model"][wkey], want["model"][wkey].data)
    assert state["model"][wkey].dtype == want["model"][wkey].data.dtype
    assert state["rng"] == {"step": 4} and state["iteration"] == 4


def test_a_shard_without_data_takes_the_general_path(tmp_root):
    with _manager(tmp_root) as m:
        for step in (1, 2):
            m.save_local(_state(step), step, is_async=False)
        sd = _state(3)
        sd["model"]["layers"][0].data = None
        # The general path decides what a shard without data means (here: not saved).
        assert not m.save_local(sd, 3, is_async=False).metrics.structure_cached
        # The cache still describes the unchanged structure, which comes back.
        assert m.save_local(_state(4), 4, is_async=False).metrics.structure_cached


# ---- restoring into the structure that was saved ----------------------------------------------


def _two_rank_state(rank: int, step: int, fill: bool = True, moved: bool = False):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(16, 8, generator=g)
    u = torch.randn(8, 4, generator=g)[rank * 4 : rank * 4 + 4]
    if not fill:
        w, u = torch.zeros_like(w), torch.zeros_like(u)
    sd = {
        "model": {"w": ShardedTensor.from_rank_offsets("w", w, replica_id=rank)},
        "u": ShardedTensor.from_rank_offsets("u", u, (0, rank, 2)),
        "rng": ShardedObject("rng", {"rank": rank, "step": step}, (2,), (rank,)),
        "step": step,
    }
    if moved:  # same shards, another place in the tree: a different structure, still loadable
        sd["elsewhere"] = sd.pop("model")
    return sd


def _restore_counting_validations(ctx, moved_on):
    import resilient_ckpt.parallel.load_checks as load_checks_mod
    import resilient_ckpt.parallel.tensor_aware_state_dict as tasd_mod

    calls = []
    real = tasd_mod.validate_sharding_integrity

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    tasd_mod.validate_sharding_integrity = counting  # the first save's check
    load_checks_mod.validate_sharding_integrity = counting  # the load verdict's
    m = CheckpointManager("restore", store_root=ctx.store_root, replication_factor=2, timeout_s=30)
    for step in (1, 2):
        m.save_local(_two_rank_state(ctx.rank, step), step).wait()
    m.close()
    calls.clear()
    m = CheckpointManager("restore", store_root=ctx.store_root, replication_factor=2, timeout_s=30)
    moved = ctx.rank in moved_on
    state, it = m.load_local(_two_rank_state(ctx.rank, 0, fill=False, moved=moved))
    m.close()
    want = _two_rank_state(ctx.rank, 2, moved=moved)
    wkey = "elsewhere" if moved else "model"
    exact = torch.equal(state[wkey]["w"], want[wkey]["w"].data) and torch.equal(state["u"], want["u"].data)
    return it, exact, state["rng"], len(calls)


@pytest.mark.multiprocess
@pytest.mark.parametrize("moved_on", [(), (1,)])
def test_restoring_the_saved_structure_skips_the_world_wide_record_check(tmp_root, moved_on):
    from harness import run_ranks

    out = run_ranks(
        _restore_counting_validations, 2, tmp_root, ranks_per_node=1, args=(moved_on,), timeout=120
    )
    for rank, (it, exact, rng, validations) in enumerate(out):
        assert it == 2 and exact and rng == {"rank": rank, "step": 2}
        # Same structure everywhere: one all-reduce decides. A template that differs on any
        # rank: every rank runs the full check (once), and the load still succeeds.
        assert validations == (1 if moved_on else 0), out
