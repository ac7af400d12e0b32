"""Lightning: local checkpoints every N steps, resumed automatically — a drop-in for
nvidia-resiliency-ext's ``ptl_resiliency.local_checkpoint_callback`` over our ``CheckpointManager``.

Same classes, same constructor arguments: change the import. ::

    from resilient_ckpt import CheckpointManager
    from resilient_ckpt.integrations.lightning import HierarchicalCheckpointIO, LocalCheckpointCallback

    manager = CheckpointManager(session_id="run7")              # embedded, or mode="service"
    trainer = pl.Trainer(
        strategy="ddp",
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=1000),
                   LocalCheckpointCallback(every_n_train_steps=50)],
        plugins=[HierarchicalCheckpointIO(None, manager, global_iteration, async_save=True)],
    )
    trainer.fit(model, ckpt_path="last")     # the newer of local and global, and says which

What Lightning sees:

- ``LocalCheckpointCallback`` is a ``ModelCheckpoint`` that only saves at train batch ends
  (every ``every_n_train_steps`` steps or ``train_time_interval``), passing
  ``storage_options={"local_checkpoint_options": {"ckpt_type": "local", "iteration": step}}``.
  With a strategy whose ``save_checkpoint`` writes on global rank 0 only (DDP, single device),
  the callback hands the dumped checkpoint to the strategy's ``checkpoint_io`` on *every* rank
  (each rank's local checkpoint is its own; no barrier); other strategies get
  ``trainer.save_checkpoint(None, storage_options=...)`` as upstream does.
- ``HierarchicalCheckpointIO`` wraps the strategy's global ``CheckpointIO``: saves with those
  options go to the local manager, any other to the wrapped IO; ``load_checkpoint(path)`` takes
  the local checkpoint when its iteration is at least the global one's
  (``get_global_ckpt_iteration_fn(path)``) and logs which it resumes from.
- ``trainer.fit(ckpt_path="last")``: Lightning only loads when some ``ModelCheckpoint`` lists a
  ``last`` file. When no global checkpoint is newer than the local one (none written yet, the
  common case after an early failure), the callback lists a local entry (an in-process
  ``memory://`` name: nothing is written) so Lightning loads through the IO, which restores the
  local checkpoint. The reference resumes from nothing in that case.

Ordering (our manager): a save returns once its copies have *started*; the callback fences it
(``SaveHandle.fence``, as ``CheckpointHook`` does before ``optimizer.step()``) in
``on_before_optimizer_step`` — after the next step's forward and backward, before the update —
so the copy overlaps them. Buffers, which the next forward writes in place (BatchNorm
statistics, DDP's buffer broadcast), are copied when the save starts (they are small).
``async_save=False`` (upstream's default) returns once the save is complete on every rank.

What a local checkpoint holds: Lightning's checkpoint dict as ``trainer.save_checkpoint`` dumps
it. Model parameters (``state_dict``) and optimizer (``optimizer_states``) tensors are
data-parallel replicas, saved once across the job and spread over the ranks (DTensors: shards at
their placements); the module's buffers are each rank's own (rank-local: saved by every rank,
restored to it); everything else (loops, callbacks, schedulers, hyper-parameters, datamodule
state) plus this rank's RNG states and DDP's gradient bucket layout is a per-rank object.
Lightning's own checkpoints carry no RNG state; a local one does, and the callback restores it
before the first batch after the resume, so dropout draws continue as if the job had not
stopped; DDP's buckets are given back before the first step (``model.ddp_buckets``), so its
first all-reduce adds gradients in the same order as an uninterrupted run's.
"""

from __future__ import annotations

import inspect
import logging
from datetime import timedelta
from importlib.util import find_spec
from typing import Any, Callable, Dict, List, Optional, Set, Tuple

import torch
import torch.distributed as dist

if find_spec("lightning") is not None:  # the package nvidia-resiliency-ext's ptl_resiliency tries first
    import lightning.pytorch as pl
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.fabric.utilities.data import AttributeDict as _FabricAttributeDict
    from lightning.pytorch.plugins.io.wrapper import _WrappingCheckpointIO
    from lightning.pytorch.utilities.parsing import AttributeDict as _AttributeDict
