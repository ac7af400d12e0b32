"""The in-memory holder: checkpoints as files of a tmpfs directory, mapped into memory.

Layout under ``{root}/{session}/``::

    iter_{iteration:020d}.owner_{owner:06d}.data   tensor bytes, one contiguous segment
    iter_{iteration:020d}.owner_{owner:06d}.hdr    msgpack header, published last (atomic rename)
    iter_{iteration:020d}.parity_{holder:06d}.data parity blocks rank ``holder`` keeps for its group
    iter_{iteration:020d}.parity_{holder:06d}.hdr  their header (:class:`ParityHeader`), published last
    free/seg_{n}.data                              retired segments kept for reuse
    .lock                                          flock for free-pool and budget decisions

A checkpoint exists iff its header exists; the header is written after every byte of the
segment, under a temporary name, then renamed, so a torn write is never taken for a
checkpoint. Files outlive the trainer process (tmpfs), which is the point.

Steady state allocates nothing: retired segments go to the free pool and the next save takes
one of the same size (tmpfs pages stay populated; a fresh tmpfs page costs ~10x a memcpy on
a VM). New segments are ``posix_fallocate``-d (~8x faster than faulting pages on write).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import itertools
import logging
import math
import mmap
import os
import re
import shutil
import socket
import stat
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import msgpack
import torch

from .. import fork_safe_locks
from ..errors import CorruptCheckpointError, ForeignCheckpointError, StoreError, StoreFullError
from ..gc_pause import paused_gc
from . import checksum, pinning

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MAGIC = "resilient_ckpt/store"
ALIGN = 256
DEFAULT_ROOT = "/dev/shm/resilient_ckpt"
_MAX_HEADER_BYTES = 1 << 30
_MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)
_NAME = re.compile(r"^iter_(\d{20})\.owner_(\d{6})\.(data|hdr)$")
_PARITY_NAME = re.compile(r"^iter_(\d{20})\.parity_(\d{6})\.(data|hdr)$")
PARITY_MAGIC = "resilient_ckpt/parity"
SMALL_SHM_BYTES = 1 << 30
_PARSED_HEADERS = 64  # per store: a node's ranks x a few retained iterations
# Unique file names within a process: two threads (prefetcher, replication) may reserve in the
# same nanosecond, and O_CREAT on a shared name would hand both the same file.
_UNIQUE = itertools.count()


@dataclass(frozen=True, order=True)
class CheckpointId:
    iteration: int
    owner: int
    session: str

    def stem(self) -> str:
        return f"iter_{self.iteration:020d}.owner_{self.owner:06d}"

    def as_tuple(self) -> Tuple[int, int, str]:
        """nvidia-resiliency-ext's CkptID order: (iteration, rank, session)."""
        return (self.iteration, self.owner, self.session)


@dataclass(frozen=True, order=True)
class ParityId:
    """The parity blocks rank ``holder`` keeps of iteration ``iteration`` for its group
    (same file-naming interface as :class:`CheckpointId`)."""

    iteration: int
    holder: int
    session: str

    def stem(self) -> str:
        return f"iter_{self.iteration:020d}.parity_{self.holder:06d}"


@dataclass(frozen=True)
class TensorLayout:
    offset: int
    nbytes: int
    dtype: str
    shape: Tuple[int, ...]
    checksum: Optional[int] = None

    def pack(self) -> tuple:
        return (self.offset, self.nbytes, self.dtype, self.shape, self.checksum)

    @classmethod
    def unpack(cls, v) -> "TensorLayout":
        """From :meth:`pack`'s fields as msgpack decodes them; wrong types are refused (a
        header has one entry per tensor, 50k+: this runs at a few hundred ns each)."""
        off, n, dt, shape, ck = v
        shape = tuple(shape)
        if (
            type(off) is not int
            or type(n) is not int
            or type(dt) is not str
            or not (ck is None or type(ck) is int)
            or any(type(s) is not int for s in shape)
        ):
            raise CorruptCheckpointError(f"malformed tensor entry {v!r} in a checkpoint header")
        return new_layout(off, n, dt, shape, ck)

    @property
    def torch_dtype(self) -> torch.dtype:
        dt = getattr(torch, self.dtype, None)
        if not isinstance(dt, torch.dtype):
            raise CorruptCheckpointError(f"unknown dtype {self.dtype!r} in a checkpoint header")
        return dt


