"""Checkpoint bytes are copied as bytes, never as values (issue 31).

On a GPU, CUDA's fused ``_foreach_copy_`` takes bf16/fp16 through float and rewrote every NaN
payload to 0x7FFF during a save; the checksums were computed afterwards, so nothing noticed.
A CPU cannot show that kernel's behaviour, but it can show which copies the code asks torch to
make: these tests record the dtype of every tensor copy (``Tensor.copy_``, ``Tensor.to``,
``torch._foreach_copy_``, on every thread) during saves and restores through the public paths —
same layout, a template of other strides, parity, a restore on another world size — and fail on
any copy whose source or destination is floating point (``resilient_ckpt.bits``: both sides
viewed as integers of the element's size). Round trips of random bit patterns (NaN payloads,
signalling NaNs, subnormals, -0.0, infinities) for every dtype check the bytes themselves, on
CUDA too where a GPU is present.
"""

from __future__ import annotations

import os
import sys
import threading
from contextlib import contextmanager

import numpy as np
import pytest
import torch

from harness import run_ranks
from resilient_ckpt import ShardedTensor
from resilient_ckpt.bits import bits, copy_bits, foreach_copy_bits, foreach_copy_run_bits

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.bool]
if hasattr(torch, "float8_e4m3fn"):
    DTYPES.append(torch.float8_e4m3fn)
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _patterns(dtype: torch.dtype, n: int, seed: int) -> torch.Tensor:
    """``n`` elements of ``dtype`` with random bits, the special patterns first: NaNs with
    payloads, signalling NaNs, a subnormal, -0.0, an infinity."""
    size = torch.empty(0, dtype=dtype).element_size()
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n * size,), dtype=torch.uint8, generator=g)
    if dtype == torch.bool:
        return (raw % 2).view(torch.bool)
    special = {
        2: [0x7FC1, 0x7F81, 0xFFC3, 0x0001, 0x8000, 0x7F80, 0x7E01, 0xFE55],
        4: [0x7FC00001, 0x7F800001, 0xFFC00003, 0x00000001, 0x80000000, 0x7F800000],
        8: [0x7FF8000000000001, 0x7FF0000000000001, 0x0000000000000001, 0x8000000000000000],
    }.get(size, [0x7F, 0xFF, 0x80, 0x01])
    arr = raw.numpy().view({1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size])
    arr[: len(special)] = np.array(special, dtype=arr.dtype)
    return raw.view(dtype)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(bits(a.cpu()), bits(b.cpu()))


# ---- the helpers themselves -------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_copy_helpers_move_every_bit_pattern_of_every_dtype(dtype, device):
    src = (
        _patterns(dtype, 4099, seed=1).to(device)
        if device == "cpu"
        else bits(_patterns(dtype, 4099, 1)).to(device).view(dtype)
    )
    dst = torch.empty_like(src)
    copy_bits(dst, src)
    assert _same_bytes(dst, src)
    a, b = torch.empty_like(src), torch.empty_like(src[:100])
    foreach_copy_bits([a, b], [src, src[:100]])
    assert _same_bytes(a, src) and _same_bytes(b, src[:100])
    strided = torch.empty(2 * src.numel(), dtype=dtype, device=device)[::2]
    copy_bits(strided, src)  # a strided destination: still bits
    assert _same_bytes(strided.contiguous(), src)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES + [torch.complex64, torch.complex128], ids=str)
def test_the_run_copy_moves_every_bit_pattern_into_integer_views(dtype, device):
    """Staging's copy of a run (integer views of a segment, sources of one dtype): every bit
    pattern arrives, complex128 (no integer of its size) and lazy negative / conjugate views
    (whose bytes are not their values) included."""
    n = 4099
    if dtype.is_complex:
        src = torch.randn(n, dtype=dtype, generator=torch.Generator().manual_seed(3)).to(device)
        lazy = src.conj() if dtype == torch.complex64 else src
    else:
        src = bits(_patterns(dtype, n, seed=2)).to(device).view(dtype)
        lazy = src
    srcs = [src[:100], src[100:], lazy]
    flat = torch.empty(2 * n, dtype=dtype, device=device)
    region = flat if dtype == torch.complex128 else bits(flat)
    views = torch._C._nn.unflatten_dense_tensors(region, srcs)
    foreach_copy_run_bits(views, srcs, dtype)
    assert _same_bytes(flat[:n], src)
    assert _same_bytes(flat[n:], lazy.resolve_conj())  # a lazy view: its values, as copy_ gives
    if not dtype.is_complex:  # a negative view among the sources: its values too
        neg = torch.randn(8, dtype=torch.complex64).conj().imag
        if dtype == torch.float32:
            out = torch.empty(8, dtype=torch.int32)
            foreach_copy_run_bits([out], [neg], torch.float32)
            assert torch.equal(out.view(torch.float32), neg.resolve_neg())


