"""CheckpointManager in one process: bad input, faults, retention, budgets, compatibility API."""

from __future__ import annotations

import dataclasses
import logging
import threading

import pytest
import torch

from resilient_ckpt.errors import (
    CheckpointingException,
    CodecError,
    StoreFullError,
    ValidationError,
)
from resilient_ckpt.manager.checkpoint_manager import FAULT_POINTS, MAX_ITERATION, CheckpointManager
from resilient_ckpt.memory.layout import CheckpointHeader, plan_layout
from resilient_ckpt.memory.store import CheckpointStore
from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor
from resilient_ckpt.parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict


def _sd(step: int, fill: bool = True):
    g = torch.Generator().manual_seed(step)
    w = torch.randn(32, 64, generator=g) if fill else torch.empty(32, 64)
    b = torch.randn(64, generator=g).to(torch.bfloat16) if fill else torch.empty(64, dtype=torch.bfloat16)
    return {
        "model": {"w": ShardedTensor.from_rank_offsets("w", w), "b": ShardedTensor.from_rank_offsets("b", b)},
        "rng": ShardedObject("rng", {"seed": step}, (1,), (0,)),
        "step": step,
    }


def _check(state, step):
    ref = _sd(step)
    assert torch.equal(state["model"]["w"], ref["model"]["w"].data)
    assert torch.equal(state["model"]["b"], ref["model"]["b"].data)
    assert state["rng"] == {"seed": step} and state["step"] == step


def _mgr(tmp_root, **kw):
    kw.setdefault("replication_factor", 1)
    kw.setdefault("keep_last", 2)  # these specify fallbacks to the previous complete iteration
    return CheckpointManager(kw.pop("session_id", "job"), store_root=str(tmp_root), **kw)


@pytest.fixture
def mgr(tmp_root):
    m = _mgr(tmp_root)
    yield m
    m.close()


def _iterations(store: CheckpointStore):
    return sorted({c.iteration for c in store.list()})


# ---- iteration numbers -------------------------------------------------------------------------


def test_iteration_that_does_not_increase_is_rejected_clearly(mgr):
    mgr.save_local(_sd(5), 5, is_async=False)
    for bad in (5, 4):
        with pytest.raises(
            ValidationError, match=f"iteration {bad} does not increase.*last saved or restored: 5"
        ):
            mgr.save_local(_sd(bad), bad)
    mgr.save_local(_sd(6), 6, is_async=False)  # the manager is still usable
    assert _iterations(mgr.store) == [5, 6]


@pytest.mark.parametrize("bad", [-1, MAX_ITERATION + 1, 3.0, True, "7"])
def test_iteration_outside_int64_or_not_an_int_is_rejected(mgr, bad):
    with pytest.raises(ValidationError, match="iteration"):
        mgr.save_local(_sd(1), bad)
    assert mgr.store.list() == []


def test_restored_iteration_counts_as_the_last_saved_one(tmp_root):
    with _mgr(tmp_root) as m:
        m.save_local(_sd(10), 10, is_async=False)
    with _mgr(tmp_root) as m:
        assert m.load_local(_sd(0, fill=False))[1] == 10
        with pytest.raises(ValidationError, match="does not increase"):
            m.save_local(_sd(10), 10)


# ---- queueing ------------------------------------------------------------------------------


def test_save_while_previous_save_in_flight_is_queued_and_both_complete(tmp_root):
    release = threading.Event()
    entered = threading.Event()

    def hook(point):
        if point == "after_staging" and not release.is_set():
            entered.set()
            release.wait(30)

    m = _mgr(tmp_root, fault_hook=hook)
    try:
        h1 = m.save_local(_sd(1), 1)
        assert entered.wait(30)
        h2 = m.save_local(_sd(2), 2)  # queued behind the blocked save: returns at once
        assert not h1.done() and not h2.done()
        third = threading.Thread(target=lambda: m.save_local(_sd(3), 3), daemon=True)
        third.start()
        third.join(0.3)
        assert third.is_alive()  # a third save waits for the oldest: memory stays bounded
        release.set()
        third.join(30)
        h1.wait(30)
        h2.wait(30)
        state, it = m.load_local(_sd(0, fill=False))
    finally:
        release.set()
        m.close()
    assert it == 3
    _check(state, 3)


# ---- faults during a save ------------------------------------------------------------------


