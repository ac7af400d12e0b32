"""resilient_ckpt: fault-tolerant in-memory local checkpoints for distributed PyTorch."""

from __future__ import annotations

import warnings as _warnings

# torch warns at import when nvidia-resiliency-ext's pynvml dependency is present; it is noise
# for our users (we never call NVML).
_warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

from .errors import CheckpointingException  # noqa: E402
from .mapping import (  # noqa: E402
    LocalNonpersistentObject,
    ShardedObject,
    ShardedTensor,
    is_main_replica,
)

__version__ = "0.1.0"

__all__ = [
    "CheckpointingException",
    "LocalNonpersistentObject",
    "ShardedObject",
    "ShardedTensor",
    "is_main_replica",
]
