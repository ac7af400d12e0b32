"""dcp.async_save / dcp.load through MemoryStorageWriter/Reader vs torch's FileSystemWriter/Reader.

Same run, same state dict, same 2 gloo ranks (each its own simulated node: its own store root
under /dev/shm, replication factor 2): a DDP-style state dict of plain tensors (identical on
both ranks, so DCP's planner gives each rank about half to write), saved with
``dcp.async_save`` and loaded back with ``dcp.load``, alternating the two storage layers:

- resilient_ckpt: ``MemoryStorageWriter(manager)`` / ``MemoryStorageReader(manager)``;
- torch FS: ``FileSystemWriter(<dir on /dev/shm>)`` / ``FileSystemReader(...)``
  (DCP's defaults: it stages a private CPU copy, then writes files, fsync on).

Per save: the stall (``async_save`` returning), time to durable (its future done: for us,
stored, checksummed, replicated to the other node and agreed by both ranks; for the file
system, files and ``.metadata`` written). Per load: ``dcp.load`` into the model's tensors,
checked bit-exact. Slowest rank of each operation; median over the repeats (one warm-up save
and load each first, not counted).

Run: ``.venv/bin/python benchmarks/dcp_storage_bench.py [--mib 256] [--tensors 320] [--repeats 5]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from typing import Dict, List

warnings.filterwarnings("ignore")


def _sizes(total_mib: int, count: int) -> List[int]:
    """``count`` tensor sizes (float32 elements) of varied shape summing to ``total_mib``."""
    weights = [1 + (i * 7919) % 13 for i in range(count)]  # a deterministic spread, 1..13
    total = total_mib * (1 << 20) // 4
    sizes = [max(1, total * w // sum(weights)) for w in weights]
    sizes[0] += total - sum(sizes)
    return sizes


def _state_dict(sizes: List[int]):
    import torch

    g = torch.Generator().manual_seed(0)  # identical on both ranks: DDP-style replicas
    return {"model": {f"layer{i}.weight": torch.randn(n, generator=g) for i, n in enumerate(sizes)}}


def _touch(sd, step: int) -> None:
    """A training step's worth of change (every tensor written in place)."""
    for t in sd["model"].values():
        t.add_(float(step))


def _timed_save(dcp, sd, writer, cid) -> Dict[str, float]:
    t0 = time.perf_counter()
    fut = dcp.async_save(sd, storage_writer=writer, checkpoint_id=cid)
    stall = time.perf_counter() - t0
    fut.result()
    return {"stall": stall, "durable": time.perf_counter() - t0}


def _timed_load(dcp, torch, sd, reader, cid) -> float:
    expected = {k: v.clone() for k, v in sd["model"].items()}
    for t in sd["model"].values():
        t.zero_()
    t0 = time.perf_counter()
    dcp.load(sd, storage_reader=reader, checkpoint_id=cid)
    seconds = time.perf_counter() - t0
    bad = [k for k, v in sd["model"].items() if not torch.equal(v, expected[k])]
    if bad:
        raise AssertionError(f"load is not bit-exact: {bad[:3]}")
    return seconds


def _rank(ctx, args) -> Dict[str, List[float]]:
    """One rank (``resilient_ckpt.bench.launcher.launch``: its process group is up)."""
    rank, root = ctx.rank, ctx.tmp_root
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.dcp import MemoryStorageReader, MemoryStorageWriter

    sd = _state_dict(_sizes(args.mib, args.tensors))
    manager = CheckpointManager(
        session_id="dcp-bench",
        store_root=f"{root}/node{rank}",
        replication_factor=2,
        ranks_per_node=1,
        timeout_s=300,
    )
    ours_w, ours_r = MemoryStorageWriter(manager), MemoryStorageReader(manager)
    fs_dir = f"{root}/fs"
    out: Dict[str, List[float]] = {}

    def keep(name: str, values: Dict[str, float]) -> None:
        for k, v in values.items():
            out.setdefault(f"{name}.{k}", []).append(v)

    # Saves first, then loads: a training loop saves many times after its one restore, and the
    # store's steady state (recycled, already-mapped segments) is what each save meets there.
    last_fs = None
    for step in range(args.repeats + 1):  # step 0: warm-up
        _touch(sd, step + 1)  # both layers save the same values (the loads check them)
        for name in ("ours", "fs"):
            cid = f"{fs_dir}/step-{2 * step + (name == 'fs')}"
            saved = _timed_save(dcp, sd, ours_w if name == "ours" else FileSystemWriter(cid), cid)
            if step:
                keep(name, saved)
                if name == "ours":
                    m = ours_w.last_save_metrics
                    keep("ours", {"replication": m.replication_s, "bytes": m.bytes_staged})
            if name == "fs":
                dist.barrier()
                if rank == 0 and last_fs is not None:
                    shutil.rmtree(last_fs, ignore_errors=True)  # /dev/shm holds one FS checkpoint
                last_fs = cid
    last_ours = f"{fs_dir}/step-{2 * args.repeats}"
    for step in range(args.repeats + 1):
        for name in ("ours", "fs"):
            reader = ours_r if name == "ours" else FileSystemReader(last_fs)
            load = _timed_load(dcp, torch, sd, reader, last_ours if name == "ours" else last_fs)
            if step:
                keep(name, {"load": load})
            dist.barrier()
    manager.close()
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--mib", type=int, default=256, help="state dict size (MiB, float32, identical on both ranks)"
    )
    p.add_argument("--tensors", type=int, default=320, help="number of tensors")
    p.add_argument("--repeats", type=int, default=5, help="measured saves and loads per storage layer")
    args = p.parse_args(argv)
    from resilient_ckpt.bench.launcher import launch

    # 2 ranks on the machine's cores (one intra-op thread each), the same for both layers; a
    # rank that fails, dies or runs out of time ends the run with its traceback
    root = tempfile.mkdtemp(prefix="dcp-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        results = dict(enumerate(launch(_rank, 2, root, ranks_per_node=1, args=(args,), timeout=1800)))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    _report(args, results)
    return 0


def _report(args, results) -> None:
    def med(key: str) -> float:
        # Slowest rank of each repeat, then the median over the repeats.
        per_repeat = zip(*(results[r][key] for r in sorted(results)))
        return statistics.median(max(v) for v in per_repeat)

    written = [results[r]["ours.bytes"][0] / (1 << 20) for r in sorted(results)]
    print(
        f"dcp.async_save / dcp.load, {args.mib} MiB in {args.tensors} float32 tensors (DDP-style, identical "
        f"on 2 ranks; DCP gives rank 0/1 {written[0]:.0f}/{written[1]:.0f} MiB to write), 2 gloo ranks, "
        f"median of {args.repeats}, slowest rank"
    )
    print(f"{'storage layer':<44}{'stall s':>10}{'durable s':>11}{'load s':>9}")
    rows = (
        ("resilient_ckpt MemoryStorageWriter/Reader", "ours"),
        ("torch FileSystemWriter/Reader (/dev/shm)", "fs"),
    )
    for label, key in rows:
        print(
            f"{label:<44}{med(key + '.stall'):>10.3f}{med(key + '.durable'):>11.3f}{med(key + '.load'):>9.3f}"
        )
    print(
        f"(ours: durable = stored + checksummed + replicated to the other node ({med('ours.replication'):.3f} s) + agreed)"
    )


if __name__ == "__main__":
    sys.exit(main())
