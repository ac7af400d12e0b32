"""What MemoryStorageWriter and MemoryStorageReader share: the CheckpointManager behind them —
the one passed in (shared by the writer and the reader of a job: recommended), or one built
from the keyword arguments ``CheckpointManager`` takes (owned, closed by ``close()``) — and
the ``checkpoint_id`` DCP hands them."""

from __future__ import annotations

import os
from typing import Any, Dict, Optional, Tuple, Union

from ..errors import ValidationError
from ..manager.checkpoint_manager import CheckpointManager
from .checkpoint_id import is_iteration_id

__all__ = ["CheckpointId", "ManagerBacked", "open_manager"]

CheckpointId = Union[str, os.PathLike, int]


class ManagerBacked:
    """Mixed into the writer and the reader (before DCP's ABCs, whose abstract
    ``validate_checkpoint_id`` it implements)."""

    def _init_backing(self, manager: Optional[CheckpointManager], manager_kwargs: Dict[str, Any]) -> None:
        self.manager, self._owns_manager = open_manager(manager, manager_kwargs, type(self).__name__)
        self._checkpoint_id: Optional[CheckpointId] = None

    @property
    def checkpoint_id(self) -> Optional[CheckpointId]:
        """The id DCP (or the constructor) gave last; DCP's logging reads it."""
        return self._checkpoint_id

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: Union[str, os.PathLike]) -> bool:
        """Whether ``checkpoint_id`` names an iteration (an int, or a name ending in digits)."""
        return is_iteration_id(checkpoint_id)

    def close(self) -> None:
        """Close the manager if this object built it (store files stay)."""
        if self._owns_manager:
            self.manager.close()

    def __getstate__(self):
        raise TypeError(
            f"{type(self).__name__} cannot be pickled (it holds a CheckpointManager's threads and "
            "process groups): use dcp.async_save with async_checkpointer_type=THREAD (the default)"
        )


def open_manager(
    manager: Optional[CheckpointManager], kwargs: Dict[str, Any], owner: str
) -> Tuple[CheckpointManager, bool]:
    """``(manager, owned)``. Raises ValidationError naming the mistake."""
    if manager is not None and kwargs:
        raise ValidationError(
            f"{owner}: pass either manager=CheckpointManager(...) or CheckpointManager keyword "
            f"arguments ({', '.join(sorted(kwargs))}), not both"
        )
    if manager is None:
        # Collective (the manager's groups are created on first use): every rank builds it.
        return CheckpointManager(**kwargs), True
    if not isinstance(manager, CheckpointManager):
        hint = (
            "; the checkpoint id (a path or name ending in the step) goes to checkpoint_id=... "
            "or to dcp.save / dcp.load"
            if isinstance(manager, (str, bytes, int)) or hasattr(manager, "__fspath__")
            else ""
        )
        raise ValidationError(
            f"{owner}'s first argument is a CheckpointManager, got {type(manager).__name__} {manager!r}{hint}"
        )
    return manager, False
