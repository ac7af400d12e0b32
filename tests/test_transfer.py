"""Moving stored bytes into restore targets (``memory.transfer``): exact, verified on the way.

Every read lands byte-exactly in its target (CPU, and CUDA through the page-locked ring when a
GPU is present), whatever the sizes relative to the chunk and ring; a tensor whose bytes do not
match its checksum, or a file that ends early, is named — never silently restored.
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_ckpt.memory import checksum, transfer
from resilient_ckpt.memory.transfer import Read, read_into

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _file(tmp_path, blobs):
    """Write ``blobs`` back to back; returns (path, [(offset, nbytes, digest)])."""
    path = tmp_path / "seg.data"
    out, pos = [], 0
    with open(path, "wb") as f:
        for b in blobs:
            f.write(b)
            out.append((pos, len(b), checksum.digest(b)))
            pos += len(b)
    return str(path), out


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks and a ring far smaller than the tensors: every chunk boundary is exercised."""
    monkeypatch.setattr(transfer, "CHUNK_BYTES", 4096)
    monkeypatch.setattr(transfer.PinnedRing, "_shared", None)
    monkeypatch.setattr(transfer.PinnedRing.__init__, "__defaults__", (4096,))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    sizes=st.lists(st.integers(0, 20_000), min_size=1, max_size=6),
    threads=st.integers(1, 4),
    seed=st.integers(0, 1000),
)
@pytest.mark.parametrize("device", DEVICES)
def test_every_read_lands_byte_exactly_in_its_target(
    tmp_path_factory, small_chunks, device, sizes, threads, seed
):
    tmp = tmp_path_factory.mktemp("t")
    g = torch.Generator().manual_seed(seed)
    blobs = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes() for n in sizes]
    path, where = _file(tmp, blobs)
    targets = [torch.full((n,), 7, dtype=torch.uint8, device=device) for n in sizes]
    reads = [Read(off, n, d, t, i) for i, ((off, n, d), t) in enumerate(zip(where, targets))]
    moved = read_into(path, reads, threads=threads)
    moved.fence()
    assert moved.failed == [] and moved.short == [] and moved.nbytes == sum(sizes)
    for b, t in zip(blobs, targets):
        assert t.cpu().numpy().tobytes() == b


@pytest.mark.parametrize("device", DEVICES)
def test_a_tensor_failing_its_checksum_or_cut_short_is_named(tmp_path, small_chunks, device):
    blobs = [os.urandom(10_000), os.urandom(5_000), os.urandom(3_000)]
    path, where = _file(tmp_path, blobs)
    (o0, n0, d0), (o1, n1, _), (o2, n2, d2) = where
    reads = [
        Read(o0, n0, d0, torch.empty(n0, dtype=torch.uint8, device=device), 0),
        Read(o1, n1, 12345, torch.empty(n1, dtype=torch.uint8, device=device), 1),  # wrong digest
        Read(o2 + 1000, n2, d2, torch.empty(n2, dtype=torch.uint8, device=device), 2),  # past the end
    ]
    moved = read_into(path, reads, threads=2)
    moved.fence()
    assert moved.failed == [1] and moved.short == [2]
    assert reads[0].target.cpu().numpy().tobytes() == blobs[0]


def test_typed_targets_of_every_shape_take_their_bytes(tmp_path):
    src = [torch.randn(3, 5), torch.arange(7, dtype=torch.int64), torch.tensor(2.5, dtype=torch.bfloat16)]
    blobs = [checksum.byte_view(t).tobytes() for t in src]
    path, where = _file(tmp_path, blobs)
    targets = [torch.zeros_like(t) for t in src]
    moved = read_into(path, [Read(o, n, d, t, i) for i, ((o, n, d), t) in enumerate(zip(where, targets))])
    assert moved.failed == [] and all(torch.equal(a, b) for a, b in zip(src, targets))


