"""DDP's gradient buckets kept across a restart (resilient_ckpt.model.ddp_buckets): what a save
records, what a restore gives back, and what it says when it cannot (the zoo checks the
bit-exact outcome with 4 ranks; here each branch on 2 real gloo ranks)."""

from __future__ import annotations

import pytest

from harness import run_ranks

pytestmark = pytest.mark.multiprocess


def _outcomes(ctx):
    import torch
    from torch.nn.parallel import DistributedDataParallel as DDP

    from resilient_ckpt.model.ddp_buckets import apply_bucket_layout, bucket_layout

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.LayerNorm(8), torch.nn.Linear(8, 2))

    def step(ddp, i):
        g = torch.Generator().manual_seed(10 * i + ctx.rank)
        ddp(torch.randn(3, 4, generator=g)).sum().backward()

    out = {}
    first = DDP(model())
    out["fresh"] = bucket_layout(first)  # nothing rebuilt yet: the initial layout
    for i in range(3):
        step(first, i)
    recorded = bucket_layout(first)
    out["recorded"] = recorded

    again = DDP(model())
    got = apply_bucket_layout(again, recorded)
    out["applied"] = (got.applied, str(got))
    out["kept"] = bucket_layout(again)  # what the next save records before DDP rebuilds
    step(again, 0)
    out["grads"] = [p.grad.flatten().tolist() for p in again.parameters()]  # (tensors would be shared fds)

    wrong = apply_bucket_layout(DDP(model()), [[0, 1]])
    out["wrong"] = (wrong.applied, str(wrong))
    none = apply_bucket_layout(DDP(model()), None)
    out["none"] = (none.applied, str(none))
    unused = apply_bucket_layout(DDP(model(), find_unused_parameters=True), recorded)
    out["unused"] = (unused.applied, str(unused))
    return out


def test_a_restored_ddp_module_gets_the_recorded_buckets_and_says_why_when_it_cannot(tmp_root):
    r0, r1 = run_ranks(_outcomes, 2, tmp_root)
    assert r0["fresh"] is None
    recorded = r0["recorded"]
    assert recorded == r1["recorded"] and sorted(i for b in recorded for i in b) == list(range(6))
    assert r0["applied"][0] and r1["applied"][0], r0["applied"]
    assert r0["kept"] == recorded  # the next save keeps it before DDP rebuilds again
    for r in (r0, r1):
        assert not r["wrong"][0] and "does not cover this model's 6 parameters" in r["wrong"][1]
        assert not r["none"][0] and "before DDP rebuilt" in r["none"][1]
        assert not r["unused"][0] and "find_unused_parameters=True" in r["unused"][1]
    # the reducer built from the layout all-reduces: both ranks hold the same averaged gradients
    assert r0["grads"] == r1["grads"]
