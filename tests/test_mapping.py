"""ShardedTensor / ShardedObject: Megatron-core semantics, validation, and Megatron interop."""

import dataclasses
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

with warnings.catch_warnings():  # megatron-core warns about optional extras at import
    warnings.simplefilter("ignore")
    from megatron.core.dist_checkpointing import mapping as mcore

from resilient_ckpt.errors import ValidationError
from resilient_ckpt.model.mapping import (
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    adapt,
    apply_factories_and_adapt,
    apply_factory_merges,
    is_main_replica,
)


def test_fields_and_order_match_the_issue_api():
    assert [f.name for f in dataclasses.fields(ShardedTensor)] == [
        "key",
        "data",
        "dtype",
        "local_shape",
        "global_shape",
        "global_offset",
        "axis_fragmentations",
        "replica_id",
        "prepend_axis_num",
        "allow_shape_mismatch",
    ]
    assert [f.name for f in dataclasses.fields(ShardedObject)] == [
        "key",
        "data",
        "global_shape",
        "global_offset",
        "replica_id",
    ]
    assert ShardedObject("o", 1, (2,), (1,)).replica_id == 0


@st.composite
def _rank_offsets_case(draw):
    shape = draw(st.lists(st.integers(1, 4), min_size=0, max_size=3))
    prepend = draw(st.integers(0, 2))
    ndim = len(shape) + prepend
    axes = draw(st.lists(st.integers(0, max(ndim - 1, 0)), unique=True, max_size=ndim)) if ndim else []
    offsets = []
    for ax in axes:
        fragm = draw(st.integers(1, 4))
        offsets.append((ax, draw(st.integers(0, fragm - 1)), fragm))
    replica = draw(st.one_of(st.integers(0, 2), st.tuples(st.integers(0, 1), st.integers(0, 1))))
    dtype = draw(st.sampled_from([torch.float32, torch.bfloat16, torch.int64]))
    return tuple(shape), prepend, offsets, replica, dtype


@settings(max_examples=60, deadline=None)
@given(_rank_offsets_case())
def test_from_rank_offsets_matches_megatron_core(case):
    shape, prepend, offsets, replica, dtype = case
    data = torch.zeros(shape, dtype=dtype)
    ours = ShardedTensor.from_rank_offsets("w", data, *offsets, replica_id=replica, prepend_axis_num=prepend)
    theirs = mcore.ShardedTensor.from_rank_offsets(
        "w", data, *offsets, replica_id=replica, prepend_axis_num=prepend
    )
    for name in (
        "key",
        "dtype",
        "local_shape",
        "global_shape",
        "global_offset",
        "axis_fragmentations",
        "replica_id",
        "prepend_axis_num",
        "allow_shape_mismatch",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name
    assert ours.data is data
    assert ours.global_slice() == theirs.global_slice()
    assert ours.local_chunk_offset_in_global() == theirs.local_chunk_offset_in_global()
    assert ours.is_main_replica() == mcore.is_main_replica(theirs.replica_id)
    # And the adapter turns Megatron's object into an equal one of ours.
    adapted = adapt(theirs)
    assert isinstance(adapted, ShardedTensor) and adapted.data is data
    assert adapted.without_data() == ours.without_data()


@pytest.mark.parametrize(
    "offsets,what",
    [
        ([(0, 2, 2)], "0 <= offset < fragments"),
        ([(0, -1, 2)], "0 <= offset < fragments"),
        ([(0, 0, 0)], "0 <= offset < fragments"),
        ([(5, 0, 2)], "axis in range"),
        ([(-1, 0, 2)], "axis in range"),
        ([(0, 0, 2), (0, 1, 2)], "each axis once"),
        ([(0, 1)], "not a triple"),
    ],
)
def test_invalid_rank_offsets_name_the_key_and_the_rule(offsets, what):
    with pytest.raises(ValidationError, match=r"'layer\.w'.*") as e:
        ShardedTensor.from_rank_offsets("layer.w", torch.zeros(2, 2), *offsets)
    assert what in str(e.value)


def test_flattened_range_is_rejected_with_a_fix():
    with pytest.raises(ValidationError, match="flattened_range is not supported.*reshape"):
        ShardedTensor.from_rank_offsets("w", torch.zeros(4), flattened_range=slice(0, 2))


def _st(**kw):
    base = dict(
        key="w",
        data=None,
        dtype=torch.float32,
        local_shape=(2, 2),
        global_shape=(4, 2),
        global_offset=(2, 0),
        axis_fragmentations=(2, 1),
    )
    base.update(kw)
    return ShardedTensor(**base)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(data=torch.zeros(2, 2, dtype=torch.float16)), "data dtype torch.float16 differs"),
        (dict(data=torch.zeros(3, 2)), r"data shape \(3, 2\) differs"),
        (dict(global_offset=(0,)), "different numbers of axes"),
        (dict(local_shape=(2,)), "prepend_axis_num 0 does not match"),
        (dict(global_offset=(3, 0), axis_fragmentations=None), r"axis 0 covers \[3, 5\) outside"),
        (dict(global_offset=(1, 0), axis_fragmentations=None, global_shape=(2, 2)), "outside"),
        (dict(global_offset=(1, 0)), "not divisible by the local shape"),
        (dict(axis_fragmentations=(2,)), "axis_fragmentations"),
        (dict(global_offset=(-2, 0), axis_fragmentations=None), "negative"),
        (dict(key=""), "non-empty string"),
    ],
)
def test_inconsistent_metadata_is_rejected_naming_the_problem(kw, msg):
    with pytest.raises(ValidationError, match=msg):
        _st(**kw)


