"""The conformance zoo for Lightning and the Hugging Face Trainer (see tests/zoo.py).

2 simulated nodes x {1, 2} ranks, gloo DDP on CPU, ranks forked from a zygote that imported the
frameworks once. Per framework, the models users bring to it: BatchNorm with and without DDP's
buffer broadcast, gradient accumulation, SGD with Nesterov momentum and a one-cycle schedule,
tied weights, a frozen parameter, parameter groups, amsgrad, an integer buffer counted in
forward, a non-persistent buffer; for the Trainer also a GPT-2 from a config, and DDP told that
every parameter is used (``ddp_find_unused_parameters=False``: DDP then rebuilds its buckets).
Each is trained uninterrupted (the oracle), then with local checkpoints every EVERY steps until
node 1 is lost after step KILL_AFTER, then resumed; every rank's full state and every loss after
the resume must equal the oracle's bit for bit.
"""

from __future__ import annotations

import os
from typing import Any, Dict, List

import pytest

from framework_zygote import Zygote
from zoo import check_bit_exact, rank_job, run_zoo

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, EVERY, KILL_AFTER = 8, 2, 5  # global steps; saves after steps 2, 4, 6, 8; node 1 lost after 5
RESTORED = 4

LIGHTNING_ZOO = ("batchnorm", "batchnorm-no-broadcast", "tied-groups-amsgrad")
HF_ZOO = ("batchnorm", "gpt2")


@pytest.fixture(scope="module")
def zygote():
    return Zygote.shared()


def _stop_at(phase: str) -> int:
    return KILL_AFTER if phase == "faulty" else STEPS


# ---- Lightning ------------------------------------------------------------------------------------


def _lightning_model(ctx, name: str, phase: str) -> Dict[str, Any]:
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.strategies import DDPStrategy

    import zoo
    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.lightning import HierarchicalCheckpointIO, LocalCheckpointCallback

    accumulate = 2 if name == "batchnorm" else 1

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            torch.manual_seed(0)
            self.net = zoo.TiedLM() if name == "tied-groups-amsgrad" else zoo.ConvBN()
            self.losses: Dict[Any, float] = {}

        def training_step(self, batch, batch_idx):
            step = self.global_step
            micro = sum(1 for s, _ in self.losses if s == step)  # this step's micro-batches so far
            loss = zoo.loss_of(self.net(zoo.data(step, self.global_rank, micro)))
            self.losses[(step, micro)] = loss.item()
            return loss

        def configure_optimizers(self):
            if name == "batchnorm":
                opt = torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9, nesterov=True)
                sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
            elif name == "tied-groups-amsgrad":
                named = list(self.net.named_parameters())
                opt = torch.optim.AdamW(
                    [
                        {"params": [p for n, p in named if n.startswith("mix")], "weight_decay": 0.1},
                        {
                            "params": [p for n, p in named if not n.startswith("mix") and p.requires_grad],
                            "lr": 3e-3,
                        },
                    ],
                    lr=1e-2,
                    amsgrad=True,
                )
                sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS)
            else:
                opt = torch.optim.Adam(self.parameters(), lr=1e-2)
                sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
            return [opt], [{"scheduler": sched, "interval": "step"}]

        def train_dataloader(self):  # the batches are zoo.data(step, rank, micro)
            return torch.utils.data.DataLoader(torch.arange(4 * STEPS * accumulate), batch_size=1)

    class Stop(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step >= _stop_at(phase):
                trainer.should_stop = True

    callbacks: List[Any] = [Stop()]
    plugins: List[Any] = []
    local = io = None
    if phase != "reference":
        local = LocalCheckpointCallback(every_n_train_steps=EVERY)
        io = HierarchicalCheckpointIO(
            None,
            lambda: CheckpointManager(session_id=f"zoo-pl-{name}", store_root=ctx.store_root, timeout_s=30),
            lambda path: -1,
            async_save=True,
        )
        callbacks.append(local)
        plugins.append(io)
    model = Module()
    zoo.seed_everything(1000 + ctx.rank)
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=ctx.ranks_per_node,
        num_nodes=2,
        strategy=DDPStrategy(
            process_group_backend="gloo", broadcast_buffers=name != "batchnorm-no-broadcast"
        ),
        max_steps=STEPS,
        accumulate_grad_batches=accumulate,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        default_root_dir=os.path.join(ctx.tmp_root, f"pl-{name}"),
        callbacks=callbacks,
        plugins=plugins,
    )
    trainer.fit(model, ckpt_path="last" if phase == "resumed" else None)
    out: Dict[str, Any] = {"losses": model.losses, "restored_from": None, "failed": 0, "buckets": None}
    if io is not None:
        io.finish()
        out.update(restored_from=local.restored_from, failed=io.failed_saves)
        io.local_ckpt_manager.close()
    opt = trainer.optimizers[0]
    out["state"] = zoo.full_state(model, opt, trainer.lr_scheduler_configs[0].scheduler)
    return out


