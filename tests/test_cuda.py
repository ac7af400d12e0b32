"""CUDA: saving GPU tensors and restoring into GPU templates, through the public API.

The save path on CUDA is its own code: the store segment is page-locked with
``cudaHostRegister`` and the copies run on a side stream ordered after the caller's (producer)
stream; a restore reads the node's copy on the host and copies it into the CUDA templates. Every
test here needs a GPU and is skipped without one. Multi-rank tests use tests/harness.py (real
processes, gloo on 127.0.0.1, one store root per simulated node) with every rank on ``cuda:0``:
one GPU cannot host two NCCL ranks, and the manager's own groups are gloo anyway. Store roots
are on ``/dev/shm`` (tmpfs), where a real store lives: its segments are what gets page-locked.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import zlib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from harness import node_store_root, run_ranks
from resilient_ckpt import CheckpointHook, CheckpointManager, ShardedTensor, TrainState

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

RUN = dict(timeout=120, collective_timeout=60)


# ---- helpers ---------------------------------------------------------------------------------------


@pytest.fixture
def shm_root():
    """A scratch store root on tmpfs (``/dev/shm``), as in production; removed afterwards."""
    d = tempfile.mkdtemp(prefix="rckpt-test-cuda-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    yield Path(d)
    shutil.rmtree(d, ignore_errors=True)


def _random(shape, dtype, seed: int) -> torch.Tensor:
    """Random bit patterns on the CPU (NaN payloads and subnormals included): bytes, not values."""
    g = torch.Generator().manual_seed(seed)
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and torch.equal(_bytes(a), _bytes(b))


def _st(key: str, t: torch.Tensor, *rank_offsets, **kw) -> ShardedTensor:
    return ShardedTensor.from_rank_offsets(key, t, *rank_offsets, **kw)


def _cuda_template(tensors: dict) -> dict:
    """Contiguous CUDA tensors shaped like ``tensors`` (name -> tensor), every byte 0x5A."""
    out = {}
    for k, t in tensors.items():
        raw = torch.full((t.numel() * t.element_size(),), 0x5A, dtype=torch.uint8, device="cuda")
        out[k] = _st(k, raw.view(t.dtype).view(tuple(t.shape)))
    return out


# ---- a. one process, every kind of tensor ---------------------------------------------------------


def _one_of_each() -> dict:
    """fp32, bf16, fp16, int64, a 0-dim tensor and a non-contiguous view, all on the GPU."""
    base = _random((48, 80), torch.float32, 6).cuda()
    return {
        "fp32": _random((257, 1031), torch.float32, 1).cuda(),
        "bf16": _random((64, 1000), torch.bfloat16, 2).cuda(),
        "fp16": _random((3, 5, 7), torch.float16, 3).cuda(),
        "int64": _random((4097,), torch.int64, 4).cuda(),
        "scalar": _random((), torch.float32, 5).cuda(),
        "strided": base.t()[::2, 3:],  # (40, 45), neither contiguous nor starting at offset 0
    }


def test_cuda_tensors_of_every_kind_restore_bit_exactly_into_cuda_templates(shm_root):
    tensors = _one_of_each()
    assert not tensors["strided"].is_contiguous() and tensors["scalar"].dim() == 0
    expected = {k: t.cpu().clone() for k, t in tensors.items()}
    m = CheckpointManager("cuda-kinds", store_root=str(shm_root), replication_factor=1)
    try:
        h = m.save_local({k: _st(k, t) for k, t in tensors.items()}, 7)
        h.wait_staged()
        h.wait()
    finally:
        m.close()
    # A restart: a fresh manager on the same store restores into the model's (CUDA) tensors.
    template = _cuda_template(tensors)
    with CheckpointManager("cuda-kinds", store_root=str(shm_root), replication_factor=1) as again:
        state, it = again.load_local(template)
    assert it == 7
    assert sorted(state) == sorted(expected)
    for k, want in expected.items():
        got = state[k]
        assert got.device.type == "cuda", (k, got.device)
        assert _same_bytes(got, want), k


# ---- b. ordering with the producer stream ----------------------------------------------------------


def test_the_snapshot_waits_for_the_producer_and_ignores_writes_after_wait_staged(shm_root):
    """The saved tensor comes out of a long chain of matmuls that is still running when
    ``save_local`` is called (no synchronize), and is overwritten on the same stream right after
    ``wait_staged()``: the checkpoint holds exactly the chain's result, never the buffer's old
    zeros, a partial result or the overwrite."""
    n = 8192
    g = torch.Generator(device="cuda").manual_seed(11)
    a = torch.randn(n, n, device="cuda", generator=g) / n**0.5  # entries stay O(1) along the chain
    x0 = torch.randn(n, n, device="cuda", generator=g)
    out = torch.zeros(n, n, device="cuda")
    template = {"out": _st("out", torch.empty(n, n, device="cuda"))}
    m = CheckpointManager("cuda-order", store_root=str(shm_root), replication_factor=1)
    try:
        for it in (1, 2, 3):  # later saves stage into recycled, already page-locked segments
            torch.cuda.synchronize()
            x = x0 * it
            for _ in range(7):
                x = x @ a
            torch.matmul(x, a, out=out)  # ~8 x 1.1 TFLOP in fp32: well over 100 ms of GPU work
            expected = out.clone()  # same stream: the value the snapshot must hold
            produced = torch.cuda.Event()
            produced.record()
            assert not produced.query(), "the producer must still be running when the save starts"
            h = m.save_local({"out": _st("out", out)}, it)
            h.wait_staged()
            # wait_staged() returned: the copies ran after the producer, so it has finished too.
            assert produced.query()
            out.fill_(-7.0)  # the optimizer step, on the current stream, no synchronize
            h.wait()
            state, got_it = m.load_local(template)
            torch.cuda.synchronize()
            assert got_it == it
            want = expected.cpu()
            assert bool(torch.isfinite(want).all()) and not bool((want == 0).all())
            assert state["out"].device.type == "cuda"
            assert _same_bytes(state["out"], want), (
                f"iteration {it}: the snapshot is not the producer's result"
            )
    finally:
        m.close()


# ---- c. two ranks on two simulated nodes, one node replaced ----------------------------------------

SESSION = "cuda-mp"


def _rank_state(rank: int, ws: int, step: int, fill: bool = True) -> dict:
    """One rank's state on cuda:0: a data-parallel replicated fp32 weight (identical on every
    rank, saved once), per-rank bf16 / fp16 / int64 shards, a 0-dim counter, a non-contiguous
    shard and a plain value."""

    def t(shape, dtype, key):
        if not fill:
            return torch.zeros(shape, dtype=dtype, device="cuda")
        # zlib, not hash(): str hashes are salted per process, and the restoring processes
        # must regenerate what the saving ones saved
        return _random(shape, dtype, zlib.crc32(f"{key}/{step}".encode())).cuda()

    # a transposed, strided view: rows of the transpose, every other column -> (64, 20)
    nc = t((40, 64), torch.float32, f"nc{rank}").t()[:, ::2] if fill else t((64, 20), torch.float32, "")
    return {
        "model": {
            "w": _st("w", t((128, 256), torch.float32, "w"), replica_id=rank),
            "u": _st("u", t((64, 96), torch.bfloat16, f"u{rank}"), (0, rank, ws)),
            "h": _st("h", t((33, 17), torch.float16, f"h{rank}"), (0, rank, ws)),
        },
        "ids": _st("ids", t((1000,), torch.int64, f"i{rank}"), (0, rank, ws)),
        "counter": _st("counter", t((), torch.int64, f"c{rank}"), (0, rank, ws), prepend_axis_num=1),
        "nc": _st("nc", nc, (0, rank, ws)),
        "step": step,
    }


def _leaves(sd: dict, prefix: str = ""):
    for k, v in sd.items():
        if isinstance(v, dict):
            yield from _leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def _save_on_cuda(ctx):
    torch.cuda.set_device(0)
    m = CheckpointManager(SESSION, store_root=ctx.store_root, replication_factor=2, timeout_s=60)
    try:
        for step in (10, 20):
            h = m.save_local(_rank_state(ctx.rank, ctx.world_size, step), step)
            h.wait_staged()
            h.wait()
    finally:
        m.close()
    return True


def _restore_on_cuda(ctx):
    torch.cuda.set_device(0)
    m = CheckpointManager(SESSION, store_root=ctx.store_root, replication_factor=2, timeout_s=60)
    try:
        state, it = m.load_local(_rank_state(ctx.rank, ctx.world_size, 0, fill=False))
        torch.cuda.synchronize()
        source = m.last_load_metrics.source
        readers = dict(m.last_load_metrics.reader_seconds)
    finally:
        m.close()
    want = dict(_leaves(_rank_state(ctx.rank, ctx.world_size, it)))
    got = dict(_leaves(state))
    tensors = {k for k, v in want.items() if isinstance(v, ShardedTensor)}
    out = {
        "iteration": it,
        "source": source,
        "exact": sorted(got) == sorted(want)
        and all(_same_bytes(got[k], want[k].data) for k in tensors)
        and got["step"] == it,
        "on_cuda": sorted(k for k in tensors if got[k].device.type != "cuda"),
        "readers": readers,
    }
    # The job's own gloo group still pairs up after the restore (the manager used its own).
    total = torch.tensor([float(ctx.rank + 1)])
    dist.all_reduce(total)
    out["all_reduce"] = total.item()
    return out


@pytest.mark.multiprocess
def test_two_nodes_on_one_gpu_restore_a_replaced_node_from_its_peer_into_cuda_templates(shm_root):
    assert run_ranks(_save_on_cuda, 2, shm_root, ranks_per_node=1, **RUN) == [True, True]
    shutil.rmtree(node_store_root(str(shm_root), 1))  # node 1 replaced: its memory is gone
    out = run_ranks(_restore_on_cuda, 2, shm_root, ranks_per_node=1, **RUN)
    assert [o["iteration"] for o in out] == [20, 20]
    assert [o["source"] for o in out] == ["local", "peer"]
    assert [o["exact"] for o in out] == [True, True]
    assert [o["on_cuda"] for o in out] == [[], []], "restored tensors left on another device"
    assert [o["all_reduce"] for o in out] == [3.0, 3.0]
    # The local rank's reads went store -> pinned ring -> device: the breakdown says so.
    assert out[0]["readers"].get("pread", 0) > 0 and out[0]["readers"].get("H2D queued", 0) > 0, out[0]


# ---- d. a CUDA model and AdamW through TrainState and CheckpointHook -------------------------------


def _cuda_train_state(seed: int) -> TrainState:
    torch.manual_seed(seed)  # seeds the CUDA generators too
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    return TrainState(model, opt, extra={"data_position": 0})


def _train_step(state: TrainState) -> None:
    g = torch.Generator(device="cuda").manual_seed(state.extra["data_position"])
    x = torch.randn(8, 16, device="cuda", generator=g)
    state.optimizer.zero_grad()
    state.model(x).pow(2).mean().backward()
    state.optimizer.step()  # the hook's pre-step hook waits for the last save's staging
    state.extra["data_position"] += 1


def _snapshot(state: TrainState):
    params = {k: v.detach().clone() for k, v in state.model.state_dict().items()}
    opt = state.optimizer.state_dict()
    opt_state = {
        i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()} for i, s in opt["state"].items()
    }
    return params, opt_state, [dict(g) for g in opt["param_groups"]], dict(state.extra)


def test_a_cuda_model_and_adamw_resume_bit_exactly_through_the_hook(shm_root):
    state = _cuda_train_state(0)
    manager = CheckpointManager("cuda-hook", store_root=str(shm_root), replication_factor=1)
    hook = CheckpointHook(manager, every_n_steps=2, state=state)
    for step in range(5):
        _train_step(state)
        if step == 3:
            at_3 = _snapshot(state)
            rng_at_3 = torch.cuda.get_rng_state()
        hook.step(step)  # saves after steps 1 and 3; step 4 mutates after the last save
        torch.randn(16, device="cuda")  # the CUDA generator moves on after each save
    hook.close()
    manager.close()
    assert hook.saved_steps == [1, 3] and hook.failed_saves == 0
    params, opt_state, groups, extra = at_3
    assert any(not torch.equal(params[k], v) for k, v in state.model.state_dict().items())

    fresh = _cuda_train_state(1)
    with CheckpointManager("cuda-hook", store_root=str(shm_root), replication_factor=1) as again:
        assert CheckpointHook(again, 2, state=fresh).restore() == 4
    got_params, got_opt, got_groups, got_extra = _snapshot(fresh)
    for k, want in params.items():
        assert got_params[k].device.type == "cuda", k
        assert _same_bytes(got_params[k], want), k
    assert sorted(got_opt) == sorted(opt_state) and opt_state
    for i, entry in opt_state.items():
        assert sorted(got_opt[i]) == sorted(entry)
        for k, want in entry.items():
            got = got_opt[i][k]
            if torch.is_tensor(want):
                assert got.device == want.device, (i, k, got.device, want.device)
                assert _same_bytes(got, want), (i, k)
            else:
                assert got == want, (i, k)
    assert all(opt_state[i]["exp_avg"].is_cuda for i in opt_state)
    assert got_groups == groups and got_extra == extra == {"data_position": 4}
    assert torch.equal(torch.cuda.get_rng_state(), rng_at_3)


def test_the_zoo_resumes_bit_exactly_on_cuda_with_synchronized_and_per_rank_batchnorm(shm_root):
    """tests/test_zoo_plain.py on the GPU (2 nodes x 1 rank, both on cuda:0, DDP over gloo):
    BatchNorm with and without buffer broadcast, SyncBatchNorm (CUDA only), the tied model; the
    buffers' copies at the save run on the current stream, the CUDA RNG is compared too."""
    from test_zoo_plain import RESTORED, _job
    from zoo import check_bit_exact, run_zoo

    names = ["batchnorm", "batchnorm-no-broadcast", "syncbatchnorm", "tied-groups-amsgrad"]
    results = run_zoo(run_ranks, shm_root, 1, _job, names, more_args=("cuda",))
    check_bit_exact(results, 1, RESTORED)
