"""Plain PyTorch (DDP, FSDP2) training state as a sharded state dict — no Megatron needed.

``TrainState(model, optimizer, lr_scheduler, extra)`` builds the sharded state dict the
manager saves and applies a restored one back, so a user never sees a ShardedTensor:

- plain parameters (DDP: identical on every data-parallel rank) become replicated shards with
  ``replica_id = dp rank``; the fully-parallel distribution then saves each once;
- buffers are each rank's own (BatchNorm statistics come from the rank's batch; DDP copies
  rank 0's over the others only at the next forward, never with ``broadcast_buffers=False``):
  rank-local shards, saved by every rank and restored to it. They are copied when the state
  dict is made (small; on CUDA on the current stream): the next forward writes them in place
  while the save's copies may still be reading;
- DDP's rebuilt gradient buckets (:mod:`.ddp_buckets`) are kept per rank and given to the
  restarted job's DDP module, so its first step adds gradients in the same order;
- DTensors (FSDP2 and friends) become shards at the offsets their placements give;
  replicated mesh dimensions become the replica id;
- optimizer state is keyed by parameter *name* (stable across restarts, unlike torch's
  integer ids), its tensors sharded like their parameter;
- shard keys are the dotted paths torch.distributed.checkpoint gives the same nested dict
  (``model.<param>``, ``optimizer.state.<param>.<state>``), so a flushed checkpoint loads with
  plain ``dcp.load({"model": model.state_dict()}, ...)``;
- per-rank state (torch/CUDA/numpy/python RNG states, the user's ``extra`` such as a
  dataloader position) is a ShardedObject per rank; scheduler state and optimizer
  hyper-parameters are common state.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Dict, List, Optional, Tuple

import numpy as np
import torch
import torch.distributed as dist

from ..bits import bits, copy_bits, foreach_copy_views
from ..errors import ValidationError
from ..gc_pause import paused_gc
from .ddp_buckets import BucketOutcome, apply_bucket_layout, bucket_layout, find_ddp
from .mapping import ShardedObject, ShardedTensor
from .state_reuse import ModuleWatch, OptimizerWatch, group_entries


def _dtensor_class():
    """DTensor, if its module is loaded — else no tensor can be one.

    Importing ``torch.distributed.tensor`` costs about a second per process, paid on every
    restart by DDP-only jobs that never use it; FSDP2 / tensor parallelism load it themselves.
    """
    mod = sys.modules.get("torch.distributed.tensor")  # torch >= 2.4 public location
    return getattr(mod, "DTensor", None)


def _dp_rank_and_size(group) -> Tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def is_dtensor(t: Any) -> bool:
    cls = _dtensor_class()
    return cls is not None and isinstance(t, cls)


def to_sharded_tensor(key: str, t: torch.Tensor, dp_rank: int = 0, rank_local: bool = False) -> ShardedTensor:
    """A ShardedTensor for a plain tensor (replicated over data parallel; ``rank_local``: each
    rank's value its own, see ``ShardedTensor``) or a DTensor."""
    t = t.detach()
    if is_dtensor(t):
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        local = t.to_local()
        placements = t.placements
        if any(p.is_partial() for p in placements):
            raise ValidationError(
                f"{key!r}: DTensor with a Partial placement cannot be checkpointed; reduce it "
                "(redistribute to Replicate or Shard) first"
            )
        _shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, placements)
        coords = t.device_mesh.get_coordinate() or []
        replica = tuple(c for c, p in zip(coords, placements) if p.is_replicate())
        return ShardedTensor(
            key,
            local,
            local.dtype,
            tuple(local.shape),
            tuple(t.shape),
            tuple(offset),
            None,  # FSDP2 chunks may be uneven: describe the grid by offsets only
            replica or 0,
        )
    st = ShardedTensor.from_rank_offsets(key, t, replica_id=dp_rank)
    st.rank_local = rank_local
    return st


def buffer_names(module: torch.nn.Module) -> set:
    """The names ``module.state_dict()`` gives its buffers (tied and shared ones under every name)."""
    return {name for name, _ in module.named_buffers(remove_duplicate=False)}


