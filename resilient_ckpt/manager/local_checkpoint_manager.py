"""``LocalCheckpointManager``: nvidia-resiliency-ext's class of that name, as Megatron-LM calls it.

Megatron-LM (``--non-persistent-ckpt-type local``) builds
``LocalCheckpointManager(non_persistent_local_ckpt_dir, repl_strategy=...)`` and calls
``local_ckpt_dir``, ``save(tasd, iteration, is_async)``, ``find_latest()`` and ``load()``.
This subclass of :class:`CheckpointManager` takes the reference's constructor and defaults
(no replication unless a ``CliqueReplicationStrategy`` is given; only the newest complete
iteration kept), its checkpoint ids ``(iteration, rank, session_id)`` and its ``find_latest``
→ ``load`` contract; everything else (store, checksums, agreement, healing, service mode) is
the same manager. Switching is one import line.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Optional, Tuple, Union

import torch.distributed as dist

from ..errors import CheckpointingException, ValidationError
from ..replication.placement import clique_groups
from .checkpoint_manager import CheckpointManager

logger = logging.getLogger(__name__)

#: store directory of the reference's default ``session_id=''`` (a store names its sessions)
UNNAMED_SESSION = "local"


class LocalCheckpointManager(CheckpointManager):
    """Drop-in for ``nvidia_resiliency_ext...local_manager.LocalCheckpointManager``.

    Args:
        root_local_ckpt_dir: the node's store root (a tmpfs directory such as
            ``/dev/shm/ckpt``; Megatron-LM's ``--non-persistent-local-ckpt-dir``).
        session_id: as in the reference ('' is allowed: the directory is the job's).
        repl_strategy: None (no replication, the reference's default) or a
            ``CliqueReplicationStrategy`` / ``LazyCliqueReplicationStrategy`` — translated to
            our clique placement with the same groups. Copies that would stay on the owner's
            node (e.g. jump 1 on one host) are skipped with a warning: the node's store already
            holds the owner's data and survives the process.
        **options: any :class:`CheckpointManager` option (``keep_last`` defaults to 1, as the
            reference retains only the newest complete iteration).
    """

    _skip_same_node = True

    def __init__(
        self,
        root_local_ckpt_dir: Union[str, Path],
        session_id: str = "",
        repl_strategy: Any = None,
        **options: Any,
    ):
        if not isinstance(session_id, str):
            raise ValidationError(f"session_id must be a str, got {type(session_id).__name__}")
        factor, jump = replication_of(repl_strategy)
        options.setdefault("keep_last", 1)
        super().__init__(
            session_id=session_id or UNNAMED_SESSION,
            store_root=str(root_local_ckpt_dir),
            replication_factor=factor,
            replication_jump=jump,
            placement="clique",
            **options,
        )
        self.root_local_ckpt_dir = root_local_ckpt_dir
        self.repl_strategy = repl_strategy
        self._given_session_id = session_id
        if factor > 1 and not self.placement.holders_of(self.rank):
            logger.warning(
                "replication (jump %d, factor %d) keeps every copy of rank %d on its own node "
                "(%d ranks per node): no copy is made; a node loss is survived only with a jump "
                "of at least the ranks per node (LOCAL_WORLD_SIZE)",
                jump,
                factor,
                self.rank,
                self.placement.ranks_per_node,
            )

    @property
    def local_ckpt_dir(self) -> Path:
        """This node's store directory of the session (Megatron-LM prints it as the save
        directory). Unlike the reference's it is shared by the node's ranks."""
        return self.store.dir

    def ckpt_id(self, iteration: int) -> Tuple[int, int, str]:
        """The reference's checkpoint id: ``(iteration, rank, session_id)``."""
        return (iteration, self.rank, self._given_session_id)

    def load(self) -> Tuple[Any, Tuple[int, int, str]]:
        """The newest complete iteration (found by ``find_latest()``, which must come first,
        as in the reference) and its checkpoint id. Collective."""
        if self.latest_iteration == -1:
            raise CheckpointingException(
                "The 'find_latest' method must be called before invoking the 'load' function."
            )
        return super().load()


def replication_of(strategy: Any) -> Tuple[int, Optional[int]]:
    """(replication factor, jump) of an nvidia-resiliency-ext replication strategy."""
    if strategy is None:
        return 1, None
    factor = getattr(strategy, "replication_factor", None)  # LazyCliqueReplicationStrategy
    jump = getattr(strategy, "replication_jump", None)
    if factor is not None and jump is not None:
        return int(factor), int(jump)
    group = getattr(strategy, "local_group", None)
    if group is None or not dist.is_initialized():
        raise ValidationError(
            f"unsupported replication strategy {type(strategy).__name__}: pass "
            "CliqueReplicationStrategy.from_replication_params(jump, factor) (or "
            "LazyCliqueReplicationStrategy), or use CheckpointManager(replication_factor=..., "
            "replication_jump=...)"
        )
    ranks = sorted(group.ranks)
    factor = len(ranks)
    jump = ranks[1] - ranks[0] if factor > 1 else 1
    if tuple(ranks) not in clique_groups(dist.get_world_size(), factor, jump):
        raise ValidationError(
            f"replication group {ranks} of rank {dist.get_rank()} is not a clique group "
            f"{{n, n+J, ...}} of jump {jump}: only groups built by "
            "CliqueReplicationStrategy.from_replication_params can be translated"
        )
    return factor, jump