def test_copy_bits_refuses_a_dtype_change():
    with pytest.raises(TypeError, match="would convert values"):
        copy_bits(torch.empty(3), torch.zeros(3, dtype=torch.float64))


# ---- every copy a save or restore makes, recorded ----------------------------------------------


@contextmanager
def _recorded_copies():
    """Every ``Tensor.copy_`` / ``Tensor.to`` (a copy) / ``torch._foreach_copy_`` made on any
    thread meanwhile, as (what, dtypes)."""
    seen, lock = [], threading.Lock()
    orig_copy, orig_to, orig_foreach = torch.Tensor.copy_, torch.Tensor.to, torch._foreach_copy_

    def note(what, *tensors):
        caller = sys._getframe(2).f_code.co_filename  # who asked torch for the copy
        with lock:
            seen.append((what, tuple(str(t.dtype) for t in tensors if isinstance(t, torch.Tensor)), caller))

    def copy_(self, src, *a, **k):
        note("copy_", self, src)
        return orig_copy(self, src, *a, **k)

    def to(self, *a, **k):
        out = orig_to(self, *a, **k)
        if out is not self:
            note("to", self, out)
        return out

    def foreach(dsts, srcs, *a, **k):
        note("_foreach_copy_", *dsts, *srcs)
        return orig_foreach(dsts, srcs, *a, **k)

    torch.Tensor.copy_, torch.Tensor.to, torch._foreach_copy_ = copy_, to, foreach
    try:
        yield seen
    finally:
        torch.Tensor.copy_, torch.Tensor.to, torch._foreach_copy_ = orig_copy, orig_to, orig_foreach


def _float_copies(seen, ours_only: bool = False):
    """The recorded copies of floating-point values; ``ours_only``: those resilient_ckpt's own
    code asked for (a framework's copies outside it — DCP's, Megatron-core's — set aside)."""
    floating = ("float", "bfloat", "half", "complex", "bool")
    return [
        s
        for s in seen
        if any(d.startswith("torch." + f) for d in s[1] for f in floating)
        and (not ours_only or f"{os.sep}resilient_ckpt{os.sep}" in s[2])
    ]


WS = 2


def _state(rank: int, step: int, ws: int = WS, cls=ShardedTensor):
    ts = {}
    for i, dtype in enumerate(DTYPES):
        whole = _patterns(dtype, 4096, seed=100 * step + i)
        ts[str(dtype)] = cls.from_rank_offsets(
            str(dtype), whole.view(ws, -1)[rank].clone(), (0, rank, ws), replica_id=0
        )
    ts["step"] = step
    return ts


def _template(rank: int, ws: int, strided: bool, cls=ShardedTensor):
    out = {}
    for dtype in DTYPES:
        n = 4096 // ws
        t = torch.zeros(2 * n, dtype=dtype)[::2] if strided else torch.zeros(n, dtype=dtype)
        out[str(dtype)] = cls.from_rank_offsets(
            str(dtype), t.reshape(1, n)[0] if not strided else t, (0, rank, ws), replica_id=0
        )
    out["step"] = 0
    return out


def _save_and_restore_recording(ctx, config: str, strided: bool):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    kw = (
        dict(replication_factor=2)
        if config == "replicas"
        else dict(redundancy="parity", parity_group=1, parity_shares=1)
    )
    state, template = _state(ctx.rank, 10), _template(ctx.rank, WS, strided)
    with _recorded_copies() as seen:
        m = CheckpointManager("bits", store_root=ctx.store_root, ranks_per_node=1, timeout_s=30, **kw)
        m.save_local(state, 10).wait()
        restored, it = m.load_local(template)
        m.close()
    exact = all(_same_bytes(restored[k], state[k].data) for k in state if k != "step")
    return _float_copies(seen), exact, it, len(seen)


@pytest.mark.multiprocess
@pytest.mark.parametrize("config,strided", [("replicas", False), ("replicas", True), ("parity", False)])
def test_a_save_and_restore_copy_no_value_of_any_dtype(tmp_root, config, strided):
    out = run_ranks(_save_and_restore_recording, WS, tmp_root, ranks_per_node=1, args=(config, strided))
    for rank, (float_copies, exact, it, copies) in enumerate(out):
        assert it == 10 and exact, rank
        assert copies > 0, "the recorder saw the save's copies"
        assert float_copies == [], f"rank {rank} copied values (not bytes): {float_copies[:5]}"


def _save_two(ctx):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    m = CheckpointManager(
        "bits", store_root=ctx.store_root, ranks_per_node=1, replication_factor=2, timeout_s=30
    )
    m.save_local(_state(ctx.rank, 10), 10).wait()
    m.close()


def _restore_on_one(ctx):
    """The 2-rank checkpoint restored on 1 rank (elastic: both saved shards into one tensor)."""
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    with _recorded_copies() as seen:
        m = CheckpointManager(
            "bits", store_root=ctx.store_root, ranks_per_node=1, replication_factor=1, timeout_s=30
        )
        restored, it = m.load_local(_template(0, 1, False))
        m.close()
    expected = {str(d): _patterns(d, 4096, seed=100 * 10 + i) for i, d in enumerate(DTYPES)}
    exact = all(_same_bytes(restored[k], expected[k]) for k in expected)
    return _float_copies(seen), exact, it