@pytest.mark.parametrize("point", FAULT_POINTS)
def test_a_failure_at_any_save_stage_keeps_the_previous_complete_iteration(tmp_root, point):
    def hook(p):
        if p == point and armed:
            raise RuntimeError(f"injected at {p}")

    armed = False
    m = _mgr(tmp_root, fault_hook=hook)
    try:
        m.save_local(_sd(1), 1, is_async=False)
        armed = True
        h = m.save_local(_sd(2), 2)
        with pytest.raises(
            CheckpointingException,
            match="iteration 2 is not complete.*previous complete iteration 1 stays loadable",
        ) as e:
            h.wait(30)
        assert f"injected at {point}" in str(e.value)
        armed = False
        assert _iterations(m.store) == [1]
        state, it = m.load_local(_sd(0, fill=False))
        assert it == 1
        _check(state, 1)
        m.save_local(_sd(3), 3, is_async=False)  # and the next save works
        assert _iterations(m.store) == [1, 3]
    finally:
        m.close()


def test_keep_last_one_never_deletes_the_only_complete_iteration_on_a_failed_save(tmp_root):
    fail = {"on": False}

    def hook(p):
        if fail["on"] and p == "after_publish":
            raise RuntimeError("boom")

    with _mgr(tmp_root, keep_last=1, fault_hook=hook) as m:
        m.save_local(_sd(1), 1, is_async=False)
        fail["on"] = True
        with pytest.raises(CheckpointingException):
            m.save_local(_sd(2), 2, is_async=False)
        assert _iterations(m.store) == [1]
        fail["on"] = False
        m.save_local(_sd(3), 3, is_async=False)
        assert _iterations(m.store) == [3]


def test_common_state_that_cannot_be_encoded_fails_before_anything_is_staged(mgr):
    mgr.save_local(_sd(1), 1, is_async=False)
    sd = _sd(2)
    sd["bad"] = threading.Lock()
    with pytest.raises(CodecError):
        mgr.save_local(sd, 2)
    assert _iterations(mgr.store) == [1]
    assert not any(p.name.endswith(".data") and "00002" in p.name for p in mgr.store.dir.iterdir())
    mgr.save_local(_sd(3), 3, is_async=False)
    _check(mgr.load_local(_sd(0, fill=False))[0], 3)


# ---- retention -----------------------------------------------------------------------------


@pytest.mark.parametrize("keep", [1, 2, 3])
def test_retention_keeps_exactly_the_last_k_complete_iterations(tmp_root, keep):
    with _mgr(tmp_root, keep_last=keep) as m:
        for it in range(1, 7):
            m.save_local(_sd(it), it, is_async=False)
            assert _iterations(m.store) == list(range(max(1, it - keep + 1), it + 1))


def test_keep_last_below_one_is_rejected(tmp_root):
    with pytest.raises(ValidationError, match="keep_last must be >= 1"):
        _mgr(tmp_root, keep_last=0)


# ---- memory budget -------------------------------------------------------------------------


def test_memory_budget_too_small_fails_the_save_clearly_and_keeps_what_is_stored(tmp_root):
    seg = plan_layout([(torch.float32, (32, 64)), (torch.bfloat16, (64,))])[1]
    # Room for two segments: keep_last=2 needs a third one for the save in progress.
    with _mgr(tmp_root, memory_budget=2 * seg + 100) as m:
        m.save_local(_sd(1), 1, is_async=False)
        m.save_local(_sd(2), 2, is_async=False)
        with pytest.raises(
            StoreFullError, match=r"over its memory budget of 16\.6. KiB.*raise memory_budget"
        ):
            m.save_local(_sd(3), 3)
        assert _iterations(m.store) == [1, 2]
        _check(m.load_local(_sd(0, fill=False))[0], 2)
        m.store.memory_budget = 3 * seg + 100
        m.save_local(_sd(4), 4, is_async=False)
        assert _iterations(m.store) == [2, 4]


# ---- load: bad template, foreign and corrupt files -----------------------------------------


def test_template_key_missing_from_the_checkpoint_raises_naming_the_key(mgr):
    mgr.save_local(_sd(1), 1, is_async=False)
    template = _sd(0, fill=False)
    template["model"]["extra"] = ShardedTensor.from_rank_offsets("extra", torch.empty(3))
    with pytest.raises(
        ValidationError,
        match=r"Unexpected keys \(requested by the state dict, not in the checkpoint\): extra",
    ):
        mgr.load_local(template)


def test_template_key_missing_is_skipped_with_a_warning_when_asked(mgr, caplog):
    mgr.save_local(_sd(1), 1, is_async=False)
    template = _sd(0, fill=False)
    template["model"]["extra"] = ShardedTensor.from_rank_offsets("extra", torch.empty(3))
    with caplog.at_level(logging.WARNING):
        state, _ = mgr.load_local(template, strict="log_unexpected")
    assert "extra" not in state["model"] and "extra" in caplog.text
    _check(state, 1)


