"""Every rank decides alike whatever fails, and the job's next call works (issue 30).

Model-based (hypothesis stateful testing) over real processes: 4 gloo ranks on 2 simulated
nodes (a store root each), one ``CheckpointManager`` per rank kept across steps, replicas
(factor 2) or parity. Random sequences of saves, restores, ``find_latest`` calls and job
restarts, with faults injected on a random rank at a random point:

* a state function raising; an object the codec refuses (a lock); a tensor on the meta device;
* one node's store full (its ranks run with a memory budget that a large save exceeds);
* a rank SIGKILLed or SIGSTOPped at a random point of a save (after staging, after publishing,
  before or after replication, before the agreement: mid-replication included);
* a rank frozen (SIGSTOP) during a restore;
* a restart of the whole job (every rank SIGKILLed and started again, as torchrun does), with
  or without one node's store wiped (the node replaced).

The oracle is a list of the iterations agreed complete. After every step: every live rank
reached the same outcome, each within 2 x ``timeout_s``; a save without a fault completes; a
restore (or the restore that follows a restart) returns the newest complete iteration,
bit-exactly; the job's own process group still pairs up; the count of process groups is what it
was after the generation's first step and the thread count does not grow past its first
plateau. A killed or frozen rank ends the job: the next step is a restart.

CI runs 4 examples of 8 steps per configuration (about a minute in all); ``RC_FAULT_EXAMPLES`` / ``RC_FAULT_STEPS`` run longer
searches (the closing note of issue 30 has the long run).
"""

from __future__ import annotations

import os
import random
import shutil
import signal
import threading
import uuid
from pathlib import Path
from typing import Any, List, Optional

import pytest
from hypothesis import HealthCheck, Phase, Verbosity, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

from commanded_job import CommandedJob

pytestmark = [pytest.mark.multiprocess]

EXAMPLES = int(os.environ.get("RC_FAULT_EXAMPLES", "4"))
STEPS = int(os.environ.get("RC_FAULT_STEPS", "8"))
#: RC_FAULT_SHRINK=0: report the first failing sequence as found (shrinking re-runs it a lot)
SHRINK = os.environ.get("RC_FAULT_SHRINK", "0") != "0"

WS, RPN = 4, 2
TIMEOUT_S = 3.0
#: within this of 2 x timeout_s every live rank has answered (process scheduling on 2 cores)
SLACK_S = 1.0
SMALL = 2048  # floats per rank of an ordinary save
LARGE = 3 << 20  # floats per rank of a save node 1's budget cannot hold (12 MiB)
BUDGET = 6 << 20  # node 1's store budget: many small saves, no large one

CONFIGS = {
    "replicas": dict(replication_factor=2),
    "parity": dict(redundancy="parity", parity_group=1, parity_shares=1),
}
SAVE_FAULTS = ("raise", "codec", "meta", "store_full", "kill", "stop")
POINTS = ("after_staging", "after_publish", "before_replication", "after_replication", "before_agreement")


# ---- inside a rank ---------------------------------------------------------------------------


def _state(rank: int, iteration: int, n: int = SMALL, fault: Optional[str] = None):
    import torch

    from resilient_ckpt import ShardedTensor

    g = torch.Generator().manual_seed(7919 * rank + iteration)
    u = torch.randn(n, generator=g)
    w = torch.randn(32, 16, generator=torch.Generator().manual_seed(iteration))
    if fault == "meta":
        u = torch.empty(n, device="meta")
    return {
        "u": ShardedTensor.from_rank_offsets("u", u, (0, rank, WS)),
        "w": ShardedTensor.from_rank_offsets("w", w, replica_id=rank),
        "step": iteration,
        "extra": threading.Lock() if fault == "codec" else {"iteration": iteration},
    }


def _exact(state, rank: int, iteration: int, n: int) -> bool:
    import torch

    ref = _state(rank, iteration, n)
    return (
        torch.equal(state["u"], ref["u"].data)
        and torch.equal(state["w"], ref["w"].data)
        and state["step"] == iteration
        and state["extra"] == {"iteration": iteration}
    )


def _template(rank: int, n: int):
    import torch

    sd = _state(rank, 0, n)
    sd["u"].data = torch.zeros_like(sd["u"].data)
    sd["w"].data = torch.zeros_like(sd["w"].data)
    return sd