@dataclass(frozen=True)
class CheckpointHeader:
    """Self-describing metadata of one stored checkpoint."""

    session: str
    iteration: int
    owner: int
    world_size: int
    tensors: Tuple[TensorLayout, ...]
    data_nbytes: int
    #: the hollow state dict (codec bytes) and anything the writer wants to keep beside it
    meta: bytes = b""
    replication: Dict[str, object] = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    checksum_algo: str = checksum.ALGO
    created_ns: int = 0
    writer: str = ""

    @property
    def id(self) -> CheckpointId:
        return CheckpointId(self.iteration, self.owner, self.session)

    def pack(self) -> bytes:
        """The header's bytes (computed once per header object: a save publishes them and
        sends them to its holders; a header that was unpacked keeps the bytes it came from)."""
        raw = self.__dict__.get("_packed")
        if raw is None:
            raw = self._pack()
            self.__dict__["_packed"] = raw
        return raw

    def _pack(self) -> bytes:
        return pack_envelope(
            {
                "magic": MAGIC,
                "format_version": self.format_version,
                "session": self.session,
                "iteration": self.iteration,
                "owner": self.owner,
                "world_size": self.world_size,
                "tensors": [t.pack() for t in self.tensors],
                "data_nbytes": self.data_nbytes,
                "meta": self.meta,
                "replication": self.replication,
                "checksum_algo": self.checksum_algo,
                "created_ns": self.created_ns or time.time_ns(),
                "writer": self.writer or writer_name(),
            }
        )

    @classmethod
    def unpack(cls, raw: bytes, source: str = "header") -> "CheckpointHeader":
        """Parse and verify; any defect is a CorruptCheckpointError naming ``source``."""
        try:
            with paused_gc():  # one TensorLayout per tensor: 50k small objects
                header = cls._parse(raw, source)
            header.__dict__["_packed"] = bytes(raw)
            return header
        except (CorruptCheckpointError, ForeignCheckpointError):
            raise
        except Exception as e:  # msgpack errors, missing keys, wrong types
            raise CorruptCheckpointError(f"{source}: malformed header ({type(e).__name__}: {e})") from e

    @classmethod
    def _parse(cls, raw: bytes, source: str) -> "CheckpointHeader":
        body, digest = msgpack.unpackb(raw, raw=False, max_bin_len=_MAX_HEADER_BYTES)
        if checksum.digest(body) != digest:
            raise CorruptCheckpointError(f"{source}: header checksum mismatch (torn or corrupted)")
        d = msgpack.unpackb(
            body, raw=False, strict_map_key=False, use_list=False, max_bin_len=_MAX_HEADER_BYTES
        )
        if d.get("magic") != MAGIC:
            raise CorruptCheckpointError(f"{source}: not a resilient_ckpt header")
        version = d["format_version"]
        if version != FORMAT_VERSION:
            raise ForeignCheckpointError(
                f"{source}: store format version {version}, this build reads version "
                f"{FORMAT_VERSION}; restore with a matching resilient_ckpt or start fresh"
            )
        return cls(
            session=str(d["session"]),
            iteration=int(d["iteration"]),
            owner=int(d["owner"]),
            world_size=int(d["world_size"]),
            tensors=tuple(map(TensorLayout.unpack, d["tensors"])),
            data_nbytes=int(d["data_nbytes"]),
            meta=bytes(d["meta"]),
            replication=dict(d.get("replication") or {}),
            format_version=version,
            checksum_algo=str(d["checksum_algo"]),
            created_ns=int(d["created_ns"]),
            writer=str(d.get("writer", "")),
        )


def pack_envelope(fields: Dict[str, Any]) -> bytes:
    """msgpack ``fields`` inside the checksummed envelope headers use."""
    body = msgpack.packb(fields, use_bin_type=True)
    return msgpack.packb([body, checksum.digest(body)], use_bin_type=True)


def unpack_envelope(raw: bytes, source: str, magic: str) -> Dict[str, Any]:
    """The fields of :func:`pack_envelope`; any defect is a CorruptCheckpointError naming
    ``source`` (a different format version: ForeignCheckpointError)."""
    try:
        body, digest = msgpack.unpackb(raw, raw=False, max_bin_len=_MAX_HEADER_BYTES)
        if checksum.digest(body) != digest:
            raise CorruptCheckpointError(f"{source}: header checksum mismatch (torn or corrupted)")
        d = msgpack.unpackb(body, raw=False, strict_map_key=False, max_bin_len=_MAX_HEADER_BYTES)
    except CorruptCheckpointError:
        raise
    except Exception as e:
        raise CorruptCheckpointError(f"{source}: malformed header ({type(e).__name__}: {e})") from e
    if not isinstance(d, dict) or d.get("magic") != magic:
        raise CorruptCheckpointError(f"{source}: not a {magic} header")
    if d.get("format_version") != FORMAT_VERSION:
        raise ForeignCheckpointError(
            f"{source}: format version {d.get('format_version')}, this build reads {FORMAT_VERSION}; "
            "restore with a matching resilient_ckpt or start fresh"
        )
    return d


def writer_name() -> str:
    """Who wrote a header: ``host:pid``."""
    return f"{socket.gethostname()}:{os.getpid()}"


def new_layout(offset: int, nbytes: int, dtype: str, shape: Tuple[int, ...], checksum=None) -> TensorLayout:
    """A TensorLayout from fields known to be well typed, without the frozen dataclass's
    per-field ``object.__setattr__`` (a 50k-tensor header builds 50k of them)."""
    lay = object.__new__(TensorLayout)
    lay.__dict__.update(offset=offset, nbytes=nbytes, dtype=dtype, shape=shape, checksum=checksum)
    return lay


def plan_layout(specs: Sequence[Tuple[torch.dtype, Tuple[int, ...]]]) -> Tuple[List[TensorLayout], int]:
    """Offsets for tensors of the given dtype/shape (layouts in the given order); total bytes.

    Tensors of one dtype are packed densely in their order, each dtype's run starting at an
    ``ALIGN`` boundary: a run is one flat typed region, so staging makes all its views and
    copies in one call each (:func:`dense_runs`) instead of a few Python calls per tensor."""
    layouts, total, _runs = plan_layout_runs(specs)
    return layouts, total