def test_checkpoints_of_another_session_are_not_loaded_and_are_named_in_the_log(tmp_root, caplog):
    with _mgr(tmp_root, session_id="run-a") as m:
        m.save_local(_sd(1), 1, is_async=False)
    with _mgr(tmp_root, session_id="run-b") as m, caplog.at_level(logging.WARNING):
        assert m.load_local(_sd(0, fill=False)) is None
        assert m.find_latest() == -1
    assert "sessions ['run-a']" in caplog.text and "session_id" in caplog.text


def _rewrite_header(store: CheckpointStore, iteration: int, **changes):
    (cid,) = [c for c in store.list() if c.iteration == iteration]
    h = CheckpointHeader.unpack(store.header_path(cid).read_bytes())
    store.header_path(cid).write_bytes(dataclasses.replace(h, **changes).pack())


@pytest.mark.parametrize(
    "change, message",
    [
        ({"session": "someone-else"}, "belongs to session 'someone-else'"),
        ({"format_version": 99}, "store format version 99, this build reads version 1"),
        # (a whole checkpoint of another world size restores resharded: tests/test_elastic.py)
        ({"world_size": 4}, "world size 4, this job has 1, and the stores hold the data of only 1 of its 4"),
    ],
)
def test_foreign_store_files_are_not_loaded_and_fail_load_clearly(tmp_root, change, message):
    with _mgr(tmp_root) as m:
        m.save_local(_sd(1), 1, is_async=False)
        _rewrite_header(m.store, 1, **change)
        with pytest.raises(CheckpointingException, match="cannot use: .*" + message):
            m.load_local(_sd(0, fill=False))
        assert m.store.list()  # reported, never deleted


def test_foreign_files_beside_a_usable_checkpoint_are_skipped_with_a_warning(tmp_root, caplog):
    with _mgr(tmp_root) as m:
        m.save_local(_sd(1), 1, is_async=False)
        m.save_local(_sd(2), 2, is_async=False)
        _rewrite_header(m.store, 2, format_version=99)
        with caplog.at_level(logging.WARNING):
            state, it = m.load_local(_sd(0, fill=False))
    assert it == 1 and "format version 99" in caplog.text
    _check(state, 1)


def _corrupt(store, iteration, how):
    (cid,) = [c for c in store.list() if c.iteration == iteration]
    if how == "truncated data":
        with open(store.data_path(cid), "r+b") as f:
            f.truncate(10)
    elif how == "flipped data byte":
        lay = store.read_header(cid).tensors[0]
        with open(store.data_path(cid), "r+b") as f:
            f.seek(lay.offset + 5)
            b = f.read(1)
            f.seek(lay.offset + 5)
            f.write(bytes([b[0] ^ 0x10]))
    elif how == "flipped header byte":
        raw = bytearray(store.header_path(cid).read_bytes())
        raw[40] ^= 0x01
        store.header_path(cid).write_bytes(bytes(raw))
    elif how == "truncated header":
        store.header_path(cid).write_bytes(store.header_path(cid).read_bytes()[:30])
    elif how == "missing data":
        store.data_path(cid).unlink()


CORRUPTIONS = [
    "truncated data",
    "flipped data byte",
    "flipped header byte",
    "truncated header",
    "missing data",
]


@pytest.mark.parametrize("how", CORRUPTIONS)
def test_corrupted_newest_checkpoint_falls_back_to_the_previous_one_with_a_warning(tmp_root, how, caplog):
    with _mgr(tmp_root) as m:
        m.save_local(_sd(1), 1, is_async=False)
        m.save_local(_sd(2), 2, is_async=False)
        _corrupt(m.store, 2, how)
        with caplog.at_level(logging.WARNING):
            state, it = m.load_local(_sd(0, fill=False))
        assert it == 1
        _check(state, 1)
        assert "iter_00000000000000000002" in caplog.text or "iteration 2" in caplog.text
        m.save_local(_sd(2), 2, is_async=False)  # the abandoned iteration can be saved again
        _check(m.load_local(_sd(0, fill=False))[0], 2)


@pytest.mark.parametrize("how", ["truncated data", "flipped data byte"])
def test_the_only_checkpoint_corrupted_raises_a_clear_error(tmp_root, how):
    with _mgr(tmp_root) as m:
        m.save_local(_sd(1), 1, is_async=False)
        _corrupt(m.store, 1, how)
        with pytest.raises(
            CheckpointingException, match=r"no complete iteration could be restored \(tried \[1\]\)"
        ):
            m.load_local(_sd(0, fill=False))


def test_empty_store_loads_nothing(mgr):
    assert mgr.find_latest() == -1
    assert mgr.load_local(_sd(0, fill=False)) is None
    with pytest.raises(CheckpointingException, match="no complete local checkpoint to load"):
        mgr.load()


def test_close_returns_the_spare_segment_and_keeps_checkpoints(tmp_root):
    m = _mgr(tmp_root)
    m.save_local(_sd(1), 1, is_async=False)
    m.close()
    assert _iterations(m.store) == [1]
    assert all(p.name.startswith("seg_") for p in m.store.free_dir.iterdir())


