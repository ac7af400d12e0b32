"""Megatron-LM's own local-checkpointing call sequence, replayed on 2 gloo ranks (2 simulated
nodes) against nvidia-resiliency-ext's LocalCheckpointManager and ours, unchanged but for the
import:

* training.py: ``LocalCheckpointManager(dir, repl_strategy=CliqueReplicationStrategy
  .from_replication_params(jump, factor))``;
* checkpointing.py, every save: ``manager.local_ckpt_dir``, Megatron-core's
  ``MCoreTensorAwareStateDict.from_state_dict(..., algo, cached_metadata,
  parallelization_group)``, ``save(tasd, iteration, is_async=True)``, ``add_finalize_fn``,
  scheduled on an ``AsyncCallsQueue`` (Megatron-core's or nvidia-resiliency-ext's, persistent
  worker or not), ``maybe_finalize_async_calls(blocking=False)`` every step and a blocking one
  at the end;
* restart after a node loss: ``find_latest()``, ``load()`` + ``to_state_dict(None)`` (the
  common state, as ``load_args_from_checkpoint`` does), ``load()`` + ``to_state_dict(template)``.

The restored state must be bit-exact. Ours must also let a non-blocking finalize return while
its save is still replicating (held back by a fault hook until the poll has returned: if the
poll waited for the save, the test would time out).
"""

import shutil
import threading
import warnings
from pathlib import Path

import pytest

from harness import node_store_root, run_ranks
from test_tensor_aware_state_dict import dp_group, megatron_like, plain_values, same

SAVES = (10, 20)


def _manager(impl, root):
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    if impl == "reference":
        from nvidia_resiliency_ext.checkpointing.local.ckpt_managers.local_manager import (
            LocalCheckpointManager,
        )
    else:
        from resilient_ckpt import LocalCheckpointManager
    # Megatron-LM's training.py, --replication --replication-jump 1 --replication-factor 2
    # (ranks 0 and 1 are on different simulated nodes).
    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    return LocalCheckpointManager(root, repl_strategy=strategy)


def _setup(impl):
    from resilient_ckpt.bench.baseline import apply_cpu_patches

    apply_cpu_patches()  # CUDA-only calls of the reference's replica transfer / mcore exchange
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.dist_checkpointing.tensor_aware_state_dict import MCoreTensorAwareStateDict
    return MCoreTensorAwareStateDict


def _train_rank(ctx, impl, queue_owner, persistent):
    from cpu_async_queue import queue_class

    tasd_cls = _setup(impl)
    r, w = ctx.rank, ctx.world_size
    group = dp_group(ctx, 1)
    gate = threading.Event()
    manager = _manager(impl, ctx.store_root)
    if impl == "ours":
        # A slow replication, on command: the first save's replication waits for the gate.
        manager.fault_hook = lambda point: point == "before_replication" and not gate.is_set() and gate.wait()
    assert manager.local_ckpt_dir  # read on every local save by checkpointing.py
    queue = queue_class(queue_owner)(persistent=persistent)
    cache, finalized, polls_in_flight = None, [], 0
    for iteration in range(1, SAVES[-1] + 1):
        if iteration in SAVES:
            state = megatron_like(r, w, 1, step=iteration, use_mcore=True, mixed=False)
            tasd, cacheable = tasd_cls.from_state_dict(
                state, algo="fully_parallel", cached_metadata=cache, parallelization_group=group
            )
            request = manager.save(tasd, iteration, is_async=True)
            request.add_finalize_fn(lambda it=iteration: finalized.append(it))
            queue.schedule_async_request(request)
            cache = cacheable
            if impl == "ours" and iteration == SAVES[0]:
                # The save is held in replication: the poll must come back without it.
                assert queue.maybe_finalize_async_calls(blocking=False) == []
                polls_in_flight += 1
                gate.set()
                continue
        queue.maybe_finalize_async_calls(blocking=False)
    queue.maybe_finalize_async_calls(blocking=True)
    queue.close()
    return finalized, polls_in_flight


def _restore_rank(ctx, impl):
    tasd_cls = _setup(impl)
    del tasd_cls
    r, w = ctx.rank, ctx.world_size
    group = dp_group(ctx, 1)
    manager = _manager(impl, ctx.store_root)
    latest = manager.find_latest()
    loaded, ckpt_id = manager.load()
    common = loaded.to_state_dict(None, algo="fully_parallel", parallelization_group=group)
    latest_again = manager.find_latest()
    loaded, _ = manager.load()
    template = megatron_like(r, w, 1, step=latest, empty=True, use_mcore=True, mixed=False)
    out = loaded.to_state_dict(template, algo="fully_parallel", parallelization_group=group)
    expected = plain_values(megatron_like(r, w, 1, step=latest, use_mcore=True, mixed=False))
    common_diff = same(
        {k: common[k] for k in ("args", "iteration")}, {k: expected[k] for k in ("args", "iteration")}
    )
    return latest, latest_again, tuple(ckpt_id), same(out, expected), sorted(common), common_diff


def _lose_node(tmp_root, node):
    shutil.rmtree(node_store_root(str(tmp_root), node))
    Path(node_store_root(str(tmp_root), node)).mkdir()


