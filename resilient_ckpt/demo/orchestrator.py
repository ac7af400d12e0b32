"""``resilient-ckpt demo``: lose a node mid-training, restore from neighbours, prove bit-exactness.

Runs on one machine: N simulated nodes × R ranks per node, each node with its own store root
(its "host memory"). Three launches of real worker processes (gloo on 127.0.0.1):

1. the reference: an uninterrupted run with the same seed;
2. the faulty run: ranks of the victim pause right after a chosen step, then the orchestrator
   kills them with SIGKILL and (for a node failure) deletes that node's store, like a machine
   lost with its memory; the surviving ranks are stopped as torchrun would stop them;
3. the restart: all ranks relaunched (the victim's node comes back empty), they restore the
   newest complete iteration — the victim's ranks from replicas on other nodes — and finish.

Then the loss curves and final parameters of (2)+(3) are compared with (1), bit for bit, a
timeline is printed and both curves are plotted to a PNG.

``--no-replacement`` (or ``--restart-nodes K``): the job comes back on another number of nodes
— one fewer, or more (a grow) — and resumes straight from the survivors' memory, resharded.
An uninterrupted run cannot be compared across world sizes (each rank's batches and the
gradient average change with the world), so the restart is compared with (1') a second,
uninterrupted job of the new size started from the same checkpoint (a copy of the surviving
stores taken right after the failure): their losses after the checkpoint and final
parameters must be identical bit for bit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from ..ports import free_port


@dataclass
class Launch:
    """One launch of the whole job: its processes and the events they print."""

    name: str
    procs: list = field(default_factory=list)
    controls: list = field(default_factory=list)
    events: List[dict] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)
    started: float = 0.0
    ended: float = 0.0

    def wait_for(self, pred, timeout: float) -> bool:
        deadline = time.time() + timeout
        with self.cond:
            while not pred(self.events):
                left = deadline - time.time()
                if left <= 0 or all(not p.is_alive() for p in self.procs):
                    return pred(self.events)
                self.cond.wait(min(left, 0.5))
            return True


class Demo:
    def __init__(self, args):
        self.args = args
        self.world = args.nodes * args.ranks_per_node
        self.restart_nodes = args.restart_nodes or (args.nodes - 1 if args.no_replacement else args.nodes)
        # Always a fresh directory of our own, also inside --workdir: it is removed at the end.
        parent = args.workdir or _shm_or_tmp()
        os.makedirs(parent, exist_ok=True)
        self.base = Path(tempfile.mkdtemp(prefix="resilient_ckpt_demo_", dir=parent))
        self.timeline: List[tuple] = []
        self.t0 = time.time()
        self.daemons = None

    def log(self, what: str) -> None:
        t = time.time() - self.t0
        self.timeline.append((t, what))
        print(f"[{t:6.2f}s] {what}", flush=True)

    def node_root(self, run: str, node: int) -> Path:
        return self.base / run / f"node{node}"

    # ---- launching -------------------------------------------------------------------------------

    def launch(
        self,
        run: str,
        name: str,
        pause_at: int = -1,
        victims=(),
        nodes: Optional[int] = None,
        session: Optional[str] = None,
    ) -> Launch:
        """Start every rank as a real process, forked from a server that imported torch once
        (starting 4 fresh interpreters costs ~12 s of imports on 2 cores). ``nodes``: the
        launch's node count (default ``--nodes``)."""
        ctx = _mp_context()
        port = free_port()
        launch = Launch(name, started=time.time())
        events = ctx.Queue()
        launch.controls = []
        nodes = nodes or self.args.nodes
        world = nodes * self.args.ranks_per_node
        for rank in range(world):
            node = rank // self.args.ranks_per_node
            env = dict(
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
                RANK=str(rank),
                WORLD_SIZE=str(world),
                LOCAL_RANK=str(rank % self.args.ranks_per_node),
                LOCAL_WORLD_SIZE=str(self.args.ranks_per_node),
                GLOO_SOCKET_IFNAME="lo",
                OMP_NUM_THREADS="1",
            )
            # one flag and its value per line
            # fmt: off
            argv = [
                "--steps", str(self.args.steps),
                "--interval", str(self.args.interval),
                "--seed", str(self.args.seed),
                "--session", session or f"demo-{run}",
                "--store-root", str(self.node_root(run, node)),
                "--mode", self.args.mode,
                "--timeout", "20",
            ]
            # fmt: on
            if self.args.mode == "service":
                argv += ["--endpoint", self.daemons.endpoint(node, run)]
                env.update(self.daemons.env(run))
            if rank in victims and pause_at >= 0:
                argv += ["--pause-at", str(pause_at)]
            control = ctx.Queue()
            p = ctx.Process(target=_rank_main, args=(argv, env, events, control), name=f"demo-rank{rank}")
            p.start()
            launch.procs.append(p)
            launch.controls.append(control)
        threading.Thread(
            target=self._reader, args=(launch, events), daemon=True, name=f"demo-{name}-events"
        ).start()
        return launch

    @staticmethod
    def _reader(launch: Launch, events) -> None:
        while True:
            ev = events.get()
            if ev is None:
                return
            with launch.cond:
                launch.events.append(ev)
                launch.cond.notify_all()

    def finish(self, launch: Launch, timeout: float = 300) -> None:
        deadline = time.time() + timeout
        for p in launch.procs:
            p.join(max(0.0, deadline - time.time()))
            if p.is_alive():
                p.kill()
                p.join()
        launch.ended = time.time()
        bad = [(i, p.exitcode) for i, p in enumerate(launch.procs) if p.exitcode != 0]
        if bad:
            rank, rc = bad[0]
            errs = [e for e in launch.events if e.get("event") == "error" and e.get("rank") == rank]
            detail = errs[0]["traceback"] if errs else "(no traceback)"
            raise SystemExit(f"{launch.name}: rank {rank} exited with {rc}:\n{detail[-3000:]}")

    # ---- the three phases ----------------------------------------------------------------------------

    def run(self) -> int:
        """Run the three phases; node stores (tmpfs memory) are removed on every exit path."""
        try:
            return self._run()
        finally:
            if self.daemons is not None:
                self.daemons.stop()
            if not self.args.keep:
                shutil.rmtree(self.base, ignore_errors=True)

    def _run(self) -> int:
        a = self.args
        victims = self.victim_ranks()
        if self.restart_nodes != a.nodes:
            return self._run_resized(victims)
        self.log(
            f"demo: {a.nodes} nodes × {a.ranks_per_node} ranks, {a.steps} steps, save every "
            f"{a.interval}, failure: {a.failure} at step {a.fail_step} (ranks {victims}), mode {a.mode}"
        )
        if a.mode == "service":
            from .services import DemoDaemons

            self.daemons = DemoDaemons(self, a.nodes)
            self.daemons.start("faulty")

        ref = self._reference_run()
        ref_losses = _losses(ref.events)
        run1, t_fail = self._faulty_run(victims)
        run1_losses = _losses(run1.events)
        last_step = _failure_step(run1.events)
        run2, t_restart = self._restart(victims)
        restored = self._check_restores(run2, t_restart)
        resumed = _resumed_step(restored)
        restore_s = max(e["seconds"] for e in restored)
        combined = {s: l for s, l in run1_losses.items() if s < resumed}
        combined.update(_losses(run2.events))
        self.restores = [
            {k: e[k] for k in ("rank", "iteration", "source", "source_rank", "seconds")}
            for e in sorted(restored, key=lambda e: e["rank"])
        ]
        self.victims = victims
        return self.report(
            ref, ref_losses, run1, run2, combined, last_step, resumed, t_fail, t_restart, restore_s
        )

    def _run_resized(self, victims: List[int]) -> int:
        """The job comes back on ``restart_nodes`` nodes: restart (resharded from memory) vs an
        uninterrupted job of that size from the same checkpoint."""
        a = self.args
        m = self.restart_nodes * a.ranks_per_node
        self.log(
            f"demo: {a.nodes} nodes × {a.ranks_per_node} ranks, {a.steps} steps, save every {a.interval}, "
            f"failure: {a.failure} at step {a.fail_step} (ranks {victims}); the job comes back on "
            f"{self.restart_nodes} node(s) × {a.ranks_per_node} = {m} ranks, no replacement"
        )
        run1, t_fail = self._faulty_run(victims)
        last_step = _failure_step(run1.events)
        # the same checkpoint, for the comparison job: a copy of every surviving store now
        shutil.copytree(self.base / "faulty", self.base / "same-checkpoint")
        self.log(f"restarting on {m} ranks: restore resharded from the survivors' memory ...")
        t_restart = time.time()
        run2 = self.launch("faulty", "restart", nodes=self.restart_nodes)
        self.finish(run2)
        restored = self._check_restores(run2, t_restart, m)
        self.log(f"comparison: an uninterrupted {m}-rank job from the same checkpoint ...")
        ref = self.launch("same-checkpoint", "comparison", nodes=self.restart_nodes, session="demo-faulty")
        self.finish(ref)
        resumed = _resumed_step(restored)
        after = lambda evs: {s: v for s, v in _losses(evs).items() if s >= resumed}  # noqa: E731
        run_losses, ref_losses = after(run2.events), after(ref.events)
        run_done = {e["rank"]: e["digest"] for e in run2.events if e["event"] == "done"}
        ref_done = {e["rank"]: e["digest"] for e in ref.events if e["event"] == "done"}
        same_losses = run_losses == ref_losses and len(run_losses) == a.steps - resumed
        same_params = run_done == ref_done and len(run_done) == m
        restore_s = max(e["seconds"] for e in restored)
        print()
        print("=" * 78)
        print(f" {self.world} ranks on {a.nodes} nodes; failure after step {last_step}; the job came back on")
        print(f" {m} ranks ({self.restart_nodes} node(s)) and restored step {resumed - 1} from memory,")
        print(f" resharded, in {restore_s:.2f}s (slowest rank)")
        print(f" compared with an uninterrupted {m}-rank job started from the same checkpoint (a copy")
        print(" of the surviving stores), steps after the checkpoint:")
        print(f"   loss curve identical:         {'YES (bit-exact)' if same_losses else 'NO'}")
        print(
            f"   final parameters identical:   {'YES (bit-exact, sha256 per rank)' if same_params else 'NO'}"
        )
        print("=" * 78)
        if a.json:
            result = {
                "resized": True,
                "world_before": self.world,
                "world_after": m,
                "failure_step": last_step,
                "resumed_from_step": resumed,
                "restore_seconds": restore_s,
                "bit_exact_losses": same_losses,
                "bit_exact_params": same_params,
                "restores": [
                    {k: e[k] for k in ("rank", "iteration", "source", "seconds")}
                    for e in sorted(restored, key=lambda e: e["rank"])
                ],
                "timeline": self.timeline,
            }
            Path(a.json).write_text(json.dumps(result, indent=2))
        print(f"total demo time: {time.time() - self.t0:.1f}s")
        return 0 if (same_losses and same_params) else 1

    def _reference_run(self) -> Launch:
        self.log("reference run (uninterrupted, same seed) ...")
        ref = (
            self.launch("reference", "reference")
            if self.args.mode == "embedded"
            else self._service_reference()
        )
        self.finish(ref)
        self.log(f"reference run done in {ref.ended - ref.started:.1f}s")
        return ref

    def _faulty_run(self, victims: List[int]) -> Tuple[Launch, float]:
        """Train until the victims pause after the failure step, then fail them and stop the
        survivors; returns the launch and the time of the failure."""
        self.log("training run ...")
        run1 = self.launch("faulty", "run", pause_at=self.args.fail_step, victims=victims)
        ok = run1.wait_for(
            lambda evs: sum(1 for e in evs if e["event"] == "paused") == len(victims), timeout=300
        )
        if not ok:
            self.finish(run1)
            raise SystemExit("victims never reached the failure step")
        saves = sorted({e["step"] for e in run1.events if e["event"] == "save"})
        self.log(f"saved local checkpoints after steps {saves}")
        t_fail = time.time()
        self.inject(run1, victims)
        # Survivors lose their peers; stop them as torchrun's agent would for a restart.
        for i, p in enumerate(run1.procs):
            if i not in victims and p.is_alive():
                p.terminate()
        for p in run1.procs:
            p.join(60)
            if p.is_alive():
                p.kill()
                p.join()
        return run1, t_fail

    def _restart(self, victims: List[int]) -> Tuple[Launch, float]:
        """Relaunch every rank to completion; returns the launch and when the restart began."""
        a = self.args
        self.log("restarting all ranks (replacement node comes up with an empty store) ...")
        if a.mode == "service" and a.failure in ("node", "daemon"):
            self.daemons.restart_lost(victims)
        t_restart = time.time()
        run2 = self.launch("faulty", "restart")
        self.finish(run2)
        return run2, t_restart

    def _check_restores(self, run2: Launch, t_restart: float, world: Optional[int] = None) -> List[dict]:
        """The restart's ``restored`` events; every rank must have restored."""
        world = world or self.world
        restored = [e for e in run2.events if e["event"] == "restored"]
        fresh = [e for e in run2.events if e["event"] == "fresh_start"]
        if fresh or len(restored) != world:
            raise SystemExit(f"restart did not restore every rank: {fresh or restored}")
        ready = [e["t"] for e in run2.events if e["event"] == "ready"]
        if ready:
            self.log(f"all {world} ranks up {max(ready) - t_restart:.2f}s after the restart began")
        for e in sorted(restored, key=lambda e: e["rank"]):
            served = (
                "resharded from the survivors' stores"
                if e["source"] == "resharded"
                else f"from {e['source']} (served by rank {e['source_rank']})"
            )
            self.log(f"rank {e['rank']} restored iteration {e['iteration']} {served} in {e['seconds']:.2f}s")
        return restored

    def victim_ranks(self) -> List[int]:
        a = self.args
        if a.failure == "rank":
            return [self.world - 1]
        node = a.nodes - 1
        return list(range(node * a.ranks_per_node, (node + 1) * a.ranks_per_node))

    def inject(self, launch: Launch, victims: List[int]) -> None:
        a = self.args
        for r in victims:
            launch.procs[r].kill()  # SIGKILL
        for r in victims:
            launch.procs[r].join()
        node = victims[0] // a.ranks_per_node
        if a.failure == "node":
            shutil.rmtree(self.node_root("faulty", node), ignore_errors=True)
            if self.daemons is not None:
                self.daemons.kill(node)
            self.log(f"FAILURE: node {node} lost — ranks {victims} killed with SIGKILL, its store deleted")
        elif a.failure == "daemon":
            self.daemons.kill(node)
            self.log(f"FAILURE: node {node}'s daemon killed with SIGKILL (and its ranks {victims})")
        else:
            self.log(f"FAILURE: rank {victims[0]} killed with SIGKILL (its node's store survives)")

    def _service_reference(self) -> Launch:
        self.daemons.start("reference")
        return self.launch("reference", "reference")

    # ---- verdict -------------------------------------------------------------------------------------

    def report(
        self, ref, ref_losses, run1, run2, combined, last_step, resumed, t_fail, t_restart, restore_s
    ) -> int:
        a = self.args
        ref_done = {e["rank"]: e["digest"] for e in ref.events if e["event"] == "done"}
        run_done = {e["rank"]: e["digest"] for e in run2.events if e["event"] == "done"}
        same_params = ref_done == run_done and len(ref_done) == self.world
        same_losses = combined == ref_losses
        diverged = sorted(s for s in ref_losses if combined.get(s) != ref_losses[s])
        ref_steps = sorted((e["step"], e["t"]) for e in ref.events if e["event"] == "step" and e["rank"] == 0)
        step_s = (ref_steps[-1][1] - ref_steps[0][1]) / max(len(ref_steps) - 1, 1)
        recomputed = last_step + 1 - resumed
        lost_s = restore_s + recomputed * step_s  # restore, then redo the steps after the checkpoint
        scratch_s = (last_step + 1) * step_s
        print()
        print("=" * 78)
        print(f" failure after step {last_step}; newest complete local checkpoint: step {resumed - 1}")
        print(f" restore took {restore_s:.2f}s (slowest rank); {recomputed} step(s) recomputed")
        print(
            f" seconds lost ≈ {lost_s:.2f}s  vs  {scratch_s:.2f}s recomputing from step 0 "
            f"(at {step_s * 1000:.0f} ms/step)"
        )
        print(f" loss curve identical to the uninterrupted run: {'YES (bit-exact)' if same_losses else 'NO'}")
        print(
            f" final parameters identical (sha256 per rank):   {'YES (bit-exact)' if same_params else 'NO'}"
        )
        if diverged:
            print(f" first differing step: {diverged[0]}")
        print("=" * 78)
        png = Path(a.plot or (Path.cwd() / "demo_loss.png"))
        _plot(png, ref_losses, combined, last_step, resumed, a)
        print(f"loss curves plotted to {png}")
        result = {
            "bit_exact_losses": same_losses,
            "bit_exact_params": same_params,
            "failure_step": last_step,
            "resumed_from_step": resumed,
            "failure": a.failure,
            "killed_ranks": self.victims,
            "restores": self.restores,
            "restore_seconds": restore_s,
            "seconds_lost": lost_s,
            "seconds_from_scratch": scratch_s,
            "timeline": self.timeline,
        }
        if a.json:
            Path(a.json).write_text(json.dumps(result, indent=2))
        print(f"total demo time: {time.time() - self.t0:.1f}s")
        return 0 if (same_losses and same_params) else 1


