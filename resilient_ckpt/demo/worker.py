"""One rank of the demo training job (also runnable under torchrun).

A small transformer with dropout, trained with DDP (gloo) and Adam + a step LR schedule on
deterministic synthetic data, saving a local checkpoint every N steps through
``CheckpointHook``. Progress is printed as JSON lines (one event per line) for the
orchestrator. With ``--pause-at S`` the rank stops after step S and waits for its stdin to
close or to be killed — the orchestrator's deterministic failure point.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, List, Optional


def emit(**event) -> None:
    event.setdefault("t", time.time())
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


def build_model(seed: int):
    import torch

    torch.manual_seed(seed)
    layer = torch.nn.TransformerEncoderLayer(
        d_model=64, nhead=4, dim_feedforward=128, dropout=0.1, batch_first=True
    )
    return torch.nn.Sequential(
        torch.nn.Linear(16, 64), torch.nn.TransformerEncoder(layer, num_layers=2), torch.nn.Linear(64, 1)
    )


def batch(seed: int, step: int, rank: int):
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step * 1009 + rank)
    x = torch.randn(8, 12, 16, generator=g)
    y = x.sum(dim=-1, keepdim=True).tanh()
    return x, y


def params_digest(model) -> str:
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().contiguous().view(-1).view(__import__("torch").uint8).numpy().tobytes())
    return h.hexdigest()


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--interval", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--session", default=os.environ.get("TORCHELASTIC_RUN_ID", "demo"))
    p.add_argument(
        "--store-root", default=os.environ.get("RESILIENT_CKPT_STORE_ROOT", "/dev/shm/resilient_ckpt")
    )
    p.add_argument("--replication-factor", type=int, default=2)
    p.add_argument("--mode", choices=["embedded", "service"], default="embedded")
    p.add_argument("--endpoint", default=os.environ.get("RESILIENT_CKPT_ENDPOINT"))
    p.add_argument("--pause-at", type=int, default=-1)
    p.add_argument("--timeout", type=float, default=30.0)
    return p.parse_args(argv)


def service_mode_missing(demo: bool = False) -> Optional[str]:
    """Why ``--mode service`` cannot run in this build (None when it can)."""
    import importlib.util
    import inspect

    from resilient_ckpt.manager.checkpoint_manager import CheckpointManager

    if "endpoint" not in inspect.signature(CheckpointManager).parameters:
        return "this build's CheckpointManager has no service client (no endpoint= argument)"
    if demo and importlib.util.find_spec("resilient_ckpt.demo.services") is None:
        return "this build has no demo daemons (resilient_ckpt.demo.services)"
    return None


def main(argv=None) -> int:
    """Entry point under torchrun / plain env:// launches: events go to stdout."""

    def pause() -> None:
        sys.stdin.read()

    args = parse_args(argv)
    if args.mode == "service" and service_mode_missing():
        raise SystemExit(f"--mode service is not available: {service_mode_missing()}; use --mode embedded")
    return run(args, emit, pause)


@dataclass
class _Job:
    """A rank's training objects; ``params`` in the order their gradients are reduced."""

    model: Any
    params: List[Any]
    opt: Any
    sched: Any
    state: Any  # TrainState
    manager: Any  # CheckpointManager
    hook: Any  # CheckpointHook


