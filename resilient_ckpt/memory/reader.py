"""Read access to the store's files: a published checkpoint (:class:`CheckpointReader`: read
into the caller's tensors, read ranges, verify, map) and read-only mappings of a data file
(:func:`map_readonly`). A reader is opened by :meth:`.store.CheckpointStore.open`, which has
verified the header first."""

from __future__ import annotations

import mmap
import warnings
from pathlib import Path
from typing import List, Optional, Sequence, Tuple

import torch

from ..errors import CorruptCheckpointError
from . import transfer
from .layout import CheckpointHeader, failed_tensors
from .transfer import Read, pread_full


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
        """Move every tensor into ``dests`` (contiguous, the stored dtype and shape; CPU, or CUDA
        — ordered before the current stream's later work) through :mod:`.transfer`, verified on
        the way unless ``verify=False``. Returns the indices failing their checksum; raises
        CorruptCheckpointError if the file ends early."""
        moved = transfer.read_into(str(self.path), self.reads(dests, verify))
        return self.check(moved)

    def reads(self, dests: Sequence[Optional[torch.Tensor]], verify: bool = True) -> List[Read]:
        """The :class:`.transfer.Read` of each stored tensor into its ``dests`` entry (None:
        not read), for moving this file's tensors together with other files'."""
        return [
            Read(lay.offset, lay.nbytes, lay.checksum if verify else None, dst, i)
            for i, (lay, dst) in enumerate(zip(self.header.tensors, dests))
            if dst is not None
        ]

    def check(self, moved: transfer.Moved) -> List[int]:
        """What :meth:`read_into` returns for a move of :meth:`reads`: the indices failing their
        checksum, after CUDA copies are ordered before the current stream's later work; raises
        CorruptCheckpointError if the file ended early."""
        if moved.short:
            raise CorruptCheckpointError(f"{self.path}: short read of tensors {moved.short[:8]}")
        moved.fence()
        return moved.failed

    def map(self, populate: bool = False) -> Tuple[mmap.mmap, torch.Tensor]:
        """Read-only mapping of the segment (the caller must not keep views past retention;
        writing through a view faults). ``populate`` maps every page up front (one kernel pass
        instead of a fault per 4 KiB page when all of it will be read)."""
        return map_readonly(self.path, self.header.data_nbytes, populate)

    def read_range(self, offset: int, out: memoryview) -> None:
        with open(self.path, "rb", buffering=0) as f:
            if pread_full(f.fileno(), out, offset) != len(out):
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
