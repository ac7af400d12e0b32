"""The node store: checkpoints as files of a tmpfs directory, a header published last."""

from __future__ import annotations

import dataclasses
import os

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from resilient_ckpt.errors import (
    CorruptCheckpointError,
    ForeignCheckpointError,
    StoreError,
    StoreFullError,
)
from resilient_ckpt.memory import checksum
from resilient_ckpt.memory.layout import (
    FORMAT_VERSION,
    CheckpointHeader,
    CheckpointId,
    TensorLayout,
    plan_layout,
)
from resilient_ckpt.memory.store import CheckpointStore

KIB = 1 << 10


def _tensors(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(64, 33, generator=g),
        torch.randint(-100, 100, (7,), generator=g, dtype=torch.int64),
        torch.randn(5, generator=g).to(torch.bfloat16),
    ]


def _save(
    store: CheckpointStore,
    iteration: int,
    owner: int = 0,
    world_size: int = 1,
    seed: int = 0,
    session: str | None = None,
    format_version: int = FORMAT_VERSION,
):
    """Write one checkpoint the way the manager does: reserve, claim, copy, header last."""
    tensors = _tensors(seed)
    layouts, total = plan_layout([(t.dtype, tuple(t.shape)) for t in tensors])
    seg = store.reserve(total)
    store.claim(seg, iteration, owner)
    for lay, t in zip(layouts, tensors):
        seg.tensor(lay).copy_(t)
    mv = checksum.byte_view(seg.buffer)
    layouts = [
        dataclasses.replace(l, checksum=checksum.digest(mv[l.offset : l.offset + l.nbytes])) for l in layouts
    ]
    header = CheckpointHeader(
        session=session or store.session,
        iteration=iteration,
        owner=owner,
        world_size=world_size,
        tensors=tuple(layouts),
        data_nbytes=total,
        meta=b"hollow",
        format_version=format_version,
    )
    if header.session == store.session:
        store.publish(seg, header)
    else:  # file names carry no session: a foreign header lands under this store's name
        store.write_header(header)
    seg.close()
    return CheckpointId(iteration, owner, store.session), tensors


def _read(store: CheckpointStore, cid: CheckpointId):
    reader = store.open(cid)
    dests = [torch.empty(l.shape, dtype=l.torch_dtype) for l in reader.header.tensors]
    bad = reader.read_into(dests)
    return dests, bad


@pytest.fixture
def store(tmp_root):
    return CheckpointStore(tmp_root / "shm", "job", world_size=1)


# ---- layout and read-back ---------------------------------------------------------------------


def test_files_are_named_by_session_iteration_and_owner_under_the_configured_root(store, tmp_root):
    cid, _ = _save(store, 42, owner=3, world_size=4)
    names = sorted(
        p.name for p in (tmp_root / "shm" / "job").iterdir() if p.is_file() and not p.name.startswith(".")
    )
    assert names == [f"iter_{42:020d}.owner_{3:06d}.data", f"iter_{42:020d}.owner_{3:06d}.hdr"]
    assert store.list() == [cid] == [CheckpointId(42, 3, "job")]
    assert cid.as_tuple() == (42, 3, "job")


def test_published_checkpoint_reads_back_bit_exactly_with_checksums(store):
    cid, tensors = _save(store, 1)
    got, bad = _read(store, cid)
    assert bad == []
    assert all(torch.equal(a, b) for a, b in zip(got, tensors))
    assert store.open(cid).verify() == []
    h = store.read_header(cid)
    assert (h.session, h.iteration, h.owner, h.world_size, h.format_version, h.meta) == (
        "job",
        1,
        0,
        1,
        FORMAT_VERSION,
        b"hollow",
    )
    assert all(l.checksum is not None for l in h.tensors)


def test_layout_offsets_are_aligned_and_cover_every_byte():
    specs = [(torch.float32, (3, 5)), (torch.bool, ()), (torch.int8, (0,)), (torch.complex128, (2,))]
    layouts, total = plan_layout(specs)
    assert [l.nbytes for l in layouts] == [60, 1, 0, 32]
    assert all(l.offset % 256 == 0 for l in layouts)
    assert all(a.offset + a.nbytes <= b.offset for a, b in zip(layouts, layouts[1:]))
    assert total >= layouts[-1].offset + layouts[-1].nbytes


# ---- a partial or foreign write is never taken for a checkpoint ---------------------------------


