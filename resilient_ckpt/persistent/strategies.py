"""Save and load strategies: pluggable backends with a format version, and a registry.

In the spirit of Megatron-core's ``dist_checkpointing.strategies``: a *sharded* strategy moves
ShardedTensors (and, when ``can_handle_sharded_objects``, ShardedObjects), a *common* strategy
the plain part of a state dict. Every strategy names its ``backend`` and format ``version``;
load strategies check a checkpoint's backend and version before touching it and raise
:class:`~resilient_ckpt.errors.ForeignCheckpointError` naming both when they cannot read it.
``get_default_strategy(action, backend, version)`` looks strategies up in a registry.

Backends:

``dcp``
    torch.distributed.checkpoint directories written and read with our planners
    (:mod:`~resilient_ckpt.persistent.save_planner`, :mod:`~resilient_ckpt.persistent.load_planner`):
    sharded state as DCP entries, common state as a pickle-free
    codec file ``common.rckc`` beside them. A manifest (``resilient_ckpt.json``) records the
    backend and version. Two load strategies: every rank reads what it needs
    (:class:`DcpLoadShardedStrategy`), or each entry is read once per data-parallel group and
    broadcast (:class:`TwoStageDcpLoadShardedStrategy`).
``memory``
    the in-memory store through a :class:`~resilient_ckpt.manager.checkpoint_manager.CheckpointManager`
    (``checkpoint_dir`` names the iteration: ``.../iter_<N>`` or an int). Common state travels
    with the sharded state in one in-memory checkpoint, so this backend has sharded
    strategies only; asking it for a common strategy is an error that says so.
"""

from __future__ import annotations

import os
import re
import warnings
from abc import ABC, abstractmethod
from enum import Enum
from pathlib import Path
from typing import Any, Callable, Dict, Optional, Tuple, Union

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from ..errors import (
    CheckpointingException,
    CorruptCheckpointError,
    ForeignCheckpointError,
    ValidationError,
)
from ..memory.layout import FORMAT_VERSION as MEMORY_FORMAT_VERSION
from ..memory.layout import CheckpointId
from ..model import codec
from ..model.mapping import ShardedTensor
from ..model.nested import nested_values
from ..parallel import collectives
from ..parallel.tensor_aware_state_dict import MCoreTensorAwareStateDict
from .layout import BACKEND, METADATA_NAME, new_manifest
from .load_planner import ResilientLoadPlanner
from .local_load import load_local, tensors_metadata
from .save_planner import ResilientSavePlanner
from .storage import (
    ResilientFileSystemWriter,
    SafeFileSystemReader,
    error_from_dcp,
    read_manifest,
    read_metadata_file,
    write_bytes_atomic,
)
from .two_stage import DEFAULT_READ_AHEAD_BYTES, two_stage_load

CheckpointDir = Union[str, os.PathLike, int]

COMMON_FILE = "common.rckc"


class StrategyAction(Enum):
    LOAD_COMMON = "load_common"
    LOAD_SHARDED = "load_sharded"
    SAVE_COMMON = "save_common"
    SAVE_SHARDED = "save_sharded"


# ---- interfaces ----------------------------------------------------------------------------


# No abstract method on purpose (B024): as Megatron-core's base classes, these carry shared
# checks; what a subclass must add (load / save) differs by strategy kind.
class LoadStrategyBase(ABC):  # noqa: B024
    """A load strategy reads checkpoints of one backend, up to a format version."""

    #: backend name this strategy reads
    backend: str = ""
    #: format versions this strategy reads
    supported_versions: Tuple[int, ...] = ()

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def check_backend_compatibility(self, loaded_backend: str) -> None:
        if loaded_backend != self.backend:
            raise ForeignCheckpointError(
                f"{type(self).__name__} reads backend {self.backend!r}, the checkpoint was written "
                f"with backend {loaded_backend!r}; use get_default_strategy(action, "
                f"{loaded_backend!r}, version)"
            )

    def check_version_compatibility(self, loaded_version: int) -> None:
        if loaded_version not in self.supported_versions:
            raise ForeignCheckpointError(
                f"{type(self).__name__} reads {self.backend!r} format versions "
                f"{list(self.supported_versions)}, the checkpoint has version {loaded_version}; "
                "load it with the resilient_ckpt release that wrote it (or a newer one)"
            )

    def check_compatibility(self, backend: str, version: int) -> None:
        self.check_backend_compatibility(backend)
        self.check_version_compatibility(version)


