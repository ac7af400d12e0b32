"""How fast this machine hands out fresh shared-memory pages, file after file.

Two processes (two ranks' save paths) each create one tmpfs file after another in /dev/shm,
``posix_fallocate`` it and map it populated — what ``CheckpointStore.reserve`` does for a
segment of fresh pages — and print the seconds each file took. On a machine whose memory is
all backed the times stay flat; on a VM whose host backs guest memory lazily or reclaims what
the guest has not touched lately, they jump once the run goes beyond memory it touched
recently (this project's CI VM: 0.43-0.63 s per 768 MiB file for the first 7.5-9 GiB, then
1.6-2.5 s; see docs/benchmarks.md, ``ours-keep2``'s third save).

    python3 benchmarks/fresh_pages.py [--mib 768] [--files 8] [--dir /dev/shm]
"""

from __future__ import annotations

import argparse
import mmap
import multiprocessing as mp
import os
import time


def _worker(index: int, args: argparse.Namespace, barrier, results) -> None:
    nbytes = args.mib << 20
    paths = [os.path.join(args.dir, f"fresh_pages_{os.getppid()}_{index}_{k}") for k in range(args.files)]
    seconds = []
    try:
        for path in paths:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                barrier.wait()  # both processes fault pages in at the same time
                t0 = time.perf_counter()
                os.posix_fallocate(fd, 0, nbytes)
                mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED | mmap.MAP_POPULATE)
                seconds.append(time.perf_counter() - t0)
                mapping.close()
            finally:
                os.close(fd)
    finally:
        for path in paths:
            if os.path.exists(path):
                os.unlink(path)
    results.put((index, seconds))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, default=768, help="size of each file (MiB)")
    parser.add_argument("--files", type=int, default=8, help="files per process")
    parser.add_argument("--dir", default="/dev/shm", help="a tmpfs directory")
    args = parser.parse_args()
    barrier, results = mp.Barrier(2), mp.Queue()
    procs = [mp.Process(target=_worker, args=(i, args, barrier, results)) for i in range(2)]
    for p in procs:
        p.start()
    per_process = dict(results.get() for _ in procs)
    for p in procs:
        p.join()
    for k in range(args.files):
        total = 2 * (k + 1) * args.mib / 1024
        times = ", ".join(f"{per_process[i][k]:.3f}" for i in sorted(per_process))
        print(f"file {k + 1} (both processes: {total:.1f} GiB so far): {times} s")


if __name__ == "__main__":
    main()
