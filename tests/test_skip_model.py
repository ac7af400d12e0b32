"""Every rank decides alike whether a due save is skipped (issue 41), whatever is in flight and
whatever fails.

Model-based (hypothesis stateful testing) over real processes: 3 gloo ranks, each its own
simulated node (a store root each), replicas (factor 2), one ``CheckpointManager`` per rank
kept across the steps of an example. Random sequences of:

* saves with ``skip_if_busy`` or queued (the default), of a state that differs every step; the
  skip-if-busy saves voting on the calling thread, or (the second run) in the background
  (``vote_in_background``: a rank idle itself starts its copies and returns a handle, which
  says whether the vote then dropped the save on every rank);
* a save held in flight on a random rank until a later step releases it — one save may queue
  behind it, as the manager allows: held before the agreement (in flight on every rank: the
  others wait in the agreement), or after it (in flight on that rank only: the others have
  completed it);
* a state function raising on a random rank;
* ``find_latest``.

The oracle is a little model of the rule: a save with ``skip_if_busy`` is skipped on every rank
iff a save is in flight (held); a save whose state function raised fails on every rank; any
other save starts, and completes once nothing holds it. After every step: every rank reached
the same outcome within the time bound, ``saves_skipped`` is the oracle's count on every rank,
``find_latest`` names the newest completed save, and the job's own process group still pairs up.
"""

from __future__ import annotations

import os
import random
import threading
import uuid
from pathlib import Path
from typing import Any, List, Optional

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from commanded_job import CommandedJob

pytestmark = [pytest.mark.multiprocess]

EXAMPLES = int(os.environ.get("RC_SKIP_EXAMPLES", "4"))
STEPS = int(os.environ.get("RC_SKIP_STEPS", "20"))
WS = 3
#: a held save keeps its peers in the agreement: far longer than any hold here lasts
TIMEOUT_S = 30.0
#: a step answers within this (saves of a few KiB; a failed one renews the groups next call)
STEP_BOUND_S = 20.0
#: release a held save after this many steps at most
MAX_HELD_STEPS = 4
#: where a save is held: before the agreement (every rank's save stays in flight), or after the
#: last collective of the save (only the held rank's does)
HOLD_POINTS = ("before_agreement", "after_confirmation")


# ---- inside a rank ---------------------------------------------------------------------------


def _state(rank: int, iteration: int):
    import torch

    from resilient_ckpt import ShardedTensor

    g = torch.Generator().manual_seed(7919 * rank + iteration)
    return {
        "u": ShardedTensor.from_rank_offsets("u", torch.randn(512, generator=g), (0, rank, WS)),
        "w": ShardedTensor.from_rank_offsets("w", torch.full((16, 8), float(iteration)), replica_id=rank),
        "step": iteration,
    }


class _Rank:
    """One rank's side (a job per example): its manager, a save it can hold in flight."""

    def __init__(self, rank: int, root: str):
        from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

        self.hold_next: Optional[str] = None  # the fault point where the next save is held
        self.release_event = threading.Event()
        self.rank = rank
        self.m = CheckpointManager(
            "skip",
            store_root=str(Path(root) / f"node{rank}"),
            replication_factor=2,
            timeout_s=TIMEOUT_S,
            fault_hook=self._hook,
        )

    def _hook(self, point: str) -> None:
        if point == self.hold_next:
            self.hold_next = None
            assert self.release_event.wait(timeout=120), "the model never released the held save"

    def save(
        self, iteration: int, skip: bool, hold: Optional[str], fail: bool, wait: bool, background: bool
    ) -> Any:
        if hold:  # (never cleared here: the held save may not have reached its hook yet)
            self.hold_next = hold

        def build():
            if fail:
                raise RuntimeError(f"state function failed on purpose at {iteration}")
            return _state(self.rank, iteration)

        try:
            handle = self.m.save_local(
                build, iteration, skip_if_busy=skip, vote_in_background=skip and background
            )
            if handle is not None and handle.skipped():  # dropped on every rank by the vote
                handle.wait()  # (its copies ended: the next step starts idle)
                handle = None
            if handle is not None and wait:
                handle.wait()
        except Exception as e:
            self.m.wait_for_saves()  # its stand-in job votes no; the next step starts idle
            return ["failed", type(e).__name__, self.m.saves_skipped]
        if handle is None:
            return ["skipped", self.m.saves_skipped]
        return ["complete" if wait else "started", self.m.saves_skipped]

    def release(self) -> Any:
        self.release_event.set()
        self.m.wait_for_saves()
        self.release_event.clear()
        return ["released"]

    def find(self) -> Any:
        return ["latest", self.m.find_latest()]

    def close(self) -> None:
        self.m.close()


# ---- the model -----------------------------------------------------------------------------------