@pytest.mark.multiprocess
def test_an_elastic_restore_copies_no_value_of_any_dtype(tmp_root):
    run_ranks(_save_two, WS, tmp_root, ranks_per_node=1)
    # node 1's store moves to node 0 (a one-node job reads both from its own store)
    import shutil
    from pathlib import Path

    from harness import node_store_root

    src, dst = Path(node_store_root(tmp_root, 1)), Path(node_store_root(tmp_root, 0))
    for f in src.rglob("*"):
        if f.is_file():
            target = dst / f.relative_to(src)
            if not target.exists():
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(f, target)
    [(float_copies, exact, it)] = run_ranks(_restore_on_one, 1, tmp_root, ranks_per_node=1)
    assert it == 10 and exact
    assert float_copies == [], f"copied values (not bytes): {float_copies[:5]}"


# ---- through PyTorch DCP's storage writer and reader -------------------------------------------


def _dcp_state(rank: int, step: int):
    """Plain tensors of every dtype holding every bit pattern (DCP saves and loads them whole:
    one rank's own tensors, as for a DDP-replicated or per-rank state)."""
    return {
        f"r{rank}.{d}": _patterns(d, 2048, seed=1000 * step + 10 * rank + i) for i, d in enumerate(DTYPES)
    }


def _dcp_save_and_load_recording(ctx):
    import torch.distributed.checkpoint as dcp

    from resilient_ckpt.dcp import MemoryStorageReader, MemoryStorageWriter
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    state = _dcp_state(ctx.rank, 7)
    template = {k: torch.zeros_like(v) for k, v in state.items()}
    with _recorded_copies() as seen:
        m = CheckpointManager("bits-dcp", store_root=ctx.store_root, ranks_per_node=1, timeout_s=30)
        dcp.save(state, storage_writer=MemoryStorageWriter(m), checkpoint_id="run/step-7")
        m.wait_for_saves()
        reader = MemoryStorageReader(m)
        reader.find_latest()
        dcp.load(template, storage_reader=reader)
        m.close()
    exact = all(_same_bytes(template[k], state[k]) for k in state)
    return _float_copies(seen, ours_only=True), _float_copies(seen), exact, len(seen)


@pytest.mark.multiprocess
def test_dcp_writer_and_reader_copy_no_value_of_any_dtype(tmp_root):
    out = run_ranks(_dcp_save_and_load_recording, WS, tmp_root, ranks_per_node=1)
    for rank, (ours, every, exact, copies) in enumerate(out):
        assert exact and copies > 0, rank
        assert ours == [], f"rank {rank}: resilient_ckpt copied values (not bytes): {ours[:5]}"
        # DCP itself (its planner and load path) asked for no value copy of this state either
        assert every == [], f"rank {rank}: a value copy outside resilient_ckpt: {every[:5]}"


# ---- Megatron-LM's local checkpointing through the drop-in LocalCheckpointManager -------------


def _megatron_sequence_recording(ctx):
    """checkpointing.py's calls: Megatron-core's MCoreTensorAwareStateDict.from_state_dict, our
    LocalCheckpointManager's save / find_latest / load, to_state_dict into a template."""
    import warnings

    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    from resilient_ckpt import LocalCheckpointManager
    from resilient_ckpt.bench.baseline import apply_cpu_patches

    apply_cpu_patches()  # Megatron-core's exchange moves buffers through CUDA otherwise
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.dist_checkpointing.mapping import ShardedTensor as MCoreShardedTensor
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict

    state = _state(ctx.rank, 30, cls=MCoreShardedTensor)
    with _recorded_copies() as seen:
        strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
        manager = LocalCheckpointManager(ctx.store_root, repl_strategy=strategy)
        tasd, _ = MCoreTensorAwareStateDict.from_state_dict(state, algo="fully_parallel")
        manager.save(tasd, 30, is_async=False)
        latest = manager.find_latest()
        loaded, _ = manager.load()
        template = _template(ctx.rank, WS, False, cls=MCoreShardedTensor)
        restored = loaded.to_state_dict(template, algo="fully_parallel")
    exact = all(_same_bytes(restored[k], state[k].data) for k in state if k != "step")
    return _float_copies(seen, ours_only=True), exact, latest, len(seen)


@pytest.mark.multiprocess
def test_the_megatron_drop_in_copies_no_value_of_any_dtype(tmp_root):
    out = run_ranks(_megatron_sequence_recording, WS, tmp_root, ranks_per_node=1)
    for rank, (ours, exact, latest, copies) in enumerate(out):
        assert latest == 30 and exact and copies > 0, rank
        assert ours == [], f"rank {rank}: resilient_ckpt copied values (not bytes): {ours[:5]}"
