"""Reading and writing DCP directories: safe metadata, checked data files, the manifest.

The planners decide *what* goes where; torch's FileSystemWriter / FileSystemReader move the
bytes, wrapped here:

- :class:`SafeFileSystemReader`: the ``.metadata`` file is a pickle (DCP's format);
  :func:`read_metadata_file` unpickles it with an allow-list of DCP's own metadata classes,
  and every data file the metadata names is checked (present, long enough) before anything is
  read, so a damaged or foreign directory fails with the file named instead of a deep torch
  error;
- :class:`ResilientFileSystemWriter`: writes the manifest before ``.metadata`` (so metadata is
  still the last file) and runs a check once this rank's data is written;
- :class:`CountingStorageReader`: counts what a reader reads (benchmarks, tests);
- :func:`read_manifest`, atomic file writes, and :func:`error_from_dcp` (torch's
  CheckpointException as ours).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import pickle
import threading
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple, Union

import torch
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, SavePlan, SavePlanner
from torch.distributed.checkpoint.storage import StorageReader

from ..errors import CheckpointingException, CorruptCheckpointError
from .checks import check_data_files
from .layout import FORMAT_NAME, MANIFEST_NAME, METADATA_NAME

#: (fqn, chunk offsets or None for a value): one stored entry.
StoredKey = Tuple[str, Optional[Tuple[int, ...]]]


# ---- metadata ------------------------------------------------------------------------------


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata with an allow-list: DCP's own dataclasses and torch scalars."""

    _MODULES_ANY = {"torch.distributed.checkpoint.metadata"}
    _ALLOWED = {
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
        ("torch.distributed.checkpoint.filesystem", "_StoragePrefix"),
        ("torch", "Size"),
        ("torch.serialization", "_get_layout"),
        ("collections", "OrderedDict"),
        ("pathlib", "PosixPath"),
        ("pathlib", "PurePosixPath"),
        ("pathlib", "WindowsPath"),
        ("pathlib", "PureWindowsPath"),
        ("pathlib", "Path"),
        ("pathlib._local", "PosixPath"),
        ("pathlib._local", "WindowsPath"),
        ("pathlib._local", "Path"),
    }

    def __init__(self, f, source: str):
        super().__init__(f)
        self.source = source

    def find_class(self, module: str, name: str) -> Any:
        if module in self._MODULES_ANY or (module, name) in self._ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(
            getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)
        ):
            return getattr(torch, name)
        raise CorruptCheckpointError(
            f"{self.source} refers to {module}.{name}, which is not part of DCP metadata; it is "
            "not unpickled. If you trust this checkpoint, open it with allow_pickle=True"
        )


def read_metadata_file(path: Union[str, os.PathLike], allow_pickle: bool = False) -> Metadata:
    """Read a DCP ``.metadata`` file with clear errors for a missing, truncated or foreign file."""
    path = Path(path)
    directory = path.parent
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        if not directory.exists():
            raise CorruptCheckpointError(
                f"{directory} does not exist; pass a DCP checkpoint directory"
            ) from None
        raise CorruptCheckpointError(
            f"{path} is missing: {directory} is not a complete DCP checkpoint (a save that did not "
            "finish writes its metadata last); use an older checkpoint"
        ) from None
    except IsADirectoryError:
        raise CorruptCheckpointError(f"{path} is a directory, not DCP metadata") from None
    if not raw:
        raise CorruptCheckpointError(f"{path} is empty (truncated); the checkpoint cannot be read")
    try:
        if allow_pickle:
            md = pickle.loads(raw)
        else:
            md = _MetadataUnpickler(io.BytesIO(raw), str(path)).load()
    except CorruptCheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(
            f"{path} is truncated or corrupt ({type(e).__name__}: {e}); the checkpoint cannot be read"
        ) from e
    if not isinstance(md, Metadata) or not isinstance(getattr(md, "state_dict_metadata", None), dict):
        raise CorruptCheckpointError(f"{path} does not hold DCP Metadata (got {type(md).__name__})")
    return md


def metadata_tensor_bytes(metadata: Metadata) -> int:
    return sum(
        math.prod(v.size) * v.properties.dtype.itemsize
        for v in metadata.state_dict_metadata.values()
        if isinstance(v, TensorStorageMetadata)
    )


def stored_lengths(metadata: Metadata) -> Dict[StoredKey, int]:
    """Bytes the storage layer holds per entry, keyed ``(fqn, offsets or None)`` (empty when
    the storage layout is not a file layout)."""
    out = {}
    for idx, info in (metadata.storage_data or {}).items():
        out[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] = int(
            getattr(info, "length", 0) or 0
        )
    return out


# ---- reader and writer ---------------------------------------------------------------------


