"""What every framework integration checks of the manager it is handed."""

from __future__ import annotations

import torch.distributed as dist

from ..errors import ValidationError
from ..manager.checkpoint_manager import CheckpointManager


def check_world(manager: CheckpointManager, when_and_fix: str) -> None:
    """Raise when ``manager`` was made for another world size than the job's: it was constructed
    before the framework initialized torch.distributed. ``when_and_fix``: where the framework
    initializes it, and how to construct the manager after that."""
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() != manager.world_size:
        raise ValidationError(
            f"the CheckpointManager was constructed for {manager.world_size} process(es) but the job has "
            f"{dist.get_world_size()}: it was made before torch.distributed was initialized ({when_and_fix}"
        )