_CTX = None


def _mp_context():
    global _CTX
    if _CTX is None:
        import multiprocessing as mp

        _CTX = mp.get_context("forkserver")
        # resilient_ckpt first: it filters torch's pynvml warning before torch is imported.
        # torch._inductor.config is what torch.use_deterministic_algorithms() imports (~1.2 s of
        # CPU per rank, ~3 s per launch of 4 ranks on 2 cores when paid after the fork).
        _CTX.set_forkserver_preload(
            [
                "resilient_ckpt",
                "torch",
                "torch.distributed",
                "torch._inductor.config",
                "resilient_ckpt.demo.worker",
                "resilient_ckpt.manager.hooks",
            ]
        )
    return _CTX


def _rank_main(argv, env, events, control) -> None:
    """A rank process: events go to the orchestrator's queue; pausing waits on ``control``."""
    os.environ.update(env)
    import traceback

    from . import worker

    rank = int(env["RANK"])

    def emit(**event):
        event.setdefault("t", time.time())
        events.put(event)

    try:
        rc = worker.run(worker.parse_args(argv), emit, control.get)
    except BaseException:
        emit(event="error", rank=rank, traceback=traceback.format_exc())
        events.close()
        events.join_thread()
        os._exit(1)
    events.close()
    events.join_thread()
    os._exit(rc)


