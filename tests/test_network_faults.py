"""Faults on the wire, with real processes on a real (virtual) network: every simulated node is a
network namespace with its own address, linked to a bridge by a veth pair shaped with tc
(``resilient_ckpt.bench.fabric``). Trainer ranks (gloo bound to their node's interface) and, in
service mode, one daemon per node run inside their node's namespace.

Each test is one fault, in embedded and in service mode: a node cut off while replicas travel
(partition), cut during a restore, a link that comes back within ``timeout_s`` (flap), 5 %
packet loss, one link 10x slower than the others, and a peer that answers small messages but
not bulk data (an MTU black hole: the control group reaches it, the data path does not). A
fault is injected from this process by a thread that waits for the condition it needs (the
ranks' signal, bytes actually crossing the link), never for a fixed time.

What every test asserts: every rank reaches the same outcome within a small multiple of
``timeout_s``; the failure names the unreachable node; nothing already complete is lost (the
previous complete iteration restores bit-exactly); the next save after the link is back
succeeds; the job's own process group still works. ``RESILIENT_CKPT_FAULT_TABLE=<file>``
appends one JSON line per test (fault, mode, outcome on every rank, seconds to detect).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from resilient_ckpt import ShardedObject, ShardedTensor
from resilient_ckpt.bench import fabric as fabric_mod
from resilient_ckpt.bench.fabric import Fabric, LinkShape
from resilient_ckpt.manager.checkpoint_manager import CheckpointManager
from resilient_ckpt.service.local_cluster import LocalDaemonCluster

# one fabric at a time on the host (its bridge and addresses are the host's): one xdist worker
pytestmark = [pytest.mark.multiprocess, pytest.mark.xdist_group("netns")]

MODES = ("embedded", "service")
MiB = 1 << 20
TIMEOUT_S = 2.0  # the manager's timeout_s (and the daemons' --peer-timeout)
SLOW = 3 * TIMEOUT_S  # "a small multiple": the slowest rank must know by then
RATE = 200_000_000  # 200 Mbit/s: a 4 MiB replica is ~0.17 s on the wire, long enough to cut
SESSION = "net"


# ---- the job each rank runs ----------------------------------------------------------------------


def _state(rank: int, world: int, step: int, mib: float, fill: bool = True) -> dict:
    g = torch.Generator().manual_seed(7919 * rank + step)
    n = max(1024, int(mib * MiB) // 4)
    u = torch.randn(n, generator=g) if fill else torch.zeros(n)
    w = torch.full((64,), float(step)) if fill else torch.zeros(64)
    return {
        "u": ShardedTensor.from_rank_offsets("u", u, (0, rank, world)),
        "w": ShardedTensor.from_rank_offsets("w", w, replica_id=rank),
        "rng": ShardedObject("rng", {"rank": rank, "step": step}, (world,), (rank,)),
        "step": step,
    }


def _exact(state: dict, rank: int, world: int, step: int, mib: float) -> bool:
    ref = _state(rank, world, step, mib)
    return (
        torch.equal(state["u"], ref["u"].data)
        and torch.equal(state["w"], ref["w"].data)
        and state["rng"] == {"rank": rank, "step": step}
        and state["step"] == step
    )


@dataclass(frozen=True)
class Job:
    mode: str
    mib: float
    sync: str  # directory of the signal files
    steps: Tuple[tuple, ...]  # ("save", it) | ("restore", expected it) | ("signal", name) | ("await", name)
    endpoints: Tuple[str, ...] = ()
    timeout_s: float = TIMEOUT_S


def _run_job(ctx, job: Job) -> dict:
    kw = dict(replication_factor=2, timeout_s=job.timeout_s)
    if job.mode == "service":
        kw.update(mode="service", endpoint=job.endpoints[ctx.node])
    m = CheckpointManager(SESSION, store_root=ctx.store_root, **kw)
    out: dict = {"records": []}
    sync, ws = Path(job.sync), ctx.world_size
    for step in job.steps:
        kind, arg = step
        if kind == "signal":
            (sync / f"{arg}.{ctx.rank}").write_text(str(time.monotonic()))
            continue
        if kind == "await":
            while not (sync / arg).exists():
                time.sleep(0.01)
            continue
        t0 = time.monotonic()
        try:
            if kind == "save":
                metrics = m.save_local(_state(ctx.rank, ws, arg, job.mib), arg).wait()
                result = {"outcome": "ok", "durable_s": metrics.durable_s}
            else:
                got = m.load_local(_state(ctx.rank, ws, 0, job.mib, fill=False))
                it = None if got is None else got[1]
                exact = got is not None and _exact(got[0], ctx.rank, ws, it, job.mib)
                result = {"outcome": "ok" if it == arg and exact else f"restored {it} (exact: {exact})"}
        except Exception as e:
            result = {"outcome": "failed", "error": f"{type(e).__name__}: {e}"[:1500]}
        out["records"].append({"kind": kind, "it": arg, "t0": t0, "t1": time.monotonic(), **result})
    t = torch.tensor([ctx.rank + 1.0])
    dist.all_reduce(t)  # the job's own group
    out["world_ok"] = float(t) == sum(range(1, ws + 1))
    m.close()
    return out


# ---- the fabric, the daemons, the fault --------------------------------------------------------


@pytest.fixture
def make_fabric():
    reason = fabric_mod.unavailable()
    if reason is not None:
        pytest.skip(f"network namespaces are not available here: {reason}")
    made: List[Fabric] = []

    def make(nodes: int, shape: Optional[LinkShape] = None) -> Fabric:
        f = Fabric(nodes, shape or LinkShape(rate_bps=RATE))
        made.append(f)
        (f.root / "sync").mkdir()
        return f

    yield make
    for f in made:
        f.close()


def _daemons(fab: Fabric) -> LocalDaemonCluster:
    return LocalDaemonCluster(
        [fab.store_root(n) for n in range(fab.nodes)],
        fab.root / "daemons",
        SESSION,
        hosts=[fab.address(n) for n in range(fab.nodes)],
        wrap=fab.command,
        extra=["--peer-timeout", str(TIMEOUT_S), "--retries", "1", "--inbound-timeout", str(2 * TIMEOUT_S)],
    ).start()


@dataclass
class Fault:
    """Injects one fault on ``node``'s link once every rank signalled ``after`` and ``min_bytes``
    more crossed that link; ``lift`` after ``hold_s`` seconds, or once every rank signalled
    ``lift_after``; then writes the ``lifted`` file the ranks await."""

    fab: Fabric
    world: int
    node: int
    inject: Callable[[], None]
    lift: Callable[[], None]
    after: str = "go"
    min_bytes: int = 0
    hold_s: Optional[float] = None
    lift_after: Optional[str] = None
    injected_at: Optional[float] = None
    lifted_at: Optional[float] = None
    problems: List[str] = field(default_factory=list)

    def start(self) -> "Fault":
        self._thread = threading.Thread(target=self._main, daemon=True)
        self._thread.start()
        return self

    def _wait(self, what: Callable[[], bool], why: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while not what():
            if time.monotonic() > deadline:
                raise TimeoutError(f"fault driver: gave up waiting for {why}")
            time.sleep(0.005)

    def _all(self, name: str) -> bool:
        return all((self.fab.root / "sync" / f"{name}.{r}").exists() for r in range(self.world))

    def _main(self) -> None:
        try:
            self._wait(lambda: self._all(self.after), f"every rank to signal {self.after!r}")
            base = sum(self.fab.link_bytes(self.node))
            self._wait(
                lambda: sum(self.fab.link_bytes(self.node)) - base >= self.min_bytes,
                f"{self.min_bytes} bytes on node {self.node}'s link",
            )
            self.injected_at = time.monotonic()
            self.inject()
            if self.hold_s is not None:
                time.sleep(self.hold_s)  # the fault's duration is the point: a flap of hold_s
            else:
                self._wait(lambda: self._all(self.lift_after), f"every rank to signal {self.lift_after!r}")
        except Exception as e:
            self.problems.append(str(e))
        finally:
            self.lift()
            self.lifted_at = time.monotonic()
            (self.fab.root / "sync" / "lifted").write_text("1")

    def join(self) -> None:
        self._thread.join(60)
        assert not self.problems, self.problems


def _records(out: List[dict], kind: str, it: int) -> List[dict]:
    return [next(r for r in o["records"] if r["kind"] == kind and r["it"] == it) for o in out]


def _table(fault: str, mode: str, recs: List[dict], f: Optional[Fault] = None) -> dict:
    """One row of the fault table (also appended to $RESILIENT_CKPT_FAULT_TABLE): each rank's
    outcome and seconds from the fault to it (for a lasting shape: the save's duration)."""
    start = [f.injected_at] * len(recs) if f is not None and f.injected_at else [r["t0"] for r in recs]
    row = {
        "fault": fault,
        "mode": mode,
        "outcome": [r["outcome"] for r in recs],
        "detect_s": [round(r["t1"] - t, 2) for r, t in zip(recs, start)],
        "data_lost": "none",
    }
    path = os.environ.get("RESILIENT_CKPT_FAULT_TABLE")
    if path:
        with open(path, "a") as fh:
            fh.write(json.dumps(row) + "\n")
    return row


def _start(fab: Fabric, mode: str) -> Tuple[str, ...]:
    return tuple(_daemons(fab).endpoints) if mode == "service" else ()


def _env(fab: Fabric, mode: str) -> Dict[str, str]:
    if mode != "service":
        return {}
    return {"RESILIENT_CKPT_SECRET_FILE": str(fab.root / "daemons" / f"{SESSION}.secret")}


def _run(
    fab: Fabric, mode: str, job: Job, world: int, endpoints=(), fault: Optional[Fault] = None
) -> List[dict]:
    """The job on ``world`` ranks, one per node; ``fault`` driven meanwhile."""
    if fault is not None:
        fault.start()
    try:
        return _run_ranks(fab, mode, job, world, endpoints)
    finally:
        if fault is not None:
            fault.join()


def _cut(fab: Fabric, world: int, node: int, mib: float, **kw) -> Fault:
    """Node ``node`` partitioned once a quarter of a replica crossed its link, then healed."""
    return Fault(
        fab, world, node, lambda: fab.cut(node), lambda: fab.heal(node), min_bytes=int(mib * MiB) // 4, **kw
    )


def _run_ranks(fab: Fabric, mode: str, job: Job, world: int, endpoints=()) -> List[dict]:
    job = Job(job.mode, job.mib, str(fab.root / "sync"), job.steps, endpoints, job.timeout_s)
    out = run_ranks(
        _run_job,
        world,
        str(fab.root),
        ranks_per_node=1,
        args=(job,),
        fabric=fab,
        extra_env=_env(fab, mode),
        timeout=120,
        collective_timeout=60,
    )
    assert all(o["world_ok"] for o in out), "the job's own all-reduce works after the fault"
    return out


# ---- 1. partition while replicas travel ----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_node_cut_off_while_replicas_travel_fails_that_save_everywhere_and_the_next_one_completes(
    make_fabric, mode
):
    fab = make_fabric(3)
    eps = _start(fab, mode)
    mib = 4
    steps = (
        ("save", 10),
        ("signal", "go"),
        ("save", 20),  # node 1 is cut while its replicas travel
        ("signal", "failed"),
        ("await", "lifted"),
        ("restore", 10),  # nothing complete was lost
        ("save", 30),  # the link is back: the next save completes
        ("restore", 30),
    )
    f = _cut(fab, 3, 1, mib, lift_after="failed")
    out = _run(fab, mode, Job(mode, mib, "", steps), 3, eps, f)
    save20 = _records(out, "save", 20)
    row = _table("partition during save", mode, save20, f)
    assert [r["outcome"] for r in save20] == ["failed"] * 3, row
    assert max(row["detect_s"]) < SLOW, row
    # the failure names the unreachable node on the ranks that deal with it
    named = [r["error"] for r in save20 if "node 1" in r["error"] or "nodes [1]" in r["error"]]
    assert named, [r["error"] for r in save20]
    for kind, it in (("save", 10), ("restore", 10), ("save", 30), ("restore", 30)):
        assert [r["outcome"] for r in _records(out, kind, it)] == ["ok"] * 3, (kind, it, out)
    if mode == "service":
        _operator_sees_the_failure(fab, eps)


