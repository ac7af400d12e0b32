"""TrainState reuses its sharded state dict between saves exactly when that is right.

A training loop saves the same tensor objects step after step; ``TrainState`` keeps the sharded
state dict of its last build and hands it out again while the model and optimizer hold the same
tensors in the same places (issue 41: a save's state dict must cost a fraction of the copies).
Specified here, against the simplest oracle — a TrainState built afresh over the same model and
optimizer — after any sequence of what training code does to them (steps, ``.data`` swaps,
replaced submodules and buffers, new parameters, dtype changes, reloaded or extended optimizers,
hyper-parameter changes): every tensor, every shard's metadata, every common value is the
oracle's. And reuse really happens when nothing but values changed.
"""

from __future__ import annotations

import hypothesis.strategies as st
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from resilient_ckpt import TrainState
from resilient_ckpt.bits import bits
from resilient_ckpt.parallel.snapshot import snapshot_parts


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(4, 8),
        torch.nn.BatchNorm1d(8),
        torch.nn.ReLU(),
        torch.nn.Linear(8, 3),
        torch.nn.LayerNorm(3),
    )


def _step(model, opt, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    opt.zero_grad()
    model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()
    opt.step()


def _described(sd) -> tuple:
    """What a save of ``sd`` stores, tensors as their bits: structure, shard rows, common values,
    each shard's bytes, each rank-local flag."""
    parts = snapshot_parts({k: v for k, v in sd.items() if k != "per_rank"})
    data = [bits(s.data).clone() for s in parts.shards]
    local = [getattr(s, "rank_local", False) for s in parts.shards]
    return parts.skeleton, parts.rows, parts.common, data, local


def _same(a: tuple, b: tuple) -> bool:
    ska, ra, ca, da, la = a
    skb, rb, cb, db, lb = b
    return (
        ska == skb
        and ra == rb
        and repr(ca) == repr(cb)
        and la == lb
        and len(da) == len(db)
        and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(da, db))
    )


def test_unchanged_model_and_optimizer_hand_out_the_same_shards():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model, opt, rng=False)
    _step(model, opt, 0)
    first = state.sharded_state_dict()
    _step(model, opt, 1)  # values change in place: the same tensors
    second = state.sharded_state_dict()
    assert second["model"] is first["model"]
    assert second["optimizer"]["state"] is first["optimizer"]["state"]
    assert _same(_described(second), _described(TrainState(model, opt, rng=False).sharded_state_dict()))
    model[1].running_mean.add_(1.0)  # a buffer written in place: its copy is taken again
    third = state.sharded_state_dict()
    assert torch.equal(third["model"]["1.running_mean"].data, model[1].running_mean)


def test_a_module_with_a_state_dict_hook_is_built_at_every_save():
    model = _model()
    model[0]._register_state_dict_hook(lambda *a: None)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = TrainState(model, opt, rng=False)
    a = state.sharded_state_dict()
    b = state.sharded_state_dict()
    assert a["model"] is not b["model"] and _same(_described(a), _described(b))


class ReuseMatchesAFreshBuild(RuleBasedStateMachine):
    """Whatever training code does between saves, the reused state dict is a fresh build's."""

    def __init__(self):
        super().__init__()
        self.model = _model()
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.state = TrainState(self.model, self.opt, rng=False)
        self.seed = 0

    def _rebuild_optimizer(self, cls=torch.optim.AdamW):
        self.opt = cls(self.model.parameters(), lr=1e-2)
        self.state = TrainState(self.model, self.opt, rng=False)

    @rule()
    def train_step(self):
        self.seed += 1
        _step(self.model, self.opt, self.seed)

    @rule(i=st.sampled_from([0, 3]))
    def swap_data(self, i):
        layer = self.model[i]
        with torch.no_grad():
            layer.weight.data = layer.weight.data.clone() * 0.5

    @rule()
    def replace_submodule(self):
        self.model[3] = torch.nn.Linear(8, 3)
        self._rebuild_optimizer()  # an optimizer over the new parameters, as a user would

    @rule()
    def reassign_buffer(self):
        bn = self.model[1]
        bn.running_var = bn.running_var.clone() + 1.0

    @rule()
    def register_buffer(self):
        self.model[2].register_buffer(f"extra{self.seed}", torch.full((2,), float(self.seed)))

    @rule()
    def non_persistent(self):
        self.model[4].register_buffer("scratch", torch.zeros(3), persistent=False)

    @rule()
    def to_float64(self):
        self.model.to(torch.float64)
        self.model.to(torch.float32)

    @rule()
    def reload_optimizer(self):
        self.opt.load_state_dict(self.opt.state_dict())

    @rule(lr=st.floats(min_value=1e-4, max_value=1.0))
    def change_lr(self, lr):
        for g in self.opt.param_groups:
            g["lr"] = lr

    @rule()
    def sgd_with_float_state(self):
        self._rebuild_optimizer(lambda p, lr: torch.optim.SGD(p, lr=lr, momentum=0.9))

    @invariant()
    def matches_a_fresh_build(self):
        got = _described(self.state.sharded_state_dict())
        want = _described(TrainState(self.model, self.opt, rng=False).sharded_state_dict())
        assert _same(got, want)


ReuseMatchesAFreshBuild.TestCase.settings = settings(
    max_examples=40, stateful_step_count=12, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
test_reuse_matches_a_fresh_build = ReuseMatchesAFreshBuild.TestCase