def _losses(events) -> Dict[int, float]:
    return {e["step"]: e["loss"] for e in events if e["event"] == "step" and e["rank"] == 0}


def _failure_step(events) -> int:
    """The step the failure came after: where the victims paused. (Rank 0's own report of that
    step may still be on its way when the survivors are stopped — the known flake where the
    demo said 18 instead of 19.)"""
    return max(e["step"] for e in events if e["event"] == "paused")


def _resumed_step(restored: List[dict]) -> int:
    """The step every rank resumes from; they must agree."""
    resumed_steps = {e["step"] for e in restored}
    if len(resumed_steps) != 1:
        raise SystemExit(f"ranks resumed from different steps: {sorted(resumed_steps)}")
    return resumed_steps.pop()


def _plot(path: Path, ref: Dict[int, float], run: Dict[int, float], failed_at: int, resumed: int, a) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    xs = sorted(ref)
    ax.plot(xs, [ref[s] for s in xs], lw=3, alpha=0.4, label="uninterrupted run")
    xs2 = sorted(run)
    ax.plot(xs2, [run[s] for s in xs2], lw=1.2, ls="--", marker=".", label="failed + restored run")
    ax.axvline(failed_at + 0.5, color="red", lw=1, label=f"{a.failure} failure after step {failed_at}")
    ax.axvline(resumed - 0.5, color="green", lw=1, label=f"restored checkpoint of step {resumed - 1}")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"resilient_ckpt demo: {a.nodes} nodes × {a.ranks_per_node} ranks, {a.mode} mode")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _shm_or_tmp() -> str:
    return (
        "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
    )