def _build_job(args: argparse.Namespace, rank: int) -> _Job:
    import torch
    import torch.distributed as dist

    from resilient_ckpt import CheckpointHook, CheckpointManager, TrainState

    model = build_model(args.seed)
    # Replicas are kept identical by one all-reduce of all gradients in parameter order.
    # (DDP would do the same, but it re-buckets gradients after its first iteration, so a
    # restarted job reduces in a different order for one step and drifts by an ulp — a
    # property of DDP, not of the checkpoint; see docs/architecture.md.)
    params = [p for p in model.parameters()]
    for p in params:  # identical start on every rank, as DDP's constructor broadcast would do
        dist.broadcast(p.data, 0)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=20, gamma=0.5)
    torch.manual_seed(args.seed + 1000 + rank)  # per-rank dropout stream, part of the saved state
    state = TrainState(model, opt, sched, extra={"samples_seen": 0})
    manager_kwargs = dict(
        session_id=args.session,
        store_root=args.store_root,
        replication_factor=args.replication_factor,
        timeout_s=args.timeout,
    )
    if args.mode == "service":
        manager_kwargs["endpoint"] = args.endpoint
    manager = CheckpointManager(**manager_kwargs)
    hook = CheckpointHook(manager, every_n_steps=args.interval, state=state)
    return _Job(model, params, opt, sched, state, manager, hook)


def _restore(job: _Job, rank: int, emit) -> int:
    """Restore the newest checkpoint, if any; returns the step to train from."""
    import torch.distributed as dist

    # Restore is timed from the moment every rank is up (process start-up is reported apart
    # by the orchestrator); the first collective would otherwise absorb the slowest start.
    dist.barrier()
    emit(event="ready", rank=rank)
    t0 = time.time()
    start = job.hook.restore()
    if job.hook.restored_from:
        emit(
            event="restored",
            rank=rank,
            step=start,
            seconds=time.time() - t0,
            **{
                k: v
                for k, v in job.hook.restored_from.items()
                if k in ("source", "source_rank", "iteration", "total_s")
            },
        )
    else:
        emit(event="fresh_start", rank=rank, seconds=time.time() - t0)
    return start


def _average_gradients(params: List[Any], world: int) -> None:
    import torch
    import torch.distributed as dist

    flat = torch.cat([p.grad.reshape(-1) for p in params])
    dist.all_reduce(flat)
    flat /= world
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def _train_step(job: _Job, args: argparse.Namespace, step: int, rank: int, world: int) -> float:
    """One optimizer step; returns the loss averaged over ranks."""
    import torch
    import torch.distributed as dist

    x, y = batch(args.seed, step, rank)
    job.model.train()
    job.opt.zero_grad(set_to_none=True)
    loss = torch.nn.functional.mse_loss(job.model(x), y)
    loss.backward()
    _average_gradients(job.params, world)
    job.opt.step()
    job.sched.step()
    job.state.extra["samples_seen"] += x.shape[0]
    mean = loss.detach().clone()
    dist.all_reduce(mean)
    mean /= world
    return float(mean)


def _checkpoint(job: _Job, step: int, rank: int, pending: list, emit) -> None:
    """Save every N steps (through the hook); report the saves that became durable."""
    handle = job.hook.step(step)
    if handle is not None:
        emit(event="save", rank=rank, step=step, stall=handle.metrics.stall_s)
        pending.append(handle)
    for h in [h for h in pending if h.done()]:
        pending.remove(h)
        if h.exception() is None:
            emit(event="durable", rank=rank, step=h.iteration, seconds=h.metrics.durable_s)


def run(args: argparse.Namespace, emit, pause) -> int:
    """Train; ``emit(**event)`` reports progress, ``pause()`` blocks at the failure point."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    rank, world = dist.get_rank(), dist.get_world_size()
    job = _build_job(args, rank)
    start = _restore(job, rank, emit)
    pending: list = []
    for step in range(start, args.steps):
        loss = _train_step(job, args, step, rank, world)
        emit(event="step", rank=rank, step=step, loss=loss)
        _checkpoint(job, step, rank, pending, emit)
        if step == args.pause_at:
            # Deterministic failure point: wait here until the orchestrator kills this process.
            emit(event="paused", rank=rank, step=step)
            pause()
            return 3
    job.hook.finish()
    emit(
        event="done",
        rank=rank,
        digest=params_digest(job.model),
        failed_saves=job.hook.failed_saves,
        save_metrics=job.manager.last_save_metrics.as_dict() if job.manager.last_save_metrics else None,
    )
    job.hook.close()
    job.manager.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