elif find_spec("pytorch_lightning") is not None:
    import pytorch_lightning as pl
    from lightning_fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning_fabric.utilities.cloud_io import get_filesystem
    from lightning_fabric.utilities.data import AttributeDict as _FabricAttributeDict
    from pytorch_lightning.plugins.io.wrapper import _WrappingCheckpointIO
    from pytorch_lightning.utilities.parsing import AttributeDict as _AttributeDict
else:
    raise ImportError(
        "resilient_ckpt.integrations.lightning needs Lightning: pip install 'resilient-ckpt[lightning]' "
        "(lightning>=2.2; pytorch_lightning works too)"
    )

from ..errors import CheckpointingException, ValidationError
from ..gc_pause import paused_gc
from ..manager.checkpoint_manager import CheckpointManager
from ..manager.hooks import CheckpointHook, log_resume
from ..model import codec
from ..model.ddp_buckets import apply_bucket_layout, bucket_layout, find_ddp
from ..model.mapping import ShardedObject
from ..model.torch_state import (
    BufferSnapshots,
    ShardedTensorCache,
    buffer_names,
    capture_rng_state,
    model_sharded,
    restore_rng_state,
)
from .world import check_world

logger = logging.getLogger(__name__)

__all__ = [
    "LOCAL_CKPT_OPTS_KEY",
    "LOCAL_RESTORE_KEY",
    "HierarchicalCheckpointIO",
    "LocalCheckpointCallback",
]

#: storage_options key that marks a save as local (upstream's name: the two sides interoperate)
LOCAL_CKPT_OPTS_KEY = "local_checkpoint_options"
#: key of a restored local checkpoint's own facts (iteration, this rank's RNG states); read by
#: LocalCheckpointCallback.on_load_checkpoint
LOCAL_RESTORE_KEY = "resilient_ckpt_local_restore"
#: what the callback lists for ckpt_path="last" when the local checkpoint is the one to load
LOCAL_MARKER_PREFIX = "memory://resilient_ckpt-local/"

_REPLICATED = ("state_dict", "optimizer_states")  # data-parallel replicas under DDP

# Lightning's hyper-parameter container, stored as what it is (a dict of plain values).
for _cls in {_FabricAttributeDict, _AttributeDict}:
    codec.register_type(_cls, f"lightning.{_cls.__module__}.AttributeDict", dict, _cls)


# ---- the callback --------------------------------------------------------------------------------


