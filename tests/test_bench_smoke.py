"""The benchmark: its workload, the machine's limits and a full (tiny) side-by-side run."""

import json
import math
import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from resilient_ckpt.bench import limits, runner, workload
from resilient_ckpt.bench import main as bench
from resilient_ckpt.bench.workload import Workload, layout, parse_size, verify
from resilient_ckpt.errors import ValidationError
from resilient_ckpt.model.nested import map_leaves

MIB = 1 << 20


# --- workload -------------------------------------------------------------------------------


def _leaves(d, prefix=()):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _leaves(v, prefix + (k,))
    else:
        yield prefix, d


def _describe(x):
    """Everything about a leaf that a checkpoint must preserve, independent of the flavour."""
    cls = type(x).__name__
    if cls == "ShardedTensor":
        return (
            cls,
            x.key,
            x.dtype,
            tuple(x.local_shape),
            tuple(x.global_shape),
            tuple(x.global_offset),
            tuple(x.axis_fragmentations),
            x.replica_id,
            x.prepend_axis_num,
            bytes(x.data.contiguous().view(-1).view(torch.uint8).numpy()),
        )
    if cls == "ShardedObject":
        return (cls, x.key, tuple(x.global_shape), tuple(x.global_offset), x.replica_id, repr(x.data))
    return ("plain", repr(x))


@pytest.mark.parametrize("world_size,dp_size", [(2, None), (4, 2)])
def test_ours_and_mcore_flavours_build_the_same_layout_and_content(world_size, dp_size):
    for rank in range(world_size):
        ours = workload.build(MIB, world_size, rank, "ours", dp_size=dp_size, iteration=7)
        mcore = workload.build(MIB, world_size, rank, "mcore", dp_size=dp_size, iteration=7)
        a, b = dict(_leaves(ours)), dict(_leaves(mcore))
        assert a.keys() == b.keys()
        for path in a:
            assert _describe(a[path]) == _describe(b[path]), path
        assert type(mcore["model"]["embedding.word_embeddings.weight"]).__module__ == (
            "megatron.core.dist_checkpointing.mapping"
        )


def test_half_the_bytes_are_dp_replicated_and_a_rank_saves_three_quarters_at_w2():
    b = 1 << 30
    lays = [layout(b, 2, r) for r in range(2)]
    for lay in lays:
        assert lay.replicated_bytes == lay.unique_bytes == b // 2
        assert lay.expected_saved_bytes == workload.expected_saved_bytes(b, 2) == b * 3 // 4
        assert {t.dtype for t in lay.tensors} == {torch.bfloat16, torch.float32}
        # like a real model: several hundred tensors, a few big matrices, many small vectors
        assert 200 <= len(lay.tensors) <= 1000
        big = [t for t in lay.tensors if 8 * MIB <= t.nbytes <= 64 * MIB]
        small = [t for t in lay.tensors if t.nbytes < MIB]
        assert len(big) >= 4 and len(small) >= len(lay.tensors) // 3
    # each replicated shard has exactly one main replica across the dp group
    rep = [[t for t in lay.tensors if t.replicated] for lay in lays]
    for t0, t1 in zip(*rep):
        assert t0.key == t1.key and sorted([t0.replica_id, t1.replica_id]) == [0, 1]
    # unique shards of one key sit at different offsets of the global tensor
    uniq = [[t for t in lay.tensors if not t.replicated] for lay in lays]
    for t0, t1 in zip(*uniq):
        assert t0.rank_offsets == ((0, 0, 2),) and t1.rank_offsets == ((0, 1, 2),)


