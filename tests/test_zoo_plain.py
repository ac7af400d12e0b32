"""The conformance zoo for the README's plain loop (``TrainState`` + ``CheckpointHook``).

2 simulated nodes x {1, 2} ranks (2 and 4 data-parallel ranks), gloo. Each model of the zoo is
trained uninterrupted without checkpoints (the oracle); then with a local checkpoint every
EVERY steps until node 1's ranks are SIGKILLed after step KILL_AFTER and its store is wiped;
then the job restarts and resumes from the newest complete checkpoint (node 1's ranks from the
replicas on node 0). Every rank's full state at the end and every loss after the resume must
equal the oracle's bit for bit (see tests/zoo.py). The save's copies are held until the
training thread fences them (as a slow copy would be): the next forward then always runs
while they are pending, as it may in any real run.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import pytest

from harness import run_ranks
from zoo import check_bit_exact, rank_job, run_zoo

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, EVERY, KILL_AFTER = 8, 2, 4  # saves after steps 1, 3, 5, 7; node 1 lost after step 4
RESTORED = 3  # the newest complete save before the loss (the resume repeats step 4)

ZOO = ("batchnorm", "batchnorm-no-broadcast", "tied-groups-amsgrad", "compiled", "amp-scaler", "fsdp2")


@dataclass
class Setup:
    model: Any
    optimizer: Any
    scheduler: Any
    accumulate: int = 1
    scaler: Any = None
    extra: Dict[str, Any] = field(default_factory=dict)

    def stateful(self) -> Dict[str, Any]:
        return {"scaler": self.scaler} if self.scaler is not None else {}


def _build(name: str, device: str = "cpu") -> Setup:
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    import zoo

    torch.manual_seed(0)
    if name in ("batchnorm", "batchnorm-no-broadcast", "compiled", "syncbatchnorm"):
        net = zoo.ConvBN().to(device)
        if name == "syncbatchnorm":  # CUDA only (tests/test_cuda.py)
            net = torch.nn.SyncBatchNorm.convert_sync_batchnorm(net)
        model = DDP(net, broadcast_buffers=name != "batchnorm-no-broadcast")
        if name == "compiled":
            model = zoo.compile_eager(model)
        if name == "batchnorm":
            opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, nesterov=True)
            sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.1, total_steps=STEPS)
            return Setup(model, opt, sched, accumulate=2)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return Setup(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5))
    if name == "tied-groups-amsgrad":
        net = zoo.TiedLM().to(device)
        model = DDP(net)
        decay = [p for n, p in net.named_parameters() if n.startswith("mix")]
        rest = [p for n, p in net.named_parameters() if not n.startswith("mix") and p.requires_grad]
        opt = torch.optim.AdamW(
            [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": 3e-3}],
            lr=1e-2,
            amsgrad=True,
        )
        return Setup(
            model, opt, torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS), extra={"seen": 0}
        )
    if name == "amp-scaler":
        model = DDP(zoo.Plain())
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)
        return Setup(model, opt, torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.2, STEPS), scaler=scaler)
    if name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        model = zoo.Plain()
        for layer in (model.a, model.b):
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        return Setup(model, opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.7))
    raise AssertionError(name)


def _step(s: Setup, step: int, rank: int, device: str = "cpu") -> float:
    import torch

    import zoo

    total = 0.0
    for micro in range(s.accumulate):
        last = micro == s.accumulate - 1
        sync = contextlib.nullcontext() if last else s.model.no_sync()
        amp = (
            torch.autocast("cpu", dtype=torch.bfloat16) if s.scaler is not None else contextlib.nullcontext()
        )
        with sync, amp:
            loss = zoo.loss_of(s.model(zoo.data(step, rank, micro).to(device))) / s.accumulate
        (s.scaler.scale(loss) if s.scaler is not None else loss).backward()
        total += loss.item()
    if s.scaler is not None:
        s.scaler.step(s.optimizer)
        s.scaler.update()
    else:
        s.optimizer.step()
    s.scheduler.step()
    s.optimizer.zero_grad(set_to_none=True)
    if "seen" in s.extra:
        s.extra["seen"] += 1
    return total


def _train_model(ctx, name: str, phase: str, device: str = "cpu") -> Dict[str, Any]:

    import zoo
    from resilient_ckpt import CheckpointHook, CheckpointManager, TrainState

    s = _build(name, device)
    zoo.seed_everything(1000 + ctx.rank)  # per-rank dropout streams (the user's script's seeding)
    losses: Dict[int, float] = {}
    hook: Optional[CheckpointHook] = None
    out: Dict[str, Any] = {}
    if phase != "reference":
        manager = CheckpointManager(session_id=f"zoo-{name}", store_root=ctx.store_root, timeout_s=30)
        state = TrainState(s.model, s.optimizer, s.scheduler, extra=s.extra, stateful=s.stateful())
        hook = CheckpointHook(manager, every_n_steps=EVERY, state=state)
    start = hook.restore() if phase == "resumed" else 0
    last = KILL_AFTER if phase == "faulty" else STEPS - 1
    for step in range(start, last + 1):
        losses[step] = _step(s, step, ctx.rank, device)
        if hook is not None:
            hook.step(step)
    if hook is not None:
        hook.fence()  # releases held copies (see hold_copies_until_fenced)
        hook.finish()
        out["restored_from"] = hook.restored_from and {
            k: hook.restored_from[k] for k in ("iteration", "source")
        }
        out["buckets"] = str(state.ddp_buckets) if state.ddp_buckets is not None else None
        out["failed"] = hook.failed_saves
        hook.close()
        manager.close()
    out["losses"] = losses
    stateful = {k: v.state_dict() for k, v in s.stateful().items()}
    out["state"] = zoo.full_state(s.model, s.optimizer, s.scheduler, s.extra, stateful=stateful)
    return out


def _job(ctx, phase: str, names: List[str], device: str = "cpu") -> Dict[str, Any]:
    return rank_job(ctx, phase, names, functools.partial(_train_model, device=device))


@pytest.mark.parametrize("rpn", [1, 2], ids=["2-ranks", "4-ranks"])
def test_the_readme_loop_resumes_every_zoo_model_bit_exactly_after_a_node_loss(tmp_path, rpn):
    results = run_zoo(run_ranks, tmp_path, rpn, _job, list(ZOO))
    check_bit_exact(results, rpn, RESTORED)
