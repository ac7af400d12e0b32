"""Figures for the node daemon (layer 7): replication throughput daemon → daemon on loopback,
against what the machine's own transports do in the same run.

Measured, interleaved round by round so machine load hits every method alike:

1. **daemon → daemon**: two ``resilient-ckpt serve`` processes (separate store roots); this
   process publishes one checkpoint of ``--mib`` MiB in node 0's store and COMMITs it with
   ``wait``; the time from COMMIT to "replicated" (node 1 verified and published its copy).
   Also the CPU seconds per GB each daemon spent (from /proc, independent of load).
2. **daemon pull**: node 0 drops its copy and FETCH-pulls it back from node 1.
3. **raw ZeroMQ**: PUSH → PULL between two processes, 64 MiB frames, zero-copy send; the
   receiver either only touches the frames (upper bound) or copies them into one buffer
   (what a receiver that must land bytes in a segment does at least).
4. **gloo**: ``torch.distributed.send/recv`` of one tensor of the same size between 2 ranks.

Run: ``.venv/bin/python benchmarks/service_figures.py [--mib 512] [--rounds 3] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Dict, List

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the shared harness

FRAME = 64 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# --------------------------------------------------------------------------- raw ZeroMQ


def _zmq_receiver(port: int, total: int, rounds: int, copy_into: bool, sockbuf: int, q) -> None:
    import numpy as np
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.PULL)
    s.setsockopt(zmq.RCVHWM, 16)
    if sockbuf:
        s.setsockopt(zmq.RCVBUF, sockbuf)
    s.bind(f"tcp://127.0.0.1:{port}")
    dst = np.empty(total, np.uint8) if copy_into else None
    if dst is not None:
        dst.fill(0)  # fault the pages in once, like a reused store segment
    q.put("ready")
    for _ in range(rounds):
        off = 0
        while off < total:
            f = s.recv(copy=False)
            n = len(f)
            if dst is not None:
                np.copyto(dst[off : off + n], np.frombuffer(f.buffer, np.uint8))
            off += n
        q.put((time.perf_counter(), _cpu_s(os.getpid())))
    s.close(linger=0)
    ctx.term()


class RawZmq:
    def __init__(self, total: int, rounds: int, copy_into: bool, frame: int = FRAME, sockbuf: int = 0):
        import numpy as np
        import zmq

        self.total = total
        self.frame = frame
        self.q = mp.get_context("fork").Queue()
        port = _port()
        self.proc = mp.get_context("fork").Process(
            target=_zmq_receiver, args=(port, total, rounds, copy_into, sockbuf, self.q), daemon=True
        )
        self.proc.start()
        self.q.get(timeout=60)
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.SNDHWM, 16)
        if sockbuf:
            self.sock.setsockopt(zmq.SNDBUF, sockbuf)
        self.sock.connect(f"tcp://127.0.0.1:{port}")
        self.src = np.ones(total, np.uint8)
        self.view = memoryview(self.src)

    def round(self) -> Dict[str, float]:
        c0, cr0 = _cpu_s(os.getpid()), _cpu_s(self.proc.pid)
        t0 = time.perf_counter()
        for off in range(0, self.total, self.frame):
            self.sock.send(self.view[off : off + self.frame], copy=False)
        t1, cr1 = self.q.get(timeout=300)
        return {"seconds": t1 - t0, "sender_cpu_s": _cpu_s(os.getpid()) - c0, "receiver_cpu_s": cr1 - cr0}

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()
        self.proc.join(10)


# --------------------------------------------------------------------------- gloo


def _gloo_rank(ctx, total: int, rounds: int):
    import torch
    import torch.distributed as dist

    t = torch.ones(total, dtype=torch.uint8) if ctx.rank == 0 else torch.zeros(total, dtype=torch.uint8)
    out = []
    for _ in range(rounds + 1):  # first round warms up the connection
        dist.barrier()
        t0 = time.perf_counter()
        if ctx.rank == 0:
            dist.send(t, 1)
            dist.recv(torch.empty(1, dtype=torch.uint8), 1)  # ack: the receiver has every byte
        else:
            dist.recv(t, 0)
            dist.send(torch.zeros(1, dtype=torch.uint8), 0)
        out.append(time.perf_counter() - t0)
    return out[1:]


# --------------------------------------------------------------------------- daemons


class Daemons:
    """Two daemon processes on loopback, node 0 and node 1, in separate store roots."""

    def __init__(self, root: Path, total: int, extra: List[str]):
        from resilient_ckpt.service.client import DaemonClient
        from resilient_ckpt.service.wire.auth import write_secret_file

        self.root = root
        secret = root / "secret"
        write_secret_file(secret)
        os.environ["RESILIENT_CKPT_SECRET_FILE"] = str(secret)
        self.eps = {i: f"tcp://127.0.0.1:{_port()}" for i in range(2)}
        self.procs = []
        for i in range(2):
            peers = ",".join(f"{j}={e}" for j, e in self.eps.items() if j != i)
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "resilient_ckpt.service.daemon",
                        "--store-root",
                        str(root / f"node{i}"),
                        "--bind",
                        self.eps[i],
                        "--node-id",
                        str(i),
                        "--peers",
                        peers,
                        "--log-level",
                        "WARNING",
                        "--keep-last",
                        "1",
                        *extra,
                    ],
                    stderr=open(root / f"daemon{i}.log", "w"),
                )
            )
        self.c0 = DaemonClient(self.eps[0], "bench", timeout_s=120)
        self.c1 = DaemonClient(self.eps[1], "bench", timeout_s=120)
        self.c0.wait_ready(120)
        self.c1.wait_ready(120)
        self.total = total
        self.it = 0

    def _publish(self, node: int, owner: int, nbytes: int):
        import torch

        from resilient_ckpt.memory import checksum
        from resilient_ckpt.memory.layout import CheckpointHeader, plan_layout
        from resilient_ckpt.memory.store import CheckpointStore

        store = CheckpointStore(self.root / f"node{node}", "bench")
        # 64 tensors, like a model's parameters and optimizer states, not one blob
        sizes = [nbytes // 64] * 64
        layouts, total = plan_layout([(torch.uint8, (n,)) for n in sizes])
        seg = store.reserve(total)
        seg.buffer.fill_(self.it % 251)
        store.claim(seg, self.it, owner)
        mv = checksum.byte_view(seg.buffer)
        layouts = [replace(l, checksum=checksum.digest(mv[l.offset : l.offset + l.nbytes])) for l in layouts]
        header = CheckpointHeader(
            session="bench",
            iteration=self.it,
            owner=owner,
            world_size=2,
            tensors=tuple(layouts),
            data_nbytes=total,
            replication={"kind": "ring", "factor": 2, "jump": 1, "ranks_per_node": 1},
        )
        store.publish(seg, header)
        seg.close()
        return store, header

    def round(self) -> Dict[str, float]:
        from resilient_ckpt.service.client import header_digest

        # Rank 1 (node 1) saves a small checkpoint of the same iteration, so each iteration is
        # complete and the daemons' retention (--keep-last 1) recycles the previous segments:
        # the steady state of a job, where no transfer lands in fresh tmpfs pages.
        self._publish(1, 1, 64 * 1024)
        store, header = self._publish(0, 0, self.total)
        raw = store.header_path(header.id).read_bytes()
        c = [_cpu_s(p.pid) for p in self.procs]
        t0 = time.perf_counter()
        state = self.c0.commit(header.iteration, 0, 2, header_digest(raw), wait_s=300)
        push_s = time.perf_counter() - t0
        c1 = [_cpu_s(p.pid) for p in self.procs]
        assert state.state == "replicated", state
        # pull it back: node 0 drops its copy and fetches it from node 1
        self.c0.drop([(header.iteration, 0)])
        t0 = time.perf_counter()
        self.c0.fetch(header.iteration, 0, from_node=1, timeout=300)
        pull_s = time.perf_counter() - t0
        c2 = [_cpu_s(p.pid) for p in self.procs]
        self.it += 1
        return {
            "push_s": push_s,
            "pull_s": pull_s,
            "bytes": header.data_nbytes,
            "push_sender_cpu_s": c1[0] - c[0],
            "push_receiver_cpu_s": c1[1] - c[1],
            "pull_server_cpu_s": c2[1] - c1[1],
            "pull_receiver_cpu_s": c2[0] - c1[0],
        }

    def close(self) -> None:
        for p in self.procs:
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


# --------------------------------------------------------------------------- main


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--mib", type=int, default=512, help="checkpoint / transfer size (default %(default)s MiB)"
    )
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--root", default="/dev/shm", help="where the two daemons' store roots go (tmpfs)")
    p.add_argument("--json", help="also write the raw measurements here")
    p.add_argument("daemon_args", nargs="*", help="extra `serve` flags, e.g. --chunk-bytes 8M (after --)")
    args = p.parse_args()
    total = args.mib << 20
    root = Path(tempfile.mkdtemp(prefix="rc_service_bench_", dir=args.root))
    results: Dict[str, List[Dict[str, float]]] = {
        "daemon": [],
        "zmq_touch": [],
        "zmq_copy": [],
        "zmq_tuned": [],
        "gloo": [],
    }
    try:
        from harness import run_ranks

        daemons = Daemons(root, total, args.daemon_args)
        zt = RawZmq(total, args.rounds + 1, copy_into=False)
        zc = RawZmq(total, args.rounds + 1, copy_into=True)
        # the daemon's own settings: 4 MiB frames, 4 MiB kernel socket buffers
        zb = RawZmq(total, args.rounds + 1, copy_into=True, frame=4 << 20, sockbuf=4 << 20)
        for _ in range(2):  # warm-up: connections, page pools (two rounds fill the pools)
            daemons.round()
        zt.round(), zc.round(), zb.round()
        for _ in range(args.rounds):
            results["daemon"].append(daemons.round())
            results["zmq_touch"].append(zt.round())
            results["zmq_copy"].append(zc.round())
            results["zmq_tuned"].append(zb.round())
        gloo = run_ranks(_gloo_rank, 2, str(root), ranks_per_node=1, args=(total, args.rounds), timeout=600)
        results["gloo"] = [{"seconds": s} for s in gloo[0]]
        zt.close()
        zc.close()
        zb.close()
        daemons.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)

    gb = total / 1e9

    def rate(samples: List[float]) -> str:
        rates = [gb / s for s in samples]
        return f"{statistics.median(rates):5.2f} GB/s (best {max(rates):.2f})"

    def cpu(samples: List[float]) -> str:
        return f"{statistics.median(samples) / gb:.2f}"

    d, zt_, zc_ = results["daemon"], results["zmq_touch"], results["zmq_copy"]
    print(
        f"loopback, {args.mib} MiB per transfer, {args.rounds} interleaved rounds, median (best); "
        f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs"
    )
    print(f"{'method':44s} {'throughput':26s} CPU s/GB send | recv")
    print(
        f"{'daemon -> daemon push (COMMIT to replicated)':44s} {rate([r['push_s'] for r in d]):26s} "
        f"{cpu([r['push_sender_cpu_s'] for r in d])} | {cpu([r['push_receiver_cpu_s'] for r in d])}"
    )
    print(
        f"{'daemon <- daemon pull (FETCH pull)':44s} {rate([r['pull_s'] for r in d]):26s} "
        f"{cpu([r['pull_server_cpu_s'] for r in d])} | {cpu([r['pull_receiver_cpu_s'] for r in d])}"
    )
    print(
        f"{'raw ZeroMQ PUSH/PULL, 64 MiB zero-copy':44s} {rate([r['seconds'] for r in zt_]):26s} "
        f"{cpu([r['sender_cpu_s'] for r in zt_])} | {cpu([r['receiver_cpu_s'] for r in zt_])}"
    )
    print(
        f"{'raw ZeroMQ, receiver copies into a buffer':44s} {rate([r['seconds'] for r in zc_]):26s} "
        f"{cpu([r['sender_cpu_s'] for r in zc_])} | {cpu([r['receiver_cpu_s'] for r in zc_])}"
    )
    zb_ = results["zmq_tuned"]
    print(
        f"{'raw ZeroMQ, 4 MiB frames + 4 MiB SO_*BUF, copy':44s} {rate([r['seconds'] for r in zb_]):26s} "
        f"{cpu([r['sender_cpu_s'] for r in zb_])} | {cpu([r['receiver_cpu_s'] for r in zb_])}"
    )
    print(f"{'gloo send/recv (one tensor)':44s} {rate([r['seconds'] for r in results['gloo']]):26s}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"mib": args.mib, "rounds": args.rounds, "results": results, "loadavg": os.getloadavg()},
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
