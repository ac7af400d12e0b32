"""Parity redundancy (``redundancy="parity"``): the grouping and striping, the codes, and real
multi-process saves and restores that lose nodes (separate store roots, gloo on loopback)."""

import itertools
import shutil
import time
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import KILLED, node_store_root, run_ranks
from resilient_ckpt.errors import ReplicationError, ValidationError
from resilient_ckpt.model.mapping import ShardedTensor
from resilient_ckpt.replication import erasure
from resilient_ckpt.replication.parity import Unrecoverable, block_nbytes, parity_groups, plan_rebuild

# ---- grouping and striping (pure) ---------------------------------------------------------


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40), st.integers(1, 4), st.integers(1, 6), st.integers(1, 2))
def test_groups_cover_every_rank_once_on_distinct_nodes(world, rpn, k, m):
    nodes = -(-world // rpn)
    if nodes < k + m:
        with pytest.raises(ReplicationError, match=f"needs {k + m} nodes"):
            parity_groups(world, rpn, k, m)
        return
    if world % rpn and nodes == m + 1:
        # a partial last node leaves a column of m ranks: no group of m+1 nodes can hold them
        with pytest.raises(ReplicationError, match="same number of ranks"):
            parity_groups(world, rpn, k, m)
        return
    groups = parity_groups(world, rpn, k, m)
    ranks = sorted(r for g in groups for r in g.members)
    assert ranks == list(range(world))
    for g in groups:
        assert len({r // rpn for r in g.members}) == g.n, "one member per node"
        assert g.m == m and g.k >= 1
        # every member: data in k stripes, parity in m; every stripe k data + m parity shares
        for j in range(g.n):
            assert len(g.data_stripes(j)) == g.k and len(g.parity_stripes(j)) == m
        for s in range(g.n):
            shares = g.shares(s)
            assert [sh.number for sh in shares] == list(range(g.n))
            assert len({sh.member for sh in shares}) == g.n


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 7), st.integers(1, 2), st.data())
def test_any_m_lost_members_are_rebuildable_and_m_plus_one_are_not(n, m, data):
    if n < m + 1:
        return
    (g,) = parity_groups(n, 1, n - m, m)
    lost = data.draw(st.sets(st.integers(0, n - 1), min_size=1, max_size=min(m + 1, n)))
    has = {i: i not in lost for i in range(n)}
    if len(lost) <= m:
        plans = plan_rebuild(g, has, has)
        assert sorted(p.member for p in plans) == sorted(lost)
        for p in plans:
            assert len(p.stripes) == g.k
            for _, shares in p.stripes:
                assert len(shares) == g.k and all(sh.member not in lost for sh in shares)
    else:
        with pytest.raises(Unrecoverable, match="lost the data of ranks"):
            plan_rebuild(g, has, has)


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 5), st.integers(1, 2), st.integers(1, 40), st.data())
def test_codes_decode_any_lost_data_share_from_any_k_shares(k, m, words, data):
    size = words * 8
    blocks = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(k)]
    parity = [torch.empty(size, dtype=torch.uint8) for _ in range(m)]
    for i in range(m):
        erasure.encode(k, m, blocks, i, parity[i])
    shares = {**dict(enumerate(blocks)), **{k + i: p for i, p in enumerate(parity)}}
    lost = data.draw(st.sets(st.integers(0, k + m - 1), min_size=1, max_size=m))
    left = {n: t for n, t in shares.items() if n not in lost}
    pick = dict(sorted(left.items())[:k])
    for want in sorted(n for n in lost if n < k):
        out = torch.empty(size, dtype=torch.uint8)
        erasure.decode(k, m, pick, want, out)
        assert torch.equal(out, blocks[want])


def test_reed_solomon_codes_in_a_forked_child_of_a_process_that_coded():
    # A trainer that coded parity, then forked (a checkpoint writer, a data loader worker):
    # the child has none of the parent's coding threads and must still code, not hang.
    import multiprocessing as mp

    k, m, size = 2, 2, 3 * erasure._CHUNK + 8
    blocks = [torch.randint(0, 256, (size,), dtype=torch.uint8) for _ in range(k)]
    parent = torch.empty(size, dtype=torch.uint8)
    erasure.encode(k, m, blocks, 0, parent)  # the parent's pool now has threads
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    child = ctx.Process(target=_encode_in_child, args=(k, m, blocks, q))
    child.start()
    try:
        got = q.get(timeout=60)
    finally:
        child.join(10)
        if child.is_alive():
            child.kill()
    assert torch.equal(torch.frombuffer(bytearray(got), dtype=torch.uint8), parent)


