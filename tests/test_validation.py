"""Sharding integrity (tiling, replicas, cross-rank agreement) and strict-key handling."""

import logging
import time
import warnings

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_ckpt.errors import CheckpointingException, ValidationError
from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor
from resilient_ckpt.model.validation import (
    StrictHandling,
    apply_strictness,
    determine_mismatch,
    object_record,
    parse_strict_flag,
    shard_record,
    validate_sharding_integrity,
)

with warnings.catch_warnings():  # megatron-core warns about optional extras at import
    warnings.simplefilter("ignore")
    from megatron.core.dist_checkpointing.validation import StrictHandling as McoreStrict


def _box_st(key, start, stop, gshape, main=True, dtype=torch.float32):
    return ShardedTensor(
        key,
        None,
        dtype,
        tuple(b - a for a, b in zip(start, stop)),
        gshape,
        tuple(start),
        None,
        0 if main else 1,
    )


@st.composite
def _tiling(draw, max_ranks=4):
    """A random irregular tiling of a random global shape, spread over ranks, with replicas."""
    ndim = draw(st.integers(1, 3))
    gshape = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    cuts = []
    for n in gshape:
        inner = draw(st.lists(st.integers(1, n - 1), unique=True, max_size=n - 1)) if n > 1 else []
        cuts.append([0] + sorted(inner) + [n])
    boxes = [((), ())]
    for c in cuts:
        boxes = [(s + (a,), e + (b,)) for s, e in boxes for a, b in zip(c, c[1:])]
    nranks = draw(st.integers(1, max_ranks))
    ranks = [[] for _ in range(nranks)]
    for start, stop in boxes:
        main = draw(st.integers(0, nranks - 1))
        ranks[main].append((start, stop, True))
        for r in draw(st.lists(st.integers(0, nranks - 1), unique=True, max_size=nranks)):
            if r != main:
                ranks[r].append((start, stop, False))
    return gshape, boxes, ranks


def _records(gshape, ranks, key="w"):
    return [[shard_record(_box_st(key, s, e, gshape, m)) for s, e, m in boxes] for boxes in ranks]


@settings(max_examples=60, deadline=None)
@given(_tiling())
def test_random_tilings_with_replicas_are_accepted(case):
    gshape, _, ranks = case
    validate_sharding_integrity(_records(gshape, ranks))


@settings(max_examples=60, deadline=None)
@given(_tiling(), st.data())
def test_a_grown_shard_that_overlaps_its_neighbour_is_rejected(case, data):
    gshape, boxes, ranks = case
    growable = [
        (r, i, ax)
        for r, bs in enumerate(ranks)
        for i, (s, e, m) in enumerate(bs)
        for ax in range(len(gshape))
        if m and e[ax] < gshape[ax]
    ]
    if not growable:
        return  # a single box covering everything cannot overlap anything
    r, i, ax = data.draw(st.sampled_from(growable))
    s, e, m = ranks[r][i]
    ranks[r][i] = (s, tuple(v + (a == ax) for a, v in enumerate(e)), m)
    # Replicas of the grown shard keep the old extent: drop them so only the overlap is wrong.
    for other in ranks:
        other[:] = [b for b in other if b[2] or b[0] != s]
    with pytest.raises(ValidationError, match=r"'w': shards .* overlap"):
        validate_sharding_integrity(_records(gshape, ranks))


@settings(max_examples=60, deadline=None)
@given(_tiling(), st.data())
def test_a_missing_or_shrunk_shard_leaves_a_gap_that_is_rejected(case, data):
    gshape, boxes, ranks = case
    mains = [(r, i) for r, bs in enumerate(ranks) for i, b in enumerate(bs) if b[2]]
    r, i = data.draw(st.sampled_from(mains))
    s, e, _ = ranks[r][i]
    shrinkable = [ax for ax in range(len(gshape)) if e[ax] - s[ax] > 1]
    if len(mains) == 1 and not shrinkable:
        return  # removing the only shard removes the key itself: nothing left to validate
    for other in ranks:  # the shard disappears with all its replicas
        other[:] = [b for b in other if b[0] != s]
    if shrinkable and (len(mains) == 1 or data.draw(st.booleans())):
        ax = data.draw(st.sampled_from(shrinkable))
        ranks[r].append((s, tuple(v - (a == ax) for a, v in enumerate(e)), True))
    with pytest.raises(ValidationError, match=r"'w': main replicas cover \d+ of \d+ .*\(gap\)"):
        validate_sharding_integrity(_records(gshape, ranks))


def test_megatron_style_tp_dp_layout_is_accepted():
    recs = []
    for rank in range(4):
        tp, dp = rank % 2, rank // 2
        w = ShardedTensor.from_rank_offsets("qkv", torch.zeros(2, 3), (0, tp, 2), replica_id=(0, 0, dp))
        ln = ShardedTensor.from_rank_offsets("ln", torch.zeros(3), replica_id=(0, tp, dp))
        recs.append([shard_record(w), shard_record(ln)])
    validate_sharding_integrity(recs)