@settings(max_examples=60, deadline=None)
@given(
    units=st.integers(min_value=4096, max_value=(2 << 30) // 16),
    world_size=st.integers(min_value=1, max_value=16),
)
def test_any_valid_size_splits_exactly_into_replicated_and_unique_halves(units, world_size):
    b = units * 16
    lay = layout(b, world_size, world_size - 1)
    assert lay.replicated_bytes == lay.unique_bytes == b // 2
    assert all(t.nbytes > 0 and all(s > 0 for s in t.local_shape) for t in lay.tensors)
    assert lay.expected_saved_bytes == b // 2 + b // 2 // world_size


def test_replicated_shards_hold_the_same_bytes_on_every_rank_and_unique_ones_do_not():
    w0, w1 = Workload(MIB, 2, 0), Workload(MIB, 2, 1)
    for spec in w0.layout.tensors:
        same = torch.equal(w0.tensors[spec.path].view(torch.uint8), w1.tensors[spec.path].view(torch.uint8))
        assert same == spec.replicated, spec.key


def _plain(sd):
    return map_leaves(lambda x: x.data if type(x).__name__ in ("ShardedTensor", "ShardedObject") else x, sd)


def test_verify_accepts_the_saved_iteration_and_rejects_another_or_a_missing_key():
    wl = Workload(MIB, 2, 1, iteration=200)
    lay = wl.layout
    assert verify(_plain(wl.sharded_state_dict()), lay, 200) == []
    wl.advance(201)
    problems = verify(_plain(wl.sharded_state_dict()), lay, 200)
    assert problems and "differs" in problems[0]
    wl.advance(200)
    restored = _plain(wl.sharded_state_dict())
    del restored["model"]["embedding.word_embeddings.weight"]
    restored["args"].hidden_size += 1
    problems = verify(restored, lay, 200)
    assert any("missing tensor model/embedding" in p for p in problems)
    assert any("value args differs" in p for p in problems)


def test_verify_compares_bytes_across_devices_and_reports_a_restore_to_the_wrong_device():
    wl = Workload(MIB, 2, 0, iteration=200)
    restored = _plain(wl.sharded_state_dict())
    assert verify(restored, wl.layout, 200, device="cpu") == []
    # restored to the host where a GPU was asked for: each such tensor is named, once
    problems = verify(restored, wl.layout, 200, device="cuda", limit=2)
    assert len(problems) == 2 and all("restored to cpu, expected cuda" in p for p in problems)
    meta = Workload(MIB, 2, 0, fill="zeros", device="meta")
    assert all(t.device.type == "meta" for t in meta.tensors.values())


def test_cuda_limits_bound_stall_by_the_d2h_link_and_restores_by_h2d():
    from resilient_ckpt.bench import report

    gib = float(1 << 30)
    cpu = {
        k: 10 * gib for k in ("memcpy_bps", "memcpy_1thread_bps", "shm_memcpy_bps", "shm_memcpy_1thread_bps")
    }
    cpu["p2p_bps"] = 2 * gib
    cuda = dict(cpu, d2h_pinned_bps=50 * gib, h2d_pinned_bps=40 * gib, cuda_devices=1)
    b, w = 1 << 30, 2
    s = workload.expected_saved_bytes(b, w)
    assert report.limit_seconds("stall_s", b, w, 1, 2, cpu) == pytest.approx(w * s / (10 * gib))
    assert report.limit_seconds("stall_s", b, w, 1, 2, cuda) == pytest.approx(w * s / (50 * gib))
    assert report.limit_seconds("durable_s", b, w, 1, 2, cuda) == pytest.approx(
        w * s / (50 * gib) + w * s / (2 * gib)
    )
    restart_cpu = report.limit_seconds("restore_restart_s", b, w, 1, 2, cpu)
    restart_cuda = report.limit_seconds("restore_restart_s", b, w, 1, 2, cuda)
    assert restart_cuda == pytest.approx(restart_cpu + w * b / (40 * gib))
    assert report.limit_seconds("restore_node_loss_s", b, w, 1, 2, cuda) == pytest.approx(
        restart_cuda + s / (2 * gib)
    )
    # two GPUs: each carries one rank's copies
    two = dict(cuda, cuda_devices=2)
    assert report.limit_seconds("stall_s", b, w, 1, 2, two) == pytest.approx(s / (50 * gib))
    assert report.limit_formula("stall_s", cuda) == "g*s/d2h"
    assert report.limit_formula("stall_s", cpu) == "W*s/memcpy"
    assert "GPU -> pinned host 50.00 GiB/s, pinned host -> GPU 40.00 GiB/s" in report.format_limits(
        dict(cuda, threads=2, fresh_memcpy_1thread_bps=gib, gloo_p2p_bps=gib, zmq_bps=gib)
    )


@given(n=st.integers(min_value=0, max_value=1 << 44))
def test_size_strings_round_trip(n):
    n = n - n % 1024 if n >= 1024 else n
    assert parse_size(workload.format_size(n)) == n


def test_bad_sizes_and_shapes_are_rejected_with_the_fix():
    with pytest.raises(ValidationError, match="K/M/G/T"):
        parse_size("12Q")
    with pytest.raises(ValidationError, match="multiple of 16"):
        layout(1000, 2, 0)
    with pytest.raises(ValidationError, match="outside world size"):
        layout(MIB, 2, 2)
    with pytest.raises(ValidationError, match="does not divide"):
        layout(MIB, 4, 0, dp_size=3)
    with pytest.raises(ValidationError, match="unknown workload flavour"):
        Workload(MIB, 2, 0, flavour="dcp")


# --- limits ---------------------------------------------------------------------------------


def test_memcpy_limits_are_positive_bandwidths():
    for bw in (
        limits.memcpy_bandwidth(8 * MIB, reps=2),
        limits.memcpy_bandwidth(8 * MIB, threads=1, reps=2),
        limits.shm_memcpy_bandwidth(8 * MIB, reps=2),
        limits.fresh_memcpy_bandwidth(8 * MIB, reps=2),
    ):
        assert math.isfinite(bw) and bw > 0
    with pytest.raises(ValidationError, match="positive"):
        limits.memcpy_bandwidth(0)


@pytest.mark.multiprocess
def test_loopback_transport_limits_are_positive_bandwidths():
    assert limits.gloo_p2p_bandwidth(16 * MIB, chunk=4 * MIB, reps=1) > 0
    assert limits.zmq_bandwidth(16 * MIB, frame=4 * MIB, reps=1) > 0


# --- runner ---------------------------------------------------------------------------------


class EagerSystem:
    """Snapshots the state inside save(), writes it (to every node: a replica) in wait()."""

    name = "eager"
    flavour = "ours"
    lazy = False

    def setup(self, ctx):
        self.ctx = ctx

    def _paths(self, node_range):
        return [
            os.path.join(runner.node_store_root(self.ctx.tmp_root, n), f"{self.ctx.rank}.pt")
            for n in node_range
        ]

    def save(self, state, iteration):
        snap = None if self.lazy else _clone(_plain(state))

        def write():
            data = _clone(_plain(state)) if self.lazy else snap
            for p in self._paths(range(self.ctx.num_nodes)):
                torch.save(data, p)

        return runner.SaveHandle(write)

    def restore(self, template):
        for p in self._paths(range(self.ctx.num_nodes)):
            if os.path.exists(p):
                return torch.load(p, weights_only=False)
        raise FileNotFoundError("no copy left")

    def teardown(self):
        pass


class LazySystem(EagerSystem):
    """Returns from save() before copying: it stores what the loop wrote afterwards."""

    name = "lazy"
    lazy = True


def _clone(x):
    return map_leaves(lambda v: v.clone() if isinstance(v, torch.Tensor) else v, x)


@pytest.mark.multiprocess
def test_a_save_that_reads_tensors_after_returning_fails_the_bit_exact_check(tmp_path, capsys):
    out = tmp_path / "r.json"
    # one flag and its value per line
    # fmt: off
    rc = bench.main([
        "--sizes", "1M", "--world-sizes", "2", "--reps", "1", "--no-limits",
        "--systems", "test_bench_smoke:EagerSystem,test_bench_smoke:LazySystem",
        "--json", str(out),
    ])
    # fmt: on
    doc = json.loads(out.read_text())
    eager, lazy = doc["runs"]
    assert eager["errors"] == []
    assert lazy["errors"] and all("not bit-exact" in e for e in lazy["errors"])
    assert rc == 1
    assert "not bit-exact" in capsys.readouterr().out


def test_an_unimportable_system_is_skipped_with_a_line(tmp_path, capsys):
    out = tmp_path / "r.json"
    rc = bench.main(["--quick", "--no-limits", "--systems", "no_such_module:System", "--json", str(out)])
    assert rc == 0
    assert "skipping no_such_module:System" in capsys.readouterr().out
    doc = json.loads(out.read_text())
    assert doc["runs"] == [] and "not importable" in doc["skipped"][0]["reason"]


def test_an_unknown_system_name_is_rejected_with_the_choices():
    with pytest.raises(ValidationError, match="ours-embedded"):
        bench.main(["--systems", "fastest", "--no-limits"])


@pytest.mark.multiprocess
def test_quick_baseline_run_writes_json_with_metrics_limits_and_dedup(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    size = 16 * MIB
    rc = bench.main(
        ["--quick", "--sizes", "16M", "--systems", "baseline", "--json", str(out), "--plot", str(png)]
    )
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["patched_for_cpu"] and doc["rss_method"].startswith("VmHWM")
    lim = doc["limits"]
    for k in ("memcpy_bps", "memcpy_1thread_bps", "shm_memcpy_bps", "gloo_p2p_bps", "zmq_bps"):
        assert lim[k] > 0
    (run,) = doc["runs"]
    assert run["errors"] == [] and run["world_size"] == 2 and run["bytes_per_rank"] == size
    m = {k: v["median"] for k, v in run["metrics"].items()}
    for k in ("stall_s", "durable_s", "restore_restart_s", "restore_node_loss_s"):
        assert m[k] > 0, k
    assert m["durable_s"] >= m["stall_s"]
    assert m["peak_rss_save_bytes"] > size and m["peak_rss_restore_bytes"] > size
    # Megatron's fully parallel dedup: a rank saves about B/2 + B/(2W) = 0.75 B
    assert m["saved_bytes"] == pytest.approx(0.75 * size, rel=0.05)
    # each node keeps its own files and its peer's replica
    assert m["store_bytes_per_rank"] >= 2 * 0.7 * size
    rows = [c for c in doc["comparisons"] if c["metric"] == "stall_s"]
    assert rows and rows[0]["baseline"] == m["stall_s"] and rows[0]["limit"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
