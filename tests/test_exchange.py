"""Exchange on load: planning (only necessary transfers) and both algorithms on real ranks."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import run_ranks
from resilient_ckpt.errors import ValidationError
from resilient_ckpt.parallel.exchange import (
    EXCHANGE_ALGOS,
    _buckets,
    check_algo,
    plan_exchange,
)


def _g(held=(), need=()):
    return {
        "held": [[k, list(o), d, list(s)] for k, o, d, s in held],
        "need": [[k, list(o)] for k, o in need],
    }


def test_a_shard_needed_only_by_its_holder_costs_nothing():
    plan, absent = plan_exchange(
        [
            _g(held=[("a", (0,), "float32", (4,))], need=[("a", (0,))]),
            _g(held=[("b", (0,), "float32", (4,))], need=[("b", (0,))]),
        ]
    )
    assert plan.transfers == () and plan.bytes_moved() == 0 and absent == {}


def test_a_replicated_shard_is_sent_once_per_receiver_from_one_source():
    held = ("w", (0,), "bfloat16", (2, 3))
    plan, _ = plan_exchange(
        [_g(held=[held]), _g(held=[held]), _g(need=[("w", (0,))]), _g(need=[("w", (0,))])]
    )
    assert sorted((t.src, t.dst) for t in plan.transfers) == [(0, 2), (0, 3)]
    assert all(t.nbytes == 12 for t in plan.transfers) and plan.bytes_moved() == 24


def test_sources_are_spread_over_holders_by_bytes_sent():
    held = [(f"p{i}", (0,), "float32", (10,)) for i in range(4)]
    plan, _ = plan_exchange([_g(held=held), _g(held=held), _g(need=[(h[0], h[1]) for h in held])])
    assert sorted(t.src for t in plan.transfers) == [0, 0, 1, 1]


def test_needed_shards_nobody_holds_are_reported_per_rank():
    plan, absent = plan_exchange([_g(need=[("ghost", (0,))]), _g(held=[("x", (0,), "int64", ())])])
    assert plan.transfers == () and absent == {0: [("ghost", (0,))]}


@st.composite
def _world(draw):
    n = draw(st.integers(1, 5))
    sids = [(f"k{i}", (draw(st.integers(0, 3)),)) for i in range(draw(st.integers(1, 12)))]
    sids = list(dict.fromkeys(sids))
    held = [set(draw(st.lists(st.sampled_from(sids), max_size=len(sids)))) for _ in range(n)]
    need = [set(draw(st.lists(st.sampled_from(sids), max_size=len(sids)))) for _ in range(n)]
    return sids, held, need


@settings(max_examples=100, deadline=None)
@given(_world())
def test_plan_moves_exactly_what_is_needed_and_not_held(case):
    sids, held, need = case
    gathered = [
        _g(held=[(k, o, "float32", (3,)) for k, o in sorted(h)], need=sorted(nd)) for h, nd in zip(held, need)
    ]
    plan, absent = plan_exchange(gathered)
    anyone = set().union(*held)
    expected = {
        (sid, dst) for dst, nd in enumerate(need) for sid in nd if sid not in held[dst] and sid in anyone
    }
    got = [(t.shard_id, t.dst) for t in plan.transfers]
    assert len(got) == len(set(got)) and set(got) == expected
    assert all(t.shard_id in held[t.src] for t in plan.transfers)
    assert all(len({t.src for t in plan.transfers if t.shard_id == sid}) <= 1 for sid in anyone)
    assert {r: set(v) for r, v in absent.items()} == {
        r: nd - anyone for r, nd in enumerate(need) if nd - anyone
    }
    assert plan_exchange(gathered)[0] == plan, "deterministic"


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(0, 300), max_size=30), st.integers(1, 256))
def test_buckets_keep_order_and_stay_within_the_bound_unless_a_shard_is_larger(sizes, cap):
    items = [((f"s{i}", (0,)), n) for i, n in enumerate(sizes)]
    buckets = _buckets(items, cap)
    assert [x for b in buckets for x in b] == items
    assert all(sum(n for _, n in b) <= cap or len(b) == 1 for b in buckets)
    assert all(b for b in buckets)


def test_exchange_algo_names_and_aliases():
    assert EXCHANGE_ALGOS == ("broadcast", "p2p")
    assert check_algo("broadcast") == "broadcast" and check_algo("p2p") == "p2p"
    assert check_algo("point_to_point") == "p2p"
    assert check_algo("gather_rounds") == "broadcast"  # Megatron-core's names keep working
    with pytest.raises(ValidationError, match="unknown exchange_algo 'scatter'; use one of broadcast, p2p"):
        check_algo("scatter")


# ---- real transfers -----------------------------------------------------------------------

_DTYPES = [torch.float32, torch.bfloat16, torch.int64, torch.bool, torch.float16]


def _tensor(i):
    """Deterministic content for shard i (shapes include a scalar and an empty tensor)."""
    shape = [(), (0,), (3,), (2, 5), (7, 3), (1, 1, 4)][i % 6]
    dtype = _DTYPES[i % len(_DTYPES)]
    vals = torch.arange(math.prod(shape), dtype=torch.float64) * (i + 1) * 0.37
    if dtype is torch.bool:
        return (vals.floor() % 2 == 1).reshape(shape)
    return vals.to(dtype).reshape(shape)


def _exchange_rank(ctx, algo):
    from resilient_ckpt.parallel import collectives, exchange

    n, me = ctx.world_size, ctx.rank
    shards = list(range(24))
    # Shard i is held by ranks {i % n, (i*7) % n} and needed by ranks {(i+1) % n, i % 3 % n}.
    held = {}
    for i in shards:
        if me in {i % n, (i * 7) % n}:
            t = _tensor(i)
            if t.dim() == 2:
                t = t.t().contiguous().t()  # non-contiguous held tensors
            held[(f"s{i}", (i,))] = t
    need = [i for i in shards if me in {(i + 1) % n, i % 3 % n}]
    local = {
        "held": [[k, list(o), exchange.dtype_name(t.dtype), list(t.shape)] for (k, o), t in held.items()],
        "need": [[f"s{i}", [i]] for i in need],
    }
    plan, absent = exchange.plan_exchange(collectives.all_gather_msgpack(local))
    assert not absent
    scratch = []
    orig_get = exchange._Scratch.get

    def recording_get(self, role, peer, n):
        buf = orig_get(self, role, peer, n)
        scratch.append(self._bufs[(role, peer)].numel())
        return buf

    exchange._Scratch.get = recording_get
    largest = max(_tensor(i).numel() * _tensor(i).element_size() for i in shards)
    results = []
    for bucket_bytes in (16, exchange.DEFAULT_BUCKET_BYTES):
        scratch.clear()
        got = exchange.execute_exchange(
            plan,
            held,
            lambda sid, dtype, shape: torch.empty(shape, dtype=dtype),
            None,
            algo,
            bucket_bytes,
        )
        exact = []
        for i in need:
            sid = (f"s{i}", (i,))
            t = held.get(sid, got.get(sid))
            exact.append(t is not None and t.dtype == _tensor(i).dtype and torch.equal(t, _tensor(i)))
        expected_recv = sorted(t.shard_id for t in plan.transfers if t.dst == me)
        results.append(
            (all(exact), sorted(got) == expected_recv, max(scratch, default=0) <= max(bucket_bytes, largest))
        )
    return results


@pytest.mark.multiprocess
@pytest.mark.parametrize("algo", ["broadcast", "p2p"])
def test_every_rank_receives_bit_exact_copies_with_bounded_scratch(tmp_root, algo):
    out = run_ranks(_exchange_rank, 3, tmp_root, args=(algo,), timeout=90)
    for per_bucket in out:
        for exact, only_planned, bounded in per_bucket:
            assert exact, "received shards equal the holder's bytes and dtype"
            assert only_planned, "a rank receives exactly the shards the plan sends it"
            assert bounded, "scratch stays within max(bucket size, largest shard)"