def test_data_file_without_header_is_not_a_checkpoint(store):
    seg = store.reserve(4 * KIB)
    store.claim(seg, 5, 0)  # the data file exists under its final name, the header never came
    seg.close()
    assert store.data_path(CheckpointId(5, 0, "job")).exists()
    assert store.list() == []
    with pytest.raises(StoreError, match="no checkpoint iter_0+5.owner_000000"):
        store.open(CheckpointId(5, 0, "job"))


def test_truncated_header_is_reported_corrupt_and_not_loaded(store):
    cid, _ = _save(store, 7)
    path = store.header_path(cid)
    path.write_bytes(path.read_bytes()[:-9])
    with pytest.raises(CorruptCheckpointError, match=r"\.hdr: malformed header"):
        store.open(cid)


def test_header_with_a_flipped_byte_is_reported_corrupt(store):
    cid, _ = _save(store, 7)
    path = store.header_path(cid)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptCheckpointError, match="header checksum mismatch|malformed header"):
        store.open(cid)


def test_header_of_another_session_is_reported_foreign(store):
    cid, _ = _save(store, 3, session="other-job")
    with pytest.raises(
        ForeignCheckpointError, match="belongs to session 'other-job'.*session_id='other-job'"
    ):
        store.open(cid)


def test_header_of_another_world_size_is_reported_foreign(store):
    cid, _ = _save(store, 3, world_size=8)
    with pytest.raises(ForeignCheckpointError, match="world size 8, this job has 1"):
        store.open(cid)


def test_header_of_another_format_version_is_reported_foreign(store):
    cid, _ = _save(store, 3, format_version=FORMAT_VERSION + 1)
    with pytest.raises(
        ForeignCheckpointError,
        match=f"format version {FORMAT_VERSION + 1}, this build reads version {FORMAT_VERSION}",
    ):
        store.open(cid)


def test_header_whose_name_and_content_disagree_is_reported_corrupt(store):
    cid, _ = _save(store, 3)
    os.replace(store.header_path(cid), store.header_path(CheckpointId(4, 0, "job")))
    with pytest.raises(CorruptCheckpointError, match="file name and header disagree"):
        store.open(CheckpointId(4, 0, "job"))


