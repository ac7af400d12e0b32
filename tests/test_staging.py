"""Staging: snapshots copied into reused store segments, never torn, every dtype bit-exact."""

from __future__ import annotations

import os
import shutil
import threading
import uuid
from pathlib import Path

import pytest
import torch

from resilient_ckpt.manager.checkpoint_manager import MAX_ITERATION, CheckpointManager
from resilient_ckpt.memory.layout import plan_layout
from resilient_ckpt.memory.staging import SegmentPrefetcher, Stager
from resilient_ckpt.memory.store import CheckpointStore
from resilient_ckpt.model.mapping import ShardedTensor

pytestmark = [
    pytest.mark.filterwarnings("ignore:ComplexHalf support is experimental:UserWarning"),
    pytest.mark.filterwarnings("ignore:.*quantized tensor creation functions:UserWarning"),
]

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _all_dtypes(device: str):
    """Every dtype torch offers that can hold data on ``device`` (creation and same-dtype copy
    work); sub-byte and quantized dtypes have no copy kernel and cannot be checkpointed. Probed
    with what the tests do: a byte view moved to the device, cloned plain, transposed and
    strided, and copied back (on CUDA, e.g. Int1 is created but has no copy kernel)."""
    out = []
    for name in dir(torch):
        dt = getattr(torch, name)
        if not isinstance(dt, torch.dtype) or dt in out:
            continue
        try:
            torch.empty(4, dtype=dt, device=device).clone()
            t = torch.zeros(64, dtype=torch.uint8).view(dt).reshape(2, -1).to(device)
            t.clone(), t.t().clone(), t[:, ::2].clone(), t.cpu()
        except (RuntimeError, TypeError, NotImplementedError):
            continue
        out.append(dt)
    return sorted(out, key=str)


def _random(shape, dtype, gen, device="cpu"):
    """Random bit patterns (NaN payloads, subnormals included); bool gets valid 0/1 values."""
    n = 1
    for s in shape:
        n *= s
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=gen).bool().to(device)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape).to(device)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu().contiguous().reshape(-1)
    return t.view(torch.uint8)


def _st(key, t):
    return ShardedTensor.from_rank_offsets(key, t)


def _template(sd):
    return {
        k: ShardedTensor.from_rank_offsets(k, torch.empty(v.local_shape, dtype=v.dtype, device=v.data.device))
        for k, v in sd.items()
    }


@pytest.fixture
def manager(tmp_root):
    m = CheckpointManager("staging", store_root=str(tmp_root), replication_factor=1)
    yield m
    m.close()


def test_cpu_dtype_list_covers_the_dtypes_trainers_use():
    dts = set(_all_dtypes("cpu"))
    must = {
        torch.float32,
        torch.float64,
        torch.float16,
        torch.bfloat16,
        torch.bool,
        torch.uint8,
        torch.int8,
        torch.int16,
        torch.int32,
        torch.int64,
        torch.complex64,
        torch.complex128,
        torch.float8_e4m3fn,
        torch.float8_e5m2,
    }
    assert must <= dts


