"""Trainer hook: save every N steps, keep the optimizer off tensors being copied, restore.

Usage in a plain loop::

    state = TrainState(model, optimizer, scheduler, extra={"epoch": 0})
    hook = CheckpointHook(CheckpointManager(), every_n_steps=100, state=state)
    start = hook.restore()                      # 0 on a fresh start
    for step in range(start, total_steps):
        train_step(step)                        # forward, backward, optimizer.step()
        hook.step(step)                         # saves after steps 99, 199, ...

A save taken after step ``s`` holds the state *after* ``s``; :meth:`restore` returns ``s + 1``,
the next step to run. Saved tensors must not change until their copies finish: the hook
registers an optimizer pre-step hook that waits for staging (``wait_staged``) — usually
free, since the copies overlap forward/backward. A failed save is a warning (plus the
``failed_saves`` counter), not a crash, unless ``raise_on_failure=True``.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any, Callable, Dict, List, Optional

from .errors import CheckpointingException
from .manager import CheckpointManager, SaveHandle
from .torch_state import TrainState

logger = logging.getLogger(__name__)


class CheckpointHook:
    def __init__(
        self,
        manager: CheckpointManager,
        every_n_steps: int,
        state: Optional[TrainState] = None,
        state_fn: Optional[Callable[[], Any]] = None,
        *,
        raise_on_failure: bool = False,
        fallback_loader: Optional[Callable[[], Optional[int]]] = None,
    ):
        if every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        if (state is None) == (state_fn is None):
            raise ValueError("pass exactly one of state= (a TrainState) or state_fn= (returns a sharded state dict)")
        self.manager = manager
        self.every_n_steps = every_n_steps
        self.state = state
        self.state_fn = state_fn
        self.raise_on_failure = raise_on_failure
        self.fallback_loader = fallback_loader
        self.failed_saves = 0
        self.saved_steps: List[int] = []
        self.restored_from: Optional[Dict[str, Any]] = None
        self._pending: List[SaveHandle] = []
        self._last: Optional[SaveHandle] = None
        self._hook_handle = None
        if state is not None and state.optimizer is not None:
            self._hook_handle = state.optimizer.register_step_pre_hook(self._before_optimizer_step)

    # ---- training loop side ------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        return (step + 1) % self.every_n_steps == 0

    def step(self, step: int, state_fn: Optional[Callable[[], Any]] = None) -> Optional[SaveHandle]:
        """Call once per step, after the optimizer step. Saves when ``should_save(step)``."""
        self._collect_finished()
        if not self.should_save(step):
            return None
        fn = state_fn or self.state_fn or self.state.sharded_state_dict
        try:
            handle = self.manager.save_local(fn(), iteration=step)
        except CheckpointingException as e:
            self._failed(step, e)
            return None
        self._last = handle
        self._pending.append(handle)
        self.saved_steps.append(step)
        return handle

    def wait_staged(self) -> None:
        """Block until the latest save's copies are done (before mutating saved tensors)."""
        if self._last is not None:
            self._last.wait_staged()

    def _before_optimizer_step(self, *_args, **_kwargs) -> None:
        self.wait_staged()

    def _collect_finished(self) -> None:
        still = []
        for h in self._pending:
            if not h.done():
                still.append(h)
                continue
            err = h.exception()
            if err is not None:
                self._failed(h.iteration, err)
        self._pending = still

    def _failed(self, step: int, err: BaseException) -> None:
        self.failed_saves += 1
        if self.raise_on_failure:
            raise err
        warnings.warn(f"local checkpoint of step {step} failed (training continues): {err}", RuntimeWarning)
        logger.warning("local checkpoint of step %d failed: %s", step, err)

    def finish(self) -> None:
        """Wait for outstanding saves (end of training); reports failures like :meth:`step`."""
        for h in self._pending:
            try:
                h.wait()
            except CheckpointingException as e:
                self._failed(h.iteration, e)
        self._pending = []

    # ---- start-up side ------------------------------------------------------------------------

    def restore(self, template: Optional[Any] = None) -> int:
        """Restore the newest complete local checkpoint; returns the next step to run.

        With a TrainState the restored state is applied to it. When no complete local
        checkpoint exists, says so and calls ``fallback_loader`` (your own loader returning
        the next step, or None) — 0 means a fresh start.
        """
        result = self.manager.load_local(template)
        if result is None:
            logger.info("no complete local checkpoint for session %r", self.manager.session_id)
            if self.fallback_loader is not None:
                logger.info("falling back to the caller's loader")
                step = self.fallback_loader()
                return int(step or 0)
            return 0
        state, iteration = result
        if self.state is not None:
            self.state.load_state_dict(state)
        self.restored_state = state
        m = self.manager.last_load_metrics
        self.restored_from = m.as_dict() if m is not None else {"iteration": iteration}
        return iteration + 1

    def close(self) -> None:
        self.finish()
        if self._hook_handle is not None:
            self._hook_handle.remove()
            self._hook_handle = None
