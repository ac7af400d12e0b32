"""Trainer hook: save every N steps, keep the optimizer off tensors being copied, restore.

Usage in a plain loop::

    state = TrainState(model, optimizer, scheduler, extra={"epoch": 0})
    hook = CheckpointHook(CheckpointManager(), every_n_steps=100, state=state)
    start = hook.restore()                      # 0 on a fresh start
    for step in range(start, total_steps):
        train_step(step)                        # forward, backward, optimizer.step()
        hook.step(step)                         # saves after steps 99, 199, ...

A save taken after step ``s`` holds the state *after* ``s``; :meth:`restore` returns ``s + 1``,
the next step to run. Saved tensors must not change until their copies have read them: the
hook registers an optimizer pre-step hook that fences the latest save (``SaveHandle.fence``):
the optimizer's kernels on the current CUDA stream run after the device-to-host copies (the GPU
waits, the CPU does not), and CPU tensors' copies are waited for — usually free, since the
copies overlap forward/backward. A failed save is a warning (plus the
``failed_saves`` counter), not a crash, unless ``raise_on_failure=True``.
"""

from __future__ import annotations

import logging
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable, ClassVar, Dict, List, Optional

import torch

from ..errors import CheckpointingException, ValidationError
from ..model.torch_state import TrainState
from .checkpoint_manager import CheckpointManager, SaveHandle

logger = logging.getLogger(__name__)

#: ``when_busy`` -> what ``save_local`` is asked for
WHEN_BUSY: Dict[str, Dict[str, bool]] = {
    "queue": {},
    "skip": {"skip_if_busy": True},
    "skip_in_background": {"skip_if_busy": True, "vote_in_background": True},
}


