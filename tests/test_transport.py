"""Point-to-point replication transport over torch.distributed (real gloo processes)."""

from __future__ import annotations

import mmap
import os
import time

import msgpack
import pytest
import torch
import torch.distributed as dist

from harness import run_ranks
from resilient_ckpt.errors import ReplicationError, StoreFullError
from resilient_ckpt.replication.transport import (
    Incoming,
    Outgoing,
    P2PTransport,
    new_checkpoint_group,
)

pytestmark = pytest.mark.multiprocess

CHUNK = 1000
# Empty, one byte, not a multiple of the chunk, exactly several chunks.
SIZES = (0, 1, 2 * CHUNK + 500, 4 * CHUNK)


def _expected(src: int, dst: int, i: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(src * 1_000_003 + dst * 1009 + i)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


class _Segments:
    """File-backed segments standing in for the store: a tensor mapped onto a file, so the
    test can read the file afterwards and see whether the bytes landed in *that* memory."""

    def __init__(self, root: str):
        os.makedirs(root, exist_ok=True)
        self.root = root
        self.maps = []

    def new(self, name: str, n: int, fill: torch.Tensor | None = None) -> torch.Tensor:
        path = os.path.join(self.root, name)
        with open(path, "wb") as f:
            f.truncate(n)
        if n == 0:
            return torch.empty(0, dtype=torch.uint8)
        with open(path, "r+b") as f:
            m = mmap.mmap(f.fileno(), n)
        self.maps.append(m)
        t = torch.frombuffer(m, dtype=torch.uint8)
        if fill is not None:
            t.copy_(fill)
        return t

    def file_bytes(self, name: str) -> bytes:
        with open(os.path.join(self.root, name), "rb") as f:
            return f.read()


def _header(src: int, i: int, n: int) -> bytes:
    return b"" if n == 0 else msgpack.packb({"src": src, "i": i, "n": n})


def _ring_exchange(ctx):
    w, r = ctx.world_size, ctx.rank
    nxt, prev = (r + 1) % w, (r - 1) % w
    seg = _Segments(os.path.join(ctx.tmp_root, f"rank{r}"))
    out = [
        Outgoing(nxt, _header(r, i, n), seg.new(f"out{i}", n, _expected(r, nxt, i, n)))
        for i, n in enumerate(SIZES)
    ]
    seen = []

    def allocate_for(i):
        def allocate(header: bytes, n: int) -> torch.Tensor:
            seen.append((i, header, n))
            return seg.new(f"in{i}", n)

        return allocate

    transport = P2PTransport(new_checkpoint_group(timeout_s=30), chunk_bytes=CHUNK)
    stats = transport.exchange(out, [Incoming(prev, allocate_for(i)) for i in range(len(SIZES))])
    exact = [
        seg.file_bytes(f"in{i}") == _expected(prev, r, i, n).numpy().tobytes() for i, n in enumerate(SIZES)
    ]
    return seen, exact, stats.bytes_sent, stats.bytes_received, dict(stats.per_peer)


def test_ring_of_three_sends_to_next_while_receiving_from_previous_bit_exactly(tmp_root):
    results = run_ranks(_ring_exchange, 3, tmp_root)
    for r, (seen, exact, sent, received, per_peer) in enumerate(results):
        prev, nxt = (r - 1) % 3, (r + 1) % 3
        # Several transfers on one pair arrive in list order with their own headers and sizes,
        # and each landed in the file-backed segment allocate() returned (no copy elsewhere).
        assert seen == [(i, _header(prev, i, n), n) for i, n in enumerate(SIZES)]
        assert exact == [True] * len(SIZES)
        total = sum(n + len(_header(r, i, n)) for i, n in enumerate(SIZES))
        assert sent == total and received == sum(n + len(_header(prev, i, n)) for i, n in enumerate(SIZES))
        assert per_peer[nxt].bytes_sent == total and per_peer[prev].bytes_received == received


def _swap(ctx, size):
    r, peer = ctx.rank, 1 - ctx.rank
    seg = _Segments(os.path.join(ctx.tmp_root, f"rank{r}"))
    payload = seg.new("out", size, _expected(r, peer, 0, size))
    dest = {}

    def allocate(header, n):
        dest["t"] = seg.new("in", n)
        dest["ptr"] = dest["t"].data_ptr()
        return dest["t"]

    # Different chunk sizes on the two ranks: message boundaries follow the sender's.
    transport = P2PTransport(new_checkpoint_group(timeout_s=30), chunk_bytes=(1 << 20, 300_001)[r])
    # Zero extra copies on CPU: gloo sends from the payload and receives into the segment.
    copies = []
    real_copy = torch.Tensor.copy_

    def counting_copy(self, *args, **kwargs):
        copies.append(self.numel())
        return real_copy(self, *args, **kwargs)

    torch.Tensor.copy_ = counting_copy
    try:
        stats = transport.exchange([Outgoing(peer, b"h%d" % r, payload)], [Incoming(peer, allocate)])
    finally:
        torch.Tensor.copy_ = real_copy
    want = _expected(peer, r, 0, size)
    return (
        seg.file_bytes("in") == want.numpy().tobytes(),
        dest["t"].data_ptr() == dest["ptr"] and torch.equal(dest["t"], want),
        torch.equal(payload, _expected(r, peer, 0, size)),  # the sender's bytes are untouched
        stats.bytes_received,
        copies,
    )


def test_two_ranks_swapping_at_once_do_not_deadlock_and_arrive_bit_exactly_without_copies(tmp_root):
    size = 3 * (1 << 20) + 7
    assert run_ranks(_swap, 2, tmp_root, args=(size,)) == [(True, True, True, size + 2, [])] * 2


def _dies(ctx, when):
    group = new_checkpoint_group(timeout_s=20)
    transport = P2PTransport(group, chunk_bytes=1 << 16)
    if ctx.rank == 1 and when == "before_sending":
        ctx.kill_self()

    def allocate(header, n):
        if ctx.rank == 1:  # "after_headers": die once sizes and headers went through
            ctx.kill_self()
        return torch.empty(n, dtype=torch.uint8)

    peer = 1 - ctx.rank
    start = time.monotonic()
    try:
        transport.exchange(
            [Outgoing(peer, b"hdr", torch.zeros(1 << 20, dtype=torch.uint8))],
            [Incoming(peer, allocate)],
        )
    except ReplicationError as e:
        return str(e), time.monotonic() - start
    return "no error", time.monotonic() - start


@pytest.mark.parametrize(
    "when, what", [("before_sending", "transfer sizes"), ("after_headers", "payload chunk")]
)
def test_a_peer_killed_mid_replication_raises_replication_error_naming_it(tmp_root, when, what):
    (msg, seconds), killed = run_ranks(_dies, 2, tmp_root, args=(when,), expect_killed=[1])
    assert "rank 1" in msg and what in msg, msg
    assert seconds < 15, seconds  # a connection error, not the 20 s group timeout


def _stuck(ctx):
    group = new_checkpoint_group(timeout_s=60)
    out = None
    if ctx.rank == 0:
        transport = P2PTransport(group, timeout=1.0)
        start = time.monotonic()
        try:
            transport.exchange([], [Incoming(1, lambda h, n: torch.empty(n, dtype=torch.uint8))])
            out = "no error"
        except ReplicationError as e:
            out = (str(e), time.monotonic() - start)
    # Rank 1 never sends; it waits here (default group) until rank 0 has given up.
    dist.barrier()
    return out


def test_a_stuck_peer_times_out_as_replication_error_instead_of_hanging(tmp_root):
    (msg, seconds), _ = run_ranks(_stuck, 2, tmp_root)
    assert "rank 1" in msg and "transfer sizes" in msg and "timeout 1 s" in msg, msg
    assert 0.9 <= seconds < 10, seconds


def _allocate_refuses(ctx):
    group = new_checkpoint_group(timeout_s=30)
    transport = P2PTransport(group, chunk_bytes=CHUNK)
    sizes = (5 * CHUNK + 3, 2 * CHUNK)
    if ctx.rank == 0:
        out = [Outgoing(1, b"x", _expected(0, 1, i, n)) for i, n in enumerate(sizes)]
        transport.exchange(out, [])
        transport.exchange([Outgoing(1, b"again", _expected(0, 1, 9, 77))], [])
        return None
    got = {}

    def refuse(header, n):
        raise StoreFullError(f"no room for {n} bytes")

    def accept(header, n):
        got[1] = torch.empty(n, dtype=torch.uint8)
        return got[1]

    try:
        transport.exchange([], [Incoming(0, refuse), Incoming(0, accept)])
        refused = "no error"
    except StoreFullError as e:
        refused = str(e)
    # The refused payload was drained, so the next transfer on the group is still in step.
    again = {}
    transport.exchange(
        [], [Incoming(0, lambda h, n: again.setdefault("t", torch.empty(n, dtype=torch.uint8)))]
    )
    return (
        refused,
        torch.equal(got[1], _expected(0, 1, 1, sizes[1])),
        torch.equal(again["t"], _expected(0, 1, 9, 77)),
    )


def test_a_refused_allocation_reraises_after_draining_and_the_group_stays_usable(tmp_root):
    _, (refused, second_ok, next_ok) = run_ranks(_allocate_refuses, 2, tmp_root)
    assert refused == f"no room for {5 * CHUNK + 3} bytes"
    assert second_ok and next_ok


def _bad_inputs(ctx):
    group = new_checkpoint_group(timeout_s=30)
    transport = P2PTransport(group)
    errors = []
    if ctx.rank == 0:
        ok = torch.zeros(4, dtype=torch.uint8)
        for outgoing in (
            Outgoing(0, b"", ok),  # to itself
            Outgoing(5, b"", ok),  # not in the group
            Outgoing(1, b"", torch.zeros(4, dtype=torch.float32)),
            Outgoing(1, b"", torch.zeros(2, 2, dtype=torch.uint8)),
            Outgoing(1, "text", ok),
        ):
            try:
                transport.exchange([outgoing], [])
                errors.append("no error")
            except ReplicationError as e:
                errors.append(str(e))
        for chunk in (0, -1, 1.5):
            try:
                P2PTransport(group, chunk_bytes=chunk)
                errors.append("no error")
            except ReplicationError as e:
                errors.append(str(e))
        transport.exchange([Outgoing(1, b"h", ok)], [])
    else:
        try:  # allocate returns the wrong size: rejected by name, bytes drained
            transport.exchange([], [Incoming(0, lambda h, n: torch.empty(n + 1, dtype=torch.uint8))])
            errors.append("no error")
        except ReplicationError as e:
            errors.append(str(e))
    dist.barrier(group=group)  # still in step
    return errors


def test_invalid_transfers_are_rejected_with_the_problem_and_fix(tmp_root):
    sender, receiver = run_ranks(_bad_inputs, 2, tmp_root)
    assert "cannot replicate to or from itself" in sender[0]
    assert "destination rank 5 is not a member" in sender[1]
    assert "contiguous 1-D uint8" in sender[2] and "torch.float32" in sender[2]
    assert "contiguous 1-D uint8" in sender[3] and "(2, 2)" in sender[3]
    assert "header for rank 1 must be bytes" in sender[4]
    assert all("chunk_bytes must be a positive integer" in m for m in sender[5:8])
    assert len(receiver) == 1
    assert "from rank 0 must return a contiguous 1-D uint8 tensor of 4 bytes" in receiver[0]
    assert "shape=(5,)" in receiver[0]


def _group_backend(ctx):
    return str(dist.get_backend(new_checkpoint_group()))


def test_checkpoint_group_is_a_separate_gloo_group_on_cpu(tmp_root):
    assert run_ranks(_group_backend, 2, tmp_root) == ["gloo", "gloo"]


def test_transport_without_a_process_group_says_to_initialize_one():
    assert not dist.is_initialized()
    with pytest.raises(ReplicationError, match="init_process_group"):
        P2PTransport()
    with pytest.raises(ReplicationError, match="init_process_group"):
        new_checkpoint_group()


def _staged_ring(ctx):
    w, r = ctx.world_size, ctx.rank
    nxt, prev = (r + 1) % w, (r - 1) % w
    transport = P2PTransport(new_checkpoint_group(timeout_s=30), chunk_bytes=CHUNK)
    # The path NCCL takes for host segments (and gloo for CUDA tensors): every chunk goes
    # through a bounce buffer on the communication device. Forced here so CPU CI covers it.
    transport._stage_all = True
    results, buffers = [], []
    for attempt in range(2):
        dest = {}
        transport.exchange(
            [Outgoing(nxt, b"", _expected(r, nxt, attempt, n)) for n in SIZES],
            [
                Incoming(
                    prev,
                    lambda h, n, i=i, dest=dest: dest.setdefault(i, torch.empty(n, dtype=torch.uint8)),
                )
                for i in range(len(SIZES))
            ],
        )
        results.append([torch.equal(dest[i], _expected(prev, r, attempt, n)) for i, n in enumerate(SIZES)])
        buffers.append(sorted(b.data_ptr() for b in transport._bounce.values()))
    return results, buffers[0] == buffers[1] and len(buffers[0]) > 0


def test_staged_transfers_through_reused_bounce_buffers_arrive_bit_exactly(tmp_root):
    for results, reused in run_ranks(_staged_ring, 3, tmp_root):
        assert results == [[True] * len(SIZES)] * 2
        assert reused


def _both_ways_posting_order(ctx):
    """Two ranks send each other 5 chunks and a remainder, in place and staged: the payload
    ops in posting order, and whether the bytes arrived."""
    peer = 1 - ctx.rank
    group = new_checkpoint_group(timeout_s=30)
    order = []
    post = dist.batch_isend_irecv

    def recording(ops):
        for op in ops:
            if op.tensor.dtype == torch.uint8:  # the payload chunks (no headers are sent)
                order.append("send" if op.op is dist.isend else "recv")
        return post(ops)

    dist.batch_isend_irecv = recording
    out = {}
    for staged in (False, True):
        transport = P2PTransport(group, chunk_bytes=CHUNK)
        transport._stage_all = staged
        n = 5 * CHUNK + 7
        dest = torch.empty(n, dtype=torch.uint8)
        order.clear()
        transport.exchange(
            [Outgoing(peer, b"", _expected(ctx.rank, peer, 0, n))],
            [Incoming(peer, lambda h, m, dest=dest: dest)],
        )
        out[staged] = (list(order), torch.equal(dest, _expected(peer, ctx.rank, 0, n)))
    return out


def test_gloo_posts_receives_before_sends_so_both_directions_move_at_once(tmp_root):
    # Issue 34: a gloo pair's "receive ready" notification posted after a send waits behind
    # that send's payload, so the peer's data waited for ours. Receives landing in place are
    # all posted before the first send; staged ones (one bounce buffer each) a round ahead.
    in_place = ["recv"] * 6 + ["send"] * 6
    staged = ["recv", "recv", "send", "recv", "send", "recv", "send", "recv", "send", "recv", "send", "send"]
    for out in run_ranks(_both_ways_posting_order, 2, tmp_root):
        assert out == {False: (in_place, True), True: (staged, True)}


def _sealed_swap(ctx):
    """Both ranks send a payload sealed by a final header made after the last byte left."""
    r, peer = ctx.rank, 1 - ctx.rank
    transport = P2PTransport(new_checkpoint_group(timeout_s=30), chunk_bytes=CHUNK)
    size = 3 * CHUNK + 5
    sent, got, dest = [], {}, {}

    def allocate(header, n):
        got["header"] = header
        dest["t"] = torch.empty(n, dtype=torch.uint8)
        return dest["t"]

    def on_chunk(lo, n):
        sent.append(lo + n)

    def seal():
        got["sent_before_seal"] = max(sent, default=0)
        return b"final %d" % r

    out = Outgoing(peer, b"first %d" % r, _expected(r, peer, 0, size), on_chunk=on_chunk, seal=seal)
    stats = transport.exchange([out], [Incoming(peer, allocate, seal=lambda f: got.setdefault("final", f))])
    first = (
        got["header"],
        got["final"],
        got["sent_before_seal"] == size,
        torch.equal(dest["t"], _expected(peer, r, 0, size)),
        stats.bytes_received,
    )

    # A seal that fails: the receiver is told (no final header), and the group stays in step.
    def failing_seal():
        raise RuntimeError("checksums failed")

    err = None
    try:
        if r == 0:
            transport.exchange([Outgoing(1, b"h", _expected(0, 1, 1, 77), seal=failing_seal)], [])
        else:
            transport.exchange([], [Incoming(0, lambda h, n: torch.empty(n, dtype=torch.uint8), seal=print)])
    except Exception as e:
        err = f"{type(e).__name__}: {e}"
    # Unsealed transfers to a receiver that takes seals still work.
    again = {}
    transport.exchange(
        [Outgoing(peer, b"plain", _expected(r, peer, 2, 99))],
        [Incoming(peer, lambda h, n: again.setdefault("t", torch.empty(n, dtype=torch.uint8)), seal=print)],
    )
    return first, err, torch.equal(again["t"], _expected(peer, r, 2, 99))


def test_a_sealed_transfer_delivers_its_final_header_after_the_last_byte_and_a_failed_seal_fails_both(
    tmp_root,
):
    out = run_ranks(_sealed_swap, 2, tmp_root)
    size = 3 * CHUNK + 5
    for r, (first, _, again_ok) in enumerate(out):
        assert first == (b"first %d" % (1 - r), b"final %d" % (1 - r), True, True, size + 7)
        assert again_ok
    assert out[0][1] == "RuntimeError: checksums failed"
    assert out[1][1].startswith("ReplicationError: rank 0 sent its payload but could not make its final")


def _ready_gated(ctx):
    """A sender whose payload is still being filled: each chunk waits for ``ready``; a
    ``ready`` that fails still sends (peers in step) and the seal tells the receiver."""
    transport = P2PTransport(new_checkpoint_group(timeout_s=30), chunk_bytes=CHUNK)
    size = 4 * CHUNK + 1
    if ctx.rank == 0:
        payload = torch.zeros(size, dtype=torch.uint8)
        want = _expected(0, 1, 0, size)
        events = []

        def ready(end):
            events.append(("ready", end))
            payload[:end] = want[:end]  # "staged" just in time

        def sent(lo, n):
            events.append(("sent", lo + n))

        transport.exchange(
            [Outgoing(1, b"h", payload, on_chunk=sent, ready=ready, seal=lambda: b"final")], []
        )

        def broken(end):
            if end > CHUNK:
                raise RuntimeError("copy failed")

        err = None
        try:
            transport.exchange([Outgoing(1, b"h", payload, ready=broken, seal=lambda: b"final")], [])
        except RuntimeError as e:
            err = str(e)
        return events, err
    got, finals = {}, []

    def allocate(header, n):
        got["t"] = torch.empty(n, dtype=torch.uint8)
        return got["t"]

    transport.exchange([], [Incoming(0, allocate, seal=finals.append)])
    ok = torch.equal(got["t"], _expected(0, 1, 0, size))
    err = None
    try:
        transport.exchange([], [Incoming(0, allocate, seal=finals.append)])
    except ReplicationError as e:
        err = str(e)
    return ok, finals, err


def test_each_chunk_waits_for_ready_and_a_failed_ready_fails_the_seal_on_both_ends(tmp_root):
    (events, send_err), (ok, finals, recv_err) = run_ranks(_ready_gated, 2, tmp_root)
    size = 4 * CHUNK + 1
    ends = [CHUNK, 2 * CHUNK, 3 * CHUNK, 4 * CHUNK, size]
    # every chunk's ready comes before that chunk is reported sent
    assert [e for e in events if e[0] == "ready"] == [("ready", e) for e in ends]
    for end in ends:
        assert events.index(("ready", end)) < events.index(("sent", end))
    assert ok and finals == [b"final", b""]
    assert send_err == "copy failed"
    assert recv_err.startswith("rank 0 sent its payload but could not make its final header")
