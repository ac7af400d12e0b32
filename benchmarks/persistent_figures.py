"""Persistent-tier figures, measured in one run on this machine.

1. Flush throughput: a data-parallel model saved into the in-memory store (replicas
   deduplicated by the fully-parallel distribution), then flushed to a DCP directory by
   ``PersistentTier.flush`` (fsync on). Reported as the group's tensor bytes / seconds until
   the checkpoint is durable, beside the machine's own limit measured right before each flush
   (disk speed drifts): each rank writing the same number of bytes to a new plain file with one
   ``write`` + ``fsync``.
2. Restore from the persistent tier, same checkpoint, same template: every rank loading
   everything from storage (what plain DCP does for a data-parallel group) against the
   two-stage load (each stored entry read by one rank and broadcast). The checkpoint files are
   evicted from the page cache (``posix_fadvise(DONTNEED)``, after fsync) before every load, so
   reads come from the device; loads alternate and the median is reported, with the bytes each
   variant read from storage (counted through a wrapped StorageReader).

Usage::

    python benchmarks/persistent_figures.py [--ranks 2] [--size-mb 512] [--tensors 16]
        [--dir /path/on/the/file/system/to/test] [--repeats 3] [--json out.json]

Ranks are processes on this host (gloo over 127.0.0.1), all on one simulated node.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist


def _evict(directory: Path) -> None:
    """Drop the checkpoint's pages from the page cache (they are clean: written with fsync)."""
    for p in directory.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _max(x: float) -> float:
    t = torch.tensor([x], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def _sum(x: int) -> int:
    t = torch.tensor([x], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return int(t.item())


def _worker(ctx, args) -> Optional[dict]:
    """One rank (``resilient_ckpt.bench.launcher.launch``: its process group is up); rank 0
    returns the figures."""
    rank, world = ctx.rank, ctx.world_size
    from resilient_ckpt import ShardedTensor
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager
    from resilient_ckpt.persistent.local_load import load_local
    from resilient_ckpt.persistent.storage import CountingStorageReader, SafeFileSystemReader
    from resilient_ckpt.persistent.tier import PersistentTier
    from resilient_ckpt.persistent.two_stage import two_stage_load

    root = Path(args.dir)
    per_tensor = args.size_mb * (1 << 20) // args.tensors // 4
    rows = max(1, per_tensor // 1024)
    shape = (rows, per_tensor // rows)

    def model(step: int):
        g = torch.Generator().manual_seed(step)
        return {f"layer{i}.weight": torch.randn(*shape, generator=g) for i in range(args.tensors)}

    def sharded(params):
        # Data parallel: every rank holds every parameter; replica_id = rank.
        return {
            "model": {
                n: ShardedTensor.from_rank_offsets(f"model.{n}", t, replica_id=rank)
                for n, t in params.items()
            },
            "step": 0,
        }

    mgr = CheckpointManager(
        "bench-persistent",
        str(root / "shm"),
        replication_factor=1,
        ranks_per_node=world,
        keep_last=args.repeats + 2,
    )
    # Nothing is deleted while measuring: this VM's disk is mounted with online discard, and
    # deleting gigabytes stalls whichever write comes next.
    tier = PersistentTier(
        root / "durable", session="bench-persistent", keep_last=args.repeats + 1, timeout_s=600
    )
    total_bytes = sum(t.numel() * 4 for t in model(0).values())

    share = torch.empty(total_bytes // world, dtype=torch.uint8).fill_(rank)

    raw_files = []

    def raw_write() -> float:
        """The machine's limit, measured beside each flush (this disk's speed drifts): this
        rank's share of the bytes, one write + fsync to a new plain file."""
        raw = root / f"raw_{rank}_{len(raw_files)}.bin"
        raw_files.append(raw)
        dist.barrier()
        t = time.perf_counter()
        with open(raw, "wb", buffering=0) as f:
            f.write(memoryview(share.numpy()))
            os.fsync(f.fileno())
        return _max(time.perf_counter() - t)

    flushes = []
    for it in range(1, args.repeats + 1):
        params = model(it)
        mgr.save_local(sharded(params), it, is_async=False)
        del params
        tier.note_complete(mgr.store, it)
        raw_s = raw_write()
        dist.barrier()
        res = tier.flush(mgr.store, it).wait()
        flushes.append(
            {
                "seconds": _max(res.durable_seconds),
                "bytes": res.total_bytes,
                "my_bytes": res.bytes_written,
                "raw_write_s": raw_s,
                "full_plans_received": tier.planner.stats.full_plans_received if rank == 0 else None,
            }
        )
    share = None  # released before the loads are measured
    ckpt = Path(tier.latest_complete().path)
    expected = model(args.repeats)

    def template():
        return {
            "model": {
                n: ShardedTensor.from_rank_offsets(f"model.{n}", torch.empty(shape), replica_id=rank)
                for n in expected
            }
        }

    loads = {"every_rank_reads_all": [], "two_stage": []}
    read_bytes = {}
    for rep in range(args.repeats):
        for variant in (
            ("every_rank_reads_all", "two_stage") if rep % 2 == 0 else ("two_stage", "every_rank_reads_all")
        ):
            if rank == 0:
                _evict(ckpt)
            dist.barrier()
            sd = template()
            reader = CountingStorageReader(SafeFileSystemReader(ckpt))
            t = time.perf_counter()
            if variant == "two_stage":
                two_stage_load(sd, reader, None, read_ahead_bytes=args.read_ahead_mb << 20)
            else:
                load_local(sd, reader)
            loads[variant].append(_max(time.perf_counter() - t))
            read_bytes[variant] = _sum(reader.bytes_read)
            ok = all(torch.equal(sd["model"][n], expected[n]) for n in expected)
            if not ok:
                raise SystemExit(f"rank {rank}: {variant} load is not bit-exact")
            del sd
    tier.close()
    mgr.close()
    for raw in raw_files:
        raw.unlink()
    if rank == 0:
        return {
            "ranks": world,
            "tensor_bytes": total_bytes,
            "tensors": args.tensors,
            "dir": str(root),
            "flushes": flushes,
            "flush_gbps": [f["bytes"] / f["seconds"] / 1e9 for f in flushes],
            "raw_write_gbps": [total_bytes / f["raw_write_s"] / 1e9 for f in flushes],
            "loads_s": loads,
            "load_read_bytes": read_bytes,
            "page_cache": "evicted (posix_fadvise DONTNEED) before every load",
        }
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--size-mb", type=int, default=512, help="model size (each rank holds all of it)")
    p.add_argument("--tensors", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--read-ahead-mb", type=int, default=256)
    p.add_argument(
        "--dir", default=None, help="where the DCP checkpoint goes (default: a temp dir under /tmp)"
    )
    p.add_argument("--json", default=None, help="also write the figures here")
    args = p.parse_args(argv)
    made = args.dir is None
    args.dir = args.dir or tempfile.mkdtemp(prefix="persistent_figures_", dir="/tmp")
    from resilient_ckpt.bench.launcher import launch
    from resilient_ckpt.errors import CheckpointingException

    try:
        res = launch(_worker, args.ranks, args.dir, args=(args,), timeout=3600)[0]
    except CheckpointingException as e:  # a rank failed, died or timed out (launch says which)
        print(e, file=sys.stderr)
        return 1
    finally:
        if made:
            shutil.rmtree(args.dir, ignore_errors=True)
    gb = res["tensor_bytes"] / 1e9
    med = {k: statistics.median(v) for k, v in res["loads_s"].items()}
    print(
        f"persistent tier, {res['ranks']} ranks on one host, {gb:.3f} GB of tensors ({res['tensors']} tensors), dir {res['dir']}"
    )
    for i, (f, g, lim) in enumerate(zip(res["flushes"], res["flush_gbps"], res["raw_write_gbps"])):
        cached = (
            ""
            if f["full_plans_received"] is None
            else f"; coordinator received {f['full_plans_received']} full plans"
        )
        print(
            f"  flush {i + 1}: {f['seconds']:.3f} s until durable, {g:.2f} GB/s "
            f"(machine limit just before: plain write+fsync of the same bytes {lim:.2f} GB/s{cached})"
        )
    print(
        f"  flush median {statistics.median(res['flush_gbps']):.2f} GB/s, limit median "
        f"{statistics.median(res['raw_write_gbps']):.2f} GB/s"
    )
    for k in ("every_rank_reads_all", "two_stage"):
        runs = ", ".join(f"{x:.3f}" for x in res["loads_s"][k])
        print(
            f"  load, {k:<21} median {med[k]:.3f} s  (runs {runs}); read from storage {res['load_read_bytes'][k] / 1e9:.3f} GB"
        )
    print(f"  two-stage speedup: {med['every_rank_reads_all'] / med['two_stage']:.2f}x ({res['page_cache']})")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
