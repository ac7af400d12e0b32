"""A checkpoint every step that never makes the step wait (``CheckpointHook(when_busy="skip")``).

A due save whose predecessor is still copying, replicating or agreeing on *any* rank is skipped
on every rank — the ranks vote in the save's one structure all-reduce — and the next step saves
instead. Specified here: the training loop runs on while a save is held in flight (a held save
never blocks a step), every rank skips and saves at the same steps, every started save
completes, the achieved interval and the steps at risk are reported (``hook.metrics``, the
Prometheus gauges), and ``when_busy="queue"`` (the default) keeps the old schedule.
"""

from __future__ import annotations

import threading

import pytest
import torch
from prometheus_client import CollectorRegistry

from harness import run_ranks
from resilient_ckpt import CheckpointHook, CheckpointManager, TrainState
from resilient_ckpt.errors import ValidationError


def _state(seed: int = 0) -> TrainState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    return TrainState(model, opt, extra={"data_position": 0})


def _train_step(state: TrainState) -> None:
    g = torch.Generator().manual_seed(state.extra["data_position"])
    state.optimizer.zero_grad()
    state.model(torch.randn(4, 8, generator=g)).pow(2).mean().backward()
    state.optimizer.step()
    state.extra["data_position"] += 1


class _Hold:
    """Holds this process's save thread before the agreement until ``release`` is set."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.held = threading.Event()

    def __call__(self, point: str) -> None:
        if point == "before_agreement" and not self.release.is_set():
            self.held.set()
            assert self.release.wait(timeout=60), "the test never released the held save"


def test_a_due_save_is_skipped_while_the_last_one_is_in_flight(tmp_root):
    hold = _Hold()
    state = _state()
    with CheckpointManager("skip", store_root=str(tmp_root), replication_factor=1, fault_hook=hold) as m:
        hook = CheckpointHook(m, every_n_steps=1, state=state, when_busy="skip")
        registry = CollectorRegistry()
        hook.register_prometheus(registry)
        for step in range(4):
            _train_step(state)
            h = hook.step(step)
            assert (h is not None) == (step == 0), step  # save 0 is held: 1-3 are skipped
        assert hook.skipped_saves == 3 and m.saves_skipped == 3
        assert hook.metrics.last_complete_step == -1 and hook.metrics.steps_at_risk == 4
        assert registry.get_sample_value("resilient_ckpt_saves_skipped") == 3.0
        hold.release.set()
        hook.finish()  # save 0 completes
        _train_step(state)
        assert hook.step(4) is not None  # idle again: the next due step saves
        hook.finish()
        metrics = hook.metrics
        assert hook.saved_steps == [0, 4] and metrics.interval_steps == 4.0
        assert metrics.last_complete_step == 4 and metrics.steps_at_risk == 0
        assert registry.get_sample_value("resilient_ckpt_checkpoint_interval_steps") == 4.0
        assert registry.get_sample_value("resilient_ckpt_last_complete_step") == 4.0
        assert sorted({c.iteration for c in m.store.list()}) == [4]  # keep_last=1
        hook.close()


def test_every_n_steps_counts_from_the_last_save_started_when_skipping(tmp_root):
    hold = _Hold()
    state = _state()
    with CheckpointManager("skipn", store_root=str(tmp_root), replication_factor=1, fault_hook=hold) as m:
        hook = CheckpointHook(m, every_n_steps=3, state=state, when_busy="skip")
        saved = []
        for step in range(12):
            _train_step(state)
            if hook.step(step) is not None:
                saved.append(step)
            if step == 6:
                hold.release.set()
            if step >= 6:
                hook.finish()  # from here on every save completes before the next step
        hook.close()
        # 2 saves (held); 5 and 6 skipped; 7 saves (released), then every 3rd step: 10
        assert saved == [2, 7, 10] and hook.skipped_saves == 2


def test_when_busy_must_be_queue_or_skip(tmp_root):
    with CheckpointManager("bad", store_root=str(tmp_root), replication_factor=1) as m:
        with pytest.raises(ValidationError, match="when_busy must be 'queue'"):
            CheckpointHook(m, every_n_steps=1, state=_state(), when_busy="drop")


def _rank_skips_together(ctx, steps: int, held_until: int):
    """Every rank trains ``steps`` steps with a save due at each; rank 1 holds its first save
    before the agreement (so every rank's save 0 stays in flight) until after step
    ``held_until``. Returns what each rank's hook did."""
    import torch.distributed as dist

    hold = _Hold()
    state = _state(seed=ctx.rank)
    with CheckpointManager(
        "skip3",
        store_root=ctx.store_root,
        replication_factor=2,
        fault_hook=hold if ctx.rank == 1 else None,
    ) as m:
        hook = CheckpointHook(m, every_n_steps=1, state=state, when_busy="skip")
        started = []
        for step in range(steps):
            _train_step(state)
            if hook.step(step) is not None:
                started.append(step)
            if step == held_until and ctx.rank == 1:
                assert hold.held.wait(timeout=60), "save 0 never reached its agreement"
                hold.release.set()
            if step == held_until:
                # Every rank waits here for save 0 to end: that the next step saves must not
                # depend on how fast this machine completes it (the job also makes the next
                # save's segment ready: a loaded machine took longer than the steps left).
                hook.finish()
        hook.finish()
        held_steps_ran = hold.held.is_set()
        metrics = hook.metrics.as_dict()
        latest = m.find_latest()
        hook.close()
    # The job's own process group still works after the skipped saves.
    t = torch.ones(1)
    dist.all_reduce(t)
    return dict(
        started=started,
        skipped=hook.skipped_saves,
        failed=hook.failed_saves,
        metrics=metrics,
        latest=latest,
        held=held_steps_ran,
        group_sum=float(t.item()),
    )


def test_every_rank_skips_and_saves_at_the_same_steps(tmp_root):
    steps, held_until = 14, 5
    results = run_ranks(_rank_skips_together, 3, tmp_root, ranks_per_node=1, args=(steps, held_until))
    first = results[0]
    for r in results:
        assert r["started"] == first["started"] and r["skipped"] == first["skipped"], results
        assert r["failed"] == 0 and r["group_sum"] == 3.0
    started = first["started"]
    # save 0 was in flight on every rank (held on rank 1) through step 5: 1..5 skipped alike
    assert started[0] == 0 and started[1] > held_until, started
    assert first["skipped"] == steps - len(started) >= held_until
    assert first["latest"] == started[-1]  # every started save completed; the newest is loadable
    assert results[1]["held"]
    m = first["metrics"]
    assert m["saves_started"] == len(started) and m["saves_skipped"] == first["skipped"]
    assert m["interval_steps"] == pytest.approx((started[-1] - started[0]) / (len(started) - 1))
    assert m["last_complete_step"] == started[-1] and m["steps_at_risk"] == steps - 1 - started[-1]


def test_a_long_run_of_saves_keeps_nothing_per_save(tmp_root):
    """Saving every step for many steps holds what one save needs, not what every save left:
    finished saves leave the in-flight queue even when no save ever waits for them (skip
    mode), and a retired checkpoint's parsed header (megabytes at 50k tensors) leaves the
    store's header cache (keep_last=1: the trainer's memory stayed flat only up to 64 of them)."""
    state = _state()
    with CheckpointManager("long", store_root=str(tmp_root), replication_factor=1, keep_last=1) as m:
        hook = CheckpointHook(m, every_n_steps=1, state=state, when_busy="skip")
        for step in range(80):
            _train_step(state)
            hook.step(step)
            if step % 2:
                hook.finish()  # half the saves complete before the next step, half not
        hook.finish()
        assert len(m._in_flight) <= 1
        m.find_latest()  # reads (and caches) the newest header
        assert len(m.store._parsed) <= 2, sorted(p.name for p in m.store._parsed)
        assert len(hook.saved_steps) > 40
        hook.close()