class CheckpointHook:
    """Saves every ``every_n_steps`` steps and restores at start-up (see the module docstring).

    Args:
        manager: the CheckpointManager that stores the checkpoints.
        every_n_steps: save after steps ``N-1, 2N-1, ...`` (``step`` counts from 0).
        state: a TrainState to save and to restore into; or
        state_fn: returns the sharded state dict to save (Megatron-style); the restored state
            is left in ``restored_state``.
        raise_on_failure: re-raise a failed save instead of warning and counting it.
        fallback_loader: called by :meth:`restore` when no complete local checkpoint exists
            (or it cannot be restored); returns the next step to run, or None for 0.
        optimizer: the optimizer whose ``step()`` waits for staging (default:
            ``state.optimizer``); with ``state_fn`` pass it, or call :meth:`wait_staged`
            yourself before mutating saved tensors.
        when_busy: what a due save does while an earlier one is still copying, replicating
            or agreeing. ``"queue"`` (default): one save waits behind the running one, a
            third makes the step wait. ``"skip"``: the save is skipped on every rank (the
            ranks vote in the save's one collective) and the next step saves instead — the
            step never waits, and with ``every_n_steps=1`` checkpoints come as often as the
            copies and the wire allow (``metrics.interval_steps`` says how often that is).
            ``"skip_in_background"``: the same rule, but the step makes no collective and
            waits for no other rank: an idle rank starts its copies at once and the ranks vote
            in the background; a save that some rank could not take is dropped on every rank
            and counted skipped at the next step (``step()`` returned its handle: see
            ``SaveHandle.skipped``). A save is due ``every_n_steps`` steps after the last one
            started (skip modes).

    Attributes: ``saved_steps`` (steps at which a save was started, successful or not),
    ``failed_steps`` and ``failed_saves`` (saves that failed: the metric to alert on),
    ``skipped_saves`` (due saves skipped, ``when_busy="skip"``), ``metrics`` (a
    :class:`HookMetrics`: the achieved interval, the steps at risk; :meth:`register_prometheus`
    exports it), ``restored_from`` (the restore's metrics), ``restored_state`` (the restored
    state dict).
    """

    def __init__(
        self,
        manager: CheckpointManager,
        every_n_steps: int,
        state: Optional[TrainState] = None,
        state_fn: Optional[Callable[[], Any]] = None,
        *,
        raise_on_failure: bool = False,
        fallback_loader: Optional[Callable[[], Optional[int]]] = None,
        optimizer: Optional[torch.optim.Optimizer] = None,
        when_busy: str = "queue",
    ):
        if when_busy not in WHEN_BUSY:
            raise ValidationError(
                f"when_busy must be 'queue' (wait behind a running save), 'skip' (skip the "
                f"save, take the next step's) or 'skip_in_background' (the same, decided off "
                f"the training thread), got {when_busy!r}"
            )
        if isinstance(every_n_steps, bool) or not isinstance(every_n_steps, int) or every_n_steps < 1:
            raise ValidationError(
                f"every_n_steps must be an int >= 1 (save after every N-th step), got {every_n_steps!r}"
            )
        if (state is None) == (state_fn is None):
            raise ValidationError(
                "pass exactly one of state= (a TrainState) or state_fn= (returns a sharded state dict)"
            )
        self.manager = manager
        self.every_n_steps = every_n_steps
        self.state = state
        self.state_fn = state_fn
        self.raise_on_failure = raise_on_failure
        self.fallback_loader = fallback_loader
        self.failed_saves = 0
        self.failed_steps: List[int] = []
        self.saved_steps: List[int] = []
        self.when_busy = when_busy
        self.skipped_saves = 0
        self._last_started = -1  # the step of the last save started (every rank alike)
        self._completed_step = -1  # the newest step whose save completed on every rank
        self._last_step = -1  # the newest step seen by step()
        self.restored_from: Optional[Dict[str, Any]] = None
        self.restored_state: Any = None
        self._pending: List[SaveHandle] = []
        self._last: Optional[SaveHandle] = None
        self._hook_handle = None
        if optimizer is None and state is not None:
            optimizer = state.optimizer
        if optimizer is not None:
            self._hook_handle = optimizer.register_step_pre_hook(self._before_optimizer_step)

    # ---- training loop side ------------------------------------------------------------------------

    def should_save(self, step: int) -> bool:
        if self.when_busy != "queue":  # a skipped save is due again at the next step
            return step - self._last_started >= self.every_n_steps
        return (step + 1) % self.every_n_steps == 0

    def step(self, step: int, state_fn: Optional[Callable[[], Any]] = None) -> Optional[SaveHandle]:
        """Call once per step, after the optimizer step. Saves when ``should_save(step)``.

        Returns the save's handle (None when this step does not save, the save was skipped
        or could not start). Failures of earlier saves that finished meanwhile are reported
        here.
        """
        self._last_step = step
        self._collect_finished()
        if not self.should_save(step):
            return None
        fn = state_fn or self.state_fn or self.state.sharded_state_dict
        skip = WHEN_BUSY[self.when_busy]
        try:
            handle = self.manager.save_local(fn, iteration=step, **skip)
        except CheckpointingException as e:
            self.saved_steps.append(step)
            self._last_started = step
            self._report([(step, e)])
            return None
        if handle is None:  # skipped on every rank: an earlier save is still in flight
            self.skipped_saves += 1
            return None
        self.saved_steps.append(step)
        self._last_started = step
        self._last = handle
        self._pending.append(handle)
        return handle

    @property
    def metrics(self) -> "HookMetrics":
        """What the checkpoints achieved so far (see :class:`HookMetrics`)."""
        started = self.saved_steps
        recent = started[-(HookMetrics.WINDOW + 1) :]
        interval = (recent[-1] - recent[0]) / (len(recent) - 1) if len(recent) > 1 else 0.0
        done = self._completed_step
        return HookMetrics(
            saves_started=len(started),
            saves_skipped=self.skipped_saves,
            saves_failed=self.failed_saves,
            interval_steps=interval,
            last_complete_step=done,
            steps_at_risk=self._last_step - done if done >= 0 else self._last_step + 1,
        )

    def register_prometheus(self, registry: Any = None, prefix: str = "resilient_ckpt_") -> None:
        """Export :attr:`metrics` as Prometheus gauges in ``registry`` (default: the
        ``prometheus_client`` default registry, which ``start_http_server`` serves); values
        are read when scraped."""
        from prometheus_client import REGISTRY, Gauge

        registry = REGISTRY if registry is None else registry
        for name, what in HookMetrics.DESCRIPTIONS.items():
            Gauge(prefix + name, what, registry=registry).set_function(
                lambda name=name: float(getattr(self.metrics, name))
            )

    def wait_staged(self) -> None:
        """Block until the latest save's copies are done (before mutating saved tensors).

        A failed copy does not raise here (this runs inside ``optimizer.step()``): the save
        fails and is reported like any failed save, by :meth:`step` or :meth:`finish`.
        """
        self._settle_latest(SaveHandle.wait_staged)

    def fence(self) -> None:
        """Order mutations after the latest save's copies without a CPU wait for GPU copies
        (see ``SaveHandle.fence``); runs before every ``optimizer.step()``. A failed copy does
        not raise here: the save fails and is reported like any failed save."""
        self._settle_latest(SaveHandle.fence)

    def _settle_latest(self, how) -> None:
        handle, self._last = self._last, None
        if handle is None:
            return
        try:
            how(handle)
        except Exception as e:  # reported through the save's handle
            logger.debug("staging of step %d failed: %s", handle.iteration, e)

    def _before_optimizer_step(self, *_args, **_kwargs) -> None:
        self.fence()

    def _collect_finished(self) -> None:
        self._drop_skipped()
        done = [h for h in self._pending if h.done()]
        self._pending = [h for h in self._pending if h not in done]
        self._note_complete(done)
        self._report([(h.iteration, h.exception()) for h in done if h.exception() is not None])

    def _drop_skipped(self) -> None:
        """``skip_in_background``: a save that started here but that the ranks' vote dropped
        on every rank counts as skipped, not started, and the next step is due again."""
        if self.when_busy != "skip_in_background":
            return
        dropped = [h for h in self._pending if h.skipped()]
        if not dropped:
            return
        self._pending = [h for h in self._pending if h not in dropped]
        gone = {h.iteration for h in dropped}
        self.saved_steps = [s for s in self.saved_steps if s not in gone]
        self.skipped_saves += len(dropped)
        self._last_started = self.saved_steps[-1] if self.saved_steps else -1

    def _note_complete(self, done: List[SaveHandle]) -> None:
        ok = [h.iteration for h in done if h.exception() is None and not h.metrics.skipped]
        if ok:
            self._completed_step = max(self._completed_step, *ok)

    def _report(self, failures) -> None:
        """Count and warn about every failure, then raise the first if asked to."""
        for step, err in failures:
            self.failed_saves += 1
            self.failed_steps.append(step)
            logger.warning("local checkpoint of step %d failed: %s", step, err)
            if not self.raise_on_failure:
                warnings.warn(
                    f"local checkpoint of step {step} failed (training continues; "
                    f"{self.failed_saves} failed so far): {err}",
                    RuntimeWarning,
                    stacklevel=3,
                )
        if failures and self.raise_on_failure:
            raise failures[0][1]

    def finish(self) -> None:
        """Wait for outstanding saves (end of training); reports failures like :meth:`step`."""
        self._drop_skipped()
        pending, self._pending = self._pending, []
        failures = []
        for h in pending:
            try:
                h.wait()
            except CheckpointingException as e:
                failures.append((h.iteration, e))
        self._note_complete(pending)
        self._report(failures)

    # ---- start-up side ------------------------------------------------------------------------

    def restore(self, template: Optional[Any] = None) -> int:
        """Restore the newest complete local checkpoint; returns the next step to run.

        With a TrainState the restored state is applied to it (otherwise it is left in
        ``restored_state``). When no complete local checkpoint exists, logs so and returns
        ``fallback_loader()`` (your own loader returning the next step, or None) — 0 means a
        fresh start. A local checkpoint that exists but cannot be restored raises, unless a
        fallback loader is set: then it is logged as a warning and the fallback is used.
        """
        session = self.manager.session_id
        try:
            result = self.manager.load_local(
                template,
                # a checkpoint of another world size is resharded into this job's layout
                elastic_template=self.state.restore_template if self.state is not None else None,
            )
        except CheckpointingException as e:
            if self.fallback_loader is None:
                raise
            logger.warning(
                "local checkpoint of session %r could not be restored (%s); falling back to "
                "the caller's loader",
                session,
                e,
            )
            return self._fallback()
        if result is None:
            # Never silent: starting over loses every step done so far if this is a restart.
            m = self.manager.last_load_metrics
            why = (
                f"memory holds part of a checkpoint but the data of ranks {m.missing_owners} is "
                "lost (see the warning above)"
                if m is not None and m.missing_owners
                else "memory holds no checkpoint of it (a first run, a new session id, or every "
                "copy was lost)"
            )
            if self.fallback_loader is not None:
                logger.warning(
                    "no local checkpoint of session %r to restore: %s; using the caller's loader",
                    session,
                    why,
                )
                return self._fallback()
            logger.warning(
                "no local checkpoint of session %r to restore: %s; starting at step 0", session, why
            )
            return 0
        state, iteration = result
        self._last_started = self._completed_step = self._last_step = iteration
        if self.state is not None:
            self.state.load_state_dict(state)
        self.restored_state = state
        m = self.manager.last_load_metrics
        self.restored_from = m.as_dict() if m is not None else {"iteration": iteration}
        buckets = self.state.ddp_buckets if self.state is not None else None
        log_resume(logger, session, iteration, m, buckets)
        return iteration + 1

    def _fallback(self) -> int:
        step = self.fallback_loader()
        return int(step or 0)

    def close(self) -> None:
        """Wait for outstanding saves and detach from the optimizer."""
        try:
            self.finish()
        finally:
            if self._hook_handle is not None:
                self._hook_handle.remove()
                self._hook_handle = None


