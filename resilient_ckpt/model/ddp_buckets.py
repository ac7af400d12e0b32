"""DDP's gradient buckets, kept across a restart so the first step after it sums as before.

``DistributedDataParallel`` (with ``find_unused_parameters=False``, its default, or
``static_graph``) starts every process with all parameters in one bucket, in model order, and
after the process's first backward rebuilds its buckets in the order the gradients became
ready (a 1 MiB first bucket, then ``bucket_cap_mb``). Where an element sits in its bucket
decides the order in which the all-reduce adds the ranks' values: with three or more ranks
``(a + b) + c`` and ``a + (b + c)`` differ in the last bits, so the first step of a restarted
process — the only one on the initial layout — drifts from the uninterrupted run (with two
ranks ``a + b == b + a``). ``find_unused_parameters=True`` never rebuilds: nothing to keep.

:func:`bucket_layout` reads the layout the next step will use (DDP's own record of its rebuilt
buckets, or the one :func:`apply_bucket_layout` gave it); a checkpoint keeps it per rank.
:func:`apply_bucket_layout` gives a DDP module that layout before its first step by building
its reducer again with those buckets, through DDP's own constructor path
(``_ddp_init_helper``, as DDP's ``__setstate__`` does). Every rank of the module's process
group must call it (one all-reduce checks that all apply the same layout, or none does).
These are private torch interfaces: whatever they do not offer is reported, never guessed.
"""

from __future__ import annotations

import logging
import zlib
from dataclasses import dataclass
from typing import Any, List, Optional

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

#: the layout this module gave a DDP module (what its next step uses until DDP rebuilds)
_APPLIED = "_resilient_ckpt_bucket_layout"

BucketLayout = List[List[int]]


def find_ddp(module: Any) -> Optional[torch.nn.Module]:
    """The ``DistributedDataParallel`` module ``module`` is or wraps (``torch.compile``'s
    ``OptimizedModule`` around it included), else None."""
    from torch.nn.parallel import DistributedDataParallel

    for m in (module, getattr(module, "_orig_mod", None)):
        if isinstance(m, DistributedDataParallel):
            return m
    return None


def rebuilds_buckets(ddp: torch.nn.Module) -> bool:
    """Whether DDP rebuilds this module's buckets after its first backward."""
    return bool(getattr(ddp, "static_graph", False)) or not getattr(ddp, "find_unused_parameters", True)


def bucket_layout(ddp: torch.nn.Module) -> Optional[BucketLayout]:
    """Per bucket, the parameter indices (reducer order) the next step reduces with; None
    where that is DDP's initial layout (what a new process has anyway), or unknown."""
    if getattr(ddp, "_has_rebuilt_buckets", False):
        layout = _logged_layout(ddp)
        if layout is None and getattr(ddp, "logger", None) is not None:
            # DDP records the rebuilt layout at the next sampled forward; a save right after
            # the rebuilding step asks for that record now (a sync of that step's events on CUDA)
            ddp.logger.set_runtime_stats_and_log()
            layout = _logged_layout(ddp)
        return layout
    return getattr(ddp, _APPLIED, None)


def _logged_layout(ddp) -> Optional[BucketLayout]:
    text = ddp._get_ddp_logging_data().get("rebuilt_per_bucket_param_indices")
    if not text:
        return None
    return [[int(i) for i in bucket.split()] for bucket in str(text).split(",")]


@dataclass(frozen=True)
class BucketOutcome:
    """What a restore did about the DDP buckets (said in the resume log line)."""

    applied: bool
    reason: str

    def __str__(self) -> str:
        return self.reason


def apply_bucket_layout(ddp: torch.nn.Module, layout: Optional[BucketLayout]) -> BucketOutcome:
    """Give ``ddp`` the buckets ``layout`` describes before its first step (collective over its
    process group: every rank applies the same layout, or none does)."""
    missing = [name for name in _PRIVATE if not hasattr(ddp, name)]
    params, expect_sparse = ddp._build_params_for_reducer() if not missing else ([], False)
    problem = _unsupported(ddp, layout, len(params), missing)
    if not _agreed(ddp, None if problem else layout):
        return BucketOutcome(False, problem or f"DDP bucket order not restored (the ranks differ): {_DRIFT}")
    old = ddp.reducer
    first_cap = getattr(dist, "_DEFAULT_FIRST_BUCKET_BYTES", ddp.bucket_bytes_cap)
    limits = [first_cap] + [ddp.bucket_bytes_cap] * (len(layout) - 1)
    # DDP reverses the assignment it computes (its buckets in backward order): hand it the
    # layout reversed, so the reducer gets it as recorded.
    given = ([list(b) for b in reversed(layout)], list(reversed(limits)))
    assign = dist._compute_bucket_assignment_by_size
    dist._compute_bucket_assignment_by_size = lambda *_args, **_kwargs: given
    try:
        old._remove_autograd_hooks()  # the new reducer's hooks replace them
        names = ddp._build_debug_param_to_name_mapping(params)
        ddp._ddp_init_helper(params, expect_sparse, names, ddp.static_graph)
    finally:
        dist._compute_bucket_assignment_by_size = assign
    if ddp.static_graph:
        ddp.reducer._set_static_graph()
        ddp.logger._set_static_graph()
    for hook, state in getattr(ddp, "_comm_hooks", ()):
        dist._register_comm_hook(ddp.reducer, state, hook)
    setattr(ddp, _APPLIED, [list(b) for b in layout])
    logger.debug("DDP reducer rebuilt with the checkpoint's buckets: %s", layout)
    return BucketOutcome(True, f"DDP gradient buckets as before the restart ({len(layout)} bucket(s))")


#: DistributedDataParallel's own (private) steps that build its reducer
_PRIVATE = ("_build_params_for_reducer", "_ddp_init_helper", "_build_debug_param_to_name_mapping")


_DRIFT = (
    "with 3 or more data-parallel ranks the first step after the resume may add gradients in another "
    "order than an uninterrupted run (last-bit differences)"
)


def _unsupported(ddp, layout: Optional[BucketLayout], n_params: int, missing: List[str]) -> Optional[str]:
    """Why this rank cannot apply ``layout`` (the whole sentence for the log), or None."""
    if not rebuilds_buckets(ddp):
        return "DDP keeps its initial buckets (find_unused_parameters=True): nothing to restore"
    if layout is None:
        return f"the checkpoint was taken before DDP rebuilt its gradient buckets: {_DRIFT}"
    why = None
    if missing:
        why = f"torch {torch.__version__} lacks DistributedDataParallel.{missing[0]}"
    elif sorted(i for b in layout for i in b) != list(range(n_params)):
        why = f"the recorded layout does not cover this model's {n_params} parameters"
    elif getattr(ddp, "mixed_precision", None) is not None:
        why = "DDP's mixed_precision option"
    elif getattr(ddp, "_use_python_reducer", False):
        why = "the Python reducer has no buckets to set"
    return None if why is None else f"DDP bucket order not restored ({why}): {_DRIFT}"


def _agreed(ddp, layout: Optional[BucketLayout]) -> bool:
    """One MAX all-reduce of (digest, -digest) on the module's own group: every rank has this
    same layout (None on any rank: no)."""
    digest = -1 if layout is None else zlib.crc32(repr(layout).encode())
    device = next(ddp.module.parameters(), torch.zeros(())).device  # NCCL: the module's GPU
    t = torch.tensor([digest, -digest], dtype=torch.int64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=ddp.process_group)
    low, high = -int(t[1]), int(t[0])
    return low == high and layout is not None