class BufferSnapshots:
    """Copies of a module's buffers made when a save's state dict is made, kept from one save to
    the next (the same tensors: refilled, not reallocated). The next forward may write buffers in
    place (BatchNorm statistics, DDP's broadcast of rank 0's) while the save's copies still read
    them; its copies read these instead. Refilling happens after the previous save was fenced
    (before the optimizer step), so its copies are done with them."""

    def __init__(self):
        self._copies: Dict[str, torch.Tensor] = {}
        self._views: Tuple[List[torch.Tensor], List[torch.Tensor]] = ([], [])

    def copy(self, buffers: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """Copies of ``buffers`` (name -> tensor), refilled in one fused copy (a model with
        thousands of BatchNorm layers has tens of thousands of buffers)."""
        copies: Dict[str, torch.Tensor] = {}
        for name, t in buffers.items():
            c = self._copies.get(name)
            if c is None or c.shape != t.shape or c.dtype != t.dtype or c.device != t.device:
                c = torch.empty_like(t, memory_format=torch.contiguous_format)
            copies[name] = c
        self._copies = copies
        # Integer views of both sides, kept for refill(): the same buffers at the next save.
        self._views = ([bits(c) for c in copies.values()], [bits(t.detach()) for t in buffers.values()])
        self.refill()
        return copies

    def refill(self) -> None:
        """Copy the buffers last given to :meth:`copy` into their copies again (the caller
        knows they are the same tensors: ``TrainState``'s watches)."""
        foreach_copy_views(*self._views)


class ShardedTensorCache:
    """The ShardedTensors made for the last save, by key, for a caller handed new tensor
    objects for the same tensors at every save (Lightning's checkpoint dict: ``state_dict()``
    detaches every parameter again). A tensor at the same storage address, of the same dtype,
    shape and strides as the one a key's ShardedTensor wraps gets that ShardedTensor again (its
    data aliases the same bytes; the kept one holds the storage alive, so no other tensor can
    have taken the address): building one costs ~16 us, this lookup ~1 us, and the manager's
    staging then finds the same source tensors too. Call :meth:`end` after each save's dict."""

    def __init__(self) -> None:
        self._made: Dict[str, ShardedTensor] = {}
        self._next: Dict[str, ShardedTensor] = {}

    def get(self, key: str, t: torch.Tensor, dp_rank: int = 0, rank_local: bool = False) -> ShardedTensor:
        old = self._made.get(key)
        if (
            old is not None
            and old.replica_id == dp_rank
            and old.rank_local == rank_local
            and not is_dtensor(t)
            and old.data.dtype == t.dtype
            and old.data.shape == t.shape
            and old.data.stride() == t.stride()
            and old.data.data_ptr() == t.data_ptr()
        ):
            st = old
        else:
            st = to_sharded_tensor(key, t, dp_rank, rank_local)
        self._next[key] = st
        return st

    def end(self) -> None:
        """This save's dict is made: forget the ShardedTensors it did not use."""
        self._made, self._next = self._next, {}


def model_sharded(
    state: Dict[str, Any],
    prefix: str,
    dp_rank: int,
    buffers: set,
    snapshots: BufferSnapshots,
    cache: Optional[ShardedTensorCache] = None,
) -> Dict[str, Any]:
    """A model's ``state_dict()`` as ShardedTensors keyed ``{prefix}.{name}``: parameters as
    data-parallel replicas, buffers (``buffers``: their names) rank-local, from ``snapshots``;
    through ``cache`` where the caller keeps one."""
    own = snapshots.copy(
        {n: t for n, t in state.items() if n in buffers and isinstance(t, torch.Tensor) and not is_dtensor(t)}
    )
    make = cache.get if cache is not None else to_sharded_tensor
    out: Dict[str, Any] = {}
    for name, t in state.items():
        if name in own:
            out[name] = make(f"{prefix}.{name}", own[name], dp_rank, True)
        elif isinstance(t, torch.Tensor):
            out[name] = make(f"{prefix}.{name}", t, dp_rank)
        else:
            out[name] = t
    return out


class TrainState:
    """What a plain PyTorch loop needs to resume bit-exactly, as a sharded state dict.

    Args:
        model: the module (DDP/FSDP2-wrapped or not; keys come from its ``state_dict()``).
        optimizer: a ``torch.optim.Optimizer`` over the model's parameters.
        lr_scheduler: anything with ``state_dict()/load_state_dict()``.
        extra: per-rank values to keep (dataloader position, counters): a dict of plain
            values, tensors, numpy arrays; restored into the same dict object.
        dp_group: the data-parallel group plain tensors are replicated over (default world).
        rng: save and restore torch/CUDA/numpy/python RNG states (per rank).
        stateful: per-rank objects with ``state_dict()`` / ``load_state_dict()`` (an AMP
            ``GradScaler``, a sampler), saved by name; their state dicts hold plain values.
        ddp: the ``DistributedDataParallel`` module around ``model``, when ``model`` is the
            module inside it (default: ``model`` itself if it is DDP-wrapped, or compiled DDP).

    After a restore, ``ddp_buckets`` says what became of DDP's gradient buckets (None: the
    model is not DDP-wrapped).

    Saves after the first reuse the sharded state dict they built (its ShardedTensors, the
    same objects save after save) as long as the model and optimizer hold the same tensors
    (:mod:`.state_reuse` checks it at C speed before each save; values may change): a save's
    state dict then costs a small fraction of the copies of the bytes, whatever the tensor
    count. Do not change the dict :meth:`sharded_state_dict` returns: the next save reuses it.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr_scheduler: Any = None,
        extra: Optional[Dict[str, Any]] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
        rng: bool = True,
        stateful: Optional[Dict[str, Any]] = None,
        ddp: Optional[torch.nn.Module] = None,
    ):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.extra = extra if extra is not None else {}
        self.dp_group = dp_group
        self.rng = rng
        self.stateful = dict(stateful or {})
        self.ddp = ddp if ddp is not None else find_ddp(model)
        self.ddp_buckets: Optional[BucketOutcome] = None
        self._buffers = BufferSnapshots()
        self._reuse: Optional[_Reuse] = None
        self._reusable = True  # False once the watches refused this model or optimizer
        for name, obj in self.stateful.items():
            if not (
                callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
            ):
                raise ValidationError(
                    f"stateful[{name!r}] is a {type(obj).__name__}, which has no state_dict()/load_state_dict(); "
                    "pass objects such as torch.amp.GradScaler, or put plain values in extra="
                )

    # ---- names ---------------------------------------------------------------------------------

    def _param_names(self) -> Dict[int, str]:
        return {id(p): n for n, p in self.model.named_parameters()}

    def _optimizer_param_names(self) -> List[str]:
        """Names in the order torch's optimizer state_dict numbers parameters."""
        names = self._param_names()
        out = []
        for group in self.optimizer.param_groups:
            for p in group["params"]:
                if id(p) not in names:
                    raise ValidationError(
                        "the optimizer holds a parameter that is not in the model; build "
                        "TrainState with the model the optimizer was created for"
                    )
                out.append(names[id(p)])
        return out

    # ---- save ----------------------------------------------------------------------------------

    def sharded_state_dict(self) -> Dict[str, Any]:
        dp_rank, _ = _dp_rank_and_size(self.dp_group)
        rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        # One ShardedTensor per tensor, none of them garbage: a collection meanwhile would walk
        # the trainer's whole heap, repeatedly (see gc_pause).
        with paused_gc():
            out = self._reused() or self._tensor_state(dp_rank)
        if self.lr_scheduler is not None:
            out["lr_scheduler"] = self.lr_scheduler.state_dict()
        per_rank: Dict[str, Any] = {"extra": dict(self.extra)}
        if self.stateful:
            per_rank["stateful"] = {name: obj.state_dict() for name, obj in self.stateful.items()}
        if self.rng:
            per_rank["rng"] = capture_rng_state()
        if self.ddp is not None:
            per_rank["ddp_buckets"] = bucket_layout(self.ddp)
        out["per_rank"] = ShardedObject("per_rank", per_rank, (world,), (rank,))
        return out

    def _tensor_state(self, dp_rank: int) -> Dict[str, Any]:
        """Model and optimizer as sharded state dicts, built; kept for the next save when the
        watches can vouch for them (:meth:`_reused`)."""
        model = self.model.state_dict()
        model = {k: v for k, v in model.items() if isinstance(v, torch.Tensor)}
        out: Dict[str, Any] = {
            "model": model_sharded(model, "model", dp_rank, buffer_names(self.model), self._buffers)
        }
        if self.optimizer is not None:
            out["optimizer"] = self._optimizer_sharded(dp_rank)
        if self._reusable:
            self._reuse = _Reuse.make(self.model, model, self.optimizer, out, self._param_names())
            self._reusable = self._reuse is not None
        return out

    def _reused(self) -> Optional[Dict[str, Any]]:
        """The last save's model and optimizer state, if they still describe what the model and
        optimizer hold: buffers copied again, hyper-parameters and non-tensor state read now."""
        reuse = self._reuse
        if reuse is None or not reuse.unchanged():
            self._reuse = None
            return None
        self._buffers.refill()
        return reuse.now(self.optimizer)

    def restore_template(self) -> Dict[str, Any]:
        """The sharded state dict to restore into, laid out for this job (a resharded restore
        needs one). An optimizer that has not stepped yet has no state tensors to fill: they
        are created first by one step with zero gradients at learning rate 0 (parameters and
        hyper-parameters unchanged; the restore overwrites the state)."""
        if self.optimizer is not None and not self.optimizer.state:
            _init_optimizer_state(self.optimizer)
        return self.sharded_state_dict()

    def _optimizer_sharded(self, dp_rank: int) -> Dict[str, Any]:
        sd = self.optimizer.state_dict()
        names = self._optimizer_param_names()
        state: Dict[str, Any] = {}
        for idx, values in sd["state"].items():
            pname = names[idx]
            state[pname] = {
                k: to_sharded_tensor(f"optimizer.state.{pname}.{k}", v, dp_rank)
                if isinstance(v, torch.Tensor)
                else v
                for k, v in values.items()
            }
        groups = []
        for g in sd["param_groups"]:
            g = dict(g)
            g["params"] = [names[i] for i in g["params"]]
            groups.append(g)
        return {"state": state, "param_groups": groups}

    # ---- load ----------------------------------------------------------------------------------

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Apply a restored state (``load_local``'s result) to model, optimizer, scheduler, RNG."""
        self._load_model(state.get("model", {}))
        if self.optimizer is not None and "optimizer" in state:
            self._load_optimizer(state["optimizer"])
        if self.lr_scheduler is not None and "lr_scheduler" in state:
            self.lr_scheduler.load_state_dict(state["lr_scheduler"])
        per_rank = state.get("per_rank") or {}
        if "extra" in per_rank:  # a checkpoint without it leaves the caller's dict alone
            self.extra.clear()
            self.extra.update(per_rank["extra"])
        saved = per_rank.get("stateful") or {}
        for name, obj in self.stateful.items():
            if name not in saved:
                raise ValidationError(
                    f"the checkpoint holds no state for stateful[{name!r}]; was it saved with it?"
                )
            obj.load_state_dict(saved[name])
        if self.rng and "rng" in per_rank:
            restore_rng_state(per_rank["rng"])
        if self.ddp is not None:  # collective over the DDP module's group, like the restore itself
            self.ddp_buckets = apply_bucket_layout(self.ddp, per_rank.get("ddp_buckets"))

    def _load_model(self, loaded: Dict[str, torch.Tensor]) -> None:
        targets = self.model.state_dict(keep_vars=True)
        missing = [k for k, v in targets.items() if isinstance(v, torch.Tensor) and k not in loaded]
        if missing:
            raise ValidationError(
                f"restored state lacks model entries {missing[:10]}; was it saved from this model?"
            )
        with torch.no_grad():
            for name, src in loaded.items():
                if name not in targets:
                    raise ValidationError(f"restored model entry {name!r} is not in this model")
                dst = targets[name]
                local = dst.to_local() if is_dtensor(dst) else dst
                if tuple(local.shape) != tuple(src.shape) or local.dtype != src.dtype:
                    raise ValidationError(
                        f"model entry {name!r}: restored {src.dtype} {tuple(src.shape)} does not match "
                        f"the model's {local.dtype} {tuple(local.shape)}"
                    )
                copy_bits(local, src)

    def _load_optimizer(self, loaded: Dict[str, Any]) -> None:
        names = self._optimizer_param_names()
        index = {n: i for i, n in enumerate(names)}
        params = {n: p for n, p in self.model.named_parameters()}
        state: Dict[int, Dict[str, Any]] = {}
        for pname, values in loaded.get("state", {}).items():
            if pname not in index:
                raise ValidationError(f"optimizer state for {pname!r}, which this optimizer does not hold")
            param = params[pname]
            state[index[pname]] = {k: _like_param(v, param) for k, v in values.items()}
        groups = []
        for g in loaded.get("param_groups", []):
            g = dict(g)
            g["params"] = [index[n] for n in g["params"]]
            groups.append(g)
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})