@dataclass
class HookMetrics:
    """What a :class:`CheckpointHook`'s saves achieved (``hook.metrics``)."""

    #: saves started (complete or failed), due saves skipped (``when_busy="skip"``), failed
    saves_started: int = 0
    saves_skipped: int = 0
    saves_failed: int = 0
    #: steps between the starts of the last ``WINDOW`` + 1 saves, on average (0: fewer than two)
    interval_steps: float = 0.0
    #: the newest step whose checkpoint completed on every rank (-1: none yet)
    last_complete_step: int = -1
    #: steps a failure now would cost: those after the newest complete checkpoint
    steps_at_risk: int = 0

    WINDOW: ClassVar[int] = 16
    DESCRIPTIONS: ClassVar[Dict[str, str]] = {
        "checkpoint_interval_steps": "Steps between the last local checkpoints started (achieved interval)",
        "saves_skipped": "Due local checkpoints skipped because an earlier one was still in flight",
        "saves_failed": "Local checkpoints that failed",
        "last_complete_step": "Newest step with a local checkpoint complete on every rank",
        "steps_at_risk": "Steps a failure now would lose (after the newest complete checkpoint)",
    }

    @property
    def checkpoint_interval_steps(self) -> float:
        return self.interval_steps

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def resume_message(session: str, iteration: int, metrics: Any = None, buckets: Any = None) -> str:
    """The line every entry point logs after a local resume: where from, and what became of
    DDP's gradient buckets (``model.ddp_buckets``) when the model is DDP-wrapped."""
    source = getattr(metrics, "source", "") or "local"
    took = getattr(metrics, "total_s", 0.0)
    where = {"local": "this node's memory", "peer": "a peer node's replica"}.get(source, source)
    line = f"Resumed session {session!r} from the local checkpoint of step {iteration} ({where}"
    line += f", {took:.2f} s)" if took else ")"
    return line if buckets is None else f"{line}; {buckets}"


def log_resume(
    log: logging.Logger, session: str, iteration: int, metrics: Any = None, buckets: Any = None
) -> None:
    """:func:`resume_message` at WARNING: shown at every framework's default verbosity (a resume
    after a failure is worth a line; frameworks leave INFO off by default)."""
    log.warning("%s", resume_message(session, iteration, metrics, buckets))
