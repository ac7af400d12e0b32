"""Figures for the foundation layer (mapping / distribution / exchange / tensor-aware state dict).

1. Save-distribution balance (max/mean bytes per rank, 1.0 is perfect) and assignment time,
   ours vs Megatron-core's greedy ``distribute_shards_to_ranks``, on a few layouts.
2. Wall time of one from_state_dict -> pop_tensors -> insert_tensors -> to_state_dict cycle
   with 10k shards on 2 gloo ranks (CPU), per phase, slowest rank.

Run: ``.venv/bin/python benchmarks/foundation_figures.py [--shards 10000] [--skip-cycle]``
"""

from __future__ import annotations

import argparse
import random
import sys
import time
import warnings
from pathlib import Path
from typing import Dict, List, Tuple

warnings.filterwarnings("ignore")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the shared harness

Layout = Tuple[Dict, Dict, int, set]


def gpt_like(dp: int, layers: int, hidden: int = 4096, tp: int = 1) -> Layout:
    """One DP group of a GPT model: params (bf16) and Adam states (fp32), all DP-replicated."""
    s2r, s2s = {}, {}
    per_layer = (
        ("qkv", 3 * hidden * hidden // tp),
        ("proj", hidden * hidden // tp),
        ("fc1", 4 * hidden * hidden // tp),
        ("fc2", 4 * hidden * hidden // tp),
        ("qkv_bias", 3 * hidden // tp),
        ("fc1_bias", 4 * hidden // tp),
        ("ln1", hidden),
        ("ln2", hidden),
    )
    for layer in range(layers):
        for name, numel in per_layer:
            for kind, itemsize in (("param", 2), ("main", 4), ("exp_avg", 4), ("exp_avg_sq", 4)):
                sid = (f"layers.{layer}.{name}.{kind}", (0,))
                s2r[sid], s2s[sid] = list(range(dp)), numel * itemsize
    return s2r, s2s, dp, set()


def skewed(dp: int) -> Layout:
    """A few huge replicated tensors (embeddings, output layer) and many small ones."""
    s2r, s2s = {}, {}
    for i, numel in enumerate((128_000 * 4096, 128_000 * 4096, 32_000 * 4096)):
        s2r[(f"embedding{i}", (0,))], s2s[(f"embedding{i}", (0,))] = list(range(dp)), numel * 2
    rnd = random.Random(1)
    for i in range(2_000):
        s2r[(f"small{i}", (0,))] = list(range(dp))
        s2s[(f"small{i}", (0,))] = rnd.randint(1, 1 << 19)
    return s2r, s2s, dp, set()


def random_layout(world: int, n: int, seed: int = 0) -> Layout:
    """Random log-normal sizes, each shard held by a random subset of ranks, some cross-group."""
    rnd = random.Random(seed)
    s2r, s2s, cross = {}, {}, set()
    for i in range(n):
        sid = (f"k{i % 997}", (i,))
        s2r[sid] = sorted(rnd.sample(range(world), rnd.randint(1, world)))
        s2s[sid] = int(rnd.lognormvariate(12, 2.5))
        if rnd.random() < 0.05:
            cross.add(sid)
    return s2r, s2s, world, cross


def balance_figures() -> List[str]:
    from megatron.core.dist_checkpointing.exchange_utils import distribute_shards_to_ranks

    from resilient_ckpt.parallel.distribution import assign_shards, rank_loads

    layouts = {
        "GPT-like DP=8, 96 layers": gpt_like(8, 96),
        "GPT-like DP=4, TP=2 slice, 3200 layers (102k shards)": gpt_like(4, 3200, tp=2),
        "skewed DP=4: 3 huge embeddings + 2k small": skewed(4),
        "skewed DP=8: 3 huge embeddings + 2k small": skewed(8),
        "random subsets W=8, 100k shards": random_layout(8, 100_000),
    }
    lines = [
        f"{'layout':55s} {'shards':>7s} {'ours max/mean':>14s} {'mcore max/mean':>15s}"
        f" {'ours s':>7s} {'mcore s':>8s}"
    ]
    for name, (s2r, s2s, n, cross) in layouts.items():
        t0 = time.perf_counter()
        ours = assign_shards(s2r, s2s, n, cross_group=cross)
        t_ours = time.perf_counter() - t0
        t0 = time.perf_counter()
        theirs = distribute_shards_to_ranks(s2r, s2s, n, cross)
        t_theirs = time.perf_counter() - t0

        def ratio(a, s2s=s2s, n=n):
            loads = rank_loads(a, s2s, n)
            return max(loads) / (sum(loads) / n)

        lines.append(
            f"{name:55s} {len(s2r):7d} {ratio(ours):14.6f} {ratio(theirs):15.6f}"
            f" {t_ours:7.2f} {t_theirs:8.2f}"
        )
    return lines


def _cycle_rank(ctx, n_shards: int):
    import torch

    from resilient_ckpt.model.mapping import ShardedObject, ShardedTensor
    from resilient_ckpt.parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict as TASD

    r, w = ctx.rank, ctx.world_size

    def state(empty=False):
        # Half the shards are data-parallel replicas, half are split across the ranks; 1 KiB each.
        sd = {}
        for i in range(n_shards):
            if i % 2:
                data = torch.zeros(256) if empty else torch.full((256,), float(i))
                sd[f"p{i}"] = ShardedTensor.from_rank_offsets(f"p{i}", data, replica_id=r)
            else:
                data = torch.zeros(256) if empty else torch.full((256,), float(i * w + r))
                sd[f"p{i}"] = ShardedTensor.from_rank_offsets(f"p{i}", data, (0, r, w))
        sd["rng"] = ShardedObject("rng", None if empty else {"seed": r}, (w,), (r,))
        sd["iteration"] = 1
        return sd

    times = {}
    source, template = state(), state(empty=True)
    t0 = time.perf_counter()
    tasd, distribution = TASD.from_state_dict(source)
    times["from_state_dict (first: gather + validate + distribute)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    TASD.from_state_dict(state(), cached_metadata=distribution)
    times["from_state_dict (cached distribution)"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tensors = tasd.pop_tensors()
    times["pop_tensors"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    tasd.insert_tensors(tensors)
    times["insert_tensors"] = time.perf_counter() - t0
    for algo in ("broadcast", "p2p"):
        t0 = time.perf_counter()
        tasd.to_state_dict(template, algo="fully_parallel", exchange_algo=algo)
        times[f"to_state_dict (fully_parallel, {algo})"] = time.perf_counter() - t0
    return times, len(tensors), distribution.imbalance


def cycle_figures(n_shards: int) -> List[str]:
    import tempfile

    from harness import run_ranks

    with tempfile.TemporaryDirectory() as tmp:
        out = run_ranks(_cycle_rank, 2, tmp, args=(n_shards,), timeout=600, collective_timeout=300)
    lines = [f"{n_shards} shards on 2 gloo ranks (CPU); seconds, slowest rank:"]
    for phase in out[0][0]:
        lines.append(f"  {phase:58s} {max(o[0][phase] for o in out):8.3f}")
    cycle = sum(max(o[0][p] for o in out) for p in out[0][0] if "cached" not in p and "p2p" not in p)
    lines.append(
        f"  {'cycle: first from_state_dict + pop + insert + to_state_dict (broadcast)':58s} {cycle:8.3f}"
    )
    lines.append(f"  saved shards per rank {[o[1] for o in out]}, imbalance {out[0][2]:.4f}")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", type=int, default=10_000)
    p.add_argument("--skip-cycle", action="store_true")
    args = p.parse_args()
    print("\n".join(balance_figures()))
    if not args.skip_cycle:
        print()
        print("\n".join(cycle_figures(args.shards)))


if __name__ == "__main__":
    main()
