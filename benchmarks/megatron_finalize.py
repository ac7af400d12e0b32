"""Megatron-LM's async local save under its own ``AsyncCallsQueue``: how long the training
loop's non-blocking ``maybe_finalize_async_calls(blocking=False)`` calls take while a save is in
flight, nvidia-resiliency-ext's ``LocalCheckpointManager`` vs ours, same workload, same run.

Each rank runs the loop of Megatron-LM's ``train()`` with ``--non-persistent-ckpt-type local
--async-save``: a training step (a few matmuls standing in for forward/backward, then the
tensors change in place, as an optimizer step does), a save every ``--every`` steps
(Megatron-core ``MCoreTensorAwareStateDict.from_state_dict`` with cached metadata, then
``manager.save(tasd, iteration, is_async=True)`` scheduled on the queue), and a non-blocking
finalize after every step; a blocking one at the end. Replication: clique, jump 1, factor 2,
2 ranks = 2 simulated nodes. ``--slow-replication S`` holds our replication S seconds (a fault
hook) to show that a poll never waits for it; the reference has no such hook (its replication
runs in its worker process anyway).

Printed per system: ``save()`` call (the loop's stall), the longest and median non-blocking
finalize call, the blocking finalize at the end, and the ratio ours / reference.

Run: ``.venv/bin/python benchmarks/megatron_finalize.py [--size 128M] [--steps 40] [--every 10]``
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
import warnings

import torch

from resilient_ckpt.bench.baseline import apply_cpu_patches
from resilient_ckpt.bench.launcher import launch, quiet
from resilient_ckpt.bench.workload import Workload, format_size, parse_size


def _queue(owner: str):
    # The queues allocate their one-int "done?" all-reduce on torch.cuda.current_device(); on a
    # machine without CUDA that is pointed at the CPU (nothing else of theirs is changed).
    if not torch.cuda.is_available():
        torch.cuda.current_device = lambda: "cpu"
    if owner == "mcore":
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    else:
        from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncCallsQueue
    return AsyncCallsQueue(persistent=False)


def _manager(system: str, root: str, slow_s: float):
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    if system == "reference":
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )

        return LocalCheckpointManager(root, repl_strategy=strategy)
    from resilient_ckpt import LocalCheckpointManager

    manager = LocalCheckpointManager(root, repl_strategy=strategy)
    if slow_s > 0:
        manager.fault_hook = lambda point: point == "before_replication" and time.sleep(slow_s)
    return manager


def _rank(ctx, system, queue_owner, size, steps, every, slow_s):
    quiet()
    apply_cpu_patches()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    work = Workload(size, ctx.world_size, ctx.rank, flavour="mcore")
    manager = _manager(system, ctx.store_root, slow_s)
    queue = _queue(queue_owner)
    a = torch.randn(384, 384)
    cache, save_s, polls = None, [], []
    for iteration in range(1, steps + 1):
        for _ in range(8):  # the "forward/backward"
            a = torch.tanh(a @ a)
        work.advance(iteration)  # the "optimizer step" changes the saved tensors in place
        if iteration % every == 0:
            t0 = time.perf_counter()
            tasd, cacheable = MCoreTensorAwareStateDict.from_state_dict(
                work.sharded_state_dict(),
                algo="fully_parallel",
                cached_metadata=cache,
                parallelization_group=ctx.dp_group,
            )
            request = manager.save(tasd, iteration, is_async=True)
            queue.schedule_async_request(request)
            save_s.append(time.perf_counter() - t0)
            cache = cacheable
        t0 = time.perf_counter()
        queue.maybe_finalize_async_calls(blocking=False)
        polls.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    queue.maybe_finalize_async_calls(blocking=True)
    final_s = time.perf_counter() - t0
    queue.close()
    return {"save_s": save_s, "polls": polls, "final_s": final_s}


def _measure(system, queue_owner, args):
    with tempfile.TemporaryDirectory(prefix="finalize-", dir="/dev/shm") as tmp:
        out = launch(
            _rank,
            2,
            tmp,
            ranks_per_node=1,
            args=(system, queue_owner, args.size, args.steps, args.every, args.slow_replication),
            timeout=600,
        )
    polls = [p for o in out for p in o["polls"]]
    return {
        "save": max(s for o in out for s in o["save_s"]),
        "poll_max": max(polls),
        "poll_p50": statistics.median(polls),
        "final": max(o["final_s"] for o in out),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("128M"), help="bytes per rank")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--every", type=int, default=10, help="save every this many steps")
    p.add_argument("--queue", choices=("nvrx", "mcore"), default="nvrx")
    p.add_argument("--slow-replication", type=float, default=0.0, help="seconds (ours only)")
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    rows = {"reference": [], "ours": []}
    for _ in range(args.rounds):  # interleaved, so machine load hits both alike
        for system in rows:
            rows[system].append(_measure(system, args.queue, args))
    best = {s: {k: min(r[k] for r in rs) for k in rs[0]} for s, rs in rows.items()}
    print(
        f"Megatron-LM async local save, {format_size(args.size)}/rank, 2 ranks = 2 nodes, "
        f"{args.queue} AsyncCallsQueue, save every {args.every} of {args.steps} steps, "
        f"slow replication {args.slow_replication:.1f} s (ours); best of {args.rounds}"
    )
    print(f"{'':28}{'reference':>12}{'ours':>12}{'ours/ref':>10}")
    labels = {
        "save": "save() + from_state_dict",
        "poll_max": "longest non-blocking poll",
        "poll_p50": "median non-blocking poll",
        "final": "blocking finalize at end",
    }
    for key, label in labels.items():
        ref, ours = best["reference"][key], best["ours"][key]
        print(f"{label:28}{ref * 1e3:10.1f}ms{ours * 1e3:10.1f}ms{ours / ref if ref else float('nan'):10.2f}")


if __name__ == "__main__":
    main()