def _encode_in_child(k, m, blocks, q):
    out = torch.empty(blocks[0].numel(), dtype=torch.uint8)
    erasure.encode(k, m, blocks, 0, out)
    q.put(out.numpy().tobytes())


def test_bad_options_are_refused_with_the_fix():
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    for factor in (2, 3):  # also the default's value, given explicitly
        with pytest.raises(ValidationError, match="two redundancy schemes"):
            CheckpointManager("p", store_root="/tmp/unused", redundancy="parity", replication_factor=factor)
    with pytest.raises(ValidationError, match="embedded-mode only"):
        CheckpointManager("p", redundancy="parity", endpoint="tcp://127.0.0.1:1")
    with pytest.raises(ValidationError, match="parity_group must be a positive integer"):
        CheckpointManager("p", redundancy="parity", parity_group=0)
    with pytest.raises(ValidationError, match="use 1 .XOR. or 2"):
        CheckpointManager("p", redundancy="parity", parity_shares=3)
    with pytest.raises(ValidationError, match="'replicas' or 'parity'"):
        CheckpointManager("p", redundancy="raid")
    with pytest.raises(
        ReplicationError, match="parity_group=4 with parity_shares=1 needs 5 nodes.*use parity_group <= 2"
    ):
        parity_groups(3, 1, 4, 1)


# ---- real processes ----------------------------------------------------------------------


def _state(rank, it, nbytes=None):
    g = torch.Generator().manual_seed(1000 * it + rank)
    # sizes differ per rank (padding of the shorter members) and are not multiples of 64
    own = torch.randn(3000 + 517 * rank, generator=g)
    return {
        "own": ShardedTensor.from_rank_offsets(f"own{rank}", own),
        "half": ShardedTensor.from_rank_offsets(f"half{rank}", own[:100].to(torch.float16).clone()),
        "it": it,
    }


def _template(rank):
    t = _state(rank, 0)
    for v in t.values():
        if isinstance(v, ShardedTensor):
            v.data.zero_()
    return t


def _manager(ctx, k, m, keep_last=1, **kw):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    return CheckpointManager(
        "parity",
        store_root=ctx.store_root,
        ranks_per_node=ctx.ranks_per_node,
        redundancy="parity",
        parity_group=k,
        parity_shares=m,
        keep_last=keep_last,
        timeout_s=30,
        **kw,
    )


def _save(ctx, k, m, iterations, keep_last=1):
    mgr = _manager(ctx, k, m, keep_last)
    for it in iterations:
        mgr.save_local(_state(ctx.rank, it), it).wait()
    met = mgr.last_save_metrics
    mgr.close()
    return met.store_bytes, met.parity_coded_bytes


def _load(ctx, k, m, keep_last=1, attempts=False):
    mgr = _manager(ctx, k, m, keep_last)
    out = mgr.load_local(_template(ctx.rank))
    if out is None:
        mgr.close()
        return None, mgr.last_load_metrics.missing_owners
    state, it = out
    ref = _state(ctx.rank, it)
    exact = all(torch.equal(state[key], ref[key].data) for key in ("own", "half")) and state["it"] == it
    # the job's own group still works
    t = torch.ones(1)
    torch.distributed.all_reduce(t)
    mgr.close()
    if attempts:
        return it, exact and t.item() == ctx.world_size, mgr._parity_rebuild.attempts
    return it, exact and t.item() == ctx.world_size


def _lose(tmp_root, *nodes):
    for n in nodes:
        shutil.rmtree(node_store_root(str(tmp_root), n))


def _copy(tmp_root, dst):
    shutil.copytree(tmp_root / "saved", dst)
    return dst


@pytest.fixture(scope="module")
def k4_saved(tmp_path_factory):
    """5 nodes x 1 rank, k=4, m=1: iterations 1..3 saved, the newest kept."""
    root = tmp_path_factory.mktemp("k4")
    _k4_metrics[:] = run_ranks(
        _save, 5, root / "saved", ranks_per_node=1, args=(4, 1, [1, 2, 3]), timeout=120
    )
    return root


_k4_metrics: list = []


@pytest.mark.multiprocess
@pytest.mark.parametrize("lost", range(5))
def test_k4_any_lost_node_is_rebuilt_bit_exactly(k4_saved, tmp_path, lost):
    root = _copy(k4_saved, tmp_path / "run")
    _lose(root, lost)
    out = run_ranks(_load, 5, root, ranks_per_node=1, args=(4, 1), timeout=120)
    assert out == [(3, True)] * 5
    # the rebuilt rank's own data is back in its (replacement) node's store
    assert list(Path(node_store_root(str(root), lost), "parity").glob("iter_*3.owner_*.hdr"))


