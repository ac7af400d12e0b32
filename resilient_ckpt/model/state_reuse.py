"""Telling, without making them again, that a model's and an optimizer's state dicts are
unchanged in structure: the same tensors in the same places (their values may have changed).

A training loop saves the same tensor objects step after step, updated in place. Building
their sharded state dict again costs microseconds per tensor (``module.state_dict()`` alone
~2 us, a ShardedTensor ~16 us): at 50,000 tensors more than the save's copies. Instead
``TrainState`` keeps the sharded state dict of its first save and, before each later one, asks
the watches below whether the state it was made of is still what the module and optimizer
hold: every tensor the same object at the same storage (``Tensor.data_ptr``: a ``.data`` swap,
``module.to()``, a re-allocation move it), every container the same size, every submodule the
same object. The checks run over flat lists at C speed (``map`` over ``dict.get`` and
``operator.is_``); anything they cannot vouch for — a state dict hook, an overridden
``state_dict``/``_save_to_state_dict``, extra state, an optimizer's own ``state_dict`` — makes
the watch refuse (``of`` returns None) and the state dict is built at every save, as before.
"""

from __future__ import annotations

import operator
from itertools import chain
from typing import Any, Dict, List, Optional, Sequence

import torch

_BASE_MODULE = torch.nn.Module
_BASE_OPTIMIZER = torch.optim.Optimizer


def _plain_module(m: torch.nn.Module) -> bool:
    """``m.state_dict()`` is the base class's over its own parameters and buffers."""
    t = type(m)
    return (
        t.state_dict is _BASE_MODULE.state_dict
        and t._save_to_state_dict is _BASE_MODULE._save_to_state_dict
        and t.get_extra_state is _BASE_MODULE.get_extra_state
        and not m._state_dict_hooks
        and not m._state_dict_pre_hooks
    )


class _Watch:
    """What must not have changed: containers keep their sizes, dict entries and sequences
    keep their objects (identity), tensors keep their storage addresses."""

    def __init__(self) -> None:
        self.containers: List[Any] = []
        self.sizes: List[int] = []
        self.owners: List[dict] = []
        self.names: List[Any] = []
        self.objects: List[Any] = []
        self.sequences: List[Any] = []
        self.items: List[Any] = []  # every sequence's objects, one after the other
        self.tensors: List[torch.Tensor] = []
        self.addresses: List[int] = []

    def container(self, c: Any) -> None:
        self.containers.append(c)
        self.sizes.append(len(c))

    def entry(self, owner: dict, name: Any, obj: Any) -> None:
        self.owners.append(owner)
        self.names.append(name)
        self.objects.append(obj)

    def sequence(self, seq: Any) -> None:
        """``seq`` (a list, or a live view of a dict's keys or values) must keep its length and
        hold the same objects in order."""
        self.container(seq)
        self.sequences.append(seq)
        self.items.extend(seq)

    def tensor(self, t: torch.Tensor) -> None:
        self.tensors.append(t)

    def seal(self) -> None:
        """Note the tensors' addresses (after the last :meth:`tensor`)."""
        self.addresses = list(map(_DATA_PTR, self.tensors))

    def unchanged(self) -> bool:
        # Each test over flat lists at C speed: map over dict.get, operator.is_, len.
        return (
            list(map(len, self.containers)) == self.sizes
            and all(map(operator.is_, map(dict.get, self.owners, self.names), self.objects))
            and all(map(operator.is_, chain.from_iterable(self.sequences), self.items))
            and list(map(_DATA_PTR, self.tensors)) == self.addresses
        )


_DATA_PTR = torch.Tensor.data_ptr


class ModuleWatch(_Watch):
    """Whether ``module.state_dict()`` would still give the tensors it gave."""

    @classmethod
    def of(cls, module: torch.nn.Module, state: Dict[str, torch.Tensor]) -> Optional["ModuleWatch"]:
        """A watch of ``module`` whose state dict's tensors are ``state`` (its tensor entries,
        as ``state_dict()`` gave them, in order); None if it cannot vouch for them."""
        w = cls()
        keys: List[str] = []
        for prefix, m in module.named_modules(remove_duplicate=False):
            if not _plain_module(m):
                return None
            p = prefix + "." if prefix else ""
            attrs = vars(m)  # the containers themselves may be replaced, not only changed
            for name in ("_parameters", "_buffers", "_modules", "_non_persistent_buffers_set"):
                w.entry(attrs, name, attrs[name])
            w.container(m._non_persistent_buffers_set)
            w.sequence(m._modules.values())
            for held in (m._parameters, m._buffers):
                w.sequence(held.values())
                for name, t in held.items():
                    if t is not None and (held is m._parameters or name not in m._non_persistent_buffers_set):
                        keys.append(p + name)
                        w.tensor(t)
        try:
            w.seal()
            same = keys == list(state) and list(map(_DATA_PTR, state.values())) == w.addresses
        except RuntimeError:  # a tensor without storage (a DTensor, a fake tensor)
            return None
        if not same:
            return None  # not the state dict this walk explains: build it every time
        return w


class OptimizerWatch(_Watch):
    """Whether ``optimizer.state_dict()`` would still hold the same parameters in the same
    groups and the same state tensors; its other values (hyper-parameters, non-tensor state)
    are read again at each save (:meth:`values`)."""

    def __init__(self) -> None:
        super().__init__()
        #: (state dict, key, parameter) of every non-tensor state value, read at each save
        self.value_owners: List[dict] = []
        self.value_keys: List[Any] = []
        self.value_params: List[torch.Tensor] = []

    @classmethod
    def of(cls, optimizer: torch.optim.Optimizer) -> Optional["OptimizerWatch"]:
        t = type(optimizer)
        if t.state_dict is not _BASE_OPTIMIZER.state_dict or any(
            getattr(optimizer, h, None)
            for h in ("_optimizer_state_dict_pre_hooks", "_optimizer_state_dict_post_hooks")
        ):
            return None
        w = cls()
        groups = optimizer.param_groups
        state = optimizer.state
        attrs = vars(optimizer)  # load_state_dict replaces both
        w.entry(attrs, "param_groups", groups)
        w.entry(attrs, "state", state)
        w.sequence(groups)
        # Keyed by parameter: compared as its keys and values in order (no tensor hashing).
        w.container(state)
        w.sequence(state.keys())
        w.sequence(state.values())
        for g in groups:
            params = g["params"]
            w.entry(g, "params", params)
            w.container(params)
            w.sequence(params)
        for p, per in state.items():
            w.container(per)
            for k, v in per.items():
                if isinstance(v, torch.Tensor):
                    w.entry(per, k, v)
                    w.tensor(v)
                else:
                    w.value_owners.append(per)
                    w.value_keys.append(k)
                    w.value_params.append(p)
        try:
            w.seal()
        except RuntimeError:  # a state tensor without storage
            return None
        return w

    def values(self) -> List[Any]:
        """The non-tensor state values now, in the order they were found."""
        return list(map(dict.get, self.value_owners, self.value_keys))


def group_entries(optimizer: torch.optim.Optimizer, names: Sequence[List[str]]) -> List[Dict[str, Any]]:
    """The optimizer's param groups as its ``state_dict()`` gives them, with parameter names
    (``names``: per group) in place of its indexes: hyper-parameters read now."""
    out = []
    for g, n in zip(optimizer.param_groups, names):
        e = {k: v for k, v in g.items() if k != "params"}
        e["params"] = list(n)
        out.append(e)
    return out
