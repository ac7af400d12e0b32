"""Hugging Face ``Trainer`` with local checkpoints (resilient_ckpt.integrations.huggingface): a
node is lost mid-training, the job restarts, ``resume_checkpoint(trainer)`` picks the local
checkpoint (newer than the Trainer's own) and the run resumes from the neighbours' memory,
bit-exactly.

2 simulated nodes x 2 ranks (own store root per node), gloo DDP through Accelerate on CPU, a
1-layer GPT-2 built from a config (dropout on), a shuffled map-style dataset. The Trainer writes
its own checkpoint every 5 steps (shared output_dir), the callback saves locally every 3: at the
loss (after step 7) the local step 6 is newer than the Trainer's step 5. The Trainer skips the
batches already trained from the restored TrainerState, as for its own checkpoints.
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
from harness import KILLED, node_store_root

pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]

STEPS, EVERY, GLOBAL_EVERY, KILL_AT = 12, 3, 5, 7
SESSION = "hf-ddp"


@pytest.fixture(scope="module")
def zygote():
    return Zygote.shared()


def _train(ctx, out_dir: str, kill_at: int):
    """One rank: train to STEPS, resuming from what resume_checkpoint picks; node 1 dies after
    ``kill_at``."""
    warnings.filterwarnings("ignore")
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    import zoo
    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.huggingface import LocalCheckpointCallback

    messages = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("resilient_ckpt.integrations.huggingface").addHandler(handler)
    logging.getLogger("resilient_ckpt.integrations.huggingface").setLevel(logging.INFO)

    class RecordingTrainer(Trainer):
        losses = {}

        def compute_loss(self, *args, **kwargs):
            loss = super().compute_loss(*args, **kwargs)
            self.losses[self.state.global_step] = (loss[0] if isinstance(loss, tuple) else loss).item()
            return loss

    class KillNode(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if ctx.node == 1 and state.global_step == kill_at:
                local.finish()  # the newest complete local save is known: step 6
                os.kill(os.getpid(), signal.SIGKILL)

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(
        output_dir=out_dir,
        per_device_train_batch_size=2,
        max_steps=STEPS,
        learning_rate=1e-2,
        lr_scheduler_type="linear",
        warmup_steps=2,
        save_strategy="steps",
        save_steps=GLOBAL_EVERY,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        ddp_backend="gloo",
        seed=0,
        disable_tqdm=True,
    )
    # made on first use (resume_checkpoint), after TrainingArguments initialized torch.distributed
    local = LocalCheckpointCallback(
        lambda: CheckpointManager(session_id=SESSION, store_root=ctx.store_root, timeout_s=20),
        every_n_steps=EVERY,
    )
    trainer = RecordingTrainer(
        model=model, args=args, train_dataset=zoo.Tokens(), callbacks=[local, KillNode()]
    )
    try:
        trainer.train(resume_from_checkpoint=local.resume_checkpoint(trainer))
    except Exception as e:  # node 0 after node 1 vanished: DDP's all-reduce fails
        return {"failed": f"{type(e).__name__}: {e}"[:300]}
    digest = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        digest.update(name.encode() + t.detach().contiguous().view(torch.uint8).numpy().tobytes())
    out = {
        "losses": dict(trainer.losses),
        "digest": digest.hexdigest(),
        "global_step": trainer.state.global_step,
        "restored_from": local.restored_from,
        "saved_steps": local.saved_steps,
        "failed_saves": local.failed_saves,
        "messages": messages,
    }
    local.manager.close()
    return out


def test_hf_trainer_resumes_from_the_neighbours_memory_bit_exactly_after_a_node_loss(zygote, tmp_path):
    ref_root, run_root = tmp_path / "reference", tmp_path / "run"
    kw = dict(ranks_per_node=2, timeout=120, collective_timeout=20)
    reference = zygote.run_ranks(_train, 4, ref_root, args=(str(ref_root / "out"), -1), **kw)
    assert [r["global_step"] for r in reference] == [STEPS] * 4
    assert all(r["saved_steps"] == [3, 6, 9, 12] and r["failed_saves"] == 0 for r in reference)
    assert all(r["restored_from"] is None for r in reference)
    assert all(any("starting from step 0" in m for m in r["messages"]) for r in reference)

    faulty = zygote.run_ranks(
        _train, 4, run_root, args=(str(run_root / "out"), KILL_AT), expect_killed=[2, 3], **kw
    )
    assert [repr(r) for r in faulty[2:]] == [repr(KILLED)] * 2  # (the sentinel crossed a process)
    assert all("failed" in r for r in faulty[:2]), faulty[:2]
    assert sorted(os.listdir(run_root / "out")) == ["checkpoint-5"], "the Trainer's own checkpoint: step 5"
    shutil.rmtree(node_store_root(str(run_root), 1))  # node 1's memory is gone with it

    resumed = zygote.run_ranks(_train, 4, run_root, args=(str(run_root / "out"), -1), **kw)
    for rank, (ref, run) in enumerate(zip(reference, resumed)):
        assert run["restored_from"] == {"iteration": 6, "source": "local" if rank < 2 else "peer"}, rank
        assert any("Resuming from a local checkpoint" in m for m in run["messages"]), run["messages"]
        assert run["global_step"] == STEPS
        assert sorted(run["losses"]) == list(range(6, STEPS))
        assert run["losses"] == {s: v for s, v in ref["losses"].items() if s >= 6}, (
            f"rank {rank}: losses differ"
        )
        assert run["digest"] == ref["digest"], f"rank {rank}: final parameters differ"
        assert run["saved_steps"] == [9, 12] and run["failed_saves"] == 0
