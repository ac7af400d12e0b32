"""What the README loop's save and restore cost for a model with many BatchNorm layers, on the
code on ``PYTHONPATH`` (run it once per code tree and compare: same machine, same run).

2 simulated nodes x 1 rank (gloo on 127.0.0.1, a store root per node, replicas on the other
node). The model: ``--blocks`` x [Linear(width, width), BatchNorm1d(width)] — 7 state tensors per
block (weight, bias, BN weight, bias, running mean, running var, batch count): 7,000 blocks of
width 96 are ~49k tensors and ~257 MiB per rank. SGD without momentum (no optimizer state: what
is measured is the model's). Per rank and save: the time ``TrainState.sharded_state_dict()``
takes, the time ``save_local`` blocks the caller (first save: the general path; then the same
tensor objects saved again: the cached path), the whole restore into a fresh TrainState;
printed as JSON (slowest rank, median over ``--saves`` cached saves).

    PYTHONPATH=<tree> python benchmarks/train_state_costs.py --blocks 7000 --width 96
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time


def _rank(ctx, args) -> dict:
    """One rank (``resilient_ckpt.bench.launcher.launch``: its process group is up)."""
    import torch

    rank, root = ctx.rank, ctx.tmp_root
    from resilient_ckpt import CheckpointManager, TrainState

    def model():
        torch.manual_seed(0)
        blocks = []
        for _ in range(args.blocks):
            blocks += [torch.nn.Linear(args.width, args.width), torch.nn.BatchNorm1d(args.width)]
        return torch.nn.Sequential(*blocks)

    net = model()
    with torch.no_grad():  # each rank's own statistics
        for m in net:
            if isinstance(m, torch.nn.BatchNorm1d):
                m.running_mean.fill_(rank)
    state = TrainState(net, torch.optim.SGD(net.parameters(), lr=0.1))
    store = os.path.join(root, f"node{rank}")
    manager = CheckpointManager(session_id="costs", store_root=store, replication_factor=2, timeout_s=120)
    tensors = len(net.state_dict())
    nbytes = sum(t.numel() * t.element_size() for t in net.state_dict().values())
    dicts, stalls = [], []
    for i in range(1 + args.saves):
        t0 = time.perf_counter()
        sd = state.sharded_state_dict()
        t1 = time.perf_counter()
        handle = manager.save_local(sd, iteration=i)
        t2 = time.perf_counter()
        handle.wait()
        dicts.append(t1 - t0)
        stalls.append(t2 - t1)
    manager.close()
    other = model()
    fresh = TrainState(other, torch.optim.SGD(other.parameters(), lr=0.1))
    t0 = time.perf_counter()
    with CheckpointManager(
        session_id="costs", store_root=store, replication_factor=2, timeout_s=120
    ) as again:
        restored, it = again.load_local()
        fresh.load_state_dict(restored)
    restore = time.perf_counter() - t0
    ok = all(torch.equal(a, b) for a, b in zip(net.state_dict().values(), fresh.model.state_dict().values()))
    return dict(
        rank=rank,
        tensors=tensors,
        mib=nbytes / 2**20,
        state_dict_first_s=dicts[0],
        state_dict_cached_s=statistics.median(dicts[1:]),
        stall_first_s=stalls[0],
        stall_cached_s=statistics.median(stalls[1:]),
        restore_s=restore,
        restored_iteration=it,
        bit_exact=ok,
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=7000)
    p.add_argument("--width", type=int, default=96)
    p.add_argument("--saves", type=int, default=4, help="cached saves after the first")
    args = p.parse_args()
    from resilient_ckpt.bench.launcher import launch

    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as root:
        results = launch(_rank, 2, root, ranks_per_node=1, args=(args,), timeout=900)
    slowest = {k: max(r[k] for r in results) for k in results[0] if k.endswith("_s")}
    print(
        json.dumps(
            {
                **{k: results[0][k] for k in ("tensors", "mib")},
                **slowest,
                "bit_exact": all(r["bit_exact"] for r in results),
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