@settings(max_examples=30, deadline=None)
@given(
    layout=st.lists(st.tuples(st.integers(0, 3000), st.integers(0, 5000)), min_size=1, max_size=80),
    corrupt=st.sets(st.integers(0, 79), max_size=4),
    past_end=st.booleans(),
    threads=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_many_small_tensors_read_in_batches_land_exactly_and_bad_ones_are_named(
    tmp_path_factory, layout, corrupt, past_end, threads, seed
):
    # Small tensors with padding between them (some gaps wider than a batch reads over), as a
    # state dict of thousands of small tensors is stored: batched reads must give each its own
    # bytes and name exactly the ones whose checksum fails or that the file cuts short.
    path = tmp_path_factory.mktemp("b") / "seg.data"
    g = torch.Generator().manual_seed(seed)
    blobs, reads, pos = [], [], 0
    with open(path, "wb") as f:
        for i, (n, gap) in enumerate(layout):
            f.write(b"\xee" * gap)
            pos += gap
            b = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes()
            f.write(b)
            digest = checksum.digest(b) ^ (1 if i in corrupt and n else 0)
            reads.append(Read(pos, n, digest, torch.zeros(n, dtype=torch.uint8), i))
            blobs.append(b)
            pos += n
    cut = None
    if past_end and layout[-1][0]:
        cut = len(layout) - 1
        last = reads[-1]
        reads[-1] = Read(last.offset + 1, last.nbytes, 0, last.target, last.index)
    moved = read_into(str(path), reads, threads=threads)
    want_failed = sorted(i for i in corrupt if i < len(layout) and layout[i][0] and i != cut)
    assert moved.failed == want_failed
    assert moved.short == ([cut] if cut is not None else [])
    for i, (b, r) in enumerate(zip(blobs, reads)):
        if i not in want_failed and i != cut:
            assert r.target.numpy().tobytes() == b, i


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    files=st.lists(
        st.lists(st.tuples(st.integers(0, 300_000), st.booleans()), min_size=0, max_size=5),
        min_size=1,
        max_size=4,
    ),
    threads=st.integers(1, 3),
    seed=st.integers(0, 1000),
)
def test_reads_of_several_files_moved_together_each_report_their_own_failures(
    tmp_path_factory, files, threads, seed
):
    # A restore reads its own copy and replicas in the node's store in one pass: every file's
    # tensors land exactly, and a corrupt tensor is named in its own file's result only.
    tmp = tmp_path_factory.mktemp("f")
    g = torch.Generator().manual_seed(seed)
    sources, expected = [], []
    for k, spec in enumerate(files):
        blobs = [
            torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy().tobytes() for n, _ in spec
        ]
        path = tmp / f"seg{k}.data"
        path.write_bytes(b"".join(blobs))
        reads, pos = [], 0
        for i, ((n, bad), b) in enumerate(zip(spec, blobs)):
            digest = checksum.digest(b) ^ (1 if bad and n else 0)
            reads.append(Read(pos, n, digest, torch.zeros(n, dtype=torch.uint8), i))
            pos += n
        sources.append((str(path), reads))
        expected.append((blobs, sorted(i for i, (n, bad) in enumerate(spec) if bad and n)))
    pending = transfer.start_reads(sources, threads=threads)
    moved = pending.wait()
    assert pending.wait() is moved  # waiting again returns the same results
    for (blobs, want_failed), (_, reads), m in zip(expected, sources, moved):
        assert m.failed == want_failed and m.short == []
        assert m.nbytes == sum(len(b) for b in blobs)
        for i, (b, r) in enumerate(zip(blobs, reads)):
            if i not in want_failed:
                assert r.target.numpy().tobytes() == b


def test_a_missing_file_among_several_raises_and_leaves_no_file_open(tmp_path):
    path, where = _file(tmp_path, [os.urandom(1000)])
    (o, n, d) = where[0]
    before = len(os.listdir("/proc/self/fd"))
    with pytest.raises(FileNotFoundError):
        transfer.read_files(
            [(path, [Read(o, n, d, torch.empty(n, dtype=torch.uint8))]), (str(tmp_path / "gone"), [])]
        )
    assert len(os.listdir("/proc/self/fd")) == before


@settings(max_examples=25, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 200_000), min_size=0, max_size=8),
    corrupt=st.sets(st.integers(0, 7), max_size=3),
    threads=st.integers(1, 3),
)
def test_checks_of_bytes_in_memory_name_exactly_the_corrupt_tensors(sizes, corrupt, threads):
    # What a rank serving a lost rank's replica verifies while its own bytes move.
    blobs = [os.urandom(n) for n in sizes]
    data = torch.frombuffer(bytearray(b"".join(blobs)) or bytearray(1), dtype=torch.uint8)
    checks, pos = [], 0
    for i, b in enumerate(blobs):
        checks.append((pos, len(b), checksum.digest(b) ^ (1 if i in corrupt else 0)))
        pos += len(b)
    assert transfer.start_checks(data, checks, threads=threads).wait() == sorted(
        i for i in corrupt if i < len(sizes)
    )
