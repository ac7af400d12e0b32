"""The small collectives every save and restore step rides on: payloads of any length arrive
whole and in rank order, short ones in one round trip, and every rank takes the same branch."""

from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import run_ranks
from resilient_ckpt.parallel import collectives

WORLD = 3


def _payload(rank: int, size: int, seed: int) -> bytes:
    return random.Random(seed * 7919 + rank).randbytes(size)


def _gather_rank(ctx, cases):
    import torch.distributed as dist

    calls = []
    orig = dist.all_gather

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    dist.all_gather = counting
    out = []
    for seed, sizes in enumerate(cases):
        calls.clear()
        got = collectives.all_gather_bytes(_payload(ctx.rank, sizes[ctx.rank], seed))
        out.append((got == [_payload(r, sizes[r], seed) for r in range(WORLD)], len(calls)))
    return out


@pytest.mark.multiprocess
def test_payloads_of_every_length_arrive_whole_short_ones_in_one_collective(tmp_root):
    head = collectives.first_round_bytes(WORLD)
    edge = [0, 1, head - 1, head, head + 1, 3 * head + 5, 1 << 20]
    rnd = random.Random(5)
    cases = [[s, s, s] for s in edge]
    cases += [[rnd.choice(edge), rnd.choice(edge), rnd.choice(edge)] for _ in range(12)]
    cases += [[0, 0, head + 1], [head + 1, 0, 0]]  # one long payload: everyone goes twice
    results = run_ranks(_gather_rank, WORLD, tmp_root, args=(cases,), timeout=120)
    for r, per_rank in enumerate(results):
        for sizes, (whole, collectives_used) in zip(cases, per_rank):
            assert whole, f"rank {r}: payloads of sizes {sizes} did not arrive whole"
            assert collectives_used == (1 if max(sizes) <= head else 2), (sizes, collectives_used)


@settings(max_examples=200, deadline=None)
@given(st.integers(min_value=1, max_value=1 << 20))
def test_the_first_round_costs_a_group_at_most_its_budget_and_fits_small_messages(n):
    head = collectives.first_round_bytes(n)
    assert head >= collectives.FIRST_ROUND_MIN
    assert n * head <= max(collectives.FIRST_ROUND_TOTAL, n * collectives.FIRST_ROUND_MIN)


def test_a_peer_closing_its_connection_at_the_groups_timeout_is_a_timeout_on_every_rank():
    # A frozen rank: the first survivor's wait expires ("timed out"), it closes its connections,
    # and the others see "Connection closed by peer" just before their own timeout. Every rank
    # must report the same thing — a timeout — and a genuine early disconnect must not.
    from resilient_ckpt.errors import CheckpointingException, CollectiveTimeoutError

    group = object()
    collectives.note_timeout(group, 4.0)
    try:
        closed = RuntimeError("Connection closed by peer [127.0.0.1]:29500")
        late = collectives._wrap(closed, "all_gather_bytes", group, elapsed=3.9)
        early = collectives._wrap(closed, "all_gather_bytes", group, elapsed=0.2)
        said = collectives._wrap(RuntimeError("Read timeout [127.0.0.1]"), "x", group, elapsed=0.1)
        assert isinstance(late, CollectiveTimeoutError) and "peer rank gave up waiting" in str(late)
        assert isinstance(said, CollectiveTimeoutError)
        assert type(early) is CheckpointingException and "Connection closed by peer" in str(early)
    finally:
        collectives.forget_timeout(group)
    unknown = collectives._wrap(RuntimeError("Connection closed by peer"), "x", object(), elapsed=1e6)
    assert type(unknown) is CheckpointingException  # no timeout known: the words decide


@settings(max_examples=50, deadline=None)
@given(
    outcomes=st.lists(st.sampled_from([True, False, "error"]), min_size=1, max_size=6), me=st.integers(0, 5)
)
def test_a_vote_carried_in_another_gather_decides_as_agree_or_fail_would(outcomes, me):
    """Every rank's vote (yes, no, or its error) gathered by another collective: no if any voted
    no, else yes; any error stops every rank — the failing one with its own exception, the
    others naming the first failing rank and its error."""
    from resilient_ckpt.errors import PeerFailedError

    me = me % len(outcomes)
    errors = {r: KeyError(f"shard {r}") for r, o in enumerate(outcomes) if o == "error"}
    votes = [collectives.vote(errors.get(r), o is True) for r, o in enumerate(outcomes)]
    if me in errors:
        with pytest.raises(KeyError, match=f"shard {me}"):
            collectives.agreed(votes, errors[me], "restoring")
    elif errors:
        first = min(errors)
        with pytest.raises(PeerFailedError, match=f"restoring failed on rank {first}") as e:
            collectives.agreed(votes, None, "restoring")
        assert e.value.rank == first and e.value.reason == f"KeyError: 'shard {first}'"
    else:
        assert collectives.agreed(votes, None, "restoring") is all(outcomes)