def _lightning_job(ctx, phase: str, names: List[str]) -> Dict[str, Any]:
    os.environ["GROUP_RANK"] = str(ctx.node)  # with RANK/LOCAL_RANK/LOCAL_WORLD_SIZE: torchelastic's
    return rank_job(ctx, phase, names, _lightning_model)


@pytest.mark.parametrize("rpn", [1, 2], ids=["2-ranks", "4-ranks"])
def test_lightning_resumes_every_zoo_model_bit_exactly_after_a_node_loss(zygote, tmp_path, rpn):
    results = run_zoo(zygote.run_ranks, tmp_path, rpn, _lightning_job, list(LIGHTNING_ZOO))
    check_bit_exact(results, rpn, RESTORED)


# ---- Hugging Face Trainer ---------------------------------------------------------------------------


def _hf_model(ctx, name: str, phase: str) -> Dict[str, Any]:
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import zoo
    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.huggingface import LocalCheckpointCallback

    class Images(torch.utils.data.Dataset):
        def __len__(self):
            return 256

        def __getitem__(self, i):
            return {"x": zoo.data(i, 0, shape=(3, 6, 6))}

    class WithLoss(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = zoo.ConvBN()

        def forward(self, x):
            return {"loss": zoo.loss_of(self.net(x))}

    class Recording(Trainer):
        losses: Dict[Any, float] = {}

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            value = loss[0] if isinstance(loss, tuple) else loss
            step = self.state.global_step
            self.losses[(step, sum(1 for s, _ in self.losses if s == step))] = value.item()
            return loss

    class Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= _stop_at(phase):
                control.should_training_stop = True

    torch.manual_seed(0)
    if name == "gpt2":  # tied embedding/head, dropout; the Trainer's DDP finds unused parameters
        model, data, extra = (
            GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2)),
            zoo.Tokens(),
            {},
        )
    else:  # DDP rebuilds its buckets
        model, data, extra = (
            WithLoss(),
            Images(),
            {"ddp_find_unused_parameters": False, "gradient_accumulation_steps": 2},
        )
    args = TrainingArguments(
        output_dir=os.path.join(ctx.tmp_root, f"hf-{name}-{phase}"),
        per_device_train_batch_size=4,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        disable_tqdm=True,
        **extra,
    )
    local = None
    callbacks: List[Any] = [Stop()]
    if phase != "reference":
        local = LocalCheckpointCallback(
            lambda: CheckpointManager(session_id=f"zoo-hf-{name}", store_root=ctx.store_root, timeout_s=30),
            every_n_steps=EVERY,
        )
        callbacks.insert(0, local)
    trainer = Recording(model=model, args=args, train_dataset=data, callbacks=callbacks)
    Recording.losses = {}
    resume = local.resume_checkpoint(trainer) if local is not None else None
    trainer.train(resume_from_checkpoint=resume)
    out: Dict[str, Any] = {
        "losses": dict(Recording.losses),
        "restored_from": None,
        "failed": 0,
        "buckets": None,
    }
    if local is not None:
        local.finish()
        out.update(restored_from=local.restored_from, failed=local.failed_saves)
        local.manager.close()
    opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
    out["state"] = zoo.full_state(model, opt, trainer.lr_scheduler)
    return out


def _hf_job(ctx, phase: str, names: List[str]) -> Dict[str, Any]:
    return rank_job(ctx, phase, names, _hf_model)


@pytest.mark.parametrize("rpn", [1, 2], ids=["2-ranks", "4-ranks"])
def test_hf_trainer_resumes_every_zoo_model_bit_exactly_after_a_node_loss(zygote, tmp_path, rpn):
    results = run_zoo(zygote.run_ranks, tmp_path, rpn, _hf_job, list(HF_ZOO))
    check_bit_exact(results, rpn, RESTORED)
