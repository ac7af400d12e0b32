"""Two nodes replicating to each other: one direction alone against both at once, per layer.

Issue 34: on two nodes each rank sends its replica to the other and receives the other's, over
the same pair of links, at once. This script times, on the project's fabric
(:mod:`resilient_ckpt.bench.fabric`: two network namespaces, one veth pair each to a bridge,
both ends shaped to the link rate), the same number of bytes moved

* ``one way``: node 0 → node 1 only;
* ``both ways``: node 0 → node 1 and node 1 → node 0 at the same time;

at each layer the replication goes through, bottom up:

1. ``raw 1 conn``: one TCP connection, each end writes ``--mib`` MiB while reading as much (a
   sender thread, a reader thread) — what a gloo pair is: one socket for both directions;
2. ``raw 2 conns``: one TCP connection per direction;
3. ``gloo p2p``: ``dist.isend`` / ``dist.irecv`` of 64 MiB tensors on a 2-rank gloo group,
   both posted before either is waited for;
4. ``transport``: :class:`~resilient_ckpt.replication.transport.P2PTransport` ``exchange`` from
   and into plain memory (64 MiB chunks, two rounds in flight);
5. ``save``: a full ``CheckpointManager.save_local`` of ``--mib`` MiB per rank, until the save
   is durable (stored, replicated to the other node, agreed) — one way: only rank 0 holds data
   (rank 1 saves 4 bytes), both ways: both do. The fourth save is timed (steady state, as
   ``resilient-ckpt bench``: three warm-up saves).

Each figure is given with its ratio to the link limit (bytes one direction must carry / link
rate); a pair that moves both directions at the link rate shows both-ways ≈ one-way ≈ 1.0x, a
pair that runs half duplex both-ways ≈ 2x. Every case runs ``--reps`` times, each in fresh
processes (the pair's start-up decides per run: the figures are bimodal), interleaved case by
case so load on the machine hits every case alike.

Run (as root): ``.venv/bin/python benchmarks/duplex_layers.py --rates 200M,1G --mib 64 --reps 3
[--layers raw1,raw2,gloo,transport,save] [--cc cubic] [--json out.json]``
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Dict, List, Optional

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MIB = 1 << 20
CHUNK = 64 << 20
PORT = 29611


# --------------------------------------------------------------------------- raw sockets


def _pump_out(sock: socket.socket, nbytes: int) -> None:
    buf = memoryview(bytearray(min(nbytes, 4 << 20)))
    left = nbytes
    while left:
        left -= sock.send(buf[: min(left, len(buf))])


def _pump_in(sock: socket.socket, nbytes: int) -> None:
    buf = memoryview(bytearray(4 << 20))
    left = nbytes
    while left:
        n = sock.recv_into(buf, min(left, len(buf)))
        if not n:
            raise ConnectionError(f"peer closed with {left} bytes to come")
        left -= n


def _connect(ctx, port: int, cc: Optional[str]) -> socket.socket:
    """Rank 1 connects to rank 0 (node 0's address); rank 0 accepts."""
    host = ctx.net.master_addr if ctx.net is not None else "127.0.0.1"
    if ctx.rank == 0:
        srv = socket.socket()
        srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if cc:
            srv.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        srv.bind((host, port))
        srv.listen(1)
        srv.settimeout(60)
        conn, _ = srv.accept()
        srv.close()
    else:
        conn = socket.socket()
        if cc:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, cc.encode())
        deadline = time.monotonic() + 60
        while True:
            try:
                conn.connect((host, port))
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(120)
    return conn


