"""Automatic restore under torchrun: a worker dies with SIGKILL, torchrun restarts the group, and
the restarted workers resume from the local checkpoint bit-exactly.

The training script is written to ``tmp_path`` and launched with
``python -m torch.distributed.run --standalone --nproc-per-node=2 --max-restarts=1``. torchrun
gives both attempts the same ``TORCHELASTIC_RUN_ID``, which names the manager's store session,
and counts attempts in ``TORCHELASTIC_RESTART_COUNT``. Each worker writes what it did (attempt,
resumed step, session, losses, final parameter digest) as a JSON file.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

SCRIPT = textwrap.dedent(
    """
    import hashlib, json, os, signal, sys
    from datetime import timedelta

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from resilient_ckpt import CheckpointHook, CheckpointManager, TrainState

    store_root, out_dir = sys.argv[1], sys.argv[2]
    steps, every, kill_after = (int(v) for v in sys.argv[3:6])

    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=timedelta(seconds=30))
    rank = dist.get_rank()
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])

    torch.manual_seed(0)
    model = DDP(torch.nn.Sequential(
        torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Dropout(0.1), torch.nn.Linear(32, 1)))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=4, gamma=0.5)
    torch.manual_seed(100 + rank)  # per-rank dropout stream: part of the saved state
    state = TrainState(model, opt, sched, extra={"data_position": 0})
    # No session_id: it comes from TORCHELASTIC_RUN_ID. One node: no peer to replicate to.
    manager = CheckpointManager(store_root=store_root, replication_factor=1, timeout_s=30)
    hook = CheckpointHook(manager, every_n_steps=every, state=state)

    start = hook.restore()
    losses = {}
    for step in range(start, steps):
        g = torch.Generator().manual_seed(1000 * state.extra["data_position"] + rank)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        sched.step()
        state.extra["data_position"] += 1
        losses[step] = loss.item()
        hook.step(step)
        if attempt == 0 and rank == 1 and step == kill_after:
            # Wait for the saves already started, so the test knows which step is the newest
            # complete checkpoint; then crash without any cleanup.
            hook.finish()
            os.kill(os.getpid(), signal.SIGKILL)
    hook.close()
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    with open(os.path.join(out_dir, f"attempt{attempt}_rank{rank}.json"), "w") as f:
        json.dump({
            "attempt": attempt, "rank": rank, "start": start, "session": manager.session_id,
            "source": (hook.restored_from or {}).get("source"), "losses": losses,
            "digest": digest.hexdigest(), "data_position": state.extra["data_position"],
        }, f)
    manager.close()
    dist.destroy_process_group()
    """
)


def _torchrun(tmp_path: Path, name: str, steps: int, every: int, kill_after: int) -> dict:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    out = tmp_path / name
    out.mkdir()
    store = tmp_path / f"{name}-store"
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        GLOO_SOCKET_IFNAME="lo",
        PYTHONWARNINGS="ignore",
        # torchrun shares its rendezvous TCPStore with the workers and, since torch 2.5, no longer
        # prefixes keys per attempt: a restarted worker can read its peer's gloo address from the
        # failed attempt and die with "connectFullMesh failed ... Connection refused"
        # (pytorch/pytorch#135712). A store of the workers' own avoids it.
        TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
    )
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "--max-restarts=1",
        "--monitor-interval=0.1",
        str(script),
        str(store),
        str(out),
        str(steps),
        str(every),
        str(kill_after),
    ]
    proc = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, (
        f"torchrun failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    )
    return {p.stem: json.loads(p.read_text()) for p in out.glob("*.json")}, proc.stderr


def test_torchrun_restart_resumes_from_the_local_checkpoint_bit_exactly(tmp_path):
    steps, every, kill_after = 12, 3, 6  # saves after steps 2, 5, 8, 11; rank 1 dies after 6
    reference, _ = _torchrun(tmp_path, "reference", steps, every, kill_after=-1)
    faulty, log = _torchrun(tmp_path, "faulty", steps, every, kill_after)

    assert sorted(reference) == ["attempt0_rank0", "attempt0_rank1"]
    # Attempt 0 never finished (rank 1 killed itself, torchrun stopped rank 0); attempt 1 did.
    assert sorted(faulty) == ["attempt1_rank0", "attempt1_rank1"], log[-3000:]
    for rank in (0, 1):
        ref, run = reference[f"attempt0_rank{rank}"], faulty[f"attempt1_rank{rank}"]
        assert ref["start"] == 0
        assert run["start"] == 6, "resumed after the newest complete checkpoint (step 5)"
        assert run["source"] == "local"
        assert run["session"] == faulty["attempt1_rank0"]["session"] != "default", (
            "the store session is bound to TORCHELASTIC_RUN_ID"
        )
        assert run["data_position"] == ref["data_position"] == steps
        assert run["losses"] == {s: l for s, l in ref["losses"].items() if int(s) >= 6}
        assert run["digest"] == ref["digest"], f"rank {rank}: final parameters differ"