class _Rank:
    """One rank's side: a manager kept across the steps of one generation of the job."""

    def __init__(self, rank: int, root: str, config: str):
        from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

        self.rank, self.node = rank, rank // RPN
        self.armed: Optional[tuple] = None
        kw = dict(CONFIGS[config])
        if self.node == 1:
            kw["memory_budget"] = BUDGET
        self.m = CheckpointManager(
            "faults",
            store_root=str(Path(root) / f"node{self.node}"),
            timeout_s=TIMEOUT_S,
            fault_hook=self._hook,
            **kw,
        )

    def _hook(self, point: str) -> None:
        if self.armed is not None and self.armed[0] == point:
            os.kill(os.getpid(), self.armed[1])
            # A signal sent to the own process is taken by whichever thread the kernel picks
            # (often the main thread), and this one runs on until the stop reaches it: long
            # enough to enter the agreement's all-reduce and send its vote. The fault is "this
            # rank stops here", so this thread waits for the signal instead of running on.
            threading.Event().wait()

    def save(self, iteration: int, n: int, fault: Optional[str], point: Optional[str]) -> Any:
        if fault in ("kill", "stop"):
            self.armed = (point, signal.SIGKILL if fault == "kill" else signal.SIGSTOP)

        def build():
            if fault == "raise":
                raise RuntimeError(f"state function failed on purpose at {iteration}")
            return _state(self.rank, iteration, n, fault)

        self.m.save_local(build, iteration).wait()
        return ["complete", iteration]

    def restore(self, n: int, freeze: bool) -> Any:
        if freeze:
            os.kill(os.getpid(), signal.SIGSTOP)
        res = self.m.load_local(_template(self.rank, n))
        if res is None:
            return ["none"]
        state, it = res
        self.m.wait_healed(timeout=4 * TIMEOUT_S)
        return ["restored", it, _exact(state, self.rank, it, n)]

    def find(self) -> Any:
        return ["latest", self.m.find_latest()]

    def close(self) -> None:
        self.m.close()


# ---- the job, driven from the test process ---------------------------------------------------


def _job(root: Path, config: str) -> CommandedJob:
    """4 rank processes (one generation of the job); restart = all SIGKILLed, started again."""
    return CommandedJob(WS, RPN, _Rank, (str(root), config))