# ---- nvidia-resiliency-ext LocalCheckpointManager-style API ----------------------------------


def test_nvrx_style_save_find_latest_and_load(tmp_root):
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest

    from resilient_ckpt.manager.async_request import LocalAsyncRequest

    with _mgr(tmp_root, session_id="nvrx") as m:
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_sd(1), algo="fully_parallel")
        assert m.save(tasd, 1, is_async=False) is None
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_sd(2), algo="fully_parallel")
        req = m.save(tasd, 2, is_async=True)
        # Our request: the older AsyncRequest's fields, which the queues convert to their class.
        assert isinstance(req, LocalAsyncRequest) and set(req._fields) < set(AsyncRequest._fields)
        for fn in req.finalize_fns:
            fn()
        assert m.latest_iteration == -1  # invalidated by the save, like nvidia-resiliency-ext
    with _mgr(tmp_root, session_id="nvrx") as m:
        assert m.find_latest() == 2
        loaded, ckpt_id = m.load()
        assert ckpt_id == (2, 0, "nvrx")
        assert not loaded.is_hollow
        _check(loaded.to_state_dict(_sd(0, fill=False), algo="fully_parallel"), 2)


def test_nvrx_style_failed_async_save_raises_in_finalize(tmp_root):
    def hook(p):
        if p == "before_replication":
            raise RuntimeError("disk on fire")

    with _mgr(tmp_root, fault_hook=hook) as m:
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(_sd(1), algo="fully_parallel")
        req = m.save(tasd, 1, is_async=True)
        with pytest.raises(CheckpointingException, match="disk on fire"):
            for fn in req.finalize_fns:
                fn()
        assert m.find_latest() == -1


# ---- retrieval re-planning -----------------------------------------------------------------


def test_a_corrupt_copy_is_excluded_for_its_whole_node_so_a_remote_replica_is_reached(monkeypatch):
    """Eight ranks on one node share a store: when rank 0's copy fails verification there, no
    other rank of that node is tried (same file); the replica on the other node serves it."""
    from resilient_ckpt.manager import restore

    world = 9  # ranks 0-7 on node "a", rank 8 on node "b" (holds the replica of rank 0)
    held = [{(5, r): 100 for r in range(8)} if r < 8 else {(5, 0): 100, (5, 8): 100} for r in range(world)]
    holdings = restore.Holdings(("a",) * 8 + ("b",), tuple(held), ((),) * world)
    tried = []

    def fake_execute(attempt, plan, transport):
        (mine,) = [f for f in plan if f.receiver == attempt.me]
        tried.append(mine.source)
        if attempt.holdings.node_of(mine.source) == 0:  # every copy on node "a" is the corrupt file
            return None, [(mine.source, mine.owner)]
        return restore.Retrieved(None, [], mine.source, "peer", 0.0, 100, 1), []

    monkeypatch.setattr(restore, "_execute", fake_execute)
    got = restore.retrieve(None, holdings, 5, None, None, 0, world)
    assert tried == [0, 8] and got.source_rank == 8 and got.attempts == 2
    assert got.failed_copies == [(0, 0)]


# ---- option groups --------------------------------------------------------------------------------


def test_option_groups_and_flat_keywords_configure_the_same_manager(tmp_root):
    from resilient_ckpt.manager.options import PersistentOptions, ReplicationOptions

    grouped = CheckpointManager(
        "opts",
        store_root=str(tmp_root),
        keep_last=3,
        replication=ReplicationOptions(factor=1, placement="ring", backend="gloo"),
        persistent=PersistentOptions(directory=None, flush_every=5),
    )
    flat = CheckpointManager(
        "opts", store_root=str(tmp_root), keep_last=3, replication_factor=1, flush_every=5
    )
    try:
        assert grouped.options == flat.options
        assert grouped.options.replication.factor == 1 and grouped.options.persistent.flush_every == 5
        assert grouped.placement == flat.placement and grouped.keep_last == 3
    finally:
        grouped.close()
        flat.close()


def test_a_value_given_both_as_group_and_flat_keyword_with_two_meanings_is_refused(tmp_root):
    from resilient_ckpt.manager.options import ReplicationOptions

    with pytest.raises(
        ValidationError, match=r"replication_factor=3 contradicts ReplicationOptions\(factor=1\)"
    ):
        CheckpointManager(
            "opts", store_root=str(tmp_root), replication_factor=3, replication=ReplicationOptions(factor=1)
        )
    with pytest.raises(ValidationError, match="placement must be 'ring' or 'clique'"):
        CheckpointManager("opts", store_root=str(tmp_root), replication=ReplicationOptions(placement="star"))
