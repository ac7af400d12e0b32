"""The machine's own limits, measured in the same run as the systems they bound.

* ``memcpy_bandwidth``: ``torch`` ``copy_`` of a large CPU tensor into a pre-faulted
  destination (default threads and 1 thread) - what staging into host memory can reach;
* ``shm_memcpy_bandwidth``: the same into a pre-faulted ``mmap`` of a ``/dev/shm`` file - what
  writing a shared-memory store can reach;
* ``gloo_p2p_bandwidth``: ``torch.distributed`` send/recv of large tensors between 2 processes
  on loopback - what replication over the trainer's process group can reach;
* ``zmq_bandwidth``: ZeroMQ PAIR sockets on loopback, 2 processes, zero-copy multipart frames
  of 64 MiB - what daemon-to-daemon replication can reach;
* ``cuda_copy_bandwidth`` (``--device cuda`` only): ``copy_`` between a CUDA tensor and
  page-locked host memory, device-to-host and host-to-device, timed with CUDA events - what
  staging from the GPU into pinned shared memory, and a restore into GPU tensors, can reach.

All return bytes per second (medians over repetitions). The two transport measurements start
their own processes with the bench launcher (:func:`resilient_ckpt.bench.launcher.launch`);
given a network fabric (:mod:`.fabric`) they run between its nodes 0 and 1 instead, through
node 1's shaped link: what that link actually delivers (:func:`link_limits`).
"""

from __future__ import annotations

import mmap
import os
import statistics
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Dict, Iterator, List, Optional

import torch

from ..errors import ValidationError

if TYPE_CHECKING:
    from .fabric import Fabric

FRAME_BYTES = 64 << 20


def _check_positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValidationError(f"{name}={value!r}: pass a positive integer number of bytes/reps")


@contextmanager
def _threads(n: Optional[int]) -> Iterator[None]:
    old = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


def _timed_copies(dst: torch.Tensor, src: torch.Tensor, reps: int) -> float:
    dst.copy_(src)  # warm-up: faults in both sides, spins up the thread pool
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return src.numel() * src.element_size() / statistics.median(times)


def memcpy_bandwidth(nbytes: int = 1 << 30, *, threads: Optional[int] = None, reps: int = 5) -> float:
    """Bytes/s of ``dst.copy_(src)`` between pre-faulted CPU tensors (``threads=None``: torch's
    default thread count)."""
    _check_positive("nbytes", nbytes)
    _check_positive("reps", reps)
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)
    with _threads(threads):
        return _timed_copies(dst, src, reps)


def fresh_memcpy_bandwidth(nbytes: int = 1 << 30, *, reps: int = 3) -> float:
    """Bytes/s of copying into a *newly allocated* tensor (page faults included): what a save
    that allocates its staging buffers every time pays. Not a limit; shown for context."""
    _check_positive("nbytes", nbytes)
    _check_positive("reps", reps)
    src = torch.ones(nbytes, dtype=torch.uint8)
    times = []
    with _threads(1):
        for _ in range(reps):
            t0 = time.perf_counter()
            dst = torch.empty_like(src)
            dst.copy_(src)
            times.append(time.perf_counter() - t0)
            del dst
    return nbytes / statistics.median(times)


def shm_memcpy_bandwidth(
    nbytes: int = 1 << 30, *, threads: Optional[int] = None, reps: int = 5, directory: str = "/dev/shm"
) -> float:
    """Bytes/s of ``copy_`` into a pre-faulted shared mapping of a file in ``directory``."""
    _check_positive("nbytes", nbytes)
    _check_positive("reps", reps)
    if not os.path.isdir(directory):
        raise ValidationError(f"{directory!r} is not a directory: pass a tmpfs mount point")
    fd, path = tempfile.mkstemp(prefix="rckpt-limits-", dir=directory)
    try:
        os.ftruncate(fd, nbytes)
        mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            dst = torch.frombuffer(mm, dtype=torch.uint8)
            dst.fill_(0)  # pre-fault: tmpfs pages allocated before timing
            src = torch.ones(nbytes, dtype=torch.uint8)
            with _threads(threads):
                bw = _timed_copies(dst, src, reps)
            del dst  # release the buffer export before closing the mapping
        finally:
            mm.close()
    finally:
        os.close(fd)
        os.unlink(path)
    return bw