class LocalCheckpointCallback(pl.callbacks.ModelCheckpoint):
    """Saves a local checkpoint every ``every_n_train_steps`` train steps or every
    ``train_time_interval`` (nvidia-resiliency-ext's ``LocalCheckpointCallback``; use it with
    :class:`HierarchicalCheckpointIO` as the strategy's ``checkpoint_io``).

    Never writes files: epoch-end, validation-end, top-k and on-exception saves of
    ``ModelCheckpoint`` are skipped. The iteration of a save is ``trainer.global_step``; a step
    saves at most once (gradient accumulation repeats a global step across batches).
    """

    def __init__(
        self,
        every_n_train_steps: Optional[int] = None,
        train_time_interval: Optional[timedelta] = None,
    ):
        super().__init__(every_n_train_steps=every_n_train_steps, train_time_interval=train_time_interval)
        self._rng_to_restore: Optional[Dict[str, Any]] = None
        self._resumed: Optional[Dict[str, Any]] = None  # the restore's facts, until the first step
        #: facts of the local checkpoint this run resumed from (iteration, source), else None
        self.restored_from: Optional[Dict[str, Any]] = None

    # ModelCheckpoint's other save points write global files: never for local checkpoints.
    def on_train_epoch_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        logger.debug("skipping on_train_epoch_end local checkpoint save")

    def on_validation_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        logger.debug("skipping on_validation_end local checkpoint save")

    def on_exception(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", exception: BaseException
    ) -> None:
        logger.debug("skipping on_exception local checkpoint save")

    def _save_topk_checkpoint(self, trainer: "pl.Trainer", monitor_candidates: Dict[str, Any]) -> None:
        logger.debug("skipping top-k local checkpoint save")

    def _save_last_checkpoint(self, trainer: "pl.Trainer", monitor_candidates: Dict[str, Any]) -> None:
        """The save: Lightning's checkpoint dict, routed to the local manager by the IO."""
        step = trainer.global_step
        if step == self._last_global_step_saved:
            return
        self._last_global_step_saved = step
        io = trainer.strategy.checkpoint_io
        if not _is_hierarchical(io):
            raise ValidationError(
                f"LocalCheckpointCallback needs a HierarchicalCheckpointIO as the strategy's checkpoint_io "
                f"(it has {type(io).__name__}): pass Trainer(plugins=[HierarchicalCheckpointIO(None, "
                "manager, get_global_ckpt_iteration_fn)]) or set trainer.strategy.checkpoint_io = "
                "HierarchicalCheckpointIO.get_partial_wrapper_constructor(manager, fn)(trainer.strategy.checkpoint_io)"
            )
        options = {LOCAL_CKPT_OPTS_KEY: dict(ckpt_type="local", iteration=step)}
        if _saves_on_global_zero_only(trainer.strategy):
            # Strategy.save_checkpoint would call the IO on rank 0 only, then a barrier; every
            # rank keeps its own local checkpoint, and the manager synchronizes what it needs.
            checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
            io.save_checkpoint(checkpoint, None, storage_options=options)
        else:
            trainer.save_checkpoint(None, storage_options=options)

    # ---- ordering and restore ----------------------------------------------------------------

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, HierarchicalCheckpointIO):
            io.rank_local = buffer_names(pl_module)  # the module's buffers: each rank's own

    def on_train_start(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        super().on_train_start(trainer, pl_module)  # ModelCheckpoint starts its time interval here
        ddp = find_ddp(trainer.strategy.model)
        io = trainer.strategy.checkpoint_io
        if isinstance(io, HierarchicalCheckpointIO):
            io.ddp = ddp  # whose bucket layout each local save keeps
        resumed, self._resumed = self._resumed, None
        if resumed is not None:  # before the first step: DDP's buckets as the run had them
            buckets = apply_bucket_layout(ddp, resumed.get("ddp_buckets")) if ddp is not None else None
            log_resume(logger, resumed["session"], resumed["iteration"], resumed.get("metrics"), buckets)

    def on_train_batch_start(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", batch: Any, batch_idx: int
    ):
        if self._rng_to_restore is not None:
            # Right before the first step after the resume: the draws of data loading's setup
            # (an iterator's base seed) in between are those of a fresh start, not of the run.
            restore_rng_state(self._rng_to_restore)
            self._rng_to_restore = None

    def on_before_optimizer_step(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", optimizer
    ) -> None:
        _fence(trainer)  # after forward/backward (the closure), before the update

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        io = trainer.strategy.checkpoint_io
        if isinstance(io, HierarchicalCheckpointIO):
            io.finish()

    def on_load_checkpoint(
        self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", checkpoint: Dict[str, Any]
    ):
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        facts = checkpoint.get(LOCAL_RESTORE_KEY)
        if facts is not None:
            self._rng_to_restore = facts.get("rng")
            self._resumed = facts
            # that step is saved: with gradient accumulation its other batches end at it again
            self._last_global_step_saved = facts["iteration"]
            self.restored_from = {k: facts[k] for k in ("iteration", "source")}

    def _find_last_checkpoints(self, trainer: "pl.Trainer") -> Set[str]:
        """For ``ckpt_path="last"``: the local checkpoint's entry when it is to be loaded (its
        iteration at least that of the newest global ``last`` checkpoint). Collective."""
        found = super()._find_last_checkpoints(trainer)
        io = trainer.strategy.checkpoint_io
        if not isinstance(io, HierarchicalCheckpointIO):
            return found
        _ensure_process_group(trainer)
        marker = io.local_resume_entry(_global_last_candidates(trainer))
        return found | {marker} if marker is not None else found


def _ensure_process_group(trainer: "pl.Trainer") -> None:
    """Lightning resolves ckpt_path before it initializes torch.distributed (its strategy's
    setup_environment, run again later as a no-op); the local checkpoint's lookup is collective."""
    if trainer.world_size > 1 and not (dist.is_available() and dist.is_initialized()):
        trainer.strategy.setup_environment()


def _fence(trainer: "pl.Trainer") -> None:
    io = trainer.strategy.checkpoint_io
    if isinstance(io, HierarchicalCheckpointIO):
        io.fence()


def _is_hierarchical(io: Any) -> bool:
    # ours, or nvidia-resiliency-ext's (anything that routes local saves to a local manager)
    return isinstance(io, HierarchicalCheckpointIO) or hasattr(io, "local_ckpt_manager")


def _saves_on_global_zero_only(strategy: Any) -> bool:
    return type(strategy).save_checkpoint is pl.strategies.Strategy.save_checkpoint


def _global_last_candidates(trainer: "pl.Trainer") -> Set[str]:
    """The global ``last`` checkpoints Lightning would choose among for ckpt_path="last"."""
    out: Set[str] = set()
    for cb in trainer.callbacks:
        if isinstance(cb, LocalCheckpointCallback):
            continue
        if isinstance(cb, pl.callbacks.ModelCheckpoint):
            out |= set(cb._find_last_checkpoints(trainer))
        elif isinstance(cb, pl.callbacks.OnExceptionCheckpoint) and getattr(cb, "ckpt_path", None):
            out.add(cb.ckpt_path)
    return out


def _newest(paths: Set[str]) -> Optional[str]:
    """Lightning's rule for ckpt_path="last": the existing candidate modified last."""
    stamps = {}
    for p in paths:
        fs = get_filesystem(p)
        if fs.exists(p):
            stamps[p] = fs.modified(p)
    return max(stamps, key=stamps.get) if stamps else None


# ---- the checkpoint IO ------------------------------------------------------------------------------


class HierarchicalCheckpointIO(_WrappingCheckpointIO):
    """Wraps the global ``CheckpointIO``; routes local saves to the local manager and resumes from
    the newer of local and global (nvidia-resiliency-ext's ``HierarchicalCheckpointIO``).

    Args:
        wrapped_checkpoint_io: the global CheckpointIO (None: the strategy's default, when given
            as ``Trainer(plugins=[...])``).
        local_ckpt_manager: our ``CheckpointManager`` (embedded or service mode; also
            ``LocalCheckpointManager``), or any manager with nvidia-resiliency-ext's
            ``save(state, iteration, is_async)`` / ``find_latest()`` / ``load()``.
        get_global_ckpt_iteration_fn: the global step of a global checkpoint, given its path.
        async_save: return once the save's copies started (they finish before the next optimizer
            update); False (upstream's default): once the save is complete on every rank.
        raise_on_failure (keyword, ours): a failed local save raises instead of warning (see
            ``CheckpointHook``); training goes on by default — the failure is counted in
            ``failed_saves`` and the previous local checkpoint stays.

    With our manager, ``to_tensor_aware_state_dict`` / ``from_tensor_aware_state_dict`` have a
    default (the layout in the module docstring); with another manager a subclass implements
    them, as upstream requires.
    """

    def __init__(
        self,
        wrapped_checkpoint_io: Optional[CheckpointIO],
        local_ckpt_manager: Any,
        get_global_ckpt_iteration_fn: Callable[[Any], int],
        async_save: bool = False,
        *,
        raise_on_failure: bool = False,
    ):
        super().__init__(wrapped_checkpoint_io)
        self.get_global_ckpt_iteration_fn = get_global_ckpt_iteration_fn
        self.async_save = async_save
        self.raise_on_failure = raise_on_failure
        self._hook: Optional[CheckpointHook] = None
        self._manager: Any = None
        self._manager_factory: Optional[Callable[[], Any]] = None
        if _is_manager(local_ckpt_manager):
            self._adopt(local_ckpt_manager)
        elif callable(local_ckpt_manager):
            # made on first use, once Lightning has initialized torch.distributed
            self._manager_factory = local_ckpt_manager
        else:
            raise ValidationError(
                f"local_ckpt_manager must be a checkpoint manager or a function returning one, got "
                f"{type(local_ckpt_manager).__name__}"
            )
        self._markers: Dict[str, Optional[str]] = {}
        #: names of the module's buffers in Lightning's ``state_dict`` (set by the callback)
        self.rank_local: Set[str] = set()
        #: the DDP module whose bucket layout each save keeps (set by the callback)
        self.ddp: Optional[torch.nn.Module] = None
        self._buffers = BufferSnapshots()
        self._shards = ShardedTensorCache()  # the last save's ShardedTensors, for the next

    @property
    def local_ckpt_manager(self) -> Any:
        """The local manager (made by the factory given, on first use)."""
        if self._manager is None:
            self._adopt(self._manager_factory())
        if self._ours:
            _check_world(self._manager)
        return self._manager

    @property
    def _ours(self) -> bool:
        return isinstance(self._manager, CheckpointManager)

    def _adopt(self, manager: Any) -> None:
        self._manager = manager
        if self._ours:
            self._hook = CheckpointHook(
                manager,
                every_n_steps=1,
                state_fn=_state_given_per_save,
                raise_on_failure=self.raise_on_failure,
            )
        elif self.raise_on_failure:
            raise ValidationError("raise_on_failure applies to resilient_ckpt's CheckpointManager only")

    # ---- save ----------------------------------------------------------------------------------

    def save_checkpoint(self, checkpoint: Dict[str, Any], path: Any, storage_options: Optional[Any] = None):
        """A save whose ``storage_options`` carry ``local_checkpoint_options`` is local; any other
        goes to the wrapped (global) CheckpointIO."""
        if storage_options is None or LOCAL_CKPT_OPTS_KEY not in storage_options:
            return self.checkpoint_io.save_checkpoint(checkpoint, path, storage_options)
        if path is not None:
            raise ValueError(f"a local checkpoint has no path (it goes to the local manager), got {path!r}")
        return self._save_local_checkpoint(checkpoint, storage_options[LOCAL_CKPT_OPTS_KEY])

    def _save_local_checkpoint(self, checkpoint: Dict[str, Any], local_ckpt_options: Dict[str, Any]):
        iteration = local_ckpt_options["iteration"]
        is_async = local_ckpt_options.get("is_async", self.async_save)
        manager = self.local_ckpt_manager  # made now if a factory was given
        state = self.to_tensor_aware_state_dict(checkpoint)
        if not self._ours:
            return manager.save(state, iteration, is_async=is_async)
        # CheckpointHook: failures warned and counted (or raised), the latest save fenced on demand
        handle = self._hook.step(iteration, state_fn=lambda: state)
        if handle is not None and not is_async:
            self._hook.finish()
        return handle

    def fence(self) -> None:
        """Order later mutations of saved tensors after the latest save's copies (CPU tensors: wait
        for them; CUDA: the current stream waits, the CPU does not). Our manager only."""
        if self._hook is not None:
            self._hook.fence()

    def finish(self) -> None:
        """Wait for outstanding local saves; report failures (warning, or raise)."""
        if self._hook is not None:
            self._hook.finish()

    @property
    def saved_iterations(self) -> List[int]:
        """Iterations of the local saves started so far, failed ones included (our manager)."""
        return list(self._hook.saved_steps) if self._hook is not None else []

    @property
    def failed_saves(self) -> int:
        """Local saves that failed so far (our manager)."""
        return self._hook.failed_saves if self._hook is not None else 0

    def teardown(self) -> None:
        self.finish()
        if self.checkpoint_io is not None:
            self.checkpoint_io.teardown()

    # ---- load ----------------------------------------------------------------------------------

    def local_resume_entry(self, global_candidates: Set[str]) -> Optional[str]:
        """The entry ``LocalCheckpointCallback`` lists for ckpt_path="last": a ``memory://`` name
        (nothing written) when the local checkpoint's iteration is at least the newest global
        candidate's; None otherwise. Collective (``find_latest``)."""
        global_path = _newest(global_candidates)
        local_it = self.local_ckpt_manager.find_latest()
        if local_it < 0:
            return None
        global_it = self.get_global_ckpt_iteration_fn(global_path) if global_path is not None else -1
        if local_it < global_it:
            return None
        session = getattr(self.local_ckpt_manager, "session_id", "local")
        marker = f"{LOCAL_MARKER_PREFIX}{session}/iteration-{local_it}"
        get_filesystem(marker).pipe(marker, b"")  # Lightning checks that a candidate exists
        self._markers[marker] = global_path
        return marker

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None, **kwargs: Any) -> Dict[str, Any]:
        """The newer of the local checkpoint (if any) and the global one at ``path``; the local one
        when its iteration is at least the global one's. Collective."""
        local_entry = isinstance(path, str) and path.startswith(LOCAL_MARKER_PREFIX)
        global_path = self._markers.get(path) if local_entry else path
        local_it = self.local_ckpt_manager.find_latest()
        if local_it < 0:
            if global_path is None:
                raise CheckpointingException(
                    "the local checkpoint chosen for ckpt_path='last' is no longer complete on every "
                    "rank and no global checkpoint exists; start the job again (or pass ckpt_path=None "
                    "to start over)"
                )
            logger.info("No local checkpoint available. Resuming from a global checkpoint: %s", global_path)
            return self.checkpoint_io.load_checkpoint(global_path, map_location=map_location, **kwargs)
        global_it = self.get_global_ckpt_iteration_fn(global_path) if global_path is not None else -1
        if local_it >= global_it:
            logger.info(
                "Local checkpoint iteration %d is at least the global one (%s). Resuming from a local checkpoint",
                local_it,
                global_it if global_path is not None else "no global checkpoint",
            )
            return self._load_local(**kwargs)
        logger.warning(
            "Found a local checkpoint of iteration %d, but global iteration %d is greater. Resuming from "
            "a global checkpoint: %s",
            local_it,
            global_it,
            global_path,
        )
        return self.checkpoint_io.load_checkpoint(global_path, map_location=map_location, **kwargs)

    def _load_local(self, **kwargs: Any) -> Dict[str, Any]:
        kwargs = _accepted(self.from_tensor_aware_state_dict, kwargs)
        if not self._ours:
            state, ckpt_id = self.local_ckpt_manager.load()
            logger.debug("loaded local checkpoint %s", ckpt_id)
            return self.from_tensor_aware_state_dict(state, **kwargs)
        result = self.local_ckpt_manager.load_local()
        if result is None:
            raise CheckpointingException(
                "the local checkpoint found a moment ago could not be restored on every rank (see the "
                "warnings above); start the job again to resume from the global checkpoint"
            )
        state, iteration = result
        per_rank = state.get("per_rank") if isinstance(state, dict) else None
        checkpoint = self.from_tensor_aware_state_dict(state, **kwargs)
        m = self.local_ckpt_manager.last_load_metrics
        facts: Dict[str, Any] = {
            "iteration": iteration,
            "source": getattr(m, "source", "local"),
            "session": self.local_ckpt_manager.session_id,
            "metrics": m,
        }
        if isinstance(per_rank, dict):
            facts.update((k, per_rank[k]) for k in ("rng", "ddp_buckets") if k in per_rank)
        checkpoint[LOCAL_RESTORE_KEY] = facts
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Global checkpoints only: the local manager retires its own."""
        return self.checkpoint_io.remove_checkpoint(path)

    @classmethod
    def get_partial_wrapper_constructor(
        cls, local_ckpt_manager: Any, get_global_ckpt_iteration_fn: Callable[[Any], int], **kwargs: Any
    ) -> Callable[[CheckpointIO], "HierarchicalCheckpointIO"]:
        """Every argument but the wrapped CheckpointIO (upstream's helper)."""

        def make(wrapped: CheckpointIO) -> "HierarchicalCheckpointIO":
            return cls(
                wrapped,
                local_ckpt_manager=local_ckpt_manager,
                get_global_ckpt_iteration_fn=get_global_ckpt_iteration_fn,
                **kwargs,
            )

        return make

    # ---- Lightning's checkpoint dict <-> what the manager stores ----------------------------------

    def to_tensor_aware_state_dict(self, checkpoint: Dict[str, Any]) -> Any:
        """What the local manager saves. Ours: model and optimizer tensors as data-parallel
        replicated shards, the rest and this rank's RNG states as a per-rank object."""
        if not self._ours:
            raise NotImplementedError(
                f"{type(self.local_ckpt_manager).__name__} is not resilient_ckpt's CheckpointManager: "
                "implement to_tensor_aware_state_dict/from_tensor_aware_state_dict in a subclass "
                "(as nvidia-resiliency-ext requires), or pass a resilient_ckpt CheckpointManager"
            )
        return lightning_to_sharded(checkpoint, self.rank_local, self._buffers, self.ddp, self._shards)

    def from_tensor_aware_state_dict(self, tensor_aware_checkpoint: Any, **kwargs: Any) -> Dict[str, Any]:
        """Lightning's checkpoint dict from what ``load_local`` restored."""
        if not self._ours:
            raise NotImplementedError(
                "implement from_tensor_aware_state_dict in a subclass for a manager that is not "
                "resilient_ckpt's CheckpointManager"
            )
        return sharded_to_lightning(tensor_aware_checkpoint)


def _is_manager(obj: Any) -> bool:
    return all(hasattr(obj, name) for name in ("find_latest", "load", "save"))


def _check_world(manager: CheckpointManager) -> None:
    check_world(
        manager,
        "Lightning initializes it inside fit()). Pass HierarchicalCheckpointIO a function that makes the "
        "manager, e.g. HierarchicalCheckpointIO(None, lambda: CheckpointManager(session_id=...), fn): it is "
        "called on first use, after the process group exists",
    )


def _state_given_per_save():
    raise AssertionError("HierarchicalCheckpointIO passes each save's state to CheckpointHook.step")


def _accepted(fn: Callable[..., Any], kwargs: Dict[str, Any]) -> Dict[str, Any]:
    """The keyword arguments ``fn`` takes: Lightning passes ``weights_only`` (2.5+) to
    ``load_checkpoint``, which upstream forwards to subclasses written without it."""
    params = inspect.signature(fn).parameters.values()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return kwargs
    names = {p.name for p in params}
    return {k: v for k, v in kwargs.items() if k in names}


def _dp_rank_world() -> Tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def lightning_to_sharded(
    checkpoint: Dict[str, Any],
    rank_local: Set[str] = frozenset(),
    snapshots: Optional[BufferSnapshots] = None,
    ddp: Optional[torch.nn.Module] = None,
    cache: Optional[ShardedTensorCache] = None,
) -> Dict[str, Any]:
    """Lightning's checkpoint dict as a sharded state dict (see the module docstring):
    ``rank_local`` names the module's buffers (copied into ``snapshots``), ``ddp`` the DDP
    module whose bucket layout is kept; ``cache`` gives the same tensors the ShardedTensors of
    the save before (Lightning detaches every tensor again at each save)."""
    rank, world = _dp_rank_world()
    out: Dict[str, Any] = {}
    model = checkpoint.get("state_dict")
    optimizers = checkpoint.get("optimizer_states")
    cache = cache if cache is not None else ShardedTensorCache()
    with paused_gc():  # a ShardedTensor per tensor, none of them garbage (see gc_pause)
        if model is not None:
            out["state_dict"] = model_sharded(
                model, "state_dict", rank, rank_local, snapshots or BufferSnapshots(), cache
            )
        if optimizers is not None:
            out["optimizer_states"] = [
                _optimizer_sharded(i, osd, rank, cache) for i, osd in enumerate(optimizers)
            ]
        cache.end()
    rest = {k: v for k, v in checkpoint.items() if k not in _REPLICATED}
    per_rank: Dict[str, Any] = {"checkpoint": rest, "rng": capture_rng_state()}
    if ddp is not None:
        per_rank["ddp_buckets"] = bucket_layout(ddp)
    out["per_rank"] = ShardedObject("lightning.per_rank", per_rank, (world,), (rank,))
    return out


def _optimizer_sharded(i: int, osd: Dict[str, Any], rank: int, cache: ShardedTensorCache) -> Dict[str, Any]:
    state = {
        idx: {
            k: cache.get(f"optimizer_states.{i}.state.{idx}.{k}", v, rank)
            if isinstance(v, torch.Tensor)
            else v
            for k, v in values.items()
        }
        for idx, values in osd.get("state", {}).items()
    }
    return {**{k: v for k, v in osd.items() if k != "state"}, "state": state}


def sharded_to_lightning(state: Dict[str, Any]) -> Dict[str, Any]:
    """Lightning's checkpoint dict from a restored :func:`lightning_to_sharded` layout."""
    per_rank = state.get("per_rank")
    if not isinstance(per_rank, dict) or "checkpoint" not in per_rank:
        raise CheckpointingException(
            "the local checkpoint was not saved by resilient_ckpt.integrations.lightning (no per-rank "
            "Lightning state in it): was the session id reused by another program?"
        )
    checkpoint = dict(per_rank["checkpoint"])
    for key in _REPLICATED:
        if key in state:
            checkpoint[key] = state[key]
    return checkpoint