def _operator_sees_the_failure(fab: Fabric, eps: Tuple[str, ...]) -> None:
    """``resilient-ckpt status`` on node 0 names the node its replica did not reach, and when."""
    cli = str(Path(sys.executable).with_name("resilient-ckpt"))
    env = {**os.environ, **_env(fab, "service")}
    p = fab.run(0, [cli, "status", "--endpoint", eps[0], "--json"], env=env)
    assert p.returncode == 0, p.stderr
    failures = json.loads(p.stdout)["daemon"]["recent_failures"]
    mine = [x for x in failures if x["iteration"] == 20 and x["node"] == 1]
    assert mine and all(x["at"] and x["outcome"] in ("failed", "abandoned") for x in mine), failures


# ---- 2. partition during a restore ---------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_node_cut_off_during_a_restore_fails_it_everywhere_and_a_later_restore_is_exact(make_fabric, mode):
    fab = make_fabric(2)
    daemons = _daemons(fab) if mode == "service" else None
    eps = tuple(daemons.endpoints) if daemons else ()
    mib = 8
    _run(fab, mode, Job(mode, mib, "", (("save", 10),)), 2, eps)
    # node 1 is replaced: its memory is gone, its ranks restore from node 0's replicas
    shutil.rmtree(fab.store_root(1))
    os.makedirs(fab.store_root(1))
    if daemons is not None:
        daemons.restart(1)
    steps = (
        ("signal", "go"),
        ("restore", 10),  # node 1 is cut while the replica travels
        ("signal", "failed"),
        ("await", "lifted"),
        ("restore", 10),
        ("save", 20),
    )
    f = _cut(fab, 2, 1, mib, lift_after="failed")
    out = _run(fab, mode, Job(mode, mib, "", steps), 2, eps, f)
    first = [o["records"][0] for o in out]
    row = _table("partition during restore", mode, first, f)
    assert [r["outcome"] for r in first] == ["failed"] * 2, row
    assert max(row["detect_s"]) < SLOW + 2 * TIMEOUT_S, row
    second = [o["records"][1] for o in out]
    assert [r["outcome"] for r in second] == ["ok"] * 2, second
    assert [r["outcome"] for r in _records(out, "save", 20)] == ["ok"] * 2, out


