"""Plain PyTorch (DDP, FSDP2) training state as a sharded state dict — no Megatron needed.

``TrainState(model, optimizer, lr_scheduler, extra)`` builds the sharded state dict the
manager saves and applies a restored one back, so a user never sees a ShardedTensor:

- plain tensors (DDP: identical on every data-parallel rank) become replicated shards with
  ``replica_id = dp rank``; the fully-parallel distribution then saves each once;
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

from ..bits import copy_bits
from ..errors import ValidationError
from .mapping import ShardedObject, ShardedTensor


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


def to_sharded_tensor(key: str, t: torch.Tensor, dp_rank: int = 0) -> ShardedTensor:
    """A ShardedTensor for a plain tensor (replicated over data parallel) or a DTensor."""
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
    return ShardedTensor.from_rank_offsets(key, t, replica_id=dp_rank)


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
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: Optional[torch.optim.Optimizer] = None,
        lr_scheduler: Any = None,
        extra: Optional[Dict[str, Any]] = None,
        dp_group: Optional[dist.ProcessGroup] = None,
        rng: bool = True,
    ):
        self.model = model
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.extra = extra if extra is not None else {}
        self.dp_group = dp_group
        self.rng = rng

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
        out: Dict[str, Any] = {
            "model": {
                name: to_sharded_tensor(f"model.{name}", t, dp_rank)
                for name, t in self.model.state_dict().items()
                if isinstance(t, torch.Tensor)
            }
        }
        if self.optimizer is not None:
            out["optimizer"] = self._optimizer_sharded(dp_rank)
        if self.lr_scheduler is not None:
            out["lr_scheduler"] = self.lr_scheduler.state_dict()
        per_rank: Dict[str, Any] = {"extra": dict(self.extra)}
        if self.rng:
            per_rank["rng"] = capture_rng_state()
        out["per_rank"] = ShardedObject("per_rank", per_rank, (world,), (rank,))
        return out

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
        if self.rng and "rng" in per_rank:
            restore_rng_state(per_rank["rng"])

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