def _one(key="w", **kw):
    base = dict(start=(0,), stop=(4,), gshape=(4,), main=True)
    base.update(kw)
    return shard_record(
        _box_st(
            key, base["start"], base["stop"], base["gshape"], base["main"], base.get("dtype", torch.float32)
        )
    )


@pytest.mark.parametrize(
    "ranks,msg",
    [
        ([[_one()], [_one(dtype=torch.float16)]], r"'w': ranks disagree on dtype"),
        ([[_one()], [_one(gshape=(8,), main=False)]], r"'w': ranks disagree on global shape"),
        ([[_one()], [_one()]], r"'w': shard at offset \(0,\) has 2 main replicas \(ranks \[0, 1\]\)"),
        ([[_one(main=False)], [_one(main=False)]], r"'w': shard at offset \(0,\) has no main replica"),
        ([[_one()], [_one(stop=(2,), main=False)]], r"'w': shard at offset \(0,\) has extent \(2,\)"),
    ],
)
def test_cross_rank_disagreements_are_reported_by_key(ranks, msg):
    with pytest.raises(ValidationError, match=msg) as e:
        validate_sharding_integrity(ranks)
    assert "fix:" in str(e.value)


def test_a_shard_mutated_outside_the_global_shape_is_rejected():
    sh = _box_st("w", (0,), (2,), (4,))
    sh.global_offset = (3,)  # Megatron helpers mutate ShardedTensors in place
    other = _box_st("w", (0,), (3,), (4,))
    with pytest.raises(ValidationError, match=r"'w': shard at offset \(3,\) .* outside"):
        validate_sharding_integrity([[shard_record(sh)], [shard_record(other)]])


def test_scalar_tensors_and_empty_shards_are_valid():
    scalar = ShardedTensor.from_rank_offsets("step", torch.tensor(3.0))
    empty = ShardedTensor("e", None, torch.float32, (0, 2), (0, 2), (0, 0), None)
    validate_sharding_integrity([[shard_record(scalar), shard_record(empty)]])


def test_allow_shape_mismatch_skips_the_tiling_check_only():
    a = ShardedTensor("p", None, torch.float32, (3,), (4,), (0,), None, allow_shape_mismatch=True)
    validate_sharding_integrity([[shard_record(a)]])
    b = ShardedTensor("p", None, torch.float16, (3,), (4,), (0,), None, allow_shape_mismatch=True)
    with pytest.raises(ValidationError, match="dtype"):
        validate_sharding_integrity([[shard_record(a)], [shard_record(b)]])


def test_many_problems_are_reported_at_most_twenty_with_a_count():
    ranks = [[_one(key=f"k{i}", main=False) for i in range(30)]]
    with pytest.raises(ValidationError, match=r"and \d+ more"):
        validate_sharding_integrity(ranks)


def test_validation_of_many_column_shards_is_not_quadratic():
    # One key cut into 4096 columns: every shard starts at 0 on axis 0.
    n = 4096
    recs = [[shard_record(_box_st("wide", (0, c), (8, c + 1), (8, n))) for c in range(n)]]
    t0 = time.perf_counter()
    validate_sharding_integrity(recs)
    assert time.perf_counter() - t0 < 2.0


def _obj(key, off, shape, main=True):
    return object_record(ShardedObject(key, None, shape, off, 0 if main else 1))


def test_rank_unique_objects_covering_their_grid_are_accepted():
    validate_sharding_integrity([], [[_obj("rng", (r,), (4,))] for r in range(4)])
    validate_sharding_integrity([], [[_obj("cfg", (0,), (1,)), _obj("cfg", (0,), (1,), False)]])


@pytest.mark.parametrize(
    "objs,msg",
    [
        (
            [[_obj("rng", (0,), (2,))], [_obj("rng", (0,), (2,))]],
            r"'rng' \(object\): offset \(0,\) has 2 main",
        ),
        ([[_obj("rng", (0,), (2,))]], r"'rng' \(object\): 1 main replicas for a grid of 2"),
        ([[_obj("rng", (0,), (2,))], [_obj("rng", (0,), (3,))]], "disagree on global shape"),
        ([[_obj("rng", (0,), (2,))], [_obj("rng", (2,), (2,))]], r"offset \(2,\) lies outside the grid"),
    ],
)
def test_object_grids_with_duplicates_gaps_or_strays_are_rejected(objs, msg):
    with pytest.raises(ValidationError, match=msg):
        validate_sharding_integrity([], objs)


# ---- strict-key handling ------------------------------------------------------------------


def test_strict_handling_has_megatron_cores_members_and_values():
    assert [(m.name, m.value) for m in StrictHandling] == [(m.name, m.value) for m in McoreStrict]
    for m in StrictHandling:
        theirs = McoreStrict[m.name]
        assert StrictHandling.requires_explicit_ckpt_mismatch_check(
            m
        ) == McoreStrict.requires_explicit_ckpt_mismatch_check(theirs)
        assert StrictHandling.requires_global_app_metadata(m) == McoreStrict.requires_global_app_metadata(
            theirs
        )
        assert StrictHandling.requires_returning_mismatch_keys(
            m
        ) == McoreStrict.requires_returning_mismatch_keys(theirs)


