"""Nested state-dict helpers: walking, mapping, splitting and merging dicts and lists."""

import copy
import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_ckpt.errors import CheckpointingException, ValidationError
from resilient_ckpt.model.nested import (
    HOLE,
    has_holes,
    map_leaves,
    map_leaves_inplace,
    merge,
    nested_items,
    nested_values,
    split,
)

# Leaves: ints are "tensors" (go to one side of a split), strings and None "plain values";
# tuples are leaves too, as in Megatron-core.
_leaf = st.one_of(st.integers(-5, 5), st.text(max_size=3), st.none(), st.tuples(st.integers(0, 3)))
_tree = st.recursive(
    _leaf,
    lambda kids: st.one_of(
        st.lists(kids, max_size=4), st.dictionaries(st.text(max_size=3), kids, max_size=4)
    ),
    max_leaves=15,
)
_top = st.one_of(st.dictionaries(st.text(max_size=3), _tree, max_size=5), st.lists(_tree, max_size=5))


def _is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


@settings(max_examples=50, deadline=None)
@given(_top)
def test_merge_of_split_rebuilds_the_original_exactly(x):
    original = copy.deepcopy(x)
    match, rest = split(x, _is_int)
    assert x == original, "split must not modify its input"
    assert merge(match, rest) == original
    assert not has_holes(merge(*split(copy.deepcopy(x), _is_int)))


@settings(max_examples=50, deadline=None)
@given(_top)
def test_split_sends_every_leaf_to_exactly_one_side(x):
    match, rest = split(x, _is_int)
    assert all(_is_int(v) for v in nested_values(match))
    assert not any(_is_int(v) for v in nested_values(rest))
    assert sorted(map(repr, nested_values(match))) + sorted(map(repr, nested_values(rest))) == sorted(
        map(repr, (v for v in nested_values(x) if _is_int(v)))
    ) + sorted(map(repr, (v for v in nested_values(x) if not _is_int(v))))


@settings(max_examples=30, deadline=None)
@given(_top)
def test_nested_items_paths_address_each_leaf(x):
    for path, leaf in nested_items(x):
        node = x
        for p in path:
            node = node[p]
        assert node == leaf
    assert [v for _, v in nested_items(x)] == list(nested_values(x))


@settings(max_examples=30, deadline=None)
@given(_top)
def test_map_leaves_is_out_of_place_and_inplace_variant_matches(x):
    original = copy.deepcopy(x)
    f = lambda v: ("mapped", v)  # noqa: E731
    out = map_leaves(f, x)
    assert x == original
    assert list(nested_values(out)) == [f(v) for v in nested_values(original)]
    assert map_leaves_inplace(f, x) == out
    assert x == out


def test_split_keeps_list_positions_where_megatron_loses_them():
    x = {"opt": [1, "lr", [2, "b"], {"t": 3, "s": "x"}], "empty": [], "e2": {}}
    match, rest = split(x, _is_int)
    assert match == {"opt": [1, HOLE, [2, HOLE], {"t": 3}]}
    assert rest == {"opt": [HOLE, "lr", [HOLE, "b"], {"s": "x"}], "empty": [], "e2": {}}
    assert merge(match, rest) == x


def test_list_with_no_match_gives_an_empty_list_that_merges_away():
    match, rest = split(["a", "b"], _is_int)
    assert match == [] and rest == ["a", "b"]
    assert merge(match, rest) == ["a", "b"]
    assert merge(rest, match) == ["a", "b"]


def test_merge_rejects_two_values_at_one_path_naming_the_path():
    with pytest.raises(ValidationError, match="a/b"):
        merge({"a": {"b": 1}}, {"a": {"b": 2}})
    with pytest.raises(CheckpointingException, match=r"3 vs 2.*x/1"):
        merge({"x": [0, [1, 2, 3]]}, {"x": [HOLE, [1, 2]]})


def test_merge_error_is_also_a_value_error_for_megatron_style_callers():
    with pytest.raises(ValueError):
        merge([1], [2])


def test_split_of_a_leaf_is_a_type_error():
    with pytest.raises(TypeError, match="dict or list"):
        split(5, _is_int)


def test_hole_is_a_singleton_that_survives_pickling_and_deepcopy():
    assert pickle.loads(pickle.dumps(HOLE)) is HOLE
    assert copy.deepcopy([HOLE])[0] is HOLE
    assert repr(HOLE) == "HOLE"
    assert list(nested_values([HOLE, 1, [HOLE]])) == [1]
    assert has_holes({"a": [1, [HOLE]]}) and not has_holes({"a": [1, [2]]})


def test_map_leaves_skips_holes():
    assert map_leaves(lambda v: v * 10, [1, HOLE, {"a": 2}]) == [10, HOLE, {"a": 20}]