def plan_layout_runs(
    specs: Sequence[Tuple[torch.dtype, Tuple[int, ...]]],
) -> Tuple[List[TensorLayout], int, List["DenseRun"]]:
    """:func:`plan_layout` and its :func:`dense_runs`, computed together."""
    out: List[Optional[TensorLayout]] = [None] * len(specs)
    by_dtype: Dict[torch.dtype, List[int]] = {}
    for i, (dtype, _shape) in enumerate(specs):
        by_dtype.setdefault(dtype, []).append(i)
    runs: List[DenseRun] = []
    pos = 0
    for dtype, idxs in by_dtype.items():
        name = str(dtype).replace("torch.", "")
        size = dtype.itemsize
        start = pos
        nonempty = []
        for i in idxs:
            shape = tuple(specs[i][1])
            n = size * math.prod(shape)
            out[i] = new_layout(pos, n, name, shape)
            pos += n
            if n:
                nonempty.append(i)
        if nonempty:
            runs.append(DenseRun(start, pos - start, dtype, tuple(nonempty)))
        pos = (pos + ALIGN - 1) // ALIGN * ALIGN
    return out, pos, runs  # type: ignore[return-value]


@dataclass(frozen=True)
class DenseRun:
    """Tensors (indexes into a layout list, in offset order) packed back to back from
    ``offset``: one flat region of ``dtype``."""

    offset: int
    nbytes: int
    dtype: torch.dtype
    indexes: Tuple[int, ...]


def dense_runs(layouts: Sequence[TensorLayout]) -> List[DenseRun]:
    """The layouts grouped into maximal back-to-back runs of one dtype (empty tensors left
    out: there is nothing to copy). Works for any layout; :func:`plan_layout`'s has one run
    per dtype."""
    order = sorted((lay.offset, i) for i, lay in enumerate(layouts) if lay.nbytes)
    runs: List[DenseRun] = []
    start = end = 0
    dtype = None
    idxs: List[int] = []
    for off, i in order:
        lay = layouts[i]
        if idxs and (off != end or lay.dtype != dtype):
            runs.append(DenseRun(start, end - start, layouts[idxs[0]].torch_dtype, tuple(idxs)))
            idxs = []
        if not idxs:
            start, dtype = off, lay.dtype
        idxs.append(i)
        end = off + lay.nbytes
    if idxs:
        runs.append(DenseRun(start, end - start, layouts[idxs[0]].torch_dtype, tuple(idxs)))
    return runs