# ---- 3. a link that comes back within timeout_s ---------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_link_that_flaps_for_less_than_the_timeout_costs_time_not_the_save(make_fabric, mode):
    fab = make_fabric(2)
    eps = _start(fab, mode)
    mib, timeout_s, down_s = 4, 8.0, 1.0
    steps = (("save", 10), ("signal", "go"), ("save", 20), ("restore", 20))
    f = _cut(fab, 2, 1, mib, hold_s=down_s)
    out = _run(fab, mode, Job(mode, mib, "", steps, timeout_s=timeout_s), 2, eps, f)
    save20 = _records(out, "save", 20)
    _table(f"link down {down_s:g} s during save", mode, save20, f)
    assert [r["outcome"] for r in save20] == ["ok"] * 2, save20
    # TCP retransmits carried the save over the gap: it took at least the gap, not timeout_s
    assert all(down_s <= r["t1"] - r["t0"] < timeout_s for r in save20), save20
    assert [r["outcome"] for r in _records(out, "restore", 20)] == ["ok"] * 2


# ---- 4. packet loss ------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_five_percent_packet_loss_slows_saves_but_every_one_completes(make_fabric, mode):
    fab = make_fabric(2, LinkShape(rate_bps=RATE, loss=0.05))
    eps = _start(fab, mode)
    steps = (("save", 10), ("save", 20), ("restore", 20))
    out = _run(fab, mode, Job(mode, 2, "", steps, timeout_s=10.0), 2, eps)
    _table("5 % packet loss each way on one link", mode, _records(out, "save", 20))
    for kind, it in (("save", 10), ("save", 20), ("restore", 20)):
        assert [r["outcome"] for r in _records(out, kind, it)] == ["ok"] * 2, (kind, it, out)
    dropped = fab.dropped_packets(1)
    assert dropped > 0, "the loss filter dropped nothing: the fault was not on the wire"


