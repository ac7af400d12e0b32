"""Replica placement (ring, clique) and the restore-time retrieval planner: pure functions."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from resilient_ckpt.errors import NoReplicaError, ReplicationError
from resilient_ckpt.replication import (
    Fetch,
    Placement,
    clique_placement,
    placement_from_env,
    plan_retrieval,
    ring_placement,
)


def _nodes(w: int, rpn: int) -> int:
    return -(-w // rpn)


def _load_bound(w: int, rpn: int, f: int, rank: int) -> int:
    """The bound placement.py documents: F-1, except the forced case (exactly F nodes and a
    partial last node) where each rank of node m holds at most ceil((W - size_m) / size_m)."""
    node = rank // rpn
    size = min(rpn, w - node * rpn)
    if _nodes(w, rpn) == f:
        return max(f - 1, -(-(w - size) // size))
    return f - 1


ring_configs = st.integers(1, 8).flatmap(
    lambda rpn: st.tuples(
        st.integers(1, 70),  # world size
        st.just(rpn),
        st.integers(1, 5),  # replication factor
        st.integers(1, 80),  # jump, any value (multiples of rpn are the usual case)
    )
)


def _ring_or_skip(w, rpn, f, j) -> Placement:
    assume(_nodes(w, rpn) >= f)
    return ring_placement(w, f, jump=j, ranks_per_node=rpn)


@settings(max_examples=400, deadline=None)
@given(ring_configs)
def test_ring_gives_every_rank_f_minus_1_distinct_holders_on_distinct_foreign_nodes(cfg):
    w, rpn, f, j = cfg
    p = _ring_or_skip(w, rpn, f, j)
    for r in range(w):
        holders = p.holders_of(r)
        assert len(holders) == f - 1
        nodes = [p.node_of(h) for h in holders]
        assert p.node_of(r) not in nodes, (r, holders)
        assert len(set(nodes)) == len(nodes), (r, holders)


@settings(max_examples=400, deadline=None)
@given(ring_configs)
def test_ring_load_stays_within_the_documented_bound_which_is_optimal(cfg):
    w, rpn, f, j = cfg
    p = _ring_or_skip(w, rpn, f, j)
    loads = [len(p.sources_for(r)) for r in range(w)]
    for r in range(w):
        assert loads[r] <= _load_bound(w, rpn, f, r), (r, loads)
    assert sum(loads) == w * (f - 1)
    # The bound is tight: no placement can do better. Replicas average F-1 per rank, and in
    # the forced case the last node must take a copy from every other rank.
    last = _nodes(w, rpn) - 1
    last_ranks = range(last * rpn, w)
    if _nodes(w, rpn) == f:
        assert sum(loads[r] for r in last_ranks) == w - len(last_ranks)
    assert max(loads) >= f - 1


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 8), st.integers(1, 10), st.integers(1, 5))
def test_ring_with_full_nodes_is_the_plain_jump_ring_with_exactly_f_minus_1_per_rank(rpn, nodes, f):
    assume(nodes >= f)
    w = rpn * nodes
    p = ring_placement(w, f, ranks_per_node=rpn)
    assert p.jump == rpn
    for r in range(w):
        assert p.holders_of(r) == tuple((r + k * rpn) % w for k in range(1, f))
        assert len(p.sources_for(r)) == f - 1


@settings(max_examples=200, deadline=None)
@given(ring_configs)
def test_ring_placement_is_deterministic_and_sources_invert_holders(cfg):
    w, rpn, f, j = cfg
    p = _ring_or_skip(w, rpn, f, j)
    q = Placement(w, f, j, rpn, "ring")
    assert p == q and hash(p) == hash(q)
    assert [p.holders_of(r) for r in range(w)] == [q.holders_of(r) for r in range(w)]
    inverse = {r: sorted(s for s in range(w) if r in p.holders_of(s)) for r in range(w)}
    assert {r: list(p.sources_for(r)) for r in range(w)} == inverse


def test_ring_with_a_partial_last_node_keeps_copies_off_the_source_node():
    # W=3, 2 ranks per node: nodes {0,1} and {2}. Ranks 0 and 1 can only use rank 2.
    p = ring_placement(3, 2, ranks_per_node=2)
    assert p.holders_of(0) == (2,)
    assert p.holders_of(1) == (2,)
    assert p.holders_of(2) == (1,)  # 2 + J = 4 ≡ 1 (mod 3)
    assert p.sources_for(2) == (0, 1)
    assert p.max_replicas_held == 2


def test_ring_follows_the_jump_and_skips_same_node_candidates():
    # W=5, 2 ranks per node: nodes {0,1} {2,3} {4}; jump 2 lands on another node every time.
    p = ring_placement(5, 2, ranks_per_node=2)
    assert [p.holders_of(r) for r in range(5)] == [(2,), (3,), (4,), (0,), (1,)]
    # jump 1 with 4 ranks per node: r+1 is usually on the same node and is skipped.
    q = ring_placement(8, 2, jump=1, ranks_per_node=4)
    assert [q.node_of(q.holders_of(r)[0]) for r in range(8)] == [1] * 4 + [0] * 4
    assert q.max_replicas_held == 1


def test_replication_factor_one_has_no_holders():
    p = ring_placement(4, 1, ranks_per_node=4)  # one node is fine without replicas
    assert all(p.holders_of(r) == () and p.sources_for(r) == () for r in range(4))
    assert p.max_replicas_held == 0


def test_too_few_nodes_for_the_factor_is_an_error_naming_sizes_and_fix():
    with pytest.raises(ReplicationError) as e:
        ring_placement(8, 3, ranks_per_node=4)
    msg = str(e.value)
    for part in (
        "factor 3",
        "world size 8",
        "4 ranks per node",
        "2 node",
        "lower replication_factor",
    ):
        assert part in msg, msg


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        (dict(world_size=0, replication_factor=2, jump=1, ranks_per_node=1), "world_size"),
        (dict(world_size=4, replication_factor=0, jump=1, ranks_per_node=1), "replication_factor"),
        (dict(world_size=4, replication_factor=2, jump=0, ranks_per_node=1), "jump"),
        (dict(world_size=4, replication_factor=2, jump=1, ranks_per_node=-2), "ranks_per_node"),
        (dict(world_size=4, replication_factor=2, jump=1, ranks_per_node=1, kind="star"), "kind"),
    ],
)
def test_invalid_placement_arguments_are_rejected_by_name(kwargs, fragment):
    with pytest.raises(ReplicationError, match=fragment):
        Placement(**kwargs)


def test_asking_about_a_rank_outside_the_world_is_an_error():
    p = ring_placement(4, 2, ranks_per_node=2)
    with pytest.raises(ReplicationError, match="outside this placement's world of 4"):
        p.holders_of(4)


# ---------------------------------------------------------------------------------- clique


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 6), st.integers(1, 4), st.integers(1, 4), st.integers(1, 3))
def test_clique_groups_match_nvidia_resiliency_ext(rpn, jump_nodes, f, groups_per_column):
    from nvidia_resiliency_ext.checkpointing.local.replication.group_utils import (
        parse_group_sequence,
    )

    j = rpn * jump_nodes
    w = j * f * groups_per_column
    p = clique_placement(w, f, jump=j, ranks_per_node=rpn)
    for group in parse_group_sequence(j, f, w):
        for i, r in enumerate(group):
            assert set(p.holders_of(r)) == set(group) - {r}
            assert p.holders_of(r) == tuple(group[(i + k) % f] for k in range(1, f))
            assert set(p.sources_for(r)) == set(group) - {r}


def test_clique_needs_world_size_divisible_by_jump_times_factor():
    with pytest.raises(ReplicationError) as e:
        clique_placement(6, 2, ranks_per_node=2)
    assert "6 is not divisible by 2 × 2 = 4" in str(e.value) and "ring" in str(e.value)
    ring_placement(6, 2, ranks_per_node=2)  # the ring has no such requirement


def test_clique_refuses_groups_inside_one_node():
    with pytest.raises(ReplicationError, match="multiple of ranks_per_node"):
        clique_placement(8, 2, jump=1, ranks_per_node=4)


# ---------------------------------------------------------------------------- from env


def test_placement_from_env_reads_local_world_size_for_nodes_and_jump(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    p = placement_from_env(12, 2)
    assert (p.ranks_per_node, p.jump, p.kind) == (4, 4, "ring")
    assert p.holders_of(1) == (5,)
    c = placement_from_env(16, 2, kind="clique")
    assert c.holders_of(0) == (4,)
    assert placement_from_env(12, 2, jump=8).holders_of(0) == (8,)


def test_placement_from_env_without_local_world_size_treats_ranks_as_nodes(monkeypatch):
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    p = placement_from_env(4, 2)
    assert (p.ranks_per_node, p.jump) == (1, 1)
    assert p.holders_of(3) == (0,)


def test_placement_from_env_rejects_a_malformed_local_world_size(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "eight")
    with pytest.raises(ReplicationError, match="LOCAL_WORLD_SIZE='eight'"):
        placement_from_env(8, 2)


# -------------------------------------------------------------------------- retrieval


def _node_of(rpn):
    return lambda r: r // rpn


def test_retrieval_prefers_the_receiver_itself_then_its_node_then_the_least_loaded_remote():
    node_of = _node_of(2)  # nodes {0,1} {2,3} {4,5}
    plan = plan_retrieval(
        wanted={0: 0, 1: 2, 2: 4, 3: 5},
        available={0: [0, 1, 4], 2: [0, 3], 4: [0, 1], 5: [0, 1]},
        node_of=node_of,
    )
    assert plan == (
        Fetch(0, 0, 0),  # its own store
        Fetch(1, 2, 0),  # rank 0 is on rank 1's node
        Fetch(2, 4, 0),  # remote: ranks 0 and 1 tie, lowest wins
        Fetch(3, 5, 1),  # remote: rank 0 already serves 1 request
    )


def test_retrieval_skips_sources_known_to_be_corrupt():
    plan = plan_retrieval({0: 0}, {0: [0, 2]}, _node_of(2), exclude=[(0, 0)])
    assert plan == (Fetch(0, 0, 2),)


def test_no_replica_left_names_the_owner_and_the_ranks_and_nodes_asked():
    with pytest.raises(NoReplicaError) as e:
        plan_retrieval({0: 0, 1: 3}, {0: [2], 3: [4]}, _node_of(2), exclude=[(4, 3)])
    msg = str(e.value)
    assert "owner 3" in msg and "rank 4 (node 2)" in msg and "corrupt: ranks [4]" in msg
    assert "owner 0" not in msg
    with pytest.raises(NoReplicaError, match="owner 7 .*holders none"):
        plan_retrieval({0: 7}, {}, _node_of(2))


retrieval_cases = st.integers(1, 4).flatmap(
    lambda rpn: st.integers(rpn, 16).flatmap(
        lambda w: st.tuples(
            st.just(rpn),
            st.just(w),
            st.dictionaries(st.integers(0, w - 1), st.integers(0, w - 1), min_size=1),
            st.dictionaries(st.integers(0, w - 1), st.sets(st.integers(0, w - 1), min_size=1), min_size=w),
            st.dictionaries(st.integers(0, w - 1), st.integers(0, 1000)),
        )
    )
)


@settings(max_examples=150, deadline=None)
@given(retrieval_cases)
def test_retrieval_is_local_first_deterministic_and_spreads_remote_bytes(case):
    rpn, w, wanted, available, sizes = case
    node_of = _node_of(rpn)
    assume(all(available.get(o) for o in wanted.values()))
    plan = plan_retrieval(wanted, available, node_of, nbytes=sizes)
    # Determinism: same answer whatever the iteration order of the inputs.
    shuffled = plan_retrieval(
        dict(reversed(list(wanted.items()))),
        {o: list(reversed(sorted(s))) for o, s in reversed(list(available.items()))},
        node_of,
        nbytes=sizes,
    )
    assert plan == shuffled
    assert [f.receiver for f in plan] == sorted(wanted)
    size = lambda o: sizes.get(o, 0)  # noqa: E731
    remote_load = Counter()
    remote_fetches = []
    for f in plan:
        assert f.owner == wanted[f.receiver] and f.source in available[f.owner]
        if f.receiver in available[f.owner]:
            assert f.source == f.receiver
        elif any(node_of(s) == node_of(f.receiver) for s in available[f.owner]):
            assert node_of(f.source) == node_of(f.receiver)
        else:
            remote_load[f.source] += size(f.owner)
            remote_fetches.append(f)
    # Greedy bound: each remote source, minus one of its requests, carries no more bytes than
    # any alternative source of that request carries in the end.
    for src in remote_load:
        mine = [f for f in remote_fetches if f.source == src]
        assert any(
            all(remote_load[src] - size(f.owner) <= remote_load[alt] for alt in available[f.owner])
            for f in mine
        ), (src, remote_load, mine)


@settings(max_examples=100, deadline=None)
@given(st.integers(1, 6), st.integers(1, 40), st.lists(st.integers(1, 100), min_size=40, max_size=40))
def test_retrieval_from_k_equal_remote_holders_stays_within_the_greedy_bound(k, n, sizes):
    # n receivers on node 0 (ranks 0..n-1) want owners whose data sits on k remote ranks.
    holders = [1000 + i for i in range(k)]
    wanted = {r: 100 + r for r in range(n)}
    nbytes = {100 + r: sizes[r] for r in range(n)}
    plan = plan_retrieval(wanted, {o: holders for o in nbytes}, lambda r: 0 if r < 1000 else r, nbytes)
    load = Counter()
    for f in plan:
        load[f.source] += nbytes[f.owner]
    total = sum(nbytes.values())
    assert max(load.values()) <= math.ceil(total / k) + max(nbytes.values())
