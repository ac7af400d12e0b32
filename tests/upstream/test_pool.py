"""The rank pool the ported upstream tests run on: a failing case does not poison the next, a
rank left in a collective by a failed peer or a hung case is reported with its stacks and the
pool restarts, and every case gets a fresh process group and fresh directories."""

import time

import pytest
import torch
import torch.distributed as dist

from upstream.pool import CaseFailed, RankPool

pytestmark = pytest.mark.multiprocess


@pytest.fixture(scope="module")
def bare_pool(tmp_path_factory):
    p = RankPool(tmp_path_factory.mktemp("bare-pool"), world_size=2, case_timeout=10, grace=1.0)
    yield p
    p.close()


def _sum_and_dirs(ctx):
    t = torch.tensor([ctx.rank + 1])
    dist.all_reduce(t)
    (ctx.tmp / f"r{ctx.rank}").touch()
    dist.barrier()
    return int(t), sorted(p.name for p in ctx.tmp.iterdir()), ctx.shm.is_dir(), ctx.case


def _raise_on_rank(ctx, rank):
    if ctx.rank == rank:
        raise ValueError(f"boom on rank {rank}")
    return "fine"


def _raise_while_peer_waits(ctx):
    if ctx.rank == 0:
        raise RuntimeError("rank 0 gave up before the barrier")
    dist.barrier()  # never matched: released when rank 0's group is torn down


def _raise_while_peer_is_stuck(ctx):
    if ctx.rank == 0:
        raise RuntimeError("rank 0 failed")
    time.sleep(60)  # stuck outside any collective (a lock, a full pipe)


def _log_and_return(ctx):
    import logging

    logging.getLogger("some.lib").warning("visible at WARNING")
    logging.getLogger("some.lib").debug("not captured at WARNING")
    with ctx.caplog.at_level(logging.DEBUG):
        logging.getLogger("some.lib").debug("captured at DEBUG")
    return ctx.caplog.text


def _sleep(ctx, seconds):
    time.sleep(seconds)


def test_cases_see_one_gloo_world_and_fresh_shared_directories(bare_pool):
    a = bare_pool.run(_sum_and_dirs)
    b = bare_pool.run(_sum_and_dirs)
    assert [x[:3] for x in a] == [(3, ["r0", "r1"], True)] * 2
    assert [x[:3] for x in b] == [(3, ["r0", "r1"], True)] * 2, "the previous case's files are gone"
    assert a[0][3] != b[0][3]


def test_a_failing_case_reports_the_rank_traceback_and_the_next_case_runs(bare_pool):
    with pytest.raises(CaseFailed, match="(?s)rank 1: FAILED.*ValueError: boom on rank 1"):
        bare_pool.run(_raise_on_rank, 1)
    assert bare_pool.run(_sum_and_dirs)[0][0] == 3


def test_a_rank_left_in_a_collective_by_a_failed_peer_fails_too_and_the_next_case_runs(bare_pool):
    t0 = time.monotonic()
    with pytest.raises(CaseFailed, match=r"(?s)rank 0: FAILED.*gave up.*rank 1: FAILED"):
        bare_pool.run(_raise_while_peer_waits)
    assert time.monotonic() - t0 < 8, "released by the failed rank's group teardown"
    assert bare_pool.run(_sum_and_dirs)[0][0] == 3


def test_a_rank_stuck_after_its_peer_failed_is_reported_with_its_stack_and_the_pool_restarts(bare_pool):
    before = bare_pool.restarts
    t0 = time.monotonic()
    with pytest.raises(CaseFailed) as info:
        bare_pool.run(_raise_while_peer_is_stuck)
    assert time.monotonic() - t0 < 8, "reported after the grace period, not the case timeout"
    msg = str(info.value)
    assert "rank 0 failed" in msg
    assert "rank(s) [1] did not finish within 1.0s after rank(s) [0] failed" in msg
    assert "stacks of rank 1" in msg and "_raise_while_peer_is_stuck" in msg
    assert bare_pool.restarts == before + 1
    assert bare_pool.run(_sum_and_dirs)[0][0] == 3


def test_a_hung_case_times_out_with_a_clear_report(bare_pool):
    with pytest.raises(CaseFailed, match=r"(?s)did not finish within 2s.*stacks of rank 0.*_sleep"):
        bare_pool.run(_sleep, 30, timeout=2)
    assert bare_pool.run(_sum_and_dirs)[0][0] == 3


def test_log_capture_behaves_like_caplog(bare_pool):
    text = bare_pool.run(_log_and_return)[0]
    assert "visible at WARNING" in text and "captured at DEBUG" in text
    assert "not captured at WARNING" not in text