class _Reuse:
    """A TrainState's last model and optimizer sharded state dicts and the watches that tell
    whether they still hold (see :mod:`.state_reuse`)."""

    def __init__(self, module: ModuleWatch, optimizer: Optional[OptimizerWatch], out: Dict[str, Any], names):
        self.module = module
        self.optimizer = optimizer
        self.model = out["model"]
        self.optimizer_state = out.get("optimizer")
        if optimizer is not None:
            state = self.optimizer_state["state"]
            #: the output dict each non-tensor state value goes to, and per group its names
            self.value_targets = [state[names[id(p)]] for p in optimizer.value_params]
            self.group_names = [list(g["params"]) for g in self.optimizer_state["param_groups"]]

    @classmethod
    def make(cls, model, model_state, optimizer, out, names) -> Optional["_Reuse"]:
        module = ModuleWatch.of(model, model_state)
        if module is None:
            return None
        watch = None
        if optimizer is not None:
            watch = OptimizerWatch.of(optimizer)
            if watch is None:
                return None
        return cls(module, watch, out, names)

    def unchanged(self) -> bool:
        return self.module.unchanged() and (self.optimizer is None or self.optimizer.unchanged())

    def now(self, optimizer) -> Dict[str, Any]:
        out: Dict[str, Any] = {"model": self.model}
        if self.optimizer is not None:
            for target, key, value in zip(
                self.value_targets, self.optimizer.value_keys, self.optimizer.values()
            ):
                target[key] = value
            state = self.optimizer_state["state"]
            out["optimizer"] = {"state": state, "param_groups": group_entries(optimizer, self.group_names)}
        return out


def _init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    lrs = [g.get("lr") for g in optimizer.param_groups]
    grads = {}
    for g in optimizer.param_groups:
        g["lr"] = 0.0 if not isinstance(g.get("lr"), torch.Tensor) else torch.zeros_like(g["lr"])
        for p in g["params"]:
            if p.requires_grad and p.grad is None:
                grads[p] = None
                p.grad = torch.zeros_like(p)
    try:
        optimizer.step()
    finally:
        for g, lr in zip(optimizer.param_groups, lrs):
            g["lr"] = lr
        for p in grads:
            p.grad = None


def _like_param(v: Any, param: torch.Tensor) -> Any:
    """Re-wrap a restored local tensor as a DTensor when its parameter is one."""
    if not isinstance(v, torch.Tensor) or not is_dtensor(param) or v.dim() == 0:
        return v
    if tuple(v.shape) != tuple(param.to_local().shape):
        return v
    return _dtensor_class().from_local(
        v.to(param.to_local().device),
        param.device_mesh,
        param.placements,
        run_check=False,
        shape=param.shape,
        stride=param.stride(),
    )


def capture_rng_state() -> Dict[str, Any]:
    state: Dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [s for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: Dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    np.random.set_state(state["numpy"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
