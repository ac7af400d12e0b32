"""resilient_ckpt: fault-tolerant in-memory local checkpoints for distributed PyTorch."""

from __future__ import annotations

import warnings as _warnings

# torch warns at import when nvidia-resiliency-ext's pynvml dependency is present; it is noise
# for our users (we never call NVML).
_warnings.filterwarnings("ignore", message="The pynvml package is deprecated")

from .errors import CheckpointingException  # noqa: E402
from .model.mapping import LocalNonpersistentObject, ShardedObject, ShardedTensor, is_main_replica  # noqa: E402
from .model.validation import StrictHandling  # noqa: E402
from .version import __version__ as __version__  # noqa: E402  (re-exported)

_LAZY = {
    "MCoreTensorAwareStateDict": ".parallel.tensor_aware_state_dict",
    "CheckpointManager": ".manager.checkpoint_manager",
    "LocalCheckpointManager": ".manager.local_checkpoint_manager",
    "MemoryStorageReader": ".dcp.reader",
    "MemoryStorageWriter": ".dcp.writer",
    "SaveHandle": ".manager.checkpoint_manager",
    "CheckpointHook": ".manager.hooks",
    "TrainState": ".model.torch_state",
}


def __getattr__(name):
    # Heavy modules (torch.distributed, nvidia-resiliency-ext) load on first use only, so
    # `import resilient_ckpt` stays cheap for the CLI and for forked workers.
    if name in _LAZY:
        import importlib

        mod = importlib.import_module(_LAZY[name], __name__)
        return getattr(mod, name)
    raise AttributeError(f"module 'resilient_ckpt' has no attribute {name!r}")


__all__ = [
    "CheckpointHook",
    "CheckpointManager",
    "CheckpointingException",
    "LocalCheckpointManager",
    "LocalNonpersistentObject",
    "MCoreTensorAwareStateDict",
    "MemoryStorageReader",
    "MemoryStorageWriter",
    "SaveHandle",
    "ShardedObject",
    "ShardedTensor",
    "StrictHandling",
    "TrainState",
    "is_main_replica",
]