def test_strict_flags_parse_from_strings_ours_and_megatrons_enum():
    assert parse_strict_flag("log_all") is StrictHandling.LOG_ALL
    assert parse_strict_flag(StrictHandling.RAISE_ALL) is StrictHandling.RAISE_ALL
    assert parse_strict_flag(McoreStrict.RETURN_UNEXPECTED) is StrictHandling.RETURN_UNEXPECTED
    with pytest.raises(
        ValidationError, match="invalid strict flag 'loose'; use one of: assume_ok_unexpected"
    ):
        parse_strict_flag("loose")


def test_missing_and_unexpected_follow_megatrons_definitions():
    missing, unexpected = determine_mismatch(requested={"a", "new"}, in_checkpoint={"a", "old"})
    assert missing == {"old"} and unexpected == {"new"}


class _Log:
    def __init__(self):
        self.lines = []

    def warning(self, fmt, *args):
        self.lines.append(fmt % args)


@pytest.mark.parametrize(
    "strict", [StrictHandling.RAISE_UNEXPECTED, StrictHandling.RAISE_ALL, StrictHandling.ASSUME_OK_UNEXPECTED]
)
def test_unexpected_keys_raise_naming_them_under_raising_flags(strict):
    with pytest.raises(CheckpointingException, match=r"not in the checkpoint\): dec.w, new.b"):
        apply_strictness(strict, set(), {"new.b", "dec.w"}, _Log())


def test_missing_keys_raise_only_under_raise_all():
    apply_strictness(StrictHandling.RAISE_UNEXPECTED, {"old"}, set(), _Log())
    with pytest.raises(ValidationError, match=r"not requested by the state dict\): old"):
        apply_strictness(StrictHandling.RAISE_ALL, {"old"}, set(), _Log())


def test_log_flags_warn_by_name_and_return_flags_stay_silent():
    log = _Log()
    apply_strictness(StrictHandling.LOG_ALL, {"old"}, {"new"}, log)
    assert any("new" in line for line in log.lines) and any("old" in line for line in log.lines)
    log = _Log()
    apply_strictness(StrictHandling.LOG_UNEXPECTED, {"old"}, {"new"}, log)
    assert len(log.lines) == 1 and "new" in log.lines[0]
    for quiet in (StrictHandling.RETURN_ALL, StrictHandling.RETURN_UNEXPECTED, StrictHandling.IGNORE_ALL):
        log = _Log()
        apply_strictness(quiet, {"old"}, {"new"}, log)
        assert log.lines == []


def test_long_key_lists_are_truncated_with_a_count(caplog):
    keys = {f"k{i:02d}" for i in range(25)}
    with pytest.raises(ValidationError, match=r"\(\+5 more\)"):
        apply_strictness(StrictHandling.RAISE_UNEXPECTED, set(), keys, logging.getLogger("x"))


_RECORD_VARIANTS = st.fixed_dictionaries(
    {
        "offset": st.sampled_from([(0, 0), (0, 2), (2, 0), (1, 0), (0, 1)]),
        "extent": st.sampled_from([(4, 2), (2, 2), (4, 3), (2, 4), (1, 2)]),
        "shape": st.sampled_from([(4, 2), (4, 4), (5, 2), (3, 2)]),
        "dtype": st.sampled_from(["float32", "bfloat16"]),
        "main": st.booleans(),
        "mismatch": st.booleans(),
    }
)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(_RECORD_VARIANTS, max_size=3), min_size=1, max_size=4), st.booleans())
def test_the_one_axis_fast_case_never_changes_the_verdict_or_its_words(ranks, as_lists):
    """Tensors split along at most one axis (possibly replicated) are accepted after a few
    comparisons; every other record set, valid or not, gets the full check: same outcome and
    message either way, for records as built locally (tuples) and as msgpack returns them."""

    def rec(v):
        r = ("w", v["offset"], v["extent"], v["shape"], v["dtype"], v["main"], v["mismatch"])
        return [list(x) if isinstance(x, tuple) else x for x in r] if as_lists else r

    records = [[rec(v) for v in rank] for rank in ranks]
    assert _verdict(records) == _verdict_without_fast_case(records)


@settings(max_examples=100, deadline=None)
@given(_tiling(max_ranks=3), st.booleans())
def test_random_tilings_get_the_same_verdict_with_and_without_the_fast_case(case, as_lists):
    gshape, _boxes, ranks = case
    records = _records(gshape, ranks)
    if as_lists:
        records = [[[list(x) if isinstance(x, tuple) else x for x in r] for r in rank] for rank in records]
    assert _verdict(records) == _verdict_without_fast_case(records) == "ok"


def _verdict(records) -> str:
    try:
        validate_sharding_integrity(records)
        return "ok"
    except ValidationError as e:
        return str(e)


def _verdict_without_fast_case(records) -> str:
    import resilient_ckpt.model.validation as validation

    with pytest.MonkeyPatch.context() as m:
        m.setattr(validation, "_tiles_along_one_axis", lambda entries: False)
        return _verdict(records)