def _raw_rank(ctx, nbytes: int, both: bool, conns: int, cc: Optional[str]) -> float:
    """Seconds until this rank sent and received what it had to (``conns``: 1 or 2)."""
    import torch.distributed as dist

    socks = [_connect(ctx, PORT + i, cc) for i in range(conns)]
    out_sock = socks[0] if conns == 1 or ctx.rank == 0 else socks[1]
    in_sock = socks[0] if conns == 1 or ctx.rank == 1 else socks[1]
    sends = both or ctx.rank == 0
    recvs = both or ctx.rank == 1
    dist.barrier()
    t0 = time.perf_counter()
    writer = threading.Thread(target=_pump_out, args=(out_sock, nbytes)) if sends else None
    if writer:
        writer.start()
    if recvs:
        _pump_in(in_sock, nbytes)
    if writer:
        writer.join()
    seconds = time.perf_counter() - t0
    dist.barrier()
    for s in socks:
        s.close()
    return seconds


# --------------------------------------------------------------------------- gloo / transport


def _gloo_rank(ctx, nbytes: int, both: bool, recv_first: bool = False) -> float:
    import torch
    import torch.distributed as dist

    group = dist.new_group(backend="gloo")
    peer = 1 - ctx.rank
    n = -(-nbytes // CHUNK)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    dist.barrier(group=group)
    t0 = time.perf_counter()
    works = []
    for i in range(n):
        lo, hi = i * CHUNK, min(nbytes, (i + 1) * CHUNK)
        if recv_first and (both or ctx.rank == 1):
            works.append(dist.irecv(dst[lo:hi], peer, group=group))
        if both or ctx.rank == 0:
            works.append(dist.isend(src[lo:hi], peer, group=group))
        if not recv_first and (both or ctx.rank == 1):
            works.append(dist.irecv(dst[lo:hi], peer, group=group))
    for w in works:
        w.wait()
    seconds = time.perf_counter() - t0
    dist.barrier(group=group)
    dist.destroy_process_group(group)
    return seconds


def _transport_rank(ctx, nbytes: int, both: bool, ahead: bool = True) -> float:
    import torch
    import torch.distributed as dist

    from resilient_ckpt.replication.transport import Incoming, Outgoing, P2PTransport, new_checkpoint_group

    group = new_checkpoint_group("gloo", timeout_s=300)
    transport = P2PTransport(group, timeout=300)
    transport._receives_ahead = ahead
    peer = 1 - ctx.rank
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    out = [Outgoing(peer, b"h", src)] if both or ctx.rank == 0 else []
    inc = [Incoming(peer, lambda _h, _n: dst)] if both or ctx.rank == 1 else []
    dist.barrier(group=group)
    t0 = time.perf_counter()
    transport.exchange(out, inc)
    seconds = time.perf_counter() - t0
    dist.barrier(group=group)
    return seconds


def _save_rank(ctx, nbytes: int, both: bool, ahead: bool = True) -> float:
    import torch

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.model.mapping import ShardedTensor

    n = nbytes // 4 if both or ctx.rank == 0 else 1  # one way: rank 1 saves 4 bytes
    key = f"w{ctx.rank}"
    state = {key: ShardedTensor.from_rank_offsets(key, torch.arange(n, dtype=torch.float32) + ctx.rank)}
    mgr = CheckpointManager(store_root=ctx.store_root, session="duplex", timeout_s=300)
    mgr._transport._receives_ahead = ahead
    try:
        for it in (1, 2, 3):  # as the bench: steady state once retention recycles segments
            mgr.save_local(state, it, is_async=False)
        t0 = time.perf_counter()
        handle = mgr.save_local(state, 4)
        handle.wait_staged()
        handle.wait()
        seconds = time.perf_counter() - t0
        m = mgr.last_save_metrics
        parts = ("staging_s", "checksum_s", "publish_s", "replication_s", "agreement_s")
        print(f"    rank {ctx.rank}: " + " ".join(f"{p[:-2]} {getattr(m, p):.3f}" for p in parts), flush=True)
        return seconds
    finally:
        mgr.close()


# --------------------------------------------------------------------------- driver

LAYERS = {
    "raw1": ("raw 1 conn", lambda nbytes, both, cc: (_raw_rank, (nbytes, both, 1, cc))),
    "raw2": ("raw 2 conns", lambda nbytes, both, cc: (_raw_rank, (nbytes, both, 2, cc))),
    "gloo": ("gloo p2p", lambda nbytes, both, cc: (_gloo_rank, (nbytes, both))),
    "gloo-rf": ("gloo p2p recv 1st", lambda nbytes, both, cc: (_gloo_rank, (nbytes, both, True))),
    "transport": ("transport", lambda nbytes, both, cc: (_transport_rank, (nbytes, both))),
    "transport-old": (
        "transport, sends 1st",
        lambda nbytes, both, cc: (_transport_rank, (nbytes, both, False)),
    ),
    "save": ("save to durable", lambda nbytes, both, cc: (_save_rank, (nbytes, both))),
    "save-old": ("save, sends 1st", lambda nbytes, both, cc: (_save_rank, (nbytes, both, False))),
}


def _set_cc(fabric, cc: str) -> None:
    for node in range(fabric.nodes):
        p = fabric.run(node, ["sysctl", "-qw", f"net.ipv4.tcp_congestion_control={cc}"])
        if p.returncode:
            raise SystemExit(f"cannot set {cc} in node {node}'s namespace: {p.stderr.strip()}")


def measure(rate_bps: int, nbytes: int, reps: int, layers: List[str], cc: Optional[str]) -> Dict[str, Any]:
    from resilient_ckpt.bench.fabric import Fabric, LinkShape
    from resilient_ckpt.bench.launcher import launch

    limit = nbytes * 8 / rate_bps
    out: Dict[str, Any] = {"rate_bps": rate_bps, "bytes": nbytes, "link_limit_s": limit, "layers": {}}
    with Fabric(2, LinkShape(rate_bps=rate_bps)) as fabric:
        if cc:
            _set_cc(fabric, cc)
        for rep in range(reps):
            for layer in layers:
                for both in (False, True):
                    fn, args = LAYERS[layer][1](nbytes, both, cc)
                    with tempfile.TemporaryDirectory(dir=str(fabric.root)) as root:
                        times = launch(fn, 2, root, args=args, ranks_per_node=1, fabric=fabric, timeout=600)
                    key = "both" if both else "one"
                    out["layers"].setdefault(layer, {"one": [], "both": []})[key].append(max(times))
                    print(
                        f"  rep {rep + 1} {LAYERS[layer][0]:>16} {key:>4}: {max(times):7.3f} s "
                        f"({max(times) / limit:.2f}x the link limit)",
                        flush=True,
                    )
    return out


def table(results: List[Dict[str, Any]]) -> str:
    lines = [
        "| link | MiB | layer | one way (s) | both ways (s) | one / limit | both / limit | runs both ways (x limit) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lim = r["link_limit_s"]
        for layer, v in r["layers"].items():
            one, both = statistics.median(v["one"]), statistics.median(v["both"])
            runs = ", ".join(f"{t / lim:.2f}" for t in v["both"])
            lines.append(
                f"| {r['rate_bps'] / 1e6:g} Mbit/s | {r['bytes'] // MIB} | {LAYERS[layer][0]} | {one:.3f} | "
                f"{both:.3f} | {one / lim:.2f}x | {both / lim:.2f}x | {runs} |"
            )
    return "\n".join(lines)


def main() -> None:
    from resilient_ckpt.bench.fabric import parse_rate, unavailable

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rates", default="200M,1G")
    ap.add_argument("--mib", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", default="raw1,raw2,gloo,transport,save")
    ap.add_argument("--cc", default=None, help="TCP congestion control in the nodes (default: the host's)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    reason = unavailable()
    if reason:
        raise SystemExit(f"no fabric here: {reason}")
    layers = args.layers.split(",")
    for layer in layers:
        if layer not in LAYERS:
            raise SystemExit(f"unknown layer {layer!r}; choose from {', '.join(LAYERS)}")
    results = []
    for rate in args.rates.split(","):
        bps = parse_rate(rate)
        print(f"{rate}: {args.mib} MiB each way, link limit {args.mib * MIB * 8 / bps:.3f} s", flush=True)
        results.append(measure(bps, args.mib * MIB, args.reps, layers, args.cc))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