class SafeFileSystemReader(FileSystemReader):
    """torch's FileSystemReader with safe metadata unpickling and up-front file checks."""

    def __init__(self, path: Union[str, os.PathLike], *, allow_pickle: bool = False, **kwargs: Any):
        super().__init__(path, **kwargs)
        self.allow_pickle = allow_pickle

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        rank = kwargs.get("rank")
        md = read_metadata_file(self._get_metadata_path(rank), self.allow_pickle)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata.storage_data is None:
            raise CorruptCheckpointError(f"{self.path}/{METADATA_NAME} has no storage layout (storage_data)")
        check_data_files(self.path, metadata)
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)


class ResilientFileSystemWriter(FileSystemWriter):
    """torch's FileSystemWriter plus: a manifest written before ``.metadata`` (so metadata is
    still the last file), and an ``after_write`` check run once this rank's data is written
    (raising there fails the save on every rank before any metadata exists)."""

    def __init__(
        self,
        path: Union[str, os.PathLike],
        *,
        manifest: Optional[Dict[str, Any]] = None,
        after_write: Optional[Callable[[], None]] = None,
        **kwargs: Any,
    ):
        kwargs.setdefault("overwrite", True)
        super().__init__(path, **kwargs)
        self.manifest = manifest
        self.after_write = after_write
        self.bytes_written = 0

    def write_data(self, plan: SavePlan, planner: SavePlanner):
        fut = super().write_data(plan, planner)
        results = fut.wait()
        self.bytes_written = sum(int(r.size_in_bytes) for r in results)
        if self.after_write is not None:
            self.after_write()
        return fut

    def finish(self, metadata: Metadata, results) -> None:
        if self.manifest is not None:
            m = dict(self.manifest)
            m["entries"] = len(metadata.state_dict_metadata)
            m["tensor_bytes"] = metadata_tensor_bytes(metadata)
            write_json_atomic(Path(self.path) / MANIFEST_NAME, m)
        super().finish(metadata, results)


class CountingStorageReader(StorageReader):
    """Wraps a StorageReader and counts what it reads (items, and stored bytes per item).

    ``bytes_read`` counts each read item's stored length (the whole stored entry: DCP's
    FileSystemReader reads an entry entirely before narrowing it).
    """

    def __init__(self, inner: StorageReader):
        self.inner = inner
        self.items_read = 0
        self.bytes_read = 0
        self.reads: Dict[StoredKey, int] = defaultdict(int)
        self._storage_data: Mapping = {}
        self._lock = threading.Lock()

    def reset(self, checkpoint_id=None) -> None:
        self.inner.reset(checkpoint_id)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self.inner.read_metadata(*args, **kwargs)

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self._storage_data = metadata.storage_data or {}
        self.inner.set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return self.inner.prepare_local_plan(plan)

    def prepare_global_plan(self, plans: List[LoadPlan]) -> List[LoadPlan]:
        return self.inner.prepare_global_plan(plans)

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        with self._lock:
            for ri in plan.items:
                idx = ri.storage_index
                info = self._storage_data.get(idx)
                n = int(getattr(info, "length", 0) or 0)
                self.items_read += 1
                self.bytes_read += n
                self.reads[(idx.fqn, None if idx.offset is None else tuple(idx.offset))] += 1
        return self.inner.read_data(plan, planner)

    @property
    def checkpoint_id(self):
        return getattr(self.inner, "checkpoint_id", None)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id) -> bool:
        return False


# ---- files beside the DCP data ---------------------------------------------------------------


def _temp_beside(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")


def write_json_atomic(path: Path, obj: Any) -> None:
    tmp = _temp_beside(path)
    with open(tmp, "w") as f:
        json.dump(obj, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    tmp = _temp_beside(path)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(directory: Union[str, os.PathLike]) -> Optional[Dict[str, Any]]:
    """The resilient_ckpt manifest of a DCP directory, or None (a plain DCP checkpoint)."""
    p = Path(directory) / MANIFEST_NAME
    try:
        m = json.loads(p.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"{p} is unreadable ({e}); the checkpoint is damaged") from e
    if not isinstance(m, dict) or m.get("format") != FORMAT_NAME:
        raise CorruptCheckpointError(f"{p} is not a resilient_ckpt manifest")
    return m


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable (best effort: not every file system allows it)."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# ---- errors ----------------------------------------------------------------------------------


def error_from_dcp(e: CheckpointException, what: str) -> CheckpointingException:
    """torch's CheckpointException (a BaseException holding every rank's error) as ours."""
    failures = getattr(e, "failures", {}) or {}
    parts = []
    first = None
    for rank, pair in sorted(failures.items()):
        exc = pair[0] if isinstance(pair, tuple) else pair
        first = first or exc
        parts.append(f"rank {rank}: {type(exc).__name__}: {exc}")
    msg = f"{what} failed: " + ("; ".join(parts[:4]) or str(e)[:500])
    if isinstance(first, CheckpointingException):
        try:
            return type(first)(msg)
        except Exception:
            pass
    return CheckpointingException(msg)