@pytest.mark.parametrize("device", DEVICES)
def test_every_dtype_and_shape_round_trips_bit_exactly_through_save_and_load(tmp_root, device):
    g = torch.Generator().manual_seed(7)
    sd, expected = {}, {}
    for dt in _all_dtypes(device):
        name = str(dt).replace("torch.", "")
        cases = {
            "plain": _random((3, 17), dt, g, device),
            "scalar": _random((), dt, g, device),
            "empty": _random((0, 5), dt, g, device),
            "transposed": _random((6, 4), dt, g, device).t(),
            "strided": _random((5, 12), dt, g, device)[1:4, ::3],
        }
        for case, t in cases.items():
            sd[f"{name}.{case}"] = _st(f"{name}.{case}", t)
            expected[f"{name}.{case}"] = t.clone()
        # Two shards that are views of one buffer (a flat parameter buffer).
        flat = _random((40,), dt, g, device)
        for i, (lo, hi) in enumerate([(0, 15), (15, 40)]):
            sd[f"{name}.view{i}"] = _st(f"{name}.view{i}", flat[lo:hi])
            expected[f"{name}.view{i}"] = flat[lo:hi].clone()
    base = _random((1, 5), torch.complex64, g, device)
    sd["expanded"], expected["expanded"] = _st("expanded", base.expand(4, 5)), base.expand(4, 5).clone()
    sd["conj"], expected["conj"] = _st("conj", base.conj()), base.conj().resolve_conj()

    m = CheckpointManager("dtypes", store_root=str(tmp_root), replication_factor=1)
    try:
        m.save_local(sd, 5, is_async=False)
        state, it = m.load_local(_template(sd))
    finally:
        m.close()
    assert it == 5
    mismatched = [
        k
        for k, v in expected.items()
        if state[k].dtype != v.dtype
        or tuple(state[k].shape) != tuple(v.shape)
        or not torch.equal(_bytes(state[k]), _bytes(v))
    ]
    assert mismatched == []
    assert all(state[k].device.type == device for k in expected)


def test_largest_iteration_number_round_trips(manager):
    sd = {"w": _st("w", torch.arange(10.0))}
    manager.save_local(sd, MAX_ITERATION, is_async=False)
    assert manager.store.list()[0].iteration == MAX_ITERATION == 2**63 - 1
    state, it = manager.load_local(_template(sd))
    assert it == 2**63 - 1 and torch.equal(state["w"], torch.arange(10.0))


def test_updates_after_wait_staged_never_reach_the_snapshot(manager):
    w = torch.randn(1 << 20)  # 4 MiB: the copy takes a while on a background thread
    b = torch.randn(1000).to(torch.bfloat16)
    sd = {"w": _st("w", w), "b": _st("b", b)}
    snapshots = []
    for it in (1, 2, 3):
        snapshots.append((w.clone(), b.clone()))
        h = manager.save_local(sd, it)
        h.wait_staged()
        w.add_(1.0)  # the optimizer step, right after wait_staged
        b.mul_(2)
        h.wait()
    state, it = manager.load_local(_template(sd))
    assert it == 3
    assert torch.equal(state["w"], snapshots[-1][0]) and torch.equal(state["b"], snapshots[-1][1])
    assert not torch.equal(state["w"], w)


def test_wait_staged_returns_only_when_every_copy_is_done(manager):
    sd = {f"t{i}": _st(f"t{i}", torch.randn(256, 1024)) for i in range(4)}
    h = manager.save_local(sd, 1)
    h.wait_staged()
    assert h._staging.done()
    h.wait()


def test_staging_buffers_are_reused_across_saves(tmp_root):
    m = CheckpointManager("reuse", store_root=str(tmp_root), replication_factor=1, keep_last=2)
    sd = {"w": _st("w", torch.randn(64, 1024)), "i": _st("i", torch.arange(100))}
    inodes, pool_sizes = [], []
    try:
        for it in range(1, 11):
            m.save_local(sd, it, is_async=False)
            (cid,) = [c for c in m.store.list() if c.iteration == it]
            ino = os.stat(m.store.data_path(cid)).st_ino
            if ino not in inodes:  # keep the inode allocated: no new file can reuse its number
                os.link(m.store.data_path(cid), tmp_root / f"keep{ino}")
            inodes.append(ino)
            pool_sizes.append(len(list(m.store.free_dir.iterdir())))
    finally:
        m.close()
    # keep_last=2 plus the save in progress: three segments cycle, no new file after warm-up.
    assert set(inodes[3:]) <= set(inodes[:3])
    assert len(set(pool_sizes[3:])) == 1


def test_a_failed_copy_is_reported_by_the_staging_handle(tmp_root):
    store = CheckpointStore(tmp_root, "s", world_size=1)
    layouts, total = plan_layout([(torch.float32, (4,))])
    seg = store.reserve(total)
    stager = Stager()
    try:
        handle = stager.stage([torch.ones(5)], seg, layouts)  # shape does not fit its slot
        with pytest.raises(RuntimeError):
            handle.wait_prefix(16)  # replication waiting for the first chunk learns it too
        with pytest.raises(RuntimeError):
            handle.wait()
    finally:
        stager.shutdown()
        store.release(seg)


