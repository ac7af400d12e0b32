"""Hugging Face ``Trainer``: local checkpoints every N steps, resumed automatically.

::

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.huggingface import LocalCheckpointCallback

    manager = CheckpointManager(session_id="run7")             # embedded, or mode="service"
    local = LocalCheckpointCallback(manager, every_n_steps=50)
    trainer = Trainer(model=model, args=args, train_dataset=ds, callbacks=[local])
    trainer.train(resume_from_checkpoint=local.resume_checkpoint(trainer))

``resume_checkpoint(trainer)`` (collective: every rank calls it) compares the newest complete
local checkpoint with the ``Trainer``'s own newest (``checkpoint-N`` under ``output_dir``, or the
path given) and returns what ``train(resume_from_checkpoint=...)`` should take, logging which:

- the Trainer's own checkpoint (or None for a fresh start) when it is newer;
- otherwise a small directory holding only ``trainer_state.json`` (the saved ``TrainerState``:
  HF computes the epoch and the batches to skip from it, as for its own checkpoints), and the
  trainer's loaders of model, optimizer/scheduler, gradient scaler and RNG states take the
  restored local checkpoint from memory when asked for that directory. Each piece is applied
  where HF applies its own: the model before ``accelerator.prepare``, optimizer and scheduler
  once created, the RNG states after the data skip.

Saving: every ``every_n_steps`` optimizer steps (``on_step_end``, iteration =
``state.global_step``) through ``CheckpointHook`` over a ``TrainState`` of the trainer's model,
optimizer and scheduler: parameters and optimizer tensors as data-parallel replicas (saved once
across the job), buffers as each rank's own (copied when the save starts: the next forward
writes them), scheduler state, the ``TrainerState``, the AMP scaler and DDP's gradient bucket
layout as per-rank state with this rank's RNG states. A save returns once its copies started;
the optimizer step waits for them (the hook's pre-step fence on the optimizer). A failed save is
a warning and ``failed_saves``, training goes on (``raise_on_failure=True`` to stop). A resume
gives DDP its buckets back before the first step (``model.ddp_buckets``; the Trainer's default
``ddp_find_unused_parameters`` never rebuilds them) and says where it resumed from, at WARNING.

Accelerate: the ``Trainer`` runs on Accelerate, so this covers Accelerate-prepared DDP under the
Trainer. A hand-written Accelerate loop has no callbacks: use ``CheckpointHook`` with a
``TrainState`` of the unwrapped model and the prepared optimizer (README, "Plain PyTorch loop").
Scope: DDP and single-device training (not DeepSpeed, FSDP or SageMaker MP, whose checkpoints the
Trainer loads its own way).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import tempfile
from typing import Any, Callable, Dict, List, Optional, Union

try:
    from transformers import TrainerCallback
    from transformers.trainer_callback import TrainerState
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError(
        "resilient_ckpt.integrations.huggingface needs transformers: pip install "
        "'resilient-ckpt[huggingface]' (transformers>=4.40, accelerate>=0.30)"
    ) from e

from ..errors import CheckpointingException, ValidationError
from ..manager.checkpoint_manager import CheckpointManager
from ..manager.hooks import CheckpointHook, log_resume
from ..model.ddp_buckets import apply_bucket_layout, find_ddp
from ..model.torch_state import TrainState, restore_rng_state
from .world import check_world

logger = logging.getLogger(__name__)

__all__ = ["LocalCheckpointCallback", "TRAINER_STATE_NAME"]

TRAINER_STATE_NAME = "trainer_state.json"  # transformers' name for it
_LOADERS = ("_load_from_checkpoint", "_load_optimizer_and_scheduler", "_load_scaler", "_load_rng_state")


class LocalCheckpointCallback(TrainerCallback):
    """Saves model, optimizer, scheduler, RNG and trainer state into ``manager`` every
    ``every_n_steps`` optimizer steps; :meth:`resume_checkpoint` resumes from the newer of the
    local and the Trainer's own checkpoint (see the module docstring).

    Attributes: ``saved_steps``, ``failed_saves`` (of the hook), ``restored_from`` (the local
    restore's facts, or None).
    """

    def __init__(
        self,
        manager: Union[CheckpointManager, Callable[[], CheckpointManager]],
        every_n_steps: int,
        *,
        raise_on_failure: bool = False,
    ):
        if not isinstance(manager, CheckpointManager) and not callable(manager):
            raise ValidationError(
                "manager must be a resilient_ckpt CheckpointManager or a function making one, got "
                f"{type(manager).__name__}"
            )
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValidationError(f"every_n_steps must be an int >= 1, got {every_n_steps!r}")
        self._manager = manager if isinstance(manager, CheckpointManager) else None
        self._manager_factory = None if isinstance(manager, CheckpointManager) else manager
        self.every_n_steps = every_n_steps
        self.raise_on_failure = raise_on_failure
        self.restored_from: Optional[Dict[str, Any]] = None
        self._hook: Optional[CheckpointHook] = None
        self._train_state: Optional[TrainState] = None
        self._extra: Dict[str, Any] = {}
        self._trainer = None
        self._restored: Optional[Dict[str, Any]] = None  # the local checkpoint, until applied
        self._resume_dir: Optional[str] = None
        self._originals: Dict[str, Any] = {}

    @property
    def manager(self) -> CheckpointManager:
        """The manager (made by the function given, on first use: the Trainer's arguments
        initialize torch.distributed, and the manager's constructor is collective)."""
        if self._manager is None:
            self._manager = self._manager_factory()
        check_world(
            self._manager,
            "the Trainer's TrainingArguments initialize it). Construct it after TrainingArguments, or pass "
            "LocalCheckpointCallback a function that makes it (called on first use)",
        )
        return self._manager

    # ---- save ----------------------------------------------------------------------------------

    def on_train_begin(self, args, state, control, model=None, optimizer=None, lr_scheduler=None, **kwargs):
        if self._resume_dir is not None:  # HF has read trainer_state.json by now
            shutil.rmtree(self._resume_dir, ignore_errors=True)
        inner = getattr(optimizer, "optimizer", optimizer)  # Accelerate's AcceleratedOptimizer wraps it
        self._extra = {}
        ddp = find_ddp(getattr(self._trainer, "model_wrapped", None))  # set by resume_checkpoint
        self._train_state = TrainState(model, inner, lr_scheduler, extra=self._extra, ddp=ddp)
        if self._hook is not None:
            self._hook.close()
        # the hook's optimizer pre-step hook fences the latest save before the update; this
        # callback decides which steps save (HF counts steps from 1), the hook saves each one given
        self._hook = CheckpointHook(
            self.manager, every_n_steps=1, state=self._train_state, raise_on_failure=self.raise_on_failure
        )
        if self._restored is not None:  # resuming from the local checkpoint: before the first step
            buckets = None
            if ddp is not None:
                buckets = apply_bucket_layout(ddp, self._restored["per_rank"].get("ddp_buckets"))
                self._train_state.ddp_buckets = buckets
            it = self.restored_from["iteration"]
            log_resume(logger, self.manager.session_id, it, self.manager.last_load_metrics, buckets)

    def on_step_end(self, args, state, control, **kwargs):
        hook = self._hook
        if hook is None or state.global_step % self.every_n_steps != 0:
            return
        # what TrainerState.save_to_json writes as trainer_state.json
        self._extra["trainer_state"] = json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"
        scaler = getattr(getattr(self._trainer, "accelerator", None), "scaler", None)
        if scaler is not None:
            self._extra["scaler"] = scaler.state_dict()
        hook.step(state.global_step)  # the iteration saved: HF's step count

    def on_train_end(self, args, state, control, **kwargs):
        if self._hook is not None:
            self._hook.finish()
        self._detach()

    def finish(self) -> None:
        """Wait for outstanding local saves (``on_train_end`` does); reports failures."""
        if self._hook is not None:
            self._hook.finish()

    @property
    def saved_steps(self) -> List[int]:
        """HF global steps whose local save was started (failed ones included)."""
        return list(self._hook.saved_steps) if self._hook is not None else []

    @property
    def failed_saves(self) -> int:
        return self._hook.failed_saves if self._hook is not None else 0

    # ---- resume --------------------------------------------------------------------------------

    def resume_checkpoint(self, trainer, checkpoint: Optional[str] = None) -> Optional[str]:
        """What to pass to ``trainer.train(resume_from_checkpoint=...)``: the Trainer's own newest
        checkpoint (``checkpoint``, else the last ``checkpoint-N`` in ``output_dir``) when it is
        newer than the newest complete local checkpoint, else a directory that makes the Trainer
        resume from the local one. None: nothing to resume from. Collective (every rank)."""
        self._trainer = trainer
        global_ckpt = checkpoint
        if global_ckpt is None and os.path.isdir(trainer.args.output_dir):
            global_ckpt = get_last_checkpoint(trainer.args.output_dir)
        global_step = _global_step_of(global_ckpt) if global_ckpt is not None else -1
        local_step = self.manager.find_latest()
        if local_step < 0 or local_step < global_step:
            if local_step >= 0:
                logger.warning(
                    "Found a local checkpoint of step %d, but the Trainer's checkpoint %s (step %d) is newer. "
                    "Resuming from the Trainer's checkpoint.",
                    local_step,
                    global_ckpt,
                    global_step,
                )
            elif global_ckpt is not None:
                logger.info(
                    "No local checkpoint available. Resuming from the Trainer's checkpoint %s", global_ckpt
                )
            else:
                logger.info("No local or Trainer checkpoint: starting from step 0")
            return global_ckpt
        result = self.manager.load_local()
        if result is None:
            raise CheckpointingException(
                f"local checkpoint of step {local_step} was found but could not be restored on every rank "
                "(see the warnings above); start the job again to resume from the Trainer's checkpoint"
            )
        restored, iteration = result
        per_rank = restored.get("per_rank") or {}
        extra = per_rank.get("extra") or {}
        if "trainer_state" not in extra:
            raise CheckpointingException(
                "the local checkpoint was not saved by resilient_ckpt.integrations.huggingface (no trainer "
                "state in it): was the session id reused by another program?"
            )
        m = self.manager.last_load_metrics
        self.restored_from = {"iteration": iteration, "source": getattr(m, "source", "local")}
        logger.info(
            "Local checkpoint of step %d is at least the Trainer's (%s). Resuming from a local checkpoint",
            iteration,
            f"step {global_step}" if global_ckpt is not None else "none",
        )
        self._restored = restored
        self._resume_dir = tempfile.mkdtemp(prefix="resilient_ckpt-hf-resume-")
        with open(os.path.join(self._resume_dir, TRAINER_STATE_NAME), "w") as f:
            f.write(extra["trainer_state"])
        self._attach(trainer)
        return self._resume_dir

    def _attach(self, trainer) -> None:
        """The trainer's loaders take the restored state from memory for the resume directory."""
        self._detach()
        for name in _LOADERS:
            original = getattr(trainer, name)
            self._originals[name] = original
            setattr(trainer, name, _Loader(self, trainer, name, original))

    def _detach(self) -> None:
        trainer = self._trainer
        for name in self._originals:
            if trainer is not None and isinstance(trainer.__dict__.get(name), _Loader):
                del trainer.__dict__[name]  # the class's method again
        self._originals = {}

    def _apply(self, trainer, name: str, model=None) -> None:
        restored = self._restored
        if name == "_load_from_checkpoint":
            TrainState(model if model is not None else trainer.model, rng=False).load_state_dict(
                {"model": restored["model"]}
            )
        elif name == "_load_optimizer_and_scheduler":
            opt = getattr(trainer.optimizer, "optimizer", trainer.optimizer)
            TrainState(trainer.model, opt, trainer.lr_scheduler, rng=False).load_state_dict(restored)
        elif name == "_load_scaler":
            scaler = getattr(trainer.accelerator, "scaler", None)
            saved = restored["per_rank"]["extra"].get("scaler")
            if scaler is not None and saved is not None:
                scaler.load_state_dict(saved)
        elif name == "_load_rng_state":
            rng = restored["per_rank"].get("rng")
            if rng is not None:
                restore_rng_state(rng)
            self._restored = None  # the last piece HF asks for: release the copy


class _Loader:
    """One of the trainer's checkpoint loaders, answering for the local resume directory."""

    def __init__(self, callback: LocalCheckpointCallback, trainer, name: str, original):
        self.callback, self.trainer, self.name, self.original = callback, trainer, name, original

    def __call__(self, checkpoint=None, *args, **kwargs):
        cb = self.callback
        if checkpoint is None or checkpoint != cb._resume_dir:
            return self.original(checkpoint, *args, **kwargs)
        if cb._restored is None:
            raise CheckpointingException(
                f"the Trainer asked for {self.name} after the local checkpoint was applied and released; "
                "call resume_checkpoint(trainer) again before every train()"
            )
        model = args[0] if args else kwargs.get("model")
        cb._apply(self.trainer, self.name, model)


def _global_step_of(checkpoint: str) -> int:
    """The global step of one of the Trainer's own checkpoints (its trainer_state.json)."""
    path = os.path.join(checkpoint, TRAINER_STATE_NAME)
    try:
        return int(TrainerState.load_from_json(path).global_step)
    except (OSError, ValueError, json.JSONDecodeError) as e:
        raise CheckpointingException(
            f"cannot read the global step of the Trainer's checkpoint {checkpoint} ({e}); pass "
            "resume_checkpoint(trainer, checkpoint=...) a complete checkpoint-N directory"
        ) from e