class FaultMachine(RuleBasedStateMachine):
    root: Path
    config: str

    examples = 0  # started so far in this test (RC_FAULT_VERBOSE prints the count)

    @initialize()
    def start(self):
        FaultMachine.examples += 1
        if os.environ.get("RC_FAULT_VERBOSE"):
            print(f"=== example {FaultMachine.examples} ({self.config})", flush=True)
        self.dir = self.root / uuid.uuid4().hex[:8]
        self.job = _job(self.dir, self.config)
        self.job.start()
        self.complete: List[int] = []  # iterations agreed complete, oldest first
        self.iteration = 0
        self.dead = False  # a rank was killed or froze: only a restart follows
        self.pgs: Optional[int] = None  # process groups after the generation's first step
        self.threads: Optional[int] = None
        self.steps = 0

    def teardown(self):
        job = getattr(self, "job", None)
        if job is not None:
            job.close()
        shutil.rmtree(getattr(self, "dir", ""), ignore_errors=True)

    # -- oracle helpers --

    def _say(self, got, what: str) -> None:
        if os.environ.get("RC_FAULT_VERBOSE"):
            brief = {r: (o[0][:2], round(o[1], 2)) for r, o in sorted(got.items())}
            print(f"[gen {self.job.generation}] {what}: {brief}", flush=True)

    def _same_outcome(self, got, what: str) -> str:
        kinds = {r: o[0][0] for r, o in got.items()}
        assert len(set(kinds.values())) == 1, f"{what}: ranks disagree: {got}"
        for r, (outcome, seconds, _, world) in got.items():
            assert seconds < 2 * TIMEOUT_S + SLACK_S, f"{what}: rank {r} took {seconds:.1f}s: {outcome}"
            assert world, f"{what}: the job's own all-reduce failed on rank {r}"
        return next(iter(kinds.values()))

    def _resources(self, got) -> None:
        """Process groups never grow; threads reach a plateau and stay there."""
        threads = max(o[2][0] for o in got.values())
        pgs = {o[2][1] for o in got.values()}
        assert len(pgs) == 1, f"ranks hold different numbers of process groups: {got}"
        pg = pgs.pop()
        if self.pgs is None:
            self.pgs, self.threads = pg, threads
        assert pg == self.pgs, f"process groups grew from {self.pgs} to {pg}"
        # Thread pools are made on first use (readers, coding): a plateau, never a climb.
        self.threads = max(self.threads, threads) if self.threads < 40 else self.threads
        assert threads <= self.threads, f"threads grew from {self.threads} to {threads}"

    def _expect_restore(self, got, what: str) -> None:
        kind = self._same_outcome(got, what)
        if not self.complete:
            assert kind == "none", f"{what}: nothing complete, yet {got}"
            return
        newest = self.complete[-1]
        for r, (outcome, *_rest) in got.items():
            assert outcome == ["restored", newest, True], (
                f"{what}: rank {r} {outcome}, expected iteration {newest} exact"
            )

    # -- the steps --
    #
    # One rule that draws its step from a seed: hypothesis's first examples are its simplest
    # (every rule with its smallest arguments), which for this machine would be sequences of
    # find_latest; a seeded mix puts saves, faults and restarts into every example, and a
    # failing sequence is still reported (and replayed) as its list of seeds.

    @rule(seed=st.integers(0, 2**32 - 1))
    def step(self, seed):
        # Keyed by the step's position too: hypothesis draws small seeds (0 above all) often,
        # and a repeated seed must not repeat the same step all through an example.
        self.steps += 1
        rng = random.Random(f"{seed}/{self.steps}")
        if self.dead:  # a rank was killed or froze: the job restarts, as under torchrun
            return self._restart(rng.choice((None, None, 0, 1)))
        pick = rng.random()
        if pick < 0.55:
            fault = rng.choice(SAVE_FAULTS) if rng.random() < 0.5 else None
            self._save(fault, rng.randrange(WS), rng.choice(POINTS))
        elif pick < 0.72:
            self._restore(rng.random() < 0.3, rng.randrange(WS))
        elif pick < 0.82:
            self._find_latest()
        else:
            self._restart(rng.choice((None, None, 0, 1)))

    def _save(self, fault, culprit, point):
        self.iteration += 10
        it = self.iteration
        if fault == "store_full":
            culprit = 2  # node 1 has the budget
        n = LARGE if fault == "store_full" else SMALL

        def args_of(r):
            mine = fault if (r == culprit and fault != "store_full") else None
            return (it, n, mine, point)

        fatal = fault in ("kill", "stop")
        live = [r for r in range(WS) if not (fatal and r == culprit)]
        got = self.job.step("save", args_of, live, check_world=not fatal, wait_s=2 * TIMEOUT_S + 20)
        what = f"save {it} ({fault} on rank {culprit} at {point})"
        self._say(got, what)
        kind = self._same_outcome(got, what)
        if fault is None:
            assert kind == "complete", f"{what}: {got}"
            self.complete.append(it)
        else:
            assert kind == "failed", f"{what}: {got}"
        if fatal:
            self.job.stopped_or_dead(culprit)
            self.dead = True
        else:
            self._resources(got)

    def _restore(self, freeze, culprit):
        live = [r for r in range(WS) if not (freeze and r == culprit)]
        got = self.job.step(
            "restore",
            lambda r: (SMALL, freeze and r == culprit),
            live,
            check_world=not freeze,
            wait_s=6 * TIMEOUT_S + 20,
        )
        self._say(got, f"restore (rank {culprit} frozen: {freeze})")
        if freeze:
            kind = self._same_outcome(got, f"restore with rank {culprit} frozen")
            assert kind == "failed", got
            self.job.stopped_or_dead(culprit)
            self.dead = True
            return
        self._expect_restore(got, "restore")
        self._resources(got)

    def _find_latest(self):
        got = self.job.step("find", lambda r: (), range(WS), check_world=True, wait_s=2 * TIMEOUT_S + 20)
        self._say(got, "find_latest")
        self._same_outcome(got, "find_latest")
        newest = self.complete[-1] if self.complete else -1
        for r, (outcome, *_rest) in got.items():
            assert outcome == ["latest", newest], f"find_latest on rank {r}: {outcome}, expected {newest}"
        self._resources(got)

    def _restart(self, wipe):
        """The whole job restarts (torchrun): every rank SIGKILLed, optionally one node
        replaced (its store wiped), every rank restores before anything else."""
        self.job.kill()
        if wipe is not None:
            shutil.rmtree(self.dir / f"node{wipe}", ignore_errors=True)
        self.job.start()
        self.dead = False
        self.pgs = self.threads = None
        got = self.job.step(
            "restore", lambda r: (SMALL, False), range(WS), check_world=True, wait_s=6 * TIMEOUT_S + 30
        )
        self._say(got, f"restart, node {wipe} wiped, restore")
        self._expect_restore(got, f"restore after a restart (node {wipe} wiped)")


@pytest.mark.timeout(max(600, 60 * EXAMPLES * STEPS))
@pytest.mark.parametrize("config", sorted(CONFIGS))
def test_every_rank_reaches_the_same_outcome_whatever_fails_and_the_next_call_works(tmp_path, config):
    FaultMachine.root = tmp_path
    FaultMachine.config = config
    FaultMachine.examples = 0
    run_state_machine_as_test(
        FaultMachine,
        settings=settings(
            max_examples=EXAMPLES,
            stateful_step_count=STEPS,
            deadline=None,
            database=None,
            suppress_health_check=list(HealthCheck),
            phases=[Phase.generate, Phase.shrink] if SHRINK else [Phase.generate],
            print_blob=True,
            verbosity=Verbosity.verbose if os.environ.get("RC_FAULT_VERBOSE") else Verbosity.normal,
        ),
    )