@pytest.mark.multiprocess
@pytest.mark.parametrize(
    "impl,queue_owner,persistent",
    [
        ("reference", "nvrx", False),
        ("ours", "nvrx", False),
        ("ours", "nvrx", True),
        ("ours", "mcore", False),
        ("ours", "mcore", True),
    ],
)
def test_megatron_lm_sequence_restores_bit_exact_after_node_loss(tmp_root, impl, queue_owner, persistent):
    trained = run_ranks(
        _train_rank,
        2,
        tmp_root,
        ranks_per_node=1,
        args=(impl, queue_owner, persistent),
        timeout=150,
        allow_children=True,
    )
    for finalized, polls in trained:
        assert finalized == list(SAVES), "every save finalized once, in order"
        assert polls == (1 if impl == "ours" else 0)
    _lose_node(tmp_root, 1)
    restored = run_ranks(_restore_rank, 2, tmp_root, ranks_per_node=1, args=(impl,), timeout=150)
    for rank, (latest, again, ckpt_id, diff, common_keys, common_diff) in enumerate(restored):
        assert latest == again == SAVES[-1]
        assert ckpt_id == (SAVES[-1], rank, "")
        assert diff == "", f"rank {rank}: {diff}"
        # load_args_from_checkpoint's to_state_dict(None): the common state, as Megatron-core's
        assert common_keys == ["args", "iteration", "optimizer"] and common_diff == ""


def _contract_rank(ctx):
    from resilient_ckpt import LocalCheckpointManager
    from resilient_ckpt.errors import CheckpointingException

    manager = LocalCheckpointManager(ctx.store_root)
    out = {"replicas": list(manager.placement.holders_of(ctx.rank))}
    try:
        manager.load()
    except CheckpointingException as e:
        out["load_first"] = str(e)
    tasd_cls = _setup("ours")
    state = megatron_like(ctx.rank, ctx.world_size, 1, step=5, use_mcore=True, mixed=False)
    tasd, _ = tasd_cls.from_state_dict(state, algo="fully_parallel", parallelization_group=dp_group(ctx, 1))
    assert manager.save(tasd, 5) is None
    out["latest"] = manager.find_latest()
    try:
        manager.save(tasd, 5)
    except AssertionError as e:  # the reference's exception for a non-increasing iteration
        out["again"] = type(e).__name__
    return out


@pytest.mark.multiprocess
def test_reference_contract_defaults_and_errors(tmp_root):
    """No replication by default; load() before find_latest() and a non-increasing iteration
    raise what the reference raises."""
    out = run_ranks(_contract_rank, 2, tmp_root, ranks_per_node=1, timeout=90)
    for o in out:
        assert o["replicas"] == []
        assert "find_latest" in o["load_first"]
        assert o["latest"] == 5
        assert o["again"] == "IterationOrderError"


def _one_host_rank(ctx):
    from nvidia_resiliency_ext.checkpointing.local.replication.strategies import CliqueReplicationStrategy

    from resilient_ckpt import LocalCheckpointManager

    tasd_cls = _setup("ours")
    strategy = CliqueReplicationStrategy.from_replication_params(1, 2)
    manager = LocalCheckpointManager(str(Path(ctx.tmp_root) / "host"), "job", repl_strategy=strategy)
    state = megatron_like(ctx.rank, ctx.world_size, 1, step=7, use_mcore=True, mixed=False)
    tasd, _ = tasd_cls.from_state_dict(state, algo="fully_parallel", parallelization_group=dp_group(ctx, 1))
    manager.save(tasd, 7, is_async=True).execute_sync()
    latest = manager.find_latest()
    loaded, _ = manager.load()
    template = megatron_like(ctx.rank, ctx.world_size, 1, step=7, empty=True, use_mcore=True, mixed=False)
    out = loaded.to_state_dict(template, algo="fully_parallel", parallelization_group=dp_group(ctx, 1))
    expected = plain_values(megatron_like(ctx.rank, ctx.world_size, 1, step=7, use_mcore=True, mixed=False))
    return latest, same(out, expected), list(manager.placement.holders_of(ctx.rank))


@pytest.mark.multiprocess
@pytest.mark.parametrize("local_world_size", ["2", "1"])
def test_jump_one_on_one_host_works(tmp_root, local_world_size):
    """Megatron's single-node default (jump 1): both ranks share one store; no copy goes into
    the owner's own store, whether LOCAL_WORLD_SIZE says so or the shared store reveals it."""
    out = run_ranks(_one_host_rank, 2, tmp_root, timeout=90, extra_env={"LOCAL_WORLD_SIZE": local_world_size})
    for latest, diff, holders in out:
        assert latest == 7 and diff == "" and holders == []


def test_async_request_waits_for_the_save_across_processes(tmp_path):
    """The request's worker-side function returns exactly when the signal is set, from a
    forked process (a kernel lock: no polling)."""
    import multiprocessing as mp

    from resilient_ckpt.manager.async_request import SaveDoneSignal, wait_for_save

    signal = SaveDoneSignal(tmp_path / "s.inflight")
    ctx = mp.get_context("fork")
    worker = ctx.Process(target=wait_for_save, args=(signal.path,))
    worker.start()
    worker.join(timeout=0.5)
    assert worker.is_alive(), "returned before the save finished"
    signal.set()
    worker.join(timeout=30)
    assert worker.exitcode == 0
    wait_for_save(signal.path)  # after the fact: returns at once
    assert not Path(signal.path).exists()


def test_async_request_is_converted_by_both_queues():
    """Both libraries' queues turn our six-field request into their own class (their
    persistent workers accept only that)."""
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncRequest as Mcore
    from nvidia_resiliency_ext.checkpointing.async_ckpt.core import AsyncRequest as Nvrx

    from resilient_ckpt.manager.async_request import LocalAsyncRequest

    assert len(LocalAsyncRequest._fields) not in (len(Mcore._fields), len(Nvrx._fields))
    ours = LocalAsyncRequest(print, (), [])
    for cls in (Mcore, Nvrx):
        theirs = cls(**ours._asdict())
        assert theirs.async_fn is print and theirs.call_idx == 0