def test_stager_copies_into_the_segment_slots(tmp_root):
    store = CheckpointStore(tmp_root, "s", world_size=1)
    tensors = [torch.randn(3, 4), torch.tensor(True), torch.arange(6, dtype=torch.int16)[::2]]
    layouts, total = plan_layout([(t.dtype, tuple(t.shape)) for t in tensors])
    seg = store.reserve(total)
    stager = Stager()
    try:
        stager.stage(tensors, seg, layouts).wait()
        assert all(torch.equal(seg.tensor(l), t) for l, t in zip(layouts, tensors))
    finally:
        stager.shutdown()
        store.release(seg)


def test_prefetcher_reserves_ahead_and_returns_its_spare_on_close(tmp_root):
    store = CheckpointStore(tmp_root, "s", world_size=1)
    pf = SegmentPrefetcher(store)
    pf.prefetch(8192)
    seg = pf.take(8192)
    assert seg.nbytes == 8192 and seg.path.name.startswith("rsv_")
    store.release(seg)
    pf.prefetch(8192)
    other = pf.take(4096)  # size changed: the spare goes back to the pool
    assert other.nbytes == 4096
    store.release(other)
    pf.prefetch(4096)
    pf.close()
    names = [p.name for p in store.free_dir.iterdir()]
    assert names and all(n.startswith("seg_") for n in names)  # no reservation left behind


class _RefusingRuntime:
    """A CUDA runtime whose driver refuses every registration (measured on an H200: a file on
    a disk file system, "invalid argument"). ``clears``: whether it offers cudaGetLastError
    (torch 2.11's ``torch.cuda.cudart()`` does not)."""

    source = "fake runtime"

    def __init__(self, clears: bool):
        self.calls = []
        self.clears = clears

    def host_register(self, ptr, nbytes):
        self.calls.append("register")
        return 1  # cudaErrorInvalidValue

    def host_unregister(self, ptr):
        self.calls.append("unregister")

    def clear_error(self):
        self.calls.append("clear")
        return self.clears


@pytest.mark.parametrize("clears", [True, False])
def test_a_segment_the_driver_refuses_to_page_lock_stays_pageable_and_says_why_and_how_to_fix_it(
    monkeypatch, caplog, clears
):
    """The save must go on (device copies into pageable memory are synchronous, still exact):
    no AttributeError where no cudaGetLastError exists, the error cleared where one does, one
    WARNING naming the store and the reason."""
    import resilient_ckpt.memory.pinning as pinning_mod

    fake = _RefusingRuntime(clears)
    monkeypatch.setattr(pinning_mod, "runtime", lambda: fake)
    monkeypatch.setattr(pinning_mod, "_warned", set())
    root = Path("/dev/shm") / f"rc-pin-{uuid.uuid4().hex[:8]}"
    try:
        store = CheckpointStore(str(root), "pin")
        with caplog.at_level("WARNING"):
            for _ in range(2):
                seg = store.reserve(4096)
                assert seg.pin() is False and not seg.pinned
                seg.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert fake.calls == ["register", "clear", "register", "clear"]
    warnings = [r.getMessage() for r in caplog.records if "not page-locked" in r.getMessage()]
    assert len(warnings) == 1 and str(root) in warnings[0] and "CUDA error 1" in warnings[0]
    assert ("install cuda-python" in warnings[0]) is not clears