def _load_and_heal(ctx, k, m):
    mgr = _manager(ctx, k, m)
    state, it = mgr.load_local(_template(ctx.rank))
    healed = mgr.wait_healed(timeout=60)
    mgr.close()
    return it, healed is not None and healed.whole


@pytest.mark.multiprocess
def test_rebuilt_members_parity_is_healed_so_a_second_loss_before_the_next_save_restores(k4_saved, tmp_path):
    root = _copy(k4_saved, tmp_path / "run")
    _lose(root, 2)
    assert run_ranks(_load_and_heal, 5, root, ranks_per_node=1, args=(4, 1), timeout=120) == [(3, True)] * 5
    assert list(Path(node_store_root(str(root), 2), "parity").glob("iter_*3.parity_000002.data"))
    _lose(root, 0)  # a second node of the same group, before any new save
    assert run_ranks(_load, 5, root, ranks_per_node=1, args=(4, 1), timeout=120) == [(3, True)] * 5


@pytest.mark.multiprocess
def test_k4_store_holds_own_data_plus_a_quarter_as_parity(k4_saved):
    dirs = [Path(node_store_root(str(k4_saved / "saved"), n), "parity") for n in range(5)]
    own = [next(d.glob("iter_*.owner_*.data")).stat().st_size for d in dirs]
    block = block_nbytes(own, 4)  # a quarter of the largest member, 64-aligned
    assert block - 64 < max(own) / 4 <= block
    for d in dirs:
        (par,) = d.glob("iter_*.parity_*.data")
        assert par.stat().st_size == block
    assert all(o >= 4 * 3000 for o in own)
    # and the save reported the node store's occupancy: own + parity + the spare segment
    for store_bytes, coded in _k4_metrics:
        assert coded == 4 * block
        assert max(own) < store_bytes <= 3 * max(own) + block + (64 << 10)


@pytest.mark.multiprocess
def test_two_lost_nodes_of_one_xor_group_warn_alike_on_every_rank(k4_saved, tmp_path):
    root = _copy(k4_saved, tmp_path / "run")
    _lose(root, 1, 3)
    out = run_ranks(_load, 5, root, ranks_per_node=1, args=(4, 1), timeout=120)
    assert out == [(None, [1, 3])] * 5


@pytest.mark.multiprocess
def test_flipped_parity_byte_is_detected_and_the_previous_iteration_restores(tmp_root):
    run_ranks(_save, 3, tmp_root, ranks_per_node=1, args=(2, 1, [1, 2], 2), timeout=120)
    _lose(tmp_root, 0)
    # node 1's parity block of iteration 2 has a flipped byte; m=1 cannot route around it
    (par,) = Path(node_store_root(str(tmp_root), 1), "parity").glob("iter_*2.parity_*.data")
    with open(par, "r+b") as f:
        b = f.read(1)
        f.seek(0)
        f.write(bytes([b[0] ^ 0x01]))
    out = run_ranks(_load, 3, tmp_root, ranks_per_node=1, args=(2, 1, 2), timeout=120)
    assert out == [(1, True)] * 3, "never wrong data: every rank falls back to iteration 1 together"


@pytest.fixture(scope="module")
def rs_saved(tmp_path_factory):
    """4 nodes x 1 rank, k=2, m=2 (Reed-Solomon): iterations 1, 2."""
    root = tmp_path_factory.mktemp("rs")
    run_ranks(_save, 4, root / "saved", ranks_per_node=1, args=(2, 2, [1, 2]), timeout=120)
    return root


@pytest.mark.multiprocess
@pytest.mark.parametrize("lost", list(itertools.combinations(range(4), 2)))
def test_rs_any_two_lost_nodes_are_rebuilt_bit_exactly(rs_saved, tmp_path, lost):
    root = _copy(rs_saved, tmp_path / "run")
    _lose(root, *lost)
    out = run_ranks(_load, 4, root, ranks_per_node=1, args=(2, 2), timeout=120)
    assert out == [(2, True)] * 4


