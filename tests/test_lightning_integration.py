"""Lightning DDP with local checkpoints (resilient_ckpt.integrations.lightning): a node is lost
mid-training, the job restarts with ``trainer.fit(ckpt_path="last")`` and resumes from the
neighbours' memory, bit-exactly.

2 simulated nodes x 2 ranks (own store root per node), gloo, Lightning's DDPStrategy on CPU with
torchelastic's environment variables (the ranks are started by the harness, as torchrun would).
A global ``ModelCheckpoint`` writes every 5 steps (rank 0, shared directory), the local callback
saves every 3 steps with ``async_save=True``. Data is a function of (global step, rank), dropout
draws from the per-rank RNG: losses and parameters repeat only if model, optimizer, scheduler,
loop state and RNG all come back exactly.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import signal
import warnings

import pytest

from framework_zygote import Zygote
from harness import KILLED, hold_copies_until_fenced, node_store_root
from test_daemon import ProcessCluster

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, EVERY, GLOBAL_EVERY, KILL_AT = 12, 3, 5, 7  # local saves at 3, 6, 9, 12; global at 5, 10
SESSION = "lightning-ddp"


@pytest.fixture(scope="module")
def zygote():
    return Zygote.shared()


def _train(ctx, global_dir: str, kill_at: int, endpoints=None):
    """One rank of the job: fit to STEPS with ckpt_path="last"; node 1 dies after ``kill_at``."""
    warnings.filterwarnings("ignore")
    os.environ["GROUP_RANK"] = str(ctx.node)  # with RANK/LOCAL_RANK/LOCAL_WORLD_SIZE: torchelastic's
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.lightning import HierarchicalCheckpointIO, LocalCheckpointCallback

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("resilient_ckpt.integrations.lightning").addHandler(handler)
    logging.getLogger("resilient_ckpt.integrations.lightning").setLevel(logging.INFO)

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(32, 1)
            )
            self.losses = {}

        def training_step(self, batch, batch_idx):
            g = torch.Generator().manual_seed(1000 * self.global_step + self.global_rank)
            x = torch.randn(16, 8, generator=g)
            loss = torch.nn.functional.mse_loss(self.net(x), x.sum(dim=1, keepdim=True).sin())
            self.losses[self.global_step] = loss.item()
            return loss

        def configure_optimizers(self):
            opt = torch.optim.Adam(self.parameters(), lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
            return [opt], [{"scheduler": sched, "interval": "step"}]

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(4 * STEPS), batch_size=1)

    class KillNode(pl.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if ctx.node == 1 and trainer.global_step == kill_at:
                trainer.strategy.checkpoint_io.finish()  # the newest complete save is known: step 6
                os.kill(os.getpid(), signal.SIGKILL)

    made = []

    def make_manager():  # called by the IO on first use (Lightning initializes torch.distributed in fit)
        if endpoints is None:
            m = CheckpointManager(session_id=SESSION, store_root=ctx.store_root, timeout_s=20)
        else:  # service mode: this node's daemon owns the store and replicates
            m = CheckpointManager(
                session_id=SESSION,
                store_root=ctx.store_root,
                mode="service",
                endpoint=endpoints[ctx.node],
                timeout_s=20,
            )
        made.append(m)
        return m

    io = HierarchicalCheckpointIO(
        None,
        make_manager,
        lambda path: torch.load(path, map_location="cpu", weights_only=False)["global_step"],
        async_save=True,
    )
    local = LocalCheckpointCallback(every_n_train_steps=EVERY)
    torch.manual_seed(0)
    model = Net()
    torch.manual_seed(100 + ctx.rank)  # per-rank dropout stream
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        num_nodes=2,
        strategy=DDPStrategy(process_group_backend="gloo"),
        max_steps=STEPS,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=os.path.join(ctx.tmp_root, "root"),
        callbacks=[
            pl.callbacks.ModelCheckpoint(
                dirpath=global_dir, every_n_train_steps=GLOBAL_EVERY, save_last=True
            ),
            local,
            KillNode(),
        ],
        plugins=[io],
    )
    try:
        trainer.fit(model, ckpt_path="last")
    except Exception as e:  # node 0 after node 1 vanished: DDP's all-reduce fails
        return {"failed": f"{type(e).__name__}: {e}"[:300], "losses": model.losses}
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    out = {
        "losses": model.losses,
        "digest": digest.hexdigest(),
        "global_step": trainer.global_step,
        "restored_from": local.restored_from,
        "failed_saves": io.failed_saves,
        "messages": messages,
        "complete": io.local_ckpt_manager.find_latest(),
        "managers_made": len(made),
    }
    io.local_ckpt_manager.close()
    return out


@pytest.fixture(scope="module")
def reference(zygote, tmp_path_factory):
    """The uninterrupted job (embedded mode; the numbers do not depend on the mode)."""
    root = tmp_path_factory.mktemp("lightning-reference")
    runs = zygote.run_ranks(
        _train, 4, root, ranks_per_node=2, args=(str(root / "global"), -1), timeout=90, collective_timeout=20
    )
    assert [r["global_step"] for r in runs] == [STEPS] * 4
    assert all(r["failed_saves"] == 0 and r["complete"] == STEPS and r["managers_made"] == 1 for r in runs)
    assert all(r["restored_from"] is None for r in runs), "a fresh store: nothing to resume"
    return runs


@pytest.mark.parametrize("mode", ["embedded", "service"])
def test_lightning_ddp_resumes_from_the_neighbours_memory_bit_exactly_after_a_node_loss(
    zygote, reference, tmp_path, mode
):
    """Embedded: node 1's trainers die and its store is wiped; its ranks restore from the replicas
    node 0's trainers hold. Service: node 1's trainers and daemon die, its store is wiped and a
    fresh daemon replaces it; node 1's ranks ask it, and it pulls their data from node 0's daemon."""
    run_root = tmp_path / "run"
    run_root.mkdir()
    cluster = ProcessCluster(run_root, 2).start() if mode == "service" else None
    endpoints = cluster.eps if cluster else None
    kw = dict(
        ranks_per_node=2,
        timeout=90,
        collective_timeout=20,
        extra_env=cluster.trainer_env if cluster else None,
    )
    try:
        faulty = zygote.run_ranks(
            _train,
            4,
            run_root,
            args=(str(run_root / "global"), KILL_AT, endpoints),
            expect_killed=[2, 3],
            **kw,
        )
        assert [repr(r) for r in faulty[2:]] == [repr(KILLED)] * 2  # (the sentinel crossed a process)
        assert all("failed" in r for r in faulty[:2]), faulty[:2]
        if cluster:
            cluster.nodes[1].kill()
        shutil.rmtree(node_store_root(str(run_root), 1))  # node 1's memory is gone with it
        if cluster:  # the replacement node's daemon
            cluster.nodes[1].start()
            cluster.nodes[1].wait_ready()

        resumed = zygote.run_ranks(_train, 4, run_root, args=(str(run_root / "global"), -1, endpoints), **kw)
    finally:
        if cluster:
            cluster.stop()
    # embedded: node 1's ranks read node 0's replicas; service: node 1's daemon pulled them first
    node1_source = "peer" if mode == "embedded" else "local"
    for rank, (ref, run) in enumerate(zip(reference, resumed)):
        # global checkpoint at step 5, local at 6: the local one is newer and is restored
        assert run["restored_from"] == {"iteration": 6, "source": "local" if rank < 2 else node1_source}, rank
        assert any("Resuming from a local checkpoint" in m for m in run["messages"]), run["messages"]
        assert run["global_step"] == STEPS
        assert sorted(run["losses"]) == list(range(6, STEPS))
        assert run["losses"] == {s: v for s, v in ref["losses"].items() if s >= 6}, (
            f"rank {rank}: losses differ"
        )
        assert run["digest"] == ref["digest"], f"rank {rank}: final parameters differ"
        assert run["failed_saves"] == 0


def _ordering(tmp: str):
    """In one process: the local save's copies are held back until the training thread fences;
    the module's on_before_optimizer_step (after the callbacks', right before the update) records
    whether they had finished. Without the callback's fence the probe would release them itself,
    after which the copies would race the update."""
    warnings.filterwarnings("ignore")
    import lightning.pytorch as pl
    import torch

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.lightning import HierarchicalCheckpointIO, LocalCheckpointCallback

    held = hold_copies_until_fenced()  # this rank process ends with the test
    release, copies_done = held.release, held.done

    seen, saved_weights = [], {}

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(4, 1)

        def training_step(self, batch, batch_idx):
            return self.lin(torch.ones(2, 4)).pow(2).mean()

        def on_before_optimizer_step(self, optimizer):
            seen.append((self.global_step, copies_done.is_set()))
            release.set()

        def on_train_batch_end(self, outputs, batch, batch_idx):  # after the callbacks' (the save)
            saved_weights[self.global_step] = {k: v.clone() for k, v in self.state_dict().items()}

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.5)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.arange(8), batch_size=1)

    class HoldCopies(pl.Callback):  # listed before the local callback: runs before its save
        def on_train_batch_end(self, *args):
            release.clear()  # the save's copies wait until someone releases them

    manager = CheckpointManager(
        session_id="ordering", store_root=os.path.join(tmp, "store"), replication_factor=1
    )
    io = HierarchicalCheckpointIO(None, manager, lambda p: -1, async_save=True)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=True,
        default_root_dir=tmp,
        callbacks=[HoldCopies(), LocalCheckpointCallback(every_n_train_steps=2)],
        plugins=[io],
    )
    trainer.fit(Net())
    state, iteration = manager.load_local()
    same = all(torch.equal(state["state_dict"][k], v) for k, v in saved_weights[2].items())
    changed = any(not torch.equal(saved_weights[2][k], v) for k, v in saved_weights[3].items())
    manager.close()
    return {"seen": seen, "iteration": iteration, "saved_step_2": same, "step_3_changed_them": changed}


def test_lightning_optimizer_update_waits_for_the_local_saves_copies(zygote, tmp_path):
    r = zygote.call_forked(_ordering, str(tmp_path))
    # a save after global step 2 only; before the next update its copies had all been read
    assert r["seen"] == [(0, False), (1, False), (2, True)]
    assert r["iteration"] == 2
    assert r["saved_step_2"], "the checkpoint holds the weights of step 2"
    assert r["step_3_changed_them"], "which the next update changed (after the copies)"
