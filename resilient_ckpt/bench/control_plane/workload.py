"""The control-plane benchmark's workload: :class:`CPWorkload`, one rank's Megatron-style sharded
state dict of N float32 tensors (:func:`tensor_numels`: their sizes), and the run's constants."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

MIB = 1 << 20
#: the issue's workload: 50k float32 tensors totalling 256 MiB per rank
BYTES_AT_50K = 256 * MIB
TENSORS_AT_BYTES = 50_000
SESSION = "cp"
FIRST_ITERATION = 100


def tensor_numels(n: int, total_bytes: Optional[int] = None) -> List[int]:
    """Element counts of ``n`` float32 tensors of varied size (each a multiple of 8) summing
    to ``total_bytes`` (default: 256 MiB x n / 50k, i.e. the 50k workload's mean size)."""
    if n < 2:
        raise ValueError("at least 2 tensors")
    total = (BYTES_AT_50K * n // TENSORS_AT_BYTES if total_bytes is None else total_bytes) // 4
    total -= total % 8
    weights = [1.0 + (i * 7919 % 97) / 24.0 for i in range(n)]  # 1x .. 5x, deterministic
    scale = total / sum(weights)
    numels = [max(8, int(w * scale) // 8 * 8) for w in weights]
    numels[-1] = max(8, total - sum(numels[:-1]))
    return numels


def _fill_value(i: int, rank: int, replicated: bool) -> float:
    return float(i % 251 + 1 + (0 if replicated else 1000 * (rank + 1)))


class CPWorkload:
    """One rank's sharded state dict of ``n`` float32 tensors (live tensors allocated once).

    Even-numbered tensors are parameters replicated over the data-parallel ranks
    (``replica_id`` = rank: one main replica), odd-numbered ones optimizer state sharded along
    axis 0 (``from_rank_offsets(key, t, (0, rank, W))``), all 2-D ``(rows, 8)``; plus one
    ShardedObject per rank and a small common part. ``flavour``: ``"ours"`` or ``"mcore"``
    (Megatron-core's mapping classes, for the reference). ``zeros``: a template.
    """

    def __init__(
        self,
        n: int,
        rank: int,
        world_size: int,
        flavour: str = "ours",
        zeros: bool = False,
        total_bytes: Optional[int] = None,
    ):
        import torch

        from ..workload import _mapping_module

        self.n, self.rank, self.world_size = n, rank, world_size
        self._m = _mapping_module(flavour)
        self.numels = tensor_numels(n, total_bytes)
        self.tensors = []
        for i, numel in enumerate(self.numels):
            t = torch.empty((numel // 8, 8), dtype=torch.float32)
            t.fill_(0.0 if zeros else _fill_value(i, rank, i % 2 == 0))
            self.tensors.append(t)

    @property
    def nbytes(self) -> int:
        return 4 * sum(self.numels)

    def sharded_state_dict(self, iteration: int = 0) -> Dict[str, Any]:
        import argparse as _ap

        m, r, w = self._m, self.rank, self.world_size
        model: Dict[str, Any] = {}
        state: Dict[str, Any] = {}
        for i, t in enumerate(self.tensors):
            if i % 2 == 0:
                model[f"t{i}"] = m.ShardedTensor.from_rank_offsets(f"decoder.{i}.weight", t, replica_id=r)
            else:
                state[f"t{i}"] = m.ShardedTensor.from_rank_offsets(f"optimizer.{i}.exp_avg", t, (0, r, w))
        return {
            "model": model,
            "optimizer": {"state": state, "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95)}]},
            "rng_state": m.ShardedObject("rng_state", {"seed": 1234 + r}, (w,), (r,), replica_id=0),
            "iteration": iteration,
            "args": _ap.Namespace(num_tensors=self.n, world_size=w),
            "checkpoint_version": 3.0,
        }

    def check(self, restored: Dict[str, Any], sample: int = 200) -> List[str]:
        """Compare a sample of restored tensors with the values saved (cheap, not exhaustive)."""
        problems = []
        step = max(1, self.n // sample)
        for i in range(0, self.n, step):
            sub = restored["model"] if i % 2 == 0 else restored["optimizer"]["state"]
            t = sub.get(f"t{i}")
            want = _fill_value(i, self.rank, i % 2 == 0)
            if t is None or tuple(t.shape) != tuple(self.tensors[i].shape) or not bool((t == want).all()):
                problems.append(f"rank {self.rank}: tensor t{i} not restored")
                if len(problems) >= 5:
                    break
        return problems