@pytest.mark.multiprocess
def test_rs_routes_around_a_corrupt_share(rs_saved, tmp_path, caplog):
    root = _copy(rs_saved, tmp_path / "run")
    _lose(root, 0)
    # one lost member, two parity shares per stripe: a flipped byte in any one share is detected
    # and the stripe decoded from the others
    # rank 0's stripe 1 is read from rank 3's data and rank 1's first parity share: the
    # second block of rank 1's parity file (its blocks lie in stripe order: 0, 1)
    (par,) = Path(node_store_root(str(root), 1), "parity").glob("iter_*2.parity_*.data")
    at = par.stat().st_size // 2 + 5
    with open(par, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x80]))
    out = run_ranks(_load, 4, root, ranks_per_node=1, args=(2, 2, 1, True), timeout=120)
    assert out == [(2, True, 2)] * 4, "restored on the second plan, without the corrupt share"


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "world, rpn, k, m, lost",
    [
        # 6 nodes, k=2, m=2: two groups of 3 (a leftover of 2 cannot hold m=2); two of (0, 1, 2)
        (6, 1, 2, 2, (0, 2)),
        # 7 nodes, k=4: a group of 5 and a mirror pair (5, 6); one node lost in each
        (7, 1, 4, 1, (2, 6)),
        # 3 nodes x 2 ranks, k=2: groups (0, 2, 4) and (1, 3, 5); node 1 (ranks 2, 3) lost
        (6, 2, 2, 1, (1,)),
    ],
    ids=["rs-6-nodes", "7-nodes-not-divisible", "2-ranks-per-node"],
)
def test_other_layouts_lose_nodes_and_restore_bit_exactly(tmp_root, world, rpn, k, m, lost):
    run_ranks(_save, world, tmp_root, ranks_per_node=rpn, args=(k, m, [4]), timeout=150)
    _lose(tmp_root, *lost)
    out = run_ranks(_load, world, tmp_root, ranks_per_node=rpn, args=(k, m), timeout=150)
    assert out == [(4, True)] * world


def _save_then_die(ctx, point):
    def hook(at):
        if ctx.rank == 1 and at == point and hook.armed:
            ctx.kill_self()

    hook.armed = False
    mgr = _manager(ctx, 2, 1, keep_last=1, fault_hook=hook)
    mgr.save_local(_state(ctx.rank, 1), 1).wait()
    hook.armed = True
    try:
        mgr.save_local(_state(ctx.rank, 2), 2).wait()
        return "saved"
    except Exception as e:
        return type(e).__name__


@pytest.mark.multiprocess
@pytest.mark.parametrize("point", ["before_replication", "parity_after_headers"])
def test_rank_killed_during_encoding_keeps_the_previous_iteration(tmp_root, point):
    t0 = time.monotonic()
    out = run_ranks(
        _save_then_die, 3, tmp_root, ranks_per_node=1, args=(point,), expect_killed=[1], timeout=120
    )
    assert time.monotonic() - t0 < 3 * 30, "the survivors fail within a small multiple of timeout_s"
    assert out[1] is KILLED and out[0] == out[2] != "saved"
    out = run_ranks(_load, 3, tmp_root, ranks_per_node=1, args=(2, 1), timeout=120)
    assert out == [(1, True)] * 3


# ---- memory: what the store occupies -------------------------------------------------------


def _save_replicas(ctx, keep_last, spare):
    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    mgr = CheckpointManager(
        "lean",
        store_root=ctx.store_root,
        ranks_per_node=1,
        keep_last=keep_last,
        spare_segment=spare,
        timeout_s=30,
    )
    for it in (1, 2, 3, 4):
        mgr.save_local(_state(ctx.rank, it), it).wait()
    reported = mgr.last_save_metrics.store_bytes
    mgr.close()
    return reported


@pytest.mark.multiprocess
@pytest.mark.parametrize("keep_last, spare, pooled", [(1, None, 0), (1, True, 2), (2, None, 2)])
def test_store_bytes_and_what_retention_keeps(tmp_root, keep_last, spare, pooled):
    reported = run_ranks(_save_replicas, 2, tmp_root, ranks_per_node=1, args=(keep_last, spare), timeout=120)
    for node in range(2):
        d = Path(node_store_root(str(tmp_root), node), "lean")
        data = sorted(d.glob("iter_*.data"))
        pool = sorted((d / "free").glob("*.data"))
        assert len(data) == 2 * keep_last, "own + one replica per kept iteration"
        # keep_last=1 without a spare: nothing pooled (the reference's footprint); with one, the
        # node's own retired segment as the next save's spare and the retired replica for the
        # next one to land in; keep_last=2 pools both retired segments
        assert len(pool) == pooled
        on_disk = sum(
            p.stat().st_blocks * 512 for p in [*d.iterdir(), *(d / "free").iterdir()] if p.is_file()
        )
        own = max(p.stat().st_size for p in data)
        assert on_disk <= (2 * keep_last + pooled) * own + (64 << 10)
        # the save's figure: the same accounting, taken before a spare was reserved again
        assert 2 * keep_last * own <= reported[node] <= (2 * keep_last + pooled) * own + (64 << 10)