def test_irregular_grid_and_shape_mismatch_are_allowed_when_declared():
    irregular = _st(local_shape=(3, 2), global_shape=(5, 2), global_offset=(2, 0), axis_fragmentations=None)
    assert irregular.global_box() == ((2, 5), (0, 2)) and not irregular.has_regular_grid
    padded = _st(global_offset=(4, 0), allow_shape_mismatch=True, axis_fragmentations=None)
    assert padded.global_box() == ((4, 6), (0, 2))


def test_shard_id_size_and_lazy_init():
    sh = _st(dtype=torch.bfloat16)
    assert sh.shard_id == ("w", (2, 0))
    assert sh.numel == 4 and sh.nbytes == 8
    sh.init_data("cpu")
    assert sh.data.shape == (2, 2) and sh.data.dtype == torch.bfloat16
    keep = sh.data
    sh.init_data("cpu")
    assert sh.data is keep, "init_data only allocates when data is None"
    assert sh.without_data().data is None and sh.data is keep


def test_prepended_axes_have_extent_one_in_the_global_box():
    sh = ShardedTensor.from_rank_offsets("e", torch.zeros(3), (0, 2, 4), prepend_axis_num=1)
    assert sh.global_shape == (4, 3) and sh.global_offset == (2, 0)
    assert sh.global_box() == ((2, 3), (0, 3))
    assert sh.global_slice() == (2, slice(0, 3))


def test_replica_ids_zero_or_all_zeros_are_main():
    assert is_main_replica(0) and is_main_replica((0, 0, 0))
    assert not is_main_replica(1) and not is_main_replica((0, 1, 0))
    assert ShardedTensor.from_rank_offsets("w", torch.zeros(1), replica_id=[0, 1]).replica_id == (0, 1)


def test_sharded_object_ids_match_megatron():
    ours = ShardedObject("rng", {"s": 1}, (2, 4), (1, 3), replica_id=(0, 1))
    theirs = mcore.ShardedObject("rng", {"s": 1}, (2, 4), (1, 3), replica_id=(0, 1))
    assert ours.unique_key == theirs.unique_key == "rng/shard_1.3_2.4"
    assert ours.object_id == ("rng", (1, 3), (2, 4))
    assert not ours.is_main_replica()
    assert ours.without_data().data is None and ours.data == {"s": 1}
    adapted = adapt(theirs)
    assert isinstance(adapted, ShardedObject) and adapted.without_data() == ours.without_data()
    with pytest.raises(ValidationError, match="'rng'.*different numbers of axes"):
        ShardedObject("rng", None, (2,), (0, 0))


def test_megatron_nonpersistent_object_is_rewrapped_and_others_pass_through():
    x = adapt(mcore.LocalNonpersistentObject(["local"]))
    assert isinstance(x, LocalNonpersistentObject) and x.unwrap() == ["local"]
    plain = object()
    assert adapt(plain) is plain


def _split_build(key, data, replica_id, flattened_range):
    halves = data.chunk(2)
    return {
        "lo": mcore.ShardedTensor.from_rank_offsets(f"{key}.lo", halves[0], replica_id=replica_id),
        "hi": mcore.ShardedTensor.from_rank_offsets(f"{key}.hi", halves[1], replica_id=replica_id),
    }


def _split_merge(sub):
    return torch.cat([sub["lo"], sub["hi"]])


def test_megatron_factory_is_built_into_ours_and_merged_back():
    w = torch.arange(4.0)
    sd = {"m": {"w": mcore.ShardedTensorFactory("w", w, _split_build, _split_merge)}, "c": 1}
    factories = {"m": {"w": sd["m"]["w"]}}
    built = apply_factories_and_adapt(sd)
    assert isinstance(built["m"]["w"]["lo"], ShardedTensor)
    assert built["m"]["w"]["hi"].key == "w.hi"
    loaded = {"m": {"w": {"lo": torch.tensor([0.0, 1.0]), "hi": torch.tensor([2.0, 3.0])}}}
    assert torch.equal(apply_factory_merges(loaded, factories)["m"]["w"], w)
    with pytest.raises(ValidationError, match="m/w"):
        apply_factory_merges({"m": {}}, factories)
