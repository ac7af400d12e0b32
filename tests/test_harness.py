"""The shared harness itself: real gloo ranks, results in order, SIGKILL observed."""

import threading

import pytest
import torch
import torch.distributed as dist

from harness import KILLED, RankFailed, run_ranks


def _sum_ranks(ctx):
    t = torch.tensor([ctx.rank], dtype=torch.int64)
    dist.all_reduce(t)
    return int(t), ctx.node, ctx.store_root


def test_ranks_form_a_gloo_group_and_report_in_order(tmp_root):
    out = run_ranks(_sum_ranks, 4, tmp_root, ranks_per_node=2)
    assert [o[0] for o in out] == [6, 6, 6, 6]
    assert [o[1] for o in out] == [0, 0, 1, 1]
    assert out[0][2] == out[1][2] != out[2][2]


def _die_on_rank1(ctx):
    if ctx.rank == 1:
        ctx.kill_self()
    return "alive"


def test_a_rank_that_kills_itself_is_reported_killed(tmp_root):
    assert run_ranks(_die_on_rank1, 2, tmp_root, expect_killed=[1]) == ["alive", KILLED]


def _raise_on_rank0(ctx):
    if ctx.rank == 0:
        raise ValueError("boom from rank 0")
    return 1


def test_an_exception_in_a_rank_fails_with_its_traceback(tmp_root):
    with pytest.raises(RankFailed, match="boom from rank 0"):
        run_ranks(_raise_on_rank0, 2, tmp_root)


def _rank_1_hangs_in_a_named_function(ctx):
    if ctx.rank == 1:
        _waits_forever()
    return ctx.rank


def _waits_forever():
    threading.Event().wait()


def test_a_hung_rank_is_reported_with_every_threads_stack(tmp_path):
    with pytest.raises(RankFailed) as failure:
        run_ranks(_rank_1_hangs_in_a_named_function, 2, tmp_path, timeout=3)
    report = str(failure.value)
    assert "ranks still running: [1]" in report
    assert "--- rank 1: every thread's stack at the timeout ---" in report
    assert "_waits_forever" in report and "_rank_1_hangs_in_a_named_function" in report