# ---- 5. one slow link ----------------------------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_one_link_ten_times_slower_than_the_others_bounds_durability_by_that_link(make_fabric, mode):
    fab = make_fabric(3)
    fab.reshape(2, rate_bps=RATE // 10)
    eps = _start(fab, mode)
    mib = 2
    steps = (("save", 10), ("save", 20), ("restore", 20))
    out = _run(fab, mode, Job(mode, mib, "", steps, timeout_s=20.0), 3, eps)
    save20 = _records(out, "save", 20)
    _table("one link 10x slower (20 of 200 Mbit/s)", mode, save20)
    assert [r["outcome"] for r in save20] == ["ok"] * 3, save20
    # node 2 sends its replica and receives one over a 20 Mbit/s link: not faster than that
    floor = mib * MiB * 8 / (RATE / 10)
    assert max(r["durable_s"] for r in save20) >= floor, (floor, save20)
    assert [r["outcome"] for r in _records(out, "restore", 20)] == ["ok"] * 3


# ---- 6. control reachable, data path not -----------------------------------------------------------


@pytest.mark.parametrize("mode", MODES)
def test_a_peer_reachable_for_small_messages_but_not_for_data_fails_the_save_and_heals(make_fabric, mode):
    fab = make_fabric(2)
    eps = _start(fab, mode)
    mib = 4
    steps = (
        ("save", 10),
        ("signal", "go"),
        ("save", 20),  # packets of 1 KiB and more to and from node 1 vanish from here on
        ("signal", "failed"),
        ("await", "lifted"),
        ("save", 30),
        ("restore", 30),
    )
    f = Fault(
        fab,
        2,
        1,
        lambda: fab.reshape(1, drop_from_bytes=1024),
        lambda: fab.reshape(1, drop_from_bytes=None),
        lift_after="failed",
    )
    out = _run(fab, mode, Job(mode, mib, "", steps), 2, eps, f)
    save20 = _records(out, "save", 20)
    row = _table("data path black-holed (packets >= 1 KiB dropped)", mode, save20, f)
    assert [r["outcome"] for r in save20] == ["failed"] * 2, row
    assert max(row["detect_s"]) < SLOW, row
    for kind, it in (("save", 10), ("save", 30), ("restore", 30)):
        assert [r["outcome"] for r in _records(out, kind, it)] == ["ok"] * 2, (kind, it, out)