class Segment:
    """A data file mapped read-write: where staging copies land.

    ``buffer`` is a 1-D uint8 tensor over the mapping; ``tensor(layout)`` views one tensor.
    """

    def __init__(self, path: Path, nbytes: int, populate: bool = True):
        self.path = path
        self.nbytes = nbytes
        self._fd = os.open(path, os.O_RDWR)
        self._mmap: Optional[mmap.mmap] = None
        self.buffer: torch.Tensor
        if nbytes:
            flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate and hasattr(mmap, "MAP_POPULATE") else 0)
            self._mmap = mmap.mmap(self._fd, nbytes, flags=flags)
            self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        else:
            self.buffer = torch.empty(0, dtype=torch.uint8)
        self.pinned = False
        self._pin_lock = threading.Lock()
        self._views: Optional[Tuple[Any, List[Any]]] = None

    def keep_views(self, runs: Any, views: List[Any]) -> None:
        """Remember staging's destination views for ``runs`` (made ahead by the prefetcher)."""
        self._views = (runs, views)

    def views_for(self, runs: Any) -> Optional[List[Any]]:
        """The views kept for exactly this ``runs`` object, if any."""
        kept = self._views
        return kept[1] if kept is not None and kept[0] is runs else None

    def tensor(self, layout: TensorLayout) -> torch.Tensor:
        return (
            self.buffer[layout.offset : layout.offset + layout.nbytes]
            .view(layout.torch_dtype)
            .view(layout.shape)
        )

    def release_pages(self, offset: int, nbytes: int) -> None:
        """Drop ``[offset, offset + nbytes)`` from this process's page tables (MADV_DONTNEED on
        a shared file mapping: the bytes stay in the store, the process's resident set shrinks;
        touching them again maps them back). No-op while page-locked for CUDA."""
        if self._mmap is None or self.pinned or nbytes <= 0 or not hasattr(mmap, "MADV_DONTNEED"):
            return
        page = mmap.PAGESIZE
        start = offset // page * page
        end = min(self.nbytes, -(-(offset + nbytes) // page) * page)
        if end > start:
            self._mmap.madvise(mmap.MADV_DONTNEED, start, end - start)

    def populate_pages(self, offset: int, nbytes: int) -> None:
        """Map ``[offset, offset + nbytes)`` into this process's page tables now
        (MADV_POPULATE_WRITE, Linux >= 5.14; else a no-op): writing into populated pages runs
        ~2x faster than taking a fault per 4 KiB page (measured: gloo receives at 1.9 vs 1.0
        GiB/s)."""
        if self._mmap is None or nbytes <= 0 or offset >= self.nbytes:
            return
        page = mmap.PAGESIZE
        start = offset // page * page
        end = min(self.nbytes, -(-(offset + nbytes) // page) * page)
        try:
            self._mmap.madvise(_MADV_POPULATE_WRITE, start, end - start)
        except (OSError, ValueError):
            pass  # older kernel: pages fault in on first write instead

    def pin(self) -> bool:
        """Page-lock the mapping for CUDA (D2H copies land here directly, asynchronously);
        returns whether it is pinned (see :func:`pinning.register`: measured on an H200, a file
        on a disk file system, not tmpfs, cannot be). Slow: callers do it off the critical path
        (the prefetcher's thread) and keep the segment mapped across saves."""
        with self._pin_lock:  # the prefetcher's and the save thread's may meet here
            if not self.pinned and self.nbytes and self._mmap is not None:
                self.pinned = pinning.register(self.buffer, str(self.path.parent.parent))
        return self.pinned

    def close(self) -> None:
        with self._pin_lock:
            if self.pinned:
                pinning.unregister(self.buffer)
                self.pinned = False
        # Never munmap explicitly: torch.frombuffer views keep a reference to the mmap object
        # but hold no buffer export, so mmap.close() would succeed under a live view and leave
        # it dangling (a later read segfaults). Dropping our references unmaps the segment as
        # soon as the last view is gone — at once in the normal case.
        self._views = None
        self.buffer = torch.empty(0, dtype=torch.uint8)
        self._mmap = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        with contextlib.suppress(Exception):
            self.close()


class CheckpointReader:
    """Read access to one published checkpoint (header verified)."""

    def __init__(self, header: CheckpointHeader, data_path: Path):
        self.header = header
        self.path = data_path
        size = data_path.stat().st_size
        if size < header.data_nbytes:
            raise CorruptCheckpointError(
                f"{data_path}: {size} bytes on disk, header says {header.data_nbytes} (truncated)"
            )

    def read_into(self, dests: Sequence[torch.Tensor], verify: bool = True) -> List[int]:
        """Copy every tensor into ``dests`` (CPU, contiguous). Returns indices failing checksum."""
        bad = []
        with open(self.path, "rb", buffering=0) as f:
            fd = f.fileno()
            for i, (lay, dst) in enumerate(zip(self.header.tensors, dests)):
                if lay.nbytes == 0:
                    continue
                view = checksum.byte_view(dst)
                got = _pread_full(fd, view, lay.offset)
                if got != lay.nbytes:
                    raise CorruptCheckpointError(f"{self.path}: short read of tensor {i}")
                if verify and lay.checksum is not None and checksum.digest(view) != lay.checksum:
                    bad.append(i)
        return bad

    def map(self, populate: bool = False) -> Tuple[mmap.mmap, torch.Tensor]:
        """Read-only mapping of the segment (the caller must not keep views past retention;
        writing through a view faults). ``populate`` maps every page up front (one kernel pass
        instead of a fault per 4 KiB page when all of it will be read)."""
        return map_readonly(self.path, self.header.data_nbytes, populate)

    def read_range(self, offset: int, out: memoryview) -> None:
        with open(self.path, "rb", buffering=0) as f:
            if _pread_full(f.fileno(), out, offset) != len(out):
                raise CorruptCheckpointError(f"{self.path}: short read at {offset}")

    def verify(self) -> List[int]:
        """Indices of tensors whose bytes fail their checksum (reads through a mapping)."""
        if not self.header.data_nbytes:
            return []
        m, buf = self.map()
        try:
            mv = memoryview(m)
            bad = failed_tensors(self.header, mv)
            mv.release()
            return bad
        finally:
            del buf
            m.close()


def failed_tensors(header: CheckpointHeader, data: memoryview) -> List[int]:
    """Indices of ``header``'s tensors whose bytes in ``data`` (the checkpoint's segment, or
    a copy of it) fail their checksum."""
    digest = checksum.digest
    return [
        i
        for i, lay in enumerate(header.tensors)
        if lay.checksum is not None and digest(data[lay.offset : lay.offset + lay.nbytes]) != lay.checksum
    ]


def map_readonly(path: Path, nbytes: int, populate: bool = False) -> Tuple[Optional[mmap.mmap], torch.Tensor]:
    """A read-only shared mapping of ``nbytes`` of a store file, as a uint8 tensor (no
    mapping, an empty tensor, for 0 bytes: mmap refuses empty lengths)."""
    if not nbytes:
        return None, torch.empty(0, dtype=torch.uint8)
    flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate and hasattr(mmap, "MAP_POPULATE") else 0)
    with open(path, "rb") as f:
        m = mmap.mmap(f.fileno(), nbytes, flags=flags, prot=mmap.PROT_READ)
    with warnings.catch_warnings():
        # torch warns that the mapping is read-only; callers only read (send, verify) it.
        warnings.simplefilter("ignore", UserWarning)
        return m, torch.frombuffer(m, dtype=torch.uint8)


def _pread_full(fd: int, view: memoryview, offset: int) -> int:
    done = 0
    n = len(view)
    while done < n:
        got = os.preadv(fd, [view[done:]], offset + done)
        if got <= 0:
            break
        done += got
    return done


class CheckpointStore:
    """One node's holder for one session (job). Safe for several processes of a node."""

    def __init__(
        self,
        root: str | os.PathLike = DEFAULT_ROOT,
        session: str = "default",
        world_size: Optional[int] = None,
        memory_budget: Optional[int] = None,
    ):
        validate_session_id(session)
        self.root = Path(root)
        self.session = session
        self.world_size = world_size
        self.memory_budget = memory_budget
        self.dir = self.root / session
        self.free_dir = self.dir / "free"
        try:
            self.free_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise StoreError(
                f"cannot create the store directory {self.free_dir}: {e}; fix: point store_root at "
                "a writable tmpfs directory (default /dev/shm/resilient_ckpt)"
            ) from e
        for d in (self.dir, self.free_dir):
            if d.is_symlink():
                raise StoreError(
                    f"{d} is a symbolic link (to {os.readlink(d)}); the store never follows links "
                    "out of its root. Fix: remove the link (or point store_root at the real "
                    "directory)"
                )
        self._lock_path = self.dir / ".lock"
        # Parsed headers by path, valid while the file is the same one (inode, size, mtime):
        # a restore reads each header several times (holdings, checks, retrieval, decode), and
        # one of a 50k-tensor checkpoint takes ~0.5 s to parse. Published headers are never
        # rewritten in place (a new one is renamed over it: a new inode).
        self._parsed: "collections.OrderedDict[Path, Tuple[Tuple[int, int, int], CheckpointHeader]]" = (
            collections.OrderedDict()
        )
        self._parsed_lock = threading.Lock()
        _warn_if_small_shm(self.root)

    # ---- locking -------------------------------------------------------------------------

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        fd = os.open(self._lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            # A child forked meanwhile must not keep the node's store locked after we close.
            fork_safe_locks.hold(fd, str(self._lock_path))
            yield
        finally:
            fork_safe_locks.release(fd)
            os.close(fd)  # releases the lock, also when this process is killed

    # ---- paths -----------------------------------------------------------------------------

    def data_path(self, cid: CheckpointId) -> Path:
        return self.dir / f"{cid.stem()}.data"

    def header_path(self, cid: CheckpointId) -> Path:
        return self.dir / f"{cid.stem()}.hdr"

    def _id(self, iteration: int, owner: int) -> CheckpointId:
        return CheckpointId(int(iteration), int(owner), self.session)

    # ---- space -----------------------------------------------------------------------------

    def usage(self) -> Dict[str, int]:
        """Bytes held: published data, free pool, total, what the store occupies; and the
        filesystem's free bytes."""
        data, free, occupied = self._sizes()
        st = os.statvfs(self.dir)
        return {
            "data_bytes": data,
            "free_pool_bytes": free,
            "total_bytes": data + free,
            "store_bytes": occupied,
            "fs_free_bytes": st.f_bavail * st.f_frsize,
            "fs_total_bytes": st.f_blocks * st.f_frsize,
        }

    def store_bytes(self) -> int:
        """Host memory this session's store occupies on the node: allocated blocks
        (``st_blocks``) of every file in it — own data, replicas, parity, headers, the free
        pool and reservations (a segment being filled counts only the pages it has)."""
        return self._sizes()[2]

    def _sizes(self) -> Tuple[int, int, int]:
        """(bytes of ``.data`` files, bytes of the free pool, allocated bytes of every file):
        one lstat per file."""
        data = free = occupied = 0
        for d in (self.dir, self.free_dir):
            for p in _entries(d):
                try:
                    st = os.lstat(p)
                except FileNotFoundError:
                    continue
                if not stat.S_ISREG(st.st_mode):
                    continue
                occupied += st.st_blocks * 512
                if d is self.free_dir:
                    free += st.st_size
                elif p.suffix == ".data":
                    data += st.st_size
        return data, free, occupied

    def _preflight(self, need: int, candidate: Optional[Path] = None) -> None:
        """Raise StoreFullError, before anything is written, if ``need`` bytes do not fit.

        ``candidate`` is the pooled segment the write will reuse; other idle pooled segments are
        released first when the budget would otherwise be exceeded (never a stored checkpoint).
        """
        reusable = _size(candidate) if candidate is not None else 0
        fresh = max(0, need - reusable)
        u = self.usage()
        if self.memory_budget is not None and u["total_bytes"] + fresh > self.memory_budget:
            self.trim_free_pool(locked=True, spare=candidate)
            u = self.usage()
        if self.memory_budget is not None and u["total_bytes"] + fresh > self.memory_budget:
            raise StoreFullError(
                f"a checkpoint segment of {_human(need)} would bring store {self.dir} to "
                f"{_human(u['total_bytes'] + fresh)} ({_human(u['data_bytes'])} in stored "
                f"checkpoints, {_human(u['free_pool_bytes'])} in reusable segments), over its "
                f"memory budget of {_human(self.memory_budget)}; nothing was written or removed. "
                "Fix: raise memory_budget (at least (keep_last + 1) x (own + replicated bytes) "
                "per node), lower keep_last, or save fewer bytes per rank"
            )
        if fresh > u["fs_free_bytes"]:
            raise StoreFullError(
                f"a checkpoint segment needs {_human(fresh)} more in {self.root} but only "
                f"{_human(u['fs_free_bytes'])} of {_human(u['fs_total_bytes'])} is free; nothing "
                "was written or removed. Fix: enlarge the shared-memory filesystem (docker run "
                "--shm-size, Kubernetes emptyDir medium: Memory with sizeLimit), lower keep_last, "
                "or point store_root at a larger tmpfs"
            )

    # ---- write path ----------------------------------------------------------------------------

    def reserve(self, nbytes: int, populate: bool = True) -> Segment:
        """A mapped, writable segment of ``nbytes`` not yet tied to a checkpoint.

        Recycled from the free pool when possible (no new pages), else fallocated. Reserved
        files are invisible to other processes' pools. Raises StoreFullError (nothing written
        or removed) if space or budget is short.
        """
        path = self.free_dir / f"rsv_{os.getpid()}_{time.time_ns()}_{next(_UNIQUE)}.data"
        with self._locked():
            candidate = self._pick_free(nbytes)
            self._preflight(nbytes, candidate)
            if candidate is not None:
                os.replace(candidate, path)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            if size > nbytes:
                os.ftruncate(fd, nbytes)
            elif size < nbytes:
                try:
                    os.posix_fallocate(fd, 0, nbytes)
                except OSError as e:
                    os.close(fd)
                    fd = -1
                    with contextlib.suppress(FileNotFoundError):
                        path.unlink()
                    if e.errno == errno.ENOSPC:
                        raise StoreFullError(
                            f"out of space allocating {_human(nbytes)} in {self.root}; nothing "
                            "stored was removed. Fix: enlarge the shared-memory filesystem "
                            "(docker run --shm-size, Kubernetes emptyDir medium: Memory) or "
                            "lower keep_last"
                        ) from e
                    raise StoreError(f"cannot allocate {_human(nbytes)} in {self.root}: {e}") from e
        finally:
            if fd >= 0:
                os.close(fd)
        return Segment(path, nbytes, populate=populate)

    def claim(self, segment: Segment, iteration: int, owner: int) -> CheckpointId:
        """Give a reserved segment its checkpoint name (the mapping stays valid)."""
        cid = self._id(iteration, owner)
        if self.header_path(cid).exists():
            try:
                self.read_header(cid)
            except (ForeignCheckpointError, CorruptCheckpointError) as e:
                raise StoreError(
                    f"cannot store {cid.stem()} in {self.dir}: a checkpoint this build cannot use "
                    f"holds that name ({e}). Fix: remove it (`resilient-ckpt drop`, or delete "
                    f"{self.header_path(cid)}) or use another session id"
                ) from e
            except StoreError:
                pass  # removed meanwhile: the claim below goes ahead
            else:
                raise StoreError(
                    f"checkpoint {cid.stem()} is already published in {self.dir}; iterations must "
                    "increase (discard it first to overwrite)"
                )
        target = self.data_path(cid)
        os.replace(segment.path, target)
        segment.path = target
        return cid

    def release(self, segment: Segment, recycle: bool = True) -> None:
        """Return an unpublished segment to the pool (a save that failed before publish, a
        spare not needed), or free its memory (``recycle=False``)."""
        segment.close()
        if not recycle:
            with contextlib.suppress(FileNotFoundError):
                segment.path.unlink()
        elif segment.path.exists():
            with self._locked():
                with contextlib.suppress(FileNotFoundError):
                    os.replace(segment.path, self._pool_name())

    def allocate(self, iteration: int, owner: int, nbytes: int, populate: bool = True) -> Segment:
        seg = self.reserve(nbytes, populate=populate)
        try:
            self.claim(seg, iteration, owner)
        except BaseException:
            self.release(seg)
            raise
        return seg

    def _pool_name(self) -> Path:
        return self.free_dir / f"seg_{os.getpid()}_{time.time_ns()}_{next(_UNIQUE)}.data"

    def _pick_free(self, nbytes: int) -> Optional[Path]:
        """Smallest pooled segment that fits, else the largest (grown by fallocate)."""
        best = None
        best_size = -1
        for p in _pool_files(self.free_dir, "seg_"):
            s = _size(p)
            if best is None:
                better = True
            elif s >= nbytes:
                better = best_size < nbytes or s < best_size
            else:
                better = best_size < nbytes and s > best_size
            if better:
                best, best_size = p, s
        return best

    def publish(self, segment: Segment, header: CheckpointHeader) -> CheckpointId:
        """Make the checkpoint visible: header written under a temp name, then renamed."""
        cid = header.id
        if cid.session != self.session:
            raise StoreError(f"header session {cid.session!r} does not match store {self.session!r}")
        if segment.path != self.data_path(cid):
            raise StoreError(f"segment {segment.path} does not belong to {cid.stem()}")
        self.write_header(header)
        return cid

    def write_header(self, header: CheckpointHeader) -> None:
        path = self.header_path(header.id)
        st = self._publish_header(header.id, header.pack())
        if header.created_ns and header.writer:
            # What a read of this file would parse (the fields pack fills in are set): later
            # reads of it (retention, restore) need not parse 50k tensor entries again.
            self._remember_parsed(path, (st.st_ino, st.st_size, st.st_mtime_ns), header)

    def write_raw_header(self, raw: bytes, expect: CheckpointId) -> CheckpointHeader:
        """Publish a header received from a peer after checking it describes ``expect``."""
        header = CheckpointHeader.unpack(raw, source=f"replica header for {expect.stem()}")
        if header.id != expect:
            raise CorruptCheckpointError(f"replica header describes {header.id}, expected {expect}")
        self.write_header(header)
        return header

    # ---- read path ---------------------------------------------------------------------------

    def list(self) -> List[CheckpointId]:
        """Published checkpoints of this session (headers present), sorted."""
        out = []
        for p in _entries(self.dir):
            m = _NAME.match(p.name)
            if m and m.group(3) == "hdr":
                if _regular(p):
                    out.append(self._id(int(m.group(1)), int(m.group(2))))
                elif os.path.lexists(p):  # else retired meanwhile (another rank of the node)
                    _ignore(p, "a checkpoint name on something that is not a regular file")
            elif not (
                p.name in ("free", ".lock")
                or _NAME.match(p.name)
                or _PARITY_NAME.match(p.name)
                or p.name.startswith(".")
            ):
                _ignore(p, "not a file this store writes")
        return sorted(out)

    def list_parity(self) -> List[ParityId]:
        """Published parity files of this session (headers present), sorted."""
        out = []
        for p in _entries(self.dir):
            m = _PARITY_NAME.match(p.name)
            if m and m.group(3) == "hdr" and _regular(p):
                out.append(ParityId(int(m.group(1)), int(m.group(2)), self.session))
        return sorted(out)

    def claim_parity(self, segment: Segment, pid: ParityId) -> None:
        """Give a reserved segment a parity file's name (one left by an abandoned save of the
        same iteration is replaced: parity is recomputed by every save)."""
        self.discard(pid)
        target = self.data_path(pid)
        os.replace(segment.path, target)
        segment.path = target

    def write_parity_header(self, raw: bytes, pid: ParityId) -> None:
        self._publish_header(pid, raw)

    def _publish_header(self, fid: Any, raw: bytes) -> os.stat_result:
        """Write a header under a temporary name and rename it into place (a reader sees
        all of it or nothing); returns the written file's stat."""
        tmp = self.dir / f".{fid.stem()}.hdr.{os.getpid()}.tmp"
        with open(tmp, "wb") as f:
            f.write(raw)
            st = os.fstat(f.fileno())
        os.replace(tmp, self.header_path(fid))
        return st

    def read_parity_header(self, pid: ParityId) -> Dict[str, Any]:
        """The parity header's fields (verified envelope, magic, version, session, id)."""
        path = self.header_path(pid)
        try:
            raw = path.read_bytes()
        except FileNotFoundError:
            raise StoreError(f"no parity file {pid.stem()} in {self.dir}") from None
        d = unpack_envelope(raw, str(path), PARITY_MAGIC)
        if d.get("session") != self.session or (d.get("iteration"), d.get("holder")) != (
            pid.iteration,
            pid.holder,
        ):
            raise CorruptCheckpointError(f"{path} does not describe {pid.stem()} of session {self.session!r}")
        return d

    def read_header(self, cid: CheckpointId) -> CheckpointHeader:
        path = self.header_path(cid)
        header = self.read_header_any_world(cid)
        if self.world_size is not None and header.world_size != self.world_size:
            raise ForeignCheckpointError(
                f"{path} was written by a job of world size {header.world_size}, this job has "
                f"{self.world_size}; it cannot be restored here (restore with the original world "
                "size, or drop the store with `resilient-ckpt drop`)"
            )
        return header

    def read_header_any_world(self, cid: CheckpointId) -> CheckpointHeader:
        """:meth:`read_header` without the world-size filter (a checkpoint of another world
        size is restored resharded); parsed at most once per file, like every header."""
        path = self.header_path(cid)
        try:
            header = self._parse_header(path)
        except FileNotFoundError:
            raise StoreError(f"no checkpoint {cid.stem()} in {self.dir}") from None
        if header.session != self.session:
            raise ForeignCheckpointError(
                f"{path} belongs to session {header.session!r}, this store serves session "
                f"{self.session!r}; it is not loaded (restore it with session_id="
                f"{header.session!r}, or remove the file)"
            )
        if header.id != cid:
            raise CorruptCheckpointError(
                f"{path} describes {header.id.stem()} (file name and header disagree); it is not loaded"
            )
        return header

    def _parse_header(self, path: Path) -> CheckpointHeader:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            key = (st.st_ino, st.st_size, st.st_mtime_ns)
            with self._parsed_lock:  # the save thread and the caller's thread share the store
                hit = self._parsed.get(path)
                if hit is not None and hit[0] == key:
                    self._parsed.move_to_end(path)
                    return hit[1]
            header = CheckpointHeader.unpack(f.read(), source=str(path))
        self._remember_parsed(path, key, header)
        return header

    def _remember_parsed(self, path: Path, key: tuple, header: CheckpointHeader) -> None:
        with self._parsed_lock:
            self._parsed[path] = (key, header)
            self._parsed.move_to_end(path)
            while len(self._parsed) > _PARSED_HEADERS:
                self._parsed.popitem(last=False)

    def open(self, cid: CheckpointId) -> CheckpointReader:
        header = self.read_header(cid)
        try:
            return CheckpointReader(header, self.data_path(cid))
        except FileNotFoundError:
            raise CorruptCheckpointError(
                f"{self.data_path(cid)} is missing although its header is published"
            ) from None

    def other_sessions(self) -> List[str]:
        """Sessions under the same root that hold published checkpoints (for diagnostics)."""
        out = []
        with contextlib.suppress(OSError):
            for d in self.root.iterdir():
                if d.name == self.session or d.is_symlink() or not d.is_dir():
                    continue
                with contextlib.suppress(OSError):
                    if any(_NAME.match(p.name) and p.suffix == ".hdr" for p in d.iterdir()):
                        out.append(d.name)
        return sorted(out)

    # ---- retire ------------------------------------------------------------------------------

    def discard(self, cid: CheckpointId, recycle: bool = True) -> None:
        """Unpublish (header first, so no reader takes it as complete) and recycle the data."""
        with contextlib.suppress(FileNotFoundError):
            self.header_path(cid).unlink()
        data = self.data_path(cid)
        if not data.exists():
            return
        if recycle:
            with self._locked():
                with contextlib.suppress(FileNotFoundError):
                    os.replace(data, self._pool_name())
        else:
            with contextlib.suppress(FileNotFoundError):
                data.unlink()

    def unpublish_mapped(self, cid: CheckpointId, segment: Segment) -> bool:
        """Retire ``cid`` whose data ``segment`` this process still maps: header removed, data
        renamed to a reservation of this process (other processes' pools never take it) and
        the segment moved with it, ready to be written again. False (nothing done but the
        header) if its data is gone."""
        with contextlib.suppress(FileNotFoundError):
            self.header_path(cid).unlink()
        path = self.free_dir / f"rsv_{os.getpid()}_{time.time_ns()}_{next(_UNIQUE)}.data"
        try:
            os.replace(self.data_path(cid), path)
        except FileNotFoundError:
            return False
        segment.path = path
        return True

    def retain(
        self, keep_iterations: Iterable[int], owners: Optional[Iterable[int]] = None
    ) -> List[CheckpointId]:
        """Discard checkpoints (of ``owners``, default all) whose iteration is not kept."""
        keep = set(keep_iterations)
        owner_set = None if owners is None else set(owners)
        dropped = []
        for cid in self.list():
            if cid.iteration not in keep and (owner_set is None or cid.owner in owner_set):
                self.discard(cid)
                dropped.append(cid)
        return dropped

    def sweep_orphans(self, in_flight: Iterable[CheckpointId] = ()) -> None:
        """Data files without a header (a crashed save) go to the free pool."""
        busy = {self.data_path(c) for c in in_flight}
        published = {self.data_path(c) for c in [*self.list(), *self.list_parity()]}
        with contextlib.suppress(FileNotFoundError):
            for p in self.dir.iterdir():
                m = _NAME.match(p.name) or _PARITY_NAME.match(p.name)
                if m and m.group(3) == "data" and p not in published and p not in busy and _regular(p):
                    logger.info("recycling %s: data without a header (a save that did not finish)", p)
                    with self._locked():
                        with contextlib.suppress(FileNotFoundError):
                            os.replace(p, self._pool_name())
                elif p.name.endswith(".tmp") and p.name.startswith("."):
                    # A header being written when its process died: never published, remove.
                    pid = p.name.rsplit(".", 2)[-2]
                    if pid.isdigit() and not _pid_alive(int(pid)):
                        with contextlib.suppress(FileNotFoundError):
                            p.unlink()
        # Reservations of processes that died (SIGKILL mid-save) go back to the pool too.
        for p in _pool_files(self.free_dir, "rsv_"):
            pid = p.name.split("_")[1]
            if not pid.isdigit():
                _ignore(p, "a reservation name without a process id")
            elif not _pid_alive(int(pid)):
                with self._locked():
                    with contextlib.suppress(FileNotFoundError):
                        os.replace(p, self._pool_name())

    def trim_free_pool(self, keep_bytes: int = 0, locked: bool = False, spare: Optional[Path] = None) -> int:
        """Release pooled segments beyond ``keep_bytes``; returns bytes released.

        ``spare`` (a segment about to be reused) is never released nor counted.
        """
        released = 0
        with contextlib.nullcontext() if locked else self._locked():
            files = sorted((p for p in _pool_files(self.free_dir, "seg_") if p != spare), key=_size)
            total = sum(_size(p) for p in files)
            for p in reversed(files):
                if total <= keep_bytes:
                    break
                s = _size(p)
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                total -= s
                released += s
        return released

    def destroy(self) -> None:
        """Remove this session's store entirely (operator action)."""
        shutil.rmtree(self.dir, ignore_errors=True)


# ---- robust scanning -----------------------------------------------------------------------
# A store root is shared with operators and other jobs: anything this store did not write
# (a stray file, a directory where a segment should be, a symbolic link) is ignored and
# logged once, never followed and never a reason to fail — so every node reaches the same
# outcome whatever lies in its store.

_IGNORED: set = set()
_SESSION = re.compile(r"^[A-Za-z0-9_+=@:-][A-Za-z0-9._+=@:-]{0,199}$")


class InvalidSessionError(StoreError, ValueError):
    """A session id that cannot name a store directory."""


def validate_session_id(session: object) -> str:
    """A session id names a directory of the store root: 1-200 characters of letters,
    digits and ``. _ + = @ : -``, not starting with a dot (no path separators, no NUL)."""
    if not isinstance(session, str) or not _SESSION.match(session):
        raise InvalidSessionError(
            f"invalid session id {session!r}: use a plain name of 1-200 letters, digits and "
            "'._+=@:-' that does not start with '.' (no '/', no NUL, not empty) — e.g. the job's "
            "name or its scheduler id"
        )
    return session


def _entries(d: Path) -> List[Path]:
    try:
        return list(d.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []


def _regular(p: Path) -> bool:
    """A regular file, not followed through a link."""
    try:
        return stat.S_ISREG(os.lstat(p).st_mode)
    except FileNotFoundError:
        return False


def _pool_files(free_dir: Path, prefix: str) -> List[Path]:
    out = []
    for p in _entries(free_dir):
        if not p.name.startswith(prefix):
            continue
        if _regular(p):
            out.append(p)
        elif p.exists() or p.is_symlink():
            _ignore(p, "not a regular file")
    return out


def _ignore(p: Path, why: str) -> None:
    if str(p) not in _IGNORED:
        _IGNORED.add(str(p))
        logger.warning("ignoring %s in the checkpoint store: %s (remove it to silence this)", p, why)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except FileNotFoundError:
        return 0


def _human(n: int) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1, plus the exact count."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit} ({n} bytes)"
    return f"{n} bytes"


_WARNED_SMALL = set()


def _warn_if_small_shm(root: Path) -> None:
    try:
        st = os.statvfs(root)
    except OSError:
        return
    total = st.f_blocks * st.f_frsize
    if total < SMALL_SHM_BYTES and str(root) not in _WARNED_SMALL:
        _WARNED_SMALL.add(str(root))
        logger.warning(
            "store root %s is on a filesystem of only %s (containers default /dev/shm to 64 MiB); "
            "checkpoints larger than that will fail: run the container with --shm-size, or mount "
            "an emptyDir with medium: Memory, or set store_root to a larger tmpfs",
            root,
            _human(total),
        )