def build_parser(p: Optional[argparse.ArgumentParser] = None) -> argparse.ArgumentParser:
    p = p or argparse.ArgumentParser(prog="resilient-ckpt demo", description=__doc__)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=2)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=10, help="save every N steps")
    p.add_argument("--failure", choices=["node", "rank", "daemon"], default="node")
    p.add_argument(
        "--fail-step", type=int, default=None, help="failure right after this step (default 2/3 of --steps)"
    )
    p.add_argument("--mode", choices=["embedded", "service"], default="embedded")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, help="PNG path (default ./demo_loss.png)")
    p.add_argument("--json", default=None, help="write the result as JSON here")
    p.add_argument(
        "--workdir",
        default=None,
        help="where node stores live: a fresh directory is made inside (default /dev/shm)",
    )
    p.add_argument("--keep", action="store_true", help="keep the node stores after the demo")
    p.add_argument(
        "--no-replacement",
        action="store_true",
        help="the failed node does not come back: the job resumes on one node fewer, resharded from memory",
    )
    p.add_argument(
        "--restart-nodes",
        type=int,
        default=None,
        help="nodes the job comes back on (more than --nodes: a grow), resharded from memory",
    )
    return p


def main(argv=None) -> int:
    from ..cli import extras

    args = build_parser().parse_args(argv)
    extras.require("demo")  # the loss plot, at the very end: fail before training instead
    if args.fail_step is None:
        args.fail_step = (2 * args.steps) // 3 + args.interval // 2
    if args.failure == "daemon" and args.mode != "service":
        raise SystemExit("--failure daemon needs --mode service")
    if args.mode == "service":
        from .worker import service_mode_missing

        missing = service_mode_missing(demo=True)
        if missing:
            raise SystemExit(f"--mode service is not available: {missing}; run the demo in --mode embedded")
    if args.nodes < 2 and args.failure == "node":
        raise SystemExit("a node failure needs at least 2 nodes (copies live on other nodes)")
    resized = args.no_replacement or (args.restart_nodes not in (None, args.nodes))
    if resized and args.mode != "embedded":
        raise SystemExit("--no-replacement / --restart-nodes need --mode embedded")
    if resized and (args.restart_nodes or args.nodes - 1) < 1:
        raise SystemExit("the job must come back on at least one node")
    if not 0 <= args.fail_step < args.steps - 1:
        raise SystemExit(f"--fail-step must be in [0, {args.steps - 2}]")
    return Demo(args).run()


if __name__ == "__main__":
    sys.exit(main())