class SkipMachine(RuleBasedStateMachine):
    root: Path
    #: skip-if-busy saves vote in the background (``vote_in_background``)
    background: bool = False

    @initialize()
    def start(self):
        # A job per example: a failing example is replayed on fresh processes, not on ranks
        # the failure left hung.
        self.failed = False
        self.job = CommandedJob(WS, 1, _Rank, (str(self.root / uuid.uuid4().hex[:8]),))
        self.job.start()  # every rank's manager made
        self.iteration = 0
        self.held_steps: Optional[int] = None  # steps since a save was held; None: none held
        self.pending: List[int] = []  # started, complete once released
        self.complete: List[int] = []
        self.skipped = 0
        self.steps = 0

    def _same(self, got, what: str) -> list:
        outcomes = {r: o[0] for r, o in got.items()}
        kinds = {o[0] for o in outcomes.values()}
        assert len(kinds) == 1, f"{what}: ranks decided differently: {outcomes}"
        for r, (outcome, seconds, _, world) in got.items():
            assert seconds < STEP_BOUND_S, f"{what}: rank {r} took {seconds:.1f}s: {outcome}"
            assert world, f"{what}: the job's own all-reduce failed on rank {r}"
        return outcomes[0]

    @rule(seed=st.integers(0, 2**32 - 1))
    def step(self, seed):
        try:
            self._step(seed)
        except BaseException:
            self.failed = True
            raise

    def _step(self, seed):
        self.steps += 1
        rng = random.Random(f"{seed}/{self.steps}")
        held = self.held_steps is not None
        if held:
            self.held_steps += 1
        pick = rng.random()
        if held and (self.held_steps >= MAX_HELD_STEPS or pick < 0.25):
            return self._release()
        if not held and pick < 0.15:
            return self._find()
        skip = rng.random() < 0.7 or (held and len(self.pending) >= 2)  # a third would wait
        hold = None if held or rng.random() < 0.6 else rng.randrange(WS)
        point = rng.choice(HOLD_POINTS)
        fail = None if held or hold is not None or rng.random() < 0.7 else rng.randrange(WS)
        self._save(skip, hold, point, fail)

    def _save(self, skip: bool, hold: Optional[int], point: str, fail: Optional[int]):
        self.iteration += 1
        it, held = self.iteration, self.held_steps is not None
        wait = not held and hold is None
        got = self.job.step(
            "save",
            lambda r: (it, skip, point if r == hold else None, r == fail, wait, self.background),
            range(WS),
            check_world=True,
            wait_s=STEP_BOUND_S + 30,
        )
        what = (
            f"save {it} (skip_if_busy={skip}, held={held}, hold on {hold} {point}, fail on {fail}, "
            f"background={self.background})"
        )
        outcome = self._same(got, what)
        if skip and held:
            self.skipped += 1
            expected = "skipped"
        elif fail is not None:
            expected = "failed"
        elif held or hold is not None:
            expected = "started"
            self.pending.append(it)
            if hold is not None:
                self.held_steps = 0
        else:
            expected = "complete"
            self.complete.append(it)
        if os.environ.get("RC_SKIP_VERBOSE"):
            print(f"{what}: {outcome}", flush=True)
        assert outcome[0] == expected, f"{what}: expected {expected}, got {got}"
        for r, o in got.items():
            assert o[0][-1] == self.skipped, f"{what}: rank {r} counted {o[0][-1]} skips, not {self.skipped}"

    def _release(self):
        got = self.job.step("release", lambda r: (), range(WS), check_world=True, wait_s=STEP_BOUND_S + 30)
        self._same(got, "release")
        self.complete.extend(self.pending)
        self.pending, self.held_steps = [], None

    def _find(self):
        got = self.job.step("find", lambda r: (), range(WS), check_world=True, wait_s=STEP_BOUND_S + 30)
        self._same(got, "find_latest")
        newest = self.complete[-1] if self.complete else -1
        for r, (outcome, *_rest) in got.items():
            assert outcome == ["latest", newest], f"find_latest on rank {r}: {outcome}, expected {newest}"

    def teardown(self):
        job = getattr(self, "job", None)
        if job is None:
            return
        try:
            if not self.failed:
                if self.held_steps is not None:
                    self._release()
                job.close()
        finally:
            job.kill()


@pytest.mark.parametrize("background", [False, True], ids=["vote_on_calling_thread", "vote_in_background"])
def test_every_rank_decides_alike_whether_a_save_is_skipped(tmp_path, background):
    SkipMachine.root = tmp_path
    SkipMachine.background = background
    run_state_machine_as_test(
        SkipMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            derandomize=os.environ.get("RC_SKIP_RANDOM") is None,
            phases=[Phase.generate],
            suppress_health_check=list(HealthCheck),
        ),
    )