class SaveStrategyBase(ABC):  # noqa: B024
    """A save strategy writes one backend's format at one version."""

    def __init__(self, backend: str, version: int):
        self.backend = backend
        self.version = int(version)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(backend={self.backend!r}, version={self.version})"


class SaveShardedStrategy(SaveStrategyBase):
    @abstractmethod
    def save(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> None:
        """Save the sharded part of a state dict (collective)."""


class SaveCommonStrategy(SaveStrategyBase):
    @abstractmethod
    def save(self, common_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> None:
        """Save the common (non-sharded) part of a state dict."""


class LoadShardedStrategy(LoadStrategyBase):
    @abstractmethod
    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        """Return ``sharded_state_dict`` with tensors (and values) in place of its sharded
        leaves (collective)."""

    @abstractmethod
    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        """key -> an unsharded ShardedTensor (only ``global_shape`` and ``dtype`` meaningful)."""


class LoadCommonStrategy(LoadStrategyBase):
    @abstractmethod
    def load(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        """The common state of the checkpoint."""


# ---- registry --------------------------------------------------------------------------------

_Factory = Callable[..., Any]
_REGISTRY: Dict[Tuple[StrategyAction, str, int], _Factory] = {}
#: (action, backend) pairs a backend deliberately has no strategy for, with the reason
_UNSUPPORTED: Dict[Tuple[StrategyAction, str], str] = {}


def register_default_strategy(action: StrategyAction, backend: str, version: int, factory: _Factory) -> None:
    """Make ``factory(**kwargs)`` the default strategy for (action, backend, version)."""
    if not isinstance(action, StrategyAction):
        raise ValidationError(f"action must be a StrategyAction, got {action!r}")
    _REGISTRY[(action, backend, int(version))] = factory


def registered_strategies() -> Dict[Tuple[str, str, int], str]:
    """(action, backend, version) -> factory name, for diagnostics."""
    return {
        (a.value, b, v): getattr(f, "__name__", repr(f))
        for (a, b, v), f in sorted(_REGISTRY.items(), key=lambda kv: (kv[0][0].value, kv[0][1], kv[0][2]))
    }


def get_default_strategy(action: StrategyAction, backend: str, version: int, **kwargs: Any):
    """The registered default strategy for ``action`` on ``backend`` at ``version``.

    ``kwargs`` go to the strategy's constructor (e.g. ``manager=`` for the memory backend,
    ``process_group=`` or ``data_parallel_group=`` for dcp). Raises
    :class:`ValidationError` naming what is available when nothing matches.
    """
    if isinstance(action, str):
        try:
            action = StrategyAction(action)
        except ValueError:
            raise ValidationError(
                f"unknown strategy action {action!r}; use one of {[a.value for a in StrategyAction]}"
            ) from None
    factory = _REGISTRY.get((action, backend, int(version)))
    if factory is not None:
        return factory(**kwargs)
    backends = sorted({b for _, b, _ in _REGISTRY})
    if backend not in backends:
        raise ValidationError(f"unknown checkpoint backend {backend!r}; registered backends: {backends}")
    reason = _UNSUPPORTED.get((action, backend))
    if reason:
        raise ValidationError(f"backend {backend!r} has no {action.value} strategy: {reason}")
    versions = sorted(v for a, b, v in _REGISTRY if a == action and b == backend)
    if not versions:
        raise ValidationError(f"backend {backend!r} has no {action.value} strategy")
    raise ValidationError(
        f"backend {backend!r} has no {action.value} strategy for format version {version}; "
        f"available versions: {versions}"
    )


# ---- dcp backend -----------------------------------------------------------------------------


def _dir(checkpoint_dir: CheckpointDir) -> Path:
    if isinstance(checkpoint_dir, int):
        raise ValidationError(f"the dcp backend needs a directory, got the integer {checkpoint_dir}")
    return Path(checkpoint_dir)


def read_checkpoint_format(checkpoint_dir: CheckpointDir) -> Tuple[str, int]:
    """(backend, version) of a checkpoint directory, from its manifest; a plain DCP directory
    (written by torch's ``dcp.save``) reads as ``("dcp", 1)``."""
    d = _dir(checkpoint_dir)
    manifest = read_manifest(d)
    if manifest is not None:
        return str(manifest.get("backend")), int(manifest.get("version", 0))
    if (d / METADATA_NAME).exists():
        return "dcp", 1
    if not d.exists():
        raise CorruptCheckpointError(f"{d} does not exist")
    raise CorruptCheckpointError(f"{d} is not a checkpoint directory (no {METADATA_NAME}, no manifest)")


def _is_coordinator(group) -> bool:
    return collectives.group_rank(group) == 0


class DcpSaveShardedStrategy(SaveShardedStrategy):
    """Sharded state to a DCP directory with :class:`~resilient_ckpt.persistent.save_planner.ResilientSavePlanner`
    (replicas written once, plan cached across saves of one structure, validated plan)."""

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        thread_count: int = 1,
        sync_files: bool = True,
        enable_plan_caching: bool = True,
        version: int = 1,
    ):
        super().__init__(BACKEND, version)
        self.process_group = process_group
        self.thread_count = thread_count
        self.sync_files = sync_files
        self.planner = ResilientSavePlanner(enable_plan_caching=enable_plan_caching)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> None:
        d = _dir(checkpoint_dir)
        no_dist = not (dist.is_available() and dist.is_initialized())
        writer = ResilientFileSystemWriter(
            d,
            manifest=new_manifest(
                "strategy",
                session=None,
                iteration=None,
                world_size=dist.get_world_size() if not no_dist else 1,
                backend=self.backend,
            ),
            thread_count=self.thread_count,
            sync_files=self.sync_files,
        )
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", UserWarning)
                dcp.save(
                    sharded_state_dict,
                    storage_writer=writer,
                    planner=self.planner,
                    process_group=self.process_group,
                    no_dist=no_dist,
                )
        except CheckpointException as e:
            raise error_from_dcp(e, f"saving {d}") from None


class DcpSaveCommonStrategy(SaveCommonStrategy):
    """The common state, from group rank 0, as a codec file (no pickle) in the directory."""

    def __init__(self, process_group: Optional[dist.ProcessGroup] = None, *, version: int = 1):
        super().__init__(BACKEND, version)
        self.process_group = process_group

    def save(self, common_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> None:
        if not _is_coordinator(self.process_group):
            return
        d = _dir(checkpoint_dir)
        d.mkdir(parents=True, exist_ok=True)
        write_bytes_atomic(d / COMMON_FILE, codec.encode(common_state_dict))


class DcpLoadShardedStrategy(LoadShardedStrategy):
    """Every rank reads what its sharded state dict needs (resharding as DCP does)."""

    backend = "dcp"
    supported_versions = (1,)

    def __init__(
        self,
        process_group: Optional[dist.ProcessGroup] = None,
        *,
        allow_partial_load: bool = False,
        allow_pickle: bool = False,
    ):
        self.process_group = process_group
        self.allow_partial_load = allow_partial_load
        self.allow_pickle = allow_pickle

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def _prepare(self, checkpoint_dir: CheckpointDir):
        d = _dir(checkpoint_dir)
        self.check_compatibility(*read_checkpoint_format(d))
        reader = SafeFileSystemReader(d, allow_pickle=self.allow_pickle)
        planner = ResilientLoadPlanner(
            allow_partial_load=self.allow_partial_load, allow_pickle=self.allow_pickle
        )
        return d, reader, planner

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        exc = None
        try:
            d, reader, planner = self._prepare(checkpoint_dir)
            load_local(sharded_state_dict, reader, planner)
        except BaseException as e:
            exc = e
        # Every rank raises together (None: the default group).
        collectives.fail_together(exc, f"loading {checkpoint_dir}", self.process_group)
        return sharded_state_dict

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        d = _dir(checkpoint_dir)
        self.check_compatibility(*read_checkpoint_format(d))
        return tensors_metadata(read_metadata_file(d / METADATA_NAME, self.allow_pickle))


class TwoStageDcpLoadShardedStrategy(DcpLoadShardedStrategy):
    """Each stored entry is read by one rank of ``data_parallel_group`` and broadcast to the
    others (:func:`~resilient_ckpt.persistent.two_stage.two_stage_load`)."""

    def __init__(
        self,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
        *,
        read_ahead_bytes: int = DEFAULT_READ_AHEAD_BYTES,
        allow_partial_load: bool = False,
        allow_pickle: bool = False,
    ):
        super().__init__(
            data_parallel_group, allow_partial_load=allow_partial_load, allow_pickle=allow_pickle
        )
        self.data_parallel_group = data_parallel_group
        self.read_ahead_bytes = read_ahead_bytes
        self.last_stats = None

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        group = self.data_parallel_group
        exc = None
        reader = planner = None
        try:
            _, reader, planner = self._prepare(checkpoint_dir)
        except BaseException as e:
            exc = e
        collectives.fail_together(exc, f"loading {checkpoint_dir}", group)
        self.last_stats = two_stage_load(
            sharded_state_dict, reader, group, planner=planner, read_ahead_bytes=self.read_ahead_bytes
        )
        return sharded_state_dict


class DcpLoadCommonStrategy(LoadCommonStrategy):
    backend = "dcp"
    supported_versions = (1,)

    def load(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        d = _dir(checkpoint_dir)
        self.check_compatibility(*read_checkpoint_format(d))
        p = d / COMMON_FILE
        try:
            raw = p.read_bytes()
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{p} is missing: {d} holds no common state (save it with the dcp SAVE_COMMON strategy)"
            ) from None
        return codec.decode(raw)


# ---- memory backend --------------------------------------------------------------------------

_ITER = re.compile(r"iter_(\d+)$")


def iteration_of(checkpoint_dir: CheckpointDir) -> Optional[int]:
    """The iteration a memory-backend ``checkpoint_dir`` names (``.../iter_<N>`` or an int);
    None for ``"latest"``."""
    if isinstance(checkpoint_dir, int):
        return checkpoint_dir
    name = Path(checkpoint_dir).name
    if name == "latest":
        return None
    m = _ITER.search(name)
    if not m:
        raise ValidationError(
            f"the memory backend needs the iteration in checkpoint_dir (…/iter_<N>, an int, or "
            f"'latest'), got {str(checkpoint_dir)!r}"
        )
    return int(m.group(1))


def _memory_version() -> int:
    return MEMORY_FORMAT_VERSION


class MemorySaveShardedStrategy(SaveShardedStrategy):
    """Save into the node store through ``manager`` (the whole state dict: common state travels
    with the sharded state)."""

    def __init__(self, manager: Any = None, *, is_async: bool = False, version: Optional[int] = None):
        if manager is None:
            raise ValidationError("the memory backend needs manager= (a CheckpointManager)")
        super().__init__("memory", _memory_version() if version is None else version)
        self.manager = manager
        self.is_async = is_async
        self.last_handle = None

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def save(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> None:
        iteration = iteration_of(checkpoint_dir)
        if iteration is None:
            raise ValidationError("saving needs an iteration (…/iter_<N> or an int), not 'latest'")
        self.last_handle = self.manager.save_local(sharded_state_dict, iteration, is_async=self.is_async)


class MemoryLoadShardedStrategy(LoadShardedStrategy):
    """Restore from the memory tier through ``manager`` (collective)."""

    backend = "memory"

    def __init__(self, manager: Any = None):
        if manager is None:
            raise ValidationError("the memory backend needs manager= (a CheckpointManager)")
        self.manager = manager
        self.supported_versions = (_memory_version(),)

    @property
    def can_handle_sharded_objects(self) -> bool:
        return True

    def load(self, sharded_state_dict: Dict[str, Any], checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        want = iteration_of(checkpoint_dir)
        out = self.manager.load_local(sharded_state_dict)
        if out is None:
            raise CheckpointingException(
                f"the memory tier holds no complete checkpoint (session {self.manager.session_id!r})"
            )
        state, iteration = out
        if want is not None and iteration != want:
            raise CheckpointingException(
                f"the memory tier's newest complete iteration is {iteration}, not {want}; load "
                "'latest' or the persistent tier"
            )
        return state

    def load_tensors_metadata(self, checkpoint_dir: CheckpointDir) -> Dict[str, Any]:
        store = self.manager.store
        want = iteration_of(checkpoint_dir)
        mine = [
            c for c in store.list() if c.owner == self.manager.rank and (want is None or c.iteration == want)
        ]
        if not mine:
            raise CheckpointingException(
                f"store {store.dir} holds no checkpoint of rank {self.manager.rank}"
                + (f" for iteration {want}" if want is not None else "")
            )
        cid: CheckpointId = mine[-1]
        header = store.read_header(cid)
        self.check_version_compatibility(header.format_version)
        tasd = MCoreTensorAwareStateDict.from_bytes(header.meta)
        out = {}
        for st in nested_values(tasd.sharded_state_dict):
            if isinstance(st, ShardedTensor) and st.key not in out:
                shape = tuple(st.global_shape)
                out[st.key] = ShardedTensor(st.key, None, st.dtype, shape, shape, (0,) * len(shape), None)
        return out


_UNSUPPORTED[(StrategyAction.SAVE_COMMON, "memory")] = (
    "the memory backend keeps the common state inside each in-memory checkpoint; save the whole "
    "state dict with its SAVE_SHARDED strategy"
)
_UNSUPPORTED[(StrategyAction.LOAD_COMMON, "memory")] = (
    "the memory backend returns the common state with the sharded state; use its LOAD_SHARDED strategy"
)


def _two_stage_or_plain(data_parallel_group=None, **kwargs):
    if data_parallel_group is not None:
        return TwoStageDcpLoadShardedStrategy(data_parallel_group, **kwargs)
    return DcpLoadShardedStrategy(**kwargs)


register_default_strategy(StrategyAction.SAVE_SHARDED, "dcp", 1, DcpSaveShardedStrategy)
register_default_strategy(StrategyAction.SAVE_COMMON, "dcp", 1, DcpSaveCommonStrategy)
register_default_strategy(StrategyAction.LOAD_SHARDED, "dcp", 1, _two_stage_or_plain)
register_default_strategy(StrategyAction.LOAD_COMMON, "dcp", 1, DcpLoadCommonStrategy)
register_default_strategy(StrategyAction.SAVE_SHARDED, "memory", _memory_version(), MemorySaveShardedStrategy)
register_default_strategy(StrategyAction.LOAD_SHARDED, "memory", _memory_version(), MemoryLoadShardedStrategy)


def verify_checkpoint_and_load_strategy(checkpoint_dir: CheckpointDir, **kwargs: Any):
    """(sharded, common) default load strategies for a DCP checkpoint directory, after checking
    its backend and version are readable here."""
    backend, version = read_checkpoint_format(checkpoint_dir)
    sharded = get_default_strategy(StrategyAction.LOAD_SHARDED, backend, version, **kwargs)
    sharded.check_compatibility(backend, version)
    common = get_default_strategy(StrategyAction.LOAD_COMMON, backend, version)
    return sharded, common
