"""Our DCP planners: flattening, dedup by the fully-parallel distribution, plan caching,
global-plan validation, strict and partial loads, metadata-only loads, safe reading."""

from __future__ import annotations

import math
import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, Metadata

from harness import run_ranks
from resilient_ckpt import ShardedObject, ShardedTensor
from resilient_ckpt.errors import CodecError, CorruptCheckpointError, ValidationError
from resilient_ckpt.model.validation import shard_record
from resilient_ckpt.parallel.distribution import compute_distribution, structure_fingerprint
from resilient_ckpt.persistent.checks import chunk_problems
from resilient_ckpt.persistent.flatten import flatten_for_save
from resilient_ckpt.persistent.load_planner import MetadataStateDictLoadPlanner, ResilientLoadPlanner
from resilient_ckpt.persistent.local_load import load_local, load_metadata_only
from resilient_ckpt.persistent.save_planner import ResilientSavePlanner
from resilient_ckpt.persistent.storage import SafeFileSystemReader, read_metadata_file

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


class NotAllowListed:
    """A value torch's weights-only unpickler refuses (module-level so pickle can find it)."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, NotAllowListed) and other.x == self.x


def _save(sd, path, planner=None):
    dcp.save(sd, checkpoint_id=str(path), planner=planner or ResilientSavePlanner(), no_dist=True)


# ---- chunk validation (pure) ------------------------------------------------------------------


@st.composite
def tilings(draw):
    """A tensor size and a random exact tiling of it by axis-aligned boxes."""
    ndim = draw(st.integers(1, 3))
    size = tuple(draw(st.integers(1, 6)) for _ in range(ndim))
    boxes = [((0,) * ndim, size)]
    for _ in range(draw(st.integers(0, 6))):
        i = draw(st.integers(0, len(boxes) - 1))
        off, ext = boxes[i]
        axes = [a for a in range(ndim) if ext[a] > 1]
        if not axes:
            continue
        a = draw(st.sampled_from(axes))
        cut = draw(st.integers(1, ext[a] - 1))
        left = (off, ext[:a] + (cut,) + ext[a + 1 :])
        right = (off[:a] + (off[a] + cut,) + off[a + 1 :], ext[:a] + (ext[a] - cut,) + ext[a + 1 :])
        boxes[i : i + 1] = [left, right]
    return size, [ChunkStorageMetadata(torch.Size(o), torch.Size(e)) for o, e in boxes]


@given(tilings())
@settings(max_examples=150, deadline=None)
def test_any_exact_tiling_is_accepted(t):
    size, chunks = t
    assert chunk_problems("w", size, chunks) == []


@given(tilings(), st.data())
@settings(max_examples=150, deadline=None)
def test_a_duplicated_or_grown_chunk_is_reported_as_an_overlap_naming_key_and_chunks(t, data):
    size, chunks = t
    i = data.draw(st.integers(0, len(chunks) - 1))
    c = chunks[i]
    if len(chunks) > 1 and data.draw(st.booleans()):
        # grow a chunk into its neighbour along some axis where there is room
        room = [a for a in range(len(size)) if c.offsets[a] + c.sizes[a] < size[a]]
        if not room:
            return
        a = data.draw(st.sampled_from(room))
        grown = list(c.sizes)
        grown[a] += 1
        bad = chunks[:i] + [ChunkStorageMetadata(c.offsets, torch.Size(grown))] + chunks[i + 1 :]
    else:
        bad = chunks + [c]  # the same chunk twice (a replica saved twice)
    problems = chunk_problems("layer.w", size, bad)
    assert len(problems) == 1 and "'layer.w'" in problems[0] and "overlap" in problems[0]


@given(tilings(), st.data())
@settings(max_examples=100, deadline=None)
def test_a_missing_chunk_is_reported_as_a_gap(t, data):
    size, chunks = t
    if len(chunks) < 2:
        return
    i = data.draw(st.integers(0, len(chunks) - 1))
    problems = chunk_problems("w", size, chunks[:i] + chunks[i + 1 :])
    assert len(problems) == 1 and "gap" in problems[0]
    missing = math.prod(chunks[i].sizes)
    assert f"cover {math.prod(size) - missing} of {math.prod(size)}" in problems[0]


def test_a_chunk_outside_its_tensor_is_named():
    problems = chunk_problems("w", (4, 4), [ChunkStorageMetadata(torch.Size([2, 0]), torch.Size([4, 4]))])
    assert problems == ["'w': chunk [2:6, 0:4) lies outside the tensor of size [4, 4]"]


# ---- save planning -------------------------------------------------------------------------


def _plans(state_dicts, caching=False):
    """Run the save planning protocol for simulated ranks in one process."""
    planners = [ResilientSavePlanner(enable_plan_caching=caching) for _ in state_dicts]
    local = []
    for r, (p, sd) in enumerate(zip(planners, state_dicts)):
        p.set_up_planner(sd, is_coordinator=r == 0)
        local.append(p.create_local_plan())
    return planners, local


def _rowshard(key, full, rank, n, replica=0):
    rows = full.shape[0] // n
    return ShardedTensor.from_rank_offsets(
        key, full[rank * rows : (rank + 1) * rows], (0, rank, n), replica_id=replica
    )


def test_global_plan_with_overlapping_shards_fails_naming_key_and_chunks():
    full = torch.arange(16.0).reshape(4, 4)
    a = ShardedTensor("w", full[:3], torch.float32, (3, 4), (4, 4), (0, 0), None)
    b = ShardedTensor("w", full[2:], torch.float32, (2, 4), (4, 4), (2, 0), None)
    planners, local = _plans([{"w": a}, {"w": b}])
    with pytest.raises(ValidationError, match=r"'w': chunks \[0:3, 0:4\) and \[2:4, 0:4\) overlap"):
        planners[0].create_global_plan(local)


def test_global_plan_with_a_gap_fails_naming_key():
    full = torch.arange(16.0).reshape(4, 4)
    a = ShardedTensor("w", full[:1], torch.float32, (1, 4), (4, 4), (0, 0), None)
    b = ShardedTensor("w", full[2:], torch.float32, (2, 4), (4, 4), (2, 0), None)
    planners, local = _plans([{"w": a}, {"w": b}])
    with pytest.raises(ValidationError, match=r"'w': chunks cover 12 of 16 elements .*gap"):
        planners[0].create_global_plan(local)


def test_ranks_disagreeing_on_a_keys_dtype_fail_naming_both_ranks():
    a = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4), (0, 0, 2))
    b = ShardedTensor.from_rank_offsets("w", torch.zeros(2, 4, dtype=torch.float64), (0, 1, 2))
    planners, local = _plans([{"w": a}, {"w": b}])
    with pytest.raises(
        ValidationError, match=r"'w': rank 0 saves torch.float32 .* rank 1 saves torch.float64"
    ):
        planners[0].create_global_plan(local)


@given(
    sizes=st.lists(st.integers(1, 40), min_size=1, max_size=8),
    tp=st.lists(st.booleans(), min_size=8, max_size=8),
    world=st.integers(2, 4),
)
@settings(max_examples=60, deadline=None)
def test_replicas_are_written_once_by_the_rank_the_memory_tier_distribution_chooses(sizes, tp, world):
    """Same shards in, same assignment out: the disk tier writes what the memory tier saved."""
    per_rank = []
    for r in range(world):
        sd = {}
        for i, n in enumerate(sizes):
            if tp[i] and n % world == 0:  # sharded over the world: one holder per piece
                sd[f"p{i}"] = _rowshard(f"p{i}", torch.ones(n, 3), r, world)
            else:  # data-parallel replica: every rank holds it, rank 0 is the main one
                sd[f"p{i}"] = ShardedTensor.from_rank_offsets(f"p{i}", torch.ones(n, 3), replica_id=r)
        per_rank.append(sd)
    planners, local = _plans(per_rank)
    plans, md = planners[0].create_global_plan(local)
    gathered = []
    for sd in per_rank:
        shards = list(sd.values())
        gathered.append(
            {"shards": [list(shard_record(s)) for s in shards], "fp": structure_fingerprint(shards)}
        )
    expected = compute_distribution([], gathered=gathered).main_rank_for_shard
    assert planners[0].writer_of_chunk == expected
    written = {(i.index.fqn, tuple(i.index.offset)): r for r, p in enumerate(plans) for i in p.items}
    assert written == expected  # each chunk in exactly one rank's final plan


def test_flattening_keys_sharded_tensors_by_key_and_everything_else_by_torchs_path():
    t = torch.ones(2)
    flat = flatten_for_save(
        {
            "model": {"layer": ShardedTensor.from_rank_offsets("decoder.layer.w", t)},
            "plain": {"b": t, "lst": [t, 3]},
            "obj": ShardedObject("rng", {"s": 1}, (2,), (1,)),
            "not_mine": ShardedTensor.from_rank_offsets("x", t).without_data(),
            "opt": {"lr": 0.1, "betas": [0.9, 0.99]},
        }
    )
    assert sorted(e.fqn for e in flat.tensors) == ["decoder.layer.w", "plain.b", "plain.lst.0"]
    # torch's rule: dicts are always descended, lists only when they hold tensors.
    assert sorted(e.fqn for e in flat.values) == ["opt.betas", "opt.lr", "plain.lst.1", "rng/shard_1_2"]
    assert flat.mappings["decoder.layer.w"] == ("model", "layer")
    assert flat.mappings["rng/shard_1_2"] == ("obj", "shard_1_2")


def test_two_leaves_flattening_to_one_key_are_refused():
    with pytest.raises(ValidationError, match="same key 'a.b'"):
        flatten_for_save({"a": {"b": 1, "c": torch.ones(1)}, "a.b": 2})


# ---- round trips with torch's own DCP ---------------------------------------------------------


def test_checkpoint_written_by_torch_dcp_save_loads_through_our_planner(tmp_path):
    w = torch.randn(4, 6)
    dcp.save(
        {"model": {"w": w, "b": torch.arange(3)}, "step": 5, "cfg": {"name": "x", "ids": [1, 2]}},
        checkpoint_id=str(tmp_path),
        no_dist=True,
    )
    template = {
        "model": {
            # Another layout than the one saved: two row pieces held by this process.
            "w0": ShardedTensor("model.w", None, torch.float32, (2, 6), (4, 6), (0, 0), None),
            "w1": ShardedTensor("model.w", None, torch.float32, (2, 6), (4, 6), (2, 0), None),
            "b": torch.zeros(3, dtype=torch.int64),
        },
        "step": None,
        "cfg": {"name": None, "ids": None},
    }
    load_local(template, SafeFileSystemReader(tmp_path))
    assert torch.equal(template["model"]["w0"], w[:2]) and torch.equal(template["model"]["w1"], w[2:])
    assert torch.equal(template["model"]["b"], torch.arange(3))
    assert template["step"] == 5 and template["cfg"] == {"name": "x", "ids": [1, 2]}


def test_our_checkpoint_loads_with_plain_dcp_load(tmp_path):
    model = torch.nn.Linear(5, 3)
    sd = {
        "model": {
            n: ShardedTensor.from_rank_offsets(f"model.{n}", t.detach())
            for n, t in model.state_dict().items()
        },
        "step": 3,
    }
    _save(sd, tmp_path)
    fresh = torch.nn.Linear(5, 3)
    target = {"model": fresh.state_dict()}
    dcp.load(target, checkpoint_id=str(tmp_path), no_dist=True)
    for n, t in model.state_dict().items():
        assert torch.equal(target["model"][n], t)


def test_a_pickled_value_is_refused_unless_pickle_is_allowed(tmp_path):
    dcp.save({"w": torch.ones(2), "custom": NotAllowListed(7)}, checkpoint_id=str(tmp_path), no_dist=True)
    with pytest.raises(CodecError, match="'custom' cannot be decoded safely.*allow_pickle=True"):
        load_local({"custom": None}, SafeFileSystemReader(tmp_path))
    sd = {"custom": None}
    load_local(sd, SafeFileSystemReader(tmp_path), ResilientLoadPlanner(allow_pickle=True))
    assert sd["custom"] == NotAllowListed(7)


def test_requested_keys_absent_from_the_checkpoint_are_named_unless_partial_load(tmp_path):
    _save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(2)), "step": 1}, tmp_path)

    def template():
        return {
            "a": ShardedTensor.from_rank_offsets("a", torch.zeros(2)),
            "gone": ShardedTensor.from_rank_offsets("gone", torch.zeros(2)).without_data(),
            "also_gone": 5,
            "step": None,
        }

    with pytest.raises(
        ValidationError, match=r"not in the checkpoint: 'also_gone', 'gone'.*allow_partial_load"
    ):
        load_local(template(), SafeFileSystemReader(tmp_path))
    sd = template()
    planner = ResilientLoadPlanner(allow_partial_load=True)
    load_local(sd, SafeFileSystemReader(tmp_path), planner)
    assert torch.equal(sd["a"], torch.ones(2)) and sd["step"] == 1
    assert "gone" not in sd and sd["also_gone"] == 5  # no data to keep: dropped; a value: kept
    assert sorted(planner.keys_not_in_checkpoint) == ["also_gone", "gone"]


def test_a_shape_mismatch_names_the_key_and_both_shapes(tmp_path):
    _save({"a": ShardedTensor.from_rank_offsets("a", torch.ones(4))}, tmp_path)
    with pytest.raises(ValidationError, match=r"'a': the checkpoint holds global size \[4\].*asks for \[6\]"):
        load_local(
            {"a": ShardedTensor.from_rank_offsets("a", torch.zeros(6))}, SafeFileSystemReader(tmp_path)
        )


def test_metadata_only_planner_rebuilds_the_nested_state_dict_without_a_model(tmp_path):
    w = torch.randn(4, 2)
    sd = {
        "model": {
            "w0": ShardedTensor("w", w[:2].clone(), torch.float32, (2, 2), (4, 2), (0, 0), None),
            "w1": ShardedTensor("w", w[2:].clone(), torch.float32, (2, 2), (4, 2), (2, 0), None),
        },
        "extra": {"epoch": 3, "names": ["a"]},
    }
    _save(sd, tmp_path)
    out = load_metadata_only(tmp_path)
    assert torch.equal(out["model"]["w0"], w)  # the whole tensor, at the first piece's path
    assert out["extra"] == {"epoch": 3, "names": ["a"]}
    assert load_metadata_only(tmp_path, keys=["extra"]) == {"extra": {"epoch": 3, "names": ["a"]}}
    with pytest.raises(ValidationError, match="keys not in the checkpoint: 'nope'"):
        load_metadata_only(tmp_path, keys=["nope"])
    with pytest.raises(ValidationError, match="fills an empty dict"):
        MetadataStateDictLoadPlanner().set_up_planner({"x": 1}, read_metadata_file(tmp_path / ".metadata"))


# ---- damaged or foreign directories ---------------------------------------------------------------


def test_overlapping_chunks_in_stored_metadata_fail_the_load_naming_key_and_chunks(tmp_path):
    full = torch.arange(8.0).reshape(4, 2)
    _save(
        {
            "a": ShardedTensor("w", full[:2].clone(), torch.float32, (2, 2), (4, 2), (0, 0), None),
            "b": ShardedTensor("w", full[2:].clone(), torch.float32, (2, 2), (4, 2), (2, 0), None),
        },
        tmp_path,
    )
    md = read_metadata_file(tmp_path / ".metadata")
    md.state_dict_metadata["w"].chunks[1] = ChunkStorageMetadata(torch.Size([1, 0]), torch.Size([2, 2]))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(ValidationError, match=r"'w': chunks \[0:2, 0:2\) and \[1:3, 0:2\) overlap"):
        load_metadata_only(tmp_path)


def test_a_missing_or_foreign_metadata_file_is_named(tmp_path):
    with pytest.raises(CorruptCheckpointError, match="does not exist"):
        read_metadata_file(tmp_path / "nope" / ".metadata")
    with pytest.raises(
        CorruptCheckpointError, match=r"\.metadata is missing: .* is not a complete DCP checkpoint"
    ):
        load_metadata_only(tmp_path)
    md = Metadata(state_dict_metadata={}, planner_data=NotAllowListed(1))
    (tmp_path / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CorruptCheckpointError, match=r"refers to test_dcp.NotAllowListed.*not unpickled"):
        read_metadata_file(tmp_path / ".metadata")
    assert read_metadata_file(tmp_path / ".metadata", allow_pickle=True).planner_data == NotAllowListed(1)
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(CorruptCheckpointError, match="does not hold DCP Metadata"):
        read_metadata_file(tmp_path / ".metadata")


# ---- plan caching across saves (two ranks) ----------------------------------------------------


def _caching(ctx):
    r = ctx.rank
    planner = ResilientSavePlanner()
    received = []

    def state(step, extra=False):
        g = torch.Generator().manual_seed(step)
        full = torch.randn(8, 4, generator=g)
        sd = {
            "w": _rowshard("w", full, r, 2),
            "rep": ShardedTensor.from_rank_offsets("rep", torch.full((3,), float(step)), replica_id=r),
            "step": step,
        }
        if extra and r == 1:
            sd["only_rank1"] = ShardedTensor.from_rank_offsets("only_rank1", torch.ones(2))
        return sd, full

    for i, (step, extra) in enumerate([(1, False), (2, False), (3, True), (4, True)]):
        sd, full = state(step, extra)
        path = os.path.join(ctx.tmp_root, f"ckpt{i}")
        dcp.save(sd, checkpoint_id=path, planner=planner)
        received.append((planner.stats.full_plans_received, planner.stats.local_plan_cached))
    # The cached plans wrote the newest data: load the last two checkpoints back.
    checks = []
    for i, step in ((1, 2), (3, 4)):
        target = {"w": torch.zeros(8, 4), "rep": torch.zeros(3), "step": None}
        load_local(target, SafeFileSystemReader(os.path.join(ctx.tmp_root, f"ckpt{i}")))
        checks.append(
            torch.equal(target["w"], state(step)[1])
            and torch.equal(target["rep"], torch.full((3,), float(step)))
            and target["step"] == step
        )
    return received, checks


@pytest.mark.multiprocess
def test_second_save_of_the_same_structure_sends_no_full_plans_to_the_coordinator(tmp_root):
    (recv0, checks0), (recv1, checks1) = run_ranks(_caching, 2, tmp_root, timeout=120)
    # Coordinator: 2 full plans, then none (markers only), then only rank 1's changed plan,
    # then none again.
    assert [n for n, _ in recv0] == [2, 0, 1, 0]
    assert [c for _, c in recv0] == [False, True, True, True]
    assert [c for _, c in recv1] == [False, True, False, True]
    assert all(checks0) and all(checks1)


def test_inspect_and_convert_read_a_checkpoint_written_by_torch(tmp_path, capsys):
    from resilient_ckpt.cli.inspect import convert_main, inspect_main

    w = torch.randn(3, 2, dtype=torch.bfloat16)
    dcp.save({"model": {"w": w}, "step": 4}, checkpoint_id=str(tmp_path / "ck"), no_dist=True)
    assert inspect_main([str(tmp_path / "ck")]) == 0
    text = capsys.readouterr().out
    assert "written by torch.distributed.checkpoint" in text
    assert "model.w" in text and "bfloat16" in text and "(3, 2)" in text and "12 B" in text
    assert convert_main([str(tmp_path / "ck"), "--to", str(tmp_path / "out.pt")]) == 0
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert torch.equal(out["model"]["w"], w) and out["step"] == 4