def test_missing_or_truncated_data_file_is_reported_corrupt(store):
    cid, _ = _save(store, 1)
    with open(store.data_path(cid), "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match="truncated"):
        store.open(cid)
    store.data_path(cid).unlink()
    with pytest.raises(CorruptCheckpointError, match="missing although its header is published"):
        store.open(cid)


def test_a_flipped_tensor_byte_fails_that_tensors_checksum(store):
    cid, _ = _save(store, 1)
    lay = store.read_header(cid).tensors[1]
    with open(store.data_path(cid), "r+b") as f:
        f.seek(lay.offset + 3)
        b = f.read(1)
        f.seek(lay.offset + 3)
        f.write(bytes([b[0] ^ 0x80]))
    _, bad = _read(store, cid)
    assert bad == [1]
    assert store.open(cid).verify() == [1]


_names = st.text(st.characters(codec="utf-8", exclude_characters="/\x00"), min_size=1, max_size=12).filter(
    lambda s: not s.startswith(".")
)
_layouts = st.builds(
    TensorLayout,
    offset=st.integers(0, 1 << 40),
    nbytes=st.integers(0, 1 << 40),
    dtype=st.sampled_from(["float32", "bfloat16", "float8_e4m3fn", "bool", "complex64", "uint64"]),
    shape=st.lists(st.integers(0, 1 << 20), max_size=4).map(tuple),
    checksum=st.one_of(st.none(), st.integers(0, (1 << 64) - 1)),
)
_headers = st.builds(
    CheckpointHeader,
    session=_names,
    iteration=st.integers(0, (1 << 63) - 1),
    owner=st.integers(0, 999_999),
    world_size=st.integers(1, 1 << 20),
    tensors=st.lists(_layouts, max_size=5).map(tuple),
    data_nbytes=st.integers(0, 1 << 45),
    meta=st.binary(max_size=64),
    replication=st.fixed_dictionaries(
        {"kind": st.sampled_from(["ring", "clique"]), "factor": st.integers(1, 4)}
    ),
    created_ns=st.integers(1, 1 << 62),
    writer=st.text(min_size=1, max_size=10),  # empty means "fill in at pack time"
)


@given(_headers)
@settings(max_examples=60, deadline=None)
def test_header_round_trips_every_field(header):
    assert CheckpointHeader.unpack(header.pack()) == header


@given(_headers, st.data())
@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_single_flipped_header_bit_is_rejected(header, data):
    raw = bytearray(header.pack())
    pos = data.draw(st.integers(0, len(raw) - 1))
    raw[pos] ^= 1 << data.draw(st.integers(0, 7))
    with pytest.raises(CorruptCheckpointError):
        CheckpointHeader.unpack(bytes(raw))


@given(_headers, st.data())
@settings(max_examples=40, deadline=None)
def test_any_truncated_header_is_rejected(header, data):
    raw = header.pack()
    cut = data.draw(st.integers(0, len(raw) - 1))
    with pytest.raises(CorruptCheckpointError):
        CheckpointHeader.unpack(raw[:cut])


def test_header_from_a_different_program_is_rejected_with_its_source_named():
    body = msgpack.packb({"magic": "something else"}, use_bin_type=True)
    raw = msgpack.packb([body, checksum.digest(body)], use_bin_type=True)
    with pytest.raises(CorruptCheckpointError, match="from-peer: not a resilient_ckpt header"):
        CheckpointHeader.unpack(raw, source="from-peer")


# ---- memory budget and free space ---------------------------------------------------------------


def test_memory_budget_too_small_raises_store_full_naming_sizes_and_fix_and_keeps_stored_data(tmp_root):
    store = CheckpointStore(tmp_root, "job", world_size=1, memory_budget=64 * KIB)
    cid, tensors = _save(store, 1)
    before = sorted(p.name for p in store.dir.iterdir())
    with pytest.raises(StoreFullError) as e:
        store.reserve(1 << 20)
    msg = str(e.value)
    assert "1.00 MiB (1048576 bytes)" in msg and "memory budget of 64.00 KiB (65536 bytes)" in msg
    assert "nothing was written or removed" in msg and "raise memory_budget" in msg
    assert sorted(p.name for p in store.dir.iterdir()) == before
    got, bad = _read(store, cid)
    assert bad == [] and all(torch.equal(a, b) for a, b in zip(got, tensors))


def test_full_shared_memory_filesystem_message_names_the_sizes_and_shm_size_fix(store, monkeypatch):
    real = store.usage

    def tiny_fs():
        u = real()
        return {**u, "fs_free_bytes": 3 * KIB, "fs_total_bytes": 64 << 20}

    monkeypatch.setattr(store, "usage", tiny_fs)
    with pytest.raises(StoreFullError) as e:
        store.reserve(1 << 20)
    msg = str(e.value)
    assert "needs 1.00 MiB (1048576 bytes) more" in msg and "only 3.00 KiB (3072 bytes) of 64.00 MiB" in msg
    assert "--shm-size" in msg and "emptyDir" in msg
    assert list(store.free_dir.iterdir()) == []  # nothing was created


def test_budget_pressure_releases_idle_pool_segments_but_never_the_one_being_reused(tmp_root):
    store = CheckpointStore(tmp_root, "job", world_size=1)
    for seg in [store.reserve(n) for n in (64 * KIB, 128 * KIB)]:
        store.release(seg)
    reused = next(p for p in store.free_dir.iterdir() if p.stat().st_size == 128 * KIB).stat().st_ino
    store.memory_budget = 150 * KIB  # 192 KiB pooled: over budget, the idle one must go
    seg = store.reserve(100 * KIB)  # the 128 KiB segment is the smallest that fits
    assert seg.nbytes == 100 * KIB and os.stat(seg.path).st_ino == reused
    assert [p.name.split("_")[0] for p in store.free_dir.iterdir()] == ["rsv"]
    seg.close()


def test_steady_state_reuses_pooled_segments_instead_of_allocating(store, tmp_root):
    inodes = []
    for it in range(1, 9):
        cid, _ = _save(store, it)
        ino = os.stat(store.data_path(cid)).st_ino
        # A hard link keeps the inode allocated: a new file can never take over its number.
        if ino not in inodes:
            os.link(store.data_path(cid), tmp_root / f"keep{ino}")
        inodes.append(ino)
        store.retain([it - 1, it])  # keep the last two
    assert len(set(inodes[3:])) <= 3 and set(inodes[3:]) <= set(inodes[:3])
    assert [c.iteration for c in store.list()] == [7, 8]
    assert len([p for p in store.free_dir.iterdir()]) == 1


def test_pool_prefers_the_smallest_segment_that_fits(store):
    for seg in [store.reserve(n) for n in (16 * KIB, 64 * KIB, 256 * KIB)]:
        store.release(seg)
    sizes = {p.stat().st_size: p.stat().st_ino for p in store.free_dir.iterdir()}
    seg = store.reserve(60 * KIB)
    assert os.stat(seg.path).st_ino == sizes[64 * KIB] and seg.nbytes == 60 * KIB
    seg.close()


# ---- retention, sweep, misc ---------------------------------------------------------------------


def test_retain_keeps_exactly_the_given_iterations_and_recycles_the_rest(store):
    for it in (1, 2, 3, 4):
        _save(store, it)
    dropped = store.retain([3, 4])
    assert [c.iteration for c in dropped] == [1, 2]
    assert [c.iteration for c in store.list()] == [3, 4]
    assert len(list(store.free_dir.iterdir())) == 2  # data kept for reuse, not unlinked


def test_discard_unpublishes_before_removing_data(store):
    cid, _ = _save(store, 1)
    store.discard(cid, recycle=False)
    assert store.list() == [] and not store.data_path(cid).exists()


def test_headerless_data_dead_reservations_and_torn_header_writes_are_swept(store):
    _save(store, 1)
    seg = store.reserve(4 * KIB)
    store.claim(seg, 2, 0)
    seg.close()
    dead_pid = 2**22 + 12345  # above pid_max on Linux: never alive
    (store.free_dir / f"rsv_{dead_pid}_1_0.data").write_bytes(b"x" * 100)
    live = store.reserve(4 * KIB)  # this process's reservation: left alone
    torn = store.dir / f".iter_{3:020d}.owner_000000.hdr.{dead_pid}.tmp"
    torn.write_bytes(b"partial")
    store.sweep_orphans()
    assert [c.iteration for c in store.list()] == [1]
    assert not store.data_path(CheckpointId(2, 0, "job")).exists() and not torn.exists()
    names = sorted(p.name.split("_")[0] for p in store.free_dir.iterdir())
    assert names == ["rsv", "seg", "seg"] and live.path.exists()
    live.close()


def test_invalid_session_names_and_unwritable_roots_are_rejected_clearly(tmp_root):
    for bad in ("", "a/b", ".hidden"):
        with pytest.raises(StoreError, match="invalid session id"):
            CheckpointStore(tmp_root, bad)
    blocker = tmp_root / "file"
    blocker.write_text("not a directory")
    with pytest.raises(StoreError, match="cannot create the store directory.*writable tmpfs"):
        CheckpointStore(blocker, "job")


def test_claiming_an_already_published_checkpoint_is_refused(store):
    _save(store, 1)
    seg = store.reserve(KIB)
    with pytest.raises(StoreError, match="already published"):
        store.claim(seg, 1, 0)
    store.release(seg)
    assert [c.iteration for c in store.list()] == [1]


def test_other_sessions_under_the_root_are_listed_for_diagnostics(tmp_root):
    a = CheckpointStore(tmp_root, "run-a", world_size=1)
    _save(a, 1)
    b = CheckpointStore(tmp_root, "run-b", world_size=1)
    assert b.other_sessions() == ["run-a"] and b.list() == []
    assert a.other_sessions() == []


def test_a_child_forked_while_the_store_is_locked_does_not_keep_it_locked(tmp_root):
    """nvidia-resiliency-ext's async writer forks the trainer at every save; a fork while a
    thread held the node store's lock left the child holding it until it exited, so the
    trainer's next reservation waited for the child (seen as a Megatron-LM test hanging)."""
    import fcntl
    import os
    import threading

    store = CheckpointStore(str(tmp_root), "fork")
    read_end, write_end = os.pipe()
    with store._locked():
        pid = os.fork()
        if pid == 0:  # the child: wait for the parent's word, then leave without cleanup
            os.close(write_end)
            os.read(read_end, 1)
            os._exit(0)
    os.close(read_end)
    try:
        # The parent released the lock by leaving the block: another process (here: a fresh
        # open file description, as a second trainer on the node would have) gets it at once.
        fd = os.open(store._lock_path, os.O_RDWR)
        try:
            got = threading.Event()

            def take():
                fcntl.flock(fd, fcntl.LOCK_EX)
                got.set()

            t = threading.Thread(target=take, daemon=True)
            t.start()
            assert got.wait(timeout=10), "the forked child still holds the store lock"
        finally:
            os.close(fd)
    finally:
        os.write(write_end, b"x")
        os.close(write_end)
        os.waitpid(pid, 0)
