"""What a stored checkpoint is on disk: its file names, its header, and where each tensor
lies in its data segment. Pure format, no file I/O (:mod:`.store` manages the files).

- **Names**, the one codec of them: :meth:`CheckpointId.stem` / :meth:`ParityId.stem` write
  ``iter_{iteration:020d}.owner_{owner:06d}`` (a rank's checkpoint) and
  ``iter_{iteration:020d}.parity_{holder:06d}`` (the parity blocks a rank keeps), each with a
  ``.data`` and a ``.hdr`` file; :func:`parse_name` reads any of them back.
- **Headers**: :class:`CheckpointHeader` (and the parity header's fields) inside the
  checksummed msgpack envelope (:func:`pack_envelope` / :func:`unpack_envelope`) of store
  format :data:`FORMAT_VERSION` (``docs/storage.md``).
- **Tensor layout**: :func:`plan_layout` packs the tensors of each dtype densely from an
  :data:`ALIGN` boundary; :func:`dense_runs` lists the flat runs staging copies in one call each.
"""

from __future__ import annotations

import math
import os
import re
import socket
import time
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import msgpack
import torch

from ..errors import CorruptCheckpointError, ForeignCheckpointError
from ..gc_pause import paused_gc
from ..model.mapping import TORCH_DTYPES, dtype_name
from . import checksum

FORMAT_VERSION = 1
MAGIC = "resilient_ckpt/store"
PARITY_MAGIC = "resilient_ckpt/parity"
ALIGN = 256
_MAX_HEADER_BYTES = 1 << 30

# ---- file names ------------------------------------------------------------------------------

#: the kinds of checkpoint file: a rank's own checkpoint, the parity blocks a rank keeps
OWNER = "owner"
PARITY = "parity"
_FILE_NAME = re.compile(r"^iter_(\d{20})\.(owner|parity)_(\d{6})\.(data|hdr)$")


class FileName(NamedTuple):
    """A checkpoint or parity file's name, parsed (:func:`parse_name`)."""

    kind: str  # OWNER (a CheckpointId's files) or PARITY (a ParityId's)
    iteration: int
    rank: int  # the owner, or the parity holder
    suffix: str  # "data" or "hdr"


def file_stem(kind: str, iteration: int, rank: int) -> str:
    """The name of a checkpoint's (``OWNER``) or parity blocks' (``PARITY``) files, less the
    ``.data`` / ``.hdr`` suffix."""
    return f"iter_{iteration:020d}.{kind}_{rank:06d}"


def parse_name(name: str) -> Optional[FileName]:
    """The fields of a checkpoint or parity file name (:func:`file_stem` + suffix); None for
    any other name."""
    m = _FILE_NAME.match(name)
    if m is None:
        return None
    return FileName(m.group(2), int(m.group(1)), int(m.group(3)), m.group(4))


# ---- ids, tensor layout, headers -------------------------------------------------------------


@dataclass(frozen=True, order=True)
class CheckpointId:
    iteration: int
    owner: int
    session: str

    def stem(self) -> str:
        return file_stem(OWNER, self.iteration, self.owner)

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
        return file_stem(PARITY, self.iteration, self.holder)


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
        dt = TORCH_DTYPES.get(self.dtype)  # a restore asks 50k layouts
        if dt is None:
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
        with paused_gc():  # one tuple per tensor: 50k small objects (see unpack)
            return self._pack_fields()

    def _pack_fields(self) -> bytes:
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
    """Who wrote a header: ``host:pid`` (made once per process: every save writes it, and
    ``gethostname`` is a system call that lets the save's background threads take the GIL
    from the training thread, which then waits for it)."""
    pid = os.getpid()
    if _WRITER[0] != pid:
        _WRITER[:] = [pid, f"{socket.gethostname()}:{pid}"]
    return _WRITER[1]


_WRITER: list = [None, ""]  # [pid, name]: a forked child makes its own


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
        name = dtype_name(dtype)
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


def failed_tensors(header: CheckpointHeader, data: memoryview) -> List[int]:
    """Indices of ``header``'s tensors whose bytes in ``data`` (the checkpoint's segment, or
    a copy of it) fail their checksum."""
    digest = checksum.digest
    return [
        i
        for i, lay in enumerate(header.tensors)
        if lay.checksum is not None and digest(data[lay.offset : lay.offset + lay.nbytes]) != lay.checksum
    ]