def test_a_store_not_on_tmpfs_is_not_offered_for_page_locking_and_the_warning_says_why(
    tmp_path, monkeypatch, caplog
):
    import resilient_ckpt.memory.pinning as pinning_mod

    if pinning_mod.filesystem_type(str(tmp_path)) in ("tmpfs", "ramfs", ""):
        pytest.skip("tmp_path is on a memory file system here")
    fake = _RefusingRuntime(clears=False)
    monkeypatch.setattr(pinning_mod, "runtime", lambda: fake)
    monkeypatch.setattr(pinning_mod, "_warned", set())
    store = CheckpointStore(str(tmp_path), "pin")
    with caplog.at_level("WARNING"):
        seg = store.reserve(4096)
        assert seg.pin() is False
        seg.close()
    assert fake.calls == []  # never asked: the refusal would leave an error nothing can clear
    warnings = [r.getMessage() for r in caplog.records if "not page-locked" in r.getMessage()]
    assert len(warnings) == 1 and "its file system is" in warnings[0] and "/dev/shm" in warnings[0]


def test_a_save_whose_segments_cannot_be_page_locked_completes_and_restores_exactly(monkeypatch, caplog):
    """A GPU job's saves page-lock their segments (the save thread, after the agreement); the
    refusal is forced here on CPU: the save completes, one WARNING, the restore is exact."""
    import resilient_ckpt.memory.pinning as pinning_mod
    from resilient_ckpt import ShardedTensor
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    fake = _RefusingRuntime(clears=False)
    monkeypatch.setattr(pinning_mod, "runtime", lambda: fake)
    monkeypatch.setattr(pinning_mod, "_warned", set())
    root = Path("/dev/shm") / f"rc-pin-{uuid.uuid4().hex[:8]}"
    data = torch.randn(4096).to(torch.bfloat16)
    data.view(torch.int16)[:3] = torch.tensor([0x7FC1, 0x7F81, -0x0001], dtype=torch.int16)  # NaN payloads
    try:
        m = CheckpointManager("pinless", store_root=str(root), replication_factor=1)
        m._prefetcher.pin = True  # what the first save of GPU tensors turns on
        with caplog.at_level("WARNING"):
            for it in (1, 2):
                m.save_local({"w": ShardedTensor.from_rank_offsets("w", data.clone())}, it).wait()
        restored, it = m.load_local({"w": ShardedTensor.from_rank_offsets("w", torch.zeros_like(data))})
        m.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert it == 2 and torch.equal(restored["w"].view(torch.int16), data.view(torch.int16))
    assert "register" in fake.calls
    assert len([r for r in caplog.records if "not page-locked" in r.getMessage()]) == 1


def test_a_segment_staged_piece_by_piece_lets_a_prefix_be_used_before_the_last_copy(tmp_root, monkeypatch):
    """Replication sends what is staged while the rest is copied (issue 34): the staging thread
    says after each piece how far the segment holds its bytes, in offset order."""
    from resilient_ckpt.memory import staging

    monkeypatch.setattr(staging, "PIECE_BYTES", 4096)
    gate, copies = threading.Event(), []
    real = staging.foreach_copy_run_bits  # what a piece of a run is copied with

    def copy(dsts, srcs, *args, **kw):
        copies.append(len(srcs))
        if len(copies) == 2:  # the second piece waits until the test has seen the first
            assert gate.wait(30)
        return real(dsts, srcs, *args, **kw)

    monkeypatch.setattr(staging, "foreach_copy_run_bits", copy)
    store = CheckpointStore(tmp_root, "s", world_size=1)
    tensors = [torch.randn(1024) for _ in range(4)] + [torch.arange(2048, dtype=torch.int16)]
    layouts, total = plan_layout([(t.dtype, tuple(t.shape)) for t in tensors])
    seg = store.reserve(total)
    stager = Stager()
    try:
        handle = stager.stage(tensors, seg, layouts)
        handle.wait_prefix(4096)  # the first float32 piece is there: returns while the rest waits
        assert not handle.done() and torch.equal(seg.tensor(layouts[0]), tensors[0])
        gate.set()
        handle.wait_prefix(total)  # every byte is there (the thread may still be returning)
        assert all(torch.equal(seg.tensor(l), t) for l, t in zip(layouts, tensors))
        assert len(copies) == 5  # a copy per piece (4 float32, 1 int16): the gate held the second
    finally:
        gate.set()
        stager.shutdown()
        store.release(seg)