# --- transports (run inside launcher ranks) ------------------------------------------------


def _gloo_rank(ctx, total: int, chunk: int, reps: int) -> Optional[float]:
    import torch.distributed as dist

    n = max(1, total // chunk)
    buf = torch.ones(chunk, dtype=torch.uint8) if ctx.rank == 0 else torch.zeros(chunk, dtype=torch.uint8)
    ack = torch.zeros(1, dtype=torch.int64)
    times: List[float] = []
    for rep in range(reps + 1):  # first round is a warm-up (connection set-up, page faults)
        dist.barrier()
        t0 = time.perf_counter()
        if ctx.rank == 0:
            for _ in range(n):
                dist.send(buf, 1)
            dist.recv(ack, 1)  # the receiver has everything
        else:
            for _ in range(n):
                dist.recv(buf, 0)
            dist.send(ack, 0)
        if rep:
            times.append(time.perf_counter() - t0)
    return n * chunk / statistics.median(times) if ctx.rank == 0 else None


def _ring_rank(ctx, total: int, chunk: int, reps: int) -> float:
    """Every rank sends ``total`` bytes to the next rank and receives as much from the previous
    one, all at once (what ring replication does), with the checkpoint transport from and into
    plain memory (no staging, checksums or store); this rank's bytes/s each way."""
    import torch.distributed as dist

    from ..replication.transport import Incoming, Outgoing, P2PTransport, new_checkpoint_group

    group = new_checkpoint_group("gloo", timeout_s=600)
    transport = P2PTransport(group, chunk_bytes=chunk, timeout=600)
    w, r = ctx.world_size, ctx.rank
    src = torch.ones(total, dtype=torch.uint8)
    dst = torch.zeros(total, dtype=torch.uint8)
    times: List[float] = []
    for rep in range(reps + 1):  # the first round is a warm-up
        dist.barrier(group=group)
        t0 = time.perf_counter()
        transport.exchange([Outgoing((r + 1) % w, b"", src)], [Incoming((r - 1) % w, lambda _h, _n: dst)])
        dist.barrier(group=group)
        if rep:
            times.append(time.perf_counter() - t0)
    return total / statistics.median(times)


def _zmq_rank(ctx, port: int, total: int, frame: int, reps: int) -> Optional[float]:
    import zmq

    host = ctx.net.master_addr if ctx.net is not None else "127.0.0.1"  # rank 0's node
    n = max(1, total // frame)
    zctx = zmq.Context()
    sock = zctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, 120_000)
    sock.setsockopt(zmq.SNDTIMEO, 120_000)
    try:
        if ctx.rank == 0:
            sock.bind(f"tcp://{host}:{port}")
            payload = memoryview(torch.ones(frame, dtype=torch.uint8).numpy())
            times: List[float] = []
            for rep in range(reps + 1):
                sock.recv()  # receiver ready
                t0 = time.perf_counter()
                for i in range(n):
                    # a small header frame + the data frame, sent without copying
                    sock.send_multipart([i.to_bytes(8, "little"), payload], copy=False)
                sock.recv()  # receiver has everything
                if rep:
                    times.append(time.perf_counter() - t0)
            return n * frame / statistics.median(times)
        sock.connect(f"tcp://{host}:{port}")
        for _ in range(reps + 1):
            sock.send(b"ready")
            got = 0
            for _ in range(n):
                parts = sock.recv_multipart(copy=False)
                got += len(parts[1].buffer)
            if got != n * frame:
                raise ValidationError(f"zmq receiver got {got} bytes, expected {n * frame}")
            sock.send(b"done")
        return None
    finally:
        sock.close(0)
        zctx.term()


def gloo_p2p_bandwidth(
    total: int = 1 << 30, *, chunk: int = FRAME_BYTES, reps: int = 3, fabric: Optional["Fabric"] = None
) -> float:
    """Bytes/s of gloo send/recv of ``chunk``-byte tensors between 2 processes on loopback (or
    from node 0 to node 1 of ``fabric``)."""
    from .launcher import launch

    _check_positive("total", total)
    _check_positive("chunk", chunk)
    with tempfile.TemporaryDirectory(prefix="rckpt-limits-") as root:
        out = launch(
            _gloo_rank, 2, root, args=(total, min(chunk, total), reps), ranks_per_node=1, fabric=fabric
        )
    return out[0]


def zmq_bandwidth(
    total: int = 1 << 30, *, frame: int = FRAME_BYTES, reps: int = 3, fabric: Optional["Fabric"] = None
) -> float:
    """Bytes/s of ZeroMQ zero-copy multipart messages between 2 processes on loopback (or
    from node 1 to node 0 of ``fabric``)."""
    from .launcher import free_port, launch

    _check_positive("total", total)
    _check_positive("frame", frame)
    with tempfile.TemporaryDirectory(prefix="rckpt-limits-") as root:
        out = launch(
            _zmq_rank,
            2,
            root,
            args=(free_port(), total, min(frame, total), reps),
            init_process_group=False,
            ranks_per_node=1,
            fabric=fabric,
        )
    return out[0]


def gloo_ring_bandwidth(
    fabric: "Fabric", total: int = 1 << 30, *, chunk: int = FRAME_BYTES, reps: int = 2
) -> float:
    """Bytes/s each node sends (and receives) when every node of ``fabric`` sends to the next
    one at once with the checkpoint transport (gloo), one rank per node: the fabric's own bound
    on ring replication (on one host every link shares the same CPUs)."""
    from .launcher import launch

    with tempfile.TemporaryDirectory(prefix="rckpt-limits-") as root:
        out = launch(
            _ring_rank,
            fabric.nodes,
            root,
            args=(total, min(chunk, total), reps),
            ranks_per_node=1,
            fabric=fabric,
        )
    return min(out)


def link_limits(fabric: "Fabric", total: int = 1 << 30, *, reps: int = 2) -> Dict[str, Any]:
    """What the links of ``fabric`` deliver, in bytes/s: gloo send/recv (node 0 to node 1) and
    ZeroMQ with the daemon's 4 MiB frames (node 1 to node 0), each alone on the fabric
    (``link_bps``: the better); and, with two or more nodes, every node sending to
    the next at once (``ring_bps``, per node)."""
    from .fabric import format_rate

    out: Dict[str, Any] = {
        "gloo_p2p_bps": gloo_p2p_bandwidth(total, reps=reps, fabric=fabric),
        "zmq_bps": zmq_bandwidth(total, frame=4 << 20, reps=reps, fabric=fabric),
    }
    out["link_bps"] = max(out["gloo_p2p_bps"], out["zmq_bps"])
    text = f"one link alone delivers {format_rate(out['link_bps'] * 8)}"
    # two nodes: one pair both ways (run one direction after the other before issue 34's fix)
    if fabric.nodes >= 2:
        out["ring_bps"] = gloo_ring_bandwidth(fabric, total // 2, reps=reps)
        text += f"; {fabric.nodes} nodes sending at once, {format_rate(out['ring_bps'] * 8)} each"
    out["describe"] = f"{fabric.describe()}: {text}"
    return out


def cuda_copy_bandwidth(
    nbytes: int = 1 << 30, *, direction: str = "d2h", reps: int = 5, device: Optional[str] = None
) -> float:
    """Bytes/s of ``copy_`` between a CUDA tensor and pinned host memory (``direction``
    ``"d2h"``: device to host, ``"h2d"``: host to device), median of ``reps`` after a warm-up,
    timed with CUDA events on the current stream."""
    _check_positive("nbytes", nbytes)
    _check_positive("reps", reps)
    if direction not in ("d2h", "h2d"):
        raise ValidationError(f"direction={direction!r}: use 'd2h' or 'h2d'")
    if not torch.cuda.is_available():
        raise ValidationError("cuda_copy_bandwidth needs a CUDA device; torch sees none")
    dev = torch.device(device) if device else torch.device("cuda", torch.cuda.current_device())
    gpu = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    host = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)
    dst, src = (host, gpu) if direction == "d2h" else (gpu, host)
    try:
        dst.copy_(src, non_blocking=True)  # warm-up
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
    finally:
        torch.cuda.synchronize(dev)
        del gpu, host, dst, src
        torch.cuda.empty_cache()
    return nbytes / statistics.median(times)


@dataclass(frozen=True)
class MachineLimits:
    """Bandwidths in bytes/s and the buffer sizes they were measured with.

    ``d2h_pinned_bps`` / ``h2d_pinned_bps``: GPU <-> page-locked host copies, measured only for
    ``device="cuda"`` (None otherwise)."""

    memcpy_bps: float
    memcpy_1thread_bps: float
    shm_memcpy_bps: float
    shm_memcpy_1thread_bps: float
    fresh_memcpy_1thread_bps: float
    gloo_p2p_bps: float
    zmq_bps: float
    threads: int
    memcpy_bytes: int
    transport_bytes: int
    d2h_pinned_bps: Optional[float] = None
    h2d_pinned_bps: Optional[float] = None
    device: str = "cpu"
    cuda_devices: Optional[int] = None

    @property
    def p2p_bps(self) -> float:
        """The best loopback point-to-point transport measured."""
        return max(self.gloo_p2p_bps, self.zmq_bps)

    def to_dict(self) -> Dict[str, float]:
        d = asdict(self)
        d["p2p_bps"] = self.p2p_bps
        return d


def measure_limits(
    *,
    quick: bool = False,
    memcpy_bytes: Optional[int] = None,
    transport_bytes: Optional[int] = None,
    device: str = "cpu",
) -> MachineLimits:
    """All limits; ``quick`` uses small buffers (seconds instead of tens of seconds);
    ``device="cuda"`` adds the GPU <-> pinned host copy bandwidths."""
    mb = memcpy_bytes or ((64 << 20) if quick else (1 << 30))
    tb = transport_bytes or ((256 << 20) if quick else (1 << 30))
    reps = 3 if quick else 5
    cuda = {}
    if device == "cuda":
        cuda = dict(
            d2h_pinned_bps=cuda_copy_bandwidth(mb, direction="d2h", reps=reps),
            h2d_pinned_bps=cuda_copy_bandwidth(mb, direction="h2d", reps=reps),
            device="cuda",
            cuda_devices=torch.cuda.device_count(),
        )
    return MachineLimits(
        memcpy_bps=memcpy_bandwidth(mb, reps=reps),
        memcpy_1thread_bps=memcpy_bandwidth(mb, threads=1, reps=reps),
        shm_memcpy_bps=shm_memcpy_bandwidth(mb, reps=reps),
        shm_memcpy_1thread_bps=shm_memcpy_bandwidth(mb, threads=1, reps=reps),
        fresh_memcpy_1thread_bps=fresh_memcpy_bandwidth(mb, reps=3),
        gloo_p2p_bps=gloo_p2p_bandwidth(tb, reps=2 if quick else 3),
        zmq_bps=zmq_bandwidth(tb, reps=2 if quick else 3),
        threads=torch.get_num_threads(),
        memcpy_bytes=mb,
        transport_bytes=tb,
        **cuda,
    )
