"""What a save costs the caller when the structure is unchanged, against the floor: one
``torch._foreach_copy_`` over the same tensors in the same process (issue 41).

2 simulated nodes x 1 rank (gloo on 127.0.0.1, a store root per node, replicas on the other
node), ``--tensors`` float32 tensors per rank summing to ``--mib``. Per code tree given with
``--tree`` (a checkout to put on ``PYTHONPATH``; the default is this one), one process pair per
alternation (``--alternations``, trees interleaved), each measuring in turn:

* ``same``: the same tensor objects saved again, changed in place between saves, in fresh
  ShardedTensors (as Megatron's ``sharded_state_dict()`` makes them): the time ``save_local``
  blocks the caller (first save: the general path; later ones cached), and the floor measured
  just before each save — one ``_foreach_copy_`` of the same tensors into integer views made
  once (the bytes moved as bits, as the save does);
* ``new``: each save brings new tensor objects of the same structure;
* ``train_state``: a model of the same tensors as parameters under ``TrainState`` (SGD): the
  time ``sharded_state_dict()`` takes at a cached save, and that save's blocked time;
* ``restore``: a restarted rank's ``load_local`` into a fresh template (the newest iteration).

Printed as JSON (slowest rank, median over saves and alternations) and as ratios to the floor:

    PYTHONPATH=. .venv/bin/python benchmarks/cached_save_costs.py --tree . --tree /tmp/base23464
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _rank(ctx, args) -> dict:
    """One rank (``resilient_ckpt.bench.launcher.launch``: its process group is up)."""
    import torch
    import torch.distributed as dist

    rank, root = ctx.rank, ctx.tmp_root
    from resilient_ckpt import CheckpointManager, ShardedTensor, TrainState

    n, per = args.tensors, max(1, (args.mib << 20) // 4 // args.tensors)
    g = torch.Generator().manual_seed(rank)
    tensors = [torch.randn(per, generator=g) for _ in range(n)]
    flat = torch.empty(n * per, dtype=torch.int32)
    views = list(flat.split(per))

    def floor() -> float:
        srcs = [t.view(torch.int32) for t in tensors]  # made once per measure, outside the timing
        t0 = time.perf_counter()
        torch._foreach_copy_(views, srcs)
        return time.perf_counter() - t0

    def wrap(ts):
        return {
            "w": {
                f"r{rank}.t{i}": ShardedTensor.from_rank_offsets(f"r{rank}.t{i}", t) for i, t in enumerate(ts)
            }
        }

    out = {"rank": rank, "tensors": n, "mib": n * per * 4 / 2**20}
    store = os.path.join(root, f"node{rank}")

    def manager(session):
        return CheckpointManager(session_id=session, store_root=store, replication_factor=2, timeout_s=300)

    # same tensor objects, fresh wrappers
    floors, stalls, first = [], [], None
    with manager("same") as m:
        for it in range(1 + args.saves):
            with torch.no_grad():
                for t in tensors[:: max(1, n // 100)]:
                    t.add_(1.0)
            sd = wrap(tensors)
            floors.append(floor())
            dist.barrier()
            t0 = time.perf_counter()
            h = m.save_local(sd, iteration=it)
            dt = time.perf_counter() - t0
            h.wait()
            if it == 0:
                first = dt
            else:
                stalls.append(dt)
    out.update(floor_s=statistics.median(floors), same_first_s=first, same_cached_s=statistics.median(stalls))

    # restore of the "same" session's newest iteration into a fresh template
    dist.barrier()
    template = wrap([torch.empty_like(t) for t in tensors])
    t0 = time.perf_counter()
    with manager("same") as again:
        state, it = again.load_local(template)
    out["restore_s"] = time.perf_counter() - t0
    out["restored_ok"] = it == args.saves and all(
        torch.equal(state["w"][f"r{rank}.t{i}"], tensors[i]) for i in range(0, n, max(1, n // 50))
    )
    del state, template

    # new tensor objects at every save
    stalls = []
    with manager("new") as m:
        for it in range(1 + args.saves):
            fresh = [t.clone() for t in tensors]
            sd = wrap(fresh)
            dist.barrier()
            t0 = time.perf_counter()
            h = m.save_local(sd, iteration=it)
            dt = time.perf_counter() - t0
            h.wait()
            if it:
                stalls.append(dt)
    out["new_cached_s"] = statistics.median(stalls)
    del fresh, sd

    # TrainState over the same tensors as parameters
    model = torch.nn.ParameterList([torch.nn.Parameter(t) for t in tensors])
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1), rng=False)
    dicts, stalls = [], []
    with manager("ts") as m:
        for it in range(1 + args.saves):
            with torch.no_grad():
                for p in list(model)[:: max(1, n // 100)]:
                    p.add_(1.0)
            t0 = time.perf_counter()
            sd = state.sharded_state_dict()
            t1 = time.perf_counter()
            dist.barrier()
            t2 = time.perf_counter()
            h = m.save_local(sd, iteration=it)
            t3 = time.perf_counter()
            h.wait()
            if it:
                dicts.append(t1 - t0)
                stalls.append(t3 - t2)
    out.update(train_state_dict_s=statistics.median(dicts), train_state_save_s=statistics.median(stalls))
    return out


def _pair(args) -> list:
    from resilient_ckpt.bench.launcher import launch

    root = tempfile.mkdtemp(prefix="rc-costs-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        return launch(_rank, 2, root, ranks_per_node=1, args=(args,), timeout=1200)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _one_run(args) -> None:
    """In a child process whose PYTHONPATH is the tree under test: one alternation, as JSON."""
    results = _pair(args)
    keys = [k for k in results[0] if k.endswith("_s")]
    slowest = {k: max(r[k] for r in results) for k in keys}
    slowest["floor_s"] = statistics.median(r["floor_s"] for r in results)  # per-process floor
    print(
        "RESULT "
        + json.dumps(
            {
                **slowest,
                "tensors": results[0]["tensors"],
                "mib": results[0]["mib"],
                "restored_ok": all(r["restored_ok"] for r in results),
            }
        )
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tensors", type=int, default=50_000)
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--saves", type=int, default=4, help="cached saves after the first, per scenario")
    p.add_argument("--alternations", type=int, default=2)
    p.add_argument("--tree", action="append", help="code tree to measure (repeatable); default: this one")
    p.add_argument("--json", help="write the figures here")
    p.add_argument("--one-run", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.one_run:
        _one_run(args)
        return 0
    trees = [
        os.path.abspath(t)
        for t in (args.tree or [os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])
    ]
    runs = {t: [] for t in trees}
    for _ in range(args.alternations):
        for tree in trees:
            cmd = [sys.executable, os.path.abspath(__file__), "--one-run", "--tensors", str(args.tensors)]
            cmd += ["--mib", str(args.mib), "--saves", str(args.saves)]
            env = dict(os.environ, PYTHONPATH=tree, OMP_NUM_THREADS="1")
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600)
            line = [x for x in done.stdout.splitlines() if x.startswith("RESULT ")]
            if not line:
                sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
                raise SystemExit(f"{tree}: no result")
            runs[tree].append(json.loads(line[0][len("RESULT ") :]))
    report = {}
    for tree, rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0] if k.endswith("_s")}
        fl = med["floor_s"]
        med["ratios_to_floor"] = {
            "same_cached": med["same_cached_s"] / fl,
            "train_state_dict": med["train_state_dict_s"] / fl,
            "train_state_save": med["train_state_save_s"] / fl,
            "new_cached": med["new_cached_s"] / fl,
        }
        med["restored_ok"] = all(r["restored_ok"] for r in rs)
        med["tensors"], med["mib"] = rs[0]["tensors"], rs[0]["mib"]
        report[tree] = med
    print(json.dumps(report, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
