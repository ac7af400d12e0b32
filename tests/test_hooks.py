"""CheckpointHook in a training loop: the save schedule, the optimizer waiting for staging,
failed saves that warn instead of stopping training, and restore at start-up."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

from harness import hold_copies_until_fenced
from resilient_ckpt import CheckpointHook, CheckpointManager, ShardedTensor, TrainState
from resilient_ckpt.errors import CheckpointingException, StoreFullError, ValidationError
from resilient_ckpt.memory import staging


def _manager(tmp_root, **kw):
    kw.setdefault("replication_factor", 1)
    kw.setdefault("keep_last", 100)  # keep everything: tests read the published iterations
    return CheckpointManager(kw.pop("session_id", "hooks"), store_root=str(tmp_root), **kw)


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return TrainState(model, opt, sched, extra={"data_position": 0})


def _train_step(state: TrainState) -> None:
    g = torch.Generator().manual_seed(state.extra["data_position"])
    x = torch.randn(4, 8, generator=g)
    state.optimizer.zero_grad()
    state.model(x).pow(2).mean().backward()
    state.optimizer.step()
    state.lr_scheduler.step()
    state.extra["data_position"] += 1


def _published(manager) -> list:
    return sorted({c.iteration for c in manager.store.list()})


def _params(state) -> dict:
    return {k: v.clone() for k, v in state.model.state_dict().items()}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the schedule ------------------------------------------------------------------------------


@pytest.mark.parametrize("every, steps, expected", [(3, 10, [2, 5, 8]), (1, 4, [0, 1, 2, 3]), (5, 4, [])])
def test_hook_saves_after_every_nth_step_and_at_no_other(tmp_root, every, steps, expected):
    state = _state()
    manager = _manager(tmp_root)
    hook = CheckpointHook(manager, every_n_steps=every, state=state)
    handles = {}
    for step in range(steps):
        _train_step(state)
        h = hook.step(step)
        assert (h is not None) == (step in expected)
        if h is not None:
            handles[step] = h
    hook.close()
    assert hook.saved_steps == expected
    assert _published(manager) == expected
    assert sorted(handles) == expected and all(h.iteration == s for s, h in handles.items())
    assert hook.failed_saves == 0
    manager.close()


@pytest.mark.parametrize("bad", [0, -3, 2.5, True, "10"])
def test_every_n_steps_that_is_not_a_positive_int_is_rejected(tmp_root, bad):
    with _manager(tmp_root) as manager:
        with pytest.raises(ValidationError, match="every_n_steps must be an int >= 1"):
            CheckpointHook(manager, every_n_steps=bad, state=_state())


def test_hook_needs_exactly_one_source_of_state(tmp_root):
    with _manager(tmp_root) as manager:
        with pytest.raises(ValidationError, match="exactly one of state="):
            CheckpointHook(manager, 2)
        with pytest.raises(ValidationError, match="exactly one of state="):
            CheckpointHook(manager, 2, state=_state(), state_fn=dict)


# ---- the optimizer waits for staging ---------------------------------------------------------------


def test_optimizer_step_cannot_start_before_the_snapshot_copies_finished(tmp_root, monkeypatch):
    """The snapshot's copies are held back until the training thread blocks on them; a probe
    registered after the hook's pre-step hook sees whether they had finished when the optimizer
    step began. Without the hook's wait the probe runs first and releases the copies itself, so
    the snapshot would also catch the updated weights."""
    held = hold_copies_until_fenced(monkeypatch.setattr)
    release, copies_done = held.release, held.done

    state = _state()
    _train_step(state)
    manager = _manager(tmp_root)
    hook = CheckpointHook(manager, every_n_steps=1, state=state)
    seen = []

    def probe(*_):
        seen.append(copies_done.is_set())
        release.set()

    state.optimizer.register_step_pre_hook(probe)
    before = _params(state)
    handle = hook.step(0)
    assert not copies_done.is_set(), "the copies are held until someone waits for them"
    _train_step(state)  # optimizer.step() inside
    assert seen == [True]
    assert handle.metrics.stall_s >= 0
    hook.close()
    manager.close()
    # The snapshot holds the weights of step 0, not the ones the optimizer step wrote.
    restored = _state(seed=1)
    with _manager(tmp_root) as again:
        assert CheckpointHook(again, 1, state=restored).restore() == 1
    assert _same(_params(restored), before)
    assert not _same(_params(restored), _params(state))


def test_optimizer_given_with_state_fn_also_waits_for_staging(tmp_root, monkeypatch):
    main = threading.current_thread()
    waited_in_main = []
    real = staging.StagingHandle.fence

    def fence(self, stream=None):
        if threading.current_thread() is main:
            waited_in_main.append(self)
        return real(self, stream)

    monkeypatch.setattr(staging.StagingHandle, "fence", fence)
    w = torch.nn.Parameter(torch.randn(4, 4))
    opt = torch.optim.SGD([w], lr=0.1)
    with _manager(tmp_root) as manager:
        hook = CheckpointHook(
            manager,
            1,
            state_fn=lambda: {"w": ShardedTensor.from_rank_offsets("w", w.detach())},
            optimizer=opt,
        )
        hook.step(0)
        assert waited_in_main == [], "save_local returns without waiting for the copies"
        w.grad = torch.ones_like(w)
        opt.step()
        assert len(waited_in_main) == 1, "the optimizer step fenced the snapshot"
        opt.step()
        assert len(waited_in_main) == 1, "and only once per save"
        hook.close()


def test_close_detaches_the_hook_from_the_optimizer(tmp_root):
    state = _state()
    with _manager(tmp_root) as manager:
        hook = CheckpointHook(manager, 2, state=state)
        assert len(state.optimizer._optimizer_step_pre_hooks) == 1
        hook.close()
        assert len(state.optimizer._optimizer_step_pre_hooks) == 0


# ---- failed saves ----------------------------------------------------------------------------------


def test_failed_save_warns_counts_and_training_goes_on(tmp_root):
    armed = {"after_staging": True}

    def fault(point):
        if armed.get(point):
            armed[point] = False
            raise RuntimeError("injected: replica node unreachable")

    state = _state()
    manager = _manager(tmp_root, fault_hook=fault)
    hook = CheckpointHook(manager, every_n_steps=3, state=state)
    for step in range(3):
        _train_step(state)
        first = hook.step(step)
    with pytest.raises(CheckpointingException):
        first.wait()  # the save of step 2 failed in the background
    _train_step(state)
    with pytest.warns(
        RuntimeWarning, match=r"local checkpoint of step 2 failed \(training continues.*injected"
    ):
        hook.step(3)  # reported at the next step, as a warning
    assert hook.failed_saves == 1 and hook.failed_steps == [2]
    for step in range(4, 9):
        _train_step(state)
        hook.step(step)
    hook.close()
    assert hook.saved_steps == [2, 5, 8]
    assert _published(manager) == [5, 8], "the failed save left nothing behind"
    assert hook.failed_saves == 1
    manager.close()


def test_save_that_cannot_start_warns_at_once_and_training_goes_on(tmp_root):
    state = _state()
    manager = _manager(tmp_root, memory_budget=64)  # far too small for any checkpoint
    hook = CheckpointHook(manager, every_n_steps=2, state=state)
    for step in range(6):
        _train_step(state)
        if hook.should_save(step):
            with pytest.warns(RuntimeWarning, match=f"step {step} failed.*memory budget"):
                assert hook.step(step) is None
        else:
            assert hook.step(step) is None
    hook.close()
    assert hook.failed_saves == 3 and hook.failed_steps == [1, 3, 5]
    assert state.extra["data_position"] == 6
    assert _published(manager) == []
    manager.close()


def test_failed_staging_copy_does_not_break_the_optimizer_step(tmp_root, monkeypatch):
    def broken_copy(*args):
        raise RuntimeError("injected: copy failed")

    monkeypatch.setattr(staging, "_finish", broken_copy)
    state = _state()
    manager = _manager(tmp_root)
    hook = CheckpointHook(manager, every_n_steps=1, state=state)
    _train_step(state)
    hook.step(0)
    _train_step(state)  # optimizer.step() waits for the failed copy and goes on
    _train_step(state)
    with pytest.warns(RuntimeWarning, match="step 0 failed.*injected: copy failed"):
        hook.finish()
    assert hook.failed_saves == 1
    assert state.extra["data_position"] == 3
    hook.close()
    manager.close()


def test_raise_on_failure_stops_training_with_the_save_error(tmp_root):
    state = _state()
    manager = _manager(tmp_root, memory_budget=64)
    hook = CheckpointHook(manager, every_n_steps=1, state=state, raise_on_failure=True)
    _train_step(state)
    with pytest.raises(StoreFullError, match="memory budget"):
        hook.step(0)
    assert hook.failed_saves == 1
    hook.close()
    manager.close()


def test_raise_on_failure_raises_a_background_failure_at_the_next_step(tmp_root):
    armed = {"before_agreement": True}

    def fault(point):
        if armed.get(point):
            armed[point] = False
            raise RuntimeError("injected late failure")

    state = _state()
    manager = _manager(tmp_root, fault_hook=fault)
    hook = CheckpointHook(manager, every_n_steps=1, state=state, raise_on_failure=True)
    _train_step(state)
    handle = hook.step(0)
    with pytest.raises(CheckpointingException):
        handle.wait()
    _train_step(state)
    with pytest.raises(CheckpointingException, match="iteration 0 is not complete"):
        hook.step(1)
    assert hook.failed_saves == 1
    hook.step(2)  # reported once, not again
    hook.close()
    assert hook.failed_saves == 1
    manager.close()


# ---- restore ---------------------------------------------------------------------------------------


def test_restore_on_an_empty_store_signals_a_fresh_start_and_says_so(tmp_root, caplog):
    state = _state()
    before = _params(state)
    with _manager(tmp_root) as manager, caplog.at_level(logging.INFO, logger="resilient_ckpt"):
        hook = CheckpointHook(manager, 5, state=state)
        assert hook.restore() == 0
    # Never silent: a start from step 0 is a WARNING that says why.
    assert any(
        r.levelname == "WARNING"
        and "no local checkpoint of session 'hooks' to restore" in r.getMessage()
        and "starting at step 0" in r.getMessage()
        for r in caplog.records
    )
    assert hook.restored_from is None and hook.restored_state is None
    assert _same(_params(state), before), "a fresh start leaves the model alone"


def test_restore_without_a_local_checkpoint_calls_the_fallback_loader_and_logs_it(tmp_root, caplog):
    calls = []

    def load_from_parallel_fs():
        calls.append(1)
        return 1200

    with _manager(tmp_root) as manager, caplog.at_level(logging.INFO, logger="resilient_ckpt"):
        hook = CheckpointHook(manager, 5, state=_state(), fallback_loader=load_from_parallel_fs)
        assert hook.restore() == 1200
    assert calls == [1]
    assert any(
        r.levelname == "WARNING"
        and "no local checkpoint of session 'hooks' to restore" in r.getMessage()
        and "using the caller's loader" in r.getMessage()
        for r in caplog.records
    )
    with _manager(tmp_root) as manager:
        assert CheckpointHook(manager, 5, state=_state(), fallback_loader=lambda: None).restore() == 0


def test_restore_returns_the_step_after_the_newest_checkpoint_and_applies_it(tmp_root):
    state = _state()
    manager = _manager(tmp_root)
    hook = CheckpointHook(manager, every_n_steps=4, state=state)
    for step in range(10):
        _train_step(state)
        hook.step(step)
        if step == 7:
            at_7 = (
                _params(state),
                state.optimizer.state_dict()["state"][0]["exp_avg"].clone(),
                state.lr_scheduler.state_dict(),
                dict(state.extra),
            )
    hook.close()
    manager.close()

    fresh = _state(seed=3)
    fallback_calls = []
    with _manager(tmp_root) as again:
        hook = CheckpointHook(again, 4, state=fresh, fallback_loader=lambda: fallback_calls.append(1))
        assert hook.restore() == 8
        assert fallback_calls == [], "a local checkpoint exists: no fallback"
        assert hook.restored_from["iteration"] == 7 and hook.restored_from["source"] == "local"
        params, exp_avg, sched, extra = at_7
        assert _same(_params(fresh), params)
        assert torch.equal(fresh.optimizer.state_dict()["state"][0]["exp_avg"], exp_avg)
        assert fresh.lr_scheduler.state_dict() == sched
        assert fresh.extra == extra == {"data_position": 8}
        # Training goes on from step 8 and keeps saving on the same schedule.
        for step in range(8, 12):
            _train_step(fresh)
            hook.step(step)
        hook.close()
        assert hook.saved_steps == [11]
        assert _published(again)[-1] == 11


def test_restore_with_state_fn_leaves_the_state_dict_to_the_caller(tmp_root):
    w = torch.arange(12.0).reshape(3, 4)

    def ssd(data):
        return {"w": ShardedTensor.from_rank_offsets("w", data), "step_note": "hello"}

    with _manager(tmp_root) as manager:
        hook = CheckpointHook(manager, 2, state_fn=lambda: ssd(w))
        hook.step(0)
        hook.step(1)
        hook.close()
    with _manager(tmp_root) as manager:
        hook = CheckpointHook(manager, 2, state_fn=lambda: ssd(w))
        assert hook.restore(ssd(torch.empty(3, 4))) == 2
        assert torch.equal(hook.restored_state["w"], w) and hook.restored_state["step_note"] == "hello"


def test_unrestorable_local_checkpoint_falls_back_when_a_loader_is_given_else_raises(tmp_root, caplog):
    state = _state()
    with _manager(tmp_root) as manager:
        hook = CheckpointHook(manager, 1, state=state)
        _train_step(state)
        hook.step(0)
        hook.close()
        (cid,) = manager.store.list()
        layout = manager.store.read_header(cid).tensors[0]
        with open(manager.store.data_path(cid), "r+b") as f:  # bit rot in the only copy
            f.seek(layout.offset)
            byte = f.read(1)
            f.seek(layout.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
    with _manager(tmp_root) as manager:
        with pytest.raises(CheckpointingException):
            CheckpointHook(manager, 1, state=_state()).restore()
    with _manager(tmp_root) as manager, caplog.at_level(logging.WARNING, logger="resilient_ckpt"):
        assert CheckpointHook(manager, 1, state=_state(), fallback_loader=lambda: 42).restore() == 42
    assert "could not be restored" in caplog.text and "falling back to the caller's loader" in caplog.text
