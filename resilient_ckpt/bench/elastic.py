"""Resharded restore, measured against a same-size restore and torch DCP resharding from disk.

One run: N ranks (2 nodes) save a tensor-parallel-style state (``--mib`` per rank, tensors split
along axis 0) to memory and flush it to a torch.distributed.checkpoint directory on disk;
then, in fresh processes:

1. **same size**: N ranks restore it from memory (the usual restart);
2. **resharded**: node 1 is lost; N/2 ranks on node 0 restore it from memory, resharded;
3. **DCP from disk**: N/2 ranks load the same iteration from the flushed directory with plain
   ``torch.distributed.checkpoint.load`` into DTensors of the new layout (DCP's own
   resharding), the files' pages dropped from the page cache first (``posix_fadvise
   DONTNEED``: no root needed).

Every restore is checked bit-exactly against the saved tensors. Times are the slowest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from typing import Any, Dict, List

import torch

from .launcher import RankContext, launch, node_store_root

TENSORS = 16


def _global(i: int, rows: int, cols: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + i)
    return torch.randn(rows, cols, generator=g)


def _state(ctx: RankContext, rows: int, cols: int, empty: bool) -> Dict[str, Any]:
    from ..model.mapping import ShardedTensor

    out: Dict[str, Any] = {}
    for i in range(TENSORS):
        local = _global(i, rows, cols).chunk(ctx.world_size, 0)[ctx.rank]
        local = torch.zeros_like(local) if empty else local.clone()
        out[f"layer{i}.weight"] = ShardedTensor.from_rank_offsets(
            f"layer{i}.weight", local, (0, ctx.rank, ctx.world_size)
        )
    out["iteration"] = 7
    return out


def _manager(ctx: RankContext, **kw):
    from ..manager.checkpoint_manager import CheckpointManager

    return CheckpointManager(
        ctx.session, store_root=ctx.store_root, ranks_per_node=ctx.ranks_per_node, timeout_s=300, **kw
    )


def _save(ctx: RankContext, rows: int, cols: int, pdir: str) -> None:
    m = _manager(ctx, persistent_dir=pdir)
    m.save_local(_state(ctx, rows, cols, empty=False), 7).wait()
    m.flush().wait()
    m.close()


def _check(ctx: RankContext, got: Dict[str, Any], rows: int, cols: int) -> bool:
    ref = _state(ctx, rows, cols, empty=False)
    return all(torch.equal(got[k], ref[k].data) for k in ref if k != "iteration")


def _restore(ctx: RankContext, rows: int, cols: int) -> Dict[str, Any]:
    import torch.distributed as dist

    m = _manager(ctx)
    template = _state(ctx, rows, cols, empty=True)
    dist.barrier()
    t0 = time.perf_counter()
    state, it = m.load_local(template)
    seconds = time.perf_counter() - t0
    source = m.last_load_metrics.source
    m.close()
    return {"seconds": seconds, "exact": _check(ctx, state, rows, cols), "source": source}


def _drop_page_cache(directory: str) -> None:
    for dirpath, _, files in os.walk(directory):
        for f in files:
            fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _dcp_load(ctx: RankContext, rows: int, cols: int, path: str) -> Dict[str, Any]:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (ctx.world_size,))
    template = _state(ctx, rows, cols, empty=True)
    targets = {
        k: DTensor.from_local(v.data, mesh, [Shard(0)], run_check=False)
        for k, v in template.items()
        if k != "iteration"
    }
    if ctx.rank == 0:
        _drop_page_cache(path)
    dist.barrier()
    t0 = time.perf_counter()
    dcp.load(targets, checkpoint_id=path)
    seconds = time.perf_counter() - t0
    got = {k: t.to_local() for k, t in targets.items()}
    return {"seconds": seconds, "exact": _check(ctx, got, rows, cols), "source": "dcp"}


def run(mib: int, world: int, workdir: str) -> Dict[str, Any]:
    cols = 1024
    rows = max(world, (mib << 20) // (TENSORS * cols * 4) * world)
    rows -= rows % world
    shm = tempfile.mkdtemp(prefix="rckpt-elastic-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    disk = tempfile.mkdtemp(prefix="rckpt-elastic-dcp-", dir=workdir)
    rpn = world // 2
    try:
        launch(_save, world, shm, ranks_per_node=rpn, args=(rows, cols, disk), session="elastic-bench")
        same = launch(_restore, world, shm, ranks_per_node=rpn, args=(rows, cols), session="elastic-bench")
        shutil.rmtree(node_store_root(shm, 1))  # node 1 is lost, no replacement
        resharded = launch(_restore, rpn, shm, ranks_per_node=rpn, args=(rows, cols), session="elastic-bench")
        (flushed,) = [p for p in os.listdir(disk) if p.startswith("iter_")]
        from_disk = launch(
            _dcp_load, rpn, shm, ranks_per_node=rpn, args=(rows, cols, os.path.join(disk, flushed))
        )
    finally:
        shutil.rmtree(shm, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)
    rows_out: List[Dict[str, Any]] = []
    for name, res, ranks in (
        ("same-size restore from memory", same, world),
        ("resharded restore from memory", resharded, rpn),
        ("torch DCP reshard from disk (page cache dropped)", from_disk, rpn),
    ):
        rows_out.append(
            {
                "case": name,
                "ranks": ranks,
                "seconds": max(r["seconds"] for r in res),
                "bit_exact": all(r["exact"] for r in res),
                "source": res[0]["source"],
            }
        )
    same_s, resh_s, dcp_s = (r["seconds"] for r in rows_out)
    return {
        "bytes_per_saving_rank": rows * cols * 4 * TENSORS // world,
        "saved_world": world,
        "restored_world": rpn,
        "rows": rows_out,
        "resharded_vs_same_size": resh_s / same_s,
        "resharded_vs_dcp_from_disk": resh_s / dcp_s,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mib", type=int, default=256, help="MiB saved per rank (default 256)")
    p.add_argument("--world", type=int, default=4, help="saving ranks, on 2 nodes (default 4)")
    p.add_argument("--workdir", default=tempfile.gettempdir(), help="a directory on disk for the DCP copy")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    doc = run(a.mib, a.world, a.workdir)
    for r in doc["rows"]:
        print(f"{r['case']:<50s} {r['ranks']} ranks {r['seconds']:8.3f} s  bit-exact: {r['bit_exact']}")
    print(
        f"resharded / same-size: {doc['resharded_vs_same_size']:.2f} (target <= 2); "
        f"resharded / DCP from disk: {doc['resharded_vs_dcp_from_disk']:.2f} (target <= 0.3)"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
    return 0
